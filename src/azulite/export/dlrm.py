"""Serving TorchRec's DLRM (``azulite.workloads.dlrm``) from raw Criteo rows.

TorchRec's DLRM takes a KeyedJaggedTensor, which neither ONNX nor Triton's wire format carries, and
training hashes and transforms the raw features first (``azulite.data.criteo``). Served, the model takes
one raw TSV line per row, so a client never re-implements preprocessing:

    ROW (BYTES [1], "label? \\t I1..I13 \\t C1..C26")
      -> the parse (Python): split the line, decimal counts and hex categories -> int64
      -> the graph (ONNX): log(1 + max(x, 0)) on the counts, id % num_embeddings per table, the
         embedding rows (one id per bag: the sum pooling is the row itself), DLRM's dense, interaction and
         over arches -> SCORE = sigmoid(logit) (FP32 [1])

By default (``--pipeline auto``: fused) both run in one Python-backend model ``dlrm`` (``ScoringModel``: the
parse, then onnxruntime on the model.onnx beside its model.py): one batcher, one hand-off, no
intermediate tensors. ``--pipeline ensemble`` serves them as the ensemble ``dlrm`` = ``dlrm_preprocess``
(Python) -> ``dlrm_model`` (ONNX). Same scores either way.

The arithmetic of the preprocessing (the transform and the hash, whose constants the checkpoint
records) lives in the exported graph; only the text parsing, which ONNX has no operator for (hex), runs in
Python. The reference the export is verified against is the training path itself: the same rows through
``azulite.data.criteo`` and TorchRec's own DLRM forward with a KeyedJaggedTensor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from azulite.export import dlrm_preprocess
from azulite.export.plan import PreprocessStep, ServingPlan
from azulite.export.recipe import TensorSpec

ROW = TensorSpec(name="ROW", dtype="BYTES", dims=(1,))
DENSE = TensorSpec(name=dlrm_preprocess.DENSE_OUTPUT, dtype="INT64", dims=(dlrm_preprocess.DENSE_COUNT,))
CATEGORIES = TensorSpec(name=dlrm_preprocess.CATEGORY_OUTPUT, dtype="INT64", dims=(dlrm_preprocess.CATEGORY_COUNT,))
SCORE = TensorSpec(name="SCORE", dtype="FP32", dims=(1,))

# The Python-backend step, whole: dlrm_preprocess.py, a module that runs in any Triton (numpy only, no
# azulite) and is written as the step's model.py. Its ``parse_rows`` is also what the export runs in-process
# to verify the pipeline, and what the bench's bare limit runs.
PREPROCESS_MODEL_PY = (Path(__file__).parent / "dlrm_preprocess.py").read_text()
# The one-step pipeline's model.py: the same module, serving its ScoringModel (parse + the ONNX graph).
SCORING_MODEL_PY = PREPROCESS_MODEL_PY + "\nTritonPythonModel = ScoringModel  # written by azulite export --pipeline fused\n"


def _served_module(dlrm: Any, num_embeddings: list[int]) -> Any:
    import torch
    from torch import nn

    from azulite.data.criteo import CAT_FEATURE_NAMES

    bags = dlrm.sparse_arch.embedding_bag_collection.embedding_bags

    class ServedDLRM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense_arch, self.inter_arch, self.over_arch = dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch
            # The 26 tables end to end in one, each feature's ids offset to its own rows: the graph looks
            # every feature up with one Gather, not a column slice and a lookup per feature (52 Gathers and
            # 26 Unsqueezes, whose per-operator cost was most of a small batch's run). Same rows, same sums.
            weights = [bags[f"t_{n}"].weight.detach() for n in CAT_FEATURE_NAMES]
            self.table = nn.Parameter(torch.cat(weights), requires_grad=False)
            starts = [0]
            for w in weights[:-1]:
                starts.append(starts[-1] + w.shape[0])
            self.register_buffer("modulus", torch.tensor(num_embeddings, dtype=torch.int64))
            self.register_buffer("offsets", torch.tensor(starts, dtype=torch.int64))

        def forward(self, dense_raw: torch.Tensor, category_ids: torch.Tensor) -> torch.Tensor:
            # azulite.data.criteo.transform_dense: log1p(max(x, 0)) in float64, then float32
            dense = torch.log1p(torch.clamp(dense_raw, min=0).to(torch.float64)).to(torch.float32)
            # hash_ids: id % num_embeddings of the table, then the table's first row in the one table
            ids = torch.remainder(category_ids, self.modulus) + self.offsets
            sparse = nn.functional.embedding(ids, self.table)  # [batch, 26, dim]
            logits = self.over_arch(self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=sparse))
            return torch.sigmoid(logits)

    return ServedDLRM().eval()


def sample_rows(n: int, seed: int = 0) -> np.ndarray:
    """``n`` raw Criteo rows (with a label), with empty, negative and large fields: what clients send."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        dense = [("" if rng.random() < 0.1 else str(int(rng.integers(-3, 5000)))) for _ in range(13)]
        cats = [("" if rng.random() < 0.05 else f"{int(rng.integers(0, 1 << 32)):08x}") for _ in range(26)]
        rows.append("\t".join([str(int(rng.integers(0, 2))), *dense, *cats]).encode())
    return np.array(rows, dtype=object).reshape(n, 1)


def reference_scores(dlrm: Any, rows: np.ndarray, num_embeddings: list[int]) -> np.ndarray:
    """The training path: azulite.data.criteo's parse, transform and hash, a KeyedJaggedTensor, TorchRec's
    DLRM forward, sigmoid. Rows without a label get a dummy one (parse_line expects it)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from azulite.data import criteo

    dense, cats = [], []
    for raw in np.asarray(rows, dtype=object).reshape(-1):
        line = raw if isinstance(raw, bytes) else str(raw).encode()
        if line.count(b"\t") == criteo.FIELD_COUNT - 2:
            line = b"0\t" + line
        parsed = criteo.parse_line(line)
        if parsed is None:
            raise ValueError(f"not a Criteo row: {line[:60]!r}")
        dense.append(parsed[1])
        cats.append(parsed[2])
    d = torch.from_numpy(criteo.transform_dense(np.array(dense, dtype=np.int64)))
    ids = criteo.hash_ids(np.array(cats, dtype=np.int64), num_embeddings)
    b = len(dense)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(criteo.CAT_FEATURE_NAMES), values=torch.from_numpy(np.ascontiguousarray(ids.T)).reshape(-1),
        lengths=torch.ones(criteo.CAT_FEATURE_COUNT * b, dtype=torch.int32))
    fx_log = logging.getLogger("torch.fx._symbolic_trace")  # TorchRec's forward asks is_fx_tracing(): it warns
    level = fx_log.level
    fx_log.setLevel(logging.ERROR)
    try:
        with torch.inference_mode():
            return torch.sigmoid(dlrm(d, kjt)).numpy()
    finally:
        fx_log.setLevel(level)


def plan(model: Any, model_config: Mapping[str, Any]) -> ServingPlan:
    num_embeddings = [int(n) for n in model_config["kwargs"]["num_embeddings_per_feature"]]

    def preprocess(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        dense, cats = dlrm_preprocess.parse_rows(feed[ROW.name])
        return {DENSE.name: dense, CATEGORIES.name: cats}

    step = PreprocessStep(inputs=(ROW,), run=preprocess, model_py=PREPROCESS_MODEL_PY, fused_model_py=SCORING_MODEL_PY)
    return ServingPlan(
        module=_served_module(model, num_embeddings), inputs=(DENSE, CATEGORIES), outputs=(SCORE,),
        sample=lambda n, seed: {ROW.name: sample_rows(n, seed)},
        reference=lambda feed: {SCORE.name: reference_scores(model, feed[ROW.name], num_embeddings)},
        preprocess=step)
