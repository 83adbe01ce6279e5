#!/bin/sh
# CTest `vectors`: replays the golden vectors through `factorps replay` for
# every SIMD variant this machine supports and checks each result set with
# check_vectors.py --require-state. Fails if any check fails, or if no
# variant ran at all.
#   replay_vectors.sh FACTORPS PYTHON3 VECTORS_DIR CHECKER OUT_DIR
set -eu
factorps=$1 python=$2 vectors=$3 checker=$4 out=$5
rm -rf "$out"
ran=0
for simd in scalar avx2 avx512 neon; do
  for threads in 1 2; do
    dir="$out/$simd-t$threads"
    set +e
    "$factorps" replay "$vectors" "$dir" --simd "$simd" --threads "$threads"
    rc=$?
    set -e
    if [ "$rc" -eq 77 ]; then
      echo "replay_vectors: $simd not supported here, skipped"
      break
    fi
    if [ "$rc" -ne 0 ]; then
      echo "replay_vectors: factorps replay --simd $simd --threads $threads failed ($rc)" >&2
      exit 1
    fi
    if ! "$python" "$checker" "$vectors" "$dir" --require-state > "$dir.check.txt"; then
      cat "$dir.check.txt"
      echo "replay_vectors: check_vectors.py failed for $simd, $threads thread(s)" >&2
      exit 1
    fi
    tail -n 1 "$dir.check.txt"
    ran=$((ran + 1))
  done
done
[ "$ran" -gt 0 ] || { echo "replay_vectors: no variant ran" >&2; exit 1; }
echo "replay_vectors: $ran replay(s) pass"
