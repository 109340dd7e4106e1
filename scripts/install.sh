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
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }
pip install --upgrade pip
# torch first and pinned: this version's CPU build lies on disk; any other pulls GBs of CUDA wheels.
pip install torch==2.13.0
if [[ $mode == runtime ]]; then
  pip install -e .
else
  pip install -e ".[dev]"
  # --- dev: section per part; each installs what its tests run against -------------------------
  # (sections are appended below by the parts that need them)
fi
"$venv/bin/python" -c "import torch, azulite" || { echo "install failed: torch or azulite does not import" >&2; exit 1; }
rm -f "$venv"/.installed-"$mode"-*
touch "$stamp"
