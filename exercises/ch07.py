"""Chapter 7 exercises: flash-decoding. Grade your work with ``make grade CH=7``.

Replace each ``raise NotImplementedError(...)`` with your implementation: in plain Python and
NumPy for Exercises 7.1-7.3 and 7.6-7.8; Exercises 7.4 and 7.5 are the two Triton kernels of
flash-decoding, whose launchers are written for you (write the kernel's body, then delete the
launcher's ``raise``). The tests compare your code with the float64 references in
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

import math

import numpy as np
import torch

# First, before Triton: without a GPU, this selects Triton's interpreter.
from minillm.kernels.base import tl, triton  # Triton as this machine runs it (no GPU: the interpreter)

__all__ = ["merge_splits", "fa2_num_splits", "split_partial", "flash_decode_split", "merge_partials", "plan_splits",
           "work_line_pieces"]


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


# == Exercise 7.4: the split kernel (stage 1) ====================================================

@triton.jit
def _split_kernel(Q, K, V, SeqLens, O_part, LSE_part,
                  q_heads, group, num_splits, stride_kb, stride_kh, scale,
                  HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Exercise 7.4 — program ``(b, kv_h, s)``: the partial result of split ``s`` of sequence
    ``b``, for the ``group`` query heads that read KV head ``kv_h`` (heads ``kv_h·group …``).

    - ``Q: [batch, q_heads, HEAD_DIM]`` contiguous (the new token's queries);
    - ``K, V: [batch, kv_heads, max_len, HEAD_DIM]`` (Chapter 2's cache; the same strides):
      key ``p`` of KV head ``h`` of sequence ``b`` starts at ``b·stride_kb + h·stride_kh +
      p·HEAD_DIM``; ``SeqLens: [batch]`` int32 (positions ``>= seq_len`` hold no token);
    - ``O_part: [batch, q_heads, num_splits, HEAD_DIM]`` and ``LSE_part: [batch, q_heads,
      num_splits]``, float32, contiguous: write row ``(b, head, s)`` of each.

    The split's keys, as in `minillm.reference.ch07_flash_decoding.split_bounds`: the
    sequence's ``tiles = ⌈seq_len / BLOCK_N⌉`` tiles are dealt ``⌈tiles / num_splits⌉`` per
    split, so split ``s`` covers ``[lo, hi)`` with ``lo = s · span``, ``span = ⌈tiles /
    num_splits⌉ · BLOCK_N`` and ``hi = min(lo + span, seq_len)`` (empty when ``lo >=
    seq_len``). Walk it in tiles of ``BLOCK_N`` with the online softmax (Chapter 3; the
    Chapter 5 decode kernel's loop) and store ``o = acc / l`` and ``lse = m + log l`` (natural
    log): an empty split stores ``o = 0`` and ``lse = -inf``, never NaN. Scores are
    ``scale · q·k``. ``GROUP_PAD >= 16`` rows (``tl.dot``'s minimum): mask the padding rows.
    ``IEEE``: fp32 inputs, pass ``input_precision="ieee"`` to ``tl.dot``.
    """
    pass


def flash_decode_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
                       block_n: int = 16, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 7.4 — stage 1 of flash-decoding (the launcher; the exercise is the kernel above).

    ``q: [batch, q_heads, head_dim]``, ``k, v: [batch, kv_heads, max_len, head_dim]`` (fp32,
    fp16 or bf16; ``head_dim`` a power of two >= 16; ``q_heads % kv_heads == 0``),
    ``seq_lens: [batch]`` int32. Returns ``(o_part [batch, q_heads, num_splits, head_dim],
    lse_part [batch, q_heads, num_splits])`` float32, as
    `minillm.reference.ch07_flash_decoding.split_partials` with ``split_bounds(seq_len,
    num_splits, block_n)``. One program per (sequence, KV head, split).
    """
    raise NotImplementedError("Exercise 7.4 (_split_kernel): not started. Read its docstring; hints: python -m minillm.grade 7 --hint 7.4")
    batch, q_heads, head_dim = q.shape
    _, kv_heads, max_len, _ = k.shape
    q, k, v, seq_lens = q.contiguous(), k.contiguous(), v.contiguous(), seq_lens.contiguous()
    o_part = torch.empty(batch, q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(batch, q_heads, num_splits, device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = q_heads // kv_heads
    _split_kernel[(batch, kv_heads, num_splits)](
        q, k, v, seq_lens, o_part, lse_part, q_heads, group, num_splits, k.stride(0), k.stride(1), scale,
        HEAD_DIM=head_dim, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32)
    return o_part, lse_part


# == Exercise 7.5: the merge kernel (stage 2) =====================================================

@triton.jit
def _merge_kernel(O_part, LSE_part, Out, LSE, num_splits, HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr):
    """Exercise 7.5 — program ``r`` merges the partial results of row ``r`` (one (sequence,
    head) pair): Exercise 7.1's formula, for one row, in Triton.

    - ``O_part: [rows, num_splits, HEAD_DIM]`` and ``LSE_part: [rows, num_splits]`` float32,
      contiguous; an empty split has ``lse = -inf`` and an ``o`` that may be anything (NaN);
    - ``Out: [rows, HEAD_DIM]`` (its own dtype: cast when storing) and ``LSE: [rows]`` float32.

    ``S_PAD`` is ``num_splits`` rounded up to a power of two: the padding splits must weigh
    nothing. With ``M = max_s lse_s`` (0 instead where every split is empty), ``w_s = e^{lse_s
    - M}``: ``out = Σ w_s o_s / Σ w_s`` (``out = 0`` when the sum is 0) and ``lse = M + log Σ
    w_s``.
    """
    pass


def merge_partials(o_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 7.5 — stage 2 of flash-decoding (the launcher; the exercise is the kernel above).

    ``o_part: [..., num_splits, head_dim]`` float32 (``head_dim`` a power of two), ``lse_part:
    [..., num_splits]`` float32. Returns ``(out [..., head_dim] in out_dtype, lse [...]
    float32)``, as `minillm.reference.ch07_flash_decoding.merge_partials`. One program per row.
    """
    raise NotImplementedError("Exercise 7.5 (_merge_kernel): not started. Read its docstring; hints: python -m minillm.grade 7 --hint 7.5")
    *lead, num_splits, head_dim = o_part.shape
    o_part, lse_part = o_part.contiguous(), lse_part.contiguous()
    out = torch.empty(*lead, head_dim, device=o_part.device, dtype=out_dtype)
    lse = torch.empty(*lead, device=o_part.device, dtype=torch.float32)
    rows = math.prod(lead)
    if rows:
        _merge_kernel[(rows,)](o_part, lse_part, out, lse, num_splits, HEAD_DIM=head_dim,
                               S_PAD=triton.next_power_of_2(num_splits))
    return out, lse


# == Exercise 7.6: splits for persistent programs ==================================================

def plan_splits(batch: int, kv_heads: int, max_seq_len: int, programs: int, block_n: int,
                max_splits: int = 128) -> int:
    """Exercise 7.6 — how many splits per sequence a persistent decode kernel should use.

    ``programs`` persistent programs (one per SM) take the ``batch · kv_heads · S`` work units
    (sequence, KV head, split) in turn; a unit is ``⌈tiles / S⌉`` tiles of ``block_n`` keys,
    ``tiles = ⌈max_seq_len / block_n⌉`` (0 for an empty sequence). A program that gets a second
    unit pays for it in full, so:

    1. the most splits that keep every program at one unit: ``most = max(1, min(max_splits,
       tiles, programs // (batch · kv_heads)))`` (``batch · kv_heads`` counts as at least 1;
       when the batch alone has more units than programs, this is 1);
    2. with one unit per program the step lasts one unit, ``⌈tiles / most⌉`` tiles; return the
       smallest ``S`` whose units are that long (fewer partials to merge): e.g. 10 tiles and
       ``most = 7`` give units of 2 tiles, and so does ``S = 5``.

    The rule is the module's `minillm.kernels.ch07_flash_decoding_gluon.plan_splits`.
    """
    raise NotImplementedError("Exercise 7.6 (plan_splits): not started. Read its docstring; hints: python -m minillm.grade 7 --hint 7.6")


# == Exercise 7.7: one equal chunk of work per program ===========================================

def work_line_pieces(seq_lens, kv_heads: int, programs: int, box: int,
                     capacity: int | None = None) -> list[list[tuple]]:
    """Exercise 7.7 — the balanced schedule: which program computes which piece of which unit.

    Whole units leave a tail: ``U`` units on ``P`` programs take ``⌈U / P⌉`` rounds. Instead,
    lay every unit (sequence ``b``, KV head ``h``; sequence-major, ``h`` fastest) out on one
    **line** as a run of ``max(⌈len_b / box⌉, 1)`` boxes of ``box`` keys (``len_b`` clamped
    to ``[0, capacity]`` when a capacity is given; an empty sequence keeps one box), and cut
    the line into chunks of ``chunk = max(1, ⌈line / programs⌉)`` boxes: chunk ``p`` is
    program ``p``'s work (programs past the line's end get none).

    Return one list per program of its pieces, in line order, each
    ``(b, h, lo, hi, part, n_parts)``: the piece covers keys ``[lo, hi)`` of sequence ``b``
    (box positions times ``box``, both clamped to the length: a piece past the length is
    empty, ``lo == hi``), and it is piece ``part`` (from 0) of the ``n_parts`` chunks that
    unit ``(b, h)`` meets. Example: lengths ``[5, 0, 40]``, 2 KV heads, 3 programs, boxes of
    16: the line is ``1 + 1 + 1 + 1 + 3 + 3 = 10`` boxes, chunks of 4, and program 2 gets
    ``[(2, 1, 16, 40, 1, 2)]``.

    The kernel's schedule: `minillm.kernels.ch07_flash_decoding_gluon` with ``schedule="line"``.
    """
    raise NotImplementedError("Exercise 7.7 (work_line_pieces): not started. Read its docstring; hints: python -m minillm.grade 7 --hint 7.7")


# == Exercise 7.8: tiles claimed as the programs go ================================================

def claimed_tiles(n_tiles: int, tile_times, claim_first: int) -> tuple[list[list[int]], list[int]]:
    """Exercise 7.8 — the claimed schedule of one unit: which tiles each program sums, and when it
    is done.

    A unit of ``n_tiles`` tiles has ``S = len(tile_times)`` programs; program ``p`` takes
    ``tile_times[p]`` (a positive integer, nanoseconds say) per tile, so a slow program is one
    with a large time. Program ``p`` first takes its own ``F = claim_first`` tiles ``p·F, p·F + 1,
    …, p·F + F − 1`` back to back from time 0, and if one of them is past the unit's last tile
    (``>= n_tiles``) it stops there, without ever claiming. Otherwise, each time it has finished
    a tile (at time 0 if ``F = 0``) it **claims**: the unit's counter (from 0) gives it tile
    ``S·F + counter`` and counts on by one. Claims made at the same time are served in program
    order. A claimed tile past the unit ends the program.

    Return ``(tiles, finish)``: ``tiles[p]``, program ``p``'s tiles in the order it takes them,
    and ``finish[p]``, the time its last tile is done (0 if it took none). Example: 10 tiles,
    ``tile_times = [1, 2]``, ``claim_first = 2``: program 0 takes 0, 1, then claims 4, 5, 6, 8,
    9 and is done at 7; program 1 takes 2, 3, then 7, and is done at 6 (with fixed runs of 5
    tiles each it would be done at 10).

    The kernel's schedule: `minillm.kernels.ch07_flash_decoding_gluon` with ``schedule="claim"``
    (there a claim's answer takes a round trip, and the ring holds tiles ahead).
    """
    raise NotImplementedError("Exercise 7.8 (claimed_tiles): not started. Read its docstring; hints: python -m minillm.grade 7 --hint 7.8")
