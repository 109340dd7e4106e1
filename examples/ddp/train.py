"""PyTorch DDP training on CPU (gloo) that survives failures, driven only by the Azure ML env contract.

Every rank trains a small MLP on its share of a fixed synthetic regression data set; DDP all-reduces the
gradients, so all ranks end with bit-identical parameters. With ``--checkpoints DIR_OR_AZ_URI`` (the job
spec passes ``${{outputs.checkpoints}}``) it checkpoints every ``--checkpoint-every`` steps through
``azulite.train``, resumes from the newest intact checkpoint when restarted (elastic restart, requeue after
preemption), and on SIGTERM finishes the step, saves and exits 75 ("preempted"). A resumed run ends with
the same parameters as one that never stopped.

The last line printed by every rank is ``final_params_sha256=<hex>``: tests compare it across ranks and
across interrupted and uninterrupted runs.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from azulite import train
from azulite.errors import AzuliteError
from azulite.workloads import mlp

FEATURES = 16
HIDDEN = 32
DATASET = 4096


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default=None, help="rank 0 saves the final model.pt here")
    ap.add_argument("--checkpoints", default=None, help="checkpoint URI: a directory or az://container/path")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="steps between async checkpoints (0: none)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (demos, tests)")
    args = ap.parse_args()

    # process group (gloo, or nccl with a GPU per local rank), device and seeds from the env contract
    # (MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK set by the launcher: Azure ML, AKS or azulite)
    ctx = train.init(seed=0)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"[rank{ctx.rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("azure").setLevel(logging.WARNING)  # the Azure SDK logs every HTTP request at INFO
    print(f"rank {ctx.rank}/{ctx.world_size} node {os.environ.get('NODE_RANK', 0)} local_rank "
          f"{os.environ.get('LOCAL_RANK', 0)} pid {os.getpid()} cwd {os.getcwd()}", flush=True)

    # the model comes from an importable factory: the checkpoint records it (model_config), so
    # `azulite export` rebuilds the model from the checkpoint alone
    net = mlp.build_mlp(FEATURES, HIDDEN).to(ctx.device)
    # find_unused_parameters=True keeps DDP's gradient buckets in their initial layout: by default DDP
    # re-lays them out after the first step, so a resumed run's first step would sum each gradient over
    # 3+ ranks in another order than the uninterrupted run did, and the parameters would differ in the
    # last bit (with 2 ranks the order cannot matter)
    model = DDP(net, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                find_unused_parameters=True) if ctx.distributed else net
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    true_w = torch.randn(FEATURES, 1, generator=g)
    x_all = torch.randn(DATASET, FEATURES, generator=g)
    y_all = x_all @ true_w
    sampler = train.ResumableSampler(DATASET, ctx, seed=7)  # remembers its place in the epoch
    progress = train.Progress()

    ckpt = None
    if args.checkpoints:
        ckpt = train.Checkpointer(
            train.CheckpointConfig(uri=args.checkpoints, interval=args.checkpoint_every, keep_last=3,
                                   model_config=mlp.model_config(FEATURES, HIDDEN)),
            ctx,
            state={"model": train.ModelState(model, opt), "data": sampler, "progress": progress,
                   "rng": train.RNGState(ctx)},
        )
        resumed = ckpt.load_latest()
        if ctx.is_main:
            print(f"resumed from step {resumed}" if resumed is not None else "no checkpoint: starting fresh", flush=True)
    preemption = train.Preemption(ctx).install()  # SIGTERM: finish the step, save, exit 75

    global_batch = args.batch_size * ctx.world_size
    while progress.step < args.steps:
        t0 = time.perf_counter()
        idx = torch.tensor(list(iter(sampler))[: args.batch_size])
        x, y = x_all[idx].to(ctx.device), y_all[idx].to(ctx.device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sampler.advance(global_batch)
        progress.step += 1
        progress.samples += global_batch
        if ctx.is_main:
            # wall-clock stamp per step: bench/launch.py measures submit -> first step and time per step from it
            print(f"step {progress.step} loss {loss.item():.5f} step_s {time.perf_counter() - t0:.5f} "
                  f"t {time.time():.6f}", flush=True)
        if (args.checkpoint_every and progress.step % args.checkpoint_every == 0) or progress.step == args.steps:
            # to the job's MLflow store, from rank 0 (job show, sweeps); every checkpoint_every steps, so
            # the tracking store's cost stays off most steps
            train.log_metrics({"loss": loss.item()}, step=progress.step, batch_size=global_batch)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if preemption.should_stop():  # every rank agrees on the same step
            if ckpt is not None:
                ckpt.save(progress.step, sync=True, raise_on_error=True)
            preemption.exit()
        if ckpt is not None:
            ckpt.maybe_save(progress.step)

    if ckpt is not None:
        ckpt.save(progress.step, sync=True, raise_on_error=True)  # the final state is always committed
        ckpt.close()
    if ctx.is_main and args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(net.state_dict(), os.path.join(args.out, "model.pt"))
    digest = params_sha256(net)
    preemption.uninstall()
    # DDP's reducer holds the process group: drop it before the group goes, or gloo may abort at exit
    del model, opt
    train.shutdown(ctx)
    print(f"final_params_sha256={digest}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except AzuliteError as e:  # bad checkpoint URI, unreachable storage: the message, not a traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = train.exit_code(e)  # 78 for what no restart can fix: the job fails at once, not restarted
    # out of the except block the error's traceback, and with it main()'s model and DDP reducer, are gone:
    # the process group can go now rather than at interpreter teardown, where gloo aborts the process
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)
