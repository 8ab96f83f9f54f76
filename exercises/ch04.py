"""Chapter 4 exercises: FlashAttention-2. Grade your work with ``make grade CH=4``.

Replace each ``raise NotImplementedError(...)`` with your implementation: Exercises 4.1–4.4 in
NumPy, 4.5–4.7 as Triton kernels (write the body of the ``@triton.jit`` function, then
delete the ``raise`` at the top of its launcher), 4.8 a schedule in NumPy and a kernel, 4.9 a
relabelling of keys in NumPy, 4.10 an exponential without the exponential unit in Triton, 4.11
the row sums of the softmax as a matmul in Triton. Tests
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

import math

import numpy as np
import torch

from minillm.kernels.base import num_sms, tl, triton  # Triton as this machine runs it (no GPU: the interpreter)

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
    raise NotImplementedError("Exercise 4.1 (fa2_tile_step): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.1")


def fa2_finalize(acc: np.ndarray, l: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 4.1 (part 2) — the end of a Q block's program.

    ``acc: [r, d]``, ``l, m: [r]`` as `fa2_tile_step` left them after the last K/V block.
    Return ``(o, lse)``: the attention output ``o: [r, d]`` and ``lse = m + log l: [r]``.
    A row that saw no visible key must get ``o = 0`` and ``lse = -inf`` (no NaN, no warning
    that matters: ``np.errstate(divide="ignore")`` silences ``log(0)``).
    """
    raise NotImplementedError("Exercise 4.1 (fa2_finalize): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.1")


def classify_causal_blocks(q_len: int, kv_len: int, block_m: int, block_n: int) -> np.ndarray:
    """Exercise 4.2 — which (Q block, K block) pairs causal attention must compute.

    Queries are cut into blocks of ``block_m`` rows, keys into blocks of ``block_n`` (the
    last block of each may be shorter). Return an integer array of shape
    ``[ceil(q_len / block_m), ceil(kv_len / block_n)]`` whose entry ``[i, j]`` is ``SKIP`` if
    no query of block ``i`` sees any key of block ``j``, ``FULL`` if every query of the block
    sees every key of it, and ``MASKED`` otherwise. Causal and bottom-right aligned (see the
    module docstring); ``q_len`` and ``kv_len`` may differ either way.
    """
    raise NotImplementedError("Exercise 4.2 (classify_causal_blocks): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.2")


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
    raise NotImplementedError("Exercise 4.3 (fa2_backward_tile): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.3")


def backward_delta(o: np.ndarray, do: np.ndarray) -> np.ndarray:
    """Exercise 4.4 — the backward's preprocess.

    ``o, do: [..., q_len, head_dim]`` (the forward's output and ``∂loss/∂o``). Return
    ``D: [..., q_len]`` with ``D_i = Σ_j P_ij dP_ij`` (``dP = dO Vᵀ``), the row term the
    softmax's Jacobian subtracts in ``dS = P ∘ (dP - D)``, computed without P or V.
    """
    raise NotImplementedError("Exercise 4.4 (backward_delta): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.4")


# ---------------------------------------------------------------------------------------------
# Triton kernels (Exercises 4.5 and 4.6): write the body of the @triton.jit function, then
# delete the `raise` at the top of its launcher.
# ---------------------------------------------------------------------------------------------
@triton.jit
def fa2_forward_kernel(Q, K, V, O, LSE, q_heads, kv_heads, q_len, kv_len, scale,
                       HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exercise 4.5 — FlashAttention-2's forward for one block of query rows.

    Program ``(i, b·q_heads + h)`` owns rows ``i·BLOCK_M … i·BLOCK_M + BLOCK_M - 1`` of query
    head ``h`` of sequence ``b``. The pointers below already point at its head's slabs:
    ``Q, O: [q_len, HEAD_DIM]``, ``K, V: [kv_len, HEAD_DIM]`` (contiguous rows; GQA's KV head
    is resolved) and ``LSE: [q_len]`` (fp32).

    Load the Q block once, keep ``acc`` (the *unscaled* output, fp32), ``l`` and ``m`` in
    registers (Exercise 4.1), and loop over the key blocks this block can see. With
    ``CAUSAL`` (bottom-right aligned: row ``r`` sits at position ``kv_len - q_len + r`` and
    sees keys ``0 … that``) the loop must *stop* after the last key the block's last row can
    see: the blocks past the diagonal are never loaded (Exercise 4.2). Mask scores with
    ``-inf`` (keys past ``kv_len``, future keys). At the end write ``O = acc / l`` (0 for a
    row that saw no key) in O's dtype and ``LSE = m + log(l)`` (``-inf`` for such a row).
    Rows past ``q_len`` are never loaded or stored. ``HEAD_DIM`` and the blocks are powers of
    two >= 16; use ``tl.dot(..., input_precision=DOT_PRECISION)`` for both products.
    """
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // q_heads, bh % q_heads
    kv_bh = (b * kv_heads + h // (q_heads // kv_heads)).to(tl.int64)  # GQA: this head's K/V slab
    Q += bh.to(tl.int64) * q_len * HEAD_DIM
    O += bh.to(tl.int64) * q_len * HEAD_DIM
    LSE += bh.to(tl.int64) * q_len
    K += kv_bh * kv_len * HEAD_DIM
    V += kv_bh * kv_len * HEAD_DIM
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    pass  # your code: load q; the loop over key blocks (where does it stop?); normalise; store O and LSE


def fa2_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 4.5 (launcher, complete) — ``q: [batch, q_heads, q_len, d]``, ``k, v: [batch,
    kv_heads, kv_len, d]`` (``d`` a power of two >= 16) -> ``(out, lse)`` as
    `minillm.reference.ch01_naive_attention.attention` returns them (``out`` in q's dtype)."""
    raise NotImplementedError("Exercise 4.5 (fa2_forward_kernel): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.5")
    batch, q_heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    BLOCK_M, BLOCK_N = 32, 16
    fa2_forward_kernel[(triton.cdiv(q_len, BLOCK_M), batch * q_heads)](
        q, k, v, out, lse, q_heads, kv_heads, q_len, kv_len, scale, HEAD_DIM=d, CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out, lse


@triton.jit
def delta_kernel(O, DO, Delta, n_rows, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Exercise 4.6 — the backward's preprocess ``D = rowsum(dO ∘ O)`` (Exercise 4.4) in Triton.

    ``O, DO: [n_rows, head_dim]`` (contiguous; any float dtype) and ``Delta: [n_rows]`` fp32.
    Program ``i`` computes ``Delta[r] = Σ_j O[r, j] · DO[r, j]`` for the rows
    ``r = i·BLOCK_M …`` of its block, in fp32. ``BLOCK_D`` is ``head_dim`` rounded up to a
    power of two; rows past ``n_rows`` and columns past ``head_dim`` must not be read or written.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    pass  # your code: two masked [BLOCK_M, BLOCK_D] loads, a product, a row sum, a masked store


def backward_delta_triton(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """Exercise 4.6 (launcher, complete) — ``o, do: [..., q_len, head_dim]`` -> ``D: [..., q_len]`` fp32."""
    raise NotImplementedError("Exercise 4.6 (delta_kernel): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.6")
    o, do = o.contiguous(), do.contiguous()
    head_dim = o.shape[-1]
    n_rows = o.numel() // head_dim
    delta = torch.empty(o.shape[:-1], device=o.device, dtype=torch.float32)
    BLOCK_M = 16
    delta_kernel[(triton.cdiv(n_rows, BLOCK_M),)](o, do, delta, n_rows, head_dim, BLOCK_M=BLOCK_M,
                                                   BLOCK_D=triton.next_power_of_2(head_dim))
    return delta


# ---------------------------------------------------------------------------------------------
# Exercise 4.7 (Section 10, Hopper): the key loop through tensor descriptors, one matmul ahead.
# ---------------------------------------------------------------------------------------------
@triton.jit
def tma_forward_kernel(desc_q, desc_k, desc_v, desc_o, q_heads, kv_heads, kv_len, scale,
                       HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exercise 4.7 — a non-causal forward that moves every tile through tensor descriptors.

    ``desc_q, desc_o`` describe ``[batch, q_heads, q_len, HEAD_DIM]`` tensors in tiles of
    ``[1, 1, BLOCK_M, HEAD_DIM]``; ``desc_k, desc_v`` describe ``[batch, kv_heads, kv_len,
    HEAD_DIM]`` in tiles of ``[1, 1, BLOCK_N, HEAD_DIM]``. ``desc.load([b, h, row, 0])`` returns
    the tile starting at ``row`` (reshape it to 2-d); rows past the end of the head arrive as
    zeros. ``desc.store([b, h, row, 0], tile)`` writes a 4-d tile and drops rows past the end.

    Program ``(i, b·q_heads + h)`` computes output rows ``i·BLOCK_M …`` of query head ``h``
    (GQA: its KV head is ``kv_h``). Write the loop over key blocks *one matmul ahead*, as
    `_kv_steps_overlapped` of the chapter's Hopper kernel: compute the scores of block
    ``j + 1`` before the softmax of block ``j``. Mind the zeros: a key row past ``kv_len``
    gives a score of 0, not ``-inf``. Store ``O = acc / l`` in O's dtype (``desc_o.dtype``).
    Use ``tl.dot(..., input_precision=DOT_PRECISION)`` for both products.
    """
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // q_heads, bh % q_heads
    kv_h = h // (q_heads // kv_heads)
    start_m = pid_m * BLOCK_M
    keys = tl.arange(0, BLOCK_N)
    pass  # your code: load q; the scores of block 0; the loop (next scores first); normalise; store


def tma_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Exercise 4.7 (launcher, complete) — ``q: [batch, q_heads, q_len, d]``, ``k, v: [batch,
    kv_heads, kv_len, d]`` (``d`` a power of two >= 16, ``kv_len >= 1``) -> ``out`` as
    `minillm.reference.ch01_naive_attention.attention` returns it (in q's dtype), non-causal."""
    raise NotImplementedError("Exercise 4.7 (tma_forward_kernel): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.7")
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, q_heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    BLOCK_M, BLOCK_N = 32, 16
    descs = [TensorDescriptor.from_tensor(t, [1, 1, rows, d]) for t, rows in ((q, BLOCK_M), (k, BLOCK_N),
                                                                              (v, BLOCK_N), (out, BLOCK_M))]
    tma_forward_kernel[(triton.cdiv(q_len, BLOCK_M), batch * q_heads)](
        *descs, q_heads, kv_heads, kv_len, scale, HEAD_DIM=d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out


# ---------------------------------------------------------------------------------------------
# Exercise 4.8 (Section 11, Hopper): persistent programs that walk a schedule of tiles.
# ---------------------------------------------------------------------------------------------
def causal_tile_order(key_blocks, batch_heads: int, num_programs: int) -> np.ndarray:
    """Exercise 4.8 (part 1) — the order in which a persistent grid takes the forward's tiles.

    A tile is one query block of one (sequence, head): tile ``t = bh·n + i`` is query block
    ``i`` of ``bh = b·q_heads + h``, with ``n = len(key_blocks)`` blocks per head and
    ``batch_heads`` heads (heads outermost, as in the chapter's Hopper kernel). Its work is
    ``key_blocks[i]``, the number of key blocks its loop visits: all equal without a mask,
    growing down the rows when causal (Exercise 4.2), 0 for a block that sees no key.

    ``num_programs`` programs walk your order round robin: program ``p`` computes the tiles
    ``order[p], order[p + num_programs], order[p + 2·num_programs], …``. Return ``order``, an
    integer array of shape ``[batch_heads·n]`` holding every tile exactly once, such that the
    busiest program's work (the sum of ``key_blocks`` over its tiles) exceeds the average,
    ``total work / num_programs``, by at most the work of one longest tile,
    ``max(key_blocks)``. The row-major order ``0, 1, 2, …`` does not, nor does the chapter's
    longest-first-within-each-head; ``num_programs`` may exceed the number of tiles.
    """
    raise NotImplementedError("Exercise 4.8 (causal_tile_order): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.8")


@triton.jit
def persistent_forward_kernel(Q, K, V, O, LSE, TileOrder, Owner, q_heads, kv_heads, q_len, kv_len, n_m_blocks,
                              n_tiles, scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              NUM_STAGES: tl.constexpr):
    """Exercise 4.8 (part 2) — Exercise 4.5's forward with a persistent grid.

    The grid has ``tl.num_programs(0)`` programs, usually fewer than the ``n_tiles`` tiles
    (and sometimes more). Program ``pid`` computes the tiles ``TileOrder[pid]``,
    ``TileOrder[pid + num_programs]``, … (``TileOrder: [n_tiles]`` int32, a permutation of the
    tiles) until the list runs out. Tile ``t`` is query block ``t % n_m_blocks`` (``BLOCK_M``
    rows) of ``bh = t // n_m_blocks = b·q_heads + h``. ``Q, O: [batch, q_heads, q_len,
    HEAD_DIM]``, ``K, V: [batch, kv_heads, kv_len, HEAD_DIM]`` (contiguous; GQA: query head
    ``h`` reads KV head ``h // (q_heads // kv_heads)``) and ``LSE: [batch, q_heads, q_len]``
    fp32: these are the tensors' starting addresses, not a head's slab.

    For each tile do what Exercise 4.5's program does (causal: bottom-right aligned, the loop
    stops at the diagonal; ``O = acc / l`` in O's dtype, ``LSE = m + log l``; rows past
    ``q_len`` are never loaded or stored; rows that see no key get 0 and ``-inf``), and record
    ``Owner[t] = pid`` (int32), which the launcher returns. Write the key loop as
    ``tl.range(..., num_stages=NUM_STAGES)`` (the compiler's software pipeline; the
    interpreter ignores it) and use ``tl.dot(..., input_precision=DOT_PRECISION)``.
    """
    pid = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    pass  # your code: the loop over this program's tiles; per tile: its id, its head and rows, 4.5's body, Owner


def persistent_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: float | None = None, num_programs: int | None = None, tile_order=None,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 4.8 (launcher, complete) — ``q: [batch, q_heads, q_len, d]``, ``k, v: [batch,
    kv_heads, kv_len, d]`` (``d`` a power of two >= 16) -> ``(out, lse, owner)``: ``out`` (in q's
    dtype, written into ``out`` if given) and ``lse`` as `fa2_forward` returns them, and
    ``owner: [n_tiles]`` int32, the program that computed each tile (-1: none did).
    ``num_programs``: the size of the grid (default: one program per SM); ``tile_order``: the
    schedule, a permutation of the tiles (default: `causal_tile_order` of the tiles' work)."""
    raise NotImplementedError("Exercise 4.8 (persistent_forward_kernel): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.8")
    batch, q_heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    BLOCK_M, BLOCK_N = 32, 16
    n_m_blocks = triton.cdiv(q_len, BLOCK_M)
    n_tiles = batch * q_heads * n_m_blocks
    num_programs = num_sms(q.device) if num_programs is None else num_programs
    if tile_order is None:
        # The work of query block i: the key blocks its loop visits, up to the diagonal when causal.
        ends = np.full(n_m_blocks, kv_len)
        if causal:
            ends = np.clip((np.arange(n_m_blocks) + 1) * BLOCK_M + kv_len - q_len, 0, kv_len)
        tile_order = causal_tile_order(-(-ends // BLOCK_N), batch * q_heads, num_programs)
    tile_order = np.asarray(tile_order)
    if tile_order.shape != (n_tiles,) or not np.array_equal(np.sort(tile_order), np.arange(n_tiles)):
        raise ValueError(f"tile_order must hold each of the {n_tiles} tiles 0 … {n_tiles - 1} exactly once, "
                         f"got {tile_order.tolist()[:20]}")
    order = torch.as_tensor(tile_order, dtype=torch.int32).to(q.device)
    owner = torch.full((n_tiles,), -1, dtype=torch.int32, device=q.device)
    persistent_forward_kernel[(num_programs,)](
        q, k, v, out, lse, order, owner, q_heads, kv_heads, q_len, kv_len, n_m_blocks, n_tiles, scale,
        HEAD_DIM=d, CAUSAL=causal, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_STAGES=2)
    return out, lse, owner


# ---------------------------------------------------------------------------------------------
# Exercise 4.9 (Section 11, Hopper): the key order that keeps an 8-bit P in registers.
# ---------------------------------------------------------------------------------------------
def relabel_order(accumulator_columns, operand_keys) -> np.ndarray:
    """Exercise 4.9 (part 1) — relabel, don't shuffle.

    A group of ``G`` keys (16 on Hopper) is spread over the lanes of a quad of threads, the
    same ``G`` scores after Q·Kᵀ and the same ``G`` probabilities before P·V, but in two
    different arrangements. ``accumulator_columns[lane, r]`` is the key (within the group)
    whose score register ``r`` of ``lane`` holds after Q·Kᵀ; ``operand_keys[lane, r]`` is the
    key whose probability register ``r`` of ``lane`` must hold when P·V reads its first
    operand. Both are ``[lanes, registers]`` integer arrays; each, flattened, is a permutation
    of ``0 … G−1``.

    If every thread hands its registers to P·V unchanged, the matmul reads the value of key
    ``accumulator_columns[lane, r]`` as if it were key ``operand_keys[lane, r]``. Return
    ``order`` (integers, shape ``[G]``): ``order[k]`` is the key whose value the matmul reads
    at position ``k``. Stored in that order (`permute_keys`), Vᵀ makes the product exact again.
    """
    raise NotImplementedError("Exercise 4.9 (relabel_order): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.9")


def permute_keys(vt, order) -> np.ndarray:
    """Exercise 4.9 (part 2) — Vᵀ with the keys of every group in ``order``.

    ``vt: [..., seq]``, the keys on the last axis (the FP8 kernel's Vᵀ is ``[batch, heads,
    head_dim, seq]``); ``order``: ``G`` integers from `relabel_order`. Return a new array of
    ``vt``'s shape and dtype whose key ``g·G + k`` is ``vt``'s key ``g·G + order[k]``, for
    every group ``g``; nothing moves along the other axes, and ``vt`` is not modified. Raise
    ``ValueError`` if ``seq`` is not a multiple of ``G``.
    """
    raise NotImplementedError("Exercise 4.9 (permute_keys): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.9")


# ---------------------------------------------------------------------------------------------
# Exercise 4.10 (Section 11, Hopper): 2^x on the FMA units.
# ---------------------------------------------------------------------------------------------
@triton.jit
def exp2_fma_kernel(X, Y, n, C0, C1, C2, C3, BLOCK: tl.constexpr):
    """Exercise 4.10 — ``Y[i] = 2^X[i]`` for fp32 ``X[i] <= 0`` (``-inf`` allowed), ``i < n``,
    without ``tl.exp2``/``tl.exp``: additions, multiplications and integer operations only.

    1. Clamp ``x`` to at least -125 (below, and for ``-inf``, the result is ``2^-125``).
    2. ``t = x + 12582912.0`` (``1.5·2^23``): the fp32 adder rounds ``x`` to the nearest
       integer ``n``, which then sits in ``t``'s low mantissa bits; ``n = t - 12582912.0``.
    3. ``f = x - n`` lies in ``[-1/2, 1/2]``; ``p = ((C3·f + C2)·f + C1)·f + C0 ≈ 2^f``.
    4. Add ``n`` to ``p``'s exponent field: reinterpret ``p`` and ``t`` as int32
       (``.to(tl.int32, bitcast=True)``), add ``t``'s bits shifted left by 23 to ``p``'s, and
       reinterpret the sum as fp32.

    Program ``i`` handles elements ``i·BLOCK …``; elements past ``n`` are neither read nor
    written.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pass  # your code: a masked load, the four steps, a masked store


def exp2_on_fma(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exercise 4.10 (launcher, complete) — ``x``: fp32, any shape, entries ``<= 0`` ->
    ``2^x`` computed by `exp2_fma_kernel` with the cubic of
    `minillm.reference.ch04_fp8.EXP2_POLY_COEFFS`, written into the first ``x.numel()``
    elements of ``out`` (fp32, 1-d, at least that long) if given."""
    raise NotImplementedError("Exercise 4.10 (exp2_fma_kernel): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.10")
    from minillm.reference.ch04_fp8 import EXP2_POLY_COEFFS

    flat = x.contiguous().view(-1)
    out = torch.empty_like(flat) if out is None else out
    exp2_fma_kernel[(triton.cdiv(flat.numel(), 128),)](flat, out, flat.numel(), *EXP2_POLY_COEFFS, BLOCK=128)
    return out[:flat.numel()].view(x.shape)


# ---------------------------------------------------------------------------------------------
# Exercise 4.11 (Section 11, Hopper): the row sums as a matmul.
# ---------------------------------------------------------------------------------------------
@triton.jit
def row_sums_kernel(S, V, O, LSE, n_q, n_k, stride_s, stride_v, stride_o,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Exercise 4.11 — ``softmax₂(S) V`` for rows ``BLOCK_M·pid …`` of the scores ``S: [n_q,
    n_k]`` (fp32, already scaled to base 2: the weights are ``2^(s - m)``), ``V: [n_k, D]``
    (fp32), with the online softmax over blocks of ``BLOCK_N`` keys as the FP8 kernel runs it:

    1. ``m_new``: the running row max (keys past ``n_k`` count as ``-inf``; every row has at
       least one key); ``alpha = 2^(m - m_new)``; ``p = 2^(s - m_new)``;
    2. P rounded to e4m3, as the FP8 kernel rounds it for P·V: ``p8 = p.to(tl.float8e4nv)
       .to(tl.float32)``;
    3. ``acc = acc · alpha + p8 @ V_block`` and the row sums **as a second matmul**:
       ``l_acc = l_acc · alpha + p8 @ ones``, ``ones`` a ``[BLOCK_N, 16]`` block of 1.0 (16:
       the narrowest ``tl.dot``), ``l_acc: [BLOCK_M, 16]``, every column the running sum. Both
       dots with ``input_precision="ieee"`` (exact fp32 products; the rounded P is exact in
       fp32);
    4. at the end ``l`` = one column of ``l_acc`` (``tl.max`` along it picks it exactly),
       ``O = acc / l`` (``stride_o`` between rows) and ``LSE = m + log2(l)`` (base 2) for the
       rows below ``n_q``; nothing else is written.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pass  # your code: the key loop (steps 1-3) and the stores (step 4)


def row_sums_attention(s: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
                       lse: torch.Tensor | None = None, block_m: int = 32, block_n: int = 32):
    """Exercise 4.11 (launcher, complete) — ``s: [n_q, n_k]``, ``v: [n_k, D]`` fp32 (``D`` a power
    of two, at least 16) -> ``(out [n_q, D], lse [n_q])`` from `row_sums_kernel`, into ``out``
    and ``lse`` if given."""
    raise NotImplementedError("Exercise 4.11 (row_sums_kernel): not started. Read its docstring; hints: python -m minillm.grade 4 --hint 4.11")
    n_q, n_k = s.shape
    d = v.shape[1]
    out = torch.empty((n_q, d), device=s.device, dtype=torch.float32) if out is None else out
    lse = torch.empty((n_q,), device=s.device, dtype=torch.float32) if lse is None else lse
    row_sums_kernel[(triton.cdiv(n_q, block_m),)](s, v, out, lse, n_q, n_k, s.stride(0), v.stride(0), out.stride(0),
                                                   BLOCK_M=block_m, BLOCK_N=block_n, D=d)
    return out, lse
