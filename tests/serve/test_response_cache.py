"""Triton's response cache (serve/response_cache.py): a repeated request is answered from the cache
without running the model (the model counts its executions, so a cached answer shows the count of the
execution that made it), over HTTP and gRPC, counted as Triton counts it; the key covers the inputs'
bytes, datatype, shape and the outputs asked for; the cache stays within its bytes."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from azulite.errors import ModelLoadError, SpecError
from azulite.serve import config as cfg
from azulite.serve.response_cache import CacheSettings, ResponseCache, parse_cache_config

from .frontends import running_server

COUNTING = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        self.executions += 1
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2),
                                                   pb_utils.Tensor("N", np.array([self.executions], np.int64))]))
        return out
"""
CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }}, {{ name: "N" data_type: TYPE_INT64 dims: [ 1 ] }} ]
{cache}
"""


@pytest.fixture()
def repo(tmp_path):
    for name, cache in (("cached", "response_cache { enable: true }"), ("uncached", "")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(CONFIG.format(name=name, cache=cache))
        (tmp_path / name / "1" / "model.py").write_text(COUNTING)
    return tmp_path


def ask(client, lib, model: str, values, outputs=None) -> tuple[list[float], int | None]:
    x = lib.InferInput("X", [len(values)], "FP32")
    x.set_data_from_numpy(np.array(values, np.float32))
    wanted = None if outputs is None else [lib.InferRequestedOutput(name) for name in outputs]
    result = client.infer(model, [x], outputs=wanted)
    n = result.as_numpy("N")
    return result.as_numpy("Y").tolist() if result.as_numpy("Y") is not None else [], None if n is None else int(n[0])


def test_a_repeated_request_is_answered_from_the_cache(repo):
    with running_server(repo, cache=CacheSettings(1 << 20)) as server:
        http = httpclient.InferenceServerClient(server.http_url)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        assert ask(http, httpclient, "cached", [1, 2]) == ([2, 4], 1)
        assert ask(grpc, grpcclient, "cached", [1, 2]) == ([2, 4], 1)  # the first execution's answer, kept
        assert ask(http, httpclient, "cached", [1, 3]) == ([2, 6], 2)  # other bytes: run
        assert ask(http, httpclient, "cached", [1, 2, 0]) == ([2, 4, 0], 3)  # other shape: run
        assert ask(http, httpclient, "cached", [1, 2], outputs=["Y"]) == ([2, 4], None)  # other outputs: run
        assert ask(http, httpclient, "cached", [1, 2], outputs=["Y"]) == ([2, 4], None)  # ... then kept
        assert ask(http, httpclient, "uncached", [1, 2]) == ([2, 4], 1)
        assert ask(http, httpclient, "uncached", [1, 2]) == ([2, 4], 2)  # no response_cache: runs each time
        stats = http.get_inference_statistics("cached")["model_stats"][0]
        inference = stats["inference_stats"]
        assert (inference["cache_hit"]["count"], inference["cache_miss"]["count"]) == (2, 4)
        assert inference["success"]["count"] == 6 and stats["execution_count"] == 4  # a hit runs nothing
        assert inference["cache_hit"]["ns"] > 0 and inference["cache_miss"]["ns"] > 0
        text = urllib.request.urlopen(server.metrics_url, timeout=60).read().decode()
        assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 2' in text
        assert 'nv_cache_num_misses_per_model{model="cached",version="1"} 4' in text
        assert "azulite_response_cache_entries 4" in text


def test_without_a_server_cache_a_model_runs_uncached(repo, caplog):
    with running_server(repo) as server:
        http = httpclient.InferenceServerClient(server.http_url)
        assert [ask(http, httpclient, "cached", [5])[1] for _ in range(2)] == [1, 2]
        text = urllib.request.urlopen(server.metrics_url, timeout=60).read().decode()
        assert "nv_cache_num_hits_per_model" not in text  # as Triton: no cache, no cache metrics
    assert "enables response_cache but the server has no cache" in caplog.text


def test_the_key_and_the_bound():
    cache = ResponseCache(64)
    x = np.arange(4, dtype=np.float32)
    keys = {ResponseCache.key("m", 1, {"X": x}, None), ResponseCache.key("m", 2, {"X": x}, None),
            ResponseCache.key("n", 1, {"X": x}, None), ResponseCache.key("m", 1, {"Z": x}, None),
            ResponseCache.key("m", 1, {"X": x.astype(np.int32)}, None), ResponseCache.key("m", 1, {"X": x[:2]}, None),
            ResponseCache.key("m", 1, {"X": x.reshape(2, 2)}, None), ResponseCache.key("m", 1, {"X": x}, frozenset({"Y"})),
            ResponseCache.key("m", 1, {"X": np.array([b"ab", b"c"], dtype=object)}, None),
            ResponseCache.key("m", 1, {"X": np.array([b"a", b"bc"], dtype=object)}, None)}
    assert len(keys) == 10
    assert ResponseCache.key("m", 1, {"X": x[::2]}, None) == ResponseCache.key("m", 1, {"X": x[::2].copy()}, None)
    out = np.zeros(8, np.float32)  # 32 bytes: two fit in 64
    cache.put(b"a", {"Y": out})
    out[0] = 9  # the model reusing its buffer does not change what was kept
    assert cache.get(b"a")["Y"][0] == 0 and not cache.get(b"a")["Y"].flags.writeable
    cache.put(b"b", {"Y": out})
    cache.get(b"a")  # a is now the most recently used
    cache.put(b"c", {"Y": out})  # evicts b, the least recently used
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.used == 64 and cache.evictions == 1
    cache.put(b"big", {"Y": np.zeros(100, np.float32)})  # larger than the whole cache: not kept
    assert cache.get(b"big") is None and len(cache) == 2


def test_cache_flags_and_configs_that_cannot_cache():
    assert parse_cache_config(["local,size=1048576"]).size == 1 << 20
    assert parse_cache_config(["local,size=64MB"]).size == 64 << 20
    for flags, words in ((["redis,host=x"], "only the 'local' cache"), (["local,size=lots"], "not a number of bytes"),
                         (["local,count=3"], "is not local,size=BYTES")):
        with pytest.raises(SpecError, match=words):
            parse_cache_config(flags)
    base = CONFIG.format(name="m", cache="response_cache { enable: true }")
    for extra, kind in (("model_transaction_policy { decoupled: true }", "a decoupled model"),
                        ("sequence_batching { }", "a sequence model")):
        config = cfg.parse_config_text(base + extra, model="m")
        cfg.fill_defaults(config, model="m")
        with pytest.raises(ModelLoadError, match=f"response_cache cannot be enabled for {kind}"):
            cfg.validate_config(config, model="m")
