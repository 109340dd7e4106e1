"""MPI jobs for AKS: the MPIJob (kubeflow/mpi-operator v2beta1) validated offline (its CRD and the
operator's own checks, the pod templates against strict Kubernetes schemas), its structure, the Dockerfile's
OpenSSH layer applied to this machine's OpenSSH configuration, and the rendered pods themselves running
examples/mpi (mpi4py) over real sshd on loopback: a worker's eviction ends in a checkpoint on every rank, a
second mpirun in the same launcher pod, and the weights of a run that never stopped."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from azulite.deploy import pod_entry, pod_mpi
from azulite.deploy.azureml import AzureMLOptions
from azulite.deploy.image import SSH_LAYER
from azulite.deploy.options import AksOptions
from azulite.deploy.render import render_spec
from azulite.errors import DeployError
from tests.deploy import schemas
from tests.deploy.conftest import EXAMPLES, docs
from tests.deploy.mpi_cluster import SSHD, Cluster
from tests.deploy.test_training import BASE, assert_valid, render, the
from tests.launch.jobkit import wait_for

MPI = {**BASE, "distribution": {"type": "mpi", "process_count_per_instance": 4}}
IMAGE = {"image": "reg.io/mpi:1"}


def replicas(objects: list[dict]) -> dict:
    return the(objects, "MPIJob")["spec"]["mpiReplicaSpecs"]


@pytest.mark.parametrize("flavor", ["indexed-job", "mpijob"])  # an mpi job is an MPIJob either way
@pytest.mark.parametrize("variant, opts", [
    ({}, {"code_uri": "az://code/jobs", "storage_account": "acct"}),
    ({"priority": "spot"}, {}),
    ({"timeout": "2h", "max_retries": 1}, {"pvc": "outputs"}),
    ({"resources": {"instance_type": "Standard_D4s_v3", "instance_count": 3},
      "distribution": {"type": "mpi", "process_count_per_instance": 2}}, {}),
])
def test_an_mpi_job_renders_as_an_mpijob_that_validates_strictly(job_file, flavor, variant, opts):
    objects = render(job_file({**MPI, **variant}), flavor, **IMAGE, **opts)
    assert [o["kind"] for o in objects] == ["ConfigMap", "MPIJob"]
    assert_valid(objects)
    for rtype, spec in replicas(objects).items():  # the pod templates as the Pods the operator makes of them
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"job-{rtype.lower()}"}, "spec": spec["template"]["spec"]}
        for version in schemas.VERSIONS:
            assert schemas.k8s_errors(pod, version) == [], rtype


def test_the_mpijob_runs_mpirun_in_the_launcher_and_sshd_in_each_worker(job_file):
    files = render_spec(job_file({**MPI, "max_retries": 2}), "aks", AksOptions(**IMAGE), AzureMLOptions())
    assert sorted(files) == ["Dockerfile", "job-mpijob.yaml"]
    cm, mj = docs(files["job-mpijob.yaml"])
    assert cm["data"] == {"pod_entry.py": Path(pod_entry.__file__).read_text(), "pod_mpi.py": Path(pod_mpi.__file__).read_text()}
    spec = mj["spec"]
    assert (spec["slotsPerWorker"], spec["sshAuthMountPath"], spec["mpiImplementation"]) == (4, "/root/.ssh", "OpenMPI")
    assert spec["launcherCreationPolicy"] == "WaitForWorkersReady"
    assert spec["runPolicy"] == {"backoffLimit": 2, "cleanPodPolicy": "Running"}  # sshd never ends by itself
    rs = spec["mpiReplicaSpecs"]
    assert {k: (v["replicas"], v["restartPolicy"]) for k, v in rs.items()} == {"Launcher": (1, "Never"),
                                                                              "Worker": (2, "OnFailure")}
    (w,), (lc,) = rs["Worker"]["template"]["spec"]["containers"], rs["Launcher"]["template"]["spec"]["containers"]
    assert [w["command"][0], *w["args"]] == ["python3", "/azulite/pod_mpi.py", "worker", "--", "/usr/sbin/sshd", "-De"]
    assert w["readinessProbe"]["tcpSocket"]["port"] == 22 and w["resources"]["limits"]["nvidia.com/gpu"] == "4"
    argv = [lc["command"][0], *lc["args"]]
    assert argv[:4] == ["python3", "/azulite/pod_mpi.py", "launcher", "--"]
    run = argv[4:]
    assert run[:4] == ["mpirun", "--allow-run-as-root", "-np", "8"]  # 2 nodes x 4
    tail = run[run.index("/azulite/pod_mpi.py") - 1:]
    assert tail[:5] == ["python3", "/azulite/pod_mpi.py", "rank", "--python", "--"]
    assert tail[5:] == ["train.py", "--steps", "10", "--ckpt", "az://ckpt/run1"]
    # every variable of the job reaches the ranks (through ssh they see none of their pod's), and the board's
    forwarded = {run[i + 1] for i, a in enumerate(run) if a == "-x"}
    own = {e["name"] for e in lc["env"] if "value" in e}
    assert own <= forwarded and {"NCCL_DEBUG", "AZUREML_NODE_COUNT", "PATH", pod_mpi.ENV_BOARD} <= forwarded
    assert {"AZURE_CLIENT_ID", "AZURE_FEDERATED_TOKEN_FILE"} <= forwarded  # az:// output: workload identity
    assert run[run.index("--wdir") + 1] == "/code" and "--tag-output" in run
    # the launcher: no GPU, no node pinning (prefers non-spot nodes), none of the job's volumes, its own IP
    pod = rs["Launcher"]["template"]["spec"]
    assert "nodeSelector" not in pod and "limits" not in lc["resources"] and "initContainers" not in pod
    assert {v["name"] for v in pod["volumes"]} == {"azulite-entry", "azulite-marks"}
    assert {"name": pod_mpi.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in lc["env"]
    pref = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]
    assert pref["matchExpressions"][0]["operator"] == "NotIn"
    assert "restartPolicy" not in pod and "restartPolicy" not in rs["Worker"]["template"]["spec"]
    assert all(line in files["Dockerfile"] for line in SSH_LAYER)


def test_without_an_image_to_build_an_mpi_job_says_why(job_file):
    with pytest.raises(DeployError, match="sshd") as e:
        render(job_file(MPI))
    assert e.value.where == "distribution.type" and "--image" in e.value.fix


@pytest.mark.parametrize("flavor, change, words, fix", [
    ("pytorchjob", MPI, "a PyTorchJob runs torchrun", "--flavor mpijob"),
    ("tfjob", MPI, "a TFJob runs TensorFlow", "--flavor mpijob"),
    ("mpijob", BASE, "an MPIJob runs mpirun", "--flavor indexed-job or pytorchjob"),
])
def test_a_flavor_that_cannot_run_the_job_is_refused(job_file, flavor, change, words, fix):
    with pytest.raises(DeployError, match=words) as e:
        render(job_file(change), flavor, **IMAGE)
    assert e.value.where == "--flavor" and fix in e.value.fix


def test_the_operators_checks_can_fail(job_file):
    mj = the(render(job_file(MPI), **IMAGE), "MPIJob")
    assert schemas.mpijob_validation_errors(mj) == []
    spec = mj["spec"]
    spec["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2
    spec["mpiReplicaSpecs"]["Worker"]["restartPolicy"] = "ExitCode"  # the training operator's, not this one's
    spec["runPolicy"]["cleanPodPolicy"] = None
    mj["metadata"]["name"] = "x" * 60  # x...-worker-1 is 69 characters
    errs = schemas.mpijob_validation_errors(mj)
    assert len(errs) == 4, errs
    assert any("Launcher].replicas: must be 1" in e for e in errs) and any("DNS-1035" in e for e in errs)
    del spec["mpiReplicaSpecs"]["Launcher"]
    assert any("must have Launcher" in e for e in schemas.mpijob_validation_errors(mj))
    spec["slotsPerWorker"] = "4"
    assert any("slotsPerWorker" in e for e in schemas.crd_errors(mj))


def test_the_dockerfiles_ssh_layer_sets_up_this_machines_openssh(tmp_path):
    """The layer's RUN lines (but apt-get) on copies of Debian's /etc/ssh files: what sshd and ssh then read."""
    if not Path("/etc/ssh/sshd_config").is_file() or not os.access(SSHD, os.X_OK):
        pytest.skip("OpenSSH server not installed (scripts/install.sh --dev installs it)")
    etc = tmp_path / "etc"
    (etc / "ssh").mkdir(parents=True)
    for name in ("ssh_config", "sshd_config"):
        shutil.copy(f"/etc/ssh/{name}", etc / "ssh" / name)
    (etc / "environment").write_text("")
    script = SSH_LAYER[1].removeprefix("RUN ").replace("/etc/", f"{etc}/")
    subprocess.run(["bash", "-c", script], check=True, env={**os.environ, "PATH": "/opt/conda/bin:/usr/bin:/bin"})
    client = subprocess.run(["ssh", "-G", "-F", str(etc / "ssh" / "ssh_config"), "worker-0"], capture_output=True,
                            text=True, check=True).stdout
    assert "stricthostkeychecking false" in client and "userknownhostsfile /dev/null" in client
    host_key = tmp_path / "host"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    server = subprocess.run([SSHD, "-T", "-f", str(etc / "ssh" / "sshd_config"), "-h", str(host_key)],
                            capture_output=True, text=True)
    assert server.returncode == 0, server.stderr
    assert "strictmodes no" in server.stdout and "permitrootlogin without-password" in server.stdout
    assert "PATH=/opt/conda/bin:/usr/bin:/bin" in (etc / "environment").read_text().splitlines()


# ---- the rendered pods, run ---------------------------------------------------------------------------
needs_mpi4py = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None
                                  or not os.access(SSHD, os.X_OK) or shutil.which("ssh") is None,
                                  reason="Open MPI, mpi4py or OpenSSH not installed")


class RenderedPods(Cluster):
    """examples/mpi rendered as an MPIJob (2 workers of 1 slot), its pods' commands and variables run here:
    ``/azulite`` is the package's folder, ``/code`` a copy of the example, the claim's mount a folder,
    ``python3`` this interpreter; each worker's sshd is the stand-in's (own address, port, marks folder)."""

    def __init__(self, tmp: Path, *sets: str) -> None:
        super().__init__(tmp)
        code, self.mnt = tmp / "code", tmp / "mnt"
        shutil.copytree(EXAMPLES / "mpi", code)
        files = render_spec(code / "job.yaml", "aks", AksOptions(pvc="outputs", **IMAGE), AzureMLOptions(),
                            ["resources.instance_type=Standard_D4s_v3", "resources.instance_count=2",
                             "distribution.process_count_per_instance=1", *sets])
        (_, mj) = docs(files["mpi-mpijob.yaml"])
        self.replicas = mj["spec"]["mpiReplicaSpecs"]
        self.paths = {"/azulite/": f"{Path(pod_mpi.__file__).parent}/", "/code": str(code), "/mnt/azulite": str(self.mnt)}

    def _map(self, word: str) -> str:
        if word == "python3":
            return sys.executable
        for pod_path, here in self.paths.items():
            if word.startswith(pod_path):
                return here + word[len(pod_path):]
        return word

    def container(self, rtype: str) -> dict:
        return self.replicas[rtype]["template"]["spec"]["containers"][0]

    def worker(self, i: int):
        c = self.container("Worker")
        argv = [self._map(w) for w in [c["command"][0], *c["args"]]]
        assert argv[-2:] == ["/usr/sbin/sshd", "-De"]
        return self.start_worker(i, [*argv[:3], "--marks", str(self.marks(i)), "--", *self.sshd(i)])

    def launcher(self):
        c = self.container("Launcher")
        argv = [self._map(w) for w in [c["command"][0], *c["args"]]]
        argv[3:3] = ["--ssh-port", str(self.port)]
        env = {e["name"]: self._map(e["value"]) for e in c["env"] if "value" in e}
        return self.start_launcher(argv, self.launcher_env(**env), self.tmp)


def _final(log: str) -> set[str]:
    return set(re.findall(r"final_params_sha256=(\w+)", log))


@needs_mpi4py
@pytest.mark.slow
def test_the_rendered_pods_train_and_a_worker_eviction_resumes_to_the_same_weights(tmp_path):
    ref = RenderedPods(tmp_path / "ref", "inputs.steps=60")
    try:
        for i in (0, 1):
            ref.worker(i)
        p = ref.launcher()
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        reference = _final(out)
        assert len(reference) == 1 and re.search(r"^\[\d+,1\]<stdout>:.*rank 1/2", out, re.M), out
    finally:
        ref.close()
    pods = RenderedPods(tmp_path / "run", "inputs.steps=60", "inputs.step_sleep=0.2")
    try:
        for i in (0, 1):
            pods.worker(i)
        launcher = pods.launcher()
        lines: list[str] = []
        wait_for(lambda: lines.append(launcher.stdout.readline()) or "checkpoint: step 10 saved" in lines[-1], 120,
                 "the first checkpoint")
        evicted = pods.workers[1]
        evicted.send_signal(signal.SIGTERM)  # the kubelet's stop of a spot-evicted worker
        wout, _ = evicted.communicate(timeout=120)
        assert evicted.returncode == 128 + signal.SIGTERM, wout
        pods.worker(1)  # the operator recreates it, same name
        rest, _ = launcher.communicate(timeout=300)
        out = "".join(lines) + rest
        assert launcher.returncode == 0, out
        stopped = int(re.search(r"preempted after step (\d+)", out).group(1))
        assert 10 <= stopped < 60 and f"resumed from step {stopped}" in out, out
        assert "rerun 1 of at most" in out and f"checkpoint: step {stopped} saved" in out
        assert _final(out) == reference, out
        assert (pods.mnt / "outputs" / "state" / "weights.npz").is_file()  # on the claim, as in the pods
    finally:
        pods.close()


def test_examples_mpi_renders_for_its_hpc_nodes_with_ucx_over_infiniband_and_no_nccl(tmp_path):
    """examples/mpi names Standard_HB120rs_v3 (HBv3: CPUs, 200 Gb/s HDR InfiniBand): its ranks get UCX over the
    HCA and shared memory within a node, and no NCCL settings (there is no GPU)."""
    files = render_spec(EXAMPLES / "mpi" / "job.yaml", "aks", AksOptions(pvc="outputs", **IMAGE), AzureMLOptions())
    (_, mj) = docs(files["mpi-mpijob.yaml"])
    assert_valid([mj])
    (launcher,) = mj["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in launcher["env"]}
    assert (env["UCX_TLS"], env["UCX_NET_DEVICES"]) == ("rc,sm,self", "mlx5_ib0:1")
    assert not [k for k in env if k.startswith("NCCL_")]
    (worker,) = mj["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert "resources" not in worker  # no GPU to ask for
    # its image: the base, mpi4py and numpy from the example's requirements.txt, then OpenSSH
    docker = files["Dockerfile"]
    assert docker.index("pip install --no-cache-dir -r /tmp/requirements.txt") < docker.index(SSH_LAYER[0])
