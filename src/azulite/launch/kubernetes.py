"""The ``kubernetes`` backend: a job spec rendered by ``azulite.deploy.objects`` (an Indexed Job + headless
Service, a Kubeflow PyTorchJob; for a tensorflow job a Kubeflow TFJob, for an mpi job a Kubeflow MPIJob)
and created, watched, read and deleted through the official ``kubernetes`` client with the user's kubeconfig.

The job store (SQLite under ``AZULITE_HOME``) records each job with ``backend = kubernetes`` and, in
``<job dir>/remote.json``, where it runs (context, namespace, kind and object name), so that ``job show``,
``logs``, ``cancel`` and ``preempt`` find it again. The cluster is the truth: ``status`` reads it and brings
the store up to date.

Settings (read once from the environment): ``KUBECONFIG`` (default ~/.kube/config), ``AZULITE_K8S_CONTEXT``,
``AZULITE_K8S_NAMESPACE`` (default), ``AZULITE_K8S_FLAVOR`` (indexed-job | pytorchjob | tfjob | mpijob), ``AZULITE_K8S_IMAGE``,
``AZULITE_K8S_CODE_URI`` (az://container/prefix: the code snapshot is uploaded there at submit),
``AZULITE_K8S_STORAGE_ACCOUNT``, ``AZULITE_K8S_PVC``, ``AZULITE_K8S_SERVICE_ACCOUNT``.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from pathlib import Path
from typing import Any, Iterator

from azulite.contract import EXIT_CONFIG
from azulite.deploy.image import code_archive_uri
from azulite.deploy.options import FLAVORS, AksOptions, check_namespace, check_object_name, check_storage_account
from azulite.deploy.mpi_job import MPI_CONTAINER
from azulite.launch.snapshot import tar_filter
from azulite.deploy.objects import FLAVOR_OF_KIND, training_objects
from azulite.deploy.training import CONTAINER, PYTORCH_CONTAINER, TF_CONTAINER, k8s_name
from azulite.errors import AzuliteError, DeployError, LaunchError, RemoteError
from azulite.launch.backend import Backend, Feature, register_backend, restated
from azulite.launch.local.store import JobStore
from azulite.launch.records import JobRecord, JobState
from azulite.spec.job import JobSpec

#: the Kubeflow kinds: (group, version, plural), as CustomObjectsApi takes them
CUSTOM = {"PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"), "TFJob": ("kubeflow.org", "v1", "tfjobs"),
          "MPIJob": ("kubeflow.org", "v2beta1", "mpijobs")}
_CONTAINERS = (CONTAINER, PYTORCH_CONTAINER, TF_CONTAINER, MPI_CONTAINER)  # the training container in each kind
#: the labels the training operator gives each pod of a Kubeflow job (replica type in lower case: worker, ps);
#: the mpi-operator labels a role (launcher, worker) and the workers' index
REPLICA_TYPE, REPLICA_INDEX = "training.kubeflow.org/replica-type", "training.kubeflow.org/replica-index"
JOB_ROLE = "training.kubeflow.org/job-role"
#: mpirun's --tag-output prefix of each line of a rank: [jobid,rank]<stdout>: (or <stderr>:, <stddiag>:)
_MPI_TAG = re.compile(r"^\[\d+,(\d+)\]<\w+>:")


#: what `deploy render`'s flags are to `job submit --backend kubernetes` (the render's errors name the flags)
SETTINGS_OF_FLAGS = {"--image": "AZULITE_K8S_IMAGE", "--pvc": "AZULITE_K8S_PVC", "--code-uri": "AZULITE_K8S_CODE_URI",
                     "--storage-account": "AZULITE_K8S_STORAGE_ACCOUNT", "--namespace": "AZULITE_K8S_NAMESPACE",
                     "--service-account": "AZULITE_K8S_SERVICE_ACCOUNT"}


def aks_options(environ: dict[str, str]) -> AksOptions:
    flavor = environ.get("AZULITE_K8S_FLAVOR", "indexed-job")
    if flavor not in FLAVORS:
        raise LaunchError(f"AZULITE_K8S_FLAVOR={flavor!r} is not a flavor", where="AZULITE_K8S_FLAVOR",
                          fix=f"use {', '.join(FLAVORS)} (or --flavor)")
    account, pvc = environ.get("AZULITE_K8S_STORAGE_ACCOUNT") or None, environ.get("AZULITE_K8S_PVC") or None
    return AksOptions(
        namespace=check_namespace(environ.get("AZULITE_K8S_NAMESPACE", "default"), "AZULITE_K8S_NAMESPACE"),
        flavor=flavor,  # type: ignore[arg-type]
        image=environ.get("AZULITE_K8S_IMAGE") or None, code_uri=environ.get("AZULITE_K8S_CODE_URI") or None,
        storage_account=account and check_storage_account(account, "AZULITE_K8S_STORAGE_ACCOUNT"),
        pvc=pvc and check_object_name(pvc, "AZULITE_K8S_PVC", "PersistentVolumeClaim", "training-outputs"),
        service_account=check_object_name(environ.get("AZULITE_K8S_SERVICE_ACCOUNT", "azulite"),
                                          "AZULITE_K8S_SERVICE_ACCOUNT", "ServiceAccount", "azulite"),
    )


def api_client(environ: dict[str, str]) -> Any:
    """A client for the kubeconfig's current (or AZULITE_K8S_CONTEXT) context; clear errors when there is none."""
    import yaml
    from kubernetes import config

    path = Path(environ.get("KUBECONFIG") or Path(environ.get("HOME", "~")) / ".kube" / "config").expanduser()
    if not path.is_file():
        raise DeployError(f"kubeconfig {path} does not exist", where="KUBECONFIG",
                          fix="run `az aks get-credentials --resource-group RG --name CLUSTER`, or set KUBECONFIG to your kubeconfig")
    context = environ.get("AZULITE_K8S_CONTEXT") or None
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise DeployError(f"kubeconfig {path} is not valid YAML: {e}", where="KUBECONFIG", fix="fix or regenerate it") from None
    names = [c.get("name") for c in cfg.get("contexts") or []]
    if context is None and not cfg.get("current-context"):
        raise DeployError(f"kubeconfig {path} has no current context", where="KUBECONFIG",
                          fix=f"run `kubectl config use-context NAME` (known: {', '.join(map(str, names)) or 'none'}) or set AZULITE_K8S_CONTEXT")
    if context is not None and context not in names:
        raise DeployError(f"kubeconfig {path} has no context {context!r}", where="AZULITE_K8S_CONTEXT",
                          fix=f"use one of: {', '.join(map(str, names)) or 'none (add one with az aks get-credentials)'}")
    try:
        return config.new_client_from_config(config_file=str(path), context=context, persist_config=False)
    except config.ConfigException as e:
        raise DeployError(f"kubeconfig {path}: {e}", where="KUBECONFIG", fix="fix the context's cluster and user entries") from None


def _api_error(e: Exception, what: str) -> RemoteError:
    status, body = getattr(e, "status", None), getattr(e, "body", None)
    detail = ""
    try:
        detail = json.loads(body).get("message", "") if body else ""
    except (ValueError, AttributeError):
        detail = str(body)[:300]
    if status is None and _unreachable(e):  # no answer at all: the cluster, not its rights, is the problem
        return RemoteError(f"{what}: the API server did not answer ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                           where="kubernetes API",
                           fix="check the cluster is up and the kubeconfig's server address (kubectl cluster-info)")
    return RemoteError(f"{what}: {status or type(e).__name__} {detail or e}".strip(), where="kubernetes API",
                       fix="check the namespace, your RBAC rights (kubectl auth can-i create jobs) and the training operator")


def _unreachable(e: BaseException) -> bool:
    """A connection that never got an HTTP answer (refused, reset, no route, name not resolved)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in (
                "MaxRetryError", "NewConnectionError", "NameResolutionError", "ProtocolError"):
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def upload_code(code_dir: str, uri: str, environ: dict[str, str]) -> None:
    """The code folder as one tar.gz blob at ``uri`` (the init container unpacks it into /code)."""
    import fsspec

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(code_dir, arcname=".", filter=tar_filter(code_dir))  # as a local job's snapshot (launch/snapshot.py)
    opts: dict[str, Any] = {}
    if environ.get("AZURE_STORAGE_CONNECTION_STRING"):
        opts["connection_string"] = environ["AZURE_STORAGE_CONNECTION_STRING"]
    elif environ.get("AZURE_STORAGE_ACCOUNT_NAME"):
        opts["account_name"] = environ["AZURE_STORAGE_ACCOUNT_NAME"]
        if environ.get("AZURE_STORAGE_ACCOUNT_KEY"):
            opts["account_key"] = environ["AZURE_STORAGE_ACCOUNT_KEY"]
        else:
            opts["anon"] = False  # DefaultAzureCredential
    try:
        with fsspec.open(uri, "wb", **opts) as f:
            f.write(buf.getvalue())
    except Exception as e:  # noqa: BLE001 - any SDK/network failure is the same user problem
        raise RemoteError(f"cannot upload the code snapshot to {uri}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                          where="AZULITE_K8S_CODE_URI", fix="check the Blob credentials (AZURE_STORAGE_*) and the container") from None


@register_backend("kubernetes")
class KubernetesBackend(Backend):
    unsupported: frozenset[Feature] = frozenset()

    def __init__(self, settings, environ=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings, environ)
        self.store = JobStore(settings.db_path)
        self.opts = aks_options(self.environ)
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = api_client(self.environ)
        return self._client

    # ---- where a job runs ----------------------------------------------------------------------------
    def _where(self, rec: JobRecord) -> dict:
        try:
            return json.loads((Path(rec.job_dir) / "remote.json").read_text())
        except (OSError, ValueError):
            raise LaunchError(f"{rec.id} has no record of where it runs ({rec.job_dir}/remote.json)",
                              fix="it was not submitted to Kubernetes by this azulite home") from None

    # ---- submit --------------------------------------------------------------------------------------
    def _submit_impl(self, spec: JobSpec, *, spec_path: str | None) -> JobRecord:
        # render first: every check of the spec and options runs before anything is recorded or sent
        probe = self._objects(spec, "probe")
        del probe
        client = self.client
        rec = self.store.create(name=spec.name, backend=self.name, spec=spec.model_dump(mode="json"), spec_path=spec_path,
                                environment=spec.environment_label, jobs_dir=self.settings.jobs_dir)
        name = k8s_name(rec.id)
        objects = self._objects(spec, name)
        Path(rec.job_dir).mkdir(parents=True, exist_ok=True)
        kind = objects[-1]["kind"]
        (Path(rec.job_dir) / "remote.json").write_text(json.dumps(
            {"namespace": self.opts.namespace, "name": name, "kind": kind, "flavor": FLAVOR_OF_KIND[kind],
             "context": self.environ.get("AZULITE_K8S_CONTEXT")}))
        try:
            if self.opts.code_uri:
                upload_code(spec.code, code_archive_uri(self.opts, name), self.environ)
            for obj in objects:
                self._create(client, obj)
        except Exception as e:
            self.store.transition(rec.id, JobState.FAILED, message=f"submit failed: {e}", exit_code=1)
            if isinstance(e, (RemoteError, DeployError)):
                raise
            raise _api_error(e, f"creating {name}") from None
        self.store.event(rec.id, f"created {kind} {self.opts.namespace}/{name}")
        return self.store.get(rec.id)

    def _objects(self, spec: JobSpec, name: str) -> list[dict]:
        try:
            return training_objects(spec, self.opts, name=name)
        except AzuliteError as e:
            raise restated(e, SETTINGS_OF_FLAGS) from None

    def _create(self, client: Any, obj: dict) -> None:
        from kubernetes import client as k

        ns = obj["metadata"]["namespace"]
        if obj["kind"] == "Service":
            k.CoreV1Api(client).create_namespaced_service(ns, obj)
        elif obj["kind"] == "ConfigMap":
            k.CoreV1Api(client).create_namespaced_config_map(ns, obj)
        elif obj["kind"] == "Job":
            k.BatchV1Api(client).create_namespaced_job(ns, obj)
        elif obj["kind"] in CUSTOM:
            group, version, plural = CUSTOM[obj["kind"]]
            k.CustomObjectsApi(client).create_namespaced_custom_object(group, version, ns, plural, obj)
        else:  # pragma: no cover - the renderers make only these
            raise LaunchError(f"cannot create a {obj['kind']}")

    # ---- status --------------------------------------------------------------------------------------
    def _read(self, where: dict) -> dict:
        from kubernetes import client as k

        try:
            if where["kind"] == "Job":
                return self.client.sanitize_for_serialization(
                    k.BatchV1Api(self.client).read_namespaced_job_status(where["name"], where["namespace"]))
            group, version, plural = CUSTOM[where["kind"]]
            return k.CustomObjectsApi(self.client).get_namespaced_custom_object(
                group, version, where["namespace"], plural, where["name"])
        except k.ApiException as e:
            if e.status == 404:
                return {}
            raise _api_error(e, f"reading {where['namespace']}/{where['name']}") from None

    @staticmethod
    def observed_state(obj: dict) -> tuple[JobState, str | None]:
        """The job's state from a Job's, PyTorchJob's or TFJob's status (404: the object is gone: canceled)."""
        if not obj:
            return JobState.CANCELED, "the object is gone from the cluster"
        status = obj.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
        for kind, state in (("Complete", JobState.SUCCEEDED), ("Succeeded", JobState.SUCCEEDED), ("Failed", JobState.FAILED)):
            if kind in conditions:
                return state, conditions[kind].get("message") or conditions[kind].get("reason")
        if status.get("active") or "Running" in conditions or status.get("ready"):
            return JobState.RUNNING, None
        return JobState.QUEUED, None

    def _sync(self, rec: JobRecord, obj: dict) -> JobRecord:
        state, reason = self.observed_state(obj)
        if state != rec.state and not rec.state.terminal:
            if state.terminal and rec.state == JobState.QUEUED and state != JobState.CANCELED:
                self.store.transition(rec.id, JobState.RUNNING, attempt=max(rec.attempt, 1))
            if state == JobState.RUNNING:
                self.store.transition(rec.id, JobState.RUNNING, attempt=max(rec.attempt, 1))
            elif state == JobState.FAILED:
                code, why = self._failed_exit(self._where(rec))
                message = "; ".join(m for m in (reason, why) if m)
                self.store.transition(rec.id, state, message=message or None, exit_code=code)
            elif state.terminal:
                self.store.transition(rec.id, state, message=reason, exit_code=0 if state == JobState.SUCCEEDED else 1)
        return self.store.get(rec.id)

    def _failed_exit(self, where: dict) -> tuple[int, str | None]:
        """The exit code a failed job's pods ended with, as the pod entry made it (deploy/pod_entry.py): a 78
        (an error no restart fixes) first, else the first pod to fail. 1 when no pod says (gone, unreadable)."""
        try:
            pods = self._pods(where)
        except RemoteError:  # the state is known; the detail is not worth failing `job show` over
            return 1, None
        ended = []
        for i, pod in enumerate(pods):
            for c in (pod.status.container_statuses or []) if pod.status else []:
                done = c.state.terminated if c.name in _CONTAINERS and c.state else None
                if done is not None and done.exit_code:
                    when = done.finished_at.isoformat() if done.finished_at else "~"  # unknown: last
                    ended.append((done.exit_code != EXIT_CONFIG, when, i, pod.metadata.name, done.exit_code))
        if not ended:
            return 1, None
        *_, name, code = min(ended)
        what = " (an error no restart can fix; not retried)" if code == EXIT_CONFIG else ""
        return code, f"pod {name} exited {code}{what}: its log says why (azulite job logs)"

    def _status_impl(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        if rec.state.terminal:
            return rec
        return self._sync(rec, self._read(self._where(rec)))

    def watch(self, job_id: str, timeout_s: float = 600) -> Iterator[JobRecord]:
        """Each change of the job's state, from the API server's watch of its object, until it ends."""
        from kubernetes import client as k, watch

        rec = self.store.get(job_id)
        where = self._where(rec)
        if where["kind"] == "Job":
            lister: Any = k.BatchV1Api(self.client).list_namespaced_job
            args: tuple = (where["namespace"],)
        else:
            lister = k.CustomObjectsApi(self.client).list_namespaced_custom_object
            group, version, plural = CUSTOM[where["kind"]]
            args = (group, version, where["namespace"], plural)
        deadline = time.monotonic() + timeout_s
        last = rec.state
        while not rec.state.terminal and time.monotonic() < deadline:
            w = watch.Watch()
            try:
                for event in w.stream(lister, *args, field_selector=f"metadata.name={where['name']}",
                                      timeout_seconds=max(1, int(deadline - time.monotonic()))):
                    obj = event["object"]
                    obj = obj if isinstance(obj, dict) else self.client.sanitize_for_serialization(obj)
                    rec = self._sync(rec, {} if event["type"] == "DELETED" else obj)
                    if rec.state != last:
                        last = rec.state
                        yield rec
                    if rec.state.terminal:
                        return
            except k.ApiException as e:
                raise _api_error(e, f"watching {where['namespace']}/{where['name']}") from None
            finally:
                w.stop()

    def _list_impl(self, limit: int) -> list[JobRecord]:
        return [r for r in self.store.list(limit) if r.backend == self.name]

    # ---- logs ----------------------------------------------------------------------------------------
    def _pods(self, where: dict) -> list[Any]:
        from kubernetes import client as k

        try:
            pods = k.CoreV1Api(self.client).list_namespaced_pod(where["namespace"], label_selector=f"azulite.io/job={where['name']}").items
        except k.ApiException as e:
            raise _api_error(e, "listing the job's pods") from None

        def order(p: Any) -> tuple[int, int, str]:
            """An Indexed Job's pods by index; a Kubeflow job's workers by replica index (``--rank N``: worker
            N), then its other replicas (a TFJob's parameter servers); an MPIJob's launcher first."""
            labels, ann = p.metadata.labels or {}, p.metadata.annotations or {}
            index = ann.get("batch.kubernetes.io/job-completion-index") or labels.get(REPLICA_INDEX, "")
            role = labels.get(REPLICA_TYPE) or labels.get(JOB_ROLE, "worker")
            rank = {"launcher": 0, "worker": 1}.get(role, 2)
            return (rank, int(index) if index.isdigit() else 0, p.metadata.name)

        return sorted(pods, key=order)

    def _logs_impl(self, job_id: str, *, rank: int | None, follow: bool) -> Iterator[str]:
        """Each pod's log (one pod per node: ``--rank`` picks the node), prefixed with the pod's name."""
        from kubernetes import client as k

        rec = self.store.get(job_id)
        where = self._where(rec)
        pods = self._pods(where)
        mpi = where["kind"] == "MPIJob"
        if mpi:  # every rank's output is in the launcher's log (mpirun --tag-output); the workers' is sshd's
            pods = [p for p in pods if (p.metadata.labels or {}).get(JOB_ROLE) == "launcher"]
        elif rank is not None:
            pods = pods[rank:rank + 1]
        core = k.CoreV1Api(self.client)

        one_rank = mpi and rank is not None  # rank N's lines of the launcher's log, their tag dropped

        def lines(pod: str, text: str) -> Iterator[str]:
            for part in text.splitlines():
                m = _MPI_TAG.match(part) if one_rank else None
                if not one_rank or (m and int(m.group(1)) == rank):
                    yield f"[{pod}] {part[m.end():] if m else part}"

        for pod in pods:
            try:
                if follow:
                    resp = core.read_namespaced_pod_log(pod.metadata.name, where["namespace"], follow=True, _preload_content=False)
                    for line in resp.stream():
                        yield from lines(pod.metadata.name, line.decode("utf-8", "replace"))
                else:
                    yield from lines(pod.metadata.name, core.read_namespaced_pod_log(pod.metadata.name, where["namespace"]))
            except k.ApiException as e:
                raise _api_error(e, f"reading the log of {pod.metadata.name}") from None

    # ---- cancel / preempt ----------------------------------------------------------------------------
    def _cancel_impl(self, job_id: str) -> JobRecord:
        from kubernetes import client as k

        rec = self.store.get(job_id)
        where = self._where(rec)
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Foreground"}
        try:
            if where["kind"] == "Job":
                k.BatchV1Api(self.client).delete_namespaced_job(where["name"], where["namespace"], body=body)
            else:
                group, version, plural = CUSTOM[where["kind"]]
                k.CustomObjectsApi(self.client).delete_namespaced_custom_object(
                    group, version, where["namespace"], plural, where["name"], body=body)
        except k.ApiException as e:
            if e.status != 404:
                raise _api_error(e, f"deleting {where['namespace']}/{where['name']}") from None
        # what the job's pods used: the Indexed Job's Service, the pod entry's ConfigMap (absent: not made)
        core = k.CoreV1Api(self.client)
        for delete, name in ((core.delete_namespaced_service, where["name"]),
                             (core.delete_namespaced_config_map, f"{where['name']}-entry")):
            try:
                delete(name, where["namespace"], body=body)
            except k.ApiException as e:
                if e.status != 404:
                    raise _api_error(e, f"deleting {where['namespace']}/{name}") from None
        if not rec.state.terminal:
            self.store.transition(rec.id, JobState.CANCELED, message="canceled (deleted from the cluster)")
        return self.store.get(job_id)

    def _preempt_impl(self, job_id: str) -> JobRecord:
        """Evict every pod of the job (policy/v1 Eviction, as a node drain or spot eviction does): each gets
        SIGTERM and its grace period to checkpoint; the pod then exits 75, which the Job's podFailurePolicy
        ignores (a PyTorchJob's 143, which Kubeflow's ExitCode policy retries), and the pod is recreated.
        An MPIJob's workers only (the nodes a spot eviction takes): their ranks checkpoint, the operator
        recreates them, and the launcher runs mpirun again in the same pod."""
        from kubernetes import client as k

        rec = self.store.get(job_id)
        where = self._where(rec)
        core = k.CoreV1Api(self.client)
        pods = self._pods(where)
        if where["kind"] == "MPIJob":
            pods = [p for p in pods if (p.metadata.labels or {}).get(JOB_ROLE) == "worker"]
        for pod in pods:
            body = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": pod.metadata.name, "namespace": where["namespace"]}}
            try:
                core.create_namespaced_pod_eviction(pod.metadata.name, where["namespace"], body)
            except k.ApiException as e:
                raise _api_error(e, f"evicting {pod.metadata.name}") from None
        self.store.event(rec.id, "preemption requested: pods evicted")
        return self.store.get(job_id)
