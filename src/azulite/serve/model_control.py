"""The data plane's model control: load, unload, repository polling and shutdown (Triton's
model-repository extension and ``--model-control-mode``), one at a time under one lock. A mixin of
:class:`azulite.serve.dataplane.TritonDataPlane`, whose state it uses: ``manager``, ``settings``, ``shm``, ``tracer``,
``_lock``, ``_poller``, ``_closing``, ``_closed``, ``_inflight`` and ``_limit_threads``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from azulite.errors import InvalidArgument, ModelLoadError, ServeError, Unsupported


class ModelControl:
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
                reason = entry.load_error
                if not reason.startswith("failed to load"):
                    reason = f"failed to load '{name}': {reason}"
                raise ModelLoadError(reason, where=f"model '{name}'", fix=entry.load_fix or None)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        async with self._control_lock():
            retired = self.manager.unload(name, unload_dependents=unload_dependents)
            await self._retire(retired)

    async def poll(self) -> None:
        """Poll mode: one rescan of the repository (see :meth:`start_polling`)."""
        async with self._control_lock():
            retired = await asyncio.to_thread(self.manager.poll)
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
