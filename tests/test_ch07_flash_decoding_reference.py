"""Chapter 7's NumPy references: `split_bounds` (how a sequence is cut into splits), the
S-way merge of split partials against attention over all the keys and against Chapter 3's
pairwise `merge_partials`, its edge cases (empty splits, huge logsumexps), and the
asynchronized softmax's partials and fallback. The kernels are tested against these in
`test_ch07_flash_decoding_kernels.py`.
"""
import math

import numpy as np
import pytest

from minillm.kernels.ch07_flash_decoding import ASYNC_WINDOW_FP16, ASYNC_WINDOW_WIDE
from minillm.reference import attention
from minillm.reference import ch07_flash_decoding as ref
from minillm.reference.ch03_online_softmax import merge_partials as merge_two


def test_split_bounds():
    """Hand-checked cuts, then the invariants: S ranges, contiguous, covering [0, n), starting
    at multiples of block_n, each at most ⌈tiles / S⌉ tiles long."""
    assert ref.split_bounds(50, 3, 16) == [(0, 32), (32, 50), (50, 50)]  # 4 tiles: 2, 2, none
    assert ref.split_bounds(50, 1, 16) == [(0, 50)]
    assert ref.split_bounds(0, 2, 16) == [(0, 0), (0, 0)]
    assert ref.split_bounds(7, 3, 1) == [(0, 3), (3, 6), (6, 7)]
    for n in (1, 15, 16, 17, 100, 333):
        for s in (1, 2, 3, 7, 40):
            for bn in (1, 16, 128):
                b = ref.split_bounds(n, s, bn)
                assert len(b) == s and b[0][0] == 0 and b[-1][1] == n
                assert all(b[i][1] == b[i + 1][0] for i in range(s - 1))
                span = math.ceil(math.ceil(n / bn) / s) * bn
                assert all(hi - lo <= span and (lo % bn == 0 or lo == n) for lo, hi in b)


@pytest.mark.parametrize("trial", range(3))
def test_reference_merge_equals_attention(trial, seed):
    """Any cut of the keys (random bounds, empty splits included), merged, is attention over
    all of them; and the S-way merge equals folding Chapter 3's pairwise `merge_partials`."""
    rng = np.random.default_rng(seed + trial)
    q_heads, kv_heads, head_dim, n = 6, 2, 8, int(rng.integers(1, 60))
    q = rng.standard_normal((q_heads, head_dim))
    k, v = rng.standard_normal((2, kv_heads, n, head_dim)) * [[[[3.0]]], [[[1.0]]]]
    cuts = np.sort(rng.integers(0, n + 1, size=int(rng.integers(0, 6))))
    edges = [0, *cuts.tolist(), n]
    bounds = list(zip(edges[:-1], edges[1:]))
    o, lse = ref.split_partials(q, k, v, bounds)
    out, l = ref.merge_partials(o, lse)
    want_o, want_l = attention(q[None, :, None], k[None], v[None])
    np.testing.assert_allclose(out, want_o[0, :, 0], rtol=1e-12, atol=1e-12, err_msg=f"seed {seed + trial}")
    np.testing.assert_allclose(l, want_l[0, :, 0], rtol=1e-12, err_msg=f"seed {seed + trial}")
    m, acc_l, acc_o = np.full(q_heads, -np.inf), np.zeros(q_heads), np.zeros((q_heads, head_dim))
    for s in range(len(bounds)):  # Chapter 3's merge wants (m, l) = (lse, 1) for a normalised piece
        empty = np.isneginf(lse[:, s])
        m, acc_l, acc_o = merge_two(m, acc_l, acc_o, lse[:, s], np.where(empty, 0.0, 1.0), o[:, s])
    np.testing.assert_allclose(out, acc_o, rtol=1e-12, atol=1e-12)


def test_reference_merge_edge_cases():
    """Empty splits weigh nothing whatever their output (NaN here); an all-empty row gives 0
    and -inf; huge logsumexps do not overflow."""
    o = np.array([[[1.0, 2.0], [np.nan, np.nan], [3.0, 5.0]], [[np.nan, 1.0], [7.0, np.nan], [0.0, 0.0]]])
    lse = np.array([[1000.0, -np.inf, 1000.0 + math.log(3)], [-np.inf, -np.inf, -np.inf]])
    out, l = ref.merge_partials(o, lse)
    np.testing.assert_allclose(out[0], (np.array([1.0, 2.0]) + 3 * np.array([3.0, 5.0])) / 4, rtol=1e-14)
    assert l[0] == pytest.approx(1000 + math.log(4), rel=1e-15)
    assert np.array_equal(out[1], [0.0, 0.0]) and l[1] == -np.inf


def test_reference_async_partials(seed):
    """With φ near the scores nothing falls back and the partials equal the exact ones; a KV
    head whose scores lie far above φ falls back (all of its non-empty splits), the other not."""
    rng = np.random.default_rng(seed)
    q_heads, kv_heads, head_dim, n = 8, 2, 16, 45
    q = rng.standard_normal((q_heads, head_dim))
    k, v = rng.standard_normal((2, kv_heads, n, head_dim))
    q[4:] = 50.0 / math.sqrt(head_dim)   # group 1: every score >= 50 (keys of KV head 1 all >= 1)
    k[1] = np.abs(k[1]) + 1.0
    bounds = ref.split_bounds(n, 4, 16)  # 3 tiles: splits of 16, 16, 13 keys and an empty one
    want_o, want_l = ref.split_partials(q, k, v, bounds)
    o, lse, fell = ref.async_partials(q, k, v, bounds, 0.0, ASYNC_WINDOW_WIDE)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_l, rtol=1e-12)
    assert fell.tolist() == [[False] * 4, [True, True, True, False]]  # 50 nats = 72 binades > 60
    _, _, fell = ref.async_partials(q[:4], k[:1], v[:1], bounds, 0.0, ASYNC_WINDOW_FP16)
    assert not fell.any()  # N(0, 1) scores: a split's max is within [-4.2, 10.4] nats of 0
