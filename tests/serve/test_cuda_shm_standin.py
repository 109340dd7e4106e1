"""serve/cuda_shm.py's own logic where no GPU runs (CI): the CUDA runtime replaced by a stand-in that keeps
"device" allocations in host memory, so registration, the allocation-size check, the copies in and out,
the bounds and the unregister-while-running path run on every machine. The real runtime, a real GPU and
tritonclient's own CUDA utilities: tests/serve/test_cuda_shm.py (run on a lent H200, stop 43)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from azulite.errors import InvalidArgument
from azulite.serve import cuda_shm
from azulite.serve.shm import SharedMemory
from azulite.serve.types import InferRequest, InferResponse, InferTensor, RequestedOutput

INVALID = 400  # cudaErrorInvalidResourceHandle's number


class _Kind:
    cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost = 1, 2


class StandInRuntime:
    """The calls of cuda.bindings.runtime that cuda_shm makes, over host buffers: (error, value) tuples."""

    cudaMemcpyKind = _Kind
    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.allocations: dict[bytes, ctypes.Array] = {}  # handle -> "device" memory
        self.open: list[int] = []

    def malloc(self, size: int) -> tuple[bytes, ctypes.Array]:
        """A client's cudaMalloc + cudaIpcGetMemHandle."""
        handle = os.urandom(cuda_shm.HANDLE_SIZE)
        self.allocations[handle] = buf = ctypes.create_string_buffer(size)
        return handle, buf

    class cudaIpcMemHandle_t:
        def __init__(self, _ptr: int) -> None:
            self.raw = ctypes.string_at(_ptr, cuda_shm.HANDLE_SIZE)

    def cudaGetDeviceCount(self):
        return 0, self.devices

    def cudaSetDevice(self, device: int):
        return (0,) if device < self.devices else (101,)

    def cudaIpcOpenMemHandle(self, handle, flags):
        buf = self.allocations.get(handle.raw)
        if buf is None:
            return INVALID, None
        self.open.append(ctypes.addressof(buf))
        return 0, ctypes.addressof(buf)

    def cudaIpcCloseMemHandle(self, ptr: int):
        self.open.remove(ptr)
        return (0,)

    def cudaMemcpy(self, dst: int, src: int, count: int, kind):
        ctypes.memmove(dst, src, count)
        return (0,)


class StandInDriver:
    def __init__(self, runtime: StandInRuntime) -> None:
        self.runtime = runtime

    def cuMemGetAddressRange(self, ptr: int):
        for buf in self.runtime.allocations.values():
            base = ctypes.addressof(buf)
            if base <= ptr < base + len(buf):
                return 0, base, len(buf)
        return INVALID, None, None


@pytest.fixture
def runtime(monkeypatch):
    rt = StandInRuntime()
    monkeypatch.setattr(cuda_shm, "_runtime", (rt, StandInDriver(rt)))
    cuda_shm.available.cache_clear()
    yield rt
    cuda_shm.available.cache_clear()


def test_inputs_and_outputs_cross_through_a_registered_region(runtime):
    registry = SharedMemory()
    handle, device = runtime.malloc(256)
    x = np.arange(16, dtype=np.float32)
    ctypes.memmove(device, x.tobytes(), 64)
    registry.register_cuda("r", handle, 0, 256)
    assert registry.status("", "cuda") == [{"name": "r", "device_id": 0, "byte_size": 256}]
    assert registry.status("", "system") == []
    request = InferRequest("m", [InferTensor("x", "FP32", (16,), None, {"shared_memory_region": "r",
                                                                        "shared_memory_byte_size": 64})],
                           outputs=[RequestedOutput("y", {"shared_memory_region": "r", "shared_memory_byte_size": 64,
                                                          "shared_memory_offset": 128})])
    registry.resolve_inputs(request)
    assert request.inputs[0].data.tolist() == x.tolist()
    ctypes.memset(device, 0, 64)  # the client rewrites its region: the request keeps its copy
    assert request.inputs[0].data.tolist() == x.tolist()
    places = registry.output_places(request)
    answer = InferResponse("m", "1", [InferTensor("y", "FP32", (16,), x * 2)])
    registry.place_outputs(answer, places)
    assert np.frombuffer(device.raw[128:192], np.float32).tolist() == (x * 2).tolist()
    assert answer.outputs[0].data is None  # answered in the region, not in the body
    registry.unregister("r", "system")  # the other kind's unregister leaves it
    assert len(runtime.open) == 1
    registry.unregister("r", "cuda")
    assert runtime.open == [] and registry.status("", "cuda") == []


def test_registration_past_the_allocation_or_on_a_missing_device_is_refused_and_closes(runtime):
    registry = SharedMemory()
    handle, _ = runtime.malloc(256)
    with pytest.raises(InvalidArgument, match="byte_size 257 is past the end of the allocation its handle names "
                                              r"\(256 bytes\)"):
        registry.register_cuda("big", handle, 0, 257)
    assert runtime.open == []  # the handle opened for the check is closed again
    with pytest.raises(InvalidArgument, match=r"device_id 3 does not exist \(this server sees 1 CUDA device: 0-0\)"):
        registry.register_cuda("dev", handle, 3, 256)
    with pytest.raises(InvalidArgument, match="unable to open its CUDA IPC handle: 400"):
        registry.register_cuda("junk", os.urandom(64), 0, 256)
    with pytest.raises(InvalidArgument, match="'byte_size' must be a non-negative integer"):
        registry.register_cuda("neg", handle, 0, -1)
    assert registry.status("", "cuda") == [] and runtime.open == []


def test_a_range_past_the_region_and_a_region_gone_while_its_request_runs(runtime):
    registry = SharedMemory()
    handle, _ = runtime.malloc(256)
    registry.register_cuda("r", handle, 0, 128)  # less than the allocation: the region is what was registered
    request = InferRequest("m", [InferTensor("x", "FP32", (16,), None, {"shared_memory_region": "r",
                                                                        "shared_memory_byte_size": 64,
                                                                        "shared_memory_offset": 100})])
    with pytest.raises(InvalidArgument, match=r"offset 100 \+ byte size 64 is past the end of CUDA shared memory "
                                              r"region 'r' \(128 bytes\)"):
        registry.resolve_inputs(request)
    ask = InferRequest("m", [], outputs=[RequestedOutput("y", {"shared_memory_region": "r",
                                                               "shared_memory_byte_size": 8})])
    places = registry.output_places(ask)
    registry.unregister("r", "cuda")
    answer = InferResponse("m", "1", [InferTensor("y", "FP32", (2,), np.array([1.5, 2.5], np.float32))])
    with pytest.raises(InvalidArgument, match="CUDA shared memory region 'r' was unregistered while the request"):
        registry.place_outputs(answer, places)


def test_the_server_lists_the_extension_only_where_it_works(runtime, monkeypatch):
    assert cuda_shm.available()
    monkeypatch.setattr(runtime, "devices", 0)
    cuda_shm.available.cache_clear()
    assert not cuda_shm.available()
