"""Chapter 9 solutions. Try the exercises in ``exercises/ch09.py`` first."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.paged import Admission

__all__ = ["Admission", "Req", "Schedule", "admission", "sample_top_p", "schedule_step", "top_p_filter"]


# == Exercise 9.1 ===============================================================================

@dataclass(frozen=True)
class Req:
    """A request as the scheduler sees it (the same as in ``exercises/ch09.py``)."""

    request_id: str
    arrival: int
    num_tokens: int
    num_computed: int = 0


@dataclass
class Schedule:
    """What one step runs (the same as in ``exercises/ch09.py``)."""

    scheduled: list[tuple[str, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def schedule_step(running: Sequence[Req], waiting: Sequence[Req], token_budget: int, max_num_seqs: int,
                  free_blocks: int, block_size: int) -> Schedule:
    """Exercise 9.1: running requests first (decodes and prompt chunks), preempting the newest
    when blocks run out; then waiting requests in arrival order until the first that does not
    fit."""
    out = Schedule()
    budget, free = token_budget, free_blocks
    queue = sorted(running, key=lambda r: r.arrival)
    num_running = len(queue)
    while queue and budget > 0:
        req = queue.pop(0)
        count = min(req.num_tokens - req.num_computed, budget)
        need = blocks_for(req.num_computed + count, block_size) - blocks_for(req.num_computed, block_size)
        victim = None
        while need > free and victim is not req:
            victim = queue.pop() if queue else req        # the newest not yet looked at, else itself
            free += blocks_for(victim.num_computed, block_size)
            out.preempted.append(victim.request_id)
            num_running -= 1
        if victim is req:                                 # it preempted itself: nobody else is left
            break
        out.scheduled.append((req.request_id, count))
        free -= need
        budget -= count

    if out.preempted:                                     # no admission in a step that preempted
        return out
    for req in sorted(waiting, key=lambda r: r.arrival):
        count = min(req.num_tokens, budget)
        if budget <= 0 or num_running >= max_num_seqs or blocks_for(count, block_size) > free:
            break                                         # head-of-line blocking: nobody overtakes
        out.scheduled.append((req.request_id, count))
        num_running += 1
        free -= blocks_for(count, block_size)
        budget -= count
    return out


# == Exercise 9.2 ===============================================================================

def admission(num_tokens: int, block_size: int, num_blocks: int, num_free: int, num_evictable: int,
              hit_ref_counts: Sequence[int]) -> Admission:
    """Exercise 9.2: never if the prompt is longer than the pool; now if the blocks the cache
    does not hold fit in the free and evictable blocks, minus the evictable hits it revives."""
    needed = blocks_for(num_tokens, block_size)
    if needed > num_blocks:
        return Admission.NEVER_FITS
    revived = sum(1 for r in hit_ref_counts if r == 0)
    available = num_free + num_evictable - revived
    return Admission.FITS_NOW if needed - len(hit_ref_counts) <= available else Admission.FITS_LATER


# == Exercise 9.3 ===============================================================================

def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Exercise 9.3: sort (ties by token id), keep each token while the mass ranked above it is
    below ``top_p``."""
    sorted_logits, order = torch.sort(logits, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(0) - probs
    return logits.index_fill(0, order[mass_before >= top_p], -torch.inf)


def sample_top_p(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Exercise 9.3: greedy at temperature 0; else temperature, nucleus, one multinomial draw."""
    if temperature == 0:
        return int(logits.argmax())
    scaled = logits / temperature
    if top_p < 1:
        scaled = top_p_filter(scaled, top_p)
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))
