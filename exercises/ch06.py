"""Chapter 6 exercises: copy-on-write, beam search, prefix caching. Grade your work with
``make grade CH=6``.

Replace each ``raise NotImplementedError(...)`` with your implementation. Exercises 6.4 and
6.5 are Triton kernels whose launchers are written for you: write the kernel's body, then
delete the launcher's ``raise``. The tests compare your functions with the book's code:
Exercise 6.1 with `minillm.paged.BlockManager` (prefix caching off) on random sequences of
operations, Exercise 6.2 with the candidate selection of `minillm.decoding.beams` (itself
checked against Hugging Face transformers) and with a whole beam search on a tiny model,
Exercise 6.3 with `minillm.paged.prefix_cache.chain_hash` and with what a `BlockManager` with
prefix caching finds in its cache, Exercises 6.4 and 6.5 with `minillm.paged.layout`'s
`copy_blocks` and `gather_slots` on shuffled pools.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# First, before Triton: without a GPU, this selects Triton's interpreter.
from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


# == Exercise 6.1: fork and copy-on-write bookkeeping ===========================================

@dataclass
class BlockTables:
    """The state of a miniature block manager (given; the exercise is the three functions below).

    Exercise 5.1's block tables (the same ``free_list``, ``tables`` and ``lengths``), now with a
    reference count per block, so that several sequences can list the same block.

    Attributes:
        num_blocks, block_size: the pool: ``num_blocks`` blocks of ``block_size`` tokens.
        tables: sequence id -> its block table, the list of its physical block ids in order
            (token ``p`` lives in block ``tables[seq][p // block_size]``).
        lengths: sequence id -> its number of tokens.
        ref_counts: block id -> how many table entries point at it (0 for a free block).
        free_list: the free block ids; blocks are taken from the **front** (`allocate_block`)
            and a block whose count drops to zero goes to the **back**.
    """

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
        """Take the block at the front of the free list; its count becomes 1."""
        if not self.free_list:
            raise RuntimeError("out of blocks")
        block = self.free_list.popleft()
        self.ref_counts[block] = 1
        return block

    def add_sequence(self, seq_id, num_tokens: int) -> None:
        """A new sequence of ``num_tokens`` tokens (a prompt): ``ceil(num_tokens / block_size)``
        fresh blocks, in order."""
        if seq_id in self.tables or num_tokens < 1:
            raise ValueError(f"cannot add sequence {seq_id!r} of {num_tokens} tokens")
        self.tables[seq_id] = [self.allocate_block() for _ in range(-(-num_tokens // self.block_size))]
        self.lengths[seq_id] = num_tokens


def fork(bt: BlockTables, parent, child) -> None:
    """Exercise 6.1 (part 1) — make ``child`` a copy of ``parent`` that shares all its blocks.

    The child gets its own table (a new list) with the same block ids and the same length;
    every one of those blocks gains one reference. No block is allocated.
    """
    raise NotImplementedError("Exercise 6.1 (fork): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.1")


def append_slot(bt: BlockTables, seq_id) -> tuple[int, tuple[int, int] | None]:
    """Exercise 6.1 (part 2) — append one token to ``seq_id``; return ``(slot, copy)``.

    Let ``n`` be the sequence's length before the append. Three cases:

    - ``n`` is a multiple of ``block_size`` (the last block is full, or there is none): the
      token opens a new block (`BlockTables.allocate_block`), appended to the table.
    - the last block is partly filled and **shared** (ref count > 1): copy-on-write. Allocate
      a block ``dst``, make it the table's last entry in place of ``src``, drop one reference
      from ``src`` (the other sequences keep it), and report ``copy = (src, dst)``: the caller
      must copy the block's K/V before writing.
    - otherwise the last block is partly filled and private: write into it.

    The token's slot is ``table[-1] * block_size + n % block_size``; the length becomes
    ``n + 1``. ``copy`` is ``None`` when nothing was copied.
    """
    raise NotImplementedError("Exercise 6.1 (append_slot): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.1")


def free(bt: BlockTables, seq_id) -> None:
    """Exercise 6.1 (part 3) — release ``seq_id``.

    Walk its table from the **last** block to the first, dropping one reference from each; a
    block whose count reaches 0 goes to the back of ``free_list``. Then forget the sequence
    (remove it from ``tables`` and ``lengths``).
    """
    raise NotImplementedError("Exercise 6.1 (free): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.1")


# == Exercise 6.2: one beam-search step =========================================================

def beam_search_step(logprobs: np.ndarray, sum_logprobs: np.ndarray, num_beams: int, eos_token_ids: Sequence[int],
                     length_penalty: float, new_len: int, at_max_length: bool = False):
    """Exercise 6.2 — one step of beam search, with Hugging Face transformers' rules.

    Args:
        logprobs: ``[live, vocab]`` float32, log-softmax of each live beam's next-token logits
            (``live`` is 1 at the first step, ``num_beams`` after).
        sum_logprobs: ``[live]`` float32, each live beam's summed log-probability so far.
        num_beams: ``k``.
        eos_token_ids: tokens that finish a beam.
        length_penalty: a finished hypothesis scores ``sum_logprob / new_len ** length_penalty``.
        new_len: generated tokens a candidate holds, its new token included (the prompt does
            not count).
        at_max_length: this step reaches ``max_new_tokens``: every candidate finishes.

    Returns:
        ``(parents, tokens, sums, finished)``:

        - Rank all ``live · vocab`` candidates by ``sum_logprobs[b] + logprobs[b, t]`` (add in
          float32) and keep the best ``K = max(2, 1 + len(eos_token_ids)) · k``, best first.
        - A candidate *ends* if its token is an eos id, or if ``at_max_length``. Only ending
          candidates ranked in the **top k** finish: ``finished`` lists them as
          ``(parent, token, score)``, in rank order, ``score`` the float32 quotient above.
          Ending candidates ranked lower are dropped.
        - The next beams are the best ``k`` candidates that do not end (none if
          ``at_max_length``): ``parents, tokens`` (int arrays) and ``sums`` (their float32
          summed log-probs), in rank order.
    """
    raise NotImplementedError("Exercise 6.2 (beam_search_step): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.2")


# == Exercise 6.3: the prefix hash chain ========================================================

HashFn = Callable[["bytes | None", Sequence[int]], bytes]


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Exercise 6.3 (part 1) — the key of one full block.

    BLAKE2b with a 16-byte digest (``hashlib.blake2b(digest_size=16)``) of the parent key's
    bytes (nothing for the first block, ``parent is None``) followed by the block's token ids
    as little-endian int32 (``np.asarray(token_ids, dtype="<i4").tobytes()``). It must equal
    `minillm.paged.prefix_cache.chain_hash` bit for bit.
    """
    raise NotImplementedError("Exercise 6.3 (chain_hash): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.3")


def block_keys(token_ids: Sequence[int], block_size: int, hash_fn: HashFn | None = None) -> list[bytes]:
    """Exercise 6.3 (part 2) — the keys of a token list's **full** blocks, as a chain.

    Block ``i`` holds ``token_ids[i * block_size:(i + 1) * block_size]``; its key is
    ``hash_fn(key of block i - 1, its tokens)`` (``None`` as the parent of block 0), so a key
    names the block *and everything before it*. A partly filled last block has no key.
    ``hash_fn`` defaults to your `chain_hash`; pass each block's tokens to it as a list.
    """
    raise NotImplementedError("Exercise 6.3 (block_keys): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.3")


def cached_prefix_tokens(token_ids: Sequence[int], cache: dict, block_size: int,
                         hash_fn: HashFn | None = None) -> int:
    """Exercise 6.3 (part 3) — how many prompt tokens a prefix cache can serve.

    ``cache`` maps a key to ``(parent_key, block_tokens)``: the key of the block before it
    (``None`` for a first block) and the tokens it holds. Walk the prompt's blocks in order;
    block ``i`` is a hit if its key (`block_keys` with ``hash_fn``) is in ``cache`` **and** the
    entry is verified: its parent key is block ``i - 1``'s key (``None`` for ``i = 0``) and its
    tokens equal the block's tokens (a key can collide; the tokens cannot lie). Stop at the
    first miss: a block is only usable with all of its prefix. Never count the block holding
    the prompt's last token, which must be computed to produce the next token's logits: at
    most ``(len(token_ids) - 1) // block_size`` blocks. Return ``hits * block_size``.
    """
    raise NotImplementedError("Exercise 6.3 (cached_prefix_tokens): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.3")


# == Exercise 6.4: the copy-on-write block copy, in Triton =======================================

@triton.jit
def _copy_blocks_kernel(Pool, Pairs, stride_plane, stride_block, block_elems, BLOCK: tl.constexpr):
    """Exercise 6.4 — program ``(i, plane)`` copies block ``Pairs[i, 0]`` of one plane over
    block ``Pairs[i, 1]`` of the same plane.

    - ``Pool`` is the pool viewed as ``[planes, num_blocks, block_elems]`` (planes = K and V
      of every layer; ``block_elems = block_size · kv_heads · head_dim``): element ``e`` of
      block ``blk`` of plane ``p`` is at ``p·stride_plane + blk·stride_block + e``, and a
      block's elements are contiguous;
    - ``Pairs: [n, 2]`` int64, contiguous: ``(src, dst)`` pairs. Destinations are distinct and
      never a source, so programs may run in any order.

    A block may hold more elements than ``BLOCK`` (a power of two): copy it in chunks of
    ``BLOCK``, masking the last, ragged one. Block offsets pass 2^31 elements in a large
    pool: make the plane (or the block id) int64 before multiplying.
    """
    pass


def copy_blocks(pool: torch.Tensor, pairs) -> None:
    """Exercise 6.4 — copy-on-write in place: ``block[dst] = block[src]`` for every ``(src,
    dst)`` pair, in every layer, for K and V (the launcher; the exercise is the kernel above).

    ``pool: [2, layers, num_blocks, block_size, kv_heads, head_dim]``, contiguous (the engine's
    `minillm.model.paged.PagedKVCache.pool`); ``pairs``: ``(src, dst)`` pairs
    (`AppendResult.copies`) or an ``[n, 2]`` array. The result equals
    `minillm.paged.layout.copy_blocks` applied to the pool viewed block-first.
    """
    raise NotImplementedError("Exercise 6.4 (_copy_blocks_kernel): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.4")
    num_blocks = pool.shape[2]
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if len(np.unique(pairs[:, 1])) != len(pairs) or np.intersect1d(pairs[:, 0], pairs[:, 1]).size:
        raise ValueError("copies must have distinct destinations, none of which is a source")
    if len(pairs) == 0:
        return
    flat = pool.view(pool.shape[0] * pool.shape[1], num_blocks, -1)     # [planes, num_blocks, block_elems]
    _copy_blocks_kernel[(len(pairs), flat.shape[0])](
        flat, torch.from_numpy(pairs).to(pool.device), flat.stride(0), flat.stride(1), flat.shape[2], BLOCK=256)


# == Exercise 6.5: reading sequences back out of the pool, in Triton =============================

@triton.jit
def _gather_kernel(Cache, BlockTables, CuSeqlens, Out, stride_cb, stride_co, max_blocks, block_size, row_elems,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Exercise 6.5 — program ``(b, j)`` copies positions ``j·BLOCK_T … j·BLOCK_T + BLOCK_T - 1``
    of sequence ``b`` from the pool to their rows of the packed output.

    - ``Cache: [num_blocks, block_size, kv_heads, head_dim]``: the row of the token at
      ``(blk, off)`` starts at ``blk·stride_cb + off·stride_co`` and is ``row_elems =
      kv_heads · head_dim`` contiguous elements;
    - ``BlockTables: [batch, max_blocks]`` int32, contiguous, ``-1`` past each sequence's
      blocks (sequences may share blocks: forks, cached prefixes);
    - ``CuSeqlens: [batch + 1]`` int32: sequence ``b`` holds ``CuSeqlens[b + 1] - CuSeqlens[b]``
      tokens, and its position ``p`` goes to row ``CuSeqlens[b] + p`` of
      ``Out: [total_tokens, row_elems]`` (contiguous).

    ``BLOCK_E`` is ``row_elems`` rounded up to a power of two. Positions past the sequence's
    length (the last tile is ragged; a short sequence's programs may have none at all) read
    no table entry and write nothing.
    """
    pass


def gather_sequences(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 6.5 — every sequence's K (or V) read through its block table into one packed
    buffer, as the torch fallback of `minillm.model.paged` does before calling SDPA (the
    launcher; the exercise is the kernel above).

    ``cache: [num_blocks, block_size, kv_heads, head_dim]``; ``block_tables: [batch,
    max_blocks]`` int32 padded with -1; ``seq_lens``: ``batch`` lengths (list or tensor).
    Returns ``(out [total_tokens, kv_heads, head_dim], cu_seqlens [batch + 1] int32)``: sequence
    ``b`` is ``out[cu_seqlens[b]:cu_seqlens[b + 1]]``, equal to
    `minillm.paged.layout.gather_slots` of its table.
    """
    raise NotImplementedError("Exercise 6.5 (_gather_kernel): not started. Read its docstring; hints: python -m minillm.grade 6 --hint 6.5")
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
