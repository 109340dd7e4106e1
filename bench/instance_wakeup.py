"""What waking an instance process for a batch costs the server's event loop, with the instance process
as a normal task (the scheduler's default, what azulite runs) and as SCHED_BATCH (tried at stop 23: neutral
on the idle machine, not kept).

Two instance processes of one model whose execute holds the GIL for 1 ms (as bench/serving_workers.py's
gil_py), one set to SCHED_BATCH from here (``os.sched_setscheduler`` on its pid), driven from the
server's own loop (uvloop, ``ProcessInstance.start_batch``) in interleaved blocks. While a batch is out
the loop does the work a server does meanwhile (other requests' parsing and encoding): 20 µs chunks of
pure Python, one per loop pass, until the answer comes. Per block:

- ``start_batch_wall_us`` / ``start_batch_cpu_us``: wall and CPU time of the loop inside start_batch
  (the pack, the header, the sendmsg that wakes the instance). Wall far above CPU: the loop lost its
  core in there (a woken normal task preempts its waker; on a loaded machine other tasks do too, hence
  the interleaved blocks);
- ``loop_share``: the loop thread's CPU over the block's wall time (1.0: the loop never lost its core
  while an instance ran a batch; on 2 cores with both instance processes busy it cannot stay at 1);
- ``chunks_per_batch``: how much of that other work the loop got done per batch.

The last line is one JSON object: the medians over blocks per policy and batch/normal ratios.

    python bench/instance_wakeup.py [--blocks 6] [--batches 300]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from google.protobuf import text_format

ROOT = Path(__file__).resolve().parents[1]

GIL_PY = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        return [pb_utils.InferenceResponse(
                    [pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())]) for r in requests]
'''
CONFIG = '''
name: "gil_py"
backend: "python"
max_batch_size: 64
input [ { name: "x" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 256 ] } ]
parameters { key: "azulite_instance_process" value: { string_value: "true" } }
'''
CHUNK_NS = 20_000


def _chunk() -> None:
    end = time.perf_counter_ns() + CHUNK_NS
    while time.perf_counter_ns() < end:
        pass


async def block(inst, n: int) -> dict:
    from azulite.serve.backends.base import WorkItem

    loop = asyncio.get_running_loop()
    items = [WorkItem({"x": np.full((1, 256), i, np.float32)}, None, 1) for i in range(4)]
    in_wall = in_cpu = chunks = 0
    w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(n):
        answer = loop.create_future()
        a, b = time.perf_counter_ns(), time.thread_time_ns()
        inst.start_batch(loop, items, lambda outcome, error: answer.set_result(error))
        in_wall += time.perf_counter_ns() - a
        in_cpu += time.thread_time_ns() - b
        while not answer.done():  # the server's other work while the batch is out
            _chunk()
            chunks += 1
            await asyncio.sleep(0)
        if answer.result() is not None:
            raise answer.result()
    wall, cpu = time.perf_counter_ns() - w0, time.thread_time_ns() - c0
    return {"start_batch_wall_us": in_wall / n / 1000, "start_batch_cpu_us": in_cpu / n / 1000,
            "loop_share": cpu / wall, "chunks_per_batch": chunks / n}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--batches", type=int, default=300)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from azulite.serve import instances
    from azulite.serve.backends.base import LoadContext
    from azulite.serve.proto import model_config_pb2 as mc
    from azulite.serve.server import new_event_loop

    with tempfile.TemporaryDirectory(prefix="azulite-bench-wakeup-") as tmp:
        model_dir = Path(tmp) / "gil_py"
        (model_dir / "1").mkdir(parents=True)
        (model_dir / "1" / "model.py").write_text(GIL_PY)
        config = text_format.Parse(CONFIG, mc.ModelConfig())
        made = {}
        for policy in ("normal", "batch"):
            ctx = LoadContext("gil_py", 1, model_dir, model_dir / "1" / "model.py", config, f"gil_py_{policy}", 0)
            made[policy] = instances.ProcessInstance("python", ctx)
        os.sched_setscheduler(made["batch"]._proc.pid, os.SCHED_BATCH, os.sched_param(0))
        assert os.sched_getscheduler(made["normal"]._proc.pid) == os.SCHED_OTHER
        runs: dict[str, list[dict]] = {"normal": [], "batch": []}

        async def measure() -> None:
            for policy in made:  # warm-up: first batches, first page faults
                await block(made[policy], 20)
            for i in range(args.blocks):
                for policy in (("normal", "batch") if i % 2 == 0 else ("batch", "normal")):
                    r = await block(made[policy], args.batches)
                    runs[policy].append(r)
                    print(f"block {i} {policy:6s} " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)

        loop = new_event_loop()
        try:
            loop.run_until_complete(measure())
        finally:
            for inst in made.values():
                inst.close()
            loop.close()
    medians = {p: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for p, rs in runs.items()}
    ratio = {k: round(medians["batch"][k] / medians["normal"][k], 3) for k in medians["batch"]}
    print(json.dumps({"bench": "instance_wakeup", "blocks": args.blocks, "batches": args.batches,
                      "cores": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
                      "median": medians, "batch_over_normal": ratio}))


if __name__ == "__main__":
    main()
