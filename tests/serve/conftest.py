"""Model repositories the serving tests build themselves (shared by the data-plane tests and the
HTTP/gRPC front-end tests — keep fixture and model names stable).

``model_repository`` (session-scoped, read-only: copy it before changing it) holds:

| model | backend | what it does |
| --- | --- | --- |
| add_sub_onnx | onnxruntime_onnx | INPUT0, INPUT1 FP32 [16] -> OUTPUT0 = sum, OUTPUT1 = diff; max_batch_size 8, dynamic batching |
| add_sub_pt | pytorch_libtorch | the same as TorchScript (INPUT__0, INPUT__1 -> OUTPUT__0, OUTPUT__1) |
| add_sub_py | python | the same as a Triton Python-backend model (INPUT0, INPUT1 -> OUTPUT0, OUTPUT1), 2 instances |
| string_py | python | TEXT BYTES [-1] -> UPPER BYTES (upper-cased), LENGTH INT64; max_batch_size 8 |
| versioned_py | python | versions 1 and 2 (policy all): OUTPUT0 = INPUT0 + version; FP32 [4], max_batch_size 0 |
| bench_matmul | python | the benchmark's model: x FP32 [256] -> y = x @ W (fixed 256x256); max_batch_size 64, 100 us delay |
| add_sub_ensemble | ensemble | add_sub_onnx then add_sub_py: OUTPUT0 = 2*INPUT0, OUTPUT1 = 2*INPUT1 |
| slow_py | python | sleeps 0.2 s per execute, echoes INPUT0 FP32 [1]; max_batch_size 8, 1 instance |

``Gate`` builds a repository holding ``gate_py`` (not in the table: echoes INPUT0 FP32 [1], 2 instances,
each execution held until the test opens the gate), for tests that must act on calls known to be inside
the server. ``bls_trace_py`` (not in the table either; tests/serve/test_trace.py): OUTPUT0 = 4 * INPUT0 by
two BLS calls to add_sub_py, one passing its request's trace on.

``broken_model_repository`` is a copy plus two models that fail to load: ``broken_onnx`` (a model.onnx
that is not ONNX) and ``broken_config`` (a config.pbtxt that does not parse).

Static model files live in tests/serve/models/; ONNX and TorchScript files are generated here.
``build_model_repository(root)`` writes the same repository anywhere (bench/ may reuse it).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

MODELS_DIR = Path(__file__).parent / "models"
ALL_MODELS = (
    "add_sub_onnx",
    "add_sub_pt",
    "add_sub_py",
    "string_py",
    "versioned_py",
    "bench_matmul",
    "add_sub_ensemble",
    "slow_py",
)

ADD_SUB_CONFIG = """
name: "{name}"
{platform}
max_batch_size: 8
input [
  {{ name: "{i0}" data_type: TYPE_FP32 dims: [ 16 ] }},
  {{ name: "{i1}" data_type: TYPE_FP32 dims: [ 16 ] }}
]
output [
  {{ name: "{o0}" data_type: TYPE_FP32 dims: [ 16 ] }},
  {{ name: "{o1}" data_type: TYPE_FP32 dims: [ 16 ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
"""


def bench_weights() -> np.ndarray:
    """The fixed W of bench_matmul (same formula as its model.py)."""
    return ((np.arange(256 * 256, dtype=np.float32).reshape(256, 256) % 7) - 3.0) / 16.0


def write_add_sub_onnx(path: Path, dim: int = 16, batch: bool = True) -> None:
    """INPUT0, INPUT1 FP32 [-1, dim] (or [dim] without batch) -> OUTPUT0 = sum, OUTPUT1 = diff."""
    from onnx import TensorProto, helper

    shape = ["batch", dim] if batch else [dim]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
    ]
    graph = helper.make_graph(nodes, "add_sub", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


def write_add_sub_torchscript(path: Path) -> None:
    import torch

    class AddSub(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + y, x - y

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # torch 2.13 deprecates jit.script; Triton's libtorch backend needs it
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(AddSub()).save(str(path))


def build_model_repository(root: Path, models: tuple[str, ...] = ALL_MODELS) -> Path:
    """Write the test repository (or the named subset) under ``root``; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for name in models:
        target = root / name
        if name == "add_sub_onnx":
            (target / "1").mkdir(parents=True, exist_ok=True)
            (target / "config.pbtxt").write_text(
                ADD_SUB_CONFIG.format(name=name, platform='platform: "onnxruntime_onnx"',
                                      i0="INPUT0", i1="INPUT1", o0="OUTPUT0", o1="OUTPUT1"))
            write_add_sub_onnx(target / "1" / "model.onnx")
        elif name == "add_sub_pt":
            (target / "1").mkdir(parents=True, exist_ok=True)
            (target / "config.pbtxt").write_text(
                ADD_SUB_CONFIG.format(name=name, platform='platform: "pytorch_libtorch"',
                                      i0="INPUT__0", i1="INPUT__1", o0="OUTPUT__0", o1="OUTPUT__1"))
            write_add_sub_torchscript(target / "1" / "model.pt")
        elif name == "versioned_py":
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(MODELS_DIR / name / "config.pbtxt", target / "config.pbtxt")
            for version in ("1", "2"):
                (target / version).mkdir(exist_ok=True)
                shutil.copy(MODELS_DIR / name / "model.py", target / version / "model.py")
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(MODELS_DIR / name / "config.pbtxt", target / "config.pbtxt")
            (target / "1").mkdir(exist_ok=True)  # an ensemble too: Triton wants its (empty) version dir
            if (MODELS_DIR / name / "model.py").exists():
                shutil.copy(MODELS_DIR / name / "model.py", target / "1" / "model.py")
    return root


def add_broken_models(root: Path) -> Path:
    """Two models that fail to load, each for its own reason; the others must keep serving."""
    (root / "broken_onnx" / "1").mkdir(parents=True, exist_ok=True)
    (root / "broken_onnx" / "config.pbtxt").write_text(
        'name: "broken_onnx"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    (root / "broken_onnx" / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    (root / "broken_config" / "1").mkdir(parents=True, exist_ok=True)
    (root / "broken_config" / "config.pbtxt").write_text('name: "broken_config"\nmax_batch_size: "eight"\n')
    return root


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model of the table above, all loadable. Do not modify: copy it first."""
    return build_model_repository(tmp_path_factory.mktemp("model_repository"))


@pytest.fixture
def broken_model_repository(tmp_path: Path, model_repository: Path) -> Path:
    """A fresh copy of ``model_repository`` plus ``broken_onnx`` and ``broken_config``."""
    root = tmp_path / "broken_repository"
    shutil.copytree(model_repository, root)
    return add_broken_models(root)


@pytest.fixture
def repository_copy(tmp_path: Path, model_repository: Path) -> Path:
    """A fresh, writable copy of ``model_repository`` (for load/unload/poll tests that edit files)."""
    root = tmp_path / "repository"
    shutil.copytree(model_repository, root)
    return root


@contextlib.contextmanager
def tasks_created(call):
    """The qualified names of the Tasks a running server's loop creates inside the block (``call`` runs a
    coroutine on that loop: a test server's ``call``); the loop's own task factory again after it."""
    created: list[str] = []

    def counting_factory(loop, coro, **kw):
        created.append(getattr(coro, "__qualname__", repr(coro)))
        return asyncio.Task(coro, loop=loop, **kw)

    async def set_factory(factory):
        asyncio.get_running_loop().set_task_factory(factory)

    call(set_factory(counting_factory))
    try:
        yield created
    finally:
        call(set_factory(None))


class Gate:
    """A Unix socket that ``gate_py`` executions connect to and block on until :meth:`open`.

    ``entered(n)`` waits until n executions are held (events, not sleeps); ``open()`` releases them and
    removes the socket, so later executions pass straight through. Always open it (``with Gate(...)``)."""

    def __init__(self, root: Path) -> None:
        self.path = root / "gate.sock"
        self.repository = root / "repository"
        target = self.repository / "gate_py"
        (target / "1").mkdir(parents=True, exist_ok=True)
        shutil.copy(MODELS_DIR / "gate_py" / "model.py", target / "1" / "model.py")
        (target / "config.pbtxt").write_text(
            (MODELS_DIR / "gate_py" / "config.pbtxt").read_text().replace("GATE_PATH", str(self.path)))
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        self._held: list[socket.socket] = []
        self._cond = threading.Condition()
        self._opened = False
        self._thread = threading.Thread(target=self._accept, name="gate", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # the listener was closed: the gate is open
                return
            with self._cond:
                if self._opened:
                    conn.close()
                    continue
                self._held.append(conn)
                self._cond.notify_all()

    def entered(self, n: int, timeout: float = 120) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self._held) >= n, timeout)

    def open(self) -> None:
        with self._cond:
            self._opened = True
            held, self._held = self._held, []
        self.path.unlink(missing_ok=True)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        except OSError:
            pass
        self._listener.close()
        for conn in held:
            conn.close()
        self._thread.join(30)

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc) -> None:
        self.open()
