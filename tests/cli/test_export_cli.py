"""``azulite export`` and ``azulite config generate``: path mistakes refused before any work, naming the
argument, exit 2 (were tracebacks, a stray temp file, or "no committed checkpoint" with exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from azulite.workloads import mlp
from tests.cli.inprocess import exit_code as run
from tests.export.conftest import save_checkpoint

MODEL = Path(__file__).resolve().parents[2] / "examples" / "model_repository" / "add_sub_onnx" / "1" / "model.onnx"


def err_of(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_config_generate_output_and_model_file_mistakes(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert run("config", "generate", MODEL, "-o", out) == 2  # a traceback, and out/../.out.tmp left behind
    assert "(--output): is a directory" in err_of(capsys) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "f").write_text("x")
    assert run("config", "generate", MODEL, "-o", tmp_path / "f" / "config.pbtxt") == 2  # a traceback
    assert "'" + str(tmp_path / "f") + "' is a file" in err_of(capsys)
    assert run("config", "generate", out) == 2  # was "model file DIR does not exist"
    assert "is a directory" in err_of(capsys)
    assert run("config", "generate", MODEL, "-o", tmp_path / "new" / "config.pbtxt") == 0  # folders are created
    assert 'platform: "onnxruntime_onnx"' in (tmp_path / "new" / "config.pbtxt").read_text()


def test_config_generate_of_an_empty_or_foreign_file_says_so(capsys, tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"")
    assert run("config", "generate", tmp_path / "model.onnx") == 2  # was "its graph has no outputs"
    err = err_of(capsys)
    assert "the file is empty (0 bytes): not an ONNX or TorchScript model" in err and "fix: " in err, err
    (tmp_path / "notes.onnx").write_bytes(b"\x08\x07")  # protobuf reads it as a ModelProto with no graph
    assert run("config", "generate", tmp_path / "notes.onnx") == 2  # was "its graph has no outputs"
    err = err_of(capsys)
    assert "notes.onnx is not an ONNX model (no graph and no opset in it)" in err and "fix: pass an .onnx" in err
    (tmp_path / "model.pt").write_text("hello")
    assert run("config", "generate", tmp_path / "model.pt") == 2  # was torch's "internal miniz error ..."
    assert "model.pt is not a TorchScript model (not the zip archive torch.jit.save writes)" in err_of(capsys)


def test_export_source_and_to_mistakes(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    assert run("export", tmp_path, "--to", tmp_path / "f") == 2  # a traceback after the model was rebuilt
    assert "--to: " in err_of(capsys)
    assert run("export", tmp_path / "typo", "--to", tmp_path / "repo") == 2  # "no committed checkpoint", exit 1
    assert "does not exist" in err_of(capsys)
    assert run("export", tmp_path / "f", "--to", tmp_path / "repo") == 2
    assert "is a file, not a checkpoint directory" in err_of(capsys)
    # storage named wrongly (a scheme azulite does not write, no credentials) is the user's to fix: exit 2, not
    # the 1 of storage that is down
    assert run("export", "s3://bucket/run", "--to", tmp_path / "repo") == 2
    assert "unsupported checkpoint storage scheme 's3'" in err_of(capsys)
    assert not (tmp_path / "repo").exists()


def test_export_of_a_location_without_a_committed_checkpoint_exits_2(capsys, tmp_path):
    (tmp_path / "ckpt").mkdir()
    assert run("export", tmp_path / "ckpt", "--to", tmp_path / "repo") == 2  # was 1 (the README says 2)
    err = err_of(capsys)
    assert f"no committed checkpoint under {tmp_path / 'ckpt'} (no step directories)" in err and "fix: " in err
    assert not (tmp_path / "repo").exists()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Steps 5 and 9 of an MLP, committed by the real Checkpointer."""
    root = tmp_path_factory.mktemp("ckpt") / "run"
    model = mlp.build_mlp(8, 16)
    for step in (5, 9):
        save_checkpoint(root, model, mlp.model_config(8, 16), step=step)
    return root


def test_export_says_how_many_ranks_saved_the_checkpoint_in_words(capsys, tmp_path, checkpoints):
    assert run("export", checkpoints, "--to", tmp_path / "repo") == 0
    assert f"checkpoint {checkpoints}/step-00000009 (step 9, saved by 1 rank)" in err_of(capsys)  # "1 ranks"


def test_export_a_step_that_is_not_there_is_a_usage_error_listing_the_steps(capsys, tmp_path, checkpoints):
    assert run("export", checkpoints, "--to", tmp_path / "repo", "--step", "7") == 2  # was 1, with no fix line
    err = err_of(capsys)
    assert "no checkpoint step 7 under" in err and "(committed steps there: 5, 9)" in err, err
    assert "fix: pass one of them, e.g. --step 9, or omit --step for the newest" in err, err
    assert run("export", checkpoints / "step-00000005", "--to", tmp_path / "repo", "--step", "7") == 2  # was 1
    assert "fix: drop --step" in err_of(capsys)
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize(("flags", "says"), [
    (("--version", "0"), "--version 0 must be >= 1"),
    (("--rows", "0"), "--rows 0 must be >= 2"),
    (("--max-batch-size", "-1"), "--max-batch-size -1 must be >= 0"),
    (("--max-queue-delay-us", "-5"), "--max-queue-delay-us -5 must be >= 0"),  # was a traceback (protobuf)
    (("--atol", "-1"), "--atol -1 must be a number >= 0"),  # was "does not match PyTorch" after the export
    (("--name", "a/b"), "model name 'a/b' is not a folder name"),
])
def test_export_numbers_are_checked_before_the_model_is_rebuilt(capsys, tmp_path, checkpoints, flags, says):
    assert run("export", checkpoints, "--to", tmp_path / "repo", *flags) == 2
    err = err_of(capsys)
    assert f"error: {says}" in err and "fix: " in err, err
    assert "rebuilt" not in err and "checkpoint " not in err.split("error:")[0], err  # nothing read before
    assert not (tmp_path / "repo").exists()


def test_export_of_an_unknown_job_exits_2_as_job_show_does(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("AZULITE_HOME", str(tmp_path / "home"))
    assert run("job", "show", "nosuch-1") == 2
    capsys.readouterr()
    assert run("export", "nosuch-1", "--to", tmp_path / "repo") == 2  # was 1
    assert "no job 'nosuch-1' and no checkpoint directory of that name" in err_of(capsys)


def test_export_of_inputs_the_model_cannot_take_is_an_error_not_a_traceback(capsys, tmp_path):
    config = mlp.model_config(16, 32)
    config["inputs"][0]["dims"] = [8]  # the model takes 16 features: a RuntimeError traceback, exit 1
    step = save_checkpoint(tmp_path / "ckpt", mlp.build_mlp(16, 32), config, step=40)
    assert run("export", step, "--to", tmp_path / "repo") == 2
    err = err_of(capsys)
    assert f"error: {step}/manifest.json (model_config.inputs[0]): the model cannot run on the inputs" in err
    assert "mat1 and mat2 shapes cannot be multiplied (64x8 and 16x32)" in err and "fix: declare what" in err
    assert "Traceback" not in err and not (tmp_path / "repo").exists()
