"""A model repository on Azure Blob (``az://container/prefix``, seed 001 §5.2 passes a remote repository)
mirrored into a local cache that the server reads as any repository.

Each sync lists the blobs under the prefix and, when anything changed (ETag), builds a complete new
snapshot folder — unchanged files hard-linked from the previous one, changed ones downloaded and checked
against the blob's Content-MD5 (or its size when the service kept no MD5) — then swaps the ``current``
symlink to it in one rename. The server only ever sees a whole snapshot; a failed or corrupt download
leaves the previous one serving. ``--model-control-mode poll`` reloads what changed.

Written against azure-storage-blob directly: the server never imports training code (the checkpoint
storage layer lives in ``azulite.train``), and listing + download + MD5 is all it needs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from azulite.errors import SpecError, StorageError

log = logging.getLogger("azulite.serve.remote")
MANIFEST = ".azulite-snapshot.json"


def parse_az_uri(uri: str) -> tuple[str, str]:
    """``az://container/prefix`` -> (container, prefix without slashes)."""
    if not uri.startswith("az://"):
        raise SpecError(f"{uri!r} is not an az:// URI", field="--model-repository", fix="use az://container/path")
    container, _, prefix = uri[len("az://"):].partition("/")
    if not container:
        raise SpecError(f"{uri!r} names no container", field="--model-repository", fix="use az://container/path")
    return container, prefix.strip("/")


def container_client(container: str, environ: Mapping[str, str]) -> Any:
    from azure.storage.blob import ContainerClient

    if environ.get("AZURE_STORAGE_CONNECTION_STRING"):
        return ContainerClient.from_connection_string(environ["AZURE_STORAGE_CONNECTION_STRING"], container)
    account = environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise StorageError("no Azure Blob credentials for an az:// model repository", where="--model-repository",
                           fix="set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME (+ _KEY, or a "
                               "managed/workload identity)")
    url = f"https://{account}.blob.core.windows.net"
    if environ.get("AZURE_STORAGE_ACCOUNT_KEY"):
        credential: Any = environ["AZURE_STORAGE_ACCOUNT_KEY"]
    else:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    return ContainerClient(url, container, credential=credential)


class RemoteRepository:
    """``path`` is what the server serves: ``<cache>/<hash of uri>/current`` (a symlink to a snapshot)."""

    def __init__(self, uri: str, cache_dir: str | Path, environ: Mapping[str, str] | None = None) -> None:
        self.uri = uri
        self.container, self.prefix = parse_az_uri(uri)
        self.root = Path(cache_dir) / hashlib.sha256(uri.encode()).hexdigest()[:16]
        self.environ = dict(os.environ if environ is None else environ)
        self._client: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.root / "current"

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = container_client(self.container, self.environ)
        return self._client

    def _manifest(self) -> dict[str, dict]:
        try:
            return json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            return {}

    def _listing(self) -> dict[str, Any]:
        base = f"{self.prefix}/" if self.prefix else ""
        try:
            return {b.name[len(base):]: b for b in self.client.list_blobs(name_starts_with=base)
                    if not b.name.endswith("/") and b.name[len(base):]}
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - any SDK/network failure is the same user problem
            raise StorageError(f"cannot list {self.uri}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                               where=self.uri, fix="check the container, the path and the credentials") from None

    def sync(self) -> bool:
        """Bring the cache up to date; True when a new snapshot was installed."""
        with self._lock:
            return self._sync()

    def _sync(self) -> bool:
        blobs = self._listing()
        if not blobs:
            raise StorageError(f"no files under {self.uri}", where=self.uri,
                               fix="upload the repository (<model>/config.pbtxt, <model>/<version>/...) there")
        old = self._manifest()
        new = {rel: {"etag": b.etag, "size": b.size} for rel, b in blobs.items()}
        if new == old and self.path.is_dir():
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        snap = self.root / f"snap-{time.time_ns()}"
        try:
            for rel, b in blobs.items():
                dest = snap / rel
                if not dest.resolve().is_relative_to(snap.resolve()):
                    raise StorageError(f"blob {b.name!r} escapes the repository", where=self.uri, fix="rename the blob")
                dest.parent.mkdir(parents=True, exist_ok=True)
                if old.get(rel) == new[rel] and (self.path / rel).is_file():
                    os.link(self.path / rel, dest)  # unchanged: same bytes, no download
                    continue
                self._download(b, dest)
            (snap / MANIFEST).write_text(json.dumps(new))
            tmp_link = self.root / f".current-{snap.name}"
            tmp_link.symlink_to(snap.name)
            previous = self.path.resolve() if self.path.is_symlink() else None
            os.replace(tmp_link, self.path)  # the one atomic step: the server sees old or new, never half
        except BaseException:
            shutil.rmtree(snap, ignore_errors=True)
            raise
        if previous is not None and previous != snap.resolve():
            # a reader that resolved the old link keeps its open files; new opens go to the new snapshot
            shutil.rmtree(previous, ignore_errors=True)
        log.info("model repository %s: snapshot %s (%d files)", self.uri, snap.name, len(blobs))
        return True

    def _download(self, blob: Any, dest: Path) -> None:
        md5 = hashlib.md5()
        size = 0
        try:
            with open(dest, "wb") as f:
                for chunk in self.client.download_blob(blob.name).chunks():
                    md5.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"cannot download {blob.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                               where=self.uri, fix="check the network and credentials; the previous snapshot keeps serving") from None
        expected = blob.content_settings.content_md5 if blob.content_settings else None
        if expected:
            if bytes(expected) != md5.digest():
                raise StorageError(
                    f"integrity check failed for {blob.name}: MD5 {base64.b64encode(md5.digest()).decode()} != "
                    f"Content-MD5 {base64.b64encode(bytes(expected)).decode()}",
                    where=self.uri, fix="re-upload the file; the previous snapshot keeps serving")
        elif size != blob.size:
            raise StorageError(f"integrity check failed for {blob.name}: {size} bytes != {blob.size}", where=self.uri,
                               fix="re-upload the file; the previous snapshot keeps serving")

    def start_polling(self, interval_s: float) -> None:
        """Re-sync every ``interval_s`` seconds in a daemon thread; failures are logged, the cache stays."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.sync()
                except Exception as e:  # noqa: BLE001 - keep serving what we have
                    log.warning("model repository %s: sync failed: %s", self.uri, e)

        self._thread = threading.Thread(target=loop, name="azulite-remote-repo", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
