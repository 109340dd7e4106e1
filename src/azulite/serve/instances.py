"""Model instances in their own processes (as Triton's Python backend runs each instance in a stub):
two instances of a Python model whose code holds the GIL then run at the same time on two cores.

The batcher drives a :class:`ProcessInstance` exactly like an in-process one: ``execute`` runs in the
instance's thread, writes the batch's inputs into a shared-memory arena (serve/shm_ring.py), sends a
small header over a socketpair and waits; the instance process reads the inputs in place, executes,
writes the outputs into its own arena and answers with their descriptors. One batch at a time per
instance, so each arena is simply reset per batch. An instance process that dies fails the batch it
was running and is started again (counted: ``azulite_instance_restarts_total``).

Which instances go out of process (serve/manager.py asks :func:`wants_process`): Python models that
are not decoupled and make no BLS call (their response senders and BLS calls need the server's own
loop); everything else stays a thread. Per model, config.pbtxt's parameter ``azulite_instance_process``
decides: "true" (each instance its own process, as Triton's Python backend always runs them), "false"
(threads of the server), "auto" (the default): processes in the model host of ``azulite serve --workers
N``, whose loop serves the front-ends, threads in a single-process server (see README: instance
processes, for the measurements behind that default). KIND_GPU instances get ``CUDA_VISIBLE_DEVICES``
set to their group's GPU in their process.

The batcher drives an instance process as a thread-backed instance (its ``execute`` blocks on the
socket in the instance's thread, or inline on the loop for short single-instance batches). A crossing
awaited on the loop itself (a reader callback, no thread) was built and measured against this: under
load (average 8-11 on 2 cores) it answered gil_py through ``--workers 2`` at 0.50-0.72x the throughput of
the thread crossing, at 1.0-1.17x its CPU per inference, so it is not used (README: instance processes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading

from azulite.errors import Internal, ModelLoadError, ServeError
from azulite.serve import ipc, shm_ring
from azulite.serve.backends.base import LoadContext, Result, Timing, WorkItem
from azulite.serve.proto import model_config_pb2 as mc

log = logging.getLogger("azulite.serve.instances")
ARENA_BYTES = 64 * 1024 * 1024
#: config.pbtxt parameter: "true" | "false" | "auto" (see the module's docstring)
PARAM = "azulite_instance_process"
_CHOICES = {"true": "true", "yes": "true", "1": "true", "false": "false", "no": "false", "0": "false",
            "auto": "auto", "": "auto"}
#: (model, instance) -> times its process was started again after dying
restarts: dict[tuple[str, str], int] = {}
_restarts_lock = threading.Lock()


def placement(config: mc.ModelConfig) -> str:
    """The model's ``azulite_instance_process`` choice: "true", "false" or "auto" (a wrong value fails
    the load, naming the parameter)."""
    if PARAM not in config.parameters:
        return "auto"
    text = config.parameters[PARAM].string_value.strip().lower()
    if text not in _CHOICES:
        raise ModelLoadError(f"model '{config.name}': parameter '{PARAM}' must be true, false or auto, got "
                             f"{config.parameters[PARAM].string_value!r}", where=f"model '{config.name}' config.pbtxt",
                             fix=f'parameters {{ key: "{PARAM}" value: {{ string_value: "true" }} }}')
    return _CHOICES[text]


def _eligible(config: mc.ModelConfig, backend: str, model_file) -> str:
    """Why this model's instances cannot leave the server's process ("" when they can)."""
    if backend != "python":
        return f"its backend is {backend or 'ensemble'}, not python"
    if config.model_transaction_policy.decoupled:
        return "it is decoupled (its response sender needs the server's loop)"
    try:
        source = model_file.read_text(errors="replace")
    except OSError:
        return f"its {model_file} cannot be read"
    if "InferenceRequest" in source or "InferenceResponseSender" in source:
        return "it makes BLS calls (they need the server's loop)"
    return ""


def wants_process(config: mc.ModelConfig, backend: str, model_file, *, host: bool = False) -> bool:
    """Whether this model's instances run as processes of their own. ``host``: the server is the model
    host of ``--workers N`` (where "auto" means processes)."""
    choice = placement(config)
    if choice == "false" or (choice == "auto" and not host):
        return False
    why_not = _eligible(config, backend, model_file)
    if choice == "true" and why_not:
        raise ModelLoadError(f"model '{config.name}': parameter '{PARAM}' is true but its instances cannot run "
                             f"in processes of their own: {why_not}", where=f"model '{config.name}' config.pbtxt",
                             fix=f'remove the parameter or set it to "false"')
    return not why_not and (choice == "true" or host)


class ProcessInstance:
    # execute waits on its process, never on this server: short batches may run inline on the loop (the
    # batcher decides), which saves a thread hop per batch on top of the process hop
    inline_safe = True
    # its execute waits on the process (little CPU of its own): the batcher judges it by the wall clock
    inline_by_wall = True

    def __init__(self, backend: str, ctx: LoadContext, *, gpu: int | None = None) -> None:
        self.backend = backend
        self.ctx = dataclasses.replace(ctx, bls=None)
        self.gpu = gpu
        self.key = (ctx.model_name, ctx.instance_name)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._arenas_open = False
        self._spawn()

    def _spawn(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        # the model and instance names in the command line: what `ps` shows
        self._proc = subprocess.Popen([sys.executable, "-m", "azulite.serve.instances", str(theirs.fileno()),
                                       self.ctx.model_name, self.ctx.instance_name],
                                      pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self.inputs = shm_ring.Arena(ARENA_BYTES)
        out_fd = os.memfd_create("azulite-instance-out", os.MFD_CLOEXEC)
        os.ftruncate(out_fd, ARENA_BYTES)
        # the config as protobuf bytes (tritonclient's generated classes do not pickle)
        hello = (self.backend, dataclasses.replace(self.ctx, config=None), self.ctx.config.SerializeToString())
        socket.send_fds(mine, [pickle.dumps(hello, ipc.PROTOCOL)], [self.inputs.fd, out_fd])
        self._out_map, self._out = shm_ring.attach(out_fd)
        self._arenas_open = True
        self._sock = mine
        try:
            header, _ = ipc.recv_frame(mine)
        except ConnectionError:
            self._reap()
            raise ModelLoadError(f"failed to load model '{self.ctx.model_name}': its instance process "
                                 f"{self.ctx.instance_name} exited while loading (see the server log)") from None
        if header[0] == "e":
            self._reap()
            raise ipc.rebuild_error(header[1])

    def _reap(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._arenas_open:  # once: a restart that failed to load has reaped them already
            self._arenas_open = False
            self.inputs.close()
            self._out.release()
            try:
                self._out_map.close()
            except BufferError:
                pass

    def _pack(self, items: list[WorkItem]) -> tuple[tuple, shm_ring.Packed]:
        self.inputs.reset()  # the previous batch is answered: its blocks are free
        packed = shm_ring.Packed()
        metas = []
        for item in items:
            names = list(item.inputs)
            start = len(packed.refs)
            shm_ring.put(self.inputs, [item.inputs[n] for n in names], packed)
            metas.append((names, start, None if item.outputs is None else sorted(item.outputs),
                          item.batch_size, item.request_id, item.parameters))
        return ("x", metas, packed.refs), packed

    def _died(self, while_: str) -> Internal:
        code = self._proc.poll() if self._proc is not None else None
        return Internal(f"model '{self.ctx.model_name}': instance process {self.ctx.instance_name} died "
                        f"(exit code {code}) {while_}; it is started again")

    def _results(self, header: tuple, inline: memoryview) -> tuple[list[Result], Timing]:
        if header[0] == "e":
            raise ipc.rebuild_error(header[1])
        _, results_meta, refs, timing = header
        results: list[Result] = []
        for entry in results_meta:
            if entry[0] == "e":
                results.append(ipc.rebuild_error(entry[1]))
            else:
                results.append({name: shm_ring.take(self._out, inline, refs[i], copy=True)
                                for name, i in entry[1]})
        return results, Timing(*timing)

    def execute(self, items: list[WorkItem]) -> tuple[list[Result], Timing]:
        """From a thread (warm-up at load, or a batch too big for the arena)."""
        for attempt in (1, 2):
            if self._proc is None or self._proc.poll() is not None:
                self._restart()
            header, packed = self._pack(items)
            try:
                ipc.send_frame(self._sock, header, packed.inline)  # type: ignore[arg-type]
            except OSError:
                # gone before the batch reached it (it died idle): the batch never ran, so it goes to the
                # process started in its place
                self._proc.wait()  # type: ignore[union-attr]
                if attempt == 1:
                    continue
                raise Internal(f"model '{self.ctx.model_name}': instance process {self.ctx.instance_name} "
                               "exits as soon as it starts") from None
            try:
                answer, inline = ipc.recv_frame(self._sock)  # type: ignore[arg-type]
            except (ConnectionError, OSError):
                self._end()
                raise self._died("while executing") from None
            return self._results(answer, inline)
        raise AssertionError("unreachable")

    def _end(self) -> None:
        """Make sure the process is gone and reaped (it may be exiting already: its exit code stays)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                try:
                    self._proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
            self._proc.wait()

    def _restart(self) -> None:
        log.warning("instance process %s of model '%s' died: starting it again", self.ctx.instance_name,
                    self.ctx.model_name)
        self._reap()
        with _restarts_lock:
            restarts[self.key] = restarts.get(self.key, 0) + 1
        self._spawn()

    def close(self) -> None:
        if self._sock is not None:
            try:
                ipc.send_frame(self._sock, ("q",))
            except OSError:
                pass
        self._reap()


def restart_metrics():
    from prometheus_client.core import Metric

    metric = Metric("azulite_instance_restarts", "Model instance processes started again after dying", "counter")
    with _restarts_lock:
        for (model, instance), n in sorted(restarts.items()):
            metric.add_sample("azulite_instance_restarts_total", {"model": model, "instance": instance}, n)
    yield metric


# --- the instance process ------------------------------------------------------------------------------

def _serve(sock: socket.socket) -> None:
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    backend_name, ctx, config = pickle.loads(msg)
    ctx = dataclasses.replace(ctx, config=mc.ModelConfig.FromString(config))
    in_map, in_view = shm_ring.attach(fds[0])
    out = shm_ring.Arena(fd=fds[1])
    from azulite.serve.backends.base import get_backend

    try:
        instance = get_backend(backend_name).load(ctx)
    except Exception as exc:  # noqa: BLE001 - the host reports the load failure
        ipc.send_frame(sock, ("e", ipc.error_tuple(exc if isinstance(exc, ServeError) else ModelLoadError(
            f"failed to load model '{ctx.model_name}': {type(exc).__name__}: {exc}"))))
        return
    if ctx.compute_threads:
        import threadpoolctl

        threadpoolctl.threadpool_limits(limits=ctx.compute_threads, user_api="blas")
    ipc.send_frame(sock, ("o",))
    try:
        while True:
            try:
                header, inline = ipc.recv_frame(sock)
            except (ConnectionError, OSError):
                return
            if header[0] == "q":
                return
            _, metas, refs = header
            items = []
            for names, start, outputs, batch_size, rid, parameters in metas:
                inputs = {n: shm_ring.take(in_view, inline, refs[start + k], copy=False) for k, n in enumerate(names)}
                items.append(WorkItem(inputs=inputs, outputs=None if outputs is None else frozenset(outputs),
                                      batch_size=batch_size, request_id=rid, parameters=parameters))
            try:
                results, timing = instance.execute(items)
            except Exception as exc:  # noqa: BLE001 - fails the batch, as in-process
                ipc.send_frame(sock, ("e", ipc.error_tuple(exc)))
                continue
            out.reset()
            packed = shm_ring.Packed()
            answers = []
            for result in results:
                if isinstance(result, BaseException):
                    answers.append(("e", ipc.error_tuple(result)))
                    continue
                names = list(result)
                start = len(packed.refs)
                shm_ring.put(out, [result[n] for n in names], packed)
                answers.append(("o", [(n, start + k) for k, n in enumerate(names)]))
            ipc.send_frame(sock, ("r", answers, packed.refs, (timing.input_ns, timing.infer_ns, timing.output_ns)),
                           packed.inline)
    finally:
        instance.close()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when an instance stops
    sock = socket.socket(fileno=int(argv[0]))
    with sock:
        _serve(sock)


if __name__ == "__main__":
    main(sys.argv[1:])
