"""Graded tests for Chapter 2 (the KV cache). Run: `make grade CH=2`.

Each test is marked with the exercise it grades; an exercise scores its points only if all
of its tests pass. Inputs are random with a fresh seed each run (the seed is in every
failure message; pin it with ``MINILLM_SEED``).
"""
import numpy as np
import pytest
import torch

from minillm import costs
from minillm import reference as ref
from minillm.testing import assert_close, random_tensor, to_numpy

write_ex = pytest.mark.exercise(id="2.1", title="Writing to the cache", points=2)
decode_ex = pytest.mark.exercise(id="2.2", title="Decode with the cache equals recompute", points=3)
budget_ex = pytest.mark.exercise(id="2.3", title="Cache size and the largest batch", points=2)
ring_ex = pytest.mark.exercise(id="2.4", title="The sliding-window ring buffer", points=3)
cache_write_kernel_ex = pytest.mark.exercise(id="2.5", title="The cache-write kernel in Triton", points=2, kind="triton")
decode_kernel_ex = pytest.mark.exercise(id="2.6", title="The decode-attention kernel in Triton", points=3, kind="triton")


def poisoned_cache(rng, kv_heads, capacity, head_dim, filled):
    """A cache whose first ``filled`` slots hold random data and the rest NaN (never written)."""
    cache = np.full((kv_heads, capacity, head_dim), np.nan)
    cache[:, :filled] = rng.standard_normal((kv_heads, filled, head_dim))
    return cache


# --- 2.1 -------------------------------------------------------------------------------------

@write_ex
@pytest.mark.parametrize("trial", range(4))
def test_write_random(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    kv_heads, head_dim, capacity = int(rng.integers(1, 5)), int(rng.integers(1, 17)), int(rng.integers(2, 40))
    start = int(rng.integers(0, capacity))
    T = 1 if trial == 0 else int(rng.integers(1, capacity - start + 1))      # trial 0: a decode step
    ck, cv = (poisoned_cache(rng, kv_heads, capacity, head_dim, start) for _ in range(2))
    old_k, old_v = ck.copy(), cv.copy()
    k_new, v_new = rng.standard_normal((2, kv_heads, T, head_dim))
    k, v = impl.kv_cache_write(ck, cv, k_new, v_new, start)
    msg = f"start={start} T={T} capacity={capacity} seed={seed + trial}"
    assert k.shape == v.shape == (kv_heads, start + T, head_dim), msg
    np.testing.assert_array_equal(k, np.concatenate([old_k[:, :start], k_new], axis=1), err_msg=msg)
    np.testing.assert_array_equal(v, np.concatenate([old_v[:, :start], v_new], axis=1), err_msg=msg)
    # in place: the new rows are in the cache itself, the slots after them still unwritten
    np.testing.assert_array_equal(ck[:, start:start + T], k_new, err_msg="write into cache_k in place")
    np.testing.assert_array_equal(cv[:, start:start + T], v_new, err_msg="write into cache_v in place")
    assert np.isnan(ck[:, start + T:]).all() and np.isnan(cv[:, start + T:]).all(), "slots past the end were written"
    assert np.shares_memory(k, ck) and np.shares_memory(v, cv), "return views of the cache, not copies"


@write_ex
def test_write_token_by_token_builds_the_sequence(impl, seed):
    rng = np.random.default_rng(seed)
    k_all, v_all = rng.standard_normal((2, 2, 9, 4))
    ck, cv = np.zeros((2, 12, 4)), np.zeros((2, 12, 4))
    impl.kv_cache_write(ck, cv, k_all[:, :4], v_all[:, :4], 0)                  # prefill 4
    for t in range(4, 9):                                                      # then decode
        k, v = impl.kv_cache_write(ck, cv, k_all[:, t:t + 1], v_all[:, t:t + 1], t)
        np.testing.assert_array_equal(k, k_all[:, :t + 1])
        np.testing.assert_array_equal(v, v_all[:, :t + 1])


@write_ex
def test_write_full_cache_raises(impl):
    ck, cv = np.zeros((1, 5, 2)), np.zeros((1, 5, 2))
    with pytest.raises(ValueError):
        impl.kv_cache_write(ck, cv, np.ones((1, 3, 2)), np.ones((1, 3, 2)), 3)


# --- 2.2 -------------------------------------------------------------------------------------

@decode_ex
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 3), (5, 1)])
def test_decode_equals_recompute(impl, heads, kv_heads, seed):
    rng = np.random.default_rng(seed)
    L, D = int(rng.integers(8, 30)), int(rng.choice([4, 8, 16]))
    q = rng.standard_normal((heads, L, D))
    k, v = rng.standard_normal((2, kv_heads, L, D))
    want, _ = ref.attention(q[None], k[None], v[None], causal=True)            # recompute everything
    prefill = int(rng.integers(0, L))                                          # 0: start from empty
    ck, cv = (poisoned_cache(rng, kv_heads, L + 3, D, 0) for _ in range(2))
    ck[:, :prefill], cv[:, :prefill] = k[:, :prefill], v[:, :prefill]
    for t in range(prefill, L):
        out = impl.decode_step(q[:, t], k[:, t], v[:, t], ck, cv, t)
        assert out.shape == (heads, D)
        np.testing.assert_allclose(out, want[0, :, t], atol=1e-12, err_msg=f"position {t}, seed {seed}")
    np.testing.assert_array_equal(ck[:, :L], k, err_msg="each step must store its key in slot pos")
    np.testing.assert_array_equal(cv[:, :L], v, err_msg="each step must store its value in slot pos")
    assert np.isnan(ck[:, L:]).all(), "slots past pos must stay untouched"


@decode_ex
def test_decode_scale_and_large_scores(impl, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((4, 8))
    k, v = rng.standard_normal((2, 2, 6, 8))
    ck, cv = np.zeros((2, 6, 8)), np.zeros((2, 6, 8))
    ck[:, :5], cv[:, :5] = k[:, :5], v[:, :5]
    # scale=1000: scores in the thousands, where exp overflows float64 (past ~709)
    out = impl.decode_step(q, k[:, 5], v[:, 5], ck, cv, 5, scale=1000.0)
    want, _ = ref.attention(q[None, :, None], k[None], v[None], causal=True, scale=1000.0)
    assert np.isfinite(out).all(), "subtract the max before exp"
    np.testing.assert_allclose(out, want[0, :, 0], atol=1e-10, err_msg=f"seed {seed}")


# --- 2.3 -------------------------------------------------------------------------------------

@budget_ex
@pytest.mark.parametrize("name", list(costs.MODELS))
def test_bytes_per_token_real_models(impl, name):
    s = costs.MODELS[name]
    for dtype_bytes in (1, 2, 4):
        assert impl.kv_bytes_per_token(s.layers, s.kv_heads, s.head_dim, dtype_bytes) == \
            costs.kv_bytes_per_token(s, dtype_bytes), f"{name}, {dtype_bytes}-byte elements"
    assert impl.kv_bytes_per_token(s.layers, s.kv_heads, s.head_dim) == costs.kv_bytes_per_token(s), \
        "dtype_bytes defaults to 2 (fp16/bf16)"


@budget_ex
def test_bytes_per_token_known_values(impl):
    assert impl.kv_bytes_per_token(32, 32, 128, 2) == 512 * 1024     # Llama-2-7B: 0.5 MiB per token
    assert impl.kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024      # Llama-3-8B: GQA cuts it 4x


@budget_ex
@pytest.mark.parametrize("trial", range(6))
def test_bytes_per_token_random_shapes(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    kv_heads = int(rng.integers(1, 17))
    s = costs.ModelShape("random", layers=int(rng.integers(1, 100)), hidden=64, heads=kv_heads * int(rng.integers(1, 9)),
                         kv_heads=kv_heads, head_dim=int(rng.integers(1, 257)), intermediate=128, vocab=100)
    dtype_bytes = int(rng.choice([1, 2, 4]))
    assert impl.kv_bytes_per_token(s.layers, s.kv_heads, s.head_dim, dtype_bytes) == \
        costs.kv_bytes_per_token(s, dtype_bytes), f"{s}, dtype_bytes={dtype_bytes}"


def _assert_max_batch(got, mem, M, alpha, beta, ctx, msg):
    assert isinstance(got, (int, np.integer)), f"return an int, got {type(got).__name__}"
    assert got == costs.max_batch(mem, M, alpha, beta, ctx), msg
    if got > 0:  # the defining property: BS fits, BS + 1 does not
        assert costs.memory_needed(M, alpha, beta, got, got * ctx) <= mem, msg
    assert costs.memory_needed(M, alpha, beta, got + 1, (got + 1) * ctx) > mem, msg


@budget_ex
@pytest.mark.parametrize("name", list(costs.MODELS))
@pytest.mark.parametrize("context", [512, 4096, 32768])
def test_max_batch_real_models(impl, name, context):
    s = costs.MODELS[name]
    mem = 80 * 2**30                                                            # an 80 GB GPU
    M, alpha, beta = s.weight_bytes(2), costs.decode_temp_bytes_per_seq(s), costs.kv_bytes_per_token(s)
    _assert_max_batch(impl.max_batch(mem, M, alpha, beta, context), mem, M, alpha, beta, context,
                      f"{name}, context {context}")


@budget_ex
@pytest.mark.parametrize("trial", range(8))
def test_max_batch_random(impl, trial, seed):
    rng = np.random.default_rng(seed + trial)
    mem = int(rng.integers(10**6, 10**12))
    M = int(rng.integers(0, 2 * mem)) if trial else mem + 1                   # trial 0: weights do not fit
    alpha, beta, ctx = int(rng.integers(1, 10**6)), int(rng.integers(1, 10**6)), int(rng.integers(1, 10**5))
    _assert_max_batch(impl.max_batch(mem, M, alpha, beta, ctx), mem, M, alpha, beta, ctx,
                      f"mem={mem} M={M} alpha={alpha} beta={beta} context={ctx}")


@budget_ex
def test_max_batch_exact_fit(impl):
    # 1000 bytes free, each sequence costs 10 + 2·45 = 100: exactly 10 fit (the budget is ≤)
    assert impl.max_batch(1500, 500, 10, 2, 45) == 10
    assert impl.max_batch(1499, 500, 10, 2, 45) == 9
    assert impl.max_batch(500, 500, 10, 2, 45) == 0


# --- 2.4 -------------------------------------------------------------------------------------

@ring_ex
def test_ring_slot(impl):
    assert [impl.ring_slot(p, 4) for p in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert impl.ring_slot(np.arange(7), 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert impl.ring_slot(5, 100) == 5, "a window longer than the sequence never wraps"


@ring_ex
def test_ring_read_known_order(impl):
    # Key 0 of each slot records the position written there: 6 tokens in 4 slots.
    ring_k = np.array([4.0, 5.0, 2.0, 3.0])[None, :, None]
    k, v = impl.ring_read(ring_k, -ring_k, 6)
    assert k[0, :, 0].tolist() == [2, 3, 4, 5], "oldest first: position order, not slot order"
    assert v[0, :, 0].tolist() == [-2, -3, -4, -5]
    k, _ = impl.ring_read(np.array([0.0, 1.0, 9.0, 9.0])[None, :, None], np.zeros((1, 4, 1)), 2)
    assert k[0, :, 0].tolist() == [0, 1], "before the ring fills, only the written slots count"


@ring_ex
@pytest.mark.parametrize("window", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)])
def test_ring_equals_windowed_attention(impl, window, heads, kv_heads, seed):
    rng = np.random.default_rng(seed)
    L, D = int(rng.integers(20, 40)), 8
    q = rng.standard_normal((1, heads, L, D))
    k, v = rng.standard_normal((2, kv_heads, L, D))
    want, _ = ref.attention(q, k[None], v[None], causal=True, window=window)
    ring_k, ring_v = np.full((kv_heads, window, D), np.nan), np.full((kv_heads, window, D), np.nan)
    for t in range(L):                                              # decode token t, W slots only
        slot = impl.ring_slot(t, window)
        ring_k[:, slot], ring_v[:, slot] = k[:, t], v[:, t]
        k_vis, v_vis = impl.ring_read(ring_k, ring_v, t + 1)
        held = slice(max(0, t + 1 - window), t + 1)
        np.testing.assert_array_equal(k_vis, k[:, held], err_msg=f"keys after position {t}, window {window}")
        np.testing.assert_array_equal(v_vis, v[:, held], err_msg=f"values after position {t}, window {window}")
        out, _ = ref.attention(q[:, :, t:t + 1], k_vis[None], v_vis[None], causal=True, window=window)
        np.testing.assert_allclose(out[0, :, 0], want[0, :, t], atol=1e-12, err_msg=f"position {t}, seed {seed}")


# --- 2.5 and 2.6: Triton kernels over a batched cache -------------------------------------------

def batched_cache(batch, kv_heads, max_len, head_dim, dtype, device, gen, token_major=False):
    """A random cache ``[batch, kv_heads, max_len, head_dim]``; ``token_major``: stored as
    ``[batch, max_len, kv_heads, head_dim]`` and viewed with heads second (other strides)."""
    if token_major:
        return random_tensor((batch, max_len, kv_heads, head_dim), dtype, device, gen).transpose(1, 2)
    return random_tensor((batch, kv_heads, max_len, head_dim), dtype, device, gen)


@cache_write_kernel_ex
@pytest.mark.parametrize("batch,kv_heads,max_len,head_dim,token_major", [
    (1, 1, 1, 16, False),
    (3, 2, 9, 24, False),   # head_dim not a power of two: the padding lanes must not spill
    (4, 3, 17, 32, True),   # token-major cache: the strides, not the shape, say where a slot is
])
def test_cache_write_kernel(impl, batch, kv_heads, max_len, head_dim, token_major, dtype, device, gen, seed):
    k_cache = batched_cache(batch, kv_heads, max_len, head_dim, dtype, device, gen, token_major)
    v_cache = batched_cache(batch, kv_heads, max_len, head_dim, dtype, device, gen, token_major)
    k_new = random_tensor((batch, kv_heads, head_dim), dtype, device, gen)
    v_new = random_tensor((batch, kv_heads, head_dim), dtype, device, gen)
    pos = torch.randint(0, max_len, (batch,), generator=gen, dtype=torch.int32)
    if batch > 1:
        pos[1] = -1  # a padding row: nothing may be written for it
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        if pos[b] >= 0:
            want_k[b, :, pos[b]] = k_new[b]
            want_v[b, :, pos[b]] = v_new[b]
    impl.cache_write(k_cache, v_cache, k_new, v_new, pos.to(device))
    for name, got, want in (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)):
        bad = (got != want).nonzero()
        assert len(bad) == 0, (f"{name}: {len(bad)} elements differ after the write, first at {tuple(bad[0].tolist())} "
                               f"(pos = {pos.tolist()}); reproduce with MINILLM_SEED={seed}")


@decode_kernel_ex
@pytest.mark.parametrize("batch,q_heads,kv_heads,max_len,head_dim", [
    (1, 1, 1, 1, 16),
    (3, 4, 4, 37, 32),   # MHA
    (2, 6, 2, 50, 24),   # GQA, 3 query heads per KV head; head_dim not a power of two
    (2, 7, 1, 20, 16),   # MQA: every query head reads KV head 0
])
def test_decode_kernel(impl, batch, q_heads, kv_heads, max_len, head_dim, dtype, device, gen, seed):
    q = random_tensor((batch, q_heads, head_dim), dtype, device, gen)
    k_cache = batched_cache(batch, kv_heads, max_len, head_dim, dtype, device, gen)
    v_cache = batched_cache(batch, kv_heads, max_len, head_dim, dtype, device, gen)
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=gen, dtype=torch.int32)
    seq_lens[-1] = max_len  # one sequence fills its cache
    if batch > 2:
        seq_lens[0] = 0     # an empty sequence: output 0
    for b in range(batch):  # slots past a sequence's end hold garbage: NaN, which must not leak in
        k_cache[b, :, int(seq_lens[b]):] = float("nan")
        v_cache[b, :, int(seq_lens[b]):] = float("nan")
    scale = None if seed % 2 else 0.3
    out = impl.decode_attention(q, k_cache, v_cache, seq_lens.to(device), scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    want = np.zeros((batch, q_heads, head_dim))
    for b in range(batch):
        n = int(seq_lens[b])
        if n:
            o, _ = ref.attention(to_numpy(q[b, :, None])[None], to_numpy(k_cache[b, :, :n])[None],
                                 to_numpy(v_cache[b, :, :n])[None], scale=scale)
            want[b] = o[0, :, 0]
    assert_close(out, want, dtype, f"out (seq_lens {seq_lens.tolist()}, scale {scale})", seed)
