"""Node health check (seed 003: verify a node before training starts): every check returns pass, warn,
fail or skipped with what it measured; what cannot be checked on this machine (no GPU, no NVML) is
*skipped with the reason*, never passed. ``azulite doctor`` exits non-zero when a check fails, so a
Kubernetes init container can keep a training pod off a bad node.

GPU facts come through NVML (``nvidia-ml-py``), the library the DCGM exporter and nvidia-smi read; the
probes (matmul TFLOP/s, memory bandwidth, checkpoint write bandwidth) are measured here with torch and the
checkpoint storage layer, so ``az://`` locations are checked through the same code training writes with.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

Status = Literal["pass", "warn", "fail", "skipped"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    measured: float | int | str | None = None
    expected: float | int | str | None = None


@dataclass(frozen=True, kw_only=True)
class Expectations:
    """What this node should have (from the SKU: GPUs, InfiniBand, per-GPU figures) and the floors below
    which a probe warns. ``None`` means unknown: the comparison is skipped, the figure still reported."""

    gpus: int | None = None
    infiniband: bool | None = None
    matmul_tflops: float | None = None  # per GPU, dense, the probe's dtype
    gpu_mem_gbps: float | None = None  # per GPU memory bandwidth
    host_mem_gbps: float = 1.0
    write_gbps: float = 0.1
    shm_warn_bytes: int = 1 << 30  # NCCL and DataLoader workers live in /dev/shm; Docker's 64 MB default breaks them
    shm_fail_bytes: int = 256 << 20
    #: fraction of a SKU figure a probe must reach to pass (probes are short and never hit the peak)
    probe_fraction: float = 0.5


# ---- NVML, behind a seam (a node without GPUs has no library at all) ------------------------------------
@dataclass
class GpuInfo:
    index: int
    name: str
    uuid: str
    ecc_uncorrected: int | None  # volatile; None where ECC is off or unsupported
    throttle_reasons: list[str] = field(default_factory=list)


@dataclass
class NvmlView:
    """What NVML says about this node; ``error`` says why there is nothing (then GPU checks are skipped)."""

    error: str | None = None
    driver: str | None = None
    cuda_driver: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)


# throttle reasons that mean the GPU runs slower than it should (idle and app-clock settings are normal)
_BAD_THROTTLES = {
    "clocksThrottleReasonSwPowerCap": "software power cap",
    "clocksThrottleReasonHwSlowdown": "hardware slowdown",
    "clocksThrottleReasonHwThermalSlowdown": "hardware thermal slowdown",
    "clocksThrottleReasonHwPowerBrakeSlowdown": "power brake",
    "clocksThrottleReasonSwThermalSlowdown": "software thermal slowdown",
}


def read_nvml() -> NvmlView:
    try:
        import pynvml
    except ImportError:
        return NvmlView(error="nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return NvmlView(error=f"NVML unavailable ({exc}): no NVIDIA driver on this machine")
    try:
        view = NvmlView(driver=_s(pynvml.nvmlSystemGetDriverVersion()))
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        view.cuda_driver = f"{cuda // 1000}.{cuda % 1000 // 10}"
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                ecc = pynvml.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                         pynvml.NVML_VOLATILE_ECC)
            except pynvml.NVMLError:
                ecc = None
            try:
                mask = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
                reasons = [text for attr, text in _BAD_THROTTLES.items() if mask & getattr(pynvml, attr, 0)]
            except pynvml.NVMLError:
                reasons = []
            view.gpus.append(GpuInfo(i, _s(pynvml.nvmlDeviceGetName(h)), _s(pynvml.nvmlDeviceGetUUID(h)), ecc, reasons))
        return view
    except pynvml.NVMLError as exc:  # a GPU that vanishes mid-read
        return NvmlView(error=f"NVML failed while reading the GPUs: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ---- the checks ---------------------------------------------------------------------------------------
def check_gpus(nv: NvmlView, exp: Expectations) -> list[Check]:
    if nv.error:
        why = nv.error
        rest = [Check(n, "skipped", why) for n in ("ecc_errors", "driver_cuda", "clock_throttling")]
        if exp.gpus:  # the SKU has GPUs and none can be seen: that node must not take a GPU job
            return [Check("gpus_visible", "fail", f"0 of {exp.gpus} GPU(s) visible: {why}", 0, exp.gpus), *rest]
        return [Check("gpus_visible", "skipped", why), *rest]
    n = len(nv.gpus)
    if exp.gpus is None:
        vis = Check("gpus_visible", "pass" if n else "fail", f"{n} GPU(s) visible (expected count unknown)", n)
    else:
        vis = Check("gpus_visible", "pass" if n == exp.gpus else "fail",
                    f"{n} of {exp.gpus} GPU(s) visible", n, exp.gpus)
    bad_ecc = [g for g in nv.gpus if g.ecc_uncorrected]
    known = [g for g in nv.gpus if g.ecc_uncorrected is not None]
    if bad_ecc:
        ecc = Check("ecc_errors", "fail", "uncorrected ECC errors on " + ", ".join(
            f"GPU {g.index} ({g.ecc_uncorrected})" for g in bad_ecc), sum(g.ecc_uncorrected or 0 for g in bad_ecc), 0)
    elif not known:
        ecc = Check("ecc_errors", "skipped", "ECC is off or not reported on these GPUs")
    else:
        ecc = Check("ecc_errors", "pass", f"no uncorrected ECC errors on {len(known)} GPU(s)", 0, 0)
    import torch

    drv = Check("driver_cuda", "pass" if n else "warn",
                f"driver {nv.driver}, CUDA driver API {nv.cuda_driver}, torch built for CUDA {torch.version.cuda}",
                nv.driver)
    if torch.version.cuda is None:
        drv = Check("driver_cuda", "warn", f"driver {nv.driver} but torch is a CPU build: training will not use the GPUs",
                    nv.driver)
    throttled = [g for g in nv.gpus if g.throttle_reasons]
    thr = (Check("clock_throttling", "warn", "; ".join(f"GPU {g.index}: {', '.join(g.throttle_reasons)}" for g in throttled))
           if throttled else Check("clock_throttling", "pass", "no GPU is held back by power or thermal limits"))
    return [vis, ecc, drv, thr]


def check_nccl_ib(exp: Expectations, environ: dict[str, str], ib_root: str = "/sys/class/infiniband") -> Check:
    devices = sorted(os.listdir(ib_root)) if os.path.isdir(ib_root) else []
    disabled = environ.get("NCCL_IB_DISABLE", "0") not in ("", "0")
    detail = f"InfiniBand devices: {', '.join(devices) or 'none'}; NCCL_IB_DISABLE={environ.get('NCCL_IB_DISABLE', 'unset')}"
    if exp.infiniband is None:
        return Check("nccl_infiniband", "skipped", f"the SKU's InfiniBand is unknown (pass --infiniband/--no-infiniband); {detail}")
    if exp.infiniband:
        if not devices:
            return Check("nccl_infiniband", "fail", f"the SKU has InfiniBand but no device is visible; {detail}", 0, "IB")
        if disabled:
            return Check("nccl_infiniband", "fail", f"NCCL_IB_DISABLE is set on an InfiniBand SKU: NCCL falls back to TCP; {detail}")
        return Check("nccl_infiniband", "pass", detail, len(devices))
    return Check("nccl_infiniband", "pass", f"no InfiniBand expected; {detail}", len(devices))


def probe_matmul(has_gpu: bool, exp: Expectations, n: int = 1024, repeats: int = 3) -> Check:
    import torch

    dev = torch.device("cuda") if has_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if has_gpu else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        if has_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if has_gpu:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    tflops = 2 * n**3 / best / 1e12
    if not has_gpu:
        return Check("matmul_tflops", "skipped", f"no GPU: the GPU probe cannot run (CPU float32 for reference: {tflops:.3f} TFLOP/s)", round(tflops, 4))
    return _against("matmul_tflops", tflops, exp.matmul_tflops, exp.probe_fraction, "TFLOP/s (bf16, one GPU)")


def probe_memory(has_gpu: bool, exp: Expectations, nbytes: int = 256 << 20) -> list[Check]:
    import torch

    from azulite.bench.collectives import memcopy_bandwidth

    host = memcopy_bandwidth(nbytes, torch.device("cpu"))
    out = [Check("host_mem_gbps", "pass" if host >= exp.host_mem_gbps else "warn",
                 f"host memory copy {host:.2f} GB/s (floor {exp.host_mem_gbps:g})", round(host, 3), exp.host_mem_gbps)]
    if not has_gpu:
        out.append(Check("gpu_mem_gbps", "skipped", "no GPU: GPU memory bandwidth cannot be measured"))
    else:
        gpu = memcopy_bandwidth(nbytes, torch.device("cuda"))
        out.append(_against("gpu_mem_gbps", gpu, exp.gpu_mem_gbps, exp.probe_fraction, "GB/s device copy"))
    return out


def _against(name: str, got: float, want: float | None, frac: float, unit: str) -> Check:
    if want is None:
        return Check(name, "pass", f"{got:.2f} {unit} (no SKU figure to compare)", round(got, 3))
    ok = got >= frac * want
    return Check(name, "pass" if ok else "warn", f"{got:.2f} {unit}, SKU figure {want:g} (floor {frac:.0%})", round(got, 3), want)


def probe_write(location: str, exp: Expectations, nbytes: int = 64 << 20, environ: dict[str, str] | None = None) -> Check:
    """Write ``nbytes`` to the checkpoint location (local folder or ``az://``) through the checkpoint
    storage layer, durable (fsync for local), then remove it."""
    from azulite.errors import AzuliteError
    from azulite.train.storage import CheckpointStorage, StorageSettings

    rel = f".azulite-doctor-{uuid.uuid4().hex[:8]}"
    data = os.urandom(1 << 20) * (nbytes >> 20)
    made: list[str] = []  # the folders the probe created, deepest first: removed after it (a probe leaves nothing)
    try:
        st = CheckpointStorage(location, StorageSettings.from_environ(environ if environ is not None else os.environ))
        folder = None if st.remote else os.path.abspath(st.path())
        while folder is not None and not os.path.exists(folder):
            made.append(folder)
            folder = os.path.dirname(folder)
        st.check()  # creates a local folder
        t0 = time.perf_counter()
        if st.remote:
            st.write_exclusive(rel, data)
        else:
            os.makedirs(st.path(), exist_ok=True)
            with open(st.path(rel), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        st.remove_file(rel)
    except (AzuliteError, OSError) as exc:
        return Check("checkpoint_write", "fail", f"cannot write to {location}: {str(exc).splitlines()[0]}")
    finally:
        for folder in made:
            try:
                os.rmdir(folder)
            except OSError:  # not empty: something else wrote there meanwhile; not ours to remove
                break
    gbps = len(data) / 1e9 / dt
    return Check("checkpoint_write", "pass" if gbps >= exp.write_gbps else "warn",
                 f"{gbps:.3f} GB/s durable write of {len(data) >> 20} MB to {location} (floor {exp.write_gbps:g})",
                 round(gbps, 4), exp.write_gbps)


def check_shm(exp: Expectations, path: str = "/dev/shm") -> Check:
    try:
        free = shutil.disk_usage(path).free
    except OSError as exc:
        return Check("dev_shm_free", "fail", f"{path} is not usable: {exc}")
    status: Status = "fail" if free < exp.shm_fail_bytes else "warn" if free < exp.shm_warn_bytes else "pass"
    return Check("dev_shm_free", status, f"{free / 2**30:.1f} GiB free in {path} (warn below {exp.shm_warn_bytes / 2**30:g} GiB)",
                 free, exp.shm_warn_bytes)


def run_checks(exp: Expectations, *, checkpoint: str | None, environ: dict[str, str],
               nvml: Callable[[], NvmlView] = read_nvml, write_bytes: int = 64 << 20) -> list[Check]:
    nv = nvml()
    has_gpu = nv.error is None and len(nv.gpus) > 0
    checks = check_gpus(nv, exp)
    checks.append(check_nccl_ib(exp, environ))
    checks.append(probe_matmul(has_gpu, exp))
    checks += probe_memory(has_gpu, exp)
    checks.append(probe_write(checkpoint, exp, write_bytes, environ) if checkpoint
                  else Check("checkpoint_write", "skipped", "no checkpoint location given (--checkpoint DIR or az://...)"))
    checks.append(check_shm(exp))
    return checks


def failed(checks: list[Check]) -> bool:
    return any(c.status == "fail" for c in checks)


def to_json(checks: list[Check]) -> dict:
    return {"ok": not failed(checks), "checks": [asdict(c) for c in checks],
            "counts": {s: sum(c.status == s for c in checks) for s in ("pass", "warn", "fail", "skipped")}}
