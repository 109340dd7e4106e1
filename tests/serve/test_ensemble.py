"""Ensembles: data flows through input_map/output_map, independent steps, validation at load, a failing
step fails the request."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from azulite.errors import InvalidArgument
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
from azulite.serve.types import InferRequest, InferTensor, RequestedOutput


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
