#!/usr/bin/env bash
# Device kit setup: run from anywhere as `bash .devkit/setup.sh` (it cds to the repository root). Offline.
# Source: scripts/device/setup.sh, copied into .devkit/ by scripts/device/build_kit.sh (it must live in .devkit/).
#   1. venv $KIT_VENV (default /tmp/v) from $KIT_PYTHON (default python3), sees that python's packages
#   2. installs .whl/*.whl into it (--no-index --no-deps), then azulite from this tree (editable)
#   3. extracts .devkit/triton.tar.xz into $KIT_TRITON (default /tmp/triton), makes the Python stub's venv
#      $KIT_TRITON/venv (numpy 1.26.4, then the machine's packages) and writes
#      $KIT_TRITON/bin/tritonserver and $KIT_TRITON/bin/perf_analyzer (bench/serving.py --anchors $KIT_TRITON)
#   4. links .cache/anchors -> $KIT_TRITON when absent (the tests' paths to tritonserver / perf_analyzer)
#   5. preflight (.devkit/preflight.py): imports, Triton + azulite serve (+ --workers 2) ready and
#      answering right, perf_analyzer runs. KIT_PREFLIGHT=0 skips it.
# KIT_FORCE_PYLIB=1: use the kit's libpython3.12.so.1.0 for Triton's Python stub even if the machine has one.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
[[ -f pyproject.toml && -d src/azulite ]] || { echo "KIT FAIL: run the copy in .devkit/ (bash scripts/device/build_kit.sh makes it)" >&2; exit 1; }
ROOT=$PWD
PY=${KIT_PYTHON:-python3}
VENV=${KIT_VENV:-/tmp/v}
TD=${KIT_TRITON:-/tmp/triton}
us() { local t=$EPOCHREALTIME; echo $(( 10#${t/./} )); }  # microseconds, pure bash (no bc on the machine)
secs() { printf '%d.%02d' $(( $1 / 1000000 )) $(( $1 % 1000000 / 10000 )); }
START=$(us)
LAST=$START
step() {  # step "what was done": prints the seconds it took and the total so far
  local now; now=$(us)
  echo "kit $(secs $((now - LAST)))s (total $(secs $((now - START)))s)  $1"
  LAST=$now
}
die() { echo "KIT FAIL: $*" >&2; exit 1; }

# ---- 0. the machine's python -------------------------------------------------------------------------
command -v "$PY" >/dev/null || die "no $PY on PATH (set KIT_PYTHON)"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' 2>/dev/null ||
  die "$PY is $("$PY" -c 'import sys; print(sys.version)' 2>&1): the kit's wheels are cp312"
ls .whl/*.whl >/dev/null 2>&1 || die ".whl/*.whl missing: carry .whl"
[[ -f .devkit/triton.tar.xz ]] || die ".devkit/triton.tar.xz missing: carry .devkit"
echo "kit: python $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0], "prefix", sys.prefix, "base", sys.base_prefix)')"
echo "kit: glibc $(ldd --version 2>/dev/null | head -n 1 | grep -o '[0-9.]*$'), $(nproc) cores, /dev/shm $(df -h /dev/shm 2>/dev/null | awk 'NR==2 {print $2}')"

# ---- 3 (in the background while the venv is made). Triton ------------------------------------------
rm -rf "$TD" && mkdir -p "$TD" || die "cannot create $TD"
(
  if command -v xz >/dev/null; then
    xz -dc -T0 .devkit/triton.tar.xz | tar -x -C "$TD" --strip-components=1
  else  # no xz-utils: Python's lzma
    "$PY" -c 'import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    for m in t.getmembers():
        m.name = m.name.split("/", 1)[1] if "/" in m.name else "."
    t.extractall(sys.argv[2], members=[m for m in t.getmembers() if m.name != "."])' .devkit/triton.tar.xz "$TD"
  fi
) > "$TD.extract.log" 2>&1 &
EXTRACT=$!

# ---- 1. the venv -------------------------------------------------------------------------------------
rm -rf "$VENV"
"$PY" -m venv --without-pip --system-site-packages "$VENV" || die "python3 -m venv failed"
# --system-site-packages gives the *base* interpreter's packages; when python3 is itself a venv (e.g.
# /opt/torch/.venv) its packages would be missing: a .pth adds every site dir python3 sees, after the venv's.
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" - > "$SP/_kit_base_site.pth" <<'PY'
import sys
dirs = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
print("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in dirs))
PY
"$VENV/bin/python" -m pip --version >/dev/null 2>&1 || "$VENV/bin/python" -m ensurepip -q >/dev/null 2>&1 ||
  die "no pip: neither $PY's pip nor ensurepip"
step "venv $VENV ($(cat "$SP/_kit_base_site.pth" | grep -o "addsitedir" | wc -l) base site dirs added)"

# ---- 2. wheels and azulite ----------------------------------------------------------------------------
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
  --disable-pip-version-check .whl/*.whl || die "pip install .whl/*.whl failed"
step "wheels: $(ls .whl/*.whl | wc -l) installed into $VENV"
if ! "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check \
     -e . > /tmp/kit-pip-azulite.log 2>&1; then
  # no (recent enough) setuptools: the same by hand: src/ on the path and the console script
  echo "kit: pip install -e . failed (tail below); installing azulite by a .pth instead"; tail -n 5 /tmp/kit-pip-azulite.log
  echo "$ROOT/src" > "$SP/azulite-src.pth"
  printf '#!%s\nimport sys\nfrom azulite.cli import main\nsys.exit(main())\n' "$VENV/bin/python" > "$VENV/bin/azulite"
  chmod +x "$VENV/bin/azulite"
fi
[[ -x $VENV/bin/azulite ]] || die "no $VENV/bin/azulite"
where=$("$VENV/bin/python" -c 'import azulite, os; print(os.path.dirname(azulite.__file__))') || die "import azulite failed"
[[ $where == "$ROOT/src/azulite" ]] || die "azulite imports from $where, not $ROOT/src/azulite"
step "azulite from $ROOT/src -> $VENV/bin/azulite"

# ---- 3. Triton: wrappers ------------------------------------------------------------------------------
wait "$EXTRACT" || { cat "$TD.extract.log"; die "extracting .devkit/triton.tar.xz into $TD failed"; }
[[ -x $TD/libexec/tritonserver && -x $TD/libexec/perf_analyzer && -d $TD/stubpy/numpy ]] || die "$TD incomplete after extraction"
# The Python stub's own venv: numpy 1.26.4 first (Triton 2.51's stub sends empty output tensors under numpy 2),
# then every package python3 sees (the same .pth as the kit venv's)
"$PY" -m venv --without-pip --system-site-packages "$TD/venv" || die "python3 -m venv $TD/venv failed"
TSP=$("$TD/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mv "$TD"/stubpy/* "$TSP"/ && rmdir "$TD/stubpy" && cp "$SP/_kit_base_site.pth" "$TSP/" || die "stub venv: moving numpy failed"
"$TD/venv/bin/python" -c 'import numpy; assert numpy.__version__ == "1.26.4", numpy.__file__' ||
  die "the stub venv $TD/venv does not import its numpy 1.26.4"
# tritonclient 2.73's generated code (azulite.serve.proto imports it) needs grpcio >= 1.81.1, protobuf >= 6.33.5:
# the machine's when they do, else the kit's (pyfallback/: grpcio 1.85.3, protobuf 6.33.6) into the kit venv
grpc_check='import grpc, google.protobuf as p, tritonclient.grpc.service_pb2_grpc; print("grpcio", grpc.__version__, "protobuf", p.__version__)'
if ! have=$("$VENV/bin/python" -c "$grpc_check" 2>&1); then
  echo "kit: the machine's grpcio/protobuf do not fit tritonclient 2.73 ($(echo "$have" | tail -n 1 | cut -c1-200))"
  cp -a "$TD"/pyfallback/* "$SP"/ || die "copying $TD/pyfallback into $SP failed"
  have=$("$VENV/bin/python" -c "$grpc_check" 2>&1) || die "grpc still broken with the kit's grpcio/protobuf: $have"
  have="$have (the kit's)"
fi
rm -rf "$TD/pyfallback"
echo "kit: $(echo "$have" | tail -n 1)"
# libpython3.12.so.1.0 for the Python backend's 3.12 stub: the machine's when it has one, else the kit's
pylib=""
if [[ ${KIT_FORCE_PYLIB:-0} == 1 ]]; then
  pylib=$TD/pylib
else
  libdir=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
  if [[ -n $libdir && -e $libdir/libpython3.12.so.1.0 ]]; then
    pylib=$libdir
  elif ldconfig -p 2>/dev/null | grep -q 'libpython3\.12\.so\.1\.0 '; then
    pylib=""  # on the loader's own path
  else
    pylib=$TD/pylib
  fi
fi
[[ -n $pylib && $pylib != "$TD/pylib" ]] && rm -rf "$TD/pylib"
echo "kit: libpython3.12.so.1.0 for the stub: ${pylib:-the loader default path}"
# libssl.so.3 / libcrypto.so.3 / libz.so.1 from the machine, the kit's copies only where missing
fallback=""
command -v ldd >/dev/null || { echo "kit: no ldd: library checks skipped"; ldd() { :; }; }
for exe in libexec/tritonserver libexec/perf_analyzer; do
  if LD_LIBRARY_PATH="$TD/lib:$TD/palib" ldd "$TD/$exe" 2>/dev/null | grep -q 'not found'; then fallback=$TD/fallback; fi
done
[[ -n $fallback ]] && echo "kit: the machine lacks $(LD_LIBRARY_PATH="$TD/lib:$TD/palib" ldd "$TD/libexec/perf_analyzer" "$TD/libexec/tritonserver" | grep 'not found' | awk '{print $1}' | sort -u | tr '\n' ' '): using $TD/fallback"
mkdir -p "$TD/bin"
cat > "$TD/bin/tritonserver" <<SH
#!/bin/sh
# written by .devkit/setup.sh: Triton 2.51 with its Python backend (3.12 stub); --model-repository and ports as usual
export LD_LIBRARY_PATH="$TD/lib${pylib:+:$pylib}${fallback:+:$fallback}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
# The stub embeds an isolated interpreter that finds its prefix through the python3 on PATH: $TD/venv's, so
# Python models get its numpy 1.26.4 (numpy 2: empty outputs) and then the machine's packages.
export PATH="$TD/venv/bin:\$PATH"
exec "$TD/libexec/tritonserver" --backend-directory="$TD/backends" "\$@"
SH
cat > "$TD/bin/perf_analyzer" <<SH
#!/bin/sh
# written by .devkit/setup.sh: perf_analyzer 2.51 (tritonclient 2.51.0's)
LD_LIBRARY_PATH="$TD/palib:$TD/lib${fallback:+:$fallback}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$TD/libexec/perf_analyzer" "\$@"
SH
chmod +x "$TD/bin/tritonserver" "$TD/bin/perf_analyzer"
for exe in tritonserver perf_analyzer; do
  miss=$(LD_LIBRARY_PATH="$TD/lib:$TD/palib:${pylib:+$pylib:}$fallback" ldd "$TD/libexec/$exe" 2>&1 | grep 'not found')
  [[ -z $miss ]] || die "$exe: libraries not found: $miss"
done
miss=$(LD_LIBRARY_PATH="$TD/lib:${pylib:+$pylib:}$fallback" ldd "$TD/backends/python/triton_python_backend_stub" \
  "$TD/backends/python/libtriton_python.so" 2>&1 | grep 'not found')
[[ -z $miss ]] || die "python backend: libraries not found: $miss"
step "Triton extracted to $TD ($(du -sm "$TD" | cut -f1) MB), bin/tritonserver and bin/perf_analyzer written"

# ---- 4. the tests' and the bench's default anchors path ------------------------------------------------
if [[ ${KIT_LINK_ANCHORS:-1} == 1 && ! -e .cache/anchors ]]; then
  mkdir -p .cache && ln -s "$TD" .cache/anchors && echo "kit: .cache/anchors -> $TD"
fi

# ---- 5. preflight -------------------------------------------------------------------------------------
"$VENV/bin/azulite" --help >/dev/null 2>&1 || die "azulite --help failed: $("$VENV/bin/azulite" --help 2>&1 | tail -n 5)"
step "azulite --help"
if [[ ${KIT_PREFLIGHT:-1} == 1 ]]; then
  "$VENV/bin/python" .devkit/preflight.py "$TD" || die "preflight failed (above)"
  step "preflight"
fi
echo "KIT READY in $(secs $(( $(us) - START ))) s:"
echo "  $VENV/bin/python bench/serving.py --workers --anchors $TD ..."
echo "  $VENV/bin/python -m pytest -q tests/serve/test_shm.py ..."
