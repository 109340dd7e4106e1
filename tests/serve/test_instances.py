"""Python model instances in their own processes (the model host of ``azulite serve --workers N``):
answers equal to in-process ones (numbers and BYTES through shared memory), and an instance process
that dies is started again and counted."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import numpy as np
import pytest

from google.protobuf import text_format

from azulite.errors import Internal, ModelLoadError, Unavailable
from azulite.serve import instances
from azulite.serve.backends.base import LoadContext, WorkItem
from azulite.serve.proto import model_config_pb2 as mc
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
from azulite.serve.server import new_event_loop
from azulite.serve.types import InferRequest, InferTensor
from tests.serve.conftest import build_model_repository
from tests.serve.procs import children, cmdline


def _instance_pids() -> list[int]:
    """This process's instance processes (whichever of its threads started them)."""
    return [p for p in children(os.getpid()) if b"azulite.serve.instances" in cmdline(p)]


def _until_ended(pid: int) -> None:
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped by its server already
        pass


def test_instances_in_their_own_processes(tmp_path):
    root = build_model_repository(tmp_path, ("add_sub_py", "string_py"))
    before = set(_instance_pids())
    dp = TritonDataPlane(DataPlaneSettings(repository=root, instance_processes=True))

    async def run() -> None:
        try:
            await check()
        finally:
            await dp.shutdown(30)

    async def check() -> None:
        pids = [p for p in _instance_pids() if p not in before]
        assert len(pids) == 3  # add_sub_py has 2 instances, string_py 1
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        request = InferRequest("add_sub_py", [InferTensor("INPUT0", "FP32", (2, 16), x),
                                              InferTensor("INPUT1", "FP32", (2, 16), x)])
        out = {t.name: t.data for t in (await dp.infer(request)).outputs}
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * x)
        np.testing.assert_array_equal(out["OUTPUT1"], 0 * x)
        text = np.array([[b"ab", b"\xc3\xa9z"]], dtype=np.object_)
        strings = InferRequest("string_py", [InferTensor("TEXT", "BYTES", (1, 2), text)])
        out = {t.name: t.data for t in (await dp.infer(strings)).outputs}
        assert out["UPPER"].tolist() == [[b"AB", b"\xc3\xa9Z"]] and out["LENGTH"].tolist() == [[2, 3]]

        victim = next(p for p in pids if b"\0string_py\0" in cmdline(p))
        os.kill(victim, signal.SIGKILL)
        # until it can be reaped (every thread gone), without reaping it (the server's loop, watching its
        # socket, may have seen it end and reaped it already)
        await asyncio.to_thread(_until_ended, victim)
        out = {t.name: t.data for t in (await dp.infer(strings)).outputs}
        assert out["LENGTH"].tolist() == [[2, 3]]
        assert sum(n for (model, _), n in instances.restarts.items() if model == "string_py") == 1

    asyncio.run(run())
    assert not [p for p in _instance_pids() if p not in before]  # every instance process finalized



# answers its process id; exits (code 3) in the middle of a batch that holds a negative input
PID_PY = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        if any((r.inputs()[0].as_numpy() < 0).any() for r in requests):
            os._exit(3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.full((len(r.inputs()[0].as_numpy()), 1),
                                                                            os.getpid(), np.int64))])
                for r in requests]
'''
PID_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }} ]
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
{parameters}
'''


def _pid_model(root, name: str, choice: str | None) -> None:
    (root / name / "1").mkdir(parents=True)
    param = "" if choice is None else f'parameters {{ key: "azulite_instance_process" value: {{ string_value: "{choice}" }} }}'
    (root / name / "config.pbtxt").write_text(PID_CONFIG.format(name=name, parameters=param))
    (root / name / "1" / "model.py").write_text(PID_PY)


def _pid_of(dp, model: str, x: float) -> int:
    async def one() -> int:
        response = await dp.infer(InferRequest(model, [InferTensor("X", "FP32", (1, 1), np.array([[x]], np.float32))]))
        return int(response.outputs[0].data[0, 0])
    return one()


def _on_server_loop(coro) -> None:
    """On the loop ``azulite serve`` runs (uvloop: its poller makes a watched descriptor non-blocking)."""
    loop = new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()


def test_single_process_server_runs_instances_in_processes_by_config(tmp_path):
    """``--workers 1``: a model whose config asks for instance processes gets one per instance, its
    neighbours stay threads (the default "auto" too); a wrong value or an impossible ask fails that
    model's load, naming the parameter, and the rest serve."""
    _pid_model(tmp_path, "in_processes", "true")
    _pid_model(tmp_path, "in_threads", "false")
    _pid_model(tmp_path, "by_default", None)
    _pid_model(tmp_path, "misspelt", "processes")
    build_model_repository(tmp_path, ("repeat_py",))  # decoupled: cannot leave the server's loop
    (tmp_path / "repeat_py" / "config.pbtxt").write_text((tmp_path / "repeat_py" / "config.pbtxt").read_text()
                                                         + '\nparameters { key: "azulite_instance_process" '
                                                           'value: { string_value: "true" } }\n')
    before = set(_instance_pids())
    dp = TritonDataPlane(DataPlaneSettings(repository=tmp_path))

    async def run() -> None:
        try:
            pids = [p for p in _instance_pids() if p not in before]
            assert sorted(cmdline(p).split(b"\0")[4] for p in pids) == [b"in_processes", b"in_processes"]
            # two requests at once: both instances busy, each answering from its own process
            answered = set(await asyncio.gather(_pid_of(dp, "in_processes", 1.0), _pid_of(dp, "in_processes", 2.0)))
            assert answered <= set(pids) and len(answered) >= 1
            for model in ("in_threads", "by_default"):
                assert await _pid_of(dp, model, 1.0) == os.getpid()
            index = {m.name: m for m in dp.repository_index().models}
            assert index["misspelt"].state == "UNAVAILABLE"
            assert "azulite_instance_process" in index["misspelt"].reason and "'processes'" in index["misspelt"].reason
            assert index["repeat_py"].state == "UNAVAILABLE" and "decoupled" in index["repeat_py"].reason
        finally:
            await dp.shutdown(30)

    _on_server_loop(run())
    assert not [p for p in _instance_pids() if p not in before]


def test_instance_process_dying_mid_batch_fails_that_batch_and_is_restarted(tmp_path):
    _pid_model(tmp_path, "dies_py", "true")
    before = set(_instance_pids())
    restarted = sum(n for (model, _), n in instances.restarts.items() if model == "dies_py")
    dp = TritonDataPlane(DataPlaneSettings(repository=tmp_path))

    async def run() -> None:
        try:
            pids = {p for p in _instance_pids() if p not in before}
            with pytest.raises(Internal, match=r"instance process \w+ died \(exit code 3\) while executing"):
                await _pid_of(dp, "dies_py", -1.0)
            # the one that died is started again, with the model loaded; the other never stopped
            for x in (1.0, 2.0, 3.0):
                assert await _pid_of(dp, "dies_py", x) in {p for p in _instance_pids() if p not in before}
            now = {p for p in _instance_pids() if p not in before}
            assert len(now) == 2 and len(now & pids) == 1
            assert sum(n for (model, _), n in instances.restarts.items() if model == "dies_py") == restarted + 1
            text = dp.metrics.metrics_text().decode()
            assert re.search(r'^azulite_instance_restarts_total\{.*model="dies_py".*\} 1(\.0)?$', text, re.M), text
        finally:
            await dp.shutdown(30)

    _on_server_loop(run())


def test_an_instance_process_is_not_restarted_on_code_changed_since_the_model_loaded(tmp_path):
    """A restarted process imports the files as they are now: changed after load (found changed under
    --verify, whose manifest is checked at load), the instance is not started again and says why; a model
    loaded again serves the new code."""
    _pid_model(tmp_path, "dies_py", "true")
    dp = TritonDataPlane(DataPlaneSettings(repository=tmp_path, control_mode="explicit", load_models=("dies_py",)))
    model_py = tmp_path / "dies_py" / "1" / "model.py"

    async def run() -> None:
        try:
            with pytest.raises(Internal, match="died"):
                await _pid_of(dp, "dies_py", -1.0)  # one instance process exits
            model_py.write_text(model_py.read_text() + "\n# changed after load\n")
            failures = []
            for x in (1.0, 2.0, 3.0, 4.0):  # the other instance answers; the dead one's batches fail
                try:
                    await _pid_of(dp, "dies_py", x)
                except Unavailable as exc:
                    failures.append(exc)
            assert failures and "code (1/*.py) changed since the model loaded" in failures[0].message
            assert "load model 'dies_py' again" in failures[0].fix
            await dp.load_model("dies_py")
            for x in (1.0, 2.0, 3.0, 4.0):  # both instances on the loaded (new) code
                await _pid_of(dp, "dies_py", x)
        finally:
            await dp.shutdown(30)

    _on_server_loop(run())


def test_code_digest_covers_every_python_file_of_the_version():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "model.py").write_text("a = 1\n")
        (root / "pkg").mkdir()
        (root / "pkg" / "helper.py").write_text("b = 1\n")
        (root / "weights.bin").write_bytes(b"\0" * 10)
        first = instances.code_digest(root / "model.py")
        (root / "weights.bin").write_bytes(b"\1" * 10)  # not code
        assert instances.code_digest(root / "model.py") == first
        (root / "pkg" / "helper.py").write_text("b = 2\n")
        assert instances.code_digest(root / "model.py") != first


def test_batches_cross_from_the_loop_and_from_threads_alike(tmp_path):
    """start_batch crosses on the server's own loop, no thread (uvloop: its poller makes the socket
    non-blocking); execute from a thread after it still waits for its answer (the blocking crossing once
    failed after a loop-side one); a process dying in a loop-side batch fails that batch, and the next
    batch runs on a process started in its place."""
    _pid_model(tmp_path, "cross_py", "true")
    model_dir = tmp_path / "cross_py"
    # slow to answer x > 100: a thread's crossing then surely waits in recv for the answer
    (model_dir / "1" / "model.py").write_text(PID_PY.replace("import os\n", "import os\nimport time\n").replace(
        "        if any((r.inputs()[0].as_numpy() < 0)",
        "        if any((r.inputs()[0].as_numpy() > 100).any() for r in requests):\n            time.sleep(0.2)\n"
        "        if any((r.inputs()[0].as_numpy() < 0)"))
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    ctx = LoadContext("cross_py", 1, model_dir, model_dir / "1" / "model.py", config, "cross_py_0", 0)
    inst = instances.ProcessInstance("python", ctx)

    def item(x: float) -> WorkItem:
        return WorkItem({"X": np.array([[x]], np.float32)}, None, 1)

    async def on_loop(items):
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        inst.start_batch(loop, items, lambda outcome, error: answer.set_exception(error) if error is not None
                         else answer.set_result(outcome))
        results, _ = await asyncio.wait_for(answer, 60)
        return [int(r["PID"][0, 0]) for r in results]

    async def run() -> None:
        pid = inst._proc.pid
        assert await on_loop([item(1.0), item(2.0)]) == [pid, pid]
        try:
            results, _ = await asyncio.wait_for(asyncio.to_thread(inst.execute, [item(300.0)]), 60)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)  # unblocks the thread stuck in recv, so the test ends
            raise
        assert int(results[0]["PID"][0, 0]) == pid
        assert await on_loop([item(4.0)]) == [pid]
        with pytest.raises(Internal, match=r"instance process cross_py_0 died \(exit code 3\) while executing"):
            await on_loop([item(-1.0)])
        again = await on_loop([item(5.0)])
        assert again[0] != pid and again[0] in _instance_pids()

    try:
        _on_server_loop(run())
    finally:
        inst.close()
    assert not [p for p in _instance_pids() if b"cross_py" in cmdline(p)]


def test_the_socket_stays_watched_between_loop_side_batches(tmp_path):
    """Loop-side batches keep the instance's socket registered with the loop (no add/remove of the reader
    per batch: 6 epoll_ctl + 2 ioctl saved); a crossing inline on the loop or from a thread takes it off
    first and still gets its own answer; the next loop-side batch registers it again."""
    import uvloop

    class CountingLoop(uvloop.Loop):
        added = removed = 0

        def add_reader(self, fd, callback, *args):
            self.added += 1
            return super().add_reader(fd, callback, *args)

        def remove_reader(self, fd):
            self.removed += 1
            return super().remove_reader(fd)

    _pid_model(tmp_path, "watch_py", "true")
    model_dir = tmp_path / "watch_py"
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    ctx = LoadContext("watch_py", 1, model_dir, model_dir / "1" / "model.py", config, "watch_py_0", 0)
    inst = instances.ProcessInstance("python", ctx)
    pid = inst._proc.pid

    def item(x: float) -> WorkItem:
        return WorkItem({"X": np.array([[x]], np.float32)}, None, 1)

    async def on_loop(items):
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        inst.start_batch(loop, items, lambda outcome, error: answer.set_exception(error) if error is not None
                         else answer.set_result(outcome))
        results, _ = await asyncio.wait_for(answer, 60)
        return [int(r["PID"][0, 0]) for r in results]

    async def run(loop: CountingLoop) -> None:
        for x in (1.0, 2.0, 3.0, 4.0):
            assert await on_loop([item(x), item(x)]) == [pid, pid]
        assert (loop.added, loop.removed) == (1, 0)
        results, _ = inst.execute([item(5.0)])  # inline on the loop, as the batcher may run it
        assert int(results[0]["PID"][0, 0]) == pid and (loop.added, loop.removed) == (1, 1)
        assert await on_loop([item(6.0)]) == [pid]
        assert (loop.added, loop.removed) == (2, 1)
        results, _ = await asyncio.wait_for(asyncio.to_thread(inst.execute, [item(7.0)]), 60)
        assert int(results[0]["PID"][0, 0]) == pid and (loop.added, loop.removed) == (2, 2)
        assert await on_loop([item(8.0)]) == [pid]

    loop = CountingLoop()
    try:
        loop.run_until_complete(run(loop))
    finally:
        inst.close()
        loop.close()
    assert loop.removed == 3  # close took it off the loop before closing the socket
    assert not [p for p in _instance_pids() if b"watch_py" in cmdline(p)]


#: PID_PY that starts a thread of its own while it loads (one the server's priority setting must reach too)
THREADED_PID_PY = PID_PY.replace("class TritonPythonModel:\n", '''class TritonPythonModel:
    def initialize(self, args):
        import threading
        self.idle = threading.Event()
        threading.Thread(target=self.idle.wait, daemon=True).start()

''')


def _nice_ctx(tmp_path, name: str, nice: str) -> LoadContext:
    _pid_model(tmp_path, name, "true")
    model_dir = tmp_path / name
    (model_dir / "1" / "model.py").write_text(THREADED_PID_PY)
    with (model_dir / "config.pbtxt").open("a") as f:
        f.write(f'parameters {{ key: "azulite_instance_nice" value: {{ string_value: "{nice}" }} }}\n')
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), mc.ModelConfig())
    return LoadContext(name, 1, model_dir, model_dir / "1" / "model.py", config, f"{name}_0", 0)


def test_instance_nice_sets_each_instance_process_priority_restarts_included(tmp_path):
    """``azulite_instance_nice`` sets the instance process's scheduling priority (docs/perf-workers.md, stop
    28: a GIL-bound model's instances ahead of the front end's loop form larger batches where cores are
    short); a process started again after dying gets it too. A value above the server's own needs no
    privilege, so the test runs anywhere."""
    target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)
    inst = instances.ProcessInstance("python", _nice_ctx(tmp_path, "nice_py", str(target)))
    try:
        pid = inst._proc.pid
        # every thread of it (Linux keeps one value per thread): the process's own and the one its load started
        threads = os.listdir(f"/proc/{pid}/task")
        assert len(threads) >= 2 and {os.getpriority(os.PRIO_PROCESS, int(t)) for t in threads} == {target}
        assert int(inst.execute([WorkItem({"X": np.array([[1.0]], np.float32)}, None, 1)])[0][0]["PID"][0, 0]) == pid
        with pytest.raises(Internal, match="died"):
            inst.execute([WorkItem({"X": np.array([[-1.0]], np.float32)}, None, 1)])
        results, _ = inst.execute([WorkItem({"X": np.array([[2.0]], np.float32)}, None, 1)])
        again = int(results[0]["PID"][0, 0])
        assert again != pid and os.getpriority(os.PRIO_PROCESS, again) == target
    finally:
        inst.close()


@pytest.mark.parametrize("value", ["fast", "-21", "20", "1.5"])
def test_a_wrong_instance_nice_fails_the_load_naming_it(tmp_path, value):
    with pytest.raises(ModelLoadError, match=r"'azulite_instance_nice' must be an integer from -20 to 19") as e:
        instances.ProcessInstance("python", _nice_ctx(tmp_path, "bad_nice_py", value))
    assert e.value.fix and "azulite_instance_nice" in e.value.fix
    assert not [p for p in _instance_pids() if b"bad_nice_py" in cmdline(p)]


# an output numpy can hold but Triton cannot (by the input's value), or an object that has no text for BYTES
ODD_PY = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class Untold:
    def __str__(self):
        raise ValueError("no text")


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = r.inputs()[0].as_numpy()
            kind = int(x[0, 0])
            y = {0: x.astype("datetime64[s]"), 1: x.astype(np.complex64),
                 2: np.array([[Untold()]] * len(x), dtype=object)}.get(kind, x)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y), pb_utils.Tensor("PID", np.full((len(x), 1), os.getpid()))]))
        return out
'''
ODD_CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }}, {{ name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }} ]
dynamic_batching {{ preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 200000 }}
parameters {{ key: "azulite_instance_process" value: {{ string_value: "{choice}" }} }}
'''


def test_an_output_triton_cannot_hold_fails_its_request_alike_in_threads_and_processes(tmp_path):
    """A model's output with no Triton datatype (datetime64 cannot even be written to shared memory) is
    the model's fault: INTERNAL naming the model and the output, the same for a thread or a process; only
    that request fails, the batch's other request answers, and the instance process lives on (no restart).
    An output that cannot be written at all (an object whose text raises) fails its batch, never the process."""
    for name, choice in (("odd_threads", "false"), ("odd_processes", "true")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(ODD_CONFIG.format(name=name, choice=choice))
        (tmp_path / name / "1" / "model.py").write_text(ODD_PY)
    before = set(_instance_pids())
    restarted = sum(n for (model, _), n in instances.restarts.items() if model == "odd_processes")
    dp = TritonDataPlane(DataPlaneSettings(repository=tmp_path))

    async def one(model: str, x: float):
        request = InferRequest(model, [InferTensor("X", "FP32", (1, 1), np.array([[x]], np.float32))])
        try:
            return {t.name: t.data for t in (await dp.infer(request)).outputs}
        except Internal as exc:
            return exc

    async def run() -> None:
        try:
            (pid,) = [p for p in _instance_pids() if p not in before]
            for model in ("odd_threads", "odd_processes"):
                for kind, dtype in ((0, "datetime64[s]"), (1, "complex64")):
                    bad, good = await asyncio.gather(one(model, kind), one(model, 5.0))
                    assert isinstance(bad, Internal) and bad.status == "INTERNAL", bad
                    assert str(bad).startswith(f"model '{model}': output 'Y' is a numpy {dtype} array, which has "
                                               "no Triton datatype"), bad
                    assert good["Y"].tolist() == [[5.0]]
            unwritable = await one("odd_processes", 2.0)
            assert isinstance(unwritable, Internal) and "could not pass the batch's outputs back" in str(unwritable)
            answered = await one("odd_processes", 3.0)
            assert int(answered["PID"][0, 0]) == pid  # the same process answered throughout
            assert sum(n for (model, _), n in instances.restarts.items() if model == "odd_processes") == restarted
        finally:
            await dp.shutdown(30)

    _on_server_loop(run())
