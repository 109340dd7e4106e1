"""Triton's Python backend, in-process: ``model.py`` defining ``TritonPythonModel`` (initialize,
execute, finalize, auto_complete_config) runs unchanged, importing ``triton_python_backend_utils``.

Why in-process: Triton runs each instance in a stub process and moves every tensor through shared
memory and an IPC handshake per execute — that round trip is most of a small model's latency. Here an
instance is an object executing in its own thread; numpy and torch release the GIL in their kernels, so
``instance_group { count: N }`` instances run concurrently. The price: instances of one model share the
interpreter, so a model.py that mutates module globals shares them across its instances.
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import inspect
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from azulite.errors import Internal, InvalidArgument, ModelLoadError, NotFound, ServeError, Unavailable, Unsupported
from azulite.serve import config as cfg
from azulite.serve.backends import pb_utils
from azulite.serve.backends.base import LoadContext, Result, Timing, WorkItem, register
from azulite.serve.proto import model_config_pb2 as mc

sys.modules.setdefault("triton_python_backend_utils", pb_utils)

_ERROR_CLASSES: dict[int, type[ServeError]] = {
    pb_utils.TritonError.INVALID_ARG: InvalidArgument,
    pb_utils.TritonError.NOT_FOUND: NotFound,
    pb_utils.TritonError.UNAVAILABLE: Unavailable,
    pb_utils.TritonError.UNSUPPORTED: Unsupported,
}
_import_lock = threading.Lock()
log = logging.getLogger("azulite.serve.python")
_OURS = str(Path(__file__).resolve().parents[2])  # azulite's own files: not the model's frames


def _model_frames(exc: BaseException) -> str:
    """The traceback's frames outside azulite, innermost first, as Triton's Python backend prints them."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_OURS)]
    if not frames:
        return ""
    return "\n\nAt:\n" + "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
_counter = 0


class _SourceOnly(importlib.machinery.SourceFileLoader):
    """A repository's Python files are compiled from their source, never from bytecode (``__pycache__``):
    the integrity manifest does not list bytecode (Python writes it), so a planted ``.pyc`` whose header
    matched the signed source's mtime and size ran in its place. Nothing is written either."""

    def get_code(self, fullname: str):
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


#: folders whose modules load source-only (model folders, and any package below one)
_model_folders: set[str] = set()


def _source_only_finder(path: str):
    """sys.path_hooks entry: a finder for a model folder (or below one) that loads source and extension
    modules, not bytecode; other paths are left to the default hooks."""
    if path in _model_folders or any(path.startswith(f + os.sep) for f in _model_folders):
        return importlib.machinery.FileFinder(
            path, (_SourceOnly, importlib.machinery.SOURCE_SUFFIXES),
            (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES))
    raise ImportError(path)


def _load_module(model_file: Path, model: str):
    """A fresh module object per call (Triton gives each instance its own process and module)."""
    global _counter
    with _import_lock:
        _counter += 1
        module_name = f"azulite_python_model_{_counter}"
        folder = str(model_file.parent)
        if _source_only_finder not in sys.path_hooks:
            sys.path_hooks.insert(0, _source_only_finder)
        if folder not in _model_folders:
            _model_folders.add(folder)
            sys.path_importer_cache.pop(folder, None)
        if folder not in sys.path:  # model.py may import its sibling files, as in Triton's stub
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(module_name, model_file,
                                                      loader=_SourceOnly(module_name, str(model_file)))
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            raise ModelLoadError(
                f"failed to load model '{model}': importing {model_file} raised {type(exc).__name__}: {exc}",
                where=str(model_file),
            ) from None
    if not hasattr(module, "TritonPythonModel"):
        raise ModelLoadError(
            f"failed to load model '{model}': {model_file} defines no class TritonPythonModel",
            where=str(model_file),
        )
    return module


def _error_of(error: pb_utils.TritonError | Exception, *, model: str) -> ServeError:
    if isinstance(error, pb_utils.TritonError):
        return _ERROR_CLASSES.get(error.code(), Internal)(error.message())
    return Internal(f"model '{model}': {error}")


class PythonInstance:
    # its execute sees each client request: coalesced ones are cut back first (serve/coalesce.py)
    per_request = True

    def __init__(self, ctx: LoadContext) -> None:
        self.model = ctx.model_name
        self.instance_name = ctx.instance_name
        self.bls = ctx.bls
        self._aloop: asyncio.AbstractEventLoop | None = None
        module = _load_module(ctx.model_file, ctx.model_name)
        self.impl = module.TritonPythonModel()
        # On the event loop a BLS call (which waits for the server) or an `async def execute` (which
        # runs its own loop) would deadlock: a model whose code could do either always gets its thread.
        self.inline_safe = not inspect.iscoroutinefunction(getattr(self.impl, "execute", None)) and \
            "InferenceRequest" not in ctx.model_file.read_text(errors="replace")
        self.config_json = json.dumps(cfg.config_to_dict(ctx.config))
        # decoupled: each request gets a response sender; execute returns None (serve/decoupled.py)
        self.decoupled = ctx.config.model_transaction_policy.decoupled
        self.inline_safe = self.inline_safe and not self.decoupled  # its execute may wait between sends
        args = {
            "model_config": self.config_json,
            "model_instance_kind": "CPU",
            "model_instance_name": ctx.instance_name,
            "model_instance_device_id": "0",
            "model_repository": str(ctx.model_dir),
            "model_version": str(ctx.version),
            "model_name": ctx.model_name,
        }
        if hasattr(self.impl, "initialize"):
            try:
                self._with_bls(self.impl.initialize, args)
            except Exception as exc:
                raise ModelLoadError(
                    f"failed to load model '{ctx.model_name}': initialize() raised {type(exc).__name__}: {exc}",
                    where=str(ctx.model_file),
                ) from None

    def _with_bls(self, fn, *args):
        pb_utils._local.bls = self.bls
        try:
            return fn(*args)
        finally:
            pb_utils._local.bls = None

    def _call_execute(self, requests):
        result = self.impl.execute(requests)
        if inspect.iscoroutine(result):  # `async def execute` (Triton allows it, for async BLS)
            if self._aloop is None:  # one loop per instance, living in the instance's own thread
                self._aloop = asyncio.new_event_loop()
            result = self._aloop.run_until_complete(result)
        return result

    def execute(self, items: list[WorkItem]) -> tuple[list[Result], Timing]:
        t0 = time.perf_counter_ns()
        requests = [
            pb_utils.InferenceRequest(
                model_name=self.model,
                requested_output_names=sorted(item.outputs) if item.outputs is not None else [],
                # Triton's models may write to their inputs; arrays off the wire can be read-only views.
                inputs=[pb_utils.Tensor(name, array if array.flags.writeable else array.copy())
                        for name, array in item.inputs.items()],
                request_id=item.request_id,
                parameters=item.parameters,
                trace=None if item.trace is None else pb_utils.InferenceTrace(item.trace),
            )
            for item in items
        ]
        if self.decoupled:
            for request, item in zip(requests, items):
                request._sender = pb_utils.InferenceResponseSender(self._deliverer(item))
        t1 = time.perf_counter_ns()
        try:
            responses = self._with_bls(self._call_execute, requests)
        except Exception as exc:
            # Triton's wording, with the model's own frames ("At:") so its author can find the line; logged
            # too: the client's 500 is not where the person running the server looks
            message = (f"Failed to process the request(s) for model instance '{self.instance_name}', message: "
                       f"{type(exc).__name__}: {exc}{_model_frames(exc)}")
            log.error("%s", message)
            raise Internal(message) from None
        t2 = time.perf_counter_ns()
        if self.decoupled:  # the answers go through the senders; Triton ignores what execute returns
            return [{} for _ in items], Timing(t1 - t0, t2 - t1, time.perf_counter_ns() - t2)
        if responses is None or not isinstance(responses, (list, tuple)):
            raise Internal(
                f"model '{self.model}': execute() returned {type(responses).__name__}, not a list of "
                f"pb_utils.InferenceResponse (one per request)",
                fix="return [pb_utils.InferenceResponse(...) for each request]; a model that sends its answers "
                    "through response senders is decoupled: model_transaction_policy { decoupled: true }")
        if len(responses) != len(items):
            raise Internal(
                f"model '{self.model}': execute() returned {len(responses)} responses for {len(items)} requests "
                "(it must return one per request)"
            )
        results: list[Result] = []
        for item, response in zip(items, responses):
            if not isinstance(response, pb_utils.InferenceResponse):
                results.append(Internal(f"model '{self.model}': execute() returned {type(response).__name__}, "
                                        "expected pb_utils.InferenceResponse"))
            elif response.has_error():
                results.append(_error_of(response.error(), model=self.model))
            else:
                outputs = {}
                for tensor in response.output_tensors():
                    if item.outputs is None or tensor.name() in item.outputs:
                        outputs[tensor.name()] = tensor.as_numpy()
                results.append(outputs)
        return results, Timing(t1 - t0, t2 - t1, time.perf_counter_ns() - t2)

    def _deliverer(self, item: WorkItem):
        """-> deliver(pb response or None, final) for one decoupled request: converted, then item.sink."""
        sink = item.sink
        if sink is None:
            raise Internal(f"model '{self.model}' is decoupled but its request has no response sink")

        def deliver(response: pb_utils.InferenceResponse | None, final: bool) -> None:
            if response is None:
                sink(None, final)
            elif response.has_error():
                sink(_error_of(response.error(), model=self.model), final)
            else:
                sink({t.name(): t.as_numpy() for t in response.output_tensors()
                      if item.outputs is None or t.name() in item.outputs}, final)

        return deliver

    def close(self) -> None:
        if hasattr(self.impl, "finalize"):
            try:
                self._with_bls(self.impl.finalize)
            except Exception as exc:  # a model failing to clean up must not stop the unload; but it is said
                log.warning("model instance '%s': finalize() raised %s: %s%s", self.instance_name,
                            type(exc).__name__, exc, _model_frames(exc))
        if self._aloop is not None:
            self._aloop.close()


@register("python")
class PythonBackend:
    name = "python"

    def load(self, ctx: LoadContext) -> PythonInstance:
        return PythonInstance(ctx)

    def auto_complete(self, config: mc.ModelConfig, model_file: Path) -> mc.ModelConfig:
        """Calls the model's static ``auto_complete_config(pb_utils.ModelConfig)``, as Triton does."""
        module = _load_module(model_file, config.name)
        hook = getattr(module.TritonPythonModel, "auto_complete_config", None)
        if hook is None:
            return config
        try:
            result = hook(pb_utils.ModelConfig(cfg.config_to_dict(config)))
        except Exception as exc:
            raise ModelLoadError(
                f"failed to load model '{config.name}': auto_complete_config() raised {type(exc).__name__}: {exc}",
                where=str(model_file),
            ) from None
        if not isinstance(result, pb_utils.ModelConfig):
            raise ModelLoadError(
                f"model '{config.name}': auto_complete_config() must return the pb_utils.ModelConfig it was given",
                where=str(model_file),
            )
        return cfg.config_from_json(result.as_dict(), model=config.name)
