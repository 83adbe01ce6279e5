#!/usr/bin/env bash
# The README's main command: trains a real model through factorps.
#
# Installs what is missing (as root), builds, starts 2 shards on loopback
# (sync mode), and trains an MLP on scikit-learn's bundled handwritten
# digits with WORKERS worker processes (default 2), each on its own part of
# the data, through factorps.torch.RemoteAdafactor. Worker 0 prints the loss
# and held-out accuracy per epoch, then the shards' figures (Adafactor state
# beside AdamW's, push latency and throughput). Exits non-zero if training
# fails or ends below 95% held-out accuracy.
#
#   scripts/demo.sh [--workers N] [--epochs N] [--build-dir DIR] [-- worker args]
#
# Ctrl-C (or SIGTERM) stops the workers and shards and waits for them: no
# process is left behind.
set -euo pipefail
cd "$(dirname "$0")/.."

workers=2
epochs=20
build=build
build_only=0
while (($#)); do
  case "$1" in
    --workers) workers=$2; shift ;;
    --epochs) epochs=$2; shift ;;
    --build-dir) build=$2; shift ;;
    --build-only) build_only=1 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--workers N] [--epochs N] [--build-dir DIR] [-- worker args]" >&2
       exit 2 ;;
  esac
  shift
done
if ! [[ $workers =~ ^[0-9]+$ ]] || ((workers < 1 || workers > 16)); then
  echo "demo: --workers must be 1..16" >&2
  exit 2
fi
python=/usr/bin/python3
shards=2

scripts/deps.sh demo
echo "== building ($build/)"
# No test, so no test dependency: the demo's package list is all it needs
# (scripts/check-demo-deps.py, run by CI, builds this way with only those
# packages' files visible). The build output goes to a log, shown on failure.
mkdir -p "$build"
blog=$build/demo-build.log
if ! { cmake -S . -B "$build" -DFPS_BUILD_TESTS=OFF &&
       cmake --build "$build" -j "$(nproc)" --target factorps factorps-server; } >"$blog" 2>&1; then
  tail -n 40 "$blog" >&2
  echo "demo: the build failed (whole log: $blog)" >&2
  exit 1
fi
((build_only)) && exit 0

tmp=$(mktemp -d "${TMPDIR:-/tmp}/factorps-demo.XXXXXX")
spids=()  # shards
wpids=()  # workers

# Stops every process we started and waits for each, so none outlives the
# script: workers first (so none reports the shards' shutdown as an error),
# then the shards; TERM, then KILL after 5 s. Then removes the scratch dir.
stop() {
  (($#)) || return 0
  kill -TERM "$@" 2>/dev/null || true
  local _
  for _ in $(seq 50); do
    local alive=0 p
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  kill -KILL "$@" 2>/dev/null || true
  wait "$@" 2>/dev/null || true
}
cleanup() {
  local rc=$?
  trap - INT TERM EXIT
  stop "${wpids[@]}"
  stop "${spids[@]}"
  rm -rf "$tmp"
  return $rc
}
trap 'echo; echo "demo: interrupted, stopping shards and workers" >&2; cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

echo "== starting $shards shards (sync mode, $workers workers) on 127.0.0.1"
# The shards run in their own session: Ctrl-C reaches only this script and
# the workers (which, started in the background, ignore SIGINT), and the
# trap below stops everything in order.
for ((i = 0; i < shards; i++)); do
  setsid "$build/server/factorps-server" --listen 127.0.0.1:0 --port-file "$tmp/shard$i.port" \
    --shard-id "$i" --shard-count "$shards" --mode sync --workers "$workers" \
    --deadline 60 --log-level warn >"$tmp/shard$i.log" 2>&1 &
  spids+=($!)
done
addrs=()
for ((i = 0; i < shards; i++)); do
  for _ in $(seq 200); do
    [[ -s $tmp/shard$i.port ]] && break
    kill -0 "${spids[$i]}" 2>/dev/null || { cat "$tmp/shard$i.log" >&2; exit 1; }
    sleep 0.05
  done
  [[ -s $tmp/shard$i.port ]] || { echo "demo: shard $i did not start" >&2; exit 1; }
  addrs+=("127.0.0.1:$(cat "$tmp/shard$i.port")")
  echo "   shard $i: ${addrs[$i]} (pid ${spids[$i]})"
done
list=$(IFS=,; echo "${addrs[*]}")

echo "== training: $workers workers, $epochs epochs"
export FACTORPS_LIB=$PWD/$build/client/libfactorps.so
start=$(date +%s.%N)
for ((w = 0; w < workers; w++)); do
  "$python" client/python/examples/train_digits.py --shards "$list" --worker-id "$w" \
    --workers "$workers" --epochs "$epochs" "$@" &
  wpids+=($!)
done
# The first worker to fail ends the run (the others would only wait for
# its gradients until the deadline).
status=0
left=("${wpids[@]}")
while ((${#left[@]})); do
  finished=
  if ! wait -n -p finished "${left[@]}"; then
    status=1
    break
  fi
  rest=()
  for p in "${left[@]}"; do [[ $p == "$finished" ]] || rest+=("$p"); done
  left=("${rest[@]}")
done
end=$(date +%s.%N)
if ((status)); then
  echo "demo: a worker failed; shard logs:" >&2
  tail -n 20 "$tmp"/shard*.log >&2 || true
  exit 1
fi
awk -v s="$start" -v e="$end" 'BEGIN { printf "== done: training (workers start to finish) took %.1f s\n", e - s }'
