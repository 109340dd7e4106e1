"""The repository manifest: sign, verify, tamper detection naming the file, Ed25519 signatures, and
the exporter's update (re-signed with the key, or refused without it)."""

from __future__ import annotations

import json

import pytest

from azulite import integrity
from azulite.errors import IntegrityError


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    for model in ("a", "b"):
        (root / model / "1").mkdir(parents=True)
        (root / model / "config.pbtxt").write_text(f'name: "{model}"\n')
        (root / model / "1" / "model.onnx").write_bytes(bytes(range(256)) * 10)
    (root / "a" / "1" / "__pycache__").mkdir()
    (root / "a" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"ignored")
    return root


@pytest.fixture
def keys(tmp_path):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub.pem"
    integrity.generate_keypair(private, public)
    return private, public


def test_sign_then_verify(repo):
    path = integrity.sign_repository(repo)
    doc = json.loads(path.read_text())
    assert sorted(doc["files"]) == ["a/1/model.onnx", "a/config.pbtxt", "b/1/model.onnx", "b/config.pbtxt"]
    manifest = integrity.verify_repository(repo)
    manifest.check_model("a")
    manifest.check_model("b")


@pytest.mark.parametrize("change, kind", [
    (lambda r: (r / "a/1/model.onnx").write_bytes(b"evil"), "does not match its sha256"),
    (lambda r: (r / "a/1/model.onnx").unlink(), "missing"),
    (lambda r: (r / "a/1/extra.py").write_text("import os"), "not in the manifest"),
])
def test_tamper_is_named_and_other_models_pass(repo, change, kind):
    integrity.sign_repository(repo)
    change(repo)
    manifest = integrity.load_manifest(repo)
    with pytest.raises(IntegrityError, match=kind) as info:
        manifest.check_model("a")
    assert "a/1/" in str(info.value) and "azulite-manifest.json" in str(info.value)
    manifest.check_model("b")
    with pytest.raises(IntegrityError, match="1 file"):
        integrity.verify_repository(repo)


def test_a_model_not_in_the_manifest_is_refused(repo):
    integrity.sign_repository(repo)
    (repo / "c" / "1").mkdir(parents=True)
    (repo / "c" / "config.pbtxt").write_text('name: "c"\n')
    with pytest.raises(IntegrityError, match="c/config.pbtxt' is not in the manifest"):
        integrity.load_manifest(repo).check_model("c")


def test_signature(repo, keys, tmp_path):
    private, public = keys
    integrity.sign_repository(repo, private)
    assert integrity.load_manifest(repo, public).signed
    with pytest.raises(IntegrityError, match="no public key"):
        integrity.load_manifest(repo)  # the server never trusts a signature it cannot check
    other_private, other_public = tmp_path / "o.pem", tmp_path / "o.pub.pem"
    integrity.generate_keypair(other_private, other_public)
    with pytest.raises(IntegrityError, match="signature does not verify"):
        integrity.load_manifest(repo, other_public)
    # a manifest edited to match a tampered file: the hashes agree, the signature does not
    (repo / "a/1/model.onnx").write_bytes(b"evil")
    doc = json.loads((repo / integrity.MANIFEST).read_text())
    doc["files"]["a/1/model.onnx"] = integrity.sha256_file(repo / "a/1/model.onnx")
    (repo / integrity.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="azulite-manifest.sig"):
        integrity.load_manifest(repo, public)
    with pytest.raises(IntegrityError, match="already exists"):
        integrity.generate_keypair(private, public)


def test_bad_manifest_and_keys_name_the_file(repo, tmp_path):
    (repo / integrity.MANIFEST).write_text("{not json")
    with pytest.raises(IntegrityError, match="not valid JSON") as info:
        integrity.load_manifest(repo)
    assert str(repo / integrity.MANIFEST) in str(info.value)
    (repo / integrity.MANIFEST).write_text(json.dumps({"format": "other", "files": {}}))
    with pytest.raises(IntegrityError, match="not an azulite-manifest/1"):
        integrity.load_manifest(repo)
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(IntegrityError, match="junk.pem"):
        integrity.sign_repository(repo, tmp_path / "junk.pem")


def test_update_for_an_exporter(repo, keys):
    private, public = keys
    integrity.sign_repository(repo, private)
    (repo / "b" / "2").mkdir()
    (repo / "b" / "2" / "model.onnx").write_bytes(b"v2")
    (repo / "a/1/model.onnx").unlink()
    with pytest.raises(IntegrityError, match="signed: updating it needs the signing key"):
        integrity.update_manifest(repo, ["b/2", "a/1/model.onnx"])
    integrity.update_manifest(repo, ["b/2", "a/1/model.onnx"], private_key=private)
    manifest = integrity.verify_repository(repo, public)
    assert "b/2/model.onnx" in manifest.files and "a/1/model.onnx" not in manifest.files
    # signing a signed repository without its key would drop the signature: refused (the fixes said
    # "re-sign: azulite repo sign REPO"); unsigning is removing the signature on purpose
    with pytest.raises(IntegrityError, match="signing it again without the key would drop its signature"):
        integrity.sign_repository(repo)
    (repo / integrity.SIGNATURE).unlink()
    # unsigned repositories update without a key; a repository without a manifest gets one
    integrity.sign_repository(repo)
    (repo / "b/2/model.onnx").write_bytes(b"v2 again")
    integrity.update_manifest(repo, ["b/2/model.onnx"])
    integrity.verify_repository(repo)


def test_a_version_added_as_a_link_is_listed_and_refused(repo, tmp_path):
    """A symlinked folder was not walked: a version added as a link to unsigned code passed `repo verify`
    and the server's check, and its code ran."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.onnx").write_bytes(b"unsigned")
    integrity.sign_repository(repo)
    (repo / "a" / "3").symlink_to(outside, target_is_directory=True)
    with pytest.raises(IntegrityError, match="a/3/model.onnx' is not in the manifest"):
        integrity.load_manifest(repo).check_model("a")
    with pytest.raises(IntegrityError, match="unlisted: a/3/model.onnx"):
        integrity.verify_repository(repo)


def test_a_link_signed_with_the_repository_is_checked_and_a_loop_ends(repo, tmp_path):
    (repo / "b" / "2").symlink_to(repo / "b" / "1", target_is_directory=True)  # a version that is a link
    (repo / "b" / "1" / "up").symlink_to(repo / "b", target_is_directory=True)  # a link back up: a loop
    doc = json.loads(integrity.sign_repository(repo).read_text())
    assert [f for f in sorted(doc["files"]) if f.startswith("b/")] == [  # the loop is not followed
        "b/1/model.onnx", "b/2/model.onnx", "b/config.pbtxt"]
    integrity.load_manifest(repo).check_model("b")
    (repo / "b" / "1" / "model.onnx").write_bytes(b"changed")  # seen through both paths
    with pytest.raises(IntegrityError, match="b/1/model.onnx' does not match"):
        integrity.load_manifest(repo).check_model("b")
