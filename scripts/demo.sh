#!/usr/bin/env bash
# The README's main command: trains a real model through factorps.
#
# Installs what is missing (as root; scripts/deps.sh demo), builds (tests
# off), starts 2 shards on loopback (sync mode) and WORKERS worker processes
# (default 2), each on its own part of the data, training through
# factorps.torch.RemoteAdafactor:
#
#   --model lm   (default) a byte-level decoder-only transformer on the Python
#                standard library's source (client/python/examples/train_lm.py):
#                one progress bar, then the held-out loss, a sample of generated
#                text, the shards' Adafactor state beside AdamW's, push figures,
#                and the report image OUT/report.png (its figures in
#                OUT/report.json). Fails unless the held-out loss ends below the
#                bar (--max-loss, default 2.3 nats per byte).
#   --model mlp  the quick one: an MLP on scikit-learn's digits
#                (train_digits.py); fails below 95% held-out accuracy.
#
#   scripts/demo.sh [--model lm|mlp] [--workers N] [--steps N] [--epochs N]
#                   [--out DIR] [--no-plot] [--build-dir DIR] [--build-only]
#                   [--prebuilt] [-- worker args]
#
# --steps (lm, default 400), --epochs (mlp, default 20); --out defaults to
# BUILD/demo; --prebuilt skips installing and building (uses BUILD as it is);
# worker args go to the training script (its --help lists them).
# Ctrl-C (or SIGTERM) stops the workers and shards and waits for them: no
# process is left behind.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: $0 [--model lm|mlp] [--workers N] [--steps N] [--epochs N] [--out DIR] [--no-plot]
       [--build-dir DIR] [--build-only] [--prebuilt] [-- worker args]"
model=lm
workers=2
epochs=20
steps=400
build=build
build_only=0
prebuilt=0
out=
plot=1
while (($#)); do
  case "$1" in
    --model) model=$2; shift ;;
    --workers) workers=$2; shift ;;
    --epochs) epochs=$2; shift ;;
    --steps) steps=$2; shift ;;
    --out) out=$2; shift ;;
    --no-plot) plot=0 ;;
    --build-dir) build=$2; shift ;;
    --build-only) build_only=1 ;;
    --prebuilt) prebuilt=1 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
if ! [[ $workers =~ ^[0-9]+$ ]] || ((workers < 1 || workers > 16)); then
  echo "demo: --workers must be 1..16" >&2
  exit 2
fi
if ! [[ $steps =~ ^[0-9]+$ ]] || ((steps < 1)); then
  echo "demo: --steps must be a positive integer" >&2
  exit 2
fi
case $model in lm|mlp) ;; *) echo "demo: --model must be lm or mlp" >&2; exit 2 ;; esac
out=${out:-$build/demo}
python=/usr/bin/python3
shards=2

if ((prebuilt)); then
  [[ -x $build/server/factorps-server && -e $build/client/libfactorps.so ]] ||
    { echo "demo: --prebuilt: no factorps-server or libfactorps.so in $build/" >&2; exit 1; }
else
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
fi

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
    --metrics-listen 127.0.0.1:0 --metrics-port-file "$tmp/shard$i.mport" \
    --shard-id "$i" --shard-count "$shards" --mode sync --workers "$workers" \
    --deadline 120 --log-level warn >"$tmp/shard$i.log" 2>&1 &
  spids+=($!)
done
addrs=()
maddrs=()
for ((i = 0; i < shards; i++)); do
  for _ in $(seq 200); do
    [[ -s $tmp/shard$i.port && -s $tmp/shard$i.mport ]] && break
    kill -0 "${spids[$i]}" 2>/dev/null || { cat "$tmp/shard$i.log" >&2; exit 1; }
    sleep 0.05
  done
  [[ -s $tmp/shard$i.port ]] || { echo "demo: shard $i did not start" >&2; exit 1; }
  addrs+=("127.0.0.1:$(cat "$tmp/shard$i.port")")
  maddrs+=("127.0.0.1:$(cat "$tmp/shard$i.mport")")
  echo "   shard $i: ${addrs[$i]} (pid ${spids[$i]}, metrics http://${maddrs[$i]}/metrics)"
done
list=$(IFS=,; echo "${addrs[*]}")
mlist=$(IFS=,; echo "${maddrs[*]}")

export FACTORPS_LIB=$(cd "$build" && pwd)/client/libfactorps.so
# One BLAS thread per worker, as torch.set_num_threads(1) in the workers
# intends: on a fresh machine scipy (python3-sklearn's dependency) brings in
# libopenblas0-pthread, which outranks the serial OpenBLAS as libblas.so.3
# and starts its own threads whatever torch is told.
export OPENBLAS_NUM_THREADS=1
if [[ $model == lm ]]; then
  echo "== training a byte-level transformer: $workers workers, $steps steps"
  mkdir -p "$out"
  rm -f "$out"/worker-*.json "$out"/report.png "$out"/report.json
  wargs=(client/python/examples/train_lm.py --steps "$steps" --metrics "$mlist" --out "$out")
  ((plot)) || wargs+=(--no-plot)
else
  echo "== training an MLP on the digits: $workers workers, $epochs epochs"
  wargs=(client/python/examples/train_digits.py --epochs "$epochs")
fi
start=$(date +%s.%N)
for ((w = 0; w < workers; w++)); do
  "$python" "${wargs[@]}" --shards "$list" --worker-id "$w" --workers "$workers" "$@" &
  wpids+=($!)
done
# The first worker to fail ends the run (the others would only wait for
# its gradients until the deadline).
status=0
left=("${wpids[@]}")
while ((${#left[@]})); do
  finished=
  if ! wait -n -p finished "${left[@]}"; then
    status=$?
    break
  fi
  rest=()
  for p in "${left[@]}"; do [[ $p == "$finished" ]] || rest+=("$p"); done
  left=("${rest[@]}")
done
end=$(date +%s.%N)
if ((status == 3)); then
  echo "demo: FAILED: training ended short of its bar (see above)" >&2
  exit 1
elif ((status)); then
  echo "demo: a worker failed (status $status); shard logs:" >&2
  tail -n 20 "$tmp"/shard*.log >&2 || true
  exit 1
fi
awk -v s="$start" -v e="$end" 'BEGIN { printf "== done: training (workers start to finish) took %.1f s\n", e - s }'
