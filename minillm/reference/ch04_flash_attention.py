"""Chapter 4 reference: FlashAttention-2, forward and backward, in NumPy.

Everything here is float64 and written to be read next to the chapter and the Triton
kernels it mirrors (`minillm.kernels.ch04_flash_attention`, `minillm.kernels.ch04_flash_attention`).
Chapter 3's `minillm.reference.ch03_online_softmax` did the arithmetic of tiled attention in
FlashAttention-1's loop order; FlashAttention-2 (Dao, 2023) keeps that arithmetic and
changes how the work is organised:

1. **One program per Q block.** The outer loop runs over blocks of queries, the inner one
   over blocks of keys. A Q block's running state ``(O, ℓ, m)`` never leaves the program,
   so it is read and written exactly once (`fa2_forward`; pass an `HBM` to see the count).
2. **Unscaled O.** The accumulator is ``Σ exp(s - m)·v``, not yet divided by ``ℓ``; a K/V
   block only rescales it by ``exp(m_old - m_new)`` and the one division by ``ℓ`` waits
   until the end (`fa2_tile_step`, `fa2_finalize`). `minillm.costs.nonmatmul_flops` counts what that saves
   against FlashAttention-1's step (`fa1_tile_step`), which renormalises every time.
3. **Only L is saved.** The forward returns ``L = m + log ℓ`` per row; the backward
   recomputes each tile of probabilities as ``P = exp(S - L)`` (`recompute_probs`).
4. **Warps split Q, not K.** Inside a program, giving each warp its own rows of Q means the
   warps never exchange partial results (`simulate_warp_split`; `minillm.costs.warp_partition_traffic`
   is its closed form).

Two more ingredients of the kernels are here too. **Block skipping**: with a causal mask or
a sliding window many (Q block, K block) pairs see nothing at all, and many see everything;
`classify_blocks` sorts the pairs into skip / masked / full, and only the masked ones build
a mask. **The backward** (`fa2_backward`) in the kernels' layout: one program per K/V block
accumulates dK and dV (summing over a GQA group's query heads), and one program per Q block
accumulates dQ.

Shapes follow `minillm.reference.ch01_naive_attention`: ``q: [batch, q_heads, q_len, head_dim]``,
``k, v: [batch, kv_heads, kv_len, head_dim]`` with ``q_heads`` a multiple of ``kv_heads``
(query head ``h`` reads KV head ``h // (q_heads // kv_heads)``), positions bottom-right
aligned: query ``i`` sits at position ``kv_len - q_len + i``. Inside a tile, ``r`` is its
number of query rows (``<= block_m``), ``c`` its number of keys (``<= block_n``) and ``d``
the head dim. Where the kernels work in base 2 (``exp2``, with ``log2 e`` folded into the
scale), this file uses natural ``exp`` and ``log``: the same numbers, written plainly.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from minillm.reference.ch01_naive_attention import attention_mask, kv_head_for
from minillm.reference.ch03_online_softmax import HBM

__all__ = [
    "FULL", "MASKED", "SKIP", "SharedMemory", "backward_delta", "block_slices", "classify_blocks", "fa1_finalize",
    "fa1_tile_step", "fa2_backward", "fa2_backward_tile", "fa2_finalize", "fa2_forward", "fa2_tile_step",
    "check_warp_split", "kernel_kv_segments", "recompute_probs", "simulate_warp_split",
]

#: What a program does with one (Q block, K block) pair, the codes of `classify_blocks`:
#: ``SKIP`` (no query of the block sees any key of the block: the K/V tile is never loaded),
#: ``MASKED`` (some pairs are visible, some not: the tile is computed and then masked) and
#: ``FULL`` (every query sees every key: the tile is computed without building a mask).
SKIP, MASKED, FULL = 0, 1, 2


# ----------------------------------------------------------------------------------------
# Blocks, and which of them a program must visit
# ----------------------------------------------------------------------------------------
def block_slices(n: int, block: int) -> list[slice]:
    """``[0, n)`` cut into consecutive blocks of ``block`` indices; the last one is shorter
    when ``block`` does not divide ``n`` (the kernels pad it and mask the padding instead)."""
    if block < 1:
        raise ValueError(f"block sizes must be >= 1, got {block}")
    return [slice(start, min(start + block, n)) for start in range(0, n, block)]


def _visible_keys(pos: int, kv_len: int, causal: bool, window: int | None) -> tuple[int, int]:
    """The keys the query at position ``pos`` sees: the half-open range ``[lo, hi)`` (empty
    when ``lo >= hi``), with the rules of `minillm.reference.ch01_naive_attention_mask`: causal hides
    keys after ``pos``, a window ``W`` hides keys ``W`` or more positions away."""
    lo, hi = 0, kv_len
    if causal:
        hi = min(hi, pos + 1)
    if window is not None:
        lo = max(lo, pos - window + 1)
        if not causal:
            hi = min(hi, pos + window)
    return lo, hi


def classify_blocks(q_len: int, kv_len: int, block_m: int, block_n: int, causal: bool = False,
                    window: int | None = None) -> np.ndarray:
    """Sort every (Q block, K block) pair into `SKIP`, `MASKED` or `FULL`.

    Returns an int8 array ``[⌈q_len / block_m⌉, ⌈kv_len / block_n⌉]`` of those codes, for
    blocks as `block_slices` cuts them (a ragged last block is just smaller). The rule is
    exact: a pair is ``SKIP`` iff every (query, key) pair in it is masked and ``FULL`` iff
    none is.

    It needs no mask, only two intervals per Q block. The keys a query sees form one range
    ``[lo(p), hi(p))`` whose both ends move right as the position ``p`` grows, by at most
    one key per row. So over the rows ``p_first … p_last`` of a Q block, the keys that
    *some* row sees are ``[lo(p_first), hi(p_last))`` (the ranges overlap from one row to the
    next: their union has no gap) and the keys that *every* row sees are
    ``[lo(p_last), hi(p_first))``. A K block outside the first range is skipped; one inside
    the second is full; anything else straddles an edge (the causal diagonal, a window's
    edge) and needs the mask. For causal attention with ``q_len = kv_len`` and square blocks
    this is the familiar picture: full below the diagonal, masked on it, skipped above.

    The Triton kernels make the same decision with the same two intervals (`_kv_segments`,
    mirrored by `kernel_kv_segments`), but their tiles always have ``BLOCK_M × BLOCK_N``
    entries. Two consequences, both on the ragged edges only: a K block that runs past
    ``kv_len`` is masked there (its padding keys must be hidden) where this function, whose
    blocks stop at ``kv_len``, may call it full; and with a window the padding rows past
    ``q_len`` widen the "every row" interval's lower edge, so the last Q block may mask a
    block that is full for its real rows. The skipped blocks are the same.
    """
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block sizes must be >= 1, got block_m={block_m}, block_n={block_n}")
    offset = kv_len - q_len                       # bottom-right alignment: row i sits at i + offset
    q_blocks, k_blocks = block_slices(q_len, block_m), block_slices(kv_len, block_n)
    classes = np.full((len(q_blocks), len(k_blocks)), SKIP, dtype=np.int8)
    for i, rows in enumerate(q_blocks):
        first, last = rows.start + offset, rows.stop - 1 + offset        # positions of its first and last row
        (first_lo, first_hi), (last_lo, last_hi) = (_visible_keys(p, kv_len, causal, window) for p in (first, last))
        some_lo, some_hi = first_lo, last_hi     # keys that some row of the block sees
        every_lo, every_hi = last_lo, first_hi   # keys that every row of the block sees
        if some_lo >= some_hi:                    # no row of this block sees any key
            continue
        for j, cols in enumerate(k_blocks):
            if cols.stop <= some_lo or cols.start >= some_hi:
                classes[i, j] = SKIP
            elif every_lo <= cols.start and cols.stop <= every_hi:
                classes[i, j] = FULL
            else:
                classes[i, j] = MASKED
    return classes


def kernel_kv_segments(start_m: int, q_len: int, kv_len: int, block_m: int, block_n: int, causal: bool = False,
                       window: int | None = None) -> tuple[int, int, int, int]:
    """The forward kernel's loop bounds for the program whose rows start at ``start_m``: a
    line-by-line Python port of `_kv_segments` and `_segments` in
    `minillm.kernels.ch04_flash_attention`, kept here so the tests can hold the kernel's block
    skipping against `classify_blocks`.

    Returns ``lo <= full_lo <= full_hi <= hi`` (key indices): the program runs masked tiles
    at ``lo, lo + block_n, …`` below ``full_lo``, unmasked tiles from ``full_lo`` to
    ``full_hi`` and masked tiles from ``full_hi`` up to ``hi``; every other K block is
    skipped. The interval ends come from the positions of the tile's first and last row,
    ``p0`` and ``p1 = p0 + block_m - 1`` (padding rows included)."""
    p0 = start_m + (kv_len - q_len)
    p1 = p0 + block_m - 1
    first, all_first = (p0 - window + 1, p1 - window + 1) if window is not None else (0, 0)
    if causal:
        end, all_end = min(p1 + 1, kv_len), min(p0 + 1, kv_len)
    elif window is not None:
        end, all_end = min(p1 + window, kv_len), min(p0 + window, kv_len)
    else:
        end, all_end = kv_len, kv_len
    lo = max(first, 0) // block_n * block_n
    hi = max(end, lo)
    full_lo = min((max(all_first, 0) + block_n - 1) // block_n * block_n, hi)
    full_hi = min(max(max(all_end, 0) // block_n * block_n, full_lo), hi)
    return lo, full_lo, full_hi, hi


# ----------------------------------------------------------------------------------------
# The forward: one tile step with an unscaled accumulator, and the end of a program
# ----------------------------------------------------------------------------------------
def _safe_max(m: np.ndarray) -> np.ndarray:
    """The max to subtract: ``m``, or 0 where ``m = -inf`` (the row has seen no visible key),
    so that ``-inf - (-inf) = NaN`` never happens; the ``exp`` it feeds is then 0."""
    return np.where(np.isneginf(m), 0.0, m)


def fa2_tile_step(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, acc: np.ndarray, l: np.ndarray, m: np.ndarray,
                  scale: float, visible: np.ndarray | None = None, flops: Counter | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold one K/V block into a Q block's running state, FlashAttention-2's way.

    ``q_i: [r, d]``, ``k_j, v_j: [c, d]``; the state of the ``r`` rows: ``acc: [r, d]``, the
    *unscaled* output ``Σ exp(s - m)·v`` over the keys seen so far, and ``l, m: [r]``, the
    sum of ``exp(s - m)`` and the running max (``0, 0, -inf`` before the first block).
    ``visible``: bool ``[r, c]`` (False = masked) or None for a `FULL` block. Returns the new
    ``(acc, l, m)``::

        S = scale · q_i k_jᵀ                   (masked entries -> -inf)
        m_new = max(m, rowmax(S))
        P = exp(S - m_new)
        α = exp(m - m_new)                     (how much the old state shrinks)
        ℓ_new = α·ℓ + rowsum(P)
        acc_new = α·acc + P v_j                (no division: that waits for `fa2_finalize`)

    Chapter 3's `tile_step` (here `fa1_tile_step`) also divides by ``ℓ_new`` and multiplies
    the new term by ``exp(m̃ - m_new)``: an ``[r, d]`` division and an ``[r, d]`` multiply per
    step that this version does not need. Pass a `collections.Counter` as ``flops`` to
    have the step's floating-point operations added to it (see `minillm.costs.nonmatmul_flops`).
    """
    s = scale * (q_i @ k_j.T)                                   # [r, c]
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m_new = np.maximum(m, np.max(s, axis=-1, initial=-np.inf))
    m_sub = _safe_max(m_new)
    p = np.exp(s - m_sub[:, None])                              # 0 at masked entries
    alpha = np.exp(m - m_sub)                                   # 0 while m = -inf: nothing to rescale
    l_new = alpha * l + p.sum(axis=-1)
    acc_new = alpha[:, None] * acc + p @ v_j
    if flops is not None:   # what the lines above cost, for an [r, c] tile and head dim d
        (r, c), d = s.shape, v_j.shape[1]
        flops["matmul"] += 2 * r * c * d + 2 * r * c * d      # q kᵀ and P v: a multiply-add is 2 FLOPs
        flops["mul"] += r * c + r + r * d                     # scale·S, α·ℓ, α·acc
        flops["max"] += r * c                                 # rowmax(S) (c - 1 per row) and max with m (1)
        flops["add"] += r * c + r + r * c + r * d             # S - m_new, m - m_new, rowsum(P) + α·ℓ, α·acc + P v
        flops["exp"] += r * c + r                             # P and α
    return acc_new, l_new, m_new


def fa2_finalize(acc: np.ndarray, l: np.ndarray, m: np.ndarray, flops: Counter | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The end of a Q block's program: ``(acc, l, m)`` of `fa2_tile_step` -> ``(o, lse)``.

    ``o = acc / ℓ`` (``[r, d]``: the one division per row and head dim of FlashAttention-2)
    and ``lse = m + log ℓ`` (``[r]``, natural log: the single statistic the backward needs).
    A row that saw no visible key has ``ℓ = 0, m = -inf``: its output is 0 and its lse
    ``-inf``, as in `minillm.reference.ch01_naive_attention`."""
    o = acc / np.where(l == 0, 1.0, l)[:, None]
    with np.errstate(divide="ignore"):
        lse = m + np.log(l)
    if flops is not None:
        r, d = acc.shape
        flops["div"] += r * d
        flops["log"] += r
        flops["add"] += r
    return o, lse


def fa1_tile_step(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, o: np.ndarray, l: np.ndarray, m: np.ndarray,
                  scale: float, visible: np.ndarray | None = None, flops: Counter | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashAttention-1's tile step (line 12 of the 2022 paper's Algorithm 1), the same
    arithmetic as Chapter 3's `minillm.reference.ch03_online_softmax.tile_step`, with its FLOPs
    counted for comparison with `fa2_tile_step`.

    ``o: [r, d]`` is the *normalised* output so far; the other arguments and the returned
    ``(o, l, m)`` are as in `fa2_tile_step`::

        m̃ = rowmax(S),  P̃ = exp(S - m̃),  ℓ̃ = rowsum(P̃)
        m_new = max(m, m̃),  α = exp(m - m_new),  β = exp(m̃ - m_new)
        ℓ_new = α·ℓ + β·ℓ̃
        o_new = diag(ℓ_new)⁻¹ (diag(ℓ·α) o + β·P̃ v_j)
    """
    s = scale * (q_i @ k_j.T)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m_tile = np.max(s, axis=-1, initial=-np.inf)
    p = np.exp(s - _safe_max(m_tile)[:, None])
    l_tile = p.sum(axis=-1)
    m_new = np.maximum(m, m_tile)
    m_sub = _safe_max(m_new)
    alpha, beta = np.exp(m - m_sub), np.exp(m_tile - m_sub)
    l_new = alpha * l + beta * l_tile
    o_new = ((l * alpha)[:, None] * o + beta[:, None] * (p @ v_j)) / np.where(l_new == 0, 1.0, l_new)[:, None]
    if flops is not None:
        (r, c), d = s.shape, v_j.shape[1]
        flops["matmul"] += 2 * r * c * d + 2 * r * c * d      # q kᵀ and P̃ v
        flops["mul"] += r * c + 2 * r + r + 2 * r * d         # scale·S, α·ℓ and β·ℓ̃, ℓ·α, o's two terms
        flops["max"] += r * c                                 # rowmax(S) (c - 1 per row) and max with m (1)
        flops["add"] += r * c + 2 * r + r * c + r * d         # S - m̃, the two exponents, ℓ̃ and ℓ_new, o's sum
        flops["exp"] += r * c + 2 * r                         # P̃, α and β
        flops["div"] += r * d                                 # the renormalisation, every step
    return o_new, l_new, m_new


def fa1_finalize(o: np.ndarray, l: np.ndarray, m: np.ndarray, flops: Counter | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The end of FlashAttention-1's row: ``o`` is already normalised; only ``lse = m + log ℓ``
    is left (counted like `fa2_finalize`'s, so that the two styles differ only where they
    really do)."""
    with np.errstate(divide="ignore"):
        lse = m + np.log(l)
    if flops is not None:
        flops["log"] += l.size
        flops["add"] += l.size
    return o, lse


# ----------------------------------------------------------------------------------------
# The forward: the loops
# ----------------------------------------------------------------------------------------
def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    kv_head_for(0, q.shape[1], k.shape[1])          # raises unless q_heads is a multiple of kv_heads


def _forward_program(mem: HBM, b: int, h: int, kv_h: int, rows: slice, block_classes: np.ndarray,
                     k_blocks: list[slice], visible: np.ndarray, scale: float, flops: Counter | None) -> None:
    """One program of the forward kernel: rows ``rows`` of query head ``h`` of sequence ``b``.

    Loads its Q block once, streams past it the K/V blocks of KV head ``kv_h`` that
    ``block_classes`` (its row of `classify_blocks`) does not skip, building a mask only for
    the `MASKED` ones, and writes its output rows and their lse once."""
    q_i = mem.read("q", (b, h, rows))
    n_rows, head_dim = q_i.shape
    acc, l, m = np.zeros((n_rows, head_dim)), np.zeros(n_rows), np.full(n_rows, -np.inf)
    for j, cols in enumerate(k_blocks):
        if block_classes[j] == SKIP:            # nothing visible: the tile is never even loaded
            continue
        k_j, v_j = mem.read("k", (b, kv_h, cols)), mem.read("v", (b, kv_h, cols))
        tile_visible = visible[rows, cols] if block_classes[j] == MASKED else None
        acc, l, m = fa2_tile_step(q_i, k_j, v_j, acc, l, m, scale, tile_visible, flops)
    o_i, lse_i = fa2_finalize(acc, l, m, flops)
    mem.write("o", (b, h, rows), o_i)
    mem.write("lse", (b, h, rows), lse_i)


def fa2_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False, scale: float | None = None,
                block_m: int = 64, block_n: int = 64, window: int | None = None, *,
                flops: Counter | None = None, hbm: HBM | None = None) -> tuple[np.ndarray, np.ndarray]:
    """FlashAttention-2's forward pass; returns ``(o, lse)`` like `minillm.reference.ch01_naive_attention`.

    - ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads, kv_len, head_dim]``
      (GQA/MQA: ``q_heads`` a multiple of ``kv_heads``; K/V are indexed, never repeated);
    - ``causal``: bottom-right aligned (query ``i`` sees keys ``<= kv_len - q_len + i``);
      ``window=W``: only keys fewer than ``W`` positions away;
    - ``scale`` defaults to ``1/sqrt(head_dim)``; ``block_m``, ``block_n``: rows per Q block
      and keys per K/V block (any sizes; the last block of each axis may be partial).

    Returns ``o: [batch, q_heads, q_len, head_dim]`` and ``lse: [batch, q_heads, q_len]``
    (natural log; a row that sees no key gets ``o = 0`` and ``lse = -inf``).

    The loops are the kernel's grid: for every (sequence, query head, Q block) one
    independent program (`_forward_program`), which keeps its state in "registers" from its
    first K/V block to its last. Pass a `collections.Counter` as ``flops`` to count the
    arithmetic, and an `HBM` as ``hbm`` to count the traffic (arrays ``q, k, v, o, lse``):
    Q is read once and O and lse written once, while each KV head's K and V are read once
    per query head and Q block that does not skip them.
    """
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    _check_shapes(q, k, v)
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    classes = classify_blocks(q_len, kv_len, block_m, block_n, causal, window)
    visible = attention_mask(q_len, kv_len, causal, window)     # read only on MASKED tiles
    k_blocks = block_slices(kv_len, block_n)

    mem = hbm if hbm is not None else HBM()
    mem.arrays.update(q=q, k=k, v=v, o=np.full(q.shape, np.nan), lse=np.full(q.shape[:3], np.nan))
    for b in range(batch):
        for h in range(q_heads):
            kv_h = kv_head_for(h, q_heads, kv_heads)
            for i, rows in enumerate(block_slices(q_len, block_m)):     # one program per Q block
                _forward_program(mem, b, h, kv_h, rows, classes[i], k_blocks, visible, scale, flops)
    return mem.arrays["o"], mem.arrays["lse"]


# ----------------------------------------------------------------------------------------
# Change (4): how a program's warps share a tile
# ----------------------------------------------------------------------------------------
class SharedMemory(HBM):
    """`HBM`'s counting store standing for one program's shared memory: every element a warp
    writes there or reads from there is counted per name, and `barrier` counts the
    ``__syncthreads()`` that must separate a write from another warp's read of it."""

    def __init__(self, **arrays: np.ndarray):
        super().__init__(**arrays)
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1


def check_warp_split(block_m: int, block_n: int, warps: int, split: str) -> None:
    """Raise ValueError unless ``split`` is ``"q"`` or ``"k"`` and ``warps`` divides ``block_m``
    (and, for ``"k"``, ``block_n``)."""
    if split not in ("q", "k"):
        raise ValueError(f"split must be 'q' (FlashAttention-2) or 'k' (FlashAttention-1), got {split!r}")
    if warps < 1 or block_m % warps or (split == "k" and block_n % warps):
        also = f" and block_n={block_n}" if split == "k" else ""
        raise ValueError(f"{warps} warps must divide block_m={block_m}{also}")


def simulate_warp_split(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, scale: float, warps: int, split: str
                        ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], SharedMemory]:
    """One tile step (from the empty state) with the work divided among ``warps`` warps,
    each a separate NumPy computation that can only share data through a `SharedMemory`.

    ``q_i: [r, d]``, ``k_j, v_j: [c, d]`` (the operand tiles, already in shared memory).
    Returns ``((acc, l, m), smem)``: the state `fa2_tile_step` would give and the counting
    store, whose arrays ``q, k, v`` count operand reads and ``max, sum, out`` the partial
    results exchanged between warps.

    - ``split="q"`` (FlashAttention-2): warp ``w`` owns rows ``w·r/W …`` of Q. It reads its
      rows and all of K and V, and everything it computes (its rows of S, their max and sum,
      its rows of the output) is its own: nothing is exchanged, no barrier.
    - ``split="k"`` (FlashAttention-1's "sliced-K"): warp ``w`` owns keys ``w·c/W …`` of K
      and V and reads all of Q. Each warp then holds a slice of every row, so (a) the row
      maxima must be exchanged before anyone can exponentiate against the common max,
      barrier; (b) each warp's partial row sums and partial ``P V`` products (a full
      ``[r, d]`` each) go to shared memory, barrier, and warp ``w`` adds up the ``W``
      partials of its share of the rows.

    (Split-K could also postpone the exchange: each warp keeps its own running ``(m, ℓ, O)``
    over all the K/V blocks and they merge once at the end, like Chapter 3's
    `merge_partials`; but then every warp holds an ``[r, d]`` accumulator, ``W`` times the
    registers of split-Q.)"""
    r, c = q_i.shape[0], k_j.shape[0]
    check_warp_split(r, c, warps, split)
    smem = SharedMemory(q=q_i, k=k_j, v=v_j)
    acc, l, m = np.zeros((r, v_j.shape[1])), np.zeros(r), np.full(r, -np.inf)
    rows_of = block_slices(r, r // warps)                           # rows_of[w]: warp w's rows
    if split == "q":
        for rows in rows_of:
            q_w, k_w, v_w = smem.read("q", rows), smem.read("k", slice(None)), smem.read("v", slice(None))
            acc[rows], l[rows], m[rows] = fa2_tile_step(q_w, k_w, v_w, acc[rows], l[rows], m[rows], scale)
        return (acc, l, m), smem

    cols_of = block_slices(c, c // warps)
    smem.arrays.update(max=np.empty((warps, r)), sum=np.empty((warps, r)), out=np.empty((warps, r, v_j.shape[1])))
    scores = []
    for w, cols in enumerate(cols_of):                  # (a) each warp: its slice of S, its partial maxima
        s_w = scale * (smem.read("q", slice(None)) @ smem.read("k", cols).T)
        scores.append(s_w)
        smem.write("max", w, s_w.max(axis=-1))
    smem.barrier()
    for w, cols in enumerate(cols_of):                  # (b) the common max, partial sums and outputs
        m = smem.read("max", slice(None)).max(axis=0)   # every warp needs the max of every row
        p_w = np.exp(scores[w] - m[:, None])
        smem.write("sum", w, p_w.sum(axis=-1))
        smem.write("out", w, p_w @ smem.read("v", cols))
    smem.barrier()
    for rows in rows_of:                                # warp w adds up the partials of its rows
        l[rows] = smem.read("sum", (slice(None), rows)).sum(axis=0)
        acc[rows] = smem.read("out", (slice(None), rows)).sum(axis=0)
    return (acc, l, m), smem


# ----------------------------------------------------------------------------------------
# The backward
# ----------------------------------------------------------------------------------------
def backward_delta(o: np.ndarray, do: np.ndarray) -> np.ndarray:
    """The backward's preprocess: ``D = rowsum(dO ∘ O)``, one number per query row.

    ``o, do: [..., q_len, head_dim]`` -> ``[..., q_len]``. It stands for ``Σ_j P_ij dP_ij``,
    the term the softmax's Jacobian subtracts (``dS = P ∘ (dP - D)``): since
    ``dP = dO Vᵀ`` and ``O = P V``, ``Σ_j P_ij (dO V ᵀ)_ij = dO_i · O_i``, so it costs one
    dot product per row instead of a pass over a row of P."""
    return np.sum(np.asarray(o, dtype=np.float64) * np.asarray(do, dtype=np.float64), axis=-1)


def recompute_probs(q_i: np.ndarray, k_j: np.ndarray, lse_i: np.ndarray, scale: float,
                    visible: np.ndarray | None = None) -> np.ndarray:
    """One tile of the attention probabilities, rebuilt from the forward's logsumexp:
    ``P = exp(scale · q_i k_jᵀ - L)``, ``[r, c]`` for ``q_i: [r, d]``, ``k_j: [c, d]``,
    ``lse_i: [r]``; 0 where ``visible`` (bool ``[r, c]``, or None for all) is False.

    No max, no sum: L already holds the whole row's normalisation. A row that saw no key has
    ``L = -inf``, which would make ``exp(s - L) = inf``; its probabilities are 0 instead
    (subtracting ``+inf`` gives ``exp(-inf) = 0``)."""
    s = scale * (q_i @ k_j.T)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    return np.exp(s - np.where(np.isneginf(lse_i), np.inf, lse_i)[:, None])


def fa2_backward_tile(q_i: np.ndarray, k_j: np.ndarray, v_j: np.ndarray, do_i: np.ndarray, lse_i: np.ndarray,
                      delta_i: np.ndarray, scale: float, visible: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradient contributions of one (Q block, K/V block) pair.

    ``q_i, do_i: [r, d]``, ``k_j, v_j: [c, d]``, ``lse_i, delta_i: [r]`` (the forward's L
    and `backward_delta`'s D for these rows), ``visible`` as in `recompute_probs`. Returns
    ``(dq_ij: [r, d], dk_ij: [c, d], dv_ij: [c, d])``::

        P  = exp(scale · q_i k_jᵀ - L)          (recomputed, never stored)
        dV = Pᵀ dO
        dP = dO v_jᵀ
        dS = P ∘ (dP - D)
        dQ = scale · dS k_j,   dK = scale · dSᵀ q_i

    Summed over all K/V blocks, ``dq_ij`` is dQ of the rows; summed over all Q blocks (and
    a GQA group's query heads), ``dk_ij`` and ``dv_ij`` are dK and dV of the keys. (The
    kernels apply ``scale`` once, to the finished sums; here each term is complete.)"""
    p = recompute_probs(q_i, k_j, lse_i, scale, visible)      # [r, c]
    dv = p.T @ do_i
    dp = do_i @ v_j.T
    ds = p * (dp - delta_i[:, None])
    return scale * (ds @ k_j), scale * (ds.T @ q_i), dv


def _dkdv_program(q, k, v, do, lse, delta, b: int, kv_h: int, cols: slice, group: int, q_blocks: list[slice],
                  block_classes: np.ndarray, visible: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One program of the dK/dV kernel: keys ``cols`` of KV head ``kv_h`` of sequence ``b``.

    K_j and V_j stay put; the Q blocks of every query head that reads this KV head stream
    past (``block_classes``: this K block's column of `classify_blocks`), and dK, dV
    accumulate in "registers": summing over the ``group`` heads happens right here."""
    k_j, v_j = k[b, kv_h, cols], v[b, kv_h, cols]
    dk, dv = np.zeros(k_j.shape), np.zeros(v_j.shape)
    for h in range(kv_h * group, (kv_h + 1) * group):       # the query heads of this KV head's group
        for i, rows in enumerate(q_blocks):
            if block_classes[i] == SKIP:
                continue
            tile_visible = visible[rows, cols] if block_classes[i] == MASKED else None
            _, dk_ij, dv_ij = fa2_backward_tile(q[b, h, rows], k_j, v_j, do[b, h, rows], lse[b, h, rows],
                                                delta[b, h, rows], scale, tile_visible)
            dk += dk_ij
            dv += dv_ij
    return dk, dv


def _dq_program(q, k, v, do, lse, delta, b: int, h: int, kv_h: int, rows: slice, k_blocks: list[slice],
                block_classes: np.ndarray, visible: np.ndarray, scale: float) -> np.ndarray:
    """One program of the dQ kernel: rows ``rows`` of query head ``h``, visiting the same
    K/V blocks as the forward did (``block_classes``: this Q block's row of
    `classify_blocks`), accumulating ``dQ = Σ_j scale · dS_ij K_j``."""
    dq = np.zeros(q[b, h, rows].shape)
    for j, cols in enumerate(k_blocks):
        if block_classes[j] == SKIP:
            continue
        tile_visible = visible[rows, cols] if block_classes[j] == MASKED else None
        dq_ij, _, _ = fa2_backward_tile(q[b, h, rows], k[b, kv_h, cols], v[b, kv_h, cols], do[b, h, rows],
                                        lse[b, h, rows], delta[b, h, rows], scale, tile_visible)
        dq += dq_ij
    return dq


def fa2_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray, lse: np.ndarray, do: np.ndarray,
                 causal: bool = False, scale: float | None = None, block_m: int = 64, block_n: int = 64,
                 window: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashAttention-2's backward pass: ``(dq, dk, dv)`` given ``do = ∂loss/∂o``.

    ``q, k, v`` and the options as given to `fa2_forward`; ``o: [batch, q_heads, q_len,
    head_dim]`` and ``lse: [batch, q_heads, q_len]`` as it returned them; ``do`` shaped like
    ``o``. Returns ``dq`` shaped like ``q`` and ``dk, dv`` shaped like ``k, v`` (under GQA the
    sum over each group's query heads). Rows with ``lse = -inf`` (no visible key)
    contribute nothing; keys no query sees get zero gradients.

    The layout of `minillm.kernels.ch04_flash_attention`:

    1. preprocess: ``D = rowsum(dO ∘ O)`` (`backward_delta`);
    2. one program per (sequence, KV head, K/V block) accumulates dK and dV over the Q
       blocks of all the group's query heads that see it (`_dkdv_program`);
    3. one program per (sequence, query head, Q block) accumulates dQ over the K/V blocks it
       sees (`_dq_program`).

    Every program skips the pairs `classify_blocks` skips and masks only the masked ones.
    P is recomputed in both 2 and 3 (the kernels' trade: 7 matmuls per tile pair instead
    of 5, in exchange for no atomic adds into dQ).
    """
    q, k, v, o, do = (np.asarray(t, dtype=np.float64) for t in (q, k, v, o, do))
    lse = np.asarray(lse, dtype=np.float64)
    _check_shapes(q, k, v)
    if o.shape != q.shape or do.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"o {o.shape} and do {do.shape} must be q's shape {q.shape}, lse {lse.shape} {q.shape[:3]}")
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    classes = classify_blocks(q_len, kv_len, block_m, block_n, causal, window)
    visible = attention_mask(q_len, kv_len, causal, window)
    q_blocks, k_blocks = block_slices(q_len, block_m), block_slices(kv_len, block_n)

    delta = backward_delta(o, do)                                            # 1. preprocess
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(batch):
        for kv_h in range(kv_heads):                                         # 2. dK, dV
            for j, cols in enumerate(k_blocks):
                dk[b, kv_h, cols], dv[b, kv_h, cols] = _dkdv_program(
                    q, k, v, do, lse, delta, b, kv_h, cols, group, q_blocks, classes[:, j], visible, scale)
        for h in range(q_heads):                                             # 3. dQ
            kv_h = kv_head_for(h, q_heads, kv_heads)
            for i, rows in enumerate(q_blocks):
                dq[b, h, rows] = _dq_program(q, k, v, do, lse, delta, b, h, kv_h, rows, k_blocks, classes[i],
                                             visible, scale)
    return dq, dk, dv
