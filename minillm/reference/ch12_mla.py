"""Chapter 12: multi-head latent attention (MLA, DeepSeek-V2) in NumPy (float64), the oracle
of `minillm.kernels.ch12_mla` and of the model's MLA layer (`minillm.model.mla`).

MLA caches, per token and layer, one **latent** vector instead of per-head keys and values:

- the KV latent ``c = RMSNorm(x W_DKV)`` of width ``r = kv_lora_rank`` (512 in DeepSeek-V2),
  from which every head's key and value are *decompressed*: ``k_h^C = W_UK^h c`` (width
  ``qk_nope_head_dim``) and ``v_h = W_UV^h c`` (width ``v_head_dim``);
- a **decoupled rotary key** ``k^R = RoPE(x W_KR)`` of width ``d_R = qk_rope_head_dim`` (64),
  *shared by all heads* (an MQA key): RoPE cannot go through ``W_UK`` (below), so the
  position lives in this separate piece.

Each head's query is likewise ``[q_h^C ; q_h^R]`` (the content part ``qk_nope_head_dim`` wide,
the rotary part ``d_R``), from ``x`` directly or through a query latent of width
``q_lora_rank`` (None: no query compression, as DeepSeek-V2-Lite). A head's score is

    s_h(t, j) = (q_h^C(t) · k_h^C(j) + q_h^R(t) · k^R(j)) / sqrt(qk_nope_head_dim + d_R).

**Naive form** (`mla_naive`): decompress K and V of every cached token, then ordinary
attention. **Absorbed form** (`mla_absorbed`): ``q_h^C · (W_UK^h c_j) = (W_UK^hᵀ q_h^C) · c_j``,
so fold ``W_UK`` into the query once per query (`absorb_query`: a query of width ``r + d_R``)
and attend directly over the latent cache ``[c_j ; k^R_j]``: every head reads the *same*
``r + d_R`` numbers per token (MQA with one "KV head" 576 wide), the values are the first
``r`` of them, and ``W_UV`` is applied to each head's latent output afterwards (it could be
folded further into ``W_O``). Both forms compute the same function: `mla_naive` and
`mla_absorbed` agree to rounding.

Names and layouts follow Hugging Face's ``DeepseekV2Attention``/``DeepseekV3Attention``: the
weights are a dict of ``[out, in]`` matrices keyed by the checkpoint's module names
(``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``); ``kv_b_proj`` holds, per head, the
``qk_nope_head_dim`` rows of ``W_UK`` then the ``v_head_dim`` rows of ``W_UV``.

**RoPE layout.** DeepSeek's checkpoints rotate *interleaved* pairs ``(x_0, x_1), (x_2, x_3),
…``. Here (as in HF's DeepSeek-V3 code) an interleaved vector is first de-interleaved to
``[x_0, x_2, …, x_1, x_3, …]`` and then rotated in the rotate-half layout: the same rotation,
with the coordinates permuted identically in queries and keys, so every score is unchanged.
The rotary key is cached in that rotate-half layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["MLADims", "random_weights", "rms_norm", "rope_tables", "apply_rope", "project", "decompress",
           "absorb_query", "latent_cache", "mla_naive", "mla_absorbed", "latent_attention",
           "paged_latent_decode", "latent_output", "split_kv_b", "latent_cache_write"]


@dataclass(frozen=True)
class MLADims:
    """The sizes of one MLA layer (HF config names)."""
    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        """Width of a head's query and (decompressed) key: content plus rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one token's cache row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """The softmax scale, ``1/sqrt(qk_head_dim)``: that of the *decompressed* head, in
        both forms (the absorbed dot products are the same numbers)."""
        return 1.0 / math.sqrt(self.qk_head_dim)


def random_weights(d: MLADims, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float64 weights of one MLA layer, ``[out, in]`` like ``nn.Linear``, scaled so
    that activations stay of order one; the norms' weights near 1."""
    def lin(out, inp):
        return rng.standard_normal((out, inp)) / math.sqrt(inp)
    h, H = d.hidden_size, d.num_heads
    w = {}
    if d.q_lora_rank is None:
        w["q_proj"] = lin(H * d.qk_head_dim, h)
    else:
        w["q_a_proj"] = lin(d.q_lora_rank, h)
        w["q_a_layernorm"] = 1.0 + 0.1 * rng.standard_normal(d.q_lora_rank)
        w["q_b_proj"] = lin(H * d.qk_head_dim, d.q_lora_rank)
    w["kv_a_proj_with_mqa"] = lin(d.latent_dim, h)
    w["kv_a_layernorm"] = 1.0 + 0.1 * rng.standard_normal(d.kv_lora_rank)
    w["kv_b_proj"] = lin(H * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank)
    w["o_proj"] = lin(h, H * d.v_head_dim)
    return w


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x²) + eps) · weight`` over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_tables(positions, dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin: [T, dim/2]``: the angle of pair ``i`` at position ``p`` is ``p · θ^(-2i/dim)``."""
    inv_freq = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang), np.sin(ang)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """Rotate ``x: [T, ..., dim]`` (``cos, sin: [T, dim/2]``). With ``interleave`` the pairs are
    ``(x_2i, x_2i+1)``, else ``(x_i, x_i+dim/2)``; either way the result is in the rotate-half
    layout ``[x1·cos − x2·sin ; x2·cos + x1·sin]`` (see the module docstring)."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = np.split(x, 2, axis=-1)
    extra = (slice(None),) + (None,) * (x.ndim - 2)
    c, s = cos[extra], sin[extra]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def split_kv_b(w: dict, d: MLADims) -> tuple[np.ndarray, np.ndarray]:
    """``W_UK: [H, qk_nope_head_dim, r]`` and ``W_UV: [H, v_head_dim, r]`` from ``kv_b_proj``."""
    kv_b = w["kv_b_proj"].reshape(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
    return kv_b[:, :d.qk_nope_head_dim], kv_b[:, d.qk_nope_head_dim:]


def project(x: np.ndarray, w: dict, d: MLADims, positions) -> tuple[np.ndarray, ...]:
    """The projections of tokens ``x: [T, hidden]`` at ``positions``:
    ``q_nope [T, H, nope]``, ``q_rope [T, H, d_R]`` (rotated), ``c_kv [T, r]`` (normed) and
    ``k_rope [T, d_R]`` (rotated)."""
    T, H = x.shape[0], d.num_heads
    if d.q_lora_rank is None:
        q = x @ w["q_proj"].T
    else:
        q = rms_norm(x @ w["q_a_proj"].T, w["q_a_layernorm"], d.rms_norm_eps) @ w["q_b_proj"].T
    q = q.reshape(T, H, d.qk_head_dim)
    kv = x @ w["kv_a_proj_with_mqa"].T                                          # [T, r + d_R]
    c_kv = rms_norm(kv[:, :d.kv_lora_rank], w["kv_a_layernorm"], d.rms_norm_eps)
    cos, sin = rope_tables(positions, d.qk_rope_head_dim, d.rope_theta)
    q_rope = apply_rope(q[..., d.qk_nope_head_dim:], cos, sin, d.rope_interleave)
    k_rope = apply_rope(kv[:, d.kv_lora_rank:], cos, sin, d.rope_interleave)
    return q[..., :d.qk_nope_head_dim], q_rope, c_kv, k_rope


def decompress(c_kv: np.ndarray, k_rope: np.ndarray, w: dict, d: MLADims) -> tuple[np.ndarray, np.ndarray]:
    """Per-head keys ``[S, H, qk_head_dim]`` (``[W_UK c ; k^R]``, the rotary part broadcast to
    every head) and values ``[S, H, v_head_dim]`` (``W_UV c``) of the cached latents."""
    w_uk, w_uv = split_kv_b(w, d)
    k_nope = np.einsum("hdr,sr->shd", w_uk, c_kv)
    v = np.einsum("hdr,sr->shd", w_uv, c_kv)
    k_r = np.broadcast_to(k_rope[:, None, :], (c_kv.shape[0], d.num_heads, d.qk_rope_head_dim))
    return np.concatenate([k_nope, k_r], axis=-1), v


def absorb_query(q_nope: np.ndarray, q_rope: np.ndarray, w: dict, d: MLADims) -> np.ndarray:
    """The absorbed query ``[T, H, r + d_R]``: ``[W_UK^hᵀ q_h^C ; q_h^R]`` per head, so that
    its dot product with a latent row ``[c ; k^R]`` is the head's score (times the scale)."""
    w_uk, _ = split_kv_b(w, d)
    return np.concatenate([np.einsum("thd,hdr->thr", q_nope, w_uk), q_rope], axis=-1)


def latent_cache(c_kv: np.ndarray, k_rope: np.ndarray) -> np.ndarray:
    """The cache rows ``[S, r + d_R]``: ``[c_kv ; k_rope]`` per token."""
    return np.concatenate([c_kv, k_rope], axis=-1)


def latent_cache_write(cache: np.ndarray, kv: np.ndarray, slot_mapping, kv_lora_rank: int, cos: np.ndarray,
                       sin: np.ndarray, norm_weight: np.ndarray, eps: float = 1e-6,
                       interleave: bool = True) -> np.ndarray:
    """The paged latent cache after new tokens are written: a float64 copy of ``cache:
    [num_blocks, block_size, (1,) r + d_R]`` in which token ``t``'s row ``kv[t] = [c_raw ;
    k_raw]`` (``kv_a_proj_with_mqa``'s output) is stored at slot ``s = slot_mapping[t]``
    (block ``s // block_size``, row ``s % block_size``) as ``[RMSNorm(c_raw)·norm_weight ;
    RoPE(k_raw)]``, the rotary key rotated with ``cos, sin: [tokens, d_R/2]`` into the
    rotate-half layout (`apply_rope`). Slot -1 writes nothing; every other row is unchanged."""
    out = np.array(cache, dtype=np.float64, copy=True)
    pool = out.reshape(-1, out.shape[-1])                                          # row s = slot s
    kv = np.asarray(kv, dtype=np.float64)
    rows = latent_cache(rms_norm(kv[:, :kv_lora_rank], norm_weight, eps),
                        apply_rope(kv[:, kv_lora_rank:], cos, sin, interleave))
    slots = np.asarray(slot_mapping)
    keep = slots >= 0
    pool[slots[keep]] = rows[keep]
    return out


def _causal_softmax(scores: np.ndarray, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """``scores: [T, H, S]`` (query ``t`` at position ``S − T + t``) -> weights and lse ``[T, H]``."""
    T, _, S = scores.shape
    if causal:
        visible = np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]        # [T, S]
        scores = np.where(visible[:, None, :], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(scores - m)
    total = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]
    return e / np.where(total == 0, 1.0, total), lse


def latent_attention(q_abs: np.ndarray, cache: np.ndarray, kv_lora_rank: int, scale: float,
                     causal: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Attention of absorbed queries ``q_abs: [T, H, r + d_R]`` over latent rows ``cache: [S,
    r + d_R]`` (keys: the whole rows; values: their first ``r`` columns); the ``T`` queries are
    the last ``T`` positions (bottom-right causal). Returns ``(o_latent [T, H, r], lse [T, H])``."""
    p, lse = _causal_softmax(np.einsum("thw,sw->ths", q_abs, cache) * scale, causal)
    return np.einsum("ths,sr->thr", p, cache[:, :kv_lora_rank]), lse


def latent_output(o_latent: np.ndarray, w: dict, d: MLADims) -> np.ndarray:
    """``W_UV`` applied to each head's latent output: ``[T, H, r] -> [T, H, v_head_dim]``."""
    _, w_uv = split_kv_b(w, d)
    return np.einsum("thr,hvr->thv", o_latent, w_uv)


def mla_naive(x: np.ndarray, w: dict, d: MLADims, positions=None, causal: bool = True) -> np.ndarray:
    """MLA by decompression: ``x: [T, hidden] -> [T, hidden]`` (positions default ``0..T-1``).
    Every cached latent becomes ``H`` keys of ``qk_head_dim`` and ``H`` values of
    ``v_head_dim``, then ordinary multi-head attention."""
    positions = np.arange(x.shape[0]) if positions is None else np.asarray(positions)
    q_nope, q_rope, c_kv, k_rope = project(x, w, d, positions)
    k, v = decompress(c_kv, k_rope, w, d)                                        # [S, H, *]
    q = np.concatenate([q_nope, q_rope], axis=-1)                               # [T, H, qk]
    p, _ = _causal_softmax(np.einsum("thd,shd->ths", q, k) * d.scale, causal)
    o = np.einsum("ths,shd->thd", p, v)                                         # [T, H, v]
    return o.reshape(x.shape[0], -1) @ w["o_proj"].T


def mla_absorbed(x: np.ndarray, w: dict, d: MLADims, positions=None, causal: bool = True) -> np.ndarray:
    """MLA over the latent cache: ``W_UK`` folded into the query, attention over ``[c_kv ;
    k_rope]`` rows, ``W_UV`` applied to the latent output. Equal to `mla_naive`."""
    positions = np.arange(x.shape[0]) if positions is None else np.asarray(positions)
    q_nope, q_rope, c_kv, k_rope = project(x, w, d, positions)
    q_abs = absorb_query(q_nope, q_rope, w, d)
    o_lat, _ = latent_attention(q_abs, latent_cache(c_kv, k_rope), d.kv_lora_rank, d.scale, causal)
    return latent_output(o_lat, w, d).reshape(x.shape[0], -1) @ w["o_proj"].T


def paged_latent_decode(q_abs: np.ndarray, cache: np.ndarray, block_tables: np.ndarray, seq_lens,
                        kv_lora_rank: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One absorbed query per sequence over a paged latent pool: ``q_abs: [B, H, W]``,
    ``cache: [num_blocks, block_size, W]`` (or ``[..., 1, W]``: one "KV head"), ``block_tables:
    [B, max_blocks]``, ``seq_lens: [B]`` -> ``(o_latent [B, H, r], lse [B, H])``; a sequence of
    length 0 gives zeros and ``-inf``."""
    cache = np.asarray(cache, dtype=np.float64)
    if cache.ndim == 4:
        cache = cache[:, :, 0]
    bs = cache.shape[1]
    B, H, _ = q_abs.shape
    out, lse = np.zeros((B, H, kv_lora_rank)), np.full((B, H), -np.inf)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = np.arange(n)
        rows = cache[np.asarray(block_tables[b])[pos // bs], pos % bs]            # [n, W]
        o, l = latent_attention(np.asarray(q_abs[b:b + 1], dtype=np.float64), rows, kv_lora_rank, scale,
                                causal=False)
        out[b], lse[b] = o[0], l[0]
    return out, lse
