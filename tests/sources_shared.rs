//! Cluster sources that name what they read of an object (SPEC 4b): `controllerconfig:NAME/FIELD`
//! against a ControllerConfig shaped like a real cluster's (every CA field set, the registry
//! lists non-empty), one watch per object whatever the number of fields or keys read from it,
//! each spec failing alone, and an empty cloud CA that is a source holding nothing, not a
//! source down.

mod common;

use std::time::Duration;

use base64::Engine;
use common::apiserver::ApiServer;
use common::daemon::{Agent, wait_until};
use common::pki::{self, Algorithm, Signer};
use common::{Node, stderr};
use serde_json::{Value, json};

const SECOND: Duration = Duration::from_secs(1);
const CC: &str = "machine-config-controller";
const KUBE: &str = "controllerconfig:machine-config-controller";
const CLOUD: &str = "controllerconfig:machine-config-controller/cloudProviderCAData";

fn b64(pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(pem)
}

/// The CA fields of a ControllerConfig as a cluster on a platform with a cloud CA, an
/// internal registry and an admin's `additionalTrustedCA` has them: base64 everywhere, the
/// registry lists of `{file, data}` with `..` for the port's colon.
fn real_fields(kube: &str, cloud: &str) -> Vec<(&'static str, Value)> {
    let internal = Signer::new("openshift-service-serving-signer", Algorithm::Rsa);
    let admin = Signer::new("registry.example.com CA", Algorithm::P256);
    vec![
        ("kubeAPIServerServingCAData", json!(b64(kube))),
        ("cloudProviderCAData", json!(b64(cloud))),
        (
            "imageRegistryBundleData",
            json!([
                {"file": "image-registry.openshift-image-registry.svc..5000", "data": b64(&internal.pem())},
                {"file": "image-registry.openshift-image-registry.svc.cluster.local..5000", "data": b64(&internal.pem())},
            ]),
        ),
        (
            "imageRegistryBundleUserData",
            json!([
                {"file": "registry.example.com..5000", "data": b64(&admin.pem())},
                // A registry's own self-signed server certificate, as admins often give.
                {"file": "quay.internal", "data": b64(&pki::leaf("quay.internal"))},
            ]),
        ),
    ]
}

fn kubeconfig(api: &ApiServer) -> [&str; 2] {
    ["--kubeconfig", api.kubeconfig().to_str().unwrap()]
}

#[test]
fn sync_reads_the_field_a_spec_names_from_a_controllerconfig_shaped_like_a_real_clusters() {
    let api = ApiServer::start();
    let node = Node::new();
    let (kube, cloud) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
        Signer::new("cloud-provider-ca", Algorithm::Rsa),
    );
    api.put_controllerconfig_spec(CC, &real_fields(&kube.pem(), &cloud.pem()));

    let out = node.sync(&[CLOUD], &kubeconfig(&api));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(node.read_bundle(), cloud.pem().as_bytes());

    // Unnamed, or named, the field stays kubeAPIServerServingCAData.
    for spec in [
        KUBE,
        "controllerconfig:machine-config-controller/kubeAPIServerServingCAData",
    ] {
        let out = node.sync(&[spec], &kubeconfig(&api));
        assert!(out.status.success(), "{spec}: {}", stderr(&out));
        assert_eq!(node.read_bundle(), kube.pem().as_bytes(), "{spec}");
    }

    // A registry list is not a bundle: said so, and the file is left as it was.
    let registries = "controllerconfig:machine-config-controller/imageRegistryBundleUserData";
    let out = node.sync(&[registries], &kubeconfig(&api));
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains(registries), "the line names the spec: {err}");
    assert!(
        err.contains("--manage-registries"),
        "and where it belongs: {err}"
    );
    assert_eq!(node.read_bundle(), kube.pem().as_bytes());

    // A field named as a path is a usage error that says how to name it.
    let out = node.sync(
        &["controllerconfig:machine-config-controller/spec.cloudProviderCAData"],
        &kubeconfig(&api),
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("without \"spec.\""),
        "{}",
        stderr(&out)
    );
}

/// The requests of kind `plural` (`controllerconfigs`, `configmaps`): (lists, watches).
fn requests_for(api: &ApiServer, plural: &str) -> (usize, usize) {
    let requests = api.requests();
    let of_kind = || requests.iter().filter(|r| r.path.contains(plural));
    (
        of_kind().filter(|r| r.is_list()).count(),
        of_kind().filter(|r| r.watch).count(),
    )
}

#[test]
fn specs_of_one_object_share_one_watch_and_fail_alone() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b, cloud, c1, c2) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
        Signer::new("kube-apiserver-lb-signer-2", Algorithm::P384),
        Signer::new("cloud-provider-ca", Algorithm::Rsa),
        Signer::new("client-ca-1", Algorithm::P256),
        Signer::new("client-ca-2", Algorithm::Ed25519),
    );
    api.put_controllerconfig_spec(CC, &real_fields(&a.pem(), &cloud.pem()));
    let (ns, name) = ("openshift-config", "client-cas");
    api.put_configmap(
        ns,
        name,
        &[("one.crt", &c1.pem()), ("two.crt", &c2.pem())],
        &[],
    );
    let sources = [
        KUBE,
        "configmap:openshift-config/client-cas/one.crt",
        CLOUD,
        "configmap:openshift-config/client-cas/two.crt",
    ];
    let agent = Agent::start(&node, &sources, &kubeconfig(&api));
    let all = |kube: &str, cloud: &str| format!("{kube}{}{cloud}{}", c1.pem(), c2.pem());
    wait_until(10 * SECOND, || node.holds(all(&a.pem(), &cloud.pem())));

    // A rotation of one field comes through the shared watch; the others stay.
    let both = a.pem() + &b.pem();
    api.put_controllerconfig_spec(CC, &real_fields(&both, &cloud.pem()));
    wait_until(5 * SECOND, || node.holds(all(&both, &cloud.pem())));

    // A bad field fails its own spec alone: its last good content stays, and a rotation of
    // the other field of the same object still reaches the file.
    let mut fields = real_fields(&b.pem(), &cloud.pem());
    fields[1].1 = json!("%%% not base64 %%%");
    api.put_controllerconfig_spec(CC, &fields);
    wait_until(5 * SECOND, || node.holds(all(&b.pem(), &cloud.pem())));
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_source_errors_total",
        &[("source", CLOUD), ("reason", "bad_base64")],
        |v| v >= 1.0,
    );
    // The counter moves as the event comes in, the state with the pass that follows.
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_source_up",
        &[("source", CLOUD)],
        |v| v == 0.0,
    );
    assert_eq!(
        agent.sample("kubelet_ca_source_up", &[("source", CLOUD)]),
        Some(0.0)
    );
    assert_eq!(
        agent.sample("kubelet_ca_source_up", &[("source", KUBE)]),
        Some(1.0)
    );
    let log = agent.log();
    assert!(
        !log.contains(&format!("source {KUBE}: spec.cloudProviderCAData")),
        "the cloud field's failure was told to the other spec:\n{log}"
    );

    // Two keys of one ConfigMap: one watch too.
    api.put_configmap(
        ns,
        name,
        &[("one.crt", &c2.pem()), ("two.crt", &c1.pem())],
        &[],
    );
    let swapped = format!("{}{}{}{}", b.pem(), c2.pem(), cloud.pem(), c1.pem());
    wait_until(5 * SECOND, || node.holds(&swapped));

    assert_eq!(
        requests_for(&api, "controllerconfigs"),
        (1, 1),
        "one list and one watch for the ControllerConfig, whatever the number of fields"
    );
    assert_eq!(
        requests_for(&api, "configmaps"),
        (1, 1),
        "one list and one watch for the ConfigMap, whatever the number of keys"
    );
    assert_eq!(api.open_watches(), 2);
}

#[test]
fn an_empty_cloud_ca_is_a_source_that_holds_nothing_not_a_source_down() {
    let api = ApiServer::start();
    let node = Node::new();
    let (kube, cloud) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
        Signer::new("cloud-provider-ca", Algorithm::Rsa),
    );
    // As on most platforms: cloudProviderCAData is null.
    let mut fields = real_fields(&kube.pem(), "");
    fields[1].1 = Value::Null;
    api.put_controllerconfig_spec(CC, &fields);
    let agent = Agent::start(&node, &[KUBE, CLOUD], &kubeconfig(&api));
    wait_until(10 * SECOND, || node.holds(kube.pem()));
    agent.wait_listening();
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_source_up",
        &[("source", CLOUD)],
        |v| v == 1.0,
    );
    let (code, body) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        agent.log().contains("source holds no certificate"),
        "{}",
        agent.log()
    );

    // The cloud CA comes, then goes (an empty string this time): the sources are the truth.
    fields[1].1 = json!(b64(&cloud.pem()));
    api.put_controllerconfig_spec(CC, &fields);
    wait_until(5 * SECOND, || node.holds(kube.pem() + &cloud.pem()));
    fields[1].1 = json!("");
    api.put_controllerconfig_spec(CC, &fields);
    wait_until(5 * SECOND, || node.holds(kube.pem()));

    let (_, metrics) = agent.get("/metrics").unwrap();
    for sample in common::daemon::samples(&metrics, "kubelet_ca_source_errors_total") {
        assert!(
            sample.value == 0.0,
            "no source error for an empty field: {sample:?}"
        );
    }
    assert_eq!(
        agent.sample("kubelet_ca_source_up", &[("source", CLOUD)]),
        Some(1.0)
    );
}
