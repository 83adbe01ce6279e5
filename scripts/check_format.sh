#!/usr/bin/env bash
# Checks the C files of scripts/format-checked.txt against .clang-format with
# clang-format-14 (Debian's clang-format-14, in scripts/deps.sh's test
# list): exit 1 naming every file that is not formatted, with the diff; exit
# 2 without the tool. A listed file that no longer exists is reported and
# skipped. --fix formats them instead.
set -euo pipefail
cd "$(dirname "$0")/.."
cf=${CLANG_FORMAT:-clang-format-14}
if ! command -v "$cf" >/dev/null; then
  echo "check_format: $cf not found (Debian package clang-format-14; scripts/deps.sh installs it)" >&2
  exit 2
fi
fix=0
if [[ ${1:-} == --fix ]]; then fix=1; fi
bad=0 n=0
while read -r f; do
  [[ -z $f || $f == \#* ]] && continue
  if [[ ! -f $f ]]; then
    # A file renamed or removed since it was listed: nothing to check, but
    # say so, so the list gets its new name.
    echo "check_format: $f (listed in scripts/format-checked.txt) no longer exists; skipped" >&2
    continue
  fi
  n=$((n + 1))
  if ((fix)); then
    "$cf" -i --style=file "$f"
  elif ! "$cf" --style=file "$f" | diff -u --label "$f" --label "$f (clang-format)" "$f" -; then
    bad=$((bad + 1))
  fi
done < scripts/format-checked.txt
if ((bad)); then
  echo "check_format: $bad of $n files differ from .clang-format (scripts/check_format.sh --fix formats them)" >&2
  exit 1
fi
echo "check_format: $n files match .clang-format"
