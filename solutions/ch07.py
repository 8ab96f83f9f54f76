"""Chapter 7 solutions. Try the exercises in ``exercises/ch07.py`` first."""
from __future__ import annotations

import math

import numpy as np


def merge_splits(o: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 7.1: weights relative to the largest lse; empty splits contribute nothing."""
    o = np.asarray(o, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    m = lse.max(axis=-1)
    m_safe = np.where(np.isneginf(m), 0.0, m)           # all empty: subtract 0, every weight e^{-inf} = 0
    w = np.exp(lse - m_safe[..., None])                 # [..., S], in [0, 1]
    empty = np.isneginf(lse)[..., None]
    w_sum = w.sum(axis=-1)
    out = (w[..., None] * np.where(empty, 0.0, o)).sum(axis=-2) / np.where(w_sum == 0, 1.0, w_sum)[..., None]
    with np.errstate(divide="ignore"):
        return out, m_safe + np.log(w_sum)


def fa2_num_splits(batch_heads: int, n_blocks: int, num_sms: int, max_splits: int = 128) -> int:
    """Exercise 7.2: FlashAttention-2's wave-efficiency rule, in the C++'s single precision."""
    f32 = np.float32
    if f32(batch_heads) >= f32(0.8) * f32(num_sms):
        return 1
    cap = min(max_splits, num_sms, n_blocks)

    def blocks_per_split(s: int) -> int:
        return -(-n_blocks // s)

    efficiency = {}
    for s in range(1, cap + 1):
        if s == 1 or blocks_per_split(s) != blocks_per_split(s - 1):
            waves = f32(batch_heads * s) / f32(num_sms)
            efficiency[s] = waves / f32(math.ceil(waves))
    if not efficiency:
        return 1
    best = max(efficiency.values())
    return next(s for s, eff in efficiency.items() if float(eff) >= 0.85 * float(best))


def split_partial(q: np.ndarray, k, v, seq_len: int, start: int, end: int, block_n: int,
                  scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 7.3: the online softmax over the split's tiles, one slice of K and V each."""
    q = np.asarray(q, dtype=np.float64)
    rows, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    stop = min(end, seq_len)
    m = np.full(rows, -np.inf)
    l = np.zeros(rows)
    acc = np.zeros((rows, head_dim))
    for a in range(start, stop, block_n):
        b = min(a + block_n, stop)                        # the ragged last tile
        x = scale * q @ np.asarray(k[a:b], dtype=np.float64).T
        m_new = np.maximum(m, x.max(axis=1))
        alpha = np.exp(m - m_new)                         # 0 on the first tile (m = -inf, m_new finite)
        p = np.exp(x - m_new[:, None])
        l = alpha * l + p.sum(axis=1)
        acc = alpha[:, None] * acc + p @ np.asarray(v[a:b], dtype=np.float64)
        m = m_new
    if stop <= start:
        return np.zeros((rows, head_dim)), np.full(rows, -np.inf)
    return acc / l[:, None], m + np.log(l)
