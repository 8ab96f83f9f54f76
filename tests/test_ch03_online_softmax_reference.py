"""Chapter 3's NumPy reference: the online softmax, merging partial results, and
FlashAttention-1's tiled attention with its HBM-traffic count.

These are the oracles of the Chapter 3 kernels, so they are checked against Chapter 1's
`minillm.reference.ch01_naive_attention` (itself checked against PyTorch) and against hand-computed
values: the chapter's worked example, the paper's A100 block sizes, exact traffic counts.
"""
import math

import numpy as np
import pytest

from minillm.costs import fa1_traffic
from minillm.reference import attention, softmax
from minillm.reference.ch03_online_softmax import (
    A100_SRAM_BYTES, HBM, fa1_block_sizes, merge_partials, merge_stats, naive_softmax, online_softmax,
    online_softmax_trace, online_softmax_update, partial_attention, softmax_stats, tile_step, tiled_attention,
)

E = math.e


def random_scores(rng, shape, scale=10.0, masked=0.2):
    """Random scores with a fraction ``masked`` of ``-inf`` entries."""
    s = scale * rng.standard_normal(shape)
    return np.where(rng.random(shape) < masked, -np.inf, s)


# ----------------------------------------------------------------------------------------
# The worked example: softmax([1, 2, 3, 4]) in two blocks
# ----------------------------------------------------------------------------------------
def test_worked_example_two_blocks():
    steps = online_softmax_trace([1.0, 2.0, 3.0, 4.0], block_size=2)
    assert len(steps) == 2
    first, second = steps
    # Block [1, 2]: max 2, sum e^(1-2) + e^(2-2).
    assert first["block_max"] == 2 and first["m"] == 2
    assert first["l"] == pytest.approx(1 / E + 1, rel=1e-15)
    assert first["rescale"] == 0.0                       # nothing summed before: exp(-inf) = 0
    # Block [3, 4]: its own max 4 and sum e^-1 + 1; the running sum is rescaled by e^(2-4).
    assert second["block_max"] == 4 and second["block_sum"] == pytest.approx(1 / E + 1, rel=1e-15)
    assert second["rescale"] == pytest.approx(E ** -2, rel=1e-15)
    assert second["m"] == 4
    assert second["l"] == pytest.approx(E ** -3 + E ** -2 + E ** -1 + 1, rel=1e-15)
    # Merging the two blocks' statistics gives the same, and so the same softmax.
    m, l = merge_stats(np.float64(2), 1 / E + 1, np.float64(4), 1 / E + 1)
    assert m == 4 and l == pytest.approx(second["l"], rel=1e-15)
    x = np.array([1.0, 2.0, 3.0, 4.0])
    p, lse = online_softmax(x, block_size=2)
    np.testing.assert_allclose(p, np.exp(x - 4) / second["l"], rtol=1e-15)
    np.testing.assert_allclose(p, softmax(x), rtol=1e-15)
    assert lse == pytest.approx(4 + math.log(second["l"]), rel=1e-15)


def test_without_the_max_softmax_overflows():
    x = np.array([1000.0, 1001.0, 1002.0])
    with np.errstate(all="ignore"):
        assert np.isnan(naive_softmax(x)).all()         # exp(1000) = inf, inf / inf = NaN
    want = softmax(x - 1000)                             # the same softmax, shifted by hand
    np.testing.assert_allclose(softmax(x), want, rtol=1e-15)
    np.testing.assert_allclose(online_softmax(x, 1)[0], want, rtol=1e-15)
    small = np.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(naive_softmax(small), softmax(small), rtol=1e-15)


# ----------------------------------------------------------------------------------------
# Statistics and their merge
# ----------------------------------------------------------------------------------------
def test_softmax_stats(seed):
    rng = np.random.default_rng(seed)
    x = random_scores(rng, (6, 40))
    x[0] = -np.inf
    m, l = softmax_stats(x)
    assert m[0] == -np.inf and l[0] == 0                 # the identity: a fully masked row
    np.testing.assert_array_equal(m[1:], x[1:].max(-1))
    assert ((1 <= l[1:]) & (l[1:] <= 40)).all()          # the max term is exp(0) = 1
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(m[1:] + np.log(l[1:]), np.logaddexp.reduce(x[1:], axis=-1), rtol=1e-13)
    m_empty, l_empty = softmax_stats(np.zeros((3, 0)))
    assert (m_empty == -np.inf).all() and (l_empty == 0).all()


@pytest.mark.parametrize("trial", range(5))
def test_online_update_over_any_split(trial, seed):
    """Streaming a row through `online_softmax_update`, cut anywhere (blocks of one
    element, fully masked blocks), ends with the statistics of the whole row."""
    rng = np.random.default_rng(seed + trial)
    n = int(rng.integers(1, 60))
    x = random_scores(rng, (4, n), scale=float(rng.choice([1, 30, 300])))
    x[:, : n // 3] = -np.inf if trial % 2 else x[:, : n // 3]    # leading masked blocks
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 8))), replace=False)) if n > 1 else []
    m, l = np.full(4, -np.inf), np.zeros(4)
    for block in np.split(x, cuts, axis=-1):
        m, l = online_softmax_update(m, l, block)
    want_m, want_l = softmax_stats(x)
    np.testing.assert_array_equal(m, want_m)
    np.testing.assert_allclose(l, want_l, rtol=1e-13, err_msg=f"seed {seed + trial}, cuts {cuts}")


@pytest.mark.parametrize("scale", [1.0, 50.0, 1000.0])
def test_merge_stats_is_associative_and_commutative(scale, seed):
    rng = np.random.default_rng(seed)
    a, b, c = (random_scores(rng, (8, int(rng.integers(1, 20))), scale=scale) for _ in range(3))
    a[0] = -np.inf                                       # a fully masked piece
    sa, sb, sc = softmax_stats(a), softmax_stats(b), softmax_stats(c)
    left = merge_stats(*merge_stats(*sa, *sb), *sc)
    right = merge_stats(*sa, *merge_stats(*sb, *sc))
    swapped = merge_stats(*sc, *merge_stats(*sb, *sa))
    whole = softmax_stats(np.concatenate([a, b, c], axis=-1))
    for got in (left, right, swapped):
        np.testing.assert_array_equal(got[0], whole[0])
        np.testing.assert_allclose(got[1], whole[1], rtol=1e-13, err_msg=f"seed {seed}")
    identity = (np.full(8, -np.inf), np.zeros(8))
    for got in (merge_stats(*sa, *identity), merge_stats(*identity, *sa)):
        np.testing.assert_array_equal(got[0], sa[0])
        np.testing.assert_array_equal(got[1], sa[1])


def test_merge_partials_equals_attention_over_all_keys(seed):
    """Split the keys into three random (non-contiguous) sets, attend over each, merge the
    partial outputs in both groupings and orders: always attention over all the keys."""
    rng = np.random.default_rng(seed)
    heads, q_len, kv_len, d = 3, 11, 29, 8
    q, k, v = rng.standard_normal((heads, q_len, d)), rng.standard_normal((heads, kv_len, d)), rng.standard_normal((heads, kv_len, d))
    want, want_lse = attention(q[None], k[None], v[None], causal=True)    # first rows see few keys
    s = np.einsum("hmd,hnd->hmn", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((q_len, kv_len), dtype=bool), kv_len - q_len), s, -np.inf)
    owner = rng.integers(0, 3, size=kv_len)
    parts = [partial_attention(s[..., owner == i], v[:, owner == i]) for i in range(3)]
    a, b, c = parts
    for m, l, o in (merge_partials(*merge_partials(*a, *b), *c), merge_partials(*a, *merge_partials(*b, *c)),
                    merge_partials(*c, *merge_partials(*a, *b))):
        np.testing.assert_allclose(o, want[0], atol=1e-12, err_msg=f"seed {seed}")
        np.testing.assert_allclose(m + np.log(l), want_lse[0], rtol=1e-12)
    empty = (np.full((heads, q_len), -np.inf), np.zeros((heads, q_len)), np.zeros((heads, q_len, d)))
    m, l, o = merge_partials(*a, *empty)
    np.testing.assert_array_equal(o, a[2])


def test_merge_partials_with_fully_masked_rows():
    s1 = np.array([[-np.inf, -np.inf], [1.0, 2.0]])
    s2 = np.array([[-np.inf], [-np.inf]])
    v1, v2 = np.ones((2, 3)), np.full((1, 3), 5.0)    # the values of the two pieces of the keys
    m, l, o = merge_partials(*partial_attention(s1, v1), *partial_attention(s2, v2))
    assert m[0] == -np.inf and l[0] == 0 and (o[0] == 0).all()  # nothing visible: zeros, not NaN
    np.testing.assert_allclose(o[1], 1.0)


@pytest.mark.parametrize("block_size", [1, 3, 16, 1000])
def test_online_softmax_two_sweeps(block_size, seed):
    rng = np.random.default_rng(seed)
    x = random_scores(rng, (3, 5, 77), scale=20.0)
    x[1, 2] = -np.inf
    p, lse = online_softmax(x, block_size)
    np.testing.assert_allclose(p, softmax(x), atol=1e-15, rtol=1e-13)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(lse, np.logaddexp.reduce(x, axis=-1), rtol=1e-13)
    assert lse[1, 2] == -np.inf and (p[1, 2] == 0).all()


# ----------------------------------------------------------------------------------------
# FlashAttention-1
# ----------------------------------------------------------------------------------------
def test_block_sizes_of_the_paper():
    assert fa1_block_sizes(A100_SRAM_BYTES, 64, elem_bytes=2) == (64, 384)    # the A100 example, fp16
    assert fa1_block_sizes(A100_SRAM_BYTES, 64, elem_bytes=4) == (64, 192)    # fp32 words
    assert fa1_block_sizes(A100_SRAM_BYTES, 128, elem_bytes=2) == (128, 192)  # Br = d caps at head_dim
    assert fa1_block_sizes(1000, 16, elem_bytes=2) == (8, 8)                  # ⌈500 / 64⌉ = 8 < d
    with pytest.raises(ValueError):
        fa1_block_sizes(0, 64)


@pytest.mark.parametrize("trial", range(20))
def test_block_sizes_fit_the_budget(trial, seed):
    rng = np.random.default_rng(seed + trial)
    sram, d, e = int(rng.integers(1024, 1 << 20)), int(rng.choice([16, 32, 64, 80, 128, 256])), int(rng.choice([1, 2, 4]))
    br, bc = fa1_block_sizes(sram, d, e)
    words = sram // e
    assert 1 <= br <= min(bc, d)
    # K_j, V_j, Q_i, O_i: at most 4·Bc·d elements, over M by less than one ceil's rounding.
    assert (2 * bc + 2 * br) * d <= 4 * bc * d < words + 4 * d
    assert 4 * (bc - 1) * d < words                     # Bc is the *smallest* block with 4·Bc·d >= M


def test_tile_step_is_a_merge_of_partials(seed):
    rng = np.random.default_rng(seed)
    br, bc, d = 5, 7, 4
    q, k, v = rng.standard_normal((br, d)), rng.standard_normal((bc, d)), rng.standard_normal((bc, d))
    state = partial_attention(random_scores(rng, (br, 3)), rng.standard_normal((br, 3, d)))  # (m, l, o)
    visible = rng.random((br, bc)) < 0.7
    visible[0] = False
    o, l, m = tile_step(q, k, v, state[2], state[1], state[0], 0.5, visible)
    want = merge_partials(*state, *partial_attention(np.where(visible, 0.5 * q @ k.T, -np.inf), v))
    np.testing.assert_array_equal(m, want[0])
    np.testing.assert_allclose(l, want[1], rtol=1e-13)
    np.testing.assert_allclose(o, want[2], atol=1e-13)
    # From the initial state (0, 0, -inf), one step is attention over the tile.
    o, l, m = tile_step(q, k, v, np.zeros((br, d)), np.zeros(br), np.full(br, -np.inf), 0.5)
    ref, ref_lse = attention(q[None, None], k[None, None], v[None, None], scale=0.5)
    np.testing.assert_allclose(o, ref[0, 0], atol=1e-13)
    np.testing.assert_allclose(m + np.log(l), ref_lse[0, 0], rtol=1e-13)


# (batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, block_q, block_kv)
TILED = [
    (1, 1, 1, 1, 1, 4, False, None, 1, 1),
    (2, 4, 2, 13, 13, 8, True, None, 4, 5),       # GQA, blocks that do not divide N
    (1, 3, 1, 7, 30, 6, True, 4, 3, 8),           # MQA, decode-like q_len < kv_len, window
    (1, 2, 2, 9, 4, 5, True, None, 2, 3),         # q_len > kv_len: the first rows see nothing
    (1, 2, 1, 10, 17, 8, False, None, 64, 64),    # one block holds everything
    (1, 1, 1, 16, 16, 4, False, 3, 1, 1),         # 1x1 tiles
]


@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window,block_q,block_kv", TILED)
def test_tiled_attention_matches_reference(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window,
                                           block_q, block_kv, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, q_heads, q_len, head_dim))
    k, v = rng.standard_normal((2, batch, kv_heads, kv_len, head_dim))
    out, lse = tiled_attention(q, k, v, causal=causal, window=window, block_q=block_q, block_kv=block_kv)
    want, want_lse = attention(q, k, v, causal=causal, window=window)
    np.testing.assert_allclose(out, want, atol=1e-12, err_msg=f"seed {seed}")
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, err_msg=f"seed {seed}")  # -inf rows compare equal


def test_tiled_attention_blocks_from_the_sram_budget(seed):
    """No block sizes given: they come from ``sram_bytes`` (2 KB of fp16 and d = 16 gives
    1024 words, Bc = Br = 16), which the count of Q reads reveals: Q is read once per K/V block."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, 1, 2, 50, 16))
    hbm = HBM()
    out, _ = tiled_attention(q, k, v, causal=True, sram_bytes=2048, elem_bytes=2, hbm=hbm)
    np.testing.assert_allclose(out, attention(q, k, v, causal=True)[0], atol=1e-12)
    assert fa1_block_sizes(2048, 16, 2) == (16, 16)
    assert hbm.reads["q"] == math.ceil(50 / 16) * q.size
    assert hbm.reads["k"] == hbm.reads["v"] == k.size


@pytest.mark.parametrize("trial", range(4))
def test_hbm_count_equals_fa1_traffic(trial, seed):
    rng = np.random.default_rng(seed + trial)
    batch, kv_heads, group = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    q_len, kv_len, d = int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.choice([4, 8]))
    br, bc = int(rng.integers(1, 12)), int(rng.integers(1, 12))
    q = rng.standard_normal((batch, kv_heads * group, q_len, d))
    k, v = rng.standard_normal((2, batch, kv_heads, kv_len, d))
    hbm = HBM()
    tiled_attention(q, k, v, causal=bool(trial % 2), block_q=br, block_kv=bc, hbm=hbm)
    sizes = {"q": 2, "k": 2, "v": 2, "out": 2, "o": 4, "l": 4, "m": 4, "lse": 4}
    want = fa1_traffic(batch, kv_heads * group, q_len, kv_len, d, 2, bc)
    counted = hbm.bytes(sizes)
    for name, rw in want.items():
        assert counted.get(name, {"read": 0, "write": 0}) == rw, f"{name} (seed {seed + trial}, Br={br}, Bc={bc})"
