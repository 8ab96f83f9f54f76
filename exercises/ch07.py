"""Chapter 7 exercises: flash-decoding. Grade your work with ``make grade CH=7``.

Replace each ``raise NotImplementedError(...)`` with your implementation, in plain Python and
NumPy. The tests compare your code with the float64 references in
`minillm.reference.ch07_flash_decoding` and with the split heuristics of
`minillm.kernels.ch07_flash_decoding`, on fresh random inputs.

The setting: one new query per sequence attends to the sequence's cached keys. Flash-decoding
cuts the keys into **splits**, computes for each split its *partial result* (the output
normalised over that split's keys, ``o_s``, and their log-sum-exp, ``lse_s = log Σ e^x``),
then merges the splits. A split with no keys has ``o_s = 0`` and ``lse_s = -inf``. Scores are
the scaled dot products ``x = q·k · scale`` with ``scale = 1/sqrt(head_dim)`` by default; all
logarithms are natural.
"""
from __future__ import annotations

import numpy as np

__all__ = ["merge_splits", "fa2_num_splits", "split_partial"]


def merge_splits(o: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 7.1 — merge the partial results of ``S`` splits (stage 2 of flash-decoding).

    ``o: [..., S, head_dim]`` the partial outputs, ``lse: [..., S]`` their log-sum-exps (any
    leading axes: a batch, heads, ...). Return ``(out [..., head_dim], lse [...])``, the
    attention output and log-sum-exp over the keys of all splits together.

    - Split ``s`` carries the weight ``e^{lse_s}`` out of ``Σ_t e^{lse_t}``; compute the
      weights relative to ``M = max_s lse_s`` so that nothing overflows (lse values of ±1000
      occur in the tests).
    - An empty split (``lse_s = -inf``) weighs nothing, **whatever its ``o_s``** (the tests
      put NaN there: ``0 · NaN`` is NaN, so do not multiply it in).
    - A row whose splits are all empty gives ``out = 0`` and ``lse = -inf``, without NaN
      (``-inf - (-inf)`` is NaN: where ``M = -inf``, subtract 0 instead).
    """
    raise NotImplementedError("Exercise 7.1 (merge_splits): not started. Read its docstring; hints: python -m minillm.grade 7 --hint 7.1")


def fa2_num_splits(batch_heads: int, n_blocks: int, num_sms: int, max_splits: int = 128) -> int:
    """Exercise 7.2 — FlashAttention-2's choice of the number of splits.

    ``batch_heads``: programs the kernel runs without splitting; ``n_blocks``: key blocks of
    the longest sequence; ``num_sms``: programs that run at once (one wave). The rule of
    ``num_splits_heuristic`` in FlashAttention-2's ``flash_api.cpp``:

    1. If ``batch_heads >= 0.8 · num_sms``, the GPU is (nearly) full already: return 1.
    2. Otherwise consider ``s = 1 … min(max_splits, num_sms, n_blocks)``. ``s`` is *eligible*
       if ``s == 1`` or ``⌈n_blocks / s⌉ != ⌈n_blocks / (s - 1)⌉`` (if ``s`` splits get as
       many blocks each as ``s - 1`` splits, the last one is empty: it is ``s - 1`` splits in
       disguise). An eligible ``s`` runs ``w = batch_heads · s / num_sms`` waves and its
       *efficiency* is ``w / ⌈w⌉``, the occupied fraction of the waves it needs.
    3. Return the smallest eligible ``s`` whose efficiency is at least ``0.85 ×`` the best
       efficiency of any eligible ``s`` (fewer splits merge faster), or 1 if none.

    Compute as the C++ does, or exact ties will come out differently: the waves and
    efficiencies are ``float`` (single precision: ``np.float32(batch_heads * s) /
    np.float32(num_sms)``, then ``w / np.float32(ceil(w))``; step 1 compares with
    ``np.float32(0.8) * np.float32(num_sms)``), while ``0.85 · best`` is a double
    (``float(eff) >= 0.85 * float(best)``). One test is such a tie: 41 programs, 40
    blocks, 100 SMs, where the answer is 7 in float32 and 2 in double.
    """
    raise NotImplementedError("Exercise 7.2 (fa2_num_splits): not started. Read its docstring; hints: python -m minillm.grade 7 --hint 7.2")


def split_partial(q: np.ndarray, k, v, seq_len: int, start: int, end: int, block_n: int,
                  scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exercise 7.3 — stage 1 of flash-decoding for one split: the kernel's inner loop.

    ``q: [rows, head_dim]``, the queries of the heads that share one KV head (a GQA group);
    ``k, v``: that KV head's keys and values of one sequence, ``[n, head_dim]`` with
    ``n >= seq_len`` (rows ``>= seq_len`` hold no token); the split covers key positions
    ``start … min(end, seq_len) - 1`` (``start`` is a multiple of ``block_n``; ``end`` may
    lie past the sequence; a split starting at or past ``seq_len`` is empty).

    Walk the split in tiles of ``block_n`` positions, as a kernel program does: tile ``i``
    covers ``start + i·block_n …``, the last one cut at ``min(end, seq_len)`` (ragged). Read
    each tile of keys and values once, as a slice ``k[a:b]``, ``v[a:b]`` (the tests record
    your reads: only slices of at most ``block_n`` rows starting at a tile's first position,
    nothing outside the split, no conversion of the whole ``k`` to an array), and keep
    Chapter 3's online softmax per row: running max ``m``, running sum ``l`` of ``e^{x - m}``
    and the unnormalised output ``acc``, rescaled by ``e^{m_old - m_new}`` when the max grows.

    Return ``(o [rows, head_dim], lse [rows])``: ``o = acc / l`` and ``lse = m + log l``; an
    empty split gives ``o = 0`` and ``lse = -inf``.
    """
    raise NotImplementedError("Exercise 7.3 (split_partial): not started. Read its docstring; hints: python -m minillm.grade 7 --hint 7.3")
