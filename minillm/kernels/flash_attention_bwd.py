"""Chapter 4: FlashAttention-2, the backward kernels.

With ``S = scale · Q Kᵀ``, ``P = softmax(S)`` row by row and ``O = P V``, the gradients
of a loss with respect to Q, K, V, given ``dO``, are

    dV = Pᵀ dO
    dP = dO Vᵀ
    dS = P ∘ (dP − D),     D_i = Σ_j P_ij dP_ij = rowsum(dO ∘ O)_i
    dQ = scale · dS K
    dK = scale · dSᵀ Q

(the softmax's Jacobian folds into the row vector ``D``). The standard algorithm would keep P
from the forward: N² numbers. FlashAttention keeps only the logsumexp ``L`` of every row
(forward, FA2 (3)) and **recomputes** each tile of P on chip as ``P = exp(S − L)``: one more
matmul (``Q Kᵀ`` again) in exchange for never storing or reading an N² matrix. ``D`` is a
cheap preprocess (`_bwd_preprocess_kernel`), one number per row.

How the work is split (the FA2 layout):

- `_bwd_dkdv_kernel`: **one program per K/V block** (of one KV head), looping over the Q
  blocks that can see it. dK and dV of the block are sums over query rows, so they
  accumulate in registers and are written once. Under GQA several query heads read the same
  KV head, and its dK/dV are the sum over that group: the program simply loops over the
  group's query heads too, so the reduction happens in registers, with no ``[q_heads, …]``
  temporary and no second pass.
- `_bwd_dq_kernel`: **one program per Q block**, looping over the K/V blocks it sees, exactly
  like the forward. dQ of the block is a sum over keys, accumulated in registers.

Why a separate dQ kernel rather than atomics: the dK/dV programs already hold every tile of
dS, and FA2's CUDA code adds their ``dS K`` terms into an fp32 dQ buffer with ``atomicAdd``
(5 matmuls per tile pair). Here the dQ programs recompute S and dP instead (7 matmuls:
40% more tensor-core work in the backward). In exchange dQ is deterministic (atomics add
in whatever order the programs happen to finish, so the low bits change from run to run),
needs no fp32 ``[batch, heads, seq, dim]`` buffer and no pass to convert it, and no two
programs ever write the same row. The Triton tutorial's fused attention makes the same trade.

Layouts, masking, GQA and varlen work exactly as in the forward (`flash_attention`), whose
helpers these kernels share.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernels.flash_attention import (
    LOG2E, Packing, _check_cu_seqlens, _check_inputs, _ensure_allocator, _head_dim_offsets, _kv_segments,
    _scale_and_window, _segments, _sequence, _visible, block_d, config_key, dot_precision, fixed_config,
    head_dim_class, seq_bucket, tile_configs, use_tma,
)

_LOG2E = tl.constexpr(LOG2E)


# ----------------------------------------------------------------------------------------
# Preprocess: D = rowsum(dO ∘ O)
# ----------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess_kernel(
    O, DO, Delta, CuSeqQ,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_db, stride_dh, stride_dm,
    q_heads, Q_LEN,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Program ``(i, b·q_heads + h)``: ``D`` of rows ``[i·BLOCK_M, (i+1)·BLOCK_M)``, fp32."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b = pid_bh // q_heads
    h = pid_bh % q_heads
    q_start, q_len, _, _ = _sequence(b, CuSeqQ, CuSeqQ, Q_LEN, Q_LEN, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d, d_ok = _head_dim_offsets(HEAD_DIM, BLOCK_D)
    rows = (q_start + offs_m).to(tl.int64)
    mask = (offs_m < q_len)[:, None] & d_ok
    o = tl.load(O + b64 * stride_ob + h64 * stride_oh + rows[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b64 * stride_db + h64 * stride_dh + rows * stride_dm, delta, mask=offs_m < q_len)


# ----------------------------------------------------------------------------------------
# dK, dV: one program per K/V block
# ----------------------------------------------------------------------------------------
@triton.jit
def _q_segments(start_n, q_len, kv_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr):
    """The mirror image of `_kv_segments`: the Q blocks that can see keys
    ``[start_n, start_n + BLOCK_N)``. Causal: query at position ``p`` sees key ``j`` iff
    ``j <= p``, so rows from position ``n0`` on see some key of the block and rows from
    ``n1`` on see all of them; rows before ``n0`` are skipped. Row index = position − (kv_len − q_len)."""
    off = kv_len - q_len
    n0 = start_n
    n1 = start_n + BLOCK_N - 1
    if CAUSAL:
        first = n0 - off
        all_first = n1 - off
    elif USE_WINDOW:
        first = n0 - window + 1 - off
        all_first = n1 - window + 1 - off
    else:
        first = 0
        all_first = 0
    if USE_WINDOW:
        end = tl.minimum(n1 + window - off, q_len)
        all_end = tl.minimum(n0 + window - off, q_len)
    else:
        end = q_len
        all_end = q_len
    return _segments(first, end, all_first, all_end, BLOCK_M)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q_seq, DO_seq, LSE_seq, Delta_seq, q_offs, do_offs,
                stride_qh, stride_doh, stride_lh, stride_dh, stride_qm, stride_dom, stride_lm, stride_dm,
                first_head, group, offs_n, offs_m0, d_ok, lo, hi, q_len, kv_len, qk_scale, window,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """Stream Q blocks ``[lo, hi)`` of each of the ``group`` query heads that read this KV
    head past this program's K/V block, accumulating dK and dV over all of them.

    One flat loop over (head, Q block) pairs rather than a loop over heads around a loop over
    blocks: the result is the same, but with the nested loops the compiler keeps more values
    alive across the outer loop and spills registers at head_dim 128 (checked by compiling
    for sm_90). Tiles are computed transposed, ``[BLOCK_N, BLOCK_M]`` (keys x queries), so
    that ``Pᵀ`` and ``dSᵀ`` come out ready for ``dV += Pᵀ dO`` and ``dK += dSᵀ Q``."""
    n_blocks = tl.cdiv(hi - lo, BLOCK_M)
    # Divide by at least 1: with an empty segment the loop body never runs, but a software-
    # pipelined loop computes the first iterations' addresses before it knows that.
    per_head = tl.maximum(n_blocks, 1)
    for it in range(0, group * n_blocks):
        head = first_head + it // per_head  # GQA: dK, dV of a KV head sum over its query heads
        start_m = lo + (it % per_head) * BLOCK_M
        Q_head = Q_seq + head * stride_qh
        DO_head = DO_seq + head * stride_doh
        LSE_head = LSE_seq + head * stride_lh
        Delta_head = Delta_seq + head * stride_dh
        offs_m = start_m + offs_m0
        row0 = tl.cast(start_m, tl.int64)
        if MASKED:  # rows past the end read as 0 (L = 0, D = 0); the mask zeroes their P anyway
            in_m = offs_m < q_len
            q = tl.load(Q_head + row0 * stride_qm + q_offs, mask=in_m[:, None] & d_ok, other=0.0)
            lse = tl.load(LSE_head + offs_m * stride_lm, mask=in_m, other=0.0)
        else:
            q = tl.load(Q_head + row0 * stride_qm + q_offs, mask=d_ok, other=0.0)
            lse = tl.load(LSE_head + offs_m * stride_lm)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M], raw scores
        # Recompute P from the saved logsumexp, in base 2: exp(scale·s − L) = 2^(qk_scale·s − L·log2 e).
        pT = tl.math.exp2(sT * qk_scale - (lse * _LOG2E)[None, :])
        if MASKED:
            # A row that sees no key has L = -inf and 2^(+inf) = inf here; the mask replaces it.
            pT = tl.where(_visible(offs_m[None, :], offs_n[:, None], q_len, kv_len, window, CAUSAL, USE_WINDOW),
                          pT, 0.0)
            do = tl.load(DO_head + row0 * stride_dom + do_offs, mask=in_m[:, None] & d_ok, other=0.0)
            delta = tl.load(Delta_head + offs_m * stride_dm, mask=in_m, other=0.0)
        else:
            do = tl.load(DO_head + row0 * stride_dom + do_offs, mask=d_ok, other=0.0)
            delta = tl.load(Delta_head + offs_m * stride_dm)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)     # dV += Pᵀ dO
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)           # dPᵀ = V dOᵀ
        dsT = pT * (dpT - delta[None, :])                                      # dSᵀ = Pᵀ ∘ (dPᵀ − D)
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)     # dK += dSᵀ Q (scaled at the end)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, CuSeqQ, CuSeqK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    kv_heads, group, Q_LEN, KV_LEN, q_bucket, kv_bucket, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program ``(j, b·kv_heads + g)``: dK and dV of keys ``[j·BLOCK_N, (j+1)·BLOCK_N)`` of KV
    head ``g`` of sequence ``b``, summed over the ``group`` query heads that read it."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    b = pid_bh // kv_heads
    kv_h = pid_bh % kv_heads
    q_start, q_len, k_start, kv_len = _sequence(b, CuSeqQ, CuSeqK, Q_LEN, KV_LEN, VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= kv_len:
        return

    b64, kv_h64 = b.to(tl.int64), kv_h.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d, d_ok = _head_dim_offsets(HEAD_DIM, BLOCK_D)
    rows_k = (k_start + offs_n).to(tl.int64)
    kv_mask = (offs_n < kv_len)[:, None] & d_ok
    # K and V of this block stay on chip for the whole program.
    k = tl.load(K + b64 * stride_kb + kv_h64 * stride_kh + rows_k[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + kv_h64 * stride_vh + rows_k[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    q_offs = offs_m0[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_offs = offs_m0[:, None] * stride_dom + offs_d[None, :] * stride_dod
    # The Q blocks to visit are the same for every head of the group (same positions).
    lo, full_lo, full_hi, hi = _q_segments(start_n, q_len, kv_len, window, BLOCK_M, BLOCK_N, CAUSAL, USE_WINDOW)
    q_start64 = tl.cast(q_start, tl.int64)
    Q_seq = Q + b64 * stride_qb + q_start64 * stride_qm
    DO_seq = DO + b64 * stride_dob + q_start64 * stride_dom
    LSE_seq = LSE + b64 * stride_lb + q_start64 * stride_lm
    Delta_seq = Delta + b64 * stride_db + q_start64 * stride_dm
    first_head = kv_h64 * group  # query heads first_head … first_head + group - 1 read this KV head
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q_seq, DO_seq, LSE_seq, Delta_seq, q_offs, do_offs,
                         stride_qh, stride_doh, stride_lh, stride_dh, stride_qm, stride_dom, stride_lm, stride_dm,
                         first_head, group, offs_n, offs_m0, d_ok, lo, full_lo, q_len, kv_len, qk_scale, window,
                         True, CAUSAL, USE_WINDOW, DOT_PRECISION, BLOCK_M)
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q_seq, DO_seq, LSE_seq, Delta_seq, q_offs, do_offs,
                         stride_qh, stride_doh, stride_lh, stride_dh, stride_qm, stride_dom, stride_lm, stride_dm,
                         first_head, group, offs_n, offs_m0, d_ok, full_lo, full_hi, q_len, kv_len, qk_scale, window,
                         False, CAUSAL, USE_WINDOW, DOT_PRECISION, BLOCK_M)
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q_seq, DO_seq, LSE_seq, Delta_seq, q_offs, do_offs,
                         stride_qh, stride_doh, stride_lh, stride_dh, stride_qm, stride_dom, stride_lm, stride_dm,
                         first_head, group, offs_n, offs_m0, d_ok, full_hi, hi, q_len, kv_len, qk_scale, window,
                         True, CAUSAL, USE_WINDOW, DOT_PRECISION, BLOCK_M)

    # Keys that no query sees (outside every window) get dK = dV = 0: still stored.
    tl.store(DK + b64 * stride_dkb + kv_h64 * stride_dkh + rows_k[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b64 * stride_dvb + kv_h64 * stride_dvh + rows_k[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


# ----------------------------------------------------------------------------------------
# dQ: one program per Q block
# ----------------------------------------------------------------------------------------
@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, K_src, V_src, k_offs, v_offs, stride_kn, stride_vn,
              offs_m, offs_n0, d_ok, lo, hi, q_len, kv_len, qk_scale, window,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
              DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stream key blocks ``[lo, hi)`` past one Q block, accumulating ``dQ += dS K``
    (``K_src``/``V_src``: TMA descriptors or base pointers, as in `_fwd_tiles`)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if TMA:
            k = K_src.load([start_n, 0])
            v = V_src.load([start_n, 0])
        else:
            row0 = tl.cast(start_n, tl.int64)
            if MASKED:
                kv_ok = (offs_n < kv_len)[:, None] & d_ok
            else:
                kv_ok = d_ok
            k = tl.load(K_src + row0 * stride_kn + k_offs, mask=kv_ok, other=0.0)
            v = tl.load(V_src + row0 * stride_vn + v_offs, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)    # [BLOCK_M, BLOCK_N]
        p = tl.math.exp2(s * qk_scale - lse2[:, None])               # P recomputed from L
        if MASKED:
            p = tl.where(_visible(offs_m[:, None], offs_n[None, :], q_len, kv_len, window, CAUSAL, USE_WINDOW),
                         p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])                               # dS = P ∘ (dP − D)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K (scaled at the end)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ, CuSeqQ, CuSeqK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dm,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    q_heads, group, Q_LEN, KV_LEN, q_bucket, kv_bucket, scale, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program ``(i, b·q_heads + h)``: dQ of rows ``[i·BLOCK_M, (i+1)·BLOCK_M)`` of query head
    ``h``, visiting the same key blocks as the forward did (same segments, same skipping)."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest programs first, as in the forward
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // q_heads
    h = pid_bh % q_heads
    kv_h = h // group
    q_start, q_len, k_start, kv_len = _sequence(b, CuSeqQ, CuSeqK, Q_LEN, KV_LEN, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return

    b64, h64, kv_h64 = b.to(tl.int64), h.to(tl.int64), kv_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d, d_ok = _head_dim_offsets(HEAD_DIM, BLOCK_D)
    rows_q = (q_start + offs_m).to(tl.int64)
    in_m = offs_m < q_len
    q_start64 = tl.cast(q_start, tl.int64)
    Q_seq = Q + b64 * stride_qb + h64 * stride_qh + q_start64 * stride_qm
    DO_seq = DO + b64 * stride_dob + h64 * stride_doh + q_start64 * stride_dom
    DQ_seq = DQ + b64 * stride_dqb + h64 * stride_dqh + q_start64 * stride_dqm
    K_seq = K + b64 * stride_kb + kv_h64 * stride_kh + tl.cast(k_start, tl.int64) * stride_kn
    V_seq = V + b64 * stride_vb + kv_h64 * stride_vh + tl.cast(k_start, tl.int64) * stride_vn
    k_offs = offs_n0[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_offs = offs_n0[:, None] * stride_vn + offs_d[None, :] * stride_vd

    if TMA:  # as in the forward: whole tiles by descriptor, bounds handled by the hardware
        q = tl.make_tensor_descriptor(Q_seq, shape=[q_len, HEAD_DIM], strides=[stride_qm, 1],
                                      block_shape=[BLOCK_M, BLOCK_D]).load([start_m, 0])
        do = tl.make_tensor_descriptor(DO_seq, shape=[q_len, HEAD_DIM], strides=[stride_dom, 1],
                                       block_shape=[BLOCK_M, BLOCK_D]).load([start_m, 0])
        K_src = tl.make_tensor_descriptor(K_seq, shape=[tl.maximum(kv_len, 1), HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        V_src = tl.make_tensor_descriptor(V_seq, shape=[tl.maximum(kv_len, 1), HEAD_DIM], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    else:
        rows = offs_m.to(tl.int64)[:, None]
        q = tl.load(Q_seq + rows * stride_qm + offs_d[None, :] * stride_qd, mask=in_m[:, None] & d_ok, other=0.0)
        do = tl.load(DO_seq + rows * stride_dom + offs_d[None, :] * stride_dod, mask=in_m[:, None] & d_ok, other=0.0)
        K_src = K_seq
        V_src = V_seq
    lse2 = tl.load(LSE + b64 * stride_lb + h64 * stride_lh + rows_q * stride_lm, mask=in_m, other=0.0) * _LOG2E
    delta = tl.load(Delta + b64 * stride_db + h64 * stride_dh + rows_q * stride_dm, mask=in_m, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    lo, full_lo, full_hi, hi = _kv_segments(start_m, q_len, kv_len, window, BLOCK_M, BLOCK_N, CAUSAL, USE_WINDOW)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_src, V_src, k_offs, v_offs, stride_kn, stride_vn,
                   offs_m, offs_n0, d_ok, lo, full_lo, q_len, kv_len, qk_scale, window,
                   True, CAUSAL, USE_WINDOW, DOT_PRECISION, TMA, BLOCK_N)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_src, V_src, k_offs, v_offs, stride_kn, stride_vn,
                   offs_m, offs_n0, d_ok, full_lo, full_hi, q_len, kv_len, qk_scale, window,
                   False, CAUSAL, USE_WINDOW, DOT_PRECISION, TMA, BLOCK_N)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_src, V_src, k_offs, v_offs, stride_kn, stride_vn,
                   offs_m, offs_n0, d_ok, full_hi, hi, q_len, kv_len, qk_scale, window,
                   True, CAUSAL, USE_WINDOW, DOT_PRECISION, TMA, BLOCK_N)

    if TMA:
        dq_desc = tl.make_tensor_descriptor(DQ_seq, shape=[q_len, HEAD_DIM], strides=[stride_dqm, 1],
                                            block_shape=[BLOCK_M, BLOCK_D])
        dq_desc.store([start_m, 0], (dq * scale).to(DQ.dtype.element_ty))
    else:
        tl.store(DQ_seq + rows * stride_dqm + offs_d[None, :] * stride_dqd, (dq * scale).to(DQ.dtype.element_ty),
                 mask=in_m[:, None] & d_ok)


# ----------------------------------------------------------------------------------------
# Tile sizes
# ----------------------------------------------------------------------------------------
#: Autotuning candidates per head dim, as in the forward (`FWD_TILES`; (BLOCK_M, BLOCK_N,
#: num_warps, num_stages), Hopper, checked for spills ahead of time). dK/dV programs hold a
#: K and a V block of BLOCK_N keys plus their two fp32 accumulators and stream thin Q/dO
#: blocks past them (BLOCK_N the tall side); dQ programs have the forward's shape (a tall Q
#: block, thin K/V blocks). The dK/dV kernel is the register-hungry one: at head_dim 128 a
#: 64 x 128 tile spills, 32 x 128 does not, and 64 x 64 spills only under GQA (group > 1).
DKDV_TILES = {
    64: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3)],
    128: [(32, 128, 8, 3), (32, 128, 8, 4), (32, 128, 8, 2), (16, 128, 8, 3), (32, 64, 8, 3)],
    256: [(16, 32, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2)],
}
DQ_TILES = {
    64: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
    256: [(64, 32, 8, 2), (64, 16, 4, 2), (32, 32, 4, 2)],
}
DQ_TILES_TMA = {
    64: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)],
    256: [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 16, 4, 2)],
}
DKDV_CONFIGS = tile_configs(DKDV_TILES)
DQ_CONFIGS = tile_configs(DQ_TILES, DQ_TILES_TMA)
#: Interpreter configs: small, and with BLOCK_M != BLOCK_N like the GPU ones.
INTERPRET_DKDV_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)
INTERPRET_DQ_CONFIG = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)
PREPROCESS_BLOCK_M = 64


def _pruner(table, tma_table=None):
    """Autotune only this head dim's candidates from ``table`` (``tma_table`` on the TMA path)."""
    def prune(configs, named_args, **kwargs):
        allowed = (tma_table if tma_table and kwargs.get("TMA") else table)[head_dim_class(kwargs["BLOCK_D"])]
        return [c for c in configs if config_key(c) in allowed]
    return prune


_AUTOTUNE_KEY = ["BLOCK_D", "CAUSAL", "USE_WINDOW", "q_bucket", "kv_bucket"]
_bwd_dkdv_kernel_tuned = triton.autotune(
    configs=DKDV_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _pruner(DKDV_TILES)},
)(_bwd_dkdv_kernel)
_bwd_dq_kernel_tuned = triton.autotune(
    configs=DQ_CONFIGS, key=_AUTOTUNE_KEY + ["TMA"],
    prune_configs_by={"early_config_prune": _pruner(DQ_TILES, DQ_TILES_TMA)},
)(_bwd_dq_kernel)


# ----------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------
def _backward(dout, q, k, v, out, lse, packing: Packing, causal: bool, scale: float, window: int | None,
              dq=None, dk=None, dv=None, dkdv_config: triton.Config | None = None,
              dq_config: triton.Config | None = None, tma: bool | None = None):
    """Launch preprocess, dK/dV and dQ (inputs already checked). Configs and ``tma`` as in
    `_forward` (TMA is used by the dQ kernel; the dK/dV kernel, whose loop also walks the
    query heads of a GQA group, reads through pointers)."""
    q_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype) if dq is None else dq
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype) if dk is None else dk
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype) if dv is None else dv
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    n = packing.n_seqs
    if n * kv_heads == 0 or packing.kv_len == 0 or head_dim == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if packing.q_len == 0:
        return dq, dk.zero_(), dv.zero_()

    delta = torch.empty(packing.lse_shape(q), device=q.device, dtype=torch.float32)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), VARLEN=packing.varlen)
    _bwd_preprocess_kernel[(triton.cdiv(packing.q_len, PREPROCESS_BLOCK_M), n * q_heads)](
        out, dout, delta, packing.cu_seqlens_q, *packing.strides(out), *packing.strides(dout),
        *packing.lse_strides(delta), q_heads, packing.q_len, **meta, BLOCK_M=PREPROCESS_BLOCK_M, num_warps=4,
    )

    meta.update(CAUSAL=bool(causal), USE_WINDOW=window is not None, DOT_PRECISION=dot_precision(q.dtype))
    tma = use_tma(packing, q, k, v, dout, dq) if tma is None else tma
    if tma and q.is_cuda:
        _ensure_allocator()
    common = (packing.q_len, packing.kv_len, seq_bucket(packing.q_len), seq_bucket(packing.kv_len),
              scale, scale * LOG2E, window or 0)
    inputs = (*packing.strides(q), *packing.strides(k), *packing.strides(v), *packing.strides(dout),
              *packing.lse_strides(lse), *packing.lse_strides(delta))
    bd = block_d(head_dim)
    dkdv_config = dkdv_config or fixed_config(DKDV_TILES, q.dtype, bd, INTERPRET_DKDV_CONFIG)
    dq_config = dq_config or fixed_config(DQ_TILES_TMA if tma else DQ_TILES, q.dtype, bd, INTERPRET_DQ_CONFIG)

    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, packing.cu_seqlens_q, packing.cu_seqlens_k, *inputs,
                 *packing.strides(dk), *packing.strides(dv), kv_heads, q_heads // kv_heads, *common)
    if dkdv_config is None:
        grid = lambda m: (triton.cdiv(packing.kv_len, m["BLOCK_N"]), n * kv_heads)  # noqa: E731
        _bwd_dkdv_kernel_tuned[grid](*dkdv_args, **meta)
    else:
        grid = (triton.cdiv(packing.kv_len, dkdv_config.kwargs["BLOCK_N"]), n * kv_heads)
        _bwd_dkdv_kernel[grid](*dkdv_args, **meta, **dkdv_config.all_kwargs())

    meta["TMA"] = tma

    dq_args = (q, k, v, dout, lse, delta, dq, packing.cu_seqlens_q, packing.cu_seqlens_k, *inputs,
               *packing.strides(dq), q_heads, q_heads // kv_heads, *common)
    if dq_config is None:
        grid = lambda m: (triton.cdiv(packing.q_len, m["BLOCK_M"]), n * q_heads)  # noqa: E731
        _bwd_dq_kernel_tuned[grid](*dq_args, **meta)
    else:
        grid = (triton.cdiv(packing.q_len, dq_config.kwargs["BLOCK_M"]), n * q_heads)
        _bwd_dq_kernel[grid](*dq_args, **meta, **dq_config.all_kwargs())
    return dq, dk, dv


def flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             scale: float | None = None, window: int | None = None,
                             dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
                             dv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of `flash_attention` given ``dout = ∂loss/∂out``.

    ``q, k, v`` and the options as passed to the forward; ``out`` and ``lse`` as it returned
    them (``flash_attention(..., return_lse=True)``); ``dout`` shaped like ``out``. Any strides.
    Under GQA, ``dk``/``dv`` (shaped like k/v) sum the contributions of every query head of a
    group. ``dq``/``dk``/``dv`` may be given preallocated. Autograd does all this for you
    (`FlashAttentionFunction`); this entry point is for tests and for reading.
    """
    _check_inputs(q, k, v, varlen=False)
    scale, window = _scale_and_window(q.shape[-1], scale, window)
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} must be {tuple(q.shape[:3])}")
    packing = Packing(q.shape[0], q.shape[2], k.shape[2])
    return _backward(dout, q, k, v, out, lse, packing, causal, scale, window, dq, dk, dv)


def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                    max_seqlen_k: int, causal: bool = False, scale: float | None = None,
                                    window: int | None = None, dq=None, dk=None, dv=None):
    """`flash_attention_backward` for the packed layout of `flash_attention_varlen` (``lse:
    [q_heads, total_q]``)."""
    _check_inputs(q, k, v, varlen=True)
    cu_seqlens_q, cu_seqlens_k = _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k)
    scale, window = _scale_and_window(q.shape[-1], scale, window)
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} must be {(q.shape[1], q.shape[0])}")
    packing = Packing(cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), cu_seqlens_q, cu_seqlens_k)
    return _backward(dout, q, k, v, out, lse, packing, causal, scale, window, dq, dk, dv)
