"""Chapter 5 exercises: the paged KV cache. Grade your work with ``make grade CH=5``.

Replace each ``raise NotImplementedError(...)`` with your implementation, in plain Python and
NumPy. The tests compare your code with `minillm.paged.BlockManager` (on random sequences of
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

import numpy as np

from minillm.paged import Admission
from minillm.paged.errors import DuplicateSequence, OutOfBlocks, RequestTooLong, UnknownSequence

__all__ = ["Admission", "BlockTables", "DuplicateSequence", "OutOfBlocks", "RequestTooLong", "UnknownSequence",
           "gather_kv", "paged_decode_one", "tile_rows"]

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
        raise NotImplementedError(
            "Exercise 5.1 (can_allocate): needed = ceil(num_tokens / block_size) (-(-n // bs) in integers); "
            "NEVER_FITS if needed > num_blocks, else FITS_NOW if needed <= num_free, else FITS_LATER."
        )

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
        raise NotImplementedError(
            "Exercise 5.1 (allocate): check the duplicate, then use can_allocate to pick the error; only then "
            "pop `needed` blocks from the front of free_list into tables[seq_id] and set lengths[seq_id]."
        )

    def append(self, seq_id) -> int:
        """Append one token to ``seq_id``; return its slot, ``block * block_size + offset``.

        A new block is taken only when the last one is full (the new token's position is a
        multiple of ``block_size``). Raises ``UnknownSequence(seq_id, "append to")`` for a
        sequence that is not live, and ``OutOfBlocks(what, 1, 0, 0, 0)`` if a new block is
        needed and the free list is empty; either way nothing changes.
        """
        raise NotImplementedError(
            "Exercise 5.1 (append): pos = lengths[seq_id] is the new token's position; if pos % block_size == 0 "
            "take a block from the free list (or raise OutOfBlocks); the slot is "
            "table[pos // block_size] * block_size + pos % block_size."
        )

    def free(self, seq_id) -> None:
        """Return every block of ``seq_id`` to the back of the free list and forget the
        sequence. Raises ``UnknownSequence(seq_id, "free")`` for a sequence that is not live."""
        raise NotImplementedError(
            "Exercise 5.1 (free): free_list.extend(the sequence's blocks), then delete tables[seq_id] and "
            "lengths[seq_id]."
        )


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
    raise NotImplementedError(
        "Exercise 5.2 (gather_kv): pos = np.arange(num_tokens); blocks = table[pos // block_size] (check the "
        "bounds and the -1s first); slots = blocks * block_size + pos % block_size; read "
        "k_cache.reshape(-1, kv_heads, head_dim)[slots], then transpose to [kv_heads, num_tokens, head_dim]."
    )


def tile_rows(block_table_row, start: int, block_n: int, seq_len: int, block_size: int, stride_block: int,
              stride_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 5.3 — the address computation of the paged attention kernels (`_tile_rows`).

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
    raise NotImplementedError(
        "Exercise 5.3 (tile_rows): pos = start + np.arange(block_n); row_ok = pos < seq_len. Fast path: "
        "blk = table[start // block_size], offsets start % block_size + arange. General path: blk = zeros, "
        "blk[row_ok] = table[pos[row_ok] // block_size], offsets pos % block_size. "
        "rows = blk * stride_block + offset * stride_offset."
    )


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
    raise NotImplementedError(
        "Exercise 5.4 (paged_decode_one): view q as [kv_heads, group, head_dim]; for block i < ceil(seq_len / "
        "block_size): n = min(block_size, seq_len - i * block_size) keys k = k_cache[table[i], :n] (and v); "
        "s = scale * q @ k^T; m_new = max(m, rowmax(s)); alpha = exp(m - m_new); p = exp(s - m_new); "
        "l = alpha * l + rowsum(p); acc = alpha * acc + p @ v. At the end out = acc / l, lse = m + log(l)."
    )
