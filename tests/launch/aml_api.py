"""A local Azure ML management endpoint for the ``azureml`` backend's tests: HTTPS on 127.0.0.1 (azure-core
refuses bearer tokens over plain HTTP) with a throw-away certificate, reached through azure-ai-ml's own
``AZUREML_DEV_URL_MFE`` override. It answers the calls ``MLClient.jobs`` makes (recorded with azure-ai-ml
1.35.2): list/get a code version by content hash, PUT a job, GET it, POST cancel.

Request bodies are validated against the REST API's published Swagger definitions (data/azureml-rest/,
source named there) and refused with ARM's error shape (400) when they fail; responses are validated too
and failures recorded in ``errors``. Swagger 2.0 polymorphism (``discriminator`` + ``allOf``) is not JSON
Schema, so a small walker below validates it (the one thing no installed library does for Swagger 2.0).

Not exercised (no workspace here): inline environments (an image or conda file: the SDK first PUTs an
anonymous environment version, an operation this server does not answer), code upload to the workspace's
blob datastore (the fake reports the snapshot as already registered, which the SDK checks first), the
workspace's resolution of environments and compute, the run-history service the studio and
``jobs.stream`` read, and authentication beyond a bearer token.
"""

from __future__ import annotations

import copy
import datetime
import ipaddress
import json
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SPEC = json.loads((Path(__file__).parent / "data" / "azureml-rest" / "mfe-2025-01-01-preview.definitions.json").read_text())
DEFS: dict[str, dict] = SPEC["definitions"]
WS = r"/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft.MachineLearningServices/workspaces/(?P<ws>[^/]+)"
_TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list, "number": (int, float)}


def _ref(schema: dict) -> dict:
    return DEFS[schema["$ref"].rsplit("/", 1)[-1]] if "$ref" in schema else schema


def _ancestors(name: str) -> list[str]:
    out = []
    for part in DEFS[name].get("allOf", []):
        parent = part["$ref"].rsplit("/", 1)[-1]
        out += [parent, *_ancestors(parent)]
    return out


def _flatten(name: str) -> tuple[dict, set[str], bool]:
    """(properties, required, closed) of a definition with its allOf parents merged."""
    d = DEFS[name]
    props, req = dict(d.get("properties", {})), set(d.get("required", []))
    for parent in (p["$ref"].rsplit("/", 1)[-1] for p in d.get("allOf", [])):
        pp, pr, _ = _flatten(parent)
        props = {**pp, **props}
        req |= pr
    return props, req, d.get("additionalProperties") is False


def _subtype(name: str, value: Any) -> str | None:
    for sub, d in DEFS.items():
        if d.get("x-ms-discriminator-value") == value and name in _ancestors(sub):
            return sub
    return None


def errors(name: str, obj: Any, path: str = "", *, request: bool = True) -> list[str]:
    """Every way ``obj`` fails definition ``name`` (a request also may not set readOnly fields)."""
    d = DEFS[name]
    where = path or "<body>"
    if "enum" in d:
        return [] if obj in d["enum"] else [f"{where}: {obj!r} is not one of {d['enum']}"]
    if not isinstance(obj, dict):
        return [f"{where}: expected an object, got {type(obj).__name__}"]
    disc = d.get("discriminator")  # polymorphic: validate as the subtype the discriminator names
    if disc is not None:
        value = obj.get(disc)
        sub = _subtype(name, value)
        if sub is None:
            return [f"{where}.{disc}: {value!r} names no subtype of {name}"]
        name = sub
    props, required, closed = _flatten(name)
    out = [f"{where}: required property '{r}' is missing" for r in sorted(required) if r not in obj]
    for key, value in obj.items():
        sub_path = f"{path}.{key}" if path else key
        if key not in props:
            if closed:
                out.append(f"{sub_path}: not a property of {name}")
            continue
        out += _value_errors(props[key], value, sub_path, request)
    return out


def _value_errors(schema: dict, value: Any, path: str, request: bool) -> list[str]:
    if value is None:
        return [] if schema.get("x-nullable") else [f"{path}: may not be null"]
    if request and schema.get("readOnly"):
        return [f"{path}: is read-only"]
    if "$ref" in schema:
        return errors(schema["$ref"].rsplit("/", 1)[-1], value, path, request=request)
    t = schema.get("type")
    if t and (not isinstance(value, _TYPES[t]) or (t in ("integer", "number") and isinstance(value, bool))):
        return [f"{path}: expected {t}, got {type(value).__name__} {value!r}"]
    out = []
    if t == "string":
        if len(value) < schema.get("minLength", 0):
            out.append(f"{path}: shorter than {schema['minLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{path}: does not match {schema['pattern']}")
        if "enum" in schema and value not in schema["enum"]:
            out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if t == "object" and isinstance(schema.get("additionalProperties"), dict):
        for k, v in value.items():
            out += _value_errors(schema["additionalProperties"], v, f"{path}.{k}", request)
    if t == "array" and "items" in schema:
        for i, v in enumerate(value):
            out += _value_errors(schema["items"], v, f"{path}[{i}]", request)
    return out


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and its key), valid for a day; the client trusts it via REQUESTS_CA_BUNDLE."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class FakeAzureML:
    TOKEN = "aml-t0ken"

    def __init__(self, directory: Path) -> None:
        self.cert, key = self_signed_cert(directory)
        self.jobs: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        handler = type("H", (_Handler,), {"fake": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(self.cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "FakeAzureML":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    def set_status(self, name: str, status: str) -> None:
        with self.lock:
            self.jobs[name]["properties"]["status"] = status


class _Handler(BaseHTTPRequestHandler):
    fake: FakeAzureML
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, obj: Any, definition: str | None = None) -> None:
        if definition:
            errs = errors(definition, obj, request=False)
            if errs:
                self.fake.errors.append(f"response {self.path}: {errs}")
        data = b"" if obj is None else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, err: str, message: str) -> None:
        # ARM's ErrorResponse shape (common-types ErrorResponse)
        self._send(code, {"error": {"code": err, "message": message}})

    def _route(self, method: str) -> None:
        if self.headers.get("Authorization") != f"Bearer {FakeAzureML.TOKEN}":
            return self._error(401, "AuthenticationFailed", "missing or wrong bearer token")
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        path, _, query = self.path.partition("?")
        self.fake.requests.append((method, path))
        if "api-version=" not in query:
            return self._error(400, "MissingApiVersionParameter", "The api-version query parameter is required")
        m = re.fullmatch(WS + r"/codes/(?P<name>[^/]+)/versions(?:/(?P<version>[^/]+))?", path)
        if m and method == "GET":
            code = {"id": f"{path if m['version'] else path + '/1'}", "name": m["version"] or "1",
                    "type": "Microsoft.MachineLearningServices/workspaces/codes/versions",
                    "properties": {"codeUri": "https://acct.blob.core.windows.net/azureml-blobstore/LocalUpload/snapshot",
                                   "isAnonymous": True, "provisioningState": "Succeeded"}}
            if m["version"]:
                return self._send(200, code, "CodeVersionResource")
            return self._send(200, {"value": [code]}, "CodeVersionResourceArmPaginatedResult")
        m = re.fullmatch(WS + r"/jobs/(?P<name>[^/]+)(?P<cancel>/cancel)?", path)
        if m and method == "PUT" and not m["cancel"]:
            try:
                body = json.loads(raw)
            except ValueError:
                return self._error(400, "BadRequest", "the body is not JSON")
            errs = errors("JobBaseResource", body)
            if errs:
                return self._error(400, "UserError", "; ".join(errs))
            job = copy.deepcopy(body)
            job.update(id=path, name=m["name"], type="Microsoft.MachineLearningServices/workspaces/jobs")
            job["properties"]["status"] = "NotStarted"
            with self.fake.lock:
                self.fake.jobs[m["name"]] = job
            return self._send(201, job, "JobBaseResource")
        if m and method == "GET" and not m["cancel"]:
            job = self.fake.jobs.get(m["name"])
            if job is None:
                return self._error(404, "UserError", f"job {m['name']} not found")
            return self._send(200, job, "JobBaseResource")
        if m and method == "POST" and m["cancel"]:
            if m["name"] not in self.fake.jobs:
                return self._error(404, "UserError", f"job {m['name']} not found")
            self.fake.set_status(m["name"], "CancelRequested")
            return self._send(200, None)
        self._error(404, "NoRoute", f"{method} {path} is not an operation this server answers")

    do_GET = lambda self: self._route("GET")  # noqa: E731
    do_PUT = lambda self: self._route("PUT")  # noqa: E731
    do_POST = lambda self: self._route("POST")  # noqa: E731
