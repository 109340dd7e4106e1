"""``azulite doctor`` on this machine (no GPU: GPU checks skipped with the reason, never passed), the
checks' verdicts on real inputs (/dev/shm, folders, an InfiniBand sysfs tree), and GPU verdicts from an
NVML view (no NVIDIA driver runs here: the view is the seam NVML's reader fills on a GPU node)."""

from __future__ import annotations

import json
import shutil

import pytest

from azulite.bench.doctor import (Check, Expectations, GpuInfo, NvmlView, check_gpus, check_nccl_ib, check_shm,
                                  failed, probe_write, read_nvml)
from tests.cli.test_job_cli import az

GPU_CHECKS = {"gpus_visible", "ecc_errors", "driver_cuda", "clock_throttling", "matmul_tflops", "gpu_mem_gbps"}


def _by_name(checks: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in checks}


def test_doctor_here_skips_what_needs_a_gpu_and_measures_the_rest(tmp_path):
    assert read_nvml().error, "this test expects a machine without an NVIDIA driver"
    p = az("doctor", "--checkpoint", str(tmp_path / "ck"), "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    checks = _by_name(out["checks"])
    for name in GPU_CHECKS:
        assert checks[name]["status"] == "skipped", checks[name]
        assert checks[name]["detail"], name  # the reason
    assert checks["checkpoint_write"]["status"] in ("pass", "warn")
    assert checks["checkpoint_write"]["measured"] > 0
    assert not (tmp_path / "ck").exists(), "the probe's file, and the folder it made for it, are removed"
    (tmp_path / "kept").mkdir()  # a folder that was there stays, empty as it was
    assert az("doctor", "--checkpoint", str(tmp_path / "kept"), "--json").returncode == 0
    assert (tmp_path / "kept").is_dir() and not list((tmp_path / "kept").iterdir())
    assert checks["host_mem_gbps"]["measured"] > 0
    assert checks["dev_shm_free"]["measured"] == pytest.approx(shutil.disk_usage("/dev/shm").free, rel=0.2)
    assert out["ok"] is True and out["counts"]["fail"] == 0


def test_a_sku_with_gpus_on_a_node_without_any_fails_with_exit_1():
    p = az("doctor", "--gpus", "8")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "gpus_visible" in p.stdout and "fail" in p.stdout and "0 of 8" in p.stdout
    assert "Traceback" not in p.stderr


def test_sku_figures_come_from_the_catalog_and_flags_override():
    # ND96asr_v4: 8 GPUs and InfiniBand in the catalog; none here. --no-infiniband overrides the catalog's
    p = az("doctor", "--sku", "ND96asr_v4", "--no-infiniband", "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    checks = _by_name(json.loads(p.stdout)["checks"])
    assert checks["gpus_visible"]["status"] == "fail" and "0 of 8" in checks["gpus_visible"]["detail"]
    assert checks["nccl_infiniband"]["status"] == "pass", checks["nccl_infiniband"]
    p = az("doctor", "--sku", "ND96asr_v9")
    assert p.returncode != 0 and "ND96asr_v9" in p.stdout + p.stderr and "Traceback" not in p.stderr


def test_durable_write_probe_to_az_against_azurite(tmp_path):
    from azure.storage.blob import BlobServiceClient

    from tests.train.azurite import Azurite

    az_ = Azurite(tmp_path / "azurite").start()
    try:
        env = {"AZURE_STORAGE_CONNECTION_STRING": az_.connection_string, "AZULITE_STORAGE_RETRIES": "1"}
        c = probe_write("az://ckpt/run1", Expectations(), nbytes=2 << 20, environ=env)
        assert c.status in ("pass", "warn") and c.measured > 0, c
        assert "2 MB to az://ckpt/run1" in c.detail
        container = BlobServiceClient.from_connection_string(az_.connection_string).get_container_client("ckpt")
        assert [b.name for b in container.list_blobs()] == [], "the probe's blob is removed"
        az_.stop()  # the storage goes away: the probe fails, naming the location
        c = probe_write("az://ckpt/run1", Expectations(), nbytes=1 << 20, environ=env)
        assert c.status == "fail" and "cannot write to az://ckpt/run1" in c.detail, c
    finally:
        az_.stop()


def test_unwritable_checkpoint_location_fails(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    c = probe_write(str(blocker / "ck"), Expectations(), nbytes=1 << 20, environ={})
    assert c.status == "fail" and str(blocker) in c.detail


def test_shm_thresholds_on_the_real_dev_shm():
    free = shutil.disk_usage("/dev/shm").free
    assert check_shm(Expectations(shm_warn_bytes=1, shm_fail_bytes=1)).status == "pass"
    assert check_shm(Expectations(shm_warn_bytes=free * 4, shm_fail_bytes=1)).status == "warn"
    assert check_shm(Expectations(shm_warn_bytes=free * 4, shm_fail_bytes=free * 2)).status == "fail"
    assert check_shm(Expectations(), path="/nonexistent/shm").status == "fail"


def test_infiniband_against_the_sku(tmp_path):
    empty = tmp_path / "ib-none"
    empty.mkdir()
    present = tmp_path / "ib"
    (present / "mlx5_0").mkdir(parents=True)
    assert check_nccl_ib(Expectations(), {}, str(present)).status == "skipped"
    assert check_nccl_ib(Expectations(infiniband=True), {}, str(empty)).status == "fail"
    assert check_nccl_ib(Expectations(infiniband=True), {"NCCL_IB_DISABLE": "1"}, str(present)).status == "fail"
    ok = check_nccl_ib(Expectations(infiniband=True), {}, str(present))
    assert ok.status == "pass" and "mlx5_0" in ok.detail
    assert check_nccl_ib(Expectations(infiniband=False), {}, str(empty)).status == "pass"


def _gpu(i, ecc=0, throttle=()):
    return GpuInfo(i, "NVIDIA A100-SXM4-80GB", f"GPU-{i:08d}", ecc, list(throttle))


def test_gpu_verdicts_from_nvml_facts():
    eight = NvmlView(driver="550.54.15", cuda_driver="12.4", gpus=[_gpu(i) for i in range(8)])
    got = {c.name: c for c in check_gpus(eight, Expectations(gpus=8))}
    assert got["gpus_visible"].status == "pass" and got["ecc_errors"].status == "pass"
    assert got["clock_throttling"].status == "pass"
    seven = NvmlView(driver="550.54.15", cuda_driver="12.4", gpus=[_gpu(i) for i in range(7)])
    assert {c.name: c for c in check_gpus(seven, Expectations(gpus=8))}["gpus_visible"].status == "fail"
    bad = NvmlView(driver="550.54.15", cuda_driver="12.4", gpus=[_gpu(0), _gpu(1, ecc=3, throttle=["hardware slowdown"])])
    got = {c.name: c for c in check_gpus(bad, Expectations(gpus=2))}
    assert got["ecc_errors"].status == "fail" and "GPU 1 (3)" in got["ecc_errors"].detail
    assert got["clock_throttling"].status == "warn" and "hardware slowdown" in got["clock_throttling"].detail
    no_ecc = NvmlView(driver="550", cuda_driver="12.4", gpus=[_gpu(0, ecc=None)])
    assert {c.name: c for c in check_gpus(no_ecc, Expectations())}["ecc_errors"].status == "skipped"


def test_failed_means_any_fail():
    assert not failed([Check("a", "pass", ""), Check("b", "warn", ""), Check("c", "skipped", "")])
    assert failed([Check("a", "pass", ""), Check("b", "fail", "")])
