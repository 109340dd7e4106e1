"""The data plane: Triton's semantics behind the :class:`azulite.serve.types.DataPlane` protocol that
the HTTP and gRPC front-ends call. It checks requests against the model's config (name, datatype,
shape, batch size: an error names the input and what was expected vs got), hands them to the model's
batcher, shapes the answers (reshape, classification), and keeps statistics and metrics.

The infer path builds no protobuf and loops over tensors, never over elements.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import threadpoolctl

from azulite.errors import InvalidArgument, ServeError, Unavailable
from azulite.serve import config as cfg
from azulite.serve import cuda_shm, instances
from azulite.serve.backends.base import Timing, WorkItem
from azulite.serve.batcher import Batcher
from azulite.serve.bls import bls_call
from azulite.serve.checks import bytes_objects, check_inputs, check_outputs, output_array, output_datatype
from azulite.serve.counted import Counted
from azulite.serve.decoupled import FINAL_FLAG, stream, stream_with_policies, unary_refused
from azulite.serve.ensemble import run_ensemble, step_item, step_outputs, step_request
from azulite.serve.drift import OutputMonitor, drift_metrics, window_of
from azulite.serve.sharedstate import SharedDriftStore, drift_key
from azulite.serve.fallback import FallbackPolicy, answer_with_fallback, fallback_metrics, policy_of
from azulite.serve.manager import ControlMode, ManagerSettings, ModelManager
from azulite.serve.metrics import ServerMetrics
from azulite.serve.model_control import ModelControl
from azulite.serve.models import LoadedModel
from azulite.serve.parameters import classify, for_model, request_int, requested_names, top_k
from azulite.serve.proto import model_config_pb2 as mc
from azulite.serve.proto import service_pb2 as pb
from azulite.serve.response_cache import CacheSettings, ResponseCache, cache_metrics
from azulite.serve.response_cache import insert as cache_insert
from azulite.serve.response_cache import lookup as cache_lookup
from azulite.serve.sequence import Sequencer
from azulite.serve.shm import SharedMemory
from azulite.serve.trace import Trace, Tracer, trace_tensors
from azulite.serve.trace_settings import TraceSettings
from azulite.serve.types import InferRequest, InferResponse, InferTensor

SERVER_NAME = "azulite"
SERVER_VERSION = "0.1.0"
# Only what is really implemented (binary_tensor_data is the front-ends' part of the protocol).
EXTENSIONS = (
    "classification",
    "sequence",  # sequence batching (serve/sequence.py): Triton lists it here, and clients look for it
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "system_shared_memory",
    "logging",  # GET/POST v2/logging, gRPC LogSettings (serve/log_settings.py)
    "trace",  # GET/POST v2[/models/NAME]/trace/setting, gRPC TraceSetting (serve/trace.py)
)

_DTYPE_TO_WIRE = {v: k for k, v in cfg.WIRE_TO_NUMPY.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPlaneSettings:
    """``strict_readiness`` (Triton's --strict-readiness, default true): the server is ready only when
    every model asked for at start loaded; false: ready as soon as it serves."""

    repository: Path
    control_mode: ControlMode = "none"
    load_models: tuple[str, ...] = ()
    strict_readiness: bool = True
    # Threads one model execution may use in BLS/OpenMP/ONNX Runtime/torch (None: the libraries'
    # defaults). 1 by default: a server scales with batching and instance_group count, and on a small
    # machine idle BLS threads spinning beside the event loop cost more than they compute (measured:
    # 250 -> 12 us CPU per request for the bench model at concurrency 32 on 2 cores).
    compute_threads: int | None = 1
    # Triton's --disable-auto-complete-config: configs are used exactly as written.
    disable_auto_complete_config: bool = False
    extensions: tuple[str, ...] = field(default=EXTENSIONS)
    #: the name /v2 and ServerMetadata report (``azulite serve --server-name``; Triton's clients expect "triton")
    server_name: str = SERVER_NAME
    #: see ManagerSettings.verify_model (the repository manifest check)
    verify_model: Callable[[Path, str], None] | None = None
    #: see ServerSettings.shared_state_dir: drift windows shared by the server's worker processes
    shared_state_dir: Path | None = None
    #: see ManagerSettings.instance_processes (on in the model host of ``azulite serve --workers N``)
    instance_processes: bool = False
    #: the trace settings at start (``azulite serve --trace-config``; serve/trace_settings.py)
    trace: TraceSettings = field(default_factory=TraceSettings)
    #: the response cache (``azulite serve --cache-config local,size=N``; serve/response_cache.py)
    cache: CacheSettings = field(default_factory=CacheSettings)
    #: where the models loaded through the load API are written after each load and unload (explicit
    #: mode), so that a restarted model host of ``--workers N`` serves what the operator left, not the
    #: start-up models (serve/model_control.py, replay); None: not kept
    control_journal: Path | None = None


class TritonDataPlane(ModelControl):
    """Implements :class:`azulite.serve.types.DataPlane`. Construct it (loads the start-up models,
    synchronously), then call it from one event loop. Extras the front-ends may use: ``metrics``
    (:class:`ServerMetrics`: ``metrics_text()``, ``content_type``, ``registry``), ``start_polling()``,
    ``startup_table()`` (rows of model, version, status for the CLI)."""

    def __init__(self, settings: DataPlaneSettings) -> None:
        self.settings = settings
        self._limit_threads()
        self.manager = ModelManager(
            ManagerSettings(repository=Path(settings.repository), control_mode=settings.control_mode,
                            load_models=settings.load_models, compute_threads=settings.compute_threads,
                            auto_complete=not settings.disable_auto_complete_config,
                            verify_model=settings.verify_model,
                            instance_processes=settings.instance_processes,
                            response_cache=settings.cache.size > 0),
            bls=partial(bls_call, self), in_flight=lambda: self._inflight,
        )
        self.metrics = ServerMetrics(self.manager.all_stats)
        self.shm = SharedMemory()  # the shared memory regions (system and CUDA) clients registered
        self.tracer = Tracer(settings.trace, known_model=lambda name: name in self.manager.entries)
        self.cache = ResponseCache(settings.cache.size) if settings.cache.size else None
        if self.cache is not None:
            self.metrics.extra.append(lambda: cache_metrics(self.manager.all_stats, self.cache))
        if self.tracer.active:
            Batcher.trace_on = True
        self._sequencers: dict[int, tuple[LoadedModel, Sequencer]] = {}  # sequence_batching models
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._closing = False
        self._closed = False
        self._inflight = 0
        self._poller: asyncio.Task | None = None
        #: per model, from its config: (config, fallback policy, output monitor)
        self._policies: dict[str, tuple[mc.ModelConfig, FallbackPolicy | None, OutputMonitor | None]] = {}
        #: (model, fallback, reason) -> requests answered by the fallback (azulite_fallback_total)
        self.fallbacks: dict[tuple[str, str, str], int] = {}
        #: the models last loaded through the load API with file overrides (serve/model_control.py journal)
        self._file_loads: set[str] = set()
        self.metrics.extra.append(lambda: fallback_metrics(self.fallbacks))
        self.metrics.extra.append(lambda: drift_metrics(self.manager.entries, self._policies))
        self.metrics.extra.append(instances.restart_metrics)
        self.manager.load_initial()
        self._limit_threads()  # again: models may have loaded more BLAS libraries (scipy, MKL...)
        explicit = settings.control_mode == "explicit" and "*" not in settings.load_models
        self._initial = list(settings.load_models) if explicit else list(self.manager.entries)

    def _limit_threads(self) -> None:
        """Cap the BLAS pools of the whole process (numpy in Python models) to ``compute_threads``:
        threadpoolctl finds the loaded libraries and sets their limits, no environment variable needed
        before import."""
        if self.settings.compute_threads:
            threadpoolctl.threadpool_limits(limits=self.settings.compute_threads, user_api="blas")

    # --- health and metadata -----------------------------------------------------------------------

    def live(self) -> bool:
        return not self._closed

    def ready(self) -> bool:
        if self._closing:
            return False
        if not self.settings.strict_readiness:
            return True
        return all(name in self.manager.entries and self.manager.entries[name].ready for name in self._initial)

    def server_metadata(self) -> pb.ServerMetadataResponse:
        extensions = list(self.settings.extensions)
        if "system_shared_memory" in extensions and cuda_shm.available():  # as Triton lists it: after system's
            extensions.insert(extensions.index("system_shared_memory") + 1, "cuda_shared_memory")
        return pb.ServerMetadataResponse(name=self.settings.server_name, version=SERVER_VERSION, extensions=extensions)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.manager.get(name, version)
        except InvalidArgument:  # a version that is no number is a mistake to name, not a model not ready
            raise
        except ServeError:
            return False
        return True

    def model_metadata(self, name: str, version: str = "") -> pb.ModelMetadataResponse:
        model = self.manager.get(name, version)
        if version and version != "-1":  # as Triton: a version's metadata lists that version only
            return model.metadata([model.version_str])
        versions = [str(v) for v in sorted(self.manager.entries[name].ready)]
        return model.metadata(versions)

    def model_config(self, name: str, version: str = "") -> mc.ModelConfig:
        return self.manager.get(name, version).config

    def trace_setting(self, model: str = "", changes: dict | None = None) -> dict:
        """Triton's trace extension (serve/trace.py): GET (``changes`` None) or POST a model's or the global
        trace settings."""
        answer = self.tracer.setting(model, changes)
        if self.tracer.active:
            Batcher.trace_on = True
        return answer

    def model_statistics(self, name: str = "", version: str = "") -> pb.ModelStatisticsResponse:
        response = pb.ModelStatisticsResponse()
        if not name:
            for entry in sorted(self.manager.entries.values(), key=lambda e: e.name):
                for v in sorted(entry.ready):
                    response.model_stats.append(entry.ready[v].stats.to_proto())
            return response
        entry = self.manager.entries.get(name)
        if entry is None or not entry.ready:
            raise InvalidArgument(f"requested model '{name}' is not available")  # Triton: 400 / INVALID_ARGUMENT
        if version and version != "-1":
            model = self.manager.get(name, version)
            response.model_stats.append(model.stats.to_proto())
        else:
            for v in sorted(entry.ready):
                response.model_stats.append(entry.ready[v].stats.to_proto())
        return response

    # --- inference ---------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._closing:
            raise Unavailable("the server is shutting down and accepts no new requests")
        self.shm.resolve_inputs(request)
        places = self.shm.output_places(request)
        # the model's fallback (serve/fallback.py) and output monitor (serve/drift.py) around _infer, inline:
        # one coroutine less on every request's await chain
        cached = self._cached_policies(request.model_name)
        if cached is None or cached[1] is None:
            response = await self._infer(request)
        else:
            response = await answer_with_fallback(request, cached[1], get_model=self.manager.get,
                                                  infer=self._infer, counts=self.fallbacks)
        try:
            self._deliver(request, response, cached, places)
        except BaseException:
            if response.trace is not None:  # no answer for the front-end to send: the trace is done
                response.trace.sent(0, 0)
            raise
        return response

    def _deliver(self, request: InferRequest, response: InferResponse, cached, places) -> None:
        """An answer's last steps (infer and infer_then alike): the output monitor sees the model's own
        answers (not a fallback's), and outputs go to the client's shared-memory regions it named."""
        if cached is not None and cached[2] is not None and response.model_name == request.model_name:
            cached[2].observe([(t.name, t.data) for t in response.outputs])
        if places:
            self.shm.place_outputs(response, places)

    def infer_then(self, request: InferRequest, then: Callable[[InferResponse | None, BaseException | None], None]
                   ) -> asyncio.Future | None:
        """infer without a coroutine or a Task, for the common case -- a batched model that is not a sequence,
        not decoupled and has no fallback policy: ``then(response, None)`` or ``then(None, error)`` is called
        once, later, from the batcher's answer (never before this returns). Returns the batcher's future
        (cancel it to cancel the request: ``then`` gets the CancelledError), or None (nothing called): the
        request needs infer's general path; await ``infer``. Raises what infer raises before the model runs.
        Saves the front end the Task per request and its three coroutines (README, serving)."""
        if self._loop is None:  # called on the loop, as infer
            self._loop = asyncio.get_running_loop()
        if self._closing:
            raise Unavailable("the server is shutting down and accepts no new requests")
        cached = self._cached_policies(request.model_name)
        if cached is not None and cached[1] is not None:
            return None
        self.shm.resolve_inputs(request)  # as infer (it skips inputs already resolved, so a fallback to infer
        places = self.shm.output_places(request)  # after this reads the same)
        model = self.manager.get(request.model_name, request.model_version)
        if model.batcher is None or model.sequence or model.decoupled or model.response_cache:
            return None
        counted = Counted(self, model)
        counted.__enter__()
        try:
            item, wanted, priority, timeout = self._admit(model, request, counted)
            future = model.batcher.submit(item, priority=priority, timeout_us=timeout, then=partial(
                self._answer_then, then, counted, model, request, item, wanted, places, cached))
        except BaseException as exc:
            counted.__exit__(type(exc), exc, exc.__traceback__)  # a bug of ours raises Internal from here
            raise
        return future

    def _answer_then(self, then, counted: Counted, model: LoadedModel, request: InferRequest, item: WorkItem,
                     wanted: list[str], places, cached, future: asyncio.Future) -> None:
        """infer_then's answer: what _infer does after its batch, and infer after _infer."""
        try:
            try:
                response = self._respond(model, request, item, future.result(), wanted)
            except BaseException as exc:
                counted.__exit__(type(exc), exc, exc.__traceback__)
                raise
            counted.__exit__(None, None, None)
            self._deliver(request, response, cached, places)
        except BaseException as exc:  # noqa: BLE001 - the front end answers it
            if counted.trace is not None and counted.trace.front:  # no answer to send: the trace is done
                counted.trace.sent(0, 0)
            then(None, exc)
            return
        then(response, None)

    def _cached_policies(self, name: str):
        """(config, fallback policy, output monitor) of a model the repository knows, else None."""
        entry = self.manager.entries.get(name)
        if entry is None or entry.config is None:
            return None
        cached = self._policies.get(name)
        if cached is None or cached[0] is not entry.config:  # the config object changes on reload
            cached = self._policies[name] = self._policy(name, entry.config)
        return cached

    def _policy(self, name: str, config: mc.ModelConfig):
        window = window_of(config)
        monitor = None
        if window:
            shared = None
            if self.settings.shared_state_dir is not None:
                shared = SharedDriftStore(self.settings.shared_state_dir,
                                          drift_key(name, config.SerializeToString(deterministic=True)))
            monitor = OutputMonitor(window, shared=shared)
        return config, policy_of(config), monitor

    def infer_stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """The responses of one request: 0..n from a decoupled model (serve/decoupled.py), else infer's;
        the model's fallback and output monitor apply to both (infer's own, or stream_with_policies)."""
        try:
            model = self.manager.get(request.model_name, request.model_version)
        except Unavailable as exc:
            cached = self._cached_policies(request.model_name)
            if cached is None or cached[1] is None:
                raise
            return stream_with_policies(self, None, request, cached[1], cached[2], unavailable=exc)
        if not model.decoupled:
            return self._one(request)
        cached = self._cached_policies(request.model_name)
        if cached is None or (cached[1] is None and cached[2] is None):
            return stream(self, model, request)
        return stream_with_policies(self, model, request, cached[1], cached[2])

    def stream_unguarded(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """A fallback's responses: its own policies do not apply (as unary fallbacks run _infer)."""
        model = self.manager.get(request.model_name, request.model_version)
        return stream(self, model, request) if model.decoupled else self._one_unguarded(request)

    async def _one_unguarded(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        self.shm.resolve_inputs(request)
        places = self.shm.output_places(request)
        response = await self._infer(request)
        if places:
            self.shm.place_outputs(response, places)
        response.parameters[FINAL_FLAG] = True
        yield response

    async def _one(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """A model that answers once: its response is the stream's final one (Triton marks it so)."""
        response = await self.infer(request)
        response.parameters[FINAL_FLAG] = True
        yield response

    async def _infer(self, request: InferRequest, parent: Trace | None = None, sample: bool = True) -> InferResponse:
        """infer without the shutdown check: ensemble steps and BLS calls of requests in flight (``parent``:
        the trace of the request this is a step or BLS call of; ``sample`` False: not traced without one)."""
        model = self.manager.get(request.model_name, request.model_version)
        if model.decoupled:
            raise unary_refused(model)
        with Counted(self, model) as counted:
            start = counted.start
            item, wanted, priority, timeout = self._admit(model, request, counted, parent, sample)
            key = None
            if model.response_cache and self.cache is not None:  # serve/response_cache.py
                key, hit, looked_ns = cache_lookup(self.cache, model, item)
                if hit is not None:
                    return self._respond(model, request, item, hit, wanted)
            if model.batcher is None:
                # Triton's ensemble scheduler reports the ensemble's own queue (arrival to first step) and
                # compute counts per request; perf_analyzer finds an ensemble's version, when none is given,
                # by which version's queue count grew, so without them it fails ("failed to find the
                # requested model version"). Its compute is the steps' wall time (Triton: their sum).
                began = time.perf_counter_ns()
                run_step = self._run_step
                if item.trace is not None:  # its steps are traced as its children
                    item.trace.stamp("QUEUE_START")
                    run_step = partial(self._run_step, parent=item.trace)
                outputs = await run_ensemble(model.name, model.ensemble_plan, item.inputs, wanted, run_step)
                model.stats.executed(item.batch_size or 1, [began - start],
                                     Timing(infer_ns=time.perf_counter_ns() - began), ok=True)
            elif model.sequence:
                outputs = await self._sequencer(model).run(
                    request.parameters, item, lambda it: model.batcher.submit(it, priority=priority, timeout_us=timeout))
            else:
                outputs = await model.batcher.submit(item, priority=priority, timeout_us=timeout)
            response = self._respond(model, request, item, outputs, wanted)
            if key is not None:  # answered without an error: kept for the next request like it
                cache_insert(self.cache, model, key, outputs, looked_ns)
        return response

    def _sequencer(self, model: LoadedModel) -> Sequencer:
        entry = self._sequencers.get(id(model))
        if entry is None or entry[0] is not model:  # a model loaded again starts with no live sequences
            entry = self._sequencers[id(model)] = (model, Sequencer(model.name, model.config))
        return entry[1]

    def _admit(self, model: LoadedModel, request: InferRequest, counted: Counted, parent: Trace | None = None,
               sample: bool = True):
        """A request checked against its model and made the batch's work: (item, the outputs wanted,
        priority, timeout in µs); a failure from here on is the backend's (``counted``'s reason). Traced
        when the tracer samples it (``sample``), or always as a step or BLS call of a traced request
        (``parent``)."""
        item = self._prepare(model, request)
        priority = request_int(request, "priority") if "priority" in request.parameters else 0
        timeout = request_int(request, "timeout") if "timeout" in request.parameters else 0
        wanted = list(model.outputs) if item.outputs is None else requested_names(request)
        counted.reason = "BACKEND"
        trace = None
        if parent is not None:
            trace = item.trace = counted.trace = parent.child(model.name, model.version, request.id)
        elif sample and self.tracer.active:
            trace = item.trace = counted.trace = self.tracer.sample(model.name, model.version, request.id,
                                                                    request.trace_context)
            if trace is not None and request.front_end:
                trace.received(request.front_end, request.recv_start, request.recv_end)
        if trace is not None and trace.wants_tensors:  # the TENSORS level: the inputs as the request sent them
            for t in request.inputs:
                trace.tensor("TENSOR_QUEUE_INPUT", t.name, t.datatype, t.shape, item.inputs[t.name])
        return item, wanted, priority, timeout

    def _prepare(self, model: LoadedModel, request: InferRequest) -> WorkItem:
        inputs, batch = check_inputs(model, ((t.name, t.datatype, tuple(t.shape), t.data) for t in request.inputs),
                                    request.id)
        outputs = None if request.outputs is None else check_outputs(model, (o.name for o in request.outputs))
        return WorkItem(inputs=inputs, outputs=outputs, batch_size=max(batch, 0), request_id=request.id,
                        parameters=for_model(request.parameters))

    def _respond(self, model: LoadedModel, request: InferRequest, item: WorkItem,
                 outputs: dict[str, np.ndarray], wanted: list[str]) -> InferResponse:
        classes = {}
        if request.outputs:
            for out in request.outputs:
                k = out.parameters.get("classification")
                if k is not None and k != 0:
                    classes[out.name] = top_k(out.name, k)
        tensors = []
        batched = model.max_batch_size > 0
        for name in wanted:
            array = outputs.get(name)
            if array is None:  # a Python model may leave an output out, requested or not: Triton answers
                continue          # without it (checked against 2.51 in tests/serve/test_protocol_triton.py)
            array = output_array(model, item.batch_size, name, array)
            if name in classes:
                array = bytes_objects(classify(array, classes[name], model.labels.get(name), batched, name))
            datatype = _DTYPE_TO_WIRE.get(array.dtype) or output_datatype(model.name, name, array.dtype)
            tensors.append(InferTensor(name=name, datatype=datatype, shape=array.shape, data=array))
        response = InferResponse(model_name=model.name, model_version=model.version_str, outputs=tensors, id=request.id)
        trace = item.trace
        if trace is not None:
            if trace.wants_tensors:
                for t in tensors:
                    trace.tensor("TENSOR_BACKEND_OUTPUT", t.name, t.datatype, t.shape, t.data)
            if not trace.parent_id:  # a step's response goes to its ensemble (as Triton's)
                trace.stamp("INFER_RESPONSE_COMPLETE")
                if trace.front:  # the front-end sending it reports the send (Trace.sent)
                    response.trace = trace
        return response

    async def _run_step(self, model_name: str, version: str, feed: dict[str, np.ndarray],
                        wanted: list[str], parent: Trace | None = None) -> dict[str, np.ndarray]:
        """One ensemble step, straight into its model's batcher (serve/ensemble.py), counted in the model's
        statistics as a request of its own (as Triton reports composing models); traced as the child of the
        ensemble request's trace (``parent``), if any."""
        model = self.manager.get(model_name, version)
        if model.batcher is None or model.sequence or model.decoupled:
            return await self._step_request(model_name, version, feed, wanted, parent)
        with Counted(self, model) as counted:
            item = step_item(model, feed, wanted)
            counted.reason = "BACKEND"
            trace = None
            if parent is not None:  # a step has its ensemble request's id (as Triton's)
                trace = item.trace = counted.trace = parent.child(model.name, model.version, parent.request_id)
            outputs = step_outputs(model, item, await model.batcher.submit(item), wanted)
            if trace is not None and trace.wants_tensors:
                trace_tensors(trace, feed, outputs)
        return outputs

    async def _step_request(self, model_name: str, version: str, feed: dict[str, np.ndarray],
                            wanted: list[str], parent: Trace | None = None) -> dict[str, np.ndarray]:
        """A step to a nested ensemble, a decoupled or a sequence model: the full request path."""
        request = step_request(model_name, version, feed, wanted, "" if parent is None else parent.request_id)
        model = self.manager.get(model_name, version)
        if model.decoupled:  # reloaded as decoupled after the ensemble loaded (else the ensemble would be)
            raise Unavailable(f"step model '{model_name}' is decoupled now, and the ensemble calling it was loaded "
                              "when it was not", fix="load the ensemble again: it then streams its answers")
        response = await self._infer(request, parent)
        return {t.name: t.data for t in response.outputs}

    @property
    def in_flight(self) -> int:
        """Requests received and not answered yet; after :meth:`shutdown`, those its timeout abandoned."""
        return self._inflight
