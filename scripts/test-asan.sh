#!/usr/bin/env bash
# make test-asan: builds moegrad, its C++ tests and the Python module with AddressSanitizer and
# UndefinedBehaviorSanitizer (g++), then runs the C++ suite and the Python suite against that
# build (docs/testing.md). Any sanitizer report fails the run (-fno-sanitize-recover=all).
#   usage: scripts/test-asan.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/asan
PY=.venv/bin/python
JOBS=${JOBS:-$(nproc)}

# -O2 plus the sanitizers' -g1 (CMakeLists.txt). The CUDA sources only where a GPU can run
# them: nvcc takes no sanitizer, and without a GPU they would be compiled for nothing
# (docs/decisions.md L108).
CUDA=OFF
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then CUDA=AUTO; fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEGRAD_WITH_CUDA=$CUDA \
  -DMOEGRAD_SANITIZE=address,undefined -DMOEGRAD_BUILD_TESTS=ON -DMOEGRAD_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="$PWD/$PY" >/dev/null
cmake --build "$BUILD" -j "$JOBS"

# The package as installed, but with the instrumented native module.
PKG="$BUILD/pkg/moegrad"
rm -rf "$BUILD/pkg" && mkdir -p "$PKG"
for f in python/moegrad/*.py; do ln -s "$PWD/$f" "$PKG/"; done
cp "$BUILD"/_C.*.so "$PKG/"

# Leak checking stays on for the C++ suite. Python and torch keep allocations alive until exit
# by design (interned objects, caches), which LeakSanitizer would report, so it is off there.
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
echo "== C++ suite (ASan + UBSan, leak checks on)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" -LE packaging

echo "== Python suite against the instrumented module (ASan + UBSan preloaded, leaks off)"
RUNTIME="$(g++ -print-file-name=libasan.so):$(g++ -print-file-name=libubsan.so)"
# torch is not instrumented; ASan must come first in the process (LD_PRELOAD) and must not
# complain about its own interceptors being late.
LD_PRELOAD="$RUNTIME" PYTHONPATH="$PWD/$BUILD/pkg" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:verify_asan_link_order=0 \
  "$PY" -c "import moegrad, sys; assert moegrad._C.__file__.startswith('$PWD/$BUILD/'), moegrad._C.__file__; print('moegrad from', moegrad._C.__file__)"
LD_PRELOAD="$RUNTIME" PYTHONPATH="$PWD/$BUILD/pkg" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:verify_asan_link_order=0 \
  "$PY" -m pytest tests/python -q -p no:cacheprovider "$@"
