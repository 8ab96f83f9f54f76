"""Chapter 4, on Hopper: FlashAttention with FlashAttention-3's ideas, in Triton.

FlashAttention-2 (`minillm.kernels.ch04_flash_attention`) was designed for the A100. On an H100
the same algorithm leaves a third of the tensor cores idle, because Hopper adds hardware that
FA2's code predates. FlashAttention-3 (Shah et al., 2024) rewrote the forward around it. What
its ideas become in Triton on sm_90, each a switch of `HopperConfig` so that the chapter can
measure what it buys (``bench/ch04_hopper.py``):

1. **TMA through host-made tensor descriptors** (``tma``). The Tensor Memory Accelerator copies a
   whole tile between global and shared memory from its coordinates and checks the bounds
   itself. FA2's TMA path builds its descriptors *inside* the kernel, per program, in a
   scratch buffer; here the host builds one 4-d descriptor per tensor (``[batch, heads, seq,
   head_dim]``, tile ``[1, 1, rows, head_dim]``) and passes it by value: no scratch buffer, no
   descriptor set-up in the kernel, and rows past the end of a head read as zeros (the
   descriptor knows each head's length) so any sequence length works. Off: pointer loads
   with masks, as on an A100.
2. **Warp specialization** (``warp_specialize``). FA3 splits a program's warps into a
   *producer* warpgroup that only issues TMA loads and *consumer* warpgroups that only do
   the matmuls and the softmax, handing tiles over through shared-memory buffers guarded by
   barriers. Triton does that split itself for a loop marked ``tl.range(...,
   warp_specialize=True)``: here, the loop over the unmasked key blocks (the bulk of the work).
   Off: one kind of warp does everything, and the compiler's software pipeline keeps
   ``num_stages`` loads in flight.
3. **Persistent programs with a tile scheduler** (``persistent``, ``scheduler``,
   ``programs_per_sm``). Instead of one program per (query block, head), launch a few
   programs per SM and let each loop over tiles. The order of the tiles is ours to choose:
   heads outermost (the programs running at one time share a few heads' K/V, which then stay
   in L2) and, when causal, the longest query blocks (the bottom rows, which see the most
   keys) first within each head. Which program gets which tile: a static round robin
   (``pid, pid + #programs, ...``), or FA3's dynamic scheduler, a global counter that each
   program bumps (``atomic_add``) for its next tile, so that a program that drew short tiles
   draws more.
4. **Larger tiles** (``block_m``, ``block_n``). TMA frees the registers that per-element
   addresses took, so at head dim 128 a 128 x 128 tile fits: half the loop iterations, each
   with twice the matmul work per softmax bookkeeping step (measured: 128 x 64 stays faster).
5. **The softmax/GEMM overlap** (``overlap``). FA3 overlaps the softmax of one block with the
   matmuls of another: two warpgroups "ping-pong", and inside a warpgroup the ``Q K_{j+1}ᵀ``
   of the next block is issued before the softmax of block j. Triton schedules instructions
   itself, but the order of the source decides what *can* overlap: with the switch on, the
   loop over unmasked blocks is written one matmul ahead (`_kv_steps_overlapped`), and
   Hopper's asynchronous matmul lets the tensor cores run while the exponentials are
   computed. (Two programs per SM, ``programs_per_sm = 2``, is the coarse form of the
   ping-pong: the SM's warp schedulers interleave two independent programs.)
6. **FP8** (`flash_attention_fp8`). Hopper's tensor cores do e4m3 matmuls at twice the bf16
   rate. Q and K are quantized with one scale per tile of rows (*block quantization*: an
   outlier only coarsens its own block), V with one per tile of keys or one per head
   (``v_scale``); Q·Kᵀ and P·V run in FP8 with fp32 accumulation, and the scales are folded
   back in fp32 (Q's and K's into the softmax scale of each tile, V's into the accumulator or,
   one per head, into the output). Optional **incoherent processing**: multiply Q and K by the
   same random orthogonal matrix (a Hadamard matrix with random signs) before quantizing.
   Scores are unchanged (``(QR)(KR)ᵀ = QKᵀ``), but the rotation spreads an outlier coordinate
   over all of them, so the largest rounding errors of the scores shrink.

The CPU runs the same kernel under Triton's interpreter (fp32, exact products); every switch
can run there (warp specialization and the software pipeline are compile-time schedules, of
no meaning to the interpreter, so it computes the same function either way).

Layout: ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads, kv_len, head_dim]``
(GQA: ``q_heads % kv_heads == 0``); causal masks are bottom-right aligned, as in the rest of
the chapter.

The backward (`flash_attention_hopper_backward`, the last section of this module) applies
the same ideas to FA2's dK/dV and dQ kernels, with its own switches (`HopperBwdConfig`);
`attention_backward` takes it on sm_90 where the Gluon backward
(`minillm.kernels.ch04_flash_attention_gluon`) does not apply, and FA2's backward off sm_90.

The last section is the chapter's one entry point: `fastest_attention`, differentiable, runs
each call on the fastest kernel that covers it (`forward_kernel`): the Gluon kernels on sm_90
where their scope allows, with the settings that measured fastest for the call
(`fastest_forward`), these Triton Hopper kernels elsewhere on sm_90, FA2's off it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from minillm.kernels.base import (  # shared by every chapter's attention kernels
    tl, triton,
    LN2_C, LOG2E, LOG2E_C, block_d, dot_precision, head_dim_offsets, interpreting, launch, num_sms,
    online_softmax_update, scale_and_window,
)
from minillm.kernels.ch04_flash_attention import kv_segments, visible_mask

#: The largest finite e4m3 value (torch.float8_e4m3fn, Triton's ``tl.float8e4nv``).
E4M3_MAX = 448.0
#: Unit roundoff of e4m3 (3 mantissa bits): a rounded value is within a relative 2^-4 of the
#: original, for values in the normal range.
E4M3_UNIT_ROUNDOFF = 2.0 ** -4


# ----------------------------------------------------------------------------------------
# Helpers inside the kernel
# ----------------------------------------------------------------------------------------
@triton.jit
def _load_rows(desc, ptr_base, offs_rows, offs_d, d_ok, n_rows, stride_row, b, h, row0,
               ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """One ``[ROWS, BLOCK_D]`` tile starting at row ``row0`` of a head's ``[len, head_dim]``
    matrix: through the 4-d descriptor (``[b, h, row0, 0]``; rows past ``n_rows`` arrive as
    zeros) or through pointers with a mask (``offs_rows`` = ``row0 + arange(ROWS)``)."""
    if TMA:
        return desc.load([b, h, row0, 0]).reshape(ROWS, BLOCK_D)
    rows = offs_rows.to(tl.int64)[:, None]  # int64: row x stride can pass 2^31
    return tl.load(ptr_base + rows * stride_row + offs_d[None, :], mask=(offs_rows < n_rows)[:, None] & d_ok,
                   other=0.0)


@triton.jit
def _load_v_fp8(desc, ptr_base, offs_n, offs_d, d_ok, stride_vd, b, h, start_n,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """One FP8 V tile, ``[BLOCK_N, BLOCK_D]``, read from the *transposed* copy ``Vᵀ: [..,
    head_dim, len_padded]`` made by the quantizer: Hopper's FP8 matmul wants its second
    operand contiguous along the reduction axis (here the keys). The padding keys are zeros."""
    if TMA:
        vt = desc.load([b, h, 0, start_n]).reshape(BLOCK_D, BLOCK_N)
    else:
        cols = offs_n.to(tl.int64)[None, :]
        vt = tl.load(ptr_base + offs_d[:, None] * stride_vd + cols, mask=tl.trans(d_ok), other=0.0)
    return tl.trans(vt)


@triton.jit
def _probabilities_to(p, dtype, ROUND_FIRST: tl.constexpr):
    """``p`` (fp32, in [0, 1]) converted to ``dtype`` (e4m3) for the P·V matmul.

    ``ROUND_FIRST`` (set under the interpreter only): round to the e4m3 grid (3 mantissa bits,
    spacing ``2^(e-3)``, subnormal spacing ``2^-9``) in fp32 first, so the cast itself is exact.
    Triton 3.9's interpreter casts fp32 to e4m3 wrongly when a value rounds *up* to the next
    power of two (0.49 becomes 0.25, not 0.5: the carry into the exponent is lost); the GPU's
    conversion instruction rounds correctly and takes the plain cast."""
    if ROUND_FIRST:
        e = tl.maximum(tl.floor(tl.math.log2(tl.where(p > 0, p, 1.0))), -6.0)
        step = tl.math.exp2(e - 3.0)
        p = tl.floor(p / step + 0.5) * step
    return p.to(dtype)


@triton.jit
def _scores(q, desc_k, K_head, offs_n, offs_d, d_ok, kv_len, stride_kn, b, kv_h, start_n,
            DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Raw scores ``q kᵀ`` of one key block, ``[BLOCK_M, BLOCK_N]`` fp32 (rows of K past
    ``kv_len`` are zeros; the caller masks them)."""
    k = _load_rows(desc_k, K_head, offs_n, offs_d, d_ok, kv_len, stride_kn, b, kv_h, start_n, BLOCK_N, BLOCK_D, TMA)
    return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)


@triton.jit
def _softmax_and_pv(acc, l_i, m_i, s, desc_v, V_head, KScale_head, VScale_head, stride_vn, stride_vd,
                    offs_m, offs_n, offs_d, d_ok, b, kv_h, start_n, q_len, kv_len, qk_scale,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                    FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_P_FIRST: tl.constexpr,
        V_SCALE_PER_HEAD: tl.constexpr = False):
    """Fold one key block's scores ``s`` into the state ``(acc, l_i, m_i)``: the online softmax
    of Chapter 3 with FA2's unnormalised accumulator (line by line as `_fwd_tiles` of the FA2
    module). ``MASKED``: apply the causal / end-of-sequence mask (the diagonal and ragged
    blocks); otherwise every pair is visible and no mask is built.

    ``FP8``: ``qk_scale`` already holds Q's block scale and the key block's scale is folded in
    here; P is rounded to e4m3 for the P·V matmul, and V's block scale multiplies that matmul's
    fp32 result before it joins the accumulator.
    """
    if FP8:
        tile_scale = qk_scale * tl.load(KScale_head + start_n // BLOCK_N)
    else:
        tile_scale = qk_scale
    if MASKED:
        visible = visible_mask(offs_m[:, None], offs_n[None, :], q_len, kv_len, 0, CAUSAL, False)
        s = tl.where(visible, s * tile_scale, float("-inf"))
    p, alpha, l_new, m_new = online_softmax_update(m_i, l_i, s, tile_scale, MASKED)
    if FP8:
        v = _load_v_fp8(desc_v, V_head, offs_n, offs_d, d_ok, stride_vd, b, kv_h, start_n, BLOCK_N, BLOCK_D, TMA)
        # P is in [0, 1]: e4m3 keeps it to 3 mantissa bits without any scale of its own.
        p8 = _probabilities_to(p, v.dtype, ROUND_P_FIRST)
        if V_SCALE_PER_HEAD:  # one scale for all of V: applied once, at the end
            acc = tl.dot(p8, v, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p8, v) * tl.load(VScale_head + start_n // BLOCK_N)
    else:
        v = _load_rows(desc_v, V_head, offs_n, offs_d, d_ok, kv_len, stride_vn, b, kv_h, start_n,
                       BLOCK_N, BLOCK_D, TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_new, m_new


@triton.jit
def _kv_steps(acc, l_i, m_i, q, desc_k, desc_v, K_head, V_head, KScale_head, VScale_head,
              stride_kn, stride_vn, stride_vd, offs_m, offs_n0, offs_d, d_ok, b, kv_h, lo, hi, q_len, kv_len,
              qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              TMA: tl.constexpr, FP8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, ROUND_P_FIRST: tl.constexpr,
        V_SCALE_PER_HEAD: tl.constexpr = False):
    """Stream key blocks ``[lo, hi)`` past the query tile ``q``, one block per iteration:
    scores, then softmax and P·V (the FA2 loop)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = start_n + offs_n0
        s = _scores(q, desc_k, K_head, offs_n, offs_d, d_ok, kv_len, stride_kn, b, kv_h, start_n,
                    DOT_PRECISION, TMA, BLOCK_N, BLOCK_D)
        acc, l_i, m_i = _softmax_and_pv(acc, l_i, m_i, s, desc_v, V_head, KScale_head, VScale_head, stride_vn,
                                        stride_vd, offs_m, offs_n, offs_d, d_ok, b, kv_h, start_n, q_len, kv_len,
                                        qk_scale, MASKED, CAUSAL, DOT_PRECISION, TMA, FP8, BLOCK_N, BLOCK_D,
                                        ROUND_P_FIRST, V_SCALE_PER_HEAD)
    return acc, l_i, m_i


@triton.jit
def _kv_steps_overlapped(acc, l_i, m_i, q, desc_k, desc_v, K_head, V_head, KScale_head, VScale_head,
                         stride_kn, stride_vn, stride_vd, offs_m, offs_n0, offs_d, d_ok, b, kv_h, lo, hi, q_len,
                         kv_len, qk_scale, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                         FP8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, ROUND_P_FIRST: tl.constexpr,
        V_SCALE_PER_HEAD: tl.constexpr = False):
    """`_kv_steps` over unmasked blocks ``[lo, hi)`` (whole blocks), software-pipelined by one
    matmul: iteration j issues the scores of block j+1 *before* the softmax of block j. On
    Hopper a matmul is issued asynchronously and waited for only where its result is used,
    so the tensor cores work on ``Q K_{j+1}ᵀ`` while the exponentials of block j are computed
    (FA3's intra-warpgroup overlap of softmax and GEMMs). Costs one block of scores more in
    registers."""
    s = _scores(q, desc_k, K_head, lo + offs_n0, offs_d, d_ok, kv_len, stride_kn, b, kv_h, lo,
                DOT_PRECISION, TMA, BLOCK_N, BLOCK_D)  # (unused when the segment is empty)
    for start_n in tl.range(lo, hi - BLOCK_N, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        next_n = start_n + BLOCK_N
        s_next = _scores(q, desc_k, K_head, next_n + offs_n0, offs_d, d_ok, kv_len, stride_kn, b, kv_h, next_n,
                         DOT_PRECISION, TMA, BLOCK_N, BLOCK_D)
        acc, l_i, m_i = _softmax_and_pv(acc, l_i, m_i, s, desc_v, V_head, KScale_head, VScale_head, stride_vn,
                                        stride_vd, offs_m, start_n + offs_n0, offs_d, d_ok, b, kv_h, start_n, q_len,
                                        kv_len, qk_scale, False, CAUSAL, DOT_PRECISION, TMA, FP8, BLOCK_N, BLOCK_D,
                                        ROUND_P_FIRST, V_SCALE_PER_HEAD)
        s = s_next
    if lo < hi:  # the last block: its scores are already computed
        last = hi - BLOCK_N
        acc, l_i, m_i = _softmax_and_pv(acc, l_i, m_i, s, desc_v, V_head, KScale_head, VScale_head, stride_vn,
                                        stride_vd, offs_m, last + offs_n0, offs_d, d_ok, b, kv_h, last, q_len,
                                        kv_len, qk_scale, False, CAUSAL, DOT_PRECISION, TMA, FP8, BLOCK_N, BLOCK_D,
                                        ROUND_P_FIRST, V_SCALE_PER_HEAD)
    return acc, l_i, m_i


@triton.jit
def _store_rows(desc_o, O_head, LSE_head, out, lse, offs_m, offs_d, d_ok, q_len, stride_om, stride_lm, b, h,
                start_m, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """Write ``ROWS`` output rows (rows past ``q_len`` are dropped) and their logsumexp."""
    in_m = offs_m < q_len
    if TMA:
        desc_o.store([b, h, start_m, 0], out.to(desc_o.dtype).reshape(1, 1, ROWS, BLOCK_D))
    else:
        rows = offs_m.to(tl.int64)[:, None]
        tl.store(O_head + rows * stride_om + offs_d[None, :], out.to(O_head.dtype.element_ty),
                 mask=in_m[:, None] & d_ok)
    tl.store(LSE_head + offs_m.to(tl.int64) * stride_lm, lse, mask=in_m)


# ----------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------
@triton.jit
def _output_tile(
    tile,
    Q, K, V, O, LSE, QScale, KScale, VScale, desc_q, desc_k, desc_v, desc_o,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_lm,
    stride_sb, stride_sh, kv_scale_blocks,
    q_heads, group, q_len, kv_len, n_m_blocks, qk_scale, offs_n0, offs_d, d_ok,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, OVERLAP: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_P_FIRST: tl.constexpr, V_SCALE_PER_HEAD: tl.constexpr,
):
    """Output tile ``tile`` (of ``n_m_blocks · batch · q_heads``): ``BLOCK_M`` rows of one head.

    Tile ``t`` belongs to (batch · head) ``t // n_m_blocks``: heads outermost, so programs
    running together share K/V in L2. Within a head, causal tiles go bottom-up (the longest
    first). ``desc_*`` are 4-d tensor descriptors when ``TMA`` (else the same tensors, unused);
    Q, K, V, O, LSE are the tensors themselves (the pointer path, and LSE always).
    ``FP8``: Q, K, V are e4m3 (V transposed: ``[b, kv_heads, head_dim, len_padded]``) with one
    fp32 scale per block of rows in ``QScale`` (``[b, q_heads, q_blocks]``, strides
    ``stride_sb`` / ``stride_sh``), ``KScale`` and ``VScale`` (``[b, kv_heads, kv_blocks]``,
    contiguous, ``kv_scale_blocks`` per head; ``V_SCALE_PER_HEAD``: V has one scale per head,
    applied once at the end). ``OVERLAP``: the unmasked key blocks go through
    `_kv_steps_overlapped`, the masked ones (a few per tile) through the plain loop.
    """
    bh = tile // n_m_blocks
    m_block = tile % n_m_blocks
    if CAUSAL:
        m_block = n_m_blocks - 1 - m_block  # longest rows first
    b = bh // q_heads
    h = bh % q_heads
    kv_h = h // group  # GQA: K/V are shared, never copied
    start_m = m_block * BLOCK_M
    b64 = b.to(tl.int64)
    Q_head = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
    O_head = O + b64 * stride_ob + h.to(tl.int64) * stride_oh
    K_head = K + b64 * stride_kb + kv_h.to(tl.int64) * stride_kh
    V_head = V + b64 * stride_vb + kv_h.to(tl.int64) * stride_vh
    LSE_head = LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh
    KScale_head = KScale + (b * (q_heads // group) + kv_h) * kv_scale_blocks
    VScale_head = VScale + (b * (q_heads // group) + kv_h) * kv_scale_blocks

    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_rows(desc_q, Q_head, offs_m, offs_d, d_ok, q_len, stride_qm, b, h, start_m, BLOCK_M, BLOCK_D, TMA)
    if FP8:  # Q's block scale joins the softmax scale: s = (q8·k8ᵀ)·sq·sk
        tile_qk_scale = qk_scale * tl.load(QScale + b * stride_sb + h * stride_sh + m_block)
    else:
        tile_qk_scale = qk_scale
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    # FA2's three segments (see `kv_segments`): masked, unmasked (the bulk), masked.
    lo, full_lo, full_hi, hi = kv_segments(start_m, q_len, kv_len, 0, BLOCK_M, BLOCK_N, CAUSAL, False)
    acc, l_i, m_i = _kv_steps(acc, l_i, m_i, q, desc_k, desc_v, K_head, V_head, KScale_head, VScale_head,
                              stride_kn, stride_vn, stride_vd, offs_m, offs_n0, offs_d, d_ok, b, kv_h, lo, full_lo,
                              q_len, kv_len, tile_qk_scale, True, CAUSAL, DOT_PRECISION, TMA, FP8, False,
                              BLOCK_N, BLOCK_D, ROUND_P_FIRST, V_SCALE_PER_HEAD)
    if OVERLAP:
        acc, l_i, m_i = _kv_steps_overlapped(
            acc, l_i, m_i, q, desc_k, desc_v, K_head, V_head, KScale_head, VScale_head, stride_kn, stride_vn,
            stride_vd, offs_m, offs_n0, offs_d, d_ok, b, kv_h, full_lo, full_hi, q_len, kv_len, tile_qk_scale,
            CAUSAL, DOT_PRECISION, TMA, FP8, WARP_SPECIALIZE, BLOCK_N, BLOCK_D, ROUND_P_FIRST, V_SCALE_PER_HEAD)
    else:
        acc, l_i, m_i = _kv_steps(acc, l_i, m_i, q, desc_k, desc_v, K_head, V_head, KScale_head, VScale_head,
                                  stride_kn, stride_vn, stride_vd, offs_m, offs_n0, offs_d, d_ok, b, kv_h,
                                  full_lo, full_hi, q_len, kv_len, tile_qk_scale, False, CAUSAL, DOT_PRECISION,
                                  TMA, FP8, WARP_SPECIALIZE, BLOCK_N, BLOCK_D, ROUND_P_FIRST, V_SCALE_PER_HEAD)
    acc, l_i, m_i = _kv_steps(acc, l_i, m_i, q, desc_k, desc_v, K_head, V_head, KScale_head, VScale_head,
                              stride_kn, stride_vn, stride_vd, offs_m, offs_n0, offs_d, d_ok, b, kv_h, full_hi, hi,
                              q_len, kv_len, tile_qk_scale, True, CAUSAL, DOT_PRECISION, TMA, FP8, False,
                              BLOCK_N, BLOCK_D, ROUND_P_FIRST, V_SCALE_PER_HEAD)

    # FA2's epilogue: divide by the softmax sum once (a row that saw no key gets 0), and
    # keep L = m + log l, in natural log (-inf for such a row).
    out = acc * (1.0 / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    if FP8 and V_SCALE_PER_HEAD:
        out = out * tl.load(VScale_head)
    lse = (m_i + tl.math.log2(l_i)) * LN2_C
    _store_rows(desc_o, O_head, LSE_head, out, lse, offs_m, offs_d, d_ok, q_len, stride_om, stride_lm,
                b, h, start_m, BLOCK_M, BLOCK_D, TMA)


@triton.jit
def _hopper_fwd_kernel(
    Q, K, V, O, LSE, QScale, KScale, VScale, desc_q, desc_k, desc_v, desc_o, TileCounter,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_lm,
    stride_sb, stride_sh, kv_scale_blocks,
    q_heads, group, q_len, kv_len, n_m_blocks, n_tiles, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, OVERLAP: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_P_FIRST: tl.constexpr = False,
    V_SCALE_PER_HEAD: tl.constexpr = False, WS_TILES: tl.constexpr = False, DYNAMIC: tl.constexpr = False,
):
    """Each program computes output tiles (`_output_tile`) until none is left.

    Static schedule (``DYNAMIC`` off): tiles ``pid, pid + #programs, ...``; with a grid of
    ``n_tiles`` programs that is one tile each (the hardware's block scheduler hands programs
    to SMs as they free up), with a few programs per SM it is a fixed round robin.
    ``DYNAMIC``: a persistent program takes tile ``pid`` first, then asks a global counter
    ``TileCounter`` (zeroed by the launcher) for the next one (``atomic_add``), so a program
    that drew short tiles simply draws more: FA3's tile scheduler.
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    if DYNAMIC:
        tile = tl.program_id(0)
        while tile < n_tiles:
            _output_tile(tile, Q, K, V, O, LSE, QScale, KScale, VScale, desc_q, desc_k, desc_v, desc_o,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om,
                      stride_lb, stride_lh, stride_lm, stride_sb, stride_sh, kv_scale_blocks,
                      q_heads, group, q_len, kv_len, n_m_blocks, qk_scale, offs_n0, offs_d, d_ok,
                      HEAD_DIM, BLOCK_D, CAUSAL, DOT_PRECISION, TMA, WARP_SPECIALIZE, OVERLAP, FP8,
                      BLOCK_M, BLOCK_N, ROUND_P_FIRST, V_SCALE_PER_HEAD)
            tile = tl.atomic_add(TileCounter, 1) + tl.num_programs(0)
    else:
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), warp_specialize=WS_TILES,
                             flatten=False):
            _output_tile(tile, Q, K, V, O, LSE, QScale, KScale, VScale, desc_q, desc_k, desc_v, desc_o,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om,
                      stride_lb, stride_lh, stride_lm, stride_sb, stride_sh, kv_scale_blocks,
                      q_heads, group, q_len, kv_len, n_m_blocks, qk_scale, offs_n0, offs_d, d_ok,
                      HEAD_DIM, BLOCK_D, CAUSAL, DOT_PRECISION, TMA, WARP_SPECIALIZE, OVERLAP, FP8,
                      BLOCK_M, BLOCK_N, ROUND_P_FIRST, V_SCALE_PER_HEAD)


# ----------------------------------------------------------------------------------------
# Configurations: every idea is a switch
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HopperConfig:
    """How `flash_attention_hopper` runs: tile sizes, launch options and one switch per idea.

    ``block_m`` query rows x ``block_n`` keys per step; ``num_warps`` (8 = two warpgroups of
    64 rows each at ``block_m = 128``), ``num_stages`` (loads in flight); ``tma``: host
    tensor descriptors, else masked pointer loads; ``warp_specialize``: producer/consumer
    warps on the unmasked key loop; ``persistent``: one program per SM looping over tiles,
    else one program per tile; ``programs_per_sm``: persistent programs per SM (2 lets one
    program's softmax overlap another's matmuls on the same SM when registers and shared
    memory allow two); ``overlap``: the scores of the next key block are issued before the
    softmax of this one (`_kv_steps_overlapped`); ``ws_loop``: which loop ``warp_specialize``
    marks, ``"keys"`` (the unmasked key loop) or ``"tiles"`` (the persistent loop over tiles);
    ``scheduler`` of a persistent grid: ``"static"`` (round robin) or ``"dynamic"`` (a global
    tile counter); ``v_scale`` (FP8 only): one scale per ``block_n`` keys of V (``"block"``) or
    one per head (``"head"``, which lets the P·V matmul accumulate in place)."""
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    tma: bool = True
    warp_specialize: bool = False
    persistent: bool = True
    overlap: bool = False
    programs_per_sm: int = 1
    ws_loop: str = "keys"
    scheduler: str = "static"
    v_scale: str = "block"

    def describe(self) -> str:
        on = [name for name in ("tma", "warp_specialize", "persistent", "overlap") if getattr(self, name)]
        if self.warp_specialize and self.ws_loop != "keys":
            on[on.index("warp_specialize")] = f"warp_specialize({self.ws_loop})"
        if self.persistent and (self.programs_per_sm != 1 or self.scheduler != "static"):
            on[on.index("persistent")] = (f"persistent x{self.programs_per_sm}/SM"
                                          + (f" {self.scheduler}" if self.scheduler != "static" else ""))
        return (f"tile {self.block_m}x{self.block_n}, {self.num_warps} warps, {self.num_stages} stages"
                + (f", {'+'.join(on)}" if on else ", no switches"))


#: The configuration used per head dim (padded: <= 64, 128) and kind, chosen from the sweeps
#: of ``bench/ch04_hopper.py`` on an H100 (bf16, N = 4k and 16k, causal and not):
#: - bf16, head dim 128: 128 x 64 tiles; persistent with the dynamic scheduler ties with one
#:   program per tile (within 4 %) and is kept as FA3's design;
#: - bf16, head dim 64: one program per tile (two 128 x 64 programs share an SM, which a
#:   grid of one persistent program per SM forbids: 300 instead of 400 TFLOP/s);
#: - FP8: 64 x 64 tiles, 4 warps, one program per tile (several per SM), and one V scale per
#:   head, so that P·V accumulates in place (with per-block V scales: 2-22 % slower).
DEFAULT_CONFIGS = {
    ("bf16", 64): HopperConfig(128, 64, 8, 3, persistent=False),
    ("bf16", 128): HopperConfig(128, 64, 8, 3, persistent=True, scheduler="dynamic"),
    ("fp8", 64): HopperConfig(64, 64, 4, 3, persistent=False, v_scale="head"),
    ("fp8", 128): HopperConfig(64, 64, 4, 3, persistent=False, v_scale="head"),
}
#: Under the interpreter: small tiles (fast on a CPU), BLOCK_M != BLOCK_N (the diagonal logic
#: is exercised as with unequal GPU tiles), and every switch on, so the CPU tests run them all.
INTERPRET_CONFIG = HopperConfig(32, 16, 4, 1, tma=True, warp_specialize=True, persistent=True, overlap=True)


def default_config(head_dim: int, fp8: bool = False) -> HopperConfig:
    """The configuration `flash_attention_hopper` / `flash_attention_fp8` use by default."""
    if interpreting():
        return INTERPRET_CONFIG
    bd = block_d(head_dim)
    return DEFAULT_CONFIGS[("fp8" if fp8 else "bf16", 64 if bd <= 64 else 128)]


#: The switches the chapter's ablation flips one at a time (name -> its two settings).
ABLATIONS = {
    "tma": "host TMA descriptors / pointer loads with masks",
    "warp_specialize": "producer and consumer warps / one kind of warp, software pipelining only",
    "persistent": "a few programs per SM looping over tiles / one program per tile",
    "overlap": "next block's scores issued before this block's softmax / right before their own",
}


def ablated(config: HopperConfig, switch: str) -> HopperConfig:
    """``config`` with ``switch`` (a key of `ABLATIONS`) flipped."""
    return replace(config, **{switch: not getattr(config, switch)})


# ----------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------
def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the host can describe ``tensors`` to TMA: a Hopper-or-newer GPU (or the
    interpreter, which emulates it, so the CPU tests run the TMA path), unit stride along the
    last axis and 16-byte aligned base and strides (the hardware's requirement)."""
    if tensors[0].is_cuda and torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
    return True


def _descriptor(t: torch.Tensor, rows: int, cols: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [1, 1, rows, cols])


#: The largest head dim the Hopper kernels take (FA2's go to 256).
HOPPER_MAX_HEAD_DIM = 128


def _check(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q, k, v must be [batch, heads, seq, head_dim] (k, v alike); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} does not match k/v {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q_heads={q.shape[1]} must be a multiple of kv_heads={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= q.shape[-1] <= HOPPER_MAX_HEAD_DIM:
        raise ValueError(f"head_dim={q.shape[-1]}: 1..{HOPPER_MAX_HEAD_DIM} supported by the Hopper kernel")


def _launch(q, k, v, out, lse, scales, causal: bool, scale: float, config: HopperConfig, fp8: bool,
            out_dtype: torch.dtype) -> None:
    """Launch `_hopper_fwd_kernel` (``q``/``k``/``v`` already quantized when ``fp8``; ``v`` is
    then the transposed copy). ``scales``: ``(q_scale, k_scale, v_scale)`` or None."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    # FP8 matrix instructions reduce over 32 elements at a time: pad small head dims to 32
    # (the padding columns are masked, or read as zeros through TMA).
    bd = max(block_d(head_dim), 32) if fp8 else block_d(head_dim)
    n_m_blocks = triton.cdiv(q_len, config.block_m)
    n_tiles = n_m_blocks * batch * q_heads
    if n_tiles == 0:
        return
    use_tma = config.tma and tma_ok(q, k, v, out)
    if use_tma:
        desc_q = _descriptor(q, config.block_m, bd)
        desc_o = _descriptor(out, config.block_m, bd)
        desc_k = _descriptor(k, config.block_n, bd)
        desc_v = _descriptor(v, bd, config.block_n) if fp8 else _descriptor(v, config.block_n, bd)
    else:
        desc_q, desc_k, desc_v, desc_o = q, k, v, out
    if scales is None:
        q_scale = k_scale = v_scale = lse  # unused: any tensor will do
        scale_strides, kv_scale_blocks = (0, 0), 0
    else:
        q_scale, k_scale, v_scale = scales
        scale_strides, kv_scale_blocks = (q_scale.stride(0), q_scale.stride(1)), k_scale.shape[-1]
        if v_scale.shape != k_scale.shape:  # one scale per head: K's layout, the head's scale at its start
            v_scale = v_scale.expand(k_scale.shape).contiguous()
    grid = (min(n_tiles, num_sms(q.device) * config.programs_per_sm) if config.persistent else n_tiles,)
    dynamic = config.persistent and config.scheduler == "dynamic"
    tile_counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else lse
    launch(
        _hopper_fwd_kernel, grid,
        q, k, v, out, lse, q_scale, k_scale, v_scale, desc_q, desc_k, desc_v, desc_o, tile_counter,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), v.stride(2) if fp8 else 0,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        *scale_strides, kv_scale_blocks,
        q_heads, q_heads // kv_heads, q_len, kv_len, n_m_blocks, n_tiles, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_D=bd, CAUSAL=bool(causal), DOT_PRECISION=dot_precision(out_dtype),
        TMA=use_tma,
        WARP_SPECIALIZE=config.warp_specialize and config.ws_loop == "keys",
        WS_TILES=config.warp_specialize and config.ws_loop == "tiles", OVERLAP=config.overlap, FP8=fp8,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, ROUND_P_FIRST=fp8 and interpreting(),
        V_SCALE_PER_HEAD=fp8 and config.v_scale == "head", DYNAMIC=dynamic,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def flash_attention_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           scale: float | None = None, config: HopperConfig | None = None,
                           return_lse: bool = False, out: torch.Tensor | None = None):
    """``softmax(scale · q kᵀ + mask) v`` with the Hopper kernel (forward only).

    - ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads, kv_len, head_dim]``,
      one dtype among fp16/bf16/fp32 (fp32: exact products, for tests), ``head_dim <= 128``,
      ``q_heads % kv_heads == 0``; any lengths; any strides (a tensor whose head_dim is not
      contiguous is copied first; one whose rows are not 16-byte aligned takes pointer loads);
    - ``causal``: bottom-right aligned; ``scale`` defaults to ``1/sqrt(head_dim)``;
    - ``config``: a `HopperConfig` (default: `default_config`).

    Returns ``out: [batch, q_heads, q_len, head_dim]`` in q's dtype (written into ``out`` if
    given: q's shape and dtype, unit stride along head_dim) and with ``return_lse`` also
    ``lse: [batch, q_heads, q_len]`` fp32, natural log (``-inf`` for a row that sees no key,
    whose output is 0).
    """
    _check(q, k, v)
    scale, _ = scale_and_window(q.shape[-1], scale, None)
    config = config or default_config(q.shape[-1])
    # The kernel adds head-dim offsets without a stride: give it unit-stride rows.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype} with unit stride along head_dim")
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    _launch(q, k, v, out, lse, None, causal, scale, config, False, q.dtype)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------
# FP8: block quantization and incoherent processing (host side, in torch)
# ----------------------------------------------------------------------------------------
def random_rotation(head_dim: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """A random orthogonal ``[head_dim, head_dim]`` fp32 matrix for incoherent processing: a
    Hadamard matrix times random signs, divided by ``sqrt(head_dim)`` (FA3's choice: applying
    it costs ``O(d log d)`` with a fast transform), when ``head_dim`` is a power of two; else
    the Q factor of a random Gaussian matrix."""
    gen = torch.Generator().manual_seed(seed)
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:  # Sylvester's construction: [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
        rot = signs[:, None] * h / math.sqrt(head_dim)
    else:
        rot, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
        rot = rot.float()
    return rot.to(device)


def quantize_blocks(x: torch.Tensor, block_rows: int, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization to e4m3: ``x: [batch, heads, seq, head_dim]`` in blocks of
    ``block_rows`` tokens, each scaled so that its largest magnitude maps to `E4M3_MAX`.

    Returns ``(x8, scales)``: ``x8: [batch, heads, seq_padded, head_dim]`` float8_e4m3fn with
    ``seq_padded`` the next multiple of ``block_rows`` (the padding rows are 0), or with
    ``transpose`` its transpose ``[batch, heads, head_dim, seq_padded]`` (contiguous); and
    ``scales: [batch, heads, n_blocks]`` fp32 with ``x ≈ x8 · scale`` per block (an all-zero
    block gets scale 1)."""
    batch, heads, seq, dim = x.shape
    n_blocks = triton.cdiv(seq, block_rows)
    padded = torch.zeros(batch, heads, n_blocks * block_rows, dim, device=x.device, dtype=torch.float32)
    padded[:, :, :seq] = x
    blocks = padded.view(batch, heads, n_blocks, block_rows, dim)
    amax = blocks.abs().amax(dim=(-2, -1))
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x8 = (blocks / scales[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    x8 = x8.view(batch, heads, n_blocks * block_rows, dim)
    if transpose:
        x8 = x8.transpose(-1, -2).contiguous()
    return x8, scales.contiguous()


def flash_attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        scale: float | None = None, rotate: bool = False, rotation_seed: int = 0,
                        config: HopperConfig | None = None, prepared: tuple | None = None,
                        return_lse: bool = False):
    """Attention with FP8 (e4m3) matmuls: Q and K block-quantized (`quantize_blocks`, one
    scale per ``block_m`` query rows / ``block_n`` keys), V with one scale per ``block_n`` keys
    or per head (``config.v_scale``; per head by default), fp32 accumulation, output
    ``[batch, q_heads, q_len, head_dim]`` in q's dtype (and with ``return_lse`` the lse).

    ``rotate``: incoherent processing, Q and K multiplied by `random_rotation` before
    quantizing (the scores are unchanged in exact arithmetic). Inputs as in
    `flash_attention_hopper` (fp16/bf16/fp32). ``prepared``: the result of `prepare_fp8` for
    these inputs, to time the attention kernel alone (in a model, the quantization is fused
    into the step that produces Q, K and V)."""
    _check(q, k, v)
    scale, _ = scale_and_window(q.shape[-1], scale, None)
    config = config or default_config(q.shape[-1], fp8=True)
    if prepared is None:
        prepared = prepare_fp8(q, k, v, config, rotate, rotation_seed)
    q8, k8, v8t, scales = prepared
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    # The kernel reads only the real rows (q_len, kv_len); the padding is for the TMA tiles.
    q_len, kv_len = q.shape[2], k.shape[2]
    _launch(q8[:, :, :q_len], k8[:, :, :kv_len], v8t, out, lse, scales, causal, scale, config, True, q.dtype)
    return (out, lse) if return_lse else out


def prepare_fp8(q, k, v, config: HopperConfig, rotate: bool = False, rotation_seed: int = 0) -> tuple:
    """``(q8, k8, v8ᵀ, (q_scale, k_scale, v_scale))`` for `flash_attention_fp8`: Q in blocks of
    ``config.block_m`` rows, K in blocks of ``config.block_n``, V (transposed) in blocks of
    ``config.block_n`` or as one block per head (``config.v_scale``), after the optional
    rotation of Q and K (`random_rotation` with ``rotation_seed``, applied in fp32)."""
    if rotate:
        rot = random_rotation(q.shape[-1], rotation_seed, q.device)
        q, k = q.float() @ rot, k.float() @ rot
    q8, q_scale = quantize_blocks(q, config.block_m)
    k8, k_scale = quantize_blocks(k, config.block_n)
    # V: blocks of block_n keys, or one block for the whole head (padded to whole key blocks).
    v_rows = config.block_n if config.v_scale == "block" else triton.cdiv(v.shape[2], config.block_n) * config.block_n
    v8t, v_scale = quantize_blocks(v, max(v_rows, config.block_n), transpose=True)
    return q8, k8, v8t, (q_scale, k_scale, v_scale)


# ========================================================================================
# The backward on Hopper
#
# The same gradients as FA2's backward (`minillm.kernels.ch04_flash_attention`, where they
# are derived): with P rebuilt from the saved logsumexp L and ``D = rowsum(dO ∘ O)``,
#
#     dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − D),   dK = scale · dSᵀ Q,   dQ = scale · dS K.
#
# One program per K/V block (``block_n`` keys of one KV head) keeps K, V and the dK, dV
# accumulators on chip and streams the Q/dO blocks that see them (all the query heads of a
# GQA group). What changes on Hopper, each a switch of `HopperBwdConfig`:
#
# 1. **TMA** (``tma``): Q, dO (and K, V once) arrive through host-made 4-d descriptors, as in
#    the forward; rows past a head's end read as zeros. Off: masked pointer loads.
# 2. **Where dQ is summed** (``dq``). ``"atomic"`` (FA2's CUDA code, FA3): the dK/dV program
#    already holds dS, so it also computes ``dS K`` for the Q block (five matmuls per tile
#    pair) and adds it into an fp32 ``[batch, q_heads, q_len, head_dim]`` buffer, which a
#    last pass scales and converts. ``"separate"`` (our FA2): a second kernel, one program
#    per Q block, recomputes S and dP (seven matmuls per pair) and keeps dQ in registers:
#    deterministic, no fp32 buffer, but 40 % more tensor-core work.
# 3. **TMA reduction** (``tma_reduce``, with ``"atomic"``): the dQ tile goes to global memory
#    as *one* bulk ``cp.reduce.async.bulk.tensor`` (the TMA adds it in L2) rather than one
#    ``atomicAdd`` per element issued by the threads. (Triton's interpreter has no TMA
#    reduction: there the element-wise atomics run.)
# 4. **The preprocess** (``fuse_preprocess``): the kernel that computes D also zeroes the
#    rows of the fp32 dQ buffer it visits: one pass over those rows instead of a separate
#    memset.
# 5. **Causal load balance** (``longest_first``): causal K/V blocks near the start see the
#    most queries. The programs are numbered so that, within a head, the longest start
#    first and the short ones fill the gaps at the end (off: the shortest first).
# 6. **Warp specialization** (``warp_specialize``): the loop over unmasked Q blocks marked
#    ``warp_specialize=True`` (producer warps issue the loads).
# 7. **Which way the tiles face** (``qk_tiles``). FA2's kernel computes ``Sᵀ = K Qᵀ`` (keys x
#    queries), so that Pᵀ and dSᵀ come out as the *first* operands of ``dV += Pᵀ dO`` and
#    ``dK += dSᵀ Q``; K and V are then first operands too, which Hopper's ``wgmma`` may take
#    from registers (64 registers per thread at head dim 128 with 8 warps, on top of the
#    dK and dV accumulators' 128). With ``S = Q Kᵀ`` (queries x keys) K and V are only ever
#    *second* operands, which ``wgmma`` reads from shared memory, and P, dS are transposed
#    through shared memory instead (as FA3 does). Measured on an H100, the transposes cost
#    Triton more registers than they free (190-250 spilled values per thread instead of
#    54-64) and half the speed at head dim 128: the switch stays off.
#
# Correctness is checked against `minillm.reference.ch04_flash_attention.fa2_backward`
# (float64 NumPy) in `tests/test_ch04_flash_attention_hopper_kernels.py`.
# ========================================================================================
@triton.jit
def q_segments(start_n, q_len, kv_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The Q blocks that see keys ``[start_n, start_n + BLOCK_N)``, split like `kv_segments`:
    ``lo <= full_lo <= full_hi <= hi`` with blocks in ``[lo, full_lo)`` and ``[full_hi, hi)``
    masked (the diagonal, and the ragged last block) and ``[full_lo, full_hi)`` not.

    Causal (bottom-right aligned: row ``i`` sits at position ``i + kv_len − q_len``): rows from
    ``start_n − off`` on see some key of the block, rows from ``start_n + BLOCK_N − 1 − off``
    on see all of them. Clamped to >= 0 before dividing (compiled ``//`` truncates, the
    interpreter's floors)."""
    off = kv_len - q_len
    if CAUSAL:
        first = start_n - off
        all_first = start_n + BLOCK_N - 1 - off
    else:
        first = 0
        all_first = 0
    lo = tl.maximum(first, 0) // BLOCK_M * BLOCK_M
    hi = tl.maximum(q_len, lo)
    full_lo = tl.minimum((tl.maximum(all_first, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, hi)
    full_hi = tl.minimum(tl.maximum(q_len // BLOCK_M * BLOCK_M, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _row_stats(LSE_head, Delta_head, offs_m, q_len, stride_lm, stride_dm, MASKED: tl.constexpr):
    """``(L · log2 e, D)`` of rows ``offs_m`` (rows past ``q_len``: 0, 0)."""
    rows = offs_m.to(tl.int64)
    if MASKED:
        in_m = offs_m < q_len
        lse = tl.load(LSE_head + rows * stride_lm, mask=in_m, other=0.0)
        delta = tl.load(Delta_head + rows * stride_dm, mask=in_m, other=0.0)
    else:
        lse = tl.load(LSE_head + rows * stride_lm)
        delta = tl.load(Delta_head + rows * stride_dm)
    return lse * LOG2E_C, delta


@triton.jit
def _add_dq(dq, desc_dq, DQ_head, offs_m, offs_d, d_ok, q_len, stride_dqm, b, h, start_m,
            BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TMA_REDUCE: tl.constexpr):
    """Add one ``[BLOCK_M, BLOCK_D]`` fp32 dQ tile into the accumulation buffer: one TMA bulk
    reduction (rows past the head's end dropped by the descriptor), or element-wise atomics."""
    if TMA_REDUCE:
        desc_dq.atomic_add([b, h, start_m, 0], dq.reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        rows = offs_m.to(tl.int64)[:, None]
        tl.atomic_add(DQ_head + rows * stride_dqm + offs_d[None, :], dq, mask=(offs_m < q_len)[:, None] & d_ok,
                      sem="relaxed")


@triton.jit
def _dkdv_step(dk, dv, k, v, desc_q, desc_do, desc_dq, Q_head, DO_head, DQ_head, LSE_head, Delta_head,
               stride_qm, stride_dom, stride_dqm, stride_lm, stride_dm,
               offs_n, offs_m, offs_d, d_ok, b, h, start_m, q_len, kv_len, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
               DQ_ATOMIC: tl.constexpr, TMA_REDUCE: tl.constexpr, QK_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """One (Q block, K/V block) pair: ``dV += Pᵀ dO``, ``dK += dSᵀ Q`` (unscaled) and, with
    ``DQ_ATOMIC``, ``dQ += dS K`` added into the fp32 buffer. ``QK_TILES``: S, P, dP, dS are
    ``[BLOCK_M, BLOCK_N]`` (queries x keys) and Pᵀ, dSᵀ are transposed for their matmuls;
    else they are computed transposed (keys x queries), as in FA2's kernel."""
    q = _load_rows(desc_q, Q_head, offs_m, offs_d, d_ok, q_len, stride_qm, b, h, start_m, BLOCK_M, BLOCK_D, TMA)
    do = _load_rows(desc_do, DO_head, offs_m, offs_d, d_ok, q_len, stride_dom, b, h, start_m, BLOCK_M, BLOCK_D,
                    TMA)
    lse2, delta = _row_stats(LSE_head, Delta_head, offs_m, q_len, stride_lm, stride_dm, MASKED)
    if QK_TILES:  # queries x keys: K and V only ever the second operand (shared memory)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:  # a row that sees no key has L = -inf and 2^(+inf) = inf here: the mask replaces it
            p = tl.where(visible_mask(offs_m[:, None], offs_n[None, :], q_len, kv_len, 0, CAUSAL, False), p, 0.0)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dk = tl.dot(tl.trans(ds), q, dk, input_precision=DOT_PRECISION)
    else:  # keys x queries: Pᵀ and dSᵀ come out as the first operands of dV's and dK's matmuls
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        pT = tl.math.exp2(sT * qk_scale - lse2[None, :])
        if MASKED:
            pT = tl.where(visible_mask(offs_m[None, :], offs_n[:, None], q_len, kv_len, 0, CAUSAL, False), pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)
        ds = tl.trans(dsT)
    if DQ_ATOMIC:
        dq = tl.dot(ds, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D], unscaled
        _add_dq(dq, desc_dq, DQ_head, offs_m, offs_d, d_ok, q_len, stride_dqm, b, h, start_m, BLOCK_M, BLOCK_D,
                TMA_REDUCE)
    return dk, dv


@triton.jit
def _dkdv_steps(dk, dv, k, v, desc_q, desc_do, desc_dq, Q, DO, DQ, LSE, Delta,
                stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh, stride_lm, stride_db, stride_dh, stride_dm,
                offs_n, offs_m0, offs_d, d_ok, b, first_head, group, lo, hi, q_len, kv_len, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                DQ_ATOMIC: tl.constexpr, TMA_REDUCE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                QK_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Q blocks ``[lo, hi)`` of each of the ``group`` query heads that read this KV head, in
    one flat loop over (head, Q block) pairs (nested loops keep more values alive and spill)."""
    n_blocks = tl.cdiv(hi - lo, BLOCK_M)
    per_head = tl.maximum(n_blocks, 1)  # a pipelined loop computes addresses before its trip test
    b64 = b.to(tl.int64)
    for it in tl.range(0, group * n_blocks, warp_specialize=WARP_SPECIALIZE):
        h = first_head + it // per_head
        start_m = lo + (it % per_head) * BLOCK_M
        h64 = h.to(tl.int64)
        dk, dv = _dkdv_step(
            dk, dv, k, v, desc_q, desc_do, desc_dq,
            Q + b64 * stride_qb + h64 * stride_qh, DO + b64 * stride_dob + h64 * stride_doh,
            DQ + b64 * stride_dqb + h64 * stride_dqh, LSE + b64 * stride_lb + h64 * stride_lh,
            Delta + b64 * stride_db + h64 * stride_dh, stride_qm, stride_dom, stride_dqm, stride_lm, stride_dm,
            offs_n, start_m + offs_m0, offs_d, d_ok, b, h, start_m, q_len, kv_len, qk_scale,
            MASKED, CAUSAL, DOT_PRECISION, TMA, DQ_ATOMIC, TMA_REDUCE, QK_TILES, BLOCK_M, BLOCK_D)
    return dk, dv


@triton.jit
def _hopper_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQ, desc_q, desc_k, desc_v, desc_do, desc_dq,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    kv_heads, group, q_len, kv_len, n_n_blocks, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr, TMA_REDUCE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, QK_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program ``t`` (of ``n_n_blocks · batch · kv_heads``): dK, dV of one K/V block, summed
    over the group's query heads (and, with ``DQ_ATOMIC``, its share of dQ added into ``DQ``,
    an fp32 buffer). Heads outermost, as in the forward; within a head, causal blocks go
    from the longest (the first keys, seen by every later query) unless ``LONGEST_FIRST`` is
    off."""
    tile = tl.program_id(0)
    bh = tile // n_n_blocks
    n_block = tile % n_n_blocks
    if CAUSAL and not LONGEST_FIRST:
        n_block = n_n_blocks - 1 - n_block
    b = bh // kv_heads
    kv_h = bh % kv_heads
    start_n = n_block * BLOCK_N
    b64, kv_h64 = b.to(tl.int64), kv_h.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    k = _load_rows(desc_k, K + b64 * stride_kb + kv_h64 * stride_kh, offs_n, offs_d, d_ok, kv_len, stride_kn,
                   b, kv_h, start_n, BLOCK_N, BLOCK_D, TMA)
    v = _load_rows(desc_v, V + b64 * stride_vb + kv_h64 * stride_vh, offs_n, offs_d, d_ok, kv_len, stride_vn,
                   b, kv_h, start_n, BLOCK_N, BLOCK_D, TMA)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    lo, full_lo, full_hi, hi = q_segments(start_n, q_len, kv_len, BLOCK_M, BLOCK_N, CAUSAL)
    first_head = kv_h * group
    dk, dv = _dkdv_steps(dk, dv, k, v, desc_q, desc_do, desc_dq, Q, DO, DQ, LSE, Delta,
                         stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                         stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh, stride_lm,
                         stride_db, stride_dh, stride_dm, offs_n, offs_m0, offs_d, d_ok, b, first_head, group,
                         lo, full_lo, q_len, kv_len, qk_scale, True, CAUSAL, DOT_PRECISION, TMA, DQ_ATOMIC,
                         TMA_REDUCE, False, QK_TILES, BLOCK_M, BLOCK_D)
    dk, dv = _dkdv_steps(dk, dv, k, v, desc_q, desc_do, desc_dq, Q, DO, DQ, LSE, Delta,
                         stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                         stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh, stride_lm,
                         stride_db, stride_dh, stride_dm, offs_n, offs_m0, offs_d, d_ok, b, first_head, group,
                         full_lo, full_hi, q_len, kv_len, qk_scale, False, CAUSAL, DOT_PRECISION, TMA, DQ_ATOMIC,
                         TMA_REDUCE, WARP_SPECIALIZE, QK_TILES, BLOCK_M, BLOCK_D)
    dk, dv = _dkdv_steps(dk, dv, k, v, desc_q, desc_do, desc_dq, Q, DO, DQ, LSE, Delta,
                         stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                         stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh, stride_lm,
                         stride_db, stride_dh, stride_dm, offs_n, offs_m0, offs_d, d_ok, b, first_head, group,
                         full_hi, hi, q_len, kv_len, qk_scale, True, CAUSAL, DOT_PRECISION, TMA, DQ_ATOMIC,
                         TMA_REDUCE, False, QK_TILES, BLOCK_M, BLOCK_D)

    # Keys that no query sees get dK = dV = 0, still stored; rows past kv_len are dropped.
    rows = offs_n.to(tl.int64)[:, None]
    kv_ok = (offs_n < kv_len)[:, None] & d_ok
    tl.store(DK + b64 * stride_dkb + kv_h64 * stride_dkh + rows * stride_dkn + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + b64 * stride_dvb + kv_h64 * stride_dvh + rows * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_steps(dq, q, do, lse2, delta, desc_k, desc_v, K_head, V_head, stride_kn, stride_vn,
              offs_m, offs_n0, offs_d, d_ok, b, kv_h, lo, hi, q_len, kv_len, qk_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Key blocks ``[lo, hi)`` past one Q block: ``dQ += dS K`` (S and dP recomputed)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_rows(desc_k, K_head, offs_n, offs_d, d_ok, kv_len, stride_kn, b, kv_h, start_n, BLOCK_N, BLOCK_D,
                       TMA)
        v = _load_rows(desc_v, V_head, offs_n, offs_d, d_ok, kv_len, stride_vn, b, kv_h, start_n, BLOCK_N, BLOCK_D,
                       TMA)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(visible_mask(offs_m[:, None], offs_n[None, :], q_len, kv_len, 0, CAUSAL, False), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _hopper_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ, desc_q, desc_k, desc_v, desc_do,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dm,
    stride_dqb, stride_dqh, stride_dqm,
    q_heads, group, q_len, kv_len, n_m_blocks, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The separate dQ pass: program ``t`` (of ``n_m_blocks · batch · q_heads``) computes dQ of
    one Q block, visiting the key blocks the forward visited (causal: the longest first)."""
    tile = tl.program_id(0)
    bh = tile // n_m_blocks
    m_block = tile % n_m_blocks
    if CAUSAL:
        m_block = n_m_blocks - 1 - m_block
    b = bh // q_heads
    h = bh % q_heads
    kv_h = h // group
    start_m = m_block * BLOCK_M
    b64, h64, kv_h64 = b.to(tl.int64), h.to(tl.int64), kv_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    q = _load_rows(desc_q, Q + b64 * stride_qb + h64 * stride_qh, offs_m, offs_d, d_ok, q_len, stride_qm,
                   b, h, start_m, BLOCK_M, BLOCK_D, TMA)
    do = _load_rows(desc_do, DO + b64 * stride_dob + h64 * stride_doh, offs_m, offs_d, d_ok, q_len, stride_dom,
                    b, h, start_m, BLOCK_M, BLOCK_D, TMA)
    lse2, delta = _row_stats(LSE + b64 * stride_lb + h64 * stride_lh, Delta + b64 * stride_db + h64 * stride_dh,
                             offs_m, q_len, stride_lm, stride_dm, True)
    K_head = K + b64 * stride_kb + kv_h64 * stride_kh
    V_head = V + b64 * stride_vb + kv_h64 * stride_vh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, full_lo, full_hi, hi = kv_segments(start_m, q_len, kv_len, 0, BLOCK_M, BLOCK_N, CAUSAL, False)
    dq = _dq_steps(dq, q, do, lse2, delta, desc_k, desc_v, K_head, V_head, stride_kn, stride_vn, offs_m, offs_n0,
                   offs_d, d_ok, b, kv_h, lo, full_lo, q_len, kv_len, qk_scale, True, CAUSAL, DOT_PRECISION, TMA,
                   BLOCK_N, BLOCK_D)
    dq = _dq_steps(dq, q, do, lse2, delta, desc_k, desc_v, K_head, V_head, stride_kn, stride_vn, offs_m, offs_n0,
                   offs_d, d_ok, b, kv_h, full_lo, full_hi, q_len, kv_len, qk_scale, False, CAUSAL, DOT_PRECISION,
                   TMA, BLOCK_N, BLOCK_D)
    dq = _dq_steps(dq, q, do, lse2, delta, desc_k, desc_v, K_head, V_head, stride_kn, stride_vn, offs_m, offs_n0,
                   offs_d, d_ok, b, kv_h, full_hi, hi, q_len, kv_len, qk_scale, True, CAUSAL, DOT_PRECISION, TMA,
                   BLOCK_N, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + rows * stride_dqm + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(offs_m < q_len)[:, None] & d_ok)


@triton.jit
def _hopper_bwd_preprocess_kernel(
    O, DO, Delta, DQAcc,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_db, stride_dh, stride_dm,
    stride_ab, stride_ah, stride_am,
    q_heads, q_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ZERO_DQ: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Program ``(i, b·q_heads + h)``: ``D = rowsum(dO ∘ O)`` of rows ``[i·BLOCK_M, (i+1)·BLOCK_M)``
    (fp32) and, with ``ZERO_DQ``, zeros in the same rows of the fp32 dQ buffer ``DQAcc``."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b64 = (bh // q_heads).to(tl.int64)
    h64 = (bh % q_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    mask = (offs_m < q_len)[:, None] & d_ok
    o = tl.load(O + b64 * stride_ob + h64 * stride_oh + rows * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + rows * stride_dom + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b64 * stride_db + h64 * stride_dh + offs_m.to(tl.int64) * stride_dm, delta, mask=offs_m < q_len)
    if ZERO_DQ:
        tl.store(DQAcc + b64 * stride_ab + h64 * stride_ah + rows * stride_am + offs_d[None, :],
                 tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32), mask=mask)


@triton.jit
def _scale_convert_kernel(X, Y, n, scale, BLOCK: tl.constexpr):
    """``Y = (scale · X)`` in Y's dtype, elementwise over ``n`` contiguous elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Y + offs, (tl.load(X + offs, mask=ok) * scale).to(Y.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class HopperBwdConfig:
    """How `flash_attention_hopper_backward` runs (switches explained at the head of the
    backward section). ``block_m`` Q rows streamed past ``block_n`` keys per dK/dV program,
    ``num_warps``/``num_stages`` of that kernel; ``dq``: ``"atomic"`` or ``"separate"``;
    ``dq_block_m`` x ``dq_block_n``, ``dq_num_warps``, ``dq_num_stages``: the separate dQ
    kernel's tile and launch options."""
    block_m: int = 64
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True
    dq: str = "atomic"
    tma_reduce: bool = True
    fuse_preprocess: bool = True
    longest_first: bool = True
    warp_specialize: bool = False
    qk_tiles: bool = False
    dq_block_m: int = 128
    dq_block_n: int = 64
    dq_num_warps: int = 8
    dq_num_stages: int = 3

    def describe(self) -> str:
        on = [name for name in ("tma", "tma_reduce", "fuse_preprocess", "longest_first", "warp_specialize", "qk_tiles")
              if getattr(self, name) and (self.dq == "atomic" or name not in ("tma_reduce", "fuse_preprocess"))]
        dq = ("dQ atomic" if self.dq == "atomic" else
              f"dQ separate {self.dq_block_m}x{self.dq_block_n}/{self.dq_num_warps}w/{self.dq_num_stages}s")
        return (f"dK/dV tile {self.block_m}x{self.block_n}, {self.num_warps} warps, {self.num_stages} stages, {dq}"
                + (f", {'+'.join(on)}" if on else ""))


#: Per (padded head dim, causal), chosen on an H100 (bf16, N = 4k and 16k, 16k tokens;
#: ``python -m bench.ch04_hopper --bwd-sweep``). dK/dV tiles 64 x 128 (FA3's at head dim
#: 128), 8 warps, 3 stages (2: 1-6 % slower). Head dim
#: 128 spills registers in every candidate (64 x 128 with atomic dQ: 54 values per thread;
#: 32 x 128 spills less but streams twice the Q blocks: 2-9 % slower); there the separate dQ
#: pass wins (3-17 %: the dK/dV kernel without the dQ tile spills 6-32 values, not 54-64).
#: Head dim 64: 128 x 128 tiles without a mask (6-13 % over 64 x 128), and with a causal mask
#: atomic dQ by element-wise atomics (there the TMA reduction is 8-9 % slower; it is 3-14 %
#: faster everywhere else).
BWD_DEFAULT_CONFIGS = {
    (64, False): HopperBwdConfig(128, 128, 8, 3, dq="separate"),
    (64, True): HopperBwdConfig(64, 128, 8, 3, tma_reduce=False),
    (128, False): HopperBwdConfig(64, 128, 8, 3, dq="separate"),
    (128, True): HopperBwdConfig(64, 128, 8, 3, dq="separate"),
}
#: Under the interpreter: small unequal tiles, dQ by atomics, TMA, the fused preprocess and
#: warp specialization on (the TMA reduction falls back to element-wise atomics there); the
#: tests flip every switch from here.
BWD_INTERPRET_CONFIG = HopperBwdConfig(16, 32, 4, 1, dq_block_m=32, dq_block_n=16, dq_num_warps=4, dq_num_stages=1,
                                       warp_specialize=True)
#: The switches the backward's ablation flips (name -> what its two settings are).
BWD_ABLATIONS = {
    "tma": "host TMA descriptors / pointer loads with masks",
    "dq": "dQ added with atomics by the dK/dV kernel / a separate dQ kernel (recomputes S and dP)",
    "tma_reduce": "dQ tile added by one TMA bulk reduction / per-element atomics",
    "fuse_preprocess": "the preprocess zeroes the fp32 dQ buffer / a separate memset",
    "longest_first": "causal K/V blocks longest first / shortest first",
    "warp_specialize": "producer and consumer warps on the unmasked Q loop / software pipelining only",
    "qk_tiles": "tiles queries x keys, K and V second operands only / keys x queries, K and V first operands",
}


def bwd_default_config(head_dim: int, causal: bool) -> HopperBwdConfig:
    """The configuration `flash_attention_hopper_backward` uses by default."""
    if interpreting():
        return BWD_INTERPRET_CONFIG
    return BWD_DEFAULT_CONFIGS[(64 if block_d(head_dim) <= 64 else 128, bool(causal))]


def bwd_ablated(config: HopperBwdConfig, switch: str) -> HopperBwdConfig:
    """``config`` with ``switch`` (a key of `BWD_ABLATIONS`) flipped."""
    if switch == "dq":
        return replace(config, dq="separate" if config.dq == "atomic" else "atomic")
    return replace(config, **{switch: not getattr(config, switch)})


def hopper_backward_applies(device) -> bool:
    """Whether `attention_backward` takes the Hopper kernels: on an sm_90 GPU (H100/H200),
    and in the interpreter (so that the CPU tests run them); FA2's kernels elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device) == (9, 0)


def _bwd_descriptors(q, k, v, dout, dq_acc, config: HopperBwdConfig, bd: int, tma: bool):
    """``(desc_q, desc_k, desc_v, desc_do, desc_dq)``: 4-d descriptors when ``tma``, else the
    tensors themselves (unused by the kernel). dQ's is made only for the TMA reduction."""
    if not tma:
        return q, k, v, dout, dq_acc
    desc_dq = dq_acc
    if config.dq == "atomic" and config.tma_reduce and not interpreting():
        desc_dq = _descriptor(dq_acc, config.block_m, bd)
    return (_descriptor(q, config.block_m, bd), _descriptor(k, config.block_n, bd), _descriptor(v, config.block_n, bd),
            _descriptor(dout, config.block_m, bd), desc_dq)


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def launch_bwd_preprocess(out, dout, delta, dq_acc, zero_dq: bool, head_dim: int) -> None:
    """The backward's preprocess: ``delta[b, h, i] = rowsum(dout ∘ out)`` (fp32 ``[batch,
    q_heads, q_len]``) and, with ``zero_dq``, zeros in the fp32 dQ buffer ``dq_acc`` (shaped
    like ``out``) that the dK/dV kernel adds dQ into with atomics."""
    batch, q_heads, q_len = out.shape[:3]
    block = 64
    acc = dq_acc if dq_acc is not None else delta  # unused without zero_dq
    acc_strides = _strides3(dq_acc) if dq_acc is not None else (0, 0, 0)
    launch(_hopper_bwd_preprocess_kernel, (triton.cdiv(q_len, block), batch * q_heads),
           out, dout, delta, acc, *_strides3(out), *_strides3(dout), *_strides3(delta), *acc_strides, q_heads, q_len,
           HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), ZERO_DQ=zero_dq, BLOCK_M=block, num_warps=4)


def scale_convert(x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
    """``y = scale · x`` in y's dtype, for contiguous tensors of the same size (the fp32 dQ
    buffer into ``dq``)."""
    n = x.numel()
    launch(_scale_convert_kernel, (triton.cdiv(n, 4096),), x, y, n, scale, BLOCK=4096, num_warps=8)


def _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, causal: bool, scale: float, config: HopperBwdConfig) -> None:
    """Preprocess, dK/dV (with dQ by atomics, then its conversion) or dK/dV then dQ."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    bd = block_d(head_dim)
    atomic = config.dq == "atomic"
    delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    dq_acc = None
    if atomic:
        dq_acc = (torch.empty if config.fuse_preprocess else torch.zeros)(q.shape, device=q.device,
                                                                          dtype=torch.float32)
    launch_bwd_preprocess(out, dout, delta, dq_acc, atomic and config.fuse_preprocess, head_dim)
    tma = config.tma and tma_ok(q, k, v, dout) and (dq_acc is None or tma_ok(dq_acc))
    desc_q, desc_k, desc_v, desc_do, desc_dq = _bwd_descriptors(q, k, v, dout, dq_acc, config, bd, tma)
    dq_target = dq_acc if atomic else dq
    n_n_blocks = triton.cdiv(kv_len, config.block_n)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=bd, CAUSAL=bool(causal), DOT_PRECISION=dot_precision(q.dtype), TMA=tma)
    launch(
        _hopper_dkdv_kernel, (n_n_blocks * batch * kv_heads,),
        q, k, v, dout, lse, delta, dk, dv, dq_target, desc_q, desc_k, desc_v, desc_do, desc_dq,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *_strides3(lse), *_strides3(delta),
        *_strides3(dk), *_strides3(dv), *_strides3(dq_target),
        kv_heads, q_heads // kv_heads, q_len, kv_len, n_n_blocks, scale, scale * LOG2E, **meta,
        DQ_ATOMIC=atomic, TMA_REDUCE=atomic and tma and config.tma_reduce and not interpreting(),
        WARP_SPECIALIZE=config.warp_specialize, LONGEST_FIRST=config.longest_first, QK_TILES=config.qk_tiles,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if atomic:
        scale_convert(dq_acc, dq, scale)
        return
    if tma:  # the dQ kernel's tiles differ from the dK/dV kernel's
        desc_q, desc_do = _descriptor(q, config.dq_block_m, bd), _descriptor(dout, config.dq_block_m, bd)
        desc_k, desc_v = _descriptor(k, config.dq_block_n, bd), _descriptor(v, config.dq_block_n, bd)
    n_m_blocks = triton.cdiv(q_len, config.dq_block_m)
    launch(
        _hopper_dq_kernel, (n_m_blocks * batch * q_heads,),
        q, k, v, dout, lse, delta, dq, desc_q, desc_k, desc_v, desc_do,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *_strides3(lse), *_strides3(delta),
        *_strides3(dq), q_heads, q_heads // kv_heads, q_len, kv_len, n_m_blocks, scale, scale * LOG2E, **meta,
        BLOCK_M=config.dq_block_m, BLOCK_N=config.dq_block_n, num_warps=config.dq_num_warps,
        num_stages=config.dq_num_stages,
    )


def flash_attention_hopper_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                                    scale: float | None = None, config: HopperBwdConfig | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of attention with the Hopper backward kernels.

    ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads, kv_len, head_dim]``
    (fp16/bf16, or fp32 for tests), the options as given to the forward; ``out``, ``lse``
    (``[batch, q_heads, q_len]`` fp32, natural log) as `flash_attention_hopper` (or FA2's
    forward) returned them; ``dout`` shaped like ``out``. Under GQA ``dk``/``dv`` sum the
    contributions of each group's query heads. Returns new contiguous tensors in q's dtype.
    Runs wherever Triton does (tests run it in the interpreter); `attention_backward` picks it
    on sm_90 only."""
    _check(q, k, v)
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} must be {tuple(q.shape[:3])}")
    scale, _ = scale_and_window(q.shape[-1], scale, None)
    config = config or bwd_default_config(q.shape[-1], causal)
    # Unit-stride rows for the kernels (and 16-byte aligned ones for TMA): copy when needed.
    q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout.to(q.dtype)))
    lse = lse.float().contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, config)
    return dq, dk, dv


def attention_backward(dout, q, k, v, out, lse, causal: bool = False, scale: float | None = None):
    """The backward for `flash_attention_hopper`'s outputs on any device: the Gluon kernel
    (`flash_attention_gluon_backward`, the fastest on Hopper) where its scope covers the call
    (`gluon_applies`: sm_90, bf16, equal lengths in multiples of 128, head dim 64 or 128), the
    Hopper kernels where `hopper_backward_applies` (sm_90, or the interpreter) up to head dim
    `HOPPER_MAX_HEAD_DIM`, FA2's elsewhere."""
    from minillm.kernels.ch04_flash_attention_gluon import flash_attention_gluon_backward, gluon_applies

    if gluon_applies(q, k, v):
        return flash_attention_gluon_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    if _hopper_covers(q):
        return flash_attention_hopper_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    from minillm.kernels.ch04_flash_attention import flash_attention_backward

    return flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


def _hopper_covers(q: torch.Tensor) -> bool:
    """Whether the Hopper kernels take a call with this ``q``: where they apply
    (`hopper_backward_applies`) and its head dim is at most `HOPPER_MAX_HEAD_DIM`."""
    return hopper_backward_applies(q.device) and q.shape[-1] <= HOPPER_MAX_HEAD_DIM


# ----------------------------------------------------------------------------------------
# One entry point: each call on the fastest kernel that covers it
# ----------------------------------------------------------------------------------------
def forward_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The forward `attention_forward` runs for these inputs, the fastest that covers them:
    ``"gluon"`` where `gluon_applies` (sm_90, bf16, queries and keys of one length, a multiple
    of 128, head dim 64 or 128); ``"hopper"`` (`flash_attention_hopper`) elsewhere on sm_90, or
    in the interpreter, up to head dim `HOPPER_MAX_HEAD_DIM` (on an H100 1-6 % ahead of FA2, on
    an H200 level); ``"fa2"`` (`minillm.kernels.ch04_flash_attention.flash_attention`) for
    everything else. The backward follows the same order (`attention_backward`)."""
    from minillm.kernels.ch04_flash_attention_gluon import gluon_applies

    if gluon_applies(q, k, v):
        return "gluon"
    return "hopper" if _hopper_covers(q) else "fa2"


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``softmax(scale · q kᵀ + mask) v`` from `forward_kernel`'s choice; the
    Gluon kernel with `minillm.kernels.ch04_flash_attention_gluon.fastest_forward`'s settings
    for this head dim, mask and length.

    ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads, kv_len, head_dim]``
    (GQA: ``q_heads % kv_heads == 0``), fp16/bf16 (fp32 off the Gluon kernels); ``causal``:
    bottom-right aligned; ``scale`` defaults to ``1/sqrt(head_dim)``. Returns ``out`` shaped
    and typed like q and ``lse: [batch, q_heads, q_len]`` fp32, natural log. Not
    differentiable: `fastest_attention` is."""
    kernel = forward_kernel(q, k, v)
    if kernel == "gluon":
        from minillm.kernels.ch04_flash_attention_gluon import fastest_forward, flash_attention_gluon

        return flash_attention_gluon(q, k, v, causal=causal, scale=scale,
                                     **fastest_forward(q.shape[-1], causal, q.shape[2]))
    if kernel == "hopper":
        return flash_attention_hopper(q, k, v, causal=causal, scale=scale, return_lse=True)
    from minillm.kernels.ch04_flash_attention import flash_attention

    return flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)


class FastestAttentionFunction(torch.autograd.Function):
    """`attention_forward` and `attention_backward` as one differentiable op: the forward saves
    q, k, v, the output and the logsumexp, the backward recomputes P from them (FA2's
    scheme) on the fastest backward that covers the call. The lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None


def fastest_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      scale: float | None = None, return_lse: bool = False):
    """Attention on the fastest kernels this chapter has for the call, differentiable in q, k
    and v: inputs as `attention_forward`; returns ``out`` (and with ``return_lse`` the
    logsumexp, not differentiable). On an H200 the Gluon kernels run at about cuDNN's speed
    where they apply (``bench/ch04_gluon.py``, its dispatch part); elsewhere as the kernel
    `forward_kernel` names. Its kernels launch through `minillm.kernels.base.launch` (the
    compiled binary reused, Triton's per-call binding skipped): on the H200 that keeps the
    host ahead of the GPU in a training step from 1k keys on."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = FastestAttentionFunction.apply(q, k, v, causal, scale)
    else:
        out, lse = attention_forward(q, k, v, causal, scale)
    return (out, lse) if return_lse else out
