"""Binary BYTES tensors (4-byte little-endian length, then the bytes, per element): the sliced fast path and
the element-by-element checked one decode alike, and every malformed tensor gets the checked path's error
naming what is wrong, never a short or shifted element."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from azulite.errors import InvalidArgument
from azulite.serve import http_codec
from azulite.serve.http_codec import deserialize_bytes, serialize_bytes

ELEMENTS = [b"", b"a", b"\x00\xff\t\n", "é".encode(), b"x" * 300, b"", b"12\t34\t" * 20, b"\x00\x00\x00\x00"]


@pytest.mark.parametrize("count", [0, 1, 2, 3, len(ELEMENTS)])
@pytest.mark.parametrize("wrap", [bytes, memoryview, lambda b: memoryview(b"pad" + b)[3:]],
                         ids=["bytes", "memoryview", "view-into-a-body"])
def test_round_trip(count, wrap):
    elements = ELEMENTS[:count]
    blob = serialize_bytes(np.array(elements + [b""], dtype=object)[:count])
    out = deserialize_bytes(wrap(blob), count, "ROW")
    assert out.dtype == object and out.shape == (count,)
    assert list(out) == elements and all(type(v) is bytes for v in out)


def test_the_fast_path_equals_the_checked_one_on_random_tensors():
    rng = np.random.default_rng(0)
    for _ in range(50):
        count = int(rng.integers(3, 40))
        elements = [rng.bytes(int(rng.integers(0, 20))) for _ in range(count)]
        blob = serialize_bytes(np.array(elements, dtype=object))
        fast = http_codec._split_bytes(memoryview(blob), count)
        assert fast is not None
        assert list(fast) == list(http_codec._split_bytes_checked(blob, count, "x")) == elements


def _tensor(*lengths_and_payloads) -> bytes:
    out = b""
    for n, payload in lengths_and_payloads:
        out += struct.pack("<I", n) + payload
    return out


@pytest.mark.parametrize(("blob", "count", "message"), [
    # the 3rd element says 9 bytes, 2 follow: neither a short element nor the next one read from inside it
    (_tensor((1, b"a"), (1, b"b"), (9, b"cd")), 3, "BYTES element 2 claims 9 bytes past the end"),
    # the 2nd element's length runs past the end while a later prefix would still fit the total
    (_tensor((1, b"a"), (200, b"bcdefgh"), (0, b"")), 3, "BYTES element 1 claims 200 bytes past the end"),
    # a length prefix cut off
    (_tensor((1, b"a"), (1, b"b"), (1, b"c")) + b"\x01\x00", 4, "holds fewer than the 4 elements"),
    # bytes after the last element
    (_tensor((1, b"a"), (1, b"b"), (1, b"c")) + b"zz", 3, "2 bytes left over after 3 elements"),
    # too small for the shape at all (refused before anything is allocated)
    (b"\x00" * 8, 3, "cannot hold the 3 elements"),
])
def test_malformed_tensors_are_refused_with_what_is_wrong(blob, count, message):
    assert http_codec._split_bytes(blob, count) is None
    with pytest.raises(InvalidArgument, match=message) as info:
        deserialize_bytes(memoryview(blob), count, "ROW")
    assert "input 'ROW'" in str(info.value)


@pytest.mark.parametrize("count", [0, 1, 2, 3, len(ELEMENTS)])
@pytest.mark.parametrize("wrap", [bytes, memoryview], ids=["bytes", "memoryview"])
def test_a_tensor_inside_a_body_is_read_by_offset(count, wrap):
    """An HTTP body's tensor is read in place (start, end): the bytes around it are never part of it."""
    blob = serialize_bytes(np.array(ELEMENTS + [b""], dtype=object)[:count])
    body = b'{"json": "header"}' + blob + serialize_bytes(np.array([b"next", b"tensor"], dtype=object))
    start = len(b'{"json": "header"}')
    out = deserialize_bytes(wrap(body), count, "ROW", start, start + len(blob))
    assert list(out) == ELEMENTS[:count] and all(type(v) is bytes for v in out)


@pytest.mark.parametrize(("blob", "count", "message"), [
    (_tensor((1, b"a"), (1, b"b"), (9, b"cd")), 3, "BYTES element 2 claims 9 bytes past the end"),
    (_tensor((1, b"a"), (200, b"bcdefgh"), (0, b"")), 3, "BYTES element 1 claims 200 bytes past the end"),
    (_tensor((1, b"a"), (1, b"b"), (1, b"c")) + b"\x01\x00", 4, "holds fewer than the 4 elements"),
    (_tensor((5, b"ab")), 1, "BYTES element 0 claims 5 bytes past the end"),
    (_tensor((1, b"a")) + b"z", 1, "1 bytes left over after 1 elements"),
])
def test_a_malformed_tensor_inside_a_body_never_reads_the_next_ones_bytes(blob, count, message):
    # followed by bytes that would complete the short element: its end is the tensor's, not the body's
    body = b"HEAD" + blob + b"\x00" * 300
    with pytest.raises(InvalidArgument, match=message):
        deserialize_bytes(body, count, "ROW", 4, 4 + len(blob))


def test_an_infer_body_with_two_bytes_tensors_keeps_each_to_its_own_bytes():
    import json

    first, second = serialize_bytes(np.array([b"abc"], dtype=object)), serialize_bytes(np.array([b"x", b"yz"], dtype=object))

    def body(first_blob: bytes, first_size: int) -> tuple[bytes, int]:
        header = json.dumps({"inputs": [
            {"name": "A", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": first_size}},
            {"name": "B", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(second)}}]}).encode()
        return header + first_blob + second, len(header)

    request = http_codec.decode_infer_request("m", "", *body(first, len(first)))
    assert [list(t.data) for t in request.inputs] == [[b"abc"], [b"x", b"yz"]]
    # A's element claims its 3 bytes plus B's first 5: refused, not read across into B
    bad = struct.pack("<I", 8) + b"abc"
    with pytest.raises(InvalidArgument, match="input 'A': BYTES element 0 claims 8 bytes past the end"):
        http_codec.decode_infer_request("m", "", *body(bad, len(bad)))
