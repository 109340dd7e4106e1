"""The launch backend boundary: one small base class, a registry, unsupported features as data.

A backend is chosen by name (``get_backend("local", settings)``); adding one (kubernetes, azureml) is one
new module with a ``@register_backend("name")`` class plus its entry in ``_BACKEND_MODULES``. Public
methods (``submit``, ``status``, ``list``, ``logs``, ``cancel``, ``preempt``) check support and wrap the
``_*_impl`` hooks, so checks and timing are written once here.
"""

from __future__ import annotations

import importlib
import re
import os
import logging
import time
from abc import ABC, abstractmethod
from enum import Enum
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Mapping, TypeVar

from azulite.errors import AzuliteError, LaunchError
from azulite.launch.records import JobRecord
from azulite.launch.settings import Settings

if TYPE_CHECKING:  # the job-spec models (pydantic, yaml) load where a spec is read, not with every backend
    from azulite.spec.job import JobSpec

log = logging.getLogger("azulite.launch")


class Feature(str, Enum):
    """What a job may ask for that not every backend can give."""

    PYTORCH = "pytorch"
    TENSORFLOW = "tensorflow"
    MPI = "mpi"
    SPOT = "spot"  # priority: spot (preemptible capacity)
    PREEMPT = "preempt"  # `job preempt`: simulate an eviction
    FOLLOW_LOGS = "follow_logs"
    MAX_RESTARTS = "max_restarts"  # in-job elastic restarts


def required_features(spec: JobSpec) -> set[Feature]:
    # a job without distribution is a plain command: every backend runs one
    need = {Feature(spec.distribution_type)} if spec.distribution is not None else set()
    if spec.priority == "spot":
        need.add(Feature.SPOT)
    if spec.max_restarts:
        need.add(Feature.MAX_RESTARTS)
    return need


class Backend(ABC):
    """Runs jobs somewhere. Subclasses set ``name`` (via the registry) and ``unsupported``, and
    implement the ``_*_impl`` hooks."""

    name: ClassVar[str] = ""
    #: features this backend cannot provide: a job needing one is refused at submit with a clear error
    unsupported: ClassVar[frozenset[Feature]] = frozenset()

    def __init__(self, settings: Settings, environ: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        #: the environment jobs inherit (the submitting shell's); read once, passed down
        self.environ: dict[str, str] = dict(os.environ if environ is None else environ)

    def check_supported(self, spec: JobSpec) -> None:
        missing = required_features(spec) & set(self.unsupported)
        if missing:
            raise LaunchError(
                f"the {self.name} backend does not support: {', '.join(sorted(f.value for f in missing))}",
                fix="choose another backend (AZULITE_BACKEND) or drop the feature from the spec",
            )

    def submit(self, spec: JobSpec, *, spec_path: str | None = None) -> JobRecord:
        self.check_supported(spec)
        t0 = time.perf_counter()
        rec = self._submit_impl(spec, spec_path=spec_path)
        log.info("%s: submitted %s in %.3fs", self.name, rec.id, time.perf_counter() - t0)
        return rec

    def status(self, job_id: str) -> JobRecord:
        return self._status_impl(job_id)

    def wait_for_change(self, rec: JobRecord, timeout_s: float) -> None:
        """Block up to ``timeout_s`` between two looks at a job (``job wait``, ``submit --wait``). Here a
        plain pause; a backend that can be woken by the job's end overrides it, so a waiter looks rarely
        and still sees the end when it happens."""
        time.sleep(timeout_s)

    def list(self, limit: int = 50) -> list[JobRecord]:
        return self._list_impl(limit)

    def logs(self, job_id: str, *, rank: int | None = None, follow: bool = False) -> Iterator[str]:
        if follow and Feature.FOLLOW_LOGS in self.unsupported:
            raise LaunchError(f"the {self.name} backend cannot follow logs", fix="drop --follow")
        return self._logs_impl(job_id, rank=rank, follow=follow)

    def cancel(self, job_id: str) -> JobRecord:
        return self._cancel_impl(job_id)

    def preempt(self, job_id: str) -> JobRecord:
        if Feature.PREEMPT in self.unsupported:
            raise LaunchError(f"the {self.name} backend cannot simulate a preemption")
        return self._preempt_impl(job_id)

    @abstractmethod
    def _submit_impl(self, spec: JobSpec, *, spec_path: str | None) -> JobRecord: ...

    @abstractmethod
    def _status_impl(self, job_id: str) -> JobRecord: ...

    @abstractmethod
    def _list_impl(self, limit: int) -> list[JobRecord]: ...

    @abstractmethod
    def _logs_impl(self, job_id: str, *, rank: int | None, follow: bool) -> Iterator[str]: ...

    @abstractmethod
    def _cancel_impl(self, job_id: str) -> JobRecord: ...

    def _preempt_impl(self, job_id: str) -> JobRecord:
        raise LaunchError(f"the {self.name} backend cannot simulate a preemption")


_REGISTRY: dict[str, type[Backend]] = {}
_BACKEND_MODULES = {
    "local": "azulite.launch.local.backend",
    "kubernetes": "azulite.launch.kubernetes",
    "azureml": "azulite.launch.azureml",
}
B = TypeVar("B", bound=type[Backend])


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator: ``@register_backend("local")``. Refuses a second backend under one name."""

    def deco(cls: B) -> B:
        if name in _REGISTRY:
            raise ValueError(f"a backend named {name!r} is already registered ({_REGISTRY[name].__name__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def restated(exc: AzuliteError, settings: Mapping[str, str]) -> AzuliteError:
    """A render error as a backend's user meets it: the render's flags (``--pvc``) named as the settings
    that give them to ``job submit`` (``AZULITE_K8S_PVC``), which has no such flags."""
    def swap(text: str | None) -> str | None:
        if text is None:
            return None
        # "pass --pvc CLAIM" -> "set AZULITE_K8S_PVC=CLAIM"; any other mention of a flag -> its setting's name
        text = re.sub(r"\bpass (--[a-z][a-z-]*) ([^\s,;)]+)",
                      lambda m: f"set {settings[m.group(1)]}={m.group(2)}" if m.group(1) in settings else m.group(0), text)
        return re.sub(r"(?<![\w-])(--[a-z][a-z-]*)\b", lambda m: settings.get(m.group(1), m.group(1)), text)

    exc.message, exc.where, exc.fix = swap(exc.message), swap(exc.where), swap(exc.fix)
    exc.args = (exc.message,)
    return exc


def available_backends() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BACKEND_MODULES))


def get_backend(name: str, settings: Settings, environ: Mapping[str, str] | None = None, *,
                where: str = "AZULITE_BACKEND") -> Backend:
    """The backend named ``name``; an unknown name is an error at ``where`` (what gave it: the environment
    variable, or a flag)."""
    if name not in _REGISTRY and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    if name not in _REGISTRY:
        raise AzuliteError(
            f"unknown launch backend {name!r}", where=where,
            fix=f"use one of: {', '.join(available_backends())}",
        )
    return _REGISTRY[name](settings, environ)
