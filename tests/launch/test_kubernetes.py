"""The ``kubernetes`` backend end to end through the official client against a local API server that
validates every request body against Kubernetes' published schemas and the Kubeflow CRDs
(tests/launch/k8s_api.py says what that server does not exercise)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import yaml

from azulite.errors import AzuliteError, DeployError, RemoteError
from azulite.launch.backend import get_backend
from azulite.launch.records import JobState
from azulite.launch.settings import Settings
from azulite.spec.loader import load_job
from tests.launch.k8s_api import FakeKubernetes, name_errors

pytest.importorskip("kubernetes")

SPEC = {
    "name": "dlrm",
    "code": "code",
    "command": "python train.py --ckpt ${{outputs.checkpoints}}",
    "environment": {"image": "myregistry.azurecr.io/train:1"},
    "resources": {"instance_type": "Standard_NC24rs_v3", "instance_count": 2},
    "distribution": {"type": "pytorch", "process_count_per_instance": 4},
    "outputs": {"checkpoints": {"path": "az://ckpt/dlrm"}},
    "priority": "spot",
}


@pytest.fixture
def api():
    with FakeKubernetes() as fake:
        yield fake
        assert fake.errors == [], fake.errors


@pytest.fixture
def spec_file(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('train')\n")
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(SPEC))
    return p


def backend(tmp_path, api, **env):
    environ = {"HOME": str(tmp_path), "KUBECONFIG": api.kubeconfig(tmp_path / "kubeconfig"), **env}
    settings = Settings.from_environ({"AZULITE_HOME": str(tmp_path / "home")})
    return get_backend("kubernetes", settings, environ)


def test_indexed_job_submit_watch_logs_preempt_cancel(tmp_path, api, spec_file):
    b = backend(tmp_path, api)
    rec = b.submit(load_job(spec_file), spec_path=str(spec_file))
    assert rec.backend == "kubernetes" and rec.state == JobState.QUEUED
    name = f"dlrm-{rec.id.rsplit('-', 1)[1]}"
    assert ("default", name) in api.objects["services"] and ("default", name) in api.objects["jobs"]
    assert list(api.objects["configmaps"]) == [("default", f"{name}-entry")]  # the pod entry torchrun runs under
    job = api.objects["jobs"][("default", name)]
    assert job["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.azure.com/scalesetpriority"] == "spot"

    # the job's state follows the cluster, through the API server's watch
    seen: list[JobState] = []
    running, done = threading.Event(), threading.Event()

    def watch():
        for r in b.watch(rec.id, timeout_s=60):
            seen.append(r.state)
            if r.state == JobState.RUNNING:
                running.set()
        done.set()

    t = threading.Thread(target=watch)
    t.start()
    api.wait_for(lambda: api.watchers >= 1)
    api.set_status("jobs", name, {"active": 2, "ready": 2})
    assert running.wait(timeout=60)
    assert b.status(rec.id).state == JobState.RUNNING

    api.add_pod(name, 1, "rank 4 step 10\n")
    api.add_pod(name, 0, "rank 0 step 10\nrank 0 loss 0.5\n")
    lines = list(b.logs(rec.id))
    assert lines[0].startswith(f"[{name}-0-") and lines[-1] == f"[{name}-1-abcde] rank 4 step 10"
    assert list(b.logs(rec.id, rank=1)) == [f"[{name}-1-abcde] rank 4 step 10"]
    assert list(b.logs(rec.id, rank=0, follow=True)) == [f"[{name}-0-abcde] rank 0 step 10", f"[{name}-0-abcde] rank 0 loss 0.5"]

    b.preempt(rec.id)
    assert sorted(api.evicted) == [f"{name}-0-abcde", f"{name}-1-abcde"]

    api.set_status("jobs", name, {"succeeded": 2, "conditions": [
        {"type": "Complete", "status": "True", "reason": "Completed", "message": "all indexes succeeded"}]})
    t.join(timeout=60)
    assert done.is_set() and seen == [JobState.RUNNING, JobState.SUCCEEDED]
    assert b.status(rec.id).state == JobState.SUCCEEDED

    # cancel deletes what was created (a finished job's record stays succeeded)
    assert b.cancel(rec.id).state == JobState.SUCCEEDED
    assert api.objects["jobs"] == {} and api.objects["services"] == {} and api.objects["configmaps"] == {}
    assert ("DELETE", f"/apis/batch/v1/namespaces/default/jobs/{name}") in api.requests


def test_pytorchjob_flavor_and_cancel(tmp_path, api, spec_file):
    b = backend(tmp_path, api, AZULITE_K8S_FLAVOR="pytorchjob", AZULITE_K8S_NAMESPACE="train")
    rec = b.submit(load_job(spec_file))
    ((ns, name),) = api.objects["pytorchjobs"]
    assert ns == "train" and api.objects["services"] == {} and api.objects["jobs"] == {}
    assert list(api.objects["configmaps"]) == [("train", f"{name}-entry")]
    api.set_status("pytorchjobs", name, {"conditions": [{"type": "Running", "status": "True"}]}, ns="train")
    assert b.status(rec.id).state == JobState.RUNNING
    assert b.cancel(rec.id).state == JobState.CANCELED
    assert api.objects["pytorchjobs"] == {} and api.objects["configmaps"] == {}


@pytest.mark.parametrize("flavor, container", [("indexed-job", "trainer"), ("pytorchjob", "pytorch")])
def test_a_failed_job_shows_the_exit_code_its_pods_ended_with(tmp_path, api, spec_file, flavor, container):
    """The pod entry makes a pod exit 78 for an error no restart fixes (tests/deploy/test_pod_entry.py):
    `job show` says that code and which pod, not 1, whichever pod ended first."""
    b = backend(tmp_path, api, AZULITE_K8S_FLAVOR=flavor)
    rec = b.submit(load_job(spec_file))
    collection = "jobs" if flavor == "indexed-job" else "pytorchjobs"
    ((_, name),) = api.objects[collection]
    api.add_pod(name, 0, "stopped\n", container=container, exit_code=143, finished_at="2026-01-01T00:10:00Z")
    api.add_pod(name, 1, "bad setting\n", container=container, exit_code=78, finished_at="2026-01-01T00:10:05Z")
    condition = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                 "message": f"Container {container} for pod default/{name}-1-abcde failed with exit code 78 matching "
                            f"FailJob rule at index 1"}
    api.set_status(collection, name, {"conditions": [condition]})
    got = b.status(rec.id)
    assert got.state == JobState.FAILED and got.exit_code == 78
    assert f"pod {name}-1-abcde exited 78 (an error no restart can fix" in (got.attempts[-1].reason or "")


def test_a_tensorflow_job_is_a_tfjob_whose_workers_are_its_ranks(tmp_path, api, spec_file):
    """A tensorflow job goes as a TFJob with the default flavor: the API server (the CRD and the operator's
    admission rules) takes it, the operator's conditions drive its state, `--rank N` reads worker N (the
    parameter servers after the workers), a worker's 78 is the failed job's code, cancel deletes it."""
    data = yaml.safe_load(spec_file.read_text())
    data["distribution"] = {"type": "tensorflow", "worker_count": 2, "parameter_server_count": 1}
    spec_file.write_text(yaml.safe_dump(data))
    b = backend(tmp_path, api)
    rec = b.submit(load_job(spec_file))
    ((_, name),) = api.objects["tfjobs"]
    assert api.objects["jobs"] == {} and api.objects["services"] == {}
    assert list(api.objects["configmaps"]) == [("default", f"{name}-entry")]
    tf = api.objects["tfjobs"][("default", name)]["spec"]
    remote = json.loads((Path(rec.job_dir) / "remote.json").read_text())
    assert (remote["kind"], remote["flavor"]) == ("TFJob", "tfjob")  # what runs, not the default it was asked
    assert {k: v["replicas"] for k, v in tf["tfReplicaSpecs"].items()} == {"PS": 1, "Worker": 2}
    api.set_status("tfjobs", name, {"conditions": [{"type": "Running", "status": "True"}]})
    assert b.status(rec.id).state == JobState.RUNNING
    api.add_pod(name, 0, "ps serving\n", replica="ps", container="tensorflow")
    api.add_pod(name, 1, "worker 1 step 5\n", replica="worker", container="tensorflow")
    api.add_pod(name, 0, "worker 0 step 5\n", replica="worker", container="tensorflow")
    assert list(b.logs(rec.id)) == [f"[{name}-worker-0] worker 0 step 5", f"[{name}-worker-1] worker 1 step 5",
                                    f"[{name}-ps-0] ps serving"]
    assert list(b.logs(rec.id, rank=1)) == [f"[{name}-worker-1] worker 1 step 5"]
    b.preempt(rec.id)
    assert sorted(api.evicted) == sorted([f"{name}-ps-0", f"{name}-worker-0", f"{name}-worker-1"])
    api.add_pod(name, 2, "bad setting\n", replica="worker", container="tensorflow", exit_code=78)
    api.set_status("tfjobs", name, {"conditions": [{"type": "Failed", "status": "True", "reason": "TFJobFailed",
                                                    "message": f"TFJob default/{name} has failed"}]})
    got = b.status(rec.id)
    assert got.state == JobState.FAILED and got.exit_code == 78
    assert f"pod {name}-worker-2 exited 78" in (got.attempts[-1].reason or "")
    b.cancel(rec.id)
    assert api.objects["tfjobs"] == {} and api.objects["configmaps"] == {}
    assert ("DELETE", f"/apis/kubeflow.org/v1/namespaces/default/tfjobs/{name}") in api.requests


def test_an_mpi_job_is_an_mpijob_whose_ranks_speak_through_the_launcher(tmp_path, api, spec_file):
    """An mpi job goes as an MPIJob (kubeflow.org/v2beta1) with the default flavor: the API server (its CRD,
    the operator's checks) takes it, the operator's conditions drive its state, the logs are the launcher's
    (every rank's output, mpirun's --tag-output) and `--rank N` is rank N's lines of it, a preemption
    evicts the workers only (the launcher runs mpirun again), a launcher's 78 is the failed job's code,
    cancel deletes it."""
    data = yaml.safe_load(spec_file.read_text())
    data["distribution"] = {"type": "mpi", "process_count_per_instance": 2}
    spec_file.write_text(yaml.safe_dump(data))
    b = backend(tmp_path, api, AZULITE_K8S_IMAGE="reg.io/mpi:1")
    rec = b.submit(load_job(spec_file))
    ((_, name),) = api.objects["mpijobs"]
    assert api.objects["jobs"] == {} and list(api.objects["configmaps"]) == [("default", f"{name}-entry")]
    remote = json.loads((Path(rec.job_dir) / "remote.json").read_text())
    assert (remote["kind"], remote["flavor"]) == ("MPIJob", "mpijob")
    mj = api.objects["mpijobs"][("default", name)]["spec"]
    assert (mj["slotsPerWorker"], mj["mpiReplicaSpecs"]["Worker"]["replicas"]) == (2, 2)
    api.set_status("mpijobs", name, {"conditions": [{"type": "Created", "status": "True"}]})
    assert b.status(rec.id).state == JobState.QUEUED
    api.set_status("mpijobs", name, {"conditions": [{"type": "Running", "status": "True"}]})
    assert b.status(rec.id).state == JobState.RUNNING
    for i in (1, 0):
        api.add_pod(name, i, f"azulite pod entry: sshd {i}\n", role="worker", container="mpi")
    launcher = api.add_pod(name, 0, "[1,0]<stdout>:rank 0/4\n[1,3]<stdout>:rank 3/4\n[1,3]<stderr>:warn 3\n"
                                    "azulite pod entry: mpirun exited 0\n", role="launcher", container="mpi")
    assert list(b.logs(rec.id)) == [f"[{launcher}] [1,0]<stdout>:rank 0/4", f"[{launcher}] [1,3]<stdout>:rank 3/4",
                                    f"[{launcher}] [1,3]<stderr>:warn 3", f"[{launcher}] azulite pod entry: mpirun exited 0"]
    assert list(b.logs(rec.id, rank=3)) == [f"[{launcher}] rank 3/4", f"[{launcher}] warn 3"]
    b.preempt(rec.id)
    assert sorted(api.evicted) == [f"{name}-worker-0", f"{name}-worker-1"]
    api.add_pod(name, 1, "bad setting\n", role="launcher", container="mpi", exit_code=78)
    api.set_status("mpijobs", name, {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                     "message": "Job has reached the specified backoff limit"}]})
    got = b.status(rec.id)
    assert got.state == JobState.FAILED and got.exit_code == 78
    assert f"pod {name}-launcher-1x" in (got.attempts[-1].reason or "")
    b.cancel(rec.id)
    assert api.objects["mpijobs"] == {} and api.objects["configmaps"] == {}
    assert ("DELETE", f"/apis/kubeflow.org/v2beta1/namespaces/default/mpijobs/{name}") in api.requests


@pytest.mark.parametrize("flavor, distribution, words", [
    ("pytorchjob", {"type": "tensorflow", "worker_count": 2}, "a PyTorchJob runs torchrun"),
    ("tfjob", {"type": "pytorch", "process_count_per_instance": 4}, "a TFJob runs TensorFlow"),
    ("pytorchjob", {"type": "mpi", "process_count_per_instance": 2}, "a PyTorchJob runs torchrun"),
    ("mpijob", {"type": "pytorch", "process_count_per_instance": 4}, "an MPIJob runs mpirun"),
])
def test_a_flavor_that_cannot_run_the_job_is_refused_before_any_request(tmp_path, api, spec_file, flavor,
                                                                          distribution, words):
    data = yaml.safe_load(spec_file.read_text())
    data["distribution"] = distribution
    spec_file.write_text(yaml.safe_dump(data))
    b = backend(tmp_path, api, AZULITE_K8S_FLAVOR=flavor)
    with pytest.raises(DeployError, match=words) as e:
        b.submit(load_job(spec_file))
    assert e.value.where == "--flavor" and api.requests == [] and b.list() == []


def test_a_failed_job_without_a_pod_that_says_why_exits_1(tmp_path, api, spec_file):
    b = backend(tmp_path, api)
    rec = b.submit(load_job(spec_file))
    ((_, name),) = api.objects["jobs"]
    api.add_pod(name, 0, "", exit_code=3, finished_at="2026-01-01T00:10:09Z")  # the first to fail, 3
    api.add_pod(name, 1, "", exit_code=1, finished_at="2026-01-01T00:10:10Z")
    api.set_status("jobs", name, {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                  "message": "Job has reached the specified backoff limit"}]})
    got = b.status(rec.id)
    assert got.exit_code == 3 and "Job has reached the specified backoff limit; pod " in got.attempts[-1].reason
    rec2 = b.submit(load_job(spec_file))  # no pods at all: 1, the condition's words alone
    name2 = next(n for (_, n) in api.objects["jobs"] if n != name)
    api.set_status("jobs", name2, {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]})
    got = b.status(rec2.id)
    assert got.exit_code == 1 and got.attempts[-1].reason == "DeadlineExceeded"


def test_a_job_whose_name_starts_with_a_digit_is_accepted_by_the_api_server(tmp_path, api, spec_file):
    """Its Service's name must be a DNS-1035 label (the test server refuses others, as the real one)."""
    spec_file.write_text(yaml.safe_dump({**SPEC, "name": "2024_dlrm"}))
    for flavor in ("indexed-job", "pytorchjob"):
        rec = backend(tmp_path, api, AZULITE_K8S_FLAVOR=flavor).submit(load_job(spec_file))
        assert rec.state == JobState.QUEUED
    assert [n for (_, n) in api.objects["services"]][0].startswith("job-2024-dlrm-")
    assert name_errors({"metadata": {"name": "2024-dlrm-1"}}, "services") != []  # what it would have been


def test_the_api_server_refuses_malformed_bodies_and_the_backend_says_so(tmp_path, api, spec_file):
    import json
    import urllib.error
    import urllib.request

    b = backend(tmp_path, api)
    # a typo in a Job is refused, as the real API server would (sent raw: the client would refuse it first)
    bad = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "imagee": "x"}]}}}}
    req = urllib.request.Request(f"{api.url}/apis/batch/v1/namespaces/default/jobs", data=json.dumps(bad).encode(),
                                 headers={"Authorization": "Bearer t0ken", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    status = json.loads(e.value.read())
    assert e.value.code == 422 and status["reason"] == "Invalid" and "imagee" in status["message"]
    # an object that already exists: the backend's error names it and the job is recorded as failed
    rec = b.submit(load_job(spec_file))
    api.objects["jobs"][("default", "dlrm-2")] = api.objects["jobs"][("default", f"dlrm-{rec.id.rsplit('-', 1)[1]}")]
    with pytest.raises(RemoteError, match="409"):
        b.submit(load_job(spec_file))
    assert [r.state for r in b.list()] == [JobState.FAILED, JobState.QUEUED]


@pytest.mark.parametrize("kubeconfig, env, where", [
    ("missing", {}, "KUBECONFIG"),
    ("no-context", {}, "KUBECONFIG"),
    ("ok", {"AZULITE_K8S_CONTEXT": "prod"}, "AZULITE_K8S_CONTEXT"),
])
def test_kubeconfig_errors_before_anything_is_sent(tmp_path, api, spec_file, kubeconfig, env, where):
    path = tmp_path / "kc"
    if kubeconfig != "missing":
        api.kubeconfig(path)
    if kubeconfig == "no-context":
        data = yaml.safe_load(path.read_text())
        data.pop("current-context")
        path.write_text(yaml.safe_dump(data))
    settings = Settings.from_environ({"AZULITE_HOME": str(tmp_path / "home")})
    b = get_backend("kubernetes", settings, {"KUBECONFIG": str(path), **env})
    with pytest.raises(DeployError) as e:
        b.submit(load_job(spec_file))
    assert e.value.where == where and e.value.fix
    assert api.requests == [] and b.list() == []


def test_render_errors_name_the_settings_job_submit_takes(tmp_path, api, spec_file):
    # the render's errors named `deploy render`'s flags (--pvc, --image): `job submit` has none of them
    data = yaml.safe_load(spec_file.read_text())
    data["outputs"]["model"] = {"type": "uri_folder"}  # no az:// path, no volume
    spec_file.write_text(yaml.safe_dump(data))
    with pytest.raises(AzuliteError) as e:
        backend(tmp_path, api).submit(load_job(spec_file))
    assert "set AZULITE_K8S_PVC=CLAIM" in e.value.fix and "--pvc" not in str(e.value)
    assert api.requests == []


def test_an_api_server_that_does_not_answer_is_said_as_such(tmp_path, api, spec_file):
    # connection refused was answered with a fix about RBAC rights and the training operator
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = yaml.safe_load(open(api.kubeconfig(tmp_path / "kc")))
    kubeconfig["clusters"][0]["cluster"]["server"] = f"http://127.0.0.1:{port}"
    (tmp_path / "kc").write_text(yaml.safe_dump(kubeconfig))
    b = get_backend("kubernetes", Settings.from_environ({"AZULITE_HOME": str(tmp_path / "home")}),
                    {"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "kc")})
    with pytest.raises(AzuliteError) as e:
        b.submit(load_job(spec_file))
    assert "the API server did not answer" in e.value.message and "kubectl cluster-info" in e.value.fix


def test_bad_spec_refused_before_anything_is_recorded(tmp_path, api, spec_file):
    b = backend(tmp_path, api)
    data = yaml.safe_load(spec_file.read_text())
    data["distribution"]["process_count_per_instance"] = 8
    spec_file.write_text(yaml.safe_dump(data))
    with pytest.raises(AzuliteError, match="has 4 GPU"):
        b.submit(load_job(spec_file))
    assert api.requests == [] and b.list() == []


def test_code_snapshot_uploaded_to_blob_for_the_init_container(tmp_path, api, spec_file, azurite):
    b = backend(tmp_path, api, AZULITE_K8S_CODE_URI="az://code/jobs", AZULITE_K8S_STORAGE_ACCOUNT="devstoreaccount1",
                AZURE_STORAGE_CONNECTION_STRING=azurite.connection_string)
    rec = b.submit(load_job(spec_file))
    name = f"dlrm-{rec.id.rsplit('-', 1)[1]}"
    pod = api.objects["jobs"][("default", name)]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["name"] == "fetch-code"
    from azure.storage.blob import BlobServiceClient

    blob = BlobServiceClient.from_connection_string(azurite.connection_string).get_blob_client("code", f"jobs/{name}/code.tar.gz")
    with tarfile.open(fileobj=io.BytesIO(blob.download_blob().readall())) as tar:
        assert tar.extractfile("./train.py").read() == b"print('train')\n"


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    from azure.storage.blob import BlobServiceClient

    from tests.train.azurite import running

    with running(tmp_path_factory) as az:
        BlobServiceClient.from_connection_string(az.connection_string).create_container("code")
        yield az


def test_job_commands_follow_the_store_to_the_cluster(tmp_path, api, spec_file):
    """`job submit --backend kubernetes --flavor`, then `job show` / `job cancel` without --backend: the
    store says where the job runs."""
    azulite = str(Path(sys.executable).parent / "azulite")
    env = {**os.environ, "AZULITE_HOME": str(tmp_path / "home"), "KUBECONFIG": api.kubeconfig(tmp_path / "kc")}
    env.pop("AZULITE_BACKEND", None)

    def run(*args):
        r = subprocess.run([azulite, "job", *args], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    rec = json.loads(run("submit", str(spec_file), "--backend", "kubernetes", "--flavor", "pytorchjob", "--json"))
    ((_, name),) = api.objects["pytorchjobs"]
    api.set_status("pytorchjobs", name, {"conditions": [{"type": "Running", "status": "True"}]})
    shown = json.loads(run("show", rec["id"], "--json"))
    assert shown["backend"] == "kubernetes" and shown["state"] == "running"
    run("cancel", rec["id"])
    assert api.objects["pytorchjobs"] == {}


@pytest.mark.parametrize("namespace", ["ML_Training", "-train", "a" * 64, ""])
def test_a_bad_namespace_setting_is_refused_before_any_request(tmp_path, api, namespace):
    # same RFC 1123 check as deploy render --namespace: it was only refused by the API server at submit
    with pytest.raises(DeployError) as e:
        backend(tmp_path, api, AZULITE_K8S_NAMESPACE=namespace)
    assert e.value.where == "AZULITE_K8S_NAMESPACE" and "ml-training" in e.value.fix
    assert api.requests == []


@pytest.mark.parametrize("setting, bad, example", [
    ("AZULITE_K8S_PVC", "Bad PVC", "training-outputs"),
    ("AZULITE_K8S_SERVICE_ACCOUNT", "Bad SA!", "e.g. azulite"),
    ("AZULITE_K8S_STORAGE_ACCOUNT", "x y", "mlartifacts01"),
])
def test_bad_claim_service_account_and_storage_account_settings_are_refused_before_any_request(tmp_path, api, setting,
                                                                                               bad, example):
    # as deploy render's --pvc, --service-account, --storage-account: they reached the manifests as written
    with pytest.raises(DeployError) as e:
        backend(tmp_path, api, **{setting: bad})
    assert e.value.where == setting and repr(bad) in e.value.message and example in e.value.fix
    assert api.requests == []
