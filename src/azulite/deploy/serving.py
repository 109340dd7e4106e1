"""A serving spec as AKS objects: Deployment + Service + autoscaling/v2 HPA running ``azulite serve`` or
real Triton on the same model repository (seed 001 §4.2 and §5.2), probed on ``/v2/health/*`` and scraped
for metrics on :8002.

The repository must be one the chosen server reads from inside the pod (``azulite.deploy.serving_repo``):
``azulite serve`` mirrors ``az://`` itself (workload identity, or an account key from a Secret); Triton
reads ``as://``, ``s3://``, ``gs://`` (an ``az://`` URI is given to it as ``as://ACCOUNT/...``, with the
account key from a Secret: Triton 24.01 reads Azure Storage with a key only). A local folder or an Azure ML
model asset is refused: no pod can read either.

Every check runs before anything is rendered: the VM size's GPUs, what a replica requests against what one
node of that size can allocate, the repository and its credentials.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from azulite.deploy.options import AksOptions
from azulite.deploy.quantity import cores, gib, parse_quantity
from azulite.deploy.serving_repo import MODEL_CACHE_DIR, repository_plan
from azulite.deploy.sku import SkuFacts, aks_allocatable, sku_facts
from azulite.deploy.training import GPU_TAINT, SPOT_KEY, SPOT_TAINT
from azulite.errors import DeployError
from azulite.spec.serving import ServingSpec

HTTP, GRPC, METRICS = 8000, 8001, 8002
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.01-py3"
#: NVIDIA's Triton images create this user (uid and gid 1000) to run the server as non-root; they start as root
TRITON_IMAGES = "nvcr.io/nvidia/tritonserver:"
TRITON_USER = 1000
#: a model load may take minutes (a large repository downloaded from Blob, TensorRT engines built): the
#: startup probe allows STARTUP_PERIOD_S * STARTUP_FAILURES seconds before the kubelet restarts the container
STARTUP_PERIOD_S, STARTUP_FAILURES = 10, 60


def _server_command(spec: ServingSpec, repo: str) -> tuple[list[str], list[str]]:
    if spec.server == "triton":
        return ["tritonserver"], [f"--model-repository={repo}", *spec.args]
    return ["azulite", "serve"], [
        "--model-repository", repo, "--http-port", str(HTTP), "--grpc-port", str(GRPC),
        "--metrics-port", str(METRICS), *spec.args,
    ]


def _image(spec: ServingSpec, opts: AksOptions) -> str:
    if opts.image or spec.image:
        return opts.image or spec.image  # type: ignore[return-value]
    if spec.server == "triton":
        return TRITON_IMAGE
    raise DeployError("no image for `azulite serve`", where="image",
                      fix="set image to an image with azulite installed (pip install azulite), or use server: triton")


def _check_fits(sku: SkuFacts, requests: dict[str, Any], fields: dict[str, str]) -> None:
    """A replica's requests against what one node of ``sku`` can allocate: more can never be scheduled."""
    cpu_m, mem = aks_allocatable(sku)
    have = {"cpu": Decimal(cpu_m) / 1000, "memory": Decimal(mem)}
    for what in ("cpu", "memory"):
        if what not in requests:
            continue
        asked = parse_quantity(str(requests[what]))
        if asked <= have[what]:
            continue
        show = cores if what == "cpu" else gib
        node = (f"{sku.vcpus} vCPUs less AKS's {cores(sku.vcpus - have['cpu'])} reserved" if what == "cpu"
                else f"{sku.ram_gb:g} GiB less AKS's reservation and eviction threshold")
        field = fields[what]
        raise DeployError(
            f"a replica requests {requests[what]} {what} but a {sku.name} node can allocate {show(have[what])} "
            f"({node}): the pod would stay Pending", where=field,
            fix=f"set {field} to at most {show(have[what])} (less still beside DaemonSets' requests), or pick a "
                "larger VM size (instance_type)")


def _security_context(image: str) -> dict:
    """No privilege escalation, no capabilities, the runtime's seccomp profile; non-root where the image is
    known to allow it (Triton's own images: their ``triton-server`` user). Another image's user is its own
    (runAsNonRoot on an image that runs as root would keep the container from starting)."""
    ctx: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                           "seccompProfile": {"type": "RuntimeDefault"}}
    if image.startswith(TRITON_IMAGES):
        ctx.update(runAsNonRoot=True, runAsUser=TRITON_USER, runAsGroup=TRITON_USER)
    return ctx


def _probes() -> dict:
    """Readiness and liveness start once the startup probe has seen the server ready (every model loaded),
    so a slow load is waited for, not killed; after that a hung server is restarted within 30 s."""
    get = lambda path: {"httpGet": {"path": path, "port": "http"}}  # noqa: E731
    return {
        "startupProbe": {**get("/v2/health/ready"), "periodSeconds": STARTUP_PERIOD_S,
                         "failureThreshold": STARTUP_FAILURES},
        "readinessProbe": {**get("/v2/health/ready"), "periodSeconds": 10},
        "livenessProbe": {**get("/v2/health/live"), "periodSeconds": 10, "failureThreshold": 3},
    }


def _resources(spec: ServingSpec, gpus: int, sku: SkuFacts | None) -> dict:
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    r = spec.resources
    if r.memory:
        limits["memory"] = r.memory
    if r.cpu:
        limits["cpu"] = r.cpu
    if r.memory_request:
        requests["memory"] = r.memory_request
    if r.cpu_request:
        requests["cpu"] = r.cpu_request
    if spec.autoscaling and "cpu" not in requests:
        # a CPU utilisation target is a share of the request: without one the HPA cannot compute it
        requests["cpu"] = r.cpu or "1"
    if requests and gpus:
        requests["nvidia.com/gpu"] = str(gpus)
    if sku is not None:
        # what the scheduler places by: the request, else the limit (Kubernetes' default request)
        asked = {k: requests.get(k, limits.get(k)) for k in ("cpu", "memory") if k in requests or k in limits}
        fields = {"cpu": "resources.cpu" if r.cpu and not r.cpu_request else "resources.cpu_request",
                  "memory": "resources.memory_request" if r.memory_request else "resources.memory"}
        _check_fits(sku, asked, fields)
    return {k: v for k, v in (("limits", limits), ("requests", requests)) if v}


def serving_objects(spec: ServingSpec, opts: AksOptions) -> list[dict]:
    """[Deployment, Service, HorizontalPodAutoscaler (when autoscaling is set)]."""
    gpus = spec.resources.gpus
    sku = sku_facts(spec.instance_type, field="instance_type") if spec.instance_type else None
    if gpus is None:
        gpus = 1 if sku and sku.gpus else 0
    if sku is not None and gpus > sku.gpus:
        raise DeployError(f"{gpus} GPU(s) per replica but {sku.name} has {sku.gpus}", where="resources.gpus",
                          fix=f"set resources.gpus to at most {sku.gpus}, or pick a VM size with more GPUs")
    image = _image(spec, opts)
    resources = _resources(spec, gpus, sku)
    plan = repository_plan(spec, opts)
    command, args = _server_command(spec, plan.uri)
    labels = {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/managed-by": "azulite"}
    env = {**plan.env, **{k: {"name": k, "value": v} for k, v in spec.environment_variables.items()}}  # the user's word wins
    container: dict[str, Any] = {
        "name": spec.server, "image": image, "command": command, "args": args,
        "ports": [{"name": "http", "containerPort": HTTP}, {"name": "grpc", "containerPort": GRPC},
                  {"name": "metrics", "containerPort": METRICS}],
        **_probes(),
        "env": list(env.values()),
        "securityContext": _security_context(image),
    }
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {"containers": [container]}
    if plan.cache:
        container["volumeMounts"] = [{"name": "model-cache", "mountPath": MODEL_CACHE_DIR}]
        pod["volumes"] = [{"name": "model-cache", "emptyDir": {}}]
    node_selector: dict[str, str] = {}
    tolerations: list[dict] = []
    if spec.node_pool:
        node_selector["agentpool"] = spec.node_pool
    elif sku is not None:  # the size its resources were checked against
        node_selector["node.kubernetes.io/instance-type"] = sku.name
    if gpus or spec.node_pool or (sku and sku.gpus):
        # a GPU pool is tainted sku=gpu:NoSchedule (cluster render), whether the replica asks for a GPU or not;
        # on a named CPU pool the toleration is harmless (the nodeSelector keeps the pod on that pool)
        tolerations.append(dict(GPU_TAINT))
    if spec.priority == "spot":
        node_selector[SPOT_KEY] = "spot"
        tolerations.append(dict(SPOT_TAINT))
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    pod_labels = dict(labels)
    if plan.workload_identity:
        # the webhook injects the federated token for this service account's identity (as for training)
        pod["serviceAccountName"] = opts.service_account
        pod_labels["azure.workload.identity/use"] = "true"
    meta = {"name": spec.name, "namespace": opts.namespace, "labels": labels}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.autoscaling.min_replicas if spec.autoscaling else spec.replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": spec.name}},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS), "prometheus.io/path": "/metrics"}},
                "spec": pod,
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"selector": {"app.kubernetes.io/name": spec.name}, "ports": [
            {"name": n, "port": p, "targetPort": n} for n, p in (("http", HTTP), ("grpc", GRPC), ("metrics", METRICS))]},
    }
    out = [deployment, service]
    if spec.autoscaling:
        a = spec.autoscaling
        out.append({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
                "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas,
                "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                    "type": "Utilization", "averageUtilization": a.target_cpu_utilization}}}],
            },
        })
    return out
