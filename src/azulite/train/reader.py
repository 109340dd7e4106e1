"""Reading a local checkpoint back: DCP's StorageReader that reads each file once, straight into the
tensors being restored, hashing every byte in the same pass.

DCP's own FileSystemReader ``torch.load``s every tensor record into a new tensor and copies that into the
target; with a hash check in front (a separate read, or a buffered copy of the file) a restore ran at a
fraction of ``torch.load``'s speed. Here each record's layout is read first (:mod:`azulite.train.record`:
the record's zip directory and pickle, not its data, give the data's offset, dtype and shape), then each
file is read front to back in large ``readinto`` calls: tensor data lands directly in the target tensor's
memory, the bytes between (zip headers, pickles, small objects) in a buffer kept
for later, and the manifest's hash (BLAKE3, :mod:`azulite.train.digest`) is fed every byte right after it
arrived (cache-hot; the hash and file reads release the GIL, so files read in parallel threads). No extra
copy and no allocation per tensor.

Ranks on one host that read the very same file (same boot, same inode: a DDP restore, where every rank
loads the whole checkpoint) share its hashing: each such file is hashed by one of them, chosen so the
bytes hashed split evenly (:mod:`azulite.train.hash_split`), and the others only copy it; they agree on
every file's verdict (a collective) before anything is built. Blob downloads are each rank's own files, so each rank hashes what it fetched.

Verification: a file's digest is checked when its last byte is read, and only once every file this
rank read matched (here or where it was hashed) are the objects built from the kept bytes (optimizer step counts, RNG states, any tensor
that could not be read in place) and DCP's ``load_state_dict`` run; so nothing read reaches training
before it was verified. A mismatch fails the load on every rank; the
Checkpointer then un-commits that checkpoint and loads the previous one, which overwrites every target
tensor again (DCP's strict load plan covers them all), or raises when none is intact: tensors that took
bytes from a corrupt file are never trained on. Records the fast path does not understand (stream
transforms, a non-contiguous target, a resharded slice along an inner dimension, an older format) are
kept as bytes and loaded the way DCP does, after verification.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future as TorchFuture

from azulite.errors import CheckpointError
from azulite.train import digest, record
from azulite.train import prefetch as pf
from azulite.train.hash_split import HashHere, Identities, assign_hashing, identity
from azulite.train.restore import IntegrityError, mismatch

#: bytes per read into a tensor: large enough that per-call overhead is nothing, small enough that the
#: hash pass right after finds the bytes still in cache
CHUNK = 8 << 20
#: DCP's data files (FileSystemWriter: ``__<rank>_<n>.distcp``), what a restore streams before its plan
_DATA = ".distcp"
@dataclass
class _Direct:
    """One tensor read in place: file bytes [start, start + nbytes) are the target's memory, in order."""

    start: int
    nbytes: int
    target: torch.Tensor
    req: Any


@dataclass
class _FilePlan:
    name: str
    path: Path
    want: Mapping[str, Any] | None
    direct: list[_Direct] = field(default_factory=list)
    later: list[Any] = field(default_factory=list)  # ReadItems built from kept bytes after verification
    kept: list[tuple[int, bytearray]] = field(default_factory=list)  # (file offset, bytes) between tensors


def tensor_memory(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype; numpy has no bfloat16)."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


class _VerifiedFiles(FileSystem):
    """DCP's file system for what it reads itself (``.metadata``): a file's bytes are handed over only
    after its digest and size matched the manifest."""

    def __init__(self, files: Mapping[str, Any], where: str) -> None:
        super().__init__()
        self._files, self._where = files, where

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise IntegrityError(f"a checkpoint is read-only while it is restored (mode {mode!r})")
        p = Path(path)
        want = _wanted(self._files, p.name, self._where)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise IntegrityError(f"file {p.name} is missing [{self._where}]") from None
        algorithm = digest.algorithm_of(want)
        h = digest.new(algorithm)
        h.update(data)
        if h.hexdigest() != want[algorithm] or len(data) != want["bytes"]:
            raise mismatch(p.name, h.hexdigest(), len(data), want, self._where)
        yield io.BytesIO(data)


def _wanted(files: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    want = files.get(name)
    if want is None:
        raise IntegrityError(f"file {name} is not in the manifest [{where}]")
    return want


class VerifyingReader(FileSystemReader):
    """DCP's FileSystemReader with every byte checked against the manifest (see the module docstring);
    ``threads`` files are read at once. With ``fetch`` (Blob), each file this rank reads is first fetched
    into ``path`` by ``fetch(name, local_path)``, in the same thread that then reads it: only the files of
    this rank's load plan, the next one downloading while the one before is read. ``direct_bytes`` counts
    what went straight into tensors."""

    def __init__(self, path: Path, manifest: Mapping[str, Any], threads: int, where: str,
                 fetch: Callable[[str, Path], None] | None = None, group: Any = None) -> None:
        super().__init__(path)
        self._files: Mapping[str, Any] = manifest["files"]
        self._threads, self._where, self._fetch = max(1, threads), where, fetch
        # ranks that read the very same file (same host, boot and inode: not Blob downloads, each rank's
        # own) share its hashing: each such file is hashed by one of them, the others only copy it
        self._group = group if fetch is None and group is not None and dist.get_world_size(group) > 1 else None
        self.fs = _VerifiedFiles(self._files, where)
        self.direct_bytes = 0
        self.hashed_bytes = 0
        self._prefetch: pf.Prefetch | None = None
        self._prefetch_for: list[Path] = []  # the data files the prefetch streams, in order
        #: when the disk was first asked for this restore's bytes (``time.perf_counter()``; None: all
        #: were in the page cache, or none was streamed)
        self.first_read_at: float | None = None
        #: when the stream brought its last byte, and when this rank's readers were done (copied and
        #: hashed their last byte): how far the readers ran behind the disk (None: nothing was streamed)
        self.stream_ended_at: float | None = None
        self.reads_done_at: float | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:
            # DCP's fallback after ``.metadata`` failed: a rank's own ``__<rank>.metadata``, which azulite
            # never writes. None lets DCP fail the load with the first failure alone (it raised "__0.metadata
            # is not in the manifest" too, with a second traceback in the log)
            return None
        if self._fetch is not None:
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            self._fetch(path.name, path)
        return super().read_metadata(*args, **kwargs)

    def _file_paths(self, plan: Any) -> list[Path]:
        """The files a load plan reads, in the order they are read."""
        names = sorted({self.storage_data[req.storage_index].relative_path for req in plan.items})
        return [Path(self.fs.concat_path(self.path, n)) for n in names]

    def start_prefetch(self) -> None:
        """Page cache cold: start streaming the checkpoint from the moment it is chosen, before DCP asks
        the state for its tensors, reads ``.metadata`` and plans (5-50 ms the disk otherwise idled, a
        cold restore's time before its first byte): ``.metadata`` first, then every data file of the
        manifest in the order a rank reads them. That is what a DDP rank reads (every tensor); a rank
        whose plan reads fewer files narrows the stream to them in :meth:`prepare_local_plan`, having
        brought at most what the disk reads while DCP plans. Local files only (a Blob download writes its
        file just before it is read)."""
        if self._fetch is not None or pf.PREFETCH_AHEAD <= 0 or self._prefetch is not None:
            return
        data = [Path(self.fs.concat_path(self.path, n)) for n in sorted(self._files) if n.endswith(_DATA)]
        self._stream(data, lead=[Path(self._get_metadata_path())])
        if self._prefetch is not None:
            self._prefetch.wait_issued()

    def _stream(self, data: list[Path], lead: list[Path] | None = None) -> None:
        """Stream ``data`` (after ``lead``), unless the prefetch already streams exactly those files."""
        if self._prefetch is not None and self._prefetch_for == data:
            return
        self.stop_prefetch()
        if self._fetch is None and pf.PREFETCH_AHEAD > 0 and data:
            self._prefetch = pf.Prefetch([*(lead or []), *data], streams=pf.PREFETCH_STREAMS)
            self._prefetch_for = data

    def prepare_local_plan(self, plan: Any) -> Any:
        # the disk streams this rank's files, in the order they are read, while DCP agrees on the global
        # plan (collectives), and keeps streaming while records are copied and hashed
        paths = self._file_paths(plan)
        self._stream(paths)
        # the coordinator learns which ranks read the very same files from the plans DCP gathers anyway,
        # and hands each rank the files it hashes with the plan it scatters: no collective of our own
        # before the reads
        ids = {p.name: (identity(p) if self._group is not None else None) for p in paths}
        return dataclasses.replace(super().prepare_local_plan(plan), storage_data=Identities(ids))

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        plans = super().prepare_global_plan(plans)
        if not all(isinstance(p.storage_data, Identities) for p in plans):
            return plans  # not our local plans (another planner's): every rank hashes what it reads
        sizes = {n: int(e.get("bytes", 0)) for n, e in self._files.items()}
        # the files each global plan reads (a planner may have changed the local plans): one the rank
        # did not name in its local plan has no identity, so that rank hashes it itself
        reads = [{self.storage_data[i.storage_index].relative_path for i in p.items} for p in plans]
        hashers = assign_hashing([{n: p.storage_data.files.get(n) for n in r} for p, r in zip(plans, reads)], sizes)
        return [dataclasses.replace(p, storage_data=HashHere(frozenset(h), frozenset(r)))
                for p, h, r in zip(plans, hashers, reads)]

    def stop_prefetch(self) -> None:
        """Ends the prefetch thread (read_data does at its end; a load that failed before it, here)."""
        if self._prefetch is not None:
            self._prefetch.stop()
            if self.first_read_at is None:
                self.first_read_at = self._prefetch.issued_at
            self.stream_ended_at = self._prefetch.ended_at
            self._prefetch = None
            self._prefetch_for = []

    def read_data(self, plan: Any, planner: Any) -> TorchFuture:
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        plans = [_FilePlan(n, Path(self.fs.concat_path(self.path, n)), self._files.get(n)) for n in sorted(per_file)]
        # the global plan may have changed this rank's files: then stream those instead
        self._stream([fp.path for fp in plans])
        # the files this rank hashes (the coordinator's answer, prepare_global_plan); all it reads when the
        # plan carries none
        given = plan.storage_data if isinstance(plan.storage_data, HashHere) else None
        hash_here = {fp.name for fp in plans if given is None or fp.name in given.files or fp.name not in given.known}
        # every rank reaches the collective below whatever happens here: a rank that raised early would
        # leave the others waiting in it
        failure: BaseException | None = None
        try:
            for fp in plans:
                fp.want = _wanted(self._files, fp.name, self._where)
            # the targets are looked up on the caller's thread; the threads only read and hash
            targets = {id(r): planner.resolve_tensor(r).detach() for rs in per_file.values() for r in rs
                       if r.type != LoadItemType.BYTE_IO}
            work = [(fp, per_file[fp.name], fp.name in hash_here) for fp in plans]
            if len(work) > 1 and self._threads > 1:
                with ThreadPoolExecutor(max_workers=min(self._threads, len(work)),
                                        thread_name_prefix="azulite-read") as pool:
                    list(pool.map(lambda w: self._read_file(w[0], w[1], targets, w[2]), work))
            else:
                for fp, reqs, verify in work:
                    self._read_file(fp, reqs, targets, verify)
        except Exception as e:  # noqa: BLE001 - raised below, after the others heard of it
            failure = e
        finally:
            self.stop_prefetch()
        self.reads_done_at = time.perf_counter()
        self._agree(failure)
        # every file of this rank matched its manifest: only now is anything built from the bytes
        for fp in plans:
            for d in fp.direct:
                planner.commit_tensor(d.req, d.target)
                self.direct_bytes += d.nbytes
            for req in fp.later:
                self._load_kept(fp, req, planner)
        fut: TorchFuture = TorchFuture()
        fut.set_result(None)
        return fut

    # -- every rank's verdict --------------------------------------------------------------------------------
    def _agree(self, failure: BaseException | None) -> None:
        """Raise on every rank if any rank's read failed: a rank that used bytes another rank hashed must
        not build anything from them when that hash did not match. One all-reduce of a flag when all is
        well (it ends a restore: what it costs is the restore's); the messages only when one failed."""
        if self._group is None:
            if failure is not None:
                raise failure
            return
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if not int(flag[0]):
            return
        verdict = None if failure is None else (isinstance(failure, IntegrityError), str(failure))
        everyone: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(everyone, verdict, group=self._group)
        if failure is not None:
            raise failure
        for rank, v in enumerate(everyone):
            if v is not None:
                integrity, text = v
                raise IntegrityError(text) if integrity else CheckpointError(f"rank {rank} could not read: {text}")

    # -- one file, on a reader thread ----------------------------------------------------------------------
    def _read_file(self, fp: _FilePlan, reqs: list[Any], targets: Mapping[int, torch.Tensor], verify: bool) -> None:
        if self._fetch is not None:
            self._fetch(fp.name, fp.path)
        try:
            f = open(fp.path, "rb", buffering=0)  # noqa: SIM115 - closed below
            heads = open(fp.path, "rb")  # noqa: SIM115 - the record layouts' own reads, closed below
        except FileNotFoundError:
            raise IntegrityError(f"file {fp.name} is missing [{self._where}]") from None
        with f, heads:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                # a layout read touches a record's first and last pages only: no readahead of its own
                # (the stream's prefetch brings the rest, in order)
                os.posix_fadvise(heads.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            size = os.fstat(f.fileno()).st_size
            if size != fp.want["bytes"]:
                raise IntegrityError(f"file {fp.name} is {size} B, the manifest says {fp.want['bytes']} B "
                                     f"[{self._where}]")
            self._read_and_hash(f, heads, fp, reqs, targets, size, verify)

    def _in_place(self, heads: Any, req: Any, target: torch.Tensor | None,
                  wait: Callable[[int], None] = lambda end: None) -> _Direct | None:
        """Where a tensor record's data lies in the file when it can be read straight into ``target``,
        else None (loaded from kept bytes after verification). Reads only the record's headers; they are
        not trusted yet, so a wrong answer can only put bytes in the wrong place of a tensor of the right
        size, and the file's hash fails. ``wait(end)`` returns once the file's bytes up to ``end`` can be
        read from the cache: the record's first page tells a plain tensor's layout (its pickle and
        headers come first), so a reader follows a cold file's stream 8 MiB at a time instead of waiting
        for each record's last page (its zip directory: only for records the first page does not tell)."""
        sinfo = self.storage_data[req.storage_index]
        if (target is None or req.type == LoadItemType.BYTE_IO or sinfo.transform_descriptors
                or target.device.type != "cpu" or not target.is_contiguous()):
            return None
        try:
            first = min(record.HEAD, sinfo.length)
            wait(sinfo.offset + first)
            lay = record.layout_from_head(os.pread(heads.fileno(), first, sinfo.offset), sinfo.length)
            if lay is None:
                wait(sinfo.offset + sinfo.length)
                lay = record.layout(heads.fileno(), sinfo.offset, sinfo.length)
            if lay is not None:
                src, offset = lay.meta(), lay.data_start
            else:  # a record the quick parser does not know: torch's own reading of it (slower, in Python)
                src = torch.load(_create_file_view(heads, sinfo.offset, sinfo.length), map_location="meta",
                                 weights_only=True)
                offset = src.untyped_storage()._checkpoint_offset
            src = narrow_tensor_by_index(src, req.storage_offsets, req.lengths)
        except Exception:  # noqa: BLE001 - an unexpected record: the slow path will name any real problem
            return None
        if (offset is None or not isinstance(src, torch.Tensor) or not src.is_contiguous()
                or src.dtype != target.dtype or src.size() != target.size()):
            return None
        start = sinfo.offset + offset + src.storage_offset() * src.element_size()
        nbytes = src.numel() * src.element_size()
        if start < sinfo.offset or start + nbytes > sinfo.offset + sinfo.length:
            return None
        return _Direct(start, nbytes, target, req)

    def _read_and_hash(self, f: Any, heads: Any, fp: _FilePlan, reqs: list[Any],
                       targets: Mapping[int, torch.Tensor], size: int, verify: bool) -> None:
        """The whole file front to back, once: tensor data into its target, the rest kept; all hashed
        (unless another rank hashes this very file: ``verify`` False). Records are taken in file order
        and each one's layout is read just before its bytes: with the page cache cold, the layout reads
        of a whole file up front waited for all of it to arrive, and only then did copying and hashing
        start (a cold restore cost the disk's time plus the copy's); this way the copy of one record
        runs while the disk brings the next."""
        algorithm = digest.algorithm_of(fp.want)
        h = digest.new(algorithm) if verify else None
        prefetch = self._prefetch
        # a record that several requests read (parts of one saved chunk into different targets) is kept
        # whole and loaded after verification; any other tensor record is read in place
        readers = Counter(self.storage_data[r.storage_index].offset for r in reqs)
        pos = 0

        def wait(end: int) -> None:
            if prefetch is not None:
                prefetch.ready(fp.path, end)

        def fill(view: memoryview, at: int) -> None:
            done = 0
            while done < len(view):
                if prefetch is not None:
                    prefetch.ready(fp.path, at + done + min(CHUNK, len(view) - done))
                n = f.readinto(view[done : done + CHUNK])
                if not n:
                    raise IntegrityError(f"file {fp.name} ended at {at + done} B, the manifest says {size} B "
                                         f"[{self._where}]")
                if h is not None:
                    h.update(view[done : done + n])  # releases the GIL on large buffers
                done += n
                if prefetch is not None:
                    prefetch.consumed(n)

        for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
            sinfo = self.storage_data[req.storage_index]
            shared = readers[sinfo.offset] > 1
            d = None if shared else self._in_place(heads, req, targets.get(id(req)), wait)
            if d is None:
                fp.later.append(req)
                continue
            if d.start < pos:  # each lies inside its own record: overlaps mean headers that cannot be right
                raise IntegrityError(f"file {fp.name}: tensor records overlap at {d.start} B [{self._where}]")
            if d.start > pos:
                gap = bytearray(d.start - pos)
                fill(memoryview(gap), pos)
                fp.kept.append((pos, gap))
            if d.nbytes:
                fill(tensor_memory(d.target), d.start)
            fp.direct.append(d)
            pos = d.start + d.nbytes
        if size > pos:
            gap = bytearray(size - pos)
            fill(memoryview(gap), pos)
            fp.kept.append((pos, gap))
        if h is None:
            return
        self.hashed_bytes += size
        got = h.hexdigest()
        if got != fp.want[algorithm]:
            raise mismatch(fp.name, got, size, fp.want, self._where)

    # -- after verification, on the caller's thread --------------------------------------------------------
    def _load_kept(self, fp: _FilePlan, req: Any, planner: Any) -> None:
        """A record that was not read in place, built from the kept (verified) bytes as DCP does."""
        sinfo = self.storage_data[req.storage_index]
        raw = _kept_bytes(fp, sinfo.offset, sinfo.length)
        stream = self.transforms.transform_load_stream(req, sinfo.transform_descriptors or (),
                                                       _create_file_view(io.BytesIO(raw), 0, len(raw)))
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
        tensor = cast(torch.Tensor, torch.load(seekable, map_location="cpu", weights_only=True))
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise IntegrityError(f"record {req.storage_index} of {fp.name} holds a tensor of size "
                                 f"{tuple(tensor.size())}, the checkpoint's metadata says {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _kept_bytes(fp: _FilePlan, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of the file, from the kept pieces: a record loaded this way had none
    of its bytes read in place, so it lies within one piece."""
    for start, buf in fp.kept:
        if start <= offset and offset + length <= start + len(buf):
            return bytes(memoryview(buf)[offset - start : offset - start + length])
    raise IntegrityError(f"record at {offset} (+{length} B) of {fp.name} overlaps a tensor read in place: "
                         "the checkpoint's metadata is inconsistent")
