"""Chapter 4: FlashAttention-2, the forward kernel and its backward.

The notebook ``chapters/04_flash_attention.ipynb`` tells the chapter's story with its measurements;
this docstring summarises what the code does.

Chapter 3 built attention out of tiles: S and P never leave the chip, and an online softmax
rescales the partial results as larger scores turn up. FlashAttention-2 (Dao, 2023) keeps
that algorithm and changes *how the work is laid out*, in three ways. Each is marked
``FA2 (1)``, ``(2)``, ``(3)`` where it happens in the code below.

1. **Loop order and parallelism.** FA1 looped over K/V blocks on the outside and Q blocks on
   the inside, so every Q block's running ``O, m, ℓ`` made a round trip through HBM for every
   K/V block. FA2 swaps the loops: *one program owns one Q block* and streams all the K/V
   blocks past it, keeping ``O, m, ℓ`` in registers from start to end. The Q blocks are
   independent, so the grid is ``(Q blocks) × (batch · heads)``: even at batch 1 a long
   sequence fills the GPU (FA1 only parallelised over batch · heads).
2. **Deferred normalisation.** The accumulator ``O`` is kept *unscaled* (a sum of
   ``exp(s - m)·v``, not yet divided by ``ℓ``); each K/V block only rescales it by
   ``exp(m_old - m_new)``, and the division by ``ℓ`` happens once, at the very end.
   That saves a ``[BLOCK_M, head_dim]`` division per block: non-matmul FLOPs are the
   expensive kind on a GPU whose tensor cores do some 15x more FLOP/s than its other units.
3. **Only the logsumexp is saved.** The backward pass needs each row's softmax statistics to
   recompute P; instead of ``m`` and ``ℓ`` separately, the forward stores their one
   combination ``L = m + log ℓ``, with which ``P = exp(S - L)`` directly.

(The paper also splits each program's work between its warps by rows of Q rather than by
keys, so that warps never exchange partial sums. In Triton that is the compiler's business:
on Hopper each warpgroup of a ``BLOCK_M = 128``, 8-warp program owns 64 whole rows.)

And three techniques from outside the paper's list:

- **Causal block skipping.** Key blocks entirely above the diagonal are never loaded; only
  the blocks that straddle the diagonal apply a mask. The loop over keys is split into an
  unmasked segment (the bulk) and masked segments (the diagonal, the ragged end of the
  sequence, the edges of a sliding window), so the common case pays nothing for masking.
- **exp2.** The GPU's special-function unit computes ``2^x``; ``exp(x)`` costs an extra
  multiply. Folding ``log2(e)`` into the softmax scale once (``qk_scale = scale · log2 e``)
  turns every exponential into a bare ``exp2``; ``m`` lives in that base-2 domain inside the
  kernel and the stored logsumexp is converted back to natural log.
- **TMA on Hopper.** Tiles can be moved by pointer arithmetic (every thread computes the
  addresses of its elements and masks the out-of-range ones: portable, and what the
  interpreter and older GPUs use) or, on Hopper and newer, by *tensor descriptors*: the
  Tensor Memory Accelerator copies a whole tile between global and shared memory from its
  coordinates, checking the bounds itself. Same results, far fewer registers (compiled for
  sm_90 at head_dim 128: 142 instead of 192 per thread), which leaves room for bigger tiles.
  `use_tma` picks the path per call; the kernels contain both, switched by ``TMA``.

Layouts:

- `flash_attention`: ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads,
  kv_len, head_dim]`` (PyTorch's SDPA layout); any strides, no copies.
- `flash_attention_varlen`: sequences of different lengths packed back to back, the layout of
  the engine's prefill: ``q: [total_q, q_heads, head_dim]``, ``k, v: [total_k, kv_heads,
  head_dim]``, sequence ``b`` occupying rows ``cu_seqlens[b] : cu_seqlens[b + 1]``.

GQA/MQA: query head ``h`` reads KV head ``h // (q_heads // kv_heads)``, without copying K/V.
Positions are bottom-right aligned as in `minillm.reference.ch01_naive_attention` (query ``i`` sits at
``kv_len - q_len + i``), per sequence in the varlen layout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from minillm.kernels.base import (  # shared by every chapter's attention kernels
    tl, triton,
    LN2_C, LOG2E, LOG2E_C, block_d, dot_precision, head_dim_offsets, interpreting, launch, online_softmax_update,
    power_of_2_at_least, scale_and_window,
)

MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------
# Small helpers shared by the forward and backward kernels
# ----------------------------------------------------------------------------------------
@triton.jit
def _sequence(b, CuSeqQ, CuSeqK, Q_LEN, KV_LEN, VARLEN: tl.constexpr):
    """Where sequence ``b`` starts in the token axis of Q (and of K/V), and its lengths.

    Dense layout: every sequence has its own batch index, starts at token 0 and has the
    same lengths. Varlen: read the prefix sums ``cu_seqlens`` (the batch stride is 0)."""
    if VARLEN:
        q_start = tl.load(CuSeqQ + b)
        q_len = tl.load(CuSeqQ + b + 1) - q_start
        k_start = tl.load(CuSeqK + b)
        kv_len = tl.load(CuSeqK + b + 1) - k_start
    else:
        q_start = 0
        q_len = Q_LEN
        k_start = 0
        kv_len = KV_LEN
    return q_start, q_len, k_start, kv_len


@triton.jit
def visible_mask(q_idx, k_idx, q_len, kv_len, window, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Which (query, key) pairs are visible: a bool tile broadcast from ``q_idx`` and ``k_idx``
    (row indices inside the sequence). Out-of-range rows/keys are invisible; query ``i`` sits at
    position ``i + kv_len - q_len`` (bottom-right alignment), so causal means ``k <= that``."""
    ok = (q_idx < q_len) & (k_idx < kv_len)
    q_pos = q_idx + (kv_len - q_len)
    if CAUSAL:
        ok = ok & (k_idx <= q_pos)
    if USE_WINDOW:
        ok = ok & (q_pos - k_idx < window)
        if not CAUSAL:
            ok = ok & (k_idx - q_pos < window)
    return ok


@triton.jit
def _segments(first, end, all_first, all_end, BLOCK: tl.constexpr):
    """Split a loop over blocks of ``BLOCK`` into masked and unmasked segments.

    ``[first, end)`` is the union of what any row of this program can see (every block
    outside it is skipped); ``[all_first, all_end)`` is what *every* row sees (a block inside
    it needs no mask). Returns ``lo <= full_lo <= full_hi <= hi`` such that blocks in
    ``[lo, full_lo)`` and ``[full_hi, hi)`` need the mask and blocks in ``[full_lo, full_hi)``
    do not. ``lo`` and ``full_lo``/``full_hi`` are multiples of ``BLOCK`` (or equal to ``hi``,
    making a segment empty), so the three loops visit whole, aligned blocks.

    Everything is clamped to >= 0 before dividing: Triton's ``//`` truncates towards zero
    when compiled but floors in the interpreter, and the two agree only on non-negative numbers.
    """
    lo = tl.maximum(first, 0) // BLOCK * BLOCK
    hi = tl.maximum(end, lo)
    full_lo = tl.minimum((tl.maximum(all_first, 0) + BLOCK - 1) // BLOCK * BLOCK, hi)
    full_hi = tl.minimum(tl.maximum(tl.maximum(all_end, 0) // BLOCK * BLOCK, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def kv_segments(start_m, q_len, kv_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr):
    """The key blocks that query rows ``[start_m, start_m + BLOCK_M)`` visit (see `_segments`).

    Rows sit at positions ``p0 … p1``. Causal: row ``p`` sees keys ``<= p``, so the union of
    visible keys ends at ``p1`` and the keys every row sees end at ``p0`` — the blocks
    between (BLOCK_M / BLOCK_N + 1 of them at most) are the diagonal, the only masked ones;
    the blocks past ``p1`` are skipped. A window ``W`` adds a lower edge ``p - W + 1``."""
    p0 = start_m + (kv_len - q_len)
    p1 = p0 + BLOCK_M - 1
    if USE_WINDOW:
        first = p0 - window + 1
        all_first = p1 - window + 1
    else:
        first = 0
        all_first = 0
    if CAUSAL:
        end = tl.minimum(p1 + 1, kv_len)
        all_end = tl.minimum(p0 + 1, kv_len)
    elif USE_WINDOW:
        end = tl.minimum(p1 + window, kv_len)
        all_end = tl.minimum(p0 + window, kv_len)
    else:
        end = kv_len
        all_end = kv_len
    return _segments(first, end, all_first, all_end, BLOCK_N)


# ----------------------------------------------------------------------------------------
# The forward kernel
# ----------------------------------------------------------------------------------------
@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, K_src, V_src, k_offs, v_offs, stride_kn, stride_vn,
               offs_m, offs_n0, d_ok, lo, hi, q_len, kv_len, qk_scale, window,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
               DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
               RESCALE_EACH_STEP: tl.constexpr = False):
    """Stream key blocks ``[lo, hi)`` past one Q block: the online-softmax update of Chapter 3.

    State per query row: ``m_i`` (running max of the scores, base-2 units), ``l_i`` (running
    sum of ``2^(s - m_i)``) and ``acc`` (running sum of ``2^(s - m_i) · v``, FA2 (2): *not*
    divided by ``l_i``). With ``MASKED`` the scores of invisible pairs become ``-inf`` (and
    out-of-range keys are not loaded); without it, the caller guarantees that every pair in
    these blocks is visible, and no mask is computed at all. (``d_ok`` masks the padding
    columns of a head dim that is not a power of two; when it is one, the mask is all-true
    at compile time and costs nothing.)

    ``K_src``/``V_src`` are TMA descriptors when ``TMA`` (a tile is one ``load`` at block
    coordinates; out-of-range rows and columns arrive as zeros), else the sequence's base
    pointers, to which ``k_offs``/``v_offs`` add one tile's offsets.

    ``RESCALE_EACH_STEP`` (an ablation for the chapter's measurements, off in real use) keeps
    ``acc`` normalised after every block, as FlashAttention-1 does: ``acc = (ℓ_old·α·acc + P V)
    / ℓ_new``, one divide per row and one more multiply per element of ``acc`` per block.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        row0 = tl.cast(start_n, tl.int64)  # int64: token index x row stride can pass 2^31
        if MASKED:
            kv_ok = (offs_n < kv_len)[:, None] & d_ok
        else:
            kv_ok = d_ok
        if TMA:
            k = K_src.load([start_n, 0])
        else:
            k = tl.load(K_src + row0 * stride_kn + k_offs, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] raw scores, fp32
        if MASKED:  # scale, then -inf where invisible; unmasked, the scale is folded into exp2
            visible = visible_mask(offs_m[:, None], offs_n[None, :], q_len, kv_len, window, CAUSAL, USE_WINDOW)
            s = tl.where(visible, s * qk_scale, float("-inf"))
        # The online softmax of Chapter 3 (base 2): new max, p = 2^(s - m_new), alpha = how much
        # the old state shrinks under the new max, l = l·alpha + Σ p.
        p, alpha, l_new, m_i = online_softmax_update(m_i, l_i, s, qk_scale, MASKED)
        if TMA:
            v = V_src.load([start_n, 0])
        else:
            v = tl.load(V_src + row0 * stride_vn + v_offs, mask=kv_ok, other=0.0)
        # FA2 (2): rescale the unnormalised accumulator; no division here. P is rounded to
        # V's dtype for the tensor-core dot (fp32 accumulation), as every FlashAttention does.
        if RESCALE_EACH_STEP:  # FA1: acc stays divided by the running sum (l_i·alpha: the old sum)
            acc = tl.dot(p.to(v.dtype), v, acc * (l_i * alpha)[:, None], input_precision=DOT_PRECISION)
            acc = acc * (1.0 / tl.where(l_new == 0.0, 1.0, l_new))[:, None]
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        l_i = l_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, CuSeqQ, CuSeqK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    q_heads, group, Q_LEN, KV_LEN, q_bucket, kv_bucket, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RESCALE_EACH_STEP: tl.constexpr = False, MASK_EVERY_BLOCK: tl.constexpr = False,
    VISIT_EVERY_BLOCK: tl.constexpr = False,
):
    """Program ``(i, b·q_heads + h)`` computes rows ``[i·BLOCK_M, (i+1)·BLOCK_M)`` of the
    output of query head ``h`` of sequence ``b`` — FA2 (1): a Q block owns its output and
    loops over every K/V block it can see; nothing but O and L is ever written.

    ``q_bucket``/``kv_bucket`` are unused here: they are the autotuner's keys (lengths rounded
    to a power of two), so that short and long sequences each get their own best tile sizes.

    The last three flags switch off one idea each, so that the chapter can measure what it
    buys (`ABLATIONS`); all are off in real use. ``RESCALE_EACH_STEP``: keep O normalised
    after every block (FA1) instead of dividing once at the end (FA2 change 2).
    ``MASK_EVERY_BLOCK``: apply the mask to every visited block, not only to the diagonal
    and ragged ones. ``VISIT_EVERY_BLOCK``: no block skipping either: every key block is
    loaded, computed and masked, as a causal kernel without skipping would.
    """
    pid_m = tl.program_id(0)
    if CAUSAL:
        # Causal rows further down see more keys: launch the longest programs first, so that
        # the short ones fill the gaps at the end instead of a long one running alone.
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // q_heads
    h = pid_bh % q_heads
    kv_h = h // group  # GQA: this query head's KV head; K/V are shared, never copied

    q_start, q_len, k_start, kv_len = _sequence(b, CuSeqQ, CuSeqK, Q_LEN, KV_LEN, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:  # varlen: this sequence is shorter than the longest one
        return

    # int64 bases: a packed batch or a [batch, heads, seq, dim] tensor can pass 2^31 elements.
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    kv_h64 = kv_h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)  # d_ok: the real columns of a padded head dim
    in_m = offs_m < q_len
    # Where this head's sequence starts in each tensor.
    Q_seq = Q + b64 * stride_qb + h64 * stride_qh + tl.cast(q_start, tl.int64) * stride_qm
    O_seq = O + b64 * stride_ob + h64 * stride_oh + tl.cast(q_start, tl.int64) * stride_om
    K_seq = K + b64 * stride_kb + kv_h64 * stride_kh + tl.cast(k_start, tl.int64) * stride_kn
    V_seq = V + b64 * stride_vb + kv_h64 * stride_vh + tl.cast(k_start, tl.int64) * stride_vn
    k_offs = offs_n0[:, None] * stride_kn + offs_d[None, :] * stride_kd  # one [BLOCK_N, BLOCK_D] tile
    v_offs = offs_n0[:, None] * stride_vn + offs_d[None, :] * stride_vd

    if TMA:
        # Hopper's tensor memory accelerator: a descriptor describes this head's sequence as
        # a [len, HEAD_DIM] matrix, and one instruction copies a whole tile into shared
        # memory, bounds included (rows past the end and padding columns read as 0, and
        # stores there are dropped). No per-element address arithmetic, far fewer registers.
        q = tl.make_tensor_descriptor(Q_seq, shape=[q_len, HEAD_DIM], strides=[stride_qm, 1],
                                      block_shape=[BLOCK_M, BLOCK_D]).load([start_m, 0])
        # (A sequence without keys still gets a valid, if unused, descriptor: TMA wants sizes >= 1.)
        K_src = tl.make_tensor_descriptor(K_seq, shape=[tl.maximum(kv_len, 1), HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        V_src = tl.make_tensor_descriptor(V_seq, shape=[tl.maximum(kv_len, 1), HEAD_DIM], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    else:
        rows = offs_m.to(tl.int64)[:, None]  # int64: row x stride can pass 2^31 in a long sequence
        q = tl.load(Q_seq + rows * stride_qm + offs_d[None, :] * stride_qd, mask=in_m[:, None] & d_ok, other=0.0)
        K_src = K_seq
        V_src = V_seq

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    # Key blocks in three segments: masked, unmasked, masked. Causal: [0, diagonal) without
    # masks, then the diagonal blocks with; the blocks past the diagonal are never visited.
    # Non-causal: everything unmasked except the last, ragged block of the sequence.
    lo, full_lo, full_hi, hi = kv_segments(start_m, q_len, kv_len, window, BLOCK_M, BLOCK_N, CAUSAL, USE_WINDOW)
    if VISIT_EVERY_BLOCK:  # ablation: all key blocks, all masked
        lo, full_lo, full_hi, hi = 0, kv_len, kv_len, kv_len
    elif MASK_EVERY_BLOCK:  # ablation: the same blocks, all masked
        full_lo, full_hi = hi, hi
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_src, V_src, k_offs, v_offs, stride_kn, stride_vn,
                               offs_m, offs_n0, d_ok, lo, full_lo, q_len, kv_len, qk_scale, window,
                               True, CAUSAL, USE_WINDOW, DOT_PRECISION, TMA, BLOCK_N, RESCALE_EACH_STEP)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_src, V_src, k_offs, v_offs, stride_kn, stride_vn,
                               offs_m, offs_n0, d_ok, full_lo, full_hi, q_len, kv_len, qk_scale, window,
                               False, CAUSAL, USE_WINDOW, DOT_PRECISION, TMA, BLOCK_N, RESCALE_EACH_STEP)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_src, V_src, k_offs, v_offs, stride_kn, stride_vn,
                               offs_m, offs_n0, d_ok, full_hi, hi, q_len, kv_len, qk_scale, window,
                               True, CAUSAL, USE_WINDOW, DOT_PRECISION, TMA, BLOCK_N, RESCALE_EACH_STEP)

    # FA2 (2): normalise once. A row with no visible key (l = 0) gets 0, like the reference.
    if RESCALE_EACH_STEP:
        out = acc  # (already normalised, step by step)
    else:
        out = acc * (1.0 / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    # FA2 (3): the only statistic kept for the backward, L = m + log l, back in natural log.
    # l = 0 gives log2(0) = -inf, and m = -inf too: L = -inf, no NaN.
    lse = (m_i + tl.math.log2(l_i)) * LN2_C

    if TMA:
        tl.make_tensor_descriptor(O_seq, shape=[q_len, HEAD_DIM], strides=[stride_om, 1],
                                  block_shape=[BLOCK_M, BLOCK_D]).store([start_m, 0], out.to(O.dtype.element_ty))
    else:
        tl.store(O_seq + rows * stride_om + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
                 mask=in_m[:, None] & d_ok)
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + (q_start + offs_m).to(tl.int64) * stride_lm, lse, mask=in_m)


# ----------------------------------------------------------------------------------------
# Tile sizes: autotuned on the GPU, one small fixed config in the interpreter
# ----------------------------------------------------------------------------------------
#: Autotuning candidates on a GPU, per head dim (padded: <= 64, 128, 256), as (BLOCK_M,
#: BLOCK_N, num_warps, num_stages), for Hopper (sm_90). BLOCK_M = 128 rows over 8 warps gives
#: each of the two warpgroups 64 rows, the height of one Hopper wgmma instruction; BLOCK_N =
#: 64/128 keys per step with 3-4 stages of K/V loads in flight. Every entry was compiled for
#: sm_90 ahead of time (`bench.ch04_flash_attention.compile_report`) and kept only if it
#: neither spills registers nor overflows shared memory: e.g. at head_dim 128, 128 x 128 tiles
#: spill, and at 256 only 32-key steps fit. The 64-row configs serve short sequences.
FWD_TILES = {
    64: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 32, 4, 2)],
    256: [(64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 3)],
}
#: The same for the TMA path (`use_tma`), which needs far fewer registers (no per-element
#: addresses): at head_dim 128, 128 x 128 tiles fit without spilling.
FWD_TILES_TMA = {
    64: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)],
    256: [(64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 3)],
}
#: The one config used under the interpreter: small tiles keep it fast, and BLOCK_M != BLOCK_N
#: exercises the diagonal logic the way 128 x 64 does on the GPU.
INTERPRET_FWD_CONFIG = triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)


#: The forward kernel's switches that turn off one FlashAttention-2 idea each, for the
#: chapter's measurements (`_fwd_kernel`): name -> constexpr flag.
ABLATIONS = {
    "rescale_each_step": "RESCALE_EACH_STEP",  # FA1's normalised O instead of FA2 change (2)
    "mask_every_block": "MASK_EVERY_BLOCK",    # mask every visited block, not only the diagonal
    "visit_every_block": "VISIT_EVERY_BLOCK",  # no causal block skipping (and every block masked)
}


#: fp32 inputs on a GPU (a testing dtype: exact IEEE products, no tensor cores) run one small
#: config instead of autotuning: their dots compile to long FMA sequences that spill and
#: take many seconds to compile, and their speed is of no interest.
FP32_CONFIG = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2)


def fixed_config(table: dict, dtype: torch.dtype, block_d_: int, interpret_config: triton.Config):
    """The config to launch with instead of autotuning, or ``None`` to autotune: the small
    interpreter config under ``TRITON_INTERPRET``; `FP32_CONFIG` for fp32; and with
    ``MINILLM_FLASH_AUTOTUNE=0`` (the test suite sets it, to compile one config per kernel
    variant instead of all of them) the first candidate of ``table`` for this head dim."""
    if interpreting():
        return interpret_config
    if dtype == torch.float32:
        return FP32_CONFIG
    if os.environ.get("MINILLM_FLASH_AUTOTUNE", "1") == "0":
        bm, bn, warps, stages = table[head_dim_class(block_d_)][0]
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
    return None


def tile_configs(*tables: dict[int, list[tuple[int, int, int, int]]]) -> list[triton.Config]:
    """Every distinct entry of per-head-dim tables as a ``triton.Config``."""
    tiles = dict.fromkeys(t for table in tables for rows in table.values() for t in rows)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]


def config_key(config: triton.Config) -> tuple[int, int, int, int]:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def head_dim_class(block_d_: int) -> int:
    """The row of a per-head-dim table that a padded head dim uses."""
    return 64 if block_d_ <= 64 else (128 if block_d_ <= 128 else 256)


FWD_CONFIGS = tile_configs(FWD_TILES, FWD_TILES_TMA)


def prune_fwd_configs(configs, named_args, **kwargs):
    """Autotune only this head dim's (and load path's) candidates, and no 128-row tiles for
    queries of at most 64 rows (they would be mostly empty). Never returns an empty list."""
    allowed = (FWD_TILES_TMA if kwargs["TMA"] else FWD_TILES)[head_dim_class(kwargs["BLOCK_D"])]
    keep = [c for c in configs if config_key(c) in allowed]
    short = [c for c in keep if c.kwargs["BLOCK_M"] <= 64]
    return short if named_args["q_bucket"] <= 64 and short else keep


_fwd_kernel_tuned = triton.autotune(
    configs=FWD_CONFIGS,
    key=["BLOCK_D", "CAUSAL", "USE_WINDOW", "TMA", "q_bucket", "kv_bucket"],  # (+ the dtypes, always)
    prune_configs_by={"early_config_prune": prune_fwd_configs},
)(_fwd_kernel)


def seq_bucket(n: int) -> int:
    """The autotuning key of a sequence length: the next power of two in [64, 16384]."""
    return min(max(power_of_2_at_least(max(int(n), 1)), 64), 16384)


# ----------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Packing:
    """How sequences are laid out: dense ``[batch, heads, seq, dim]`` (``cu_seqlens_q is None``)
    or packed varlen ``[tokens, heads, dim]`` with prefix sums of the lengths.

    ``q_len``/``kv_len`` are the lengths (dense) or the maxima over the batch (varlen);
    ``n_seqs`` is the batch size."""
    n_seqs: int
    q_len: int
    kv_len: int
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def strides(self, t: torch.Tensor) -> tuple[int, int, int, int]:
        """(batch, head, token, dim) strides of a Q/K/V/O-like tensor."""
        if self.varlen:  # [tokens, heads, dim]: no batch axis
            return 0, t.stride(1), t.stride(0), t.stride(2)
        return tuple(t.stride())

    def lse_strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, head, token) strides of an lse-like tensor: ``[batch, heads, seq]`` dense,
        ``[heads, tokens]`` varlen."""
        if self.varlen:
            return 0, t.stride(0), t.stride(1)
        return tuple(t.stride())

    def lse_shape(self, q: torch.Tensor) -> tuple[int, ...]:
        return (q.shape[1], q.shape[0]) if self.varlen else tuple(q.shape[:3])


def _check_inputs(q, k, v, varlen: bool) -> tuple[int, int, int]:
    """Validate shapes/dtypes; returns ``(q_heads, kv_heads, head_dim)``."""
    dims = 3 if varlen else 4
    layout = "[tokens, heads, head_dim]" if varlen else "[batch, heads, seq, head_dim]"
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        raise ValueError(f"q, k, v must be {layout}; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on the same device")
    head_axis = 1
    q_heads, kv_heads, head_dim = q.shape[head_axis], k.shape[head_axis], q.shape[-1]
    if k.shape[-1] != head_dim or (not varlen and k.shape[0] != q.shape[0]):
        raise ValueError(f"q {tuple(q.shape)} does not match k/v {tuple(k.shape)}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (MHA/GQA/MQA)")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim}: 1..{MAX_HEAD_DIM} supported (a Q block lives in registers)")
    return q_heads, kv_heads, head_dim


def use_tma(packing: Packing, *tensors: torch.Tensor) -> bool:
    """Whether the kernels may read and write ``tensors`` through TMA descriptors: on a
    Hopper-or-newer GPU (not in the interpreter), unless ``MINILLM_FLASH_TMA=0``, and only if
    every tensor has a unit stride along head_dim and 16-byte aligned rows (base address and
    every other stride a multiple of 16 bytes), which is what the hardware requires. Other
    layouts (e.g. a head_dim of 20 in fp16, or a transposed K) take the pointer path."""
    t0 = tensors[0]
    if interpreting() or not t0.is_cuda or os.environ.get("MINILLM_FLASH_TMA", "1") == "0":
        return False
    if torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    for t in tensors:
        strides = packing.strides(t)
        if strides[3] != 1 or t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in strides[:3]):
            return False
    return True


def _ensure_allocator() -> None:
    """Descriptors made inside a kernel live in a small global scratch buffer that Triton
    asks an allocator for at launch; give it torch's if none is set in this thread (autograd
    runs the backward in its own thread, which starts without one)."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        if not isinstance(_allocator.get(), NullAllocator):
            return
    except ImportError:  # another Triton layout: set ours unconditionally
        pass
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def launch_forward(q, k, v, packing: Packing, causal: bool, scale: float, window: int | None,
                   out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                   config: triton.Config | None = None, tma: bool | None = None,
                   ablation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel (inputs already checked; `flash_attention` and
    `flash_attention_varlen` check them, then call this). ``config`` forces a tile config
    (tests); otherwise the interpreter uses `INTERPRET_FWD_CONFIG` and a GPU autotunes.
    ``tma`` forces the TMA path on or off (tests; the interpreter runs both); by default
    `use_tma` decides. ``ablation``: one of `ABLATIONS`, with a ``config`` (measurements only)."""
    q_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[-1]  # heads: axis 1 in both layouts
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty(packing.lse_shape(q), device=q.device, dtype=torch.float32)
    if packing.n_seqs * q_heads == 0 or packing.q_len == 0:
        return out, lse
    args = (
        q, k, v, out, lse, packing.cu_seqlens_q, packing.cu_seqlens_k,
        *packing.strides(q), *packing.strides(k), *packing.strides(v), *packing.strides(out),
        *packing.lse_strides(lse),
        q_heads, q_heads // kv_heads, packing.q_len, packing.kv_len,
        seq_bucket(packing.q_len), seq_bucket(packing.kv_len), scale * LOG2E, window or 0,
    )
    tma = use_tma(packing, q, k, v, out) if tma is None else tma
    if tma and q.is_cuda:
        _ensure_allocator()
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), CAUSAL=bool(causal), USE_WINDOW=window is not None,
                VARLEN=packing.varlen, DOT_PRECISION=dot_precision(q.dtype), TMA=tma)
    if ablation is not None:
        if config is None:
            raise ValueError("an ablation runs with a fixed config: pass config=")
        meta[ABLATIONS[ablation]] = True
    if config is None:
        config = fixed_config(FWD_TILES_TMA if tma else FWD_TILES, q.dtype, block_d(head_dim), INTERPRET_FWD_CONFIG)
    if config is None:
        grid = lambda m: (triton.cdiv(packing.q_len, m["BLOCK_M"]), packing.n_seqs * q_heads)  # noqa: E731
        _fwd_kernel_tuned[grid](*args, **meta)
    else:
        grid = (triton.cdiv(packing.q_len, config.kwargs["BLOCK_M"]), packing.n_seqs * q_heads)
        launch(_fwd_kernel, grid, *args, **meta, **config.all_kwargs())
    return out, lse


# ----------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------
class FlashAttentionFunction(torch.autograd.Function):
    """FlashAttention-2 as a differentiable op (dense or varlen layout).

    Forward saves only q, k, v, the output and the logsumexp (FA2 (3)); the backward
    recomputes P block by block from them (`minillm.kernels.ch04_flash_attention`). The
    returned lse is not differentiable (its gradient would add a term the kernels do not
    compute)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        packing = _packing_of(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        out, lse = launch_forward(q, k, v, packing, causal, scale, window)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.packing_lens = (packing.n_seqs, packing.q_len, packing.kv_len)
        ctx.causal, ctx.scale, ctx.window = causal, scale, window
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        packing = Packing(*ctx.packing_lens, cu_q, cu_k)
        dq, dk, dv = launch_backward(dout, q, k, v, out, lse, packing, ctx.causal, ctx.scale, ctx.window)
        return dq, dk, dv, None, None, None, None, None, None, None


def _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k):
    """Validate the prefix sums; int64 ones are converted to int32 (the kernels index with
    int32 sequence offsets; a packed batch of 2^31 tokens is not a use case)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-d int32 tensor on q's device, got {tuple(cu.shape)} "
                             f"{cu.dtype} on {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries")
    return cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)


def _packing_of(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packing:
    if cu_seqlens_q is None:
        return Packing(q.shape[0], q.shape[2], k.shape[2])
    return Packing(cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), cu_seqlens_q, cu_seqlens_k)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, window: int | None = None, return_lse: bool = False,
                    out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """FlashAttention-2: ``softmax(scale · q kᵀ + mask) v`` without ever materialising S or P.

    - ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads, kv_len, head_dim]``,
      one dtype among fp16/bf16/fp32, ``q_heads % kv_heads == 0``, ``head_dim <= 256``; any
      strides (nothing is copied);
    - ``causal``: bottom-right aligned (query ``i`` sees keys ``<= kv_len - q_len + i``);
      ``window=W``: only keys within ``W`` positions (with ``causal``: the last W keys);
    - ``scale`` defaults to ``1/sqrt(head_dim)`` and must be positive.

    Returns ``out: [batch, q_heads, q_len, head_dim]`` in q's dtype, and with ``return_lse``
    also ``lse: [batch, q_heads, q_len]`` float32 (natural log; ``-inf`` for a row that sees
    no key, whose output is 0). Differentiable in q, k, v (`FlashAttentionFunction`); the
    preallocated ``out``/``lse`` buffers are only accepted when no gradient is needed.
    """
    _check_inputs(q, k, v, varlen=False)
    scale, window = scale_and_window(q.shape[-1], scale, window)
    if _needs_grad(q, k, v):
        if out is not None or lse is not None:
            raise ValueError("out=/lse= cannot be used when q, k or v requires grad")
        o, l = FlashAttentionFunction.apply(q, k, v, causal, scale, window, None, None, None, None)
    else:
        o, l = launch_forward(q, k, v, Packing(q.shape[0], q.shape[2], k.shape[2]), causal, scale, window, out, lse)
    return (o, l) if return_lse else o


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                           scale: float | None = None, window: int | None = None, return_lse: bool = False,
                           out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """FlashAttention-2 over a packed batch of sequences of different lengths (no padding).

    - ``q: [total_q, q_heads, head_dim]``, ``k, v: [total_k, kv_heads, head_dim]``: the
      sequences back to back (any strides);
    - ``cu_seqlens_q, cu_seqlens_k: [batch + 1]`` int32 on q's device, the prefix sums of the
      lengths (``cu[0] = 0``; sequence ``b`` is rows ``cu[b] : cu[b + 1]``). Each sequence
      attends only within itself, bottom-right aligned by its own lengths, so a sequence with
      more keys than queries is a chunk of a prompt whose earlier tokens are already cached;
    - ``max_seqlen_q, max_seqlen_k``: Python ints, at least the longest lengths (they size the
      grid; they are not checked against ``cu_seqlens``, which would need a device sync).

    Returns ``out: [total_q, q_heads, head_dim]`` and with ``return_lse`` also ``lse:
    [q_heads, total_q]`` float32. Differentiable in q, k, v like `flash_attention`.
    """
    _check_inputs(q, k, v, varlen=True)
    cu_seqlens_q, cu_seqlens_k = _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k)
    scale, window = scale_and_window(q.shape[-1], scale, window)
    if _needs_grad(q, k, v):
        if out is not None or lse is not None:
            raise ValueError("out=/lse= cannot be used when q, k or v requires grad")
        o, l = FlashAttentionFunction.apply(q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k)
    else:
        packing = Packing(cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), cu_seqlens_q, cu_seqlens_k)
        o, l = launch_forward(q, k, v, packing, causal, scale, window, out, lse)
    return (o, l) if return_lse else o


# ========================================================================================
# The backward
#
# Chapter 4: FlashAttention-2, the backward kernels.
#
# With ``S = scale · Q Kᵀ``, ``P = softmax(S)`` row by row and ``O = P V``, the gradients
# of a loss with respect to Q, K, V, given ``dO``, are
#
#     dV = Pᵀ dO
#     dP = dO Vᵀ
#     dS = P ∘ (dP − D),     D_i = Σ_j P_ij dP_ij = rowsum(dO ∘ O)_i
#     dQ = scale · dS K
#     dK = scale · dSᵀ Q
#
# (the softmax's Jacobian folds into the row vector ``D``). The standard algorithm would keep P
# from the forward: N² numbers. FlashAttention keeps only the logsumexp ``L`` of every row
# (forward, FA2 (3)) and **recomputes** each tile of P on chip as ``P = exp(S − L)``: one more
# matmul (``Q Kᵀ`` again) in exchange for never storing or reading an N² matrix. ``D`` is a
# cheap preprocess (`_bwd_preprocess_kernel`), one number per row.
#
# How the work is split (the FA2 layout):
#
# - `_bwd_dkdv_kernel`: **one program per K/V block** (of one KV head), looping over the Q
#   blocks that can see it. dK and dV of the block are sums over query rows, so they
#   accumulate in registers and are written once. Under GQA several query heads read the same
#   KV head, and its dK/dV are the sum over that group: the program simply loops over the
#   group's query heads too, so the reduction happens in registers, with no ``[q_heads, …]``
#   temporary and no second pass.
# - `_bwd_dq_kernel`: **one program per Q block**, looping over the K/V blocks it sees, exactly
#   like the forward. dQ of the block is a sum over keys, accumulated in registers.
#
# Why a separate dQ kernel rather than atomics: the dK/dV programs already hold every tile of
# dS, and FA2's CUDA code adds their ``dS K`` terms into an fp32 dQ buffer with ``atomicAdd``
# (5 matmuls per tile pair). Here the dQ programs recompute S and dP instead (7 matmuls:
# 40% more tensor-core work in the backward). In exchange dQ is deterministic (atomics add
# in whatever order the programs happen to finish, so the low bits change from run to run),
# needs no fp32 ``[batch, heads, seq, dim]`` buffer and no pass to convert it, and no two
# programs ever write the same row. The Triton tutorial's fused attention makes the same trade.
#
# Layouts, masking, GQA and varlen work exactly as in the forward (`flash_attention`), whose
# helpers these kernels share.
# ========================================================================================


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
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
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
    """The mirror image of `kv_segments`: the Q blocks that can see keys
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
        pT = tl.math.exp2(sT * qk_scale - (lse * LOG2E_C)[None, :])
        if MASKED:
            # A row that sees no key has L = -inf and 2^(+inf) = inf here; the mask replaces it.
            pT = tl.where(visible_mask(offs_m[None, :], offs_n[:, None], q_len, kv_len, window, CAUSAL, USE_WINDOW),
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
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
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
            p = tl.where(visible_mask(offs_m[:, None], offs_n[None, :], q_len, kv_len, window, CAUSAL, USE_WINDOW),
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
    offs_d, d_ok = head_dim_offsets(HEAD_DIM, BLOCK_D)
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
    lse2 = tl.load(LSE + b64 * stride_lb + h64 * stride_lh + rows_q * stride_lm, mask=in_m, other=0.0) * LOG2E_C
    delta = tl.load(Delta + b64 * stride_db + h64 * stride_dh + rows_q * stride_dm, mask=in_m, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    lo, full_lo, full_hi, hi = kv_segments(start_m, q_len, kv_len, window, BLOCK_M, BLOCK_N, CAUSAL, USE_WINDOW)
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


def config_pruner(table, tma_table=None):
    """Autotune only this head dim's candidates from ``table`` (``tma_table`` on the TMA path)."""
    def prune(configs, named_args, **kwargs):
        allowed = (tma_table if tma_table and kwargs.get("TMA") else table)[head_dim_class(kwargs["BLOCK_D"])]
        return [c for c in configs if config_key(c) in allowed]
    return prune


_AUTOTUNE_KEY = ["BLOCK_D", "CAUSAL", "USE_WINDOW", "q_bucket", "kv_bucket"]
_bwd_dkdv_kernel_tuned = triton.autotune(
    configs=DKDV_CONFIGS, key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": config_pruner(DKDV_TILES)},
)(_bwd_dkdv_kernel)
_bwd_dq_kernel_tuned = triton.autotune(
    configs=DQ_CONFIGS, key=_AUTOTUNE_KEY + ["TMA"],
    prune_configs_by={"early_config_prune": config_pruner(DQ_TILES, DQ_TILES_TMA)},
)(_bwd_dq_kernel)


# ----------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------
def launch_backward(dout, q, k, v, out, lse, packing: Packing, causal: bool, scale: float, window: int | None,
                    dq=None, dk=None, dv=None, dkdv_config: triton.Config | None = None,
                    dq_config: triton.Config | None = None, tma: bool | None = None):
    """Launch preprocess, dK/dV and dQ (inputs already checked). Configs and ``tma`` as in
    `launch_forward` (TMA is used by the dQ kernel; the dK/dV kernel, whose loop also walks the
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
    launch(_bwd_preprocess_kernel, (triton.cdiv(packing.q_len, PREPROCESS_BLOCK_M), n * q_heads),
           out, dout, delta, packing.cu_seqlens_q, *packing.strides(out), *packing.strides(dout),
           *packing.lse_strides(delta), q_heads, packing.q_len, **meta, BLOCK_M=PREPROCESS_BLOCK_M, num_warps=4)

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
        launch(_bwd_dkdv_kernel, grid, *dkdv_args, **meta, **dkdv_config.all_kwargs())

    meta["TMA"] = tma

    dq_args = (q, k, v, dout, lse, delta, dq, packing.cu_seqlens_q, packing.cu_seqlens_k, *inputs,
               *packing.strides(dq), q_heads, q_heads // kv_heads, *common)
    if dq_config is None:
        grid = lambda m: (triton.cdiv(packing.q_len, m["BLOCK_M"]), n * q_heads)  # noqa: E731
        _bwd_dq_kernel_tuned[grid](*dq_args, **meta)
    else:
        grid = (triton.cdiv(packing.q_len, dq_config.kwargs["BLOCK_M"]), n * q_heads)
        launch(_bwd_dq_kernel, grid, *dq_args, **meta, **dq_config.all_kwargs())
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
    scale, window = scale_and_window(q.shape[-1], scale, window)
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} must be {tuple(q.shape[:3])}")
    packing = Packing(q.shape[0], q.shape[2], k.shape[2])
    return launch_backward(dout, q, k, v, out, lse, packing, causal, scale, window, dq, dk, dv)


def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                                    max_seqlen_k: int, causal: bool = False, scale: float | None = None,
                                    window: int | None = None, dq=None, dk=None, dv=None):
    """`flash_attention_backward` for the packed layout of `flash_attention_varlen` (``lse:
    [q_heads, total_q]``)."""
    _check_inputs(q, k, v, varlen=True)
    cu_seqlens_q, cu_seqlens_k = _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k)
    scale, window = scale_and_window(q.shape[-1], scale, window)
    if dout.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(f"dout {tuple(dout.shape)}, out {tuple(out.shape)} must be q's shape {tuple(q.shape)} "
                         f"and lse {tuple(lse.shape)} must be {(q.shape[1], q.shape[0])}")
    packing = Packing(cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), cu_seqlens_q, cu_seqlens_k)
    return launch_backward(dout, q, k, v, out, lse, packing, causal, scale, window, dq, dk, dv)
