"""The listening flags of ``observe`` and ``dashboard`` (``serve``'s are tested in test_serve.py): a port out
of range, an address that does not resolve, a port another process holds and an address not this machine's
are errors naming the flag and a fix, exit 2, never a socket traceback."""

from __future__ import annotations

import socket
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.inprocess import exit_code

AZULITE = str(Path(sys.executable).parent / "azulite")


@pytest.mark.parametrize("command", ["observe", "dashboard"])
@pytest.mark.parametrize("args, said", [
    (["--port", "70000"], "--port: 70000 is not a port (0-65535)"),
    (["--port", "-1"], "--port: -1 is not a port (0-65535)"),
    (["--host", "not.a.host", "--port", "0"], "--host: cannot listen on 'not.a.host'"),
])
def test_bad_flags_are_named(command, args, said, capsys):
    assert exit_code(command, *args) == 2
    err = capsys.readouterr().err
    assert said in err and "fix:" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["observe", "dashboard"])
def test_a_taken_port_is_named(command, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        run = subprocess.run([AZULITE, command, "--port", str(port)], capture_output=True,
                             text=True, timeout=120, env=_env(tmp_path))
    assert run.returncode == 2, run.stderr
    assert f"--host 127.0.0.1 --port {port}: cannot listen on 127.0.0.1:{port}: Address already in use" in run.stderr
    assert "--port 0 picks any free port" in run.stderr and "Traceback" not in run.stderr


def test_an_address_not_of_this_machine_is_named(tmp_path):
    # TEST-NET-1 (RFC 5737): resolves, is never a local interface
    run = subprocess.run([AZULITE, "dashboard", "--host", "192.0.2.1", "--port", "0",
                          "--key", "k" * 16], capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    assert run.returncode == 2, run.stderr
    assert "--host 192.0.2.1 --port 0: cannot listen on 192.0.2.1:0: Cannot assign requested address" in run.stderr


def _env(tmp_path):
    return {**os.environ, "AZULITE_HOME": str(tmp_path)}


def test_observe_refuses_a_disk_path_that_is_not_there(capsys):
    # it was dropped from /metrics without a word
    assert exit_code("observe", "--port", "0", "--disk", "/", "--disk", "/no/such/mount") == 2
    assert "--disk: no folder '/no/such/mount' on this machine" in capsys.readouterr().err
