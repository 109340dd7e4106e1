"""Does the exported file compute what the PyTorch model computes? Both run on the same sample inputs;
the report gives the largest absolute and relative error per output, and the export fails when any
element is off by more than ``atol + rtol * |reference|`` (numpy.allclose's rule)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from azulite.errors import ExportVerificationError


@dataclass(frozen=True)
class Tolerance:
    atol: float = 1e-5
    rtol: float = 1e-4


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclass(frozen=True)
class Verification:
    rows: int
    tolerance: Tolerance
    outputs: tuple[OutputError, ...]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def max_abs(self) -> float:
        return max(o.max_abs for o in self.outputs)

    @property
    def max_rel(self) -> float:
        return max(o.max_rel for o in self.outputs)

    def summary(self) -> str:
        return (f"max abs error {self.max_abs:.3g}, max rel error {self.max_rel:.3g} on {self.rows} rows "
                f"(tolerance atol {self.tolerance.atol:g} + rtol {self.tolerance.rtol:g} x |reference|)")


def reference_outputs(model: Any, recipe: Any, sample: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The PyTorch model's own outputs, keyed by the recipe's output names: checked against what
    model_config declares (inputs it runs on; outputs' count, datatypes and dims) first."""
    from azulite.export.signature import call_model, check_returns

    out = call_model(model, recipe.inputs, sample, where=recipe.where)
    rows = len(next(iter(sample.values()))) if sample else 0
    check_returns(out, recipe.outputs, rows, where=recipe.where)
    return {t.name: o.detach().numpy() for t, o in zip(recipe.outputs, out)}


def compare(reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], tolerance: Tolerance,
            rows: int) -> Verification:
    outputs = []
    for name, want in reference.items():
        have = np.asarray(got[name])
        if have.shape != want.shape:
            raise ExportVerificationError(f"output {name!r}: the export returns shape {have.shape}, PyTorch {want.shape}")
        w, h = want.astype(np.float64), have.astype(np.float64)
        diff = np.abs(h - w)
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff / np.maximum(np.abs(w), np.finfo(np.float32).tiny)).max()) if diff.size else 0.0
        ok = bool(np.all(diff <= tolerance.atol + tolerance.rtol * np.abs(w)))
        outputs.append(OutputError(name, max_abs, max_rel, ok))
    return Verification(rows=rows, tolerance=tolerance, outputs=tuple(outputs))
