"""A cluster spec (``azulite.spec.cluster``: the same file ``azulite simulate`` and ``plan`` read) as what
sets up AKS for GPU work (seed 001 §2, seed 002 steps 2-3): the ``az aks nodepool add`` commands for GPU and
spot pools with the cluster autoscaler, the autoscaler profile, the NVIDIA device plugin DaemonSet, the DCGM
exporter and the PrometheusRule alerts of seed 001 §2.5.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from azulite.deploy.sku import sku_facts
from azulite.errors import DeployError
from azulite.observe import rules
from azulite.observe.alerts import gpu_rule_groups
from azulite.observe.rules import RuleGroup
from azulite.spec.cluster import SPOT_TAINT as SPOT_TAINT_TEXT
from azulite.spec.cluster import ClusterSpec, NodePool, Taint

DEVICE_PLUGIN_NS = "gpu-resources"
DCGM_PORT = 9400
#: AKS's most nodes in one (Virtual Machine Scale Sets) node pool (learn.microsoft.com/azure/aks/quotas-skus-regions)
AKS_MAX_POOL_NODES = 1000
#: the label AKS puts on every node: its pool's name
POOL_LABEL = "agentpool"
_AKS_POOL_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")  # AKS: Linux node pool names
# AKS cluster names: 1-63 letters, digits, '_' and '-', starting and ending with a letter or digit; `az`
# would refuse anything else only when the script runs, after the first pools were added
_AKS_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class AksCluster:
    """Where the pools go and what watches them: what a cluster spec for simulation does not say."""

    resource_group: str
    #: the AKS cluster (default: the spec's ``name``)
    cluster_name: str | None = None
    monitoring_namespace: str = "monitoring"
    device_plugin_image: str = "nvcr.io/nvidia/k8s-device-plugin:v0.18.0"
    dcgm_exporter_image: str = "nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04"
    max_node_provision_time: str = "15m"
    #: alert thresholds (seed 001 §2.5: 1024 MB free for 2 minutes; ``alert_for`` is that rule's duration)
    gpu_memory_free_mb: int = 1024
    gpu_temperature_c: int = 85
    gpu_idle_utilization: int = 5
    alert_for: str = "2m"
    #: labels of the PrometheusRule: a Prometheus Operator loads only the rules its ruleSelector matches
    #: (kube-prometheus-stack's default: ``release: <its Helm release name>``)
    rule_labels: tuple[tuple[str, str], ...] = ()


def _duration(seconds: float) -> str:
    """Seconds as the autoscaler profile writes durations (10m, 90s)."""
    s = int(round(seconds))
    return f"{s // 3600}h" if s and s % 3600 == 0 else f"{s // 60}m" if s and s % 60 == 0 else f"{s}s"


def pool_taints(pool: NodePool, gpu: bool) -> list[str]:
    """The pool's taints as rendered: its own, else ``sku=gpu:NoSchedule`` on a GPU pool; a spot pool also
    carries Azure's spot taint."""
    taints = [str(t) for t in pool.taints] or (["sku=gpu:NoSchedule"] if gpu else [])
    if pool.spot and SPOT_TAINT_TEXT not in taints:
        taints.append(SPOT_TAINT_TEXT)
    return taints


def _pool_command(spec: ClusterSpec, aks: AksCluster, i: int, pool: NodePool) -> list[str]:
    where = f"pools[{i}]"
    if not _AKS_POOL_NAME.match(pool.name):
        raise DeployError(f"{pool.name!r} is not an AKS node pool name", where=f"{where}.name",
                          fix="use 1-12 lowercase letters and digits, starting with a letter, e.g. gpunp")
    if pool.max_nodes > AKS_MAX_POOL_NODES:
        raise DeployError(f"max_nodes {pool.max_nodes}: an AKS node pool holds at most {AKS_MAX_POOL_NODES} nodes",
                          where=f"{where}.max_nodes",
                          fix=f"set max_nodes to at most {AKS_MAX_POOL_NODES}, and split the capacity over more pools")
    sku = sku_facts(pool.sku, field=f"{where}.sku")
    gpu = sku.gpus > 0
    taints = pool_taints(pool, gpu)
    labels = pool.labels or ({"sku": "gpu"} if gpu else {})
    argv = ["az", "aks", "nodepool", "add", "--resource-group", aks.resource_group,
            "--cluster-name", _cluster_name(spec, aks), "--name", pool.name, "--node-vm-size", sku.name,
            "--node-count", str(pool.start_nodes)]
    if taints:
        argv += ["--node-taints", ",".join(taints)]
    if labels:
        argv += ["--labels", *(f"{k}={v}" for k, v in labels.items())]
    if pool.spot:
        argv += ["--priority", "Spot", "--eviction-policy", "Delete", "--spot-max-price", "-1"]
    if spec.autoscaler.enabled:
        argv += ["--enable-cluster-autoscaler", "--min-count", str(pool.min_nodes), "--max-count", str(pool.max_nodes)]
    return argv


def _cluster_name(spec: ClusterSpec, aks: AksCluster) -> str:
    """The AKS cluster the pools go to: --cluster-name, else the spec's ``name`` (never a default: the
    script would add pools to a cluster nobody named)."""
    if aks.cluster_name:
        name, where = aks.cluster_name, "--cluster-name"
    elif "name" in spec.model_fields_set:
        name, where = spec.name, "name"
    else:
        raise DeployError("no AKS cluster named: the spec has no `name` and no --cluster-name was given",
                          where="name", fix="add `name: <your AKS cluster>` to the spec, or pass --cluster-name NAME")
    if not _AKS_CLUSTER_NAME.match(name):
        raise DeployError(f"{name!r} is not an AKS cluster name", where=where,
                          fix="use 1-63 letters, digits, '_' and '-', starting and ending with a letter or digit, "
                              "e.g. --cluster-name gpu-aks")
    return name


def gpu_pools(spec: ClusterSpec) -> list[NodePool]:
    return [p for i, p in enumerate(spec.pools) if sku_facts(p.sku, field=f"pools[{i}].sku").gpus > 0]


def _gpu_nodes(spec: ClusterSpec) -> dict:
    """What puts a GPU DaemonSet on the GPU pools' nodes and nowhere else: an affinity to their pools (AKS
    labels every node ``agentpool=<pool>``, whatever labels the pool sets) and a toleration of each taint
    they carry (their own, as cluster render makes them)."""
    pools = gpu_pools(spec)
    tolerations: list[dict] = []
    for pool in pools:
        for text in pool_taints(pool, True):
            t = Taint.parse(text)
            tol = ({"key": t.key, "operator": "Equal", "value": t.value, "effect": t.effect} if t.value
                   else {"key": t.key, "operator": "Exists", "effect": t.effect})
            if tol not in tolerations:
                tolerations.append(tol)
    return {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": POOL_LABEL, "operator": "In", "values": [p.name for p in pools]}]}]}}},
        "tolerations": tolerations,
    }
def pool_commands(spec: ClusterSpec, aks: AksCluster) -> list[list[str]]:
    return [_pool_command(spec, aks, i, p) for i, p in enumerate(spec.pools)]


def nodepool_script(spec: ClusterSpec, aks: AksCluster) -> str:
    """A bash script: one ``az aks nodepool add`` per pool, then the autoscaler profile."""
    name = _cluster_name(spec, aks)
    lines = ["#!/usr/bin/env bash", "# Rendered by `azulite cluster render`: GPU/spot node pools and the autoscaler profile.",
             "set -euo pipefail"]
    for argv in pool_commands(spec, aks):
        parts = [" ".join(argv[:4])]
        for a in argv[4:]:
            if a.startswith("--"):
                parts.append(a)
            else:
                parts[-1] += " " + shlex.quote(a)
        lines.append(" \\\n    ".join(parts))
    a = spec.autoscaler
    if a.enabled:
        lines.append(" \\\n    ".join([
            "az aks update", f"--resource-group {shlex.quote(aks.resource_group)}",
            f"--name {shlex.quote(name)}", "--cluster-autoscaler-profile",
            f"scale-down-unneeded-time={_duration(a.scale_down_unneeded_time)}",
            f"scale-down-delay-after-add={_duration(a.scale_down_delay_after_add)}",
            f"max-node-provision-time={aks.max_node_provision_time}"]))
    return "\n".join(lines) + "\n"


def device_plugin(aks: AksCluster, spec: ClusterSpec) -> list[dict]:
    """[Namespace, DaemonSet]: seed 001 §2.3's manifest, on the spec's GPU pools (their taints tolerated)."""
    labels = {"name": "nvidia-device-plugin-ds"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEVICE_PLUGIN_NS}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet",
         "metadata": {"name": "nvidia-device-plugin-daemonset", "namespace": DEVICE_PLUGIN_NS},
         "spec": {
             "selector": {"matchLabels": labels}, "updateStrategy": {"type": "RollingUpdate"},
             "template": {"metadata": {"labels": labels}, "spec": {
                 **_gpu_nodes(spec),
                 "priorityClassName": "system-node-critical",
                 "containers": [{
                     "image": aks.device_plugin_image, "name": "nvidia-device-plugin-ctr",
                     "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}],
                     "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                     "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"}],
                 }],
                 "volumes": [{"name": "device-plugin", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}],
             }},
         }},
    ]


def dcgm_exporter(aks: AksCluster, spec: ClusterSpec) -> list[dict]:
    """[Namespace, DaemonSet, Service]: DCGM metrics (DCGM_FI_DEV_*) on :9400 of every node of the spec's GPU
    pools (on a node without a GPU the exporter finds none and exits, again and again)."""
    ns = aks.monitoring_namespace
    labels = {"app.kubernetes.io/name": "dcgm-exporter"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "dcgm-exporter", "namespace": ns, "labels": labels},
         "spec": {
             "selector": {"matchLabels": labels},
             "template": {"metadata": {"labels": labels, "annotations": {
                 "prometheus.io/scrape": "true", "prometheus.io/port": str(DCGM_PORT)}}, "spec": {
                 **_gpu_nodes(spec),
                 "containers": [{
                     "name": "dcgm-exporter", "image": aks.dcgm_exporter_image,
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


def gpu_alert_rules(aks: AksCluster) -> list[RuleGroup]:
    """The GPU alert groups (one copy, in ``azulite.observe.alerts``) with this cluster's thresholds."""
    return gpu_rule_groups(fb_free_mib=aks.gpu_memory_free_mb, temp_c=aks.gpu_temperature_c,
                           idle_utilization=aks.gpu_idle_utilization, memory_for=aks.alert_for)


def prometheus_rule(aks: AksCluster) -> dict:
    return rules.prometheus_rule(gpu_alert_rules(aks), name="gpu-alerts", namespace=aks.monitoring_namespace,
                                 labels=dict(aks.rule_labels))


def rule_file(aks: AksCluster) -> str:
    """The same groups as a plain rules file (``promtool check rules``, or Prometheus without the operator)."""
    return rules.rule_file(gpu_alert_rules(aks))
