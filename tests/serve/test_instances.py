"""Python model instances in their own processes (the model host of ``azulite serve --workers N``):
answers equal to in-process ones (numbers and BYTES through shared memory), and an instance process
that dies is started again and counted."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np

from azulite.serve import instances
from azulite.serve.dataplane import DataPlaneSettings, TritonDataPlane
from azulite.serve.types import InferRequest, InferTensor
from tests.serve.conftest import build_model_repository
from tests.serve.procs import children, cmdline


def _instance_pids() -> list[int]:
    """This process's instance processes (whichever of its threads started them)."""
    return [p for p in children(os.getpid()) if b"azulite.serve.instances" in cmdline(p)]


def test_instances_in_their_own_processes(tmp_path):
    root = build_model_repository(tmp_path, ("add_sub_py", "string_py"))
    before = set(_instance_pids())
    dp = TritonDataPlane(DataPlaneSettings(repository=root, instance_processes=True))

    async def run() -> None:
        try:
            await check()
        finally:
            await dp.shutdown(30)

    async def check() -> None:
        pids = [p for p in _instance_pids() if p not in before]
        assert len(pids) == 3  # add_sub_py has 2 instances, string_py 1
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        request = InferRequest("add_sub_py", [InferTensor("INPUT0", "FP32", (2, 16), x),
                                              InferTensor("INPUT1", "FP32", (2, 16), x)])
        out = {t.name: t.data for t in (await dp.infer(request)).outputs}
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * x)
        np.testing.assert_array_equal(out["OUTPUT1"], 0 * x)
        text = np.array([[b"ab", b"\xc3\xa9z"]], dtype=np.object_)
        strings = InferRequest("string_py", [InferTensor("TEXT", "BYTES", (1, 2), text)])
        out = {t.name: t.data for t in (await dp.infer(strings)).outputs}
        assert out["UPPER"].tolist() == [[b"AB", b"\xc3\xa9Z"]] and out["LENGTH"].tolist() == [[2, 3]]

        victim = next(p for p in pids if b"\0string_py\0" in cmdline(p))
        os.kill(victim, signal.SIGKILL)
        # until it can be reaped (every thread gone), without reaping it: the server's own check sees it dead
        await asyncio.to_thread(os.waitid, os.P_PID, victim, os.WEXITED | os.WNOWAIT)
        out = {t.name: t.data for t in (await dp.infer(strings)).outputs}
        assert out["LENGTH"].tolist() == [[2, 3]]
        assert sum(n for (model, _), n in instances.restarts.items() if model == "string_py") == 1

    asyncio.run(run())
    assert not [p for p in _instance_pids() if p not in before]  # every instance process finalized

