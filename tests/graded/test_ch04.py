"""Graded tests for Chapter 4 (FlashAttention-2). Run: `make grade CH=4`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import math

import numpy as np
import pytest
import torch

from minillm import reference as ref
from minillm.reference import ch04_flash_attention as fa2
from minillm.testing import assert_close, poisoned, random_tensor, to_numpy

tile_ex = pytest.mark.exercise(id="4.1", title="FA2 tile step with an unscaled output", points=3)
classify_ex = pytest.mark.exercise(id="4.2", title="Causal block skipping", points=2)
backward_ex = pytest.mark.exercise(id="4.3", title="One tile pair of the backward", points=3)
delta_ex = pytest.mark.exercise(id="4.4", title="The backward's preprocess D", points=1)
fa2_kernel_ex = pytest.mark.exercise(id="4.5", title="The FlashAttention-2 forward kernel in Triton", points=4, kind="triton")
delta_kernel_ex = pytest.mark.exercise(id="4.6", title="The preprocess kernel D in Triton", points=1, kind="triton")
tma_kernel_ex = pytest.mark.exercise(id="4.7", title="The key loop through tensor descriptors, one matmul ahead",
                                     points=2, kind="triton")
persistent_ex = pytest.mark.exercise(id="4.8", title="Persistent programs walking a balanced causal schedule",
                                     points=3, kind="triton")
relabel_ex = pytest.mark.exercise(id="4.9", title="Relabel, don't shuffle: the key order that keeps an 8-bit P in "
                                  "registers", points=2)
exp2_ex = pytest.mark.exercise(id="4.10", title="2^x on the FMA units: an exponential without the exponential unit",
                               points=2, kind="triton")
row_sums_ex = pytest.mark.exercise(id="4.11", title="The row sums as a matmul: l = P·1 on the tensor cores' path",
                                   points=2, kind="triton")


def empty_state(rows, d):
    """``(acc, l, m)`` of rows that have seen nothing."""
    return np.zeros((rows, d)), np.zeros(rows), np.full(rows, -np.inf)


def state_from_scores(s, v):
    """The ``(acc, l, m)`` a Q block would hold after seeing keys with scores ``s: [r, n]``
    (``-inf`` = masked) and values ``v: [n, d]``."""
    m = np.max(s, axis=-1)
    m_sub = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m_sub[:, None])
    return p @ v, p.sum(axis=-1), m


# --- 4.1 -------------------------------------------------------------------------------------

@tile_ex
def test_one_block_is_attention_over_it(impl, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((5, 8)), rng.standard_normal((7, 8)), rng.standard_normal((7, 8))
    acc, l, m = impl.fa2_tile_step(q, k, v, *empty_state(5, 8), 0.4)
    s = 0.4 * (q @ k.T)
    # Not exact: `scale * q @ k.T` and `scale * (q @ k.T)` round differently (~1e-15 absolute).
    np.testing.assert_allclose(m, s.max(-1), rtol=1e-12, atol=1e-12,
                               err_msg=f"m: the row max of the scaled scores (seed {seed})")
    np.testing.assert_allclose(acc, np.exp(s - m[:, None]) @ v, atol=1e-13,
                               err_msg=f"acc must stay unscaled: Σ exp(s - m)·v, not divided by l (seed {seed})")
    o, lse = impl.fa2_finalize(acc, l, m)
    want, want_lse = ref.attention(q[None, None], k[None, None], v[None, None], scale=0.4)
    np.testing.assert_allclose(o, want[0, 0], atol=1e-13, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, want_lse[0, 0], rtol=1e-13, atol=1e-13, err_msg=f"seed {seed}")


@tile_ex
@pytest.mark.parametrize("trial", range(4))
def test_tile_step_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    r, c, d = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.choice([4, 8, 16]))
    q, k, v = rng.standard_normal((r, d)), rng.standard_normal((c, d)), rng.standard_normal((c, d))
    seen = 30 * rng.standard_normal((r, 5))
    seen[0] = -np.inf                                    # row 0 has seen nothing yet
    acc, l, m = state_from_scores(seen, rng.standard_normal((5, d)))
    visible = rng.random((r, c)) < 0.6 if trial else None
    scale = float(rng.uniform(0.1, 50.0))   # scores up to the hundreds
    got = impl.fa2_tile_step(q, k, v, acc, l, m, scale, visible)
    want = fa2.fa2_tile_step(q, k, v, acc, l, m, scale, visible)
    msg = f"r={r} c={c} scale={scale:.3g} seed={seed + trial}"
    assert not any(np.isnan(x).any() for x in got), "NaN: a row whose max is still -inf must subtract 0"
    # m within rounding (-inf compares equal): the order of `scale * q @ k.T` is free.
    np.testing.assert_allclose(got[2], want[2], rtol=1e-12, atol=1e-11, err_msg="m: " + msg)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12, err_msg="l: " + msg)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12 * np.abs(want[0]).max(), err_msg="acc: " + msg)


@tile_ex
def test_masked_blocks_and_empty_rows(impl, seed):
    """A fully masked block leaves the state as it was; a row that never sees a key ends
    with output 0 and lse -inf."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((4, 6)), rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    state = impl.fa2_tile_step(q, k, v, *empty_state(4, 6), 1.0, np.zeros((4, 3), dtype=bool))
    assert not any(np.isnan(x).any() for x in state), "a masked block must not produce NaN"
    assert (state[2] == -np.inf).all() and (state[1] == 0).all() and (state[0] == 0).all()
    visible = np.ones((4, 3), dtype=bool)
    visible[1] = False                                   # row 1 never sees a key
    state = impl.fa2_tile_step(q, k, v, *state, 1.0, visible)
    again = impl.fa2_tile_step(q, k, v, *state, 1.0, np.zeros((4, 3), dtype=bool))
    for x, y in zip(again, state):
        np.testing.assert_allclose(x, y, rtol=1e-15, err_msg="a fully masked block must change nothing")
    o, lse = impl.fa2_finalize(*again)
    assert lse[1] == -np.inf and (o[1] == 0).all(), "a row that saw no key: o = 0, lse = -inf"
    assert np.isfinite(lse[[0, 2, 3]]).all() and not np.isnan(o).any()


@tile_ex
@pytest.mark.parametrize("q_heads,kv_heads,q_len,kv_len,causal,window",
                         [(2, 2, 13, 13, True, None), (4, 2, 7, 22, False, None), (3, 1, 10, 6, True, None),
                          (2, 1, 9, 19, True, 5)])
def test_fa2_loops_with_your_tile_step(impl, q_heads, kv_heads, q_len, kv_len, causal, window, seed):
    """FlashAttention-2's loops (one program per Q block, K/V blocks inner) around your
    `fa2_tile_step` and `fa2_finalize` equal attention, scores in the tens included."""
    rng = np.random.default_rng(seed)
    d, bm, bn = 8, 4, 5
    q = 4 * rng.standard_normal((q_heads, q_len, d))
    k, v = rng.standard_normal((2, kv_heads, kv_len, d))
    scale = 1 / math.sqrt(d)
    visible = ref.attention_mask(q_len, kv_len, causal=causal, window=window)
    o, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for h in range(q_heads):
        kv_h = ref.kv_head_for(h, q_heads, kv_heads)
        for i in range(0, q_len, bm):                    # one program per Q block
            rows = slice(i, min(i + bm, q_len))
            state = empty_state(rows.stop - rows.start, d)
            for j in range(0, kv_len, bn):               # K/V blocks stream past it
                cols = slice(j, j + bn)
                state = impl.fa2_tile_step(q[h, rows], k[kv_h, cols], v[kv_h, cols], *state, scale,
                                           visible[rows, cols])
            o[h, rows], lse[h, rows] = impl.fa2_finalize(*state)
    want, want_lse = ref.attention(q[None], k[None], v[None], causal=causal, window=window)
    np.testing.assert_allclose(o, want[0], atol=1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")   # -inf rows compare equal


# --- 4.2 -------------------------------------------------------------------------------------

def brute_force_classes(q_len, kv_len, block_m, block_n):
    visible = ref.attention_mask(q_len, kv_len, causal=True)
    rows, cols = fa2.block_slices(q_len, block_m), fa2.block_slices(kv_len, block_n)
    return np.array([[fa2.SKIP if not visible[r, c].any() else fa2.FULL if visible[r, c].all() else fa2.MASKED
                      for c in cols] for r in rows]).reshape(len(rows), len(cols))


@classify_ex
def test_square_causal_picture(impl):
    got = np.asarray(impl.classify_causal_blocks(8, 8, 4, 4))
    np.testing.assert_array_equal(got, [[impl.MASKED, impl.SKIP], [impl.FULL, impl.MASKED]],
                                  err_msg="8 x 8 causal, 4 x 4 blocks: masked on the diagonal, full below, "
                                          "skipped above")
    assert (impl.SKIP, impl.MASKED, impl.FULL) == (0, 1, 2), "keep the codes SKIP, MASKED, FULL = 0, 1, 2"


@classify_ex
@pytest.mark.parametrize("trial", range(40))
def test_classes_match_the_mask(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    q_len, kv_len = int(rng.integers(1, 50)), int(rng.integers(1, 50))
    if trial % 4 == 0:
        kv_len = q_len                                       # prefill
    block_m, block_n = int(rng.integers(1, 17)), int(rng.integers(1, 17))
    got = np.asarray(impl.classify_causal_blocks(q_len, kv_len, block_m, block_n))
    want = brute_force_classes(q_len, kv_len, block_m, block_n)
    msg = f"q_len={q_len} kv_len={kv_len} block_m={block_m} block_n={block_n} (0 skip, 1 masked, 2 full)"
    np.testing.assert_array_equal(got, want, err_msg=f"{msg}, seed {seed + trial}")


@classify_ex
def test_skipping_with_your_classes_gives_attention(impl, seed):
    """Skip the SKIP blocks, mask only the MASKED ones: still exact attention (more queries
    than keys, so the first Q blocks skip everything)."""
    rng = np.random.default_rng(seed)
    q_len, kv_len, d, bm, bn = 23, 17, 8, 4, 6
    q = rng.standard_normal((1, 1, q_len, d))
    k, v = rng.standard_normal((2, 1, 1, kv_len, d))
    classes = np.asarray(impl.classify_causal_blocks(q_len, kv_len, bm, bn))
    visible = ref.attention_mask(q_len, kv_len, causal=True)
    o, lse = np.zeros(q.shape[2:]), np.zeros(q_len)
    for i, rows in enumerate(fa2.block_slices(q_len, bm)):
        state = empty_state(rows.stop - rows.start, d)
        for j, cols in enumerate(fa2.block_slices(kv_len, bn)):
            if classes[i, j] == fa2.SKIP:
                continue
            mask = visible[rows, cols] if classes[i, j] == fa2.MASKED else None
            state = fa2.fa2_tile_step(q[0, 0, rows], k[0, 0, cols], v[0, 0, cols], *state, 1 / math.sqrt(d), mask)
        o[rows], lse[rows] = fa2.fa2_finalize(*state)
    want, want_lse = ref.attention(q, k, v, causal=True)
    np.testing.assert_allclose(o, want[0, 0], atol=1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, want_lse[0, 0], rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")


# --- 4.3 -------------------------------------------------------------------------------------

def forward_and_delta(rng, q_len, kv_len, d, causal, scale=None, window=None, score_scale=1.0):
    """One head: q, k, v, dO, the forward's lse, and D."""
    q = score_scale * rng.standard_normal((1, 1, q_len, d))
    k, v = rng.standard_normal((2, 1, 1, kv_len, d))
    o, lse = ref.attention(q, k, v, causal=causal, scale=scale, window=window)
    do = rng.standard_normal(o.shape)
    return q[0, 0], k[0, 0], v[0, 0], do[0, 0], o[0, 0], lse[0, 0], fa2.backward_delta(o, do)[0, 0]


@backward_ex
@pytest.mark.parametrize("trial", range(4))
def test_backward_tile_matches_the_reference(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    q_len, kv_len, d = int(rng.integers(2, 12)), int(rng.integers(2, 12)), int(rng.choice([4, 8]))
    q, k, v, do, _, lse, delta = forward_and_delta(rng, q_len, kv_len, d, causal=bool(trial % 2),
                                                   score_scale=float(rng.choice([1.0, 8.0])))
    scale = 1 / math.sqrt(d)
    visible = ref.attention_mask(q_len, kv_len, causal=True) if trial % 2 else None
    got = impl.fa2_backward_tile(q, k, v, do, lse, delta, scale, visible)
    want = fa2.fa2_backward_tile(q, k, v, do, lse, delta, scale, visible)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11, err_msg=f"{name}, seed {seed + trial}")


@backward_ex
def test_rows_that_saw_nothing_contribute_nothing(impl, seed):
    """More queries than keys, causal: the first rows see no key, their lse is -inf. They
    must add zeros (not NaN) to every gradient."""
    rng = np.random.default_rng(seed)
    q, k, v, do, _, lse, delta = forward_and_delta(rng, 9, 4, 6, causal=True)
    assert np.isneginf(lse[:5]).all()
    visible = ref.attention_mask(9, 4, causal=True)
    dq, dk, dv = impl.fa2_backward_tile(q, k, v, do, lse, delta, 0.5, visible)
    assert not any(np.isnan(g).any() for g in (dq, dk, dv)), "NaN: exp(-inf - (-inf)) in a row with lse = -inf"
    np.testing.assert_array_equal(dq[:5], 0.0)
    _, dk_seen, dv_seen = impl.fa2_backward_tile(q[5:], k, v, do[5:], lse[5:], delta[5:], 0.5, visible[5:])
    np.testing.assert_allclose(dk, dk_seen, rtol=1e-12, atol=1e-13, err_msg="the empty rows changed dK")
    np.testing.assert_allclose(dv, dv_seen, rtol=1e-12, atol=1e-13, err_msg="the empty rows changed dV")


@backward_ex
@pytest.mark.parametrize("q_heads,kv_heads,q_len,kv_len,causal", [(2, 2, 11, 11, True), (4, 2, 6, 13, False),
                                                                  (2, 1, 10, 7, True)])
def test_gradients_from_your_tiles(impl, q_heads, kv_heads, q_len, kv_len, causal, seed):
    """Sum your tile contributions over every (Q block, K/V block) pair and, for dK and dV,
    over the query heads that share a KV head: the full gradients."""
    rng = np.random.default_rng(seed)
    d, bm, bn = 8, 4, 3
    q = rng.standard_normal((1, q_heads, q_len, d))
    k, v = rng.standard_normal((2, 1, kv_heads, kv_len, d))
    o, lse = ref.attention(q, k, v, causal=causal)
    do = rng.standard_normal(o.shape)
    delta = fa2.backward_delta(o, do)
    visible = ref.attention_mask(q_len, kv_len, causal=causal)
    scale = 1 / math.sqrt(d)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for h in range(q_heads):
        g = ref.kv_head_for(h, q_heads, kv_heads)
        for rows in fa2.block_slices(q_len, bm):
            for cols in fa2.block_slices(kv_len, bn):
                dq_ij, dk_ij, dv_ij = impl.fa2_backward_tile(q[0, h, rows], k[0, g, cols], v[0, g, cols],
                                                             do[0, h, rows], lse[0, h, rows], delta[0, h, rows],
                                                             scale, visible[rows, cols])
                dq[0, h, rows] += dq_ij
                dk[0, g, cols] += dk_ij
                dv[0, g, cols] += dv_ij
    want = fa2.fa2_backward(q, k, v, o, lse, do, causal=causal)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        np.testing.assert_allclose(got, w, atol=1e-11, err_msg=f"{name}, seed {seed}")


# --- 4.4 -------------------------------------------------------------------------------------

@delta_ex
def test_delta_is_the_rowsum_of_p_times_dp(impl, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, 2, 3, 7, 5))
    o, _ = ref.attention(q, k, v, causal=True)
    do = rng.standard_normal(o.shape)
    p = ref.softmax(ref.attention_scores(q, k, causal=True))       # [2, 3, 7, 7]
    dp = do @ np.swapaxes(v, -1, -2)
    got = np.asarray(impl.backward_delta(o, do))
    assert got.shape == o.shape[:-1], f"D has one number per row: shape {o.shape[:-1]}, got {got.shape}"
    np.testing.assert_allclose(got, np.sum(p * dp, axis=-1), rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")


# --- 4.5 -------------------------------------------------------------------------------------

@fa2_kernel_ex
@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal", [
    (1, 1, 1, 1, 1, 16, False),
    (1, 2, 2, 70, 70, 32, True),   # three Q blocks, the diagonal crosses key blocks; ragged tails
    (2, 4, 2, 20, 53, 16, True),   # GQA; fewer queries than keys (bottom-right causal)
    (1, 3, 1, 45, 21, 16, True),   # MQA; more queries than keys: the first 24 rows see no key
    (1, 2, 2, 33, 40, 16, False),
])
def test_fa2_forward_kernel(impl, batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, dtype, device, gen,
                            seed):
    q = random_tensor((batch, q_heads, q_len, head_dim), dtype, device, gen)
    k = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen, scale=2.0)  # peaked softmax rows
    v = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    scale = None if seed % 2 else 0.4
    out, lse = impl.fa2_forward(q, k, v, causal=causal, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    want_out, want_lse = ref.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, scale=scale)
    msg = f"(q_len {q_len}, kv_len {kv_len}, causal {causal}, heads {q_heads}/{kv_heads}, scale {scale})"
    assert_close(out, want_out, dtype, f"out {msg}", seed)
    assert_close(lse, want_lse, dtype, f"lse {msg}", seed)


# --- 4.6 -------------------------------------------------------------------------------------

@delta_kernel_ex
@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 3, 37, 40), (1, 2, 16, 64)])
def test_delta_kernel(impl, shape, dtype, device, gen, seed):
    o = random_tensor(shape, dtype, device, gen)
    do = random_tensor(shape, dtype, device, gen)
    delta = impl.backward_delta_triton(o, do)
    assert delta.shape == shape[:-1] and delta.dtype == torch.float32
    # Products of two rounded inputs are exact in fp32, and the sum is accumulated in fp32.
    assert_close(delta, ref.backward_delta(to_numpy(o), to_numpy(do)), torch.float32, f"D {shape}", seed)


# --- 4.7 -------------------------------------------------------------------------------------

@tma_kernel_ex
@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim", [
    (1, 1, 1, 1, 1, 16),       # one key: the first block is also the last
    (1, 2, 2, 70, 70, 32),     # ragged ends of both Q and K/V (zeros from the descriptor)
    (2, 4, 2, 20, 53, 16),     # GQA, fewer queries than keys
    (1, 3, 1, 45, 16, 16),     # MQA, exactly one key block
    (1, 2, 2, 33, 40, 16),
])
def test_tma_forward_kernel(impl, batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen, seed):
    q = random_tensor((batch, q_heads, q_len, head_dim), dtype, device, gen)
    k = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen, scale=2.0)  # peaked softmax rows
    v = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    scale = None if seed % 2 else 0.4
    out = impl.tma_forward(q, k, v, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    want, _ = ref.attention(to_numpy(q), to_numpy(k), to_numpy(v), scale=scale)
    assert_close(out, want, dtype, f"out (q_len {q_len}, kv_len {kv_len}, heads {q_heads}/{kv_heads}, scale {scale})",
                 seed)


# --- 4.8 -------------------------------------------------------------------------------------

def key_blocks(q_len, kv_len, block_m, block_n, causal):
    """The work of each query block: how many key blocks its loop visits (Exercise 4.2)."""
    classes = brute_force_classes(q_len, kv_len, block_m, block_n) if causal else \
        np.full((-(-q_len // block_m), -(-kv_len // block_n)), fa2.FULL)
    return (classes != fa2.SKIP).sum(axis=1)


def program_work(order, work, num_programs):
    """The work of each program when ``num_programs`` walk ``order`` round robin."""
    loads = np.zeros(num_programs, dtype=np.int64)
    np.add.at(loads, np.arange(len(order)) % num_programs, work[np.asarray(order)])
    return loads


def check_schedule(order, kb, batch_heads, num_programs, msg):
    """Every tile once, and the busiest program within one longest tile of the average."""
    n_tiles = len(kb) * batch_heads
    order = np.asarray(order)
    assert order.shape == (n_tiles,), f"{msg}: the order has shape {order.shape}, expected ({n_tiles},): one entry per tile"
    assert np.issubdtype(order.dtype, np.integer), f"{msg}: tile ids are integers, got dtype {order.dtype}"
    assert ((order >= 0) & (order < n_tiles)).all(), \
        f"{msg}: tile ids run from 0 to {n_tiles - 1}, got {order.min()} … {order.max()}"
    counts = np.bincount(order, minlength=n_tiles)
    bad = np.flatnonzero(counts != 1)
    assert not bad.size, (
        f"{msg}: every tile must appear exactly once, but tile {bad[0]} (query block {bad[0] % len(kb)} of head "
        f"{bad[0] // len(kb)}) appears {counts[bad[0]]} times ({bad.size} tiles wrong)")
    work = np.tile(np.asarray(kb, dtype=np.int64), batch_heads)
    loads = program_work(order, work, num_programs)
    total, longest = int(work.sum()), int(work.max())
    # busiest <= total / P + longest, in integers
    assert loads.max() * num_programs <= total + longest * num_programs, (
        f"{msg}: program {loads.argmax()} does {loads.max()} key blocks of work, but the average is "
        f"{total / num_programs:.2f} and one longest tile {longest}: at most {total / num_programs + longest:.2f} "
        f"allowed. Work per program: {loads.tolist()[:16]}{' …' if num_programs > 16 else ''}")
    return loads


@persistent_ex
@pytest.mark.parametrize("trial", range(12))
def test_tile_order_covers_and_balances(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    q_len = int(rng.integers(1, 300))
    kv_len = q_len if trial % 3 else int(rng.integers(1, 300))
    block_m, block_n = int(rng.choice([16, 32, 64])), int(rng.choice([16, 32, 64]))
    causal = trial % 4 != 3
    kb = key_blocks(q_len, kv_len, block_m, block_n, causal)
    batch_heads = int(rng.integers(1, 9))
    n_tiles = len(kb) * batch_heads
    num_programs = [1, n_tiles + int(rng.integers(1, 5)), int(rng.integers(2, max(3, n_tiles)))][trial % 3]
    order = impl.causal_tile_order(kb, batch_heads, num_programs)
    check_schedule(order, kb, batch_heads, num_programs,
                   f"key_blocks={kb.tolist()}, batch_heads={batch_heads}, num_programs={num_programs} (seed {seed + trial})")


@persistent_ex
@pytest.mark.parametrize("n,batch_heads,num_programs", [
    (8, 4, 4),      # N = 256 in blocks of 32: 1 … 8 key blocks per query block
    (16, 8, 12),
    (10, 6, 5),
    (32, 16, 132),  # N = 4096 in blocks of 128, 16 heads, one program per SM of an H100
])
def test_tile_order_beats_the_round_robins(impl, n, batch_heads, num_programs):
    """Square causal attention, where query block i sees i + 1 key blocks. Walked in row-major
    order, or longest first within each head (the chapter's kernel), the programs' work is
    unbalanced: the busiest does more than the average plus one longest tile."""
    kb = np.arange(1, n + 1)
    order = impl.causal_tile_order(kb, batch_heads, num_programs)
    work = np.tile(kb, batch_heads)
    row_major = np.arange(n * batch_heads)
    per_head_longest_first = np.array([bh * n + i for bh in range(batch_heads) for i in reversed(range(n))])
    bound = work.sum() / num_programs + n
    for name, naive in (("row-major", row_major), ("longest first within each head", per_head_longest_first)):
        assert program_work(naive, work, num_programs).max() > bound, f"the {name} order is balanced here"
    loads = check_schedule(order, kb, batch_heads, num_programs,
                           f"square causal, {n} query blocks, {batch_heads} heads, {num_programs} programs")
    assert loads.max() < program_work(row_major, work, num_programs).max()


def tile_name(t, n_m_blocks, q_heads):
    bh, i = divmod(int(t), n_m_blocks)
    return f"query block {i} of sequence {bh // q_heads}, head {bh % q_heads} (tile {t})"


def check_persistent_run(out, lse, owner, q, k, v, causal, scale, order, num_programs, dtype, seed, msg):
    """Compare with the reference, naming the tiles that were never computed or computed
    by the wrong program."""
    batch, q_heads, q_len, _ = q.shape
    n_m_blocks = -(-q_len // 32)                       # the launcher's BLOCK_M
    want_out, want_lse = ref.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, scale=scale)
    got = to_numpy(out).reshape(batch * q_heads, q_len, -1)
    unwritten = [bh * n_m_blocks + i for bh in range(batch * q_heads) for i in range(n_m_blocks)
                 if np.isnan(got[bh, i * 32:(i + 1) * 32]).any()]
    assert not unwritten, (
        f"{msg}: the rows of {tile_name(unwritten[0], n_m_blocks, q_heads)} were never written ({len(unwritten)} of "
        f"{len(order)} tiles): does every program walk all of its tiles, pid, pid + num_programs, … up to "
        f"n_tiles? (seed {seed})")
    assert_close(out, want_out, dtype, f"out {msg}", seed)
    assert_close(lse, want_lse, dtype, f"lse {msg}", seed)
    owner = owner.cpu().numpy()
    expected = np.empty(len(order), dtype=np.int64)
    expected[np.asarray(order)] = np.arange(len(order)) % num_programs
    assert (owner >= 0).all(), (
        f"{msg}: Owner of {tile_name(np.flatnonzero(owner < 0)[0], n_m_blocks, q_heads)} is {owner.min()}: store "
        f"the program's id in Owner[tile] for every tile it computes")
    wrong = np.flatnonzero(owner != expected)
    assert not wrong.size, (
        f"{msg}: {tile_name(wrong[0], n_m_blocks, q_heads)} was computed by program {owner[wrong[0]]}, but the "
        f"schedule gives it to program {expected[wrong[0]]} (program p takes TileOrder[p], "
        f"TileOrder[p + num_programs], …): does the kernel read its tiles from TileOrder? (seed {seed})")


@persistent_ex
@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,num_programs", [
    (1, 1, 1, 1, 1, 16, False, 1),
    (1, 2, 2, 70, 70, 32, True, 1),    # one program walks all six tiles; ragged tails
    (2, 4, 2, 20, 53, 16, True, 3),    # GQA, fewer queries than keys (bottom-right causal)
    (1, 3, 1, 45, 21, 16, True, 5),    # MQA, more queries than keys: the first 24 rows see no key
    (1, 2, 2, 33, 40, 16, False, 40),  # more programs than tiles: most have nothing to do
    (2, 2, 1, 50, 37, 16, False, 3),
])
def test_persistent_forward_kernel(impl, batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, num_programs,
                                   dtype, device, gen, seed):
    q = random_tensor((batch, q_heads, q_len, head_dim), dtype, device, gen)
    k = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen, scale=2.0)  # peaked softmax rows
    v = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    scale = None if seed % 2 else 0.4
    n_tiles = batch * q_heads * -(-q_len // 32)
    order = np.random.default_rng(seed).permutation(n_tiles)   # any schedule must give the same output
    out, lse, owner = impl.persistent_forward(q, k, v, causal=causal, scale=scale, num_programs=num_programs,
                                              tile_order=order, out=poisoned(q.shape, dtype, device))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    msg = (f"(q_len {q_len}, kv_len {kv_len}, causal {causal}, heads {q_heads}/{kv_heads}, scale {scale}, "
           f"{num_programs} programs, tile_order {order.tolist()})")
    check_persistent_run(out, lse, owner, q, k, v, causal, scale, order, num_programs, dtype, seed, msg)


@persistent_ex
def test_persistent_forward_with_your_schedule(impl, device, gen, seed):
    """The default schedule is your `causal_tile_order`: the work each program did, read from
    ``owner``, is within one longest tile of the average."""
    batch, q_heads, q_len, head_dim, num_programs = 1, 4, 130, 16, 3
    q, k, v = (random_tensor((batch, q_heads, q_len, head_dim), torch.float32, device, gen) for _ in range(3))
    out, lse, owner = impl.persistent_forward(q, k, v, causal=True, num_programs=num_programs,
                                              out=poisoned(q.shape, torch.float32, device))
    want_out, want_lse = ref.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    assert_close(out, want_out, torch.float32, "out (your schedule, causal, 130 rows, 4 heads, 3 programs)", seed)
    assert_close(lse, want_lse, torch.float32, "lse (your schedule)", seed)
    owner = owner.cpu().numpy()
    assert ((owner >= 0) & (owner < num_programs)).all(), f"owner {owner.tolist()}: every tile, by one of 3 programs"
    work = np.tile(key_blocks(q_len, q_len, 32, 16, True), batch * q_heads)   # the launcher's 32 x 16 tiles
    loads = np.bincount(owner, weights=work, minlength=num_programs)
    assert loads.max() <= work.sum() / num_programs + work.max(), (
        f"work per program {loads.tolist()} (key blocks): the busiest exceeds the average "
        f"{work.sum() / num_programs:.2f} by more than one longest tile ({work.max()})")


# --- 4.9 -------------------------------------------------------------------------------------

#: Hopper, per group of 16 keys: lane c of a quad holds the scores of keys 2c, 2c+1, 2c+8, 2c+9
#: (the fp32 accumulator of wgmma), and an 8-bit first operand wants keys 4c … 4c+3.
HOPPER_ACCUMULATOR = np.array([[2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9] for c in range(4)])
HOPPER_OPERAND = np.array([[4 * c + r for r in range(4)] for c in range(4)])


def read_as_operand(p, accumulator_columns, operand_keys):
    """``p [..., n]`` as P·V reads it when every register goes over unchanged: in each group of
    G keys, the value of key ``accumulator_columns[lane, r]`` lands at ``operand_keys[lane, r]``."""
    cols, keys = np.ravel(accumulator_columns), np.ravel(operand_keys)
    read = np.empty_like(p)
    for start in range(0, p.shape[-1], cols.size):
        read[..., start + keys] = p[..., start + cols]
    return read


@relabel_ex
def test_hopper_order_is_the_kernels(impl):
    """On Hopper's two layouts the order is the one `prepare_gluon_fp8` stores Vᵀ's keys in."""
    from minillm.kernels.ch04_flash_attention_gluon import P_KEY_ORDER

    order = np.asarray(impl.relabel_order(HOPPER_ACCUMULATOR, HOPPER_OPERAND))
    assert order.shape == (16,) and [int(x) for x in order] == list(P_KEY_ORDER), \
        f"got {order.tolist()}: position 4c + r must hold the key of lane c's register r after Q·Kᵀ"


@relabel_ex
@pytest.mark.parametrize("lanes, registers", [(4, 4), (8, 2), (2, 8), (4, 8), (1, 5)])
def test_relabelled_product_is_exact(impl, seed, lanes, registers):
    """Any two arrangements of a group: P read as it lies, times Vᵀ in your order, is P·V."""
    rng = np.random.default_rng(seed)
    group = lanes * registers
    columns = rng.permutation(group).reshape(lanes, registers)
    keys = rng.permutation(group).reshape(lanes, registers)
    order = np.asarray(impl.relabel_order(columns, keys))
    assert sorted(order.tolist()) == list(range(group)), f"order must be a permutation of 0 … {group - 1} (seed {seed})"
    n = group * int(rng.integers(1, 5))
    p, vt = rng.random((3, n)), rng.standard_normal((2, 5, n))  # vt: [heads, head_dim, keys]
    got = read_as_operand(p, columns, keys) @ np.swapaxes(impl.permute_keys(vt, order), -1, -2)
    np.testing.assert_allclose(got, p @ np.swapaxes(vt, -1, -2), rtol=1e-12, atol=1e-12,
                               err_msg=f"P·V with the registers relabelled and Vᵀ permuted (seed {seed})")


@relabel_ex
def test_permute_keys_moves_keys_within_groups_only(impl, seed):
    rng = np.random.default_rng(seed)
    order = rng.permutation(16)
    vt = rng.standard_normal((2, 3, 4, 48)).astype(np.float32)
    before = vt.copy()
    got = np.asarray(impl.permute_keys(vt, order))
    assert got.shape == vt.shape and got.dtype == vt.dtype
    np.testing.assert_array_equal(vt, before, err_msg="permute_keys must not modify its input")
    for g in range(3):
        np.testing.assert_array_equal(got[..., 16 * g:16 * g + 16], vt[..., 16 * g + order],
                                      err_msg=f"group {g}: key 16g + k must be vt's key 16g + order[k] (seed {seed})")
    with pytest.raises(ValueError):
        impl.permute_keys(vt[..., :40], order)  # 40 keys: not whole groups of 16


# --- 4.10 ------------------------------------------------------------------------------------

def exp2_inputs(rng, n):
    """``n`` fp32 inputs <= 0: mostly spread over [-130, 0], with the points where rounding
    changes its mind (k ± 1/2), 0, the clamp, values below it and ``-inf`` scattered among them."""
    special = np.concatenate([np.arange(-124, 1) + 0.5, np.arange(-124, 1) - 0.5, [0.0, -125.0, -126.0, -1e4,
                                                                                     -np.inf]])
    x = -rng.exponential(8.0, n)
    picks = rng.choice(n, size=min(n, special.size // 4), replace=False)
    x[picks] = rng.choice(special, size=picks.size)
    return np.minimum(x, 0.0).astype(np.float32)


@exp2_ex
@pytest.mark.parametrize("n", [1, 200, 4099])
def test_exp2_on_fma(impl, n, device, seed):
    """Within the cubic's error of 2^x, and the cubic's answer (a few ulp of
    `minillm.reference.ch04_fp8.exp2_polynomial`, which ``tl.exp2`` is not: it is exact to an
    ulp, where the cubic is off by up to 7.5e-5)."""
    from minillm.reference import ch04_fp8 as ref8

    x = exp2_inputs(np.random.default_rng(seed), n)
    y = impl.exp2_on_fma(torch.from_numpy(x).to(device))
    assert y.shape == (n,) and y.dtype == torch.float32
    got = to_numpy(y)
    exact = np.exp2(np.maximum(x.astype(np.float64), ref8.EXP2_POLY_MIN))
    worst = np.argmax(np.abs(got / exact - 1))
    assert np.abs(got[worst] / exact[worst] - 1) <= ref8.EXP2_POLY_REL_ERROR, \
        f"2^{x[worst]} = {exact[worst]:.7e}, got {got[worst]:.7e} (seed {seed})"
    want = ref8.exp2_polynomial(x).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=8 * 2.0 ** -23, atol=0,
                               err_msg=f"not the cubic's value: round, cubic in f, exponent bits (seed {seed})")


@exp2_ex
def test_exp2_kernel_leaves_the_rest_alone(impl, device, seed):
    """Elements past ``n`` are not written: the output buffer is longer than the input."""
    x = torch.from_numpy(exp2_inputs(np.random.default_rng(seed), 250)).to(device)
    out = poisoned((384,), torch.float32, device)
    impl.exp2_on_fma(x, out=out)
    assert torch.isfinite(out[:250]).all(), f"the first 250 elements must be written (seed {seed})"
    assert torch.isnan(out[250:]).all(), f"elements past n were written (seed {seed})"


# --- 4.11 ------------------------------------------------------------------------------------

def row_sum_scores(rng, n_q, n_k, block_n):
    """Scores ``[n_q, n_k]`` (base 2, fp32) whose weights never sit near a rounding point of
    e4m3, so that the kernel and the float64 reference round every one the same way: in each
    block of ``block_n`` keys one key has the row's running max ``M_b`` (an integer, rising by
    0, 1 or 2 from block to block), and every other key a weight ``2^(s - M_b) = g + 2^e/32``,
    a quarter of e4m3's step above a value ``g = 2^e (1 + k/8)`` with ``e`` in -4..-1."""
    s = np.empty((n_q, n_k))
    top = rng.integers(-4, 5, size=n_q).astype(np.float64)
    for start in range(0, n_k, block_n):
        width = min(block_n, n_k - start)
        top = top + rng.integers(0, 3, size=n_q) if start else top
        e = rng.integers(-4, 0, size=(n_q, width)).astype(np.float64)
        w = 2.0 ** e * (1 + rng.integers(0, 8, size=(n_q, width)) / 8 + 1 / 32)
        w[np.arange(n_q), rng.integers(0, width, size=n_q)] = 1.0
        s[:, start:start + width] = top[:, None] + np.log2(w)
    return s.astype(np.float32)


@row_sums_ex
@pytest.mark.parametrize("n_q, n_k, d, block_m, block_n", [(37, 100, 16, 32, 32), (64, 64, 32, 16, 16),
                                                           (5, 203, 64, 16, 32)])
def test_row_sums_as_a_matmul(impl, n_q, n_k, d, block_m, block_n, device, seed):
    """Out and the base-2 logsumexp against the float64 steps with P rounded to e4m3 in both
    products (`minillm.reference.ch04_fp8.online_fp8_softmax`); on these inputs summing P unrounded moves the logsumexp by more than 0.01, and
    multiplying V by it moves the output by far more than the tolerance."""
    from minillm.reference import ch04_fp8 as ref8

    rng = np.random.default_rng(seed)
    s = row_sum_scores(rng, n_q, n_k, block_n)
    v = rng.standard_normal((n_k, d)).astype(np.float32)
    out, lse = impl.row_sums_attention(torch.from_numpy(s).to(device), torch.from_numpy(v).to(device),
                                       block_m=block_m, block_n=block_n)
    assert out.shape == (n_q, d) and lse.shape == (n_q,)
    want_out, want_lse = ref8.online_fp8_softmax(s, v, block_n)
    _, plain_lse = ref8.online_fp8_softmax(s, v, block_n, rounded_sum=False)
    assert np.abs(want_lse - plain_lse).max() > 1e-2  # (the inputs tell the two sums apart)
    np.testing.assert_allclose(to_numpy(lse), want_lse, rtol=0, atol=2e-5,
                               err_msg=f"lse = m + log2(l), l from P rounded to e4m3 (seed {seed})")
    np.testing.assert_allclose(to_numpy(out), want_out, rtol=1e-5, atol=1e-5,
                               err_msg=f"out = (P8 @ V) / (P8 @ 1) (seed {seed})")


@row_sums_ex
def test_row_sums_kernel_writes_only_its_rows(impl, device, seed):
    """Rows past ``n_q`` of given, longer buffers are not written."""
    rng = np.random.default_rng(seed)
    s = torch.from_numpy(row_sum_scores(rng, 20, 70, 32)).to(device)
    v = torch.from_numpy(rng.standard_normal((70, 16)).astype(np.float32)).to(device)
    out, lse = poisoned((27, 16), torch.float32, device), poisoned((27,), torch.float32, device)
    impl.row_sums_attention(s, v, out=out, lse=lse, block_m=16, block_n=32)
    assert torch.isfinite(out[:20]).all() and torch.isfinite(lse[:20]).all(), f"rows 0-19 must be written (seed {seed})"
    assert torch.isnan(out[20:]).all() and torch.isnan(lse[20:]).all(), f"rows past n_q were written (seed {seed})"
