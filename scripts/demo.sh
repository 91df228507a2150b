#!/usr/bin/env bash
# Runs kubelet-ca-agent for real with no cluster: signers made now with openssl, a dir:
# source, and a bundle, state and history under ./demo/ (git ignores it). Run it again to
# see a rotation: a new signer is added each time and the bundle is replaced atomically.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v openssl >/dev/null || { apt-get update -qq && apt-get install -y -qq openssl; }
cargo build --release --quiet
bin=target/release/kubelet-ca-agent
demo=demo
mkdir -p "$demo/signers" "$demo/keys" "$demo/etc-kubernetes" "$demo/state"

new_signer() { # name days
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$2" \
    -subj "/O=demo/CN=$1" -keyout "$demo/keys/$1.key" -out "$demo/signers/$1.crt" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    2>/dev/null
}

# Signers from an earlier run expire (30 days): start afresh when one has.
for f in "$demo"/signers/*.crt; do
  [ -e "$f" ] && ! openssl x509 -in "$f" -noout -checkend 0 >/dev/null && rm -f "$demo"/signers/*.crt
done
[ -e "$demo/signers/kube-apiserver-to-kubelet-signer.crt" ] ||
  new_signer kube-apiserver-to-kubelet-signer 365
new_signer "kube-csr-signer-$(date +%Y%m%d-%H%M%S)" 30

args=(--source "dir:$demo/signers" --bundle "$demo/etc-kubernetes/kubelet-ca.crt"
      --state-dir "$demo/state")
echo "== sync --dry-run: what would change"
"$bin" sync "${args[@]}" --dry-run
echo "== sync: write the bundle"
"$bin" sync "${args[@]}"
echo "== sync again: already in sync, the file is not touched"
"$bin" sync "${args[@]}"
echo "== inspect the written bundle"
"$bin" inspect "$demo/etc-kubernetes/kubelet-ca.crt" --warn-within 7d || true
echo "== history of replaced bundles: $demo/state/history"
ls "$demo/state/history" 2>/dev/null || echo "(none yet: run again to rotate)"
