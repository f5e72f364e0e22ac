"""Wrap raw memory as a torch tensor through a hand-built DLPack capsule.

Why not only __cuda_array_interface__: torch.as_tensor asks the driver which device owns the pointer
(cudaPointerGetAttributes), and that query fails for reserved VMM addresses that have no pages mapped
yet. DLPack names the device explicitly, so torch never inspects the pointer; a whole-arena view whose
first page is uncommitted (KV pool, require_committed=False) needs exactly that.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

_KDL_CPU, _KDL_CUDA = 1, 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

# address of a live DLManagedTensor -> (the struct, its shape array, the object to keep alive)
_live: dict[int, tuple[Any, Any, Any]] = {}
_live_lock = threading.Lock()


def _delete(managed: Any) -> None:
    # torch calls this when the last tensor sharing the storage dies; ctypes takes the GIL for us.
    with _live_lock:
        _live.pop(ctypes.addressof(managed.contents), None)


_deleter = _Deleter(_delete)  # module-level: the C function pointer must outlive every tensor

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def tensor_from_pointer(ptr: int, nbytes: int, device: torch.device, keepalive: Any) -> torch.Tensor:
    """A 1-D uint8 tensor over [ptr, ptr+nbytes) on device; keepalive lives as long as the tensor."""
    if device.type == "cuda":
        dl_device = _DLDevice(_KDL_CUDA, device.index if device.index is not None else torch.cuda.current_device())
    elif device.type == "cpu":
        dl_device = _DLDevice(_KDL_CPU, 0)
    else:
        raise ValueError(f"no DLPack wrapping for device type {device.type!r}")
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(ptr, dl_device, 1, _DLDataType(_KDL_UINT, 8, 1),
                                  ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)), None, 0)
    managed.manager_ctx = None
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    with _live_lock:
        _live[address] = (managed, shape, keepalive)
    try:
        capsule = _capsule_new(address, b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _live_lock:
            _live.pop(address, None)
        raise


def num_live_wrappers() -> int:
    with _live_lock:
        return len(_live)
