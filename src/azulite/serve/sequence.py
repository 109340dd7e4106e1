"""Sequence batching (``sequence_batching`` in a model's config), as Triton documents it: requests carry
a correlation ID (``sequence_id``, an integer or a string) and ``sequence_start`` / ``sequence_end``
flags (request parameters, over HTTP and gRPC alike). Per sequence, the server

- runs its requests one at a time, in arrival order (a per-sequence FIFO lock), so a model's state for
  the sequence is never touched by two executions at once;
- adds the control inputs the config asks for: CONTROL_SEQUENCE_START / END / READY (as the config's
  ``int32_false_true``, ``fp32_false_true`` or ``bool_false_true`` pair) and CONTROL_SEQUENCE_CORRID (in
  its ``data_type``);
- keeps implicit state (``state { input_name output_name ... }``): the state input is zeros at the start
  of a sequence (or ``initial_state`` zero data), then the model's last state output; the state output is
  never answered to the client;
- releases a sequence at its END request, or once idle longer than ``max_sequence_idle_microseconds``
  (Triton's default: 1 s); a request of a released or unknown sequence without START is refused, naming
  the sequence and why.

Both strategies keep these semantics. ``direct``: one request per execution. ``oldest``: the model's
batcher batches requests of different sequences (its ``max_queue_delay_microseconds`` and
``preferred_batch_size``, up to max_batch_size; batch_settings.BatcherSettings); a batch never holds two steps of
one sequence, since a sequence has one request in flight. ``max_candidate_sequences`` is not a limit here.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from azulite.errors import InvalidArgument
from azulite.serve import config as cfg
from azulite.serve.backends.base import Result, WorkItem
from azulite.serve.proto import model_config_pb2 as mc

_REMEMBER_EXPIRED = 4096  # released-by-timeout ids kept to say so in the error (bounded)

_K = mc.ModelSequenceBatching.Control


@dataclass(slots=True)
class _Sequence:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_ns: int = 0
    state: dict[str, np.ndarray] = field(default_factory=dict)


def _flag(value: Any, key: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"request parameter '{key}' must be a boolean, got {value!r}")
    return value


def _control_value(control, on: bool) -> np.ndarray:
    if control.int32_false_true:
        return np.array([control.int32_false_true[int(on)]], dtype=np.int32)
    if control.fp32_false_true:
        return np.array([control.fp32_false_true[int(on)]], dtype=np.float32)
    if control.bool_false_true:
        return np.array([control.bool_false_true[int(on)]], dtype=np.bool_)
    return np.array([int(on)], dtype=np.int32)


class Sequencer:
    """The live sequences of one loaded model."""

    def __init__(self, model_name: str, config: mc.ModelConfig) -> None:
        self.model = model_name
        sb = config.sequence_batching
        self.batched = config.max_batch_size > 0
        self.idle_ns = (sb.max_sequence_idle_microseconds or cfg.DEFAULT_SEQUENCE_IDLE_US) * 1000
        self.controls: list[tuple[str, Any]] = [(ci.name, c) for ci in sb.control_input for c in ci.control]
        self.states = list(sb.state)
        self.state_outputs = frozenset(s.output_name for s in self.states)
        self._live: dict[Any, _Sequence] = {}
        self._expired: OrderedDict[Any, None] = OrderedDict()
        self._swept_ns = 0

    def _initial_state(self) -> dict[str, np.ndarray]:
        out = {}
        for s in self.states:
            dims = list(s.initial_state[0].dims) if s.initial_state else list(s.dims)
            dtype = cfg.WIRE_TO_NUMPY[cfg.CONFIG_TO_WIRE[s.data_type]]
            array = np.zeros([max(d, 1) for d in dims], dtype=dtype)
            out[s.input_name] = array[None] if self.batched else array
        return out

    def _sweep(self, now: int) -> None:
        """Release sequences idle past the limit (at most every half limit: O(live) each time)."""
        if now - self._swept_ns < self.idle_ns // 2:
            return
        self._swept_ns = now
        for sid in [sid for sid, seq in self._live.items() if now - seq.last_ns > self.idle_ns
                    and not seq.lock.locked()]:
            del self._live[sid]
            self._expired[sid] = None
            if len(self._expired) > _REMEMBER_EXPIRED:
                self._expired.popitem(last=False)

    def _sequence_id(self, params: dict[str, Any]) -> Any:
        sid = params.get("sequence_id")
        if isinstance(sid, float) and sid >= 2**64:  # a JSON number past UINT64 parses as a float
            raise InvalidArgument(
                f"inference request to model '{self.model}': correlation ID (request parameter 'sequence_id') "
                f"{sid:.0f} is past the largest unsigned 64-bit integer",
                fix="use an ID in 1..18446744073709551615, or a string")
        if isinstance(sid, bool) or sid in (None, 0, "") or not isinstance(sid, (int, str, np.integer)):
            raise InvalidArgument(
                f"inference request to model '{self.model}' must specify a non-zero or non-empty correlation ID "
                f"(request parameter 'sequence_id'), got {_shown(sid)}", fix="set sequence_id on every request of a sequence")
        sid = int(sid) if isinstance(sid, np.integer) else sid
        if isinstance(sid, int) and not 0 < sid < 2**64:  # Triton's correlation IDs are UINT64 (or strings)
            raise InvalidArgument(
                f"inference request to model '{self.model}': correlation ID (request parameter 'sequence_id') "
                f"{sid} is not an unsigned 64-bit integer", fix="use an ID in 1..18446744073709551615, or a string")
        return sid

    async def run(self, params: dict[str, Any], item: WorkItem,
                  submit: Callable[[WorkItem], Awaitable[Result]]) -> Result:
        sid = self._sequence_id(params)
        if self.batched and item.batch_size != 1:  # one request is one step of one sequence (Triton's words)
            raise InvalidArgument(f"inference request to model '{self.model}' must specify batch-size 1 due to "
                                  f"requirements of sequence batcher, got {item.batch_size}",
                                  fix="send one step of one sequence per request: inputs with a leading dimension of 1")
        start = _flag(params.get("sequence_start"), "sequence_start")
        end = _flag(params.get("sequence_end"), "sequence_end")
        controls = self._control_inputs(sid, start, end)  # before any bookkeeping: it may refuse the id
        now = time.monotonic_ns()
        self._sweep(now)
        seq = self._live.get(sid)
        if seq is not None and not seq.lock.locked() and now - seq.last_ns > self.idle_ns:
            del self._live[sid]
            self._expired[sid] = None
            seq = None
        if seq is None:
            if not start:
                if sid in self._expired:
                    raise InvalidArgument(
                        f"sequence {sid!r} of model '{self.model}' was released after "
                        f"{self.idle_ns // 1000} us idle (max_sequence_idle_microseconds)",
                        fix="start it again with sequence_start, or send within the idle limit")
                raise InvalidArgument(
                    f"inference request for sequence {sid!r} to model '{self.model}' must specify the START flag "
                    "on the first request of the sequence", fix="set sequence_start on the sequence's first request")
            self._expired.pop(sid, None)
            seq = self._live[sid] = _Sequence(last_ns=now)
        async with seq.lock:
            if start:
                seq.state = self._initial_state()
            item.inputs.update(controls)
            item.inputs.update(seq.state)
            if item.outputs is not None and self.state_outputs:
                item.outputs = item.outputs | self.state_outputs
            try:
                result = await submit(item)
            finally:
                seq.last_ns = time.monotonic_ns()
                if end and self._live.get(sid) is seq:
                    del self._live[sid]
            if isinstance(result, dict):
                for s in self.states:
                    value = result.pop(s.output_name, None)
                    if value is not None:
                        seq.state[s.input_name] = np.asarray(value)
            return result

    def _control_inputs(self, sid: Any, start: bool, end: bool) -> dict[str, np.ndarray]:
        out = {}
        for name, control in self.controls:
            if control.kind == _K.CONTROL_SEQUENCE_START:
                value = _control_value(control, start)
            elif control.kind == _K.CONTROL_SEQUENCE_END:
                value = _control_value(control, end)
            elif control.kind == _K.CONTROL_SEQUENCE_READY:
                value = _control_value(control, True)
            elif control.kind == _K.CONTROL_SEQUENCE_CORRID:
                wire = cfg.CONFIG_TO_WIRE.get(control.data_type, "UINT64")
                if wire == "BYTES":
                    value = np.array([str(sid).encode()], dtype=np.object_)
                else:
                    if isinstance(sid, str):
                        raise InvalidArgument(f"model '{self.model}' takes integer correlation IDs "
                                              f"(its CORRID control is {wire}), got sequence_id {sid!r}")
                    dtype = cfg.WIRE_TO_NUMPY[wire]
                    if np.issubdtype(dtype, np.integer) and not np.iinfo(dtype).min <= sid <= np.iinfo(dtype).max:
                        raise InvalidArgument(f"model '{self.model}' takes correlation IDs its CORRID control ({wire}) "
                                              f"can hold, got sequence_id {sid}",
                                              fix=f"use an ID in 1..{np.iinfo(dtype).max}")
                    value = np.array([sid], dtype=dtype)
            else:
                continue
            out[name] = value[None] if self.batched else value
        return out


def _shown(value: Any) -> str:
    """A parameter as the client wrote it (JSON), not Python's repr."""
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
