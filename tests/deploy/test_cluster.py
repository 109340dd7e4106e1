"""``cluster render``: node pool commands from the spec and the catalog, the device plugin and DCGM exporter
validated strictly, the GPU alerts checked and unit-tested with promtool (Prometheus' own tool)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from azulite.deploy.cluster import AksCluster
from azulite.deploy.render import render_cluster, write_files
from azulite.errors import AzuliteError
from tests.deploy import schemas
from tests.deploy.conftest import EXAMPLES, docs, seed
from tests.deploy.test_training import assert_valid, the

CLUSTER = EXAMPLES / "aks" / "cluster.yaml"
AKS = AksCluster(resource_group="torchrec-rg")
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (Debian prometheus; scripts/install.sh --dev)")


@pytest.fixture(scope="module")
def files():
    return render_cluster(CLUSTER, AKS)


def cluster_file(tmp_path, pools: list[dict], name: str | None = "gpu-aks") -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({**({"name": name} if name else {}), "pools": pools}, sort_keys=False))
    return p


def _commands(script: str) -> list[list[str]]:
    return [shlex.split(c) for c in script.replace("\\\n", " ").splitlines() if c.startswith("az ")]


def test_node_pool_commands(files):
    add = [c for c in _commands(files["nodepools.sh"]) if c[:4] == ["az", "aks", "nodepool", "add"]]
    assert len(add) == 3
    flags = [dict(zip(c[4::1], c[5::1])) for c in add]
    gpu, spot, t4 = flags
    # seed 001 §2.2 / seed 002 step 2: tainted, labelled, autoscaled GPU pool
    assert gpu["--node-vm-size"] == "Standard_ND96asr_v4" and gpu["--node-taints"] == "sku=gpu:NoSchedule"
    assert gpu["--resource-group"] == "torchrec-rg" and gpu["--cluster-name"] == "torchrec-aks" and gpu["--node-count"] == "2"
    assert gpu["--labels"] == "sku=gpu" and gpu["--min-count"] == "1" and gpu["--max-count"] == "4"
    assert "--enable-cluster-autoscaler" in add[0]
    # seed 001 §2.6: a spot pool that scales to zero, evicted VMs deleted, up to the on-demand price
    assert spot["--priority"] == "Spot" and spot["--eviction-policy"] == "Delete" and spot["--spot-max-price"] == "-1"
    assert spot["--min-count"] == "0" and "kubernetes.azure.com/scalesetpriority=spot:NoSchedule" in spot["--node-taints"]
    assert t4["--node-vm-size"] == "Standard_NC4as_T4_v3"
    (update,) = [c for c in _commands(files["nodepools.sh"]) if c[:3] == ["az", "aks", "update"]]
    assert "scale-down-unneeded-time=10m" in update and "scale-down-delay-after-add=10m" in update
    assert subprocess.run(["bash", "-n"], input=files["nodepools.sh"], text=True).returncode == 0


def test_device_plugin_reproduces_seed_001_and_objects_validate(files):
    plugin = docs(files["nvidia-device-plugin.yaml"])
    dcgm = docs(files["dcgm-exporter.yaml"])
    assert_valid(plugin + dcgm)
    ds, s = the(plugin, "DaemonSet"), seed("nvidia-device-plugin-ds.yaml")
    assert ds["metadata"] == s["metadata"]
    assert ds["spec"]["selector"] == s["spec"]["selector"]
    pod, spod = ds["spec"]["template"]["spec"], s["spec"]["template"]["spec"]
    assert pod["containers"] == spod["containers"] and pod["volumes"] == spod["volumes"]
    assert pod["priorityClassName"] == spod["priorityClassName"]
    for t in spod["tolerations"]:
        assert t in pod["tolerations"]
    assert the(dcgm, "Service")["spec"]["ports"][0]["port"] == 9400


def _placement(ds: dict) -> tuple[list[str], list[dict]]:
    pod = ds["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (expr,) = term["matchExpressions"]
    assert (expr["key"], expr["operator"]) == ("agentpool", "In")  # the label AKS puts on every node: its pool
    return expr["values"], pod["tolerations"]


def test_gpu_daemonsets_run_on_the_gpu_pools_only(files):
    """The DCGM exporter had tolerations and no node selection: it landed on CPU nodes and crash-looped."""
    for name in ("nvidia-device-plugin.yaml", "dcgm-exporter.yaml"):
        pools, tolerations = _placement(the(docs(files[name]), "DaemonSet"))
        assert pools == ["gpupool", "gpuspot", "gpunp"], name  # examples/aks/cluster.yaml's GPU pools, no other
        assert {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in tolerations
        assert {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
                "effect": "NoSchedule"} in tolerations


def test_gpu_daemonsets_tolerate_the_taints_a_pool_sets_itself(tmp_path):
    """A pool with its own taint (not sku=gpu) got no device plugin: no GPU was ever advertised on it."""
    p = cluster_file(tmp_path, [
        {"name": "gpunp", "sku": "Standard_NC4as_T4_v3", "max_nodes": 2, "labels": {"sku": "cpu"},
         "taints": ["nvidia.com/gpu=present:NoSchedule", "dedicated:NoExecute"]},
        {"name": "cpu", "sku": "Standard_D4s_v3", "max_nodes": 2}])
    files = render_cluster(p, AKS)
    for name in ("nvidia-device-plugin.yaml", "dcgm-exporter.yaml"):
        objects = docs(files[name])
        assert_valid(objects)
        pools, tolerations = _placement(the(objects, "DaemonSet"))
        assert pools == ["gpunp"]
        assert tolerations == [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present", "effect": "NoSchedule"},
                               {"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}]


def test_a_cluster_without_gpu_pools_gets_only_its_node_pools(tmp_path):
    files = render_cluster(cluster_file(tmp_path, [{"name": "cpu", "sku": "Standard_D4s_v3", "max_nodes": 3}]), AKS)
    assert list(files) == ["nodepools.sh"]


def test_prometheus_rule_labels_for_the_operators_rule_selector(tmp_path):
    """The rule had `labels: {}`: kube-prometheus-stack's default ruleSelector (release: <release>) skipped it."""
    aks = AksCluster(resource_group="rg", rule_labels=(("release", "kube-prometheus-stack"),))
    (rule,) = docs(render_cluster(CLUSTER, aks)["gpu-alerts.yaml"])
    assert_valid([rule])
    assert rule["metadata"]["labels"] == {"release": "kube-prometheus-stack"}
    with pytest.raises(AzuliteError) as e:
        render_cluster(CLUSTER, AksCluster(resource_group="rg", rule_labels=(("a b", "x"),)))
    assert "not a Kubernetes label key" in e.value.message


def test_prometheus_rule_matches_seed_001(files):
    (rule,) = docs(files["gpu-alerts.yaml"])
    assert_valid([rule])  # against the prometheus-operator CRD
    broken = {**rule, "spec": {"groups": [{"rules": [{"alert": "X", "for": "2 minutes"}]}]}}
    assert len(schemas.errors(broken, "1.37")) == 3  # no group name, no expr, a bad duration
    s = seed("gpu-alerts.yaml")
    # the one renderer (azulite.observe.rules) always writes `labels` (here empty); the rest is the seed's
    assert (rule["apiVersion"], rule["kind"]) == (s["apiVersion"], s["kind"])
    assert rule["metadata"] == {**s["metadata"], "labels": {}}
    ours = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    for r in s["spec"]["groups"][0]["rules"]:
        assert ours[r["alert"]] == r
    assert yaml.safe_load(files["gpu-alerts.rules.yml"])["groups"] == rule["spec"]["groups"]


@needs_promtool
def test_promtool_checks_the_rules_and_refuses_a_broken_one(files, tmp_path):
    write_files(tmp_path, files)
    ok = subprocess.run([promtool, "check", "rules", str(tmp_path / "gpu-alerts.rules.yml")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = yaml.safe_load(files["gpu-alerts.rules.yml"])
    broken["groups"][0]["rules"][0]["expr"] = "DCGM_FI_DEV_FB_FREE <"
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(broken))
    bad = subprocess.run([promtool, "check", "rules", str(tmp_path / "broken.yml")], capture_output=True, text=True)
    assert bad.returncode != 0


@needs_promtool
def test_promtool_unit_tests_the_alerts(files, tmp_path):
    write_files(tmp_path, files)
    tests = {
        "rule_files": ["gpu-alerts.rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": 'DCGM_FI_DEV_FB_FREE{gpu="0",Hostname="n1"}', "values": "500x10"},
                {"series": 'DCGM_FI_DEV_FB_FREE{gpu="1",Hostname="n1"}', "values": "4000x10"},
                {"series": 'DCGM_FI_DEV_GPU_TEMP{gpu="0",Hostname="n1"}', "values": "70x5 90x10"},
                {"series": 'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n1"}', "values": "0x60"},
                {"series": 'DCGM_FI_DEV_GPU_UTIL{gpu="1",Hostname="n1"}', "values": "95x60"},
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "GPUMemoryExhausted", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "GPUMemoryExhausted", "exp_alerts": [{
                    "exp_labels": {"severity": "critical", "gpu": "0", "Hostname": "n1"},
                    "exp_annotations": {"summary": "GPU 0 memory exhausted", "description": "Only 500MB free GPU memory"}}]},
                {"eval_time": "9m", "alertname": "GPUTemperatureHigh", "exp_alerts": []},
                {"eval_time": "12m", "alertname": "GPUTemperatureHigh", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "gpu": "0", "Hostname": "n1"},
                    "exp_annotations": {"summary": "GPU 0 on n1 runs hot",
                                        "description": "90 C for 5 minutes (over 85 C): clocks will be throttled"}}]},
                {"eval_time": "20m", "alertname": "GPUIdle", "exp_alerts": []},
                {"eval_time": "45m", "alertname": "GPUIdle", "exp_alerts": [{
                    "exp_labels": {"severity": "info", "gpu": "0", "Hostname": "n1"},
                    "exp_annotations": {"summary": "GPU 0 idle for 30 minutes",
                                        "description": "Utilisation 0%: a node paid for and not used"}}]},
            ],
        }],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    run = subprocess.run([promtool, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    # the same tests fail when the threshold moves: the unit test can fail
    write_files(tmp_path, render_cluster(CLUSTER, AksCluster(resource_group="rg", gpu_memory_free_mb=100)))
    run = subprocess.run([promtool, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode != 0 and "GPUMemoryExhausted" in run.stdout + run.stderr


@pytest.mark.parametrize("change, where", [
    ({"sku": "Standard_ND96asr"}, "pools[0].sku"),
    ({"min_nodes": 5}, "pools"),
    ({"name": "gpu-pool-for-training"}, "pools[0].name"),
    ({"sku": "ml.p3.2xlarge"}, "pools[0].sku"),
    # each was rendered into nodepools.sh, to fail at `az` after the pools before it were made
    ({"labels": {"a b": "x;y $(id)"}}, "pools[0].labels"),
    ({"labels": {"team": "x;y"}}, "pools[0].labels"),
    ({"taints": ["bad key=x:NoSchedule"]}, "pools[0].taints"),
    ({"taints": ["k=v:Sometimes"]}, "pools[0].taints"),
    ({"max_nodes": 5000}, "pools[0].max_nodes"),  # an AKS pool holds at most 1000 nodes
])
def test_bad_cluster_specs(tmp_path, change, where):
    data = yaml.safe_load(CLUSTER.read_text())
    data["pools"][0].update(change)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(AzuliteError) as e:
        render_cluster(p, AKS)
    assert where in str(e.value.where), str(e.value)
    assert str(e.value.where).startswith(f"{p}:")  # at its line
    assert e.value.fix


def test_a_spec_without_a_name_names_no_cluster(tmp_path):
    """It rendered `az aks nodepool add --cluster-name cluster`: a cluster nobody named."""
    p = cluster_file(tmp_path, [{"name": "cpu", "sku": "Standard_D4s_v3"}], name=None)
    with pytest.raises(AzuliteError) as e:
        render_cluster(p, AKS)
    assert e.value.where == f"{p} (name)" and "--cluster-name" in e.value.fix
    assert "--cluster-name mine " in render_cluster(p, AksCluster(resource_group="rg", cluster_name="mine"))["nodepools.sh"]


@pytest.mark.parametrize("spec_name, flag, where", [("bad name!", None, "name"), ("torchrec-aks", "x y", "--cluster-name"),
                                                    ("-lead", None, "name")])
def test_an_aks_cluster_name_az_would_refuse_is_an_error(tmp_path, spec_name, flag, where):
    # it was rendered (quoted) into nodepools.sh, to fail only when `az` ran it
    data = yaml.safe_load(CLUSTER.read_text())
    data["name"] = spec_name
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(AzuliteError) as e:
        render_cluster(p, AksCluster(resource_group="rg", cluster_name=flag))
    assert e.value.where == (where if flag else f"{p}:4 ({where})") and "is not an AKS cluster name" in e.value.message
    assert "--cluster-name gpu_aks-2 " in render_cluster(p, AksCluster(resource_group="rg", cluster_name="gpu_aks-2"))["nodepools.sh"]
