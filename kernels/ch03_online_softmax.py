"""Chapter 3: softmax of rows too long to hold on chip, with the online softmax.

The notebook ``chapters/03_online_softmax.ipynb`` tells the chapter's story with its measurements;
this docstring summarises what the code does.

Chapter 1's `row_softmax` loads a whole row into registers, takes its max, then its sum,
then writes ``exp(x - max) / sum``: one read and one write of the row, but only up to the
row length that fits (64k elements there). A longer row has to be streamed in blocks, and
then the textbook recipe needs **three** sweeps over it: one for the max, one for the sum
of ``exp(x - max)`` (which needs the *final* max), one to write the output.

The online softmax merges the first two. One sweep keeps a running max ``m`` and a running
sum ``ℓ`` of ``exp(x - m)``; when a block raises the max from ``m`` to ``m_new``, the sum
so far is rescaled by ``exp(m - m_new)`` (see `minillm.reference.ch03_online_softmax`). So
"single pass" means *one pass for the statistics instead of two*. The output still needs
its own sweep: every ``exp(x - m) / ℓ`` depends on the final ``m`` and ``ℓ``, known only
after the last element was read. Traffic per row: **2 reads + 1 write** (three-pass
softmax: 3 reads + 1 write; the whole row in registers: 1 read + 1 write).

When the row fits in one block the kernel takes that last path (``ONE_TILE``): the row is
read once, kept in registers, and the output written from them.

The second half of the module is attention in FlashAttention-1's loop order
(`tiled_attention`), the online softmax applied to tiles of scores.
"""
from __future__ import annotations

import torch
from minillm.kernels.base import (  # Triton as this machine runs it, and the shared helpers
    tl, triton,
    LN2_C, LOG2E, block_d, dot_precision, online_softmax_update, power_of_2_at_least, scale_and_window,
)

#: Rows up to this many elements are kept in registers (one read); longer rows are streamed.
MAX_ONE_TILE = 8192
#: Block of a streamed row: 4096 elements (16 KB of fp32) per iteration over 8 warps.
STREAM_BLOCK = 4096


@triton.jit
def _online_softmax_kernel(
    X, Y, LSE,
    stride_x_row, stride_y_row, stride_lse, n_cols,
    BLOCK_N: tl.constexpr, ONE_TILE: tl.constexpr,
):
    """Program ``r``: softmax of row ``r`` of the ``[rows, n_cols]`` matrix ``X`` into ``Y``,
    and its log-sum-exp into ``LSE[r]``. All arithmetic is fp32."""
    row = tl.program_id(0).to(tl.int64)  # int64: rows x cols passes 2^31 (8192 rows of 256k)
    x_row = X + row * stride_x_row
    y_row = Y + row * stride_y_row
    cols = tl.arange(0, BLOCK_N)

    if ONE_TILE:
        # The whole row in registers: read once, write once (Chapter 1's fused softmax).
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf row: avoid -inf - (-inf)
        e = tl.exp(x - m_safe)
        l = tl.sum(e, axis=0)
        y = e / tl.where(l == 0.0, 1.0, l)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=cols < n_cols)
    else:
        # Sweep 1: the statistics, one block at a time. m and l are scalars carried by the
        # loop; each block costs one exp per element plus one rescale of l.
        m = tl.full((), float("-inf"), dtype=tl.float32)
        l = tl.zeros((), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            offs = start + cols
            x = tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            # exp(m - m_safe): the rescale of everything summed so far (0 on the first block,
            # where m = -inf; 1 when this block did not raise the max).
            l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
            m = m_new
        # Sweep 2: the output, which needs the final m and l.
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        inv_l = 1.0 / tl.where(l == 0.0, 1.0, l)  # all -inf row: l = 0 -> zeros, like the reference
        for start in range(0, n_cols, BLOCK_N):
            offs = start + cols
            x = tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
            tl.store(y_row + offs, (tl.exp(x - m_safe) * inv_l).to(Y.dtype.element_ty), mask=offs < n_cols)
    tl.store(LSE + row * stride_lse, m + tl.log(l))  # log(0) = -inf for an all -inf row


def online_softmax(x: torch.Tensor, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None, block_n: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of ``x: [..., n]`` for any ``n``; returns ``(y, lse)``.

    - ``y``: shaped like ``x``, dtype ``out_dtype`` (default ``x.dtype``), written into
      ``out`` if given (rows must be equally spaced, last dim contiguous, as for ``x``);
    - ``lse: [...]`` float32, ``log Σ exp(x)`` of each row (``-inf`` for an all ``-inf``
      row, whose ``y`` is zeros), written into ``lse`` if given (viewable as ``[rows]``).

    ``block_n`` (a power of two) overrides the block size: rows of at most ``block_n``
    elements take the one-read path, longer rows are streamed ``block_n`` at a time. By
    default rows up to `MAX_ONE_TILE` stay in registers and longer ones stream in blocks of
    `STREAM_BLOCK`. One program per row.
    """
    n_cols = x.shape[-1]
    if n_cols == 0:
        raise ValueError("softmax over an empty last dim")
    out_dtype = out_dtype or x.dtype
    if out is None:
        out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    if lse is None:
        lse = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    if out.shape != x.shape or lse.shape != x.shape[:-1]:
        raise ValueError(f"out {tuple(out.shape)} / lse {tuple(lse.shape)} do not match x {tuple(x.shape)}")
    rows = x.numel() // n_cols
    if rows == 0:
        return out, lse
    if block_n is None:
        one_tile = n_cols <= MAX_ONE_TILE
        block_n = power_of_2_at_least(n_cols) if one_tile else STREAM_BLOCK
    else:
        if block_n < 1 or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two, got {block_n}")
        one_tile = n_cols <= block_n
    # ~16 elements per thread: 4 warps for small blocks, up to 16 for an 8192-element row.
    num_warps = min(16, max(4, block_n // 512))
    try:
        lse_flat = lse.view(rows)  # a view, so that the kernel writes into lse itself
    except RuntimeError:
        raise ValueError(f"lse of strides {lse.stride()} cannot be viewed as [rows]") from None
    _online_softmax_kernel[(rows,)](
        x, out, lse_flat, _row_stride(x), _row_stride(out), lse_flat.stride(0), n_cols,
        BLOCK_N=block_n, ONE_TILE=one_tile, num_warps=num_warps,
    )
    return out, lse


def _row_stride(t: torch.Tensor) -> int:
    # Rows of a [..., n] tensor must be equally spaced, with the last dim contiguous, for the
    # flattened row index of the kernel to address them without a copy.
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError("the last dim must be contiguous")
    try:
        return t.view(-1, t.shape[-1]).stride(0)
    except RuntimeError:
        raise ValueError(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} cannot be "
                         "viewed as [rows, n] without a copy") from None


# ========================================================================================
# Chapter 3: attention in FlashAttention-1's loop order, as one Triton kernel.
#
# Chapter 1 wrote the ``N × N`` scores and probabilities to HBM and read them back. Tiling
# with the online softmax removes them: a tile of scores ``S_ij = Q_i K_jᵀ`` is computed on
# chip, folded into the running output of its query rows, and dropped. What must survive
# between tiles is only, per query row, the running output ``O``, max ``m`` and sum ``ℓ``.
#
# FlashAttention-1 (Dao et al. 2022, Algorithm 1) orders the loops **K/V outer, Q inner**:
#
#     for each (batch, query head)                       <- one program each
#         for j over K/V blocks:                         <- outer
#             load K_j, V_j (they stay on chip for the whole inner loop)
#             for i over Q blocks:                       <- inner
#                 load Q_i and the running O_i, ℓ_i, m_i from HBM
#                 fold S_ij into them (online softmax, `minillm.reference.ch03_online_softmax.tile_step`)
#                 store O_i, ℓ_i, m_i back to HBM
#
# K and V are read once, but every query row's state makes a round trip through HBM on every
# outer iteration: ``Tc = ⌈kv_len / BLOCK_N⌉`` reads of Q and ``Tc - 1`` round trips of O
# (fp32, as the original implementation's ``o_tmp``), ℓ and m. That is the traffic that
# FlashAttention-2 (Chapter 4) removes by swapping the loops: with Q outer, a row block's state
# lives in registers from its first tile to its last and is written once. The exact count is
# `minillm.costs.fa1_traffic` (see `minillm.costs.tiled_attention_traffic`).
#
# Two savings the paper's pseudo-code leaves out, both visible below as load/store masks: on the first
# outer iteration the state is known (``O = 0, ℓ = 0, m = -inf``) and not read, and on the
# last one the finished rows go straight to ``out`` (input dtype) and ``lse`` instead of the
# workspace. Every tile is computed, even a fully masked one (the causal/window mask only
# sets scores to ``-inf``); skipping them is one of Chapter 4's improvements.
#
# Parallelism: one program per (batch, query head), as in FlashAttention-1. With few heads
# and a short batch that is fewer programs than the GPU has SMs; FlashAttention-2 also splits
# the query rows across programs.
#
# Shapes: ``q: [batch, q_heads, q_len, head_dim]``, ``k, v: [batch, kv_heads, kv_len,
# head_dim]`` (any strides); GQA/MQA: query head ``h`` reads KV head ``h // (q_heads //
# kv_heads)``. Positions are bottom-right aligned as in `minillm.reference.ch01_naive_attention`.
# ========================================================================================
#: Default tile sizes (rows of Q, rows of K/V). Powers of two, as Triton needs; the paper's
#: SRAM-derived sizes (`minillm.reference.ch03_online_softmax.fa1_block_sizes`) are not.
FA1_BLOCK_M, FA1_BLOCK_N = 64, 64


@triton.jit
def _fa1_kernel(
    Q, K, V, Out, LSE, Oacc, Lacc, Macc,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    q_heads, q_len, kv_len, head_dim, group_size, qk_scale, window,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``b·q_heads + h``: the whole attention of query head ``h`` of sequence ``b``.

    ``Oacc: [batch·q_heads, q_len, head_dim]`` and ``Lacc, Macc: [batch·q_heads, q_len]``
    (fp32, contiguous) are the HBM home of the running state between outer iterations.
    ``qk_scale`` is the softmax scale times ``log2 e``: exponentials are base 2 (``2^x`` is
    what the GPU computes natively), so ``m`` is in log2 units and the lse is converted back."""
    pid = tl.program_id(0)
    # int64: the workspace and the inputs of long sequences pass 2^31 elements.
    b, h = (pid // q_heads).to(tl.int64), (pid % q_heads).to(tl.int64)
    kv_h = h // group_size  # GQA: this query head's KV head; nothing is copied
    acc_base = Oacc + pid.to(tl.int64) * q_len * head_dim
    stat_base = pid.to(tl.int64) * q_len

    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < head_dim
    n_kv_blocks = tl.cdiv(kv_len, BLOCK_N)

    for j in range(0, n_kv_blocks):                                    # outer: K/V blocks
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        in_n = offs_n < kv_len
        k = tl.load(K + b * stride_kb + kv_h * stride_kh + offs_n[:, None].to(tl.int64) * stride_kn
                    + offs_d[None, :] * stride_kd, mask=in_n[:, None] & in_d[None, :], other=0.0)
        v = tl.load(V + b * stride_vb + kv_h * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn
                    + offs_d[None, :] * stride_vd, mask=in_n[:, None] & in_d[None, :], other=0.0)
        # How many rows of state to read from the workspace (none on the first outer
        # iteration: the state is known), to write back to it, and to write out as final
        # (all of them on the last iteration). Folding the two conditions into row bounds
        # keeps them plain masks: a load or store whose mask is all false moves no data.
        rows_in = tl.where(j > 0, q_len, 0)
        rows_done = tl.where(j == n_kv_blocks - 1, q_len, 0)
        rows_back = q_len - rows_done

        for start_m in range(0, q_len, BLOCK_M):                       # inner: Q blocks
            offs_m = start_m + tl.arange(0, BLOCK_M)
            in_m = offs_m < q_len
            rows = offs_m.to(tl.int64)  # row offsets in int64 (x row strides can pass 2^31)
            q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm
                        + offs_d[None, :] * stride_qd, mask=in_m[:, None] & in_d[None, :], other=0.0)

            # The running state of these rows: from HBM, or (first iteration) its initial
            # value O = 0, ℓ = 0, m = -inf, which the masked-off loads return as `other`.
            acc_ptrs = acc_base + rows[:, None] * head_dim + offs_d[None, :]
            in_state = offs_m < rows_in
            o = tl.load(acc_ptrs, mask=in_state[:, None] & in_d[None, :], other=0.0)
            l = tl.load(Lacc + stat_base + offs_m, mask=in_state, other=0.0)
            m = tl.load(Macc + stat_base + offs_m, mask=in_state, other=float("-inf"))

            # fp32 inputs: exact fp32 products ("ieee"); fp16/bf16: tensor cores, fp32 accumulation.
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            s = s * qk_scale
            visible = in_n[None, :]
            q_pos = offs_m[:, None] + (kv_len - q_len)
            k_pos = offs_n[None, :]
            if CAUSAL:
                visible = visible & (k_pos <= q_pos)
            if USE_WINDOW:
                dist = q_pos - k_pos
                visible = visible & (dist < window) & (dist > -window)
            s = tl.where(visible, s, float("-inf"))

            # Online softmax (FA1's lines 10-12, with exp(S - m_new) in place of the paper's
            # exp(S - m̃)·exp(m̃ - m_new): the same numbers, one exp fewer per score): the new
            # max, p = 2^(s - m_new), alpha = 2^(m - m_new) (rescale of the old state), l_new.
            p, alpha, l_new, m_new = online_softmax_update(m, l, s, qk_scale, True)
            # P is rounded to the input dtype for the tensor-core dot, as in FlashAttention (fp32: a no-op).
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            # FA1 keeps O normalised: undo the old 1/ℓ, add the tile, divide by the new ℓ.
            o = (o * (l * alpha)[:, None] + pv) / tl.where(l_new == 0.0, 1.0, l_new)[:, None]

            # Back to HBM: the workspace, or (last iteration) the output and lse.
            back, done = offs_m < rows_back, offs_m < rows_done
            tl.store(acc_ptrs, o, mask=back[:, None] & in_d[None, :])
            tl.store(Lacc + stat_base + offs_m, l_new, mask=back)
            tl.store(Macc + stat_base + offs_m, m_new, mask=back)
            tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_om
                     + offs_d[None, :] * stride_od, o.to(Out.dtype.element_ty), mask=done[:, None] & in_d[None, :])
            tl.store(LSE + b * stride_lb + h * stride_lh + rows * stride_lm, (m_new + tl.math.log2(l_new)) * LN2_C,
                     mask=done)
        # The next outer iteration reads what this one wrote, possibly from other threads of
        # the program (the load and store layouts need not match): make the writes visible.
        tl.debug_barrier()


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, window: int | None = None, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, block_m: int = FA1_BLOCK_M, block_n: int = FA1_BLOCK_N,
                    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in FlashAttention-1's loop order; returns ``(out, lse)`` like
    `minillm.reference.ch01_naive_attention`.

    - ``out: [batch, q_heads, q_len, head_dim]`` in q's dtype, ``lse: [batch, q_heads,
      q_len]`` float32 (``-inf``, with a zero output row, for a query that sees no key);
      either may be given preallocated (any strides);
    - ``scale`` defaults to ``1/sqrt(head_dim)``; ``window=W``: only keys with
      ``|p - j| < W`` are visible (with ``causal``: the last ``W`` tokens);
    - ``block_m``/``block_n``: tile rows of Q and of K/V (powers of two, >= 16).

    Needs an fp32 workspace for the running ``O, ℓ, m`` between outer iterations:
    ``(o_acc [batch·q_heads, q_len, head_dim], l_acc, m_acc [batch·q_heads, q_len])``,
    contiguous. It is allocated here unless passed as ``workspace`` (to reuse it across
    calls); whatever it holds on entry is never read. None is needed when
    ``kv_len <= block_n`` (a single outer iteration).
    """
    batch, q_heads, q_len, head_dim = q.shape
    if k.dim() != 4 or v.shape != k.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads} (MHA/GQA/MQA)")
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {blk}")
    scale, window = scale_and_window(head_dim, scale, window)
    if out is None:
        out = torch.empty(batch, q_heads, q_len, head_dim, device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty(batch, q_heads, q_len, device=q.device, dtype=torch.float32)
    if batch * q_heads * q_len == 0:
        return out, lse
    if kv_len == 0:  # no key at all: every row is fully masked
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    if workspace is not None:
        o_acc, l_acc, m_acc = workspace
        if (tuple(o_acc.shape) != (batch * q_heads, q_len, head_dim) or tuple(l_acc.shape) != (batch * q_heads, q_len)
                or m_acc.shape != l_acc.shape or not all(t.is_contiguous() and t.dtype == torch.float32
                                                         for t in workspace)):
            raise ValueError("workspace must be contiguous fp32 (o_acc [batch·q_heads, q_len, head_dim], "
                             "l_acc, m_acc [batch·q_heads, q_len])")
    elif kv_len > block_n:  # more than one outer iteration: the state needs a home in HBM
        o_acc = torch.empty(batch * q_heads, q_len, head_dim, device=q.device, dtype=torch.float32)
        l_acc = torch.empty(batch * q_heads, q_len, device=q.device, dtype=torch.float32)
        m_acc = torch.empty_like(l_acc)
    else:                 # never touched (every workspace access is masked off)
        o_acc = l_acc = m_acc = torch.empty(1, device=q.device, dtype=torch.float32)
    bd = block_d(head_dim)  # tl.dot needs every dim >= 16
    _fa1_kernel[(batch * q_heads,)](
        q, k, v, out, lse, o_acc, l_acc, m_acc,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        q_heads, q_len, kv_len, head_dim, q_heads // kv_heads, scale * LOG2E, window or 0,
        CAUSAL=causal, USE_WINDOW=window is not None, DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=bd,
        num_warps=4 if bd <= 64 else 8, num_stages=1,
    )
    return out, lse
