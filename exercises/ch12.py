"""Chapter 12 exercises: multi-head latent attention. Grade your work with ``make grade CH=12``.

Replace each ``raise NotImplementedError(...)`` with your implementation: Exercise 12.1 in
NumPy, 12.2 and 12.3 as Triton kernels (write the body of the ``@triton.jit`` function, then
delete the ``raise`` at the top of its launcher). Tests compare your functions with the float64
references in `minillm.reference.ch12_mla` on fresh random inputs of odd sizes.

Notation (the notebook's): ``H`` heads; ``r = kv_lora_rank``, the latent's width; ``R =
qk_rope_head_dim``, the shared rotary key's; ``W = r + R``, one cached row ``[c ; k_R]``;
``kv_b_proj: [H · (nope + v), r]`` holds, per head, the ``nope`` rows of ``W_UK`` and then the
``v`` rows of ``W_UV``.
"""
from __future__ import annotations

import numpy as np
import torch

from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


def absorbed_attention(q_nope: np.ndarray, q_rope: np.ndarray, rows: np.ndarray, kv_b_proj: np.ndarray,
                       v_head_dim: int, scale: float) -> np.ndarray:
    """Exercise 12.1 — MLA in the absorbed form, over the latent rows.

    ``q_nope: [T, H, nope]`` and ``q_rope: [T, H, R]`` (already rotated) are the queries of the
    last ``T`` of ``S`` positions; ``rows: [S, r + R]`` the latent cache ``[c ; k_R]`` of all
    ``S`` positions; ``kv_b_proj: [H · (nope + v_head_dim), r]``. Return each head's attention
    output ``[T, H, v_head_dim]``, causal (query ``t`` sits at position ``S − T + t`` and sees
    rows ``0 … S − T + t``), *without* decompressing any key or value:

    1. fold ``W_UK`` into the query: ``q_lat[t, h] = W_UK^hᵀ q_nope[t, h]`` (width ``r``) and
       ``q_abs = [q_lat ; q_rope]`` (width ``r + R``);
    2. attention over the rows: scores ``q_abs · row · scale``, a softmax over the visible
       rows, the latent output ``o_lat = Σ_j p_j c_j`` (width ``r``: the values are the rows'
       first ``r`` columns);
    3. unfold ``W_UV``: ``o[t, h] = W_UV^h o_lat[t, h]``.

    The result must equal decompression (``k_h = [W_UK^h c ; k_R]``, ``v_h = W_UV^h c``,
    ordinary attention) to float64 rounding.
    """
    raise NotImplementedError("Exercise 12.1 (absorbed_attention): not started. Read its docstring; hints: python -m minillm.grade 12 --hint 12.1")


# ---------------------------------------------------------------------------------------------
# Triton kernel (Exercise 12.2): write the body of the @triton.jit function, then delete the
# `raise` at the top of its launcher.
# ---------------------------------------------------------------------------------------------
@triton.jit
def absorbed_scores_kernel(Q, Rows, S, num_heads, seq_len, scale,
                           stride_qh, stride_rs, stride_sh,
                           KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    """Exercise 12.2 — the scores of every head against a tile of latent rows, in Triton.

    ``Q: [num_heads, KV_LORA + ROPE_DIM]`` holds the absorbed queries of one token (row
    stride ``stride_qh``, columns contiguous), ``Rows: [seq_len, KV_LORA + ROPE_DIM]`` the
    latent rows ``[c ; k_R]`` (row stride ``stride_rs``), ``S: [num_heads, seq_len]`` fp32 the
    output (row stride ``stride_sh``). Program ``j`` computes ``S[h, n] = scale · Q[h] · Rows[n]``
    for every head ``h`` (the ``BLOCK_H >= 16`` rows of its dots; ``num_heads <= BLOCK_H``)
    and the rows ``n`` of tile ``j`` (``BLOCK_N`` of them).

    Split each dot in two, as MLA's kernels do: the latent part (``KV_LORA`` columns, loaded
    as ``[*, BLOCK_C]`` tiles) and the rotary part (the next ``ROPE_DIM`` columns, ``[*,
    BLOCK_R]``), ``s = q_c · cᵀ + q_r · k_Rᵀ``, both with ``tl.dot(..., input_precision=
    DOT_PRECISION)``. ``BLOCK_C``, ``BLOCK_R`` are ``KV_LORA``, ``ROPE_DIM`` rounded up to
    powers of two >= 16: mask the padding columns (and heads and rows past the ends) on every
    load and store.
    """
    j = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    pass  # your code: load q_c, q_r, the tile's c and k_R; two dots; store the scaled scores


def absorbed_scores(q: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, scale: float,
                    block_n: int = 16) -> torch.Tensor:
    """Exercise 12.2 (launcher, complete) — ``q: [heads, W]`` (absorbed queries, ``heads <= 64``)
    and ``rows: [seq_len, W]`` (one dtype: fp32, fp16 or bf16; ``W = kv_lora_rank + R``) ->
    the scaled scores ``[heads, seq_len]`` float32."""
    raise NotImplementedError("Exercise 12.2 (absorbed_scores): not started. Read its docstring; hints: python -m minillm.grade 12 --hint 12.2")
    heads, width = q.shape
    rope = width - kv_lora_rank
    if rows.shape[1] != width or rows.dtype != q.dtype or not 0 < kv_lora_rank < width or heads > 64:
        raise ValueError(f"q {tuple(q.shape)} and rows {tuple(rows.shape)} do not fit kv_lora_rank={kv_lora_rank}")
    q, rows = q.contiguous(), rows.contiguous()
    s = torch.empty((heads, rows.shape[0]), device=q.device, dtype=torch.float32)
    if rows.shape[0]:
        absorbed_scores_kernel[(triton.cdiv(rows.shape[0], block_n),)](
            q, rows, s, heads, rows.shape[0], scale, q.stride(0), rows.stride(0), s.stride(0),
            KV_LORA=kv_lora_rank, ROPE_DIM=rope, BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)),
            BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_H=max(16, triton.next_power_of_2(heads)),
            BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return s


# ---------------------------------------------------------------------------------------------
# Triton kernel (Exercise 12.3): write the body of the @triton.jit function, then delete the
# `raise` at the top of its launcher.
# ---------------------------------------------------------------------------------------------
@triton.jit
def latent_cache_write_kernel(KV, NormW, Cos, Sin, Slots, Cache, eps, block_size,
                              stride_kt, stride_ct, stride_cb, stride_co,
                              KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr,
                              BLOCK_HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Exercise 12.3 — one new token's row of the paged latent cache, in Triton.

    ``KV: [tokens, KV_LORA + ROPE_DIM]`` holds ``kv_a_proj_with_mqa``'s output ``[c_raw ;
    k_raw]`` (row stride ``stride_kt``, columns contiguous); ``NormW: [KV_LORA]`` the latent's
    RMSNorm weight (``kv_a_layernorm``); ``Cos, Sin: [tokens, ROPE_DIM // 2]`` float32 (row
    stride ``stride_ct``) the angle of each rotary pair at the token's position; ``Slots:
    [tokens]`` int64; ``Cache: [num_blocks, block_size, KV_LORA + ROPE_DIM]`` the paged pool
    (strides ``stride_cb``, ``stride_co``, columns contiguous). Program ``t`` writes token
    ``t``'s row at slot ``s = Slots[t]`` (block ``s // block_size``, row ``s % block_size``)
    and writes nothing at all when ``s == -1``:

    - columns ``[0, KV_LORA)``: ``c_raw / sqrt(mean(c_raw²) + eps) · NormW``, in float32;
    - columns ``[KV_LORA, KV_LORA + ROPE_DIM)``: RoPE of ``k_raw``, pair ``i`` being ``(x1,
      x2) = (k_2i, k_2i+1)`` when ``INTERLEAVE`` (DeepSeek's checkpoints) else ``(k_i,
      k_i+ROPE_DIM/2)``, rotated to ``x1·cos_i − x2·sin_i`` stored at ``KV_LORA + i`` and
      ``x2·cos_i + x1·sin_i`` at ``KV_LORA + ROPE_DIM/2 + i`` (the rotate-half layout, whatever
      the input's). RMSNorm touches the latent only, RoPE the rotary key only.

    ``BLOCK_C``, ``BLOCK_HALF`` are ``KV_LORA``, ``ROPE_DIM // 2`` rounded up to powers of two:
    mask the padding on every load and store. Store in the cache's dtype.
    """
    t = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_i = tl.arange(0, BLOCK_HALF)
    pass  # your code: load the slot; unless -1, normalise the latent, rotate the pairs, store the row


def latent_cache_write(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, kv_lora_rank: int,
                       cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6,
                       interleave: bool = True) -> None:
    """Exercise 12.3 (launcher, complete) — store new tokens' latent rows into the pool, in place.
    ``cache: [num_blocks, block_size, (1,) W]`` (``W = kv_lora_rank + R``, columns contiguous),
    ``kv: [tokens, W]`` in the cache's dtype, ``slot_mapping: [tokens]`` (-1: skip), ``cos, sin:
    [tokens, R/2]`` (the rotation of each pair; wider tables: their first ``R/2`` columns),
    ``norm_weight: [kv_lora_rank]``, ``eps`` (the model's: 1e-6), ``interleave`` (RoPE on
    interleaved pairs, as DeepSeek's checkpoints)."""
    raise NotImplementedError("Exercise 12.3 (latent_cache_write_kernel): not started. Read its docstring; hints: python -m minillm.grade 12 --hint 12.3")
    pool = cache[:, :, 0] if cache.dim() == 4 else cache
    num_blocks, block_size, width = pool.shape
    rope = width - kv_lora_rank
    n = kv.shape[0]
    if kv.shape != (n, width) or rope < 2 or rope % 2 or pool.stride(2) != 1 or slot_mapping.shape != (n,):
        raise ValueError(f"kv {tuple(kv.shape)}, slot_mapping {tuple(slot_mapping.shape)} and the pool "
                         f"{tuple(cache.shape)} do not fit kv_lora_rank={kv_lora_rank}")
    kv, slots = kv.contiguous(), slot_mapping.to(torch.int64).contiguous()
    cos = cos[:, :rope // 2].to(torch.float32).contiguous()
    sin = sin[:, :rope // 2].to(torch.float32).contiguous()
    if n:
        latent_cache_write_kernel[(n,)](
            kv, norm_weight.contiguous(), cos, sin, slots, pool, float(eps), block_size,
            kv.stride(0), cos.stride(0), pool.stride(0), pool.stride(1),
            KV_LORA=kv_lora_rank, ROPE_DIM=rope, BLOCK_C=triton.next_power_of_2(kv_lora_rank),
            BLOCK_HALF=triton.next_power_of_2(rope // 2), INTERLEAVE=bool(interleave))
