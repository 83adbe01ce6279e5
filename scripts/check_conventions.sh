#!/usr/bin/env bash
# Conventions a compiler cannot check, over the files git tracks (run by
# ctest as conventions_check, label unit; exit 1 naming each offence):
#
# - One status convention on the server: a handler fails a call with an
#   FPS_E* code (fps_call_error) and server/status.c translates it to gRPC,
#   so no GRPC_STATUS_* literal stands outside status.[ch], except in the
#   files listed below, each with the most it may hold and why. A file
#   that gains one fails; a file that loses some is told to lower its
#   number here.
set -euo pipefail
cd "$(dirname "$0")/.."

# file                  most  why
allowed_status="
server/peer.c           24    reads the status of another shard's reply (gRPC -> FPS_E*), not one it sends
server/lease_etcd.c     6     reads the status of etcd's replies
server/rpc_pushpull.c   9     not moved to fps_call_error yet
server/rpc_checkpoint.c 9     not moved to fps_call_error yet
server/rpc_exchange.c   12    not moved to fps_call_error yet
"

# The files git tracks below a folder (every file, in a tree without git).
files() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git ls-files -- "$1"
  else find "$1" -type f | sort; fi
}

bad=0
declare -A most=()
while read -r f n _; do
  [[ -n ${f:-} ]] && most[$f]=$n
done <<<"$allowed_status"

while read -r f; do
  case $f in server/status.c | server/status.h) continue ;; esac
  n=$(grep -c 'GRPC_STATUS_' "$f" || true)
  allowed=${most[$f]:-0}
  if ((n > allowed)); then
    echo "check_conventions: $f holds $n GRPC_STATUS_* literal(s) (allowed: $allowed):" >&2
    grep -n 'GRPC_STATUS_' "$f" | sed 's/^/  /' >&2
    echo "  fail a call with fps_call_error(c, FPS_E..., ...): server/status.c translates it" >&2
    bad=$((bad + 1))
  elif ((n < allowed)); then
    echo "check_conventions: $f holds $n GRPC_STATUS_* literal(s), fewer than the $allowed allowed: lower its number in $0"
  fi
done < <(files server | grep -E '\.[ch]$')

if ((bad)); then
  echo "check_conventions: $bad offence(s)" >&2
  exit 1
fi
echo "check_conventions: ok"
