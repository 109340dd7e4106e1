"""Triton's shared memory extensions: a client registers a POSIX shared-memory object (a file of
/dev/shm, created with ``shm_open``: tritonclient.utils.shared_memory, perf_analyzer --shared-memory
system) or GPU memory (serve/cuda_shm.py) under a region name; infer requests then name a region, offset
and byte size instead of carrying tensor bytes, for inputs and for outputs.

One registry per server for both kinds (one namespace of names, as Triton's), shared by the HTTP and gRPC
front-ends through the data plane; status and unregister see the kind they are called for. The codecs leave
an input whose parameters name a region without data (``data`` None); :meth:`SharedMemory.
resolve_inputs` fills it from the region before the request is checked, and :meth:`place_outputs` writes
the answers into the client's regions and leaves those outputs without data in the response.

Errors follow Triton's classes (an unknown region is NOT_FOUND, a range outside a region INVALID_ARGUMENT,
a name registered twice ALREADY_EXISTS), except where Triton answers INTERNAL for a client's mistake (a
key that does not open, an output region too small): those are INVALID_ARGUMENT here.

Every read and write is bounds-checked against the region (never outside it); inputs are copied out of
the region, so a client that rewrites the region while its request waits in a batch changes nothing, and
a region can always be unmapped. Written by hand: no library implements the server side of Triton's
protocol, and Python's mmap is all the mapping needs.
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from azulite.errors import InvalidArgument, NotFound
from azulite.serve.config import WIRE_TO_NUMPY
from azulite.serve.http_codec import deserialize_bytes, serialize_bytes
from azulite.serve.types import InferRequest, InferResponse, InferTensor

if TYPE_CHECKING:
    from azulite.serve.cuda_shm import CudaRegion

SHM_DIR = "/dev/shm"  # where shm_open(3) keeps its objects on Linux
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
_SHM_PARAMS = (REGION, BYTE_SIZE, OFFSET)


KINDS = ("system", "cuda")


class RegionExists(InvalidArgument):
    """A region name registered twice (Triton: ALREADY_EXISTS)."""

    status = "ALREADY_EXISTS"


def check_range(label: str, name: str, byte_size: int, closed: bool, offset: int, size: int, what: str) -> None:
    """InvalidArgument unless [offset, offset + size) lies in a region of ``byte_size`` that is still
    registered (``closed``: unregistered while the request ran); ``label`` names its kind."""
    if closed:
        raise InvalidArgument(f"{what}: {label} shared memory region '{name}' was unregistered while the request "
                              "was running", fix="unregister a region only when no request uses it")
    if offset < 0 or size < 0 or offset + size > byte_size:
        raise InvalidArgument(
            f"{what}: offset {offset} + byte size {size} is past the end of {label} shared memory region "
            f"'{name}' ({byte_size} bytes)",
            fix="keep shared_memory_offset + shared_memory_byte_size within the registered byte_size")


def _sizes(label: str, name: str, fields: tuple[tuple[str, Any], ...]) -> None:
    """A registration's integers: each non-negative, the last (byte_size) positive."""
    for field, value in fields:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{label} shared memory region '{name}': '{field}' must be a non-negative "
                                  f"integer, got {value!r}")
    if fields[-1][1] == 0:
        raise InvalidArgument(f"{label} shared memory region '{name}': {fields[-1][0]} must be positive")


def uses_shm(parameters: dict[str, Any] | Any) -> bool:
    """Whether a tensor's parameters place it in a shared-memory region (codecs then expect no data)."""
    return REGION in parameters


@dataclass(slots=True)
class Region:
    """One registered system region: the client's /dev/shm object, mapped."""

    name: str
    key: str
    offset: int
    byte_size: int
    _map: mmap.mmap
    kind = "system"

    def check(self, offset: int, size: int, what: str) -> int:
        """-> the absolute position in the mapping of [offset, offset + size) of the region; raises
        InvalidArgument when that range is not inside the region."""
        check_range("system", self.name, self.byte_size, self._map.closed, offset, size, what)
        return self.offset + offset

    def read(self, offset: int, size: int, what: str) -> bytes:
        start = self.check(offset, size, what)
        return self._map[start:start + size]  # a copy: the client may rewrite the region meanwhile

    def write(self, offset: int, data: bytes, what: str) -> None:
        start = self.check(offset, len(data), what)
        self._map[start:start + len(data)] = data

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def close(self) -> None:
        self._map.close()


def _int_param(params: dict[str, Any], key: str, what: str, default: int | None = None) -> int:
    value = params.get(key, default)
    if value is None:
        raise InvalidArgument(f"{what}: '{REGION}' is set but '{key}' is missing",
                              fix=f"give {key} with the region")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgument(f"{what}: '{key}' must be a non-negative integer, got {value!r}")
    return int(value)


def _open_object(key: str) -> tuple[int, int]:
    """shm_open(key, O_RDWR) by hand: -> (fd, size). Only a plain object directly in /dev/shm: a key with
    a path in it must not let a client map any other file of the server."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise InvalidArgument(f"shared memory key {key!r} is not a POSIX shared memory name",
                              fix="use the key given to shm_open / create_shared_memory_region, e.g. '/input0'")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgument(f"unable to open shared memory key {key!r}: {exc.strerror}",
                              fix="create the region (shm_open) before registering it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InvalidArgument(f"shared memory key {key!r} is not a shared memory object")
    return fd, st.st_size


class SharedMemory:
    """The registered regions of one server, system and CUDA, by name."""

    def __init__(self) -> None:
        self._regions: dict[str, Region | CudaRegion] = {}

    # --- the extension's control calls --------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgument("a system shared memory region needs a non-empty name")
        if not isinstance(key, str) or not key:
            raise InvalidArgument(f"system shared memory region '{name}': 'key' must be a non-empty string")
        _sizes("system", name, (("offset", offset), ("byte_size", byte_size)))
        self._free(name)
        fd, size = _open_object(key)
        try:
            if offset + byte_size > size:
                raise InvalidArgument(
                    f"system shared memory region '{name}': offset {offset} + byte_size {byte_size} is past the "
                    f"end of shared memory object {key!r} ({size} bytes)",
                    fix="register a range inside the object, or make the object larger")
            # mapped from 0: mmap offsets must be page-aligned, a region's offset need not be
            mapping = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._regions[name] = Region(name, key, offset, byte_size, mapping)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """A region of GPU memory another process exported (serve/cuda_shm.py); Unsupported without CUDA."""
        from azulite.serve.cuda_shm import HANDLE_SIZE, CudaRegion, device_count

        if not isinstance(name, str) or not name:
            raise InvalidArgument("a CUDA shared memory region needs a non-empty name")
        device_count()  # a server without CUDA says so first, whatever else the request holds
        if not isinstance(raw_handle, bytes) or len(raw_handle) != HANDLE_SIZE:
            got = f"{len(raw_handle)} bytes" if isinstance(raw_handle, bytes) else repr(raw_handle)
            raise InvalidArgument(f"CUDA shared memory region '{name}': raw_handle must be the {HANDLE_SIZE}-byte "
                                  f"cudaIpcMemHandle_t, got {got}",
                                  fix="send cudaIpcGetMemHandle's handle (tritonclient: "
                                      "cuda_shared_memory.get_raw_handle; base64 in HTTP's raw_handle.b64)")
        _sizes("CUDA", name, (("device_id", device_id), ("byte_size", byte_size)))
        self._free(name)
        self._regions[name] = CudaRegion(name, raw_handle, device_id, byte_size)

    def _free(self, name: str) -> None:
        if name in self._regions:
            raise RegionExists(f"shared memory region '{name}' is already registered",
                               fix="unregister it first, or register under another name")

    def unregister(self, name: str = "", kind: str = "system") -> None:
        """One region of ``kind``, or every region of it when ``name`` is empty; an unknown name (or one of
        the other kind) is not an error (Triton)."""
        names = [name] if name else list(self._regions)
        for n in names:
            region = self._regions.get(n)
            if region is not None and region.kind == kind:
                del self._regions[n]
                region.close()

    def status(self, name: str = "", kind: str = "system") -> list[dict[str, Any]]:
        """Triton's status documents of the regions of ``kind`` (all, or the one named)."""
        if not name:
            return [self._regions[n].status() for n in sorted(self._regions) if self._regions[n].kind == kind]
        region = self._regions.get(name) if isinstance(name, str) else None
        if region is None or region.kind != kind:
            raise NotFound(f"Unable to find {kind if kind == 'system' else 'CUDA'} shared memory region: '{name}'",
                           fix="register the region first")
        return [region.status()]

    def close(self) -> None:
        for kind in KINDS:
            self.unregister("", kind)

    def _get(self, name: Any, what: str) -> Region | CudaRegion:
        if not isinstance(name, str):  # a number is the client's mistake, not a lookup
            raise InvalidArgument(f"{what}: '{REGION}' must be a region's name (a string), got {name!r}",
                                  fix="name the region as it was registered")
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"{what}: unable to find shared memory region '{name}'",
                           fix="register the region first (register_system_shared_memory / "
                               "register_cuda_shared_memory)")
        return region

    # --- infer requests -----------------------------------------------------------------------------

    def resolve_inputs(self, request: InferRequest) -> None:
        """Fill every input that names a region with a copy of its bytes, checked against its shape."""
        for i, tensor in enumerate(request.inputs):
            if tensor.data is not None or not uses_shm(tensor.parameters):
                continue
            what = f"input '{tensor.name}'"
            params = tensor.parameters
            region = self._get(params[REGION], what)
            size = _int_param(params, BYTE_SIZE, what)
            offset = _int_param(params, OFFSET, what, 0)
            dtype = WIRE_TO_NUMPY[tensor.datatype]  # the codecs checked the datatype
            count = int(np.prod(tensor.shape, dtype=np.int64))
            if tensor.datatype != "BYTES" and size != count * dtype.itemsize:
                raise InvalidArgument(
                    f"{what}: shared_memory_byte_size is {size} but shape {list(tensor.shape)} of "
                    f"{tensor.datatype} needs {count * dtype.itemsize} bytes",
                    fix="byte size must be prod(shape) * element size")
            raw = region.read(offset, size, what)
            if tensor.datatype == "BYTES":
                array = deserialize_bytes(raw, count, tensor.name).reshape(tensor.shape)
            else:
                array = np.frombuffer(raw, dtype=dtype).reshape(tensor.shape)
            rest = {k: v for k, v in params.items() if k not in _SHM_PARAMS}
            request.inputs[i] = InferTensor(tensor.name, tensor.datatype, tensor.shape, array, rest)

    def output_places(self, request: InferRequest) -> dict[str, tuple[Region | CudaRegion, int, int]]:
        """Outputs the request wants in regions: name -> (region, offset, byte size), checked before the
        model runs so a bad region fails the request without running it."""
        places: dict[str, tuple[Region | CudaRegion, int, int]] = {}
        for out in request.outputs or ():
            if not uses_shm(out.parameters):
                continue
            what = f"output '{out.name}'"
            region = self._get(out.parameters[REGION], what)
            size = _int_param(out.parameters, BYTE_SIZE, what)
            offset = _int_param(out.parameters, OFFSET, what, 0)
            region.check(offset, size, what)
            places[out.name] = (region, offset, size)
        return places

    @staticmethod
    def place_outputs(response: InferResponse, places: dict[str, tuple[Region | CudaRegion, int, int]]) -> None:
        """Write the placed outputs into their regions; they stay in the response without data."""
        for i, t in enumerate(response.outputs):
            place = places.get(t.name)
            if place is None:
                continue
            region, offset, size = place
            blob = serialize_bytes(t.data) if t.datatype == "BYTES" else np.ascontiguousarray(t.data).tobytes()
            if len(blob) > size:
                raise InvalidArgument(
                    f"output '{t.name}' is {len(blob)} bytes but shared_memory_byte_size of region "
                    f"'{region.name}' is {size}", fix="give the output a region of at least its size")
            region.write(offset, blob, f"output '{t.name}'")
            # as Triton: name, datatype and shape only (perf_analyzer reads any parameters as binary data)
            response.outputs[i] = InferTensor(t.name, t.datatype, t.shape, None, t.parameters)  # type: ignore[arg-type]
