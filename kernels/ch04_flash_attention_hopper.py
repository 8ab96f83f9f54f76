"""Chapter 4, on Hopper: the FlashAttention forward with FlashAttention-3's ideas, in Triton.

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
the chapter. Forward only (no autograd; the training path stays FA2's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from minillm.kernels.base import (  # shared by every chapter's attention kernels
    tl, triton,
    LN2_C, LOG2E, block_d, dot_precision, head_dim_offsets, interpreting, num_sms, online_softmax_update,
    scale_and_window,
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
    if not 1 <= q.shape[-1] <= 128:
        raise ValueError(f"head_dim={q.shape[-1]}: 1..128 supported by the Hopper kernel")


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
    _hopper_fwd_kernel[grid](
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
