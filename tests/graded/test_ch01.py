"""Graded tests for Chapter 1 (naive attention). Run: `make grade CH=1`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run.
"""
import numpy as np
import pytest
import torch

from minillm import reference as ref
from minillm.testing import assert_close, random_tensor, to_numpy

safe_softmax = pytest.mark.exercise(id="1.1", title="Safe softmax", points=2)
mask_ex = pytest.mark.exercise(id="1.2", title="Causal and sliding-window mask", points=2)
gqa_ex = pytest.mark.exercise(id="1.3", title="GQA head mapping", points=1)
scores_ex = pytest.mark.exercise(id="1.4", title="The scores kernel in Triton", points=3, kind="triton")
softmax_kernel_ex = pytest.mark.exercise(id="1.5", title="The row softmax kernel in Triton", points=3, kind="triton")


@safe_softmax
@pytest.mark.parametrize("shape,axis", [((7,), -1), ((3, 11), -1), ((4, 5, 6), 1), ((2, 3), 0)])
def test_softmax_matches_reference(impl, shape, axis, seed):
    x = np.random.default_rng(seed).standard_normal(shape) * 5
    np.testing.assert_allclose(impl.safe_softmax(x, axis=axis), ref.softmax(x, axis=axis), atol=1e-12,
                               err_msg=f"seed {seed}")


@safe_softmax
def test_softmax_does_not_overflow(impl):
    x = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0]])
    p = impl.safe_softmax(x)
    assert np.all(np.isfinite(p)), "exp(1000) overflows: subtract the row max first"
    np.testing.assert_allclose(p[0], [0.09003057, 0.24472847, 0.66524096], rtol=1e-6)
    np.testing.assert_allclose(p[1], p[0][::-1], rtol=1e-6)


@safe_softmax
def test_softmax_fully_masked_row_is_zero(impl):
    x = np.array([[0.0, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf]])
    p = impl.safe_softmax(x)
    assert not np.isnan(p).any(), "a fully masked row must give zeros, not NaN"
    np.testing.assert_allclose(p, [[1 / (1 + np.e), 0, np.e / (1 + np.e)], [0, 0, 0]], atol=1e-12)


@mask_ex
def test_mask_known_cases(impl):
    assert impl.attention_mask(3, 3, causal=True).astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert impl.attention_mask(1, 4, causal=True).all(), "decode: the newest query sees every cached key"
    assert impl.attention_mask(4, 4, causal=True, window=2).astype(int).tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert impl.attention_mask(2, 2).all(), "no mask at all: everything visible"


@mask_ex
@pytest.mark.parametrize("trial", range(4))
def test_mask_random_shapes(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    q_len = int(rng.integers(1, 40))
    kv_len = int(rng.integers(q_len, 60)) if trial % 2 else int(rng.integers(1, 60))
    causal = bool(trial < 2 or rng.integers(2))
    window = None if trial == 0 else int(rng.integers(1, 20))
    got = impl.attention_mask(q_len, kv_len, causal=causal, window=window)
    want = ref.attention_mask(q_len, kv_len, causal=causal, window=window)
    assert got.shape == want.shape and got.dtype == bool
    assert (got == want).all(), f"q_len={q_len} kv_len={kv_len} causal={causal} window={window}"


@gqa_ex
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 8), (8, 2), (32, 8), (12, 1), (6, 3)])
def test_kv_head_mapping(impl, q_heads, kv_heads):
    got = [impl.kv_head_for(h, q_heads, kv_heads) for h in range(q_heads)]
    assert got == [h // (q_heads // kv_heads) for h in range(q_heads)]
    # every KV head serves the same number of query heads
    assert np.bincount(got).tolist() == [q_heads // kv_heads] * kv_heads


@gqa_ex
def test_kv_head_mapping_rejects_bad_ratio(impl):
    with pytest.raises(ValueError):
        impl.kv_head_for(0, 6, 4)


@scores_ex
@pytest.mark.parametrize("batch,heads,q_len,kv_len,head_dim,causal", [
    (1, 1, 1, 1, 16, False),
    (2, 3, 37, 37, 32, True),
    (1, 2, 5, 70, 64, True),    # fewer queries than keys: bottom-right causal alignment
    (1, 2, 45, 33, 16, False),  # tails in both tile dims
])
def test_scores_kernel(impl, batch, heads, q_len, kv_len, head_dim, causal, device, gen, seed):
    dtype = torch.float32 if seed % 2 else torch.float16
    q = random_tensor((batch, heads, q_len, head_dim), dtype, device, gen)
    k = random_tensor((batch, heads, kv_len, head_dim), dtype, device, gen)
    s = impl.attention_scores(q, k, causal=causal)
    assert s.dtype == torch.float32 and s.device == q.device
    assert_close(s, ref.attention_scores(to_numpy(q), to_numpy(k), causal), dtype, "S", seed)
    s2 = impl.attention_scores(q, k, causal=causal, scale=0.5)
    assert_close(s2, ref.attention_scores(to_numpy(q), to_numpy(k), causal, scale=0.5), dtype, "S(scale=0.5)", seed)


@softmax_kernel_ex
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (6, 100), (2, 257)])
def test_softmax_kernel(impl, shape, dtype, device, gen, seed):  # dtype: every kernel dtype (conftest)
    s = random_tensor(shape, torch.float64, "cpu", gen, scale=5.0)
    rows = s.reshape(-1, shape[-1])
    rows[torch.rand(rows.shape, generator=gen) < 0.3] = float("-inf")  # masked keys, tail lanes included
    rows[0, :] = float("-inf")  # a fully masked row (decode before any key is visible)
    if rows.shape[0] > 1:
        rows[1] *= 300  # scores in the thousands: exp overflows unless the max is subtracted
    s = s.to(device=device, dtype=dtype)
    p = impl.row_softmax(s)
    assert p.shape == s.shape and p.dtype == torch.float32 and p.device == s.device
    # The kernel computes in fp32 from the (already rounded) input: fp32 tolerances for every dtype.
    assert_close(p, ref.softmax(to_numpy(s)), torch.float32, "P", seed)
