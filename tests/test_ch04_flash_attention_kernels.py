"""Chapter 4's FlashAttention-2 kernels against float64 references.

- Forward (`flash_attention`) against `minillm.reference.ch01_naive_attention`, out and lse: MHA, GQA
  2/4/7, MQA, head dims 16-96 (also not powers of two), lengths 1/17/33/70/129, q_len !=
  kv_len both ways with bottom-right causal alignment (rows that see no key: out 0, lse
  -inf), sliding windows; outputs poisoned with NaN so an unwritten element fails.
- Every tile shape the GPU autotuner may pick is run through the interpreter too (the
  segment arithmetic must hold for BLOCK_M < BLOCK_N as well as >); the offset kv_len -
  q_len is swept through every residue of the tile sizes (off-by-ones at the diagonal only
  show at some offsets); and a test fills the keys that no block of rows may touch with
  NaN: a kernel that loads a block above the diagonal (or outside a window) instead of
  skipping it fails.
- Both ways of moving tiles, pointer arithmetic and TMA descriptors (Hopper; the
  interpreter emulates them), with outputs in NaN-filled buffers larger than the view:
  nothing outside a sequence's rows may be written.
- Varlen (`flash_attention_varlen`): a packed batch equals the reference and the dense
  kernel run sequence by sequence, forward and backward.
- Backward against float64 autograd of a plain torch implementation (itself checked
  against the NumPy reference): dQ, dK, dV, with GQA's dK/dV summed over the group, causal
  with q_len != kv_len, windows; through `flash_attention_backward` (poisoned buffers) and
  through autograd (`FlashAttentionFunction`).

CPU: small shapes under the interpreter, fp32 (exact dots) and fp16, ~60 s on 2 cores.
GPU (`make gpu`): the same plus bf16, the `gpu`-marked large shapes (bf16, D=128, N=4096,
causal, GQA; fp32 skipped there), every autotune candidate forced in turn on both load
paths, the autotuned launch itself, and offsets past 2^31 elements.
"""
import math

import numpy as np
import pytest
import torch

from minillm.costs import nominal_attention_flops
from minillm.kernels.ch04_flash_attention import (
    ABLATIONS, FWD_CONFIGS, INTERPRET_FWD_CONFIG, Packing, flash_attention, flash_attention_varlen, launch_forward,
    seq_bucket,
)
from minillm.kernels.ch04_flash_attention import (
    DKDV_CONFIGS, DQ_CONFIGS, INTERPRET_DKDV_CONFIG, INTERPRET_DQ_CONFIG, flash_attention_backward,
    flash_attention_varlen_backward, launch_backward,
)
from minillm.reference import attention, attention_mask
from minillm.testing import (
    assert_close, assert_grad_close, poisoned, random_tensor, skip_fp32_on_gpu, to_numpy,
)


@pytest.fixture(autouse=True)
def _one_config_per_kernel(monkeypatch):
    """On a GPU, launch each kernel variant with its main config instead of autotuning:
    autotuning compiles every candidate for every (head dim, causal, dtype, …) variant the
    tests touch, minutes of compiling for nothing. Every candidate is still run, once, by
    `test_every_gpu_config`, and the autotuned path by `test_autotuned_launch`."""
    monkeypatch.setenv("MINILLM_FLASH_AUTOTUNE", "0")


# ----------------------------------------------------------------------------------------
# References and helpers
# ----------------------------------------------------------------------------------------
def torch_attention(q, k, v, causal=False, scale=None, window=None):
    """Attention written out in torch, differentiable, for float64 gradients.

    ``[batch, heads, seq, dim]`` like `minillm.reference.ch01_naive_attention` (GQA by repeating the
    KV heads, bottom-right aligned masks from `attention_mask`). Returns ``(out, lse)``; a
    row that sees no key gives out 0 and lse -inf, with zero gradients."""
    q_heads, q_len, head_dim = q.shape[1:]
    kv_heads, kv_len = k.shape[1:3]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k = k.repeat_interleave(q_heads // kv_heads, dim=1)
    v = v.repeat_interleave(q_heads // kv_heads, dim=1)
    visible = torch.from_numpy(attention_mask(q_len, kv_len, causal, window)).to(q.device)
    any_visible = visible.any(-1, keepdim=True)
    s = (scale * q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    s = torch.where(any_visible, s, 0.0)  # keep fully masked rows finite: no NaN in the gradient
    p = torch.softmax(s, dim=-1) * any_visible
    lse = torch.where(any_visible[..., 0], torch.logsumexp(s, dim=-1), float("-inf"))
    return p @ v, lse


def make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen):
    q = random_tensor((batch, q_heads, q_len, head_dim), dtype, device, gen)
    k = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    v = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    return q, k, v


def reference(q, k, v, causal=False, window=None):
    """float64 ``(out, lse)`` as NumPy arrays: `minillm.reference.ch01_naive_attention` for small inputs;
    for large ones (GPU tests) `torch_attention` in float64 on the device, one batch entry and
    KV head at a time so that the score matrix stays a few hundred MB."""
    if q.numel() * k.shape[2] <= 1 << 26:
        return attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, window=window)
    group = q.shape[1] // k.shape[1]
    out = np.empty(q.shape)
    lse = np.empty(q.shape[:3])
    for b in range(q.shape[0]):
        for g in range(k.shape[1]):
            heads = slice(g * group, (g + 1) * group)
            o, l = torch_attention(q[b:b + 1, heads].double(), k[b:b + 1, g:g + 1].double(),
                                   v[b:b + 1, g:g + 1].double(), causal, None, window)
            out[b, heads], lse[b, heads] = to_numpy(o[0]), to_numpy(l[0])
    return out, lse


def reference_grads(q, k, v, dout, causal=False, scale=None, window=None):
    """float64 ``(out, dq, dk, dv)`` by autograd of `torch_attention` (on q's device)."""
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    out, _ = torch_attention(q64, k64, v64, causal, scale, window)
    out.backward(dout.to(torch.float64))
    return out.detach(), q64.grad, k64.grad, v64.grad


def exact_dtype(device):
    """The dtype of the tests that need no particular one: fp32 (exact dots) under the
    interpreter, fp16 on a GPU (see `minillm.testing.skip_fp32_on_gpu`)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.float16


def case_id(c):
    batch, hq, hkv, nq, nk, d, causal, window = c
    kind = "causal" if causal else "full"
    return f"b{batch}-h{hq}-kv{hkv}-q{nq}-k{nk}-d{d}-{kind}" + (f"-w{window}" if window else "")


# (batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window)
FWD_SMALL = [
    (1, 1, 1, 1, 1, 16, False, None),       # one query, one key
    (2, 4, 4, 17, 17, 32, True, None),      # MHA, causal, a partial block
    (1, 4, 2, 70, 70, 64, False, None),     # GQA 2:1, ragged tail block
    (1, 4, 1, 129, 129, 16, True, None),    # GQA 4:1, several diagonal blocks
    (1, 7, 1, 33, 70, 40, True, None),      # MQA, q < kv (a chunk of a prompt), head_dim 40
    (1, 14, 2, 20, 20, 24, False, None),    # GQA 7:1
    (1, 2, 1, 70, 33, 32, True, None),      # q > kv: the first rows see no key (out 0, lse -inf)
    (1, 3, 1, 1, 129, 96, True, None),      # one query over many keys, head_dim 96
    (1, 2, 1, 90, 90, 16, True, 20),        # sliding window
    (2, 2, 2, 40, 61, 16, False, 7),        # local (non-causal) window, q < kv
]
FWD_LARGE = [
    (2, 32, 8, 4096, 4096, 128, True, None),   # Llama-3-8B-like prefill
    (1, 16, 16, 2048, 2048, 64, False, None),
    (2, 16, 2, 1000, 3000, 256, True, None),   # head_dim 256, q < kv
    (1, 28, 4, 777, 1531, 96, True, 256),      # Qwen-like GQA 7:1, window
    (3, 16, 16, 513, 513, 128, False, None),
]
FWD_CASES = [pytest.param(*c, id=case_id(c)) for c in FWD_SMALL] + [
    pytest.param(*c, id=case_id(c), marks=pytest.mark.gpu) for c in FWD_LARGE
]


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window", FWD_CASES)
def test_forward(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen)
    out = poisoned(q.shape, dtype, device)
    lse = poisoned((batch, q_heads, q_len), torch.float32, device)
    got_out, got_lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    ref_out, ref_lse = reference(q, k, v, causal, window)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


def test_forward_defaults_and_scale(device, gen, seed):
    """Without out/lse the launcher allocates them; a custom scale is honoured."""
    dtype = exact_dtype(device)
    q, k, v = make_qkv(2, 4, 2, 19, 23, 32, dtype, device, gen)
    out = flash_attention(q, k, v, scale=0.3)
    assert out.shape == q.shape and out.dtype == dtype
    out2, lse = flash_attention(q, k, v, causal=True, scale=0.3, return_lse=True)
    assert lse.shape == (2, 4, 19) and lse.dtype == torch.float32
    ref_out, _ = attention(to_numpy(q), to_numpy(k), to_numpy(v), scale=0.3)
    ref_out2, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, scale=0.3)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(out2, ref_out2, dtype, "out (causal)", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


def test_forward_follows_strides(device, gen, seed):
    """q/k/v sliced out of fused projections (``[batch, seq, 3, heads, dim]`` viewed as
    ``[batch, heads, seq, dim]``), a K whose head dim is not the contiguous axis, and the
    output written into a token-major buffer: every stride is followed, nothing copied."""
    dtype = exact_dtype(device)
    batch, q_heads, kv_heads, n, head_dim = 2, 4, 2, 37, 24
    qkv = random_tensor((batch, n, q_heads + 2 * kv_heads, head_dim), dtype, device, gen)
    q = qkv[:, :, :q_heads].transpose(1, 2)
    v = qkv[:, :, q_heads + kv_heads:].transpose(1, 2)
    k_dmajor = random_tensor((batch, kv_heads, head_dim, n), dtype, device, gen)
    k = k_dmajor.transpose(2, 3)  # stride 1 along the sequence, not the head dim
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous()) and k.stride(3) != 1
    out_buf = poisoned((batch, n, q_heads, head_dim), dtype, device)
    lse_buf = poisoned((q_heads, batch, n), torch.float32, device)
    flash_attention(q, k, v, causal=True, return_lse=True, out=out_buf.transpose(1, 2), lse=lse_buf.transpose(0, 1))
    ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    assert_close(out_buf.transpose(1, 2), ref_out, dtype, "out", seed)
    assert_close(lse_buf.transpose(0, 1), ref_lse, dtype, "lse", seed)


def _distinct_tiles(configs):
    return sorted({(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs})


def _config(bm, bn):
    import triton

    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)


# Every tile shape a GPU may pick, and one with BLOCK_M < BLOCK_N (the interpreter's own
# 32 x 16 runs in every other test): (BLOCK_M, BLOCK_N).
FWD_TILES = sorted(set(_distinct_tiles(FWD_CONFIGS)) | {(16, 32)})


@pytest.mark.parametrize("bm,bn", FWD_TILES, ids=[f"{m}x{n}" for m, n in FWD_TILES])
def test_forward_tile_shapes(bm, bn, device, gen, seed):
    """The segment arithmetic (masked / unmasked / skipped blocks) for every tile shape, on
    the shapes where it is subtle: causal with q < kv and q > kv, GQA, a window."""
    dtype = exact_dtype(device)
    for q_len, kv_len, causal, window in [(150, 200, True, None), (140, 75, True, None), (130, 170, False, 45),
                                          (100, 100, True, 70)]:
        q, k, v = make_qkv(1, 2, 1, q_len, kv_len, 32, dtype, device, gen)
        out, lse = poisoned(q.shape, dtype, device), poisoned(q.shape[:3], torch.float32, device)
        launch_forward(q, k, v, Packing(1, q_len, kv_len), causal, 32 ** -0.5, window, out, lse,
                       config=_config(bm, bn))
        ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, window=window)
        what = f"(q {q_len}, kv {kv_len}, causal {causal}, window {window}, tiles {bm}x{bn})"
        assert_close(out, ref_out, dtype, f"out {what}", seed)
        assert_close(lse, ref_lse, dtype, f"lse {what}", seed)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the rows that do see NaN keys
@pytest.mark.parametrize("bm,bn", [(32, 16), (16, 32), (64, 128)], ids=["32x16", "16x32", "64x128"])
def test_blocks_outside_the_mask_are_never_read(bm, bn, device, gen, seed):
    """Causal: the key blocks past a row block's diagonal are skipped, not masked. Fill K and
    V from key ``X`` on with NaN (``X`` a multiple of both tile sizes): a kernel that loads
    such a block gets ``0 · NaN = NaN`` in its output even where the mask hides it, so the
    rows whose whole block lies before ``X`` must still be exact. Likewise, with a sliding
    window, keys before the window of every row of a block must never be read."""
    dtype = exact_dtype(device)
    cfg = _config(bm, bn)
    x = 2 * max(bm, bn)
    w = bn + 3  # the window of the second half
    n = x + w + 2 * max(bm, bn) + 7
    q, k, v = make_qkv(1, 2, 1, n, n, 16, dtype, device, gen)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, x:] = float("nan")
    v_nan[:, :, x:] = float("nan")
    out, _ = launch_forward(q, k_nan, v_nan, Packing(1, n, n), True, 0.25, None, config=cfg)
    ref_out, _ = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, scale=0.25)
    clean = x // bm * bm  # rows of blocks that end at or before key X
    assert_close(out[:, :, :clean], ref_out[:, :, :clean], dtype, "out (rows before the NaN keys)", seed)

    # Window W: the block of rows starting at m0 reads keys from floor((m0 - W + 1) / BLOCK_N) on.
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :x] = float("nan")
    v_nan[:, :, :x] = float("nan")
    out, _ = launch_forward(q, k_nan, v_nan, Packing(1, n, n), True, 0.25, w, config=cfg)
    ref_out, _ = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True, scale=0.25, window=w)
    first_clean = -(-(x + w - 1) // bm) * bm  # first row block whose window starts at or after X
    assert first_clean < n
    assert_close(out[:, :, first_clean:], ref_out[:, :, first_clean:], dtype, "out (rows after the NaN keys)", seed)


def test_alignment_sweep(device, gen, seed):
    """Where the causal diagonal (and a window's edge) crosses tile boundaries depends on
    ``kv_len - q_len`` modulo the tile sizes; an off-by-one there drops or adds a key only
    for some offsets. Sweep the offset through more than a full period of every tile the
    interpreter uses (16 and 32), forward; and the window size, with and without causal."""
    dtype = exact_dtype(device)
    q_len = 40  # a full 32-row block, then a partial one
    offsets = list(range(0, 34)) + [-1, -15, -16, -17, -20, -37]  # every residue mod 32, and q > kv
    cases = [(q_len + off, True, None) for off in offsets]
    cases += [(kv, causal, w) for kv in (40, 57) for causal in (True, False) for w in (1, 15, 16, 17, 33)]
    for kv_len, causal, window in cases:
        q, k, v = make_qkv(1, 1, 1, q_len, kv_len, 16, dtype, device, gen)
        out, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
        ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, window=window)
        what = f"(q {q_len}, kv {kv_len}, causal {causal}, window {window})"
        assert_close(out, ref_out, dtype, f"out {what}", seed)
        assert_close(lse, ref_lse, dtype, f"lse {what}", seed)


def test_alignment_sweep_backward(device, gen, seed):
    """The backward's two loops (Q blocks per K/V block, K/V blocks per Q block) at the
    offsets where the diagonal sits on, just before or just after a tile boundary."""
    dtype = exact_dtype(device)
    q_len = 40
    for off, causal, window in [(-17, True, None), (-1, True, None), (0, True, None), (1, True, None),
                                (15, True, None), (16, True, None), (17, True, None), (31, True, None),
                                (33, True, None), (0, True, 16), (12, True, 17), (-5, True, 1),
                                (0, False, 5), (12, False, 17), (-9, False, 16)]:
        kv_len = q_len + off
        q, k, v = make_qkv(1, 1, 1, q_len, kv_len, 16, dtype, device, gen)
        dout = random_tensor(q.shape, dtype, device, gen)
        out, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, window=window)
        _, rdq, rdk, rdv = reference_grads(q, k, v, dout, causal=causal, window=window)
        what = f"(q {q_len}, kv {kv_len}, causal {causal}, window {window})"
        assert_grad_close(dq, rdq, dtype, f"dq {what}", seed)
        assert_grad_close(dk, rdk, dtype, f"dk {what}", seed)
        assert_grad_close(dv, rdv, dtype, f"dv {what}", seed)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_load_paths_write_only_their_rows(tma, dtype, device, gen, seed):
    """Both ways the forward and dQ kernels move tiles (pointer arithmetic with masks, and
    Hopper's TMA descriptors, whose bounds checks are done by the hardware; the interpreter
    runs both): results match, and the outputs are written into views of larger NaN-filled
    buffers, whose rows around each head (dense) or past the last sequence (varlen) must
    still be NaN afterwards: a tile store that crossed a sequence's end would show there."""
    skip_fp32_on_gpu(dtype, device)
    q_heads, kv_heads, head_dim = 4, 2, 40
    # Dense, causal GQA with q < kv.
    q, k, v = make_qkv(1, q_heads, kv_heads, 45, 70, head_dim, dtype, device, gen)
    dout = random_tensor(q.shape, dtype, device, gen)
    packing = Packing(1, 45, 70)
    buf = poisoned((1, q_heads, 45 + 6, head_dim), dtype, device)
    out, lse = launch_forward(q, k, v, packing, True, head_dim ** -0.5, None, out=buf[:, :, 3:48], tma=tma)
    dq_buf = poisoned((1, q_heads, 45 + 6, head_dim), dtype, device)
    launch_backward(dout, q, k, v, out, lse, packing, True, head_dim ** -0.5, None, dq=dq_buf[:, :, 3:48], tma=tma)
    ref_out, rdq, _, _ = reference_grads(q, k, v, dout, causal=True)
    assert_close(out, to_numpy(ref_out), dtype, "out", seed)
    assert_grad_close(dq_buf[:, :, 3:48], rdq, dtype, "dq", seed)
    for name, b in (("out", buf), ("dq", dq_buf)):
        assert torch.isnan(b[:, :, :3]).all() and torch.isnan(b[:, :, 48:]).all(), f"{name}: rows outside were written"

    # Varlen: the last sequence ends at the end of the view, and the buffer goes on.
    lens = [(30, 41), (37, 37)]
    qv, cu_q = pack([a for a, _ in lens], q_heads, head_dim, dtype, device, gen)
    kv_, cu_k = pack([b for _, b in lens], kv_heads, head_dim, dtype, device, gen)
    vv, _ = pack([b for _, b in lens], kv_heads, head_dim, dtype, device, gen)
    total = qv.shape[0]
    packing = Packing(2, 37, 41, cu_q, cu_k)
    buf = poisoned((total + 9, q_heads, head_dim), dtype, device)
    out, lse = launch_forward(qv, kv_, vv, packing, True, head_dim ** -0.5, None, out=buf[:total], tma=tma)
    assert torch.isnan(buf[total:]).all(), "out: rows past the last sequence were written"
    for bi in range(2):
        ref_out, _ = attention(to_numpy(per_sequence(qv, cu_q, bi)), to_numpy(per_sequence(kv_, cu_k, bi)),
                               to_numpy(per_sequence(vv, cu_k, bi)), causal=True)
        assert_close(per_sequence(out, cu_q, bi), ref_out, dtype, f"varlen out (sequence {bi})", seed)


# ----------------------------------------------------------------------------------------
# Varlen
# ----------------------------------------------------------------------------------------
# Per sequence (q_len, kv_len): kv >= q is a prompt chunk after a cached prefix, kv < q has
# rows that see no key, (0, 5) contributes nothing and must not disturb its neighbours.
VARLEN_SEQS = [(1, 1), (17, 30), (70, 70), (0, 5), (33, 33), (12, 7)]


def pack(lengths, heads, head_dim, dtype, device, gen):
    """A packed ``[total, heads, dim]`` tensor and its int32 ``cu_seqlens``."""
    total = sum(lengths)
    t = random_tensor((total, heads, head_dim), dtype, device, gen)
    cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32, device=device)
    return t, cu


def per_sequence(t, cu, b):
    """Sequence ``b`` of a packed tensor as ``[1, heads, len, dim]``."""
    return t[int(cu[b]):int(cu[b + 1])].transpose(0, 1)[None]


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 9)], ids=["causal", "full", "window"])
def test_varlen_forward(causal, window, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    q_heads, kv_heads, head_dim = 4, 2, 32
    q_lens, k_lens = [s[0] for s in VARLEN_SEQS], [s[1] for s in VARLEN_SEQS]
    q, cu_q = pack(q_lens, q_heads, head_dim, dtype, device, gen)
    k, cu_k = pack(k_lens, kv_heads, head_dim, dtype, device, gen)
    v, _ = pack(k_lens, kv_heads, head_dim, dtype, device, gen)
    out = poisoned(q.shape, dtype, device)
    lse = poisoned((q_heads, q.shape[0]), torch.float32, device)
    flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal, window=window,
                           return_lse=True, out=out, lse=lse)
    for b in range(len(VARLEN_SEQS)):
        if q_lens[b] == 0:
            continue
        qb, kb, vb = per_sequence(q, cu_q, b), per_sequence(k, cu_k, b), per_sequence(v, cu_k, b)
        ref_out, ref_lse = attention(to_numpy(qb), to_numpy(kb), to_numpy(vb), causal=causal, window=window)
        got_out, got_lse = per_sequence(out, cu_q, b), lse[None, :, int(cu_q[b]):int(cu_q[b + 1])]
        assert_close(got_out, ref_out, dtype, f"out (sequence {b})", seed)
        assert_close(got_lse, ref_lse, dtype, f"lse (sequence {b})", seed)
        if causal and window is None:  # ... and the dense kernel on this sequence alone agrees
            dense_out, dense_lse = flash_attention(qb, kb, vb, causal=causal, window=window, return_lse=True)
            assert_close(got_out, to_numpy(dense_out), dtype, f"out vs dense (sequence {b})", seed)
            assert_close(got_lse, to_numpy(dense_lse), dtype, f"lse vs dense (sequence {b})", seed)


def test_varlen_backward(dtype, device, gen, seed):
    """Packed gradients equal each sequence's own float64 gradients (dK/dV of a sequence
    with no queries are zero), through both the explicit backward and autograd."""
    skip_fp32_on_gpu(dtype, device)
    q_heads, kv_heads, head_dim, causal = 4, 2, 16, True
    seqs = [(17, 30), (33, 33), (0, 5), (12, 7)]
    q_lens, k_lens = [s[0] for s in seqs], [s[1] for s in seqs]
    q, cu_q = pack(q_lens, q_heads, head_dim, dtype, device, gen)
    k, cu_k = pack(k_lens, kv_heads, head_dim, dtype, device, gen)
    v, _ = pack(k_lens, kv_heads, head_dim, dtype, device, gen)
    dout = random_tensor(q.shape, dtype, device, gen)
    args = (cu_q.long(), cu_k.long(), max(q_lens), max(k_lens))  # int64 prefix sums are accepted too
    out, lse = flash_attention_varlen(q, k, v, *args, causal=causal, return_lse=True)
    dq, dk, dv = (poisoned(t.shape, dtype, device) for t in (q, k, v))
    flash_attention_varlen_backward(dout, q, k, v, out, lse, *args, causal=causal, dq=dq, dk=dk, dv=dv)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    flash_attention_varlen(qg, kg, vg, *args, causal=causal).backward(dout)

    for b in range(len(seqs)):
        qb, kb, vb = per_sequence(q, cu_q, b), per_sequence(k, cu_k, b), per_sequence(v, cu_k, b)
        _, rdq, rdk, rdv = reference_grads(qb, kb, vb, per_sequence(dout, cu_q, b), causal)
        for name, got, auto, cu, want in (("dq", dq, qg.grad, cu_q, rdq), ("dk", dk, kg.grad, cu_k, rdk),
                                          ("dv", dv, vg.grad, cu_k, rdv)):
            assert_grad_close(per_sequence(got, cu, b), want, dtype, f"{name} (sequence {b})", seed)
            assert_grad_close(per_sequence(auto, cu, b), want, dtype, f"autograd {name} (sequence {b})", seed)


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------
BWD_SMALL = [
    (1, 2, 2, 17, 17, 32, True, None),      # MHA causal, one partial block
    (1, 4, 2, 70, 70, 16, False, None),     # GQA 2:1: dK/dV sum two query heads; ragged tails
    (1, 4, 1, 33, 50, 40, True, None),      # MQA, q < kv, head_dim 40
    (1, 2, 1, 50, 33, 16, True, None),      # q > kv: rows without keys get zero gradients
    (1, 7, 1, 1, 20, 16, False, None),      # a single query, group of 7
    (1, 2, 1, 60, 60, 16, True, 13),        # sliding window: keys nobody sees get dK = dV = 0
    (1, 2, 2, 30, 45, 24, False, 9),        # local window, q < kv
]
BWD_LARGE = [
    (1, 8, 2, 4096, 4096, 128, True, None),    # the chapter's headline shape (bf16 on the GPU)
    (2, 16, 16, 1024, 1024, 64, False, None),
    (1, 8, 1, 777, 1531, 96, True, 300),
    (1, 4, 4, 600, 900, 256, True, None),
]
BWD_CASES = [pytest.param(*c, id=case_id(c)) for c in BWD_SMALL] + [
    pytest.param(*c, id=case_id(c), marks=pytest.mark.gpu) for c in BWD_LARGE
]


@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window", BWD_CASES)
def test_backward(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen)
    dout = random_tensor(q.shape, dtype, device, gen)
    out, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
    dq, dk, dv = (poisoned(t.shape, dtype, device) for t in (q, k, v))
    got = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, window=window, dq=dq, dk=dk, dv=dv)
    assert got[0] is dq and got[1] is dk and got[2] is dv
    ref_out, rdq, rdk, rdv = reference_grads(q, k, v, dout, causal, None, window)
    assert_close(out, to_numpy(ref_out), dtype, "out", seed)
    assert_grad_close(dq, rdq, dtype, "dq", seed)
    assert_grad_close(dk, rdk, dtype, "dk", seed)
    assert_grad_close(dv, rdv, dtype, "dv", seed)


def _pairs(a, b):
    """Pair two lists, cycling the shorter one, so that every element of both appears."""
    n = max(len(a), len(b))
    return [(a[i % len(a)], b[i % len(b)]) for i in range(n)]


BWD_TILES = _pairs(_distinct_tiles(DKDV_CONFIGS), _distinct_tiles(DQ_CONFIGS))


@pytest.mark.parametrize("dkdv_tile,dq_tile", BWD_TILES,
                         ids=[f"dkdv{a[0]}x{a[1]}-dq{b[0]}x{b[1]}" for a, b in BWD_TILES])
def test_backward_tile_shapes(dkdv_tile, dq_tile, device, gen, seed):
    """Every tile shape of the GPU's backward autotune lists, under the interpreter: causal
    GQA with q < kv and a window with q > kv (the Q-block segments of dK/dV are the
    mirror image of the forward's and have their own corner cases)."""
    dtype = exact_dtype(device)
    for q_len, kv_len, causal, window in [(90, 140, True, None), (100, 70, True, 40)]:
        q, k, v = make_qkv(1, 2, 1, q_len, kv_len, 16, dtype, device, gen)
        dout = random_tensor(q.shape, dtype, device, gen)
        packing = Packing(1, q_len, kv_len)
        out, lse = launch_forward(q, k, v, packing, causal, 0.25, window)
        dq, dk, dv = (poisoned(t.shape, dtype, device) for t in (q, k, v))
        launch_backward(dout, q, k, v, out, lse, packing, causal, 0.25, window, dq, dk, dv,
                        dkdv_config=_config(*dkdv_tile), dq_config=_config(*dq_tile))
        _, rdq, rdk, rdv = reference_grads(q, k, v, dout, causal, 0.25, window)
        what = f"(q {q_len}, kv {kv_len}, window {window})"
        assert_grad_close(dq, rdq, dtype, f"dq {what}", seed)
        assert_grad_close(dk, rdk, dtype, f"dk {what}", seed)
        assert_grad_close(dv, rdv, dtype, f"dv {what}", seed)


def test_autograd(device, gen, seed):
    """`flash_attention` is differentiable: grads of a weighted sum equal float64 autograd
    of the torch reference; a plain ``.sum()`` (whose gradient is an expanded, stride-0
    tensor) works too; the returned lse is not differentiable."""
    dtype = exact_dtype(device)
    q, k, v = make_qkv(1, 4, 2, 33, 41, 16, dtype, device, gen)
    w = random_tensor(q.shape, dtype, device, gen)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(qg, kg, vg, causal=True, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    (out * w).sum().backward()
    _, rdq, rdk, rdv = reference_grads(q, k, v, w, causal=True)
    for name, got, want in (("dq", qg.grad, rdq), ("dk", kg.grad, rdk), ("dv", vg.grad, rdv)):
        assert_grad_close(got, want, dtype, name, seed)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    flash_attention(qg, kg, vg).sum().backward()
    _, rdq, rdk, rdv = reference_grads(q, k, v, torch.ones_like(q))
    for name, got, want in (("dq (sum)", qg.grad, rdq), ("dk (sum)", kg.grad, rdk), ("dv (sum)", vg.grad, rdv)):
        assert_grad_close(got, want, dtype, name, seed)

    with pytest.raises(ValueError, match="requires grad"):
        flash_attention(qg, kg, vg, out=torch.empty_like(q))


@pytest.mark.parametrize("ablation", sorted(ABLATIONS))
def test_ablations_compute_the_same_attention(ablation, device, gen, seed):
    """The chapter's ablations (FA1's step-by-step normalisation, masking every block, no
    block skipping) change how the kernel works, never what it computes: each matches the
    reference on causal GQA with q < kv, q > kv (rows that see no key) and a window."""
    dtype = exact_dtype(device)
    cfg = _config(32, 16) if torch.device(device).type == "cpu" else _config(64, 64)
    for q_len, kv_len, causal, window in [(45, 70, True, None), (50, 30, True, None), (40, 40, False, 9)]:
        q, k, v = make_qkv(2, 4, 2, q_len, kv_len, 24, dtype, device, gen)
        out, lse = launch_forward(q, k, v, Packing(2, q_len, kv_len), causal, 24 ** -0.5, window, config=cfg,
                                  ablation=ablation)
        ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, window=window)
        assert_close(out, ref_out, dtype, f"out ({ablation}, {q_len}x{kv_len})", seed)
        assert_close(lse, ref_lse, dtype, f"lse ({ablation}, {q_len}x{kv_len})", seed)
    with pytest.raises(ValueError, match="fixed config"):
        launch_forward(q, k, v, Packing(2, 40, 40), False, 0.1, None, ablation=ablation)


def test_torch_reference_matches_numpy_reference(gen):
    """The torch implementation the gradients come from agrees with the NumPy oracle."""
    for args in [(2, 4, 2, 9, 13, 8, True, None), (1, 3, 1, 12, 5, 8, True, None), (1, 2, 2, 10, 10, 8, False, 3)]:
        *shape, causal, window = args
        q, k, v = make_qkv(*shape, torch.float64, "cpu", gen)
        out, lse = torch_attention(q, k, v, causal, 0.4, window)
        ref_out, ref_lse = attention(q.numpy(), k.numpy(), v.numpy(), causal=causal, scale=0.4, window=window)
        np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-12)
        np.testing.assert_array_equal(np.isinf(lse.numpy()), np.isinf(ref_lse))
        np.testing.assert_allclose(lse.numpy()[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)], atol=1e-12)


# ----------------------------------------------------------------------------------------
# API checks and bookkeeping
# ----------------------------------------------------------------------------------------
def test_rejects_bad_inputs(device, gen):
    q, k, v = make_qkv(1, 6, 4, 8, 8, 16, torch.float32, device, gen)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k, v)
    q, k, v = make_qkv(1, 4, 2, 8, 8, 16, torch.float32, device, gen)
    with pytest.raises(ValueError, match="same shape"):
        flash_attention(q, k, v[:, :, :4])
    with pytest.raises(TypeError, match="dtype"):
        flash_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="scale"):
        flash_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="head_dim"):
        big = torch.zeros(1, 1, 2, 300, device=device)
        flash_attention(big, big, big)
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                               torch.tensor([0, 8], device=device, dtype=torch.float32),
                               torch.tensor([0, 8], device=device, dtype=torch.int32), 8, 8)


def test_seq_buckets():
    assert [seq_bucket(n) for n in (1, 64, 65, 4096, 5000, 10 ** 6)] == [64, 64, 128, 4096, 8192, 16384]


def test_autotune_candidates(monkeypatch):
    """What the autotuner may choose from: each head dim's own candidates, per load path;
    only 64-row forward tiles for short queries; and the fixed configs used without tuning."""
    from minillm.kernels.ch04_flash_attention import (
        FP32_CONFIG, FWD_TILES, FWD_TILES_TMA, config_key, fixed_config, head_dim_class, prune_fwd_configs,
    )
    from minillm.kernels.ch04_flash_attention import DKDV_TILES, DQ_TILES, DQ_TILES_TMA, config_pruner

    assert [head_dim_class(d) for d in (16, 32, 64, 128, 256)] == [64, 64, 64, 128, 256]
    for block_d_ in (64, 128, 256):
        for tma in (False, True):
            kw = {"BLOCK_D": block_d_, "TMA": tma}
            fwd_table = (FWD_TILES_TMA if tma else FWD_TILES)[block_d_]
            keys = lambda configs: sorted(config_key(c) for c in configs)  # noqa: E731
            assert keys(prune_fwd_configs(FWD_CONFIGS, {"q_bucket": 4096}, **kw)) == sorted(fwd_table)
            short = keys(prune_fwd_configs(FWD_CONFIGS, {"q_bucket": 64}, **kw))
            assert short and all(bm <= 64 for bm, *_ in short)
            dq_table = (DQ_TILES_TMA if tma else DQ_TILES)[block_d_]
            assert keys(config_pruner(DQ_TILES, DQ_TILES_TMA)(DQ_CONFIGS, {}, **kw)) == sorted(dq_table)
            assert keys(config_pruner(DKDV_TILES)(DKDV_CONFIGS, {}, **kw)) == sorted(DKDV_TILES[block_d_])
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU
    assert fixed_config(FWD_TILES, torch.float32, 128, INTERPRET_FWD_CONFIG) is FP32_CONFIG
    assert config_key(fixed_config(FWD_TILES, torch.bfloat16, 128, INTERPRET_FWD_CONFIG)) == FWD_TILES[128][0]
    monkeypatch.setenv("MINILLM_FLASH_AUTOTUNE", "1")
    assert fixed_config(FWD_TILES, torch.bfloat16, 128, INTERPRET_FWD_CONFIG) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fixed_config(FWD_TILES, torch.bfloat16, 128, INTERPRET_FWD_CONFIG) is INTERPRET_FWD_CONFIG


def test_interpreter_configs_are_small():
    """The interpreter runs one fixed config per kernel (autotuning there would take minutes)."""
    for cfg in (INTERPRET_FWD_CONFIG, INTERPRET_DKDV_CONFIG, INTERPRET_DQ_CONFIG):
        assert cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] <= 32 * 32


# ----------------------------------------------------------------------------------------
# GPU only: every autotune config, and offsets past 2^31
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_every_gpu_config(head_dim, device, gen, seed):
    """Each autotuning candidate for this head dim and load path, forced in turn (autotuning
    would only ever run the fastest), on a causal GQA shape with q < kv in bf16: every one
    compiles for this GPU, fits, and is correct."""
    from minillm.kernels.ch04_flash_attention import block_d, prune_fwd_configs
    from minillm.kernels.ch04_flash_attention import DKDV_TILES, DQ_TILES, DQ_TILES_TMA, config_pruner

    dtype = torch.bfloat16
    q, k, v = make_qkv(2, 8, 2, 700, 1000, head_dim, dtype, device, gen)
    dout = random_tensor(q.shape, dtype, device, gen)
    packing = Packing(2, 700, 1000)
    scale = head_dim ** -0.5
    ref_out, rdq, rdk, rdv = reference_grads(q, k, v, dout, causal=True)
    for tma in (False, True):  # the pointer path, and TMA (Hopper and newer)
        if tma and torch.cuda.get_device_capability(device)[0] < 9:
            continue
        kw = {"BLOCK_D": block_d(head_dim), "TMA": tma}
        for cfg in prune_fwd_configs(FWD_CONFIGS, {"q_bucket": 1024}, **kw):
            out, lse = launch_forward(q, k, v, packing, True, scale, None, config=cfg, tma=tma)
            assert_close(out, to_numpy(ref_out), dtype, f"out {cfg} tma={tma}", seed)
        out, lse = launch_forward(q, k, v, packing, True, scale, None)
        dkdv = config_pruner(DKDV_TILES)(DKDV_CONFIGS, {}, **kw)
        dq_cfgs = config_pruner(DQ_TILES, DQ_TILES_TMA)(DQ_CONFIGS, {}, **kw)
        for a, b in _pairs(dkdv, dq_cfgs):
            dq, dk, dv = launch_backward(dout, q, k, v, out, lse, packing, True, scale, None, dkdv_config=a,
                                         dq_config=b, tma=tma)
            assert_grad_close(dq, rdq, dtype, f"dq {b} tma={tma}", seed)
            assert_grad_close(dk, rdk, dtype, f"dk {a}", seed)
            assert_grad_close(dv, rdv, dtype, f"dv {a}", seed)


@pytest.mark.gpu
def test_autotuned_launch(monkeypatch, device, gen, seed):
    """The autotuned wrappers themselves (the other tests pin one config): a bf16, head_dim
    128, causal GQA call through autograd, as the benchmark and a training step make it."""
    monkeypatch.setenv("MINILLM_FLASH_AUTOTUNE", "1")
    dtype = torch.bfloat16
    q, k, v = make_qkv(2, 8, 2, 1024, 1024, 128, dtype, device, gen)
    dout = random_tensor(q.shape, dtype, device, gen)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = flash_attention(qg, kg, vg, causal=True)
    out.backward(dout)
    ref_out, rdq, rdk, rdv = reference_grads(q, k, v, dout, causal=True)
    assert_close(out, to_numpy(ref_out), dtype, "out", seed)
    for name, got, want in (("dq", qg.grad, rdq), ("dk", kg.grad, rdk), ("dv", vg.grad, rdv)):
        assert_grad_close(got, want, dtype, name, seed)


@pytest.mark.gpu
def test_offsets_past_two_to_the_31(device, gen, seed):
    """A packed batch of 520 sequences x 1024 tokens x 32 heads x 128 = 2.2e9 elements per
    tensor: the last sequences start past 2^31 elements, so every kernel must index in
    int64. Only the last sequence is checked (forward and gradients)."""
    dtype = torch.bfloat16
    n_seqs, n, heads, head_dim = 520, 1024, 32, 128
    total = n_seqs * n
    assert total * heads * head_dim > 2 ** 31
    q = torch.randn(total, heads, head_dim, device=device, dtype=dtype)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = torch.arange(0, total + 1, n, device=device, dtype=torch.int32)
    out, lse = flash_attention_varlen(q, k, v, cu, cu, n, n, causal=True, return_lse=True)
    dout = torch.randn_like(q)
    dq, dk, dv = flash_attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, n, n, causal=True)
    b = n_seqs - 1
    qb, kb, vb = per_sequence(q, cu, b), per_sequence(k, cu, b), per_sequence(v, cu, b)
    ref_out, rdq, rdk, rdv = reference_grads(qb, kb, vb, per_sequence(dout, cu, b), causal=True)
    assert_close(per_sequence(out, cu, b), to_numpy(ref_out), dtype, "out (last sequence)", seed)
    assert_grad_close(per_sequence(dq, cu, b), rdq, dtype, "dq (last sequence)", seed)
    assert_grad_close(per_sequence(dk, cu, b), rdk, dtype, "dk (last sequence)", seed)
    assert_grad_close(per_sequence(dv, cu, b), rdv, dtype, "dv (last sequence)", seed)


# ----------------------------------------------------------------------------------------
# The benchmark's bookkeeping (no timing: a stand-in timer, tiny shapes, the interpreter)
# ----------------------------------------------------------------------------------------
def test_benchmark_dry_run(device):
    """`bench.ch04_flash_attention.sweep` end to end on tiny shapes with a stand-in timer
    that calls the function once: every point adds its rows (a peer that refuses the inputs,
    e.g. cuDNN on a CPU, is recorded with a note), our output and gradients agree with
    SDPA's, and the summary prints. The real sweep runs on a GPU (`python -m bench.run`)."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import ch04_flash_attention as bench
    from bench.common import Results

    dtype = exact_dtype(device)
    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    bench.sweep(results, device, head_dims=(16,), seq_lens=(17, 32), tokens=32, hidden=32,
                dtypes=(dtype,), causals=(False, True), passes=("fwd", "bwd"),
                timer=lambda fn: (fn(), 1.0)[1])
    rows = results.rows
    points = 2 * 2 * 2  # seq_lens x causal x pass
    count = lambda metric: sum(r["metric"] == metric for r in rows)  # noqa: E731
    assert count("time_ms") == 2 * points and count("TFLOPs") == 2 * points  # one row per peer
    assert count("rel_err") == points
    assert {r["peer"] for r in rows if r["metric"] == "time_ms"} == {"sdpa_flash", "sdpa_cudnn"}
    errors = [r["ours"] for r in rows if r["metric"] == "rel_err"]
    assert all(e < (1e-4 if dtype == torch.float32 else 1e-2) for e in errors), errors
    p = next(r for r in rows if r["metric"] == "TFLOPs" and r["params"]["pass"] == "bwd" and r["params"]["causal"])
    n = p["params"]["seq_len"]
    assert p["ours"] == pytest.approx(nominal_attention_flops(32 // n, 2, n, n, 16, True, backward=True) / 1e-3 / 1e12)
    assert p["fraction_of_ceiling"] == pytest.approx(p["ours"])  # the stand-in ceiling is 1 TFLOP/s
    assert results.status[bench.BENCHMARK] == "complete"
    table = bench.summary(results)
    assert len(table.splitlines()) == 1 + points
