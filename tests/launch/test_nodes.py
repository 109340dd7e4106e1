"""The node-request files between ``azulite job nodes`` and a job's supervisor: each request answered once,
in order, and an asker whose job went away told why instead of waiting."""

import threading

import pytest

from azulite.errors import LaunchError
from azulite.launch.local.nodes import REQUESTS_DIR, node_view, take_requests, wait_reply, write_reply, write_request
from azulite.launch.records import JobRecord, JobState, ProcessRecord


def test_requests_are_taken_once_oldest_first_and_answered_each_on_its_own(tmp_path):
    first, second = write_request(tmp_path, 1), write_request(tmp_path, None)
    taken = take_requests(tmp_path)
    assert [(r["id"], r["count"]) for r in taken] == [(first, 1), (second, None)]
    assert take_requests(tmp_path) == []  # removed once taken: never answered twice

    write_reply(tmp_path, second, started=[], refused="the job has ended")
    write_reply(tmp_path, first, started=["node-1"])
    assert wait_reply(tmp_path, first, gone=lambda: None, timeout=5) == {"id": first, "started": ["node-1"], "refused": None}
    assert wait_reply(tmp_path, second, gone=lambda: None, timeout=5)["refused"] == "the job has ended"
    assert list((tmp_path / REQUESTS_DIR).iterdir()) == []  # replies read are removed


def test_an_answer_that_comes_while_waiting_is_returned(tmp_path):
    rid = write_request(tmp_path, 2)

    def supervisor():
        (req,) = take_requests(tmp_path)
        write_reply(tmp_path, req["id"], started=["node-1", "node-2"])

    threading.Timer(0.3, supervisor).start()
    assert wait_reply(tmp_path, rid, gone=lambda: None, timeout=30)["started"] == ["node-1", "node-2"]


def test_a_job_gone_ends_the_wait_with_the_reason_and_withdraws_the_request(tmp_path):
    rid = write_request(tmp_path, 1)
    with pytest.raises(LaunchError, match="job t-1 ended \\(failed\\)"):
        wait_reply(tmp_path, rid, gone=lambda: "job t-1 ended (failed)", timeout=30)
    assert take_requests(tmp_path) == []  # a late supervisor does not act on it


def test_the_view_reads_each_agents_state_from_its_recorded_exit():
    rec = JobRecord(id="t-1", name="t", backend="local", state=JobState.RUNNING, attempt=2, created_at=0.0,
                    started_at=None, ended_at=None, exit_code=None, reason=None, spec={}, spec_path=None,
                    environment=None, job_dir="/x", supervisor_pid=None, failed_rank=None)
    rec.processes = [
        ProcessRecord(1, "agent", "node-1", 1, None, None, 10, 0, None),  # an earlier attempt: not shown
        ProcessRecord(2, "agent", "node-0", 0, None, None, 20, None, None),
        ProcessRecord(2, "agent", "node-1", 1, None, None, 21, 137, None),
        ProcessRecord(2, "rank", "rank-0", 0, 0, 0, 22, None, None),
        ProcessRecord(2, "agent", "node-2", 2, None, None, 23, 0, None),
    ]
    view = node_view(rec, (1, 4), True)
    assert [(n.name, n.state, n.pid) for n in view.nodes] == [
        ("node-0", "running", 20), ("node-1", "lost", 21), ("node-2", "finished", 23), ("node-3", "starting", None)]
    assert view.lost == ["node-1"] and view.running == ["node-0"]
    assert view.to_json()["lost"] == ["node-1"] and view.to_json()["nodes"][1]["exit_code"] == 137
    # the same job once it has ended: nothing is lost any more (nothing could bring a node back); it was
    # "lost" for every failed, canceled or timed-out job's nodes
    rec.state = JobState.FAILED
    rec.processes[1] = ProcessRecord(2, "agent", "node-0", 0, None, None, 20, 3, None)
    ended = node_view(rec, (1, 4), True)
    assert [(n.name, n.state) for n in ended.nodes] == [
        ("node-0", "failed"), ("node-1", "stopped"), ("node-2", "finished"), ("node-3", "never started")]
    assert ended.lost == []
