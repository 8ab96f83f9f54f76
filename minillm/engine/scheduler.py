"""Chapter 9: continuous batching. Every step, decide which tokens of which requests to run.

Two queues, both in arrival order: ``running`` requests hold KV blocks, ``waiting`` ones hold
none (new, or preempted). One step (`Scheduler.schedule`):

1. **Running requests first, oldest first.** Each gets the tokens it has not computed yet, up
   to the step's token budget (``max_num_batched_tokens``): one per sequence when decoding, a
   chunk of the prompt when prefilling (*chunked prefill*: a long prompt is spread over
   several steps instead of stalling everyone's decode). Its new tokens need slots; when the
   pool has too few blocks, the **newest** running request is *preempted*: its blocks are
   freed and it goes back to waiting, to be recomputed later (its prompt and its output so
   far are simply prefilled again; the prefix cache usually still holds most of it).
2. **Then waiting requests, oldest first,** while the budget, ``max_num_seqs`` and the pool
   allow. The oldest waiting request that does not fit blocks the queue (no overtaking, so a
   long request cannot starve), and nothing is admitted in a step that preempted.

A request's sequences (``n`` samples, or beams) are scheduled together. They are sampled only
in a step that computes the last token of every one of them; so when a group cannot finish
all of its prefill in this step, each sequence holds back its last token (it is computed in a
later step, together with the others').

Blocks are taken (`BlockManager.allocate` / `append_slots`) while scheduling and never freed
between then and the step's forward pass, which is what makes the prefix cache's early
registration safe (see `minillm.paged.block_manager`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from minillm.engine.request import Request, RequestStatus, Sequence
from minillm.paged import BlockManager, OutOfBlocks

__all__ = ["Scheduler", "SchedulerOutput"]


@dataclass
class SchedulerOutput:
    """One step's work.

    Attributes:
        seqs: the sequences to run, in batch order.
        num_new_tokens: tokens of each to compute (its last ones in the block manager).
        copies: copy-on-write block copies ``(src, dst)`` to perform before the forward pass.
        requests: the requests these sequences belong to.
        owners: each sequence's request.
        preempted: requests preempted (blocks freed, back to waiting) during this step.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    owners: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, chunks: list[tuple[Sequence, int]], copies) -> None:
        self.requests.append(request)
        for seq, count in chunks:
            self.seqs.append(seq)
            self.owners.append(request)
            self.num_new_tokens.append(count)
        self.copies.extend(copies)


def _by_arrival(request: Request) -> int:
    return request.arrival_index


class Scheduler:
    """The waiting and running queues over one `BlockManager` (see the module docstring).

    Args:
        manager: the block manager of the engine's KV pool.
        max_num_seqs: most sequences in the running queue.
        max_num_batched_tokens: the per-step token budget; at least ``max_num_seqs`` so that
            every running sequence can always decode.
    """

    def __init__(self, manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running sequence must be able to decode each step")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    # == queues ==================================================================================
    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_by_arrival)

    def finish(self, request: Request) -> None:
        """Take ``request`` out of the queues and free its blocks (finished or aborted)."""
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED

    def free_seq(self, seq: Sequence) -> None:
        if seq.seq_id in self.manager:
            self.manager.free(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seqs for r in self.running)

    # == one step ================================================================================
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # The common case, every running sequence decoding, takes its slots in one call; any
        # other (the budget or the pool too short, a sequence without blocks) goes request by request.
        queue = [] if self._take_all_running(out) else list(self.running)  # oldest first; victims off the end
        budget -= out.num_batched_tokens
        while queue and budget > 0:
            request = queue.pop(0)
            while True:
                try:
                    chunks, copies = self._take_blocks(request, budget)
                    break
                except OutOfBlocks:
                    victim = queue.pop() if queue else request
                    self._preempt(victim, out)
                    if victim is request:
                        chunks = []
                        break
            if chunks:
                out.add(request, chunks, copies)
                budget -= sum(count for _, count in chunks)

        seqs = self.num_running_seqs
        while self.waiting and budget > 0 and not out.preempted:
            request = self.waiting[0]
            if seqs + _max_seqs(request) > self.max_num_seqs:
                break
            try:
                chunks, copies = self._take_blocks(request, budget)
            except OutOfBlocks:
                break                                  # fits later: head-of-line waits for blocks
            if not chunks:
                break
            self.waiting.pop(0)
            bisect.insort(self.running, request, key=_by_arrival)
            request.status = RequestStatus.RUNNING
            seqs += _max_seqs(request)
            out.add(request, chunks, copies)
            budget -= sum(count for _, count in chunks)
        return out

    def schedule_ahead(self) -> SchedulerOutput | None:
        """The decode step after the one running now, scheduled before that one's tokens are
        known (the engine's overlapped decode): one token for every sequence of every running
        request, its slot taken with `BlockManager.append_pending`. ``None``, having changed
        nothing, when the budget or the pool is too short (the next step is then scheduled as
        usual, once the tokens are known). Admits nobody."""
        out = SchedulerOutput()
        for request in self.running:
            out.requests.append(request)
            for seq in request.seqs:
                out.seqs.append(seq)
                out.owners.append(request)
        if not out.seqs or len(out.seqs) > self.max_num_batched_tokens:
            return None
        try:
            result = self.manager.append_pending([seq.seq_id for seq in out.seqs])
        except OutOfBlocks:
            return None
        out.num_new_tokens = [1] * len(out.seqs)
        out.copies = list(result.copies)
        return out

    def _take_all_running(self, out: SchedulerOutput) -> bool:
        """Take the slots of every running sequence's uncomputed tokens in one `append_slots`
        call and add them to ``out``, when they all fit in the step's budget and in the pool:
        what `_take_blocks` request by request would do then (same slots, same copies, same
        order), at one call's cost. Returns False, having changed nothing, when they do not."""
        mgr = self.manager
        seqs, owners, counts, requests, tokens = [], [], [], [], []
        for request in self.running:
            took = False
            for seq in request.seqs:
                if seq.seq_id not in mgr:
                    return False
                count = len(seq.token_ids) - seq.num_computed
                if count > 0:
                    seqs.append(seq)
                    owners.append(request)
                    counts.append(count)
                    tokens.append(seq.token_ids[seq.num_computed:])
                    took = True
            if took:
                requests.append(request)
        if not seqs or sum(counts) > self.max_num_batched_tokens:
            return False
        try:
            result = mgr.append_slots([seq.seq_id for seq in seqs], tokens)
        except OutOfBlocks:
            return False
        out.seqs += seqs
        out.owners += owners
        out.num_new_tokens += counts
        out.requests += requests
        out.copies += result.copies
        return True

    def _take_blocks(self, request: Request, budget: int) -> tuple[list[tuple[Sequence, int]], tuple]:
        """Choose how many tokens of each of ``request``'s sequences to compute within
        ``budget``, and take their slots from the block manager.

        Returns ``(chunks, copies)``: ``(sequence, count)`` pairs and the copy-on-write copies.
        Raises `OutOfBlocks` only when it changed nothing.
        """
        mgr = self.manager
        held = [s for s in request.seqs if s.seq_id in mgr]
        fresh = [s for s in request.seqs if s.seq_id not in mgr]
        remaining = sum(s.num_uncomputed for s in held)
        remaining += sum(len(s.token_ids) - mgr.num_cached_prefix_tokens(s.token_ids) for s in fresh)
        # A group's sequences are sampled together, so they must finish in the same step: when
        # they cannot all finish now, each holds back its last token. Several fresh sequences (a
        # preempted group coming back) are allocated one at a time, which can stop half way, so
        # they always hold back.
        together = len(request.seqs) == 1 or (remaining <= budget and not fresh)
        hold = 0 if together else 1

        def chunk(uncomputed: int, left: int) -> int:
            return min(uncomputed - hold, left)

        chunks, copies, left = [], (), budget
        appends = []
        for seq in held:
            count = chunk(seq.num_uncomputed, left)
            if count > 0:
                appends.append((seq, count))
                left -= count
        if appends:  # one call: all or nothing
            result = mgr.append_slots([s.seq_id for s, _ in appends],
                                      [s.token_ids[s.num_computed:s.num_computed + c] for s, c in appends])
            chunks, copies = appends, result.copies
        for seq in fresh:
            if left <= 0:
                break
            cached = mgr.num_cached_prefix_tokens(seq.token_ids)
            # Holding back the last token of a fully cached sequence recomputes its last cached
            # block (`allocate` never hands out the block it writes into as a hit): up to
            # block_size tokens over the budget, once.
            end = min(len(seq.token_ids) - hold, cached + left)
            try:
                seq.num_computed = mgr.allocate(seq.seq_id, seq.token_ids[:end])
            except OutOfBlocks:
                if chunks:
                    break          # keep what this step already took; the rest comes next step
                raise
            if request.num_cached_tokens is None:  # its first admission: what the prefix cache gave
                request.num_cached_tokens = seq.num_computed
            chunks.append((seq, end - seq.num_computed))
            left -= end - seq.num_computed
        return chunks, copies

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preemption by recomputation: free every block, keep the tokens, wait again."""
        self._free(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)
        out.preempted.append(request)

    def _free(self, request: Request) -> None:
        for seq in request.seqs:
            self.free_seq(seq)
            seq.num_computed = 0


def _max_seqs(request: Request) -> int:
    """Sequences the request will run at once: ``n`` samples or ``num_beams`` beams."""
    p = request.params
    return max(request.num_seqs, p.num_beams if p.beam_search else p.n)
