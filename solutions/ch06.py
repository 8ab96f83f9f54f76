"""Chapter 6 solutions. Try the exercises in ``exercises/ch06.py`` first."""
from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# First, before Triton: without a GPU, this selects Triton's interpreter.
from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


# == Exercise 6.1 ===============================================================================

@dataclass
class BlockTables:
    """The state of a miniature block manager (the same as in ``exercises/ch06.py``)."""

    num_blocks: int
    block_size: int
    tables: dict = field(default_factory=dict)
    lengths: dict = field(default_factory=dict)
    ref_counts: list = field(init=False)
    free_list: deque = field(init=False)

    def __post_init__(self):
        self.ref_counts = [0] * self.num_blocks
        self.free_list = deque(range(self.num_blocks))

    def allocate_block(self) -> int:
        if not self.free_list:
            raise RuntimeError("out of blocks")
        block = self.free_list.popleft()
        self.ref_counts[block] = 1
        return block

    def add_sequence(self, seq_id, num_tokens: int) -> None:
        if seq_id in self.tables or num_tokens < 1:
            raise ValueError(f"cannot add sequence {seq_id!r} of {num_tokens} tokens")
        self.tables[seq_id] = [self.allocate_block() for _ in range(-(-num_tokens // self.block_size))]
        self.lengths[seq_id] = num_tokens


def fork(bt: BlockTables, parent, child) -> None:
    """Exercise 6.1: the child points at the parent's blocks; each gains one reference."""
    table = bt.tables[parent]
    for block in table:
        bt.ref_counts[block] += 1
    bt.tables[child] = list(table)
    bt.lengths[child] = bt.lengths[parent]


def append_slot(bt: BlockTables, seq_id) -> tuple[int, tuple[int, int] | None]:
    """Exercise 6.1: copy a shared, partly filled last block first; open a block when the last
    one is full; the token goes to the next offset."""
    table, n, bs = bt.tables[seq_id], bt.lengths[seq_id], bt.block_size
    copy = None
    if n % bs != 0 and bt.ref_counts[table[-1]] > 1:
        src, dst = table[-1], bt.allocate_block()
        bt.ref_counts[src] -= 1          # still >= 1: the other sequences keep it
        table[-1] = dst
        copy = (src, dst)
    elif n % bs == 0:
        table.append(bt.allocate_block())
    bt.lengths[seq_id] = n + 1
    return table[-1] * bs + n % bs, copy


def free(bt: BlockTables, seq_id) -> None:
    """Exercise 6.1: drop one reference per block, last block first; at zero, back to the pool."""
    for block in reversed(bt.tables.pop(seq_id)):
        bt.ref_counts[block] -= 1
        if bt.ref_counts[block] == 0:
            bt.free_list.append(block)
    del bt.lengths[seq_id]


# == Exercise 6.2 ===============================================================================

def beam_search_step(logprobs: np.ndarray, sum_logprobs: np.ndarray, num_beams: int, eos_token_ids: Sequence[int],
                     length_penalty: float, new_len: int, at_max_length: bool = False):
    """Exercise 6.2: rank every one-token extension, keep the top 2k (more with several eos
    ids), finish the eos candidates among the top k, continue with the best k others."""
    num_candidates = max(2, 1 + len(eos_token_ids)) * num_beams
    vocab = logprobs.shape[1]
    totals = (logprobs.astype(np.float32) + sum_logprobs.astype(np.float32)[:, None]).ravel()
    ranked = np.argsort(-totals, kind="stable")[:num_candidates]
    parents, tokens, sums = ranked // vocab, ranked % vocab, totals[ranked]
    ends = [at_max_length or int(t) in eos_token_ids for t in tokens]
    finished = [(int(parents[r]), int(tokens[r]), float(sums[r] / np.float32(new_len ** length_penalty)))
                for r in range(min(num_beams, len(ranked))) if ends[r]]
    go_on = [] if at_max_length else [r for r, end in enumerate(ends) if not end][:num_beams]
    return parents[go_on].astype(np.int64), tokens[go_on].astype(np.int64), sums[go_on], finished


# == Exercise 6.3 ===============================================================================

HashFn = Callable[["bytes | None", Sequence[int]], bytes]


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Exercise 6.3: BLAKE2b-128 of the parent key (nothing for the first block) and the
    block's tokens as little-endian int32."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.digest()


def block_keys(token_ids: Sequence[int], block_size: int, hash_fn: HashFn | None = None) -> list[bytes]:
    """Exercise 6.3: one key per full block, each hashing the previous key."""
    hash_fn = hash_fn or chain_hash
    keys: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        keys.append(hash_fn(keys[-1] if keys else None, list(token_ids[i * block_size:(i + 1) * block_size])))
    return keys


def cached_prefix_tokens(token_ids: Sequence[int], cache: dict, block_size: int,
                         hash_fn: HashFn | None = None) -> int:
    """Exercise 6.3: walk the full blocks, stop at the first miss or failed verification, and
    never serve the block of the last token."""
    keys = block_keys(token_ids, block_size, hash_fn)
    hits = 0
    for i in range((len(token_ids) - 1) // block_size):
        entry = cache.get(keys[i])
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        if entry is None or entry[0] != (keys[i - 1] if i else None) or tuple(entry[1]) != block:
            break
        hits += 1
    return hits * block_size


# == Exercise 6.4: the copy-on-write block copy ===================================================

@triton.jit
def _copy_blocks_kernel(Pool, Pairs, stride_plane, stride_block, block_elems, BLOCK: tl.constexpr):
    """Program ``(i, plane)``: block ``Pairs[i, 0]`` of ``plane`` to block ``Pairs[i, 1]``."""
    i = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    src = tl.load(Pairs + 2 * i)
    dst = tl.load(Pairs + 2 * i + 1)
    src_block = Pool + plane * stride_plane + src * stride_block
    dst_block = Pool + plane * stride_plane + dst * stride_block
    for start in range(0, block_elems, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < block_elems
        tl.store(dst_block + offs, tl.load(src_block + offs, mask=mask), mask=mask)


def copy_blocks(pool: torch.Tensor, pairs) -> None:
    """Exercise 6.4: one program per (pair, plane), copying the block in chunks of ``BLOCK``."""
    num_blocks = pool.shape[2]
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if len(np.unique(pairs[:, 1])) != len(pairs) or np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
        raise ValueError("copies must have distinct destinations, none of which is a source")
    if len(pairs) == 0:
        return
    flat = pool.view(pool.shape[0] * pool.shape[1], num_blocks, -1)     # [planes, num_blocks, block_elems]
    _copy_blocks_kernel[(len(pairs), flat.shape[0])](
        flat, torch.from_numpy(pairs).to(pool.device), flat.stride(0), flat.stride(1), flat.shape[2], BLOCK=256)


# == Exercise 6.5: reading sequences back out of the pool =========================================

@triton.jit
def _gather_kernel(Cache, BlockTables, CuSeqlens, Out, stride_cb, stride_co, max_blocks, block_size, row_elems,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program ``(b, j)``: positions ``j·BLOCK_T …`` of sequence ``b`` to their rows of ``Out``."""
    b = tl.program_id(0)
    first = tl.load(CuSeqlens + b)
    seq_len = tl.load(CuSeqlens + b + 1) - first
    pos = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = pos < seq_len
    blk = tl.load(BlockTables + b * max_blocks + pos // block_size, mask=ok, other=0).to(tl.int64)
    src = blk * stride_cb + (pos % block_size) * stride_co                  # [BLOCK_T] row starts
    offs_e = tl.arange(0, BLOCK_E)
    mask = ok[:, None] & (offs_e < row_elems)[None, :]
    rows = tl.load(Cache + src[:, None] + offs_e[None, :], mask=mask)
    dst = (first + pos).to(tl.int64) * row_elems
    tl.store(Out + dst[:, None] + offs_e[None, :], rows, mask=mask)


def gather_sequences(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 6.5: one program per (sequence, tile of BLOCK_T positions)."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    if cache.stride(3) != 1 or cache.stride(2) != head_dim:
        raise ValueError("each token's [kv_heads, head_dim] row of the cache must be contiguous")
    lens = [int(n) for n in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]), device=cache.device, dtype=torch.int32)
    out = torch.full((sum(lens), kv_heads, head_dim), float("nan"), device=cache.device, dtype=cache.dtype)
    if not lens or max(lens) == 0:
        return out, cu
    block_tables = block_tables.contiguous()
    BLOCK_T = 16
    grid = (len(lens), triton.cdiv(max(lens), BLOCK_T))
    _gather_kernel[grid](cache, block_tables, cu, out, cache.stride(0), cache.stride(1), block_tables.shape[1],
                         block_size, kv_heads * head_dim, BLOCK_T=BLOCK_T,
                         BLOCK_E=triton.next_power_of_2(kv_heads * head_dim))
    return out, cu
