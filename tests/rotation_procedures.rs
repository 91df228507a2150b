//! The rotation procedures of docs/operations.md ("Rotating a signer (OpenShift)" and
//! "Rotating the API server's serving CA (kubeadm)"), each run end to end, step by step as
//! the docs give them, against the real API server of
//! `../shared/tools/kube-apiserver/cluster` (Node authorizer, RBAC, NodeRestriction), with
//! real node agents (`kubelet-ca-agent run`, each with its own node credentials
//! `system:node:NAME` signed by the cluster CA) and the real `rollout status` and `rollout
//! wait`:
//!
//! - an OpenShift signer rotation: the new signer published next to the old one in
//!   `openshift-config-managed/kube-apiserver-client-ca`, `rollout wait --for add=` holding
//!   while one node's agent is paused and exiting 0 once it catches up, then a client
//!   certificate of the new signer verified by openssl against every node's bundle, then
//!   the old signer withdrawn (a paused node named by `rollout status` as still holding it,
//!   by its CN) and `rollout wait --for remove=` with the fingerprint kept in step 1;
//! - a kubeadm serving-CA rotation: the new CA added to `kube-public/cluster-info`, `rollout
//!   wait --for add= --target /…/kubelet.conf` holding while one node's kubelet restart
//!   fails and exiting 0 once every kubeconfig holds it and its kubelet restarted, the API
//!   server switched to a serving certificate of the new CA (the agents, whose own
//!   credentials are that kubeconfig, keep reading through it), the old CA withdrawn and
//!   `rollout wait --for remove=`.
//!
//! The docs write the cluster's side with kubectl; here the same requests go through curl
//! as admin ([`Cluster::request`]), one for each kubectl command.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use common::daemon::{Agent, check_line, eventually};
use common::pki::{Algorithm, Signer};
use common::real_cluster::{Cluster, RolloutWait, rollout, rollout_wait as wait};
use common::{Node, agent_bin, openssl_verifies, sha256_hex, stderr, stdout};
use serde_json::{Value, json};

const SECOND: Duration = Duration::from_secs(1);

/// `kubectl -n NS create role ROLE --verb=get,list,watch --resource=configmaps
/// --resource-name=NAME` (when `name` is given) and `kubectl -n NS create rolebinding
/// BINDING --role=ROLE --group=system:nodes`, as the docs grant a source to the nodes.
fn grant_to_nodes(cluster: &Cluster, ns: &str, role: &str, name: Option<&str>, binding: &str) {
    cluster.namespace(ns);
    let base = format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}");
    if let Some(name) = name {
        let body = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": role, "namespace": ns},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                       "resourceNames": [name], "verbs": ["get", "list", "watch"]}],
        });
        let (code, answer) = cluster.request("POST", &format!("{base}/roles"), Some(&body));
        assert!(code == 201 || code == 409, "create role: {code} {answer}");
    }
    let body = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": binding, "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
    });
    let (code, answer) = cluster.request("POST", &format!("{base}/rolebindings"), Some(&body));
    assert!(
        code == 201 || code == 409,
        "create rolebinding: {code} {answer}"
    );
}

fn signal(agent: &Agent, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(agent.child.id() as i32), signal)
        .expect("signal the agent");
}

fn b64(bytes: impl AsRef<[u8]>) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The SHA-256 of a PEM certificate's DER: its fingerprint, as reports and `inspect` give it.
fn fingerprint(pem: &str) -> String {
    sha256_hex(pem::parse(pem).expect("a PEM certificate").contents())
}

/// The docs' `kubelet-ca-agent inspect FILE --output json | jq -r '[.certificates[] |
/// select(.subject_cn | startswith("kube-csr-signer_@"))] | max_by(.not_before) | .sha256'`:
/// the fingerprint of the newest CSR signer in `pem`.
fn newest_csr_signer(pem: &Path) -> String {
    let out = Command::new(agent_bin())
        .args(["inspect", path_str(pem), "--output", "json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    listed["certificates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            c["subject_cn"]
                .as_str()
                .unwrap()
                .starts_with("kube-csr-signer_@")
        })
        .max_by_key(|c| c["not_before"].as_str().unwrap().to_string())
        .unwrap()["sha256"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The `oc get configmap ... -o jsonpath='{.data.ca-bundle\.crt}' > FILE` of the docs.
fn signers_to(cluster: &Cluster, file: &Path) {
    let (code, cm) = cluster.request(
        "GET",
        &format!("/api/v1/namespaces/{SIGNERS_NS}/configmaps/{SIGNERS}"),
        None,
    );
    assert_eq!(code, 200, "{cm}");
    write(file, cm["data"]["ca-bundle.crt"].as_str().unwrap());
}

fn write(path: &Path, content: impl AsRef<[u8]>) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, content).unwrap();
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

// ---------------------------------------------------------------------------------------
// Rotating a signer (OpenShift)
// ---------------------------------------------------------------------------------------

const SIGNERS_NS: &str = "openshift-config-managed";
const SIGNERS: &str = "kube-apiserver-client-ca";

#[test]
fn an_openshift_signer_rotation_lets_the_new_signer_issue_only_once_every_node_holds_it() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let started = Instant::now();
    let admin = cluster.admin_kubeconfig();
    // The signers' ConfigMap as the platform keeps it: a signer that does not rotate here,
    // and the CSR signer about to rotate. Both older than the new one.
    let other = Signer::valid_between(
        "kube-apiserver-to-kubelet-signer",
        Algorithm::P256,
        time::Duration::days(-30),
        time::Duration::days(335),
    );
    let old = Signer::valid_between(
        "kube-csr-signer_@1700000000",
        Algorithm::P256,
        time::Duration::days(-20),
        time::Duration::days(10),
    );
    let new = Signer::valid_between(
        "kube-csr-signer_@1701728000",
        Algorithm::P256,
        time::Duration::minutes(-5),
        time::Duration::days(30),
    );
    cluster.put_configmap(
        SIGNERS_NS,
        SIGNERS,
        &[("ca-bundle.crt", &format!("{}{}", other.pem(), old.pem()))],
    );
    // "RBAC for the unit": the nodes read that ConfigMap, by name.
    grant_to_nodes(
        &cluster,
        SIGNERS_NS,
        "kubelet-ca-agent-source",
        Some(SIGNERS),
        "kubelet-ca-agent-source",
    );

    // Three nodes, each with its agent on the default source and the node's own
    // credentials (the kubelet's kubeconfig, as the unit has it).
    let names = ["worker-1", "worker-2", "worker-3"];
    let mut nodes = Vec::new();
    for name in names {
        cluster.create_node(name, None);
        let node = Node::new();
        let kubeconfig = cluster.node_kubeconfig(name);
        let agent = Agent::start(&node, &[], &["--kubeconfig", path_str(&kubeconfig)]);
        nodes.push((name, node, agent));
    }
    for (_, _, agent) in &nodes {
        agent.wait_listening();
    }

    // Before: every node holds what the sources make.
    let (code, text) = wait(
        &admin,
        &["--for", "sources", "--timeout", "60s"],
        70 * SECOND,
    );
    assert_eq!(code, Some(0), "{text}\n{}", nodes[0].2.log());
    let out = rollout(&admin, &["status"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(
        stdout(&out).starts_with("3 of 3 nodes hold what the sources make (2 certificates)"),
        "{}",
        stdout(&out)
    );
    // ... and the fingerprint of the signer that issues now, kept for the last step.
    let signers_before = cluster.path("signers-before.pem");
    signers_to(&cluster, &signers_before);
    let old_signer_sha256 = cluster.path("old-signer.sha256");
    write(&old_signer_sha256, newest_csr_signer(&signers_before));
    assert_eq!(
        fs::read_to_string(&old_signer_sha256).unwrap(),
        fingerprint(&old.pem())
    );
    // Each node's report names what it holds.
    let report: Value = serde_json::from_str(
        &cluster
            .node_annotation("worker-1", "kubelet-ca-agent/held")
            .expect("worker-1's report"),
    )
    .unwrap();
    assert_eq!(
        report["names"][fingerprint(&old.pem())],
        "kube-csr-signer_@1700000000",
        "{report}"
    );

    // A node whose agent does not follow (a paused pool, an agent stuck): worker-3's is
    // stopped before the rotation.
    let (_, node3, agent3) = &nodes[2];
    signal(agent3, nix::sys::signal::Signal::SIGSTOP);

    // 1. The new signer is published next to the old one.
    let published = format!("{}{}{}", other.pem(), old.pem(), new.pem());
    cluster.put_configmap(SIGNERS_NS, SIGNERS, &[("ca-bundle.crt", &published)]);
    let new_signer = cluster.path("new-signer.crt");
    write(&new_signer, new.pem());

    // Its fingerprint, as the docs find it when the platform rotated it: the newest
    // kube-csr-signer_@ of `inspect --output json` on the ConfigMap's bundle, kept in
    // new-signer.sha256.
    let signers_pem = cluster.path("signers.pem");
    signers_to(&cluster, &signers_pem);
    let new_signer_sha256 = cluster.path("new-signer.sha256");
    write(&new_signer_sha256, newest_csr_signer(&signers_pem));
    let new_sha = fs::read_to_string(&new_signer_sha256).unwrap();
    assert_eq!(new_sha, fingerprint(&new.pem()));

    // The nodes that follow hold it within a second or so; the paused one does not.
    for (name, node, agent) in &nodes[..2] {
        assert!(
            eventually(10 * SECOND, || node.holds(&published)),
            "{name} did not follow\n{}",
            agent.log()
        );
    }
    // What the new signer would issue now: refused by the kubelet of worker-3.
    let (client, _key) =
        new.issue_client("system:serviceaccount:openshift-monitoring:prometheus-k8s");
    assert!(openssl_verifies(&nodes[0].1.bundle(), &client));
    assert!(!openssl_verifies(&node3.bundle(), &client));

    // 2. The gate holds: `rollout wait --for add=` times out (exit 1) naming worker-3; with
    // the fingerprint as `rollout status` prints it.
    let out = rollout(&admin, &["status"]);
    let printed = format!("sha256:{}...", &new_sha[..12]);
    assert!(
        stdout(&out).contains(&format!("kube-csr-signer_@1701728000 ({printed})")),
        "{}",
        stdout(&out)
    );
    let (code, text) = wait(
        &admin,
        &["--for", &format!("add={printed}"), "--timeout", "5s"],
        30 * SECOND,
    );
    eprintln!("the gate, worker-3's agent paused:\n{text}");
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("timed out after 5s: 2 of 3 nodes hold kube-csr-signer_@1701728000"),
        "{text}"
    );
    let laggard = text
        .lines()
        .find(|l| l.starts_with("worker-3 "))
        .unwrap_or_else(|| panic!("worker-3 is not named: {text}"));
    assert!(
        laggard.contains(" behind ") && laggard.contains("lacks kube-csr-signer_@1701728000"),
        "{text}"
    );
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("worker-1 ") || l.starts_with("worker-2 "))
    );
    // `rollout status` names it the same way.
    let out = rollout(&admin, &["status"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stdout(&out).starts_with("2 of 3 nodes hold what the sources make"));
    assert!(stdout(&out).lines().any(|l| l.starts_with("worker-3 ")));

    // The wait as the docs give it (`--for add="$(cat new-signer.sha256)"`): it holds while
    // worker-3 lags, and exits 0 the moment worker-3's agent is back and has written its
    // bundle and its report.
    let mut gate = RolloutWait::start(
        &admin,
        &["--for", &format!("add={new_sha}"), "--timeout", "60s"],
    );
    std::thread::sleep(2 * SECOND);
    assert!(gate.running(), "the gate opened with worker-3 behind");
    signal(agent3, nix::sys::signal::Signal::SIGCONT);
    let (code, text) = gate.exit(30 * SECOND);
    assert_eq!(code, Some(0), "{text}\n{}", agent3.log());
    assert!(
        text.lines()
            .last()
            .unwrap()
            .starts_with("3 of 3 nodes hold kube-csr-signer_@1701728000"),
        "{text}"
    );

    // 3. Then it issues: a client certificate of the new signer is trusted on every node.
    for (name, node, _) in &nodes {
        assert!(node.holds(&published), "{name}");
        assert!(
            openssl_verifies(&node.bundle(), &client),
            "{name} refuses the new signer's client certificate"
        );
    }

    // The wait by file, as the docs offer it when the signer's certificate is at hand.
    let (code, text) = wait(
        &admin,
        &[
            "--for",
            &format!("add=file:{}", new_signer.display()),
            "--timeout",
            "10s",
        ],
        20 * SECOND,
    );
    assert_eq!(code, Some(0), "{text}");

    // 4. Later, the old signer is withdrawn, and the removal is waited for in turn, by the
    // fingerprint kept in step 1. worker-3's agent is paused again: `rollout status` names
    // the withdrawn signer it still holds by its CN, which only its own report gives now.
    let (old_client, _) =
        old.issue_client("system:serviceaccount:openshift-monitoring:prometheus-k8s");
    signal(agent3, nix::sys::signal::Signal::SIGSTOP);
    let withdrawn = format!("{}{}", other.pem(), new.pem());
    cluster.put_configmap(SIGNERS_NS, SIGNERS, &[("ca-bundle.crt", &withdrawn)]);
    let old_sha = fs::read_to_string(&old_signer_sha256).unwrap();
    assert!(
        eventually(10 * SECOND, || {
            let out = rollout(&admin, &["status"]);
            stdout(&out).starts_with("2 of 3 nodes hold what the sources make")
        }),
        "worker-1 and worker-2 did not drop the old signer"
    );
    let out = rollout(&admin, &["status"]);
    let table = stdout(&out);
    let laggard = table
        .lines()
        .find(|l| l.starts_with("worker-3 "))
        .unwrap_or_else(|| panic!("worker-3 is not named: {table}"));
    assert!(
        laggard.contains(&format!(
            "still holds kube-csr-signer_@1700000000 (sha256:{}...)",
            &old_sha[..12]
        )),
        "{table}"
    );
    let mut gate = RolloutWait::start(
        &admin,
        &["--for", &format!("remove={old_sha}"), "--timeout", "60s"],
    );
    std::thread::sleep(2 * SECOND);
    assert!(
        gate.running(),
        "the removal's gate opened with worker-3 behind"
    );
    signal(agent3, nix::sys::signal::Signal::SIGCONT);
    let (code, text) = gate.exit(30 * SECOND);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.lines()
            .last()
            .unwrap()
            .starts_with("3 of 3 nodes no longer hold kube-csr-signer_@1700000000"),
        "{text}"
    );
    for (name, node, _) in &nodes {
        assert!(node.holds(&withdrawn), "{name}");
        assert!(!openssl_verifies(&node.bundle(), &old_client), "{name}");
        assert!(openssl_verifies(&node.bundle(), &client), "{name}");
    }
    let out = rollout(&admin, &["status"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    eprintln!("the OpenShift signer rotation took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------
// Rotating the API server's serving CA (kubeadm)
// ---------------------------------------------------------------------------------------

const CLUSTER_INFO: &str = "configmap:kube-public/cluster-info/kubeconfig";
const CLIENT_CA: &str = "configmap:kube-system/extension-apiserver-authentication/client-ca-file";

/// kube-public/cluster-info's `kubeconfig`, as kubeadm publishes it.
fn cluster_info(server: &str, ca_pem: &str) -> String {
    format!(
        "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: {server}\n  name: \"\"\ncontexts: null\ncurrent-context: \"\"\nkind: Config\npreferences: {{}}\nusers: null\n",
        b64(ca_pem)
    )
}

/// The docs' three commands on cluster-info: `kubectl get` its kubeconfig, `sed` its
/// `certificate-authority-data:` line to the base64 of `cas`, `kubectl patch` it back.
fn set_cluster_info_cas(cluster: &Cluster, cas: &str) {
    let (code, cm) = cluster.request(
        "GET",
        "/api/v1/namespaces/kube-public/configmaps/cluster-info",
        None,
    );
    assert_eq!(code, 200, "{cm}");
    let kubeconfig = cm["data"]["kubeconfig"].as_str().unwrap();
    let line = format!("certificate-authority-data: {}", b64(cas));
    let edited: String = kubeconfig
        .split_inclusive('\n')
        .map(|l| match l.find("certificate-authority-data: ") {
            Some(at) => format!("{}{line}\n", &l[..at]),
            None => l.to_string(),
        })
        .collect();
    assert_ne!(edited, kubeconfig, "the sed changed nothing");
    let patch = json!({"data": {"kubeconfig": edited}});
    let (code, answer) = cluster.request(
        "PATCH",
        "/api/v1/namespaces/kube-public/configmaps/cluster-info",
        Some(&patch),
    );
    assert_eq!(code, 200, "{answer}");
}

/// The CA data of the kubeconfig at `path`, decoded.
fn ca_data(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap();
    let value = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("certificate-authority-data: "))
        .unwrap_or_else(|| panic!("no CA data in {text}"));
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(value.trim())
            .unwrap(),
    )
    .unwrap()
}

/// `curl --cacert CA https://.../livez`'s status code: 0 when TLS fails (the server's
/// certificate is not signed by CA).
fn livez_with(url: &str, ca: &Path) -> u16 {
    let out = Command::new("curl")
        .args([
            "-s",
            "-m",
            "10",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--cacert",
        ])
        .arg(ca)
        .arg(format!("{url}/livez"))
        .output()
        .expect("curl");
    stdout(&out).trim().parse().unwrap_or(0)
}

fn bash(dir: &Path, script: &str) {
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(dir)
        .output()
        .expect("bash");
    assert!(out.status.success(), "{script}\n{}", stderr(&out));
}

/// A kubeadm node: its private `/etc/kubernetes` (bind-mounted for its agent at the path
/// every node shares), its kubelet's client certificate, the hook's record.
struct KubeadmNode {
    name: &'static str,
    node: Node,
    agent: Option<Agent>,
}

impl KubeadmNode {
    /// The node's kubelet.conf, as the test sees it (its agent sees it at the shared path).
    fn kubelet_conf(&self) -> PathBuf {
        self.node.bundle_dir().join("kubelet.conf")
    }

    /// The hook's record: one line per kubelet restart (in the state directory: a hook runs
    /// inside the agent's confinement).
    fn restarts(&self) -> Vec<String> {
        fs::read_to_string(self.node.state_dir().join("kubelet-restarts"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn broken(&self) -> PathBuf {
        self.node.root().join("kubelet-broken")
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().unwrap()
    }
}

#[test]
fn a_kubeadm_serving_ca_rotation_switches_the_api_server_only_once_every_kubelet_trusts_the_new_ca()
{
    // Every node's kubelet.conf is /etc/kubernetes/kubelet.conf: the gate asks about that
    // one path. Here each agent gets its node's directory at one shared path, in a mount
    // namespace of its own.
    let probe = Command::new("unshare").args(["-m", "true"]).output();
    if !common::require(
        probe.is_ok_and(|o| o.status.success()),
        "unshare -m (a mount namespace per node agent) needs root",
    ) {
        return;
    }
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let started = Instant::now();
    let admin = cluster.admin_kubeconfig();
    let pki = cluster.path("pki");
    let old_ca = cluster.ca_pem();
    let shared = tempfile::tempdir().unwrap();
    let etc_kubernetes = shared.path().join("etc/kubernetes");
    fs::create_dir_all(&etc_kubernetes).unwrap();
    let kubelet_conf = etc_kubernetes.join("kubelet.conf");
    let target = path_str(&kubelet_conf).to_string();

    // kubeadm's cluster-info, and the nodes' read access to it and to the client CA.
    cluster.put_configmap(
        "kube-public",
        "cluster-info",
        &[("kubeconfig", &cluster_info(&cluster.url, &old_ca))],
    );
    grant_to_nodes(
        &cluster,
        "kube-public",
        "kubelet-ca-agent-kubeconfig",
        Some("cluster-info"),
        "kubelet-ca-agent-kubeconfig",
    );
    grant_to_nodes(
        &cluster,
        "kube-system",
        "extension-apiserver-authentication-reader",
        None,
        "kubelet-ca-agent-source",
    );

    // Three nodes as kubeadm joins them: kubelet.conf with the cluster CA's data and the
    // kubelet's client certificate; the agent keeps its CA data from cluster-info and, as
    // the unit, uses it as its own credentials; the hook stands in for
    // `systemctl restart kubelet.service` (worker-3's kubelet fails to start at first).
    let mut nodes: Vec<KubeadmNode> = Vec::new();
    for name in ["worker-1", "worker-2", "worker-3"] {
        cluster.create_node(name, None);
        let node = Node::new();
        let (crt, key) = cluster.client_cert(&format!("system:node:{name}"), &["system:nodes"]);
        let current = node
            .root()
            .join("var/lib/kubelet/pki/kubelet-client-current.pem");
        write(
            &current,
            format!(
                "{}{}",
                fs::read_to_string(crt).unwrap(),
                fs::read_to_string(key).unwrap()
            ),
        );
        let conf = node.bundle_dir().join("kubelet.conf");
        write(
            &conf,
            format!(
                "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: {}\n  name: kubernetes\ncontexts:\n- context:\n    cluster: kubernetes\n    user: system:node:{name}\n  name: system:node:{name}@kubernetes\ncurrent-context: system:node:{name}@kubernetes\nkind: Config\npreferences: {{}}\nusers:\n- name: system:node:{name}\n  user:\n    client-certificate: {}\n    client-key: {}\n",
                b64(&old_ca),
                cluster.url,
                current.display(),
                current.display()
            ),
        );
        fs::set_permissions(&conf, fs::Permissions::from_mode(0o600)).unwrap();
        let hook = node.root().join("restart-kubelet");
        let root = node.root().display().to_string();
        let state = node.state_dir().display().to_string();
        write(
            &hook,
            format!(
                "#!/bin/sh\nif [ -e {root}/kubelet-broken ]; then echo 'kubelet.service failed' >&2; exit 1; fi\necho \"$KUBELET_CA_KUBECONFIG $KUBELET_CA_ADDED\" >>{state}/kubelet-restarts\n"
            ),
        );
        fs::set_permissions(&hook, fs::Permissions::from_mode(0o755)).unwrap();
        let kubeadm = KubeadmNode {
            name,
            node,
            agent: None,
        };
        if name == "worker-3" {
            write(&kubeadm.broken(), "");
        }
        nodes.push(kubeadm);
    }
    for kubeadm in &mut nodes {
        let mount = format!(
            "mount --bind {} {} && exec \"$@\"",
            kubeadm.node.bundle_dir().display(),
            etc_kubernetes.display()
        );
        let wrapper = [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            &mount,
            "sh",
        ];
        let manage = format!("{target}={CLUSTER_INFO}");
        let hook = kubeadm.node.root().join("restart-kubelet");
        let agent = Agent::start_wrapped(
            &kubeadm.node,
            &[CLIENT_CA],
            &[
                "--kubeconfig",
                &target,
                "--manage-kubeconfig",
                &manage,
                "--kubeconfig-hook",
                path_str(&hook),
            ],
            &wrapper,
            |_| {},
        );
        kubeadm.agent = Some(agent);
    }
    for kubeadm in &nodes {
        kubeadm.agent().wait_listening();
    }
    let gate = |condition: &str, timeout: &str| -> Vec<String> {
        [
            "--for",
            condition,
            "--source",
            CLUSTER_INFO,
            "--target",
            &target,
            "--timeout",
            timeout,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };

    // Before: every node's kubelet.conf holds what cluster-info makes.
    let before = gate("sources", "60s");
    let (code, text) = wait(&admin, &before, 70 * SECOND);
    assert_eq!(code, Some(0), "{text}\n{}", nodes[0].agent().log());
    let out = rollout(
        &admin,
        &["status", "--source", CLUSTER_INFO, "--target", &target],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );

    // A copy of the CA the API server presents now, and the new CA, made as the docs make it.
    fs::copy(pki.join("ca.crt"), pki.join("old-ca.crt")).unwrap();
    bash(
        &pki,
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout new-ca.key -out new-ca.crt -days 3650 \
         -subj \"/CN=kubernetes-2\" -addext \"basicConstraints=critical,CA:TRUE\" \
         -addext \"keyUsage=critical,keyCertSign,cRLSign\" 2>/dev/null",
    );
    let out = Command::new(agent_bin())
        .args(["inspect", path_str(&pki.join("new-ca.crt"))])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let new_ca_path = pki.join("new-ca.crt");
    let old_ca_path = pki.join("old-ca.crt");
    let new_ca = fs::read_to_string(&new_ca_path).unwrap();
    let both = format!("{old_ca}{new_ca}");

    // 1. Add the new CA to cluster-info, next to the old one.
    set_cluster_info_cas(&cluster, &both);

    // 2. The gate: every kubelet.conf holds it and its kubelet restarted. worker-3's
    // kubelet does not start again: the wait times out (exit 1) naming it.
    let add = format!("add=file:{}", new_ca_path.display());
    let (code, text) = wait(&admin, &gate(&add, "5s"), 30 * SECOND);
    eprintln!("the gate, worker-3's kubelet not restarted:\n{text}");
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("timed out after 5s: 2 of 3 nodes hold kubernetes-2"),
        "{text}"
    );
    let laggard = text
        .lines()
        .find(|l| l.starts_with("worker-3 "))
        .unwrap_or_else(|| panic!("worker-3 is not named: {text}"));
    assert!(
        laggard.contains("kubelet restart failed after a CA was added"),
        "{text}"
    );
    assert!(
        ca_data(&nodes[2].kubelet_conf()) == both,
        "worker-3's kubeconfig has the CA"
    );
    let out = rollout(
        &admin,
        &[
            "status",
            "--source",
            CLUSTER_INFO,
            "--target",
            &target,
            "--output",
            "json",
        ],
    );
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    let worker3 = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "worker-3")
        .unwrap()
        .clone();
    assert_eq!(worker3["state"], "behind", "{status}");
    assert_eq!(
        worker3["why"][0]["reason"], "kubeletNotRestarted",
        "{status}"
    );

    // Its kubelet is fixed: the agent's next try of the hook restarts it, and the gate opens.
    fs::remove_file(nodes[2].broken()).unwrap();
    let (code, text) = wait(&admin, &gate(&add, "60s"), 70 * SECOND);
    assert_eq!(code, Some(0), "{text}\n{}", nodes[2].agent().log());
    let new_sha = fingerprint(&new_ca);
    for kubeadm in &nodes {
        assert_eq!(ca_data(&kubeadm.kubelet_conf()), both, "{}", kubeadm.name);
        assert_eq!(
            kubeadm.restarts(),
            vec![format!("{target} {new_sha}")],
            "{}: one kubelet restart, for the new CA",
            kubeadm.name
        );
    }

    // 3. Switch the serving certificate: signed by the new CA, with the names the current
    // one has, as the docs' commands do it on a control-plane node. (The cluster's ca.crt is
    // also its --client-ca-file and what admin trusts: with both CAs, as kubeadm's manual
    // rotation has it by this step.)
    assert_eq!(livez_with(&cluster.url, &old_ca_path), 200);
    assert_eq!(livez_with(&cluster.url, &new_ca_path), 0);
    bash(
        &pki,
        "openssl req -newkey rsa:2048 -nodes -keyout apiserver-next.key -out apiserver-next.csr -subj \"/CN=kube-apiserver\" 2>/dev/null
         printf 'subjectAltName=%s\\nextendedKeyUsage=serverAuth\\n' \"$(openssl x509 -in apiserver.crt -noout -ext subjectAltName | tail -n 1 | sed 's/IP Address:/IP:/g; s/ //g')\" >apiserver-next.ext
         openssl x509 -req -in apiserver-next.csr -CA new-ca.crt -CAkey new-ca.key -CAcreateserial -days 365 -extfile apiserver-next.ext -out apiserver-next.crt 2>/dev/null
         mv apiserver-next.key apiserver.key && mv apiserver-next.crt apiserver.crt",
    );
    fs::write(pki.join("ca.crt"), &both).unwrap();
    cluster.restart();
    assert_eq!(
        livez_with(&cluster.url, &new_ca_path),
        200,
        "the server presents the new CA's certificate"
    );
    assert_eq!(livez_with(&cluster.url, &old_ca_path), 0);

    // 4. Withdraw the old CA from cluster-info. The agents read it through the new serving
    // certificate, trusting it by the kubeconfig they manage.
    set_cluster_info_cas(&cluster, &new_ca);

    // 5. The gate: every kubelet.conf dropped the old CA (each agent checked that the new CA
    // alone verifies the API server first).
    let remove = format!("remove=file:{}", old_ca_path.display());
    let (code, text) = wait(&admin, &gate(&remove, "60s"), 70 * SECOND);
    assert_eq!(code, Some(0), "{text}\n{}", nodes[0].agent().log());
    for kubeadm in &nodes {
        let conf = fs::read_to_string(kubeadm.kubelet_conf()).unwrap();
        assert_eq!(ca_data(&kubeadm.kubelet_conf()), new_ca, "{}", kubeadm.name);
        assert!(
            conf.contains(&format!(
                "current-context: system:node:{}@kubernetes\n",
                kubeadm.name
            )) && conf.contains("client-key: "),
            "{conf}"
        );
        // No restart for a removal.
        assert_eq!(kubeadm.restarts().len(), 1, "{}", kubeadm.name);
        let verbose = kubeadm.agent().get("/readyz?verbose").unwrap().1;
        assert_eq!(
            check_line(&verbose, &format!("source:{CLUSTER_INFO}")),
            format!("[+]source:{CLUSTER_INFO} ok"),
            "{verbose}"
        );
        assert_eq!(
            check_line(&verbose, &format!("in-sync:{target}")),
            format!("[+]in-sync:{target} ok"),
            "{verbose}"
        );
    }
    let out = rollout(
        &admin,
        &["status", "--source", CLUSTER_INFO, "--target", &target],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    eprintln!(
        "the kubeadm serving-CA rotation took {:?}",
        started.elapsed()
    );
}
