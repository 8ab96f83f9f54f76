"""Chapter 4 solutions. Try the exercises in ``exercises/ch04.py`` first."""
from __future__ import annotations

import numpy as np

SKIP, MASKED, FULL = 0, 1, 2


def _safe(m: np.ndarray) -> np.ndarray:
    """The max to subtract: 0 where nothing is visible (m = -inf), so -inf - (-inf) never happens."""
    return np.where(np.isneginf(m), 0.0, m)


def fa2_tile_step(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, acc: np.ndarray, l: np.ndarray,
                  m: np.ndarray, scale: float, visible: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 4.1: raise the max, shrink the old state to it, add the tile; no division."""
    s = scale * (q_i @ k_j.T)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m_new = np.maximum(m, np.max(s, axis=-1, initial=-np.inf))
    m_sub = _safe(m_new)
    p = np.exp(s - m_sub[:, None])
    alpha = np.exp(m - m_sub)              # exp(m_old - m_new) <= 1; 0 while nothing was seen
    return alpha[:, None] * acc + p @ v_j, alpha * l + p.sum(axis=-1), m_new


def fa2_finalize(acc: np.ndarray, l: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 4.1: the one division per row, and the logsumexp."""
    o = acc / np.where(l == 0, 1.0, l)[:, None]
    with np.errstate(divide="ignore"):
        return o, m + np.log(l)


def classify_causal_blocks(q_len: int, kv_len: int, block_m: int, block_n: int) -> np.ndarray:
    """Exercise 4.2: compare each K block's first and last key with the block's first and
    last query position."""
    offset = kv_len - q_len
    n_q, n_k = -(-q_len // block_m), -(-kv_len // block_n)
    classes = np.empty((n_q, n_k), dtype=np.int8)
    for i in range(n_q):
        p_first = i * block_m + offset                       # the block's first row sees keys <= p_first
        p_last = min((i + 1) * block_m, q_len) - 1 + offset  # its last row sees keys <= p_last
        for j in range(n_k):
            k_first, k_last = j * block_n, min((j + 1) * block_n, kv_len) - 1
            if k_first > p_last:
                classes[i, j] = SKIP
            elif k_last <= p_first:
                classes[i, j] = FULL
            else:
                classes[i, j] = MASKED
    return classes


def fa2_backward_tile(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, do_i: np.ndarray, lse_i: np.ndarray,
                      delta_i: np.ndarray, scale: float, visible: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 4.3: recompute P from L, then the five products of the backward."""
    s = scale * (q_i @ k_j.T)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    # L = -inf only for rows that saw nothing: subtracting +inf there makes every p exactly 0.
    p = np.exp(s - np.where(np.isneginf(lse_i), np.inf, lse_i)[:, None])
    dv = p.T @ do_i
    dp = do_i @ v_j.T
    ds = p * (dp - delta_i[:, None])
    return scale * (ds @ k_j), scale * (ds.T @ q_i), dv


def backward_delta(o: np.ndarray, do: np.ndarray) -> np.ndarray:
    """Exercise 4.4: D_i = dO_i · O_i."""
    return np.sum(o * do, axis=-1)
