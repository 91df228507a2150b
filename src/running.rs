//! How a running agent says that it manages the bundle, so that a hand-run `sync` does not
//! write a file that the agent would put back a second later (as a repair).
//!
//! `run` holds `<state-dir>/agent.lock` with flock(2) for as long as it runs, and writes in
//! it its pid and the files it manages. The lock, not the file, is the claim: the kernel
//! drops it when the process ends, however it ends, so a file left by a killed agent (or a
//! pid since reused) claims nothing. A reader tests the lock with a shared, non-blocking
//! flock and lets go at once.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::UsageError;
use crate::fsutil::{Links, open_regular};
use crate::text::escape;

/// The lock file's name in the state directory.
pub const LOCK_FILE: &str = "agent.lock";

/// What a running agent writes in its lock file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// 0 when the lock is held but its content could not be read.
    pub pid: u32,
    pub version: String,
    /// When it started, RFC 3339.
    pub started: String,
    pub managed: Vec<ManagedPath>,
}

/// A managed file: its path as the agent sees it (the directory resolved), and its
/// directory's identity, which holds across mount namespaces (the agent in a pod, `sync`
/// on the host) where the path might not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManagedPath {
    pub path: PathBuf,
    pub dir_dev: u64,
    pub dir_ino: u64,
}

impl ManagedPath {
    pub fn of(path: &Path) -> ManagedPath {
        let dir = crate::writer::atomic::parent_dir(path);
        let (dir_dev, dir_ino) = std::fs::metadata(&dir).map_or((0, 0), |m| (m.dev(), m.ino()));
        ManagedPath {
            path: resolved(path),
            dir_dev,
            dir_ino,
        }
    }

    /// Whether `other` names the same file.
    pub fn is(&self, other: &ManagedPath) -> bool {
        let same_dir =
            self.dir_ino != 0 && (self.dir_dev, self.dir_ino) == (other.dir_dev, other.dir_ino);
        self.path == other.path || (same_dir && self.path.file_name() == other.path.file_name())
    }
}

impl Claim {
    /// The holder's pid, for a message.
    pub fn who(&self) -> String {
        match self.pid {
            0 => "unknown".to_string(),
            pid => pid.to_string(),
        }
    }
}

/// `path` with its directory resolved (links, `..`), as far as it exists; else absolute.
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (absolute.parent(), absolute.file_name()) {
        (Some(dir), Some(name)) => dir
            .canonicalize()
            .map_or_else(|_| absolute.clone(), |dir| dir.join(name)),
        _ => absolute,
    }
}

/// The claim of a running agent: dropping it (the agent's exit) lets go.
#[derive(Debug)]
pub struct Held {
    _file: File,
}

/// How long `run` waits for the lock before it takes another agent for its holder: a
/// `sync` that tests the lock holds it for microseconds.
const CONTENDED: Duration = Duration::from_secs(1);

/// Claims `state_dir` for the running agent managing the files at `managed` (the bundle
/// first). Another agent running with
/// the same state directory is a configuration error: two agents would undo each other's
/// writes. A lock that cannot be taken for any other reason (an unwritable state
/// directory) is logged, and the agent runs without advertising itself.
pub fn claim(state_dir: &Path, managed: &[PathBuf]) -> Result<Option<Held>, UsageError> {
    let path = state_dir.join(LOCK_FILE);
    let unadvertised = |e: &dyn std::fmt::Display| {
        tracing::warn!(lock = %path.display(), error = %e, "cannot hold the lock file that tells sync this agent manages the bundle; a hand-run sync will not know it is undone");
        Ok(None)
    };
    if let Err(e) = std::fs::create_dir_all(state_dir) {
        return unadvertised(&e);
    }
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(
            (nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_NONBLOCK
                | nix::fcntl::OFlag::O_CLOEXEC)
                .bits(),
        )
        .open(&path);
    let mut file = match opened {
        Ok(file) => file,
        Err(e) => return unadvertised(&e),
    };
    match file.metadata() {
        Ok(m) if m.is_file() => {}
        Ok(_) => return unadvertised(&"not a regular file"),
        Err(e) => return unadvertised(&e),
    }
    let deadline = Instant::now() + CONTENDED;
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(TryLockError::WouldBlock) => {
                let other = read_claim(&mut file);
                let (pid, managing) = match &other {
                    Some(c) => (c.who(), managed_list(c)),
                    None => ("unknown".to_string(), "unknown files".to_string()),
                };
                return Err(UsageError(format!(
                    "another kubelet-ca-agent run (pid {pid}) uses the state directory {} and manages {managing} (it holds {}): two agents would undo each other's writes; stop it, or give each agent its own --state-dir and --bundle",
                    escape(&state_dir.display().to_string()),
                    escape(&path.display().to_string()),
                )));
            }
            Err(TryLockError::Error(e)) => return unadvertised(&e),
        }
    }
    let claim = Claim {
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        started: crate::text::rfc3339(time::OffsetDateTime::now_utc().unix_timestamp()),
        managed: managed.iter().map(|p| ManagedPath::of(p)).collect(),
    };
    let mut text = serde_json::to_vec_pretty(&claim).expect("a claim serializes");
    text.push(b'\n');
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(&text));
    if let Err(e) = written {
        // Held but unreadable: sync still sees the lock, and refuses without knowing what
        // is managed, which is the safe side.
        tracing::warn!(lock = %path.display(), error = %e, "cannot write the lock file's content");
    }
    Ok(Some(Held { _file: file }))
}

/// The claim of an agent running with `state_dir`, if one runs: `Ok(None)` when none does
/// (no lock file, or one nobody holds). A held lock whose content cannot be read (being
/// written) gives a claim with no managed file.
pub fn find(state_dir: &Path) -> io::Result<Option<Claim>> {
    let path = state_dir.join(LOCK_FILE);
    let mut file = match open_regular(&path, Links::NoFollow) {
        Ok(Ok((file, _))) => file,
        Ok(Err(_)) => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    match file.try_lock_shared() {
        // Nobody holds it: a file left by an agent that has stopped.
        Ok(()) => return Ok(None),
        Err(TryLockError::WouldBlock) => {}
        Err(TryLockError::Error(e)) => return Err(e),
    }
    // The agent writes its claim right after it takes the lock: give it a moment.
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        if let Some(claim) = read_claim(&mut file) {
            return Ok(Some(claim));
        }
        if Instant::now() >= deadline {
            return Ok(Some(Claim {
                pid: 0,
                version: String::new(),
                started: String::new(),
                managed: Vec::new(),
            }));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_claim(file: &mut File) -> Option<Claim> {
    let mut text = Vec::new();
    file.rewind().ok()?;
    file.take(64 * 1024).read_to_end(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

/// `a.crt` or `a.crt, b.crt`, escaped.
pub fn managed_list(claim: &Claim) -> String {
    let paths: Vec<String> = claim
        .managed
        .iter()
        .map(|m| escape(&m.path.display().to_string()).into_owned())
        .collect();
    if paths.is_empty() {
        "unknown files".to_string()
    } else {
        paths.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_seen_while_held_and_not_after() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let bundle = dir.path().join("ca.crt");
        assert_eq!(find(&state).unwrap(), None, "no file");
        let held = claim(&state, std::slice::from_ref(&bundle))
            .unwrap()
            .expect("claimed");
        let seen = find(&state).unwrap().expect("held");
        assert_eq!(seen.pid, std::process::id());
        assert!(seen.managed[0].is(&ManagedPath::of(&bundle)));
        assert!(!seen.managed[0].is(&ManagedPath::of(&dir.path().join("other.crt"))));
        // Relative and through `..`: the same file.
        let roundabout = dir.path().join("state/../ca.crt");
        assert!(seen.managed[0].is(&ManagedPath::of(&roundabout)));
        drop(held);
        assert!(state.join(LOCK_FILE).exists());
        assert_eq!(find(&state).unwrap(), None, "a stale file claims nothing");
        // And the next agent takes it over.
        let _again = claim(&state, std::slice::from_ref(&bundle))
            .unwrap()
            .expect("claimed again");
        assert!(find(&state).unwrap().is_some());
    }

    #[test]
    fn a_second_agent_on_the_same_state_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("ca.crt");
        let _held = claim(dir.path(), std::slice::from_ref(&bundle))
            .unwrap()
            .expect("claimed");
        let refused = claim(dir.path(), std::slice::from_ref(&bundle))
            .unwrap_err()
            .0;
        assert!(
            refused.contains(&format!("pid {}", std::process::id()))
                && refused.contains("own --state-dir"),
            "{refused}"
        );
    }
}
