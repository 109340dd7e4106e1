"""``onnxruntime_onnx``: an ONNX Runtime session per instance, the batch merged with np.concatenate
(onnxruntime releases the GIL while it runs, so instances execute concurrently)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from azulite.errors import InvalidArgument, ModelLoadError
from azulite.serve import merge
from azulite.serve.backends.base import LoadContext, Result, Timing, WorkItem, register
from azulite.serve.proto import model_config_pb2 as mc

# Triton's ONNX Runtime backend fills a missing max_batch_size with this (--backend-config default).
DEFAULT_MAX_BATCH_SIZE = 4

ORT_TO_CONFIG = {
    "tensor(bool)": mc.TYPE_BOOL,
    "tensor(uint8)": mc.TYPE_UINT8,
    "tensor(uint16)": mc.TYPE_UINT16,
    "tensor(uint32)": mc.TYPE_UINT32,
    "tensor(uint64)": mc.TYPE_UINT64,
    "tensor(int8)": mc.TYPE_INT8,
    "tensor(int16)": mc.TYPE_INT16,
    "tensor(int32)": mc.TYPE_INT32,
    "tensor(int64)": mc.TYPE_INT64,
    "tensor(float16)": mc.TYPE_FP16,
    "tensor(float)": mc.TYPE_FP32,
    "tensor(double)": mc.TYPE_FP64,
    "tensor(string)": mc.TYPE_STRING,
    "tensor(bfloat16)": mc.TYPE_BF16,
}


def _session(path: Path, config: mc.ModelConfig, *, model: str, threads: int | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    params = config.parameters
    if threads:
        options.intra_op_num_threads = threads
    # Triton's ORT backend parameters; spinning off: the cores are shared with the event loop.
    if "intra_op_thread_count" in params:
        options.intra_op_num_threads = int(params["intra_op_thread_count"].string_value)
    if "inter_op_thread_count" in params:
        options.inter_op_num_threads = int(params["inter_op_thread_count"].string_value)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf/... types
        raise ModelLoadError(
            f"failed to load model '{model}': onnxruntime could not load {path}: {exc}",
            where=str(path),
        ) from None


def _to_str(b):
    return b.decode() if isinstance(b, bytes) else b


def _to_bytes(s):
    return s.encode() if isinstance(s, str) else s


def _dynamic(dim) -> bool:
    return not isinstance(dim, int) or dim < 0


class OnnxInstance:
    inline_safe = True  # a pure function of its inputs

    def __init__(self, ctx: LoadContext) -> None:
        self.model = ctx.model_name
        self.session = _session(ctx.model_file, ctx.config, model=ctx.model_name, threads=ctx.compute_threads)
        self.batching = ctx.config.max_batch_size > 0
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.string_inputs = {i.name for i in self.session.get_inputs() if i.type == "tensor(string)"}
        names = {i.name for i in self.session.get_inputs()}
        for tensor in ctx.config.input:
            if tensor.name not in names:
                raise ModelLoadError(
                    f"model '{ctx.model_name}': config input '{tensor.name}' is not an input of the ONNX "
                    f"model (its inputs: {sorted(names)})",
                    where=str(ctx.model_file),
                )

    def execute(self, items: list[WorkItem]) -> tuple[list[Result], Timing]:
        t0 = time.perf_counter_ns()
        sizes = [item.batch_size for item in items]
        feed = merge.merge_inputs([item.inputs for item in items], sizes)
        if self.string_inputs:  # onnxruntime wants str, the wire carries bytes
            feed = dict(feed)
            for name in self.string_inputs:
                if name in feed:
                    feed[name] = np.vectorize(_to_str, otypes=[object])(feed[name])
        wanted = self.output_names
        if all(item.outputs is not None for item in items):
            union = set().union(*(item.outputs for item in items))  # type: ignore[arg-type]
            wanted = [n for n in self.output_names if n in union]
        t1 = time.perf_counter_ns()
        try:
            arrays = self.session.run(wanted, feed)
        except Exception as exc:
            raise InvalidArgument(f"model '{self.model}': onnxruntime failed to run the request: {exc}") from None
        t2 = time.perf_counter_ns()
        outputs = {}
        for name, array in zip(wanted, arrays):
            if array.dtype.kind in ("U", "O"):
                array = np.vectorize(_to_bytes, otypes=[object])(array)
            outputs[name] = array
        results: list[Result] = merge.split_outputs(outputs, sizes, model=self.model) if self.batching else [outputs]
        return results, Timing(t1 - t0, t2 - t1, time.perf_counter_ns() - t2)

    def close(self) -> None:
        self.session = None


@register("onnxruntime")
class OnnxRuntimeBackend:
    name = "onnxruntime"

    def load(self, ctx: LoadContext) -> OnnxInstance:
        return OnnxInstance(ctx)

    def auto_complete(self, config: mc.ModelConfig, model_file: Path) -> mc.ModelConfig:
        """As Triton's ONNX Runtime backend: inputs and outputs from the model when the config has none;
        if every input and output has a variable first dimension and max_batch_size is unset, the model
        batches: max_batch_size 4 and default dynamic batching."""
        session = _session(model_file, config, model=config.name)
        ins, outs = session.get_inputs(), session.get_outputs()
        can_batch = all(len(t.shape) > 0 and _dynamic(t.shape[0]) for t in (*ins, *outs))
        if config.max_batch_size == 0 and can_batch and not config.input and not config.output:
            config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
            if not config.HasField("dynamic_batching"):
                config.dynamic_batching.SetInParent()
        skip = 1 if config.max_batch_size > 0 else 0
        for kind, tensors, target in (("input", ins, config.input), ("output", outs, config.output)):
            if target:
                continue
            for tensor in tensors:
                if tensor.type not in ORT_TO_CONFIG:
                    raise ModelLoadError(
                        f"model '{config.name}': {kind} '{tensor.name}' has unsupported type {tensor.type}"
                    )
                dims = [d if isinstance(d, int) and d >= 0 else -1 for d in tensor.shape[skip:]]
                target.add(name=tensor.name, data_type=ORT_TO_CONFIG[tensor.type], dims=dims or [1])
        return config
