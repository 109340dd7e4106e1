"""``azulite serve --model-repository az://...`` against Azurite: the repository mirrored into a local
cache as whole snapshots, integrity-checked (Content-MD5), re-synced for poll mode, served to Triton's client."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from azulite.errors import StorageError
from azulite.serve.remote import RemoteRepository
from tests.cli.test_serve import Served
from tests.train.azurite import running

MODEL = Path(__file__).parent / "models" / "add_sub_py"


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    with running(tmp_path_factory) as az:
        yield az


@pytest.fixture
def container(azurite, request):
    from azure.storage.blob import BlobServiceClient

    name = "models" + str(abs(hash(request.node.name)) % 10**8)
    c = BlobServiceClient.from_connection_string(azurite.connection_string).create_container(name)
    return c


def upload_model(container, prefix: str, name: str = "add_sub_py") -> None:
    """Triton's layout: <name>/config.pbtxt and <name>/1/model.py."""
    config = (MODEL / "config.pbtxt").read_bytes().replace(b'name: "add_sub_py"', f'name: "{name}"'.encode())
    container.upload_blob(f"{prefix}/{name}/config.pbtxt", config, overwrite=True)
    container.upload_blob(f"{prefix}/{name}/1/model.py", (MODEL / "model.py").read_bytes(), overwrite=True)


def test_sync_snapshots_changes_and_integrity(container, azurite, tmp_path):
    upload_model(container, "repo")
    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string}
    r = RemoteRepository(f"az://{container.container_name}/repo", tmp_path / "cache", env)
    assert r.sync() is True
    assert (r.path / "add_sub_py" / "config.pbtxt").read_bytes() == (MODEL / "config.pbtxt").read_bytes()
    first = r.path.resolve()
    assert r.sync() is False and r.path.resolve() == first

    container.upload_blob("repo/add_sub_py/config.pbtxt", b"# changed\n", overwrite=True)
    assert r.sync() is True
    assert (r.path / "add_sub_py" / "config.pbtxt").read_bytes() == b"# changed\n"
    assert not first.exists()  # the old snapshot is gone, the unchanged model.py was linked, not fetched
    assert (r.path / "add_sub_py" / "1" / "model.py").read_bytes() == (MODEL / "model.py").read_bytes()

    # a blob whose bytes do not match its Content-MD5: refused, the previous snapshot keeps serving
    from azure.storage.blob import ContentSettings

    good = r.path.resolve()
    container.upload_blob("repo/add_sub_py/1/model.py", b"print('tampered')\n", overwrite=True)
    container.get_blob_client("repo/add_sub_py/1/model.py").set_http_headers(ContentSettings(content_md5=bytearray(16)))
    with pytest.raises(StorageError, match="integrity check failed for repo/add_sub_py/1/model.py"):
        r.sync()
    assert r.path.resolve() == good and (r.path / "add_sub_py" / "config.pbtxt").read_bytes() == b"# changed\n"
    assert [p.name for p in r.root.iterdir() if p.name.startswith("snap-")] == [good.name]


def test_bad_remote_repositories(container, azurite, tmp_path):
    env = {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string}
    with pytest.raises(StorageError, match="no files under"):
        RemoteRepository(f"az://{container.container_name}/empty", tmp_path, env).sync()
    with pytest.raises(StorageError) as e:
        RemoteRepository(f"az://{container.container_name}/x", tmp_path, {}).sync()
    assert "AZURE_STORAGE_CONNECTION_STRING" in e.value.fix


def test_serve_from_blob_and_poll_for_new_models(container, azurite, tmp_path, monkeypatch):
    upload_model(container, "repo")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    monkeypatch.setenv("AZULITE_MODEL_CACHE", str(tmp_path / "cache"))
    s = Served("--model-repository", f"az://{container.container_name}/repo",
               "--model-control-mode", "poll", "--repository-poll-secs", "1")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{s.ports['HTTPService']}")
    try:
        assert client.is_server_ready() and client.is_model_ready("add_sub_py"), "".join(s.lines)
        upload_model(container, "repo", "add_sub_py2")
        deadline = time.monotonic() + 120  # safety net; the condition is the model becoming ready
        while not client.is_model_ready("add_sub_py2"):
            assert time.monotonic() < deadline and s.proc.poll() is None, "".join(s.lines)
            time.sleep(0.2)
    finally:
        client.close()
        s.stop()
