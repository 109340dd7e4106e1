"""The data plane end to end (no transport): every backend's answers, request validation with Triton's
wording, classification, statistics and metrics, metadata, repository index, broken models, shutdown."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from azulite.errors import InvalidArgument, ModelLoadError, NotFound, Unavailable
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
from azulite.serve.types import InferRequest, InferTensor, RequestedOutput

from .conftest import bench_weights


def plane(repo, **kw) -> TritonDataPlane:
    return TritonDataPlane(DataPlaneSettings(repository=repo, **kw))


def fp32(name, array) -> InferTensor:
    array = np.asarray(array, dtype=np.float32)
    return InferTensor(name, "FP32", array.shape, array)


def add_sub_request(model: str, x, y, names=("INPUT0", "INPUT1"), **kw) -> InferRequest:
    return InferRequest(model, [fp32(names[0], x), fp32(names[1], y)], **kw)


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize(
    ("model", "ins", "outs"),
    [
        ("add_sub_onnx", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")),
        ("add_sub_pt", ("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1")),
        ("add_sub_py", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")),
        ("add_sub_ensemble", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")),
    ],
)
def test_every_backend_computes_add_sub_batched_equal_unbatched(model_repository, rng, model, ins, outs):
    dp = plane(model_repository, control_mode="explicit", load_models=(model,))

    async def main():
        xs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (1, 3, 2, 1, 4, 1, 2, 2)]
        ys = [rng.standard_normal((n, 16)).astype(np.float32) for n in (1, 3, 2, 1, 4, 1, 2, 2)]
        together = await asyncio.gather(*(dp.infer(add_sub_request(model, x, y, ins)) for x, y in zip(xs, ys)))
        alone = [await dp.infer(add_sub_request(model, x, y, ins)) for x, y in zip(xs, ys)]
        for x, y, a, b in zip(xs, ys, together, alone):
            got = {t.name: t.data for t in a.outputs}
            if model == "add_sub_ensemble":
                np.testing.assert_allclose(got[outs[0]], 2 * x, atol=1e-5)
                np.testing.assert_allclose(got[outs[1]], 2 * y, atol=1e-5)
            else:
                np.testing.assert_array_equal(got[outs[0]], x + y)
                np.testing.assert_array_equal(got[outs[1]], x - y)
            for ta, tb in zip(a.outputs, b.outputs):
                assert ta.name == tb.name and ta.datatype == "FP32" and ta.shape == x.shape
                np.testing.assert_array_equal(ta.data, tb.data)
        stats = dp.model_statistics(model).model_stats[0]
        assert stats.inference_stats.success.count == 16
        await dp.shutdown()

    asyncio.run(main())


def test_bytes_model_versions_and_bench_model(model_repository):
    dp = plane(model_repository, control_mode="explicit", load_models=("string_py", "versioned_py", "bench_matmul"))

    async def main():
        text = np.array([[b"hello", b"Triton"], [b"", b"x\xc3\xa9"]], dtype=np.object_)
        r = await dp.infer(InferRequest("string_py", [InferTensor("TEXT", "BYTES", text.shape, text)]))
        out = {t.name: t for t in r.outputs}
        assert out["UPPER"].datatype == "BYTES" and out["UPPER"].data.tolist() == [[b"HELLO", b"TRITON"], [b"", b"X\xc3\xa9"]]
        assert out["LENGTH"].datatype == "INT64" and out["LENGTH"].data.tolist() == [[5, 6], [0, 3]]
        for version, add in (("", 2), ("1", 1), ("2", 2)):
            r = await dp.infer(InferRequest("versioned_py", [fp32("INPUT0", [1, 2, 3, 4])], model_version=version))
            assert r.model_version == str(add) and r.outputs[0].data.tolist() == [1 + add, 2 + add, 3 + add, 4 + add]
        with pytest.raises(NotFound, match="Request for unknown model: 'versioned_py' version 3 is not found"):
            await dp.infer(InferRequest("versioned_py", [fp32("INPUT0", [1, 2, 3, 4])], model_version="3"))
        x = np.linspace(-1, 1, 256, dtype=np.float32)[None]
        r = await dp.infer(InferRequest("bench_matmul", [fp32("x", x)]))
        np.testing.assert_allclose(r.outputs[0].data, x @ bench_weights(), rtol=1e-5)
        meta = dp.model_metadata("versioned_py")
        assert list(meta.versions) == ["1", "2"] and meta.inputs[0].shape == [4]
        meta = dp.model_metadata("bench_matmul")
        assert (meta.platform, meta.inputs[0].name, list(meta.inputs[0].shape)) == ("python", "x", [-1, 256])
        await dp.shutdown()

    asyncio.run(main())


def test_bad_requests_name_what_is_wrong(model_repository):
    dp = plane(model_repository, control_mode="explicit", load_models=("add_sub_onnx",))
    ok = np.ones((1, 16), np.float32)

    async def expect(request, error, message):
        with pytest.raises(error, match=message):
            await dp.infer(request)

    async def main():
        await expect(add_sub_request("nope", ok, ok), NotFound, "Request for unknown model: 'nope' is not found")
        await expect(add_sub_request("add_sub_onnx", ok, ok, ("INPUT0", "WRONG")), InvalidArgument,
                     "unexpected inference input 'WRONG' for model 'add_sub_onnx'")
        await expect(InferRequest("add_sub_onnx", [fp32("INPUT0", ok)]), InvalidArgument,
                     r"missing required input\(s\) \['INPUT1'\]")
        ints = np.ones((1, 16), np.int32)
        await expect(InferRequest("add_sub_onnx", [fp32("INPUT0", ok), InferTensor("INPUT1", "INT32", (1, 16), ints)]),
                     InvalidArgument, "inference input 'INPUT1' data-type is 'INT32', but model 'add_sub_onnx' expects 'FP32'")
        bad = np.ones((1, 15), np.float32)
        await expect(add_sub_request("add_sub_onnx", bad, bad), InvalidArgument,
                     r"unexpected shape for input 'INPUT0' for model 'add_sub_onnx'. Expected \[-1,16\], got \[1,15\]")
        big = np.ones((9, 16), np.float32)
        await expect(add_sub_request("add_sub_onnx", big, big), InvalidArgument,
                     "inference request batch-size must be <= 8 for 'add_sub_onnx'")
        await expect(add_sub_request("add_sub_onnx", ok, np.ones((2, 16))), InvalidArgument, "batch size 2")
        empty = np.ones((0, 16), np.float32)
        await expect(add_sub_request("add_sub_onnx", empty, empty), InvalidArgument, "batch-size must be >= 1")
        await expect(add_sub_request("add_sub_onnx", ok, ok, outputs=[RequestedOutput("NOPE")]), InvalidArgument,
                     "unexpected inference output 'NOPE' for model 'add_sub_onnx'")
        await expect(add_sub_request("add_sub_onnx", ok, ok, parameters={"priority": "high"}), InvalidArgument,
                     "parameter 'priority' must be an integer")
        # still serving, and the failures were counted as OTHER (not the model's fault)
        r = await dp.infer(add_sub_request("add_sub_onnx", ok, ok, outputs=[RequestedOutput("OUTPUT1")]))
        assert [t.name for t in r.outputs] == ["OUTPUT1"]
        stats = dp.model_statistics("add_sub_onnx").model_stats[0].inference_stats
        assert stats.fail.count == 9 and stats.success.count == 1
        text = dp.metrics.metrics_text().decode()
        assert 'nv_inference_request_failure{model="add_sub_onnx",version="1",reason="OTHER"} 9' in text
        await dp.shutdown()

    asyncio.run(main())


def test_a_shape_with_the_batch_dimension_missing_or_extra_says_so_in_its_fix(model_repository):
    """Triton appends a NOTE on max_batch_size to its shape error; azulite names the fix for the case at hand."""
    dp = plane(model_repository, control_mode="explicit", load_models=("add_sub_onnx", "versioned_py"))

    async def error(request) -> InvalidArgument:
        with pytest.raises(InvalidArgument) as e:
            await dp.infer(request)
        return e.value

    async def main():
        v = np.ones(16, np.float32)
        e = await error(add_sub_request("add_sub_onnx", v, v))
        assert "Expected [-1,16], got [16]" in e.message
        assert e.fix == "the model batches (max_batch_size 8): put the batch size first, e.g. [1,16] for one row"
        e = await error(InferRequest("versioned_py", [fp32("INPUT0", np.ones((1, 4)))]))
        assert "Expected [4], got [1,4]" in e.message
        assert e.fix == "the model does not batch (max_batch_size 0): send the shape [4]"
        e = await error(add_sub_request("add_sub_onnx", np.ones((1, 15)), np.ones((1, 15))))
        assert e.fix is None  # a wrong size, not a batch dimension: the message says it all
        await dp.shutdown()

    asyncio.run(main())


def test_classification_extension(tmp_path, model_repository):
    import shutil

    shutil.copytree(model_repository / "add_sub_onnx", tmp_path / "add_sub_onnx")
    config = tmp_path / "add_sub_onnx" / "config.pbtxt"
    config.write_text(config.read_text().replace(
        'name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ]', 'name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] label_filename: "labels.txt"'))
    (tmp_path / "add_sub_onnx" / "labels.txt").write_text("\n".join(f"label{i}" for i in range(16)))
    dp = plane(tmp_path)

    async def main():
        x = np.arange(16, dtype=np.float32)[None]
        r = await dp.infer(add_sub_request("add_sub_onnx", x, np.zeros_like(x), outputs=[
            RequestedOutput("OUTPUT0", {"classification": 2}), RequestedOutput("OUTPUT1", {"classification": 1})]))
        out = {t.name: t for t in r.outputs}
        assert out["OUTPUT0"].datatype == "BYTES" and out["OUTPUT0"].shape == (1, 2)
        assert out["OUTPUT0"].data.tolist() == [[b"15.000000:15:label15", b"14.000000:14:label14"]]
        assert out["OUTPUT1"].data.tolist() == [[b"15.000000:15"]]
        await dp.shutdown()

    asyncio.run(main())


def test_statistics_metrics_and_metadata(model_repository):
    dp = plane(model_repository, control_mode="explicit", load_models=("add_sub_py",))

    async def main():
        ok = np.ones((2, 16), np.float32)
        await asyncio.gather(*(dp.infer(add_sub_request("add_sub_py", ok, ok)) for _ in range(10)))
        stats = dp.model_statistics("add_sub_py", "1").model_stats[0]
        s = stats.inference_stats
        assert (stats.name, stats.version, stats.inference_count) == ("add_sub_py", "1", 20)
        assert s.success.count == s.queue.count == s.compute_infer.count == 10 and s.success.ns > 0
        assert stats.execution_count == sum(b.compute_infer.count for b in stats.batch_stats) >= 3
        assert sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats) == 20
        assert stats.last_inference > 0
        assert [m.name for m in dp.model_statistics().model_stats] == ["add_sub_py"]
        with pytest.raises(InvalidArgument, match="'string_py' is not available"):  # Triton: 400
            dp.model_statistics("string_py")
        text = dp.metrics.metrics_text().decode()
        for line in ('nv_inference_request_success{model="add_sub_py",version="1"} 10',
                     'nv_inference_count{model="add_sub_py",version="1"} 20',
                     'nv_inference_pending_request_count{model="add_sub_py",version="1"} 0',
                     "# TYPE nv_inference_request_success counter", "nv_inference_queue_duration_us{",
                     "nv_inference_compute_input_duration_us{", "nv_inference_compute_infer_duration_us{",
                     "nv_inference_compute_output_duration_us{", "nv_inference_request_duration_us{",
                     "nv_inference_exec_count{", "nv_cpu_utilization ", "nv_cpu_memory_total_bytes ",
                     "nv_cpu_memory_used_bytes "):
            assert line in text, line
        meta = dp.server_metadata()
        assert "classification" in meta.extensions and "statistics" in meta.extensions
        assert "system_shared_memory" in meta.extensions and "cuda_shared_memory" not in meta.extensions
        assert "sequence" in meta.extensions  # as Triton 2.51 lists it (sequence batching: serve/sequence.py)
        config = dp.model_config("add_sub_py")
        assert config.max_batch_size == 8 and config.instance_group[0].count == 2
        await dp.shutdown()

    asyncio.run(main())


def test_broken_models_do_not_stop_the_others(broken_model_repository):
    dp = plane(broken_model_repository)
    assert not dp.ready()  # strict readiness, as Triton
    assert plane(broken_model_repository, strict_readiness=False).ready()
    index = {m.name: m for m in dp.repository_index().models}
    assert index["broken_onnx"].state == "UNAVAILABLE" and "onnxruntime could not load" in index["broken_onnx"].reason
    assert index["broken_config"].state == "UNAVAILABLE" and "max_batch_size" in index["broken_config"].reason
    assert index["add_sub_onnx"].state == "READY"
    assert {m.name for m in dp.repository_index(ready_only=True).models} >= {"add_sub_onnx", "add_sub_py"}
    assert "broken_onnx" not in {m.name for m in dp.repository_index(ready_only=True).models}
    assert not dp.model_ready("broken_onnx") and dp.model_ready("add_sub_onnx") and dp.model_ready("versioned_py", "1")

    async def main():
        with pytest.raises(Unavailable, match="'broken_onnx' has no available versions"):
            await dp.infer(InferRequest("broken_onnx", [fp32("x", [1.0])]))
        ok = np.ones((1, 16), np.float32)
        r = await dp.infer(add_sub_request("add_sub_onnx", ok, ok))
        assert r.outputs[0].data.sum() == 32
        await dp.shutdown()

    asyncio.run(main())


def test_the_load_api_answers_a_failed_load_with_its_fix(broken_model_repository):
    """A model that fails to load through the load API (explicit mode): the client's error carries the fix
    the load failure named (here the config's syntax error: its file and line), as the server's log does."""
    dp = plane(broken_model_repository, control_mode="explicit", load_models=("add_sub_onnx",))

    async def main():
        with pytest.raises(ModelLoadError) as err:
            await dp.load_model("broken_config")
        assert err.value.fix and "config.pbtxt" in err.value.fix, err.value
        assert "fix:" in str(err.value)  # what the HTTP and gRPC answers carry
        await dp.load_model("add_sub_onnx")  # a load that succeeds leaves no fix behind
        assert dp.manager.entries["add_sub_onnx"].load_fix == ""
        await dp.shutdown()

    asyncio.run(main())


def test_model_errors_are_per_request(tmp_path, caplog):
    (tmp_path / "picky" / "1").mkdir(parents=True)
    (tmp_path / "picky" / "config.pbtxt").write_text(
        'backend: "python" max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 100000 }\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ] output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]')
    (tmp_path / "picky" / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        out = []\n"
        "        for r in requests:\n"
        "            x = pb_utils.get_input_tensor_by_name(r, 'x').as_numpy()\n"
        "            if x[0, 0] < 0:\n"
        "                if x[0, 0] < -10:\n"
        "                    raise ValueError('far too negative')\n"
        "                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError('negative input', pb_utils.TritonError.INVALID_ARG)))\n"
        "            else:\n"
        "                out.append(pb_utils.InferenceResponse([pb_utils.Tensor('y', x * 10)]))\n"
        "        return out\n")
    dp = plane(tmp_path)

    async def main():
        results = await asyncio.gather(*(dp.infer(InferRequest("picky", [fp32("x", [[v]])])) for v in (1, -1, 2)),
                                       return_exceptions=True)
        assert results[0].outputs[0].data.tolist() == [[10]] and results[2].outputs[0].data.tolist() == [[20]]
        assert isinstance(results[1], InvalidArgument) and "negative input" in str(results[1])
        from azulite.errors import Internal

        with pytest.raises(Internal, match="Failed to process the request.*ValueError: far too negative") as info:
            await dp.infer(InferRequest("picky", [fp32("x", [[-20]])]))
        # the model's own frame, as Triton's "At:" (no frame of azulite's), and the same message in the log
        model_py = str(tmp_path / "picky" / "1" / "model.py")
        assert f"\n\nAt:\n  {model_py}(9): execute\n" in info.value.message and "azulite/serve" not in info.value.message
        assert [r.getMessage() for r in caplog.records if r.name == "azulite.serve.python"] == [info.value.message]
        stats = dp.model_statistics("picky").model_stats[0].inference_stats
        assert stats.fail.count == 2 and stats.success.count == 2
        assert 'reason="BACKEND"} 2' in dp.metrics.metrics_text().decode()
        await dp.shutdown()

    asyncio.run(main())


def test_shutdown_drains_in_flight_and_refuses_new(model_repository):
    dp = plane(model_repository, control_mode="explicit", load_models=("slow_py",))

    async def main():
        inflight = [asyncio.ensure_future(dp.infer(InferRequest("slow_py", [fp32("INPUT0", [[v]])]))) for v in range(3)]
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(dp.shutdown(drain_timeout_s=60))
        await asyncio.sleep(0.01)
        assert not dp.ready()
        with pytest.raises(Unavailable, match="shutting down"):
            await dp.infer(InferRequest("slow_py", [fp32("INPUT0", [[9.0]])]))
        results = await asyncio.gather(*inflight)
        assert [r.outputs[0].data[0, 0] for r in results] == [0, 1, 2]
        await closing
        assert not dp.live()

    asyncio.run(main())


_THREADS_PROBE = """
import json, sys
import threadpoolctl, torch
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
dp = TritonDataPlane(DataPlaneSettings(repository=sys.argv[1], compute_threads=int(sys.argv[2])))
options = {name: dp.manager.get(name).batcher._instances[0].model.session.get_session_options()
           for name in ("add_sub_onnx", "onnx_with_params")}
print(json.dumps({"blas": [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"],
                  "torch": torch.get_num_threads(),
                  "onnx": {n: [o.intra_op_num_threads, o.inter_op_num_threads] for n, o in options.items()}}))
"""


def test_compute_threads_reach_blas_torch_and_onnxruntime(tmp_path, model_repository):
    """compute_threads=3 (neither the default 1 nor the libraries' own, this machine's core count) caps
    numpy's BLAS, torch and ONNX Runtime sessions, unless a model's config sets Triton's ONNX Runtime
    parameters intra_op_thread_count / inter_op_thread_count. In a fresh process: the caps are
    process-wide, so this process's earlier tests would show through."""
    import json
    import shutil
    import subprocess
    import sys

    for name in ("bench_matmul", "add_sub_pt", "add_sub_onnx"):
        shutil.copytree(model_repository / name, tmp_path / name)
    shutil.copytree(model_repository / "add_sub_onnx", tmp_path / "onnx_with_params")
    config = tmp_path / "onnx_with_params" / "config.pbtxt"
    config.write_text(config.read_text().replace('"add_sub_onnx"', '"onnx_with_params"')
                      + 'parameters { key: "intra_op_thread_count" value: { string_value: "2" } }\n'
                      'parameters { key: "inter_op_thread_count" value: { string_value: "5" } }\n')
    p = subprocess.run([sys.executable, "-c", _THREADS_PROBE, str(tmp_path), "3"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["blas"] and set(got["blas"]) == {3}, got
    assert got["torch"] == 3, got
    assert got["onnx"]["add_sub_onnx"][0] == 3 and got["onnx"]["onnx_with_params"] == [2, 5], got


def test_queue_full_counts_as_rejected(tmp_path, model_repository):
    import shutil

    shutil.copytree(model_repository / "slow_py", tmp_path / "slow_py")
    config = tmp_path / "slow_py" / "config.pbtxt"
    config.write_text(config.read_text() + "dynamic_batching { default_queue_policy { max_queue_size: 1 } }\n")
    dp = plane(tmp_path)

    async def main():
        results = await asyncio.gather(*(dp.infer(InferRequest("slow_py", [fp32("INPUT0", [[v]])])) for v in range(4)),
                                       return_exceptions=True)
        rejected = [r for r in results if isinstance(r, Unavailable)]
        assert len(rejected) >= 2 and all("Exceeds maximum queue size" in str(r) for r in rejected)
        ok = [r for r in results if not isinstance(r, Exception)]
        assert len(ok) + len(rejected) == 4
        text = dp.metrics.metrics_text().decode()
        assert f'nv_inference_request_failure{{model="slow_py",version="1",reason="REJECTED"}} {len(rejected)}' in text
        await dp.shutdown()

    asyncio.run(main())


def test_reshape_inputs_and_outputs(tmp_path, model_repository):
    import shutil

    shutil.copytree(model_repository / "add_sub_onnx", tmp_path / "add_sub_onnx")
    config = tmp_path / "add_sub_onnx" / "config.pbtxt"
    config.write_text(config.read_text().replace("dims: [ 16 ]", "dims: [ 4, 4 ] reshape: { shape: [ 16 ] }"))
    dp = plane(tmp_path)
    assert list(dp.model_metadata("add_sub_onnx").inputs[0].shape) == [-1, 4, 4]

    async def main():
        x = np.arange(32, dtype=np.float32).reshape(2, 4, 4)
        r = await dp.infer(add_sub_request("add_sub_onnx", x, x))
        assert r.outputs[0].shape == (2, 4, 4)
        np.testing.assert_array_equal(r.outputs[0].data, 2 * x)
        await dp.shutdown()

    asyncio.run(main())
