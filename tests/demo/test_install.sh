#!/usr/bin/env bash
# What a user of the installed tools meets:
# - `cmake --install` into a temporary prefix; factorps-server, factorps and
#   a program built with `pkg-config --cflags --libs factorps` run with no
#   LD_LIBRARY_PATH (and ldd resolves libfactorps into the prefix);
# - `pkg-config --cflags factorps` carries no -DNOMINMAX (nor any -D);
# - `factorps --version` prints the project's version;
# - every subcommand that talks to shards takes them from FACTORPS_SHARDS,
#   and without either says so (exit 2);
# - `factorps stats` ends with a total line carrying the AdamW ratio.
#   tests/demo/test_install.sh BUILD_DIR SOURCE_DIR VERSION
set -euo pipefail
build=$1 src=$2 version=$3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/factorps-install.XXXXXX")
spid=
cleanup() {
  [[ -n $spid ]] && { kill -TERM "$spid" 2>/dev/null; wait "$spid" 2>/dev/null || true; }
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
unset LD_LIBRARY_PATH FACTORPS_SHARDS FACTORPS_LIB

cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
p=$tmp/prefix
lib=$(dirname "$(find "$p" -name 'libfactorps.so' | head -1)")
export PKG_CONFIG_PATH=$lib/pkgconfig

cflags=$(pkg-config --cflags factorps)
echo "pkg-config --cflags factorps: $cflags"
[[ $cflags != *NOMINMAX* && $cflags != *-D* ]] || fail "cflags leak definitions: $cflags"
[[ $(pkg-config --modversion factorps) == "$version" ]] || fail "pkg-config version"

out=$("$p/bin/factorps" --version)
[[ $out == "factorps $version" ]] || fail "factorps --version printed '$out'"
"$p/bin/factorps-server" --version | grep -qx "factorps-server $version" ||
  fail "factorps-server --version"

# A program linked with the installed shared library, nothing else set.
cc -o "$tmp/client" "$src/tests/demo/installed_client.c" $(pkg-config --cflags --libs factorps)
found=$(ldd "$tmp/client" | awk '/libfactorps\.so/ { print $3 }')
[[ -n $found && $(realpath "$found") == $(realpath "$lib")/libfactorps.so* ]] ||
  { ldd "$tmp/client"; fail "libfactorps is not found in the prefix without LD_LIBRARY_PATH"; }

"$p/bin/factorps-server" --listen 127.0.0.1:0 --port-file "$tmp/port" --mode async \
  --log-level warn >"$tmp/server.log" 2>&1 &
spid=$!
for _ in $(seq 200); do [[ -s $tmp/port ]] && break; sleep 0.05; done
[[ -s $tmp/port ]] || { cat "$tmp/server.log"; fail "the installed server did not start"; }
addr=127.0.0.1:$(cat "$tmp/port")
"$tmp/client" "$addr" | grep -q "created w 64x32" || fail "the installed client"

# No shards anywhere: a clear usage error from each subcommand.
for cmd in stats "pull w" checkpoint "load --steps 2"; do
  set +e
  msg=$("$p/bin/factorps" $cmd 2>&1)
  rc=$?
  set -e
  ((rc == 2)) && [[ $msg == *"set FACTORPS_SHARDS"* ]] ||
    fail "factorps $cmd without shards: status $rc, '$msg'"
done

export FACTORPS_SHARDS=$addr
stats=$("$p/bin/factorps" stats)
echo "$stats"
last=$(echo "$stats" | tail -n 1)
# 64x32: Adafactor keeps 64 + 32 = 96 elements, AdamW 2 x 2048 = 4096.
[[ $last == "total (1 shard): tensors 1  params 2048  optimizer state 96 elements"*"AdamW would keep 4096"*": 42.7x Adafactor's" ]] ||
  fail "stats total line: '$last'"
"$p/bin/factorps" pull w | grep -q "w" || fail "pull with FACTORPS_SHARDS"
"$p/bin/factorps" load --workers 1 --params 20k --steps 3 --warmup 1 | grep -q "^RESULT" ||
  fail "load with FACTORPS_SHARDS"
# No --checkpoint-dir: the shard refuses, but the command reached it.
set +e
msg=$("$p/bin/factorps" checkpoint 2>&1)
rc=$?
set -e
((rc == 1)) && [[ $msg != *"no shards"* ]] || fail "checkpoint with FACTORPS_SHARDS: $rc '$msg'"
# --shards still wins over the environment.
FACTORPS_SHARDS=127.0.0.1:1 "$p/bin/factorps" stats --shards "$addr" >/dev/null ||
  fail "--shards does not override FACTORPS_SHARDS"
echo "ok"
