"""How and where a job checkpoints: :class:`CheckpointConfig`, validated when built. Apart from the
Checkpointer so a config is built and checked without importing torch."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from azulite.errors import CheckpointUsageError

__all__ = ["CheckpointConfig"]


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How and where a job checkpoints. Validated when built."""

    #: a local directory or ``az://container/path``
    uri: str
    #: save every ``interval`` steps in :meth:`Checkpointer.maybe_save` (0: only explicit saves)
    interval: int = 0
    #: keep the newest N committed checkpoints (>= 1)
    keep_last: int = 3
    #: also keep every checkpoint whose step is a multiple of K, forever (0: none)
    keep_every: int = 0
    #: periodic saves copy and write in the Checkpointer's thread; the step blocks only to take the state
    #: dicts and copy the buffers (see ``overlap_staging``)
    async_save: bool = True
    #: async saves copy parameters and optimizer state in the background while the next forward and
    #: backward run; the optimizer's next ``step()`` waits until the copy is done (a step pre-hook). Turn
    #: off when the loop changes parameters in place outside ``optimizer.step()`` (or call
    #: :meth:`Checkpointer.wait_staged` before it does)
    overlap_staging: bool = True
    #: writer threads per rank (files per rank); 2 doubles DCP's write bandwidth here
    thread_count: int = 2
    #: what a failed save does: "continue" logs it loudly and trains on (the previous checkpoint stays
    #: the one to resume from) until ``max_failed_saves`` in a row; "stop" raises CheckpointError
    on_save_error: Literal["continue", "stop"] = "continue"
    max_failed_saves: int = 3
    #: the model's config, written into every manifest so a resume can rebuild from files alone
    model_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "CheckpointConfig"
        for name, low in (("interval", 0), ("keep_last", 1), ("keep_every", 0), ("thread_count", 1),
                          ("max_failed_saves", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise CheckpointUsageError(f"{name}={value!r} must be an integer >= {low}", where=f"{where}.{name}",
                                           fix=f"e.g. {name}={max(low, 1)}")
        if self.on_save_error not in ("continue", "stop"):
            raise CheckpointUsageError(f"on_save_error={self.on_save_error!r} is not one of 'continue', 'stop'",
                                       where=f"{where}.on_save_error", fix="on_save_error='continue'")
        try:
            json.dumps(dict(self.model_config))
        except (TypeError, ValueError) as e:
            raise CheckpointUsageError(f"model_config is not JSON-serialisable: {e}", where=f"{where}.model_config",
                                       fix="pass plain numbers, strings, lists and dicts") from None
