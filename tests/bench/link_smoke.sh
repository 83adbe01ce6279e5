#!/usr/bin/env bash
# CTest `bench_link_smoke`: tests/bench/link_bench.py still builds its
# shaped link, runs every contender across it and leaves nothing behind.
# A few seconds of a 1M-parameter model at 1 Gbit/s; no timing is checked.
#   1. --smoke must print a table row with a steps/s for fp32 and bf16 (and
#      the peer when ../shared/peers is there), and delete its namespaces.
#   2. SIGTERM in the middle of a run must leave no namespace and no
#      process of that run.
# Needs root (namespaces, tc): without it the test skips (exit 77,
# tests/allowed-skips.txt).
#   link_smoke.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
if [[ $(id -u) != 0 ]]; then
  echo "link_smoke: not root: network namespaces and tc need it; skipped"
  exit 77
fi
bench=(/usr/bin/python3 "$src/tests/bench/link_bench.py" --build "$build" --smoke --rate 1)
left() { ip netns list | grep -c -- "-$1\b" || true; }

tag=sm$((RANDOM % 100000))
out=$("${bench[@]}" --tag "$tag")
echo "$out"
row=$(grep '^| 1M | 2 | sync |' <<<"$out") || { echo "link_smoke: no table row" >&2; exit 1; }
# The fp32 and bf16 steps/s columns (the 4th and 6th cells) are numbers > 0.
for col in 5 7; do
  v=$(cut -d'|' -f"$col" <<<"$row" | tr -d ' ')
  /usr/bin/python3 -c "import sys; sys.exit(0 if float('$v') > 0 else 1)" ||
    { echo "link_smoke: column $col is '$v'" >&2; exit 1; }
done
[[ $(left "$tag") == 0 ]] || { echo "link_smoke: namespaces of $tag left behind" >&2; exit 1; }

# Stopped in the middle of a run: everything goes.
tag=st$((RANDOM % 100000))
"${bench[@]}" --tag "$tag" --contenders fp32 --steps-10m 200 >/dev/null 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
# Until something runs in its namespaces (at most 60 s: the iperf3 checks
# come first and take longer on a loaded machine). The processes are
# recorded when seen: one iperf3 server of the link check exits after its
# test, so a second look can find none.
inside=
for _ in $(seq 1 600); do
  inside=$(ip netns pids "fpslb-s-$tag" 2>/dev/null; ip netns pids "fpslb-w-$tag" 2>/dev/null) || true
  [[ -n $inside ]] && break
  sleep 0.1
done
[[ -n $inside ]] || { echo "link_smoke: the run never started its shards" >&2; exit 1; }
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
trap - EXIT
[[ $rc != 0 ]] || { echo "link_smoke: a stopped run exited 0" >&2; exit 1; }
[[ $(left "$tag") == 0 ]] || { echo "link_smoke: namespaces of stopped $tag left behind" >&2; exit 1; }
for p in $inside; do
  [[ ! -d /proc/$p ]] || { echo "link_smoke: process $p of the stopped run still runs" >&2; exit 1; }
done
echo "link_smoke: ok"
