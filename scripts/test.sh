#!/usr/bin/env bash
# The README's test command: installs missing packages (as root), configures,
# builds and runs every test.
#   scripts/test.sh                 normal build in build/
#   scripts/test.sh --asan          ASan+UBSan build in build-asan/
#   scripts/test.sh --tsan          TSan build in build-tsan/, tests labelled tsan
#   scripts/test.sh --neon          aarch64 cross build, unit tests under qemu-user
# Extra arguments after -- go to ctest (e.g. -- -L unit).
set -euo pipefail
cd "$(dirname "$0")/.."

variant=normal
while (($#)); do
  case "$1" in
    --asan) variant=asan ;;
    --tsan) variant=tsan ;;
    --neon) variant=neon ;;
    --) shift; break ;;
    *) echo "usage: $0 [--asan|--tsan|--neon] [-- ctest args]" >&2; exit 2 ;;
  esac
  shift
done

scripts/deps.sh test
jobs=$(nproc)
args=(-DFPS_WERROR=ON -DFPS_BUILD_TESTS=ON)  # demo.sh turns tests off in build/
case $variant in
  normal) dir=build ;;
  asan) dir=build-asan; args+=(-DFPS_SANITIZE=asan -DCMAKE_BUILD_TYPE=Debug -DFPS_BUILD_BENCH=OFF) ;;
  tsan) dir=build-tsan; args+=(-DFPS_SANITIZE=tsan -DCMAKE_BUILD_TYPE=Debug -DFPS_BUILD_BENCH=OFF) ;;
  neon) dir=build-neon; args+=(-DCMAKE_TOOLCHAIN_FILE=tests/cmake/aarch64-linux-gnu.cmake
                              -DFPS_COMMON_ONLY=ON -DFPS_BUILD_BENCH=OFF) ;;
esac
if [[ $variant == normal ]]; then
  # The Python suite runs twice: under Debian's torch 1.13 and under the
  # venv's torch 2.13 (scripts/venv.sh creates it, or reuses a complete
  # one; tests labelled torch2); the modules that use transformers or
  # accelerate a third time, under transformers 5 (label hf5). The
  # sanitizer variants keep Debian's only.
  # The hf5 venv starts from the torch2 one's packages (hard links), so
  # torch is unpacked once (and on a machine without local wheels,
  # downloaded once): one after the other from scratch took 187 s of a
  # CI run.
  # Without pip's index (an offline machine, or HTTPS it cannot verify)
  # the venvs cannot be made: the suite then runs under Debian's torch
  # alone and says so, unless FPS_REQUIRE_VENVS=1 (CI) makes it an error.
  if torch2=$(scripts/venv.sh "$dir/venv-torch2") &&
     hf5=$(scripts/venv.sh "$dir/venv-hf5" scripts/venv-hf5.txt "$dir/venv-torch2"); then
    args+=(-DFPS_TORCH2_PYTHON="$PWD/$torch2" -DFPS_HF5_PYTHON="$PWD/$hf5")
  elif [[ ${FPS_REQUIRE_VENVS:-0} == 1 ]]; then
    echo "test: the PyTorch 2 venvs could not be made (above), and FPS_REQUIRE_VENVS=1" >&2
    exit 1
  else
    echo "test: WARNING: no PyTorch 2 venv (pip could not install its pins, above): the Python" \
         "tests run under Debian's torch 1.13 only, none under torch 2.13 or transformers 5" >&2
    args+=(-DFPS_TORCH2_PYTHON= -DFPS_HF5_PYTHON=)
  fi
fi
cmake -S . -B "$dir" "${args[@]}" >/dev/null
cmake --build "$dir" -j "$jobs"
if [[ $variant == asan ]]; then
  # A rare leak report from inside OpenSSL at exit (tests/lsan.supp says
  # which); the test processes and the servers they start inherit this.
  # No spaces: the deploy tests pass sanitizer options through to shards
  # whose environment is checked to hold none.
  export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
  # Not under ASan: packaging (pip builds its own libfactorps, 127 s here)
  # and the static check of the deploy files; no code of ours runs in them
  # that the other tests do not run.
  set -- -E '^(python_install|deploy_check)$' "$@"
fi
if [[ $variant == tsan ]]; then
  # Only the concurrency tests (label tsan). Debian's gRPC is not built with
  # TSan: tests/tsan.supp ignores what happens inside it (never our code);
  # the test processes and the servers they start inherit this.
  export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
  set -- -L tsan "$@"
fi
# Every skipped test case lands in the skip log (tests/cmake/skip77.sh); a
# skip that tests/allowed-skips.txt does not list fails the run, so a test
# that silently stopped running its checks (a missing tool, a lost
# privilege, a broken fixture) cannot pass CI.
export FPS_SKIP_LOG="$PWD/$dir/skipped-tests.txt"
: >"$FPS_SKIP_LOG"
rc=0
ctest --test-dir "$dir" --output-on-failure -j "$jobs" "$@" || rc=$?
scripts/check_skips.sh "$FPS_SKIP_LOG" tests/allowed-skips.txt "$variant" || rc=1
exit $rc
