"""Azure ML documents round-trip through azure-ai-ml's own loaders (load_job, load_online_endpoint,
load_online_deployment: the SDK's marshmallow schemas), and match seed 001's documents."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from azulite.deploy.azureml import AzureMLOptions
from azulite.deploy.options import AksOptions
from azulite.deploy.render import render_spec, write_files
from azulite.errors import AzuliteError
from tests.deploy.conftest import EXAMPLES, seed
from tests.deploy.test_training import BASE

ml = pytest.importorskip("azure.ai.ml")


def render_to(path, out, **aml):
    files = render_spec(path, "azureml", AksOptions(), AzureMLOptions(**aml))
    return {p.name: p for p in write_files(out, files)}


def test_command_job_round_trips(tmp_path):
    files = render_to(EXAMPLES / "azureml" / "arr-coc" / "job.yaml", tmp_path / "out")
    job = ml.load_job(files["arr-coc.azureml.yml"])
    assert job.type == "command"
    assert job.distribution.type == "pytorch" and job.distribution.process_count_per_instance == 4
    assert job.resources.instance_count == 2 and job.resources.instance_type == "Standard_NC24rs_v3"
    assert job.compute == "gpu-cluster"
    assert job.environment == "AzureML-pytorch-2.2-cuda12.1@latest"  # the SDK drops the azureml: prefix
    assert job.inputs["vqa_data"].path == "azureml://datasets/vqav2"
    assert "${{inputs.vqa_data}}" in job.command


def test_spot_job_with_blob_outputs_round_trips(job_file, tmp_path):
    spec = {**BASE, "priority": "spot", "compute": "gpu-cluster", "environment_variables": {"X": "1"},
            "inputs": {"steps": 10, "data": {"type": "uri_folder", "path": "az://data/criteo"}}, "timeout": "2h"}
    files = render_to(job_file(spec), tmp_path / "out", datastore="ckptstore", storage_account="acct")
    job = ml.load_job(files["job.azureml.yml"])
    assert job.queue_settings.job_tier == "spot"
    assert job.outputs["checkpoints"].path == "azureml://datastores/ckptstore/paths/run1"
    assert job.inputs["data"].path == "https://acct.blob.core.windows.net/data/criteo"
    assert job.limits.timeout == 7200 and job.environment_variables == {"X": "1"}
    assert job.environment.image == "myregistry.azurecr.io/train:1"


def test_every_resources_field_of_azure_mls_reaches_the_document(job_file, tmp_path):
    """shm_size and properties were dropped from the rendered job; docker_args, locations and
    max_instance_count were refused as unknown fields of an Azure ML job."""
    resources = {**BASE["resources"], "shm_size": "16g", "properties": {"k": "v"}, "docker_args": "--ipc=host",
                 "locations": ["westus2"], "max_instance_count": 4}
    files = render_to(job_file({**BASE, "compute": "gpu-cluster", "resources": resources}), tmp_path / "out",
                      datastore="ckptstore")
    job = ml.load_job(files["job.azureml.yml"])
    r = job.resources
    assert (r.shm_size, r.properties, r.docker_args, r.locations, r.max_instance_count) == (
        "16g", {"k": "v"}, "--ipc=host", ["westus2"], 4)
    assert (r.instance_type, r.instance_count) == ("Standard_NC24rs_v3", 2)


def test_azure_ml_keys_of_the_spec_go_through_and_code_is_relative_to_the_file(job_file, tmp_path):
    """description, identity, services, queue_settings, limits and properties were accepted and dropped (a
    native spot request rendered as dedicated capacity); code was this machine's absolute path."""
    spec = {**BASE, "compute": "gpu-cluster", "description": "nightly", "identity": {"type": "managed"},
            "queue_settings": {"job_tier": "Spot"}, "limits": {"timeout": 3600}, "properties": {"team": "recsys"},
            "services": {"shell": {"type": "ssh", "nodes": "all"}}}
    out = tmp_path / "build" / "aml"
    files = {p.name: p for p in write_files(out, render_spec(job_file(spec), "azureml", AksOptions(),
                                                              AzureMLOptions(datastore="ckptstore"), out=out))}
    doc = yaml.safe_load(files["job.azureml.yml"].read_text())
    assert doc["code"] == "../../code"
    job = ml.load_job(files["job.azureml.yml"])
    assert job.description == "nightly" and job.identity.type == "managed_identity" and job.queue_settings.job_tier == "spot"
    assert job.limits.timeout == 3600 and job.properties["team"] == "recsys" and job.services["shell"].type == "ssh"
    assert str(job.code).endswith("code")


def test_load_job_rejects_a_broken_document(tmp_path):
    """The round trip can fail: the SDK's schema refuses what azure ML would."""
    files = render_to(EXAMPLES / "azureml" / "arr-coc" / "job.yaml", tmp_path / "out")
    doc = yaml.safe_load(files["arr-coc.azureml.yml"].read_text())
    doc["distribution"]["process_count_per_instance"] = "four"
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(Exception, match="process_count_per_instance"):
        ml.load_job(bad)


def rest(files: dict, name: str):
    """The endpoint and deployment as azure-ai-ml loads them and converts them for the service (what
    `ml_client.online_endpoints.begin_create_or_update` runs before sending: names, scale settings)."""
    ep = ml.load_online_endpoint(files[f"{name}-endpoint.yml"])
    dep = ml.load_online_deployment(files[f"{name}-deployment.yml"])
    ep._to_rest_online_endpoint("eastus")
    dep._to_rest_object("eastus")
    return ep, dep


def serving_file(tmp_path, **spec):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"name": "dens", "server": "triton", "model_repository": "az://models/dens",
                                 "instance_type": "Standard_NC4as_T4_v3", **spec}, sort_keys=False))
    return p


def test_triton_endpoint_reproduces_seed_001(tmp_path):
    out = tmp_path / "build" / "aml"
    files = {p.name: p for p in write_files(out, render_spec(EXAMPLES / "aks" / "triton-endpoint.yaml", "azureml",
                                                             AksOptions(), AzureMLOptions(), out=out))}
    ep, dep = rest(files, "triton-endpoint")
    s_ep, s_dep = seed("create-managed-endpoint.yaml"), seed("create-managed-deployment.yaml")
    assert ep.name == s_ep["name"] and ep.auth_mode == s_ep["auth_mode"]
    assert dep.name == s_dep["name"] and dep.endpoint_name == s_dep["endpoint_name"]
    assert dep.model.type == s_dep["model"]["type"] == "triton_model"
    assert str(dep.model.version) == str(s_dep["model"]["version"])
    assert dep.instance_type == s_dep["instance_type"] and dep.instance_count == s_dep["instance_count"]
    # the repository ships with the examples (it was ./models, which did not exist) and is written relative
    # to the document, as `az ml` resolves it (it was this machine's absolute path)
    doc = yaml.safe_load(files["triton-endpoint-deployment.yml"].read_text())
    assert doc["model"]["path"] == os.path.relpath(EXAMPLES / "model_repository", out)
    assert str(dep.model.path) == str(EXAMPLES / "model_repository")


def test_a_local_repository_that_is_not_there_is_refused(tmp_path):
    p = serving_file(tmp_path, model_repository="./models")
    with pytest.raises(AzuliteError) as e:
        render_to(p, tmp_path / "out")
    assert e.value.where == f"{p}:3 (model_repository)" and "does not exist" in e.value.message
    assert not (tmp_path / "out").exists()


def test_autoscaled_endpoint_from_blob(tmp_path):
    """It rendered scale_settings target_utilization, which azure-ai-ml refuses for a managed deployment:
    autoscaling is Azure Monitor's, rendered as its commands."""
    p = serving_file(tmp_path, autoscaling={"min_replicas": 1, "max_replicas": 4, "target_cpu_utilization": 60})
    files = render_to(p, tmp_path / "out", datastore="workspaceblobstore")
    _, dep = rest(files, "dens")
    assert dep.scale_settings is None and dep.instance_count == 1
    assert dep.model.path == "azureml://datastores/workspaceblobstore/paths/dens"
    script = files["dens-autoscale.sh"].read_text()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    commands = [shlex.split(c) for c in script.splitlines() if c.startswith("az monitor")]
    assert commands[0][:3] == ["az", "monitor", "autoscale"] and commands[0][3] == "create"
    create = dict(zip(commands[0][4::2], commands[0][5::2]))
    assert (create["--min-count"], create["--max-count"], create["--count"]) == ("1", "4", "1")
    conditions = [c[c.index("--condition") + 1] for c in commands[1:]]
    assert conditions == ["CpuUtilizationPercentage > 60 avg 5m", "CpuUtilizationPercentage < 30 avg 5m"]
    assert "az ml online-deployment show --endpoint-name dens --name blue" in script
    # what was rendered before: the SDK refuses it before sending anything
    doc = yaml.safe_load(files["dens-deployment.yml"].read_text())
    doc["scale_settings"] = {"type": "target_utilization", "min_instances": 1, "max_instances": 4}
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(Exception, match="DefaultScaleSettings only"):
        ml.load_online_deployment(bad)._to_rest_object("eastus")


def test_an_endpoint_name_azure_ml_refuses_is_refused_with_the_fix(tmp_path):
    """A 33-63 character name passed the Kubernetes rule and failed only when azure-ai-ml converted it."""
    name = "gpu-inference-endpoint-for-recsys-prod"  # 38: a Service's name, not an endpoint's
    p = serving_file(tmp_path, name=name, model_repository="azureml:dens:3")
    with pytest.raises(AzuliteError) as e:
        render_to(p, tmp_path / "out")
    assert e.value.where == f"{p}:1 (name)" and "3 to 32" in e.value.message
    assert e.value.fix.endswith("--set name=gpu-inference-endpoint-for")
    fixed = render_spec(p, "azureml", AksOptions(), AzureMLOptions(), overrides=["name=gpu-inference-endpoint-for"])
    out = write_files(tmp_path / "fixed", fixed)
    rest({f.name: f for f in out}, "gpu-inference-endpoint-for")
    # the SDK's own check, on what the rule refuses: the same verdict
    doc = {"$schema": "x", "name": name, "auth_mode": "key"}
    (tmp_path / "ep.yml").write_text(yaml.safe_dump(doc))
    with pytest.raises(Exception, match="at least 3 and at most 32"):
        ml.load_online_endpoint(tmp_path / "ep.yml")._to_rest_online_endpoint("eastus")


@pytest.mark.parametrize("change, where", [
    ({"priority": "spot"}, "priority"),
    ({"args": ["--log-verbose=1"]}, "args"),
    ({"server": "azulite"}, "server"),
    ({"image": "nvcr.io/nvidia/tritonserver:24.01-py3"}, "image"),
    ({"node_pool": "gpunp"}, "node_pool"),
    ({"resources": {"cpu": "2", "memory": "8Gi"}}, "resources.cpu"),
    ({"resources": {"gpus": 2}}, "resources.gpus"),
    ({"args": ["--log-verbose=1"], "priority": "spot"}, "args, priority"),
])
def test_what_a_managed_deployment_has_no_place_for_is_refused_not_dropped(tmp_path, change, where):
    """priority: spot and args vanished; server: azulite became Azure's Triton without a word."""
    p = serving_file(tmp_path, **change)
    with pytest.raises(AzuliteError) as e:
        render_to(p, tmp_path / "out", datastore="ds")
    assert e.value.where.endswith(f"({where})") and "has no place for" in e.value.message, str(e.value)
    assert "--target aks" in e.value.fix


@pytest.mark.parametrize("repo", ["as://acct/models/dens", "s3://bucket/dens", "https://acct.blob.core.windows.net/m/d"])
def test_a_model_path_azure_ml_cannot_take_is_refused(tmp_path, repo):
    with pytest.raises(AzuliteError) as e:
        render_to(serving_file(tmp_path, model_repository=repo), tmp_path / "out")
    assert e.value.where.endswith("(model_repository)") and "Azure ML cannot take" in e.value.message
    assert "--datastore" in e.value.fix


@pytest.mark.parametrize("repo, model", [
    ("azureml://models/dens", "azureml:dens:1"), ("azureml://models/dens/versions/4", "azureml:dens:4"),
    ("azureml:dens:2", "azureml:dens:2"),
    ("azureml://registries/azureml/models/dens/versions/3", "azureml://registries/azureml/models/dens/versions/3"),
])
def test_registered_models_are_referenced(tmp_path, repo, model):
    files = render_to(serving_file(tmp_path, model_repository=repo), tmp_path / "out")
    assert yaml.safe_load(files["dens-deployment.yml"].read_text())["model"] == model
    rest(files, "dens")


def test_no_vm_size_is_said_in_the_serving_specs_words(tmp_path):
    """It said training's "a cluster target needs one to size GPUs, /dev/shm" and "set resources.instance_type"."""
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"name": "dens", "server": "triton", "model_repository": "azureml:dens:1"}))
    with pytest.raises(AzuliteError) as e:
        render_to(p, tmp_path / "out")
    assert e.value.where == f"{p} (instance_type)"
    assert e.value.message == "no VM size: an Azure ML online deployment runs on instances of one VM size"
    assert e.value.fix.startswith("set instance_type, e.g. Standard_NC4as_T4_v3")


@pytest.mark.parametrize("change, where", [
    ({"compute": None}, "compute"),
    ({"environment": None}, "environment"),
    ({"distribution": {"type": "pytorch", "process_count_per_instance": 5}}, "distribution.process_count_per_instance"),
    ({"resources": {"instance_type": "ml.p3.2xlarge", "instance_count": 1}}, "resources.instance_type"),
])
def test_bad_azureml_jobs(job_file, tmp_path, change, where):
    spec = {**BASE, "compute": "gpu-cluster", **change}
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(AzuliteError) as e:
        render_to(job_file(spec), tmp_path / "out", datastore="d")
    assert e.value.where == where, str(e.value)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("dist, check", [
    ({"type": "tensorflow", "worker_count": 2, "parameter_server_count": 1},
     lambda d: d.type == "tensorflow" and d.worker_count == 2 and d.parameter_server_count == 1),
    ({"type": "mpi", "process_count_per_instance": 2}, lambda d: d.type == "mpi" and d.process_count_per_instance == 2),
])
def test_tensorflow_and_mpi_jobs_round_trip(job_file, tmp_path, dist, check):
    files = render_to(job_file({**BASE, "compute": "gpu-cluster", "distribution": dist}), tmp_path / "out", datastore="d")
    job = ml.load_job(files["job.azureml.yml"])
    assert check(job.distribution)


@pytest.mark.parametrize("extra, where, sets", [
    # each was dropped from the rendered document without a word, while `job submit --backend azureml` refused
    # max_restarts (and took elastic the same silent way)
    ({"max_restarts": 2}, "max_restarts", "--set max_restarts=0"),
    ({"elastic": {"min_nodes": 1}}, "elastic", "--set elastic=null"),
    ({"max_restarts": 2, "elastic": {"min_nodes": 1}}, "max_restarts, elastic", "--set max_restarts=0 --set elastic=null"),
])
def test_fields_azure_ml_has_no_place_for_are_refused_not_dropped(job_file, tmp_path, extra, where, sets):
    path = job_file({**BASE, "compute": "gpu-cluster", **extra})
    with pytest.raises(AzuliteError) as e:
        render_spec(path, "azureml", AksOptions(), AzureMLOptions(datastore="ckptstore"))
    assert e.value.where == where and e.value.message.startswith("an Azure ML command job has no place for ")
    assert sets in e.value.fix
    fixed = render_spec(path, "azureml", AksOptions(), AzureMLOptions(datastore="ckptstore"),
                        overrides=sets.replace("--set ", "").split())  # as the fix says
    assert list(fixed) == ["job.azureml.yml"]


SWEEPS = Path(__file__).resolve().parents[1] / "spec" / "data" / "azureml-examples"


def test_a_public_sweep_job_renders_as_an_azure_ml_sweep_job_and_round_trips(tmp_path):
    """`deploy render sweep.yaml --target azureml` said "this is a sweep job ... submit it with azulite job submit"."""
    out = tmp_path / "out"
    files = {p.name: p for p in write_files(out, render_spec(
        SWEEPS / "lightgbm" / "iris" / "job-sweep.yml", "azureml", AksOptions(), AzureMLOptions(),
        overrides=["trial.resources.instance_type=Standard_D4s_v3"], out=out))}
    job = ml.load_job(files["iris.azureml.yml"])
    assert job.type == "sweep" and job.compute == "cpu-cluster"
    assert job.sampling_algorithm.type == "random"
    assert job.search_space["learning_rate"].min_value == 0.01 and job.search_space["learning_rate"].max_value == 0.9
    assert list(job.search_space["boosting"].values) == ["gbdt", "dart"]
    assert (job.objective.goal, job.objective.primary_metric) == ("minimize", "test-multi_logloss")
    assert (job.limits.max_total_trials, job.limits.max_concurrent_trials, job.limits.timeout) == (20, 10, 7200)
    assert "--learning-rate ${{search_space.learning_rate}}" in job.trial.command
    assert job.trial.environment == "AzureML-lightgbm-3.3@latest" and str(job.trial.code).endswith("src")
    assert job.inputs["iris_csv"].path == "https://azuremlexamples.blob.core.windows.net/datasets/iris.csv"
    assert job.trial.resources.instance_type == "Standard_D4s_v3"


def test_a_distributed_sweep_with_early_termination_round_trips(job_file, tmp_path):
    job_file({})  # the code folder
    trial = {**{k: v for k, v in BASE.items() if k not in ("name", "inputs", "outputs")}, "code": "code",
             "command": "python train.py --lr ${{search_space.lr}} --ckpt ${{outputs.checkpoints}}", "priority": "spot"}
    sweep = {"type": "sweep", "name": "ddp-sweep", "compute": "gpu-cluster", "trial": trial, "outputs": BASE["outputs"],
             "sampling_algorithm": {"type": "random", "seed": 7},
             "search_space": {"lr": {"type": "loguniform", "min_value": -6, "max_value": -1},
                              "b": {"type": "qnormal", "mu": 8, "sigma": 2, "q": 2}},
             "objective": {"goal": "minimize", "primary_metric": "loss"},
             "limits": {"max_total_trials": 8, "max_concurrent_trials": 2, "trial_timeout": "30m"},
             "early_termination": {"type": "bandit", "slack_factor": 0.1, "delay_evaluation": 2}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    files = render_to(path, tmp_path / "out", datastore="ckptstore")
    job = ml.load_job(files["ddp-sweep.azureml.yml"])
    assert job.trial.distribution.type == "pytorch" and job.trial.distribution.process_count_per_instance == 4
    assert job.trial.resources.instance_count == 2 and job.limits.trial_timeout == 1800
    assert job.early_termination.type == "bandit" and job.early_termination.slack_factor == 0.1
    assert job.early_termination.delay_evaluation == 2 and job.sampling_algorithm.seed == 7
    assert job.search_space["b"].q == 2 and job.search_space["lr"].type == "loguniform"
    assert job.queue_settings.job_tier == "spot"
    assert job.outputs["checkpoints"].path == "azureml://datastores/ckptstore/paths/run1"


def test_a_sweep_is_refused_for_aks_and_its_trial_errors_name_the_trial(job_file, tmp_path):
    path = SWEEPS / "lightgbm" / "iris" / "job-sweep.yml"
    with pytest.raises(AzuliteError) as e:
        render_spec(path, "aks", AksOptions(), AzureMLOptions())
    assert "--target aks renders command jobs and serving specs; this is a sweep job" in e.value.message
    assert "--target azureml" in e.value.fix
    with pytest.raises(AzuliteError) as e:
        render_spec(path, "azureml", AksOptions(), AzureMLOptions())
    assert e.value.where == "trial.resources.instance_type" and "set trial.resources.instance_type" in e.value.fix
    with pytest.raises(AzuliteError) as e:
        render_spec(path, "azureml", AksOptions(), AzureMLOptions(), overrides=[
            "trial.resources.instance_type=Standard_D4s_v3", "trial.max_restarts=1", "trial.distribution.type=pytorch"])
    assert e.value.where == "trial.max_restarts" and "--set trial.max_restarts=0" in e.value.fix
