#!/usr/bin/env bash
# Creates the TLS material of a factorps job: a CA and one certificate per
# role, into DIR (openssl only). Existing files are kept: running it again
# issues only what is missing (more shards: --shards 4), so it is safe in a
# start-up hook. deploy/README.md (Security) describes the model.
#
#   DIR/ca.crt                  the job's CA: every party trusts it
#   DIR/server-<i>-<r>.crt/.key shard i, replica r (a, b): the certificate
#                               its front proxy serves; DNS names of the
#                               compose service shard-<i>-<r> and of the
#                               Kubernetes pod factorps-shard-<r>-<i> under
#                               the headless Service factorps-shard
#   DIR/peer-<i>.crt/.key       client certificate of shard i's replicas
#                               (replication, Exchange): CN peer-<i>,
#                               URI urn:factorps:peer:<i>
#   DIR/worker.crt/.key         client certificate of the workers
#   DIR/admin.crt/.key          client certificate of administrators
#   CA_DIR/ca.key               the CA's key: only this script needs it;
#                               keep it off the shards and workers
#
# Usage: make-tls.sh [options] DIR
#   --shards N       shards (default 2)
#   --namespace NS   Kubernetes namespace in the server names (default factorps)
#   --ca-dir D       where the CA key lives (default DIR/ca-private)
#   --days N         validity of the role certificates (default 365; CA 10 years)
#   --renew          reissue every role certificate (new keys) with the
#                    existing CA: clients and shards that trust the CA keep
#                    working across the change (restart them to load the
#                    new files)
#   --force          replace everything, the CA too (everything must then
#                    be restarted with the new files)
#   --kubernetes     after issuing, print two Secrets on stdout
#                    (kubectl apply -f -): factorps-tls-shard (ca.crt,
#                    server-*, peer-*) for the shard pods and
#                    factorps-tls-worker (ca.crt, worker.*) for the workers.
#                    The CA key and the admin key stay in DIR.
# Exit 0: done; 1: an error (named on stderr); 2: bad usage.
set -euo pipefail

usage() {
  sed -n '2,/^# Exit/s/^# \{0,1\}//p' "$0" >&2
  exit 2
}

shards=2 ns=factorps ca_dir= days=365 renew=0 force=0 k8s=0 dir=
while (($#)); do
  case $1 in
    --shards) shards=${2:?}; shift 2 ;;
    --namespace) ns=${2:?}; shift 2 ;;
    --ca-dir) ca_dir=${2:?}; shift 2 ;;
    --days) days=${2:?}; shift 2 ;;
    --renew) renew=1; shift ;;
    --force) force=1; shift ;;
    --kubernetes) k8s=1; shift ;;
    -h | --help) usage ;;
    -*) echo "make-tls.sh: unknown option $1" >&2; usage ;;
    *) [[ -z $dir ]] || usage; dir=$1; shift ;;
  esac
done
[[ -n $dir ]] || usage
[[ $shards =~ ^[1-9][0-9]{0,3}$ ]] || { echo "make-tls.sh: --shards $shards is not a count" >&2; exit 2; }
[[ $days =~ ^[1-9][0-9]{0,4}$ ]] || { echo "make-tls.sh: --days $days is not a count" >&2; exit 2; }
[[ $ns =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || { echo "make-tls.sh: bad namespace $ns" >&2; exit 2; }
command -v openssl >/dev/null || { echo "make-tls.sh: openssl not installed" >&2; exit 1; }
ca_dir=${ca_dir:-$dir/ca-private}

umask 077
mkdir -p "$dir" "$ca_dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

say() { echo "make-tls.sh: $*" >&2; }

if ((force)); then
  rm -f "$dir"/*.crt "$dir"/*.key "$ca_dir/ca.key"
fi

# The CA. A ca.crt without its key cannot issue anything new; a key without
# its certificate is left over from a failed run and is replaced.
if [[ ! -s $dir/ca.crt ]]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$ca_dir/ca.key" -out "$tmp/ca.crt" -days 3650 -sha256 \
    -subj "/O=factorps/CN=factorps job CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  mv "$tmp/ca.crt" "$dir/ca.crt"
  chmod 0644 "$dir/ca.crt"
  say "new CA $dir/ca.crt (key $ca_dir/ca.key)"
fi

# issue NAME SUBJECT EXTENSIONS: NAME.crt and NAME.key signed by the CA,
# unless both exist (and --renew was not given).
issue() {
  local name=$1 subj=$2 ext=$3
  if ((!renew)) && [[ -s $dir/$name.crt && -s $dir/$name.key ]]; then
    return 0
  fi
  if [[ ! -s $ca_dir/ca.key ]]; then
    say "$name: the CA key $ca_dir/ca.key is missing, so nothing new can be signed (--ca-dir, or --force for a new CA)"
    exit 1
  fi
  printf '%s\n' "$ext" >"$tmp/ext"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$tmp/$name.key" -out "$tmp/$name.csr" -subj "$subj" 2>"$tmp/err" ||
    { cat "$tmp/err" >&2; exit 1; }
  openssl x509 -req -in "$tmp/$name.csr" -CA "$dir/ca.crt" -CAkey "$ca_dir/ca.key" \
    -set_serial "0x$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" -days "$days" -sha256 \
    -extfile "$tmp/ext" -out "$tmp/$name.crt" 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  # Key first: a crash between the two leaves no certificate without its key.
  mv "$tmp/$name.key" "$dir/$name.key"
  mv "$tmp/$name.crt" "$dir/$name.crt"
  chmod 0600 "$dir/$name.key"
  chmod 0644 "$dir/$name.crt"
  say "issued $dir/$name.crt ($subj)"
}

client_ext() {
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n'
  printf 'extendedKeyUsage=clientAuth\nsubjectAltName=URI:urn:factorps:%s\n' "$1"
}

for ((i = 0; i < shards; i++)); do
  for r in a b; do
    k="factorps-shard-$r-$i.factorps-shard"
    issue "server-$i-$r" "/O=factorps/OU=shard/CN=shard-$i-$r" \
      "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=DNS:shard-$i-$r,DNS:$k,DNS:$k.$ns.svc,DNS:$k.$ns.svc.cluster.local"
  done
  issue "peer-$i" "/O=factorps/OU=peer/CN=peer-$i" "$(client_ext "peer:$i")"
done
issue worker "/O=factorps/OU=worker/CN=worker" "$(client_ext worker)"
issue admin "/O=factorps/OU=admin/CN=admin" "$(client_ext admin)"

if ((k8s)); then
  # secret NAME FILE...: a Secret of those files (keys: their base names).
  secret() {
    local name=$1 f
    shift
    printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n' "$name" "$ns"
    printf '  labels:\n    app.kubernetes.io/name: factorps\ntype: Opaque\ndata:\n'
    for f in "$@"; do
      printf '  %s: %s\n' "$(basename "$f")" "$(base64 -w0 <"$f")"
    done
  }
  files=("$dir/ca.crt")
  for ((i = 0; i < shards; i++)); do
    files+=("$dir/server-$i-a.crt" "$dir/server-$i-a.key" "$dir/server-$i-b.crt" "$dir/server-$i-b.key"
      "$dir/peer-$i.crt" "$dir/peer-$i.key")
  done
  secret factorps-tls-shard "${files[@]}"
  secret factorps-tls-worker "$dir/ca.crt" "$dir/worker.crt" "$dir/worker.key"
fi
