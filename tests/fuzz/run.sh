#!/usr/bin/env bash
# Runs every libFuzzer harness of build/fuzz for a while; exits non-zero on the first finding.
# usage: tests/fuzz/run.sh SECONDS [RUNS]   (RUNS > 0: stop each harness after RUNS inputs)
# FUZZ_SEED=N fixes libFuzzer's seed: with RUNS, the same inputs on every run of one commit (CI).
# The committed seed corpora (tests/fuzz/corpus/<harness>) are read, never written: new inputs
# go to build/fuzz/corpus/<harness>, crashes to build/fuzz/artifacts/ (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:-10}
RUNS=${2:--1}
BUILD=build/fuzz
mkdir -p "$BUILD/artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
status=0
for exe in "$BUILD"/tests/fuzz/fuzz_*; do
  [ -x "$exe" ] || continue
  name=$(basename "$exe")
  seeds="tests/fuzz/corpus/$name"
  work="$BUILD/corpus/$name"
  mkdir -p "$work" "$seeds"
  log="$BUILD/$name.log"
  echo "== $name: ${SECONDS_EACH}s${RUNS:+ (runs $RUNS)}"
  if ! "$exe" -max_total_time="$SECONDS_EACH" -runs="$RUNS" ${FUZZ_SEED:+-seed="$FUZZ_SEED"} \
      -timeout=20 -rss_limit_mb=2048 \
      -max_len="${FUZZ_MAX_LEN:-512}" -print_final_stats=1 -artifact_prefix="$BUILD/artifacts/$name-" \
      "$work" "$seeds" >"$log" 2>&1; then
    echo "FINDING in $name (log: $log)"; tail -n 40 "$log"; status=1
    continue
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb|cov: " "$log" | tail -n 3 | sed 's/^/   /'
done
exit $status
