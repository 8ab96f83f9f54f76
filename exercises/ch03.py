"""Chapter 3 exercises: the online softmax and tiling. Grade your work with ``make grade CH=3``.

Replace each ``raise NotImplementedError(...)`` with your implementation, in NumPy. Tests
compare your functions with the float64 references in `minillm.reference.ch03_online_softmax`
and `minillm.reference.ch01_naive_attention` on fresh random inputs, including scores in the
thousands (where ``exp`` overflows) and fully masked rows (all ``-inf``).

Conventions: ``m`` is a row's running max, ``l`` its running sum of ``exp(x - m)``. A row
that has seen nothing yet (or only ``-inf``) has ``m = -inf`` and ``l = 0``; never compute
``-inf - (-inf)`` (that is NaN): where a max is ``-inf``, subtract 0 instead.
"""
from __future__ import annotations

import numpy as np


def online_softmax_update(m: np.ndarray, l: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 3.1 — fold one block of each row into its running statistics.

    ``m, l: [rows]`` are the max and the sum of ``exp(x - m)`` over the elements seen so far;
    ``block: [rows, B]`` holds the next ``B`` elements of each row (``-inf`` = masked). Return
    ``(m_new, l_new)``, the statistics of everything seen including the block, such that
    streaming a whole row block by block ends with ``m = max(row)`` and
    ``l = Σ exp(row - max(row))``. Do not overflow: never exponentiate a positive number.
    """
    raise NotImplementedError(
        "Exercise 3.1 (online_softmax_update): m_new = np.maximum(m, block.max(axis=-1)); let m_safe be "
        "m_new with -inf replaced by 0 (np.where); the old sum was taken against m, so it becomes "
        "l * np.exp(m - m_safe); add np.exp(block - m_safe[:, None]).sum(axis=-1)."
    )


def merge_partials(m1: np.ndarray, l1: np.ndarray, o1: np.ndarray, m2: np.ndarray, l2: np.ndarray,
                   o2: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 3.2 — merge the attention outputs of two disjoint sets of keys.

    For each query row, ``(mₖ, lₖ, oₖ)`` describe attention over the keys of set ``k`` alone:
    ``mₖ, lₖ: [...]`` the statistics of its scores, ``oₖ: [..., d]`` its output
    ``softmax(scores_k) · V_k`` (normalised within the set; zeros and ``(-inf, 0)`` if the
    set is empty or fully masked). Return ``(m, l, o)`` of attention over both sets together.
    The merge must not depend on grouping or order: ``merge(merge(a, b), c) ==
    merge(a, merge(b, c))`` and ``merge(a, b) == merge(b, a)``.
    """
    raise NotImplementedError(
        "Exercise 3.2 (merge_partials): m = max(m1, m2) (with a safe 0 where it is -inf); each set's sum "
        "relative to m is wₖ = lₖ·exp(mₖ - m), and l = w1 + w2. oₖ is an average weighted by that set's own "
        "sum, so o = (w1·o1 + w2·o2) / l (add [..., None] to broadcast over d; where l = 0, divide by 1)."
    )


def tile_step(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, o_i: np.ndarray, l_i: np.ndarray,
              m_i: np.ndarray, scale: float, visible: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 3.3 — one step of FlashAttention-1: fold the block ``(K_j, V_j)`` into the
    running state of the query block ``Q_i``.

    ``q_i: [Br, d]``, ``k_j, v_j: [Bc, d]``; ``o_i: [Br, d]`` is the (normalised) attention
    output of these queries over the keys seen so far, ``l_i, m_i: [Br]`` its statistics
    (``0, 0, -inf`` before the first block). ``visible``: bool ``[Br, Bc]`` (False = masked)
    or None (all visible). Return the new ``(o_i, l_i, m_i)``: attention over the old keys
    and ``k_j`` together. Repeated over all K/V blocks it must equal full attention.
    """
    raise NotImplementedError(
        "Exercise 3.3 (tile_step): s = scale * q_i @ k_j.T, set s to -inf where not visible; the tile's own "
        "statistics are m̃ = s.max(-1) and ℓ̃ = Σ exp(s - m̃) (safe max!) and its own output is "
        "exp(s - m̃) @ v_j / ℓ̃ (divide by 1 where ℓ̃ = 0): a partial result. Merge it into (m_i, l_i, o_i) as "
        "in Exercise 3.2, and return (o, l, m) in that order."
    )
