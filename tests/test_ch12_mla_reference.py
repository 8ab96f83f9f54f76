"""Chapter 12's NumPy reference: the naive form of multi-head latent attention (decompress K
and V, ordinary attention) and the absorbed form (``W_UK`` in the query, ``W_UV`` after the
output, attention over the latent rows) compute the same function, for fresh seeds and odd
sizes, with and without query compression; the paged latent decode matches the last row of
that attention. The kernels are tested against these in `test_ch12_mla_kernels.py`.
"""
import numpy as np
import pytest

from minillm.reference import ch12_mla as ref


def _dims(rng, q_lora: bool, interleave: bool = True) -> ref.MLADims:
    return ref.MLADims(hidden_size=int(rng.integers(9, 40)), num_heads=int(rng.integers(1, 6)),
                       kv_lora_rank=int(rng.integers(3, 24)), qk_nope_head_dim=int(rng.integers(1, 12)),
                       qk_rope_head_dim=2 * int(rng.integers(1, 5)), v_head_dim=int(rng.integers(1, 13)),
                       q_lora_rank=int(rng.integers(3, 20)) if q_lora else None, rope_interleave=interleave)


@pytest.mark.parametrize("q_lora", [False, True], ids=["no-q-lora", "q-lora"])
@pytest.mark.parametrize("trial", range(3))
def test_naive_equals_absorbed(q_lora, trial, seed):
    """The two forms agree to float64 rounding, causal, for random odd sizes."""
    rng = np.random.default_rng(seed + trial)
    d = _dims(rng, q_lora, interleave=bool(trial % 2))
    w = ref.random_weights(d, rng)
    T = int(rng.integers(1, 23))
    x = rng.standard_normal((T, d.hidden_size))
    naive, absorbed = ref.mla_naive(x, w, d), ref.mla_absorbed(x, w, d)
    assert naive.shape == absorbed.shape == (T, d.hidden_size)
    np.testing.assert_allclose(absorbed, naive, rtol=1e-10, atol=1e-10)


def test_causal_prefix_and_positions(seed):
    """Causality: the first T' outputs do not depend on later tokens; a later chunk at its own
    positions attends to the earlier ones exactly as the whole sequence does."""
    rng = np.random.default_rng(seed)
    d = _dims(rng, q_lora=True)
    w = ref.random_weights(d, rng)
    x = rng.standard_normal((17, d.hidden_size))
    full = ref.mla_absorbed(x, w, d)
    np.testing.assert_allclose(ref.mla_absorbed(x[:9], w, d), full[:9], rtol=1e-10, atol=1e-10)
    # The last 5 queries over all 17 latents (bottom-right causal), from the cache's point of view.
    q_nope, q_rope, c_kv, k_rope = ref.project(x, w, d, np.arange(17))
    q_abs = ref.absorb_query(q_nope[-5:], q_rope[-5:], w, d)
    o_lat, _ = ref.latent_attention(q_abs, ref.latent_cache(c_kv, k_rope), d.kv_lora_rank, d.scale)
    out = ref.latent_output(o_lat, w, d).reshape(5, -1) @ w["o_proj"].T
    np.testing.assert_allclose(out, full[-5:], rtol=1e-10, atol=1e-10)


def test_rope_is_relative_and_layout_free(seed):
    """The rotary part of a score depends on the positions' difference only, and the
    interleaved and rotate-half layouts give the same scores when q and k share the layout."""
    rng = np.random.default_rng(seed)
    dim = 8
    q, k = rng.standard_normal((1, dim)), rng.standard_normal((1, dim))
    for interleave in (False, True):
        def score(pq, pk):
            cq, sq = ref.rope_tables([pq], dim, 10000.0)
            ck, sk = ref.rope_tables([pk], dim, 10000.0)
            return (ref.apply_rope(q, cq, sq, interleave) @ ref.apply_rope(k, ck, sk, interleave).T).item()
        assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-9)
        assert score(0, 0) == pytest.approx((q @ k.T).item(), rel=1e-12)  # position 0: no rotation
    # De-interleaving permutes q and k alike: the dot product of the rotated vectors is the
    # complex-pair rotation's (DeepSeek-V2's reference code) whatever the layout.
    c, s = ref.rope_tables([5], dim, 10000.0)
    qc = (q[0, 0::2] + 1j * q[0, 1::2]) * np.exp(1j * np.arctan2(s[0], c[0]))
    kc = (k[0, 0::2] + 1j * k[0, 1::2])
    expected = float(np.real(qc * np.conj(kc)).sum())
    got = (ref.apply_rope(q, c, s, True) @ ref.apply_rope(k, *ref.rope_tables([0], dim, 1e4), True).T).item()
    assert got == pytest.approx(expected, rel=1e-9)


def test_absorbed_query_scores_equal_decompressed(seed):
    """Score by score: the absorbed query against the latent row is the decompressed head's
    query against its decompressed key."""
    rng = np.random.default_rng(seed)
    d = _dims(rng, q_lora=False)
    w = ref.random_weights(d, rng)
    x = rng.standard_normal((11, d.hidden_size))
    q_nope, q_rope, c_kv, k_rope = ref.project(x, w, d, np.arange(11))
    k, _ = ref.decompress(c_kv, k_rope, w, d)
    naive = np.einsum("thd,shd->ths", np.concatenate([q_nope, q_rope], -1), k)
    absorbed = np.einsum("thw,sw->ths", ref.absorb_query(q_nope, q_rope, w, d), ref.latent_cache(c_kv, k_rope))
    np.testing.assert_allclose(absorbed, naive, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_latent_decode(block_size, seed):
    """The paged decode (one query per sequence, blocks in any order) equals latent attention
    over each sequence's rows; a length-0 sequence gives zeros and -inf."""
    rng = np.random.default_rng(seed)
    B, H, r, dr = 4, 3, 10, 4
    lens = [int(rng.integers(1, 40)) for _ in range(B - 1)] + [0]
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = B * max_blocks + 2
    cache = rng.standard_normal((num_blocks, block_size, 1, r + dr))
    tables = np.full((B, max_blocks), -1)
    perm = rng.permutation(num_blocks)
    for b, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[b, :nb] = perm[b * max_blocks: b * max_blocks + nb]
    q = rng.standard_normal((B, H, r + dr))
    out, lse = ref.paged_latent_decode(q, cache, tables, lens, r, 0.3)
    for b, n in enumerate(lens[:-1]):
        pos = np.arange(n)
        rows = cache[tables[b][pos // block_size], pos % block_size, 0]
        o, l = ref.latent_attention(q[b:b + 1], rows, r, 0.3, causal=False)
        np.testing.assert_allclose(out[b], o[0], rtol=1e-12)
        np.testing.assert_allclose(lse[b], l[0], rtol=1e-12)
    assert np.all(out[-1] == 0) and np.all(lse[-1] == -np.inf)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate-half"])
def test_latent_cache_write(interleave, seed):
    """The cache write stores `project`'s latent rows ``[c_kv ; k_rope]`` (normed, rotated)
    at the tokens' slots, skips slot -1 and leaves every other row (and its input) as it was."""
    rng = np.random.default_rng(seed)
    d = _dims(rng, q_lora=False, interleave=interleave)
    w = ref.random_weights(d, rng)
    n, num_blocks, block_size = 7, 5, 3
    x = rng.standard_normal((n, d.hidden_size))
    positions = rng.integers(0, 300, n)
    cache = np.full((num_blocks, block_size, 1, d.latent_dim), np.nan)
    slots = rng.permutation(num_blocks * block_size)[:n]
    slots[rng.integers(0, n)] = -1
    cos, sin = ref.rope_tables(positions, d.qk_rope_head_dim, d.rope_theta)
    out = ref.latent_cache_write(cache, x @ w["kv_a_proj_with_mqa"].T, slots, d.kv_lora_rank, cos, sin,
                                 w["kv_a_layernorm"], d.rms_norm_eps, interleave)
    _, _, c_kv, k_rope = ref.project(x, w, d, positions)
    flat, keep = out.reshape(-1, d.latent_dim), slots >= 0
    np.testing.assert_allclose(flat[slots[keep]], ref.latent_cache(c_kv, k_rope)[keep], rtol=1e-12, atol=1e-12,
                               err_msg=f"seed={seed}")
    untouched = np.setdiff1d(np.arange(flat.shape[0]), slots[keep])
    assert np.isnan(flat[untouched]).all() and np.isnan(cache).all(), f"seed={seed}"
