#!/usr/bin/env bash
# Usage: skip77.sh TEST_NAME COMMAND [ARGS...]
#
# Runs one test command and tells ctest when it skipped instead of passing.
# CMocka's skip() and unittest's skipTest() both exit 0, so ctest would
# count a test that left checks out as passed. This wrapper (every test is
# registered through it: the add_test override in tests/CMakeLists.txt)
# streams the output; if the command exited 0 but reported a skipped case,
# it exits 77, which the test's SKIP_RETURN_CODE turns into "Skipped". A
# failure stays a failure. With FPS_SKIP_LOG set, each skipped case is
# appended to that file as "TEST_NAME CASE" (a command that exits 77 itself
# as "TEST_NAME *"), for scripts/test.sh to check against
# tests/allowed-skips.txt.
set -u
name=$1
shift
out=$(mktemp "${TMPDIR:-/tmp}/fps-test-out.XXXXXX")
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
log() { [[ -n ${FPS_SKIP_LOG:-} ]] && echo "$name $1" >>"$FPS_SKIP_LOG"; return 0; }
if [[ $rc -eq 77 ]]; then
  log '*'
  exit 77
fi
if [[ $rc -eq 0 ]]; then
  # CMocka: "[  SKIPPED ] case" (not its "N test(s)" summary lines);
  # unittest -v: "test_x (module.Class.test_x) ... skipped 'why'".
  cases=$(sed -nE -e '/^\[  SKIPPED \] [0-9]+ test/d' -e 's/^\[  SKIPPED \] ([^ ]+)$/\1/p' \
               -e 's/^([A-Za-z0-9_]+) \(([A-Za-z0-9_.]+)\) \.\.\. skipped .*/\2/p' "$out" | sort -u)
  if [[ -z $cases ]] && grep -qE '^OK \(skipped=' "$out"; then cases='?'; fi
  if [[ -n $cases ]]; then
    for c in $cases; do log "$c"; done
    echo "fps: skipped:" $cases "-> exit 77: ctest reports this test as skipped, not passed"
    exit 77
  fi
fi
exit $rc
