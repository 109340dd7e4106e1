"""azulite.export: a trained checkpoint -> a Triton model repository (the only bridge from training to
serving), and config.pbtxt generated offline from a model file.

    from azulite.export import ExportOptions, export_checkpoint
    result = export_checkpoint("runs/ckpt", ExportOptions(repo=Path("model_repository")))

See README.md, "Export: from checkpoint to endpoint".
"""

from __future__ import annotations

from azulite.export.generate import Generated, generate
from azulite.export.pipeline import ExportOptions, ExportResult, export_checkpoint
from azulite.export.recipe import ModelRecipe, TensorSpec
from azulite.export.verify import Tolerance

__all__ = ["ExportOptions", "ExportResult", "Generated", "ModelRecipe", "TensorSpec", "Tolerance",
           "export_checkpoint", "generate"]
