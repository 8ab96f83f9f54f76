"""Graded tests for Chapter 7 (flash-decoding). Run: `make grade CH=7`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import math

import numpy as np
import pytest

from minillm.kernels.ch07_flash_decoding import fa2_num_splits as fa2_reference
from minillm.reference import ch07_flash_decoding as ref

merge_ex = pytest.mark.exercise(id="7.1", title="Merging the splits by their log-sum-exp", points=2)
fa2_ex = pytest.mark.exercise(id="7.2", title="FlashAttention-2's number of splits", points=2)
split_ex = pytest.mark.exercise(id="7.3", title="One split's online softmax, tile by tile", points=3)


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
