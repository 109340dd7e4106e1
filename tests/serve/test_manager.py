"""Model control: modes none / explicit / poll, --load-model, load with a config override and files,
ensembles pulling in their composing models, unload_dependents, reload without dropping requests."""

from __future__ import annotations

import asyncio
import logging
import json
import os
import shutil
import time

import numpy as np
import pytest

from azulite.errors import ModelLoadError, NotFound, Unavailable, Unsupported
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
from azulite.serve.types import InferRequest, InferTensor


def plane(repo, **kw) -> TritonDataPlane:
    return TritonDataPlane(DataPlaneSettings(repository=repo, **kw))


def fp32(name, array) -> InferTensor:
    array = np.asarray(array, dtype=np.float32)
    return InferTensor(name, "FP32", array.shape, array)


def versioned(version: str = "") -> InferRequest:
    return InferRequest("versioned_py", [fp32("INPUT0", [0, 0, 0, 0])], model_version=version)


def test_none_mode_loads_everything_and_refuses_control(model_repository):
    dp = plane(model_repository)
    assert dp.ready() and dp.model_ready("add_sub_pt") and dp.model_ready("add_sub_ensemble")

    async def main():
        with pytest.raises(Unavailable, match="not allowed if model control mode is 'none'"):
            await dp.load_model("add_sub_py")
        with pytest.raises(Unavailable):
            await dp.unload_model("add_sub_py")
        await dp.shutdown()

    asyncio.run(main())


def test_explicit_mode_load_unload(model_repository):
    dp = plane(model_repository, control_mode="explicit", load_models=("versioned_py",))
    assert dp.ready() and dp.model_ready("versioned_py") and not dp.model_ready("add_sub_py")
    index = {m.name: m for m in dp.repository_index().models}
    assert index["add_sub_py"].state == "" and index["versioned_py"].state == "READY"

    async def main():
        with pytest.raises(NotFound, match="'add_sub_py' is not found"):
            await dp.infer(InferRequest("add_sub_py", []))
        await dp.load_model("add_sub_py")
        assert dp.model_ready("add_sub_py")
        await dp.unload_model("versioned_py")
        assert not dp.model_ready("versioned_py")
        with pytest.raises(Unavailable, match="no available versions"):
            await dp.infer(versioned())
        assert {m.state for m in dp.repository_index().models if m.name == "versioned_py"} == {"UNAVAILABLE"}
        await dp.load_model("versioned_py")
        assert (await dp.infer(versioned())).model_version == "2"
        with pytest.raises(NotFound, match="no model directory 'ghost'"):
            await dp.load_model("ghost")
        await dp.shutdown()

    asyncio.run(main())


def test_explicit_star_and_unknown_load_model(model_repository):
    assert plane(model_repository, control_mode="explicit", load_models=("*",)).model_ready("bench_matmul")
    dp = plane(model_repository, control_mode="explicit", load_models=("ghost", "string_py"))
    assert dp.model_ready("string_py") and not dp.ready()
    assert "no model directory 'ghost'" in {m.name: m for m in dp.repository_index().models}["ghost"].reason


def test_ensemble_load_pulls_composing_models_and_unload_dependents(model_repository):
    dp = plane(model_repository, control_mode="explicit")

    async def main():
        await dp.load_model("add_sub_ensemble")
        assert dp.model_ready("add_sub_onnx") and dp.model_ready("add_sub_py")
        # an ensemble cannot outlive a composing model; the other composing model stays
        await dp.unload_model("add_sub_onnx")
        assert not dp.model_ready("add_sub_ensemble") and dp.model_ready("add_sub_py")
        reason = {m.name: m.reason for m in dp.repository_index().models}["add_sub_ensemble"]
        assert "composing model 'add_sub_onnx' was unloaded" in reason
        # unload_dependents: the ensemble takes the composing models loaded only for it, not those loaded by name
        await dp.load_model("add_sub_onnx")
        await dp.load_model("add_sub_ensemble")
        await dp.unload_model("add_sub_ensemble", unload_dependents=True)
        assert not dp.model_ready("add_sub_ensemble") and not dp.model_ready("add_sub_py")
        assert dp.model_ready("add_sub_onnx")
        await dp.load_model("add_sub_ensemble")  # without the flag the composing models stay
        await dp.unload_model("add_sub_ensemble")
        assert dp.model_ready("add_sub_py") and dp.model_ready("add_sub_onnx")
        await dp.shutdown()

    asyncio.run(main())


def test_load_with_config_override_and_files(model_repository, tmp_path):
    dp = plane(model_repository, control_mode="explicit")
    onnx = (model_repository / "add_sub_onnx" / "1" / "model.onnx").read_bytes()

    async def main():
        config = json.loads(json.dumps({
            "name": "add_sub_onnx", "platform": "onnxruntime_onnx", "max_batch_size": 2,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                      {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [16]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]}]}))
        await dp.load_model("add_sub_onnx", {"config": json.dumps(config)})
        assert dp.model_config("add_sub_onnx").max_batch_size == 2
        assert [o.name for o in dp.model_metadata("add_sub_onnx").outputs] == ["OUTPUT0"]
        config["name"] = "uploaded"
        await dp.load_model("uploaded", {"config": json.dumps(config), "file:1/model.onnx": onnx})
        x = np.ones((1, 16), np.float32)
        r = await dp.infer(InferRequest("uploaded", [fp32("INPUT0", x), fp32("INPUT1", x)]))
        assert r.outputs[0].data.sum() == 32
        with pytest.raises(ModelLoadError, match="requires a 'config' parameter"):
            await dp.load_model("other", {"file:1/model.onnx": onnx})
        config["name"] = "escapes"
        with pytest.raises(ModelLoadError, match="invalid file path"):
            await dp.load_model("escapes", {"config": json.dumps(config), "file:../../evil.onnx": onnx})
        # made of the request's files alone and failed: not listed for good as UNAVAILABLE
        assert {"other", "escapes"}.isdisjoint(m.name for m in dp.repository_index().models)
        with pytest.raises(ModelLoadError, match="invalid JSON model configuration"):
            await dp.load_model("add_sub_onnx", {"config": "{not json"})
        # the failed reload left the loaded model as it was, serving
        assert dp.model_ready("add_sub_onnx") and dp.model_config("add_sub_onnx").max_batch_size == 2
        r = await dp.infer(InferRequest("add_sub_onnx", [fp32("INPUT0", x), fp32("INPUT1", x)]))
        assert r.outputs[0].data.sum() == 32
        await dp.load_model("add_sub_onnx")  # a good reload clears the failure, and keeps the override (Triton's)
        assert dp.model_config("add_sub_onnx").max_batch_size == 2
        assert not dp.manager.entries["add_sub_onnx"].load_error
        await dp.unload_model("add_sub_onnx")  # an unload drops it: config.pbtxt's again
        await dp.load_model("add_sub_onnx")
        assert dp.model_config("add_sub_onnx").max_batch_size != 2
        await dp.shutdown()

    asyncio.run(main())


def bump_mtime(path):
    later = time.time() + 5
    os.utime(path, (later, later))


def test_poll_mode_loads_new_reloads_changed_unloads_removed(repository_copy, caplog):
    root = repository_copy
    dp = plane(root, control_mode="poll")
    assert dp.model_config("versioned_py").version_policy.HasField("all")

    async def main():
        # changed: serve only version 1; new: a copy under another name; removed: string_py
        config = root / "versioned_py" / "config.pbtxt"
        config.write_text(config.read_text().replace("version_policy: { all { } }", "version_policy: { specific { versions: [1] } }"))
        bump_mtime(config)
        shutil.copytree(root / "add_sub_py", root / "add_sub_py2")
        c2 = root / "add_sub_py2" / "config.pbtxt"
        c2.write_text(c2.read_text().replace('name: "add_sub_py"', 'name: "add_sub_py2"'))
        shutil.rmtree(root / "string_py")
        slow = root / "slow_py" / "config.pbtxt"
        slow.write_text(slow.read_text().replace('string_value: "0.2"', 'string_value: "0.0"'))
        bump_mtime(slow)
        running = asyncio.ensure_future(dp.infer(InferRequest("slow_py", [fp32("INPUT0", [[7]])])))
        while not dp.model_statistics("slow_py").model_stats[0].inference_stats.queue.count:
            await asyncio.sleep(0.005)  # executing now (0.2 s), on the old instance
        with caplog.at_level(logging.INFO, logger="azulite.serve.poll"):
            await dp.poll()
        polled = [r.getMessage() for r in caplog.records if r.name == "azulite.serve.poll"]
        assert sorted(polled) == ["poll: model 'add_sub_py2' appeared, loaded: version(s) 1 ready",
                                  "poll: model 'slow_py' changed, reloaded: version(s) 1 ready",
                                  "poll: model 'string_py' left the repository: unloaded",
                                  "poll: model 'versioned_py' changed, reloaded: version(s) 1 ready"], polled
        assert (await running).outputs[0].data.tolist() == [[7]]  # in flight during the reload: answered
        assert dp.model_config("slow_py").parameters["delay_s"].string_value == "0.0"  # reloaded
        assert (await dp.infer(InferRequest("slow_py", [fp32("INPUT0", [[8]])]))).outputs[0].data.tolist() == [[8]]
        assert (await dp.infer(versioned())).model_version == "1"
        assert dp.model_ready("add_sub_py2") and not dp.model_ready("string_py")
        assert dp.model_ready("add_sub_onnx")  # unchanged models stay as they were
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="azulite.serve.poll"):
            await dp.poll()  # string_py's entry goes now, its leaving said once already
        assert [r.getMessage() for r in caplog.records if r.name == "azulite.serve.poll"] == []
        assert "string_py" not in {m.name for m in dp.repository_index().models}
        await dp.shutdown()

    asyncio.run(main())


def test_poll_mode_broken_edit_keeps_the_loaded_model_serving(repository_copy, caplog):
    """As Triton: a reload that fails leaves the loaded model as it was; a new model that fails is
    UNAVAILABLE with its reason; the others never notice."""
    dp = plane(repository_copy, control_mode="poll", strict_readiness=False)

    async def main():
        config = repository_copy / "add_sub_py" / "config.pbtxt"
        config.write_text("this is not protobuf text")
        bump_mtime(config)
        shutil.copytree(repository_copy / "add_sub_py", repository_copy / "new_broken")
        with caplog.at_level(logging.WARNING, logger="azulite.serve"):
            await dp.poll()
        assert "reloading model 'add_sub_py' failed; the loaded version(s) 1 serve on" in caplog.text
        assert dp.model_ready("add_sub_py") and dp.model_ready("add_sub_onnx")
        x = fp32("INPUT0", [[1.0] * 16]), fp32("INPUT1", [[2.0] * 16])
        assert (await dp.infer(InferRequest("add_sub_py", list(x)))).outputs[0].data.tolist() == [[3.0] * 16]
        assert not dp.model_ready("new_broken")
        reason = {m.name: m for m in dp.repository_index().models}["new_broken"].reason
        # names the file and, from protobuf's text format, the line and column
        assert reason.startswith(f"{repository_copy / 'new_broken' / 'config.pbtxt'}: failed to parse the model "
                                 "configuration of 'new_broken': line 1 column 1: "), reason
        with pytest.raises(Unsupported):
            plane(repository_copy).start_polling(1)
        await dp.shutdown()

    asyncio.run(main())


def test_a_model_refused_at_start_then_removed_is_forgotten(repository_copy):
    """Poll mode: a model that failed to load stayed in the index as UNAVAILABLE after its folder was removed,
    and strict readiness kept answering not ready."""
    shutil.copytree(repository_copy / "add_sub_py", repository_copy / "broken")
    (repository_copy / "broken" / "config.pbtxt").write_text("this is not protobuf text")
    dp = plane(repository_copy, control_mode="poll")  # strict readiness (the default)

    async def main():
        assert not dp.ready() and "broken" in {m.name for m in dp.repository_index().models}
        shutil.rmtree(repository_copy / "broken")
        await dp.poll()
        assert dp.ready() and "broken" not in {m.name for m in dp.repository_index().models}
        assert dp.model_ready("add_sub_py")
        await dp.shutdown()

    asyncio.run(main())


def test_version_policy_latest_n_serves_only_those(tmp_path, model_repository):
    shutil.copytree(model_repository / "versioned_py", tmp_path / "versioned_py")
    shutil.copytree(tmp_path / "versioned_py" / "2", tmp_path / "versioned_py" / "3")
    config = tmp_path / "versioned_py" / "config.pbtxt"
    config.write_text(config.read_text().replace("version_policy: { all { } }", "version_policy: { latest { num_versions: 2 } }"))
    dp = plane(tmp_path)
    assert list(dp.model_metadata("versioned_py").versions) == ["2", "3"]
    assert not dp.model_ready("versioned_py", "1") and dp.model_ready("versioned_py", "3")

    async def main():
        assert (await dp.infer(versioned())).model_version == "3"
        assert (await dp.infer(versioned("2"))).outputs[0].data.tolist() == [2, 2, 2, 2]
        with pytest.raises(NotFound, match="version 1 is not found"):
            await dp.infer(versioned("1"))
        await dp.shutdown()

    asyncio.run(main())


WARM = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.seen = []

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            self.seen.append(x.shape)
            if (x < 0).any():
                return [pb_utils.InferenceResponse(error=pb_utils.TritonError("negative warmup")) for _ in requests]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("n", np.array([[len(self.seen)]] * x.shape[0], np.int64))]))
        return out
"""


def test_model_warmup_runs_before_ready_and_failing_warmup_fails_the_load(tmp_path):
    for name, data in (("warm", "zero_data: true"), ("cold", "zero_data: true")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text("import numpy as np\n" + WARM)
        (tmp_path / name / "config.pbtxt").write_text(
            f'backend: "python" max_batch_size: 4\n'
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ] output [ { name: "n" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
            f'model_warmup [ {{ name: "w" batch_size: 2 count: 3 inputs {{ key: "x" value: {{ data_type: TYPE_FP32 dims: [ 2 ] {data} }} }} }} ]')
    (tmp_path / "cold" / "warmup").mkdir()
    (tmp_path / "cold" / "warmup" / "neg").write_bytes(np.array([-1.0, -2.0], np.float32).tobytes())
    cfg = tmp_path / "cold" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("zero_data: true", 'input_data_file: "neg"'))
    dp = plane(tmp_path, strict_readiness=False)
    index = {m.name: m for m in dp.repository_index().models}
    assert "warmup 'w' failed: negative warmup" in index["cold"].reason

    async def main():
        r = await dp.infer(InferRequest("warm", [fp32("x", [[1, 2]])]))
        assert r.outputs[0].data.tolist() == [[4]]  # three warmup executions came first
        await dp.shutdown()

    asyncio.run(main())


def test_warmup_inputs_and_instance_settings_are_checked_at_load(tmp_path):
    """A warmup sample for an input the model lacks, or none for one it has, failed inside the model
    ('NoneType' object has no attribute 'as_numpy'); a wrong azulite_instance_nice loaded while the
    instances were threads, and failed the same repository under --workers N."""
    config = ('backend: "python" max_batch_size: 4\n'
              'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ] output [ { name: "n" data_type: TYPE_INT64 dims: [ 1 ] } ]\n')
    sample = 'model_warmup [ {{ name: "w" batch_size: 1 inputs {{ key: "{key}" value: {{ data_type: TYPE_FP32 dims: [ 2 ] zero_data: true }} }} }} ]'
    for name, text in (("nope", config + sample.format(key="NOPE")), ("fine", config + sample.format(key="x")),
                       ("nice", config + 'parameters { key: "azulite_instance_nice" value: { string_value: "50" } }')):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text("import numpy as np\n" + WARM)
        (tmp_path / name / "config.pbtxt").write_text(text)
    dp = plane(tmp_path, strict_readiness=False)
    index = {m.name: m for m in dp.repository_index().models}
    assert "warmup 'w': 'NOPE' is not an input of the model (its inputs: x)" in index["nope"].reason
    assert index["fine"].state == "READY"
    assert "parameter 'azulite_instance_nice' must be an integer from -20 to 19" in index["nice"].reason
    asyncio.run(dp.shutdown())


def test_load_failures_name_the_config_file_or_the_missing_version_folder(tmp_path):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "config.pbtxt").write_text('name: "flat" backend: "python"')
    (tmp_path / "flat" / "model.py").write_text("")  # beside config.pbtxt instead of in 1/
    (tmp_path / "bad" / "1").mkdir(parents=True)
    (tmp_path / "bad" / "1" / "model.py").write_text("class TritonPythonModel:\n    def execute(self, requests):\n"
                                                     "        return []\n")
    (tmp_path / "bad" / "config.pbtxt").write_text(
        'name: "bad" backend: "python" max_batch_size: 8 dynamic_batching { preferred_batch_size: [ 16 ] }\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ] output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]')
    dp = plane(tmp_path, strict_readiness=False)
    index = {m.name: m.reason for m in dp.repository_index().models}
    assert index["flat"] == (f"failed to load 'flat': no version folder such as 1/ under {tmp_path / 'flat'} (each "
                             "version of a model is a numbered folder holding the model file)"), index
    assert index["bad"] == (f"{tmp_path / 'bad' / 'config.pbtxt'}: model 'bad': dynamic batching preferred size 16 "
                            "must be positive and <= max_batch_size 8"), index
