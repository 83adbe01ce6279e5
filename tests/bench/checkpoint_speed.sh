#!/usr/bin/env bash
# Reproduces the checkpoint figures of docs/performance.md: one async shard
# holding PARAMS parameters (factorps load registers and trains them), then
#   - a Checkpoint RPC (`factorps checkpoint`): bytes, seconds, MB/s;
#   - SIGTERM: the seconds until the shard exits (call draining plus the
#     final checkpoint), which terminationGracePeriodSeconds must cover;
#   - a restart with --require-checkpoint: the restore time from the log.
#
#   tests/bench/checkpoint_speed.sh [BUILD_DIR]      (default: build)
#   PARAMS=256M (1 GiB of fp32 parameters)  DIR=/var/tmp (the file system
#   measured: put it on the disk your volumes use)
#
# Needs memory for the shard's tensors twice (the snapshot) plus the load
# generator's copy: about 3.5 GB for 256M parameters.
set -euo pipefail

build=${1:-build}
server=$build/server/factorps-server
cli=$build/client/factorps
for bin in "$server" "$cli"; do
  [[ -x $bin ]] || { echo "checkpoint_speed.sh: $bin not built" >&2; exit 2; }
done
params=${PARAMS:-256M}
work=$(mktemp -d "${DIR:-/var/tmp}/fps-ckspeed.XXXXXX")
pid=
cleanup() {
  [[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

start() {  # extra flags...
  rm -f "$work/port"
  "$server" --listen 127.0.0.1:0 --port-file "$work/port" --mode async \
    --checkpoint-dir "$work/ck" --log-level info "$@" >>"$work/log" 2>&1 &
  pid=$!
  while [[ ! -s $work/port ]]; do
    kill -0 "$pid" 2>/dev/null || { cat "$work/log" >&2; exit 1; }
    sleep 0.05
  done
}

start
addr=127.0.0.1:$(cat "$work/port")
out=$("$cli" load --shards "$addr" --workers 1 --params "$params" --steps 2 --warmup 0 \
  --mode-hint async)
echo "${out%%$'\n'*}"
"$cli" checkpoint --shards "$addr"
t0=$(date +%s.%N)
kill -TERM "$pid"
wait "$pid" || { echo "shard exited $?" >&2; exit 1; }
t1=$(date +%s.%N)
pid=
echo "SIGTERM to exit: $(echo "$t1 - $t0" | bc) s"
grep -o 'checkpoint [^ ]*: .*' "$work/log" | sed 's/^/  /'
start --require-checkpoint
grep -o 'restored .*' "$work/log" | sed 's/^/  /'
kill -TERM "$pid"
wait "$pid" || true
pid=
