#!/usr/bin/env bash
# Installs the Debian packages moegrad's build, tests and demo need, if any is missing.
# Safe to re-run: it does nothing when everything is present.
set -euo pipefail
# clang-16 and libclang-rt-16-dev (libFuzzer, sanitizer runtimes) serve `make fuzz` (clang 14
# lacks _Float16 on x86-64). ccache: .ci/run compiles each translation unit once per set of flags.
PACKAGES=(g++ make libhwy-dev libgtest-dev libbenchmark-dev fortunes clang-16 libclang-rt-16-dev ccache)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing Debian packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "error: need root (or sudo) to run: apt-get install ${missing[*]}" >&2; exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
