//! Durability that no SIGKILL test can see: a power loss right after a rotation must find
//! either the old or the new bundle, which only the right syscalls in the right order
//! guarantee. `sync` and `run` are traced with strace and, for each replace of the bundle,
//! the trace must show: the temporary file opened `O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC`,
//! written, fsynced, renamed over the bundle, and then the bundle's directory (an fd opened
//! on that directory) fsynced.

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::daemon::{Agent, wait_until};
use common::pki::{Algorithm, Signer};
use common::{Node, agent_bin, require, stderr};

const SECOND: Duration = Duration::from_secs(1);
const TRACED: &str = "trace=openat,write,fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat";

/// strace is installed and allowed to trace here.
fn strace_works() -> bool {
    Command::new("strace")
        .args(["-f", "-qq", "-o", "/dev/null", "true"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The strace command line that writes its trace to `out` (then the program to trace).
fn strace_args(out: &Path) -> Vec<String> {
    let mut args: Vec<String> = ["-f", "-qq", "-s", "16", "-e", TRACED, "-o"]
        .map(String::from)
        .to_vec();
    args.push(out.display().to_string());
    args
}

/// One completed syscall of the trace, in completion order.
#[derive(Debug, Clone)]
struct Call {
    name: String,
    args: String,
    ret: Option<i64>,
    line: String,
}

impl Call {
    /// The quoted strings among the arguments (paths), unescaped for `\"` and `\\`.
    fn strings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut chars = self.args.chars();
        while let Some(c) = chars.next() {
            if c != '"' {
                continue;
            }
            let mut s = String::new();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => s.extend(chars.next()),
                    '"' => break,
                    c => s.push(c),
                }
            }
            out.push(s);
        }
        out
    }

    /// The first argument as an fd number (write, fsync, fdatasync).
    fn fd(&self) -> Option<i64> {
        self.args.split(',').next()?.trim().parse().ok()
    }

    /// For a rename: (from, to).
    fn rename(&self) -> Option<(String, String)> {
        if !self.name.starts_with("rename") || self.ret != Some(0) {
            return None;
        }
        let mut paths = self.strings().into_iter();
        Some((paths.next()?, paths.next()?))
    }
}

/// Parses strace's `-f -o` output (`PID name(args) = ret`), joining calls that were
/// interrupted by another thread's (`<unfinished ...>` / `<... name resumed>`).
fn parse_trace(text: &str) -> Vec<Call> {
    let mut pending: HashMap<String, String> = HashMap::new();
    let mut calls = Vec::new();
    for line in text.lines() {
        let Some((pid, rest)) = line.split_once(' ') else {
            continue;
        };
        let rest = rest.trim_start();
        let full = if let Some(head) = rest.strip_suffix(" <unfinished ...>") {
            pending.insert(pid.to_string(), head.to_string());
            continue;
        } else if let Some(resumed) = rest.strip_prefix("<... ") {
            let Some((_, tail)) = resumed.split_once(" resumed>") else {
                continue;
            };
            match pending.remove(pid) {
                Some(head) => format!("{head}{tail}"),
                None => continue,
            }
        } else {
            rest.to_string()
        };
        if full.starts_with("---") || full.starts_with("+++") {
            continue;
        }
        let Some((name, after)) = full.split_once('(') else {
            continue;
        };
        // strace pads short calls: `fsync(3)                          = 0`.
        let Some((args, ret)) = after.rsplit_once(" = ") else {
            continue;
        };
        let Some(args) = args.trim_end().strip_suffix(')') else {
            continue;
        };
        calls.push(Call {
            name: name.to_string(),
            args: args.to_string(),
            ret: ret.split_whitespace().next().and_then(|r| r.parse().ok()),
            line: line.to_string(),
        });
    }
    calls
}

/// Checks every replace of `bundle` in the trace; returns how many there were. Panics
/// with the offending part of the trace when one is not durable.
fn check_replaces(calls: &[Call], bundle: &Path) -> usize {
    let bundle = bundle.to_str().unwrap();
    let dir = bundle.rsplit_once('/').unwrap().0;
    // What each fd number refers to at each point of the trace: (path, flags, index of the
    // open). A number is handed out again only after it was closed, so the latest open
    // returning it is what it refers to.
    let mut fds: HashMap<i64, (String, String, usize)> = HashMap::new();
    let mut replaces = 0;
    let dump = |from: usize, to: usize| -> String {
        calls[from..to.min(calls.len())]
            .iter()
            .map(|c| c.line.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    };
    for (i, call) in calls.iter().enumerate() {
        if call.name == "openat"
            && let Some(fd) = call.ret.filter(|&fd| fd >= 0)
        {
            let path = call.strings().into_iter().next().unwrap_or_default();
            let flags = call
                .args
                .split(", ")
                .find(|a| a.starts_with("O_"))
                .unwrap_or_default()
                .to_string();
            fds.insert(fd, (path, flags, i));
            continue;
        }
        let Some((from, to)) = call.rename() else {
            continue;
        };
        if to != bundle {
            continue;
        }
        replaces += 1;
        // The temporary file: the open of `from` that is still the fd written and synced.
        let (temp_fd, (_, flags, opened_at)) = fds
            .iter()
            .filter(|(_, (path, ..))| *path == from)
            .max_by_key(|(_, (.., at))| *at)
            .map(|(fd, v)| (*fd, v.clone()))
            .unwrap_or_else(|| {
                panic!("no open of the temporary file {from} before\n{}", call.line)
            });
        assert!(
            from.starts_with(&format!("{dir}/.")),
            "the temporary file {from} is not a hidden file in the bundle's directory {dir}"
        );
        for flag in ["O_CREAT", "O_EXCL", "O_NOFOLLOW", "O_CLOEXEC"] {
            assert!(
                flags.split('|').any(|f| f == flag),
                "the temporary file was opened without {flag}: {}",
                calls[opened_at].line
            );
        }
        let between = &calls[opened_at + 1..i];
        let on_temp = |names: &[&str]| {
            between
                .iter()
                .position(|c| names.contains(&c.name.as_str()) && c.fd() == Some(temp_fd))
        };
        let written = on_temp(&["write"]);
        let synced = on_temp(&["fsync", "fdatasync"]);
        let context = dump(opened_at, i + 1);
        assert!(
            written.is_some(),
            "nothing written to the temporary file:\n{context}"
        );
        assert!(
            synced.is_some_and(|s| written.is_some_and(|w| w < s)),
            "the temporary file is not fsynced after it is written and before the rename:\n{context}"
        );
        // After the rename, before the next replace: an fsync of an fd opened on the
        // bundle's directory.
        let next_rename = calls[i + 1..]
            .iter()
            .position(|c| c.rename().is_some_and(|(_, to)| to == bundle))
            .map_or(calls.len(), |p| i + 1 + p);
        // The temporary name is the bundle now: nothing unlinks it after the rename
        // (whatever took that name since would be removed).
        if let Some(c) = calls[i + 1..next_rename]
            .iter()
            .find(|c| c.name.starts_with("unlink") && c.strings().contains(&from))
        {
            panic!(
                "the temporary name {from} is unlinked after the rename:\n{}",
                c.line
            );
        }
        let mut open_after = fds.clone();
        let mut dir_synced = false;
        for c in &calls[i + 1..next_rename] {
            if c.name == "openat"
                && let Some(fd) = c.ret.filter(|&fd| fd >= 0)
            {
                let path = c.strings().into_iter().next().unwrap_or_default();
                open_after.insert(fd, (path, String::new(), 0));
            }
            if ["fsync", "fdatasync"].contains(&c.name.as_str())
                && c.ret == Some(0)
                && c.fd()
                    .and_then(|fd| open_after.get(&fd))
                    .is_some_and(|(path, ..)| path.trim_end_matches('/') == dir)
            {
                dir_synced = true;
                break;
            }
        }
        assert!(
            dir_synced,
            "the directory {dir} is not fsynced after the rename over the bundle:\n{}",
            dump(i, next_rename.min(i + 40))
        );
    }
    replaces
}

#[test]
fn sync_makes_a_rotation_durable_temp_fsync_rename_directory_fsync() {
    if !require(
        strace_works(),
        "strace is not installed or cannot trace here",
    ) {
        return;
    }
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    assert!(node.sync(&[&source], &[]).status.success());
    fs::write(source.strip_prefix("file:").unwrap(), a.pem() + &b.pem()).unwrap();

    let trace = node.root().join("sync.trace");
    let out = Command::new("strace")
        .args(strace_args(&trace))
        .arg(agent_bin())
        .arg("sync")
        .arg("--bundle")
        .arg(node.bundle())
        .arg("--state-dir")
        .arg(node.state_dir())
        .arg("--source")
        .arg(&source)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(node.holds(a.pem() + &b.pem()));
    let calls = parse_trace(&fs::read_to_string(&trace).unwrap());
    assert_eq!(
        check_replaces(&calls, &node.bundle()),
        1,
        "one rotation, one replace"
    );
}

/// The pid of the agent strace runs: the child of strace that is the agent's binary
/// (strace forks short-lived test children of its own at start).
fn traced_pid(strace: u32) -> i32 {
    let children = format!("/proc/{strace}/task/{strace}/children");
    let agent = fs::canonicalize(agent_bin()).unwrap();
    let mut pid = None;
    wait_until(10 * SECOND, || {
        pid = fs::read_to_string(&children).ok().and_then(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
                .find(|p| fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|exe| exe == agent))
        });
        pid.is_some()
    });
    pid.unwrap()
}

#[test]
fn run_makes_every_replace_durable_temp_fsync_rename_directory_fsync() {
    if !require(
        strace_works(),
        "strace is not installed or cannot trace here",
    ) {
        return;
    }
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    let trace: PathBuf = node.root().join("run.trace");
    let mut wrapper = vec!["strace".to_string()];
    wrapper.extend(strace_args(&trace));
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut agent = Agent::start_wrapped(&node, &[&source], &[], &wrapper, |_| {});
    let pid = traced_pid(agent.child.id());
    wait_until(10 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();
    agent.wait_metric(5 * SECOND, "kubelet_ca_writes_total{", 1.0);

    // A rotation.
    fs::write(source.strip_prefix("file:").unwrap(), a.pem() + &b.pem()).unwrap();
    wait_until(5 * SECOND, || node.holds(a.pem() + &b.pem()));
    // The counter follows the directory fsync.
    agent.wait_metric(5 * SECOND, "kubelet_ca_writes_total{", 2.0);

    // Stop the agent itself (strace would only detach on a signal of its own), then
    // strace ends with it, its trace complete.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let deadline = Instant::now() + 10 * SECOND;
    while agent.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the traced agent did not stop");
        std::thread::sleep(Duration::from_millis(10));
    }
    let calls = parse_trace(&fs::read_to_string(&trace).unwrap());
    assert_eq!(
        check_replaces(&calls, &node.bundle()),
        2,
        "the first write and the rotation: {}",
        agent.log()
    );
}

#[test]
fn the_trace_checker_rejects_a_replace_without_a_directory_fsync() {
    // The checker itself, on a made-up trace: without this, a checker that accepts
    // anything would make both tests above pass for nothing.
    let good = r#"10 openat(AT_FDCWD, "/d/.b.kubelet-ca-agent-tmp.10.0", O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC, 0600) = 5
10 write(5, "-----BEGIN CERTI"..., 600) = 600
11 openat(AT_FDCWD, "/elsewhere", O_RDONLY|O_CLOEXEC <unfinished ...>
10 fsync(5 <unfinished ...>
11 <... openat resumed>) = 6
10 <... fsync resumed>) = 0
10 rename("/d/.b.kubelet-ca-agent-tmp.10.0", "/d/b") = 0
10 openat(AT_FDCWD, "/d", O_RDONLY|O_CLOEXEC) = 7
10 fsync(7)                          = 0
"#;
    assert_eq!(check_replaces(&parse_trace(good), Path::new("/d/b")), 1);
    let cases = [
        ("no directory fsync", good.replace("10 fsync(7)                          = 0\n", "")),
        (
            "fsync of another fd",
            good.replace("10 fsync(7) ", "10 fsync(6) "),
        ),
        (
            "no temp fsync",
            good.replace("10 <... fsync resumed>) = 0\n", ""),
        ),
        (
            "directory fsync before the rename",
            good.replace(
                "10 rename(\"/d/.b.kubelet-ca-agent-tmp.10.0\", \"/d/b\") = 0\n10 openat(AT_FDCWD, \"/d\", O_RDONLY|O_CLOEXEC) = 7\n10 fsync(7)                          = 0\n",
                "10 openat(AT_FDCWD, \"/d\", O_RDONLY|O_CLOEXEC) = 7\n10 fsync(7)                          = 0\n10 rename(\"/d/.b.kubelet-ca-agent-tmp.10.0\", \"/d/b\") = 0\n",
            ),
        ),
        ("no O_EXCL", good.replace("O_EXCL|", "")),
        ("no O_NOFOLLOW", good.replace("O_NOFOLLOW|", "")),
        (
            "the temporary name unlinked after the rename",
            good.to_string()
                + "10 unlink(\"/d/.b.kubelet-ca-agent-tmp.10.0\") = -1 ENOENT (No such file or directory)\n",
        ),
    ];
    for (what, trace) in cases {
        assert_ne!(trace, good, "{what}: the case changes nothing");
        let calls = parse_trace(&trace);
        let caught =
            std::panic::catch_unwind(|| check_replaces(&calls, Path::new("/d/b"))).is_err();
        assert!(caught, "{what}: accepted");
    }
}
