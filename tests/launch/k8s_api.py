"""A local Kubernetes API server for the ``kubernetes`` backend's tests: it answers the calls the official
client makes for the kinds azulite uses (create, read, list + watch, delete Jobs, Services, ConfigMaps,
PyTorchJobs, TFJobs, MPIJobs; list pods, read pod logs, create evictions) and nothing else.

It does not only confirm itself: every request body is validated against the published schemas
(Kubernetes' OpenAPI as kubernetes-validate ships it, strict; the training operator's PyTorchJob and TFJob
CRDs and its admission webhooks' rules; the mpi-operator's MPIJob CRD and its controller's checks), and its name against the API server's name rules, and refused with a 422
``Status`` as the API server would; every response body is validated too, and a response that fails is
recorded in ``errors`` (tests assert it stays empty). The "controller" is the test: ``set_status`` changes
an object's status (and wakes its watchers), ``add_pod`` adds a pod with a log (and an exit code).

Not exercised here (no API server runs on this machine): admission (quotas, RBAC, webhooks such as
workload identity's), the Job and training-operator controllers themselves, scheduling, field selectors
other than ``metadata.name``, resourceVersion semantics beyond a counter, and server-side defaulting.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from tests.deploy import schemas

NS = r"(?P<ns>[a-z0-9-]+)"
NAME = r"(?P<name>[a-z0-9.-]+)"
# (method, path regex, collection key, handler name): the API paths of the kinds used, as the OpenAPI spec names them
ROUTES = [
    ("POST", rf"/api/v1/namespaces/{NS}/services", "services", "create"),
    ("DELETE", rf"/api/v1/namespaces/{NS}/services/{NAME}", "services", "delete"),
    ("POST", rf"/api/v1/namespaces/{NS}/configmaps", "configmaps", "create"),
    ("DELETE", rf"/api/v1/namespaces/{NS}/configmaps/{NAME}", "configmaps", "delete"),
    ("POST", rf"/apis/batch/v1/namespaces/{NS}/jobs", "jobs", "create"),
    ("GET", rf"/apis/batch/v1/namespaces/{NS}/jobs", "jobs", "list"),
    ("GET", rf"/apis/batch/v1/namespaces/{NS}/jobs/{NAME}(?:/status)?", "jobs", "read"),
    ("DELETE", rf"/apis/batch/v1/namespaces/{NS}/jobs/{NAME}", "jobs", "delete"),
    ("POST", rf"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs", "pytorchjobs", "create"),
    ("GET", rf"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs", "pytorchjobs", "list"),
    ("GET", rf"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs/{NAME}", "pytorchjobs", "read"),
    ("DELETE", rf"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs/{NAME}", "pytorchjobs", "delete"),
    ("POST", rf"/apis/kubeflow.org/v1/namespaces/{NS}/tfjobs", "tfjobs", "create"),
    ("GET", rf"/apis/kubeflow.org/v1/namespaces/{NS}/tfjobs", "tfjobs", "list"),
    ("GET", rf"/apis/kubeflow.org/v1/namespaces/{NS}/tfjobs/{NAME}", "tfjobs", "read"),
    ("DELETE", rf"/apis/kubeflow.org/v1/namespaces/{NS}/tfjobs/{NAME}", "tfjobs", "delete"),
    ("POST", rf"/apis/kubeflow.org/v2beta1/namespaces/{NS}/mpijobs", "mpijobs", "create"),
    ("GET", rf"/apis/kubeflow.org/v2beta1/namespaces/{NS}/mpijobs", "mpijobs", "list"),
    ("GET", rf"/apis/kubeflow.org/v2beta1/namespaces/{NS}/mpijobs/{NAME}", "mpijobs", "read"),
    ("DELETE", rf"/apis/kubeflow.org/v2beta1/namespaces/{NS}/mpijobs/{NAME}", "mpijobs", "delete"),
    ("GET", rf"/api/v1/namespaces/{NS}/pods", "pods", "list"),
    ("GET", rf"/api/v1/namespaces/{NS}/pods/{NAME}/log", "pods", "log"),
    ("POST", rf"/api/v1/namespaces/{NS}/pods/{NAME}/eviction", "pods", "evict"),
]
KINDS = {"services": ("v1", "Service"), "configmaps": ("v1", "ConfigMap"), "jobs": ("batch/v1", "Job"),
         "pytorchjobs": ("kubeflow.org/v1", "PyTorchJob"), "tfjobs": ("kubeflow.org/v1", "TFJob"),
         "mpijobs": ("kubeflow.org/v2beta1", "MPIJob"),
         "pods": ("v1", "Pod")}
LISTS = {"jobs": "joblist-batch-v1.json", "pods": "podlist-v1.json"}


DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def name_errors(obj: dict, collection: str) -> list[str]:
    """The API server's name rules: a Service's is a DNS-1035 label (a letter first, at most 63), a Job's a
    DNS-1123 label (its pods carry it as a label value), others DNS-1123 subdomains."""
    name = (obj.get("metadata") or {}).get("name") or ""
    rule, limit = {"services": (DNS1035_LABEL, 63), "jobs": (DNS1123_SUBDOMAIN, 63)}.get(collection,
                                                                                      (DNS1123_SUBDOMAIN, 253))
    if len(name) > limit or not rule.fullmatch(name):
        return [f"metadata.name: Invalid value: {name!r}: not a valid {collection[:-1]} name"]
    return []


def body_errors(obj: Any, collection: str) -> list[str]:
    if not isinstance(obj, dict):
        return ["<root>: not a JSON object"]
    api_version, kind = KINDS[collection]
    if (obj.get("apiVersion"), obj.get("kind")) != (api_version, kind):
        return [f"<root>: expected {api_version} {kind}, got {obj.get('apiVersion')} {obj.get('kind')}"]
    return name_errors(obj, collection) + schemas.errors(obj, "1.37")


class FakeKubernetes:
    def __init__(self) -> None:
        self.objects: dict[str, dict[tuple[str, str], dict]] = {k: {} for k in KINDS}
        self.logs: dict[tuple[str, str], str] = {}
        self.evicted: list[str] = []
        self.requests: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.rv = 0
        self.cond = threading.Condition()
        self.events: list[tuple[int, str, str, tuple[str, str], dict]] = []  # (rv, type, collection, key, object)
        handler = type("H", (_Handler,), {"fake": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "FakeKubernetes":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)

    closed = False
    watchers = 0

    def kubeconfig(self, path, context: str = "test") -> str:
        import yaml

        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": context,
            "clusters": [{"name": "local", "cluster": {"server": self.url}}],
            "users": [{"name": "me", "user": {"token": "t0ken"}}],
            "contexts": [{"name": context, "context": {"cluster": "local", "user": "me", "namespace": "default"}}],
        }))
        return str(path)

    # ---- the test's controller -----------------------------------------------------------------------
    def _record(self, type_: str, collection: str, key: tuple[str, str], obj: dict) -> None:
        with self.cond:
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.events.append((self.rv, type_, collection, key, copy.deepcopy(obj)))
            self.cond.notify_all()

    def set_status(self, collection: str, name: str, status: dict, ns: str = "default") -> None:
        obj = self.objects[collection][(ns, name)]
        obj["status"] = status
        self._record("MODIFIED", collection, (ns, name), obj)

    def add_pod(self, job: str, index: int, log: str, ns: str = "default", *, container: str = "trainer",
                exit_code: int | None = None, finished_at: str = "2026-01-01T00:10:00Z",
                replica: str | None = None, role: str | None = None) -> str:
        """A pod of ``job`` (its index), running, or ended with ``exit_code`` at ``finished_at`` (as the kubelet
        reports a terminated container). ``replica``: a Kubeflow job's pod of that replica type (``worker``,
        ``ps``), named and labelled as the training operator does (``<job>-<type>-<index>``); ``role``: an
        MPIJob's (``launcher``: the pod of the launcher Job, ``<job>-launcher-<suffix>``; ``worker``), named and
        labelled as the mpi-operator does."""
        name = f"{job}-{replica}-{index}" if replica else f"{job}-{index}-abcde"
        if role:
            name = f"{job}-launcher-{index}x{uuid.uuid4().hex[:4]}" if role == "launcher" else f"{job}-worker-{index}"
        status: dict[str, Any] = {"phase": "Running"}
        if exit_code is not None:
            status = {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [{
                "name": container, "image": "x", "imageID": "", "ready": False, "restartCount": 0,
                "state": {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                         "startedAt": "2026-01-01T00:00:00Z", "finishedAt": finished_at}}}]}
        labels = {"azulite.io/job": job, "batch.kubernetes.io/job-completion-index": str(index)}
        annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
        if replica:
            labels = {"azulite.io/job": job, "training.kubeflow.org/job-name": job,
                      "training.kubeflow.org/replica-type": replica, "training.kubeflow.org/replica-index": str(index)}
            annotations = {}
        if role:
            labels = {"azulite.io/job": job, "training.kubeflow.org/job-name": job,
                      "training.kubeflow.org/operator-name": "mpi-operator", "training.kubeflow.org/job-role": role}
            if role == "worker":
                labels["training.kubeflow.org/replica-index"] = str(index)
            annotations = {}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": container, "image": "x"}]}, "status": status}
        self.objects["pods"][(ns, name)] = pod
        self.logs[(ns, name)] = log
        return name

    def wait_for(self, predicate, timeout: float = 30) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, timeout=timeout):
                raise AssertionError("condition not reached")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKubernetes
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, obj: Any, *, schema: str | None = None, content_type: str = "application/json") -> None:
        if schema == "object" and isinstance(obj, dict):
            errs = schemas.errors(obj, "1.37")
            if errs:
                self.fake.errors.append(f"response {self.path}: {errs}")
        elif schema:
            errs = schemas.file_errors(obj, schema)
            if errs:
                self.fake.errors.append(f"response {self.path}: {errs}")
        data = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        st = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure" if code >= 400 else "Success",
              "message": message, "reason": reason, "code": code}
        if details:
            st["details"] = details
        self._send(code, st, schema="status-meta-v1.json")

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None

    def _route(self, method: str) -> None:
        if self.headers.get("Authorization") != "Bearer t0ken":
            return self._status(401, "Unauthorized", "Unauthorized")
        url = urlparse(self.path)
        self.fake.requests.append((method, url.path))
        for m, pattern, collection, action in ROUTES:
            match = re.fullmatch(pattern, url.path)
            if m == method and match:
                return getattr(self, f"_{action}")(collection, match.groupdict(), parse_qs(url.query))
        self._status(404, "NotFound", f"the server could not find the requested resource ({method} {url.path})")

    do_GET = lambda self: self._route("GET")  # noqa: E731
    do_POST = lambda self: self._route("POST")  # noqa: E731
    do_DELETE = lambda self: self._route("DELETE")  # noqa: E731

    def _create(self, collection: str, p: dict, q: dict) -> None:
        body = self._body()
        errs = body_errors(body, collection)
        if errs:
            causes = [{"reason": "FieldValueInvalid", "message": e} for e in errs]
            return self._status(422, "Invalid", f"{KINDS[collection][1]} is invalid: {'; '.join(errs)}",
                                {"kind": collection, "causes": causes})
        meta = body["metadata"]
        if meta.get("namespace", p["ns"]) != p["ns"]:
            return self._status(400, "BadRequest", "the namespace of the object does not match the namespace on the request")
        key = (p["ns"], meta["name"])
        if key in self.fake.objects[collection]:
            return self._status(409, "AlreadyExists", f'{collection} "{meta["name"]}" already exists')
        obj = copy.deepcopy(body)
        obj["metadata"].update(namespace=p["ns"], uid=str(uuid.uuid4()), creationTimestamp="2026-01-01T00:00:00Z")
        self.fake.objects[collection][key] = obj
        self.fake._record("ADDED", collection, key, obj)
        self._send(201, obj, schema="object")

    def _read(self, collection: str, p: dict, q: dict) -> None:
        obj = self.fake.objects[collection].get((p["ns"], p["name"]))
        if obj is None:
            return self._status(404, "NotFound", f'{collection} "{p["name"]}" not found')
        self._send(200, obj, schema="object")

    def _delete(self, collection: str, p: dict, q: dict) -> None:
        body = self._body()
        if body is not None:
            errs = schemas.file_errors(body, "deleteoptions-meta-v1.json")
            if errs:
                return self._status(400, "BadRequest", f"invalid DeleteOptions: {errs}")
        obj = self.fake.objects[collection].pop((p["ns"], p["name"]), None)
        if obj is None:
            return self._status(404, "NotFound", f'{collection} "{p["name"]}" not found')
        self.fake._record("DELETED", collection, (p["ns"], p["name"]), obj)
        self._send(200, obj, schema="object")

    def _list(self, collection: str, p: dict, q: dict) -> None:
        items = [o for (ns, _), o in self.fake.objects[collection].items() if ns == p["ns"]]
        field = (q.get("fieldSelector") or [""])[0]
        name = field.removeprefix("metadata.name=") if field.startswith("metadata.name=") else None
        if field and name is None:
            return self._status(400, "BadRequest", f"field selector {field!r} not supported here")
        labels = (q.get("labelSelector") or [""])[0]
        if labels:
            k, _, v = labels.partition("=")
            items = [o for o in items if (o["metadata"].get("labels") or {}).get(k) == v]
        if name is not None:
            items = [o for o in items if o["metadata"]["name"] == name]
        if (q.get("watch") or ["false"])[0].lower() in ("true", "1"):
            return self._watch(collection, p["ns"], name, float((q.get("timeoutSeconds") or ["30"])[0]))
        api_version, kind = KINDS[collection]
        out = {"apiVersion": api_version, "kind": f"{kind}List", "metadata": {"resourceVersion": str(self.fake.rv)}, "items": items}
        self._send(200, out, schema=LISTS.get(collection))

    def _watch(self, collection: str, ns: str, name: str | None, timeout: float) -> None:
        """Watch events as JSON lines (ADDED for what exists, then each change) until timeoutSeconds."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(event: dict) -> None:
            errs = schemas.file_errors(event, "watchevent-meta-v1.json")
            if event["type"] != "ERROR":
                errs += schemas.errors(event["object"], "1.37")
            if errs:
                self.fake.errors.append(f"watch event: {errs}")
            data = (json.dumps(event) + "\n").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def wanted(key: tuple[str, str]) -> bool:
            return key[0] == ns and (name is None or key[1] == name)

        with self.fake.cond:
            seen = self.fake.rv
            self.fake.watchers += 1
            self.fake.cond.notify_all()
        for key, obj in list(self.fake.objects[collection].items()):
            if wanted(key):
                chunk({"type": "ADDED", "object": obj})
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self.fake.cond:
                    self.fake.cond.wait_for(lambda: self.fake.rv > seen or self.fake.closed,
                                            timeout=max(0.0, deadline - time.monotonic()))
                    new = [e for e in self.fake.events if e[0] > seen]
                    seen = self.fake.rv
                for _, type_, coll, key, obj in new:
                    if coll == collection and wanted(key):
                        chunk({"type": type_, "object": obj})
                if self.fake.closed or time.monotonic() >= deadline:
                    break
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _log(self, collection: str, p: dict, q: dict) -> None:
        log = self.fake.logs.get((p["ns"], p["name"]))
        if log is None:
            return self._status(404, "NotFound", f'pods "{p["name"]}" not found')
        self._send(200, log, content_type="text/plain")

    def _evict(self, collection: str, p: dict, q: dict) -> None:
        body = self._body()
        errs = schemas.file_errors(body, "eviction-policy-v1.json")
        if not errs and (body.get("apiVersion"), body.get("kind")) != ("policy/v1", "Eviction"):
            errs = ["not a policy/v1 Eviction"]
        if errs:
            return self._status(422, "Invalid", f"Eviction is invalid: {errs}")
        if (p["ns"], p["name"]) not in self.fake.objects["pods"]:
            return self._status(404, "NotFound", f'pods "{p["name"]}" not found')
        self.fake.evicted.append(p["name"])
        self._status(201, "", "")
