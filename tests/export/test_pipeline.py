"""azulite.export in-process: formats and their fallbacks, verification, version folders, and every bad
input the issue lists — each a clear error, with nothing written into the repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import tritonclient.http as httpclient

from azulite.errors import CheckpointError, ExportError, ExportVerificationError
from azulite.export import ExportOptions, Tolerance, export_checkpoint
from azulite.serve import config as serve_config
from azulite.workloads import mlp
from tests.export import models
from tests.export.conftest import repo_entries, save_checkpoint
from tests.serve.frontends import running_server


@pytest.fixture(scope="module")
def mlp_ckpt(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(3)
    model = mlp.build_mlp(8, 16)
    root = tmp_path_factory.mktemp("mlp") / "ckpt"
    save_checkpoint(root, model, mlp.model_config(8, 16), step=7)
    return root, model


def test_onnx_export_equals_the_trained_model_and_versions_count_up(mlp_ckpt, tmp_path):
    root, model = mlp_ckpt
    repo = tmp_path / "repo"
    first = export_checkpoint(str(root), ExportOptions(repo=repo, name="m"))
    assert (first.format, first.version, first.step, first.skipped) == ("onnx", 1, 7, ())
    assert first.verification.ok and first.verification.max_abs < 1e-5
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    got = ort.InferenceSession(str(repo / "m" / "1" / "model.onnx")).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, model(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
    config = serve_config.parse_config_file(repo / "m" / "config.pbtxt", model="m")
    serve_config.validate_config(config, model="m")
    assert (config.platform, config.max_batch_size, list(config.input[0].dims)) == ("onnxruntime_onnx", 64, [8])
    assert config.HasField("dynamic_batching")
    second = export_checkpoint(str(root / "step-00000007"), ExportOptions(repo=repo, name="m"))
    assert (second.format, second.version, second.inputs, second.outputs) == ("onnx", 2, ("x",), ("y",))
    assert repo_entries(repo) == ["m", "m/1", "m/1/model.onnx", "m/2", "m/2/model.onnx", "m/config.pbtxt"]
    with pytest.raises(ExportError, match="version 2 already exists"):
        export_checkpoint(str(root), ExportOptions(repo=repo, name="m", version=2))


def test_a_new_version_keeps_the_models_one_config_and_its_format(mlp_ckpt, tmp_path):
    """Triton: one config.pbtxt per model, shared by every version. A version in another format, with
    another signature or batch size would not load beside the others: refused, naming the fix, with
    nothing written; a fitting one lands and the config (with the user's own edits) stays as it was."""
    root, model = mlp_ckpt
    repo = tmp_path / "repo"
    export_checkpoint(str(root), ExportOptions(repo=repo, name="m", max_batch_size=16))
    config = repo / "m" / "config.pbtxt"
    edited = config.read_text() + "version_policy { all { } }\n"  # the user's own setting: serve every version
    config.write_text(edited)
    before = repo_entries(repo)
    with pytest.raises(ExportError) as err:
        export_checkpoint(str(root), ExportOptions(repo=repo, name="m", format="torchscript"))
    assert f"model 'm' in {repo} is onnx (onnxruntime_onnx; versions 1); a torchscript version cannot join them" \
        in err.value.message
    assert "--name m_torchscript" in err.value.fix and "--format onnx" in err.value.fix
    with pytest.raises(ExportError, match=r"cannot apply: --max-batch-size 64 \(the model's config.pbtxt: 16\)"):
        export_checkpoint(str(root), ExportOptions(repo=repo, name="m", max_batch_size=64))
    wide = tmp_path / "wide"
    save_checkpoint(wide, mlp.build_mlp(12, 16), mlp.model_config(12, 16))
    with pytest.raises(ExportError, match=r"does not fit model 'm' .*: input x has dims \[12\], the config says \[8\]"):
        export_checkpoint(str(wide), ExportOptions(repo=repo, name="m"))
    assert repo_entries(repo) == before and config.read_text() == edited

    torch.manual_seed(4)
    retrained = mlp.build_mlp(8, 16)
    save_checkpoint(tmp_path / "ckpt2", retrained, mlp.model_config(8, 16))
    second = export_checkpoint(str(tmp_path / "ckpt2"), ExportOptions(repo=repo, name="m"))  # auto: the model's onnx
    assert (second.format, second.version) == ("onnx", 2)
    assert config.read_text() == edited
    # both versions load under the one config and each answers with its own weights
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    with running_server(repo) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        for version, module in (("1", model), ("2", retrained)):
            assert client.is_model_ready("m", version)
            i = httpclient.InferInput("x", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            got = client.infer("m", [i], model_version=version).as_numpy("y")
            np.testing.assert_allclose(got, module(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_auto_falls_back_to_torchscript_and_says_why(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, models.build_branchy(), models.recipe("build_branchy"))
    result = export_checkpoint(str(root), ExportOptions(repo=tmp_path / "repo", name="b"))
    assert result.format == "torchscript"
    assert [f for f, _ in result.skipped] == ["onnx"]
    assert "data-dependent" in result.skipped[0][1]
    assert result.verification.ok


def test_python_backend_format(mlp_ckpt, tmp_path):
    root, _ = mlp_ckpt
    result = export_checkpoint(str(root), ExportOptions(repo=tmp_path / "repo", name="p", format="python"))
    vdir = tmp_path / "repo" / "p" / "1"
    assert sorted(p.name for p in vdir.iterdir()) == ["model.py", "recipe.json", "weights.pt"]
    assert json.loads((vdir / "recipe.json").read_text())["factory"] == "azulite.workloads.mlp:build_mlp"
    assert result.verification.max_abs == 0.0


def test_export_that_does_not_match_pytorch_fails_and_writes_nothing(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, models.build_liar(), models.recipe("build_liar"))
    repo = tmp_path / "repo"
    with pytest.raises(ExportVerificationError, match=r"does not match PyTorch: max abs error 0\.5"):
        export_checkpoint(str(root), ExportOptions(repo=repo, name="liar"))
    assert repo_entries(repo) == []
    # a tolerance that admits the difference lets it through (the check is the tolerance, not a constant)
    ok = export_checkpoint(str(root), ExportOptions(repo=repo, name="liar", tolerance=Tolerance(atol=0.6)))
    assert ok.verification.ok and abs(ok.verification.max_abs - 0.5) < 1e-6


def test_uncommitted_and_corrupt_checkpoints_are_refused(mlp_ckpt, tmp_path):
    root, _ = mlp_ckpt
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    step = copy / "step-00000007"
    repo = tmp_path / "repo"
    shard = sorted(step.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not match the manifest") as e:
        export_checkpoint(str(copy), ExportOptions(repo=repo))
    assert e.value.exit_code == 1 and e.value.fix == "the checkpoint is damaged: export another step (--step)"
    # the step folder named: no --step to give (it was offered)
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not match the manifest") as e:
        export_checkpoint(str(step), ExportOptions(repo=repo))
    assert e.value.fix == ("the checkpoint is damaged: restore its files from a copy, or export another committed "
                           f"step folder of {copy}") and "--step" not in e.value.fix
    # a manifest that is there but not one is damage, as resume says (export said "an interrupted save")
    (step / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError) as e:
        export_checkpoint(str(step), ExportOptions(repo=repo))
    assert e.value.message == f"checkpoint {step} is corrupt: its manifest.json is not a valid manifest"
    assert e.value.exit_code == 1 and "--step" not in e.value.fix
    (step / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as e:
        export_checkpoint(str(step), ExportOptions(repo=repo))
    assert e.value.message == f"checkpoint {step} is not committed: it has no manifest.json: an interrupted save"
    assert e.value.exit_code == 2
    # a location with no committed checkpoint: the README's exit 2 (it was 1)
    with pytest.raises(CheckpointError, match=r"no committed checkpoint under .* \(1 step directory, none committed\)") as e:
        export_checkpoint(str(copy), ExportOptions(repo=repo))
    assert e.value.exit_code == 2
    with pytest.raises(CheckpointError, match=r"no committed checkpoint .* \(no step directories\)") as e:
        export_checkpoint(str(tmp_path / "empty"), ExportOptions(repo=repo))
    assert e.value.exit_code == 2
    assert repo_entries(repo) == []


def test_missing_rebuild_metadata_says_what_the_training_script_must_record(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, mlp.build_mlp(), {"features": 16, "hidden": 32})  # the DDP example's old model_config
    with pytest.raises(ExportError) as err:
        export_checkpoint(str(root), ExportOptions(repo=tmp_path / "repo"))
    text = str(err.value)
    assert "model_config has no 'factory'" in text and "manifest.json" in text
    assert 'the training script must record how to rebuild its model, e.g. CheckpointConfig(model_config={"factory"' in text
    wrong = {**mlp.model_config(), "kwargs": {"features": 16, "hidden": 64}}
    root2 = tmp_path / "ckpt2"
    save_checkpoint(root2, mlp.build_mlp(), wrong)
    with pytest.raises(ExportError, match=r"shapes differ from the checkpoint's 'model': 0.weight: checkpoint \[32, 16\], model \[64, 16\]"):
        export_checkpoint(str(root2), ExportOptions(repo=tmp_path / "repo"))
    root3 = tmp_path / "ckpt3"
    save_checkpoint(root3, mlp.build_mlp(), {**mlp.model_config(), "factory": "no_such_pkg.models:build"})
    with pytest.raises(ExportError, match="cannot import module 'no_such_pkg.models'"):
        export_checkpoint(str(root3), ExportOptions(repo=tmp_path / "repo"))
    assert repo_entries(tmp_path / "repo") == []


def test_a_preprocessing_step_without_a_one_step_form_is_served_as_an_ensemble(tmp_path):
    """``--pipeline auto`` (the default) serves a plan's preprocessing in one step only where the plan has
    that form (DLRM: tests/export/test_export_dlrm.py); otherwise as an ensemble, and asking for fused is
    refused, with nothing written."""
    root = tmp_path / "ckpt"
    torch.manual_seed(5)
    model = mlp.build_mlp(4, 8)
    save_checkpoint(root, model, {**mlp.model_config(4, 8), "serving": "tests.export.models:serve_from_text"})
    repo = tmp_path / "repo"
    with pytest.raises(ExportError, match="has no one-step form") as err:
        export_checkpoint(str(root), ExportOptions(repo=repo, name="t", pipeline="fused"))
    assert "--pipeline ensemble" in err.value.fix
    assert repo_entries(repo) == []
    result = export_checkpoint(str(root), ExportOptions(repo=repo, name="t"))
    assert (result.pipeline, result.format, result.inputs, result.outputs) == ("ensemble", "onnx", ("TEXT",), ("y",))
    assert result.verification.ok
    assert sorted(p.name for p in repo.iterdir()) == ["t", "t_model", "t_preprocess"]
