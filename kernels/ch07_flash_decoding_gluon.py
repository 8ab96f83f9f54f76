"""Chapter 7, on Hopper, written out: flash-decoding with a loader warp and bulk copies, in Gluon.

`minillm.kernels.ch07_flash_decoding` leaves the loads to Triton: every thread of a program
computes the addresses of its share of a tile through the block table, and the pipeliner
keeps a few tiles in flight. Its bulk (TMA) path needs a tile to be one box of the pool, so
a 16-token paged pool, whose 128-key tile is 8 blocks anywhere in memory, never takes it.
This module writes the same algorithm with Gluon (the layer under Triton, see Chapter 4's
`minillm.kernels.ch04_flash_attention_gluon`), FlashAttention-3's way:

- a **loader warp** reads a tile's block-table entries in one vector load (a tile ahead) and
  issues one TMA copy per block (per 64 columns of the head) straight into the rows of a ring
  slot in shared memory: the gather a paged tile needs happens in the copy engine, with no
  addresses in registers;
- a **consumer warpgroup** runs the online softmax on ``wgmma``: the group's query heads are
  the rows of a 64-row tile (GQA 4:1 fills 4 of them; the other rows are zero and cost
  tensor-core time only, which a memory-bound loop has to spare);
- programs are **persistent**: at most one per SM, each taking work units (sequence, KV head,
  split) in turn, so the loader fetches the next unit's first tiles while the consumer
  finishes this one; the split count (`plan_splits`) is the largest that gives each program
  at most one unit, instead of the Triton kernel's "one wave of two programs per SM";
  ``schedule="claim"`` lets a unit's programs take its tiles from a shared counter as they
  go, so that a program slowed by the memory system takes fewer;
  ``schedule="line"`` instead cuts all the work (every unit's keys, in boxes of a block) into
  one equal chunk per program, from the lengths, on the GPU (stream-K's answer to the tail
  that whole units leave; measured in Chapter 7, slower except where programs are long);
  ``schedule="steal"`` keeps every split's fixed run, but a program that has finished its own
  takes tiles from the back of the slowest-looking run of its unit (work stealing);
- the splits are merged in the same launch by the last of a group's programs to finish
  (an arrival counter, as `flash_decode_attention`'s one-launch merge), by the program of its
  last split as soon as the others' partials are there (``merge="poll"``: it reads their
  slots until none holds the empty marker), or (``merge="launch"``) by a second launch,
  Chapter 7's stage 2; Chapter 7 measures the three;
- for measuring, ``timeline=`` makes every program stamp the GPU's clocks at five events of
  its work (`TIMELINE_EVENTS`; compiled in only then): Chapter 7's program-by-program view.

Scope (`gluon_decode_applies`): an sm_90 GPU, bf16, head_dim 64 or 128, any GQA group up to
64 query heads per KV head, a paged pool ``[num_blocks, block_size, kv_heads, head_dim]``
(or, ``kv_layout="HND"``, ``[num_blocks, kv_heads, block_size, head_dim]``: see `_pool_view`)
that is contiguous, with ``block_size`` a multiple of 16 that divides the tile (`BLOCK_N`
keys) or is a multiple of it. K and V sit in shared memory as tiles of 64 columns: 64 bf16
are one 128-byte row of the swizzle pattern, so a box of 16 keys lands as whole rows of a
tile (a head of 128 is two tiles side by side). The contract is `paged_decode_attention`'s:
``-1`` past each length in the table, a table entry that is not a block reads as zeros,
lengths clamped to the table's capacity.

Gluon kernels run on an NVIDIA GPU only (Triton's interpreter does not execute them): on a
CPU the tests check the planning and compile the kernel for sm_90.
"""
from __future__ import annotations

import functools
import math

import torch

from minillm.kernels.base import (  # first: it decides on Triton's interpreter before Triton is imported
    LOG2E, TensorAddress, TensorDescriptor, cached_descriptor, device_capability, fence_async_shared, launch, mbarrier,
    num_sms, power_of_2_at_least, tl, warpgroup_mma, warpgroup_mma_wait, gluon_get_index, gluon_put_index,
    gluon_tma_load as _tma_load, gluon_warps_barrier as _warps_barrier,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from minillm.kernels.ch05_paged_attention import check_paged, decode_outputs
from minillm.kernels.ch07_flash_decoding import (
    MAX_SPLITS, cached_counters, cached_empty_workspace, cached_workspace, reduce_splits,
)

__all__ = ["flash_decode_attention_gluon", "gluon_decode_applies", "plan_splits", "balanced_slots", "as_token_major",
           "to_head_major", "new_timeline", "BLOCK_N", "NUM_STAGES", "ROWS", "KV_LAYOUTS", "TIMELINE_EVENTS", "MERGES",
           "SCHEDULES", "EMPTY_SLOT_BITS", "CLAIM_FIRST", "CLAIM_SPACING", "claim_counters", "steal_words",
           "STEAL_MAX_SPLITS", "LOADER_REGS"]

#: Keys per tile, and ring slots (each a K and a V tile: 32 KB at head dim 128). Chosen on an
#: H200 (`bench.ch07_tune_flash_decoding` part ``gluon``, CUDA-graph times at six points,
#: ``bench/results/raw/nvidia-h200.ch07_tune_gluon.log``): 64-key tiles in three slots were
#: the fastest at all six; 128-key tiles ran up to 3 % slower where bandwidth decides,
#: deeper rings (4 or 6 slots of 64 keys) 1-4 % slower.
BLOCK_N = 64
NUM_STAGES = 3
#: The merge's step: at most ``MERGE_SPLITS`` splits of at most ``MERGE_ROWS`` (head, split)
#: rows at a time (64 x 128 fp32 is 64 registers a thread of the consumer warpgroup).
MERGE_SPLITS, MERGE_ROWS = 16, 64
#: With ``schedule="claim"``, the tiles each program takes as its own before it claims more;
#: and the int32s from one unit's claim counter to the next (128 bytes: a cache line each, so
#: that the claims of different units do not queue at one line of L2).
CLAIM_FIRST = 2
CLAIM_SPACING = 32
#: With ``schedule="steal"``, the most splits a unit may have: a thief looks at all of its unit's
#: runs in one vector load of the loader warp (`_richest_run`, 4 words a lane).
STEAL_MAX_SPLITS = 128
#: Registers per thread of the loader warp (``setmaxnreg``): 40 hold every schedule's loop but
#: the thieves'; with ``schedule="steal"`` ptxas spilled 72 bytes a thread at 40 and 24 at 48
#: (Triton 3.9, head dim 128), none at 56.
LOADER_REGS = {"steal": 56}
_CLAIM_SPACING = gl.constexpr(CLAIM_SPACING)
#: Rows of the query tile: one warpgroup's ``wgmma`` is 64 rows tall.
ROWS = 64
#: What a timeline (`flash_decode_attention_gluon`'s ``timeline``) records per program, in
#: this order: the consumer's start, the loader's first copies issued, the first K tile in
#: shared memory, the last piece's keys done, the program's end (its last partial stored, and
#: merged if it was the last to arrive).
TIMELINE_EVENTS = ("start", "first copy", "first tile", "keys done", "end")
_N_EVENTS = gl.constexpr(len(TIMELINE_EVENTS))
#: The bits of an fp32 NaN that arithmetic never returns (an NVIDIA GPU's NaN results are
#: 0x7fffffff): with ``merge="poll"`` a workspace slot that holds them has no partial yet.
EMPTY_SLOT_BITS = 0x7FBADBAD
_EMPTY = gl.constexpr(EMPTY_SLOT_BITS)


# ----------------------------------------------------------------------------------------
# Helpers inside the kernel
# ----------------------------------------------------------------------------------------
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _stamp(timeline, event: gl.constexpr, TIMELINE: gl.constexpr):
    """With ``TIMELINE``, this program's clocks at ``event`` (an index of `TIMELINE_EVENTS`)
    into ``timeline``'s row for it: ``[programs, 2, events]`` int64, the GPU's global timer (ns,
    one clock for all SMs) and the SM's cycle counter (finer, this SM's own)."""
    if TIMELINE:
        row = timeline + gl.program_id(0) * (2 * _N_EVENTS)
        ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        cycles = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(row + event, ns)
        gl.store(row + _N_EVENTS + event, cycles)


@gluon.jit
def _length_and_boxes(n, inside, capacity, BOX: gl.constexpr):
    """A length clamped to ``[0, capacity]`` and its boxes on the work line, ``max(⌈len /
    BOX⌉, 1)`` (an empty sequence keeps one box: its unit still writes 0 and -inf); 0 boxes
    where not ``inside`` the batch. Scalars or vectors alike."""
    n = gl.minimum(gl.maximum(n, 0), capacity)
    return n, gl.where(inside, gl.maximum(gl.cdiv(n, BOX), 1), 0)


@gluon.jit
def _sequence(seq_lens, b, batch, capacity, BOX: gl.constexpr):
    """Sequence ``b``'s length and boxes (`_length_and_boxes`); past the batch, 0 and 0."""
    inside = b < batch
    return _length_and_boxes(gl.load(seq_lens + b, mask=inside, other=0).to(gl.int32), inside, capacity, BOX)


@gluon.jit
def _scan_lengths(seq_lens, batch, capacity, kv_heads, target, BOX: gl.constexpr, WARPS: gl.constexpr):
    """One pass over the lengths, 128 at a time: the boxes of all sequences (one KV head's
    share of the work line), and the sequence ``b`` whose units hold box ``target`` of the line,
    with the boxes before it (``H · before <= target < H · (before + boxes_b)``; 0 and 0 when
    no sequence does)."""
    layout: gl.constexpr = gl.BlockedLayout([max(1, 128 // (32 * WARPS))], [32], [WARPS], [0])
    offs = gl.arange(0, 128, layout)
    total = 0
    b = 0
    before = 0
    for s0 in range(0, batch, 128):
        idx = s0 + offs
        _n, boxes = _length_and_boxes(gl.load(seq_lens + idx, mask=idx < batch, other=0).to(gl.int32),
                                      idx < batch, capacity, BOX)
        ends = gl.associative_scan(boxes, 0, _add) + total
        starts = ends - boxes
        hit = (idx < batch) & (starts * kv_heads <= target) & (target < ends * kv_heads)
        b = gl.maximum(b, gl.max(gl.where(hit, idx, 0), axis=0))
        before = gl.maximum(before, gl.max(gl.where(hit, starts, 0), axis=0))
        total += gl.sum(boxes, axis=0)
    return total, b, before


# A program's walk over its work. Two schedules (``LINE`` constexpr):
# - units: unit ``u = (b · H + kv_h) · S + split`` is split ``split`` of sequence ``b`` at KV
#   head ``kv_h`` (``⌈tiles / S⌉`` whole tiles of the sequence's own length); the program
#   takes units ``pid``, ``pid + P``, ...; state ``pos`` = the unit, ``end`` = ``B · H · S``;
# - line: the work line lists the units (sequence, KV head) as runs of boxes, ``max(⌈len /
#   BOX⌉, 1)`` each, and program ``pid`` takes boxes ``[pid · chunk, (pid + 1) · chunk)``,
#   ``chunk = ⌈line / P⌉``, unit by unit: state ``pos`` = the next box, ``end`` = the chunk's
#   end, and the current unit (``b``, ``kv_h``, its boxes ``[unit_start, unit_start +
#   unit_len)``, the sequence's length).
# `minillm.reference.ch07_flash_decoding.work_line_pieces` is the line in Python.
@gluon.jit
def _walk_start(seq_lens, batch, kv_heads, num_splits, capacity, LINE: gl.constexpr, BOX: gl.constexpr,
                WARPS: gl.constexpr):
    """The walk's first state: ``(pos, end, b, kv_h, unit_start, unit_len, seq_len, chunk)``."""
    if LINE:
        per_head, _b, _before = _scan_lengths(seq_lens, batch, capacity, kv_heads, -1, BOX, WARPS)
        total = per_head * kv_heads
        chunk = gl.cdiv(total, gl.num_programs(0))
        pos = gl.program_id(0) * chunk
        _total, b, before = _scan_lengths(seq_lens, batch, capacity, kv_heads, pos, BOX, WARPS)
        seq_len, unit_len = _sequence(seq_lens, b, batch, capacity, BOX)
        kv_h = (pos - before * kv_heads) // gl.maximum(unit_len, 1)
        return (pos, gl.minimum(pos + chunk, total), b, kv_h, before * kv_heads + kv_h * unit_len, unit_len, seq_len,
                chunk)
    else:
        return gl.program_id(0), batch * kv_heads * num_splits, 0, 0, 0, 0, 0, 0


@gluon.jit
def _walk_piece(pos, end, b, kv_h, unit_start, unit_len, seq_len, seq_lens, batch, kv_heads, num_splits, capacity,
                LINE: gl.constexpr, BOX: gl.constexpr, BLOCK_N: gl.constexpr):
    """The piece at the walk's state: ``(b, kv_h, lo, hi)``, keys ``[lo, hi)`` of sequence
    ``b`` at KV head ``kv_h`` (empty where the piece lies past the length)."""
    if LINE:
        piece_end = gl.minimum(unit_start + unit_len, end)
        return b, kv_h, (pos - unit_start) * BOX, gl.minimum((piece_end - unit_start) * BOX, seq_len)
    else:
        split = pos % num_splits
        bh = pos // num_splits
        seq_len, _boxes = _sequence(seq_lens, bh // kv_heads, batch, capacity, BOX)
        per_split = gl.cdiv(gl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
        lo = split * per_split
        return bh // kv_heads, bh % kv_heads, lo, gl.minimum(lo + per_split, seq_len)


@gluon.jit
def _walk_part(pos, unit_start, unit_len, chunk, num_splits, LINE: gl.constexpr):
    """Which of its unit's pieces the current one is, and how many the unit has."""
    if LINE:
        first = unit_start // chunk
        return pos // chunk - first, (unit_start + unit_len - 1) // chunk - first + 1
    else:
        return pos % num_splits, num_splits


@gluon.jit
def _walk_next(pos, end, b, kv_h, unit_start, unit_len, seq_len, seq_lens, batch, kv_heads, capacity,
               LINE: gl.constexpr, BOX: gl.constexpr):
    """The state after the current piece: ``(pos, b, kv_h, unit_start, unit_len, seq_len)``
    (line: the next unit, the next KV head or the next sequence's first; units: ``P`` units on)."""
    if LINE:
        wrap = kv_h + 1 == kv_heads
        b = gl.where(wrap, b + 1, b)
        next_len, next_boxes = _sequence(seq_lens, b, batch, capacity, BOX)
        return (gl.minimum(unit_start + unit_len, end), b, gl.where(wrap, 0, kv_h + 1), unit_start + unit_len,
                next_boxes, next_len)
    else:
        return pos + gl.num_programs(0), b, kv_h, unit_start, unit_len, seq_len


@gluon.jit
def _tile_rows(table, start, limit, block_size, block_rows, head_row, num_blocks, max_blocks, BOX: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """The rows of the pool's 2-d view (``block · block_rows + head_row + offset``, see
    `_pool_view`) of the first key of each of the ``BLOCK_N / BOX`` boxes of tile ``[start,
    start + BLOCK_N)``, through the sequence's block ``table``, in one vector load (the loader
    warp's lanes; one round trip per tile, not one per block). Boxes from ``limit`` on (the
    piece's end), and table entries that are not blocks, give a row from ``num_blocks ·
    block_rows`` on: past the view's end, where TMA reads zeros."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    pos = start + gl.arange(0, BLOCK_N // BOX, layout) * BOX
    idx = pos // block_size
    blk = gl.load(table + idx, mask=idx < max_blocks, other=-1)
    ok = (blk >= 0) & (blk < num_blocks) & (pos < limit)
    return gl.where(ok, blk, num_blocks) * block_rows + head_row + pos % block_size


@gluon.jit
def _load_tile(desc, rows, col0, ready, ring, slot, BOX: gl.constexpr, BLOCK_N: gl.constexpr,
               D_CHUNKS: gl.constexpr):
    """One tile of one KV head (columns from ``col0``) into ring slot ``slot``: a box of ``BOX``
    keys at each of the pool ``rows`` (`_tile_rows`: a block, or a tile's share of a larger
    one), each as ``D_CHUNKS`` copies of 64 columns, all completing on ``ready``."""
    mbarrier.expect(ready, BLOCK_N * D_CHUNKS * desc.block_type.nbytes // BOX)
    boxes = gl.arange(0, BLOCK_N // BOX, rows.type.layout)
    for i in gl.static_range(BLOCK_N // BOX):
        row = gl.sum(gl.where(boxes == i, rows, 0), axis=0)  # element i, as a scalar
        for c in gl.static_range(D_CHUNKS):
            _tma_load(desc, [row, col0 + c * 64], ready, ring.index(slot * D_CHUNKS + c).slice(i * BOX, BOX))


@gluon.jit
def _claim_in_lane0(claim):
    """The counter at ``claim`` incremented by lane 0 of the loader warp, as a ``[32]`` tensor (one
    element per lane) that holds the counter's old value in lane 0 and 0 elsewhere: nothing waits
    for the atomic's answer until the value is taken (`_tile_of`). A scalar ``gl.atomic_add``
    hands its answer to every lane at once, so the warp would wait there for the round trip; and
    ptxas turns an ``atom.add`` whose address is the same in every lane into a warp-aggregated
    one followed by a shuffle of the answer, which waits too, so this is ``atom.inc`` (+1 below
    2^31 - 1), which it leaves as it is."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout)
    return gl.inline_asm_elementwise(
        "{ .reg .pred first; setp.eq.s32 first, $2, 0; mov.u32 $0, 0; "
        "@first atom.relaxed.gpu.global.inc.u32 $0, [$1], 2147483647; }",
        "=r,l,r", [claim + lane * 0, lane], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _request_tile(k, split, num_splits, claim, FIRST: gl.constexpr):
    """The ``k``-th tile of split ``split``'s claimed piece, as a request to take later
    (`_tile_of`, ``num_splits · FIRST`` added then): its own ``FIRST`` tiles first (``split ·
    FIRST + k``, no atomic on the way to the first copies), then those the unit's counter
    ``claim`` hands out, from ``num_splits · FIRST`` on. (Nothing here reads the claim's answer,
    so nothing waits for it.)"""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    if k < FIRST:
        request = gl.full([32], (split - num_splits) * FIRST + k, gl.int32, layout)
    else:
        request = _claim_in_lane0(claim)
    return request


@gluon.jit
def _tile_of(request, num_splits, FIRST: gl.constexpr):
    """The tile a `_request_tile` asked for (lane 0's; the others hold no more than it)."""
    return num_splits * FIRST + gl.max(request, axis=0)


@gluon.jit
def _fill_slot(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, tile, rows, col0, it,
               timeline, BOX: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, D_CHUNKS: gl.constexpr,
               TIMELINE: gl.constexpr):
    """Tile ``tile`` (its pool ``rows``, `_tile_rows`) into the ring slot of position ``it``, its
    index beside the slot (released by the K copies' expect, an arrival), once the consumer has
    given the slot back."""
    slot = it % NUM_STAGES
    free = ((it // NUM_STAGES) & 1) ^ 1
    mbarrier.wait(k_empty.index(slot), free)
    gluon_put_index(tile_ids.index(slot), tile)
    _load_tile(k_desc, rows, col0, k_ready.index(slot), k_smem, slot, BOX, BLOCK_N, D_CHUNKS)
    mbarrier.wait(v_empty.index(slot), free)
    _load_tile(v_desc, rows, col0, v_ready.index(slot), v_smem, slot, BOX, BLOCK_N, D_CHUNKS)
    if it == 0:
        _stamp(timeline, 1, TIMELINE)


@gluon.jit
def _close_piece(k_ready, v_ready, k_empty, v_empty, tile_ids, index, it, NUM_STAGES: gl.constexpr):
    """The slot that ends a claimed piece: ``index`` (< 0) beside it, both barriers completed
    without bytes. Returns the ring position after it."""
    slot = it % NUM_STAGES
    free = ((it // NUM_STAGES) & 1) ^ 1
    mbarrier.wait(k_empty.index(slot), free)
    gluon_put_index(tile_ids.index(slot), index)
    mbarrier.arrive(k_ready.index(slot))
    mbarrier.wait(v_empty.index(slot), free)
    mbarrier.arrive(v_ready.index(slot))
    return it + 1


@gluon.jit
def _load_claimed(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, table, seq_lens,
                  claim, b, split, num_splits, batch, capacity, block_size, block_rows, head_row, col0, num_blocks,
                  max_blocks, it, timeline, BLOCK_N: gl.constexpr, BOX: gl.constexpr, NUM_STAGES: gl.constexpr,
                  D_CHUNKS: gl.constexpr, FIRST: gl.constexpr, TIMELINE: gl.constexpr):
    """The loader's share of a claimed piece (`_loader`'s ``CLAIM``), from ring position ``it``:
    returns the position after it (its tiles and the closing slot). A tile past the sequence's
    last ends the piece: the own tiles only grow, and every claimed one lies beyond them all."""
    seq_len, _boxes = _sequence(seq_lens, b, batch, capacity, BOX)
    n_tiles = gl.cdiv(seq_len, BLOCK_N)
    tile = _tile_of(_request_tile(0, split, num_splits, claim, FIRST), num_splits, FIRST)
    rows = _tile_rows(table, tile * BLOCK_N, seq_len, block_size, block_rows, head_row, num_blocks, max_blocks, BOX,
                      BLOCK_N)
    ahead = _request_tile(1, split, num_splits, claim, FIRST)
    k = 0
    while tile < n_tiles:
        # Claims two tiles ahead: the one asked for now is taken an iteration later, so its
        # round trip overlaps a whole tile's wait and copies; the next tile's table entries
        # are read after this tile's copies, and their round trip overlaps the next wait.
        later = _request_tile(k + 2, split, num_splits, claim, FIRST)
        _fill_slot(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, tile, rows, col0,
                   it, timeline, BOX, BLOCK_N, NUM_STAGES, D_CHUNKS, TIMELINE)
        tile = _tile_of(ahead, num_splits, FIRST)
        rows = _tile_rows(table, tile * BLOCK_N, seq_len, block_size, block_rows, head_row, num_blocks, max_blocks,
                          BOX, BLOCK_N)
        ahead = later
        k += 1
        it += 1
    # No more tiles for this piece (the claims still in flight lie further on): a slot without
    # one. Its index waits for the last claim's answer (a tile index is >= 0, so the minimum is
    # -1): the claim is done before this program can arrive, and so before the merge that
    # resets the counter.
    return _close_piece(k_ready, v_ready, k_empty, v_empty, tile_ids,
                        gl.minimum(_tile_of(ahead, num_splits, FIRST), -1), it, NUM_STAGES)


# Stealing (``schedule="steal"``): split ``s`` of a unit keeps its fixed run of the unit's tiles,
# ``[s R, s R + run_s)`` (``R = ⌈tiles / S⌉``), and one int32 of its own (`CLAIM_SPACING` apart,
# a cache line each) counts what has been taken of the run: the low 16 bits the tiles its owner
# claimed from the front (after its first ``FIRST``, which are never stolen), the high 16 bits
# those other programs of the unit stole from the back. A claim adds one to its half and looks
# at the word before it: tiles remain while ``min(FIRST, run) + front + back < run``. Every
# claim moves the sum by one, so the first claims in the word's order get the tiles and every
# tile goes exactly once; a late claim only overshoots its half (never by 2^15).
_STEAL_BACK = gl.constexpr(1 << 16)


@gluon.jit
def _own_request(k, word, FIRST: gl.constexpr):
    """The ``k``-th tile of this split's own run, as a request to take later (`_own_tile`): lane 0
    holds ``-(k + 1)`` for one of the first ``FIRST`` (no atomic), else the run's word before
    lane 0 added one to its low half (`_claim_in_lane0`); the other lanes hold 0."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    if k < FIRST:
        lane = gl.arange(0, 32, layout)
        request = gl.where(lane == 0, -(k + 1), 0)
    else:
        request = _claim_in_lane0(word)
    return request


@gluon.jit
def _own_tile(request, start, run, FIRST: gl.constexpr):
    """The tile an `_own_request` got: ``start`` + its place in the run, or -1 once the run has
    none left for its owner."""
    word = gl.sum(request, axis=0)
    fixed = -word - 1
    claimed = gl.minimum(run, FIRST) + (word & 0xFFFF) + (word >> 16) < run
    own = gl.where(fixed < run, start + fixed, -1)
    return gl.where(word < 0, own, gl.where(claimed, start + FIRST + (word & 0xFFFF), -1))


@gluon.jit
def _split_run(split, n_tiles, per_split):
    """The tiles of split ``split``'s fixed run (``[split · per_split, ...)``, none past the last)."""
    return gl.minimum(gl.maximum(n_tiles - split * per_split, 0), per_split)


@gluon.jit
def _richest_run(unit_claims, n_tiles, per_split, num_splits, FIRST: gl.constexpr):
    """One look at every run's word of the unit (volatile loads: the words change under other
    programs' atomics, and must not be served from this SM's L1): ``left · 128 + split`` for the
    run with the most tiles left, or -1 where none has any (ties: the highest split)."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    s = gl.arange(0, 128, layout)
    inside = s < num_splits
    words = gl.load(unit_claims + s * _CLAIM_SPACING, mask=inside, other=0, volatile=True)
    run = _split_run(s, n_tiles, per_split)
    left = run - gl.minimum(run, FIRST) - (words & 0xFFFF) - (words >> 16)
    return gl.max(gl.where(inside & (left > 0), left * 128 + s, -1), axis=0)


@gluon.jit
def _load_stolen(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, table, seq_lens,
                 unit_claims, b, split, num_splits, batch, capacity, block_size, block_rows, head_row, col0,
                 num_blocks, max_blocks, it, timeline, BLOCK_N: gl.constexpr, BOX: gl.constexpr,
                 NUM_STAGES: gl.constexpr, D_CHUNKS: gl.constexpr, FIRST: gl.constexpr, TIMELINE: gl.constexpr):
    """The loader's share of a stolen-from piece (`_loader`'s ``STEAL``): this split's own run from
    the front, its claims two tiles ahead as `_load_claimed`'s; then, while any run of the unit
    has tiles left, tiles from the back of the run with the most (`_richest_run`), one claim
    each, until that run has none and another look is taken. Returns the ring position after
    the piece's closing slot."""
    seq_len, _boxes = _sequence(seq_lens, b, batch, capacity, BOX)
    n_tiles = gl.cdiv(seq_len, BLOCK_N)
    per_split = gl.cdiv(n_tiles, num_splits)
    start = split * per_split
    run = _split_run(split, n_tiles, per_split)
    word = unit_claims + split * _CLAIM_SPACING
    tile = _own_tile(_own_request(0, word, FIRST), start, run, FIRST)
    rows = _tile_rows(table, gl.maximum(tile, 0) * BLOCK_N, seq_len, block_size, block_rows, head_row, num_blocks,
                      max_blocks, BOX, BLOCK_N)
    ahead = _own_request(1, word, FIRST)
    k = 0
    while tile >= 0:
        later = _own_request(k + 2, word, FIRST)
        _fill_slot(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, tile, rows, col0,
                   it, timeline, BOX, BLOCK_N, NUM_STAGES, D_CHUNKS, TIMELINE)
        tile = _own_tile(ahead, start, run, FIRST)
        rows = _tile_rows(table, gl.maximum(tile, 0) * BLOCK_N, seq_len, block_size, block_rows, head_row,
                          num_blocks, max_blocks, BOX, BLOCK_N)
        ahead = later
        k += 1
        it += 1
    # The own run is done (the claim still in flight can only find it so: the front half only
    # grows). Its answer is waited for at the closing slot, as the thefts' are where they are made.
    best = _richest_run(unit_claims, n_tiles, per_split, num_splits, FIRST)
    while best >= 0:
        victim = best % 128
        victim_run = _split_run(victim, n_tiles, per_split)
        taken = gl.atomic_add(unit_claims + victim * _CLAIM_SPACING, _STEAL_BACK, sem="relaxed", scope="gpu")
        back = taken >> 16
        if gl.minimum(victim_run, FIRST) + (taken & 0xFFFF) + back < victim_run:
            tile = victim * per_split + victim_run - 1 - back
            rows = _tile_rows(table, tile * BLOCK_N, seq_len, block_size, block_rows, head_row, num_blocks,
                              max_blocks, BOX, BLOCK_N)
            _fill_slot(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, tile, rows,
                       col0, it, timeline, BOX, BLOCK_N, NUM_STAGES, D_CHUNKS, TIMELINE)
            it += 1
        else:
            best = _richest_run(unit_claims, n_tiles, per_split, num_splits, FIRST)
    return _close_piece(k_ready, v_ready, k_empty, v_empty, tile_ids,
                        gl.minimum(_own_tile(ahead, start, run, FIRST), -1), it, NUM_STAGES)


@gluon.jit
def _unit_claims(claims, b, kv_h, kv_heads, num_splits, STEAL: gl.constexpr):
    """Where unit (``b``, ``kv_h``)'s claim words start: one counter (``"claim"``), or one word per
    split (``"steal"``), `CLAIM_SPACING` int32s apart either way."""
    unit = b * kv_heads + kv_h
    if STEAL:
        unit = unit * num_splits
    return claims + unit * _CLAIM_SPACING


@gluon.jit
def _loader(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, block_tables, seq_lens,
            claims, stride_tb, stride_cb, batch, kv_heads, num_splits, block_size, block_rows, head_rows, head_cols,
            num_blocks, max_blocks, timeline, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BOX: gl.constexpr,
            NUM_STAGES: gl.constexpr, LINE: gl.constexpr, CLAIM: gl.constexpr, STEAL: gl.constexpr,
            CLAIM_FIRST: gl.constexpr, TIMELINE: gl.constexpr):
    """One warp: the K and V tiles of this program's pieces into the rings, in the order the
    consumer uses them (the same walk). A slot is refilled once the consumer has arrived on
    its empty barrier (on the first pass the wait is for parity 1, which a fresh barrier
    reports complete). KV head ``h``'s keys sit ``h · head_rows`` rows and ``h · head_cols``
    columns into a block of the pool's 2-d view (`_pool_view`).

    ``CLAIM``: a piece's tiles are not a fixed run of the unit's: after ``CLAIM_FIRST`` tiles of
    its own, whichever the unit's claim counter (``claims`` + (b · H + kv_h) · `CLAIM_SPACING`)
    hands out, one tile per increment, until they pass the unit's last tile (`_request_tile`);
    each tile's index goes into ``tile_ids`` beside its ring slot
    (`minillm.kernels.base.gluon_put_index`), and the piece ends with a slot that carries no
    tile (index -1, both barriers completed without bytes). ``STEAL`` (with ``CLAIM``): each split
    keeps its fixed run and a claim word of its own, and a program whose run is done takes
    tiles from the back of its unit's other runs (`_load_stolen`)."""
    D_CHUNKS: gl.constexpr = HEAD_D // 64
    capacity = max_blocks * block_size
    pos, end, b, kv_h, unit_start, unit_len, seq_len, chunk = _walk_start(seq_lens, batch, kv_heads, num_splits,
                                                                          capacity, LINE, BOX, 1)
    it = 0
    while pos < end:
        pb, pkv, lo, hi = _walk_piece(pos, end, b, kv_h, unit_start, unit_len, seq_len, seq_lens, batch, kv_heads,
                                      num_splits, capacity, LINE, BOX, BLOCK_N)
        table = block_tables + pb.to(gl.int64) * stride_tb
        head_row = pkv * head_rows
        col0 = pkv * head_cols
        if STEAL:
            it = _load_stolen(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, table,
                              seq_lens, _unit_claims(claims, pb, pkv, kv_heads, num_splits, STEAL), pb,
                              pos % num_splits, num_splits, batch, capacity, block_size, block_rows, head_row, col0,
                              num_blocks, max_blocks, it, timeline, BLOCK_N, BOX, NUM_STAGES, D_CHUNKS, CLAIM_FIRST,
                              TIMELINE)
        elif CLAIM:
            it = _load_claimed(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, table,
                               seq_lens, _unit_claims(claims, pb, pkv, kv_heads, num_splits, STEAL), pb,
                               pos % num_splits, num_splits, batch, capacity, block_size, block_rows, head_row, col0,
                               num_blocks, max_blocks, it, timeline, BLOCK_N, BOX, NUM_STAGES, D_CHUNKS, CLAIM_FIRST,
                               TIMELINE)
        else:
            rows = _tile_rows(table, lo, hi, block_size, block_rows, head_row, num_blocks, max_blocks, BOX, BLOCK_N)
            for j in range(gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)):
                slot = it % NUM_STAGES
                free = ((it // NUM_STAGES) & 1) ^ 1
                # The next tile's table entries a tile ahead: their round trip overlaps this
                # tile's wait for a free slot and its copies.
                next_rows = _tile_rows(table, lo + (j + 1) * BLOCK_N, hi, block_size, block_rows, head_row,
                                       num_blocks, max_blocks, BOX, BLOCK_N)
                mbarrier.wait(k_empty.index(slot), free)
                _load_tile(k_desc, rows, col0, k_ready.index(slot), k_smem, slot, BOX, BLOCK_N, D_CHUNKS)
                mbarrier.wait(v_empty.index(slot), free)
                _load_tile(v_desc, rows, col0, v_ready.index(slot), v_smem, slot, BOX, BLOCK_N, D_CHUNKS)
                if it == 0:
                    _stamp(timeline, 1, TIMELINE)
                rows = next_rows
                it += 1
        pos, b, kv_h, unit_start, unit_len, seq_len = _walk_next(pos, end, b, kv_h, unit_start, unit_len, seq_len,
                                                                 seq_lens, batch, kv_heads, capacity, LINE, BOX)


@gluon.jit
def _load_queries(q_smem, q_ptr, b, kv_h, group, stride_qb, stride_qh, HEAD_D: gl.constexpr):
    """The ``group`` query heads of KV head ``kv_h`` as the first rows of the ``[ROWS, HEAD_D]``
    query tile (kept as 64-column tiles in ``q_smem``); the other rows are zero."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, 64, gl.SliceLayout(1, layout))
    cols = gl.arange(0, 64, gl.SliceLayout(0, layout))
    ok = (rows < group)[:, None] & (cols < 64)[None, :]
    base = q_ptr + b.to(gl.int64) * stride_qb + (kv_h * group + rows)[:, None] * stride_qh + cols[None, :]
    for c in gl.static_range(HEAD_D // 64):
        q_smem.index(c).store(gl.load(base + c * 64, mask=ok, other=0.0))
    fence_async_shared()  # ordinary stores, then wgmma (the async proxy) reads them
    _warps_barrier()


@gluon.jit
def _zero_rows_past(v_tile, n_valid):
    """Zero rows ``>= n_valid`` of a ``[BLOCK_N, 64]`` tile in shared memory: the ragged last
    tile's rows past the length are stale cache contents (possibly NaN), and ``0 · NaN`` would
    reach the output through P·V even though their probabilities are 0."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    tile = v_tile.load(layout)
    rows = gl.arange(0, v_tile.shape[0], gl.SliceLayout(1, layout))
    v_tile.store(gl.where((rows < n_valid)[:, None], tile, gl.zeros_like(tile)))


@gluon.jit
def _start_scores(q_smem, k_smem, slot, s_zero, D_CHUNKS: gl.constexpr):
    """``S = Q Kᵀ`` for the tile in ring slot ``slot``, started: one ``wgmma`` per 64 columns."""
    s = s_zero
    for c in gl.static_range(D_CHUNKS):
        s = warpgroup_mma(q_smem.index(c), k_smem.index(slot * D_CHUNKS + c).permute((1, 0)), s, use_acc=c > 0,
                          is_async=True)
    return s


@gluon.jit
def _scores(q_smem, k_smem, slot, s_zero, D_CHUNKS: gl.constexpr):
    """``S = Q Kᵀ`` for the tile in ring slot ``slot``, finished."""
    return warpgroup_mma_wait(0, deps=[_start_scores(q_smem, k_smem, slot, s_zero, D_CHUNKS)])


@gluon.jit
def _store_partial(acc0, acc1, m_i, l_i, o_ptr, lse_ptr, stride_oh, stride_lh, group, D_CHUNKS: gl.constexpr):
    """``o = acc / l`` (fp32 or the output's dtype, at ``o_ptr`` + head · stride_oh + column) and
    ``lse = (m + log2 l) · ln 2`` for the group's heads; an empty split stores 0 and -inf."""
    o_layout: gl.constexpr = acc0.type.layout
    rows = gl.arange(0, 64, gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, 64, gl.SliceLayout(0, o_layout))
    inv_l = 1.0 / gl.where(l_i == 0.0, 1.0, l_i)
    inv_l = gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))
    ok = (rows < group)[:, None] & (cols < 64)[None, :]
    ptrs = o_ptr + rows[:, None] * stride_oh + cols[None, :]
    gl.store(ptrs, (acc0 * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=ok)
    if D_CHUNKS == 2:
        gl.store(ptrs + 64, (acc1 * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=ok)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    lse_rows = gl.arange(0, 64, lse.type.layout)
    gl.store(lse_ptr + lse_rows * stride_lh, lse, mask=lse_rows < group)


@gluon.jit
def _load_partials(lse_ptrs, o_ptrs, ok, POLL: gl.constexpr):
    """One step's partials (``lse [MERGE_H, MERGE_S]``, ``o [MERGE_H, MERGE_S, HEAD_D]``) from L2
    (``.cg``); with ``POLL``, read again until no slot inside ``ok`` holds `EMPTY_SLOT_BITS` any
    more (its program's stores have all landed: an aligned 32-bit store is never seen half
    done). The polling reads are ``volatile``: a plain load of an address that nothing in the
    loop writes may be hoisted out of it (ptxas did, where the step's count needs no barrier
    between warps), and the wait then never ends. Triton's volatile loads are system-scoped
    (``LDG.STRONG.SYS``); on an H200 the polling merge ended 5.5 us after the last program's keys,
    the counter's 3.3 (Chapter 7)."""
    if POLL:
        lse_s = gl.load(lse_ptrs, mask=ok, other=float("-inf"), volatile=True)
        o_s = gl.load(o_ptrs, mask=ok[:, :, None], other=0.0, volatile=True)
        missing = _count_empty(lse_s, o_s)
        while missing > 0:
            lse_s = gl.load(lse_ptrs, mask=ok, other=float("-inf"), volatile=True)
            o_s = gl.load(o_ptrs, mask=ok[:, :, None], other=0.0, volatile=True)
            missing = _count_empty(lse_s, o_s)
    else:
        lse_s = gl.load(lse_ptrs, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o_s = gl.load(o_ptrs, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
    return lse_s, o_s


@gluon.jit
def _count_empty(lse_s, o_s):
    """How many of a step's slots still hold `EMPTY_SLOT_BITS` (the same count in every thread)."""
    empty_o = (o_s.to(gl.int32, bitcast=True) == _EMPTY).to(gl.int32)
    empty_lse = (lse_s.to(gl.int32, bitcast=True) == _EMPTY).to(gl.int32)
    return gl.sum(gl.sum(gl.sum(empty_o, axis=2), axis=1), axis=0) + gl.sum(gl.sum(empty_lse, axis=1), axis=0)


@gluon.jit
def _merge_splits(o_part, lse_part, out, lse, group, num_splits, stride_ph, stride_ps, stride_lph, stride_oh,
                  stride_lh, HEAD_D: gl.constexpr, MERGE_H: gl.constexpr, MERGE_S: gl.constexpr, POLL: gl.constexpr):
    """The partials of the group's heads (``o_part``/``lse_part``: the group's first head's, fp32,
    natural log; empty splits hold 0 and -inf) merged into ``out``/``lse``.

    All ``group <= MERGE_H`` heads at once, ``MERGE_S`` splits per step, in one pass (the
    running maximum of the lse rescales what was summed before, Chapter 3's merge): the lse
    and the outputs of a step are loaded together, so a group with at most ``MERGE_S`` splits
    costs one round trip to L2, not two per head. ``POLL``: each step waits for its partials
    to arrive (`_load_partials`) and, once read, marks their slots empty again for the next
    call. (The merge runs at the end of a program, after its unit; every microsecond of it
    is on the step's critical path.)"""
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 2, 16], [1, 4, 1], [2, 1, 0])
    hs_layout: gl.constexpr = gl.SliceLayout(2, layout)  # [heads, splits]
    hd_layout: gl.constexpr = gl.SliceLayout(1, layout)  # [heads, head_dim]
    offs_h = gl.arange(0, MERGE_H, gl.SliceLayout(1, hs_layout))
    offs_s = gl.arange(0, MERGE_S, gl.SliceLayout(0, hs_layout))
    offs_d = gl.arange(0, HEAD_D, gl.SliceLayout(0, hd_layout))
    h_ok = (offs_h < group)[:, None]
    o_rows = o_part + offs_h[:, None, None] * stride_ph + offs_d[None, None, :]
    m = gl.full([MERGE_H], float("-inf"), gl.float32, gl.SliceLayout(1, hs_layout))
    w_sum = gl.zeros([MERGE_H], gl.float32, gl.SliceLayout(1, hs_layout))
    acc = gl.zeros([MERGE_H, HEAD_D], gl.float32, hd_layout)
    for s0 in range(0, num_splits, MERGE_S):
        s = s0 + offs_s
        ok = h_ok & (s < num_splits)[None, :]
        lse_ptrs = lse_part + offs_h[:, None] * stride_lph + s[None, :]
        o_ptrs = o_rows + s[None, :, None] * stride_ps
        lse_s, o_s = _load_partials(lse_ptrs, o_ptrs, ok, POLL)
        if POLL:  # read: the slots are empty again (the next call's programs write them after this kernel)
            empty = gl.full([MERGE_H, MERGE_S], _EMPTY, gl.int32, hs_layout).to(gl.float32, bitcast=True)
            gl.store(lse_ptrs, empty, mask=ok)
            gl.store(o_ptrs, gl.full([MERGE_H, MERGE_S, HEAD_D], _EMPTY, gl.int32, layout).to(gl.float32, bitcast=True),
                     mask=ok[:, :, None])
        m_new = gl.maximum(m, gl.max(lse_s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights e^-inf = 0, no NaN
        w = gl.exp2((lse_s - m_safe[:, None]) * 1.4426950408889634)
        rescale = gl.exp2((m - m_safe) * 1.4426950408889634)
        acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, hd_layout))[:, None] + gl.sum(
            w[:, :, None] * o_s, axis=1)
        w_sum = w_sum * rescale + gl.sum(w, axis=1)
        m = m_new
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    total = gl.where(w_sum == 0.0, 1.0, w_sum)
    o = acc / gl.convert_layout(total, gl.SliceLayout(1, hd_layout))[:, None]
    rows_hd = gl.arange(0, MERGE_H, gl.SliceLayout(1, hd_layout))
    gl.store(out + rows_hd[:, None] * stride_oh + offs_d[None, :], o.to(out.dtype.element_ty),
             mask=(rows_hd < group)[:, None] & (offs_d < HEAD_D)[None, :])
    gl.store(lse + offs_h * stride_lh, m_safe + gl.log2(w_sum) * 0.6931471805599453, mask=offs_h < group)


@gluon.jit
def _publish_stores():
    """``fence.acq_rel.gpu`` in every thread: its stores so far are performed at GPU scope before
    it goes on. (The polling merge has no release and acquire to rely on: the partials are
    plain stores, read by volatile loads on another SM. What it does rely on is the hardware's
    behaviour: an aligned 32-bit store is seen whole, and once performed it is in L2, where
    those loads read. On an H200 the merge took as long with the fence as without it, to the
    global timer's step of 0.26 us.)"""
    gl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _merge_if_last(o_part, lse_part, out, lse, counter, claims, group, num_splits, stride_ph, stride_ps, stride_lph,
                   stride_oh, stride_lh, HEAD_D: gl.constexpr, MERGE_H: gl.constexpr, MERGE_S: gl.constexpr,
                   CLAIM: gl.constexpr, STEAL: gl.constexpr):
    """Count this program in at ``counter``; the last of the ``num_splits`` to arrive merges the
    partials (`_merge_splits`) and sets the counter back to zero (``CLAIM``: and the unit's claim
    counter, ``STEAL``: its runs' words, which every program of the unit is done with once it has
    arrived).

    Memory ordering as in `flash_decode_attention`'s one-launch merge: the barrier orders the
    partition's partial stores before the atomic, whose release publishes them GPU-wide; the
    last program's acquire sees every other program's, and it reads them from L2 (``.cg``).
    On the last program's path: its stores' acknowledgement, the atomic's round trip, the
    partials' round trip."""
    _warps_barrier()
    arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        _merge_splits(o_part, lse_part, out, lse, group, num_splits, stride_ph, stride_ps, stride_lph, stride_oh,
                      stride_lh, HEAD_D, MERGE_H, MERGE_S, False)
        gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call
        if STEAL:
            layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            s = gl.arange(0, 128, layout)
            gl.store(claims + s * _CLAIM_SPACING, gl.zeros([128], gl.int32, layout), mask=s < num_splits)
        elif CLAIM:
            gl.atomic_xchg(claims, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _finish_piece(acc0, acc1, m_i, l_i, o_part, lse_part, out, lse, counter, claims, head0, lse0, part, n_parts,
                  group, stride_ph, stride_ps, stride_lph, stride_oh, stride_lh, HEAD_D: gl.constexpr,
                  MERGE_H: gl.constexpr, MERGE_S: gl.constexpr, MERGE: gl.constexpr, CLAIM: gl.constexpr,
                  STEAL: gl.constexpr):
    """A piece's result: the unit's output itself when the piece is its only one, else the
    piece's partial at slot ``part`` (``head0``, ``lse0``: the group's first head's offsets in
    the workspace) and the merge (``MERGE``, `MERGE_CODES`): by the unit's last program to
    arrive (`_merge_if_last`), by the program of the unit's last piece once the others'
    partials have arrived (``"poll"``), or by a second launch (nothing here)."""
    D_CHUNKS: gl.constexpr = HEAD_D // 64
    if n_parts > 1:
        _store_partial(acc0, acc1, m_i, l_i, o_part + head0 + part * stride_ps, lse_part + lse0 + part,
                       stride_ph, stride_lph, group, D_CHUNKS)
        if MERGE == 1:
            _merge_if_last(o_part + head0, lse_part + lse0, out, lse, counter, claims, group, n_parts, stride_ph,
                           stride_ps, stride_lph, stride_oh, stride_lh, HEAD_D, MERGE_H, MERGE_S, CLAIM, STEAL)
        elif MERGE == 2:
            _publish_stores()
            if part == n_parts - 1:
                _merge_splits(o_part + head0, lse_part + lse0, out, lse, group, n_parts, stride_ph, stride_ps,
                              stride_lph, stride_oh, stride_lh, HEAD_D, MERGE_H, MERGE_S, True)
    else:
        _store_partial(acc0, acc1, m_i, l_i, out, lse, stride_oh, stride_lh, group, D_CHUNKS)


@gluon.jit
def _softmax_tile(s, m_i, l_i, start, hi, cols, qk_scale, p_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """One tile's online-softmax step (base 2, FA2's unscaled accumulator) on the scores ``s``
    of keys ``[start, start + BLOCK_N)``, none past ``hi`` (the piece's end): ``(P as the bf16
    register operand of P·V, alpha = 2^(m_old - m_new), m_new, l_new)``."""
    if start + BLOCK_N > hi:  # the piece's last tile: no key past its end
        s = gl.where((start + cols < hi)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(gl.bfloat16), p_layout), alpha, m_new, l_i


@gluon.jit
def _start_pv(p_op, v_smem, slot, acc0, acc1, alpha, start, hi, o_rows: gl.constexpr, BLOCK_N: gl.constexpr,
              D_CHUNKS: gl.constexpr):
    """``acc = alpha · acc + P V`` for the V tile in ring slot ``slot`` (keys from ``start``),
    started asynchronously, one ``wgmma`` per 64 columns; a ragged tile's rows past ``hi`` are
    zeroed in shared memory first (`_zero_rows_past`)."""
    if start + BLOCK_N > hi:
        for c in gl.static_range(D_CHUNKS):
            _zero_rows_past(v_smem.index(slot * D_CHUNKS + c), hi - start)
        fence_async_shared()
        _warps_barrier()
    alpha_o = gl.convert_layout(alpha, o_rows)[:, None]
    acc0 = warpgroup_mma(p_op, v_smem.index(slot * D_CHUNKS), acc0 * alpha_o, is_async=True)
    if D_CHUNKS == 2:
        acc1 = warpgroup_mma(p_op, v_smem.index(slot * D_CHUNKS + 1), acc1 * alpha_o, is_async=True)
    return acc0, acc1


@gluon.jit
def _wait_pv(acc0, acc1, p_op, D_CHUNKS: gl.constexpr):
    """Wait for every matmul in flight (P·V): the accumulators, and P's registers, which must
    not be reused before the matmul has read them."""
    if D_CHUNKS == 2:
        acc0, acc1, p_op = warpgroup_mma_wait(0, deps=[acc0, acc1, p_op])
    else:
        acc0, p_op = warpgroup_mma_wait(0, deps=[acc0, p_op])
    return acc0, acc1


@gluon.jit
def _tile_in_turn(q_smem, k_smem, v_smem, v_ready, k_empty, v_empty, acc0, acc1, m_i, l_i, s_zero, cols, slot, phase,
                  start, hi, qk_scale, p_layout: gl.constexpr, o_rows: gl.constexpr, BLOCK_N: gl.constexpr,
                  D_CHUNKS: gl.constexpr):
    """One tile (keys from ``start``, none past ``hi``) in ring slot ``slot``, its K already there:
    S = Q Kᵀ (wait), the softmax, P·V (wait), the slot given back. Returns ``(acc0, acc1, m, l)``."""
    s = _scores(q_smem, k_smem, slot, s_zero, D_CHUNKS)
    mbarrier.arrive(k_empty.index(slot))
    p_op, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, start, hi, cols, qk_scale, p_layout, BLOCK_N)
    mbarrier.wait(v_ready.index(slot), phase)
    acc0, acc1 = _start_pv(p_op, v_smem, slot, acc0, acc1, alpha, start, hi, o_rows, BLOCK_N, D_CHUNKS)
    acc0, acc1 = _wait_pv(acc0, acc1, p_op, D_CHUNKS)
    mbarrier.arrive(v_empty.index(slot))
    return acc0, acc1, m_i, l_i


@gluon.jit
def _keys_in_turn(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, acc0, acc1, m_i, l_i, s_zero, cols,
                  it, lo, hi, n_tiles, qk_scale, p_layout: gl.constexpr, o_rows: gl.constexpr,
                  NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D_CHUNKS: gl.constexpr):
    """A piece's keys ``[lo, hi)``, ``n_tiles`` tiles from ring position ``it``, one after the
    other: per tile S = Q Kᵀ (wait), the softmax, P·V (wait). Returns ``(acc0, acc1, m, l)``."""
    for j in range(n_tiles):
        slot = (it + j) % NUM_STAGES
        phase = ((it + j) // NUM_STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        acc0, acc1, m_i, l_i = _tile_in_turn(q_smem, k_smem, v_smem, v_ready, k_empty, v_empty, acc0, acc1, m_i, l_i,
                                             s_zero, cols, slot, phase, lo + j * BLOCK_N, hi, qk_scale, p_layout,
                                             o_rows, BLOCK_N, D_CHUNKS)
    return acc0, acc1, m_i, l_i


@gluon.jit
def _keys_pipelined(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, acc0, acc1, m_i, l_i, s_zero,
                    cols, it, lo, hi, n_tiles, qk_scale, p_layout: gl.constexpr, o_rows: gl.constexpr,
                    NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D_CHUNKS: gl.constexpr):
    """`_keys_in_turn`'s result with FlashAttention-3's overlap inside the warpgroup: tile j's
    S = Q Kⱼᵀ is started before tile j-1's P·V, so that while the softmax of tile j runs on
    the CUDA cores, P·V of tile j-1 runs on the tensor cores, and the scores' latency is
    spent once per piece instead of once per tile.

    Iteration j: start S_j; start acc = alpha_{j-1} acc + P_{j-1} V_{j-1}; wait for S_j only
    (matmul groups retire in order); softmax(S_j); wait for P·V."""
    if n_tiles > 0:
        slot = it % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), (it // NUM_STAGES) & 1)
        s = _scores(q_smem, k_smem, slot, s_zero, D_CHUNKS)
        mbarrier.arrive(k_empty.index(slot))
        p_op, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, lo, hi, cols, qk_scale, p_layout, BLOCK_N)
        for j in range(1, n_tiles):
            slot = (it + j) % NUM_STAGES
            prev = (it + j - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(slot), ((it + j) // NUM_STAGES) & 1)
            s = _start_scores(q_smem, k_smem, slot, s_zero, D_CHUNKS)
            mbarrier.wait(v_ready.index(prev), ((it + j - 1) // NUM_STAGES) & 1)
            # (tile j-1 is not the piece's last, so never ragged)
            acc0, acc1 = _start_pv(p_op, v_smem, prev, acc0, acc1, alpha, lo + (j - 1) * BLOCK_N, hi, o_rows,
                                   BLOCK_N, D_CHUNKS)
            s = warpgroup_mma_wait(D_CHUNKS, deps=[s])  # S_j done; P·V's D_CHUNKS matmuls may still run
            mbarrier.arrive(k_empty.index(slot))
            p_next, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, lo + j * BLOCK_N, hi, cols, qk_scale, p_layout,
                                                    BLOCK_N)
            acc0, acc1 = _wait_pv(acc0, acc1, p_op, D_CHUNKS)
            mbarrier.arrive(v_empty.index(prev))
            p_op = p_next
        last = (it + n_tiles - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(last), ((it + n_tiles - 1) // NUM_STAGES) & 1)
        acc0, acc1 = _start_pv(p_op, v_smem, last, acc0, acc1, alpha, lo + (n_tiles - 1) * BLOCK_N, hi, o_rows,
                               BLOCK_N, D_CHUNKS)
        acc0, acc1 = _wait_pv(acc0, acc1, p_op, D_CHUNKS)
        mbarrier.arrive(v_empty.index(last))
    return acc0, acc1, m_i, l_i


@gluon.jit
def _keys_claimed(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, acc0, acc1, m_i, l_i, s_zero,
                  cols, it, seq_len, qk_scale, p_layout: gl.constexpr, o_rows: gl.constexpr,
                  NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D_CHUNKS: gl.constexpr):
    """`_keys_in_turn` over the tiles the loader claimed for this piece (`_load_claimed`), in the
    order they arrive, each tile's index read beside its ring slot, until a slot without one:
    the online softmax and its partial do not depend on which keys, or in which order. Returns
    ``(acc0, acc1, m, l, it)``, ``it`` past the closing slot."""
    slot = it % NUM_STAGES
    phase = (it // NUM_STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    tile = gluon_get_index(tile_ids.index(slot), 4)
    while tile >= 0:
        acc0, acc1, m_i, l_i = _tile_in_turn(q_smem, k_smem, v_smem, v_ready, k_empty, v_empty, acc0, acc1, m_i, l_i,
                                             s_zero, cols, slot, phase, tile * BLOCK_N, seq_len, qk_scale, p_layout,
                                             o_rows, BLOCK_N, D_CHUNKS)
        it += 1
        slot = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        tile = gluon_get_index(tile_ids.index(slot), 4)
    # the closing slot: nothing to read, given back at once
    mbarrier.arrive(k_empty.index(slot))
    mbarrier.wait(v_ready.index(slot), phase)
    mbarrier.arrive(v_empty.index(slot))
    return acc0, acc1, m_i, l_i, it + 1


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, q_ptr, seq_lens, o_part, lse_part,
              out, lse, counters, claims, stride_qb, stride_qh, stride_pb, stride_ph, stride_ps, stride_lpb,
              stride_lph, stride_ob, stride_oh, stride_lb, stride_lh, stride_cb, batch, group, kv_heads, num_splits,
              block_size, max_blocks, qk_scale, timeline, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, BOX: gl.constexpr, LINE: gl.constexpr, CLAIM: gl.constexpr,
              STEAL: gl.constexpr, SPLIT: gl.constexpr, MERGE_H: gl.constexpr, MERGE_S: gl.constexpr,
              PIPELINE: gl.constexpr, MERGE: gl.constexpr, TIMELINE: gl.constexpr):
    """One warpgroup: for each of this program's pieces, the online softmax over its tiles
    (base 2, FA2's unscaled accumulator; ``CLAIM``: the tiles the loader claimed,
    `_keys_claimed`), then the piece's result: the output itself when the piece is its unit's
    only one, else (``SPLIT``) a partial in the fp32 workspace and the merge by the unit's last
    program to finish (`_merge_if_last`)."""
    _stamp(timeline, 0, TIMELINE)
    D_CHUNKS: gl.constexpr = HEAD_D // 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    capacity = max_blocks * block_size
    pos, end, b, kv_h, unit_start, unit_len, seq_len, chunk = _walk_start(seq_lens, batch, kv_heads, num_splits,
                                                                          capacity, LINE, BOX, 4)
    it = 0
    while pos < end:
        pb, pkv, lo, hi = _walk_piece(pos, end, b, kv_h, unit_start, unit_len, seq_len, seq_lens, batch, kv_heads,
                                      num_splits, capacity, LINE, BOX, BLOCK_N)
        _load_queries(q_smem, q_ptr, pb, pkv, group, stride_qb, stride_qh, HEAD_D)
        m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
        acc0 = gl.zeros([64, 64], gl.float32, o_layout)
        acc1 = gl.zeros([64, 64], gl.float32, o_layout)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        if TIMELINE:
            if it == 0 and (CLAIM or n_tiles > 0):  # an extra wait on the first tile, for its arrival's time
                mbarrier.wait(k_ready.index(0), 0)
                _stamp(timeline, 2, TIMELINE)
        if CLAIM:
            seq_b, _boxes = _sequence(seq_lens, pb, batch, capacity, BOX)
            acc0, acc1, m_i, l_i, it = _keys_claimed(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                                     tile_ids, acc0, acc1, m_i, l_i, s_zero, cols, it, seq_b,
                                                     qk_scale, p_layout, o_rows, NUM_STAGES, BLOCK_N, D_CHUNKS)
            n_tiles = 0  # (`it` is past this piece's slots already)
        elif PIPELINE:
            acc0, acc1, m_i, l_i = _keys_pipelined(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, acc0,
                                                   acc1, m_i, l_i, s_zero, cols, it, lo, hi, n_tiles, qk_scale,
                                                   p_layout, o_rows, NUM_STAGES, BLOCK_N, D_CHUNKS)
        else:
            acc0, acc1, m_i, l_i = _keys_in_turn(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, acc0,
                                                 acc1, m_i, l_i, s_zero, cols, it, lo, hi, n_tiles, qk_scale,
                                                 p_layout, o_rows, NUM_STAGES, BLOCK_N, D_CHUNKS)
        it += n_tiles
        _stamp(timeline, 3, TIMELINE)
        out_b = out + pb.to(gl.int64) * stride_ob + (pkv * group) * stride_oh
        lse_b = lse + pb.to(gl.int64) * stride_lb + (pkv * group) * stride_lh
        if SPLIT:
            part, n_parts = _walk_part(pos, unit_start, unit_len, chunk, num_splits, LINE)
            _finish_piece(acc0, acc1, m_i, l_i, o_part, lse_part, out_b, lse_b, counters + pb * stride_cb + pkv,
                          _unit_claims(claims, pb, pkv, kv_heads, num_splits, STEAL),
                          pb.to(gl.int64) * stride_pb + (pkv * group) * stride_ph,
                          pb.to(gl.int64) * stride_lpb + (pkv * group) * stride_lph, part, n_parts, group,
                          stride_ph, stride_ps, stride_lph, stride_oh, stride_lh, HEAD_D, MERGE_H, MERGE_S,
                          MERGE, CLAIM, STEAL)
        else:  # every unit is one piece: no merge code at all
            _store_partial(acc0, acc1, m_i, l_i, out_b, lse_b, stride_oh, stride_lh, group, D_CHUNKS)
        _stamp(timeline, 4, TIMELINE)
        pos, b, kv_h, unit_start, unit_len, seq_len = _walk_next(pos, end, b, kv_h, unit_start, unit_len, seq_len,
                                                                 seq_lens, batch, kv_heads, capacity, LINE, BOX)


@gluon.jit
def _decode_kernel(k_desc, v_desc, q_ptr, block_tables, seq_lens, o_part, lse_part, out, lse, counters, claims,
                   stride_qb, stride_qh, stride_tb, stride_pb, stride_ph, stride_ps, stride_lpb, stride_lph,
                   stride_ob, stride_oh, stride_lb, stride_lh, stride_cb,
                   batch, group, kv_heads, num_splits, block_size, block_rows, head_rows, head_cols, num_blocks,
                   max_blocks, qk_scale, timeline,
                   HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BOX: gl.constexpr, NUM_STAGES: gl.constexpr,
                   LINE: gl.constexpr, CLAIM: gl.constexpr, STEAL: gl.constexpr, CLAIM_FIRST: gl.constexpr,
                   SPLIT: gl.constexpr, MERGE_H: gl.constexpr, MERGE_S: gl.constexpr, LOADER_REGS: gl.constexpr,
                   PIPELINE: gl.constexpr, MERGE: gl.constexpr, LAUNCH_DEPENDENTS: gl.constexpr, PDL: gl.constexpr,
                   TIMELINE: gl.constexpr):
    """A 1-d grid of at most one program per SM, each walking its work: units ``pid``, ``pid +
    P``, ..., or (``LINE``) its chunk of the work line; ``CLAIM``: a unit's tiles go to its
    programs as they claim them (``claims``: zeroed int32s, one per unit every `CLAIM_SPACING`;
    ``STEAL``: one per split, each split keeping its run but for what others steal from its back).
    ``num_warps=4``: the consumer (the default partition) and a one-warp loader. Shared memory:
    the query tile and ``NUM_STAGES`` slots of K and V, each as ``HEAD_D / 64`` tiles of
    ``[BLOCK_N, 64]`` (the descriptors' layout), and with ``CLAIM`` a tile index per slot.
    ``PDL``: launched as a programmatic dependent launch, the program sets up its shared memory
    and barriers, then waits for the kernel before it (``griddepcontrol.wait``) before it reads
    anything in global memory."""
    if LAUNCH_DEPENDENTS or PDL:  # the next launch (a programmatic dependent one) may be scheduled now
        tl.extra.cuda.gdc_launch_dependents()
    D_CHUNKS: gl.constexpr = HEAD_D // 64
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [D_CHUNKS, 64, 64], q_layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES * D_CHUNKS, BLOCK_N, 64], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES * D_CHUNKS, BLOCK_N, 64], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)  # the loader's expect() is the one arrival
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)  # the consumer's
        mbarrier.init(v_empty.index(i), count=1)
    if CLAIM:
        tile_ids = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        tile_ids = k_ready  # (unused)
    fence_async_shared()
    if PDL:  # the queries, the lengths, the tables and the pool may be the last kernel's output
        tl.extra.cuda.gdc_wait()

    # (The argument tuples are written in place: see Chapter 4's Gluon kernel.)
    gl.warp_specialize(
        [(_consumer, (q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, q_ptr,
                      seq_lens, o_part, lse_part, out, lse, counters, claims, stride_qb, stride_qh, stride_pb,
                      stride_ph, stride_ps, stride_lpb, stride_lph, stride_ob, stride_oh, stride_lb, stride_lh,
                      stride_cb, batch, group, kv_heads, num_splits, block_size, max_blocks, qk_scale, timeline,
                      HEAD_D, BLOCK_N, NUM_STAGES, BOX, LINE, CLAIM, STEAL, SPLIT, MERGE_H, MERGE_S, PIPELINE,
                      MERGE, TIMELINE)),
         (_loader, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, tile_ids, block_tables,
                    seq_lens, claims, stride_tb, stride_cb, batch, kv_heads, num_splits, block_size, block_rows,
                    head_rows, head_cols, num_blocks, max_blocks, timeline, HEAD_D, BLOCK_N, BOX, NUM_STAGES, LINE,
                    CLAIM, STEAL, CLAIM_FIRST, TIMELINE))],
        [1],
        [LOADER_REGS],
    )


# ----------------------------------------------------------------------------------------
# Planning and launch (plain Python)
# ----------------------------------------------------------------------------------------
def plan_splits(batch: int, kv_heads: int, max_seq_len: int, programs: int, block_n: int = BLOCK_N,
                max_splits: int = MAX_SPLITS) -> int:
    """Splits per sequence for the persistent kernel: as many as keep every program at one unit
    of work, then the fewest that leave the units as long.

    A program that gets a second unit (sequence, KV head, split) pays for it in full: a second
    query load, a second partial and arrival on the merge's counter, a second wait for its
    first tiles, and nothing hides them. On the H200, plans that gave each program 17 units
    (33-41 splits of 64-key tiles at 128k keys, chosen by counting tiles alone) ran at
    0.70-0.87x the Triton kernel's speed
    (``bench/results/raw/nvidia-h200.bench_ch07_gluon_many_units.log``).
    So ``S ≤ programs / (batch · kv_heads)``, and ``S = 1`` once the batch alone has more units
    than there are programs. Within that bound every program runs one unit of ``⌈tiles / S⌉``
    tiles (``tiles = ⌈max_seq_len / block_n⌉``), so the step is shortest at the largest ``S``
    allowed; of the counts that give the same ``⌈tiles / S⌉`` the smallest is taken (fewer
    partials to merge). The Triton kernel's rule (`num_splits_heuristic`) fills a wave of two
    programs per SM instead: this kernel runs one."""
    tiles = -(-max(0, max_seq_len) // block_n)
    most = max(1, min(max_splits, tiles, programs // max(1, batch * kv_heads)))
    per_unit = -(-tiles // most)
    return next(s for s in range(1, most + 1) if -(-tiles // s) == per_unit)


#: `plan_splits` remembered per argument tuple: a decode loop asks for the same plan every step.
_planned_splits = functools.lru_cache(maxsize=1024)(plan_splits)


def balanced_slots(programs: int, kv_heads: int, capacity_boxes: int) -> int:
    """The most pieces a unit can be cut into by the balanced schedule (the workspace's slots per
    head): a unit of ``u`` boxes shares the line with its sequence's other KV heads, so the line
    has at least ``H · u`` boxes and the chunks at least ``H · u / P``; ``u`` boxes then meet
    at most ``⌈P / H⌉ + 1`` chunks; and no more pieces than boxes (the table's capacity) or
    programs."""
    return max(1, min(programs, -(-programs // kv_heads) + 1, capacity_boxes))


#: The pool layouts the kernel reads (FlashInfer's names): ``"NHD"``, a block's tokens then
#: heads, ``[num_blocks, block_size, kv_heads, head_dim]`` (every other chapter's); ``"HND"``,
#: heads then tokens, ``[num_blocks, kv_heads, block_size, head_dim]`` (one KV head's share of
#: a block is contiguous).
KV_LAYOUTS = ("NHD", "HND")
#: Where the splits are merged (`flash_decode_attention_gluon`'s ``merge``), and each one's
#: code in the kernel (``MERGE``: 0, a second launch; 1, the last to arrive; 2, polling).
MERGE_CODES = {"last": 1, "poll": 2, "launch": 0, "launch_pdl": 0}
MERGES = tuple(MERGE_CODES)
#: How the programs share the work (`flash_decode_attention_gluon`'s ``schedule``).
SCHEDULES = ("units", "line", "claim", "steal")


def as_token_major(cache: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A pool of ``kv_layout`` seen as ``[num_blocks, block_size, kv_heads, head_dim]`` (a view)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return cache.transpose(1, 2) if kv_layout == "HND" and cache.dim() == 4 else cache


def to_head_major(cache: torch.Tensor) -> torch.Tensor:
    """An NHD pool ``[num_blocks, block_size, kv_heads, head_dim]`` copied into HND,
    ``[num_blocks, kv_heads, block_size, head_dim]`` (the same tables address it)."""
    return cache.transpose(1, 2).contiguous()


def claim_counters(batch: int, q_heads: int, device) -> torch.Tensor:
    """The claim counters of ``schedule="claim"``, reused across calls: int32, zero, `CLAIM_SPACING`
    apart per (sequence, KV head) (``[batch, CLAIM_SPACING · q_heads]``, enough for any number of KV
    heads); the merges leave them zero again."""
    return cached_counters(batch, CLAIM_SPACING * q_heads, device, "claims")


def steal_words(batch: int, kv_heads: int, num_splits: int, device) -> torch.Tensor:
    """The runs' words of ``schedule="steal"``, reused across calls: int32, zero, `CLAIM_SPACING`
    apart per (sequence, KV head, split) (``[batch, CLAIM_SPACING · kv_heads · num_splits]``); the
    merges leave them zero again."""
    return cached_counters(batch, CLAIM_SPACING * kv_heads * num_splits, device, "steals")


def new_timeline(programs: int, device) -> torch.Tensor:
    """A timeline for `flash_decode_attention_gluon`'s ``timeline``: zeros ``[programs, 2,
    len(TIMELINE_EVENTS)]`` int64 (``[:, 0]`` global-timer ns, ``[:, 1]`` SM cycles)."""
    return torch.zeros(programs, 2, len(TIMELINE_EVENTS), dtype=torch.int64, device=device)


def gluon_decode_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         kv_layout: str = "NHD") -> bool:
    """Whether `flash_decode_attention_gluon` takes these inputs (see the module's scope)."""
    return _reason(q, k_cache, v_cache, kv_layout) is None


def _reason(q, k_cache, v_cache, kv_layout) -> str | None:
    if not (q.is_cuda and device_capability(q.device)[0] == 9):
        return "the Gluon decode kernel needs an sm_90 GPU (H100/H200)"
    return _layout_reason(q, k_cache, v_cache, kv_layout)


def _layout_reason(q, k_cache, v_cache, kv_layout="NHD") -> str | None:
    """What rules out these tensors, device aside (None: they qualify)."""
    if kv_layout not in KV_LAYOUTS:
        return f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}"
    if k_cache.dim() != 4 or q.dim() != 3:
        return ("q must be [batch, q_heads, head_dim] and the caches [num_blocks, block_size, kv_heads, head_dim] "
                "(NHD) or [num_blocks, kv_heads, block_size, head_dim] (HND)")
    num_blocks, block_size, kv_heads, head_dim = as_token_major(k_cache, kv_layout).shape
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16):
        return "bf16 only"
    if head_dim not in (64, 128):
        return f"head_dim must be 64 or 128, got {head_dim}"
    if kv_heads == 0 or q.shape[1] % kv_heads or q.shape[1] // kv_heads > ROWS:
        return f"{q.shape[1]} query heads over {kv_heads} KV heads: a group of 1..{ROWS} heads is needed"
    if block_size % 16 or (BLOCK_N % block_size and block_size % BLOCK_N):
        return f"block_size must be a multiple of 16 that divides {BLOCK_N} or is a multiple of it, got {block_size}"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        return "the pools must be contiguous and 16-byte aligned"
    if (num_blocks + 1) * block_size * (kv_heads if kv_layout == "HND" else 1) >= 2**31:
        return "the pool has too many rows for 32-bit TMA coordinates"
    return None


def _pool_view(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, kv_layout: str):
    """The contiguous pool as the 2-d tensor the copies read, and where a KV head sits in it:
    ``(shape, block_rows, head_rows, head_cols)``. Key ``t`` of KV head ``h`` in block ``b`` is
    row ``b · block_rows + h · head_rows + t``, columns from ``h · head_cols``.

    - NHD: ``[num_blocks · block_size, kv_heads · head_dim]``; a head is ``head_dim`` columns
      of every row, and a box of 16 keys is 16 pieces of ``2 · head_dim`` bytes, one per row
      of the block (``kv_heads · head_dim`` elements apart);
    - HND: ``[num_blocks · kv_heads · block_size, head_dim]``; a head's share of a block is
      ``block_size`` consecutive rows, one run of ``block_size · 2 · head_dim`` bytes."""
    if kv_layout == "HND":
        return [num_blocks * kv_heads * block_size, head_dim], kv_heads * block_size, block_size, 0
    return [num_blocks * block_size, kv_heads * head_dim], block_size, 0, head_dim


def _descriptor(pool: torch.Tensor, shape: list[int], box: int):
    """A TMA descriptor over the contiguous ``pool`` seen as the 2-d ``shape`` (`_pool_view`),
    boxes of ``[box, 64]``, reused across calls; it holds the pool's address, not the pool."""
    def make():
        layout = gl.NVMMASharedLayout.get_default_for([box, 64], gl.bfloat16)
        return TensorDescriptor(TensorAddress(pool.data_ptr(), pool.dtype), shape, [shape[1], 1], [box, 64], layout)
    return cached_descriptor((pool.data_ptr(), pool.device.index, *shape, pool.dtype, "gluon", box), make)


def flash_decode_attention_gluon(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None, *,
                                 schedule: str = "units", num_splits: int | None = None,
                                 max_seq_len: int | None = None, programs: int | None = None,
                                 block_n: int = BLOCK_N, num_stages: int = NUM_STAGES,
                                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                                 kv_layout: str = "NHD", pipeline: bool = False, loader_regs: int | None = None,
                                 merge: str = "last", claim_first: int = CLAIM_FIRST,
                                 timeline: torch.Tensor | None = None, pdl: bool = False,
                                 compile_only: bool = False):
    """`flash_decode_attention`'s contract (``q: [batch, q_heads, head_dim]``, pools
    ``[num_blocks, block_size, kv_heads, head_dim]``, ``block_tables: [batch, max_blocks]``
    int32, ``seq_lens: [batch]``; returns ``(out [batch, q_heads, head_dim] bf16, lse [batch,
    q_heads] fp32, natural log)``) on the Gluon kernel, within `gluon_decode_applies`'s scope.

    - ``kv_layout``: ``"NHD"`` (default, the pools above) or ``"HND"``: pools ``[num_blocks,
      kv_heads, block_size, head_dim]``, where a KV head's keys in a block are one run of
      memory (`_pool_view`); the tables and lengths are the same;

    - ``schedule``: ``"units"`` (default): every (sequence, KV head) cut into ``num_splits``
      splits of whole tiles of its own length, the units dealt to the programs in turn;
      ``num_splits`` defaults to `plan_splits` (``max_seq_len`` bounds the lengths for it;
      default the table's capacity). ``"line"``: the balanced schedule, every program one
      equal chunk of the work line (all units' boxes of keys in a row), cut on the GPU from
      the lengths (`minillm.reference.ch07_flash_decoding.work_line_pieces`). ``"claim"``: the
      units' splits and merge, but a unit's programs take its tiles one at a time from a
      counter of the unit's instead of each a fixed run of them, so a program that streams
      faster takes more (each still leaves one partial; which program sums which keys, and so
      the last bits of the result, changes from call to call); ``merge="last"`` only;
      ``claim_first``: tiles each program takes as its own before it claims (the first ones
      need no atomic's round trip before their copies). ``"steal"``: the units' splits, each
      with its fixed run of tiles, but a program whose run is done takes tiles from the back of
      the run of its unit with the most left, one claim each (work stealing; `_load_stolen`), so
      that the unit's slowest program has less to do at the end; ``merge="last"`` only, at
      most `STEAL_MAX_SPLITS` splits; ``claim_first`` tiles of each run are its owner's alone;
    - ``programs``: persistent programs (default one per SM);
    - ``pipeline``: overlap tile j's scores with tile j-1's P·V in the consumer
      (`_keys_pipelined`, FlashAttention-3's intra-warpgroup overlap) instead of taking each
      tile's two matmuls in turn (`_keys_in_turn`);
    - ``block_n``: keys per tile (64 or 128); ``num_stages``: ring slots; ``loader_regs``:
      registers per thread of the loader warp (``setmaxnreg``; the consumer keeps what the
      program was compiled with; default: the schedule's entry of `LOADER_REGS`, else 40);
    - ``merge`` (where splits are merged): ``"last"`` (default), by the last of a unit's
      programs to finish, in the same launch (`_merge_if_last`); ``"launch"``, by a second
      launch (Chapter 7's stage 2, `reduce_splits`) after every program stored its partial;
      ``"launch_pdl"``, that launch as a programmatic dependent launch (scheduled while the
      decode kernel runs, it waits for the kernel's end before it reads); ``"poll"``, by the
      program of each unit's last split, which reads the other partials until none of their
      slots holds the empty marker (`EMPTY_SLOT_BITS`, what the workspace starts with and what
      the merge writes back): no atomic and no wait for stores to be acknowledged, but a
      program that waits for others, so only where every piece has a program of its own (the
      planned split counts do), all of them running at once. All but ``"last"``: ``"units"`` only;
    - ``timeline``: an int64 tensor ``[programs, 2, len(TIMELINE_EVENTS)]`` (`new_timeline`) that the
      kernel, compiled with the stamps, fills with each program's clocks at `TIMELINE_EVENTS`
      (``[:, 0]``: the global timer in ns, ``[:, 1]``: the SM's cycles; a program with no work
      leaves zeros after its start; the last piece's stamps win). For measuring, not serving;
    - ``pdl``: launch as a programmatic dependent launch (Hopper; Chapter 10's chains of
      kernels): the launch is scheduled while the kernel before it in the stream runs, and the
      programs wait for it to finish (``griddepcontrol.wait``) after setting up their shared
      memory, before their first read of global memory; the next launch may be scheduled as soon
      as every program has started. With ``merge="launch"`` the merge launch is one too;
    - ``compile_only``: compile for the current device without launching; returns the kernel."""
    reason = (_layout_reason if compile_only else _reason)(q, k_cache, v_cache, kv_layout)
    if reason:
        raise ValueError(reason)
    batch = q.shape[0]
    num_blocks, block_size, kv_heads, head_dim, q_heads = check_paged(
        q, as_token_major(k_cache, kv_layout), as_token_major(v_cache, kv_layout), block_tables, seq_lens, batch)
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    out, lse = decode_outputs(q, out, lse)
    if block_n not in (64, 128) or (block_n % block_size and block_size % block_n):
        raise ValueError(f"block_n must be 64 or 128 and divide the block size or be a multiple of it, got {block_n}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "line" and num_splits is not None:
        raise ValueError("num_splits belongs to the 'units' schedule; the line cuts itself")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if schedule == "line" and merge != "last":
        raise ValueError("the line's units have a varying number of pieces: only merge='last' merges them")
    if int(claim_first) != claim_first or claim_first < 0:
        raise ValueError(f"claim_first must be an integer >= 0, got {claim_first}")
    if schedule in ("claim", "steal") and merge != "last":
        raise ValueError(f"schedule={schedule!r} resets its claim counters in the last program's merge: "
                         "merge='last' only")
    if batch * q_heads == 0 and not compile_only:
        return out, lse
    if timeline is not None and (timeline.dtype != torch.int64 or not timeline.is_contiguous()
                                 or tuple(timeline.shape[1:]) != (2, len(TIMELINE_EVENTS))):
        raise ValueError(f"timeline must be a contiguous int64 tensor [programs, 2, {len(TIMELINE_EVENTS)}]")
    box = min(block_size, block_n)
    capacity = block_tables.shape[1] * block_size
    programs = programs or num_sms(q.device)
    if schedule == "line":
        line_boxes = batch * kv_heads * max(1, -(-capacity // box))  # the line's longest
        if line_boxes >= 2**31:
            raise ValueError("the work line has too many boxes for 32-bit positions")
        grid = max(1, min(programs, line_boxes))
        num_splits = slots = balanced_slots(grid, kv_heads, -(-capacity // box))
    else:
        if num_splits is None:
            bound = capacity if max_seq_len is None else int(max_seq_len)
            num_splits = _planned_splits(batch, kv_heads, bound, programs, block_n)
        if int(num_splits) != num_splits or num_splits < 1:
            raise ValueError(f"num_splits must be an integer >= 1, got {num_splits}")
        num_splits = slots = int(num_splits)
        grid = max(1, min(programs, batch * kv_heads * num_splits))
        if merge == "poll" and batch * kv_heads * num_splits > programs:
            raise ValueError(f"merge='poll' needs a program per piece: {batch * kv_heads * num_splits} pieces "
                             f"({batch} x {kv_heads} KV heads x {num_splits} splits) on {programs} programs")
    if timeline is not None and timeline.shape[0] < grid:
        raise ValueError(f"timeline has {timeline.shape[0]} rows for {grid} programs")
    split = slots > 1
    if split and merge == "poll":  # slots marked empty, no counters (a placeholder)
        o_part, lse_part = cached_empty_workspace(batch, q_heads, slots, head_dim, q.device, EMPTY_SLOT_BITS)
        counters = seq_lens[:, None]
    elif split:
        o_part, lse_part, counters = cached_workspace(batch, q_heads, slots, head_dim, q.device)
    else:  # unused placeholders: the units write the output itself
        o_part, lse_part, counters = out[:, :, None], lse[:, :, None], seq_lens[:, None]
    # (one split: its program claims every tile, so it takes them in turn; nothing to steal)
    claim, steal = split and schedule in ("claim", "steal"), split and schedule == "steal"
    loader_regs = loader_regs or LOADER_REGS.get(schedule if split else "units", 40)
    if steal:
        if num_splits > STEAL_MAX_SPLITS:
            raise ValueError(f"schedule='steal' takes at most {STEAL_MAX_SPLITS} splits, got {num_splits}")
        if -(-capacity // block_n) >= 2**15:
            raise ValueError("schedule='steal' counts a run's tiles in 15 bits: the table is too long")
        claims = steal_words(batch, kv_heads, num_splits, q.device)
    else:
        claims = claim_counters(batch, q_heads, q.device) if claim else counters
    merge_h = power_of_2_at_least(q_heads // kv_heads)
    qk_scale = (1.0 / math.sqrt(head_dim) if scale is None else float(scale)) * LOG2E
    view, block_rows, head_rows, head_cols = _pool_view(num_blocks, block_size, kv_heads, head_dim, kv_layout)
    q_st, out_st, o_st, lse_st, l_st = q.stride(), out.stride(), o_part.stride(), lse.stride(), lse_part.stride()
    args = (_descriptor(k_cache, view, box), _descriptor(v_cache, view, box), q, block_tables, seq_lens, o_part,
            lse_part, out, lse, counters, claims, q_st[0], q_st[1], block_tables.stride(0), o_st[0], o_st[1], o_st[2],
            l_st[0], l_st[1], out_st[0], out_st[1], lse_st[0], lse_st[1], counters.stride(0), batch,
            q_heads // kv_heads, kv_heads, num_splits, block_size, block_rows, head_rows, head_cols, num_blocks,
            block_tables.shape[1], qk_scale,
            seq_lens if timeline is None else timeline)  # (an unused placeholder without one)
    meta = dict(HEAD_D=head_dim, BLOCK_N=block_n, BOX=box, NUM_STAGES=num_stages, LINE=schedule == "line",
                CLAIM=claim, STEAL=steal, CLAIM_FIRST=int(claim_first), SPLIT=split, MERGE_H=merge_h,
                LOADER_REGS=loader_regs,
                PIPELINE=bool(pipeline), num_warps=4,
                MERGE=MERGE_CODES[merge], LAUNCH_DEPENDENTS=split and merge == "launch_pdl", PDL=bool(pdl),
                **({"launch_pdl": True} if pdl else {}),  # (the kernel's switch and the launch's go together)
                TIMELINE=timeline is not None,
                MERGE_S=max(1, min(MERGE_SPLITS, MERGE_ROWS // merge_h, power_of_2_at_least(slots))))
    if compile_only:
        return _decode_kernel.warmup(*args, grid=(grid,), **meta)
    if q_st[2] != 1 or out_st[2] != 1:
        raise ValueError("q and out must have a unit stride along head_dim")
    launch(_decode_kernel, (grid,), *args, **meta)
    if split and MERGE_CODES[merge] == 0:
        reduce_splits(o_part, lse_part, out, lse, pdl=pdl or merge == "launch_pdl")
    return out, lse
