"""Chapter 8's NumPy references: the tile models of the GEMV and flat GEMM schedules
(`gemv_tiles`, `flat_gemm_tiles`, with ragged tiles and split-K, empty runs included) equal
``x @ w.T``; `split_k_ranges`, `padding_waste` and `arithmetic_intensity` on hand-checked
values. The kernels are tested against these in `test_ch08_flat_gemm_kernels.py`.
"""
import math

import numpy as np
import pytest

from minillm.reference import ch08_flat_gemm as ref


def test_split_k_ranges():
    # 72 in tiles of 16 is 5 tiles (the last ragged): runs of 2 tiles, the last one empty.
    assert ref.split_k_ranges(72, 16, 4) == [(0, 32), (32, 64), (64, 72), (72, 72)]
    assert ref.split_k_ranges(200, 32, 3) == [(0, 96), (96, 192), (192, 200)]
    assert ref.split_k_ranges(64, 16, 1) == [(0, 64)]
    assert ref.split_k_ranges(10, 16, 3) == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ValueError):
        ref.split_k_ranges(64, 16, 0)


@pytest.mark.parametrize("trial", range(6))
def test_tile_models_equal_matmul(trial, seed):
    rng = np.random.default_rng(seed + trial)
    M, N, K = (int(v) for v in rng.integers(1, 70, size=3))
    x, w = rng.standard_normal((M, K)), rng.standard_normal((N, K))
    want = x @ w.T
    bn, bk, split = int(rng.choice([1, 3, 8, 16])), int(rng.choice([1, 5, 16, 32])), int(rng.integers(1, 6))
    msg = f"M={M} N={N} K={K} block_n={bn} block_k={bk} split_k={split}, seed {seed + trial}"
    np.testing.assert_allclose(ref.gemv_tiles(x, w, bn, bk, split), want, rtol=1e-12, atol=1e-12, err_msg=msg)
    np.testing.assert_allclose(ref.flat_gemm_tiles(x, w, 16, bn, bk, split), want, rtol=1e-12, atol=1e-12,
                               err_msg=msg)
    got32 = ref.flat_gemm_tiles(x, w, 32, bn, bk, split, acc_dtype=np.float32)
    assert got32.dtype == np.float32 and got32.shape == (M, N)
    np.testing.assert_allclose(got32, want, rtol=1e-4, atol=1e-4 * math.sqrt(K), err_msg=msg)


def test_padding_waste_and_intensity():
    assert ref.padding_waste(1, 64) == pytest.approx(63 / 64)
    assert ref.padding_waste(1, 16) == pytest.approx(15 / 16)
    assert ref.padding_waste(16, 16) == 0.0
    assert ref.padding_waste(17, 16) == pytest.approx(15 / 32)
    # Weights dominate: 2M / elem_bytes FLOP/byte (1 per row of the batch in fp16).
    assert ref.arithmetic_intensity(1, 4096, 4096, 2) == pytest.approx(1.0, rel=1e-3)
    assert ref.arithmetic_intensity(8, 4096, 4096, 2) == pytest.approx(8.0, rel=1e-2)
    assert ref.arithmetic_intensity(4, 10, 20, 4) == pytest.approx(2 * 4 * 10 * 20 / (4 * (200 + 80 + 40)))
