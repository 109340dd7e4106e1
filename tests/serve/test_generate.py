"""Triton's HTTP generate extension (serve/generate.py) on a decoupled Python model: /generate_stream as
server-sent events, one per response, and /generate's single answer — side by side with real Triton."""

from __future__ import annotations

import http.client
import json

import pytest

from .conftest import build_model_repository
from .frontends import running_server


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_model_repository(tmp_path_factory.mktemp("generate"), ("repeat_py", "string_py"))


def post(url: str, path: str, doc) -> tuple[int, str, bytes]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(doc) if not isinstance(doc, bytes) else doc,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, r.getheader("Content-Type", ""), body


def events(body: bytes) -> list:
    return [json.loads(chunk[len(b"data: "):]) for chunk in body.split(b"\n\n") if chunk.startswith(b"data: ")]


def conversation(url: str) -> dict:
    """What a server answers to the same generate requests (status, content type, parsed answers)."""
    out = {}
    status, ctype, body = post(url, "/v2/models/repeat_py/generate_stream", {"IN": [1, 2, 3]})
    out["stream"] = (status, ctype.split(";")[0], events(body))
    status, ctype, body = post(url, "/v2/models/repeat_py/generate_stream", {"IN": [4, -1, 5]})
    out["stream_error"] = (status, [("error" if "error" in e else e["OUT"]) for e in events(body)])
    status, _, body = post(url, "/v2/models/repeat_py/generate", {"IN": [7]})
    out["one"] = (status, json.loads(body))
    status, _, body = post(url, "/v2/models/string_py/generate", {"TEXT": ["ab", "c"]})
    out["unary"] = (status, json.loads(body))
    status, _, body = post(url, "/v2/models/repeat_py/generate_stream", {"NOPE": [1]})
    out["bad_input"] = status
    status, _, body = post(url, "/v2/models/missing/generate", {"IN": [1]})
    out["unknown_model"] = status
    return out


def test_generate_stream_events(repo):
    with running_server(repo) as s:
        got = conversation(s.http_url)
    assert got["stream"] == (200, "text/event-stream", [
        {"model_name": "repeat_py", "model_version": "1", "OUT": v, "IDX": i} for i, v in enumerate((1, 2, 3))])
    assert got["stream_error"] == (200, [4, "error"])
    assert got["one"] == (200, {"model_name": "repeat_py", "model_version": "1", "OUT": 7, "IDX": 0})
    assert got["unary"] == (200, {"model_name": "string_py", "model_version": "1", "UPPER": ["AB", "C"],
                                  "LENGTH": [2, 1]})
    assert got["bad_input"] == 400 and got["unknown_model"] in (400, 404)


def test_same_answers_as_real_triton(repo, tmp_path):
    from .anchor import running_triton

    with running_triton(repo, tmp_path / "triton.log") as triton:
        theirs = conversation(triton.http_url)
    with running_server(repo) as s:
        ours = conversation(s.http_url)
    assert ours == theirs
