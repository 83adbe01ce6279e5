#!/usr/bin/env bash
# The skip wrapper's contract (tests/cmake/skip77.sh): a reported skip is
# exit 77 and is logged, a failure stays a failure, a pass stays a pass.
set -u
w=$1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
fail=0
expect() {  # expect RC DESCRIPTION COMMAND...
  local want=$1 what=$2
  shift 2
  FPS_SKIP_LOG=$log "$w" demo "$@" >/dev/null 2>&1
  local rc=$?
  if [[ $rc -ne $want ]]; then echo "FAIL: $what: exit $rc, want $want"; fail=1; fi
}
expect 0 "plain pass" true
expect 3 "plain failure" sh -c 'exit 3'
expect 77 "cmocka skip" sh -c 'echo "[  SKIPPED ] case_a"; echo "[  SKIPPED ] 1 test(s), listed below:"'
expect 77 "unittest skip" sh -c 'echo "test_b (mod.Cls.test_b) ... skipped '"'"'no tool'"'"'"'
expect 1 "failure beside a skip" sh -c 'echo "[  SKIPPED ] case_c"; exit 1'
expect 77 "a command's own 77" sh -c 'exit 77'
want=$'demo *\ndemo case_a\ndemo mod.Cls.test_b'
got=$(sort "$log")
if [[ $got != "$want" ]]; then echo "FAIL: skip log is:"; echo "$got"; fail=1; fi
exit $fail
