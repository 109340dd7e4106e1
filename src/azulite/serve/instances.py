"""Model instances in their own processes (as Triton's Python backend runs each instance in a stub):
two instances of a Python model whose code holds the GIL then run at the same time on two cores.

The batcher drives a :class:`ProcessInstance` exactly like an in-process one: ``execute`` runs in the
instance's thread, writes the batch's inputs into a shared-memory arena (serve/shm_ring.py; each
input's rows of every request back to back, one block and one descriptor per input, ipc.pack_dicts),
sends a small header over a socketpair and waits; the instance process reads the inputs in place,
executes, writes the outputs into its own arena the same way and answers with their descriptors. Each
side makes one sendmsg and one recv per frame (ipc.Channel), so a batch costs four syscalls and one
wake-up per direction, and no wait4: a process that died idle refuses the next send. One batch at a time
per instance, so each arena is simply reset per batch. An instance process that dies fails the batch it
was running and is started again (counted: ``azulite_instance_restarts_total``). Outputs that cannot
cross never end the process: one with no Triton datatype fails its request as in a thread
(checks.output_datatype), anything else that cannot be written fails its batch. The process's own
side: serve/instances_child.py.

Which instances go out of process (serve/manager.py asks :func:`wants_process`): Python models that
are not decoupled and make no BLS call (their response senders and BLS calls need the server's own
loop); everything else stays a thread. Per model, config.pbtxt's parameter ``azulite_instance_process``
decides: "true" (each instance its own process, as Triton's Python backend always runs them), "false"
(threads of the server), "auto" (the default): processes in the model host of ``azulite serve --workers
N``, whose loop serves the front-ends, threads in a single-process server (see README: instance
processes, for the measurements behind that default). KIND_GPU instances get ``CUDA_VISIBLE_DEVICES`` set
to their group's GPU in their process. ``azulite_instance_nice`` (an integer, -20..19; unset: the
server's own) sets the instance processes' scheduling priority, for where the cores are short: 10 (below
the loop, which a wake-up then runs at once instead of queueing it behind a spinning instance while
another core idles) measured 1.02-1.34x Triton's throughput on a GIL-bound model on an idle 2-core
machine (unset: 0.89-1.08x); -5 (ahead of the loop, so it dispatches later, to larger batches) gained
where other work took the cores (README: instance processes). Below the server's own value it needs
CAP_SYS_NICE; without it the instances keep the server's priority and the load says so in the log.

The batcher sends every batch for an instance process from its event loop
(:meth:`ProcessInstance.start_batch`: the header sent, the answer parsed by a reader callback; no
thread between), which measured 1.04-1.25x the throughput of the thread hand-off on gil_py idle (README:
instance processes). The socket stays registered with that loop between batches; a crossing from a
thread (warm-up at load, a restart) or inline on the loop takes it off first (:meth:`_detach`) and sets
it blocking again (uvloop's poller leaves it non-blocking, on which a thread's blocking crossing failed;
tests/serve/test_instances.py catches both). A process that dies idle is then seen by the loop at once
(its socket reads EOF) and started again before the next batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from pathlib import Path

from azulite.errors import Internal, ModelLoadError, Unavailable
from azulite.serve import ipc, shm_ring
from azulite.serve.backends.base import LoadContext, Result, Timing, WorkItem
from azulite.serve.proto import model_config_pb2 as mc

log = logging.getLogger("azulite.serve.instances")
ARENA_BYTES = 64 * 1024 * 1024
#: config.pbtxt parameter: "true" | "false" | "auto" (see the module's docstring)
PARAM = "azulite_instance_process"
_CHOICES = {"true": "true", "yes": "true", "1": "true", "false": "false", "no": "false", "0": "false",
            "auto": "auto", "": "auto"}
#: config.pbtxt parameter: the instance processes' nice value (-20..19)
NICE_PARAM = "azulite_instance_nice"
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


def instance_nice(config: mc.ModelConfig) -> int | None:
    """The model's ``azulite_instance_nice`` (None: unset); a wrong value fails the load, naming it."""
    if NICE_PARAM not in config.parameters:
        return None
    text = config.parameters[NICE_PARAM].string_value.strip()
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not -20 <= value <= 19:
        raise ModelLoadError(f"model '{config.name}': parameter '{NICE_PARAM}' must be an integer from -20 to 19, "
                             f"got {text!r}", where=f"model '{config.name}' config.pbtxt",
                             fix=f'parameters {{ key: "{NICE_PARAM}" value: {{ string_value: "10" }} }}')
    return value


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
                             fix='remove the parameter or set it to "false"')
    return not why_not and (choice == "true" or host)


class ProcessInstance:
    # execute waits on its process, never on this server: short batches may run inline on the loop (the
    # batcher decides), which saves a thread hop per batch on top of the process hop
    inline_safe = True
    # its execute waits on the process (little CPU of its own): the batcher judges it by the wall clock
    inline_by_wall = True
    # a Python model's execute sees each client request: coalesced ones are cut back (serve/coalesce.py)
    per_request = True

    def __init__(self, backend: str, ctx: LoadContext, *, gpu: int | None = None) -> None:
        self.backend = backend
        self.ctx = dataclasses.replace(ctx, bls=None)
        self.gpu = gpu
        self.key = (ctx.model_name, ctx.instance_name)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._chan: ipc.Channel | None = None
        self._dead = False  # its process ended (seen by a failed crossing): start another before the next batch
        self._arenas_open = False
        self._watched = None  # the event loop its socket stays registered with (start_batch), if any
        self._watched_fd = -1
        self._done = None  # the loop-side batch in flight: its callback
        self.nice = instance_nice(ctx.config)
        self._code = code_digest(ctx.model_file)  # what a restart must find again (_restart)
        self._spawn()

    def _spawn(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        # the model and instance names in the command line: what `ps` shows
        self._proc = subprocess.Popen([sys.executable, "-m", "azulite.serve.instances_child", str(theirs.fileno()),
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
        self._chan = ipc.Channel(mine)
        self._dead = False
        try:
            header, _ = self._chan.recv()
        except ConnectionError:
            self._reap()
            raise ModelLoadError(f"failed to load model '{self.ctx.model_name}': its instance process "
                                 f"{self.ctx.instance_name} exited while loading (see the server log)") from None
        if header[0] == "e":
            self._reap()
            raise ipc.rebuild_error(header[1])
        if self.nice is not None:
            self._set_nice()

    def _set_nice(self) -> None:
        """Every thread of the instance process at ``self.nice``, once its model has loaded: Linux keeps a
        nice value per thread, so each one that exists then is set (the main thread and e.g. a BLAS pool
        the import or the load started), and every thread made later inherits its maker's."""
        try:
            for tid in os.listdir(f"/proc/{self._proc.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), self.nice)
        except PermissionError:
            log.warning("model '%s' instance %s: %s %d needs CAP_SYS_NICE (below the server's own priority); "
                        "its process keeps the server's", self.ctx.model_name, self.ctx.instance_name, NICE_PARAM,
                        self.nice)
            self.nice = None  # said once: a restarted process keeps the server's priority too
        except (ProcessLookupError, FileNotFoundError):  # it died since: the next batch finds out and restarts it
            pass

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
        # the batch's inputs, each name's rows back to back in one block (ipc.pack_dicts)
        inputs = ipc.pack_dicts(self.inputs, [item.inputs for item in items], packed)
        metas = [(None if item.outputs is None else sorted(item.outputs), item.batch_size, item.request_id,
                  item.parameters) for item in items]
        return ("x", metas, inputs, packed.refs), packed

    def _died(self, while_: str) -> Internal:
        code = self._proc.poll() if self._proc is not None else None
        return Internal(f"model '{self.ctx.model_name}': instance process {self.ctx.instance_name} died "
                        f"(exit code {code}) {while_}; it is started again")

    def _results(self, header: tuple, inline: memoryview) -> tuple[list[Result], Timing]:
        if header[0] == "e":
            raise ipc.rebuild_error(header[1])
        _, errors, outputs, refs, timing = header
        # one copy of each stacked output out of the arena (the instance reuses it for its next batch)
        answered = iter(ipc.unpack_dicts(self._out, inline, outputs, refs, copy=True))
        results: list[Result] = [ipc.rebuild_error(e) if e is not None else next(answered) for e in errors]
        return results, Timing(*timing)

    def execute(self, items: list[WorkItem]) -> tuple[list[Result], Timing]:
        """From a thread (warm-up at load, a batcher without :meth:`start_batch`, a restart) or inline on
        the loop: the socket off the loop first, and blocking (uvloop's poller made it non-blocking; a
        blocking recv would then fail at once instead of waiting for the answer)."""
        self._detach()
        if self._sock is not None:
            self._sock.setblocking(True)
        for attempt in (1, 2):
            # no poll (a wait4) per batch: a process that died idle refuses the send below (EPIPE: its
            # end of the socketpair closed with it), and one that died in a batch failed that batch
            if self._proc is None or self._dead:
                self._restart()
            header, packed = self._pack(items)
            try:
                self._chan.send(header, packed.inline)  # type: ignore[union-attr]
            except OSError:
                # gone before the batch reached it (it died idle): the batch never ran, so it goes to the
                # process started in its place
                self._proc.wait()  # type: ignore[union-attr]
                self._dead = True
                if attempt == 1:
                    continue
                raise Internal(f"model '{self.ctx.model_name}': instance process {self.ctx.instance_name} "
                               "exits as soon as it starts") from None
            try:
                answer, inline = self._chan.recv()  # type: ignore[union-attr]
            except (ConnectionError, OSError):
                self._end()
                self._dead = True
                raise self._died("while executing") from None
            return self._results(answer, inline)
        raise AssertionError("unreachable")

    def start_batch(self, loop, items: list[WorkItem], done) -> None:
        """Cross from the event loop itself, without a thread: send the batch, and when the answer is
        readable call ``done((results, timing), None)`` (or ``done(None, error)``) on the loop. One batch
        at a time, as with execute. A process to start again, or inputs too large for the arena, go
        through :meth:`execute` in a thread instead (rare; a start takes ~0.3 s, which the loop must not
        wait out). Measured against the thread hand-off (two instance processes of an echo model kept
        busy from uvloop, batches of 8, interleaved pairs): 82-118 vs 112-149 µs of the server's CPU per
        batch over eight pairs at load 9-10, 94-102 vs 110-143 over three at load 13-15, lower in every
        pair; wall time per batch 0.8-1.9x in the first eight, 1.4-3.6x in the last three (on a machine
        that loaded, a process with three runnable threads gets more turns than one with one).

        The socket stays registered with the loop from one batch to the next (:meth:`_watch`): adding and
        removing uvloop's reader per batch cost 6 ``epoll_ctl``, 2 ``ioctl`` and 1 ``io_uring_enter``
        (``strace -c -f``, 4,100 batches; none with it kept), and in the same isolation, interleaved in
        one process (20 blocks of 600 batches each way, 2026-11-24 06:10 UTC, load average 12.7) the
        loop's CPU per batch fell from a median 126 to 85 µs (lower in 16 blocks of 20); wall time per
        batch moved 0.13-5.9x from block to block at that load, nothing to read from it. A crossing from
        a thread (warm-up, a restart) or inline on the loop takes it off the loop first (:meth:`_detach`),
        so only one side ever reads the socket."""
        if self._proc is None or self._dead or self._chan is None:
            self._detach()
            self._in_thread(loop, items, done)
            return
        header, packed = self._pack(items)
        if packed.inline_bytes:
            self._detach()
            self._in_thread(loop, items, done)
            return
        self._watch(loop)
        try:
            # the peer has read everything sent before (one batch at a time), so a small header fits in the
            # socket's buffer at once, non-blocking as the loop's poller left it or not
            self._chan.send(header)  # type: ignore[union-attr]
        except OSError:
            self._detach()
            self._proc.wait()  # type: ignore[union-attr] # died idle: the batch never ran; execute starts another
            self._dead = True
            self._in_thread(loop, items, done)
            return
        self._done = done

    def _watch(self, loop) -> None:
        """Keep the socket registered with ``loop`` (once: it stays between batches)."""
        if self._watched is loop:
            return
        self._detach()
        self._watched_fd = self._sock.fileno()  # type: ignore[union-attr]
        loop.add_reader(self._watched_fd, self._readable)
        self._watched = loop

    def _readable(self) -> None:
        """The loop's reader: the answer of the batch in flight, or the end of a process that died (idle
        or in that batch)."""
        try:
            frame = self._chan.try_recv()  # type: ignore[union-attr]
            if frame is None:
                return  # part of the answer: wait for the rest
        except (ConnectionError, OSError):
            done, self._done = self._done, None
            self._unwatch()
            self._end()
            self._dead = True
            if done is not None:
                done(None, self._died("while executing"))
            return
        done, self._done = self._done, None
        if done is None:  # nothing asked: never sent by a live instance process
            log.warning("instance process %s of model '%s' answered no batch", self.ctx.instance_name,
                        self.ctx.model_name)
            return
        try:
            outcome, error = self._results(*frame), None
        except Exception as exc:  # noqa: BLE001 - the batch's error (e.g. the model's own)
            outcome, error = None, exc
        done(outcome, error)

    def _unwatch(self) -> None:
        """Off the loop (on the loop's thread, or with the loop stopped), the socket blocking again
        (uvloop's poller made it non-blocking) for the thread crossings."""
        loop, self._watched = self._watched, None
        if loop is None:
            return
        try:
            loop.remove_reader(self._watched_fd)
        except (RuntimeError, ValueError, OSError):  # a closed loop: nothing is watched any more
            pass
        if self._sock is not None:
            self._sock.setblocking(True)

    def _detach(self) -> None:
        """Take the socket off the loop watching it, from any thread: on the loop's own thread (or with
        the loop not running) at once, else on the loop, waiting for it (a thread's crossing then reads
        the answer itself)."""
        loop = self._watched
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or not loop.is_running():
            self._unwatch()
            return
        off = threading.Event()

        def unwatch() -> None:
            self._unwatch()
            off.set()

        try:
            loop.call_soon_threadsafe(unwatch)
        except RuntimeError:  # closed meanwhile
            self._unwatch()
            return
        if not off.wait(30):  # the loop stopped before it ran: nothing watches the socket now
            self._unwatch()

    def _in_thread(self, loop, items, done) -> None:
        def finished(f) -> None:
            if f.cancelled():
                done(None, Internal(f"model '{self.ctx.model_name}': the batch was cancelled"))
            elif f.exception() is not None:
                done(None, f.exception())
            else:
                done(f.result(), None)

        loop.run_in_executor(None, self.execute, items).add_done_callback(finished)

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
        if code_digest(self.ctx.model_file) != self._code:
            # a new process imports the files as they are now: code that was never loaded (nor, under
            # --verify, checked against the manifest), beside instances still running the loaded code
            log.error("model '%s': its code changed since it loaded: instance process %s not started again",
                      self.ctx.model_name, self.ctx.instance_name)
            raise Unavailable(f"model '{self.ctx.model_name}': instance process {self.ctx.instance_name} died and its "
                              f"code ({self.ctx.model_file.parent.name}/*.py) changed since the model loaded: not "
                              "started again on code that was not loaded",
                              fix=f"load model '{self.ctx.model_name}' again (the load API, or poll mode)")
        with _restarts_lock:
            restarts[self.key] = restarts.get(self.key, 0) + 1
        self._spawn()

    def close(self) -> None:
        self._detach()  # before the socket closes: a loop must never watch a closed (or reused) descriptor
        if self._sock is not None:
            self._sock.setblocking(True)
            try:
                ipc.send_frame(self._sock, ("q",))
            except OSError:
                pass
        self._reap()


def code_digest(model_file: Path) -> str:
    """sha256 of a Python model's code: its model file and every .py file under its version directory (what
    a started process imports), by relative path; "" when it cannot be read (the start then fails itself)."""
    root = model_file.parent
    digest = hashlib.sha256()
    try:
        for path in sorted({model_file, *root.rglob("*.py")}):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    except OSError:
        return ""
    return digest.hexdigest()


def restart_metrics():
    from prometheus_client.core import Metric

    metric = Metric("azulite_instance_restarts", "Model instance processes started again after dying", "counter")
    with _restarts_lock:
        for (model, instance), n in sorted(restarts.items()):
            metric.add_sample("azulite_instance_restarts_total", {"model": model, "instance": instance}, n)
    yield metric
