"""Repository scanning, version policies, labels, change fingerprints."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from azulite.errors import ModelLoadError, NotFound
from azulite.serve import repository as repo
from azulite.serve.proto import model_config_pb2 as mc


def policy(text: str) -> mc.ModelVersionPolicy:
    from google.protobuf import text_format

    return text_format.Parse(text, mc.ModelVersionPolicy())


def test_list_models_and_versions(model_repository):
    names = repo.list_models(model_repository)
    assert {"add_sub_onnx", "add_sub_pt", "add_sub_py", "string_py", "versioned_py", "bench_matmul"} <= set(names)
    assert repo.version_dirs(model_repository / "versioned_py") == (1, 2)
    with pytest.raises(NotFound, match="does not exist"):
        repo.list_models(model_repository / "nope")


def test_version_dirs_skip_non_numeric_and_zero(tmp_path):
    for d in ("1", "3", "10", "0", "latest", ".hidden"):
        (tmp_path / d).mkdir()
    assert repo.version_dirs(tmp_path) == (1, 3, 10)


def test_version_policies():
    available = (1, 2, 5)
    assert repo.select_versions(mc.ModelVersionPolicy(), available, model="m") == [5]
    assert repo.select_versions(policy("latest { num_versions: 2 }"), available, model="m") == [2, 5]
    assert repo.select_versions(policy("all { }"), available, model="m") == [1, 2, 5]
    assert repo.select_versions(policy("specific { versions: [5, 1] }"), available, model="m") == [1, 5]
    with pytest.raises(ModelLoadError, match=r"asks for version\(s\) \[3\]"):
        repo.select_versions(policy("specific { versions: [3] }"), available, model="m")
    with pytest.raises(ModelLoadError, match="no version folder such as 1/ under /repo/m "):
        repo.select_versions(mc.ModelVersionPolicy(), (), model="m", path=Path("/repo/m"))
    with pytest.raises(ModelLoadError, match="at least one version must be available"):
        repo.select_versions(policy("specific { }"), available, model="m")


def test_labels_and_missing_label_file(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text(
        'name: "m" backend: "python" output [ { name: "y" data_type: TYPE_FP32 dims: [3] label_filename: "labels.txt" } ]')
    source = repo.read_model(tmp_path, "m")
    with pytest.raises(ModelLoadError, match="label file 'labels.txt' not found"):
        repo.read_labels(source, source.config)
    (tmp_path / "m" / "labels.txt").write_text("cat\ndog\nbird\n")
    assert repo.read_labels(source, source.config) == {"y": ["cat", "dog", "bird"]}


def test_read_model_without_config_and_guess_backend(model_repository, tmp_path):
    source = repo.read_model(model_repository, "add_sub_onnx")
    assert source.config is not None and source.versions == (1,)
    (tmp_path / "bare" / "1").mkdir(parents=True)
    (tmp_path / "bare" / "1" / "model.onnx").write_bytes(b"")
    bare = repo.read_model(tmp_path, "bare")
    assert bare.config is None and repo.guess_backend(bare) == "onnxruntime"
    with pytest.raises(NotFound):
        repo.read_model(tmp_path, "absent")


def test_fingerprint_changes_with_files(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text("a")
    before = repo.fingerprint(tmp_path / "m")
    time.sleep(0.01)
    (tmp_path / "m" / "config.pbtxt").write_text("ab")
    assert repo.fingerprint(tmp_path / "m") != before
