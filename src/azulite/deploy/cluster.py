"""A cluster spec as what sets up AKS for GPU work (seed 001 §2, seed 002 steps 2-3): the ``az aks
nodepool add`` commands for GPU and spot pools with the cluster autoscaler, the autoscaler profile, the
NVIDIA device plugin DaemonSet, the DCGM exporter and the PrometheusRule alerts of seed 001 §2.5.
"""

from __future__ import annotations

import shlex
from typing import Any

from azulite.deploy.sku import sku_facts
from azulite.deploy.training import GPU_TAINT, SPOT_TAINT
from azulite.spec.deploy import Alerts, ClusterSpec, NodePool

DEVICE_PLUGIN_NS = "gpu-resources"
DCGM_PORT = 9400


def _pool_command(spec: ClusterSpec, i: int, pool: NodePool) -> list[str]:
    sku = sku_facts(pool.sku, field=f"node_pools[{i}].sku")
    gpu = sku.gpus > 0
    taints = pool.taints if pool.taints is not None else (["sku=gpu:NoSchedule"] if gpu else [])
    if pool.spot and not any(t.startswith("kubernetes.azure.com/scalesetpriority=") for t in taints):
        taints = [*taints, "kubernetes.azure.com/scalesetpriority=spot:NoSchedule"]
    labels = pool.labels if pool.labels is not None else ({"sku": "gpu"} if gpu else {})
    count = pool.count if pool.count is not None else (pool.min_count if pool.min_count is not None else 1)
    argv = ["az", "aks", "nodepool", "add", "--resource-group", spec.resource_group, "--cluster-name", spec.cluster_name,
            "--name", pool.name, "--node-vm-size", sku.name, "--node-count", str(count)]
    if pool.os_sku:
        argv += ["--os-sku", pool.os_sku]
    if taints:
        argv += ["--node-taints", ",".join(taints)]
    if labels:
        argv += ["--labels", *(f"{k}={v}" for k, v in labels.items())]
    if pool.spot:
        argv += ["--priority", "Spot", "--eviction-policy", "Delete", "--spot-max-price", f"{pool.spot_max_price:g}"]
    if pool.min_count is not None:
        argv += ["--enable-cluster-autoscaler", "--min-count", str(pool.min_count), "--max-count", str(pool.max_count)]
    return argv


def nodepool_script(spec: ClusterSpec) -> str:
    """A bash script: one ``az aks nodepool add`` per pool, then the autoscaler profile."""
    lines = ["#!/usr/bin/env bash", "# Rendered by `azulite cluster render`: GPU/spot node pools and the autoscaler profile.",
             "set -euo pipefail"]
    for i, pool in enumerate(spec.node_pools):
        argv = _pool_command(spec, i, pool)
        parts = [" ".join(argv[:4])]
        for a in argv[4:]:
            if a.startswith("--"):
                parts.append(a)
            else:
                parts[-1] += " " + shlex.quote(a)
        lines.append(" \\\n    ".join(parts))
    a = spec.autoscaler
    if any(p.min_count is not None for p in spec.node_pools):
        lines.append(" \\\n    ".join([
            "az aks update", f"--resource-group {shlex.quote(spec.resource_group)}", f"--name {shlex.quote(spec.cluster_name)}",
            "--cluster-autoscaler-profile", f"scale-down-unneeded-time={a.scale_down_unneeded_time}",
            f"scale-down-delay-after-add={a.scale_down_delay_after_add}", f"max-node-provision-time={a.max_node_provision_time}"]))
    return "\n".join(lines) + "\n"


def pool_commands(spec: ClusterSpec) -> list[list[str]]:
    return [_pool_command(spec, i, p) for i, p in enumerate(spec.node_pools)]


def device_plugin(spec: ClusterSpec) -> list[dict]:
    """[Namespace, DaemonSet]: seed 001 §2.3's manifest, also tolerating spot pools."""
    labels = {"name": "nvidia-device-plugin-ds"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEVICE_PLUGIN_NS}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet",
         "metadata": {"name": "nvidia-device-plugin-daemonset", "namespace": DEVICE_PLUGIN_NS},
         "spec": {
             "selector": {"matchLabels": labels}, "updateStrategy": {"type": "RollingUpdate"},
             "template": {"metadata": {"labels": labels}, "spec": {
                 "tolerations": [dict(GPU_TAINT), dict(SPOT_TAINT)],
                 "priorityClassName": "system-node-critical",
                 "containers": [{
                     "image": spec.monitoring.device_plugin_image, "name": "nvidia-device-plugin-ctr",
                     "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}],
                     "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                     "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"}],
                 }],
                 "volumes": [{"name": "device-plugin", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}],
             }},
         }},
    ]


def dcgm_exporter(spec: ClusterSpec) -> list[dict]:
    """[DaemonSet, Service]: DCGM metrics (DCGM_FI_DEV_*) on :9400 of every GPU node, scraped by Prometheus."""
    ns = spec.monitoring.namespace
    labels = {"app.kubernetes.io/name": "dcgm-exporter"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "dcgm-exporter", "namespace": ns, "labels": labels},
         "spec": {
             "selector": {"matchLabels": labels},
             "template": {"metadata": {"labels": labels, "annotations": {
                 "prometheus.io/scrape": "true", "prometheus.io/port": str(DCGM_PORT)}}, "spec": {
                 "tolerations": [dict(GPU_TAINT), dict(SPOT_TAINT)],
                 "containers": [{
                     "name": "dcgm-exporter", "image": spec.monitoring.dcgm_exporter_image,
                     "ports": [{"name": "metrics", "containerPort": DCGM_PORT}],
                     "securityContext": {"runAsNonRoot": False, "runAsUser": 0, "capabilities": {"add": ["SYS_ADMIN"]}},
                     "volumeMounts": [{"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True}],
                 }],
                 "volumes": [{"name": "pod-resources", "hostPath": {"path": "/var/lib/kubelet/pod-resources"}}],
             }},
         }},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dcgm-exporter", "namespace": ns, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "metrics", "port": DCGM_PORT, "targetPort": "metrics"}]}},
    ]


def gpu_alert_rules(alerts: Alerts) -> list[dict[str, Any]]:
    """The Prometheus rule groups of the GPU alerts. Kept as data in this one function so that the
    observe part's rule renderer (issue 11) can take them over."""
    return [{"name": "gpu.rules", "rules": [
        {"alert": "GPUMemoryExhausted", "expr": f"DCGM_FI_DEV_FB_FREE < {alerts.gpu_memory_free_mb}", "for": alerts.for_,
         "labels": {"severity": "critical"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} memory exhausted",
                         "description": "Only {{ $value }}MB free GPU memory"}},
        {"alert": "GPUTemperatureHigh", "expr": f"DCGM_FI_DEV_GPU_TEMP > {alerts.gpu_temperature_c}", "for": alerts.for_,
         "labels": {"severity": "warning"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} at {{ $value }} C",
                         "description": f"GPU temperature above {alerts.gpu_temperature_c} C"}},
        {"alert": "GPUIdle", "expr": f"avg_over_time(DCGM_FI_DEV_GPU_UTIL[10m]) < {alerts.gpu_idle_utilization}",
         "for": "30m", "labels": {"severity": "info"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} idle for 30 minutes",
                         "description": "Utilisation {{ $value }}%: a node paid for and not used"}},
    ]}]


def prometheus_rule(spec: ClusterSpec) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "gpu-alerts", "namespace": spec.monitoring.namespace},
            "spec": {"groups": gpu_alert_rules(spec.monitoring.alerts)}}
