"""The served signature against the model: inputs the rebuilt model cannot run on, outputs whose dims or
datatypes are not what it returns, and an ONNX file that does not take what config.pbtxt would say, are each
an ExportError naming the model_config field, with nothing written (a config contradicting its model passed
as "verified"; a wrong input was a RuntimeError traceback)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from azulite.errors import ExportError
from azulite.export import ExportOptions, export_checkpoint
from azulite.export.recipe import ModelRecipe, TensorSpec
from azulite.export.signature import check_returns
from azulite.export.verify import reference_outputs
from azulite.workloads import mlp
from tests.export.conftest import repo_entries, save_checkpoint

WHERE = "ckpt/step-00000040/manifest.json"


def _recipe(**tensor) -> ModelRecipe:
    """The DDP example's model_config (16 features in, 1 out) with one field of one tensor replaced:
    ``inputs_dims=[8]``, ``outputs_dtype="INT64"``."""
    config = mlp.model_config(16, 32)
    for key, value in tensor.items():
        kind, field = key.split("_")
        config[kind][0][field] = value
    return ModelRecipe.from_model_config(config, where=WHERE)


def _reference(recipe: ModelRecipe) -> dict:
    torch.manual_seed(0)
    return reference_outputs(mlp.build_mlp(16, 32).eval(), recipe, recipe.sample_inputs(64))


def test_the_declared_signature_passes_and_minus_one_matches_any_size():
    assert _reference(_recipe())["y"].shape == (64, 1)
    assert _reference(_recipe(outputs_dims=[-1]))["y"].shape == (64, 1)


@pytest.mark.parametrize("edit, field, words", [
    ({"inputs_dims": [8]}, "model_config.inputs[0]",
     "the model cannot run on the inputs model_config.inputs[0] declares: x (FP32, dims [8]) fed as a batch [64, 8]: "
     "RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x8 and 16x32)"),
    ({"inputs_dtype": "INT64"}, "model_config.inputs[0]", "x (INT64, dims [16]) fed as a batch [64, 16]: RuntimeError: mat1 and mat2"),
    ({"inputs_dims": [-1]}, "model_config.inputs[0]", "x (FP32, dims [-1]) fed as a batch [64, 4] (each -1 tried as 4): RuntimeError"),
    ({"outputs_dims": [4]}, "model_config.outputs[0].dims",
     "y (FP32, dims [4]): the model returns [64, 1] for a batch of 64 rows ([1] per row)"),
    ({"outputs_dims": [1, 1]}, "model_config.outputs[0].dims", "y (FP32, dims [1, 1]): the model returns [64, 1]"),
    ({"outputs_dtype": "INT64"}, "model_config.outputs[0].dtype", "y (INT64, dims [1]): the model returns FP32, not INT64"),
])
def test_a_signature_that_contradicts_the_model_names_the_field(edit, field, words):
    with pytest.raises(ExportError) as e:
        _reference(_recipe(**edit))
    assert e.value.exit_code == 2 and e.value.where == f"{WHERE} ({field})"
    assert words in e.value.message
    assert "CheckpointConfig(model_config=...)" in e.value.fix and "manifest.json" in e.value.fix
    if field.endswith(".dims") and "[4]" in str(edit):
        assert e.value.fix.startswith("declare dims [1] (per row, without the batch dimension")


def test_returns_are_counted_and_must_be_batched_tensors():
    y = TensorSpec(name="y", dtype="FP32", dims=(1,))
    with pytest.raises(ExportError, match=r"the model returns 2 tensors but model_config.outputs lists 1"):
        check_returns([np.zeros((4, 1), np.float32)] * 2, [y], 4, where=WHERE)
    with pytest.raises(ExportError, match=r"returns a dict as output 0, not a tensor"):
        check_returns([{"y": 1}], [y], 4, where=WHERE)
    with pytest.raises(ExportError, match=r"returns \[1\] for a batch of 4 rows \(no batch dimension of 4 in front\)"):
        check_returns([np.zeros(1, np.float32)], [y], 4, where=WHERE)
    with pytest.raises(ExportError, match=r"the onnx export returns FP64, not FP32"):
        check_returns([np.zeros((4, 1))], [y], 4, where=WHERE, by="the onnx export")
    with pytest.raises(ExportError, match=r"returns bfloat16, not FP32"):
        check_returns([torch.zeros(4, 1, dtype=torch.bfloat16)], [y], 4, where=WHERE)
    check_returns([torch.zeros(4, 1)], [y], 4, where=WHERE)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(3)
    root = tmp_path_factory.mktemp("sig")
    wrong = mlp.model_config(16, 32)
    wrong["outputs"][0]["dims"] = [4]  # the model outputs [batch, 1]
    return {"good": save_checkpoint(root / "good", mlp.build_mlp(16, 32), mlp.model_config(16, 32), step=40),
            "wrong": save_checkpoint(root / "wrong", mlp.build_mlp(16, 32), wrong, step=40)}


@pytest.mark.parametrize("fmt", ["onnx", "torchscript", "python"])
def test_an_export_whose_config_contradicts_the_model_writes_nothing(ckpt, tmp_path, fmt):
    # it wrote config.pbtxt with dims 4 and printed "verified"
    repo = tmp_path / "repo"
    with pytest.raises(ExportError) as e:
        export_checkpoint(str(ckpt["wrong"]), ExportOptions(repo=repo, format=fmt))
    assert e.value.where.endswith("step-00000040/manifest.json (model_config.outputs[0].dims)")
    assert "the model returns [64, 1] for a batch of 64 rows" in e.value.message
    assert repo_entries(repo) == []


def test_an_onnx_export_without_a_batch_dimension_is_refused_naming_the_flag(ckpt, tmp_path):
    # --max-batch-size 0 wrote dims [16] beside an ONNX file taking [64, 16]: no request could be served
    repo = tmp_path / "repo"
    with pytest.raises(ExportError) as e:
        export_checkpoint(str(ckpt["good"]), ExportOptions(repo=repo, format="onnx", max_batch_size=0))
    assert e.value.message.startswith("--max-batch-size 0 serves x whole, as dims [16] (no batch dimension), but the "
                                      "exported ONNX file takes [64, 16]")
    assert "--max-batch-size N >= 1" in e.value.fix and repo_entries(repo) == []
    ok = export_checkpoint(str(ckpt["good"]), ExportOptions(repo=repo, format="onnx"))
    assert ok.verification.ok and repo_entries(repo) == ["mlp", "mlp/1", "mlp/1/model.onnx", "mlp/config.pbtxt"]
