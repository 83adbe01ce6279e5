#!/usr/bin/env bash
# Reproduces docs/performance.md's `factorps load` figures: 2 shards on loopback, 10M
# and 100M parameters, 2 and 4 workers, sync and async, plus the loopback
# TCP bandwidth measured by iperf3 in the same run for comparison, as one
# stream and as W x 2 parallel streams (a W-worker job opens one connection
# from each worker to each shard), before and after the runs.
#
#   tests/bench/load.sh [BUILD_DIR]          (default: build)
#
# Environment knobs (defaults in brackets):
#   PARAMS="10M 100M"  WORKERS="2 4"  MODES="sync async"
#   STEPS_10M=12  STEPS_100M=5  (other sizes: STEPS=8)  WARMUP=2
#   PROCESSES=0 (1: workers as processes instead of threads)
#   REPS=3 (runs per row, fresh shards each time; the row shows the median
#           of each figure over the runs)
#   MODEL=gpt (factorps load --model: gpt, or peer for the peer's shapes)
#   WIRE=f32 (factorps load --wire-dtype: f32 or bf16)
# tests/bench/side_by_side.py runs the same loads interleaved with the
# torch.distributed.rpc peer.
#
# Every server is started on 127.0.0.1:0 (port from --port-file) and killed
# on exit, also on failure or Ctrl-C. Numbers are noisy on small machines:
# the workers, both shards and the kernel share the same cores.
set -euo pipefail

build=${1:-build}
server=$build/server/factorps-server
cli=$build/client/factorps
for bin in "$server" "$cli"; do
  [[ -x $bin ]] || { echo "load.sh: $bin not built (cmake --build $build)" >&2; exit 2; }
done
command -v iperf3 >/dev/null || { echo "load.sh: iperf3 missing (scripts/deps.sh test)" >&2; exit 2; }

PARAMS=${PARAMS:-"10M 100M"}
WORKERS=${WORKERS:-"2 4"}
MODES=${MODES:-"sync async"}
WARMUP=${WARMUP:-2}
PROCESSES=${PROCESSES:-0}
REPS=${REPS:-3}
MODEL=${MODEL:-gpt}
WIRE=${WIRE:-f32}

tmp=$(mktemp -d)
pids=()  # live children only
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT INT TERM

wait_port() {  # wait_port FILE PID -> prints the port
  for _ in $(seq 1 500); do
    if [[ -s $1 ]]; then cat "$1"; return 0; fi
    kill -0 "$2" 2>/dev/null || { echo "load.sh: process $2 died" >&2; return 1; }
    sleep 0.02
  done
  echo "load.sh: no port in $1" >&2
  return 1
}

# Loopback TCP bandwidth over $1 parallel streams (default 1). iperf3
# cannot listen on port 0, so try a few random high ports.
iperf_gbs() {
  local port out streams=${1:-1}
  for _ in 1 2 3 4 5; do
    port=$((20000 + RANDOM % 40000))
    iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
    local sp=$!
    pids+=("$sp")
    sleep 0.3
    if out=$(iperf3 -c 127.0.0.1 -p "$port" -t 5 -P "$streams" -J 2>/dev/null); then
      wait "$sp" 2>/dev/null || true
      pids=()
      /usr/bin/python3 -c 'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8e9))' <<<"$out"
      return 0
    fi
    kill "$sp" 2>/dev/null || true
    wait "$sp" 2>/dev/null || true
    pids=()
  done
  echo "n/a"
}

steps_for() {
  case $1 in
    10M) echo "${STEPS_10M:-12}" ;;
    100M) echo "${STEPS_100M:-5}" ;;
    *) echo "${STEPS:-8}" ;;
  esac
}

# Runs in this shell (not a $(...) subshell) so the EXIT trap sees its
# servers in `pids`; the RESULT line lands in $result.
result=""
run_one() {  # run_one MODE WORKERS PARAMS -> sets $result
  local mode=$1 w=$2 n=$3 addrs="" i steps
  steps=$(steps_for "$n")
  local mine=()
  for i in 0 1; do
    rm -f "$tmp/port$i"
    "$server" --listen 127.0.0.1:0 --shard-id "$i" --shard-count 2 --mode "$mode" \
      --workers "$w" --deadline 300 --port-file "$tmp/port$i" >"$tmp/server$i.log" 2>&1 &
    pids+=("$!")
    mine+=("$!")
  done
  for i in 0 1; do
    addrs+="${addrs:+,}127.0.0.1:$(wait_port "$tmp/port$i" "${mine[$i]}")"
  done
  local kind=--threads
  [[ $PROCESSES == 1 ]] && kind=--processes
  local out
  out=$("$cli" load --shards "$addrs" --workers "$w" --params "$n" --steps "$steps" \
    --warmup "$WARMUP" --mode-hint "$mode" "$kind" --deadline 600 --model "$MODEL" \
    --wire-dtype "$WIRE" 2>&1) || {
    echo "load.sh: factorps load failed ($mode, $w workers, $n):" >&2
    echo "$out" >&2
    exit 1  # the EXIT trap stops the shards
  }
  kill "${mine[@]}" 2>/dev/null || true
  wait "${mine[@]}" 2>/dev/null || true
  pids=()  # reaped: never signal a pid the system may reuse
  result=$(grep '^RESULT' <<<"$out")
}

get() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }

# The median of the numbers on stdin (one a line).
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

row() {  # row MODE WORKERS PARAMS -> prints the medians of REPS runs as a table row
  local all=() rep k
  for rep in $(seq 1 "$REPS"); do
    run_one "$@"
    all+=("$result")
  done
  local cols=()
  for k in steps_per_s gb_per_s p50_ms p99_ms; do
    cols+=("$(for r in "${all[@]}"; do get "$k" "$r"; done | median)")
  done
  printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n" "$3" "$1" "$2" "${cols[0]}" "${cols[1]}" \
    "${cols[2]}" "${cols[3]}" "${loop_gbs[1]}" "${loop_gbs[$2]}"
}

# loop_gbs[STREAMS]: one stream and W x 2 streams for every W of $WORKERS.
declare -A loop_gbs
measure_loop() {
  local w
  loop_gbs[1]=$(iperf_gbs 1)
  for w in $WORKERS; do loop_gbs[$w]=$(iperf_gbs $((w * 2))); done
}
loop_line() {  # loop_line WHEN
  local w line="# loopback TCP $1 (iperf3, 5 s): ${loop_gbs[1]} GB/s (1 stream)"
  for w in $WORKERS; do line+=", ${loop_gbs[$w]} GB/s ($((w * 2)) streams)"; done
  echo "$line"
}

echo "# factorps load: 2 shards on 127.0.0.1, $(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo | head -n 1)," \
  "$(nproc) CPUs, model $MODEL, $WIRE on the wire, medians of $REPS, $(date -u +%Y-%m-%dT%H:%MZ)"
measure_loop
loop_line "before the runs"
echo
echo "| params | mode | workers | steps/s | GB/s | p50 ms | p99 ms | iperf3 1 stream GB/s | iperf3 W x 2 streams GB/s |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for n in $PARAMS; do
  for mode in $MODES; do
    for w in $WORKERS; do
      row "$mode" "$w" "$n"
    done
  done
done
measure_loop
echo
loop_line "after the runs"
