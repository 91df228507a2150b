//! `publish` against a local API server that answers server-side apply as kube-apiserver
//! does: the derived ConfigMap is created from a ControllerConfig and follows its bundle,
//! is written only when the bundle changes (its resourceVersion says so), keeps the last good
//! bundle through bad input, survives deletion and hand edits, stays correct with two
//! replicas, and a node agent watching it follows a rotation end to end.

mod common;

use std::time::Duration;

use base64::Engine;
use common::apiserver::{ApiServer, Rule};
use common::daemon::{Agent, wait_until};
use common::pki::{Algorithm, Signer};
use common::{Node, sha256_hex, stderr};
use serde_json::Value;

const SECOND: Duration = Duration::from_secs(1);
const CC: &str = "machine-config-controller";
const NS: &str = "openshift-machine-config-operator";
const NAME: &str = "kubelet-ca-bundle";
const TO: &str = "openshift-machine-config-operator/kubelet-ca-bundle";
const KEY: &str = "ca-bundle.crt";
const SHA_ANNOTATION: &str = "kubelet-ca-agent.io/bundle-sha256";

fn b64(pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(pem)
}

fn publish_command() -> std::process::Command {
    let mut cmd = std::process::Command::new(common::agent_bin());
    cmd.arg("publish")
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG");
    cmd
}

fn publisher(node: &Node, api: &ApiServer, extra: &[&str]) -> Agent {
    Agent::publish(node.root(), api.kubeconfig(), TO, &[], extra)
}

/// The derived ConfigMap's bundle, if it exists.
fn published(api: &ApiServer) -> Option<String> {
    let cm = api.configmap(NS, NAME)?;
    cm.pointer(&format!("/data/{KEY}"))
        .and_then(Value::as_str)
        .map(str::to_string)
}

fn rv(api: &ApiServer) -> u64 {
    api.configmap(NS, NAME)
        .and_then(|cm| cm["metadata"]["resourceVersion"].as_str()?.parse().ok())
        .expect("the ConfigMap exists")
}

fn annotation(api: &ApiServer, name: &str) -> Option<String> {
    api.configmap(NS, NAME)?
        .pointer("/metadata/annotations")?
        .get(name)?
        .as_str()
        .map(str::to_string)
}

/// Waits until the ConfigMap holds exactly `pem`.
fn wait_published(api: &ApiServer, limit: Duration, pem: &str) -> Duration {
    wait_until(limit, || published(api).as_deref() == Some(pem))
}

/// A local API server with a ControllerConfig carrying `signer`, and a publisher that has
/// published it.
fn publishing(signer: &Signer) -> (ApiServer, Node, Agent) {
    let api = ApiServer::start();
    let node = Node::new();
    api.put_controllerconfig(CC, &b64(&signer.pem()));
    let agent = publisher(&node, &api, &[]);
    wait_published(&api, 10 * SECOND, &signer.pem());
    agent.wait_listening();
    (api, node, agent)
}

#[test]
fn a_controllerconfig_creates_the_configmap_and_a_bundle_change_updates_it() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::Rsa),
        Signer::new("kube-apiserver-localhost-signer", Algorithm::P256),
    );
    api.put_controllerconfig(CC, &b64(&a.pem()));
    let agent = publisher(&node, &api, &[]);
    wait_published(&api, 10 * SECOND, &a.pem());
    assert_eq!(
        annotation(&api, SHA_ANNOTATION),
        Some(sha256_hex(a.pem().as_bytes())),
        "the SHA-256 annotation describes the content"
    );
    assert_eq!(
        annotation(&api, "kubelet-ca-agent.io/sources").as_deref(),
        Some("controllerconfig:machine-config-controller")
    );
    let cm = api.configmap(NS, NAME).unwrap();
    let managers: Vec<&str> = cm["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["operation"] == "Apply")
        .filter_map(|m| m["manager"].as_str())
        .collect();
    assert_eq!(managers, ["kubelet-ca-agent-publisher"], "{cm}");

    let both = a.pem() + &b.pem();
    api.put_controllerconfig(CC, &b64(&both));
    let took = wait_published(&api, 2 * SECOND, &both);
    eprintln!("a ControllerConfig rotation reached the ConfigMap in {took:?}");
    agent.wait_listening();
    agent.wait_metric(SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    assert_eq!(
        agent.sample(
            "kubelet_ca_bundle_certificates",
            &[(
                "filepath",
                "configmap:openshift-machine-config-operator/kubelet-ca-bundle/ca-bundle.crt"
            )]
        ),
        Some(2.0)
    );
    assert_eq!(agent.metric("kubelet_ca_writes_total{"), Some(2.0));
    let (code, ready) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200, "{ready}");
    assert!(
        !ready.contains("file-watch"),
        "a publisher watches no file: {ready}"
    );
}

#[test]
fn an_unrelated_controllerconfig_change_leaves_the_configmap_alone() {
    let a = Signer::new("signer-a", Algorithm::P256);
    let (api, _node, agent) = publishing(&a);
    let before = rv(&api);
    let patches = || {
        api.requests()
            .iter()
            .filter(|r| r.method == "PATCH")
            .count()
    };
    let applies = patches();
    for _ in 0..3 {
        api.touch_controllerconfig(CC);
    }
    std::thread::sleep(SECOND);
    assert_eq!(
        rv(&api),
        before,
        "the ConfigMap was written for an unrelated change"
    );
    assert_eq!(patches(), applies, "an unchanged bundle was applied again");
    assert!(agent.log().contains("published"), "{}", agent.log());
}

#[test]
fn bad_base64_a_private_key_or_only_expired_signers_keep_the_last_bundle() {
    let a = Signer::new("signer-a", Algorithm::P256);
    let (api, _node, agent) = publishing(&a);
    let before = rv(&api);

    let expired = Signer::valid_between(
        "expired",
        Algorithm::P256,
        time::Duration::days(-3),
        time::Duration::days(-1),
    );
    let key = a.key_pem();
    for (bad, reason) in [
        ("not base64 at all!".to_string(), "bad_base64"),
        (b64(&(a.pem() + &key)), "private_key"),
    ] {
        api.put_controllerconfig(CC, &bad);
        wait_until(5 * SECOND, || {
            agent
                .sample("kubelet_ca_source_errors_total", &[("reason", reason)])
                .is_some_and(|v| v >= 1.0)
        });
        assert_eq!(agent.metric("kubelet_ca_source_up{"), Some(0.0));
    }
    api.put_controllerconfig(CC, &b64(&expired.pem()));
    wait_until(5 * SECOND, || {
        agent
            .sample(
                "kubelet_ca_sync_errors_total",
                &[("reason", "no_valid_certificate")],
            )
            .is_some_and(|v| v >= 1.0)
    });
    std::thread::sleep(SECOND / 2);
    assert_eq!(rv(&api), before, "bad input reached the ConfigMap");
    assert_eq!(published(&api), Some(a.pem()));
    assert!(
        !agent.log().contains("PRIVATE KEY-----"),
        "key material in the log"
    );

    // Good input again: published.
    let b = Signer::new("signer-b", Algorithm::Rsa);
    api.put_controllerconfig(CC, &b64(&b.pem()));
    wait_published(&api, 2 * SECOND, &b.pem());
}

#[test]
fn two_publishers_change_the_configmap_exactly_once_per_bundle_change() {
    let api = ApiServer::start();
    let node = Node::new();
    let first = Signer::new("signer-0", Algorithm::P256);
    api.put_controllerconfig(CC, &b64(&first.pem()));
    let one = publisher(&node, &api, &[]);
    wait_published(&api, 10 * SECOND, &first.pem());
    // The second starts on a ConfigMap that exists: two replicas creating it at the same
    // instant would both count the creation (an apply that creates has no precondition).
    let two = publisher(&node, &api, &[]);
    one.wait_listening();
    two.wait_listening();
    two.wait_metric(5 * SECOND, "kubelet_ca_bundle_in_sync{", 1.0);

    let mut previous = first;
    for round in 1..=20 {
        let next = Signer::new(&format!("signer-{round}"), Algorithm::P256);
        let bundle = previous.pem() + &next.pem();
        let cc_rv = api.put_controllerconfig(CC, &b64(&bundle));
        wait_published(&api, 2 * SECOND, &bundle);
        // Both replicas have seen it and applied (or found it applied) before the next.
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(
            rv(&api),
            cc_rv + 1,
            "round {round}: the ConfigMap changed more than once (or not right after the ControllerConfig)"
        );
        assert_eq!(
            api.resource_version(),
            cc_rv + 1,
            "round {round}: another write happened"
        );
        previous = next;
    }
    for agent in [&one, &two] {
        agent.wait_metric(SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    }
    let writes: f64 = [&one, &two]
        .iter()
        .map(|a| a.metric("kubelet_ca_writes_total{").unwrap_or(0.0))
        .sum();
    // The creation plus 20 changes; an apply that changed nothing is not a write.
    assert_eq!(writes, 21.0, "{}\n{}", one.log(), two.log());
    let lost = |a: &Agent| a.log().matches("looking again").count();
    eprintln!(
        "applies that found the ConfigMap already moved by the other replica: {} and {}",
        lost(&one),
        lost(&two)
    );
}

#[test]
fn a_deleted_or_hand_edited_configmap_is_published_again() {
    let a = Signer::new("signer-a", Algorithm::P256);
    let (api, _node, agent) = publishing(&a);

    api.delete_configmap(NS, NAME);
    let took = wait_published(&api, 5 * SECOND, &a.pem());
    eprintln!("a deleted ConfigMap was published again in {took:?}");

    let intruder = Signer::new("intruder", Algorithm::P256);
    api.edit_configmap_as("kubectl-edit", NS, NAME, &[(KEY, &intruder.pem())], &[]);
    wait_published(&api, 5 * SECOND, &a.pem());
    agent.wait_metric(5 * SECOND, "kubelet_ca_repairs_total{", 2.0);
    assert!(agent.log().contains("does not match"), "{}", agent.log());
}

#[test]
fn a_node_agent_watching_the_derived_configmap_follows_a_rotation_end_to_end() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::Rsa),
        Signer::new("kube-apiserver-lb-signer-2", Algorithm::Rsa),
    );
    api.put_controllerconfig(CC, &b64(&a.pem()));
    let _publisher = publisher(&node, &api, &[]);
    let agent = Agent::start(
        &node,
        &[&format!("configmap:{TO}")],
        &["--kubeconfig", api.kubeconfig().to_str().unwrap()],
    );
    wait_until(10 * SECOND, || node.holds(a.pem()));

    let both = a.pem() + &b.pem();
    api.put_controllerconfig(CC, &b64(&both));
    let took = wait_until(3 * SECOND, || node.holds(&both));
    eprintln!("ControllerConfig -> derived ConfigMap -> node file in {took:?}");
    api.put_controllerconfig(CC, &b64(&b.pem()));
    wait_until(3 * SECOND, || node.holds(b.pem()));
    agent.wait_metric(SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
}

#[test]
fn the_publisher_needs_only_its_objects_by_name() {
    let api = ApiServer::start();
    let node = Node::new();
    let a = Signer::new("signer-a", Algorithm::P256);
    api.put_controllerconfig(CC, &b64(&a.pem()));
    // The Role and ClusterRole of deploy/overlays/openshift-publisher.
    api.restrict_to(vec![
        Rule::new(
            &["get", "list", "watch"],
            "machineconfiguration.openshift.io",
            "controllerconfigs",
            None,
            &[CC],
        ),
        Rule::new(
            &["get", "list", "watch", "patch", "create"],
            "",
            "configmaps",
            Some(NS),
            &[NAME],
        ),
    ]);
    let agent = publisher(&node, &api, &[]);
    wait_published(&api, 10 * SECOND, &a.pem());
    agent.wait_listening();
    agent.wait_metric(SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    assert!(!agent.log().contains("forbidden"), "{}", agent.log());
}

#[test]
fn once_publishes_then_finds_it_published_and_fails_clearly() {
    let api = ApiServer::start();
    let a = Signer::new("signer-a", Algorithm::P256);
    api.put_controllerconfig(CC, &b64(&a.pem()));
    let once = || {
        publish_command()
            .args(["--to", TO, "--once", "--kubeconfig"])
            .arg(api.kubeconfig())
            .output()
            .unwrap()
    };
    let out = once();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("published"), "{}", stderr(&out));
    assert_eq!(published(&api), Some(a.pem()));
    let before = rv(&api);

    let out = once();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("already published"),
        "{}",
        stderr(&out)
    );
    assert_eq!(rv(&api), before);

    api.put_controllerconfig(CC, &b64(&(a.pem() + &a.key_pem())));
    let out = once();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("PRIVATE KEY"), "{}", stderr(&out));
    assert!(stderr(&out).contains("left as it was"), "{}", stderr(&out));
    assert_eq!(rv(&api), before);

    let out = publish_command()
        .args(["--to", "bad namespace/x", "--once"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = publish_command()
        .args(["--to", TO, "--source", "file:/etc/x.pem", "--once"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cluster sources only"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn the_publishers_metrics_are_guarded_like_the_node_agents() {
    let api = ApiServer::start();
    let node = Node::new();
    let a = Signer::new("signer-a", Algorithm::P256);
    api.put_controllerconfig(CC, &b64(&a.pem()));
    // No --insecure-metrics, no client CA, no token webhook: /metrics answers nobody.
    let agent = Agent::publish_with(node.root(), api.kubeconfig(), TO, &[], &[], |cmd| {
        cmd.env_remove("KUBELET_CA_AGENT_INSECURE_METRICS");
    });
    wait_published(&api, 10 * SECOND, &a.pem());
    agent.wait_listening();
    wait_until(5 * SECOND, || {
        agent.get("/readyz").is_some_and(|(code, _)| code == 200)
    });
    let (code, body) = agent.get("/metrics").unwrap();
    assert_eq!(code, 401, "{body}");
    assert_eq!(agent.get("/livez").map(|(code, _)| code), Some(200));
    assert!(
        agent.log().contains("answers 401 to everyone"),
        "{}",
        agent.log()
    );
}
