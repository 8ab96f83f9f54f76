"""Chapter 4's Gluon kernels (`flash_attention_gluon`, `flash_attention_gluon_backward`)
against the float64 references.

- GPU (sm_90, `make gpu`): every variant (pipelined, warp-specialized, ping-pong), head dims
  64 and 128, causal and not, MHA and GQA, lengths 128 to 1152, fresh seeds; out and lse
  against `minillm.reference.attention`, with the bf16 tolerance. The FP8 kernel within the
  error FP8 allows of exact attention of its quantized inputs
  (`minillm.testing.assert_within_fp8_bound`). The backward's dQ, dK and dV against the
  float64 NumPy backward (`fa2_backward`), with dQ added by TMA reductions and by atomics,
  and `attention_backward` choosing it where it applies; `fastest_attention` running the
  forward with `fastest_forward`'s settings and the Gluon backward, its out and gradients
  against the references, and a second training step launching every kernel from
  `minillm.kernels.base.launch`'s cache.
- CPU: the wrapper refuses what the kernels do not cover (with the reason), `gluon_applies`
  says no off a Hopper GPU, and `fastest_forward` asks only for what the kernel takes.
  Gluon kernels do not run under Triton's interpreter; instead,
  with a Triton whose Gluon API the module knows, every kernel is compiled for sm_90 on the CPU
  (a stand-in driver that names the target) and its PTX is checked for what the chapter claims:
  asynchronous wgmma, register reallocation (``setmaxnreg``) in the warp-specialized kernels
  only, no spills to local memory, and in the backward dQ's bulk reduction (or atomics).
"""
import numpy as np
import pytest
import torch
import triton

from minillm.kernels.ch04_flash_attention_gluon import (
    GLUON_VERSIONS, VARIANTS, bwd_shared_bytes, default_tiles, fastest_forward, flash_attention_gluon,
    flash_attention_gluon_backward, P_KEY_ORDER, flash_attention_gluon_fp8, gluon_applies, prepare_gluon_fp8,
)
from minillm.reference import attention
from minillm.reference.ch04_flash_attention import fa2_backward
from minillm.reference.ch04_fp8 import EXP2_POLY_REL_ERROR
from minillm.testing import (
    SM90_COMPILE_PRELUDE, assert_close, assert_grad_close, assert_within_fp8_bound, compile_for_sm90,
    fp8_quantized_inputs, random_tensor, sm90_compile_mark, to_numpy,
)


def make_qkv(batch, q_heads, kv_heads, seq, head_dim, device, gen, scale=1.0):
    q = random_tensor((batch, q_heads, seq, head_dim), torch.bfloat16, device, gen, scale)
    k = random_tensor((batch, kv_heads, seq, head_dim), torch.bfloat16, device, gen, scale)
    v = random_tensor((batch, kv_heads, seq, head_dim), torch.bfloat16, device, gen)
    return q, k, v


# ----------------------------------------------------------------------------------------
# CPU: scope checks and compiling for sm_90 without a GPU
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape_q, shape_kv, dtype, match", [
    ((1, 2, 256, 64), (1, 2, 256, 64), torch.float16, "bf16"),
    ((1, 2, 256, 96), (1, 2, 256, 96), torch.bfloat16, "head_dim"),
    ((1, 2, 200, 64), (1, 2, 200, 64), torch.bfloat16, "multiple of 128"),
    ((1, 3, 256, 64), (1, 2, 256, 64), torch.bfloat16, "kv_heads"),
    ((1, 2, 256, 64), (1, 2, 384, 64), torch.bfloat16, "kv_heads"),
])
def test_refuses_inputs_out_of_scope(shape_q, shape_kv, dtype, match):
    q = torch.zeros(shape_q, dtype=dtype)
    k = torch.zeros(shape_kv, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        flash_attention_gluon(q, k, k)
    assert not gluon_applies(q, k, k)


def test_fastest_forward_asks_only_for_what_the_kernel_takes():
    """Three consumers only without a mask (the causal schedules pair 128-row tiles), a
    warp-specialized variant, and the settings the chapter measured at the points it names."""
    for head_dim in (64, 128):
        for causal in (False, True):
            for seq in (128, 1024, 2048, 4096, 16384):
                settings = fastest_forward(head_dim, causal, seq)
                assert settings["variant"] in VARIANTS[1:]
                assert settings["consumers"] == 2 or not causal
    assert fastest_forward(64, False, 2048) == dict(variant="ws_pingpong", consumers=3)
    assert fastest_forward(64, False, 1024) == dict(variant="ws_pingpong", consumers=2)
    assert fastest_forward(128, True, 4096) == dict(variant="ws_pingpong", consumers=2)
    assert fastest_forward(128, True, 2048) == fastest_forward(128, False, 16384) == dict(variant="ws", consumers=2)


def test_refuses_a_scale_that_is_not_positive():
    """The kernels take the row max of the scores before scaling them, which is right only for
    a positive scale: the forward (bf16 and FP8) and the backward refuse any other."""
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 256)
    for scale in (0.0, -0.125):
        with pytest.raises(ValueError, match="scale must be > 0"):
            flash_attention_gluon(q, q, q, scale=scale)
        with pytest.raises(ValueError, match="scale must be > 0"):
            flash_attention_gluon_fp8(q, q, q, scale=scale)
        with pytest.raises(ValueError, match="scale must be > 0"):
            flash_attention_gluon_backward(q, q, q, q, q, lse, scale=scale)


def test_refuses_unknown_variant_and_tile():
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="persistent"):
        flash_attention_gluon(q, q, q, variant="pipelined", persistent=True)
    with pytest.raises(ValueError, match="variant"):
        flash_attention_gluon(q, q, q, variant="fastest")
    with pytest.raises(ValueError, match="warp-specialized"):
        flash_attention_gluon_fp8(q, q, q, variant="pipelined")
    with pytest.raises(ValueError, match="block_n"):
        flash_attention_gluon(q, q, q, block_n=32)
    with pytest.raises(ValueError, match="block_n"):
        flash_attention_gluon(q, q, q, block_n=256)  # 256-key tiles are FP8's only
    q384 = torch.zeros(1, 2, 384, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of block_n"):
        flash_attention_gluon_fp8(q384, q384, q384, block_n=256,
                                  prepared=prepare_gluon_fp8(q384, q384, q384, 128), compile_only=True)
    with pytest.raises(ValueError, match="head_group"):
        flash_attention_gluon(q, q, q, head_group=0)
    with pytest.raises(ValueError, match="fma_exp2 must be one of"):
        flash_attention_gluon(q, q, q, fma_exp2=3)
    with pytest.raises(ValueError, match="warp-specialized"):
        flash_attention_gluon(q, q, q, variant="pipelined", fma_exp2=4)
    with pytest.raises(ValueError, match="warp-specialized"):
        flash_attention_gluon(q, q, q, variant="pipelined", lazy_rescale=True)
    with pytest.raises(ValueError, match="warp-specialized"):
        flash_attention_gluon(q, q, q, variant="pipelined", row_sum_mma=True)
    with pytest.raises(ValueError, match="warp-specialized"):
        flash_attention_gluon(q, q, q, variant="pipelined", pin_softmax=True)
    with pytest.raises(ValueError, match="P in registers"):
        flash_attention_gluon_fp8(q, q, q, pin_softmax=True, compile_only=True,
                                  prepared=prepare_gluon_fp8(q, q, q, p_in_registers=False))


def test_refuses_192_key_blocks_out_of_scope():
    """192-key blocks (two tiles of 128 and 64 keys, `_attend_rows_wide`) are FP8's, with two
    consumers and P in registers, without the FMA exponentials, the lazy max or the pin; ``seq``
    need not be a multiple of 192 (the last block is masked)."""
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_n"):
        flash_attention_gluon(q, q, q, block_n=192)
    for kwargs in (dict(consumers=3), dict(fma_exp2=2), dict(lazy_rescale=True), dict(pin_softmax=True),
                   dict(prepared=prepare_gluon_fp8(q, q, q, 192, p_in_registers=False))):
        with pytest.raises(ValueError, match="192-key blocks need"):
            flash_attention_gluon_fp8(q, q, q, block_n=192, compile_only=True, **kwargs)
    q8, k8, v8t, (q_scales, k_scales, v_scales), _ = prepare_gluon_fp8(q, q, q, 192)
    assert k8.shape == q.shape and v8t.shape == (1, 2, 64, 256) and k_scales.shape == (1, 2, 2)


def test_refuses_three_consumers_out_of_scope():
    """Three consumer warpgroups (192-row tiles) without a mask only (the causal schedules pair
    up 128-row tiles), in a warp-specialized kernel; at head dim 128 with 64-key tiles unless
    told otherwise (`default_tiles`)."""
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="consumers must be one of"):
        flash_attention_gluon(q, q, q, consumers=4)
    for kwargs in (dict(variant="pipelined"), dict(causal=True)):
        with pytest.raises(ValueError, match="three consumers"):
            flash_attention_gluon(q, q, q, consumers=3, **kwargs)
    with pytest.raises(ValueError, match="three consumers"):
        flash_attention_gluon_fp8(q, q, q, consumers=3, causal=True)
    assert default_tiles(128, False, 3) == default_tiles(128, True, 3) == (64, 4)
    assert default_tiles(64, False, 3) == default_tiles(64) and default_tiles(64, True, 3) == default_tiles(64, True)


def test_backward_refuses_what_it_does_not_cover():
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 256)
    with pytest.raises(ValueError, match="lse"):
        flash_attention_gluon_backward(q, q, q, q, q, lse[:, :, :128])
    with pytest.raises(ValueError, match="must be q's shape"):
        flash_attention_gluon_backward(q[:, :1], q, q, q, q, lse)
    with pytest.raises(ValueError, match="block_m"):
        flash_attention_gluon_backward(q, q, q, q, q, lse, block_m=32)
    with pytest.raises(ValueError, match="shared memory"):  # 128 x 128 tiles at head dim 128: 320 KiB
        flash_attention_gluon_backward(q, q, q, q, q, lse, block_m=128)
    with pytest.raises(ValueError, match="dq_reduce"):
        flash_attention_gluon_backward(q, q, q, q, q, lse, dq_reduce="sum")
    with pytest.raises(ValueError, match="head_group"):
        flash_attention_gluon_backward(q, q, q, q, q, lse, head_group=0)
    with pytest.raises(ValueError, match="multiple of 128"):
        short = torch.zeros(1, 2, 200, 64, dtype=torch.bfloat16)
        flash_attention_gluon_backward(short, short, short, short, short, lse[:, :, :200])
    # The shared-memory arithmetic matches what the compiler allocates (see the sm_90 facts).
    assert bwd_shared_bytes(128, 64, 2) == 192 * 1024 and bwd_shared_bytes(64, 64, 3) == 128 * 1024


def test_fp8_p_key_order_relabels_the_accumulator_as_an_8bit_operand():
    """Within 16 keys, lane c of a quad holds score columns 2c, 2c+1, 2c+8, 2c+9 of the wgmma
    accumulator and keys 4c..4c+3 of an 8-bit first operand: `P_KEY_ORDER` pairs them, and
    `prepare_gluon_fp8` stores Vᵀ's keys in that order (each 16 of them, nothing else moved)."""
    for c in range(4):
        assert P_KEY_ORDER[4 * c:4 * c + 4] == (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)
    assert sorted(P_KEY_ORDER) == list(range(16))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    natural = prepare_gluon_fp8(q, k, v, p_in_registers=False)
    permuted = prepare_gluon_fp8(q, k, v)
    assert permuted[4] and not natural[4]
    for a, b in zip(natural[:2] + natural[3], permuted[:2] + permuted[3]):
        assert torch.equal(a.float(), b.float())
    order = torch.tensor(P_KEY_ORDER)
    want = natural[2].float().view(1, 2, 64, 16, 16)[..., order].reshape(1, 2, 64, 256)
    assert torch.equal(permuted[2].float(), want)
    assert not torch.equal(permuted[2].float(), natural[2].float())


def test_does_not_apply_off_the_gpu():
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    assert not gluon_applies(q, q, q)


#: Compiles every kernel for sm_90 in a fresh process (`minillm.testing.SM90_COMPILE_PRELUDE`
#: says how, and provides ``stack_bytes`` and the SASS readers).
COMPILE_SCRIPT = SM90_COMPILE_PRELUDE + r"""
import re
from minillm.kernels.ch04_flash_attention_gluon import (
    VARIANTS, default_tiles, flash_attention_gluon, flash_attention_gluon_backward, flash_attention_gluon_fp8,
    prepare_gluon_fp8,
)


def facts_of(compiled, mma):
    ptx = compiled.asm["ptx"]
    # "overlap": a wait that leaves matmuls in flight (1: P V; 2: P V and the row sums P · 1)
    return {"wgmma": ptx.count(mma),
            "overlap": re.search(r"wgmma\.wait_group\.sync\.aligned [12]\b", ptx) is not None,
            "setmaxnreg": "setmaxnreg" in ptx, "local": "ld.local" in ptx or "st.local" in ptx,
            "stack": stack_bytes(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
            "global_atomics": "atom.global" in ptx,
            # a wgmma whose first operand is registers ({...}, {...}) rather than a descriptor
            "a_from_registers": re.search(r"wgmma\.mma_async[^{]*\{[^}]*\}, \{", ptx) is not None}


facts = {}
for variant in VARIANTS:
    for head_dim in (64, 128):
        for causal in (False, True):
            q = torch.zeros(1, 4, 256, head_dim, dtype=torch.bfloat16)
            k = torch.zeros(1, 2, 256, head_dim, dtype=torch.bfloat16)
            compiled = flash_attention_gluon(q, k, k, causal=causal, variant=variant, compile_only=True)
            facts[f"{variant} {head_dim} {causal}"] = facts_of(compiled, "wgmma.mma_async")
            if variant != "pipelined":
                compiled = flash_attention_gluon(q, k, k, causal=causal, variant=variant, persistent=True, paired=True,
                                                 dynamic=True, compile_only=True)
                facts[f"{variant} dynamic {head_dim} {causal}"] = facts_of(compiled, "wgmma.mma_async")
                compiled = flash_attention_gluon_fp8(q, k, k, causal=causal, variant=variant, compile_only=True)
                facts[f"fp8 {variant} {head_dim} {causal}"] = facts_of(compiled, "e4m3.e4m3")
                compiled = flash_attention_gluon_fp8(q, k, k, causal=causal, variant=variant, compile_only=True,
                                                     prepared=prepare_gluon_fp8(q, k, k, p_in_registers=False))
                facts[f"fp8 smem {variant} {head_dim} {causal}"] = facts_of(compiled, "e4m3.e4m3")
for head_dim in (64, 128):
    q = torch.zeros(1, 4, 640, head_dim, dtype=torch.bfloat16)  # 3 tiles of 192 rows and a short one a head
    k = torch.zeros(1, 2, 640, head_dim, dtype=torch.bfloat16)
    block_n = default_tiles(head_dim, True, 3)[0]
    for variant in VARIANTS[1:]:
        compiled = flash_attention_gluon(q, k, k, variant=variant, consumers=3, compile_only=True)
        facts[f"c3 {variant} {head_dim}"] = dict(facts_of(compiled, "wgmma.mma_async"),
                                                 warps=compiled.metadata.num_warps)
        for where in ("registers", "smem"):
            compiled = flash_attention_gluon_fp8(
                q, k, k, variant=variant, consumers=3, compile_only=True,
                prepared=prepare_gluon_fp8(q, k, k, block_n, p_in_registers=where == "registers"))
            facts[f"c3 fp8 {where} {variant} {head_dim}"] = dict(facts_of(compiled, "e4m3.e4m3"),
                                                                 warps=compiled.metadata.num_warps)
for head_dim in (64, 128):
    q = torch.zeros(1, 4, 640, head_dim, dtype=torch.bfloat16)  # three 192-key blocks and a short one
    k = torch.zeros(1, 2, 640, head_dim, dtype=torch.bfloat16)
    for variant in VARIANTS[1:]:
        for causal in (False, True):
            for row_sum in (False, True):
                compiled = flash_attention_gluon_fp8(q, k, k, causal=causal, variant=variant, block_n=192,
                                                     row_sum_mma=row_sum, compile_only=True)
                facts[f"fp8 192 {variant} {head_dim} {causal} {row_sum}"] = facts_of(compiled, "e4m3.e4m3")
q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
k = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
compiled = flash_attention_gluon_fp8(q, k, k, causal=True, lazy_rescale=True, compile_only=True)
facts["fp8 lazy"] = facts_of(compiled, "e4m3.e4m3")
q = torch.zeros(1, 4, 512, 128, dtype=torch.bfloat16)
for where in ("registers", "smem"):
    compiled = flash_attention_gluon_fp8(q, q, q, block_n=256, compile_only=True,
                                         prepared=prepare_gluon_fp8(q, q, q, 256, p_in_registers=where == "registers"))
    facts[f"fp8 256 {where}"] = facts_of(compiled, "e4m3.e4m3")
q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
for fma_exp2 in (0, 2, 4):
    compiled = flash_attention_gluon_fp8(q, k, k, fma_exp2=fma_exp2, compile_only=True)
    ptx = compiled.asm["ptx"]
    facts[f"fp8 fma_exp2 {fma_exp2}"] = dict(ex2=ptx.count("ex2.approx"), shfl=ptx.count("shfl.sync"),
                                              stack=stack_bytes(compiled.asm["cubin"]))
for head_dim in (64, 128):
    q = torch.zeros(1, 4, 256, head_dim, dtype=torch.bfloat16)
    for dtype, fn, mma in (("bf16", flash_attention_gluon, "bf16.bf16"),
                           ("fp8", flash_attention_gluon_fp8, "e4m3.e4m3")):
        for row_sum in (False, True):
            compiled = fn(q, q, q, row_sum_mma=row_sum, compile_only=True)
            ptx = compiled.asm["ptx"]
            facts[f"row sum {dtype} {head_dim} {row_sum}"] = dict(
                facts_of(compiled, mma), ones_mma=len(re.findall(r"wgmma\.mma_async\S*\.m64n8k", ptx)),
                wait_2="wgmma.wait_group.sync.aligned 2" in ptx, shfl=ptx.count("shfl.sync"))
for head_dim in (64, 128):
    q = torch.zeros(1, 4, 256, head_dim, dtype=torch.bfloat16)
    for dtype, fn in (("bf16", flash_attention_gluon), ("fp8", flash_attention_gluon_fp8)):
        for variant in VARIANTS if dtype == "bf16" else VARIANTS[1:]:  # (FP8 is warp-specialized only)
            for pin in (False, True) if variant != "pipelined" else (False,):
                compiled = fn(q, q, q, variant=variant, pin_softmax=pin, compile_only=True)
                facts[f"pin {dtype} {variant} {head_dim} {pin}"] = dict(
                    exps=exps_before_wait(sass_ops(compiled.asm["cubin"])), stack=stack_bytes(compiled.asm["cubin"]))
for reduce in ("tma", "atomic", "tma_prefetch"):
    for head_dim in (64, 128):
        for causal in (False, True):
            q = torch.zeros(1, 4, 256, head_dim, dtype=torch.bfloat16)
            k = torch.zeros(1, 2, 256, head_dim, dtype=torch.bfloat16)
            compiled = flash_attention_gluon_backward(q, q, k, k, q, torch.zeros(1, 4, 256), causal=causal,
                                                      dq_reduce=reduce.split("_")[0],
                                                      prefetch_stats=reduce.endswith("prefetch"), compile_only=True)
            ptx = compiled.asm["ptx"]
            facts[f"bwd {reduce} {head_dim} {causal}"] = dict(
                facts_of(compiled, "wgmma.mma_async"), bulk_reduce="cp.reduce.async.bulk.tensor" in ptx,
                atomics=".add.v2.f32" in ptx)
            if reduce == "tma":
                compiled = flash_attention_gluon_backward(q, q, k, k, q, torch.zeros(1, 4, 256), causal=causal,
                                                          persistent=True, compile_only=True)
                facts[f"bwd persistent {head_dim} {causal}"] = facts_of(compiled, "wgmma.mma_async")
json.dump(facts, sys.stdout)
"""


@pytest.fixture(scope="module")
def sm90_compiled():
    """``{"variant head_dim causal": facts of its PTX}`` for every kernel, compiled for sm_90."""
    return compile_for_sm90(COMPILE_SCRIPT)


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS + tuple(f"fp8 {v}" for v in VARIANTS[1:])
                         + tuple(f"fp8 smem {v}" for v in VARIANTS[1:])
                         + tuple(f"{v} dynamic" for v in VARIANTS[1:]))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_compiles_for_sm90(sm90_compiled, variant, head_dim, causal):
    """Asynchronous wgmma (in FP8: e4m3 ones), register reallocation in the warp-specialized
    kernels only, no spills, shared memory within an SM's. A warp-specialized kernel claims its
    tiles with a global atomic when asked (``dynamic``) and by default under a causal mask."""
    facts = sm90_compiled[f"{variant} {head_dim} {causal}"]
    assert facts["global_atomics"] == (variant.endswith("dynamic") or (causal and variant != "pipelined"))
    assert facts["wgmma"] > 0
    assert facts["overlap"]  # S_j retired while P V stays in flight
    assert facts["setmaxnreg"] == (variant != "pipelined")  # registers moved to the consumers
    assert not facts["local"]  # nothing spilled by the compiler
    if causal and variant in ("fp8 ws", "fp8 ws_pingpong"):
        # P in fp32 across the loop and the mask: ptxas spills 8 bytes with Triton 3.6 (whose
        # kernels the benchmarks time), 400-576 with 3.9 (see `prepare_gluon_fp8`)
        assert facts["stack"] <= (8 if triton.__version__.startswith("3.6") else 576)
    else:
        assert facts["stack"] == 0  # nor by ptxas
    assert facts["shared"] <= 227 * 1024
    assert facts["a_from_registers"] == (not variant.startswith("fp8 smem"))  # P·V reads P from registers


@sm90_compile_mark(GLUON_VERSIONS)
def test_wide_fp8_tiles_compile_for_sm90(sm90_compiled):
    """256-key FP8 tiles at head dim 128: with P through shared memory they fit an SM's shared
    memory (just: two stages of K and Vᵀ, Q, the output's buffers and P) without spills (Triton
    3.9; 3.6's ptxas spilled 6 registers, ``bench/results/raw/nvidia-h200.gluon_fp8_wide_tiles_
    spills.log``); with P held in fp32 in registers, 128 values more a thread, ptxas spills."""
    smem, registers = sm90_compiled["fp8 256 smem"], sm90_compiled["fp8 256 registers"]
    assert smem["wgmma"] > 0 and smem["overlap"] and not smem["a_from_registers"]
    assert 200 * 1024 < smem["shared"] <= 227 * 1024
    assert smem["stack"] <= (32 if triton.__version__.startswith("3.6") else 0)
    assert registers["a_from_registers"] and registers["stack"] > 0


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("row_sum", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_192_key_blocks_compile_for_sm90(sm90_compiled, variant, head_dim, causal, row_sum):
    """FP8's 192-key blocks: e4m3 wgmma with P from registers, in 240 registers a consumer.
    P·V starts before the scores (`_attend_rows_wide`), so that P is e4m3 (48 registers) by the
    time the score accumulators (96) are taken; held in fp32 instead, as the 128-key loop holds
    it, it would need 48 more than there are. With Triton 3.6 (the benchmarks') ptxas spills
    8 bytes a thread at most (one register pair, and mostly none); 3.9's up to 248 bytes at
    head dim 128."""
    facts = sm90_compiled[f"fp8 192 {variant} {head_dim} {causal} {row_sum}"]
    assert facts["wgmma"] > 0 and facts["a_from_registers"] and facts["setmaxnreg"] and not facts["local"]
    if triton.__version__.startswith("3.6"):
        assert facts["stack"] <= 8
    else:
        assert facts["stack"] <= 256


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_three_consumers_compile_for_sm90(sm90_compiled, variant, head_dim):
    """Three consumer warpgroups and the loader's: 16 warps, with 160 registers a consumer
    thread. At head dim 64 (128-key tiles) in bf16 (Q in six buffers of 64 rows, four stages of
    K and V: 180,648 bytes of shared memory) and in FP8 with P through shared memory nothing
    spills; with P kept in fp32 in registers until the matmul, 64 values more a thread, ptxas
    spills (240-300 bytes). At head dim 128 the default 64-key tiles leave room for all three."""
    for key in (f"c3 {variant} {head_dim}", f"c3 fp8 smem {variant} {head_dim}",
                f"c3 fp8 registers {variant} {head_dim}"):
        facts = sm90_compiled[key]
        assert facts["warps"] == 16 and facts["setmaxnreg"] and facts["wgmma"] > 0 and facts["overlap"]
        assert not facts["local"] and facts["shared"] <= 227 * 1024
        assert facts["a_from_registers"] == ("smem" not in key)
        assert (facts["stack"] > 0) == ("registers" in key and head_dim == 64)


@sm90_compile_mark(GLUON_VERSIONS)
def test_exp2_on_fma_compiles_for_sm90(sm90_compiled):
    """``fma_exp2=N`` takes one in N of P's exponentials off the special-function unit (PTX
    ``ex2.approx``; the rest, and the rescaling factors, stay) without moving data between
    threads (no extra shuffles) or spilling."""
    none, half, quarter = (sm90_compiled[f"fp8 fma_exp2 {n}"] for n in (0, 2, 4))
    p_share = none["ex2"] - half["ex2"]  # half of P's exponentials
    assert p_share > 0 and none["ex2"] - quarter["ex2"] == p_share // 2
    assert none["shfl"] == half["shfl"] == quarter["shfl"]
    assert none["stack"] == half["stack"] == quarter["stack"] == 0


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_row_sum_on_tensor_cores_compiles_for_sm90(sm90_compiled, dtype, head_dim):
    """``row_sum_mma``: a third matmul of width 8 (P times the ones) per block, started after
    P·V, so that the softmax waits for S with two groups in flight instead of one; the
    shuffles of the row sum are gone (those of the row max stay, half as many), and the
    operand P is read from the registers that hold it for P·V: no spills."""
    plain, ones = (sm90_compiled[f"row sum {dtype} {head_dim} {flag}"] for flag in (False, True))
    assert plain["ones_mma"] == 0 and ones["ones_mma"] > 0
    assert ones["wait_2"] and not plain["wait_2"]
    assert ones["shfl"] < plain["shfl"]
    assert ones["a_from_registers"] and not ones["local"] and ones["stack"] == plain["stack"] == 0


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("dtype, variant", [("bf16", v) for v in VARIANTS] + [("fp8", v) for v in VARIANTS[1:]])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_pinned_softmax_stays_ahead_of_the_wait_in_the_machine_code(sm90_compiled, dtype, variant, head_dim):
    """In the machine code of the key loop, ptxas puts the wait for the P·V in flight before the
    softmax's exponentials (at most the two rescaling factors' ahead of it), in all three
    kernels: the overlap that the source's order allows does not happen. ``pin_softmax`` keeps
    all 64 of P's a thread in front of the wait (`_pin_before_wait`), without spilling.
    (Chapter 4 measures both.)"""
    plain = sm90_compiled[f"pin {dtype} {variant} {head_dim} False"]
    assert plain["exps"] <= 2, plain
    if variant != "pipelined":  # (the switch is the warp-specialized kernels')
        pinned = sm90_compiled[f"pin {dtype} {variant} {head_dim} True"]
        assert pinned["exps"] >= 64, pinned
        assert pinned["stack"] == 0


@sm90_compile_mark(GLUON_VERSIONS)
def test_lazy_rescale_compiles_for_sm90(sm90_compiled):
    """The lazy running max (causal FP8, the tightest for registers): wgmma still asynchronous
    with P·V in flight across the softmax, no spills in the PTX, and ptxas's as small as the
    default kernel's with Triton 3.6 (which the benchmarks ran); 3.9's ptxas spills 728
    bytes (not timed)."""
    facts = sm90_compiled["fp8 lazy"]
    assert facts["wgmma"] > 0 and facts["overlap"] and not facts["local"]
    assert facts["stack"] <= (8 if triton.__version__.startswith("3.6") else 768)


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("reduce", ["tma", "atomic", "tma_prefetch"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_compiles_for_sm90(sm90_compiled, reduce, head_dim, causal):
    """The five matmuls as asynchronous wgmma, registers moved to the consumers, and dQ added
    the way asked: one bulk tensor reduction, or vector atomics (``tma_prefetch``: the bulk
    reduction, with L and D loaded a step ahead). No spills at head dim 64. At 128 ptxas
    spills a few registers of the 240 (56-144 bytes of stack with Triton 3.6 and 3.9), and
    many more with the prefetch (256-464 bytes), which is why that is off there by default."""
    facts = sm90_compiled[f"bwd {reduce} {head_dim} {causal}"]
    assert facts["wgmma"] > 0 and facts["setmaxnreg"] and facts["overlap"]  # Sᵀ retired while dPᵀ runs
    assert not facts["local"]
    if head_dim == 64:
        assert facts["stack"] == 0
    elif reduce != "tma_prefetch":
        assert facts["stack"] <= 160  # the defaults' spills stay small (atomics: up to 144 bytes)
    assert facts["shared"] <= 227 * 1024
    assert facts["bulk_reduce"] == reduce.startswith("tma")
    assert facts["atomics"] == (reduce == "atomic")


@sm90_compile_mark(GLUON_VERSIONS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_backward_compiles_for_sm90(sm90_compiled, head_dim, causal):
    """The persistent backward claims its key tiles with a global atomic. The loop around the
    tiles keeps a few more values live: at head dim 64 ptxas spills at most 16 bytes, at 128
    150-230 (against 56-144 with one tile per program)."""
    facts = sm90_compiled[f"bwd persistent {head_dim} {causal}"]
    assert facts["wgmma"] > 0 and facts["setmaxnreg"] and facts["global_atomics"] and not facts["local"]
    assert facts["stack"] <= (16 if head_dim == 64 else 256)
    assert facts["shared"] <= 227 * 1024


# ----------------------------------------------------------------------------------------
# GPU: against the float64 reference
# ----------------------------------------------------------------------------------------
def check_against_reference(q, k, v, causal, seed, scale=None, **kwargs):
    """`flash_attention_gluon` (with ``kwargs``) against the float64 reference: out and lse."""
    out, lse = flash_attention_gluon(q, k, v, causal=causal, scale=scale, **kwargs)
    ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, scale=scale)
    assert_close(out, ref_out, torch.bfloat16, "out", seed)
    assert_close(lse, ref_lse, torch.bfloat16, "lse", seed)


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, q_heads, kv_heads, seq", [(2, 3, 3, 128), (1, 4, 1, 640), (2, 8, 2, 1152)])
def test_matches_reference_on_gpu(variant, head_dim, causal, batch, q_heads, kv_heads, seq, gen, seed):
    q, k, v = make_qkv(batch, q_heads, kv_heads, seq, head_dim, "cuda", gen)
    assert gluon_applies(q, k, v)
    check_against_reference(q, k, v, causal, seed, variant=variant)


def on_hopper_warp_specialized(test):
    """A GPU test (sm_90) over the warp-specialized variants, both head dims, causal or not."""
    for mark in (pytest.mark.parametrize("causal", [False, True]), pytest.mark.parametrize("head_dim", [64, 128]),
                 pytest.mark.parametrize("variant", VARIANTS[1:]),
                 pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU"),
                 pytest.mark.gpu):
        test = mark(test)
    return test


@on_hopper_warp_specialized
@pytest.mark.parametrize("programs", [True, 3])
def test_persistent_matches_reference_on_gpu(variant, head_dim, causal, programs, gen, seed):
    """A persistent grid: one program per SM, or 3 programs that each take a dozen tiles of
    different lengths (causal), so the rings, the Q buffers and the ping-pong turns run on
    across tiles."""
    q, k, v = make_qkv(2, 4, 2, 640, head_dim, "cuda", gen)
    check_against_reference(q, k, v, causal, seed, variant=variant, persistent=programs)


@on_hopper_warp_specialized
@pytest.mark.parametrize("programs, paired, dynamic, head_group",
                         [(True, True, True, 3), (3, False, True, 1), (3, True, False, 5), (False, False, False, 8),
                          (False, True, False, 1)])
def test_tile_orders_match_reference_on_gpu(variant, head_dim, causal, programs, paired, dynamic, head_group, gen,
                                            seed):
    """Every tile once, whatever the order: 5 tiles a head (causal pairs: ranks 0 and 4, 1 and
    3, and 2 alone), heads grouped by 3, 5 or 8 of 8 (the last group smaller but for 8),
    persistent programs claiming units from the atomic counter (one per SM, or 3 that take a
    dozen tiles each) or in turn, or one program per unit."""
    q, k, v = make_qkv(2, 4, 2, 640, head_dim, "cuda", gen)
    check_against_reference(q, k, v, causal, seed, variant=variant, persistent=programs, paired=paired,
                            dynamic=dynamic, head_group=head_group)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("block_n, num_stages", [(64, 2), (64, 3), (128, 2)])
@pytest.mark.parametrize("tree_reductions", [False, True])
@pytest.mark.parametrize("variant", ["ws", "ws_pingpong"])
def test_tiles_and_scale_on_gpu(block_n, num_stages, tree_reductions, variant, gen, seed):
    """Other tiles and a scale of the caller's, and the softmax's row max and sum as trees
    (folded from 64 or 128 columns)."""
    q, k, v = make_qkv(1, 2, 2, 384, 128, "cuda", gen)
    check_against_reference(q, k, v, True, seed, scale=0.3, block_n=block_n, num_stages=num_stages,
                            tree_reductions=tree_reductions, variant=variant)


@on_hopper_warp_specialized
@pytest.mark.parametrize("programs", [False, 3])
@pytest.mark.parametrize("p_in_registers", [True, False])
def test_fp8_within_bound_on_gpu(variant, head_dim, causal, programs, p_in_registers, gen, seed):
    # Scores with a spread of a few units and 256 keys: the output is then not a near-uniform
    # average of V (close to 0), and the bound, relative to it, says something.
    q, k, v = make_qkv(1, 4, 2, 256, head_dim, "cuda", gen, scale=2.0)
    prepared = prepare_gluon_fp8(q, k, v, p_in_registers=p_in_registers)
    out, lse = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, prepared=prepared,
                                         persistent=programs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(lse).all()
    # The reference multiplies the same quantized values with V's keys in their own order.
    qd, kd, vd = fp8_quantized_inputs(prepare_gluon_fp8(q, k, v, p_in_registers=False), 256, 256, 64, 128)
    assert_within_fp8_bound(out, qd, kd, vd, 64, 128, causal, vd.shape[2], f"gluon fp8 {variant}", seed,
                            rounded_sum=True)


@on_hopper_warp_specialized
@pytest.mark.parametrize("seq, programs", [(128, False), (384, 3), (640, False), (896, True)])
@pytest.mark.parametrize("row_sum_mma", [True, False])
def test_fp8_192_key_blocks_within_bound_on_gpu(variant, head_dim, causal, seq, programs, row_sum_mma, gen, seed):
    """192-key blocks (K's scale per 192 keys) within FP8's bound, at lengths whose last block is
    short by 64 keys (128: the only block; 640), full (384) or short by 128 (896), on one program
    per tile, 3 that take several and one per SM. The logsumexp against exact attention of the
    quantized inputs: within 0.02 with the row sums on the CUDA cores, and with them on the
    tensor cores within ``-log(1 - 2^-4)`` = 0.065 more, since those sum P as rounded to e4m3
    (each value within 2^-4 of itself). A 64-key block lost or taken twice moves it by about
    ``log(1 ± 64/N)``, 0.07 or more at these lengths: the tighter check catches that."""
    q, k, v = make_qkv(1, 4, 2, seq, head_dim, "cuda", gen, scale=2.0)
    out, lse = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, block_n=192,
                                         prepared=prepare_gluon_fp8(q, k, v, 192), persistent=programs,
                                         row_sum_mma=row_sum_mma)
    assert out.dtype == torch.bfloat16 and torch.isfinite(lse).all()
    qd, kd, vd = fp8_quantized_inputs(prepare_gluon_fp8(q, k, v, 192, p_in_registers=False), seq, seq, 64, 192)
    assert_within_fp8_bound(out, qd, kd, vd, 64, 192, causal, vd.shape[2], f"gluon fp8 192 {variant}", seed,
                            rounded_sum=row_sum_mma, nonvacuous=causal or seq <= 384)
    _, want_lse = attention(qd, kd, vd, causal=causal)
    assert np.abs(to_numpy(lse) - want_lse).max() <= 2e-2 + (0.065 if row_sum_mma else 0.0), f"seed {seed}"


@on_hopper_warp_specialized
def test_fp8_192_key_blocks_as_accurate_as_128_on_gpu(variant, head_dim, causal, gen, seed):
    """192-key blocks against the 128-key kernel at 1,664 keys (8 blocks and 128 keys, GQA 2, 3
    persistent programs): their errors against exact attention of the bf16 inputs are FP8's
    and the same size (K's scales are per 192 and per 128 keys)."""
    q, k, v = make_qkv(2, 4, 2, 1664, head_dim, "cuda", gen, scale=2.0)
    want, _ = attention(*(to_numpy(t) for t in (q, k, v)), causal=causal)
    errs = []
    for block_n in (192, 128):
        out, lse = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, block_n=block_n,
                                             persistent=3, row_sum_mma=True)
        assert torch.isfinite(lse).all()
        errs.append(np.linalg.norm(to_numpy(out) - want) / np.linalg.norm(want))
    assert errs[1] < 0.15, f"seed {seed}: the 128-key kernel's error {errs[1]:.3f} is not FP8's"
    assert errs[0] <= 1.1 * errs[1] + 0.005, f"seed {seed}: 192-key blocks {errs[0]:.4f}, 128-key {errs[1]:.4f}"


def on_hopper_three_consumers(test):
    """A GPU test (sm_90) over both warp-specialized variants with three consumers, both head
    dims, and lengths whose last 192-row tile is short by 64 rows (128, 896), by 128 (640) or
    full (384, 1152), on one program per tile, one per SM and two programs that take many
    tiles each."""
    for mark in (pytest.mark.parametrize("programs", [False, True, 2]),
                 pytest.mark.parametrize("seq", [128, 384, 640, 896, 1152]),
                 pytest.mark.parametrize("head_dim", [64, 128]),
                 pytest.mark.parametrize("variant", VARIANTS[1:]),
                 pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU"),
                 pytest.mark.gpu):
        test = mark(test)
    return test


@on_hopper_three_consumers
def test_three_consumers_match_reference_on_gpu(variant, head_dim, seq, programs, gen, seed):
    q, k, v = make_qkv(2, 4, 2, seq, head_dim, "cuda", gen)
    check_against_reference(q, k, v, False, seed, variant=variant, persistent=programs, consumers=3)


@on_hopper_three_consumers
def test_fp8_three_consumers_within_bound_on_gpu(variant, head_dim, seq, programs, gen, seed):
    """Within FP8's bound at every length, and close to the two-consumer kernel on the same
    quantized inputs: from 640 keys on the bound of random inputs comes within half of the
    output's own size (an average of many values of V), so a lost block is caught by the
    comparison instead (it would move the output by about its size). At head dim 128 the
    default tiles have 64 keys, and so have K's scales."""
    q, k, v = make_qkv(1, 4, 2, seq, head_dim, "cuda", gen, scale=2.0)
    block_n = default_tiles(head_dim, True, 3)[0]
    qd, kd, vd = fp8_quantized_inputs(prepare_gluon_fp8(q, k, v, block_n, p_in_registers=False), seq, seq, 64,
                                      block_n)
    for p_in_registers in (True, False):
        prepared = prepare_gluon_fp8(q, k, v, block_n, p_in_registers=p_in_registers)
        out, lse = flash_attention_gluon_fp8(q, k, v, variant=variant, prepared=prepared, persistent=programs,
                                             consumers=3)
        assert out.dtype == torch.bfloat16 and torch.isfinite(lse).all()
        assert_within_fp8_bound(out, qd, kd, vd, 64, block_n, False, vd.shape[2], f"gluon fp8 c3 {variant}", seed,
                                nonvacuous=seq <= 384)
        two, two_lse = flash_attention_gluon_fp8(q, k, v, variant=variant, prepared=prepared, block_n=block_n,
                                                 row_sum_mma=False)  # (its row sums as three consumers take them)
        assert (out.float() - two.float()).norm() <= 1e-2 * two.float().norm(), f"seed {seed}"
        assert (lse - two_lse).abs().max() <= 1e-3, f"seed {seed}"


@on_hopper_warp_specialized
@pytest.mark.parametrize("p_in_registers", [True, False])
def test_fp8_wide_tiles_within_bound_on_gpu(variant, head_dim, causal, p_in_registers, gen, seed):
    """256-key tiles (K's scale per 256 keys) within FP8's bound: under a causal mask 768 keys,
    three tiles a head, the first 128-row tile's one block half past the tile's last row;
    without one 256 keys (with more, the output of random inputs averages out to the size of
    the bound, and the bound would say little: the next test covers longer rows)."""
    seq = 768 if causal else 256
    q, k, v = make_qkv(2, 4, 2, seq, head_dim, "cuda", gen, scale=2.0)
    prepared = prepare_gluon_fp8(q, k, v, 256, p_in_registers=p_in_registers)
    out, lse = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, prepared=prepared, block_n=256)
    assert torch.isfinite(lse).all()
    qd, kd, vd = fp8_quantized_inputs(prepare_gluon_fp8(q, k, v, 256, p_in_registers=False), seq, seq, 64, 256)
    assert_within_fp8_bound(out, qd, kd, vd, 64, 256, causal, vd.shape[2], f"gluon fp8 256 {variant}", seed)


@on_hopper_warp_specialized
@pytest.mark.parametrize("p_in_registers", [True, False])
def test_fp8_wide_tiles_as_accurate_as_narrow_ones_on_gpu(variant, head_dim, causal, p_in_registers, gen, seed):
    """256-key tiles against 128-key ones on the same e4m3 values (each 256 keys' scale given
    to both of its 128-key halves), at 768 keys, GQA 2, on 3 persistent programs that take
    several tiles each: their errors against exact attention of the bf16 inputs are FP8's and
    the same size (the tiles change only where P is rounded; the benchmark's 2k-16k points
    agree to three digits). A lost or repeated tile would move the output by 30-80 %."""
    q, k, v = make_qkv(2, 4, 2, 768, head_dim, "cuda", gen, scale=2.0)
    wide = prepare_gluon_fp8(q, k, v, 256, p_in_registers=p_in_registers)
    q8, k8, v8t, (q_scales, k_scales, v_scales), flag = wide
    narrow = (q8, k8, v8t, (q_scales, k_scales.repeat_interleave(2, dim=-1), v_scales), flag)
    want, _ = attention(*(to_numpy(t) for t in (q, k, v)), causal=causal)
    errs = []
    for prepared, block_n in ((wide, 256), (narrow, 128)):
        out, lse = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, prepared=prepared,
                                             block_n=block_n, persistent=3, row_sum_mma=False)  # (like for like)
        assert torch.isfinite(lse).all()
        errs.append(np.linalg.norm(to_numpy(out) - want) / np.linalg.norm(want))
    assert errs[1] < 0.15, f"seed {seed}: the 128-key kernel's error {errs[1]:.3f} is not FP8's"
    assert errs[0] <= 1.1 * errs[1] + 0.005, f"seed {seed}: 256-key tiles {errs[0]:.4f}, 128-key {errs[1]:.4f}"


@on_hopper_warp_specialized
def test_fp8_p_in_registers_matches_shared_memory_on_gpu(variant, head_dim, causal, gen, seed):
    """P read from registers (keys of Vᵀ permuted) and from shared memory: the same products,
    summed by the tensor cores in another order, at 640 keys and GQA 2. So are the row sums
    (``P · 1``), whose ~14-bit accumulation (`ch04_fp8.FP8_ACCUMULATOR_BITS`) over 20 steps of 32 keys
    moves ℓ by up to about ``20 · 2^-13``, and the logsumexp by as much."""
    q, k, v = make_qkv(2, 4, 2, 640, head_dim, "cuda", gen, scale=2.0)
    outs = [flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant,
                                      prepared=prepare_gluon_fp8(q, k, v, p_in_registers=flag))
            for flag in (True, False)]
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=3e-3, rtol=0)


@on_hopper_warp_specialized
def test_pinned_softmax_computes_the_same_bits_on_gpu(variant, head_dim, causal, gen, seed):
    """``pin_softmax`` changes where the machine code waits, not what it computes: the same output
    and logsumexp bit for bit, in bf16 and FP8 (row sums on the tensor cores and on the CUDA
    cores), persistent or not, at 640 keys and GQA 2."""
    q, k, v = make_qkv(2, 4, 2, 640, head_dim, "cuda", gen)
    prepared = prepare_gluon_fp8(q, k, v)
    calls = ((flash_attention_gluon, {}), (flash_attention_gluon, dict(persistent=3)),
             (flash_attention_gluon_fp8, dict(prepared=prepared)),
             (flash_attention_gluon_fp8, dict(prepared=prepared, row_sum_mma=False)))
    for fn, kw in calls:
        out, lse = fn(q, k, v, causal=causal, variant=variant, **kw)
        out_pinned, lse_pinned = fn(q, k, v, causal=causal, variant=variant, pin_softmax=True, **kw)
        assert torch.equal(out, out_pinned) and torch.equal(lse, lse_pinned), f"seed {seed}"


@on_hopper_warp_specialized
@pytest.mark.parametrize("fma_exp2", [2, 4, 8])
def test_fp8_exp2_on_fma_within_bound_on_gpu(variant, head_dim, causal, fma_exp2, gen, seed):
    """A share of P's exponentials computed by the polynomial on the FMA units: within FP8's
    bound, and the logsumexp (from P in fp32, before any e4m3 rounding) within the
    polynomial's relative error of the kernel's with every exponential on MUFU. (The row sums on
    the CUDA cores, from P in fp32: summed from P as rounded, an exponential that lands on the
    other side of a rounding point would move ℓ by a step of e4m3.)"""
    q, k, v = make_qkv(1, 4, 2, 256, head_dim, "cuda", gen, scale=2.0)
    prepared = prepare_gluon_fp8(q, k, v)
    out, lse = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, prepared=prepared,
                                         fma_exp2=fma_exp2, row_sum_mma=False)
    _, lse_mufu = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, prepared=prepared, fma_exp2=0,
                                            row_sum_mma=False)
    # l is a sum of positive terms, each off by at most EXP2_POLY_REL_ERROR: so is l, and log l
    # by about as much (plus fp32 rounding of the sums, which the two orders share).
    torch.testing.assert_close(lse, lse_mufu, atol=2 * EXP2_POLY_REL_ERROR, rtol=0)
    qd, kd, vd = fp8_quantized_inputs(prepare_gluon_fp8(q, k, v, p_in_registers=False), 256, 256, 64, 128)
    assert_within_fp8_bound(out, qd, kd, vd, 64, 128, causal, vd.shape[2], f"gluon fp8 {variant} fma {fma_exp2}",
                            seed, p_rel_error=EXP2_POLY_REL_ERROR)


def growing_keys(k, step=1.0):
    """``k`` with its j-th block of 128 keys scaled by ``1 + step·j``: the scores' row max then
    grows from block to block, by more than `LAZY_RESCALE_SLACK` at the test's scale, so that a
    lazy max does move (and the accumulator is rescaled) now and then."""
    blocks = torch.arange(k.shape[2], device=k.device) // 128
    return (k.float() * (1 + step * blocks)[:, None]).to(k.dtype)


@on_hopper_warp_specialized
@pytest.mark.parametrize("growing", [False, True])
def test_lazy_rescale_matches_reference_on_gpu(variant, head_dim, causal, growing, gen, seed):
    """bf16 with a lazy running max (P up to 2^8 before the final division) against float64."""
    q, k, v = make_qkv(2, 4, 2, 640, head_dim, "cuda", gen, scale=1.5)
    check_against_reference(q, growing_keys(k) if growing else k, v, causal, seed, variant=variant,
                            lazy_rescale=True)


@on_hopper_warp_specialized
@pytest.mark.parametrize("growing", [False, True])
def test_fp8_lazy_rescale_within_bound_on_gpu(variant, head_dim, causal, growing, gen, seed):
    """FP8 with a lazy running max (P up to 2^8, within e4m3's range) within FP8's bound."""
    q, k, v = make_qkv(1, 4, 2, 256, head_dim, "cuda", gen, scale=2.0)
    k = growing_keys(k) if growing else k
    out, lse = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, lazy_rescale=True)
    assert torch.isfinite(lse).all()
    qd, kd, vd = fp8_quantized_inputs(prepare_gluon_fp8(q, k, v, p_in_registers=False), 256, 256, 64, 128)
    assert_within_fp8_bound(out, qd, kd, vd, 64, 128, causal, vd.shape[2], f"gluon fp8 lazy {variant}", seed,
                            rounded_sum=True)


@on_hopper_warp_specialized
@pytest.mark.parametrize("programs", [False, 3])
def test_row_sum_on_tensor_cores_matches_reference_on_gpu(variant, head_dim, causal, programs, gen, seed):
    """bf16 with the row sums of P from the tensor cores (``P · 1``), against float64: 5 tiles
    a head and GQA 2, one program per tile or 3 persistent ones."""
    q, k, v = make_qkv(2, 4, 2, 640, head_dim, "cuda", gen, scale=1.5)
    check_against_reference(q, k, v, causal, seed, variant=variant, persistent=programs, row_sum_mma=True)


@on_hopper_warp_specialized
@pytest.mark.parametrize("p_in_registers", [True, False])
def test_fp8_row_sum_on_tensor_cores_within_bound_on_gpu(variant, head_dim, causal, p_in_registers, gen, seed):
    """FP8 with the row sums from the tensor cores: the sum of P as rounded to e4m3 (what P·V
    multiplied) instead of P in fp32. The output stays within FP8's bound; the logsumexp moves
    by at most the log of e4m3's rounding of a sum of normal e4m3 numbers, ``-log(1 - 2^-4)``
    (the smaller, subnormal weights of these rows carry too little of the sum to move it more)."""
    q, k, v = make_qkv(1, 4, 2, 256, head_dim, "cuda", gen, scale=2.0)
    prepared = prepare_gluon_fp8(q, k, v, p_in_registers=p_in_registers)
    out, lse = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, prepared=prepared,
                                         row_sum_mma=True)
    _, lse_cores = flash_attention_gluon_fp8(q, k, v, causal=causal, variant=variant, prepared=prepared,
                                             row_sum_mma=False)
    torch.testing.assert_close(lse, lse_cores, atol=-np.log1p(-2.0**-4) + 1e-3, rtol=0)
    assert (lse - lse_cores).abs().max() > 0  # (a different sum, or the switch did nothing)
    qd, kd, vd = fp8_quantized_inputs(prepare_gluon_fp8(q, k, v, p_in_registers=False), 256, 256, 64, 128)
    assert_within_fp8_bound(out, qd, kd, vd, 64, 128, causal, vd.shape[2], f"gluon fp8 row sum {variant}", seed,
                            rounded_sum=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("fp8", [False, True])
def test_row_sum_on_tensor_cores_with_three_consumers_on_gpu(variant, fp8, gen, seed):
    """The ones are shared by three consumers (192-row tiles, the last one short), head dim 64."""
    q, k, v = make_qkv(2, 4, 2, 640, 64, "cuda", gen, scale=2.0 if fp8 else 1.0)
    if not fp8:
        check_against_reference(q, k, v, False, seed, variant=variant, consumers=3, persistent=2, row_sum_mma=True)
        return
    prepared = prepare_gluon_fp8(q, k, v, p_in_registers=False)  # (three consumers fit with P in shared memory)
    out, _ = flash_attention_gluon_fp8(q, k, v, variant=variant, prepared=prepared, consumers=3, persistent=2,
                                       row_sum_mma=True)
    qd, kd, vd = fp8_quantized_inputs(prepared, 640, 640, 64, 128)
    assert_within_fp8_bound(out, qd, kd, vd, 64, 128, False, vd.shape[2], f"gluon fp8 c3 row sum {variant}", seed,
                            rounded_sum=True)


@on_hopper_warp_specialized
def test_bf16_exp2_on_fma_matches_reference_on_gpu(variant, head_dim, causal, gen, seed):
    """The bf16 kernel with a quarter of P's exponentials on the FMA units, against float64."""
    q, k, v = make_qkv(2, 4, 2, 640, head_dim, "cuda", gen)
    check_against_reference(q, k, v, causal, seed, variant=variant, fma_exp2=4)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, q_heads, kv_heads, seq", [(2, 3, 3, 128), (1, 4, 1, 640), (2, 8, 2, 1152)])
@pytest.mark.parametrize("dq_reduce, prefetch_stats", [("tma", False), ("atomic", False), ("tma", True)])
def test_backward_matches_reference_on_gpu(head_dim, causal, batch, q_heads, kv_heads, seq, dq_reduce, prefetch_stats,
                                           gen, seed):
    """dQ, dK, dV from the Gluon forward's out and lse, against the float64 NumPy backward: MHA,
    MQA (4:1) and GQA, lengths of 1, 5 and 9 key tiles (causal: tiles that straddle the
    diagonal and query blocks no key of a tile reaches)."""
    q, k, v = make_qkv(batch, q_heads, kv_heads, seq, head_dim, "cuda", gen)
    check_backward(q, k, v, causal, seed, gen, dq_reduce=dq_reduce, prefetch_stats=prefetch_stats)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("head_dim, block_m, num_stages", [(64, 64, 3), (64, 128, 2), (128, 64, 3)])
def test_backward_tiles_and_scale_on_gpu(head_dim, block_m, num_stages, gen, seed):
    q, k, v = make_qkv(1, 4, 2, 384, head_dim, "cuda", gen)
    check_backward(q, k, v, True, seed, gen, scale=0.3, block_m=block_m, num_stages=num_stages)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_group", [3, 64])
def test_backward_tile_orders_on_gpu(head_dim, causal, head_group, gen, seed):
    """The key tiles of 4 K/V heads in groups of 3 (then 1), or all in one group."""
    q, k, v = make_qkv(2, 8, 2, 1152, head_dim, "cuda", gen)
    check_backward(q, k, v, causal, seed, gen, head_group=head_group)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("programs, dynamic", [(True, True), (3, True), (3, False)])
def test_backward_persistent_on_gpu(head_dim, causal, programs, dynamic, gen, seed):
    """A persistent backward: one program per SM, or 3 that take a dozen key tiles each (of 36:
    4 K/V heads of 9), claimed from the counter or in turn, so that K and V, the ring and the
    dSᵀ buffers run on from one tile to the next."""
    q, k, v = make_qkv(2, 8, 2, 1152, head_dim, "cuda", gen)
    check_backward(q, k, v, causal, seed, gen, persistent=programs, dynamic=dynamic)


def check_backward(q, k, v, causal, seed, gen, scale=None, backward=None, **kwargs):
    """``backward`` (default `flash_attention_gluon_backward`, with ``kwargs``) from the Gluon
    forward's out and lse, against `fa2_backward` in float64 from the reference's out and lse."""
    dout = random_tensor(q.shape, torch.bfloat16, q.device, gen)
    out, lse = flash_attention_gluon(q, k, v, causal=causal, scale=scale)
    backward = backward or flash_attention_gluon_backward
    dq, dk, dv = backward(dout, q, k, v, out, lse, causal=causal, scale=scale, **kwargs)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    qn, kn, vn = (to_numpy(t) for t in (q, k, v))
    ref_out, ref_lse = attention(qn, kn, vn, causal=causal, scale=scale)
    rdq, rdk, rdv = fa2_backward(qn, kn, vn, ref_out, ref_lse, to_numpy(dout), causal=causal, scale=scale)
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert_grad_close(got, want, torch.bfloat16, f"{name} ({kwargs})", seed)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
def test_attention_backward_takes_the_gluon_kernel_on_hopper(gen, seed, monkeypatch):
    """`attention_backward` hands a call in the Gluon backward's scope to it (and its gradients
    are right), and one outside it (fp16) to the Triton Hopper kernels."""
    import minillm.kernels.ch04_flash_attention_gluon as glu
    from minillm.kernels.ch04_flash_attention_hopper import attention_backward, flash_attention_hopper

    calls = []
    real = glu.flash_attention_gluon_backward
    monkeypatch.setattr(glu, "flash_attention_gluon_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = make_qkv(1, 4, 2, 256, 64, "cuda", gen)
    check_backward(q, k, v, True, seed, gen, backward=attention_backward)
    assert calls == [1]
    half = [t.half() for t in (q, k, v, random_tensor(q.shape, torch.bfloat16, q.device, gen))]
    out16, lse16 = flash_attention_hopper(*half[:3], causal=True, return_lse=True)
    attention_backward(half[3], *half[:3], out16, lse16, causal=True)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("head_dim, causal, seq", [(64, False, 2048), (64, False, 1024), (128, True, 4096),
                                                   (128, False, 1152), (64, True, 640)])
def test_fastest_attention_runs_the_gluon_kernels_on_hopper(head_dim, causal, seq, gen, seed, monkeypatch):
    """In the Gluon scope `fastest_attention` runs the forward once with `fastest_forward`'s
    settings (three consumers, ping-pong or neither) and the Gluon backward once, and its out,
    lse and gradients through autograd match the float64 references."""
    import minillm.kernels.ch04_flash_attention_gluon as glu
    from minillm.kernels.ch04_flash_attention_hopper import fastest_attention, forward_kernel

    forwards, backwards = [], []
    real_fwd, real_bwd = glu.flash_attention_gluon, glu.flash_attention_gluon_backward
    monkeypatch.setattr(glu, "flash_attention_gluon",
                        lambda *a, **kw: forwards.append({k: kw[k] for k in ("variant", "consumers")})
                        or real_fwd(*a, **kw))
    monkeypatch.setattr(glu, "flash_attention_gluon_backward",
                        lambda *a, **kw: backwards.append(1) or real_bwd(*a, **kw))
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, seq, head_dim, "cuda", gen))
    dout = random_tensor(q.shape, torch.bfloat16, q.device, gen)
    assert forward_kernel(q, k, v) == "gluon"
    out, lse = fastest_attention(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    assert forwards == [fastest_forward(head_dim, causal, seq)] and backwards == [1]
    _check_step(q, k, v, dout, out, lse, causal, seed)


def _check_step(q, k, v, dout, out, lse, causal, seed):
    """A training step's out, lse and the gradients autograd left in q, k, v against the
    float64 references."""
    qn, kn, vn = (to_numpy(t.detach()) for t in (q, k, v))
    ref_out, ref_lse = attention(qn, kn, vn, causal=causal)
    assert_close(out.detach(), ref_out, torch.bfloat16, "out", seed)
    assert_close(lse, ref_lse, torch.bfloat16, "lse", seed)
    want = fa2_backward(qn, kn, vn, ref_out, ref_lse, to_numpy(dout), causal=causal)
    for name, t, w in zip(("dq", "dk", "dv"), (q, k, v), want):
        assert_grad_close(t.grad, w, torch.bfloat16, name, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="Gluon's wgmma/TMA kernels need an sm_90 GPU")
@pytest.mark.parametrize("seq, kernel, launched", [
    (640, "gluon", {"_warp_specialized_kernel", "_bwd_kernel", "_hopper_bwd_preprocess_kernel",
                    "_scale_convert_kernel"}),
    (200, "hopper", {"_hopper_fwd_kernel", "_hopper_bwd_preprocess_kernel", "_hopper_dkdv_kernel"}),
])
def test_fastest_attention_launches_cached_binaries(seq, kernel, launched, gen, seed):
    """A training step of `fastest_attention` launches its kernels through
    `minillm.kernels.base.launch`: the first step caches a binary for each kernel it launches,
    a second step on new tensors of the same shapes finds every one (the cache does not grow),
    and the launches from the cache compute the right out and gradients."""
    from minillm.kernels.base import clear_launch_cache, launch_cache
    from minillm.kernels.ch04_flash_attention_hopper import fastest_attention, forward_kernel

    def step():
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, seq, 128, "cuda", gen))
        dout = random_tensor(q.shape, torch.bfloat16, q.device, gen)
        assert forward_kernel(q, k, v) == kernel
        out, lse = fastest_attention(q, k, v, causal=True, return_lse=True)
        out.backward(dout)
        return q, k, v, dout, out, lse

    clear_launch_cache()
    step()
    cached = launch_cache()
    assert launched <= {key[0].fn.__name__ for key in cached}
    second = step()
    assert launch_cache().keys() == cached.keys()
    _check_step(*second, True, seed)
