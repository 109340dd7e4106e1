"""The instance process of serve/instances.py (``python -m azulite.serve.instances_child FD MODEL
INSTANCE``; ``ps`` shows the model and instance): it gets the model's backend, load context and config and
both arenas' descriptors over its socket, loads the model, answers "o", then runs one batch per frame
until told to quit ("q") or its socket closes: the inputs read in place from the server's arena, the
outputs written into its own, the descriptors sent back. A batch's failure is answered, never the end
of the process: the model's exception fails the batch, an output with no Triton datatype fails its
request (as a thread instance's would, checks.output_datatype), one that cannot be written fails the
batch."""

from __future__ import annotations

import dataclasses
import pickle
import signal
import socket
import sys

from azulite.errors import Internal, ModelLoadError, ServeError
from azulite.serve import config as cfg
from azulite.serve import ipc, log_settings, shm_ring
from azulite.serve.backends.base import WorkItem, get_backend
from azulite.serve.checks import output_datatype
from azulite.serve.proto import model_config_pb2 as mc

#: the numpy dtypes an output can cross as without a look at it (checks.output_datatype for the rest)
_WIRE_DTYPES = frozenset(cfg.NUMPY_TO_WIRE)


def _serve(sock: socket.socket) -> None:
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    backend_name, ctx, config = pickle.loads(msg)
    ctx = dataclasses.replace(ctx, config=mc.ModelConfig.FromString(config))
    in_map, in_view = shm_ring.attach(fds[0])
    out = shm_ring.Arena(fd=fds[1])
    try:
        instance = get_backend(backend_name).load(ctx)
    except Exception as exc:  # noqa: BLE001 - the host reports the load failure
        ipc.send_frame(sock, ("e", ipc.error_tuple(exc if isinstance(exc, ServeError) else ModelLoadError(
            f"failed to load model '{ctx.model_name}': {type(exc).__name__}: {exc}"))))
        return
    if ctx.compute_threads:
        import threadpoolctl

        threadpoolctl.threadpool_limits(limits=ctx.compute_threads, user_api="blas")
    chan = ipc.Channel(sock)
    chan.send(("o",))
    try:
        while True:
            try:
                header, inline = chan.recv()
            except (ConnectionError, OSError):
                return
            if header[0] == "q":
                return
            _, metas, inputs, refs = header
            # read in place: the server rewrites its arena only after this batch is answered
            items = [WorkItem(inputs=d, outputs=None if outputs is None else frozenset(outputs),
                              batch_size=batch_size, request_id=rid, parameters=parameters)
                     for d, (outputs, batch_size, rid, parameters)
                     in zip(ipc.unpack_dicts(in_view, inline, inputs, refs, copy=False), metas)]
            try:
                results, timing = instance.execute(items)
            except Exception as exc:  # noqa: BLE001 - fails the batch, as in-process
                chan.send(("e", ipc.error_tuple(exc)))
                continue
            out.reset()
            packed = shm_ring.Packed()
            results = [_answerable(ctx.model_name, r) for r in results]
            errors = [ipc.error_tuple(r) if isinstance(r, BaseException) else None for r in results]
            try:
                outputs = ipc.pack_dicts(out, [r for r in results if not isinstance(r, BaseException)], packed)
            except Exception as exc:  # noqa: BLE001 - outputs that cannot cross fail the batch, not the process
                chan.send(("e", ipc.error_tuple(Internal(
                    f"model '{ctx.model_name}': instance process {ctx.instance_name} could not pass the batch's "
                    f"outputs back: {type(exc).__name__}: {exc}"))))
                continue
            chan.send(("r", errors, outputs, packed.refs, (timing.input_ns, timing.infer_ns, timing.output_ns)),
                      packed.inline)
    finally:
        instance.close()


def _answerable(model: str, result):
    """A request's outputs, or the error a thread instance would answer for them (checks.output_datatype:
    an output with no Triton datatype, which could not cross to the server either)."""
    if isinstance(result, BaseException):
        return result
    for name, array in result.items():
        if array.dtype not in _WIRE_DTYPES:
            try:
                output_datatype(model, name, array.dtype)
            except Internal as exc:
                return exc
    return result


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when an instance stops
    # a Python model's pb_utils.Logger lines reach the server's log, as the server's settings say
    log_settings.install(prefix=f"{argv[2] if len(argv) > 2 else 'instance'}[%(process)d] ")
    sock = socket.socket(fileno=int(argv[0]))
    with sock:
        _serve(sock)


if __name__ == "__main__":
    main(sys.argv[1:])
