#!/usr/bin/env bash
# Installs the Debian 12 packages factorps needs to build, test and run.
# Usage: scripts/deps.sh [--list] [build|test|demo]   (default: test)
# As root it installs what is missing with apt-get; as another user it only
# lists what is missing and fails. --list prints the list, one per line, and
# installs nothing (scripts/check-demo-deps.sh builds with only those).
set -euo pipefail

build_pkgs=(build-essential cmake pkg-config libgrpc-dev protobuf-c-compiler libprotobuf-c-dev
  libuv1-dev libssl-dev libhttp-parser-dev libcjson-dev zlib1g-dev)
test_pkgs=(libcmocka-dev python3-numpy python3-grpcio python3-protobuf protobuf-compiler
  protobuf-compiler-grpc gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user clang
  libclang-rt-14-dev iperf3 iptables prometheus yamllint docker-compose python3-torch python3-sklearn
  openssl iproute2 procps clang-format-14 libcmocka-dev:arm64 libcjson-dev:arm64 libssl-dev:arm64
  python3-pip python3-venv python3-setuptools python3-wheel python3-tqdm python3-matplotlib
  libopenblas0-serial etcd-server nghttp2-proxy)
demo_pkgs=(python3-numpy python3-torch python3-sklearn python3-tqdm python3-matplotlib
  libopenblas0-serial)

list=0
if [[ ${1:-} == --list ]]; then list=1; shift; fi
case "${1:-test}" in
  build) want=("${build_pkgs[@]}") ;;
  test) want=("${build_pkgs[@]}" "${test_pkgs[@]}") ;;
  demo) want=("${build_pkgs[@]}" "${demo_pkgs[@]}") ;;
  *) echo "usage: $0 [--list] [build|test|demo]" >&2; exit 2 ;;
esac
if ((list)); then
  printf '%s\n' "${want[@]}"
  exit 0
fi

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]} == 0)) && exit 0

if [[ $(id -u) -ne 0 ]]; then
  echo "factorps: missing Debian packages: ${missing[*]}" >&2
  echo "install them with: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
echo "factorps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# The NEON tests link the aarch64 build of CMocka (run under qemu-user).
if [[ " ${missing[*]} " == *":arm64 "* ]] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
  dpkg --add-architecture arm64
fi
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
