"""Preemption by Azure scheduled events (instance metadata), against a small local HTTP server."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from azulite.train import Preemption, ScheduledEventsSettings, init, list_checkpoints


class MetadataServer:
    """Answers like http://169.254.169.254/metadata/scheduledevents: events appear when armed; requests
    without the ``Metadata: true`` header are refused, as the real service does."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                server.requests += 1
                if self.headers.get("Metadata") != "true" or not self.path.startswith("/metadata/scheduledevents"):
                    self.send_response(400)
                    self.end_headers()
                    return
                body = json.dumps({"DocumentIncarnation": len(server.events), "Events": server.events}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metadata/scheduledevents?api-version=2020-07-01"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def event(self, kind: str, resources: list[str]) -> None:
        self.events.append({"EventId": f"id-{len(self.events)}", "EventType": kind, "ResourceType": "VirtualMachine",
                            "Resources": resources, "EventStatus": "Scheduled", "NotBefore": "", "Description": "",
                            "EventSource": "Platform", "DurationInSeconds": -1})


@pytest.fixture
def metadata():
    server = MetadataServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def _wait(predicate, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_preempt_event_for_this_vm_stops_training(metadata):
    ctx = init({})
    settings = ScheduledEventsSettings(enabled=True, url=metadata.url, poll_s=0.1, resource="vm-1")
    preemption = Preemption(ctx, scheduled_events=settings, signals=()).install()
    try:
        assert _wait(lambda: metadata.requests >= 2)
        metadata.event("Freeze", ["vm-1"])  # a freeze does not stop the VM
        metadata.event("Preempt", ["vm-2"])  # another VM's eviction is not ours
        seen = metadata.requests
        assert _wait(lambda: metadata.requests >= seen + 3)
        assert not preemption.should_stop()
        metadata.event("Preempt", ["vm-1"])
        assert _wait(preemption.should_stop)
        assert preemption.reason == "scheduled event Preempt"
    finally:
        preemption.uninstall()


def test_unreachable_endpoint_does_not_stop_training(metadata):
    ctx = init({})
    url = metadata.url.replace("/metadata/", "/elsewhere/")  # answers 400
    preemption = Preemption(ctx, scheduled_events=ScheduledEventsSettings(enabled=True, url=url, poll_s=0.1),
                            signals=()).install()
    try:
        assert _wait(lambda: metadata.requests >= 3)
        assert not preemption.should_stop()
    finally:
        preemption.uninstall()


def test_settings_from_environ():
    s = ScheduledEventsSettings.from_environ({"AZULITE_SCHEDULED_EVENTS": "1", "AZULITE_SCHEDULED_EVENTS_URL": "http://x/y",
                                              "AZULITE_SCHEDULED_EVENTS_POLL_S": "0.5"})
    assert s.enabled and s.url == "http://x/y" and s.poll_s == 0.5
    assert not ScheduledEventsSettings.from_environ({}).enabled


@pytest.mark.slow
def test_scheduled_terminate_in_a_torchrun_job_commits_and_exits_75(runner, metadata, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = runner.start(["--ckpt", str(ckpt), "--steps", "400", "--interval", "4", "--step-sleep", "0.1"],
                        env={"AZULITE_SCHEDULED_EVENTS": "1", "AZULITE_SCHEDULED_EVENTS_URL": metadata.url,
                             "AZULITE_SCHEDULED_EVENTS_POLL_S": "0.2"})
    proc.wait_for(lambda text: "step 3 " in text)
    metadata.event("Terminate", ["any-vm"])
    res = proc.wait(timeout=180)
    # only rank 0 may have seen the event first: the all-reduce makes both ranks stop at the same step
    assert res.output.count("checkpoint committed, exiting 75") == 2, res.output[-4000:]
    assert "exitcode  : 75" in res.output, res.output  # torchrun reports its workers' 'preempted' exit code
    committed = [c.step for c in list_checkpoints(str(ckpt)) if c.committed]
    assert committed and 3 <= committed[-1] < 400
