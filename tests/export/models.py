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
