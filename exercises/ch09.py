"""Chapter 9 exercises: the engine's scheduler, admission and sampler. Grade your work with
``make grade CH=9``.

Replace each ``raise NotImplementedError(...)`` with your implementation, in plain Python
(and torch for Exercise 9.3). The tests compare your functions with the book's engine, on
fresh random scenarios: Exercise 9.1 with `minillm.engine.scheduler.Scheduler.schedule`,
Exercise 9.2 with `minillm.paged.BlockManager.can_allocate`, Exercise 9.3 with
`minillm.decoding.sampling`'s top-p filter and `sample_token`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.paged import Admission

__all__ = ["Admission", "Req", "Schedule", "admission", "sample_top_p", "schedule_step", "top_p_filter"]


# == Exercise 9.1: one scheduling step ==========================================================

@dataclass(frozen=True)
class Req:
    """A request as the scheduler sees it (given; one sequence per request).

    Attributes:
        request_id: its name.
        arrival: its place in arrival order (smaller = older); all different.
        num_tokens: prompt + tokens generated so far.
        num_computed: leading tokens whose K/V are in the cache. A running request holds
            ``ceil(num_computed / block_size)`` blocks and has ``num_computed < num_tokens``
            (1 token left when it decodes; more while its prompt is prefilled in chunks). A
            waiting request holds no block and has ``num_computed == 0``.
    """

    request_id: str
    arrival: int
    num_tokens: int
    num_computed: int = 0


@dataclass
class Schedule:
    """What one step runs.

    Attributes:
        scheduled: ``(request_id, num_new_tokens)`` in batch order: first the running requests
            that run this step, oldest first, then the waiting requests admitted, oldest first.
        preempted: ids of the running requests preempted in this step, in the order it
            preempted them.
    """

    scheduled: list[tuple[str, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """``ceil(num_tokens / block_size)`` (given)."""
    return -(-num_tokens // block_size)


def schedule_step(running: Sequence[Req], waiting: Sequence[Req], token_budget: int, max_num_seqs: int,
                  free_blocks: int, block_size: int) -> Schedule:
    """Exercise 9.1 — decide one step of continuous batching (Section 3 of the chapter).

    ``running`` and ``waiting`` come in any order; sort each by ``arrival``. ``free_blocks``
    blocks of the pool hold nothing. Keep a budget of ``token_budget`` tokens for the step.
    Change none of the inputs.

    1. **Running requests, oldest first**, while the budget left is positive. A request
       wants its uncomputed tokens, ``num_tokens - num_computed`` (1 when it decodes); it gets
       ``count = min(wanted, budget left)`` (a long prompt is *chunked* over several steps).
       Its new tokens need ``blocks_for(num_computed + count) - blocks_for(num_computed)``
       fresh blocks. While the free blocks cannot cover that, **preempt** a victim: the
       newest running request not yet looked at in this step (it frees its
       ``blocks_for(num_computed)`` blocks and goes back to waiting), or, when no such
       request is left, the request itself (it frees its blocks and does not run). A
       request that gets its blocks runs: record ``(request_id, count)``, take the blocks,
       spend ``count`` of the budget.
    2. **Then waiting requests, oldest first** (first come, first served), but only if no
       request was preempted in this step. Stop at the first request that cannot start: the
       budget left is 0, or the running queue is full (``len(running)`` plus the requests
       admitted so far reach ``max_num_seqs``; a running request counts even in a step it
       does not run), or the free blocks cannot hold ``blocks_for(count)`` with ``count =
       min(num_tokens, budget left)``. No later request may overtake it (*head-of-line blocking*: a long request
       must not starve behind a stream of short ones). An admitted request is recorded like a
       running one and takes its blocks and budget.

    The tests guarantee ``token_budget >= max_num_seqs >= len(running)`` and that every
    waiting request's whole prompt fits in the pool.
    """
    raise NotImplementedError("Exercise 9.1 (schedule_step): not started. Read its docstring; hints: python -m minillm.grade 9 --hint 9.1")


# == Exercise 9.2: admission, the three-way answer ==============================================

def admission(num_tokens: int, block_size: int, num_blocks: int, num_free: int, num_evictable: int,
              hit_ref_counts: Sequence[int]) -> Admission:
    """Exercise 9.2 — can a new prompt of ``num_tokens`` tokens get its blocks now, later, never?

    The pool has ``num_blocks`` blocks: ``num_free`` on the free list, ``num_evictable``
    unreferenced blocks that the prefix cache keeps (reusable, evicting their contents), and
    the rest referenced by running sequences. The prefix cache found the prompt's first
    ``len(hit_ref_counts)`` blocks; ``hit_ref_counts[i]`` is the reference count of the
    ``i``-th of them (0: it is one of the evictable blocks; > 0: running sequences use it).

    - The prompt occupies ``needed = ceil(num_tokens / block_size)`` blocks. More than the
      whole pool: ``Admission.NEVER_FITS``, whatever the cache holds.
    - Hit blocks are shared, not allocated: only ``needed - hits`` fresh blocks are needed.
    - Fresh blocks come from the free list and from the evictable blocks. But an evictable
      block that is a *hit* is revived by this request, so it cannot also be evicted to make
      room: it no longer counts as available.
    - Enough available blocks: ``Admission.FITS_NOW``; else ``Admission.FITS_LATER``.
    """
    raise NotImplementedError("Exercise 9.2 (admission): not started. Read its docstring; hints: python -m minillm.grade 9 --hint 9.2")


# == Exercise 9.3: top-p (nucleus) sampling =====================================================

def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Exercise 9.3 (part 1) — keep the nucleus of a distribution.

    ``logits: [vocab]`` float32. Rank the tokens by logit, most likely first (ties: the
    smaller token id first). With ``p = softmax(logits)``, a token is **kept** when the total
    probability of the tokens ranked above it is below ``top_p``: the smallest set of most
    likely tokens whose probability reaches ``top_p``. The most likely token is therefore
    always kept. Return a new tensor equal to ``logits`` with every other entry set to
    ``-inf`` (leave the input unchanged). Compute the probabilities in float32, as
    ``torch.softmax`` does.
    """
    raise NotImplementedError("Exercise 9.3 (top_p_filter): not started. Read its docstring; hints: python -m minillm.grade 9 --hint 9.3")


def sample_top_p(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Exercise 9.3 (part 2) — draw one token, as `minillm.decoding.sampling.sample_token`
    does without top-k.

    ``temperature == 0``: the argmax (greedy; the generator is not used). Otherwise divide
    the logits by ``temperature``, keep the nucleus (`top_p_filter`, only when ``top_p < 1``),
    and draw with ``torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator)``.
    Return the token id as an ``int``.
    """
    raise NotImplementedError("Exercise 9.3 (sample_top_p): not started. Read its docstring; hints: python -m minillm.grade 9 --hint 9.3")
