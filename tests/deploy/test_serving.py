"""Serving on AKS: Deployment + Service + HPA validated strictly (1.30, 1.37) and compared with seed 001's
arr-coc Triton Deployment (§5.2) and GPU workload + HPA (§4.2)."""

from __future__ import annotations

import pytest
import yaml

from azulite.deploy.azureml import AzureMLOptions
from azulite.deploy.options import AksOptions
from azulite.deploy.render import render_spec
from azulite.errors import AzuliteError
from pathlib import Path

from azulite.deploy.training import GPU_TAINT
from tests.deploy.test_training import assert_valid, the
from tests.deploy.conftest import EXAMPLES, docs, quantities, seed

AKS = EXAMPLES / "aks"


#: what examples/aks/arr-coc-triton.yaml's render command passes (Triton reads Blob with the account's key)
TRITON_BLOB = {"storage_account": "mystorageaccount", "storage_key_secret": "models-storage"}


def render(path, overrides=(), **opts) -> list[dict]:
    files = render_spec(path, "aks", AksOptions(**opts), AzureMLOptions(), overrides)
    return [d for text in files.values() for d in docs(text)]


def spec_file(tmp_path, base="arr-coc-triton.yaml", **change) -> Path:
    data = yaml.safe_load((AKS / base).read_text())
    data.update(change)
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}, sort_keys=False))
    return p


def test_arr_coc_triton_reproduces_seed_001():
    objects = render(AKS / "arr-coc-triton.yaml", **TRITON_BLOB)
    assert_valid(objects)
    dep, s = the(objects, "Deployment"), seed("arr-coc-triton.yaml")
    assert dep["metadata"]["name"] == s["metadata"]["name"]
    assert dep["spec"]["replicas"] == s["spec"]["replicas"]
    pod, spod = dep["spec"]["template"]["spec"], s["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == spod["nodeSelector"]
    c, sc = pod["containers"][0], spod["containers"][0]
    for k in ("name", "image", "command"):
        assert c[k] == sc[k], k
    # the seed's azureml://models/arr-coc-ensemble is an Azure ML asset Triton cannot read: the example serves
    # the Blob folder, as Triton reads Azure Storage, with the account key from the Secret
    assert sc["args"] == ["--model-repository=azureml://models/arr-coc-ensemble", "--log-verbose=1"]
    assert c["args"] == ["--model-repository=as://mystorageaccount/models/arr-coc-ensemble", "--log-verbose=1"]
    assert {"name": "AZURE_STORAGE_KEY", "valueFrom": {"secretKeyRef": {
        "name": "models-storage", "key": "azurestorageaccountkey"}}} in c["env"]
    assert quantities(c["resources"]) == quantities(sc["resources"])
    assert [p["containerPort"] for p in sc["ports"]] == [p["containerPort"] for p in c["ports"]][:2]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    svc = the(objects, "Service")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_gpu_workload_and_hpa_reproduce_seed_001():
    objects = render(AKS / "gpu-workload.yaml")
    assert_valid(objects)
    dep, hpa = the(objects, "Deployment"), the(objects, "HorizontalPodAutoscaler")
    s_dep, s_hpa = seed("gpu-workload.yaml"), seed("gpu-inference-hpa.yaml")
    assert dep["metadata"]["name"] == s_dep["metadata"]["name"] == s_hpa["spec"]["scaleTargetRef"]["name"]
    assert dep["spec"]["replicas"] == s_dep["spec"]["replicas"]
    pod, spod = dep["spec"]["template"]["spec"], s_dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == spod["nodeSelector"]
    assert pod["containers"][0]["image"] == spod["containers"][0]["image"]
    ours, theirs = quantities(pod["containers"][0]["resources"]), quantities(spod["containers"][0]["resources"])
    # the seed requests 4 CPUs of a 4-vCPU node, which AKS reserves 140m of: never schedulable (refused below)
    assert (theirs["requests"].pop("cpu"), theirs["limits"].pop("cpu")) == ("4", "8")
    assert (ours["requests"].pop("cpu"), ours["limits"].pop("cpu")) == ("3", "4")
    assert ours == theirs
    with pytest.raises(AzuliteError) as e:
        render(AKS / "gpu-workload.yaml", ["resources.cpu_request=4"])
    assert e.value.where == "--set resources.cpu_request=4 (resources.cpu_request)"
    assert "can allocate 3.86 (4 vCPUs less AKS's 0.14 reserved)" in e.value.message
    # `azulite serve` reads the az:// repository itself, with workload identity
    assert pod["containers"][0]["command"] == ["azulite", "serve"]
    assert "az://models/gpu-workload" in pod["containers"][0]["args"]
    assert pod["serviceAccountName"] == "azulite"
    assert dep["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    for k in ("scaleTargetRef", "minReplicas", "maxReplicas", "metrics"):
        assert hpa["spec"][k] == s_hpa["spec"][k], k


@pytest.mark.parametrize("change, where", [
    ({"instance_type": "Standard_NC4as_T4", "resources": {"gpus": 1}}, "instance_type"),
    ({"resources": {"gpus": 2}}, "resources.gpus"),
    ({"server": "azulite", "image": None}, "image"),
    ({"autoscaling": {"min_replicas": 4, "max_replicas": 2}}, "autoscaling"),
    ({"replicaz": 2}, "replicaz"),
    ({"name": "2nd-model"}, "name"),  # a Service's name starts with a letter (DNS-1035)
    ({"name": "Model"}, "name"),
    # quantities the API server would refuse at apply time were rendered
    ({"resources": {"memory": "lots"}}, "resources.memory"),
    ({"resources": {"cpu": "banana"}}, "resources.cpu"),
    ({"resources": {"memory": "16GB"}}, "resources.memory"),
    ({"resources": {"cpu": "-1"}}, "resources.cpu"),
    ({"resources": {"cpu": "2", "cpu_request": "3"}}, "resources"),
    # more than one node of the VM size can give a replica
    ({"resources": {"gpus": 1, "memory": "27Gi"}}, "resources.memory"),
    ({"resources": {"gpus": 1, "cpu_request": "3900m"}}, "resources.cpu_request"),
])
def test_bad_serving_specs(tmp_path, change, where):
    with pytest.raises(AzuliteError) as e:
        render(spec_file(tmp_path, **change), **TRITON_BLOB)
    assert where in str(e.value.where), str(e.value)
    assert e.value.fix
    assert str(e.value.where).startswith(str(tmp_path / "s.yaml"))  # said in the file, at its line when there


@pytest.mark.parametrize("resources", [{"cpu": "500m", "memory": "512Mi"}, {"cpu": "1.5", "memory": "1e9"},
                                       {"cpu": 2, "cpu_request": "1500m", "memory": "25Gi", "memory_request": "20G"},
                                       {"cpu": "3.86"}])
def test_good_quantities_render_and_validate(tmp_path, resources):
    objects = render(spec_file(tmp_path, resources={"gpus": 1, **resources}), **TRITON_BLOB)
    assert_valid(objects)


def test_a_node_pool_is_tolerated_whether_the_replica_asks_for_a_gpu_or_not(tmp_path):
    """gpus: 0 on the GPU pool selected the pool but did not tolerate its sku=gpu taint: Pending forever."""
    pod = lambda objs: the(objs, "Deployment")["spec"]["template"]["spec"]  # noqa: E731
    p = pod(render(spec_file(tmp_path, resources={"gpus": 0}), **TRITON_BLOB))
    assert p["nodeSelector"] == {"agentpool": "gpunp"} and GPU_TAINT in p["tolerations"]
    assert "nvidia.com/gpu" not in p["containers"][0].get("resources", {}).get("limits", {})
    # a VM size without a pool: the pod lands on that size, the one its requests were checked against
    p = pod(render(spec_file(tmp_path, node_pool=None, resources={"gpus": 1}), **TRITON_BLOB))
    assert p["nodeSelector"] == {"node.kubernetes.io/instance-type": "Standard_NC4as_T4_v3"}
    assert GPU_TAINT in p["tolerations"]


def test_serving_pods_run_without_privileges_and_wait_for_slow_model_loads(tmp_path):
    objects = render(AKS / "arr-coc-triton.yaml", **TRITON_BLOB)
    c = the(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    ctx = c["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    # Triton's image starts as root; its triton-server user (uid 1000) is made to run it
    assert (ctx["runAsNonRoot"], ctx["runAsUser"], ctx["runAsGroup"]) == (True, 1000, 1000)
    start = c["startupProbe"]
    assert start["httpGet"]["path"] == "/v2/health/ready" and start["periodSeconds"] * start["failureThreshold"] >= 600
    assert "initialDelaySeconds" not in c["livenessProbe"]  # it starts after the startup probe succeeded
    # another image's user is its own: runAsNonRoot on an image that runs as root keeps it from starting
    c = the(render(AKS / "gpu-workload.yaml"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "runAsNonRoot" not in c["securityContext"] and c["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("opts, flag", [({"flavor": "pytorchjob"}, "--flavor"), ({"pvc": "claim"}, "--pvc"),
                                        ({"code_uri": "az://code/x"}, "--code-uri"),
                                        ({"termination_grace_s": 30}, "--termination-grace")])
def test_job_options_are_refused_for_a_serving_spec(opts, flag):
    """--flavor pytorchjob (and the other job-only options) rendered the same Deployment without a word."""
    with pytest.raises(AzuliteError) as e:
        render(AKS / "gpu-workload.yaml", **opts)
    assert e.value.where == flag and "this is a serving spec" in e.value.message


def test_image_option_overrides_the_serving_specs_image():
    c = the(render(AKS / "gpu-workload.yaml", image="myacr.azurecr.io/serve:2"), "Deployment")
    assert c["spec"]["template"]["spec"]["containers"][0]["image"] == "myacr.azurecr.io/serve:2"
