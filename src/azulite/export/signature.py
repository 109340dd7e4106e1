"""Does the signature an export serves say what the model takes and returns? config.pbtxt is written from
``model_config.inputs``/``outputs`` (per row, without the batch dimension): a model that cannot run on the
declared inputs, or returns other dims or datatypes than declared, would be served under a config that
contradicts it (every request refused, or answered in a shape clients do not expect). Checked against the
rebuilt PyTorch model, then against the exported file (what it returns, and what an ONNX file declares),
before anything is written; each mistake names the ``model_config`` field and what the model really does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from azulite.errors import ExportError
from azulite.export.recipe import DTYPES, TensorSpec

#: numpy dtypes -> KServe v2 datatypes (the names model_config uses)
_WIRE = {v: k for k, v in DTYPES.items()}
_MANIFEST_FIX = ("record it in the training script's CheckpointConfig(model_config=...); for a checkpoint already "
                 "saved, correct model_config in its manifest.json")


def _shape(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _declared(t: TensorSpec) -> str:
    return f"{t.name} ({t.dtype}, dims {_shape(t.dims)})"


def call_model(model: Any, inputs: Sequence[TensorSpec], sample: Mapping[str, np.ndarray], *, where: str) -> tuple:
    """``model`` run on ``sample`` (a batch of the declared inputs) -> the tensors it returns. A model that
    refuses them is told as the declared inputs' mistake, with the model's own complaint."""
    import torch

    args = [torch.from_numpy(np.ascontiguousarray(sample[t.name])) for t in inputs]
    try:
        with torch.inference_mode():
            out = model(*args)
    except Exception as e:  # noqa: BLE001 - whatever the user's forward raises on the wrong inputs
        field = "model_config.inputs" + ("[0]" if len(inputs) == 1 else "")
        fed = ", ".join(f"{_declared(t)} fed as a batch {_shape(a.shape)}" for t, a in zip(inputs, args))
        wild = " (each -1 tried as 4)" if any(d == -1 for t in inputs for d in t.dims) else ""
        complaint = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise ExportError(
            f"the model cannot run on the inputs {field} declares: {fed}{wild}: "
            f"{type(e).__name__}{': ' + complaint if complaint else ''}",
            where=f"{where} ({field})" if where else field,
            fix="declare what the model's forward takes, per row without the batch dimension (name, dtype, dims; "
                "-1 for a size that varies): " + _MANIFEST_FIX) from None
    return (out,) if isinstance(out, torch.Tensor) else tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check_returns(got: Sequence[Any], outputs: Sequence[TensorSpec], rows: int, *, where: str,
                  by: str = "the model") -> None:
    """``got`` (what ``by`` returned for a batch of ``rows`` rows, in order: numpy arrays or torch tensors)
    against the declared ``outputs``: as many, each of the declared datatype, shaped [rows, *dims] (-1
    matches any size)."""
    def at(field: str) -> str:
        return f"{where} ({field})" if where else field

    if len(got) != len(outputs):
        raise ExportError(f"{by} returns {len(got)} tensor{'' if len(got) == 1 else 's'} but model_config.outputs "
                          f"lists {len(outputs)}", where=at("model_config.outputs"),
                          fix="list every output the model returns, in order: " + _MANIFEST_FIX)
    for i, (t, o) in enumerate(zip(outputs, got)):
        field = f"model_config.outputs[{i}]"
        if not hasattr(o, "shape") or not hasattr(o, "dtype"):
            raise ExportError(f"{by} returns a {type(o).__name__} as output {i}, not a tensor", where=at(field),
                              fix="the model's forward must return tensors (one, or a tuple of them)")
        wire, dtype_name = _wire_of(o)
        if wire != t.dtype:
            raise ExportError(f"{_declared(t)}: {by} returns {wire or dtype_name}, not {t.dtype}",
                              where=at(f"{field}.dtype"),
                              fix=(f"declare dtype {wire!r}: " if wire else
                                   f"return a datatype Triton serves ({', '.join(DTYPES)}); or ") + _MANIFEST_FIX)
        shape = tuple(int(d) for d in o.shape)
        per_row = shape[1:]
        batched = bool(shape) and shape[0] == rows
        if not (batched and len(per_row) == len(t.dims) and all(d in (-1, s) for d, s in zip(t.dims, per_row))):
            what = f"{_shape(per_row)} per row" if batched else f"no batch dimension of {rows} in front"
            raise ExportError(
                f"{_declared(t)}: {by} returns {_shape(shape)} for a batch of {rows} rows ({what})",
                where=at(f"{field}.dims"),
                fix=(f"declare dims {_shape(per_row)} (per row, without the batch dimension; -1 for a size that "
                     "varies): " if batched and per_row else "") + _MANIFEST_FIX)


def _wire_of(o: Any) -> tuple[str | None, str]:
    """The KServe datatype of an array or tensor (None when Triton serves none such), and its own name."""
    if isinstance(o, np.ndarray):
        return _WIRE.get(o.dtype), str(o.dtype)
    import torch

    try:
        as_numpy = torch.empty(0, dtype=o.dtype).numpy().dtype
    except (TypeError, RuntimeError):  # bfloat16 and others numpy has no type for
        return None, str(o.dtype).removeprefix("torch.")
    return _WIRE.get(as_numpy), str(o.dtype).removeprefix("torch.")


def check_onnx_file(path: Path, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], max_batch_size: int,
                    *, where: str) -> None:
    """The ONNX file's declared inputs and outputs against the config.pbtxt about to be written: the same
    names and element types, and shapes Triton will send: [batch, *dims] when ``max_batch_size`` > 0, else
    dims as they are (-1 and symbolic dimensions match any size)."""
    import onnx

    from azulite.export.generate import ONNX_TYPES

    graph = onnx.load(str(path), load_external_data=False).graph
    declared = {v.name: v for v in [*graph.input, *graph.output]}
    batch = max_batch_size > 0
    for kind, specs in (("inputs", inputs), ("outputs", outputs)):
        for i, t in enumerate(specs):
            field = f"model_config.{kind}[{i}]"
            v = declared.get(t.name)
            if v is None:
                raise ExportError(f"the ONNX file has no {kind[:-1]} named {t.name!r}", where=f"{where} ({field}.name)")
            tt = v.type.tensor_type
            file_dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tt.shape.dim]
            file_type = ONNX_TYPES.get(tt.elem_type)
            if file_type != t.dtype:
                raise ExportError(f"{_declared(t)}: the exported ONNX file's {kind[:-1]} is {file_type}",
                                  where=f"{where} ({field}.dtype)", fix=f"declare dtype {file_type!r}; " + _MANIFEST_FIX)
            want = [-1, *t.dims] if batch else list(t.dims)
            if not batch and len(file_dims) == len(want) + 1:  # the rows it was exported with, as a fixed dimension
                raise ExportError(
                    f"--max-batch-size 0 serves {t.name} whole, as dims {_shape(t.dims)} (no batch dimension), but the "
                    f"exported ONNX file takes {_shape(file_dims)}: the verification batch, fixed",
                    fix="export with --max-batch-size N >= 1 (the default 64): the model "
                                                  "takes a batch of rows, as model_config's per-row dims say")
            if len(file_dims) != len(want) or not all(w == -1 or f == -1 or w == f for w, f in zip(want, file_dims)):
                said = f"config.pbtxt would say dims {_shape(t.dims)} with max_batch_size {max_batch_size}" + (
                    " (a batch dimension in front)" if batch else " (no batch dimension: the whole shape)")
                raise ExportError(
                    f"{_declared(t)}: the exported ONNX file's {kind[:-1]} is {_shape(file_dims)}; {said}",
                    where=f"{where} ({field}.dims)",
                    fix="declare the dims the model really has, per row without the batch dimension: " + _MANIFEST_FIX)
