//! Issue 37 (SPEC 8c, 13 layers 3 and 4): a taken-over agent holds no borrowed identity.
//! The DaemonSet writes its node's report with the pod's own service account token, which
//! the API server (1.30 and later) binds to the Pod and to its node
//! (`authentication.kubernetes.io/node-name`), and RBAC's grant of `patch` on nodes is
//! confined by the ValidatingAdmissionPolicies shipped beside it.
//!
//! Against the real API server of `../shared/tools/kube-apiserver/cluster` (v1.32, Node
//! authorizer, NodeRestriction), with the kubeadm overlay applied exactly as
//! `kubectl kustomize` renders it (namespace, service account, RBAC, policies and their
//! bindings): the token of a pod on node A may write A's `kubelet-ca-agent/held`
//! annotation and record Events about A, and nothing else (another Node, a label, another
//! annotation, the spec, the status, a Node created or deleted, an Event about B); a token
//! bound to no Pod writes no Node at all; the namespace admits the DaemonSet's own pod and
//! refuses one that mounts the kubelet's directory. Then the agent itself, with that token
//! as its in-cluster credentials and no kubelet key, reports on A.

mod common;

use std::fs;
use std::process::Command;
use std::time::Duration;

use common::daemon::{Agent, eventually};
use common::real_cluster::{Cluster, env_value, object, render};
use common::{Node, is_root, require};
use serde_json::{Value, json};

const NS: &str = "kubelet-ca-agent";
const SA: &str = "kubelet-ca-agent";
const HELD: &str = "kubelet-ca-agent/held";
const NODE_NAME: &str = "authentication.kubernetes.io/node-name";
const A: &str = "worker-a";
const B: &str = "worker-b";
/// Another annotation each Node carries, which the agent's token may not touch.
const OTHER: &str = "example.com/owner";
const SECOND: Duration = Duration::from_secs(1);

/// A Node as admin, with its labels and another owner's annotation.
fn create_node(cluster: &Cluster, name: &str) {
    let body = json!({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "labels": {"pool": "test"}, "annotations": {OTHER: "ops"}}});
    let (code, answer) = cluster.request("POST", "/api/v1/nodes", Some(&body));
    assert_eq!(code, 201, "create node {name}: {answer}");
}

/// The Node `name` as admin reads it.
fn node(cluster: &Cluster, name: &str) -> Value {
    cluster.node(name).unwrap_or_else(|| panic!("node {name}"))
}

/// A core/v1 Event about Node `about`, from `component`, as the agent records it.
fn event(about: &str, component: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": format!("{about}."), "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": about, "uid": about},
        "reason": "CAFileChanged", "action": "Replace", "type": "Normal",
        "message": "/etc/kubernetes/kubelet-ca.crt now holds 1 certificate(s)",
        "source": {"component": component, "host": A},
        "reportingComponent": component, "reportingInstance": A})
}

/// The user `token` authenticates as (a SelfSubjectReview).
fn who(cluster: &Cluster, token: &str) -> Value {
    let review = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"});
    let (code, answer) = cluster.request_with_token(
        token,
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        Some(&review),
    );
    assert_eq!(code, 201, "SelfSubjectReview: {answer}");
    answer["status"]["userInfo"].clone()
}

/// A refusal: 403 (RBAC, or the policy's Forbidden) or 422 (the policy's Invalid), never
/// a success.
fn refused(what: &str, (code, answer): (u16, Value)) -> String {
    assert!(
        code == 403 || code == 422,
        "{what}: expected a refusal, got {code} {answer}"
    );
    answer["message"].as_str().unwrap_or_default().to_string()
}

#[test]
fn the_agents_token_writes_its_own_nodes_report_and_nothing_else() {
    if !require(is_root(), "a mount namespace needs root")
        || !require(
            Command::new("unshare").arg("--help").output().is_ok(),
            "unshare (util-linux) is not installed",
        )
    {
        return;
    }
    let Some(rendered) = render("deploy/overlays/kubeadm") else {
        return;
    };
    let Some(cluster) = Cluster::up() else {
        return;
    };

    // --- The kustomization's identity, RBAC and policies, exactly as rendered ----------
    let applied = cluster.apply_identity(&rendered);
    for kind in [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert_eq!(
            applied.iter().filter(|o| o["kind"] == kind).count(),
            3,
            "the node report's, the Events' and the pods' {kind}s"
        );
    }

    // --- Two nodes, and the agent's pod on A (the DaemonSet's template; it never runs) --
    create_node(&cluster, A);
    create_node(&cluster, B);
    let daemonset = object(&rendered, "DaemonSet", "kubelet-ca-agent");
    let template = &daemonset["spec"]["template"];
    let uid = cluster.daemonset_pod(daemonset, "kubelet-ca-agent-a", A);

    // The token the kubelet would project into it, and one bound to nothing.
    let token = cluster.service_account_token(NS, SA, Some(("kubelet-ca-agent-a", &uid)));
    let unbound = cluster.service_account_token(NS, SA, None);
    let user = who(&cluster, &token);
    assert_eq!(
        user["username"],
        format!("system:serviceaccount:{NS}:{SA}"),
        "{user}"
    );
    assert_eq!(user["extra"][NODE_NAME], json!([A]), "{user}");
    assert!(
        who(&cluster, &unbound)["extra"][NODE_NAME].is_null(),
        "a token bound to no Pod names no node"
    );

    // Policies take a moment to load: until then RBAC alone lets the token patch B. Ask
    // until the policy refuses it (bounded), then put B back as it was.
    let a = format!("/api/v1/nodes/{A}");
    let b = format!("/api/v1/nodes/{B}");
    let held = |value: &str| json!({"metadata": {"annotations": {HELD: value}}});
    assert!(
        eventually(30 * SECOND, || {
            let (code, _) = cluster.request_with_token(&token, "PATCH", &b, Some(&held("probe")));
            code == 403
        }),
        "the ValidatingAdmissionPolicy kubelet-ca-agent-node-report never took effect"
    );
    cluster.set_held(B, None);
    let before_a = node(&cluster, A);
    let before_b = node(&cluster, B);

    // --- With the token of the pod on A -------------------------------------------------
    // Its own report: yes.
    let report = r#"{"v":1,"targets":[]}"#;
    let (code, answer) = cluster.request_with_token(&token, "PATCH", &a, Some(&held(report)));
    assert_eq!(code, 200, "A's pod writes A's report: {answer}");
    assert_eq!(cluster.node_annotation(A, HELD).as_deref(), Some(report));
    // Another Node's report: no.
    let message = refused(
        "B's report",
        cluster.request_with_token(&token, "PATCH", &b, Some(&held(report))),
    );
    assert!(message.contains("its own Node only"), "{message}");
    // Anything else of its own Node: no.
    let attempts = [
        (
            "a label",
            json!({"metadata": {"labels": {"pool": "attacker"}}}),
        ),
        (
            "a new label",
            json!({"metadata": {"labels": {"extra": "1"}}}),
        ),
        (
            "another annotation",
            json!({"metadata": {"annotations": {OTHER: "attacker"}}}),
        ),
        (
            "a new annotation",
            json!({"metadata": {"annotations": {"example.com/new": "1"}}}),
        ),
        (
            "another annotation removed",
            json!({"metadata": {"annotations": {OTHER: null}}}),
        ),
        ("the spec", json!({"spec": {"unschedulable": true}})),
        (
            "a taint",
            json!({"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}}),
        ),
        (
            "a finalizer",
            json!({"metadata": {"finalizers": ["example.com/hold"]}}),
        ),
        (
            "a report over 16 KiB",
            held(&format!(r#"{{"v":1,"x":"{}"}}"#, "x".repeat(17 * 1024))),
        ),
    ];
    for (what, patch) in &attempts {
        refused(
            what,
            cluster.request_with_token(&token, "PATCH", &a, Some(patch)),
        );
    }
    refused(
        "the status",
        cluster.request_with_token(
            &token,
            "PATCH",
            &format!("{a}/status"),
            Some(&json!({"status": {"capacity": {"cpu": "64"}}})),
        ),
    );
    refused(
        "a Node created",
        cluster.request_with_token(
            &token,
            "POST",
            "/api/v1/nodes",
            Some(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "worker-c"}})),
        ),
    );
    refused(
        "a Node deleted",
        cluster.request_with_token(&token, "DELETE", &b, None),
    );
    assert!(cluster.node("worker-c").is_none());
    // A and B are as they were, but for A's report.
    let mut expected_a = before_a.clone();
    expected_a["metadata"]["annotations"][HELD] = json!(report);
    for (name, before) in [(A, &expected_a), (B, &before_b)] {
        let now = node(&cluster, name);
        for field in ["labels", "annotations", "finalizers"] {
            assert_eq!(
                now["metadata"][field], before["metadata"][field],
                "Node {name}'s {field}"
            );
        }
        assert_eq!(now["spec"], before["spec"], "Node {name}'s spec");
        assert_eq!(now["status"], before["status"], "Node {name}'s status");
    }

    // Events: about A, from kubelet-ca-agent, yes; about B, or posing as the kubelet, no.
    let events = "/api/v1/namespaces/default/events";
    let (code, answer) =
        cluster.request_with_token(&token, "POST", events, Some(&event(A, "kubelet-ca-agent")));
    assert_eq!(code, 201, "an Event about A: {answer}");
    refused(
        "an Event about B",
        cluster.request_with_token(&token, "POST", events, Some(&event(B, "kubelet-ca-agent"))),
    );
    refused(
        "an Event as the kubelet",
        cluster.request_with_token(&token, "POST", events, Some(&event(A, "kubelet"))),
    );

    // --- A token bound to no Pod: no Node at all, no Event ------------------------------
    for path in [&a, &b] {
        let message = refused(
            "the unbound token's report",
            cluster.request_with_token(&unbound, "PATCH", path, Some(&held("unbound"))),
        );
        assert!(message.contains("names no node"), "{message}");
    }
    refused(
        "the unbound token's Event",
        cluster.request_with_token(
            &unbound,
            "POST",
            events,
            Some(&event(A, "kubelet-ca-agent")),
        ),
    );
    assert_eq!(cluster.node_annotation(A, HELD).as_deref(), Some(report));
    assert_eq!(cluster.node_annotation(B, HELD), None);

    // --- The namespace admits no pod that mounts what the agent must not hold ----------
    let mut spec = template["spec"].clone();
    spec["nodeName"] = json!(B);
    spec["volumes"].as_array_mut().unwrap().push(
        json!({"name": "kubelet", "hostPath": {"path": "/var/lib/kubelet", "type": "Directory"}}),
    );
    spec["containers"][0]["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "kubelet", "mountPath": "/var/lib/kubelet", "readOnly": true}));
    let greedy = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "kubelet-ca-agent-greedy", "namespace": NS}, "spec": spec});
    let message = refused(
        "a pod mounting /var/lib/kubelet",
        cluster.request(
            "POST",
            &format!("/api/v1/namespaces/{NS}/pods"),
            Some(&greedy),
        ),
    );
    assert!(message.contains("not /var/lib/kubelet"), "{message}");

    // --- The agent itself, with that token and no kubelet key ---------------------------
    agent_reports_with_the_pods_token(&cluster, daemonset, &token);
}

/// Runs `kubelet-ca-agent run` as the DaemonSet's pod does on A: in-cluster credentials
/// (KUBERNETES_SERVICE_HOST and _PORT, and the pod's token, CA and namespace in
/// /var/run/secrets/kubernetes.io/serviceaccount, laid out in a mount namespace of its
/// own), the rendered source, and no kubelet credentials anywhere; then A carries its
/// report.
fn agent_reports_with_the_pods_token(cluster: &Cluster, daemonset: &Value, token: &str) {
    // The DaemonSet's own source, read with the rendered Role, rather than a local file: an
    // agent whose sources are all local resolves no credentials at all, so its report is
    // off unless --report-kubeconfig names some (src/daemon/mod.rs, report_credentials).
    // kube-apiserver publishes this source itself (a post-start hook).
    let source = env_value(daemonset, "KUBELET_CA_AGENT_SOURCE");
    assert_eq!(
        source,
        "configmap:kube-system/extension-apiserver-authentication/client-ca-file"
    );
    assert!(
        eventually(20 * SECOND, || cluster
            .configmap("kube-system", "extension-apiserver-authentication")
            .is_some()),
        "the API server did not publish extension-apiserver-authentication"
    );
    cluster.set_held(A, None);

    let account = cluster.path("serviceaccount");
    fs::create_dir_all(&account).unwrap();
    fs::write(account.join("token"), token).unwrap();
    fs::write(account.join("ca.crt"), cluster.ca_pem()).unwrap();
    fs::write(account.join("namespace"), NS).unwrap();
    let port = cluster.url.rsplit(':').next().unwrap().to_string();
    // A tmpfs over /var/run (/run) in the agent's own mount namespace, the machine's left
    // as it is, and the service account's files where a pod has them.
    let wrapper = [
        "unshare",
        "-m",
        "sh",
        "-c",
        "mount --make-rprivate / && mount -t tmpfs -o size=1m tmpfs /var/run \
         && mkdir -p /var/run/secrets/kubernetes.io/serviceaccount \
         && mount --bind \"$SERVICE_ACCOUNT\" /var/run/secrets/kubernetes.io/serviceaccount \
         && exec \"$@\"",
        "sh",
    ];
    let node = Node::new();
    let agent = Agent::start_wrapped(&node, &[&source], &["--node-name", A], &wrapper, |cmd| {
        cmd.env("SERVICE_ACCOUNT", &account)
            .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
            .env("KUBERNETES_SERVICE_PORT", &port)
            .env_remove("KUBELET_CA_AGENT_REPORT_KUBECONFIG")
            .env_remove("KUBELET_CA_AGENT_KUBECONFIG");
    });
    agent.wait_listening();

    let reported = eventually(40 * SECOND, || cluster.node_annotation(A, HELD).is_some());
    assert!(
        reported,
        "the agent wrote no report on {A} with its pod's token:\n{}",
        agent.log()
    );
    let raw = cluster.node_annotation(A, HELD).unwrap();
    let report: Value = serde_json::from_str(&raw).expect("the report is JSON");
    assert_eq!(report["v"], 1, "{raw}");
    assert!(
        report["targets"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["kind"] == "bundle")),
        "{raw}"
    );
    assert_eq!(cluster.node_annotation(B, HELD), None, "nothing on {B}");
    let log = agent.log();
    let chosen = log
        .lines()
        .find(|l| l.contains("credentials for the API server chosen"))
        .unwrap_or_else(|| panic!("no choice of credentials logged:\n{log}"));
    assert!(
        chosen
            .contains("the pod's service account in /var/run/secrets/kubernetes.io/serviceaccount"),
        "{chosen}"
    );
    assert!(!log.contains("forbidden"), "{log}");
}
