"""``azulite deploy render`` / ``azulite cluster render`` through the console script."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.cli.inprocess import exit_code as _exit_code

ROOT = Path(__file__).resolve().parents[2]
AZULITE = str(Path(sys.executable).parent / "azulite")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([AZULITE, *args], capture_output=True, text=True, timeout=120)


def test_deploy_render_writes_manifests(tmp_path):
    r = run("deploy", "render", str(ROOT / "examples/aks/torchrec/job.yaml"), "--target", "aks",
            "--flavor", "pytorchjob", "--namespace", "train", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    cm, pj = yaml.safe_load_all((tmp_path / "torchrec-dlrm-training-pytorchjob.yaml").read_text())
    assert pj["kind"] == "PyTorchJob" and pj["metadata"]["namespace"] == "train"
    # the pod entry torchrun runs under, as one readable block in the file
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["namespace"] == "train"
    assert "\n    def agent(" in (tmp_path / "torchrec-dlrm-training-pytorchjob.yaml").read_text()
    r = run("cluster", "render", str(ROOT / "examples/aks/cluster.yaml"), "--resource-group", "rg", "--out", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "dcgm-exporter.yaml", "gpu-alerts.rules.yml", "gpu-alerts.yaml", "nodepools.sh", "nvidia-device-plugin.yaml"]


def test_bad_input_exits_2_with_field_and_fix_and_writes_nothing(tmp_path):
    r = run("deploy", "render", str(ROOT / "examples/aks/torchrec/job.yaml"), "--target", "aks",
            "--set", "distribution.process_count_per_instance=16", "--out", str(tmp_path / "out"))
    assert r.returncode == 2
    assert "distribution.process_count_per_instance" in r.stderr and "fix:" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    r = run("deploy", "render", str(ROOT / "examples/aks/torchrec/job.yaml"), "--target", "gke", "--out", str(tmp_path))
    assert r.returncode == 2 and "--target" in r.stderr


def test_a_tensorflow_example_renders_as_a_tfjob_and_an_unknown_flavor_is_named(tmp_path):
    r = run("deploy", "render", str(ROOT / "examples/tensorflow/job.yaml"), "--target", "aks", "--image",
            "reg.io/tf:1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    cm, tf = yaml.safe_load_all((tmp_path / "tensorflow-tfjob.yaml").read_text())
    assert (cm["kind"], tf["kind"]) == ("ConfigMap", "TFJob")
    assert tf["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 2
    r = run("deploy", "render", str(ROOT / "examples/tensorflow/job.yaml"), "--target", "aks", "--flavor", "tf",
            "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "--flavor" in r.stderr and "indexed-job, pytorchjob, tfjob" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


def test_help_examples_name_files_that_exist(capsys, monkeypatch):
    from azulite.cli import main

    monkeypatch.setenv("COLUMNS", "200")  # one example per line, whatever the terminal

    for group in ("deploy", "cluster"):
        try:
            main([group, "--help"])
        except SystemExit:
            pass
        paths = re.findall(r"render (\S+\.yaml)", capsys.readouterr().out)
        assert paths and all((ROOT / p).is_file() for p in paths), paths


def test_render_out_that_is_a_file_is_an_error(tmp_path):
    f = tmp_path / "build"
    f.write_text("")
    r = run("deploy", "render", str(ROOT / "examples/aks/torchrec/job.yaml"), "--target", "aks", "--out", str(f))
    assert r.returncode == 2 and "--out is a file, not a folder" in r.stderr and "Traceback" not in r.stderr


def test_bad_namespace_and_negative_numbers_are_refused_before_writing(tmp_path, capsys):
    # the offline schemas do not check names: `Bad_NS` rendered fine and would only fail at kubectl apply
    job = str(ROOT / "examples/aks/torchrec/job.yaml")
    cluster = str(ROOT / "examples/aks/cluster.yaml")
    out = tmp_path / "out"
    assert _exit_code("deploy", "render", job, "--target", "aks", "--namespace", "Bad_NS", "--out", str(out)) == 2
    assert "--namespace: 'Bad_NS' is not a Kubernetes namespace name" in capsys.readouterr().err
    assert _exit_code("cluster", "render", cluster, "-g", "rg", "--monitoring-namespace", "gpu mon", "--out", str(out)) == 2
    assert "--monitoring-namespace: 'gpu mon'" in capsys.readouterr().err
    assert _exit_code("deploy", "render", job, "--target", "aks", "--termination-grace", "-1", "--out", str(out)) == 2
    assert _exit_code("cluster", "render", cluster, "-g", "rg", "--gpu-memory-free-mb", "-5", "--out", str(out)) == 2
    assert _exit_code("deploy", "render", job, "--target", "aks", "--image", "my image!", "--out", str(out)) == 2
    assert "--image: 'my image!' is not an image reference" in capsys.readouterr().err
    assert not out.exists()
    assert _exit_code("deploy", "render", job, "--target", "aks", "--namespace", "ml-training", "--out", str(out)) == 0
    assert _exit_code("deploy", "render", job, "--target", "aks", "--image", "myacr.azurecr.io/train:1.0", "--out", str(out)) == 0


@pytest.mark.parametrize("flag, bad, said", [
    # each rendered into the manifests, rc 0, and would fail only at kubectl apply (or in the pod)
    ("--pvc", "Bad PVC", "--pvc: 'Bad PVC' is not a Kubernetes PersistentVolumeClaim name"),
    ("--service-account", "Bad SA!", "--service-account: 'Bad SA!' is not a Kubernetes ServiceAccount name"),
    ("--storage-account", "x y", "--storage-account: 'x y' is not an Azure storage account name"),
    ("--storage-account", "ab", "'ab' is not an Azure storage account name"),
    ("--storage-account", "Mixed", "'Mixed' is not an Azure storage account name"),
])
def test_bad_claim_service_account_and_storage_account_names_are_refused(tmp_path, capsys, flag, bad, said):
    job, out = str(ROOT / "examples/aks/torchrec/job.yaml"), tmp_path / "out"
    assert _exit_code("deploy", "render", job, "--target", "aks", flag, bad, "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert said in err and "fix: use " in err and not out.exists(), err


def test_good_claim_service_account_and_storage_account_names_render(tmp_path):
    job, out = str(ROOT / "examples/aks/torchrec/job.yaml"), tmp_path / "out"
    assert _exit_code("deploy", "render", job, "--target", "aks", "--pvc", "train-outputs.v2", "--service-account",
                      "ml-sa", "--storage-account", "mlartifacts01", "--out", str(out)) == 0
    text = "".join(p.read_text() for p in out.iterdir())
    assert "claimName: train-outputs.v2" in text


def test_render_a_directory_says_so(tmp_path, capsys):
    assert _exit_code("deploy", "render", str(tmp_path), "--target", "aks", "--out", str(tmp_path / "out")) == 2
    assert "is a directory, not a spec file" in capsys.readouterr().err  # was "cannot read the spec (IsADirectoryError)"


@pytest.mark.parametrize("target", ["aks", "azureml"])
def test_a_retired_vm_size_is_refused_before_anything_is_written(tmp_path, target):
    shutil.copytree(ROOT / "examples/ddp", tmp_path / "ddp")
    spec = tmp_path / "ddp" / "job.yaml"
    spec.write_text(spec.read_text().replace("Standard_NC24rs_v3", "Standard_NC6s_v3"))
    r = run("deploy", "render", str(spec), "--target", target, "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "resources.instance_type: Standard_NC6s_v3 was retired on 2025-09-30" in r.stderr and "fix:" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target, args, named", [
    ("azureml", ["--image", "reg.io/x:1", "--pvc", "claim"], "--image, --pvc do not apply to --target azureml"),
    ("azureml", ["--flavor", "pytorchjob", "--namespace", "ml"], "--flavor, --namespace do not apply"),
    ("aks", ["--compute", "gpu", "--datastore", "ds"], "--compute, --datastore do not apply to --target aks"),
])
def test_flags_the_target_does_not_read_are_refused(tmp_path, target, args, named):
    # each was dropped without a word
    r = run("deploy", "render", str(ROOT / "examples/ddp/job.yaml"), "--target", target, *args, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and named in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, said", [
    (["-g", ""], "--resource-group: '' is not an Azure resource group name"),
    (["-g", "rg", "--alert-for", "banana"], "--alert-for: 'banana' is not a duration"),  # was "for: rule group ..."
    (["-g", "rg", "--gpu-temperature-c", "-5"], "--gpu-temperature-c"),
    (["-g", "rg", "--rule-label", "release"], "--rule-label: 'release': no '=' in it"),
    (["-g", "rg", "--rule-label", "a b=c"], "--rule-label: 'a b=c': 'a b' is not a Kubernetes label key"),
])
def test_bad_cluster_render_options_are_named(tmp_path, capsys, args, said):
    out = tmp_path / "out"
    assert _exit_code("cluster", "render", str(ROOT / "examples/aks/cluster.yaml"), *args, "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert said in err and "fix:" in err and "Traceback" not in err and not out.exists(), err


def test_cluster_render_labels_the_rule_for_kube_prometheus_stack(tmp_path):
    out = tmp_path / "out"
    assert _exit_code("cluster", "render", str(ROOT / "examples/aks/cluster.yaml"), "-g", "my-rg.(prod)_1",
                      "--rule-label", "release=kube-prometheus-stack", "--out", str(out)) == 0
    rule = yaml.safe_load((out / "gpu-alerts.yaml").read_text())
    assert rule["metadata"]["labels"] == {"release": "kube-prometheus-stack"}


def test_serving_render_options(tmp_path, capsys):
    spec, out = str(ROOT / "examples/aks/arr-coc-triton.yaml"), tmp_path / "out"
    # as the example's comment says
    assert _exit_code("deploy", "render", spec, "--target", "aks", "--storage-account", "mystorageaccount",
                      "--storage-key-secret", "models-storage", "--out", str(out)) == 0
    capsys.readouterr()
    for args, said in ((["--flavor", "pytorchjob"], "--flavor: --flavor applies to job specs; this is a serving spec"),
                       (["--storage-key-secret", "Bad!"], "--storage-key-secret: 'Bad!' is not a Kubernetes Secret name"),
                       (["--target", "azureml", "--storage-key-secret", "s"], "--storage-key-secret does not apply to --target azureml")):
        assert _exit_code("deploy", "render", spec, "--target", "aks", *args, "--out", str(tmp_path / "x")) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    assert not (tmp_path / "x").exists()
