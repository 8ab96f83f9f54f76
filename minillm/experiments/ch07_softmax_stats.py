"""Chapter 7: what a real model's softmax inputs look like, to choose FlashDecoding++'s φ.

FlashDecoding++'s *asynchronized softmax* (Hong et al., 2023, arXiv 2311.01282) replaces the
running maximum of the online softmax by one constant φ, fixed per model: every partial
softmax computes ``exp(s - φ)`` and partial results add up without rescaling. That is exact
(softmax is invariant to the constant subtracted) as long as ``exp(s - φ)`` neither overflows
nor underflows in the precision it is computed and multiplied in, i.e. as long as the scores
stay inside a window ``[φ + lo, φ + hi]`` around φ. The paper picks φ from statistics of the
softmax inputs of each model (for Llama-2-7B most inputs fall in a range of about 20 around
their φ) and recomputes with the exact softmax when a value leaves the window.

This module measures those statistics on a `LlamaForCausalLM` (the bundled model, or any
checkpoint): it runs a forward pass, recomputes every layer's scaled scores ``s = q·k /
sqrt(head_dim)`` from the layer's inputs (a forward pre-hook, so the model code is untouched),
and records, per (layer, head, query), the largest visible score of the row. Scores here are in
natural-log units, the units of the ``phi`` argument of
`minillm.kernels.ch07_flash_decoding.flash_decode_attention`.

Why the row *maximum*: with a window ``[lo, hi]``, the dangerous cases are a row whose largest
score exceeds ``φ + hi`` (overflow of ``exp(s - φ)``) and a row whose largest score is below
``φ + lo`` (every term underflows, the row sums to ~0). Scores far below the row's maximum
underflow harmlessly: the exact softmax would give them weights below the precision anyway.
So the fraction of rows whose maximum leaves the window is the fraction of (query, head) pairs
on which the fallback has to fire (`fallback_fraction`), and `choose_phi` picks the φ that
makes it smallest.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minillm.model.torch_model import Attention, LlamaForCausalLM, apply_rope

__all__ = ["ScoreStats", "collect_score_stats", "choose_phi", "fallback_fraction"]


@dataclass
class ScoreStats:
    """Softmax-input statistics of one forward pass (causal self-attention over the prompt).

    - ``row_max: [layers, batch, heads, T]`` float64: the largest scaled score each query row
      sees (keys ``0 … t``), natural-log units;
    - ``row_min: [layers, batch, heads, T]``: the smallest;
    - ``quantiles: [layers, len(QUANTILES)]``: quantiles of all visible scores of each layer;
    - ``QUANTILES``: the quantile levels.
    """
    row_max: np.ndarray
    row_min: np.ndarray
    quantiles: np.ndarray
    QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)

    @property
    def layers(self) -> int:
        return self.row_max.shape[0]


@torch.inference_mode()
def collect_score_stats(model: LlamaForCausalLM, input_ids: torch.Tensor) -> ScoreStats:
    """Run ``model`` on ``input_ids: [batch, T]`` (no cache) and gather `ScoreStats`.

    The hook sees each `Attention` layer's inputs ``(x, cos, sin, …)`` and recomputes its
    queries and keys exactly as the layer does (projection, RoPE); scores are computed in
    float32 whatever the model's dtype."""
    c = model.config
    scale = c.head_dim ** -0.5
    per_layer: list[tuple[torch.Tensor, torch.Tensor, np.ndarray]] = []

    def hook(attn: Attention, args):
        x, cos, sin = args[0], args[1], args[2]
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin).float(), apply_rope(k, cos, sin).float()
        k = k.repeat_interleave(c.num_attention_heads // c.num_key_value_heads, dim=1)
        s = (q @ k.transpose(-1, -2)) * scale                                   # [B, H, T, T]
        visible = torch.ones(T, T, dtype=torch.bool, device=s.device).tril()
        row_max = s.masked_fill(~visible, float("-inf")).amax(-1)
        row_min = s.masked_fill(~visible, float("inf")).amin(-1)
        scores = s[:, :, visible].flatten().double().cpu().numpy()
        per_layer.append((row_max.double().cpu(), row_min.double().cpu(),
                          np.quantile(scores, ScoreStats.QUANTILES)))

    handles = [layer.self_attn.register_forward_pre_hook(hook) for layer in model.model.layers]
    try:
        model(input_ids)
    finally:
        for h in handles:
            h.remove()
    return ScoreStats(row_max=np.stack([m.numpy() for m, _, _ in per_layer]),
                      row_min=np.stack([m.numpy() for _, m, _ in per_layer]),
                      quantiles=np.stack([q for _, _, q in per_layer]))


def fallback_fraction(row_max, phi: float, lo: float, hi: float) -> float:
    """The fraction of rows whose maximum leaves ``[phi + lo, phi + hi]``: the rows on which
    the asynchronized softmax must fall back to the exact one. ``row_max``: any array."""
    m = np.asarray(row_max, dtype=np.float64).ravel()
    if m.size == 0:
        return 0.0
    return float(np.mean((m < phi + lo) | (m > phi + hi)))


def choose_phi(row_max, lo: float, hi: float) -> tuple[float, float]:
    """The φ that keeps the most row maxima inside ``[φ + lo, φ + hi]`` (``lo < 0 < hi``).

    The window has a fixed width, so the best windows are found by sliding it over the sorted
    maxima (two pointers): for each maximum as the window's lowest point, count how many fit.
    Among equally good windows we take the one whose φ lies in the middle of the optimal
    range, so that the scores of new inputs have room on both sides.
    Returns ``(phi, coverage)``, coverage being the fraction of rows inside the window."""
    if not lo < hi:
        raise ValueError(f"need lo < hi, got {lo}, {hi}")
    m = np.sort(np.asarray(row_max, dtype=np.float64).ravel())
    m = m[np.isfinite(m)]
    if m.size == 0:
        raise ValueError("no finite row maxima")
    width = hi - lo
    # Window [m[i], m[i] + width] holds m[i : end[i]]; φ = m[i] - lo puts its low edge at m[i].
    end = np.searchsorted(m, m + width, side="right")
    counts = end - np.arange(m.size)
    best = counts.max()
    starts = np.flatnonzero(counts == best)
    # The window keeps m[i] … m[end - 1] inside for every φ in [m[end - 1] - hi, m[i] - lo]
    # (low edge at or below m[i], top edge at or above m[end - 1]). Take the middle of the
    # widest such interval.
    lows = m[end[starts] - 1] - hi
    highs = m[starts] - lo
    j = int(np.argmax(highs - lows))
    phi = float((lows[j] + highs[j]) / 2)
    return phi, float(best / m.size)
