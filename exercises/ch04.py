"""Chapter 4 exercises: FlashAttention-2. Grade your work with ``make grade CH=4``.

Replace each ``raise NotImplementedError(...)`` with your implementation, in NumPy. Tests
compare your functions with the float64 references in `minillm.reference.ch04_flash_attention`
and `minillm.reference.ch01_naive_attention` on fresh random inputs, including scores in the hundreds,
blocks that do not divide the sequence, more queries than keys (whose first rows see no key
at all) and fully masked rows.

Conventions, as in Chapter 3: ``m`` is a row's running max and ``l`` its running sum of
``exp(s - m)``; a row that has seen nothing yet (or only masked keys) has ``m = -inf`` and
``l = 0``. Never compute ``-inf - (-inf)`` (that is NaN): where a max is ``-inf``, subtract 0
instead. New in this chapter: ``acc`` is the *unscaled* output ``Σ exp(s - m)·v`` (not yet
divided by ``l``), and ``lse = m + log l`` (natural log) is the one statistic per row the
forward keeps for the backward. Positions are bottom-right aligned: query ``i`` of
``q_len`` sits at position ``kv_len - q_len + i`` and, causally, sees keys ``0 … that``.
"""
from __future__ import annotations

import numpy as np

#: The codes of Exercise 4.2: what a program does with one (Q block, K block) pair.
SKIP, MASKED, FULL = 0, 1, 2


def fa2_tile_step(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, acc: np.ndarray, l: np.ndarray,
                  m: np.ndarray, scale: float, visible: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 4.1 (part 1) — fold one K/V block into a Q block's state, FlashAttention-2's way.

    ``q_i: [r, d]``, ``k_j, v_j: [c, d]``; ``acc: [r, d]`` is the unscaled output over the
    keys seen so far and ``l, m: [r]`` its statistics (``0, 0, -inf`` before the first
    block). ``visible``: bool ``[r, c]`` (False = masked) or None (all visible). Return the
    new ``(acc, l, m)``. Do not divide by ``l``: that happens once, in `fa2_finalize`.
    """
    raise NotImplementedError(
        "Exercise 4.1 (fa2_tile_step): s = scale * q_i @ k_j.T, -inf where not visible; m_new = max(m, rowmax(s)) "
        "(let m_sub be m_new with -inf replaced by 0); p = exp(s - m_sub[:, None]); alpha = exp(m - m_sub) shrinks "
        "the old state: l_new = alpha * l + p.sum(-1), acc_new = alpha[:, None] * acc + p @ v_j. "
        "Return (acc_new, l_new, m_new)."
    )


def fa2_finalize(acc: np.ndarray, l: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 4.1 (part 2) — the end of a Q block's program.

    ``acc: [r, d]``, ``l, m: [r]`` as `fa2_tile_step` left them after the last K/V block.
    Return ``(o, lse)``: the attention output ``o: [r, d]`` and ``lse = m + log l: [r]``.
    A row that saw no visible key must get ``o = 0`` and ``lse = -inf`` (no NaN, no warning
    that matters: ``np.errstate(divide="ignore")`` silences ``log(0)``).
    """
    raise NotImplementedError(
        "Exercise 4.1 (fa2_finalize): o = acc / l[:, None], dividing by 1 where l == 0 (np.where); "
        "lse = m + np.log(l), which is -inf + -inf = -inf for a row that saw nothing."
    )


def classify_causal_blocks(q_len: int, kv_len: int, block_m: int, block_n: int) -> np.ndarray:
    """Exercise 4.2 — which (Q block, K block) pairs causal attention must compute.

    Queries are cut into blocks of ``block_m`` rows, keys into blocks of ``block_n`` (the
    last block of each may be shorter). Return an integer array of shape
    ``[ceil(q_len / block_m), ceil(kv_len / block_n)]`` whose entry ``[i, j]`` is ``SKIP`` if
    no query of block ``i`` sees any key of block ``j``, ``FULL`` if every query of the block
    sees every key of it, and ``MASKED`` otherwise. Causal and bottom-right aligned (see the
    module docstring); ``q_len`` and ``kv_len`` may differ either way.
    """
    raise NotImplementedError(
        "Exercise 4.2 (classify_causal_blocks): for Q block i (rows r0 … r1 - 1) the positions are p_first = "
        "r0 + kv_len - q_len and p_last = r1 - 1 + kv_len - q_len. Row p sees keys 0 … p, so the block's keys "
        "[k0, k1) are seen by no row iff k0 > p_last, and by every row iff k1 - 1 <= p_first. You need no mask."
    )


def fa2_backward_tile(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, do_i: np.ndarray, lse_i: np.ndarray,
                      delta_i: np.ndarray, scale: float, visible: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise 4.3 — the gradient contributions of one (Q block, K/V block) pair.

    ``q_i, do_i: [r, d]`` (queries and ``∂loss/∂o`` of the block's rows), ``k_j, v_j: [c, d]``,
    ``lse_i: [r]`` (the forward's ``L = m + log l`` of these rows), ``delta_i: [r]``
    (``D = rowsum(dO ∘ O)``, Exercise 4.4), ``visible`` as in Exercise 4.1. Return
    ``(dq_ij: [r, d], dk_ij: [c, d], dv_ij: [c, d])``: this pair's terms of dQ, dK and dV, so
    that summing over all pairs gives the full gradients. Recompute the probabilities from
    ``L`` (no max, no sum needed). A row with ``L = -inf`` saw no key: it contributes zero.
    """
    raise NotImplementedError(
        "Exercise 4.3 (fa2_backward_tile): p = exp(scale * q_i @ k_j.T - lse_i[:, None]), zero where not visible "
        "and in rows where lse_i is -inf (mask before exp, or subtract +inf there); dv = p.T @ do_i; "
        "dp = do_i @ v_j.T; ds = p * (dp - delta_i[:, None]); dq = scale * ds @ k_j; dk = scale * ds.T @ q_i."
    )


def backward_delta(o: np.ndarray, do: np.ndarray) -> np.ndarray:
    """Exercise 4.4 — the backward's preprocess.

    ``o, do: [..., q_len, head_dim]`` (the forward's output and ``∂loss/∂o``). Return
    ``D: [..., q_len]`` with ``D_i = Σ_j P_ij dP_ij`` (``dP = dO Vᵀ``), the row term the
    softmax's Jacobian subtracts in ``dS = P ∘ (dP - D)``, computed without P or V.
    """
    raise NotImplementedError(
        "Exercise 4.4 (backward_delta): Σ_j P_ij (dO_i · V_j) = dO_i · (Σ_j P_ij V_j) = dO_i · O_i: "
        "sum o * do over the last axis."
    )
