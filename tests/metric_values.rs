//! The values of the metrics `run` serves, not just their names: a dashboard or an alert
//! reads the number, so a series that is present with the wrong value is as broken as a
//! missing one. Counters follow the rename by a moment, so every check waits for a value.

mod common;

use std::fs;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use time::Duration as Span;

use common::daemon::{Agent, samples, wait_until};
use common::pki::{self, Algorithm, Signer};
use common::{KUBECONFIG_NOWHERE, Node, sha256_hex};

const SECOND: Duration = Duration::from_secs(1);

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn source_path(spec: &str) -> &str {
    spec.strip_prefix("file:").unwrap()
}

#[test]
fn x509_cert_expired_is_0_for_a_valid_certificate_and_1_once_past_not_after() {
    let node = Node::new();
    let current = Signer::new("current", Algorithm::P256);
    let expired =
        Signer::valid_between("expired", Algorithm::P256, Span::days(-30), Span::days(-1));
    let brief = Signer::valid_between("brief", Algorithm::P256, Span::hours(-1), Span::seconds(3));
    // Expired certificates are kept by default: they must show as expired.
    let pem = current.pem() + &expired.pem() + &brief.pem();
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));
    agent.wait_listening();
    let expired_of = |cn: &str| agent.sample("x509_cert_expired", &[("subject_CN", cn)]);
    agent.wait_sample(
        2 * SECOND,
        "x509_cert_expired",
        &[("subject_CN", "current")],
        |v| v == 0.0,
    );
    assert_eq!(expired_of("expired"), Some(1.0));
    assert_eq!(expired_of("brief"), Some(0.0));
    let not_after = agent
        .sample("x509_cert_not_after", &[("subject_CN", "expired")])
        .unwrap();
    assert!(not_after < unix_now() - 3600.0, "notAfter {not_after}");
    // Nothing happens on disk when `brief` expires: the value still turns to 1.
    agent.wait_sample(
        8 * SECOND,
        "x509_cert_expired",
        &[("subject_CN", "brief")],
        |v| v == 1.0,
    );
    assert_eq!(expired_of("current"), Some(0.0));
}

#[test]
fn a_bundle_with_nothing_valid_is_counted_once_per_problem_and_never_written() {
    let node = Node::new();
    let current = Signer::new("current", Algorithm::P256);
    let source = node.source("signers.pem", current.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(current.pem()));
    agent.wait_listening();
    let expired =
        Signer::valid_between("expired", Algorithm::P256, Span::days(-30), Span::days(-1));
    fs::write(source_path(&source), expired.pem()).unwrap();
    let labels = [("reason", "no_valid_certificate")];
    agent.wait_sample(2 * SECOND, "kubelet_ca_sync_errors_total", &labels, |v| {
        v == 1.0
    });
    agent.wait_metric(SECOND, "kubelet_ca_bundle_in_sync{", 0.0);
    // More passes over the same problem (the source written again as it was, a repair of
    // the file) are not more errors; the file keeps the last valid bundle.
    fs::write(source_path(&source), expired.pem()).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        agent.sample("kubelet_ca_sync_errors_total", &labels),
        Some(1.0)
    );
    assert!(node.holds(current.pem()));
    assert_eq!(
        agent
            .log()
            .matches("none is valid now: refusing to write it")
            .count(),
        1,
        "{}",
        agent.log()
    );
}

#[test]
fn rejected_not_ca_counts_each_certificate_left_out_once() {
    let node = Node::new();
    let ca = Signer::new("ca", Algorithm::P256);
    let pem = ca.pem() + &pki::leaf("leaf-1") + &pki::leaf("leaf-2");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(ca.pem()));
    agent.wait_listening();
    let labels = [("source", source.as_str()), ("reason", "not_ca")];
    agent.wait_sample(
        2 * SECOND,
        "kubelet_ca_rejected_certificates_total",
        &labels,
        |v| v == 2.0,
    );
    // Reading the same content again (the file rewritten as it was), or another pass (a
    // repair), does not count the same certificates again.
    fs::write(source_path(&source), &pem).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        agent.sample("kubelet_ca_rejected_certificates_total", &labels),
        Some(2.0)
    );
    fs::write(node.bundle(), "garbage").unwrap();
    wait_until(2 * SECOND, || node.holds(ca.pem()));
    agent.wait_metric(2 * SECOND, "kubelet_ca_repairs_total{", 1.0);
    assert_eq!(
        agent.sample("kubelet_ca_rejected_certificates_total", &labels),
        Some(2.0)
    );
}

#[test]
fn the_sync_duration_histogram_counts_rotations_and_not_repairs() {
    let node = Node::new();
    let source = node.source("signers.pem", pki::bundle_of(1, "r0"));
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    agent.wait_metric(5 * SECOND, "kubelet_ca_writes_total{", 1.0);
    let count = || agent.sample("kubelet_ca_sync_duration_seconds_count", &[]);
    let base = agent.wait_sample(
        2 * SECOND,
        "kubelet_ca_sync_duration_seconds_count",
        &[],
        |v| v >= 0.0,
    );
    const ROTATIONS: usize = 3;
    for i in 1..=ROTATIONS {
        let pem = pki::bundle_of(1, &format!("r{i}"));
        fs::write(source_path(&source), &pem).unwrap();
        wait_until(2 * SECOND, || node.holds(&pem));
        agent.wait_sample(
            2 * SECOND,
            "kubelet_ca_sync_duration_seconds_count",
            &[],
            |v| v == base + i as f64,
        );
    }
    let inf = agent
        .sample("kubelet_ca_sync_duration_seconds_bucket", &[("le", "+Inf")])
        .unwrap();
    assert_eq!(inf, base + ROTATIONS as f64, "the +Inf bucket is the count");
    // A repair is not a source change reaching the disk.
    let pem = fs::read(node.bundle()).unwrap();
    fs::write(node.bundle(), "garbage").unwrap();
    wait_until(2 * SECOND, || node.holds(&pem));
    agent.wait_metric(2 * SECOND, "kubelet_ca_repairs_total{", 1.0);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(count(), Some(base + ROTATIONS as f64));
}

#[test]
fn bundle_info_carries_the_sha256_of_the_file_on_disk() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();
    for pem in [a.pem(), a.pem() + &b.pem()] {
        fs::write(source_path(&source), &pem).unwrap();
        wait_until(2 * SECOND, || node.holds(&pem));
        let sha = sha256_hex(&fs::read(node.bundle()).unwrap());
        let mut body = String::new();
        wait_until(2 * SECOND, || {
            body = agent.get("/metrics").unwrap().1;
            samples(&body, "kubelet_ca_bundle_info")
                .iter()
                .any(|s| s.label("sha256") == Some(&sha))
        });
        // One series, with value 1: the old hash left with the old file.
        let info = samples(&body, "kubelet_ca_bundle_info");
        assert_eq!(info.len(), 1, "{info:?}");
        assert_eq!(info[0].value, 1.0);
        assert_eq!(
            info[0].label("filepath"),
            Some(node.bundle().to_str().unwrap())
        );
    }
}

#[test]
fn last_sync_timestamp_is_now_after_each_sync() {
    let node = Node::new();
    let source = node.source("signers.pem", pki::bundle_of(1, "first"));
    let started = unix_now();
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    agent.wait_metric(5 * SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    let first = agent
        .sample("kubelet_ca_last_sync_timestamp_seconds", &[])
        .expect("a last sync after a sync");
    assert!(
        (started - 1.0..=unix_now() + 1.0).contains(&first),
        "last sync {first}, started at {started}"
    );
    std::thread::sleep(Duration::from_millis(1200));
    let rotated = unix_now();
    let pem = pki::bundle_of(1, "second");
    fs::write(source_path(&source), &pem).unwrap();
    wait_until(2 * SECOND, || node.holds(&pem));
    // Every pass that ends in sync counts (the agent looks at its own write too): the
    // one after the rotation is at or after it.
    let second = agent.wait_sample(
        2 * SECOND,
        "kubelet_ca_last_sync_timestamp_seconds",
        &[],
        |t| t >= rotated,
    );
    assert!(
        second > first && second <= unix_now() + 1.0,
        "last sync {second}, rotated at {rotated}, first {first}"
    );
}

#[test]
fn last_sync_timestamp_is_absent_while_an_adopted_file_stands() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "adopted");
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &pem).unwrap();
    let kubeconfig = node.root().join("kubeconfig");
    fs::write(&kubeconfig, KUBECONFIG_NOWHERE).unwrap();
    let agent = Agent::start(
        &node,
        &["configmap:openshift-config-managed/kube-apiserver-client-ca"],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    agent.wait_listening();
    wait_until(5 * SECOND, || {
        agent.get("/readyz").is_some_and(|(code, _)| code == 200)
    });
    let sha = sha256_hex(pem.as_bytes());
    agent.wait_sample(
        2 * SECOND,
        "kubelet_ca_bundle_info",
        &[("sha256", &sha)],
        |v| v == 1.0,
    );
    assert_eq!(
        agent.sample("kubelet_ca_last_sync_timestamp_seconds", &[]),
        None
    );
    // Not even after the adopted bundle is put back in place: that is a repair, not a
    // sync with sources that were never read.
    fs::remove_file(node.bundle()).unwrap();
    wait_until(2 * SECOND, || node.holds(&pem));
    agent.wait_metric(2 * SECOND, "kubelet_ca_repairs_total{", 1.0);
    assert_eq!(
        agent.sample("kubelet_ca_last_sync_timestamp_seconds", &[]),
        None
    );
    assert_eq!(agent.sample("kubelet_ca_bundle_in_sync", &[]), None);
}

#[test]
fn the_series_of_a_certificate_that_leaves_the_bundle_disappear() {
    let node = Node::new();
    let (stays, leaves) = (
        Signer::new("stays", Algorithm::P256),
        Signer::new("leaves", Algorithm::P384),
    );
    let source = node.source("signers.pem", stays.pem() + &leaves.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(stays.pem() + &leaves.pem()));
    agent.wait_listening();
    let series = |body: &str, name: &str| -> Vec<String> {
        samples(body, name)
            .iter()
            .map(|s| s.label("subject_CN").unwrap_or_default().to_string())
            .collect()
    };
    let mut body = String::new();
    wait_until(2 * SECOND, || {
        body = agent.get("/metrics").unwrap().1;
        series(&body, "x509_cert_not_after").len() == 2
    });

    fs::write(source_path(&source), stays.pem()).unwrap();
    wait_until(2 * SECOND, || node.holds(stays.pem()));
    // The first scrape that describes the new file (by its hash) has no trace of the
    // certificate that left.
    let sha = sha256_hex(stays.pem().as_bytes());
    wait_until(2 * SECOND, || {
        body = agent.get("/metrics").unwrap().1;
        samples(&body, "kubelet_ca_bundle_info")
            .iter()
            .any(|s| s.label("sha256") == Some(&sha))
    });
    for name in [
        "x509_cert_not_after",
        "x509_cert_not_before",
        "x509_cert_expired",
    ] {
        assert_eq!(series(&body, name), ["stays"], "{name}:\n{body}");
    }
    assert_eq!(
        samples(&body, "kubelet_ca_bundle_certificates")
            .first()
            .map(|s| s.value),
        Some(1.0)
    );
}
