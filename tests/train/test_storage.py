"""(g) Bad checkpoint URIs and unreachable storage fail at start, with errors naming what and how to fix."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from azulite.contract import EXIT_CONFIG
from azulite.errors import CheckpointError, SpecError, StorageConfigError, StorageError
from azulite.launch.local.procs import free_port
from azulite.train import CheckpointConfig, Checkpointer, Progress, StorageSettings, exit_code, init, parse_uri
from azulite.train.storage import CheckpointStorage
from tests.train.azurite import connection_string


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("", "the checkpoint URI is empty"),
        ("s3://bucket/run", "unsupported checkpoint storage scheme 's3'"),
        ("gs://bucket/run", "unsupported checkpoint storage scheme 'gs'"),
        ("az:///run", "names no container"),
        ("az://Bad_Container/run", "'Bad_Container' is not a valid Azure Blob container name"),
        ("az://ab/run", "'ab' is not a valid Azure Blob container name"),
    ],
)
def test_bad_uris_are_refused_with_a_fix(uri, message):
    with pytest.raises(StorageError) as info:
        parse_uri(uri)
    assert message in info.value.message
    assert info.value.fix
    assert exit_code(info.value) == EXIT_CONFIG  # a script exits 78: its job is not restarted into it again


def test_good_uris_parse():
    assert parse_uri("az://checkpoints/job-1/") == ("az", "checkpoints/job-1")
    assert parse_uri("abfs://checkpoints@acct.dfs.core.windows.net/x") == ("az", "checkpoints/x")
    assert parse_uri("file:///tmp/x")[1] == "/tmp/x"
    assert parse_uri("relative/dir")[1] == str(Path("relative/dir").absolute())


def _checkpointer(uri: str, settings: StorageSettings) -> Checkpointer:
    ctx = init({})  # one process, no process group
    return Checkpointer(CheckpointConfig(uri=uri), ctx, {"progress": Progress()}, settings=settings)


def test_unwritable_local_directory_fails_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError) as info:
        _checkpointer(str(blocker / "ckpt"), StorageSettings())
    assert info.value.message == (f"checkpoint location {str(blocker / 'ckpt')!r} cannot be created: "
                                  f"{str(blocker)!r} is a file, not a folder")  # was "Not a directory"
    assert info.value.where == str(blocker / "ckpt") and str(blocker) in info.value.fix
    assert exit_code(info.value) == EXIT_CONFIG


def test_a_checkpoint_location_that_is_a_file_is_named_as_one(tmp_path):
    blocker = tmp_path / "ckpt"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError) as info:
        CheckpointStorage(str(blocker), StorageSettings()).check()
    # was "cannot write to the checkpoint directory: File exists"
    assert info.value.message == f"checkpoint location {str(blocker)!r} is a file: it must be a folder"
    assert "at a folder" in info.value.fix and blocker.read_text() == "not a directory"


def test_az_without_credentials_fails_at_start():
    with pytest.raises(StorageError) as info:
        _checkpointer("az://checkpoints/run", StorageSettings())
    assert "no Azure Storage credentials for az://checkpoints/run" in info.value.message
    assert "AZURE_STORAGE_CONNECTION_STRING" in info.value.fix
    assert exit_code(info.value) == EXIT_CONFIG


def test_exit_code_is_78_only_for_what_no_restart_can_fix():
    """Storage that is down, a checkpoint that cannot be read, anything not azulite's: the error's own code
    (1), which a launcher restarts and retries; a spec or setting wrong as given: 78 (EX_CONFIG)."""
    assert exit_code(StorageError("Blob is down")) == 1
    assert exit_code(CheckpointError("no checkpoint verifies")) == 1
    assert exit_code(RuntimeError("a bug")) == 1
    assert exit_code(SpecError("bad flag")) == EXIT_CONFIG == 78


def test_unreachable_blob_endpoint_fails_at_start_quickly():
    dead = StorageSettings(connection_string=connection_string(free_port()), connection_timeout=2, read_timeout=5,
                           retries=1)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        _checkpointer("az://checkpoints/run", dead)
    assert time.monotonic() - t0 < 60
    assert "cannot reach Azure Blob storage for az://checkpoints/run" in info.value.message
    assert "Azurite" in info.value.fix
    assert exit_code(info.value) == 1  # down now, maybe up on a restart: restarted and retried as before


@pytest.mark.parametrize("environ, says", [
    # "cannot reach Azure Blob storage ...: AzureSigningError: Incorrect padding", exit 1 (retried)
    ({"AZURE_STORAGE_CONNECTION_STRING": "AccountName=devstoreaccount1;AccountKey=abc;BlobEndpoint={endpoint}"},
     "AZURE_STORAGE_CONNECTION_STRING is malformed: its AccountKey is not a base64 account key (Incorrect padding)"),
    # ValueError "Connection string is either blank or malformed", exit 1
    ({"AZURE_STORAGE_CONNECTION_STRING": "hello"},
     "AZURE_STORAGE_CONNECTION_STRING is malformed: its setting 1 of 1 is not NAME=VALUE"),
    ({"AZURE_STORAGE_CONNECTION_STRING": "AccountName=devstoreaccount1;BlobEndpoint={endpoint};secret"},
     "AZURE_STORAGE_CONNECTION_STRING is malformed: its setting 3 of 3 is not NAME=VALUE"),
    # AzureSigningError "Invalid base64", exit 1
    ({"AZURE_STORAGE_ACCOUNT_NAME": "devstoreaccount1", "AZURE_STORAGE_ACCOUNT_KEY": "not base64!!"},
     "AZURE_STORAGE_ACCOUNT_KEY is not a base64 account key (Invalid base64-encoded string"),
])
def test_malformed_credentials_are_a_setting_to_fix_named_by_their_variable(environ, says):
    """Malformed as given, they failed only when the SDK signed the first request, and read as storage that
    is down: exit 1, restarted and retried into the same error. Nothing listens at the endpoint: the
    credentials are refused before any request."""
    endpoint = f"http://127.0.0.1:{free_port()}/devstoreaccount1"
    environ = {k: v.format(endpoint=endpoint) for k, v in environ.items()}
    settings = StorageSettings.from_environ({**environ, "AZULITE_STORAGE_RETRIES": "0"})
    with pytest.raises(StorageConfigError) as info:
        CheckpointStorage("az://ckpt/run", settings).check()
    assert info.value.message.startswith(says) and info.value.where == "environment"
    assert "copy it again from the storage account" in info.value.fix
    assert exit_code(info.value) == EXIT_CONFIG
    for secret in ("abc", "secret", "not base64"):  # no credential is echoed
        assert secret not in info.value.message


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_checkpoint_folder_that_cannot_be_created_is_a_setting_to_fix(tmp_path, monkeypatch):
    # "No such file or directory", exit 1: restarted into the same error
    with pytest.raises(StorageConfigError) as info:
        CheckpointStorage("/proc/azulite-ckpt").check()
    assert info.value.message == ("cannot create or write the checkpoint directory /proc/azulite-ckpt: No such file "
                                  "or directory") and info.value.where == "/proc/azulite-ckpt"
    assert exit_code(info.value) == EXIT_CONFIG and "choose a directory" in info.value.fix
    # a full disk may have room on a restart: retried as before
    import errno
    import os

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(StorageError) as info:
        CheckpointStorage(str(tmp_path / "ck")).check()
    assert "No space left on device" in info.value.message and exit_code(info.value) == 1


def test_settings_read_from_an_environ_mapping():
    s = StorageSettings.from_environ({"AZURE_STORAGE_CONNECTION_STRING": "cs", "AZULITE_STAGING_DIR": "/x"})
    assert s.connection_string == "cs" and s.staging_dir == "/x" and s.account_name is None


def test_local_manifest_write_is_exclusive(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    storage.write_exclusive("m.json", b"first")
    with pytest.raises(StorageError, match="already exists"):
        storage.write_exclusive("m.json", b"second")
    assert (tmp_path / "m.json").read_bytes() == b"first"
    assert not list(tmp_path.glob(".*.tmp"))
