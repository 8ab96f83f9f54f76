"""Graded tests for Chapter 12 (multi-head latent attention). Run: `make grade CH=12`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import math

import numpy as np
import pytest
import torch

from minillm.reference import ch12_mla as ref
from minillm.testing import assert_close, poisoned, random_tensor, skip_fp32_on_gpu, to_numpy

absorbed_ex = pytest.mark.exercise(id="12.1", title="Attention over the latent cache (absorbed form)", points=3)
scores_kernel_ex = pytest.mark.exercise(id="12.2", title="The absorbed scores in Triton", points=3, kind="triton")
cache_write_ex = pytest.mark.exercise(id="12.3", title="The latent cache write in Triton", points=3, kind="triton")


def _layer(rng, q_lora: bool):
    d = ref.MLADims(hidden_size=int(rng.integers(9, 33)), num_heads=int(rng.integers(1, 6)),
                    kv_lora_rank=int(rng.integers(3, 20)), qk_nope_head_dim=int(rng.integers(1, 10)),
                    qk_rope_head_dim=2 * int(rng.integers(1, 5)), v_head_dim=int(rng.integers(1, 11)),
                    q_lora_rank=int(rng.integers(3, 16)) if q_lora else None)
    return d, ref.random_weights(d, rng)


# --- 12.1 ------------------------------------------------------------------------------------

@absorbed_ex
@pytest.mark.parametrize("trial", range(4))
def test_absorbed_equals_decompressed(impl, trial, seed):
    """The whole sequence's queries (T = S), causal: equal to the decompressed heads' attention."""
    rng = np.random.default_rng(seed + trial)
    d, w = _layer(rng, q_lora=bool(trial % 2))
    S = int(rng.integers(1, 20))
    x = rng.standard_normal((S, d.hidden_size))
    q_nope, q_rope, c_kv, k_rope = ref.project(x, w, d, np.arange(S))
    got = impl.absorbed_attention(q_nope, q_rope, ref.latent_cache(c_kv, k_rope), w["kv_b_proj"], d.v_head_dim,
                                  d.scale)
    k, v = ref.decompress(c_kv, k_rope, w, d)
    scores = np.einsum("thd,shd->ths", np.concatenate([q_nope, q_rope], -1), k) * d.scale
    scores = np.where(np.tril(np.ones((S, S), bool))[:, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("ths,shd->thd", p / p.sum(-1, keepdims=True), v)
    assert got.shape == (S, d.num_heads, d.v_head_dim), "[T, H, v_head_dim]"
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-11, err_msg=f"seed={seed + trial}")


@absorbed_ex
def test_absorbed_chunk_after_prefix(impl, seed):
    """The last T queries over all S rows (bottom-right causal): the rows of the whole layer's
    absorbed reference for those positions."""
    rng = np.random.default_rng(seed)
    d, w = _layer(rng, q_lora=True)
    S, T = 15, 4
    x = rng.standard_normal((S, d.hidden_size))
    q_nope, q_rope, c_kv, k_rope = ref.project(x, w, d, np.arange(S))
    got = impl.absorbed_attention(q_nope[-T:], q_rope[-T:], ref.latent_cache(c_kv, k_rope), w["kv_b_proj"],
                                  d.v_head_dim, d.scale)
    expected = ref.mla_naive(x, w, d)[-T:]
    np.testing.assert_allclose(got.reshape(T, -1) @ w["o_proj"].T, expected, rtol=1e-9, atol=1e-11,
                               err_msg=f"seed={seed}: query t of T sits at position S - T + t")


# --- 12.2 ------------------------------------------------------------------------------------

@scores_kernel_ex
@pytest.mark.parametrize("heads,r,rope,seq_len", [(3, 24, 8, 37), (16, 32, 16, 16), (5, 40, 4, 1), (20, 16, 2, 50)])
def test_absorbed_scores_kernel(impl, heads, r, rope, seq_len, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    q = random_tensor((heads, r + rope), dtype, device, gen)
    rows = random_tensor((seq_len, r + rope), dtype, device, gen)
    scale = 1.0 / math.sqrt(r + rope)
    got = impl.absorbed_scores(q, rows, r, scale)
    expected = to_numpy(q) @ to_numpy(rows).T * scale
    assert got.shape == (heads, seq_len) and got.dtype == torch.float32
    assert_close(got, expected, dtype, "scores", seed)


@scores_kernel_ex
def test_absorbed_scores_strided(impl, device, gen, seed):
    """Rows and queries that are views with padding between rows (the launcher makes them
    contiguous, the kernel must use the strides it is given)."""
    dtype = torch.float16
    wide = random_tensor((29, 64), dtype, device, gen)
    rows, q = wide[:, :40], random_tensor((6, 48), dtype, device, gen)[:, 8:]
    got = impl.absorbed_scores(q, rows, 32, 0.2, block_n=32)
    assert_close(got, to_numpy(q) @ to_numpy(rows).T * 0.2, dtype, "scores", seed)


# --- 12.3 ------------------------------------------------------------------------------------

def _write_case(r, rope, block_size, num_blocks, n, dtype, device, gen, rng, pool_shape=None):
    """A NaN pool with a NaN guard block on each side, new tokens' raw rows (one latent tiny,
    where ``eps`` matters), shuffled slots with some -1, the norm weight and fp32 RoPE tables."""
    guarded = poisoned((num_blocks + 2, block_size) + (pool_shape or (1, r + rope)), dtype, device)
    kv = random_tensor((n, r + rope), dtype, device, gen)
    kv[int(rng.integers(0, n)), :r] *= 1e-3
    weight = (1 + 0.1 * random_tensor((r,), torch.float64, "cpu", gen)).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[torch.from_numpy(rng.choice(n, size=max(1, n // 4), replace=False))] = -1
    cos, sin = ref.rope_tables(rng.integers(0, 500, n), rope, 10000.0)           # [n, rope/2]
    return guarded, kv, weight, slots, cos, sin


def _check_written(guarded, kv, weight, slots, cos, sin, r, interleave, dtype, seed):
    width, bs = kv.shape[1], guarded.shape[1]
    rows = guarded.reshape(-1, guarded.shape[-1])                                 # guard block first
    expected = ref.latent_cache_write(np.full((guarded.shape[0] - 2, bs, width), np.nan), to_numpy(kv), slots.numpy(),
                                      r, cos, sin, to_numpy(weight), 1e-6, interleave).reshape(-1, width)
    done = slots[slots >= 0]
    assert_close(rows[done + bs, :width], expected[done], dtype, "written rows [c_kv normed ; k_pe rotated]", seed)
    others = sorted(set(range(rows.shape[0])) - set((done + bs).tolist()))
    assert torch.isnan(rows[others]).all() and torch.isnan(rows[:, width:]).all(), \
        f"seed={seed}: a row without a new token (slot -1, another slot, outside the pool) or a padding was written"


@cache_write_ex
@pytest.mark.parametrize("r,rope,block_size,num_blocks,n,interleave",
                         [(24, 8, 4, 6, 9, True), (13, 6, 3, 7, 11, True), (5, 2, 1, 12, 7, False),
                          (40, 16, 16, 2, 5, False)])
def test_latent_cache_write_kernel(impl, r, rope, block_size, num_blocks, n, interleave, dtype, device, gen, seed):
    """Odd widths, interleaved and rotate-half input pairs, blocks of 1 to 16, shuffled slots
    with some -1: the written rows equal the reference, every other row (the guard blocks
    around the pool included) stays NaN."""
    skip_fp32_on_gpu(dtype, device)
    rng = np.random.default_rng(seed)
    guarded, kv, weight, slots, cos, sin = _write_case(r, rope, block_size, num_blocks, n, dtype, device, gen, rng)
    impl.latent_cache_write(guarded[1:-1], kv, slots.to(device), r, torch.from_numpy(cos).to(device),
                            torch.from_numpy(sin).to(device), weight, 1e-6, interleave)
    _check_written(guarded, kv, weight, slots, cos, sin, r, interleave, dtype, seed)


@cache_write_ex
def test_latent_cache_write_strided_pool(impl, device, gen, seed):
    """A 3-D pool whose rows are padded (row stride W + 5, as a view of a wider buffer): the
    kernel must address rows with the strides it is given; the padding stays NaN."""
    dtype = torch.float16
    rng = np.random.default_rng(seed)
    r, rope, block_size, num_blocks, n = 19, 4, 5, 4, 8
    guarded, kv, weight, slots, cos, sin = _write_case(r, rope, block_size, num_blocks, n, dtype, device, gen, rng,
                                                       pool_shape=(r + rope + 5,))
    impl.latent_cache_write(guarded[1:-1, :, :r + rope], kv, slots.to(device), r, torch.from_numpy(cos).to(device),
                            torch.from_numpy(sin).to(device), weight, 1e-6, True)
    _check_written(guarded, kv, weight, slots, cos, sin, r, True, dtype, seed)
