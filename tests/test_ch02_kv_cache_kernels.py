"""Chapter 2's KV-cache kernels against NumPy references.

- `write_kv` against a NumPy scatter: unsorted and non-contiguous slots, sequences at
  different positions, padding slots (-1) and out-of-range slots that must write nothing;
  the whole cache is compared exactly, so a stray write anywhere fails.
- `decode_attention` against `minillm.reference.ch01_naive_attention`, one sequence at a time over its
  own length: MHA, GQA 2/4/7, MQA, head dims that are not powers of two, a zero-length
  sequence. The cache slots past each length are filled with NaN, so a kernel that reads
  past a sequence's end (even with a zero weight: 0·NaN = NaN) fails.
- Decoding token by token with both kernels equals causal attention recomputed over the
  whole sequence (the invariant the whole chapter rests on).

CPU: small odd shapes under the interpreter (fp32 with exact dots, fp16). GPU (`make gpu`):
the same plus bf16 and the `gpu`-marked long contexts and >2^31-element caches.
"""
import numpy as np
import pytest
import torch

from minillm.kernels.ch02_kv_cache import decode_attention, write_kv
from minillm.reference import attention
from minillm.testing import assert_close, poisoned, random_tensor, to_numpy


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------
def reference_decode(q, k_cache, v_cache, seq_lens, scale=None):
    """float64 ``(out [B, Hq, D], lse [B, Hq])``: for each sequence, its one query attends to
    the first ``seq_lens[b]`` slots (a q_len = 1 attention, bottom-right aligned: it sees
    every cached key). Length 0 gives zeros and -inf, like a fully masked row."""
    q = to_numpy(q)
    batch, q_heads, head_dim = q.shape
    out = np.zeros((batch, q_heads, head_dim))
    lse = np.full((batch, q_heads), -np.inf)
    for b, n in enumerate(int(x) for x in seq_lens):
        if n == 0:
            continue
        o, l = attention(q[b][None, :, None], to_numpy(k_cache[b, :, :n])[None],
                         to_numpy(v_cache[b, :, :n])[None], scale=scale)
        out[b], lse[b] = o[0, :, 0], l[0, :, 0]
    return out, lse


def make_cache(batch, kv_heads, max_len, head_dim, seq_lens, dtype, device, gen):
    """Random K/V caches whose slots past each sequence's length hold NaN."""
    k = random_tensor((batch, kv_heads, max_len, head_dim), dtype, device, gen)
    v = random_tensor((batch, kv_heads, max_len, head_dim), dtype, device, gen)
    for b, n in enumerate(seq_lens):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return k, v


def reference_scatter(cache, new, slots):
    """NumPy ``cache[b, :, slots[b, t]] = new[b, :, t]`` for slots in range (others skipped)."""
    cache, new, slots = cache.copy(), np.asarray(new), np.asarray(slots)
    max_len = cache.shape[2]
    for b in range(slots.shape[0]):
        for t in range(slots.shape[1]):
            if 0 <= slots[b, t] < max_len:
                cache[b, :, slots[b, t]] = new[b, :, t]
    return cache


# ----------------------------------------------------------------------------------------
# decode_attention
# ----------------------------------------------------------------------------------------
# (q_heads, kv_heads, head_dim, seq_lens, max_len): batch = len(seq_lens)
DECODE_SMALL = [
    (1, 1, 16, [1], 1),                    # one key: the output is that key's value
    (4, 4, 64, [130, 1, 64], 131),         # MHA; a length that fills exactly one tile
    (8, 4, 40, [77, 0, 129], 140),         # GQA 2:1, head_dim 40; an empty sequence
    (8, 2, 96, [3, 200], 203),             # GQA 4:1, head_dim 96, several tiles
    (14, 2, 64, [65, 33], 70),             # GQA 7:1 (a group that is not a power of two)
    (7, 1, 128, [50, 1, 99], 101),         # MQA, 7 query heads on one KV head
    (32, 1, 16, [45], 45),                 # MQA with a group of 32 (> the 16-row minimum)
]
DECODE_LARGE = [
    (32, 8, 128, [33000, 1, 4097, 17, 32768, 12345, 8191, 2], 33000),  # Llama-3-8B-like, long context
    (32, 32, 128, [4096, 1000, 3, 4095], 4096),                         # MHA
    (64, 8, 256, [5000, 2049], 5000),                                   # head_dim 256
    (28, 4, 128, [20000, 0, 1], 20000),                                 # GQA 7:1 (Qwen2-7B-like)
]
DECODE_CASES = [pytest.param(*c, id=f"h{c[0]}-kv{c[1]}-d{c[2]}-L{'_'.join(map(str, c[3]))}") for c in DECODE_SMALL] + [
    pytest.param(*c, id=f"h{c[0]}-kv{c[1]}-d{c[2]}-b{len(c[3])}-L{max(c[3])}", marks=pytest.mark.gpu)
    for c in DECODE_LARGE
]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,seq_lens,max_len", DECODE_CASES)
def test_decode_attention(q_heads, kv_heads, head_dim, seq_lens, max_len, dtype, device, gen, seed):
    batch = len(seq_lens)
    q = random_tensor((batch, q_heads, head_dim), dtype, device, gen)
    k, v = make_cache(batch, kv_heads, max_len, head_dim, seq_lens, dtype, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out, lse = poisoned((batch, q_heads, head_dim), dtype, device), poisoned((batch, q_heads), torch.float32, device)

    got_out, got_lse = decode_attention(q, k, v, lens, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    ref_out, ref_lse = reference_decode(q, k, v, seq_lens)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


def test_decode_attention_allocates_outputs(device, gen, seed):
    """Without ``out``/``lse`` the launcher allocates them: q's dtype, and float32."""
    dtype = torch.float16
    q = random_tensor((2, 4, 32), dtype, device, gen)
    k, v = make_cache(2, 2, 19, 32, [19, 5], dtype, device, gen)
    out, lse = decode_attention(q, k, v, torch.tensor([19, 5], dtype=torch.int64, device=device))  # int64 lengths too
    assert out.shape == (2, 4, 32) and out.dtype == dtype
    assert lse.shape == (2, 4) and lse.dtype == torch.float32
    ref_out, ref_lse = reference_decode(q, k, v, [19, 5])
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


def test_decode_attention_follows_strides(device, gen, seed):
    """A cache stored as ``[batch, max_len, kv_heads, head_dim]`` (token-major, as some engines
    keep it) viewed as ``[batch, kv_heads, max_len, head_dim]``; q sliced out of a fused
    projection; out written into a strided view. The kernel follows all the strides."""
    dtype = torch.float32
    batch, q_heads, kv_heads, max_len, head_dim = 2, 6, 2, 90, 48
    k_tok = random_tensor((batch, max_len, kv_heads, head_dim), dtype, device, gen)
    v_tok = random_tensor((batch, max_len, kv_heads, head_dim), dtype, device, gen)
    k, v = k_tok.transpose(1, 2), v_tok.transpose(1, 2)
    qkv = random_tensor((batch, 3, q_heads, head_dim), dtype, device, gen)
    q = qkv[:, 1]
    assert not (q.is_contiguous() or k.is_contiguous())
    out_buf = poisoned((q_heads, batch, head_dim), dtype, device)
    lse_buf = poisoned((q_heads, batch), torch.float32, device)
    seq_lens = [90, 61]
    decode_attention(q, k, v, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                     out=out_buf.transpose(0, 1), lse=lse_buf.t())
    ref_out, ref_lse = reference_decode(q, k, v, seq_lens)
    assert_close(out_buf.transpose(0, 1), ref_out, dtype, "out", seed)
    assert_close(lse_buf.t(), ref_lse, dtype, "lse", seed)


def test_decode_attention_custom_scale(device, gen, seed):
    dtype = torch.float32
    q = random_tensor((1, 2, 16), dtype, device, gen)
    k, v = make_cache(1, 1, 70, 16, [70], dtype, device, gen)
    out, lse = decode_attention(q, k, v, torch.tensor([70], dtype=torch.int32, device=device), scale=0.7)
    ref_out, ref_lse = reference_decode(q, k, v, [70], scale=0.7)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


def test_decode_attention_rejects_bad_shapes(device, gen):
    q = random_tensor((1, 6, 16), torch.float32, device, gen)
    k = random_tensor((1, 4, 8, 16), torch.float32, device, gen)
    lens = torch.tensor([8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, k, k, lens)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(q[:, :4], k, k, torch.tensor([8, 8], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="does not match"):
        decode_attention(q[:, :4, :8], k, k, lens)


# ----------------------------------------------------------------------------------------
# write_kv
# ----------------------------------------------------------------------------------------
# (kv_heads, head_dim, max_len, slots): batch = len(slots), T = len(slots[0])
WRITE_CASES = [
    (1, 16, 4, [[0]]),                                 # the smallest write
    (2, 40, 37, [[5], [0], [36]]),                     # decode: each sequence at its own position
    (3, 64, 50, [[9, 2, 30, 31, 0], [-1, 17, 4, -1, 49]]),  # unsorted, gaps, padding
    (8, 128, 23, [[22, 21, 20], [-1, -1, -1]]),        # a sequence of padding only
    (5, 96, 11, [[3, 11, -7, 100, 4]]),                # out-of-range slots write nothing
]


@pytest.mark.parametrize("kv_heads,head_dim,max_len,slots", WRITE_CASES)
def test_write_kv(kv_heads, head_dim, max_len, slots, dtype, device, gen, seed):
    batch, n_tokens = len(slots), len(slots[0])
    k_cache = random_tensor((batch, kv_heads, max_len, head_dim), dtype, device, gen)
    v_cache = random_tensor((batch, kv_heads, max_len, head_dim), dtype, device, gen)
    k_new = random_tensor((batch, kv_heads, n_tokens, head_dim), dtype, device, gen)
    v_new = random_tensor((batch, kv_heads, n_tokens, head_dim), dtype, device, gen)
    want_k = reference_scatter(to_numpy(k_cache), to_numpy(k_new), slots)
    want_v = reference_scatter(to_numpy(v_cache), to_numpy(v_new), slots)

    write_kv(k_cache, v_cache, k_new, v_new, torch.tensor(slots, dtype=torch.int32, device=device))
    # A copy is exact: every untouched slot keeps its old value, every written one the new row.
    assert_close(k_cache, want_k, dtype, "k_cache", seed, atol=0, rtol=0)
    assert_close(v_cache, want_v, dtype, "v_cache", seed, atol=0, rtol=0)


def test_write_kv_strided_rows_and_cast(device, gen, seed):
    """New rows in the ``[batch, T, kv_heads, head_dim]`` layout of a projection's output,
    fp32, written into an fp16 cache (int64 slots): strides followed, values cast."""
    batch, n_tokens, kv_heads, head_dim, max_len = 2, 6, 3, 24, 40
    k_cache = random_tensor((batch, kv_heads, max_len, head_dim), torch.float16, device, gen)
    v_cache = random_tensor((batch, kv_heads, max_len, head_dim), torch.float16, device, gen)
    k_new = random_tensor((batch, n_tokens, kv_heads, head_dim), torch.float32, device, gen).transpose(1, 2)
    v_new = random_tensor((batch, n_tokens, kv_heads, head_dim), torch.float32, device, gen).transpose(1, 2)
    slots = [[39, 0, 7, 8, 6, 21], [1, -1, 2, 3, 38, -1]]
    rounded = lambda t: to_numpy(t.to(torch.float16))  # noqa: E731 - what the cache can hold
    want_k = reference_scatter(to_numpy(k_cache), rounded(k_new), slots)
    want_v = reference_scatter(to_numpy(v_cache), rounded(v_new), slots)
    write_kv(k_cache, v_cache, k_new, v_new, torch.tensor(slots, dtype=torch.int64, device=device))
    assert_close(k_cache, want_k, torch.float16, "k_cache", seed, atol=0, rtol=0)
    assert_close(v_cache, want_v, torch.float16, "v_cache", seed, atol=0, rtol=0)


def test_write_kv_rejects_bad_shapes(device, gen):
    cache = random_tensor((2, 2, 8, 16), torch.float32, device, gen)
    new = random_tensor((2, 2, 3, 16), torch.float32, device, gen)
    with pytest.raises(ValueError, match="slots"):
        write_kv(cache, cache.clone(), new, new, torch.zeros(2, 2, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="integer"):
        write_kv(cache, cache.clone(), new, new, torch.zeros(2, 3, device=device))
    with pytest.raises(ValueError, match="does not match"):
        write_kv(cache, cache.clone(), new[:, :1], new[:, :1], torch.zeros(2, 3, dtype=torch.int32, device=device))


# ----------------------------------------------------------------------------------------
# Decode == recompute
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 32), pytest.param(32, 8, 128, marks=pytest.mark.gpu)])
def test_decode_token_by_token_equals_recompute(q_heads, kv_heads, head_dim, dtype, device, gen, seed):
    """Prefill prompts of different lengths (the shorter one padded with slot -1), then
    decode token by token: write the new K/V at each sequence's own position, attend over
    the cache. Every step must equal row ``p`` of causal attention over the whole sequence.
    Sequence 2 stops early: its slot becomes -1 and its length stays, so its cache must
    not change while the others go on."""
    prompts, totals = [5, 9, 1], [40, 31, 12]
    batch, max_len = len(prompts), max(totals) + 3
    q_all = random_tensor((batch, q_heads, max(totals), head_dim), dtype, device, gen)
    k_all = random_tensor((batch, kv_heads, max(totals), head_dim), dtype, device, gen)
    v_all = random_tensor((batch, kv_heads, max(totals), head_dim), dtype, device, gen)
    k_cache = torch.zeros((batch, kv_heads, max_len, head_dim), dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)

    # Prefill: one write of max(prompts) tokens per sequence, padding beyond each prompt.
    t_max = max(prompts)
    slots = torch.tensor([[t if t < n else -1 for t in range(t_max)] for n in prompts], dtype=torch.int32)
    write_kv(k_cache, v_cache, k_all[:, :, :t_max], v_all[:, :, :t_max], slots.to(device))

    ref = [attention(to_numpy(q_all[b:b + 1, :, :n]), to_numpy(k_all[b:b + 1, :, :n]),
                     to_numpy(v_all[b:b + 1, :, :n]), causal=True) for b, n in enumerate(totals)]
    lens = list(prompts)
    while any(n < total for n, total in zip(lens, totals)):
        pos = [n if n < total else -1 for n, total in zip(lens, totals)]  # -1: this one is done
        gather = torch.tensor([max(p, 0) for p in pos], device=device)
        idx = torch.arange(batch, device=device)
        k_step = k_all[idx, :, gather][:, :, None]  # [batch, kv_heads, 1, head_dim]
        v_step = v_all[idx, :, gather][:, :, None]
        q_step = q_all[idx, :, gather]              # [batch, q_heads, head_dim]
        write_kv(k_cache, v_cache, k_step, v_step, torch.tensor(pos, dtype=torch.int32, device=device)[:, None])
        lens = [p + 1 if p >= 0 else n for p, n in zip(pos, lens)]
        out = poisoned((batch, q_heads, head_dim), dtype, device)
        lse = poisoned((batch, q_heads), torch.float32, device)
        decode_attention(q_step, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32, device=device), out=out, lse=lse)
        for b, p in enumerate(pos):
            if p >= 0:
                assert_close(out[b], ref[b][0][0, :, p], dtype, f"out (sequence {b}, position {p})", seed)
                assert_close(lse[b], ref[b][1][0, :, p], dtype, f"lse (sequence {b}, position {p})", seed)

    # The cache ends up holding exactly each sequence's K/V, and zeros past its end.
    for b, n in enumerate(totals):
        assert_close(k_cache[b, :, :n], to_numpy(k_all[b, :, :n]), dtype, "k_cache", seed, atol=0, rtol=0)
        assert_close(v_cache[b, :, :n], to_numpy(v_all[b, :, :n]), dtype, "v_cache", seed, atol=0, rtol=0)
        assert not k_cache[b, :, n:].any() and not v_cache[b, :, n:].any()


# ----------------------------------------------------------------------------------------
# Offsets past 2^31
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_offsets_past_two_to_the_31(device, gen, seed):
    """A bf16 cache of 64 sequences x 8 heads x 33k slots x 128 = 2.16e9 elements per tensor
    (4.3 GB each): the last sequences start past 2^31 elements, so both kernels must index in
    int64. Only short lengths are used (fast), and only the last sequences are checked."""
    dtype = torch.bfloat16
    batch, q_heads, kv_heads, max_len, head_dim = 64, 32, 8, 33000, 128
    assert batch * kv_heads * max_len * head_dim > 2 ** 31
    k_cache = torch.zeros((batch, kv_heads, max_len, head_dim), dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    n = 300
    k_new = random_tensor((batch, kv_heads, n, head_dim), dtype, device, gen)
    v_new = random_tensor((batch, kv_heads, n, head_dim), dtype, device, gen)
    # Write the tokens at the end of each cache, then one more near the start.
    slots = torch.arange(max_len - n, max_len, device=device, dtype=torch.int32).expand(batch, n).contiguous()
    write_kv(k_cache, v_cache, k_new, v_new, slots)
    assert torch.equal(k_cache[-1, :, max_len - n:], k_new[-1]) and torch.equal(v_cache[-1, :, max_len - n:], v_new[-1])
    q = random_tensor((batch, q_heads, head_dim), dtype, device, gen)
    lens = torch.full((batch,), max_len, dtype=torch.int32, device=device)
    out, lse = decode_attention(q, k_cache, v_cache, lens)
    last = slice(batch - 2, batch)
    ref_out, ref_lse = reference_decode(q[last], k_cache[last], v_cache[last], [max_len] * 2)
    assert_close(out[last], ref_out, dtype, "out (last two sequences)", seed)
    assert_close(lse[last], ref_lse, dtype, "lse (last two sequences)", seed)


# ----------------------------------------------------------------------------------------
# The benchmark's bookkeeping (no timing: a stand-in timer, tiny shapes, the interpreter)
# ----------------------------------------------------------------------------------------
def test_benchmark_dry_run(device):
    """`bench.ch02_decode_attention.sweep` end to end on tiny shapes with a stand-in timer
    that just calls the function once: every point adds its rows, our output agrees with
    SDPA's, and the summary prints. The real sweep runs on a GPU (`python -m bench.run`)."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # `pytest` without `python -m` does not put the root on the path
        sys.path.insert(0, root)
    from bench import ch02_decode_attention as bench
    from bench.common import Results

    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    bench.sweep(results, device, q_heads=4, kv_heads_list=(1, 4), batches=(2,), contexts=(33, 70), head_dim=16,
                dtype=torch.float32, timer=lambda fn: (fn(), 1.0)[1], write_max_len=9)
    rows = results.rows
    decode_points, write_points = 2 * 2, 2
    count = lambda metric: sum(r["metric"] == metric for r in rows)  # noqa: E731
    assert count("time_ms") == 2 * decode_points          # one row per peer
    assert count("bandwidth_TBps") == decode_points
    assert count("rel_err") == decode_points
    assert count("write_kv_time_ms") == 2 * write_points
    assert all(r["ours"] < 1e-5 for r in rows if r["metric"] == "rel_err")
    assert {r["peer"] for r in rows if r["metric"] == "time_ms"} >= {"sdpa_default"}
    assert results.status[bench.BENCHMARK] == "complete"
    table = bench.summary(results)
    assert len(table.splitlines()) == 1 + decode_points + 3 + write_points
