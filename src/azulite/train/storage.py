"""Where checkpoints live: a local directory or Azure Blob (``az://container/path``), through fsspec.

URIs are validated and the storage is probed when the Checkpointer is created, so a typo or a dead
storage account fails at start with a message naming the URI, not an hour later inside a save.

Connection settings are read once, from an ``environ`` mapping, into :class:`StorageSettings`:
``AZURE_STORAGE_CONNECTION_STRING`` (Azurite's or a real account's), or ``AZURE_STORAGE_ACCOUNT_NAME``
with ``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_SAS_TOKEN`` (or, with only the name, adlfs's
default Azure credential chain).
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec

from azulite.errors import StorageConfigError, StorageError

_CONTAINER = re.compile(r"^[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}$")
_EXAMPLE = "a local path such as /data/ckpt or an Azure Blob URI such as az://checkpoints/my-job"


@dataclass(frozen=True, kw_only=True)
class StorageSettings:
    """Azure Blob connection settings (ignored for local paths)."""

    connection_string: str | None = None
    account_name: str | None = None
    account_key: str | None = None
    sas_token: str | None = None
    #: seconds to wait for a connection before a request fails (probe and uploads)
    connection_timeout: int = 10
    #: seconds to wait for a response
    read_timeout: int = 120
    #: retries of a failed Blob request (exponential backoff from ``retry_backoff_s``); the SDK's default
    #: (15 s, x3) makes a dead endpoint take minutes to report
    retries: int = 3
    retry_backoff_s: float = 1.0
    #: local directory where shards are written before upload and downloaded before load
    staging_dir: str | None = None
    #: ranged GETs in flight per blob on download (restore), each of ``download_chunk_mb``
    download_concurrency: int = 8
    download_chunk_mb: int = 8

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> StorageSettings:
        return cls(
            connection_string=environ.get("AZURE_STORAGE_CONNECTION_STRING") or None,
            account_name=environ.get("AZURE_STORAGE_ACCOUNT_NAME") or None,
            account_key=environ.get("AZURE_STORAGE_ACCOUNT_KEY") or None,
            sas_token=environ.get("AZURE_STORAGE_SAS_TOKEN") or None,
            staging_dir=environ.get("AZULITE_STAGING_DIR") or None,
            retries=_int(environ, "AZULITE_STORAGE_RETRIES", 3),
        )


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise StorageConfigError(f"{name}={raw!r} is not an integer", where="environment", fix=f"e.g. {name}={default}") from None


def parse_uri(uri: str) -> tuple[str, str]:
    """Split and validate a checkpoint URI into (scheme, path): ("file", "/abs/dir") or ("az", "container/dir")."""
    if isinstance(uri, os.PathLike):  # a pathlib.Path is a local folder
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        raise StorageConfigError(f"the checkpoint URI must be text or a path, got {type(uri).__name__} {uri!r}",
                                 where="checkpoint uri", fix=f"give {_EXAMPLE}")
    if not uri.strip():
        raise StorageConfigError("the checkpoint URI is empty", where="checkpoint uri", fix=f"give {_EXAMPLE}")
    uri = uri.strip()
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and uri[1:2] == ":"):  # also C:\ paths
        path = parsed.path if scheme == "file" else uri
        return "file", str(Path(path).expanduser().absolute())
    if scheme in ("az", "abfs"):
        container = parsed.netloc
        if "@" in container:  # abfs://container@account.dfs.core.windows.net/path
            container = container.split("@", 1)[0]
        if not container:
            raise StorageConfigError(
                f"{uri!r} names no container",
                where="checkpoint uri",
                fix="write az://<container>/<path>, e.g. az://checkpoints/my-job",
            )
        if not _CONTAINER.match(container):
            raise StorageConfigError(
                f"{container!r} is not a valid Azure Blob container name",
                where=f"checkpoint uri {uri!r}",
                fix="container names are 3-63 lowercase letters, digits and single hyphens, e.g. az://checkpoints/run-1",
            )
        rest = parsed.path.strip("/")
        return "az", f"{container}/{rest}" if rest else container
    raise StorageConfigError(
        f"unsupported checkpoint storage scheme {scheme!r}:// in {uri!r}",
        where="checkpoint uri",
        fix=f"use {_EXAMPLE}",
    )


class CheckpointStorage:
    """The few operations checkpoints need, the same for a directory and a Blob container.

    Paths given to the methods are relative to the root URI (``"step-00000010/manifest.json"``).
    """

    def __init__(self, uri: str, settings: StorageSettings | None = None) -> None:
        self.scheme, self.root = parse_uri(uri)
        self.settings = settings or StorageSettings()
        self.uri = f"az://{self.root}" if self.remote else self.root
        self._fs: Any = None

    @property
    def remote(self) -> bool:
        return self.scheme == "az"

    @property
    def fs(self) -> Any:
        if self._fs is None:
            if self.remote:
                s = self.settings
                if not (s.connection_string or s.account_name):
                    raise StorageConfigError(
                        f"no Azure Storage credentials for {self.uri}",
                        where="environment",
                        fix="set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and "
                        "AZURE_STORAGE_ACCOUNT_KEY)",
                    )
                check_credentials(s)
                kwargs: dict[str, Any] = {
                    "connection_timeout": s.connection_timeout,
                    "read_timeout": s.read_timeout,
                    "skip_instance_cache": True,
                }
                if s.connection_string:
                    kwargs["connection_string"] = s.connection_string
                else:
                    kwargs.update(account_name=s.account_name, account_key=s.account_key, sas_token=s.sas_token)
                try:
                    fs = fsspec.filesystem("az", **kwargs)
                    fs.service_client = self._service_client(fs)
                except ValueError as e:  # the SDK refused the settings themselves (no request was made)
                    variable = "AZURE_STORAGE_CONNECTION_STRING" if s.connection_string else "AZURE_STORAGE_ACCOUNT_NAME"
                    raise StorageConfigError(f"{variable} is malformed: {first_line(e)}", where="environment",
                                             fix=_CREDENTIALS_FIX) from None
                self._fs = fs
            else:
                self._fs = fsspec.filesystem("file")
        return self._fs

    def _service_client(self, fs: Any) -> Any:
        """adlfs builds its client with the SDK's default retries and no way to pass others; hand it one
        with bounded retries and timeouts (same credentials)."""
        from azure.storage.blob.aio import BlobServiceClient, ExponentialRetry

        s = self.settings
        options: dict[str, Any] = {
            "retry_policy": ExponentialRetry(initial_backoff=s.retry_backoff_s, increment_base=2,
                                             retry_total=s.retries, random_jitter_range=1),
            "connection_timeout": s.connection_timeout,
            "read_timeout": s.read_timeout,
            # a download is one GET of max_single_get_size, then the rest in parallel ranges: a small first
            # GET puts all of a shard's ranges in flight at once
            "max_single_get_size": s.download_chunk_mb << 20,
            "max_chunk_get_size": s.download_chunk_mb << 20,
        }
        if s.connection_string:
            return BlobServiceClient.from_connection_string(s.connection_string, **options)
        credential = s.account_key or s.sas_token or fs.service_client.credential
        return BlobServiceClient(f"https://{s.account_name}.blob.core.windows.net", credential=credential, **options)

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def display(self, rel: str = "") -> str:
        return f"{self.uri}/{rel}" if rel else self.uri

    # -- probing -----------------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail now, with a clear error, if the storage cannot be written."""
        if not self.remote:
            _check_folder(self.root, self.uri)
            try:
                os.makedirs(self.root, exist_ok=True)
                probe = Path(self.root) / f".probe-{uuid.uuid4().hex}"
                probe.write_bytes(b"ok")
                probe.unlink()
            except OSError as e:
                # a folder that cannot be created or written as named (no such parent, /proc, read-only,
                # permissions) stays so on a restart: a setting to fix; a full or failing disk may not
                error = StorageError if e.errno in _LOCAL_TRANSIENT else StorageConfigError
                raise error(
                    f"cannot create or write the checkpoint directory {self.root}: {e.strerror or e}",
                    where=self.uri,
                    fix="choose a directory this process can create and write, or fix its permissions"
                    if error is StorageConfigError else "free space on the disk or check it, then start again",
                ) from None
            return
        container = self.root.split("/", 1)[0]
        try:
            # adlfs warns "Failed to fetch container properties ... Assume it exists already" for any failure
            # of its container check, and goes on; the failure itself is reported below
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Failed to fetch container properties", category=UserWarning)
                if not self.fs.exists(container):
                    self.fs.mkdir(container)
                probe = self.path(f".probe-{uuid.uuid4().hex}")
                self.fs.pipe_file(probe, b"ok")
                self.fs.rm_file(probe)
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - any SDK/network failure is the same user problem
            if refused(e):
                raise self.refused_error(e) from None
            raise StorageError(
                f"cannot reach Azure Blob storage for {self.uri}: {type(e).__name__}: {first_line(e)}",
                where=self.uri,
                fix="check AZURE_STORAGE_CONNECTION_STRING / the account, and that the endpoint is up "
                "(for tests: Azurite started with --skipApiVersionCheck)",
            ) from None

    def refused_error(self, e: BaseException) -> StorageConfigError:
        """The error for a request the account refused (:func:`refused`): credentials wrong as given, which no
        restart fixes."""
        return StorageConfigError(
            f"Azure Blob storage refused the credentials for {self.uri}: {type(e).__name__}: {first_line(e)}",
            where=self.uri,
            fix="check the account key, SAS token or identity (AZURE_STORAGE_CONNECTION_STRING, or "
                "AZURE_STORAGE_ACCOUNT_KEY / AZURE_STORAGE_SAS_TOKEN) and that it may write to the container")

    # -- listing and reading -------------------------------------------------------------------------------
    def list_dir(self, rel: str = "", *, folders_only: bool = False) -> list[str]:
        """Names (not paths) of the entries directly under ``rel`` (only its folders: ``folders_only``);
        [] if it does not exist."""
        try:
            entries = self.fs.ls(self.path(rel), detail=True)
        except FileNotFoundError:
            return []
        return sorted({e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries
                       if not folders_only or e.get("type") == "directory"})

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def sizes(self, rel: str) -> dict[str, int]:
        """Name -> size in bytes of the files directly under ``rel`` (one listing; {} if it does not exist)."""
        if not self.remote:
            try:
                with os.scandir(self.path(rel)) as it:
                    return {e.name: e.stat().st_size for e in it if e.is_file()}
            except FileNotFoundError:
                return {}
        try:
            entries = self.fs.ls(self.path(rel), detail=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in entries if e.get("type") == "file"}

    def du(self, rel: str) -> int:
        try:
            return int(self.fs.du(self.path(rel), total=True))
        except FileNotFoundError:
            return 0

    # -- writing -------------------------------------------------------------------------------------------
    def upload(self, local: str | os.PathLike, rel: str) -> None:
        self.fs.put_file(str(local), self.path(rel), overwrite=True)

    def download(self, rel: str, local: str | os.PathLike) -> None:
        os.makedirs(os.path.dirname(str(local)), exist_ok=True)
        if self.remote:  # ranged GETs in parallel (the SDK's max_concurrency), written in order
            self.fs.get_file(self.path(rel), str(local), max_concurrency=self.settings.download_concurrency)
        else:
            self.fs.get_file(self.path(rel), str(local))

    def write_exclusive(self, rel: str, data: bytes) -> None:
        """Write ``data`` at ``rel`` in one piece, only if nothing is there yet.

        Blob: one Put Blob with ``If-None-Match: *`` (adlfs ``overwrite=False``) — atomic, never half
        visible. Local: write a temporary file, fsync it, then ``os.link`` it into place (fails if the
        target exists), and fsync the directory.
        """
        if self.remote:
            try:
                self.fs.pipe_file(self.path(rel), data, overwrite=False)
            except FileExistsError:
                raise StorageError(
                    f"{self.display(rel)} already exists", where=self.display(rel),
                    fix="a checkpoint with this step was already committed; never reuse a step number",
                ) from None
            return
        target = Path(self.path(rel))
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise StorageError(
                f"{target} already exists", where=str(target),
                fix="a checkpoint with this step was already committed; never reuse a step number",
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` at ``rel``, replacing what is there, never half visible (a small file: Put Blob; a
        local temporary file renamed over it)."""
        if self.remote:
            self.fs.pipe_file(self.path(rel), data)
            return
        target = Path(self.path(rel))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def remove_tree(self, rel: str) -> None:
        if self.remote:
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass
        else:
            shutil.rmtree(self.path(rel), ignore_errors=True)

    def remove_file(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass


_CREDENTIALS_FIX = ("copy it again from the storage account (Azure portal: Access keys; or `az storage account "
                    "show-connection-string` / `az storage account keys list`); for Azurite, its documented "
                    "development connection string")
#: errnos of a local folder that may be writable on a restart (a full or failing disk, a stale NFS handle)
_LOCAL_TRANSIENT = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN})


def check_credentials(settings: StorageSettings) -> None:
    """Azure credentials malformed as given, named by their variable before any request: the SDK found them
    only when it signed the first one ("AzureSigningError: Incorrect padding"), which read as storage that
    is down (exit 1, restarted and retried into the same error). A key is decoded as the SDK decodes it;
    no secret is echoed."""
    if settings.connection_string:
        parts = settings.connection_string.strip().rstrip(";").split(";")
        found: dict[str, str] = {}
        for i, part in enumerate(parts, 1):
            name, eq, value = part.partition("=")
            if not eq or not name.strip():
                raise StorageConfigError(
                    f"AZURE_STORAGE_CONNECTION_STRING is malformed: its setting {i} of {len(parts)} is not NAME=VALUE "
                    "(e.g. AccountName=...;AccountKey=...;BlobEndpoint=...)", where="environment", fix=_CREDENTIALS_FIX)
            found[name.strip().lower()] = value
        if "accountkey" in found:
            _check_key(found["accountkey"], "AZURE_STORAGE_CONNECTION_STRING is malformed: its AccountKey")
    elif settings.account_key:
        _check_key(settings.account_key, "AZURE_STORAGE_ACCOUNT_KEY")


def _check_key(key: str, what: str) -> None:
    try:
        base64.b64decode(key)  # as the SDK decodes it to sign a request
    except (binascii.Error, ValueError) as e:
        raise StorageConfigError(f"{what} is not a base64 account key ({first_line(e)})", where="environment",
                                 fix=_CREDENTIALS_FIX) from None


def refused(e: BaseException) -> bool:
    """Whether a Blob request failed because the account refused it (401/403), or the SDK could not sign it
    with the key given (checked before, so hardly ever here), rather than storage that is down."""
    if getattr(e, "status_code", None) in (401, 403):
        return True
    try:
        from azure.core.exceptions import ClientAuthenticationError
    except ImportError:  # pragma: no cover - installed with adlfs
        return False
    return isinstance(e, ClientAuthenticationError)


def remove_if_empty(folder: str | os.PathLike) -> None:
    """Remove a local staging ``folder`` if it is empty: another rank on this host may still be using it
    (that rank removes it when done)."""
    try:
        os.rmdir(folder)
    except OSError:  # not empty (another rank's), or gone already
        pass


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _check_folder(root: str, uri: str) -> None:
    """A local location that is, or lies under, a file: named, with the folder it must be (os.makedirs says
    only "File exists" or "Not a directory")."""
    path = Path(root)
    for p in (path, *path.parents):
        if p.exists():
            if p.is_dir():
                return
            what = (f"checkpoint location {str(path)!r} is a file: it must be a folder" if p == path else
                    f"checkpoint location {str(path)!r} cannot be created: {str(p)!r} is a file, not a folder")
            raise StorageConfigError(what, where=uri,
                               fix=f"point the checkpoint location (outputs.checkpoints, or CheckpointConfig(uri=...)) "
                                   f"at a folder, or move the file {str(p)!r} away")
