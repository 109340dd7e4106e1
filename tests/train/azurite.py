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
        self._chosen = port is None  # a port chosen here may be chosen again if another process takes it
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
        chosen = self._chosen
        for attempt in range(3):  # a free port chosen here can be taken by another process before azurite binds
            if self._launch(binary, timeout):
                return self
            if not chosen or attempt == 2:
                break
            self.port = free_port()
        raise RuntimeError(f"azurite did not serve on port {self.port} within {timeout}s (another server holds it?)")

    def _launch(self, binary: str, timeout: float) -> bool:
        """Azurite started on ``self.port``: True once it listens there; False (stopped) when the port was
        taken (it exits with EADDRINUSE, or another process listens there)."""
        self.proc = subprocess.Popen(
            [binary, "--skipApiVersionCheck", "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
             "--location", str(self.location), "--silent", "--loose", *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode()[-2000:]
                if "EADDRINUSE" in err:
                    self.stop()
                    return False
                raise RuntimeError(f"azurite exited {self.proc.returncode}: {err}")
            owner = self._listener()
            if owner == "ours":
                return True
            if owner == "other":  # someone else's server took the port after it was chosen
                self.stop()
                return False
            time.sleep(0.1)  # polling the readiness condition, not synchronising on time
        self.stop()
        raise RuntimeError(f"azurite did not listen on port {self.port} within {timeout}s")

    def _listener(self) -> str | None:
        """Who listens on the port: "ours" (this azurite's process or a child of it), "other", or None."""
        import psutil

        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
            for proc in procs:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                       for c in proc.net_connections(kind="tcp")):
                    return "ours"
        except psutil.NoSuchProcess:
            return None  # exited: the poll above says why
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return "other"
        except OSError:
            return None

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
