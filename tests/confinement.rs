//! Issue 37: the agent attacked from inside. A library preloaded into the agent
//! (tests/attack/attack.c) runs, in one of the agent's own threads after start-up, what an
//! attacker who took the agent over would try: read the cluster CA's key, an admin
//! kubeconfig, etcd's data and a pod's token; create a static pod manifest and a cron file;
//! connect to etcd, to another local port and to a socket at systemd's bus path; run a shell.
//!
//! A kubeadm node is laid out at its real paths in a mount namespace of the test's own
//! (`unshare -m`), against the real API server of `../shared/tools/kube-apiserver/cluster`
//! (whose etcd is the one attacked), and the agent runs as the unit runs it: the kubelet's
//! kubeconfig, a cluster source, its report. Each way also shows that the agent still does
//! its job: a rotation lands in the bundle, and the node's report is written.
//! - bare: Landlock and seccomp alone;
//! - under the unit: its `InaccessiblePaths=`, `ProtectSystem=strict` with its
//!   `ReadWritePaths=`, and its one capability, applied as systemd would.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::daemon::eventually;
use common::pki::{Algorithm, Signer};
use common::real_cluster::Cluster;
use common::{agent_bin, is_root, require};

/// Runs inside the mount namespace: $1 the work directory, $2 the agent, $3 the mode
/// (`bare` or `unit`); the unit's masks and writable paths in $MASKS and $WRITABLE.
const NODE_SCRIPT: &str = r#"
set -eu
W=$1; BIN=$2; MODE=$3
mount --make-rprivate /
cp -a /etc "$W/etc" 2>/dev/null || true
rm -rf "$W/etc/kubernetes" "$W/etc/cron.d"
mkdir -p "$W/etc/kubernetes/pki" "$W/etc/kubernetes/manifests" "$W/etc/cron.d"
mount --bind "$W/etc" /etc
mount -t tmpfs tmpfs /var/lib
mount -t tmpfs tmpfs /run
# A kubeadm node: the cluster CA and its key, the admin kubeconfig, static pods, etcd's data,
# a pod's token; the kubelet's kubeconfig and rotating client certificate.
cp "$W/ca.crt" /etc/kubernetes/pki/ca.crt
echo "the cluster CA's key" >/etc/kubernetes/pki/ca.key
echo "admin credentials" >/etc/kubernetes/admin.conf
echo "admin credentials" >/etc/kubernetes/super-admin.conf
mkdir -p /var/lib/etcd/member/snap /var/lib/kubelet/pki /var/lib/kubelet-ca-agent \
  /var/lib/kubelet/pods/0b6e/volumes/kubernetes.io~projected/kube-api-access
echo "etcd's data" >/var/lib/etcd/member/snap/db
echo "a pod's token" >/var/lib/kubelet/pods/0b6e/volumes/kubernetes.io~projected/kube-api-access/token
cat "$W/node.crt" "$W/node.key" >/var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem
ln -s /var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem /var/lib/kubelet/pki/kubelet-client-current.pem
cp "$W/kubelet.conf" /etc/kubernetes/kubelet.conf
cp "$W/config.yaml" /var/lib/kubelet/config.yaml
# systemd's bus, and another local service.
mkdir -p /run/dbus
python3 -c 'import socket,time,sys; s=socket.socket(socket.AF_UNIX); s.bind("/run/dbus/system_bus_socket"); s.listen(8); open(sys.argv[1],"w").close(); time.sleep(300)' "$W/bus-up" &
python3 -c 'import socket,time,sys; s=socket.socket(); s.bind(("127.0.0.1",int(sys.argv[1]))); s.listen(8); open(sys.argv[2],"w").close(); time.sleep(300)' "$OTHER_PORT" "$W/other-up" &
for _ in $(seq 100); do [ -e "$W/bus-up" ] && [ -e "$W/other-up" ] && break; sleep 0.05; done
PREFIX=()
if [ "$MODE" = unit ]; then
  # As systemd applies the unit: its writable paths first (ReadWritePaths=), then the
  # rest read-only (ProtectSystem=strict), then its masks (InaccessiblePaths=: an empty
  # directory or file of mode 000, read-only), and the one capability it keeps.
  # (The test's own directory stays writable: its logs, not the agent's business.)
  mkdir -m 000 "$W/inaccessible-dir"; install -m 000 /dev/null "$W/inaccessible-reg"
  for p in $WRITABLE "$W"; do [ -e "$p" ] && mount --bind "$p" "$p"; done
  for m in / /etc /var/lib /run; do mount -o remount,bind,ro "$m"; done
  for p in $WRITABLE "$W"; do [ -e "$p" ] && mount -o remount,bind,rw "$p"; done
  for p in $MASKS; do
    if [ -d "$p" ]; then mount --bind "$W/inaccessible-dir" "$p"; mount -o remount,bind,ro "$p"
    elif [ -e "$p" ]; then mount --bind "$W/inaccessible-reg" "$p"; mount -o remount,bind,ro "$p"; fi
  done
  PREFIX=(setpriv --bounding-set=-all,+chown --inh-caps=-all)
fi
set +e
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LD_PRELOAD="$W/attack.so" \
  ATTACK_READ="/etc/kubernetes/kubelet-ca.crt:/etc/kubernetes/pki/ca.key:/etc/kubernetes/admin.conf:/etc/kubernetes/super-admin.conf:/var/lib/etcd/member/snap/db:/var/lib/kubelet/pods/0b6e/volumes/kubernetes.io~projected/kube-api-access/token" \
  ATTACK_CREATE="/etc/kubernetes/manifests/x.yaml:/etc/cron.d/x:/var/lib/kubelet-ca-agent/x" \
  ATTACK_CONNECT="$API_PORT:$ETCD_PORT:$OTHER_PORT" \
  ATTACK_UNIX=/run/dbus/system_bus_socket ATTACK_EXEC=/bin/sh \
  "${PREFIX[@]}" "$BIN" run --source "$SOURCE" --listen "127.0.0.1:$PORT" --insecure-metrics \
  >"$W/agent.out" 2>"$W/agent.err" &
agent=$!
for _ in $(seq 150); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/readyz")" = 200 ] && break
  sleep 0.1
done
curl -s "http://127.0.0.1:$PORT/readyz?verbose" >"$W/readyz"
kill -USR2 $agent
for _ in $(seq 100); do grep -q '^ATTACK end' "$W/agent.err" && break; sleep 0.05; done
touch "$W/attacked"
# The test rotates the source now and looks at the bundle and the report: wait for it.
for _ in $(seq 600); do [ -e "$W/done" ] && break; sleep 0.1; done
kill -TERM $agent; wait $agent
"#;

/// What the attacker got, each attempt's line (`read /path: allowed`).
fn attempts(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.strip_prefix("ATTACK "))
        .filter(|l| l.contains(": "))
        .map(str::to_string)
        .collect()
}

fn allowed(attempts: &[String], what: &str) -> bool {
    let line = attempts
        .iter()
        .find(|l| l.starts_with(&format!("{what}: ")))
        .unwrap_or_else(|| panic!("no attempt to {what}: {attempts:#?}"));
    line.ends_with(": allowed")
}

/// The unit's lines `NAME=` (each value's words, without systemd's `-` prefix).
fn unit_paths(unit: &str, name: &str) -> Vec<String> {
    unit.lines()
        .filter_map(|l| l.trim().strip_prefix(&format!("{name}=")))
        .flat_map(|v| v.split_whitespace())
        .map(|p| p.trim_start_matches('-').to_string())
        .collect()
}

struct Node {
    cluster: Cluster,
    work: tempfile::TempDir,
}

/// The cluster, a node identity for worker-1, its Node, and a readable source.
fn node() -> Option<Node> {
    if !require(is_root(), "a mount namespace needs root")
        || !require(
            Command::new("unshare").arg("--help").output().is_ok(),
            "unshare (util-linux) is not installed",
        )
        || !require(
            Command::new("gcc").arg("--version").output().is_ok(),
            "gcc is not installed (the attack is a preloaded C library)",
        )
    {
        return None;
    }
    let cluster = Cluster::up()?;
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let built = Command::new("gcc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(w.join("attack.so"))
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/attack/attack.c"))
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let (crt, key) = cluster.client_cert("system:node:worker-1", &["system:nodes"]);
    fs::copy(crt, w.join("node.crt")).unwrap();
    fs::copy(key, w.join("node.key")).unwrap();
    fs::copy(cluster.ca_path(), w.join("ca.crt")).unwrap();
    use base64::Engine;
    let ca_data = base64::engine::general_purpose::STANDARD.encode(cluster.ca_pem());
    fs::write(
        w.join("kubelet.conf"),
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: {ca_data}\n    server: {}\n  name: kubernetes\ncontexts:\n- context:\n    cluster: kubernetes\n    user: system:node:worker-1\n  name: system:node:worker-1@kubernetes\ncurrent-context: system:node:worker-1@kubernetes\nusers:\n- name: system:node:worker-1\n  user:\n    client-certificate: /var/lib/kubelet/pki/kubelet-client-current.pem\n    client-key: /var/lib/kubelet/pki/kubelet-client-current.pem\n",
            cluster.url
        ),
    )
    .unwrap();
    fs::write(
        w.join("config.yaml"),
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nauthentication:\n  x509:\n    clientCAFile: /etc/kubernetes/kubelet-ca.crt\n",
    )
    .unwrap();
    cluster.namespace("signers");
    cluster.put_configmap("signers", "client-ca", &[("ca-bundle.crt", &signer("one"))]);
    cluster.grant_configmaps(
        "signers",
        &["client-ca"],
        &["get", "list", "watch"],
        "system:node:worker-1",
    );
    cluster.create_node("worker-1", None);
    Some(Node { cluster, work })
}

fn signer(cn: &str) -> String {
    Signer::new(&format!("signer-{cn}"), Algorithm::P256).pem()
}

/// Runs the node in `mode`, attacks it, rotates its source, and returns the attempts, the
/// agent's log and `/readyz?verbose`.
fn attack(node: &Node, mode: &str) -> (Vec<String>, String, String) {
    // Each way in a directory of its own, with the node's files.
    let w = &node.work.path().join(mode);
    fs::create_dir(w).unwrap();
    for file in [
        "attack.so",
        "node.crt",
        "node.key",
        "ca.crt",
        "kubelet.conf",
        "config.yaml",
    ] {
        fs::copy(node.work.path().join(file), w.join(file)).unwrap();
    }
    let env = fs::read_to_string(node.cluster.path("env")).unwrap();
    let var = |name: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} in the cluster's env"))
            .trim_matches('"')
            .to_string()
    };
    let unit = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/kubelet-ca-agent.service"),
    )
    .unwrap();
    let masks = unit_paths(&unit, "InaccessiblePaths");
    assert!(
        masks.iter().any(|m| m == "/etc/kubernetes/pki"),
        "the unit hides /etc/kubernetes/pki: {masks:?}"
    );
    let mut writable = unit_paths(&unit, "ReadWritePaths");
    writable.push("/var/lib/kubelet-ca-agent".into()); // StateDirectory=
    let port = common::daemon::free_port();
    let mut script = Command::new("unshare")
        .args(["-m", "bash", "-c", NODE_SCRIPT, "node"])
        .arg(w)
        .arg(agent_bin())
        .arg(mode)
        .env("MASKS", masks.join(" "))
        .env("WRITABLE", writable.join(" "))
        .env("SOURCE", "configmap:signers/client-ca")
        .env("PORT", port.to_string())
        .env("API_PORT", var("API_PORT"))
        .env("ETCD_PORT", var("ETCD_PORT"))
        .env("OTHER_PORT", common::daemon::free_port().to_string())
        .stderr(fs::File::create(w.join("script.err")).unwrap())
        .spawn()
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || w.join("attacked").exists()),
        "the node never got to the attack: {}{}",
        fs::read_to_string(w.join("script.err")).unwrap_or_default(),
        fs::read_to_string(w.join("agent.err")).unwrap_or_default()
    );
    // The agent still does its job: a rotation lands, and its report is written.
    let two = signer("two");
    node.cluster
        .put_configmap("signers", "client-ca", &[("ca-bundle.crt", &two)]);
    let bundle = w.join("etc/kubernetes/kubelet-ca.crt");
    let landed = eventually(Duration::from_secs(10), || {
        fs::read_to_string(&bundle).is_ok_and(|b| b == two)
    });
    let reported = eventually(Duration::from_secs(10), || {
        node.cluster
            .node_annotation("worker-1", "kubelet-ca-agent/held")
            .is_some_and(|held| held.contains(&common::sha256_hex(&pem_der(&two))))
    });
    fs::write(w.join("done"), "").unwrap();
    let status = script.wait().unwrap();
    let log = fs::read_to_string(w.join("agent.err")).unwrap_or_default();
    assert!(status.success(), "the node script failed: {log}");
    assert!(
        landed,
        "{mode}: the rotation did not land in the bundle: {log}"
    );
    assert!(
        reported,
        "{mode}: the report does not name the new signer: {log}"
    );
    let readyz = fs::read_to_string(w.join("readyz")).unwrap_or_default();
    (attempts(&log), log, readyz)
}

fn pem_der(pem: &str) -> Vec<u8> {
    pem::parse(pem).unwrap().into_contents()
}

/// What both ways stop: everything but the agent's own files and its API server.
fn stopped_either_way(mode: &str, api_port: &str, got: &[String], log: &str) {
    assert!(
        allowed(got, "read /etc/kubernetes/kubelet-ca.crt"),
        "{mode}: the agent reads its own bundle: {log}"
    );
    assert!(
        allowed(got, &format!("connect {api_port}")),
        "{mode}: the agent reaches its API server: {got:#?}"
    );
    for denied in [
        "read /var/lib/etcd/member/snap/db",
        "read /var/lib/kubelet/pods/0b6e/volumes/kubernetes.io~projected/kube-api-access/token",
        "create /etc/cron.d/x",
        "unix /run/dbus/system_bus_socket",
        "exec /bin/sh",
    ] {
        assert!(
            !allowed(got, denied),
            "{mode}: a taken-over agent could {denied}: {got:#?}"
        );
    }
    let connects: Vec<&String> = got.iter().filter(|l| l.starts_with("connect ")).collect();
    assert_eq!(
        connects.iter().filter(|l| l.ends_with(": allowed")).count(),
        1,
        "{mode}: only the API server may be reached (etcd and the other port not): {connects:#?}"
    );
    assert!(
        allowed(got, "create /var/lib/kubelet-ca-agent/x"),
        "{mode}: the state directory stays writable: {got:#?}"
    );
}

#[test]
fn a_taken_over_agent_reaches_nothing_but_its_job_bare_and_under_the_unit() {
    let Some(node) = node() else {
        return;
    };
    let env = fs::read_to_string(node.cluster.path("env")).unwrap();
    let api = env
        .lines()
        .find_map(|l| l.strip_prefix("API_PORT="))
        .unwrap()
        .trim_matches('"')
        .to_string();

    // Bare: Landlock and seccomp alone. What the agent's own directory holds stays
    // reachable (Landlock cannot hide pki/ inside the /etc/kubernetes it writes in).
    let (got, log, readyz) = attack(&node, "bare");
    stopped_either_way("bare", &api, &got, &log);
    assert!(
        readyz.contains("[+]confinement ok: Landlock ABI")
            || readyz.contains("[+]confinement ok, with a warning"),
        "{readyz}"
    );
    assert!(log.contains("confined"), "the start says what holds: {log}");
    for within in [
        "read /etc/kubernetes/pki/ca.key",
        "create /etc/kubernetes/manifests/x.yaml",
    ] {
        assert!(
            allowed(&got, within),
            "bare: {within} is inside the bundle's directory, which only the masks hide: {got:#?}"
        );
    }

    // Under the unit: its masks hide the control plane's secrets and static pods too.
    // The rotation back to one signer first, so that the next rotation is a change.
    node.cluster.put_configmap(
        "signers",
        "client-ca",
        &[("ca-bundle.crt", &signer("three"))],
    );
    let (got, log, _) = attack(&node, "unit");
    stopped_either_way("unit", &api, &got, &log);
    for denied in [
        "read /etc/kubernetes/pki/ca.key",
        "read /etc/kubernetes/admin.conf",
        "read /etc/kubernetes/super-admin.conf",
        "create /etc/kubernetes/manifests/x.yaml",
    ] {
        assert!(
            !allowed(&got, denied),
            "unit: a taken-over agent could {denied}: {got:#?}"
        );
    }
}
