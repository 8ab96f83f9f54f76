"""Chapter 1: the textbook attention algorithm as three Triton kernels.

The notebook ``chapters/01_naive_attention.ipynb`` tells the chapter's story with its measurements;
this docstring summarises what the code does.

    S = scale · Q Kᵀ (+ mask)   -> written to HBM   [batch, q_heads, q_len, kv_len], fp32
    P = softmax(S) row by row   -> written to HBM   [batch, q_heads, q_len, kv_len], input dtype
    O = P V                     -> written to HBM   [batch, q_heads, q_len, head_dim]

Each pass is its own kernel launch, so S and P make a round trip through HBM: this is the
O(N²)-memory algorithm that FlashAttention (Chapters 3-4) removes. The count of matrix
reads/writes (Q, K, S, S, P, P, V, O: eight) is in `minillm.costs.naive_attention_traffic`.

Shapes: ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads, kv_len, head_dim]``;
any strides are accepted (no copies). GQA/MQA: query head ``h`` reads KV head
``h // (q_heads // kv_heads)``. Positions are bottom-right aligned as in
`minillm.reference.ch01_naive_attention`.
"""
from __future__ import annotations

import torch
# (importing base also sets the interpreter switch, before any @triton.jit)
from minillm.kernels.base import block_d, dot_precision, power_of_2_at_least, scale_and_window, tl, triton


# ----------------------------------------------------------------------------------------
# Pass 1: scores
# ----------------------------------------------------------------------------------------
@triton.jit
def _scores_kernel(
    Q, K, S,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_sb, stride_sh, stride_sm, stride_sn,
    q_heads, q_len, kv_len, head_dim, group_size, scale, window,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program computes one [BLOCK_M, BLOCK_N] tile of S for one (batch, head)."""
    pid_m, pid_n, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # int64: S has batch·heads·q_len·kv_len elements, past 2^31 already at 16 heads x 12k tokens.
    b, h = (pid_bh // q_heads).to(tl.int64), (pid_bh % q_heads).to(tl.int64)
    kv_h = h // group_size  # GQA: several query heads share this KV head; nothing is copied

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_m, in_n, in_d = offs_m < q_len, offs_n < kv_len, offs_d < head_dim

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=in_m[:, None] & in_d[None, :], other=0.0)
    k = tl.load(K + b * stride_kb + kv_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=in_n[:, None] & in_d[None, :], other=0.0)
    # fp32 inputs: exact fp32 products ("ieee": the interpreter and the tests need them);
    # fp16/bf16 inputs: tensor cores, fp32 accumulation.
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = s * scale

    # Mask in the same pass so that softmax only ever sees -inf for hidden keys.
    q_pos = offs_m[:, None] + (kv_len - q_len)
    k_pos = offs_n[None, :]
    if CAUSAL:
        s = tl.where(k_pos <= q_pos, s, float("-inf"))
    if USE_WINDOW:
        dist = q_pos - k_pos
        s = tl.where((dist < window) & (dist > -window), s, float("-inf"))

    tl.store(S + b * stride_sb + h * stride_sh + offs_m[:, None] * stride_sm + offs_n[None, :] * stride_sn,
             s, mask=in_m[:, None] & in_n[None, :])


def attention_scores(q: torch.Tensor, k: torch.Tensor, causal: bool = False, scale: float | None = None,
                     window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 1: ``S = scale · q kᵀ`` with hidden keys set to ``-inf``.

    ``q: [batch, q_heads, q_len, head_dim]``, ``k: [batch, kv_heads, kv_len, head_dim]``
    -> ``S: [batch, q_heads, q_len, kv_len]`` in float32 (scores are kept in fp32 so the
    softmax sees them unrounded; this is also what PyTorch's math backend does).
    """
    batch, q_heads, q_len, head_dim = q.shape
    _, kv_heads, kv_len, _ = k.shape
    _check_gqa(q_heads, kv_heads)
    scale, window = scale_and_window(head_dim, scale, window)
    if out is None:
        out = torch.empty(batch, q_heads, q_len, kv_len, device=q.device, dtype=torch.float32)
    BLOCK_M, BLOCK_N = 64, 64
    grid = (triton.cdiv(q_len, BLOCK_M), triton.cdiv(kv_len, BLOCK_N), batch * q_heads)
    _scores_kernel[grid](
        q, k, out, *q.stride(), *k.stride(), *out.stride(),
        q_heads, q_len, kv_len, head_dim, q_heads // kv_heads, scale, window or 0,
        CAUSAL=causal, USE_WINDOW=window is not None, DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d(head_dim),
        num_warps=4, num_stages=2,
    )
    return out


# ----------------------------------------------------------------------------------------
# Pass 2: softmax, one row per program
# ----------------------------------------------------------------------------------------
@triton.jit
def _softmax_kernel(
    S, P, LSE,
    stride_s_row, stride_p_row, n_cols,
    BLOCK_N: tl.constexpr,
):
    """Row ``r`` of the flattened ``[rows, n_cols]`` score matrix -> probabilities and lse.

    The whole row is loaded at once (BLOCK_N >= n_cols), the "fused softmax" of the Triton
    tutorials: S is read once and P written once, as the textbook traffic count assumes.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    s = tl.load(S + row * stride_s_row + cols, mask=cols < n_cols, other=float("-inf"))
    m = tl.max(s, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a fully masked row: avoid (-inf) - (-inf) = nan
    e = tl.exp(s - m)
    total = tl.sum(e, axis=0)
    p = e / tl.where(total == 0.0, 1.0, total)  # fully masked row -> zeros, like the reference
    tl.store(P + row * stride_p_row + cols, p.to(P.dtype.element_ty), mask=cols < n_cols)
    tl.store(LSE + row, m + tl.log(total))  # log(0) = -inf for a fully masked row


def row_softmax(scores: torch.Tensor, out_dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 2: softmax over the last dim of ``scores: [..., kv_len]`` (fp32).

    Returns ``(P, lse)``: ``P`` has the shape of ``scores`` and dtype ``out_dtype`` (the
    attention's input dtype: P feeds a tensor-core matmul next), ``lse: [...]`` float32.
    """
    n_cols = scores.shape[-1]
    if scores.stride(-1) != 1:
        raise ValueError("scores must be contiguous in the last dim")
    rows = scores.numel() // n_cols
    out_dtype = out_dtype or scores.dtype
    if out is None:
        out = torch.empty(scores.shape, device=scores.device, dtype=out_dtype)
    if lse is None:
        lse = torch.empty(scores.shape[:-1], device=scores.device, dtype=torch.float32)
    BLOCK_N = power_of_2_at_least(n_cols)
    if BLOCK_N > 65536:
        raise ValueError(f"row_softmax keeps a whole row on chip; kv_len={n_cols} > 65536 is not supported")
    # Enough threads that each holds ~32 elements of the row in registers (Triton caps at 32 warps).
    num_warps = min(32, max(4, BLOCK_N // (32 * 32)))
    _softmax_kernel[(rows,)](
        scores, out, lse, _row_stride(scores), _row_stride(out), n_cols,
        BLOCK_N=BLOCK_N, num_warps=num_warps,
    )
    return out, lse


# ----------------------------------------------------------------------------------------
# Pass 3: O = P V
# ----------------------------------------------------------------------------------------
@triton.jit
def _pv_kernel(
    P, V, O,
    stride_pb, stride_ph, stride_pm, stride_pn,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    q_heads, q_len, kv_len, head_dim, group_size,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program computes a [BLOCK_M, head_dim] tile of O, looping over kv_len."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // q_heads).to(tl.int64), (pid_bh % q_heads).to(tl.int64)  # int64: P is huge
    kv_h = h // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_m, in_d = offs_m < q_len, offs_d < head_dim
    p_ptrs = P + b * stride_pb + h * stride_ph + offs_m[:, None] * stride_pm
    v_ptrs = V + b * stride_vb + kv_h * stride_vh + offs_d[None, :] * stride_vd

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_n = offs_n < kv_len
        p = tl.load(p_ptrs + offs_n[None, :] * stride_pn, mask=in_m[:, None] & in_n[None, :], other=0.0)
        v = tl.load(v_ptrs + offs_n[:, None] * stride_vn, mask=in_n[:, None] & in_d[None, :], other=0.0)
        acc += tl.dot(p, v, input_precision=DOT_PRECISION)

    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             acc.to(O.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])


def probs_times_values(p: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 3: ``O = P V``. ``p: [batch, q_heads, q_len, kv_len]``, ``v: [batch, kv_heads, kv_len, head_dim]``
    -> ``O: [batch, q_heads, q_len, head_dim]`` in ``v``'s dtype."""
    batch, q_heads, q_len, kv_len = p.shape
    _, kv_heads, _, head_dim = v.shape
    _check_gqa(q_heads, kv_heads)
    if out is None:
        out = torch.empty(batch, q_heads, q_len, head_dim, device=v.device, dtype=v.dtype)
    BLOCK_M, BLOCK_N = 64, 64
    grid = (triton.cdiv(q_len, BLOCK_M), batch * q_heads)
    _pv_kernel[grid](
        p, v, out, *p.stride(), *v.stride(), *out.stride(),
        q_heads, q_len, kv_len, head_dim, q_heads // kv_heads,
        DOT_PRECISION=dot_precision(v.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d(head_dim),
        num_warps=4, num_stages=3,
    )
    return out


# ----------------------------------------------------------------------------------------
# The whole algorithm, and its memory-traffic count
# ----------------------------------------------------------------------------------------
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, window: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard attention in three kernel launches; returns ``(out, lse)`` like the reference.

    Peak extra memory is S (fp32) plus P (input dtype): ``batch·q_heads·q_len·kv_len·(4 + e)``
    bytes, which is what makes this algorithm run out of memory at long sequence lengths.
    """
    scores = attention_scores(q, k, causal=causal, scale=scale, window=window)
    probs, lse = row_softmax(scores, out_dtype=v.dtype)
    del scores  # free S before allocating O: only S or P need be alive with the output
    return probs_times_values(probs, v), lse


def _row_stride(t: torch.Tensor) -> int:
    # Rows of a [..., n] tensor must be equally spaced for the flattened row index to work.
    flat = t.reshape(-1, t.shape[-1])
    if flat.data_ptr() != t.data_ptr():
        raise ValueError("tensor must be viewable as [rows, n] without a copy")
    return flat.stride(0)


def _check_gqa(q_heads: int, kv_heads: int) -> None:
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (MHA/GQA/MQA)")
