#!/usr/bin/env bash
# Device check of the CUDA backend (docs/cuda.md): one run on a machine with an NVIDIA GPU.
#
#   bash scripts/device_check.sh --prepare   # on a machine with apt and pip access (no GPU
#                                            # needed): fetches what the GPU machine may lack into
#                                            # build/device-deps (Highway from Debian packages,
#                                            # compute-sanitizer from its PyPI wheel)
#   bash scripts/device_check.sh             # on the GPU machine: build moegrad with CUDA for
#                                            # this GPU, CUDA tests, compute-sanitizer memcheck on
#                                            # a small subset, GPU benchmark, short demo; a table
#                                            # last. Under 8 minutes on one H200 with 16 cores.
#
# The GPU machine needs Python 3 with torch (a CUDA build), nvcc, cmake, ninja, nanobind,
# scikit-build-core and pytest. Results go to $OUT (default build/device-check). Exit status 0
# only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEPS=$ROOT/build/device-deps
PREFIX=$DEPS/prefix
SANITIZER_WHEEL_VERSION="13.0.*"

if [ "${1:-}" = "--prepare" ]; then
  set -e
  rm -rf "$DEPS" && mkdir -p "$DEPS/debs" "$PREFIX"
  (cd "$DEPS/debs" && apt-get download libhwy-dev libhwy1)
  for d in "$DEPS"/debs/*.deb; do dpkg -x "$d" "$PREFIX"; done
  rm -rf "$DEPS/debs" "$PREFIX/usr/share"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$DEPS/wheels" \
    "nvidia-cuda-sanitizer-api==$SANITIZER_WHEEL_VERSION" || echo "no compute-sanitizer wheel"
  if ls "$DEPS"/wheels/*.whl >/dev/null 2>&1; then
    mkdir -p "$DEPS/sanitizer"
    python3 -m zipfile -e "$DEPS"/wheels/*.whl "$DEPS/sanitizer"
    rm -rf "$DEPS/wheels"
    find "$DEPS/sanitizer" -name compute-sanitizer -type f -exec chmod +x {} +
    find "$DEPS/sanitizer" -name "*.so*" -exec chmod +x {} +
    find "$DEPS/sanitizer" -path "*bin/*" -type f -exec chmod +x {} +
  fi
  du -sh "$DEPS"
  echo "prepared $DEPS: pass it to the GPU machine (device tool: carry [\"build/device-deps\"])"
  exit 0
fi

OUT=${OUT:-$ROOT/build/device-check}
mkdir -p "$OUT"
LOG=$OUT/device_check.log
: >"$LOG"
declare -a ROWS=()
FAILED=0
T_ALL=$(date +%s)

BUDGET_S=${BUDGET_S:-470}  # the whole script; each step also has its own limit

step() {  # step NAME TIMEOUT_S COMMAND... : runs, logs, records a table row
  local name=$1 limit=$2
  shift 2
  local t0 rc left
  t0=$(date +%s)
  left=$(( BUDGET_S - (t0 - T_ALL) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    ROWS+=("$(printf '%-12s %-12s %6ss  %s' "$name" SKIPPED 0 'time budget spent')")
    FAILED=1
    return
  fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  : >"$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$name.log" | tee -a "$LOG"
  local dt=$(( $(date +%s) - t0 ))
  local status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT"; elif [ $rc -ne 0 ]; then status="FAIL rc=$rc"; fi
  [ "$status" = ok ] || FAILED=1
  ROWS+=("$(printf '%-12s %-12s %6ss  %s' "$name" "$status" "$dt" "$(summary_of "$name")")")
}

summary_of() {  # one line of the step's log worth showing in the table
  local f=$OUT/$1.log
  case $1 in
    tests|memcheck) grep -E "passed|failed|error" "$f" | tail -n 1 ;;
    memcheck-raw) grep -E "ERROR SUMMARY" "$f" | tail -n 1 ;;
    bench) grep -E "cases, .* failures" "$f" | tail -n 1 ;;
    demo) grep -iE "loss|final|check" "$f" | tail -n 1 | cut -c1-80 ;;
    build) grep -E "cuda_built" "$f" | tail -n 1 ;;
    *) echo "" ;;
  esac
}

nvidia-smi -L 2>&1 | tee -a "$LOG" || true
"${DEVICE_CHECK_PYTHON:-python3}" -c "import torch; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"

# Highway: the system's, else the prepared prefix.
CMAKE_DEFS=(-Ccmake.define.MOEGRAD_WITH_CUDA=ON
           "-Ccmake.define.MOEGRAD_CUDA_ARCHS=${DEVICE_CHECK_ARCHS:-native}")
if [ -d "$PREFIX/usr" ]; then  # searched before the system's
  export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# compute-sanitizer: the toolkit's, else the prepared wheel's.
SAN=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$SAN" ] && [ -x "$c" ] && SAN=$c
done
if [ -z "$SAN" ] && [ -d "$DEPS/sanitizer" ]; then
  SAN=$(find "$DEPS/sanitizer" -name compute-sanitizer -type f | head -n 1)
fi

# moegrad is installed into its own folder on PYTHONPATH (no venv needed; the system's torch,
# nanobind and scikit-build-core are used). DEVICE_CHECK_PYTHON picks another interpreter.
PY=${DEVICE_CHECK_PYTHON:-python3}
SITE=$ROOT/build/device-site  # outside $OUT: only results travel back
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
step build 150 bash -c "rm -rf '$SITE' && '$PY' -m pip install -q --no-build-isolation --no-deps \
  --target '$SITE' ${CMAKE_DEFS[*]} -Cbuild-dir='$ROOT/build/device-wheel' '$ROOT' && \
  cd '$OUT' && '$PY' -c \
  'import moegrad; print(\"cuda_built\", moegrad._C.cuda_built, moegrad.__file__); assert moegrad._C.cuda_built'"

step tests 130 "$PY" -m pytest "$ROOT/tests/python/test_cuda.py" -q -p no:cacheprovider \
  -k "not demo" --junitxml="$OUT/test_cuda.xml"

if [ -n "$SAN" ]; then
  step memcheck 80 "$SAN" --tool memcheck --error-exitcode 3 --target-processes all \
    "$PY" -m pytest "$ROOT/tests/python/test_cuda.py" -q -x -p no:cacheprovider \
    -k "invalid or misaligned or uncovered or ties or large_n"
else
  echo "compute-sanitizer not found: memcheck skipped" | tee -a "$LOG"
  ROWS+=("$(printf '%-12s %-12s %6ss  %s' memcheck MISSING 0 'no compute-sanitizer (run --prepare)')")
  FAILED=1
fi

step bench 80 "$PY" -m moegrad.bench --device cuda --quick --json "$OUT/bench_cuda.json"

DATA=$OUT/demo_text.txt
cat "$ROOT"/docs/*.md "$ROOT"/README.md >"$DATA"
step demo 40 "$PY" -m moegrad.demo --device cuda --steps 20 --data "$DATA" --quiet \
  --check-every 10 --json "$OUT/demo.json"

echo
echo "==================== device check: $(( $(date +%s) - T_ALL )) s ===================="
if [ -f "$OUT/bench.log" ]; then
  sed -n '/^largest case/,$p' "$OUT/bench.log" | head -n 16
fi
printf '%-12s %-12s %7s  %s\n' step status time detail
for r in "${ROWS[@]}"; do echo "$r"; done
exit $FAILED
