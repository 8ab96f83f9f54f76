"""Chapter 8 solutions. Try the exercises in ``exercises/ch08.py`` first."""
from __future__ import annotations

import math

import numpy as np
import torch

# First, before Triton: without a GPU, this selects Triton's interpreter.
from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)


def gemv_tiles(x: np.ndarray, w, block_n: int, block_k: int) -> np.ndarray:
    """Exercise 8.1: each tile of w read once; every row of x multiplied by it and summed
    along K into a float32 accumulator per block of features."""
    x = np.asarray(x, dtype=np.float32)
    M = x.shape[0]
    N, K = w.shape
    y = np.zeros((M, N), dtype=np.float32)
    for n0 in range(0, N, block_n):
        n1 = min(n0 + block_n, N)
        acc = np.zeros((M, n1 - n0), dtype=np.float32)          # the program's registers
        for k0 in range(0, K, block_k):
            k1 = min(k0 + block_k, K)
            tile = np.asarray(w[n0:n1, k0:k1], dtype=np.float32)  # [features, K tile], read once
            # Every row of x times every row of the tile, summed along K: CUDA-core work.
            acc += (x[:, None, k0:k1] * tile[None, :, :]).sum(axis=-1, dtype=np.float32)
        y[:, n0:n1] = acc
    return y


def find_inflection_points(ms, t_gemv, t_flat, t_cublas, tolerance: float = 0.02) -> tuple[int, int]:
    """Exercise 8.2: every candidate (M1, M2), its regret beyond the tolerance, the least
    regret with ties to the largest thresholds."""
    ms = [int(m) for m in ms]
    if any(b <= a for a, b in zip(ms, ms[1:])):
        raise ValueError(f"ms must be increasing, got {ms}")

    def measured(t):
        return math.inf if t is None or not math.isfinite(float(t)) else float(t)

    times = [[measured(t) for t in ts] for ts in (t_gemv, t_flat, t_cublas)]
    if any(len(ts) != len(ms) for ts in times):
        raise ValueError("one time per batch size, for each kernel")
    best = [min(column) for column in zip(*times)]

    def regret(m1, m2):
        total = 0.0
        for i, m in enumerate(ms):
            if best[i] == math.inf:
                continue
            kernel = 0 if m <= m1 else 1 if m <= m2 else 2
            total += max(0.0, times[kernel][i] / best[i] - 1.0 - tolerance)
        return total

    candidates = {(m1, m2): regret(m1, m2) for m1 in [0] + ms for m2 in [m1] + [m for m in ms if m > m1]}
    least = min(candidates.values())
    if least == math.inf:
        raise ValueError("every dispatch chooses a kernel that was not measured somewhere")
    return max(pair for pair, r in candidates.items() if r <= least + 1e-12)


def flat_gemm_tile(x: np.ndarray, w: np.ndarray, pid_m: int, pid_n: int, out: np.ndarray, block_m: int = 16,
                   block_n: int = 32, block_k: int = 32, split_k: int = 1) -> np.ndarray:
    """Exercise 8.3: zero-padded operand tiles, one partial per run of K tiles, and only the
    real corner of the summed tile written."""
    M, K = x.shape
    N = w.shape[0]
    m0, n0 = pid_m * block_m, pid_n * block_n
    rows, cols = max(0, min(block_m, M - m0)), max(0, min(block_n, N - n0))
    k_tiles = -(-K // block_k)
    per_run = -(-k_tiles // split_k)
    partials = np.zeros((split_k, block_m, block_n), dtype=np.float32)
    for s in range(split_k):
        for t in range(s * per_run, min((s + 1) * per_run, k_tiles)):
            k0 = t * block_k
            width = min(block_k, K - k0)
            xt = np.zeros((block_m, block_k), dtype=np.float32)  # padding rows and columns: zeros
            wt = np.zeros((block_n, block_k), dtype=np.float32)
            xt[:rows, :width] = x[m0:m0 + rows, k0:k0 + width]
            wt[:cols, :width] = w[n0:n0 + cols, k0:k0 + width]
            partials[s] += xt @ wt.T
    total = np.zeros((block_m, block_n), dtype=np.float32)
    for s in range(split_k):                                    # in run order: reproducible
        total += partials[s]
    out[m0:m0 + rows, n0:n0 + cols] = total[:rows, :cols]
    return partials


# == Exercise 8.4: the GEMV kernel ================================================================

@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``pid``: output features ``pid·BLOCK_N …`` for all ``M`` rows, no tensor cores."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (offs_k < K)[None, :]
        w = tl.load(W + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n < N)[:, None] & k_ok, other=0.0)
        x = tl.load(X + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m < M)[:, None] & k_ok, other=0.0)
        # Every row of x times every row of the tile, summed along K: [BLOCK_M, BLOCK_N].
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(Y + offs_m[:, None] * N + offs_n[None, :], acc, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 32) -> torch.Tensor:
    """Exercise 8.4: one program per block of ``block_n`` output features."""
    (M, K), N = x.shape, w.shape[0]
    x, w = x.contiguous(), w.contiguous()
    y = torch.full((M, N), float("nan"), device=x.device, dtype=torch.float32)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, BLOCK_M=triton.next_power_of_2(M),
                                             BLOCK_N=block_n, BLOCK_K=block_k)
    return y


# == Exercise 8.5: the flat GEMM with split-K =====================================================

@triton.jit
def _flat_gemm_kernel(X, W, Y, M, N, K, k_span,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Program ``(pid_m, pid_n, pid_k)``: the ``[BLOCK_M, BLOCK_N]`` tile over K-slice ``pid_k``,
    added into ``Y`` atomically (the other slices add theirs)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = pid_k * k_span
    hi = tl.minimum(lo + k_span, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (offs_k < hi)[None, :]
        x = tl.load(X + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m < M)[:, None] & k_ok, other=0.0)
        w = tl.load(W + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n < N)[:, None] & k_ok, other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tl.atomic_add(Y + offs_m[:, None] * N + offs_n[None, :], acc, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def flat_gemm(x: torch.Tensor, w: torch.Tensor, split_k: int = 1, block_n: int = 32, block_k: int = 32
              ) -> torch.Tensor:
    """Exercise 8.5: one program per (M tile of 16, N tile, K-slice)."""
    (M, K), N = x.shape, w.shape[0]
    x, w = x.contiguous(), w.contiguous()
    y = torch.zeros(M, N, device=x.device, dtype=torch.float32)        # the slices add into it
    k_span = triton.cdiv(triton.cdiv(K, block_k), split_k) * block_k     # whole K tiles per slice
    grid = (triton.cdiv(M, 16), triton.cdiv(N, block_n), split_k)
    _flat_gemm_kernel[grid](x, w, y, M, N, K, k_span, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                            IEEE=x.dtype == torch.float32)
    return y
