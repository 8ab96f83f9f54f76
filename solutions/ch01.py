"""Chapter 1 solutions. Try the exercises in ``exercises/ch01.py`` first."""
from __future__ import annotations

import math

import numpy as np
import torch

from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


def safe_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Exercise 1.1: softmax with the max subtracted (exp never sees a positive argument)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)  # fully masked slice: keep exp(-inf - 0) = 0
    e = np.exp(x - m)
    total = e.sum(axis=axis, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def attention_mask(q_len: int, kv_len: int, causal: bool = False, window: int | None = None) -> np.ndarray:
    """Exercise 1.2: broadcast query positions (a column) against key positions (a row)."""
    q_pos = np.arange(q_len)[:, None] + (kv_len - q_len)
    k_pos = np.arange(kv_len)[None, :]
    visible = np.ones((q_len, kv_len), dtype=bool)
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        visible &= np.abs(q_pos - k_pos) < window
    return visible


def kv_head_for(q_head: int, q_heads: int, kv_heads: int) -> int:
    """Exercise 1.3: consecutive groups of ``q_heads // kv_heads`` query heads share a KV head."""
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    return q_head // (q_heads // kv_heads)


@triton.jit
def _scores_tile(Q, K, S, q_len, kv_len, scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    # Contiguous [batch*heads, len, HEAD_DIM] tensors: one (batch, head) slab per bh.
    q = tl.load(Q + bh * q_len * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :], mask=rows[:, None] < q_len, other=0.0)
    k = tl.load(K + bh * kv_len * HEAD_DIM + cols[:, None] * HEAD_DIM + d[None, :], mask=cols[:, None] < kv_len, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None] + (kv_len - q_len), s, float("-inf"))
    tl.store(S + bh * q_len * kv_len + rows[:, None] * kv_len + cols[None, :], s,
             mask=(rows[:, None] < q_len) & (cols[None, :] < kv_len))


def attention_scores(q: torch.Tensor, k: torch.Tensor, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Exercise 1.4: one program per [32 x 32] tile of S for one (batch, head)."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    q, k = q.contiguous(), k.contiguous()
    s = torch.empty(batch, heads, q_len, kv_len, device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grid = (triton.cdiv(q_len, 32), triton.cdiv(kv_len, 32), batch * heads)
    _scores_tile[grid](q, k, s, q_len, kv_len, scale, HEAD_DIM=head_dim, CAUSAL=causal,
                       IEEE=q.dtype == torch.float32, BLOCK_M=32, BLOCK_N=32)
    return s


@triton.jit
def softmax_kernel(S, P, n_cols, stride_row, BLOCK_N: tl.constexpr):
    """Exercise 1.5: the row in one tile; -inf past its end, so the tail adds exp(-inf) = 0."""
    row = tl.program_id(0).to(tl.int64)  # int64: row x stride can pass 2^31 for long rows
    cols = tl.arange(0, BLOCK_N)
    in_row = cols < n_cols
    s = tl.load(S + row * stride_row + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    m = tl.max(s, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a fully masked row: avoid -inf - (-inf) = NaN
    e = tl.exp(s - m)                          # every exponent <= 0: no overflow
    total = tl.sum(e, axis=0)
    p = e / tl.where(total == 0.0, 1.0, total)  # fully masked row: 0 / 1 = zeros
    tl.store(P + row * stride_row + cols, p, mask=in_row)


def row_softmax(s: torch.Tensor) -> torch.Tensor:
    """Exercise 1.5 (launcher): one program per row of the flattened ``[rows, n]`` matrix."""
    s = s.contiguous()
    n_cols = s.shape[-1]
    p = torch.empty(s.shape, device=s.device, dtype=torch.float32)
    rows = s.numel() // n_cols
    if rows:
        softmax_kernel[(rows,)](s, p, n_cols, n_cols, BLOCK_N=triton.next_power_of_2(n_cols))
    return p
