"""A torch.save record's tensor layout read without torch.load: the same answer as
torch.load(map_location="meta") for every kind of tensor a checkpoint holds, None for anything else."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from torch.utils.serialization import config as serialization_config

from azulite.train import record

CASES = {
    "matrix": lambda: torch.randn(3, 4),
    "strided view": lambda: torch.randn(6, 5)[1:4, ::2],
    "offset view": lambda: torch.randn(10)[3:7],
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.zeros(0, 3),
    "transposed int64": lambda: torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
    "bfloat16": lambda: torch.randn(4, 4).to(torch.bfloat16),
    "bool": lambda: torch.ones(5, dtype=torch.bool),
    "complex64": lambda: torch.randn(2, 3, dtype=torch.complex64),
    "uint8": lambda: torch.randint(0, 255, (7,), dtype=torch.uint8),
    "float16 step view": lambda: torch.randn(8).half()[::3],
    "large": lambda: torch.randn(64, 1024),
}


def _records(path: Path, objs: list[object], crc: bool = True) -> list[tuple[int, int]]:
    """Writes the objects' torch.save records back to back (with junk between, as records sit inside a
    DCP file); their (start, length)."""
    spans = []
    prior = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = crc  # DCP's writer here turns the CRC off (commit.py)
    try:
        with open(path, "wb") as f:
            for obj in objs:
                buf = io.BytesIO()
                torch.save(obj, buf)
                f.write(b"junk" * 5)
                spans.append((f.tell(), len(buf.getvalue())))
                f.write(buf.getvalue())
            f.write(b"tail")
    finally:
        serialization_config.save.compute_crc32 = prior
    return spans


@pytest.mark.parametrize("crc", [True, False])
def test_layout_matches_torch_load_meta_and_locates_the_bytes(tmp_path: Path, crc: bool) -> None:
    torch.manual_seed(0)
    tensors = {name: make() for name, make in CASES.items()}
    path = tmp_path / "records.bin"
    spans = _records(path, list(tensors.values()), crc)
    data = path.read_bytes()
    with open(path, "rb") as f:
        for (name, t), (start, length) in zip(tensors.items(), spans):
            lay = record.layout(f.fileno(), start, length)
            assert lay is not None, name
            meta = torch.load(io.BytesIO(data[start : start + length]), map_location="meta", weights_only=True)
            assert (lay.dtype, lay.size, lay.stride, lay.storage_offset) == (
                meta.dtype, tuple(meta.size()), meta.stride(), meta.storage_offset()), name
            assert lay.data_start == meta.untyped_storage()._checkpoint_offset, name
            assert lay.storage_bytes == meta.untyped_storage().nbytes(), name
            m = lay.meta()
            assert (m.dtype, m.size(), m.stride(), m.storage_offset()) == (meta.dtype, meta.size(), meta.stride(),
                                                                            meta.storage_offset()), name
            # the bytes there, viewed the way the layout says, are the tensor saved
            raw = bytearray(data[start + lay.data_start : start + lay.data_start + lay.storage_bytes])
            storage = torch.frombuffer(raw, dtype=lay.dtype) if raw else torch.empty(0, dtype=lay.dtype)
            assert torch.equal(storage.as_strided(lay.size, lay.stride, lay.storage_offset), t), name


def test_not_a_plain_tensor_is_none(tmp_path: Path) -> None:
    path = tmp_path / "records.bin"
    objs = [{"a": torch.ones(2)}, 1.5, [torch.ones(3)], "text", torch.nn.Parameter(torch.ones(2))]
    spans = _records(path, objs)
    # a compressed record (torch.save never writes one; a rewritten file might)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        src = io.BytesIO()
        torch.save(torch.ones(4), src)
        with zipfile.ZipFile(io.BytesIO(src.getvalue())) as orig:
            for info in orig.infolist():
                zf.writestr(info.filename, orig.read(info.filename))
    with open(path, "ab") as f:
        spans.append((f.tell(), len(buf.getvalue())))
        f.write(buf.getvalue())
    with open(path, "rb") as f:
        found = [record.layout(f.fileno(), start, length) for start, length in spans]
        # a span that is not a record at all, or is cut short
        junk = [record.layout(f.fileno(), 0, 20), record.layout(f.fileno(), spans[0][0], spans[0][1] - 30)]
    assert found[:4] == [None] * 4 and found[5] is None and junk == [None, None]
    # a Parameter pickles through another rebuild function: not this parser's
    assert found[4] is None


@pytest.mark.parametrize("crc", [True, False])
def test_the_first_page_of_a_record_gives_the_same_layout(tmp_path: Path, crc: bool) -> None:
    """layout_from_head: what a reader of a cold file uses once a record's first page arrived."""
    torch.manual_seed(0)
    objs = [make() for make in CASES.values()]
    path = tmp_path / "records.bin"
    spans = _records(path, objs, crc)
    data = path.read_bytes()
    with open(path, "rb") as f:
        for name, (start, length) in zip(CASES, spans):
            head = data[start : start + min(record.HEAD, length)]
            got = record.layout_from_head(head, length)
            assert got is not None and got == record.layout(f.fileno(), start, length), name
            # too little of the record to tell (up to the storage entry's header, or into the pickle): no
            # answer, never a wrong one
            storage_header = head.rfind(b"PK\x03\x04", 0, got.data_start)
            assert record.layout_from_head(head[: storage_header + 30], length) is None, name
            assert record.layout_from_head(head[:60], length) is None, name
            # a record shorter than its tensor's bytes: no answer
            assert record.layout_from_head(head, got.data_start + got.storage_bytes - 1) is None, name


def test_the_first_page_of_anything_else_gives_no_layout(tmp_path: Path) -> None:
    path = tmp_path / "records.bin"
    objs = [{"a": torch.ones(2)}, 1.5, [torch.ones(3)], "text", torch.nn.Parameter(torch.ones(2))]
    spans = _records(path, objs)
    data = path.read_bytes()
    assert [record.layout_from_head(data[s : s + min(record.HEAD, n)], n) for s, n in spans] == [None] * 5
    assert record.layout_from_head(b"", 10) is None and record.layout_from_head(data[:200], 200) is None
    # a record whose byte order entry says big-endian
    buf = io.BytesIO()
    torch.save(torch.ones(4), buf)
    big = buf.getvalue().replace(b"little", b"big\x00\x00\x00", 1)
    assert record.layout_from_head(big[: record.HEAD], len(big)) is None
