"""Ensembles with a decoupled step (serve/ensemble.py stream_ensemble, serve/decoupled.py): each response of
the decoupled step runs the steps after it and becomes one response of the ensemble, which is decoupled
itself (its /config says so, unary infer is refused). The same conversations against real Triton 2.51
(Python backend) give the same answers; and through ``--workers 2``."""

from __future__ import annotations

import asyncio
import json
import queue
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import build_model_repository
from .frontends import running_server

PLUS_ONE_CONFIG = """name: "plus_one"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""
PLUS_ONE = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + np.int32(1))]) for r in requests]
"""
# X -> plus_one -> A -> repeat_py (decoupled: one response per element) -> R, I -> plus_one -> Y
CHAIN = """name: "chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [
  { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "I" data_type: TYPE_UINT32 dims: [ 1 ] }
]
ensemble_scheduling { step [
  { model_name: "plus_one" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "A" } },
  { model_name: "repeat_py" model_version: -1 input_map { key: "IN" value: "A" }
    output_map [ { key: "OUT" value: "R" }, { key: "IDX" value: "I" } ] },
  { model_name: "plus_one" model_version: -1 input_map { key: "IN" value: "R" } output_map { key: "OUT" value: "Y" } }
] }
"""
# the same, also answering A (made before the decoupled step: no response of it to go with): refused at load
MIXED = CHAIN.replace('"chain"', '"mixed"').replace(
    '{ name: "I" data_type: TYPE_UINT32 dims: [ 1 ] }',
    '{ name: "I" data_type: TYPE_UINT32 dims: [ 1 ] }, { name: "A" data_type: TYPE_INT32 dims: [ -1 ] }')
MIXED_ERROR = "in ensemble mixed, step of model 'mixed' receives inputs originated from different decoupled models"
# an ensemble whose only step is another decoupled ensemble: decoupled too
OUTER = """name: "outer"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "chain" model_version: -1 input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } }
] }
"""
REQUESTS = {"three": [1, 2, 3], "none": [], "bad": [4, -2, 5]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = build_model_repository(tmp_path_factory.mktemp("decoupled_ensemble"), ("repeat_py",))
    (root / "plus_one" / "1").mkdir(parents=True)
    (root / "plus_one" / "config.pbtxt").write_text(PLUS_ONE_CONFIG)
    (root / "plus_one" / "1" / "model.py").write_text(PLUS_ONE)
    for name, text in (("chain", CHAIN), ("outer", OUTER), ("mixed", MIXED)):
        (root / name / "1").mkdir(parents=True)  # Triton wants the empty version directory
        (root / name / "config.pbtxt").write_text(text)
    return root


def conversation(grpc_url: str, model: str, empty_final: bool) -> dict:
    """The three requests on one stream -> per request id, its responses in order: ({Y, I}, final flag),
    or ("error", message)."""
    seen: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: seen.put((result, error)))
    try:
        for rid, values in REQUESTS.items():
            x = grpcclient.InferInput("X", [len(values)], "INT32")
            x.set_data_from_numpy(np.array(values, dtype=np.int32))
            client.async_stream_infer(model, [x], request_id=rid, enable_empty_final_response=empty_final)
    finally:
        client.stop_stream()  # returns once the server closed the stream: every response is in
    out: dict = {}
    while not seen.empty():
        result, error = seen.get_nowait()
        if error is not None:
            out.setdefault("error", []).append(error.message())
            continue
        response = result.get_response()
        got = {name: result.as_numpy(name).tolist() for name in ("Y", "I") if result.as_numpy(name) is not None}
        out.setdefault(response.id, []).append((got, response.parameters["triton_final_response"].bool_param))
    client.close()
    return out


def unary_statuses(http_url: str, grpc_url: str, model: str) -> tuple[str, str]:
    statuses = []
    for lib, url in ((httpclient, http_url), (grpcclient, grpc_url)):
        x = lib.InferInput("X", [2], "INT32")
        x.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
        client = lib.InferenceServerClient(url)
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, [x])
        client.close()
        statuses.append((info.value.status(), info.value.message()))
    return statuses[0], statuses[1]


def settled(seen: dict, empty_final: bool) -> dict:
    """Per request, the tensors of its responses, in order, once the final marks are checked. When the last
    response leaves after the decoupled step sent its final flag, it is marked final; else, asked for, an
    empty final response follows it (which one depends on the two threads' timing, in Triton as here). A
    request that fails gets its error and no final mark; a response still in the steps when the error came
    is dropped (Triton's too)."""
    errors = seen.get("error", [])
    assert len(errors) == 1 and "element 1 is negative: -1" in errors[0], errors
    out = {}
    for rid in REQUESTS:
        responses = seen.get(rid, [])
        finals = [final for _, final in responses]
        assert not any(finals[:-1]), responses  # only the last may be marked final
        if rid == "bad":  # ended by its error
            assert not any(finals), responses
        elif empty_final:  # the end is marked: on the last response, or by an empty one after it
            assert finals and finals[-1], responses
        empty = [got for got, _ in responses if not got]
        assert not empty or (empty_final and not responses[-1][0] and len(empty) == 1), responses
        out[rid] = [got for got, _ in responses if got]
    return out


THREE = [{"Y": [3], "I": [0]}, {"Y": [4], "I": [1]}, {"Y": [5], "I": [2]}]


def check(seen: dict, empty_final: bool, three: list = THREE, bad: dict | None = None) -> None:
    answers = settled(seen, empty_final)
    assert answers["three"] == three and answers["none"] == []  # none: the decoupled step sent no response
    # 4 -> 5: answered (unless the error overtook it); -2 -> -1: the decoupled step's error ends the request
    assert answers["bad"] in ([], [bad or {"Y": [6], "I": [0]}]), answers["bad"]


@pytest.mark.parametrize("grpc_impl", ["h2", "grpcio"])
def test_each_response_of_the_decoupled_step_runs_the_steps_after_it(repo, grpc_impl):
    with running_server(repo, grpc_impl=grpc_impl) as s:
        for empty_final in (True, False):
            check(conversation(s.grpc_url, "chain", empty_final), empty_final)
            check(conversation(s.grpc_url, "outer", empty_final), empty_final,
                  [{"Y": [y]} for y in (3, 4, 5)], {"Y": [6]})
        config = requests.get(f"http://{s.http_url}/v2/models/chain/config", timeout=60).json()
        assert config["model_transaction_policy"] == {"decoupled": True}  # as Triton marks it
        (http_status, http_message), (grpc_status, grpc_message) = unary_statuses(s.http_url, s.grpc_url, "chain")
        assert http_status == "501" and "'chain' is decoupled" in http_message
        assert grpc_status == "StatusCode.UNIMPLEMENTED" and "ModelStreamInfer" in grpc_message
        # over HTTP, Triton's generate_stream: one event per response
        events = requests.post(f"http://{s.http_url}/v2/models/chain/generate_stream", json={"X": [7, 8]},
                               timeout=60).text.split("\n\n")
        assert [e for e in events if e] == [
            'data: {"model_name": "chain", "model_version": "1", "Y": 9, "I": 0}',
            'data: {"model_name": "chain", "model_version": "1", "Y": 10, "I": 1}']
        mixed = requests.get(f"http://{s.http_url}/v2/models/mixed/ready", timeout=60)
        index = {m["name"]: m for m in httpclient.InferenceServerClient(s.http_url).get_model_repository_index()}
        assert mixed.status_code == 400 and MIXED_ERROR in index["mixed"]["reason"]
        stats = httpclient.InferenceServerClient(s.http_url).get_inference_statistics("chain")
        inference = stats["model_stats"][0]["inference_stats"]
        # "three" and "none" twice, directly and through outer (8), and generate_stream: answered; "bad" four
        # times: failed; the unary calls were refused before they were requests of the model
        assert (inference["success"]["count"], inference["fail"]["count"]) == (9, 4)


def test_same_responses_as_real_triton(repo, tmp_path):
    from .anchor import running_triton

    def talk(t):
        seen = {(m, f): conversation(t.grpc_url, m, f) for m in ("chain", "outer") for f in (True, False)}
        config = requests.get(f"http://{t.http_url}/v2/models/chain/config", timeout=60).json()
        mixed = requests.get(f"http://{t.http_url}/v2/models/mixed/ready", timeout=60).status_code
        return seen, config["model_transaction_policy"], unary_statuses(t.http_url, t.grpc_url, "chain"), mixed

    with running_triton(repo, tmp_path / "triton.log", args=("--exit-on-error=false",)) as triton:
        theirs, their_policy, their_unary, their_mixed = talk(triton)
    with running_server(repo) as s:
        ours, our_policy, our_unary, our_mixed = talk(s)
    assert their_mixed == our_mixed == 400 and MIXED_ERROR in (tmp_path / "triton.log").read_text()  # same words
    for (model, empty_final), seen in theirs.items():
        mine, their = settled(ours[model, empty_final], empty_final), settled(seen, empty_final)
        assert {k: v for k, v in mine.items() if k != "bad"} == {k: v for k, v in their.items() if k != "bad"}
        assert not mine["bad"] or not their["bad"] or mine["bad"] == their["bad"]  # each as its timing allowed
    assert our_policy == their_policy == {"decoupled": True}
    assert [status for status, _ in our_unary] == [status for status, _ in their_unary]


def test_workers_2_stream_the_ensemble_alike(repo):
    from .test_workers import Workers

    w = Workers(repo, "--strict-readiness", "false", workers=2)  # 'mixed' fails to load
    try:
        grpc_url = f"127.0.0.1:{w.ports['GRPCInferenceService']}"
        for empty_final in (True, False):
            check(conversation(grpc_url, "chain", empty_final), empty_final)
    finally:
        w.stop()


def test_a_step_reloaded_as_decoupled_under_a_loaded_ensemble_is_named(tmp_path):
    """An ensemble loaded over a plain step whose model later reloads decoupled answers 503 naming the
    step and what to do (it was 501 'call it over ModelStreamInfer', which the ensemble did not take)."""
    root = tmp_path / "repo"
    (root / "p" / "1").mkdir(parents=True)
    (root / "p" / "config.pbtxt").write_text(PLUS_ONE_CONFIG.replace('"plus_one"', '"p"'))
    (root / "p" / "1" / "model.py").write_text(PLUS_ONE)
    (root / "e" / "1").mkdir(parents=True)
    (root / "e" / "config.pbtxt").write_text(
        'name: "e" platform: "ensemble" max_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "p" model_version: -1 input_map { key: "IN" value: "X" } '
        'output_map { key: "OUT" value: "Y" } } ] }\n')
    with running_server(root, model_control_mode="explicit", load_models=("e",)) as s:
        client = httpclient.InferenceServerClient(s.http_url)
        x = httpclient.InferInput("X", [2], "INT32")
        x.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
        assert client.infer("e", [x]).as_numpy("Y").tolist() == [2, 3]
        config = PLUS_ONE_CONFIG.replace('"plus_one"', '"p"') + "model_transaction_policy { decoupled: true }\n"
        client.load_model("p", config=_json_config(config))
        with pytest.raises(InferenceServerException) as info:
            client.infer("e", [x])
        assert info.value.status() == "503"
        assert "step model 'p' is decoupled now" in info.value.message() and "load the ensemble again" in \
            info.value.message()
        client.close()


def _json_config(text: str) -> str:
    from azulite.serve import config as cfg

    return json.dumps(cfg.config_to_dict(cfg.parse_config_text(text, model="p")))


# --- stream_ensemble and the origin rule, driven step by step --------------------------------------------

def _plan(text: str):
    from azulite.serve import config as cfg
    from azulite.serve.ensemble import plan_of

    return plan_of(cfg.parse_config_text(text, model="chain"))


def _drive(ends_before_last: bool, fails: bool = False, seen: list | None = None) -> list:
    """CHAIN's plan with the steps faked: repeat_py sends 1 and 2, then its end (or an error) either before
    the second response has gone through the last step, or only once it has. -> (Y, last) per response."""
    from azulite.serve.ensemble import stream_ensemble

    async def main():
        second_done = asyncio.Event()
        end = asyncio.Event()

        async def run_step(model, version, feed, wanted):
            value = feed["IN"] + 1
            if int(value[0]) == 3:  # the second response's last step
                if ends_before_last:
                    await end.wait()  # held until the decoupled step has ended
                second_done.set()
            return {"OUT": value}

        async def stream_step(model, version, feed, wanted):
            for v in (1, 2):
                yield {"OUT": np.array([v], np.int32), "IDX": np.array([v - 1], np.uint32)}
            if not ends_before_last:
                await second_done.wait()
            end.set()
            if fails:
                raise RuntimeError("the step failed")

        async for pool, last in stream_ensemble("chain", _plan(CHAIN), {"X": np.array([0], np.int32)}, run_step,
                                                stream_step, lambda step: step.model == "repeat_py"):
            seen.append((pool["Y"].tolist(), last))
        return seen

    seen = [] if seen is None else seen
    return asyncio.run(main())


def test_the_last_response_is_marked_final_only_when_the_decoupled_step_had_ended():
    assert _drive(ends_before_last=True) == [([2], False), ([3], True)]  # Triton's: no empty final after it
    assert _drive(ends_before_last=False) == [([2], False), ([3], False)]  # the end came later: an empty final


def test_a_decoupled_steps_error_fails_the_request_dropping_what_had_not_left():
    seen: list = []
    with pytest.raises(RuntimeError, match="the step failed"):
        _drive(ends_before_last=True, fails=True, seen=seen)
    assert seen == []  # the error came while both responses were still in their steps: neither is sent


def test_a_decoupled_step_no_output_comes_after_is_refused():
    """Two decoupled steps side by side, the outputs after one: the other's responses would each run the
    steps after the first again (a response per pair); refused at load, naming it."""
    from azulite.errors import ModelLoadError
    from azulite.serve import config as cfg
    from azulite.serve.ensemble import check_decoupled_origins

    head, tail = CHAIN.rsplit("] }\n", 1)
    text = head + ', { model_name: "repeat_py" input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "R2" } }' \
        + "] }\n" + tail
    config = cfg.parse_config_text(text, model="chain")

    def composing(name):
        c = cfg.parse_config_text(f'name: "{name}"', model=name)
        c.model_transaction_policy.decoupled = name == "repeat_py"
        return c

    with pytest.raises(ModelLoadError, match="decoupled step model\\(s\\) 'repeat_py' lead to none of its outputs"):
        check_decoupled_origins(config, composing)


@pytest.mark.parametrize(("outputs", "steps", "refused"), [
    # the chain itself: every step after repeat_py takes only what came from it
    ("Y I", "", None),
    # a step after it taking the ensemble's input X as well
    ("Y", '{ model_name: "two" input_map [ { key: "A" value: "R" }, { key: "B" value: "X" } ] '
          'output_map { key: "O" value: "Z" } }', "step of model 'two'"),
    # two decoupled steps' outputs meeting in one step
    ("Y", '{ model_name: "repeat_py" input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "R2" } }, '
          '{ model_name: "two" input_map [ { key: "A" value: "R" }, { key: "B" value: "R2" } ] '
          'output_map { key: "O" value: "Z" } }', "step of model 'two' .*\\(repeat_py, repeat_py\\)"),
])
def test_a_steps_inputs_must_come_after_the_same_decoupled_step(outputs, steps, refused):
    from azulite.errors import ModelLoadError
    from azulite.serve import config as cfg
    from azulite.serve.ensemble import check_decoupled_origins

    head, tail = CHAIN.rsplit("] }\n", 1)  # the step list's end
    text = head + (", " + steps if steps else "") + "] }\n" + tail
    if outputs == "Y":
        text = text.replace(',\n  { name: "I" data_type: TYPE_UINT32 dims: [ 1 ] }', "")
    config = cfg.parse_config_text(text, model="chain")
    decoupled = {"repeat_py": True, "plus_one": False, "two": False}

    def composing(name):
        c = cfg.parse_config_text(f'name: "{name}"', model=name)
        c.model_transaction_policy.decoupled = decoupled[name]
        return c

    if refused is None:
        check_decoupled_origins(config, composing)
    else:
        with pytest.raises(ModelLoadError, match="receives inputs originated from different decoupled models"):
            check_decoupled_origins(config, composing)
        with pytest.raises(ModelLoadError, match=refused):
            check_decoupled_origins(config, composing)
