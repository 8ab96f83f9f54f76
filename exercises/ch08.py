"""Chapter 8 exercises: the decode-time linear layer. Grade your work with ``make grade CH=8``.

Replace each ``raise NotImplementedError(...)`` with your implementation, in plain Python and
NumPy. The tests compare your code with the float64 references in
`minillm.reference.ch08_flat_gemm` and with `minillm.kernels.ch08_flat_gemm.find_inflection_points`, on
fresh random inputs whose sizes are rarely multiples of the tiles (ragged last tiles).

The layout is ``nn.Linear``'s: ``x: [M, K]`` (one row per token of the batch), ``w: [N, K]``
(one row per output feature) and ``y = x @ w.T: [M, N]``. The kernels keep their running
sums in fp32 registers whatever the input dtype; here that means accumulating in
``np.float32`` arrays.
"""
from __future__ import annotations

import numpy as np

__all__ = ["gemv_tiles", "find_inflection_points", "flat_gemm_tile"]


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
