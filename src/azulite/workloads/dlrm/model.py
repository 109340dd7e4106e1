"""The DLRM factory: TorchRec's DLRM over one EmbeddingBagCollection, one table per Criteo feature.

``build_model(**kwargs)`` is importable and needs no process group, so the export step rebuilds the
trained model unsharded from the checkpoint manifest's ``model_config`` (``factory`` + ``kwargs``), and
:func:`load_plain_model` loads a sharded checkpoint of any world size into it in one process. The model's
``state_dict`` keys are the same sharded (DistributedModelParallel) and plain: ``sparse_arch.
embedding_bag_collection.embedding_bags.t_cat_<i>.weight``, ``dense_arch.model._mlp.<k>._linear.weight``...
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from azulite.data.criteo import CAT_FEATURE_COUNT, CAT_FEATURE_NAMES, INT_FEATURE_COUNT, preprocess_spec
from azulite.errors import CheckpointError, ModelConfigError


def _drop_fx_tracing_notice(record: logging.LogRecord) -> bool:
    # torchrec's modules call torch.fx's is_fx_tracing(), which logs a deprecation notice meant for torchrec
    # ("is_fx_tracing will return true for both fx.symbolic_trace and torch.export ...") into every rank's
    # log of a DLRM job and onto the console of `azulite export`: nothing a user can act on
    return "is_fx_tracing will return true" not in record.getMessage()


logging.getLogger("torch.fx._symbolic_trace").addFilter(_drop_fx_tracing_notice)

FACTORY = "azulite.workloads.dlrm.model:build_model"
#: the Stateful name under which the training script saves ``ModelState(model, optimizer)``; its model
#: weights are DCP keys ``model.model.<state_dict key>``
STATE_KEY = "model"


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """The model's shape (the seed's flags). Validated when built: every mistake is named before any
    process group starts."""

    #: rows of each of the 26 tables (Criteo C1..C26), e.g. the seed's 40000000,39060,...
    num_embeddings_per_feature: tuple[int, ...]
    #: width of every table; the dense arch's last layer must equal it (DLRM's interaction needs it)
    embedding_dim: int = 64
    dense_arch_layer_sizes: tuple[int, ...] = (512, 256, 64)
    #: the last layer is the logit: 1
    over_arch_layer_sizes: tuple[int, ...] = (512, 512, 256, 1)

    def __post_init__(self) -> None:
        n = self.num_embeddings_per_feature
        if len(n) != CAT_FEATURE_COUNT:
            raise ModelConfigError(
                f"--num_embeddings_per_feature has {len(n)} values; Criteo has {CAT_FEATURE_COUNT} categorical "
                "features, one table each", where="--num_embeddings_per_feature",
                fix=f"give {CAT_FEATURE_COUNT} comma-separated table sizes, e.g. " + ",".join(["1000"] * 4) + ",...")
        bad = [(i, v) for i, v in enumerate(n) if not isinstance(v, int) or v < 1]
        if bad:
            raise ModelConfigError(f"table size {bad[0][1]!r} of feature C{bad[0][0] + 1} must be an integer >= 1",
                                   where="--num_embeddings_per_feature", fix="e.g. 1000")
        for flag, sizes in (("--dense_arch_layer_sizes", self.dense_arch_layer_sizes),
                            ("--over_arch_layer_sizes", self.over_arch_layer_sizes)):
            if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ModelConfigError(f"{flag}={','.join(map(str, sizes))!r}: layer sizes must be integers >= 1",
                                       where=flag, fix="e.g. 512,256,64")
        if not isinstance(self.embedding_dim, int) or self.embedding_dim < 1:
            raise ModelConfigError(f"--embedding_dim={self.embedding_dim!r} must be an integer >= 1",
                                   where="--embedding_dim", fix="e.g. 64")
        if self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ModelConfigError(
                f"the dense arch's last layer ({self.dense_arch_layer_sizes[-1]}) does not match "
                f"--embedding_dim={self.embedding_dim}: DLRM interacts the dense output with every embedding",
                where="--dense_arch_layer_sizes",
                fix=f"end --dense_arch_layer_sizes with {self.embedding_dim}, e.g. "
                    f"{','.join(map(str, (*self.dense_arch_layer_sizes[:-1], self.embedding_dim)))}")
        if self.over_arch_layer_sizes[-1] != 1:
            raise ModelConfigError(
                f"the over arch's last layer is {self.over_arch_layer_sizes[-1]}; it is the click logit: 1",
                where="--over_arch_layer_sizes",
                fix=f"end --over_arch_layer_sizes with 1, e.g. {','.join(map(str, (*self.over_arch_layer_sizes[:-1], 1)))}")

    def table_bytes(self) -> int:
        """fp32 bytes of all embedding tables."""
        return sum(self.num_embeddings_per_feature) * self.embedding_dim * 4

    def kwargs(self) -> dict[str, Any]:
        """JSON-able keyword arguments of :func:`build_model`."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def model_config(self) -> dict[str, Any]:
        """What the training script writes into every checkpoint manifest (``CheckpointConfig.model_config``)."""
        return {"factory": FACTORY, "kwargs": self.kwargs(), "state_key": STATE_KEY,
                "preprocess": preprocess_spec(self.num_embeddings_per_feature)}


def build_model(*, num_embeddings_per_feature: Sequence[int], embedding_dim: int = 64,
                dense_arch_layer_sizes: Sequence[int] = (512, 256, 64),
                over_arch_layer_sizes: Sequence[int] = (512, 512, 256, 1),
                device: str | torch.device = "cpu") -> torch.nn.Module:
    """TorchRec's DLRM with one table ``t_cat_<i>`` per feature ``cat_<i>``, unsharded.

    ``device="meta"`` builds the tables without memory, for DistributedModelParallel to materialize only
    each rank's shards (the dense arch then also sits on meta until DMP moves it). Forward takes
    ``(dense_features [B, 13] float32, sparse_features KeyedJaggedTensor)`` and returns logits ``[B, 1]``.
    """
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    cfg = DLRMConfig(num_embeddings_per_feature=tuple(num_embeddings_per_feature), embedding_dim=embedding_dim,
                     dense_arch_layer_sizes=tuple(dense_arch_layer_sizes),
                     over_arch_layer_sizes=tuple(over_arch_layer_sizes))
    device = torch.device(device)
    tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=cfg.embedding_dim, num_embeddings=rows,
                                 feature_names=[name])
              for name, rows in zip(CAT_FEATURE_NAMES, cfg.num_embeddings_per_feature)]
    ebc = EmbeddingBagCollection(tables=tables, device=device)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=INT_FEATURE_COUNT,
                dense_arch_layer_sizes=list(cfg.dense_arch_layer_sizes),
                over_arch_layer_sizes=list(cfg.over_arch_layer_sizes),
                dense_device=device)


def load_plain_model(checkpoint_dir: str | os.PathLike) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild the model from a committed checkpoint directory (``step-N/``) alone, in this process and
    without a process group: the manifest's ``model_config`` names the factory and its kwargs, DCP
    reshards the saved (table/column-wise sharded) weights into the plain tables. Returns the model in
    eval mode and the model_config."""
    import torch.distributed.checkpoint as dcp

    manifest_path = os.path.join(checkpoint_dir, "manifest.json")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path} does not exist: not a committed checkpoint",
                              where=str(checkpoint_dir), fix="pass a step-N directory that has a manifest.json") from None
    mc = manifest.get("model_config") or {}
    if mc.get("factory") != FACTORY:
        raise CheckpointError(f"checkpoint's model factory is {mc.get('factory')!r}, not {FACTORY!r}",
                              where=manifest_path, fix="pass a checkpoint written by examples/dlrm/train.py")
    model = build_model(**mc["kwargs"])
    sd = model.state_dict()
    dcp.load({mc.get("state_key", STATE_KEY): {"model": sd}}, checkpoint_id=str(checkpoint_dir), no_dist=True)
    model.load_state_dict(sd)
    return model.eval(), mc
