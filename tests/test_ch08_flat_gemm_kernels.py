"""Chapter 8's decode-GEMM kernels and dispatcher against float64 NumPy references.

(The references themselves are tested in `test_ch08_flat_gemm_reference.py`.)

- `gemv` and `flat_gemm` against `minillm.reference.ch08_flat_gemm.linear`: M in {1, 2, 3, 5, 16,
  17, 33} (one program, several, a ragged last one), N and K not powers of two (ragged last
  tiles), with and without bias, split-K on and off (runs of unequal length), into a
  NaN-poisoned ``out`` (every element must be written) that is a strided view inside a
  larger NaN buffer (nothing outside it may be written), strided and transposed ``x``;
  forced tiles (GEMV rows per program that are not powers of two, flat tiles of 32 rows);
  split-K results reproducible bit for bit; empty M and K; bad inputs refused.
- The dispatch: `choose_kernel` at and around the thresholds, `DispatchTable` (save/load
  round trip through `minillm.engine.gemm_table`, the nearest-shape fallback, the default
  rule, the file name per GPU, refusals),
  `find_inflection_points` on hand-made sweeps (clean, ties within tolerance, a noisy point,
  missing GEMV times, kernels never best) and random ones (its answer has the least regret
  of all pairs); `linear` on CPU is ``F.linear``; on a GPU every branch equals ``F.linear``.
- `bench.ch08_flat_gemm` end to end on a tiny shape (a stand-in timer).

CPU: fp32 (exact dots) and fp16 under the interpreter, small shapes. GPU (`make gpu`): the
same plus bf16, Llama-2-7B shapes, autotuning and every branch of `linear`.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minillm.kernels import ch08_flat_gemm as fg
from minillm.engine.gemm_table import load_table, save_table, table_for_device, table_path
from minillm.kernels.ch08_flat_gemm import (
    DEFAULT_TABLE, DEFAULT_THRESHOLDS, DispatchTable, TileConfig, choose_kernel, find_exceptions,
    find_inflection_points, flat_gemm,
    gemv, linear,
)
from minillm.reference import ch08_flat_gemm as ref
from minillm.testing import assert_close, poisoned, random_tensor, to_numpy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KERNELS = {"gemv": gemv, "flat_gemm": flat_gemm}


@pytest.fixture(autouse=True)
def one_config_per_test(monkeypatch):
    """On a GPU, compile one config per kernel variant instead of timing every candidate
    (`test_autotuning_picks_and_caches` turns tuning back on)."""
    monkeypatch.setenv("MINILLM_FLAT_GEMM_AUTOTUNE", "0")


def operands(M, N, K, dtype, device, gen, with_bias=True):
    x = random_tensor((M, K), dtype, device, gen)
    w = random_tensor((N, K), dtype, device, gen, scale=1 / math.sqrt(max(K, 1)))  # outputs of order 1
    b = random_tensor((N,), dtype, device, gen) if with_bias else None
    return x, w, b


def expected(x, w, b):
    return ref.linear(to_numpy(x), to_numpy(w), None if b is None else to_numpy(b))


def tol(dtype, K):
    """fp16/bf16 outputs are rounded once (the sums are fp32); fp32 sums of K products differ
    from float64 by ~sqrt(K) ulps."""
    return None if dtype != torch.float32 else 1e-5 * max(1.0, math.sqrt(K) / 4)


# ----------------------------------------------------------------------------------------
# gemv and flat_gemm against the reference
# ----------------------------------------------------------------------------------------
# (M, N, K, bias, split_k): split_k None lets the launcher choose (no split on a CPU).
CASES = [
    (1, 96, 72, False, None),
    (2, 100, 200, True, 3),      # runs of 96, 96, 8 (CPU tiles of 32)
    (3, 100, 72, True, None),
    (5, 96, 200, False, 2),
    (16, 100, 72, True, 4),
    (17, 96, 200, True, None),
    (33, 100, 72, False, 2),
]


def _case_id(c):
    return f"M{c[0]}-N{c[1]}-K{c[2]}{'-bias' if c[3] else ''}-split{c[4] or 'auto'}"


@pytest.mark.parametrize("kind", list(KERNELS))
@pytest.mark.parametrize("M,N,K,with_bias,split_k", [pytest.param(*c, id=_case_id(c)) for c in CASES])
def test_kernel_matches_reference(kind, M, N, K, with_bias, split_k, dtype, device, gen, seed):
    x, w, b = operands(M, N, K, dtype, device, gen, with_bias)
    # The output is a strided window inside a larger NaN buffer: every element of the window
    # must be written (NaN fails), and nothing around it.
    buf = poisoned((M + 3, 2 * N + 5), dtype, device)
    out = buf[1:M + 1, 3:2 * N + 3:2]
    got = KERNELS[kind](x, w, b, out=out, split_k=split_k)
    assert got is out
    assert_close(out, expected(x, w, b), dtype, f"{kind} out", seed, atol=tol(dtype, K), rtol=tol(dtype, K))
    window = torch.zeros_like(buf, dtype=torch.bool)
    window[1:M + 1, 3:2 * N + 3:2] = True
    assert torch.isnan(buf[~window]).all(), f"{kind} wrote outside out (seed {seed})"


@pytest.mark.parametrize("kind", list(KERNELS))
def test_strided_and_transposed_x(kind, dtype, device, gen, seed):
    """x as a column-slice of a wider matrix (row stride > K), and as a transposed view
    (unit stride along M, not K); M = 20 takes two GEMV programs, the second ragged."""
    M, N, K = 20, 100, 72
    _, w, b = operands(M, N, K, dtype, device, gen)
    wide = random_tensor((M, 2 * K + 1), dtype, device, gen)
    tall = random_tensor((K, M), dtype, device, gen)
    for name, x in (("column slice", wide[:, 1:K + 1]), ("transposed", tall.t())):
        got = KERNELS[kind](x, w, b, split_k=2)
        assert_close(got, expected(x, w, b), dtype, f"{kind} ({name} x)", seed, atol=tol(dtype, K),
                     rtol=tol(dtype, K))


def test_forced_tiles(device, gen, seed):
    """GEMV programs of 3 rows (not a power of two: the accumulator has a padding column)
    over M = 10 (four programs, the last with one row); flat tiles of 32 rows and 16 columns
    of K, with more runs asked for than K has tiles (empty runs are not launched)."""
    dtype = torch.float16
    x, w, b = operands(10, 50, 40, dtype, device, gen)
    want = expected(x, w, b)
    got = gemv(x, w, b, config=TileConfig(block_m=3, block_n=16, block_k=16), split_k=2)
    assert_close(got, want, dtype, "gemv 3 rows per program", seed)
    got = flat_gemm(x, w, b, config=TileConfig(block_m=32, block_n=16, block_k=16), split_k=5)
    assert_close(got, want, dtype, "flat_gemm 32-row tiles, 5 runs over 3 K tiles", seed)


@pytest.mark.parametrize("kind", list(KERNELS))
def test_split_k_is_reproducible(kind, device, gen, seed):
    """The partials are added in a fixed order (no atomics): the same call gives the same
    bits twice, and the split result agrees with the unsplit one to fp32 rounding."""
    dtype = torch.float32
    x, w, b = operands(4, 64, 200, dtype, device, gen)
    first = KERNELS[kind](x, w, b, split_k=3)
    assert torch.equal(first, KERNELS[kind](x, w, b, split_k=3)), "split-K must be deterministic"
    assert_close(first, to_numpy(KERNELS[kind](x, w, b, split_k=1)), dtype, f"{kind} split vs unsplit", seed)


@pytest.mark.parametrize("kind", list(KERNELS))
def test_empty_sizes(kind, device, gen):
    x, w, b = operands(3, 8, 0, torch.float16, device, gen)
    assert torch.equal(KERNELS[kind](x, w, b), b.expand(3, 8)), "K = 0: the bias alone"
    assert not KERNELS[kind](x, w).any(), "K = 0 without bias: zeros"
    x, w, _ = operands(0, 8, 16, torch.float16, device, gen)
    assert KERNELS[kind](x, w).shape == (0, 8)


def test_split_k_rule():
    """`split_k_for`: enough programs for two per SM, within its limits (values checked by hand)."""
    tile = TileConfig(16, 64, 128)
    assert fg.split_k_for(1, 4096, 4096, tile, 2, 132) == 8      # 64 programs -> 512
    assert fg.split_k_for(16, 4096, 4096, tile, 2, 132) == 2     # 4 would make the partials 6 % of the weights
    assert fg.split_k_for(1, 12288, 4096, tile, 2, 132) == 2     # 192 programs -> 384
    assert fg.split_k_for(1, 32768, 4096, tile, 2, 132) == 1     # 512 programs: the GPU is full
    assert fg.split_k_for(1, 256, 688, tile, 2, 132) == 1        # 6 K tiles: too few to split
    assert fg.split_k_for(1, 64, 1 << 20, tile, 2, 132) == fg.MAX_SPLIT_K


def test_bad_inputs_are_refused(device, gen):
    x, w, b = operands(2, 8, 16, torch.float16, device, gen)
    with pytest.raises(ValueError):
        gemv(x, w[:, :8])                                      # K mismatch
    with pytest.raises(TypeError):
        flat_gemm(x, w.float())                                # dtype mismatch
    with pytest.raises(ValueError):
        gemv(x, w, b[:4])                                      # bias of the wrong size
    with pytest.raises(ValueError):
        flat_gemm(x, w, out=torch.empty(2, 9, dtype=x.dtype, device=device))
    with pytest.raises(ValueError):
        gemv(x, w, config=TileConfig(block_m=17, block_n=16, block_k=16))
    with pytest.raises(ValueError):
        flat_gemm(x, w, config=TileConfig(block_m=8, block_n=16, block_k=16))
    with pytest.raises(ValueError):
        flat_gemm(x, w, split_k=0)


# ----------------------------------------------------------------------------------------
# The dispatch
# ----------------------------------------------------------------------------------------
def test_choose_kernel_thresholds():
    table = DispatchTable({(4096, 4096): (8, 96), (512, 256): (0, 0)})
    assert [choose_kernel(m, 4096, 4096, table) for m in (1, 8, 9, 96, 97)] == \
        ["gemv", "gemv", "flat_gemm", "flat_gemm", "cublas"]
    assert choose_kernel(1, 512, 256, table) == "cublas", "M1 = M2 = 0: cuBLAS everywhere"
    m1, m2 = DEFAULT_THRESHOLDS
    assert [choose_kernel(m, 10, 10, None) for m in (m1, m1 + 1, m2, m2 + 1)] == \
        ["gemv", "flat_gemm", "flat_gemm", "cublas"]
    with pytest.raises(ValueError):
        choose_kernel(-1, 10, 10)


def test_dispatch_table_roundtrip_and_fallback(tmp_path):
    table = DispatchTable({(4096, 4096): (8, 96), (12288, 4096): (4, 128), (256, 256): (2, 16)},
                          default=(3, 30), info={"device": "NVIDIA Test GPU"})
    path = save_table(table, table_path("NVIDIA Test GPU", tmp_path))
    assert path == tmp_path / "nvidia-test-gpu.flat_gemm.json"
    data = json.loads(path.read_text())
    assert data["kind"] == "flat_gemm_dispatch" and "date" not in data, "no top-level date (see the docstring)"
    back = load_table(path)
    assert back == table
    # Exact shapes, then the nearest by N·K: [4096, 11008] is 2.7x of 4096² and 0.9x of 12288x4096.
    assert back.thresholds(4096, 4096) == (8, 96)
    assert back.thresholds(4096, 11008) == (4, 128)
    assert back.thresholds(11008, 4096) == (4, 128)
    assert back.thresholds(512, 256) == (2, 16)
    assert back.thresholds(1, 1) == (2, 16)
    assert back.thresholds(4096, 11008) == (4, 128), "a second lookup (remembered) gives the same"
    back.entries[(4096, 11264)] = (6, 64)  # a nearer shape added later: the lookup sees it
    assert back.thresholds(4096, 11008) == (6, 64)
    assert DispatchTable().thresholds(4096, 4096) == DEFAULT_THRESHOLDS
    assert DispatchTable.from_dict({**data, "shapes": []}).thresholds(5, 5) == (3, 30), "no shapes: the default"
    with pytest.raises(ValueError):
        DispatchTable.from_dict({**data, "kind": "something else"})
    with pytest.raises(ValueError):
        DispatchTable.from_dict({**data, "shapes": [{"n": 1, "k": 1, "m1": 8, "m2": 4}]})
    assert table_for_device("cpu") == DispatchTable() == DEFAULT_TABLE, "no table off the GPU"


def test_choose_kernel_honours_exceptions_of_its_shape_and_batch_only():
    table = DispatchTable({(4096, 4096): (1, 48)}, exceptions={(4096, 4096): {96: "flat_gemm", 2: "cublas"}})
    assert [choose_kernel(m, 4096, 4096, table) for m in (1, 2, 3, 48, 64, 95, 96, 97, 128)] == \
        ["gemv", "cublas", "flat_gemm", "flat_gemm", "cublas", "cublas", "flat_gemm", "cublas", "cublas"]
    # Another shape borrows the nearest shape's thresholds, not its exceptions.
    assert choose_kernel(96, 4096, 4608, table) == "cublas"


def test_dispatch_table_exceptions_roundtrip(tmp_path):
    table = DispatchTable({(4096, 4096): (1, 48), (256, 256): (4, 256)}, info={"device": "NVIDIA Test GPU"},
                          exceptions={(4096, 4096): {96: "flat_gemm"}})
    path = save_table(table, table_path("NVIDIA Test GPU", tmp_path))
    data = json.loads(path.read_text())
    by_shape = {(s["n"], s["k"]): s for s in data["shapes"]}
    assert by_shape[(4096, 4096)]["exceptions"] == {"96": "flat_gemm"}
    assert "exceptions" not in by_shape[(256, 256)], "a shape without exceptions keeps the old form"
    assert load_table(path) == table
    old_form = {**data, "shapes": [{k: v for k, v in s.items() if k != "exceptions"} for s in data["shapes"]]}
    assert DispatchTable.from_dict(old_form).exceptions == {}, "files written before exceptions still load"
    for bad in ({"96": "cudnn"}, {"0": "gemv"}):
        with pytest.raises(ValueError, match="exceptions"):
            DispatchTable.from_dict({**data, "shapes": [{"n": 1, "k": 1, "m1": 1, "m2": 4, "exceptions": bad}]})


def test_find_exceptions_catches_an_isolated_slow_point_only():
    """The sweep of Llama-2-7B's O projection on an H200 (graph µs, fp16, 2026-11-28), where
    cuBLAS ran M = 96 slower than both M = 64 and M = 128: the thresholds (the committed
    table's (1, 48)) give M = 96 to cuBLAS, 6 % slower than the flat GEMM there, and the
    exception hands it back. A 3 % gap is noise: no exception."""
    ms = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    gemv = [11.15, 12.53, 18.13, 30.81, 43.13, 54.09] + [None] * 8
    flat = [12.07, 11.7, 11.77, 12.29, 12.32, 12.61, 12.51, 12.91, 14.41, 14.56, 15.61, 15.93, 22.84, 23.12]
    cublas = [13.99, 14.04, 14.07, 14.17, 13.6, 13.81, 14.43, 14.3, 14.82, 12.97, 16.55, 14.23, 17.34, 17.41]
    thresholds = find_inflection_points(ms, gemv, flat, cublas)
    assert thresholds == (1, 48)
    assert find_exceptions(ms, gemv, flat, cublas, thresholds) == {96: "flat_gemm"}
    assert find_exceptions(ms, gemv, flat, cublas, thresholds, margin=0.10) == {}
    cublas[10] = flat[10] * 1.03
    assert find_exceptions(ms, gemv, flat, cublas, thresholds) == {}
    # Where the thresholds' kernel is the fastest everywhere, nothing.
    g, f, c = [8.0, 14.0, 14.0], [10.0, 10.0, 12.0], [12.0, 12.0, 10.0]
    assert find_exceptions([1, 2, 3], g, f, c, find_inflection_points([1, 2, 3], g, f, c)) == {}
    with pytest.raises(ValueError):
        find_exceptions([1, 2], g, f, c, (1, 2))


def _regret(ms, times, m1, m2, tolerance):
    best = [min(t[i] for t in times) for i in range(len(ms))]
    total = 0.0
    for i, m in enumerate(ms):
        t = times[0][i] if m <= m1 else times[1][i] if m <= m2 else times[2][i]
        total += max(0.0, t / best[i] - 1 - tolerance)
    return total


MS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_find_inflection_points_hand_made():
    base = [10.0] * len(MS)

    def sweep(gemv_best_to, flat_best_to):
        """GEMV 20 % faster than the others up to gemv_best_to, flat 20 % faster than
        cuBLAS up to flat_best_to, cuBLAS 20 % faster beyond."""
        g = [8.0 if m <= gemv_best_to else 14.0 for m in MS]
        f = [10.0 if m <= flat_best_to else 12.0 for m in MS]
        c = [12.0 if m <= flat_best_to else 10.0 for m in MS]
        return g, f, c

    assert find_inflection_points(MS, *sweep(4, 64)) == (4, 64)
    assert find_inflection_points(MS, *sweep(0, 0)) == (0, 0), "neither of ours ever wins: cuBLAS everywhere"
    assert find_inflection_points(MS, *sweep(256, 256)) == (256, 256), "GEMV wins everywhere"
    # Ties: all three equal everywhere -> the largest thresholds (GEMV all the way).
    assert find_inflection_points(MS, base, base, base) == (256, 256)
    # Within tolerance: the GEMV only 1 % slower than flat at M = 8 still gets it.
    g, f, c = sweep(4, 64)
    g[3] = f[3] * 1.01
    assert find_inflection_points(MS, g, f, c, tolerance=0.02) == (8, 64)
    assert find_inflection_points(MS, g, f, c, tolerance=0.0) == (4, 64)
    # A noisy point: flat "wins" by 0.5 % at 256 but cuBLAS wins clearly at 128: M2 stays 64.
    g, f, c = sweep(4, 64)
    f[-1] = c[-1] * 0.995
    assert find_inflection_points(MS, g, f, c, tolerance=0.0) == (4, 64)
    # The GEMV not measured past 16 (None / NaN): never chosen there, even if it would tie.
    g = [8.0, 8.0, 8.0, 8.0, 8.0, None, float("nan"), None, None]
    assert find_inflection_points(MS, g, base, base) == (16, 256)


def test_find_inflection_points_refuses_bad_sweeps():
    with pytest.raises(ValueError):
        find_inflection_points([1, 4, 2], [1] * 3, [1] * 3, [1] * 3)
    with pytest.raises(ValueError):
        find_inflection_points([1, 2], [1] * 2, [1] * 2, [1] * 3)
    with pytest.raises(ValueError):  # M = 1 needs cuBLAS, which then must serve M = 2 too
        find_inflection_points([1, 2], [None, 1], [None, 1], [1, None])


@pytest.mark.parametrize("trial", range(5))
def test_find_inflection_points_least_regret(trial, seed):
    """On random sweeps the answer has the least regret of all candidate pairs, and no pair
    with larger thresholds has as little."""
    rng = np.random.default_rng(seed + trial)
    times = [list(rng.uniform(1.0, 2.0, len(MS))) for _ in range(3)]
    tolerance = float(rng.choice([0.0, 0.02, 0.1]))
    m1, m2 = find_inflection_points(MS, *times, tolerance=tolerance)
    assert m1 in [0] + MS and m2 in [0] + MS and m1 <= m2
    got = _regret(MS, times, m1, m2, tolerance)
    for a in [0] + MS:
        for b in [a] + [m for m in MS if m > a]:
            r = _regret(MS, times, a, b, tolerance)
            assert got <= r + 1e-9, f"({a}, {b}) has regret {r} < {got} of ({m1}, {m2}), seed {seed + trial}"
            if (a, b) > (m1, m2):
                assert r > got + 1e-12, f"({a}, {b}) ties ({m1}, {m2}) with larger thresholds, seed {seed + trial}"


def test_linear_on_cpu_is_f_linear(gen):
    x = random_tensor((2, 3, 40), torch.float32, "cpu", gen)
    w, b = random_tensor((24, 40), torch.float32, "cpu", gen), random_tensor((24,), torch.float32, "cpu", gen)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x[0, 0], w), F.linear(x[0, 0], w))


# ----------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 11008), (1376, 256)])
@pytest.mark.parametrize("M", [1, 8, 16, 64])
def test_large_shapes(M, N, K, dtype, device, gen, seed):
    if dtype == torch.float32:
        pytest.skip("fp32 is checked at small shapes")
    x, w, b = operands(M, N, K, dtype, device, gen)
    want = expected(x, w, b)
    for kind, fn in KERNELS.items():
        if kind == "gemv" and M > 16:
            continue
        assert_close(fn(x, w, b, out=poisoned((M, N), dtype, device)), want, dtype, f"{kind} M={M}", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", fg.KERNELS)
def test_linear_every_branch_on_gpu(kind, dtype, device, gen, seed):
    """A table that sends every M to one kernel; [..., K] inputs; equal to F.linear up to
    rounding (the kernels sum in another order than cuBLAS)."""
    m1, m2 = {"gemv": (1000, 1000), "flat_gemm": (0, 1000), "cublas": (0, 0)}[kind]
    table = DispatchTable({(100, 72): (m1, m2)})
    x, w, b = operands(3 * 5, 100, 72, dtype, device, gen)
    x3 = x.view(3, 5, 72)
    assert choose_kernel(15, 100, 72, table) == kind
    got = linear(x3, w, b, table=table)
    assert got.shape == (3, 5, 100)
    assert_close(got, expected(x3, w, b), dtype, f"linear via {kind}", seed, atol=tol(dtype, 72), rtol=tol(dtype, 72))


@pytest.mark.gpu
def test_table_for_this_gpu(device, tmp_path):
    """`table_for_device` finds the file named after this GPU, or gives the default."""
    table = DispatchTable({(100, 72): (1, 2)})
    save_table(table, table_path(torch.cuda.get_device_name(device), tmp_path))
    assert table_for_device(device, tmp_path) == table
    assert table_for_device(device, tmp_path / "elsewhere") == DispatchTable()


@pytest.mark.gpu
def test_autotuning_picks_and_caches(monkeypatch, device, gen, seed):
    monkeypatch.setenv("MINILLM_FLAT_GEMM_AUTOTUNE", "1")
    x, w, _ = operands(8, 4096, 4096, torch.float16, device, gen, with_bias=False)
    for kind, fn in KERNELS.items():
        cfg = fg.pick_config(kind, x, w)
        key = (kind, torch.float16, fg.rows_bucket(kind, 8), 4096, 4096, x.device.index)
        times = fg.TUNING_TIMES[key]
        assert len(times) >= 2 and min(times, key=times.get) == cfg.describe(), "the fastest candidate is kept"
        assert fg.pick_config(kind, x, w) == cfg and fg.TUNING_TIMES[key] is times, "tuned once per key"
        assert_close(fn(x, w), expected(x, w, None), torch.float16, f"{kind} tuned", seed)


# ----------------------------------------------------------------------------------------
# The benchmark's bookkeeping
# ----------------------------------------------------------------------------------------
def test_benchmark_dry_run(device, tmp_path):
    """`bench.ch08_flat_gemm.sweep` end to end on one tiny shape with a stand-in timer that
    calls the function once: every point adds its rows, the outputs agree with fp32, the
    table is saved where the runtime looks for it, and the summary prints."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # `pytest` without `python -m` does not put the root on the path
        sys.path.insert(0, root)
    from bench import ch08_flat_gemm as bench
    from bench.common import Results

    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    ms = (1, 3, 17)
    table = bench.sweep(results, device, shapes=[("tiny.a", 48, 40)], ms=ms, bf16_ms=(),
                        timer=lambda fn: (fn(), 1.0)[1], table_dir=tmp_path)
    rows = results.rows

    def count(metric, **params):
        return sum(r["metric"] == metric and all(r["params"].get(a) == b for a, b in params.items()) for r in rows)

    n_gemv = sum(m <= bench.GEMV_MAX_M for m in ms)
    for kernel, n in (("cublas", 3), ("flat_gemm", 3), ("gemv", n_gemv)):
        for metric in ("time_ms", "bandwidth_TBps", "TFLOPs", "rel_err"):
            assert count(metric, kernel=kernel) == n, (metric, kernel)
    assert count("time_ms", kernel="dispatch") == 3 and count("bandwidth_TBps", kernel="dispatch") == 3
    assert all(r["ours"] < 2e-3 for r in rows if r["metric"] == "rel_err"), "fp16 outputs vs fp32"
    # Every time ties (the stand-in timer): the largest thresholds win, GEMV up to 3, flat beyond.
    assert table.entries == {(48, 40): (3, 17)}
    assert count("m1", shape="tiny.a") == 1 and next(r["ours"] for r in rows if r["metric"] == "m1") == 3
    assert load_table(table_path("dry run", tmp_path)) == table
    assert [r["params"]["chosen"] for r in rows if r["metric"] == "time_ms" and r["params"]["kernel"] == "dispatch"] \
        == ["gemv", "gemv", "flat_gemm"]
    bw = next(r for r in rows if r["metric"] == "bandwidth_TBps" and r["params"]["kernel"] == "flat_gemm")
    assert bw["fraction_of_ceiling"] == pytest.approx(bw["ours"])  # the stand-in ceiling is 1 TB/s
    assert results.status[bench.BENCHMARK] == "complete"
    assert len(bench.summary(results).splitlines()) == 2 + len(ms) + 2


# ----------------------------------------------------------------------------------------
# The flat GEMM with W as the A operand, the one-launch split-K, the launch plans
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("split_k", [1, 3])
def test_flat_gemm_with_w_as_a(split_k, device, gen, seed):
    """``w_as_a`` (``yᵀ = W xᵀ``): the same product, ragged M, N and K, bias, into a NaN-poisoned
    ``out``, with and without split-K (the last program of each tile adds the partials)."""
    dtype = torch.float16
    x, w, b = operands(5, 70, 200, dtype, device, gen)
    cfg = TileConfig(block_m=16, block_n=32, block_k=32, w_as_a=True)
    got = flat_gemm(x, w, b, out=poisoned((5, 70), dtype, device), config=cfg, split_k=split_k)
    assert_close(got, expected(x, w, b), dtype, f"flat_gemm w_as_a split {split_k}", seed)
    assert "wA" in cfg.describe()


@pytest.mark.parametrize("kind", list(KERNELS))
def test_split_k_tickets_are_reset(kind, device, gen, seed):
    """The split-K tickets are left at zero by every launch (the last program resets them), so
    the plan's workspace serves the next call: three calls in a row, same bits; then a call
    with other data through the same plan is right too. One plan per shape, made once."""
    dtype = torch.float32
    x, w, b = operands(4, 48, 200, dtype, device, gen)
    cfg = TileConfig(block_m=4 if kind == "gemv" else 16, block_n=16, block_k=32, split_k=4)
    first = KERNELS[kind](x, w, b, config=cfg)
    plans = len(fg.plan_cache())
    for _ in range(2):
        assert torch.equal(KERNELS[kind](x, w, b, config=cfg), first)
    assert len(fg.plan_cache()) == plans, "the second call reuses the plan"
    plan = next(p for key, p in fg.plan_cache().items() if key[0] == kind and key[1] == cfg and key[2:5] == (4, 48, 200))
    assert plan.grid[2] == 4 and plan.partials.shape == (4, 4, 48)
    assert not plan.counters.any(), "every ticket back at zero"
    x2 = random_tensor((4, 200), dtype, device, gen)
    assert_close(KERNELS[kind](x2, w, b, config=cfg), expected(x2, w, b), dtype, f"{kind} reused plan", seed)
