"""serve/http_codec.py. Binary BYTES tensors (4-byte little-endian length, then the bytes, per element): the
sliced fast path and the element-by-element checked one decode alike, and every malformed tensor gets the
checked path's error naming what is wrong, never a short or shifted element. Headers seen before answer
from their plan as their JSON would. JSON tensors (orjson, the standard library where orjson refuses):
every numeric type reads back bit for bit in its own type, non-finite floats and big integers as before,
bools and strings refused for numbers."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from azulite.errors import InvalidArgument
from azulite.serve import http_codec
from azulite.serve.backends import pb_utils
from azulite.serve.http_codec import deserialize_bytes, serialize_bytes
from azulite.serve.http_replies import parse_json_body
from azulite.serve.types import InferTensor

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


def test_an_element_that_is_not_bytes_is_written_as_its_text():
    # a model's BYTES output holding numbers or text: each element as its text (Triton's
    # serialize_byte_tensor, pb_utils', and this server's JSON answers alike), never bytes(n) -- n zero
    # bytes, or an OverflowError for a number past a machine word
    array = np.array([b"raw", "é", 7, 10**30, 2.5, bytearray(b"ba"), np.int64(-3)], dtype=object)
    expected = [b"raw", "é".encode(), b"7", str(10**30).encode(), b"2.5", b"ba", b"-3"]
    assert list(deserialize_bytes(serialize_bytes(array), len(array), "OUT")) == expected
    # as pb_utils writes them (Triton's serialize_byte_tensor: it has no case for a bytearray) ...
    alike = [0, 1, 2, 3, 4, 6]
    triton = pb_utils.serialize_byte_tensor(array[alike]).tobytes()
    assert list(deserialize_bytes(triton, len(alike), "OUT")) == [expected[i] for i in alike]
    # ... and as a JSON answer writes them
    assert http_codec._json_data(InferTensor("OUT", "BYTES", (7,), array)) == [v.decode() for v in expected]


@pytest.mark.parametrize("value", ["false", 1, 0, None, {}])
def test_binary_data_flags_must_be_booleans(value):
    # "binary_data": "false" read as true (a non-empty string) answered binary to a client that asked for
    # JSON; Triton refuses any non-boolean there too (with a 500: here a 400 naming the parameter)
    x = {"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}
    for doc, words in (({"inputs": [x], "outputs": [{"name": "Y", "parameters": {"binary_data": value}}]},
                        "output 'Y': parameter 'binary_data' must be true or false"),
                       ({"inputs": [x], "parameters": {"binary_data_output": value}},
                        "parameter 'binary_data_output' must be true or false")):
        with pytest.raises(InvalidArgument, match=words) as e:
            http_codec.decode_infer_request("m", "", json.dumps(doc).encode(), None)
        assert json.dumps(value) in str(e.value)
    for flag in (True, False):
        doc = {"inputs": [x], "outputs": [{"name": "Y", "parameters": {"binary_data": flag}}],
               "parameters": {"binary_data_output": flag}}
        request = http_codec.decode_infer_request("m", "", json.dumps(doc).encode(), None)
        assert request.outputs[0].parameters == {"binary_data": flag}


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


# --- a header seen before: its plan, not its JSON (http_codec._PLANS / _HEADS) ---------------------------


def _infer_body(header: dict, *blobs: bytes) -> tuple[bytes, int]:
    head = json.dumps(header, separators=(",", ":")).encode()
    return head + b"".join(blobs), len(head)


_FP32_AND_BYTES = {"id": "r1", "parameters": {"priority": 1},
                   "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}},
                              {"name": "s", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 12}}],
                   "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}


def test_a_header_seen_before_decodes_its_own_body_and_fresh_objects():
    http_codec._PLANS.clear()
    requests = []
    for i in range(3):  # the first parses the JSON, the next ones reuse its plan
        x = np.arange(4, dtype=np.float32) + 10 * i
        strings = serialize_bytes(np.array([b"a%d" % i, b"b%d" % i], dtype=object))
        request = http_codec.decode_infer_request("m", "2", *_infer_body(_FP32_AND_BYTES, x.tobytes(), strings))
        assert request.model_name == "m" and request.model_version == "2" and request.id == "r1"
        assert request.inputs[0].data.tolist() == [x.tolist()] and request.inputs[0].shape == (1, 4)
        assert list(request.inputs[1].data) == [b"a%d" % i, b"b%d" % i]
        assert request.inputs[0].parameters == {} and request.parameters == {"priority": 1}
        assert [(o.name, o.parameters) for o in request.outputs] == [("y", {"binary_data": True})]
        requests.append(request)
    assert len(http_codec._PLANS) == 1  # the header was parsed once
    # nothing is shared between requests: what one request's path changes, the next never sees
    requests[1].parameters["sequence_id"] = 7
    requests[1].outputs[0].parameters["classification"] = 2
    again = http_codec.decode_infer_request("m", "", *_infer_body(
        _FP32_AND_BYTES, np.zeros(4, np.float32).tobytes(), serialize_bytes(np.array([b"aa", b"bb"], dtype=object))))
    assert again.parameters == {"priority": 1} and again.outputs[0].parameters == {"binary_data": True}


_TWO_STRINGS = serialize_bytes(np.array([b"abc", b"d"], dtype=object))  # 12 bytes


@pytest.mark.parametrize(("blobs", "message"), [
    ((b"\x00" * 16, _TWO_STRINGS + b"zz"), "body has 2 bytes after the inputs' binary data"),
    ((b"\x00" * 16, b"\x00" * 8), "runs past the end of the body"),
    ((b"\x00" * 16, struct.pack("<I", 9) + b"abcd" + struct.pack("<I", 0)), "BYTES element 0 claims 9 bytes"),
])
def test_a_header_seen_before_still_refuses_a_body_that_does_not_fit_it(blobs, message):
    http_codec._PLANS.clear()
    http_codec.decode_infer_request("m", "", *_infer_body(_FP32_AND_BYTES, b"\x00" * 16, _TWO_STRINGS))
    with pytest.raises(InvalidArgument, match=message):
        http_codec.decode_infer_request("m", "", *_infer_body(_FP32_AND_BYTES, *blobs))


def test_the_plans_stay_bounded():
    http_codec._PLANS.clear()
    header = {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "parameters": {"binary_data_size": 1}}]}
    for i in range(http_codec._PLANS_MAX + 5):  # an id per request: a header never seen again
        request = http_codec.decode_infer_request("m", "", *_infer_body({**header, "id": str(i)}, bytes([i % 256])))
        assert request.id == str(i) and request.inputs[0].data.tolist() == [i % 256 - 256 * (i % 256 > 127)]
    assert len(http_codec._PLANS) <= http_codec._PLANS_MAX


def _response(shape, data, rid="") -> tuple:
    from azulite.serve.types import InferResponse, InferTensor

    return InferResponse(model_name="m", model_version="1", id=rid,
                         outputs=[InferTensor("y", "FP32", shape, data)])


def test_an_answer_header_seen_before_is_the_one_its_json_gives():
    http_codec._HEADS.clear()
    request = http_codec.decode_infer_request("m", "", *_infer_body(
        {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "parameters": {"binary_data_size": 1}}],
         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}, b"\x01"))
    for shape, rid in (((1, 3), ""), ((1, 3), ""), ((2, 3), ""), ((1, 3), "r9"), ((2, 3), "")):
        data = np.random.default_rng(len(shape) + shape[0]).random(shape).astype(np.float32)
        body, hlen = http_codec.encode_infer_response(_response(shape, data, rid), request)
        doc = json.loads(body[:hlen])
        assert doc == {"model_name": "m", "model_version": "1", **({"id": rid} if rid else {}),
                       "outputs": [{"name": "y", "datatype": "FP32", "shape": list(shape),
                                    "parameters": {"binary_data_size": data.nbytes}}]}
        assert body[hlen:] == data.tobytes()
    assert len(http_codec._HEADS) == 3
    # a transposed (not C-contiguous) output is answered row-major
    data = np.arange(6, dtype=np.float32).reshape(3, 2).T
    body, hlen = http_codec.encode_infer_response(_response((2, 3), data), request)
    assert np.frombuffer(body[hlen:], np.float32).tolist() == data.reshape(-1).tolist()
    # JSON output asked for: no plan, the data in the JSON
    json_request = http_codec.decode_infer_request("m", "", *_infer_body(
        {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "parameters": {"binary_data_size": 1}}]}, b"\x01"))
    body, hlen = http_codec.encode_infer_response(_response((1, 2), np.ones((1, 2), np.float32)), json_request)
    assert hlen is None and json.loads(body)["outputs"][0]["data"] == [1.0, 1.0]


# --- JSON tensors (orjson, and the standard library where orjson refuses) ---------------------------------


def _json_answer(*outputs) -> dict:
    """Each (name, datatype, array) answered as JSON data to a request that asks for no binary output."""
    from azulite.serve.types import InferResponse, InferTensor

    request = http_codec.decode_infer_request("m", "", *_infer_body(
        {"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [1]}]}))
    response = InferResponse(model_name="m", model_version="1", id="",
                             outputs=[InferTensor(n, d, a.shape, a) for n, d, a in outputs])
    body, hlen = http_codec.encode_infer_response(response, request)
    assert hlen is None
    return json.loads(body)


@pytest.mark.parametrize("datatype", ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                                      "INT64", "FP16", "FP32", "FP64"])
def test_json_outputs_read_back_as_the_same_values_in_their_own_type(datatype):
    from azulite.serve.config import WIRE_TO_NUMPY

    dtype = WIRE_TO_NUMPY[datatype]
    rng = np.random.default_rng(7)
    if dtype.kind == "b":
        data = rng.random((2, 5)) < 0.5
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)  # the extremes too (UINT64's max and INT64's min are past a double's exact range)
        data = np.concatenate([np.array([info.min, info.max], dtype),
                               rng.integers(info.min, info.max, 8, dtype=dtype, endpoint=True)]).reshape(2, 5)
        assert data.max() == info.max and data.min() == info.min
    else:
        finfo = np.finfo(dtype)
        data = np.concatenate([np.array([finfo.max, finfo.tiny, -0.0, 1 / 3], dtype),
                               (rng.standard_normal(6) * 1e3).astype(dtype)]).reshape(2, 5)
    out = _json_answer(("y", datatype, data))["outputs"][0]
    assert out["shape"] == [2, 5] and out["datatype"] == datatype
    back = np.array(out["data"], dtype=dtype)  # as tritonclient's InferResult.as_numpy reads JSON data
    assert back.tobytes() == data.reshape(-1).tobytes()


def test_json_floats_are_the_shortest_text_of_their_own_type_and_row_major():
    data = np.array([[0.1234, -2.5, 1e-7]], np.float32)
    assert _json_answer(("y", "FP32", data))["outputs"][0]["data"] == [0.1234, -2.5, 1e-07]  # not 0.12340000271...
    t = np.arange(6, dtype=np.float32).reshape(3, 2).T
    assert _json_answer(("y", "FP32", t))["outputs"][0]["data"] == t.reshape(-1).tolist()
    strided = np.array([0.1234, 9.0, -2.5, 9.0], np.float32)[::2]  # a 1-D view with a stride: still FP32's shortest
    assert _json_answer(("y", "FP32", strided))["outputs"][0]["data"] == [0.1234, -2.5]


def test_json_non_finite_floats_are_written_as_before_and_nothing_else_changes():
    data = np.array([1.5, np.nan, np.inf, -np.inf], np.float32)
    doc = _json_answer(("y", "FP32", data), ("z", "INT32", np.array([3, 4], np.int32)),
                       ("s", "BYTES", np.array([b"ab", b"c"], dtype=object)))
    y, z, s = doc["outputs"]
    assert y["data"][0] == 1.5 and np.isnan(y["data"][1]) and y["data"][2:] == [float("inf"), float("-inf")]
    assert z["data"] == [3, 4] and s["data"] == ["ab", "c"]


def test_json_inputs_read_nan_and_big_integers_and_refuse_bools_for_numbers():
    def decode(header: dict):
        return http_codec.decode_infer_request("m", "", *_infer_body(header))

    # NaN / Infinity literals (what Python's json writes) and a parameter past 64 bits: the stdlib reads them
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": [1.0, float("nan"), float("inf")]}],
                       "parameters": {"seed": 2 ** 70}}).encode()
    request = http_codec.decode_infer_request("m", "", head, None)
    x = request.inputs[0].data
    assert x.dtype == np.float32 and x[0] == 1.0 and np.isnan(x[1]) and np.isinf(x[2])
    assert request.parameters["seed"] == 2 ** 70
    assert decode({"inputs": [{"name": "x", "datatype": "INT64", "shape": [2, 2], "data": [[1, 2], [3, -4]]}]}
                  ).inputs[0].data.tolist() == [[1, 2], [3, -4]]
    assert decode({"inputs": [{"name": "x", "datatype": "FP64", "shape": [2], "data": [1, 2.5]}]}).inputs[0].data.tolist() == [1.0, 2.5]
    for datatype, data, said, want in (
            ("FP32", [1.0, True], r"element 1 of 'data' is true, not a number \(FP32\)", "numbers"),
            ("INT32", [1, 2.0], r"element 1 of 'data' is 2.0, not a whole number within INT32's range", "numbers"),
            ("INT32", [2.5, 2], r"element 0 of 'data' is 2.5, not a whole number \(INT32\)", "numbers"),
            ("BOOL", [True, 1], r"element 1 of 'data' is 1, not true or false \(BOOL\)", "booleans"),
            ("UINT8", [1, None], r"element 1 of 'data' is null, not a whole number \(UINT8\)", "numbers"),
            ("FP32", [1.0, "2"], r"element 1 of 'data' is \"2\", not a number \(FP32\)", "numbers")):
        with pytest.raises(InvalidArgument, match=f"(?s)input 'x': {said}.*{want}"):
            decode({"inputs": [{"name": "x", "datatype": datatype, "shape": [2], "data": data}]})
    with pytest.raises(InvalidArgument, match="malformed JSON in the infer request"):
        http_codec.decode_infer_request("m", "", b'{"inputs": [', None)


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1.5e309"])
def test_a_json_number_past_a_doubles_range_is_refused_not_made_infinite(number):
    """Python reads ``1e400`` as infinity; a double cannot hold it (Triton: "Number too big to be stored in
    double", a 500 there, a client's mistake here). ``Infinity`` written as such stays accepted (above)."""
    head = ('{"inputs":[{"name":"x","datatype":"FP64","shape":[2],"data":[%s, 1]}]}' % number).encode()
    with pytest.raises(InvalidArgument) as exc:
        http_codec.decode_infer_request("m", "", head, None)
    assert f"number {number} is too big to be stored in a double" in str(exc.value) and "Infinity" in exc.value.fix
    with pytest.raises(InvalidArgument, match=f"number {number} is too big"):
        parse_json_body(('{"log_verbose_level": %s}' % number).encode())


def test_an_integer_past_64_bits_in_an_integer_tensor_is_past_its_range():
    """orjson reads 2**64 as a float: still named as past the range, not as a number of the wrong kind."""
    head = ('{"inputs":[{"name":"x","datatype":"UINT64","shape":[1],"data":[%d]}]}' % 2 ** 64).encode()
    with pytest.raises(InvalidArgument, match=r"element 0 of 'data' is past the range of UINT64 \(0 to 18446744073709551615\)"):
        http_codec.decode_infer_request("m", "", head, None)


@pytest.mark.parametrize("datatype, data, index, bounds", [
    ("FP32", [1.0, 1e300], 1, "-3.40282e+38 to 3.40282e+38"),  # no longer made infinite, with a warning in the log
    ("FP32", [1e39, 2.0], 0, "-3.40282e+38 to 3.40282e+38"),
    ("FP32", [2.0, 10 ** 40], 1, "-3.40282e+38 to 3.40282e+38"),
    ("FP64", [10 ** 400, 1.0], 0, "-1.79769e+308 to 1.79769e+308"),
    ("INT8", [1, 300], 1, "-128 to 127"),
    ("UINT8", [-1, 3], 0, "0 to 255"),
    ("INT64", [2 ** 63, 0], 0, "-9223372036854775808 to 9223372036854775807"),
])
def test_json_inputs_past_their_datatypes_range_are_refused_naming_the_element(datatype, data, index, bounds):
    import warnings

    body = http_codec.decode_infer_request
    header = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [2], "data": data}]}).encode()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing reaches the log as a RuntimeWarning
        with pytest.raises(InvalidArgument) as exc:
            body("m", "", header, None)
    assert f"input 'x': element {index} of 'data' is past the range of {datatype} ({bounds})" in str(exc.value)
    assert "send values within" in exc.value.fix


def test_json_inputs_at_their_datatypes_range_and_infinity_still_read():
    header = json.dumps({"inputs": [
        {"name": "f", "datatype": "FP32", "shape": [3], "data": [3.4028234e38, -3.4028234e38, float("inf")]},
        {"name": "u", "datatype": "UINT64", "shape": [2], "data": [2 ** 64 - 1, 0]},
        {"name": "i", "datatype": "INT8", "shape": [2], "data": [-128, 127]}]}).encode()
    f, u, i = (t.data for t in http_codec.decode_infer_request("m", "", header, None).inputs)
    assert f.tolist()[:2] == [float(np.finfo(np.float32).max), float(np.finfo(np.float32).min)] and np.isinf(f[2])
    assert u.tolist() == [2 ** 64 - 1, 0] and i.tolist() == [-128, 127]


@pytest.mark.parametrize("size", [True, -1, 1.5, "4"])
def test_a_binary_data_size_that_is_no_byte_count_is_refused_naming_it(size):
    """``true`` was taken as the integer 1 (Python's bool is an int): 'binary_data_size is True bytes'."""
    header = json.dumps({"inputs": [{"name": "x", "datatype": "INT8", "shape": [1],
                                     "parameters": {"binary_data_size": size}}]}).encode()
    with pytest.raises(InvalidArgument) as exc:
        http_codec.decode_infer_request("m", "", header + b"\x01", len(header))
    assert f"input 'x': binary_data_size must be a non-negative integer, got {json.dumps(size)}" in str(exc.value)
