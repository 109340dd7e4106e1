"""Job data as Azure ML handles it: remote inputs made local before start, remote outputs uploaded after.

Inputs (``{type: uri_file | uri_folder | mltable, path, mode}``) whose path is remote are fetched through
fsspec — adlfs for Blob (``az://container/p``, ``abfs[s]://container@account.dfs.core.windows.net/p``,
``wasb[s]://container@account.blob.core.windows.net/p``, ``https://account.blob.core.windows.net/...``),
fsspec's HTTP file system for any other ``http(s)://`` — into a per-machine cache under
``$AZULITE_HOME/cache/inputs``, keyed by the content's identity (every file's name, size and ETag /
Last-Modified as the server reports them): a requeued attempt, or another job reading the same data, does
not download it again, and changed data is fetched anew. ``mode: download`` and ``ro_mount`` both get the
cached local copy (no FUSE mount here; the job sees a read-only-by-convention folder either way);
``mode: direct`` hands the URI to the command unchanged. Registered assets (``azureml:NAME:VERSION``,
``azureml:NAME@latest``) and ``azureml://`` datastore paths need a workspace: resolved through
``MLClient`` when ``AZUREML_SUBSCRIPTION_ID``, ``AZUREML_RESOURCE_GROUP`` and ``AZUREML_WORKSPACE_NAME``
are set, otherwise a clear error naming the input and the override.

Blob credentials, first that applies: ``AZURE_STORAGE_CONNECTION_STRING`` (when it names the URI's
account, or the URI names none), ``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_SAS_TOKEN`` for
``AZURE_STORAGE_ACCOUNT_NAME``, else anonymous access (public containers), else azure-identity's
``DefaultAzureCredential`` chain. Errors name the input, the URI and the credentials tried.

Outputs with a remote ``path`` and ``mode: upload``, ``rw_mount`` or ``mount`` are written locally
(``<job dir>/outputs/<name>``) and uploaded after every attempt — success, failure or preemption — so
nothing the job wrote is lost. A remote output without a mode (or ``direct``) is handed to the command as
the URI, which writes there itself (checkpoints do).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from azulite.errors import InputError
from azulite.spec.job import JobSpec, Output, PathInput

UPLOAD_MODES = ("upload", "rw_mount", "mount")  # Azure ML writes a mounted output back too
_BLOB_HOST = re.compile(r"^(?P<account>[a-z0-9]{3,24})\.(?:blob|dfs)\.core\.windows\.net$")
_ASSET = re.compile(r"^azureml:(?P<name>[A-Za-z0-9_.-]+)(?:(?::(?P<version>[A-Za-z0-9_.-]+))|@(?P<label>[A-Za-z0-9_.-]+))?$")


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://") or path.startswith("azureml:")


@dataclass
class _Location:
    """One remote URI as fsspec sees it: a file system, the path within it, and what we tried."""

    uri: str
    fs: Any
    path: str
    credential: str


def _connection_account(conn: str) -> str | None:
    m = re.search(r"AccountName=([^;]+)", conn)
    return m.group(1) if m else None


def _blob_location(uri: str, container: str, account: str | None, rest: str, environ: Mapping[str, str]) -> list[_Location]:
    """Candidate file systems for a Blob path, in the order credentials are tried."""
    import fsspec

    path = f"{container}/{rest}".rstrip("/")
    conn = environ.get("AZURE_STORAGE_CONNECTION_STRING")
    env_account = environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    out = []
    if conn and (account is None or _connection_account(conn) == account):
        out.append(_Location(uri, fsspec.filesystem("az", connection_string=conn, skip_instance_cache=True), path,
                             "AZURE_STORAGE_CONNECTION_STRING"))
        return out  # an emulator or a named account: nothing else would reach the same endpoint
    account = account or env_account
    if account is None:
        raise InputError(f"{uri} names no storage account and none is configured", where=uri,
                         fix="set AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME, or write "
                         "abfss://<container>@<account>.dfs.core.windows.net/<path>")
    if account == env_account and (environ.get("AZURE_STORAGE_ACCOUNT_KEY") or environ.get("AZURE_STORAGE_SAS_TOKEN")):
        out.append(_Location(uri, fsspec.filesystem(
            "az", account_name=account, account_key=environ.get("AZURE_STORAGE_ACCOUNT_KEY"),
            sas_token=environ.get("AZURE_STORAGE_SAS_TOKEN"), skip_instance_cache=True), path,
            "AZURE_STORAGE_ACCOUNT_KEY/SAS_TOKEN"))
    out.append(_Location(uri, fsspec.filesystem("az", account_name=account, anon=True, skip_instance_cache=True), path,
                         "anonymous access"))
    out.append(_Location(uri, fsspec.filesystem("az", account_name=account, anon=False, skip_instance_cache=True), path,
                         "DefaultAzureCredential (azure-identity)"))
    return out


def _http_client(environ: Mapping[str, str]) -> Any:
    """aiohttp sessions that trust the system CAs plus ``SSL_CERT_FILE`` of the job's environment (aiohttp
    builds its default TLS context once, at import, from the process's own environment)."""

    async def get_client(**kwargs: Any) -> Any:
        import ssl

        import aiohttp

        ctx = ssl.create_default_context()
        if environ.get("SSL_CERT_FILE"):
            ctx.load_verify_locations(environ["SSL_CERT_FILE"])
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx), **kwargs)

    return get_client


def locations(uri: str, environ: Mapping[str, str]) -> list[_Location]:
    """The file systems to try for a remote ``uri``, first that works wins."""
    import fsspec

    p = urlparse(uri)
    scheme = p.scheme.lower()
    if scheme in ("az", "abfs", "abfss", "wasb", "wasbs"):
        container, _, host = p.netloc.partition("@")
        account = None
        if host:
            m = _BLOB_HOST.match(host.lower())
            if not m:
                raise InputError(f"{host!r} is not an Azure Storage host", where=uri,
                                 fix="write <container>@<account>.blob.core.windows.net (or .dfs.)")
            account = m.group("account")
        if not container:
            raise InputError(f"{uri} names no container", where=uri, fix="write az://<container>/<path>")
        return _blob_location(uri, container, account, p.path.strip("/"), environ)
    if scheme in ("http", "https"):
        m = _BLOB_HOST.match(p.hostname or "")
        if m:
            container, _, rest = p.path.strip("/").partition("/")
            return _blob_location(uri, container, m.group("account"), rest, environ)
        return [_Location(uri, fsspec.filesystem("http", skip_instance_cache=True, get_client=_http_client(environ)),
                          uri, "none (plain HTTP(S))")]
    raise InputError(f"unsupported URI scheme {scheme!r} in {uri}", where=uri,
                     fix="use az://, abfss://, wasbs://, https:// or azureml:// (or a local path)")


def _listing(loc: _Location, kind: str) -> list[dict[str, Any]]:
    """name (relative), size and version tag of every file under the location."""
    fs, path = loc.fs, loc.path
    if kind == "uri_file":
        info = fs.info(path)
        if info.get("type") == "directory":
            raise InputError("is a folder, not a file", where=loc.uri, fix="use type: uri_folder for a folder")
        return [_entry(info, os.path.basename(path.rstrip("/")) or "data")]
    found = fs.find(path, detail=True)
    if not found:
        raise FileNotFoundError(path)
    base = path.rstrip("/")
    out = []
    for name, info in sorted(found.items()):
        if info.get("type") == "directory":
            continue
        rel = name[len(base):].lstrip("/") if name.startswith(base) else os.path.basename(name)
        out.append(_entry(info, rel or os.path.basename(name)))
    return out


def _entry(info: Mapping[str, Any], rel: str) -> dict[str, Any]:
    tag = next((str(info[k]) for k in ("etag", "ETag", "content_md5", "Content-MD5", "last_modified", "Last-Modified",
                                       "mtime") if info.get(k) is not None), "")
    return {"name": rel, "source": info["name"], "size": int(info.get("size") or 0), "tag": tag}


def _open(loc_list: list[_Location], name: str, kind: str) -> tuple[_Location, list[dict[str, Any]]]:
    tried = []
    for loc in loc_list:
        try:
            return loc, _listing(loc, kind)
        except InputError as e:
            raise InputError(f"input {name!r}: {e.message}", where=e.where, fix=e.fix) from None
        except FileNotFoundError as e:
            # fsspec's HTTP file system says "not found" for a server that does not answer too: its cause
            # (aiohttp's ClientConnectorError: connection refused, no such host) is the real reason
            cause = e.__cause__
            tried.append(f"{loc.credential}: " + ("not found" if cause is None else
                                                  f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:160]}"))
        except Exception as e:  # noqa: BLE001 - auth, network, SDK errors: try the next credential
            tried.append(f"{loc.credential}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}")
    uri = loc_list[0].uri
    raise InputError(f"input {name!r}: {uri} does not exist or cannot be read (tried {'; '.join(tried)})",
                     where=f"inputs.{name}.path",
                     fix=f"check the URI and its credentials, or point it at local data: --set inputs.{name}.path=./data")


def _workspace(environ: Mapping[str, str]) -> Any | None:
    keys = ("AZUREML_SUBSCRIPTION_ID", "AZUREML_RESOURCE_GROUP", "AZUREML_WORKSPACE_NAME")
    if not all(environ.get(k) for k in keys):
        return None
    from azure.ai.ml import MLClient
    from azure.identity import DefaultAzureCredential

    return MLClient(DefaultAzureCredential(), *(environ[k] for k in keys))


def resolve_azureml(name: str, uri: str, environ: Mapping[str, str]) -> str:
    """A registered data asset or an ``azureml://`` datastore path, as a storage URI (needs a workspace)."""
    ws = _workspace(environ)
    if ws is None:
        raise InputError(
            f"input {name!r} is {uri}, which only an Azure ML workspace can resolve, and none is configured",
            where=f"inputs.{name}.path",
            fix=f"point it at local data with --set inputs.{name}.path=./data, or set AZUREML_SUBSCRIPTION_ID, "
            "AZUREML_RESOURCE_GROUP and AZUREML_WORKSPACE_NAME (and Azure credentials) to resolve it",
        )
    try:
        m = _ASSET.match(uri)
        if m:
            asset = ws.data.get(m.group("name"), version=m.group("version"), label=m.group("label") or
                                (None if m.group("version") else "latest"))
            uri = asset.path
        ds = re.search(r"datastores/(?P<ds>[^/]+)/paths/(?P<rest>.*)$", uri)
        if uri.startswith("azureml://") and ds:
            store = ws.datastores.get(ds.group("ds"))
            return f"abfss://{store.container_name}@{store.account_name}.dfs.core.windows.net/{ds.group('rest')}"
        return uri
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - any workspace/SDK failure
        raise InputError(f"input {name!r}: cannot resolve {uri} in the workspace: {type(e).__name__}: {e}",
                         where=f"inputs.{name}.path", fix=f"check the asset name and version, or --set inputs.{name}.path=./data") from None


@dataclass(frozen=True)
class Fetched:
    name: str
    uri: str
    local: str
    identity: str
    downloaded: bool  # False: served from the cache


def _resolvable(name: str, uri: str) -> None:
    """An http(s) input's host must resolve: with no network (or a typo in the host) every credential of
    the chain was tried against it, with retries, for minutes (2m45s measured), before the error came."""
    p = urlparse(uri)
    if p.scheme.lower() not in ("http", "https") or not p.hostname:
        return
    try:
        socket.getaddrinfo(p.hostname, p.port or (443 if p.scheme.lower() == "https" else 80),
                           type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise InputError(f"input {name!r}: the host {p.hostname!r} of {uri} cannot be resolved ({e})",
                         where=f"inputs.{name}.path",
                         fix=f"check the URL and this machine's network, or point it at local data: "
                             f"--set inputs.{name}.path=./data") from None


def identify(name: str, inp: PathInput, environ: Mapping[str, str]) -> tuple[_Location, list[dict[str, Any]], str]:
    """Where a remote input is, what is there, and its content identity (no download)."""
    uri = inp.path
    if uri.startswith("azureml:"):
        uri = resolve_azureml(name, uri, environ)
    kind = "uri_file" if inp.type == "uri_file" else "uri_folder"
    _resolvable(name, uri)
    loc, files = _open(locations(uri, environ), name, kind)
    identity = hashlib.sha256(json.dumps([uri, kind, [(f["name"], f["size"], f["tag"]) for f in files]]).encode()).hexdigest()
    return loc, files, identity


def fetch(name: str, inp: PathInput, cache_dir: Path, environ: Mapping[str, str]) -> Fetched:
    """The local path of a remote input: from the cache when its content identity is there, else
    downloaded into it (into a temporary folder renamed into place: never half a copy)."""
    loc, files, identity = identify(name, inp, environ)
    entry = cache_dir / identity[:32]
    data = entry / "data"
    local = data / files[0]["name"] if inp.type == "uri_file" else data
    if (entry / "complete").exists():
        return Fetched(name, loc.uri, str(local), identity, downloaded=False)
    tmp = cache_dir / f".tmp-{identity[:16]}-{uuid.uuid4().hex[:8]}"
    try:
        for f in files:
            dest = tmp / "data" / f["name"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            loc.fs.get_file(f["source"], str(dest))
            if dest.stat().st_size != f["size"] and f["size"]:
                raise InputError(f"input {name!r}: {f['source']} changed while downloading "
                                 f"({dest.stat().st_size} of {f['size']} bytes)", where=loc.uri, fix="retry the job")
        (tmp / "complete").write_text(json.dumps({"uri": loc.uri, "files": len(files)}))
        cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, entry)
        except OSError:  # another job fetched the same content meanwhile: theirs is as good
            if not (entry / "complete").exists():
                raise
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001
        raise InputError(f"input {name!r}: downloading {loc.uri} failed: {type(e).__name__}: {e}",
                         where=f"inputs.{name}.path", fix="check the storage is reachable, then resubmit") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Fetched(name, loc.uri, str(local), identity, downloaded=True)


def check_inputs(spec: JobSpec, environ: Mapping[str, str]) -> None:
    """At submit: every remote input (not ``direct``) exists and is readable, without downloading."""
    for name, inp in spec.inputs.items():
        if isinstance(inp, PathInput) and is_remote(inp.path) and inp.mode != "direct":
            identify(name, inp, environ)


def fetch_inputs(spec: JobSpec, cache_dir: Path, environ: Mapping[str, str]) -> dict[str, Fetched]:
    return {name: fetch(name, inp, cache_dir, environ) for name, inp in spec.inputs.items()
            if isinstance(inp, PathInput) and is_remote(inp.path) and inp.mode != "direct"}


def uploaded(out: Output) -> bool:
    """Whether an output is written locally and uploaded after each attempt."""
    return bool(out.path) and is_remote(str(out.path)) and out.mode in UPLOAD_MODES


def output_location(name: str, out: Output, job_dir: Path) -> str:
    """Where the command writes output ``name``: a local folder (a file in it, for ``uri_file``) for
    uploaded outputs, else the output's own path."""
    if not uploaded(out):
        return out.location(job_dir, name)
    local = job_dir / "outputs" / name
    return str(local / os.path.basename(str(out.path).rstrip("/"))) if out.type == "uri_file" else str(local)


def upload_outputs(spec: JobSpec, job_dir: Path, environ: Mapping[str, str]) -> list[str]:
    """Upload every uploaded output's local folder to its remote path; returns what was uploaded."""
    done = []
    for name, out in spec.outputs.items():
        if not uploaded(out):
            continue
        local = job_dir / "outputs" / name
        if not local.exists():
            continue
        loc = locations(str(out.path), environ)[0]
        try:
            for f in sorted(p for p in local.rglob("*") if p.is_file()):
                rel = f.relative_to(local).as_posix()
                target = f"{loc.path.rstrip('/')}/{rel}" if out.type != "uri_file" else loc.path
                loc.fs.put_file(str(f), target)
                done.append(f"{out.path.rstrip('/')}/{rel}")
        except Exception as e:  # noqa: BLE001
            raise InputError(f"output {name!r}: uploading to {out.path} failed ({loc.credential}): "
                             f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}",
                             where=f"outputs.{name}.path",
                             fix=f"the files are kept in {local}; fix the storage and copy them, or rerun") from None
    return done
