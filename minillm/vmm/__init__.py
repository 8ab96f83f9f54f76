"""Chapter 11: a KV cache in virtual memory, through CUDA's virtual memory management API.

Each request's keys and values stay contiguous in *virtual* memory, so unmodified kernels for
contiguous caches run on them, while *physical* pages are mapped behind them only as the
request grows (vAttention, Prabhu et al. 2024).

- `minillm.vmm.pagetable`: the bookkeeping (slots, pages, reclamation), pure Python;
- `minillm.vmm.driver`: the driver calls (``cuMemAddressReserve``, ``cuMemCreate``,
  ``cuMemMap``, ``cuMemSetAccess``, ``cuMemUnmap``, ``cuMemRelease``, ``cuMemAddressFree``)
  through NVIDIA's ``cuda-bindings`` package;
- `minillm.vmm.dlpack`: the mapped ranges as torch tensors, without copies;
- `minillm.vmm.cache`: `VirtualKVCache`, the three together;
- `minillm.vmm.manager`: the engine on it (``EngineConfig(kv_cache="virtual")``): the cache
  seen as a paged cache of one block per slot, and the block manager's interface over the
  page table (imported by the engine, not here).

This package imports on any machine. The bindings are an optional dependency (``pip install
cuda-bindings``, or the ``vmm`` extra); `available` says whether the GPU side can run here,
and `VirtualKVCache` explains what is missing when it cannot.
"""
from minillm.vmm.cache import VirtualKVCache
from minillm.vmm.driver import MISSING, CudaError, available
from minillm.vmm.pagetable import RECLAMATION_POLICIES, Geometry, OutOfPages, PageTable, pages_for

__all__ = ["MISSING", "RECLAMATION_POLICIES", "CudaError", "Geometry", "OutOfPages", "PageTable", "VirtualKVCache",
           "available", "pages_for"]
