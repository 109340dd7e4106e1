"""The h2 transport's unary answer, packed in one go (serve/grpc_h2_calls.py), against the same frames
built one by one by h2_frames._frame: equal bytes for every stream id range and message size."""

from __future__ import annotations

import pytest

from azulite.serve.grpc_h2_calls import _unary_answer
from azulite.serve.h2_frames import (DATA, END_HEADERS, END_STREAM, HEADERS, _GRPC_PREFIX, _OK_TRAILERS,
                                     _RESPONSE_HEADERS, _frame)


@pytest.mark.parametrize("sid", [1, 255, 257, 65537, 2**31 - 1])
@pytest.mark.parametrize("size", [0, 1, 250, 251, 65531, 70000])
def test_a_unary_answer_is_the_frames_built_one_by_one(sid, size):
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    want = (_frame(HEADERS, END_HEADERS, sid, _RESPONSE_HEADERS)
            + _frame(DATA, 0, sid, _GRPC_PREFIX.pack(0, len(payload)) + payload)
            + _frame(HEADERS, END_HEADERS | END_STREAM, sid, _OK_TRAILERS))
    assert _unary_answer(sid, payload) == want
