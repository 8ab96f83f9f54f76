"""Chapter 7: flash-decoding over the paged KV cache, with FlashDecoding++'s asynchronized softmax.

The explanation, with the measurements behind each choice, is the notebook
``chapters/07_flash_decoding.ipynb``; this module is the code, main path first.

Chapter 5's `paged_decode_attention` runs one program per (sequence, KV head): at batch 1 with
8 KV heads that is 8 programs on a GPU of 132 SMs, far too few to pull HBM bandwidth.
Flash-decoding (Dao et al., 2023; vLLM's PagedAttention V2) cuts each sequence's keys into
``S`` **splits**, one program each:

1. *Stage 1* (`_split_kernel`, grid ``(batch, kv_heads, S)``): Chapter 5's loop over the tiles
   of one split, writing a partial result per query head: the output normalised over the
   split's keys ``o_s`` and the split's log-sum-exp ``lse_s``.
2. *Stage 2* (`_merge_splits_kernel`, grid ``(batch, q_heads)``): with ``M = max_s lse_s`` and
   ``w_s = e^{lse_s − M}``, ``out = Σ_s w_s o_s / Σ_s w_s`` and ``lse = M + log Σ_s w_s``
   (Chapter 3's `merge_partials` over ``S`` pieces; an empty split weighs 0).

With ``S = 1`` stage 1 writes the final result and stage 2 is skipped. How many splits:
`num_splits_heuristic` (one full wave of programs; the default), `fa2_num_splits`
(FlashAttention-2's rule) or `partition_splits` (vLLM's 512-token partitions).

Two variants follow the main path: **one launch** (``FUSED_MERGE``, the default: the last of
a group's ``S`` programs merges, `_merge_if_last`) and FlashDecoding++'s **asynchronized
softmax** (``phi=``: one unified max for every tile, with an exact in-kernel fallback,
`_async_split`).

How stage 1 loads a tile (`_kv_tiles`): pointer loads through the block table, or on sm_90,
where a tile is one box of the pool (blocks a multiple of the tile, e.g. Chapter 11's one
block per sequence), bulk TMA copies through host tensor descriptors (`tma_applies`,
`kv_descriptors`); both, and an eviction hint, are switches of stage 1's ``config``
(`TMA_ON_HOPPER`, `KV_EVICT`: the defaults, with the measurements behind them).

Layouts and contract: those of `paged_decode_attention`. Workspace (`split_workspace`): fp32
partials ``[batch, q_heads, S, head_dim]`` and ``[batch, q_heads, S]`` (split axis next to
last: one (sequence, head)'s partials are one contiguous run).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from minillm.kernels.base import (
    tl, triton,
    CPU_NUM_SMS, LN2_C, LOG2E, LOG2E_C, TensorAddress, block_d, cached_descriptor, dot_precision, head_dim_offsets,
    interpreting, launch, num_sms, online_softmax_update, power_of_2_at_least, scale_and_window, unrecorded,
)
from minillm.kernels.ch05_paged_attention import (  # Chapter 5's tile addressing, reused as it is
    blocks_per_tile, check_paged, decode_block_n, decode_outputs, tile_rows,
)

__all__ = ["flash_decode_attention", "split_workspace", "tma_applies", "kv_descriptors", "TMA_ON_HOPPER", "KV_EVICT",
           "split_counters", "cached_workspace", "cached_empty_workspace", "cached_counters", "FUSED_MERGE",
           "num_splits_heuristic", "fa2_num_splits", "partition_splits", "num_sms", "async_window",
           "SPLIT_PROGRAMS_PER_SM", "MIN_TILES_PER_SPLIT", "MAX_SPLITS", "CPU_NUM_SMS", "VLLM_PARTITION",
           "ASYNC_WINDOW_FP16", "ASYNC_WINDOW_WIDE"]


# ----------------------------------------------------------------------------------------
# Stage 1: one program per (sequence, KV head, split)
# ----------------------------------------------------------------------------------------
@triton.jit
def _split_bounds(seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    """Key positions ``[lo, hi)`` of split ``split`` of a sequence of ``seq_len`` keys, and
    ``full_hi``, the end of its whole tiles.

    Each split gets ``⌈tiles / S⌉`` whole tiles of the sequence's *own* length (so short and
    long sequences alike are shared by all ``S`` programs): every boundary is a multiple of
    ``BLOCK_N``, Chapter 5's fast tile paths still apply, and only the sequence's last tile
    is ragged. A split past the end gets ``hi = lo``: no tile, an empty partial."""
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.maximum(tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len), lo)
    full_hi = hi // BLOCK_N * BLOCK_N  # end of the whole tiles (>= lo: lo is a multiple of BLOCK_N)
    return lo, full_hi, hi


@triton.jit
def _kv_tiles(acc, l, m, q, k_head, v_head, desc_k, desc_v, col0, table, stride_tn, stride_kb, stride_ko,
              stride_vb, stride_vo, offs_n0, d_ok, lo, hi, seq_len, block_size, num_blocks, qk_scale,
              MASKED: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr, KV_EVICT: tl.constexpr):
    """Key tiles ``[lo, hi)`` of one sequence folded into the online softmax ``(acc, l, m)``
    (base 2): Chapter 5's decode loop (`paged_fwd_tiles` with the group's query heads as the
    rows), with two ways of loading a tile.

    - Pointer loads (``TMA`` off, or the ragged last tile): `tile_rows` finds each key's row
      through the block table and every thread loads its share of the ``[BLOCK_N, BLOCK_D]``
      tile. ``KV_EVICT``: the loads' eviction policy (``"evict_first"``: K and V are read
      exactly once per step, so let them leave L2 before q, the table and the partials).
    - ``TMA`` (sm_90, and only where ``BLOCK_N`` divides the block size: one block per
      tile): one scalar table entry, then one bulk copy per tile through the tensor
      descriptors ``desc_k``/``desc_v`` (the pool seen as ``[num_blocks, block_size,
      kv_heads · head_dim]``, boxes ``[1, BLOCK_N, BLOCK_D]`` at ``[block, offset, col0]``),
      issued by one thread: no per-row addresses in registers. An invalid block id is sent
      past the pool's end, where TMA reads zeros, as the pointer path's mask does.

    ``MASKED``: positions ``>= seq_len`` may occur (the last tile); their scores are
    ``-inf`` and their rows are not loaded (always through pointers: a bulk copy of the
    whole box would read stale rows past the length)."""
    for start in range(lo, hi, BLOCK_N):
        if TMA and not MASKED:
            blk = tl.load(table + (start // block_size) * stride_tn)
            blk = tl.where((blk >= 0) & (blk < num_blocks), blk, num_blocks).to(tl.int32)
            off = (start % block_size).to(tl.int32)
            k = desc_k.load([blk, off, col0]).reshape(BLOCK_N, BLOCK_D)
        else:
            k_rows, v_rows, row_ok = tile_rows(table, stride_tn, start, offs_n0, seq_len, block_size, num_blocks,
                                               stride_kb, stride_ko, stride_vb, stride_vo, BLOCKS_PER_TILE, MASKED,
                                               BLOCK_N)
            kv_ok = row_ok[:, None] & d_ok
            k = tl.load(k_head + k_rows[:, None], mask=kv_ok, other=0.0, eviction_policy=KV_EVICT)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [GROUP_PAD, BLOCK_N] raw scores, fp32
        if MASKED:  # scale, then -inf past the length; unmasked, the scale is folded into exp2
            s = tl.where((start + offs_n0 < seq_len)[None, :], s * qk_scale, float("-inf"))
        p, alpha, l, m = online_softmax_update(m, l, s, qk_scale, MASKED)  # Chapter 3, base 2
        if TMA and not MASKED:
            v = desc_v.load([blk, off, col0]).reshape(BLOCK_N, BLOCK_D)
        else:
            v = tl.load(v_head + v_rows[:, None], mask=kv_ok, other=0.0, eviction_policy=KV_EVICT)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # FA2: unscaled
    return acc, l, m


@triton.jit
def _exact_split(q, k_head, v_head, desc_k, desc_v, col0, table, stride_tn, stride_kb, stride_ko, stride_vb,
                 stride_vo, offs_n0, d_ok, lo, full_hi, hi, seq_len, block_size, num_blocks, qk_scale,
                 BLOCKS_PER_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_PAD: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, KV_EVICT: tl.constexpr):
    """The online softmax over key positions ``[lo, hi)``: ``(acc, l, m)`` (base 2, ``acc``
    unscaled), as Chapter 5's kernels compute it (`_kv_tiles`).

    ``[lo, full_hi)`` are whole tiles inside the sequence and need no mask at all;
    ``[full_hi, hi)`` is the sequence's ragged last tile, if it falls in this split."""
    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), dtype=tl.float32)
    acc, l, m = _kv_tiles(acc, l, m, q, k_head, v_head, desc_k, desc_v, col0, table, stride_tn, stride_kb,
                          stride_ko, stride_vb, stride_vo, offs_n0, d_ok, lo, full_hi, seq_len, block_size,
                          num_blocks, qk_scale, False, BLOCKS_PER_TILE, DOT_PRECISION, BLOCK_N, BLOCK_D, TMA,
                          KV_EVICT)
    acc, l, m = _kv_tiles(acc, l, m, q, k_head, v_head, desc_k, desc_v, col0, table, stride_tn, stride_kb,
                          stride_ko, stride_vb, stride_vo, offs_n0, d_ok, full_hi, hi, seq_len, block_size,
                          num_blocks, qk_scale, True, BLOCKS_PER_TILE, DOT_PRECISION, BLOCK_N, BLOCK_D, TMA,
                          KV_EVICT)
    return acc, l, m


# The integers that change from one engine step to the next (the block tables' width; the LSE
# partials' batch and head strides, S·heads and S) are not specialized on: each value class
# (one, a multiple of 16, other) would otherwise be a compiled variant of its own, and an
# engine without CUDA graphs would compile them inside its requests' steps. The output
# partials' strides also follow S, but as multiples of head_dim they stay multiples of 16 for
# every head_dim that is one, so specializing on them costs no variant and tells the compiler
# that rows of partials are 16-byte aligned (vector stores, and vector loads in the merge):
# without it, batch-1 decode with 8 KV heads ran 3-8% slower on an H100.
@triton.jit(do_not_specialize=["stride_tb", "max_blocks", "stride_lb", "stride_lh"])
def _split_kernel(
    Q, K, V, DescK, DescV, BlockTables, SeqLens, O, LSE, Fallbacks, Out, OutLse, Counters,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_tb, stride_tn, stride_sl,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_fb, stride_fh, stride_fs,
    stride_outb, stride_outh, stride_outd,
    stride_olb, stride_olh,
    stride_cb, stride_ch,
    group_size, block_size, num_blocks, max_blocks, qk_scale, phi2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, KV_EVICT: tl.constexpr,
    # The two variants (their code follows the main path, below):
    ASYNC: tl.constexpr, WINDOW_LO: tl.constexpr, WINDOW_HI: tl.constexpr, TRACK_FALLBACKS: tl.constexpr,
    ASYNC_LANES: tl.constexpr, FALLBACK: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program ``(b, kv_h, s)``: split ``s`` of sequence ``b``'s keys, for the ``group_size``
    query heads that read KV head ``kv_h``.

    Writes each head's partial result to ``O[b, h, s, :]`` (normalised over the split) and
    ``LSE[b, h, s]`` (natural log); with one split these are the final output and lse (the
    launcher passes them with a split stride of 0).

    How tiles are loaded (`_kv_tiles`): ``TMA`` with the tensor descriptors ``DescK``/``DescV``
    (else those are ``K``/``V`` again, unused), ``KV_EVICT`` the pointer loads' eviction policy.

    Variants: ``ASYNC`` replaces the online softmax by FlashDecoding++'s unified max ``phi2``
    (`_async_split`: ``WINDOW_*``, ``ASYNC_LANES``, ``FALLBACK``, ``TRACK_FALLBACKS`` are its
    knobs, ``Fallbacks`` its optional output); ``FUSED_MERGE`` makes the last program of
    ``(b, kv_h)`` merge the partials into ``Out``/``OutLse`` (`_merge_if_last`, with the
    arrival counter at ``Counters[b, kv_h]``).

    ``PDL`` (Chapter 10's fused decode step on Hopper): launched as a programmatic dependent
    launch, the program waits for the kernel before it (which wrote q and the new token's K/V)
    before it reads anything, then lets the kernel after it launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b, kv_h, split = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    num_splits = tl.num_programs(2)

    # The group's query heads are the rows of every dot (Chapter 5's decode kernel).
    offs_g = tl.arange(0, GROUP_PAD)
    in_g = offs_g < group_size
    heads = kv_h * group_size + tl.minimum(offs_g, group_size - 1)  # padding rows: clamped, never stored
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=in_g[:, None] & d_ok, other=0.0)

    # This split's keys, whole tiles of the sequence's own (clamped) length.
    seq_len = tl.minimum(tl.maximum(tl.load(SeqLens + b * stride_sl), 0), max_blocks * block_size)
    lo, full_hi, hi = _split_bounds(seq_len, split, num_splits, BLOCK_N)
    table = BlockTables + b * stride_tb
    k_head = K + kv_h * stride_kh + offs_d[None, :] * stride_kd
    v_head = V + kv_h * stride_vh + offs_d[None, :] * stride_vd
    offs_n0 = tl.arange(0, BLOCK_N)
    col0 = (kv_h * HEAD_DIM).to(tl.int32)  # this head's first column in the descriptors' [.., kv_heads·head_dim]

    if ASYNC:  # variant: FlashDecoding++'s asynchronized softmax (below)
        acc, l, m = _async_split(q, k_head, v_head, DescK, DescV, col0, table, stride_tn, stride_kb, stride_ko,
                                 stride_vb, stride_vo, in_g, offs_n0, d_ok, lo, full_hi, hi, seq_len, block_size,
                                 num_blocks, qk_scale, phi2,
                                 Fallbacks + b * stride_fb + kv_h * stride_fh + split * stride_fs,
                                 BLOCKS_PER_TILE, DOT_PRECISION, GROUP_PAD, BLOCK_D, BLOCK_N,
                                 WINDOW_LO, WINDOW_HI, TRACK_FALLBACKS, ASYNC_LANES, FALLBACK, TMA, KV_EVICT)
    else:
        acc, l, m = _exact_split(q, k_head, v_head, DescK, DescV, col0, table, stride_tn, stride_kb, stride_ko,
                                 stride_vb, stride_vo, offs_n0, d_ok, lo, full_hi, hi, seq_len, block_size,
                                 num_blocks, qk_scale, BLOCKS_PER_TILE, DOT_PRECISION, GROUP_PAD, BLOCK_D,
                                 BLOCK_N, TMA, KV_EVICT)

    # The partial: o_s = acc / l and lse_s = m + log l. An empty split: l = 0 -> o = 0 and
    # lse = log2(0) = -inf (m is -inf or φ; either way -inf), which stage 2 weighs 0.
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    lse = (m + tl.math.log2(l)) * LN2_C
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=in_g[:, None] & d_ok)
    tl.store(LSE + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=in_g)

    if FUSED_MERGE:  # variant: one launch, the last of the S programs merges (below)
        _merge_if_last(O + b * stride_ob, LSE + b * stride_lb, Out + b * stride_outb, OutLse + b * stride_olb,
                       Counters + b * stride_cb + kv_h * stride_ch, kv_h * group_size, group_size, num_splits,
                       stride_oh, stride_os, stride_od, stride_lh, stride_ls, stride_outh, stride_outd, stride_olh,
                       offs_d, d_ok, MERGE_ROWS, MERGE_BLOCK_S)


# ----------------------------------------------------------------------------------------
# Stage 2: merge the splits of one (sequence, query head)
# ----------------------------------------------------------------------------------------
@triton.jit
def _merge_rows(o_rows, lse_rows, stride_ph, stride_ps, stride_pd, stride_qh, stride_qs, n_rows, num_splits,
                offs_d, d_ok, ROWS: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Merge the ``num_splits`` partials of ``n_rows <= ROWS`` query heads of one sequence:
    head ``r``'s split ``s`` is ``o_rows + r·stride_ph + s·stride_ps + d·stride_pd`` and
    ``lse_rows + r·stride_qh + s·stride_qs`` (fp32, natural log). Returns ``(out, lse)``,
    ``[ROWS, BLOCK_D]`` and ``[ROWS]`` fp32: ``out = Σ_s w_s o_s / Σ_s w_s`` and ``lse = M +
    log Σ_s w_s`` with ``w_s = e^{lse_s − M}``, ``M = max_s lse_s``, ``BLOCK_S`` splits of all
    rows at a time (``[ROWS, BLOCK_S, BLOCK_D]`` tiles: the rows' loads are independent, so
    merging a GQA group costs one row's latency, not ``group`` of them).

    Two passes over the lse (``S`` floats a row, from cache the second time), one over the
    outputs. An empty split's output is not even read (its weight is 0; masked load); padding
    rows get ``out = 0``, ``lse = −∞`` (the caller does not store them). ``CACHE``: the loads'
    cache modifier: ``""`` in stage 2 (a later launch: every partial is visible), ``".cg"``
    (cache in L2 only, i.e. bypass L1) when stage 1's last program merges partials other
    programs wrote during the same launch."""
    offs_r = tl.arange(0, ROWS)
    r_ok = (offs_r < n_rows)[:, None]
    offs_s0 = tl.arange(0, BLOCK_S)
    lse_base = lse_rows + offs_r[:, None] * stride_qh
    m_lanes = tl.full((ROWS, BLOCK_S), float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + offs_s0
        m_lanes = tl.maximum(m_lanes, tl.load(lse_base + offs_s[None, :] * stride_qs,
                                              mask=r_ok & (offs_s < num_splits)[None, :], other=float("-inf"),
                                              cache_modifier=CACHE))
    m = tl.max(m_lanes, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights e^{-inf} = 0, no NaN

    o_base = o_rows + offs_r[:, None, None] * stride_ph + offs_d[None, None, :] * stride_pd
    acc = tl.zeros((ROWS, offs_d.shape[0]), dtype=tl.float32)
    w_lanes = tl.zeros((ROWS, BLOCK_S), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + offs_s0
        lse_s = tl.load(lse_base + offs_s[None, :] * stride_qs, mask=r_ok & (offs_s < num_splits)[None, :],
                        other=float("-inf"), cache_modifier=CACHE)
        w = tl.math.exp2((lse_s - m[:, None]) * LOG2E_C)  # e^{lse_s - M}, in (0, 1]; 0 when empty
        o_s = tl.load(o_base + offs_s[None, :, None] * stride_ps,
                      mask=(lse_s > float("-inf"))[:, :, None] & d_ok[None, :, :], other=0.0,
                      cache_modifier=CACHE)
        acc += tl.sum(w[:, :, None] * o_s, axis=1)
        w_lanes += w
    w_sum = tl.sum(w_lanes, axis=1)
    out = acc / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]
    return out, m + tl.math.log2(w_sum) * LN2_C


@triton.jit
def _merge_splits_kernel(
    OP, LP, O, LSE, num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_qb, stride_qh, stride_qs,
    stride_ob, stride_oh, stride_od,
    stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program ``(b, h)``: `_merge_rows` over the partials ``OP[b, h, :, :]`` and ``LP[b, h, :]``
    into ``O[b, h, :]`` and ``LSE[b, h]`` (the two-launch path; `_split_kernel` with
    ``FUSED_MERGE`` runs the same merge in its last program instead). ``PDL``: launched as a
    programmatic dependent launch, the program waits for the kernel that wrote the partials."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    out, lse = _merge_rows(OP + b * stride_pb + h * stride_ph, LP + b * stride_qb + h * stride_qh, 0, stride_ps,
                           stride_pd, 0, stride_qs, 1, num_splits, offs_d, d_ok, 1, BLOCK_S, "")
    # (Not `offs_d < HEAD_DIM`: the padding columns' offsets are clamped onto the last real one.)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM)
    tl.store(LSE + b * stride_lb + h * stride_lh + tl.arange(0, 1), lse)


# ----------------------------------------------------------------------------------------
# Variant 1: FlashDecoding++'s asynchronized softmax (``phi=``)
#
# The online softmax pays per tile for a row max (a cross-lane reduction) and for rescaling
# the accumulator by 2^(m_old - m_new), and it makes the splits' partials need rescaling
# against each other. FlashDecoding++ uses one *unified max* φ for every tile of every split
# instead: p = 2^(x - φ), no max, no rescale. That is only safe while 2^(x - φ) neither
# overflows nor underflows in the dtype P is rounded to for the PV dot, so each program
# checks its rows' largest score against a window around φ and, outside it, recomputes its
# split exactly (`_exact_split`, in the same kernel: no host sync). The partials are written
# as in the main path (lse_s = φ + log Σ p), so stage 2 is unchanged.
# ----------------------------------------------------------------------------------------
#: ``(lo, hi)``: with ``P`` rounded to fp16 for the PV dot, each row's largest ``2^(x − φ)``
#: (log2 units) must lie in ``[2^lo, 2^hi]``: below ``2^15`` so that ``p`` and a partial sum
#: of a few stay under fp16's 65504, above ``2^-6`` because the terms 8+ binades below it
#: become fp16 subnormals (a NumPy simulation of fp16-rounded P, 512-32768 keys: the same
#: error as exact mode down to a largest p of 2^-6, 1.9x it at 2^-8, 5.7x at 2^-10).
ASYNC_WINDOW_FP16 = (-6.0, 15.0)
#: The same for bf16 and fp32 ``P`` (fp32's exponent range, 2^-126 … 2^128): ``Σ p`` and
#: ``Σ p·v`` stay finite over 2^17 keys with ``|v|`` up to 2^20 (2^60 · 2^17 · 2^20 = 2^97),
#: and the terms within fp32's 24 bits of the largest ``p`` stay normal numbers.
ASYNC_WINDOW_WIDE = (-60.0, 60.0)


def async_window(dtype: torch.dtype) -> tuple[float, float]:
    """The safe window of ``max(x) − φ`` in log2 units (binades) for a cache of ``dtype``
    (``P`` is rounded to it for the PV dot)."""
    return ASYNC_WINDOW_FP16 if dtype == torch.float16 else ASYNC_WINDOW_WIDE


@triton.jit
def _async_tiles(acc, l_run, x_max, q, k_head, v_head, table, stride_tn, stride_kb, stride_ko, stride_vb,
                 stride_vo, offs_n0, d_ok, lo, hi, seq_len, block_size, num_blocks, qk_scale, phi2,
                 MASKED: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_N: tl.constexpr, LANES: tl.constexpr):
    """Key tiles ``[lo, hi)`` with the unified max ``phi2`` (log2 units): ``p = 2^(x − φ)``.

    No running max and no rescale: ``acc`` accumulates ``p·v``. ``l_run`` and ``x_max`` are
    the running sum of ``p`` and the running max of the scores (the max only checks the
    window). ``LANES``: they are ``[GROUP_PAD, BLOCK_N]`` register tiles, updated elementwise
    and reduced once by the caller (no reduction in the loop at all); else ``[GROUP_PAD]``
    rows, updated with one ``tl.sum``/``tl.max`` per tile. ``MASKED``: positions ``>=
    seq_len`` may occur (the last tile): they score ``−inf``, so ``p = 0``."""
    for start in range(lo, hi, BLOCK_N):
        k_rows, v_rows, row_ok = tile_rows(table, stride_tn, start, offs_n0, seq_len, block_size, num_blocks,
                                           stride_kb, stride_ko, stride_vb, stride_vo, BLOCKS_PER_TILE, MASKED,
                                           BLOCK_N)
        kv_ok = row_ok[:, None] & d_ok
        k = tl.load(k_head + k_rows[:, None], mask=kv_ok, other=0.0)
        x = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 units
        if MASKED:
            x = tl.where((start + offs_n0 < seq_len)[None, :], x, float("-inf"))
        p = tl.math.exp2(x - phi2)
        if LANES:
            x_max = tl.maximum(x_max, x)
            l_run += p
        else:
            x_max = tl.maximum(x_max, tl.max(x, axis=1))
            l_run += tl.sum(p, axis=1)
        v = tl.load(v_head + v_rows[:, None], mask=kv_ok, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_run, x_max


@triton.jit
def _async_split(q, k_head, v_head, desc_k, desc_v, col0, table, stride_tn, stride_kb, stride_ko, stride_vb,
                 stride_vo, in_g, offs_n0, d_ok, lo, full_hi, hi, seq_len, block_size, num_blocks,
                 qk_scale, phi2, fallback_flag,
                 BLOCKS_PER_TILE: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_PAD: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW_LO: tl.constexpr, WINDOW_HI: tl.constexpr,
                 TRACK_FALLBACKS: tl.constexpr, ASYNC_LANES: tl.constexpr, FALLBACK: tl.constexpr,
                 TMA: tl.constexpr, KV_EVICT: tl.constexpr):
    """`_exact_split`'s ``(acc, l, m)`` with the unified max: ``m = φ`` for every row, unless a
    real row's largest score left ``[φ + WINDOW_LO, φ + WINDOW_HI]``: then (with ``FALLBACK``)
    the split is recomputed exactly, reading its K/V a second time. ``TRACK_FALLBACKS``: store
    1 (fell back) or 0 at ``fallback_flag``. (``FALLBACK=False`` only measures the fallback's
    cost: a split outside the window is then wrong.)"""
    acc = tl.zeros((GROUP_PAD, BLOCK_D), dtype=tl.float32)
    if ASYNC_LANES:
        l_run = tl.zeros((GROUP_PAD, BLOCK_N), dtype=tl.float32)
        x_max = tl.full((GROUP_PAD, BLOCK_N), float("-inf"), dtype=tl.float32)
    else:
        l_run = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        x_max = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    acc, l_run, x_max = _async_tiles(acc, l_run, x_max, q, k_head, v_head, table, stride_tn, stride_kb,
                                     stride_ko, stride_vb, stride_vo, offs_n0, d_ok, lo, full_hi, seq_len,
                                     block_size, num_blocks, qk_scale, phi2, False, BLOCKS_PER_TILE,
                                     DOT_PRECISION, BLOCK_N, ASYNC_LANES)
    acc, l_run, x_max = _async_tiles(acc, l_run, x_max, q, k_head, v_head, table, stride_tn, stride_kb,
                                     stride_ko, stride_vb, stride_vo, offs_n0, d_ok, full_hi, hi, seq_len,
                                     block_size, num_blocks, qk_scale, phi2, True, BLOCKS_PER_TILE,
                                     DOT_PRECISION, BLOCK_N, ASYNC_LANES)
    if ASYNC_LANES:
        l = tl.sum(l_run, axis=1)
        row_max = tl.max(x_max, axis=1)
    else:
        l = l_run
        row_max = x_max
    m = tl.zeros((GROUP_PAD,), dtype=tl.float32) + phi2
    # The window check, once per program: how far each real row's largest score lies from φ.
    offset = row_max - phi2
    outside = in_g & ((offset < WINDOW_LO) | (offset > WINDOW_HI))
    fell_back = (hi > lo) & (tl.max(outside.to(tl.int32), axis=0) > 0)
    if FALLBACK:
        if fell_back:  # recompute this split exactly (its K/V are read a second time)
            acc, l, m = _exact_split(q, k_head, v_head, desc_k, desc_v, col0, table, stride_tn, stride_kb,
                                     stride_ko, stride_vb, stride_vo, offs_n0, d_ok, lo, full_hi, hi, seq_len,
                                     block_size, num_blocks, qk_scale, BLOCKS_PER_TILE, DOT_PRECISION,
                                     GROUP_PAD, BLOCK_D, BLOCK_N, TMA, KV_EVICT)
    if TRACK_FALLBACKS:
        tl.store(fallback_flag, fell_back.to(tl.int32))
    return acc, l, m


# ----------------------------------------------------------------------------------------
# Variant 2: one launch, the last program merges (``FUSED_MERGE``, the default)
#
# Stage 2 as a second kernel costs a launch (tens of µs of host time), about as long as a
# whole small decode step on the GPU. Instead each (sequence, KV head) has an int32 arrival
# counter (`split_counters`); a program writes its partials, then adds 1; the one that reads
# back S − 1 is the last, so every partial of the group is written: it merges them (stage 2's
# `_merge_rows`, the group's query heads at once) and puts the counter back to 0 (no clearing
# between calls; works inside a CUDA graph). No program waits for another.
# ----------------------------------------------------------------------------------------
@triton.jit
def _merge_if_last(O_b, LSE_b, Out_b, OutLse_b, counter, h0, group_size, num_splits,
                   stride_oh, stride_os, stride_od, stride_lh, stride_ls, stride_outh, stride_outd, stride_olh,
                   offs_d, d_ok, MERGE_ROWS: tl.constexpr, MERGE_BLOCK_S: tl.constexpr):
    """Count this program in at ``counter``; if it is the last of the ``num_splits`` to arrive,
    merge the partials of query heads ``h0 … h0 + group_size − 1`` (``O_b``, ``LSE_b``: the
    sequence's partials) into ``Out_b``/``OutLse_b`` (the sequence's final output and lse)."""
    # Memory ordering: the barrier orders every thread's partial stores before the atomic,
    # whose release half (acq_rel, gpu scope; cumulative) publishes them GPU-wide before the
    # count; the program that sees S - 1 has, by the acquire half, every other program's
    # release before it, so their partials are in L2 when it reads them, bypassing its own
    # (incoherent) L1 with `.cg`. Under the interpreter programs run in order: the last merges.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:  # the last of the S programs of (b, kv_h): merge the group
        o_g, lse_g = _merge_rows(O_b + h0 * stride_oh, LSE_b + h0 * stride_lh, stride_oh, stride_os, stride_od,
                                 stride_lh, stride_ls, group_size, num_splits, offs_d, d_ok, MERGE_ROWS,
                                 MERGE_BLOCK_S, ".cg")
        offs_r = tl.arange(0, MERGE_ROWS)
        r_ok = offs_r < group_size
        tl.store(Out_b + (h0 + offs_r[:, None]) * stride_outh + offs_d[None, :] * stride_outd,
                 o_g.to(Out_b.dtype.element_ty), mask=r_ok[:, None] & d_ok)
        tl.store(OutLse_b + (h0 + offs_r) * stride_olh, lse_g, mask=r_ok)
        # Back to zero for the next call (which a later launch on the stream, or the next
        # replay of a CUDA graph, orders after this one).
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


# ----------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------
#: Warps and pipeline stages of stage 1 (``BLOCK_N = 128``, `decode_block_n`). Chosen on the
#: H200 by `bench.ch07_tune_flash_decoding` (bf16, head dim 128, CUDA-graph times at the best S of
#: six points from batch 1 x 8 KV heads x 4k to batch 32 x 8 x 32k; BLOCK_N 64/128 x warps 4/8
#: x stages 2/3/4). For the exact softmax 4 and 8 warps are within 1-3 % of each other (4
#: warps: 11.2 against 11.9 µs at 1 x 8 x 4k, 0.135 against 0.136 ms at 1 x 8 x 128k, 0.969
#: against 0.985 ms at 32 x 8 x 32k); BLOCK_N = 64 is 5-15 % slower with 8 warps and at best
#: equal with 4. What decides is the asynchronized softmax: with 8 warps its kernel needs 167
#: registers a thread against the exact one's 92 (the fallback loop is compiled into it), so
#: one program fits per SM instead of two and it ran 13-25 % slower; with 4 warps both kernels
#: need 207-211 registers, two programs per SM, and async ran at 1.00-1.10x the exact speed.
#: Stages: 2 and 3 tie at small points; 2 lost 5-10 % at some (batch 8 x 8, S = 8), so 3.
SPLIT_WARPS, SPLIT_STAGES = 4, 3
#: Bulk (TMA) loads of whole K/V tiles on sm_90 where the pool allows them (`tma_applies`),
#: by default? ``"captured"``: when the launch is being captured into a CUDA graph, pointer
#: loads otherwise (True/False: always/never; ``config={"TMA": ...}`` decides one call).
#: Measured on an H100 (bf16, head dim 128, one block per sequence, `bench.ch07_tune_flash_decoding
#: hopper2` and the benchmark's ``loads`` rows), bulk copies save GPU time where a call is
#: short (CUDA-graph times over 4 copies of the cache: 14.9 -> 14.0 us at batch 1 x 8 KV
#: heads x 4k, 31.0 -> 29.7 us at 1 x 32 x 4k, 52.4 -> 51.9 at 8 x 8 x 4k) and nothing where
#: bandwidth decides (1 x 8 x 32k: 54.0 -> 53.6 us; 8 x 8 x 32k: 354.8 -> 355.0 us). Their
#: price is host time: Triton's launcher encodes both descriptors at every launch, 20-50 us
#: of CPU per eager call, more than the GPU time saved. A graph pays it once, at capture (the
#: encoded ``CUtensorMap`` is a kernel parameter, kept by value), and an engine's decode step
#: is a graph: there the saving is free. A 16-token paged pool cannot use them at all (a tile
#: is 8 blocks, not one box).
TMA_ON_HOPPER = "captured"
#: The eviction policy of stage 1's pointer loads of K and V (``""``: the default policy;
#: ``"evict_first"``: K/V are read once per step, let them leave L2 first). None: on the H100
#: ``evict_first`` changed no point of the benchmark's ``loads`` rows by more than 0.8 %
#: (the L2 is 50 MB, and a decode step streams each byte once either way).
KV_EVICT = ""
#: Stage 1's launch options (``config`` of `flash_decode_attention` overrides them, for measurements):
#: warps, pipeline stages, ``ASYNC_LANES`` (the asynchronized softmax's running sum and max
#: as ``[group, BLOCK_N]`` lane tiles instead of per-tile row reductions) and ``FALLBACK``
#: (compile the in-kernel exact fallback; False is for measuring its cost only: a split
#: outside the window is then wrong).
_STAGE1_DEFAULTS = dict(num_warps=SPLIT_WARPS, num_stages=SPLIT_STAGES, ASYNC_LANES=False, FALLBACK=True,
                        TMA=False, KV_EVICT=KV_EVICT)

#: Merge the splits inside stage 1 (its last program per (sequence, KV head); one launch) by
#: default, instead of in a second launch (`reduce_splits`): `_merge_if_last`.
FUSED_MERGE = True

#: Splits merged per step by stage 2 (``[BLOCK_S, head_dim]`` fp32 tiles; 16 x 128 is 8 KB).
MERGE_BLOCK_S = 16
#: The one-launch merge's tile is ``[group, BLOCK_S, head_dim]`` (all of a GQA group's query
#: heads at once): at most this many (head, split) rows per step (64 x 128 fp32 = 32 KB, 64
#: registers a thread at 4 warps).
MERGE_TILE_ROWS = 64
MERGE_WARPS = 4


# ----------------------------------------------------------------------------------------
# How many splits (plain Python)
# ----------------------------------------------------------------------------------------
#: Stage-1 programs resident per SM, the size of one wave `num_splits_heuristic` fills. On
#: the H200 (bf16, head dim 128, ``BLOCK_N = 128``, 4 warps, 3 stages) a program uses 207-211
#: registers per thread and 73.7 KB of shared memory: 128 x 211 = 27k of an SM's 64k
#: registers, so two programs fit per SM (shared memory would allow three). The split sweep
#: of `bench.ch07_tune_flash_decoding` (L = 32k, CUDA-graph times) shows the wave at work: every
#: batch x heads is fastest at the S that gives 256-264 programs and clearly slower just past
#: it: batch 1 x 8 KV heads 0.044 ms at S = 32 (256 programs, 72 % of copy bandwidth), 0.048 at
#: 24, 0.051 at 48; 1 x 32: 0.132 at S = 8 (256), 0.172 at 10 (320); 8 x 8: 0.255 at S = 4,
#: 0.332 at 5 (320: 2.4 waves, the old heuristic's pick), 0.257 at 8 (512, two whole waves);
#: 16 x 8: 0.497 at S = 2, 0.567 at 3. One full wave of resident programs, not "more programs".
SPLIT_PROGRAMS_PER_SM = 2
#: The shortest split `num_splits_heuristic` makes, in tiles of ``BLOCK_N`` keys. The
#: workspace is not what limits it: a split writes and stage 2 reads ``2·(head_dim + 1)·4``
#: bytes per query head, against ``2·BLOCK_N·head_dim·elem`` bytes of K/V per tile and KV
#: head, i.e. ``≈ 4·group / (tiles·BLOCK_N·elem)`` of the traffic. On the H200 at batch 1,
#: 8 KV heads, 4k tokens (32 tiles of 128), CUDA-graph times: S = 4 (8 tiles each) 18.0 µs,
#: S = 8 (4 tiles) 12.5 µs, S = 16 (2 tiles) 11.2 µs, S = 32 (1 tile) 11.9 µs: two tiles per
#: split is where splitting further stops paying.
MIN_TILES_PER_SPLIT = 2
#: The most splits any rule picks (FlashAttention-2's limit too): beyond it, stage 2's
#: per-row work grows and no GPU has that many SMs per sequence to feed.
MAX_SPLITS = 128
#: vLLM's PagedAttention V2 partition: 512 tokens per split. (`num_sms`, `CPU_NUM_SMS`: from
#: `minillm.kernels.base`, shared with Chapter 8.)
VLLM_PARTITION = 512


def num_splits_heuristic(batch: int, kv_heads: int, max_seq_len: int, num_sms: int, block_n: int) -> int:
    """Splits per sequence for a decode step (ours; the default of `flash_decode_attention`).

    Unsplit, the kernel runs ``batch · kv_heads`` programs, and ``SPLIT_PROGRAMS_PER_SM ·
    num_sms`` of them fit on the GPU at once (one *wave*). Split each sequence into as many
    pieces as still fit in that one wave, ``⌊wave / (batch · kv_heads)⌋``: every SM gets its
    full complement of programs, all of the same length, and no program is left for a second,
    mostly empty wave (a wave and a bit costs nearly two waves of short programs: on the H200
    320 programs, 2.4 waves of 132, ran 30 % slower than 256). Then at most one split per
    `MIN_TILES_PER_SPLIT` tiles of ``block_n`` keys of the longest sequence (``max_seq_len``)
    and at most `MAX_SPLITS`. Returns 1 (no stage 2) when the batch alone fills a wave or the
    sequences are too short to split.
    """
    base = max(1, batch * kv_heads)
    fits = SPLIT_PROGRAMS_PER_SM * num_sms // base
    tiles = -(-max(0, max_seq_len) // block_n)
    return max(1, min(fits, tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def fa2_num_splits(batch_heads: int, n_blocks: int, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """FlashAttention-2's split rule (``num_splits_heuristic`` in ``csrc/flash_attn/flash_api.cpp``).

    - ``batch_heads``: programs without splitting (``batch · heads · m_blocks``; for decode
      with GQA, FlashAttention-2 packs a group's query heads into the rows of one program, so
      ``batch · kv_heads``);
    - ``n_blocks``: key blocks of the longest sequence (``⌈L / 128⌉`` at head dim 128);
    - ``num_sms``: program slots per wave. FlashAttention-2 (since 2.5) passes **twice** the
      SM count (two 128-thread programs fit per SM); the benchmark does the same.

    If ``batch_heads`` already fills 80 % of the slots: 1. Otherwise, for each split count
    ``s = 1 … min(max_splits, num_sms, n_blocks)`` the *wave efficiency* is ``w / ⌈w⌉`` with
    ``w = batch_heads · s / num_sms`` waves (the occupied fraction of the last wave); split
    counts that give the same blocks per split as ``s − 1`` are skipped (e.g. 64 blocks in 11
    or 12 splits are both 6 per split: the 12th would be empty). The answer is the smallest
    ``s`` whose efficiency is at least 0.85 of the best one: fewer splits, less merging.

    The arithmetic is single precision, as in the C++ (``float n_waves``, ``0.8f``; the 0.85
    product is in double): ties with 0.85 · best are exact in real numbers for some inputs
    (41 programs, 40 blocks, 100 slots: 0.82 against 0.85 · 16.4/17), and float and double
    rounding decide them differently (7 splits here; 2 in double).
    """
    f32 = np.float32
    if f32(batch_heads) >= f32(0.8) * f32(num_sms):
        return 1
    max_splits = min(max_splits, num_sms, n_blocks)

    def eligible(s: int) -> bool:
        return s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))

    efficiency = {}
    for s in range(1, max_splits + 1):
        if eligible(s):
            waves = f32(batch_heads * s) / f32(num_sms)
            efficiency[s] = waves / f32(math.ceil(waves))
    best = max(efficiency.values(), default=f32(0))
    for s, eff in efficiency.items():  # in increasing s
        if float(eff) >= 0.85 * float(best):
            return s
    return 1


def partition_splits(max_seq_len: int, partition: int = VLLM_PARTITION) -> int:
    """Fixed-size partitions (vLLM's PagedAttention V2 uses 512 tokens): ``⌈max_seq_len /
    partition⌉`` splits, at least 1, whatever the batch."""
    if partition < 1:
        raise ValueError(f"partition must be >= 1, got {partition}")
    return max(1, -(-max(0, max_seq_len) // partition))


# ----------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------
def split_workspace(batch: int, q_heads: int, num_splits: int, head_dim: int, device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials stage 1 writes and stage 2 reads: ``(o_part, lse_part)``, fp32,
    ``[batch, q_heads, num_splits, head_dim]`` and ``[batch, q_heads, num_splits]``, both
    contiguous views of one allocation (one allocator call instead of two)."""
    n_o = batch * q_heads * num_splits * head_dim
    buf = torch.empty(n_o + batch * q_heads * num_splits, device=device, dtype=torch.float32)
    return buf[:n_o].view(batch, q_heads, num_splits, head_dim), buf[n_o:].view(batch, q_heads, num_splits)


#: ``(device, batch, q_heads, S, head_dim) -> (o_part, lse_part)``: the workspaces
#: `flash_decode_attention` reuses when the caller gives none (`cached_workspace`).
_WORKSPACES: dict[tuple, tuple[torch.Tensor, ...] | torch.Tensor] = {}
#: Shapes kept in `_WORKSPACES` before it is emptied (an engine's batch size changes from
#: step to step; each entry is ``batch · q_heads · S · (head_dim + 1) · 4`` bytes, 0.5 MB at
#: batch 1 with 32 heads and 33 splits).
WORKSPACE_CACHE_SIZE = 64


def workspace_cache() -> dict[tuple, tuple[torch.Tensor, ...] | torch.Tensor]:
    """A snapshot (a new dict, the same tensors) of the workspaces kept for reuse: ``(device,
    batch, q_heads, S, head_dim) -> (o_part, lse_part, counters)`` and ``("counters", device,
    batch, q_heads) -> counters``. A CUDA-graph runner holds on to them (their addresses are
    baked into its graphs); tests inspect them."""
    return dict(_WORKSPACES)


def clear_workspace_cache() -> None:
    """Forget every kept workspace (the next call of each shape allocates afresh)."""
    _WORKSPACES.clear()


def split_counters(batch: int, q_heads: int, device) -> torch.Tensor:
    """The arrival counters of the one-launch merge (``FUSED_MERGE``): int32 ``[batch,
    q_heads]``, zero (entry ``[b, kv_h]`` counts the finished splits of sequence ``b``, KV
    head ``kv_h``; ``q_heads`` columns so that one buffer serves any number of KV heads). The
    kernel leaves them zero again after every call."""
    return torch.zeros(batch, q_heads, device=device, dtype=torch.int32)


def _same_device(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` and ``cuda:0`` are one key of `_WORKSPACES` (a caller
    that names the device without an index finds the buffers the kernels use)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _reused(key: tuple, device, make):
    """``_WORKSPACES[key]``, made by ``make()`` on first use: the buffers `flash_decode_attention`
    reuses across calls when the caller gives none. Nothing is kept while a CUDA graph is being
    captured: memory allocated during capture belongs to the graph's private pool (and a zero
    fill is captured with the graph, so every replay starts from zero)."""
    buf = _WORKSPACES.get(key)  # the key as the caller gave it (a decode loop's: the same each step)
    if buf is not None:
        return buf
    given, key = key, tuple(_same_device(k) if isinstance(k, torch.device) else k for k in key)
    buf = _WORKSPACES.get(key)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if buf is None:
        with unrecorded():  # made once for later calls, which leave it as they found it
            buf = make()
    if not capturing:
        if len(_WORKSPACES) >= WORKSPACE_CACHE_SIZE - 1:
            _WORKSPACES.clear()
        _WORKSPACES[key] = buf
        if given != key:  # e.g. "cuda" for "cuda:0": one buffer under both spellings of the device
            _WORKSPACES[given] = buf
    return buf


def cached_workspace(batch: int, q_heads: int, num_splits: int, head_dim: int, device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o_part, lse_part, counters)`` reused across calls of one shape on one device (`_reused`).

    Allocating them per call cost a few microseconds of the ~15-50 µs a small decode step takes
    (it is host time: at batch 1 and 4k tokens the GPU work is ~14 µs). Reuse is safe for calls
    ordered on one stream, which is how a decode loop runs: the next call's stage 1 cannot
    overwrite the partials before this call's merge has read them. Callers that run decode
    steps of the same shape concurrently on several streams must pass their own workspaces
    (``workspace`` of `flash_decode_attention`)."""
    return _reused((device, batch, q_heads, num_splits, head_dim), device,
                   lambda: (*split_workspace(batch, q_heads, num_splits, head_dim, device),
                            cached_counters(batch, q_heads, device)))


def cached_empty_workspace(batch: int, q_heads: int, num_splits: int, head_dim: int, device, empty_bits: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_workspace` with every slot holding the fp32 whose bits are ``empty_bits``, reused
    across calls (`_reused`, kept apart from `cached_workspace`'s): for a merge that waits until
    a slot no longer holds the marker and writes it back once read (the Gluon kernel's
    ``merge="poll"``), so that every call finds the workspace as the first one did."""
    def make():
        o_part, lse_part = split_workspace(batch, q_heads, num_splits, head_dim, device)
        o_part.view(torch.int32).fill_(empty_bits)
        lse_part.view(torch.int32).fill_(empty_bits)
        return o_part, lse_part
    return _reused((device, "empty", empty_bits, batch, q_heads, num_splits, head_dim), device, make)


def cached_counters(batch: int, q_heads: int, device, purpose: str = "arrivals") -> torch.Tensor:
    """`split_counters` reused across calls (`_reused`, key ``("counters", device, batch, q_heads)``);
    one buffer serves every split count. Another ``purpose`` has a buffer of its own (key
    ``(purpose, device, batch, q_heads)``; the Gluon kernel's ``"claims"``: the next tile of each
    unit, beside the arrivals)."""
    key = ("counters" if purpose == "arrivals" else purpose, device, batch, q_heads)
    return _reused(key, device, lambda: split_counters(batch, q_heads, device))


def flash_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None, *,
                           num_splits: int | None = None, max_seq_len: int | None = None, phi: float | None = None,
                           out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                           block_n: int | None = None, tile_in_block: bool | None = None,
                           workspace: tuple[torch.Tensor, ...] | None = None,
                           fallbacks: torch.Tensor | None = None, config: dict | None = None,
                           fused_merge: bool | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query per sequence over its paged K/V cache, each sequence split
    over ``num_splits`` programs per KV head (flash-decoding).

    The contract of `paged_decode_attention`:

    - ``q: [batch, q_heads, head_dim]``; ``k_cache, v_cache: [num_blocks, block_size,
      kv_heads, head_dim]`` (one dtype with q: fp16, bf16 or fp32; any block size >= 1;
      ``q_heads % kv_heads == 0``); ``block_tables: [batch, max_blocks]`` int32 (int64
      accepted), -1 past each length; ``seq_lens: [batch]`` integers, clamped to
      ``[0, max_blocks · block_size]``; a table entry that is not a valid block reads as zeros;
    - ``scale`` defaults to ``1/sqrt(head_dim)``.

    And:

    - ``num_splits``: splits per sequence; ``None`` picks `num_splits_heuristic` for this
      device, an int forces it (any ``>= 1``; more splits than tiles leaves some empty);
    - ``max_seq_len``: a Python int bounding ``seq_lens`` (default ``max_blocks · block_size``),
      used only to choose ``num_splits`` without reading the lengths from the device; the
      splits themselves are sized per sequence in the kernel, so a loose bound is harmless;
    - ``phi``: FlashDecoding++'s unified max, in natural-log units of the scaled score
      ``q·k·scale``; ``None`` is the exact online softmax. With ``phi`` a split whose largest
      score per row leaves the safe window `async_window` around ``phi`` is recomputed
      exactly, inside the kernel: the result is correct for any ``phi``, only its speed
      depends on it.

    Returns ``(out, lse)``: ``out: [batch, q_heads, head_dim]`` in q's dtype and ``lse:
    [batch, q_heads]`` float32 (natural log; length 0 gives ``out = 0``, ``lse = -inf``).
    ``out``/``lse`` may be given preallocated (any strides).

    Knobs for tests and measurements (``None``, the default, picks as a caller wants):

    - ``block_n``: keys per tile (default `decode_block_n`); ``tile_in_block``: the tile path
      of `tile_rows` (True = one table entry per tile, False = the general path, None = the
      best that applies);
    - ``workspace``: ``(o_part, lse_part)`` as `split_workspace` makes them for this
      ``num_splits``, optionally with a third member, the int32 arrival counters
      (`split_counters`; else cached ones); without it a cached workspace
      (`cached_workspace`) when ``num_splits > 1``. After the call it holds the partials,
      which tests compare and the benchmark merges again with `reduce_splits`;
    - ``fused_merge``: merge the splits in stage 1's last program (one launch; True) or in
      the separate stage-2 launch (`reduce_splits`; False); None = `FUSED_MERGE`;
    - ``fallbacks``: int32 ``[batch, kv_heads, num_splits]``, written with 1 where a program
      of the asynchronized softmax fell back to the exact loop, else 0 (needs ``phi``);
    - ``config``: overrides of stage 1's launch options (`_STAGE1_DEFAULTS`: warps, stages,
      ``ASYNC_LANES``, ``FALLBACK``);
    - ``pdl``: launch stage 1 as a programmatic dependent launch (`split_attention`; Hopper
      only, for callers whose kernels before and after chain that way, as Chapter 10's).
    """
    dims, num_splits, block_n = _plan(q, k_cache, v_cache, block_tables, seq_lens, num_splits, max_seq_len, block_n)
    batch, (q_heads, head_dim) = q.shape[0], q.shape[1:]
    out, lse = decode_outputs(q, out, lse)
    if batch * q_heads == 0:
        return out, lse
    if num_splits == 1:  # nothing to merge: stage 1 writes the final output (split stride 0)
        split_attention(q, k_cache, v_cache, block_tables, seq_lens, out[:, :, None], lse[:, :, None], scale,
                        phi, block_n, tile_in_block, fallbacks, dims, config, pdl=pdl)
        return out, lse
    if workspace is None:
        workspace = cached_workspace(batch, q_heads, num_splits, head_dim, q.device)
    o_part, lse_part = workspace[:2]
    if o_part.dim() != 4 or o_part.shape[2] != num_splits:
        raise ValueError(f"workspace {tuple(o_part.shape)} was made for another number of splits than {num_splits}")
    if FUSED_MERGE if fused_merge is None else fused_merge:
        counters = workspace[2] if len(workspace) > 2 else cached_counters(batch, q_heads, q.device)
        split_attention(q, k_cache, v_cache, block_tables, seq_lens, o_part, lse_part, scale, phi, block_n,
                        tile_in_block, fallbacks, dims, config, merge_into=(out, lse, counters), pdl=pdl)
    else:
        split_attention(q, k_cache, v_cache, block_tables, seq_lens, o_part, lse_part, scale, phi, block_n,
                        tile_in_block, fallbacks, dims, config, pdl=pdl)
        reduce_splits(o_part, lse_part, out, lse)
    return out, lse


def _plan(q, k_cache, v_cache, block_tables, seq_lens, num_splits, max_seq_len, block_n):
    """Check the inputs (`check_paged`) and pick the splits: ``(dims, num_splits, block_n)``
    with ``dims`` what `check_paged` returned."""
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got {tuple(q.shape)}")
    batch = q.shape[0]
    dims = check_paged(q, k_cache, v_cache, block_tables, seq_lens, batch)
    _, block_size, kv_heads, head_dim, _ = dims
    block_n = block_n or decode_block_n(head_dim, q.dtype)
    if num_splits is None:
        bound = block_tables.shape[1] * block_size if max_seq_len is None else int(max_seq_len)
        if bound < 0:
            raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
        num_splits = num_splits_heuristic(batch, kv_heads, bound, num_sms(q.device), block_n)
    if int(num_splits) != num_splits or num_splits < 1:
        raise ValueError(f"num_splits must be an integer >= 1, got {num_splits}")
    return dims, int(num_splits), block_n


def split_attention(q, k_cache, v_cache, block_tables, seq_lens, o_part, lse_part, scale=None, phi=None,
                    block_n=None, tile_in_block=None, fallbacks=None, dims=None, config=None, merge_into=None,
                    pdl=False):
    """Stage 1: write the partials of ``S = o_part.shape[2]`` splits per sequence, and with
    ``merge_into = (out, lse, counters)`` also merge them in the same launch (``FUSED_MERGE``:
    the last program of each (sequence, KV head) writes ``out``/``lse`` of its query heads;
    ``counters``: int32, at least ``[batch, kv_heads]``, all zero, left zero).

    ``o_part: [batch, q_heads, S, head_dim]`` (fp32 workspace, or the final output viewed
    with a split axis of 1), ``lse_part: [batch, q_heads, S]`` fp32; any strides. ``dims``:
    `check_paged`'s answer when the caller already checked the inputs (a launch is a few
    microseconds of Python; checking twice would add to it). ``pdl``: launch as a
    programmatic dependent launch (`_split_kernel`'s ``PDL``); only on a GPU that has them
    (`minillm.kernels.ch10_fused_decode.pdl_enabled`)."""
    batch = q.shape[0]
    num_blocks, block_size, kv_heads, head_dim, q_heads = dims or check_paged(q, k_cache, v_cache, block_tables,
                                                                               seq_lens, batch)
    num_splits = o_part.shape[2]
    if tuple(o_part.shape) != (batch, q_heads, num_splits, head_dim) or tuple(lse_part.shape) != (
            batch, q_heads, num_splits) or lse_part.dtype != torch.float32 or num_splits < 1:
        raise ValueError(f"workspace {tuple(o_part.shape)}, {tuple(lse_part.shape)} {lse_part.dtype} must be "
                         f"[batch, q_heads, S, head_dim] and float32 [batch, q_heads, S] for q {tuple(q.shape)}")
    scale, _ = scale_and_window(head_dim, scale, None)
    if phi is not None and not math.isfinite(phi):
        raise ValueError(f"phi must be a finite float, got {phi}")
    track = fallbacks is not None
    if track:
        if phi is None:
            raise ValueError("fallbacks are counted for the asynchronized softmax only: give phi")
        if tuple(fallbacks.shape) != (batch, kv_heads, num_splits) or fallbacks.dtype != torch.int32:
            raise ValueError(f"fallbacks must be int32 [batch, kv_heads, num_splits] = "
                             f"[{batch}, {kv_heads}, {num_splits}], got {tuple(fallbacks.shape)} {fallbacks.dtype}")
    flags = fallbacks if track else lse_part  # a placeholder pointer when not tracking (never written)
    flag_strides = fallbacks.stride() if track else (0, 0, 0)
    fused = merge_into is not None and num_splits > 1
    if fused:
        out, lse, counters = merge_into
        if tuple(out.shape) != (batch, q_heads, head_dim) or tuple(lse.shape) != (batch, q_heads):
            raise ValueError(f"out {tuple(out.shape)} / lse {tuple(lse.shape)} do not match q {tuple(q.shape)}")
        if (counters.dim() != 2 or counters.dtype != torch.int32 or counters.shape[0] < batch
                or counters.shape[1] < kv_heads):
            raise ValueError(f"counters must be int32 [>= {batch}, >= {kv_heads}], got {tuple(counters.shape)} "
                             f"{counters.dtype}")
        out_strides, lse_strides, counter_strides = out.stride(), lse.stride(), counters.stride()
    else:  # placeholders, never touched
        out, lse, counters = o_part, lse_part, seq_lens
        out_strides, lse_strides, counter_strides = (0, 0, 0), (0, 0), (0, 0)
    block_n = block_n or decode_block_n(head_dim, q.dtype)
    config = tuple(sorted(config.items())) if config else ()
    meta = _stage1_meta(head_dim, q.dtype, q_heads // kv_heads, block_size, block_n, tile_in_block, phi is not None,
                        track, fused, num_splits, config)
    if meta["BLOCKS_PER_TILE"] == 1 and "TMA" not in dict(config) and _tma_by_default(q):
        meta = _stage1_meta(head_dim, q.dtype, q_heads // kv_heads, block_size, block_n, tile_in_block,
                            phi is not None, track, fused, num_splits, (*config, ("TMA", True)))
    descriptors = None
    if meta["TMA"]:
        descriptors = kv_descriptors(k_cache, v_cache, block_n, meta["BLOCK_D"])
        if descriptors is None:  # this cache cannot be described: pointer loads
            meta = _stage1_meta(head_dim, q.dtype, q_heads // kv_heads, block_size, block_n, tile_in_block,
                                phi is not None, track, fused, num_splits, (*config, ("TMA", False)))
    args = (q, k_cache, v_cache, *(descriptors or (k_cache, v_cache)), block_tables, seq_lens, o_part, lse_part,
            flags, out, lse, counters,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), seq_lens.stride(0),
            *o_part.stride(), *lse_part.stride(), *flag_strides, *out_strides, *lse_strides, *counter_strides,
            q_heads // kv_heads, block_size, num_blocks, block_tables.shape[1], scale * LOG2E,
            0.0 if phi is None else phi * LOG2E)
    if pdl:  # the kernel's PDL switch and the launch attribute go together
        meta = {**meta, "PDL": True, "launch_pdl": True}
    return launch(_split_kernel, (batch, kv_heads, num_splits), *args, **meta)


# ----------------------------------------------------------------------------------------
# Bulk (TMA) loads on Hopper
# ----------------------------------------------------------------------------------------
def tma_applies(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, block_d_: int) -> bool:
    """Whether stage 1 can load whole K/V tiles with TMA from this pool (`_kv_tiles`).

    - an sm_90 GPU (H100/H200; the pointer path everywhere else), or the interpreter, which
      emulates descriptors so that the CPU tests run this path;
    - ``block_n`` divides the block size: every whole tile lies in one block, one box
      (16-token blocks with 128-key tiles would need 8 boxes per tile: pointer loads);
    - the pool seen as ``[num_blocks, block_size, kv_heads · head_dim]``: each token's heads
      packed (``stride(2) = head_dim``, ``stride(3) = 1``), ``head_dim`` a power of two (the box
      is ``block_d_`` columns wide and must not spill into the next head), base and strides
      16-byte aligned (the hardware's rule), coordinates within int32."""
    if k_cache.is_cuda:
        if not _is_sm90(k_cache.device.index if k_cache.device.index is not None else torch.cuda.current_device()):
            return False
    elif not interpreting():
        return False
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if block_size % block_n or head_dim != block_d_ or block_n > 256 or block_d_ > 256:
        return False
    elem = k_cache.element_size()
    for t in (k_cache, v_cache):
        if (t.stride(3) != 1 or t.stride(2) != head_dim or t.data_ptr() % 16
                or (t.stride(0) * elem) % 16 or (t.stride(1) * elem) % 16):
            return False
    return max(num_blocks + 1, block_size, kv_heads * head_dim) < 2**31


def _tma_by_default(q: torch.Tensor) -> bool:
    """Whether a call whose ``config`` does not say takes bulk loads (`TMA_ON_HOPPER`; the
    pool's own conditions are `tma_applies`'s, checked after)."""
    if TMA_ON_HOPPER != "captured":
        return bool(TMA_ON_HOPPER)
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int, block_d_: int):
    """``(desc_k, desc_v)``: host tensor descriptors of the pools seen as ``[num_blocks,
    block_size, kv_heads · head_dim]`` with boxes ``[1, block_n, block_d_]``, or None where
    `tma_applies` says no. The launch encodes each into the 128-byte ``CUtensorMap`` the
    kernel reads (a kernel parameter: a CUDA graph captures it by value)."""
    if not tma_applies(k_cache, v_cache, block_n, block_d_):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    box = [1, block_n, block_d_]
    descs = []
    for t in (k_cache, v_cache):
        shape, strides = [num_blocks, block_size, kv_heads * head_dim], [t.stride(0), t.stride(1), 1]
        if not t.is_cuda:  # the interpreter reads the tensor itself
            descs.append(TensorDescriptor(t, shape, strides, box))
            continue
        key = (t.data_ptr(), t.device.index, *shape, *strides, t.dtype, block_n, block_d_)
        descs.append(cached_descriptor(key, lambda t=t, shape=shape, strides=strides: TensorDescriptor(
            TensorAddress(t.data_ptr(), t.dtype), shape, strides, box)))
    return tuple(descs)


@functools.lru_cache(maxsize=1024)
def _stage1_meta(head_dim: int, dtype: torch.dtype, group: int, block_size: int, block_n: int,
                 tile_in_block: bool | None, is_async: bool, track: bool, fused: bool, num_splits: int,
                 config: tuple) -> dict:
    """Stage 1's compile-time parameters and launch options for one kind of call (cached: a
    decode loop asks for the same ones every step, and recomputing them was a visible part
    of a call's few microseconds of host time). ``config``: overrides, as sorted items."""
    window_lo, window_hi = async_window(dtype)
    meta = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), GROUP_PAD=max(16, power_of_2_at_least(group)),
        BLOCK_N=block_n, BLOCKS_PER_TILE=blocks_per_tile(block_size, block_n, tile_in_block),
        DOT_PRECISION=dot_precision(dtype), ASYNC=is_async, WINDOW_LO=window_lo, WINDOW_HI=window_hi,
        TRACK_FALLBACKS=track, FUSED_MERGE=fused,
        MERGE_ROWS=power_of_2_at_least(group) if fused else 1,
        MERGE_BLOCK_S=(min(MERGE_BLOCK_S, power_of_2_at_least(num_splits),
                           max(1, MERGE_TILE_ROWS // power_of_2_at_least(group))) if fused else 1),
        **{**_STAGE1_DEFAULTS, **dict(config)},
    )
    meta["TMA"] = bool(meta["TMA"]) and meta["BLOCKS_PER_TILE"] == 1  # one box per tile: one block per tile
    return meta


def reduce_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  pdl: bool = False) -> None:
    """Stage 2 alone: merge ``o_part: [batch, q_heads, S, head_dim]``, ``lse_part: [batch,
    q_heads, S]`` (fp32; an empty split has lse -inf) into ``out: [batch, q_heads, head_dim]``
    (any float dtype) and ``lse: [batch, q_heads]`` fp32 (natural log). Any strides. ``pdl``:
    a programmatic dependent launch (Hopper; scheduled before the kernel that writes the
    partials has finished, it waits for that kernel before it reads them)."""
    if o_part.dim() != 4 or tuple(lse_part.shape) != tuple(o_part.shape[:3]):
        raise ValueError(f"partials {tuple(o_part.shape)}, {tuple(lse_part.shape)} must be [batch, q_heads, S, "
                         "head_dim] and [batch, q_heads, S]")
    batch, q_heads, num_splits, head_dim = o_part.shape
    if tuple(out.shape) != (batch, q_heads, head_dim) or tuple(lse.shape) != (batch, q_heads):
        raise ValueError(f"out {tuple(out.shape)} / lse {tuple(lse.shape)} do not match the partials "
                         f"{tuple(o_part.shape)}")
    if batch * q_heads == 0:
        return
    launch(
        _merge_splits_kernel, (batch, q_heads), o_part, lse_part, out, lse, num_splits,
        *o_part.stride(), *lse_part.stride(), *out.stride(), *lse.stride(),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_S=min(MERGE_BLOCK_S, power_of_2_at_least(num_splits)),
        num_warps=MERGE_WARPS, **({"PDL": True, "launch_pdl": True} if pdl else {}),
    )
