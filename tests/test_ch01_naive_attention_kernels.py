"""Chapter 1's three Triton kernels against the NumPy reference, pass by pass and end to end.

CPU: small odd shapes under the interpreter (fp32 with exact dots, fp16). GPU (`make gpu`):
the same tests plus bf16 and the `gpu`-marked large shapes.
"""
import numpy as np
import pytest
import torch

from minillm.kernels.ch01_naive_attention import (
    attention_scores, naive_attention, probs_times_values, row_softmax,
)
from minillm import reference as ref
from minillm.reference import attention, kv_head_for, softmax
from minillm.testing import assert_close, poisoned, random_tensor, to_numpy

# (batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window)
SMALL = [
    (1, 1, 1, 1, 1, 16, False, None),      # a single score
    (2, 4, 2, 37, 37, 40, True, None),     # GQA 2:1, head_dim not a power of two
    (1, 6, 1, 5, 77, 64, True, 7),         # MQA, more keys than queries, sliding window
    (1, 3, 3, 70, 70, 24, False, None),    # tails in both tile dims
    (2, 2, 1, 33, 65, 32, False, 9),       # non-causal local window, q_len < kv_len
    (1, 2, 2, 4, 3, 16, True, None),       # q_len > kv_len: first rows see no key at all
]
LARGE = [
    (2, 16, 4, 1000, 1000, 128, True, None),
    (1, 8, 8, 2048, 2048, 64, False, None),
    (1, 32, 8, 1, 4097, 128, True, None),   # decode over a long cache
    (1, 8, 2, 777, 1531, 96, True, 256),
]
CASES = [pytest.param(*c, id="x".join(map(str, c[:6])) + f"-c{int(c[6])}-w{c[7]}") for c in SMALL] + [
    pytest.param(*c, id="x".join(map(str, c[:6])) + f"-c{int(c[6])}-w{c[7]}", marks=pytest.mark.gpu) for c in LARGE
]


def make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen):
    q = random_tensor((batch, q_heads, q_len, head_dim), dtype, device, gen)
    k = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    v = random_tensor((batch, kv_heads, kv_len, head_dim), dtype, device, gen)
    return q, k, v


@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window", CASES)
def test_scores_pass(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, dtype, device, gen, seed):
    q, k, _ = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen)
    s = poisoned((batch, q_heads, q_len, kv_len), torch.float32, device)
    attention_scores(q, k, causal=causal, window=window, out=s)
    assert_close(s, ref.attention_scores(to_numpy(q), to_numpy(k), causal, window=window), dtype, "S", seed)


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 33), (5, 1000), pytest.param(64, 40000, marks=pytest.mark.gpu)])
def test_softmax_pass(rows, cols, dtype, device, gen, seed):
    s = random_tensor((rows, cols), torch.float32, device, gen, scale=4.0)
    s[0, : cols // 2] = float("-inf")  # a partly masked row ...
    if rows > 1:
        s[1] = float("-inf")  # ... and a fully masked one (must give zeros, lse = -inf)
    p, lse = poisoned((rows, cols), dtype, device), poisoned((rows,), torch.float32, device)
    row_softmax(s, out_dtype=dtype, out=p, lse=lse)
    ref = to_numpy(s)
    assert_close(p, softmax(ref), dtype, "P", seed)
    with np.errstate(divide="ignore"):
        ref_lse = np.log(np.exp(ref).sum(-1))
    assert_close(lse, ref_lse, torch.float32, "lse", seed)


@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window", CASES)
def test_pv_pass(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, dtype, device, gen, seed):
    _, _, v = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen)
    logits = random_tensor((batch, q_heads, q_len, kv_len), torch.float32, device, gen)
    p = torch.softmax(logits, dim=-1).to(dtype)
    o = poisoned((batch, q_heads, q_len, head_dim), dtype, device)
    probs_times_values(p, v, out=o)
    heads = kv_head_for(np.arange(q_heads), q_heads, kv_heads)
    assert_close(o, to_numpy(p) @ to_numpy(v)[:, heads], dtype, "O", seed)


@pytest.mark.parametrize("batch,q_heads,kv_heads,q_len,kv_len,head_dim,causal,window", CASES)
def test_naive_attention_end_to_end(batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window,
                                    dtype, device, gen, seed):
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, device, gen)
    out, lse = naive_attention(q, k, v, causal=causal, window=window)
    ref_out, ref_lse = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal, window=window)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


@pytest.mark.gpu
def test_offsets_past_two_to_the_31(device, gen, seed):
    """16 heads x 12288² scores = 2.4e9 elements: S and P offsets overflow int32 unless the
    kernels index in int64. Check the last head, the one furthest into the buffers."""
    dtype = torch.bfloat16
    q, k, v = make_qkv(1, 16, 4, 12288, 12288, 64, dtype, device, gen)
    out, _ = naive_attention(q, k, v, causal=True)
    ref_out, _ = attention(to_numpy(q[:, -4:]), to_numpy(k[:, -1:]), to_numpy(v[:, -1:]), causal=True)
    assert_close(out[:, -4:], ref_out, dtype, "out (last KV group)", seed)


def test_strided_inputs_need_no_copy(device, gen, seed):
    """Q/K/V in the [batch, seq, heads, dim] memory layout of a fused QKV projection, viewed
    as [batch, heads, seq, dim] through transpose: the kernels follow the strides."""
    dtype = torch.float32
    qkv = random_tensor((2, 29, 3, 4, 32), dtype, device, gen)  # [batch, seq, (q|k|v), heads, dim]
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out, _ = naive_attention(q, k, v, causal=True)
    ref, _ = attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    assert_close(out, ref, dtype, "out", seed)


def test_custom_scale(device, gen, seed):
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, torch.float32, device, gen)
    out, _ = naive_attention(q, k, v, scale=0.3)
    ref, _ = attention(to_numpy(q), to_numpy(k), to_numpy(v), scale=0.3)
    assert_close(out, ref, torch.float32, "out", seed)


def test_rejects_bad_gqa_ratio(device, gen):
    q, k, v = make_qkv(1, 6, 4, 8, 8, 16, torch.float32, device, gen)
    with pytest.raises(ValueError, match="multiple"):
        naive_attention(q, k, v)
