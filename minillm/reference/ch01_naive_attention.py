"""Reference attention in NumPy (float64), the oracle for every attention kernel in the book.

Shapes follow PyTorch's SDPA layout:

- ``q``: ``[batch, q_heads, q_len, head_dim]``
- ``k``, ``v``: ``[batch, kv_heads, kv_len, head_dim]``, with ``q_heads % kv_heads == 0``
  (``kv_heads == q_heads`` is MHA, ``1`` is MQA, anything between is GQA).

Positions are *bottom-right aligned*: query ``i`` sits at absolute position
``kv_len - q_len + i``. With ``q_len == kv_len`` (prefill) that is just ``i``; with
``q_len == 1`` (decode) the single query is the newest token and sees the whole cache.
"""
from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically safe softmax: subtracting the row max leaves the result unchanged
    (it cancels between numerator and denominator) but keeps ``exp`` from overflowing.
    Rows that are entirely ``-inf`` (fully masked) give all zeros instead of NaN."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def attention_mask(q_len: int, kv_len: int, causal: bool = False, window: int | None = None) -> np.ndarray:
    """Which keys each query may attend to: a bool array ``[q_len, kv_len]`` (True = visible).

    - ``causal``: query at position ``p`` sees keys ``j <= p`` (no peeking at the future).
    - ``window=W``: query at ``p`` sees only keys with ``|p - j| < W``; combined with
      ``causal`` this is the sliding window of Mistral-style models (the last ``W`` tokens,
      itself included).
    """
    q_pos = np.arange(q_len)[:, None] + (kv_len - q_len)
    k_pos = np.arange(kv_len)[None, :]
    visible = np.ones((q_len, kv_len), dtype=bool)
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        visible &= np.abs(q_pos - k_pos) < window
    return visible


def kv_head_for(q_head: int | np.ndarray, q_heads: int, kv_heads: int):
    """The KV head that query head ``q_head`` reads under GQA: consecutive groups of
    ``q_heads // kv_heads`` query heads share one KV head (the layout of Llama and HF)."""
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    return q_head // (q_heads // kv_heads)


def attention_scores(q: np.ndarray, k: np.ndarray, causal: bool = False, scale: float | None = None,
                     window: int | None = None) -> np.ndarray:
    """The masked, scaled score matrix ``S = scale · q kᵀ`` with ``-inf`` at hidden keys.

    ``q: [batch, q_heads, q_len, head_dim]``, ``k: [batch, kv_heads, kv_len, head_dim]``
    -> ``[batch, q_heads, q_len, kv_len]`` float64. ``scale`` defaults to ``1/sqrt(head_dim)``.
    """
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    q_heads, q_len, head_dim = q.shape[1:]
    kv_heads, kv_len = k.shape[1:3]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    k = k[:, kv_head_for(np.arange(q_heads), q_heads, kv_heads)]  # the KV head each q head reads
    scores = scale * (q @ np.swapaxes(k, -1, -2))
    return np.where(attention_mask(q_len, kv_len, causal, window), scores, -np.inf)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention, computed the textbook way in float64.

    Returns ``(out, lse)``:

    - ``out``: ``[batch, q_heads, q_len, head_dim]`` = softmax(scale · q kᵀ + mask) v
    - ``lse``: ``[batch, q_heads, q_len]``, the log-sum-exp of each masked score row
      (``-inf`` for a row with no visible key, whose output is 0). Later chapters need it:
      FlashAttention's backward and flash-decoding's split merge both work from it.
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    batch, q_heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    scores = attention_scores(q, k, causal, scale, window)  # [batch, q_heads, q_len, kv_len]
    v = v[:, kv_head_for(np.arange(q_heads), q_heads, kv_heads)]  # the KV head each q head reads

    row_max = np.max(scores, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    row_sum = np.sum(np.exp(scores - row_max), axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (row_max + np.log(row_sum))[..., 0]
    probs = softmax(scores, axis=-1)
    return probs @ v, lse
