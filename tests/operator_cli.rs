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
use common::pki;
use common::{Node, agent_bin, stderr, stdout};

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
