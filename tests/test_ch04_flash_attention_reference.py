"""Chapter 4's NumPy reference: FlashAttention-2's forward and backward, block skipping,
the FLOP count of change (2) and the warp-partitioning count of change (4).

These are the oracles of the Chapter 4 exercises and the story of its notebook, so they are
checked against Chapter 1's `minillm.reference.ch01_naive_attention` (forward), against float64 torch
autograd (backward), against brute force (block classes), against the Triton kernel's own
segment arithmetic (ported), and against closed forms (FLOPs, shared-memory bytes).
"""
import math

import numpy as np
import pytest
import torch

from minillm.costs import nonmatmul_flops, warp_partition_traffic
from minillm.reference import attention, attention_mask
from minillm.reference.ch04_flash_attention import (
    FULL, MASKED, SKIP, backward_delta, block_slices, classify_blocks, fa1_finalize, fa1_tile_step, fa2_backward,
    fa2_backward_tile, fa2_finalize, fa2_forward, fa2_tile_step, kernel_kv_segments,
    recompute_probs, simulate_warp_split,
)
from minillm.reference.ch03_online_softmax import HBM, tile_step


def torch_attention(q, k, v, causal, scale, window):
    """Attention written out in torch float64, differentiable: GQA by repeating K/V heads,
    masks from `attention_mask`; a row that sees no key gives 0 with zero gradients."""
    q_heads, q_len = q.shape[1:3]
    kv_heads, kv_len = k.shape[1:3]
    k = k.repeat_interleave(q_heads // kv_heads, dim=1)
    v = v.repeat_interleave(q_heads // kv_heads, dim=1)
    visible = torch.from_numpy(attention_mask(q_len, kv_len, causal, window))
    s = torch.where(visible, scale * q @ k.transpose(-1, -2), -math.inf)
    m = s.amax(-1, keepdim=True).detach()                # the shift does not change the softmax
    p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
    l = p.sum(-1, keepdim=True)
    return (p / torch.where(l == 0, 1.0, l)) @ v


def torch_grads(q, k, v, do, causal, scale, window):
    """``(o, dq, dk, dv)`` by float64 autograd of `torch_attention`."""
    q_t, k_t, v_t = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    o = torch_attention(q_t, k_t, v_t, causal, scale, window)
    o.backward(torch.tensor(do))
    return o.detach().numpy(), q_t.grad.numpy(), k_t.grad.numpy(), v_t.grad.numpy()


def random_qkv(rng, batch, q_heads, kv_heads, q_len, kv_len, head_dim, score_scale=1.0):
    q = score_scale * rng.standard_normal((batch, q_heads, q_len, head_dim))
    k, v = rng.standard_normal((2, batch, kv_heads, kv_len, head_dim))
    return q, k, v


def brute_force_classes(q_len, kv_len, block_m, block_n, causal, window):
    """SKIP iff every pair of the block is masked, FULL iff none is: read off the mask."""
    visible = attention_mask(q_len, kv_len, causal, window)
    rows, cols = block_slices(q_len, block_m), block_slices(kv_len, block_n)
    classes = np.empty((len(rows), len(cols)), dtype=np.int8)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            tile = visible[r, c]
            classes[i, j] = SKIP if not tile.any() else FULL if tile.all() else MASKED
    return classes


# (batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, block_m, block_n)
CASES = [
    (1, 1, 1, 1, 1, 4, False, None, 1, 1),
    (2, 2, 2, 13, 13, 8, True, None, 4, 5),       # MHA, blocks that divide nothing
    (1, 4, 2, 17, 17, 6, False, None, 8, 3),      # GQA 2, odd lengths
    (1, 4, 1, 7, 30, 8, True, 4, 3, 8),           # MQA, decode-like q_len < kv_len, sliding window
    (1, 2, 2, 19, 6, 5, True, None, 4, 4),        # q_len > kv_len: the first 13 rows see no key
    (2, 8, 2, 21, 11, 4, False, 3, 5, 2),         # GQA 4, non-causal window, rows beyond every key
    (1, 3, 3, 10, 17, 8, False, None, 64, 64),    # one block holds everything
    (1, 2, 1, 16, 16, 4, True, 5, 1, 1),          # 1 x 1 tiles
]
CASE_IDS = [f"b{c[0]}-h{c[1]}-kv{c[2]}-q{c[3]}-k{c[4]}-{'causal' if c[6] else 'full'}-w{c[7]}-{c[8]}x{c[9]}"
            for c in CASES]


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window,block_m,block_n", CASES,
                         ids=CASE_IDS)
def test_forward_matches_reference(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, block_m,
                                   block_n, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, q_heads, kv_heads, q_len, kv_len, head_dim)
    o, lse = fa2_forward(q, k, v, causal=causal, window=window, block_m=block_m, block_n=block_n)
    want, want_lse = attention(q, k, v, causal=causal, window=window)
    np.testing.assert_allclose(o, want, atol=1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, err_msg=f"seed {seed}")   # -inf rows compare equal
    unseen = ~attention_mask(q_len, kv_len, causal, window).any(-1)
    assert (o[:, :, unseen] == 0).all() and np.isneginf(lse[:, :, unseen]).all()


@pytest.mark.parametrize("trial", range(6))
def test_forward_random_shapes_and_large_scores(trial, seed):
    """Random everything, scores into the hundreds (exp of them overflows without the max)."""
    rng = np.random.default_rng(seed + trial)
    kv_heads, group = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    q_len, kv_len, d = int(rng.integers(1, 30)), int(rng.integers(1, 30)), int(rng.choice([3, 8]))
    causal, window = bool(rng.integers(2)), (None if trial % 3 == 0 else int(rng.integers(1, 12)))
    q, k, v = random_qkv(rng, 1, kv_heads * group, kv_heads, q_len, kv_len, d, score_scale=float(rng.choice([1, 100])))
    block_m, block_n = int(rng.integers(1, 12)), int(rng.integers(1, 12))
    o, lse = fa2_forward(q, k, v, causal=causal, window=window, block_m=block_m, block_n=block_n)
    want, want_lse = attention(q, k, v, causal=causal, window=window)
    msg = f"q_len={q_len} kv_len={kv_len} causal={causal} window={window} {block_m}x{block_n}, seed {seed + trial}"
    assert np.isfinite(o).all(), msg
    np.testing.assert_allclose(o, want, atol=1e-12, err_msg=msg)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, err_msg=msg)


def test_tile_step_keeps_the_output_unscaled(seed):
    """After any number of steps, acc / ℓ is Chapter 3's normalised output and acc itself is
    Σ exp(s - m)·v; one step of each style from the same state agrees."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((11, 4)), rng.standard_normal((11, 4))
    visible = rng.random((5, 11)) < 0.7
    visible[0] = False                                  # a row that never sees a key
    empty = (np.zeros((5, 4)), np.zeros(5), np.full(5, -np.inf))
    (acc, l, m), (o1, l1, m1), (o3, l3, m3) = empty, empty, empty      # FA2, FA1, Chapter 3's tile_step
    for cols in block_slices(11, 3):
        acc, l, m = fa2_tile_step(q, k[cols], v[cols], acc, l, m, 0.7, visible[:, cols])
        o1, l1, m1 = fa1_tile_step(q, k[cols], v[cols], o1, l1, m1, 0.7, visible[:, cols])
        o3, l3, m3 = tile_step(q, k[cols], v[cols], o3, l3, m3, 0.7, visible[:, cols])
    s = np.where(visible, 0.7 * (q @ k.T), -np.inf)
    np.testing.assert_array_equal(m, np.max(s, axis=-1))
    m_sub = np.where(np.isneginf(m), 0.0, m)
    np.testing.assert_allclose(acc, np.exp(s - m_sub[:, None]) @ v, rtol=1e-13, atol=1e-15)
    o, lse = fa2_finalize(acc, l, m)
    np.testing.assert_allclose(o, o1, rtol=1e-13, atol=1e-15)          # FA1's running output, normalised
    np.testing.assert_allclose(o1, o3, rtol=1e-15, atol=1e-15)         # is Chapter 3's tile_step
    np.testing.assert_array_equal(l1, l3)
    np.testing.assert_allclose(lse, fa1_finalize(o1, l1, m1)[1], rtol=1e-14)
    assert (o[0] == 0).all() and lse[0] == -np.inf


def test_hbm_traffic_and_skipped_blocks_never_loaded(seed):
    """FA2 (1): Q is read once, O and lse written once; K/V tiles are read once per
    (query head, Q block) that does not skip them, and never otherwise. K/V blocks that
    every Q block skips may even hold NaN."""
    rng = np.random.default_rng(seed)
    batch, q_heads, kv_heads, q_len, kv_len, d, bm, bn, window = 2, 4, 2, 9, 40, 8, 4, 6, 5
    q, k, v = random_qkv(rng, batch, q_heads, kv_heads, q_len, kv_len, d)
    classes = classify_blocks(q_len, kv_len, bm, bn, causal=True, window=window)
    never = [cols for j, cols in enumerate(block_slices(kv_len, bn)) if (classes[:, j] == SKIP).all()]
    assert len(never) >= 4, "the window leaves the first K/V blocks unseen"
    want, want_lse = attention(q, k, v, causal=True, window=window)
    for cols in never:
        k[:, :, cols] = v[:, :, cols] = np.nan
    hbm = HBM()
    o, lse = fa2_forward(q, k, v, causal=True, window=window, block_m=bm, block_n=bn, hbm=hbm)
    np.testing.assert_allclose(o, want, atol=1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    assert hbm.reads["q"] == q.size and hbm.writes["o"] == q.size and hbm.writes["lse"] == q.size // d
    cols_len = [c.stop - c.start for c in block_slices(kv_len, bn)]
    tiles = sum(cols_len[j] for i, j in zip(*np.nonzero(classes != SKIP)))     # keys loaded per query head
    assert hbm.reads["k"] == hbm.reads["v"] == batch * q_heads * tiles * d
    assert tiles < classes.shape[0] * kv_len / 3                                 # what skipping saved


# ----------------------------------------------------------------------------------------
# Block classes
# ----------------------------------------------------------------------------------------
def test_classes_of_the_square_causal_picture():
    assert (SKIP, MASKED, FULL) == (0, 1, 2)
    np.testing.assert_array_equal(classify_blocks(12, 12, 4, 4, causal=True),
                                  [[MASKED, SKIP, SKIP], [FULL, MASKED, SKIP], [FULL, FULL, MASKED]])
    # Decode: one query, the newest token, sees every key: nothing to mask.
    np.testing.assert_array_equal(classify_blocks(1, 10, 4, 4, causal=True), [[FULL, FULL, FULL]])
    # A window of 4 at q_len = kv_len = 12 with 4 x 4 blocks: the diagonal and the one
    # before it are masked, everything else skipped (no block is wholly inside a window).
    np.testing.assert_array_equal(classify_blocks(12, 12, 4, 4, causal=True, window=4),
                                  [[MASKED, SKIP, SKIP], [MASKED, MASKED, SKIP], [SKIP, MASKED, MASKED]])
    np.testing.assert_array_equal(classify_blocks(5, 7, 2, 3), np.full((3, 3), FULL))


@pytest.mark.parametrize("trial", range(8))
def test_classes_match_brute_force(trial, seed):
    rng = np.random.default_rng(seed + trial)
    for _ in range(50):
        q_len, kv_len = int(rng.integers(1, 40)), int(rng.integers(1, 40))
        block_m, block_n = int(rng.integers(1, 12)), int(rng.integers(1, 12))
        causal, window = bool(rng.integers(2)), (None if rng.random() < 0.4 else int(rng.integers(1, 20)))
        got = classify_blocks(q_len, kv_len, block_m, block_n, causal, window)
        want = brute_force_classes(q_len, kv_len, block_m, block_n, causal, window)
        np.testing.assert_array_equal(got, want, err_msg=f"{q_len}x{kv_len}, blocks {block_m}x{block_n}, "
                                                         f"causal={causal}, window={window}, seed {seed + trial}")


def kernel_classes(q_len, kv_len, block_m, block_n, causal, window):
    """The classes the Triton forward kernel uses, from `kernel_kv_segments`."""
    k_blocks = block_slices(kv_len, block_n)
    classes = np.full((len(block_slices(q_len, block_m)), len(k_blocks)), SKIP, dtype=np.int8)
    for i, rows in enumerate(block_slices(q_len, block_m)):
        lo, full_lo, full_hi, hi = kernel_kv_segments(rows.start, q_len, kv_len, block_m, block_n, causal, window)
        for start in range(lo, hi, block_n):
            classes[i, start // block_n] = FULL if full_lo <= start < full_hi else MASKED
    return classes


@pytest.mark.parametrize("trial", range(6))
def test_classes_agree_with_the_kernels_segments(trial, seed):
    """The kernel skips exactly the blocks `classify_blocks` skips, never runs unmasked a
    block that needs a mask, and masks more only on ragged edges: a K block running past
    kv_len, or (with a window) the last Q block, whose padding rows move the window's edge."""
    rng = np.random.default_rng(seed + trial)
    for _ in range(50):
        q_len, kv_len = int(rng.integers(1, 70)), int(rng.integers(1, 70))
        block_m, block_n = int(rng.choice([1, 3, 4, 16, 32])), int(rng.choice([1, 5, 8, 16, 32]))
        causal, window = bool(rng.integers(2)), (None if rng.random() < 0.4 else int(rng.integers(1, 30)))
        ours = classify_blocks(q_len, kv_len, block_m, block_n, causal, window)
        kernel = kernel_classes(q_len, kv_len, block_m, block_n, causal, window)
        msg = f"{q_len}x{kv_len}, blocks {block_m}x{block_n}, causal={causal}, window={window}, seed {seed + trial}"
        np.testing.assert_array_equal(kernel == SKIP, ours == SKIP, err_msg=msg)
        assert (ours[kernel == FULL] == FULL).all(), msg
        for i, j in zip(*np.nonzero(kernel != ours)):
            ragged_k = (j + 1) * block_n > kv_len
            ragged_q = window is not None and (i + 1) * block_m > q_len
            assert ragged_k or ragged_q, f"block ({i}, {j}): {msg}"


# ----------------------------------------------------------------------------------------
# Change (2): non-matmul FLOPs
# ----------------------------------------------------------------------------------------
def closed_form_flops(style, q_len, head_dim, area, row_steps):
    """The counts in terms of ``area`` (Σ r·c over the visited tiles) and ``row_steps``
    (Σ r: one per row and visited K/V block); see the tallies in the tile steps."""
    a, rs, n, d = area, row_steps, q_len, head_dim
    if style == "fa2":
        counts = {"exp": a + rs, "mul": a + rs * (1 + d), "add": 2 * a + rs * (1 + d) + n, "max": a,
                  "div": n * d, "log": n}
    else:
        counts = {"exp": a + 2 * rs, "mul": a + rs * (3 + 2 * d), "add": 2 * a + rs * (2 + d) + n, "max": a,
                  "div": rs * d, "log": n}
    return {**counts, "nonmatmul": sum(counts.values()), "matmul": 4 * a * d}


@pytest.mark.parametrize("style", ["fa1", "fa2"])
@pytest.mark.parametrize("trial", range(4))
def test_flop_count_matches_closed_form(style, trial, seed):
    rng = np.random.default_rng(seed + trial)
    q_len, kv_len, d = int(rng.integers(1, 60)), int(rng.integers(1, 60)), int(rng.choice([4, 16, 64]))
    block_m, block_n = int(rng.integers(1, 20)), int(rng.integers(1, 20))
    tc = math.ceil(kv_len / block_n)
    got = nonmatmul_flops(q_len, kv_len, d, block_m, block_n, style)
    assert got == closed_form_flops(style, q_len, d, q_len * kv_len, q_len * tc), f"seed {seed + trial}"
    # Causal: only the visited tiles count.
    classes = classify_blocks(q_len, kv_len, block_m, block_n, causal=True)
    rows = [r.stop - r.start for r in block_slices(q_len, block_m)]
    cols = [c.stop - c.start for c in block_slices(kv_len, block_n)]
    visited = list(zip(*np.nonzero(classes != SKIP)))
    area, row_steps = sum(rows[i] * cols[j] for i, j in visited), sum(rows[i] for i, _ in visited)
    got = nonmatmul_flops(q_len, kv_len, d, block_m, block_n, style, causal=True)
    assert got == closed_form_flops(style, q_len, d, area, row_steps), f"causal, seed {seed + trial}"


def test_fa2_saves_the_per_step_rescaling():
    """N = 1024, d = 64, 128 x 64 tiles (Tc = 16 K/V blocks): FA1 divides 16 times more and
    spends ~1.3x the non-matmul FLOPs of FA2 (the score tile's own exp, max and sums, the
    same in both, are the bulk); the matmuls are the same."""
    n, d, tc = 1024, 64, 16
    fa1, fa2 = (nonmatmul_flops(n, n, d, 128, 64, style) for style in ("fa1", "fa2"))
    assert fa1["matmul"] == fa2["matmul"] == 4 * n * n * d
    assert fa1["div"] == tc * fa2["div"] == tc * n * d
    assert fa1["exp"] - fa2["exp"] == n * tc                    # β: one more exp per row and step
    assert fa1["mul"] - fa2["mul"] == n * tc * (d + 2)          # d + 2 more multiplies per row and step
    assert 1.25 < fa1["nonmatmul"] / fa2["nonmatmul"] < 1.35


# ----------------------------------------------------------------------------------------
# Change (4): warps split Q, not K
# ----------------------------------------------------------------------------------------
ELEM_BYTES = {"q": 2, "k": 2, "v": 2, "max": 4, "sum": 4, "out": 4}


@pytest.mark.parametrize("split", ["q", "k"])
@pytest.mark.parametrize("block_m,block_n,head_dim,warps",
                         [(16, 12, 8, 4), (8, 8, 4, 2), (12, 6, 5, 1), (64, 32, 16, 8)])
def test_warp_split_computes_the_tile_and_counts_match(split, block_m, block_n, head_dim, warps, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((block_m, head_dim)), rng.standard_normal((block_n, head_dim)), \
        rng.standard_normal((block_n, head_dim))
    (acc, l, m), smem = simulate_warp_split(q, k, v, 0.3, warps, split)
    want = fa2_tile_step(q, k, v, np.zeros((block_m, head_dim)), np.zeros(block_m), np.full(block_m, -np.inf), 0.3)
    np.testing.assert_allclose(acc, want[0], rtol=1e-13, atol=1e-13 * np.abs(want[0]).max(), err_msg=f"seed {seed}")
    np.testing.assert_allclose(l, want[1], rtol=1e-13)
    np.testing.assert_allclose(m, want[2], rtol=1e-15)
    counted = smem.bytes(ELEM_BYTES)
    operands = sum(counted[n]["read"] for n in "qkv")
    exchange = [n for n in counted if n not in "qkv"]
    got = {"operand_read_bytes": operands,
           "exchange_write_bytes": sum(counted[n]["write"] for n in exchange),
           "exchange_read_bytes": sum(counted[n]["read"] for n in exchange), "barriers": smem.barriers}
    assert got == warp_partition_traffic(block_m, block_n, head_dim, warps, split)
    if split == "q":
        assert not exchange and smem.barriers == 0                 # no warp ever waits for another


def test_warp_partition_numbers():
    """Br = Bc = d = 64, 4 warps, fp16 operands, fp32 partials (the docstring's example)."""
    split_k = warp_partition_traffic(64, 64, 64, 4, "k")
    split_q = warp_partition_traffic(64, 64, 64, 4, "q")
    assert split_k == {"operand_read_bytes": 48 * 1024, "exchange_write_bytes": 66 * 1024,
                       "exchange_read_bytes": 69 * 1024, "barriers": 2}
    assert split_q == {"operand_read_bytes": 72 * 1024, "exchange_write_bytes": 0, "exchange_read_bytes": 0,
                       "barriers": 0}
    # With one warp there is nothing to split: both schemes are the same program.
    one_k, one_q = warp_partition_traffic(64, 64, 64, 1, "k"), warp_partition_traffic(64, 64, 64, 1, "q")
    assert one_k["operand_read_bytes"] == one_q["operand_read_bytes"]
    with pytest.raises(ValueError):
        warp_partition_traffic(64, 30, 64, 4, "k")                  # 4 warps cannot split 30 keys
    with pytest.raises(ValueError):
        warp_partition_traffic(64, 64, 64, 4, "d")


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window,block_m,block_n", CASES,
                         ids=CASE_IDS)
def test_backward_matches_torch_autograd(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, block_m,
                                         block_n, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, q_heads, kv_heads, q_len, kv_len, head_dim)
    o, lse = fa2_forward(q, k, v, causal=causal, window=window, block_m=block_m, block_n=block_n)
    do = rng.standard_normal(o.shape)
    scale = 1 / math.sqrt(head_dim)
    want_o, want_dq, want_dk, want_dv = torch_grads(q, k, v, do, causal, scale, window)
    np.testing.assert_allclose(want_o, attention(q, k, v, causal=causal, window=window)[0], atol=1e-12)
    dq, dk, dv = fa2_backward(q, k, v, o, lse, do, causal=causal, window=window, block_m=block_m, block_n=block_n)
    for name, got, want in (("dq", dq, want_dq), ("dk", dk, want_dk), ("dv", dv, want_dv)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-11, err_msg=f"{name}, seed {seed}")


@pytest.mark.parametrize("trial", range(4))
def test_backward_random_shapes(trial, seed):
    rng = np.random.default_rng(seed + trial)
    kv_heads, group = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    q_len, kv_len, d = int(rng.integers(1, 25)), int(rng.integers(1, 25)), int(rng.choice([3, 8]))
    causal, window = bool(rng.integers(2)), (None if trial % 2 else int(rng.integers(1, 10)))
    block_m, block_n = int(rng.integers(1, 10)), int(rng.integers(1, 10))
    q, k, v = random_qkv(rng, 1, kv_heads * group, kv_heads, q_len, kv_len, d, score_scale=float(rng.choice([1, 10])))
    scale = float(rng.uniform(0.1, 1.0))
    o, lse = fa2_forward(q, k, v, causal, scale, block_m, block_n, window)
    do = rng.standard_normal(o.shape)
    _, *want = torch_grads(q, k, v, do, causal, scale, window)
    got = fa2_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n, window)
    msg = f"q_len={q_len} kv_len={kv_len} group={group} causal={causal} window={window} {block_m}x{block_n}"
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10, err_msg=f"{name}: {msg}, seed {seed + trial}")


def test_unseen_rows_and_keys_get_zero_gradients(seed):
    """Rows with lse = -inf contribute nothing (no NaN from exp(-inf - (-inf))), and keys no
    query sees get dK = dV = 0."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 1, 12, 20, 4)
    window = 3
    o, lse = fa2_forward(q, k, v, causal=False, window=window, block_m=4, block_n=4)   # row i at position 8 + i
    do = rng.standard_normal(o.shape)
    dq, dk, dv = fa2_backward(q, k, v, o, lse, do, causal=False, window=window, block_m=4, block_n=4)
    unseen_keys = ~attention_mask(12, 20, False, window).any(0)
    assert unseen_keys[:6].all() and not np.isnan(dq).any()
    assert (dk[:, :, unseen_keys] == 0).all() and (dv[:, :, unseen_keys] == 0).all()
    q, k, v = random_qkv(rng, 1, 1, 1, 9, 4, 4)
    o, lse = fa2_forward(q, k, v, causal=True, block_m=3, block_n=3)
    dq, dk, dv = fa2_backward(q, k, v, o, lse, np.ones(o.shape), causal=True, block_m=3, block_n=3)
    assert np.isneginf(lse[0, 0, :5]).all() and (dq[0, 0, :5] == 0).all() and np.isfinite(dk).all()


def test_backward_pieces(seed):
    """D is the row sum of P ∘ dP; recomputed probabilities are the softmax (rows that see
    nothing: zeros); a row with lse = -inf adds nothing even to an unmasked tile."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 1, 1, 7, 9, 5)
    o, lse = attention(q, k, v, causal=True)
    do = rng.standard_normal(o.shape)
    p = recompute_probs(q[0, 0], k[0, 0], lse[0, 0], 1 / math.sqrt(5), attention_mask(7, 9, causal=True))
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-13)
    np.testing.assert_allclose(backward_delta(o, do)[0, 0], np.sum(p * (do[0, 0] @ v[0, 0].T), axis=-1), rtol=1e-12)
    lse_empty = lse[0, 0].copy()
    lse_empty[2] = -np.inf
    dq, dk, dv = fa2_backward_tile(q[0, 0], k[0, 0], v[0, 0], do[0, 0], lse_empty, np.zeros(7), 0.3)
    assert (dq[2] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


def test_input_checks():
    q, k = np.zeros((1, 3, 4, 8)), np.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError):
        fa2_forward(q, k, k)                                       # 3 query heads, 2 KV heads
    with pytest.raises(ValueError):
        fa2_forward(np.zeros((1, 2, 4, 8)), k, np.zeros((1, 2, 5, 8)))
    with pytest.raises(ValueError):
        classify_blocks(4, 4, 0, 2)
    with pytest.raises(ValueError):
        nonmatmul_flops(4, 4, 8, 2, 2, style="fa3")
