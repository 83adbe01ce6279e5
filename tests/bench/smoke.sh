#!/bin/sh
# CTest `bench_smoke`: the benchmark tooling still runs. factorps load
# --model peer must build the peer's 64 tensors (10M: 9999872 elements,
# the total of torch_rpc_ps.py's model_shapes(10M, 64)), and
# side_by_side.py must complete a tiny sync + async matrix with fp32 and
# bf16 on the wire (no peer, no iperf3: timings are not checked here),
# printing the sync memory bound per shard; perf_summary.py (the profile
# helper's report) must group a canned perf report right; push_chunks.py
# must A/B two sets of shard flags, and shape_bound.py give its known
# figures.
#   smoke.sh BUILD_DIR SOURCE_DIR
set -eu
build=$1 src=$2
tmp=$(mktemp -d)
pid=
trap 'if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi; rm -rf "$tmp"' EXIT INT TERM
"$build/server/factorps-server" --listen 127.0.0.1:0 --mode async --port-file "$tmp/port" \
  >"$tmp/server.log" 2>&1 &
pid=$!
i=0
while [ ! -s "$tmp/port" ]; do
  i=$((i + 1))
  [ $i -lt 500 ] || { cat "$tmp/server.log"; echo "smoke: no port" >&2; exit 1; }
  sleep 0.02
done
out=$("$build/client/factorps" load --shards "127.0.0.1:$(cat "$tmp/port")" --model peer \
  --params 10M --workers 1 --steps 2 --warmup 1 --wire-dtype bf16)
echo "$out"
echo "$out" | grep -q "9999872 parameters in 64 tensors" || { echo "smoke: wrong peer model" >&2; exit 1; }
echo "$out" | grep -q "RESULT .* wire=bf16" || { echo "smoke: no bf16 RESULT" >&2; exit 1; }
if "$build/client/factorps" load --shards "127.0.0.1:1" --model nope >/dev/null 2>&1; then
  echo "smoke: --model nope accepted" >&2
  exit 1
fi
table=$(/usr/bin/python3 "$src/tests/bench/side_by_side.py" --build "$build" --params 300k \
  --workers 2 --modes sync,async --reps 1 --steps-10m 2 --peers "$tmp/no-peers" --no-iperf)
echo "$table"
# The sync row must set each shard's VmHWM against the memory bound computed
# from that shard's Stats (a "-" there means Stats could not be read).
echo "$table" | grep -Eq '^\| 300k \| 2 \| sync \|.*\(([0-9.]+ / [0-9.]+), (within|OVER)\)' ||
  { echo "smoke: no sync memory bound in the table" >&2; exit 1; }
# perf_summary.py groups a shard's symbols: a canned `perf report` excerpt
# (percent, user [.] or kernel [k], symbol) with known group totals.
cat >"$tmp/report.txt" <<'REPORT'
# Samples: 1000  of event 'cpu-clock:pppH'
    30.00%  [k] _copy_to_iter
    20.00%  [.] sum_f32_avx512
    15.00%  [.] __memmove_avx512_unaligned_erms
    10.00%  [.] apply_rowcol_avx512
     5.00%  [k] memcpy_orig
     5.00%  [.] fps_dtype_decode
     5.00%  [k] clear_page_erms
     5.00%  [.] bf16_encode_avx2
     5.00%  [k] finish_task_switch.isra.0
REPORT
summary=$(/usr/bin/python3 "$src/tests/bench/perf_summary.py" --report "$tmp/report.txt")
echo "$summary"
for want in " 35.00%  kernel TCP copies" " 25.00%  decode / sum kernels" \
  " 15.00%  user-space copies" " 10.00%  Adafactor kernels" "  5.00%  bf16 encode" \
  "  5.00%  page faults, zeroing" "  5.00%  other kernel" "  0.00%  other user" \
  "user 55.0%, kernel 45.0%"; do
  echo "$summary" | grep -qF -- "$want" || { echo "smoke: perf_summary lacks '$want'" >&2; exit 1; }
done
# push_chunks.py runs one contender per set of shard flags and reports each
# one's shard VmHWM.
chunks=$(/usr/bin/python3 "$src/tests/bench/push_chunks.py" --build "$build" --params 300k \
  --workers 2 --chunks 8Mi --reps 1 --steps-10m 2 --shard-flags= \
  --shard-flags=--http2-bdp-probe=true 2>/dev/null)
echo "$chunks"
for want in "chunk 8388608: steps/s" "chunk 8388608 --http2-bdp-probe=true: steps/s"; do
  echo "$chunks" | grep -F -- "$want" | grep -q "shard VmHWM [0-9]* MiB" ||
    { echo "smoke: push_chunks lacks '$want' with its VmHWM" >&2; exit 1; }
done
# shape_bound.py: the 10M model's known figures (0.70 with 8 MiB chunks,
# fp32 or bf16; bf16 cut at wire bytes as before, 0.54).
shape=$(/usr/bin/python3 "$src/tests/bench/shape_bound.py" --params 10M --workers 2 --chunks 8Mi)
echo "$shape"
echo "$shape" | grep -q "10M W2 f32 chunk 8 MiB: .*shape bound sync 0.70" &&
  echo "$shape" | grep -q "10M W2 bf16 chunk 8 MiB: .*shape bound sync 0.70" &&
  /usr/bin/python3 "$src/tests/bench/shape_bound.py" --params 10M --workers 2 --chunks 8Mi \
    --wire bf16 --wire-chunks | grep -q "shape bound sync 0.54" ||
  { echo "smoke: shape_bound.py figures changed" >&2; exit 1; }
