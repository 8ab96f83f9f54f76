"""Chapter 11: the engine on a virtual-memory KV cache (``EngineConfig(kv_cache="virtual")``).

The engine of Chapter 9 talks to a block manager (admission, slots, forks, frees) and to a
paged cache (per-layer K/V pools and the attention kernels). A contiguous per-request cache
*is* the paged layout with one block per sequence (`minillm.kernels.ch05_paged_attention.
contiguous_as_paged`): block ``s`` is slot ``s``'s whole stretch of ``capacity`` tokens. So
the virtual cache of Chapter 11 plugs into the unchanged engine as:

- `SlotKVCache`: the cache the model sees. Per layer ``k[layer], v[layer]: [max_slots,
  capacity, kv_heads, head_dim]``, so ``block_size = capacity`` and every block table has
  one column, ``[slot]``: the attention kernels of Chapters 4, 5 and 7 run unchanged and never
  look a block up past the first (vAttention's point: no per-block indirection).
- `VirtualBlockManager`: the block manager's interface over the page table of
  `minillm.vmm.pagetable`. Each sequence gets a slot; ``slot_mapping = slot · capacity +
  position``; admission is counted in **pages** (one "block" of this manager is one page of
  every layer's K and V: ``page_bytes / bytes_per_token`` tokens of one sequence), and pages
  are mapped as a sequence grows. A finished sequence's slot keeps its pages for the next
  sequence admitted to it (deferred reclamation), which is what keeps mapping calls off the
  steady state: a slot reused by a request no longer than the last one maps nothing.

What changes against the paged cache:

- **No sharing.** There is no prefix cache (vAttention has none; `EngineConfig` turns
  ``enable_prefix_caching`` off in virtual mode), and a fork (``n > 1`` samples, beam search)
  *copies* the parent's tokens into the child's own slot instead of sharing blocks. The copy
  is lazy, like paged copy-on-write: `fork` only records it; the child's first
  `append_slots` maps the child's pages and copies the parent's rows (only the mapped, used
  rows: reading an unmapped page faults the GPU). Until then the parent's slot is kept, even
  if the parent itself is freed meanwhile, so its rows cannot be reclaimed under the copy.
- **Pages, not blocks.** With CUDA's 2 MB pages a page of one tensor holds ``2 MB /
  bytes_per_token`` tokens (4096 for 4 KV heads of 64 in bf16), far more than a 16-token
  block: a short request holds a mostly empty page in every layer. That internal
  fragmentation is the price of the hardware page size (vAttention patches the driver for
  64-256 KB pages).

On a CPU (and in the tests) the same manager runs over `SimulatedVirtualCache`: the page
table's bookkeeping with plain torch tensors behind it and no driver. Its page is
``block_size`` tokens of one tensor, so one "block" of the manager is one block of the paged
pool and both modes get the same pool from the same memory budget. ``poison=True`` fills
every page that is not mapped with NaN, so a kernel that reads memory the GPU would fault on
shows up as NaN outputs.

`build_kv_cache` builds the manager and the cache of either mode for the engine.
"""
from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from minillm.model.paged import BACKENDS, PagedKVCache
from minillm.paged import Admission, AppendResult, BlockManager, BlockManagerStats, blocks_for
from minillm.paged.block_manager import PENDING, as_token_list, check_token_ids, gather_step_inputs
from minillm.paged.errors import DuplicateSequence, OutOfBlocks, RequestTooLong, UnknownSequence
from minillm.vmm.pagetable import Geometry, OutOfPages, PageTable, pages_for

__all__ = ["KV_CACHE_MODES", "OutOfSlots", "SimulatedVirtualCache", "SlotKVCache", "VirtualBlockManager",
           "build_kv_cache", "kv_blocks_needed", "page_group_bytes", "slot_capacity"]

KV_CACHE_MODES = ("paged", "virtual")


class OutOfSlots(OutOfBlocks):
    """Every slot of the virtual cache is taken (by live sequences, or by a freed parent whose
    rows a fork has yet to copy). Like `OutOfBlocks`, nothing was changed."""

    def __init__(self, what: str, slots: int):
        self.needed, self.available = 1, 0
        Exception.__init__(self, f"{what} needs a slot of the virtual KV cache but all {slots} are taken. "
                                 f"Nothing was changed: free or preempt a sequence and retry.")


# == the CPU stand-in of VirtualKVCache ========================================================
class SimulatedVirtualCache:
    """`minillm.vmm.VirtualKVCache`'s interface over plain torch tensors: the same `PageTable`
    (slots, pages, deferred reclamation, mapping counters), no driver calls.

    ``k[layer], v[layer]: [max_batch, max_len, kv_heads, head_dim]`` (``torch.empty``: the
    operating system commits a large allocation's memory only where it is written). Tensor
    ``2l`` of the page table is the K of layer ``l``, ``2l + 1`` its V (as on the GPU).

    Args:
        page_bytes: bytes of one page of one tensor.
        max_pages: the physical pool, in pages of one tensor.
        poison: fill the memory of every unmapped page with NaN (at creation and at each unmap).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_batch: int, max_len: int, *,
                 page_bytes: int, max_pages: int, dtype=torch.float32, device="cpu", reclamation: str = "deferred",
                 poison: bool = False):
        self.dtype, self.device = dtype, torch.device(device)
        elem = torch.empty(0, dtype=dtype).element_size()
        self.page_bytes = int(page_bytes)
        self.geometry = Geometry(2 * layers, max_batch, kv_heads * head_dim * elem, self.page_bytes, max_len)
        self.poison = poison
        self.table = PageTable(self.geometry, max_pages, reclamation, mapper=self if poison else None)
        shape = (max_batch, max_len, kv_heads, head_dim)
        make = (lambda: torch.full(shape, float("nan"), dtype=dtype, device=device)) if poison else \
            (lambda: torch.empty(shape, dtype=dtype, device=device))
        tensors = [make() for _ in range(2 * layers)]
        self.k, self.v = tensors[0::2], tensors[1::2]
        self.closed = False

    # the mapper of the page table (only when poisoning)
    def map(self, tensor: int, slot: int, page: int, phys: int) -> None:
        pass  # a freshly mapped page holds whatever it held: stale data, or NaN if never written

    def unmap(self, tensor: int, slot: int, page: int, phys: int) -> None:
        t = (self.k if tensor % 2 == 0 else self.v)[tensor // 2]
        bpt = self.geometry.bytes_per_token
        first, end = page * self.page_bytes // bpt, -(-(page + 1) * self.page_bytes // bpt)
        t[slot, first:end] = float("nan")  # every row that touches the page

    # VirtualKVCache's methods
    def admit(self, req: Hashable, tokens: int = 0) -> int:
        return self.table.admit(req, tokens)

    def grow(self, req: Hashable, tokens: int, ahead: int = 0) -> int:
        return self.table.grow(req, tokens, ahead)

    def release(self, req: Hashable) -> int:
        return self.table.release(req)

    def slot(self, req: Hashable) -> int:
        return self.table.slot(req)

    def close(self) -> None:
        if not self.closed:
            self.table.close()
            self.k, self.v = [], []
            self.closed = True


# == the cache the model sees ==================================================================
class SlotKVCache(PagedKVCache):
    """A virtual (or simulated) cache seen as a paged cache with one block per slot.

    ``k[layer], v[layer]: [max_slots, capacity, kv_heads, head_dim]`` (the backing cache's
    tensors, no copy): ``num_blocks = max_slots``, ``block_size = capacity``. ``pool`` is
    ``k[0]`` (what the runner asks of it: device, dtype); there is no single pool tensor.

    Args:
        backing: a `minillm.vmm.VirtualKVCache` or a `SimulatedVirtualCache`.
        backend, softmax_phi: as `PagedKVCache`.
    """

    def __init__(self, backing, backend: str = "auto", softmax_phi: float | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backing = backing
        self.k, self.v = list(backing.k), list(backing.v)
        self.pool = self.k[0]
        self.kernels = self._pick_kernels(backend)
        self.softmax_phi = softmax_phi
        # Give the mapped memory back when the engine is dropped (not at interpreter exit,
        # when the CUDA context may already be gone).
        self._finalizer = weakref.finalize(self, backing.close)
        self._finalizer.atexit = False

    @property
    def num_blocks(self) -> int:
        return self.pool.shape[0]

    @property
    def block_size(self) -> int:
        return self.pool.shape[1]

    @property
    def block_bytes(self) -> int:
        """Virtual bytes of one slot in every layer, K and V (mapped only as it fills)."""
        g = self.backing.geometry
        return g.num_tensors * g.slot_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the pages mapped now."""
        return self.backing.table.mapped_bytes()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """No block is ever shared, so there is nothing to copy on write (forks copy rows in
        `VirtualBlockManager.append_slots`)."""
        if copies:
            raise ValueError(f"a slot cache shares no blocks: cannot copy {list(copies)[:3]}")

    def copy_rows(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        """``[dst_slot, :num_tokens] = [src_slot, :num_tokens]`` in every layer, for K and V:
        a fork's copy of its parent (both ranges must be mapped)."""
        for t in (*self.k, *self.v):
            t[dst_slot, :num_tokens].copy_(t[src_slot, :num_tokens])

    def close(self) -> None:
        """Unmap and release everything (`VirtualKVCache.close`); the cache is unusable after."""
        self._finalizer()


# == the block manager's interface over the page table =========================================
@dataclass
class _Seq:
    token_ids: list[int]
    key: int | None            # its admission in the page table (None: a fork whose copy is pending)
    source: int | None = None  # pending fork: the key whose first len(token_ids) rows it copies


class VirtualBlockManager:
    """The `minillm.paged.BlockManager` interface the engine uses, over slots of a virtual
    cache (see the module docstring).

    Units: one **block** here is one page of every tensor (K and V of every layer) of one
    slot, ``block_size`` tokens; ``num_blocks`` is the physical pool in those units.
    ``block_table(seq) == [slot]`` and ``slot_mapping`` is ``slot · capacity + position``.

    Args:
        cache: the `SlotKVCache` (its backing cache holds the page table).
        ahead_tokens: map pages for this many tokens past each sequence's length when free
            pages allow (never by reclaiming another slot's), so that fewer steps map.
    """

    def __init__(self, cache: SlotKVCache, ahead_tokens: int = 0):
        self.cache, self.backing = cache, cache.backing
        self.table: PageTable = self.backing.table
        g = self.table.geometry
        self.geometry = g
        self.capacity = cache.block_size
        self.block_size = max(1, g.page_bytes // g.bytes_per_token)
        self.num_blocks = self.table.num_physical_pages // g.num_tensors
        self.enable_prefix_caching = False
        self.ahead_tokens = int(ahead_tokens)
        self.stats = BlockManagerStats()
        self.num_forks = 0            # forks made
        self.fork_copied_tokens = 0   # rows copied by forks (in each tensor)
        self._seqs: dict[Hashable, _Seq] = {}
        self._holders: dict[int, int] = {}   # key -> pending forks that will copy from it
        self._orphans: set[int] = set()      # keys of freed sequences kept for a pending copy
        self._keys = 0
        # The driver's calls need the device's context current in the calling thread (the
        # server steps the engine in a thread of its own): bound on first use in each thread.
        device = getattr(self.backing, "device", torch.device("cpu"))
        self._cuda_index = device.index if device.type == "cuda" else None
        self._bound_thread = threading.get_ident()

    # == counters ================================================================================
    @property
    def num_used_blocks(self) -> int:
        """Blocks (pages of every tensor) the live sequences' tokens need, and the freed
        parents kept for a pending copy: those are exactly the page table's active requests
        (every admission of the table is this manager's), whose pages it counts as they grow."""
        return self.table.needed_pages

    @property
    def num_available_blocks(self) -> int:
        """Blocks that can be handed out now: free pages, and mapped pages no live sequence
        needs (idle slots', and those mapped ahead), which are reclaimed on demand."""
        return self.num_blocks - self.num_used_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks of pages not mapped anywhere."""
        return self.table.num_free_pages // self.geometry.num_tensors

    @property
    def num_cached_blocks(self) -> int:
        """Blocks of pages mapped but not needed (retained by deferred reclamation, or ahead)."""
        g = self.geometry
        return self.table.mapped_bytes() // (g.page_bytes * g.num_tensors) - self.num_used_blocks

    @property
    def num_evictions(self) -> int:
        return 0

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_free_slots(self) -> int:
        return self.geometry.max_slots - self.table.num_requests

    # == read-only views =========================================================================
    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._seqs)

    def seq_ids(self) -> list:
        return list(self._seqs)

    def has_slot(self, seq_id) -> bool:
        """Whether ``seq_id`` holds a slot (False for a fork not yet appended to)."""
        return self._get(seq_id, "read").key is not None

    def block_table(self, seq_id) -> list[int]:
        """``[slot]``: one block, the sequence's whole slot."""
        return [self._slot(seq_id, "read the block table of")]

    def num_tokens(self, seq_id) -> int:
        return len(self._get(seq_id, "read").token_ids)

    def token_ids(self, seq_id) -> tuple[int, ...]:
        return tuple(self._get(seq_id, "read").token_ids)

    def num_cached_tokens(self, seq_id) -> int:
        self._get(seq_id, "read")
        return 0

    def slot(self, seq_id, position: int) -> int:
        n = self.num_tokens(seq_id)
        if not 0 <= position < n:
            raise IndexError(f"position {position} out of range for sequence {seq_id!r} of {n} tokens")
        return self._slot(seq_id, "read") * self.capacity + position

    def slot_mapping(self, seq_id, start: int = 0, stop: int | None = None) -> list[int]:
        n = self.num_tokens(seq_id)
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise IndexError(f"positions {start}:{stop} out of range for sequence {seq_id!r} of {n} tokens")
        base = self._slot(seq_id, "read") * self.capacity
        return list(range(base + start, base + stop))

    def step_inputs(self, seq_ids: Sequence, counts: Sequence[int]
                    ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
        """``(token_ids, positions, slots, lengths, block_tables)`` of a step over the last
        ``counts[i]`` tokens of each ``seq_ids[i]``: `minillm.paged.BlockManager.step_inputs`
        (block tables of one column, ``[slot]``)."""
        seqs = ((seq_id, self._get(seq_id, "read").token_ids, [self._slot(seq_id, "read")]) for seq_id in seq_ids)
        return gather_step_inputs(seqs, counts, self.capacity)

    # == admission ===============================================================================
    def blocks_needed(self, num_tokens: int) -> int:
        return self.geometry.pages_for(num_tokens)

    def can_allocate(self, request: int | Sequence[int]) -> Admission:
        try:
            num_tokens = operator.index(request)
        except TypeError:
            num_tokens = len(check_token_ids(request, "ask about"))
        if num_tokens < 1:
            raise ValueError(f"a request needs at least one token, got {num_tokens}")
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_blocks or num_tokens > self.capacity:
            return Admission.NEVER_FITS
        ok = needed <= self.num_available_blocks and self.num_free_slots > 0
        return Admission.FITS_NOW if ok else Admission.FITS_LATER

    def num_cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """0: there is no prefix cache."""
        check_token_ids(token_ids, "look up")
        return 0

    def blocks_to_append(self, seq_ids, num_tokens: int = 1) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        seq_ids = list(seq_ids)
        return self._blocks_for_appends([self._get(s, "append to") for s in seq_ids], [num_tokens] * len(seq_ids))

    def can_append(self, seq_ids, num_tokens: int = 1) -> bool:
        seq_ids = list(seq_ids)
        slots = sum(self._seqs[s].key is None for s in seq_ids if s in self._seqs)
        return self.blocks_to_append(seq_ids, num_tokens) <= self.num_available_blocks and slots <= self.num_free_slots

    # == operations ==============================================================================
    def allocate(self, seq_id, token_ids: Sequence[int]) -> int:
        """Give a new sequence a slot and the pages of its prompt; returns 0 (nothing cached).

        Raises `DuplicateSequence`, `RequestTooLong` (more pages than the pool, or more tokens
        than a slot holds), `OutOfBlocks` / `OutOfSlots` (not now), ``ValueError``."""
        if seq_id in self._seqs:
            raise DuplicateSequence(seq_id, "allocate")
        tokens = check_token_ids(token_ids, "allocate")
        if not tokens:
            raise ValueError(f"cannot allocate sequence {seq_id!r}: the prompt is empty")
        needed = self.blocks_needed(len(tokens))
        if needed > self.num_blocks:
            raise RequestTooLong(len(tokens), self.block_size, needed, self.num_blocks)
        if len(tokens) > self.capacity:
            raise ValueError(f"sequence {seq_id!r} of {len(tokens)} tokens is longer than a slot ({self.capacity})")
        if self.num_free_slots < 1:
            raise OutOfSlots(f"allocating sequence {seq_id!r}", self.geometry.max_slots)
        if needed > self.num_available_blocks:
            self._out_of_blocks(f"allocating sequence {seq_id!r} ({len(tokens)} tokens)", needed)
        key = self._admit(len(tokens), f"allocating sequence {seq_id!r}")
        self._seqs[seq_id] = _Seq(tokens, key)
        self._map_ahead([key])
        self.stats.prompt_tokens += len(tokens)
        return 0

    def append_slots(self, seq_ids: Sequence, token_ids) -> AppendResult:
        """Append tokens to several sequences at once; returns their slots (no copies: a
        pending fork copies its parent's rows here, before the step writes anything).
        All or nothing: raises `OutOfBlocks` / `OutOfSlots` having changed nothing."""
        seq_ids = list(seq_ids)
        if len(token_ids) != len(seq_ids):
            raise ValueError(f"got {len(seq_ids)} sequences but {len(token_ids)} token entries")
        batches = [check_token_ids(as_token_list(t), "append to sequence", s) for s, t in zip(seq_ids, token_ids)]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"append_slots got a sequence twice in {seq_ids!r}")
        seqs = [self._get(s, "append to") for s in seq_ids]
        for sid, seq, toks in zip(seq_ids, seqs, batches):
            if len(seq.token_ids) + len(toks) > self.capacity:
                raise ValueError(f"sequence {sid!r} would have {len(seq.token_ids) + len(toks)} tokens, more than "
                                 f"a slot holds ({self.capacity})")
        pending = [seq for seq in seqs if seq.key is None]
        if len(pending) > self.num_free_slots:
            raise OutOfSlots(f"appending to {len(seqs)} sequence(s)", self.geometry.max_slots)
        needed = self._blocks_for_appends(seqs, [len(t) for t in batches])
        if needed > self.num_available_blocks:
            self._out_of_blocks(f"appending to {len(seqs)} sequence(s)", needed)

        # Pending forks first: each takes a slot, maps its pages and copies its parent's rows.
        for seq, toks in zip(seqs, batches):
            if seq.key is None:
                n = len(seq.token_ids)
                seq.key = self._admit(n + len(toks), "copying a fork")
                self.cache.copy_rows(self.table.slot(seq.source), self.table.slot(seq.key), n)
                self.fork_copied_tokens += n
                self._drop_holder(seq.source)
                seq.source = None
        slots: list[int] = []
        for seq, toks in zip(seqs, batches):
            n = len(seq.token_ids)
            self._grow(seq.key, n + len(toks))
            base = self.table.slot(seq.key) * self.capacity
            slots.extend(range(base + n, base + n + len(toks)))
            seq.token_ids.extend(toks)
        self._map_ahead([seq.key for seq in seqs])
        return AppendResult(tuple(slots), ())

    def append_slot(self, seq_id, token_id: int) -> AppendResult:
        return self.append_slots([seq_id], [token_id])

    def append_pending(self, seq_ids) -> AppendResult:
        """One slot per sequence for a token whose id is not known yet
        (`minillm.paged.BlockManager.append_pending`); `set_last_token` gives it.

        The step before is still running then, and may write into the slot of a sequence
        freed since: so the pages come from the free pool only, never reclaimed (unmapped)
        from an idle slot; `OutOfBlocks` (nothing changed) when the free pool is short."""
        seq_ids = list(seq_ids)
        seqs = [self._get(s, "append to") for s in seq_ids]
        if any(seq.key is None for seq in seqs):
            raise ValueError("append_pending cannot copy a pending fork (its parent's rows are needed first)")
        needed = self._blocks_for_appends(seqs, [1] * len(seqs))
        if needed > self.num_free_blocks:
            self._out_of_blocks(f"appending ahead to {len(seqs)} sequence(s) from free pages", needed)
        result = self.append_slots(seq_ids, [0] * len(seq_ids))
        for seq_id in seq_ids:
            self._seqs[seq_id].token_ids[-1] = PENDING
        return result

    def set_last_token(self, seq_id, token_id: int) -> None:
        """Give the token `append_pending` appended to ``seq_id`` its id."""
        tokens = self._get(seq_id, "set the last token of").token_ids
        if tokens[-1] != PENDING:
            raise ValueError(f"sequence {seq_id!r} has no pending token")
        tokens[-1] = check_token_ids([token_id], "set the last token of sequence", seq_id)[0]

    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` a copy of ``parent_id``. Costs nothing now: the child's first
        append takes a slot, maps its pages and copies the parent's rows; until then the
        parent's slot is kept, even if the parent is freed."""
        parent = self._get(parent_id, "fork from")
        if child_id in self._seqs:
            raise DuplicateSequence(child_id, "fork into")
        source = parent.key if parent.key is not None else parent.source
        self._holders[source] = self._holders.get(source, 0) + 1
        self._seqs[child_id] = _Seq(list(parent.token_ids), None, source)
        self.num_forks += 1

    def free(self, seq_id) -> None:
        """End ``seq_id``: its slot goes idle with its pages still mapped (deferred
        reclamation), unless a pending fork has yet to copy from it."""
        seq = self._get(seq_id, "free")
        del self._seqs[seq_id]
        if seq.key is None:
            self._drop_holder(seq.source)
        elif self._holders.get(seq.key):
            self._orphans.add(seq.key)
        else:
            self.backing.release(seq.key)

    # == internals ===============================================================================
    def _get(self, seq_id, action: str) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(seq_id, action) from None

    def _slot(self, seq_id, action: str) -> int:
        seq = self._get(seq_id, action)
        if seq.key is None:
            raise ValueError(f"sequence {seq_id!r} is a fork whose slot is taken at its first append_slots")
        return self.table.slot(seq.key)

    def _blocks_for_appends(self, seqs: list[_Seq], counts: list[int]) -> int:
        """New blocks the appends need: the growth of each sequence, and the whole of a
        pending fork (its copy of the parent, and the new tokens)."""
        g = self.geometry
        out = 0
        for seq, k in zip(seqs, counts):
            n = len(seq.token_ids)
            out += g.pages_for(n + k) - (0 if seq.key is None else g.pages_for(n))
        return out

    def _bind_context(self) -> None:
        if self._cuda_index is not None and threading.get_ident() != self._bound_thread:
            from minillm.vmm import driver as drv

            drv.ensure_context(self._cuda_index)
            self._bound_thread = threading.get_ident()

    def _admit(self, tokens: int, what: str) -> int:
        self._bind_context()
        key = self._keys
        self._keys += 1
        try:
            self.backing.admit(key, tokens)
        except OutOfPages:  # the checks above make this unreachable; keep the manager's contract anyway
            self._out_of_blocks(what, self.blocks_needed(tokens))
        return key

    def _grow(self, key: int, tokens: int) -> None:
        self._bind_context()
        try:
            self.backing.grow(key, tokens)
        except OutOfPages:
            self._out_of_blocks("growing a sequence", self.blocks_needed(tokens))

    def _map_ahead(self, keys: list[int]) -> None:
        """Map ``ahead_tokens`` past each length from free pages only."""
        if self.ahead_tokens <= 0:
            return
        g, t = self.geometry, self.table
        for key in keys:
            slot = t.slot(key)
            want = g.pages_for(min(t.tokens[slot] + self.ahead_tokens, g.max_len)) - t.mapped_pages[slot]
            if 0 < want * g.num_tensors <= t.num_free_pages:
                self.backing.grow(key, t.tokens[slot], self.ahead_tokens)

    def _drop_holder(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            if key in self._orphans:
                self._orphans.remove(key)
                self.backing.release(key)

    def _out_of_blocks(self, what: str, needed: int):
        raise OutOfBlocks(what, needed, self.num_available_blocks, self.num_free_blocks, self.num_cached_blocks)


# == the engine's side ========================================================================
def _kv_dims(model) -> tuple[int, int, int, int]:
    """``(layers, kv_heads, head_dim, dtype bytes)`` of the model's KV cache."""
    c = model.config
    return c.num_hidden_layers, c.num_key_value_heads, c.head_dim, model.lm_head.weight.element_size()


def _page_bytes(model, config, device: torch.device) -> int:
    """One page of one tensor: the driver's granularity on CUDA (2 MB), ``block_size`` tokens
    on a CPU (the simulated allocator)."""
    if device.type == "cuda":
        from minillm.vmm import driver as drv

        ok, why = drv.available()
        if not ok:
            raise RuntimeError(f"kv_cache='virtual' on CUDA needs the driver bindings ({why}). {drv.MISSING}")
        return drv.device_granularity(device.index if device.index is not None else torch.cuda.current_device())
    _, kv_heads, head_dim, elem = _kv_dims(model)
    return config.block_size * kv_heads * head_dim * elem


def page_group_bytes(model, config, device) -> int:
    """Bytes of one block of `VirtualBlockManager`: one page of each layer's K and V."""
    layers = model.config.num_hidden_layers
    return 2 * layers * _page_bytes(model, config, torch.device(device))


def slot_capacity(max_len: int, bytes_per_token: int, page_bytes: int) -> int:
    """Tokens one slot holds: ``max_len`` rounded up to whole pages (``>= max_len``)."""
    return pages_for(max_len, bytes_per_token, page_bytes) * page_bytes // bytes_per_token


def _check_virtual_model(model) -> None:
    if getattr(model.config, "is_mla", False):
        raise ValueError("kv_cache='virtual' supports models with K and V heads; an MLA model's latent cache "
                         "runs on the paged cache (kv_cache='paged')")
    if hasattr(model, "make_runner"):
        raise ValueError("kv_cache='virtual' runs in one process: use kv_cache='paged' with tensor parallelism")


def build_kv_cache(model, config, num_blocks: int, *, poison: bool = False):
    """``(manager, cache)`` of the engine's KV cache, by ``config.kv_cache``:

    - ``"paged"``: a `BlockManager` of ``num_blocks`` blocks of ``config.block_size`` tokens
      and the model's `PagedKVCache`;
    - ``"virtual"``: a `VirtualBlockManager` over a `SlotKVCache` of ``max_num_seqs + max_n -
      1`` slots (beam search forks before it frees) of ``max_model_len`` tokens rounded up to
      whole pages, with ``num_blocks`` pages of every tensor as the physical pool: on CUDA a
      `minillm.vmm.VirtualKVCache`, elsewhere a `SimulatedVirtualCache` (``poison``: see it).
    """
    if config.kv_cache == "paged":
        manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
        return manager, model.new_paged_cache(num_blocks, config.block_size, backend=config.attention_backend)
    if config.kv_cache != "virtual":
        raise ValueError(f"kv_cache must be one of {KV_CACHE_MODES}, got {config.kv_cache!r}")
    _check_virtual_model(model)
    weight = model.lm_head.weight
    device, dtype = weight.device, weight.dtype
    layers, kv_heads, head_dim, elem = _kv_dims(model)
    mpe = model.config.max_position_embeddings
    max_len = min(config.max_model_len or mpe, mpe)
    page = _page_bytes(model, config, device)
    capacity = slot_capacity(max_len, kv_heads * head_dim * elem, page)
    slots = config.max_num_seqs + config.max_n - 1
    max_pages = num_blocks * 2 * layers
    if device.type == "cuda":
        from minillm.vmm.cache import VirtualKVCache

        backing = VirtualKVCache(layers, kv_heads, head_dim, slots, capacity, dtype=dtype, device=device,
                                 page_bytes=page, max_pages=max_pages, reclamation="deferred")
        # Triton refuses a kernel argument whose address the driver cannot resolve, and a
        # tensor's address is slot 0's first row: map it now (a request that came and went;
        # deferred reclamation keeps the page for slot 0's first real request), so launches
        # and graph captures work before any request has arrived.
        backing.admit("base page", 1)
        backing.release("base page")
    else:
        backing = SimulatedVirtualCache(layers, kv_heads, head_dim, slots, capacity, page_bytes=page,
                                        max_pages=max_pages, dtype=dtype, device=device, poison=poison)
    cache = SlotKVCache(backing, backend=config.attention_backend)
    return VirtualBlockManager(cache), cache


def kv_blocks_needed(manager, prompt_len: int, max_tokens: int, width: int) -> int:
    """Blocks a request of ``width`` sequences (``n`` samples or beams) may hold at its
    longest, to compare with ``manager.num_blocks``. Paged: they share the prompt's full
    blocks (by fork, and by the prefix cache after a preemption); the rest is theirs. Virtual:
    nothing is shared, every sequence holds its own pages."""
    total = prompt_len + max_tokens
    if isinstance(manager, VirtualBlockManager):
        return width * manager.blocks_needed(total)
    bs = manager.block_size
    shared = prompt_len // bs if width == 1 or manager.enable_prefix_caching else 0
    return shared + width * (blocks_for(total, bs) - shared)
