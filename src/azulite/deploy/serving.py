"""A serving spec as AKS objects: Deployment + Service + autoscaling/v2 HPA running ``azulite serve`` or
real Triton on the same model repository (seed 001 §4.2 and §5.2), probed on ``/v2/health/*`` and scraped
for metrics on :8002.

``azulite serve`` reads ``az://`` repositories itself (downloaded to a cache, polled for changes); Triton
gets the repository URI as given (it reads ``as://``, ``s3://``, ``gs://`` and local paths).
"""

from __future__ import annotations

from typing import Any

from azulite.deploy.options import AksOptions
from azulite.deploy.sku import sku_facts
from azulite.deploy.training import GPU_TAINT, SPOT_KEY, SPOT_TAINT
from azulite.errors import DeployError
from azulite.spec.serving import ServingSpec

HTTP, GRPC, METRICS = 8000, 8001, 8002
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.01-py3"


def _server_command(spec: ServingSpec) -> tuple[list[str], list[str]]:
    if spec.server == "triton":
        return ["tritonserver"], [f"--model-repository={spec.model_repository}", *spec.args]
    return ["azulite", "serve"], [
        "--model-repository", spec.model_repository, "--http-port", str(HTTP), "--grpc-port", str(GRPC),
        "--metrics-port", str(METRICS), *spec.args,
    ]


def _image(spec: ServingSpec) -> str:
    if spec.image:
        return spec.image
    if spec.server == "triton":
        return TRITON_IMAGE
    raise DeployError("no image for `azulite serve`", where="image",
                      fix="set image to an image with azulite installed (pip install azulite), or use server: triton")


def serving_objects(spec: ServingSpec, opts: AksOptions) -> list[dict]:
    """[Deployment, Service, HorizontalPodAutoscaler (when autoscaling is set)]."""
    gpus = spec.resources.gpus
    sku = sku_facts(spec.instance_type, field="instance_type") if spec.instance_type else None
    if gpus is None:
        gpus = 1 if sku and sku.gpus else 0
    if sku is not None and gpus > sku.gpus:
        raise DeployError(f"{gpus} GPU(s) per replica but {sku.name} has {sku.gpus}", where="resources.gpus",
                          fix=f"set resources.gpus to at most {sku.gpus}, or pick a VM size with more GPUs")
    command, args = _server_command(spec)
    labels = {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/managed-by": "azulite"}
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
    probe = lambda path, delay: {"httpGet": {"path": path, "port": "http"}, "initialDelaySeconds": delay, "periodSeconds": 10}  # noqa: E731
    container = {
        "name": spec.server, "image": _image(spec), "command": command, "args": args,
        "ports": [{"name": "http", "containerPort": HTTP}, {"name": "grpc", "containerPort": GRPC},
                  {"name": "metrics", "containerPort": METRICS}],
        "readinessProbe": probe("/v2/health/ready", 5),
        "livenessProbe": probe("/v2/health/live", 15),
        "env": [{"name": k, "value": v} for k, v in spec.environment_variables.items()],
    }
    if limits or requests:
        container["resources"] = {k: v for k, v in (("limits", limits), ("requests", requests)) if v}
    node_selector: dict[str, str] = {}
    tolerations: list[dict] = []
    if spec.node_pool:
        node_selector["agentpool"] = spec.node_pool
    if gpus:
        tolerations.append(dict(GPU_TAINT))
    if spec.priority == "spot":
        node_selector[SPOT_KEY] = "spot"
        tolerations.append(dict(SPOT_TAINT))
    pod: dict[str, Any] = {"containers": [container]}
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    meta = {"name": spec.name, "namespace": opts.namespace, "labels": labels}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.autoscaling.min_replicas if spec.autoscaling else spec.replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": spec.name}},
            "template": {
                "metadata": {"labels": labels, "annotations": {
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
