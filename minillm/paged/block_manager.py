"""The block manager: per-sequence block tables over a shared pool of KV blocks.

A sequence's keys and values live in fixed-size *blocks* scattered over one big pool; its
**block table** lists them in order, so logical position ``p`` lives in block
``table[p // block_size]`` at offset ``p % block_size``. Nothing needs to be contiguous, so a
sequence takes memory one block at a time as it grows, and at most its last block is partly
empty. This module does the bookkeeping on the CPU; the attention kernels read the tables.

What the scheduler of a serving engine calls, in the order it calls them:

1. `BlockManager.can_allocate` before admitting a request: `Admission.FITS_NOW`,
   `Admission.FITS_LATER` (wait for running sequences to finish) or `Admission.NEVER_FITS`
   (reject: the request is longer than the whole pool).
2. `BlockManager.allocate` at admission: builds the table, reusing cached prefix blocks, and
   returns how many prompt tokens are already cached (their K and V need not be computed).
   `BlockManager.slot_mapping` then says where to write the K and V of the rest.
3. Before each decode step, `BlockManager.can_append` (else preempt someone) and
   `BlockManager.append_slots`: one slot per new token, plus the block copies that
   copy-on-write needs, to be performed *before* the step writes anything.
4. `BlockManager.fork` for parallel sampling and beam search: the child shares every block.
5. `BlockManager.free` when a sequence finishes or is preempted.

Every method that fails raises a `minillm.paged.errors.BlockManagerError` and changes nothing.

Timing contract with the engine. The manager registers a prompt's full blocks in the prefix
cache when it allocates them, *before* the forward pass has written their K and V. A second
request admitted in the same step can then hit them, which is what keeps two requests with a
shared prefix from storing it twice; it is safe because the engine writes the whole batch's K
and V of a layer before any attention of that layer reads them. An engine that splits a prompt
over several steps (chunked prefill, `minillm.engine`) keeps the contract by allocating only the
first chunk and appending the others step by step, and by never freeing blocks between the
step that takes them and its forward pass.
"""
from __future__ import annotations

import enum
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from minillm.paged.allocator import BlockAllocator
from minillm.paged.errors import DuplicateSequence, OutOfBlocks, RequestTooLong, UnknownSequence
from minillm.paged.prefix_cache import Block, HashFn, chain_hash

__all__ = ["PENDING", "Admission", "AppendResult", "BlockManager", "as_token_list", "blocks_for", "check_token_ids",
           "gather_step_inputs"]

MAX_TOKEN_ID = 2**31 - 1  # token ids are hashed as int32
PENDING = -1              # a token appended before its id is known (`BlockManager.append_pending`)


class Admission(enum.Enum):
    """The three answers to "can this request have its blocks?"."""

    FITS_NOW = "fits now"      # enough blocks are free or evictable right now
    FITS_LATER = "fits later"  # not now, but the whole pool is big enough: wait
    NEVER_FITS = "never fits"  # more blocks than the whole pool: reject


@dataclass(frozen=True)
class AppendResult:
    """What appending tokens to sequences asks of the caller.

    Attributes:
        slots: for each appended token, in order, the pool slot its K and V go to,
            ``block_id * block_size + offset``.
        copies: ``(src, dst)`` physical block pairs to copy, in every layer, for K and V,
            *before* writing the new tokens (copy-on-write). All ``dst`` are distinct and
            none is a ``src``, so the copies can run in one batch, in any order.
    """

    slots: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]

    @property
    def slot(self) -> int:
        """The one slot of a single-token append (`BlockManager.append_slot`)."""
        if len(self.slots) != 1:
            raise ValueError(f"this append produced {len(self.slots)} slots, not one")
        return self.slots[0]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def as_token_list(tokens) -> list:
    """One token id, or an iterable of them, as a list."""
    try:
        return [operator.index(tokens)]
    except TypeError:
        return list(tokens)


def gather_step_inputs(seqs, counts: Sequence[int], block_size: int
                       ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
    """`BlockManager.step_inputs` over ``seqs``, ``(seq_id, token_ids, block_table)`` triples
    (any paged layout: the virtual cache's is one block of ``block_size = capacity`` per
    sequence, table ``[slot]``), running the last ``counts[i]`` tokens of each."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    lengths: list[int] = []
    tables: list[list[int]] = []
    for (seq_id, tokens, table), n in zip(seqs, counts):
        length = len(tokens)
        if not 1 <= n <= length:
            raise ValueError(f"sequence {seq_id!r} has {length} tokens; cannot run its last {n}")
        start = length - n
        if n == 1:  # a decode step: one token, no list built
            ids.append(tokens[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            ids += tokens[start:]
            positions += range(start, length)
            slots += [table[p // bs] * bs + p % bs for p in range(start, length)]
        lengths.append(length)
        tables.append(table)
    return ids, positions, slots, lengths, tables


def check_token_ids(token_ids, action: str, seq_id=None) -> list[int]:
    """``token_ids`` as a list of ints in ``[0, 2**31)``, else the error says it could not
    ``action`` (followed by ``seq_id`` when given: formatted only then, since `append_slots`
    checks every sequence of every step). Shared by the block managers of Chapters 5 and 11."""
    try:
        tokens = [operator.index(t) for t in token_ids]
    except TypeError:
        action = action if seq_id is None else f"{action} {seq_id!r}"
        raise TypeError(f"cannot {action}: token ids must be integers, got {token_ids!r}") from None
    if tokens and 0 <= min(tokens) and max(tokens) <= MAX_TOKEN_ID:
        return tokens
    action = action if seq_id is None else f"{action} {seq_id!r}"
    bad = [t for t in tokens if not 0 <= t <= MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"cannot {action}: token ids must lie in [0, 2**31), got {bad[:5]}")
    return tokens


@dataclass
class _Sequence:
    token_ids: list[int]      # every token whose K and V has (or is about to have) a slot
    block_table: list[int]    # physical block ids, one per block_size tokens, the last maybe partial
    num_cached_tokens: int    # prompt tokens found in the prefix cache at allocation


@dataclass
class BlockManagerStats:
    """Running totals, for the notebooks and for an engine's metrics.

    Attributes:
        prompt_tokens: prompt tokens passed to `BlockManager.allocate`.
        cached_prompt_tokens: of those, tokens found in the prefix cache.
        cow_copies: blocks copied by copy-on-write.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    cow_copies: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of prompt tokens served by the prefix cache (0 before any request)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class BlockManager:
    """Block tables for every live sequence, over a pool of ``num_blocks`` blocks.

    Args:
        num_blocks: physical blocks in the pool (``>= 1``).
        block_size: tokens per block (``>= 1``; any integer, powers of two are not required).
        enable_prefix_caching: reuse full blocks across requests with a common prefix
            (see `minillm.paged.prefix_cache`). Off, freed blocks go straight to the free list.
        hash_fn: the block-key function, `chain_hash` unless a test wants collisions.

    Sequences are named by any hashable id (the engine's request id).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = chain_hash):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash = hash_fn
        self._alloc = BlockAllocator(num_blocks)
        self._seqs: dict[object, _Sequence] = {}
        self.stats = BlockManagerStats()

    # == counters ================================================================================
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._alloc.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (no useful contents)."""
        return self._alloc.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for the prefix cache (reusable when the free list is empty)."""
        return self._alloc.num_evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one block table."""
        return self._alloc.num_used

    @property
    def num_available_blocks(self) -> int:
        """Blocks that can be handed out now: free + unreferenced cached."""
        return self._alloc.num_available

    @property
    def num_evictions(self) -> int:
        """Cached blocks whose contents were dropped so far (reused, or evicted by `evict`)."""
        return self._alloc.num_evictions

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by sequences."""
        return self.num_used_blocks / self.num_blocks

    # == read-only views =========================================================================
    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        """Live sequences."""
        return len(self._seqs)

    def seq_ids(self) -> list:
        """Ids of the live sequences, in allocation order."""
        return list(self._seqs)

    def block_table(self, seq_id) -> list[int]:
        """The physical block ids of ``seq_id``, in logical order (a copy)."""
        return list(self._get(seq_id, "read the block table of").block_table)

    def num_tokens(self, seq_id) -> int:
        """Tokens of ``seq_id`` that have (or are about to have) a slot."""
        return len(self._get(seq_id, "read").token_ids)

    def token_ids(self, seq_id) -> tuple[int, ...]:
        return tuple(self._get(seq_id, "read").token_ids)

    def num_cached_tokens(self, seq_id) -> int:
        """Prompt tokens of ``seq_id`` that `allocate` found in the prefix cache."""
        return self._get(seq_id, "read").num_cached_tokens

    def slot(self, seq_id, position: int) -> int:
        """The pool slot of token ``position`` of ``seq_id``: ``block_id * block_size + offset``."""
        seq = self._get(seq_id, "read")
        if not 0 <= position < len(seq.token_ids):
            raise IndexError(f"position {position} out of range for sequence {seq_id!r} of "
                             f"{len(seq.token_ids)} tokens")
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id, start: int = 0, stop: int | None = None) -> list[int]:
        """Slots of positions ``start .. stop-1`` of ``seq_id`` (``stop`` defaults to its length).

        After ``cached = allocate(seq_id, prompt)``, ``slot_mapping(seq_id, cached)`` is where
        the prefill writes the K and V of the tokens it computes.
        """
        seq = self._get(seq_id, "read")
        stop = len(seq.token_ids) if stop is None else stop
        if not 0 <= start <= stop <= len(seq.token_ids):
            raise IndexError(f"positions {start}:{stop} out of range for sequence {seq_id!r} of "
                             f"{len(seq.token_ids)} tokens")
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def step_inputs(self, seq_ids: Sequence, counts: Sequence[int]
                    ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
        """What a forward step over the last ``counts[i]`` tokens of each ``seq_ids[i]`` reads,
        in one pass (`minillm.model.paged.PagedBatch.from_manager` calls it every step):
        ``(token_ids, positions, slots, lengths, block_tables)``, the first three flat over the
        step's tokens, the last two per sequence. The block tables are the manager's own lists,
        not copies: read them before the next change to the manager.

        Raises `UnknownSequence`, and ``ValueError`` unless ``1 <= counts[i] <= length``."""
        table = self._seqs
        try:  # every step reads every running sequence: no call per sequence
            seqs = [(seq_id, table[seq_id].token_ids, table[seq_id].block_table) for seq_id in seq_ids]
        except (KeyError, TypeError):  # an unknown or unhashable id: raised with its message
            seqs = [(seq_id, *self._tokens_and_table(seq_id)) for seq_id in seq_ids]
        return gather_step_inputs(seqs, counts, self.block_size)

    def _tokens_and_table(self, seq_id) -> tuple[list[int], list[int]]:
        seq = self._get(seq_id, "read")
        return seq.token_ids, seq.block_table

    def ref_count(self, block_id: int) -> int:
        """How many block-table entries point at ``block_id``."""
        return self._alloc.blocks[block_id].ref_count

    def block(self, block_id: int) -> Block:
        """The `Block` object of ``block_id`` (read it, do not modify it)."""
        return self._alloc.blocks[block_id]

    def free_block_ids(self) -> list[int]:
        return self._alloc.free_ids()

    def cached_block_ids(self) -> list[int]:
        """Unreferenced cached blocks, next to be evicted first."""
        return list(self._alloc.cache.evictable_ids())

    def prefix_cache_entries(self) -> dict[bytes, int]:
        """Key -> block id of every block the prefix cache can find (a copy)."""
        return self._alloc.cache.entries()

    # == admission ===============================================================================
    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens occupies, ``ceil(num_tokens / block_size)``."""
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, request: int | Sequence[int]) -> Admission:
        """Whether a new request of ``request`` tokens (a count, or the token ids) can be
        allocated now, later, or never.

        Given the token ids, blocks the prefix cache already holds count as free, so the
        answer can be `Admission.FITS_NOW` for a request that needs more blocks than are
        available; given a count, it assumes no cache hit. Changes nothing (not even the LRU
        order), so it is safe to ask for every waiting request at every step.
        """
        try:
            num_tokens, hits = operator.index(request), []
        except TypeError:
            tokens = check_token_ids(request, "ask about")
            num_tokens, hits = len(tokens), self.prefix_hits(tokens)[1]
        if num_tokens < 1:
            raise ValueError(f"a request needs at least one token, got {num_tokens}")
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_blocks:
            return Admission.NEVER_FITS
        return Admission.FITS_NOW if needed - len(hits) <= self._available_after(hits) else Admission.FITS_LATER

    def num_cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` that `allocate` would find in the prefix cache now: a
        multiple of ``block_size``, less than ``len(token_ids)``. Changes nothing."""
        return len(self.prefix_hits(check_token_ids(token_ids, "look up"))[1]) * self.block_size

    def can_append(self, seq_ids: Iterable, num_tokens: int = 1) -> bool:
        """Whether every sequence in ``seq_ids`` can take ``num_tokens`` more tokens now."""
        return self.blocks_to_append(seq_ids, num_tokens) <= self.num_available_blocks

    def blocks_to_append(self, seq_ids: Iterable, num_tokens: int = 1) -> int:
        """New blocks that `append_slots` of ``num_tokens`` tokens to each of ``seq_ids`` takes:
        blocks for the tokens past each last block, plus one copy per sequence that must
        copy a shared, partly filled last block (the last of its sharers in the batch to
        append writes in place, so it needs no copy)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in {seq_ids!r}")
        seqs = [self._get(s, "append to") for s in seq_ids]
        return sum(self._new_blocks(seqs, [num_tokens] * len(seqs)))

    # == operations ==============================================================================
    def allocate(self, seq_id, token_ids: Sequence[int]) -> int:
        """Give a new sequence the blocks for its prompt ``token_ids``; returns how many of its
        leading tokens are already cached.

        Prompt blocks found in the prefix cache are shared, not copied. The count returned is
        a multiple of ``block_size`` and always less than ``len(token_ids)``: even a fully
        cached prompt recomputes its last block, because the forward pass needs the last
        token's hidden state to produce the next token's logits (and writing that block must
        not touch a block other sequences share).

        Raises:
            DuplicateSequence: ``seq_id`` is live.
            RequestTooLong: the prompt needs more blocks than the pool has (`Admission.NEVER_FITS`).
            OutOfBlocks: not enough blocks now (`Admission.FITS_LATER`).
            ValueError: empty prompt, or a token id outside ``[0, 2**31)``.
        """
        if seq_id in self._seqs:
            raise DuplicateSequence(seq_id, "allocate")
        tokens = check_token_ids(token_ids, "allocate")
        if not tokens:
            raise ValueError(f"cannot allocate sequence {seq_id!r}: the prompt is empty")
        keys, hits = self.prefix_hits(tokens)
        needed = self.blocks_needed(len(tokens))
        if needed > self.num_blocks:
            raise RequestTooLong(len(tokens), self.block_size, needed, self.num_blocks)
        if needed - len(hits) > self._available_after(hits):
            self._raise_out_of_blocks(f"allocating sequence {seq_id!r} ({len(tokens)} tokens)",
                                      needed - len(hits), self._available_after(hits))

        # Take the hits first: once referenced they cannot be evicted by the fresh blocks below.
        for block in hits:
            self._alloc.incref(block.block_id)
        table = [block.block_id for block in hits]
        bs = self.block_size
        for i in range(len(hits), needed):
            table.append(self._alloc.allocate())
            if i < len(keys):  # a full block: findable from now on (see the module docstring)
                self._alloc.register(table[i], keys[i], table[i - 1] if i else None, tokens[i * bs:(i + 1) * bs])

        cached = len(hits) * bs
        self._seqs[seq_id] = _Sequence(tokens, table, cached)
        self.stats.prompt_tokens += len(tokens)
        self.stats.cached_prompt_tokens += cached
        return cached

    def append_slots(self, seq_ids: Sequence, token_ids: Sequence[int] | Sequence[Sequence[int]]) -> AppendResult:
        """Append tokens to several sequences at once (one decode step of a batch).

        Call it with the tokens the next forward pass feeds in (in decoding, the token each
        sequence just sampled): they join the sequences now, and the step writes their K and V
        into the returned slots.

        Args:
            seq_ids: distinct live sequences.
            token_ids: one token id per sequence, or one list of token ids per sequence
                (several tokens per step: speculative decoding, or a chunk of a prompt).

        Returns:
            An `AppendResult`: the slots of all new tokens, sequence by sequence, and the
            block copies to perform first. Every slot lies in a block referenced only by its
            own sequence.

        Raises:
            OutOfBlocks: the batch needs more blocks than are available (nothing is appended;
                preempt a sequence and retry).
            UnknownSequence, ValueError: bad ids or token ids.
        """
        seq_ids = list(seq_ids)
        if len(token_ids) != len(seq_ids):
            raise ValueError(f"got {len(seq_ids)} sequences but {len(token_ids)} token entries")
        batches = [check_token_ids(as_token_list(t), "append to sequence", sid) for sid, t in zip(seq_ids, token_ids)]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"append_slots got a sequence twice in {seq_ids!r}")
        seqs = [self._get(s, "append to") for s in seq_ids]
        needed = sum(self._new_blocks(seqs, [len(t) for t in batches]))
        if needed > self.num_available_blocks:
            self._raise_out_of_blocks(f"appending to {len(seqs)} sequence(s)", needed, self.num_available_blocks)

        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for seq, toks in zip(seqs, batches):
            self._append(seq, toks, slots, copies)
        self.stats.cow_copies += len(copies)
        return AppendResult(tuple(slots), tuple(copies))

    def append_pending(self, seq_ids: Sequence) -> AppendResult:
        """`append_slots` of one token per sequence whose id is not known yet: a step launched
        while the one before it, which draws these tokens, still runs (the engine's overlapped
        decode). Until `set_last_token` gives it, the token reads as ``PENDING`` and a block it
        fills is not offered to the prefix cache."""
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"append_pending got a sequence twice in {seq_ids!r}")
        seqs = [self._get(s, "append to") for s in seq_ids]
        fast = self._append_pending_unshared(seqs)
        if fast is not None:
            return fast
        needed = sum(self._new_blocks(seqs, [1] * len(seqs)))
        if needed > self.num_available_blocks:
            self._raise_out_of_blocks(f"appending to {len(seqs)} sequence(s)", needed, self.num_available_blocks)
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            self._append(seq, [PENDING], slots, copies)
        self.stats.cow_copies += len(copies)
        return AppendResult(tuple(slots), tuple(copies))

    def _append_pending_unshared(self, seqs: list[_Sequence]) -> AppendResult | None:
        """`append_pending`'s common case, in one tight loop: no sequence's last block is both
        partly filled and shared, so no copy-on-write, and only the sequences at a block
        boundary take a new block. Same slots and blocks as the general path; ``None``, having
        changed nothing, when a copy is needed or the pool is short."""
        bs, blocks = self.block_size, self._alloc.blocks
        needed = 0
        for seq in seqs:
            n = len(seq.token_ids)
            if n % bs == 0:
                needed += 1
            elif blocks[seq.block_table[-1]].ref_count > 1:
                return None
        if needed > self.num_available_blocks:
            return None
        slots = []
        for seq in seqs:
            pos, table = len(seq.token_ids), seq.block_table
            if pos % bs == 0:
                table.append(self._alloc.allocate())
            seq.token_ids.append(PENDING)   # a pending token registers no block (`set_last_token` does)
            slots.append(table[-1] * bs + pos % bs)
        return AppendResult(tuple(slots), ())

    def set_last_token(self, seq_id, token_id: int) -> None:
        """Give the token `append_pending` appended to ``seq_id`` its id (and, if it filled its
        block, offer that block to the prefix cache, as `append_slots` would have)."""
        seq = self._get(seq_id, "set the last token of")
        if seq.token_ids[-1] != PENDING:
            raise ValueError(f"sequence {seq_id!r} has no pending token")
        if type(token_id) is not int or not 0 <= token_id <= MAX_TOKEN_ID:   # the common case checked inline
            token_id = check_token_ids([token_id], "set the last token of sequence", seq_id)[0]
        seq.token_ids[-1] = token_id
        pos = len(seq.token_ids) - 1
        if (pos + 1) % self.block_size == 0 and self.enable_prefix_caching:
            self._register_full_block(seq, pos // self.block_size)

    def append_slot(self, seq_id, token_id: int) -> AppendResult:
        """Append one token to one sequence: ``append_slots([seq_id], [token_id])``.

        ``result.slot`` is where the token's K and V go; ``result.copies`` holds at most
        one copy (when the last block was shared with a fork and partly filled).
        """
        return self.append_slots([seq_id], [token_id])

    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` a copy of ``parent_id`` that shares every block with it.

        Costs no block now; the first append to either sequence into a shared, partly filled
        last block copies that block (copy-on-write). Full blocks are never written again, so
        they stay shared until freed.
        """
        parent = self._get(parent_id, "fork from")
        if child_id in self._seqs:
            raise DuplicateSequence(child_id, "fork into")
        for block_id in parent.block_table:
            self._alloc.incref(block_id)
        self._seqs[child_id] = _Sequence(list(parent.token_ids), list(parent.block_table), parent.num_cached_tokens)

    def free(self, seq_id) -> None:
        """Release every block of ``seq_id``; blocks nobody else references are returned to the
        pool (to the prefix cache if cached, else to the free list)."""
        seq = self._get(seq_id, "free")
        # Last block first, so that the tail is the first to be evicted (prefix_cache docstring).
        for block_id in reversed(seq.block_table):
            self._alloc.decref(block_id)
        del self._seqs[seq_id]

    def evict_cached(self, max_blocks: int | None = None) -> int:
        """Move ``max_blocks`` unreferenced cached blocks (all if ``None``, fewer if there are
        fewer), least recently released first, to the free list; returns how many moved. Not
        needed for correctness (allocation evicts on demand); useful to reset the prefix cache."""
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        return self._alloc.evict(max_blocks)

    # == internals ===============================================================================
    def _get(self, seq_id, action: str) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id, action) from None
        except TypeError:  # unhashable id
            raise UnknownSequence(seq_id, action) from None

    def prefix_hits(self, tokens: list[int]) -> tuple[list[bytes], list[Block]]:
        """The keys of the prompt's full blocks, and the leading blocks the cache holds.

        Hits stop at the first miss (a block is only usable with all of its prefix), and never
        cover the last token: at most ``(len(tokens) - 1) // block_size`` blocks.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        keys: list[bytes] = []
        for i in range(len(tokens) // bs):
            keys.append(self._hash(keys[-1] if keys else None, tokens[i * bs:(i + 1) * bs]))
        hits: list[Block] = []
        for i in range((len(tokens) - 1) // bs):
            block = self._alloc.cache.lookup(keys[i], hits[-1] if hits else None, tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return keys, hits

    def _available_after(self, hits: list[Block]) -> int:
        """Blocks available for fresh allocation once ``hits`` are referenced: an evictable hit
        is revived, so it can no longer be evicted to make room."""
        return self.num_available_blocks - sum(block.ref_count == 0 for block in hits)

    def _needs_copy(self, seq: _Sequence, refs: dict[int, int]) -> bool:
        """Whether the next append to ``seq`` must copy its last block: it is partly filled and
        shared (``refs`` overrides ref counts already lowered earlier in the batch)."""
        last = seq.block_table[-1]
        return len(seq.token_ids) % self.block_size != 0 and refs.get(last, self._alloc.blocks[last].ref_count) > 1

    def _growth(self, seq: _Sequence, num_tokens: int) -> int:
        """Blocks past the current last one that ``num_tokens`` more tokens need."""
        n = len(seq.token_ids)
        return self.blocks_needed(n + num_tokens) - self.blocks_needed(n)

    def _new_blocks(self, seqs: list[_Sequence], counts: list[int]) -> list[int]:
        """New blocks per sequence for appending ``counts[i]`` tokens to ``seqs[i]``, in batch
        order (see `blocks_to_append`)."""
        refs: dict[int, int] = {}  # ref counts as the batch proceeds: each copy lowers one
        out = []
        for seq, n in zip(seqs, counts):
            copy = n > 0 and self._needs_copy(seq, refs)
            if copy:
                last = seq.block_table[-1]
                refs[last] = refs.get(last, self._alloc.blocks[last].ref_count) - 1
            out.append(copy + self._growth(seq, n))
        return out

    def _append(self, seq: _Sequence, tokens: list[int], slots: list[int], copies: list[tuple[int, int]]) -> None:
        bs, table = self.block_size, seq.block_table
        if tokens and self._needs_copy(seq, {}):
            # Copy-on-write: the others keep the shared block; this sequence gets a private copy.
            src, dst = table[-1], self._alloc.allocate()
            self._alloc.decref(src)  # stays >= 1: it was shared
            table[-1] = dst
            copies.append((src, dst))
        for token in tokens:
            pos = len(seq.token_ids)
            if pos % bs == 0:
                table.append(self._alloc.allocate())
            seq.token_ids.append(token)
            slots.append(table[-1] * bs + pos % bs)
            if (pos + 1) % bs == 0 and self.enable_prefix_caching and token != PENDING:
                self._register_full_block(seq, pos // bs)

    def _register_full_block(self, seq: _Sequence, i: int) -> None:
        """Block ``i`` of ``seq`` just filled up: cache it if its predecessor is cached."""
        table, bs = seq.block_table, self.block_size
        parent = self._alloc.blocks[table[i - 1]] if i else None
        if parent is not None and not parent.is_cached:
            return  # unreachable by any lookup: the chain is broken before it
        key = self._hash(parent.hash if parent else None, seq.token_ids[i * bs:(i + 1) * bs])
        self._alloc.register(table[i], key, table[i - 1] if i else None, seq.token_ids[i * bs:(i + 1) * bs])

    def _raise_out_of_blocks(self, what: str, needed: int, available: int):
        raise OutOfBlocks(what, needed, available, self.num_free_blocks, self.num_cached_blocks)
