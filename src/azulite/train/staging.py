"""Staging: an async save's own copy of the training state, taken while training goes on.

The Checkpointer (``checkpoint.py``) decides when to save; this module only copies. What is copied is
written by the commit protocol (``commit.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict


class CachedStager:
    """Copies the state into CPU buffers allocated once and reused by every async save.

    Tensors whose storage only an optimizer's ``step()`` changes (``deferrable``: parameters and
    optimizer state of optimizers that wait for staging in a step pre-hook) are copied by the save thread
    while training goes on to the next forward and backward, which only read them; the rest (buffers,
    which forward may change, and anything else) is copied before ``stage`` returns. ``stage`` returns
    the rest of the copy, for the save thread to run; ``copying`` is set once it is done. This is
    CheckFreq's pipelined snapshot
    (Mohan et al., FAST '21), and DCP's own ``StagingOptions(use_async_staging=True)`` minus the part
    that needs CUDA.

    DCP's own stager caches its buffers only in pinned memory, which a CPU-only torch cannot allocate;
    re-allocating ~GBs per save would cost far more than a memcpy. Safe because the Checkpointer never
    starts a save before the previous one finished writing.

    Replicated state (DDP: every rank holds all of it) is written once, each tensor by one rank, as DCP's
    deterministic de-duplication decides. So from the second save of the same state on, a rank copies only
    the tensors it wrote last time (``owned``) and hands the others to DCP as they are: with N ranks the
    step blocks for 1/N of the copy. The writer checks the plan against what was copied: a save that would
    write a tensor not copied fails (nothing is committed) rather than write one that training moves, and
    the next save copies everything again.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}
        self._keys: Any = None
        #: tensors (flat DCP names) this rank wrote in the last committed save of this structure
        self.owned: frozenset[str] | None = None
        #: tensors the last stage() copied; None: all of them
        self.copied: frozenset[str] | None = None
        #: storages (data_ptr) that only a waiting optimizer's step() changes; set before each save
        self.deferrable: frozenset[int] = frozenset()
        #: tensors the last stage() left to the background copy
        self.deferred: frozenset[str] = frozenset()
        #: set when the last stage()'s deferred copy is done (or failed); None: nothing was deferred
        self.copying: threading.Event | None = None

    def stage(self, state_dict: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        flat, mapping = flatten_state_dict(state_dict)
        keys = structure(flat)
        if keys != self._keys:
            self._cache, self._keys, self.owned = {}, keys, None
        owned = self.owned
        chosen = {k: v for k, v in flat.items() if owned is None or k in owned or not isinstance(v, torch.Tensor)}
        later = {k: v for k, v in chosen.items() if isinstance(v, torch.Tensor) and storage_ptr(v) in self.deferrable}
        staged = {**flat, **self._copy({k: v for k, v in chosen.items() if k not in later})}
        self.copied = None if owned is None else frozenset(k for k in chosen if isinstance(flat[k], torch.Tensor))
        self.deferred = frozenset(later)
        copying = self.copying = threading.Event() if later else None

        def finish() -> dict[str, Any]:
            if copying is not None:
                try:
                    staged.update(self._copy(later))
                finally:
                    copying.set()
            return unflatten_state_dict(staged, mapping)

        return finish

    def _copy(self, part: dict[str, Any]) -> dict[str, Any]:
        # buffers are made on first use, for every tensor eventually: the owned set may change
        missing = {k: v for k, v in part.items() if k not in self._cache}
        if missing:
            self._cache.update(_create_cpu_state_dict(missing))
        return _copy_state_dict(part, {k: self._cache[k] for k in part}, type_check=False)

    def close(self) -> None:
        self._cache, self._keys, self.copying = {}, None, None


def wait_staged_hook(checkpointer: Any) -> Callable[..., None]:
    """An optimizer step pre-hook that waits for the Checkpointer's background copy. It holds the
    Checkpointer weakly: an optimizer must not keep it (and its process group) alive until interpreter
    shutdown, where destroying a gloo group aborts the process."""
    ref = weakref.ref(checkpointer)

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        ck = ref()
        if ck is not None:
            ck.wait_staged()

    return hook


def updates_in_step(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of torch.optim's, which change parameters and state only in step()."""
    return isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).__module__.startswith("torch.optim.")


def storage_ptr(t: Any) -> int | None:
    """The address of the memory a tensor (a DTensor: its local shard) lives in; None when unknown."""
    try:
        local = t.to_local() if hasattr(t, "to_local") else t
        return int(local.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - a tensor subclass without storage: copied before stage() returns
        return None


def structure(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return tuple((k, structure(v)) for k, v in obj.items())
    if hasattr(obj, "shape"):
        return (tuple(obj.shape), str(obj.dtype))
    return type(obj).__name__
