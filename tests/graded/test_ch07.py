"""Graded tests for Chapter 7 (flash-decoding). Run: `make grade CH=7`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import math

import numpy as np
import pytest
import torch

from minillm.kernels.ch07_flash_decoding import fa2_num_splits as fa2_reference
from minillm.kernels.ch07_flash_decoding_gluon import plan_splits as plan_reference
from minillm.reference import ch07_flash_decoding as ref
from minillm.testing import assert_close, kernel_dtypes, to_numpy

merge_ex = pytest.mark.exercise(id="7.1", title="Merging the splits by their log-sum-exp", points=2)
fa2_ex = pytest.mark.exercise(id="7.2", title="FlashAttention-2's number of splits", points=2)
split_ex = pytest.mark.exercise(id="7.3", title="One split's online softmax, tile by tile", points=3)
split_kernel_ex = pytest.mark.exercise(id="7.4", title="The split kernel: partials of one split per program",
                                       points=3, kind="triton")
merge_kernel_ex = pytest.mark.exercise(id="7.5", title="The merge kernel", points=2, kind="triton")
plan_ex = pytest.mark.exercise(id="7.6", title="Splits for persistent programs", points=2)
line_ex = pytest.mark.exercise(id="7.7", title="One equal chunk of work per program", points=2)
claim_ex = pytest.mark.exercise(id="7.8", title="Tiles claimed as the programs go", points=2)


# --- 7.1 -------------------------------------------------------------------------------------

def random_partials(rng, lead, num_splits, head_dim, empty_fraction=0.3, spread=5.0):
    """Partials ``(o [*lead, S, D], lse [*lead, S])`` with some splits empty (lse -inf, o NaN)."""
    o = rng.standard_normal((*lead, num_splits, head_dim))
    lse = spread * rng.standard_normal((*lead, num_splits))
    empty = rng.random((*lead, num_splits)) < empty_fraction
    lse[empty] = -np.inf
    o[empty] = np.nan
    return o, lse


@merge_ex
@pytest.mark.parametrize("trial", range(4))
def test_merge_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    lead = tuple(int(n) for n in rng.integers(1, 4, size=int(rng.integers(1, 3))))
    num_splits, head_dim = int(rng.integers(1, 40)), int(rng.integers(1, 20))
    o, lse = random_partials(rng, lead, num_splits, head_dim)
    out, l = impl.merge_splits(o.copy(), lse.copy())
    want_o, want_l = ref.merge_partials(o, lse)
    msg = f"lead={lead} S={num_splits} D={head_dim} seed={seed + trial}"
    assert out.shape == want_o.shape and l.shape == want_l.shape, f"shapes {out.shape}, {l.shape} ({msg})"
    assert not np.isnan(out).any(), "NaN in the output: an empty split's o must not be multiplied in (0 · NaN = NaN)"
    np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-12, err_msg=msg)
    np.testing.assert_array_equal(np.isneginf(l), np.isneginf(want_l), err_msg=msg)
    np.testing.assert_allclose(l[np.isfinite(want_l)], want_l[np.isfinite(want_l)], rtol=1e-12, atol=1e-12, err_msg=msg)


@merge_ex
def test_merge_worked_example_and_edge_cases(impl):
    # Two splits whose sums of e^x are 1 and 3 (relative to e^1000): weights 1/4 and 3/4.
    o = np.array([[[1.0, 2.0], [np.nan, np.nan], [3.0, 5.0]], [[np.nan, 1.0], [7.0, np.nan], [0.0, 0.0]]])
    lse = np.array([[1000.0, -np.inf, 1000.0 + math.log(3)], [-np.inf, -np.inf, -np.inf]])
    out, l = impl.merge_splits(o, lse)
    np.testing.assert_allclose(out[0], [2.5, 4.25], rtol=1e-14, err_msg="(1·[1, 2] + 3·[3, 5]) / 4")
    assert l[0] == pytest.approx(1000 + math.log(4), rel=1e-15), "lse = log(e^1000 + 3·e^1000): no overflow"
    assert np.array_equal(out[1], [0.0, 0.0]) and l[1] == -np.inf, "all splits empty: out 0 and lse -inf"
    out, l = impl.merge_splits(np.array([[4.0, -1.0]]), np.array([-2000.0]))
    np.testing.assert_allclose(out, [4.0, -1.0], rtol=1e-15, err_msg="one split is its own merge")
    assert l == pytest.approx(-2000.0), "no underflow either"


@merge_ex
def test_merge_equals_attention_over_all_keys(impl, seed):
    """Cut a sequence anywhere (empty pieces included): merging the pieces is attention."""
    rng = np.random.default_rng(seed)
    q_heads, kv_heads, head_dim, n = 4, 2, 8, int(rng.integers(1, 50))
    q = rng.standard_normal((q_heads, head_dim))
    k, v = 3 * rng.standard_normal((kv_heads, n, head_dim)), rng.standard_normal((kv_heads, n, head_dim))
    edges = [0, *np.sort(rng.integers(0, n + 1, size=5)).tolist(), n]
    o, lse = ref.split_partials(q, k, v, list(zip(edges[:-1], edges[1:])))
    out, l = impl.merge_splits(o, lse)
    want_o, want_l = ref.merge_partials(*ref.split_partials(q, k, v, [(0, n)]))
    np.testing.assert_allclose(out, want_o, rtol=1e-12, atol=1e-12, err_msg=f"seed={seed}")
    np.testing.assert_allclose(l, want_l, rtol=1e-12, atol=1e-12, err_msg=f"seed={seed}")


# --- 7.2 -------------------------------------------------------------------------------------

@fa2_ex
def test_fa2_hand_computed(impl):
    assert impl.fa2_num_splits(48, 1000, 108) == 2, \
        "48 programs on 108 SMs: 2 splits fill 89 % of the wave, >= 0.85 of the best (1.0, at 9 splits)"
    assert impl.fa2_num_splits(120, 1000, 108) == 1, "120 >= 0.8 · 108: the GPU is full already"
    assert impl.fa2_num_splits(8, 512, 264) == 29, "8 programs, 264 slots: the smallest s with 8s/264 >= 0.85"
    assert impl.fa2_num_splits(1, 64, 12) == 10, \
        "64 blocks in 12 splits are 6 per split, like 11: s = 12 is not eligible, the best is 11/12"
    assert impl.fa2_num_splits(1, 1, 132) == 1, "one block cannot be split"
    assert impl.fa2_num_splits(1, 4096, 264, max_splits=16) == 14, "at most 16 splits: 14/264 >= 0.85 · 16/264"


@fa2_ex
def test_fa2_float32_tie(impl):
    assert impl.fa2_num_splits(41, 40, 100) == 7, (
        "an exact tie: 0.82 (s = 2) against 0.85 · 82/85 (s = 40). In float32 efficiencies, as in the C++, "
        "it is decided against s = 2; compute the waves and efficiencies with np.float32")


@fa2_ex
@pytest.mark.parametrize("trial", range(3))
def test_fa2_matches_flash_attention_rule(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    for _ in range(300):
        sms = int(rng.choice([16, 20, 40, 100, 108, 132, 216, 264]))
        bh = int(rng.integers(1, sms + 20))
        n_blocks = int(rng.integers(1, 1100))
        max_splits = int(rng.choice([128, int(rng.integers(1, 200))]))
        want = fa2_reference(bh, n_blocks, sms, max_splits)
        got = impl.fa2_num_splits(bh, n_blocks, sms, max_splits)
        assert got == want, (f"fa2_num_splits({bh}, {n_blocks}, {sms}, max_splits={max_splits}) = {got}, "
                             f"expected {want} (seed {seed + trial})")


# --- 7.3 -------------------------------------------------------------------------------------

class RecordingRows:
    """A ``[n, head_dim]`` array that records the slices read from it and refuses the reads a
    kernel program for the split ``[start, stop)`` never makes."""

    def __init__(self, data, start: int, stop: int, block_n: int, name: str):
        self._data = data
        self.start, self.stop, self.block_n, self.name = start, stop, block_n, name
        self.shape = data.shape
        self.reads: list[tuple[int, int]] = []

    def __len__(self):
        return len(self._data)

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise AssertionError(f"read {self.name} as a slice of rows, {self.name}[a:b], got {self.name}[{index!r}]")
        a, b, _ = index.indices(len(self._data))
        if not (self.start <= a < b <= self.stop):
            raise AssertionError(f"read {self.name}[{a}:{b}]: the split only owns rows {self.start}..{self.stop - 1}")
        if (a - self.start) % self.block_n or b - a > self.block_n:
            raise AssertionError(f"read {self.name}[{a}:{b}]: a tile starts at start + i·block_n "
                                 f"(start={self.start}, block_n={self.block_n}) and holds at most block_n rows")
        self.reads.append((a, b))
        return self._data[a:b]

    def __array__(self, *args, **kwargs):
        raise AssertionError(f"do not convert the whole {self.name} to an array: read it one tile at a time")

    def __iter__(self):
        raise AssertionError(f"do not iterate over {self.name}: read it one tile at a time, {self.name}[a:b]")


def split_case(rng, rows, head_dim, seq_len, n_extra, scale=1.0):
    q = scale * rng.standard_normal((rows, head_dim))
    k = np.full((seq_len + n_extra, head_dim), np.nan)   # rows past the sequence hold no token
    v = np.full_like(k, np.nan)
    k[:seq_len] = rng.standard_normal((seq_len, head_dim))
    v[:seq_len] = rng.standard_normal((seq_len, head_dim))
    return q, k, v


def reference_split(q, k, v, start, stop, scale=None):
    o, lse = ref.split_partials(q, k[None], v[None], [(start, stop)], scale)
    return o[:, 0], lse[:, 0]


@split_ex
@pytest.mark.parametrize("trial", range(4))
def test_split_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    rows, head_dim, block_n = int(rng.integers(1, 9)), int(rng.integers(1, 33)), int(rng.choice([1, 4, 16]))
    seq_len = int(rng.integers(1, 120))
    num_splits = int(rng.integers(1, 6))
    q, k, v = split_case(rng, rows, head_dim, seq_len, n_extra=5, scale=float(rng.choice([1.0, 30.0])))
    scale = float(rng.choice([0.1, 1 / math.sqrt(head_dim)]))
    for start, stop in ref.split_bounds(seq_len, num_splits, block_n):
        end = stop if stop < seq_len else seq_len + int(rng.integers(0, 40))  # the last split may run past
        k_rec, v_rec = (RecordingRows(a, start, stop, block_n, name) for a, name in ((k, "k"), (v, "v")))
        o, lse = impl.split_partial(q, k_rec, v_rec, seq_len, start, end, block_n, scale)
        want_o, want_l = reference_split(q, k, v, start, stop, scale)
        msg = f"rows={rows} D={head_dim} block_n={block_n} seq_len={seq_len} split [{start}, {end}) seed={seed + trial}"
        np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12, err_msg=msg)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_l), err_msg=msg)
        np.testing.assert_allclose(lse[np.isfinite(want_l)], want_l[np.isfinite(want_l)], rtol=1e-12, atol=1e-12, err_msg=msg)
        tiles = [(a, min(a + block_n, stop)) for a in range(start, stop, block_n)]
        assert k_rec.reads == tiles and v_rec.reads == tiles, \
            f"read each tile of K and V once, in order: expected {tiles}, read K {k_rec.reads}, V {v_rec.reads} ({msg})"


@split_ex
def test_split_past_the_end_is_empty(impl, seed):
    rng = np.random.default_rng(seed)
    q, k, v = split_case(rng, 4, 8, 20, n_extra=20)
    k_rec, v_rec = (RecordingRows(a, 32, 32, 16, name) for a, name in ((k, "k"), (v, "v")))
    o, lse = impl.split_partial(q, k_rec, v_rec, 20, 32, 48, 16)
    assert o.shape == (4, 8) and lse.shape == (4,)
    assert np.array_equal(o, np.zeros((4, 8))) and np.all(lse == -np.inf), "an empty split: o = 0, lse = -inf"
    assert not k_rec.reads and not v_rec.reads, "an empty split reads nothing"


@split_ex
def test_split_with_huge_scores_and_a_ragged_tile(impl, seed):
    """Scores in the thousands (e^x overflows without the running max) and a last tile of 3."""
    rng = np.random.default_rng(seed)
    q, k, v = split_case(rng, 3, 16, 35, n_extra=0, scale=400.0)
    k_rec, v_rec = (RecordingRows(a, 16, 35, 16, name) for a, name in ((k, "k"), (v, "v")))
    o, lse = impl.split_partial(q, k_rec, v_rec, 35, 16, 64, 16)
    want_o, want_l = reference_split(q, k, v, 16, 35)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse)), "overflow: subtract the running max before exp"
    np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12, err_msg=f"seed={seed}")
    np.testing.assert_allclose(lse, want_l, rtol=1e-12, atol=1e-12, err_msg=f"seed={seed}")
    assert k_rec.reads == [(16, 32), (32, 35)], f"tiles [16, 32) and [32, 35), read {k_rec.reads}"


# --- 7.4 and 7.5: the Triton kernels -------------------------------------------------------------

def pick_dtype(device, seed):
    dtypes = kernel_dtypes(device)
    return dtypes[seed % len(dtypes)]


def decode_case(rng, seq_lens, q_heads, kv_heads, head_dim, dtype, device, max_len=None, q_scale=1.0):
    """``q [batch, q_heads, D]`` and a cache ``k, v [batch, kv_heads, max_len, D]`` whose slots
    past each sequence's length are NaN (reading them, even with weight 0, gives NaN)."""
    batch = len(seq_lens)
    max_len = max_len or max(max(seq_lens), 1) + 5
    k = rng.standard_normal((batch, kv_heads, max_len, head_dim))
    v = rng.standard_normal((batch, kv_heads, max_len, head_dim))
    for b, n in enumerate(seq_lens):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    as_t = lambda a: torch.from_numpy(a).to(device=device, dtype=dtype)  # noqa: E731
    q = as_t(q_scale * rng.standard_normal((batch, q_heads, head_dim)))
    return q, as_t(k), as_t(v), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def reference_partials(q, k, v, seq_lens, num_splits, block_n, scale=None):
    q, k, v = to_numpy(q), to_numpy(k), to_numpy(v)
    batch, q_heads, head_dim = q.shape
    o = np.zeros((batch, q_heads, num_splits, head_dim))
    lse = np.full((batch, q_heads, num_splits), -np.inf)
    for b, n in enumerate(seq_lens):
        o[b], lse[b] = ref.split_partials(q[b], k[b, :, :n], v[b, :, :n], ref.split_bounds(n, num_splits, block_n),
                                          scale)
    return o, lse


@split_kernel_ex
@pytest.mark.parametrize("seq_lens,q_heads,kv_heads,head_dim,num_splits", [
    ([37, 100], 4, 4, 16, 3),           # MHA; ragged last tiles
    ([50, 1, 16], 8, 2, 32, 4),         # GQA 4:1; a one-key sequence (three empty splits)
    ([70, 0], 6, 2, 16, 5),             # GQA 3:1; an empty sequence
    ([20], 8, 1, 16, 4),                # MQA; 2 tiles over 4 splits: two empty splits
    ([45, 33], 4, 2, 64, 1),            # one split: the whole sequence
])
def test_split_kernel(impl, seq_lens, q_heads, kv_heads, head_dim, num_splits, device, seed):
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    q, k, v, lens = decode_case(rng, seq_lens, q_heads, kv_heads, head_dim, dtype, device)
    o, lse = impl.flash_decode_split(q, k, v, lens, num_splits, block_n=16)
    want_o, want_lse = reference_partials(q, k, v, seq_lens, num_splits, 16)
    what = f"seq_lens={seq_lens} q_heads={q_heads} kv_heads={kv_heads} num_splits={num_splits}"
    assert o.shape == want_o.shape and lse.shape == want_lse.shape, what
    assert not torch.isnan(o).any(), f"NaN in o: a slot past the length was read, or an empty split divided 0/0 ({what})"
    assert_close(o, want_o, dtype, f"o_part ({what})", seed)
    assert_close(lse, want_lse, dtype, f"lse_part ({what})", seed)


@split_kernel_ex
def test_split_kernel_large_scores_and_scale(impl, device, seed):
    """Scores in the hundreds and a scale: the running max must be subtracted; the merged
    partials equal attention over all keys."""
    rng = np.random.default_rng(seed)
    q, k, v, lens = decode_case(rng, [61, 29], 8, 2, 16, torch.float32, device, q_scale=20.0)
    o, lse = impl.flash_decode_split(q, k, v, lens, 3, block_n=16, scale=0.8)
    want_o, want_lse = reference_partials(q, k, v, [61, 29], 3, 16, scale=0.8)
    assert_close(o, want_o, torch.float32, "o_part (large scores, scale=0.8)", seed)
    assert_close(lse, want_lse, torch.float32, "lse_part (large scores, scale=0.8)", seed, rtol=1e-5)


@merge_kernel_ex
@pytest.mark.parametrize("lead,num_splits,head_dim", [((2, 4), 3, 16), ((3, 8), 5, 32), ((1, 2), 1, 16),
                                                       ((2, 3), 13, 64), ((4,), 7, 8)])
def test_merge_kernel(impl, lead, num_splits, head_dim, device, seed):
    """Random partials with empty splits (lse -inf, o NaN) and rows with every split empty."""
    rng = np.random.default_rng(seed)
    o, lse = random_partials(rng, lead, num_splits, head_dim)
    lse.reshape(-1, num_splits)[0] = -np.inf                           # one row: every split empty
    o.reshape(-1, num_splits, head_dim)[0] = np.nan
    want_out, want_lse = ref.merge_partials(o, lse)
    o_t = torch.from_numpy(o).to(device=device, dtype=torch.float32)
    lse_t = torch.from_numpy(lse).to(device=device, dtype=torch.float32)
    out, got_lse = impl.merge_partials(o_t, lse_t)
    what = f"lead={lead} num_splits={num_splits} head_dim={head_dim}"
    assert out.shape == (*lead, head_dim) and got_lse.shape == lead, what
    assert not torch.isnan(out).any(), f"NaN: an empty split's o (NaN) was multiplied in, or 0/0 ({what})"
    assert_close(out, want_out, torch.float32, f"out ({what})", seed)
    assert_close(got_lse, want_lse, torch.float32, f"lse ({what})", seed)


@merge_kernel_ex
def test_merge_kernel_huge_lse_and_out_dtype(impl, device, seed):
    """lse values of ±1000 (subtract the max, or e^1000 overflows) and an fp16 output."""
    rng = np.random.default_rng(seed)
    o, lse = random_partials(rng, (2, 3), 6, 16)
    for shift in (1000.0, -1000.0):
        want_out, want_lse = ref.merge_partials(o, lse + shift)
        out, got_lse = impl.merge_partials(torch.from_numpy(o).float().to(device),
                                           torch.from_numpy(lse + shift).float().to(device), out_dtype=torch.float16)
        assert out.dtype == torch.float16
        assert_close(out, want_out, torch.float16, f"out (lse shifted by {shift})", seed)
        assert_close(got_lse, want_lse, torch.float32, f"lse (shifted by {shift})", seed)


@split_kernel_ex
def test_split_then_merge_is_attention(impl, device, seed):
    """The kernel's partials, merged (by the reference), give attention over all the keys,
    for any number of splits."""
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    q, k, v, lens = decode_case(rng, [83, 40, 7], 8, 2, 32, dtype, device)
    for num_splits in (2, 4, 7):
        o, lse = impl.flash_decode_split(q, k, v, lens, num_splits, block_n=16)
        out, got_lse = ref.merge_partials(to_numpy(o), to_numpy(lse))
        for b, n in enumerate([83, 40, 7]):
            kb, vb = to_numpy(k)[b, :, :n], to_numpy(v)[b, :, :n]
            want_o, want_lse = ref.merge_partials(*ref.split_partials(to_numpy(q)[b], kb, vb, [(0, n)]))
            what = f"sequence {b} (length {n}), {num_splits} splits"
            assert_close(torch.from_numpy(out[b]), want_o, dtype, what, seed)
            assert_close(torch.from_numpy(got_lse[b]), want_lse, dtype, f"lse of {what}", seed)


# --- 7.6 -------------------------------------------------------------------------------------

@plan_ex
def test_plan_hand_computed(impl):
    assert impl.plan_splits(1, 8, 32768, 132, 128) == 16, \
        "8 units, 256 tiles: at most 16 splits (128 units, one per program) of 16 tiles each"
    assert impl.plan_splits(1, 32, 4096, 132, 128) == 4, "32 units: at most 4 splits, 8 tiles each"
    assert impl.plan_splits(32, 8, 4096, 132, 128) == 1, "256 units already cover 132 programs: no split"
    assert impl.plan_splits(1, 1, 4096, 132, 128) == 32, "one unit of 32 tiles: 32 splits of one tile"
    assert impl.plan_splits(1, 8, 100, 132, 128) == 1, "a sequence shorter than a tile cannot be split"
    assert impl.plan_splits(3, 2, 0, 132, 128) == 1, "empty sequences: nothing to split"
    assert impl.plan_splits(1, 4, 4096, 132, 128, max_splits=6) == 6, "at most max_splits"
    assert impl.plan_splits(2, 3, 640, 7, 64) == 1, \
        "6 units on 7 programs, 10 tiles: one split per unit is all that fits (7 // 6 = 1)"


@plan_ex
def test_plan_takes_the_fewest_splits_of_the_same_length(impl):
    assert impl.plan_splits(1, 1, 1280, 7, 128) == 5, "10 tiles, at most 7 splits: units of 2 tiles, as with 5"
    assert impl.plan_splits(1, 1, 1280, 4, 128) == 4, "10 tiles, at most 4 splits: units of 3 tiles, 3 would be 4"
    assert impl.plan_splits(10, 1, 640, 7, 64) == 1, "10 units on 7 programs: a second unit each already"
    assert impl.plan_splits(64, 1, 640, 132, 64) == 2, "64 units on 132 programs: 2 splits of 5 tiles"


@plan_ex
@pytest.mark.parametrize("trial", range(3))
def test_plan_matches_the_kernel_module(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    for _ in range(300):
        batch, kv_heads = int(rng.integers(1, 40)), int(rng.choice([1, 2, 4, 8, 32]))
        length = int(rng.choice([0, int(rng.integers(1, 300)), int(rng.integers(1, 200_000))]))
        programs = int(rng.choice([7, 66, 114, 132, int(rng.integers(1, 300))]))
        block_n = int(rng.choice([16, 64, 128]))
        max_splits = int(rng.choice([128, int(rng.integers(1, 64))]))
        want = plan_reference(batch, kv_heads, length, programs, block_n, max_splits)
        got = impl.plan_splits(batch, kv_heads, length, programs, block_n, max_splits)
        assert got == want, (f"plan_splits({batch}, {kv_heads}, {length}, {programs}, {block_n}, "
                             f"max_splits={max_splits}) = {got}, want {want} (seed {seed + trial})")


# --- 7.7 -------------------------------------------------------------------------------------

@line_ex
def test_line_hand_computed(impl):
    got = impl.work_line_pieces([5, 0, 40], 2, 3, 16)
    assert got == [[(0, 0, 0, 5, 0, 1), (0, 1, 0, 5, 0, 1), (1, 0, 0, 0, 0, 1), (1, 1, 0, 0, 0, 1)],
                   [(2, 0, 0, 40, 0, 1), (2, 1, 0, 16, 0, 2)],
                   [(2, 1, 16, 40, 1, 2)]], \
        "lengths [5, 0, 40], 2 KV heads, 3 programs, boxes of 16: a line of 10 boxes in chunks of 4"
    assert impl.work_line_pieces([100, 7], 1, 4, 16, capacity=64) == \
        [[(0, 0, 0, 32, 0, 2)], [(0, 0, 32, 64, 1, 2)], [(1, 0, 0, 7, 0, 1)], []], \
        "a length past the capacity is clamped (100 -> 64 keys, 4 boxes); a program past the line's end gets none"
    line = impl.work_line_pieces([32768], 8, 132, 16)
    assert line[16] == [(0, 0, 32000, 32768, 16, 17), (0, 1, 0, 1232, 0, 17)], \
        "batch 1, 8 KV heads, 32k keys on 132 programs: chunks of 125 boxes; program 16 finishes a unit, starts the next"


@line_ex
@pytest.mark.parametrize("trial", range(3))
def test_line_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    for _ in range(200):
        batch, kv_heads = int(rng.integers(1, 12)), int(rng.choice([1, 2, 8, 32]))
        programs, box = int(rng.integers(1, 200)), int(rng.choice([16, 64]))
        capacity = None if rng.random() < 0.3 else int(rng.integers(0, 5000))
        lens = [int(x) for x in rng.integers(0, 2 * (capacity or 3000) + 1, batch)]
        want = ref.work_line_pieces(lens, kv_heads, programs, box, capacity)
        got = impl.work_line_pieces(lens, kv_heads, programs, box, capacity)
        assert [list(map(tuple, p)) for p in got] == want, \
            (f"work_line_pieces({lens}, {kv_heads}, {programs}, {box}, capacity={capacity}) differs from the "
             f"reference (seed {seed + trial})")


# --- 7.8 -------------------------------------------------------------------------------------

@claim_ex
def test_claims_hand_computed(impl):
    assert impl.claimed_tiles(10, [1, 2], 2) == ([[0, 1, 4, 5, 6, 8, 9], [2, 3, 7]], [7, 6]), \
        "10 tiles, programs of 1 and 2 per tile, 2 own tiles each: the fast one claims 5 of the 6 others"
    assert impl.claimed_tiles(3, [1, 1, 1, 1], 1) == ([[0], [1], [2], []], [1, 1, 1, 0]), \
        "own tile 3 is past the unit: program 3 stops there and takes nothing"
    assert impl.claimed_tiles(4, [3, 3], 0) == ([[0, 2], [1, 3]], [6, 6]), \
        "no own tiles: both claim at time 0, program 0 first"
    assert impl.claimed_tiles(0, [5, 1], 0) == ([[], []], [0, 0]), "an empty unit: every first claim fails"


@claim_ex
@pytest.mark.parametrize("trial", range(3))
def test_claims_match_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    for _ in range(300):
        programs, claim_first = int(rng.integers(1, 17)), int(rng.integers(0, 6))
        n_tiles = int(rng.integers(0, 200))
        times = [int(t) for t in rng.integers(1, 10, programs)]
        want = ref.claimed_tiles(n_tiles, times, claim_first)
        tiles, finish = impl.claimed_tiles(n_tiles, times, claim_first)
        got = ([list(map(int, t)) for t in tiles], [int(f) for f in finish])
        assert sorted(t for ts in got[0] for t in ts) == list(range(n_tiles)), \
            (f"claimed_tiles({n_tiles}, {times}, {claim_first}): every tile must go to exactly one program "
             f"(seed {seed + trial})")
        assert got == want, (f"claimed_tiles({n_tiles}, {times}, {claim_first}) = {got}, want {want} "
                             f"(seed {seed + trial})")

