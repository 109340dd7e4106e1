"""A request's tensors held against its model's config: one set of checks for a client's request
(:meth:`TritonDataPlane._prepare`) and for an ensemble step's arrays (:func:`ensemble.step_item`), so
both refuse alike and an error names the input, the model, what was expected and what came. Triton's own
wording where it has one (its clients' users grep for it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from azulite.errors import Internal, InvalidArgument, Unsupported
from azulite.serve import config as cfg
from azulite.serve.parameters import shape_text
from azulite.serve.types import bytes_element

if TYPE_CHECKING:
    from azulite.serve.models import LoadedModel


def request_tag(request_id: str | None) -> str:
    """Triton's prefix of the errors it finds holding a request against its model (a datatype, a shape, a
    batch size, an input missing; not an unknown input or output name, not a model's own error):
    ``[request id: ID] ``, ``<id_unknown>`` for a request without one. None: no prefix (an ensemble's step)."""
    return "" if request_id is None else f"[request id: {request_id or '<id_unknown>'}] "


def check_inputs(model: LoadedModel, tensors: Iterable[tuple[str, str, tuple[int, ...], np.ndarray]],
                 request_id: str | None = None) -> tuple[dict[str, np.ndarray], int]:
    """``tensors``: (name, wire datatype, shape, data) each. Returns the inputs (shaped as the model
    takes them: the request's shape, then the config's reshape) and the batch size (-1: not batching).
    Errors carry :func:`request_tag` where Triton's do."""
    name = model.name
    tag = request_tag(request_id)
    mbs = model.max_batch_size
    inputs: dict[str, np.ndarray] = {}
    batch = -1
    for key, datatype, shape, data in tensors:
        spec = model.inputs.get(key)
        if spec is None:
            raise InvalidArgument(f"unexpected inference input '{key}' for model '{name}'",
                                  fix=f"the model's inputs are {sorted(model.inputs)}")
        if key in inputs:
            raise InvalidArgument(f"input '{key}' is given twice in the request for model '{name}'")
        if datatype != spec.datatype:
            raise InvalidArgument(f"{tag}inference input '{key}' data-type is '{datatype}', "
                                  f"but model '{name}' expects '{spec.datatype}'")
        if mbs > 0:
            if not shape:
                raise InvalidArgument(
                    f"{tag}unexpected shape for input '{key}' for model '{name}'. Expected "
                    f"{shape_text((-1, *spec.dims))}, got [] (the model batches: the first dimension is the batch)")
            if batch < 0:
                batch = shape[0]
            elif shape[0] != batch:
                raise InvalidArgument(f"{tag}input '{key}' has batch size {shape[0]} but other inputs of the request "
                                      f"have {batch}, for model '{name}'")
            rest = shape[1:]
        else:
            rest = shape
        if not spec.matches(rest):
            expected = (-1, *spec.dims) if mbs > 0 else spec.dims
            fix = None
            if mbs > 0 and spec.matches(shape):  # the whole shape is the model's dims: the batch is missing
                fix = (f"the model batches (max_batch_size {mbs}): put the batch size first, e.g. "
                       f"{shape_text((1, *shape))} for one row")
            elif mbs == 0 and shape and spec.matches(shape[1:]):  # a batch dimension the model does not take
                fix = f"the model does not batch (max_batch_size 0): send the shape {shape_text(shape[1:])}"
            raise InvalidArgument(f"{tag}unexpected shape for input '{key}' for model '{name}'. "
                                  f"Expected {shape_text(expected)}, got {shape_text(shape)}", fix=fix)
        expected_dtype = cfg.WIRE_TO_NUMPY.get(spec.datatype)
        if expected_dtype is None:
            raise Unsupported(f"datatype {spec.datatype} of input '{key}' is not supported by azulite")
        if data.dtype != expected_dtype:
            raise InvalidArgument(f"input '{key}' of model '{name}': data of numpy dtype {data.dtype} "
                                  f"does not match datatype {datatype}")
        if data.shape != shape:
            if data.size != int(np.prod(shape)):
                raise InvalidArgument(f"input '{key}' of model '{name}': {data.size} elements given for shape "
                                      f"{shape_text(shape)}")
            data = data.reshape(shape)
        if spec.reshape is not None:
            data = data.reshape(((batch,) if mbs > 0 else ()) + spec.reshape)
        inputs[key] = data
    if len(inputs) < len(model.required_inputs) or not model.required_inputs <= inputs.keys():
        missing = sorted(model.required_inputs - inputs.keys())
        raise InvalidArgument(
            f"{tag}expected {len(model.required_inputs)} inputs but got {len(inputs)} inputs for model '{name}'. "
            f"Got input(s) {sorted(inputs)}, but missing required input(s) {missing}. "
            "Please provide all required input(s).")
    if mbs > 0 and batch == 0:
        raise InvalidArgument(f"{tag}inference request batch-size must be >= 1 for '{name}' (got a batch of 0)")
    if mbs > 0 and batch > mbs:
        raise InvalidArgument(f"{tag}inference request batch-size must be <= {mbs} for '{name}'",
                              fix=f"split the request into batches of at most {mbs}")
    return inputs, batch


def check_outputs(model: LoadedModel, names: Iterable[str]) -> frozenset[str]:
    """The outputs asked for, each one the model has."""
    wanted = frozenset(names)
    for out in wanted:
        if out not in model.outputs:
            raise InvalidArgument(f"unexpected inference output '{out}' for model '{model.name}'",
                                  fix=f"the model's outputs are {sorted(model.outputs)}")
    return wanted


def output_datatype(model: str, name: str, dtype: np.dtype) -> str:
    """The wire datatype of a model's output; a numpy dtype with no Triton datatype (datetime64,
    complex, a record, a byte order not the machine's) is the model's fault, not the client's: INTERNAL,
    naming the model and the output, the same whether the instance is a thread or a process."""
    wire = cfg.NUMPY_TO_WIRE.get(dtype)
    if wire is not None:
        return wire
    if dtype.kind in ("S", "U", "O"):
        return "BYTES"
    raise Internal(f"model '{model}': output '{name}' is a numpy {dtype} array, which has no Triton datatype",
                   fix="return it as one of Triton's types, e.g. array.astype(np.float32), or bytes for BYTES")


def output_array(model: LoadedModel, batch_size: int, name: str, array) -> np.ndarray:
    """A model's output as an answer carries it (a response, or an ensemble step's next feed): an ndarray
    with the config's reshape applied, numpy strings as BYTES' object array of bytes."""
    if not isinstance(array, np.ndarray):
        array = np.asarray(array)
    spec = model.outputs.get(name)
    if spec is not None and spec.reshape is not None:
        array = array.reshape(((batch_size,) if model.max_batch_size > 0 else ()) + spec.dims)
    return bytes_objects(array)


def bytes_objects(array: np.ndarray) -> np.ndarray:
    """A BYTES output as the server holds one (serve/types.py: an object array of bytes, what the next step
    of an ensemble reads, as from Triton): numpy strings (kinds S, U) and object arrays holding text or
    numbers (a Python model's ``np.array(["a"], dtype=object)``) converted element by element
    (types.bytes_element); an object array of bytes, or any other array, unchanged."""
    kind = array.dtype.kind
    if kind == "O":
        if all(type(v) is bytes for v in array.reshape(-1)):
            return array
    elif kind not in ("S", "U"):
        return array
    out = np.empty(array.size, dtype=np.object_)
    out[:] = [bytes_element(v) for v in array.reshape(-1)]
    return out.reshape(array.shape)
