#!/usr/bin/env bash
# Profiles one shard of a sync load: 2 shards on 127.0.0.1, `factorps load
# --model peer` (the peer's 64 tensors), 100M parameters, 4 workers by
# default; `perf record` (user and kernel) follows shard 0 from the end of
# the first model step (so the tensors' creation and init are not in it)
# until the load ends, then tests/bench/perf_summary.py prints the top
# symbols and the shares of user-space copies, decode/sum kernels, bf16
# encode, the Adafactor kernels and kernel TCP copies.
#
#   tests/bench/profile_shard.sh [BUILD_DIR]          (default: build)
#
# Environment knobs (defaults in brackets):
#   PARAMS=100M  WORKERS=4  MODE=sync  STEPS=5 (timed steps)  WARMUP=1
#   WIRE=f32 (or bf16)  SHARD=0 (which shard to record)  TOP=15 (symbols shown)
#   FREQ=999 (samples/s)  OUT= (keep perf.data and the logs in this folder)
# perf is /usr/bin/perf (Debian: linux-perf, not among the test dependencies):
# without it the script says so and exits 77 (skipped). It records cycles,
# or cpu-clock where the machine has no hardware counters (virtual machines).
# Every process started here is stopped on exit, also on failure or Ctrl-C.
set -euo pipefail

build=${1:-build}
src=$(cd "$(dirname "$0")/../.." && pwd)
server=$build/server/factorps-server
cli=$build/client/factorps
perf=${PERF:-/usr/bin/perf}
for bin in "$server" "$cli"; do
  [[ -x $bin ]] || { echo "profile_shard: $bin not built (cmake --build $build)" >&2; exit 2; }
done
if [[ ! -x $perf ]]; then
  echo "profile_shard: $perf not found (Debian package linux-perf): skipped" >&2
  exit 77
fi

PARAMS=${PARAMS:-100M}
WORKERS=${WORKERS:-4}
MODE=${MODE:-sync}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-1}
WIRE=${WIRE:-f32}
SHARD=${SHARD:-0}
TOP=${TOP:-15}
FREQ=${FREQ:-999}
[[ $SHARD == 0 || $SHARD == 1 ]] || { echo "profile_shard: SHARD must be 0 or 1" >&2; exit 2; }

if [[ -n ${OUT:-} ]]; then
  mkdir -p "$OUT"
  tmp=$(cd "$OUT" && pwd)
  keep=1
else
  tmp=$(mktemp -d)
  keep=0
fi
pids=()  # live children only
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  ((keep)) || rm -rf "$tmp"
}
trap cleanup EXIT INT TERM

wait_port() {  # wait_port FILE PID -> prints the port
  for _ in $(seq 1 500); do
    if [[ -s $1 ]]; then cat "$1"; return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "profile_shard: process $2 died" >&2; return 1; }
    sleep 0.02
  done
  echo "profile_shard: no port in $1" >&2
  return 1
}

shard_pids=()
addrs=""
for i in 0 1; do
  rm -f "$tmp/port$i"
  "$server" --listen 127.0.0.1:0 --shard-id "$i" --shard-count 2 --mode "$MODE" \
    --workers "$WORKERS" --deadline 600 --port-file "$tmp/port$i" >"$tmp/shard$i.log" 2>&1 &
  pids+=("$!")
  shard_pids+=("$!")
done
for i in 0 1; do
  addrs+="${addrs:+,}127.0.0.1:$(wait_port "$tmp/port$i" "${shard_pids[$i]}")"
done
target=${shard_pids[$SHARD]}
target_addr=$(cut -d, -f$((SHARD + 1)) <<<"$addrs")

echo "# profile_shard: shard $SHARD of 2 (pid $target), $PARAMS params, W $WORKERS, $MODE," \
  "$WIRE on the wire, $STEPS timed steps; $(nproc) CPUs, load average" \
  "$(cut -d' ' -f1 /proc/loadavg), $(date -u +%Y-%m-%dT%H:%MZ)"
"$cli" load --shards "$addrs" --model peer --params "$PARAMS" --workers "$WORKERS" \
  --steps $((STEPS + WARMUP)) --warmup "$WARMUP" --mode-hint "$MODE" --wire-dtype "$WIRE" \
  --deadline 900 >"$tmp/load.log" 2>&1 &
load=$!
pids+=("$load")

# Start recording once the recorded shard has applied one update to each of
# its tensors: creation and init are then behind us.
started=0
while kill -0 "$load" 2>/dev/null; do
  if "$cli" stats --shards "$target_addr" --json 2>/dev/null | /usr/bin/python3 -c '
import json, sys
s = json.load(sys.stdin)["shards"][0]
sys.exit(0 if s["tensors"] > 0 and s["updates"] >= s["tensors"] else 1)'; then
    started=1
    break
  fi
  sleep 0.2
done
((started)) || { cat "$tmp/load.log" >&2; echo "profile_shard: the load ended before its first step" >&2; exit 1; }

"$perf" record -F "$FREQ" -p "$target" -o "$tmp/perf.data" >"$tmp/perf.log" 2>&1 &
rec=$!
pids+=("$rec")
load_rc=0
wait "$load" || load_rc=$?
kill -INT "$rec" 2>/dev/null || true
wait "$rec" 2>/dev/null || true
pids=("${shard_pids[@]}")  # the load and perf are reaped: never signal a reused pid
if ((load_rc)); then
  cat "$tmp/load.log" >&2
  echo "profile_shard: factorps load failed ($load_rc)" >&2
  exit 1
fi
grep '^RESULT' "$tmp/load.log" || true
[[ -s $tmp/perf.data ]] || { cat "$tmp/perf.log" >&2; echo "profile_shard: perf recorded nothing" >&2; exit 1; }
/usr/bin/python3 "$src/tests/bench/perf_summary.py" "$tmp/perf.data" --top "$TOP" --perf "$perf"
((keep)) && echo "# perf data: $tmp/perf.data (perf report -i $tmp/perf.data)"
exit 0
