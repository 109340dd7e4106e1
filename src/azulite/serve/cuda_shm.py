"""CUDA shared memory regions (Triton's ``cudasharedmemory`` extension): a client allocates GPU memory,
exports it with ``cudaIpcGetMemHandle`` (tritonclient.utils.cuda_shared_memory, perf_analyzer
``--shared-memory cuda``) and registers the 64-byte handle, a device id and a byte size under a region
name; infer requests then name the region for inputs and outputs, as for system shared memory
(serve/shm.py keeps both kinds in one registry: region names are one namespace, as in Triton).

The server opens the handle with ``cudaIpcOpenMemHandle`` and copies a tensor's bytes between the region
and host memory with ``cudaMemcpy``: the models here take host (numpy) tensors, so an input crosses to
the host once, as it would from a request body, without the client's own copy and send. Through NVIDIA's
CUDA Python bindings (``cuda.bindings.runtime``, the package ``cuda-bindings`` / ``cuda-python``): the
library tritonclient itself uses on the client side; imported only when a client registers a region.

Every copy is bounds-checked against the region, and the region against the allocation the handle
belongs to (``cuMemGetAddressRange``): a byte size larger than the client's allocation is refused at
registration, so no copy reads or writes outside it. Without the bindings, or without a CUDA device, a
registration is UNIMPLEMENTED (HTTP 501) naming which is missing.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

import numpy as np

from azulite.errors import InvalidArgument, Unsupported
from azulite.serve.shm import check_range

HANDLE_SIZE = 64  # CUDA_IPC_HANDLE_SIZE

_runtime: Any = None
_lock = threading.Lock()


def _cuda() -> tuple[Any, Any]:
    """(cuda.bindings.runtime, cuda.bindings.driver), or Unsupported naming what is missing."""
    global _runtime
    with _lock:
        if _runtime is None:
            try:
                from cuda.bindings import driver, runtime
            except ImportError:
                raise Unsupported(
                    "CUDA shared memory needs NVIDIA's CUDA Python bindings, which this server does not have "
                    "(the package 'cuda-bindings')",
                    fix="install azulite[gpu] (cuda-bindings) on a machine with an NVIDIA driver, or place "
                        "tensors in system shared memory or the request body") from None
            _runtime = (runtime, driver)
        return _runtime


def _name(err: Any) -> str:
    return getattr(err, "name", str(err))


def _call(what: str, fn, *args) -> Any:
    """One CUDA runtime call: its value, or InvalidArgument naming the call and CUDA's error."""
    result = fn(*args)
    err, rest = result[0], result[1:]
    if int(err) != 0:
        raise InvalidArgument(f"{what}: {_name(err)}")
    return rest[0] if len(rest) == 1 else rest


def device_count() -> int:
    """How many CUDA devices this server sees; Unsupported when none (or no driver)."""
    runtime, _ = _cuda()
    try:
        err, count = runtime.cudaGetDeviceCount()
        reason = _name(err) if int(err) != 0 else "no device" if not count else ""
    except Exception as exc:  # noqa: BLE001 - the bindings raise where no driver library loads at all
        reason = f"{type(exc).__name__}: {exc}"[:200]
    if reason:
        raise Unsupported(f"CUDA shared memory needs a CUDA device, and this server has none ({reason})",
                          fix="place tensors in system shared memory or the request body, or serve from a "
                              "machine with an NVIDIA GPU and driver")
    return int(count)


@functools.cache
def available() -> bool:
    """Whether this server can open CUDA regions (bindings and a device): server metadata lists the
    extension then."""
    try:
        device_count()
    except Unsupported:
        return False
    return True


class CudaRegion:
    """One registered CUDA region: the client's allocation, opened in this process."""

    kind = "cuda"

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.name, self.device_id, self.byte_size = name, device_id, byte_size
        runtime, driver = _cuda()
        count = device_count()
        if device_id >= count:
            raise InvalidArgument(f"CUDA shared memory region '{name}': device_id {device_id} does not exist "
                                  f"(this server sees {count} CUDA device{'s' if count != 1 else ''}: 0-{count - 1})",
                                  fix="give the id of the device the region was allocated on")
        self._rt = runtime
        what = f"CUDA shared memory region '{name}'"
        _call(f"{what}: cudaSetDevice({device_id})", runtime.cudaSetDevice, device_id)
        raw = ctypes.create_string_buffer(raw_handle, HANDLE_SIZE)  # the handle struct reads these 64 bytes
        handle = runtime.cudaIpcMemHandle_t(_ptr=ctypes.addressof(raw))
        try:
            ptr = _call(f"{what}: unable to open its CUDA IPC handle", runtime.cudaIpcOpenMemHandle,
                        handle, runtime.cudaIpcMemLazyEnablePeerAccess)
        except InvalidArgument as exc:
            raise InvalidArgument(str(exc), fix="register the handle cudaIpcGetMemHandle gave for memory that is "
                                  "still allocated (tritonclient: cuda_shared_memory.get_raw_handle), from another "
                                  "process than the server's: CUDA opens no handle in the process that made it") from None
        self.ptr = int(ptr)
        self._closed = False
        try:
            base, size = _call(f"{what}: cuMemGetAddressRange", driver.cuMemGetAddressRange, self.ptr)
            room = int(base) + int(size) - self.ptr
            if byte_size > room:
                raise InvalidArgument(f"{what}: byte_size {byte_size} is past the end of the allocation its "
                                      f"handle names ({room} bytes)",
                                      fix="register at most the bytes allocated with cudaMalloc")
        except BaseException:
            self.close()
            raise

    def check(self, offset: int, size: int, what: str) -> int:
        """-> the device address of [offset, offset + size) of the region; InvalidArgument outside it."""
        check_range("CUDA", self.name, self.byte_size, self._closed, offset, size, what)
        return self.ptr + offset

    def read(self, offset: int, size: int, what: str) -> memoryview:
        """A host copy of the bytes: the client may rewrite the region meanwhile."""
        src = self.check(offset, size, what)
        host = np.empty(size, np.uint8)
        if size:
            _call(f"{what}: cudaSetDevice", self._rt.cudaSetDevice, self.device_id)
            _call(f"{what}: copy from CUDA shared memory region '{self.name}'", self._rt.cudaMemcpy,
                  host.ctypes.data, src, size, self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        return memoryview(host)

    def write(self, offset: int, data: bytes, what: str) -> None:
        dst = self.check(offset, len(data), what)
        if data:
            host = np.frombuffer(data, np.uint8)
            _call(f"{what}: cudaSetDevice", self._rt.cudaSetDevice, self.device_id)
            _call(f"{what}: copy to CUDA shared memory region '{self.name}'", self._rt.cudaMemcpy,
                  dst, host.ctypes.data, len(data), self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._rt.cudaSetDevice(self.device_id)
            self._rt.cudaIpcCloseMemHandle(self.ptr)
