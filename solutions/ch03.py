"""Chapter 3 solutions. Try the exercises in ``exercises/ch03.py`` first."""
from __future__ import annotations

import numpy as np


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
