"""A KV cache in virtual memory on the GPU (vAttention's design), over `minillm.vmm.driver`.

``VirtualKVCache(layers, kv_heads, head_dim, max_batch, max_len)`` reserves, for the keys and
for the values of every layer, one virtual range of ``max_batch`` slots of ``max_len`` tokens
(rounded up to whole pages) and exposes each as a torch tensor ``[max_batch, max_len,
kv_heads, head_dim]`` (`VirtualKVCache.k`, `VirtualKVCache.v`): request ``b``'s cache is
``k[layer][b, :L]``, contiguous, for any kernel written for a contiguous cache. No memory is
behind it until `grow` maps pages; `release` ends a request (its pages stay mapped for the
slot's next request under ``"deferred"`` reclamation, vAttention's default).

The bookkeeping is `minillm.vmm.pagetable.PageTable`; this class only adds the driver calls
(`_Mapper`). Physical pages are created on first use and kept in a pool after they are
unmapped, so reusing one costs a ``cuMemMap`` but no ``cuMemCreate``; `trim` releases the
pool's idle pages, `close` everything.

**Never touch an unmapped part** of the tensors (e.g. ``k[0].zero_()`` on the whole
reservation): the GPU faults with an illegal address, which ends the process's CUDA context.
Kernels are safe as long as they read only each request's first ``L`` tokens.
"""
from __future__ import annotations

import time
from collections.abc import Hashable

from minillm.vmm import driver as drv
from minillm.vmm.dlpack import as_tensor
from minillm.vmm.pagetable import Geometry, PageTable

__all__ = ["VirtualKVCache"]


class _Mapper:
    """The driver side of the page table: one reserved range per tensor, a pool of physical
    pages (handles created on first use), and timings of every map call."""

    def __init__(self, cache: "VirtualKVCache"):
        self.cache = cache
        self.handles: dict[int, object] = {}   # physical page id -> cuMemCreate handle
        self.map_seconds: list[float] = []     # host time of each cuMemMap + cuMemSetAccess
        self.create_seconds: list[float] = []  # host time of each cuMemCreate
        self.synced = False

    def _address(self, tensor: int, slot: int, page: int) -> int:
        g = self.cache.geometry
        return self.cache.bases[tensor] + slot * g.slot_bytes + page * g.page_bytes

    def map(self, tensor: int, slot: int, page: int, phys: int) -> None:
        c = self.cache
        if phys not in self.handles:
            t0 = time.perf_counter()
            self.handles[phys] = drv.create(c.page_bytes, c.prop)
            self.create_seconds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        drv.map_page(self._address(tensor, slot, page), c.page_bytes, self.handles[phys], c.descs)
        self.map_seconds.append(time.perf_counter() - t0)

    def unmap(self, tensor: int, slot: int, page: int, phys: int) -> None:
        if not self.synced:  # kernels launched earlier may still read the page
            import torch

            torch.cuda.synchronize(self.cache.device)
            self.synced = True
        drv.unmap(self._address(tensor, slot, page), self.cache.page_bytes)


class VirtualKVCache:
    """Keys and values of ``layers`` layers for up to ``max_batch`` requests of up to
    ``max_len`` tokens, in reserved virtual ranges backed page by page.

    - ``page_bytes``: a multiple of the device's granularity (default: the granularity, 2 MB);
    - ``max_pages``: the physical pool, in pages (default: enough for every slot to be full);
    - ``reclamation``: ``"deferred"`` (keep a finished request's pages for its slot's next
      request) or ``"eager"`` (unmap them at once).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_batch: int, max_len: int, *,
                 dtype=None, device=None, page_bytes: int | None = None, max_pages: int | None = None,
                 reclamation: str = "deferred"):
        import torch

        ok, why = drv.available()
        if not ok:
            raise RuntimeError(f"VirtualKVCache needs CUDA and the driver bindings ({why}). {drv.MISSING}")
        self.dtype = dtype or torch.bfloat16
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        drv.ensure_context(self.device.index)
        self.prop = drv.allocation_prop(self.device.index)
        self.descs = drv.access_descs(self.device.index)
        self.granularity = drv.granularity(self.prop)
        self.page_bytes = int(page_bytes or self.granularity)
        if self.page_bytes % self.granularity:
            raise ValueError(f"page_bytes={self.page_bytes} is not a multiple of the granularity {self.granularity}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        elem = torch.empty(0, dtype=self.dtype).element_size()
        self.geometry = Geometry(2 * layers, max_batch, kv_heads * head_dim * elem, self.page_bytes, max_len)
        g = self.geometry
        if max_pages is None:
            max_pages = g.num_tensors * g.max_slots * g.pages_per_slot
        self._mapper = _Mapper(self)
        self.table = PageTable(g, max_pages, reclamation, self._mapper)
        self.bases: list[int] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.closed = False
        try:
            for _ in range(g.num_tensors):
                self.bases.append(drv.reserve(g.tensor_bytes, self.page_bytes))
        except BaseException:
            self._free_ranges()
            raise
        shape = (max_batch, max_len, kv_heads, head_dim)
        strides = (g.slot_bytes // elem, kv_heads * head_dim, head_dim, 1)
        tensors = [as_tensor(base, shape, strides, self.dtype, self.device, self) for base in self.bases]
        self.k, self.v = tensors[0::2], tensors[1::2]  # tensor 2l: K of layer l, 2l + 1: V

    # ----------------------------------------------------------------- requests
    def admit(self, req: Hashable, tokens: int = 0) -> int:
        """A slot for ``req`` (its batch index in `k`/`v`), with pages for ``tokens`` tokens."""
        self._mapper.synced = False
        return self.table.admit(req, tokens)

    def grow(self, req: Hashable, tokens: int, ahead: int = 0) -> int:
        """Map what ``tokens`` tokens (plus ``ahead`` in advance) need; returns the mappings made."""
        self._mapper.synced = False
        return self.table.grow(req, tokens, ahead)

    def release(self, req: Hashable) -> int:
        """End ``req``; returns the unmappings made (none under deferred reclamation)."""
        self._mapper.synced = False
        return self.table.release(req)

    def slot(self, req: Hashable) -> int:
        return self.table.slot(req)

    def layer(self, i: int):
        """``(k, v)`` of layer ``i``: ``[max_batch, max_len, kv_heads, head_dim]`` each."""
        return self.k[i], self.v[i]

    # ----------------------------------------------------------------- memory
    @property
    def map_seconds(self) -> list[float]:
        return self._mapper.map_seconds

    @property
    def create_seconds(self) -> list[float]:
        return self._mapper.create_seconds

    def physical_bytes(self) -> int:
        """Bytes of physical pages created (mapped or pooled)."""
        return len(self._mapper.handles) * self.page_bytes

    def trim(self) -> int:
        """Release the physical pages that are created but not mapped; returns how many."""
        mapped = set(self.table.mappings().values())
        idle = [p for p in self._mapper.handles if p not in mapped]
        for p in idle:
            drv.release(self._mapper.handles.pop(p))
        return len(idle)

    def close(self) -> None:
        """Unmap and release everything and give the virtual ranges back. The tensors must not
        be used afterwards."""
        if self.closed:
            return
        self._mapper.synced = False
        self.table.close()
        self.trim()
        self.k, self.v = [], []  # torch frees them once no view is left (their DLPack deleters run)
        self._free_ranges()
        self.closed = True

    def _free_ranges(self) -> None:
        for base in self.bases:
            drv.free_range(base, self.geometry.tensor_bytes)
        self.bases = []

    def __enter__(self) -> "VirtualKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
