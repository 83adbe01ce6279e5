#!/bin/sh
# CTest `cli_plan_balance`: `factorps plan` for both load models
# at 100M parameters over 2, 3 and 4 shards must give max/min shard bytes
# <= 1.05 at the default split threshold, split exactly one tensor (the
# embedding), and refuse bad arguments with exit status 2.
#   plan_balance.sh FACTORPS
set -eu
factorps=$1
for model in gpt peer; do
  for s in 2 3 4; do
    line=$("$factorps" plan --model "$model" --params 100M --shard-count "$s" | grep '^RESULT ')
    echo "$model $s: $line"
    echo "$line" | awk '{
      for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      if (v["ratio_split"] + 0 > 1.05 || v["ratio_split"] + 0 < 1) { print "ratio_split out of [1, 1.05]"; exit 1 }
      if (v["split_tensors"] != 1) { print "expected exactly one split tensor"; exit 1 }
    }'
  done
done
# 0 never splits: the plan is the whole-tensor placement
line=$("$factorps" plan --params 100M --shard-count 4 --split-min-bytes 0 | grep '^RESULT ')
echo "$line" | grep -q 'split_tensors=0 blocks=32 ' || { echo "split 0: $line"; exit 1; }
for bad in "--shard-count 0" "--shard-count 3 --split-min-bytes 3Xi" "--shard-count 3 --model x" ""; do
  set +e
  # shellcheck disable=SC2086
  "$factorps" plan $bad >/dev/null 2>&1
  rc=$?
  set -e
  [ "$rc" -eq 2 ] || { echo "factorps plan $bad: exit $rc, expected 2"; exit 1; }
done
echo "plan_balance: ok"
