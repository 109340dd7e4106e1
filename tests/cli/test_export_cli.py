"""``azulite export`` and ``azulite config generate``: path mistakes refused before any work, naming the
argument, exit 2 (were tracebacks, a stray temp file, or "no committed checkpoint" with exit 1)."""

from __future__ import annotations

from pathlib import Path

from tests.cli.inprocess import exit_code as run

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


def test_export_source_and_to_mistakes(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    assert run("export", tmp_path, "--to", tmp_path / "f") == 2  # a traceback after the model was rebuilt
    assert "--to: " in err_of(capsys)
    assert run("export", tmp_path / "typo", "--to", tmp_path / "repo") == 2  # "no committed checkpoint", exit 1
    assert "does not exist" in err_of(capsys)
    assert run("export", tmp_path / "f", "--to", tmp_path / "repo") == 2
    assert "is a file, not a checkpoint directory" in err_of(capsys)
    assert not (tmp_path / "repo").exists()
