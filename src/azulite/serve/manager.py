"""Model lifecycle over a repository: load, unload, reload on change, with Triton's model control modes.

- ``none``: every model in the repository is loaded at start; the load/unload API is refused.
- ``explicit``: only ``load_models`` at start (``"*"``: all); the load/unload API drives the rest.
- ``poll``: like ``none`` at start, then :meth:`ModelManager.poll` reloads changed models, loads new
  ones and unloads removed ones.

One model failing to load is recorded on that model (state UNAVAILABLE with the reason, shown in the
repository index) and never stops the others. A reload builds the new versions first and swaps them in
atomically; the old ones drain and are finalized after the swap, so serving never pauses.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from azulite.errors import InvalidArgument, ModelLoadError, ModelNotReady, NotFound, ServeError, Unavailable
from azulite.serve import config as cfg
from azulite.serve import instances
from azulite.serve import repository as repo
from azulite.serve.backends.base import LoadContext, get_backend
from azulite.serve.batch_settings import BatcherSettings
from azulite.serve.batcher import Batcher
from azulite.serve.ensemble import check_ensemble, mark_decoupled
from azulite.serve.drift import window_of
from azulite.serve.fallback import policy_of
from azulite.serve.models import READY, UNAVAILABLE, LoadedModel, ModelEntry, VersionState
from azulite.serve.proto import model_config_pb2 as mc
from azulite.serve.stats import ModelStats
from azulite.serve.warmup import warm_up

ControlMode = Literal["none", "explicit", "poll"]
log = logging.getLogger("azulite.serve")
poll_log = logging.getLogger("azulite.serve.poll")  # `azulite serve` shows its INFO lines: what poll mode did


@dataclass(frozen=True, slots=True, kw_only=True)
class ManagerSettings:
    """``repository``: the model repository path. ``control_mode``: Triton's --model-control-mode.
    ``load_models``: Triton's --load-model list for explicit mode ("*" = all)."""

    repository: Path
    control_mode: ControlMode = "none"
    load_models: tuple[str, ...] = ()
    compute_threads: int | None = 1
    auto_complete: bool = True  # Triton's --disable-auto-complete-config turns it off
    #: called as verify_model(root, name) before a model's files are read; raises ModelLoadError naming a
    #: file that does not match the repository manifest (None: no integrity check)
    verify_model: Callable[[Path, str], None] | None = None
    #: a model whose config leaves ``azulite_instance_process`` at "auto" runs its Python instances in
    #: processes of their own (on in the model host of ``--workers N``; serve/instances.py)
    instance_processes: bool = False
    #: the server has a response cache (--cache-config): without one, a model's response_cache is inert
    response_cache: bool = False


def ensemble_dependencies(config: mc.ModelConfig) -> list[str]:
    return [step.model_name for step in config.ensemble_scheduling.step]


class ModelManager:
    def __init__(self, settings: ManagerSettings, *, bls: Callable[[Any], Any] | None = None,
                 in_flight: Callable[[], int] | None = None) -> None:
        if settings.control_mode not in ("none", "explicit", "poll"):
            raise ModelLoadError(
                f"unknown model control mode '{settings.control_mode}'", fix="use none, explicit or poll"
            )
        self.settings = settings
        self.root = Path(settings.repository)
        self.bls = bls
        self.in_flight = in_flight  # the server's requests in flight: each batcher gets it (Batcher._alone)
        self.entries: dict[str, ModelEntry] = {}
        self._left_said: set[str] = set()  # models poll unloaded for leaving the repository, already logged
        #: while load_initial runs: the models that failed to load (each tried, and logged, once)
        self._failed_at_start: set[str] | None = None
        repo.list_models(self.root)  # the repository itself must exist

    # --- what the data plane reads ----------------------------------------------------------------

    def get(self, name: str, version: str = "") -> LoadedModel:
        """The ready version a request goes to, or Triton's NotFound / Unavailable wording."""
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"Request for unknown model: '{name}' is not found")
        if version and version != "-1" and not (version.isascii() and version.isdigit()):
            raise InvalidArgument(f"model '{name}': version '{version}' is not a version number (Triton refuses it too)",
                                  fix="name a version by its number (a folder of the model), or leave it out for the "
                                      "latest ready version")
        if not version or version == "-1":
            model = entry.default()
            if model is None:
                raise ModelNotReady(
                    f"Request for unknown model: '{name}' has no available versions"
                    + (f" ({entry.reason})" if entry.reason else "")
                )
            return model
        number = int(version)  # digits: checked above
        model = entry.ready.get(number)
        if model is None:
            state = entry.states.get(number)
            if state is not None and state.state != READY:
                raise ModelNotReady(f"Request for unknown model: '{name}' version {version} is not at ready state"
                                  + (f" ({state.reason})" if state.reason else ""))
            raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")
        return model

    def all_stats(self) -> Iterable[ModelStats]:
        for entry in list(self.entries.values()):
            for model in list(entry.ready.values()):
                yield model.stats

    # --- start ------------------------------------------------------------------------------------

    def initial_models(self) -> list[str]:
        names = repo.list_models(self.root)
        if self.settings.control_mode == "explicit":
            wanted = self.settings.load_models
            if "*" in wanted:
                return names
            missing = [n for n in wanted if n not in names]
            if missing:
                # Triton refuses to start; we record them as failed so the rest still serves.
                for name in missing:
                    reason = repo.name_problem(name) or f"no model directory '{name}' in {self.root}"
                    self.entries[name] = ModelEntry(name=name, reason=reason)
            return [n for n in wanted if n in names]
        return names

    def load_initial(self) -> list[Batcher]:
        """Load the start-up set (non-ensembles first). Returns old batchers to close (none at start)."""
        names = self.initial_models()
        order = sorted(names, key=lambda n: self._is_ensemble_dir(n))
        retired: list[Batcher] = []
        # a model that failed here is not loaded (and its failure logged) again as an ensemble's step
        self._failed_at_start = set()
        try:
            for name in order:
                if name in self._failed_at_start or (name in self.entries and self.entries[name].ready):
                    continue
                retired += self.load(name)
        finally:
            self._failed_at_start = None
        return retired

    def _is_ensemble_dir(self, name: str) -> bool:
        try:
            text = (self.root / name / "config.pbtxt").read_text()
        except OSError:
            return False
        return "ensemble_scheduling" in text

    # --- load / unload ----------------------------------------------------------------------------

    def load(self, name: str, *, config_json: str | None = None, files: dict[str, bytes] | None = None,
             _chain: tuple[str, ...] = ()) -> list[Batcher]:
        """Load (or reload) one model. Never raises for the model's own faults: they are recorded on
        the entry (the data plane's load API raises them). Returns the batchers the swap retired."""
        repo.check_model_name(name)  # the callers check first; this keeps a path out of the repository
        entry = self.entries.get(name) or ModelEntry(name=name)
        self.entries.setdefault(name, entry)
        entry.explicit = not _chain or (entry.explicit and bool(entry.ready))
        if config_json is None and not files and entry.ready:
            config_json = entry.override  # a loaded model reloaded without an override keeps its own (Triton's)
        tmp: Path | None = None
        states: dict[int, VersionState] = {}  # the versions tried, each READY or UNAVAILABLE with its reason
        try:
            root = self.root
            if files:
                if config_json is None:
                    raise ModelLoadError(
                        f"failed to load '{name}': loading from 'file:' parameters requires a 'config' parameter"
                    )
                tmp = Path(tempfile.mkdtemp(prefix="azulite-model-"))
                for key, data in files.items():
                    rel = Path(key)
                    if rel.is_absolute() or ".." in rel.parts:
                        raise ModelLoadError(f"failed to load '{name}': invalid file path '{key}'")
                    target = tmp / name / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(data)
                root = tmp
            if self.settings.verify_model is not None:
                if files:
                    raise ModelLoadError(f"failed to load '{name}': the repository is verified against its "
                                         "manifest, so models cannot be loaded from 'file:' parameters")
                self.settings.verify_model(root, name)
            source = repo.read_model(root, name, config_json=config_json)
            config = self._final_config(source)
            if cfg.backend_of(config) == "ensemble":
                for dep in ensemble_dependencies(config):
                    if problem := repo.name_problem(dep):
                        raise ModelLoadError(f"ensemble '{name}' names a composing model that cannot exist: {problem}")
                    if dep in _chain or dep == name:
                        raise ModelLoadError(f"ensemble '{name}' has a cycle through '{dep}'")
                    dep_entry = self.entries.get(dep)
                    if (dep_entry is None or not dep_entry.ready) and not (self.root / dep).is_dir():
                        # loading it would list a model the repository never had (index, unload, metadata)
                        raise ModelLoadError(f"ensemble '{name}' steps to model '{dep}', which is not in the "
                                             f"model repository", fix=f"add {dep}/ to the repository, or correct "
                                             "the step's model_name")
                    if (dep_entry is None or not dep_entry.ready) and dep not in (self._failed_at_start or ()):
                        self.load(dep, _chain=(*_chain, name))
                    if not self.entries[dep].ready:
                        if dep in (self._failed_at_start or ()):  # its own error is logged and listed once
                            raise ModelLoadError(f"ensemble '{name}' depends on '{dep}', which failed to load "
                                                 f"(see its own error)",
                                                 fix=f"fix model '{dep}'; '{name}' loads with it")
                        raise ModelLoadError(
                            f"ensemble '{name}' depends on '{dep}' which is not available: "
                            f"{self.entries[dep].reason or 'not loaded'}"
                        )
                check_ensemble(config, lambda dep: self.entries[dep].config, lambda dep: set(self.entries[dep].ready))
                mark_decoupled(config, lambda dep: self.entries[dep].config)
            if cfg.backend_of(config) == "ensemble" and not source.versions:
                versions = [1]  # Triton wants an empty 1/ directory; azulite does not insist
            else:
                versions = repo.select_versions(config.version_policy, source.versions, model=name, path=source.path)
            labels = repo.read_labels(source, config)
            ready: dict[int, LoadedModel] = {}
            for version in versions:
                try:
                    ready[version] = self._load_version(source, config, version, labels)
                    states[version] = VersionState(READY)
                except ServeError as exc:
                    states[version] = VersionState(UNAVAILABLE, exc.message)
            if not ready:
                raise ModelLoadError("; ".join(s.reason for s in states.values()) or f"model '{name}' has no versions")
        except ServeError as exc:
            reason = self._reason(exc, name)
            entry.fingerprint = repo.fingerprint(self.root / name)
            entry.load_error, entry.load_fix = reason, exc.fix or ""
            if entry.ready:  # as Triton: a failed reload leaves the loaded model serving, unchanged
                log.warning("reloading model '%s' failed; the loaded version(s) %s serve on: %s", name,
                            ", ".join(map(str, sorted(entry.ready))), reason)
                return []
            if self._failed_at_start is not None:
                self._failed_at_start.add(name)
            log.warning("model '%s' failed to load: %s%s", name, reason, f"\n  fix: {exc.fix}" if exc.fix else "")
            # the index lists each version that failed with its own reason, as Triton's does (a failure
            # before any version was tried, e.g. the config's, is the model's alone)
            entry.states = states or {v: VersionState(UNAVAILABLE, reason) for v in entry.states}
            entry.state, entry.reason = UNAVAILABLE, reason
            return []
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        retired = [m.batcher for v, m in entry.ready.items() if m.batcher is not None]
        entry.ready, entry.states, entry.config = ready, states, config
        entry.override = None if files else config_json
        entry.state, entry.reason, entry.load_error, entry.load_fix = READY, "", "", ""
        entry.fingerprint = repo.fingerprint(self.root / name)
        return retired

    def _reason(self, exc: ServeError, name: str) -> str:
        """A load failure as the index and the start-up table show it: a config error names the file
        (and the line, where protobuf's text format gives one: it is in the message)."""
        where = exc.where or ""
        config = self.root / name / "config.pbtxt"
        if where == f"model '{name}' config.pbtxt" and config.is_file():
            where = str(config)
        if "config.pbtxt" in where and where not in exc.message:
            return f"{where}: {exc.message}"
        return exc.message

    def _final_config(self, source: repo.ModelSource) -> mc.ModelConfig:
        """config.pbtxt (or none) -> the config Triton would serve: auto-completed, defaulted, valid."""
        name = source.name
        config = mc.ModelConfig()
        if source.config is not None:
            config.CopyFrom(source.config)
        if not config.name:
            config.name = name
        backend = cfg.backend_of(config)
        if not backend:
            backend = repo.guess_backend(source)
            if backend == "onnxruntime":
                config.platform = cfg.ONNX_PLATFORM
            elif backend == "pytorch":
                config.platform = cfg.TORCH_PLATFORM
            elif backend:
                config.backend = backend
        if not self.settings.auto_complete and source.config is None:
            raise ModelLoadError(
                f"failed to load '{name}': no config.pbtxt, and auto-complete is disabled",
                where=str(source.path),
                fix="add a config.pbtxt or start without --disable-auto-complete-config",
            )
        if self.settings.auto_complete and backend in ("onnxruntime", "pytorch", "python") and source.versions:
            version = source.versions[-1]
            model_file = repo.model_file(source, config, version)
            config = get_backend(backend).auto_complete(config, model_file)
        cfg.fill_defaults(config, model=name)
        cfg.validate_config(config, model=name)
        policy_of(config)  # a bad fallback, drift or instance-process parameter fails the load, naming it
        if config.response_cache.enable and not self.settings.response_cache:
            log.warning("model '%s' enables response_cache but the server has no cache: its answers are not "
                        "cached (start with --cache-config local,size=BYTES)", name)
        window_of(config)
        instances.placement(config)
        instances.instance_nice(config)  # checked even where the instances run as threads: the same
        return config                     # repository then loads alike under --workers N

    def _load_version(self, source: repo.ModelSource, config: mc.ModelConfig, version: int,
                      labels: dict[str, list[str]]) -> LoadedModel:
        name = source.name
        stats = ModelStats(name=name, version=str(version))
        backend = cfg.backend_of(config)
        if backend == "ensemble":
            return LoadedModel(name=name, version=version, config=config, batcher=None, stats=stats, labels=labels)
        model_file = repo.model_file(source, config, version)
        impl = get_backend(backend)
        instances = []
        try:
            for group in config.instance_group:
                for i in range(group.count):
                    instance_name = f"{group.name}_{i}"
                    ctx = LoadContext(
                        model_name=name, version=version, model_dir=source.path, model_file=model_file,
                        config=config, instance_name=instance_name, instance_index=len(instances), bls=self.bls,
                        compute_threads=self.settings.compute_threads,
                    )
                    instance = self._instance(impl, backend, ctx, group)
                    instances.append((instance_name, instance))
                    warm_up(config, instance, source.path)
        except BaseException:
            for _, inst in instances:
                inst.close()
            raise
        batcher = Batcher(model=name, settings=BatcherSettings.from_config(config), instances=instances,
                          observer=stats, server_in_flight=self.in_flight)
        return LoadedModel(name=name, version=version, config=config, batcher=batcher, stats=stats, labels=labels)

    def _instance(self, impl, backend: str, ctx: LoadContext, group):
        if instances.wants_process(ctx.config, backend, ctx.model_file, host=self.settings.instance_processes):
            gpu = group.gpus[ctx.instance_index % len(group.gpus)] if group.kind == mc.ModelInstanceGroup.KIND_GPU \
                and group.gpus else None
            return instances.ProcessInstance(backend, ctx, gpu=gpu)
        return impl.load(ctx)

    def check_load(self, name: str, *, files: dict[str, bytes] | None = None) -> None:
        """Refuse a load API call the mode or the repository does not allow (before loading anything)."""
        if self.settings.control_mode != "explicit":
            raise Unavailable(  # Triton answers UNAVAILABLE / 503 here
                f"explicit model load / unload is not allowed if model control mode is '{self.settings.control_mode}'",
                fix="start the server with --model-control-mode=explicit",
            )
        repo.check_model_name(name)
        if not (self.root / name).is_dir() and not files:
            raise NotFound(f"failed to load '{name}', failed to poll from model repository: no model directory "
                           f"'{name}' in {self.root}")

    def unload(self, name: str, *, unload_dependents: bool = False, check_mode: bool = True) -> list[Batcher]:
        if check_mode and self.settings.control_mode != "explicit":
            raise Unavailable(  # Triton answers UNAVAILABLE / 503 here
                f"explicit model load / unload is not allowed if model control mode is '{self.settings.control_mode}'",
                fix="start the server with --model-control-mode=explicit",
            )
        repo.check_model_name(name)
        entry = self.entries.get(name)
        if entry is None:
            if (self.root / name).is_dir():
                return []  # never loaded: unloading is a no-op, as in Triton
            raise NotFound(f"failed to unload '{name}': no such model")
        return self._unload(entry, "unloaded", unload_dependents)

    def _unload(self, entry: ModelEntry, reason: str, unload_dependents: bool) -> list[Batcher]:
        """As Triton: an ensemble cannot outlive a composing model, so the ensembles using ``entry`` go too;
        with ``unload_dependents``, an ensemble also takes the composing models that were loaded only for
        it (not by name) and that no other loaded ensemble uses."""
        retired = [m.batcher for m in entry.ready.values() if m.batcher is not None]
        entry.ready = {}
        entry.override = None
        entry.states = {v: VersionState(UNAVAILABLE, reason) for v in entry.states}
        entry.state, entry.reason = UNAVAILABLE, reason
        users = [e for e in self.entries.values() if e.ready and entry.name in self._steps(e)]
        for user in users:
            retired += self._unload(user, f"composing model '{entry.name}' was unloaded", False)
        if unload_dependents:
            for dep in dict.fromkeys(self._steps(entry)):
                d = self.entries.get(dep)
                if d is not None and d.ready and not d.explicit and not any(
                        dep in self._steps(e) for e in self.entries.values() if e.ready):
                    retired += self._unload(d, "unloaded", True)
        return retired

    @staticmethod
    def _steps(entry: ModelEntry) -> list[str]:
        return ensemble_dependencies(entry.config) if entry.config is not None else []

    def poll(self) -> list[Batcher]:
        """Poll mode: load new models, reload changed ones, unload removed ones."""
        retired: list[Batcher] = []
        present = set(repo.list_models(self.root))
        for name in list(self.entries):
            if name in present:
                continue
            if self.entries[name].ready:
                retired += self.unload(name, check_mode=False)
                poll_log.info("poll: model '%s' left the repository: unloaded", name)
                self._left_said.add(name)
            else:  # one that never loaded (refused, failed) or was unloaded: no longer listed, nor waited for
                del self.entries[name]
                if name not in self._left_said:  # said once, when it was unloaded (the poll before this one)
                    poll_log.info("poll: model '%s' left the repository", name)
                self._left_said.discard(name)
        changed = [
            n for n in sorted(present, key=self._is_ensemble_dir)
            if n not in self.entries or repo.fingerprint(self.root / n) != self.entries[n].fingerprint
        ]
        for name in changed:
            known = name in self.entries and bool(self.entries[name].ready)
            retired += self.load(name)
            entry = self.entries.get(name)
            if entry is not None and entry.ready and not entry.load_error:  # failures are logged by load()
                poll_log.info("poll: model '%s' %s: version(s) %s ready", name, "changed, reloaded" if known else "appeared, loaded",
                         ", ".join(map(str, sorted(entry.ready))))
        return retired
