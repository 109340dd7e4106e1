"""Writing config.pbtxt: Triton's own ``ModelConfig`` message filled in and printed by protobuf's
text_format (the format Triton parses), then parsed and validated back by the server's own code, so a
config azulite writes is one azulite serve loads.

Hand-written only in what it decides (batching, names, comments); the syntax is protobuf's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from google.protobuf import text_format

from azulite.errors import AzuliteError, ExportError
from azulite.export.recipe import TensorSpec
from azulite.serve import config as serve_config
from azulite.serve.proto import model_config_pb2 as mc

ONNX_PLATFORM = serve_config.ONNX_PLATFORM
TORCH_PLATFORM = serve_config.TORCH_PLATFORM


@dataclass(frozen=True)
class Batching:
    """``max_batch_size`` 0: the model takes no batch dimension (each request is one call)."""

    max_batch_size: int = 0
    dynamic: bool = False
    max_queue_delay_us: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ExportError(f"max batch size {self.max_batch_size} must be >= 0", fix="e.g. --max-batch-size 64")
        if self.dynamic and self.max_batch_size == 0:
            raise ExportError("dynamic batching needs a batch dimension: max batch size is 0",
                              fix="pass --max-batch-size N (N >= 1) with --dynamic-batching")


def tensor(spec: TensorSpec) -> mc.ModelInput:
    t = mc.ModelInput(name=spec.name, data_type=serve_config.WIRE_TO_CONFIG[spec.dtype])
    t.dims.extend(spec.dims)
    return t


def build(name: str, *, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], batching: Batching,
          platform: str = "", backend: str = "", instance_count: int = 0) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, platform=platform, backend=backend, max_batch_size=batching.max_batch_size)
    for spec in inputs:
        config.input.append(tensor(spec))
    for spec in outputs:
        out = mc.ModelOutput(name=spec.name, data_type=serve_config.WIRE_TO_CONFIG[spec.dtype])
        out.dims.extend(spec.dims)
        config.output.append(out)
    if batching.dynamic:
        config.dynamic_batching.SetInParent()
        if batching.max_queue_delay_us:
            config.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us
    if instance_count:
        config.instance_group.add(count=instance_count, kind=mc.ModelInstanceGroup.KIND_CPU)
    return config


def render(config: mc.ModelConfig, notes: Iterable[str] = ()) -> str:
    """The config.pbtxt text: ``notes`` first, as comments (text_format ignores them), then the message.
    Validated by the server's own checks first: what this writes, azulite serve loads."""
    check(config)
    head = "".join(f"# {line}\n" for note in notes for line in note.splitlines())
    body = text_format.MessageToString(config)
    return head + body + ("" if body.endswith("\n") else "\n")


def check(config: mc.ModelConfig) -> None:
    copy = mc.ModelConfig()
    copy.CopyFrom(config)
    try:
        serve_config.fill_defaults(copy, model=config.name)
        serve_config.validate_config(copy, model=config.name)
    except AzuliteError as e:
        raise ExportError(f"the generated configuration would not load: {e.message}", where=f"model '{config.name}'") from None
