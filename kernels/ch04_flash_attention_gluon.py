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
   scores ``S_j = Q K_jᵀ`` are started before ``P_{j-1} V_{j-1}``, so that the softmax of
   block j may run while that second matmul is still on the tensor cores. (In the machine
   code it does not: ptxas moves the wait for the second matmul ahead of the softmax, in all
   three kernels; ``pin_softmax`` keeps the order, `_pin_before_wait`, and measured slower.)
   The same warps also refill the ring, after a barrier across the whole program.
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
(`default_schedule` says when that is the default), and share out their tiles in one of
several orders: with a causal mask, pairs of tiles of equal total length claimed from an
atomic counter. And both can run with **three consumer warpgroups** (``consumers=3``:
FA3's 192-row tiles at head dim 64, without a mask; at head dim 128 with 64-key tiles), 160
registers a thread instead of 240 (`CONSUMER_REGS`).

And `flash_attention_gluon_fp8`: the warp-specialized kernel with e4m3 matmuls (Hopper's FP8
tensor cores run at twice the bf16 rate): Q with one scale per 64 rows, K per ``block_n`` keys,
V per head, as in `flash_attention_fp8` of the Triton module. V's ring holds tiles of Vᵀ,
because an 8-bit ``wgmma`` reads its second operand along the reduction axis (the keys), with
the keys of each 16 in the order in which the 8-bit first operand reads P from the registers
that hold the scores (`P_KEY_ORDER`), so that P stays in registers (or, as the ablation, P
goes through shared memory); the softmax's row max is a tree (`_fold_halves`), and its row
sums come from the tensor cores (``row_sum_mma``, `_start_row_sum`: P times a tile of ones,
a third matmul per block, where the CUDA cores would add; `default_row_sum`).
Two of FlashAttention-4's changes to the softmax are switches of both kernels, off by default
(measured slower on an H200): a share of the exponentials computed by a polynomial on the FMA
units (``fma_exp2``, `_exp2_shared`) and a lazy running max (``lazy_rescale``, `_rescaled`).

And `flash_attention_gluon_backward`: FA3's backward with the same division of labour. One
program per 128 keys of one K/V head keeps dK and dV in the accumulators of two consumer
warpgroups (64 keys each) while a loader warp streams the blocks of Q and dO past them; the
scores are computed as Sᵀ = K Qᵀ, so that Pᵀ and dSᵀ already sit in registers as the first
operands of dV += Pᵀ dO and dK += dSᵀ Q. dQ is not kept anywhere: each step's tile
``dS K`` is added into an fp32 buffer in global memory by one TMA bulk reduction per warpgroup
(element-wise atomics, the alternative, took 11-35 % more time on an H200). At head dim 64 each
step's rows of the logsumexp and of D are loaded a step ahead (`default_prefetch_stats`).

Scope: bf16, ``q: [batch, q_heads, seq, head_dim]``, ``k, v: [batch, kv_heads, seq,
head_dim]`` (GQA: ``q_heads % kv_heads == 0``), head_dim 64 or 128, ``seq`` a multiple of 128
(every tile full: no bounds logic), queries and keys of the same length; causal masks on the
diagonal. `gluon_applies` says whether a call qualifies; `flash_attention_hopper` and
`flash_attention_hopper_backward` cover everything else.

Gluon kernels run on an NVIDIA GPU only: Triton's interpreter does not execute them, so the
CPU side of the tests checks the wrapper and, with a Triton whose Gluon API this module knows
(3.6, the version torch 2.11 ships, and 3.9), compiles the kernels for sm_90 without a GPU.
Gluon is experimental and renames things between releases; the three names that moved
between 3.6 and 3.9 are bound once in `minillm.kernels.base`, and the TMA reduction, which
3.6 offers only as an IR operation, is a small builtin of this module.
"""
from __future__ import annotations

import functools

import torch

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as gl_builtin

from minillm.kernels.base import (
    LOG2E, TRITON_VERSION, TensorAddress, TensorDescriptor, cached_descriptor, fence_async_shared, launch, mbarrier,
    num_sms, scale_and_window, tma, warpgroup_mma, warpgroup_mma_wait,
    gluon_tma_load as _tma_load, gluon_tma_store as _tma_store, gluon_warps_barrier as _warps_barrier,
    gluon_put_index as _write_tile, gluon_get_index as _read_tile, gluon_reinterpret as _reinterpret,
)
from minillm.reference.ch04_fp8 import EXP2_POLY_COEFFS, EXP2_POLY_MIN, ROUND_MAGIC


@gl_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord:] += src``: one TMA bulk reduction of the shared-memory tile ``src`` into
    the tensor of ``tensor_desc`` (``cp.reduce.async.bulk.tensor``; completion as a TMA store's,
    `tma.store_wait`). Triton 3.9 calls it ``tma.async_atomic_add``; 3.6 has only the IR op."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

#: Query rows per program (two warpgroups of 64).
BLOCK_M = 128
#: Registers per thread of a consumer warpgroup (``setmaxnreg``) for two consumers (a tile of
#: 128 query rows) and three (192 rows, FlashAttention-3's tile at head dim 64): with the loader's
#: warpgroup at 24, 2 · 4 · 32 · 240 and 3 · 4 · 32 · 160 both leave 64,512 of an SM's 65,536.
CONSUMER_REGS = {2: 240, 3: 160}
#: The three kernels, in the order the chapter builds them.
VARIANTS = ("pipelined", "ws", "ws_pingpong")
#: Triton versions whose Gluon API this module was compiled against.
GLUON_VERSIONS = ((3, 6), (3, 9))


# ----------------------------------------------------------------------------------------
# Helpers inside the kernel
# ----------------------------------------------------------------------------------------
@gluon.jit
def _column_halves(x):
    """``x [ROWS, W]`` as its two column halves ``[ROWS, W/2]``: each thread holds the
    elements of both (the accumulator layout repeats every 8 columns), so no data moves."""
    ROWS: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[1]
    return x.reshape([ROWS, 2, W // 2]).permute((0, 2, 1)).split()


@gluon.jit
def _fold_halves(x, MAX: gl.constexpr):
    """``x [ROWS, W]`` folded to ``[ROWS, 8]`` by adding (``MAX``: taking the larger of) its
    column halves (four times for W = 128): the elements of each half sit in the same thread
    as those of the other, so these are independent operations on registers (a tree), where
    `gl.max`/`gl.sum` along a thread's 32 elements of a row would be a chain of 32."""
    W: gl.constexpr = x.shape[1]
    for i in gl.static_range(4):
        if (W >> i) > 8:  # down to 8 columns: two per thread of a quad
            a, b = _column_halves(x)
            if MAX:
                x = gl.maximum(a, b)
            else:
                x = a + b
    return x


@gluon.jit
def _pin_before_wait(p, pin_smem):
    """Store a value that depends on every element of ``p`` (its column halves added, `_fold_halves`)
    into the scratch tile ``pin_smem [ROWS, 8]`` fp32, which nobody reads. A ``wgmma`` wait has
    no operands: ptxas must keep it before the first read of the accumulators in flight, and
    nothing in the softmax reads those of the P·V, so it puts the wait for that matmul, and the
    slot's release after it, before the exponentials (which then run with no matmul of this
    warpgroup in flight). It does not move a shared-memory store across the wait, so a store that needs
    every exponential keeps them all in front of it (`_attend_rows`' ``PIN_SOFTMAX``)."""
    pin_smem.store(_fold_halves(p, False))


#: `minillm.reference.ch04_fp8.exp2_polynomial`'s constants, as the kernel's compile-time values.
_EXP2_C0, _EXP2_C1, _EXP2_C2, _EXP2_C3 = (gl.constexpr(c) for c in EXP2_POLY_COEFFS)
_ROUND_MAGIC = gl.constexpr(ROUND_MAGIC)
_EXP2_MIN = gl.constexpr(EXP2_POLY_MIN)


@gluon.jit
def _exp2_on_fma(x):
    """``2^x`` (``x <= 0``) on the FMA and integer units instead of the special-function unit
    (MUFU, 16 exponentials per clock per SM): round, a cubic for the remainder, the integer
    part added into the exponent bits (`minillm.reference.ch04_fp8.exp2_polynomial`, the
    same steps in NumPy): eight instructions an element where MUFU takes one."""
    x = gl.maximum(x, _EXP2_MIN)
    t = x + _ROUND_MAGIC
    f = x - (t - _ROUND_MAGIC)
    p = ((_EXP2_C3 * f + _EXP2_C2) * f + _EXP2_C1) * f + _EXP2_C0
    bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _joined_halves(a, b):
    """The inverse of `_column_halves`. (``a`` may come from an earlier join, in a layout
    spelled differently but holding the same elements where ``b``'s does: a conversion
    without data movement.)"""
    ROWS: gl.constexpr = a.shape[0]
    W: gl.constexpr = a.shape[1] * 2
    return gl.join(gl.convert_layout(a, b.type.layout), b).permute((0, 2, 1)).reshape([ROWS, W])


@gluon.jit
def _exp2_shared(x, FMA_SHARE: gl.constexpr):
    """``2^x`` on a ``[ROWS, W]`` tile, the first ``W / FMA_SHARE`` columns by `_exp2_on_fma`
    and the rest by MUFU (``FMA_SHARE``: 0 for none, 2, 4 or 8), so that both kinds of unit
    work at once: FlashAttention-4's answer to the exponential as the bottleneck."""
    if FMA_SHARE == 0:
        y = gl.exp2(x)
    else:
        a, b = _column_halves(x)
        if FMA_SHARE == 2:
            a = _exp2_on_fma(a)
        else:
            a0, a1 = _column_halves(a)
            if FMA_SHARE == 4:
                a0 = _exp2_on_fma(a0)
            else:
                a00, a01 = _column_halves(a0)
                a0 = _joined_halves(_exp2_on_fma(a00), gl.exp2(a01))
            a = _joined_halves(a0, gl.exp2(a1))
        y = gl.convert_layout(_joined_halves(a, gl.exp2(b)), x.type.layout)
    return y


@gluon.jit
def _mask_keys(s, row0, col0, seq_len, CAUSAL: gl.constexpr):
    """``s [ROWS, W]`` (rows from ``row0``, keys from ``col0``, in the wgmma accumulator's
    layout) with ``-inf`` at the keys its rows may not see: above the diagonal (``CAUSAL``), or
    else past ``seq_len``."""
    layout: gl.constexpr = s.type.layout
    if CAUSAL:
        rows = row0 + gl.arange(0, s.shape[0], gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, s.shape[1], gl.SliceLayout(0, layout))
        s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    else:
        cols = col0 + gl.arange(0, s.shape[1], gl.SliceLayout(0, layout))
        s = gl.where(cols[None, :] < seq_len, s, float("-inf"))
    return s


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale, row0, col0, mask_this, CAUSAL: gl.constexpr,
                    TREE: gl.constexpr = False, FMA_EXP2: gl.constexpr = 0, SLACK: gl.constexpr = 0.0,
                    SUM: gl.constexpr = True):
    """One step of Chapter 3's online softmax in base 2 on a ``[ROWS, BLOCK_N]`` fp32 tile of
    raw scores ``s`` (in the wgmma accumulator's layout). ``m_i, l_i: [ROWS]``: running
    max (of ``s·qk_scale``) and sum; ``row0``/``col0``: sequence positions of the tile's first
    row and column; ``mask_this``: the tile straddles the diagonal (causal only).
    ``TREE``: the row max and sum as trees (`_fold_halves`), shorter chains of dependent
    instructions between the scores and P (FP8's default, where the matmuls no longer hide them).
    ``FMA_EXP2``: one column in this many of P's exponentials on the FMA units (`_exp2_shared`).
    ``SLACK`` (> 0): a row's running max moves only when the tile's exceeds it by more than
    ``SLACK`` (base-2 units): P then reaches at most ``2^SLACK``, and rows whose max stays keep
    ``alpha = 1`` (FlashAttention-4's lazy rescaling; see `_rescaled`). ``SUM`` False: the row
    sum is left to the tensor cores (`_start_row_sum`) and ``l_new`` is ``l_i`` unchanged.
    Returns ``(p, alpha, m_new, l_new)`` as `minillm.kernels.base.online_softmax_update`."""
    if CAUSAL:
        if mask_this:
            s = _mask_keys(s, row0, col0, 0, True)
    # The scale is positive, so it commutes with the max and folds into one FMA per score.
    if TREE:
        s_max = gl.convert_layout(gl.max(_fold_halves(s, True), axis=1), m_i.type.layout)
    else:
        s_max = gl.max(s, axis=1)
    m_new = gl.maximum(m_i, s_max * qk_scale)
    if SLACK > 0:
        m_new = gl.where(m_new > m_i + SLACK, m_new, m_i)
    p = _exp2_shared(s * qk_scale - m_new[:, None], FMA_EXP2)
    alpha = gl.exp2(m_i - m_new)
    if not SUM:
        l_new = l_i
    elif TREE:
        l_new = l_i * alpha + gl.convert_layout(gl.sum(_fold_halves(p, False), axis=1), l_i.type.layout)
    else:
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _rescaled(acc, alpha, o_rows: gl.constexpr, SLACK: gl.constexpr):
    """``acc`` with each row times ``alpha``; with a ``SLACK`` (`_online_softmax`), only when some
    row's max has moved (alpha < 1), which after the first blocks is rare: the multiplications
    (one per accumulator element, as many as the exponentials at head dim 128) are skipped."""
    if SLACK > 0:
        if gl.min(alpha, axis=0) < 1.0:
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    else:
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    return acc


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
    ``p_layout``; in FP8 through shared memory (``FP8 == 1``), e4m3 in ``p_smem``; in FP8 from
    registers (``FP8 == 2``), P itself, which `_p_for_mma` converts at the matmul."""
    if FP8 == 2:
        operand = p
    elif FP8:
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()  # ordinary stores, then the wgmma (async proxy) reads them
        _warps_barrier()  # every warp's rows are stored before the matmul starts
        operand = p_smem
    else:
        operand = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    return operand


@gluon.jit
def _p_for_mma(p_op, p_layout: gl.constexpr, FP8: gl.constexpr):
    """The first operand of P·V from what `_p_operand` returned. With P in registers in FP8
    (``FP8 == 2``), P crosses the loop in fp32 and becomes e4m3 here: held across the loop as
    bytes, each would take a 16-bit register of its own and be unpacked and packed again.

    An 8-bit operand holds four consecutive keys per thread where the scores hold two pairs
    eight keys apart (columns 2c, 2c+1, 2c+8, 2c+9 of each 16). Reading them in that order
    instead (a relabelling: no data moves) sums over the keys in the order `P_KEY_ORDER`, in
    which the host stored Vᵀ's keys."""
    if FP8 == 2:
        ROWS: gl.constexpr = p_op.shape[0]
        BLOCK_N: gl.constexpr = p_op.shape[1]
        p = p_op.reshape([ROWS, BLOCK_N // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([ROWS, BLOCK_N])
        p = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=p_layout.parent, k_width=4))
        operand = p.to(gl.float8e4nv)
    else:
        operand = p_op
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
def _start_row_sum(p_mma, ones_smem, l_acc, alpha, FP8: gl.constexpr):
    """Start ``l_acc · alpha + P · 1`` as a matmul (``ROW_SUM`` of `_attend_rows`): the row sums
    of P from the tensor cores, as a second product with the ``[BLOCK_N, 8]`` ones of
    ``ones_smem`` (stored ``[8, BLOCK_N]``, as K's tiles are), where the softmax would add
    each thread's 64 values of P and shuffle the partial sums across its quad. ``l_acc:
    [ROWS, 8]`` fp32 holds each row's sum in all 8 columns; ``p_mma``: P as `_p_for_mma`
    returned it, from registers (the same elements in the same threads: wgmma's first
    operand does not depend on the width of the product) or, in FP8 == 1, shared memory.
    What it sums is P as rounded for P·V, so the division at the end uses the weights the
    output was built from."""
    sum_layout: gl.constexpr = l_acc.type.layout
    l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, sum_layout))[:, None]
    if FP8 == 1:
        a = p_mma
    else:
        a = gl.convert_layout(p_mma, gl.DotOperandLayout(operand_index=0, parent=sum_layout,
                                                         k_width=4 if FP8 else 2))
    return warpgroup_mma(a, ones_smem.permute((1, 0)), l_acc, is_async=True)


@gluon.jit
def _wait_turn(turn, CONSUMER: gl.constexpr, t):
    """Ping-pong: wait for this consumer's ``t``-th turn at the tensor cores. The turns go round
    the consumers in a ring (each passes on by arriving on the next one's barrier), and
    consumer 0's first wait is for parity 1, which a fresh barrier reports as complete."""
    if CONSUMER == 0:
        mbarrier.wait(turn.index(0), (t & 1) ^ 1)
    else:
        mbarrier.wait(turn.index(CONSUMER), t & 1)


@gluon.jit
def _attend_rows(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                 k_desc, v_desc, kv_row0, n_blocks, n_full, row0, qk_scale, k_scales, p_smem, it0, turn0,
                 CONSUMER: gl.constexpr, WS: gl.constexpr, PINGPONG: gl.constexpr,
                 CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                 FP8: gl.constexpr = False, TREE: gl.constexpr = False, FMA_EXP2: gl.constexpr = 0,
                 SLACK: gl.constexpr = 0.0, CONSUMERS: gl.constexpr = 2, ones_smem=None,
                 ROW_SUM: gl.constexpr = False, PIN_SOFTMAX: gl.constexpr = False, pin_smem=None):
    """The key loop of one set of query rows: returns ``(acc [ROWS, HEAD_D] fp32, not yet
    divided by l; m_i, l_i [ROWS])`` for ``softmax(Q Kᵀ · scale) V`` over ``n_blocks`` blocks.

    ``q_smem: [ROWS, HEAD_D]`` (loaded); ``k_smem, v_smem: [NUM_STAGES, BLOCK_N, HEAD_D]``
    rings, which have already passed ``it0`` blocks (of earlier tiles of a persistent
    program): block j sits in slot ``(it0 + j) % NUM_STAGES``, and its ``*_ready`` barrier
    completes phase ``((it0 + j) // NUM_STAGES) & 1`` when the copy has landed.

    - ``WS``: a consumer frees a slot by arriving on ``*_empty`` (the loader warp refills it);
      else these warps refill it themselves.
    - ``PINGPONG``: wait for ``turn[CONSUMER]`` before starting the matmuls, pass the turn on
      to the next of the ``CONSUMERS`` right after (``turn0``: turns taken in earlier tiles).
    - ``FP8``: Q, K and V are e4m3, V's ring holds tiles of Vᵀ (``[HEAD_D, BLOCK_N]``: an
      8-bit ``wgmma`` reads its second operand along the keys), block j's scores are scaled
      by ``qk_scale · k_scales[j]`` (K's scale per block; Q's is in ``qk_scale`` already) and
      P is rounded to e4m3: ``FP8 == 1`` into ``p_smem`` (``[ROWS, BLOCK_N]``) for P·V,
      ``FP8 == 2`` in registers, Vᵀ's keys stored in `P_KEY_ORDER` (`_p_for_mma`).
    - ``TREE``, ``FMA_EXP2``, ``SLACK``: the softmax's row max and sum as trees, a share of
      its exponentials on the FMA units, a lazy running max (`_online_softmax`, `_rescaled`).
    - ``ROW_SUM``: the row sums of P as a third matmul, ``P · 1`` with the ones of ``ones_smem``,
      started with each P·V (`_start_row_sum`), instead of on the CUDA cores.
    - ``PIN_SOFTMAX`` (``WS``, P in registers): keep the softmax in front of the wait for P·V in
      the machine code too (`_pin_before_wait`, into ``pin_smem [ROWS, 8]``): without it ptxas
      moves that wait, and the slot's release, up to just after the wait for S_j.

    Iteration j:  start S_j = Q K_jᵀ;  acc *= alpha_{j-1};  start acc += P_{j-1} V_{j-1};
    wait for S_j only (P V keeps running);  softmax(S_j) on the CUDA cores;  wait for P V
    (in the source: ptxas moves that last wait up to the first unless ``PIN_SOFTMAX``).
    """
    MMA_K: gl.constexpr = 256 // k_smem.dtype.primitive_bitwidth  # 16 for bf16, 32 for e4m3
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_D, MMA_K])
    # bf16 P as the register operand of P·V: with k_width=2 this layout holds each thread's
    # elements of S where they already are, so the conversion moves no data. (FP8's P: see
    # `_p_operand` and `_p_for_mma`.)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    sum_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                         instr_shape=[16, 8, MMA_K])
    l_acc = gl.zeros([ROWS, 8], gl.float32, sum_layout)
    # Matmul groups retire in order: with S_j started first, leaving the ones after it (P V,
    # and the row sum) outstanding retires S_j only.
    AFTER_S: gl.constexpr = 2 if ROW_SUM else 1

    # Block 0: its scores and softmax, with nothing to overlap yet.
    first = it0 % NUM_STAGES
    mbarrier.wait(k_ready.index(first), (it0 // NUM_STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(first).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    if WS:
        mbarrier.arrive(k_empty.index(first))
    tile_scale = qk_scale * gl.load(k_scales) if FP8 else qk_scale
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, tile_scale, row0, 0, n_full <= 0, CAUSAL, TREE, FMA_EXP2,
                                         SLACK, not ROW_SUM)
    p_op = _p_operand(p, p_smem, p_layout, FP8)

    for j in range(1, n_blocks):
        slot = (it0 + j) % NUM_STAGES
        phase = ((it0 + j) // NUM_STAGES) & 1
        prev = (it0 + j - 1) % NUM_STAGES
        prev_phase = ((it0 + j - 1) // NUM_STAGES) & 1
        if PINGPONG:
            _wait_turn(turn, CONSUMER, turn0 + j - 1)
        mbarrier.wait(k_ready.index(slot), phase)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = _rescaled(acc, alpha, o_rows, SLACK)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        p_mma = _p_for_mma(p_op, p_layout, FP8)
        acc_tok = warpgroup_mma(p_mma, _v_operand(v_smem.index(prev), FP8), acc, is_async=True)
        if ROW_SUM:
            l_tok = _start_row_sum(p_mma, ones_smem, l_acc, alpha, FP8)
        if PINGPONG:
            mbarrier.arrive(turn.index((CONSUMER + 1) % CONSUMERS))
        s = warpgroup_mma_wait(AFTER_S, deps=[s_tok])
        if WS:
            mbarrier.arrive(k_empty.index(slot))
        tile_scale = qk_scale * gl.load(k_scales + j) if FP8 else qk_scale
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, tile_scale, row0, j * BLOCK_N, j >= n_full, CAUSAL,
                                             TREE, FMA_EXP2, SLACK, not ROW_SUM)
        if PIN_SOFTMAX:
            _pin_before_wait(p, pin_smem)
        acc, p_op = _wait_pv(acc_tok, p_op, FP8)
        if ROW_SUM:
            l_acc = warpgroup_mma_wait(0, deps=[l_tok])
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
    acc = _rescaled(acc, alpha, o_rows, SLACK)
    mbarrier.wait(v_ready.index(last), ((it0 + n_blocks - 1) // NUM_STAGES) & 1)
    p_mma = _p_for_mma(p_op, p_layout, FP8)
    acc_tok = warpgroup_mma(p_mma, _v_operand(v_smem.index(last), FP8), acc, is_async=True)
    if ROW_SUM:
        l_tok = _start_row_sum(p_mma, ones_smem, l_acc, alpha, FP8)
    acc, p_op = _wait_pv(acc_tok, p_op, FP8)
    if WS:
        mbarrier.arrive(v_empty.index(last))
    if ROW_SUM:  # every column holds the sum: the max takes one exactly
        l_acc = warpgroup_mma_wait(0, deps=[l_tok])
        l_i = gl.convert_layout(gl.max(l_acc, axis=1), m_i.type.layout)
    return acc, m_i, l_i


@gluon.jit
def _wide_softmax(s_a, s_b, m_i, qk_scale, row0, j, n_full, seq_len, CAUSAL: gl.constexpr):
    """`_online_softmax` (trees, no row sum) on the ``j``-th 192-key block, held as two tiles:
    ``s_a [ROWS, 128]`` (keys ``192·j`` on) and ``s_b [ROWS, 64]`` (keys ``192·j + 128`` on), in
    the layouts of their wgmma accumulators. The block is masked from block ``n_full`` on under
    a causal mask, else where it runs past ``seq_len`` (the last block of a head whose length
    is not a multiple of 192: its keys past the end are another head's, or TMA's zeros).
    Returns ``(p_a, p_b, alpha, m_new)``."""
    N_A: gl.constexpr = s_a.shape[1]
    b_layout: gl.constexpr = s_b.type.layout
    col0 = j * 192
    masked = j >= n_full if CAUSAL else (j + 1) * 192 > seq_len
    if masked:
        s_a = _mask_keys(s_a, row0, col0, seq_len, CAUSAL)
        s_b = _mask_keys(s_b, row0, col0 + N_A, seq_len, CAUSAL)
    folded_a = _fold_halves(s_a, True)
    folded = gl.maximum(folded_a, gl.convert_layout(_fold_halves(s_b, True), folded_a.type.layout))
    s_max = gl.convert_layout(gl.max(folded, axis=1), m_i.type.layout)
    m_new = gl.maximum(m_i, s_max * qk_scale)
    p_a = gl.exp2(s_a * qk_scale - m_new[:, None])
    p_b = gl.exp2(s_b * qk_scale - gl.convert_layout(m_new, gl.SliceLayout(1, b_layout))[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p_a, p_b, alpha, m_new


@gluon.jit
def _wide_sums(p_a, p_b, l_i, alpha):
    """``l_i · alpha`` plus the row sums of both tiles of P (trees, on the CUDA cores)."""
    folded_a = _fold_halves(p_a, False)
    folded = folded_a + gl.convert_layout(_fold_halves(p_b, False), folded_a.type.layout)
    return l_i * alpha + gl.convert_layout(gl.sum(folded, axis=1), l_i.type.layout)


@gluon.jit
def _start_wide_pv(p_a, p_b, v_tile, acc, ones_smem, l_acc, alpha, p_layout: gl.constexpr, ROW_SUM: gl.constexpr):
    """Start ``acc += P V`` for a 192-key block as two chained matmuls (keys 0-127, then 128-191
    of the ``[HEAD_D, 256]`` slot of Vᵀ), P converted to e4m3 as it goes in (`_p_for_mma`), and
    with ``ROW_SUM`` the row sums ``l_acc · alpha + P · 1`` likewise (`_start_row_sum`; ones
    ``[8, 256]``). Returns the tokens of the two accumulators (``l_acc`` as given without)."""
    pa_mma = _p_for_mma(p_a, p_layout, 2)
    pb_mma = _p_for_mma(p_b, p_layout, 2)
    N_A: gl.constexpr = p_a.shape[1]
    N_B: gl.constexpr = p_b.shape[1]
    acc_tok = warpgroup_mma(pa_mma, v_tile.slice(0, N_A, dim=1).permute((1, 0)), acc, is_async=True)
    acc_tok = warpgroup_mma(pb_mma, v_tile.slice(N_A, N_B, dim=1).permute((1, 0)), acc_tok, is_async=True)
    if ROW_SUM:
        l_tok = _start_row_sum(pa_mma, ones_smem.slice(0, N_A, dim=1), l_acc, alpha, 2)
        sum_layout: gl.constexpr = l_acc.type.layout
        pb_sum = gl.convert_layout(pb_mma, gl.DotOperandLayout(operand_index=0, parent=sum_layout, k_width=4))
        l_tok = warpgroup_mma(pb_sum, ones_smem.slice(N_A, N_B, dim=1).permute((1, 0)), l_tok, is_async=True)
    else:
        l_tok = l_acc
    return acc_tok, l_tok


@gluon.jit
def _start_wide_scores(q_smem, k_tile, sa_zero, sb_zero):
    """Start both tiles of a 192-key block's scores, ``Q K_jᵀ`` for keys 0-127 and 128-191 of
    the ring slot ``k_tile [256, HEAD_D]``. Returns their tokens."""
    N_A: gl.constexpr = sa_zero.shape[1]
    N_B: gl.constexpr = sb_zero.shape[1]
    sa_tok = warpgroup_mma(q_smem, k_tile.slice(0, N_A).permute((1, 0)), sa_zero, use_acc=False, is_async=True)
    sb_tok = warpgroup_mma(q_smem, k_tile.slice(N_A, N_B).permute((1, 0)), sb_zero, use_acc=False, is_async=True)
    return sa_tok, sb_tok


@gluon.jit
def _attend_rows_wide(q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, n_blocks, n_full, row0,
                      seq_len, qk_scale, k_scales, it0, turn0, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr,
                      CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr,
                      CONSUMERS: gl.constexpr, ones_smem, ROW_SUM: gl.constexpr):
    """`_attend_rows` for FP8 with 192-key blocks (FlashAttention-3's code takes 128 × 224 tiles
    for e4m3 at head dim 128, and 128 × 192 when V comes column-major, as our Vᵀ does), the
    warp-specialized kernels only, P in registers. Gluon's tensors have power-of-two shapes, so a
    block is two tiles, keys 0-127 and 128-191, each its own wgmma, in ring slots of 256 keys
    (``k_smem [NUM_STAGES, 256, HEAD_D]``, ``v_smem [NUM_STAGES, HEAD_D, 256]`` of Vᵀ; the last
    64 unused). The wider block spreads what every block costs whatever its width (waiting on
    barriers, issuing the matmuls, the row max's shuffles, the rescaling of the accumulator)
    over 1.5 times the keys.

    The order within an iteration differs from `_attend_rows`': P·V of the last block is started
    *before* the scores of this one. The registers decide it: P in fp32 (96 a thread), the two
    score accumulators (96) and the output's (64) cannot all be live at once within 240, and
    starting P·V first converts P to e4m3 (48) before the scores' accumulators are taken. What
    is lost is the chance to run the softmax under P·V, which the machine code of the other
    order does not take either (ptxas moves the wait for P·V up to the wait for the scores)."""
    MMA_K: gl.constexpr = 32
    N_A: gl.constexpr = 128
    N_B: gl.constexpr = 64
    sa_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, N_A, MMA_K])
    sb_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, N_B, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, MMA_K])
    sum_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 8, MMA_K])
    # (`_p_for_mma` reads only this layout's parent, the accumulator's)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, sa_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, sa_layout))
    acc = gl.zeros([64, HEAD_D], gl.float32, o_layout)
    sa_zero = gl.zeros([64, N_A], gl.float32, sa_layout)
    sb_zero = gl.zeros([64, N_B], gl.float32, sb_layout)
    l_acc = gl.zeros([64, 8], gl.float32, sum_layout)

    # Block 0: its scores and softmax.
    first = it0 % NUM_STAGES
    mbarrier.wait(k_ready.index(first), (it0 // NUM_STAGES) & 1)
    sa_tok, sb_tok = _start_wide_scores(q_smem, k_smem.index(first), sa_zero, sb_zero)
    s_a, s_b = warpgroup_mma_wait(0, deps=[sa_tok, sb_tok])
    mbarrier.arrive(k_empty.index(first))
    p_a, p_b, alpha, m_i = _wide_softmax(s_a, s_b, m_i, qk_scale * gl.load(k_scales), row0, 0, n_full, seq_len,
                                         CAUSAL)
    if not ROW_SUM:
        l_i = _wide_sums(p_a, p_b, l_i, alpha)

    for j in range(1, n_blocks):
        slot = (it0 + j) % NUM_STAGES
        prev = (it0 + j - 1) % NUM_STAGES
        if PINGPONG:
            _wait_turn(turn, CONSUMER, turn0 + j - 1)
        acc = _rescaled(acc, alpha, o_rows, 0.0)
        mbarrier.wait(v_ready.index(prev), ((it0 + j - 1) // NUM_STAGES) & 1)
        acc_tok, l_tok = _start_wide_pv(p_a, p_b, v_smem.index(prev), acc, ones_smem, l_acc, alpha, p_layout,
                                        ROW_SUM)
        mbarrier.wait(k_ready.index(slot), ((it0 + j) // NUM_STAGES) & 1)
        sa_tok, sb_tok = _start_wide_scores(q_smem, k_smem.index(slot), sa_zero, sb_zero)
        if PINGPONG:
            mbarrier.arrive(turn.index((CONSUMER + 1) % CONSUMERS))
        if ROW_SUM:
            acc, l_acc, s_a, s_b = warpgroup_mma_wait(0, deps=[acc_tok, l_tok, sa_tok, sb_tok])
        else:
            acc, s_a, s_b = warpgroup_mma_wait(0, deps=[acc_tok, sa_tok, sb_tok])
        mbarrier.arrive(k_empty.index(slot))
        mbarrier.arrive(v_empty.index(prev))
        p_a, p_b, alpha, m_i = _wide_softmax(s_a, s_b, m_i, qk_scale * gl.load(k_scales + j), row0, j, n_full,
                                             seq_len, CAUSAL)
        if not ROW_SUM:
            l_i = _wide_sums(p_a, p_b, l_i, alpha)

    # The last block's P V.
    last = (it0 + n_blocks - 1) % NUM_STAGES
    acc = _rescaled(acc, alpha, o_rows, 0.0)
    mbarrier.wait(v_ready.index(last), ((it0 + n_blocks - 1) // NUM_STAGES) & 1)
    acc_tok, l_tok = _start_wide_pv(p_a, p_b, v_smem.index(last), acc, ones_smem, l_acc, alpha, p_layout, ROW_SUM)
    if ROW_SUM:
        acc, l_acc = warpgroup_mma_wait(0, deps=[acc_tok, l_tok])
        l_i = gl.convert_layout(gl.max(l_acc, axis=1), m_i.type.layout)
    else:
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
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
def _schedule(index, units_per_head, n_heads, head_group):
    """The ``index``-th unit of work in the order programs take them (a forward's query tile or
    pair of tiles, a backward's key tile), as ``(head, rank)``: rank 0 is a head's longest
    unit under a causal mask. The heads are taken ``head_group`` at a time, and within a group
    the units go rank by rank: first every head's rank-0 unit, then every head's rank-1 unit,
    and so on. With ``head_group = 1`` that is head after head (programs running together share
    one head's K/V in L2); with all heads in one group it is *longest first* over the whole
    grid, so that the last units handed out are the shortest and no SM is left with a long one
    at the end; groups of a few heads get most of both."""
    per_group = head_group * units_per_head
    first_head = (index // per_group) * head_group
    r = index - (index // per_group) * per_group
    heads_here = gl.minimum(head_group, n_heads - first_head)  # the last group may be smaller
    return first_head + r % heads_here, r // heads_here


@gluon.jit
def _tiles_per_head(seq_len, TILE_M: gl.constexpr):
    """Query tiles of ``TILE_M`` rows per head: ``seq_len / 128`` (every tile full), or for
    192-row tiles ``ceil(seq_len / 192)``, the last one short by 64 or 128 rows."""
    if TILE_M == 128:  # (the same number as the ceiling; the plain division keeps the code as measured)
        n_m = seq_len // 128
    else:
        n_m = (seq_len + TILE_M - 1) // TILE_M
    return n_m


@gluon.jit
def _key_blocks(seq_len, BLOCK_N: gl.constexpr):
    """Key blocks per head: ``seq_len / BLOCK_N``, or for FP8's 192-key blocks ``ceil(seq_len /
    192)``, the last one short by 64 or 128 keys unless ``seq_len`` is a multiple of 192."""
    if BLOCK_N == 192:
        n = (seq_len + 191) // 192
    else:  # (the same number as the ceiling; the plain division keeps the code as measured)
        n = seq_len // BLOCK_N
    return n


@gluon.jit
def _tile_coordinates(tile, seq_len, q_heads, group, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                      TILE_M: gl.constexpr = 128):
    """Query tile ``tile = head · n_m + rank`` of ``TILE_M`` rows (``n_m``: `_tiles_per_head`;
    ``head`` among the batch's ``batch · q_heads``; rank 0: the head's last rows, the longest
    under a causal mask, and with 192-row tiles the one that may be short), and where its rows
    sit in the 2-D views: ``(row0, q_row, kv_bh, n_blocks)`` (``kv_bh``: the index of its K/V
    head among all of the batch's, whose rows start at ``kv_bh · seq_len``)."""
    n_m = _tiles_per_head(seq_len, TILE_M)
    row0 = (n_m - 1 - tile % n_m) * TILE_M
    bh = tile // n_m
    kv_bh = (bh // q_heads) * (q_heads // group) + (bh % q_heads) // group  # GQA: shared K/V
    if CAUSAL:  # the blocks up to the tile's last row (the last one partly masked when wider than the tile)
        n_blocks = (row0 + TILE_M + BLOCK_N - 1) // BLOCK_N
    else:
        n_blocks = _key_blocks(seq_len, BLOCK_N)
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
def _next_unit(unit, tile_counter, DYNAMIC: gl.constexpr):
    """The unit of work a persistent program takes after ``unit``, in a grid of P programs:
    ``unit + P``, or with ``DYNAMIC`` ``P + c``, ``c`` being what an atomic increment of the
    global ``tile_counter`` (zeroed before the launch) returns: the next unit no program has
    claimed."""
    if DYNAMIC:
        nxt = gl.num_programs(0) + gl.atomic_add(tile_counter, 1)
    else:
        nxt = unit + gl.num_programs(0)
    return nxt


@gluon.jit
def _consume_tile(my_q, my_o, k_smem, v_smem, p_smem, k_ready, v_ready, k_empty, v_empty, turn, k_desc, v_desc,
                  o_desc, lse_ptr, q_scales, k_scales, v_scales, kv_bh, n_blocks, my_row0, o_row, seq_len, qk_scale,
                  it0, turn0, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
                  CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  FP8: gl.constexpr, TREE: gl.constexpr, FMA_EXP2: gl.constexpr, SLACK: gl.constexpr,
                  ones_smem, ROW_SUM: gl.constexpr, PIN_SOFTMAX: gl.constexpr, pin_smem):
    """One consumer's 64 rows of a tile: the key loop (`_attend_rows`) and the store
    (`_store_rows`) of rows ``my_row0`` (in the head) / ``o_row`` (in the 2-D views)."""
    if FP8:
        rows_scale = qk_scale * gl.load(q_scales + o_row // 64)
        out_scale = gl.load(v_scales + kv_bh)
    else:
        rows_scale = qk_scale
        out_scale = 1.0
    my_k_scales = k_scales + kv_bh * _key_blocks(seq_len, BLOCK_N)
    if BLOCK_N == 192:
        acc, m_i, l_i = _attend_rows_wide(my_q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, n_blocks,
                                          (my_row0 + 1) // BLOCK_N, my_row0, seq_len, rows_scale, my_k_scales, it0,
                                          turn0, CONSUMER, PINGPONG, CAUSAL, HEAD_D, NUM_STAGES, CONSUMERS,
                                          ones_smem, ROW_SUM)
    else:
        acc, m_i, l_i = _attend_rows(my_q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                     k_desc, v_desc, kv_bh * seq_len, n_blocks, (my_row0 + 1) // BLOCK_N, my_row0,
                                     rows_scale, my_k_scales, p_smem, it0, turn0,
                                     CONSUMER, True, PINGPONG, CAUSAL, 64, BLOCK_N, HEAD_D, NUM_STAGES, 4, FP8, TREE,
                                     FMA_EXP2, SLACK, CONSUMERS, ones_smem, ROW_SUM, PIN_SOFTMAX, pin_smem)
    _store_rows(acc, m_i, l_i, my_o, o_desc, lse_ptr, o_row, 64, out_scale)


@gluon.jit
def _pass_rows(k_ready, v_ready, k_empty, v_empty, turn, n_blocks, it0, turn0, CONSUMER: gl.constexpr,
               CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, NUM_STAGES: gl.constexpr):
    """A consumer whose rows lie past the end of the head (the short last tile of 192-row
    tiles) computes nothing, but it still takes part in the ring: it frees each slot once its
    copy has landed (the loader waits for every consumer's arrival) and passes each ping-pong
    turn on, so that the others' turns and slots run exactly as in a full tile."""
    for j in range(n_blocks):
        slot = (it0 + j) % NUM_STAGES
        phase = ((it0 + j) // NUM_STAGES) & 1
        if PINGPONG:
            if j > 0:
                _wait_turn(turn, CONSUMER, turn0 + j - 1)
                mbarrier.arrive(turn.index((CONSUMER + 1) % CONSUMERS))
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot))
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot))


@gluon.jit
def _consumer(shared, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr, CAUSAL: gl.constexpr,
              HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, FP8: gl.constexpr,
              TREE: gl.constexpr, FMA_EXP2: gl.constexpr, SLACK: gl.constexpr, CONSUMERS: gl.constexpr,
              ROW_SUM: gl.constexpr, PIN_SOFTMAX: gl.constexpr):
    """One consumer warpgroup (``shared``: the kernel's buffers, barriers, descriptors and sizes,
    the same tuple for every consumer): rows ``[64·CONSUMER, 64·CONSUMER + 64)`` of each tile of
    ``64 · CONSUMERS`` rows the loader hands this program, until it hands over ``n_tiles`` (no
    more work). Q comes in two buffers, the tiles alternating between them, each with its tile's
    index in ``tile_ids``; a buffer is given back (``q_empty``) once this consumer's output,
    staged in it in bf16, has been stored. ``FP8``: the scales are fp32 arrays ``q_scales
    [batch·q_heads·seq/64]``, ``k_scales [batch·kv_heads·seq/BLOCK_N]`` and ``v_scales
    [batch·kv_heads]``, in row order."""
    (q_smem, k_smem, v_smem, o_smem, p_smem, tile_ids, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
     k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, seq_len, q_heads, group, n_tiles, qk_scale,
     ones_smem, pin_smem) = shared
    it0 = 0  # K/V blocks this program's ring has passed
    turn0 = 0  # ping-pong turns taken
    i = 0  # tiles done
    mbarrier.wait(q_ready.index(0), 0)
    tile = _read_tile(tile_ids.index(0), 4)
    while tile < n_tiles:
        row0, q_row, kv_bh, n_blocks = _tile_coordinates(tile, seq_len, q_heads, group, CAUSAL, BLOCK_N,
                                                         64 * CONSUMERS)
        buf = i % 2
        my_q = q_smem.index(buf * CONSUMERS + CONSUMER)
        my_row0 = row0 + CONSUMER * 64
        o_row = q_row + CONSUMER * 64
        if FP8:
            my_o = o_smem.index(CONSUMER)
        else:
            my_o = my_q
        if CONSUMERS == 2:  # 128-row tiles are always full
            _consume_tile(my_q, my_o, k_smem, v_smem, p_smem.index(CONSUMER), k_ready, v_ready, k_empty, v_empty,
                          turn, k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, kv_bh, n_blocks,
                          my_row0, o_row, seq_len, qk_scale, it0, turn0, CONSUMER, CONSUMERS, PINGPONG, CAUSAL,
                          HEAD_D, BLOCK_N, NUM_STAGES, FP8, TREE, FMA_EXP2, SLACK, ones_smem, ROW_SUM,
                          PIN_SOFTMAX, pin_smem.index(CONSUMER))
        else:
            if my_row0 < seq_len:
                _consume_tile(my_q, my_o, k_smem, v_smem, p_smem.index(CONSUMER), k_ready, v_ready, k_empty,
                              v_empty, turn, k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, kv_bh,
                              n_blocks, my_row0, o_row, seq_len, qk_scale, it0, turn0, CONSUMER, CONSUMERS,
                              PINGPONG, CAUSAL, HEAD_D, BLOCK_N, NUM_STAGES, FP8, TREE, FMA_EXP2, SLACK, ones_smem,
                              ROW_SUM, PIN_SOFTMAX, pin_smem.index(CONSUMER))
            else:
                _pass_rows(k_ready, v_ready, k_empty, v_empty, turn, n_blocks, it0, turn0, CONSUMER, CONSUMERS,
                           PINGPONG, NUM_STAGES)
        mbarrier.arrive(q_empty.index(buf))
        it0 += n_blocks
        turn0 += n_blocks - 1
        i += 1
        mbarrier.wait(q_ready.index(i % 2), (i // 2) & 1)
        tile = _read_tile(tile_ids.index(i % 2), 4)


@gluon.jit
def _load_tile(tile, i, it, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_ids, q_ready, q_empty, k_ready,
               v_ready, k_empty, v_empty, seq_len, q_heads, group, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, FP8: gl.constexpr, CONSUMERS: gl.constexpr):
    """Hand tile ``tile`` (``head · tiles per head + rank``) to the consumers as this program's
    ``i``-th: its index into ``tile_ids``, the ``CONSUMERS`` 64-row parts of Q into Q buffer
    ``i % 2`` (all of them in a short tile too: rows past the last are another head's, or zeros
    past the tensor's end, and nobody reads them), then K_j and V_j into the rings, whose slots
    have passed ``it`` blocks. A slot or a Q buffer is reused once every consumer arrived on its
    empty barrier (count ``CONSUMERS``); on the first pass the wait is for parity 1, which a fresh
    barrier reports as complete. ``FP8``: V's
    tiles come from Vᵀ, ``[batch·kv_heads·HEAD_D, seq]``, columns ``j·BLOCK_N`` onwards of the
    head's rows. Returns ``(i + 1, it + the tile's blocks)``."""
    row0, q_row, kv_bh, n_blocks = _tile_coordinates(tile, seq_len, q_heads, group, CAUSAL, BLOCK_N,
                                                     64 * CONSUMERS)
    kv_row0 = kv_bh * seq_len
    buf = i % 2
    mbarrier.wait(q_empty.index(buf), ((i // 2) & 1) ^ 1)
    _write_tile(tile_ids.index(buf), tile)
    # (The expect is an arrival: it releases the index. A TMA copy counts its whole box, zeros too.)
    mbarrier.expect(q_ready.index(buf), CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        _tma_load(q_desc, [q_row + c * 64, 0], q_ready.index(buf), q_smem.index(buf * CONSUMERS + c))
    for j in range(n_blocks):
        slot = (it + j) % NUM_STAGES
        free_phase = (((it + j) // NUM_STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free_phase)
        if BLOCK_N == 192:  # three copies of 64 keys each (see `_attend_rows_wide`)
            mbarrier.expect(k_ready.index(slot), 3 * k_desc.block_type.nbytes)
            for c in gl.static_range(3):
                _tma_load(k_desc, [kv_row0 + j * BLOCK_N + 64 * c, 0], k_ready.index(slot),
                          k_smem.index(slot).slice(64 * c, 64))
        else:
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row0 + j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free_phase)
        if BLOCK_N == 192:
            mbarrier.expect(v_ready.index(slot), 3 * v_desc.block_type.nbytes)
            for c in gl.static_range(3):
                _tma_load(v_desc, [kv_bh * v_desc.block_type.shape[0], j * BLOCK_N + 64 * c], v_ready.index(slot),
                          v_smem.index(slot).slice(64 * c, 64, dim=1))
        elif FP8:
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [kv_bh * v_desc.block_type.shape[0], j * BLOCK_N], v_ready.index(slot),
                      v_smem.index(slot))
        else:
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [kv_row0 + j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))
    return i + 1, it + n_blocks


@gluon.jit
def _loader(loads, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, FP8: gl.constexpr,
            PAIRED: gl.constexpr, DYNAMIC: gl.constexpr, CONSUMERS: gl.constexpr):
    """One warp: it picks this program's *units* of work and loads their tiles (`_load_tile`).
    A unit is one query tile, or with ``PAIRED`` (causal) two tiles of one head, ranks r and
    ``seq/128 − 1 − r``, whose key blocks add up to the same number for every r: equal units,
    so that a fixed round robin of them keeps every SM equally busy. The units are in
    `_schedule`'s order (``head_group``); the program's first is ``pid``, the next ``pid + P``
    in a grid of P programs, or with ``DYNAMIC`` unit ``P + c``, ``c`` being what an atomic
    increment of the global ``tile_counter`` (zeroed before the launch) returns: the next
    unit no program has claimed. The rings and the Q buffers run on from one tile to the next,
    so a persistent program loads its next tile while the consumers finish this one. When the
    units run out, it hands over ``n_tiles`` (no more work). ``loads``: the descriptors, buffers,
    barriers, ``tile_counter`` and sizes it needs, as the kernel gathers them."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_ids, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
     tile_counter, seq_len, q_heads, group, n_tiles, head_group) = loads
    n_m = _tiles_per_head(seq_len, 64 * CONSUMERS)
    n_bh = n_tiles // n_m
    if PAIRED:
        per_head = (n_m + 1) // 2  # (odd n_m: the middle tile is a unit of its own)
    else:
        per_head = n_m
    it = 0
    i = 0
    unit = gl.program_id(0)
    while unit < n_bh * per_head:
        next_unit = _next_unit(unit, tile_counter, DYNAMIC)  # claimed now: overlaps this unit's copies
        head, rank = _schedule(unit, per_head, n_bh, head_group)
        i, it = _load_tile(head * n_m + rank, i, it, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_ids,
                           q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, seq_len, q_heads, group, CAUSAL,
                           BLOCK_N, NUM_STAGES, FP8, CONSUMERS)
        if PAIRED:
            if n_m - 1 - rank != rank:
                i, it = _load_tile(head * n_m + n_m - 1 - rank, i, it, q_desc, k_desc, v_desc, q_smem, k_smem,
                                   v_smem, tile_ids, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, seq_len,
                                   q_heads, group, CAUSAL, BLOCK_N, NUM_STAGES, FP8, CONSUMERS)
        unit = next_unit
    # No more tiles: say so through the next buffer.
    buf = i % 2
    mbarrier.wait(q_empty.index(buf), ((i // 2) & 1) ^ 1)
    _write_tile(tile_ids.index(buf), n_tiles)
    mbarrier.arrive(q_ready.index(buf))


@gluon.jit
def _warp_specialized_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, tile_counter,
                             seq_len, q_heads, group, n_tiles, head_group, qk_scale, CAUSAL: gl.constexpr,
                             HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                             PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                             FP8: gl.constexpr = False, PAIRED: gl.constexpr = False,
                             DYNAMIC: gl.constexpr = False, TREE: gl.constexpr = False,
                             FMA_EXP2: gl.constexpr = 0, SLACK: gl.constexpr = 0.0, CONSUMERS: gl.constexpr = 2,
                             ROW_SUM: gl.constexpr = False, PIN_SOFTMAX: gl.constexpr = False):
    """A 1-d grid over the ``n_tiles`` query tiles of ``64 · CONSUMERS`` rows (``CONSUMERS``: 2,
    or 3 for FlashAttention-3's 192-row tiles, `_tiles_per_head` of them per head): one program
    per tile, or fewer (persistent: each takes tiles in turn, `_loader` says which;
    ``tile_counter``: one int32, zero, for ``DYNAMIC``).
    ``num_warps=4`` (consumer 0, the default partition) plus the workers: the other consumers
    (4 warps each) and the loader (1 warp). Q and O blocks of 64 rows, K blocks of ``BLOCK_N``
    rows, V blocks of ``BLOCK_N`` rows (FP8: of Vᵀ, ``HEAD_D`` rows by ``BLOCK_N`` keys). Q has
    two buffers (``[tile parity · CONSUMERS + consumer]``), so that a persistent program loads
    the next tile's Q while it finishes this one. In bf16 each consumer's Q buffer takes its O
    for the store; in FP8 O (bf16) is twice the size of Q (e4m3) and has buffers of its own."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * CONSUMERS, 64, HEAD_D], q_desc.layout)
    if BLOCK_N == 192:  # (FP8, P in registers) slots of 256 keys, filled by three copies of 64
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, 256, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, HEAD_D, 256], v_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS, 64, HEAD_D], o_desc.layout)
        p_smem = q_smem  # (unused)
    elif FP8:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, HEAD_D, BLOCK_N], v_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS, 64, HEAD_D], o_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.float8e4nv)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [CONSUMERS, 64, BLOCK_N], p_layout)
    else:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_D], v_desc.layout)
        o_smem = q_smem
        p_smem = q_smem  # (unused)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # one per Q buffer
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(2, CONSUMERS):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)  # the loader's expect() is the one arrival
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    if ROW_SUM:  # the second operand of P · 1, for every consumer, written once
        ONES_N: gl.constexpr = 256 if BLOCK_N == 192 else BLOCK_N
        if BLOCK_N == 192:  # sliced as V's slots are: the same layout
            ones_layout: gl.constexpr = v_desc.layout
        else:
            ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], k_desc.dtype)
        ones_smem = gl.allocate_shared_memory(k_desc.dtype, [8, ONES_N], ones_layout)
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [2, 2], [1, 0])
        if FP8:
            # The byte of e4m3's 1.0, 0x38, as int8: Triton 3.6 has no e4m3 constants, and a
            # constant 1.0 converted to e4m3 did not multiply as 1 (row sums off by up to e^5
            # on an H200), where the byte itself does.
            ones_bits = gl.full([8, ONES_N], 0x38, gl.int8, store_layout)
            _reinterpret(ones_smem, gl.int8, [8, ONES_N], ones_layout).store(ones_bits)
        else:
            ones_smem.store(gl.full([8, ONES_N], 1.0, gl.float32, store_layout).to(k_desc.dtype))
    else:
        ones_smem = tile_ids  # (unused)
    if PIN_SOFTMAX:  # each consumer's scratch tile for `_pin_before_wait`
        pin_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 64, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    else:
        pin_smem = q_smem  # (unused)
    fence_async_shared()  # (the ones are ordinary stores, and wgmma reads through the async proxy)

    # What every consumer reads: run-time values only, since a tuple kept in a variable would
    # turn constexpr members into run-time values (the consumer's index and the switches are
    # therefore written in place, in each partition's own tuple).
    shared = (q_smem, k_smem, v_smem, o_smem, p_smem, tile_ids, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              turn, k_desc, v_desc, o_desc, lse_ptr, q_scales, k_scales, v_scales, seq_len, q_heads, group, n_tiles,
              qk_scale, ones_smem, pin_smem)
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tile_ids, q_ready, q_empty, k_ready, v_ready, k_empty,
             v_empty, tile_counter, seq_len, q_heads, group, n_tiles, head_group)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [(_consumer, (shared, 0, PINGPONG, CAUSAL, HEAD_D, BLOCK_N, NUM_STAGES, FP8, TREE, FMA_EXP2, SLACK, 2,
                          ROW_SUM, PIN_SOFTMAX)),
             (_consumer, (shared, 1, PINGPONG, CAUSAL, HEAD_D, BLOCK_N, NUM_STAGES, FP8, TREE, FMA_EXP2, SLACK, 2,
                          ROW_SUM, PIN_SOFTMAX)),
             (_loader, (loads, CAUSAL, BLOCK_N, NUM_STAGES, FP8, PAIRED, DYNAMIC, CONSUMERS))],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    else:
        gl.warp_specialize(
            [(_consumer, (shared, 0, PINGPONG, CAUSAL, HEAD_D, BLOCK_N, NUM_STAGES, FP8, TREE, FMA_EXP2, SLACK, 3,
                          ROW_SUM, PIN_SOFTMAX)),
             (_consumer, (shared, 1, PINGPONG, CAUSAL, HEAD_D, BLOCK_N, NUM_STAGES, FP8, TREE, FMA_EXP2, SLACK, 3,
                          ROW_SUM, PIN_SOFTMAX)),
             (_consumer, (shared, 2, PINGPONG, CAUSAL, HEAD_D, BLOCK_N, NUM_STAGES, FP8, TREE, FMA_EXP2, SLACK, 3,
                          ROW_SUM, PIN_SOFTMAX)),
             (_loader, (loads, CAUSAL, BLOCK_N, NUM_STAGES, FP8, PAIRED, DYNAMIC, CONSUMERS))],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
        )


# ----------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------
def default_tiles(head_dim: int, fp8: bool = False, consumers: int = 2) -> tuple[int, int]:
    """``(block_n, num_stages)``, from a sweep on the H100 (``bench/results/raw/
    nvidia-h100.gluon_tile_sweep.log``). Shared memory per program: Q (128·d·e bytes, e = 2 in
    bf16, 1 in e4m3; two tiles of it in the warp-specialized kernel) plus, per stage, a K and a
    V tile (2·block_n·d·e bytes), plus in FP8 the bf16 output and e4m3 P buffers: at d = 128 in
    bf16 the warp-specialized kernel takes 192 KiB of the 227 KiB an SM offers with two
    stages, and a third would not fit. A power-of-two
    stage count keeps the ring's slot and phase arithmetic to shifts and masks (three stages
    ran up to 11 % slower than two or four at d = 64). In FP8 four stages fit as well and were
    no faster than two on an H200 (within 6 %, ``nvidia-h200.gluon_fp8_stages.log``), and
    256-key tiles (FP8 only) fit with P through shared memory alone (229,824 bytes at d = 128)
    and ran 0.82-1.06x the 128-key kernel, with P in registers they spill and run at half its
    speed or less (``bench.ch04_gluon`` part ``tiles``, ``nvidia-h200.bench_ch04_gluon_tiles.log``).
    192-key FP8 blocks, FlashAttention-3's with V column-major (``block_n=192``: two tiles of
    128 and 64 keys, `_attend_rows_wide`, P in registers, row sums on the tensor cores), ran at
    0.93-0.99x of the 128-key kernel at d = 128 and 0.94-1.03x at 64, gaining only at 8k-16k
    keys (part ``wide``, ``nvidia-h200.bench_ch04_gluon_wide.log``).
    With three consumers at d = 128: 64-key tiles and four stages. A consumer thread's 160
    registers hold a 64 × 64 fp32 score tile beside its share of the 64 × 128 accumulator, not a
    64 × 128 one (ptxas spills 248 bytes a thread in bf16 with 128-key tiles, none with 64),
    and four stages of the smaller tiles fit (229,800 bytes in bf16)."""
    if consumers == 3 and head_dim == 128:
        return (64, 4)
    if fp8:
        return (128, 2)
    return (128, 2) if head_dim == 128 else (128, 4)


def gluon_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `flash_attention_gluon` takes these inputs: a CUDA device of compute
    capability 9.x, bf16, head_dim 64 or 128, equal lengths that are multiples of 128, GQA
    heads, and a Triton whose Gluon API this module knows."""
    return (q.is_cuda and _KNOWN_GLUON and torch.cuda.get_device_capability(q.device)[0] == 9
            and _reason(q, k, v) is None)


#: Whether this Triton's Gluon API is one the module knows.
_KNOWN_GLUON = TRITON_VERSION in GLUON_VERSIONS


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


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv, torch.float32: gl.float32}


def _descriptor(t2d: torch.Tensor, rows: int, cols: int | None = None) -> TensorDescriptor:
    """A TMA descriptor over the 2-D ``t2d`` in ``[rows, cols]`` blocks (cols: whole rows), made
    once per address, shape, strides, dtype and block and then reused (`cached_descriptor`):
    building one runs Triton's Python checks, about 8 µs of an H200 host's time, and a training
    step makes nine, mostly on addresses the caching allocator hands out again step after step."""
    block = (rows, cols or t2d.shape[1])
    shape, strides = list(t2d.shape), list(t2d.stride())
    address = t2d.data_ptr()

    def make():
        return TensorDescriptor(TensorAddress(address, t2d.dtype), shape, strides, list(block),
                                _shared_layout(block, t2d.dtype))
    return cached_descriptor((address, t2d.get_device(), *shape, *strides, t2d.dtype, block, "gluon_fwd_bwd"), make)


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a ``block`` tile (Gluon's default for it), made once per tile
    shape: computing it took about half of a descriptor's 16 µs of host time on an H200's host,
    and a call makes four or five descriptors."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def flash_attention_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                          scale: float | None = None, variant: str = "ws", block_n: int | None = None,
                          num_stages: int | None = None, consumer_regs: int | None = None, loader_regs: int = 24,
                          persistent: bool | int | None = None, head_group: int | None = None,
                          paired: bool | None = None, dynamic: bool | None = None, tree_reductions: bool = False,
                          fma_exp2: int = 0, lazy_rescale: bool = False, consumers: int = 2,
                          row_sum_mma: bool = False, pin_softmax: bool = False, compile_only: bool = False):
    """``softmax(scale · q kᵀ + mask) v`` with the Gluon kernels (forward only).

    - ``q: [batch, q_heads, seq, head_dim]``, ``k, v: [batch, kv_heads, seq, head_dim]``, bf16,
      ``q_heads % kv_heads == 0``, head_dim 64 or 128, ``seq`` a multiple of 128 (ValueError
      otherwise); non-contiguous inputs are copied;
    - ``causal``: query i sees keys ``j <= i``; ``scale`` defaults to ``1/sqrt(head_dim)``;
    - ``variant``: one of `VARIANTS`; ``block_n`` (64 or 128; FP8 also 256, with ``seq`` a
      multiple of it, and 192, `flash_attention_gluon_fp8`) and ``num_stages`` default to
      `default_tiles`; ``consumer_regs`` / ``loader_regs``: registers per thread of the
      warp-specialized partitions (``setmaxnreg``; the consumers' default: `CONSUMER_REGS`);
      ``consumers`` (warp-specialized kernels): 2 consumer warpgroups per program (tiles of 128
      query rows), or 3 (FlashAttention-3's 192 rows at head dim 64; without a mask only; the
      last tile of a head short unless ``seq`` is a multiple of 192; at head dim 128 with
      64-key tiles by default, `default_tiles`); ``persistent`` (warp-specialized kernels):
      True for one program per SM taking tiles in turn instead of one per tile, or a number of
      programs (the tests use a few, so that each takes many tiles). How the warp-specialized
      kernels share out the tiles (`_loader`): ``paired`` (causal only): units of two tiles
      whose lengths add up to the same, else one tile each; ``head_group``: the order of the
      units, heads taken that many at a time and within a group longest first (`_schedule`;
      1: head after head); ``dynamic`` (persistent grids): each program claims its next unit
      from an atomic counter instead of taking every P-th. Each of the four left at None
      takes `default_schedule`'s value. ``tree_reductions``: the softmax's row max and sum
      as trees (warp-specialized kernels: ``TREE`` of `_online_softmax`; off by default in bf16,
      on in FP8). ``fma_exp2`` (warp-specialized kernels): one in this many of the softmax's
      exponentials on the FMA units instead of the special-function unit (`FMA_EXP2_SHARES`;
      0: none). ``lazy_rescale`` (warp-specialized kernels): the running max moves only by more
      than `LAZY_RESCALE_SLACK`, and the accumulator is rescaled only when some row's does.
      Both are FlashAttention-4's and off by default: on an H200 they made the kernels slower
      but for FP8 with ping-pong (``bench/ch04_gluon.py``, the softmax part).
      ``row_sum_mma`` (warp-specialized kernels): the softmax's row sums as a matmul ``P · 1``
      started with each P·V (`_start_row_sum`) instead of additions on the CUDA cores.
      ``pin_softmax`` (warp-specialized kernels, P in registers): keep each block's softmax in
      front of the wait for the P·V in flight in the machine code (`_pin_before_wait`), which
      ptxas otherwise moves up to the wait for the scores. Off by default: on an H200 it made
      bf16 0.94-1.02x as fast and FP8 with its defaults 0.90-0.96x; only FP8 summing on the
      CUDA cores under a causal mask at head dim 128 gained (1.00-1.03x; ``bench/ch04_gluon.py``,
      the pin part).

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
                   persistent, head_group, paired, dynamic, tree_reductions, compile_only, fma_exp2=fma_exp2,
                   lazy_rescale=lazy_rescale, consumers=consumers, row_sum_mma=row_sum_mma, pin_softmax=pin_softmax)


def flash_attention_gluon_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                              scale: float | None = None, variant: str = "ws", prepared: tuple | None = None,
                              block_n: int | None = None, num_stages: int | None = None,
                              consumer_regs: int | None = None, loader_regs: int = 24,
                              persistent: bool | int | None = None, head_group: int | None = None,
                              paired: bool | None = None, dynamic: bool | None = None, tree_reductions: bool = True,
                              fma_exp2: int = 0, lazy_rescale: bool = False, consumers: int = 2,
                              row_sum_mma: bool | None = None, pin_softmax: bool = False, compile_only: bool = False):
    """The warp-specialized kernel with e4m3 matmuls: Q in blocks of 64 rows (one consumer's
    rows) and K in blocks of ``block_n`` keys, each with its own scale, V with one scale per
    head, fp32 accumulation (the quantization of `minillm.kernels.ch04_flash_attention_hopper.
    quantize_blocks`). Inputs, scope and result as `flash_attention_gluon` (bf16 in, bf16
    out); ``variant``: ``"ws"`` or ``"ws_pingpong"``; ``block_n``: 64, 128 (default), 192 or
    256 keys per tile, K's scale per as many (``prepared`` must use the same; 192:
    FlashAttention-3's FP8 tile for a column-major V, two tiles of 128 and 64 keys,
    `_attend_rows_wide`, with two consumers and P in registers, and ``seq`` need not be a
    multiple of it); ``prepared``:
    `prepare_gluon_fp8`'s result for these inputs, to time the kernel without the
    quantization (it also says whether P·V reads P from registers, the default, or from
    shared memory); ``tree_reductions``: as
    `flash_attention_gluon`'s, here on by default; ``row_sum_mma``: as `flash_attention_gluon`'s,
    by default on with two consumers and tiles of up to 192 keys (`default_row_sum`), where it
    measured faster on an H200 at every point; P's row sums are then those of P as rounded to
    e4m3, in ℓ and in the logsumexp; ``fma_exp2``, ``lazy_rescale``, ``consumers`` and ``pin_softmax``:
    as `flash_attention_gluon`'s, the first two off by default here too (P, at
    most ``2^8`` with a lazy max, still fits e4m3's 448). With three consumers the kernel fits
    its 160 registers a thread only with P through shared memory (``prepared`` with
    ``p_in_registers=False``): P held in registers spills, and the kernel runs at well under half
    speed (0.37-0.39x on an H200, ``bench.ch04_gluon``'s consumers part)."""
    if variant not in VARIANTS[1:]:
        raise ValueError(f"the FP8 kernel is warp-specialized: variant must be one of {VARIANTS[1:]}, got {variant!r}")
    reason = _reason(q, k, v)
    if reason:
        raise ValueError(reason)
    block_n = block_n or default_tiles(q.shape[-1], True, consumers)[0]
    row_sum_mma = default_row_sum(block_n, consumers) if row_sum_mma is None else row_sum_mma
    q8, k8, v8t, scales, p_in_registers = prepared or prepare_gluon_fp8(q, k, v, block_n)
    return _launch(q8, k8, v8t, (scales, p_in_registers), causal, scale, variant, block_n, num_stages, consumer_regs,
                   loader_regs, persistent, head_group, paired, dynamic, tree_reductions, compile_only,
                   out_shape=q.shape, fma_exp2=fma_exp2, lazy_rescale=lazy_rescale, consumers=consumers,
                   row_sum_mma=row_sum_mma, pin_softmax=pin_softmax)


def default_row_sum(block_n: int, consumers: int) -> bool:
    """Whether the FP8 kernel takes its row sums from the tensor cores (``row_sum_mma``) unless
    told: with two consumers and tiles of up to 192 keys. With 128-key tiles, on an H200, it ran 1.05-1.09x
    faster at head dim 128 and 1.10-1.14x at 64 (with ping-pong 1.04-1.07x and 1.06-1.16x),
    causal or not, N 2k-16k (the row-sum part of ``bench/ch04_gluon.py``): the loop of the
    softmax loses 64 additions and 4 shuffles a thread per block (448 instructions a warp to
    386 at head dim 128) for one matmul of width 8 more. In bf16 it does not pay (0.96-1.04x:
    there the tensor cores, not the instructions, set the pace). With three consumers (P through
    shared memory) it gains 1.02-1.05x at head dim 128 and 1.06-1.09x at 64, which only draws
    level with two consumers and the sums (0.95-1.02x); with 256-key tiles it gains little at
    128 (0.98-1.03x; the loop spills) and the wide tile stays behind (0.84-0.97x). With 192-key
    blocks (two tiles, `_attend_rows_wide`) it pays more than with 128: 1.02-1.06x at head dim
    128 and 1.11-1.18x at 64 (the wide part of ``bench/ch04_gluon.py``)."""
    return consumers == 2 and block_n <= 192


#: With ``lazy_rescale``, how far (base 2) a row's max may outgrow the one its P and accumulator
#: are scaled by: P <= 2^8 = 256, within e4m3's 448 and bf16's range (FlashAttention-4's 8).
LAZY_RESCALE_SLACK = 8.0
#: ``fma_exp2``'s values: one in this many columns' exponentials on the FMA units (0: none).
FMA_EXP2_SHARES = (0, 2, 4, 8)


#: The order of the keys in each 16 of Vᵀ when P stays in registers (see `_p_for_mma`):
#: position 4c + 2e + i holds key 8e + 2c + i.
P_KEY_ORDER = tuple(8 * e + 2 * c + i for c in range(4) for e in range(2) for i in range(2))


def prepare_gluon_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int = 128,
                      p_in_registers: bool = True) -> tuple:
    """``(q8, k8, v8ᵀ, (q_scales, k_scales, v_scales), p_in_registers)`` for
    `flash_attention_gluon_fp8`: e4m3 ``q8 [b, h, s, d]``, ``k8 [b, h_kv, s, d]``, ``v8ᵀ [b,
    h_kv, d, s]`` and their fp32 scales (per 64 query rows, per ``block_n`` keys, per head of
    V). ``p_in_registers``: P·V reads P from registers, and Vᵀ's keys are stored in
    `P_KEY_ORDER` within each 16; else P goes through shared memory and the keys keep their
    order. Registers are the default: faster with and without a mask on an H200
    (``bench/results/nvidia-h200.json``, kernels ``fp8_*`` against ``fp8_*_smem``). P in fp32
    across the loop takes 48 registers more, and under a causal mask ptxas spills a little
    with Triton 3.6 (8 bytes at head dim 128) and a lot with 3.9 (400-576 bytes, not timed)."""
    from minillm.kernels.ch04_flash_attention_hopper import quantize_blocks

    q8, q_scales = quantize_blocks(q, 64)
    k8, k_scales = quantize_blocks(k, block_n)
    k8 = k8[:, :, :k.shape[2]].contiguous()  # (192-key blocks: the kernel masks the keys past the end)
    v8t, v_scales = quantize_blocks(v, v.shape[2], transpose=True)
    if p_in_registers:
        *lead, s = v8t.shape
        order = torch.tensor(P_KEY_ORDER, device=v.device)
        v8t = v8t.view(*lead, s // 16, 16)[..., order].reshape(*lead, s)
    return q8, k8, v8t, (q_scales, k_scales, v_scales), p_in_registers


#: Up to this length, the warp-specialized kernels run persistent by default without a causal mask.
PERSISTENT_MAX_SEQ = 8192
#: Heads per group of `_schedule` in the causal defaults (forward and backward).
CAUSAL_HEAD_GROUP = 8


def default_schedule(causal: bool, seq_len: int) -> dict:
    """How the warp-specialized forward shares out its tiles unless told: the keyword
    arguments ``persistent``, ``paired``, ``dynamic`` and ``head_group`` of
    `flash_attention_gluon`. Measured with `bench/ch04_gluon.py` on an H100 (no mask) and in
    three sweeps on an H200 (causal, ``bench/results/raw/nvidia-h200.gluon_schedule_sweep*.log``):

    - without a mask every tile costs the same: persistent up to `PERSISTENT_MAX_SEQ` keys,
      tiles in turn, head after head. A persistent program loads its next tile while it
      finishes this one, which hides a tile's start (its Q and first K/V blocks): 10-18 % at
      1k keys, a few percent at 4-8k, nothing measurable at 16k (where one H100 run lost 20 %).
    - with a causal mask a tile's cost is its rank: persistent, in pairs of equal total
      length, claimed from an atomic counter, heads in groups of `CAUSAL_HEAD_GROUP`. One
      program per tile (the hardware hands out the programs as SMs free up, longest first
      within a head) measured 0.71-0.84x cuDNN at 1-2k keys and head dim 64; persistent
      programs taking every P-th tile or pair in a fixed order swung between 0.78x and 1.10x
      from one point (and one run) to the next, with how the units happened to fall to the
      SMs; claimed pairs stayed within 0.96-1.07x at every point of their sweep, and within
      0.98-1.06x in the benchmark's run (``bench/results/nvidia-h200.json``)."""
    if causal:
        return dict(persistent=True, paired=True, dynamic=True, head_group=CAUSAL_HEAD_GROUP)
    return dict(persistent=seq_len <= PERSISTENT_MAX_SEQ, paired=False, dynamic=False, head_group=1)


#: From this many keys on, the bf16 forward at head dim 64 without a mask takes three consumers.
THREE_CONSUMERS_MIN_SEQ = 2048
#: From this many keys on, the bf16 forward at head dim 128 under a causal mask takes ping-pong.
CAUSAL_PINGPONG_MIN_SEQ = 4096


def fastest_forward(head_dim: int, causal: bool, seq_len: int) -> dict:
    """The keyword arguments of `flash_attention_gluon` (``variant``, ``consumers``) that ran
    fastest at this kind of call on an H200; the schedule stays `default_schedule`'s. What the
    chapter's runs measured (``bench/results/raw/nvidia-h200.bench_ch04_gluon_*.log``):

    - head dim 64 without a mask, from `THREE_CONSUMERS_MIN_SEQ` keys on: ping-pong with three
      consumer warpgroups, 1.05-1.11x of ping-pong with two and 1.04-1.11x of cuDNN (``ws``
      with two: 0.98x); at 1k keys a head has 5 1/3 tiles of 192 rows and the third
      consumer gains nothing, so two, with ping-pong (1-4 % over ``ws`` in eight runs);
    - head dim 128 under a causal mask, from `CAUSAL_PINGPONG_MIN_SEQ` keys on: ping-pong,
      1.00-1.07x of ``ws`` in each of five runs (shorter rows: level, either way);
    - everything else: ``ws`` (ping-pong mostly within 3 % of it, either way)."""
    if head_dim == 64 and not causal:
        return dict(variant="ws_pingpong", consumers=3 if seq_len >= THREE_CONSUMERS_MIN_SEQ else 2)
    if head_dim == 128 and causal and seq_len >= CAUSAL_PINGPONG_MIN_SEQ:
        return dict(variant="ws_pingpong", consumers=2)
    return dict(variant="ws", consumers=2)


def _grid(n_units: int, persistent: bool | int, dynamic: bool, device) -> tuple[tuple[int], torch.Tensor | None]:
    """``(grid, tile_counter)`` of a warp-specialized kernel over ``n_units`` units of work:
    one program per unit, or ``persistent`` ones (True: one per SM; a number: that many, at
    most ``n_units``); with ``dynamic``, the zeroed int32 counter they claim units from (else
    None)."""
    programs = num_sms(device) if persistent is True else int(persistent) or n_units
    counter = torch.zeros(1, device=device, dtype=torch.int32) if dynamic else None
    return (min(n_units, programs),), counter


def _launch(q, k, v, scales, causal, scale, variant, block_n, num_stages, consumer_regs, loader_regs, persistent,
            head_group, paired, dynamic, tree_reductions, compile_only, out_shape=None, fma_exp2=0,
            lazy_rescale=False, consumers=2, row_sum_mma=False, pin_softmax=False):
    """Make the descriptors and launch (or compile) the kernel of ``variant``. ``scales``:
    None for bf16, else FP8's ``((q_scales, k_scales, v_scales), p_in_registers)`` with ``v``
    as Vᵀ."""
    b, h, s, d = q.shape
    schedule = default_schedule(bool(causal), s)
    persistent = (variant != "pipelined" and schedule["persistent"]) if persistent is None else persistent
    paired = bool(causal) and (schedule["paired"] if paired is None else bool(paired))
    dynamic = bool(persistent) and (schedule["dynamic"] if dynamic is None else bool(dynamic))
    head_group = schedule["head_group"] if head_group is None else int(head_group)
    fp8 = scales is not None
    if head_group < 1:
        raise ValueError(f"head_group must be a positive number of heads, got {head_group}")
    default_n, default_stages = default_tiles(d, fp8, consumers)
    block_n, num_stages = block_n or default_n, num_stages or default_stages
    if block_n not in ((64, 128, 192, 256) if fp8 else (64, 128)):
        raise ValueError(f"block_n must be 64 or 128 (FP8: or 192 or 256), got {block_n}")
    if s % block_n and block_n != 192:
        raise ValueError(f"seq must be a multiple of block_n = {block_n}, got {s}")
    if block_n == 192 and (consumers != 2 or not scales[1] or fma_exp2 or lazy_rescale or pin_softmax):
        raise ValueError("192-key blocks need two consumers, P in registers and no fma_exp2, lazy_rescale "
                         "or pin_softmax")
    if fma_exp2 not in FMA_EXP2_SHARES:
        raise ValueError(f"fma_exp2 must be one of {FMA_EXP2_SHARES}, got {fma_exp2!r}")
    if (fma_exp2 or lazy_rescale or row_sum_mma or pin_softmax) and variant == "pipelined":
        raise ValueError("fma_exp2, lazy_rescale, row_sum_mma and pin_softmax need a warp-specialized variant")
    if consumers not in CONSUMER_REGS:
        raise ValueError(f"consumers must be one of {tuple(CONSUMER_REGS)}, got {consumers!r}")
    if consumers == 3 and (variant == "pipelined" or causal):
        # (the causal schedules pair up 128-row tiles)
        raise ValueError("three consumers need a warp-specialized variant and no causal mask")
    consumer_regs = CONSUMER_REGS[consumers] if consumer_regs is None else consumer_regs
    qk_scale = scale_and_window(d, scale, None)[0] * LOG2E  # (> 0: the row max commutes with it)
    out = torch.empty(out_shape or q.shape, device=q.device, dtype=torch.bfloat16)
    lse = torch.empty((b, h, s), device=q.device, dtype=torch.float32)
    copy_n = 64 if block_n == 192 else block_n  # (192-key blocks come in three copies)
    k_desc = _descriptor(k.view(-1, d), copy_n)
    # FP8: V's tiles are [d, block_n] blocks of Vᵀ, viewed as [b·h_kv·d, s].
    v_desc = _descriptor(v.view(-1, s), d, copy_n) if fp8 else _descriptor(v.view(-1, d), block_n)
    n_tiles = -(-s // (64 * consumers)) * b * h
    if variant == "pipelined":
        if persistent:
            raise ValueError("the pipelined kernel has one program per tile: persistent=True needs a 'ws' variant")
        kernel, rows, args, grid = _pipelined_kernel, BLOCK_M, (lse, s, h, h // k.shape[1], qk_scale), (n_tiles,)
        meta = dict(num_warps=8)
    else:
        (q_scales, k_scales, v_scales), p_in_registers = scales if fp8 else ((lse, lse, lse), False)  # (bf16: unread)
        if pin_softmax and fp8 and not p_in_registers:
            raise ValueError("pin_softmax needs P in registers (prepare_gluon_fp8(..., p_in_registers=True))")
        kernel, rows = _warp_specialized_kernel, 64
        n_units = b * h * ((s // BLOCK_M + 1) // 2) if paired else n_tiles
        grid, tile_counter = _grid(n_units, persistent, dynamic, q.device)
        tile_counter = lse if tile_counter is None else tile_counter  # (unread)
        args = (lse, q_scales, k_scales, v_scales, tile_counter, s, h, h // k.shape[1], n_tiles, head_group, qk_scale)
        meta = dict(PINGPONG=variant == "ws_pingpong", CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs,
                    FP8=(2 if p_in_registers else 1) if fp8 else 0, PAIRED=paired, DYNAMIC=dynamic,
                    TREE=bool(tree_reductions), FMA_EXP2=fma_exp2,
                    SLACK=LAZY_RESCALE_SLACK if lazy_rescale else 0.0, CONSUMERS=consumers,
                    ROW_SUM=bool(row_sum_mma), PIN_SOFTMAX=bool(pin_softmax), num_warps=4)
    descriptors = (_descriptor(q.view(-1, d), rows), k_desc, v_desc, _descriptor(out.view(-1, d), rows))
    meta.update(CAUSAL=bool(causal), HEAD_D=d, BLOCK_N=block_n, NUM_STAGES=num_stages)
    if compile_only:
        return kernel.warmup(*descriptors, *args, grid=grid, **meta)
    launch(kernel, grid, *descriptors, *args, **meta)  # (Triton's binding once per signature)
    return out, lse


# ----------------------------------------------------------------------------------------
# The backward: FlashAttention-3's dK/dV kernel, with dQ added by atomics
# ----------------------------------------------------------------------------------------
#: Keys per backward program: two consumer warpgroups of 64.
BWD_BLOCK_N = 128


@gluon.jit
def _bwd_coordinates(tile, seq_len, q_heads, group, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Key tile ``tile = kv_bh · (seq_len / 128) + rank`` (``kv_bh`` among the batch's
    ``batch · kv_heads`` K/V heads; rank 0: a head's first keys, under a causal mask the ones
    most queries see). Returns ``(n0, kv_row, q_bh0, i0, n_iter)``: the tile's first key, its
    row in the 2-D ``[batch·kv_heads·seq, HEAD_D]`` views, the index of the group's first query
    head among the batch's, the first query block that sees the tile and the number of query
    blocks per head from there."""
    n_kv_tiles = seq_len // 128
    kv_bh = tile // n_kv_tiles
    n0 = (tile % n_kv_tiles) * 128
    kv_heads = q_heads // group
    q_bh0 = (kv_bh // kv_heads) * q_heads + (kv_bh % kv_heads) * group
    if CAUSAL:
        i0 = n0 // BLOCK_M  # earlier queries see none of these keys
    else:
        i0 = 0
    return n0, kv_bh * seq_len + n0, q_bh0, i0, seq_len // BLOCK_M - i0


@gluon.jit
def _bwd_load_tile(tile, t0, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready,
                   q_empty, seq_len, q_heads, group, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                   NUM_STAGES: gl.constexpr):
    """Key tile ``tile``'s K and V, then for every query head of the group and every query
    block that sees the keys, Q_i and dO_i into the ring, whose slots have passed ``t0`` steps
    (one ready barrier for the pair; a slot is free when both consumers arrived on its empty
    barrier). Returns ``t0`` plus the tile's steps."""
    n0, kv_row, q_bh0, i0, n_iter = _bwd_coordinates(tile, seq_len, q_heads, group, CAUSAL, BLOCK_M)
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [kv_row, 0], kv_ready, k_smem)
    _tma_load(v_desc, [kv_row, 0], kv_ready, v_smem)
    for s in range(group * n_iter):
        q_row = (q_bh0 + s // n_iter) * seq_len + (i0 + s % n_iter) * BLOCK_M
        slot = (t0 + s) % NUM_STAGES
        mbarrier.wait(q_empty.index(slot), (((t0 + s) // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, 0], q_ready.index(slot), q_smem.index(slot))
        _tma_load(do_desc, [q_row, 0], q_ready.index(slot), do_smem.index(slot))
    return t0 + group * n_iter


@gluon.jit
def _bwd_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, tile_id, kv_ready, kv_empty, q_ready,
                q_empty, tile_counter, seq_len, q_heads, group, n_kv_bh, head_group, CAUSAL: gl.constexpr,
                BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr):
    """One warp: the key tiles of this program (`_bwd_load_tile`). The first is ``pid`` in
    `_schedule`'s order; with ``PERSISTENT``, in a grid of P programs, then ``pid + P``, ... or
    with ``DYNAMIC`` the next one claimed from the global ``tile_counter``, as the forward's
    `_loader`: each tile once both consumers are done with the last one's K and V
    (``kv_empty``), its index handed over in ``tile_id``; when the tiles run out, it hands over
    the tile count (no more work)."""
    n_kv_tiles = seq_len // 128
    if PERSISTENT:
        t0 = 0  # steps this program's ring has passed: it runs on from one tile to the next
        i = 0  # key tiles done
        unit = gl.program_id(0)
        while unit < n_kv_bh * n_kv_tiles:
            next_unit = _next_unit(unit, tile_counter, DYNAMIC)  # claimed now: overlaps this tile's copies
            kv_bh, rank = _schedule(unit, n_kv_tiles, n_kv_bh, head_group)
            mbarrier.wait(kv_empty, (i & 1) ^ 1)
            _write_tile(tile_id.index(0), kv_bh * n_kv_tiles + rank)
            t0 = _bwd_load_tile(kv_bh * n_kv_tiles + rank, t0, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem,
                                k_smem, v_smem, kv_ready, q_ready, q_empty, seq_len, q_heads, group, CAUSAL, BLOCK_M,
                                NUM_STAGES)  # (K/V's expect() is an arrival: it releases the index)
            i += 1
            unit = next_unit
        mbarrier.wait(kv_empty, (i & 1) ^ 1)
        _write_tile(tile_id.index(0), n_kv_bh * n_kv_tiles)
        mbarrier.arrive(kv_ready)
    else:
        kv_bh, rank = _schedule(gl.program_id(0), n_kv_tiles, n_kv_bh, head_group)
        _bwd_load_tile(kv_bh * n_kv_tiles + rank, 0, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                       kv_ready, q_ready, q_empty, seq_len, q_heads, group, CAUSAL, BLOCK_M, NUM_STAGES)


@gluon.jit
def _bwd_tile(tile, t0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_empty, q_ready, q_empty, ds_ready,
              dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, seq_len, q_heads, group, qk_scale, scale,
              CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
              NUM_STAGES: gl.constexpr, DQ_TMA: gl.constexpr, PREFETCH_STATS: gl.constexpr,
              PERSISTENT: gl.constexpr):
    """One consumer warpgroup's work on key tile ``tile`` (K and V loaded; the ring has passed
    ``t0`` steps): keys ``[n0 + 64·CONSUMER, +64)``. For each
    query block (``BLOCK_M`` rows, its Q_i and dO_i in the ring), with ``P = exp(scale·S − L)``
    rebuilt from the forward's logsumexp and ``D = rowsum(dO ∘ O)`` (the preprocess)::

        Sᵀ = K Q_iᵀ,  dPᵀ = V dO_iᵀ       [64, BLOCK_M], started together
        Pᵀ = exp2(Sᵀ·qk_scale − L·log2 e)  (while dPᵀ runs)
        dSᵀ = Pᵀ ∘ (dPᵀ − D)
        dV += Pᵀ dO_i,  dK += dSᵀ Q_i     (Pᵀ and dSᵀ from registers)
        dQ_i[:, half] += dS K[:, half]   (dSᵀ of both warpgroups, through shared memory)

    The keys-by-queries orientation keeps dK and dV (this warpgroup's rows) in the accumulators
    for the whole loop. dQ's tile needs all 128 keys of dS, so both warpgroups store their dSᵀ
    rows to ``ds_smem`` (two buffers, alternating) and meet at ``ds_ready``; each then takes
    half of dQ's columns, ``[BLOCK_M, HEAD_D/2]``, and adds it to the fp32 dQ buffer, into
    which every program whose keys these queries see adds too:

    - ``DQ_TMA``: the tile goes to ``dq_smem`` and one TMA bulk reduction (``dq_desc``) adds
      it in L2, while the warpgroup moves on; the next tile waits until that one is read;
    - else: element-wise atomics from registers (``dq_ptr``), 32 per thread per tile.

    ``PREFETCH_STATS``: each step loads the next step's rows of L and D from global memory, so
    that their latency is spent during this step rather than before the exponentials.
    ``PERSISTENT``: arrive on ``kv_empty`` once K and V are no longer read, so that the loader
    brings the next tile's while this one's dK and dV are stored. Returns ``t0`` plus the steps."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D // 2, 16])
    # Pᵀ and dSᵀ as the register operand: as in the forward, no data moves (k_width=2).
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    HALF_D: gl.constexpr = HEAD_D // 2

    my_k = k_smem.slice(CONSUMER * 64, 64)
    my_v = v_smem.slice(CONSUMER * 64, 64)
    k_half = k_smem.slice(CONSUMER * HALF_D, HALF_D, dim=1)  # [128 keys, HEAD_D/2]
    cols0 = gl.arange(0, BLOCK_M, gl.SliceLayout(0, s_layout))
    dq_offsets = (gl.arange(0, BLOCK_M, gl.SliceLayout(1, dq_layout))[:, None] * HEAD_D
                  + gl.arange(0, HALF_D, gl.SliceLayout(0, dq_layout))[None, :])
    out_offsets = (gl.arange(0, 64, gl.SliceLayout(1, kv_layout))[:, None] * HEAD_D
                   + gl.arange(0, HEAD_D, gl.SliceLayout(0, kv_layout))[None, :])
    s_zero = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout)
    my_dq = dq_smem.index(CONSUMER)

    n0, kv_row, q_bh0, i0, n_iter = _bwd_coordinates(tile, seq_len, q_heads, group, CAUSAL, BLOCK_M)
    rows = n0 + CONSUMER * 64 + gl.arange(0, 64, gl.SliceLayout(1, s_layout))
    dk = gl.zeros([64, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([64, HEAD_D], gl.float32, kv_layout)
    n_steps = group * n_iter
    if PREFETCH_STATS:
        lse_next = gl.load(lse_ptr + q_bh0 * seq_len + i0 * BLOCK_M + cols0)
        delta_next = gl.load(delta_ptr + q_bh0 * seq_len + i0 * BLOCK_M + cols0)
    for s in range(n_steps):
        t = t0 + s
        blk = i0 + s % n_iter
        q_row = (q_bh0 + s // n_iter) * seq_len + blk * BLOCK_M
        slot = t % NUM_STAGES
        if PREFETCH_STATS:
            lse2 = lse_next * 1.4426950408889634  # natural log -> base 2
            delta = delta_next
            s_next = (s + 1) % n_steps  # the last step reloads the first rows: harmless
            row_next = (q_bh0 + s_next // n_iter) * seq_len + (i0 + s_next % n_iter) * BLOCK_M
            lse_next = gl.load(lse_ptr + row_next + cols0)
            delta_next = gl.load(delta_ptr + row_next + cols0)
        else:
            lse2 = gl.load(lse_ptr + q_row + cols0) * 1.4426950408889634
            delta = gl.load(delta_ptr + q_row + cols0)
        mbarrier.wait(q_ready.index(slot), (t // NUM_STAGES) & 1)
        q_tile = q_smem.index(slot)
        do_tile = do_smem.index(slot)
        st_tok = warpgroup_mma(my_k, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(my_v, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[st_tok])
        pt = gl.exp2(st * qk_scale - lse2[None, :])
        if CAUSAL:
            if blk * BLOCK_M < n0 + 128:  # the block reaches below the diagonal
                pt = gl.where((blk * BLOCK_M + cols0)[None, :] >= rows[:, None], pt, 0.0)
        dpt = warpgroup_mma_wait(0, deps=[dpt_tok])
        dst = (pt * (dpt - delta[None, :])).to(gl.bfloat16)
        pt_op = gl.convert_layout(pt.to(gl.bfloat16), a_layout)
        dv_tok = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        ds_op = gl.convert_layout(dst, a_layout)
        dk_tok = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
        # Both warpgroups' dSᵀ rows in place before either reads all 128 keys of it.
        ds_buf = ds_smem.index(t % 2)
        ds_buf.slice(CONSUMER * 64, 64).store(dst)
        fence_async_shared()
        _warps_barrier()
        mbarrier.arrive(ds_ready.index(t % 2))
        mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
        dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_half, dq_zero, use_acc=False, is_async=True)
        dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok, pt_op, ds_op])
        mbarrier.arrive(q_empty.index(slot))
        if DQ_TMA:
            # The previous reduction has read my_dq (wait), on every warp (barrier), before it is rewritten.
            tma.store_wait(0)
            _warps_barrier()
            my_dq.store(dq)
            fence_async_shared()
            _warps_barrier()
            _tma_reduce_add(dq_desc, [q_row, CONSUMER * HALF_D], my_dq)
        else:
            gl.atomic_add(dq_ptr + (q_row.to(gl.int64) * HEAD_D + CONSUMER * HALF_D) + dq_offsets, dq,
                          sem="relaxed")
    # Every matmul that read K and V has been waited for: in a persistent grid the loader may
    # bring the next tile's while this warpgroup stores its 64 rows of dK (times the softmax
    # scale: S = scale · Q Kᵀ) and dV.
    if PERSISTENT:
        mbarrier.arrive(kv_empty)
    base = (kv_row + CONSUMER * 64).to(gl.int64) * HEAD_D
    gl.store(dk_ptr + base + out_offsets, (dk * scale).to(gl.bfloat16))
    gl.store(dv_ptr + base + out_offsets, dv.to(gl.bfloat16))
    return t0 + n_steps


@gluon.jit
def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, tile_id, kv_ready, kv_empty, q_ready, q_empty,
                  ds_ready, dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, seq_len, q_heads, group, n_kv_bh,
                  head_group, qk_scale, scale, CONSUMER: gl.constexpr, CAUSAL: gl.constexpr, HEAD_D: gl.constexpr,
                  BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, DQ_TMA: gl.constexpr,
                  PREFETCH_STATS: gl.constexpr, PERSISTENT: gl.constexpr):
    """One consumer warpgroup (`_bwd_tile`) for the program's key tile, the ``pid``-th in
    `_schedule`'s order; with ``PERSISTENT``, for each tile the loader hands over in
    ``tile_id`` (with K and V, ``kv_ready``) until it hands over the tile count."""
    n_kv_tiles = seq_len // 128
    if PERSISTENT:
        t0 = 0  # steps this program's ring has passed (slots, phases and dSᵀ buffers run on)
        i = 0  # key tiles done
        mbarrier.wait(kv_ready, 0)
        tile = _read_tile(tile_id.index(0), 4)
        while tile < n_kv_bh * n_kv_tiles:
            t0 = _bwd_tile(tile, t0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_empty, q_ready, q_empty,
                           ds_ready, dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, seq_len, q_heads, group,
                           qk_scale, scale, CONSUMER, CAUSAL, HEAD_D, BLOCK_M, NUM_STAGES, DQ_TMA, PREFETCH_STATS,
                           PERSISTENT)
            i += 1
            mbarrier.wait(kv_ready, i & 1)
            tile = _read_tile(tile_id.index(0), 4)
    else:
        kv_bh, rank = _schedule(gl.program_id(0), n_kv_tiles, n_kv_bh, head_group)
        mbarrier.wait(kv_ready, 0)
        _bwd_tile(kv_bh * n_kv_tiles + rank, 0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_empty, q_ready,
                  q_empty, ds_ready, dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, seq_len, q_heads, group,
                  qk_scale, scale, CONSUMER, CAUSAL, HEAD_D, BLOCK_M, NUM_STAGES, DQ_TMA, PREFETCH_STATS, PERSISTENT)
    tma.store_wait(0)


@gluon.jit
def _bwd_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, tile_counter,
                seq_len, q_heads, group, n_kv_bh, head_group, qk_scale, scale, CAUSAL: gl.constexpr,
                HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                LOADER_REGS: gl.constexpr, DQ_TMA: gl.constexpr, PREFETCH_STATS: gl.constexpr,
                PERSISTENT: gl.constexpr = False, DYNAMIC: gl.constexpr = False):
    """A 1-d grid over the ``seq / 128 · batch · kv_heads`` key tiles (128 keys of one K/V
    head): one program per tile, or with ``PERSISTENT`` fewer that each take tiles in turn
    (`_bwd_loader` says which; ``tile_counter``: one int32, zero, for ``DYNAMIC``). ``num_warps=4``
    (consumer 0) plus consumer 1 (4 warps) and the loader (1 warp). Descriptors
    over the 2-D views ``[rows, HEAD_D]``: Q and dO in ``BLOCK_M``-row blocks, K and V in
    128-row blocks, dQ (``dq_desc``, fp32) in ``[BLOCK_M, HEAD_D/2]`` blocks. ``dq_ptr``: that
    fp32 buffer, zeroed, shaped like Q; ``dk_ptr``, ``dv_ptr``: bf16, shaped like K (GQA: each
    program sums its group's query heads, so no reduction follows)."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [128, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [128, HEAD_D], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, BLOCK_M], gl.bfloat16)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 128, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D // 2], dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tile_id = gl.allocate_shared_memory(gl.int32, [1, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(kv_empty, count=2)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize(
        [(_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, tile_id, kv_ready, kv_empty, q_ready,
                          q_empty, ds_ready, dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, seq_len, q_heads,
                          group, n_kv_bh, head_group, qk_scale, scale, 0, CAUSAL, HEAD_D, BLOCK_M, NUM_STAGES,
                          DQ_TMA, PREFETCH_STATS, PERSISTENT)),
         (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, tile_id, kv_ready, kv_empty, q_ready,
                          q_empty, ds_ready, dq_desc, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, seq_len, q_heads,
                          group, n_kv_bh, head_group, qk_scale, scale, 1, CAUSAL, HEAD_D, BLOCK_M, NUM_STAGES,
                          DQ_TMA, PREFETCH_STATS, PERSISTENT)),
         (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, tile_id, kv_ready,
                        kv_empty, q_ready, q_empty, tile_counter, seq_len, q_heads, group, n_kv_bh, head_group, CAUSAL,
                        BLOCK_M, NUM_STAGES, PERSISTENT, DYNAMIC))],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


def default_bwd_tiles(head_dim: int) -> tuple[int, int]:
    """``(block_m, num_stages)`` of the backward: query rows per step and ring slots. 64 rows
    (FlashAttention-3's at both head dims): the scores tile ``[64 keys, block_m]`` and dPᵀ
    beside dK and dV keep a consumer within its 240 registers; two slots (a third measured
    the same at head dim 64, and at 128 leaves no shared memory to spare)."""
    return (64, 2)


def default_prefetch_stats(head_dim: int) -> bool:
    """Whether the backward loads each step's rows of L and D a step ahead by default: at head
    dim 64, where a step's matmuls are short and the loads' latency showed (1.07-1.17x faster
    on an H200); not at 128, where the two extra row vectors held across the loop made the
    kernel 0.5-0.6x as fast."""
    return head_dim == 64


def default_bwd_head_group(causal: bool) -> int:
    """The backward's tile order (`_schedule`) unless told: under a causal mask, heads in
    groups of `CAUSAL_HEAD_GROUP` with every head's first (longest) key tiles before the next
    ones, so that the last programs to start are short; head after head otherwise. In two
    runs on an H200 (``bench/results/raw/nvidia-h200.gluon_schedule_sweep{2,3}.log``) the
    groups made the causal backward 1-7 % faster at 14 of the 20 points and changed the rest
    by under 2 %; all heads in one group was 3-22 % slower (sweep 1): programs running
    together then share no Q or dO in L2."""
    return CAUSAL_HEAD_GROUP if causal else 1


def bwd_shared_bytes(head_dim: int, block_m: int, num_stages: int) -> int:
    """Shared memory of the backward kernel: the ring of Q and dO blocks, the K and V tiles,
    two dSᵀ buffers and each consumer's fp32 dQ tile (barriers aside)."""
    return 2 * (2 * num_stages * block_m * head_dim + 2 * BWD_BLOCK_N * head_dim + 2 * BWD_BLOCK_N * block_m) \
        + 4 * block_m * head_dim


def flash_attention_gluon_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                                   scale: float | None = None, block_m: int | None = None,
                                   num_stages: int | None = None, consumer_regs: int = 240, loader_regs: int = 24,
                                   dq_reduce: str = "tma", prefetch_stats: bool | None = None,
                                   head_group: int | None = None, persistent: bool | int = False,
                                   dynamic: bool | None = None, compile_only: bool = False):
    """Gradients ``(dq, dk, dv)`` of `flash_attention_gluon`'s attention, in its scope.

    ``q, k, v``, ``causal`` and ``scale`` as given to the forward; ``out: [batch, q_heads,
    seq, head_dim]`` bf16 and ``lse: [batch, q_heads, seq]`` fp32 (natural log) as the
    forward (this one, or any FlashAttention forward) returned them; ``dout`` shaped like
    ``out``. ``block_m`` (64 or 128) query rows per step and ``num_stages`` ring slots default
    to `default_bwd_tiles` (ValueError if they need more than an SM's 227 KiB of shared
    memory, `bwd_shared_bytes`); ``dq_reduce``: ``"tma"`` (one bulk reduction per dQ tile) or
    ``"atomic"`` (element-wise atomics); ``prefetch_stats``: load each step's rows of the
    logsumexp and of D one step ahead (default: `default_prefetch_stats`); ``head_group``: the
    order of the key tiles, as the forward's (default: `default_bwd_head_group`);
    ``persistent``: True for one program per SM taking key tiles in turn (the loader brings
    the next tile's K and V while the consumers store this one's dK and dV), or a number of
    programs; ``dynamic`` (persistent grids; default True): claim each next tile from an
    atomic counter, as the forward's `_loader`. Not the default: the loop around the tiles
    keeps more values live, ptxas spills 150-230 bytes per thread at head dim 128, and on an
    H200 the persistent backward (claiming its tiles) ran at 0.76-0.83x of one program per tile
    there; at head dim 64 it gained 10 % at 1k causal keys and lost up to 4 % elsewhere
    (``bench/results/raw/nvidia-h200.gluon_bwd_persistent.log``). Returns bf16 ``dq``
    shaped like q, ``dk, dv`` like k, v (under GQA the sums over each group's query heads);
    with ``compile_only``, compiles the dK/dV kernel without launching anything and returns it.

    Three launches: the preprocess (``D = rowsum(dO ∘ O)`` and a zeroed fp32 dQ buffer), the
    warp-specialized dK/dV kernel, which adds dQ into the buffer, and dQ's conversion to bf16,
    with `minillm.kernels.ch04_flash_attention_hopper`'s helpers for the first and last."""
    from minillm.kernels.ch04_flash_attention_hopper import launch_bwd_preprocess, scale_convert

    reason = _reason(q, k, v)
    if reason:
        raise ValueError(reason)
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} must be {tuple(q.shape[:3])}")
    default_m, default_stages = default_bwd_tiles(q.shape[-1])
    block_m, num_stages = block_m or default_m, num_stages or default_stages
    if block_m not in (64, 128):
        raise ValueError(f"block_m must be 64 or 128, got {block_m}")
    if bwd_shared_bytes(q.shape[-1], block_m, num_stages) > 227 * 1024:
        raise ValueError(f"block_m={block_m} with {num_stages} stages needs "
                         f"{bwd_shared_bytes(q.shape[-1], block_m, num_stages)} bytes of shared memory, over 227 KiB")
    if dq_reduce not in ("tma", "atomic"):
        raise ValueError(f"dq_reduce must be 'tma' or 'atomic', got {dq_reduce!r}")
    if head_group is not None and head_group < 1:
        raise ValueError(f"head_group must be a positive number of heads, got {head_group}")
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout.to(torch.bfloat16)))
    lse = lse.float().contiguous()
    b, h, s, d = q.shape
    scale, _ = scale_and_window(d, scale, None)
    delta = torch.empty((b, h, s), device=q.device, dtype=torch.float32)
    dq_acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    descriptors = (_descriptor(q.view(-1, d), block_m), _descriptor(dout.view(-1, d), block_m),
                   _descriptor(k.view(-1, d), BWD_BLOCK_N), _descriptor(v.view(-1, d), BWD_BLOCK_N),
                   _descriptor(dq_acc.view(-1, d), block_m, d // 2))
    n_kv_bh = b * k.shape[1]
    n_tiles = s // BWD_BLOCK_N * n_kv_bh
    dynamic = bool(persistent) and (True if dynamic is None else bool(dynamic))
    grid, tile_counter = _grid(n_tiles, persistent, dynamic, q.device)
    tile_counter = delta if tile_counter is None else tile_counter  # (unread)
    head_group = default_bwd_head_group(causal) if head_group is None else head_group
    args = (lse, delta, dq_acc, dk, dv, tile_counter, s, h, h // k.shape[1], n_kv_bh, head_group, scale * LOG2E, scale)
    meta = dict(CAUSAL=bool(causal), HEAD_D=d, BLOCK_M=block_m, NUM_STAGES=num_stages, CONSUMER_REGS=consumer_regs,
                LOADER_REGS=loader_regs, num_warps=4, DQ_TMA=dq_reduce == "tma", PERSISTENT=bool(persistent),
                DYNAMIC=dynamic,
                PREFETCH_STATS=bool(default_prefetch_stats(d) if prefetch_stats is None else prefetch_stats))
    if compile_only:
        return _bwd_kernel.warmup(*descriptors, *args, grid=grid, **meta)
    launch_bwd_preprocess(out, dout, delta, dq_acc, True, d)
    launch(_bwd_kernel, grid, *descriptors, *args, **meta)
    dq = torch.empty_like(q)
    scale_convert(dq_acc, dq, scale)
    return dq, dk, dv
