"""azulite.train — what a training script imports.

    ctx = train.init()                                   # process group, device, seeds (env contract only)
    ckpt = train.Checkpointer(train.CheckpointConfig(uri=..., interval=50), ctx, state={...})
    ckpt.load_latest()                                   # newest checkpoint whose hashes verify, or None
    stop = train.Preemption(ctx).install()               # SIGTERM -> agree -> save -> exit 75
    train.log_metrics({"loss": loss.item()}, step=step)  # rank 0 -> the job's MLflow store
    except AzuliteError as e: sys.exit(train.exit_code(e))  # 78 for a bad URI, no credentials: not restarted

See README.md, "Checkpoints and resume", and tests/train/scripts/toy_train.py for a whole script.
"""

from __future__ import annotations

import importlib
from typing import Any

from azulite.contract import EXIT_CONFIG, EXIT_PREEMPTED

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


def exit_code(error: BaseException) -> int:
    """What a training script exits with after catching ``error``: ``EXIT_CONFIG`` (78) for an azulite
    error no restart can fix (a bad URI, no credentials, a bad spec: ``AzuliteError.permanent``), so the
    launcher fails the job at once instead of restarting it into the same error; else the error's own
    ``exit_code`` (1 for storage that is down, a checkpoint that cannot be read)."""
    if getattr(error, "permanent", False):
        return EXIT_CONFIG
    return int(getattr(error, "exit_code", 1))


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "EXIT_CONFIG",
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
    "exit_code",
    "init",
    "list_checkpoints",
    "log_metrics",
    "parse_uri",
    "seed_everything",
    "shutdown",
]
