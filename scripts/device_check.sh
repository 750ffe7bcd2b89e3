#!/usr/bin/env bash
# Device check of the CUDA backend (docs/cuda.md "The device check"): one run on a machine with
# an NVIDIA GPU, within 7 minutes.
#
#   bash scripts/device_check.sh --prepare   # on a machine with apt (no GPU needed): downloads
#                                            # the Debian packages of Highway (libhwy-dev,
#                                            # libhwy1; about 0.6 MB) into scripts/device-deps,
#                                            # which is committed and so travels with the tree,
#                                            # and the wheels of transformers and huggingface_hub
#                                            # at requirements-dev.txt's pins (about 15 MB) into
#                                            # .whl (not committed: carry it to the GPU machine)
#   bash scripts/device_check.sh             # on the GPU machine: build, CUDA tests, memcheck,
#                                            # no-sync + CUDA-graph check of the layer step, GPU
#                                            # benchmark; a table last
#   bash scripts/device_check.sh --dry-run   # anywhere, no GPU: the same steps and budgets with
#                                            # every command replaced by an echo (the test suite
#                                            # runs this, tests/python/test_device_check.py)
#
# The GPU machine needs Python 3 with torch (a CUDA build), nvcc, cmake, ninja, nanobind,
# scikit-build-core, pytest and compute-sanitizer; no internet. Highway comes from the system or
# from scripts/device-deps (unpacked by this script without dpkg). Results go to $OUT (default
# build/device-check): one log per step, test_cuda.xml, bench_cuda.json (rewritten after every
# case, so a timeout keeps the finished ones). Exit status 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEBS=$ROOT/scripts/device-deps
PREFIX=$ROOT/build/device-deps/prefix
DRY=0

case "${1:-}" in
  --prepare)
    set -e
    mkdir -p "$DEBS"
    rm -f "$DEBS"/*.deb
    (cd "$DEBS" && apt-get download libhwy-dev libhwy1)
    du -sh "$DEBS"
    echo "prepared $DEBS (commit it: it travels with the working tree)"
    pins=$(grep -E '^(transformers|huggingface_hub)==' "$ROOT/requirements-dev.txt" | cut -d' ' -f1)
    # huggingface_hub 2's HTTP client, which a GPU machine's older hub lacks
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$ROOT/.whl" $pins \
      httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    du -sh "$ROOT/.whl"
    echo "prepared $ROOT/.whl (the transformers tests on CUDA; carry it to the GPU machine)"
    exit 0 ;;
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: $0 [--prepare | --dry-run]" >&2; exit 2 ;;
esac

# A dry run's steps take no time; DEVICE_CHECK_DRY_STEP_S makes each count as that many seconds
# (a fake clock), so that the test suite can exercise the budget's skipping.
FAKE=0
now() { echo $(( $(date +%s) + FAKE )); }

OUT=${OUT:-$ROOT/build/device-check}
mkdir -p "$OUT"
LOG=$OUT/device_check.log
: >"$LOG"
declare -a ROWS=()
FAILED=0
T_ALL=$(now)

# The whole run must end within 7 minutes (420 s) of device time: each step has its own limit,
# and the limits add up to less than BUDGET_S, which leaves room for the start and the table.
BUDGET_S=${BUDGET_S:-405}
declare -A LIMIT=([build]=120 [tests]=110 [memcheck]=50 [sync]=35 [bench]=85)
STEPS=(build tests memcheck sync bench)

step() {  # step NAME COMMAND... : runs within its limit, logs, records a table row
  local name=$1
  shift
  local limit=${LIMIT[$name]} t0 rc left
  t0=$(now)
  left=$(( BUDGET_S - (t0 - T_ALL) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    ROWS+=("$(printf '%-10s %-12s %5ss  %s' "$name" SKIPPED 0 'time budget spent')")
    FAILED=1
    return
  fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  : >"$OUT/$name.log"
  if [ "$DRY" = 1 ]; then
    echo "dry run: $*" >>"$OUT/$name.log"
    FAKE=$(( FAKE + ${DEVICE_CHECK_DRY_STEP_S:-0} ))
    rc=0
  else
    timeout --kill-after=5 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    rc=$?
  fi
  tail -n 15 "$OUT/$name.log" | tee -a "$LOG"
  local dt=$(( $(now) - t0 ))
  local status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT"; elif [ $rc -ne 0 ]; then status="FAIL rc=$rc"; fi
  [ "$status" = ok ] || FAILED=1
  ROWS+=("$(printf '%-10s %-12s %5ss  %s' "$name" "$status" "$dt" "$(summary_of "$name" | cut -c1-90)")")
}

summary_of() {  # one line of the step's log worth showing in the table
  local f=$OUT/$1.log
  case $1 in
    tests) grep -E "passed|failed|error" "$f" | tail -n 1 ;;
    memcheck) grep -E "ERROR SUMMARY|memcheck calls" "$f" | tail -n 1 ;;
    sync) grep -E "^sync check" "$f" | tail -n 1 ;;
    bench) grep -E "cases, .* failures" "$f" | tail -n 1 ;;
    build) grep -E "cuda_built|build took" "$f" | tail -n 1 ;;
    *) echo "" ;;
  esac
}

total=0
for s in "${STEPS[@]}"; do total=$(( total + LIMIT[$s] )); done
echo "step limits: ${total} s in all, budget ${BUDGET_S} s" | tee -a "$LOG"
if [ "$total" -gt "$BUDGET_S" ] || [ "$BUDGET_S" -gt 420 ]; then
  echo "device_check: the step limits ($total s) exceed the budget ($BUDGET_S s, at most 420)" >&2
  exit 2
fi

PY=${DEVICE_CHECK_PYTHON:-python3}
if [ "$DRY" = 0 ]; then
  nvidia-smi -L 2>&1 | tee -a "$LOG" || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"
fi

# Highway: the system's, else the committed Debian packages, unpacked (ar + tar, no dpkg needed).
have_hwy() { [ -f /usr/include/hwy/highway.h ] || [ -f /usr/local/include/hwy/highway.h ]; }
if ! have_hwy || [ "$DRY" = 1 ]; then
  if ls "$DEBS"/*.deb >/dev/null 2>&1; then
    "$PY" "$ROOT/scripts/unpack_deb.py" "$PREFIX" "$DEBS"/*.deb 2>&1 | tee -a "$LOG"
  else
    echo "no Highway on this machine and none in $DEBS: run --prepare first" | tee -a "$LOG"
  fi
fi
if [ -d "$PREFIX/usr" ]; then  # searched before the system's
  export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
SAN=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$SAN" ] && [ -x "$c" ] && SAN=$c
done
[ "$DRY" = 1 ] && SAN=${SAN:-compute-sanitizer}

# moegrad is installed into its own folder on PYTHONPATH (the system's torch, nanobind and
# scikit-build-core are used). The CUDA code for this GPU only (native); the CPU kernels for this
# CPU only (one Highway target: -march=native with HWY_COMPILE_ONLY_STATIC), which quarters the
# CPU compile time; the CPU results the tests compare with do not depend on the SIMD target.
SITE=$ROOT/build/device-site  # outside $OUT: only results travel back
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# transformers at the tested pin (the GPU machine's own may predate the experts interface or the
# architectures the tests build): wheels from --prepare, when carried along, go next on the path.
WHEELS=${DEVICE_CHECK_WHEELS:-$ROOT/.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  WSITE=$ROOT/build/device-wheels
  if [ "$DRY" = 1 ]; then
    echo "dry run: pip install $WHEELS/*.whl into $WSITE" | tee -a "$LOG"
  else
    rm -rf "$WSITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WSITE" "$WHEELS"/*.whl \
      2>&1 | tail -n 3 | tee -a "$LOG"
  fi
  export PYTHONPATH="$PYTHONPATH:$WSITE"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export PYTHONUNBUFFERED=1
export CXXFLAGS=${DEVICE_CHECK_CXXFLAGS:--march=native -DHWY_COMPILE_ONLY_STATIC=1}
CMAKE_DEFS="-Ccmake.build-type=${DEVICE_CHECK_BUILD_TYPE:-Release} -Ccmake.define.MOEGRAD_WITH_CUDA=ON \
-Ccmake.define.MOEGRAD_CUDA_ARCHS=${DEVICE_CHECK_ARCHS:-native}"

step build bash -c "t0=\$(date +%s); rm -rf '$SITE' && '$PY' -m pip install -q \
  --no-build-isolation --no-deps --target '$SITE' $CMAKE_DEFS \
  -Cbuild-dir='$ROOT/build/device-wheel' '$ROOT' && echo \"build took \$(( \$(date +%s) - t0 )) s\" \
  && cd '$OUT' && '$PY' -c \
  'import moegrad; print(\"cuda_built\", moegrad._C.cuda_built, moegrad.__file__); assert moegrad._C.cuda_built' \
  && { readelf -d '$SITE'/moegrad/_C*.so | grep NEEDED || true; }"

# Every CUDA test: test_cuda.py and the CUDA cases of the transformers tests, spread over xdist
# workers and each held to a minute where the plugins are there (a hang fails one test, not all).
PYARGS=()
if [ "$DRY" = 1 ] || "$PY" -c "import xdist" 2>/dev/null; then PYARGS+=(-n 8); fi
if [ "$DRY" = 1 ] || "$PY" -c "import pytest_timeout" 2>/dev/null; then PYARGS+=(--timeout 60); fi
step tests "$PY" -m pytest "$ROOT/tests/python/test_cuda.py" "$ROOT/tests/python/test_hf.py" -q \
  -p no:cacheprovider -k "cuda and not demo" -rfE "${PYARGS[@]}" --junitxml="$OUT/test_cuda.xml"

# memcheck of a few calls of every operator (not the test suite: under the sanitizer every
# kernel launch is slow, so a small held-back set of calls fits its limit).
if [ -n "$SAN" ]; then
  step memcheck "$SAN" --tool memcheck --error-exitcode 3 "$PY" "$ROOT/scripts/device_calls.py" \
    memcheck
else
  ROWS+=("$(printf '%-10s %-12s %5ss  %s' memcheck MISSING 0 'no compute-sanitizer on PATH or in /usr/local/cuda')")
  FAILED=1
fi

step sync "$PY" "$ROOT/scripts/device_calls.py" sync

step bench "$PY" -m moegrad.bench --device cuda --quick --no-compile --tokens 16384 \
  --json "$OUT/bench_cuda.json"

echo
echo "==================== device check: $(( $(now) - T_ALL )) s ===================="
if [ -f "$OUT/bench.log" ]; then
  sed -n '/^largest case/,$p' "$OUT/bench.log" | head -n 16
fi
printf '%-10s %-12s %6s  %s\n' step status time detail
for r in "${ROWS[@]}"; do echo "$r"; done
exit $FAILED
