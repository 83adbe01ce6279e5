#!/usr/bin/env bash
# Usage: check_skips.sh SKIP_LOG ALLOWED VARIANT
#
# SKIP_LOG: "TEST CASE" lines written by tests/cmake/skip77.sh for every
# skipped test case. ALLOWED: lines "VARIANTS TEST_GLOB CASE_GLOB  # why"
# (VARIANTS: comma-separated normal,asan,tsan,neon or *). Prints every skip,
# and exits 1 if one is not allowed for this variant.
set -euo pipefail
log=$1 allowed=$2 variant=$3
bad=0
[[ -s $log ]] || exit 0
while read -r test case; do
  ok=0
  while read -r vars tglob cglob _; do
    [[ -z ${vars:-} || $vars == \#* ]] && continue
    [[ ",$vars," == *",$variant,"* || $vars == '*' ]] || continue
    # shellcheck disable=SC2053
    if [[ $test == $tglob && $case == $cglob ]]; then ok=1; break; fi
  done <"$allowed"
  if ((ok)); then
    echo "skipped (allowed): $test $case"
  else
    echo "SKIPPED, NOT ALLOWED: $test $case (tests/allowed-skips.txt lists what may skip)" >&2
    bad=1
  fi
done < <(sort -u "$log")
exit $bad
