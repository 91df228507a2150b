//! Issue 37: the agent attacked from inside. A library preloaded into the agent
//! (tests/attack/attack.c) runs, in one of the agent's own threads after start-up, what an
//! attacker who took the agent over would try: read the cluster CA's key, an admin
//! kubeconfig, etcd's data, a pod's token and the kubelet's key; create a static pod
//! manifest and a cron file; connect to etcd, to another local port and to a socket at
//! systemd's bus path; run a shell.
//!
//! A kubeadm node is laid out at its real paths in a mount namespace of the test's own
//! (`unshare -m`), against the real API server of `../shared/tools/kube-apiserver/cluster`
//! (whose etcd is the one attacked). Each way also shows that the agent still does its job:
//! a rotation lands in the bundle, and the node's report is written on worker-1.
//! - bare: Landlock and seccomp alone, run as the unit runs it (the kubelet's kubeconfig, a
//!   cluster source, its report);
//! - under the unit: its `InaccessiblePaths=`, `ProtectSystem=strict` with its
//!   `ReadWritePaths=`, and its one capability, applied as systemd would;
//! - in the DaemonSet's pod: a root of its own with the volumes of the DaemonSet that
//!   `kubectl kustomize deploy/overlays/kubeadm` renders and nothing else of the node, its
//!   environment, its one capability, and in-cluster credentials: the token of its own
//!   service account, bound to its Pod on worker-1, under the overlay's RBAC and policies as
//!   rendered; never the kubelet's key.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::daemon::eventually;
use common::pki::{Algorithm, Signer};
use common::real_cluster::{Cluster, object, render};
use common::{agent_bin, is_root, require};
use serde_json::{Value, json};

/// Runs inside the mount namespace: $1 the work directory, $2 the agent, $3 the way (`bare`,
/// `unit` or `daemonset`); the unit's masks and writable paths in $MASKS and $WRITABLE; the
/// pod's volumes, environment and arguments in $VOLUMES, $POD_ENV and $POD_ARGS (one a line).
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
# a pod's token; the kubelet's kubeconfig and rotating client certificate; the directory of
# the host's kubelet restart requests.
cp "$W/ca.crt" /etc/kubernetes/pki/ca.crt
echo "the cluster CA's key" >/etc/kubernetes/pki/ca.key
echo "admin credentials" >/etc/kubernetes/admin.conf
echo "admin credentials" >/etc/kubernetes/super-admin.conf
mkdir -p /var/lib/etcd/member/snap /var/lib/kubelet/pki /var/lib/kubelet-ca-agent \
  /var/lib/kubelet/pods/0b6e/volumes/kubernetes.io~projected/kube-api-access \
  /run/kubelet-ca-agent/kubelet-restart
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
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
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
if [ "$MODE" = daemonset ]; then
  # A worker: the DaemonSet's node affinity keeps it off the control plane, the one place
  # with admin kubeconfigs (the test checks the rendered affinity); the pod masks pki/ and
  # manifests/ alone, and would read them where they are (docs/security.md).
  rm -f /etc/kubernetes/admin.conf /etc/kubernetes/super-admin.conf
  # The pod's root, as a container runtime builds it: an empty file system, read-only at the
  # end (readOnlyRootFilesystem), with the pod's volumes mounted into it.
  R=$W/root
  mkdir "$R"; mount -t tmpfs -o mode=0755,size=1m tmpfs "$R"
  # bind SOURCE TARGET rw|ro: SOURCE of the node at TARGET in the pod.
  bind() {
    if [ -d "$1" ]; then mkdir -p "$R$2"
    else mkdir -p "$(dirname "$R$2")"; [ -e "$R$2" ] || : >"$R$2"; fi
    mount --bind "$1" "$R$2"
    if [ "$3" = ro ]; then mount -o remount,bind,ro "$R$2"; fi
  }
  # The DaemonSet's volumes, parents before what they hold (as the runtime orders them): a
  # hostPath is the node's directory (made first when DirectoryOrCreate); an emptyDir of
  # medium Memory an empty tmpfs.
  while read -r kind path target type access; do
    case $kind in
      "") ;;
      hostPath)
        if [ "$type" = DirectoryOrCreate ]; then mkdir -p "$path"; fi
        bind "$path" "$target" "$access";;
      emptyDir)
        mkdir -p "$R$target"
        mount -t tmpfs -o size=1k,mode=0755 tmpfs "$R$target"
        if [ "$access" = ro ]; then mount -o remount,ro "$R$target"; fi;;
      *) echo "a volume this test does not emulate: $kind" >&2; exit 1;;
    esac
  done <<<"$VOLUMES"
  # What the kubelet and the runtime add to every pod: the service account's token, CA and
  # namespace (read-only), /proc, and the usual devices.
  bind "$W/serviceaccount" /var/run/secrets/kubernetes.io/serviceaccount ro
  mkdir "$R/proc"; mount -t proc proc "$R/proc"
  mkdir "$R/dev"; mount -t tmpfs -o mode=0755,size=64k tmpfs "$R/dev"
  for d in null zero full random urandom; do bind "/dev/$d" "/dev/$d" rw; done
  # The image: the agent (and the library the test preloads into it). The image's agent is
  # a static binary FROM scratch; the test's is linked dynamically, so the host's loader
  # and libraries come too, read-only: /usr, and /lib and /lib64 (symbolic links into /usr
  # where the host has them so). With them comes a shell, /bin/sh (bin -> usr/bin, or /bin
  # itself where it is a directory), so that `exec /bin/sh` finds a program to refuse.
  bind "$BIN" /kubelet-ca-agent ro
  bind "$W/attack.so" /attack.so ro
  for d in usr lib lib64 bin; do
    if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$R/$d"
    elif [ -d "/$d" ]; then bind "/$d" "/$d" ro; fi
  done
  mount -o remount,ro "$R"
  mapfile -t CONTAINER_ENV <<<"$POD_ENV"
  mapfile -t CONTAINER_ARGS <<<"$POD_ARGS"
fi
ATTACKS=(
  ATTACK_READ="/etc/kubernetes/kubelet-ca.crt:/etc/kubernetes/pki/ca.key:/etc/kubernetes/admin.conf:/etc/kubernetes/super-admin.conf:/var/lib/etcd/member/snap/db:/var/lib/kubelet/pods/0b6e/volumes/kubernetes.io~projected/kube-api-access/token:/var/lib/kubelet/pki/kubelet-client-current.pem"
  ATTACK_CREATE="/etc/kubernetes/manifests/x.yaml:/etc/cron.d/x:/var/lib/kubelet-ca-agent/x"
  ATTACK_CONNECT="$API_PORT:$ETCD_PORT:$OTHER_PORT"
  ATTACK_UNIX=/run/dbus/system_bus_socket ATTACK_EXEC=/bin/sh
)
set +e
if [ "$MODE" = daemonset ]; then
  # Into the pod's root, with the container's environment; then its securityContext: root
  # with CHOWN alone, no privilege escalation. (The runtime's default seccomp profile is
  # not applied: the agent's own filter is.)
  chroot "$R" /usr/bin/env -i "${CONTAINER_ENV[@]}" LD_PRELOAD=/attack.so "${ATTACKS[@]}" \
    /usr/bin/setpriv --bounding-set=-all,+chown --inh-caps=-all --no-new-privs \
    /kubelet-ca-agent "${CONTAINER_ARGS[@]}" >"$W/agent.out" 2>"$W/agent.err" &
else
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LD_PRELOAD="$W/attack.so" "${ATTACKS[@]}" \
    "${PREFIX[@]}" "$BIN" run --source "$SOURCE" --listen "127.0.0.1:$PORT" --insecure-metrics \
    >"$W/agent.out" 2>"$W/agent.err" &
fi
agent=$!
for _ in $(seq 150); do
  [ "$(curl -sk -o /dev/null -w '%{http_code}' "$URL/readyz")" = 200 ] && break
  sleep 0.1
done
curl -sk "$URL/readyz?verbose" >"$W/readyz"
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
    cluster.kubeadm_node_files(w, "worker-1");
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

/// The DaemonSet's pod on worker-1: its container and volumes as
/// `kubectl kustomize deploy/overlays/kubeadm` renders them, and the token of its service
/// account that the kubelet would project into it.
struct Pod {
    container: Value,
    volumes: Vec<Value>,
    token: String,
    namespace: String,
}

/// The kubeadm overlay's identity applied to the cluster as rendered (namespace, service
/// account, RBAC, the policies), the DaemonSet's Pod on worker-1, a token bound to it, and
/// the reads its configuration needs.
fn pod(node: &Node, rendered: &[Value]) -> Pod {
    let cluster = &node.cluster;
    let daemonset = object(rendered, "DaemonSet", "kubelet-ca-agent");
    let spec = &daemonset["spec"]["template"]["spec"];
    // Never a control-plane node, the one place with admin kubeconfigs: so the node laid
    // out for the pod is a worker, without them.
    let terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .expect("the DaemonSet's required node affinity");
    for role in [
        "node-role.kubernetes.io/control-plane",
        "node-role.kubernetes.io/master",
    ] {
        assert!(
            terms
                .iter()
                .all(|t| t["matchExpressions"].as_array().is_some_and(|e| e
                    .iter()
                    .any(|e| e["key"] == role && e["operator"] == "DoesNotExist"))),
            "the DaemonSet keeps off nodes labelled {role}: {terms:?}"
        );
    }
    let namespace = daemonset["metadata"]["namespace"].as_str().unwrap();
    let account = spec["serviceAccountName"].as_str().unwrap();
    cluster.apply_identity(rendered);
    let uid = cluster.daemonset_pod(daemonset, "kubelet-ca-agent-worker-1", "worker-1");
    let token = cluster.service_account_token(
        namespace,
        account,
        Some(("kubelet-ca-agent-worker-1", &uid)),
    );
    // The report then goes through the overlay's policies: they take a moment to load, and
    // until then RBAC alone would let the token write another Node's report. Ask until the
    // policy refuses that (bounded).
    cluster.create_node("worker-2", None);
    let probe = json!({"metadata": {"annotations": {"kubelet-ca-agent/held": "probe"}}});
    assert!(
        eventually(Duration::from_secs(30), || {
            let (code, _) =
                cluster.request_with_token(&token, "PATCH", "/api/v1/nodes/worker-2", Some(&probe));
            code == 403
        }),
        "the overlay's ValidatingAdmissionPolicy for the node report never took effect"
    );
    // The source: the test's own ConfigMap instead of the overlay's
    // kube-system/extension-apiserver-authentication (client-ca-file), which the API server
    // writes itself (a post-start hook) and the test could not rotate; the pod's service
    // account may read it as the overlay's Role lets it read its own source, by name.
    cluster.grant_configmaps(
        "signers",
        &["client-ca"],
        &["get", "list", "watch"],
        &format!("system:serviceaccount:{namespace}:{account}"),
    );
    // The overlay also keeps the API server's CA in kubelet.conf from kube-public/cluster-info,
    // which kubeadm publishes (a bare API server has none): the cluster's CA, as kubelet.conf
    // already holds it.
    use base64::Engine;
    let ca_data = base64::engine::general_purpose::STANDARD.encode(cluster.ca_pem());
    cluster.put_configmap(
        "kube-public",
        "cluster-info",
        &[(
            "kubeconfig",
            &format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: {ca_data}\n    server: {}\n  name: \"\"\ncontexts: null\ncurrent-context: \"\"\nusers: null\n",
                cluster.url
            ),
        )],
    );
    Pod {
        container: spec["containers"][0].clone(),
        volumes: spec["volumes"].as_array().unwrap().clone(),
        token,
        namespace: namespace.to_string(),
    }
}

impl Pod {
    /// The container's volume mounts, one a line for the script (`hostPath PATH TARGET TYPE
    /// rw|ro`, `emptyDir - TARGET - rw|ro`), parents first as a runtime mounts them.
    fn mounts(&self) -> String {
        let mut mounts: Vec<(usize, String)> = self.container["volumeMounts"]
            .as_array()
            .expect("the container's volumeMounts")
            .iter()
            .map(|m| {
                let name = &m["name"];
                let target = m["mountPath"].as_str().unwrap();
                let access = if m["readOnly"] == true { "ro" } else { "rw" };
                let volume = self
                    .volumes
                    .iter()
                    .find(|v| v["name"] == *name)
                    .unwrap_or_else(|| panic!("no volume {name}"));
                let line = if let Some(host) = volume.get("hostPath") {
                    let kind = host["type"].as_str().unwrap_or("-");
                    format!(
                        "hostPath {} {target} {kind} {access}",
                        host["path"].as_str().unwrap()
                    )
                } else if volume["emptyDir"]["medium"] == "Memory" {
                    format!("emptyDir - {target} - {access}")
                } else {
                    panic!("a volume this test does not emulate: {volume}")
                };
                (target.split('/').filter(|c| !c.is_empty()).count(), line)
            })
            .collect();
        mounts.sort_by_key(|(depth, _)| *depth);
        mounts
            .into_iter()
            .map(|(_, l)| l)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The container's environment as the kubelet makes it, one `NAME=VALUE` a line: the
    /// downward API's stand-ins (the node worker-1, its address 127.0.0.1), `$(NAME)`
    /// expanded, the API server in KUBERNETES_SERVICE_HOST and _PORT; with the listen port
    /// `port` (other agents run on this machine) and the test's source.
    fn env(&self, api_port: &str, port: u16) -> String {
        let mut env: Vec<(String, String)> = vec![
            (
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ),
            ("KUBERNETES_SERVICE_HOST".into(), "127.0.0.1".into()),
            ("KUBERNETES_SERVICE_PORT".into(), api_port.into()),
        ];
        for e in self.container["env"]
            .as_array()
            .expect("the container's env")
        {
            let name = e["name"].as_str().unwrap().to_string();
            let value = if let Some(value) = e["value"].as_str() {
                let mut value = value.to_string();
                for (n, v) in &env {
                    value = value.replace(&format!("$({n})"), v);
                }
                value
            } else {
                match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                    Some("spec.nodeName") => "worker-1".into(),
                    Some("status.hostIP") => "127.0.0.1".into(),
                    _ => panic!("an environment variable this test does not emulate: {e}"),
                }
            };
            let value = match name.as_str() {
                "KUBELET_CA_AGENT_LISTEN" => {
                    let (address, rendered) = value.rsplit_once(':').unwrap();
                    assert_eq!((address, rendered), ("[127.0.0.1]", "9745"), "{value}");
                    format!("{address}:{port}")
                }
                "KUBELET_CA_AGENT_SOURCE" => {
                    assert_eq!(
                        value,
                        "configmap:kube-system/extension-apiserver-authentication/client-ca-file"
                    );
                    "configmap:signers/client-ca".into()
                }
                _ => value,
            };
            assert!(!value.contains("$("), "{name}={value}");
            env.push((name, value));
        }
        env.iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Runs the node in `mode` (as the DaemonSet's `pod` when given), attacks it, rotates its
/// source, and returns the attempts, the agent's log and `/readyz?verbose`.
fn attack(node: &Node, mode: &str, pod: Option<&Pod>) -> (Vec<String>, String, String) {
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
    let mut script = Command::new("unshare");
    script
        .args(["-m", "bash", "-c", NODE_SCRIPT, "node"])
        .arg(w)
        .arg(agent_bin())
        .arg(mode)
        .env("MASKS", masks.join(" "))
        .env("WRITABLE", writable.join(" "))
        .env("SOURCE", "configmap:signers/client-ca")
        .env("PORT", port.to_string())
        .env("URL", format!("http://127.0.0.1:{port}"))
        .env("API_PORT", var("API_PORT"))
        .env("ETCD_PORT", var("ETCD_PORT"))
        .env("OTHER_PORT", common::daemon::free_port().to_string())
        .stderr(fs::File::create(w.join("script.err")).unwrap());
    if let Some(pod) = pod {
        // The service account's files as the kubelet projects them.
        let account = w.join("serviceaccount");
        fs::create_dir(&account).unwrap();
        fs::write(account.join("token"), &pod.token).unwrap();
        fs::write(account.join("ca.crt"), node.cluster.ca_pem()).unwrap();
        fs::write(account.join("namespace"), &pod.namespace).unwrap();
        let args: Vec<&str> = pod.container["args"]
            .as_array()
            .expect("the container's args")
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        // The container's client CA makes the endpoint TLS (its certificate self-signed).
        script
            .env("VOLUMES", pod.mounts())
            .env("POD_ENV", pod.env(&var("API_PORT"), port))
            .env("POD_ARGS", args.join("\n"))
            .env("URL", format!("https://127.0.0.1:{port}"));
    }
    let mut script = script.spawn().unwrap();
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
    assert!(
        status.success(),
        "{mode}: the node script failed: {}{log}",
        fs::read_to_string(w.join("script.err")).unwrap_or_default()
    );
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

/// What every way stops: everything but the agent's own files and its API server.
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

/// Why `what` was refused (`denied (REASON)`), or `allowed`.
fn outcome<'a>(attempts: &'a [String], what: &str) -> &'a str {
    attempts
        .iter()
        .find_map(|l| l.strip_prefix(&format!("{what}: ")))
        .unwrap_or_else(|| panic!("no attempt to {what}: {attempts:#?}"))
}

/// The unit's and the pod's masks: what only they hide.
fn masked(mode: &str, got: &[String]) {
    for denied in [
        "read /etc/kubernetes/pki/ca.key",
        "read /etc/kubernetes/admin.conf",
        "read /etc/kubernetes/super-admin.conf",
        "create /etc/kubernetes/manifests/x.yaml",
    ] {
        assert!(
            !allowed(got, denied),
            "{mode}: a taken-over agent could {denied}: {got:#?}"
        );
    }
}

#[test]
fn a_taken_over_agent_reaches_nothing_but_its_job_bare_under_the_unit_and_in_the_pod() {
    let Some(node) = node() else {
        return;
    };
    let Some(rendered) = render("deploy/overlays/kubeadm") else {
        return;
    };
    let env = fs::read_to_string(node.cluster.path("env")).unwrap();
    let api = env
        .lines()
        .find_map(|l| l.strip_prefix("API_PORT="))
        .unwrap()
        .trim_matches('"')
        .to_string();
    let mut table: Vec<(&str, Vec<String>)> = Vec::new();

    // Bare: Landlock and seccomp alone. What the agent's own directory holds stays
    // reachable (Landlock cannot hide pki/ inside the /etc/kubernetes it writes in).
    let (got, log, readyz) = attack(&node, "bare", None);
    stopped_either_way("bare", &api, &got, &log);
    // What holds is said as the kernel offers it: its Landlock ABI, asked of it here.
    // SAFETY: landlock_create_ruleset with LANDLOCK_CREATE_RULESET_VERSION only reads the ABI.
    let abi = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32,
        )
    };
    if abi >= 6 {
        assert!(
            readyz.contains(&format!(
                "[+]confinement ok: Landlock ABI {abi} (files, TCP ports"
            )),
            "{readyz}"
        );
    } else {
        assert!(
            readyz.contains("[+]confinement ok, with a warning"),
            "{readyz}"
        );
    }
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
    table.push(("bare", got));

    // Under the unit: its masks hide the control plane's secrets and static pods too.
    // The rotation back to one signer first, so that the next rotation is a change.
    node.cluster.put_configmap(
        "signers",
        "client-ca",
        &[("ca-bundle.crt", &signer("three"))],
    );
    let (got, log, _) = attack(&node, "unit", None);
    stopped_either_way("unit", &api, &got, &log);
    masked("unit", &got);
    table.push(("unit", got));

    // In the DaemonSet's pod: its volumes, and no more, in a root of its own; its
    // environment, its capability, and its own service account's token.
    node.cluster.put_configmap(
        "signers",
        "client-ca",
        &[("ca-bundle.crt", &signer("four"))],
    );
    let pod = pod(&node, &rendered);
    let (got, log, readyz) = attack(&node, "daemonset", Some(&pod));
    stopped_either_way("daemonset", &api, &got, &log);
    masked("daemonset", &got);
    assert!(readyz.contains("[+]confinement ok"), "daemonset: {readyz}");
    // Not the kubelet's key: its report went through the pod's token.
    assert!(
        !allowed(&got, "read /var/lib/kubelet/pki/kubelet-client-current.pem"),
        "daemonset: the pod reads the kubelet's key: {got:#?}"
    );
    let chosen = log
        .lines()
        .find(|l| l.contains("credentials for the API server chosen"))
        .unwrap_or_else(|| panic!("daemonset: no choice of credentials logged: {log}"));
    assert!(
        chosen.contains("the pod's service account"),
        "daemonset: {chosen}"
    );
    assert!(!log.contains("forbidden"), "daemonset: {log}");
    // The pod holds a shell (its root has the host's /usr): Landlock refuses it, it is not
    // merely missing.
    let shell = outcome(&got, "exec /bin/sh");
    assert!(
        !shell.contains("No such file"),
        "daemonset: /bin/sh is in the pod's root, and refused: {shell}"
    );
    table.push(("daemonset", got));

    // What each way let through, for the record (with --nocapture).
    eprintln!("{}", record(&table, &api, &node.cluster));
}

/// The attempts of each way side by side, one a row, the ports named.
fn record(table: &[(&str, Vec<String>)], api: &str, cluster: &Cluster) -> String {
    let env = fs::read_to_string(cluster.path("env")).unwrap();
    let etcd = env
        .lines()
        .find_map(|l| l.strip_prefix("ETCD_PORT="))
        .unwrap()
        .trim_matches('"')
        .to_string();
    // `connect PORT` by what listens there (the other port is each way's own).
    let named = |what: &str| match what.strip_prefix("connect ") {
        Some(port) if port == api => "connect the API server".to_string(),
        Some(port) if port == etcd => "connect etcd".to_string(),
        Some(_) => "connect another local port".to_string(),
        None => what.to_string(),
    };
    let ways: Vec<&str> = table.iter().map(|(way, _)| *way).collect();
    let mut text = format!("| attempt | {} |\n", ways.join(" | "));
    for line in &table[0].1 {
        let what = named(line.split_once(": ").map_or(line.as_str(), |(w, _)| w));
        let row: Vec<&str> = table
            .iter()
            .map(|(_, got)| {
                got.iter()
                    .filter_map(|l| l.split_once(": "))
                    .find(|(w, _)| named(w) == what)
                    .map_or("-", |(_, outcome)| outcome)
            })
            .collect();
        text.push_str(&format!("| {what} | {} |\n", row.join(" | ")));
    }
    text
}
