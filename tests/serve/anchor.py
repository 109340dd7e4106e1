"""Real Triton (the anchors installer's tritonserver, Python backend only) on free loopback ports, for
tests that compare azulite's answers with Triton's own. Always stopped by the context that started it."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import tritonclient.http as httpclient

from azulite.launch.local.procs import free_ports

TRITONSERVER = Path(__file__).resolve().parents[2] / ".cache" / "anchors" / "bin" / "tritonserver"


@dataclass
class TritonProcess:
    http_url: str
    grpc_url: str
    metrics_url: str = ""


#: Triton's words when a port it was given was taken between free_ports() choosing it and its bind
_PORT_TAKEN = ("already in use", "Address already in use")


@contextmanager
def running_triton(repository: Path, log: Path, start_timeout_s: float = 180,
                   args: tuple[str, ...] = ()) -> Iterator[TritonProcess]:
    assert TRITONSERVER.exists(), "tritonserver missing: `make test` installs it (scripts/anchors.sh)"
    for attempt in range(3):  # free ports are chosen, then bound by another process: another may take one
        started = _start(repository, log, start_timeout_s, args)
        if started is not None:
            break
        assert attempt < 2, f"tritonserver found its ports taken three times:\n{log.read_text()[-3000:]}"
    proc, urls = started
    try:
        yield urls
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)


def _start(repository: Path, log: Path, start_timeout_s: float, args: tuple[str, ...]):
    """(process, urls) of a ready tritonserver; None when it exited because a port was taken."""
    http_port, grpc_port, metrics_port = free_ports(3)
    with log.open("w") as out:
        proc = subprocess.Popen([str(TRITONSERVER), f"--model-repository={repository}", "--http-address=127.0.0.1",
                                 "--grpc-address=127.0.0.1", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
                                 f"--metrics-port={metrics_port}", "--metrics-address=127.0.0.1",
                                 "--exit-timeout-secs=5", *args], stdout=out,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "COLUMNS": "120"})
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", connection_timeout=5)
        deadline = time.monotonic() + start_timeout_s  # a safety net: readiness is what is waited on
        while True:
            if proc.poll() is not None:
                text = log.read_text()
                if any(words in text for words in _PORT_TAKEN):
                    return None
                raise AssertionError(f"tritonserver exited ({proc.returncode}):\n{text[-3000:]}")
            try:
                if client.is_server_ready():
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            assert time.monotonic() < deadline, f"tritonserver not ready in {start_timeout_s} s"
            time.sleep(0.2)  # polling the readiness condition, not synchronising on time
        client.close()
    except BaseException:
        proc.kill()
        proc.wait(60)
        raise
    return proc, TritonProcess(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                               f"http://127.0.0.1:{metrics_port}/metrics")
