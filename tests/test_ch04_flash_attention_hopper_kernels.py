"""Chapter 4's Hopper forward (`flash_attention_hopper`, `flash_attention_fp8`) against float64
references.

- bf16/fp16/fp32 forward against `minillm.reference.ch01_naive_attention`, out and lse: MHA,
  GQA, odd lengths, q_len != kv_len both ways (rows that see no key: out 0, lse -inf),
  head dims 16-128 (also not powers of two), causal and not; the output buffer is poisoned
  with NaN so an unwritten element fails.
- Every combination of the switches (TMA descriptors, warp specialization, persistence,
  the overlapped loop): under the interpreter all 16; on the GPU each switch flipped from
  every default config, with the tile sizes the benchmark sweeps.
- FP8: the quantizer equals the NumPy reference exactly; the kernel is within the
  elementwise bound that rounding P to e4m3 allows (`minillm.reference.ch04_fp8.p_rounding_bound`)
  of exact attention of the quantized inputs, with and without the rotation (on the GPU plus
  `fp8_accumulation_bound`: Hopper's FP8 matrix instructions accumulate in ~14 bits); the
  rotation is orthogonal and leaves exact attention unchanged.

- The backward (`flash_attention_hopper_backward`) against the float64 NumPy backward
  `minillm.reference.ch04_flash_attention.fa2_backward`: MHA, GQA, odd lengths, q_len !=
  kv_len both ways, causal and not, dQ by atomics and by the separate pass, every switch.
- `fastest_attention`, the differentiable entry point: out, lse and the gradients through
  autograd against the same references, and the kernel `forward_kernel` names for the device
  (the Hopper kernels in the interpreter and on sm_90, FA2's past head dim 128 and elsewhere).

CPU: small shapes under the interpreter (fp32 exact dots, and fp16). GPU (`make gpu`): bf16
and fp16, larger shapes, the GPU tile configs.
"""
import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from minillm.kernels.base import interpreting
from minillm.kernels.ch04_flash_attention_hopper import (
    ABLATIONS, BWD_ABLATIONS, BWD_DEFAULT_CONFIGS, BWD_INTERPRET_CONFIG, DEFAULT_CONFIGS, E4M3_MAX,
    E4M3_UNIT_ROUNDOFF, INTERPRET_CONFIG, HopperBwdConfig, HopperConfig, ablated, attention_backward, bwd_ablated,
    bwd_default_config, default_config, fastest_attention, flash_attention_fp8, flash_attention_hopper,
    flash_attention_hopper_backward, forward_kernel, hopper_backward_applies, prepare_fp8, quantize_blocks,
    random_rotation,
)
from minillm.reference import attention
from minillm.reference import ch04_fp8 as ref8
from minillm.reference.ch04_flash_attention import fa2_backward
from minillm.testing import (
    assert_close, assert_grad_close, assert_within_fp8_bound, fp8_quantized_inputs, poisoned, random_tensor,
    skip_fp32_on_gpu, to_numpy,
)

SWITCHES = ("tma", "warp_specialize", "persistent", "overlap")


def make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen, scale=1.0):
    q = random_tensor((batch, q_heads, q_len, head_dim), dtype, device, gen, scale)
    k = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen, scale)
    v = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    return q, k, v


def check_forward(q, k, v, causal, dtype, seed, config=None):
    out = poisoned(q.shape, q.dtype, q.device)
    got, lse = flash_attention_hopper(q, k, v, causal=causal, config=config, return_lse=True, out=out)
    assert got is out
    ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


# ----------------------------------------------------------------------------------------
# bf16 / fp16 / fp32 forward
# ----------------------------------------------------------------------------------------
FWD_SMALL = [  # batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal
    (2, 4, 2, 37, 37, 16, False),     # GQA 2:1, odd length
    (1, 4, 1, 45, 61, 64, True),      # MQA, q < kv (bottom-right causal)
    (1, 2, 1, 70, 33, 32, True),      # q > kv: the first rows see no key
    (1, 3, 3, 29, 29, 24, True),      # head_dim not a power of two
    (1, 2, 2, 1, 50, 128, False),     # one query row
]
FWD_LARGE = [
    (2, 16, 4, 1000, 1000, 128, True),
    (1, 32, 32, 777, 777, 64, False),
    (1, 8, 2, 513, 1531, 128, True),
    (1, 8, 8, 1531, 513, 64, True),
    (2, 4, 4, 300, 300, 80, False),   # padded head dim (TMA zero-fills the columns past 80)
]


def case_id(c):
    b, hq, hk, m, n, d, causal = c
    return f"B{b}-H{hq}:{hk}-{m}x{n}-D{d}" + ("-causal" if causal else "")


FWD_CASES = [pytest.param(*c, id=case_id(c)) for c in FWD_SMALL] + [
    pytest.param(*c, id=case_id(c), marks=pytest.mark.gpu) for c in FWD_LARGE
]


@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal", FWD_CASES)
def test_forward(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen)
    check_forward(q, k, v, causal, dtype, seed)


def interpreter_configs():
    """All 16 switch combinations on the interpreter's tiles, and the persistent ones again
    with the dynamic tile scheduler and with warp specialization on the tile loop."""
    for flags in itertools.product((False, True), repeat=len(SWITCHES)):
        config = HopperConfig(INTERPRET_CONFIG.block_m, INTERPRET_CONFIG.block_n, 4, 1, **dict(zip(SWITCHES, flags)))
        yield config
        if config.persistent:
            yield replace(config, scheduler="dynamic", programs_per_sm=2)
        if config.persistent and config.warp_specialize:
            yield replace(config, ws_loop="tiles")


@pytest.mark.skipif(not interpreting(), reason="interpreter test (the GPU runs test_gpu_switches)")
@pytest.mark.parametrize("config", list(interpreter_configs()), ids=lambda c: c.describe().split(", ", 3)[-1])
def test_every_switch_combination(config, gen, seed):
    dtype = torch.float32
    for shape, causal in (((1, 4, 2, 45, 61, 32), True), ((2, 2, 1, 37, 37, 16), False)):
        q, k, v = make_qkv(*shape, dtype, "cpu", gen)
        check_forward(q, k, v, causal, dtype, seed, config)


@pytest.mark.skipif(not interpreting(), reason="interpreter test")
@pytest.mark.parametrize("bm,bn", [(16, 32), (32, 32), (64, 16)])
def test_tile_shapes(bm, bn, gen, seed):
    """The segment arithmetic with BLOCK_M < BLOCK_N, = and >, on the overlapped loop too."""
    dtype = torch.float32
    for overlap in (False, True):
        config = HopperConfig(bm, bn, 4, 1, overlap=overlap)
        q, k, v = make_qkv(1, 2, 1, 53, 71, 16, dtype, "cpu", gen)
        check_forward(q, k, v, True, dtype, seed, config)


def test_strided_inputs(device, gen, seed):
    """Inputs that are views (heads and tokens transposed, as after a projection) and a head
    dim with a non-unit stride (copied first)."""
    dtype = torch.float16
    q = random_tensor((1, 33, 4, 32), dtype, device, gen).transpose(1, 2)
    k = random_tensor((1, 40, 2, 32), dtype, device, gen).transpose(1, 2)
    v = random_tensor((1, 2, 32, 40), dtype, device, gen).transpose(2, 3)  # head_dim not contiguous
    check_forward(q, k, v, True, dtype, seed)


def test_defaults_and_errors(device, gen):
    q, k, v = make_qkv(1, 2, 1, 20, 20, 16, torch.float16, device, gen)
    out = flash_attention_hopper(q, k, v, scale=0.3)
    ref, _ = attention(to_numpy(q), to_numpy(k), to_numpy(v), scale=0.3)
    assert_close(out, ref, torch.float16)
    with pytest.raises(ValueError):
        flash_attention_hopper(q, k[:, :, :, :8], v, causal=True)
    with pytest.raises(ValueError):
        flash_attention_hopper(q[:, :1], k.expand(1, 2, 20, 16), v.expand(1, 2, 20, 16))  # 1 q head, 2 kv heads
    with pytest.raises(ValueError):
        flash_attention_hopper(torch.zeros(1, 1, 4, 160, device=device, dtype=torch.float16),
                               *(torch.zeros(1, 1, 4, 160, device=device, dtype=torch.float16),) * 2)
    with pytest.raises(TypeError):
        flash_attention_hopper(q.float(), k, v)


def test_config_helpers():
    base = HopperConfig()
    for switch in ABLATIONS:
        flipped = ablated(base, switch)
        assert getattr(flipped, switch) != getattr(base, switch)
        assert ablated(flipped, switch) == base
    if interpreting():
        assert default_config(128) == INTERPRET_CONFIG
        assert INTERPRET_CONFIG.block_m * INTERPRET_CONFIG.block_n <= 32 * 32  # fast on a CPU
    else:
        assert default_config(128) == DEFAULT_CONFIGS[("bf16", 128)]


# ----------------------------------------------------------------------------------------
# GPU: every switch, flipped from each default config, and the swept tile sizes
# ----------------------------------------------------------------------------------------
def gpu_configs(head_dim: int):
    base = DEFAULT_CONFIGS[("bf16", head_dim)]
    configs = [base] + [ablated(base, s) for s in SWITCHES]
    configs += [HopperConfig(bm, bn, w, s) for bm, bn, w, s in ((128, 64, 8, 3), (64, 128, 4, 3))]
    configs += [HopperConfig(64, 64, 4, 3, programs_per_sm=2, overlap=True),
                replace(base, persistent=True, scheduler="dynamic")]
    return list(dict.fromkeys(configs))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_switches(head_dim, device, gen, seed):
    dtype = torch.bfloat16
    for config in gpu_configs(head_dim):
        for causal, (q_len, kv_len) in ((False, (333, 333)), (True, (333, 517)), (True, (517, 333))):
            q, k, v = make_qkv(2, 8, 2, q_len, kv_len, head_dim, dtype, device, gen)
            check_forward(q, k, v, causal, dtype, seed, config)


# ----------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------
def test_round_e4m3_matches_torch():
    """The NumPy rounding equals torch's float8_e4m3fn cast on every representable value,
    the midpoints between them (ties to even) and random values."""
    x = torch.cat([torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float(),
                   torch.linspace(-460, 460, 20001), torch.randn(5000) * 3, torch.rand(5000) * 2 ** -6])
    x = x[torch.isfinite(x) & (x.abs() <= E4M3_MAX)].double()
    got = ref8.round_e4m3(x.numpy())
    want = x.to(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(got, want)
    finite = np.abs(x.numpy()) >= 2 ** -6
    rel = np.abs(got - x.numpy())[finite] / np.abs(x.numpy())[finite]
    assert rel.max() <= ref8.UNIT_ROUNDOFF == E4M3_UNIT_ROUNDOFF


def test_exp2_polynomial_within_its_bound(seed):
    """The software exponential (Gluon FP8 kernel's ``fma_exp2``) against ``2^x``: relative
    error within `EXP2_POLY_REL_ERROR` on random inputs down to the clamp, around the
    rounding points n ± 1/2 and at 0; ``-inf`` and anything below the clamp give 2^-125;
    every result a positive normal number. The bound is not loose: the cubic's worst error
    on [-1/2, 1/2] is more than half of it."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.uniform(ref8.EXP2_POLY_MIN, 0.0, 200_000), -rng.exponential(2.0, 50_000),
                        np.arange(-124, 1) + 0.5, np.arange(-124, 1) - 0.5, np.linspace(-0.5, 0.0, 10_001)])
    x = np.minimum(x, 0.0).astype(np.float32)
    got = ref8.exp2_polynomial(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got / want - 1.0)
    assert rel.max() <= ref8.EXP2_POLY_REL_ERROR
    assert rel.max() > ref8.EXP2_POLY_REL_ERROR / 2
    low = ref8.exp2_polynomial(np.array([-np.inf, -1e4, -126.0, ref8.EXP2_POLY_MIN], np.float32))
    np.testing.assert_allclose(low, 2.0 ** ref8.EXP2_POLY_MIN, rtol=ref8.EXP2_POLY_REL_ERROR)
    assert np.all(np.isfinite(got)) and got.min() >= np.finfo(np.float32).tiny


@pytest.mark.parametrize("causal", [False, True])
def test_rounded_row_sums_within_their_bound(causal, seed):
    """`p_rounding_bound` with ``rounded_sum``: the kernels' arithmetic (`online_fp8_softmax`) with
    ℓ summed from P as rounded to e4m3 (what the tensor cores add for ``P · 1``) stays within it, elementwise, on
    scores with a spread of a few units over 256 keys in blocks of 64; the plain bound holds
    for ℓ from P unrounded, as the kernels compute it otherwise. Neither bound is vacuous,
    and the rounded sums do move the output (more than a bf16 rounding of it)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, 256, 64)) * sd for sd in (2.0, 2.0, 1.0))
    qd, kd, vd = ref8.quantized_inputs(q, k, v, 64, 128)
    s2 = np.where(ref8.attention_mask(256, 256, causal), qd @ np.swapaxes(kd, -1, -2) / math.sqrt(64), -np.inf)
    s2 = s2 * math.log2(math.e)  # the kernels' base-2 scores
    want = ref8.fp8_attention(q, k, v, 64, 128, causal=causal)
    for rounded_sum in (False, True):
        got = ref8.online_fp8_softmax(s2, vd, 64, rounded_sum)[0]
        bound = ref8.p_rounding_bound(q, k, v, 64, 128, causal=causal, rounded_sum=rounded_sum)
        assert np.all(np.abs(got - want) <= bound + 1e-12), (rounded_sum, np.max(np.abs(got - want) - bound))
        assert np.linalg.norm(bound) < 0.5 * np.linalg.norm(want)
    moved = np.abs(ref8.online_fp8_softmax(s2, vd, 64, True)[0] - ref8.online_fp8_softmax(s2, vd, 64, False)[0])
    assert moved.max() > 2.0 ** -8 * np.abs(want).max()


@pytest.mark.parametrize("block_rows,seq", [(16, 37), (32, 32), (64, 5)])
def test_quantize_blocks_matches_reference(block_rows, seq, gen):
    x = random_tensor((2, 3, seq, 24), torch.float32, "cpu", gen, scale=3.0)
    x[0, 1, : min(seq, block_rows)] = 0.0  # an all-zero block: scale 1, values 0
    x8, scales = quantize_blocks(x, block_rows)
    want8, want_scales = ref8.quantize_blocks(x.double().numpy(), block_rows)
    np.testing.assert_allclose(scales.double().numpy(), want_scales, rtol=1e-6)
    np.testing.assert_array_equal(x8[:, :, :seq].double().numpy(), want8)
    assert (x8[:, :, seq:].float() == 0).all()  # padding rows
    assert x8.float().abs().max() <= E4M3_MAX
    xt, _ = quantize_blocks(x, block_rows, transpose=True)
    assert torch.equal(xt.float(), x8.float().transpose(-1, -2))


def test_rotation_is_orthogonal_and_preserves_attention(gen):
    for head_dim in (16, 64, 24):
        rot = random_rotation(head_dim, seed=3).double()
        np.testing.assert_allclose((rot @ rot.T).numpy(), np.eye(head_dim), atol=1e-6)
        if head_dim & (head_dim - 1) == 0:
            signs = np.sign(rot[:, 0].numpy())
            np.testing.assert_allclose(rot.numpy(), ref8.random_hadamard(signs), atol=1e-7)
    q, k, v = (random_tensor((1, 2, 9, 16), torch.float64, "cpu", gen).numpy() for _ in range(3))
    rot = random_rotation(16, seed=1).double().numpy()
    plain, _ = attention(q, k, v, causal=True)
    rotated, _ = attention(q @ rot, k @ rot, v, causal=True)
    np.testing.assert_allclose(rotated, plain, atol=1e-5)  # the rotation is fp32-rounded


def check_fp8(q, k, v, causal, config, rotate, seed):
    """|kernel − exact attention of the quantized inputs| <= the P-rounding bound, elementwise.
    The inputs are those the kernel's own quantizer made (rotated first with ``rotate``), so the
    reference computes with exactly the values the kernel multiplies."""
    prepared = prepare_fp8(q, k, v, config, rotate=rotate)
    out = flash_attention_fp8(q, k, v, causal=causal, config=config, prepared=prepared)
    qd, kd, vd = fp8_quantized_inputs(prepared, q.shape[2], k.shape[2], config.block_m, config.block_n)
    v_block = None if config.v_scale == "block" else vd.shape[2]  # one scale for the whole head
    assert_within_fp8_bound(out, qd, kd, vd, config.block_m, config.block_n, causal, v_block,
                            f"{config.describe()}, V scale per {config.v_scale}, rotate {rotate}", seed)


FP8_SMALL = [(1, 4, 2, 45, 61, 32, True), (2, 2, 1, 37, 37, 16, False), (1, 2, 1, 40, 23, 64, True)]


@pytest.mark.skipif(not interpreting(), reason="interpreter test (the GPU runs test_fp8_gpu)")
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("shape", FP8_SMALL, ids=case_id)
def test_fp8_within_rounding_bound(shape, rotate, gen, seed):
    *dims, causal = shape
    q, k, v = make_qkv(*dims, torch.float32, "cpu", gen, scale=2.0)
    for tma in (True, False):  # the transposed V through the descriptor and through pointers
        for v_scale in ("block", "head"):
            config = HopperConfig(32, 16, 4, 1, tma=tma, persistent=tma, overlap=tma, v_scale=v_scale,
                                  scheduler="dynamic" if v_scale == "head" else "static")
            check_fp8(q, k, v, causal, config, rotate, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_gpu(head_dim, rotate, device, gen, seed):
    q, k, v = make_qkv(1, 4, 2, 300, 437, head_dim, torch.bfloat16, device, gen, scale=2.0)
    config = DEFAULT_CONFIGS[("fp8", head_dim)]
    for variant in (config, ablated(config, "overlap"), replace(config, v_scale="head"),
                    replace(config, v_scale="block", scheduler="dynamic"),
                    HopperConfig(config.block_m, config.block_n, config.num_warps, config.num_stages,
                                 tma=False, persistent=False)):
        check_fp8(q, k, v, True, variant, rotate, seed)


def test_fp8_prepared_inputs_are_reused(device, gen):
    """`prepare_fp8` once, then the kernel alone (what the benchmark times) gives the same output."""
    q, k, v = make_qkv(1, 2, 1, 30, 30, 16, torch.float16, device, gen)
    config = default_config(16, fp8=True)
    once = flash_attention_fp8(q, k, v, causal=True, config=config)
    again = flash_attention_fp8(q, k, v, causal=True, config=config, prepared=prepare_fp8(q, k, v, config))
    assert torch.equal(once, again)
    assert math.isfinite(float(once.float().abs().sum()))


# ----------------------------------------------------------------------------------------
# The benchmark's bookkeeping (no timing: a stand-in timer, tiny shapes, the interpreter)
# ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not interpreting(), reason="bookkeeping check under the interpreter; the GPU runs the benchmark")
def test_benchmark_dry_run(device):
    """`bench.ch04_hopper.sweep_points` end to end on tiny shapes with a stand-in timer that
    calls the function once: every point adds its rows (a peer that refuses, e.g. cuDNN on a
    CPU, is recorded with a note), the errors are finite, and the summary prints. The real
    sweep runs on a GPU (`python -m bench.run --only ch04_hopper`)."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import ch04_hopper as bench
    from bench.common import Results

    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    bench.sweep_points(results, device, head_dims=(16,), seq_lens=(17, 32), tokens=32, hidden=32,
                       dtype=torch.float16, ablation_seq_lens=(32,), error_seq_len=24,
                       timer=lambda fn: (fn(), 1.0)[1])
    rows = results.rows
    count = lambda metric, **p: sum(r["metric"] == metric and all(r["params"].get(k) == v for k, v in p.items())
                                    for r in rows)  # noqa: E731
    points = 2 * 2  # seq_lens x causal
    ablations = len(bench.ABLATIONS) + 1  # + the other key-block width (the interpreter's scheduler is static)
    assert count("TFLOPs", dtype="float16") == points * len(bench.PEERS) + 2 * ablations
    assert count("TFLOPs", dtype="fp8") == points * 3 + 2  # + V scale per block, at the ablation points
    assert count("quantize_ms") == points
    assert count("rel_err", dtype="fp8") == 2 * 2 * 2  # inputs x causal x V scale
    for r in rows:
        if r["metric"] == "rel_err" and r["params"]["dtype"] == "fp8":
            assert 0 < r["ours"] < 0.2 and 0 < r["peer_value"] < 0.2
        if r["metric"] == "rel_err" and r["params"]["dtype"] == "float16":
            assert r["ours"] < 1e-2
    assert "hopper" in bench.summary(results)


@pytest.mark.skipif(not interpreting(), reason="bookkeeping check under the interpreter; the GPU runs the benchmark")
def test_benchmark_backward_dry_run(device):
    """`bench.ch04_hopper.backward_points` on tiny shapes with a stand-in timer: every point
    adds a row per peer (cuDNN refuses on a CPU: recorded with a note), each ablation point a
    row per switch, the gradient error against a peer is small, and the summary prints them."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import ch04_hopper as bench
    from bench.common import Results

    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    bench.backward_points(results, device, head_dims=(16,), seq_lens=(17, 32), tokens=32, hidden=32,
                          dtype=torch.float16, ablation_seq_lens=(32,), timer=lambda fn: (fn(), 1.0)[1])
    rows = [r for r in results.rows if r["params"].get("pass") == "bwd"]
    assert len(rows) == len(results.rows)
    count = lambda metric, ablation: sum(r["metric"] == metric and ("ablation" in r["params"]) == ablation
                                         for r in rows)  # noqa: E731
    points = 2 * 2  # seq_lens x causal
    assert count("TFLOPs", False) == count("time_ms", False) == points * 3  # sdpa_flash, sdpa_cudnn, fa2
    assert count("TFLOPs", True) == 2 * len(BWD_ABLATIONS)  # the interpreter's config: dQ by atomics
    for r in rows:
        if r["metric"] == "rel_err":
            assert r["ours"] < 1e-2 and (r["peer_value"] is None or r["peer_value"] < 1e-2)
    text = bench.summary(results)
    assert "backward" in text and "longest_first" in text


# ----------------------------------------------------------------------------------------
# The backward
# ----------------------------------------------------------------------------------------
def check_backward(q, k, v, causal, dtype, seed, config=None, gen=None):
    """Forward with the Hopper kernel, backward with ``config``; both against float64 NumPy
    (`attention` for out/lse, `fa2_backward` for the gradients, from the same out/lse)."""
    dout = random_tensor(q.shape, dtype, q.device, gen or torch.Generator().manual_seed(seed))
    out, lse = flash_attention_hopper(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = flash_attention_hopper_backward(dout, q, k, v, out, lse, causal=causal, config=config)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    qn, kn, vn = (to_numpy(t) for t in (q, k, v))
    ref_out, ref_lse = attention(qn, kn, vn, causal=causal)
    rdq, rdk, rdv = fa2_backward(qn, kn, vn, ref_out, ref_lse, to_numpy(dout), causal=causal)
    label = f"{(config or bwd_default_config(q.shape[-1], causal)).describe()}"
    assert_grad_close(dq, rdq, dtype, f"dq ({label})", seed)
    assert_grad_close(dk, rdk, dtype, f"dk ({label})", seed)
    assert_grad_close(dv, rdv, dtype, f"dv ({label})", seed)


BWD_SMALL = [  # batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal
    (1, 4, 2, 45, 61, 32, True),      # GQA 2:1, q < kv (bottom-right causal)
    (2, 2, 1, 37, 37, 16, False),     # MQA, odd length
    (1, 2, 1, 70, 33, 24, True),      # q > kv: the first rows see no key (zero dQ); head dim 24
    (1, 3, 3, 1, 50, 16, False),      # one query row
]
BWD_LARGE = [
    (2, 8, 2, 333, 517, 128, True),
    (1, 8, 8, 1000, 1000, 64, True),
    (2, 4, 1, 517, 333, 64, True),
    (1, 8, 4, 600, 600, 128, False),
    (1, 4, 4, 300, 300, 80, False),   # padded head dim
]
BWD_CASES = [pytest.param(*c, id=case_id(c)) for c in BWD_SMALL] + [
    pytest.param(*c, id=case_id(c), marks=pytest.mark.gpu) for c in BWD_LARGE
]


@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal", BWD_CASES)
def test_backward(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen)
    check_backward(q, k, v, causal, dtype, seed, gen=gen)


def bwd_interpreter_configs():
    """The interpreter's config with each switch flipped, the separate dQ pass with each of its
    switches flipped, and tile shapes with BLOCK_M <, = and > BLOCK_N."""
    base = BWD_INTERPRET_CONFIG
    configs = [base] + [bwd_ablated(base, s) for s in BWD_ABLATIONS]
    separate = bwd_ablated(base, "dq")
    configs += [bwd_ablated(separate, s) for s in ("tma", "longest_first", "warp_specialize")]
    configs += [replace(base, block_m=bm, block_n=bn, dq_block_m=bn, dq_block_n=bm)
                for bm, bn in ((32, 32), (32, 16))]
    return list(dict.fromkeys(configs))


@pytest.mark.skipif(not interpreting(), reason="interpreter test (the GPU runs test_gpu_backward_switches)")
@pytest.mark.parametrize("config", bwd_interpreter_configs(), ids=lambda c: c.describe())
def test_backward_every_switch(config, gen, seed):
    dtype = torch.float32
    for shape, causal in (((1, 4, 2, 45, 61, 32), True), ((1, 2, 1, 50, 33, 16), True),
                          ((2, 2, 1, 37, 37, 16), False)):
        q, k, v = make_qkv(*shape, dtype, "cpu", gen)
        check_backward(q, k, v, causal, dtype, seed, config, gen)


def gpu_bwd_configs(head_dim: int):
    """Each default config of this head dim with every switch flipped, and two other tiles."""
    configs = []
    for causal in (False, True):
        base = BWD_DEFAULT_CONFIGS[(head_dim, causal)]
        configs += [base] + [bwd_ablated(base, s) for s in BWD_ABLATIONS]
    configs += [HopperBwdConfig(64, 64, 4, 3), HopperBwdConfig(32, 128, 8, 2)]
    return list(dict.fromkeys(configs))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_backward_switches(head_dim, device, gen, seed):
    dtype = torch.bfloat16
    for config in gpu_bwd_configs(head_dim):
        # Two cases per config keep the compilations (two per config) within a minute or two.
        for causal, (q_len, kv_len) in ((False, (333, 333)), (True, (517, 333))):
            q, k, v = make_qkv(2, 8, 2, q_len, kv_len, head_dim, dtype, device, gen)
            check_backward(q, k, v, causal, dtype, seed, config, gen)


def test_backward_inputs_and_dispatch(device, gen, seed):
    """Strided inputs and dO (copied as needed), a given scale, an fp32 lse from elsewhere,
    errors on mismatched shapes, and `attention_backward`'s choice of kernels."""
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
    q = random_tensor((1, 21, 2, 16), dtype, device, gen).transpose(1, 2)
    k = random_tensor((1, 30, 1, 16), dtype, device, gen).transpose(1, 2)
    v = random_tensor((1, 30, 1, 16), dtype, device, gen).transpose(1, 2)
    dout = random_tensor((1, 2, 16, 21), dtype, device, gen).transpose(2, 3)
    out, lse = flash_attention_hopper(q, k, v, causal=True, scale=0.3, return_lse=True)
    got = attention_backward(dout, q, k, v, out, lse, causal=True, scale=0.3)
    qn, kn, vn = (to_numpy(t) for t in (q, k, v))
    ref_out, ref_lse = attention(qn, kn, vn, causal=True, scale=0.3)
    want = fa2_backward(qn, kn, vn, ref_out, ref_lse, to_numpy(dout), causal=True, scale=0.3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_grad_close(g, w, dtype, name, seed)
    with pytest.raises(ValueError):
        flash_attention_hopper_backward(dout, q, k, v, out, lse[:, :, :5])
    on_hopper = torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    assert hopper_backward_applies(device) == (on_hopper or (torch.device(device).type == "cpu" and interpreting()))
    if interpreting():
        assert bwd_default_config(128, True) == BWD_INTERPRET_CONFIG
    else:
        assert bwd_default_config(128, True) == BWD_DEFAULT_CONFIGS[(128, True)]
        assert bwd_default_config(40, False) == BWD_DEFAULT_CONFIGS[(64, False)]


# ----------------------------------------------------------------------------------------
# The entry point: fastest_attention
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal", [
    (1, 4, 2, 45, 61, 32, True),      # GQA, q < kv (bottom-right causal)
    (2, 2, 1, 37, 37, 16, False),     # MQA, odd length
    (1, 2, 1, 70, 33, 24, True),      # q > kv: the first rows see no key
    (1, 2, 2, 33, 33, 160, True),     # past the Hopper kernels' head dims: FA2's
])
def test_fastest_attention_forward_and_gradients(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, dtype,
                                                 device, gen, seed):
    """Through autograd, out, lse and dQ, dK, dV match the float64 references, the call without
    gradients gives the same out, and the kernel is the one `forward_kernel` names here."""
    skip_fp32_on_gpu(dtype, device)
    q, k, v = (t.requires_grad_() for t in make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype,
                                                     device, gen))
    dout = random_tensor(q.shape, dtype, device, gen)
    out, lse = fastest_attention(q, k, v, causal=causal, scale=0.3, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    out.backward(dout)
    qn, kn, vn = (to_numpy(t.detach()) for t in (q, k, v))
    ref_out, ref_lse = attention(qn, kn, vn, causal=causal, scale=0.3)
    assert_close(out.detach(), ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)
    want = fa2_backward(qn, kn, vn, ref_out, ref_lse, to_numpy(dout), causal=causal, scale=0.3)
    for name, t, w in zip(("dq", "dk", "dv"), (q, k, v), want):
        assert_grad_close(t.grad, w, dtype, name, seed)
    with torch.no_grad():
        assert torch.equal(fastest_attention(q, k, v, causal=causal, scale=0.3), out.detach())
    on_hopper = torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    hopper = (on_hopper or interpreting()) and head_dim <= 128
    assert forward_kernel(q, k, v) == ("hopper" if hopper else "fa2")  # none of these is in the Gluon scope


def test_fastest_attention_refuses_a_scale_that_is_not_positive(device, gen):
    """Whichever kernel takes the call, a scale of 0 or below is refused, not computed wrongly."""
    q, k, v = make_qkv(1, 2, 1, 16, 16, 16, torch.float32 if torch.device(device).type == "cpu" else torch.float16,
                       device, gen)
    for scale in (0.0, -0.5):
        with pytest.raises(ValueError, match="scale must be > 0"):
            fastest_attention(q, k, v, scale=scale)
