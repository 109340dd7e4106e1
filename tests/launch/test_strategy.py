"""The launch-strategy seam: per-attempt context (dirs, env, substituted command), command argv, GPU split."""

from pathlib import Path

from azulite.launch.local.pytorch import gpu_split
from azulite.launch.local.strategy import command_argv, get_strategy
from azulite.launch.local.context import build_context
from azulite.spec.loader import load_job


def _spec(tmp_path: Path, extra: str = ""):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('hi')\n")
    (tmp_path / "job.yaml").write_text(
        "name: s\ncode: src\ncommand: python train.py --n ${{inputs.n}} --out ${{outputs.ckpt}}\n"
        "inputs: {n: 5}\noutputs: {ckpt: {type: uri_folder}}\ninstance_count: 2\n"
        "environment_variables: {FOO: bar}\ndistribution: {type: pytorch, process_count_per_instance: 2}\n" + extra
    )
    return load_job(tmp_path / "job.yaml")


def test_context_dirs_env_and_command(tmp_path):
    spec = _spec(tmp_path)
    job_dir = tmp_path / "home" / "jobs" / "s-1"
    (job_dir / "code").mkdir(parents=True)
    (job_dir / "code" / "train.py").write_text("x")
    environ = {"PATH": "/usr/bin:/venv/bin", "RANK": "7", "HOME": "/root", "TORCHELASTIC_RUN_ID": "x"}
    ctx = build_context("s-1", 2, spec, job_dir, environ, python="/venv/bin/python")
    assert ctx.command == f"python train.py --n 5 --out {job_dir / 'outputs' / 'ckpt'}"
    assert (job_dir / "outputs" / "ckpt").is_dir()
    assert [d.name for d in ctx.node_dirs] == ["node-0", "node-1"] and all((d / "train.py").exists() for d in ctx.node_dirs)
    env = ctx.base_env
    assert env["AZULITE_JOB_ID"] == "s-1" and env["AZULITE_ATTEMPT"] == "2" and env["FOO"] == "bar"
    assert env["PATH"] == "/venv/bin:/usr/bin" and env["PYTHONUNBUFFERED"] == "1"  # first, and once
    assert "RANK" not in env and "TORCHELASTIC_RUN_ID" not in env  # inherited ids would confuse the ranks
    assert env["AZULITE_OUTPUT_CKPT"] == str(job_dir / "outputs" / "ckpt")
    assert ctx.logs_dir.is_dir() and ctx.records_dir.is_dir() and ctx.attempt_dir.name == "attempt-2"

    procs = get_strategy("pytorch").processes(ctx)
    assert [p.name for p in procs] == ["node-0", "node-1"]
    for p in procs:
        argv = list(p.argv)
        assert argv[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
        assert "--nnodes=2" in argv and "--nproc-per-node=2" in argv and "--rdzv-backend=c10d" in argv
        assert "--rdzv-id=s-1-a2" in argv and "--max-restarts=0" in argv
        assert argv[argv.index("--") + 1 :][-6:] == ["python", "train.py", "--n", "5", "--out", str(job_dir / "outputs" / "ckpt")]
        assert p.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and p.env["GLOO_SOCKET_IFNAME"] == "lo"
    endpoints = {a for p in procs for a in p.argv if a.startswith("--rdzv-endpoint=127.0.0.1:")}
    assert len(endpoints) == 1  # one shared rendezvous


def test_command_argv_avoids_the_shell_for_simple_commands():
    assert command_argv("python train.py --lr 0.1") == ["python", "train.py", "--lr", "0.1"]
    assert command_argv("python a.py && python b.py")[:2] == ["/bin/sh", "-c"]
    assert command_argv("FOO=1 python a.py")[:2] == ["/bin/sh", "-c"]
    assert command_argv("python $HOME/a.py")[:2] == ["/bin/sh", "-c"]


def test_gpu_split_per_node():
    assert gpu_split((), 0, 2) is None
    assert gpu_split(("0", "1", "2", "3"), 1, 2) == "2,3"
    assert gpu_split(("0", "1"), 1, 2) == "0,1"  # fewer GPUs than asked: wrap around


def test_master_port_pins_a_pytorch_rendezvous_and_is_a_plain_variable_elsewhere(tmp_path):
    """It was taken out of every job's environment: a job without distribution (or mpi, tensorflow), which has
    no rendezvous, lost the variable without a word."""
    pinned = _spec(tmp_path, "").model_copy(update={"environment_variables": {"MASTER_PORT": "29555"}})
    ctx = build_context("s-1", 1, pinned, tmp_path / "j", {"PATH": "/usr/bin"}, make_dirs=False)
    assert ctx.rdzv_port == 29555 and "MASTER_PORT" not in ctx.base_env  # torchrun's --rdzv-endpoint
    plain = pinned.model_copy(update={"distribution": None})
    ctx = build_context("s-1", 1, plain, tmp_path / "j", {"PATH": "/usr/bin", "MASTER_PORT": "1"}, make_dirs=False)
    assert ctx.rdzv_port is None and ctx.base_env["MASTER_PORT"] == "29555"  # the spec's, not the shell's
