#!/usr/bin/env bash
# Builds the device kit (see scripts/device/README.md): the two git-ignored folders a lent GPU machine gets
# through the device tool's carry (64 MiB in all), both idempotent to rebuild:
#   .whl/     15 cp312 manylinux (<= 2_28) / pure wheels that azulite serve, bench/serving.py --workers and
#             tests/serve need and the machine (python3 = /opt/torch/.venv, 3.12, no network) lacks
#   .devkit/  triton.tar.xz + setup.sh, preflight.py, run_checks.sh, simulate.sh, kit_notorch.py, README.md
# Needs: `make test` done once (.cache/anchors: the nvidia-pytriton 0.7.0 venv, .cache/anchors/dl's
# tritonclient 2.51.0 wheel), network to PyPI, a libpython3.12.so.1.0 to ship (pyenv 3.12.1's), xz, tar, strip.
#
# triton.tar.xz (top folder triton/, xz --x86 --lzma2=preset=9e,dict=256MiB, one block; ~215 MB unpacked):
#   VERSION                  what is in it (below)
#   libexec/tritonserver     Triton 2.51 from the pytriton wheel (pytriton/tritonserver/bin), unmodified
#   libexec/perf_analyzer    perf_analyzer 2.51 from the tritonclient 2.51.0 wheel (later builds need glibc 2.38)
#   lib/                     the wheel's nvidia_pytriton.libs (41 libs: the NEEDED closure) less libpython3.13
#   backends/python/         libtriton_python.so, triton_python_backend_utils.py, the 3.12 stub
#   palib/                   libb64.so.0d, libcudart.so.12 -> ../lib/... (the names perf_analyzer asks for)
#   pylib/                   libpython3.12.so.1.0 (strip --strip-debug), used only where the machine has none
#   fallback/                libssl.so.3, libcrypto.so.3 -> ../lib/... and libz.so.1 (this machine's), only if missing
#   stubpy/                  numpy 1.26.4 cp312 (no tests/, *.pyi, core/include, f2py/src, _pyinstaller) for the
#                            stub's venv: Triton 2.51's stub sends empty outputs under numpy 2
#   pyfallback/              grpcio 1.85.3 + protobuf 6.33.6 unpacked, only if the machine's are older than
#                            tritonclient 2.73's generated code needs (grpcio >= 1.81.1, protobuf >= 6.33.5)
# Wheels are unpacked with Python's zipfile (modes 644); the tar is reproducible (sorted, root-owned, fixed
# mtime), so an unchanged tree gives the same bytes; the ~2.5 min xz run is skipped when nothing changed.
#
# Knobs: KIT_WHL (.whl)  KIT_DIR (.devkit)  KIT_OUT ($KIT_DIR/triton.tar.xz)  KIT_CACHE (.cache/devkit: downloads,
#        staging tree, manifest)  KIT_ANCHORS (.cache/anchors)  KIT_PYLIB_SRC (libpython3.12.so.1.0 to ship)
#        KIT_PIP_PY (python whose pip downloads: .venv/bin/python, else python3)  KIT_FORCE=1 (always recompress)
set -euo pipefail
umask 022
cd "$(dirname "$0")/../.."
ROOT=$PWD
HERE=$ROOT/scripts/device
WHL=$(realpath -m "${KIT_WHL:-.whl}")
KDIR=$(realpath -m "${KIT_DIR:-.devkit}")
OUTF=$(realpath -m "${KIT_OUT:-$KDIR/triton.tar.xz}")
CACHE=$(realpath -m "${KIT_CACHE:-.cache/devkit}")
ANCH=$(realpath -m "${KIT_ANCHORS:-.cache/anchors}")
PYLIB_SRC=${KIT_PYLIB_SRC:-/root/.pyenv/versions/3.12.1/lib/libpython3.12.so.1.0}
PIP_PY=${KIT_PIP_PY:-}
[[ -n $PIP_PY ]] || { [[ -x .venv/bin/python ]] && PIP_PY=.venv/bin/python || PIP_PY=python3; }
die() { echo "build_kit: $*" >&2; exit 1; }
say() { echo "build_kit: $*"; }

# The wheels of .whl/ (the dev .venv's versions when the kit was first made) and of the tarball's Python parts
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 httptools==0.9.0
        hpack==4.2.0 orjson==3.13.0 tritonclient==2.73.0 python-rapidjson==1.25 geventhttpclient==2.6.1
        gevent==26.9.0 greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 brotli==1.2.1)
STUB_NUMPY=numpy==1.26.4
FALLBACK=(grpcio==1.85.3 protobuf==6.33.6)
# cp312 on x86_64, manylinux up to glibc 2.28 (newest first: pip then prefers the newest tag a release has)
PLATFORMS=()
for v in 28 27 26 25 24 23 22 21 20 19 18 17; do PLATFORMS+=(--platform "manylinux_2_${v}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64
            --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
download() {  # download DIR SPEC...: cp312 wheels, no dependencies (pip reuses files already in DIR)
  local dir=$1; shift
  mkdir -p "$dir"
  "$PIP_PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 "${PLATFORMS[@]}" -d "$dir" "$@" || die "pip download $* failed"
}
wheel_of() {  # wheel_of DIR SPEC: the one wheel in DIR for name==version (wheel names normalise - and . to _)
  local name=${2%%==*} ver=${2##*==} w
  name=$(echo "$name" | tr '.-' '__')
  w=$(find "$1" -maxdepth 1 -iname "${name}-${ver}-*.whl" | sort | head -n 1)
  [[ -n $w ]] || die "no wheel for $2 in $1"
  echo "$w"
}

# ---- 0. what must be here ---------------------------------------------------------------------------------
SITE=$(ls -d "$ANCH"/venv/lib/python3.*/site-packages 2>/dev/null | head -n 1 || true)
[[ -n $SITE && -x $SITE/pytriton/tritonserver/bin/tritonserver && -d $SITE/nvidia_pytriton.libs ]] ||
  die "no nvidia-pytriton in $ANCH/venv: run 'make test' (or scripts/anchors.sh) first"
TC251=$(ls "$ANCH"/dl/tritonclient-2.51.0-*manylinux*x86_64*.whl 2>/dev/null | head -n 1 || true)
[[ -n $TC251 || -x $ANCH/lib/perf_analyzer ]] || die "no tritonclient 2.51.0 wheel in $ANCH/dl: run scripts/anchors.sh"
[[ -f $PYLIB_SRC ]] || die "no libpython3.12.so.1.0 at $PYLIB_SRC (set KIT_PYLIB_SRC)"
LIBZ=$(readlink -f /lib/x86_64-linux-gnu/libz.so.1 2>/dev/null || readlink -f /usr/lib64/libz.so.1 2>/dev/null || true)
[[ -f $LIBZ ]] || die "no libz.so.1 on this machine to ship as the fallback"
for t in xz tar strip sha256sum; do command -v $t >/dev/null || die "$t missing"; done

# ---- 1. .whl/ ---------------------------------------------------------------------------------------------
download "$CACHE/whl" "${WHEELS[@]}"
want=()
for spec in "${WHEELS[@]}"; do want+=("$(wheel_of "$CACHE/whl" "$spec")"); done
mkdir -p "$WHL"
for f in "$WHL"/*.whl; do  # nothing else in .whl/: setup.sh installs every *.whl there
  [[ -e $f ]] || continue
  keep=0; for w in "${want[@]}"; do [[ $(basename "$w") == $(basename "$f") ]] && keep=1; done
  [[ $keep == 1 ]] || { say "removing $(basename "$f") from $WHL"; rm -f "$f"; }
done
for w in "${want[@]}"; do cmp -s "$w" "$WHL/$(basename "$w")" || cp "$w" "$WHL/"; done
say "$WHL: ${#want[@]} wheels, $(du -sb "$WHL" | cut -f1) bytes"

# ---- 2. the Triton tree -----------------------------------------------------------------------------------
download "$CACHE/dl" "$STUB_NUMPY" "${FALLBACK[@]}"
ST=$CACHE/tree/triton
rm -rf "$CACHE/tree" && mkdir -p "$ST"/{libexec,lib,backends/python,palib,pylib,fallback,stubpy,pyfallback}
TS=$SITE/pytriton/tritonserver
LIBS=$SITE/nvidia_pytriton.libs
cp -p "$TS/bin/tritonserver" "$ST/libexec/tritonserver"
if [[ -n $TC251 ]]; then
  python3 - "$TC251" "$ST/libexec/perf_analyzer" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith("/bin/perf_analyzer"))
    with z.open(name) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
else
  cp "$ANCH/lib/perf_analyzer" "$ST/libexec/perf_analyzer"
fi
chmod 755 "$ST/libexec/perf_analyzer" "$ST/libexec/tritonserver"
for f in "$LIBS"/*; do
  case $(basename "$f") in libpython3*) ;; *) cp -p "$f" "$ST/lib/" ;; esac  # the 3.13 stub's libpython: not shipped
done
cp -p "$TS/backends/python/libtriton_python.so" "$TS/backends/python/triton_python_backend_utils.py" "$ST/backends/python/"
cp -p "$TS/python_backend_stubs/3.12/triton_python_backend_stub" "$ST/backends/python/"
(cd "$ST/lib" && ln -s "../lib/$(ls libb64-*.so.0d | head -n 1)" ../palib/libb64.so.0d &&
  ln -s "../lib/$(ls libcudart-*.so.12* | head -n 1)" ../palib/libcudart.so.12 &&
  ln -s "../lib/$(ls libssl-*.so.3 | head -n 1)" ../fallback/libssl.so.3 &&
  ln -s "../lib/$(ls libcrypto-*.so.3 | head -n 1)" ../fallback/libcrypto.so.3) || die "linking palib/ fallback/ failed"
cp "$LIBZ" "$ST/fallback/libz.so.1" && chmod 644 "$ST/fallback/libz.so.1"
strip --strip-debug -o "$ST/pylib/libpython3.12.so.1.0" "$PYLIB_SRC" && chmod 755 "$ST/pylib/libpython3.12.so.1.0"
python3 -m zipfile -e "$(wheel_of "$CACHE/dl" "$STUB_NUMPY")" "$ST/stubpy/"
(cd "$ST/stubpy/numpy" && find . -type d -name tests -prune -exec rm -rf {} + && find . -name '*.pyi' -delete &&
  rm -rf core/include f2py/src _pyinstaller) || die "trimming numpy failed"
for spec in "${FALLBACK[@]}"; do python3 -m zipfile -e "$(wheel_of "$CACHE/dl" "$spec")" "$ST/pyfallback/"; done
cat > "$ST/VERSION" <<'TXT'
Triton Inference Server 2.51 (nvidia-pytriton 0.7.0 wheel: pytriton/tritonserver, nvidia_pytriton.libs), Python backend, 3.12 stub
perf_analyzer 2.51 (tritonclient 2.51.0 wheel)
pylib/libpython3.12.so.1.0: CPython 3.12.1 (pyenv build), used only when the machine has no libpython3.12.so.1.0
fallback/: libssl.so.3, libcrypto.so.3 (the wheel's OpenSSL 3), libz.so.1 (Debian 12), used only when the machine lacks them
stubpy/: numpy 1.26.4 (cp312 wheel, tests removed) for the Python backend stub's venv: Triton 2.51's stub (pybind11 before numpy 2) sends
  empty (0-byte) output tensors under numpy 2.x; setup.sh puts it first in $KIT_TRITON/venv, which the wrapper puts first on PATH
pyfallback/: grpcio 1.85.3 + protobuf 6.33.6 (cp312 wheels, unpacked), copied into the kit venv by setup.sh only when the machine's
  grpcio/protobuf are too old for tritonclient 2.73's generated code (needs grpcio >= 1.81.1, protobuf >= 6.33.5)
TXT
find "$ST" -name __pycache__ -prune -exec rm -rf {} +
[[ $(ls "$ST/lib" | wc -l) -ge 40 && -d $ST/stubpy/numpy && -d $ST/pyfallback/grpc && -d $ST/pyfallback/google ]] ||
  die "staging tree $ST incomplete"
say "staged $ST ($(du -sm "$ST" | cut -f1) MB, $(find "$ST" | wc -l) paths)"

# ---- 3. triton.tar.xz (skipped when the tree and the tarball are those of the last build) -------------------
manifest=$( (cd "$CACHE/tree" && find triton -printf '%y %m %p %l\n' | LC_ALL=C sort &&
             find triton -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -d' ' -f1)
stamp=$CACHE/triton.tar.xz.stamp  # "tree-manifest tarball-sha256 tarball-path"
if [[ ${KIT_FORCE:-0} != 1 && -f $OUTF && -f $stamp ]] &&
   [[ "$(cat "$stamp")" == "$manifest $(sha256sum < "$OUTF" | cut -d' ' -f1) $OUTF" ]]; then
  say "$OUTF up to date ($(stat -c %s "$OUTF") bytes)"
else
  mkdir -p "$(dirname "$OUTF")"
  say "compressing into $OUTF (xz -9e, one thread: ~2.5 min)"
  tar -C "$CACHE/tree" --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00:00Z' -cf - triton |
    xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > "$OUTF.part" || die "tar | xz failed"
  mv "$OUTF.part" "$OUTF"
  echo "$manifest $(sha256sum < "$OUTF" | cut -d' ' -f1) $OUTF" > "$stamp"
  say "$OUTF: $(stat -c %s "$OUTF") bytes"
fi
rm -rf "$CACHE/tree"  # rebuilt on every run (the manifest is what is kept)

# ---- 4. the scripts -----------------------------------------------------------------------------------------
mkdir -p "$KDIR"
for f in setup.sh preflight.py run_checks.sh simulate.sh kit_notorch.py README.md; do
  cmp -s "$HERE/$f" "$KDIR/$f" || cp "$HERE/$f" "$KDIR/$f"
done
chmod 755 "$KDIR/setup.sh" "$KDIR/run_checks.sh" "$KDIR/simulate.sh"
# both folders must stay out of git (the device tool carries ignored paths named in carry)
if [[ $WHL == "$ROOT/.whl" && $KDIR == "$ROOT/.devkit" ]] && gd=$(git rev-parse --git-dir 2>/dev/null); then
  mkdir -p "$gd/info"
  for p in /.whl/ /.devkit/; do grep -qxF "$p" "$gd/info/exclude" 2>/dev/null || echo "$p" >> "$gd/info/exclude"; done
fi
say "kit ready: $WHL ($(du -sb "$WHL" | cut -f1) B) + $KDIR ($(du -sb "$KDIR" | cut -f1) B);" \
    "device call: command 'bash .devkit/run_checks.sh', carry [\".whl\", \".devkit\"]"
