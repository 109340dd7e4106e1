"""Ensembles: data flows through input_map/output_map, independent steps, validation at load, a failing
step fails the request."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import numpy as np
import pytest

from azulite.errors import InvalidArgument
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
from azulite.serve.types import InferRequest, InferTensor, RequestedOutput

from .frontends import running_server
from .test_server import COUNT_WINDOWS, PERF_ANALYZER


def fp32(name, array) -> InferTensor:
    array = np.asarray(array, dtype=np.float32)
    return InferTensor(name, "FP32", array.shape, array)


ENSEMBLE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "A" data_type: TYPE_FP32 dims: [ 16 ] }}, {{ name: "B" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "SUM_PT" data_type: TYPE_FP32 dims: [ 16 ] }}, {{ name: "FINAL" data_type: TYPE_FP32 dims: [ 16 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "add_sub_onnx" model_version: -1
     input_map {{ key: "INPUT0" value: "A" }} input_map {{ key: "INPUT1" value: "B" }}
     output_map {{ key: "OUTPUT0" value: "s" }} output_map {{ key: "{diff_key}" value: "d" }} }},
  {{ model_name: "add_sub_pt" model_version: 1
     input_map {{ key: "INPUT__0" value: "A" }} input_map {{ key: "INPUT__1" value: "B" }}
     output_map {{ key: "OUTPUT__0" value: "SUM_PT" }} }},
  {{ model_name: "add_sub_py"
     input_map {{ key: "INPUT0" value: "s" }} input_map {{ key: "INPUT1" value: "{second}" }}
     output_map {{ key: "OUTPUT0" value: "FINAL" }} }}
] }}
"""


@pytest.fixture
def ensemble_repo(tmp_path, model_repository):
    for name in ("add_sub_onnx", "add_sub_pt", "add_sub_py"):
        shutil.copytree(model_repository / name, tmp_path / name)
    for name, diff_key, second in (("diamond", "OUTPUT1", "d"), ("bad_key", "NOPE", "d"), ("dangling", "OUTPUT1", "zz")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(ENSEMBLE.format(name=name, diff_key=diff_key, second=second))
    return tmp_path


def test_ensemble_dataflow_and_validation(ensemble_repo):
    dp = TritonDataPlane(DataPlaneSettings(repository=ensemble_repo, strict_readiness=False))
    index = {m.name: m for m in dp.repository_index().models}
    assert index["diamond"].state == "READY"
    assert "'NOPE' is not an output of model 'add_sub_onnx'" in index["bad_key"].reason
    assert "input tensor 'zz' is neither an ensemble input nor produced by any step" in index["dangling"].reason

    async def main():
        a = np.arange(32, dtype=np.float32).reshape(2, 16)
        b = np.full((2, 16), 3, np.float32)
        r = await dp.infer(InferRequest("diamond", [fp32("A", a), fp32("B", b)]))
        out = {t.name: t.data for t in r.outputs}
        np.testing.assert_array_equal(out["SUM_PT"], a + b)
        np.testing.assert_array_equal(out["FINAL"], (a + b) + (a - b))
        r = await dp.infer(InferRequest("diamond", [fp32("A", a), fp32("B", b)], outputs=[RequestedOutput("FINAL")]))
        assert [t.name for t in r.outputs] == ["FINAL"]
        with pytest.raises(InvalidArgument, match="unexpected shape for input 'A' for model 'diamond'"):
            await dp.infer(InferRequest("diamond", [fp32("A", a[:, :4]), fp32("B", b)]))
        for name in ("diamond", "add_sub_onnx", "add_sub_pt", "add_sub_py"):
            assert dp.model_statistics(name).model_stats[0].inference_stats.success.count == 2, name
        # the ensemble's own queue and compute counts, as Triton's (perf_analyzer finds its version by them)
        diamond = dp.model_statistics("diamond").model_stats[0]
        s = diamond.inference_stats
        assert s.queue.count == s.compute_input.count == s.compute_infer.count == s.compute_output.count == 2
        assert s.compute_infer.ns > 0 and diamond.inference_count == 4 and diamond.execution_count == 2
        assert [(b.batch_size, b.compute_infer.count) for b in diamond.batch_stats] == [(2, 2)]
        await dp.shutdown()

    asyncio.run(main())


def test_failing_step_fails_the_ensemble_request(ensemble_repo):
    (ensemble_repo / "add_sub_py" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def execute(self, requests):\n        raise RuntimeError('step broke')\n")
    dp = TritonDataPlane(DataPlaneSettings(repository=ensemble_repo, strict_readiness=False))

    async def main():
        from azulite.errors import Internal

        a = np.ones((1, 16), np.float32)
        with pytest.raises(Internal, match="step broke"):
            await dp.infer(InferRequest("diamond", [fp32("A", a), fp32("B", a)]))
        assert dp.model_statistics("diamond").model_stats[0].inference_stats.fail.count == 1
        await dp.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_an_ensemble_with_no_version_given(ensemble_repo, tmp_path, protocol):
    """perf_analyzer (no -x) reads every model's statistics and takes the ensemble's version from the one
    whose queue count grew during its window: the ensemble's own stats must count like Triton's."""
    assert PERF_ANALYZER.exists(), "perf_analyzer missing: `make test` installs it (scripts/anchors.sh)"
    for name in ("bad_key", "dangling"):
        shutil.rmtree(ensemble_repo / name)
    # perf_analyzer asks for a step's model_version as written: unset reads as version 0, so name -1 (latest)
    config = ensemble_repo / "diamond" / "config.pbtxt"
    config.write_text(config.read_text().replace('model_name: "add_sub_py"', 'model_name: "add_sub_py" model_version: -1'))
    with running_server(ensemble_repo) as s:
        csv = tmp_path / "out.csv"
        p = subprocess.run([str(PERF_ANALYZER), "-m", "diamond", "-i", protocol, "-u",
                            s.http_url if protocol == "http" else s.grpc_url, "-b", "1", "--concurrency-range", "2",
                            *COUNT_WINDOWS, "--max-trials", "5", "--stability-percentage", "999", "-f", str(csv)],
                           capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "Composing models:" in p.stdout and "add_sub_py, version: 1" in p.stdout, p.stdout
        header, row = (line.split(",") for line in csv.read_text().splitlines()[:2])
        assert float(row[header.index("Inferences/Second")]) > 0


CHAINS = """
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "T" data_type: TYPE_STRING dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: {out_type} dims: [ -1 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "string_py" input_map {{ key: "TEXT" value: "T" }}
     output_map {{ key: "UPPER" value: "u" }} output_map {{ key: "LENGTH" value: "n" }} }},
  {{ model_name: "{second}" input_map {{ key: "{second_in}" value: "{fed}" }} output_map {{ key: "{second_out}" value: "OUT" }} }}
] }}
"""


def test_steps_go_to_the_composing_batchers_checked_and_counted(tmp_path, model_repository):
    """Steps skip the wire-shaped request (serve/ensemble.py step_item), yet a step's tensors are still held
    against the composing model's config (an earlier step's INT64 into an FP32 input fails naming the model
    and input), BYTES flow between steps, and each composing model counts its own requests as Triton does.
    The configs agree (a disagreement fails the load: test_ensemble_mistakes_fail_the_load_not_every_request);
    what a model answers may not: string_py's copy declares LENGTH FP32 and answers INT64."""
    for name in ("string_py", "add_sub_py"):
        shutil.copytree(model_repository / name, tmp_path / name)
    config = tmp_path / "string_py" / "config.pbtxt"
    config.write_text(config.read_text().replace('"LENGTH" data_type: TYPE_INT64', '"LENGTH" data_type: TYPE_FP32'))
    for name, out_type, second, second_in, fed, second_out in (
            ("shout", "TYPE_STRING", "string_py", "TEXT", "u", "UPPER"),
            ("mistyped", "TYPE_FP32", "add_sub_py", "INPUT0", "n", "OUTPUT0")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(CHAINS.format(
            name=name, out_type=out_type, second=second, second_in=second_in, fed=fed, second_out=second_out))
    dp = TritonDataPlane(DataPlaneSettings(repository=tmp_path))

    async def main():
        text = np.array([[b"ab", b"c"], [b"de", b"f"]], dtype=np.object_)
        r = await dp.infer(InferRequest("shout", [InferTensor("T", "BYTES", text.shape, text)]))
        assert r.outputs[0].datatype == "BYTES"
        assert r.outputs[0].data.tolist() == [[b"AB", b"C"], [b"DE", b"F"]]
        assert dp.model_statistics("string_py").model_stats[0].inference_stats.success.count == 2
        with pytest.raises(InvalidArgument, match="inference input 'INPUT0' data-type is 'INT64', but model "
                                                  "'add_sub_py' expects 'FP32'"):
            await dp.infer(InferRequest("mistyped", [InferTensor("T", "BYTES", text.shape, text)]))
        py = dp.model_statistics("add_sub_py").model_stats[0].inference_stats
        assert (py.success.count, py.fail.count) == (0, 1)
        assert dp.model_statistics("mistyped").model_stats[0].inference_stats.fail.count == 1
        assert dp.model_statistics("string_py").model_stats[0].inference_stats.success.count == 3
        await dp.shutdown()

    asyncio.run(main())


# a tokenizer-like step that answers text the way Triton's Python models often do (str objects, and a
# number, in an object array), and a step after it that reads its BYTES input as Triton hands it: bytes
TEXT_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("WORDS", np.array([["héllo", 7, np.str_("x")]] * len(r.inputs()[0].as_numpy()), dtype=object))])
                for r in requests]
'''
UPPER_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            words = r.inputs()[0].as_numpy()
            upper = np.array([w.decode().upper().encode() for w in words.reshape(-1)], dtype=object).reshape(words.shape)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper)]))
        return out
'''
STEP = '''
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "{i}" data_type: {it} dims: [ -1 ] }} ]
output [ {{ name: "{o}" data_type: TYPE_STRING dims: [ -1 ] }} ]
parameters {{ key: "azulite_instance_process" value: {{ string_value: "{placement}" }} }}
'''
TEXT_ENSEMBLE = '''
name: "shout_{placement}"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "text_{placement}" input_map { key: "X" value: "X" } output_map { key: "WORDS" value: "w" } },
  { model_name: "upper_{placement}" input_map { key: "WORDS" value: "w" } output_map { key: "UPPER" value: "OUT" } }
] }
'''


def test_a_steps_text_reaches_the_next_step_as_bytes_whatever_the_instance_placement(tmp_path):
    """Triton hands a BYTES input to a Python model as bytes, whatever objects the step before put in its
    output (str, numbers): the same here with the steps' instances as threads or as processes."""
    for placement in ("false", "true"):
        for name, code, i, it, o in ((f"text_{placement}", TEXT_PY, "X", "TYPE_FP32", "WORDS"),
                                     (f"upper_{placement}", UPPER_PY, "WORDS", "TYPE_STRING", "UPPER")):
            (tmp_path / name / "1").mkdir(parents=True)
            (tmp_path / name / "config.pbtxt").write_text(STEP.format(name=name, i=i, it=it, o=o, placement=placement))
            (tmp_path / name / "1" / "model.py").write_text(code)
        (tmp_path / f"shout_{placement}" / "1").mkdir(parents=True)
        (tmp_path / f"shout_{placement}" / "config.pbtxt").write_text(
            TEXT_ENSEMBLE.replace("{placement}", placement))
    dp = TritonDataPlane(DataPlaneSettings(repository=tmp_path))

    async def run() -> None:
        try:
            for placement in ("false", "true"):
                x = np.array([[1.0], [2.0]], np.float32)
                response = await dp.infer(InferRequest(f"shout_{placement}", [InferTensor("X", "FP32", x.shape, x)]))
                (out,) = response.outputs
                assert out.datatype == "BYTES" and out.data.tolist() == [["HÉLLO".encode(), b"7", b"X"]] * 2, placement
                assert all(type(v) is bytes for v in out.data.reshape(-1))
        finally:
            await dp.shutdown(30)

    asyncio.run(run())


def test_ensemble_mistakes_fail_the_load_not_every_request(ensemble_repo):
    """A data type two steps disagree on, a pinned version that did not load, a composing model the repository
    lacks: each loaded READY and failed every request (the last as a 404 for a model never asked for, and a
    model listed that the repository never had)."""
    variants = {
        "dtype": ENSEMBLE.format(name="dtype", diff_key="OUTPUT1", second="d").replace(
            '{ name: "A" data_type: TYPE_FP32', '{ name: "A" data_type: TYPE_INT32'),
        "version": ENSEMBLE.format(name="version", diff_key="OUTPUT1", second="d").replace("model_version: 1", "model_version: 7"),
        "missing": ENSEMBLE.format(name="missing", diff_key="OUTPUT1", second="d").replace(
            'model_name: "add_sub_pt"', 'model_name: "does_not_exist"'),
        "out_dtype": ENSEMBLE.format(name="out_dtype", diff_key="OUTPUT1", second="d").replace(
            '{ name: "FINAL" data_type: TYPE_FP32', '{ name: "FINAL" data_type: TYPE_FP64'),
    }
    for name, text in variants.items():
        (ensemble_repo / name / "1").mkdir(parents=True)
        (ensemble_repo / name / "config.pbtxt").write_text(text)
    dp = TritonDataPlane(DataPlaneSettings(repository=ensemble_repo, strict_readiness=False))
    index = {m.name: m for m in dp.repository_index().models}
    assert index["dtype"].state == "UNAVAILABLE" and (
        "step 0: tensor 'A' (ensemble input) is TYPE_INT32, but input 'INPUT0' of model 'add_sub_onnx' takes TYPE_FP32"
        in index["dtype"].reason)
    assert "step 1: model 'add_sub_pt' has no version 7 loaded (loaded: 1)" in index["version"].reason
    assert "steps to model 'does_not_exist', which is not in the model repository" in index["missing"].reason
    assert "output 'FINAL' is TYPE_FP64 in its config, but output 'OUTPUT0' of model 'add_sub_py' is TYPE_FP32" in (
        index["out_dtype"].reason)
    assert "does_not_exist" not in index  # no phantom entry
    asyncio.run(dp.shutdown())
