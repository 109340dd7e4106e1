"""How to rebuild a trained model from its checkpoint alone: the ``model_config`` a training script records
in ``CheckpointConfig(model_config=...)``, which every manifest carries.

    {"factory": "pkg.module:callable",          # returns the torch.nn.Module, unwrapped (no DDP/FSDP)
     "kwargs": {...},                            # the factory's keyword arguments (JSON)
     "state_key": "model",                       # the Checkpointer state entry holding the module
     "inputs":  [{"name": "x", "dtype": "FP32", "dims": [16]}],        # per row: no batch dimension
     "outputs": [{"name": "y", "dtype": "FP32", "dims": [1]}],
     # optional:
     "examples": "pkg.module:callable",          # (n, seed) -> {input name: np.ndarray [n, *dims]}
     "serving": "pkg.module:callable"}           # (model, model_config) -> azulite.export.plan.ServingPlan:
                                                 # a wrapper module, raw-record preprocessing (an ensemble step);
                                                 # with it, inputs/outputs may be left out

Validated here, when read, so a missing field is reported once with what the training script must add.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from azulite.errors import ExportError

#: the KServe v2 datatypes an exported model's tensors may have, with their numpy dtypes
DTYPES: dict[str, np.dtype] = {
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "INT8": np.dtype(np.int8), "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64), "UINT8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "BYTES": np.dtype(np.object_),
}

#: serving adapters for the factories of azulite's own workloads, whose checkpoints (written before this
#: existed, too) do not name one in model_config.serving
ADAPTERS: dict[str, str] = {
    "azulite.workloads.dlrm.model:build_model": "azulite.export.dlrm:plan",
}

_EXAMPLE = (
    'CheckpointConfig(model_config={"factory": "my_pkg.models:build_model", "kwargs": {"hidden": 32}, '
    '"state_key": "model", "inputs": [{"name": "x", "dtype": "FP32", "dims": [16]}], '
    '"outputs": [{"name": "y", "dtype": "FP32", "dims": [1]}]})'
)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the served model; ``dims`` exclude the batch dimension (-1: variable)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    #: integer inputs: the half-open range sample values are drawn from for verification
    range: tuple[int, int] = (0, 100)

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class ModelRecipe:
    factory: str
    kwargs: Mapping[str, Any]
    state_key: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    examples: str | None = None
    #: "pkg.module:callable" building the ServingPlan (model_config.serving, or the factory's adapter)
    serving: str | None = None
    preprocess: Mapping[str, Any] | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    #: where model_config was read (the manifest), for errors about its fields
    where: str = ""

    @classmethod
    def from_model_config(cls, config: Any, *, where: str) -> ModelRecipe:
        if not isinstance(config, Mapping) or not config:
            raise _missing("the manifest has no model_config", where)
        if "factory" not in config:
            raise _missing(f"model_config has no 'factory' (it has: {sorted(config) or 'nothing'})", where)
        factory = config["factory"]
        if not isinstance(factory, str) or factory.count(":") != 1 or not all(factory.split(":")):
            raise _missing(f"model_config.factory {factory!r} is not 'package.module:callable'", where)
        kwargs = config.get("kwargs", {})
        if not isinstance(kwargs, Mapping):
            raise _missing(f"model_config.kwargs must be a mapping of keyword arguments, got {kwargs!r}", where)
        state_key = config.get("state_key", "model")
        if not isinstance(state_key, str) or not state_key:
            raise _missing(f"model_config.state_key must name a Checkpointer state entry, got {state_key!r}", where)
        served_by_adapter = (isinstance(config.get("serving"), str) and ":" in config["serving"]) or factory in ADAPTERS
        inputs = _tensors(config, "inputs", where) if not served_by_adapter or "inputs" in config else ()
        outputs = _tensors(config, "outputs", where) if not served_by_adapter or "outputs" in config else ()
        examples = config.get("examples")
        if examples is not None and (not isinstance(examples, str) or ":" not in examples):
            raise _missing(f"model_config.examples {examples!r} is not 'package.module:callable'", where)
        preprocess = config.get("preprocess")
        if preprocess is not None and not isinstance(preprocess, Mapping):
            raise _missing(f"model_config.preprocess must be a mapping, got {preprocess!r}", where)
        serving = config.get("serving") or ADAPTERS.get(factory)
        return cls(factory=factory, kwargs=dict(kwargs), state_key=state_key, inputs=inputs, outputs=outputs,
                   examples=examples, serving=serving, preprocess=preprocess, raw=dict(config), where=where)

    def build(self) -> Any:
        """The freshly built (untrained) module, in eval mode."""
        fn = import_callable(self.factory, what="model_config.factory")
        try:
            model = fn(**self.kwargs)
        except Exception as e:  # noqa: BLE001 - the user's factory: name it and its arguments
            raise ExportError(f"model factory {self.factory}(**{dict(self.kwargs)}) failed: {type(e).__name__}: {e}",
                              fix="record kwargs the factory accepts in model_config.kwargs") from None
        if not hasattr(model, "state_dict") or not callable(model):
            raise ExportError(f"model factory {self.factory} returned {type(model).__name__}, not a torch.nn.Module")
        return model.eval()

    def sample_inputs(self, n: int, seed: int = 0) -> dict[str, np.ndarray]:
        """``n`` rows to verify the export on: the recipe's own ``examples`` callable when it names one
        (real-looking data), else random values of each input's dtype and shape."""
        if self.examples:
            fn = import_callable(self.examples, what="model_config.examples")
            out = fn(n, seed)
            missing = [t.name for t in self.inputs if t.name not in out]
            if missing:
                raise ExportError(f"model_config.examples {self.examples} returned no {missing}")
            return {t.name: np.asarray(out[t.name], dtype=t.numpy_dtype) for t in self.inputs}
        rng = np.random.default_rng(seed)
        sample = {}
        for t in self.inputs:
            shape = (n, *[d if d > 0 else 4 for d in t.dims])
            if t.numpy_dtype.kind == "f":
                sample[t.name] = rng.standard_normal(shape).astype(t.numpy_dtype)
            elif t.numpy_dtype.kind in "iu":
                sample[t.name] = rng.integers(t.range[0], t.range[1], shape).astype(t.numpy_dtype)
            elif t.numpy_dtype.kind == "b":
                sample[t.name] = rng.integers(0, 2, shape).astype(bool)
            else:
                raise ExportError(f"input {t.name!r} ({t.dtype}) cannot be sampled at random",
                                  fix="name a model_config.examples callable that returns real inputs")
        return sample


def import_callable(ref: str, *, what: str) -> Callable[..., Any]:
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ExportError(f"{what} {ref!r}: cannot import module {module_name!r}: {e}",
                          fix="the factory must live in an importable module (installed, or on PYTHONPATH), "
                              "not in the training script") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ExportError(f"{what} {ref!r}: module {module_name!r} has no {attr!r}")
    if not callable(obj):
        raise ExportError(f"{what} {ref!r} is not callable")
    return obj


def _tensors(config: Mapping[str, Any], key: str, where: str) -> tuple[TensorSpec, ...]:
    raw = config.get(key)
    if not isinstance(raw, list) or not raw:
        raise _missing(f"model_config has no '{key}' list (the served model's {key[:-1]} names, dtypes, dims)", where)
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, Mapping) or not isinstance(t.get("name"), str) or not t["name"]:
            raise _missing(f"model_config.{key}[{i}] needs a 'name', got {t!r}", where)
        dtype = str(t.get("dtype", "")).upper().removeprefix("TYPE_")
        if dtype not in DTYPES:
            raise _missing(f"model_config.{key}[{i}] ({t['name']}): dtype {t.get('dtype')!r} is not one of "
                           f"{', '.join(DTYPES)}", where)
        dims = t.get("dims")
        if not isinstance(dims, list) or not dims or not all(isinstance(d, int) and (d > 0 or d == -1) for d in dims):
            raise _missing(f"model_config.{key}[{i}] ({t['name']}): dims {dims!r} must be a non-empty list of "
                           "sizes (> 0, or -1 for variable), without the batch dimension", where)
        rng = t.get("range", (0, 100))
        out.append(TensorSpec(name=t["name"], dtype=dtype, dims=tuple(dims), range=(int(rng[0]), int(rng[1]))))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise _missing(f"model_config.{key} repeats a name: {names}", where)
    return tuple(out)


def _missing(message: str, where: str) -> ExportError:
    return ExportError(
        f"cannot rebuild the model: {message}",
        where=where,
        fix="the training script must record how to rebuild its model, e.g. " + _EXAMPLE,
    )
