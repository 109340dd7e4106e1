"""The env contract as a training script reads it: errors that name the variable and the fix."""

from __future__ import annotations

import pytest
import torch

from azulite.errors import LaunchError
from azulite.train import init
from azulite.train.env import DistEnv


@pytest.mark.parametrize(("environ", "says"), [
    ({"RANK": "one"}, "RANK='one' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "x"}, "MASTER_PORT='x' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 and WORLD_SIZE=2 are inconsistent"),
    ({"WORLD_SIZE": "0"}, "RANK=0 and WORLD_SIZE=0 are inconsistent"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "29500"}, "WORLD_SIZE=2 but MASTER_ADDR/MASTER_PORT are not set"),
])
def test_bad_environments_are_launch_errors_that_say_what_is_wrong(environ, says):
    with pytest.raises(LaunchError) as e:
        DistEnv.from_environ(environ)
    assert says in e.value.message and e.value.where == "environment" and "torchrun" in e.value.fix


def test_the_contract_is_read_as_typed_values():
    env = DistEnv.from_environ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.4",
                                "MASTER_PORT": "6000", "TORCHELASTIC_RESTART_COUNT": "2", "AZULITE_ATTEMPT": "3"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 4, 1, "10.0.0.4", 6000)
    assert (env.restart_count, env.attempt) == (2, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(LaunchError) as e:
        init({}, backend="nccl")
    assert "backend 'nccl' asked for but CUDA is not available" in e.value.message and "gloo" in e.value.fix


def test_a_process_that_called_init_skips_the_exit_collection_and_its_exit_handlers_still_run(tmp_path):
    """init() registers gc.freeze at exit, once: the exit handler registered before it (which runs after
    it) sees the heap frozen, one registered after it (which runs before it) still runs -- a rank's exit no
    longer walks torch's objects over and over (1.2-1.4 s of CPU a rank)."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('last', gc.get_freeze_count() > 0, flush=True))\n"
        "from azulite.train import init\n"
        "init({})\n"
        "n = atexit._ncallbacks()\n"
        "init({})\n"
        "print('registered again', atexit._ncallbacks() - n, flush=True)\n"
        "atexit.register(lambda: print('first', gc.get_freeze_count() > 0, flush=True))\n"
        "sys.exit(75)\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 75, p.stderr
    assert p.stdout.splitlines() == ["registered again 0", "first False", "last True"], p.stdout
