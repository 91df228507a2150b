//! Test kit shared by the integration tests: signer certificates generated at run time
//! (dates relative to now, so nothing here can expire), and a harness that runs the real
//! binary in a scratch directory.
#![allow(dead_code)]

pub mod apiserver;
pub mod daemon;
pub mod pki;
pub mod prometheus;
pub mod real_cluster;
pub mod systemd;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

/// The agent binary built by cargo for this test run.
pub fn agent_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kubelet-ca-agent")
}

/// A scratch node: a bundle path, a state dir and room for sources.
pub struct Node {
    pub dir: TempDir,
}

impl Node {
    pub fn new() -> Self {
        Node {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn bundle(&self) -> PathBuf {
        self.root().join("etc/kubernetes/kubelet-ca.crt")
    }

    pub fn bundle_dir(&self) -> PathBuf {
        self.root().join("etc/kubernetes")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.root().join("state")
    }

    /// Writes a source file and returns its `file:` spec.
    pub fn source(&self, name: &str, content: impl AsRef<[u8]>) -> String {
        let path = self.root().join("sources").join(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, content).unwrap();
        format!("file:{}", path.display())
    }

    /// The bundle is a regular file and holds exactly `content`. (A FIFO at the path
    /// must not hang the test any more than the agent.)
    pub fn holds(&self, content: impl AsRef<[u8]>) -> bool {
        fs::symlink_metadata(self.bundle()).is_ok_and(|m| m.is_file())
            && fs::read(self.bundle()).is_ok_and(|b| b == content.as_ref())
    }

    pub fn read_bundle(&self) -> Vec<u8> {
        fs::read(self.bundle()).expect("bundle exists")
    }

    /// `kubelet-ca-agent sync` against this node with the given sources and extra args.
    pub fn sync(&self, sources: &[&str], extra: &[&str]) -> Output {
        fs::create_dir_all(self.bundle_dir()).unwrap();
        let mut cmd = self.command("sync");
        for s in sources {
            cmd.arg("--source").arg(s);
        }
        cmd.args(extra).output().expect("run agent")
    }

    /// A command with `--bundle` and `--state-dir` pointing into this node.
    pub fn command(&self, subcommand: &str) -> Command {
        let mut cmd = Command::new(agent_bin());
        cmd.arg(subcommand)
            .arg("--bundle")
            .arg(self.bundle())
            .arg("--state-dir")
            .arg(self.state_dir())
            .env_remove("RUST_LOG")
            .env("NO_COLOR", "1");
        cmd
    }

    /// Files in the bundle directory other than the bundle itself.
    pub fn stray_files(&self) -> Vec<String> {
        fs::read_dir(self.bundle_dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "kubelet-ca.crt")
            .collect()
    }
}

/// Identity of a file for "was it touched?" checks: inode, mtime (ns), and content.
pub fn fingerprint_file(path: &Path) -> (u64, i64, i64, Vec<u8>) {
    let m = fs::metadata(path).unwrap();
    (m.ino(), m.mtime(), m.mtime_nsec(), fs::read(path).unwrap())
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `openssl verify -CAfile bundle [-untrusted intermediates] cert`: does `cert` chain to
/// the bundle, by a tool nobody here wrote?
pub fn openssl_verifies(bundle: &Path, cert_pem: &str) -> bool {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("client.crt");
    fs::write(&cert, cert_pem).unwrap();
    let out = Command::new("openssl")
        .args(["verify", "-purpose", "sslclient", "-CAfile"])
        .arg(bundle)
        .arg(&cert)
        .output()
        .expect("openssl is installed");
    out.status.success()
}

/// True when running in CI (`CI` set to anything but empty, `0` or `false`): there a test
/// whose prerequisite is missing fails instead of skipping, so that a suite that is green
/// in CI has really run every test.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// A test's prerequisite: true when `cond` holds. Otherwise, in CI ([`in_ci`]) the test
/// fails naming `why`; elsewhere it prints `skipped: <why>` and the caller returns.
///
/// ```ignore
/// if !require(is_root(), "chattr +i needs root") {
///     return;
/// }
/// ```
pub fn require(cond: bool, why: &str) -> bool {
    if !cond {
        assert!(
            !in_ci(),
            "prerequisite missing in CI (CI is set, so this test may not skip): {why}"
        );
        eprintln!("skipped: {why}");
    }
    cond
}

/// The tests run as root (chattr, chown, security.* attributes).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `chattr <flag> <path>` (`+i`, `-i`); true when it succeeded.
pub fn chattr(flag: &str, path: &Path) -> bool {
    Command::new("chattr")
        .arg(flag)
        .arg(path)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Hex SHA-256 of `bytes`, as the agent names bundles (metrics, history, records).
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

/// The history entries under `<state-dir>/history/`: (file name, content, mode). A
/// hidden file there is an entry being written (the agent's temporary file), not yet one.
pub fn history_entries(state_dir: &Path) -> Vec<(String, Vec<u8>, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let Ok(dir) = fs::read_dir(state_dir.join("history")) else {
        return Vec::new();
    };
    let mut entries: Vec<_> = dir
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                return None;
            }
            let mode = fs::symlink_metadata(e.path()).ok()?.permissions().mode() & 0o7777;
            Some((name, fs::read(e.path()).ok()?, mode))
        })
        .collect();
    entries.sort();
    entries
}

/// A kubeconfig whose API server refuses connections: a cluster source that is never read.
pub const KUBECONFIG_NOWHERE: &str = "apiVersion: v1
kind: Config
clusters:
- name: nowhere
  cluster:
    server: https://127.0.0.1:1
    insecure-skip-tls-verify: true
users:
- name: nobody
  user:
    token: not-a-real-token
contexts:
- name: nowhere
  context:
    cluster: nowhere
    user: nobody
current-context: nowhere
";

/// CPU time (user + system) of a process so far, in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}
