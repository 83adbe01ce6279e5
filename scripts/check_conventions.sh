#!/usr/bin/env bash
# Conventions a compiler cannot check, over the files git tracks (run by
# ctest as conventions_check, label unit; exit 1 naming each offence):
#
# - One status convention on the server: a handler fails a call with an
#   FPS_E* code (fps_call_error) and server/status.c translates it to gRPC,
#   so no GRPC_STATUS_* literal stands outside status.[ch].
# - One log line on the server: every message, start-up errors included,
#   goes through FPS_LOG (common/log.h), never a bare fprintf to stderr.
# - One door to the heap: the server, libfactorps, the CLI and common/
#   allocate through fps_malloc and friends (common/alloc.h), so that the
#   allocation-failure sweeps reach every allocation; no raw libc call
#   outside common/alloc.c.
# - Comments say why, not which tracker entry asked for a change: a reader
#   cannot open "issue 12". No file (code, tests, docs) cites one.
#
# Each check lists the files still allowed some, with the most each may
# hold and why: a file that gains one fails; a file that loses some is
# told to lower its number here.
set -euo pipefail
cd "$(dirname "$0")/.."

# file                  most  why
allowed_status="
server/peer.c           7     reads the status of another shard's reply to word its refusal (status.c translates)
server/lease_etcd.c     6     reads the status of etcd's replies
server/replica_send.c   3     reads the status the standby ends its Replicate stream with
"
allowed_stderr="
"

# The files git tracks below a folder (every file, in a tree without git).
files() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git ls-files -- "$1"
  else find "$1" -type f | sort; fi
}

bad=0
# check WHAT PATTERN ALLOWED HINT [EXEMPT...]: server's C files against a
# fixed-string pattern.
check() {
  local what=$1 pattern=$2 allowed=$3 hint=$4
  shift 4
  declare -A most=()
  local f n _
  while read -r f n _; do
    [[ -n ${f:-} ]] && most[$f]=$n
  done <<<"$allowed"
  while read -r f; do
    for x in "$@"; do [[ $f == "$x" ]] && continue 2; done
    n=$(grep -cF -- "$pattern" "$f" || true)
    local max=${most[$f]:-0}
    if ((n > max)); then
      echo "check_conventions: $f holds $n $what (allowed: $max):" >&2
      grep -nF -- "$pattern" "$f" | sed 's/^/  /' >&2
      echo "  $hint" >&2
      bad=$((bad + 1))
    elif ((n < max)); then
      echo "check_conventions: $f holds $n $what, fewer than the $max allowed: lower its number in $0"
    fi
  done < <(files server | grep -E '\.[ch]$')
}

check "GRPC_STATUS_* literal(s)" "GRPC_STATUS_" "$allowed_status" \
  "fail a call with fps_call_error(c, FPS_E..., ...): server/status.c translates it" \
  server/status.c server/status.h
check "fprintf(stderr, ...)" "fprintf(stderr" "$allowed_stderr" \
  "log with FPS_LOG(FPS_LOG_ERROR, ...) (common/log.h): one line format for every message"

# Raw allocations (a call, not a member such as ->free or .free).
raw='(^|[^[:alnum:]_.>])(malloc|calloc|realloc|strdup|strndup|free|posix_memalign|aligned_alloc)\('
for dir in server client common; do
  while read -r f; do
    case $f in common/alloc.c | common/alloc.h | client/python/*) continue ;; esac
    hits=$(grep -nE "$raw" "$f" || true)
    if [[ -n $hits ]]; then
      echo "check_conventions: $f calls libc's allocator directly (use fps_malloc/fps_free, common/alloc.h):" >&2
      echo "$hits" | sed 's/^/  /' >&2
      bad=$((bad + 1))
    fi
  done < <(files "$dir" | grep -E '\.[ch]$')
done

# Tracker numbers, anywhere in the tree (this file's pattern excepted).
tracker='issues? #?[0-9]'
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  cited=$(git grep -n -I -i -E "$tracker" -- . ':!scripts/check_conventions.sh' || true)
else
  cited=$(grep -rnIiE "$tracker" --exclude-dir=.git --exclude-dir='build*' --exclude=check_conventions.sh . || true)
fi
if [[ -n $cited ]]; then
  echo "check_conventions: comments cite tracker numbers (say the reason or the feature instead):" >&2
  echo "$cited" | sed 's/^/  /' >&2
  bad=$((bad + 1))
fi

if ((bad)); then
  echo "check_conventions: $bad offence(s)" >&2
  exit 1
fi
echo "check_conventions: ok"
