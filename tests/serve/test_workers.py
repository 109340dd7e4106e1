"""``azulite serve --workers 2`` as real processes and sockets: two front-ends behind the shared ports,
one model host, Python instances in their own processes. Each test picks connections that landed on a
given front-end (found from /proc: which process holds the server end of the connection), so what
crosses front-ends is known, not left to the kernel's hashing."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.serve.conftest import build_model_repository
from tests.serve.procs import alive, children, cmdline, kill, owner, tree

AZULITE = str(Path(sys.executable).parent / "azulite")

# answers, per request, how many requests its execute() call held: a batch across front-ends shows as 2
BATCH_COUNT_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        n = len(requests)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("N", np.full((len(r.inputs()[0].as_numpy()), 1), n, np.int64))])
                for r in requests]
'''
BATCH_COUNT_CONFIG = '''
name: "batch_count_py"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "N" data_type: TYPE_INT64 dims: [ 1 ] } ]
dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 60000000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
'''
# holds each execution until the file <gate>/open exists; says it is inside by writing <gate>/inside
HELD_PY = '''
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json
        self.gate = json.loads(args["model_config"])["parameters"]["gate"]["string_value"]

    def execute(self, requests):
        open(os.path.join(self.gate, "inside"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(self.gate, "open")) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", r.inputs()[0].as_numpy() * 2)]) for r in requests]
'''
HELD_CONFIG = '''
name: "held_py"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
parameters { key: "gate" value: { string_value: "GATE" } }
'''


def write_model(root: Path, name: str, config: str, code: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    (root / name / "1" / "model.py").write_text(code)


def wait_for(predicate, what: str, timeout: float = 120.0):
    """Poll a condition (the safety-net timeout only fails the test, it never decides it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except ConnectionError:  # a connection queued on a front-end as it was killed is reset: ask again
            value = None
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Workers:
    """``azulite serve --workers 2`` (or ``workers``) on free ports; ``frontends()`` are the front-end pids."""

    def __init__(self, repo: Path, *args: str, workers: int = 2) -> None:
        self.proc = subprocess.Popen(
            [AZULITE, "serve", str(repo), "--workers", str(workers), *args, "--http-port", "0", "--grpc-port", "0",
             "--metrics-port", "0", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
             "--metrics-address", "127.0.0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})
        self.lines: list[str] = []
        self.ports: dict[str, int] = {}
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self.ready.wait(180) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError("server did not start:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            m = re.match(r"Started (\w+)(?: Service)? at [\d.]+:(\d+)", line)
            if m:
                self.ports[m.group(1)] = int(m.group(2))
            if "azulite serve ready" in line:
                self.ready.set()
        self.ready.set()

    def descendants(self) -> list[int]:
        return tree(self.proc.pid)

    def frontends(self) -> list[int]:
        return [p for p in children(self.proc.pid) if b"frontend" in cmdline(p)]

    def conn(self) -> http.client.HTTPConnection:
        c = http.client.HTTPConnection("127.0.0.1", self.ports["HTTPService"], timeout=120)
        c.request("GET", "/v2/health/live")
        assert c.getresponse().read() == b""
        return c

    def conn_on(self, pid: int) -> http.client.HTTPConnection:
        """A keep-alive connection served by front-end ``pid`` (new connections until one lands there)."""
        spare = []
        try:
            for _ in range(200):
                c = self.conn()
                if owner(c, self.frontends()) == pid:
                    return c
                spare.append(c)
            raise AssertionError(f"no connection landed on front-end {pid}")
        finally:
            for c in spare:
                c.close()

    def metric(self, name: str, labels: str = "") -> float:
        c = http.client.HTTPConnection("127.0.0.1", self.ports["Metrics"], timeout=60)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
        m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else -1.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            for pid in self.descendants():
                kill(pid)
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)


def call(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    return r.status, (json.loads(data) if data else {})


def infer(conn, model: str, x: float) -> dict:
    status, doc = call(conn, "POST", f"/v2/models/{model}/infer",
                       {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [x]}]})
    assert status == 200, doc
    return {o["name"]: o["data"] for o in doc["outputs"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = build_model_repository(tmp_path_factory.mktemp("workers_repo"), ("add_sub_py", "repeat_py"))
    write_model(root, "batch_count_py", BATCH_COUNT_CONFIG, BATCH_COUNT_PY)
    s = Workers(root, "--model-control-mode", "explicit", "--load-model", "batch_count_py", "--load-model", "repeat_py")
    yield s
    s.stop()


def test_two_front_ends_one_model_host(served):
    a_pid, b_pid = served.frontends()
    a, b = served.conn_on(a_pid), served.conn_on(b_pid)
    # model control through one front-end is what every other one answers
    assert call(b, "GET", "/v2/models/add_sub_py/ready")[0] == 400
    assert call(a, "POST", "/v2/repository/models/add_sub_py/load", {})[0] == 200
    assert call(b, "GET", "/v2/models/add_sub_py/ready")[0] == 200
    x = list(range(16))
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16], "data": x} for n in ("INPUT0", "INPUT1")]}
    for conn in (a, b, a):
        status, doc = call(conn, "POST", "/v2/models/add_sub_py/infer", body)
        assert status == 200, doc
        assert {o["name"]: o["data"] for o in doc["outputs"]}["OUTPUT0"] == [2.0 * v for v in x]
    # statistics are one count, whichever front-end asks
    for conn in (a, b):
        stats = call(conn, "GET", "/v2/models/add_sub_py/stats")[1]["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 3, stats
    assert served.metric("nv_inference_request_success", '{model="add_sub_py",version="1"}') == 3
    assert call(b, "POST", "/v2/repository/models/add_sub_py/unload", {})[0] == 200
    assert call(a, "GET", "/v2/models/add_sub_py/ready")[0] == 400
    # requests through both front-ends meet in one dynamic batcher: the batch of 2 leaves at once (its
    # preferred size); with a batcher per front-end each would wait out the 60 s delay alone and say 1
    answers = {}
    threads = [threading.Thread(target=lambda k, c: answers.__setitem__(k, infer(c, "batch_count_py", 1.0)),
                                args=(k, c)) for k, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == {"a": {"N": [2]}, "b": {"N": [2]}}
    # a decoupled model's responses stream back through a front-end (generate_stream: one event each)
    a.request("POST", "/v2/models/repeat_py/generate_stream", body=json.dumps({"IN": [1, 2, 3]}))
    r = a.getresponse()
    events = [json.loads(c[len(b"data: "):]) for c in r.read().split(b"\n\n") if c.startswith(b"data: ")]
    assert r.status == 200 and [(e["OUT"], e["IDX"]) for e in events] == [(1, 0), (2, 1), (3, 2)], events
    # the Python model's instance runs in its own process, a child of the model host
    host = [p for p in children(served.proc.pid) if b" host " in b" " + cmdline(p).replace(b"\0", b" ")]
    assert len(host) == 1 and any(b"azulite.serve.instances" in cmdline(p) for p in children(host[0]))
    a.close()
    b.close()


def test_shared_memory_regions_are_the_model_hosts_whichever_front_end_asks(served):
    """A region registered through one front-end is the one every front-end reads and writes: the model
    host maps it (serve/frontend_views.py RemoteShm); CUDA registration says what is missing here."""
    import tritonclient.utils.shared_memory as shm

    from azulite.serve import cuda_shm

    a_pid, b_pid = served.frontends()
    a, b = served.conn_on(a_pid), served.conn_on(b_pid)
    key = f"/azulite-workers-{os.getpid()}"
    region = shm.create_shared_memory_region("w", key, 256)
    try:
        assert call(a, "POST", "/v2/repository/models/add_sub_py/load", {})[0] == 200
        x, y = np.arange(16, dtype=np.float32), np.full(16, 0.5, np.float32)
        shm.set_shared_memory_region(region, [x, y])
        assert call(a, "POST", "/v2/systemsharedmemory/region/w/register", {"key": key, "byte_size": 256})[0] == 200
        assert call(b, "GET", "/v2/systemsharedmemory/status")[1] == [
            {"name": "w", "key": key, "offset": 0, "byte_size": 256}]
        status, doc = call(b, "POST", "/v2/systemsharedmemory/region/w/register", {"key": key, "byte_size": 256})
        assert status == 400 and "'w' is already registered" in doc["error"], doc  # the host's class, not a 500
        place = {"shared_memory_region": "w", "shared_memory_byte_size": 64}
        body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16], "parameters": {**place, "shared_memory_offset": off}}
                           for n, off in (("INPUT0", 0), ("INPUT1", 64))],
                "outputs": [{"name": "OUTPUT0", "parameters": {**place, "shared_memory_offset": 128}}]}
        status, doc = call(b, "POST", "/v2/models/add_sub_py/infer", body)
        assert status == 200, doc
        assert shm.get_contents_as_numpy(region, np.float32, [16], offset=128).tolist() == (x + y).tolist()
        assert call(b, "POST", "/v2/systemsharedmemory/region/w/unregister")[0] == 200
        assert call(a, "GET", "/v2/systemsharedmemory/status")[1] == []
        status, doc = call(a, "POST", "/v2/models/add_sub_py/infer", body)
        assert status == 404 and "'w'" in doc["error"], doc
        if not cuda_shm.available():
            status, doc = call(a, "POST", "/v2/cudasharedmemory/region/c/register",
                               {"raw_handle": {"b64": "aGFuZGxl"}, "device_id": 0, "byte_size": 64})
            assert status == 501 and "CUDA" in doc["error"], doc
        assert call(b, "POST", "/v2/repository/models/add_sub_py/unload", {})[0] == 200
    finally:
        shm.destroy_shared_memory_region(region)
        a.close()
        b.close()


def test_killed_front_end_is_replaced_while_the_other_serves(served):
    before = served.metric("azulite_worker_restarts_total", '{role="frontend"}')
    a_pid, b_pid = served.frontends()
    b = served.conn_on(b_pid)
    os.kill(a_pid, signal.SIGKILL)
    # B serves on (a request of batch size 2 is the model's preferred batch: it runs at once)
    status, doc = call(b, "POST", "/v2/models/batch_count_py/infer",
                       {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 1], "data": [1.0, 2.0]}]})
    assert status == 200 and doc["outputs"][0]["data"] == [1, 1], doc
    wait_for(lambda: served.metric("azulite_worker_restarts_total", '{role="frontend"}') == before + 1,
             "the restart counter")

    def replaced():
        pids = served.frontends()
        return pids if len(pids) == 2 and a_pid not in pids else None

    pids = wait_for(replaced, "a new front-end")
    assert b_pid in pids
    new = served.conn_on(next(p for p in pids if p != b_pid))
    assert call(new, "GET", "/v2/models/batch_count_py/ready")[0] == 200
    new.close()
    b.close()


def test_killed_model_host_is_restarted_with_every_front_end(served):
    """The host holds the models: when it dies the supervisor starts it (its start-up models loaded
    again, instance processes too) and then every front-end, and counts it."""
    before = served.metric("azulite_worker_restarts_total", '{role="host"}')
    old_frontends = set(served.frontends())

    def host() -> list[int]:
        return [p for p in children(served.proc.pid) if b" host " in b" " + cmdline(p).replace(b"\0", b" ")]

    (old_host,) = host()
    old_instances = [p for p in children(old_host) if b"azulite.serve.instances" in cmdline(p)]
    assert old_instances
    # what the operator did since the start: add_sub_py loaded with a config override, repeat_py (a start-up
    # model) unloaded; the restarted host serves that, not the start-up models (it brought them back)
    conn = served.conn()
    assert call(conn, "POST", "/v2/repository/models/add_sub_py/load")[0] == 200
    config = call(conn, "GET", "/v2/models/add_sub_py/config")[1]
    config["parameters"] = {**config.get("parameters", {}), "operator_note": {"string_value": "kept"}}
    assert call(conn, "POST", "/v2/repository/models/add_sub_py/load",
                {"parameters": {"config": json.dumps(config)}})[0] == 200
    assert call(conn, "POST", "/v2/repository/models/repeat_py/unload")[0] == 200
    conn.close()
    os.kill(old_host, signal.SIGKILL)
    wait_for(lambda: (h := host()) and h != [old_host] and len(set(served.frontends()) - old_frontends) == 2,
             "a new host and two new front-ends")
    # the dead host's instance processes saw their socket close and left with it
    wait_for(lambda: not [p for p in old_instances if alive(p)], "the old instance processes to exit")
    conn = wait_for(lambda: served.conn(), "a front-end to accept")
    status, doc = wait_for(lambda: (r := call(conn, "POST", "/v2/models/batch_count_py/infer",
                                              {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2, 1],
                                                           "data": [1.0, 2.0]}]})) and r[0] == 200 and r,
                           "the model to answer again")
    assert doc["outputs"][0]["data"] == [1, 1], doc
    assert served.metric("azulite_worker_restarts_total", '{role="host"}') == before + 1
    index = {m["name"]: m.get("state") for m in call(conn, "POST", "/v2/repository/index")[1]}
    assert index["add_sub_py"] == "READY" and index["repeat_py"] != "READY" and index["batch_count_py"] == "READY"
    parameters = call(conn, "GET", "/v2/models/add_sub_py/config")[1]["parameters"]
    assert parameters["operator_note"] == {"string_value": "kept"}
    conn.close()


def test_shutdown_drains_every_worker(tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    root = tmp_path / "repo"
    write_model(root, "held_py", HELD_CONFIG.replace("GATE", str(gate)), HELD_PY)
    s = Workers(root)
    procs = s.descendants()
    try:
        conns = [s.conn_on(pid) for pid in s.frontends()]
        answers: dict[int, dict] = {}
        threads = [threading.Thread(target=lambda i, c: answers.__setitem__(i, infer(c, "held_py", float(i))),
                                    args=(i, c)) for i, c in enumerate(conns)]
        for t in threads:
            t.start()
        # one request executing (held), the other queued behind it: both are inside the server
        wait_for(lambda: (gate / "inside").exists()
                 and s.metric("nv_inference_pending_request_count", '{model="held_py",version="1"}') == 1,
                 "both requests inside the server")
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: any("draining" in line for line in s.lines), "the server to start draining")
        (gate / "open").touch()
        for t in threads:
            t.join(120)
        assert answers == {0: {"Y": [0.0]}, 1: {"Y": [2.0]}}  # both front-ends answered what they had
        assert s.proc.wait(120) == 0, "".join(s.lines)
        assert not [p for p in procs if alive(p)]  # no worker, host or instance process left
    finally:
        s.stop()


def test_limits_quotas_and_audit_hold_across_front_ends(tmp_path):
    """Per-request protection state is one truth for the whole server: a key's rate and daily quota are
    spent across front-ends (not granted once per process), a restarted front-end does not hand the quota
    back, and both front-ends write whole lines to one audit log."""
    from azulite.serve.keystore import KeyStore

    store = KeyStore(tmp_path / "keys.db")
    quota = store.create("quota", quota_per_day=3)[1]
    slow = store.create("slow", rps=0.001)[1]  # one request, then a token every 1000 s
    store.close()
    root = build_model_repository(tmp_path / "repo", ("add_sub_py",))
    audit = tmp_path / "audit.jsonl"
    s = Workers(root, "--auth", "--key-store", str(tmp_path / "keys.db"), "--audit-log", str(audit))
    try:
        a_pid, b_pid = s.frontends()
        a, b = s.conn_on(a_pid), s.conn_on(b_pid)
        body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16], "data": list(range(16))}
                           for n in ("INPUT0", "INPUT1")]}

        def infer_with(conn, token: str) -> int:
            conn.request("POST", "/v2/models/add_sub_py/infer", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
            r = conn.getresponse()
            r.read()
            return r.status

        # the rate: one token in all, whichever front-end is asked first and second
        assert [infer_with(a, slow), infer_with(b, slow)] == [200, 429]
        # the quota: 3 a day across both front-ends
        assert [infer_with(c, quota) for c in (a, b, a, b)] == [200, 200, 200, 429]
        # the audit writer batches lines: wait until both front-ends' six are in the log before a kill -9
        wait_for(lambda: audit.exists() and audit.read_text().count('"model":"add_sub_py"') >= 6, "six audit lines")
        # the guard's counters are the whole server's, whichever front-end the scrape reaches (and the
        # killed front-end's published counts stay in the sum)
        wait_for(lambda: s.metric("azulite_audit_lines_written_total") == len(audit.read_text().splitlines()),
                 "every audit line (health checks too) counted")
        assert s.metric("azulite_requests_rejected_total", '{status="RESOURCE_EXHAUSTED"}') == 2
        # a front-end killed and replaced starts from the shared counts, not a fresh quota
        os.kill(a_pid, signal.SIGKILL)
        pids = wait_for(lambda: (p := s.frontends()) and len(p) == 2 and a_pid not in p and p, "a new front-end")
        new = s.conn_on(next(p for p in pids if p != b_pid))
        assert [infer_with(new, quota), infer_with(b, quota), infer_with(new, slow)] == [429, 429, 429]
        wait_for(lambda: s.metric("azulite_requests_rejected_total", '{status="RESOURCE_EXHAUSTED"}') == 5
                 and s.metric("azulite_audit_lines_written_total") == len(audit.read_text().splitlines()),
                 "the new front-end's counts in the sum")
        for c in (a, b, new):
            c.close()
    finally:
        s.stop()
    # every request of both front-ends is one whole JSON line of the one log (written before stop returns)
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    statuses = sorted(line["status"] for line in lines if line.get("model") == "add_sub_py")
    assert statuses == sorted([200] * 4 + [429] * 5), lines


def test_the_model_host_drains_in_what_the_front_ends_left_of_the_exit_timeout(tmp_path):
    # the host drained a whole --exit-timeout-secs again after the front-ends had spent theirs
    from azulite.serve.workers import STOP_BY, _time_left

    assert _time_left(tmp_path, 30.0) == 30.0  # no deadline written (the supervisor died): all of it
    (tmp_path / STOP_BY).write_text(repr(time.time() + 5.0))
    assert 0.0 < _time_left(tmp_path, 30.0) <= 5.0
    (tmp_path / STOP_BY).write_text(repr(time.time() - 1.0))
    assert _time_left(tmp_path, 30.0) == 0.0


def test_run_folders_of_killed_servers_are_swept_at_the_next_start():
    """A supervisor killed with SIGKILL leaves its run folder (host socket, guard counts, state/); the next
    `azulite serve --workers N` removes those whose supervisor is gone, and only those."""
    import tempfile

    from azulite.serve.workers import RUN_DIR_PREFIX, sweep_run_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no live process now
    dead = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    (dead / "supervisor.pid").write_text(str(gone.pid))
    (dead / "state").mkdir()
    live = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    (live / "supervisor.pid").write_text(str(os.getpid()))
    unknown = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))  # no pid file: not judged
    try:
        removed = sweep_run_dirs()
        assert dead in removed and not dead.exists()
        assert live.exists() and unknown.exists() and live not in removed and unknown not in removed
    finally:
        for path in (dead, live, unknown):
            shutil.rmtree(path, ignore_errors=True)
