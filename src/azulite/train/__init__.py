"""azulite.train — what a training script imports.

    ctx = train.init()                                   # process group, device, seeds (env contract only)
    ckpt = train.Checkpointer(train.CheckpointConfig(uri=..., interval=50), ctx, state={...})
    ckpt.load_latest()                                   # newest checkpoint whose hashes verify, or None
    stop = train.Preemption(ctx).install()               # SIGTERM -> agree -> save -> exit 75
    train.log_metrics({"loss": loss.item()}, step=step)  # rank 0 -> the job's MLflow store

See README.md, "Checkpoints and resume", and tests/train/scripts/toy_train.py for a whole script.
"""

from __future__ import annotations

import importlib
from typing import Any

from azulite.contract import EXIT_PREEMPTED

# Names load their module on first use (PEP 562): `azulite job show` lists checkpoints through
# azulite.train.catalog without importing torch; a training script pays for torch when it touches init.
_WHERE = {
    "CheckpointConfig": "checkpoint_config", "Checkpointer": "checkpoint",
    "CheckpointInfo": "catalog", "list_checkpoints": "catalog",
    "DistEnv": "env", "TrainContext": "env", "init": "env", "seed_everything": "env", "shutdown": "env",
    "log_metrics": "metrics",
    "Preemption": "preempt", "ScheduledEventsSettings": "preempt", "ScheduledEventsWatcher": "preempt",
    "ModelState": "state", "ObjectState": "state", "Progress": "state", "ResumableSampler": "state",
    "RNGState": "state",
    "CheckpointStorage": "storage", "StorageSettings": "storage", "parse_uri": "storage",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'azulite.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"azulite.train.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "EXIT_PREEMPTED",
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointStorage",
    "Checkpointer",
    "DistEnv",
    "ModelState",
    "ObjectState",
    "Preemption",
    "Progress",
    "RNGState",
    "ResumableSampler",
    "ScheduledEventsSettings",
    "ScheduledEventsWatcher",
    "StorageSettings",
    "TrainContext",
    "init",
    "list_checkpoints",
    "log_metrics",
    "parse_uri",
    "seed_everything",
    "shutdown",
]
