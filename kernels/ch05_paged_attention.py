"""Chapter 5: attention over a paged KV cache (vLLM's PagedAttention), as Triton kernels.

The notebook ``chapters/05_paged_kv.ipynb`` tells the chapter's story with its measurements;
this docstring summarises what the code does.

Chapter 2's cache gave every sequence a contiguous ``[max_len]`` stretch of slots, reserved up
front for the longest it might become. A paged cache (Kwon et al., 2023) instead cuts one pool
into fixed-size **blocks** of ``block_size`` token slots and hands them out one at a time
(`minillm.paged.BlockManager`): a sequence wastes at most the unfilled end of its last block,
and sequences can share blocks (forks, common prompt prefixes). The price is an indirection.
Token ``p`` of sequence ``b`` lives in

    slot = block_tables[b, p // block_size] * block_size + p % block_size,

row ``slot`` of the pool viewed as ``[num_blocks * block_size, kv_heads, head_dim]``, and the
blocks of one sequence lie anywhere in the pool, in any order.

Layout (the contract of `minillm.paged`): per layer ``k_cache, v_cache: [num_blocks,
block_size, kv_heads, head_dim]``; block tables int32 ``[batch, max_blocks]`` padded with -1;
slot mappings int64 with -1 for "do not write". Three kernels:

1. `write_paged_kv` scatters the new tokens' K and V rows to their slots (Chapter 2's
   `write_kv`, with a slot that now names a block and an offset).
2. `paged_decode_attention`: one new query per sequence over its whole paged cache. This is
   Chapter 2's `decode_attention` with one change, *where* a tile of keys comes from: one
   program per (sequence, KV head), the query heads of a GQA group as the rows of one
   ``tl.dot`` (so each K/V element is read from HBM once), an online softmax over tiles of
   ``BLOCK_N`` token positions; each position of a tile is mapped through the block table to
   its row of the pool. Decode is memory bound (Chapter 2), so the question this chapter
   measures is whether the scattered blocks cost bandwidth.
3. `paged_prefill_attention`: the new tokens of each sequence attending to its cached prefix
   plus themselves (causal, bottom-right aligned). This is Chapter 4's FlashAttention-2
   forward (one program per Q block, head and sequence; unscaled accumulator; the loop over
   key tiles split into unmasked and masked segments by `kv_segments`) with the same change
   of where key tiles come from. It is what prefix caching (a prompt whose first blocks are
   already cached attends to them without recomputing them) and chunked prefill (a long
   prompt processed a chunk per step) need: the queries are only the new tokens, the keys
   the whole sequence so far.

**Tiles and blocks.** The kernels walk key positions in tiles of ``BLOCK_N`` whatever the
block size, so any block size works (1, 3, 17, 256, ...: powers of two are not needed).
There are two ways to find a tile's rows:

- *general*: load ``BLOCK_N`` table entries (one per position, ``p // block_size``; within
  a block they repeat, and lanes reading the same entry share one cached transaction) and
  compute each row's address. This handles tiles that straddle blocks, e.g. block size 16 or 17 with
  ``BLOCK_N = 128``.
- *one block per tile* (``BLOCKS_PER_TILE = 1``, a compile-time switch chosen by the
  launcher when ``block_size % BLOCK_N == 0``): tiles start at multiples of ``BLOCK_N``, so
  each lies inside one block; one scalar table load serves the whole tile, and its rows are
  consecutive slots. No per-position division, no per-position table load. Contiguous caches
  (`contiguous_as_paged`: one block per sequence) take this path whenever ``max_len`` is a
  multiple of ``BLOCK_N``.
- *whole blocks per tile* (``BLOCKS_PER_TILE = n >= 2``, when ``BLOCK_N = n · block_size``,
  e.g. block size 16 with ``BLOCK_N = 128``): the tile is exactly ``n`` blocks, so ``n``
  table entries are loaded and each is broadcast to its ``block_size`` rows in registers.

Either way a tile is ``BLOCK_N`` rows of ``head_dim`` contiguous elements (one KV head of a
token), as in a contiguous token-major cache, so coalescing within a row is unchanged; what
paging changes is which rows follow which. Whether the special paths are worth their extra
compiled variants is a measurement, not an assumption: `bench.ch05_paged_attention` times
each against the general path on the same inputs (rows with peer ``general_path``).

**No TMA.** Chapter 4's forward loads K/V tiles on Hopper with TMA descriptors, which copy a
box of one strided tensor. A paged tile that straddles blocks is not such a box, so these
kernels use pointer arithmetic only (the one-block tiles could use a descriptor over the
pool; not done here).

**Tile sizes** are fixed per head dim and dtype (`decode_block_n`, `prefill_config`; small
ones under the interpreter), taken from Chapters 2 and 4's measurements rather than
autotuned: the tile size does not depend on the block size, so one compiled kernel per
(head dim, dtype, path) serves every batch.

**Safety.** Table entries past a sequence's length may be -1 and are never loaded (the table
load is masked by the length). An entry *inside* the length that is not a valid block id
(negative, or ``>= num_blocks``: a caller's bug) is never dereferenced either: the block is
replaced by block 0 for the address and the load is masked, so its positions read as zero
keys and values (score 0, contributing nothing to the output but weight to the softmax
sum). Lengths are clamped to what the table can address. Every K/V address the kernels
form lies inside the pool (the padded head-dim columns are clamped by
`minillm.kernels.base.head_dim_offsets`, which fixed a real fault on an H200). Offsets are int64: a pool of
many long sequences passes 2^31 elements.

Shapes and units are documented per function; any strides are accepted (no copies).
"""
from __future__ import annotations

import functools

import torch
from minillm.kernels.base import (
    tl, triton,
    LN2_C, LOG2E, block_d, dot_precision, head_dim_offsets, interpreting, launch, online_softmax_update,
    power_of_2_at_least, scale_and_window,
)
from minillm.kernels.ch04_flash_attention import kv_segments, visible_mask

__all__ = ["write_paged_kv", "paged_decode_attention", "paged_prefill_attention", "contiguous_as_paged",
           "decode_block_n", "prefill_config",
           # the pieces Chapter 7's flash-decoding reuses
           "tile_rows", "paged_fwd_tiles", "check_paged", "decode_outputs", "blocks_per_tile"]


# ----------------------------------------------------------------------------------------
# Writing new tokens into the pool
# ----------------------------------------------------------------------------------------
@triton.jit
def _write_paged_kv_kernel(
    K_new, V_new, K_cache, V_cache, Slots,
    stride_knt, stride_knh, stride_knd,
    stride_vnt, stride_vnh, stride_vnd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_s,
    kv_heads, block_size, num_slots,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(t, j)`` copies KV heads ``j·BLOCK_H …`` of new token ``t`` to its slot.

    As in Chapter 2, one program moves a whole ``[heads, head_dim]`` tile of K and of V
    (a few KB of loads in flight), and the head axis is split only to bound registers."""
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)

    slot = tl.load(Slots + t * stride_s).to(tl.int64)
    # -1 is padding; anything else outside [0, num_slots) would write outside the pool.
    # Both write nothing (checking on the host would cost a GPU->CPU sync per step): the
    # token then has zero heads to copy, which folds the test into the mask. The slot is
    # also replaced by 0, so that even the masked-off addresses lie inside the pool.
    ok = (slot >= 0) & (slot < num_slots)
    heads_to_copy = tl.where(ok, kv_heads, 0)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size  # (slot >= 0 here: // and % agree compiled and interpreted)
    off = slot % block_size

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads_to_copy
    offs_h = tl.minimum(offs_h, kv_heads - 1).to(tl.int64)  # padding heads: clamped, masked
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    mask = h_ok[:, None] & d_ok

    k = tl.load(K_new + t * stride_knt + offs_h[:, None] * stride_knh + offs_d[None, :] * stride_knd, mask=mask)
    v = tl.load(V_new + t * stride_vnt + offs_h[:, None] * stride_vnh + offs_d[None, :] * stride_vnd, mask=mask)
    k_row = K_cache + blk * stride_kcb + off * stride_kco  # the slot's row: block, then offset in it
    v_row = V_cache + blk * stride_vcb + off * stride_vco
    tl.store(k_row + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd, k.to(K_cache.dtype.element_ty),
             mask=mask)
    tl.store(v_row + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd, v.to(V_cache.dtype.element_ty),
             mask=mask)


def write_paged_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store new K/V rows into the paged pool, in place: ``cache[slot // bs, slot % bs] = new``.

    - ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``, written in place;
    - ``k_new, v_new: [num_tokens, kv_heads, head_dim]``, the new tokens of the whole batch
      back to back (any strides; cast to the cache's dtype on the way);
    - ``slot_mapping: [num_tokens]``, any integer dtype (int64 by the layout contract): token
      ``i`` goes to slot ``slot_mapping[i] = block_id * block_size + offset``. ``-1`` means
      "padding: write nothing", and so does any slot outside ``[0, num_blocks · block_size)``
      (never written, not reported: checking would cost a device sync). If two tokens name
      the same slot, which one lands is unspecified.
    """
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
                         "[num_blocks, block_size, kv_heads, head_dim] and equal")
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)} differ")
    if k_new.dim() != 3 or tuple(k_new.shape[1:]) != (kv_heads, head_dim):
        raise ValueError(f"k_new {tuple(k_new.shape)} does not match the cache {tuple(k_cache.shape)} "
                         "(expected [num_tokens, kv_heads, head_dim])")
    num_tokens = k_new.shape[0]
    if tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [num_tokens] = [{num_tokens}]")
    if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise TypeError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    if num_tokens == 0 or kv_heads * head_dim == 0 or num_blocks * block_size == 0:
        return
    BLOCK_D = power_of_2_at_least(head_dim)
    BLOCK_H = min(power_of_2_at_least(kv_heads), max(1, 4096 // BLOCK_D))  # <= ~4k elements per tensor
    grid = (num_tokens, triton.cdiv(kv_heads, BLOCK_H))
    launch(
        _write_paged_kv_kernel, grid, k_new, v_new, k_cache, v_cache, slot_mapping,
        *k_new.stride(), *v_new.stride(), *k_cache.stride(), *v_cache.stride(), slot_mapping.stride(0),
        kv_heads, block_size, num_blocks * block_size,
        HEAD_DIM=head_dim, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, num_warps=4,
    )


# ----------------------------------------------------------------------------------------
# Where a tile of keys lives: the block-table lookup both attention kernels share
# ----------------------------------------------------------------------------------------
@triton.jit
def tile_rows(Table, stride_tn, start, offs_n0, n_valid, block_size, num_blocks,
              stride_kb, stride_ko, stride_vb, stride_vo,
              BLOCKS_PER_TILE: tl.constexpr, RAGGED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows of the pool holding key positions ``start + offs_n0`` of one sequence.

    ``Table`` points at the sequence's block-table row. Returns ``(k_rows, v_rows, row_ok)``:
    int64 ``[BLOCK_N]`` element offsets of each position's row in K and V (add the head and
    head-dim offsets to get a tile's addresses), and ``row_ok``, the positions to load.

    ``BLOCKS_PER_TILE``: 0 for the general path (one table entry per position); 1 when the
    caller guarantees that the tile lies in one block (``start`` is a multiple of ``BLOCK_N``
    and ``BLOCK_N`` divides ``block_size``), so one scalar table entry serves it; ``n >= 2``
    when ``BLOCK_N = n · block_size`` (``start`` a multiple of ``BLOCK_N``): the tile is ``n``
    whole blocks, ``n`` entries. ``RAGGED``: positions ``>= n_valid`` may occur (the last tile of a
    sequence); their table entries are not loaded (they may be -1, or past the table) and
    ``row_ok`` excludes them. Without it every position is ``< n_valid``, and no length mask
    is computed at all.

    A block id outside ``[0, num_blocks)`` inside the length is a caller's bug: it is
    replaced by 0 (so the address stays inside the pool) and its rows are masked off, which
    makes them read as zeros instead of faulting or reading another pool's memory.
    """
    offs_n = start + offs_n0
    if BLOCKS_PER_TILE == 1:
        blk = tl.load(Table + (start // block_size) * stride_tn)  # one entry for the whole tile
        off = (start % block_size) + offs_n0                       # consecutive slots of that block
    elif BLOCKS_PER_TILE > 1:
        # n entries, then each repeated for its BLOCK_N // n rows (a register broadcast).
        idx = start // (BLOCK_N // BLOCKS_PER_TILE) + tl.arange(0, BLOCKS_PER_TILE)
        if RAGGED:
            few = tl.load(Table + idx * stride_tn, mask=idx * (BLOCK_N // BLOCKS_PER_TILE) < n_valid, other=0)
        else:
            few = tl.load(Table + idx * stride_tn)
        blk = tl.reshape(tl.broadcast_to(few[:, None], (BLOCKS_PER_TILE, BLOCK_N // BLOCKS_PER_TILE)), (BLOCK_N,))
        off = offs_n0 % (BLOCK_N // BLOCKS_PER_TILE)  # a compile-time power of two: a mask, not a division
    else:
        if RAGGED:
            blk = tl.load(Table + (offs_n // block_size) * stride_tn, mask=offs_n < n_valid, other=0)
        else:
            blk = tl.load(Table + (offs_n // block_size) * stride_tn)
        off = offs_n % block_size
    blk_ok = (blk >= 0) & (blk < num_blocks)
    if BLOCKS_PER_TILE == 1:
        # blk_ok is one bool for the whole tile: fold it into a count of rows to load (and
        # the length into it too), so the row mask is one vector compare.
        n_ok = tl.where(blk_ok, BLOCK_N, 0)
        if RAGGED:
            n_ok = tl.minimum(n_ok, n_valid - start)
        row_ok = offs_n0 < n_ok
    else:
        row_ok = blk_ok
        if RAGGED:
            row_ok = row_ok & (offs_n < n_valid)
    blk = tl.where(blk_ok, blk, 0).to(tl.int64)  # int64: block x block stride passes 2^31 in a big pool
    off = off.to(tl.int64)
    return blk * stride_kb + off * stride_ko, blk * stride_vb + off * stride_vo, row_ok


# ----------------------------------------------------------------------------------------
# Decode: one query per sequence over its paged cache
# ----------------------------------------------------------------------------------------
@triton.jit
def _paged_decode_kernel(
    Q, K, V, BlockTables, SeqLens, O, LSE,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_tb, stride_tn, stride_sl,
    stride_ob, stride_oh, stride_od,
    stride_lb, stride_lh,
    group_size, block_size, num_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program ``(b, kv_h)``: the ``group_size`` query heads of sequence ``b`` that read KV
    head ``kv_h``, over the first ``seq_lens[b]`` token positions of its block table.

    Chapter 2's kernel, line for line, except for the addresses of a tile (`tile_rows`) and
    the base-2 exponentials of Chapter 4 (``qk_scale`` includes ``log2 e``)."""
    b, kv_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)

    offs_g = tl.arange(0, GROUP_PAD)
    in_g = offs_g < group_size
    # The group's query heads are consecutive (Llama's layout). Padding rows (tl.dot needs
    # >= 16) load zeros and are never stored; their addresses are clamped to a real head.
    heads = kv_h * group_size + tl.minimum(offs_g, group_size - 1)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=in_g[:, None] & d_ok, other=0.0)

    # Clamp the length into what the table can address: a bad length must not read past it.
    seq_len = tl.minimum(tl.maximum(tl.load(SeqLens + b * stride_sl), 0), max_blocks * block_size)
    table = BlockTables + b * stride_tb
    k_head = K + kv_h * stride_kh + offs_d[None, :] * stride_kd  # [1, BLOCK_D]: this head's columns
    v_head = V + kv_h * stride_vh + offs_d[None, :] * stride_vd
    offs_n0 = tl.arange(0, BLOCK_N)

    # Online softmax over tiles (Chapter 3), base 2: m is the running max of the scaled
    # scores in log2 units, l the running sum of 2^(s - m), acc the running sum of
    # 2^(s - m)·v, divided by l only once at the end.
    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), dtype=tl.float32)

    for start in range(0, seq_len, BLOCK_N):
        k_rows, v_rows, row_ok = tile_rows(table, stride_tn, start, offs_n0, seq_len, block_size, num_blocks,
                                           stride_kb, stride_ko, stride_vb, stride_vo, BLOCKS_PER_TILE, True, BLOCK_N)
        k = tl.load(k_head + k_rows[:, None], mask=row_ok[:, None] & d_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [GROUP_PAD, BLOCK_N], fp32
        # Past the length: -inf. (A position in an invalid block loaded a zero key: score 0.)
        s = tl.where((start + offs_n0 < seq_len)[None, :], s * qk_scale, float("-inf"))

        # The online-softmax update (Chapter 3, base 2): new max, p = 2^(s - m_new), alpha =
        # 2^(m - m_new) (0 on the first tile), l = l·alpha + Σ p.
        p, alpha, l, m = online_softmax_update(m, l, s, qk_scale, True)

        v = tl.load(v_head + v_rows[:, None], mask=row_ok[:, None] & d_ok, other=0.0)
        # P is rounded to the cache dtype for the tensor-core dot (fp32 accumulation), as in
        # FlashAttention; fp32 inputs keep exact IEEE products.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)

    # seq_len = 0: the loop never ran, l = 0 and m = -inf -> output 0 and lse = -inf.
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    lse = (m + tl.math.log2(l)) * LN2_C  # back to natural log
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=in_g[:, None] & d_ok)
    tl.store(LSE + b * stride_lb + heads * stride_lh, lse, mask=in_g)


#: ``BLOCK_N`` of the decode kernel under the interpreter: small, so that the CPU tests walk
#: several tiles per sequence, and so that both tile paths run there (block sizes that are
#: multiples of 16 take the one-block-per-tile path, 1/3/17 the general one).
INTERPRET_DECODE_BLOCK_N = 16
#: Warps and pipeline stages of the decode kernel on a GPU (Chapter 2's measurements).
DECODE_WARPS, DECODE_STAGES = 8, 3


@functools.lru_cache(maxsize=None)  # asked on every decode call; the interpreter is chosen at import
def decode_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """``BLOCK_N`` of the decode kernel: key positions per tile.

    On a GPU: tiles of 32 KB (128 x 128 in bf16), Chapter 2's choice. With ``num_stages=3``
    the loads of the next tiles are in flight while one is used, and a single program needs
    that much outstanding to pull its share of HBM bandwidth; on an H200 (bf16, head_dim 128)
    ``BLOCK_N = 128`` with 8 warps ran 1.4x faster than 64 at batch 1 and 8. The tile size
    does not depend on the block size: small blocks are handled by the general path, whose
    per-position table loads hit L1 after the first of each block."""
    if interpreting():
        return INTERPRET_DECODE_BLOCK_N
    return min(128, max(16, 32768 // (block_d(head_dim) * dtype.itemsize)))


def check_paged(q, k_cache, v_cache, block_tables, seq_lens, batch: int) -> tuple[int, int, int, int, int]:
    """Validate the cache, tables and lengths; returns (num_blocks, block_size, kv_heads, head_dim, q_heads)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
                         "[num_blocks, block_size, kv_heads, head_dim] and equal")
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)} "
                         "(expected [*, q_heads, head_dim])")
    q_heads = q.shape[1]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (MHA/GQA/MQA)")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q and the caches must share one dtype among fp16/bf16/fp32; got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim={head_dim}: 1..256 supported (one query block lives in registers)")
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if (block_tables.dim() != 2 or block_tables.shape[0] != batch
            or block_tables.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"block_tables must be an int32 tensor [batch, max_blocks] with batch={batch}, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise ValueError(f"seq_lens must be an integer tensor [batch] = [{batch}], got "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    if not (q.device == k_cache.device == v_cache.device == block_tables.device == seq_lens.device):
        raise ValueError("q, the caches, block_tables and seq_lens must be on the same device")
    return num_blocks, block_size, kv_heads, head_dim, q_heads


def decode_outputs(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None):
    """``(out, lse)`` of a decode launcher for ``q: [batch, q_heads, head_dim]``: the given
    tensors, or new ones (``out`` like q, ``lse: [batch, q_heads]`` float32)."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32)
    return out, lse


def blocks_per_tile(block_size: int, block_n: int, forced: bool | None) -> int:
    """The tile path (`tile_rows`): 1 if a tile of ``block_n`` positions always lies in one
    block, ``n`` if it is exactly ``n >= 2`` whole blocks, 0 (general) otherwise. ``forced``
    (tests, measurements): True = the one-block path (only where it is correct), False = the
    general path, None = the best that applies."""
    fits = block_size % block_n == 0
    if forced is None:
        if fits:
            return 1
        return block_n // block_size if block_size > 1 and block_n % block_size == 0 else 0
    if forced and not fits:
        raise ValueError(f"block_size={block_size} is not a multiple of BLOCK_N={block_n}: "
                         "a tile may straddle blocks, the one-block-per-tile path would be wrong")
    return int(bool(forced))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                           out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
                           block_n: int | None = None,
                           tile_in_block: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per sequence over its paged K/V cache.

    - ``q: [batch, q_heads, head_dim]``, the query of each sequence's newest token;
    - ``k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]``, the pool (one
      dtype with q: fp16, bf16 or fp32); any block size >= 1; ``q_heads % kv_heads == 0``
      (query head ``h`` reads KV head ``h // (q_heads // kv_heads)``);
    - ``block_tables: [batch, max_blocks]`` int32 (int64 accepted): sequence ``b``'s blocks in
      order; entries past its length may be -1 (never read);
    - ``seq_lens: [batch]`` integers: sequence ``b`` attends to its positions ``0 …
      seq_lens[b] - 1`` (the new token's K/V already written, e.g. by `write_paged_kv`).
      Length 0 gives a zero output and ``lse = -inf``; lengths are clamped to
      ``[0, max_blocks · block_size]``;
    - ``scale`` defaults to ``1/sqrt(head_dim)``.

    Returns ``(out, lse)``: ``out: [batch, q_heads, head_dim]`` in q's dtype and ``lse:
    [batch, q_heads]`` float32 (natural log). ``out``/``lse`` may be given preallocated (any
    strides). One program per (sequence, KV head), as in Chapter 2's `decode_attention`.

    Knobs for tests and measurements (``None``, the default, picks as a caller wants): the
    tile size ``block_n`` (keys per tile, default `decode_block_n`) and the tile path
    ``tile_in_block`` (True = one table entry per tile, False = the general path).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got {tuple(q.shape)}")
    batch = q.shape[0]
    num_blocks, block_size, kv_heads, head_dim, q_heads = check_paged(q, k_cache, v_cache, block_tables,
                                                                       seq_lens, batch)
    scale, _ = scale_and_window(head_dim, scale, None)
    out, lse = decode_outputs(q, out, lse)
    if batch * q_heads == 0:
        return out, lse

    group = q_heads // kv_heads
    BLOCK_N = block_n or decode_block_n(head_dim, q.dtype)
    launch(
        _paged_decode_kernel, (batch, kv_heads), q, k_cache, v_cache, block_tables, seq_lens, out, lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), seq_lens.stride(0),
        *out.stride(), *lse.stride(),
        group, block_size, num_blocks, block_tables.shape[1], scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), GROUP_PAD=max(16, power_of_2_at_least(group)),
        BLOCK_N=BLOCK_N, BLOCKS_PER_TILE=blocks_per_tile(block_size, BLOCK_N, tile_in_block),
        DOT_PRECISION=dot_precision(q.dtype), num_warps=DECODE_WARPS, num_stages=DECODE_STAGES,
    )
    return out, lse


def contiguous_as_paged(cache: torch.Tensor, heads_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous per-sequence cache seen as a paged pool, without copying anything.

    A contiguous cache is the paged layout with *one block per sequence*: block ``b`` is
    sequence ``b``'s whole stretch of ``max_len`` slots (``block_size = max_len``) and the
    block table is ``[[0], [1], …]``. So the paged kernels run on contiguous caches too, and
    a benchmark can compare paged and contiguous storage with the very same kernel.

    - ``cache: [batch, max_len, kv_heads, head_dim]`` (token-major, the pool's own layout),
      or with ``heads_first=True`` Chapter 2's ``[batch, kv_heads, max_len, head_dim]``.

    Returns ``(pool, block_tables)``: ``pool`` a view ``[batch, max_len, kv_heads,
    head_dim]`` of the same memory, and ``block_tables`` int32 ``[batch, 1]`` = ``arange``.
    Call it for K and for V (the tables are the same).
    """
    if cache.dim() != 4:
        raise ValueError(f"cache must be 4-d, got {tuple(cache.shape)}")
    pool = cache.transpose(1, 2) if heads_first else cache
    tables = torch.arange(pool.shape[0], device=cache.device, dtype=torch.int32)[:, None]
    return pool, tables


# ----------------------------------------------------------------------------------------
# Prefill over a cached prefix: FlashAttention-2 with paged K/V tiles
# ----------------------------------------------------------------------------------------
@triton.jit
def paged_fwd_tiles(acc, l_i, m_i, q, k_head, v_head, table, stride_tn,
                    stride_kb, stride_ko, stride_vb, stride_vo,
                    offs_m, offs_n0, d_ok, lo, hi, q_len, kv_len, block_size, num_blocks, qk_scale,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stream key tiles ``[lo, hi)`` of one sequence past one Q block: Chapter 4's `_fwd_tiles`
    with each tile's rows found through the block table (`tile_rows`).

    ``MASKED``: the tiles may hold invisible (query, key) pairs (the causal diagonal, the
    ragged end of the sequence): scores are masked with `visible_mask` and positions past the
    length are not loaded. Without it every pair is visible and no mask is computed."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k_rows, v_rows, row_ok = tile_rows(table, stride_tn, start_n, offs_n0, kv_len, block_size, num_blocks,
                                           stride_kb, stride_ko, stride_vb, stride_vo, BLOCKS_PER_TILE, MASKED, BLOCK_N)
        kv_ok = row_ok[:, None] & d_ok
        k = tl.load(k_head + k_rows[:, None], mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] raw scores, fp32
        if MASKED:  # scale, then -inf where invisible; unmasked, the scale is folded into exp2
            visible = visible_mask(offs_m[:, None], offs_n[None, :], q_len, kv_len, 0, CAUSAL, False)
            s = tl.where(visible, s * qk_scale, float("-inf"))
        p, alpha, l_i, m_i = online_softmax_update(m_i, l_i, s, qk_scale, MASKED)  # Chapter 3, base 2
        v = tl.load(v_head + v_rows[:, None], mask=kv_ok, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # FA2: unscaled
    return acc, l_i, m_i


# Not specialized on the integers that change from step to step (the tables' width, the
# LSE strides, which follow the step's token count): see Chapter 7's `_split_kernel`.
@triton.jit(do_not_specialize=["stride_tb", "max_blocks", "stride_lh", "stride_lm"])
def _paged_prefill_kernel(
    Q, K, V, BlockTables, SeqLens, CuSeqQ, O, LSE,
    stride_qm, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_tb, stride_tn, stride_sl,
    stride_om, stride_oh, stride_od,
    stride_lh, stride_lm,
    q_heads, group, block_size, num_blocks, max_blocks, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program ``(i, b·q_heads + h)``: rows ``[i·BLOCK_M, (i+1)·BLOCK_M)`` of sequence ``b``'s new
    queries, head ``h``, against the sequence's ``seq_lens[b]`` keys in the paged pool.

    The queries are the last ``q_len`` positions of the sequence (bottom-right alignment:
    query ``i`` at ``kv_len - q_len + i``), so with a cached prefix of ``P`` tokens the
    causal diagonal sits ``P`` keys to the right: `kv_segments` finds the unmasked bulk (the
    prefix and the earlier chunks) and the masked diagonal tiles, exactly as for Chapter 4's
    varlen kernel when ``kv_len > q_len``."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest programs first (Chapter 4): the short ones fill the gaps at the end
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // q_heads
    h = pid_bh % q_heads
    kv_h = h // group  # GQA: K/V shared by the group, never copied

    q_start = tl.load(CuSeqQ + b)
    q_len = tl.load(CuSeqQ + b + 1) - q_start
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:  # this sequence has fewer new tokens than the longest one
        return
    kv_len = tl.minimum(tl.maximum(tl.load(SeqLens + b * stride_sl), 0), max_blocks * block_size)

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    in_m = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)[:, None]  # int64: token x row stride passes 2^31 in a big batch
    q = tl.load(Q + rows * stride_qm + h64 * stride_qh + offs_d[None, :] * stride_qd,
                mask=in_m[:, None] & d_ok, other=0.0)
    table = BlockTables + b64 * stride_tb
    k_head = K + kv_h.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    v_head = V + kv_h.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    # Masked, unmasked, masked: [lo, full_lo) and [full_hi, hi) need the mask, the bulk
    # between does not, and the tiles past the diagonal are never visited (Chapter 4).
    lo, full_lo, full_hi, hi = kv_segments(start_m, q_len, kv_len, 0, BLOCK_M, BLOCK_N, CAUSAL, False)
    acc, l_i, m_i = paged_fwd_tiles(acc, l_i, m_i, q, k_head, v_head, table, stride_tn,
                                    stride_kb, stride_ko, stride_vb, stride_vo, offs_m, offs_n0, d_ok,
                                    lo, full_lo, q_len, kv_len, block_size, num_blocks, qk_scale,
                                    True, CAUSAL, BLOCKS_PER_TILE, DOT_PRECISION, BLOCK_N)
    acc, l_i, m_i = paged_fwd_tiles(acc, l_i, m_i, q, k_head, v_head, table, stride_tn,
                                    stride_kb, stride_ko, stride_vb, stride_vo, offs_m, offs_n0, d_ok,
                                    full_lo, full_hi, q_len, kv_len, block_size, num_blocks, qk_scale,
                                    False, CAUSAL, BLOCKS_PER_TILE, DOT_PRECISION, BLOCK_N)
    acc, l_i, m_i = paged_fwd_tiles(acc, l_i, m_i, q, k_head, v_head, table, stride_tn,
                                    stride_kb, stride_ko, stride_vb, stride_vo, offs_m, offs_n0, d_ok,
                                    full_hi, hi, q_len, kv_len, block_size, num_blocks, qk_scale,
                                    True, CAUSAL, BLOCKS_PER_TILE, DOT_PRECISION, BLOCK_N)

    out = acc * (1.0 / tl.where(l_i == 0.0, 1.0, l_i))[:, None]  # a row that sees nothing: 0
    lse = (m_i + tl.math.log2(l_i)) * LN2_C                          # ... and -inf
    tl.store(O + rows * stride_om + h64 * stride_oh + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=in_m[:, None] & d_ok)
    tl.store(LSE + h64 * stride_lh + (q_start + offs_m).to(tl.int64) * stride_lm, lse, mask=in_m)


#: Prefill tiles on a GPU, ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` per padded head dim
#: (<= 64, 128, 256): the first (pointer-path) candidate of Chapter 4's `FWD_TILES`, which its
#: sm_90 compile report kept (no spills) and its autotuner picked most often. 128 query rows
#: over 8 warps give each Hopper warpgroup 64 rows (one wgmma); 64 keys per step with 3 stages
#: in flight. The paged gather adds a ``[BLOCK_N]`` vector of row offsets, a few registers.
#: Fixed rather than autotuned: the paged kernel has no TMA path, and one config per head dim
#: keeps its compile count (and the engine's warm-up) small.
#: (At head dim <= 64, 128 x 64 tiles with 3 stages crashed ptxas (SIGSEGV) on the H200 with
#: Triton 3.6 for blocks of 16; with 2 stages it compiled in every case we tried.)
PREFILL_TILES = {64: (128, 64, 8, 2), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}
#: The same when every sequence has at most 64 new tokens (a short chunk, a few speculative
#: tokens): 128-row blocks would be mostly empty. Chapter 4's prune rule. (At head dim <= 64,
#: 64 x 64 tiles with 3 stages crashed ptxas (SIGSEGV) on the H200 with Triton 3.6 for the
#: general tile path; 64 x 32 with 2 stages compiles and passes.)
PREFILL_TILES_SHORT = {64: (64, 32, 4, 2), 128: (64, 64, 4, 3), 256: (64, 32, 4, 3)}
#: fp32 on a GPU (a testing dtype, exact IEEE dots on CUDA cores): small tiles, as Chapter 4.
PREFILL_FP32_TILES = (32, 32, 4, 2)
#: Under the interpreter: small tiles (fast on a CPU), BLOCK_M != BLOCK_N to exercise the
#: diagonal logic as 128 x 64 does on the GPU, and BLOCK_N = 16 so that block sizes that are
#: multiples of 16 take the one-block-per-tile path and the others the general one.
INTERPRET_PREFILL_TILES = (32, 16, 4, 1)


def prefill_config(head_dim: int, dtype: torch.dtype, max_seqlen_q: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the prefill kernel (see `PREFILL_TILES`)."""
    if interpreting():
        return INTERPRET_PREFILL_TILES
    if dtype == torch.float32:
        return PREFILL_FP32_TILES
    bd = block_d(head_dim)
    cls = 64 if bd <= 64 else (128 if bd <= 128 else 256)
    return (PREFILL_TILES_SHORT if max_seqlen_q <= 64 else PREFILL_TILES)[cls]


def paged_prefill_attention(q: torch.Tensor, cu_seqlens_q: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            max_seqlen_q: int, causal: bool = True, scale: float | None = None,
                            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
                            config: tuple[int, int, int, int] | None = None,
                            tile_in_block: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens of each sequence attending to its cached (paged) prefix and to themselves.

    - ``q: [total_q, q_heads, head_dim]``: the new tokens of every sequence back to back
      (the varlen layout of `flash_attention_varlen`; any strides);
    - ``cu_seqlens_q: [batch + 1]`` int32 (int64 accepted) on q's device: prefix sums of
      the new-token counts (sequence ``b``'s queries are rows ``cu[b] : cu[b + 1]``; a count
      may be 0);
    - ``k_cache, v_cache, block_tables``: the pool and tables, as in `paged_decode_attention`;
    - ``seq_lens: [batch]``: tokens in each sequence's cache *including* the new ones, whose
      K/V must already be written (`write_paged_kv`); the cached prefix is ``seq_lens[b] -
      q_len_b`` tokens (0 for a fresh prompt, any number for prefix caching or a later chunk
      of a chunked prefill). Clamped to ``[0, max_blocks · block_size]``;
    - ``max_seqlen_q``: a Python int, at least the largest new-token count (it sizes the
      grid; not checked against ``cu_seqlens_q``, which would need a device sync);
    - ``causal``: query ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i``
      (bottom-right aligned) and sees keys up to it; ``causal=False`` sees all ``seq_lens[b]``;
    - ``scale`` defaults to ``1/sqrt(head_dim)``.

    Returns ``(out, lse)``: ``out: [total_q, q_heads, head_dim]`` in q's dtype and ``lse:
    [q_heads, total_q]`` float32 (natural log; head-major, like `flash_attention_varlen`; a
    row that sees no key gets out 0 and lse -inf). Forward only (inference).

    Knobs for tests and measurements (``None``, the default, picks as a caller wants): the
    tiles ``config = (BLOCK_M, BLOCK_N, warps, stages)`` and the tile path ``tile_in_block``
    (as in `paged_decode_attention`).
    """
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1 or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens_q must be a 1-d int32 tensor [batch + 1], got {tuple(cu_seqlens_q.shape)} "
                         f"{cu_seqlens_q.dtype}")
    batch = cu_seqlens_q.shape[0] - 1
    num_blocks, block_size, kv_heads, head_dim, q_heads = check_paged(q, k_cache, v_cache, block_tables,
                                                                       seq_lens, batch)
    if cu_seqlens_q.device != q.device:
        raise ValueError("cu_seqlens_q must be on q's device")
    scale, _ = scale_and_window(head_dim, scale, None)
    total_q = q.shape[0]
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty(q_heads, total_q, device=q.device, dtype=torch.float32)
    max_seqlen_q = int(max_seqlen_q)
    if batch * q_heads == 0 or total_q == 0 or max_seqlen_q <= 0:
        return out, lse

    bm, bn, warps, stages = config or prefill_config(head_dim, q.dtype, max_seqlen_q)
    grid = (triton.cdiv(max_seqlen_q, bm), batch * q_heads)
    launch(
        _paged_prefill_kernel, grid, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), seq_lens.stride(0),
        *out.stride(), *lse.stride(),
        q_heads, q_heads // kv_heads, block_size, num_blocks, block_tables.shape[1], scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), CAUSAL=bool(causal),
        BLOCKS_PER_TILE=blocks_per_tile(block_size, bn, tile_in_block), DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )
    return out, lse
