"""Chapter 6 exercises: copy-on-write, beam search, prefix caching. Grade your work with
``make grade CH=6``.

Replace each ``raise NotImplementedError(...)`` with your implementation. The tests compare
your functions with the book's code: Exercise 6.1 with `minillm.paged.BlockManager` (prefix
caching off) on random sequences of operations, Exercise 6.2 with the candidate selection of
`minillm.decoding.beams` (itself checked against Hugging Face transformers) and with a whole
beam search on a tiny model, Exercise 6.3 with `minillm.paged.prefix_cache.chain_hash` and
with what a `BlockManager` with prefix caching finds in its cache.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


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
    raise NotImplementedError(
        "Exercise 6.1 (fork): for each block of bt.tables[parent], bt.ref_counts[block] += 1; then "
        "bt.tables[child] = list(...) (a copy, not the same list) and bt.lengths[child] = bt.lengths[parent]."
    )


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
    raise NotImplementedError(
        "Exercise 6.1 (append_slot): n = bt.lengths[seq_id]; if n % bs and bt.ref_counts[table[-1]] > 1: "
        "dst = bt.allocate_block(), decrement the old last block, table[-1] = dst, copy = (src, dst); "
        "elif n % bs == 0: table.append(bt.allocate_block()). Then slot = table[-1] * bs + n % bs."
    )


def free(bt: BlockTables, seq_id) -> None:
    """Exercise 6.1 (part 3) — release ``seq_id``.

    Walk its table from the **last** block to the first, dropping one reference from each; a
    block whose count reaches 0 goes to the back of ``free_list``. Then forget the sequence
    (remove it from ``tables`` and ``lengths``).
    """
    raise NotImplementedError(
        "Exercise 6.1 (free): for block in reversed(bt.tables[seq_id]): decrement bt.ref_counts[block], and "
        "bt.free_list.append(block) if it reached 0. Then del bt.tables[seq_id], bt.lengths[seq_id]."
    )


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
    raise NotImplementedError(
        "Exercise 6.2 (beam_search_step): totals = (logprobs + sum_logprobs[:, None]).ravel(); the best K indices "
        "(np.argsort(-totals)[:K]) give parent = index // vocab and token = index % vocab. ends[r] = at_max_length "
        "or token in eos. finished: ranks r < k with ends[r], score = np.float32(total) / np.float32(new_len ** lp). "
        "Next beams: the first k ranks that do not end."
    )


# == Exercise 6.3: the prefix hash chain ========================================================

HashFn = Callable[["bytes | None", Sequence[int]], bytes]


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Exercise 6.3 (part 1) — the key of one full block.

    BLAKE2b with a 16-byte digest (``hashlib.blake2b(digest_size=16)``) of the parent key's
    bytes (nothing for the first block, ``parent is None``) followed by the block's token ids
    as little-endian int32 (``np.asarray(token_ids, dtype="<i4").tobytes()``). It must equal
    `minillm.paged.prefix_cache.chain_hash` bit for bit.
    """
    raise NotImplementedError(
        "Exercise 6.3 (chain_hash): h = hashlib.blake2b(digest_size=16); h.update(parent or b''); "
        "h.update(the tokens as '<i4' bytes); return h.digest()."
    )


def block_keys(token_ids: Sequence[int], block_size: int, hash_fn: HashFn | None = None) -> list[bytes]:
    """Exercise 6.3 (part 2) — the keys of a token list's **full** blocks, as a chain.

    Block ``i`` holds ``token_ids[i * block_size:(i + 1) * block_size]``; its key is
    ``hash_fn(key of block i - 1, its tokens)`` (``None`` as the parent of block 0), so a key
    names the block *and everything before it*. A partly filled last block has no key.
    ``hash_fn`` defaults to your `chain_hash`; pass each block's tokens to it as a list.
    """
    raise NotImplementedError(
        "Exercise 6.3 (block_keys): for i in range(len(token_ids) // block_size), append "
        "hash_fn(keys[-1] if keys else None, list(the i-th block's tokens))."
    )


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
    raise NotImplementedError(
        "Exercise 6.3 (cached_prefix_tokens): keys = block_keys(...); for i in range((len - 1) // bs): "
        "entry = cache.get(keys[i]); stop unless entry[0] == (keys[i - 1] if i else None) and "
        "tuple(entry[1]) == tuple(block i's tokens); count the hits."
    )
