"""Chapters 5-6: the paged KV-cache block manager, one behaviour per test.

The random sequences of operations, and the invariants they must keep, are in
``test_block_manager_properties.py``; here every error path, the three-way admission answer,
copy-on-write, prefix caching and the layout helpers are pinned down on small hand-checked cases.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from minillm.paged import (
    PAD, Admission, Block, BlockManager, BlockManagerError, DuplicateSequence, OutOfBlocks, PrefixCache,
    RequestTooLong, UnknownSequence, blocks_for, chain_hash, copy_blocks, flat_slot_mapping, gather_slots,
    padded_block_tables, padded_slot_mapping, write_slots,
)


def snapshot(m: BlockManager):
    """Everything observable about a manager, to check that a failed call changed nothing."""
    return (
        {s: (m.block_table(s), m.token_ids(s), m.num_cached_tokens(s)) for s in m.seq_ids()},
        [m.ref_count(b) for b in range(m.num_blocks)],
        m.free_block_ids(), m.cached_block_ids(), m.prefix_cache_entries(),
        (m.stats.prompt_tokens, m.stats.cached_prompt_tokens, m.stats.cow_copies),
    )


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# --- construction ------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [0, -3, 2.0, None])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size)


@pytest.mark.parametrize("num_blocks", [0, -1, 3.0])
def test_bad_num_blocks(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks, 4)


def test_blocks_for():
    assert [blocks_for(n, 3) for n in range(8)] == [0, 1, 1, 1, 2, 2, 2, 3]
    assert [blocks_for(n, 1) for n in range(4)] == [0, 1, 2, 3]


# --- allocation and block tables ---------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 5, 12, 21])
def test_allocate_builds_table_and_slots(block_size, n):
    m = BlockManager(64, block_size, enable_prefix_caching=False)
    assert m.allocate("a", tokens(n)) == 0
    table = m.block_table("a")
    assert len(table) == -(-n // block_size) and len(set(table)) == len(table)
    assert m.num_used_blocks == len(table) and m.num_free_blocks == 64 - len(table)
    expected = [table[p // block_size] * block_size + p % block_size for p in range(n)]
    assert m.slot_mapping("a") == expected
    assert [m.slot("a", p) for p in range(n)] == expected
    assert m.slot_mapping("a", 2 if n > 2 else 0, n) == expected[2 if n > 2 else 0:]
    assert all(m.ref_count(b) == 1 for b in table)


@pytest.mark.parametrize("block_size", [1, 3, 5])
def test_append_allocates_only_when_last_block_is_full(block_size):
    m = BlockManager(32, block_size)
    m.allocate("a", tokens(2))
    for n in range(3, 30):
        before = m.block_table("a")
        result = m.append_slot("a", 100 + n)
        after = m.block_table("a")
        new_block = (n - 1) % block_size == 0          # token n-1 (0-based) starts a block
        assert len(after) == len(before) + new_block
        assert after[:len(before)] == before
        assert result.copies == ()
        assert result.slots == (after[-1] * block_size + (n - 1) % block_size,)
        assert m.num_tokens("a") == n and m.token_ids("a")[-1] == 100 + n


def test_append_several_tokens_at_once():
    m = BlockManager(16, 4)
    m.allocate("a", tokens(3))
    result = m.append_slots(["a"], [[7, 8, 9, 10, 11, 12]])
    table = m.block_table("a")
    assert len(table) == 3 and m.num_tokens("a") == 9
    assert list(result.slots) == m.slot_mapping("a", 3, 9)
    assert m.append_slots(["a"], [[]]).slots == ()  # nothing to append is fine


def test_append_accepts_numpy_ints():
    m = BlockManager(4, 2)
    assert m.can_allocate(np.int64(3)) is Admission.FITS_NOW
    m.allocate("a", np.arange(3))
    m.append_slots(["a"], np.array([5]))
    assert m.token_ids("a") == (0, 1, 2, 5)
    r = m.append_slot("a", np.int32(6))
    assert r.slot == r.slots[0] == m.slot("a", 4)
    with pytest.raises(ValueError, match="not one"):
        _ = m.append_slots(["a"], [[7, 8]]).slot


# --- the three-way admission answer -------------------------------------------------------------
def test_admission_three_ways():
    m = BlockManager(4, 4, enable_prefix_caching=False)  # 16 token slots
    assert m.can_allocate(16) is Admission.FITS_NOW
    assert m.can_allocate(17) is Admission.NEVER_FITS
    assert m.can_allocate(tokens(17)) is Admission.NEVER_FITS
    m.allocate("a", tokens(9))                           # 3 blocks, 1 left
    assert m.can_allocate(4) is Admission.FITS_NOW
    assert m.can_allocate(5) is Admission.FITS_LATER
    assert m.can_allocate(tokens(5)) is Admission.FITS_LATER
    assert m.can_allocate(16) is Admission.FITS_LATER    # the whole pool, once "a" is gone
    m.free("a")
    assert m.can_allocate(16) is Admission.FITS_NOW


def test_allocate_matches_admission_and_changes_nothing_on_failure():
    m = BlockManager(4, 4)
    m.allocate("a", tokens(9))
    before = snapshot(m)
    with pytest.raises(OutOfBlocks) as err:
        m.allocate("b", tokens(5, 100))
    assert err.value.needed == 2 and err.value.available == 1
    assert "2 new block(s)" in str(err.value) and "1 can be handed out" in str(err.value)
    with pytest.raises(RequestTooLong) as err:
        m.allocate("b", tokens(17, 100))
    assert err.value.needed == 5 and err.value.num_blocks == 4 and "never fit" in str(err.value)
    assert snapshot(m) == before
    assert "b" not in m


def test_admission_counts_prefix_hits():
    m = BlockManager(4, 4)
    m.allocate("a", tokens(9))                           # blocks 0-1 full and cached, block 2 partial
    prompt = tokens(8) + [50, 51]                        # shares a's two full blocks
    assert m.can_allocate(len(prompt)) is Admission.FITS_LATER   # 3 blocks, 1 available
    assert m.can_allocate(prompt) is Admission.FITS_NOW          # 1 new block, 1 available
    assert m.allocate("b", prompt) == 8
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.num_used_blocks == 4 and m.num_available_blocks == 0


def test_admission_does_not_count_a_revived_block_twice():
    # An unreferenced cached block that the request hits stops being evictable: it cannot
    # also be evicted to make room for the request's fresh blocks.
    m = BlockManager(3, 2)
    m.allocate("a", [1, 2, 3])                           # [1,2] cached, [3] partial
    m.free("a")                                          # 1 cached + 2 free = 3 available
    m.allocate("x", [9])                                 # 1 cached + 1 free
    prompt = [1, 2, 5, 6, 7]                             # hits [1,2], needs 2 fresh blocks
    assert m.num_available_blocks == 2
    assert m.can_allocate(prompt) is Admission.FITS_LATER
    with pytest.raises(OutOfBlocks):
        m.allocate("b", prompt)
    m.free("x")
    assert m.can_allocate(prompt) is Admission.FITS_NOW
    assert m.allocate("b", prompt) == 2


def test_admission_asks_without_touching_the_lru():
    m = BlockManager(3, 2)
    m.allocate("a", [1, 2, 3])
    m.free("a")
    before = snapshot(m)
    assert m.can_allocate([1, 2, 9]) is Admission.FITS_NOW
    assert snapshot(m) == before


# --- error paths ---------------------------------------------------------------------------------
def test_unknown_sequence_everywhere():
    m = BlockManager(4, 2)
    m.allocate("a", [1, 2, 3])
    calls = {
        "free": lambda: m.free("zz"),
        "append": lambda: m.append_slot("zz", 1),
        "append to": lambda: m.append_slots(["a", "zz"], [1, 2]),
        "fork": lambda: m.fork("zz", "c"),
        "block_table": lambda: m.block_table("zz"),
        "slot_mapping": lambda: m.slot_mapping("zz"),
        "can_append": lambda: m.can_append(["zz"]),
    }
    before = snapshot(m)
    for name, call in calls.items():
        with pytest.raises(UnknownSequence, match="'zz'") as err:
            call()
        assert isinstance(err.value, LookupError) and isinstance(err.value, BlockManagerError), name
    assert snapshot(m) == before  # in particular, the failed batch append did not touch "a"


def test_double_free():
    m = BlockManager(4, 2)
    m.allocate("a", [1, 2, 3])
    m.free("a")
    with pytest.raises(UnknownSequence, match="already freed"):
        m.free("a")


def test_duplicate_sequence():
    m = BlockManager(8, 2)
    m.allocate("a", [1, 2, 3])
    m.allocate("b", [4])
    before = snapshot(m)
    with pytest.raises(DuplicateSequence, match="'a'") as err:
        m.allocate("a", [5])
    assert isinstance(err.value, ValueError)
    with pytest.raises(DuplicateSequence, match="'b'"):
        m.fork("a", "b")
    assert snapshot(m) == before


@pytest.mark.parametrize("bad, exc", [([], ValueError), ([1, -1], ValueError), ([2**31], ValueError),
                                      ([1.5], TypeError), (["3"], TypeError)])
def test_bad_prompts(bad, exc):
    m = BlockManager(8, 2)
    with pytest.raises(exc):
        m.allocate("a", bad)
    assert "a" not in m and m.num_free_blocks == 8


def test_bad_appends():
    m = BlockManager(8, 2)
    m.allocate("a", [1])
    m.allocate("b", [1])
    before = snapshot(m)
    with pytest.raises(ValueError, match="twice"):
        m.append_slots(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match="2 sequences but 1"):
        m.append_slots(["a", "b"], [1])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        m.append_slots(["a", "b"], [1, -5])
    with pytest.raises(ValueError):
        m.can_allocate(0)
    with pytest.raises(ValueError):
        m.blocks_to_append(["a"], -1)
    with pytest.raises(IndexError):
        m.slot("a", 1)
    with pytest.raises(IndexError):
        m.slot_mapping("a", 0, 2)
    assert snapshot(m) == before


def test_append_out_of_blocks_changes_nothing():
    m = BlockManager(3, 2, enable_prefix_caching=False)
    m.allocate("a", [1, 2])
    m.allocate("b", [3, 4])
    m.allocate("c", [5])
    assert m.can_append(["c"]) and not m.can_append(["a"]) and m.blocks_to_append(["a", "b", "c"]) == 2
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="2 new block") as err:
        m.append_slots(["c", "a", "b"], [6, 7, 8])   # "c" alone would fit: all or nothing
    assert err.value.needed == 2 and err.value.available == 0
    assert snapshot(m) == before
    m.append_slot("c", 6)                             # fills c's last block in place
    m.free("b")
    m.append_slot("a", 7)
    assert m.token_ids("a") == (1, 2, 7)


# --- fork, reference counts, copy-on-write ------------------------------------------------------
def test_fork_shares_every_block():
    m = BlockManager(16, 4)
    m.allocate("p", tokens(10))
    m.fork("p", "c")
    assert m.block_table("c") == m.block_table("p")
    assert m.token_ids("c") == m.token_ids("p")
    assert all(m.ref_count(b) == 2 for b in m.block_table("p"))
    assert m.num_used_blocks == 3


def test_copy_on_write_of_a_partial_shared_block():
    m = BlockManager(16, 4)
    m.allocate("p", tokens(10))                      # last block holds 2 of 4 tokens
    m.fork("p", "c")
    shared = m.block_table("p")
    r = m.append_slot("p", 77)
    assert len(r.copies) == 1
    src, dst = r.copies[0]
    assert src == shared[-1] and dst not in shared
    assert m.block_table("p") == shared[:-1] + [dst] and m.block_table("c") == shared
    assert r.slots == (dst * 4 + 2,)
    assert m.ref_count(src) == 1 and m.ref_count(dst) == 1 and m.ref_count(shared[0]) == 2
    r = m.append_slot("c", 88)                       # now alone in the old block: writes in place
    assert r.copies == () and r.slots == (src * 4 + 2,)
    assert m.stats.cow_copies == 1


def test_fork_of_a_full_block_needs_no_copy():
    m = BlockManager(16, 4)
    m.allocate("p", tokens(8))
    m.fork("p", "c")
    for seq in ("p", "c"):
        r = m.append_slot(seq, 5)
        assert r.copies == ()
    assert m.block_table("p")[:2] == m.block_table("c")[:2]
    assert m.block_table("p")[2] != m.block_table("c")[2]


def test_block_size_one_never_copies():
    m = BlockManager(32, 1)
    m.allocate("p", tokens(5))
    for k in range(3):
        m.fork("p", k)
    r = m.append_slots(["p", 0, 1, 2], [1, 2, 3, 4])
    assert r.copies == ()
    assert len({s for s in r.slots}) == 4


@pytest.mark.parametrize("block_size", [2, 3, 5])
def test_batched_copy_on_write(block_size):
    m = BlockManager(32, block_size, enable_prefix_caching=False)
    m.allocate("p", tokens(block_size + 1))          # last block partial
    for k in range(3):
        m.fork("p", k)
    ids = ["p", 0, 1, 2]
    predicted = m.blocks_to_append(ids)
    free_before = m.num_free_blocks
    r = m.append_slots(ids, [10, 11, 12, 13])
    assert predicted == free_before - m.num_free_blocks == 3
    srcs, dsts = [c[0] for c in r.copies], [c[1] for c in r.copies]
    assert len(r.copies) == 3 and len(set(dsts)) == 3 and not set(srcs) & set(dsts)
    for seq, slot in zip(ids, r.slots):              # every write lands in a private block
        assert m.ref_count(slot // block_size) == 1
        assert slot // block_size == m.block_table(seq)[-1]


def test_copies_and_writes_keep_every_sequence_readable():
    """Mirror the pool in a NumPy array of token ids: after performing the copies and the writes
    the manager asks for, reading each sequence through its table gives back its tokens."""
    bs = 3
    m = BlockManager(20, bs)
    pool = np.full((20, bs), -1)
    m.allocate("p", tokens(4))
    write_slots(pool, m.slot_mapping("p"), np.asarray(tokens(4)))
    m.fork("p", "a")
    m.fork("p", "b")
    for step in range(5):
        r = m.append_slots(["p", "a", "b"], [100 + step, 200 + step, 300 + step])
        copy_blocks([pool], r.copies)
        write_slots(pool, r.slots, np.asarray([100 + step, 200 + step, 300 + step]))
        for seq in ("p", "a", "b"):
            assert gather_slots(pool, m.block_table(seq), m.num_tokens(seq)).tolist() == list(m.token_ids(seq))


def test_free_returns_blocks_at_zero():
    m = BlockManager(8, 4, enable_prefix_caching=False)
    m.allocate("p", tokens(6))
    m.fork("p", "c")
    m.free("p")
    assert m.num_used_blocks == 2 and all(m.ref_count(b) == 1 for b in m.block_table("c"))
    m.free("c")
    assert m.num_free_blocks == 8 and m.num_used_blocks == 0 and len(m) == 0


# --- prefix caching ------------------------------------------------------------------------------
def test_prefix_hit_shares_blocks():
    m = BlockManager(16, 4)
    assert m.allocate("a", tokens(10)) == 0
    assert m.allocate("b", tokens(9) + [99]) == 8    # two full blocks in common
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.block_table("b")[2] != m.block_table("a")[2]
    assert [m.ref_count(b) for b in m.block_table("a")] == [2, 2, 1]
    assert m.num_cached_tokens("b") == 8
    assert m.stats.prefix_hit_rate == pytest.approx(8 / 20)


def test_same_step_requests_do_not_duplicate_blocks():
    """Two requests with the same system prompt admitted back to back (before any forward pass
    has run): the second one hits the blocks the first one registered."""
    m = BlockManager(16, 4)
    system = tokens(12)
    m.allocate("a", system + [50, 51])
    m.allocate("b", system + [60])
    assert m.num_cached_tokens("b") == 12
    assert m.num_used_blocks == 3 + 1 + 1            # 3 shared + one tail each


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_fully_cached_prompt_still_computes_a_token(block_size):
    m = BlockManager(32, block_size)
    prompt = tokens(4 * block_size)
    m.allocate("a", prompt)
    cached = m.allocate("b", prompt)
    assert cached == len(prompt) - block_size < len(prompt)
    assert cached % block_size == 0
    last_a, last_b = m.block_table("a")[-1], m.block_table("b")[-1]
    assert last_a != last_b and m.ref_count(last_b) == 1   # recomputed into a private block
    m.free("a")
    m.free("b")
    assert m.allocate("c", prompt + [7]) == len(prompt)    # one more token: the whole prompt hits


def test_cached_blocks_are_kept_and_evicted_lru_only_when_free_list_is_empty():
    m = BlockManager(6, 2)
    m.allocate("a", [1, 2, 3, 4])                    # 2 full blocks, both cached
    a0, a1 = m.block_table("a")
    m.free("a")
    assert m.num_cached_blocks == 2 and m.num_free_blocks == 4
    assert m.cached_block_ids() == [a1, a0]          # tail released first: evicted first
    m.allocate("b", tokens(8, 100))                  # takes the 4 free blocks
    assert m.num_cached_blocks == 2 and m.num_evictions == 0
    m.allocate("c", [9])                              # free list empty: evict the LRU, a's tail
    assert m.block_table("c") == [a1] and m.num_evictions == 1
    assert m.cached_block_ids() == [a0] and not m.block(a1).is_cached
    m.free("b")
    assert m.allocate("d", [1, 2, 3]) == 2            # a's head is still there
    assert m.block_table("d")[0] == a0


def test_evict_cached():
    m = BlockManager(8, 2)
    m.allocate("a", tokens(6))
    m.free("a")
    assert m.num_cached_blocks == 3
    assert m.evict_cached(1) == 1 and m.num_cached_blocks == 2
    assert m.evict_cached() == 2 and m.num_cached_blocks == 0 and m.num_free_blocks == 8
    assert m.prefix_cache_entries() == {}
    with pytest.raises(ValueError):
        m.evict_cached(-1)
    assert m.allocate("b", tokens(6)) == 0


def test_prefix_caching_off():
    m = BlockManager(8, 2, enable_prefix_caching=False)
    m.allocate("a", tokens(6))
    assert m.allocate("b", tokens(6)) == 0
    m.free("a")
    assert m.num_cached_blocks == 0 and m.prefix_cache_entries() == {}


def test_blocks_filled_by_decoding_are_cached():
    m = BlockManager(8, 2)
    m.allocate("a", [1])
    for t in [2, 3, 4]:
        m.append_slot("a", t)
    m.free("a")
    assert m.allocate("b", [1, 2, 3, 4, 5]) == 4


def test_colliding_hash_never_serves_wrong_blocks():
    """With a hash that maps everything to one key, verification must turn every false match
    into a miss; true matches of the first block can still hit."""
    m = BlockManager(16, 2, hash_fn=lambda parent, toks: b"same")
    m.allocate("a", [1, 2, 3, 4, 5])
    assert m.allocate("b", [9, 9, 3, 4, 5]) == 0      # same key, different tokens
    assert m.allocate("c", [7, 1, 2, 4, 5]) == 0      # a's tokens, shifted
    assert m.allocate("d", [1, 2, 3, 4, 6]) == 2      # the one true match that is findable
    assert m.block_table("d")[0] == m.block_table("a")[0]
    assert m.block_table("d")[1] != m.block_table("a")[1]


def test_same_tokens_at_another_position_do_not_hit():
    """A block's K and V depend on its position and everything before it, not only on its own
    tokens: with a hash blind to the parent, a repeated block must still miss."""
    m = BlockManager(16, 2, hash_fn=lambda parent, toks: bytes(toks))
    m.allocate("a", [1, 2, 1, 2, 1])                 # [1,2] twice; the second copy's key is taken
    assert m.allocate("b", [1, 2, 1, 2, 9]) == 2
    table = m.block_table("b")
    assert table[0] == m.block_table("a")[0] and table[1] != table[0]


def test_real_hash_finds_the_whole_chain():
    m = BlockManager(16, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    assert m.allocate("d", [1, 2, 3, 4, 6]) == 4


def test_chain_hash_is_stable_and_chained():
    toks = [1, 2, 70000, 2**31 - 1]
    expected = hashlib.blake2b(b"" + np.asarray(toks, "<i4").tobytes(), digest_size=16).digest()
    assert chain_hash(None, toks) == expected
    assert chain_hash(None, toks) != chain_hash(chain_hash(None, [0]), toks)   # depends on the parent
    assert chain_hash(None, [1, 2]) != chain_hash(None, [2, 1])
    code = "from minillm.paged import chain_hash; print(chain_hash(None, [1, 2, 70000, 2**31 - 1]).hex())"
    for seed in ("0", "12345"):  # a fresh interpreter with another hash salt
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        assert out == expected.hex()


def test_prefix_cache_unregister_removes_descendants():
    cache = PrefixCache()
    b0, b1, b2, other = Block(0), Block(1), Block(2), Block(3)
    assert cache.register(b0, b"k0", None, [1])
    assert cache.register(b1, b"k1", b0, [2])
    assert cache.register(b2, b"k2", b1, [3])
    assert cache.register(other, b"k3", b0, [4])
    assert not cache.register(Block(4), b"k1", b0, [2])          # key taken: first wins
    assert not cache.register(Block(5), b"k5", Block(6), [2])    # parent not cached
    removed = cache.unregister(b1)
    assert removed[0] is b1 and set(removed) == {b1, b2}
    assert cache.entries() == {b"k0": 0, b"k3": 3}
    assert not b2.is_cached and b0.children == {other}
    assert cache.lookup(b"k3", b0, [4]) is other
    assert cache.lookup(b"k3", None, [4]) is None                 # wrong parent
    assert cache.lookup(b"k3", b0, [5]) is None                   # wrong tokens


# --- layout helpers ------------------------------------------------------------------------------
def test_padded_block_tables():
    out = padded_block_tables([[3, 1], [], [0, 5, 2]])
    assert out.dtype == np.int32 and out.tolist() == [[3, 1, PAD], [PAD] * 3, [0, 5, 2]]
    assert padded_block_tables([[1]], max_blocks=4).tolist() == [[1, -1, -1, -1]]
    with pytest.raises(ValueError, match="max_blocks"):
        padded_block_tables([[1, 2, 3]], max_blocks=2)
    t = padded_block_tables([[1, 2], [3]], device="cpu")
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.tolist() == [[1, 2], [3, -1]]


def test_slot_mappings():
    out = padded_slot_mapping([[5, 6, 7], [9]])
    assert out.dtype == np.int64 and out.tolist() == [[5, 6, 7], [9, -1, -1]]
    with pytest.raises(ValueError, match="max_len"):
        padded_slot_mapping([[1, 2]], max_len=1)
    assert flat_slot_mapping([[5, 6], [], [9]]).tolist() == [5, 6, 9]
    assert flat_slot_mapping([], device="cpu").dtype == torch.int64


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_copy_write_gather(lib):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((6, 3, 2, 4))            # [num_blocks, block_size, kv_heads, head_dim]
    k = torch.from_numpy(k) if lib == "torch" else k
    orig = k.clone() if lib == "torch" else k.copy()
    copy_blocks([k], [(1, 4), (2, 5)])
    assert (k[4] == orig[1]).all() and (k[5] == orig[2]).all() and (k[:4] == orig[:4]).all()
    values = np.arange(2 * 2 * 4, dtype=np.float64).reshape(2, 2, 4)
    values = torch.from_numpy(values) if lib == "torch" else values
    write_slots(k, [7, PAD], values)                 # slot 7 = block 2, offset 1; the pad is skipped
    assert (k[2, 1] == values[0]).all()
    got = gather_slots(k, [2, 0], 4)                 # positions 0..3: block 2 then block 0
    assert (got[0] == k[2, 0]).all() and (got[1] == values[0]).all() and (got[3] == k[0, 0]).all()
    assert gather_slots(k, [2, PAD, PAD], 3).shape == (3, 2, 4)     # padding past the tokens is fine
    with pytest.raises(ValueError, match="padding"):
        gather_slots(k, [2, PAD], 4)
    with pytest.raises(ValueError, match="more than"):
        gather_slots(k, [2], 4)
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks([k], [(1, 3), (2, 3)])
    with pytest.raises(ValueError, match="source"):
        copy_blocks([k], [(1, 3), (3, 4)])
    copy_blocks([k], [])


def test_write_slots_rejects_a_non_contiguous_cache():
    cache = np.zeros((3, 4, 2, 2)).transpose(1, 0, 2, 3)   # [4 blocks, 3 slots, ...], blocks not outermost
    with pytest.raises(ValueError, match="contiguous"):
        write_slots(cache, [0], np.ones((1, 2, 2)))
    assert not cache.any()
