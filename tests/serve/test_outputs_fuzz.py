"""A Python model's outputs as random as numpy allows (every dtype numpy has a name for, Triton's or not,
any shape, C / Fortran / strided layouts, BYTES arrays holding bytes, text and numbers), answered by the
same model as threads and as instance processes, read by tritonclient over HTTP (binary and JSON outputs)
and gRPC: each answer is what Triton's rules make of the model's own array (recomputed here from the same
seed), and an output with no Triton datatype is INTERNAL naming it. ``make test`` runs 200 seeds; ``make
soak`` (AZULITE_SOAK=1) 3,000 more. Real Triton 2.51 answers 120 seeds of the same model the same, bar
two documented leniencies of azulite's (triton_refuses)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from .frontends import running_server

# the model's own arrays: the test runs the same function to know what each answer must be
MAKE = '''
import numpy as np

DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
          "uint64", "bool", ">f4", "complex64", "object", "S3", "U2", "datetime64[s]"]


def make(seed, rows):
    rng = np.random.default_rng(seed)
    dtype = DTYPES[rng.integers(len(DTYPES))]
    shape = (rows,) + tuple(int(rng.integers(0, 4)) for _ in range(int(rng.integers(0, 3))))
    base = rng.standard_normal(shape) * 100
    if dtype == "object":
        pool = [b"ab", "x\\u00e9", 7, 2.5, b"", np.str_("s")]
        y = np.empty(base.size, dtype=object)
        y[:] = [pool[i] for i in rng.integers(len(pool), size=base.size)]
        y = y.reshape(shape)
    elif dtype[0] in "SU":
        y = base.astype(int).astype(dtype)
    else:
        y = base.astype(dtype)
    layout = int(rng.integers(3))
    if layout == 1 and y.ndim >= 2:
        y = np.asfortranarray(y)
    elif layout == 2 and y.ndim >= 2 and y.shape[1] > 1:
        y = np.repeat(y, 2, axis=1)[:, ::2]
    return y
'''
MODEL = MAKE + '''

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = r.inputs()[0].as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", make(int(x[0, 0]), len(x)))]))
        return out
'''
CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
parameters {{ key: "azulite_instance_process" value: {{ string_value: "{processes}" }} }}
'''
TRITON_TYPES = {"float32": "FP32", "float64": "FP64", "float16": "FP16", "int8": "INT8", "uint8": "UINT8",
                "int16": "INT16", "uint16": "UINT16", "int32": "INT32", "uint32": "UINT32", "int64": "INT64",
                "uint64": "UINT64", "bool": "BOOL"}
space: dict = {}
exec(MAKE, space)  # noqa: S102 - the model's own generator, run here as the oracle


def element(v) -> bytes:
    """A BYTES element as Triton writes a Python model's (serialize_byte_tensor): bytes, text as UTF-8,
    anything else as its text."""
    return v if type(v) is bytes else (v.encode() if isinstance(v, str) else bytes(v) if isinstance(v, bytes)
                                       else str(v).encode())


def expected(seed: int, rows: int):
    """(datatype, shape, C-order bytes or BYTES elements) the answer must carry, or the error's words."""
    y = space["make"](seed, rows)
    if y.dtype.kind in "OSU":
        return "BYTES", y.shape, [element(v) for v in y.reshape(-1)]
    if y.dtype.name in TRITON_TYPES and y.dtype.isnative:
        return TRITON_TYPES[y.dtype.name], y.shape, np.ascontiguousarray(y).tobytes()
    return f"output 'Y' is a numpy {y.dtype} array, which has no Triton datatype"


def triton_refuses(seed: int, rows: int, kind: str) -> bool:
    """Where azulite answers and Triton 2.51 does not (checked against it below): a numpy unicode array
    (its pb_utils.Tensor: "NumPy dtype is not supported"; azulite writes its text as BYTES) and FP16 as
    JSON numbers (azulite writes them, as tritonclient reads them)."""
    y = space["make"](seed, rows)
    return y.dtype.kind == "U" or (y.dtype == np.float16 and kind == "http_json")


def answered(kind: str, client, model: str, seed: int, rows: int):
    x = np.full((rows, 1), seed, np.float32)
    try:
        if kind == "grpc":
            tensor = tg.InferInput("X", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer(model, [tensor])
            datatype = result.get_output("Y").datatype
        else:
            tensor = th.InferInput("X", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer(model, [tensor], outputs=[th.InferRequestedOutput("Y", binary_data=kind == "http")])
            datatype = result.get_output("Y")["datatype"]
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()
    y = result.as_numpy("Y")
    if datatype == "BYTES":
        return "BYTES", y.shape, [v.encode() if isinstance(v, str) else v for v in y.reshape(-1)]
    return datatype, y.shape, y.tobytes()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("outputs_repo")
    for name, processes in (("out_threads", "false"), ("out_processes", "true")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, processes=processes))
        (repo / name / "1" / "model.py").write_text(MODEL)
    with running_server(repo) as s:
        yield s


def check_seeds(server, seeds) -> None:
    clients = {"http": th.InferenceServerClient(server.http_url), "http_json": th.InferenceServerClient(server.http_url),
               "grpc": tg.InferenceServerClient(server.grpc_url)}
    for seed in seeds:
        rows = 1 + seed % 3
        want = expected(seed, rows)
        for model in ("out_threads", "out_processes"):
            for kind, client in clients.items():
                got = answered(kind, client, model, seed, rows)
                if isinstance(want, str):
                    assert got[0] in ("500", "StatusCode.INTERNAL") and f"model '{model}': {want}" in got[1], \
                        (kind, model, seed, got)
                else:
                    assert got == want, (kind, model, seed)


def test_a_models_outputs_reach_every_client_as_triton_writes_them(server):
    check_seeds(server, range(200))


@pytest.mark.soak
def test_a_models_outputs_soak(server):
    check_seeds(server, range(200, 3200 if os.environ.get("AZULITE_SOAK") == "1" else 400))


def test_real_triton_writes_the_same_outputs(tmp_path):
    """The rules the oracle applies are Triton's: real Triton 2.51 (the anchors installer's, Python backend)
    answers the same model the same, bar where it refuses (triton_refuses); an output with no Triton
    datatype fails there too."""
    from .anchor import running_triton

    (tmp_path / "repo" / "out_threads" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "out_threads" / "config.pbtxt").write_text(CONFIG.format(name="out_threads", processes="false"))
    (tmp_path / "repo" / "out_threads" / "1" / "model.py").write_text(MODEL)
    refused = 0
    with running_triton(tmp_path / "repo", tmp_path / "triton.log") as triton:
        clients = {"http": th.InferenceServerClient(triton.http_url),
                   "http_json": th.InferenceServerClient(triton.http_url), "grpc": tg.InferenceServerClient(triton.grpc_url)}
        for seed in range(120):
            rows = 1 + seed % 3
            want = expected(seed, rows)
            for kind, client in clients.items():
                got = answered(kind, client, "out_threads", seed, rows)
                if isinstance(want, str) or triton_refuses(seed, rows, kind):
                    refused += not isinstance(want, str)
                    assert isinstance(got[1], str) and got[0] not in ("200", "StatusCode.OK"), (kind, seed, got)
                else:
                    assert got == want, (kind, seed)
    assert refused  # the exceptions were met, so the docstring's claim about them was checked
