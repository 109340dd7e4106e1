"""Node telemetry on a Prometheus endpoint (``azulite observe``): GPU metrics read through NVML under the
DCGM exporter's field names and labels, so dashboards and the alert rules of seed 001 §2.5 work unchanged
against either, plus CPU, memory, disk and network from psutil.

Everything is read at scrape time by one custom collector (no background thread, no stale cache). Without
GPUs (no driver, no devices, or NVML failing mid-run) the GPU series are *absent*, never zero: a zero
would read as an idle GPU. ``azulite_gpu_telemetry_up`` says whether they are there, and the exporter
logs the reason once per change, not once per scrape.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger("azulite.observe")

#: DCGM field -> (help, unit note); values as dcgm-exporter reports them (MiB, °C, W, %)
DCGM_FIELDS = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "Memory utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
}
GPU_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    model: str
    values: dict[str, float]  # DCGM field name -> value


class GpuSource(Protocol):
    def read(self) -> list[GpuSample]:
        """This node's GPUs now. Raises :class:`GpuUnavailable` with the reason when there are none to read."""
        ...


class GpuUnavailable(Exception):
    pass


class NvmlSource:
    """NVML (``nvidia-ml-py``): initialised lazily and again after a failure, so a driver that comes back
    (or a GPU that reappears) is picked up without restarting the exporter."""

    def __init__(self) -> None:
        self._ready = False

    def read(self) -> list[GpuSample]:
        try:
            import pynvml
        except ImportError:
            raise GpuUnavailable("nvidia-ml-py is not installed") from None
        try:
            if not self._ready:
                pynvml.nvmlInit()
                self._ready = True
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                util = pynvml.nvmlDeviceGetUtilizationRates(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                out.append(GpuSample(i, _s(pynvml.nvmlDeviceGetUUID(h)), _s(pynvml.nvmlDeviceGetName(h)), {
                    "DCGM_FI_DEV_GPU_UTIL": util.gpu,
                    "DCGM_FI_DEV_MEM_COPY_UTIL": util.memory,
                    "DCGM_FI_DEV_FB_USED": mem.used / 2**20,
                    "DCGM_FI_DEV_FB_FREE": mem.free / 2**20,
                    "DCGM_FI_DEV_GPU_TEMP": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                    "DCGM_FI_DEV_POWER_USAGE": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                }))
        except pynvml.NVMLError as exc:
            self._ready = False
            raise GpuUnavailable(f"NVML: {exc}") from None
        if not out:
            raise GpuUnavailable("NVML sees no GPU on this node")
        return out


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NodeCollector(Collector):
    """One scrape = one read of NVML and psutil. ``disk_paths`` are the mount points whose use is
    exported (the checkpoint and data disks)."""

    def __init__(self, gpus: GpuSource | None = None, *, hostname: str | None = None,
                 disk_paths: tuple[str, ...] = ("/",), say: Callable[[str], None] = log.warning) -> None:
        self.gpus = gpus if gpus is not None else NvmlSource()
        self.hostname = hostname or socket.gethostname()
        self.disk_paths = disk_paths
        self._say = say
        self._last_gpu_state: str | None = None  # what was last said, to say each change once

    def collect(self) -> Iterator[Metric]:
        yield from self._gpu_metrics()
        yield from self._host_metrics()

    def _gpu_metrics(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("azulite_gpu_telemetry_up", "1 when GPU metrics are exported, 0 when there are none (see the exporter's log).")
        try:
            samples = self.gpus.read()
        except GpuUnavailable as exc:
            self._tell(f"GPU metrics absent: {exc}")
            up.add_metric([], 0)
            yield up
            return
        self._tell(f"GPU metrics from {len(samples)} GPU(s)")
        up.add_metric([], 1)
        yield up
        for field, help_ in DCGM_FIELDS.items():
            fam = GaugeMetricFamily(field, help_, labels=GPU_LABELS)
            for g in samples:
                if field in g.values:
                    fam.add_metric([str(g.index), g.uuid, f"nvidia{g.index}", g.model, self.hostname], g.values[field])
            yield fam

    def _tell(self, state: str) -> None:
        if state != self._last_gpu_state:
            self._last_gpu_state = state
            self._say(state)

    def _host_metrics(self) -> Iterator[Metric]:
        host = [self.hostname]
        cpu = GaugeMetricFamily("azulite_host_cpu_utilization_percent", "CPU busy since the last scrape, all cores (%).", labels=["Hostname"])
        cpu.add_metric(host, psutil.cpu_percent(interval=None))
        yield cpu
        cores = GaugeMetricFamily("azulite_host_cpus", "Logical CPUs.", labels=["Hostname"])
        cores.add_metric(host, psutil.cpu_count() or 0)
        yield cores
        load = GaugeMetricFamily("azulite_host_load1", "1-minute load average.", labels=["Hostname"])
        load.add_metric(host, psutil.getloadavg()[0])
        yield load
        vm = psutil.virtual_memory()
        for name, value, h in (("azulite_host_memory_total_bytes", vm.total, "Physical memory."),
                               ("azulite_host_memory_available_bytes", vm.available, "Memory available without swapping.")):
            m = GaugeMetricFamily(name, h, labels=["Hostname"])
            m.add_metric(host, value)
            yield m
        dtotal = GaugeMetricFamily("azulite_host_disk_total_bytes", "Size of the filesystem.", labels=["Hostname", "path"])
        dfree = GaugeMetricFamily("azulite_host_disk_free_bytes", "Free space on the filesystem.", labels=["Hostname", "path"])
        for path in self.disk_paths:
            try:
                du = psutil.disk_usage(path)
            except OSError:
                continue  # a mount that went away: absent, like a vanished GPU
            dtotal.add_metric([self.hostname, path], du.total)
            dfree.add_metric([self.hostname, path], du.free)
        yield dtotal
        yield dfree
        sent = CounterMetricFamily("azulite_host_network_sent_bytes", "Bytes sent per interface.", labels=["Hostname", "interface"])
        recv = CounterMetricFamily("azulite_host_network_received_bytes", "Bytes received per interface.", labels=["Hostname", "interface"])
        for nic, c in psutil.net_io_counters(pernic=True).items():
            sent.add_metric([self.hostname, nic], c.bytes_sent)
            recv.add_metric([self.hostname, nic], c.bytes_recv)
        yield sent
        yield recv


def registry_for(collector: NodeCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg
