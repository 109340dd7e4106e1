"""Async saves of replicated (DDP) state on every rank of a torchrun group, training moving on while each
save writes. From the second save on a rank copies only the tensors DCP has it write; every checkpoint must
still hold the values of its own step. Writes ``--out/rank-R.json`` with what each rank copied and whether
the checkpoints of steps 3 and 2 load back to the parameters they were saved with. Parameters and Adam
state are copied in the background while the next step runs (its ``opt.step()`` waits for the copy)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from azulite import train
from toy_train import params_sha256  # beside this script


def build() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters())
    return model, ddp, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = train.init(seed=0)
    model, ddp, opt = build()
    ddp(torch.randn(2, 128)).square().mean().backward()
    opt.step()
    progress = train.Progress()
    ck = train.Checkpointer(train.CheckpointConfig(uri=args.ckpt, keep_last=5), ctx,
                            {"model": train.ModelState(ddp, opt), "progress": progress})
    copied, saved = [], {}
    for step in (1, 2, 3):
        progress.step = step
        saved[step] = params_sha256(model)
        ck.save(step, sync=False)
        staged = ck._stager.copied  # white box: what this save copied (None: everything)
        copied.append(None if staged is None else sorted(staged))
        opt.zero_grad()  # training moves on while the save copies and writes (step() waits for the copy)
        ddp(torch.randn(2, 128)).square().mean().backward()
        opt.step()
        ck.wait()
    cache = ck._stager._cache or {}
    tensors = sorted(k for k, v in cache.items() if isinstance(v, torch.Tensor))
    ck.close()

    loaded = {}
    for step in (3, 2):
        fresh, fresh_ddp, fresh_opt = build()
        reader = train.Checkpointer(train.CheckpointConfig(uri=args.ckpt), ctx,
                                    {"model": train.ModelState(fresh_ddp, fresh_opt), "progress": train.Progress()})
        loaded[step] = reader.load_latest() == step and params_sha256(fresh) == saved[step]
        torch.distributed.barrier()
        if ctx.is_main:
            shutil.rmtree(Path(args.ckpt) / f"step-{step:08d}")
        torch.distributed.barrier()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank-{ctx.rank}.json").write_text(json.dumps({"copied": copied, "tensors": tensors,
                                                                        "loaded": loaded}))
    train.shutdown(ctx)


if __name__ == "__main__":
    main()
