"""Preemption: stop at a step every rank agrees on, commit a checkpoint, exit 'preempted' (75).

A stop request comes from SIGTERM (Kubernetes' termination grace, torchrun forwarding its own SIGTERM, a
spot eviction) or from Azure's scheduled-events endpoint announcing Preempt/Terminate for this VM. A
signal reaches ranks at different moments, so each rank only raises a local flag; :meth:`should_stop`
turns the flags into one decision with a tiny all-reduce (MAX of one integer) at the end of a step, so
all ranks stop after the same step, save that step synchronously, and exit together.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from azulite.contract import EXIT_PREEMPTED
from azulite.train.env import TrainContext

log = logging.getLogger("azulite.train.preempt")

SCHEDULED_EVENTS_URL = "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01"
#: scheduled-event types after which this VM stops running the job
STOPPING_EVENTS = frozenset({"Preempt", "Terminate"})


@dataclass(frozen=True, kw_only=True)
class ScheduledEventsSettings:
    """The Azure Instance Metadata scheduled-events watcher (off unless enabled)."""

    enabled: bool = False
    url: str = SCHEDULED_EVENTS_URL
    poll_s: float = 5.0
    #: only events naming this VM (its compute name) count; None: any Preempt/Terminate event
    resource: str | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ScheduledEventsSettings:
        enabled = environ.get("AZULITE_SCHEDULED_EVENTS", "").lower() in ("1", "true", "yes", "on")
        return cls(
            enabled=enabled,
            url=environ.get("AZULITE_SCHEDULED_EVENTS_URL") or SCHEDULED_EVENTS_URL,
            poll_s=float(environ.get("AZULITE_SCHEDULED_EVENTS_POLL_S") or 5.0),
            resource=environ.get("AZULITE_SCHEDULED_EVENTS_RESOURCE") or None,
        )


class ScheduledEventsWatcher:
    """Polls the scheduled-events endpoint in a daemon thread; calls ``on_event`` once on the first
    Preempt/Terminate event (for this VM when ``resource`` is set). Unreachable endpoints are logged once
    and retried: off Azure there is no metadata service, which must not stop training."""

    def __init__(self, settings: ScheduledEventsSettings, on_event: Callable[[dict[str, Any]], None]) -> None:
        self.settings = settings
        self.on_event = on_event
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="azulite-scheduled-events", daemon=True)
        self.fired: dict[str, Any] | None = None

    def start(self) -> ScheduledEventsWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.settings.poll_s + 5)

    def poll_once(self) -> dict[str, Any] | None:
        """One request; the first stopping event, or None."""
        req = urllib.request.Request(self.settings.url, headers={"Metadata": "true"})
        with urllib.request.urlopen(req, timeout=max(2.0, self.settings.poll_s)) as resp:
            body = json.loads(resp.read() or b"{}")
        for event in body.get("Events", []) or []:
            if event.get("EventType") not in STOPPING_EVENTS:
                continue
            resources = event.get("Resources") or []
            if self.settings.resource is None or self.settings.resource in resources:
                return event
        return None

    def _run(self) -> None:
        warned = False
        while not self._stop.is_set():
            try:
                event = self.poll_once()
            except Exception as e:  # noqa: BLE001 - the metadata service is best effort
                if not warned:
                    log.warning("scheduled events endpoint %s unreachable (%s); will keep trying",
                                self.settings.url, e)
                    warned = True
                event = None
            if event is not None:
                self.fired = event
                log.warning("scheduled event %s (%s) for %s: stopping after this step",
                            event.get("EventType"), event.get("EventId"), event.get("Resources"))
                self.on_event(event)
                return
            self._stop.wait(self.settings.poll_s)


class Preemption:
    """The stop flag of this rank and the agreement on it.

    Usage, at the end of every step (all ranks call it at the same step)::

        if preemption.should_stop():
            checkpointer.save(step, sync=True, raise_on_error=True)
            preemption.exit()
    """

    def __init__(
        self,
        ctx: TrainContext,
        *,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
        scheduled_events: ScheduledEventsSettings | None = None,
        check_every: int = 1,
    ) -> None:
        self.ctx = ctx
        self.signals = signals
        self.check_every = max(1, check_every)
        # A plain attribute, not a threading.Event: the SIGTERM handler writes it, and a handler may be
        # entered again by a second SIGTERM (a kubelet's and a user's; locally, before stop 39, three came)
        # while the first is inside Event.set() holding its non-reentrant lock: the rank then deadlocks
        # in its own handler and its peers wait in the next collective until torchrun SIGKILLs them all
        # (the CI hang of issue 9). A bool store is atomic under the GIL and needs no lock; nobody waits on
        # it (should_stop polls it).
        self._requested = False
        self.reason: str | None = None
        self._calls = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._watcher = (ScheduledEventsWatcher(scheduled_events, lambda ev: self.request(f"scheduled event {ev.get('EventType')}"))
                         if scheduled_events is not None and scheduled_events.enabled else None)

    def install(self) -> Preemption:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if self._watcher is not None:
            self._watcher.start()
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._watcher is not None:
            self._watcher.stop()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # runs between any two bytecodes of the main thread, and may itself be interrupted by the next
        # signal: no locks, no logging, nothing that waits (signal.Signals(n).name takes no lock)
        self.request(signal.Signals(signum).name)

    def request(self, reason: str) -> None:
        """Raise this rank's flag (from a signal handler, a watcher thread or the script). Lock-free and
        safe to re-enter: a concurrent second request may overwrite ``reason``, never block."""
        if not self._requested:
            self.reason = reason
            self._requested = True

    @property
    def requested(self) -> bool:
        """This rank's own flag (no agreement)."""
        return self._requested

    def should_stop(self) -> bool:
        """True on every rank when any rank was asked to stop. A collective every ``check_every`` calls."""
        self._calls += 1
        if self._calls % self.check_every:
            return False
        flag = 1 if self._requested else 0
        if self.ctx.distributed:
            t = torch.tensor([flag], dtype=torch.int32, device=self.ctx.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        if flag and not self._requested:
            self.request("another rank was asked to stop")
        return bool(flag)

    def exit(self) -> NoReturn:
        """Leave with the 'preempted' exit code (after the checkpoint is committed)."""
        log.warning("preempted (%s): checkpoint committed, exiting %d", self.reason, EXIT_PREEMPTED)
        self.uninstall()
        # committed: a repeated notice (the supervisor, the rank runner and torchrun each send one) must not
        # turn this exit 75 into a death by signal (143) while the process winds down -- and the handler
        # uninstall restored, or the interpreter's own at its finalization, would be SIG_DFL
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        if dist.is_initialized():
            dist.destroy_process_group()
        logging.shutdown()
        sys.stdout.flush()
        sys.exit(EXIT_PREEMPTED)
