"""Graded tests for Chapter 3 (the online softmax and tiling). Run: `make grade CH=3`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import math

import numpy as np
import pytest
import torch

from minillm import reference as ref
from minillm.reference.ch03_online_softmax import partial_attention, softmax_stats
from minillm.reference.ch03_online_softmax import tile_step as reference_tile_step
from minillm.testing import assert_close, random_tensor, to_numpy

update_ex = pytest.mark.exercise(id="3.1", title="The online softmax update", points=2)
merge_ex = pytest.mark.exercise(id="3.2", title="Merging partial attention outputs", points=3)
tile_ex = pytest.mark.exercise(id="3.3", title="One tile step of FlashAttention-1", points=3)
stream_kernel_ex = pytest.mark.exercise(id="3.4", title="The streamed softmax kernel in Triton", points=3, kind="triton")
fa1_kernel_ex = pytest.mark.exercise(id="3.5", title="FlashAttention-1's loops in Triton", points=4, kind="triton")


def random_scores(rng, shape, scale=5.0, masked=0.2):
    s = scale * rng.standard_normal(shape)
    return np.where(rng.random(shape) < masked, -np.inf, s)


# --- 3.1 -------------------------------------------------------------------------------------

@update_ex
def test_update_worked_example(impl):
    m, l = impl.online_softmax_update(np.array([-np.inf]), np.array([0.0]), np.array([[1.0, 2.0]]))
    assert m[0] == 2 and l[0] == pytest.approx(math.exp(-1) + 1, rel=1e-14), "block [1, 2] from the empty state"
    m, l = impl.online_softmax_update(m, l, np.array([[3.0, 4.0]]))
    assert m[0] == 4, "the running max after [3, 4]"
    assert l[0] == pytest.approx(sum(math.exp(-i) for i in range(4)), rel=1e-14), \
        "the sum of exp(x - 4) over [1, 2, 3, 4]: rescale the old sum by exp(2 - 4)"


@update_ex
@pytest.mark.parametrize("trial", range(6))
def test_update_streams_a_row(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    rows, n = int(rng.integers(1, 6)), int(rng.integers(1, 80))
    x = random_scores(rng, (rows, n), scale=float(rng.choice([1.0, 20.0, 1000.0])))
    x[0, : n // 2] = -np.inf                       # masked leading blocks
    m, l = np.full(rows, -np.inf), np.zeros(rows)
    start = 0
    while start < n:
        size = int(rng.integers(1, 17))
        m, l = impl.online_softmax_update(m, l, x[:, start:start + size])
        start += size
    want_m, want_l = softmax_stats(x)
    msg = f"rows={rows} n={n} seed={seed + trial}"
    assert np.all(np.isfinite(l)), "overflow or NaN: subtract the max before exp, and treat a -inf max as 0"
    np.testing.assert_array_equal(m, want_m, err_msg=msg)
    np.testing.assert_allclose(l, want_l, rtol=1e-12, err_msg=msg)


@update_ex
def test_update_with_fully_masked_blocks(impl, seed):
    rng = np.random.default_rng(seed)
    m0, l0 = np.array([-np.inf, 1.5]), np.array([0.0, 2.0])
    m, l = impl.online_softmax_update(m0, l0, np.full((2, 4), -np.inf))
    assert not np.isnan(l).any() and not np.isnan(m).any(), "a masked block must not produce NaN"
    np.testing.assert_array_equal(m, m0)
    np.testing.assert_array_equal(l, l0)
    block = rng.standard_normal((2, 3))
    m, l = impl.online_softmax_update(m, l, block)
    np.testing.assert_allclose(l[0], np.exp(block[0] - block[0].max()).sum(), rtol=1e-13)


# --- 3.2 -------------------------------------------------------------------------------------

def partials(rng, heads=2, q_len=9, kv_len=23, d=6, n_sets=3, causal=True, scale=1.0):
    """Random attention split over ``n_sets`` random sets of keys: the partials and the whole."""
    q, k, v = (rng.standard_normal((heads, n, d)) for n in (q_len, kv_len, kv_len))
    s = scale * np.einsum("hmd,hnd->hmn", q, k) / np.sqrt(d)
    s = np.where(ref.attention_mask(q_len, kv_len, causal=causal), s, -np.inf)
    owner = rng.integers(0, n_sets, size=kv_len)
    parts = [partial_attention(s[..., owner == i], v[:, owner == i]) for i in range(n_sets)]
    return parts, partial_attention(s, v)


@merge_ex
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_merge_equals_attention_over_all_keys(impl, scale, seed):
    rng = np.random.default_rng(seed)
    (a, b), (want_m, want_l, want_o) = partials(rng, q_len=12, kv_len=8, n_sets=2, scale=scale)
    m, l, o = impl.merge_partials(*a, *b)   # q_len > kv_len, causal: the first rows see no key
    msg = f"scale={scale} seed={seed}"
    assert not np.isnan(o).any(), "rows with no visible key must give zeros, not NaN"
    np.testing.assert_array_equal(m, want_m, err_msg=msg)
    np.testing.assert_allclose(l, want_l, rtol=1e-12, err_msg=msg)
    np.testing.assert_allclose(o, want_o, atol=1e-12, err_msg=msg)


@merge_ex
@pytest.mark.parametrize("trial", range(3))
def test_merge_is_associative_and_commutative(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    (a, b, c), (_, want_l, want_o) = partials(rng, kv_len=int(rng.integers(3, 40)), causal=bool(trial % 2))
    groupings = {"(a+b)+c": impl.merge_partials(*impl.merge_partials(*a, *b), *c),
                 "a+(b+c)": impl.merge_partials(*a, *impl.merge_partials(*b, *c)),
                 "c+(b+a)": impl.merge_partials(*c, *impl.merge_partials(*b, *a))}
    for name, (m, l, o) in groupings.items():
        np.testing.assert_allclose(l, want_l, rtol=1e-12, err_msg=f"{name}, seed {seed + trial}")
        np.testing.assert_allclose(o, want_o, atol=1e-12, err_msg=f"{name}, seed {seed + trial}")


@merge_ex
def test_merge_with_an_empty_partial(impl, seed):
    rng = np.random.default_rng(seed)
    (a,), _ = partials(rng, n_sets=1, causal=False)
    empty = (np.full_like(a[0], -np.inf), np.zeros_like(a[1]), np.zeros_like(a[2]))
    for m, l, o in (impl.merge_partials(*a, *empty), impl.merge_partials(*empty, *a)):
        np.testing.assert_array_equal(m, a[0])
        np.testing.assert_allclose(l, a[1], rtol=1e-15)
        np.testing.assert_allclose(o, a[2], atol=1e-15)
    m, l, o = impl.merge_partials(*empty, *empty)
    assert (m == -np.inf).all() and (l == 0).all() and (o == 0).all(), "nothing visible: (-inf, 0, zeros)"


# --- 3.3 -------------------------------------------------------------------------------------

@tile_ex
def test_tile_step_from_the_initial_state(impl, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((5, 8)), rng.standard_normal((7, 8)), rng.standard_normal((7, 8))
    o, l, m = impl.tile_step(q, k, v, np.zeros((5, 8)), np.zeros(5), np.full(5, -np.inf), 0.4)
    want, want_lse = ref.attention(q[None, None], k[None, None], v[None, None], scale=0.4)
    np.testing.assert_allclose(o, want[0, 0], atol=1e-13, err_msg=f"seed {seed}")
    np.testing.assert_allclose(m + np.log(l), want_lse[0, 0], rtol=1e-13, atol=1e-13, err_msg=f"seed {seed}")


@tile_ex
@pytest.mark.parametrize("trial", range(4))
def test_tile_step_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    br, bc, d = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.choice([4, 8, 16]))
    q, k, v = rng.standard_normal((br, d)), rng.standard_normal((bc, d)), rng.standard_normal((bc, d))
    m_i, l_i, o_i = partial_attention(random_scores(rng, (br, 5), scale=30.0), rng.standard_normal((5, d)))
    visible = rng.random((br, bc)) < 0.6 if trial else None
    scale = float(rng.uniform(0.1, 50.0))   # up to scores in the hundreds
    o, l, m = impl.tile_step(q, k, v, o_i, l_i, m_i, scale, visible)
    want_o, want_l, want_m = reference_tile_step(q, k, v, o_i, l_i, m_i, scale, visible)
    msg = f"Br={br} Bc={bc} scale={scale:.3g} seed={seed + trial}"
    # Not exact: `scale * q_i @ k_j.T` and `scale * (q_i @ k_j.T)` round differently (~1e-14);
    # a wrong max (old m ignored, masked scores counted, no scale) is off by far more.
    np.testing.assert_allclose(m, want_m, rtol=1e-12, atol=1e-11, err_msg="m: " + msg)   # -inf compares equal
    np.testing.assert_allclose(l, want_l, rtol=1e-12, err_msg=msg)
    np.testing.assert_allclose(o, want_o, atol=1e-12, err_msg=msg)


@tile_ex
@pytest.mark.parametrize("q_heads,kv_heads,q_len,kv_len,causal", [(2, 2, 13, 13, True), (4, 2, 7, 22, False),
                                                                  (3, 1, 10, 6, True)])
def test_fa1_loops_with_your_tile_step(impl, q_heads, kv_heads, q_len, kv_len, causal, seed):
    """FlashAttention-1's loops (K/V outer, Q inner) around your `tile_step` equal attention."""
    rng = np.random.default_rng(seed)
    d, br, bc = 8, 4, 5
    q = rng.standard_normal((q_heads, q_len, d))
    k, v = rng.standard_normal((2, kv_heads, kv_len, d))
    scale = 1 / math.sqrt(d)
    visible = ref.attention_mask(q_len, kv_len, causal=causal)
    o = np.zeros(q.shape)
    l, m = np.zeros(q.shape[:2]), np.full(q.shape[:2], -np.inf)
    for h in range(q_heads):
        kv_h = ref.kv_head_for(h, q_heads, kv_heads)
        for j in range(0, kv_len, bc):                   # outer: K/V blocks
            for i in range(0, q_len, br):                # inner: Q blocks
                rows, cols = slice(i, i + br), slice(j, j + bc)
                o[h, rows], l[h, rows], m[h, rows] = impl.tile_step(
                    q[h, rows], k[kv_h, cols], v[kv_h, cols], o[h, rows], l[h, rows], m[h, rows], scale,
                    visible[rows, cols])
    want, want_lse = ref.attention(q[None], k[None], v[None], causal=causal)
    np.testing.assert_allclose(o, want[0], atol=1e-12, err_msg=f"seed {seed}")
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(m + np.log(l), want_lse[0], rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")


# --- 3.4 -------------------------------------------------------------------------------------

@stream_kernel_ex
@pytest.mark.parametrize("rows,n_cols,block_n", [(1, 1, 16), (3, 16, 16), (5, 50, 16), (4, 129, 32)])
def test_streamed_softmax_kernel(impl, rows, n_cols, block_n, dtype, device, gen, seed):
    x = random_tensor((rows, n_cols), torch.float64, "cpu", gen, scale=5.0)
    x[torch.rand(x.shape, generator=gen) < 0.2] = float("-inf")
    x[0] = float("-inf")                          # every element masked: zeros and lse = -inf
    if rows > 1:
        x[1] = torch.linspace(-2000, 2000, n_cols, dtype=torch.float64)  # the max rises in every block
    if rows > 2:
        x[2, :min(n_cols, block_n + 3)] = float("-inf")  # the first block(s) see nothing
    if rows > 3:
        x[3] *= 200                               # scores in the thousands
    x = x.to(device=device, dtype=dtype)
    y, lse = impl.online_softmax(x, block_n=block_n)
    assert y.shape == x.shape and lse.shape == x.shape[:-1] and y.dtype == lse.dtype == torch.float32
    m, l = softmax_stats(to_numpy(x))
    with np.errstate(divide="ignore"):
        want_lse = m + np.log(l)
    msg = f"(n_cols {n_cols}, block_n {block_n})"
    assert_close(y, ref.softmax(to_numpy(x)), torch.float32, f"y {msg}", seed)
    assert_close(lse, want_lse, torch.float32, f"lse {msg}", seed)


# --- 3.5 -------------------------------------------------------------------------------------

@fa1_kernel_ex
@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal", [
    (1, 1, 1, 1, 1, 16, False),
    (1, 2, 2, 37, 37, 32, True),   # several blocks each way, ragged tails
    (2, 4, 2, 20, 45, 16, True),   # GQA; fewer queries than keys (bottom-right causal)
    (1, 2, 1, 40, 23, 16, True),   # more queries than keys: the first 17 rows see no key at all
    (1, 3, 3, 9, 50, 16, False),
])
def test_fa1_kernel(impl, batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, dtype, device, gen, seed):
    q = random_tensor((batch, q_heads, q_len, head_dim), dtype, device, gen)
    k = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen, scale=2.0)  # peaked softmax rows
    v = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    out, lse = impl.fa1_attention(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    want_out, want_lse = ref.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal)
    msg = f"(q_len {q_len}, kv_len {kv_len}, causal {causal}, heads {q_heads}/{kv_heads})"
    assert_close(out, want_out, dtype, f"out {msg}", seed)
    assert_close(lse, want_lse, dtype, f"lse {msg}", seed)
