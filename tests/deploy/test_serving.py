"""Serving on AKS: Deployment + Service + HPA validated strictly (1.30, 1.37) and compared with seed 001's
arr-coc Triton Deployment (§5.2) and GPU workload + HPA (§4.2)."""

from __future__ import annotations

import pytest
import yaml

from azulite.deploy.azureml import AzureMLOptions
from azulite.deploy.options import AksOptions
from azulite.deploy.render import render_spec
from azulite.errors import AzuliteError
from tests.deploy.test_training import assert_valid, the
from tests.deploy.conftest import EXAMPLES, docs, quantities, seed

AKS = EXAMPLES / "aks"


def render(path) -> list[dict]:
    files = render_spec(path, "aks", AksOptions(), AzureMLOptions())
    return [d for text in files.values() for d in docs(text)]


def test_arr_coc_triton_reproduces_seed_001():
    objects = render(AKS / "arr-coc-triton.yaml")
    assert_valid(objects)
    dep, s = the(objects, "Deployment"), seed("arr-coc-triton.yaml")
    assert dep["metadata"]["name"] == s["metadata"]["name"]
    assert dep["spec"]["replicas"] == s["spec"]["replicas"]
    pod, spod = dep["spec"]["template"]["spec"], s["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == spod["nodeSelector"]
    c, sc = pod["containers"][0], spod["containers"][0]
    for k in ("name", "image", "command", "args"):
        assert c[k] == sc[k], k
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
    assert quantities(pod["containers"][0]["resources"]) == quantities(spod["containers"][0]["resources"])
    # `azulite serve` reads the az:// repository itself
    assert pod["containers"][0]["command"] == ["azulite", "serve"]
    assert "az://models/gpu-workload" in pod["containers"][0]["args"]
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
])
def test_bad_serving_specs(tmp_path, change, where):
    data = yaml.safe_load((AKS / "arr-coc-triton.yaml").read_text())
    data.update(change)
    data = {k: v for k, v in data.items() if v is not None}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(AzuliteError) as e:
        render(p)
    assert where in str(e.value.where), str(e.value)
    assert e.value.fix
