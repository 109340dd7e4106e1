"""Pieces of the DLRM training loop: batches, optimizers, durable state, evaluation and metric logging.

Kept out of the script so the bare-TorchRec anchor of ``bench/dlrm.py`` and the tests build exactly the
same model, optimizer and batches.
"""

from __future__ import annotations

import logging
import math
import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from azulite.data.criteo import CAT_FEATURE_COUNT, CAT_FEATURE_NAMES
from azulite.data.criteo_stream import Rows

log = logging.getLogger(__name__)


_KEYS = list(CAT_FEATURE_NAMES)
#: batch size -> the KJT's lengths (one id per feature and row): the same every step, and never written to
_LENGTHS: dict[int, torch.Tensor] = {}


def to_batch(rows: Rows) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
    """(dense [B, 13], KeyedJaggedTensor of one id per feature and row, labels [B], weights [B])."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    b = len(rows.labels)
    lengths = _LENGTHS.get(b)
    if lengths is None:
        lengths = _LENGTHS[b] = torch.ones(CAT_FEATURE_COUNT * b, dtype=torch.int32)
    # KJT values are feature-major: all rows of cat_0, then all rows of cat_1, ...
    values = torch.from_numpy(np.ascontiguousarray(rows.sparse.T)).reshape(-1)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=_KEYS, values=values, lengths=lengths)
    return (torch.from_numpy(rows.dense), kjt, torch.from_numpy(rows.labels), torch.from_numpy(rows.weight))


def make_optimizer(model: torch.nn.Module, lr: float) -> Any:
    """One optimizer over both halves: the fused row-wise Adagrad TorchRec runs in backward on the
    sharded tables (set by :func:`fuse_embedding_optimizer` before sharding) and Adagrad on the dense part."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=lr))
    return CombinedOptimizer([model.fused_optimizer, dense])


def fuse_embedding_optimizer(model: torch.nn.Module, lr: float) -> None:
    """Row-wise Adagrad on the embedding tables, applied in backward (TorchRec's fused kernels: the
    tables' gradients are never materialized)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": lr})


class ShardedModelState(Stateful):
    """A DistributedModelParallel model and its CombinedOptimizer for the Checkpointer.

    ``azulite.train.ModelState`` goes through torch's ``get_state_dict``, which does not know DMP; DMP's
    own ``state_dict`` gives the plain model's keys with ShardedTensor tables (each rank writes its shards)
    and TorchRec's KeyedOptimizer gives the fused optimizer state keyed the same way. DCP loads in place."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"model": _local(self.model.state_dict()), "optim": _local(self.optimizer.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DCP loaded the tensors in place; load_state_dict also takes the non-tensor values (param groups)
        # and wants every key, so the tables this rank holds no part of come back from the model itself
        model = self.model.state_dict()
        model.update(state_dict["model"])
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(state_dict["optim"])


def _local(tree: Any) -> Any:
    """``tree`` without the ShardedTensors of which this rank holds no shard (a table_wise table that
    lives on another rank). DCP saves each tensor from the ranks that hold it, so nothing is lost; but a
    rank asking on load for a key it cannot hold makes DCP 2.13 take the checkpoint for a pre-2.4 one,
    and its old key scheme then misses every non-tensor value ("Missing key in checkpoint state_dict")."""
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()
                if not (hasattr(v, "local_shards") and not v.local_shards())}
    return tree


class ReaderState(Stateful):
    """The reader's position (epoch = its RNG state, file, byte offset, line and row numbers). Every rank
    holds the same position, stored once as a pickled blob."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def state_dict(self) -> dict[str, Any]:
        return {"pickle": pickle.dumps(self.reader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reader.load_state_dict(pickle.loads(state_dict["pickle"]))


#: environment variables that change how a rank computes: thread pools, allocators, the interpreter
_RUNTIME_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_", "GLIBC_", "LD_PRELOAD", "PYTHON",
                         "TORCH_", "ATEN_", "DNNL_", "ONEDNN_")


def runtime_settings() -> dict[str, Any]:
    """What, besides the code, sets a rank's speed: torch's intra- and inter-op threads, the interpreter's
    switch interval, the CPU affinity, the threads alive and the thread/allocator environment. The job
    and bench/dlrm_bare.py both report it, and bench/dlrm.py checks the two match."""
    import os
    import sys

    threads = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int) if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                threads.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "switch_interval_s": sys.getswitchinterval(),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "threads": threads,
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_RUNTIME_ENV_PREFIXES)}}


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


@torch.no_grad()
def evaluate(model: torch.nn.Module, reader: Any, *, limit_batches: int | None = None) -> dict[str, float]:
    """Held-out AUC (torchmetrics' exact BinaryAUROC, gathered over every rank) and log loss of the
    rows ``reader`` yields (its val split, one pass). Every rank must call it: the sharded forward and the
    gather are collectives."""
    from torchmetrics.classification import BinaryAUROC

    was_training = model.training
    model.eval()
    auroc = BinaryAUROC()
    loss_sum = torch.zeros(2, dtype=torch.float64)  # sum of BCE, rows
    n_batches = 0
    while limit_batches is None or n_batches < limit_batches:
        rows = reader.next_rows()
        if rows is None:
            break
        dense, kjt, labels, weight = to_batch(rows)
        logits = model(dense, kjt).squeeze(-1)
        keep = weight > 0
        if keep.any():
            auroc.update(torch.sigmoid(logits[keep]), labels[keep].long())
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        loss_sum += torch.stack([(bce * weight).sum().double(), weight.sum().double()])
        n_batches += 1
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    rows_seen = int(loss_sum[1].item())
    result = {"auc": float(auroc.compute()) if rows_seen else math.nan,
              "log_loss": float(loss_sum[0] / loss_sum[1]) if rows_seen else math.nan, "rows": rows_seen}
    model.train(was_training)
    return result


class MetricsSink:
    """Training metrics to the job's MLflow store from rank 0 through ``azulite.train.log_metrics`` (the
    process's one metrics writer: the checkpointer's figures go there too, and two writers of one SQLite
    store would contend); a failing store is logged once, never fatal."""

    def __init__(self, is_main: bool, environ: Any = None) -> None:
        self._environ = environ
        self._on = is_main
        if is_main:
            # the writer and its MLflow run start now, before training: the first contact with a store
            # takes about a second, which rank 0 would otherwise spend inside a step the others wait on
            from azulite.train.metrics import warm_up

            warm_up(environ)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self._on:
            return
        from azulite.errors import MetricsError
        from azulite.train.metrics import log_metrics

        try:
            log_metrics({k: float(v) for k, v in metrics.items()}, step=step, environ=self._environ)
        except MetricsError as e:  # the store is an observer, training goes on
            log.warning("metrics not logged (%s); they stay in the log only", e)
            self._on = False

    def close(self) -> None:
        """Wait (bounded) until every logged value is in the store."""
        if self._on:
            from azulite.train.metrics import flush

            flush()
