"""Written by `azulite export` as dlrm_preprocess/<version>/model.py: raw Criteo TSV rows -> the DLRM model's
int64 inputs. A row is "I1..I13 <tab> C1..C26" (39 fields) or the same after a label (40 fields): decimal
counts (empty: 0) and hex category ids (empty: 0). The transform and the hashing run in the next model of
the ensemble. This file must run in any Triton Python backend: numpy (1.26 or later) only, no azulite.

It is also, with one line more (``TritonPythonModel = ScoringModel``), the model.py of the one-step served
pipeline (``azulite export --pipeline fused``): ``ScoringModel`` parses the rows of every request handed
over and runs the DLRM graph (the model.onnx beside it, onnxruntime) on them in one call -- one batcher,
one hand-off, no intermediate tensors between two models.

Why vectorised: with many rows per request, parsing is the server's per-row work. The whole batch is one
byte buffer, its tabs found at once, every field's bytes gathered right-aligned into a [digits, fields]
array, turned into digit values by byte arithmetic and summed by place value: no Python object per row or
per field. Anything the fast path is not sure of (a str row, a stray
character, a field too long, a value past int64) goes to ``parse_rows_checked``, which reads field by field
and names the first bad row and field -- so the fast path never has to decide an error itself.
"""

import re

import numpy as np

DENSE_OUTPUT = "DENSE_RAW"
CATEGORY_OUTPUT = "CATEGORY_IDS"
DENSE_COUNT, CATEGORY_COUNT = 13, 26
FEATURES = DENSE_COUNT + CATEGORY_COUNT

_DENSE = re.compile(r"-?[0-9]*")
_CAT = re.compile(r"[0-9a-fA-F]{0,16}")
INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)

_TAB, _MINUS = 9, 45
# at most 18 decimal digits always fit in int64 (10**18 - 1 < 2**63); longer fields take the checked path
_MAX_DECIMAL_DIGITS = 18
_POWERS_10 = 10 ** np.arange(_MAX_DECIMAL_DIGITS - 1, -1, -1, dtype=np.int64)
_PLACES_16 = np.left_shift(1, np.arange(60, -1, -4, dtype=np.int64))  # hex place values, 16 digits
_BACK = np.arange(-_MAX_DECIMAL_DIGITS, 0, dtype=np.int32)[:, None]  # a field's last bytes, from its end
# a byte -> the value of the hex digit it is (either case; a decimal digit's value too); 255: not a hex digit.
# Applied to the whole batch at once by bytes.translate (one C pass over the bytes, ~6 us for 64 rows),
# where a numpy table lookup over the gathered bytes first widened each to an index (~20 us); telling digits
# from letters by arithmetic needed np.where to choose, which branches per byte.
_HEX_VALUE = np.full(256, 255, dtype=np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16)
_HEX_VALUE[np.frombuffer(b"ABCDEF", dtype=np.uint8)] = np.arange(10, 16)
_DIGIT_VALUES = _HEX_VALUE.tobytes()
# Place values as float64 for fields short enough that every sum stays an exact integer (< 2**53): numpy's
# float matmul is BLAS's, its integer one a plain loop (~1.5x slower here); longer fields take the int64 one.
_POWERS_10_F = _POWERS_10.astype(np.float64)
_PLACES_16_F = _PLACES_16.astype(np.float64)
_EXACT_DECIMAL_DIGITS, _EXACT_HEX_DIGITS = 15, 13


def parse_rows(rows):
    """rows: array of bytes, shape [B] or [B, 1] -> (dense [B, 13] int64, categories [B, 26] int64).
    Raises ValueError naming the first bad row and field."""
    rows = np.asarray(rows, dtype=object).reshape(-1)
    parsed = parse_rows_fast(rows) if len(rows) >= FAST_FROM_ROWS else None
    return parsed if parsed is not None else parse_rows_checked(rows)


#: below this many rows the fast path's fixed cost (a few dozen numpy calls) is more than reading the
#: fields one by one
FAST_FROM_ROWS = 4


def parse_rows_fast(rows):
    """The whole batch at once; None when any row needs ``parse_rows_checked`` (a bad row, a str row...)."""
    n = len(rows)
    if n == 0:
        return np.zeros((0, DENSE_COUNT), dtype=np.int64), np.zeros((0, CATEGORY_COUNT), dtype=np.int64)
    try:
        blob = b"\t".join(rows)
    except TypeError:  # str rows, None...: read one by one
        return None
    if b"\n" in blob or b"\r" in blob:  # lines as read from a file keep their end: strip it, as the checked path
        rows = [r.rstrip(b"\r\n") for r in rows]
        blob = b"\t".join(rows)
        if b"\n" in blob or b"\r" in blob:
            return None
    # Rows joined by tabs: every field of every row lies between two tabs. The tab appended last ends the
    # last field and makes "the byte at a field's start" valid for an empty field at the very end.
    blob += b"\t"
    buf = np.frombuffer(blob, dtype=np.uint8)
    if len(buf) >= 1 << 31:
        return None
    values = np.frombuffer(blob.translate(_DIGIT_VALUES), dtype=np.uint8)  # each byte's digit value, or 255
    field_end = np.flatnonzero(buf == _TAB).astype(np.int32)
    field_start = np.empty_like(field_end)
    field_start[0] = 0
    field_start[1:] = field_end[:-1] + 1
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=n)
    row_end = np.cumsum(lengths + 1) - 1  # where each row's closing tab is
    # each row's last field: when the tabs are 39 (or 40, with labels) a row, every 39th (40th) tab closes a
    # row, if each closes the row expected -- then every row has that many fields; else (rows with and without
    # a label, a bad row) each found by search, and the counts checked
    per_row = len(field_end) // n
    last = np.arange(per_row - 1, len(field_end), per_row) \
        if per_row in (FEATURES, FEATURES + 1) and per_row * n == len(field_end) else None
    if last is None or not np.array_equal(field_end[last], row_end):
        last = np.searchsorted(field_end, row_end)
        counts = np.diff(last)  # fields per row, past the first row's (last[0] + 1)
        if not (FEATURES <= last[0] + 1 <= FEATURES + 1) or \
                (n > 1 and (counts.min() < FEATURES or counts.max() > FEATURES + 1)):
            return None
    # The last 39 fields of each row (a label, when there is one, is skipped unread, as the checked path
    # does), field-major: [39, rows]. Every array below keeps the rows innermost, so numpy's loops run
    # long and contiguous rather than a few digits at a time.
    index = np.arange(-(FEATURES - 1), 1)[:, None] + last
    start, end = field_start[index], field_end[index]
    dense = _decimal(buf, values, start[:DENSE_COUNT].ravel(), end[:DENSE_COUNT].ravel())
    if dense is None:
        return None
    cats = _hexadecimal(values, start[DENSE_COUNT:].ravel(), end[DENSE_COUNT:].ravel())
    if cats is None:
        return None
    return (np.ascontiguousarray(dense.reshape(DENSE_COUNT, n).T),
            np.ascontiguousarray(cats.reshape(CATEGORY_COUNT, n).T))


def _chars(values, start, end, max_width):
    """The fields' digit values right-aligned, one column per field: [width, fields] uint8, with the places
    before each field's first byte (the field before's bytes, or before the buffer) set to 0; None when a
    field is longer than ``max_width``. The places are zeroed by multiplying with a mask: a boolean-mask
    assignment (or np.where) over fields of mixed lengths branches on every byte and cost ~15x more (64
    rows: ~100 us)."""
    width = int((end - start).max())
    if width > max_width:
        return None
    pos = _BACK[len(_BACK) - width:] + end
    # "clip": a position before the buffer reads byte 0; the mask leaves it out anyway
    digits = np.take(values, pos, mode="clip")
    digits *= pos >= start
    return digits


def _decimal(buf, values, start, end):
    negative = (end > start) & (buf[start] == _MINUS)
    digits = _chars(values, start + negative, end, _MAX_DECIMAL_DIGITS)
    if digits is None or digits.max(initial=0) > 9:  # a hex letter (10-15) or any other byte (255)
        return None
    width = len(digits)
    if width <= _EXACT_DECIMAL_DIGITS:
        value = (_POWERS_10_F[_MAX_DECIMAL_DIGITS - width:] @ digits).astype(np.int64)
    else:
        value = _POWERS_10[_MAX_DECIMAL_DIGITS - width:] @ digits
    return np.where(negative, -value, value)


def _hexadecimal(values, start, end):
    digits = _chars(values, start, end, 16)
    if digits is None or digits.max(initial=0) > 15:
        return None
    width = len(digits)
    if width <= _EXACT_HEX_DIGITS:
        return (_PLACES_16_F[16 - width:] @ digits).astype(np.int64)
    if width == 16 and (digits[0] > 7).any():  # past int64: the checked path says which
        return None
    return _PLACES_16[16 - width:] @ digits


def parse_rows_checked(rows):
    """Field by field, each checked: the reference ``parse_rows_fast`` must equal, and the errors."""
    rows = np.asarray(rows, dtype=object).reshape(-1)
    dense = np.zeros((len(rows), DENSE_COUNT), dtype=np.int64)
    cats = np.zeros((len(rows), CATEGORY_COUNT), dtype=np.int64)
    for i, raw in enumerate(rows):
        line = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) == FEATURES + 1:
            fields = fields[1:]
        if len(fields) != FEATURES:
            raise ValueError(f"row {i}: {len(fields)} tab-separated fields; a Criteo row has 13 counts and 26 "
                             "categories (39 fields), optionally after its label (40)")
        for j, f in enumerate(fields[:DENSE_COUNT]):
            if not _DENSE.fullmatch(f):
                raise ValueError(f"row {i}, I{j + 1}: {f[:20]!r} is not a decimal integer (or empty)")
            v = int(f) if f not in ("", "-") else 0
            if not INT64_MIN <= v <= INT64_MAX:
                raise ValueError(f"row {i}, I{j + 1}: {f[:24]!r} does not fit in int64")
            dense[i, j] = v
        for j, f in enumerate(fields[DENSE_COUNT:]):
            if not _CAT.fullmatch(f):
                raise ValueError(f"row {i}, C{j + 1}: {f[:20]!r} is not a hex category id of 1-16 digits (or empty)")
            v = int(f, 16) if f else 0
            if v > INT64_MAX:
                raise ValueError(f"row {i}, C{j + 1}: {f!r} does not fit in int64")
            cats[i, j] = v
    return dense, cats


class PreprocessModel:
    """The ensemble's first step: raw rows -> DENSE_RAW and CATEGORY_IDS."""

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        rows = [pb_utils.get_input_tensor_by_name(r, "ROW").as_numpy().reshape(-1) for r in requests]
        # every request the batcher handed over parsed as one batch; a batch holding a bad row is parsed
        # again request by request, so only the request that sent it fails
        parsed = None
        if len(rows) > 1 and sum(len(r) for r in rows) >= FAST_FROM_ROWS:
            parsed = parse_rows_fast(np.concatenate(rows))
        if parsed is not None:
            parts, start = [], 0  # each request's rows, as views (np.split costs ~9 us a batch more)
            for r in rows:
                end = start + len(r)
                parts.append((parsed[0][start:end], parsed[1][start:end]))
                start = end
        else:
            parts = map(_or_error, rows)
        responses = []
        for part in parts:
            if isinstance(part, ValueError):
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(part))))
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(DENSE_OUTPUT, part[0]), pb_utils.Tensor(CATEGORY_OUTPUT, part[1])]))
        return responses


def _or_error(rows):
    try:
        return parse_rows(rows)
    except ValueError as e:
        return e


class ScoringModel:
    """The one-step pipeline: raw rows -> SCORE, parsing and the DLRM graph (``model.onnx`` in this version's
    folder, run by onnxruntime; onnxruntime must be installed in the Python backend's environment)."""

    def initialize(self, args):
        import json
        import os

        import onnxruntime as ort

        # as azulite's and Triton's ONNX Runtime backends: the config's intra_op_thread_count, else 1 thread
        # (the cores are shared with the server's own threads), and no spinning
        params = json.loads(args["model_config"]).get("parameters") or {}
        threads = int((params.get("intra_op_thread_count") or {}).get("string_value") or 1)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        self.output = self.session.get_outputs()[0].name

    def score(self, dense, cats):
        return self.session.run([self.output], {DENSE_OUTPUT: dense, CATEGORY_OUTPUT: cats})[0]

    def run_batch(self, feed):
        """{ROW: rows} -> {SCORE: scores}, in-process: what the export verifies this model.py by."""
        dense, cats = parse_rows(feed["ROW"])
        return {self.output: self.score(dense, cats)}

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        rows = [pb_utils.get_input_tensor_by_name(r, "ROW").as_numpy().reshape(-1) for r in requests]
        sizes = [len(r) for r in rows]
        # every request's rows parsed as one batch and scored in one session run; a batch holding a bad row
        # is parsed again request by request, and only the request that sent it fails
        parsed = parse_rows_fast(np.concatenate(rows)) if len(rows) > 1 and sum(sizes) >= FAST_FROM_ROWS else None
        parts = [None] * len(rows)
        if parsed is None:
            parts = [_or_error(r) for r in rows]
            good = [p for p in parts if not isinstance(p, ValueError)]
            if good:
                parsed = good[0] if len(good) == 1 else tuple(np.concatenate(x) for x in zip(*good))
        scores = None if parsed is None else self.score(*parsed)
        responses, start = [], 0
        for size, part in zip(sizes, parts):
            if isinstance(part, ValueError):
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(str(part), pb_utils.TritonError.INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(self.output, scores[start:start + size])]))
            start += size
        return responses


# the ensemble's step by default; the one-step pipeline's model.py ends with TritonPythonModel = ScoringModel
TritonPythonModel = PreprocessModel
