"""Memory we manage ourselves, seen by torch as a tensor without a copy: a DLPack capsule.

``torch.from_dlpack`` (``torch.utils.dlpack.from_dlpack``) accepts a capsule holding a
``DLManagedTensor``: the data pointer, the device, the dtype, the shape and strides, and a
``deleter`` that torch calls once the tensor (and every view of it) is gone. The deleter
drops our reference to ``owner``, the object that owns the memory, so the memory outlives
every tensor made from it. The device is given in the capsule, so torch never queries the
pointer (``cudaPointerGetAttributes`` fails on a virtual range whose first page is not mapped).

The structures below are DLPack's ABI (``dlpack.h``, the unversioned ``DLManagedTensor``,
which every torch release accepts); nothing here is specific to CUDA, and the CPU tests
export host memory through the same path.
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

__all__ = ["as_tensor", "DL_CPU", "DL_CUDA"]

DL_CPU, DL_CUDA = 1, 2  # DLDeviceType
_CODES = {"int": 0, "uint": 1, "float": 2, "bfloat": 4}  # DLDataTypeCode


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

#: Exported tensors not yet deleted: address of the DLManagedTensor -> what must stay alive.
_LIVE: dict[int, tuple] = {}
_NAME = b"dltensor"
_USED = b"used_dltensor"

_pyapi = ctypes.pythonapi
_pyapi.PyCapsule_New.restype = ctypes.py_object
_pyapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_pyapi.PyCapsule_IsValid.restype = ctypes.c_int
_pyapi.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_pyapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
_pyapi.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


@_DELETER
def _delete(managed) -> None:  # called by the consumer (torch) when its tensor is freed
    _LIVE.pop(ctypes.addressof(managed.contents), None)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule) -> None:  # a capsule never consumed: delete it ourselves
    if _pyapi.PyCapsule_IsValid(capsule, _NAME):
        _LIVE.pop(_pyapi.PyCapsule_GetPointer(capsule, _NAME), None)


def _dtype_of(torch_dtype) -> _DLDataType:
    name = str(torch_dtype).removeprefix("torch.")  # "bfloat16", "float32", "int8", "uint8"
    for prefix in ("bfloat", "float", "uint", "int"):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return _DLDataType(_CODES[prefix], int(name[len(prefix):]), 1)
    raise TypeError(f"no DLPack type for {torch_dtype}")


def capsule(ptr: int, shape: Sequence[int], strides: Sequence[int], dtype, device_type: int, device_id: int,
            owner: Any):
    """A ``"dltensor"`` capsule over ``ptr`` (``strides`` in elements), keeping ``owner``
    alive until the consumer deletes it."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * ndim)(*shape)
    strides_arr = (ctypes.c_int64 * ndim)(*strides)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(ctypes.c_void_p(int(ptr)), _DLDevice(device_type, device_id), ndim, _dtype_of(dtype),
                                  shape_arr, strides_arr, 0)
    managed.manager_ctx = None
    managed.deleter = _delete
    address = ctypes.addressof(managed)
    _LIVE[address] = (managed, shape_arr, strides_arr, owner)
    return _pyapi.PyCapsule_New(address, _NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))


def as_tensor(ptr: int, shape: Sequence[int], strides: Sequence[int], dtype, device, owner: Any):
    """A torch tensor over memory at ``ptr`` (no copy): ``shape``, ``strides`` (elements),
    ``dtype``, on ``device`` (a torch device, CPU or CUDA). ``owner`` stays referenced until
    the tensor and all its views are freed."""
    import torch

    device = torch.device(device)
    dev = (DL_CUDA, device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else (DL_CPU, 0)
    return torch.utils.dlpack.from_dlpack(capsule(ptr, shape, strides, dtype, *dev, owner))


def live_exports() -> int:
    """Exported tensors torch has not deleted yet (the tests check that this returns to 0)."""
    return len(_LIVE)
