"""Chapter 11: a KV cache in virtual memory (vAttention), simulated on the CPU.

vAttention (Prabhu et al., 2024) keeps each request's KV cache *contiguous in virtual memory*
and lets the GPU's page tables do what PagedAttention does in software: the driver maps
physical pages behind the virtual range as the request grows. This module measures, on the
length distributions of Chapter 5 (`SHAREGPT_LIKE`, `ALPACA_LIKE`), what that costs and saves:

- **waste vs page size** (`virtual_waste`, `waste_curves`): a page of one virtual tensor holds
  ``page_bytes / bytes_per_token`` tokens, so a page *is* a block of that many tokens, and the
  waste is Chapter 5's paged waste at that block size. With 2 MB pages and Llama-3-8B (2 KiB
  per token per tensor) that is a block of 1024 tokens; vAttention's 64–256 KB pages bring it
  to 32–128. The unit is the page of one tensor (the K or the V of one layer), as in vLLM,
  whose block of 16 tokens is 32 KiB per tensor for the same model;
- **the serving loop** (`simulate_virtual_serving`): requests admitted to slots of a
  `minillm.vmm.pagetable.PageTable` over a physical pool, with eager or **deferred
  reclamation** (a finished request's pages stay mapped and serve the next request of the
  slot), recording mapping calls per step;
- **hiding the mapping latency** (`mapping_overhead`): each (tensor, page) mapping costs
  ``map_latency_s`` of host time; done synchronously it adds to the step, done one step
  ahead on a background thread it only shows when it takes longer than a step;
- **GMLake's stitching** (`replay_allocations`): on an allocation trace, an allocator that needs
  physically contiguous chunks against one that stitches free pages from anywhere into one
  virtual range.

Memory is counted in bytes of physical pages. Invariants the tests check: mapped bytes ≥ used
bytes, waste under one page per (request, layer, K/V), no virtual page mapped twice, nothing
mapped after the last request leaves.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minillm.experiments.ch05_fragmentation import ALPACA_LIKE, SHAREGPT_LIKE, Requests, paged_waste
from minillm.vmm.pagetable import Geometry, OutOfPages, PageTable

__all__ = [
    "KVModel", "LLAMA3_8B_KV", "LLAMA2_7B_KV", "LLAMA3_70B_TP8_KV", "KV_MODELS", "KiB", "MiB", "PAGE_SIZES",
    "VLLM_BLOCK_SIZES", "virtual_waste", "waste_curves", "VirtualTrace", "simulate_virtual_serving",
    "mapping_overhead", "AllocationTrace", "random_allocation_trace", "requests_allocation_trace",
    "replay_allocations", "SHAREGPT_LIKE", "ALPACA_LIKE",
]

KiB, MiB = 1 << 10, 1 << 20
#: vAttention's small pages (64, 128, 256 KB, through a modified driver) and CUDA's 2 MB.
PAGE_SIZES = (64 * KiB, 128 * KiB, 256 * KiB, 2 * MiB)
VLLM_BLOCK_SIZES = (16, 32)


@dataclass(frozen=True)
class KVModel:
    """What one GPU caches per token: ``layers`` layers of ``kv_heads`` heads of ``head_dim``."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token in one virtual tensor (K or V of one layer)."""
        return self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def num_tensors(self) -> int:
        return 2 * self.layers

    def tokens_per_page(self, page_bytes: int) -> float:
        return page_bytes / self.bytes_per_token

    def geometry(self, max_slots: int, page_bytes: int, max_len: int) -> Geometry:
        return Geometry(self.num_tensors, max_slots, self.bytes_per_token, page_bytes, max_len)


LLAMA3_8B_KV = KVModel("Llama-3-8B", 32, 8, 128)
LLAMA2_7B_KV = KVModel("Llama-2-7B", 32, 32, 128)
#: Llama-3-70B's 8 KV heads split over 8 GPUs by tensor parallelism: one KV head per GPU.
LLAMA3_70B_TP8_KV = KVModel("Llama-3-70B, TP-8 (per GPU)", 80, 1, 128)
KV_MODELS = (LLAMA2_7B_KV, LLAMA3_8B_KV, LLAMA3_70B_TP8_KV)


# ----------------------------------------------------------------------- waste, closed forms
def _lengths(requests: Requests, when: str) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, weights)``: every length a request holds, each counted once per step
    (``"lifetime"``: ``p … p + o − 1``) or only the last one (``"final"``)."""
    if when == "final":
        return requests.peak_lens, np.ones(len(requests), dtype=np.int64)
    if when != "lifetime":
        raise ValueError(f"when must be 'lifetime' or 'final', got {when!r}")
    o = requests.output_lens
    starts = np.repeat(requests.prompt_lens, o)
    offsets = np.arange(o.sum()) - np.repeat(np.cumsum(o) - o, o)
    return starts + offsets, np.ones(int(o.sum()), dtype=np.int64)


def virtual_waste(requests: Requests, model: KVModel, page_bytes: int, *, when: str = "lifetime") -> float:
    """Fraction of mapped bytes that hold no token, with ``page_bytes`` pages and no retained
    pages (eager reclamation; mapping exactly what each step needs). Equal to Chapter 5's
    `paged_waste` with blocks of ``page_bytes / bytes_per_token`` tokens when that divides."""
    lens, w = _lengths(requests, when)
    bpt = model.bytes_per_token
    mapped = -(-lens * bpt // page_bytes) * page_bytes
    return float(1 - (lens * bpt * w).sum() / (mapped * w).sum())


def waste_curves(requests: Requests, model: KVModel, page_sizes: Sequence[int] = PAGE_SIZES,
                 block_sizes: Sequence[int] = VLLM_BLOCK_SIZES, *, when: str = "lifetime") -> dict:
    """The data of the waste plots.

    Returns ``{"model", "page_bytes", "tokens_per_page", "virtual" (waste per page size),
    "block_sizes", "paged" (Chapter 5's waste per block size), "block_bytes" (bytes per block
    and tensor), "mib_per_request" (mean mapped-but-unused MiB per request at its last step,
    all layers, per page size), "when"}``.
    """
    peak = requests.peak_lens
    bpt = model.bytes_per_token
    mib = [float(((-(-peak * bpt // pb) * pb - peak * bpt) * model.num_tensors).mean() / MiB) for pb in page_sizes]
    return {
        "model": model.name, "when": when,
        "page_bytes": list(page_sizes),
        "tokens_per_page": [model.tokens_per_page(pb) for pb in page_sizes],
        "virtual": [virtual_waste(requests, model, pb, when=when) for pb in page_sizes],
        "block_sizes": list(block_sizes),
        "block_bytes": [bs * bpt for bs in block_sizes],
        "paged": [paged_waste(requests, bs, when=when) for bs in block_sizes],
        "mib_per_request": mib,
    }


# ----------------------------------------------------------------------- the serving loop
@dataclass(frozen=True)
class VirtualTrace:
    """What `simulate_virtual_serving` saw, step by step (each array ``[steps]``).

    Attributes:
        running: requests in the batch.
        used, mapped, retained: bytes holding a token / mapped / mapped but needed by no
            active request (idle slots' pages, kept by deferred reclamation).
        map_calls, unmap_calls: (tensor, page) mappings made / undone during the step.
        preemptions: requests evicted to make room, in total.
        pool_bytes: the physical pool.
    """

    running: np.ndarray
    used: np.ndarray
    mapped: np.ndarray
    retained: np.ndarray
    map_calls: np.ndarray
    unmap_calls: np.ndarray
    preemptions: int
    pool_bytes: int

    @property
    def steps(self) -> int:
        return len(self.running)

    @property
    def waste(self) -> float:
        """Time-averaged fraction of mapped bytes that no active request uses (retained pages
        included)."""
        return float(1 - self.used.sum() / self.mapped.sum())

    @property
    def waste_excluding_retained(self) -> float:
        """The same without the retained pages: what the pages the requests need waste."""
        return float(1 - self.used.sum() / (self.mapped - self.retained).sum())


def simulate_virtual_serving(requests: Requests, model: KVModel, page_bytes: int, pool_bytes: int,
                             max_batch: int, *, reclamation: str = "deferred", lookahead: int = 0,
                             check: bool = False) -> VirtualTrace:
    """Serve ``requests`` (all waiting at step 0, first come first served) from a virtual-memory
    KV cache with ``max_batch`` slots over a physical pool of ``pool_bytes``.

    A request is admitted when a slot is idle and its prompt's pages can be mapped (free, or
    reclaimed from idle slots). Every step each running request produces a token; before the
    step, its pages must cover the tokens the step writes, plus ``lookahead`` more tokens
    mapped ahead of time (vAttention maps one step ahead). When a page cannot be had, the
    newest request is preempted (its slot released, and it waits at the head of the queue
    with what it generated as its prompt), as vLLM does. ``check`` asserts the invariants of
    `minillm.vmm.pagetable.PageTable` after every step (the tests use it).
    """
    geometry = model.geometry(max_batch, page_bytes, requests.max_len)
    table = PageTable(geometry, pool_bytes // page_bytes, reclamation)
    queue = deque([i, int(requests.prompt_lens[i]), int(requests.output_lens[i])] for i in range(len(requests)))
    running: list[list[int]] = []  # [request, tokens held L, outputs left]
    tr = {k: [] for k in ("running", "used", "mapped", "retained", "map", "unmap")}
    preemptions = 0

    while queue or running:
        maps0, unmaps0 = table.map_calls, table.unmap_calls
        while queue and len(running) < max_batch:  # admission
            i, tokens, left = queue[0]
            try:
                table.admit(i, tokens, lookahead)
            except OutOfPages:
                if i in table.requests:
                    table.release(i)
                if not running:
                    raise ValueError("the pool cannot hold the longest request on its own") from None
                break
            queue.popleft()
            running.append([i, tokens, left])
        # the step: every running request holds L tokens (the newest written this step)
        tr["running"].append(len(running))
        tr["used"].append(table.used_bytes())
        tr["mapped"].append(table.mapped_bytes())
        tr["retained"].append(table.retained_bytes())
        if check:
            _check(table)
        survivors = []
        for r in running:
            r[2] -= 1
            if r[2] == 0:
                table.release(r[0])
            else:
                r[1] += 1
                survivors.append(r)
        running = survivors
        k = 0
        while k < len(running):  # pages for the next step's tokens
            r = running[k]
            try:
                table.grow(r[0], r[1], lookahead)
                k += 1
            except OutOfPages:
                victim = running.pop()  # the newest
                table.release(victim[0])
                queue.appendleft(victim)
                preemptions += 1
        tr["map"].append(table.map_calls - maps0)
        tr["unmap"].append(table.unmap_calls - unmaps0)
    table.close()
    return VirtualTrace(np.asarray(tr["running"]), np.asarray(tr["used"], dtype=np.int64),
                        np.asarray(tr["mapped"], dtype=np.int64), np.asarray(tr["retained"], dtype=np.int64),
                        np.asarray(tr["map"], dtype=np.int64), np.asarray(tr["unmap"], dtype=np.int64),
                        preemptions, table.num_physical_pages * page_bytes)


def _check(table: PageTable) -> None:
    """The invariants: mapped ≥ used; waste < one page per (request, tensor); every virtual
    page mapped once and every physical page behind at most one virtual page."""
    g = table.geometry
    assert table.mapped_bytes() >= table.used_bytes()
    assert 0 <= table.waste_bytes() <= len(table.requests) * g.num_tensors * (g.page_bytes - 1)
    phys = list(table.mappings().values())
    assert len(phys) == len(set(phys))
    assert len(phys) + table.num_free_pages == table.num_physical_pages


# ----------------------------------------------------------------------- hiding the mapping latency
def mapping_overhead(map_calls_per_step, map_latency_s: float, step_time_s: float, *, ahead: bool) -> dict:
    """Host time the mappings add to the steps.

    Synchronous (``ahead=False``): a step's mappings run before its kernels, so each adds
    ``map_latency_s``. One step ahead (``ahead=True``, vAttention's overlap): a background
    thread maps the next step's pages while the GPU runs the current step (``step_time_s``),
    so a step waits only for the part that does not fit, ``max(0, calls · latency − step)``.

    Returns ``{"added_s", "steps_delayed", "fraction"}``: total added seconds, steps that
    wait at all, and the added time as a fraction of ``steps · step_time_s``.
    """
    work = np.asarray(map_calls_per_step, dtype=np.float64) * map_latency_s
    added = np.maximum(0.0, work - step_time_s) if ahead else work
    return {"added_s": float(added.sum()), "steps_delayed": int((added > 0).sum()),
            "fraction": float(added.sum() / (len(work) * step_time_s)) if len(work) else 0.0}


# ----------------------------------------------------------------------- GMLake: stitching
@dataclass(frozen=True)
class AllocationTrace:
    """Allocations and frees in time order: event ``k`` is ``(alloc_id, pages)`` with pages > 0
    for an allocation of that many pages, ``(alloc_id, 0)`` for the free of ``alloc_id``."""

    events: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.events)

    def peak_live_pages(self) -> int:
        live, peak, size = 0, 0, {}
        for a, pages in self.events:
            if pages:
                size[a] = pages
                live += pages
            else:
                live -= size.pop(a)
            peak = max(peak, live)
        return peak


def random_allocation_trace(n: int, seed: int = 0, mean_pages: float = 16.0, sigma: float = 1.0,
                            mean_lifetime: float = 8.0) -> AllocationTrace:
    """``n`` allocations of lognormal sizes (mean ``mean_pages``, at least 1), one allocated per
    tick, each freed after an exponential lifetime (mean ``mean_lifetime`` ticks): mixed sizes
    and interleaved lifetimes, the pattern that fragments a contiguous allocator."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean_pages) - sigma**2 / 2
    sizes = np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(int)
    ends = np.arange(n) + 1 + rng.exponential(mean_lifetime, n)
    return _trace(sizes, np.arange(n, dtype=float), ends)


def requests_allocation_trace(requests: Requests, model: KVModel, page_bytes: int, arrivals_per_step: float = 1.0
                              ) -> AllocationTrace:
    """KV caches reserved whole (a contiguous cache that knows each request's final length):
    request ``i`` arrives at step ``i / arrivals_per_step`` and holds ``p + o − 1`` tokens of
    all its layers for ``o`` steps."""
    pages = [int(-(-int(L) * model.bytes_per_token // page_bytes)) * model.num_tensors for L in requests.peak_lens]
    starts = np.arange(len(requests)) / arrivals_per_step
    return _trace(np.asarray(pages), starts, starts + requests.output_lens)


def _trace(sizes, starts, ends) -> AllocationTrace:
    events = [(float(s), 1, i, int(p)) for i, (s, p) in enumerate(zip(starts, sizes))]
    events += [(float(e), 0, i, 0) for i, e in enumerate(ends)]
    events.sort()  # at equal times frees (0) come before allocations (1)
    return AllocationTrace(tuple((i, p) for _, _, i, p in events))


def replay_allocations(trace: AllocationTrace, *, stitching: bool) -> dict:
    """Replay ``trace`` on physical memory seen as a line of pages that grows on demand.

    Without stitching (a caching allocator over ordinary ``cudaMalloc`` segments), an
    allocation needs a *run* of consecutive free pages: the first run that fits, else the
    line is extended (by the deficit, when a free run ends it). With stitching (GMLake), any
    free pages, wherever they are, are mapped into one new virtual range (lowest runs first),
    so the line grows only when the free pages in total are too few.

    Returns ``{"peak_reserved_pages", "peak_live_pages", "fragmentation" (1 − live/reserved at
    the peak), "stitched" (allocations made of more than one run), "mean_runs" (runs per
    stitched allocation)}``.
    """
    runs: list[list[int]] = []  # free runs [start, length], sorted by start, never adjacent
    end = 0                      # pages reserved so far (the line's length)
    owner: dict[int, list[tuple[int, int]]] = {}
    live = peak_live = stitched = runs_total = 0
    for a, pages in trace.events:
        if pages == 0:
            for piece in owner.pop(a):
                _give_back(runs, *piece)
                live -= piece[1]
            continue
        free_total = sum(r[1] for r in runs)
        fits = any(r[1] >= pages for r in runs) if not stitching else free_total >= pages
        if not fits:  # extend the line, continuing a free run that ends it
            tail = runs[-1][1] if runs and runs[-1][0] + runs[-1][1] == end else 0
            grow = pages - (free_total if stitching else tail)
            _give_back(runs, end, grow)
            end += grow
        pieces = _take_pieces(runs, pages, stitching)
        owner[a] = pieces
        if len(pieces) > 1:
            stitched += 1
            runs_total += len(pieces)
        live += pages
        peak_live = max(peak_live, live)
    return {"peak_reserved_pages": end, "peak_live_pages": peak_live,
            "fragmentation": 1 - peak_live / end if end else 0.0,
            "stitched": stitched, "mean_runs": runs_total / stitched if stitched else 1.0}


def _take_pieces(runs: list[list[int]], pages: int, stitching: bool) -> list[tuple[int, int]]:
    """Cut ``pages`` pages out of the free runs: from the first run that fits, or (stitching)
    from the lowest runs, as many as needed."""
    if not stitching:
        k = next(i for i, r in enumerate(runs) if r[1] >= pages)
        start = runs[k][0]
        runs[k][0] += pages
        runs[k][1] -= pages
        if runs[k][1] == 0:
            del runs[k]
        return [(start, pages)]
    pieces = []
    while pages:
        start, length = runs[0]
        n = min(length, pages)
        pieces.append((start, n))
        pages -= n
        if n == length:
            del runs[0]
        else:
            runs[0][0] += n
            runs[0][1] -= n
    return pieces


def _give_back(runs: list[list[int]], start: int, length: int) -> None:
    """Return ``[start, start + length)`` to the free runs, merging with its neighbours."""
    if length <= 0:
        return
    k = bisect.bisect_left(runs, [start, 0])
    runs.insert(k, [start, length])
    if k + 1 < len(runs) and runs[k][0] + runs[k][1] == runs[k + 1][0]:
        runs[k][1] += runs[k + 1][1]
        del runs[k + 1]
    if k > 0 and runs[k - 1][0] + runs[k - 1][1] == runs[k][0]:
        runs[k - 1][1] += runs[k][1]
        del runs[k]
