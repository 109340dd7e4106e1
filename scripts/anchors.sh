#!/usr/bin/env bash
# The serving anchors azulite is measured and tested against, from PyPI only, into one folder (idempotent):
#   DIR/bin/tritonserver   NVIDIA Triton 2.51, CPU, with its Python backend (shipped in the nvidia-pytriton wheel)
#                          (+ onnxruntime in its venv, for ONNX models wrapped as Python-backend models)
#   DIR/bin/perf_analyzer  Triton's load generator 2.51 (shipped in the tritonclient 2.51.0 wheel; later
#                          builds need glibc 2.38, newer than Debian 12's)
# Usage: scripts/anchors.sh [DIR]   (default: .cache/anchors in the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(realpath -m "${1:-.cache/anchors}")
# onnxruntime (the version of azulite's .venv when there is one: both then compute the same floats) and Pillow
# for Python-backend models that run an ONNX file or decode images (examples/arrcoc)
ort=$(.venv/bin/python -c 'import onnxruntime; print(onnxruntime.__version__)' 2>/dev/null || echo 1.32.0)
extras=("onnxruntime==$ort" pillow)
[[ -x $dir/bin/perf_analyzer && -x $dir/bin/tritonserver ]] && grep -q 'venv/bin:' "$dir/bin/tritonserver" &&
  "$dir/venv/bin/python" -c "import onnxruntime, PIL; assert onnxruntime.__version__ == '$ort'" 2>/dev/null && exit 0
py=${PYTHON:-python3}
mkdir -p "$dir/bin" "$dir/lib" "$dir/backends/python" "$dir/dl"
[[ -x $dir/venv/bin/python ]] || "$py" -m venv "$dir/venv"
vpy=$dir/venv/bin/python
"$vpy" -m pip install -q nvidia-pytriton==0.7.0   # its own venv: it pins numpy < 2
"$vpy" -m pip install -q "${extras[@]}"
read -r site pyver pylib < <("$vpy" -c 'import sys, sysconfig as s
print(s.get_paths()["purelib"], f"{sys.version_info[0]}.{sys.version_info[1]}", s.get_config_var("LIBDIR"))')
triton=$site/pytriton/tritonserver
libs=$site/nvidia_pytriton.libs

if [[ ! -x $dir/lib/perf_analyzer ]]; then
  "$vpy" -m pip download -q --no-deps --only-binary=:all: -d "$dir/dl" tritonclient==2.51.0
  wheel=$(ls "$dir"/dl/tritonclient-2.51.0-*manylinux*x86_64*.whl | head -n 1)
  rm -rf "$dir/dl/unpacked" && "$vpy" -m zipfile -e "$wheel" "$dir/dl/unpacked"
  install -m 755 "$(find "$dir/dl/unpacked" -path '*bin/perf_analyzer' | head -n 1)" "$dir/lib/perf_analyzer"
  rm -rf "$dir/dl/unpacked"
fi
# perf_analyzer links libb64 and libcudart (it runs without a GPU); the pytriton wheel carries both
ln -sf "$(ls "$libs"/libb64-*.so.0d | head -n 1)" "$dir/lib/libb64.so.0d"
ln -sf "$(ls "$libs"/libcudart-*.so.12* | head -n 1)" "$dir/lib/libcudart.so.12"
# Triton's Python backend: its library and utils, and the stub built for this Python version
ln -sf "$triton/backends/python/libtriton_python.so" "$dir/backends/python/libtriton_python.so"
ln -sf "$triton/backends/python/triton_python_backend_utils.py" "$dir/backends/python/triton_python_backend_utils.py"
install -m 755 "$triton/python_backend_stubs/$pyver/triton_python_backend_stub" "$dir/backends/python/"

cat > "$dir/bin/perf_analyzer" <<SH
#!/bin/sh
LD_LIBRARY_PATH="$dir/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$dir/lib/perf_analyzer" "\$@"
SH
cat > "$dir/bin/tritonserver" <<SH
#!/bin/sh
# --model-repository and the ports as usual; the Python backend and the anchors' venv are set here
export LD_LIBRARY_PATH="$pylib:$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export PYTHONPATH="$site\${PYTHONPATH:+:\$PYTHONPATH}"
# The Python-backend stub embeds an isolated interpreter (PYTHONPATH is ignored) that finds its prefix through
# the python3 on PATH: this venv's, so Python models get its numpy < 2 (with numpy 2, Triton 2.51's
# as_numpy() returns garbage for UINT8 inputs and BYTES inputs crash the stub) and its packages.
export PATH="$dir/venv/bin:\$PATH"
exec "$triton/bin/tritonserver" --backend-directory="$dir/backends" "\$@"
SH
chmod +x "$dir/bin/perf_analyzer" "$dir/bin/tritonserver"
"$dir/bin/perf_analyzer" --version >/dev/null 2>&1 || { echo "anchors: perf_analyzer does not run" >&2; exit 1; }
echo "anchors ready: $dir/bin/tritonserver $dir/bin/perf_analyzer"
