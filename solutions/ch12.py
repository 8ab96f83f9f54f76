"""Chapter 12 solutions. Try the exercises in ``exercises/ch12.py`` first."""
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
    nope = q_nope.shape[-1]
    heads, r = q_nope.shape[1], kv_b_proj.shape[1]
    kv_b = kv_b_proj.reshape(heads, nope + v_head_dim, r)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]                        # [H, nope, r], [H, v, r]
    q_abs = np.concatenate([np.einsum("thd,hdr->thr", q_nope, w_uk), q_rope], axis=-1)
    T, S = q_nope.shape[0], rows.shape[0]
    scores = np.einsum("thw,sw->ths", q_abs, rows) * scale              # [T, H, S]
    visible = np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]    # [T, S]
    scores = np.where(visible[:, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o_lat = np.einsum("ths,sr->thr", p, rows[:, :r])                    # [T, H, r]
    return np.einsum("thr,hvr->thv", o_lat, w_uv)


# ---------------------------------------------------------------------------------------------
# Triton kernel (Exercise 12.2): the kernel and its launcher.
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
    h_ok, n_ok = offs_h < num_heads, offs_n < seq_len
    offs_c, offs_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    c_ok, r_ok = offs_c < KV_LORA, offs_r < ROPE_DIM
    q_c = tl.load(Q + offs_h[:, None] * stride_qh + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(Q + offs_h[:, None] * stride_qh + KV_LORA + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                  other=0.0)
    c = tl.load(Rows + offs_n[:, None] * stride_rs + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
    k_r = tl.load(Rows + offs_n[:, None] * stride_rs + KV_LORA + offs_r[None, :],
                  mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
    s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PRECISION)
    tl.store(S + offs_h[:, None] * stride_sh + offs_n[None, :], s * scale, mask=h_ok[:, None] & n_ok[None, :])


def absorbed_scores(q: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, scale: float,
                    block_n: int = 16) -> torch.Tensor:
    """Exercise 12.2 (launcher, complete) — ``q: [heads, W]`` (absorbed queries, ``heads <= 64``)
    and ``rows: [seq_len, W]`` (one dtype: fp32, fp16 or bf16; ``W = kv_lora_rank + R``) ->
    the scaled scores ``[heads, seq_len]`` float32."""
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
