"""Backends: ONNX auto-complete, TorchScript binding, the Python backend's pb_utils API, instance
concurrency, auto_complete_config, BLS, load failures."""

from __future__ import annotations

import asyncio
import sys
import warnings

import numpy as np
import pytest
import torch

from azulite.errors import Internal, InvalidArgument
from azulite.serve.backends import pb_utils
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
from azulite.serve.types import InferRequest, InferTensor

from .conftest import write_add_sub_onnx


def plane(repo, **kw) -> TritonDataPlane:
    return TritonDataPlane(DataPlaneSettings(repository=repo, strict_readiness=False, **kw))


def fp32(name, array) -> InferTensor:
    array = np.asarray(array, dtype=np.float32)
    return InferTensor(name, "FP32", array.shape, array)


def python_model(root, name, config: str, code: str, version: int = 1, extra: dict | None = None):
    (root / name / str(version)).mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / name / "config.pbtxt").write_text(config)
    (root / name / str(version) / "model.py").write_text(code)
    for fname, text in (extra or {}).items():
        (root / name / str(version) / fname).write_text(text)


def test_onnx_without_config_is_auto_completed(tmp_path):
    write_add_sub_onnx(tmp_path / "auto_batch" / "1" / "model.onnx")
    write_add_sub_onnx(tmp_path / "auto_fixed" / "1" / "model.onnx", batch=False)
    dp = plane(tmp_path)
    batching = dp.model_config("auto_batch")
    assert batching.platform == "onnxruntime_onnx" and batching.max_batch_size == 4
    assert batching.HasField("dynamic_batching")
    assert [(t.name, list(t.dims)) for t in batching.input] == [("INPUT0", [16]), ("INPUT1", [16])]
    assert [t.name for t in batching.output] == ["OUTPUT0", "OUTPUT1"]
    strict = plane(tmp_path, disable_auto_complete_config=True)
    assert "auto-complete is disabled" in {m.name: m for m in strict.repository_index().models}["auto_batch"].reason
    fixed = dp.model_config("auto_fixed")
    assert fixed.max_batch_size == 0 and not fixed.HasField("dynamic_batching")
    assert list(fixed.input[0].dims) == [16]

    async def main():
        x = np.ones((3, 16), np.float32)
        r = await dp.infer(InferRequest("auto_batch", [fp32("INPUT0", x), fp32("INPUT1", x)]))
        assert r.outputs[0].data.sum() == 96
        r = await dp.infer(InferRequest("auto_fixed", [fp32("INPUT0", x[0]), fp32("INPUT1", x[0])]))
        assert r.outputs[1].data.tolist() == [0.0] * 16
        await dp.shutdown()

    asyncio.run(main())


def test_onnx_config_naming_a_missing_input_fails_to_load(tmp_path, model_repository):
    import shutil

    shutil.copytree(model_repository / "add_sub_onnx", tmp_path / "add_sub_onnx")
    config = tmp_path / "add_sub_onnx" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "INPUT1"', 'name: "INPUT9"'))
    dp = plane(tmp_path)
    index = {m.name: m for m in dp.repository_index().models}
    assert "config input 'INPUT9' is not an input of the ONNX model" in index["add_sub_onnx"].reason


class Scale(torch.nn.Module):
    """forward(offset, value): config inputs bind by argument name, not position."""

    def forward(self, offset: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value * 10 + offset


def test_torchscript_binds_inputs_by_forward_argument_name(tmp_path):
    (tmp_path / "scale" / "1").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(Scale())
    scripted.save(str(tmp_path / "scale" / "1" / "model.pt"))
    (tmp_path / "scale" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch" max_batch_size: 2\n'
        'input [ { name: "value" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "offset" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "out" data_type: TYPE_FP32 dims: [ 2 ] } ]')
    (tmp_path / "noconfig" / "1").mkdir(parents=True)
    scripted.save(str(tmp_path / "noconfig" / "1" / "model.pt"))
    dp = plane(tmp_path)
    assert "needs a config.pbtxt listing its inputs" in {m.name: m for m in dp.repository_index().models}["noconfig"].reason

    async def main():
        r = await dp.infer(InferRequest("scale", [fp32("value", [[1, 2]]), fp32("offset", [[3, 4]])]))
        assert r.outputs[0].data.tolist() == [[13, 24]]
        await dp.shutdown()

    asyncio.run(main())


def test_pb_utils_is_importable_by_triton_name_and_has_its_api():
    import triton_python_backend_utils as tpbu

    assert tpbu is pb_utils and sys.modules["triton_python_backend_utils"] is pb_utils
    config = {"input": [{"name": "a", "data_type": "TYPE_FP32", "dims": [2]}],
              "output": [{"name": "b", "data_type": "TYPE_STRING", "dims": [1]}]}
    assert pb_utils.get_input_config_by_name(config, "a")["dims"] == [2]
    assert pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "b")["data_type"]) is np.object_
    assert pb_utils.get_output_config_by_name(config, "zz") is None
    assert pb_utils.numpy_to_triton_type(np.float32) == 11 and pb_utils.triton_to_numpy_type(13) is np.object_
    t = pb_utils.Tensor("s", np.array(["ab", "c"]))
    assert t.as_numpy().tolist() == [b"ab", b"c"] and t.name() == "s"
    assert pb_utils.deserialize_bytes_tensor(pb_utils.serialize_byte_tensor(t.as_numpy())).tolist() == [b"ab", b"c"]
    back = pb_utils.Tensor.from_dlpack("x", pb_utils.Tensor("x", np.arange(3, dtype=np.float32)))
    assert back.as_numpy().tolist() == [0, 1, 2]
    import torch

    assert torch.from_dlpack(back).tolist() == [0, 1, 2]
    assert pb_utils.Tensor.from_dlpack("t", torch.arange(2)).as_numpy().tolist() == [0, 1]
    req = pb_utils.InferenceRequest(model_name="m", requested_output_names=["y"], inputs=[t], request_id="7")
    assert pb_utils.get_input_tensor_by_name(req, "s") is t and req.request_id() == "7"
    resp = pb_utils.InferenceResponse(error=pb_utils.TritonError("bad", pb_utils.TritonError.INVALID_ARG))
    assert resp.has_error() and resp.error().code() == 3 and resp.error().message() == "bad"
    with pytest.raises(pb_utils.TritonModelException, match="only available inside execute"):
        req.exec()
    # a request not traced hands an empty trace (the OpenTelemetry context: none), passed on as is
    assert isinstance(req.trace(), pb_utils.InferenceTrace) and req.trace().get_context() is None
    assert pb_utils.InferenceRequest(model_name="m", inputs=[t], trace=req.trace()).trace() is req.trace()
    with pytest.raises(pb_utils.TritonModelException, match="trace must be a pb_utils.InferenceTrace"):
        pb_utils.InferenceRequest(model_name="m", inputs=[t], trace="yes")
    mc = pb_utils.ModelConfig({"name": "m", "max_batch_size": 0})
    mc.set_max_batch_size(4)
    mc.set_dynamic_batching()
    mc.add_input({"name": "a", "data_type": "TYPE_FP32", "dims": [2]})
    mc.add_input({"name": "a", "data_type": "TYPE_FP32", "dims": [2]})  # the same again: no change
    with pytest.raises(ValueError, match="unable to override input 'a'"):
        mc.add_input({"name": "a", "data_type": "TYPE_INT32", "dims": [2]})
    assert mc.as_dict()["max_batch_size"] == 4 and len(mc.as_dict()["input"]) == 1


AUTO = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [3]})
        auto_complete_model_config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [3]})
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def initialize(self, args):
        self.args = args

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + int(self.args["model_version"]))])
                for r in requests]
'''


def test_python_auto_complete_config_and_initialize_args(tmp_path):
    python_model(tmp_path, "auto_py", 'backend: "python"', AUTO, version=3)
    dp = plane(tmp_path)
    config = dp.model_config("auto_py")
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
    assert [(t.name, list(t.dims)) for t in config.input] == [("IN", [3])]

    async def main():
        ints = np.array([[1, 2, 3]], np.int32)
        r = await dp.infer(InferRequest("auto_py", [InferTensor("IN", "INT32", ints.shape, ints)]))
        assert r.outputs[0].datatype == "INT32" and r.outputs[0].data.tolist() == [[4, 5, 6]]
        await dp.shutdown()

    asyncio.run(main())


BARRIER_MODEL = '''
import barrier_state
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]

    def execute(self, requests):
        barrier_state.BARRIER.wait()  # passes only when two instances execute at the same time
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
                for r in requests]
'''


@pytest.mark.parametrize("count", [1, 2])
def test_instance_group_count_executes_concurrently(tmp_path, count):
    config = ('backend: "python" max_batch_size: 0\n'
              'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ] output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
              f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]")
    state = f"import threading\nBARRIER = threading.Barrier(2, timeout={10 if count == 2 else 1})\n"
    python_model(tmp_path, f"pair{count}", config, BARRIER_MODEL.replace("barrier_state", f"barrier_state{count}"),
                 extra={f"barrier_state{count}.py": state})
    dp = plane(tmp_path)

    async def main():
        results = await asyncio.gather(*(dp.infer(InferRequest(f"pair{count}", [fp32("x", [v])])) for v in (1, 2)),
                                       return_exceptions=True)
        if count == 2:
            assert [r.outputs[0].data.tolist() for r in results] == [[1], [2]]
        else:  # one instance cannot meet itself at the barrier: the control that shows the test can fail
            assert all(isinstance(r, Internal) and "BrokenBarrierError" in str(r) for r in results)
        await dp.shutdown()

    asyncio.run(main())


BLS_MODEL = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            bls = pb_utils.InferenceRequest(model_name="add_sub_onnx", requested_output_names=["OUTPUT0"],
                                            inputs=[pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", x)])
            result = bls.exec()
            if result.has_error():
                raise pb_utils.TritonModelException(result.error().message())
            doubled = pb_utils.get_output_tensor_by_name(result, "OUTPUT0").as_numpy()
            missing = pb_utils.InferenceRequest(model_name="nope", requested_output_names=["y"], inputs=[]).exec()
            assert missing.has_error() and missing.error().code() == pb_utils.TritonError.NOT_FOUND
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", doubled)]))
        return responses
'''


ASYNC_BLS_MODEL = BLS_MODEL.replace("def execute", "async def execute").replace(
    "result = bls.exec()", "result = await bls.async_exec()")


@pytest.mark.parametrize("code", [BLS_MODEL, ASYNC_BLS_MODEL], ids=["exec", "async_exec"])
def test_python_bls_calls_another_model(tmp_path, model_repository, code):
    import shutil

    shutil.copytree(model_repository / "add_sub_onnx", tmp_path / "add_sub_onnx")
    python_model(tmp_path, "bls", 'backend: "python" max_batch_size: 8\n'
                 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ] output [ { name: "y" data_type: TYPE_FP32 dims: [ 16 ] } ]',
                 code)
    dp = plane(tmp_path)

    async def main():
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        for _ in range(5):  # past the first batch too: a BLS model must never run on the event loop (deadlock)
            r = await asyncio.wait_for(dp.infer(InferRequest("bls", [fp32("x", x)])), 30)
            np.testing.assert_array_equal(r.outputs[0].data, 2 * x)
        assert dp.model_statistics("add_sub_onnx").model_stats[0].inference_stats.success.count == 5
        await dp.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("raise ImportError('no such dependency')", "importing .* raised ImportError: no such dependency"),
        ("class Other: pass", "defines no class TritonPythonModel"),
        ("class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('bad weights')",
         r"initialize\(\) raised RuntimeError: bad weights"),
    ],
)
def test_python_model_load_failures_are_reported(tmp_path, code, reason):
    python_model(tmp_path, "bad", 'backend: "python" input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ] '
                 'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]', code)
    python_model(tmp_path, "good", 'backend: "python" input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ] '
                 'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]',
                 "import triton_python_backend_utils as pb_utils\nclass TritonPythonModel:\n    def execute(self, requests):\n"
                 "        return [pb_utils.InferenceResponse([pb_utils.Tensor('y', r.inputs()[0].as_numpy())]) for r in requests]\n")
    dp = plane(tmp_path)
    index = {m.name: m for m in dp.repository_index().models}
    assert index["bad"].state == "UNAVAILABLE"
    import re

    assert re.search(reason, index["bad"].reason), index["bad"].reason
    if "initialize" in code:  # the version failed (listed with its reason, as Triton's index lists it); an
        assert index["bad"].version == "1"  # import fails auto-complete first, before any version
    assert index["good"].state == "READY"


def test_python_execute_returning_wrong_count_fails_the_batch(tmp_path):
    python_model(tmp_path, "short", 'backend: "python" max_batch_size: 0 input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ] '
                 'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]',
                 "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n")
    dp = plane(tmp_path)

    async def main():
        with pytest.raises(Internal, match=r"execute\(\) returned 0 responses for 1 requests"):
            await dp.infer(InferRequest("short", [fp32("x", [1])]))
        with pytest.raises(InvalidArgument):
            await dp.infer(InferRequest("short", [fp32("x", [1, 2])]))
        await dp.shutdown()

    asyncio.run(main())


def test_python_model_config_arg_is_triton_json(tmp_path):
    code = ("import json\nimport triton_python_backend_utils as pb_utils\nclass TritonPythonModel:\n"
            "    def initialize(self, args):\n        self.c = json.loads(args['model_config'])\n"
            "    def execute(self, requests):\n"
            "        dims = self.c['input'][0]['dims']\n"
            "        assert dims == [1] and isinstance(self.c['max_batch_size'], int), self.c\n"
            "        return [pb_utils.InferenceResponse([pb_utils.Tensor('y', r.inputs()[0].as_numpy())]) for r in requests]\n")
    python_model(tmp_path, "cfg", 'backend: "python" input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ] '
                 'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]', code)
    dp = plane(tmp_path)

    async def main():
        r = await dp.infer(InferRequest("cfg", [fp32("x", [5])]))
        assert r.outputs[0].data.tolist() == [5]
        await dp.shutdown()

    asyncio.run(main())


def test_onnx_string_tensors_round_trip_as_bytes(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["TEXT"], ["SAME"])], "echo",
                              [helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["batch", 2])],
                              [helper.make_tensor_value_info("SAME", TensorProto.STRING, ["batch", 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "echo" / "1").mkdir(parents=True)
    (tmp_path / "echo" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    dp = plane(tmp_path)
    assert dp.model_metadata("echo").inputs[0].datatype == "BYTES"

    async def main():
        text = np.array([[b"a", "\u00e9".encode()]], dtype=np.object_)
        r = await dp.infer(InferRequest("echo", [InferTensor("TEXT", "BYTES", text.shape, text)]))
        assert r.outputs[0].datatype == "BYTES" and r.outputs[0].data.tolist() == [[b"a", "\u00e9".encode()]]
        await dp.shutdown()

    asyncio.run(main())


def _plant_bytecode(source, evil: str) -> None:
    """A ``__pycache__`` .pyc for ``source`` whose header matches it (mtime, size): Python's own loader
    runs it instead of the source."""
    import importlib.util
    import marshal
    import os
    import struct

    st = source.stat()
    cached = importlib.util.cache_from_source(str(source))
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    with open(cached, "wb") as f:
        f.write(importlib.util.MAGIC_NUMBER + struct.pack("<III", 0, int(st.st_mtime) & 0xFFFFFFFF,
                                                          st.st_size & 0xFFFFFFFF))
        f.write(marshal.dumps(compile(evil, str(source), "exec")))


def test_a_models_python_runs_from_its_source_never_planted_bytecode(tmp_path):
    """The integrity manifest signs sources, not bytecode (Python writes it): a .pyc planted beside a
    signed model.py, or beside a module it imports, ran in their place. Nothing is written there either."""
    from azulite.serve.backends.python import _load_module

    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    (folder / "helper_for_bytecode_test.py").write_text("VALUE = 'source'\n")
    (folder / "model.py").write_text("import helper_for_bytecode_test as helper\n\n\n"
                                     "class TritonPythonModel:\n    VALUE = helper.VALUE\n    MINE = 'source'\n")
    _plant_bytecode(folder / "helper_for_bytecode_test.py", "VALUE = 'planted'\n")
    _plant_bytecode(folder / "model.py", "class TritonPythonModel:\n    VALUE = MINE = 'planted'\n")
    try:
        module = _load_module(folder / "model.py", "m")
        assert (module.TritonPythonModel.MINE, module.TritonPythonModel.VALUE) == ("source", "source")
    finally:
        sys.modules.pop("helper_for_bytecode_test", None)
    assert sorted(p.name for p in (folder / "__pycache__").iterdir()) == sorted(  # only the planted two
        ["helper_for_bytecode_test.cpython-%d%d.pyc" % sys.version_info[:2], "model.cpython-%d%d.pyc" % sys.version_info[:2]])


def test_python_execute_returning_none_says_a_list_is_needed_or_decoupled(tmp_path):
    python_model(tmp_path, "none", 'backend: "python" max_batch_size: 0 input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ] '
                 'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]',
                 "class TritonPythonModel:\n    def execute(self, requests):\n        return None\n")
    dp = plane(tmp_path)

    async def main():
        with pytest.raises(Internal, match=r"execute\(\) returned NoneType, not a list of pb_utils.InferenceResponse") \
                as info:
            await dp.infer(InferRequest("none", [fp32("x", [1])]))
        assert "decoupled: true" in info.value.fix
        await dp.shutdown()

    asyncio.run(main())
