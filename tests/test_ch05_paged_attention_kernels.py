"""Chapter 5's paged-KV kernels against float64 NumPy references.

(The references themselves are tested in `test_ch05_paged_attention_reference.py`, the
traffic count in `test_costs.py`.)

- `paged_decode_attention` against `minillm.reference.paged_decode_attention`: block sizes 1,
  3, 16, 17, 64, 256 (powers of two or not), MHA, GQA 4/8, MQA, head dims 32-128 (40 and 96
  too), per-sequence lengths (0, and lengths that are not multiples of the block size). The
  physical blocks are a random permutation of a pool bigger than needed; every slot that holds
  no token (unused blocks, the tail of each last block, and guard blocks just outside the
  pool) is NaN, and block tables are padded with -1, so a kernel that reads anything it
  should not (even with weight 0: 0·NaN = NaN) fails. Both tile paths (one table entry per
  tile, and the general per-position one) are run; a table entry that is not a valid block
  reads as zeros instead of faulting; lengths past the table are clamped to it.
- `contiguous_as_paged` + `paged_decode_attention` equals Chapter 2's `decode_attention`.
- `paged_prefill_attention` against `minillm.reference.paged_prefill_attention`: cached
  prefixes of 0 tokens, part of a block and several blocks; 1 and many new tokens; an empty
  sequence in the batch; causal (bottom-right aligned) and not; blocks shared by two
  sequences (a cached common prefix).
- `write_paged_kv` against `minillm.paged.write_slots`: -1 slots and out-of-range slots write
  nothing; the whole pool and guard blocks around it are compared exactly.
- End to end: chunked prefill and decode steps through the three kernels equal causal
  attention recomputed over the whole sequences.

CPU: small shapes under the interpreter, fp32 (exact dots) and fp16. GPU (`make gpu`): the
same plus bf16, the `gpu`-marked long contexts, and pools past 2^31 elements.
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minillm.kernels.ch02_kv_cache import decode_attention
from minillm.kernels.ch05_paged_attention import (
    blocks_per_tile, contiguous_as_paged, decode_block_n, paged_decode_attention,
    paged_prefill_attention, prefill_config, write_paged_kv,
)
from minillm.paged import PAD, gather_slots, padded_block_tables, write_slots
from minillm.reference import attention
from minillm.reference import ch05_paged_attention as ref
from minillm.testing import (
    GUARD_BLOCKS, PagedPool, assert_close, poisoned, random_tensor, skip_fp32_on_gpu, to_numpy,
)


# ----------------------------------------------------------------------------------------
# Helpers: the references over a shuffled, NaN-poisoned pool (`minillm.testing.PagedPool`)
# ----------------------------------------------------------------------------------------
def reference_decode(q, pool: PagedPool, scale=None):
    k, v, tables = pool.numpy()
    return ref.paged_decode_attention(to_numpy(q), k, v, tables, pool.seq_lens, scale)


def reference_prefill(q, cu, pool: PagedPool, causal=True, scale=None):
    k, v, tables = pool.numpy()
    return ref.paged_prefill_attention(to_numpy(q), np.asarray(cu), k, v, tables, pool.seq_lens, causal, scale)


def cu_seqlens(q_lens, device):
    return torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------------------
# paged_decode_attention
# ----------------------------------------------------------------------------------------
# (q_heads, kv_heads, head_dim, block_size, seq_lens): batch = len(seq_lens)
DECODE_SMALL = [
    (4, 4, 64, 1, [5, 0, 17]),             # MHA, one token per block, an empty sequence
    (8, 2, 40, 3, [10, 1, 0, 23]),         # GQA 4:1, head_dim 40, blocks of 3
    (16, 2, 128, 16, [16, 33, 47]),        # GQA 8:1, a length that fills its last block exactly
    (6, 1, 96, 17, [17, 35, 2]),           # MQA (6 query heads), head_dim 96, blocks of 17
    (8, 2, 64, 64, [64, 65, 30]),          # GQA 4:1, one token into a second block
    (4, 2, 32, 256, [300, 3]),             # blocks of 256, a sequence in two blocks
    (8, 2, 64, 4, [9, 16, 1]),             # blocks of 4: a tile of 16 is 4 whole blocks (CPU tiles)
    (4, 1, 32, 8, [33, 8, 0]),             # blocks of 8: 2 whole blocks per CPU tile, a ragged end
]
DECODE_LARGE = [
    (32, 8, 128, 16, [4097, 1, 33000, 17, 12345]),   # Llama-3-8B-like, long contexts
    (32, 32, 128, 256, [4096, 1000, 3]),             # MHA, blocks of 256 (one table entry per tile)
    (64, 8, 256, 32, [5000, 2049]),                  # head_dim 256
    (28, 4, 128, 17, [20000, 0, 1]),                 # GQA 7:1 (Qwen2-7B-like), blocks of 17
    (32, 8, 128, 1, [3000, 77]),                     # one token per block
    (32, 1, 128, 128, [8192, 100]),                  # MQA, blocks of BLOCK_N
]


def _decode_id(c):
    return f"h{c[0]}-kv{c[1]}-d{c[2]}-bs{c[3]}-L{'_'.join(map(str, c[4]))}"


DECODE_CASES = [pytest.param(*c, id=_decode_id(c)) for c in DECODE_SMALL] + [
    pytest.param(*c, id=_decode_id(c), marks=pytest.mark.gpu) for c in DECODE_LARGE
]


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seq_lens", DECODE_CASES)
def test_paged_decode_attention(q_heads, kv_heads, head_dim, block_size, seq_lens, dtype, device, gen, seed):
    pool = PagedPool(seq_lens, block_size, kv_heads, head_dim, dtype, device, gen)
    batch = len(seq_lens)
    q = random_tensor((batch, q_heads, head_dim), dtype, device, gen)
    out, lse = poisoned((batch, q_heads, head_dim), dtype, device), poisoned((batch, q_heads), torch.float32, device)

    got_out, got_lse = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device), out=out, lse=lse)
    assert got_out is out and got_lse is lse
    ref_out, ref_lse = reference_decode(q, pool)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_decode_both_tile_paths(block_size, device, gen, seed):
    """Block sizes that are multiples of BLOCK_N run the one-table-entry-per-tile path by
    default; forcing the general path must give the same answer (and forcing the one-block
    path where a tile can straddle blocks is refused)."""
    dtype = torch.float16
    block_n = 16
    pool = PagedPool([block_size + 5, 2 * block_size, 3], block_size, 2, 32, dtype, device, gen)
    q = random_tensor((3, 4, 32), dtype, device, gen)
    ref_out, ref_lse = reference_decode(q, pool)
    for path in (True, False):
        out, lse = paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device), block_n=block_n,
                                          tile_in_block=path)
        assert_close(out, ref_out, dtype, f"out (tile_in_block={path})", seed)
        assert_close(lse, ref_lse, dtype, f"lse (tile_in_block={path})", seed)
    with pytest.raises(ValueError, match="straddle"):
        paged_decode_attention(q, pool.k, pool.v, pool.tables, pool.lens(device),
                               block_n=32 if block_size == 16 else 128, tile_in_block=True)


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_invalid_block_reads_zeros(block_size, device, gen, seed):
    """A table entry inside a sequence's length that is not a block (-1, or past the pool) is
    never dereferenced: its positions read as zero keys and values (score 0, value 0)."""
    dtype = torch.float32
    q_heads, kv_heads, head_dim = 4, 2, 16
    pool = PagedPool([3 * block_size + 1, 2 * block_size], block_size, kv_heads, head_dim, dtype, device, gen)
    tables = pool.tables.clone()
    tables[0, 1] = PAD                   # a hole in the middle of sequence 0
    tables[1, 0] = pool.k.shape[0] + 7   # a block id past the pool
    q = random_tensor((2, q_heads, head_dim), dtype, device, gen)
    # BLOCK_N = 16 on every device: blocks of 16 take the one-entry-per-tile path, 4 the general one.
    out, lse = paged_decode_attention(q, pool.k, pool.v, tables, pool.lens(device), block_n=16)
    for b, bad in ((0, 1), (1, 0)):
        k, v = to_numpy(pool.k_seq[b]), to_numpy(pool.v_seq[b])
        zero = slice(bad * block_size, (bad + 1) * block_size)
        k[zero], v[zero] = 0.0, 0.0
        o, l = attention(to_numpy(q[b])[None, :, None], k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None])
        assert_close(out[b], o[0, :, 0], dtype, f"out (sequence {b})", seed)
        assert_close(lse[b], l[0, :, 0], dtype, f"lse (sequence {b})", seed)


def test_lengths_are_clamped_to_the_table(device, gen, seed):
    """A length longer than the table can address is clamped to ``max_blocks · block_size``:
    the kernels never read past the table's row. The table is a column slice of a wider one
    whose extra columns name NaN blocks, so reading past it shows (decode and prefill)."""
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
    block_size, q_heads, kv_heads, head_dim = 4, 4, 2, 16
    pool = PagedPool([12, 7], block_size, kv_heads, head_dim, dtype, device, gen, spare_blocks=4)
    width = pool.tables.shape[1]  # 4 columns: 3 used by sequence 0, one of -1
    wide = torch.full((2, width + 3), PAD, dtype=torch.int32, device=device)
    wide[:, :width] = pool.tables
    wide[:, width:] = torch.tensor(pool.unused_blocks()[:3], dtype=torch.int32, device=device)
    tables = wide[:, :width]
    tables[0, 3] = pool.unused_blocks()[3]  # sequence 0 now has 4 blocks; its last is NaN
    capacity = width * block_size
    too_long = torch.tensor([capacity + 9, 7], dtype=torch.int32, device=device)
    pool.tables, pool.seq_lens = tables, [capacity, 7]
    # The 4th block of sequence 0 gets real tokens (positions 12..15).
    pool.k[int(tables[0, 3])] = random_tensor((block_size, kv_heads, head_dim), dtype, device, gen)
    pool.v[int(tables[0, 3])] = random_tensor((block_size, kv_heads, head_dim), dtype, device, gen)

    q = random_tensor((2, q_heads, head_dim), dtype, device, gen)
    out, lse = paged_decode_attention(q, pool.k, pool.v, tables, too_long)
    ref_out, ref_lse = reference_decode(q, pool)
    assert_close(out, ref_out, dtype, "decode out", seed)
    assert_close(lse, ref_lse, dtype, "decode lse", seed)

    qp = random_tensor((5, q_heads, head_dim), dtype, device, gen)
    cu = cu_seqlens([3, 2], device)
    out, lse = paged_prefill_attention(qp, cu, pool.k, pool.v, tables, too_long, 3)
    ref_out, ref_lse = reference_prefill(qp, cu.cpu(), pool)
    assert_close(out, ref_out, dtype, "prefill out", seed)
    assert_close(lse, ref_lse, dtype, "prefill lse", seed)


def test_paged_decode_allocates_outputs_and_int64_inputs(device, gen, seed):
    """Without ``out``/``lse`` the launcher allocates them (q's dtype, and float32); int64
    tables and lengths are accepted; a custom scale is applied."""
    dtype = torch.float16
    pool = PagedPool([19, 5], 8, 1, 24, dtype, device, gen)
    q = random_tensor((2, 3, 24), dtype, device, gen)
    out, lse = paged_decode_attention(q, pool.k, pool.v, pool.tables.long(), pool.lens(device, torch.int64), scale=0.3)
    assert out.shape == (2, 3, 24) and out.dtype == dtype
    assert lse.shape == (2, 3) and lse.dtype == torch.float32
    ref_out, ref_lse = reference_decode(q, pool, scale=0.3)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


def test_paged_decode_follows_strides(device, gen, seed):
    """K and V pools that are views with different strides (K a head-dim slice of a wider
    buffer, V stored block-major per head and transposed), q sliced out of a fused projection,
    a block table that is a column slice, outputs written into strided views. Nothing is
    copied, and the padded head-dim columns never address outside the views."""
    dtype = torch.float32
    batch, q_heads, kv_heads, head_dim, block_size = 2, 6, 2, 40, 5
    pool = PagedPool([23, 9], block_size, kv_heads, head_dim, dtype, device, gen)
    wide = torch.full((*pool.k.shape[:3], 56), float("nan"), dtype=dtype, device=device)
    wide[..., :head_dim] = pool.k
    k = wide[..., :head_dim]
    v = pool.v.transpose(1, 2).contiguous().transpose(1, 2)  # [nb, bs, h, d] view of a [nb, h, bs, d] buffer
    tables = torch.full((batch, 2 * pool.tables.shape[1]), PAD, dtype=torch.int32, device=device)
    tables[:, ::2] = pool.tables
    tables = tables[:, ::2]
    qkv = random_tensor((batch, 3, q_heads, head_dim), dtype, device, gen)
    q = qkv[:, 1]
    assert not (k.is_contiguous() or v.is_contiguous() or q.is_contiguous() or tables.is_contiguous())
    out_buf = poisoned((q_heads, batch, head_dim), dtype, device)
    lse_buf = poisoned((q_heads, batch), torch.float32, device)
    paged_decode_attention(q, k, v, tables, pool.lens(device), out=out_buf.transpose(0, 1), lse=lse_buf.t())
    ref_out, ref_lse = reference_decode(q, pool)
    assert_close(out_buf.transpose(0, 1), ref_out, dtype, "out", seed)
    assert_close(lse_buf.t(), ref_lse, dtype, "lse", seed)


@pytest.mark.parametrize("heads_first", [True, False], ids=["ch02-layout", "token-major"])
def test_contiguous_as_paged_equals_chapter_2(heads_first, dtype, device, gen, seed):
    """A contiguous cache is a pool of one block per sequence: the paged kernel on the view
    equals Chapter 2's `decode_attention` and the reference, with no copy made."""
    batch, q_heads, kv_heads, max_len, head_dim = 3, 8, 2, 45, 32
    seq_lens = [45, 0, 20]
    k = random_tensor((batch, kv_heads, max_len, head_dim), dtype, device, gen)
    v = random_tensor((batch, kv_heads, max_len, head_dim), dtype, device, gen)
    for b, n in enumerate(seq_lens):  # slots past each length are never read
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    if not heads_first:  # the same cache stored token-major
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    k_pool, tables = contiguous_as_paged(k, heads_first=heads_first)
    v_pool, _ = contiguous_as_paged(v, heads_first=heads_first)
    assert k_pool.data_ptr() == k.data_ptr() and k_pool.shape == (batch, max_len, kv_heads, head_dim)
    assert tables.dtype == torch.int32 and tables[:, 0].tolist() == list(range(batch))
    q = random_tensor((batch, q_heads, head_dim), dtype, device, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)

    out, lse = paged_decode_attention(q, k_pool, v_pool, tables, lens)
    k2, v2 = (k, v) if heads_first else (k.transpose(1, 2), v.transpose(1, 2))
    ch2_out, ch2_lse = decode_attention(q, k2, v2, lens)
    want_out, want_lse = ref.paged_decode_attention(to_numpy(q), to_numpy(k_pool), to_numpy(v_pool),
                                                    tables.cpu().numpy(), seq_lens)
    assert_close(out, want_out, dtype, "out", seed)
    assert_close(lse, want_lse, dtype, "lse", seed)
    assert_close(out, to_numpy(ch2_out), dtype, "out vs Chapter 2", seed)
    assert_close(lse, to_numpy(ch2_lse), dtype, "lse vs Chapter 2", seed)


def test_paged_decode_rejects_bad_inputs(device, gen):
    pool = PagedPool([8], 4, 2, 16, torch.float32, device, gen)
    lens = pool.lens(device)
    q = random_tensor((1, 6, 16), torch.float32, device, gen)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], pool.k, pool.v, pool.tables, lens)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, pool.k, pool.v, pool.tables.float(), lens)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, pool.k, pool.v, pool.tables.expand(2, -1), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, pool.k, pool.v, pool.tables, torch.tensor([8, 8], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="does not match"):
        paged_decode_attention(q[..., :8], pool.k, pool.v, pool.tables, lens)
    with pytest.raises(TypeError, match="dtype"):
        paged_decode_attention(q.half(), pool.k, pool.v, pool.tables, lens)


def test_tile_sizes():
    """The interpreter's tiles are small (both tile paths run on CPU); the GPU's are Chapter
    2's 32 KB decode tiles and Chapter 4's prefill tiles."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        assert decode_block_n(128, torch.float16) == 16
        assert prefill_config(128, torch.float16, 4096) == (32, 16, 4, 1)
    else:
        assert decode_block_n(128, torch.bfloat16) == 128 and decode_block_n(256, torch.bfloat16) == 64
        assert prefill_config(128, torch.bfloat16, 4096) == (128, 64, 8, 3)
        assert prefill_config(128, torch.bfloat16, 64)[0] == 64


# ----------------------------------------------------------------------------------------
# paged_prefill_attention
# ----------------------------------------------------------------------------------------
# (q_heads, kv_heads, head_dim, block_size, [(cached prefix, new tokens), ...])
PREFILL_SMALL = [
    (2, 2, 64, 1, [(0, 5), (3, 1), (4, 0)]),        # MHA, blocks of 1, a sequence with no new token
    (8, 2, 40, 3, [(0, 37), (2, 40), (7, 1)]),      # GQA 4:1, head_dim 40, a prefix ending mid-block
    (8, 1, 128, 16, [(32, 20), (0, 16), (16, 33)]),  # GQA 8:1 (MQA), prefixes of whole blocks
    (4, 1, 96, 17, [(34, 20), (0, 17), (51, 1)]),   # MQA, head_dim 96, blocks of 17, a decode-like row
    (4, 4, 128, 64, [(64, 40), (130, 35)]),         # MHA, blocks of 64, several cached blocks + part
    (4, 2, 64, 256, [(250, 20), (0, 33)]),          # blocks of 256, new tokens crossing into block 2
    (4, 2, 32, 8, [(8, 9), (0, 20), (5, 1)]),       # blocks of 8: 2 whole blocks per CPU tile
    (4, 4, 64, 4, [(6, 10), (16, 3)]),              # blocks of 4: 4 whole blocks per CPU tile
]
PREFILL_LARGE = [
    (32, 8, 128, 16, [(2000, 500), (0, 1000), (4096, 1), (333, 700)]),  # Llama-3-8B-like chunks
    (32, 8, 128, 256, [(4096, 512), (0, 1500)]),                        # one table entry per tile
    (16, 2, 256, 17, [(1000, 300), (5, 64)]),                           # head_dim 256
    (28, 4, 128, 32, [(100, 40), (0, 64), (2000, 7)]),                  # short chunks: 64-row tiles
]


def _prefill_id(c):
    return f"h{c[0]}-kv{c[1]}-d{c[2]}-bs{c[3]}-" + "_".join(f"{p}+{n}" for p, n in c[4])


PREFILL_CASES = [pytest.param(*c, id=_prefill_id(c)) for c in PREFILL_SMALL] + [
    pytest.param(*c, id=_prefill_id(c), marks=pytest.mark.gpu) for c in PREFILL_LARGE
]


def run_prefill(q_heads, kv_heads, head_dim, block_size, seqs, dtype, device, gen, causal=True,
                shared_prefix_blocks=0, **kwargs):
    """Build a pool holding each sequence's prefix + new tokens, run the kernel into poisoned
    buffers; returns ``(q, cu, pool, out, lse)``."""
    pool = PagedPool([p + n for p, n in seqs], block_size, kv_heads, head_dim, dtype, device, gen,
                shared_prefix_blocks=shared_prefix_blocks)
    q_lens = [n for _, n in seqs]
    total = sum(q_lens)
    q = random_tensor((total, q_heads, head_dim), dtype, device, gen)
    cu = cu_seqlens(q_lens, device)
    out, lse = poisoned((total, q_heads, head_dim), dtype, device), poisoned((q_heads, total), torch.float32, device)
    got = paged_prefill_attention(q, cu, pool.k, pool.v, pool.tables, pool.lens(device), max(q_lens), causal,
                                  out=out, lse=lse, **kwargs)
    assert got[0] is out and got[1] is lse
    return q, cu, pool, out, lse


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,seqs", PREFILL_CASES)
def test_paged_prefill_attention(q_heads, kv_heads, head_dim, block_size, seqs, dtype, device, gen, seed):
    skip_fp32_on_gpu(dtype, device)
    q, cu, pool, out, lse = run_prefill(q_heads, kv_heads, head_dim, block_size, seqs, dtype, device, gen)
    ref_out, ref_lse = reference_prefill(q, cu.cpu(), pool)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


def test_paged_prefill_not_causal_and_scale(device, gen, seed):
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
    q, cu, pool, out, lse = run_prefill(4, 2, 32, 5, [(12, 9), (0, 20)], dtype, device, gen, causal=False)
    ref_out, ref_lse = reference_prefill(q, cu.cpu(), pool, causal=False)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)
    out, lse = paged_prefill_attention(q, cu, pool.k, pool.v, pool.tables, pool.lens(device), 20, scale=0.2)
    ref_out, ref_lse = reference_prefill(q, cu.cpu(), pool, causal=True, scale=0.2)
    assert_close(out, ref_out, dtype, "out (scale 0.2)", seed)
    assert_close(lse, ref_lse, dtype, "lse (scale 0.2)", seed)


def test_paged_prefill_shared_prefix_blocks(device, gen, seed):
    """Prefix caching: two sequences whose tables start with the same physical blocks (one
    copy of the common prompt), each computing only its own new tokens."""
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
    q, cu, pool, out, lse = run_prefill(4, 1, 32, 8, [(24, 6), (16, 12)], dtype, device, gen, shared_prefix_blocks=2)
    assert pool.table_lists[0][:2] == pool.table_lists[1][:2]
    ref_out, ref_lse = reference_prefill(q, cu.cpu(), pool)
    assert_close(out, ref_out, dtype, "out", seed)
    assert_close(lse, ref_lse, dtype, "lse", seed)


@pytest.mark.parametrize("block_size", [16, 48])
def test_paged_prefill_both_tile_paths(block_size, device, gen, seed):
    """As for decode: the general path forced where the one-entry-per-tile path applies."""
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
    seqs = [(block_size + 3, 20), (0, 2 * block_size)]
    for path in (True, False):
        q, cu, pool, out, lse = run_prefill(2, 1, 32, block_size, seqs, dtype, device, gen,
                                            config=(32, 16, 4, 1), tile_in_block=path)
        ref_out, ref_lse = reference_prefill(q, cu.cpu(), pool)
        assert_close(out, ref_out, dtype, f"out (tile_in_block={path})", seed)
        assert_close(lse, ref_lse, dtype, f"lse (tile_in_block={path})", seed)


def test_paged_prefill_rejects_bad_inputs(device, gen):
    pool = PagedPool([8], 4, 2, 16, torch.float32, device, gen)
    q = random_tensor((8, 4, 16), torch.float32, device, gen)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(q, torch.tensor([[0, 8]], dtype=torch.int32, device=device), pool.k, pool.v,
                                pool.tables, pool.lens(device), 8)
    with pytest.raises(ValueError, match="block_tables"):  # 2 sequences in cu, 1 table row
        paged_prefill_attention(q, cu_seqlens([4, 4], device), pool.k, pool.v, pool.tables, pool.lens(device), 4)


# ----------------------------------------------------------------------------------------
# write_paged_kv
# ----------------------------------------------------------------------------------------
# (num_blocks, block_size, kv_heads, head_dim, slots)
WRITE_CASES = [
    (4, 1, 1, 16, [0, 3, -1]),                       # blocks of one slot
    (5, 3, 2, 40, [14, 0, 7, -1, 6, 8]),             # unsorted, padding
    (3, 16, 3, 64, [47, 16, -1, 100, -7, 48, 0]),    # 48 = one past the pool, 100, -7: never written
    (2, 17, 8, 128, [33, 17, 16, -1]),               # blocks of 17, both sides of a block boundary
    (2, 256, 2, 96, [511, 255, 256, 0, 512]),        # blocks of 256, 512 is past the pool
]


@pytest.mark.parametrize("num_blocks,block_size,kv_heads,head_dim,slots", WRITE_CASES)
def test_write_paged_kv(num_blocks, block_size, kv_heads, head_dim, slots, dtype, device, gen, seed):
    # The pool is the middle of a bigger buffer: a write outside the pool (an out-of-range
    # slot that was not skipped) lands in the guard blocks and shows.
    shape = (num_blocks + 2 * GUARD_BLOCKS, block_size, kv_heads, head_dim)
    k_buf, v_buf = random_tensor(shape, dtype, device, gen), random_tensor(shape, dtype, device, gen)
    inside = slice(GUARD_BLOCKS, GUARD_BLOCKS + num_blocks)
    k_cache, v_cache = k_buf[inside], v_buf[inside]
    k_new = random_tensor((len(slots), kv_heads, head_dim), dtype, device, gen)
    v_new = random_tensor((len(slots), kv_heads, head_dim), dtype, device, gen)
    in_pool = [s if 0 <= s < num_blocks * block_size else PAD for s in slots]  # what may be written
    want_k, want_v = to_numpy(k_buf), to_numpy(v_buf)
    write_slots(want_k[inside], in_pool, to_numpy(k_new))
    write_slots(want_v[inside], in_pool, to_numpy(v_new))

    write_paged_kv(k_cache, v_cache, k_new, v_new, torch.tensor(slots, dtype=torch.int64, device=device))
    # A copy is exact: every other slot of the pool, and everything around it, keeps its value.
    assert_close(k_buf, want_k, dtype, "k (pool and guard blocks)", seed, atol=0, rtol=0)
    assert_close(v_buf, want_v, dtype, "v (pool and guard blocks)", seed, atol=0, rtol=0)


def test_write_paged_kv_strided_rows_and_cast(device, gen, seed):
    """New rows sliced out of a fused ``[tokens, 3, kv_heads, head_dim]`` fp32 projection,
    written into an fp16 pool (int32 slots): strides followed, values cast."""
    num_blocks, block_size, kv_heads, head_dim = 4, 5, 3, 24
    k_cache = random_tensor((num_blocks, block_size, kv_heads, head_dim), torch.float16, device, gen)
    v_cache = random_tensor((num_blocks, block_size, kv_heads, head_dim), torch.float16, device, gen)
    qkv = random_tensor((6, 3, kv_heads, head_dim), torch.float32, device, gen)
    k_new, v_new = qkv[:, 1], qkv[:, 2]
    slots = [19, 0, -1, 7, 12, 5]
    want_k, want_v = to_numpy(k_cache), to_numpy(v_cache)
    write_slots(want_k, slots, to_numpy(k_new.half()))
    write_slots(want_v, slots, to_numpy(v_new.half()))
    write_paged_kv(k_cache, v_cache, k_new, v_new, torch.tensor(slots, dtype=torch.int32, device=device))
    assert_close(k_cache, want_k, torch.float16, "k_cache", seed, atol=0, rtol=0)
    assert_close(v_cache, want_v, torch.float16, "v_cache", seed, atol=0, rtol=0)


def test_write_paged_kv_rejects_bad_inputs(device, gen):
    cache = random_tensor((2, 4, 2, 16), torch.float32, device, gen)
    new = random_tensor((3, 2, 16), torch.float32, device, gen)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_paged_kv(cache, cache.clone(), new, new, torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="integer"):
        write_paged_kv(cache, cache.clone(), new, new, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="does not match"):
        write_paged_kv(cache, cache.clone(), new[:, :1], new[:, :1], torch.zeros(3, dtype=torch.int64, device=device))


# ----------------------------------------------------------------------------------------
# End to end: chunked prefill, then decode, through the three kernels
# ----------------------------------------------------------------------------------------
def test_chunked_prefill_then_decode_equals_recompute(dtype, device, gen, seed):
    """Two prompts (21 and 9 tokens) prefilled in chunks of at most 8 tokens, then 3 decode
    steps each, every step writing its K/V with `write_paged_kv` into blocks of 5 handed out
    from a shuffled pool, and attending with the paged kernels. The second prompt runs out
    before the first (a sequence with no new token in the last chunk), and every prefill
    write carries a padding token (slot -1) that must land nowhere. Every output row must
    equal row ``p`` of causal attention over the whole sequence."""
    skip_fp32_on_gpu(dtype, device)
    q_heads, kv_heads, head_dim, block_size, chunk = 4, 2, 16, 5, 8
    prompts, decode_steps = [21, 9], 3
    totals = [n + decode_steps for n in prompts]
    batch = len(prompts)
    qs = [random_tensor((n, q_heads, head_dim), dtype, device, gen) for n in totals]
    ks = [random_tensor((n, kv_heads, head_dim), dtype, device, gen) for n in totals]
    vs = [random_tensor((n, kv_heads, head_dim), dtype, device, gen) for n in totals]
    want = [attention(to_numpy(q.transpose(0, 1))[None], to_numpy(k.transpose(0, 1))[None],
                      to_numpy(v.transpose(0, 1))[None], causal=True) for q, k, v in zip(qs, ks, vs)]

    need = [math.ceil(n / block_size) for n in totals]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[:need[0]], perm[need[0]:need[0] + need[1]]]
    block_tables = padded_block_tables(tables, max(need), device=device)
    shape = (num_blocks + 2 * GUARD_BLOCKS, block_size, kv_heads, head_dim)
    k_buf = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_buf = torch.full(shape, float("nan"), dtype=dtype, device=device)
    inside = slice(GUARD_BLOCKS, GUARD_BLOCKS + num_blocks)
    k_cache, v_cache = k_buf[inside], v_buf[inside]

    def check(b, positions, out, lse, rows):
        o, l = want[b]
        for r, p in zip(rows, positions):
            assert_close(out[r], o[0, :, p], dtype, f"out (sequence {b}, position {p})", seed)
            assert_close(lse[:, r], l[0, :, p], dtype, f"lse (sequence {b}, position {p})", seed)

    done = [0, 0]
    while any(d < n for d, n in zip(done, prompts)):  # chunked prefill, both sequences per step
        spans = [(d, min(n, d + chunk)) for d, n in zip(done, prompts)]
        q_lens = [e - s for s, e in spans]
        pos = [p for s, e in spans for p in range(s, e)]
        owner = [b for b, (s, e) in enumerate(spans) for _ in range(s, e)]
        slots = [int(ref.paged_kv_addresses(tables[b], [p], block_size)[0]) for b, p in zip(owner, pos)]
        # One padding token (slot -1) rides along, as in a padded batch: it must write nothing.
        junk = torch.full((1, kv_heads, head_dim), 1e4, dtype=dtype, device=device)
        k_new = torch.cat([torch.stack([ks[b][p] for b, p in zip(owner, pos)]), junk])
        v_new = torch.cat([torch.stack([vs[b][p] for b, p in zip(owner, pos)]), junk])
        q_new = torch.stack([qs[b][p] for b, p in zip(owner, pos)])
        write_paged_kv(k_cache, v_cache, k_new, v_new, torch.tensor(slots + [PAD], device=device))
        lens = torch.tensor([e for _, e in spans], dtype=torch.int32, device=device)
        out, lse = paged_prefill_attention(q_new, cu_seqlens(q_lens, device), k_cache, v_cache, block_tables, lens,
                                           max(q_lens))
        row = 0
        for b, (s, e) in enumerate(spans):
            check(b, range(s, e), out, lse, range(row, row + e - s))
            row += e - s
        done = [e for _, e in spans]

    for _ in range(decode_steps):  # decode: one token per sequence
        pos = list(done)
        slots = [int(ref.paged_kv_addresses(tables[b], [p], block_size)[0]) for b, p in enumerate(pos)]
        k_new = torch.stack([ks[b][p] for b, p in enumerate(pos)])
        v_new = torch.stack([vs[b][p] for b, p in enumerate(pos)])
        write_paged_kv(k_cache, v_cache, k_new, v_new, torch.tensor(slots, device=device))
        done = [p + 1 for p in pos]
        q_new = torch.stack([qs[b][p] for b, p in enumerate(pos)])
        out, lse = paged_decode_attention(q_new, k_cache, v_cache, block_tables,
                                          torch.tensor(done, dtype=torch.int32, device=device))
        for b, p in enumerate(pos):
            check(b, [p], out[b:b + 1], lse[b:b + 1].t(), [0])

    # The pool holds exactly the sequences' K/V, in their blocks, and nothing was written
    # around it.
    for b in range(batch):
        assert_close(gather_slots(k_cache, tables[b], totals[b]), to_numpy(ks[b]), dtype,
                     f"k_cache (sequence {b})", seed, atol=0, rtol=0)
        assert_close(gather_slots(v_cache, tables[b], totals[b]), to_numpy(vs[b]), dtype,
                     f"v_cache (sequence {b})", seed, atol=0, rtol=0)
    for buf in (k_buf, v_buf):
        assert buf[:GUARD_BLOCKS].isnan().all() and buf[GUARD_BLOCKS + num_blocks:].isnan().all()


# ----------------------------------------------------------------------------------------
# Offsets past 2^31
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_offsets_past_two_to_the_31(device, gen, seed):
    """A bf16 pool of 132k blocks x 16 slots x 8 heads x 128 = 2.2e9 elements per tensor
    (4.4 GB each): blocks near the end of the pool start past 2^31 elements, so every kernel
    must index in int64. Two sequences live in the last blocks (and one in the first ones);
    they are written with `write_paged_kv`, then read by decode and prefill."""
    dtype = torch.bfloat16
    block_size, kv_heads, head_dim, q_heads = 16, 8, 128, 32
    num_blocks = 132_000
    assert num_blocks * block_size * kv_heads * head_dim > 2 ** 31
    k_cache = torch.zeros((num_blocks, block_size, kv_heads, head_dim), dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    seq_lens = [300, 77, 200]
    tables = [list(range(num_blocks - 1, num_blocks - 20, -1)),  # the last blocks, backwards
              list(range(3, 8)),
              list(range(num_blocks - 40, num_blocks - 27))]
    block_tables = padded_block_tables(tables, 20, device=device)
    k_seq = [random_tensor((n, kv_heads, head_dim), dtype, device, gen) for n in seq_lens]
    v_seq = [random_tensor((n, kv_heads, head_dim), dtype, device, gen) for n in seq_lens]
    slots = np.concatenate([ref.paged_kv_addresses(t, np.arange(n), block_size) for t, n in zip(tables, seq_lens)])
    assert slots.max() * kv_heads * head_dim > 2 ** 31
    write_paged_kv(k_cache, v_cache, torch.cat(k_seq), torch.cat(v_seq), torch.from_numpy(slots).to(device))
    for b, n in enumerate(seq_lens):
        assert torch.equal(gather_slots(k_cache, tables[b], n), k_seq[b])
        assert torch.equal(gather_slots(v_cache, tables[b], n), v_seq[b])

    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = random_tensor((3, q_heads, head_dim), dtype, device, gen)
    out, lse = paged_decode_attention(q, k_cache, v_cache, block_tables, lens)
    for b, n in enumerate(seq_lens):
        k, v = to_numpy(k_seq[b]).transpose(1, 0, 2)[None], to_numpy(v_seq[b]).transpose(1, 0, 2)[None]
        o, l = attention(to_numpy(q[b])[None, :, None], k, v)
        assert_close(out[b], o[0, :, 0], dtype, f"decode out (sequence {b})", seed)
        assert_close(lse[b], l[0, :, 0], dtype, f"decode lse (sequence {b})", seed)

    q_lens = [100, 77, 50]
    qp = random_tensor((sum(q_lens), q_heads, head_dim), dtype, device, gen)
    cu = cu_seqlens(q_lens, device)
    out, lse = paged_prefill_attention(qp, cu, k_cache, v_cache, block_tables, lens, max(q_lens))
    for b, n in enumerate(seq_lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        k, v = to_numpy(k_seq[b]).transpose(1, 0, 2)[None], to_numpy(v_seq[b]).transpose(1, 0, 2)[None]
        o, l = attention(to_numpy(qp[rows]).transpose(1, 0, 2)[None], k, v, causal=True)
        assert_close(out[rows], o[0].transpose(1, 0, 2), dtype, f"prefill out (sequence {b})", seed)
        assert_close(lse[:, rows], l[0], dtype, f"prefill lse (sequence {b})", seed)


# ----------------------------------------------------------------------------------------
# The benchmark's bookkeeping (no timing: a stand-in timer, tiny shapes, the interpreter)
# ----------------------------------------------------------------------------------------
def test_benchmark_dry_run(device):
    """`bench.ch05_paged_attention.sweep` end to end on tiny shapes with a stand-in timer that
    calls the function once: every point adds its rows, the paged output agrees with the
    contiguous one and with the reference, and the summary prints. The real sweep runs on a
    GPU (`python -m bench.run`)."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # `pytest` without `python -m` does not put the root on the path
        sys.path.insert(0, root)
    from bench import ch05_paged_attention as bench
    from bench.common import Results

    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
    results = Results("dry run", {"copy_TBps": 1.0, "bf16_matmul_TFLOPs": 1.0}, env={})
    bench.sweep(results, device, q_heads=4, kv_heads_list=(2,), batches=(2,), contexts=(48,), head_dim=16,
                block_sizes=(1, 16), dtype=dtype, timer=lambda fn: (fn(), 1.0)[1],
                prefill_points=((2, 8, 12),), prefill_block_sizes=(16,), prefill_heads=(4, 2))
    rows = results.rows

    def count(metric, **params):
        return sum(r["metric"] == metric and all(r["params"].get(a) == b for a, b in params.items()) for r in rows)

    decode_points = 2  # block sizes 1 and 16 at one (kv_heads, batch, context)
    # + a general-path row where a block holds whole tiles (block 16 under the interpreter's
    # 16-position tiles; none with the GPU's 128-position tiles)
    fast_path_points = sum(blocks_per_tile(bs, decode_block_n(16, dtype), None) > 0 for bs in (1, 16))
    assert count("time_ms", kind="decode") == decode_points + fast_path_points
    assert count("bandwidth_TBps", kind="decode") == decode_points
    assert count("rel_err", kind="decode") == decode_points
    assert count("time_ms", kind="prefill") == 1 and count("TFLOPs", kind="prefill") == 1
    assert count("rel_err", kind="prefill") == 1
    tol = 1e-4 if dtype == torch.float32 else 2e-3  # fp16 on a GPU: rounding of P and of the output
    assert all(r["ours"] < tol for r in rows if r["metric"] == "rel_err"), [r["ours"] for r in rows
                                                                           if r["metric"] == "rel_err"]
    assert {r["peer"] for r in rows if r["metric"] == "time_ms"} == (
        {"contiguous", "flash_attention_varlen"} | ({"general_path"} if fast_path_points else set()))
    bw = next(r for r in rows if r["metric"] == "bandwidth_TBps" and r["params"]["block_size"] == 16)
    assert bw["fraction_of_ceiling"] == pytest.approx(bw["ours"])  # the stand-in ceiling is 1 TB/s
    assert results.status[bench.BENCHMARK] == "complete"
    table = bench.summary(results)
    # decode: header + one (kv_heads, batch, context); paths: 3 + one (if any); prefill: 3
    assert len(table.splitlines()) == 2 + (4 if fast_path_points else 0) + 3, table


def test_tile_path_choice():
    """Which way `tile_rows` finds a tile's rows: one entry per tile when a block holds whole
    tiles, ``n`` entries when a tile is ``n`` whole blocks, one per position otherwise."""
    assert blocks_per_tile(256, 128, None) == 1 and blocks_per_tile(128, 128, None) == 1
    assert blocks_per_tile(16, 128, None) == 8 and blocks_per_tile(64, 128, None) == 2
    assert blocks_per_tile(17, 128, None) == 0 and blocks_per_tile(1, 128, None) == 0
    assert blocks_per_tile(48, 128, None) == 0  # neither divides the other
    assert blocks_per_tile(16, 128, False) == 0 and blocks_per_tile(256, 128, True) == 1
    with pytest.raises(ValueError, match="straddle"):
        blocks_per_tile(16, 128, True)
