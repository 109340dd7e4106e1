#!/usr/bin/env bash
# Re-runs the kit's simulation on the dev machine (not for the device; heavy: minutes, run it when the machine
# is idle): a stand-in of the device's python3 (a venv of pyenv 3.12.1 with the device's packages, no torch), a
# copy of the working tree + .whl + .devkit, then setup.sh, the shm tests (add_sub_pt left out: no cp312 CPU
# torch here, kit_notorch.py) and a small bench. Usage: bash .devkit/simulate.sh (or scripts/device/simulate.sh),
# after bash scripts/device/build_kit.sh.
# KIT_BASE_OLD=1: grpcio 1.78 / protobuf 5.29 in the stand-in (setup.sh must use its pyfallback/).
# KIT_BASE_PY: the 3.12 interpreter the stand-in is made from (default pyenv's 3.12.1).
set -euo pipefail
src=$(cd "$(dirname "$0")" && git rev-parse --show-toplevel)
[[ -f $src/.devkit/setup.sh && -f $src/.devkit/triton.tar.xz ]] && ls "$src"/.whl/*.whl >/dev/null ||
  { echo "simulate: no kit in $src: bash scripts/device/build_kit.sh first" >&2; exit 1; }
py312=${KIT_BASE_PY:-/root/.pyenv/versions/3.12.1/bin/python3}
base=/tmp/kit-base
if [[ ! -x $base/bin/python3 ]]; then
  "$py312" -m venv $base
  $base/bin/python -m pip install -q numpy==2.5.2 grpcio==1.85.3 protobuf==6.33.6 prometheus-client psutil uvloop typer rich \
    pyyaml pathspec fsspec threadpoolctl onnxruntime==1.30.0 onnx==1.23.1 matplotlib pytest pytest-timeout pytest-xdist requests \
    packaging setuptools wheel tensorboard nvidia-ml-py filelock jinja2 aiohttp ml-dtypes typing-extensions urllib3 certifi \
    onnxscript "cuda-bindings>=13,<14"
  $base/bin/python -m pip uninstall -y -q pydantic pydantic_core annotated-types typing-inspection  # not on the device
fi
if [[ ${KIT_BASE_OLD:-0} == 1 ]]; then
  [[ -x /tmp/kit-base-old/bin/python3 ]] || { "$py312" -m venv /tmp/kit-base-old
    /tmp/kit-base-old/bin/python -m pip install -q --no-deps grpcio==1.78.0 protobuf==5.29.5
    echo "import site; site.addsitedir('$base/lib/python3.12/site-packages')" > /tmp/kit-base-old/lib/python3.12/site-packages/zz_kit_base.pth; }
  base=/tmp/kit-base-old
fi
rm -rf /tmp/kit-repo && mkdir /tmp/kit-repo
(cd "$src" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t /tmp/kit-repo && cp -r .whl .devkit /tmp/kit-repo/)
cd /tmp/kit-repo
export PATH=$base/bin:$PATH
bash .devkit/setup.sh
cp .devkit/kit_notorch.py /tmp/kit_notorch.py
PYTHONPATH=/tmp /tmp/v/bin/python -m pytest -q -p kit_notorch -p no:cacheprovider tests/serve/test_shm.py tests/serve/test_shm_ring.py \
  tests/serve/test_cuda_shm.py 2>&1 | tail -n 3
/tmp/v/bin/python bench/serving.py --workers --anchors /tmp/triton --concurrency 8 --measure-ms 500 --models gil_py \
  --protocols http --no-twins --serve-workers 1 2>&1 | grep -E '^ +(triton|azulite)' | cut -c1-100
