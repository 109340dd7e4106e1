"""What one batch's crossing to an instance process costs, against the least a Python crossing can cost.

Measured from the server's own event loop (uvloop), one batch out at a time with the loop idle meanwhile,
as at concurrency 1: a batch of one request, x FP32 [1, 256] in, y FP32 [1, 256] out, to a model whose
execute holds the GIL for 1 ms in pure Python (gil_py, as bench/instance_wakeup.py loads it), both ways:

- ``azulite``: a :class:`~azulite.serve.instances.ProcessInstance` of the Python backend, driven by
  ``start_batch`` as the batcher drives it (the inputs packed into the shared-memory arena, a pickled header
  over the socketpair, the Python backend's request and response objects in the instance process, the
  answer read by the loop's reader callback);
- ``floor`` (the anchor): the least the same crossing can be in Python: a child process that spins the same
  1 ms, the 1 KB in and out through a memfd both map at fixed places, one byte over a socketpair each way,
  read by a reader callback of the same loop. No framework: what is left is the two wake-ups, the spin,
  and two 1 KB copies.

Per block of ``--batches`` batches: the median wall time of a batch from the send to the answer in the
loop, the loop thread's CPU per batch, and the instance process's CPU per batch (every thread's, from
/proc/PID/task/TID/schedstat: nanoseconds, where /proc/PID/stat counts 10 ms ticks). Blocks of the two
alternate, each side's order flipped every other block, so a change in the machine's load hits both. The
last line is one JSON object: the medians over blocks, ``azulite_over_floor`` and
``azulite_minus_floor_us`` (what azulite's crossing costs above the floor, per batch: the figure a cut of
its Python moves).

    python bench/instance_crossing.py [--blocks 6] [--batches 1000] [--nice N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from google.protobuf import text_format

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.instance_wakeup import CONFIG, GIL_PY  # noqa: E402 - gil_py as a process, as the serving bench runs it
from bench.server_procs import process_cpu_ns  # noqa: E402

ROWS, WIDTH = 1, 256

#: the floor's instance: the same 1 ms spin, x at offset 0 and y at 4096 of the memfd, a byte each way
FLOOR_CHILD = r'''
import mmap, os, sys, time
import numpy as np
fd, mfd = int(sys.argv[1]), int(sys.argv[2])
m = mmap.mmap(mfd, 1 << 16)
x = np.frombuffer(m, np.float32, 256, 0)
y = np.frombuffer(m, np.float32, 256, 4096)
while os.read(fd, 64):
    end = time.perf_counter() + 0.001
    while time.perf_counter() < end:
        pass
    y[:] = x
    os.write(fd, b"r")
'''


async def azulite_block(inst, n: int, value: float) -> dict:
    from azulite.serve.backends.base import WorkItem

    loop = asyncio.get_running_loop()
    x = np.full((ROWS, WIDTH), value, np.float32)
    walls = []
    cpu0, inst0 = time.thread_time_ns(), process_cpu_ns(inst._proc.pid)
    for _ in range(n):
        answer = loop.create_future()
        t0 = time.perf_counter_ns()
        inst.start_batch(loop, [WorkItem({"x": x}, None, ROWS)],
                         lambda outcome, error: answer.set_result((outcome, error)))
        outcome, error = await answer
        walls.append(time.perf_counter_ns() - t0)
        if error is not None:
            raise error
        if not np.array_equal(outcome[0][0]["y"], x):
            raise AssertionError("azulite's instance answered another array")
    return block_figures(walls, time.thread_time_ns() - cpu0, process_cpu_ns(inst._proc.pid) - inst0)


class Floor:
    """The floor's child process and the loop's end of it."""

    def __init__(self, loop) -> None:
        self.sock, theirs = socket.socketpair()
        mfd = os.memfd_create("azulite-bench-floor", os.MFD_CLOEXEC)
        os.ftruncate(mfd, 1 << 16)
        self.proc = subprocess.Popen([sys.executable, "-c", FLOOR_CHILD, str(theirs.fileno()), str(mfd)],
                                     pass_fds=[theirs.fileno(), mfd])
        theirs.close()
        self.map = mmap.mmap(mfd, 1 << 16)
        os.close(mfd)
        self.x = np.frombuffer(self.map, np.float32, WIDTH, 0)
        self.y = np.frombuffer(self.map, np.float32, WIDTH, 4096)
        self.sock.setblocking(False)
        self.loop = loop
        self.answer: asyncio.Future | None = None
        loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        os.read(self.sock.fileno(), 64)
        self.answer.set_result(self.y.copy().reshape(ROWS, WIDTH))  # type: ignore[union-attr]

    async def block(self, n: int, value: float) -> dict:
        x = np.full((ROWS, WIDTH), value, np.float32)
        walls = []
        cpu0, inst0 = time.thread_time_ns(), process_cpu_ns(self.proc.pid)
        for _ in range(n):
            self.answer = self.loop.create_future()
            t0 = time.perf_counter_ns()
            self.x[:] = x.reshape(-1)
            os.write(self.sock.fileno(), b"x")
            y = await self.answer
            walls.append(time.perf_counter_ns() - t0)
            if not np.array_equal(y, x):
                raise AssertionError("the floor's child answered another array")
        return block_figures(walls, time.thread_time_ns() - cpu0, process_cpu_ns(self.proc.pid) - inst0)

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()  # the child's read sees EOF
        self.proc.wait(30)


def block_figures(walls: list[int], loop_cpu_ns: int, instance_cpu_ns: float) -> dict:
    n = len(walls)
    return {"wall_p50_us": statistics.median(walls) / 1000, "loop_cpu_us": loop_cpu_ns / n / 1000,
            "instance_cpu_us": instance_cpu_ns / n / 1000}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--nice", type=int, help="both instance processes at this nice value (as the serving bench's "
                    "--instance-nice)")
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.batches < 1:
        ap.error("--blocks and --batches must be at least 1")
    sys.path.insert(0, str(ROOT / "src"))
    from azulite.serve import instances
    from azulite.serve.backends.base import LoadContext
    from azulite.serve.proto import model_config_pb2 as mc
    from azulite.serve.server import new_event_loop

    runs: dict[str, list[dict]] = {"azulite": [], "floor": []}
    with tempfile.TemporaryDirectory(prefix="azulite-bench-crossing-") as tmp:
        model_dir = Path(tmp) / "gil_py"
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "1" / "model.py").write_text(GIL_PY)
        config = text_format.Parse(CONFIG, mc.ModelConfig())
        loop = new_event_loop()
        # this checkout's code on both sides: the instance process imports azulite anew, from the path it inherits
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), before]))
        try:
            inst = instances.ProcessInstance("python", LoadContext("gil_py", 1, model_dir, model_dir / "1" / "model.py",
                                                                   config, "gil_py_0", 0))
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
        floor = Floor(loop)
        if args.nice is not None:
            for pid in (inst._proc.pid, floor.proc.pid):
                os.setpriority(os.PRIO_PROCESS, pid, args.nice)

        async def measure() -> None:
            await azulite_block(inst, 50, -1.0)  # warm-up: first batches, first page faults
            await floor.block(50, -1.0)
            for i in range(args.blocks):
                for side in (("azulite", "floor") if i % 2 == 0 else ("floor", "azulite")):
                    r = await (azulite_block(inst, args.batches, float(i)) if side == "azulite"
                               else floor.block(args.batches, float(i)))
                    runs[side].append(r)
                    print(f"block {i} {side:7s} " + "  ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)

        try:
            loop.run_until_complete(measure())
        finally:
            floor.close()
            inst.close()
            loop.close()
    medians = {side: {k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0]} for side, rs in runs.items()}
    result = {"bench": "instance_crossing", "blocks": args.blocks, "batches": args.batches, "nice": args.nice,
              "cores": len(os.sched_getaffinity(0)), "loadavg": [round(x, 2) for x in os.getloadavg()],
              "median": medians,
              "azulite_over_floor": {k: round(medians["azulite"][k] / medians["floor"][k], 3)
                                     for k in medians["floor"]},
              "azulite_minus_floor_us": {k: round(medians["azulite"][k] - medians["floor"][k], 1)
                                         for k in medians["floor"]}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
