#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan+UBSan) and runs them.
#   tests/fuzz/run.sh --ci              bounded run: the `fuzz` CTest label
#                                       (seed replay + FPS_FUZZ_SECONDS each)
#   tests/fuzz/run.sh [-j N] SECONDS [TARGET...]
#                                       long runs: each target for SECONDS, N at
#                                       a time (default 1), logs and new inputs
#                                       in build-fuzz/fuzz-runs/; prints the
#                                       executions of each run
# Targets: fuzz_create fuzz_pull fuzz_stats fuzz_pushpull fuzz_ckpt_rpc fuzz_getstate fuzz_http fuzz_checkpoint
#          fuzz_wire fuzz_wire_cost fuzz_split_partials fuzz_exchange fuzz_replicate
# Environment: FPS_FUZZ_BUILD (build dir, default build-fuzz), CC (default clang).
# Exit status: 0 if every run ended without a crash, leak or sanitizer report.
# A crashing input is left as build-fuzz/fuzz-runs/<target>-crash-*: copy
# it into tests/fuzz/crashes/<target>/ once fixed, so every build replays it.
set -euo pipefail
cd "$(dirname "$0")/../.."

all=(fuzz_create fuzz_pull fuzz_stats fuzz_pushpull fuzz_ckpt_rpc fuzz_getstate fuzz_http fuzz_checkpoint
     fuzz_wire fuzz_wire_cost fuzz_split_partials fuzz_exchange fuzz_replicate)
build=${FPS_FUZZ_BUILD:-build-fuzz}
jobs=1
ci=0
while (($#)); do
  case "$1" in
    --ci) ci=1; shift ;;
    -j) jobs=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
# Arguments are checked before the (long) clang build.
if ((!ci)) && { (($# < 1)) || ! [[ $1 =~ ^[0-9]+$ ]]; }; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi

export CC=${CC:-clang}
if ! command -v "$CC" >/dev/null; then
  echo "run.sh: $CC not found; the fuzz targets need clang with libFuzzer" >&2
  exit 2
fi
cmake -S . -B "$build" -DFPS_FUZZ=ON -DFPS_SANITIZE=asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFPS_WERROR=ON -DFPS_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$(nproc)" --target "${all[@]}"
if ! grep -q '^FPS_HAVE_LIBFUZZER:INTERNAL=1' "$build/CMakeCache.txt"; then
  echo "run.sh: $CC cannot link -fsanitize=fuzzer; nothing to fuzz with" >&2
  exit 2
fi

if ((ci)); then
  exec ctest --test-dir "$build" -L fuzz --output-on-failure -j "$(nproc)"
fi

seconds=$1
shift
targets=("$@")
((${#targets[@]})) || targets=("${all[@]}")

out=$build/fuzz-runs
mkdir -p "$out"
declare -A maxlen=([fuzz_http]=20000 [fuzz_checkpoint]=8192 [fuzz_split_partials]=65536)

run_one() {
  local t=$1 work=$out/corpus-$1
  mkdir -p "$work"
  rm -f "$out/$t.rc"
  # -rss_limit_mb: a leak that grows shows as a failure; -timeout: a hang.
  local rc=0
  "$build/tests/fuzz/$t" -max_total_time="$seconds" -max_len="${maxlen[$t]:-4096}" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$out/$t-" \
    "$work" "tests/fuzz/corpus/$t" >"$out/$t.log" 2>&1 || rc=$?
  echo "$rc" >"$out/$t.rc"
}

status=0
for t in "${targets[@]}"; do
  while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
  echo "run.sh: $t for ${seconds}s (log: $out/$t.log)"
  run_one "$t" &
done
wait
for t in "${targets[@]}"; do
  rc=$(cat "$out/$t.rc" 2>/dev/null || echo missing)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out/$t.log" | tail -1)
  secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$out/$t.log" | tail -1)
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$out/$t.log" | tail -1)
  if [[ $rc != 0 ]]; then
    status=1
    echo "$t: FAILED (exit $rc) after ${execs:-?} executions; see $out/$t.log"
  else
    echo "$t: ${execs:-?} executions in ${secs:-?} s, no crash ($cov)"
  fi
done
exit $status
