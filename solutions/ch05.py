"""Chapter 5 solutions. Try the exercises in ``exercises/ch05.py`` first."""
from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

# First, before Triton: without a GPU, this selects Triton's interpreter.
from minillm.kernels.base import interpreting, tl, triton  # Triton as this machine runs it (no GPU: the interpreter)
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
    """Exercise 5.3: the kernel's `tile_rows`, both paths."""
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


# == Exercise 5.5: the paged tile load of the decode kernel =====================================

@triton.jit
def _paged_decode_kernel(Q, K, V, BlockTables, SeqLens, O, LSE,
                         q_heads, group, block_size, max_blocks, scale,
                         stride_kb, stride_ko, stride_kh,
                         HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    """Program ``(b, kv_h)``: the query heads of sequence ``b`` that read KV head ``kv_h``."""
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)                         # the GQA group's heads, padded to 16
    in_group = rows < group
    heads = kv_h * group + tl.minimum(rows, group - 1)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (b * q_heads + heads[:, None]) * HEAD_DIM + offs_d[None, :], mask=in_group[:, None], other=0.0)
    seq_len = tl.load(SeqLens + b)
    table = BlockTables + b * max_blocks
    offs_n = tl.arange(0, BLOCK_N)

    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n
        ok = pos < seq_len
        # The tile's rows through the block table: entry pos // block_size, offset pos % block_size.
        blk = tl.load(table + pos // block_size, mask=ok, other=0).to(tl.int64)
        kv_rows = blk * stride_kb + (pos % block_size) * stride_ko + kv_h * stride_kh
        k = tl.load(K + kv_rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + kv_rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)

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
    """Exercise 5.5: one program per (sequence, KV head); see the kernel."""
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
    """Program ``t``: token ``t``'s K and V rows to slot ``Slots[t]`` (nothing for -1)."""
    t = tl.program_id(0)
    slot = tl.load(Slots + t)
    heads = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    mask = (heads < tl.where(slot >= 0, kv_heads, 0)) & (offs_d < HEAD_DIM)   # [BLOCK_H, HEAD_DIM]
    src = (t * kv_heads + heads) * HEAD_DIM + offs_d                  # k_new[t, heads, :]
    blk = (slot // block_size).to(tl.int64)
    dst = blk * stride_cb + (slot % block_size) * stride_co + heads * stride_ch + offs_d
    tl.store(K_cache + dst, tl.load(K_new + src, mask=mask).to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + dst, tl.load(V_new + src, mask=mask).to(V_cache.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Exercise 5.6: one program per new token."""
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
