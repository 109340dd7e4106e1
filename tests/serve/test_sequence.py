"""Sequence batching (serve/sequence.py): tritonclient's sequence calls over HTTP and gRPC against a real
azulite server and against real Triton (the same Python model, with control inputs and implicit state):
equal answers and error classes."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import MODELS_DIR, build_model_repository
from .frontends import running_server

IDLE_US = 5000  # the idle model's limit: 5 ms


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = build_model_repository(tmp_path_factory.mktemp("sequence"), ("accumulate_py",))
    idle = root / "accumulate_idle"
    (idle / "1").mkdir(parents=True)
    (idle / "config.pbtxt").write_text((MODELS_DIR / "accumulate_py" / "config.pbtxt").read_text()
                                       .replace('"accumulate_py"', '"accumulate_idle"')
                                       .replace("max_sequence_idle_microseconds: 60000000",
                                                f"max_sequence_idle_microseconds: {IDLE_US}"))
    (idle / "1" / "model.py").write_text((MODELS_DIR / "accumulate_py" / "model.py").read_text())
    oldest = root / "accumulate_oldest"  # the oldest strategy: batches across sequences, up to 4
    (oldest / "1").mkdir(parents=True)
    (oldest / "config.pbtxt").write_text((MODELS_DIR / "accumulate_py" / "config.pbtxt").read_text()
                                         .replace('"accumulate_py"', '"accumulate_oldest"')
                                         .replace("direct { }", "oldest { max_candidate_sequences: 4 "
                                                  "max_queue_delay_microseconds: 60000000 }"))
    (oldest / "1" / "model.py").write_text((MODELS_DIR / "accumulate_py" / "model.py").read_text())
    return root


def one(client, lib, model: str, value: int, **seq):
    inp = lib.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    result = client.infer(model, [inp], **seq)
    return (int(result.as_numpy("OUTPUT")[0, 0]), int(result.as_numpy("CORR")[0, 0]),
            int(result.as_numpy("FLAGS")[0, 0]), result.as_numpy("OUTPUT_STATE"))


def error_status(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


def conversation(http_url: str, grpc_url: str) -> dict:
    seen: dict = {}
    for protocol, lib, url, base in (("http", httpclient, http_url, 1000), ("grpc", grpcclient, grpc_url, 2000)):
        client = lib.InferenceServerClient(url)
        a, b = base + 1, base + 2
        steps = [(a, 1, True, False), (b, 10, True, False), (a, 2, False, False), (b, 20, False, True),
                 (a, 3, False, True)]
        seen[protocol, "answers"] = [
            one(client, lib, "accumulate_py", v, sequence_id=sid, sequence_start=s, sequence_end=e)
            for sid, v, s, e in steps]
        seen[protocol, "after end"] = error_status(lambda: one(client, lib, "accumulate_py", 1, sequence_id=a))
        seen[protocol, "never started"] = error_status(
            lambda: one(client, lib, "accumulate_py", 1, sequence_id=base + 9))
        seen[protocol, "no id"] = error_status(lambda: one(client, lib, "accumulate_py", 1))
        # a sequence idle past max_sequence_idle_microseconds is released
        one(client, lib, "accumulate_idle", 5, sequence_id=a, sequence_start=True)
        time.sleep(IDLE_US / 1e6 * 100)  # makes sure the idle limit has passed (not a synchronisation)
        seen[protocol, "idle"] = error_status(lambda: one(client, lib, "accumulate_idle", 1, sequence_id=a))
        seen[protocol, "restart"] = one(client, lib, "accumulate_idle", 7, sequence_id=a, sequence_start=True,
                                        sequence_end=True)
        client.close()
    return seen


def check(seen: dict, ours: bool) -> None:
    for protocol, base in (("http", 1000), ("grpc", 2000)):
        a, b = base + 1, base + 2
        if ours:  # implicit state carries the running sum
            sums = [1, 10, 3, 30, 6]
        else:  # Triton 2.51's Python backend runs the model but carries no implicit state (observed here)
            sums = [1, 10, 2, 20, 3]
        assert seen[protocol, "answers"] == [(sums[0], a, 5, None), (sums[1], b, 5, None), (sums[2], a, 4, None),
                                             (sums[3], b, 6, None), (sums[4], a, 6, None)]
        assert seen[protocol, "restart"] == (7, a, 7, None)
        for what in ("after end", "never started", "no id", "idle"):
            assert seen[protocol, what][0] == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT"), what
        if ours:
            assert f"sequence {a}" in seen[protocol, "after end"][1] and "START" in seen[protocol, "after end"][1]
            assert f"sequence {base + 9}" in seen[protocol, "never started"][1]
            assert "correlation ID" in seen[protocol, "no id"][1]
            assert f"sequence {a}" in seen[protocol, "idle"][1] and "idle" in seen[protocol, "idle"][1]


def test_sequences_over_http_and_grpc(repo):
    with running_server(repo) as s:
        check(conversation(s.http_url, s.grpc_url), ours=True)
        for lib, url in ((httpclient, s.http_url), (grpcclient, s.grpc_url)):
            client = lib.InferenceServerClient(url)
            # a string correlation ID where the model's CORRID control is UINT64: refused, naming both
            # (real Triton accepts it; what it feeds CORRID then is not documented)
            status, message = error_status(
                lambda: one(client, lib, "accumulate_py", 1, sequence_id="seq-a", sequence_start=True))
            assert status in ("400", "StatusCode.INVALID_ARGUMENT") and "'seq-a'" in message and "UINT64" in message


def test_same_answers_as_real_triton(repo, tmp_path):
    from .anchor import running_triton

    with running_triton(repo, tmp_path / "triton.log") as triton:
        theirs = conversation(triton.http_url, triton.grpc_url)
    check(theirs, ours=False)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_drives_sequences(repo, tmp_path, protocol):
    """perf_analyzer's sequence mode (sequence ids, START/END, concurrent sequences) finds no error."""
    import subprocess

    from .test_server import COUNT_WINDOWS, PERF_ANALYZER

    assert PERF_ANALYZER.exists(), "perf_analyzer missing: `make test` installs it (scripts/anchors.sh)"
    with running_server(repo) as s:
        url = s.http_url if protocol == "http" else s.grpc_url
        p = subprocess.run([str(PERF_ANALYZER), "-m", "accumulate_py", "-i", protocol, "-u", url,
                            "--concurrency-range", "4", "--sequence-length", "5", *COUNT_WINDOWS, "--max-trials", "5",
                            "--stability-percentage", "999", "-f", str(tmp_path / "out.csv")],
                           capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        stats = httpclient.InferenceServerClient(s.http_url).get_inference_statistics("accumulate_py")
        inference = stats["model_stats"][0]["inference_stats"]
        model = s.server.dataplane.manager.get("accumulate_py", "")
        assert inference["success"]["count"] > 0 and inference["fail"]["count"] == 0, (
            f"failures by reason: {model.stats.failures}\n{p.stdout[-2000:]}")


def test_oldest_strategy_batches_across_sequences(repo):
    """Four sequences step at once: with max_batch_size 4 and a long queue delay (60 s) each step's four
    requests run as one execution as soon as the batch is full; each sequence keeps its own state."""
    import queue

    with running_server(repo) as s:
        client = grpcclient.InferenceServerClient(s.grpc_url)

        def step(value_of, **flags) -> list:
            done: queue.Queue = queue.Queue()
            for k in range(4):
                inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                inp.set_data_from_numpy(np.array([[value_of(k)]], dtype=np.int32))
                client.async_infer("accumulate_oldest", [inp], sequence_id=500 + k, **flags,
                                   callback=lambda result, error: done.put((result, error)))
            answers = []
            for _ in range(4):
                result, error = done.get(timeout=120)
                assert error is None, error
                answers.append((int(result.as_numpy("CORR")[0, 0]), int(result.as_numpy("OUTPUT")[0, 0])))
            return sorted(answers)

        assert step(lambda k: k + 1, sequence_start=True) == [(500, 1), (501, 2), (502, 3), (503, 4)]
        assert step(lambda k: 10, sequence_end=True) == [(500, 11), (501, 12), (502, 13), (503, 14)]
        stats = httpclient.InferenceServerClient(s.http_url).get_inference_statistics("accumulate_oldest")
        model = stats["model_stats"][0]
        assert int(model["inference_count"]) == 8 and int(model["execution_count"]) == 2
        client.close()


def test_ids_out_of_range_and_batches_of_more_than_one_are_the_clients_mistake(repo):
    """A negative sequence_id was a 500 (numpy's OverflowError casting it to the UINT64 CORRID); a request of
    two rows was run, and applied the sequence's state to both (Triton refuses it: batch-size 1)."""
    with running_server(repo) as s:
        for lib, url, bad in ((httpclient, s.http_url, "400"), (grpcclient, s.grpc_url, "StatusCode.INVALID_ARGUMENT")):
            client = lib.InferenceServerClient(url)
            status, message = error_status(lambda: one(client, lib, "accumulate_py", 1, sequence_id=-7,
                                                       sequence_start=True))
            assert status == bad and "correlation ID (request parameter 'sequence_id') -7 is not an unsigned 64-bit" in message
            one(client, lib, "accumulate_py", 1, sequence_id=77, sequence_start=True)
            two = lib.InferInput("INPUT", [2, 1], "INT32")
            two.set_data_from_numpy(np.array([[5], [6]], dtype=np.int32))
            status, message = error_status(lambda: client.infer("accumulate_py", [two], sequence_id=77))
            assert status == bad and "must specify batch-size 1 due to requirements of sequence batcher, got 2" in message
            assert one(client, lib, "accumulate_py", 3, sequence_id=77, sequence_end=True)[0] == 4  # the state is 1 + 3
            client.close()
