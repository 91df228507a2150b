#!/usr/bin/env bash
# Fills corpus/parse_source/ and corpus/scan/ with seeds made now: the certificates expire,
# so none is ever committed. Needs openssl. Usage: fuzz/seed.sh (from anywhere).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

ca() { # ca NAME KEYSPEC... : a self-signed CA certificate, NAME.pem and NAME.key
    local name=$1
    shift
    openssl req -x509 "$@" -nodes -days 30 -subj "/O=fuzz/CN=$name" \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
        -keyout "$name.key" -out "$name.pem" 2>/dev/null
}

ca ec -newkey ec -pkeyopt ec_paramgen_curve:P-256
ca ed25519 -newkey ed25519
ca rsa -newkey rsa:2048
# A client certificate signed by the EC CA: parses, but is not a CA.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
    -subj "/O=system:nodes/CN=system:node:fuzz" -CA ec.pem -CAkey ec.key \
    -addext basicConstraints=critical,CA:FALSE -keyout leaf.key -out leaf.pem 2>/dev/null

out=$here/corpus/parse_source
mkdir -p "$out"
cp ec.pem ed25519.pem rsa.pem leaf.pem "$out/"
cat ec.pem ed25519.pem rsa.pem >"$out/bundle.pem"
cat ec.pem leaf.pem rsa.pem ec.pem >"$out/mixed-with-duplicate.pem"
cp ec.key "$out/private-key.pem"
cat ed25519.pem ed25519.key >"$out/cert-and-key.pem"
sed 's/$/\r/' "$out/bundle.pem" >"$out/bundle-crlf.pem"
head -c 900 "$out/bundle.pem" >"$out/truncated.pem"
openssl x509 -in ec.pem -text >"$out/with-text.pem"

mkdir -p "$here/corpus/scan"
cp "$out"/* "$here/corpus/scan/"
echo "seeded $(ls "$out" | wc -l) files in $out and $here/corpus/scan"
