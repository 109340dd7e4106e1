"""A local Azure ML workspace for the ``azureml`` backend's tests: HTTPS on 127.0.0.1 (azure-core refuses
bearer tokens over plain HTTP) with a throw-away certificate, reached through azure-ai-ml's own
``AZUREML_DEV_URL_MFE`` override. It answers the calls azure-ai-ml 1.35.2 makes (recorded from the SDK):

- management (ARM): list/get/PUT a code version and its ``startPendingUpload``, PUT an (anonymous) environment
  version, PUT/GET a job, POST cancel, GET the workspace (for its discovery URL);
- the workspace's discovery document and its run-history service: GET a run's details, whose ``logFiles``
  are read-SAS URLs of log blobs on Azurite (the workspace's Blob store here);
- with ``default_output``, jobs get the artifact store's ``default`` output and the datastore answers GET and
  ``listSecrets`` (an account key), so the SDK lists logs from the datastore's Blob container (its URLs name
  ``https://ACCOUNT.blob.core.windows.net``: the tests route them to an Azurite serving TLS, blob_tunnel.py);
- an App Service managed-identity token endpoint (``IDENTITY_ENDPOINT`` / ``IDENTITY_HEADER``), so that the
  CLI's own DefaultAzureCredential gets a token without Entra ID.

With an Azurite given, code is uploaded for real: the pending upload hands out a container SAS on Azurite,
the SDK uploads the snapshot there and registers the code version. A job "runs" by a script
(:meth:`FakeAzureML.script`): each run-details request applies its next step (a status and log lines
appended to the log blobs), so a follower sees the run progress and end without any timing.

Request bodies are validated and refused with ARM's error shape (400) when they fail: jobs and code
versions against the REST API's published Swagger definitions (data/azureml-rest/, source named there;
a small walker below handles Swagger 2.0 polymorphism, which is not JSON Schema), the operations that
excerpt does not hold (environment versions, pending uploads, datastores, the workspace, run details) against the
models of azure-ai-ml's generated REST clients (aml_models.py). Responses are validated too and failures
recorded in ``errors``.

Not exercised (no workspace here): the service's image build for an inline environment and its resolution
of environments and compute, jobs actually running, identity-based datastores, and authentication beyond a
bearer token.
"""

from __future__ import annotations

import copy
import datetime
import ipaddress
import json
import re
import ssl
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.launch import aml_models

SPEC = json.loads((Path(__file__).parent / "data" / "azureml-rest" / "mfe-2025-01-01-preview.definitions.json").read_text())
DEFS: dict[str, dict] = SPEC["definitions"]
WS = r"/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft.MachineLearningServices/workspaces/(?P<ws>[^/]+)"
#: the workspace Blob store's host as azure-ai-ml builds it from a datastore (reached through blob_tunnel.py)
BLOB_HOST = "devstoreaccount1.blob.core.windows.net"
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
        item = schema["additionalProperties"]
        for k, v in value.items():
            if item.get("type") == "string" and isinstance(v, (int, float)):
                # the service's JSON binding reads a number as a string here; azure-ai-ml relies on it
                # (a code version's properties.hash_version is sent as the integer 202208)
                continue
            out += _value_errors(item, v, f"{path}.{k}", request)
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
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName(BLOB_HOST)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class FakeAzureML:
    TOKEN = "aml-t0ken"
    IDENTITY_HEADER = "identity-s3cret"

    def __init__(self, directory: Path, azurite: Any = None, *, default_output: bool = False,
                 cert: tuple[Path, Path] | None = None) -> None:
        self.cert, key = cert or self_signed_cert(directory)
        self.azurite = azurite
        # an Azurite started with --cert serves TLS only (then with this stand-in's certificate)
        self.blob_scheme = "https" if azurite is not None and "--cert" in getattr(azurite, "args", ()) else "http"
        #: give jobs the ``default`` output a workspace gives them (the artifact store's datastore): the SDK's
        #: log streaming then lists log files from that datastore instead of the run details
        self.default_output = default_output
        self.jobs: dict[str, dict] = {}
        self.codes: dict[tuple[str, str], dict] = {}
        self.environments: dict[tuple[str, str], dict] = {}
        self.uploads: list[str] = []  # containers handed out for pending uploads
        self.requests: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.scripts: dict[str, list[tuple[str, dict[str, str]]]] = {}
        self.logs: dict[str, dict[str, str]] = {}  # run -> log name -> text so far
        self.lock = threading.Lock()
        # the container of run logs ("azureml" in a workspace's artifact store; one per stand-in here, as
        # tests share one Azurite)
        self.log_container = f"azureml-{uuid.uuid4().hex[:8]}"
        self.arm = aml_models.arm()
        self.run_history = aml_models.run_history()
        if azurite is not None:
            self._blob().create_container(self.log_container)
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

    def environ(self) -> dict[str, str]:
        """What a user's shell would hold to reach this workspace: the endpoint override, the CA, and an
        App Service managed identity served here (DefaultAzureCredential picks it up)."""
        return {"AZUREML_DEV_URL_MFE": self.url, "REQUESTS_CA_BUNDLE": str(self.cert),
                "IDENTITY_ENDPOINT": f"{self.url}/msi/token", "IDENTITY_HEADER": self.IDENTITY_HEADER}

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

    def script(self, name: str, steps: list[tuple[str, dict[str, str]]]) -> None:
        """Run ``name``: each later run-details request applies the next (status, {log name: text}) step."""
        with self.lock:
            self.scripts[name] = list(steps)

    # ---- Azurite as the workspace's Blob store ---------------------------------------------------------
    def _blob(self) -> Any:
        from azure.storage.blob import BlobServiceClient

        from tests.train.azurite import ACCOUNT, KEY

        return BlobServiceClient(self._blob_url("").rstrip("/"), credential={"account_name": ACCOUNT, "account_key": KEY})

    def _blob_url(self, container: str, blob: str = "") -> str:
        from tests.train.azurite import ACCOUNT

        return f"{self.blob_scheme}://127.0.0.1:{self.azurite.port}/{ACCOUNT}/{container}" + (f"/{blob}" if blob else "")

    def pending_upload(self) -> tuple[str, str]:
        """A fresh container and a container-level read/write/list SAS on it, as the service hands out."""
        from azure.storage.blob import ContainerSasPermissions, generate_container_sas
        from tests.train.azurite import ACCOUNT, KEY

        container = f"code-{uuid.uuid4().hex[:12]}"
        self._blob().create_container(container)
        self.uploads.append(container)
        sas = generate_container_sas(ACCOUNT, container, account_key=KEY, expiry=datetime.datetime.now(datetime.timezone.utc)
                                     + datetime.timedelta(hours=1),
                                     permission=ContainerSasPermissions(read=True, add=True, create=True, write=True, list=True))
        return self._blob_url(container), f"{self._blob_url(container)}?{sas}"

    def _advance(self, name: str) -> None:
        """Apply the next step of the run's script: its status, its lines appended to the log blobs."""
        with self.lock:
            steps = self.scripts.get(name)
            if not steps:
                return
            status, lines = steps.pop(0)
            texts = self.logs.setdefault(name, {})
            for log, text in lines.items():
                texts[log] = texts.get(log, "") + text
                self._blob().get_blob_client(self.log_container, f"ExperimentRun/dcid.{name}/{log}").upload_blob(
                    texts[log].encode(), overwrite=True)
            self.jobs[name]["properties"]["status"] = status

    def run_details(self, name: str) -> dict:
        from azure.storage.blob import BlobSasPermissions, generate_blob_sas
        from tests.train.azurite import ACCOUNT, KEY

        self._advance(name)
        job = self.jobs[name]
        expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=30)
        files = {}
        for log in sorted(self.logs.get(name, {})):
            blob = f"ExperimentRun/dcid.{name}/{log}"
            sas = generate_blob_sas(ACCOUNT, self.log_container, blob, account_key=KEY, permission=BlobSasPermissions(read=True), expiry=expiry)
            files[log] = f"{self._blob_url(self.log_container, blob)}?{sas}"
        return {"runId": name, "runUuid": str(uuid.uuid5(uuid.NAMESPACE_URL, name)), "status": job["properties"]["status"],
                "target": job["properties"].get("computeId", "").rsplit("/", 1)[-1],
                "properties": {"azureml.runsource": "azureml.scriptrun"}, "logFiles": files,
                "warnings": [], "runTypeV2": {"orchestrator": "Execution", "traits": ["azureml.commonruntime"]}}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeAzureML
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, obj: Any, definition: str | None = None, checker: Any = None) -> None:
        if definition:
            errs = (checker.errors(definition, obj, request=False) if checker is not None
                    else errors(definition, obj, request=False))
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

    def _body(self, raw: bytes, definition: str, checker: Any = None) -> dict | None:
        """The request body, or None after answering 400 when it is not JSON or fails its definition."""
        try:
            body = json.loads(raw)
        except ValueError:
            self._error(400, "BadRequest", "the body is not JSON")
            return None
        errs = checker.errors(definition, body) if checker is not None else errors(definition, body)
        if errs:
            self._error(400, "UserError", "; ".join(errs))
            return None
        return body

    def _route(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        path, _, query = self.path.partition("?")
        params = dict(p.partition("=")[::2] for p in query.split("&") if p)
        self.fake.requests.append((method, path))
        fake = self.fake
        if path == "/msi/token" and method == "GET":  # App Service managed identity (no bearer token yet)
            if self.headers.get("X-IDENTITY-HEADER") != fake.IDENTITY_HEADER:
                return self._error(401, "Unauthorized", "missing or wrong X-IDENTITY-HEADER")
            from urllib.parse import unquote

            return self._send(200, {"access_token": fake.TOKEN, "expires_on": str(int(time.time()) + 3600),
                                    "resource": unquote(params.get("resource", "")), "token_type": "Bearer"})
        if path == "/discovery" and method == "GET":  # the workspace's discovery document: service base URLs
            return self._send(200, {k: fake.url for k in ("api", "catalog", "experimentation", "history", "modelmanagement",
                                                           "pipelines")} | {"studio": "https://ml.azure.com"})
        if self.headers.get("Authorization") != f"Bearer {FakeAzureML.TOKEN}":
            return self._error(401, "AuthenticationFailed", "missing or wrong bearer token")
        m = re.fullmatch(r"/history/v1\.0" + WS + r"/runs/(?P<run>[^/]+)/details", path)
        if m and method == "GET":
            if m["run"] not in fake.jobs:
                return self._error(404, "UserError", f"run {m['run']} not found")
            return self._send(200, fake.run_details(m["run"]), "RunDetails", fake.run_history)
        if "api-version=" not in query:
            return self._error(400, "MissingApiVersionParameter", "The api-version query parameter is required")
        if re.fullmatch(WS, path) and method == "GET":
            ws = {"id": path, "name": path.rsplit("/", 1)[-1], "type": "Microsoft.MachineLearningServices/workspaces",
                  "location": "westeurope", "kind": "Default",
                  "properties": {"discoveryUrl": f"{fake.url}/discovery", "workspaceId": str(uuid.uuid5(uuid.NAMESPACE_URL, path)),
                                 "provisioningState": "Succeeded"}}
            return self._send(200, ws, "Workspace", fake.arm)
        m = re.fullmatch(WS + r"/environments/(?P<name>[^/]+)/versions/(?P<version>[^/]+)", path)
        if m and method == "PUT":
            body = self._body(raw, "EnvironmentVersion", fake.arm)
            if body is None:
                return None
            env = copy.deepcopy(body)
            env.update(id=path, name=m["version"], type="Microsoft.MachineLearningServices/workspaces/environments/versions")
            env["properties"]["provisioningState"] = "Succeeded"
            fake.environments[(m["name"], m["version"])] = env
            return self._send(200, env, "EnvironmentVersion", fake.arm)
        m = re.fullmatch(WS + r"/codes/(?P<name>[^/]+)/versions/(?P<version>[^/]+)/startPendingUpload", path)
        if m and method == "POST" and fake.azurite is not None:
            if self._body(raw, "PendingUploadRequestDto", fake.arm) is None:
                return None
            blob_uri, sas_uri = fake.pending_upload()
            return self._send(200, {"blobReferenceForConsumption": {"blobUri": blob_uri, "credential": {
                "credentialType": "SAS", "sasUri": sas_uri}}, "pendingUploadId": str(uuid.uuid4()),
                "pendingUploadType": "TemporaryBlobReference"}, "PendingUploadResponseDto", fake.arm)
        m = re.fullmatch(WS + r"/codes/(?P<name>[^/]+)/versions(?:/(?P<version>[^/]+))?", path)
        if m and method == "PUT" and m["version"] and fake.azurite is not None:
            body = self._body(raw, "CodeVersionResource")
            if body is None:
                return None
            code = copy.deepcopy(body)
            code.update(id=path, name=m["version"], type="Microsoft.MachineLearningServices/workspaces/codes/versions")
            code["properties"]["provisioningState"] = "Succeeded"
            fake.codes[(m["name"], m["version"])] = code
            return self._send(201, code, "CodeVersionResource")
        if m and method == "GET" and fake.azurite is not None:  # the registered versions, listed by content hash
            if m["version"]:
                code = fake.codes.get((m["name"], m["version"]))
                if code is None:
                    return self._error(404, "UserError", f"code {m['name']}:{m['version']} not found")
                return self._send(200, code, "CodeVersionResource")
            # by hash across names: the SDK names each anonymous snapshot with a fresh GUID and relies on
            # this lookup to find the same content registered under another
            found = [c for c in fake.codes.values() if (c["properties"].get("properties") or {}).get("hash_sha256") == params.get("hash")]
            return self._send(200, {"value": found}, "CodeVersionResourceArmPaginatedResult")
        if m and method == "GET":  # no Blob store: the snapshot is reported as registered already
            code = {"id": f"{path if m['version'] else path + '/1'}", "name": m["version"] or "1",
                    "type": "Microsoft.MachineLearningServices/workspaces/codes/versions",
                    "properties": {"codeUri": "https://acct.blob.core.windows.net/azureml-blobstore/LocalUpload/snapshot",
                                   "isAnonymous": True, "provisioningState": "Succeeded"}}
            if m["version"]:
                return self._send(200, code, "CodeVersionResource")
            return self._send(200, {"value": [code]}, "CodeVersionResourceArmPaginatedResult")
        m = re.fullmatch(WS + r"/datastores/(?P<name>[^/]+)(?P<secrets>/listSecrets)?", path)
        if m and m["name"] == "workspaceartifactstore" and fake.azurite is not None:
            from tests.train.azurite import ACCOUNT, KEY

            if method == "GET" and not m["secrets"]:
                return self._send(200, {"id": path, "name": m["name"], "type": "Microsoft.MachineLearningServices/workspaces/datastores",
                                        "properties": {"datastoreType": "AzureBlob", "accountName": ACCOUNT,
                                                       "containerName": fake.log_container, "endpoint": "core.windows.net",
                                                       "protocol": "https", "isDefault": False,
                                                       "credentials": {"credentialsType": "AccountKey"}}}, "Datastore", fake.arm)
            if method == "POST" and m["secrets"]:
                # azure-ai-ml also sends expireAfterHours, "a legacy field still accepted by the service; not
                # modeled in the current TSP" (its own comment): accepted here too
                body = json.loads(raw or b"{}")
                body.pop("expireAfterHours", None)
                errs = fake.arm.errors("SecretExpiry", body)
                if errs:
                    return self._error(400, "UserError", "; ".join(errs))
                return self._send(200, {"secretsType": "AccountKey", "key": KEY}, "DatastoreSecrets", fake.arm)
        m = re.fullmatch(WS + r"/jobs/(?P<name>[^/]+)(?P<cancel>/cancel)?", path)
        if m and method == "PUT" and not m["cancel"]:
            body = self._body(raw, "JobBaseResource")
            if body is None:
                return None
            job = copy.deepcopy(body)
            job.update(id=path, name=m["name"], type="Microsoft.MachineLearningServices/workspaces/jobs")
            job["properties"]["status"] = "NotStarted"
            if fake.default_output:
                job["properties"].setdefault("outputs", {})["default"] = {
                    "jobOutputType": "uri_folder", "mode": "ReadWriteMount",
                    "uri": f"azureml://datastores/workspaceartifactstore/ExperimentRun/dcid.{m['name']}"}
            with fake.lock:
                fake.jobs[m["name"]] = job
            return self._send(201, job, "JobBaseResource")
        if m and method == "GET" and not m["cancel"]:
            job = fake.jobs.get(m["name"])
            if job is None:
                return self._error(404, "UserError", f"job {m['name']} not found")
            return self._send(200, job, "JobBaseResource")
        if m and method == "POST" and m["cancel"]:
            if m["name"] not in fake.jobs:
                return self._error(404, "UserError", f"job {m['name']} not found")
            fake.set_status(m["name"], "CancelRequested")
            return self._send(200, None)
        self._error(404, "NoRoute", f"{method} {path} is not an operation this server answers")

    do_GET = lambda self: self._route("GET")  # noqa: E731
    do_PUT = lambda self: self._route("PUT")  # noqa: E731
    do_POST = lambda self: self._route("POST")  # noqa: E731
