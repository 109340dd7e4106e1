"""config.pbtxt -> Triton's own ``ModelConfig`` message, validated as Triton validates it, plus the
datatype tables and the JSON rendering every other part uses.

Parsing is ``google.protobuf.text_format`` on the message tritonclient ships, so every field Triton knows
parses (and an unknown field is an error naming its line, as in Triton). Validation messages follow
Triton's wording and always name the model and the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor

from azulite.errors import ModelLoadError
from azulite.serve.proto import model_config_pb2 as mc

# Triton config enum <-> KServe v2 datatype name <-> numpy dtype. BYTES travels as numpy object arrays
# of ``bytes``; BF16 has no numpy dtype, so a BF16 tensor is refused at inference (not at load).
CONFIG_TO_WIRE: dict[int, str] = {
    mc.TYPE_BOOL: "BOOL",
    mc.TYPE_UINT8: "UINT8",
    mc.TYPE_UINT16: "UINT16",
    mc.TYPE_UINT32: "UINT32",
    mc.TYPE_UINT64: "UINT64",
    mc.TYPE_INT8: "INT8",
    mc.TYPE_INT16: "INT16",
    mc.TYPE_INT32: "INT32",
    mc.TYPE_INT64: "INT64",
    mc.TYPE_FP16: "FP16",
    mc.TYPE_FP32: "FP32",
    mc.TYPE_FP64: "FP64",
    mc.TYPE_STRING: "BYTES",
    mc.TYPE_BF16: "BF16",
}
WIRE_TO_CONFIG: dict[str, int] = {v: k for k, v in CONFIG_TO_WIRE.items()}
WIRE_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
NUMPY_TO_WIRE: dict[np.dtype, str] = {v: k for k, v in WIRE_TO_NUMPY.items()}


def wire_datatype(config_type: int) -> str:
    """TYPE_FP32 -> "FP32" (the name model metadata and infer use)."""
    return CONFIG_TO_WIRE.get(config_type, "INVALID")


def numpy_to_wire(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.kind in ("S", "U", "O"):
        return "BYTES"
    try:
        return NUMPY_TO_WIRE[dtype]
    except KeyError:
        raise ModelLoadError(f"numpy dtype {dtype} has no Triton datatype") from None


# --- parse ---------------------------------------------------------------------------------------


def parse_config_text(text: str, *, model: str, path: str | Path | None = None) -> mc.ModelConfig:
    """Parse the text of a config.pbtxt; a syntax error names the file and line (text_format's own)."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        where = str(path) if path else f"model '{model}' config.pbtxt"
        line, column = exc.GetLine(), exc.GetColumn()
        at = f"line {line} column {column}: " if line else ""
        detail = re.sub(r"^\d+:\d+ : ", "", str(exc))  # the position, said once as words
        raise ModelLoadError(
            f"failed to parse the model configuration of '{model}': {at}{detail}",
            where=where,
            fix=f"correct {f'line {line} of ' if line else ''}{where}: config.pbtxt is protobuf text format of "
            "Triton's ModelConfig (https://github.com/triton-inference-server/common/blob/main/protobuf/"
            "model_config.proto)",
        ) from None
    return config


def parse_config_file(path: Path, *, model: str) -> mc.ModelConfig:
    return parse_config_text(path.read_text(), model=model, path=path)


def config_from_json(data: str | bytes | dict, *, model: str) -> mc.ModelConfig:
    """A JSON ModelConfig (Triton's load API ``config`` parameter, Python auto_complete_config output)."""
    config = mc.ModelConfig()
    try:
        if isinstance(data, dict):
            json_format.ParseDict(data, config)
        else:
            json_format.Parse(data, config)
    except json_format.ParseError as exc:
        raise ModelLoadError(f"model '{model}': invalid JSON model configuration: {exc}") from None
    return config


# --- JSON out (int64 as numbers, as Triton's HTTP /config answers) -------------------------------

_INT64_TYPES = (
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
)


def _int64_as_numbers(descriptor: Any, obj: dict) -> None:
    for field in descriptor.fields:
        if field.name not in obj:
            continue
        value = obj[field.name]
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                if value_field.message_type is not None:
                    for item in value.values():
                        _int64_as_numbers(value_field.message_type, item)
                elif value_field.type in _INT64_TYPES:
                    obj[field.name] = {k: int(v) for k, v in value.items()}
            elif isinstance(value, list):
                for item in value:
                    _int64_as_numbers(field.message_type, item)
            else:
                _int64_as_numbers(field.message_type, value)
        elif field.type in _INT64_TYPES:
            obj[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)


def message_to_dict(message: Any, *, defaults: bool = True) -> dict:
    """Any protobuf message as Triton's JSON: proto field names, default-valued fields included, and
    int64 fields as JSON numbers (``json_format`` alone writes them as strings, which Triton does not).
    The HTTP front-end renders /config and /stats with this."""
    kwargs: dict[str, Any] = {"preserving_proto_field_name": True}
    if defaults:
        kwargs["always_print_fields_with_no_presence"] = True
    try:
        obj = json_format.MessageToDict(message, **kwargs)
    except TypeError:  # protobuf < 5.26 spells it differently
        kwargs.pop("always_print_fields_with_no_presence", None)
        obj = json_format.MessageToDict(message, including_default_value_fields=defaults, **kwargs)
    _int64_as_numbers(message.DESCRIPTOR, obj)
    return obj


def config_to_dict(config: mc.ModelConfig) -> dict:
    return message_to_dict(config)


# --- defaults and validation ----------------------------------------------------------------------

ONNX_PLATFORM = "onnxruntime_onnx"
TORCH_PLATFORM = "pytorch_libtorch"
ENSEMBLE_PLATFORM = "ensemble"
DEFAULT_FILENAMES = {"onnxruntime": "model.onnx", "pytorch": "model.pt", "python": "model.py"}
DEFAULT_SEQUENCE_IDLE_US = 1_000_000  # Triton's max_sequence_idle_microseconds when a config leaves it 0


def backend_of(config: mc.ModelConfig) -> str:
    """The backend that runs a config: "onnxruntime", "pytorch", "python" or "ensemble" ("" if none)."""
    if config.backend:
        return config.backend
    return {
        ONNX_PLATFORM: "onnxruntime",
        TORCH_PLATFORM: "pytorch",
        ENSEMBLE_PLATFORM: "ensemble",
    }.get(config.platform, "")


def fill_defaults(config: mc.ModelConfig, *, model: str) -> None:
    """What Triton 2.51 adds to every config it loads, so that ``/config`` answers what Triton's does
    (compared field by field against it: tests/serve/test_metadata_triton.py): the name, platform from
    backend (and back), the backend's model file name, one CPU instance group named after the model,
    the `latest 1` version policy, ``preferred_batch_size: [max_batch_size]`` when a batcher names none,
    a one-second sequence idle limit, pinned input and output memory, a default priority level."""
    if not config.name:
        config.name = model
    backend = backend_of(config)
    if backend == "onnxruntime":
        config.backend = "onnxruntime"
        config.platform = ONNX_PLATFORM
    elif backend == "pytorch":
        config.backend = "pytorch"
        config.platform = TORCH_PLATFORM
    if not config.default_model_filename and backend in DEFAULT_FILENAMES:
        config.default_model_filename = DEFAULT_FILENAMES[backend]
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if backend == "ensemble":
        config.model_transaction_policy.SetInParent()  # {decoupled: false} shown, as Triton shows it
    if backend != "ensemble" and not config.instance_group:
        config.instance_group.add(name=config.name, count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    if backend != "ensemble":
        # Triton's defaults; azulite has no GPU to pin for, so they only show in /config
        optimization = config.optimization
        if not optimization.HasField("input_pinned_memory"):
            optimization.input_pinned_memory.enable = True
        if not optimization.HasField("output_pinned_memory"):
            optimization.output_pinned_memory.enable = True
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}"
        if group.count < 0:
            raise _invalid(model, f"model '{model}': instance_group {index} has count {group.count}",
                           fix="count: 1 or more (unset means 1)")
        if group.count == 0:  # unset (protobuf's 0): one instance, as Triton
            group.count = 1
        # No GPU here: KIND_AUTO and KIND_GPU instances run on the CPU (documented in the README), so a
        # repository written for a GPU Triton still loads.
        if group.kind in (mc.ModelInstanceGroup.KIND_AUTO, mc.ModelInstanceGroup.KIND_GPU):
            group.kind = mc.ModelInstanceGroup.KIND_CPU
            del group.gpus[:]
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        if db.priority_levels and not db.default_priority_level:
            db.default_priority_level = db.priority_levels
        if not db.preferred_batch_size and config.max_batch_size > 0:
            db.preferred_batch_size.append(config.max_batch_size)
    if config.HasField("sequence_batching"):
        sb = config.sequence_batching
        if not sb.max_sequence_idle_microseconds:
            sb.max_sequence_idle_microseconds = DEFAULT_SEQUENCE_IDLE_US
        if sb.HasField("oldest") and not sb.oldest.preferred_batch_size and config.max_batch_size > 0:
            sb.oldest.preferred_batch_size.append(config.max_batch_size)


def _invalid(model: str, message: str, fix: str | None = None) -> ModelLoadError:
    return ModelLoadError(message, where=f"model '{model}' config.pbtxt", fix=fix)


def _validate_tensors(model: str, kind: str, tensors: Any, max_batch_size: int) -> None:
    seen: set[str] = set()
    for tensor in tensors:
        if not tensor.name:
            raise _invalid(model, f"model '{model}': every {kind} must have a name")
        if tensor.name in seen:
            raise _invalid(model, f"model '{model}': {kind} '{tensor.name}' is declared twice")
        seen.add(tensor.name)
        if tensor.data_type == mc.TYPE_INVALID:
            raise _invalid(
                model,
                f"model '{model}', {kind} '{tensor.name}': data_type must be set",
                fix="e.g. data_type: TYPE_FP32",
            )
        dims = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
        if not tensor.dims:  # as Triton's: a batched scalar is dims [1] reshaped to []
            raise _invalid(
                model,
                f"model '{model}', {kind} '{tensor.name}': must specify 'dims'",
                fix="list the sizes without the batch dimension, e.g. dims: [ 16 ]; a scalar per batch item is "
                    "dims: [ 1 ] with reshape: { shape: [ ] }",
            )
        for dim in tensor.dims:
            if dim < -1 or dim == 0:
                raise _invalid(
                    model,
                    f"model '{model}', {kind} '{tensor.name}': dimension {dim} is not valid; "
                    "use a positive size or -1 for a variable one",
                )
        del dims


def _inside(name: str) -> bool:
    """A file name relative to the folder it is read from, staying inside it: not absolute, no '..' part
    (a config override through the load API must not point a model at code or files elsewhere)."""
    parts = name.replace("\\", "/").split("/")
    return not name.startswith(("/", "\\")) and ".." not in parts and ":" not in parts[0]


def check_file_names(model: str, config: mc.ModelConfig) -> None:
    """default_model_filename and label_filename stay inside the model (checked before any file is read)."""
    if config.default_model_filename and not _inside(config.default_model_filename):
        raise _invalid(model, f"model '{model}': default_model_filename '{config.default_model_filename}' must name a "
                       "file inside the version directory (no absolute path, no '..')",
                       fix='e.g. default_model_filename: "model.onnx"; put the file in the version directory')
    for output in config.output:
        if output.label_filename and not _inside(output.label_filename):
            raise _invalid(model, f"model '{model}', output '{output.name}': label_filename "
                           f"'{output.label_filename}' must name a file inside the model directory (no absolute "
                           "path, no '..')", fix='e.g. label_filename: "labels.txt" beside config.pbtxt')


_BOOLEAN_CONTROLS = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY")
_CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")


def _validate_sequence_controls(model: str, sb: Any) -> None:
    """Triton's checks of sequence_batching.control_input: each kind once; START / END / READY give their
    false and true values as exactly one pair (``int32_false_true``, ``fp32_false_true`` or
    ``bool_false_true``); CORRID a data_type and no pair."""
    kinds = mc.ModelSequenceBatching.Control.Kind
    seen: set[int] = set()
    for tensor in sb.control_input:
        for control in tensor.control:
            kind = kinds.Name(control.kind)
            where = f"sequence_batching control_input '{tensor.name}' ({kind})"
            if control.kind in seen:
                raise _invalid(model, f"model '{model}': sequence batching specifies multiple {kind} tensors",
                               fix=f"keep one control_input of kind {kind}")
            seen.add(control.kind)
            pairs = [(field, len(getattr(control, field))) for field in ("int32_false_true", "fp32_false_true",
                                                                         "bool_false_true") if getattr(control, field)]
            if kind in _BOOLEAN_CONTROLS:
                if not pairs:
                    raise _invalid(model, f"model '{model}': {where} must specify either 'int32_false_true', "
                                   "'fp32_false_true' or 'bool_false_true'",
                                   fix="e.g. control [ { kind: " + kind + " int32_false_true: [ 0, 1 ] } ]")
                if len(pairs) > 1:
                    raise _invalid(model, f"model '{model}': {where} specifies both '{pairs[0][0]}' and "
                                   f"'{pairs[1][0]}'", fix="keep one false/true pair")
                if pairs[0][1] != 2:
                    raise _invalid(model, f"model '{model}': {where}: '{pairs[0][0]}' must have exactly 2 entries "
                                   f"(the false value, then the true one), got {pairs[0][1]}",
                                   fix=f"e.g. {pairs[0][0]}: [ 0, 1 ]")
            elif kind == "CONTROL_SEQUENCE_CORRID":
                if pairs:
                    raise _invalid(model, f"model '{model}': {where} must not specify '{pairs[0][0]}' (a correlation "
                                   "ID is not a false/true flag)", fix="give it a data_type instead")
                if mc.DataType.Name(control.data_type) not in _CORRID_TYPES:
                    raise _invalid(model, f"model '{model}': {where} must specify a data_type of "
                                   f"{', '.join(_CORRID_TYPES)}, got {mc.DataType.Name(control.data_type)}",
                                   fix="e.g. data_type: TYPE_UINT64")


def validate_config(config: mc.ModelConfig, *, model: str) -> None:
    """Triton's checks, each naming the model and the field."""
    if config.name != model:
        raise _invalid(
            model,
            f"model configuration name '{config.name}' does not match the model directory name '{model}'",
            fix=f'set name: "{model}" or leave it out',
        )
    backend = backend_of(config)
    if not backend:
        raise _invalid(
            model,
            f"model '{model}': must specify 'platform' or 'backend' (got platform '{config.platform}')",
            fix='e.g. platform: "onnxruntime_onnx", platform: "pytorch_libtorch", backend: "python" '
            'or platform: "ensemble"',
        )
    if backend not in ("onnxruntime", "pytorch", "python", "ensemble"):
        raise _invalid(
            model,
            f"model '{model}': backend '{backend}' is not supported by azulite "
            "(supported: onnxruntime, pytorch, python, ensemble)",
        )
    if config.max_batch_size < 0:
        raise _invalid(model, f"model '{model}': max_batch_size must be >= 0, got {config.max_batch_size}")
    if backend != "python" and not config.input:
        raise _invalid(model, f"model '{model}': must specify one or more 'input's")
    if backend != "python" and not config.output:
        raise _invalid(model, f"model '{model}': must specify one or more 'output's")
    _validate_tensors(model, "input", config.input, config.max_batch_size)
    _validate_tensors(model, "output", config.output, config.max_batch_size)
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        if config.max_batch_size == 0:
            raise _invalid(
                model,
                f"model '{model}': dynamic batching requires max_batch_size > 0 "
                "(the model has no batch dimension)",
                fix="set max_batch_size or remove dynamic_batching",
            )
        for size in db.preferred_batch_size:
            if size < 1 or size > config.max_batch_size:
                raise _invalid(
                    model,
                    f"model '{model}': dynamic batching preferred size {size} must be positive and "
                    f"<= max_batch_size {config.max_batch_size}",
                )
        if db.priority_levels:
            if not 1 <= db.default_priority_level <= db.priority_levels:
                raise _invalid(
                    model,
                    f"model '{model}': dynamic_batching.default_priority_level must be in "
                    f"[1, {db.priority_levels}], got {db.default_priority_level}",
                )
            for level in db.priority_queue_policy:
                if not 1 <= level <= db.priority_levels:
                    raise _invalid(
                        model,
                        f"model '{model}': dynamic_batching.priority_queue_policy level {level} is not "
                        f"in [1, {db.priority_levels}]",
                    )
    if config.response_cache.enable and (config.model_transaction_policy.decoupled
                                         or config.HasField("sequence_batching")):
        kind = "a decoupled model" if config.model_transaction_policy.decoupled else "a sequence model"
        raise _invalid(model, f"model '{model}': response_cache cannot be enabled for {kind} (its answers are "
                       "not a function of one request's inputs)", fix="remove response_cache { enable: true }")
    if config.model_transaction_policy.decoupled and backend not in ("python", "ensemble"):
        raise _invalid(
            model,
            f"model '{model}': decoupled models (model_transaction_policy.decoupled) are not supported by "
            f"azulite's {backend} backend",
            fix="serve decoupled models with the python backend, or set decoupled: false (one response per request)",
        )
    check_file_names(model, config)
    if config.HasField("sequence_batching"):
        _validate_sequence_controls(model, config.sequence_batching)
    if config.version_policy.HasField("latest") and config.version_policy.latest.num_versions < 1:
        raise _invalid(model, f"model '{model}': version_policy.latest.num_versions must be >= 1")
    if backend == "ensemble":
        if not config.ensemble_scheduling.step:
            raise _invalid(model, f"ensemble '{model}': ensemble_scheduling must have at least one step")
        for index, step in enumerate(config.ensemble_scheduling.step):
            if not step.model_name:
                raise _invalid(model, f"ensemble '{model}': step {index} must name a model_name")
            if not step.input_map or not step.output_map:
                raise _invalid(
                    model, f"ensemble '{model}': step {index} ('{step.model_name}') needs input_map and output_map"
                )
