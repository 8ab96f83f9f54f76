"""Chapter 4, on Hopper, written out: FlashAttention-3's warp specialization in Gluon.

`minillm.kernels.ch04_flash_attention_hopper` asks Triton's compiler for FlashAttention-3's
ideas through switches (``tl.range(..., warp_specialize=True)``, ``num_stages``); on sm_90 the
compiler left the schedule as it was, and the kernel stayed at 0.75-0.8x cuDNN at head dim
128. **Gluon** (``triton.experimental.gluon``) is Triton's lower layer: the same Python
front end, but the program states what the compiler otherwise decides: the layout of every
tensor in registers, shared-memory buffers, ``mbarrier`` objects, TMA copies, asynchronous
``wgmma`` and when to wait for it, and which warps run which function, with how many
registers (``gl.warp_specialize``, which sets ``setmaxnreg``). This module writes FA3's
forward with it, in steps that the chapter measures one against the other:

1. ``"pipelined"``: one program of 8 warps (two warpgroups, 64 query rows each) per 128-row
   query tile; K/V tiles arrive by TMA in a ring of ``num_stages`` shared-memory slots, each
   guarded by an mbarrier; the loop is ordered as FA3's *intra-warpgroup overlap*: the
   scores ``S_j = Q K_jᵀ`` are started before ``P_{j-1} V_{j-1}``, and the softmax of block j
   runs while that second matmul is still on the tensor cores. The same warps also refill
   the ring, after a barrier across the whole program.
2. ``"ws"``: warp specialization. A *loader* warp (24 registers) only issues TMA copies into
   the ring and waits until a slot is free; two *consumer* warpgroups (4 warps and 240
   registers each, 64 query rows each) only compute. A slot is free when both consumers
   have arrived on its "empty" barrier; a tile is ready when its "ready" barrier has seen
   the copy's bytes. No barrier spans the whole program any more.
3. ``"ws_pingpong"``: FA3's *ping-pong*: the two consumers take turns to start their matmuls
   (a token passed through two mbarriers), so that one warpgroup's exponentials run while the
   other's matmuls hold the tensor cores.

Both warp-specialized kernels can also run **persistent** (``persistent=True``): one program
per SM, taking tiles in turn, with the rings running on from one tile to the next and Q in two
buffers, so that the loader fetches the next tile while the consumers finish this one
(`persistent_by_default` says when that is the default).

And `flash_attention_gluon_fp8`: the warp-specialized kernel with e4m3 matmuls (Hopper's FP8
tensor cores run at twice the bf16 rate): Q with one scale per 64 rows, K per ``block_n`` keys,
V per head, as in `flash_attention_fp8` of the Triton module; P is rounded to e4m3 into shared
memory for P·V, and V's ring holds tiles of Vᵀ, because an 8-bit ``wgmma`` reads its second
operand along the reduction axis (the keys).

Scope: bf16, ``q: [batch, q_heads, seq, head_dim]``, ``k, v: [batch, kv_heads, seq,
head_dim]`` (GQA: ``q_heads % kv_heads == 0``), head_dim 64 or 128, ``seq`` a multiple of 128
(every tile full: no bounds logic), queries and keys of the same length; causal masks on the
diagonal. Forward only. `gluon_applies` says whether a call qualifies; `flash_attention_hopper`
covers everything else.

Gluon kernels run on an NVIDIA GPU only: Triton's interpreter does not execute them, so the
CPU side of the tests checks the wrapper and, with a Triton whose Gluon API this module knows
(3.6, the version torch 2.11 ships, and 3.9), compiles the kernels for sm_90 without a GPU.
Gluon is experimental and renames things between releases; the three names that moved
between 3.6 and 3.9 are bound once below.
"""
from __future__ import annotations

import math

import torch
import triton

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from minillm.kernels.base import LOG2E, num_sms

try:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Gluon without these names: the module imports, its kernels do not compile
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None

# Gluon's names for a TMA copy and a barrier across a partition's warps (Triton 3.9's, else 3.6's).
_tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
_tma_store = getattr(tma, "async_store", None) or getattr(tma, "async_copy_shared_to_global", None)
_warps_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier", None)

#: Query rows per program (two warpgroups of 64).
BLOCK_M = 128
#: The three kernels, in the order the chapter builds them.
VARIANTS = ("pipelined", "ws", "ws_pingpong")
#: Triton versions whose Gluon API this module was compiled against.
GLUON_VERSIONS = ((3, 6), (3, 9))


# ----------------------------------------------------------------------------------------
# Helpers inside the kernel
# ----------------------------------------------------------------------------------------
@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale, row0, col0, mask_this, CAUSAL: gl.constexpr,
                    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One step of Chapter 3's online softmax in base 2 on a ``[ROWS, BLOCK_N]`` fp32 tile of
    raw scores ``s`` (in ``s_layout``, the wgmma accumulator's). ``m_i, l_i: [ROWS]``: running
    max (of ``s·qk_scale``) and sum; ``row0``/``col0``: sequence positions of the tile's first
    row and column; ``mask_this``: the tile straddles the diagonal (causal only).
    Returns ``(p, alpha, m_new, l_new)`` as `minillm.kernels.base.online_softmax_update`."""
    if CAUSAL:
        if mask_this:
            rows = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
            cols = col0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
            s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    # The scale is positive, so it commutes with the max and folds into one FMA per score.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _v_operand(v_tile, FP8: gl.constexpr):
    """The ``[BLOCK_N, HEAD_D]`` second operand of P·V: the tile itself, or in FP8 a view of the
    ``[HEAD_D, BLOCK_N]`` tile of Vᵀ (no data moves)."""
    if FP8:
        operand = v_tile.permute((1, 0))
    else:
        operand = v_tile
    return operand


@gluon.jit
def _p_operand(p, p_smem, p_layout: gl.constexpr, FP8: gl.constexpr):
    """P (fp32, the scores' layout) as the first operand of P·V: in bf16, registers in
    ``p_layout``; in FP8, e4m3 in ``p_smem``. (Hopper's 8-bit wgmma could read P from
    registers too, but four keys per thread in a row means shuffling them, and the wait for a
    matmul cannot hold 8-bit registers, so P takes the way through shared memory.)"""
    if FP8:
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()  # ordinary stores, then the wgmma (async proxy) reads them
        _warps_barrier()  # every warp's rows are stored before the matmul starts
        operand = p_smem
    else:
        operand = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    return operand


@gluon.jit
def _wait_pv(acc_tok, p_op, FP8: gl.constexpr):
    """Wait for every matmul in flight (the last P·V): the accumulator, and in bf16 P's
    registers, a dependency so that they are not reused before the matmul has read them."""
    if FP8:
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
    else:
        acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
    return acc, p_op


@gluon.jit
def _attend_rows(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                 k_desc, v_desc, kv_row0, n_blocks, n_full, row0, qk_scale, k_scales, p_smem, it0, turn0,
                 CONSUMER: gl.constexpr, WS: gl.constexpr, PINGPONG: gl.constexpr,
                 CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                 FP8: gl.constexpr = False):
    """The key loop of one set of query rows: returns ``(acc [ROWS, HEAD_D] fp32, not yet
    divided by l; m_i, l_i [ROWS])`` for ``softmax(Q Kᵀ · scale) V`` over ``n_blocks`` blocks.

    ``q_smem: [ROWS, HEAD_D]`` (loaded); ``k_smem, v_smem: [NUM_STAGES, BLOCK_N, HEAD_D]``
    rings, which have already passed ``it0`` blocks (of earlier tiles of a persistent
    program): block j sits in slot ``(it0 + j) % NUM_STAGES``, and its ``*_ready`` barrier
    completes phase ``((it0 + j) // NUM_STAGES) & 1`` when the copy has landed.

    - ``WS``: a consumer frees a slot by arriving on ``*_empty`` (the loader warp refills it);
      else these warps refill it themselves.
    - ``PINGPONG``: wait for ``turn[CONSUMER]`` before starting the matmuls, pass the turn on
      right after (``turn0``: turns taken in earlier tiles).
    - ``FP8``: Q, K and V are e4m3, V's ring holds tiles of Vᵀ (``[HEAD_D, BLOCK_N]``: an
      8-bit ``wgmma`` reads its second operand along the keys), block j's scores are scaled
      by ``qk_scale · k_scales[j]`` (K's scale per block; Q's is in ``qk_scale`` already) and
      P is rounded to e4m3 into ``p_smem`` (``[ROWS, BLOCK_N]``) for P·V.

    Iteration j:  start S_j = Q K_jᵀ;  acc *= alpha_{j-1};  start acc += P_{j-1} V_{j-1};
    wait for S_j only (P V keeps running);  softmax(S_j) on the CUDA cores;  wait for P V.
    """
    MMA_K: gl.constexpr = 256 // k_smem.dtype.primitive_bitwidth  # 16 for bf16, 32 for e4m3
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, MMA_K])
    # bf16 P as the register operand of P·V: with k_width=2 this layout holds each thread's
    # elements of S where they already are, so the conversion moves no data. (FP8's P goes
    # through shared memory: see `_p_operand`.)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    # Block 0: its scores and softmax, with nothing to overlap yet.
    first = it0 % NUM_STAGES
    mbarrier.wait(k_ready.index(first), (it0 // NUM_STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(first).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    if WS:
        mbarrier.arrive(k_empty.index(first))
    tile_scale = qk_scale * gl.load(k_scales) if FP8 else qk_scale
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, tile_scale, row0, 0, n_full <= 0, CAUSAL, ROWS, BLOCK_N,
                                         s_layout)
    p_op = _p_operand(p, p_smem, p_layout, FP8)

    for j in range(1, n_blocks):
        slot = (it0 + j) % NUM_STAGES
        phase = ((it0 + j) // NUM_STAGES) & 1
        prev = (it0 + j - 1) % NUM_STAGES
        prev_phase = ((it0 + j - 1) // NUM_STAGES) & 1
        if PINGPONG:  # turn t: consumer 0's first wait passes at once, consumer 1 waits for it
            mbarrier.wait(turn.index(CONSUMER), ((turn0 + j - 1) & 1) ^ (1 - CONSUMER))
        mbarrier.wait(k_ready.index(slot), phase)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        mbarrier.wait(v_ready.index(prev), prev_phase)
        acc_tok = warpgroup_mma(p_op, _v_operand(v_smem.index(prev), FP8), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - CONSUMER))
        # Matmul groups retire in order: leaving 1 outstanding retires S_j and keeps P V running.
        s = warpgroup_mma_wait(1, deps=[s_tok])
        if WS:
            mbarrier.arrive(k_empty.index(slot))
        tile_scale = qk_scale * gl.load(k_scales + j) if FP8 else qk_scale
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, tile_scale, row0, j * BLOCK_N, j >= n_full, CAUSAL,
                                             ROWS, BLOCK_N, s_layout)
        acc, p_op = _wait_pv(acc_tok, p_op, FP8)
        if WS:
            mbarrier.arrive(v_empty.index(prev))
        else:  # both warpgroups are done with slot `prev`: refill it with block j - 1 + NUM_STAGES
            _warps_barrier()
            nxt = j - 1 + NUM_STAGES
            more = nxt < n_blocks
            mbarrier.expect(k_ready.index(prev), k_desc.block_type.nbytes, pred=more)
            _tma_load(k_desc, [kv_row0 + nxt * BLOCK_N, 0], k_ready.index(prev), k_smem.index(prev), pred=more)
            mbarrier.expect(v_ready.index(prev), v_desc.block_type.nbytes, pred=more)
            _tma_load(v_desc, [kv_row0 + nxt * BLOCK_N, 0], v_ready.index(prev), v_smem.index(prev), pred=more)
        p_op = _p_operand(p, p_smem, p_layout, FP8)

    # The last block's P V.
    last = (it0 + n_blocks - 1) % NUM_STAGES
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(last), ((it0 + n_blocks - 1) // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, _v_operand(v_smem.index(last), FP8), acc, is_async=True)
    acc, p_op = _wait_pv(acc_tok, p_op, FP8)
    if WS:
        mbarrier.arrive(v_empty.index(last))
    return acc, m_i, l_i


@gluon.jit
def _store_rows(acc, m_i, l_i, o_smem, o_desc, lse_ptr, o_row, ROWS: gl.constexpr, out_scale=1.0):
    """FA2's epilogue: ``O = acc / l`` in bf16 through ``o_smem`` (in bf16 the rows' Q buffer, no
    longer read) and one TMA store at row ``o_row`` of the 2-D ``[batch·heads·seq, HEAD_D]`` output;
    ``lse = (m + log2 l)·ln 2`` (natural log) to ``lse_ptr[o_row:o_row + ROWS]``. ``out_scale``
    multiplies O (FP8: V's scale)."""
    o_layout: gl.constexpr = acc.type.layout
    o = acc * (out_scale / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)))[:, None]
    o_smem.store(o.to(gl.bfloat16))
    fence_async_shared()  # ordinary stores to shared memory, then the TMA (async proxy) reads them
    _warps_barrier()  # every warp's rows are in place before the copy starts
    _tma_store(o_desc, [o_row, 0], o_smem)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + o_row + gl.arange(0, ROWS, lse.type.layout), lse)
    tma.store_wait(0)


@gluon.jit
def _tile_coordinates(tile, seq_len, q_heads, group, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query tile ``tile`` of ``(seq_len / 128) · batch · q_heads``: heads outermost (programs
    running together share K/V in L2) and within a head the longest causal rows first; and
    where its rows sit in the 2-D views: ``(row0, q_row, kv_bh, n_blocks)`` (``kv_bh``: the
    index of its K/V head among all of the batch's, whose rows start at ``kv_bh · seq_len``)."""
    n_m = seq_len // 128
    row0 = (n_m - 1 - tile % n_m) * 128
    bh = tile // n_m
    kv_bh = (bh // q_heads) * (q_heads // group) + (bh % q_heads) // group  # GQA: shared K/V
    if CAUSAL:
        n_blocks = (row0 + 128) // BLOCK_N
    else:
        n_blocks = seq_len // BLOCK_N
    return row0, bh * seq_len + row0, kv_bh, n_blocks


# ----------------------------------------------------------------------------------------
# Kernel 1: software-pipelined, one kind of warp
# ----------------------------------------------------------------------------------------
@gluon.jit
def _pipelined_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, seq_len, q_heads, group, qk_scale,
                      CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                      NUM_STAGES: gl.constexpr):
    """Grid ``(seq / 128 · batch · q_heads,)``, 8 warps. Descriptors over the 2-D views
    ``[rows, HEAD_D]``: Q and O in 128-row blocks, K and V in ``BLOCK_N``-row blocks."""
    row0, q_row, kv_bh, n_blocks = _tile_coordinates(gl.program_id(0), seq_len, q_heads, group, CAUSAL, BLOCK_N)
    kv_row0 = kv_bh * seq_len
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [128, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_ready, q_smem)
    for i in gl.static_range(NUM_STAGES):  # fill the ring
        more = i < n_blocks
        mbarrier.expect(k_ready.index(i), k_desc.block_type.nbytes, pred=more)
        _tma_load(k_desc, [kv_row0 + i * BLOCK_N, 0], k_ready.index(i), k_smem.index(i), pred=more)
        mbarrier.expect(v_ready.index(i), v_desc.block_type.nbytes, pred=more)
        _tma_load(v_desc, [kv_row0 + i * BLOCK_N, 0], v_ready.index(i), v_smem.index(i), pred=more)
    mbarrier.wait(q_ready, 0)

    acc, m_i, l_i = _attend_rows(q_smem, k_smem, v_smem, k_ready, v_ready, k_ready, v_ready, k_ready,
                                 k_desc, v_desc, kv_row0, n_blocks, (row0 + 1) // BLOCK_N, row0, qk_scale,
                                 lse_ptr, q_smem, 0, 0,  # (no K scales, no P buffer, one tile, no turns)
                                 0, False, False, CAUSAL, 128, BLOCK_N, HEAD_D, NUM_STAGES, 8)
    _warps_barrier()  # both warpgroups are done with Q before its buffer takes O
    _store_rows(acc, m_i, l_i, q_smem, o_desc, lse_ptr, q_row, 128)


# ----------------------------------------------------------------------------------------
# Kernel 2: a loader warp and two consumer warpgroups (optionally in ping-pong)
# ----------------------------------------------------------------------------------------
@gluon.jit
def _consumer(q_smem, k_smem, v_smem, o_smem, p_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
              k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, seq_len, q_heads, group, n_tiles,
              qk_scale, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr,
              HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, FP8: gl.constexpr):
    """One consumer warpgroup: rows ``[64·CONSUMER, 64·CONSUMER + 64)`` of each of this
    program's tiles (``pid, pid + #programs, ...``: one tile unless the grid is persistent).
    Q comes in two buffers, the tiles alternating between them; a buffer is given back
    (``q_empty``) once this consumer's output, staged in it in bf16, has been stored.
    ``FP8``: the scales are fp32 arrays ``q_scales [batch·q_heads·seq/64]``, ``k_scales
    [batch·kv_heads·seq/BLOCK_N]`` and ``v_scales [batch·kv_heads]``, in row order."""
    it0 = 0  # K/V blocks this program's ring has passed
    turn0 = 0  # ping-pong turns taken
    i = 0  # tiles done
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        row0, q_row, kv_bh, n_blocks = _tile_coordinates(tile, seq_len, q_heads, group, CAUSAL, BLOCK_N)
        buf = i % 2
        my_q = q_smem.index(buf * 2 + CONSUMER)
        my_row0 = row0 + CONSUMER * 64
        o_row = q_row + CONSUMER * 64
        if FP8:
            rows_scale = qk_scale * gl.load(q_scales + o_row // 64)
            out_scale = gl.load(v_scales + kv_bh)
            my_o = o_smem.index(CONSUMER)
        else:
            rows_scale = qk_scale
            out_scale = 1.0
            my_o = my_q
        mbarrier.wait(q_ready.index(buf), (i // 2) & 1)
        acc, m_i, l_i = _attend_rows(my_q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                     k_desc, v_desc, kv_bh * seq_len, n_blocks, (my_row0 + 1) // BLOCK_N, my_row0,
                                     rows_scale, k_scales + kv_bh * (seq_len // BLOCK_N), p_smem.index(CONSUMER),
                                     it0, turn0, CONSUMER, True, PINGPONG, CAUSAL, 64, BLOCK_N, HEAD_D, NUM_STAGES,
                                     4, FP8)
        _store_rows(acc, m_i, l_i, my_o, o_desc, lse_ptr, o_row, 64, out_scale)
        mbarrier.arrive(q_empty.index(buf))
        it0 += n_blocks
        turn0 += n_blocks - 1
        i += 1


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
            seq_len, q_heads, group, n_tiles, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_STAGES: gl.constexpr, FP8: gl.constexpr):
    """One warp, for each of this program's tiles: the two 64-row halves of Q into the tile's
    Q buffer, then K_j and V_j into the rings, which run on from one tile to the next (so a
    persistent program loads the next tile while the consumers finish this one). A slot or a
    Q buffer is reused once both consumers arrived on its empty barrier (count 2); on the first
    pass the wait is for parity 1, which a fresh barrier reports as complete. ``FP8``: V's
    tiles come from Vᵀ, ``[batch·kv_heads·HEAD_D, seq]``, columns ``j·BLOCK_N`` onwards of the
    head's rows."""
    it = 0
    i = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        row0, q_row, kv_bh, n_blocks = _tile_coordinates(tile, seq_len, q_heads, group, CAUSAL, BLOCK_N)
        kv_row0 = kv_bh * seq_len
        buf = i % 2
        mbarrier.wait(q_empty.index(buf), ((i // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(buf), 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, 0], q_ready.index(buf), q_smem.index(buf * 2))
        _tma_load(q_desc, [q_row + 64, 0], q_ready.index(buf), q_smem.index(buf * 2 + 1))
        for j in range(n_blocks):
            slot = (it + j) % NUM_STAGES
            free_phase = (((it + j) // NUM_STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), free_phase)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row0 + j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), free_phase)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            if FP8:
                _tma_load(v_desc, [kv_bh * v_desc.block_type.shape[0], j * BLOCK_N], v_ready.index(slot),
                          v_smem.index(slot))
            else:
                _tma_load(v_desc, [kv_row0 + j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))
        it += n_blocks
        i += 1


@gluon.jit
def _warp_specialized_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, seq_len,
                             q_heads, group, n_tiles, qk_scale, CAUSAL: gl.constexpr, HEAD_D: gl.constexpr,
                             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, FP8: gl.constexpr = False):
    """A 1-d grid over the ``n_tiles = seq / 128 · batch · q_heads`` query tiles: one program
    per tile, or fewer (persistent: each takes tiles ``pid, pid + #programs, ...``).
    ``num_warps=4`` (consumer 0, the default partition) plus the workers: consumer 1 (4 warps)
    and the loader (1 warp). Q and O blocks of 64 rows, K blocks of ``BLOCK_N`` rows, V blocks
    of ``BLOCK_N`` rows (FP8: of Vᵀ, ``HEAD_D`` rows by ``BLOCK_N`` keys). Q has two buffers
    (``[tile parity · 2 + consumer]``), so that a persistent program loads the next tile's Q
    while it finishes this one. In bf16 each consumer's Q buffer takes its O for the store;
    in FP8 O (bf16) is twice the size of Q (e4m3) and has buffers of its own."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [4, 64, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    if FP8:
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, HEAD_D, BLOCK_N], v_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [2, 64, HEAD_D], o_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.float8e4nv)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, BLOCK_N], p_layout)
    else:
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_D], v_desc.layout)
        o_smem = q_smem
        p_smem = q_smem  # (unused)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)  # the loader's expect() is the one arrival
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    # The argument tuples are written in place: a tuple kept in a variable would turn its
    # constexpr members (the consumer's index among them) into run-time values.
    gl.warp_specialize(
        [(_consumer, (q_smem, k_smem, v_smem, o_smem, p_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                      turn, k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, seq_len, q_heads, group,
                      n_tiles, qk_scale, 0, PINGPONG, CAUSAL, HEAD_D, BLOCK_N, NUM_STAGES, FP8)),
         (_consumer, (q_smem, k_smem, v_smem, o_smem, p_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                      turn, k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, seq_len, q_heads, group,
                      n_tiles, qk_scale, 1, PINGPONG, CAUSAL, HEAD_D, BLOCK_N, NUM_STAGES, FP8)),
         (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                    v_empty, seq_len, q_heads, group, n_tiles, CAUSAL, BLOCK_N, NUM_STAGES, FP8))],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


# ----------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------
def default_tiles(head_dim: int, fp8: bool = False) -> tuple[int, int]:
    """``(block_n, num_stages)``, from a sweep on the H100 (``bench/results/raw/
    nvidia-h100.gluon_tile_sweep.log``). Shared memory per program: Q (128·d·e bytes, e = 2 in
    bf16, 1 in e4m3; two tiles of it in the warp-specialized kernel) plus, per stage, a K and a
    V tile (2·block_n·d·e bytes), plus in FP8 the bf16 output and e4m3 P buffers: at d = 128 in
    bf16 the warp-specialized kernel takes 192 KiB of the 227 KiB an SM offers with two
    stages, and a third would not fit. A power-of-two
    stage count keeps the ring's slot and phase arithmetic to shifts and masks (three stages
    ran up to 11 % slower than two or four at d = 64)."""
    if fp8:
        return (128, 2)
    return (128, 2) if head_dim == 128 else (128, 4)


def gluon_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `flash_attention_gluon` takes these inputs: a CUDA device of compute
    capability 9.x, bf16, head_dim 64 or 128, equal lengths that are multiples of 128, GQA
    heads, and a Triton whose Gluon API this module knows."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and tuple(int(x) for x in triton.__version__.split(".")[:2]) in GLUON_VERSIONS
            and _reason(q, k, v) is None)


def _reason(q, k, v) -> str | None:
    """Why these inputs are out of scope, or None."""
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return f"q, k, v must be bf16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        return (f"q, k, v must be [batch, heads, seq, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}")
    b, h, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (s, d) or h % k.shape[1]:
        return f"k, v must be [batch, kv_heads, seq, head_dim] with q_heads % kv_heads == 0, got {tuple(k.shape)}"
    if d not in (64, 128):
        return f"head_dim must be 64 or 128, got {d}"
    if s % BLOCK_M or s == 0:
        return f"seq must be a positive multiple of {BLOCK_M}, got {s}"
    return None


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


def _descriptor(t2d: torch.Tensor, rows: int, cols: int | None = None) -> TensorDescriptor:
    """A TMA descriptor over the 2-D ``t2d`` in ``[rows, cols]`` blocks (cols: whole rows)."""
    block = [rows, cols or t2d.shape[1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t2d.dtype])
    return TensorDescriptor.from_tensor(t2d, block, layout)


def flash_attention_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                          scale: float | None = None, variant: str = "ws", block_n: int | None = None,
                          num_stages: int | None = None, consumer_regs: int = 240, loader_regs: int = 24,
                          persistent: bool | int | None = None, compile_only: bool = False):
    """``softmax(scale · q kᵀ + mask) v`` with the Gluon kernels (forward only).

    - ``q: [batch, q_heads, seq, head_dim]``, ``k, v: [batch, kv_heads, seq, head_dim]``, bf16,
      ``q_heads % kv_heads == 0``, head_dim 64 or 128, ``seq`` a multiple of 128 (ValueError
      otherwise); non-contiguous inputs are copied;
    - ``causal``: query i sees keys ``j <= i``; ``scale`` defaults to ``1/sqrt(head_dim)``;
    - ``variant``: one of `VARIANTS`; ``block_n`` (64 or 128) and ``num_stages`` default to
      `default_tiles`; ``consumer_regs`` / ``loader_regs``: registers per thread of the
      warp-specialized partitions (``setmaxnreg``); ``persistent`` (warp-specialized kernels):
      True for one program per SM taking tiles in turn instead of one per tile, or a number of
      programs (the tests use a few, so that each takes many tiles); None (the default): as
      `persistent_by_default` says.

    Returns ``(out [batch, q_heads, seq, head_dim] bf16, lse [batch, q_heads, seq] fp32,
    natural log)``; with ``compile_only``, compiles without launching and returns the
    compiled kernel (``.asm``, ``.metadata``)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    reason = _reason(q, k, v)
    if reason:
        raise ValueError(reason)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _launch(q, k, v, None, causal, scale, variant, block_n, num_stages, consumer_regs, loader_regs,
                   persistent, compile_only)


def flash_attention_gluon_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                              scale: float | None = None, variant: str = "ws", prepared: tuple | None = None,
                              block_n: int | None = None, num_stages: int | None = None, consumer_regs: int = 240,
                              loader_regs: int = 24, persistent: bool | int | None = None,
                              compile_only: bool = False):
    """The warp-specialized kernel with e4m3 matmuls: Q in blocks of 64 rows (one consumer's
    rows) and K in blocks of ``block_n`` keys, each with its own scale, V with one scale per
    head, fp32 accumulation (the quantization of `minillm.kernels.ch04_flash_attention_hopper.
    quantize_blocks`). Inputs, scope and result as `flash_attention_gluon` (bf16 in, bf16
    out); ``variant``: ``"ws"`` or ``"ws_pingpong"``; ``prepared``: `prepare_gluon_fp8`'s
    result for these inputs, to time the kernel without the quantization."""
    if variant not in VARIANTS[1:]:
        raise ValueError(f"the FP8 kernel is warp-specialized: variant must be one of {VARIANTS[1:]}, got {variant!r}")
    reason = _reason(q, k, v)
    if reason:
        raise ValueError(reason)
    block_n = block_n or default_tiles(q.shape[-1], fp8=True)[0]
    prepared = prepared or prepare_gluon_fp8(q, k, v, block_n)
    return _launch(*prepared, causal, scale, variant, block_n, num_stages, consumer_regs, loader_regs,
                   persistent, compile_only, out_shape=q.shape)


def prepare_gluon_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int = 128) -> tuple:
    """``(q8, k8, v8ᵀ, (q_scales, k_scales, v_scales))`` for `flash_attention_gluon_fp8`: e4m3
    ``q8 [b, h, s, d]``, ``k8 [b, h_kv, s, d]``, ``v8ᵀ [b, h_kv, d, s]`` and their fp32 scales
    (per 64 query rows, per ``block_n`` keys, per head of V)."""
    from minillm.kernels.ch04_flash_attention_hopper import quantize_blocks

    q8, q_scales = quantize_blocks(q, 64)
    k8, k_scales = quantize_blocks(k, block_n)
    v8t, v_scales = quantize_blocks(v, v.shape[2], transpose=True)
    return q8, k8, v8t, (q_scales, k_scales, v_scales)


#: Up to this length, the warp-specialized kernels run persistent by default (no causal mask).
PERSISTENT_MAX_SEQ = 8192


def persistent_by_default(variant: str, causal: bool, seq_len: int) -> bool:
    """Whether a kernel runs persistent unless told: the warp-specialized ones, without a
    causal mask, up to `PERSISTENT_MAX_SEQ` keys. Measured on the H100 (`bench/ch04_gluon.py`):
    a persistent program loads its next tile while it finishes this one, which hides the
    start of a tile (its Q and first K/V blocks): worth 10-18 % at 1k keys, a few percent at
    4-8k, and nothing measurable at 16k, where one run even lost 20 %. With a causal mask the
    tiles differ in length, and a fixed round robin of them leaves SMs idle at the end (a third
    slower at 16k), which one program per tile, handed out by the hardware as SMs free up,
    avoids."""
    return variant != "pipelined" and not causal and seq_len <= PERSISTENT_MAX_SEQ


def _launch(q, k, v, scales, causal, scale, variant, block_n, num_stages, consumer_regs, loader_regs, persistent,
            compile_only, out_shape=None):
    """Make the descriptors and launch (or compile) the kernel of ``variant``. ``scales``:
    None for bf16, else FP8's ``(q_scales, k_scales, v_scales)`` with ``v`` as Vᵀ."""
    if persistent is None:
        persistent = persistent_by_default(variant, causal, q.shape[2])
    fp8 = scales is not None
    b, h, s, d = q.shape
    default_n, default_stages = default_tiles(d, fp8)
    block_n, num_stages = block_n or default_n, num_stages or default_stages
    if block_n not in (64, 128):
        raise ValueError(f"block_n must be 64 or 128, got {block_n}")
    qk_scale = (1.0 / math.sqrt(d) if scale is None else float(scale)) * LOG2E
    out = torch.empty(out_shape or q.shape, device=q.device, dtype=torch.bfloat16)
    lse = torch.empty((b, h, s), device=q.device, dtype=torch.float32)
    k_desc = _descriptor(k.view(-1, d), block_n)
    # FP8: V's tiles are [d, block_n] blocks of Vᵀ, viewed as [b·h_kv·d, s].
    v_desc = _descriptor(v.view(-1, s), d, block_n) if fp8 else _descriptor(v.view(-1, d), block_n)
    n_tiles = s // BLOCK_M * b * h
    programs = num_sms(q.device) if persistent is True else int(persistent) or n_tiles
    grid = (min(n_tiles, programs),)
    if variant == "pipelined":
        if persistent:
            raise ValueError("the pipelined kernel has one program per tile: persistent=True needs a 'ws' variant")
        kernel, rows, args = _pipelined_kernel, BLOCK_M, (lse, s, h, h // k.shape[1], qk_scale)
        meta = dict(num_warps=8)
    else:
        q_scales, k_scales, v_scales = scales if fp8 else (lse, lse, lse)  # (bf16: unread)
        kernel, rows = _warp_specialized_kernel, 64
        args = (lse, q_scales, k_scales, v_scales, s, h, h // k.shape[1], n_tiles, qk_scale)
        meta = dict(PINGPONG=variant == "ws_pingpong", CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs,
                    FP8=fp8, num_warps=4)
    descriptors = (_descriptor(q.view(-1, d), rows), k_desc, v_desc, _descriptor(out.view(-1, d), rows))
    meta.update(CAUSAL=bool(causal), HEAD_D=d, BLOCK_N=block_n, NUM_STAGES=num_stages)
    if compile_only:
        return kernel.warmup(*descriptors, *args, grid=grid, **meta)
    kernel[grid](*descriptors, *args, **meta)
    return out, lse
