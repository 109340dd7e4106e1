"""``pytorch_libtorch``: a TorchScript ``model.pt`` run with ``torch.jit.load`` on the CPU.

Input binding follows Triton's PyTorch backend: names ``<anything>__<index>`` bind to the forward
argument at that index; otherwise config inputs bind to forward arguments by name, else in config order.
Outputs: ``<anything>__<index>`` picks that element of the returned tuple, otherwise config order.
"""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import numpy as np

from azulite.errors import InvalidArgument, ModelLoadError
from azulite.serve import merge
from azulite.serve.backends.base import LoadContext, Result, Timing, WorkItem, register
from azulite.serve.proto import model_config_pb2 as mc

_INDEXED = re.compile(r"^.+__(\d+)$")


def _positions(names: list[str], forward_args: list[str]) -> list[int]:
    indexed = [_INDEXED.match(n) for n in names]
    if all(indexed):
        return [int(m.group(1)) for m in indexed]  # type: ignore[union-attr]
    if set(names) <= set(forward_args):
        return [forward_args.index(n) for n in names]
    return list(range(len(names)))


def _writable(array: np.ndarray) -> np.ndarray:
    """torch wants writable memory; arrays straight off the wire (np.frombuffer) are read-only."""
    array = np.ascontiguousarray(array)
    return array if array.flags.writeable else array.copy()


class TorchInstance:
    inline_safe = True  # a pure function of its inputs

    def __init__(self, ctx: LoadContext) -> None:
        import torch

        self.torch = torch
        self.model = ctx.model_name
        if ctx.compute_threads and torch.get_num_threads() != ctx.compute_threads:
            torch.set_num_threads(ctx.compute_threads)  # process-wide in torch; the same for every instance
        try:
            with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; Triton's libtorch backend runs it
                warnings.simplefilter("ignore", DeprecationWarning)
                self.module = torch.jit.load(str(ctx.model_file), map_location="cpu").eval()
        except Exception as exc:
            raise ModelLoadError(
                f"failed to load model '{ctx.model_name}': torch.jit.load({ctx.model_file}) failed: {exc}",
                where=str(ctx.model_file),
            ) from None
        try:
            args = [a.name for a in self.module.forward.schema.arguments][1:]  # drop self
        except Exception:
            args = []
        in_names = [t.name for t in ctx.config.input]
        self.input_order = [n for _, n in sorted(zip(_positions(in_names, args), in_names))]
        out_names = [t.name for t in ctx.config.output]
        self.output_pos = dict(zip(out_names, _positions(out_names, [])))
        self.batching = ctx.config.max_batch_size > 0

    def execute(self, items: list[WorkItem]) -> tuple[list[Result], Timing]:
        torch = self.torch
        t0 = time.perf_counter_ns()
        sizes = [item.batch_size for item in items]
        feed = merge.merge_inputs([item.inputs for item in items], sizes)
        tensors = [torch.from_numpy(_writable(feed[n])) for n in self.input_order]
        t1 = time.perf_counter_ns()
        try:
            with torch.inference_mode():
                result = self.module(*tensors)
        except Exception as exc:
            raise InvalidArgument(f"model '{self.model}': the TorchScript model failed on the request: {exc}") from None
        t2 = time.perf_counter_ns()
        if isinstance(result, torch.Tensor):
            result = (result,)
        outputs = {}
        for name, pos in self.output_pos.items():
            if isinstance(result, dict):
                value = result[name]
            else:
                value = result[pos]
            outputs[name] = value.detach().cpu().numpy()
        results: list[Result] = merge.split_outputs(outputs, sizes, model=self.model) if self.batching else [outputs]
        return results, Timing(t1 - t0, t2 - t1, time.perf_counter_ns() - t2)

    def close(self) -> None:
        self.module = None


@register("pytorch")
class TorchScriptBackend:
    name = "pytorch"

    def load(self, ctx: LoadContext) -> TorchInstance:
        return TorchInstance(ctx)

    def auto_complete(self, config: mc.ModelConfig, model_file: Path) -> mc.ModelConfig:
        """TorchScript files carry no tensor types or shapes: like Triton, the config must name them."""
        if not config.input or not config.output:
            raise ModelLoadError(
                f"model '{config.name}': a PyTorch (TorchScript) model needs a config.pbtxt listing its "
                "inputs and outputs; they cannot be read from model.pt",
                where=str(model_file.parent.parent / "config.pbtxt"),
            )
        return config
