"""Chapter 5 exercises: the paged KV cache. Grade your work with ``make grade CH=5``.

Replace each ``raise NotImplementedError(...)`` with your implementation: in plain Python and
NumPy for Exercises 5.1-5.4; Exercises 5.5 and 5.6 are Triton kernels, whose launchers are
written for you (write the kernel's body, then delete the launcher's ``raise``). The tests compare your code with `minillm.paged.BlockManager` (on random sequences of
operations) and with the float64 references in `minillm.reference.ch05_paged_attention`, on pools
whose blocks are randomly shuffled, with block sizes 1, 3, 7, 16 and more (powers of two are
not special).

The layout is the book's (the `minillm.paged` package docstring): a layer's keys live in
``k_cache: [num_blocks, block_size, kv_heads, head_dim]``; a sequence's **block table** lists
its physical blocks in logical order, padded with ``-1`` past its last block; token ``p``
lives in block ``table[p // block_size]`` at offset ``p % block_size``, which is the **slot**
``table[p // block_size] * block_size + p % block_size`` of the pool viewed as
``[num_blocks * block_size, kv_heads, head_dim]``.
"""
from __future__ import annotations

from collections import deque

import math

import numpy as np
import torch

# First, before Triton: without a GPU, this selects Triton's interpreter.
from minillm.kernels.base import interpreting, tl, triton  # Triton as this machine runs it (no GPU: the interpreter)
from minillm.paged import Admission
from minillm.paged.errors import DuplicateSequence, OutOfBlocks, RequestTooLong, UnknownSequence

__all__ = ["Admission", "BlockTables", "DuplicateSequence", "OutOfBlocks", "RequestTooLong", "UnknownSequence",
           "gather_kv", "paged_decode_one", "tile_rows", "paged_decode", "write_kv"]

PAD = -1  # the padding entry of block tables


class BlockTables:
    """Exercise 5.1 — per-sequence block tables over a fixed pool of blocks, with a free list.

    ``num_blocks`` physical blocks of ``block_size`` token slots each. The data structures are
    set up for you; keep them, the tests read them:

    - ``free_list``: ids of the free blocks. Take new blocks from its front (``popleft``) and
      put freed ones at its back.
    - ``tables[seq_id]``: the physical block ids of a live sequence, in logical order.
    - ``lengths[seq_id]``: how many tokens it holds; it always occupies exactly
      ``ceil(length / block_size)`` blocks, the last one possibly partly filled.

    No sharing between sequences (that is Chapter 6). Every method that fails must raise one
    of the exceptions of `minillm.paged.errors`, imported above, *before changing anything*,
    so that a caller can catch the error and carry on (see each method for which and when).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_list: deque[int] = deque(range(num_blocks))
        self.tables: dict = {}
        self.lengths: dict = {}

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self.free_list)

    def block_table(self, seq_id) -> list[int]:
        """A copy of ``seq_id``'s block table."""
        if seq_id not in self.tables:
            raise UnknownSequence(seq_id, "read the block table of")
        return list(self.tables[seq_id])

    def num_tokens(self, seq_id) -> int:
        """Tokens held by ``seq_id``."""
        if seq_id not in self.lengths:
            raise UnknownSequence(seq_id, "read")
        return self.lengths[seq_id]

    def can_allocate(self, num_tokens: int) -> Admission:
        """Whether a new request of ``num_tokens`` tokens fits: ``Admission.FITS_NOW`` (enough
        free blocks now), ``Admission.FITS_LATER`` (not now, but the pool is big enough: wait
        for others to finish) or ``Admission.NEVER_FITS`` (more blocks than the whole pool).
        Raises ``ValueError`` if ``num_tokens < 1``. Changes nothing."""
        raise NotImplementedError("Exercise 5.1 (can_allocate): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.1")

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Give a new sequence the blocks for its ``num_tokens`` prompt tokens; return a copy
        of its block table.

        Raises, checked in this order, changing nothing:
            ``DuplicateSequence(seq_id, "allocate")`` if ``seq_id`` is live;
            ``ValueError`` if ``num_tokens < 1``;
            ``RequestTooLong(num_tokens, block_size, needed, num_blocks)`` if it can never fit;
            ``OutOfBlocks(what, needed, available, free, 0)`` if it does not fit now (``what``
            is a short description for the message, e.g. ``f"allocating {seq_id!r}"``;
            ``available`` and ``free`` are both the number of free blocks).
        """
        raise NotImplementedError("Exercise 5.1 (allocate): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.1")

    def append(self, seq_id) -> int:
        """Append one token to ``seq_id``; return its slot, ``block * block_size + offset``.

        A new block is taken only when the last one is full (the new token's position is a
        multiple of ``block_size``). Raises ``UnknownSequence(seq_id, "append to")`` for a
        sequence that is not live, and ``OutOfBlocks(what, 1, 0, 0, 0)`` if a new block is
        needed and the free list is empty; either way nothing changes.
        """
        raise NotImplementedError("Exercise 5.1 (append): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.1")

    def free(self, seq_id) -> None:
        """Return every block of ``seq_id`` to the back of the free list and forget the
        sequence. Raises ``UnknownSequence(seq_id, "free")`` for a sequence that is not live."""
        raise NotImplementedError("Exercise 5.1 (free): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.1")


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table_row, num_tokens: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 5.2 — read one sequence's keys and values back through its block table.

    ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``; ``block_table_row``:
    the sequence's block ids (a list or an int array), ``-1`` past its last block;
    ``num_tokens``: its length. Return ``(k, v)``, each ``[kv_heads, num_tokens, head_dim]``:
    the contiguous K and V of Chapters 1–4, position ``p`` read from block
    ``block_table_row[p // block_size]`` at offset ``p % block_size``. Vectorise: no Python
    loop over positions. Raise ``ValueError`` if a position ``< num_tokens`` falls past the
    end of the table or into a ``-1`` entry (NumPy would happily read ``cache[-1]``, the last
    block of the pool, which belongs to someone else).
    """
    raise NotImplementedError("Exercise 5.2 (gather_kv): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.2")


def tile_rows(block_table_row, start: int, block_n: int, seq_len: int, block_size: int, stride_block: int,
              stride_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 5.3 — the address computation of the paged attention kernels (`tile_rows`).

    A kernel program walks a sequence's key positions in tiles of ``block_n``; the tile
    starting at ``start`` (``0 <= start < seq_len``) covers positions ``start … start +
    block_n - 1``, of which those ``>= seq_len`` hold no token. Return ``(rows, row_ok)``,
    both ``[block_n]``:

    - ``row_ok`` (bool): ``position < seq_len``;
    - ``rows`` (int64): the element offset of each position's row in the pool,
      ``block * stride_block + offset * stride_offset`` with ``block = table[p // block_size]``
      and ``offset = p % block_size``. Where ``row_ok`` is False the kernel masks the load
      off, but the address must still lie inside the pool: use block 0 there (any valid
      block id of the table is accepted too).

    The rules of the kernel, which the tests check (``block_table_row`` is an object that
    records what you read: index it, ``block_table_row[i]`` or ``block_table_row[int_array]``,
    and do not convert it whole to an array, which reads every entry):

    - never read a table entry of a position ``>= seq_len``: it may be ``-1``, or lie past
      the end of the table;
    - the fast path: when the tile lies inside one block (``block_size % block_n == 0`` and
      ``start % block_n == 0``) read exactly **one** entry, and its rows are consecutive
      offsets of that block. Otherwise read one entry per position below ``seq_len``.

    ``block_size`` is any integer ``>= 1`` (1, 3, 7, ... as well as powers of two).
    """
    raise NotImplementedError("Exercise 5.3 (tile_rows): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.3")


def paged_decode_one(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table_row, seq_len: int,
                     scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 5.4 — one decode step of one sequence over its paged cache, block by block.

    ``q: [q_heads, head_dim]`` (the newest token's query), ``k_cache, v_cache`` the pool,
    ``block_table_row`` the sequence's table, ``seq_len`` its length (its newest K/V already
    written); ``q_heads`` is a multiple of ``kv_heads`` and query head ``h`` reads KV head
    ``h // (q_heads // kv_heads)`` (GQA). ``scale`` defaults to ``1/sqrt(head_dim)``.

    Return ``(out: [q_heads, head_dim], lse: [q_heads])`` (natural log), as
    `minillm.reference.ch05_paged_attention.paged_decode_attention` computes for one sequence.
    Walk the blocks in table order, one at a time, with Chapter 3's online softmax (running
    max ``m``, sum ``l`` and unscaled output), as the kernel walks its tiles; the last block
    may be partly filled. ``seq_len = 0`` gives ``out = 0`` and ``lse = -inf``.
    """
    raise NotImplementedError("Exercise 5.4 (paged_decode_one): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.4")


# == Exercise 5.5: the paged tile load of the decode kernel =====================================

@triton.jit
def _paged_decode_kernel(Q, K, V, BlockTables, SeqLens, O, LSE,
                         q_heads, group, block_size, max_blocks, scale,
                         stride_kb, stride_ko, stride_kh,
                         HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    """Exercise 5.5 — program ``(b, kv_h)``: decode attention of sequence ``b``'s query heads
    that read KV head ``kv_h``, over its paged cache. Everything is written except the tile
    load: fill in ``k`` and ``v`` in the loop.

    - ``Q, O: [batch, q_heads, HEAD_DIM]`` contiguous; ``LSE: [batch, q_heads]`` float32;
    - ``K, V: [num_blocks, block_size, kv_heads, HEAD_DIM]``, the pool (contiguous, the same
      strides): element ``[blk, off, h, d]`` is at ``blk*stride_kb + off*stride_ko +
      h*stride_kh + d``;
    - ``BlockTables: [batch, max_blocks]`` int32, contiguous, ``-1`` past each sequence's
      blocks; ``SeqLens: [batch]`` int32.

    The tile of positions ``pos = start + offs_n`` (``BLOCK_N`` of them) lives in block
    ``table[pos // block_size]`` at offset ``pos % block_size`` (Exercise 5.3). Positions
    ``>= seq_len`` hold no token: their table entries may be ``-1`` or lie past the table,
    so load neither the entry nor the K/V row there (masks, ``other=0``).
    """
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)                         # the GQA group's heads, padded to 16
    in_group = rows < group
    heads = kv_h * group + tl.minimum(rows, group - 1)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (b * q_heads + heads[:, None]) * HEAD_DIM + offs_d[None, :], mask=in_group[:, None], other=0.0)
    seq_len = tl.load(SeqLens + b)
    table = BlockTables + b * max_blocks                   # this sequence's row of the table
    offs_n = tl.arange(0, BLOCK_N)

    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n
        ok = pos < seq_len
        # ---- Exercise 5.5: your code. k, v: [BLOCK_N, HEAD_DIM], this tile's keys and values
        # of KV head kv_h, read through the block table; 0 where not ok. ----
        k = tl.zeros((BLOCK_N, HEAD_DIM), dtype=Q.dtype.element_ty)   # replace
        v = tl.zeros((BLOCK_N, HEAD_DIM), dtype=Q.dtype.element_ty)   # replace
        # ---- the online softmax of Chapter 3, as in Chapter 2's decode kernel ----
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]       # seq_len 0: out 0, lse -inf
    tl.store(O + (b * q_heads + heads[:, None]) * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=in_group[:, None])
    tl.store(LSE + b * q_heads + heads, m + tl.log(l), mask=in_group)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5.5 — decode attention over a paged cache (the launcher; the exercise is the
    kernel above).

    ``q: [batch, q_heads, head_dim]`` (fp32, fp16 or bf16; ``head_dim`` a power of two >= 16),
    ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]`` contiguous, any block
    size, ``q_heads % kv_heads == 0``; ``block_tables: [batch, max_blocks]`` int32 padded with
    -1; ``seq_lens: [batch]`` int32. Returns ``(out [batch, q_heads, head_dim], lse [batch,
    q_heads] float32)``, as `minillm.reference.ch05_paged_attention.paged_decode_attention`.
    """
    raise NotImplementedError("Exercise 5.5 (_paged_decode_kernel): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.5")
    batch, q_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(batch, q_heads, device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // kv_heads
    _paged_decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, lse,
        q_heads, group, block_size, block_tables.shape[1], scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=16 if interpreting() else 64, IEEE=q.dtype == torch.float32)
    return out, lse


# == Exercise 5.6: the paged KV write ============================================================

@triton.jit
def _write_kv_kernel(K_new, V_new, K_cache, V_cache, Slots, kv_heads, block_size,
                     stride_cb, stride_co, stride_ch,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Exercise 5.6 — program ``t`` stores new token ``t``'s K and V rows in the pool.

    - ``K_new, V_new: [num_tokens, kv_heads, HEAD_DIM]`` contiguous: token ``t``'s rows are
      the ``kv_heads · HEAD_DIM`` elements from ``t · kv_heads · HEAD_DIM`` on;
    - ``K_cache, V_cache: [num_blocks, block_size, kv_heads, HEAD_DIM]`` with the strides
      ``stride_cb`` (block), ``stride_co`` (offset in the block), ``stride_ch`` (head) and 1
      (head dim), the same for both. They may be padded views: slot ``s`` is block
      ``s // block_size``, offset ``s % block_size`` (not row ``s`` of a flat view);
    - ``Slots: [num_tokens]`` int64: token ``t`` goes to slot ``Slots[t]``; ``-1`` means
      padding: write nothing.

    ``BLOCK_H`` is ``kv_heads`` rounded up to a power of two: mask the extra heads. Store in
    the cache's dtype (``.to(K_cache.dtype.element_ty)``).
    """
    pass


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Exercise 5.6 — ``cache[slot // block_size, slot % block_size] = new`` for every new
    token, in place, skipping ``-1`` slots, as `minillm.paged.layout.write_slots` (the
    launcher; the exercise is the kernel above). One program per new token."""
    raise NotImplementedError("Exercise 5.6 (_write_kv_kernel): not started. Read its docstring; hints: python -m minillm.grade 5 --hint 5.6")
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if v_cache.stride() != k_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must have the same strides, head_dim contiguous")
    k_new, v_new, slot_mapping = k_new.contiguous(), v_new.contiguous(), slot_mapping.contiguous()
    if k_new.shape[0] == 0:
        return
    _write_kv_kernel[(k_new.shape[0],)](
        k_new, v_new, k_cache, v_cache, slot_mapping, kv_heads, block_size,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads))
