#!/usr/bin/env bash
# Creates the Secret factorps-tokens that the shard StatefulSets and the
# worker Job mount (keys: workers, admins, peers, peer-<i>: shard i's peer
# token alone, which its replicas send each other), with fresh random tokens,
# unless it exists. Run it once before `kubectl apply -k deploy/kubernetes`
# (the pods wait for the Secret). Tokens never touch the repository or the
# command line of another process.
# Usage: deploy/kubernetes/make-tokens.sh [NAMESPACE] [SHARD_COUNT]
#   (defaults: factorps, 2: the kustomization's namespace and replicas)
# Admin calls from a machine with kubectl:
#   kubectl -n factorps get secret factorps-tokens -o jsonpath='{.data.admins}' | base64 -d > admin.token
#   factorps checkpoint --shards ... --token-file admin.token \
#     --tls-ca DIR/ca.crt --tls-cert DIR/admin.crt --tls-key DIR/admin.key
# (DIR: where deploy/make-tls.sh wrote the job's TLS material; the proxies
# admit only certificates of its CA.)
set -euo pipefail
ns=${1:-factorps}
count=${2:-2}
if kubectl -n "$ns" get secret factorps-tokens >/dev/null 2>&1; then
  echo "secret factorps-tokens already exists in namespace $ns: kept" >&2
  exit 0
fi
kubectl get namespace "$ns" >/dev/null 2>&1 || kubectl create namespace "$ns"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
umask 077
new() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
new >"$dir/workers"
new >"$dir/admins"
args=()
for ((i = 0; i < count; i++)); do
  new >"$dir/peer-$i"
  echo "$i:$(cat "$dir/peer-$i")" >>"$dir/peers"
  args+=(--from-file="peer-$i=$dir/peer-$i")
done
kubectl -n "$ns" create secret generic factorps-tokens --from-file=workers="$dir/workers" \
  --from-file=admins="$dir/admins" --from-file=peers="$dir/peers" "${args[@]}"
