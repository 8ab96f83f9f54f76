"""CUDA's virtual memory management (VMM) API, through NVIDIA's Python bindings.

The bindings are the ``cuda-bindings`` package (``pip install cuda-bindings``, or the
``vmm`` extra of this project: ``pip install -e '.[vmm]'``); they import without a GPU, but
every call needs the NVIDIA driver. Each binding returns a tuple ``(CUresult, *values)``;
`check` turns a non-success result into a `CudaError` and returns the values.

The six calls of Chapter 11, in the order a cache uses them:

=================================  ===========================================================
``cuMemGetAllocationGranularity``  the page size physical memory comes in (2 MB on current GPUs)
``cuMemAddressReserve``            reserve a range of virtual addresses (no memory behind it)
``cuMemCreate``                    create a physical allocation (a page), returned as a handle
``cuMemMap`` + ``cuMemSetAccess``  back part of a reserved range with it, make it readable and
                                   writable by the device
``cuMemUnmap``                     detach it again (the handle survives and can be mapped again)
``cuMemRelease``, ``cuMemAddressFree``  give the physical page and the virtual range back
=================================  ===========================================================
"""
from __future__ import annotations

import functools
from typing import Any

__all__ = ["MISSING", "CudaError", "bindings", "available", "check", "ensure_context", "allocation_prop",
           "access_descs", "granularity", "device_granularity", "reserve", "free_range", "create", "map_page",
           "unmap", "release", "mem_info"]

MISSING = ("the virtual-memory cache needs NVIDIA's Python bindings of the CUDA driver: "
           "pip install cuda-bindings  (or: pip install -e '.[vmm]'), and an NVIDIA GPU")


class CudaError(RuntimeError):
    """A CUDA driver call returned an error."""


@functools.lru_cache(maxsize=None)
def bindings():
    """The ``cuda.bindings.driver`` module (or ``cuda.cuda`` of cuda-python before 12.6);
    ``ImportError`` with the install hint when neither is installed."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]  # cuda-python < 12.6
        except ImportError as exc:
            raise ImportError(MISSING) from exc
    return driver


def available() -> tuple[bool, str]:
    """``(True, "")`` if the bindings import, torch sees a CUDA device and the driver answers;
    else ``(False, why)``. Never raises."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device"
        check(bindings().cuInit(0))
        return True, ""
    except Exception as exc:  # noqa: BLE001 - any failure means "not here"
        return False, f"{type(exc).__name__}: {exc}"


def check(result) -> Any:
    """Unpack a binding's ``(CUresult, *values)``: raise `CudaError` unless the result is
    ``CUDA_SUCCESS``; return the single value, a tuple of several, or None."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        d = bindings()
        try:
            _, text = d.cuGetErrorString(err)
            text = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # noqa: BLE001
            text = "?"
        raise CudaError(f"{getattr(err, 'name', err)}: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def ensure_context(device_index: int) -> None:
    """Make the device's primary context (torch's) current on this thread: torch creates it
    on first use; the VMM calls need a current context."""
    import torch

    torch.cuda.set_device(device_index)
    torch.empty(1, device=f"cuda:{device_index}")  # forces torch to create/bind the primary context
    d = bindings()
    check(d.cuInit(0))
    ctx = check(d.cuCtxGetCurrent())
    if ctx is None or int(ctx) == 0:
        dev = check(d.cuDeviceGet(device_index))
        check(d.cuCtxSetCurrent(check(d.cuDevicePrimaryCtxRetain(dev))))


def allocation_prop(device_index: int):
    """``CUmemAllocationProp`` of pinned device memory on ``device_index``."""
    d = bindings()
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


def access_descs(device_index: int) -> list:
    """One ``CUmemAccessDesc``: read-write access for ``device_index``."""
    d = bindings()
    desc = d.CUmemAccessDesc()
    desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device_index
    desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return [desc]


def granularity(prop, recommended: bool = False) -> int:
    """Bytes physical allocations (and mappings) must be a multiple of: the minimum, or the
    recommended one (for performance)."""
    d = bindings()
    flag = d.CUmemAllocationGranularity_flags
    option = flag.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended else flag.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(check(d.cuMemGetAllocationGranularity(prop, option)))


def device_granularity(device_index: int) -> int:
    """The smallest page ``device_index`` maps (2 MB on current GPUs), its context made current."""
    ensure_context(device_index)
    return granularity(allocation_prop(device_index))


def reserve(size: int, alignment: int = 0) -> int:
    """Reserve ``size`` bytes of virtual addresses; returns the base address."""
    d = bindings()
    return int(check(d.cuMemAddressReserve(size, alignment, d.CUdeviceptr(0), 0)))


def free_range(ptr: int, size: int) -> None:
    """Give back a reservation (everything in it must be unmapped)."""
    d = bindings()
    check(d.cuMemAddressFree(d.CUdeviceptr(ptr), size))


def create(size: int, prop):
    """A physical allocation of ``size`` bytes (a multiple of the granularity): its handle."""
    return check(bindings().cuMemCreate(size, prop, 0))


def map_page(ptr: int, size: int, handle, descs) -> None:
    """Map ``handle`` (all ``size`` bytes of it) at virtual address ``ptr`` and make it
    readable and writable (``cuMemMap`` then ``cuMemSetAccess``)."""
    d = bindings()
    check(d.cuMemMap(d.CUdeviceptr(ptr), size, 0, handle, 0))
    check(d.cuMemSetAccess(d.CUdeviceptr(ptr), size, descs, len(descs)))


def unmap(ptr: int, size: int) -> None:
    """Unmap ``[ptr, ptr + size)``. The caller must first make sure no kernel still reads it
    (synchronize): unlike ``cudaFree``, ``cuMemUnmap`` is not guaranteed to wait."""
    d = bindings()
    check(d.cuMemUnmap(d.CUdeviceptr(ptr), size))


def release(handle) -> None:
    """Release a physical allocation (its memory returns to the device once it is unmapped
    everywhere)."""
    check(bindings().cuMemRelease(handle))


def mem_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current device, from ``cuMemGetInfo``."""
    free, total = check(bindings().cuMemGetInfo())
    return int(free), int(total)
