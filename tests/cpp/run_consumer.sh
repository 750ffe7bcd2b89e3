#!/usr/bin/env bash
# Installs the built library into a temporary prefix, then configures, builds and runs
# tests/consumer against it with find_package(moegrad CONFIG REQUIRED) and
# -DCMAKE_PREFIX_PATH=<prefix>. Registered as the CTest test moegrad_find_package_consumer.
# Usage: run_consumer.sh <cmake> <build dir> <consumer source dir> [generator] [make program]
#                        [C compiler] [C++ compiler] [config] [executable name]
# (also builds examples/c standalone: moegrad_c_example_standalone)
set -euo pipefail
cmake=$1
build=$2
src=$3
gen=${4:-}
make_program=${5:-}
cc=${6:-}
cxx=${7:-}
config=${8:-}
exe_name=${9:-moegrad_consumer}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moegrad-consumer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

echo "== install into $prefix"
"$cmake" --install "$build" --prefix "$prefix" ${config:+--config "$config"}

echo "== configure $src"
args=(-S "$src" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release
      -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
[[ -n $gen ]] && args+=(-G "$gen")
[[ -n $make_program ]] && args+=(-DCMAKE_MAKE_PROGRAM="$make_program")
[[ -n $cc ]] && args+=(-DCMAKE_C_COMPILER="$cc")
[[ -n $cxx ]] && args+=(-DCMAKE_CXX_COMPILER="$cxx")
"$cmake" "${args[@]}"

# The package must come from the temporary prefix, not from the build tree or the system.
found=$(sed -n 's/^moegrad_DIR:[A-Z]*=//p' "$tmp/build/CMakeCache.txt")
echo "moegrad_DIR=$found"
case $found in
  "$prefix"/*) ;;
  *) echo "find_package(moegrad) did not resolve to the installed prefix" >&2; exit 1 ;;
esac

echo "== build"
"$cmake" --build "$tmp/build" ${config:+--config "$config"}

echo "== run"
exe=$(find "$tmp/build" -type f -name "$exe_name" -perm -u+x | head -n 1)
if command -v ldd >/dev/null 2>&1; then
  lib=$(ldd "$exe" | awk '/libmoegrad/ { print $3 }')
  echo "libmoegrad resolved to: $lib"
  case $lib in
    "$prefix"/*) ;;
    *) echo "the consumer does not load the installed libmoegrad" >&2; exit 1 ;;
  esac
fi
"$exe"
