"""How much KV memory block sharing saves for parallel sampling and beam search.

Both decoding methods keep several sequences that start from the same prompt. Without
sharing, each holds its own copy of every block; with `BlockManager.fork` they share every
block they have in common and copy only a partly filled last block when they diverge
(copy-on-write). The PagedAttention paper (Kwon et al., 2023, Sec. 6.3 and Fig. 15) reports
savings of 6-10 % (parallel sampling) and 38-55 % (beam search) on Alpaca, 16-31 % and 44-66 %
on ShareGPT.

These functions drive a real `BlockManager` (prefix caching off, so that only fork sharing
counts) through the block operations of each method, with random tokens, and compare, at every
step, the blocks it holds with the blocks the same sequences would hold alone (the sum of
``ceil(length / block_size)``). They do not decode anything: which beams survive is drawn at
random, by the model described in `beam_search_trace`.

Savings are ``1 - sum(shared) / sum(unshared)`` over all steps (time averaged, what a snapshot
of a busy server shows), and, as ``peak_saving``, the same ratio of the maxima.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minillm.decoding.sharing_trace import SharingTrace
from minillm.experiments.ch05_fragmentation import LengthDistribution
from minillm.paged.block_manager import BlockManager, blocks_for

__all__ = ["SharingTrace", "parallel_sampling_trace", "beam_search_trace", "sharing_savings"]

_VOCAB = 32000  # random tokens; their values do not matter with prefix caching off


def _manager(max_seqs: int, max_tokens: int, block_size: int) -> BlockManager:
    # Room for every sequence unshared, plus one block each for copy-on-write: never runs out.
    return BlockManager(max_seqs * (blocks_for(max_tokens, block_size) + 1), block_size, enable_prefix_caching=False)


def _check_empty(mgr: BlockManager) -> None:
    if len(mgr) or mgr.num_used_blocks:  # a bug in this driver or in the manager
        raise RuntimeError(f"{len(mgr)} sequences and {mgr.num_used_blocks} blocks left after the last step")


def parallel_sampling_trace(prompt_len: int, output_lens: Sequence[int], block_size: int,
                            seed: int = 0) -> SharingTrace:
    """``n = len(output_lens)`` samples of one prompt, sample ``i`` producing ``output_lens[i]``
    tokens (stopping at its own end of sequence).

    The prompt is prefilled once and forked ``n - 1`` times; step ``j`` then appends one token to
    every sample still running, and a sample that has produced its last token is freed. As in
    `minillm.experiments.ch05_fragmentation`, a sample of ``o`` tokens holds ``prompt_len + j`` tokens at its
    steps ``j = 0 .. o - 1``.
    """
    rng = np.random.default_rng(seed)
    outs = [int(o) for o in output_lens]
    if prompt_len < 1 or not outs or min(outs) < 1:
        raise ValueError("need prompt_len >= 1 and at least one sample with at least one output token")
    mgr = _manager(len(outs), prompt_len + max(outs), block_size)
    mgr.allocate(0, rng.integers(0, _VOCAB, prompt_len).tolist())
    for i in range(1, len(outs)):
        mgr.fork(0, i)
    shared, unshared, copies = [], [], 0
    for j in range(max(outs)):
        alive = [i for i in range(len(outs)) if outs[i] > j]
        shared.append(mgr.num_used_blocks)
        unshared.append(len(alive) * blocks_for(prompt_len + j, block_size))
        for i in alive:
            if outs[i] == j + 1:
                mgr.free(i)
        going = [i for i in alive if outs[i] > j + 1]
        if going:
            copies += len(mgr.append_slots(going, rng.integers(0, _VOCAB, len(going)).tolist()).copies)
    _check_empty(mgr)
    return SharingTrace(np.asarray(shared), np.asarray(unshared), copies)


def beam_search_trace(prompt_len: int, output_len: int, beam_width: int, block_size: int, seed: int = 0,
                      keep_prob: float = 0.0) -> SharingTrace:
    """The block operations of beam search with ``beam_width`` beams for ``output_len`` steps.

    The prompt is prefilled once and forked into ``beam_width`` beams. At each later step every
    beam slot picks a parent among the current beams, the new beams are forked from their
    parents, the old ones freed, and every new beam appends one token, so a parent chosen ``m``
    times has its partly filled last block copied ``m - 1`` times. Which parents win is random,
    a stand-in for the scores: slot ``i`` keeps its own beam with probability ``keep_prob`` and
    otherwise picks a parent uniformly (``keep_prob = 0``, the default, is the neutral
    "Wright-Fisher" model, where beams merge back into a common ancestor about ``2 *
    beam_width`` steps in the past; a larger ``keep_prob`` keeps beams apart longer and saves
    less).
    """
    if prompt_len < 1 or output_len < 1 or beam_width < 1:
        raise ValueError("need prompt_len, output_len and beam_width >= 1")
    if not 0.0 <= keep_prob <= 1.0:
        raise ValueError(f"keep_prob must lie in [0, 1], got {keep_prob}")
    rng = np.random.default_rng(seed)
    mgr = _manager(2 * beam_width, prompt_len + output_len, block_size)
    mgr.allocate("prompt", rng.integers(0, _VOCAB, prompt_len).tolist())
    beams = list(range(beam_width))
    for b in beams:
        mgr.fork("prompt", b)
    mgr.free("prompt")
    next_id = beam_width
    shared, unshared, copies = [], [], 0
    for j in range(output_len):
        shared.append(mgr.num_used_blocks)
        unshared.append(beam_width * blocks_for(prompt_len + j, block_size))
        if j + 1 == output_len:
            break
        keep = rng.random(beam_width) < keep_prob
        parents = np.where(keep, np.arange(beam_width), rng.integers(0, beam_width, beam_width))
        children = list(range(next_id, next_id + beam_width))
        next_id += beam_width
        for slot, child in enumerate(children):
            mgr.fork(beams[parents[slot]], child)
        for b in beams:
            mgr.free(b)
        beams = children
        copies += len(mgr.append_slots(beams, rng.integers(0, _VOCAB, beam_width).tolist()).copies)
    for b in beams:
        mgr.free(b)
    _check_empty(mgr)
    return SharingTrace(np.asarray(shared), np.asarray(unshared), copies)


def sharing_savings(kind: str, widths: Sequence[int], dist: LengthDistribution, *, block_size: int = 16,
                    num_requests: int = 50, seed: int = 0, keep_prob: float = 0.0) -> dict:
    """Savings for ``num_requests`` prompts drawn from ``dist``, for each width.

    Args:
        kind: ``"parallel"`` (each of ``n`` samples draws its own output length from ``dist``) or
            ``"beam"`` (all beams run for the request's output length).
        widths: numbers of samples, or beam widths.

    Returns:
        ``{"widths": [...], "saving": [...], "peak_saving": [...], "copies": [...], ...}``:
        ``saving`` over all requests served one after another, ``peak_saving`` the mean over
        requests of each one's peak saving, ``copies`` the copy-on-write copies in total. The
        same prompts and output lengths are used for every width.
    """
    if kind not in ("parallel", "beam"):
        raise ValueError(f"kind must be 'parallel' or 'beam', got {kind!r}")
    reqs = dist.sample(num_requests, seed)
    rng = np.random.default_rng(seed + 1)
    out = {"kind": kind, "widths": list(widths), "saving": [], "peak_saving": [], "copies": [],
           "block_size": block_size, "dist": dist.name}
    for n in widths:
        traces = []
        for r, (p, o) in enumerate(zip(reqs.prompt_lens.tolist(), reqs.output_lens.tolist())):
            if kind == "parallel":
                # The first sample keeps the request's length; the others draw theirs, within max_len.
                extra = dist.sample(n - 1, seed=int(rng.integers(2**31))).output_lens.tolist() if n > 1 else []
                outs = [o] + [min(x, dist.max_len - p) for x in extra]
                traces.append(parallel_sampling_trace(p, outs, block_size, seed=r))
            else:
                traces.append(beam_search_trace(p, o, n, block_size, seed=r, keep_prob=keep_prob))
        total = SharingTrace.concat(traces)
        out["saving"].append(total.saving)
        out["peak_saving"].append(float(np.mean([t.peak_saving for t in traces])))
        out["copies"].append(total.copies)
    return out
