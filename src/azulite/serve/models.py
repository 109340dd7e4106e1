"""A loaded model version: its final config, the tensor specs requests are checked against, its
scheduler (a Batcher over its instances; none for an ensemble), its statistics and the metadata message
answered for it. Built by the manager; read by the data plane on every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from azulite.serve import config as cfg
from azulite.serve.batcher import Batcher
from azulite.serve.ensemble import EnsembleStep, plan_of
from azulite.serve.proto import model_config_pb2 as mc
from azulite.serve.proto import service_pb2 as pb
from azulite.serve.stats import ModelStats

READY = "READY"
UNAVAILABLE = "UNAVAILABLE"
LOADING = "LOADING"
UNLOADING = "UNLOADING"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str  # KServe v2 name: "FP32", "BYTES" ...
    dims: tuple[int, ...]  # without the batch dimension; -1 = any
    reshape: tuple[int, ...] | None = None
    optional: bool = False

    @classmethod
    def of(cls, tensor: mc.ModelInput | mc.ModelOutput) -> "TensorSpec":
        reshape = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None
        return cls(
            name=tensor.name,
            datatype=cfg.wire_datatype(tensor.data_type),
            dims=tuple(tensor.dims),
            reshape=reshape,
            optional=getattr(tensor, "optional", False),
        )

    def matches(self, shape: tuple[int, ...]) -> bool:
        # a tuple compare first: every request of a fixed-shape input answers it in one C call
        return shape == self.dims or (len(shape) == len(self.dims)
                                      and all(d == -1 or d == s for d, s in zip(self.dims, shape)))


@dataclass(slots=True, eq=False)
class LoadedModel:
    name: str
    version: int
    config: mc.ModelConfig
    batcher: Batcher | None
    stats: ModelStats
    labels: dict[str, list[str]] = field(default_factory=dict)
    inputs: dict[str, TensorSpec] = field(default_factory=dict)
    outputs: dict[str, TensorSpec] = field(default_factory=dict)
    required_inputs: frozenset[str] = frozenset()
    version_str: str = ""
    #: an ensemble's steps, read out of its config once (empty for other models)
    ensemble_plan: tuple[EnsembleStep, ...] = ()
    #: the config's, read once: checked several times per request, and a protobuf field read costs more
    max_batch_size: int = 0
    #: the config has sequence_batching; model_transaction_policy.decoupled (read once, for the same reason)
    sequence: bool = False
    decoupled: bool = False
    #: response_cache { enable: true } (serve/response_cache.py; the server must have a cache too)
    response_cache: bool = False

    def __post_init__(self) -> None:
        self.inputs = {t.name: TensorSpec.of(t) for t in self.config.input}
        self.outputs = {t.name: TensorSpec.of(t) for t in self.config.output}
        self.required_inputs = frozenset(n for n, s in self.inputs.items() if not s.optional)
        self.version_str = str(self.version)
        self.max_batch_size = self.config.max_batch_size
        self.sequence = self.config.HasField("sequence_batching")
        self.decoupled = self.config.model_transaction_policy.decoupled
        self.response_cache = self.config.response_cache.enable
        if self.config.HasField("ensemble_scheduling"):
            self.ensemble_plan = plan_of(self.config)

    @property
    def is_ensemble(self) -> bool:
        return self.batcher is None

    def metadata(self, versions: list[str]) -> pb.ModelMetadataResponse:
        batch = [-1] if self.max_batch_size > 0 else []
        msg = pb.ModelMetadataResponse(
            name=self.name, versions=versions, platform=self.config.platform or self.config.backend
        )
        for spec in self.inputs.values():
            msg.inputs.add(name=spec.name, datatype=spec.datatype, shape=[*batch, *spec.dims])
        for spec in self.outputs.values():
            msg.outputs.add(name=spec.name, datatype=spec.datatype, shape=[*batch, *spec.dims])
        return msg


@dataclass(slots=True)
class VersionState:
    state: str
    reason: str = ""


@dataclass(slots=True, eq=False)
class ModelEntry:
    """Everything known about one model name: its ready versions and the state of each version tried."""

    name: str
    ready: dict[int, LoadedModel] = field(default_factory=dict)
    states: dict[int, VersionState] = field(default_factory=dict)
    state: str = UNAVAILABLE  # the model as a whole, for models that failed before any version
    reason: str = ""
    fingerprint: tuple = ()
    config: mc.ModelConfig | None = None
    #: loaded by name (start-up set, load API), not only as an ensemble's composing model: an ensemble's
    #: unload with unload_dependents leaves it loaded
    explicit: bool = True
    #: why the last load of this model failed ("" if it succeeded); the loaded versions may still serve
    load_error: str = ""
    #: how to fix that failure, when the error said ("" otherwise): the load API's answer carries it
    load_fix: str = ""
    #: the config override (JSON) the loaded versions were loaded with: a load without one keeps it, as
    #: Triton's does, until the model is unloaded (None: config.pbtxt)
    override: str | None = None

    def default(self) -> LoadedModel | None:
        """The version a request without one gets: the highest ready version."""
        return self.ready[max(self.ready)] if self.ready else None
