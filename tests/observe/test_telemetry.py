"""``azulite observe``: the real exporter on loopback (no GPU here: GPU series absent, said once; host
metrics from psutil), its exposition linted by promtool, and the DCGM naming and a GPU vanishing mid-run
through the GPU source seam (NVML itself cannot run without an NVIDIA driver)."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import psutil
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from azulite.observe.telemetry import DCGM_FIELDS, GpuSample, GpuUnavailable, NodeCollector, registry_for

AZULITE = str(Path(sys.executable).parent / "azulite")


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_exporter_without_gpus(tmp_path):
    p = subprocess.Popen([AZULITE, "observe", "--port", "0", "--disk", "/", "--disk", str(tmp_path)],
                         env={**os.environ, "AZULITE_HOME": str(tmp_path / "azhome")},
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in p.stderr], daemon=True).start()
    try:
        url = None
        seen = []
        while url is None:
            line = lines.get(timeout=120)
            seen.append(line)
            m = re.search(r"(http://127\.0\.0\.1:\d+/metrics)", line)
            url = m.group(1) if m else None
        first, second = scrape(url), scrape(url)
        fams = families(second)
        assert fams["azulite_gpu_telemetry_up"].samples[0].value == 0
        assert not any(name.startswith("DCGM_") for name in families(first) | fams), "absent, not zero"
        total = fams["azulite_host_memory_total_bytes"].samples[0].value
        assert total == psutil.virtual_memory().total
        paths = {s.labels["path"] for s in fams["azulite_host_disk_free_bytes"].samples}
        assert paths == {"/", str(tmp_path)}
        assert {s.labels["interface"] for s in fams["azulite_host_network_sent_bytes"].samples} >= {"lo"}
        assert fams["azulite_job_store_up"].samples[0].value == 0  # no store in this home: said, not created
        assert not (tmp_path / "azhome").exists()
        lint = subprocess.run(["promtool", "check", "metrics"], input=second, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
    finally:
        p.terminate()
        p.wait(timeout=30)
    while not lines.empty():
        seen.append(lines.get())
    said = [l for l in seen if "GPU metrics absent" in l]
    assert len(said) == 1, seen  # once, not once per scrape


class Gpus:
    """A GPU source whose answers the test scripts: samples, or the reason there are none."""

    def __init__(self) -> None:
        self.answer: list[GpuSample] | str = []

    def read(self) -> list[GpuSample]:
        if isinstance(self.answer, str):
            raise GpuUnavailable(self.answer)
        return self.answer


def test_dcgm_names_labels_and_a_gpu_vanishing_mid_run():
    gpus, said = Gpus(), []
    c = NodeCollector(gpus, hostname="node-7", say=said.append)
    reg = registry_for(c)
    values = {f: float(i + 1) for i, f in enumerate(DCGM_FIELDS)}
    gpus.answer = [GpuSample(0, "GPU-aaaa", "NVIDIA A100-SXM4-80GB", values), GpuSample(1, "GPU-bbbb", "NVIDIA A100-SXM4-80GB", values)]
    fams = families(generate_latest(reg).decode())
    for field, v in values.items():
        samples = fams[field].samples
        assert [s.labels["gpu"] for s in samples] == ["0", "1"]
        assert samples[1].labels == {"gpu": "1", "UUID": "GPU-bbbb", "device": "nvidia1",
                                     "modelName": "NVIDIA A100-SXM4-80GB", "Hostname": "node-7"}
        assert samples[0].value == v
    assert fams["azulite_gpu_telemetry_up"].samples[0].value == 1
    gpus.answer = "NVML: GPU is lost"
    for _ in range(3):
        fams = families(generate_latest(reg).decode())
        assert "DCGM_FI_DEV_GPU_UTIL" not in fams and fams["azulite_gpu_telemetry_up"].samples[0].value == 0
        assert "azulite_host_cpus" in fams  # the rest keeps being exported
    gpus.answer = [GpuSample(0, "GPU-aaaa", "NVIDIA A100-SXM4-80GB", values)]
    assert len(families(generate_latest(reg).decode())["DCGM_FI_DEV_FB_USED"].samples) == 1
    assert said == ["GPU metrics from 2 GPU(s)", "GPU metrics absent: NVML: GPU is lost", "GPU metrics from 1 GPU(s)"]


def test_a_vanished_disk_is_absent_not_an_error(tmp_path):
    gone = tmp_path / "gone"
    c = NodeCollector(Gpus(), hostname="h", disk_paths=("/", str(gone)), say=lambda s: None)
    fams = families(generate_latest(registry_for(c)).decode())
    assert {s.labels["path"] for s in fams["azulite_host_disk_free_bytes"].samples} == {"/"}
