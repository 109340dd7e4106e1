"""TorchRec's DLRM on Criteo-format data, sharded across ranks, checkpointed and resumable: the seed's
``train_dlrm.py`` made real on CPU/gloo (and GPUs/NCCL when there are some).

The tables are placed by TorchRec's planner (table_wise / column_wise / data_parallel on CPU; row_wise too
on GPUs) within this machine's memory; the dense part is data-parallel. Checkpoints (``--checkpoints``)
hold the sharded tables, the fused optimizer state, the reader's position and every RNG, async every
``--checkpoint_every`` steps: a run killed (kill -9, elastic restart) or preempted (SIGTERM -> commit ->
exit 75 -> requeue) resumes and ends bitwise identical to one that never stopped. The manifest records the
model factory and the preprocessing, for export to serving.

The last line printed by every rank is ``final_params_sha256=<hex>`` (the same on every rank: a hash of
every rank's shards).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import math
import os
import resource
import sys
import time
import warnings

import torch
import torch.distributed as dist

from azulite import train
from azulite.data import criteo_reader, criteo_synth
from azulite.errors import AzuliteError, FlagError
from azulite.workloads.dlrm import loop, sharding
from azulite.workloads.dlrm.model import DLRMConfig, build_model

log = logging.getLogger("dlrm")


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset_path", required=True, help="Criteo TSV file(s) (plain or .gz) or day_N_*.npy folder")
    ap.add_argument("--num_embeddings_per_feature", type=int_list, required=True,
                    help="26 table sizes, comma-separated (one value: the same for all 26)")
    ap.add_argument("--embedding_dim", type=int, default=16)
    ap.add_argument("--dense_arch_layer_sizes", type=int_list, default=(64, 16))
    ap.add_argument("--over_arch_layer_sizes", type=int_list, default=(64, 32, 1))
    ap.add_argument("--batch_size", type=int, default=256, help="per rank")
    ap.add_argument("--learning_rate", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--limit_train_batches", type=int, default=0, help="steps per epoch at most (0: all)")
    ap.add_argument("--limit_val_batches", type=int, default=0, help="validation batches at most (0: all)")
    ap.add_argument("--validation_fraction", type=float, default=0.1,
                    help="rows held out for the final AUC: row i of each file when i %% 1000 < 1000 x this")
    ap.add_argument("--max_bad_lines_fraction", type=float, default=0.001)
    ap.add_argument("--sharding_types", default="", help="comma-separated subset the planner may choose from")
    ap.add_argument("--checkpoints", default=None, help="checkpoint URI: a directory or az://container/path")
    ap.add_argument("--checkpoint_every", type=int, default=50, help="steps between async checkpoints (0: none)")
    ap.add_argument("--log_every", type=int, default=20)
    ap.add_argument("--stop_check_every", type=int, default=10,
                    help="steps between the ranks' agreement on a preemption (an all-reduce; 1: every step)")
    ap.add_argument("--untimed_steps", type=int, default=10,
                    help="this run's first steps, left out of the final samples/s (one-time costs)")
    ap.add_argument("--out", default=None, help="rank 0 writes metrics.json here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step_sleep", type=float, default=0.0, help="seconds to sleep per step (demos, tests)")
    args = ap.parse_args(argv)
    if len(args.num_embeddings_per_feature) == 1:
        args.num_embeddings_per_feature = args.num_embeddings_per_feature * 26
    check_numbers(args)
    return args


#: every number flag (the model's shape is DLRMConfig's to check): (flag, lowest, example); floats: (flag,
#: range in words, the check, example).
#: Unchecked, --batch_size 0 was a ValueError traceback in the reader, -3 an AssertionError in TorchRec's
#: planner, --epochs 0 an untrained model committed and exported, --checkpoint_every -1 an error naming
#: CheckpointConfig.interval
_INT_FLAGS = (("batch_size", 1, 256), ("epochs", 1, 1), ("limit_train_batches", 0, 0), ("limit_val_batches", 0, 0),
              ("checkpoint_every", 0, 50), ("log_every", 0, 20), ("stop_check_every", 1, 10),
              ("untimed_steps", 0, 10), ("seed", 0, 0))
_FLOAT_FLAGS = (("learning_rate", "> 0", lambda v: v > 0, 0.05),
                ("validation_fraction", ">= 0 and < 1", lambda v: 0 <= v < 1, 0.1),
                ("max_bad_lines_fraction", ">= 0 and <= 1", lambda v: 0 <= v <= 1, 0.001),
                ("step_sleep", ">= 0", lambda v: v >= 0, 0.0))


def check_numbers(args: argparse.Namespace) -> None:
    """Every number flag in its range, named with the values it takes (exit 2, before anything starts)."""
    for name, low, example in _INT_FLAGS:
        value = getattr(args, name)
        if value < low:
            raise FlagError(f"must be an integer >= {low}, got {value}", where=f"--{name}",
                            fix=f"e.g. --{name} {example}")
    for name, what, ok, example in _FLOAT_FLAGS:
        value = getattr(args, name)
        if not (math.isfinite(value) and ok(value)):
            raise FlagError(f"must be a number {what}, got {value}", where=f"--{name}", fix=f"e.g. --{name} {example}")


def local_state_sha256(model: torch.nn.Module) -> str:
    """sha256 of this rank's part of the model: its table shards and the (replicated) dense weights."""
    h = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        if hasattr(value, "local_shards"):  # ShardedTensor: this rank's shards
            tensors = [s.tensor for s in value.local_shards()]
        elif hasattr(value, "to_local"):  # DTensor
            tensors = [value.to_local()]
        else:
            tensors = [value]
        for t in tensors:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # azulite's own INFO (checkpoint commits, resumes); TorchRec logs every kernel's arguments at INFO on
    # the root logger, and deprecation notices (ShardedTensor -> DTensor) are not the user's to act on
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[rank{os.environ.get('RANK', 0)}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("azulite").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True was specified.*")

    # every mistake a flag or the machine can reveal is named before any process group starts
    cfg = DLRMConfig(num_embeddings_per_feature=args.num_embeddings_per_feature, embedding_dim=args.embedding_dim,
                     dense_arch_layer_sizes=args.dense_arch_layer_sizes,
                     over_arch_layer_sizes=args.over_arch_layer_sizes)
    world_size = int(os.environ.get("WORLD_SIZE") or 1)
    per_rank_bytes = sharding.check_fits(cfg, world_size=world_size, ranks_here=sharding.ranks_on_this_host(os.environ))
    permille = round(args.validation_fraction * 1000)
    reader_kw = dict(world_size=world_size, batch_size=args.batch_size,
                     num_embeddings_per_feature=cfg.num_embeddings_per_feature, validation_permille=permille,
                     seed=args.seed, max_bad_fraction=args.max_bad_lines_fraction)
    # the data gives at least one step (the same on every rank): an empty dataset, or one of fewer rows than
    # a step, trained "successfully" into an untrained checkpoint that exported
    probe = criteo_reader.open_reader(args.dataset_path, split="train", rank=0, warn=False, **reader_kw)
    try:
        probe.next_rows()
    finally:
        probe.close()
    allowed = [t for t in args.sharding_types.split(",") if t] or None

    ctx = train.init(seed=args.seed)
    if not dist.is_initialized():
        # one process: TorchRec's DMP still wants a process group (of one); the checkpoints need none
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sharding.sharding_types(ctx.device, allowed)
    model = build_model(**cfg.kwargs(), device="meta")
    loop.fuse_embedding_optimizer(model, args.learning_rate)
    model = sharding.shard(model, pg=dist.group.WORLD, device=ctx.device,
                           world_size=ctx.world_size,
                           local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE") or ctx.world_size),
                           batch_size=args.batch_size, per_rank_bytes=per_rank_bytes, allowed=allowed)
    optimizer = loop.make_optimizer(model, args.learning_rate)
    plan = sharding.sharding_summary(model)
    plan_counts = {k: sum(v == k for v in plan.values()) for k in sorted(set(plan.values()))}
    if ctx.is_main:
        print(f"rank {ctx.rank}/{ctx.world_size}: DLRM with 26 tables ({sum(cfg.num_embeddings_per_feature):,} rows "
              f"x {cfg.embedding_dim}); sharding: " + ", ".join(f"{n} {k}" for k, n in plan_counts.items()),
              flush=True)

    reader_kw.update(rank=ctx.rank, world_size=ctx.world_size)
    reader = criteo_reader.open_reader(args.dataset_path, split="train", **reader_kw)
    progress = train.Progress()
    ckpt = None
    if args.checkpoints:
        ckpt = train.Checkpointer(
            train.CheckpointConfig(uri=args.checkpoints, interval=args.checkpoint_every, keep_last=3,
                                   model_config=cfg.model_config()),
            ctx,
            state={"model": loop.ShardedModelState(model, optimizer), "data": loop.ReaderState(reader),
                   "progress": progress, "rng": train.RNGState(ctx)},
        )
        resumed = ckpt.load_latest()
        if ctx.is_main:
            print(f"resumed from step {resumed}" if resumed is not None else "no checkpoint: starting fresh", flush=True)
    # the agreement is a collective every rank waits in: every step it would cost a few % of a step this
    # small; a stop is then acted on up to --stop_check_every steps later, well within the grace period
    preemption = train.Preemption(ctx, check_every=args.stop_check_every).install()
    sink = loop.MetricsSink(ctx.is_main)

    # imported before training, not at the first progress line: importing torchmetrics takes rank 0 a second
    # or more, which every other rank would spend waiting in that step's collectives
    from torchmetrics.functional.classification import binary_auroc

    global_batch = args.batch_size * ctx.world_size
    # rank 0's window of steps for the progress line: detached tensors only (no .item(), no sigmoid, no
    # sync per step); loss, sigmoid and AUROC are computed once per --log_every steps
    keep_window = bool(args.log_every) and ctx.is_main
    window_loss, window_logits, window_labels = [], [], []
    t_window, steps_window = time.perf_counter(), 0
    # samples/s: rank 0's clock from the end of this run's step --untimed_steps to the end of its last step
    # (and the CPU seconds this process spent in that window, all threads: a figure a busy machine blurs less)
    train_start, train_samples, run_steps = (time.perf_counter() if args.untimed_steps <= 0 else None), 0, 0
    cpu_start, window_unix = time.process_time(), [time.time()]  # the window in epoch seconds, for probes
    flt_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # Everything built so far (TorchRec, the planner's objects, MLflow's client and run, torchmetrics) lives
    # as long as the job: out of the collector's way, or the first young-generation collections in the
    # training steps walk the setup's survivors (rank 0: two gen-1 collections of ~13 ms each in a window of
    # 400 steps at load 20, then one of ~1.3 ms; the bare loop, with no MLflow or torchmetrics, had none)
    gc.collect()
    gc.freeze()
    model.train()
    while reader.epoch < args.epochs:
        if args.limit_train_batches and reader.chunks >= args.limit_train_batches:
            reader.end_epoch()
            continue
        rows = reader.next_rows()
        if rows is None:  # the end of an epoch: the reader moved on to the next
            continue
        dense, kjt, labels, _ = loop.to_batch(rows)
        logits = model(dense, kjt).squeeze(-1)
        loss = loop.loss_fn(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        progress.step += 1
        progress.samples += global_batch
        run_steps += 1
        if train_start is not None:
            train_samples += global_batch
        steps_window += 1
        if keep_window:
            window_loss.append(loss.detach())
            window_logits.append(logits.detach())
            window_labels.append(labels)
        if keep_window and progress.step % args.log_every == 0:
            dt = time.perf_counter() - t_window
            # validate_args=False: the labels are the reader's 0/1 and the scores sigmoids; torchmetrics'
            # checks of them cost ~8x the AUROC itself (measured over 20 x 256 rows: ~4 ms vs ~0.5 ms)
            metrics = {"train_loss": float(torch.stack(window_loss).double().mean()),
                       "train_auc": float(binary_auroc(torch.sigmoid(torch.cat(window_logits)),
                                                       torch.cat(window_labels).long(), validate_args=False)),
                       "samples_per_s": steps_window * global_batch / dt}
            limit = f"/{args.limit_train_batches}" if args.limit_train_batches else ""
            print(f"step {progress.step} epoch {reader.epoch + 1}/{args.epochs} batch {reader.chunks}{limit} "
                  f"loss {metrics['train_loss']:.4f} auc {metrics['train_auc']:.4f} "
                  f"samples/s {metrics['samples_per_s']:.0f}", flush=True)
            sink.log(metrics, progress.step)
            window_loss, window_logits, window_labels = [], [], []
            t_window, steps_window = time.perf_counter(), 0
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if preemption.should_stop():
            if ckpt is not None:
                ckpt.save(progress.step, sync=True, raise_on_error=True)
            sink.close()
            preemption.exit()
        if ckpt is not None:
            ckpt.maybe_save(progress.step)
        if run_steps == args.untimed_steps:
            train_start, cpu_start, window_unix = time.perf_counter(), time.process_time(), [time.time()]
            flt_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    train_s = time.perf_counter() - train_start if train_start is not None else 0.0
    window_unix.append(time.time())
    timed_steps = train_samples // global_batch
    cpu_ms_per_step = (time.process_time() - cpu_start) * 1000 / timed_steps if timed_steps else None
    # minor page faults per step in the window (all threads): the bench's sign of allocator churn
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt_start
    minflt_per_step = faults / timed_steps if timed_steps else None
    cpu_ms_ranks = [cpu_ms_per_step]
    if ctx.distributed:  # every rank's figure (after the timed window): the slowest rank sets the pace
        cpu_ms_ranks = [None] * ctx.world_size
        dist.all_gather_object(cpu_ms_ranks, cpu_ms_per_step)

    if ckpt is not None:
        ckpt.save(progress.step, sync=True, raise_on_error=True)  # the final state is always committed
    result: dict = {"steps": progress.step, "samples": progress.samples,
                    "samples_per_s": train_samples / train_s if train_s > 0 and train_samples else None,
                    "cpu_ms_per_step": cpu_ms_per_step, "cpu_ms_per_step_ranks": cpu_ms_ranks,
                    "minflt_per_step": minflt_per_step, "window_unix": window_unix,
                    "runtime": loop.runtime_settings(), "sharding": plan_counts}
    if permille:
        val = criteo_reader.open_reader(args.dataset_path, split="val", shuffle_files=False, **reader_kw)
        result.update({f"val_{k}": v for k, v in
                       loop.evaluate(model, val, limit_batches=args.limit_val_batches or None).items()})
        val.close()
        if ctx.is_main:
            best = criteo_synth.best_auc(args.dataset_path, permille)
            if best is not None:
                result["best_auc"] = best
            print(f"held-out AUC {result['val_auc']:.4f} (log loss {result['val_log_loss']:.4f}, "
                  f"{result['val_rows']} rows)" + (f"; best achievable AUC on these rows {best:.4f}" if best else ""),
                  flush=True)
            sink.log({k: v for k, v in result.items() if k in ("val_auc", "val_log_loss")}, progress.step)
    sink.close()
    if ctx.is_main:
        if result["samples_per_s"]:
            print(f"trained {progress.step} steps at {result['samples_per_s']:.0f} samples/s", flush=True)
        if ckpt is not None:
            print(f"checkpoint: {args.checkpoints.rstrip('/')}/step-{progress.step:08d}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "metrics.json"), "w") as f:
                json.dump(result, f, indent=1)
        print("result " + json.dumps(result), flush=True)
    if ckpt is not None:
        ckpt.close()
    reader.close()

    mine = local_state_sha256(model)
    hashes = [None] * ctx.world_size
    if ctx.distributed:
        dist.all_gather_object(hashes, mine)
    else:
        hashes = [mine]
    digest = hashlib.sha256("".join(hashes).encode()).hexdigest()
    preemption.uninstall()
    # Everything that holds the process group (DMP's sharded modules and DDP's reducer, the optimizer, the
    # checkpointer's view of both) goes before the group does: left to interpreter teardown, gloo aborted
    # there once in a test ("terminate called without an active exception", exit 134, after this rank had
    # printed its hash). The setup's objects were frozen out of the collector's way: unfrozen, so that
    # the collection frees the modules' reference cycles now rather than at exit.
    del model, optimizer, ckpt
    gc.unfreeze()
    gc.collect()
    train.shutdown(ctx)
    print(f"final_params_sha256={digest}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except AzuliteError as e:  # bad flags, data, storage: the message, not a traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = train.exit_code(e)  # 78 for what no restart can fix: the job fails at once, not restarted
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)
