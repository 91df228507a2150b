//! `run` with local sources and no cluster: rotations, drift repair, readiness, systemd
//! notify, metrics and shutdown, all against the real binary.

mod common;

use std::fs;
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use time::Duration as Span;

use common::daemon::{Agent, wait_until};
use common::pki::{self, Algorithm, Signer};
use common::{KUBECONFIG_NOWHERE, Node, fingerprint_file, history_entries, require, sha256_hex};

const SECOND: Duration = Duration::from_secs(1);

#[test]
fn a_file_source_replaced_by_mv_reaches_the_bundle_within_a_second() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::Ed25519),
    );
    let source = node.source("signers.pem", a.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));

    let path = source.strip_prefix("file:").unwrap();
    let staged = format!("{path}.new");
    fs::write(&staged, a.pem() + &b.pem()).unwrap();
    fs::rename(&staged, path).unwrap();
    let took = wait_until(SECOND, || node.holds(a.pem() + &b.pem()));
    eprintln!("rotation reached the bundle in {took:?}");
    assert!(agent.log().contains("bundle written"));
}

#[test]
fn relative_paths_are_watched_too() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    fs::create_dir_all(node.root().join("signers")).unwrap();
    fs::write(node.root().join("signers/a.crt"), a.pem()).unwrap();
    let both = a.pem() + &b.pem();
    let _agent = Agent::start_with(&node, &["dir:signers"], &[], |cmd| {
        // The command line wins over the harness's KUBELET_CA_AGENT_BUNDLE.
        cmd.current_dir(node.root())
            .arg("--bundle")
            .arg("etc/kubernetes/kubelet-ca.crt");
    });
    wait_until(5 * SECOND, || node.holds(a.pem()));
    fs::write(node.root().join("signers/b.crt"), b.pem()).unwrap();
    wait_until(SECOND, || node.holds(&both));
    fs::write(node.bundle(), "garbage").unwrap();
    wait_until(SECOND, || node.holds(&both));
}

#[test]
fn garbage_and_deletion_are_repaired_within_a_second() {
    let node = Node::new();
    let pem = pki::bundle_of(2, "ca");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));

    fs::write(node.bundle(), "garbage\n").unwrap();
    let took = wait_until(SECOND, || node.holds(&pem));
    eprintln!("garbage repaired in {took:?}");
    fs::remove_file(node.bundle()).unwrap();
    let took = wait_until(SECOND, || node.holds(&pem));
    eprintln!("deletion repaired in {took:?}");
    agent.wait_listening();
    agent.wait_metric(SECOND, "kubelet_ca_repairs_total{", 2.0);
    assert!(agent.log().contains("repaired the bundle"));
    // Someone else's content is not history: history keeps this agent's bundles.
    let history = node.state_dir().join("history");
    let entries = fs::read_dir(&history).map(|d| d.count()).unwrap_or(0);
    assert_eq!(entries, 0, "repairs must not fill history");
}

#[test]
fn a_writer_fighting_over_the_file_meets_backoff_not_a_busy_loop() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));

    // Another writer puts its own content back every 20 ms for 6 seconds.
    let start = Instant::now();
    while start.elapsed() < 6 * SECOND {
        if fs::read(node.bundle()).is_ok_and(|b| b != b"mine\n") {
            fs::write(node.bundle(), "mine\n").unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.wait_listening();
    let repairs = agent.metric("kubelet_ca_repairs_total{").unwrap();
    eprintln!("{repairs} repairs in 6 s of fighting");
    // 250 ms doubling: repairs at about 0, 0.25, 0.75, 1.75, 3.75 s: five, never dozens.
    assert!((3.0..=7.0).contains(&repairs), "{repairs} repairs");
    // Once the other writer stops, the file comes back (after the backoff).
    wait_until(10 * SECOND, || node.holds(&pem));
}

#[test]
fn after_a_repair_the_daemon_goes_idle() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));
    for _ in 0..2 {
        fs::write(node.bundle(), "garbage").unwrap();
        wait_until(2 * SECOND, || node.holds(&pem));
    }
    // Let every backoff run out, then watch the CPU: a loop that spins would burn ~200
    // ticks in 2 s; an idle daemon burns none.
    std::thread::sleep(SECOND);
    let before = common::cpu_ticks(agent.child.id());
    std::thread::sleep(2 * SECOND);
    let spent = common::cpu_ticks(agent.child.id()) - before;
    assert!(spent < 10, "{spent} ticks of CPU in 2 idle seconds");
}

/// Clears the immutable flag it was given when dropped, so that a failed assertion does not
/// leave a directory the tempdir cannot remove.
struct Immutable(std::path::PathBuf);

impl Drop for Immutable {
    fn drop(&mut self) {
        common::chattr("-i", &self.0);
    }
}

#[test]
fn a_failing_write_is_retried_with_backoff_and_converges() {
    if !require(common::is_root(), "chattr +i needs root") {
        return;
    }
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();
    agent.wait_metric(2 * SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    let before = fingerprint_file(&node.bundle());
    if !require(
        common::chattr("+i", &node.bundle_dir()),
        "chattr +i is not supported here",
    ) {
        return;
    }
    let immutable = Immutable(node.bundle_dir());
    let failures = |agent: &Agent| {
        agent
            .sample(
                "kubelet_ca_sync_errors_total",
                &[("reason", "permission_denied")],
            )
            .unwrap_or(0.0)
    };
    // The only event: the source changes. Nothing touches anything after this line until
    // the flag is cleared, so every further attempt comes from the retry timer.
    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    let first = agent.wait_sample(
        2 * SECOND,
        "kubelet_ca_sync_errors_total",
        &[("reason", "permission_denied")],
        |v| v >= 1.0,
    );
    let failed_at = Instant::now();
    agent.wait_metric(SECOND, "kubelet_ca_bundle_in_sync{", 0.0);
    let (code, verbose) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 503, "{verbose}");
    assert!(
        verbose.contains("[-]in-sync failed") && verbose.contains("Operation not permitted"),
        "{verbose}"
    );
    // A pass while the retry waits (the source written again, same content) keeps saying
    // why the write failed, not only that it did.
    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    wait_until(SECOND, || {
        agent.get("/readyz?verbose").is_some_and(|(_, v)| {
            v.contains("Operation not permitted") && v.contains("retrying with backoff")
        })
    });
    // Retries at about 1 s and 3 s after the first failure: they happen with no event at
    // all, and they are a few, not hundreds.
    wait_until(5 * SECOND, || failures(&agent) > first);
    std::thread::sleep(
        (failed_at + Duration::from_millis(3500)).saturating_duration_since(Instant::now()),
    );
    let attempts = failures(&agent);
    // At 1 s and 3 s: two (one if the machine is slow), not one a second.
    assert!(
        (first + 1.0..=first + 2.0).contains(&attempts),
        "{first} then {attempts} failed writes in 3.5 s"
    );
    assert_eq!(agent.metric("kubelet_ca_bundle_in_sync{"), Some(0.0));
    assert_eq!(
        fingerprint_file(&node.bundle()),
        before,
        "the old file is intact"
    );
    // The metrics describe the file on disk, not the bundle that could not be written.
    let on_disk = sha256_hex(a.pem().as_bytes());
    assert_eq!(
        agent.sample("kubelet_ca_bundle_info", &[("sha256", &on_disk)]),
        Some(1.0)
    );
    assert_eq!(
        agent.sample("x509_cert_not_after", &[("subject_CN", "b")]),
        None
    );
    assert!(node.stray_files().is_empty(), "{:?}", node.stray_files());
    drop(immutable);
    // The next retry (at most 4 s away) finds the directory writable.
    wait_until(10 * SECOND, || node.holds(b.pem()));
    agent.wait_metric(2 * SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    let (code, verbose) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200, "{verbose}");
    let settled = failures(&agent);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(failures(&agent), settled, "failures after convergence");
}

#[test]
fn bad_content_in_a_source_never_reaches_the_file_or_the_log() {
    let node = Node::new();
    let signer = Signer::new("good", Algorithm::P256);
    let source = node.source("signers.pem", signer.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(signer.pem()));
    agent.wait_listening();
    let before = fingerprint_file(&node.bundle());

    let key = signer.key_pem();
    fs::write(source.strip_prefix("file:").unwrap(), signer.pem() + &key).unwrap();
    agent.wait_metric(2 * SECOND, "kubelet_ca_source_up{", 0.0);
    // Every reason has its series from the start: look at this one.
    assert!(
        agent
            .sample(
                "kubelet_ca_source_errors_total",
                &[("reason", "private_key")]
            )
            .is_some_and(|v| v >= 1.0)
    );
    let (code, body) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(
        code, 200,
        "a rejected update does not make a valid file unready: {body}"
    );
    assert!(
        body.contains("[-]source:file:") && body.contains("PRIVATE KEY"),
        "{body}"
    );
    assert_eq!(fingerprint_file(&node.bundle()), before);
    let log = agent.log();
    assert!(log.contains("private_key"), "{log}");
    for line in key.lines().filter(|l| !l.starts_with("-----")) {
        assert!(!log.contains(line), "key material in the log");
    }
}

#[test]
fn an_adopted_valid_file_makes_the_agent_ready_while_the_cluster_is_unreachable() {
    let node = Node::new();
    let pem = pki::bundle_of(2, "adopted");
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &pem).unwrap();
    let before = fingerprint_file(&node.bundle());
    // A kubeconfig whose server refuses connections.
    let kubeconfig = node.root().join("kubeconfig");
    fs::write(&kubeconfig, KUBECONFIG_NOWHERE).unwrap();
    let agent = Agent::start(
        &node,
        &["configmap:openshift-config-managed/kube-apiserver-client-ca"],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    let took = wait_until(5 * SECOND, || {
        agent.get("/readyz").is_some_and(|(code, _)| code == 200)
    });
    eprintln!("ready {took:?} after the first poll");
    let (_, verbose) = agent.get("/readyz?verbose").unwrap();
    assert!(
        verbose.contains("[+]bundle-valid ok") && verbose.contains("[-]source:configmap:"),
        "{verbose}"
    );
    assert_eq!(agent.metric("kubelet_ca_source_up{"), Some(0.0));
    assert_eq!(agent.metric("kubelet_ca_bundle_certificates{"), Some(2.0));
    std::thread::sleep(SECOND);
    assert_eq!(
        fingerprint_file(&node.bundle()),
        before,
        "the adopted file is left alone"
    );
}

#[test]
fn while_the_cluster_is_unreachable_the_adopted_bundle_is_what_a_repair_restores() {
    let node = Node::new();
    let pem = pki::bundle_of(2, "adopted");
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
    // Nothing to compare with yet: no in-sync series rather than a false 0.
    assert_eq!(agent.metric("kubelet_ca_bundle_in_sync{"), None);
    fs::remove_file(node.bundle()).unwrap();
    wait_until(SECOND, || node.holds(&pem));
    std::thread::sleep(Duration::from_millis(300));
    fs::write(node.bundle(), "a stale bundle from somewhere else").unwrap();
    wait_until(2 * SECOND, || node.holds(&pem));
    // The counter follows the rename by a moment: wait for it, then check it stays.
    agent.wait_metric(SECOND, "kubelet_ca_repairs_total{", 2.0);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(agent.metric("kubelet_ca_repairs_total{"), Some(2.0));
}

#[test]
fn a_changed_mode_is_put_back_without_rewriting_the_file() {
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));
    let (inode, ..) = fingerprint_file(&node.bundle());
    fs::set_permissions(node.bundle(), fs::Permissions::from_mode(0o600)).unwrap();
    let mode = || fs::metadata(node.bundle()).unwrap().permissions().mode() & 0o777;
    wait_until(SECOND, || mode() == 0o644);
    assert_eq!(
        fingerprint_file(&node.bundle()).0,
        inode,
        "the file was rewritten"
    );
    agent.wait_listening();
    agent.wait_metric(SECOND, "kubelet_ca_repairs_total{", 1.0);
}

#[test]
fn a_changed_owner_is_put_back_without_rewriting_the_file() {
    use std::os::unix::fs::MetadataExt;
    if !require(common::is_root(), "changing a file's owner needs root") {
        return;
    }
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));
    let (inode, ..) = fingerprint_file(&node.bundle());
    std::os::unix::fs::chown(node.bundle(), Some(65534), Some(65534)).unwrap();
    let owner = || {
        let m = fs::metadata(node.bundle()).unwrap();
        (m.uid(), m.gid(), m.mode() & 0o777)
    };
    wait_until(SECOND, || owner() == (0, 0, 0o644));
    assert_eq!(
        fingerprint_file(&node.bundle()).0,
        inode,
        "the file was rewritten"
    );
    agent.wait_listening();
    agent.wait_metric(SECOND, "kubelet_ca_repairs_total{", 1.0);
}

#[test]
fn an_emptied_member_of_a_dir_source_does_not_drop_its_signers() {
    let node = Node::new();
    let dir = node.root().join("signers");
    fs::create_dir_all(&dir).unwrap();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    fs::write(dir.join("a.crt"), a.pem()).unwrap();
    fs::write(dir.join("b.crt"), b.pem()).unwrap();
    let agent = Agent::start(&node, &[&format!("dir:{}", dir.display())], &[]);
    let both = a.pem() + &b.pem();
    wait_until(5 * SECOND, || node.holds(&both));
    agent.wait_listening();
    // `cp` truncates before it writes: the moment in between must not cost b's clients.
    fs::write(dir.join("b.crt"), "").unwrap();
    agent.wait_metric(2 * SECOND, "kubelet_ca_source_up{", 0.0);
    assert_eq!(fs::read(node.bundle()).unwrap(), both.as_bytes());
    assert!(agent.log().contains("empty_file"));
    fs::write(dir.join("b.crt"), b.pem()).unwrap();
    agent.wait_metric(2 * SECOND, "kubelet_ca_source_up{", 1.0);
}

#[test]
fn records_are_kept_even_when_no_write_is_needed() {
    let node = Node::new();
    let pem = pki::bundle_of(2, "ca");
    let source = node.source("signers.pem", &pem);
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &pem).unwrap();
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    let managed = node.state_dir().join("managed-files.json");
    wait_until(2 * SECOND, || managed.exists());
    let json: serde_json::Value = serde_json::from_slice(&fs::read(&managed).unwrap()).unwrap();
    let sha = {
        use sha2::{Digest, Sha256};
        hex::encode(Sha256::digest(pem.as_bytes()))
    };
    assert_eq!(json["files"][0]["sha256"], sha);
    assert_eq!(json["files"][0]["path"], node.bundle().to_str().unwrap());
}

#[test]
fn systemd_hears_ready_status_and_watchdog() {
    let node = Node::new();
    let socket_path = node.root().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let source = node.source("signers.pem", pki::bundle_of(1, "ca"));
    let _agent = Agent::start_with(&node, &[&source], &[], |cmd| {
        cmd.env("NOTIFY_SOCKET", &socket_path)
            .env("WATCHDOG_USEC", "200000");
    });
    let mut messages = Vec::new();
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    while start.elapsed() < 2 * SECOND {
        if let Ok(n) = socket.recv(&mut buf) {
            messages.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    let all = messages.join("\n");
    assert!(all.contains("READY=1"), "{all}");
    assert!(
        all.lines()
            .any(|l| l.starts_with("STATUS=in sync: 1 certificates")),
        "{all}"
    );
    let watchdogs = messages.iter().filter(|m| m.contains("WATCHDOG=1")).count();
    // Every 100 ms (half of WATCHDOG_USEC) for 2 s: about 20, not one on every turn of
    // the loop.
    assert!(
        (10..=30).contains(&watchdogs),
        "{watchdogs} watchdog pings in 2 s"
    );
    let ready_at = messages.iter().position(|m| m.contains("READY=1")).unwrap();
    assert_eq!(
        messages.iter().filter(|m| m.contains("READY=1")).count(),
        1,
        "READY=1 is sent once"
    );
    assert!(ready_at < 3, "READY=1 comes first thing: {all}");
}

#[test]
fn sigterm_exits_0() {
    let node = Node::new();
    let source = node.source("signers.pem", pki::bundle_of(1, "ca"));
    let mut agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    let status = agent.terminate();
    assert_eq!(status.code(), Some(0), "{}", agent.log());
}

#[test]
fn metrics_follow_the_bundle() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("kube-csr-signer", Algorithm::P256),
        Signer::new("old-signer", Algorithm::P384),
    );
    let source = node.source("signers.pem", a.pem() + &b.pem());
    let agent = Agent::start(&node, &[&source], &["--node-name", "worker-1"]);
    agent.wait_listening();
    agent.wait_metric(5 * SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    let (_, body) = agent.get("/metrics").unwrap();
    for needle in [
        "x509_cert_not_after{filepath=",
        "subject_CN=\"kube-csr-signer\"",
        "subject_CN=\"old-signer\"",
        "x509_cert_expired{",
        "kubelet_ca_bundle_certificates{",
        "kubelet_ca_source_up{source=\"file:",
        "kubelet_ca_agent_build_info{version=",
        "node=\"worker-1\"",
        "process_resident_memory_bytes ",
        "kubelet_ca_sync_duration_seconds_bucket{le=",
    ] {
        assert!(body.contains(needle), "missing {needle} in\n{body}");
    }
    // A certificate that leaves the bundle leaves the metrics at the next scrape.
    fs::write(source.strip_prefix("file:").unwrap(), a.pem()).unwrap();
    wait_until(2 * SECOND, || {
        agent
            .get("/metrics")
            .is_some_and(|(_, m)| !m.contains("old-signer"))
    });
    // Prometheus text by default; OpenMetrics when the scraper asks for it.
    let (_, head, text) = agent.get_with("/metrics", "").unwrap();
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert!(text.contains("# TYPE kubelet_ca_writes_total counter") && !text.contains("# EOF"));
    let accept = "Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n";
    let (_, head, om) = agent.get_with("/metrics", accept).unwrap();
    assert!(head.contains("application/openmetrics-text"), "{head}");
    assert!(om.contains("# TYPE kubelet_ca_writes counter") && om.trim_end().ends_with("# EOF"));
}

#[test]
fn the_bundle_changes_at_a_certificate_boundary_with_no_other_event() {
    let node = Node::new();
    let lasting = Signer::new("lasting", Algorithm::P256);
    let brief = Signer::valid_between("brief", Algorithm::P256, Span::hours(-1), Span::seconds(3));
    let source = node.source("signers.pem", lasting.pem() + &brief.pem());
    let agent = Agent::start(&node, &[&source], &["--drop-expired"]);
    wait_until(5 * SECOND, || node.holds(lasting.pem() + &brief.pem()));
    // Nothing touches the source; the timer at brief's notAfter drops it.
    wait_until(6 * SECOND, || node.holds(lasting.pem()));
    // The log line follows the rename.
    wait_until(SECOND, || agent.log().contains("removed=1"));
}

#[test]
fn exec_on_change_runs_after_each_replace_and_failures_are_counted() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    // In the state directory: a hook runs inside the agent's confinement.
    let marker = node.state_dir().join("hook-ran");
    let hook = format!(
        "sh -c 'cat \"$KUBELET_CA_BUNDLE\" > {}; exit 3'",
        marker.display()
    );
    let agent = Agent::start(&node, &[&source], &["--exec-on-change", &hook]);
    wait_until(5 * SECOND, || {
        fs::read(&marker).is_ok_and(|m| m == a.pem().as_bytes())
    });
    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    wait_until(2 * SECOND, || {
        fs::read(&marker).is_ok_and(|m| m == b.pem().as_bytes())
    });
    agent.wait_listening();
    agent.wait_metric(2 * SECOND, "kubelet_ca_exec_on_change_failures_total", 2.0);
}

#[test]
fn promtool_accepts_the_metrics() {
    let node = Node::new();
    let source = node.source("signers.pem", pki::bundle_of(3, "ca"));
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    agent.wait_metric(5 * SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    let (_, body) = agent.get("/metrics").unwrap();
    let mut promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool is installed (scripts/test.sh installs prometheus)");
    use std::io::Write;
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn listen_must_be_loopback_for_insecure_metrics() {
    let node = Node::new();
    let out = std::process::Command::new(common::agent_bin())
        .args([
            "run",
            "--source",
            "file:/x.pem",
            "--listen",
            "0.0.0.0:9745",
            "--insecure-metrics",
        ])
        .arg("--bundle")
        .arg(node.bundle())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));
}

/// Replaces the bundle the way another tool would (write beside it, rename over it), so
/// that the agent never sees it half-written.
fn replace_behind_the_agents_back(node: &Node, content: &str) {
    let staged = node.bundle_dir().join("someone-else.tmp");
    fs::write(&staged, content).unwrap();
    fs::rename(&staged, node.bundle()).unwrap();
}

#[test]
fn run_keeps_each_replaced_bundle_in_history_mode_0600() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let path_of = |s: &str| s.strip_prefix("file:").unwrap().to_string();
    let source = node.source("signers.pem", a.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();
    // The first write replaced nothing: nothing to keep.
    assert!(history_entries(&node.state_dir()).is_empty());

    let both = a.pem() + &b.pem();
    fs::write(path_of(&source), &both).unwrap();
    wait_until(2 * SECOND, || node.holds(&both));
    // History is written by the records thread, a moment after the rename.
    wait_until(2 * SECOND, || history_entries(&node.state_dir()).len() == 1);
    let (name, content, mode) = history_entries(&node.state_dir()).remove(0);
    assert_eq!(
        content,
        a.pem().as_bytes(),
        "history holds the replaced bundle"
    );
    assert_eq!(format!("{mode:o}"), "600", "{name}");
    assert!(
        name.ends_with(&format!("-{}.crt", sha256_hex(a.pem().as_bytes()))),
        "{name}"
    );

    fs::write(path_of(&source), b.pem()).unwrap();
    wait_until(2 * SECOND, || node.holds(b.pem()));
    wait_until(2 * SECOND, || history_entries(&node.state_dir()).len() == 2);
    let entries = history_entries(&node.state_dir());
    // Names sort by their sequence number: the newest is last.
    assert_eq!(entries[0].1, a.pem().as_bytes());
    assert_eq!(entries[1].1, both.as_bytes());
    assert!(entries.iter().all(|(_, _, mode)| *mode == 0o600));
}

#[test]
fn what_a_repair_overwrites_is_not_history_even_a_valid_bundle() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    // Someone else's bundle: valid, current, just not what the sources say.
    let foreign = pki::bundle_of(2, "foreign");
    let source = node.source("signers.pem", a.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();

    replace_behind_the_agents_back(&node, &foreign);
    wait_until(2 * SECOND, || node.holds(a.pem()));
    agent.wait_metric(2 * SECOND, "kubelet_ca_repairs_total{", 1.0);

    // A real rotation afterwards does keep history: the repair's absence below is not
    // history being broken altogether.
    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    wait_until(2 * SECOND, || node.holds(b.pem()));
    wait_until(2 * SECOND, || {
        history_entries(&node.state_dir())
            .iter()
            .any(|(_, content, _)| content == a.pem().as_bytes())
    });
    // Give a late record the time to land before looking for what must not be there.
    std::thread::sleep(Duration::from_millis(300));
    let entries = history_entries(&node.state_dir());
    assert!(
        entries
            .iter()
            .all(|(_, content, _)| content != foreign.as_bytes()),
        "the bundle a repair overwrote was saved: {:?}",
        entries.iter().map(|(name, ..)| name).collect::<Vec<_>>()
    );
    assert_eq!(entries.len(), 1, "{entries:?}");
}

#[test]
fn a_file_whose_every_certificate_expired_is_not_adopted_nor_restored() {
    let node = Node::new();
    let expired: String = (0..2)
        .map(|i| {
            Signer::valid_between(
                &format!("expired-{i}"),
                Algorithm::P256,
                Span::days(-30),
                Span::days(-1),
            )
            .pem()
        })
        .collect();
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &expired).unwrap();
    let kubeconfig = node.root().join("kubeconfig");
    fs::write(&kubeconfig, KUBECONFIG_NOWHERE).unwrap();
    let agent = Agent::start(
        &node,
        &["configmap:openshift-config-managed/kube-apiserver-client-ca"],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    agent.wait_listening();
    let verbose = || agent.get("/readyz?verbose").unwrap();
    // Wait for the source to be reported down: the start is over by then.
    wait_until(5 * SECOND, || verbose().1.contains("[-]source:configmap:"));
    let (code, body) = verbose();
    assert_eq!(code, 503, "an expired bundle is not ready: {body}");
    assert!(
        body.contains("[-]bundle-valid failed: no certificate in the file is valid now"),
        "{body}"
    );
    assert!(
        !agent.log().contains("adopted the valid bundle"),
        "{}",
        agent.log()
    );

    // Not adopted, so not what a repair puts back while the cluster is unreachable.
    fs::remove_file(node.bundle()).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        fs::symlink_metadata(node.bundle()).is_err(),
        "the expired bundle was restored"
    );
    assert_eq!(agent.get("/readyz").map(|(code, _)| code), Some(503));
    assert!(agent.metric("kubelet_ca_writes_total{").unwrap_or(0.0) == 0.0);
}

#[test]
fn a_bundle_is_never_built_from_the_sources_read_so_far() {
    let node = Node::new();
    let adopted = pki::bundle_of(2, "adopted");
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &adopted).unwrap();
    let before = fingerprint_file(&node.bundle());
    let local = node.source("local.pem", Signer::new("local", Algorithm::P256).pem());
    let kubeconfig = node.root().join("kubeconfig");
    fs::write(&kubeconfig, KUBECONFIG_NOWHERE).unwrap();
    let agent = Agent::start(
        &node,
        &[
            &local,
            "configmap:openshift-config-managed/kube-apiserver-client-ca",
        ],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    agent.wait_listening();
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_source_up",
        &[("source", &local)],
        |v| v == 1.0,
    );
    wait_until(5 * SECOND, || {
        agent.get("/readyz").is_some_and(|(code, _)| code == 200)
    });
    std::thread::sleep(SECOND);
    assert!(
        fingerprint_file(&node.bundle()) == before,
        "a bundle built from the local source alone replaced the adopted one"
    );

    // The local source changes: still only one of two sources read.
    let changed_at = agent
        .sample(
            "kubelet_ca_source_last_change_timestamp_seconds",
            &[("source", &local)],
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    fs::write(
        local.strip_prefix("file:").unwrap(),
        Signer::new("local-2", Algorithm::P256).pem(),
    )
    .unwrap();
    agent.wait_sample(
        2 * SECOND,
        "kubelet_ca_source_last_change_timestamp_seconds",
        &[("source", &local)],
        |t| t > changed_at,
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        fingerprint_file(&node.bundle()) == before,
        "a bundle built from the changed local source alone replaced the adopted one"
    );

    // And a repair puts back the adopted bundle, not the local source's.
    fs::remove_file(node.bundle()).unwrap();
    wait_until(2 * SECOND, || node.holds(&adopted));
    assert_eq!(agent.metric("kubelet_ca_bundle_in_sync{"), None);
    assert_eq!(
        agent.metric("kubelet_ca_last_sync_timestamp_seconds{"),
        None
    );
}

#[test]
fn an_adopted_bundle_is_no_longer_restored_once_every_certificate_expired() {
    let node = Node::new();
    let brief = Signer::valid_between("brief", Algorithm::P256, Span::hours(-1), Span::seconds(4));
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), brief.pem()).unwrap();
    let kubeconfig = node.root().join("kubeconfig");
    fs::write(&kubeconfig, KUBECONFIG_NOWHERE).unwrap();
    let agent = Agent::start(
        &node,
        &["configmap:openshift-config-managed/kube-apiserver-client-ca"],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    agent.wait_listening();
    wait_until(3 * SECOND, || {
        agent.get("/readyz").is_some_and(|(code, _)| code == 200)
    });
    // While it holds a certificate valid now, the adopted bundle is what a repair restores.
    fs::remove_file(node.bundle()).unwrap();
    wait_until(SECOND, || node.holds(brief.pem()));
    // Its last certificate expires: readiness follows with no other event, and from then
    // on a deleted file is not brought back with nothing valid in it.
    wait_until(8 * SECOND, || {
        agent.get("/readyz?verbose").is_some_and(|(code, body)| {
            code == 503 && body.contains("no certificate in the file is valid now")
        })
    });
    fs::remove_file(node.bundle()).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        fs::symlink_metadata(node.bundle()).is_err(),
        "an all-expired bundle was restored"
    );
}

#[test]
fn a_retained_signer_leaves_the_file_when_its_window_ends_with_no_other_event() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem() + &b.pem());
    let agent = Agent::start(&node, &[&source], &["--retain-removed", "3s"]);
    wait_until(5 * SECOND, || node.holds(a.pem() + &b.pem()));
    agent.wait_listening();
    // b leaves the source: it stays in the file for its window...
    fs::write(source.strip_prefix("file:").unwrap(), a.pem()).unwrap();
    std::thread::sleep(SECOND);
    assert!(node.holds(a.pem() + &b.pem()), "b was not retained");
    // ...and leaves when the window ends, on the loop's own timer: nothing else happens.
    let took = wait_until(5 * SECOND, || node.holds(a.pem()));
    eprintln!("the retained signer left {took:?} after the first second");
}
