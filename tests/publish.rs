//! `publish` against a local API server that answers server-side apply as kube-apiserver
//! does: the derived ConfigMap is created from a ControllerConfig and follows its bundle,
//! is written only when the bundle changes (its resourceVersion says so), keeps the last good
//! bundle through bad input, survives deletion and hand edits, stays correct with two
//! replicas, and a node agent watching it follows a rotation end to end. With
//! `--cloud-ca-source` and `--registry-source` the same ConfigMap carries the cloud CA and
//! one key per registry CA, derived from a ControllerConfig shaped like a real cluster's, and
//! a node agent keeps its cloud CA file and registry CA files from it.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::time::Duration;

use base64::Engine;
use common::apiserver::{ApiServer, Rule};
use common::daemon::{Agent, check_line, wait_until};
use common::pki::{Algorithm, Signer, leaf};
use common::{Node, sha256_hex, stderr};
use serde_json::{Value, json};

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

/// The ConfigMap deleted while the publisher's apply is in flight: the watch says it is
/// gone before the apply's answer comes, and the answer (older) must not make the publisher
/// take it for published (a race one full test run met by chance).
#[test]
fn a_configmap_deleted_while_the_apply_is_in_flight_is_published_again() {
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let (api, _node, agent) = publishing(&a);
    api.set_patch_answer_delay(SECOND);
    api.put_controllerconfig(CC, &b64(&b.pem()));
    // Committed at once, answered a second later: deleted in between.
    wait_published(&api, 5 * SECOND, &b.pem());
    api.delete_configmap(NS, NAME);
    let took = wait_published(&api, 10 * SECOND, &b.pem());
    eprintln!("published again {took:?} after the delete");
    assert!(
        agent.log().contains("the ConfigMap is gone"),
        "{}",
        agent.log()
    );
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

// ---------------------------------------------------------------------------------------------
// The other CA files of the node in the same ConfigMap: cloud-ca.pem and registry.<host..port>
// ---------------------------------------------------------------------------------------------

const CLOUD_SOURCE: &str = "controllerconfig:machine-config-controller/cloudProviderCAData";
const REGISTRY_SOURCES: &str = "controllerconfig:machine-config-controller/imageRegistryBundleData,controllerconfig:machine-config-controller/imageRegistryBundleUserData";
const INTERNAL_SOURCE: &str = "controllerconfig:machine-config-controller/imageRegistryBundleData";
const INTERNAL: &str = "image-registry.openshift-image-registry.svc..5000";
const INTERNAL_KEY: &str = "registry.image-registry.openshift-image-registry.svc..5000";
const USER_KEY: &str = "registry.registry.example.com..5000";
const MIRROR_KEY: &str = "registry.mirror.example.com";

fn entry(file: &str, pem: &str) -> Value {
    json!({"file": file, "data": b64(pem)})
}

/// A ControllerConfig's spec as a real cluster has it: every CA field base64-encoded (the
/// cloud CA `null` when there is none), both registry lists, and an unrelated field.
fn cluster_spec(
    kube: &str,
    cloud: Option<&str>,
    internal: Vec<Value>,
    user: Vec<Value>,
    platform: &str,
) -> Vec<(&'static str, Value)> {
    vec![
        ("kubeAPIServerServingCAData", json!(b64(kube))),
        (
            "cloudProviderCAData",
            cloud.map_or(Value::Null, |c| json!(b64(c))),
        ),
        ("imageRegistryBundleData", Value::Array(internal)),
        ("imageRegistryBundleUserData", Value::Array(user)),
        ("platformSpec", json!({"type": platform})),
    ]
}

/// A publisher that keeps every key.
fn every_key_publisher(node: &Node, api: &ApiServer) -> Agent {
    publisher(
        node,
        api,
        &[
            "--cloud-ca-source",
            CLOUD_SOURCE,
            "--registry-source",
            REGISTRY_SOURCES,
        ],
    )
}

/// The derived ConfigMap's `data`.
fn data(api: &ApiServer) -> BTreeMap<String, String> {
    api.configmap(NS, NAME)
        .and_then(|cm| serde_json::from_value(cm["data"].clone()).ok())
        .unwrap_or_default()
}

fn keys_of(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn applies(api: &ApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.method == "PATCH")
        .count()
}

fn key_label(key: &str) -> String {
    format!("configmap:{NS}/{NAME}/{key}")
}

/// The signers of one cluster: the kubelet CA's, the cloud CA, the registries'.
struct Cas {
    kube: Signer,
    cloud: Signer,
    internal: Signer,
    user: Signer,
    /// A registry's own self-signed server certificate (not a CA).
    mirror: String,
}

impl Cas {
    fn new() -> Cas {
        Cas {
            kube: Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
            cloud: Signer::new("cloud-provider-ca", Algorithm::P256),
            internal: Signer::new("image-registry-ca", Algorithm::P256),
            user: Signer::new("registry-example-ca", Algorithm::P384),
            mirror: leaf("mirror.example.com"),
        }
    }

    fn spec(&self, platform: &str) -> Vec<(&'static str, Value)> {
        cluster_spec(
            &self.kube.pem(),
            Some(&self.cloud.pem()),
            vec![entry(INTERNAL, &self.internal.pem())],
            vec![
                entry("registry.example.com..5000", &self.user.pem()),
                entry("mirror.example.com", &self.mirror),
            ],
            platform,
        )
    }

    /// Every key the publisher derives from [`Cas::spec`].
    fn published(&self) -> BTreeMap<String, String> {
        keys_of(&[
            (KEY, &self.kube.pem()),
            ("cloud-ca.pem", &self.cloud.pem()),
            (INTERNAL_KEY, &self.internal.pem()),
            (USER_KEY, &self.user.pem()),
            (MIRROR_KEY, &self.mirror),
        ])
    }
}

#[test]
fn publish_derives_every_ca_of_the_controllerconfig_and_a_registry_removed_loses_its_key() {
    let api = ApiServer::start();
    let node = Node::new();
    let cas = Cas::new();
    let mut spec = cas.spec("AWS");
    // An IPv6 registry cannot be a ConfigMap key: skipped, and said.
    spec[3]
        .1
        .as_array_mut()
        .unwrap()
        .push(entry("[fd00::1]:5000", &cas.user.pem()));
    api.put_controllerconfig_spec(CC, &spec);
    let agent = every_key_publisher(&node, &api);
    let want = cas.published();
    wait_until(10 * SECOND, || data(&api) == want);
    agent.wait_listening();
    // Four sources of one ControllerConfig: one watch of it, and one of the ConfigMap.
    wait_until(5 * SECOND, || api.open_watches() == 2);
    let lists = api
        .requests()
        .iter()
        .filter(|r| r.is_list() && r.path.contains("controllerconfigs"))
        .count();
    assert_eq!(
        lists, 1,
        "one list of the ControllerConfig for every source of it"
    );

    // Each key has its line and its series, in sync; the publisher is ready.
    for key in [KEY, "cloud-ca.pem", INTERNAL_KEY, USER_KEY, MIRROR_KEY] {
        agent.wait_sample(
            5 * SECOND,
            "kubelet_ca_bundle_in_sync",
            &[("filepath", &key_label(key))],
            |v| v == 1.0,
        );
    }
    assert_eq!(
        agent.sample(
            "kubelet_ca_bundle_certificates",
            &[("filepath", &key_label(USER_KEY))]
        ),
        Some(1.0)
    );
    let (code, ready) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200, "{ready}");
    for key in ["cloud-ca.pem", INTERNAL_KEY, MIRROR_KEY] {
        let line = check_line(&ready, &format!("in-sync:{}", key_label(key)));
        assert!(line.starts_with("[+]"), "{key}: {ready}");
    }
    let skipped = check_line(&ready, "held:registry.*");
    assert!(skipped.contains("[fd00::1]:5000"), "{ready}");
    assert!(agent.log().contains("[fd00::1]:5000"), "{}", agent.log());
    assert!(
        agent
            .sample(
                "kubelet_ca_source_errors_total",
                &[
                    (
                        "source",
                        "controllerconfig:machine-config-controller/imageRegistryBundleUserData"
                    ),
                    ("reason", "not_a_configmap_key"),
                ],
            )
            .is_some_and(|v| v >= 1.0),
        "{}",
        agent.log()
    );
    // Every source is named in an annotation, and only the publisher applied.
    assert_eq!(
        annotation(&api, "kubelet-ca-agent.io/registry-sources").as_deref(),
        Some(REGISTRY_SOURCES)
    );
    assert_eq!(
        annotation(&api, "kubelet-ca-agent.io/cloud-ca-sources").as_deref(),
        Some(CLOUD_SOURCE)
    );

    // A registry leaves the user list, another's CA rotates: its key goes, the other's
    // changes, the rest stays as it is.
    let internal2 = Signer::new("image-registry-ca-2", Algorithm::P256);
    let both = cas.internal.pem() + &internal2.pem();
    api.put_controllerconfig_spec(
        CC,
        &cluster_spec(
            &cas.kube.pem(),
            Some(&cas.cloud.pem()),
            vec![entry(INTERNAL, &both)],
            vec![entry("mirror.example.com", &cas.mirror)],
            "AWS",
        ),
    );
    let mut want = cas.published();
    want.remove(USER_KEY);
    want.insert(INTERNAL_KEY.into(), both);
    let took = wait_until(3 * SECOND, || data(&api) == want);
    eprintln!("a registry change reached the ConfigMap in {took:?}");
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_writes_total",
        &[("filepath", &key_label(INTERNAL_KEY))],
        |v| v >= 2.0,
    );
    // The kubelet bundle was not rewritten for it.
    assert_eq!(
        agent.sample("kubelet_ca_writes_total", &[("filepath", &key_label(KEY))]),
        Some(1.0)
    );
    wait_until(5 * SECOND, || {
        agent.get("/readyz").is_some_and(|(code, _)| code == 200)
    });
    let (_, ready) = agent.get("/readyz?verbose").unwrap();
    assert!(!ready.contains(USER_KEY), "{ready}");
}

#[test]
fn an_empty_cloud_ca_is_published_empty_and_a_node_keeps_its_files_from_the_configmap() {
    let api = ApiServer::start();
    let node = Node::new();
    let cas = Cas::new();
    // No cloud CA on this platform: cloudProviderCAData is null.
    let spec = |cloud: Option<&str>| {
        cluster_spec(
            &cas.kube.pem(),
            cloud,
            vec![entry(INTERNAL, &cas.internal.pem())],
            vec![entry("registry.example.com..5000", &cas.user.pem())],
            "None",
        )
    };
    api.put_controllerconfig_spec(CC, &spec(None));
    let publisher = every_key_publisher(&node, &api);
    let want = keys_of(&[
        (KEY, &cas.kube.pem()),
        ("cloud-ca.pem", ""),
        (INTERNAL_KEY, &cas.internal.pem()),
        (USER_KEY, &cas.user.pem()),
    ]);
    wait_until(10 * SECOND, || data(&api) == want);
    publisher.wait_listening();
    wait_until(5 * SECOND, || {
        publisher
            .get("/readyz")
            .is_some_and(|(code, _)| code == 200)
    });

    // A node agent that keeps its cloud CA file and its registry CA files from the
    // ConfigMap alone.
    let cloud_file = node
        .root()
        .join("etc/kubernetes/cloud-config/ca-bundle.pem");
    std::fs::create_dir_all(cloud_file.parent().unwrap()).unwrap();
    let certs = node.root().join("etc/docker/certs.d");
    std::fs::create_dir_all(&certs).unwrap();
    let manage = format!("{}=configmap:{TO}/cloud-ca.pem", cloud_file.display());
    let registries = format!("{}=configmap:{TO}/registry.*", certs.display());
    let agent = Agent::start(
        &node,
        &[&format!("configmap:{TO}")],
        &[
            "--manage",
            &manage,
            "--manage-registries",
            &registries,
            "--kubeconfig",
            api.kubeconfig().to_str().unwrap(),
        ],
    );
    let ca = |dir: &str| certs.join(dir).join("ca.crt");
    wait_until(10 * SECOND, || {
        node.holds(cas.kube.pem())
            && std::fs::read(ca("registry.example.com:5000"))
                .is_ok_and(|b| b == cas.user.pem().as_bytes())
            && std::fs::read(ca("image-registry.openshift-image-registry.svc:5000"))
                .is_ok_and(|b| b == cas.internal.pem().as_bytes())
    });
    // Nothing to keep for the cloud CA: up, ready, and no file. (Readiness follows the
    // bundle alone, so it is the source's line that tells when it has been read.)
    let cloud_source = format!("source:configmap:{TO}/cloud-ca.pem");
    wait_until(5 * SECOND, || {
        agent
            .get("/readyz?verbose")
            .is_some_and(|(_, page)| check_line(&page, &cloud_source).starts_with("[+]"))
    });
    let (code, ready) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200, "{ready}");
    let source = check_line(&ready, &cloud_source);
    assert!(source.starts_with("[+]"), "{ready}");
    assert!(!cloud_file.exists());
    // The other keys of the ConfigMap are not registries.
    assert_eq!(
        std::fs::read_dir(&certs).unwrap().count(),
        2,
        "{:?}",
        std::fs::read_dir(&certs).unwrap().collect::<Vec<_>>()
    );

    // The cloud CA appears: ControllerConfig -> ConfigMap -> node file.
    api.put_controllerconfig_spec(CC, &spec(Some(&cas.cloud.pem())));
    let took = wait_until(3 * SECOND, || {
        std::fs::read(&cloud_file).is_ok_and(|b| b == cas.cloud.pem().as_bytes())
    });
    eprintln!("cloudProviderCAData -> cloud-ca.pem -> node file in {took:?}");
    // And goes again: the key is empty, the node's file stays as it is.
    api.put_controllerconfig_spec(CC, &spec(None));
    wait_until(3 * SECOND, || {
        data(&api).get("cloud-ca.pem").is_some_and(String::is_empty)
    });
    std::thread::sleep(SECOND / 2);
    assert_eq!(
        std::fs::read(&cloud_file).unwrap(),
        cas.cloud.pem().as_bytes()
    );
    agent.wait_metric(SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
}

#[test]
fn a_private_key_in_one_registrys_data_keeps_that_key_while_the_others_update() {
    let api = ApiServer::start();
    let node = Node::new();
    let cas = Cas::new();
    api.put_controllerconfig_spec(CC, &cas.spec("AWS"));
    let agent = every_key_publisher(&node, &api);
    wait_until(10 * SECOND, || data(&api) == cas.published());
    agent.wait_listening();

    // One update: the kubelet CA and the cloud CA rotate, the user registry's CA rotates,
    // and the internal registry's data carries a private key.
    let (kube2, cloud2, user2) = (
        Signer::new("kube-apiserver-lb-signer-2", Algorithm::P256),
        Signer::new("cloud-provider-ca-2", Algorithm::P256),
        Signer::new("registry-example-ca-2", Algorithm::P256),
    );
    let kube = cas.kube.pem() + &kube2.pem();
    api.put_controllerconfig_spec(
        CC,
        &cluster_spec(
            &kube,
            Some(&cloud2.pem()),
            vec![entry(
                INTERNAL,
                &(cas.internal.pem() + &cas.internal.key_pem()),
            )],
            vec![
                entry("registry.example.com..5000", &user2.pem()),
                entry("mirror.example.com", &cas.mirror),
            ],
            "AWS",
        ),
    );
    let mut want = cas.published();
    want.insert(KEY.into(), kube);
    want.insert("cloud-ca.pem".into(), cloud2.pem());
    want.insert(USER_KEY.into(), user2.pem());
    wait_until(3 * SECOND, || data(&api) == want);
    // The internal registry's key is as it was, and the refusal is counted and shown.
    assert_eq!(data(&api)[INTERNAL_KEY], cas.internal.pem());
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_source_errors_total",
        &[("source", INTERNAL_SOURCE), ("reason", "private_key")],
        |v| v >= 1.0,
    );
    let (_, ready) = agent.get("/readyz?verbose").unwrap();
    let held = check_line(&ready, "held:registry.*");
    assert!(
        held.contains(INTERNAL_KEY) && held.contains("keeps what it holds"),
        "{ready}"
    );
    assert!(
        check_line(&ready, &format!("in-sync:{}", key_label(INTERNAL_KEY))).starts_with("[+]"),
        "{ready}"
    );
    let published: String = data(&api).values().cloned().collect();
    assert!(
        !published.contains("PRIVATE KEY"),
        "a key reached the ConfigMap"
    );
    assert!(
        !agent.log().contains("PRIVATE KEY-----"),
        "key material in the log"
    );

    // Good data again: published.
    api.put_controllerconfig_spec(
        CC,
        &cluster_spec(
            &cas.kube.pem(),
            Some(&cloud2.pem()),
            vec![entry(INTERNAL, &user2.pem())],
            vec![],
            "AWS",
        ),
    );
    let want = keys_of(&[
        (KEY, &cas.kube.pem()),
        ("cloud-ca.pem", &cloud2.pem()),
        (INTERNAL_KEY, &user2.pem()),
    ]);
    wait_until(3 * SECOND, || data(&api) == want);
}

#[test]
fn an_unrelated_controllerconfig_change_applies_nothing_when_every_key_is_kept() {
    let api = ApiServer::start();
    let node = Node::new();
    let cas = Cas::new();
    api.put_controllerconfig_spec(CC, &cas.spec("AWS"));
    let agent = every_key_publisher(&node, &api);
    wait_until(10 * SECOND, || data(&api) == cas.published());
    agent.wait_listening();
    agent.wait_metric(5 * SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    std::thread::sleep(SECOND / 2);
    let (before, patches) = (rv(&api), applies(&api));

    for platform in ["GCP", "Azure", "None"] {
        let cc_rv = api.put_controllerconfig_spec(CC, &cas.spec(platform));
        assert!(cc_rv > before, "the ControllerConfig did not change");
    }
    std::thread::sleep(SECOND);
    assert_eq!(applies(&api), patches, "an apply for an unrelated change");
    assert_eq!(
        rv(&api),
        before,
        "the ConfigMap was written for an unrelated change"
    );
    assert_eq!(data(&api), cas.published());

    // A key of someone else's beside them is not the publisher's: left alone, no apply.
    let theirs = Signer::new("theirs", Algorithm::P256).pem();
    api.edit_configmap_as(
        "kubectl-edit",
        NS,
        NAME,
        &[("registry.theirs.example", &theirs)],
        &[],
    );
    std::thread::sleep(SECOND);
    assert_eq!(
        applies(&api),
        patches,
        "an apply for a key that is not the publisher's"
    );
    // One of its keys edited by hand: put back, and counted as a repair of that key.
    let intruder = Signer::new("intruder", Algorithm::P256).pem();
    api.edit_configmap_as("kubectl-edit", NS, NAME, &[(USER_KEY, &intruder)], &[]);
    let mut want = cas.published();
    want.insert("registry.theirs.example".into(), theirs);
    wait_until(5 * SECOND, || data(&api) == want);
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_repairs_total",
        &[("filepath", &key_label(USER_KEY))],
        |v| v == 1.0,
    );
    assert!(agent.log().contains("other-keys-sha256"), "{}", agent.log());
    let repaired = applies(&api);
    std::thread::sleep(SECOND);
    assert_eq!(applies(&api), repaired, "the repair did not settle");
}

#[test]
fn once_publishes_every_key_and_a_refused_registry_entry_exits_1_keeping_its_key() {
    let api = ApiServer::start();
    let cas = Cas::new();
    api.put_controllerconfig_spec(CC, &cas.spec("AWS"));
    let once = || {
        publish_command()
            .args(["--to", TO, "--once", "--kubeconfig"])
            .arg(api.kubeconfig())
            .args(["--cloud-ca-source", CLOUD_SOURCE])
            .args(["--registry-source", REGISTRY_SOURCES])
            .output()
            .unwrap()
    };
    let out = once();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(data(&api), cas.published());
    let before = rv(&api);
    let out = once();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("already published"),
        "{}",
        stderr(&out)
    );
    assert_eq!(rv(&api), before);

    // A key in the internal registry's data, and a new kubelet CA: the bundle is
    // published, the registry's key stays, and the run says so and exits 1.
    let kube2 = Signer::new("kube-apiserver-lb-signer-2", Algorithm::P256);
    let mut spec = cas.spec("AWS");
    spec[0].1 = json!(b64(&kube2.pem()));
    spec[2].1 = json!([entry(
        INTERNAL,
        &(cas.internal.pem() + &cas.internal.key_pem())
    )]);
    api.put_controllerconfig_spec(CC, &spec);
    let out = once();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("left as it was"), "{}", stderr(&out));
    assert!(stderr(&out).contains(INTERNAL), "{}", stderr(&out));
    let mut want = cas.published();
    want.insert(KEY.into(), kube2.pem());
    assert_eq!(data(&api), want);

    // The bundle's key where another key goes: a usage error.
    let out = publish_command()
        .args(["--to", &format!("{TO}/cloud-ca.pem"), "--once"])
        .args(["--cloud-ca-source", CLOUD_SOURCE])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let out = publish_command()
        .args([
            "--to",
            TO,
            "--once",
            "--registry-source",
            "dir:/etc/registries",
        ])
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
fn every_key_needs_no_more_than_the_publishers_objects_by_name() {
    let api = ApiServer::start();
    let node = Node::new();
    let cas = Cas::new();
    api.put_controllerconfig_spec(CC, &cas.spec("AWS"));
    // The same rules as for the bundle alone: the sources of the other keys read the same
    // ControllerConfig, and the keys live in the same ConfigMap.
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
    let agent = every_key_publisher(&node, &api);
    wait_until(10 * SECOND, || data(&api) == cas.published());
    agent.wait_listening();
    wait_until(5 * SECOND, || {
        agent.get("/readyz").is_some_and(|(code, _)| code == 200)
    });
    assert!(!agent.log().contains("forbidden"), "{}", agent.log());
}

/// `--kubeconfig-ca-source` (issue 26): the publisher derives `kubeconfig-ca.crt` from the
/// `kubeconfig-data` ConfigMap (base64 of PEM, as the node configuration path holds it),
/// in the loop and with `--once`; sources that hold nothing keep the key as it is; and a
/// node keeps its kubeconfig from that one key.
#[test]
fn the_kubeconfigs_ca_is_derived_into_its_key_and_a_node_keeps_its_kubeconfig_from_it() {
    const DATA_NS: &str = "openshift-machine-config-operator";
    const DATA: &str = "kubeconfig-data";
    let api = ApiServer::start();
    let node = Node::new();
    let kube = Signer::new("kube-apiserver-lb-signer", Algorithm::P256);
    let (ca1, ca2) = (
        Signer::new("kube-apiserver-serving-ca-1", Algorithm::P256),
        Signer::new("kube-apiserver-serving-ca-2", Algorithm::P256),
    );
    api.put_controllerconfig(CC, &b64(&kube.pem()));
    api.put_configmap(DATA_NS, DATA, &[("ca-bundle.crt", &b64(&ca1.pem()))], &[]);
    let source = format!("configmap:{DATA_NS}/{DATA}");
    let agent = publisher(&node, &api, &["--kubeconfig-ca-source", &source]);
    let key = |api: &ApiServer| data(api).get("kubeconfig-ca.crt").cloned();
    wait_until(10 * SECOND, || key(&api) == Some(ca1.pem()));
    assert_eq!(
        annotation(&api, "kubelet-ca-agent.io/kubeconfig-ca-sources").as_deref(),
        Some(source.as_str())
    );

    // A node behind the publisher keeps its kubeconfig from that key.
    let kubeconfig = node.root().join("kubelet-kubeconfig");
    fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:9\n    certificate-authority-data: {}\n",
            b64(&ca1.pem())
        ),
    )
    .unwrap();
    let manage = format!(
        "{}=configmap:{NS}/{NAME}/kubeconfig-ca.crt",
        kubeconfig.display()
    );
    let kubeconfig_ca = || {
        let text = fs::read_to_string(&kubeconfig).unwrap();
        let line = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("certificate-authority-data: "))
            .unwrap()
            .to_string();
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(line)
                .unwrap(),
        )
        .unwrap()
    };
    let node_agent = Agent::start(
        &node,
        &[&format!("configmap:{NS}/{NAME}")],
        &[
            "--kubeconfig",
            api.kubeconfig().to_str().unwrap(),
            "--manage-kubeconfig",
            &manage,
        ],
    );
    wait_until(10 * SECOND, || node.holds(kube.pem()));

    // The next CA is published beside the first: the key, then the node's kubeconfig.
    let both = format!("{}{}", ca1.pem(), ca2.pem());
    api.put_configmap(DATA_NS, DATA, &[("ca-bundle.crt", &b64(&both))], &[]);
    wait_until(10 * SECOND, || key(&api).as_deref() == Some(both.as_str()));
    wait_until(10 * SECOND, || kubeconfig_ca() == both);

    // Sources that hold nothing keep the key as it is, and say so.
    api.put_configmap(DATA_NS, DATA, &[("ca-bundle.crt", "")], &[]);
    agent.wait_sample(
        10 * SECOND,
        "kubelet_ca_source_errors_total",
        &[("source", &source), ("reason", "no_certificate")],
        |v| v >= 1.0,
    );
    assert_eq!(key(&api).as_deref(), Some(both.as_str()));
    drop(node_agent);

    // --once derives it too.
    let once = || {
        publish_command()
            .args(["--to", TO, "--once", "--kubeconfig"])
            .arg(api.kubeconfig())
            .args(["--kubeconfig-ca-source", &source])
            .output()
            .unwrap()
    };
    let out = once();
    assert_eq!(
        out.status.code(),
        Some(1),
        "an empty source fails the run: {}",
        stderr(&out)
    );
    api.put_configmap(DATA_NS, DATA, &[("ca-bundle.crt", &ca2.pem())], &[]);
    let out = once();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(key(&api), Some(ca2.pem()));
    // Its key where the bundle goes: a usage error.
    let out = publish_command()
        .args(["--to", &format!("{TO}/kubeconfig-ca.crt"), "--once"])
        .args(["--kubeconfig-ca-source", &source])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}
