"""Minimal PyTorch DDP training on CPU (gloo), driven only by the Azure ML env contract.

Every rank trains a tiny MLP on its own shard of a synthetic regression problem; DDP all-reduces the
gradients, so all ranks must end with bit-identical parameters. The last line printed (by every rank) is
``final_params_sha256=<hex>``: the test compares it across ranks.
"""

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    # the env contract: MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK set by the launcher (Azure ML or azulite).
    # nccl when this node has a GPU per process (the launcher splits CUDA_VISIBLE_DEVICES per node), else gloo
    node, local = int(os.environ.get("NODE_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} node {node} local_rank {local} pid {os.getpid()} cwd {os.getcwd()}", flush=True)

    torch.manual_seed(0)  # same init everywhere (DDP also broadcasts rank 0's parameters)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    model = DDP(net, device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)).to(device)
    data_gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard

    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = torch.randn(args.batch_size, 16, generator=data_gen).to(device)
        y = x @ true_w
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            # wall-clock stamp per step: bench/launch.py measures submit -> first step and time per step from it
            print(f"step {step} loss {loss.item():.5f} step_s {time.perf_counter() - t0:.5f} t {time.time():.6f}", flush=True)

    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
    digest = params_sha256(model.module)
    dist.barrier()
    # DDP's reducer holds the process group: drop it before destroying the group, or gloo may abort at exit
    del model, opt
    dist.destroy_process_group()
    print(f"final_params_sha256={digest}", flush=True)


if __name__ == "__main__":
    main()
