"""Graded tests for Chapter 5 (the paged KV cache). Run: `make grade CH=5`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import math

import numpy as np
import pytest
import torch

from minillm.paged import Admission, BlockManager
from minillm.paged.errors import (
    BlockManagerError, DuplicateSequence, OutOfBlocks, RequestTooLong, UnknownSequence,
)
from minillm.paged.layout import write_slots
from minillm.reference import ch05_paged_attention as ref
from minillm.testing import assert_close, kernel_dtypes, to_numpy

tables_ex = pytest.mark.exercise(id="5.1", title="Block tables: allocate, append, free, admission", points=3)
gather_ex = pytest.mark.exercise(id="5.2", title="The paged gather in NumPy", points=2)
address_ex = pytest.mark.exercise(id="5.3", title="The kernel's address computation", points=3)
decode_ex = pytest.mark.exercise(id="5.4", title="Paged decode attention, block by block", points=2)
kernel_ex = pytest.mark.exercise(id="5.5", title="The paged tile load of the decode kernel", points=3, kind="triton")
write_ex = pytest.mark.exercise(id="5.6", title="The paged KV write kernel", points=2, kind="triton")


def shuffled_pool(rng, seq_len, block_size, kv_heads, head_dim, spare=3, padding=2):
    """A float64 pool holding one sequence of ``seq_len`` random tokens in randomly chosen
    blocks; every slot that holds no token is NaN. Returns ``(k_cache, v_cache, table, k, v)``
    with ``table`` padded by ``padding`` entries of -1 and ``k, v: [kv_heads, seq_len, head_dim]``."""
    n_blocks = math.ceil(seq_len / block_size)
    num_blocks = n_blocks + spare
    blocks = rng.permutation(num_blocks)[:n_blocks]
    k_cache = np.full((num_blocks, block_size, kv_heads, head_dim), np.nan)
    v_cache = np.full_like(k_cache, np.nan)
    k, v = rng.standard_normal((2, kv_heads, seq_len, head_dim))
    for p in range(seq_len):
        k_cache[blocks[p // block_size], p % block_size] = k[:, p]
        v_cache[blocks[p // block_size], p % block_size] = v[:, p]
    table = np.concatenate([blocks, np.full(padding, -1)]).astype(np.int32)
    return k_cache, v_cache, table, k, v


# --- 5.1 -------------------------------------------------------------------------------------

def state(bt):
    """Everything a failed call must leave untouched."""
    return list(bt.free_list), {s: list(t) for s, t in bt.tables.items()}, dict(bt.lengths)


def check_invariants(bt, msg=""):
    """Blocks are either free or in exactly one table; each table has ceil(len / bs) blocks."""
    used = [b for t in bt.tables.values() for b in t]
    free = list(bt.free_list)
    assert len(set(used)) == len(used), f"a block is in two tables {msg}"
    assert len(set(free)) == len(free), f"a block is on the free list twice {msg}"
    assert sorted(used + free) == list(range(bt.num_blocks)), \
        f"free + used blocks must be the whole pool, each once: free {free}, tables {bt.tables} {msg}"
    assert set(bt.tables) == set(bt.lengths), f"tables and lengths must have the same sequences {msg}"
    for s, t in bt.tables.items():
        want = math.ceil(bt.lengths[s] / bt.block_size)
        assert len(t) == want, (f"sequence {s!r} holds {bt.lengths[s]} tokens: {want} block(s) of "
                                f"{bt.block_size}, not {len(t)} {msg}")


@tables_ex
def test_append_takes_a_block_only_when_the_last_is_full(impl):
    bt = impl.BlockTables(num_blocks=6, block_size=4)
    table = bt.allocate("a", 5)                                  # 5 tokens: two blocks, the second holds 1
    assert len(table) == 2 and bt.num_free == 4, f"5 tokens in blocks of 4 take 2 blocks, got {table}"
    assert bt.block_table("a") == table
    for pos in range(5, 8):                                      # positions 5, 6, 7 fill block 1
        slot = bt.append("a")
        assert bt.block_table("a") == table, f"position {pos} fits in the last block: no new block"
        assert slot == table[1] * 4 + pos % 4, f"position {pos}: slot table[1] * 4 + {pos % 4}, got {slot}"
    slot = bt.append("a")                                        # position 8: block 1 is full
    new = bt.block_table("a")
    assert len(new) == 3 and new[:2] == table and bt.num_free == 3, "position 8 needs a third block"
    assert slot == new[2] * 4, f"position 8 is offset 0 of the new block: slot {new[2] * 4}, got {slot}"
    assert bt.num_tokens("a") == 9
    check_invariants(bt)
    bt.free("a")
    assert bt.num_free == 6 and "a" not in bt.tables, "free returns every block"
    check_invariants(bt)


@tables_ex
def test_three_way_admission(impl):
    bt = impl.BlockTables(num_blocks=8, block_size=16)
    assert bt.can_allocate(1) is Admission.FITS_NOW
    assert bt.can_allocate(128) is Admission.FITS_NOW, "8 blocks of 16 hold 128 tokens"
    assert bt.can_allocate(129) is Admission.NEVER_FITS, "129 tokens need 9 blocks: more than the pool"
    bt.allocate(0, 100)                                          # 7 blocks, 1 left
    assert bt.can_allocate(16) is Admission.FITS_NOW
    assert bt.can_allocate(17) is Admission.FITS_LATER, "2 blocks needed, 1 free, 8 in the pool: wait"
    assert bt.can_allocate(129) is Admission.NEVER_FITS
    with pytest.raises(ValueError):
        bt.can_allocate(0)


@tables_ex
def test_errors_are_clear_and_change_nothing(impl):
    bt = impl.BlockTables(num_blocks=4, block_size=3)
    bt.allocate("a", 9)                                          # 3 full blocks, 1 free
    bt.append("a")                                               # position 9 takes the last block
    cases = [
        (lambda: bt.allocate("b", 13), RequestTooLong, "13 tokens need 5 blocks > 4: can never fit"),
        (lambda: bt.allocate("b", 1), OutOfBlocks, "no free block now"),
        (lambda: bt.allocate("a", 1), DuplicateSequence, "'a' is live"),
        (lambda: bt.allocate("b", 0), ValueError, "an empty prompt"),
        (lambda: bt.append("zzz"), UnknownSequence, "no such sequence"),
        (lambda: bt.free("zzz"), UnknownSequence, "no such sequence"),
    ]
    bt.append("a")
    bt.append("a")                                               # positions 10, 11: the pool is full
    for call, error, why in cases + [(lambda: bt.append("a"), OutOfBlocks, "position 12 needs a 5th block")]:
        before = state(bt)
        with pytest.raises(error) as info:
            call()
        assert state(bt) == before, f"{error.__name__} ({why}): the call changed the state before failing"
        assert str(info.value), "give the error a message"
    check_invariants(bt)


@tables_ex
@pytest.mark.parametrize("trial", range(12))
def test_random_operations_match_the_block_manager(impl, trial, seed):
    """A random stream of allocate / append / free / can_allocate calls, some of which must
    fail, on your class and on `minillm.paged.BlockManager`: same answers, same errors, same
    number of free blocks and the same table lengths after every call."""
    rng = np.random.default_rng(seed + trial)
    num_blocks, bs = int(rng.integers(1, 12)), int(rng.choice([1, 2, 3, 4, 7, 16]))
    mine = impl.BlockTables(num_blocks, bs)
    theirs = BlockManager(num_blocks, bs, enable_prefix_caching=False)
    next_id = 0
    for step in range(150):
        live = theirs.seq_ids()
        kind = rng.choice(["allocate", "append", "append", "append", "free", "ask"])
        if kind in ("append", "free") and live and rng.random() < 0.9:
            sid = live[int(rng.integers(len(live)))]
        elif kind == "allocate" and live and rng.random() < 0.1:
            sid = live[0]                                        # a duplicate
        else:
            sid, next_id = next_id, next_id + 1                  # fresh (unknown for append/free)
        n = int(rng.integers(0, num_blocks * bs + bs + 2))       # 0, fits, fits later, never fits
        msg = f"step {step}: {kind}({sid!r}{', ' + str(n) if kind in ('allocate', 'ask') else ''}), " \
              f"num_blocks={num_blocks} block_size={bs}, seed {seed + trial}"
        if kind == "ask":
            if n == 0:
                continue
            got, want = mine.can_allocate(n), theirs.can_allocate(n)
            assert got is want, f"{msg}: can_allocate says {got}, should be {want}"
            continue
        ours_call = {"allocate": lambda: mine.allocate(sid, n), "append": lambda: mine.append(sid),
                     "free": lambda: mine.free(sid)}[kind]
        ref_call = {"allocate": lambda: theirs.allocate(sid, [7] * n), "append": lambda: theirs.append_slot(sid, 7),
                    "free": lambda: theirs.free(sid)}[kind]
        want_err = got_err = None
        try:
            want = ref_call()
        except (BlockManagerError, ValueError) as e:
            want_err = type(e)
        before = state(mine)
        try:
            got = ours_call()
        except (BlockManagerError, ValueError) as e:
            got_err = type(e)
        if want_err is not None:
            assert got_err is want_err, f"{msg}: should raise {want_err.__name__}, got " \
                                        f"{got_err.__name__ if got_err else 'no error'}"
            assert state(mine) == before, f"{msg}: {want_err.__name__} must leave everything as it was"
        else:
            assert got_err is None, f"{msg}: raised {got_err.__name__}, but the call fits"
            if kind == "append":
                table, pos = mine.block_table(sid), mine.num_tokens(sid) - 1
                assert got == table[pos // bs] * bs + pos % bs, f"{msg}: slot {got} is not where position {pos} lives"
                assert table[:len(before[1][sid])] == before[1][sid], f"{msg}: appending moved existing blocks"
            if kind == "allocate":
                assert list(got) == mine.block_table(sid), f"{msg}: allocate must return the new table"
        check_invariants(mine, msg)
        assert mine.num_free == theirs.num_free_blocks, \
            f"{msg}: {mine.num_free} free blocks, the block manager has {theirs.num_free_blocks}"
        assert sorted(mine.tables) == sorted(theirs.seq_ids()), f"{msg}: live sequences differ"
        for s in theirs.seq_ids():
            assert mine.num_tokens(s) == theirs.num_tokens(s), f"{msg}: length of {s!r}"


# --- 5.2 -------------------------------------------------------------------------------------

@gather_ex
@pytest.mark.parametrize("trial", range(10))
def test_gather_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    bs = int(rng.choice([1, 3, 4, 7, 16, 17]))
    kv_heads, head_dim = int(rng.choice([1, 2, 4])), int(rng.choice([4, 8]))
    n = int(rng.integers(1, 5 * bs + 2)) if trial % 3 else bs * int(rng.integers(1, 5))   # some fill the last block
    k_cache, v_cache, table, k, v = shuffled_pool(rng, n, bs, kv_heads, head_dim)
    row = table.tolist() if trial % 2 else table
    got_k, got_v = impl.gather_kv(k_cache, v_cache, row, n)
    want_k, want_v = ref.gather_paged_kv(k_cache, v_cache, table, n)
    msg = f"block_size={bs} num_tokens={n} kv_heads={kv_heads}, seed {seed + trial}"
    assert np.shape(got_k) == (kv_heads, n, head_dim), f"k must be [kv_heads, num_tokens, head_dim]: {msg}"
    np.testing.assert_array_equal(got_k, want_k, err_msg=msg)
    np.testing.assert_array_equal(got_v, want_v, err_msg=msg)
    np.testing.assert_array_equal(got_k, k, err_msg=msg)          # the tokens as they were written


@gather_ex
def test_gather_of_a_prefix_and_of_nothing(impl, seed):
    """Fewer tokens than the sequence holds (a prefix), and zero tokens."""
    rng = np.random.default_rng(seed)
    k_cache, v_cache, table, k, v = shuffled_pool(rng, 23, 5, 2, 4)
    got_k, got_v = impl.gather_kv(k_cache, v_cache, table, 11)
    np.testing.assert_array_equal(got_k, k[:, :11], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(got_v, v[:, :11], err_msg=f"seed {seed}")
    got_k, _ = impl.gather_kv(k_cache, v_cache, table, 0)
    assert np.shape(got_k) == (2, 0, 4), "zero tokens: an empty [kv_heads, 0, head_dim]"


@gather_ex
def test_gather_refuses_padding_and_short_tables(impl, seed):
    rng = np.random.default_rng(seed)
    k_cache, v_cache, table, _, _ = shuffled_pool(rng, 10, 4, 1, 4, padding=1)   # 3 blocks, then one -1
    with pytest.raises(ValueError):
        impl.gather_kv(k_cache, v_cache, table, 13)           # position 12 is in the -1 entry
    with pytest.raises(ValueError):
        impl.gather_kv(k_cache, v_cache, table, 17)           # position 16 is past the table


# --- 5.3 -------------------------------------------------------------------------------------

class RecordingTable:
    """A block-table row that counts the entries read and refuses the reads the kernel never
    makes: entries of positions at or past the length (they may be -1, or lie past the table)."""

    def __init__(self, entries, readable: int):
        self._entries = np.asarray(entries, dtype=np.int64)
        self.readable = readable              # entries 0 .. readable-1 cover positions < seq_len
        self.reads = 0

    def __len__(self):
        return len(self._entries)

    def __getitem__(self, index):
        idx = np.asarray(index)
        if idx.dtype == bool or not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"index the block table with integers (a scalar or an int array), got {index!r}")
        flat = idx.reshape(-1)
        bad = flat[(flat < 0) | (flat >= self.readable)]
        if bad.size:
            b = int(bad[0])
            what = ("a negative index" if b < 0 else "past the table's end" if b >= len(self._entries)
                    else f"entry {self._entries[b]}, past the sequence's blocks")
            raise AssertionError(f"read block-table entry {b} ({what}): the kernel never loads entries "
                                 f"of positions >= seq_len (only entries 0..{self.readable - 1} cover the sequence)")
        self.reads += flat.size
        return self._entries[idx]

    def __array__(self, *args, **kwargs):
        raise AssertionError("do not convert the whole block-table row to an array: that reads every entry, "
                             "-1 padding included; index it with the entries you need")

    def __iter__(self):
        raise AssertionError("do not iterate over the whole block-table row: index the entries you need")


def expected_rows(table, start, block_n, seq_len, bs, stride_block, stride_offset):
    pos = start + np.arange(block_n)
    ok = pos < seq_len
    slots = ref.paged_kv_addresses(table, pos[ok], bs)
    return ok, (slots // bs) * stride_block + (slots % bs) * stride_offset


def tile_case(rng, bs, seq_len, padding):
    n_blocks = math.ceil(seq_len / bs)
    num_blocks = n_blocks + 4
    table = np.concatenate([rng.permutation(num_blocks)[:n_blocks], np.full(padding, -1)])
    kv_heads, head_dim = int(rng.integers(1, 4)), int(rng.choice([4, 8]))
    stride_offset = kv_heads * head_dim
    stride_block = (bs + int(rng.integers(0, 2))) * stride_offset   # sometimes a padded (strided) pool
    return table, num_blocks, stride_block, stride_offset


def check_tile(impl, table, num_blocks, start, block_n, seq_len, bs, stride_block, stride_offset, msg):
    guard = RecordingTable(table, math.ceil(seq_len / bs))
    rows, ok = impl.tile_rows(guard, start, block_n, seq_len, bs, stride_block, stride_offset)
    rows, ok = np.asarray(rows), np.asarray(ok)
    want_ok, want_rows = expected_rows(table, start, block_n, seq_len, bs, stride_block, stride_offset)
    assert rows.shape == (block_n,) and ok.shape == (block_n,), f"rows and row_ok are [block_n]: {msg}"
    assert rows.dtype == np.int64, f"rows must be int64 (offsets pass 2^31 in a big pool), got {rows.dtype}"
    np.testing.assert_array_equal(ok, want_ok, err_msg=f"row_ok = position < seq_len: {msg}")
    np.testing.assert_array_equal(rows[ok], want_rows, err_msg=f"rows of the positions < seq_len: {msg}")
    assert np.all((rows[~ok] >= 0) & (rows[~ok] < num_blocks * stride_block)), \
        f"masked rows must still address the pool (block 0 is fine): {rows[~ok]}, {msg}"
    return guard


@address_ex
@pytest.mark.parametrize("trial", range(12))
def test_tile_rows_every_tile_of_a_sequence(impl, trial, seed):
    """Every tile of a sequence, block sizes 1, 3, 7, 16, 17, ..., tables padded with -1 or
    not padded at all (then the last tile reaches past the table's end)."""
    rng = np.random.default_rng(seed + trial)
    bs = int(rng.choice([1, 2, 3, 5, 7, 8, 16, 17, 32, 64]))
    block_n = int(rng.choice([4, 8, 16]))
    seq_len = int(rng.integers(1, 6 * max(bs, block_n)))
    table, num_blocks, sb, so = tile_case(rng, bs, seq_len, padding=int(rng.integers(0, 3)))
    for start in range(0, seq_len, block_n):
        msg = f"block_size={bs} block_n={block_n} seq_len={seq_len} start={start}, seed {seed + trial}"
        check_tile(impl, table, num_blocks, start, block_n, seq_len, bs, sb, so, msg)


@address_ex
@pytest.mark.parametrize("bs,block_n", [(16, 16), (32, 8), (64, 16), (12, 4), (6, 3)])
def test_one_block_tiles_read_one_entry(impl, bs, block_n, seed):
    """When a block holds whole tiles, one table entry serves a tile (the kernel's fast path)."""
    rng = np.random.default_rng(seed)
    seq_len = int(rng.integers(2 * bs, 4 * bs))
    table, num_blocks, sb, so = tile_case(rng, bs, seq_len, padding=1)
    for start in range(0, seq_len, block_n):
        msg = f"block_size={bs} block_n={block_n} seq_len={seq_len} start={start}, seed {seed}"
        guard = check_tile(impl, table, num_blocks, start, block_n, seq_len, bs, sb, so, msg)
        assert guard.reads == 1, f"the tile lies in one block: read one table entry, not {guard.reads} ({msg})"


@address_ex
def test_block_size_one_and_a_ragged_last_tile(impl, seed):
    """Block size 1 (every position its own block) and a last tile mostly past the length,
    over a table without padding: its entries past the length do not exist."""
    rng = np.random.default_rng(seed)
    for bs, block_n, seq_len in [(1, 8, 13), (3, 8, 10), (7, 4, 7), (5, 16, 21)]:
        table, num_blocks, sb, so = tile_case(rng, bs, seq_len, padding=0)
        start = (seq_len - 1) // block_n * block_n
        check_tile(impl, table, num_blocks, start, block_n, seq_len, bs, sb, so,
                   f"block_size={bs} block_n={block_n} seq_len={seq_len} start={start}, seed {seed}")


# --- 5.4 -------------------------------------------------------------------------------------

@decode_ex
@pytest.mark.parametrize("trial", range(8))
def test_paged_decode_matches_the_reference(impl, trial, seed):
    """NaN in every slot that holds no token: reading past the length, even with weight 0,
    gives NaN. Scores up to the hundreds."""
    rng = np.random.default_rng(seed + trial)
    q_heads, kv_heads = [(4, 4), (8, 2), (6, 1), (4, 2)][trial % 4]
    bs, head_dim = int(rng.choice([1, 3, 8, 16, 17])), int(rng.choice([4, 8]))
    n = int(rng.integers(1, 5 * bs + 3)) if trial % 3 else 3 * bs
    k_cache, v_cache, table, _, _ = shuffled_pool(rng, n, bs, kv_heads, head_dim)
    q = float(rng.choice([1.0, 30.0])) * rng.standard_normal((q_heads, head_dim))
    out, lse = impl.paged_decode_one(q, k_cache, v_cache, table, n)
    want_out, want_lse = ref.paged_decode_attention(q[None], k_cache, v_cache, table[None], [n])
    msg = f"q_heads={q_heads} kv_heads={kv_heads} block_size={bs} seq_len={n}, seed {seed + trial}"
    assert not np.isnan(out).any(), f"NaN: a slot past the length was read ({msg})"
    np.testing.assert_allclose(out, want_out[0], rtol=1e-10, atol=1e-12, err_msg=msg)
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-12, atol=1e-12, err_msg=msg)


@decode_ex
def test_paged_decode_scale_and_empty_sequence(impl, seed):
    rng = np.random.default_rng(seed)
    k_cache, v_cache, table, _, _ = shuffled_pool(rng, 9, 4, 2, 8)
    q = rng.standard_normal((4, 8))
    out, lse = impl.paged_decode_one(q, k_cache, v_cache, table, 9, scale=0.7)
    want_out, want_lse = ref.paged_decode_attention(q[None], k_cache, v_cache, table[None], [9], scale=0.7)
    np.testing.assert_allclose(out, want_out[0], rtol=1e-10, atol=1e-12, err_msg=f"scale=0.7, seed {seed}")
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-12, atol=1e-12, err_msg=f"scale=0.7, seed {seed}")
    out, lse = impl.paged_decode_one(q, k_cache, v_cache, table, 0)
    assert np.shape(out) == (4, 8) and not np.any(out), "seq_len 0: out = 0"
    assert np.all(np.asarray(lse) == -np.inf), "seq_len 0: lse = -inf"


# --- 5.5 and 5.6: the Triton kernels -------------------------------------------------------------

def pick_dtype(device, seed):
    """One of the dtypes kernels are tested in on ``device`` (fp32/fp16 on the CPU), by seed."""
    dtypes = kernel_dtypes(device)
    return dtypes[seed % len(dtypes)]


def paged_batch(rng, seq_lens, block_size, kv_heads, head_dim, dtype, device, spare=3, padding=2):
    """A pool holding ``len(seq_lens)`` sequences in shuffled blocks, every slot without a token
    NaN; block tables int32 ``[batch, max_blocks + padding]`` padded with -1."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + spare
    order = rng.permutation(num_blocks)
    k_cache = np.full((num_blocks, block_size, kv_heads, head_dim), np.nan)
    v_cache = np.full_like(k_cache, np.nan)
    tables = np.full((len(seq_lens), max(need, default=0) + padding), -1, dtype=np.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        blocks = order[used:used + need[b]]
        used += need[b]
        tables[b, :need[b]] = blocks
        for p in range(n):
            k_cache[blocks[p // block_size], p % block_size] = rng.standard_normal((kv_heads, head_dim))
            v_cache[blocks[p // block_size], p % block_size] = rng.standard_normal((kv_heads, head_dim))
    # One more NaN block in front of the pool, which is a view past it: a row read through a
    # -1 entry then lands there (NaN, caught) instead of before the tensor (a crash).
    as_t = lambda a: torch.from_numpy(np.concatenate([np.full_like(a[:1], np.nan), a])).to(  # noqa: E731
        device=device, dtype=dtype)[1:]
    return (as_t(k_cache), as_t(v_cache), torch.from_numpy(tables).to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


@kernel_ex
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens", [
    (4, 4, 16, 16, [37, 16]),               # MHA, tiles inside one block
    (8, 2, 32, 7, [50, 1, 23]),             # GQA 4:1, tiles straddle blocks of 7
    (6, 2, 16, 1, [19, 33]),                # GQA 3:1, one token per block
    (8, 1, 16, 3, [0, 40, 17]),             # MQA, an empty sequence
    (4, 2, 64, 17, [70]),                   # a block size just past the tile
])
def test_paged_decode_kernel(impl, q_heads, kv_heads, head_dim, block_size, seq_lens, device, seed):
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    k_cache, v_cache, tables, lens = paged_batch(rng, seq_lens, block_size, kv_heads, head_dim, dtype, device)
    q = torch.from_numpy(rng.standard_normal((len(seq_lens), q_heads, head_dim))).to(device=device, dtype=dtype)
    out, lse = impl.paged_decode(q, k_cache, v_cache, tables, lens)
    want_out, want_lse = ref.paged_decode_attention(to_numpy(q), to_numpy(k_cache), to_numpy(v_cache),
                                                    tables.cpu().numpy(), seq_lens)
    what = f"q_heads={q_heads} kv_heads={kv_heads} block_size={block_size} seq_lens={seq_lens}"
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (len(seq_lens), q_heads)
    assert not torch.isnan(out).any(), f"NaN in the output: a slot past a sequence's length was read ({what})"
    assert_close(out, want_out, dtype, f"out ({what})", seed)
    assert_close(lse, want_lse, dtype, f"lse ({what})", seed)


@kernel_ex
def test_paged_decode_kernel_scale_and_large_scores(impl, device, seed):
    """Scores in the hundreds (the online softmax must subtract its running max) and a scale."""
    rng = np.random.default_rng(seed)
    dtype = torch.float32
    k_cache, v_cache, tables, lens = paged_batch(rng, [45, 29], 5, 2, 16, dtype, device)
    q = torch.from_numpy(20 * rng.standard_normal((2, 4, 16))).to(device=device, dtype=dtype)
    out, lse = impl.paged_decode(q, k_cache, v_cache, tables, lens, scale=0.9)
    want_out, want_lse = ref.paged_decode_attention(to_numpy(q), to_numpy(k_cache), to_numpy(v_cache),
                                                    tables.cpu().numpy(), [45, 29], scale=0.9)
    assert_close(out, want_out, dtype, "out (scale=0.9, large scores)", seed)
    assert_close(lse, want_lse, dtype, "lse (scale=0.9, large scores)", seed, rtol=1e-5)


@write_ex
@pytest.mark.parametrize("num_blocks,block_size,kv_heads,head_dim,num_tokens,pad", [
    (6, 16, 2, 16, 9, 0),
    (9, 3, 3, 32, 14, 3),                   # 3 KV heads (padded to 4 in the kernel), -1 slots
    (5, 1, 1, 16, 5, 1),
    (7, 7, 4, 64, 20, 2),
])
def test_write_kv_kernel(impl, num_blocks, block_size, kv_heads, head_dim, num_tokens, pad, device, seed):
    """Random distinct slots (some -1: padding, nothing written); every other slot must keep
    its old contents. The pool is a view that starts one block into a larger tensor, so a
    write through slot -1 lands in that block (and is caught) instead of before the tensor."""
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    big_k = torch.from_numpy(rng.standard_normal((num_blocks + 1, *shape[1:]))).to(device=device, dtype=dtype)
    big_v = torch.from_numpy(rng.standard_normal((num_blocks + 1, *shape[1:]))).to(device=device, dtype=dtype)
    k_cache, v_cache = big_k[1:], big_v[1:]
    want_k, want_v, before = to_numpy(k_cache), to_numpy(v_cache), to_numpy(big_k[0])
    slots = rng.permutation(num_blocks * block_size)[:num_tokens]
    slots[rng.permutation(num_tokens)[:pad]] = -1
    k_new = torch.from_numpy(rng.standard_normal((num_tokens, kv_heads, head_dim))).to(device=device, dtype=dtype)
    v_new = torch.from_numpy(rng.standard_normal((num_tokens, kv_heads, head_dim))).to(device=device, dtype=dtype)
    impl.write_kv(k_cache, v_cache, k_new, v_new, torch.from_numpy(slots).to(device))
    write_slots(want_k, slots, to_numpy(k_new))
    write_slots(want_v, slots, to_numpy(v_new))
    what = f"slots {slots.tolist()}, pool {shape}"
    assert np.array_equal(to_numpy(big_k[0]), before), f"a -1 slot (padding) was written ({what})"
    assert_close(k_cache, want_k, dtype, f"k_cache ({what})", seed, atol=0, rtol=0)
    assert_close(v_cache, want_v, dtype, f"v_cache ({what})", seed, atol=0, rtol=0)


@write_ex
def test_write_kv_kernel_follows_the_strides(impl, device, seed):
    """A pool whose blocks are padded (block stride > block_size · row): a slot is block
    ``slot // block_size`` and offset ``slot % block_size``, not row ``slot`` of a flat view."""
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    num_blocks, block_size, kv_heads, head_dim = 5, 6, 2, 16
    big_k = torch.from_numpy(rng.standard_normal((num_blocks, block_size + 2, kv_heads, head_dim))).to(device, dtype)
    big_v = torch.from_numpy(rng.standard_normal((num_blocks, block_size + 2, kv_heads, head_dim))).to(device, dtype)
    k_cache, v_cache = big_k[:, 1:block_size + 1], big_v[:, 1:block_size + 1]      # strided views
    want_k, want_v = to_numpy(big_k), to_numpy(big_v)
    slots = rng.permutation(num_blocks * block_size)[:11]
    k_new = torch.from_numpy(rng.standard_normal((11, kv_heads, head_dim))).to(device=device, dtype=dtype)
    v_new = torch.from_numpy(rng.standard_normal((11, kv_heads, head_dim))).to(device=device, dtype=dtype)
    impl.write_kv(k_cache, v_cache, k_new, v_new, torch.from_numpy(slots).to(device))
    inner_k, inner_v = want_k[:, 1:block_size + 1].copy(), want_v[:, 1:block_size + 1].copy()
    write_slots(inner_k, slots, to_numpy(k_new))
    write_slots(inner_v, slots, to_numpy(v_new))
    want_k[:, 1:block_size + 1], want_v[:, 1:block_size + 1] = inner_k, inner_v
    assert_close(big_k, want_k, dtype, f"the padded pool of K (slots {slots.tolist()})", seed, atol=0, rtol=0)
    assert_close(big_v, want_v, dtype, f"the padded pool of V (slots {slots.tolist()})", seed, atol=0, rtol=0)
