//! What an operator meets on the command line, through the real binary: a hand-run sync
//! against a bundle a running agent manages, variables that are misspelt or carry a bad
//! value, lists written loosely, output read by `head`, logs nobody reads, a hook that
//! cannot run, the node's name, and the help's headings.

mod common;

use std::fs;
use std::os::fd::OwnedFd;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::daemon::{Agent, wait_until};
use common::pki::{self, Algorithm, Signer};
use common::{Node, agent_bin, fingerprint_file, stderr, stdout};

const SECOND: Duration = Duration::from_secs(1);

/// `kubelet-ca-agent ARGS` with no `KUBELET_CA_AGENT_*` variable but those in `env`.
fn agent(args: &[&str], env: &[(&str, &str)]) -> Output {
    clean(Command::new(agent_bin()).args(args))
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

fn clean(cmd: &mut Command) -> &mut Command {
    cmd.env_remove("RUST_LOG")
        .env_remove("KUBECONFIG")
        .env_remove("NOTIFY_SOCKET");
    for (name, _) in std::env::vars() {
        if name.starts_with("KUBELET_CA_AGENT_") {
            cmd.env_remove(name);
        }
    }
    cmd
}

/// A pipe whose reading end is already closed: what `| head -1` leaves once it has its
/// line, without the race of a reader that might still be reading.
fn closed_pipe() -> OwnedFd {
    let (read, write) = nix::unistd::pipe().unwrap();
    drop(read);
    write
}

// 7. A sync against a bundle that a running agent manages.

#[test]
fn sync_refuses_a_bundle_that_a_running_agent_manages_unless_forced() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("agent-signer", Algorithm::P256),
        Signer::new("hand-signer", Algorithm::P256),
    );
    let agents = node.source("a.pem", a.pem());
    let by_hand = node.source("b.pem", b.pem());
    let mut agent = Agent::start(&node, &[&agents], &[]);
    wait_until(10 * SECOND, || node.holds(a.pem()));
    let before = fingerprint_file(&node.bundle());

    let out = node.sync(&[&by_hand], &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains(&node.bundle().display().to_string())
            && err.contains(&format!("pid {}", agent.child.id()))
            && err.contains("managed by a running kubelet-ca-agent"),
        "{err}"
    );
    assert!(
        err.contains("--source") && err.contains("systemctl stop") && err.contains("--force"),
        "says what to do instead: {err}"
    );
    assert_eq!(fingerprint_file(&node.bundle()), before, "nothing written");

    // The dry run shows the plan and says that the sync itself would be refused (it exits
    // 0, as SPEC 3 has a dry run do).
    let out = node.sync(&[&by_hand], &["--dry-run"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("would be refused"),
        "{}",
        stderr(&out)
    );
    assert!(stdout(&out).contains("would add"), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("managed by a running"),
        "{}",
        stderr(&out)
    );

    // A second agent on the same state directory is refused as well.
    let second = clean(Command::new(agent_bin()).args(["run", "--source", &agents]))
        .arg("--bundle")
        .arg(node.bundle())
        .arg("--state-dir")
        .arg(node.state_dir())
        .args(["--listen", "127.0.0.1:0", "--insecure-metrics"])
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(2), "{}", stderr(&second));
    assert!(
        stderr(&second).contains("another kubelet-ca-agent run"),
        "{}",
        stderr(&second)
    );

    // Forced: written, and put back by the agent.
    let out = node.sync(&[&by_hand], &["--force"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    wait_until(10 * SECOND, || node.holds(a.pem()));

    // An agent killed outright leaves its lock file, which claims nothing any more.
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    assert!(node.state_dir().join("agent.lock").exists());
    let out = node.sync(&[&by_hand], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(node.holds(b.pem()));
}

// 11. The environment.

#[test]
fn a_bad_value_from_the_environment_names_its_variable() {
    let out = agent(&["version"], &[("KUBELET_CA_AGENT_LOG_LEVEL", "bogus")]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("KUBELET_CA_AGENT_LOG_LEVEL=bogus (for --log-level)")
            && err.contains("is not a log level"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");

    let out = agent(&["inspect", "-"], &[("KUBELET_CA_AGENT_OUTPUT", "yaml")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("KUBELET_CA_AGENT_OUTPUT=yaml (for --output)"),
        "{}",
        stderr(&out)
    );

    // The same value on the command line is reported under the flag, as before.
    let out = agent(&["--log-level", "bogus", "version"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        !stderr(&out).contains("KUBELET_CA_AGENT_LOG_LEVEL")
            && stderr(&out).contains("--log-level"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn an_unknown_variable_is_warned_about_with_the_closest_known_one() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "env");
    let source = node.source("a.pem", &pem);
    fs::create_dir_all(node.bundle_dir()).unwrap();
    let out = clean(&mut node.command("sync"))
        .env("KUBELET_CA_AGENT_SOURCE", &source)
        .env("KUBELET_CA_AGENT_SOURCES", "file:/misspelt.pem")
        .env("KUBELET_CA_AGENT_NO_SUCH_THING_AT_ALL", "1")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "a warning, not an error: {}",
        stderr(&out)
    );
    assert!(node.holds(&pem));
    let err = stderr(&out);
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines[0].contains("KUBELET_CA_AGENT_NO_SUCH_THING_AT_ALL")
            && lines[1].contains("KUBELET_CA_AGENT_SOURCES")
            && lines[1].contains("did you mean KUBELET_CA_AGENT_SOURCE?"),
        "the warnings come first, one line each: {err}"
    );
    assert!(lines[2].contains("bundle written"), "{err}");
}

#[test]
fn a_list_may_have_spaces_after_its_commas_and_a_trailing_comma() {
    let node = Node::new();
    let (a, b) = (pki::bundle_of(1, "a"), pki::bundle_of(1, "b"));
    let (sa, sb) = (node.source("a.pem", &a), node.source("b.pem", &b));
    let out = node.sync(&[&format!("{sa}, {sb},")], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(node.holds(a.clone() + &b));

    fs::remove_file(node.bundle()).unwrap();
    let out = clean(&mut node.command("sync"))
        .env("KUBELET_CA_AGENT_SOURCE", format!(" {sb} ,{sa}, "))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(node.holds(b + &a));
}

// 13. Output nobody reads.

#[test]
fn a_closed_stdout_ends_the_output_quietly_with_the_usual_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bundle.crt");
    fs::write(&path, pki::bundle_of(3, "ca")).unwrap();
    let path = path.to_str().unwrap();
    for args in [
        vec!["inspect", "-o", "json", path],
        vec!["inspect", path],
        vec!["version"],
    ] {
        let out = clean(Command::new(agent_bin()).args(&args))
            .stdout(closed_pipe())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "{args:?}: no noise");
    }

    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(2, "plan"));
    fs::create_dir_all(node.bundle_dir()).unwrap();
    let out = clean(
        node.command("sync")
            .args(["--source", &source, "--dry-run"]),
    )
    .stdout(closed_pipe())
    .stderr(Stdio::piped())
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

#[test]
fn run_keeps_the_file_correct_after_its_stderr_is_closed() {
    let node = Node::new();
    let (a, b) = (pki::bundle_of(1, "first"), pki::bundle_of(1, "second"));
    let source = node.source("a.pem", &a);
    let mut agent = Agent::start_with(&node, &[&source], &[], |cmd| {
        cmd.stderr(closed_pipe());
    });
    wait_until(10 * SECOND, || node.holds(&a));
    fs::write(source.strip_prefix("file:").unwrap(), &b).unwrap();
    wait_until(10 * SECOND, || node.holds(&b));
    // A repair logs too.
    fs::write(node.bundle(), &a).unwrap();
    wait_until(10 * SECOND, || node.holds(&b));
    assert!(agent.child.try_wait().unwrap().is_none(), "still running");
    assert_eq!(agent.terminate().code(), Some(0));
}

// 16. The node's name.

#[test]
fn the_node_name_defaults_to_the_host_name() {
    let host = fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let host = host.trim();
    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(1, "ca"));
    let agent = Agent::start(&node, &[&source], &[]);
    agent.wait_listening();
    let built = agent.sample("kubelet_ca_agent_build_info", &[("node", host)]);
    assert_eq!(built, Some(1.0), "node=\"{host}\"");
    assert!(
        agent.log().contains(&format!("node=\"{host}\"")),
        "{}",
        agent.log()
    );
    let help = stdout(&agent_run_help());
    assert!(help.contains("this host's name"), "{help}");
}

fn agent_run_help() -> Output {
    agent(&["run", "--help"], &[])
}

// 20. A hook that cannot run.

#[test]
fn a_hook_that_cannot_run_is_refused_before_anything_is_written() {
    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(1, "ca"));
    let not_executable = node.root().join("hook.sh");
    fs::write(&not_executable, "#!/bin/sh\n").unwrap();
    for (hook, why) in [
        ("/nonexistent/hook", "does not exist"),
        (not_executable.to_str().unwrap(), "is not executable"),
        ("no-such-hook-on-path --flag", "is not found on PATH"),
    ] {
        let out = node.sync(&[&source], &["--exec-on-change", hook]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{hook}: {err}");
        assert!(
            err.contains(why) && err.contains("--exec-on-change"),
            "{hook}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!node.bundle().exists(), "{hook}: nothing written");
    }

    let out = clean(node.command("run").args(["--source", &source]))
        .args(["--listen", "127.0.0.1:0", "--insecure-metrics"])
        .args(["--exec-on-change", "/nonexistent/hook"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("/nonexistent/hook does not exist"),
        "{}",
        stderr(&out)
    );
    assert!(!node.bundle().exists());
}

// 23. The help.

#[test]
fn the_logging_flags_have_a_heading_of_their_own() {
    let help = stdout(&agent_run_help());
    let heading = help.find("\nLogging:\n").expect("a Logging heading");
    let (commands, logging) = help.split_at(heading);
    assert!(
        logging.contains("--log-level") && logging.contains("--log-format"),
        "{help}"
    );
    assert!(!commands.contains("--log-level"), "{help}");
    assert!(
        commands.contains("--source") && !logging.contains("--source"),
        "{help}"
    );
}
