"""Chapter 10's fused kernels (`minillm.kernels.ch10_fused_decode`) against their NumPy
references (`minillm.reference.ch10_fused_decode`) and against the torch model's own ops.

CPU: the interpreter, fp32 and fp16; GPU: fp32, fp16 and bf16 (`minillm.testing.kernel_dtypes`).
Outputs are poisoned (NaN) before the launch; the caches are NaN except the slots written, so
a write to a wrong slot, or one that is missing, shows.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import math

from minillm.kernels.ch08_flat_gemm import TileConfig
from minillm.kernels.ch10_fused_decode import (add_rmsnorm, add_rmsnorm_gemv, add_rmsnorm_gemv_rope, decode_gemv,
                                               rope_write_kv, silu_mul, silu_mul_gemv)
from minillm.model.torch_model import RMSNorm, apply_rope, rope_cos_sin
from minillm.reference import ch10_fused_decode as ref
from minillm.testing import (assert_close, default_device, fresh_seed, kernel_dtypes, poisoned, random_tensor,
                             to_numpy)

DEVICE = default_device()
DTYPES = kernel_dtypes(DEVICE)


def ulps(dtype) -> float:
    """One unit in the last place at 1.0 (the slack of "the same rounding, a different order")."""
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hidden", [(1, 64), (5, 96), (3, 1000)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_reference(dtype, T, hidden, with_residual):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = random_tensor((T, hidden), dtype, DEVICE, gen)
    r = random_tensor((T, hidden), dtype, DEVICE, gen) if with_residual else None
    w = random_tensor((hidden,), dtype, DEVICE, gen, scale=0.5) + 1
    out = poisoned((T, hidden), dtype, DEVICE)
    res_out = poisoned((T, hidden), dtype, DEVICE) if with_residual else None
    y, new_r = add_rmsnorm(x, r, w, 1e-5, out=out, residual_out=res_out)
    want_y, want_r = ref.add_rmsnorm(to_numpy(x), None if r is None else to_numpy(r), to_numpy(w), 1e-5)
    assert y is out
    assert_close(y, want_y, dtype, "y", seed)
    assert_close(new_r, want_r, dtype, "residual", seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_rounds_as_the_model(dtype):
    """The fused kernel equals ``RMSNorm(x + r)`` of the torch model to within an ulp."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    T, hidden = 7, 256
    x, r = random_tensor((T, hidden), dtype, DEVICE, gen), random_tensor((T, hidden), dtype, DEVICE, gen)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(random_tensor((hidden,), dtype, DEVICE, gen, scale=0.3) + 1)
        s = x + r
        want = norm(s)
    y, new_r = add_rmsnorm(x, r, norm.weight.detach(), 1e-6)
    assert torch.equal(new_r, s)
    # fp32 on a GPU: torch's norm and the kernel sum 256 squares in different orders and take
    # rsqrt differently (the kernel's is the hardware approximation), so a few ulps apart.
    slack = 4 * ulps(dtype) if dtype == torch.float32 and DEVICE.type == "cuda" else 2 * ulps(dtype)
    torch.testing.assert_close(y, want, atol=slack, rtol=slack)


def test_add_rmsnorm_in_place_residual_and_strided_rows():
    gen = torch.Generator().manual_seed(fresh_seed())
    big = random_tensor((4, 2, 64), torch.float32, DEVICE, gen)
    x = big[:, 0]                                       # rows two apart
    r = random_tensor((4, 64), torch.float32, DEVICE, gen)
    w = torch.ones(64, device=DEVICE)
    want_y, want_r = ref.add_rmsnorm(to_numpy(x), to_numpy(r), to_numpy(w), 1e-5)
    y, new_r = add_rmsnorm(x, r, w, 1e-5, residual_out=r)
    assert new_r is r
    assert_close(r, want_r, torch.float32, "residual")
    assert_close(y, want_y, torch.float32, "y")
    with pytest.raises(ValueError):
        add_rmsnorm(x, r, torch.ones(63, device=DEVICE), 1e-5)


def _merged_qkv(T, H, Hkv, D, dtype, gen):
    """q, k, v as strided views of one ``[T, (H + 2 Hkv) D]`` tensor: the merged projection's
    output, exactly what the fused model hands the kernel."""
    qkv = random_tensor((T, (H + 2 * Hkv) * D), dtype, DEVICE, gen)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hkv,D,block_size", [(1, 4, 2, 16, 4), (6, 4, 1, 64, 16), (5, 6, 3, 24, 3)])
def test_rope_write_kv_matches_reference(dtype, T, H, Hkv, D, block_size):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_blocks = T + 3
    qkv, q, k, v = _merged_qkv(T, H, Hkv, D, dtype, gen)
    positions = torch.as_tensor(rng.integers(0, 4000, T), device=DEVICE)
    cos, sin = rope_cos_sin(positions, D, 10000.0, dtype)
    slots = rng.permutation(num_blocks * block_size)[:T]
    if T > 2:
        slots[1] = -1                                    # padding: nothing written
    slot_mapping = torch.as_tensor(slots, device=DEVICE, dtype=torch.int64)
    k_cache = poisoned((num_blocks, block_size, Hkv, D), dtype, DEVICE)
    v_cache = poisoned((num_blocks, block_size, Hkv, D), dtype, DEVICE)
    q_before = qkv.clone()
    q_out = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    assert torch.equal(qkv, q_before), "the inputs must not change"
    want_q, want_k, want_v = ref.rope_write_kv(to_numpy(q), to_numpy(k), to_numpy(v), to_numpy(cos), to_numpy(sin),
                                               to_numpy(k_cache), to_numpy(v_cache), slots)
    assert q_out.shape == (T, H, D) and q_out.is_contiguous()
    assert_close(q_out, want_q, dtype, "q", seed)
    written = [s for s in slots if s >= 0]
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    assert_close(flat_k[written], want_k.reshape(-1, Hkv, D)[written], dtype, "k cache", seed)
    assert_close(flat_v[written], want_v.reshape(-1, Hkv, D)[written], dtype, "v cache", seed)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.isnan(flat_k[untouched.to(DEVICE)]).all() and torch.isnan(flat_v[untouched.to(DEVICE)]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_the_models_rotary_and_cache_write(dtype):
    """Against the model's own ``apply_rope`` and `write_kv` (HF's rotate-half layout, the
    model's rope_theta): equal up to an ulp (the angles are the same tensor)."""
    from minillm.model.paged import write_kv

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    T, H, Hkv, D, bs = 5, 8, 2, 32, 4
    _, q, k, v = _merged_qkv(T, H, Hkv, D, dtype, gen)
    positions = torch.arange(100, 100 + T, device=DEVICE)
    cos, sin = rope_cos_sin(positions, D, 500000.0, dtype)
    want_q, want_k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])

    class Pool:  # the two attributes write_kv reads
        kernels = None
        k = [torch.zeros(3, bs, Hkv, D, device=DEVICE, dtype=dtype)]
        v = [torch.zeros(3, bs, Hkv, D, device=DEVICE, dtype=dtype)]
    slots = torch.tensor([0, 5, 6, 11, 2], device=DEVICE)
    write_kv(Pool, 0, want_k, v, slots)
    k_cache, v_cache = torch.zeros_like(Pool.k[0]), torch.zeros_like(Pool.v[0])
    got_q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    tol = dict(atol=2 * ulps(dtype), rtol=2 * ulps(dtype))
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(k_cache, Pool.k[0], **tol)
    assert torch.equal(v_cache, Pool.v[0])


def test_rope_write_kv_in_place_and_checks():
    gen = torch.Generator().manual_seed(fresh_seed())
    T, H, Hkv, D = 3, 2, 1, 8
    q = random_tensor((T, H, D), torch.float32, DEVICE, gen)
    k = random_tensor((T, Hkv, D), torch.float32, DEVICE, gen)
    cos, sin = rope_cos_sin(torch.arange(T, device=DEVICE), D, 10000.0, torch.float32)
    cache = torch.zeros(2, 4, Hkv, D, device=DEVICE)
    want = ref.rotary(to_numpy(q), to_numpy(cos), to_numpy(sin))
    out = rope_write_kv(q, k, k.clone(), cos, sin, cache, cache.clone(), torch.tensor([0, 1, 2], device=DEVICE),
                        q_out=q)
    assert out is q
    assert_close(q, want, torch.float32, "q in place")
    with pytest.raises(ValueError):
        rope_write_kv(q, k, k, cos[:, :4], sin, cache, cache, torch.zeros(T, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 64), (4, 352), (3, 2500)])
def test_silu_mul_matches_reference_and_the_model(dtype, T, inter):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    gate_up = random_tensor((T, 2 * inter), dtype, DEVICE, gen, scale=2.0)
    out = poisoned((T, inter), dtype, DEVICE)
    got = silu_mul(gate_up, out=out)
    assert got is out
    assert_close(got, ref.silu_mul(to_numpy(gate_up)), dtype, "silu_mul", seed)
    g, u = gate_up.chunk(2, dim=-1)
    want = F.silu(g) * u
    torch.testing.assert_close(got, want, atol=2 * ulps(dtype), rtol=2 * ulps(dtype))


# ----------------------------------------------------------------------------------------
# The GEMV with add_rmsnorm / silu_mul folded in
# ----------------------------------------------------------------------------------------
#: (M, N, K, split_k, rows per program): ragged N and K tiles, several programs along M (the
#: last one short), split-K runs (the CPU tile is 32 x 64: K = 200 is 4 tiles).
GEMV_CASES = [(1, 96, 72, 1, 1), (3, 100, 200, 3, 2), (5, 33, 64, 1, 16), (2, 70, 130, 2, 2)]


@pytest.fixture
def untuned(monkeypatch):
    """On a GPU, one config per kernel variant (Chapter 8's first GEMV tile) instead of timing
    every candidate for every test shape."""
    monkeypatch.setenv("MINILLM_FLAT_GEMM_AUTOTUNE", "0")


def gemv_config(M, split_k, rows):
    """A small tile on the interpreter; the GPU's own choice (with this split) on a GPU."""
    if DEVICE.type == "cuda":
        return None
    return TileConfig(min(rows, M), 32, 64, 4, 1, split_k)


def gemv_tol(dtype, K):
    """fp32: sums of K products differ from float64 by ~sqrt(K) ulps; fp16/bf16: the default."""
    return None if dtype != torch.float32 else 1e-5 * max(1.0, math.sqrt(K) / 4)


def pair_tol(dtype, K):
    """Fused against the unfused pair: the same roundings, fp32 sums in another order."""
    return max(4 * ulps(dtype), gemv_tol(dtype, K) or 0.0)


def linear_weight(N, K, dtype, gen, with_bias):
    w = random_tensor((N, K), dtype, DEVICE, gen, scale=1 / math.sqrt(K))  # outputs of order 1
    return w, (random_tensor((N,), dtype, DEVICE, gen) if with_bias else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,split_k,rows", GEMV_CASES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_gemv_matches_reference_and_the_unfused_pair(dtype, M, N, K, split_k, rows, with_residual,
                                                                 untuned):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = random_tensor((M, K), dtype, DEVICE, gen)
    r = random_tensor((M, K), dtype, DEVICE, gen) if with_residual else None
    nw = random_tensor((K,), dtype, DEVICE, gen, scale=0.5) + 1
    w, b = linear_weight(N, K, dtype, gen, with_bias=with_residual)
    out = poisoned((M, N), dtype, DEVICE)
    r_out = poisoned((M, K), dtype, DEVICE) if with_residual else None
    y, new_r = add_rmsnorm_gemv(x, r, nw, 1e-5, w, b, out=out, residual_out=r_out,
                                config=gemv_config(M, split_k, rows))
    want_y, want_r = ref.add_rmsnorm_linear(to_numpy(x), None if r is None else to_numpy(r), to_numpy(nw), 1e-5,
                                            to_numpy(w), None if b is None else to_numpy(b))
    assert y is out
    assert_close(y, want_y, dtype, "y", seed, atol=gemv_tol(dtype, K), rtol=gemv_tol(dtype, K))
    h, want_r_t = add_rmsnorm(x, r, nw, 1e-5)
    assert torch.equal(new_r, want_r_t), f"the residual is x + residual, rounded (seed {seed})"
    unfused = (h.float() @ w.float().T + (0 if b is None else b.float())).to(dtype)
    torch.testing.assert_close(y, unfused, atol=pair_tol(dtype, K), rtol=pair_tol(dtype, K))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,split_k,rows", GEMV_CASES)
def test_silu_mul_gemv_matches_reference_and_the_unfused_pair(dtype, M, N, K, split_k, rows, untuned):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    gate_up = random_tensor((M, 2 * K), dtype, DEVICE, gen, scale=2.0)
    w, b = linear_weight(N, K, dtype, gen, with_bias=split_k > 1)
    out = poisoned((M, N), dtype, DEVICE)
    y = silu_mul_gemv(gate_up, w, b, out=out, config=gemv_config(M, split_k, rows))
    assert y is out
    want = ref.silu_mul_linear(to_numpy(gate_up), to_numpy(w), None if b is None else to_numpy(b))
    assert_close(y, want, dtype, "y", seed, atol=gemv_tol(dtype, K), rtol=gemv_tol(dtype, K))
    unfused = (silu_mul(gate_up).float() @ w.float().T + (0 if b is None else b.float())).to(dtype)
    torch.testing.assert_close(y, unfused, atol=pair_tol(dtype, K), rtol=pair_tol(dtype, K))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,split_k,rows", GEMV_CASES)
def test_decode_gemv_matches_reference(dtype, M, N, K, split_k, rows, untuned):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = random_tensor((M, K + 3), dtype, DEVICE, gen)[:, 1:K + 1]  # strided rows
    w, b = linear_weight(N, K, dtype, gen, with_bias=True)
    y = decode_gemv(x, w, b, config=gemv_config(M, split_k, rows))
    want = to_numpy(x) @ to_numpy(w).T + to_numpy(b)
    assert_close(y, want, dtype, "y", seed, atol=gemv_tol(dtype, K), rtol=gemv_tol(dtype, K))


#: (M, H, Hkv, D, block_size, rows per program, BLOCK_N asked for): the CPU tile's 32 features
#: fitted to the pairs (16 pairs; 4 at D = 24, whose half is 12; 2 at D = 4), a short last
#: row tile, GQA and MHA.
ROPE_GEMV_CASES = [(1, 4, 2, 16, 4, 1, 32), (3, 2, 2, 24, 3, 2, 32), (5, 6, 3, 4, 2, 4, 8), (2, 4, 1, 64, 16, 2, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,H,Hkv,D,block_size,rows,block_n", ROPE_GEMV_CASES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_gemv_rope_equals_the_gemv_then_rope_write_kv(dtype, M, H, Hkv, D, block_size, rows, block_n,
                                                                 with_residual, untuned):
    """The q/k/v GEMV with the rotation and the cache write at its end: the rotated q and the
    cache rows of the unfused pair (`add_rmsnorm_gemv`, then `rope_write_kv` on views of its
    output) up to the order of the fp32 sums, and the NumPy references; a padding slot (-1)
    writes nothing, every other cache row stays as it was."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    K = 40
    x = random_tensor((M, K), dtype, DEVICE, gen)
    r = random_tensor((M, K), dtype, DEVICE, gen) if with_residual else None
    nw = random_tensor((K,), dtype, DEVICE, gen, scale=0.5) + 1
    w, b = linear_weight((H + 2 * Hkv) * D, K, dtype, gen, with_bias=with_residual)
    positions = torch.as_tensor(rng.integers(0, 4000, M), device=DEVICE)
    cos, sin = rope_cos_sin(positions, D, 10000.0, dtype)
    num_blocks = M + 2
    slots = rng.permutation(num_blocks * block_size)[:M]
    if M > 2:
        slots[1] = -1
    slot_mapping = torch.as_tensor(slots, device=DEVICE, dtype=torch.int64)
    caches = [poisoned((num_blocks, block_size, Hkv, D), dtype, DEVICE) for _ in range(4)]
    config = None if DEVICE.type == "cuda" else TileConfig(min(rows, M), block_n, 16, 4, 1, 2)  # split: refitted
    q, new_r = add_rmsnorm_gemv_rope(x, r, nw, 1e-5, w, b, H, cos, sin, caches[0], caches[1], slot_mapping,
                                     config=config)
    qkv, want_r = add_rmsnorm_gemv(x, r, nw, 1e-5, w, b)
    want_q = rope_write_kv(qkv[:, :H * D].view(M, H, D), qkv[:, H * D:(H + Hkv) * D].view(M, Hkv, D),
                           qkv[:, (H + Hkv) * D:].view(M, Hkv, D), cos, sin, caches[2], caches[3], slot_mapping)
    assert q.shape == (M, H, D)
    tol = pair_tol(dtype, K)
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol, msg=lambda m: f"q (seed {seed}): {m}")
    assert torch.equal(new_r, want_r), f"the residual (seed {seed})"
    written = [s for s in slots if s >= 0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    for got, want, name in ((caches[0], caches[2], "k"), (caches[1], caches[3], "v")):
        got, want = got.view(-1, Hkv, D), want.view(-1, Hkv, D)
        torch.testing.assert_close(got[written], want[written], atol=tol, rtol=tol,
                                   msg=lambda m: f"{name} cache (seed {seed}): {m}")
        assert torch.isnan(got[untouched.to(DEVICE)]).all(), f"{name}: a row outside the slots was written"
    h, _ = ref.add_rmsnorm_linear(to_numpy(x), None if r is None else to_numpy(r), to_numpy(nw), 1e-5, to_numpy(w),
                                  None if b is None else to_numpy(b))
    ref_q, ref_k, _ = ref.rope_write_kv(h[:, :H * D].reshape(M, H, D), h[:, H * D:(H + Hkv) * D].reshape(M, Hkv, D),
                                        h[:, (H + Hkv) * D:].reshape(M, Hkv, D), to_numpy(cos), to_numpy(sin),
                                        to_numpy(caches[2]), to_numpy(caches[3]), slots)
    assert_close(q, ref_q, dtype, "q", seed, atol=gemv_tol(dtype, K), rtol=gemv_tol(dtype, K))
    assert_close(caches[0].view(-1, Hkv, D)[written], ref_k.reshape(-1, Hkv, D)[written], dtype, "k", seed,
                 atol=gemv_tol(dtype, K), rtol=gemv_tol(dtype, K))


def test_prologue_gemv_checks(untuned):
    x = torch.zeros(2, 16, device=DEVICE)
    w = torch.zeros(8, 16, device=DEVICE)
    nw = torch.ones(16, device=DEVICE)
    r = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="alias"):
        add_rmsnorm_gemv(x, r, nw, 1e-5, w, residual_out=r)
    with pytest.raises(ValueError):
        add_rmsnorm_gemv(x, r, nw[:8], 1e-5, w)
    with pytest.raises(ValueError):
        silu_mul_gemv(torch.zeros(2, 17, device=DEVICE), w)
    with pytest.raises(ValueError):
        decode_gemv(x, torch.zeros(8, 15, device=DEVICE))
    y, same = add_rmsnorm_gemv(x, None, nw, 1e-5, w)
    assert same is x and y.shape == (2, 8)
