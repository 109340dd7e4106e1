"""The anchor of bench/dlrm.py: a bare TorchRec training loop, launched with plain torchrun.

Same DLRM, same planner constraints and DDP settings, same fused row-wise Adagrad + dense Adagrad, same
batch size, on the same npy files — read the way TorchRec's own DLRM example reads its preprocessed Criteo
(whole arrays in memory, one slice per batch, hashing by modulo), with no checkpoints, no metrics and
no resumable reader. Prints ``bare_samples_per_s=<n>`` on rank 0, timed over the same window as
examples/dlrm/train.py's ``samples_per_s``: from the end of step ``--untimed_steps`` to the end of the last
step, on rank 0 (nothing before the window: process start, imports, planning, loading the arrays).

    torchrun --nproc-per-node 2 bench/dlrm_bare.py --dataset_path DIR --batch_size 256 ...

The ``--probe_*`` flags are bench/dlrm_probe.py's (one difference from the job at a time, or an A/B of one
inside this process); bench/dlrm.py's anchor runs with none of them.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import resource
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
    ap.add_argument("--sharding_types", default="table_wise,column_wise,data_parallel")
    ap.add_argument("--untimed_steps", type=int, default=10, help="steps before the clock starts (as train.py's)")
    # probes of the job's differences (bench/dlrm_probe.py), one at a time; bench/dlrm.py's anchor uses neither
    ap.add_argument("--probe_azulite_reader", action="store_true",
                    help="read the batches with azulite's streaming npy reader instead of arrays in memory")
    ap.add_argument("--probe_alternate_reader", type=int, default=0, metavar="N",
                    help="alternate blocks of N steps read from memory and through azulite's reader, and report "
                         "each kind's CPU per step (an A/B inside one process: both meet the same load)")
    ap.add_argument("--probe_alternate_stop", type=int, default=0, metavar="N",
                    help="alternate blocks of N steps without and with the job's preemption agreement (a MAX "
                         "all-reduce of one int every 10 steps, as azulite.train.Preemption.should_stop does)")
    ap.add_argument("--probe_alternate_none", type=int, default=0, metavar="N",
                    help="blocks of N steps alternating with no difference: what the alternation alone reads "
                         "(its bias and noise)")
    ap.add_argument("--probe_extra_gloo_group", action="store_true",
                    help="create a second, idle gloo process group, as the job's checkpointer does")
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
    constraints = {f"t_{n}": ParameterConstraints(sharding_types=args.sharding_types.split(","))
                   for n in names}
    sharders = [EmbeddingBagCollectionSharder()]
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=args.batch_size,
                                    constraints=constraints).collective_plan(model, sharders, dist.group.WORLD)
    model = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan, sharders=sharders,
                                     data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False,
                                                                                      find_unused_parameters=True))
    # alive (and its loop thread polling) until the end
    extra_groups = [dist.new_group(backend="gloo")] if args.probe_extra_gloo_group else []
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
    reader = None
    if args.probe_azulite_reader or args.probe_alternate_reader:
        from azulite.data.criteo_reader import open_reader

        reader = open_reader(args.dataset_path, split="train", rank=rank, world_size=world, batch_size=b,
                             num_embeddings_per_feature=[args.num_embeddings] * 26,
                             validation_permille=args.validation_permille, seed=0)
    lengths = torch.ones(26 * b, dtype=torch.int32)
    gc.collect()  # as examples/dlrm/train.py does before its steps
    gc.freeze()
    start = None
    block = args.probe_alternate_reader or args.probe_alternate_stop or args.probe_alternate_none
    use_reader = reader is not None
    kind = "reader" if args.probe_alternate_reader else "stop" if args.probe_alternate_stop else "none"
    # the blocks of an alternating probe: main thread CPU s, process CPU s, steps ("memory": the plain loop)
    alternate = {"memory": [0.0, 0.0, 0], "reader": [0.0, 0.0, 0], "stop": [0.0, 0.0, 0], "none": [0.0, 0.0, 0]}
    for step in range(steps):
        if step == args.untimed_steps:
            start, cpu_start, window_start = time.perf_counter(), time.process_time(), time.time()
            flt_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        probed = False
        if block:  # the probes only (a few bytecodes per step otherwise: the anchor is not slowed)
            probed = (step // block) % 2 == 1  # the block with the difference
            use_reader = probed if args.probe_alternate_reader else reader is not None
            t_thread, t_proc = time.thread_time(), time.process_time()
        if not use_reader:
            rows = slice(step * gb + rank * b, step * gb + (rank + 1) * b)
            d, s, y = dense[rows], sparse[rows], labels[rows]
        else:
            r = reader.next_rows()
            d, s, y = r.dense, r.sparse, r.labels
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=names, values=torch.from_numpy(np.ascontiguousarray(s.T)).reshape(-1), lengths=lengths)
        logits = model(torch.from_numpy(d), kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if block:
            if probed and args.probe_alternate_stop and step % 10 == 9:
                flag = torch.tensor([0], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                int(flag.item())
            if step >= args.untimed_steps:
                a = alternate[kind if probed else "memory"]
                a[0] += time.thread_time() - t_thread
                a[1] += time.process_time() - t_proc
                a[2] += 1
    end, cpu_end, window_end = time.perf_counter(), time.process_time(), time.time()
    flt_end = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # the job's report of its thread pools, switch interval, affinity and env, taken the same way (imported
    # after the window: nothing of azulite is in the bare loop's process while it is timed)
    from azulite.workloads.dlrm.loop import runtime_settings

    runtime = runtime_settings()
    timed = steps - args.untimed_steps
    cpu_ranks = [None] * world  # every rank's CPU per step (after the window), as train.py's result has
    dist.all_gather_object(cpu_ranks, round((cpu_end - cpu_start) * 1000 / timed, 3) if start is not None else None)
    if rank == 0 and start is not None:
        kinds = [ps.sharding_type for params in model.plan.plan.values() for ps in params.values()]
        counts = {k: kinds.count(k) for k in sorted(set(kinds))}
        print(f"bare_samples_per_s={timed * gb / (end - start):.1f} steps={steps} "
              f"cpu_ms_per_step={(cpu_end - cpu_start) * 1000 / timed:.3f} "
              f"sharding={json.dumps(counts, separators=(',', ':'))} "
              f"cpu_ms_per_step_ranks={json.dumps(cpu_ranks, separators=(',', ':'))} "
              f"minflt_per_step={(flt_end - flt_start) / timed:.1f}", flush=True)
        # the window in epoch seconds (for a probe outside the process) and the runtime settings
        extra = {"window_unix": [window_start, window_end], "runtime": runtime}
        if args.probe_alternate_reader or args.probe_alternate_stop or args.probe_alternate_none:
            extra["alternate_ms_per_step"] = {k: {"main_thread": round(v[0] * 1000 / v[2], 4),
                                                  "process": round(v[1] * 1000 / v[2], 4), "steps": v[2]}
                                              for k, v in alternate.items() if v[2]}
        print("bare_extra " + json.dumps(extra), flush=True)
    dist.barrier()
    del extra_groups
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
