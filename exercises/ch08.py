"""Chapter 8 exercises: the decode-time linear layer. Grade your work with ``make grade CH=8``.

Replace each ``raise NotImplementedError(...)`` with your implementation: in plain Python and
NumPy for Exercises 8.1-8.3; Exercises 8.4 and 8.5 are the Triton kernels of 8.1 and 8.3,
whose launchers are written for you (write the kernel's body, then delete the launcher's
``raise``). The tests compare your code with the float64 references in
`minillm.reference.ch08_flat_gemm` and with `minillm.kernels.ch08_flat_gemm.find_inflection_points`, on
fresh random inputs whose sizes are rarely multiples of the tiles (ragged last tiles).

The layout is ``nn.Linear``'s: ``x: [M, K]`` (one row per token of the batch), ``w: [N, K]``
(one row per output feature) and ``y = x @ w.T: [M, N]``. The kernels keep their running
sums in fp32 registers whatever the input dtype; here that means accumulating in
``np.float32`` arrays.
"""
from __future__ import annotations

import math

import numpy as np
import torch

# First, before Triton: without a GPU, this selects Triton's interpreter.
from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)

__all__ = ["gemv_tiles", "find_inflection_points", "flat_gemm_tile", "gemv", "flat_gemm"]


def gemv_tiles(x: np.ndarray, w, block_n: int, block_k: int) -> np.ndarray:
    """Exercise 8.1 — the GEMV kernel's reduction, tile by tile.

    The kernel runs one program per block of ``block_n`` output features: rows ``n0 … n0 +
    block_n − 1`` of ``w`` (``n0`` a multiple of ``block_n``; the last block may be
    shorter). A program walks K in tiles of ``block_k`` (``k0`` a multiple of ``block_k``;
    the last tile may be shorter). At each step it reads **one** tile of weights,
    ``w[n0:n1, k0:k1]``, and for every row of ``x`` multiplies that row's ``x[m, k0:k1]``
    elementwise with each of the tile's rows and sums along K, adding the sums into its
    float32 accumulator ``[M, n1 − n0]``. When K is done, the accumulator is columns
    ``n0:n1`` of ``y``.

    ``x: [M, K]`` is a NumPy array. ``w: [N, K]`` is an object that records what you read:
    use ``w.shape`` and read it only by slicing tiles, ``w[n0:n1, k0:k1]`` (which returns a
    NumPy array); do not convert it whole (that reads every weight at once). The tests
    check that every weight is read exactly once, in tiles of at most ``block_n x
    block_k`` aligned to those multiples: streaming the weights once is the whole point of
    the kernel. Return ``y: [M, N]`` as float32.
    """
    raise NotImplementedError("Exercise 8.1 (gemv_tiles): not started. Read its docstring; hints: python -m minillm.grade 8 --hint 8.1")


def find_inflection_points(ms, t_gemv, t_flat, t_cublas, tolerance: float = 0.02) -> tuple[int, int]:
    """Exercise 8.2 — the heuristic dataflow's thresholds ``(M1, M2)`` from a sweep.

    ``ms``: the batch sizes measured, increasing; ``t_gemv``, ``t_flat``, ``t_cublas``: each
    kernel's time at each of them (lists of the same length). A time that is ``None``, NaN
    or infinite means "not measured here" (the GEMV is only timed for small M): that
    kernel can never be chosen at that M.

    A dispatch ``(M1, M2)`` with ``M1 <= M2`` runs the GEMV for ``M <= M1``, the flat GEMM
    for ``M1 < M <= M2`` and cuBLAS beyond; 0 means "never" (``(0, 0)`` is cuBLAS
    everywhere). The candidates are every ``M1`` in ``[0] + ms`` with every ``M2`` in
    ``[M1] + [m for m in ms if m > M1]``. A candidate's **regret** is::

        Σ over the M of ms:  max(0, t_chosen(M) / t_best(M) − 1 − tolerance)

    where ``t_best(M)`` is the fastest measured time at M (skip an M where nothing was
    measured) and ``t_chosen(M)`` the time of the kernel the candidate picks there
    (infinite regret if that kernel was not measured at M). Return the candidate of least
    regret; among candidates whose regret is within 1e-12 of the least, the one with the
    largest M1, and among those the largest M2 (so a kernel within ``tolerance`` of the
    best keeps its M). Raise ``ValueError`` if ``ms`` is not increasing, if the lists have
    different lengths, or if every candidate has infinite regret. Return Python ints.
    """
    raise NotImplementedError("Exercise 8.2 (find_inflection_points): not started. Read its docstring; hints: python -m minillm.grade 8 --hint 8.2")


def flat_gemm_tile(x: np.ndarray, w: np.ndarray, pid_m: int, pid_n: int, out: np.ndarray, block_m: int = 16,
                   block_n: int = 32, block_k: int = 32, split_k: int = 1) -> np.ndarray:
    """Exercise 8.3 — one program of the flat GEMM: an output tile over K, with split-K.

    Program ``(pid_m, pid_n)`` owns output rows ``m0 = pid_m·block_m … m0 + block_m − 1``
    and features ``n0 = pid_n·block_n … n0 + block_n − 1`` of ``y = x @ w.T`` (``x: [M, K]``,
    ``w: [N, K]``). Its registers hold a **full** ``[block_m, block_n]`` float32 tile even
    when fewer rows or features remain (a tensor core multiplies whole tiles: that is the
    padding): rows past M and features past N are **zeros** in its operand tiles, and so
    is the part of the last K tile past K.

    Split-K: the ``ceil(K / block_k)`` tiles of K are dealt to ``split_k`` runs of
    ``ceil(tiles / split_k)`` consecutive tiles (the last runs shorter, possibly empty),
    as `minillm.reference.ch08_flat_gemm.split_k_ranges` computes. Each run accumulates its
    own partial tile, ``Σ x_tile @ w_tileᵀ`` over its K tiles, in float32.

    Return ``partials: [split_k, block_m, block_n]`` (float32, one per run, padding
    included). Then write the tile's result, the partials added in run order (run 0
    first), into ``out: [M, N]`` **in place** — only its real rows and features: the
    padding is computed and thrown away, and nothing else of ``out`` may change.
    """
    raise NotImplementedError("Exercise 8.3 (flat_gemm_tile): not started. Read its docstring; hints: python -m minillm.grade 8 --hint 8.3")


# == Exercise 8.4: the GEMV kernel ================================================================

@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Exercise 8.4 — Exercise 8.1 as a Triton kernel: program ``pid`` computes output
    features ``pid·BLOCK_N … pid·BLOCK_N + BLOCK_N - 1`` for every row of ``x``.

    - ``X: [M, K]``, ``W: [N, K]`` contiguous (fp32, fp16 or bf16); ``Y: [M, N]`` float32,
      contiguous;
    - ``BLOCK_M`` is ``M`` rounded up to a power of two (``M`` is a decode batch: small);
      ``BLOCK_N``, ``BLOCK_K`` are powers of two; ``N`` and ``K`` need not be multiples of
      them (mask the ragged tiles; the padding must add nothing).

    Walk K in tiles of ``BLOCK_K``: load the ``[BLOCK_N, BLOCK_K]`` tile of ``W`` (each weight
    once) and the ``[BLOCK_M, BLOCK_K]`` tile of ``X``, and add their products summed along K
    into a float32 accumulator ``[BLOCK_M, BLOCK_N]``, elementwise with broadcasting (a
    ``[BLOCK_M, 1, BLOCK_K]`` times a ``[1, BLOCK_N, BLOCK_K]``, then ``tl.sum`` over the last
    axis): no ``tl.dot``, which needs 16 rows. Compute in float32 (``.to(tl.float32)``).
    """
    pass


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 32) -> torch.Tensor:
    """Exercise 8.4 — ``y = x @ w.T`` for a small ``M`` (the launcher; the exercise is the
    kernel above). ``x: [M, K]`` (``M <= 16``), ``w: [N, K]``; returns ``y: [M, N]`` float32.
    One program per block of ``block_n`` output features."""
    raise NotImplementedError("Exercise 8.4 (_gemv_kernel): not started. Read its docstring; hints: python -m minillm.grade 8 --hint 8.4")
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
    """Exercise 8.5 — Exercise 8.3 as a Triton kernel: program ``(pid_m, pid_n, pid_k)``
    computes the ``[BLOCK_M, BLOCK_N]`` output tile ``(pid_m, pid_n)`` over its slice of K,
    ``[pid_k · k_span, min((pid_k + 1) · k_span, K))`` (``k_span`` is a whole number of
    ``BLOCK_K`` tiles; the last slices may be short or empty), and **adds** it into ``Y``.

    - ``X: [M, K]``, ``W: [N, K]`` contiguous; ``Y: [M, N]`` float32, zero on entry;
    - ``BLOCK_M = 16`` (``tl.dot``'s minimum): rows of ``X`` past ``M`` are padding, loaded as
      zeros and never stored; ``N`` and ``K`` are not multiples of the tiles either;
    - ``IEEE``: fp32 inputs, pass ``input_precision="ieee"`` to ``tl.dot``.

    Each K step is a tensor-core product ``x_tile @ w_tileᵀ`` accumulated in a float32
    ``[BLOCK_M, BLOCK_N]`` register tile (``tl.dot(a, b, acc)``). Several programs (one per
    slice) add to the same outputs at once, so the final add must be atomic
    (``tl.atomic_add``): a plain store keeps only one slice's sum.
    """
    pass


def flat_gemm(x: torch.Tensor, w: torch.Tensor, split_k: int = 1, block_n: int = 32, block_k: int = 32
              ) -> torch.Tensor:
    """Exercise 8.5 — ``y = x @ w.T`` with split-K (the launcher; the exercise is the kernel
    above). ``x: [M, K]``, ``w: [N, K]`` (fp32, fp16 or bf16); returns ``y: [M, N]`` float32.
    One program per (tile of 16 rows, tile of ``block_n`` features, slice of K)."""
    raise NotImplementedError("Exercise 8.5 (_flat_gemm_kernel): not started. Read its docstring; hints: python -m minillm.grade 8 --hint 8.5")
    (M, K), N = x.shape, w.shape[0]
    x, w = x.contiguous(), w.contiguous()
    y = torch.zeros(M, N, device=x.device, dtype=torch.float32)        # the slices add into it
    k_span = triton.cdiv(triton.cdiv(K, block_k), split_k) * block_k     # whole K tiles per slice
    grid = (triton.cdiv(M, 16), triton.cdiv(N, block_n), split_k)
    _flat_gemm_kernel[grid](x, w, y, M, N, K, k_span, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                            IEEE=x.dtype == torch.float32)
    return y
