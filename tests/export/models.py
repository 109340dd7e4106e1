"""Tiny models the export tests rebuild through model_config factories (importable, as the contract wants)."""

from __future__ import annotations

import torch
from torch import nn


class Branchy(nn.Module):
    """A data-dependent branch: torch.export (hence the ONNX exporter) refuses it, torch.jit.trace records
    the branch taken. ``auto`` must fall back to TorchScript and say why."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(features, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.abs().sum() >= 0):  # always true, but only the data can tell
            return self.lin(x)
        return -self.lin(x)


class Liar(nn.Module):
    """Computes something else while being exported: the verification must catch it."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(features, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if torch.compiler.is_exporting() or torch.jit.is_tracing():
            y = y + 0.5
        return y


def build_branchy(features: int = 4) -> nn.Module:
    return Branchy(features)


def build_liar(features: int = 4) -> nn.Module:
    return Liar(features)


def recipe(factory: str, features: int = 4, **extra) -> dict:
    return {"factory": f"{__name__}:{factory}", "kwargs": {"features": features}, "state_key": "model",
            "inputs": [{"name": "x", "dtype": "FP32", "dims": [features]}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [2]}], **extra}


TEXT_PREPROCESS_PY = '''"""Comma-separated floats (BYTES [1]) -> x (FP32 [features]): a preprocessing step with no one-step form."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            rows = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy().reshape(-1)
            x = np.array([[float(v) for v in row.split(b",")] for row in rows], dtype=np.float32)
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("x", x)]))
        return out
'''


def serve_from_text(model: nn.Module, model_config: dict):
    """A serving plan whose clients send comma-separated text, parsed by a preprocessing step that has no
    one-step (fused) form: ``--pipeline auto`` must serve it as an ensemble."""
    import numpy as np

    from azulite.export.plan import PreprocessStep, ServingPlan
    from azulite.export.recipe import TensorSpec

    features = int(model_config["kwargs"]["features"])
    outputs = int(model_config["kwargs"].get("outputs", 1))
    text = TensorSpec(name="TEXT", dtype="BYTES", dims=(1,))

    def parse(feed):
        rows = np.asarray(feed["TEXT"], dtype=object).reshape(-1)
        return {"x": np.array([[float(v) for v in row.split(b",")] for row in rows], dtype=np.float32)}

    def sample(n: int, seed: int):
        x = np.random.default_rng(seed).standard_normal((n, features)).astype(np.float32)
        return {"TEXT": np.array([",".join(map(repr, map(float, row))).encode() for row in x], dtype=object).reshape(n, 1)}

    def reference(feed):
        with torch.no_grad():
            return {"y": model(torch.from_numpy(parse(feed)["x"])).numpy()}

    return ServingPlan(module=model, inputs=(TensorSpec(name="x", dtype="FP32", dims=(features,)),),
                       outputs=(TensorSpec(name="y", dtype="FP32", dims=(outputs,)),), sample=sample, reference=reference,
                       preprocess=PreprocessStep(inputs=(text,), model_py=TEXT_PREPROCESS_PY, run=parse))
