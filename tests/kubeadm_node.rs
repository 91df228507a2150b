//! Issue 34: a kubeadm node on Debian, as a new user meets it, against the real API server of
//! `../shared/tools/kube-apiserver/cluster`. In a mount namespace of its own (`unshare -m`)
//! the test lays out the node's real paths as kubeadm does, leaving the machine's own as they
//! are: `/etc/kubernetes/kubelet.conf` naming the client certificate
//! `/var/lib/kubelet/pki/kubelet-client-current.pem`, `/var/lib/kubelet/config.yaml`,
//! `/etc/default` and no `/etc/sysconfig`. Then it follows the docs' kubeadm steps: the
//! environment file installed as `/etc/default/kubelet-ca-agent`, `sync` with no flag at all
//! (which must name the kubeadm source), the source set in the environment file, `sync`
//! again, and `run` with no flag, read through `/readyz?verbose` and `/metrics`.

mod common;

use std::fs;
use std::process::Command;

use common::real_cluster::Cluster;
use common::{agent_bin, is_root, require};

const KUBEADM_SOURCE: &str =
    "configmap:kube-system/extension-apiserver-authentication/client-ca-file";

/// Runs inside the mount namespace: $1 the work directory, $2 the agent, $3 the repository.
/// Each step's stdout, stderr and exit code go to $W/out/<step>.{out,err,code}.
const NODE_SCRIPT: &str = r#"
set -eu
W=$1; BIN=$2; REPO=$3
mount --make-rprivate /
# /etc as a copy (with /etc/kubernetes, without /etc/sysconfig), /var/lib empty: the node's
# real paths, the machine's untouched.
cp -a /etc "$W/etc" 2>/dev/null || true
rm -rf "$W/etc/sysconfig" "$W/etc/kubernetes" "$W/etc/default/kubelet-ca-agent"
mkdir -p "$W/etc/kubernetes/pki" "$W/etc/default"
mount --bind "$W/etc" /etc
mount -t tmpfs tmpfs /var/lib
mkdir -p /var/lib/kubelet/pki
# kubeadm's layout: the cluster CA, the kubelet's kubeconfig and its rotating client
# certificate (a link to a dated file holding certificate and key), its configuration.
cp "$W/ca.crt" /etc/kubernetes/pki/ca.crt
cat "$W/node.crt" "$W/node.key" >/var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem
chmod 600 /var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem
ln -s /var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem /var/lib/kubelet/pki/kubelet-client-current.pem
cp "$W/kubelet.conf" /etc/kubernetes/kubelet.conf
cp "$W/config.yaml" /var/lib/kubelet/config.yaml
mkdir -p "$W/out" "$W/home"
step() {   # NAME COMMAND...
  local name=$1; shift
  set +e
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$W/home" "${ENVIRONMENT[@]}" "$@" >"$W/out/$name.out" 2>"$W/out/$name.err"
  echo $? >"$W/out/$name.code"
  set -e
}
# As systemd's EnvironmentFile= reads it: one NAME=VALUE a line, no shell expansion.
environment() { mapfile -t ENVIRONMENT < <(grep -E '^KUBELET_CA_AGENT_[A-Z_]+=' /etc/default/kubelet-ca-agent); }
# The docs' install of the environment file, on a machine without /etc/sysconfig.
if [ -d /etc/sysconfig ]; then echo "/etc/sysconfig exists" >&2; exit 3; fi
eval "$INSTALL_ENV"
test -f /etc/default/kubelet-ca-agent
ENVIRONMENT=()
# 1. sync with no flag and no environment: the default source, which is OpenShift's.
step sync-default "$BIN" sync
# 1b. run, the same (only its port set, in the environment): the log names the source.
set +e
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$W/home" KUBELET_CA_AGENT_LISTEN=127.0.0.1:$PORT \
  "$BIN" run >"$W/out/run-default.out" 2>"$W/out/run-default.err" &
agent=$!
for _ in $(seq 150); do
  grep -q 'use --source' "$W/out/run-default.err" && break
  sleep 0.1
done
kill -TERM $agent; wait $agent
set -e
# 2. the environment file, edited as the docs' kubeadm steps say, and sync.
sed -i -e "s|^KUBELET_CA_AGENT_SOURCE=.*|KUBELET_CA_AGENT_SOURCE=$KUBEADM_SOURCE|" \
       -e "s|^KUBELET_CA_AGENT_LISTEN=.*|KUBELET_CA_AGENT_LISTEN=127.0.0.1:$PORT|" /etc/default/kubelet-ca-agent
environment
step sync "$BIN" sync
cp /etc/kubernetes/kubelet-ca.crt "$W/out/bundle.crt" 2>/dev/null || true
# The docs' gate before the kubelet is pointed at the bundle.
step inspect "$BIN" inspect /etc/kubernetes/kubelet-ca.crt
# 3. the daemon, with no flag: its health and metrics once ready.
set +e
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$W/home" "${ENVIRONMENT[@]}" "$BIN" run >"$W/out/run.out" 2>"$W/out/run.err" &
agent=$!
for _ in $(seq 100); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/readyz")" = 200 ] && break
  sleep 0.1
done
sleep 0.5
curl -s "http://127.0.0.1:$PORT/readyz?verbose" >"$W/out/readyz"
curl -s "http://127.0.0.1:$PORT/metrics" >"$W/out/metrics"
kill -TERM $agent; wait $agent; echo $? >"$W/out/run.code"
"#;

#[test]
fn a_kubeadm_node_on_debian_works_from_the_docs_with_no_flag() {
    if !require(is_root(), "a mount namespace needs root")
        || !require(
            Command::new("unshare").arg("--help").output().is_ok(),
            "unshare (util-linux) is not installed",
        )
    {
        return;
    }
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let w = work.path();

    // kube-apiserver publishes its client CA in kube-system/extension-apiserver-authentication
    // itself (a post-start hook): wait for it.
    let configmap = "/api/v1/namespaces/kube-system/configmaps/extension-apiserver-authentication";
    assert!(
        common::daemon::eventually(std::time::Duration::from_secs(20), || cluster
            .request("GET", configmap, None)
            .0
            == 200),
        "the API server did not publish {configmap}"
    );
    // The Role that reads it exists (the API server's bootstrap policy); kubeadm's nodes are
    // given it by the binding the docs' "RBAC for the unit" creates.
    let (code, role) = cluster.request(
        "GET",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/roles/extension-apiserver-authentication-reader",
        None,
    );
    assert_eq!(code, 200, "{role}");
    let binding = serde_json::json!({"apiVersion":"rbac.authorization.k8s.io/v1","kind":"RoleBinding",
        "metadata":{"name":"kubelet-ca-agent-source","namespace":"kube-system"},
        "roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"Role","name":"extension-apiserver-authentication-reader"},
        "subjects":[{"apiGroup":"rbac.authorization.k8s.io","kind":"Group","name":"system:nodes"}]});
    let (code, body) = cluster.request(
        "POST",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/rolebindings",
        Some(&binding),
    );
    assert_eq!(code, 201, "{body}");

    // The node: its identity signed by the cluster CA, as the kubelet's TLS bootstrap does;
    // its kubelet.conf, and its configuration with step 3 of the docs done (its client CA is
    // the bundle).
    cluster.kubeadm_node_files(w, "worker-1");
    let port = common::daemon::free_port();
    let repo = env!("CARGO_MANIFEST_DIR");
    let install = install_command_of_the_docs();
    let out = Command::new("unshare")
        .args(["-m", "bash", "-c", NODE_SCRIPT, "node"])
        .arg(w)
        .arg(agent_bin())
        .arg(repo)
        .current_dir(repo)
        .env("INSTALL_ENV", &install)
        .env("KUBEADM_SOURCE", KUBEADM_SOURCE)
        .env("PORT", port.to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the node script failed ({install}): {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |name: &str| fs::read_to_string(w.join("out").join(name)).unwrap_or_default();

    // 1. No flag: the kubelet's kubeconfig is found and said; the default source, OpenShift's,
    //    is not on this cluster, and the error names the one that is (exit 1).
    let err = read("sync-default.err");
    assert_eq!(read("sync-default.code").trim(), "1", "{err}");
    assert!(
        err.contains(
            "kubeconfig /etc/kubernetes/kubelet.conf (the kubelet's kubeconfig on kubeadm)"
        ),
        "{err}"
    );
    assert!(
        err.contains(&format!("use --source {KUBEADM_SOURCE}")),
        "{err}"
    );
    assert!(!err.contains("TLS bootstrap"), "{err}");

    // 1b. run, the same: the daemon's log names the source that this cluster has.
    let log = read("run-default.err");
    let hint = log
        .lines()
        .find(|l| l.contains(&format!("use --source {KUBEADM_SOURCE}")))
        .unwrap_or_else(|| panic!("run does not name {KUBEADM_SOURCE}:\n{log}"));
    assert!(
        hint.contains("WARN")
            && hint.contains("configmap:openshift-config-managed/kube-apiserver-client-ca"),
        "{hint}"
    );
    assert!(
        log.contains(
            "kubeconfig /etc/kubernetes/kubelet.conf (the kubelet's kubeconfig on kubeadm)"
        ),
        "{log}"
    );

    // 2. With the source set in /etc/default/kubelet-ca-agent, no flag: the bundle holds the
    //    cluster's client CA, which openssl verifies the node's certificate with.
    let err = read("sync.err");
    assert_eq!(read("sync.code").trim(), "0", "{err}");
    let bundle = read("bundle.crt");
    assert!(bundle.contains("BEGIN CERTIFICATE"), "{err}");
    let node_crt = fs::read_to_string(w.join("node.crt")).unwrap();
    assert!(common::openssl_verifies(
        &w.join("out/bundle.crt"),
        &node_crt
    ));

    // The docs' gate (docs/operations.md, "On kubeadm"): inspect passes on that bundle.
    assert_eq!(read("inspect.code").trim(), "0", "{}", read("inspect.out"));

    // 3. run, with no flag: ready, the kubelet uses the bundle, the source is up, the
    //    credentials said at start.
    let readyz = read("readyz");
    let log = read("run.err");
    assert!(readyz.contains("[+]bundle-valid ok"), "{readyz}\n{log}");
    assert!(readyz.contains("[+]in-sync ok"), "{readyz}\n{log}");
    assert!(
        readyz.contains("[+]kubelet-uses-bundle ok"),
        "{readyz}\n{log}"
    );
    assert!(
        readyz.contains(&format!("[+]source:{KUBEADM_SOURCE} ok")),
        "{readyz}\n{log}"
    );
    assert!(readyz.contains("readyz check passed"), "{readyz}");
    assert!(
        log.contains(
            "kubeconfig /etc/kubernetes/kubelet.conf (the kubelet's kubeconfig on kubeadm)"
        ),
        "{log}"
    );
    assert!(
        read("metrics")
            .contains("kubelet_ca_bundle_in_sync{filepath=\"/etc/kubernetes/kubelet-ca.crt\"} 1"),
        "{}",
        read("metrics")
    );
    assert_eq!(read("run.code").trim(), "0", "{log}");
}

/// The docs' command that installs the environment file (docs/operations.md, "As a systemd
/// unit"): run as it is written, on a machine without /etc/sysconfig.
fn install_command_of_the_docs() -> String {
    let docs =
        fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md")).unwrap();
    let line = docs
        .lines()
        .find(|l| {
            l.contains("systemd/kubelet-ca-agent.sysconfig")
                && l.trim_start().starts_with("install")
        })
        .expect("docs/operations.md installs the environment file");
    line.split('#').next().unwrap().trim().to_string()
}
