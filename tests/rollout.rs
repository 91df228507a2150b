//! The rollout gate (SPEC 8c) through the real binary, against the real API server of
//! `../shared/tools/kube-apiserver/cluster`: Nodes with hand-written reports (current,
//! behind, invalid, oversized, wrongly typed, missing, NotReady, being deleted), `rollout
//! status` as a table and as JSON with its exit codes, a read-only identity and one without
//! access to the Nodes, the kubectl plugin's name, and `rollout wait` exiting the moment the
//! last node's report is written, through an API server restart, and on its timeout.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::pki::{Algorithm, Signer};
use common::real_cluster::{Cluster, RolloutWait, rollout};
use common::{agent_bin, sha256_hex, stderr, stdout};
use serde_json::{Value, json};

const NS: &str = "openshift-config-managed";
const NAME: &str = "kube-apiserver-client-ca";
const BUNDLE: &str = "/etc/kubernetes/kubelet-ca.crt";

/// A report as the node agent writes it, its bundle holding `certs`.
fn held(certs: &[&str]) -> String {
    json!({
        "v": 1, "agent": "0.1.0", "changed": "2026-11-27T15:00:00Z",
        "targets": [{"path": BUNDLE, "kind": "bundle", "certs": certs, "inSync": true}],
    })
    .to_string()
}

/// Two signers published in the ConfigMap the nodes read, and their fingerprints.
fn signers(cluster: &Cluster) -> (Signer, Signer, String, String) {
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("kube-csr-signer_@1700000002", Algorithm::P256),
    );
    let bundle = format!("{}{}", a.pem(), b.pem());
    cluster.put_configmap(NS, NAME, &[("ca-bundle.crt", &bundle)]);
    let (fa, fb) = (sha256_hex(&a.der()), sha256_hex(&b.der()));
    (a, b, fa, fb)
}

#[test]
fn rollout_status_names_every_node_that_is_not_current_and_exits_as_documented() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let (_a, _b, fa, fb) = signers(&cluster);
    cluster.create_node("good", Some(&held(&[&fa, &fb])));
    cluster.create_node("down", Some(&held(&[&fb, &fa])));
    cluster.set_ready("good", "True");
    cluster.set_ready("down", "False");
    cluster.create_node("behind", Some(&held(&[&fa])));
    cluster.create_node("garbage", Some("{\"v\":1,\"targets\":7}"));
    cluster.create_node("wrong-type", Some(&held(&[&fa]).replace("true", "\"yes\"")));
    let oversized = format!("{{\"v\":1,\"pad\":\"{}\"}}", "x".repeat(20 * 1024));
    cluster.create_node("oversized", Some(&oversized));
    cluster.create_node("silent", None);
    cluster.create_node("leaving", Some(&held(&[&fa])));
    cluster.delete_node_held("leaving");
    let admin = cluster.admin_kubeconfig();

    let out = rollout(&admin, &["status"]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}{}", stderr(&out));
    let first = text.lines().next().unwrap();
    assert_eq!(
        first,
        "2 of 7 nodes hold what the sources make (2 certificates); 1 node being deleted is left out"
    );
    assert!(
        text.contains(&format!(
            "kube-csr-signer_@1700000002 (sha256:{}...)",
            &fb[..12]
        )),
        "{text}"
    );
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no line for {name}: {text}"))
            .to_string()
    };
    assert!(line("behind").contains(" behind "), "{text}");
    assert!(
        line("behind").contains("lacks kube-csr-signer_@1700000002"),
        "{text}"
    );
    assert!(line("garbage").contains(" invalid "), "{text}");
    assert!(
        line("wrong-type").contains("invalid report: not a report"),
        "{text}"
    );
    assert!(
        line("oversized").contains("over the 16384 allowed"),
        "{text}"
    );
    assert!(line("silent").contains(" unreported "), "{text}");
    assert!(!text.contains("leaving"), "{text}");
    // Current nodes are not listed, NotReady or not; a NotReady laggard would be marked.
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("good ") || l.starts_with("down "))
    );

    let out = rollout(&admin, &["status", "--output", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let json: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(
        (json["counted"].as_u64(), json["current"].as_u64()),
        (Some(7), Some(2))
    );
    assert_eq!(json["leftOut"], 1);
    assert_eq!(json["states"]["invalid"], 3);
    let nodes = json["nodes"].as_array().unwrap();
    let node = |name: &str| nodes.iter().find(|n| n["name"] == name).unwrap().clone();
    assert_eq!(node("down")["state"], "current");
    assert_eq!(node("down")["ready"], "false");
    assert_eq!(node("down")["why"][0]["reason"], "notReady");
    assert_eq!(node("good")["ready"], "true");
    assert_eq!(node("silent")["state"], "unreported");
    assert_eq!(node("behind")["lacks"][0]["sha256"], fb.as_str());
    assert_eq!(json["certificates"][1]["holding"], 2);

    // The current nodes alone: exit 0.
    for name in ["good", "down"] {
        let body = json!({"metadata": {"labels": {"rollout": "done"}}});
        cluster.request("PATCH", &format!("/api/v1/nodes/{name}"), Some(&body));
    }
    let out = rollout(&admin, &["status", "--selector", "rollout=done"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(stdout(&out).starts_with("2 of 2 nodes hold"));

    // A read-only identity: get, list and watch on nodes and on the source alone.
    let viewer = cluster.kubeconfig_for("viewer", &[]);
    cluster.grant_nodes(&["get", "list", "watch"], "viewer");
    cluster.grant_configmaps(NS, &[NAME], &["get", "list", "watch"], "viewer");
    let out = rollout(&viewer, &["status"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("2 of 7 nodes hold"),
        "{}",
        stdout(&out)
    );
    // Without access to the Nodes: exit 2, saying what is needed.
    let stranger = cluster.kubeconfig_for("stranger", &[]);
    cluster.grant_configmaps(NS, &[NAME], &["get", "list", "watch"], "stranger");
    let out = rollout(&stranger, &["status"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("get, list and watch on nodes"),
        "{}",
        stderr(&out)
    );
    // A wait ends on the refusal at once, saying the same, rather than at its timeout.
    let started = std::time::Instant::now();
    let out = rollout(
        &stranger,
        &["wait", "--for", &format!("add={fb}"), "--timeout", "60s"],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("get, list and watch on nodes"),
        "{}",
        stderr(&out)
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(60));
    // Without access to the sources: exit 2 too.
    let blind = cluster.kubeconfig_for("blind", &[]);
    cluster.grant_nodes(&["get", "list", "watch"], "blind");
    let out = rollout(&blind, &["status"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("cannot read the sources"),
        "{}",
        stderr(&out)
    );
    // A wait for add= or remove= needs the sources only to name the certificates: without
    // them it goes on with the fingerprints alone (and here times out: exit 1, not 2).
    let out = rollout(
        &blind,
        &["wait", "--for", &format!("add={fb}"), "--timeout", "1s"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("the certificates are named by their fingerprints alone"),
        "{}",
        stderr(&out)
    );
    assert!(
        stdout(&out).contains(&format!(
            "timed out after 1s: 2 of 7 nodes hold sha256:{}...",
            &fb[..12]
        )),
        "{}",
        stdout(&out)
    );

    // As the kubectl plugin.
    let bin = tempfile::tempdir().unwrap();
    let plugin = bin.path().join("kubectl-kubelet_ca");
    std::os::unix::fs::symlink(agent_bin(), &plugin).unwrap();
    let help = Command::new(&plugin)
        .args(["rollout", "status", "--help"])
        .output()
        .unwrap();
    assert!(
        stdout(&help).contains("kubectl kubelet-ca rollout status"),
        "{}",
        stdout(&help)
    );
    let out = Command::new(&plugin)
        .args(["rollout", "status", "--kubeconfig"])
        .arg(&admin)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).starts_with("2 of 7 nodes hold"));
    if Path::new("/usr/bin/kubectl").exists() {
        let path = format!(
            "{}:{}",
            bin.path().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new("/usr/bin/kubectl")
            .args([
                "kubelet-ca",
                "rollout",
                "status",
                "-o",
                "json",
                "--kubeconfig",
            ])
            .arg(&admin)
            .env("PATH", path)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        let json: Value = serde_json::from_slice(&out.stdout).expect("JSON through kubectl");
        assert_eq!(json["counted"], 7);
    }
}

/// More Nodes than a page (the lists ask for 500 at a time): every one is counted, its
/// report and its readiness read, through the continue tokens of both the list of the Nodes
/// and the table of their readiness.
#[test]
fn rollout_counts_and_names_every_node_past_one_page() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let (_a, _b, fa, fb) = signers(&cluster);
    let both = held(&[&fa, &fb]);
    let mut nodes: Vec<(String, Option<String>)> = (0..501)
        .map(|i| (format!("node-{i:04}"), Some(both.clone())))
        .collect();
    nodes[500].1 = Some(held(&[&fa]));
    cluster.create_nodes(&nodes);
    cluster.set_ready("node-0000", "True");
    cluster.set_ready("node-0500", "False");
    let admin = cluster.admin_kubeconfig();

    let out = rollout(&admin, &["status", "--output", "json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let json: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(
        (json["counted"].as_u64(), json["current"].as_u64()),
        (Some(501), Some(500))
    );
    let listed = json["nodes"].as_array().unwrap();
    let node = |name: &str| listed.iter().find(|n| n["name"] == name).unwrap().clone();
    assert_eq!(node("node-0500")["state"], "behind");
    assert_eq!(node("node-0500")["ready"], "false");
    assert_eq!(node("node-0000")["ready"], "true");

    // wait, from its watch's first list: the count, then the exit once the last one holds it.
    let mut wait = RolloutWait::start(&admin, &["--for", &format!("add={fb}")]);
    let second = Duration::from_secs(1);
    assert!(
        wait.line(30 * second).starts_with("500 of 501 nodes hold"),
        "{}",
        wait.log()
    );
    cluster.set_held("node-0500", Some(&both));
    assert_eq!(wait.exit(20 * second).0, Some(0));
}

#[test]
fn rollout_wait_exits_the_moment_the_last_node_holds_the_ca_even_through_a_restart() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let (_a, b, fa, fb) = signers(&cluster);
    for name in ["n1", "n2", "n3"] {
        cluster.create_node(name, Some(&held(&[&fa])));
    }
    let admin = cluster.admin_kubeconfig();
    let new_ca = cluster.path("new-ca.pem");
    std::fs::write(&new_ca, b.pem()).unwrap();
    let colons: Vec<String> = fb
        .as_bytes()
        .chunks(2)
        .map(|p| String::from_utf8_lossy(p).to_uppercase())
        .collect();
    let mut wait = RolloutWait::start(&admin, &["--for", &format!("add={}", colons.join(":"))]);
    let name = format!("kube-csr-signer_@1700000002 (sha256:{}...)", &fb[..12]);
    let second = Duration::from_secs(1);
    assert_eq!(wait.line(20 * second), format!("0 of 3 nodes hold {name}"));
    cluster.set_held("n1", Some(&held(&[&fa, &fb])));
    assert_eq!(wait.line(5 * second), format!("1 of 3 nodes hold {name}"));
    // The API server restarts: the watch gets 410 and lists again at once.
    cluster.restart();
    cluster.set_held("n2", Some(&held(&[&fb])));
    assert_eq!(wait.line(15 * second), format!("2 of 3 nodes hold {name}"));
    // A node being deleted is left out: the last one it waits for.
    cluster.delete_node_held("n3");
    assert!(
        wait.line(5 * second)
            .starts_with(&format!("2 of 2 nodes hold {name}")),
        "the count moves when n3 leaves"
    );
    assert_eq!(wait.exit(5 * second).0, Some(0));
    // The restart is told in the log, not on every retry or event: "cannot follow" comes
    // once a spell, and the next only after "following the Nodes again". An API server that
    // has just started may still cut the first watch it accepts (seen under load: "connection
    // closed before message completed", a second spell told as one), and the command may
    // exit on the list that ends it before it logs that it follows again.
    let log = wait.log();
    let told: Vec<&str> = log
        .lines()
        .filter_map(|l| {
            if l.contains("cannot follow the Nodes") {
                Some("down")
            } else if l.contains("following the Nodes again") {
                Some("up")
            } else {
                None
            }
        })
        .collect();
    assert!(
        told.first() == Some(&"down") && told.windows(2).all(|w| w[0] != w[1]),
        "{log}"
    );
    assert!(wait.logged("410 Gone") <= 1);

    // remove= with a timeout: exit 1, naming the laggards as status does.
    let mut wait = RolloutWait::start(
        &admin,
        &[
            "--for",
            &format!("remove=file:{}", new_ca.display()),
            "--timeout",
            "3s",
        ],
    );
    let (code, text) = wait.exit(30 * second);
    assert_eq!(code, Some(1), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        text.contains("timed out after 3s: 0 of 2 nodes no longer hold"),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("n1 ") && l.contains("still holds kube-csr-signer_@1700000002")),
        "{text}"
    );
    assert!(lines.iter().any(|l| l.starts_with("n2 ")), "{text}");
    assert!(!lines.iter().any(|l| l.starts_with("n3 ")), "{text}");
    // The moment n1 and n2 drop it, a wait for the removal exits 0.
    cluster.set_held("n1", Some(&held(&[&fa])));
    cluster.set_held("n2", Some(&held(&[&fa])));
    let mut wait = RolloutWait::start(
        &admin,
        &["--for", &format!("remove={fb}"), "--timeout", "30s"],
    );
    assert_eq!(wait.exit(20 * second).0, Some(0));
    // A usage error: exit 2.
    let out = rollout(&admin, &["wait", "--for", "add=nope"]);
    assert_eq!(out.status.code(), Some(2));
    let out = rollout(&admin, &["wait", "--for", "add=file:/nonexistent.pem"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// A `rollout wait` that has its answer ends at once and says nothing else: no warning of
/// its watch being cut as the command exits (issue 39: 3 runs in 30 printed one).
#[test]
fn a_successful_wait_prints_no_warning() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let (_a, _b, fa, fb) = signers(&cluster);
    for name in ["n1", "n2", "n3"] {
        cluster.create_node(name, Some(&held(&[&fa, &fb])));
    }
    let admin = cluster.admin_kubeconfig();
    for run in 0..50 {
        let out = rollout(&admin, &["wait", "--for", &format!("add={fb}")]);
        assert_eq!(out.status.code(), Some(0), "run {run}: {}", stderr(&out));
        assert!(
            stdout(&out).starts_with("3 of 3 nodes hold"),
            "run {run}: {}",
            stdout(&out)
        );
        let log = stderr(&out);
        assert!(
            !log.contains(" WARN ") && !log.contains(" ERROR "),
            "run {run}: a successful wait warned: {log}"
        );
    }
}

/// A report whose bundle holds `certs`, naming some of them (`names`: fingerprint, CN), as
/// the node agent names what it holds.
fn held_named(certs: &[&str], names: &[(&str, &str)]) -> String {
    let mut report: Value = serde_json::from_str(&held(certs)).unwrap();
    let names: serde_json::Map<String, Value> = names
        .iter()
        .map(|(sha, cn)| (sha.to_string(), json!(cn)))
        .collect();
    report["names"] = Value::Object(names);
    report.to_string()
}

/// The fingerprint as the table prints it (`sha256:` and 12 digits, then `...`) is what
/// `--for` takes, as is any prefix of 12 digits or more, of a certificate the sources make
/// or only a report names (issue 39: `--for add=7cd38cef4711` was refused). One that names
/// no certificate, or several, is refused (exit 2), the several listed.
#[test]
fn the_fingerprint_the_table_prints_is_what_wait_takes() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let (_a, _b, fa, fb) = signers(&cluster);
    let withdrawn = Signer::new("withdrawn-signer", Algorithm::P256);
    let fc = sha256_hex(&withdrawn.der());
    cluster.create_node("n1", Some(&held(&[&fa, &fb])));
    cluster.create_node(
        "n2",
        Some(&held_named(&[&fa, &fc], &[(&fc, "withdrawn-signer")])),
    );
    // A report naming two fingerprints that share their first 12 digits.
    let twins = [
        format!("abcdefabcdef{}", "0".repeat(52)),
        format!("abcdefabcdef{}", "1".repeat(52)),
    ];
    cluster.create_node("n3", Some(&held(&[&fa, &fb, &twins[0], &twins[1]])));
    let admin = cluster.admin_kubeconfig();

    let out = rollout(&admin, &["status"]);
    let table = stdout(&out);
    let printed = table
        .lines()
        .find(|l| l.starts_with("kube-csr-signer_@1700000002 ("))
        .and_then(|l| l.split(['(', ')']).nth(1))
        .unwrap_or_else(|| panic!("no fingerprint printed for the signer: {table}"))
        .to_string();
    assert_eq!(printed, format!("sha256:{}...", &fb[..12]), "{table}");

    // Pasted into wait: n2 lacks it, so the wait times out naming it.
    let name = format!("kube-csr-signer_@1700000002 (sha256:{}...)", &fb[..12]);
    for given in [
        printed.clone(),
        fb[..12].to_string(),
        fb[..20].to_uppercase(),
    ] {
        let out = rollout(
            &admin,
            &["wait", "--for", &format!("add={given}"), "--timeout", "1s"],
        );
        assert_eq!(out.status.code(), Some(1), "{given}: {}", stderr(&out));
        assert!(
            stdout(&out).contains(&format!("timed out after 1s: 2 of 3 nodes hold {name}")),
            "{given}: {}",
            stdout(&out)
        );
    }
    // A certificate no source makes any more, named by n2's report alone.
    let out = rollout(
        &admin,
        &[
            "wait",
            "--for",
            &format!("remove=sha256:{}", &fc[..12]),
            "--timeout",
            "1s",
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains(&format!(
            "timed out after 1s: 2 of 3 nodes no longer hold withdrawn-signer (sha256:{}...)",
            &fc[..12]
        )),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("n2 ") && l.contains("still holds withdrawn-signer")),
        "{text}"
    );
    // Once every node holds it, the pasted fingerprint's wait exits 0.
    cluster.set_held("n2", Some(&held(&[&fa, &fb])));
    let out = rollout(&admin, &["wait", "--for", &format!("add={printed}")]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    // A prefix nothing names: exit 2, saying so, before any wait.
    let out = rollout(
        &admin,
        &["wait", "--for", "add=ffffffffffff", "--timeout", "30s"],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains(
            "no certificate that the sources make or a node's report names has a fingerprint starting with sha256:ffffffffffff"
        ),
        "{}",
        stderr(&out)
    );
    // Two that start so: exit 2, both listed in full.
    let out = rollout(&admin, &["wait", "--for", "remove=abcdef:abcdef"]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let said = stderr(&out);
    assert!(
        said.contains("sha256:abcdefabcdef names 2 certificates, give more of its digits"),
        "{said}"
    );
    for twin in &twins {
        assert!(said.contains(&format!("sha256:{twin}")), "{said}");
    }
    // With one digit more, it names one.
    let out = rollout(
        &admin,
        &["wait", "--for", "remove=abcdefabcdef1", "--timeout", "1s"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("2 of 3 nodes no longer hold sha256:abcdefabcdef..."),
        "{}",
        stdout(&out)
    );
    // Fewer than 12 digits is not a fingerprint.
    let out = rollout(&admin, &["wait", "--for", &format!("add={}", &fb[..11])]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
}

/// `rollout status` names a certificate a node still holds by its subject CN, as the node's
/// report names it, when no source makes it any more (issue 39: a withdrawn CA was shown by
/// its fingerprint alone), in the table and in the JSON.
#[test]
fn rollout_status_names_a_withdrawn_ca_a_node_still_holds() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let (_a, _b, fa, fb) = signers(&cluster);
    let withdrawn = Signer::new("kube-csr-signer_@1600000000", Algorithm::P256);
    let fc = sha256_hex(&withdrawn.der());
    cluster.create_node("current", Some(&held(&[&fa, &fb])));
    cluster.create_node(
        "lagging",
        Some(&held_named(
            &[&fa, &fc],
            &[(&fc, "kube-csr-signer_@1600000000"), (&fa, "not-signer-a")],
        )),
    );
    let admin = cluster.admin_kubeconfig();
    let out = rollout(&admin, &["status"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = stdout(&out);
    let line = text
        .lines()
        .find(|l| l.starts_with("lagging "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains(&format!(
            "lacks kube-csr-signer_@1700000002 (sha256:{}...); still holds kube-csr-signer_@1600000000 (sha256:{}...)",
            &fb[..12],
            &fc[..12]
        )),
        "{text}"
    );
    let out = rollout(&admin, &["status", "-o", "json"]);
    let json: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let lagging = json["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "lagging")
        .unwrap()
        .clone();
    assert_eq!(lagging["stillHolds"][0]["sha256"], fc.as_str(), "{json}");
    assert_eq!(
        lagging["stillHolds"][0]["subjectCN"], "kube-csr-signer_@1600000000",
        "{json}"
    );
    // What the sources name keeps their name, whatever a node says.
    assert!(!text.contains("not-signer-a"), "{text}");
}

/// `rollout` takes its credentials as kubectl does (issue 39: `--context` was refused): a
/// context chosen by `--context` from a kubeconfig whose current one points at a wrong
/// server and user, `--cluster` and `--user` instead of the context's, and `$KUBECONFIG`
/// naming several files merged as kubectl merges them (a missing one skipped, the first
/// current-context that is set winning), also as the kubectl plugin.
#[test]
fn rollout_takes_its_credentials_as_kubectl_does() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let (_a, _b, fa, fb) = signers(&cluster);
    cluster.create_node("n1", Some(&held(&[&fa, &fb])));
    let (crt, key) = cluster.client_cert("ops", &["system:masters"]);
    let (stranger_crt, stranger_key) = cluster.client_cert("stranger", &[]);
    let ca = cluster.ca_path();
    let user = |name: &str, crt: &Path, key: &Path| {
        format!(
            "- name: {name}\n  user:\n    client-certificate: {}\n    client-key: {}\n",
            crt.display(),
            key.display()
        )
    };
    let clusters = format!(
        "clusters:\n- name: right\n  cluster:\n    server: {}\n    certificate-authority: {}\n- name: wrong\n  cluster:\n    server: https://127.0.0.1:1\n    certificate-authority: {}\n",
        cluster.url,
        ca.display(),
        ca.display()
    );
    let users = format!(
        "users:\n{}{}",
        user("ops", &crt, &key),
        user("stranger", &stranger_crt, &stranger_key)
    );
    let contexts = "contexts:\n- name: right\n  context: {cluster: right, user: ops}\n- name: wrong\n  context: {cluster: wrong, user: stranger}\n";
    let two = cluster.path("two-contexts.kubeconfig");
    std::fs::write(
        &two,
        format!(
            "apiVersion: v1\nkind: Config\n{clusters}{users}{contexts}current-context: wrong\n"
        ),
    )
    .unwrap();
    let run = |args: &[&str], kubeconfig_env: Option<&str>| {
        let mut command = Command::new(agent_bin());
        command
            .arg("rollout")
            .args(args)
            .env_remove("KUBECONFIG")
            .env_remove("RUST_LOG")
            .env("HOME", cluster.path("no-home"));
        if let Some(value) = kubeconfig_env {
            command.env("KUBECONFIG", value);
        }
        command.output().unwrap()
    };
    let holds = |out: &std::process::Output| {
        assert_eq!(out.status.code(), Some(0), "{}{}", stdout(out), stderr(out));
        assert!(
            stdout(out).starts_with("1 of 1 nodes hold "),
            "{}",
            stdout(out)
        );
    };
    let path = two.to_str().unwrap();
    // The current context reaches nothing: exit 2.
    let out = run(&["status", "--kubeconfig", path], None);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    holds(&run(
        &["status", "--kubeconfig", path, "--context", "right"],
        None,
    ));
    holds(&run(
        &[
            "wait",
            "--for",
            "sources",
            "--timeout",
            "20s",
            "--kubeconfig",
            path,
            "--context",
            "right",
        ],
        None,
    ));
    // The wrong context's cluster and user, each replaced.
    holds(&run(
        &[
            "status",
            "--kubeconfig",
            path,
            "--cluster",
            "right",
            "--user",
            "ops",
        ],
        None,
    ));
    // The right server with the wrong user: refused, as RBAC says (exit 2).
    let out = run(
        &["status", "--kubeconfig", path, "--cluster", "right"],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(stderr(&out).contains("stranger"), "{}", stderr(&out));
    // A context that is not there: exit 2, naming it.
    let out = run(&["status", "--kubeconfig", path, "--context", "nope"], None);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("--context \"nope\" is not among its contexts"),
        "{}",
        stderr(&out)
    );

    // $KUBECONFIG with several files: a missing one skipped; the first file sets only the
    // current-context, and it wins over the second's.
    let only_current = cluster.path("current.kubeconfig");
    std::fs::write(
        &only_current,
        "apiVersion: v1\nkind: Config\ncurrent-context: right\n",
    )
    .unwrap();
    let list = format!(
        "{}:{}:{}",
        cluster.path("missing.kubeconfig").display(),
        only_current.display(),
        two.display()
    );
    holds(&run(&["status"], Some(&list)));
    holds(&run(
        &["wait", "--for", &format!("add={}", &fb[..12])],
        Some(&list),
    ));
    // In the other order, the second file's current-context is the first set: wrong.
    let reversed = format!("{}:{}", two.display(), only_current.display());
    let out = run(&["status"], Some(&reversed));
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    holds(&run(&["status", "--context", "right"], Some(&reversed)));

    // As the kubectl plugin, with kubectl's flags.
    let bin = tempfile::tempdir().unwrap();
    let plugin = bin.path().join("kubectl-kubelet_ca");
    std::os::unix::fs::symlink(agent_bin(), &plugin).unwrap();
    let out = Command::new(&plugin)
        .args([
            "rollout",
            "status",
            "--context",
            "right",
            "--kubeconfig",
            path,
        ])
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    holds(&out);
    if Path::new("/usr/bin/kubectl").exists() {
        let search = format!(
            "{}:{}",
            bin.path().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new("/usr/bin/kubectl")
            .args(["kubelet-ca", "rollout", "status", "--context", "right"])
            .env("KUBECONFIG", &list)
            .env("PATH", search)
            .output()
            .unwrap();
        holds(&out);
    }
}

/// `rollout wait` through a client certificate rotated under it (issue 38): its certificate
/// expires while it waits, the API server restarts (every request after is refused as
/// unauthorized, 401), and a new certificate is written in its place, with no file event to
/// say so (no inotify, as on a node out of instances). The wait never exits on the
/// refusal: the 401 makes it read its credentials again (before, the Nodes' watch did not,
/// and waited up to a minute for the once-a-minute reading), it lists on the new
/// certificate, and succeeds when the last node holds the CA.
#[test]
fn rollout_wait_keeps_waiting_through_a_client_certificate_rotated_under_it() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let (_a, _b, fa, fb) = signers(&cluster);
    cluster.create_node("n1", Some(&held(&[&fa])));
    cluster.grant_nodes(&["get", "list", "watch"], "operator");
    let dir = tempfile::tempdir().unwrap();
    let (crt, key) = (dir.path().join("client.crt"), dir.path().join("client.key"));
    let second = Duration::from_secs(1);
    cluster.client_cert_until("operator", &[], 12 * second, &crt, &key);
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: operator\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: c\n  context: {{cluster: c, user: operator}}\ncurrent-context: c\n",
            cluster.url,
            cluster.path("pki/ca.crt").display(),
            crt.display(),
            key.display()
        ),
    )
    .unwrap();
    let mut wait = RolloutWait::start_wrapped(
        &kubeconfig,
        &["--for", &format!("add={fb}")],
        &common::daemon::WITHOUT_INOTIFY,
    );
    // The operator may read Nodes alone: the CA is named by its fingerprint.
    let name = format!("sha256:{}...", &fb[..12]);
    assert_eq!(wait.line(20 * second), format!("0 of 1 nodes hold {name}"));
    // The certificate expires; the API server restarts, and refuses it from then on.
    std::thread::sleep(13 * second);
    cluster.restart();
    std::thread::sleep(3 * second);
    assert!(
        wait.running(),
        "rollout wait exited on the refusal\n{}",
        wait.log()
    );
    // A new certificate, written as a rotation writes it.
    let (new_crt, new_key) = (dir.path().join("new.crt"), dir.path().join("new.key"));
    cluster.client_cert_until("operator", &[], 3600 * second, &new_crt, &new_key);
    std::fs::rename(&new_key, &key).unwrap();
    std::fs::rename(&new_crt, &crt).unwrap();
    let written = std::time::Instant::now();
    cluster.set_held("n1", Some(&held(&[&fa, &fb])));
    assert_eq!(
        wait.line(20 * second),
        format!("1 of 1 nodes hold {name}"),
        "{}",
        wait.log()
    );
    eprintln!(
        "the new certificate in use {:?} after it was written",
        written.elapsed()
    );
    let (code, out) = wait.exit(5 * second);
    let log = wait.log();
    assert_eq!(code, Some(0), "{out}\n{log}");
    assert!(
        log.contains("credentials for the API server changed"),
        "the new certificate was read\n{log}"
    );
}
