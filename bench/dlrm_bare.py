"""The anchor of bench/dlrm.py: a bare TorchRec training loop, launched with plain torchrun.

Same DLRM, same planner constraints and DDP settings, same fused row-wise Adagrad + dense Adagrad, same
batch size, on the same npy files — read the way TorchRec's own DLRM example reads its preprocessed Criteo
(whole arrays in memory, one slice per batch, hashing by modulo), with no checkpoints, no metrics and
no resumable reader. Prints ``bare_samples_per_s=<n>`` on rank 0 (first step to last, as train.py).

    torchrun --nproc-per-node 2 bench/dlrm_bare.py --dataset_path DIR --batch_size 256 ...
"""

from __future__ import annotations

import argparse
import glob
import os
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset_path", required=True)
    ap.add_argument("--num_embeddings", type=int, default=1000)
    ap.add_argument("--embedding_dim", type=int, default=8)
    ap.add_argument("--dense_arch_layer_sizes", default="32,8")
    ap.add_argument("--over_arch_layer_sizes", default="32,1")
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--learning_rate", type=float, default=0.02)
    ap.add_argument("--validation_permille", type=int, default=100)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    names = [f"cat_{i}" for i in range(26)]
    tables = [EmbeddingBagConfig(name=f"t_{n}", embedding_dim=args.embedding_dim, num_embeddings=args.num_embeddings,
                                 feature_names=[n]) for n in names]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
                 dense_in_features=13, dense_arch_layer_sizes=[int(x) for x in args.dense_arch_layer_sizes.split(",")],
                 over_arch_layer_sizes=[int(x) for x in args.over_arch_layer_sizes.split(",")],
                 dense_device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": args.learning_rate})
    topology = Topology(world_size=world, local_world_size=world, compute_device="cpu", ddr_cap=4 * 1024**3)
    constraints = {f"t_{n}": ParameterConstraints(sharding_types=["table_wise", "column_wise", "data_parallel"])
                   for n in names}
    sharders = [EmbeddingBagCollectionSharder()]
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=args.batch_size,
                                    constraints=constraints).collective_plan(model, sharders, dist.group.WORLD)
    model = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan, sharders=sharders,
                                     data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False,
                                                                                      find_unused_parameters=True))
    opt = CombinedOptimizer([model.fused_optimizer, KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda ps: torch.optim.Adagrad(ps, lr=args.learning_rate))])

    # the training rows of every day, in memory (TorchRec's InMemoryBinaryCriteoIterDataPipe does the same)
    dense, sparse, labels = [], [], []
    for pre in sorted(p[: -len("_dense.npy")] for p in glob.glob(os.path.join(args.dataset_path, "*_dense.npy"))):
        d, s, y = (np.load(f"{pre}_{k}.npy") for k in ("dense", "sparse", "labels"))
        keep = np.arange(len(y)) % 1000 >= args.validation_permille
        dense.append(d[keep]), sparse.append(s[keep] % args.num_embeddings), labels.append(y[keep, 0])
    dense, sparse, labels = np.concatenate(dense), np.concatenate(sparse), np.concatenate(labels).astype(np.float32)
    b, gb = args.batch_size, args.batch_size * world
    steps = len(labels) // gb
    lengths = torch.ones(26 * b, dtype=torch.int32)
    start = None
    for step in range(steps):
        rows = slice(step * gb + rank * b, step * gb + (rank + 1) * b)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=names, values=torch.from_numpy(np.ascontiguousarray(sparse[rows].T)).reshape(-1), lengths=lengths)
        logits = model(torch.from_numpy(dense[rows]), kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels[rows]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if start is None:
            start = time.perf_counter()
    dist.barrier()
    if rank == 0:
        # like train.py: the clock starts at the first step (here: after it, so the bare loop is not
        # charged with the first step's one-time costs)
        print(f"bare_samples_per_s={(steps - 1) * gb / (time.perf_counter() - start):.1f} steps={steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
