#!/usr/bin/env bash
# Runs kubelet-ca-agent for real with no cluster: signers made now with openssl in a dir:
# source, the bundle, state and history under ./demo/ (git ignores it), and metrics and
# health on 127.0.0.1:9745. It shows a rotation and a repair, then keeps the daemon running
# in the foreground until Ctrl-C (or for DEMO_SECONDS seconds, if set).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
command -v python3 >/dev/null || need+=(python3)
[ ${#need[@]} -eq 0 ] || { apt-get update -qq && apt-get install -y -qq "${need[@]}"; }
step() { printf '\n== %s\n' "$*"; }

step "cargo build --release (about 5 minutes the first time on 2 cores)"
# The binary is wherever cargo puts it (CARGO_TARGET_DIR, build.target-dir or build.target
# in a cargo config, ...): cargo's own compiler-artifact message names it. Progress and
# warnings go to the terminal as usual; only the JSON messages are read here.
bin=$(cargo build --release --bin kubelet-ca-agent --message-format=json-render-diagnostics |
  python3 -c '
import json, sys
exe = None
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "kubelet-ca-agent" \
            and "bin" in m["target"]["kind"] and m.get("executable"):
        exe = m["executable"]
if not exe:
    sys.exit("cargo build reported no kubelet-ca-agent executable")
print(exe)
')
echo "built $bin"
demo=demo
listen=${DEMO_LISTEN:-127.0.0.1:9745}
mkdir -p "$demo/signers" "$demo/keys" "$demo/etc-kubernetes" "$demo/state"
rm -f "$demo"/signers/*.crt

new_signer() { # name days
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$2" \
    -subj "/O=demo/CN=$1" -keyout "$demo/keys/$1.key" -out "$demo/signers/$1.crt.tmp" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    2>/dev/null
  mv "$demo/signers/$1.crt.tmp" "$demo/signers/$1.crt"   # appear whole, like a real rotation
}

new_signer kube-apiserver-to-kubelet-signer 365
new_signer kube-csr-signer-1 30
args=(--source "dir:$demo/signers" --bundle "$demo/etc-kubernetes/kubelet-ca.crt"
      --state-dir "$demo/state" --listen "$listen" --insecure-metrics --node-name demo-node)

step "sync --dry-run: what the daemon is about to do"
"$bin" sync "${args[@]:0:6}" --dry-run

step "run: the daemon, metrics and health on http://$listen"
"$bin" run "${args[@]}" &
agent=$!
trap 'kill $agent 2>/dev/null; wait $agent 2>/dev/null' EXIT
until curl -sf "http://$listen/readyz" >/dev/null; do sleep 0.1; done
curl -s "http://$listen/readyz?verbose"
"$bin" inspect "$demo/etc-kubernetes/kubelet-ca.crt" || true

step "rotation: a new signer appears in the source directory"
new_signer kube-csr-signer-2 30
sleep 0.5
"$bin" inspect "$demo/etc-kubernetes/kubelet-ca.crt" || true

step "drift: something overwrites the bundle; the daemon repairs it"
echo "not a bundle" > "$demo/etc-kubernetes/kubelet-ca.crt"
sleep 0.5
head -1 "$demo/etc-kubernetes/kubelet-ca.crt"

step "metrics (a few of them)"
curl -s "http://$listen/metrics" | grep -E '^(x509_cert_not_after|kubelet_ca_(writes|repairs)_total|kubelet_ca_bundle_in_sync)'

step "history of replaced bundles in $demo/state/history"
ls "$demo/state/history"

step "the daemon keeps running; add or remove files in $demo/signers and watch the bundle follow. Ctrl-C stops it."
if [ -n "${DEMO_SECONDS:-}" ]; then sleep "$DEMO_SECONDS"; else wait $agent; fi
