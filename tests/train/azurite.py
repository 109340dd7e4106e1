"""Start and stop a real Azurite (Azure Blob emulator) for tests: a free port, a temporary location.

``--skipApiVersionCheck`` is required: the current azure-storage-blob sends an API version Azurite does
not know yet and every call would fail (FIELD-NOTES). Installed by scripts/install.sh --dev into
.cache/node (npm ``azurite``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from azulite.launch.local.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "devstoreaccount1"
# Azurite's documented, public development key (not a secret).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_binary() -> str | None:
    local = ROOT / ".cache" / "node" / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    return shutil.which("azurite-blob")


def connection_string(port: int) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};")


class Azurite:
    def __init__(self, location: Path, port: int | None = None, args: tuple[str, ...] = ()) -> None:
        self.location = location
        self.port = port or free_port()
        self.args = args  # more azurite-blob flags (e.g. --cert/--key to serve TLS)
        self.proc: subprocess.Popen | None = None

    @property
    def connection_string(self) -> str:
        return connection_string(self.port)

    def start(self, timeout: float = 60) -> Azurite:
        binary = azurite_binary()
        if binary is None:
            raise RuntimeError("azurite-blob not found: run `bash scripts/install.sh --dev` (npm install azurite)")
        self.location.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--skipApiVersionCheck", "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
             "--location", str(self.location), "--silent", "--loose", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"azurite exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"azurite did not listen on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None


@contextmanager
def running(tmp_path_factory, name: str = "azurite") -> Iterator[Azurite]:
    """A started Azurite for a fixture, stopped after. Not installed is a failure that says how to
    install it, never a skip: `make test` installs it, and a skipped Blob test would hide a missing step."""
    if azurite_binary() is None:
        pytest.fail("azurite-blob is not installed: run scripts/install.sh --dev (make test does)")
    az = Azurite(tmp_path_factory.mktemp(name)).start()
    try:
        yield az
    finally:
        az.stop()
