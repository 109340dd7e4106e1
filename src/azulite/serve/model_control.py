"""The data plane's model control: the repository index, load, unload, repository polling and shutdown
(Triton's model-repository extension and ``--model-control-mode``), one at a time under one lock. A mixin
of :class:`azulite.serve.dataplane.TritonDataPlane`, whose state it uses: ``manager``, ``settings``, ``shm``,
``tracer``, ``_lock``, ``_poller``, ``_closing``, ``_closed``, ``_inflight`` and ``_limit_threads``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from azulite.errors import InvalidArgument, ModelLoadError, ServeError, Unsupported
from azulite.serve import repository as repo
from azulite.serve.models import READY
from azulite.serve.proto import service_pb2 as pb

log = logging.getLogger("azulite.serve")


class ModelControl:
    def repository_index(self, ready_only: bool = False) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        names = set(self.manager.entries)
        try:
            names |= set(repo.list_models(self.manager.root))
        except ServeError:
            pass
        for name in sorted(names):
            entry = self.manager.entries.get(name)
            if entry is None:
                if not ready_only:
                    response.models.add(name=name)  # in the repository, never loaded (Triton: no state)
                continue
            if entry.states:
                for v in sorted(entry.states):
                    st = entry.states[v]
                    if ready_only and st.state != READY:
                        continue
                    response.models.add(name=name, version=str(v), state=st.state, reason=st.reason)
            elif not ready_only:
                response.models.add(name=name, state=entry.state, reason=entry.reason)
        return response

    def startup_table(self) -> list[tuple[str, str, str]]:
        """(model, version, status) rows as Triton prints at start: READY or UNAVAILABLE: <reason>."""
        rows = []
        for m in self.repository_index().models:
            status = m.state or "UNAVAILABLE"
            if m.reason:
                status += f": {m.reason}"
            rows.append((m.name, m.version or "-", status if m.state else "UNLOADED"))
        return rows

    def _control_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def load_model(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        parameters = dict(parameters or {})
        if "config" in parameters and not isinstance(parameters["config"], str):
            raise InvalidArgument("load parameter 'config' must be a string: the model configuration as JSON",
                                  fix='e.g. {"parameters": {"config": "{\\"max_batch_size\\": 8}"}}')
        for key in parameters:
            if key != "config" and not key.startswith("file:"):  # Triton's words
                raise InvalidArgument(f"unrecognized load parameter '{key}'.",
                                      fix="a load takes 'config' (the model configuration as JSON) and "
                                      "'file:<path in the model folder>' (that file's content)")
        config_json = parameters.pop("config", None)
        files = {k[len("file:"):]: v for k, v in parameters.items()}
        for key, value in files.items():
            if not isinstance(value, (bytes, bytearray)):
                raise InvalidArgument(f"load parameter 'file:{key}' must be bytes (base64 over HTTP)")
        async with self._control_lock():
            self.manager.check_load(name, files=files or None)
            retired = await asyncio.to_thread(self.manager.load, name, config_json=config_json, files=files or None)
            self._limit_threads()
            await self._retire(retired)  # the versions it replaced (none if the load failed: they serve on)
            entry = self.manager.entries[name]
            if entry.load_error:
                if files and not entry.ready and not (self.manager.root / name).is_dir():
                    # a model made of the request's files alone, which failed: nothing of it is in the
                    # repository to list (it stayed in the index as UNAVAILABLE for good)
                    del self.manager.entries[name]
                reason = entry.load_error
                if not reason.startswith("failed to load"):
                    reason = f"failed to load '{name}': {reason}"
                raise ModelLoadError(reason, where=f"model '{name}'", fix=entry.load_fix or None)
            if files:
                self._file_loads.add(name)
            else:
                self._file_loads.discard(name)
            self._write_journal()

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        async with self._control_lock():
            retired = self.manager.unload(name, unload_dependents=unload_dependents)
            await self._retire(retired)
            self._write_journal()

    def _write_journal(self) -> None:
        """The models serving now, each with the config override its versions run with (explicit mode,
        ``settings.control_journal``): what a restarted model host loads (:meth:`replay`)."""
        path = self.settings.control_journal
        if path is None or self.settings.control_mode != "explicit":
            return
        serving = {name: {"config": entry.override, "files": name in self._file_loads}
                   for name, entry in self.manager.entries.items() if entry.ready}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(serving, sort_keys=True))
        os.replace(tmp, path)  # whole or not at all: a host killed while writing reads the previous one

    async def replay(self, journal: dict[str, dict]) -> None:
        """A restarted model host: load again, with their config overrides, the models that were serving
        (those the journal lists beyond the start-up models, which are loaded already), unload the start-up
        models that were not. A model loaded with file overrides comes back from the repository's files
        (the files are not kept), said in the log."""
        for name in sorted(journal):
            entry = journal[name]
            if entry.get("files"):
                log.warning("model host restarted: model '%s' had been loaded with file overrides, which are not "
                            "kept: it is loaded from the repository's files", name)
            ready = name in self.manager.entries and self.manager.entries[name].ready
            if entry.get("config") is not None or not ready:
                try:
                    await self.load_model(name, {"config": entry["config"]} if entry.get("config") else None)
                except ServeError as exc:
                    log.warning("model host restarted: model '%s' did not load again: %s", name, exc.message)
        for name in [n for n, e in self.manager.entries.items() if e.ready and n not in journal]:
            await self.unload_model(name)
        log.warning("model host restarted: serving the models loaded before it stopped: %s",
                    ", ".join(sorted(journal)) or "none")

    async def poll(self) -> None:
        """Poll mode: one rescan of the repository (see :meth:`start_polling`)."""
        async with self._control_lock():
            retired = await asyncio.to_thread(self.manager.poll)
            # a start-up model that left the repository is no longer waited for by readiness (one refused
            # at start, then removed, kept /v2/health/ready at 400 for good)
            self._initial = [name for name in self._initial if name in self.manager.entries]
            self._limit_threads()
            await self._retire(retired)

    def start_polling(self, interval_s: float = 15.0) -> None:
        """Triton's --repository-poll-secs: rescan every interval (poll mode only)."""
        if self.settings.control_mode != "poll":
            raise Unsupported("repository polling needs --model-control-mode=poll")

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.poll()
                except ServeError:
                    pass  # a broken repository state is recorded per model; keep polling

        self._poller = asyncio.get_running_loop().create_task(loop(), name="azulite-repository-poll")

    async def _retire(self, batchers) -> None:
        if batchers:
            await asyncio.gather(*(b.close() for b in batchers), return_exceptions=True)

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let those in flight finish (batchers keep running meanwhile), then
        close every batcher, which finalizes the model instances."""
        self._closing = True
        if self._poller is not None:
            self._poller.cancel()
        deadline = time.monotonic() + drain_timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        batchers = [m.batcher for e in self.manager.entries.values() for m in e.ready.values() if m.batcher]
        await asyncio.gather(*(b.close(max(0.0, deadline - time.monotonic())) for b in batchers),
                             return_exceptions=True)
        self.shm.close()
        self.tracer.close()  # the traces not yet written go to their file
        self._closed = True
