"""The DDP example's model: a two-layer MLP regressor. It lives here, not in examples/ddp/train.py, so that
``azulite export`` can rebuild it from the factory string the training script records in its checkpoint
manifest (``azulite.workloads.mlp:build_mlp``) without importing the training script."""

from __future__ import annotations

from typing import Any

from torch import nn


def build_mlp(features: int = 16, hidden: int = 32, outputs: int = 1) -> nn.Sequential:
    """Linear -> ReLU -> Linear. A plain ``nn.Sequential`` keeps the parameter names ("0.weight", ...) of
    checkpoints written before the model moved here."""
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


def model_config(features: int = 16, hidden: int = 32, outputs: int = 1) -> dict[str, Any]:
    """What the training script records in ``CheckpointConfig(model_config=...)``: how to rebuild the model
    and its serving signature (one FP32 row of ``features`` in, ``outputs`` predictions out)."""
    return {
        "factory": f"{__name__}:build_mlp",
        "kwargs": {"features": features, "hidden": hidden, "outputs": outputs},
        "state_key": "model",
        "inputs": [{"name": "x", "dtype": "FP32", "dims": [features]}],
        "outputs": [{"name": "y", "dtype": "FP32", "dims": [outputs]}],
    }
