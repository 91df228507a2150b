//! The fleet as the publisher exports it (SPEC 8c): `kubelet_ca_fleet_nodes{state}` and
//! `kubelet_ca_fleet_certificate_missing_nodes{subject_CN,serial_number}` for the bundle it
//! publishes, from one metadata watch on the Nodes, against the real API server of
//! `../shared/tools/kube-apiserver/cluster`: nodes current, unreported and invalid are
//! counted as such, a node outside `--node-selector` is not counted, and a report written
//! later moves the counts at once.

mod common;

use std::time::Duration;

use common::daemon::{Agent, eventually};
use common::pki::{Algorithm, Signer};
use common::real_cluster::Cluster;
use common::sha256_hex;
use serde_json::json;

const SECOND: Duration = Duration::from_secs(1);
const NS: &str = "openshift-config-managed";
const NAME: &str = "signers";

/// A report as the node agent writes it, its bundle holding `certs`.
fn held(certs: &[&str]) -> String {
    json!({
        "v": 1, "agent": "0.1.0", "changed": "2026-11-27T15:00:00Z",
        "targets": [{"path": "/etc/kubernetes/kubelet-ca.crt", "kind": "bundle", "certs": certs, "inSync": true}],
    })
    .to_string()
}

#[test]
fn the_publisher_counts_the_selected_nodes_by_state_and_each_certificate_missing() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let a = Signer::new("signer-a", Algorithm::P256);
    cluster.put_configmap(NS, NAME, &[("ca-bundle.crt", &a.pem())]);
    let fa = sha256_hex(&a.der());
    // Labelled pool=test: one current, one unreported, one invalid. One more, unlabelled
    // and unreported, is outside the selector.
    cluster.create_node("current", Some(&held(&[&fa])));
    cluster.create_node("silent", None);
    cluster.create_node("garbage", Some("{\"v\":1,\"targets\":7}"));
    let body = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "windows"}});
    let (code, answer) = cluster.request("POST", "/api/v1/nodes", Some(&body));
    assert_eq!(code, 201, "{answer}");

    let work = tempfile::tempdir().unwrap();
    let publisher = Agent::publish(
        work.path(),
        &cluster.admin_kubeconfig(),
        "openshift-machine-config-operator/kubelet-ca-bundle",
        &[&format!("configmap:{NS}/{NAME}")],
        &["--node-selector", "pool=test"],
    );
    publisher.wait_listening();
    let state = |s: &str| publisher.sample("kubelet_ca_fleet_nodes", &[("state", s)]);
    let missing = || {
        publisher.sample(
            "kubelet_ca_fleet_certificate_missing_nodes",
            &[("subject_CN", "signer-a")],
        )
    };
    let counts = || {
        (
            state("current"),
            state("behind"),
            state("unreported"),
            state("invalid"),
            missing(),
        )
    };
    assert!(
        eventually(20 * SECOND, || counts()
            == (Some(1.0), Some(0.0), Some(1.0), Some(1.0), Some(2.0))),
        "{:?}\n{}",
        counts(),
        publisher.log()
    );
    // A report written now moves the counts at once.
    cluster.set_held("silent", Some(&held(&[&fa])));
    assert!(
        eventually(5 * SECOND, || counts()
            == (Some(2.0), Some(0.0), Some(0.0), Some(1.0), Some(1.0))),
        "{:?}",
        counts()
    );
    // A node behind: it holds an old signer only.
    let old = Signer::new("signer-old", Algorithm::P256);
    cluster.set_held("current", Some(&held(&[&sha256_hex(&old.der())])));
    assert!(
        eventually(5 * SECOND, || counts()
            == (Some(1.0), Some(1.0), Some(0.0), Some(1.0), Some(2.0))),
        "{:?}",
        counts()
    );
    let verbose = publisher.get("/readyz?verbose").unwrap().1;
    assert!(verbose.contains("[+]fleet ok"), "{verbose}");
}
