"""Chapters 5-6: the block manager's invariants under random sequences of operations.

A hypothesis state machine allocates, forks, appends (batched, several tokens at a time), frees
and evicts at random, on pools of 1-24 blocks with block sizes from 1 to 7, with prefix caching
on or off, and with the real hash or a deliberately terrible one (three possible keys), whose
collisions the hit verification must catch.

Alongside the manager it keeps a model of the GPU pool: ``pool[block, offset]`` holds a
fingerprint of the whole prefix up to the token written there, standing in for that token's K
and V (which depend on every earlier token and on the position). The test performs exactly the
copies and writes the manager asks for, so a wrong slot, a missed copy-on-write, a write into a
shared block, or a prefix hit on the wrong block all show up as a sequence that no longer reads
back its own prefix fingerprints.

After every step (``@invariant``):

- free + used + cached-evictable = total, and the three sets of block ids partition the pool;
- each block's ref count equals the number of block-table entries that point at it;
- each sequence occupies ``ceil(len / block_size)`` blocks and reads back its own fingerprints;
- every prefix-cache entry points at a block that is cached under that key, whose parent is
  cached, and whose contents are the fingerprints of the prefix its chain spells (no stale
  block, no reused block).

Checked when it happens: every slot handed out for a write lies in a block referenced only by
the writing sequence; copies have distinct destinations that are not sources; the admission
answer matches what ``allocate`` does; a failed call changes nothing; a hit never covers the whole
prompt. At the end (teardown) every sequence is freed and the whole pool must come back.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.paged import Admission, BlockManager, OutOfBlocks, RequestTooLong, chain_hash

MOD = (1 << 61) - 1  # a Mersenne prime: rolling fingerprints stay below 2**61, in int64
EMPTY = -1


def fingerprints(tokens) -> list[int]:
    """``fp[p]`` identifies ``tokens[:p + 1]``: what a token's K and V depend on."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % MOD
        out.append(h)
    return out


def weak_hash(parent, tokens) -> bytes:
    """Three possible keys: nearly every lookup collides, and verification must notice."""
    return bytes([sum(tokens) % 3])


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4, 5, 7]),
                caching=st.booleans(), weak=st.booleans())
    def setup(self, num_blocks, block_size, caching, weak):
        self.m = BlockManager(num_blocks, block_size, enable_prefix_caching=caching,
                              hash_fn=weak_hash if weak else chain_hash)
        self.bs = block_size
        self.pool = np.full((num_blocks, block_size), EMPTY, dtype=np.int64)
        self.prompts: list[list[int]] = []  # every prompt so far, to build prompts sharing prefixes
        self.next_id = 0

    # -- helpers -----------------------------------------------------------------------------------
    def snapshot(self):
        m = self.m
        return ({s: (m.block_table(s), m.token_ids(s)) for s in m.seq_ids()},
                [m.ref_count(b) for b in range(m.num_blocks)], m.free_block_ids(), m.cached_block_ids(),
                m.prefix_cache_entries())

    def write(self, seq_id, slots, positions):
        """Write the fingerprints of ``seq_id``'s tokens at ``positions`` into ``slots``."""
        fps = fingerprints(self.m.token_ids(seq_id))
        table = self.m.block_table(seq_id)
        for slot, pos in zip(slots, positions):
            block = slot // self.bs
            assert block in table and self.m.ref_count(block) == 1, "a write would land in a shared block"
            self.pool[block, slot % self.bs] = fps[pos]

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # -- rules -------------------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data):
        n = data.draw(st.integers(1, 3 * self.bs + 2), label="prompt length")
        fresh = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="tokens")
        if self.prompts and data.draw(st.booleans(), label="reuse a prefix"):
            base = data.draw(st.sampled_from(self.prompts), label="base prompt")
            cut = data.draw(st.integers(0, len(base)), label="prefix length")
            fresh = (base[:cut] + fresh)[:max(n, 1)]
        self.admit(fresh)

    @precondition(lambda self: len(self.m.prefix_cache_entries()) > 0)
    @rule(data=st.data())
    def prefix_hit(self, data):
        """A prompt that starts with the chain of a cached block (evictable or in use) and goes on."""
        candidates = sorted(self.m.prefix_cache_entries().values())
        evictable = self.m.cached_block_ids()
        if evictable and data.draw(st.booleans(), label="hit an unreferenced block"):
            candidates = evictable  # reviving these is what admission must count right
        node, chain = self.m.block(data.draw(st.sampled_from(candidates), label="cached block")), []
        while node is not None:
            chain[:0] = node.token_ids
            node = node.parent
        if data.draw(st.booleans(), label="repeat the prefix"):
            chain = chain + chain  # the same blocks at other positions: must not hit (other K and V)
        extra = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2 * self.bs), label="tokens after the hit")
        self.admit(chain + extra)

    @precondition(lambda self: self.m.num_free_blocks > 0)
    @rule(data=st.data())
    def squeeze(self, data):
        """Memory pressure: a prompt as long as the free list, leaving only cached blocks to evict."""
        n = self.m.num_free_blocks * self.bs
        self.admit(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="tokens"))

    def admit(self, prompt):
        """Ask `can_allocate`, then check that `allocate` does what the answer said."""
        answer = self.m.can_allocate(prompt)
        by_count = self.m.can_allocate(len(prompt))
        assert (answer is Admission.NEVER_FITS) == (by_count is Admission.NEVER_FITS)
        if by_count is Admission.FITS_NOW:
            assert answer is Admission.FITS_NOW  # knowing the tokens can only help
        seq_id, before = self.new_id(), self.snapshot()
        if answer is Admission.NEVER_FITS:
            try:
                self.m.allocate(seq_id, prompt)
                raise AssertionError("allocate accepted a request that never fits")
            except RequestTooLong:
                assert self.snapshot() == before
            return
        if answer is Admission.FITS_LATER:
            try:
                self.m.allocate(seq_id, prompt)
                raise AssertionError("allocate accepted a request that fits only later")
            except OutOfBlocks:
                assert self.snapshot() == before
            return
        cached = self.m.allocate(seq_id, prompt)
        assert 0 <= cached < len(prompt) and cached % self.bs == 0
        if not self.m.enable_prefix_caching:
            assert cached == 0
        self.prompts.append(prompt)
        self.write(seq_id, self.m.slot_mapping(seq_id, cached), range(cached, len(prompt)))

    @precondition(lambda self: len(self.m) > 0)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.m.seq_ids()), label="parent")
        used = self.m.num_used_blocks
        child = self.new_id()
        self.m.fork(parent, child)
        assert self.m.num_used_blocks == used  # sharing costs nothing until a write

    @precondition(lambda self: len(self.m) > 0)
    @rule(data=st.data())
    def append(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.m.seq_ids()), min_size=1, unique=True), label="sequences")
        k = data.draw(st.integers(0, self.bs + 1), label="tokens each")
        toks = [data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k), label="new tokens") for _ in ids]
        needed, available, before = self.m.blocks_to_append(ids, k), self.m.num_available_blocks, self.snapshot()
        assert self.m.can_append(ids, k) == (needed <= available)
        if needed > available:
            try:
                self.m.append_slots(ids, toks)
                raise AssertionError("append_slots went past the pool")
            except OutOfBlocks:
                assert self.snapshot() == before
            return
        lengths = {s: self.m.num_tokens(s) for s in ids}
        result = self.m.append_slots(ids, toks)
        assert self.m.num_available_blocks == available - needed  # the prediction was exact
        srcs, dsts = [c[0] for c in result.copies], [c[1] for c in result.copies]
        assert len(set(dsts)) == len(dsts) and not set(srcs) & set(dsts)
        self.pool[dsts] = self.pool[srcs]  # copy-on-write first, as the engine must
        assert len(result.slots) == k * len(ids)
        for i, s in enumerate(ids):
            self.write(s, result.slots[i * k:(i + 1) * k], range(lengths[s], lengths[s] + k))

    @precondition(lambda self: len(self.m) > 0)
    @rule(data=st.data())
    def free(self, data):
        # Several at a time, so that the pool drains as often as it fills.
        for s in data.draw(st.lists(st.sampled_from(self.m.seq_ids()), min_size=1, unique=True), label="sequences"):
            self.m.free(s)

    @rule(n=st.none() | st.integers(0, 4))
    def evict(self, n):
        cached = self.m.num_cached_blocks
        moved = self.m.evict_cached(n)
        assert self.m.num_cached_blocks == cached - moved
        assert moved == cached if n is None else moved >= min(n, cached)

    # -- invariants --------------------------------------------------------------------------------
    @invariant()
    def pool_is_partitioned(self):
        m = self.m
        free, cached = set(m.free_block_ids()), set(m.cached_block_ids())
        used = {b for b in range(m.num_blocks) if m.ref_count(b) > 0}
        assert len(free) == m.num_free_blocks and len(cached) == m.num_cached_blocks
        assert m.num_free_blocks + m.num_used_blocks + m.num_cached_blocks == m.num_blocks
        assert len(used) == m.num_used_blocks
        assert free | cached | used == set(range(m.num_blocks))
        assert not (free & cached) and not (free & used) and not (cached & used)
        assert all(m.block(b).is_cached for b in cached)

    @invariant()
    def ref_counts_match_tables(self):
        counts = np.zeros(self.m.num_blocks, dtype=int)
        for s in self.m.seq_ids():
            table = self.m.block_table(s)
            assert len(table) == -(-self.m.num_tokens(s) // self.bs)
            np.add.at(counts, table, 1)
        assert counts.tolist() == [self.m.ref_count(b) for b in range(self.m.num_blocks)]

    @invariant()
    def every_sequence_reads_back_its_prefix(self):
        for s in self.m.seq_ids():
            n, table = self.m.num_tokens(s), self.m.block_table(s)
            slots = [table[p // self.bs] * self.bs + p % self.bs for p in range(n)]
            assert self.pool.reshape(-1)[slots].tolist() == fingerprints(self.m.token_ids(s))

    @invariant()
    def prefix_cache_points_at_live_contents(self):
        entries = self.m.prefix_cache_entries()
        if not self.m.enable_prefix_caching:
            assert entries == {}
        for key, b in entries.items():
            block = self.m.block(b)
            assert block.hash == key and len(block.token_ids) == self.bs
            chain, node = [], block
            while node is not None:
                assert node.is_cached, "a cached block's ancestor left the cache"
                chain.append(node.token_ids)
                node = node.parent
            prefix = [t for toks in reversed(chain) for t in toks]
            assert self.pool[b].tolist() == fingerprints(prefix)[-self.bs:], "stale cached block"

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for s in self.m.seq_ids():
            self.m.free(s)
        assert self.m.num_used_blocks == 0 and len(self.m) == 0
        assert self.m.num_free_blocks + self.m.num_cached_blocks == self.m.num_blocks
        self.m.evict_cached()
        assert self.m.num_free_blocks == self.m.num_blocks and self.m.prefix_cache_entries() == {}


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerProperties = BlockManagerMachine.TestCase
