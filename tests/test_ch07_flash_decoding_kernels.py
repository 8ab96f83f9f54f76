"""Chapter 7's flash-decoding kernels against float64 NumPy references.

(The references themselves are tested in `test_ch07_flash_decoding_reference.py`, the
traffic counts in `test_costs.py`.)

- `flash_decode_attention` (and its tuning knobs) against `minillm.reference.ch07_flash_decoding` on
  Chapter 5's shuffled, NaN-poisoned pools (`minillm.testing.PagedPool`): block sizes 1, 3, 4, 8, 16, 17, 32; MHA, GQA 4
  and 8, MQA; head dims 32-128 (80 too); lengths 0, 1 and odd; 1, 2, 3, 7 splits and more
  splits than tiles (empty splits in a mixed batch). Both the final output and the
  workspace of partials stage 1 wrote are compared; with one split the workspace must stay
  untouched (stage 1 writes the output directly).
- The asynchronized softmax: equal to the exact kernel when no split falls back (and no
  fallback fires); a KV head whose scores sit far above φ, and φ far above or below every
  score (exp overflowing or underflowing), fall back per (sequence, KV head, split) exactly as
  the reference says, and the results stay correct.
- Both tile paths, invalid block ids (read as zeros), lengths clamped to the table, strided
  inputs and outputs, the stage-2 kernel alone (empty splits whose partial output is NaN,
  all-empty rows, logsumexps of ±1000), agreement with Chapter 5's `paged_decode_attention`.
- The split heuristics: FlashAttention-2's rule on hand-computed cases (including its
  eligibility rule and a float32 tie), ours, fixed partitions.

CPU: small shapes under the interpreter, fp32 and fp16, ``BLOCK_N = 16`` on every device for
the small cases (so that splits fall the same way on a GPU). GPU (`make gpu`): the same plus
bf16 and the `gpu`-marked long contexts with the default tile size and heuristic.
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minillm.kernels.ch07_flash_decoding import (
    ASYNC_WINDOW_FP16, ASYNC_WINDOW_WIDE, CPU_NUM_SMS, MAX_SPLITS, MIN_TILES_PER_SPLIT, SPLIT_PROGRAMS_PER_SM,
    async_window, cached_workspace, clear_workspace_cache, fa2_num_splits, flash_decode_attention, num_sms,
    num_splits_heuristic, partition_splits, reduce_splits, split_counters, split_workspace, tma_applies,
    workspace_cache,
)
from minillm.kernels.ch05_paged_attention import contiguous_as_paged, decode_block_n, paged_decode_attention
from minillm.paged import PAD
from minillm.reference import attention, kv_head_for
from minillm.reference import ch07_flash_decoding as ref
from minillm.testing import PagedPool, assert_close, poisoned, random_tensor, skip_fp32_on_gpu, to_numpy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Keys per tile in the small cases, on every device: the interpreter's own tile size, and
#: on a GPU a size at which these short sequences still have several tiles to split.
BLOCK_N = 16


def reference_partials(q, pool: PagedPool, num_splits, block_n=BLOCK_N, scale=None, phi=None, window=None):
    k, v, tables = pool.numpy()
    return ref.flash_decode_partials(to_numpy(q), k, v, tables, pool.seq_lens, num_splits, block_n, scale, phi,
                                     window)


def run(q, pool: PagedPool, num_splits, dtype, device, **kwargs):
    """`flash_decode_attention` into NaN-poisoned output, lse and workspace (with its own arrival
    counters, which must be back to zero after the call); returns out, lse, (o_part, lse_part)."""
    batch, q_heads, head_dim = q.shape
    out, lse = poisoned(q.shape, dtype, device), poisoned((batch, q_heads), torch.float32, device)
    workspace = (poisoned((batch, q_heads, num_splits, head_dim), torch.float32, device),
                 poisoned((batch, q_heads, num_splits), torch.float32, device), split_counters(batch, q_heads, device))
    got = flash_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device), out=out, lse=lse,
                                 num_splits=num_splits, block_n=kwargs.pop("block_n", BLOCK_N), workspace=workspace,
                                 **kwargs)
    assert got[0] is out and got[1] is lse
    assert not workspace[2].any(), "the arrival counters must be back to zero after the call"
    return out, lse, workspace[:2]


# ----------------------------------------------------------------------------------------
# flash_decode_attention against the reference
# ----------------------------------------------------------------------------------------
# (q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits)
SMALL = [
    (2, 2, 64, 1, [37, 0, 5], 3),        # MHA, blocks of 1, a length 0, a sequence shorter than a split
    (8, 2, 80, 3, [51, 1, 23], 2),       # GQA 4:1, head dim 80, blocks of 3, a length 1
    (16, 2, 128, 16, [77, 16, 40], 7),   # GQA 8:1, blocks of BLOCK_N: one table entry per tile
    (6, 1, 32, 17, [69, 2], 3),          # MQA (6 heads), blocks of 17 (tiles straddle blocks)
    (4, 4, 32, 4, [50, 16, 1], 9),       # blocks of 4 (4 whole blocks per tile); 9 splits > 4 tiles
    (4, 2, 64, 16, [33, 0], 1),          # one split: no stage 2, the output written directly
]
LARGE = [
    (32, 8, 128, 16, [4097, 1, 33000, 17, 12345], None),  # Llama-3-8B-like: the default heuristic
    (32, 8, 128, 16, [70000, 5], 37),                     # many splits of a long sequence
    (32, 32, 128, 256, [4096, 1000, 3], None),            # MHA, blocks of 256
    (28, 4, 128, 17, [20000, 0, 1], 5),                   # GQA 7:1, blocks of 17
    (64, 8, 256, 32, [5000, 2049], 3),                    # head dim 256
]


def _case_id(c):
    return f"h{c[0]}-kv{c[1]}-d{c[2]}-bs{c[3]}-L{'_'.join(map(str, c[4]))}-S{c[5]}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two_launch"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens,num_splits",
                         [pytest.param(*c, id=_case_id(c)) for c in SMALL])
def test_flash_decode_attention(q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, fused, dtype, device,
                                gen, seed):
    """Output, lse and the workspace of partials against the reference (stage 1 and the
    merge each checked), with the merge in stage 1's last program (fused) and in a second
    launch; with one split the workspace is never touched."""
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, dtype, device, gen)
    q = random_tensor((len(seq_lens), q_heads, head_dim), dtype, device, gen)
    out, lse, (o_part, lse_part) = run(q, pool, num_splits, dtype, device, fused_merge=fused)
    want_o, want_l, _ = reference_partials(q, pool, num_splits)
    ref_out, ref_lse = ref.merge_partials(want_o, want_l)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)
    if num_splits == 1:
        assert o_part.isnan().all() and lse_part.isnan().all(), "one split: the workspace must stay untouched"
    else:
        assert_close(o_part, want_o, dtype, "partial outputs", seed)
        assert_close(lse_part, want_l, dtype, "partial lse", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens,num_splits",
                         [pytest.param(*c, id=_case_id(c)) for c in LARGE])
def test_flash_decode_attention_long(q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, dtype, device,
                                     gen, seed):
    """Long contexts with the GPU's own tile size, exact and asynchronized (φ = 0: random
    scores never leave the window, so nothing falls back)."""
    skip_fp32_on_gpu(dtype, device)
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, dtype, device, gen)
    q = random_tensor((len(seq_lens), q_heads, head_dim), dtype, device, gen)
    want_out, want_lse = ref.merge_partials(*reference_partials(q, pool, 1, decode_block_n(head_dim, dtype))[:2])
    for phi, fused in ((None, True), (0.0, True), (None, False)):
        out, lse = flash_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device), num_splits=num_splits,
                                          max_seq_len=max(seq_lens), phi=phi, fused_merge=fused)
        assert_close(out, want_out, dtype, f"out (phi={phi}, fused={fused})", seed)
        assert_close(lse, want_lse, dtype, f"lse (phi={phi}, fused={fused})", seed)


@pytest.mark.parametrize("block_size", [16, 32])
def test_both_tile_paths(block_size, device, gen, seed):
    """Split starts are multiples of BLOCK_N, so blocks of 16 and 32 take the
    one-entry-per-tile path by default; forcing the general path gives the same answer."""
    dtype = torch.float16
    pool = PagedPool([5 * block_size + 3, 2 * block_size, 3], block_size, 2, 32, dtype, device, gen)
    q = random_tensor((3, 4, 32), dtype, device, gen)
    want_out, want_lse = ref.merge_partials(*reference_partials(q, pool, 3)[:2])
    for path in (True, False):
        out, lse, _ = run(q, pool, 3, dtype, device, tile_in_block=path)
        assert_close(out, want_out, dtype, f"out (tile_in_block={path})", seed)
        assert_close(lse, want_lse, dtype, f"lse (tile_in_block={path})", seed)


def test_invalid_blocks_read_zeros_and_lengths_are_clamped(device, gen, seed):
    """A table entry inside a length that is not a block (-1, or past the pool) reads as zero
    keys and values, in whichever split it falls; a length past the table is clamped to it
    (the table is a column slice of a wider one naming NaN blocks, so a read past it shows)."""
    dtype = torch.float32
    block_size, q_heads, kv_heads, head_dim = 8, 4, 2, 16
    pool = PagedPool([45, 24], block_size, kv_heads, head_dim, dtype, device, gen, spare_blocks=6)
    width = pool.tables.shape[1]  # 7 columns: 6 used by sequence 0, 3 by sequence 1
    spare = pool.unused_blocks()
    wide = torch.full((2, width + 2), PAD, dtype=torch.int32, device=device)
    wide[:, :width] = pool.tables
    wide[:, width:] = torch.tensor(spare[:2], dtype=torch.int32, device=device)  # NaN blocks past the table
    tables = wide[:, :width]
    tables[0, 3] = PAD                   # sequence 0: positions 24-31 (its second split) in a hole
    tables[1, 0] = pool.k.shape[0] + 7   # sequence 1: positions 0-7 in a block past the pool
    # Sequence 1's length is clamped to the table's 7 blocks (56 tokens): fill blocks 3-6.
    tables[1, 3:] = torch.tensor(spare[2:6], dtype=torch.int32, device=device)
    for blk in spare[2:6]:
        pool.k[blk] = random_tensor((block_size, kv_heads, head_dim), dtype, device, gen)
        pool.v[blk] = random_tensor((block_size, kv_heads, head_dim), dtype, device, gen)
    lens = torch.tensor([45, 999], dtype=torch.int32, device=device)
    q = random_tensor((2, q_heads, head_dim), dtype, device, gen)
    out, lse = flash_decode_attention(q, pool.k, pool.v, tables, lens, num_splits=3, block_n=BLOCK_N)

    k_flat, v_flat = pool.k.reshape(-1, kv_heads, head_dim), pool.v.reshape(-1, kv_heads, head_dim)
    for b, (n, hole) in enumerate(((45, 3), (56, 0))):
        pos = torch.arange(n, device=device)
        blk = tables[b].long()[pos // block_size]
        kb = to_numpy(k_flat[blk.clamp(0, pool.k.shape[0] - 1) * block_size + pos % block_size])
        vb = to_numpy(v_flat[blk.clamp(0, pool.k.shape[0] - 1) * block_size + pos % block_size])
        kb[hole * block_size:(hole + 1) * block_size] = 0.0  # what the kernel must see there
        vb[hole * block_size:(hole + 1) * block_size] = 0.0
        o, l = attention(to_numpy(q[b])[None, :, None], kb.transpose(1, 0, 2)[None], vb.transpose(1, 0, 2)[None])
        assert_close(out[b], o[0, :, 0], dtype, f"out (sequence {b})", seed)
        assert_close(lse[b], l[0, :, 0], dtype, f"lse (sequence {b})", seed)


def test_follows_strides(device, gen, seed):
    """K a head-dim slice of a wider buffer, V a transposed copy, q sliced out of a fused
    projection, a column-sliced table, out/lse and the workspace written through strided views."""
    dtype = torch.float32
    batch, q_heads, kv_heads, head_dim, block_size, splits = 2, 6, 2, 40, 5, 3
    pool = PagedPool([43, 9], block_size, kv_heads, head_dim, dtype, device, gen)
    wide = torch.full((*pool.k.shape[:3], 56), float("nan"), dtype=dtype, device=device)
    wide[..., :head_dim] = pool.k
    k = wide[..., :head_dim]
    v = pool.v.transpose(1, 2).contiguous().transpose(1, 2)
    tables = torch.full((batch, 2 * pool.tables.shape[1]), PAD, dtype=torch.int32, device=device)
    tables[:, ::2] = pool.tables
    tables = tables[:, ::2]
    q = random_tensor((batch, 3, q_heads, head_dim), dtype, device, gen)[:, 1]
    out_buf = poisoned((q_heads, batch, head_dim), dtype, device)
    lse_buf = poisoned((q_heads, batch), torch.float32, device)
    o_ws = poisoned((splits, batch, q_heads, head_dim), torch.float32, device).permute(1, 2, 0, 3)  # FA2's layout
    l_ws = poisoned((splits, batch, q_heads), torch.float32, device).permute(1, 2, 0)
    flash_decode_attention(q, k, v, tables, pool.lens(device), out=out_buf.transpose(0, 1), lse=lse_buf.t(),
                           num_splits=splits, block_n=BLOCK_N, workspace=(o_ws, l_ws))
    want_o, want_l, _ = reference_partials(q, pool, splits)
    ref_out, ref_lse = ref.merge_partials(want_o, want_l)
    assert_close(out_buf.transpose(0, 1), ref_out, dtype, "out", seed)
    assert_close(lse_buf.t(), ref_lse, dtype, "lse", seed)
    assert_close(o_ws, want_o, dtype, "partial outputs", seed)


def test_agrees_with_chapter_5_and_default_splits(dtype, device, gen, seed):
    """The public function with its default heuristic splits a 200-token sequence (six
    splits of 2+ tiles on the CPU), and agrees with Chapter 5's unsplit kernel."""
    pool = PagedPool([200, 31], 16, 2, 64, dtype, device, gen)
    q = random_tensor((2, 8, 64), dtype, device, gen)
    if decode_block_n(64, dtype) == 16:  # the interpreter: the heuristic sees 13 tiles
        assert num_splits_heuristic(2, 2, 208, num_sms(device), 16) == min(13 // MIN_TILES_PER_SPLIT, MAX_SPLITS)
    out, lse = flash_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device))
    ch5_out, ch5_lse = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device))
    assert_close(out, to_numpy(ch5_out), dtype, "out vs Chapter 5", seed)
    assert_close(lse, to_numpy(ch5_lse), dtype, "lse vs Chapter 5", seed)
    want_out, want_lse = ref.merge_partials(*reference_partials(q, pool, 1)[:2])
    assert_close(out, want_out, dtype, "out", seed)


# ----------------------------------------------------------------------------------------
# The asynchronized softmax
# ----------------------------------------------------------------------------------------
def split_row_maxima(q, pool: PagedPool, num_splits, block_n=BLOCK_N):
    """``[q_heads]`` arrays: each query head's largest scaled score in each non-empty split."""
    k, v, tables = pool.numpy()
    q = to_numpy(q)
    q_heads, head_dim = q.shape[1:]
    maxima = []
    for b, n in enumerate(pool.seq_lens):
        kb = ref.gather_paged_kv(k, v, tables[b], n)[0][kv_head_for(np.arange(q_heads), q_heads, k.shape[2])]
        for lo, hi in ref.split_bounds(n, num_splits, block_n):
            if hi > lo:
                maxima.append((np.einsum("hd,hnd->hn", q[b], kb[:, lo:hi]) / math.sqrt(head_dim)).max(axis=1))
    return maxima


def test_async_equals_exact_without_fallback(dtype, device, gen, seed):
    """φ one unit below the smallest split max: every row's offset is inside the window (for
    fp16's narrow one too), no program falls back, and the result is the exact one."""
    q_heads, kv_heads, head_dim, splits = 8, 2, 64, 3
    pool = PagedPool([61, 40, 0], 16, kv_heads, head_dim, dtype, device, gen)
    q = random_tensor((3, q_heads, head_dim), dtype, device, gen)
    maxima = split_row_maxima(q, pool, splits)
    phi = float(min(m.min() for m in maxima)) - 1.0
    lo, hi = async_window(dtype)
    offsets = (np.concatenate(maxima) - phi) * math.log2(math.e)
    assert offsets.min() >= lo and offsets.max() <= hi, "the test's φ must keep every split in the window"
    flags = torch.full((3, kv_heads, splits), -1, dtype=torch.int32, device=device)
    out, lse, (o_part, lse_part) = run(q, pool, splits, dtype, device, phi=phi, fallbacks=flags)
    assert flags.cpu().eq(0).all(), f"no program should fall back: {flags.cpu().tolist()}"
    want_o, want_l, _ = reference_partials(q, pool, splits)
    ref_out, ref_lse = ref.merge_partials(want_o, want_l)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)
    assert_close(o_part, want_o, dtype, "partial outputs", seed)
    assert_close(lse_part, want_l, dtype, "partial lse", seed)
    exact_out, _, _ = run(q, pool, splits, dtype, device)
    assert_close(out, to_numpy(exact_out), dtype, "out vs exact mode", seed)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter, before falling back
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("lanes", [False, True], ids=["row-sums", "lane-tiles"])
def test_async_fallback_fires_where_it_must(lanes, dtype, device, gen, seed):
    """KV head 1's scores are all >= 50 nats (72 binades, past both windows) above φ = 0, KV
    head 0's random ones within a few nats of it: exactly head 1's non-empty splits fall back
    (as the reference says), and the output is still exact. Then φ = ±500 (exp would overflow
    to inf, or underflow to 0, in every split): every non-empty split falls back."""
    skip_fp32_on_gpu(dtype, device)
    q_heads, kv_heads, head_dim, splits = 8, 2, 32, 4
    seq_lens = [50, 0, 7]
    pool = PagedPool(seq_lens, 4, kv_heads, head_dim, dtype, device, gen)
    pool.k[:, :, 1] = pool.k[:, :, 1].abs() + 1.0  # (NaN slots stay NaN)
    q = random_tensor((3, q_heads, head_dim), dtype, device, gen)
    q[:, 4:] = 50.0 / math.sqrt(head_dim)
    window = async_window(dtype)
    want_o, want_l, _ = reference_partials(q, pool, splits)
    nonempty = np.array([[hi > lo for lo, hi in ref.split_bounds(n, splits, BLOCK_N)] for n in seq_lens])
    for phi, heads_falling in ((0.0, [False, True]), (500.0, [True, True]), (-500.0, [True, True])):
        _, _, want_fell = reference_partials(q, pool, splits, phi=phi, window=window)
        expected = nonempty[:, None, :] & np.array(heads_falling)[None, :, None]
        assert np.array_equal(want_fell, expected), "the reference's fallbacks"
        flags = torch.full((3, kv_heads, splits), -1, dtype=torch.int32, device=device)
        out, lse, (o_part, _) = run(q, pool, splits, dtype, device, phi=phi, fallbacks=flags,
                                    config=dict(ASYNC_LANES=lanes))
        assert np.array_equal(flags.cpu().numpy(), expected.astype(np.int32)), \
            f"phi={phi}: fallbacks {flags.cpu().tolist()}, expected {expected.astype(int).tolist()}"
        ref_out, ref_lse = ref.merge_partials(want_o, want_l)
        assert_close(out, ref_out, dtype, f"out (phi={phi})", seed)
        assert_close(lse, ref_lse, dtype, f"lse (phi={phi})", seed)
        assert_close(o_part, want_o, dtype, f"partial outputs (phi={phi})", seed)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_async_window_edges(dtype, device, gen, seed):
    """φ placed so that the largest split max sits 1 binade inside, then 1 binade past, the
    upper edge of the window, and the smallest 1 binade past the lower edge: the programs that
    fall back are exactly those the reference names (no row within 0.05 binades of an edge,
    where fp32 and float64 scores could disagree), and the output is right every time."""
    skip_fp32_on_gpu(dtype, device)
    q_heads, kv_heads, head_dim, splits = 4, 2, 32, 3
    pool = PagedPool([45, 30], 8, kv_heads, head_dim, dtype, device, gen)
    q = random_tensor((2, q_heads, head_dim), dtype, device, gen, scale=2.0)  # maxima spread over ~10 binades
    maxima2 = np.concatenate(split_row_maxima(q, pool, splits)) * math.log2(math.e)  # log2 units
    lo, hi = async_window(dtype)
    want_o, want_l, _ = reference_partials(q, pool, splits)
    ref_out, ref_lse = ref.merge_partials(want_o, want_l)
    for phi2, some_fall in ((maxima2.max() - (hi - 1), False), (maxima2.max() - (hi + 1), True),
                            (maxima2.min() - (lo - 1), True)):
        while np.abs(maxima2 - phi2 - hi).min() < 0.05 or np.abs(maxima2 - phi2 - lo).min() < 0.05:
            phi2 += 0.1  # keep every row clear of the edges
        phi = phi2 / math.log2(math.e)
        _, _, want_fell = reference_partials(q, pool, splits, phi=phi, window=(lo, hi))
        assert want_fell.any() == some_fall
        flags = torch.full((2, kv_heads, splits), -1, dtype=torch.int32, device=device)
        out, lse, _ = run(q, pool, splits, dtype, device, phi=phi, fallbacks=flags)
        assert np.array_equal(flags.cpu().numpy(), want_fell.astype(np.int32)), \
            f"phi={phi:.3f}: fallbacks {flags.cpu().tolist()}, expected {want_fell.astype(int).tolist()}"
        assert_close(out, ref_out, dtype, f"out (phi={phi:.3f})", seed)
        assert_close(lse, ref_lse, dtype, f"lse (phi={phi:.3f})", seed)


def test_async_window():
    """fp16 P: a largest p within [2^-6, 2^15] (2^15 < 65504); bf16/fp32 P: fp32's range."""
    assert async_window(torch.float16) == ASYNC_WINDOW_FP16 and ASYNC_WINDOW_FP16[1] < math.log2(65504)
    assert async_window(torch.bfloat16) == async_window(torch.float32) == ASYNC_WINDOW_WIDE
    lo, hi = ASYNC_WINDOW_WIDE
    assert hi + 17 + 20 < 128 and lo - 24 > -126  # 2^17 keys, |v| < 2^20; 24 bits above the subnormals


# ----------------------------------------------------------------------------------------
# Stage 2 alone
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 5, 40])
def test_reduce_kernel_alone(num_splits, device, gen, seed):
    """`reduce_splits` on random partials (strided: FA2's split-major layout) against
    `merge_partials`: a third of the splits empty with NaN outputs (never read), one row all
    empty, logsumexps of ±1000 (no overflow)."""
    batch, q_heads, head_dim = 3, 4, 24
    o_part = random_tensor((num_splits, batch, q_heads, head_dim), torch.float32, device, gen).permute(1, 2, 0, 3)
    lse_part = (random_tensor((num_splits, batch, q_heads), torch.float32, device, gen) * 5).permute(1, 2, 0)
    rng = np.random.default_rng(seed)
    empty = torch.from_numpy(rng.random((batch, q_heads, num_splits)) < 0.34).to(device)
    empty[1, 2] = True                   # an all-empty row
    lse_part[0, 0] += 1000.0             # huge logsumexps: e^{lse} would overflow
    lse_part[0, 1] -= 1000.0
    lse_part.masked_fill_(empty, float("-inf"))
    o_part.masked_fill_(empty[..., None], float("nan"))
    out = poisoned((batch, q_heads, head_dim), torch.float16, device)
    lse = poisoned((batch, q_heads), torch.float32, device)
    reduce_splits(o_part, lse_part, out, lse)
    want_o, want_l = ref.merge_partials(to_numpy(o_part), to_numpy(lse_part))
    assert_close(out, want_o, torch.float16, "out", seed)
    assert_close(lse, want_l, torch.float32, "lse", seed)
    assert out[1, 2].eq(0).all() and lse[1, 2] == float("-inf")


def test_rejects_bad_inputs(device, gen):
    pool = PagedPool([20], 4, 2, 16, torch.float32, device, gen)
    lens = pool.lens(device)
    q = random_tensor((1, 4, 16), torch.float32, device, gen)
    with pytest.raises(ValueError, match="num_splits"):
        flash_decode_attention(q, pool.k, pool.v, pool.tables, lens, num_splits=0)
    with pytest.raises(ValueError, match="phi"):
        flash_decode_attention(q, pool.k, pool.v, pool.tables, lens, num_splits=2, phi=float("nan"))
    with pytest.raises(ValueError, match="phi"):
        flash_decode_attention(q, pool.k, pool.v, pool.tables, lens, num_splits=2,
                               fallbacks=torch.zeros(1, 2, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="fallbacks"):
        flash_decode_attention(q, pool.k, pool.v, pool.tables, lens, num_splits=2, phi=0.0,
                               fallbacks=torch.zeros(1, 2, 3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="workspace"):
        flash_decode_attention(q, pool.k, pool.v, pool.tables, lens, num_splits=2,
                               workspace=split_workspace(1, 4, 3, 16, device))
    with pytest.raises(ValueError, match="max_seq_len"):
        flash_decode_attention(q, pool.k, pool.v, pool.tables, lens, max_seq_len=-1)
    with pytest.raises(ValueError, match="multiple"):
        flash_decode_attention(q[:, :3], pool.k, pool.v, pool.tables, lens)


# ----------------------------------------------------------------------------------------
# How many splits
# ----------------------------------------------------------------------------------------
def test_fa2_num_splits_hand_checked():
    # FlashAttention-2's own comment: 48 programs on 108 SMs: 2 splits fill 89 % of the last
    # wave, 3 only 67 %; the best (9 splits: 4 full waves) is 1.0, and 0.89 >= 0.85.
    assert fa2_num_splits(48, 1000, 108) == 2
    # B=1, 8 KV heads, 64k keys (512 blocks) on an H200 as FA2 calls it (2 x 132 slots):
    # 33 splits fill the wave exactly; the smallest s with 8s/264 >= 0.85 is 29.
    assert fa2_num_splits(8, 512, 264) == 29
    # Eligibility: 64 blocks on 12 slots. 12 splits would be 6 blocks each, like 11 (the
    # 12th empty), so s = 12 (efficiency 1.0) is skipped: the best is 11/12, and the
    # smallest s with s/12 >= 0.85 · 11/12 is 10. (Counting s = 12 would give 11.)
    assert fa2_num_splits(1, 64, 12) == 10
    # A tie in real numbers: 41 programs, 40 blocks, 100 slots. The best eligible s is 40
    # (16.4 waves: 16.4/17 = 82/85), 0.85 · 82/85 = 0.82 = the efficiency of s = 2 (and of
    # 4, 6). In float32, as in the C++, 0.82 loses the tie: 7 (0.957). In double it is 2.
    assert fa2_num_splits(41, 40, 100) == 7
    assert fa2_num_splits(86, 64, 108) == 5 and fa2_num_splits(87, 64, 108) == 1  # 86 < 0.8 · 108 = 86.4 <= 87
    assert fa2_num_splits(1, 1, 264) == 1            # one block: nothing to split
    # One program: the efficiency s/264 grows with s up to the cap of 128 splits; 0.85 of
    # 128/264 needs s >= 108.8, and 109, 110 give 38 blocks per split like 108 (not eligible).
    assert fa2_num_splits(1, 4096, 264) == 111
    assert fa2_num_splits(1, 4096, 264, max_splits=16) == 14  # s >= 0.85 · 16 = 13.6


def test_num_splits_heuristic():
    """Ours: as many splits as fit in one wave of SPLIT_PROGRAMS_PER_SM programs per SM,
    splits of at least MIN_TILES_PER_SPLIT tiles, at most MAX_SPLITS; 1 when the batch fills
    the wave."""
    sms, bn = 132, 128
    wave = SPLIT_PROGRAMS_PER_SM * sms
    assert num_splits_heuristic(32, 32, 131072, sms, bn) == 1  # 1024 programs already
    assert num_splits_heuristic(1, 8, 100, sms, bn) == 1        # one tile
    assert num_splits_heuristic(1, 8, 0, sms, bn) == 1
    # The H200 sweep's optima (bench.ch07_tune_flash_decoding): 256-264 programs, never 320.
    assert [num_splits_heuristic(b, h, 32768, sms, bn) for b, h in ((1, 8), (1, 32), (8, 8), (16, 8), (32, 8))] \
        == [33, 8, 4, 2, 1]
    for batch in (1, 2, 3, 8, 32):
        for kv_heads in (1, 8, 32):
            for L in (1, 127, 128, 4096, 32768, 65536, 131072):
                s = num_splits_heuristic(batch, kv_heads, L, sms, bn)
                tiles = -(-L // bn)
                assert 1 <= s <= MAX_SPLITS
                assert s == 1 or tiles // s >= MIN_TILES_PER_SPLIT, (batch, kv_heads, L, s)
                assert s == 1 or s * batch * kv_heads <= wave  # one wave, never a partial second one
                capped = s in (MAX_SPLITS, max(1, tiles // MIN_TILES_PER_SPLIT))
                assert capped or (s + 1) * batch * kv_heads > wave  # and as full as it gets


def test_cached_workspace(dtype, device, gen, seed):
    """Without a workspace the launcher reuses one per shape (same tensors on the next call),
    and a second call on other values of that shape is still right (nothing stale)."""
    pool = PagedPool([70, 33], 16, 2, 32, dtype, device, gen)
    clear_workspace_cache()
    for _ in range(2):
        q = random_tensor((2, 4, 32), dtype, device, gen)
        out, _ = flash_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device), num_splits=3,
                                        block_n=BLOCK_N)
        want, _ = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device))
        assert_close(out, to_numpy(want), dtype, "out with the cached workspace", seed)
    cache = workspace_cache()
    assert sorted(cache, key=str) == sorted([(q.device, 2, 4, 3, 32), ("counters", q.device, 2, 4)], key=str)
    o_part, lse_part, counters = cache[(q.device, 2, 4, 3, 32)]
    assert o_part.shape == (2, 4, 3, 32) and lse_part.shape == (2, 4, 3) and o_part.is_contiguous()
    assert counters is cache[("counters", q.device, 2, 4)] and counters.shape == (2, 4)
    assert not counters.any(), "the arrival counters must be back to zero after each call"


def test_workspace_is_found_again_under_either_spelling_of_the_device(device):
    """A second ask for a shape's workspace returns the same tensors without making new ones, and
    on a GPU ``cuda`` finds the buffers that ``cuda:0`` made (the lookup tries the caller's key
    first, so a decode loop's repeated ask skips the normalization)."""
    clear_workspace_cache()
    first = cached_workspace(3, 4, 2, 32, device)
    again = cached_workspace(3, 4, 2, 32, device)
    assert all(a is b for a, b in zip(first, again))
    if device.type == "cuda":
        indexed, bare = torch.device("cuda", torch.cuda.current_device()), torch.device("cuda")
        assert all(a is b for a, b in zip(cached_workspace(3, 4, 2, 32, indexed), cached_workspace(3, 4, 2, 32, bare)))
    made = len(workspace_cache())
    cached_workspace(3, 4, 2, 32, device)
    assert len(workspace_cache()) == made, "a hit must not add entries"


@pytest.mark.parametrize("phi", [None, 0.0])
def test_fused_merge_equals_two_launches(phi, dtype, device, gen, seed):
    """The one-launch merge against the two-launch path and the reference, on one batch with
    odd lengths, a length 0 and a sequence shorter than its splits (empty splits, which must
    still count themselves in), GQA 3:1, an invalid block, and the asynchronized softmax with
    a KV head forced to fall back; called three times on the same buffers (the counters,
    reset by the last program, are reused) and through the cached workspace."""
    skip_fp32_on_gpu(dtype, device)
    q_heads, kv_heads, head_dim, splits = 6, 2, 32, 5
    pool = PagedPool([83, 0, 7, 50], 8, kv_heads, head_dim, dtype, device, gen)
    q = random_tensor((4, q_heads, head_dim), dtype, device, gen)
    if phi is not None:
        q[:, 3:] *= 40.0  # KV head 1's scores leave the window: its non-empty splits fall back
    k, v, tables = pool.numpy()
    hole = int(tables[3, 2])  # sequence 3: positions 16-23 in a block past the pool, read as zeros
    k, v, tables = k.copy(), v.copy(), tables.copy()
    k[hole], v[hole] = 0.0, 0.0
    pool.tables[3, 2] = pool.k.shape[0] + 5
    want_o, want_l, _ = ref.flash_decode_partials(to_numpy(q), k, v, tables, pool.seq_lens, splits, BLOCK_N, None,
                                                  phi, async_window(dtype))
    ref_out, ref_lse = ref.merge_partials(want_o, want_l)
    counters = split_counters(4, q_heads, device)
    o_ws = poisoned((4, q_heads, splits, head_dim), torch.float32, device)
    l_ws = poisoned((4, q_heads, splits), torch.float32, device)
    results = {}
    for fused in (True, False, True, True):
        out, lse = poisoned(q.shape, dtype, device), poisoned((4, q_heads), torch.float32, device)
        flags = torch.full((4, kv_heads, splits), -1, dtype=torch.int32, device=device) if phi is not None else None
        flash_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device), out=out, lse=lse,
                               num_splits=splits, block_n=BLOCK_N, phi=phi, fallbacks=flags,
                               workspace=(o_ws, l_ws, counters), fused_merge=fused)
        assert not counters.any(), f"counters not reset (fused={fused})"
        assert_close(out, ref_out, dtype, f"out (fused={fused})", seed)
        assert_close(lse, ref_lse, dtype, f"lse (fused={fused})", seed)
        if phi is not None:
            assert flags[:, 1].sum() > 0 and not flags[:, 0].any()
        results[fused] = (out, lse)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[True][1], results[False][1], rtol=1e-5, atol=1e-5)
    clear_workspace_cache()
    for _ in range(2):  # the cached workspace and counters
        out, lse = flash_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device), num_splits=splits,
                                          block_n=BLOCK_N, phi=phi)
        assert_close(out, ref_out, dtype, "out (cached workspace)", seed)
        assert not workspace_cache()[("counters", q.device, 4, q_heads)].any()


def test_partition_splits_and_num_sms(device):
    assert partition_splits(4096) == 8 and partition_splits(4097) == 9 and partition_splits(4096, 128) == 32
    assert partition_splits(0) == 1 and partition_splits(100, 512) == 1
    with pytest.raises(ValueError):
        partition_splits(100, 0)
    if torch.device(device).type == "cpu":
        assert num_sms(device) == CPU_NUM_SMS == 132
    else:
        assert num_sms(device) == torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------------------
# Bulk (TMA) tile loads and the eviction hint (sm_90; the interpreter emulates descriptors)
# ----------------------------------------------------------------------------------------
def tma_expected(device) -> bool:
    """Where `tma_applies` may say yes: the interpreter and sm_90 GPUs."""
    return torch.device(device).type == "cpu" or torch.cuda.get_device_capability(device) == (9, 0)


# (q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits): block sizes multiples of
# BLOCK_N (one box per whole tile), odd lengths (the ragged last tile takes pointer loads).
TMA_CASES = [
    (8, 2, 64, 16, [77, 16, 1, 0], 3),    # GQA 4:1, blocks of one tile, a length 0 and 1
    (6, 6, 32, 32, [101, 33], 4),         # MHA, two tiles per block
    (16, 2, 128, 48, [150, 47, 95], 5),   # GQA 8:1, blocks of three tiles (not a power of two)
    (4, 1, 16, 64, [129], 1),             # MQA, one split (no merge), head dim 16
]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens,num_splits",
                         [pytest.param(*c, id=_case_id(c)) for c in TMA_CASES])
def test_tma_and_eviction_paths(q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits, dtype, device, gen,
                                seed):
    """Every combination of bulk loads (on, off) and eviction hint (evict_first, none) gives the
    reference's output, lse and partials; `tma_applies` says yes for these pools where TMA exists."""
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, dtype, device, gen)
    assert tma_applies(pool.k, pool.v, BLOCK_N, head_dim) == tma_expected(device)
    q = random_tensor((len(seq_lens), q_heads, head_dim), dtype, device, gen)
    want_o, want_l, _ = reference_partials(q, pool, num_splits)
    ref_out, ref_lse = ref.merge_partials(want_o, want_l)
    for tma in (True, False):
        for evict in ("evict_first", ""):
            config = {"TMA": tma, "KV_EVICT": evict}
            out, lse, (o_part, lse_part) = run(q, pool, num_splits, dtype, device, config=config)
            assert_close(out, ref_out, dtype, f"out ({config})", seed)
            assert_close(lse, ref_lse, dtype, f"lse ({config})", seed)
            if num_splits > 1:
                assert_close(o_part, want_o, dtype, f"partial outputs ({config})", seed)


def test_tma_on_a_contiguous_cache(dtype, device, gen, seed):
    """Chapter 11's case: a contiguous ``[batch, capacity, kv_heads, head_dim]`` cache seen as one
    block per sequence (`contiguous_as_paged`), slots NaN past each length, lengths odd, the
    default split heuristic; bulk loads on and off agree with the reference attention."""
    batch, capacity, q_heads, kv_heads, head_dim = 3, 96, 8, 2, 32
    lens = [95, 17, 50]
    k = torch.full((batch, capacity, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v = torch.full_like(k, float("nan"))
    for b, n in enumerate(lens):
        k[b, :n] = random_tensor((n, kv_heads, head_dim), dtype, device, gen)
        v[b, :n] = random_tensor((n, kv_heads, head_dim), dtype, device, gen)
    k_pool, tables = contiguous_as_paged(k)
    v_pool, _ = contiguous_as_paged(v)
    assert tma_applies(k_pool, v_pool, BLOCK_N, head_dim) == tma_expected(device)
    q = random_tensor((batch, q_heads, head_dim), dtype, device, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for tma in (True, False):
        out, lse = flash_decode_attention(q, k_pool, v_pool, tables, seq_lens, block_n=BLOCK_N, config={"TMA": tma})
        for b, n in enumerate(lens):
            kb, vb = to_numpy(k[b, :n]).transpose(1, 0, 2), to_numpy(v[b, :n]).transpose(1, 0, 2)
            o, l = attention(to_numpy(q[b])[None, :, None], kb[None], vb[None])
            assert_close(out[b], o[0, :, 0], dtype, f"out (sequence {b}, tma={tma})", seed)
            assert_close(lse[b], l[0, :, 0], dtype, f"lse (sequence {b}, tma={tma})", seed)


def test_tma_invalid_blocks_read_zeros(device, gen, seed):
    """Through descriptors too, a table entry that is not a block (-1, or past the pool, whose
    neighbours in memory are NaN) reads as zero keys and values, in whole tiles as in the
    ragged last one; the pointer path gives the same answer."""
    dtype = torch.float32
    block_size, q_heads, kv_heads, head_dim = 16, 4, 2, 32
    pool = PagedPool([70, 40], block_size, kv_heads, head_dim, dtype, device, gen)
    tables = pool.tables.clone()
    tables[0, 1] = PAD                     # sequence 0: positions 16-31 (a whole tile) in a hole
    tables[1, 2] = pool.k.shape[0]         # sequence 1: positions 32-39 (its ragged tile) past the pool
    tables[0, 3] = pool.k.shape[0] + 1000  # sequence 0: positions 48-63 far past the pool
    lens = pool.lens(device)
    q = random_tensor((2, q_heads, head_dim), dtype, device, gen)
    k_flat, v_flat = pool.k.reshape(-1, kv_heads, head_dim), pool.v.reshape(-1, kv_heads, head_dim)
    for tma in (True, False):
        out, lse = flash_decode_attention(q, pool.k, pool.v, tables, lens, num_splits=2, block_n=BLOCK_N,
                                          config={"TMA": tma})
        for b, n in enumerate(pool.seq_lens):
            pos = torch.arange(n, device=device)
            blk = tables[b].long()[pos // block_size]
            ok = ((blk >= 0) & (blk < pool.k.shape[0])).cpu().numpy()
            rows = blk.clamp(0, pool.k.shape[0] - 1) * block_size + pos % block_size
            kb, vb = to_numpy(k_flat[rows]), to_numpy(v_flat[rows])
            kb[~ok], vb[~ok] = 0.0, 0.0  # what the kernel must see there
            o, l = attention(to_numpy(q[b])[None, :, None], kb.transpose(1, 0, 2)[None], vb.transpose(1, 0, 2)[None])
            assert_close(out[b], o[0, :, 0], dtype, f"out (sequence {b}, tma={tma})", seed)
            assert_close(lse[b], l[0, :, 0], dtype, f"lse (sequence {b}, tma={tma})", seed)


def test_tma_applies_only_where_one_box_is_a_tile(device, gen):
    """No bulk loads where a tile is not one box of the pool: blocks not a multiple of the
    tile, a head dim that is not a power of two, heads not packed (a head-dim slice of a
    wider buffer), the general tile path forced; and never on a GPU other than sm_90."""
    dtype = torch.float16
    pool = PagedPool([40], 16, 2, 32, dtype, device, gen)
    assert tma_applies(pool.k, pool.v, 16, 32) == tma_expected(device)
    assert not tma_applies(pool.k, pool.v, 32, 32)                     # 16-token blocks, 32-key tiles
    odd = PagedPool([40], 17, 2, 32, dtype, device, gen)
    assert not tma_applies(odd.k, odd.v, 16, 32)
    d80 = PagedPool([40], 16, 2, 80, dtype, device, gen)
    assert not tma_applies(d80.k, d80.v, 16, 128)
    wide = torch.zeros((*pool.k.shape[:3], 64), dtype=dtype, device=device)
    assert not tma_applies(wide[..., :32], wide[..., :32], 16, 32)      # stride(2) = 64, not head_dim
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
        assert not tma_applies(pool.k, pool.v, 16, 32)
    # The general path forced: pointer loads whatever TMA_ON_HOPPER says (still correct).
    q = random_tensor((1, 4, 32), dtype, device, gen)
    want_out, _ = ref.merge_partials(*reference_partials(q, pool, 2)[:2])
    out, _, _ = run(q, pool, 2, dtype, device, tile_in_block=False, config={"TMA": True})
    assert_close(out, want_out, dtype, "out (general tile path, TMA asked)")



def test_default_loads_bulk_only_when_captured(device, gen, seed, monkeypatch):
    """``TMA_ON_HOPPER = "captured"``: a call that does not choose asks for descriptors only while
    its launch is captured into a CUDA graph (sm_90), never eagerly; the captured call, replayed,
    gives the eager call's answer on a contiguous cache."""
    import minillm.kernels.ch07_flash_decoding as fd

    dtype = torch.float16
    asked = []
    real = fd.kv_descriptors
    monkeypatch.setattr(fd, "kv_descriptors", lambda *a, **kw: asked.append(1) or real(*a, **kw))
    batch, capacity, q_heads, kv_heads, head_dim = 2, 4 * BLOCK_N, 8, 2, 32
    k = random_tensor((batch, capacity, kv_heads, head_dim), dtype, device, gen)
    v = random_tensor((batch, capacity, kv_heads, head_dim), dtype, device, gen)
    k_pool, tables = contiguous_as_paged(k)
    v_pool, _ = contiguous_as_paged(v)
    q = random_tensor((batch, q_heads, head_dim), dtype, device, gen)
    seq_lens = torch.tensor([capacity - 3, BLOCK_N + 5], dtype=torch.int32, device=device)
    want_out, want_lse = flash_decode_attention(q, k_pool, v_pool, tables, seq_lens, num_splits=2, block_n=BLOCK_N)
    assert fd.TMA_ON_HOPPER == "captured" and not asked   # eager: pointer loads, no descriptor
    if torch.device(device).type != "cuda":
        return
    out = torch.empty_like(want_out)
    lse = torch.empty_like(want_lse)

    def step():
        flash_decode_attention(q, k_pool, v_pool, tables, seq_lens, num_splits=2, block_n=BLOCK_N, out=out, lse=lse)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert bool(asked) == (torch.cuda.get_device_capability(device) == (9, 0))
    assert_close(out, to_numpy(want_out), dtype, "out (captured)", seed)
    assert_close(lse, to_numpy(want_lse), dtype, "lse (captured)", seed)

# ----------------------------------------------------------------------------------------
# The benchmark's bookkeeping (no timing: a stand-in timer, tiny shapes, the interpreter)
# ----------------------------------------------------------------------------------------
def test_benchmark_dry_run(device):
    """`bench.ch07_flash_decoding.sweep` end to end on tiny shapes with a stand-in timer: every
    point adds its rows (peers, bandwidth, errors, reduce share, async ratio), the ablation
    adds one row per split count and per heuristic, and the summary prints."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # `pytest` without `python -m` does not put the root on the path
        sys.path.insert(0, root)
    from bench import ch07_flash_decoding as bench
    from bench.common import Results

    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    bench.sweep(results, device, q_heads=4, kv_heads_list=(2,), batches=(1, 2), contexts=(160,), head_dim=16,
                dtype=dtype, timer=lambda fn: (fn(), 1.0)[1], long_point=(1, 2, 96),
                ablation_points=((1, 2, 96),), ablation_splits=(1, 2, 4), max_cache_bytes=1e9,
                load_points=((2, 2, 160),))
    rows = results.rows

    def count(metric, **params):
        return sum(r["metric"] == metric and all(r["params"].get(a) == b for a, b in params.items()) for r in rows)

    points = 2  # batches 1, 2 at one (kv_heads, context)
    assert count("time_ms", kind="decode") == points * (len(bench.PEERS) + 1)  # + the two-launch merge
    assert sum(r["metric"] == "time_ms" and r["peer"] == "two_launch" for r in rows) == points
    assert count("bandwidth_TBps", kind="decode") == points * len(bench.PEERS)
    assert count("rel_err", kind="decode") == points * 2
    assert count("reduce_share", kind="decode") == points
    assert count("async_time_ms", kind="decode") == points
    assert count("time_ms", kind="long_context") == 1
    splits_rows = [r for r in rows if r["params"].get("kind") == "split_sweep"]
    assert {r["params"]["num_splits"] for r in splits_rows if r["params"]["rule"] == "sweep"} == {1, 2, 4}
    assert {r["params"]["rule"] for r in splits_rows} >= {"sweep", "ours", "fa2", "partition_128", "partition_512"}
    loads = [r for r in rows if r["params"].get("kind") == "loads"]
    assert {(r["params"]["layout"], r["params"]["variant"]) for r in loads if r["metric"] == "load_time_ms"} == set(
        bench.LOAD_VARIANTS)
    contiguous = {r["params"]["block_size"] for r in loads if r["params"]["layout"] == "contiguous"}
    assert contiguous == {160 + bench.SLOT_EXTRA}
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    errs = [r["ours"] for r in rows if r["metric"] == "rel_err"]
    assert errs and all(e < tol for e in errs), errs
    assert results.status[bench.BENCHMARK] == "complete"
    assert bench.summary(results).count("\n") >= 4
