"""Triton's ``model_warmup``: sample requests run on every instance at load, before the model is READY,
so the first real request does not pay for lazy initialisation. A failing warmup fails the load."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from azulite.errors import ModelLoadError
from azulite.serve import config as cfg
from azulite.serve.backends.base import ModelInstance, WorkItem
from azulite.serve.proto import model_config_pb2 as mc


def _input(model: str, warmup: mc.ModelWarmup, name: str, spec: mc.ModelWarmup.Input, batch: int,
           model_dir: Path, rng: np.random.Generator) -> np.ndarray:
    wire = cfg.wire_datatype(spec.data_type)
    dtype = cfg.WIRE_TO_NUMPY.get(wire)
    if dtype is None:
        raise ModelLoadError(f"model '{model}' warmup '{warmup.name}': input '{name}' has unsupported type {wire}")
    shape = ((batch,) if batch else ()) + tuple(spec.dims)
    kind = spec.WhichOneof("input_data_type")
    if kind == "input_data_file":
        path = model_dir / "warmup" / spec.input_data_file
        if not path.is_file():
            raise ModelLoadError(f"model '{model}' warmup '{warmup.name}': input file {path} not found")
        raw = path.read_bytes()
        one = np.frombuffer(raw, dtype=dtype) if wire != "BYTES" else np.array([raw], dtype=np.object_)
        return np.resize(one, shape).astype(dtype)
    if wire == "BYTES":
        return np.full(shape, b"" if kind == "zero_data" else b"warmup", dtype=np.object_)
    if kind == "random_data":
        if dtype.kind == "f":
            return rng.random(shape).astype(dtype)
        if dtype.kind == "b":
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.integers(0, 8, shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def warm_up(config: mc.ModelConfig, instance: ModelInstance, model_dir: Path) -> None:
    """Run each warmup sample ``count`` times (at least once) on one instance."""
    rng = np.random.default_rng(0)
    names = {t.name for t in config.input}
    for warmup in config.model_warmup:
        batch = max(1, warmup.batch_size) if config.max_batch_size > 0 else 0
        unknown = sorted(set(warmup.inputs) - names)
        if unknown:  # else the model meets a missing input and fails in its own words
            raise ModelLoadError(f"model '{config.name}' warmup '{warmup.name}': '{unknown[0]}' is not an input of "
                                 f"the model (its inputs: {', '.join(sorted(names))})",
                                 where=f"model '{config.name}' config.pbtxt", fix="name the model's inputs in the warmup")
        missing = sorted({t.name for t in config.input if not t.optional} - set(warmup.inputs))
        if missing:
            raise ModelLoadError(f"model '{config.name}' warmup '{warmup.name}': no sample for input '{missing[0]}'",
                                 where=f"model '{config.name}' config.pbtxt",
                                 fix="give every input of the model in each warmup (zero_data: true is enough)")
        inputs = {name: _input(config.name, warmup, name, spec, batch, model_dir, rng)
                  for name, spec in warmup.inputs.items()}
        for _ in range(max(1, warmup.count)):
            try:
                results, _ = instance.execute([WorkItem(inputs=inputs, outputs=None, batch_size=batch)])
            except Exception as exc:
                raise ModelLoadError(
                    f"failed to load '{config.name}': warmup '{warmup.name}' failed: {exc}"
                ) from None
            if results and isinstance(results[0], Exception):
                raise ModelLoadError(f"failed to load '{config.name}': warmup '{warmup.name}' failed: {results[0]}")
