"""A small DDP training script that uses azulite.train the way a real one should.

Read top to bottom: start from the env contract, build the model, wrap everything durable as Stateful,
resume from the newest intact checkpoint, train with periodic async checkpoints, stop cleanly on
preemption, and end with ``final_params_sha256=<hex>`` so runs can be compared bit for bit.

The flags after "fault injection" exist for tests: they kill this process or pause it at an exact point.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from azulite import train
from azulite.errors import AzuliteError

LAYERS = [16, 64, 64, 1]
DATASET = 512
GLOBAL_BATCH = 16


def build_model() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(LAYERS, LAYERS[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(LAYERS) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def make_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)  # the data is fixed; only the order and noise use the RNGs
    x = torch.randn(DATASET, LAYERS[0], generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return x, y


def params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def pause_hook(specs: list[str] | None, pause_dir: str | None, rank: int):
    """--pause-at PHASE:STEP: at that checkpoint phase, write <pause-dir>/paused-PHASE-STEP-rankR and wait
    for <pause-dir>/go-PHASE-STEP (a test does something in between: kill us, stop the storage)."""
    if not specs:
        return None
    points = {(phase, int(step)) for phase, step in (s.split(":") for s in specs)}

    def hook(phase: str, step: int) -> None:
        if (phase, step) not in points:
            return
        Path(pause_dir, f"paused-{phase}-{step}-rank{rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 300
        while not Path(pause_dir, f"go-{phase}-{step}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    return hook


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="checkpoint URI: a directory or az://container/path")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="synchronous periodic saves")
    ap.add_argument("--on-save-error", default="continue", choices=["continue", "stop"])
    ap.add_argument("--out", help="write {'sha256', 'step', 'resumed_from'} here (rank 0)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (gives tests time to act)")
    # fault injection
    ap.add_argument("--kill-at", type=int, help="SIGKILL this process after finishing this step ...")
    ap.add_argument("--kill-rank", type=int, default=0, help="... on this rank ...")
    ap.add_argument("--kill-marker", help="... once: only if this file does not exist yet (it is created)")
    ap.add_argument("--pause-at", action="append", help="PHASE:STEP, PHASE in save_start, shards_written, before_manifest")
    ap.add_argument("--pause-dir")
    args = ap.parse_args()

    ctx = train.init(seed=0)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[rank{ctx.rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("azure").setLevel(logging.WARNING)  # the SDK logs every HTTP request at INFO

    model = build_model().to(ctx.device)
    ddp = DDP(model) if ctx.distributed else model
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=8, gamma=0.7)
    x, y = make_dataset()
    sampler = train.ResumableSampler(DATASET, ctx, seed=7)
    progress = train.Progress()

    ckpt = train.Checkpointer(
        train.CheckpointConfig(uri=args.ckpt, interval=args.interval, keep_last=args.keep_last,
                               async_save=not args.sync, on_save_error=args.on_save_error,
                               model_config={"layers": LAYERS}),
        ctx,
        state={"model": train.ModelState(ddp, opt), "sched": train.ObjectState(sched), "data": sampler,
               "progress": progress, "rng": train.RNGState(ctx)},
        phase_hook=pause_hook(args.pause_at, args.pause_dir, ctx.rank),
    )
    resumed_from = ckpt.load_latest()
    preemption = train.Preemption(ctx, scheduled_events=train.ScheduledEventsSettings.from_environ(os.environ)).install()

    per_rank = GLOBAL_BATCH // ctx.world_size
    while progress.step < args.steps:
        idx = torch.tensor(list(iter(sampler))[:per_rank])
        xb, yb = x[idx].to(ctx.device), y[idx].to(ctx.device)
        # every RNG the checkpoint carries is used, so a resume that lost one would diverge
        xb = xb + 0.01 * torch.randn_like(xb)
        weight = 1.0 + 0.1 * float(np.random.rand()) + 0.1 * random.random()
        loss = weight * torch.nn.functional.binary_cross_entropy_with_logits(ddp(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        sampler.advance(GLOBAL_BATCH)
        progress.step += 1
        progress.samples += GLOBAL_BATCH
        if ctx.is_main:
            print(f"step {progress.step} loss {loss.item():.6f}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)

        if args.kill_at == progress.step and ctx.rank == args.kill_rank:
            marker = Path(args.kill_marker) if args.kill_marker else None
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.write_text(str(progress.step))
                print(f"rank {ctx.rank} SIGKILL at step {progress.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        if preemption.should_stop():
            ckpt.save(progress.step, sync=True, raise_on_error=True)
            preemption.exit()
        ckpt.maybe_save(progress.step)

    ckpt.save(progress.step, sync=True, raise_on_error=True)  # the last one must be committed
    ckpt.close()
    sha = params_sha256(model)
    if ctx.is_main:
        print(f"final_params_sha256={sha}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"sha256": sha, "step": progress.step, "resumed_from": resumed_from}))
    preemption.uninstall()
    train.shutdown(ctx)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AzuliteError as e:  # a user's mistake or a storage failure: the message, not a traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
