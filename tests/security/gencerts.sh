#!/bin/sh
# Generates the certificates and tokens the security tests use, into DIR,
# with the openssl command-line tool (EC P-256 keys: fast to make).
#   ca.pem ca.key            CA "factorps test CA"
#   server.pem server.key    signed by ca: 127.0.0.1, ::1, localhost, shard.factorps.test
#   client.pem client.key    signed by ca, clientAuth
#   expired.pem expired.key  signed by ca, validity ended a day before it began
#   ca2.pem ca2.key          a second, unrelated CA
#   other.pem other.key      signed by ca2, clientAuth
#   token token2 wrong-token tokens.txt (token and token2, for rotation)
# Usage: gencerts.sh DIR
set -eu
dir=$1
mkdir -p "$dir"
cd "$dir"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

ca() { # name subject
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -out "$1.pem" -days 30 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}

leaf() { # name ca subject days ext
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$3"
  printf '%s\n' "$5" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -out "$1.pem" \
    -days "$4" -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca "factorps test CA"
ca ca2 "unrelated CA"
leaf server ca "factorps shard" 30 "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost,DNS:shard.factorps.test"
client_ext="basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
leaf client ca "worker 0" 30 "$client_ext"
leaf other ca2 "intruder" 30 "$client_ext"
# OpenSSL 3.0's x509 -req has no -not_before; -days -1 ends the validity
# a day before it starts, which verification reports as expired.
leaf expired ca "expired worker" -1 "$client_ext"

openssl rand -hex 32 > token
openssl rand -hex 32 > token2
openssl rand -hex 32 > wrong-token
{ echo "# current and next token (rotation)"; cat token; echo; cat token2; } > tokens.txt
