#!/usr/bin/env bash
# Runs every libFuzzer harness of build/fuzz for a while; exits non-zero if any harness finds
# something.
# usage: tests/fuzz/run.sh SECONDS [RUNS]   (RUNS > 0: stop each harness after RUNS inputs)
# FUZZ_SEED=N fixes libFuzzer's seed: with RUNS, the same inputs on every run of one commit (CI).
# FUZZ_JOBS=N runs N harnesses at a time (default 1; each harness is one process on one core).
# The committed seed corpora (tests/fuzz/corpus/<harness>) are read, never written: new inputs
# go to build/fuzz/corpus/<harness>, crashes to build/fuzz/artifacts/ (docs/testing.md).
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:-10}
RUNS=${2:--1}
BUILD=build/fuzz
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

# One harness; its report is printed in one piece when it ends, so parallel reports do not mix.
run_one() {
  local exe=$1 name seeds work log report
  name=$(basename "$exe")
  seeds="tests/fuzz/corpus/$name"
  work="$BUILD/corpus/$name"
  mkdir -p "$work" "$seeds"
  log="$BUILD/$name.log"
  report="== $name: ${SECONDS_EACH}s${RUNS:+ (runs $RUNS)}"
  if ! "$exe" -max_total_time="$SECONDS_EACH" -runs="$RUNS" ${FUZZ_SEED:+-seed="$FUZZ_SEED"} \
      -timeout=20 -rss_limit_mb=2048 \
      -max_len="${FUZZ_MAX_LEN:-512}" -print_final_stats=1 -artifact_prefix="$BUILD/artifacts/$name-" \
      "$work" "$seeds" >"$log" 2>&1; then
    printf '%s\nFINDING in %s (log: %s)\n%s\n' "$report" "$name" "$log" "$(tail -n 40 "$log")"
    return 1
  fi
  printf '%s\n%s\n' "$report" \
    "$(grep -E "stat::number_of_executed_units|stat::peak_rss_mb|cov: " "$log" | tail -n 3 | sed 's/^/   /')"
}

if [ "${1:-}" = "--one" ]; then  # the worker form used below: run.sh --one EXE SECONDS RUNS
  SECONDS_EACH=$3 RUNS=$4
  run_one "$2"
  exit
fi

mkdir -p "$BUILD/artifacts"
status=0
find "$BUILD/tests/fuzz" -maxdepth 1 -type f -name 'fuzz_*' -perm -u+x | sort |
  xargs -r -P "${FUZZ_JOBS:-1}" -I{} bash "$SELF" --one {} "$SECONDS_EACH" "$RUNS" || status=1
exit $status
