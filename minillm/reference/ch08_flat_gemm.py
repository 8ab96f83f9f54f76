"""Chapter 8 reference: the decode-time linear layer and the tile schedules of its kernels, in NumPy.

A linear layer is ``y = x Wᵀ + b`` with ``x: [M, K]`` (one row per token of the batch),
``W: [N, K]`` (PyTorch's ``nn.Linear`` layout: one row per output feature) and ``y: [M, N]``.
At decode time ``M`` is the batch size, 1 to a few dozen, while ``N·K`` is millions of
weights: the weights are almost all the bytes, and each weight is used ``M`` times.

Everything here is float64 and written to be read next to the chapter:

- `linear`: the layer itself, the oracle of `minillm.kernels.ch08_flat_gemm`.
- `gemv_tiles`: the schedule of the GEMV kernel. Each program owns ``block_n`` output
  features for *all* ``M`` rows, streams its ``[block_n, block_k]`` tiles of ``W`` along
  ``K`` and multiplies each by the ``M`` rows of ``x``, reducing along ``K`` with a plain
  sum (CUDA cores, no matrix instruction, no padding of ``M``).
- `flat_gemm_tiles`: the schedule of the flat GEMM kernel. Each program owns an output tile
  ``[block_m, block_n]``; the rows of ``x`` are padded with zeros to a multiple of
  ``block_m`` (16, the smallest tile ``tl.dot`` accepts) and each step is a small matrix
  product ``x_tile @ w_tileᵀ``, what a tensor core does. The padding rows are computed and
  thrown away: `padding_waste` is the fraction of the tensor-core work they take.
- Both take ``split_k``: the ``K`` tiles are dealt to ``split_k`` programs in contiguous runs
  (`split_k_ranges`), each sums its run into a partial result, and the partials are added
  at the end, in split order (the kernels' second pass does the same).
- `arithmetic_intensity`: FLOPs per byte of a linear layer, ``≈ 2M / elem_bytes`` when the
  weights dominate the bytes; far below any GPU's ridge point at decode batch sizes.

Both tile models equal ``x @ w.T`` (up to float rounding): tiling changes the order of the
additions, never what is added. ``acc_dtype=np.float32`` mimics the kernels' fp32 registers.
"""
from __future__ import annotations

import math

import numpy as np

from minillm.costs import gemm_bytes, gemm_flops

__all__ = ["linear", "split_k_ranges", "gemv_tiles", "flat_gemm_tiles", "padding_waste", "arithmetic_intensity"]


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """``y = x wᵀ + b`` in float64: ``x: [..., K]``, ``w: [N, K]``, ``b: [N]`` or None;
    returns ``[..., N]``."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x {x.shape} and w {w.shape}: expected x [..., K] and w [N, K]")
    y = x @ w.T
    if b is not None:
        y = y + np.asarray(b, dtype=np.float64)
    return y


def split_k_ranges(K: int, block_k: int, split_k: int = 1) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` range of ``K`` that each of ``split_k`` programs reduces.

    The ``ceil(K / block_k)`` tiles of ``K`` are dealt out in contiguous runs of
    ``ceil(tiles / split_k)`` tiles, so every run starts on a tile boundary; only the last
    tile of ``K`` may be ragged, and the last runs may be shorter, or empty (``lo == hi``):
    e.g. 5 tiles over 4 programs is 2, 2, 1, 0. The kernels compute the same ranges.
    """
    if block_k < 1 or split_k < 1:
        raise ValueError(f"block_k and split_k must be >= 1, got {block_k} and {split_k}")
    tiles_per_split = -(-(-(-K // block_k)) // split_k)
    span = tiles_per_split * block_k
    return [(min(s * span, K), min((s + 1) * span, K)) for s in range(split_k)]


def gemv_tiles(x: np.ndarray, w: np.ndarray, block_n: int, block_k: int, split_k: int = 1,
               acc_dtype=np.float64) -> np.ndarray:
    """``x @ w.T`` computed as the GEMV kernel schedules it. ``x: [M, K]``, ``w: [N, K]``.

    One program per ``block_n`` output features (and per split): it walks its range of
    ``K`` in tiles of ``block_k``, loads the ``[block_n, block_k]`` tile of ``w`` (rows
    contiguous in memory: wide, coalesced loads) and, for each of the ``M`` rows of ``x``,
    multiplies elementwise and sums along ``K``. Its ``[M, block_n]`` partial sums stay in
    ``acc_dtype`` (fp32 registers in the kernel). The last row block and the last ``K``
    tile may be ragged; nothing is padded. Returns ``[M, N]`` in ``acc_dtype``.
    """
    x, w = _check(x, w)
    M, K = x.shape
    N = w.shape[0]
    y = np.zeros((M, N), dtype=acc_dtype)
    for n0 in range(0, N, block_n):                          # one program per row block (x split)
        rows = slice(n0, min(n0 + block_n, N))
        partials = []
        for lo, hi in split_k_ranges(K, block_k, split_k):
            acc = np.zeros((M, rows.stop - n0), dtype=acc_dtype)
            for k0 in range(lo, hi, block_k):
                cols = slice(k0, min(k0 + block_k, hi))
                w_tile = w[rows, cols].astype(acc_dtype)      # [block_n, block_k]: read once
                x_tile = x[:, cols].astype(acc_dtype)         # [M, block_k]
                # Each row of x times the whole tile, summed along K: no matrix instruction.
                acc += (x_tile[:, None, :] * w_tile[None, :, :]).sum(axis=-1, dtype=acc_dtype)
            partials.append(acc)
        y[:, rows] = _sum_in_order(partials, acc_dtype)
    return y


def flat_gemm_tiles(x: np.ndarray, w: np.ndarray, block_m: int = 16, block_n: int = 64, block_k: int = 64,
                    split_k: int = 1, acc_dtype=np.float64) -> np.ndarray:
    """``x @ w.T`` computed as the flat GEMM kernel schedules it. ``x: [M, K]``, ``w: [N, K]``.

    ``x`` is padded with zero rows to a multiple of ``block_m`` and ``w`` with zero rows
    to a multiple of ``block_n``; each program (M tile, N tile, split) accumulates its
    ``[block_m, block_n]`` tile over its ``K`` tiles as a matrix product of a ``[block_m,
    block_k]`` tile of ``x`` and the transpose of a ``[block_n, block_k]`` tile of ``w``
    (the ragged last ``K`` tile is zero-padded too, so every product has the full tile
    shape, as a tensor core's does). The partials of the splits are added in split order.
    Only the ``[M, N]`` corner of the padded result is returned: the padding rows and
    columns hold products of zeros and are dropped, never written.
    """
    x, w = _check(x, w)
    M, K = x.shape
    N = w.shape[0]
    m_pad, n_pad, k_pad = _round_up(M, block_m), _round_up(N, block_n), _round_up(K, block_k)
    xp = np.zeros((m_pad, k_pad), dtype=acc_dtype)
    xp[:M, :K] = x
    wp = np.zeros((n_pad, k_pad), dtype=acc_dtype)
    wp[:N, :K] = w
    y = np.zeros((m_pad, n_pad), dtype=acc_dtype)
    # The kernel's grid order: M tiles vary fastest, so the programs that share a tile of
    # w run side by side (the tile is read from HBM once and from L2 by the others).
    for n0 in range(0, n_pad, block_n):
        for m0 in range(0, m_pad, block_m):
            partials = []
            for lo, hi in split_k_ranges(K, block_k, split_k):
                acc = np.zeros((block_m, block_n), dtype=acc_dtype)
                for k0 in range(lo, hi, block_k):
                    acc += xp[m0:m0 + block_m, k0:k0 + block_k] @ wp[n0:n0 + block_n, k0:k0 + block_k].T
                partials.append(acc)
            y[m0:m0 + block_m, n0:n0 + block_n] = _sum_in_order(partials, acc_dtype)
    return y[:M, :N]


def padding_waste(M: int, block_m: int) -> float:
    """Fraction of a flat GEMM's tensor-core work spent on padding rows: ``1 − M / M_pad``
    with ``M_pad = ceil(M / block_m)·block_m``. E.g. a batch of 1 in tiles of 64 rows
    wastes 63/64 ≈ 98 %; in tiles of 16, 15/16 ≈ 94 %; in FlashDecoding++'s tiles of 8,
    7/8. (Wasted compute, not wasted bandwidth: the weights are read once either way.)"""
    if M < 1 or block_m < 1:
        raise ValueError(f"M and block_m must be >= 1, got {M} and {block_m}")
    return 1.0 - M / _round_up(M, block_m)


def arithmetic_intensity(M: int, N: int, K: int, elem_bytes: int = 2) -> float:
    """FLOP per byte of ``[M, K] @ [K, N]``: ``2MNK`` FLOPs over the ideal bytes
    ``(NK + MK + MN)·elem_bytes`` (`minillm.costs.gemm_flops` / `gemm_bytes`). When the
    weights dominate (``M ≪ N, K``) this is ``≈ 2M / elem_bytes``: 1 FLOP/byte per row of
    the batch in fp16, against a ridge point of a few hundred on a modern GPU."""
    return gemm_flops(M, N, K) / gemm_bytes(M, N, K, elem_bytes)


# ----------------------------------------------------------------------------------------
def _check(x, w) -> tuple[np.ndarray, np.ndarray]:
    x, w = np.asarray(x), np.asarray(w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {x.shape} and w {w.shape}: expected x [M, K] and w [N, K]")
    return x, w


def _round_up(n: int, block: int) -> int:
    return math.ceil(n / block) * block


def _sum_in_order(partials: list[np.ndarray], acc_dtype) -> np.ndarray:
    """The split-K combine: partials added one after the other, split 0 first (a fixed
    order, so the result does not depend on which program finished first)."""
    total = np.zeros_like(partials[0], dtype=acc_dtype)
    for p in partials:
        total += p
    return total
