"""Chapter 3's Triton kernels against the NumPy references.

- `online_softmax` against `minillm.reference.softmax`: both code paths (row in registers,
  row streamed in blocks), tails, partly and fully masked rows, values far past where a
  softmax without the max overflows, strided rows; output and lse buffers NaN-poisoned.
- `tiled_attention` (FA1 loop order) against `minillm.reference.ch01_naive_attention`: MHA/GQA/MQA,
  causal and sliding window, q_len above and below kv_len (rows that see no key), head dims
  and lengths that are not powers of two, several tiles in both loops; poisoned outputs
  and a NaN-filled workspace (the state of the first outer iteration must not be read).

CPU: small shapes under the interpreter (fp32 with exact dots, fp16). GPU (`make gpu`):
the same plus bf16 and the `gpu`-marked large shapes.
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minillm.kernels.ch03_online_softmax import MAX_ONE_TILE, online_softmax
from minillm.kernels.ch03_online_softmax import tiled_attention
from minillm.reference import attention, softmax
from minillm.testing import assert_close, poisoned, random_tensor, to_numpy


def reference_lse(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.logaddexp.reduce(x, axis=-1)


# ----------------------------------------------------------------------------------------
# online_softmax
# ----------------------------------------------------------------------------------------
# (rows, cols, block_n): block_n None is the launcher's choice; block_n < cols streams.
SOFTMAX_CASES = [
    (1, 1, None),        # one element
    (7, 33, 16),         # streamed: two full blocks and a tail of one
    (5, 1000, None),     # in registers, a 1024 block with a tail
    (4, 1000, 128),      # streamed, 8 blocks
    (3, 256, 256),       # exactly one block: the register path
    (3, 257, 256),       # one element over: streamed, a last block of one
    pytest.param(64, 40000, None, marks=pytest.mark.gpu),
    pytest.param(8, 262144, None, marks=pytest.mark.gpu),
    pytest.param(3, 100003, None, marks=pytest.mark.gpu),
    pytest.param(2048, MAX_ONE_TILE, None, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("rows,cols,block_n", SOFTMAX_CASES)
def test_online_softmax(rows, cols, block_n, dtype, device, gen, seed):
    x = random_tensor((rows, cols), dtype, device, gen, scale=4.0)
    x[0, : cols // 2] = float("-inf")     # a partly masked row (all of it when cols = 1) ...
    if rows > 1:
        x[1] = float("-inf")              # ... and a fully masked one: zeros, lse = -inf
    if rows > 2 and cols > 1:
        x[2, -1] = 60.0                   # a new max in the last block: everything before is rescaled
    y, lse = poisoned((rows, cols), dtype, device), poisoned((rows,), torch.float32, device)
    got_y, got_lse = online_softmax(x, out=y, lse=lse, block_n=block_n)
    assert got_y is y and got_lse is lse
    ref = to_numpy(x)
    assert_close(y, softmax(ref), dtype, "softmax", seed)
    assert_close(lse, reference_lse(ref), torch.float32, "lse", seed)


@pytest.mark.parametrize("block_n", [None, 64])
def test_online_softmax_huge_values(block_n, device, gen, seed):
    """Scores in the thousands, where exp overflows fp32 (past ~88): only the max-subtracted
    form survives. The row's max moves block to block, so each rescale is exp(-huge) = 0
    or a finite factor, never inf."""
    x = random_tensor((3, 300), torch.float32, device, gen, scale=2000.0)
    y, lse = online_softmax(x, block_n=block_n)
    ref = to_numpy(x)
    assert_close(y, softmax(ref), torch.float32, "softmax", seed)
    assert_close(lse, reference_lse(ref), torch.float32, "lse", seed, rtol=1e-6)


def test_online_softmax_shapes_dtypes_and_strides(device, gen, seed):
    """A [2, 3, 50] input whose rows are slices of a wider buffer (row stride 64), fp16 in
    and fp32 out, the lse written into a [2, 3] view; without ``out`` the output takes
    x's dtype."""
    buf = random_tensor((2, 3, 64), torch.float16, device, gen, scale=3.0)
    x = buf[..., :50]
    assert not x.is_contiguous()
    y = poisoned((2, 3, 50), torch.float32, device)
    lse = poisoned((2, 3), torch.float32, device)
    online_softmax(x, out_dtype=torch.float32, out=y, lse=lse, block_n=16)
    ref = to_numpy(x)
    assert_close(y, softmax(ref), torch.float32, "softmax", seed, atol=1e-6, rtol=1e-5)
    assert_close(lse, reference_lse(ref), torch.float32, "lse", seed)
    y16, lse16 = online_softmax(x)
    assert y16.dtype == torch.float16 and y16.shape == x.shape and lse16.shape == (2, 3)
    assert_close(y16, softmax(ref), torch.float16, "softmax (fp16 out)", seed)


def test_online_softmax_rejects_bad_arguments(device):
    x = torch.zeros(4, 10, device=device)
    with pytest.raises(ValueError, match="power of two"):
        online_softmax(x, block_n=24)
    with pytest.raises(ValueError, match="contiguous"):
        online_softmax(x.t())
    with pytest.raises(ValueError, match="empty"):
        online_softmax(torch.zeros(3, 0, device=device))
    with pytest.raises(ValueError, match="without a copy"):   # rows not equally spaced
        online_softmax(torch.zeros(4, 6, 10, device=device)[:, :3])


@pytest.mark.gpu
def test_online_softmax_offsets_past_two_to_the_31(device, gen, seed):
    """8200 rows of 262144 = 2.15e9 elements: the last rows start past 2^31, so the kernel
    must index in int64. Only the last row is random (the others are zeros) and checked."""
    dtype = torch.bfloat16
    rows, cols = 8200, 262144
    assert (rows - 1) * cols > 2 ** 31
    x = torch.zeros(rows, cols, device=device, dtype=dtype)
    x[-1] = random_tensor((cols,), dtype, device, gen, scale=4.0)
    y, lse = online_softmax(x)
    ref = to_numpy(x[-1:])
    assert_close(y[-1:], softmax(ref), dtype, "softmax (last row)", seed)
    assert_close(lse[-1:], reference_lse(ref), torch.float32, "lse (last row)", seed)


# ----------------------------------------------------------------------------------------
# tiled_attention (FlashAttention-1 loop order)
# ----------------------------------------------------------------------------------------
# (batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, block_m, block_n)
SMALL = [
    (1, 1, 1, 1, 1, 16, False, None, 16, 16),      # a single score
    (1, 4, 2, 37, 37, 40, True, None, 16, 16),     # GQA 2:1, head_dim 40, 3x3 tiles with tails
    (1, 3, 1, 20, 45, 24, True, 7, 16, 32),        # MQA, more keys than queries, sliding window
    (1, 2, 2, 33, 20, 16, True, None, 32, 16),     # q_len > kv_len: the first 13 rows see no key
    (2, 1, 1, 70, 70, 32, False, None, 64, 64),    # default tiles, a tail in both loops
    (1, 2, 1, 17, 100, 64, False, 9, 16, 64),      # non-causal window, 2 K/V blocks
]
LARGE = [
    (2, 16, 4, 1000, 1000, 128, True, None, 64, 64),
    (1, 8, 8, 2048, 2048, 64, False, None, 64, 64),
    (1, 32, 8, 1, 4097, 128, True, None, 16, 64),      # decode over a long cache
    (1, 8, 2, 777, 1531, 96, True, 256, 64, 64),
    (1, 4, 4, 513, 513, 256, False, None, 32, 32),     # head_dim 256
]


def _case_id(c):
    return "x".join(map(str, c[:6])) + f"-c{int(c[6])}-w{c[7]}-b{c[8]}x{c[9]}"


CASES = [pytest.param(*c, id=_case_id(c)) for c in SMALL] + [
    pytest.param(*c, id=_case_id(c), marks=pytest.mark.gpu) for c in LARGE
]


def make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen):
    q = random_tensor((batch, q_heads, q_len, head_dim), dtype, device, gen)
    k = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    v = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    return q, k, v


def nan_workspace(batch, q_heads, q_len, head_dim, device):
    """A workspace full of NaN: reading a state that was never written poisons the output."""
    return (poisoned((batch * q_heads, q_len, head_dim), torch.float32, device),
            poisoned((batch * q_heads, q_len), torch.float32, device),
            poisoned((batch * q_heads, q_len), torch.float32, device))


@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window,block_m,block_n", CASES)
def test_tiled_attention(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, block_m, block_n,
                         dtype, device, gen, seed):
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen)
    out = poisoned((batch, q_heads, q_len, head_dim), dtype, device)
    lse = poisoned((batch, q_heads, q_len), torch.float32, device)
    got_out, got_lse = tiled_attention(q, k, v, causal=causal, window=window, out=out, lse=lse, block_m=block_m,
                                       block_n=block_n, workspace=nan_workspace(batch, q_heads, q_len, head_dim, device))
    assert got_out is out and got_lse is lse
    ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, window=window)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, torch.float32, "lse", seed, atol=1e-4, rtol=1e-4)


def test_tiled_attention_allocates_and_follows_strides(device, gen, seed):
    """Q/K/V in the [batch, seq, (q|k|v), heads, dim] layout of a fused projection, viewed
    as [batch, heads, seq, dim]; out and lse written into transposed views; the launcher
    allocates its own workspace (4 K/V blocks of 16)."""
    dtype = torch.float32
    qkv = random_tensor((2, 61, 3, 2, 32), dtype, device, gen)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out_buf = poisoned((2, 61, 2, 32), dtype, device)            # [batch, seq, heads, dim]
    lse_buf = poisoned((61, 2, 2), torch.float32, device)        # [seq, batch, heads]
    tiled_attention(q, k, v, causal=True, out=out_buf.transpose(1, 2), lse=lse_buf.permute(1, 2, 0),
                    block_m=32, block_n=16)
    ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    assert_close(out_buf.transpose(1, 2), ref_out, dtype, "out", seed)
    assert_close(lse_buf.permute(1, 2, 0), ref_lse, dtype, "lse", seed)
    out, lse = tiled_attention(q, k, v, scale=0.3, block_n=32)   # allocated: q's dtype and fp32
    assert out.shape == q.shape and out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), scale=0.3)
    assert_close(out, ref_out, dtype, "out (scale 0.3)", seed)
    assert_close(lse, ref_lse, dtype, "lse (scale 0.3)", seed)


def test_tiled_attention_no_keys(device, gen):
    q = random_tensor((1, 2, 5, 16), torch.float32, device, gen)
    k = torch.zeros(1, 1, 0, 16, device=device)
    out, lse = tiled_attention(q, k, k, out=poisoned((1, 2, 5, 16), torch.float32, device))
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_tiled_attention_rejects_bad_arguments(device, gen):
    q, k, v = make_qkv(1, 6, 4, 8, 8, 16, torch.float32, device, gen)
    with pytest.raises(ValueError, match="multiple"):
        tiled_attention(q, k, v)
    q, k, v = make_qkv(1, 4, 2, 8, 8, 16, torch.float32, device, gen)
    with pytest.raises(ValueError, match="power of two"):
        tiled_attention(q, k, v, block_n=8)
    with pytest.raises(ValueError, match="shape mismatch"):
        tiled_attention(q, k, v[..., :8])
    with pytest.raises(ValueError, match="workspace"):
        tiled_attention(q, k, v, workspace=nan_workspace(1, 2, 8, 16, device))


@pytest.mark.gpu
def test_tiled_attention_offsets_past_two_to_the_31(device, gen, seed):
    """64 heads x 270k queries x 128 = 2.2e9 elements in Q, out and the workspace: the last
    head starts past 2^31 elements, so the kernel must index in int64. Only the last head
    holds random queries (the others are zeros: a wrapped offset reads them) and only it is
    checked; two K/V blocks keep it fast."""
    dtype = torch.bfloat16
    batch, heads, q_len, kv_len, d = 1, 64, 270_000, 100, 128
    assert batch * (heads - 1) * q_len * d > 2 ** 31
    q = torch.zeros(batch, heads, q_len, d, device=device, dtype=dtype)
    q[:, -1] = random_tensor((batch, q_len, d), dtype, device, gen)
    k = random_tensor((batch, heads, kv_len, d), dtype, device, gen)
    v = random_tensor((batch, heads, kv_len, d), dtype, device, gen)
    out, lse = tiled_attention(q, k, v, block_n=64)
    ref_out, ref_lse = attention(to_numpy(q[:, -1:]), to_numpy(k[:, -1:]), to_numpy(v[:, -1:]))
    assert_close(out[:, -1:], ref_out, dtype, "out (last head)", seed)
    assert_close(lse[:, -1:], ref_lse, torch.float32, "lse (last head)", seed, atol=1e-3, rtol=1e-3)


# ----------------------------------------------------------------------------------------
# The benchmark's bookkeeping (no timing: a stand-in timer, tiny shapes, the interpreter)
# ----------------------------------------------------------------------------------------
def test_benchmark_dry_run(device):
    """`bench.ch03_online_softmax.sweep` end to end on tiny shapes with a stand-in timer
    that calls the function once: every point adds its rows, our outputs agree with the
    peers', and the summary prints. The real sweep runs on a GPU (`python -m bench.run`)."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # `pytest` without `python -m` does not put the root on the path
        sys.path.insert(0, root)
    from bench import ch03_online_softmax as bench
    from bench.common import Results

    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    bench.sweep(results, device, rows=3, cols_list=(20, 100), softmax_dtypes=(torch.float32,),
                attn_points=((1, 2, 70, 16, False), (1, 1, 33, 16, True)), attn_dtype=torch.float32, block_n=32,
                timer=lambda fn: (fn(), 1.0)[1])
    rows = results.rows
    count = lambda metric: sum(r["metric"] == metric for r in rows)  # noqa: E731
    softmax_points, attn_points = 2, 2
    assert count("effective_bandwidth_TBps") == softmax_points
    assert count("bandwidth_TBps") == softmax_points + attn_points
    assert count("time_ms") == softmax_points + 2 * attn_points   # attention: one row per SDPA peer
    assert count("TFLOPs") == 2 * attn_points
    assert count("hbm_bytes") == attn_points
    assert count("rel_err") == softmax_points + attn_points
    assert all(r["ours"] < 1e-5 for r in rows if r["metric"] == "rel_err")
    assert {r["params"]["path"] for r in rows if "cols" in r["params"]} == {"registers", "streamed"}
    assert results.status[bench.BENCHMARK] == "complete"
    table = bench.summary(results)
    assert len(table.splitlines()) == 1 + softmax_points + 2 + attn_points
