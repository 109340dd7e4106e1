"""Training jobs for AKS: the Indexed Job + Service, the PyTorchJob and (tensorflow jobs) the TFJob, validated
offline (strict Kubernetes 1.30 and 1.37 schemas; the training-operator CRDs and admission rules), compared
with seed 002's manifests."""

from __future__ import annotations

import kubernetes_validate
import pytest

from azulite.deploy.options import AksOptions
from azulite.deploy.image import curated_image
from azulite.deploy import pod_entry
from azulite.deploy.training import k8s_name
from azulite.deploy.render import render_spec
from azulite.deploy.azureml import AzureMLOptions
from azulite.errors import AzuliteError, DeployError, UnknownSku
from tests.deploy import schemas
from tests.deploy.conftest import EXAMPLES, docs, quantities, seed

TORCHREC = EXAMPLES / "aks" / "torchrec" / "job.yaml"
ENTRY = "/azulite/pod_entry.py"
BASE = {
    "name": "job",
    "command": "python train.py --steps ${{inputs.steps}} --ckpt ${{outputs.checkpoints}}",
    "inputs": {"steps": 10},
    "environment": {"image": "myregistry.azurecr.io/train:1"},
    "resources": {"instance_type": "Standard_NC24rs_v3", "instance_count": 2},
    "distribution": {"type": "pytorch", "process_count_per_instance": 4},
    "outputs": {"checkpoints": {"path": "az://ckpt/run1"}},
}


def render(path, flavor="indexed-job", **opts) -> list[dict]:
    files = render_spec(path, "aks", AksOptions(flavor=flavor, **opts), AzureMLOptions())
    return [d for name, text in files.items() if name.endswith(".yaml") for d in docs(text)]


def assert_valid(objects: list[dict]) -> None:
    for obj in objects:
        for version in schemas.VERSIONS:
            errs = schemas.errors(obj, version)
            assert errs == [], f"{obj['kind']} {obj['metadata']['name']} on {version}:\n" + "\n".join(errs)
            if obj["kind"] not in schemas.CRDS:
                kubernetes_validate.validate(obj, version, strict=True)


def the(objects: list[dict], kind: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


@pytest.mark.parametrize("flavor", ["indexed-job", "pytorchjob"])
@pytest.mark.parametrize("variant", [
    {},
    {"priority": "spot"},
    {"max_restarts": 2, "timeout": "2h", "max_retries": 1},
])
def test_rendered_jobs_validate_strictly(job_file, flavor, variant):
    path = job_file({**BASE, **variant})
    objects = render(path, flavor, code_uri="az://code/jobs", storage_account="acct")
    assert_valid(objects)


def test_validation_reports_every_error_and_can_fail():
    job = the(render(TORCHREC), "Job")
    job["spec"]["completionsMode"] = "Indexed"  # typo
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["limit"] = {}  # typo
    job["spec"]["parallelism"] = "two"
    errs = schemas.errors(job, "1.37")
    assert len(errs) == 3, errs
    assert any("completionsMode" in e for e in errs) and any("'limit'" in e for e in errs)
    pj = the(render(TORCHREC, "pytorchjob"), "PyTorchJob")
    pj["spec"]["elasticPolicy"]["minReplica"] = 1
    pj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "2"
    assert len(schemas.errors(pj, "1.37")) == 2


def test_the_operators_admission_refuses_what_its_crd_lets_through():
    """The training operator's webhook, beyond the CRD: seed 002's own PyTorchJob names its container
    "torchrec", which the operator refuses (it wants "pytorch", whose exit code its ExitCode policy reads)."""
    s = seed("torchrec-pytorchjob.yaml")
    assert schemas.crd_errors(s) == []
    assert schemas.pytorchjob_admission_errors(s) == [
        "spec.pytorchReplicaSpecs[Worker].template.spec.containers: must have at least one container with name pytorch"]
    pj = the(render(TORCHREC, "pytorchjob"), "PyTorchJob")
    assert schemas.pytorchjob_admission_errors(pj) == []
    assert _container(pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"])["name"] == "pytorch"
    pj["metadata"]["name"] = "1-dlrm"
    pj["spec"]["pytorchReplicaSpecs"]["Master"] = {"replicas": 2, "template": {"spec": {"containers": [{"name": "x"}]}}}
    assert len(schemas.pytorchjob_admission_errors(pj)) == 4  # name, Master's image, its pytorch container, replicas


@pytest.mark.parametrize("name, expected", [("dlrm_Run", "dlrm-run"), ("2024-dlrm", "job-2024-dlrm"), ("__", "job"),
                                            ("-x-", "x"), ("a" * 60, "a" * 52)])
def test_k8s_names_are_dns_1035_labels(name, expected):
    assert k8s_name(name) == expected


def _container(pod_spec: dict) -> dict:
    return pod_spec["containers"][0]


def launch(c: dict) -> tuple[list[str], list[str], list[str], list[str]]:
    """A torchrun container's argv as (agent options, torchrun and its flags, rank options, the command):
    ``python3 /azulite/pod_entry.py agent OPTS -- torchrun FLAGS /azulite/pod_entry.py rank OPTS -- CMD``."""
    argv = c["command"] + c["args"]
    assert argv[:3] == ["python3", ENTRY, "agent"], argv
    agent_end, rank_at = argv.index("--"), argv.index(ENTRY, 3)
    assert argv[agent_end + 1] == "torchrun" and argv[rank_at + 1] == "rank", argv
    cmd_at = argv.index("--", rank_at)
    return argv[3:agent_end], argv[agent_end + 1:rank_at], argv[rank_at + 2:cmd_at], argv[cmd_at + 1:]


def _common_pod_fields(ours: dict, theirs: dict, restart_policy: str | None = None) -> None:
    """The fields that matter in seed 002's pod template: placement, image, GPUs, NCCL, volumes."""
    for k, v in theirs["nodeSelector"].items():
        assert ours["nodeSelector"][k] == v
    for t in theirs["tolerations"]:
        assert t in ours["tolerations"]
    assert ours["restartPolicy"] == (restart_policy or theirs["restartPolicy"])
    c, sc = _container(ours), _container(theirs)
    assert c["image"] == sc["image"]
    assert quantities(c["resources"]) == quantities(sc["resources"])
    env = {e["name"]: e["value"] for e in c["env"]}
    for e in sc["env"]:
        assert env[e["name"]] == e["value"], e
    for m in sc["volumeMounts"]:
        assert m in c["volumeMounts"]
    for v in theirs["volumes"]:
        assert v in ours["volumes"]


def test_option_a_reproduces_seed_002_indexed_job():
    objects = render(TORCHREC)
    assert_valid(objects)
    job, svc, s = the(objects, "Job"), the(objects, "Service"), seed("torchrec-training-job.yaml")
    assert job["metadata"]["name"] == s["metadata"]["name"]
    for k in ("parallelism", "completions", "completionMode"):
        assert job["spec"][k] == s["spec"][k]
    pod, spod = job["spec"]["template"]["spec"], s["spec"]["template"]["spec"]
    _common_pod_fields(pod, spod)
    c, sc = _container(pod), _container(spod)
    # the seed's torchrun, under the pod entry (from the ConfigMap, mounted), which makes the pod's exit code
    # the ranks' 75/78 that the podFailurePolicy reads (tests/deploy/test_pod_entry.py runs it)
    assert sc["command"] == ["torchrun"]
    agent, torchrun, rank, command = launch(c)
    assert agent == [] and torchrun[0] == "torchrun" and rank == ["--python"]
    script = sc["args"].index("train_dlrm.py")
    assert command == sc["args"][script:]
    for flag in sc["args"][:script]:
        if not flag.startswith("--nnodes="):
            assert flag in torchrun, flag
    # the seed's Option A runs a fixed 2 nodes; the example's spec asks for 1..2 (seed's Option C), so torchrun
    # gets the range
    assert "--nnodes=1:2" in torchrun and "--nnodes=2" in sc["args"]
    cm = the(objects, "ConfigMap")
    assert {"name": "azulite-entry", "mountPath": "/azulite", "readOnly": True} in c["volumeMounts"]
    assert {"name": "azulite-entry", "configMap": {"name": cm["metadata"]["name"], "defaultMode": 0o555}} in pod["volumes"]
    # the agent's marks folder (its default) on a volume: writable under a read-only root filesystem
    assert {"name": "azulite-marks", "mountPath": pod_entry.DEFAULT_MARKS} in c["volumeMounts"]
    assert {"name": "azulite-marks", "emptyDir": {"sizeLimit": "1Mi"}} in pod["volumes"]
    # c10d on pod 0, reachable through the headless Service the pods' subdomain names
    assert svc["spec"]["clusterIP"] == "None" and pod["subdomain"] == svc["metadata"]["name"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["MASTER_ADDR"].startswith(f"{job['metadata']['name']}-0.{svc['metadata']['name']}.")
    assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    # InfiniBand SKU: NCCL over mlx5, as seed 002's "Environment Variables"
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_SOCKET_IFNAME"] == "eth0" and env["UCX_TLS"].startswith("rc")


def test_option_c_reproduces_seed_002_pytorchjob():
    objects = render(TORCHREC, "pytorchjob")
    assert_valid(objects)
    pj = the(objects, "PyTorchJob")
    s = seed("torchrec-pytorchjob.yaml")
    assert pj["metadata"]["name"] == s["metadata"]["name"]
    assert pj["spec"]["elasticPolicy"]["rdzvBackend"] == s["spec"]["elasticPolicy"]["rdzvBackend"]
    # the spec's node range (elastic.min_nodes 1, instance_count 2): the seed's minReplicas, and its
    # replicas as the top (the seed's maxReplicas 4 is above the pods it starts; azulite's max = nodes started)
    ep, sep = pj["spec"]["elasticPolicy"], s["spec"]["elasticPolicy"]
    assert ep["minReplicas"] == sep["minReplicas"] == 1
    assert ep["maxReplicas"] == s["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2 <= sep["maxReplicas"]
    w, sw = pj["spec"]["pytorchReplicaSpecs"]["Worker"], s["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert w["replicas"] == sw["replicas"]
    # Kubeflow's ExitCode policy (the seed's OnFailure restarts a config error and counts a preemption as a
    # failure): the pod entry makes a preempted pod exit 143, which the operator retries, and a 78 fail it
    assert w["restartPolicy"] == "ExitCode"
    _common_pod_fields(w["template"]["spec"], sw["template"]["spec"], restart_policy="Never")
    # torchrun reads the operator's PET_* rendezvous variables; the script and its flags are the seed's
    c, sc = _container(w["template"]["spec"]), _container(sw["template"]["spec"])
    agent, torchrun, rank, command = launch(c)
    assert agent == ["--exit-preempted=143"] and torchrun == ["torchrun"] and rank == ["--python"]
    assert command == sc["command"][1:]
    assert pj["spec"]["nprocPerNode"] == "8"


def test_non_infiniband_sku_uses_sockets(job_file):
    path = job_file({**BASE, "resources": {"instance_type": "Standard_NC4as_T4_v3", "instance_count": 2},
                     "distribution": {"type": "pytorch", "process_count_per_instance": 1}})
    env = {e["name"]: e["value"] for e in _container(the(render(path), "Job")["spec"]["template"]["spec"])["env"]}
    assert env["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in env


def test_spot_job_placement_checkpoints_and_preemption(job_file):
    path = job_file({**BASE, "priority": "spot"})
    job = the(render(path, termination_grace_s=300), "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["kubernetes.azure.com/scalesetpriority"] == "spot"
    assert {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
            "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["terminationGracePeriodSeconds"] == 300
    # Blob checkpoints through workload identity
    assert pod["serviceAccountName"] == "azulite"
    assert job["spec"]["template"]["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    c = _container(pod)
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["AZULITE_OUTPUT_CHECKPOINTS"] == "az://ckpt/run1"
    assert "--ckpt" in c["args"] and c["args"][c["args"].index("--ckpt") + 1] == "az://ckpt/run1"
    # a rank that committed after SIGTERM exits 75: not a failure of the Job
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [75]}} in rules
    # one that exits 78 (azulite.train.exit_code of a bad URI, no credentials) fails the Job without retries
    assert {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [78]}} in rules


def test_pvc_outputs_and_code_from_blob(job_file):
    spec = {**BASE, "outputs": {"checkpoints": {}, "model": {}}}
    spec["command"] += " --model ${{outputs.model}}"
    path = job_file(spec)
    objects = render(path, pvc="train-data", code_uri="az://code/jobs", storage_account="acct")
    assert_valid(objects)
    pod = the(objects, "Job")["spec"]["template"]["spec"]
    assert {"name": "outputs", "persistentVolumeClaim": {"claimName": "train-data"}} in pod["volumes"]
    args = _container(pod)["args"]
    assert args[args.index("--model") + 1] == "/mnt/azulite/outputs/model"
    (init,) = pod["initContainers"]
    assert "az://" not in init["command"][-1] and "-c code -n jobs/job/code.tar.gz" in init["command"][-1]
    assert {"name": "code", "mountPath": "/code"} in init["volumeMounts"]


def test_dockerfile_from_requirements(job_file, tmp_path):
    path = job_file({**BASE, "environment": {"image": "mcr.microsoft.com/azureml/openmpi4.1.0-cuda12.1-cudnn8-ubuntu22.04"}})
    (tmp_path / "code" / "requirements.txt").write_text("numpy\n")
    with pytest.raises(DeployError) as e:
        render(path)
    assert e.value.where == "environment" and "--image" in e.value.fix
    files = render_spec(path, "aks", AksOptions(image="reg.io/train:2"), AzureMLOptions())
    assert "RUN pip install --no-cache-dir -r /tmp/requirements.txt" in files["Dockerfile"]
    assert "COPY . /code" in files["Dockerfile"]
    assert "image: reg.io/train:2" in files["job-indexed-job.yaml"]


@pytest.mark.parametrize("change, where, words", [
    ({"resources": {"instance_type": "Standard_ND96asrr_v4", "instance_count": 2}}, "resources.instance_type", "Standard_ND96asr_v4"),
    ({"distribution": {"type": "pytorch", "process_count_per_instance": 8}}, "distribution.process_count_per_instance", "at most 4"),
    ({"priority": "spot", "outputs": {}, "command": "python train.py"}, "outputs.checkpoints", "az://"),
    ({"environment": "azureml:AzureML-acpt-pytorch-2.2-cuda12.1@latest"}, "environment", "--image"),
    ({"environment": None}, "environment", "environment.image"),
    ({"distribution": {"type": "mpi", "process_count_per_instance": 2}}, "distribution.type", "sshd and ssh"),
    ({"distribution": {"type": "tensorflow", "worker_count": 9}}, "distribution.worker_count", "at most 8 workers"),
    ({"outputs": {"checkpoints": {}}}, "outputs.checkpoints.path", "--pvc"),
    ({"inputs": {"steps": 3, "data": {"type": "uri_folder", "path": "azureml://datasets/x"}}}, "inputs.data.path", "az://"),
])
def test_bad_input_is_refused_before_rendering(job_file, change, where, words):
    path = job_file({**BASE, **change})
    with pytest.raises(AzuliteError) as e:
        render(path)
    assert e.value.where == where, str(e.value)
    assert words in str(e.value)
    if where == "resources.instance_type":
        assert isinstance(e.value, UnknownSku)


@pytest.mark.parametrize("command, rank_opts, args", [
    ("deepspeed train.py --deepspeed_config ds.json", ["--python"], ["train.py", "--deepspeed_config", "ds.json"]),
    ("torchrun --nproc_per_node=4 train.py --lr 0.1", ["--python"], ["train.py", "--lr", "0.1"]),
    ("python -m mypkg.train --x 1", ["--python"], ["-m", "mypkg.train", "--x", "1"]),
    ("./run.sh 3", [], ["./run.sh", "3"]),
    ("python train.py && echo done", [], ["bash", "-c", "trap 'exit $?' TERM INT; python train.py && echo done"]),
])
def test_commands_become_each_ranks_command(job_file, command, rank_opts, args):
    path = job_file({**BASE, "command": command, "outputs": {}, "priority": "dedicated"})
    c = _container(the(render(path), "Job")["spec"]["template"]["spec"])
    _, torchrun, rank, cmd = launch(c)
    assert torchrun[-1] == "--max_restarts=0" and rank == rank_opts and cmd == args


def test_dockerfile_from_a_conda_file(job_file, tmp_path):
    path = job_file({**BASE, "environment": {"image": "mcr.microsoft.com/azureml/curated/acpt:1", "conda_file": "code/conda.yaml"}})
    (tmp_path / "code" / "conda.yaml").write_text("dependencies: [python=3.11]\n")
    files = render_spec(path, "aks", AksOptions(image="reg.io/train:3", code_uri="az://code/jobs", storage_account="a"),
                        AzureMLOptions())
    assert files["Dockerfile"].splitlines()[1:] == [
        "FROM mcr.microsoft.com/azureml/curated/acpt:1", "COPY conda.yaml /tmp/conda.yaml",
        "RUN conda env update -n base -f /tmp/conda.yaml && conda clean -afy", "WORKDIR /code"]


@pytest.mark.parametrize("ref, image", [
    ("azureml:AzureML-acpt-pytorch-2.2-cuda12.1@latest", "mcr.microsoft.com/azureml/curated/acpt-pytorch-2.2-cuda12.1:latest"),
    ("azureml:AzureML-ACPT-pytorch-1.13-py38-cuda11.7-gpu:7", "mcr.microsoft.com/azureml/curated/acpt-pytorch-1.13-py38-cuda11.7-gpu:7"),
    ("azureml://registries/azureml/environments/acpt-pytorch-2.8-cuda12.6/versions/12",
     "mcr.microsoft.com/azureml/curated/acpt-pytorch-2.8-cuda12.6:12"),
    ("azureml://registries/azureml/environments/tensorflow-2.16-cuda12/labels/latest",
     "mcr.microsoft.com/azureml/curated/tensorflow-2.16-cuda12:latest"),
    ("azureml:my-env:3", None), ("azureml:AzureML-x@stable", None), ("reg.io/train:1", None),
])
def test_curated_environments_name_their_mcr_image(ref, image):
    assert curated_image(ref) == image


def test_a_curated_environment_is_the_image_or_the_dockerfile_base(job_file, tmp_path):
    """A curated environment's image holds the framework (the openmpi base does not): the pod runs it when the
    code is fetched at start, and the Dockerfile builds on it when the code or requirements are baked in."""
    path = job_file({**BASE, "environment": "azureml:AzureML-acpt-pytorch-2.2-cuda12.1@latest"})
    with pytest.raises(DeployError) as e:
        render(path)
    assert "does not hold the job's code" in str(e.value) and "--code-uri" in e.value.fix
    fetched = render_spec(path, "aks", AksOptions(code_uri="az://code/jobs", storage_account="a"), AzureMLOptions())
    assert "image: mcr.microsoft.com/azureml/curated/acpt-pytorch-2.2-cuda12.1:latest" in fetched["job-indexed-job.yaml"]
    assert "Dockerfile" not in fetched
    (tmp_path / "code" / "requirements.txt").write_text("numpy\n")
    baked = render_spec(path, "aks", AksOptions(image="reg.io/train:4"), AzureMLOptions())
    assert baked["Dockerfile"].splitlines()[1] == "FROM mcr.microsoft.com/azureml/curated/acpt-pytorch-2.2-cuda12.1:latest"
    assert "image: reg.io/train:4" in baked["job-indexed-job.yaml"]


@pytest.mark.parametrize("restarts, retries, expected", [(0, 0, 3), (2, 0, 2), (2, 1, 3), (0, 2, 5)])
def test_pytorchjob_retries_are_torchrun_restarts(job_file, restarts, retries, expected):
    """ExitCode pods never restart in place, so runPolicy.backoffLimit would never count: max_retries
    becomes more of torchrun's restarts (the operator's default 3 when the spec sets none)."""
    pj = the(render(job_file({**BASE, "max_restarts": restarts, "max_retries": retries}), "pytorchjob"), "PyTorchJob")
    assert pj["spec"]["elasticPolicy"]["maxRestarts"] == expected


def test_fixed_node_count_renders_fixed_range(job_file):
    job = the(render(job_file(BASE)), "Job")
    assert "--nnodes=2" in _container(job["spec"]["template"]["spec"])["args"]
    pj = the(render(job_file(BASE), "pytorchjob"), "PyTorchJob")
    assert pj["spec"]["elasticPolicy"]["minReplicas"] == pj["spec"]["elasticPolicy"]["maxReplicas"] == 2


def test_no_distribution_runs_the_command_once_per_pod(job_file):
    spec = {k: v for k, v in BASE.items() if k != "distribution"}
    spec["resources"] = {"instance_type": "Standard_NC24rs_v3", "instance_count": 3}
    objects = render(job_file(spec))
    assert_valid(objects)
    job = the(objects, "Job")
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 3
    pod = job["spec"]["template"]["spec"]
    c = _container(pod)
    # the command itself, no torchrun, under the pod entry's agent (PID 1: it passes SIGTERM on)
    argv = c["command"] + c["args"]
    assert argv == ["python3", ENTRY, "agent", "--", "python", "train.py", "--steps", "10", "--ckpt", "az://ckpt/run1"]
    assert not any("torchrun" in a or "nnodes" in a for a in argv)
    assert [o["kind"] for o in objects] == ["Service", "ConfigMap", "Job"]
    # one process per pod holding the node's GPUs (NC24rs_v3: 4), and its node rank from the pod index
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    (rank,) = [e for e in c["env"] if e["name"] == "NODE_RANK"]
    assert "job-completion-index" in rank["valueFrom"]["fieldRef"]["fieldPath"]


def test_no_distribution_as_pytorchjob_names_the_fix(job_file):
    spec = {k: v for k, v in BASE.items() if k != "distribution"}
    with pytest.raises(DeployError) as e:
        render(job_file(spec), "pytorchjob")
    assert e.value.where == "distribution" and "indexed-job" in e.value.fix


TF = {**BASE, "distribution": {"type": "tensorflow", "worker_count": 4, "parameter_server_count": 2}}


@pytest.mark.parametrize("flavor", ["indexed-job", "tfjob"])  # a tensorflow job is a TFJob either way
@pytest.mark.parametrize("variant", [{}, {"priority": "spot"}, {"timeout": "2h", "max_retries": 1},
                                     {"distribution": {"type": "tensorflow", "worker_count": 1}}])
def test_a_tensorflow_job_renders_as_a_tfjob_that_validates_strictly(job_file, flavor, variant):
    objects = render(job_file({**TF, **variant}), flavor, code_uri="az://code/jobs", storage_account="acct")
    assert [o["kind"] for o in objects] == ["ConfigMap", "TFJob"]
    assert_valid(objects)


def test_the_tfjob_runs_each_task_once_under_the_pod_entry_with_kubeflows_exit_codes(job_file):
    files = render_spec(job_file(TF), "aks", AksOptions(), AzureMLOptions())
    assert list(files) == ["job-tfjob.yaml"]
    cm, tf = docs(files["job-tfjob.yaml"])
    spec = tf["spec"]
    assert spec["successPolicy"] == "AllWorkers" and spec["runPolicy"]["cleanPodPolicy"] == "Running"
    replicas = spec["tfReplicaSpecs"]
    assert {k: (v["replicas"], v["restartPolicy"]) for k, v in replicas.items()} == {"PS": (2, "ExitCode"),
                                                                                    "Worker": (4, "ExitCode")}
    for rtype, gpus in (("Worker", "2"), ("PS", None)):  # 4 workers on 2 nodes of 4 GPUs: 2 each; a ps none
        (c,) = replicas[rtype]["template"]["spec"]["containers"]
        assert c["name"] == "tensorflow" and c["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
        assert [c["command"][0], *c["args"]][:5] == ["python3", ENTRY, "agent", "--exit-preempted=143", "--"]
        assert c["args"][4:] == ["python", "train.py", "--steps", "10", "--ckpt", "az://ckpt/run1"]
        assert (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu") == gpus
        assert not [e for e in c["env"] if e["name"] in ("NODE_RANK", "TF_CONFIG")]  # the operator's TF_CONFIG
        volume = next(v for v in replicas[rtype]["template"]["spec"]["volumes"] if "configMap" in v)
        assert volume["configMap"]["name"] == cm["metadata"]["name"] == "job-entry"


def test_tfjob_admission_rules_can_fail(job_file):
    tf = the(render(job_file(TF)), "TFJob")
    replicas = tf["spec"]["tfReplicaSpecs"]
    replicas["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    replicas["Chief"] = replicas["Master"] = replicas["PS"]
    tf["metadata"]["name"] = "2tf"
    errs = schemas.tfjob_admission_errors(tf)
    assert len(errs) == 3 and any("name tensorflow" in e for e in errs) and any("Chief or Master" in e for e in errs)
    assert schemas.crd_errors(tf) == []  # the CRD lets all three through
    replicas["Worker"]["replicas"] = "4"
    assert len(schemas.crd_errors(tf)) == 1


@pytest.mark.parametrize("flavor, change, words", [
    ("pytorchjob", TF, "a PyTorchJob runs torchrun"),
    ("tfjob", BASE, "a TFJob runs TensorFlow"),
])
def test_a_flavor_that_cannot_run_the_job_is_refused(job_file, flavor, change, words):
    with pytest.raises(DeployError, match=words) as e:
        render(job_file(change), flavor)
    assert e.value.where == "--flavor" and e.value.fix


def test_docker_args_are_refused_for_aks_naming_the_field(job_file):
    """Azure ML's docker_args have no pod equivalent: rendered without them, the job would differ silently."""
    path = job_file({**BASE, "resources": {**BASE["resources"], "docker_args": ["--ipc=host"]}})
    with pytest.raises(DeployError) as e:
        render(path)
    assert e.value.where == "resources.docker_args" and "shm_size" in e.value.fix
