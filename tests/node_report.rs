//! Every node says what it holds (issue 33, SPEC 8c), against the real API server of
//! `../shared/tools/kube-apiserver/cluster`, with the Node authorizer and NodeRestriction as
//! on a real cluster: the agent, with a node's own credentials, writes the
//! `kubelet-ca-agent/held` annotation on its Node after its first pass and after each change,
//! and nothing while idle; credentials that name one node cannot write another's report; a
//! Node that does not exist yet is waited for; and none of it touches the bundle or readiness.

mod common;

use std::time::Duration;

use common::Node;
use common::daemon::{Agent, check_line, eventually, wait_until};
use common::pki::{Algorithm, Signer};
use common::real_cluster::Cluster;
use serde_json::Value;

const SECOND: Duration = Duration::from_secs(1);
const NS: &str = "openshift-config-managed";
const NAME: &str = "kube-apiserver-client-ca";
const SPEC: &str = "configmap:openshift-config-managed/kube-apiserver-client-ca";
const KEY: &str = "ca-bundle.crt";
const HELD: &str = "kubelet-ca-agent/held";

/// The SHA-256 of a PEM certificate's DER, as the report gives it.
fn fingerprint(pem: &str) -> String {
    let der = pem::parse(pem).expect("a PEM certificate").into_contents();
    common::sha256_hex(&der)
}

/// The report on Node `name`, parsed, when there is one.
fn report(cluster: &Cluster, name: &str) -> Option<Value> {
    let raw = cluster.node_annotation(name, HELD)?;
    Some(serde_json::from_str(&raw).expect("the report is JSON"))
}

/// The fingerprints the report says the bundle holds, and whether it is in sync.
fn bundle_held(report: &Value) -> (Vec<String>, bool) {
    let bundle = report["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["kind"] == "bundle")
        .expect("the bundle's entry");
    let certs = bundle["certs"]
        .as_array()
        .map(|a| a.iter().map(|c| c.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    (certs, bundle["inSync"] == true)
}

/// A cluster with the signers' ConfigMap holding `pem`, readable by `nodes`, each
/// registered as a Node when `registered`.
fn cluster_with(pem: &str, nodes: &[(&str, bool)]) -> Option<Cluster> {
    let cluster = Cluster::up()?;
    cluster.put_configmap(NS, NAME, &[(KEY, pem)]);
    for (node, registered) in nodes {
        cluster.grant_configmaps(
            NS,
            &[NAME],
            &["get", "list", "watch"],
            &format!("system:node:{node}"),
        );
        if *registered {
            cluster.create_node(node, None);
        }
    }
    Some(cluster)
}

/// An agent on `node` with `name`'s node credentials.
fn agent(cluster: &Cluster, node: &Node, name: &str, extra: &[&str]) -> Agent {
    let kubeconfig = cluster.node_kubeconfig(name);
    let mut args = vec!["--kubeconfig", kubeconfig.to_str().unwrap()];
    args.extend_from_slice(extra);
    let agent = Agent::start(node, &[SPEC], &args);
    agent.wait_listening();
    agent
}

/// The report's writes, whatever their cause.
fn writes(agent: &Agent) -> f64 {
    let (_, body) = agent.get("/metrics").unwrap_or_default();
    body.lines()
        .filter(|l| l.starts_with("kubelet_ca_node_report_writes_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_node_reports_what_it_holds_on_its_own_node_once_per_change() {
    let a = Signer::new("signer-a", Algorithm::P256).pem();
    let b = Signer::new("signer-b", Algorithm::P256).pem();
    let Some(cluster) = cluster_with(&a, &[("worker-1", true)]) else {
        return;
    };
    let node = Node::new();
    let agent = agent(&cluster, &node, "worker-1", &[]);
    wait_until(20 * SECOND, || node.holds(&a));

    // After the first pass: the bundle's certificates, in sync, with nothing secret.
    assert!(
        eventually(10 * SECOND, || report(&cluster, "worker-1")
            .is_some_and(|r| bundle_held(&r) == (vec![fingerprint(&a)], true))),
        "no report of the bundle on Node worker-1: {:?}\n{}",
        cluster.node_annotation("worker-1", HELD),
        agent.log()
    );
    let first = report(&cluster, "worker-1").unwrap();
    assert_eq!(first["v"], 1);
    let raw = cluster.node_annotation("worker-1", HELD).unwrap();
    assert!(!raw.contains("BEGIN"), "{raw}");
    assert!(raw.len() <= 16 * 1024);
    assert_eq!(
        first["targets"][0]["path"],
        node.bundle().display().to_string()
    );
    let verbose = agent.get("/readyz?verbose").unwrap().1;
    assert_eq!(
        check_line(&verbose, "node-report"),
        "[+]node-report ok",
        "{verbose}"
    );

    // Idle: nothing written.
    let before = writes(&agent);
    assert!(before >= 1.0);
    std::thread::sleep(3 * SECOND);
    assert_eq!(writes(&agent), before, "written while idle");

    // A rotation: one more write, with what the node now holds.
    cluster.put_configmap(NS, NAME, &[(KEY, &format!("{a}{b}"))]);
    assert!(
        eventually(10 * SECOND, || report(&cluster, "worker-1").is_some_and(
            |r| bundle_held(&r) == (vec![fingerprint(&a), fingerprint(&b)], true)
        )),
        "the report did not follow the rotation: {:?}\n{}",
        cluster.node_annotation("worker-1", HELD),
        agent.log()
    );
    std::thread::sleep(2 * SECOND);
    assert_eq!(writes(&agent), before + 1.0, "one write per change");
    let second = report(&cluster, "worker-1").unwrap();
    assert_ne!(second["changed"], Value::Null);
    assert_eq!(
        agent.sample(
            "kubelet_ca_node_report_errors_total",
            &[("reason", "forbidden")]
        ),
        Some(0.0)
    );

    // `kubectl describe node` shows what changed, as an Event on the Node.
    let changed = wait_for_event(&cluster, "worker-1", "CAFileChanged", "added signer-b");
    assert_eq!(changed["type"], "Normal");
    let note = changed["note"].as_str().unwrap();
    assert!(
        note.contains("now holds 2 certificate(s); added signer-b"),
        "{note}"
    );
    // A rejected update (a private key in it) is a Warning; the bundle stays.
    let key = Signer::new("signer-c", Algorithm::P256).key_pem();
    cluster.put_configmap(NS, NAME, &[(KEY, &format!("{a}{key}"))]);
    let rejected = wait_for_event(&cluster, "worker-1", "SourceRejected", "");
    assert_eq!(rejected["type"], "Warning");
    let note = rejected["note"].as_str().unwrap();
    assert!(note.contains("the last good content is kept"), "{note}");
    let body = key.lines().nth(1).unwrap();
    assert!(
        !note.contains("-----BEGIN") && !note.contains(body),
        "{note}"
    );
    assert!(node.holds(format!("{a}{b}")));
}

/// The Event of `reason` about Node `name` whose message holds `says`, once it is there
/// (10 s at most).
fn wait_for_event(cluster: &Cluster, name: &str, reason: &str, says: &str) -> Value {
    let mut found = None;
    let path = format!(
        "/apis/events.k8s.io/v1/namespaces/default/events?fieldSelector=regarding.name={name}"
    );
    eventually(10 * SECOND, || {
        let (_, list) = cluster.request("GET", &path, None);
        found = list["items"].as_array().and_then(|items| {
            items
                .iter()
                .find(|e| e["reason"] == reason && e["note"].as_str().unwrap_or("").contains(says))
                .cloned()
        });
        found.is_some()
    });
    found.unwrap_or_else(|| {
        let (_, list) = cluster.request("GET", &path, None);
        let (_, all) = cluster.request("GET", "/apis/events.k8s.io/v1/events", None);
        panic!("no {reason} event about Node {name}: {list}\nall: {all}")
    })
}

#[test]
fn credentials_that_name_one_node_cannot_write_another_nodes_report() {
    let a = Signer::new("signer-a", Algorithm::P256).pem();
    let Some(cluster) = cluster_with(&a, &[("worker-1", true), ("worker-2", true)]) else {
        return;
    };
    let node = Node::new();
    // worker-1's credentials, told to report as worker-2.
    let agent = agent(&cluster, &node, "worker-1", &["--node-name", "worker-2"]);
    wait_until(20 * SECOND, || node.holds(&a));
    agent.wait_sample(
        10 * SECOND,
        "kubelet_ca_node_report_errors_total",
        &[("reason", "forbidden")],
        |v| v >= 1.0,
    );
    // The real API server refused it (the watch of worker-2, and so any write): worker-2 holds no report, the bundle and readiness
    // are as they would be, and health says why, not counted.
    assert_eq!(cluster.node_annotation("worker-2", HELD), None);
    assert_eq!(cluster.node_annotation("worker-1", HELD), None);
    let (code, verbose) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200, "{verbose}");
    let line = check_line(&verbose, "node-report");
    assert!(
        line.starts_with("[-]node-report failed: ") && line.ends_with("(not counted)"),
        "{line}"
    );
    assert!(line.contains("403"), "{line}");
    let log = agent.log();
    assert!(
        log.contains("a node may read and write only its own Node"),
        "{log}"
    );
    // Said once at start: the name given is not the one the credentials name.
    assert_eq!(
        log.matches("--node-name worker-2 is not the node the credentials name (worker-1)")
            .count(),
        1,
        "{log}"
    );
}

/// One name for the node (issue 39): on a host whose name is not the Node's, the Node the
/// credentials name is the node of the log and of the metrics' label, as of its report.
#[test]
fn the_node_is_named_as_its_credentials_name_it_whatever_the_host_is_called() {
    let a = Signer::new("signer-a", Algorithm::P256).pem();
    let Some(cluster) = cluster_with(&a, &[("worker-1", true)]) else {
        return;
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_ne!(
        host.trim(),
        "worker-1",
        "the test needs a host not named worker-1"
    );
    let node = Node::new();
    let agent = agent(&cluster, &node, "worker-1", &[]);
    wait_until(20 * SECOND, || report(&cluster, "worker-1").is_some());
    assert_eq!(
        agent.sample("kubelet_ca_agent_build_info", &[("node", "worker-1")]),
        Some(1.0)
    );
    let log = agent.log();
    let starting = log
        .lines()
        .find(|l| l.contains(" starting "))
        .unwrap_or_default();
    assert!(starting.contains("node=\"worker-1\""), "{log}");
    assert!(!log.contains(&format!("node=\"{}\"", host.trim())), "{log}");
    assert!(
        !log.contains("is not the node the credentials name"),
        "{log}"
    );
}

#[test]
fn a_node_that_does_not_exist_yet_is_waited_for_and_then_reported() {
    let a = Signer::new("signer-a", Algorithm::P256).pem();
    let Some(cluster) = cluster_with(&a, &[("worker-3", false)]) else {
        return;
    };
    let node = Node::new();
    let agent = agent(&cluster, &node, "worker-3", &[]);
    // The bundle does not wait for the Node.
    wait_until(20 * SECOND, || node.holds(&a));
    // Pending, never failed, while the kubelet has not registered it.
    let verbose = || agent.get("/readyz?verbose").unwrap().1;
    assert!(
        eventually(10 * SECOND, || check_line(&verbose(), "node-report")
            .starts_with(
                "[?]node-report pending: waiting for the Node to exist"
            )),
        "{}",
        verbose()
    );
    assert!(
        !agent
            .log()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("report")),
        "a missing Node is waited for quietly\n{}",
        agent.log()
    );
    // The kubelet registers it: the report follows within the backoff.
    cluster.create_node("worker-3", None);
    assert!(
        eventually(40 * SECOND, || report(&cluster, "worker-3").is_some()),
        "no report after the Node was registered\n{}",
        agent.log()
    );
}

#[test]
fn an_agent_restarted_on_an_unchanged_node_writes_nothing() {
    let a = Signer::new("signer-a", Algorithm::P256).pem();
    let Some(cluster) = cluster_with(&a, &[("worker-4", true)]) else {
        return;
    };
    let node = Node::new();
    let mut first = agent(&cluster, &node, "worker-4", &[]);
    assert!(eventually(20 * SECOND, || report(&cluster, "worker-4").is_some()));
    let rv = cluster.node("worker-4").unwrap()["metadata"]["resourceVersion"].clone();
    let changed = report(&cluster, "worker-4").unwrap()["changed"].clone();
    first.terminate();

    let second = agent(&cluster, &node, "worker-4", &[]);
    let verbose = || second.get("/readyz?verbose").unwrap().1;
    assert!(
        eventually(15 * SECOND, || check_line(&verbose(), "node-report")
            == "[+]node-report ok"),
        "{}\n{}",
        verbose(),
        second.log()
    );
    assert_eq!(writes(&second), 0.0);
    let node_now = cluster.node("worker-4").unwrap();
    assert_eq!(node_now["metadata"]["resourceVersion"], rv);
    assert_eq!(report(&cluster, "worker-4").unwrap()["changed"], changed);
}

#[test]
fn a_managed_kubeconfig_is_reported_with_the_kubelets_restart_after_it_gained_a_ca() {
    let a = Signer::new("signer-a", Algorithm::P256).pem();
    let Some(cluster) = cluster_with(&a, &[("worker-5", true), ("worker-6", true)]) else {
        return;
    };
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let cluster_ca = cluster.ca_pem();
    let next_ca = Signer::new("next-apiserver-ca", Algorithm::P256).pem();
    // (the node, its hook, what the report must say of the restart)
    for (name, hook, restart) in [
        ("worker-5", "true", "done"),
        ("worker-6", "false", "failed"),
    ] {
        let node = Node::new();
        // A kubeconfig of the node's own, trusting the cluster CA, whose CA data the agent
        // keeps from a file source that also holds the next CA.
        let kubeconfig = node.root().join("kubelet.kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority-data: {}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n",
                cluster.url,
                b64(&cluster_ca)
            ),
        )
        .unwrap();
        let cas = node.source("apiserver-cas.pem", format!("{cluster_ca}{next_ca}"));
        let manage = format!("{}={cas}", kubeconfig.display());
        let agent = agent(
            &cluster,
            &node,
            name,
            &[
                "--manage-kubeconfig",
                &manage,
                "--kubeconfig-hook",
                &format!("sh -c {hook}"),
            ],
        );
        let entry = || {
            report(&cluster, name).and_then(|r| {
                r["targets"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|t| t["kind"] == "kubeconfig")
                    .cloned()
            })
        };
        assert!(
            eventually(20 * SECOND, || entry()
                .is_some_and(|t| t["restart"] == restart)),
            "{name}: {:?}\n{}",
            entry(),
            agent.log()
        );
        let entry = entry().unwrap();
        assert_eq!(entry["path"], kubeconfig.display().to_string());
        assert_eq!(
            entry["certs"],
            serde_json::json!([fingerprint(&cluster_ca), fingerprint(&next_ca)])
        );
        // Nothing of the kubeconfig but its certificates.
        let raw = cluster.node_annotation(name, HELD).unwrap();
        assert!(!raw.contains(&cluster.url), "{raw}");
    }
}

/// The report kept like a file (issue 38): removed, edited into a lie, or lost with a Node
/// deleted and registered again, the true report is back within 5 s each time, each repair
/// counted by its cause and logged once; and idle, the agent writes nothing and asks nothing
/// about nodes beyond its open watch.
#[test]
fn the_report_is_put_back_when_removed_edited_or_the_node_registered_again() {
    let a = Signer::new("signer-a", Algorithm::P256).pem();
    let Some(cluster) = cluster_with(&a, &[("worker-7", true)]) else {
        return;
    };
    let node = Node::new();
    let agent = agent(&cluster, &node, "worker-7", &[]);
    let truth = || report(&cluster, "worker-7");
    assert!(
        eventually(20 * SECOND, || truth()
            .is_some_and(|r| bundle_held(&r) == (vec![fingerprint(&a)], true))),
        "no report\n{}",
        agent.log()
    );
    let written = truth().unwrap();
    // Written as the agent's own field manager, as `kubectl get node -o yaml` shows.
    let managed = cluster.node("worker-7").unwrap()["metadata"]["managedFields"].clone();
    assert!(
        managed
            .as_array()
            .is_some_and(|m| m.iter().any(|f| f["manager"] == "kubelet-ca-agent")),
        "{managed}"
    );
    std::thread::sleep(2 * SECOND);

    // 30 idle seconds: no write, and no request on nodes but the open watch.
    let (requests, writes_before) = (cluster.requests_on("nodes"), writes(&agent));
    std::thread::sleep(30 * SECOND);
    let after = cluster.requests_on("nodes");
    // (A watch is counted when it ends; the agent's list is there.)
    assert!(
        requests.get("LIST").is_some_and(|n| *n >= 1.0),
        "the API server's metrics show no list of nodes: {requests:?}"
    );
    let asked = |by: &std::collections::BTreeMap<String, f64>| -> f64 {
        by.iter()
            .filter(|(verb, _)| *verb != "WATCH")
            .map(|(_, n)| n)
            .sum()
    };
    assert_eq!(
        asked(&after),
        asked(&requests),
        "requests on nodes while idle: before {requests:?}, after {after:?}"
    );
    assert_eq!(writes(&agent), writes_before, "written while idle");

    // Removed, then edited into a lie (the node out of sync), then the Node deleted and
    // registered again: each time the true report is back within 5 s.
    let back_within = |what: &str, limit: Duration| {
        let started = std::time::Instant::now();
        assert!(
            eventually(limit, || truth().as_ref() == Some(&written)),
            "the report was not put back within {limit:?} after it was {what}: {:?}\n{}",
            cluster.node_annotation("worker-7", HELD),
            agent.log()
        );
        eprintln!("{what}: put back in {:?}", started.elapsed());
    };
    cluster.set_held("worker-7", None);
    back_within("removed", 5 * SECOND);
    let mut lie = written.clone();
    lie["targets"][0]["inSync"] = Value::Bool(false);
    lie["targets"][0]["reason"] = Value::String("edited by someone".into());
    cluster.set_held("worker-7", Some(&lie.to_string()));
    back_within("edited", 5 * SECOND);
    let uid = cluster.node("worker-7").unwrap()["metadata"]["uid"].clone();
    let (code, answer) = cluster.request("DELETE", "/api/v1/nodes/worker-7", None);
    assert_eq!(code, 200, "{answer}");
    cluster.create_node("worker-7", None);
    back_within("lost with the Node registered again", 5 * SECOND);
    assert_ne!(cluster.node("worker-7").unwrap()["metadata"]["uid"], uid);

    // Each repair counted by its cause, and said once in the log.
    for cause in ["removed", "edited", "registered"] {
        assert_eq!(
            agent.sample("kubelet_ca_node_report_writes_total", &[("cause", cause)]),
            Some(1.0),
            "{cause}\n{}",
            agent.log()
        );
    }
    let log = agent.log();
    assert_eq!(
        log.matches("put this node's report back on its Node")
            .count(),
        3,
        "{log}"
    );
    assert_eq!(
        check_line(&agent.get("/readyz?verbose").unwrap().1, "node-report"),
        "[+]node-report ok"
    );
}
