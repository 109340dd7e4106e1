"""Everything that must survive a restart, as ``Stateful`` objects the Checkpointer saves through DCP.

A resumed run on CPU continues bitwise identically only if all of it round-trips: parameters and
optimizer state (through DCP's state-dict helpers, so DDP, FSDP2 and plain modules all work), the LR
scheduler, the step, the data position, and the RNG streams of torch, numpy and python.

Small python values are stored pickled into ``bytes``: DCP writes non-tensor values as opaque blobs,
and a single blob keeps DCP's key flattening away from tuples such as python's RNG state.
"""

from __future__ import annotations

import logging
import math
import pickle
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from azulite.errors import CheckpointUsageError
from azulite.train.env import TrainContext

log = logging.getLogger("azulite.train.checkpoint")

__all__ = ["ModelState", "ObjectState", "Progress", "RNGState", "ResumableSampler", "Stateful"]


class ModelState(Stateful):
    """A model and (optionally) its optimizer. DCP's helpers give each rank its own shards for FSDP2 and
    one deduplicated copy for DDP, and reshard on load when the world size changes."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        if not isinstance(model, torch.nn.Module):  # else a torch error deep inside the first save
            raise TypeError(f"ModelState(model, optimizer): model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ModelState(model, optimizer): optimizer must be a torch.optim.Optimizer or None, "
                            f"got {type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self._options = StateDictOptions(strict=True)

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            msd = get_state_dict(self.model, [], options=self._options)[0]
            return {"model": msd}
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._options)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer if self.optimizer is not None else [],
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optim", {}),
            options=self._options,
        )


class ObjectState(Stateful):
    """Any object with ``state_dict``/``load_state_dict`` of small python values (an LR scheduler, a
    ``torchdata`` StatefulDataLoader, a custom sampler), stored as one pickled blob."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"pickle": pickle.dumps(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(pickle.loads(state_dict["pickle"]))


class Progress(Stateful):
    """The training step (and the number of samples seen): the checkpoint's own clock."""

    def __init__(self, step: int = 0, samples: int = 0) -> None:
        self.step = step
        self.samples = samples

    def state_dict(self) -> dict[str, Any]:
        return {"pickle": pickle.dumps({"step": self.step, "samples": self.samples})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        values = pickle.loads(state_dict["pickle"])
        self.step, self.samples = int(values["step"]), int(values["samples"])


class RNGState(Stateful):
    """torch (CPU and, when present, this rank's CUDA device), numpy and python RNG streams of THIS rank.

    The key carries the rank, so every rank writes its own streams. On a different world size, a rank
    that has no saved streams keeps its seeded ones (the Checkpointer leaves it out of the load).
    """

    def __init__(self, ctx: TrainContext) -> None:
        self.rank = ctx.rank
        self.device = ctx.device

    @property
    def key(self) -> str:
        return f"rank{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        states: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        return {self.key: pickle.dumps(states)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = pickle.loads(state_dict[self.key])
        torch.set_rng_state(states["torch"])
        np.random.set_state(states["numpy"])
        random.setstate(states["python"])
        if "cuda" in states and self.device.type == "cuda":
            torch.cuda.set_rng_state(states["cuda"], self.device)


class ResumableSampler(torch.utils.data.Sampler[int], Stateful):
    """A distributed sampler that remembers how far into the epoch the job got.

    The position is global (samples consumed by all ranks this epoch), so it means the same thing after a
    restart on another world size. The training loop calls :meth:`advance` after each optimizer step
    with the global batch size; iterating starts from the saved position. Hand-written because
    ``torch.utils.data.DistributedSampler`` has no state; ``torchdata``'s StatefulDataLoader (which
    works here through :class:`ObjectState`) is heavier than the tests need.
    """

    def __init__(self, dataset_len: int, ctx: TrainContext, *, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(dataset_len, bool) or not hasattr(dataset_len, "__index__") or dataset_len < 0:
            raise TypeError(f"ResumableSampler: dataset_len must be a whole number >= 0, got {dataset_len!r}")
        if not isinstance(ctx, TrainContext):
            raise TypeError(f"ResumableSampler: ctx must be the TrainContext of azulite.train.init(), got "
                            f"{type(ctx).__name__}")
        self.dataset_len = int(dataset_len)
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed = 0  # global samples consumed in this epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        # rank r takes every world_size-th sample starting at r, from the global position on
        rest = order[self.consumed :]
        return iter(rest[self.rank :: self.world_size])

    def __len__(self) -> int:
        return math.ceil(max(self.dataset_len - self.consumed - self.rank, 0) / self.world_size)

    def advance(self, global_samples: int) -> None:
        """Record one step's worth of consumed samples; rolls over to the next epoch at the end."""
        self.consumed += global_samples
        if self.consumed >= self.dataset_len:
            self.epoch += 1
            self.consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return {"pickle": pickle.dumps({"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                                        "dataset_len": self.dataset_len})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        values = pickle.loads(state_dict["pickle"])
        saved_len = values.get("dataset_len")  # None: saved before it was recorded
        if saved_len is not None and saved_len != self.dataset_len:
            # the saved position and order are over another dataset: resumed, it yielded an empty epoch (or
            # indexes past the end) without a word
            raise CheckpointUsageError(
                f"the checkpoint's ResumableSampler was over {saved_len} samples; this script's has "
                f"{self.dataset_len}", where="ResumableSampler(dataset_len)",
                fix="resume with the dataset it was saved with, or train into a new checkpoint location")
        if values["seed"] != self.seed:
            log.warning("ResumableSampler: the checkpoint's seed %s replaces this script's %s (the saved order "
                        "goes on)", values["seed"], self.seed)
        self.epoch, self.consumed, self.seed = values["epoch"], values["consumed"], values["seed"]
