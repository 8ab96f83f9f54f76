"""Chapter 3: softmax of rows too long to hold on chip, with the online softmax.

Chapter 1's `row_softmax` loads a whole row into registers, takes its max, then its sum,
then writes ``exp(x - max) / sum``: one read and one write of the row, but only up to the
row length that fits (64k elements there). A longer row has to be streamed in blocks, and
then the textbook recipe needs **three** sweeps over it: one for the max, one for the sum
of ``exp(x - max)`` (which needs the *final* max), one to write the output.

The online softmax merges the first two. One sweep keeps a running max ``m`` and a running
sum ``ℓ`` of ``exp(x - m)``; when a block raises the max from ``m`` to ``m_new``, the sum
so far is rescaled by ``exp(m - m_new)`` (see `minillm.reference.online_softmax`). So
"single pass" means *one pass for the statistics instead of two*. The output still needs
its own sweep: every ``exp(x - m) / ℓ`` depends on the final ``m`` and ``ℓ``, known only
after the last element was read. Traffic per row: **2 reads + 1 write** (three-pass
softmax: 3 reads + 1 write; the whole row in registers: 1 read + 1 write).

When the row fits in one block the kernel takes that last path (``ONE_TILE``): the row is
read once, kept in registers, and the output written from them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
        block_n = triton.next_power_of_2(n_cols) if one_tile else STREAM_BLOCK
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


def online_softmax_traffic(rows: int, n_cols: int, in_bytes: int, out_bytes: int | None = None,
                           block_n: int | None = None) -> dict[str, int]:
    """HBM bytes one `online_softmax` call moves: ``{"read", "write", "minimal"}``.

    A streamed row is read twice (statistics, then output) and written once; a row that fits
    in one block (``n_cols <= block_n``, default `MAX_ONE_TILE`) is read once. Each row also
    writes its fp32 lse. ``minimal`` is what any softmax must move: read once, write once."""
    out_bytes = in_bytes if out_bytes is None else out_bytes
    one_tile = n_cols <= (MAX_ONE_TILE if block_n is None else block_n)
    elems = rows * n_cols
    write = elems * out_bytes + rows * 4
    return {"read": elems * in_bytes * (1 if one_tile else 2), "write": write,
            "minimal": elems * in_bytes + write}


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
