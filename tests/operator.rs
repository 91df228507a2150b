//! What an operator trying the agent runs into: mistyped flags and variables, flags that
//! contradict each other, an environment that refuses the agent. Each is refused, or
//! answered, with one line that says what is wrong and what to do.

mod common;

use std::net::TcpListener;
use std::process::{Command, Output};

use common::{Node, agent_bin, stderr};

/// `kubelet-ca-agent ARGS` with a clean environment plus `env`.
fn agent(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(agent_bin());
    cmd.args(args)
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG")
        .env_remove("NOTIFY_SOCKET");
    for (name, _) in std::env::vars() {
        if name.starts_with("KUBELET_CA_AGENT_") {
            cmd.env_remove(name);
        }
    }
    cmd.envs(env.iter().copied()).output().unwrap()
}

#[test]
fn an_unknown_log_level_is_refused_and_the_usual_spellings_are_read() {
    for level in ["warning", "WARN", "Info", "debug,kube_client=info"] {
        let out = agent(&["--log-level", level, "version"], &[]);
        assert!(out.status.success(), "{level}: {}", stderr(&out));
    }
    for level in ["debg", "bogus", "loud"] {
        let out = agent(&["--log-level", level, "version"], &[]);
        assert_eq!(out.status.code(), Some(2), "{level}");
        assert!(
            stderr(&out).contains("is not a log level"),
            "{}",
            stderr(&out)
        );
        let out = agent(&["version"], &[("KUBELET_CA_AGENT_LOG_LEVEL", level)]);
        assert_eq!(out.status.code(), Some(2), "{level} from the environment");
    }
    // A level that is read as meant keeps errors in the log: a source that does not exist
    // is reported at warn level.
    let node = Node::new();
    let out = node.sync(
        &["file:/nonexistent/signers.pem"],
        &["--log-level", "warning"],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("/nonexistent/signers.pem"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn contradicting_endpoint_flags_are_refused_with_what_to_use_instead() {
    let node = Node::new();
    let source = node.source("a.pem", common::pki::bundle_of(1, "a"));
    let bundle = node.bundle();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--source",
            &source,
            "--bundle",
            bundle.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        agent(&args, &[])
    };
    let out = run(&[
        "--listen",
        "127.0.0.1:0",
        "--insecure-metrics",
        "--client-ca-file",
        "/etc/ca.crt",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let line = stderr(&out);
    assert!(
        line.contains("--insecure-metrics") && line.contains("--client-ca-file"),
        "{line}"
    );
    assert!(line.contains("drop --insecure-metrics"), "{line}");
    assert_eq!(line.lines().count(), 1, "{line}");

    let out = run(&["--listen", "0.0.0.0:0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let line = stderr(&out);
    assert!(line.contains("nothing could authenticate"), "{line}");
    assert!(line.contains("--client-ca-file"), "{line}");
}

#[test]
fn a_port_in_use_is_a_runtime_failure_not_a_usage_error() {
    let node = Node::new();
    let source = node.source("a.pem", common::pki::bundle_of(1, "a"));
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = taken.local_addr().unwrap().to_string();
    let bundle = node.bundle();
    std::fs::create_dir_all(node.bundle_dir()).unwrap();
    let out = agent(
        &[
            "run",
            "--source",
            &source,
            "--bundle",
            bundle.to_str().unwrap(),
            "--state-dir",
            node.state_dir().to_str().unwrap(),
            "--listen",
            &listen,
            "--insecure-metrics",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("Address already in use"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn an_unreachable_api_server_is_named_with_its_cause_once_per_change() {
    use common::apiserver::ApiServer;
    use common::daemon::{Agent, eventually};
    use std::time::Duration;
    let api = ApiServer::start();
    let server = api.url();
    api.stop();
    let node = Node::new();
    std::fs::create_dir_all(node.bundle_dir()).unwrap();
    std::fs::write(node.bundle(), common::pki::bundle_of(1, "adopted")).unwrap();
    let spec = "configmap:openshift-config-managed/kube-apiserver-client-ca";
    let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
    let agent = Agent::start(&node, &[spec], &["--kubeconfig", &kubeconfig]);
    agent.wait_listening();
    let expected = format!("{server}: connection refused");
    let page = || {
        agent
            .get("/readyz?verbose")
            .map(|(_, b)| b)
            .unwrap_or_default()
    };
    assert!(
        eventually(Duration::from_secs(10), || page().contains(&expected)),
        "{}",
        page()
    );
    // Retries go on with backoff (0.8 s doubling); the cause is logged once, and kube-rs's
    // context-free "client error (Connect)" line never.
    std::thread::sleep(Duration::from_secs(4));
    let log = agent.log();
    assert_eq!(log.matches(&expected).count(), 1, "{log}");
    assert!(!log.contains("client error (Connect)"), "{log}");
    assert!(!log.contains(" ERROR "), "{log}");

    let out = node.sync(&[spec], &["--kubeconfig", &kubeconfig, "--dry-run"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains(&expected), "{}", stderr(&out));
}
