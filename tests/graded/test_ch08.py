"""Graded tests for Chapter 8 (the decode-time linear layer). Run: `make grade CH=8`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import math

import numpy as np
import pytest
import torch

from minillm.kernels.ch08_flat_gemm import find_inflection_points as kernels_find_inflection_points
from minillm.reference import ch08_flat_gemm as ref
from minillm.testing import assert_close, kernel_dtypes, to_numpy

gemv_ex = pytest.mark.exercise(id="8.1", title="The GEMV reduction, tile by tile", points=3)
inflection_ex = pytest.mark.exercise(id="8.2", title="Inflection points from a sweep", points=3)
tile_ex = pytest.mark.exercise(id="8.3", title="One flat-GEMM tile: padding and split-K", points=4)
gemv_kernel_ex = pytest.mark.exercise(id="8.4", title="The GEMV kernel", points=2, kind="triton")
flat_kernel_ex = pytest.mark.exercise(id="8.5", title="The flat GEMM kernel with split-K", points=3, kind="triton")


# --- 8.1 -------------------------------------------------------------------------------------

class RecordingWeight:
    """A weight matrix ``[N, K]`` that counts how often each element is read and refuses any
    read other than a tile slice ``w[n0:n1, k0:k1]``."""

    def __init__(self, w: np.ndarray):
        self._w = w
        self.shape = w.shape
        self.dtype = w.dtype
        self.reads = np.zeros(w.shape, dtype=np.int64)
        self.tiles: list[tuple[int, int, int, int]] = []

    def __getitem__(self, index):
        if not (isinstance(index, tuple) and len(index) == 2
                and all(isinstance(i, slice) and i.step in (None, 1) for i in index)):
            raise AssertionError(f"read the weights as tiles, w[n0:n1, k0:k1]; got w[{index!r}]")
        (r0, r1, _), (c0, c1, _) = index[0].indices(self.shape[0]), index[1].indices(self.shape[1])
        self.reads[r0:r1, c0:c1] += 1
        self.tiles.append((r0, r1, c0, c1))
        return self._w[r0:r1, c0:c1].copy()

    def __array__(self, *args, **kwargs):
        raise AssertionError("do not convert the whole weight matrix to an array: stream it tile by tile")

    def __iter__(self):
        raise AssertionError("do not iterate over the weight matrix: read it tile by tile")


def check_gemv(impl, x, w, block_n, block_k, msg):
    rec = RecordingWeight(w)
    y = impl.gemv_tiles(x, rec, block_n, block_k)
    assert isinstance(y, np.ndarray) and y.shape == (x.shape[0], w.shape[0]), f"y must be [M, N]: {msg}"
    assert y.dtype == np.float32, f"accumulate and return float32 (the kernel's registers), got {y.dtype}: {msg}"
    K = x.shape[1]
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-5 * max(1.0, math.sqrt(K)), err_msg=msg)
    np.testing.assert_array_equal(rec.reads, 1, err_msg=f"every weight must be read exactly once: {msg}")
    for r0, r1, c0, c1 in rec.tiles:
        assert r0 % block_n == 0 and c0 % block_k == 0, \
            f"tile w[{r0}:{r1}, {c0}:{c1}] does not start at a multiple of (block_n, block_k): {msg}"
        assert 0 < r1 - r0 <= block_n and 0 < c1 - c0 <= block_k, \
            f"tile w[{r0}:{r1}, {c0}:{c1}] is larger than block_n x block_k (or empty): {msg}"


@gemv_ex
@pytest.mark.parametrize("trial", range(10))
def test_gemv_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    M, N, K = int(rng.integers(1, 9)), int(rng.integers(1, 70)), int(rng.integers(1, 90))
    block_n, block_k = int(rng.choice([1, 4, 8, 16, 32])), int(rng.choice([4, 8, 16, 32]))
    x, w = rng.standard_normal((M, K)), rng.standard_normal((N, K)) / math.sqrt(K)
    check_gemv(impl, x, w, block_n, block_k, f"M={M} N={N} K={K} block_n={block_n} block_k={block_k}, seed {seed + trial}")


@gemv_ex
def test_gemv_ragged_and_exact_tiles(impl, seed):
    """One row; tiles that divide N and K exactly; tiles larger than the matrix."""
    rng = np.random.default_rng(seed)
    for M, N, K, block_n, block_k in [(1, 7, 5, 4, 4), (3, 32, 64, 16, 32), (2, 5, 9, 64, 128)]:
        x, w = rng.standard_normal((M, K)), rng.standard_normal((N, K))
        check_gemv(impl, x, w, block_n, block_k, f"M={M} N={N} K={K} block_n={block_n} block_k={block_k}, seed {seed}")


# --- 8.2 -------------------------------------------------------------------------------------

MS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def staircase(gemv_best_to, flat_best_to):
    """GEMV 20 % faster than the others up to gemv_best_to, flat GEMM 20 % faster than cuBLAS
    up to flat_best_to, cuBLAS 20 % faster beyond."""
    g = [8.0 if m <= gemv_best_to else 14.0 for m in MS]
    f = [10.0 if m <= flat_best_to else 12.0 for m in MS]
    c = [12.0 if m <= flat_best_to else 10.0 for m in MS]
    return g, f, c


@inflection_ex
def test_inflection_points_hand_made(impl):
    got = impl.find_inflection_points(MS, *staircase(4, 64))
    assert tuple(got) == (4, 64), f"GEMV best up to 4, flat GEMM up to 64: expected (4, 64), got {got}"
    assert tuple(impl.find_inflection_points(MS, *staircase(0, 0))) == (0, 0), "cuBLAS best everywhere: (0, 0)"
    assert tuple(impl.find_inflection_points(MS, *staircase(256, 256))) == (256, 256), "GEMV best everywhere"
    assert tuple(impl.find_inflection_points(MS, *staircase(0, 32))) == (0, 32), "GEMV never best"
    same = [5.0] * len(MS)
    assert tuple(impl.find_inflection_points(MS, same, same, same)) == (256, 256), \
        "all tied everywhere: ties go to the largest M1, then the largest M2"
    g, f, c = staircase(4, 64)
    g[3] = f[3] * 1.01                                      # at M = 8 the GEMV is 1 % slower than flat
    assert tuple(impl.find_inflection_points(MS, g, f, c, tolerance=0.02)) == (8, 64), \
        "1 % slower is within a 2 % tolerance: the GEMV keeps M = 8"
    assert tuple(impl.find_inflection_points(MS, g, f, c, tolerance=0.0)) == (4, 64), "no tolerance: it does not"
    g, f, c = staircase(4, 64)
    f[-1] = c[-1] * 0.995                                   # flat wins at 256 by 0.5 %, cuBLAS at 128 by 20 %
    assert tuple(impl.find_inflection_points(MS, g, f, c, tolerance=0.0)) == (4, 64), \
        "one noisy point past a range where cuBLAS clearly wins must not move M2"
    g = [8.0] * 5 + [None, float("nan"), None, float("inf")]  # the GEMV measured up to 16 only
    ten = [10.0] * len(MS)
    assert tuple(impl.find_inflection_points(MS, g, ten, ten)) == (16, 256), \
        "an unmeasured kernel (None, NaN, inf) is never chosen"


@inflection_ex
@pytest.mark.parametrize("trial", range(12))
def test_inflection_points_match_the_kernels_module(impl, trial, seed):
    """Random sweeps shaped like real ones (GEMV time growing with M, cuBLAS shrinking
    relative to flat), plus noise; the GEMV sometimes measured only up to some M."""
    rng = np.random.default_rng(seed + trial)
    ms = sorted(set(int(m) for m in rng.integers(1, 300, size=int(rng.integers(2, 12)))))
    base = rng.uniform(5, 10)
    g = [base * (0.7 + 0.05 * m) * rng.uniform(0.97, 1.03) for m in ms]
    f = [base * (0.9 + 0.002 * m) * rng.uniform(0.97, 1.03) for m in ms]
    c = [base * rng.uniform(0.95, 1.2) for m in ms]
    cut = int(rng.integers(0, len(ms) + 1))
    g = [t if i < cut else None for i, t in enumerate(g)]
    tolerance = float(rng.choice([0.0, 0.01, 0.02, 0.05]))
    got = impl.find_inflection_points(ms, g, f, c, tolerance=tolerance)
    want = kernels_find_inflection_points(ms, g, f, c, tolerance=tolerance)
    assert tuple(got) == want, f"ms={ms}, tolerance={tolerance}: expected {want}, got {got}, seed {seed + trial}"
    assert all(type(v) is int for v in got), f"return Python ints, got {[type(v).__name__ for v in got]}"


@inflection_ex
def test_inflection_points_refuses_bad_sweeps(impl):
    with pytest.raises(ValueError):
        impl.find_inflection_points([1, 4, 2], [1.0] * 3, [1.0] * 3, [1.0] * 3)       # not increasing
    with pytest.raises(ValueError):
        impl.find_inflection_points([1, 2], [1.0] * 2, [1.0] * 2, [1.0] * 3)          # lengths differ
    with pytest.raises(ValueError):
        # M = 1 has only cuBLAS, which M = 2 lacks: every dispatch misses a point
        impl.find_inflection_points([1, 2], [None, 1.0], [None, 1.0], [1.0, None])


# --- 8.3 -------------------------------------------------------------------------------------

def expected_partials(x, w, pid_m, pid_n, block_m, block_n, block_k, split_k):
    """float64 partials of one program: zero-padded tiles, K split as the kernels split it."""
    M, K = x.shape
    N = w.shape[0]
    m0, n0 = pid_m * block_m, pid_n * block_n
    xt = np.zeros((block_m, K))
    wt = np.zeros((block_n, K))
    xt[:max(0, min(block_m, M - m0))] = x[m0:m0 + block_m]
    wt[:max(0, min(block_n, N - n0))] = w[n0:n0 + block_n]
    return np.stack([xt[:, lo:hi] @ wt[:, lo:hi].T for lo, hi in ref.split_k_ranges(K, block_k, split_k)])


def check_tile(impl, x, w, pid_m, pid_n, block_m, block_n, block_k, split_k, msg):
    M, K = x.shape
    N = w.shape[0]
    out = np.full((M, N), np.nan)
    partials = impl.flat_gemm_tile(x, w, pid_m, pid_n, out, block_m, block_n, block_k, split_k)
    partials = np.asarray(partials)
    assert partials.shape == (split_k, block_m, block_n), \
        f"partials must be [split_k, block_m, block_n] = {(split_k, block_m, block_n)}, got {partials.shape}: {msg}"
    assert partials.dtype == np.float32, f"partials are float32 (the kernel's registers), got {partials.dtype}: {msg}"
    want = expected_partials(x, w, pid_m, pid_n, block_m, block_n, block_k, split_k)
    np.testing.assert_allclose(partials, want, rtol=1e-5, atol=1e-5 * math.sqrt(K),
                               err_msg=f"partial s sums the K tiles of run s only: {msg}")
    m0, n0 = pid_m * block_m, pid_n * block_n
    rows, cols = max(0, min(block_m, M - m0)), max(0, min(block_n, N - n0))
    assert not partials[:, rows:].any() and not partials[:, :, cols:].any(), \
        f"padding rows (past M) and columns (past N) must hold zeros: pad the operands with zeros ({msg})"
    inside = np.zeros((M, N), dtype=bool)
    inside[m0:m0 + rows, n0:n0 + cols] = True
    assert np.isnan(out[~inside]).all(), f"the program wrote outside its own tile of out: {msg}"
    np.testing.assert_allclose(out[inside], (x @ w.T)[inside], rtol=1e-5, atol=1e-5 * math.sqrt(K),
                               err_msg=f"out's tile must be the sum of the partials: {msg}")
    return out


@tile_ex
@pytest.mark.parametrize("trial", range(10))
def test_one_tile_partials_and_padding(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    M, N, K = int(rng.integers(1, 40)), int(rng.integers(1, 70)), int(rng.integers(1, 100))
    block_m, block_n = int(rng.choice([16, 32])), int(rng.choice([8, 16, 32]))
    block_k, split_k = int(rng.choice([8, 16])), int(rng.integers(1, 5))
    x, w = rng.standard_normal((M, K)), rng.standard_normal((N, K)) / math.sqrt(K)
    grid = (-(-M // block_m), -(-N // block_n))
    # The last (ragged) tile half of the time, else any tile.
    pid_m, pid_n = (grid[0] - 1, grid[1] - 1) if trial % 2 else (int(rng.integers(grid[0])), int(rng.integers(grid[1])))
    check_tile(impl, x, w, pid_m, pid_n, block_m, block_n, block_k, split_k,
               f"M={M} N={N} K={K} tile ({pid_m}, {pid_n}) of {block_m}x{block_n}, block_k={block_k}, "
               f"split_k={split_k}, seed {seed + trial}")


@tile_ex
def test_every_tile_gives_the_product(impl, seed):
    """All the programs of the grid together write x @ w.T, every element once."""
    rng = np.random.default_rng(seed)
    M, N, K, block_m, block_n, block_k, split_k = 35, 50, 70, 16, 16, 16, 2
    x, w = rng.standard_normal((M, K)), rng.standard_normal((N, K))
    out = np.full((M, N), np.nan)
    for pid_m in range(-(-M // block_m)):
        for pid_n in range(-(-N // block_n)):
            impl.flat_gemm_tile(x, w, pid_m, pid_n, out, block_m, block_n, block_k, split_k)
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-4, err_msg=f"seed {seed}")


@tile_ex
def test_empty_runs_and_a_single_row(impl, seed):
    """K = 40 in tiles of 16 is 3 tiles: over 4 runs, the last run is empty (a zero partial).
    A batch of one row: 15 of the 16 rows of the tile are padding."""
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((1, 40)), rng.standard_normal((20, 40))
    out = check_tile(impl, x, w, 0, 0, 16, 32, 16, 4, f"M=1 N=20 K=40 split_k=4, seed {seed}")
    assert not np.isnan(out).any()


# --- 8.4 and 8.5: the Triton kernels -------------------------------------------------------------

def pick_dtype(device, seed):
    dtypes = kernel_dtypes(device)
    return dtypes[seed % len(dtypes)]


def linear_case(rng, M, N, K, dtype, device):
    as_t = lambda a: torch.from_numpy(a).to(device=device, dtype=dtype)  # noqa: E731
    return as_t(rng.standard_normal((M, K))), as_t(rng.standard_normal((N, K)))


def check_linear(y, x, w, dtype, what, seed):
    """``y`` against ``x @ w.T`` in float64 on the (rounded) inputs. The kernels add K
    products in float32, so the tolerance grows with ``sqrt(K)``."""
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == torch.float32, f"y must be [M, N] float32: {what}"
    K = x.shape[1]
    atol, rtol = {torch.float32: (1e-5, 1e-5)}.get(dtype, (1e-4, 1e-4))
    assert_close(y, ref.linear(to_numpy(x), to_numpy(w)), dtype, f"y ({what})", seed,
                 atol=atol * math.sqrt(K), rtol=rtol)


@gemv_kernel_ex
@pytest.mark.parametrize("M,N,K,block_n,block_k", [
    (1, 37, 70, 16, 32),         # one row: the decode step of one sequence
    (3, 100, 129, 16, 32),       # ragged N and K tiles
    (5, 16, 64, 16, 64),         # exact tiles
    (16, 45, 33, 32, 16),
])
def test_gemv_kernel(impl, M, N, K, block_n, block_k, device, seed):
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    x, w = linear_case(rng, M, N, K, dtype, device)
    y = impl.gemv(x, w, block_n=block_n, block_k=block_k)
    check_linear(y, x, w, dtype, f"M={M} N={N} K={K} block_n={block_n} block_k={block_k}", seed)


@flat_kernel_ex
@pytest.mark.parametrize("M,N,K,split_k,block_n,block_k", [
    (1, 37, 70, 1, 32, 32),      # one row: 15 padding rows in the 16-row tile
    (5, 50, 129, 2, 32, 32),     # 5 K tiles over 2 slices: 3 + 2
    (16, 33, 70, 5, 16, 32),     # 3 K tiles over 5 slices: two slices empty
    (20, 64, 96, 3, 32, 32),     # two M tiles (the second 4 rows); 3 slices of one tile
    (3, 40, 200, 4, 16, 16),
])
def test_flat_gemm_kernel(impl, M, N, K, split_k, block_n, block_k, device, seed):
    rng = np.random.default_rng(seed)
    dtype = pick_dtype(device, seed)
    x, w = linear_case(rng, M, N, K, dtype, device)
    y = impl.flat_gemm(x, w, split_k=split_k, block_n=block_n, block_k=block_k)
    check_linear(y, x, w, dtype, f"M={M} N={N} K={K} split_k={split_k} block_n={block_n} block_k={block_k}", seed)


@flat_kernel_ex
def test_flat_gemm_kernel_split_k_does_not_change_the_product(impl, device, seed):
    """Every split of K gives the same product (to float32 rounding): each slice's partial sum
    must be added, once, and the slices must cover K exactly."""
    rng = np.random.default_rng(seed)
    x, w = linear_case(rng, 4, 24, 160, torch.float32, device)
    ys = [impl.flat_gemm(x, w, split_k=s, block_n=16, block_k=16) for s in (1, 2, 3, 7, 10, 12)]
    for s, y in zip((1, 2, 3, 7, 10, 12), ys):
        check_linear(y, x, w, torch.float32, f"split_k={s}, K=160, block_k=16", seed)
