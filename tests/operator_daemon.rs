//! What an operator reads when the node agent cannot do its job, through the real binary:
//! each cause is named as it is (a source of leaf certificates, expired signers, a
//! directory at the bundle path, a spec with a part missing, a non-CA file of a `dir:`
//! source), health does not claim what the agent cannot see, every counter has its series
//! from the start, and the agent says whether the kubelet uses the bundle at all.

mod common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use time::{Duration as Span, OffsetDateTime};

use common::daemon::{Agent, check_line, samples, wait_until};
use common::pki::{self, Algorithm, Signer};
use common::{KUBECONFIG_NOWHERE, Node, sha256_hex, stderr};

const SECOND: Duration = Duration::from_secs(1);

/// The short form of a certificate's SHA-256 the agent prints: its first 12 hex digits.
fn short_sha256(pem: &str) -> String {
    let der = pem::parse(pem).unwrap().into_contents();
    sha256_hex(&der)[..12].to_string()
}

/// The one line `sync` ends with on failure (the warnings before it are not the error).
fn error_line(out: &std::process::Output) -> String {
    let err = stderr(out);
    err.lines()
        .find(|l| l.starts_with("kubelet-ca-agent: error:"))
        .unwrap_or_else(|| panic!("no error line in {err}"))
        .to_string()
}

fn verbose(agent: &Agent) -> (u16, String) {
    agent.get("/readyz?verbose").unwrap_or_default()
}

// Issue #18, item 8: a source of leaf certificates only.

#[test]
fn sync_names_the_certificates_dropped_as_not_cas_when_nothing_else_is_left() {
    let node = Node::new();
    let (leaf_a, leaf_b) = (pki::leaf("serving-a"), pki::leaf("serving-b"));
    let source = node.source("leaves.pem", leaf_a.clone() + &leaf_b);
    let out = node.sync(&[&source], &[]);
    let err = error_line(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("not a CA"), "{err}");
    for (cn, pem) in [("serving-a", &leaf_a), ("serving-b", &leaf_b)] {
        assert!(err.contains(cn), "{cn} not named: {err}");
        assert!(
            err.contains(&short_sha256(pem)),
            "{cn}'s sha256 not named: {err}"
        );
    }
    // Not the clock: nothing here is expired.
    assert!(!err.contains("none is valid now"), "{err}");
    assert!(!node.bundle().exists());
}

#[test]
fn run_says_every_certificate_was_dropped_as_not_a_ca_and_counts_it_apart() {
    let node = Node::new();
    let leaf = pki::leaf("kube-apiserver-serving");
    let source = node.source("leaves.pem", &leaf);
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_sync_errors_total",
        &[("reason", "no_ca_certificate")],
        |v| v == 1.0,
    );
    let no_valid = agent.sample(
        "kubelet_ca_sync_errors_total",
        &[("reason", "no_valid_certificate")],
    );
    assert!(no_valid.unwrap_or(0.0) == 0.0, "{no_valid:?}");
    let (code, page) = verbose(&agent);
    assert_eq!(code, 503, "{page}");
    let line = check_line(&page, "in-sync");
    assert!(
        line.starts_with("[-]")
            && line.contains("not a CA")
            && line.contains("kube-apiserver-serving")
            && line.contains(&short_sha256(&leaf)),
        "{page}"
    );
    let log = agent.log();
    assert!(
        log.contains("no_ca_certificate") && log.contains(&short_sha256(&leaf)),
        "{log}"
    );
    assert!(!log.contains("none is valid now"), "{log}");
}

// Item 8: a bundle whose every certificate expired names them and their notAfter.

/// The UTC dates `not_after` can have fallen on for a signer made now with notAfter one
/// day ago (two when the test runs across midnight).
fn dates_one_day_ago() -> Vec<String> {
    let day = |t: OffsetDateTime| t.date().to_string();
    let now = OffsetDateTime::now_utc() - Span::days(1);
    vec![day(now - Span::minutes(1)), day(now + Span::minutes(1))]
}

#[test]
fn sync_names_each_expired_certificate_with_its_not_after() {
    let node = Node::new();
    let expired = Signer::valid_between(
        "old-signer",
        Algorithm::P256,
        Span::days(-30),
        Span::days(-1),
    );
    let source = node.source("signers.pem", expired.pem());
    let out = node.sync(&[&source], &[]);
    let err = error_line(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("old-signer") && err.contains(&short_sha256(&expired.pem())),
        "{err}"
    );
    assert!(err.contains("expired"), "{err}");
    assert!(
        dates_one_day_ago().iter().any(|d| err.contains(d.as_str())),
        "notAfter not named: {err}"
    );
}

#[test]
fn run_names_each_expired_certificate_with_its_not_after_in_health() {
    let node = Node::new();
    let expired = Signer::valid_between(
        "old-signer",
        Algorithm::P256,
        Span::days(-30),
        Span::days(-1),
    );
    let source = node.source("signers.pem", expired.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_sync_errors_total",
        &[("reason", "no_valid_certificate")],
        |v| v == 1.0,
    );
    let line = check_line(&verbose(&agent).1, "in-sync");
    assert!(line.contains("old-signer"), "{line}");
    assert!(
        dates_one_day_ago()
            .iter()
            .any(|d| line.contains(d.as_str())),
        "notAfter not named: {line}"
    );
}

// Item 8: a directory at the bundle path.

#[test]
fn a_directory_at_the_bundle_path_is_named_for_what_it_is_and_left_alone() {
    let node = Node::new();
    fs::create_dir_all(node.bundle()).unwrap();
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_sync_errors_total",
        &[("reason", "not_a_file")],
        |v| v >= 1.0,
    );
    let io_errors = agent.sample("kubelet_ca_sync_errors_total", &[("reason", "io_error")]);
    assert!(io_errors.unwrap_or(0.0) == 0.0, "{io_errors:?}");
    let (code, page) = verbose(&agent);
    assert_eq!(code, 503, "{page}");
    let line = check_line(&page, "in-sync");
    assert!(
        line.starts_with("[-]") && line.contains("a directory") && line.contains("rmdir"),
        "{page}"
    );
    let log = agent.log();
    assert!(!log.contains("replacing it"), "{log}");
    assert!(!log.contains("Is a directory"), "{log}");
    assert!(node.bundle().is_dir(), "the directory was touched");
    // Once the directory is gone, the file follows at once.
    fs::remove_dir(node.bundle()).unwrap();
    wait_until(3 * SECOND, || node.holds(&pem));
}

// Item 12: a spec with a part missing says which.

#[test]
fn a_source_spec_without_a_name_says_the_name_is_missing() {
    let node = Node::new();
    for (spec, says) in [
        ("configmap:ns-only", "name is missing"),
        ("configmap:ns-only/", "name is missing"),
        ("configmap:", "namespace and name are missing"),
        ("configmap:/name", "namespace is missing"),
        ("controllerconfig:", "name is missing"),
    ] {
        let out = node.sync(&[spec], &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{spec}: {err}");
        assert!(err.contains(says), "{spec}: {err}");
        assert!(err.contains(&format!("{spec:?}")), "{spec}: {err}");
    }
}

// Item 15: a non-CA warning from a `dir:` source names the file.

#[test]
fn a_non_ca_certificate_of_a_dir_source_is_named_with_its_file() {
    let node = Node::new();
    let signers = node.root().join("signers");
    fs::create_dir_all(&signers).unwrap();
    let ca = Signer::new("ca", Algorithm::P256);
    fs::write(signers.join("ca.crt"), ca.pem()).unwrap();
    fs::write(signers.join("server.pem"), pki::leaf("a-server")).unwrap();
    let spec = format!("dir:{}", signers.display());
    let agent = Agent::start(&node, &[&spec], &[]);
    wait_until(5 * SECOND, || node.holds(ca.pem()));
    wait_until(2 * SECOND, || agent.log().contains("a-server"));
    let log = agent.log();
    let line = log.lines().find(|l| l.contains("a-server")).unwrap();
    assert!(line.contains("server.pem"), "{line}");
    // `sync` says the same (on a node of its own: the running agent holds this one).
    let out = Node::new().sync(&[&spec], &[]);
    let err = stderr(&out);
    let line = err.lines().find(|l| l.contains("a-server")).unwrap_or("");
    assert!(line.contains("server.pem"), "{err}");
}

// Item 19: in sync is not claimed for what the agent cannot see.

#[test]
fn in_sync_is_not_claimed_before_any_source_was_read() {
    let node = Node::new();
    let missing = format!("file:{}", node.root().join("absent.pem").display());
    let agent = Agent::start(&node, &[&missing], &[]);
    agent.wait_listening();
    wait_until(5 * SECOND, || {
        check_line(&verbose(&agent).1, &format!("source:{missing}")).starts_with("[-]")
    });
    let (code, page) = verbose(&agent);
    assert_eq!(code, 503, "the file does not exist: {page}");
    let line = check_line(&page, "in-sync");
    assert!(
        line.starts_with("[?]in-sync unknown: not known yet") && line.contains("no source"),
        "{page}"
    );
    assert!(
        check_line(&page, "bundle-valid").contains("does not exist"),
        "{page}"
    );
}

#[test]
fn an_adopted_bundle_is_ready_but_not_claimed_in_sync_until_the_sources_are_read() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "adopted");
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &pem).unwrap();
    let kubeconfig = node.root().join("kubeconfig");
    fs::write(&kubeconfig, KUBECONFIG_NOWHERE).unwrap();
    let spec = "configmap:openshift-config-managed/kube-apiserver-client-ca";
    let agent = Agent::start(
        &node,
        &[spec],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    agent.wait_listening();
    wait_until(5 * SECOND, || verbose(&agent).0 == 200);
    let line = check_line(&verbose(&agent).1, "in-sync");
    assert!(
        line.starts_with("[?]in-sync unknown: not known yet") && line.contains(spec),
        "{line}"
    );
}

// Item 22: every counter has its series from the start.

#[test]
fn counters_have_their_series_at_zero_from_the_start() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(&pem));
    agent.wait_listening();
    agent.wait_metric(2 * SECOND, "kubelet_ca_bundle_in_sync{", 1.0);
    let (_, body) = agent.get("/metrics").unwrap();
    let filepath = node.bundle().display().to_string();
    let zero = |name: &str, labels: &[(&str, &str)]| {
        let found = samples(&body, name).into_iter().find(|s| s.has(labels));
        assert_eq!(
            found.map(|s| s.value),
            Some(0.0),
            "{name} {labels:?} in\n{body}"
        );
    };
    zero("kubelet_ca_repairs_total", &[("filepath", &filepath)]);
    for reason in [
        "permission_denied",
        "no_space",
        "read_only",
        "io_error",
        "not_a_file",
        "no_valid_certificate",
        "no_ca_certificate",
        "attributes",
    ] {
        zero(
            "kubelet_ca_sync_errors_total",
            &[("filepath", &filepath), ("reason", reason)],
        );
    }
    for reason in [
        "unreadable",
        "too_large",
        "malformed_pem",
        "private_key",
        "not_certificate",
        "unparsable_certificate",
        "no_certificate",
    ] {
        zero(
            "kubelet_ca_source_errors_total",
            &[("source", &source), ("reason", reason)],
        );
    }
    zero(
        "kubelet_ca_rejected_certificates_total",
        &[("source", &source), ("reason", "not_ca")],
    );
    zero("kubelet_ca_exec_on_change_failures_total", &[]);
    for record in ["history", "retention", "managed_files"] {
        zero("kubelet_ca_state_errors_total", &[("record", record)]);
    }
    // A local source has no watch, and no API server to be refused by.
    for (name, reason) in [
        ("kubelet_ca_watch_restarts_total", None),
        ("kubelet_ca_source_errors_total", Some("forbidden")),
    ] {
        let mut labels = vec![("source", source.as_str())];
        labels.extend(reason.map(|r| ("reason", r)));
        assert!(
            samples(&body, name).iter().all(|s| !s.has(&labels)),
            "{name} {labels:?} in\n{body}"
        );
    }
    promtool_accepts(&body);
}

#[test]
fn a_cluster_source_has_its_watch_and_api_series_from_the_start() {
    let node = Node::new();
    let kubeconfig = node.root().join("kubeconfig");
    fs::write(&kubeconfig, KUBECONFIG_NOWHERE).unwrap();
    let spec = "configmap:openshift-config-managed/kube-apiserver-client-ca";
    let agent = Agent::start(
        &node,
        &[spec],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    agent.wait_listening();
    let (_, body) = agent.get("/metrics").unwrap();
    let has =
        |name: &str, labels: &[(&str, &str)]| samples(&body, name).iter().any(|s| s.has(labels));
    assert!(
        has("kubelet_ca_watch_restarts_total", &[("source", spec)]),
        "{body}"
    );
    for reason in ["forbidden", "not_found", "missing_key", "private_key"] {
        assert!(
            has(
                "kubelet_ca_source_errors_total",
                &[("source", spec), ("reason", reason)]
            ),
            "{reason}: {body}"
        );
    }
    assert!(
        has("kubelet_ca_sync_errors_total", &[("reason", "credentials")]),
        "{body}"
    );
    promtool_accepts(&body);
}

fn promtool_accepts(body: &str) {
    use std::io::Write;
    let mut promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool is installed (scripts/test.sh installs prometheus)");
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

// Item 2: whether the kubelet uses the bundle at all.

/// An agent on `node` with its kubelet config at `config`, and its source in place.
fn agent_with_kubelet_config(node: &Node, config: &Path) -> Agent {
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("signers.pem", &pem);
    let agent = Agent::start_with(node, &[&source], &[], |cmd| {
        cmd.env("KUBELET_CA_AGENT_KUBELET_CONFIG", config);
    });
    wait_until(5 * SECOND, || node.holds(&pem));
    agent.wait_listening();
    agent
}

const USES: &str = "kubelet_ca_kubelet_uses_bundle";

#[test]
fn a_kubelet_config_that_names_the_bundle_is_reported_used() {
    let node = Node::new();
    let config = node.root().join("var/lib/kubelet/config.yaml");
    fs::create_dir_all(config.parent().unwrap()).unwrap();
    // As kubeadm writes it.
    fs::write(
        &config,
        format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nauthentication:\n  anonymous:\n    enabled: false\n  webhook:\n    cacheTTL: 0s\n    enabled: true\n  x509:\n    clientCAFile: {}\nauthorization:\n  mode: Webhook\ncgroupDriver: systemd\n",
            node.bundle().display()
        ),
    )
    .unwrap();
    let agent = agent_with_kubelet_config(&node, &config);
    let filepath = node.bundle().display().to_string();
    agent.wait_sample(5 * SECOND, USES, &[("filepath", &filepath)], |v| v == 1.0);
    let (code, page) = verbose(&agent);
    assert_eq!(code, 200, "{page}");
    assert_eq!(
        check_line(&page, "kubelet-uses-bundle"),
        "[+]kubelet-uses-bundle ok",
        "{page}"
    );
}

#[test]
fn a_kubelet_config_that_names_another_file_is_reported_without_failing_readiness() {
    let node = Node::new();
    let config = node.bundle_dir().join("kubelet.conf");
    fs::create_dir_all(node.bundle_dir()).unwrap();
    // As OpenShift renders it: JSON.
    fs::write(
        &config,
        r#"{"kind":"KubeletConfiguration","apiVersion":"kubelet.config.k8s.io/v1beta1","authentication":{"x509":{"clientCAFile":"/etc/kubernetes/kubelet-ca-old.crt"},"webhook":{"enabled":true}}}"#,
    )
    .unwrap();
    let agent = agent_with_kubelet_config(&node, &config);
    let filepath = node.bundle().display().to_string();
    agent.wait_sample(5 * SECOND, USES, &[("filepath", &filepath)], |v| v == 0.0);
    let (code, page) = verbose(&agent);
    assert_eq!(
        code, 200,
        "the kubelet's choice does not fail readiness: {page}"
    );
    let line = check_line(&page, "kubelet-uses-bundle");
    assert!(
        line.starts_with("[-]kubelet-uses-bundle failed")
            && line.contains("/etc/kubernetes/kubelet-ca-old.crt")
            && line.contains(&config.display().to_string()),
        "{page}"
    );
}

#[test]
fn without_a_kubelet_config_the_use_of_the_bundle_is_not_known() {
    let node = Node::new();
    let config = node.root().join("var/lib/kubelet/config.yaml");
    let agent = agent_with_kubelet_config(&node, &config);
    wait_until(5 * SECOND, || {
        check_line(&verbose(&agent).1, "kubelet-uses-bundle")
            .contains(&format!("no file at {}", config.display()))
    });
    let (code, page) = verbose(&agent);
    assert_eq!(code, 200, "{page}");
    assert!(
        check_line(&page, "kubelet-uses-bundle")
            .starts_with("[?]kubelet-uses-bundle unknown: not known"),
        "{page}"
    );
    // Not known is neither failed nor ok (issue 34): no line says the check failed.
    assert!(!page.contains("[-]kubelet-uses-bundle"), "{page}");
    assert!(!page.contains("[+]kubelet-uses-bundle"), "{page}");
    assert!(
        check_line(&page, "kubelet-uses-bundle").ends_with("(not counted)"),
        "{page}"
    );
    let (_, body) = agent.get("/metrics").unwrap();
    assert!(samples(&body, USES).is_empty(), "{body}");
}

// Issue 34, item 6: an expired signer the sources still carry beside a valid one.

#[test]
fn an_expired_signer_beside_a_valid_one_is_a_warning_naming_it_in_the_log_and_in_health() {
    let node = Node::new();
    let expired = Signer::valid_between(
        "old-signer",
        Algorithm::P256,
        Span::days(-30),
        Span::days(-1),
    );
    let live = Signer::new("new-signer", Algorithm::P256);
    let source = node.source("signers.pem", expired.pem() + &live.pem());
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    wait_until(5 * SECOND, || verbose(&agent).0 == 200);
    // The bundle keeps it (the default), and says so: ready, with a warning naming it.
    let page = verbose(&agent).1;
    let line = check_line(&page, "bundle-valid");
    assert!(
        line.starts_with("[+]bundle-valid ok, with a warning:"),
        "{page}"
    );
    assert!(
        line.contains("old-signer") && line.contains(&short_sha256(&expired.pem())),
        "{line}"
    );
    assert!(line.contains("--drop-expired"), "{line}");
    assert!(!line.contains("new-signer"), "{line}");
    // The log: a WARN line naming it (not INFO), once the bundle is written.
    wait_until(5 * SECOND, || agent.log().contains("expired certificate"));
    let log = agent.log();
    let warned = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("old-signer"))
        .unwrap_or_else(|| panic!("no WARN line names old-signer:\n{log}"));
    assert!(warned.contains(&short_sha256(&expired.pem())), "{warned}");
    assert!(
        !log.lines()
            .any(|l| l.contains("WARN") && l.contains("new-signer")),
        "{log}"
    );
}

// Issue 34, item 3: with no authentication configured, the warning at start says what to set
// and where (the unit's environment file on Debian and on RPM systems).

#[test]
fn without_authentication_the_warning_at_start_says_what_to_set_and_where() {
    let node = Node::new();
    let source = node.source("signers.pem", pki::bundle_of(1, "ca"));
    let agent = Agent::start_with(&node, &[&source], &[], |cmd| {
        cmd.env_remove("KUBELET_CA_AGENT_INSECURE_METRICS");
    });
    agent.wait_listening();
    assert_eq!(agent.get("/metrics").map(|(code, _)| code), Some(401));
    let log = agent.log();
    let warning = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("/metrics answers 401 to everyone"))
        .unwrap_or_else(|| panic!("no warning:\n{log}"));
    for what in [
        "KUBELET_CA_AGENT_CLIENT_CA_FILE",
        "KUBELET_CA_AGENT_AUTHORIZED_USERS",
        "KUBELET_CA_AGENT_INSECURE_METRICS=true",
        "/etc/default/kubelet-ca-agent",
        "/etc/sysconfig/kubelet-ca-agent",
    ] {
        assert!(warning.contains(what), "{what} not said: {warning}");
    }
}
