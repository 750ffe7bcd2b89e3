#!/usr/bin/env bash
# make test-asan: builds moegrad, its C++ tests and the Python module with AddressSanitizer and
# UndefinedBehaviorSanitizer (g++), then runs the C++ suite and the Python suite against that
# build (docs/testing.md). Any sanitizer report fails the run (-fno-sanitize-recover=all).
#   usage: scripts/test-asan.sh [pytest args...]
#   ASAN_STEPS: the steps to run, of "build cpp python" (default: all three, in that order)
#   PYTEST_JOBS: pytest-xdist workers of the Python suite (0: one process)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/asan
PY=.venv/bin/python
JOBS=${JOBS:-$(nproc)}

STEPS=" ${ASAN_STEPS:-build cpp python} "
PYTEST_JOBS=${PYTEST_JOBS:-$JOBS}

# -O2 plus the sanitizers' -g1 (CMakeLists.txt). No CUDA sources: nvcc takes no sanitizer, the
# CUDA kernels are checked with compute-sanitizer. One Highway SIMD target (AVX-512, over an
# SSE4 baseline): the plain C++ suite tests every target (L108, L211).
if [[ $STEPS == *" build "* ]]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEGRAD_WITH_CUDA=OFF \
    -DMOEGRAD_HWY_ONE_TARGET=ON -DMOEGRAD_SANITIZE=address,undefined -DMOEGRAD_BUILD_TESTS=ON \
    -DMOEGRAD_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PWD/$PY" >/dev/null
  cmake --build "$BUILD" -j "$JOBS"
fi

# Leak checking stays on for the C++ suite. Python and torch keep allocations alive until exit
# by design (interned objects, caches), which LeakSanitizer would report, so it is off there.
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
if [[ $STEPS == *" cpp "* ]]; then
  echo "== C++ suite (ASan + UBSan, leak checks on)"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
    ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" -LE packaging
fi
[[ $STEPS == *" python "* ]] || exit 0

# The package as installed (its modules and subpackages), but with the instrumented native module.
PKG="$BUILD/pkg/moegrad"
rm -rf "$BUILD/pkg" && mkdir -p "$PKG"
for f in python/moegrad/*; do
  case "$(basename "$f")" in __pycache__|_C.*) ;; *) ln -s "$PWD/$f" "$PKG/" ;; esac
done
cp "$BUILD"/_C.*.so "$PKG/"

echo "== Python suite against the instrumented module (ASan + UBSan preloaded, leaks off)"
RUNTIME="$(g++ -print-file-name=libasan.so):$(g++ -print-file-name=libubsan.so)"
# torch is not instrumented; ASan must come first in the process (LD_PRELOAD) and must not
# complain about its own interceptors being late.
LD_PRELOAD="$RUNTIME" PYTHONPATH="$PWD/$BUILD/pkg" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:verify_asan_link_order=0 \
  "$PY" -c "import moegrad, sys; assert moegrad._C.__file__.startswith('$PWD/$BUILD/'), moegrad._C.__file__; print('moegrad from', moegrad._C.__file__)"
LD_PRELOAD="$RUNTIME" PYTHONPATH="$PWD/$BUILD/pkg" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:verify_asan_link_order=0 \
  "$PY" -m pytest tests/python -q -p no:cacheprovider -n "$PYTEST_JOBS" "$@"
