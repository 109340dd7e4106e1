"""Run the toy training script under real torchrun on loopback, and always clean up after it."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from azulite.launch.local.procs import free_port, signal_all, tree

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "tests" / "train" / "scripts" / "toy_train.py"


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        # elastic restarts after kill -9 recover reliably only with a fresh store per round (FIELD-NOTES)
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT / "src"),
    )
    env.pop("AZURE_STORAGE_CONNECTION_STRING", None)
    env.update(extra or {})
    return env


def torchrun_cmd(args: Sequence[str], log_dir: Path, *, nproc: int = 2, max_restarts: int = 0,
                 script: Path = TOY) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1", f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.5",
        # torchrun's own folder (error files) in the test's folder: without it each run left a
        # torchelastic_* folder in /tmp, never removed
        f"--log-dir={log_dir / 'torchelastic'}",
        str(script), *args,
    ]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class Proc:
    """A torchrun (or single python) process in its own session, killed with its group on exit."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(log_dir.glob("out-*.log")))
        self.out_path, self.err_path = log_dir / f"out-{n}.log", log_dir / f"err-{n}.log"
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        # every process of this run carries the tag, so teardown finds workers even once orphaned
        self.tag = uuid.uuid4().hex
        env = {**env, "AZULITE_TEST_PROC_TAG": self.tag}
        self.popen = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=self._err, start_new_session=True,
                                      cwd=ROOT)

    def output(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.output()):
                return
            if self.popen.poll() is not None:
                raise AssertionError(f"process exited {self.popen.returncode} before the condition:\n{self.output()[-4000:]}")
            time.sleep(0.1)
        raise AssertionError(f"condition not met within {timeout}s:\n{self.output()[-4000:]}")

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill_group(self) -> None:
        """kill -9 of torchrun and every worker. torchrun starts each worker in its own session, so the
        process group is not enough: collect the whole tree first, then kill all of it."""
        everything = tree([self.popen.pid])
        signal_all(everything, signal.SIGKILL)
        psutil.wait_procs(everything, timeout=30)
        self.popen.wait(timeout=30)

    def wait(self, timeout: float = 240) -> Result:
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise AssertionError(f"timed out after {timeout}s:\n{self.output()[-4000:]}") from None
        finally:
            self.close()
        return Result(rc, self.out_path.read_text(), self.err_path.read_text())

    def close(self) -> None:
        if self.popen.poll() is None:
            self.kill_group()
        leftovers = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get("AZULITE_TEST_PROC_TAG") == self.tag:
                    p.kill()
                    leftovers.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        psutil.wait_procs(leftovers, timeout=30)
        self._out.close()
        self._err.close()


class Runner:
    """Starts processes for one test and kills whatever is left at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, args: Sequence[str], *, nproc: int = 2, max_restarts: int = 0,
              env: dict[str, str] | None = None, torchrun: bool = True, script: Path = TOY) -> Proc:
        if torchrun:
            cmd = torchrun_cmd(args, self.log_dir, nproc=nproc, max_restarts=max_restarts, script=script)
        else:
            cmd = [sys.executable, str(script), *args]
        proc = Proc(cmd, base_env(env), self.log_dir)
        self.procs.append(proc)
        return proc

    def run(self, args: Sequence[str], *, timeout: float = 240, **kw) -> Result:
        return self.start(args, **kw).wait(timeout=timeout)

    def cleanup(self) -> None:
        for p in self.procs:
            p.close()
