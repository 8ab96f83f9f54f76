"""Chapter 3 solutions. Try the exercises in ``exercises/ch03.py`` first."""
from __future__ import annotations

import math

import numpy as np
import torch

from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


def _safe(m: np.ndarray) -> np.ndarray:
    """The max to subtract: 0 where nothing is visible (m = -inf), so -inf - (-inf) never happens."""
    return np.where(np.isneginf(m), 0.0, m)


def online_softmax_update(m: np.ndarray, l: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 3.1: raise the max, rescale the old sum to it, add the block's terms."""
    m_new = np.maximum(m, np.max(block, axis=-1, initial=-np.inf))
    m_safe = _safe(m_new)
    # exp(m - m_safe) <= 1: the sum so far, re-expressed against the new max (0 on the first block).
    return m_new, l * np.exp(m - m_safe) + np.sum(np.exp(block - m_safe[..., None]), axis=-1)


def merge_partials(m1: np.ndarray, l1: np.ndarray, o1: np.ndarray, m2: np.ndarray, l2: np.ndarray,
                   o2: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 3.2: weight each normalised output by its share of the common softmax sum."""
    m = np.maximum(m1, m2)
    m_safe = _safe(m)
    w1, w2 = l1 * np.exp(m1 - m_safe), l2 * np.exp(m2 - m_safe)
    l = w1 + w2
    o = (w1[..., None] * o1 + w2[..., None] * o2) / np.where(l == 0, 1.0, l)[..., None]
    return m, l, o


def tile_step(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, o_i: np.ndarray, l_i: np.ndarray,
              m_i: np.ndarray, scale: float, visible: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 3.3: the tile is a partial result over the keys of block j; merge it in."""
    s = scale * (q_i @ k_j.T)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m_t = np.max(s, axis=-1, initial=-np.inf)                  # m̃: the tile's row max
    p_t = np.exp(s - _safe(m_t)[:, None])                      # P̃
    l_t = p_t.sum(axis=-1)                                     # ℓ̃
    o_t = (p_t @ v_j) / np.where(l_t == 0, 1.0, l_t)[:, None]  # the tile's own attention output
    m, l, o = merge_partials(m_i, l_i, o_i, m_t, l_t, o_t)
    return o, l, m


@triton.jit
def online_softmax_kernel(X, Y, LSE, n_cols, stride_row, BLOCK_N: tl.constexpr):
    """Exercise 3.4: sweep 1 folds each block into (m, l); sweep 2 writes exp(x - m) / l."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_row
    y_row = Y + row * stride_row
    cols = tl.arange(0, BLOCK_N)
    m = tl.full((), float("-inf"), dtype=tl.float32)
    l = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: subtract 0
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)  # rescale the old sum, add the block
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    inv_l = 1.0 / tl.where(l == 0.0, 1.0, l)  # all -inf row: zeros
    for start in range(0, n_cols, BLOCK_N):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(y_row + start + cols, tl.exp(x - m_safe) * inv_l, mask=mask)
    tl.store(LSE + row, m + tl.log(l))  # log(0) = -inf: -inf for an all -inf row


def online_softmax(x: torch.Tensor, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 3.4 (launcher): one program per row."""
    x = x.contiguous()
    n_cols = x.shape[-1]
    y = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    lse = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    rows = x.numel() // n_cols
    if rows:
        online_softmax_kernel[(rows,)](x, y, lse, n_cols, n_cols, BLOCK_N=block_n)
    return y, lse


@triton.jit
def fa1_kernel(Q, K, V, O, L, M, q_heads, kv_heads, q_len, kv_len, scale,
               HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exercise 3.5: FlashAttention-1's Algorithm 1, the running state in HBM (O, L, M)."""
    bh = tl.program_id(0)
    b, h = bh // q_heads, bh % q_heads
    kv_bh = (b * kv_heads + h // (q_heads // kv_heads)).to(tl.int64)  # GQA: this head's K/V slab
    Q += bh.to(tl.int64) * q_len * HEAD_DIM
    O += bh.to(tl.int64) * q_len * HEAD_DIM
    L += bh.to(tl.int64) * q_len
    M += bh.to(tl.int64) * q_len
    K += kv_bh * kv_len * HEAD_DIM
    V += kv_bh * kv_len * HEAD_DIM
    d = tl.arange(0, HEAD_DIM)
    for start_n in range(0, kv_len, BLOCK_N):                 # outer: K/V blocks, loaded once
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * HEAD_DIM + d[None, :], mask=cols[:, None] < kv_len, other=0.0)
        v = tl.load(V + cols[:, None] * HEAD_DIM + d[None, :], mask=cols[:, None] < kv_len, other=0.0)
        for start_m in range(0, q_len, BLOCK_M):              # inner: Q blocks, state from HBM
            rows = start_m + tl.arange(0, BLOCK_M)
            in_m = rows < q_len
            q = tl.load(Q + rows[:, None] * HEAD_DIM + d[None, :], mask=in_m[:, None], other=0.0)
            o = tl.load(O + rows[:, None] * HEAD_DIM + d[None, :], mask=in_m[:, None], other=0.0)
            l = tl.load(L + rows, mask=in_m, other=0.0)
            m = tl.load(M + rows, mask=in_m, other=float("-inf"))

            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            visible = cols[None, :] < kv_len
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + (kv_len - q_len))
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: subtract 0
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)                              # how much the old state shrinks
            l_new = alpha * l + tl.sum(p, axis=1)
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            # FA1 keeps O normalised: undo the old division by l, add P V, divide by l_new.
            o = ((alpha * l)[:, None] * o + pv) / tl.where(l_new == 0.0, 1.0, l_new)[:, None]

            tl.store(O + rows[:, None] * HEAD_DIM + d[None, :], o, mask=in_m[:, None])
            tl.store(L + rows, l_new, mask=in_m)
            tl.store(M + rows, m_new, mask=in_m)
        # The next outer iteration reads what this one stored, possibly from other threads of
        # the program (a load's layout need not match the store's): make the stores visible.
        tl.debug_barrier()


def fa1_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 3.5 (launcher): one program per (sequence, query head)."""
    batch, q_heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = torch.zeros(q.shape, device=q.device, dtype=torch.float32)               # the running state,
    l = torch.zeros(q.shape[:-1], device=q.device, dtype=torch.float32)          # in HBM between
    m = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=torch.float32)  # outer steps
    fa1_kernel[(batch * q_heads,)](
        q, k, v, o, l, m, q_heads, kv_heads, q_len, kv_len, scale, HEAD_DIM=d, CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=16, BLOCK_N=16)
    return o.to(q.dtype), m + torch.log(l)  # lse = m + log l: -inf for a row that saw no key
