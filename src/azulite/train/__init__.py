"""azulite.train — what a training script imports.

    ctx = train.init()                                   # process group, device, seeds (env contract only)
    ckpt = train.Checkpointer(train.CheckpointConfig(uri=..., interval=50), ctx, state={...})
    ckpt.load_latest()                                   # newest checkpoint whose hashes verify, or None
    stop = train.Preemption(ctx).install()               # SIGTERM -> agree -> save -> exit 75

See README.md, "Checkpoints and resume", and tests/train/scripts/toy_train.py for a whole script.
"""

from azulite.contract import EXIT_PREEMPTED
from azulite.train.checkpoint import (
    CheckpointConfig,
    CheckpointInfo,
    Checkpointer,
    list_checkpoints,
)
from azulite.train.env import DistEnv, TrainContext, init, seed_everything, shutdown
from azulite.train.preempt import Preemption, ScheduledEventsSettings, ScheduledEventsWatcher
from azulite.train.state import ModelState, ObjectState, Progress, ResumableSampler, RNGState
from azulite.train.storage import CheckpointStorage, StorageSettings, parse_uri

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
    "parse_uri",
    "seed_everything",
    "shutdown",
]
