"""The bookkeeping of a virtual-memory KV cache: which virtual pages are backed by which
physical pages. Pure Python, no GPU: the CPU simulator of Chapter 11
(`minillm.experiments.ch11_virtual_memory`) and the real cache on the GPU
(`minillm.vmm.cache.VirtualKVCache`) share it; the GPU cache only adds the driver calls.

Layout (vAttention's)
---------------------
Every layer keeps its keys and its values in two **virtual tensors**, so a model of ``N``
layers has ``2N`` of them. Each virtual tensor is a reserved range of virtual addresses cut
into ``max_slots`` equal **slots**, one per request that can be resident at once (the batch
index). Slot ``s`` of a tensor starts at ``s · slot_bytes`` and is long enough for ``max_len``
tokens, rounded up to whole pages, so that no page is ever shared by two requests. Token ``t``
of the request in slot ``s`` sits at byte ``s · slot_bytes + t · bytes_per_token``: a request's
cache is contiguous, and a kernel written for a contiguous cache reads it with ordinary strides.

Nothing behind a slot exists until it is needed: as a request grows past the pages already
mapped, the next page of **every** virtual tensor in its slot is backed by a physical page.
All ``2N`` tensors of a slot grow together, so one number per slot (`PageTable.mapped_pages`)
says how many pages of each of its tensors are mapped.

Reclamation
-----------
- ``"eager"``: a finished request's pages are unmapped at once and go back to the free pool.
- ``"deferred"`` (vAttention): a finished request's slot keeps its pages mapped; the next
  request admitted to that slot starts with them, paying no mapping calls. Pages held by idle
  slots (or by a reused slot beyond its request's need) are **retained**: reclaimed, from the
  idle slots first, only when a request needs a page and the free pool is empty.

A ``mapper`` (``map(tensor, slot, page, phys)`` / ``unmap(tensor, slot, page, phys)``) is told
of every mapping change; the GPU cache's mapper calls ``cuMemMap`` and ``cuMemUnmap``.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Geometry", "Mapper", "OutOfPages", "PageTable", "RECLAMATION_POLICIES", "pages_for"]

RECLAMATION_POLICIES = ("eager", "deferred")


def pages_for(tokens: int, bytes_per_token: int, page_bytes: int) -> int:
    """Pages one virtual tensor needs for ``tokens`` tokens: ``ceil(tokens · bytes_per_token /
    page_bytes)``. A token may straddle two pages: the range is contiguous, so it does not matter."""
    if tokens < 0 or bytes_per_token < 1 or page_bytes < 1:
        raise ValueError(f"bad sizes: tokens={tokens}, bytes_per_token={bytes_per_token}, page_bytes={page_bytes}")
    return -(-tokens * bytes_per_token // page_bytes)


@dataclass(frozen=True)
class Geometry:
    """The shape of the virtual reservation.

    Attributes:
        num_tensors: virtual tensors, ``2 · layers`` (K and V of each layer).
        max_slots: requests resident at once (the largest batch).
        bytes_per_token: bytes of one token in one tensor, ``kv_heads · head_dim · dtype_bytes``.
        page_bytes: the mapping granularity (2 MB on current NVIDIA GPUs through ``cuMemCreate``).
        max_len: the longest request, in tokens.
    """

    num_tensors: int
    max_slots: int
    bytes_per_token: int
    page_bytes: int
    max_len: int

    def __post_init__(self):
        if min(self.num_tensors, self.max_slots, self.bytes_per_token, self.page_bytes, self.max_len) < 1:
            raise ValueError(f"every size must be >= 1: {self}")

    @property
    def pages_per_slot(self) -> int:
        """Pages of one slot of one tensor: room for ``max_len`` tokens, whole pages."""
        return pages_for(self.max_len, self.bytes_per_token, self.page_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.pages_per_slot * self.page_bytes

    @property
    def tensor_bytes(self) -> int:
        """Virtual bytes reserved per tensor (``max_slots`` slots)."""
        return self.max_slots * self.slot_bytes

    @property
    def virtual_bytes(self) -> int:
        """Virtual bytes reserved in all (costs nothing physical)."""
        return self.num_tensors * self.tensor_bytes

    def pages_for(self, tokens: int) -> int:
        """`pages_for` of this geometry (the sizes are checked once, at creation)."""
        if tokens < 0:
            raise ValueError(f"bad sizes: tokens={tokens}")
        return -(-tokens * self.bytes_per_token // self.page_bytes)

    def token_offset(self, slot: int, token: int) -> int:
        """Byte offset of ``token`` of the request in ``slot``, from the tensor's base."""
        return slot * self.slot_bytes + token * self.bytes_per_token


class Mapper(Protocol):
    def map(self, tensor: int, slot: int, page: int, phys: int) -> None: ...

    def unmap(self, tensor: int, slot: int, page: int, phys: int) -> None: ...


class OutOfPages(RuntimeError):
    """No free physical page, and nothing left to reclaim."""


class PageTable:
    """Slots, their mapped pages and the physical pool (``num_physical_pages`` pages).

    ``admit(req)`` gives a request a slot, ``grow(req, tokens)`` maps what ``tokens`` tokens
    need, ``release(req)`` ends it (unmapping or not, by ``reclamation``), ``close()`` unmaps
    everything. Counters: ``map_calls``, ``unmap_calls`` (one per (tensor, page)).
    """

    def __init__(self, geometry: Geometry, num_physical_pages: int, reclamation: str = "deferred",
                 mapper: Mapper | None = None):
        if reclamation not in RECLAMATION_POLICIES:
            raise ValueError(f"reclamation must be one of {RECLAMATION_POLICIES}, got {reclamation!r}")
        self.geometry = geometry
        self.reclamation = reclamation
        self.mapper = mapper
        self.num_physical_pages = int(num_physical_pages)
        self._free_phys = list(range(self.num_physical_pages - 1, -1, -1))  # a stack: low ids first
        self._phys: dict[tuple[int, int, int], int] = {}  # (tensor, slot, page) -> physical page
        self.mapped_pages = [0] * geometry.max_slots      # pages mapped in each tensor of a slot
        self.tokens = [0] * geometry.max_slots            # tokens of the request in a slot (0 if idle)
        self._slot_of: dict[Hashable, int] = {}
        self._idle = set(range(geometry.max_slots))
        # pages_for(tokens) summed over the active slots, kept up to date by admit, grow and
        # release: the engine asks for it for every sequence of every step.
        self._needed_pages = 0
        self.map_calls = 0
        self.unmap_calls = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_pages(self) -> int:
        return len(self._free_phys)

    @property
    def requests(self) -> list:
        return list(self._slot_of)

    @property
    def num_requests(self) -> int:
        """Active requests (slots in use)."""
        return len(self._slot_of)

    @property
    def needed_pages(self) -> int:
        """Pages of one tensor the active requests need: ``pages_for(tokens)`` summed over
        the active slots (O(1): a running count)."""
        return self._needed_pages

    def slot(self, req: Hashable) -> int:
        return self._slot_of[req]

    def physical(self, tensor: int, slot: int, page: int) -> int | None:
        """The physical page behind a virtual page, or None when it is not mapped."""
        return self._phys.get((tensor, slot, page))

    def mappings(self) -> dict[tuple[int, int, int], int]:
        return dict(self._phys)

    def mapped_bytes(self) -> int:
        return len(self._phys) * self.geometry.page_bytes

    def used_bytes(self) -> int:
        """Bytes holding a token: ``tokens · bytes_per_token`` per tensor of each active slot."""
        g = self.geometry
        return sum(self.tokens[s] for s in self._slot_of.values()) * g.bytes_per_token * g.num_tensors

    def needed_bytes(self) -> int:
        """Bytes of the pages the active requests need (``pages_for(tokens)`` per tensor)."""
        g = self.geometry
        return self._needed_pages * g.page_bytes * g.num_tensors

    def waste_bytes(self) -> int:
        """Mapped but unused bytes in the pages active requests need: under one page per
        (request, tensor)."""
        return self.needed_bytes() - self.used_bytes()

    def retained_bytes(self) -> int:
        """Mapped bytes no active request needs: idle slots' pages, and a reused slot's pages
        beyond its request's need (only ``"deferred"`` keeps any). Reclaimable on demand."""
        return self.mapped_bytes() - self.needed_bytes()

    # ----------------------------------------------------------------- requests
    def admit(self, req: Hashable, tokens: int = 0, ahead: int = 0) -> int:
        """Give ``req`` an idle slot and return it. Under ``"deferred"``, the idle slot whose
        retained pages come closest to covering ``tokens`` (the fewest that are enough, else
        the most), so that mapping calls are saved and few pages are held in excess."""
        if req in self._slot_of:
            raise ValueError(f"request {req!r} already has slot {self._slot_of[req]}")
        if not self._idle:
            raise OutOfPages("no idle slot: the batch is full")
        need = self.geometry.pages_for(min(tokens + ahead, self.geometry.max_len))
        enough = [s for s in self._idle if self.mapped_pages[s] >= need]
        if enough:
            slot = min(enough, key=lambda s: (self.mapped_pages[s], s))
        else:
            slot = max(self._idle, key=lambda s: (self.mapped_pages[s], -s))
        self._idle.remove(slot)
        self._slot_of[req] = slot
        self.tokens[slot] = 0
        if tokens or ahead:
            try:
                self.grow(req, tokens, ahead)
            except OutOfPages:  # admission fails as a whole: the slot is idle again
                del self._slot_of[req]
                self._idle.add(slot)
                raise
        return slot

    def grow(self, req: Hashable, tokens: int, ahead: int = 0) -> int:
        """Make room for ``tokens`` tokens (the request's new length), and map ``ahead`` more
        tokens' pages in advance (capped at ``max_len``); returns how many (tensor, page)
        mappings it made. Raises `OutOfPages` when the pool runs dry, having undone the
        mappings of this call (pages reclaimed from other slots stay free)."""
        g = self.geometry
        slot = self._slot_of[req]
        if tokens > g.max_len:
            raise ValueError(f"{tokens} tokens: more than max_len={g.max_len}")
        need = g.pages_for(min(tokens + ahead, g.max_len))
        made, start = 0, self.mapped_pages[slot]
        while self.mapped_pages[slot] < need:
            page = self.mapped_pages[slot]
            if len(self._free_phys) < g.num_tensors:
                self.reclaim(g.num_tensors - len(self._free_phys), keep=slot)
            if len(self._free_phys) < g.num_tensors:
                self._shrink(slot, start)  # all or nothing: undo this call's mappings
                raise OutOfPages(f"request {req!r} needs page {page} of {g.num_tensors} tensors; "
                                 f"{len(self._free_phys)} physical pages free and nothing to reclaim")
            for t in range(g.num_tensors):
                self._map(t, slot, page)
            made += g.num_tensors
            self.mapped_pages[slot] += 1
        if tokens > self.tokens[slot]:
            self._needed_pages += g.pages_for(tokens) - g.pages_for(self.tokens[slot])
            self.tokens[slot] = tokens
        return made

    def release(self, req: Hashable) -> int:
        """End ``req``; returns the (tensor, page) unmappings made (0 under ``"deferred"``)."""
        slot = self._slot_of.pop(req)
        self._needed_pages -= self.geometry.pages_for(self.tokens[slot])
        self.tokens[slot] = 0
        self._idle.add(slot)
        if self.reclamation == "eager":
            return self._shrink(slot, 0)
        return 0

    def reclaim(self, pages: int, keep: int | None = None) -> int:
        """Unmap at least ``pages`` physical pages that no active request needs (idle slots
        first, the most-mapped first; then pages of active slots beyond their need), other
        than slot ``keep``'s. Returns the physical pages freed (a multiple of ``num_tensors``)."""
        g = self.geometry
        freed = 0
        idle = sorted(self._idle, key=lambda s: -self.mapped_pages[s])
        active = [s for s in self._slot_of.values() if s != keep]
        for slot in idle + active:
            if freed >= pages:
                break
            floor = g.pages_for(self.tokens[slot]) if slot not in self._idle else 0
            while self.mapped_pages[slot] > floor and freed < pages:
                freed += self._shrink(slot, self.mapped_pages[slot] - 1)
        return freed

    def close(self) -> int:
        """Release every request and unmap every page; returns the unmappings made."""
        for req in list(self._slot_of):
            self.release(req)
        undone = sum(self._shrink(s, 0) for s in range(self.geometry.max_slots))
        assert not self._phys and len(self._free_phys) == self.num_physical_pages
        return undone

    # ----------------------------------------------------------------- internals
    def _map(self, tensor: int, slot: int, page: int) -> None:
        key = (tensor, slot, page)
        if key in self._phys:
            raise AssertionError(f"virtual page {key} is already mapped")
        phys = self._free_phys.pop()
        if self.mapper is not None:
            try:
                self.mapper.map(tensor, slot, page, phys)
            except BaseException:
                self._free_phys.append(phys)
                raise
        self._phys[key] = phys
        self.map_calls += 1

    def _shrink(self, slot: int, keep_pages: int) -> int:
        """Unmap pages ``keep_pages ..`` of ``slot`` in every tensor (last page first)."""
        undone = 0
        for page in range(self.mapped_pages[slot] - 1, keep_pages - 1, -1):
            for t in range(self.geometry.num_tensors):
                phys = self._phys.pop((t, slot, page))
                if self.mapper is not None:
                    self.mapper.unmap(t, slot, page, phys)
                self._free_phys.append(phys)
                self.unmap_calls += 1
                undone += 1
        self.mapped_pages[slot] = min(self.mapped_pages[slot], keep_pages)
        return undone
