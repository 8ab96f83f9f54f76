"""Chapter 7: flash-decoding in NumPy (float64), the oracle of `minillm.kernels.ch07_flash_decoding`.

A decode step's attention for one sequence splits into independent pieces: cut the keys into
``S`` splits, compute each split's attention as if its keys were the whole sequence (its
**partial** output ``o_s``, normalised over the split, and its log-sum-exp ``lse_s``), then
merge. Over the splits the softmax weights of all keys are ``e^{x_i − lse}``, so split ``s``
as a whole carries the weight ``e^{lse_s − lse}``::

    M = max_s lse_s,  w_s = e^{lse_s − M},  o = Σ_s w_s o_s / Σ_s w_s,  lse = M + log Σ_s w_s

(`merge_partials`: Chapter 3's pairwise `minillm.reference.ch03_online_softmax.merge_partials`
applied to ``S`` pieces at once). An empty split has ``lse_s = −∞`` and weight 0.

The functions follow the kernels step by step:

- `split_bounds`: where the splits of one sequence fall (whole tiles of ``block_n`` keys,
  ``⌈tiles / S⌉`` per split, sized by the sequence's own length);
- `split_partials`: the exact partials, by the safe softmax of each split;
- `async_partials`: FlashDecoding++'s asynchronized softmax, ``p = e^{x − φ}`` with one
  unified max ``φ``, including the kernel's window check and exact fallback per (KV head,
  split), and which splits fell back;
- `flash_decode_partials` and `flash_decode_attention`: the same over a paged cache (gathered
  with `minillm.reference.ch05_paged_attention.gather_paged_kv`);
- `work_line_pieces`: the schedule of the persistent Gluon kernel (which program computes
  which piece of which sequence and KV head);
- `claimed_tiles`: its claimed schedule for one unit, with each program's speed given (which
  tiles each program sums, and when it is done).

The safe window of the asynchronized softmax is a parameter here (``window = (lo, hi)``, in
log2 units of ``max(x) − φ``); the kernels' values are `minillm.kernels.ch07_flash_decoding.async_window`.
"""
from __future__ import annotations

import math

import numpy as np

from minillm.reference.ch01_naive_attention import kv_head_for
from minillm.reference.ch05_paged_attention import gather_paged_kv

__all__ = ["split_bounds", "split_partials", "merge_partials", "async_partials", "flash_decode_partials",
           "flash_decode_attention", "work_line_pieces"]


def split_bounds(seq_len: int, num_splits: int, block_n: int = 1) -> list[tuple[int, int]]:
    """The key ranges ``[(lo, hi), …]`` (``num_splits`` of them) that the kernel's splits of a
    sequence of ``seq_len`` keys cover: ``tiles = ⌈seq_len / block_n⌉``, ``t = ⌈tiles /
    num_splits⌉`` tiles per split, split ``s`` = ``[s·t·block_n, min((s+1)·t·block_n,
    seq_len))``, empty (``lo == hi``) when it starts past the end."""
    if num_splits < 1 or block_n < 1:
        raise ValueError(f"num_splits and block_n must be >= 1, got {num_splits} and {block_n}")
    tiles = -(-seq_len // block_n)                      # ⌈n / bn⌉ (ceiling division)
    span = -(-tiles // num_splits) * block_n            # ⌈tiles / S⌉ whole tiles per split
    bounds = []
    for s in range(num_splits):
        lo = min(s * span, seq_len)
        bounds.append((lo, min(lo + span, seq_len)))
    return bounds


def _split_scores(q, k, lo: int, hi: int, scale: float):
    """``x: [q_heads, hi - lo]``, the scaled scores of every query head (GQA: head ``h`` reads
    KV head ``h // group``) against keys ``lo … hi - 1``."""
    q_heads, kv_heads = q.shape[0], k.shape[0]
    k_of_head = k[kv_head_for(np.arange(q_heads), q_heads, kv_heads), lo:hi]  # [q_heads, n, D]
    return scale * np.einsum("hd,hnd->hn", q, k_of_head)


def _values(v, q_heads: int, lo: int, hi: int):
    return v[kv_head_for(np.arange(q_heads), q_heads, v.shape[0]), lo:hi]  # [q_heads, n, D]


def split_partials(q, k, v, bounds, scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The exact partial results of one sequence's splits.

    Args:
        q: ``[q_heads, head_dim]``, the sequence's new query.
        k, v: ``[kv_heads, seq_len, head_dim]`` (``q_heads % kv_heads == 0``).
        bounds: ``[(lo, hi), …]``, the keys of each split (`split_bounds`).
        scale: defaults to ``1/sqrt(head_dim)``.

    Returns ``(o [q_heads, S, head_dim], lse [q_heads, S])``: per split the softmax-weighted
    average of its values and ``log Σ e^x`` over its keys; an empty split gives ``o = 0``,
    ``lse = -inf``.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    q_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    o = np.zeros((q_heads, len(bounds), head_dim))
    lse = np.full((q_heads, len(bounds)), -np.inf)
    for s, (lo, hi) in enumerate(bounds):
        if hi <= lo:
            continue
        x = _split_scores(q, k, lo, hi, scale)
        m = x.max(axis=1, keepdims=True)
        p = np.exp(x - m)
        o[:, s] = np.einsum("hn,hnd->hd", p, _values(v, q_heads, lo, hi)) / p.sum(axis=1, keepdims=True)
        lse[:, s] = m[:, 0] + np.log(p.sum(axis=1))
    return o, lse


def merge_partials(o, lse) -> tuple[np.ndarray, np.ndarray]:
    """Merge the partial results of ``S`` splits: ``o: [..., S, head_dim]``, ``lse: [..., S]``
    -> ``(out [..., head_dim], lse [...])`` (the module docstring's formula). Empty splits
    (``lse = -inf``) weigh nothing, whatever their ``o``; a row whose splits are all empty
    gives ``out = 0`` and ``lse = -inf``."""
    o = np.asarray(o, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    m = lse.max(axis=-1, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # all empty: e^{-inf - 0} = 0, no NaN
    w = np.exp(lse - m_safe[..., None])
    w_sum = w.sum(axis=-1)
    num = np.einsum("...s,...sd->...d", w, np.where(np.isneginf(lse)[..., None], 0.0, o))
    with np.errstate(divide="ignore"):
        return num / np.where(w_sum == 0, 1.0, w_sum)[..., None], m_safe + np.log(w_sum)


def async_partials(q, k, v, bounds, phi: float, window: tuple[float, float], scale: float | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The partials of FlashDecoding++'s asynchronized softmax, with the kernel's fallback.

    Arguments as `split_partials`, plus ``phi``, the unified max (natural-log units of the
    scaled score), and ``window = (lo, hi)`` in log2 units. A split is computed as
    ``p = e^{x − φ}``, ``o_s = Σ p·v / Σ p`` and ``lse_s = φ + log Σ p``, unless, for some
    query head of a KV head's group, ``(max x − φ) · log2 e`` lies outside ``[lo, hi]``: then
    that (KV head, split) falls back to the exact computation, as the kernel's program for it
    does. (The kernel notices after its loop; the reference checks first. The outcome is the
    same, and it keeps float64 from overflowing where the kernel would have.)

    Returns ``(o, lse, fell_back)``: ``o, lse`` as `split_partials` (mathematically equal to
    it), ``fell_back: [kv_heads, S]`` bool (False for empty splits).
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    q_heads, head_dim = q.shape
    kv_heads = k.shape[0]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    lo_w, hi_w = window
    o, lse = split_partials(q, k, v, bounds, scale)  # what a fallback computes
    fell_back = np.zeros((kv_heads, len(bounds)), dtype=bool)
    for s, (lo, hi) in enumerate(bounds):
        if hi <= lo:
            continue
        x = _split_scores(q, k, lo, hi, scale)
        offset = (x.max(axis=1) - phi) * math.log2(math.e)  # [q_heads], log2 units
        outside = ((offset < lo_w) | (offset > hi_w)).reshape(kv_heads, group).any(axis=1)
        fell_back[:, s] = outside
        for j in np.flatnonzero(~outside):
            rows = slice(j * group, (j + 1) * group)
            p = np.exp(x[rows] - phi)
            l = p.sum(axis=1)
            o[rows, s] = np.einsum("hn,hnd->hd", p, _values(v, q_heads, lo, hi)[rows]) / l[:, None]
            lse[rows, s] = phi + np.log(l)
    return o, lse, fell_back


def flash_decode_partials(q, k_cache, v_cache, block_tables, seq_lens, num_splits: int, block_n: int = 1,
                          scale: float | None = None, phi: float | None = None,
                          window: tuple[float, float] | None = None):
    """Stage 1 over a paged cache: the partials of every sequence's ``num_splits`` splits.

    ``q: [batch, q_heads, head_dim]``, the pool ``[num_blocks, block_size, kv_heads,
    head_dim]``, ``block_tables``, ``seq_lens`` as in
    `minillm.reference.ch05_paged_attention.paged_decode_attention`; ``block_n`` the kernel's tile
    (it decides where splits fall); ``phi`` (with ``window``) for the asynchronized softmax.

    Returns ``(o [batch, q_heads, S, head_dim], lse [batch, q_heads, S], fell_back [batch,
    kv_heads, S])``, the workspace the kernel's stage 1 writes (``fell_back`` all False
    without ``phi``).
    """
    q = np.asarray(q, dtype=np.float64)
    batch, q_heads, head_dim = q.shape
    kv_heads = np.shape(k_cache)[2]
    o = np.zeros((batch, q_heads, num_splits, head_dim))
    lse = np.full((batch, q_heads, num_splits), -np.inf)
    fell_back = np.zeros((batch, kv_heads, num_splits), dtype=bool)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k, v = gather_paged_kv(k_cache, v_cache, block_tables[b], n)
        bounds = split_bounds(n, num_splits, block_n)
        if phi is None:
            o[b], lse[b] = split_partials(q[b], k, v, bounds, scale)
        else:
            if window is None:
                raise ValueError("the asynchronized softmax needs its window (lo, hi)")
            o[b], lse[b], fell_back[b] = async_partials(q[b], k, v, bounds, phi, window, scale)
    return o, lse, fell_back


def flash_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits: int, block_n: int = 1,
                           scale: float | None = None, phi: float | None = None,
                           window: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Flash-decoding over a paged cache: `flash_decode_partials`, then `merge_partials`.

    Returns ``(out [batch, q_heads, head_dim], lse [batch, q_heads])`` float64, equal (up to
    rounding) to `minillm.reference.ch05_paged_attention.paged_decode_attention` for any split.
    """
    o, lse, _ = flash_decode_partials(q, k_cache, v_cache, block_tables, seq_lens, num_splits, block_n, scale,
                                      phi, window)
    return merge_partials(o, lse)


def work_line_pieces(seq_lens, kv_heads: int, programs: int, box: int,
                     capacity: int | None = None) -> list[list[tuple]]:
    """The persistent Gluon decode kernel's balanced schedule (``schedule="line"``): for each
    of ``programs`` programs, its pieces ``(b, kv_h, lo, hi, part, n_parts)`` in the order it
    computes them: keys ``[lo, hi)`` of sequence ``b`` at KV head ``kv_h``, piece ``part`` of
    the ``n_parts`` that its unit (sequence, KV head) is cut into (``lo == hi``: an empty
    sequence's one piece, which still writes the output's 0 and -inf).

    The **work line** lists the units in order (sequence-major), each as a run of
    ``max(⌈len / box⌉, 1)`` boxes of ``box`` keys (the length clamped to ``capacity``), and
    is cut into chunks of ``chunk = ⌈line / programs⌉`` boxes, chunk ``p`` to program ``p``:
    equal up to a box. A chunk boundary inside a unit makes two pieces of it."""
    lens = [max(int(n), 0) if capacity is None else min(max(int(n), 0), capacity) for n in seq_lens]
    sizes = [max(-(-n // box), 1) for n in lens]
    chunk = max(1, -(-kv_heads * sum(sizes) // programs))
    pieces: list[list[tuple]] = [[] for _ in range(programs)]
    unit_start = 0
    for b, n in enumerate(lens):
        for h in range(kv_heads):
            unit_end = unit_start + sizes[b]
            first, last = unit_start // chunk, (unit_end - 1) // chunk
            for k in range(first, last + 1):
                lo_box, hi_box = max(unit_start, k * chunk), min(unit_end, (k + 1) * chunk)
                pieces[k].append((b, h, min((lo_box - unit_start) * box, n), min((hi_box - unit_start) * box, n),
                                  k - first, last - first + 1))
            unit_start = unit_end
    return pieces


def claimed_tiles(n_tiles: int, tile_times, claim_first: int) -> tuple[list[list[int]], list[int]]:
    """The Gluon kernel's claimed schedule (``schedule="claim"``) for one unit of ``n_tiles``
    tiles and ``S = len(tile_times)`` programs, program ``p`` taking ``tile_times[p]`` (a positive
    integer: ns, say) per tile: ``(tiles, finish)``, program ``p``'s tiles in the order it takes
    them and the time its last one is done (0 if it took none).

    Program ``p`` first takes its own tiles ``p·F, …, p·F + F − 1`` (``F = claim_first``) back to
    back from time 0, and stops at the first one past the unit (``>= n_tiles``) without ever
    claiming. Otherwise, each time it has finished a tile (at time 0 if ``F = 0``) it claims:
    the unit's counter, from 0, gives it tile ``S·F + counter`` and counts on; claims made at the
    same time are served in program order; a claimed tile past the unit ends the program. A
    model of the kernel in which a claim is answered at once and the ring holds no tile ahead."""
    import heapq

    programs = len(tile_times)
    tiles: list[list[int]] = [[] for _ in range(programs)]
    finish = [0] * programs
    claims = []  # (time of the claim, program): the heap serves the earliest, then the lowest program
    for p, per_tile in enumerate(tile_times):
        own = range(p * claim_first, (p + 1) * claim_first)
        tiles[p] = [t for t in own if t < n_tiles]
        finish[p] = len(tiles[p]) * per_tile
        if len(tiles[p]) == claim_first:  # no own tile past the unit (they only grow): on to the claims
            heapq.heappush(claims, (finish[p], p))
    counter = 0
    while claims:
        when, p = heapq.heappop(claims)
        tile = programs * claim_first + counter
        counter += 1
        if tile < n_tiles:
            tiles[p].append(tile)
            finish[p] = when + tile_times[p]
            heapq.heappush(claims, (finish[p], p))
    return tiles, finish
