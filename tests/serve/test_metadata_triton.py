"""What ``/config``, a model's (and a version's) metadata, the statistics, the log and trace settings answer, field by field against
real Triton 2.51 (the anchors installer's, Python backend): the same repository loaded by both and the
same requests sent, every difference outside the two listed below fails. The configs leave out what
Triton fills in (instance groups, preferred sizes, the sequence idle limit, the model file name, pinned
memory) so its normalization is what is compared. Durations and times differ by nature and are left out.

Known and kept: a request Triton refuses before it reaches the model (a missing input, a wrong shape) is
not in its statistics or its failure metric; azulite counts it, reason OTHER (tests/serve/test_dataplane.py),
so that a client sending bad requests shows on the dashboard and the alert rules."""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as tg
import tritonclient.http as th

from .conftest import MODELS_DIR, build_model_repository
from .frontends import running_server

IO = """input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""

#: add_sub_py's code under configs that each leave Triton something to fill in
VARIANTS = {
    "c_plain": "max_batch_size: 8",
    "c_nobatch": "max_batch_size: 0",
    "c_db_empty": "max_batch_size: 8\ndynamic_batching { }",
    "c_pref": "max_batch_size: 8\ndynamic_batching { preferred_batch_size: [2, 4] max_queue_delay_microseconds: 100 }",
    "c_prio": "max_batch_size: 8\ndynamic_batching { priority_levels: 3 default_priority_level: 2 "
              "default_queue_policy { max_queue_size: 4 } }",
    "c_groups": 'max_batch_size: 8\ninstance_group [ { count: 2 kind: KIND_CPU }, { name: "named" } ]',
    "c_oldest": "max_batch_size: 8\nsequence_batching { oldest { max_candidate_sequences: 4 } }",
    "c_direct": "max_batch_size: 8\nsequence_batching { direct { } }",
    "c_policy": "max_batch_size: 8\nversion_policy: { specific { versions: [1] } }",
    "c_params": 'max_batch_size: 8\nparameters { key: "k" value: { string_value: "v" } }\nresponse_cache { enable: true }',
    "c_rate": 'max_batch_size: 8\ninstance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: "R" count: 2 } ] } } ]',
    "c_file": 'max_batch_size: 8\ndefault_model_filename: "other.py"',
}
ENSEMBLE = """name: "c_ensemble"
platform: "ensemble"
max_batch_size: 8
{io}ensemble_scheduling {{ step [
  {{ model_name: "add_sub_py" model_version: -1 input_map {{ key: "INPUT0" value: "INPUT0" }}
    input_map {{ key: "INPUT1" value: "INPUT1" }} output_map {{ key: "OUTPUT0" value: "s" }} output_map {{ key: "OUTPUT1" value: "d" }} }},
  {{ model_name: "c_plain" model_version: -1 input_map {{ key: "INPUT0" value: "s" }} input_map {{ key: "INPUT1" value: "d" }}
    output_map {{ key: "OUTPUT0" value: "OUTPUT0" }} output_map {{ key: "OUTPUT1" value: "OUTPUT1" }} }} ] }}
"""
FROM_TESTS = ("add_sub_py", "string_py", "versioned_py", "repeat_py", "accumulate_py")


def repository(root: Path) -> tuple[Path, list[str]]:
    build_model_repository(root, FROM_TESTS)
    for name, text in VARIANTS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n{text}\n{IO}')
        shutil.copy(MODELS_DIR / "add_sub_py" / "model.py", root / name / "1" / ("other.py" if name == "c_file" else "model.py"))
    (root / "c_ensemble" / "1").mkdir(parents=True)
    (root / "c_ensemble" / "config.pbtxt").write_text(ENSEMBLE.format(io=IO))
    return root, [*FROM_TESTS, *VARIANTS, "c_ensemble"]


def metric_families(url: str) -> dict[str, dict]:
    """Triton's inference, CPU and pinned-memory metrics as a scrape shows them: each family's HELP, TYPE and
    label names."""
    families: dict[str, dict] = {}
    ours = ("nv_inference", "nv_cpu", "nv_pinned")
    for line in urllib.request.urlopen(url, timeout=60).read().decode().splitlines():
        if line.startswith(tuple(f"# {kind} {family}" for kind in ("HELP", "TYPE") for family in ours)):
            kind, name, text = line[2:].split(" ", 2)
            families.setdefault(name, {})[kind] = text
        elif line.startswith(ours):
            name = re.match(r"[a-z_]+", line).group(0)
            families.setdefault(name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                                if name.endswith(("_bucket", "_sum")) else name, {}).setdefault(
                "labels", set()).add(tuple(sorted(re.findall(r'(\w+)="', line))))
    return families


def answers(http_url: str, grpc_url: str, models: list[str], metrics_url: str) -> dict:
    http, grpc = th.InferenceServerClient(http_url), tg.InferenceServerClient(grpc_url)
    out = {}
    for m in models:
        out[m, "config"] = http.get_model_config(m)
        out[m, "grpc config"] = grpc.get_model_config(m, as_json=True)["config"]
        out[m, "metadata"] = http.get_model_metadata(m)
        out[m, "grpc metadata"] = grpc.get_model_metadata(m, as_json=True)
        out[m, "metadata v1"] = http.get_model_metadata(m, "1")
    out["versioned_py", "metadata v2"] = http.get_model_metadata("versioned_py", "2")
    out["versioned_py", "grpc metadata v2"] = grpc.get_model_metadata("versioned_py", "2", as_json=True)
    out["server", "logging"] = http.get_log_settings()  # the logging extension's defaults
    out["server", "grpc logging"] = grpc.get_log_settings(as_json=True)
    out["server", "trace"] = http.get_trace_settings()  # the trace extension's defaults, global and a model's
    out["c_plain", "trace"] = http.get_trace_settings("c_plain")
    out["server", "grpc trace"] = grpc.get_trace_settings(as_json=True)
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    for _ in range(3):  # one client, one at a time: each request is one execution of batch 2, on both
        inputs = [th.InferInput(name, [2, 16], "FP32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(x)
        http.infer("c_plain", inputs)
    deadline = time.monotonic() + 60  # Triton counts a request once it is released, after its answer
    while http.get_inference_statistics("c_plain")["model_stats"][0]["execution_count"] < 3:
        assert time.monotonic() < deadline, "the statistics never counted the three requests"
        time.sleep(0.01)  # polling the condition
    out["c_plain", "stats"] = untimed(http.get_inference_statistics("c_plain"))
    # azulite's own addition (a latency histogram) is left out: only the families Triton has are compared
    out["server", "metrics"] = {name: family for name, family in metric_families(metrics_url).items()
                                if not name.startswith("nv_inference_first_response_histogram")}
    out["c_nobatch", "grpc stats"] = untimed(grpc.get_inference_statistics("c_nobatch", as_json=True))
    out["all", "stats"] = untimed(http.get_inference_statistics())
    http.close()
    grpc.close()
    return out


def untimed(stats):
    """Statistics without what differs by nature: durations (``ns``) and the last inference's time."""
    if isinstance(stats, dict):
        return {k: untimed(v) for k, v in stats.items() if k not in ("ns", "last_inference")}
    if isinstance(stats, list):
        return [untimed(v) for v in stats]
    return stats


def known_differences(ours: dict, theirs: dict) -> None:
    """The two differences kept on purpose, made equal before comparing (each is asserted to be there,
    so this list cannot outlive them):
    - Triton writes a sequence state's ``initial_state`` dims as JSON strings (protobuf's int64 rule, the
      one field its writer does not turn back into numbers); azulite writes numbers, as for every other dims.
    - azulite's model_config.proto is newer than Triton 2.51's: an ensemble shows ``max_inflight_requests``."""
    for side in (ours["accumulate_py", "config"], theirs["accumulate_py", "config"]):
        for state in side["sequence_batching"]["state"]:
            for initial in state["initial_state"]:
                initial["dims"] = [int(d) for d in initial["dims"]]
    assert "max_inflight_requests" not in theirs["c_ensemble", "config"]["ensemble_scheduling"]
    assert ours["c_ensemble", "config"]["ensemble_scheduling"].pop("max_inflight_requests") == 0


def test_config_and_metadata_answer_as_tritons(tmp_path):
    from .anchor import running_triton

    root, models = repository(tmp_path / "repo")
    with running_triton(root, tmp_path / "triton.log") as triton:
        theirs = answers(triton.http_url, triton.grpc_url, models, triton.metrics_url)
    with running_server(root) as server:
        ours = answers(server.http_url, server.grpc_url, models, server.metrics_url)
    raw = json.dumps(theirs["accumulate_py", "config"]["sequence_batching"]["state"])
    assert '"dims": ["1"]' in raw  # Triton's quirk is still there (else drop it from known_differences)
    known_differences(ours, theirs)
    for key in theirs:
        assert ours[key] == theirs[key], key
    # the normalization compared is really there (a config that Triton left alone would compare equal too)
    assert theirs["c_db_empty", "config"]["dynamic_batching"]["preferred_batch_size"] == [8]
    assert theirs["c_plain", "config"]["instance_group"][0]["name"] == "c_plain"
    assert theirs["versioned_py", "metadata v2"]["versions"] == ["2"]
    plain = theirs["c_plain", "stats"]["model_stats"][0]
    assert plain["inference_count"] == 6 and plain["execution_count"] == 3 and "cache_hit" in plain["inference_stats"]
    assert plain["batch_stats"][0]["batch_size"] == 2
    assert {"nv_inference_request_success", "nv_inference_queue_duration_us", "nv_cpu_utilization",
            "nv_pinned_memory_pool_total_bytes"} <= set(theirs["server", "metrics"])
