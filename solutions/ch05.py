"""Chapter 5 solutions. Try the exercises in ``exercises/ch05.py`` first."""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from minillm.paged import Admission
from minillm.paged.errors import DuplicateSequence, OutOfBlocks, RequestTooLong, UnknownSequence

PAD = -1


class BlockTables:
    """Exercise 5.1: block tables over a fixed pool, with a free list (no sharing, no cache)."""

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
        return len(self.free_list)

    def block_table(self, seq_id) -> list[int]:
        if seq_id not in self.tables:
            raise UnknownSequence(seq_id, "read the block table of")
        return list(self.tables[seq_id])

    def num_tokens(self, seq_id) -> int:
        if seq_id not in self.lengths:
            raise UnknownSequence(seq_id, "read")
        return self.lengths[seq_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> Admission:
        """Exercise 5.1: compare with the free list now, and with the whole pool."""
        if num_tokens < 1:
            raise ValueError(f"a request needs at least one token, got {num_tokens}")
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_blocks:
            return Admission.NEVER_FITS
        return Admission.FITS_NOW if needed <= self.num_free else Admission.FITS_LATER

    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Exercise 5.1: check everything first, then take the blocks from the free list."""
        if seq_id in self.tables:
            raise DuplicateSequence(seq_id, "allocate")
        admission = self.can_allocate(num_tokens)          # ValueError for num_tokens < 1
        needed = self.blocks_needed(num_tokens)
        if admission is Admission.NEVER_FITS:
            raise RequestTooLong(num_tokens, self.block_size, needed, self.num_blocks)
        if admission is Admission.FITS_LATER:
            raise OutOfBlocks(f"allocating sequence {seq_id!r} ({num_tokens} tokens)", needed, self.num_free,
                              self.num_free, 0)
        self.tables[seq_id] = [self.free_list.popleft() for _ in range(needed)]
        self.lengths[seq_id] = num_tokens
        return list(self.tables[seq_id])

    def append(self, seq_id) -> int:
        """Exercise 5.1: a new block only when the last one is full; the new token's slot."""
        if seq_id not in self.tables:
            raise UnknownSequence(seq_id, "append to")
        table, pos = self.tables[seq_id], self.lengths[seq_id]
        if pos % self.block_size == 0:                      # the last block is full (or there is none)
            if not self.free_list:
                raise OutOfBlocks(f"appending to sequence {seq_id!r}", 1, 0, 0, 0)
            table.append(self.free_list.popleft())
        self.lengths[seq_id] = pos + 1
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def free(self, seq_id) -> None:
        """Exercise 5.1: every block back to the free list."""
        if seq_id not in self.tables:
            raise UnknownSequence(seq_id, "free")
        self.free_list.extend(reversed(self.tables.pop(seq_id)))
        del self.lengths[seq_id]


def gather_kv(k_cache: np.ndarray, v_cache: np.ndarray, block_table_row, num_tokens: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 5.2: one slot per position, then one fancy-indexing read of the flat pool."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    table = np.asarray(block_table_row, dtype=np.int64)
    pos = np.arange(num_tokens)
    logical = pos // block_size
    if num_tokens and logical[-1] >= len(table):
        raise ValueError(f"{num_tokens} tokens need {logical[-1] + 1} blocks, the table has {len(table)}")
    physical = table[logical]
    if np.any(physical < 0):
        raise ValueError("a position below num_tokens falls into a padding (-1) entry")
    slots = physical * block_size + pos % block_size
    k = k_cache.reshape(num_blocks * block_size, kv_heads, head_dim)[slots]   # [num_tokens, kv_heads, head_dim]
    v = v_cache.reshape(num_blocks * block_size, kv_heads, head_dim)[slots]
    return k.transpose(1, 0, 2), v.transpose(1, 0, 2)


def tile_rows(block_table_row, start: int, block_n: int, seq_len: int, block_size: int, stride_block: int,
              stride_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 5.3: the kernel's `_tile_rows`, both paths."""
    offs = np.arange(block_n)
    pos = start + offs
    row_ok = pos < seq_len
    if block_size % block_n == 0 and start % block_n == 0:
        # One block holds the whole tile: one table entry, consecutive offsets in it.
        blk = np.int64(block_table_row[start // block_size])
        off = start % block_size + offs
        rows = blk * stride_block + off * stride_offset
    else:
        # One entry per position, read only below the length; block 0 elsewhere (masked anyway).
        blk = np.zeros(block_n, dtype=np.int64)
        if row_ok.any():
            blk[row_ok] = np.asarray(block_table_row[pos[row_ok] // block_size], dtype=np.int64)
        rows = blk * stride_block + (pos % block_size) * stride_offset
    return rows.astype(np.int64), row_ok


def paged_decode_one(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table_row, seq_len: int,
                     scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 5.4: one block of keys at a time, the online softmax across blocks."""
    q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qg = q.reshape(kv_heads, group, head_dim)            # a GQA group's heads side by side
    m = np.full((kv_heads, group), -np.inf)
    l = np.zeros((kv_heads, group))
    acc = np.zeros((kv_heads, group, head_dim))
    for i in range(-(-seq_len // block_size)):
        blk = int(block_table_row[i])
        n = min(block_size, seq_len - i * block_size)    # the last block may be partly filled
        k = k_cache[blk, :n].transpose(1, 0, 2)          # [kv_heads, n, head_dim]
        v = v_cache[blk, :n].transpose(1, 0, 2)
        s = scale * qg @ k.transpose(0, 2, 1)            # [kv_heads, group, n]
        m_new = np.maximum(m, s.max(axis=-1))
        alpha = np.exp(m - m_new)                        # 0 on the first block (m = -inf, m_new finite)
        p = np.exp(s - m_new[..., None])
        l = alpha * l + p.sum(axis=-1)
        acc = alpha[..., None] * acc + p @ v
        m = m_new
    if seq_len == 0:
        return np.zeros((q_heads, head_dim)), np.full(q_heads, -np.inf)
    return (acc / l[..., None]).reshape(q_heads, head_dim), (m + np.log(l)).reshape(q_heads)
