"""A stand-in for an MPIJob's pods on this machine: each "worker pod" is ``pod_mpi.py worker`` around its own
sshd on a loopback address of its own (127.0.0.2, 127.0.0.3: Open MPI takes them for other hosts and reaches
them through ssh, as mpirun reaches the operator's workers), with a key pair and the operator's hostfile;
the launcher runs with the variables the operator sets (the hostfile) and the ssh options a test needs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from azulite.deploy import pod_entry, pod_mpi
from azulite.launch.local.procs import free_port

POD_MPI = pod_mpi.__file__
SSHD = "/usr/sbin/sshd"


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    proc.wait()


class Cluster:
    """Two worker pods and a launcher pod on loopback, torn down whatever the test does."""

    def __init__(self, tmp: Path, slots: int = 1) -> None:
        self.tmp, self.port = tmp, free_port()
        self.procs: list[subprocess.Popen] = []
        keys = tmp / "keys"
        keys.mkdir(parents=True)
        for name in ("host", "id"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
        (keys / "authorized_keys").write_text((keys / "id.pub").read_text())
        os.chmod(keys / "authorized_keys", 0o600)
        self.config = tmp / "sshd_config"
        self.config.write_text(f"HostKey {keys / 'host'}\nAuthorizedKeysFile {keys / 'authorized_keys'}\n"
                               "PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\n"
                               "UsePAM no\nPidFile none\n")
        try:
            Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        except PermissionError:
            pytest.skip("sshd needs /run/sshd, its privilege separation directory: create it as root")
        self.hosts = ["127.0.0.2", "127.0.0.3"]
        (tmp / "hostfile").write_text("".join(f"{h} slots={slots}\n" for h in self.hosts))
        self.ssh_args = (f"-p {self.port} -i {keys / 'id'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                         f"-o BatchMode=yes -o LogLevel=ERROR")
        self.workers: dict[int, subprocess.Popen] = {}

    def marks(self, i: int) -> Path:
        return self.tmp / f"marks-{i}"

    def sshd(self, i: int) -> list[str]:
        """Worker ``i``'s sshd in the foreground, on its own address; the pod's marks folder reaches the
        ranks as the default path reaches them in a pod (here through sshd's SetEnv)."""
        return [SSHD, "-D", "-e", "-f", str(self.config), "-o", f"ListenAddress={self.hosts[i]}:{self.port}",
                "-o", f"SetEnv={pod_entry.ENV_MARKS}={self.marks(i)}"]

    def start_worker(self, i: int, argv: list[str] | None = None) -> subprocess.Popen:
        """Worker pod ``i``: the agent around sshd (``argv``: the rendered command, mapped to this machine)."""
        argv = argv or [sys.executable, POD_MPI, "worker", "--marks", str(self.marks(i)), "--", *self.sshd(i)]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        self.workers[i] = p
        return p

    def launcher_env(self, **extra: str) -> dict[str, str]:
        """The launcher's environment: the operator's hostfile variable, the launcher's IP (the downward
        API's), and what reaching sshd on loopback needs (the operator's rsh args are only
        ``-o ConnectionAttempts=10``: its images take port 22 and the mounted key)."""
        return {**os.environ, pod_mpi.ENV_HOSTFILE: str(self.tmp / "hostfile"), pod_mpi.ENV_POD_IP: "127.0.0.1",
                "OMPI_MCA_plm_rsh_args": self.ssh_args, "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_btl": "self,tcp", "OMPI_MCA_btl_tcp_if_include": "lo",
                **extra}

    def start_launcher(self, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p)
