"""What gets served, decided before any file is written: the module to export (tensors in, tensors out),
its signature, the inputs a client sends, PyTorch's answer to them (the reference the export is verified
against) and, when clients send raw records, a preprocessing step that runs in front of the model: as a
Triton ensemble, or (when the plan has that form) in one Python-backend step that also runs the model.

A model whose ``model_config`` names a ``serving`` callable (``"pkg.module:callable"``, called with the
rebuilt model and the model_config) gets that callable's plan: this is how a model that takes, e.g., a
KeyedJaggedTensor is served from raw Criteo rows. Any other model is served as it is, with the
``inputs``/``outputs`` its model_config lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from azulite.export.recipe import ModelRecipe, TensorSpec, import_callable

Arrays = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class PreprocessStep:
    """A Triton Python-backend model in front of the exported one: ``inputs`` (what clients send) -> the
    exported model's inputs. ``model_py`` is its whole, self-contained source (it must run in any Triton
    Python backend, which has numpy but not azulite); ``run`` is the same computation in-process."""

    inputs: tuple[TensorSpec, ...]
    model_py: str
    run: Callable[[Arrays], dict[str, np.ndarray]]
    files: Mapping[str, bytes] = field(default_factory=dict)
    #: the one-step form (``--pipeline fused``), when the plan has one: a self-contained Python-backend
    #: model.py that does this step AND runs the exported model (the ``model.onnx`` in its own version folder,
    #: with onnxruntime) on every request handed over, in one execute. Its TritonPythonModel also has
    #: ``run_batch(feed) -> outputs`` (what clients send -> what they get), which the export verifies it by.
    fused_model_py: str | None = None


@dataclass(frozen=True)
class ServingPlan:
    module: Any
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: (n, seed) -> what a client sends: the raw records when there is a preprocess step
    sample: Callable[[int, int], dict[str, np.ndarray]]
    #: PyTorch's outputs for what a client sends (through the training code's own preprocessing)
    reference: Callable[[Arrays], dict[str, np.ndarray]]
    preprocess: PreprocessStep | None = None
    recipe: ModelRecipe | None = None

    @property
    def client_inputs(self) -> tuple[TensorSpec, ...]:
        return self.preprocess.inputs if self.preprocess else self.inputs


def plan_for(model: Any, recipe: ModelRecipe) -> ServingPlan:
    if recipe.serving:
        fn = import_callable(recipe.serving, what="model_config.serving")
        return fn(model, dict(recipe.raw))
    from azulite.export.verify import reference_outputs

    return ServingPlan(module=model, inputs=recipe.inputs, outputs=recipe.outputs, sample=recipe.sample_inputs,
                       reference=lambda feed: reference_outputs(model, recipe, feed), recipe=recipe)
