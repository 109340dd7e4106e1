"""The rebuilt module -> one model file a Triton backend runs, in order of preference:

1. ``onnx``: ``torch.onnx.export`` with its default, torch.export-based (dynamo) exporter, run by ONNX
   Runtime. The legacy TorchScript-based exporter (``dynamo=False``) is deprecated in torch 2.13 and
   slated for removal, so azulite installs ``onnxscript`` (which the new exporter writes through) instead.
   The batch dimension is exported as a symbolic ``batch`` dimension.
2. ``torchscript``: ``torch.jit.trace``, run by Triton's PyTorch (libtorch) backend, when the model has
   something ONNX cannot express.
3. ``python``: the module's own code in a Python-backend ``model.py`` (the factory imported from the
   manifest, the weights from ``weights.pt``): it runs whatever PyTorch runs, at PyTorch's speed, but needs
   the factory's package installed where the server runs.

``auto`` tries them in that order and reports why each earlier one failed.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from azulite.errors import ExportError
from azulite.export.plan import ServingPlan
from azulite.export.recipe import TensorSpec

FORMATS = ("onnx", "torchscript", "python")


@dataclass(frozen=True)
class Exported:
    format: str
    filename: str
    #: the served names, in the recipe's order (TorchScript renames them to Triton's <name>__<index>)
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    #: runs the written file on numpy inputs keyed by the recipe's names -> outputs keyed by the recipe's names
    run: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


def _args(inputs: tuple[TensorSpec, ...], sample: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    import torch

    return tuple(torch.from_numpy(np.ascontiguousarray(sample[t.name])) for t in inputs)


def export_onnx(plan: ServingPlan, sample: Mapping[str, np.ndarray], version_dir: Path, batching: bool) -> Exported:
    import onnxruntime as ort
    import torch

    path = version_dir / "model.onnx"
    dynamic_shapes = None
    if batching:
        batch = torch.export.Dim("batch")
        dynamic_shapes = tuple({0: batch} for _ in plan.inputs)
    log = io.StringIO()
    # "torchvision is not installed. Skipping torchvision::nms", and torch.export's graph dumps on failure:
    # the error says what failed
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "torch._export",
                                               "torch.fx.experimental.symbolic_shapes", "torch.fx._symbolic_trace")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:  # the exporter prints its progress and warns a lot: not for the console
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(plan.module, _args(plan.inputs, sample), str(path), dynamo=True, external_data=False,
                              input_names=[t.name for t in plan.inputs],
                              output_names=[t.name for t in plan.outputs], dynamic_shapes=dynamic_shapes)
    except Exception as e:  # noqa: BLE001 - torch.export / onnxscript raise many types
        raise ExportError(f"torch.onnx.export failed: {_first(e)}") from None
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    names = [t.name for t in plan.outputs]

    def run(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {t.name: feed[t.name] for t in plan.inputs})))

    return Exported("onnx", "model.onnx", tuple(t.name for t in plan.inputs), tuple(names), run)


def export_torchscript(plan: ServingPlan, sample: Mapping[str, np.ndarray], version_dir: Path, batching: bool) -> Exported:
    import torch

    path = version_dir / "model.pt"
    try:
        with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; Triton's libtorch backend needs it
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(plan.module, _args(plan.inputs, sample), check_trace=True)
            traced.save(str(path))
            loaded = torch.jit.load(str(path), map_location="cpu").eval()
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"torch.jit.trace failed: {_first(e)}") from None

    def run(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            out = loaded(*_args(plan.inputs, feed))
        out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        return {t.name: o.numpy() for t, o in zip(plan.outputs, out)}

    return Exported("torchscript", "model.pt", tuple(f"{t.name}__{i}" for i, t in enumerate(plan.inputs)),
                    tuple(f"{t.name}__{i}" for i, t in enumerate(plan.outputs)), run)


_PYTHON_MODEL = '''"""Written by `azulite export --format python`: the trained module run by Triton's Python backend.
The model is rebuilt by its factory ({factory}) with the weights in weights.pt; the factory's package
must be importable where the server runs."""

import importlib
import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "recipe.json")) as f:
            recipe = json.load(f)
        module, _, attr = recipe["factory"].partition(":")
        factory = importlib.import_module(module)
        for part in attr.split("."):
            factory = getattr(factory, part)
        self.model = factory(**recipe["kwargs"]).eval()
        self.model.load_state_dict(torch.load(os.path.join(here, "weights.pt"), map_location="cpu", weights_only=True))
        self.inputs = [t["name"] for t in recipe["inputs"]]
        self.outputs = [t["name"] for t in recipe["outputs"]]

    def execute(self, requests):
        # the dynamic batcher hands several requests at once: one forward pass over all of them
        feeds = [[pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs] for r in requests]
        sizes = [f[0].shape[0] for f in feeds]
        args = [torch.from_numpy(np.ascontiguousarray(np.concatenate([f[i] for f in feeds]))) for i in range(len(self.inputs))]
        with torch.inference_mode():
            out = self.model(*args)
        out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        responses, start = [], 0
        for size in sizes:
            tensors = [pb_utils.Tensor(n, o[start:start + size].numpy()) for n, o in zip(self.outputs, out)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start += size
        return responses
'''


def export_python(plan: ServingPlan, sample: Mapping[str, np.ndarray], version_dir: Path, batching: bool) -> Exported:
    import torch

    recipe = plan.recipe
    if recipe is None or plan.preprocess is not None or plan.module is None:
        raise ExportError("the python format serves the factory's own module; this model is served through an "
                          "adapter (model_config.serving)", fix="use --format onnx or torchscript")
    if not batching:
        raise ExportError("the python format batches requests along the first dimension: it needs max batch size >= 1")
    torch.save(plan.module.state_dict(), version_dir / "weights.pt")
    meta = {"factory": recipe.factory, "kwargs": dict(recipe.kwargs),
            "inputs": [{"name": t.name} for t in plan.inputs], "outputs": [{"name": t.name} for t in plan.outputs]}
    (version_dir / "recipe.json").write_text(json.dumps(meta, indent=1))
    (version_dir / "model.py").write_text(_PYTHON_MODEL.format(factory=recipe.factory))
    # what the served model.py does, done here: a fresh module from the factory and the written weights
    rebuilt = recipe.build()
    rebuilt.load_state_dict(torch.load(version_dir / "weights.pt", map_location="cpu", weights_only=True))

    def run(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            out = rebuilt(*_args(plan.inputs, feed))
        out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        return {t.name: o.numpy() for t, o in zip(plan.outputs, out)}

    return Exported("python", "model.py", tuple(t.name for t in plan.inputs), tuple(t.name for t in plan.outputs), run)


EXPORTERS = {"onnx": export_onnx, "torchscript": export_torchscript, "python": export_python}


def _first(e: BaseException) -> str:
    """The root cause's first line, without the exporter's ANSI colours."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
