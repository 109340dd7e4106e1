"""Where a tensor's bytes lie in one ``torch.save`` record, read from the record's zip directory and its
small pickle, without ``torch.load``.

DCP writes every tensor of a checkpoint file as one ``torch.save`` record (a small zip: ``data.pkl``, the
storage as ``data/<key>`` stored uncompressed, a few one-line entries). A restore reads tensor bytes
straight into the target tensors, so it needs each record's layout before its bytes:
``torch.load(map_location="meta")`` gives it, but it runs the weights-only unpickler in Python and reads
the record through Python file objects, holding the GIL for about 0.3 ms a record, as long as hashing a
1.5 MB tensor; with every rank of a DDP restore parsing every record that was a sixth of a warm restore's
CPU. Here the zip directory is read with :mod:`zipfile` and the pickle with the C unpickler, which knows
only the few names a plain tensor's pickle holds. Anything else (a record of another object, a dtype
without a typed storage, a big-endian or compressed record, zip64) gives None and the caller falls back to
``torch.load`` after the file's hash matched. Nothing here is trusted: the caller checks the answer
against its target's dtype and size, and the file's hash before anything is used.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass

import torch

#: the typed storages ``torch.save`` names in a tensor's pickle, by name (the classes themselves warn that
#: TypedStorage is deprecated when touched)
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length
_LOCAL_SIG = b"PK\x03\x04"
#: a local header's signature, flags, method, compressed size and the two lengths
_LOCAL_FIELDS = struct.Struct("<4s2xHH8xI4xHH")
_DESCRIPTOR = struct.Struct("<4s4xII")  # signature, CRC, compressed and uncompressed size
_DESCRIPTOR64 = struct.Struct("<4s4xQQ")
_DESCRIPTOR_SIG = b"PK\x07\x08"
#: how much of a record's start :func:`layout_from_head` looks at: a plain tensor's pickle and the small
#: entries before its data take ~600 B
HEAD = 4096


@dataclass(frozen=True)
class Layout:
    """A record's tensor: its storage's bytes are record bytes [data_start, data_start + storage_bytes)."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_start: int
    storage_bytes: int

    def meta(self) -> torch.Tensor:
        """The tensor on the meta device (for slicing it the way a load request asks)."""
        numel = self.storage_bytes // self.dtype.itemsize
        return torch.empty(numel, dtype=self.dtype, device="meta").as_strided(self.size, self.stride,
                                                                              self.storage_offset)


class _Unknown(Exception):
    """The record holds something this parser does not know: the caller falls back to torch.load."""


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):  # noqa: ANN001, ANN202, ARG001 - torch's signature
    if not isinstance(storage, _Storage) or backward_hooks or metadata:
        raise _Unknown("not a plain tensor")
    return _Tensor(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise _Unknown(f"{module}.{name}")

    def persistent_load(self, pid: object) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise _Unknown("not a storage")
        return _Storage(pid[1].dtype, str(pid[2]), int(pid[4]))


class _Span:
    """Bytes [start, start + length) of a file, for :mod:`zipfile`: positioned reads (``os.pread``), no
    shared file position, so reader threads can share one descriptor."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the record")
        self.pos = base + offset
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        data = os.pread(self.fd, max(n, 0), self.start + self.pos)
        self.pos += len(data)
        return data


def _entry(span: _Span, info: zipfile.ZipInfo) -> tuple[int, int]:
    """(start, length) of an uncompressed entry's data within the record (after its local header)."""
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
        raise _Unknown("compressed entry")
    span.seek(info.header_offset)
    head = span.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size:
        raise _Unknown("short local header")
    sig, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if sig != _LOCAL_SIG:
        raise _Unknown("no local header")
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > span.length:
        raise _Unknown("entry past the record's end")
    return start, info.file_size


def _read(span: _Span, info: zipfile.ZipInfo) -> bytes:
    start, length = _entry(span, info)
    span.seek(start)
    data = span.read(length)
    if len(data) != length:
        raise _Unknown("short entry")
    return data


def layout(fd: int, start: int, length: int) -> Layout | None:
    """The layout of the tensor that file bytes [start, start + length) (one ``torch.save`` record) hold,
    or None when the record is not a plain little-endian tensor this parser knows."""
    span = _Span(fd, start, length)
    try:
        with zipfile.ZipFile(span) as zf:
            infos = {i.filename: i for i in zf.infolist()}
        pickles = [n for n in infos if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pickles) != 1 or any(i.file_size >= 0xFFFFFFFF or i.header_offset >= 0xFFFFFFFF for i in infos.values()):
            return None
        prefix = pickles[0][: -len("data.pkl")]
        order = infos.get(prefix + "byteorder")
        if order is None or _read(span, order) != b"little":
            return None
        obj = _Unpickler(io.BytesIO(_read(span, infos[pickles[0]]))).load()
        if not isinstance(obj, _Tensor):
            return None
        data = infos.get(f"{prefix}data/{obj.storage.key}")
        if data is None:
            return None
        data_start, nbytes = _entry(span, data)
        if nbytes != obj.storage.numel * obj.storage.dtype.itemsize:
            return None
    except (_Unknown, zipfile.BadZipFile, pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError,
            struct.error, KeyError, IndexError, AttributeError):
        return None
    return Layout(obj.storage.dtype, obj.size, obj.stride, obj.storage_offset, data_start, nbytes)


def layout_from_head(head: bytes, length: int) -> Layout | None:
    """The layout of a ``length``-byte record, from its first bytes alone (``head``, up to :data:`HEAD`),
    or None when they do not tell (then :func:`layout`, which needs the record's end: its zip directory).

    ``torch.save`` writes ``data.pkl`` first, then a few one-line entries, then the storage, each entry
    behind its local header; a streamed zip's local headers carry no sizes (a data descriptor follows
    each entry: flag bit 3), so the walk takes the pickle's end from the pickle itself (its STOP, checked
    against the descriptor after it) and a small entry's end from the first descriptor after it whose
    sizes equal the bytes between. A reader of a cold file can thus place a tensor's bytes once the
    record's first page arrived, not its last. Nothing here is trusted either (see :func:`layout`)."""
    try:
        pos, prefix, key, obj, order = 0, None, None, None, None
        while pos + _LOCAL_FIELDS.size <= len(head):
            sig, flags, method, csize, name_len, extra_len = _LOCAL_FIELDS.unpack_from(head, pos)
            if sig != _LOCAL_SIG or method != zipfile.ZIP_STORED:
                return None
            name = head[pos + _LOCAL_FIELDS.size : pos + _LOCAL_FIELDS.size + name_len].decode("utf-8")
            start = pos + _LOCAL_FIELDS.size + name_len + extra_len
            if prefix is None:  # the first entry: the pickle
                if not name.endswith("data.pkl"):
                    return None
                prefix = name[: -len("data.pkl")]
                src = io.BytesIO(head[start:])
                obj = _Unpickler(src).load()
                if not isinstance(obj, _Tensor):
                    return None
                key = f"{prefix}data/{obj.storage.key}"
                end = start + src.tell()
            elif name == key:  # the storage: where the tensor's bytes begin
                nbytes = obj.storage.numel * obj.storage.dtype.itemsize
                if order != b"little" or start + nbytes > length:
                    return None
                return Layout(obj.storage.dtype, obj.size, obj.stride, obj.storage_offset, start, nbytes)
            elif flags & 0x8:  # a small entry of unknown size: it ends at the descriptor that says so
                end = head.find(_DESCRIPTOR_SIG, start)
                while end >= 0 and (_descriptor(head, end) or (-1,))[0] != end - start:
                    end = head.find(_DESCRIPTOR_SIG, end + 1)
                if end < 0:
                    return None
            else:
                end = start + csize
            if name == f"{prefix}byteorder":
                order = head[start:end]
            pos = end
            if flags & 0x8:
                desc = _descriptor(head, end)
                if desc is None or desc[0] != end - start:
                    return None
                pos += desc[1]
    except (_Unknown, pickle.UnpicklingError, EOFError, ValueError, TypeError, struct.error, UnicodeDecodeError,
            AttributeError, IndexError, KeyError):
        return None
    return None


def _descriptor(head: bytes, at: int) -> tuple[int, int] | None:
    """(entry size, descriptor length) of a data descriptor at ``at`` (32- or 64-bit sizes: the form
    followed by the next header), None where there is none."""
    if head[at : at + 4] != _DESCRIPTOR_SIG:
        return None
    for form in (_DESCRIPTOR, _DESCRIPTOR64):
        if at + form.size + 4 <= len(head):
            _, csize, usize = form.unpack_from(head, at)
            if csize == usize and head[at + form.size : at + form.size + 2] == b"PK":
                return csize, form.size
    return None
