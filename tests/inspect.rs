//! `inspect`: what a person sees at a glance, what a script parses, and the exit codes.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::pki::{Algorithm, Signer};
use common::{agent_bin, stderr, stdout};
use time::Duration;

fn inspect_file(content: &str, args: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bundle.crt");
    std::fs::write(&path, content).unwrap();
    Command::new(agent_bin())
        .arg("inspect")
        .arg(&path)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn valid_bundle_is_shown_as_a_table_and_exits_0() {
    let a = Signer::new("kube-csr-signer", Algorithm::P256);
    let b = Signer::new("kube-apiserver-to-kubelet-signer", Algorithm::Rsa);
    let out = inspect_file(&(a.pem() + &b.pem()), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let table = stdout(&out);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    for column in [
        "SUBJECT",
        "ISSUER",
        "SERIAL",
        "SHA-256",
        "NOT BEFORE",
        "NOT AFTER",
        "TIME LEFT",
        "STATUS",
    ] {
        assert!(lines[0].contains(column), "missing {column}: {}", lines[0]);
    }
    assert!(
        lines[1].starts_with("kube-csr-signer ") && lines[1].ends_with("valid"),
        "{}",
        lines[1]
    );
    assert!(
        (lines[2].contains("364d") || lines[2].contains("365d")) && lines[2].ends_with("valid"),
        "{}",
        lines[2]
    );
}

#[test]
fn expired_and_not_yet_valid_certificates_exit_1() {
    let live = Signer::new("live", Algorithm::P256);
    let dead = Signer::valid_between(
        "dead",
        Algorithm::P256,
        Duration::days(-10),
        Duration::days(-2),
    );
    let next = Signer::valid_between(
        "next",
        Algorithm::P256,
        Duration::days(2),
        Duration::days(20),
    );
    for (pem, status) in [(dead.pem(), "EXPIRED"), (next.pem(), "NOT YET VALID")] {
        let out = inspect_file(&(live.pem() + &pem), &[]);
        assert_eq!(out.status.code(), Some(1));
        assert!(stdout(&out).contains(status), "{}", stdout(&out));
    }
}

#[test]
fn warn_within_flags_a_certificate_that_expires_soon() {
    let soon = Signer::valid_between(
        "soon",
        Algorithm::Ed25519,
        Duration::days(-1),
        Duration::days(20),
    );
    let out = inspect_file(&soon.pem(), &["--warn-within", "30d"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("EXPIRING"));
    let out = inspect_file(&soon.pem(), &["--warn-within", "10d"]);
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn json_output_is_machine_readable() {
    let a = Signer::new("signer-a", Algorithm::P384);
    let out = inspect_file(&a.pem(), &["--output", "json"]);
    assert_eq!(out.status.code(), Some(0));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cert = &report["certificates"][0];
    assert_eq!(cert["subject_cn"], "signer-a");
    assert_eq!(cert["status"], "valid");
    assert_eq!(cert["is_ca"], true);
    assert_eq!(cert["sha256"].as_str().unwrap().len(), 64);
    let left = cert["seconds_left"].as_i64().unwrap();
    assert!((364 * 86400..=365 * 86400).contains(&left), "{left}");
}

#[test]
fn reads_standard_input() {
    let a = Signer::new("from-stdin", Algorithm::P256);
    let mut child = Command::new(agent_bin())
        .args(["inspect", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(a.pem().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("from-stdin"));
}

#[test]
fn a_broken_block_is_reported_and_exits_1() {
    let a = Signer::new("intact", Algorithm::P256);
    let pem = a.pem();
    let torn = format!("{pem}{}", &pem[..pem.len() / 2]);
    let out = inspect_file(&torn, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("intact"));
    assert!(
        stderr(&out).contains("block 2") && stderr(&out).contains("truncated"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn unreadable_or_certificate_free_input_exits_2() {
    let out = Command::new(agent_bin())
        .args(["inspect", "/nonexistent/bundle.crt"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("/nonexistent/bundle.crt"));
    let out = inspect_file("just some text\n", &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("no certificate"), "{}", stderr(&out));
}

#[test]
fn version_prints_the_version() {
    let out = Command::new(agent_bin()).arg("version").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).starts_with(&format!("kubelet-ca-agent {}", env!("CARGO_PKG_VERSION"))));
}

#[test]
fn a_bare_number_for_warn_within_is_refused_with_days_suggested() {
    let a = Signer::new("a", Algorithm::P256);
    let out = inspect_file(&a.pem(), &["--warn-within", "7"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("write 7d for 7 days"), "{err}");
    assert!(!err.contains("7sec"), "{err}");
}

#[test]
fn json_problems_list_the_certificates_that_made_the_exit_code() {
    let live = Signer::new("live", Algorithm::P256);
    let soon = Signer::valid_between(
        "soon",
        Algorithm::P256,
        Duration::days(-1),
        Duration::days(20),
    );
    let dead = Signer::valid_between(
        "dead",
        Algorithm::P256,
        Duration::days(-10),
        Duration::days(-2),
    );
    let out = inspect_file(
        &(live.pem() + &soon.pem() + &dead.pem()),
        &["-o", "json", "--warn-within", "60d"],
    );
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let problems = report["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 2, "{report:#}");
    let by = |subject: &str| {
        problems
            .iter()
            .find(|p| p["subject"] == subject)
            .unwrap_or_else(|| panic!("no problem for {subject}: {report:#}"))
    };
    let soon_problem = by("soon");
    assert_eq!(soon_problem["why"], "expires_within");
    assert_eq!(soon_problem["block"], 2);
    let sha256 = report["certificates"][1]["sha256"].as_str().unwrap();
    assert_eq!(soon_problem["sha256"], sha256);
    assert_eq!(
        soon_problem["not_after"],
        report["certificates"][1]["not_after"]
    );
    assert!(
        soon_problem["message"]
            .as_str()
            .unwrap()
            .contains("within --warn-within 60d"),
        "{soon_problem}"
    );
    assert_eq!(by("dead")["why"], "expired");

    // Valid within the window: no problem, exit 0.
    let out = inspect_file(&live.pem(), &["-o", "json", "--warn-within", "60d"]);
    assert_eq!(out.status.code(), Some(0));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["problems"], serde_json::json!([]));
}
