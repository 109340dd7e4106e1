"""Exporting into a repository that carries an integrity manifest (azulite.integrity, issue 11): the
manifest is updated and re-signed, or the export fails before writing anything."""

from __future__ import annotations

import pytest
import torch

from azulite import integrity
from azulite.errors import ExportError
from azulite.export import ExportOptions, export_checkpoint
from azulite.workloads import mlp
from tests.export.conftest import repo_entries, save_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("ick") / "ckpt"
    save_checkpoint(root, mlp.build_mlp(4, 8), mlp.model_config(4, 8))
    return root


def test_signed_repository_is_re_signed_or_refused(ckpt, tmp_path):
    repo = tmp_path / "repo"
    export_checkpoint(str(ckpt), ExportOptions(repo=repo, name="a"))
    integrity.generate_keypair(tmp_path / "key.pem", tmp_path / "key.pub")
    integrity.sign_repository(repo, tmp_path / "key.pem")
    before = repo_entries(repo)
    with pytest.raises(ExportError, match="is signed: exporting into it must re-sign it"):
        export_checkpoint(str(ckpt), ExportOptions(repo=repo, name="a"))
    assert repo_entries(repo) == before  # refused before anything was written
    result = export_checkpoint(str(ckpt), ExportOptions(repo=repo, name="a", sign_key=tmp_path / "key.pem"))
    assert result.version == 2 and "re-signed" in result.integrity
    manifest = integrity.verify_repository(repo, tmp_path / "key.pub")  # every file, and the signature
    assert "a/2/model.onnx" in manifest.files

