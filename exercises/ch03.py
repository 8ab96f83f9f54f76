"""Chapter 3 exercises: the online softmax and tiling. Grade your work with ``make grade CH=3``.

Replace each ``raise NotImplementedError(...)`` with your implementation: Exercises 3.1–3.3 in
NumPy, 3.4 and 3.5 as Triton kernels (write the body of the ``@triton.jit`` function, then
delete the ``raise`` at the top of its launcher). Tests
compare your functions with the float64 references in `minillm.reference.ch03_online_softmax`
and `minillm.reference.ch01_naive_attention` on fresh random inputs, including scores in the
thousands (where ``exp`` overflows) and fully masked rows (all ``-inf``).

Conventions: ``m`` is a row's running max, ``l`` its running sum of ``exp(x - m)``. A row
that has seen nothing yet (or only ``-inf``) has ``m = -inf`` and ``l = 0``; never compute
``-inf - (-inf)`` (that is NaN): where a max is ``-inf``, subtract 0 instead.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


def online_softmax_update(m: np.ndarray, l: np.ndarray, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 3.1 — fold one block of each row into its running statistics.

    ``m, l: [rows]`` are the max and the sum of ``exp(x - m)`` over the elements seen so far;
    ``block: [rows, B]`` holds the next ``B`` elements of each row (``-inf`` = masked). Return
    ``(m_new, l_new)``, the statistics of everything seen including the block, such that
    streaming a whole row block by block ends with ``m = max(row)`` and
    ``l = Σ exp(row - max(row))``. Do not overflow: never exponentiate a positive number.
    """
    raise NotImplementedError("Exercise 3.1 (online_softmax_update): not started. Read its docstring; hints: python -m minillm.grade 3 --hint 3.1")


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
    raise NotImplementedError("Exercise 3.2 (merge_partials): not started. Read its docstring; hints: python -m minillm.grade 3 --hint 3.2")


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
    raise NotImplementedError("Exercise 3.3 (tile_step): not started. Read its docstring; hints: python -m minillm.grade 3 --hint 3.3")


# ---------------------------------------------------------------------------------------------
# Triton kernels (Exercises 3.4 and 3.5): write the body of the @triton.jit function, then
# delete the `raise` at the top of its launcher.
# ---------------------------------------------------------------------------------------------
@triton.jit
def online_softmax_kernel(X, Y, LSE, n_cols, stride_row, BLOCK_N: tl.constexpr):
    """Exercise 3.4 — softmax of a row too long for one tile: stream it in blocks of ``BLOCK_N``.

    Program ``r`` handles row ``r`` (``n_cols`` elements from ``X + r·stride_row``; fp32 or
    fp16; ``-inf`` = masked; ``n_cols`` may be many times ``BLOCK_N`` and need not be a
    multiple of it). Two sweeps over the row:

    1. the statistics, one block at a time (Exercise 3.1): the running max ``m`` and the
       running sum ``l`` of ``exp(x - m)`` (scalars, fp32; ``-inf`` and 0 at the start);
    2. the output: ``Y[r, j] = exp(x_j - m) / l`` (fp32, same offsets as ``X``).

    Then ``LSE[r] = m + log(l)``. A block, or a whole row, may be entirely ``-inf``: never
    compute ``-inf - (-inf)``; an all ``-inf`` row gives zeros and ``LSE = -inf``.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_row
    y_row = Y + row * stride_row
    cols = tl.arange(0, BLOCK_N)
    pass  # your code: sweep 1 (m, l), sweep 2 (y), then LSE


def online_softmax(x: torch.Tensor, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 3.4 (launcher, complete) — softmax over the last axis of ``x: [..., n]`` in
    blocks of ``block_n`` (a power of two). Returns ``(y, lse)``: ``y`` like ``x`` and
    ``lse: [...]``, both float32."""
    raise NotImplementedError("Exercise 3.4 (online_softmax_kernel): not started. Read its docstring; hints: python -m minillm.grade 3 --hint 3.4")
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
    """Exercise 3.5 — attention in FlashAttention-1's loop order: K/V blocks outer, Q blocks inner.

    Program ``b·q_heads + h`` computes the whole attention of query head ``h`` of sequence
    ``b``. The pointers below already point at its slabs: ``Q, O: [q_len, HEAD_DIM]`` and
    ``K, V: [kv_len, HEAD_DIM]`` (contiguous rows; GQA's KV head is resolved), ``L, M:
    [q_len]``. ``O, L, M`` are fp32 and hold the running state of every query row between
    outer iterations: the *normalised* output so far, the sum ``l`` and the max ``m`` of the
    row's scores, initialised by the launcher to ``0, 0, -inf``.

    For each block of ``BLOCK_N`` keys (outer loop; load K_j, V_j once), for each block of
    ``BLOCK_M`` query rows (inner loop): load Q_i and the rows' state, compute
    ``s = scale · Q_i K_jᵀ`` (``tl.dot(..., input_precision=DOT_PRECISION)``), set ``-inf``
    where a key is past ``kv_len`` or (``CAUSAL``, bottom-right aligned: row ``i`` sits at
    position ``kv_len - q_len + i``) in the future, fold the tile into the state as in
    Exercise 3.3 and store the state back. Masked lanes (rows past ``q_len``, keys past
    ``kv_len``) are never loaded or stored. A row may see no key at all in a block, or at all.
    End each outer iteration with ``tl.debug_barrier()``: on a GPU the next one reads what
    this one stored, possibly from other threads of the program.
    ``HEAD_DIM`` is a power of two >= 16, and so are the blocks.
    """
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
    pass  # your code: the two loops


def fa1_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 3.5 (launcher, complete) — ``q: [batch, q_heads, q_len, d]``, ``k, v: [batch,
    kv_heads, kv_len, d]`` (``d`` a power of two >= 16) -> ``(out, lse)`` as
    `minillm.reference.ch01_naive_attention.attention` returns them (``out`` in q's dtype)."""
    raise NotImplementedError("Exercise 3.5 (fa1_kernel): not started. Read its docstring; hints: python -m minillm.grade 3 --hint 3.5")
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
