//! The kubelet's restart after a managed kubeconfig gained a CA (SPEC 4c), asked of the
//! host rather than done: the process that parses what the cluster sends and serves the
//! endpoint never holds systemd's bus (SPEC 13, as OpenSSH keeps its one privileged act out
//! of the process that parses input). `--kubeconfig-restart-request DIR`:
//!
//! 1. the agent removes `DIR/result` and writes `DIR/request` (by rename: never half
//!    written);
//! 2. the host's `kubelet-ca-agent-kubelet-restart.path` sees the request and starts
//!    `kubelet-ca-agent-kubelet-restart.service`, which takes it (renames it away, so that
//!    a request made during the restart makes one more), runs `systemctl restart
//!    kubelet.service` and writes `DIR/result`: systemd's own words for how the service
//!    ended (`success ...`, `exit-code exited 1`);
//! 3. the agent reads the result: `success` is done, anything else failed and is asked
//!    again with the hook's backoff.
//!
//! The host reads nothing the agent writes: the request's presence is the whole message.
//! Where nothing on the host takes it (the path unit not installed), the restart stays
//! pending with that reason, and the request waits for it.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Where the requests go by default: under `/run`, so that none survives a reboot.
pub const DEFAULT_DIR: &str = "/run/kubelet-ca-agent/kubelet-restart";

/// The host's unit that takes the requests.
pub const PATH_UNIT: &str = "kubelet-ca-agent-kubelet-restart.path";

/// The request, the host's result.
const REQUEST: &str = "request";
const RESULT: &str = "result";

/// A result is a line of systemd's words; more is not one.
const MAX_RESULT: usize = 256;

/// How long a request may wait untaken before the restart is said to be pending for want of
/// a taker.
pub const UNTAKEN: Duration = Duration::from_secs(10);

/// The longest wait for a result once the host took the request: systemd bounds the restart
/// itself (the kubelet's start timeout); this only guards against a result that never
/// comes.
pub const RESULT_MAX: Duration = Duration::from_secs(15 * 60);

/// How often the directory is looked at while a restart is asked: often at first, when
/// the host takes a request within milliseconds, then once a second.
const POLL_FAST: Duration = Duration::from_millis(50);
const POLL_SLOW: Duration = Duration::from_secs(1);

/// What the wait for the host has come to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// The request is there, not taken yet.
    Untaken,
    /// The request was taken; no result yet.
    Taken,
    /// The host's result line.
    Result(String),
    /// The directory is not there (nothing installed it).
    NoDir,
}

/// What to do next, from what was seen and how long it has been (pure: tested without a
/// disk or a clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Keep waiting; `Some` says why the restart is pending, for the operator.
    Wait(Option<String>),
    /// The restart is done.
    Done,
    /// The restart failed, and why.
    Failed(String),
}

/// The decision after `seen`, `waited` since the request was written (or first tried,
/// while the directory is missing) and `taken_for` since the host took it.
pub fn next(
    dir: &Path,
    seen: &Seen,
    waited: Duration,
    taken_for: Option<Duration>,
    result_max: Duration,
) -> Next {
    let shown = dir.display();
    match seen {
        Seen::Result(line) if line.split_whitespace().next() == Some("success") => Next::Done,
        Seen::Result(line) => Next::Failed(format!(
            "the host's kubelet restart ended with {:?} (journalctl -u kubelet-ca-agent-kubelet-restart.service says why)",
            crate::text::escape(line.trim())
        )),
        Seen::NoDir => Next::Wait(Some(format!(
            "pending: {shown} does not exist: install and enable {PATH_UNIT} on this host (docs/operations.md, \"The kubelet's restart: the host's path unit\")"
        ))),
        Seen::Untaken if waited >= UNTAKEN => Next::Wait(Some(format!(
            "pending: nothing on this host took the restart request in {shown} within {}: is {PATH_UNIT} enabled? (docs/operations.md, \"The kubelet's restart: the host's path unit\")",
            humantime::format_duration(UNTAKEN)
        ))),
        Seen::Untaken => Next::Wait(None),
        Seen::Taken if taken_for.is_some_and(|t| t >= result_max) => Next::Failed(format!(
            "the host took the restart request in {shown} but wrote no result within {}",
            humantime::format_duration(result_max)
        )),
        Seen::Taken => Next::Wait(None),
    }
}

/// Asks the host to restart the kubelet and waits for how it ended. `note` is told why
/// the restart is pending whenever that changes (`None` once it is not). Gives up when
/// `stop` says so. The error says what failed, in one line.
pub fn restart(
    dir: &Path,
    stop: &dyn Fn() -> bool,
    note: &dyn Fn(Option<String>),
) -> Result<(), String> {
    restart_within(dir, RESULT_MAX, stop, note)
}

/// [`restart`], giving up on a taken request after `result_max` without a result.
fn restart_within(
    dir: &Path,
    result_max: Duration,
    stop: &dyn Fn() -> bool,
    note: &dyn Fn(Option<String>),
) -> Result<(), String> {
    let started = Instant::now();
    let mut asked = ask(dir);
    let mut taken_at: Option<Instant> = None;
    let mut said: Option<String> = None;
    loop {
        if stop() {
            return Err("stopping: the kubelet's restart is no longer waited for".into());
        }
        let seen = match &asked {
            Ok(()) => look(dir),
            Err(_) if !dir.is_dir() => Seen::NoDir,
            Err(e) => return Err(e.clone()),
        };
        if seen == Seen::Taken && taken_at.is_none() {
            taken_at = Some(Instant::now());
        }
        let decision = next(
            dir,
            &seen,
            started.elapsed(),
            taken_at.map(|t| t.elapsed()),
            result_max,
        );
        match decision {
            Next::Done => {
                tell(note, &mut said, None);
                return Ok(());
            }
            Next::Failed(why) => {
                tell(note, &mut said, None);
                return Err(why);
            }
            Next::Wait(why) => tell(note, &mut said, why),
        }
        std::thread::sleep(poll_every(started.elapsed()));
        if seen == Seen::NoDir {
            asked = ask(dir);
        }
    }
}

/// How long to wait before looking again, `waited` after the request: often while the host
/// would answer at once, then once a second, for as long as nothing takes it.
fn poll_every(waited: Duration) -> Duration {
    if waited < UNTAKEN {
        POLL_FAST
    } else {
        POLL_SLOW
    }
}

/// Tells `note` of a change of the pending reason, once.
fn tell(note: &dyn Fn(Option<String>), said: &mut Option<String>, why: Option<String>) {
    if *said != why {
        if let Some(why) = &why {
            tracing::warn!("the kubelet's restart is {why}");
        }
        note(why.clone());
        *said = why;
    }
}

/// Clears the last result and writes the request, by rename.
fn ask(dir: &Path) -> Result<(), String> {
    let shown = dir.display();
    match std::fs::remove_file(dir.join(RESULT)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot clear {shown}/{RESULT}: {e}")),
    }
    let temporary = dir.join(format!(".{REQUEST}.{}", std::process::id()));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&temporary)?;
        file.write_all(b"restart kubelet.service\n")?;
        std::fs::rename(&temporary, dir.join(REQUEST))
    })();
    written.map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        format!("cannot write the restart request in {shown}: {e}")
    })
}

/// What the directory says now.
fn look(dir: &Path) -> Seen {
    if let Some(line) = read_result(&dir.join(RESULT)) {
        return Seen::Result(line);
    }
    match std::fs::symlink_metadata(dir.join(REQUEST)) {
        Ok(_) => Seen::Untaken,
        Err(_) if !dir.is_dir() => Seen::NoDir,
        Err(_) => Seen::Taken,
    }
}

/// The result's first line, when there is a result: a regular file, never followed
/// through a link, at most [`MAX_RESULT`] bytes read.
fn read_result(path: &Path) -> Option<String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut bytes = Vec::new();
    file.take(MAX_RESULT as u64).read_to_end(&mut bytes).ok()?;
    let text = String::from_utf8_lossy(&bytes);
    Some(text.lines().next().unwrap_or("").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> &'static Path {
        Path::new("/run/kubelet-ca-agent/kubelet-restart")
    }

    #[test]
    fn success_is_done_and_anything_else_failed_in_systemds_words() {
        let seen = |line: &str| Seen::Result(line.into());
        assert_eq!(
            next(
                dir(),
                &seen("success exited 0"),
                Duration::ZERO,
                None,
                RESULT_MAX
            ),
            Next::Done
        );
        let Next::Failed(why) = next(
            dir(),
            &seen("exit-code exited 1"),
            Duration::ZERO,
            None,
            RESULT_MAX,
        ) else {
            panic!("a failed restart is not done");
        };
        assert!(
            why.contains("\"exit-code exited 1\"") && why.contains("journalctl"),
            "{why}"
        );
        assert!(matches!(
            next(dir(), &seen(""), Duration::ZERO, None, RESULT_MAX),
            Next::Failed(_)
        ));
        assert!(matches!(
            next(dir(), &seen("successful"), Duration::ZERO, None, RESULT_MAX),
            Next::Failed(_)
        ));
    }

    #[test]
    fn the_directory_is_looked_at_often_at_first_then_once_a_second() {
        assert_eq!(poll_every(Duration::ZERO), POLL_FAST);
        assert_eq!(poll_every(UNTAKEN - Duration::from_millis(1)), POLL_FAST);
        assert_eq!(poll_every(UNTAKEN), POLL_SLOW);
        assert_eq!(poll_every(RESULT_MAX), POLL_SLOW);
        assert!(POLL_FAST < POLL_SLOW);
    }

    #[test]
    fn an_untaken_request_is_pending_after_a_while_and_names_the_path_unit() {
        assert_eq!(
            next(
                dir(),
                &Seen::Untaken,
                UNTAKEN - Duration::from_millis(1),
                None,
                RESULT_MAX
            ),
            Next::Wait(None)
        );
        let Next::Wait(Some(why)) = next(dir(), &Seen::Untaken, UNTAKEN, None, RESULT_MAX) else {
            panic!("an untaken request must say why it waits");
        };
        assert!(
            why.starts_with("pending: ") && why.contains(PATH_UNIT),
            "{why}"
        );
        let Next::Wait(Some(why)) = next(dir(), &Seen::NoDir, Duration::ZERO, None, RESULT_MAX)
        else {
            panic!("a missing directory must say why it waits");
        };
        assert!(
            why.contains("does not exist") && why.contains(PATH_UNIT),
            "{why}"
        );
    }

    #[test]
    fn a_taken_request_waits_for_its_result_then_fails() {
        assert_eq!(
            next(
                dir(),
                &Seen::Taken,
                RESULT_MAX * 2,
                Some(RESULT_MAX - Duration::from_secs(1)),
                RESULT_MAX
            ),
            Next::Wait(None)
        );
        assert!(matches!(
            next(dir(), &Seen::Taken, Duration::ZERO, Some(RESULT_MAX), RESULT_MAX),
            Next::Failed(why) if why.contains("wrote no result within 15m")
        ));
    }

    /// Nothing on the host yet: no directory, pending and saying so; the directory comes,
    /// the request is written and taken: done.
    #[test]
    fn a_missing_directory_is_pending_until_it_comes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("kubelet-restart");
        let notes = std::sync::Mutex::new(Vec::new());
        let host = {
            let dir = dir.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                std::fs::create_dir(&dir).unwrap();
                let request = dir.join(REQUEST);
                while !request.exists() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                std::fs::rename(&request, dir.join("taken")).unwrap();
                std::fs::write(dir.join(RESULT), "success exited 0\n").unwrap();
            })
        };
        let result = restart(&dir, &|| false, &|why| notes.lock().unwrap().push(why));
        host.join().unwrap();
        assert_eq!(result, Ok(()));
        let notes = notes.into_inner().unwrap();
        assert!(
            notes
                .first()
                .is_some_and(|n| n.as_deref().is_some_and(|n| n.contains("does not exist"))),
            "{notes:?}"
        );
        assert_eq!(
            notes.last(),
            Some(&None),
            "the pending reason is cleared once done"
        );
        // A directory where the request cannot be written is a failure, not a wait.
        let blocked = tmp.path().join("blocked");
        std::fs::create_dir_all(blocked.join(REQUEST).join("inside")).unwrap();
        let stop_at = Instant::now() + Duration::from_secs(5);
        let why = restart(&blocked, &|| Instant::now() > stop_at, &|_| {}).unwrap_err();
        assert!(
            why.starts_with("cannot write the restart request in"),
            "{why}"
        );
        // A last result that cannot be cleared (not a file) is a failure too: never a wait
        // that could read it as this request's.
        let stuck = tmp.path().join("stuck");
        std::fs::create_dir_all(stuck.join(RESULT).join("inside")).unwrap();
        let stop_at = Instant::now() + Duration::from_secs(5);
        let why = restart(&stuck, &|| Instant::now() > stop_at, &|_| {}).unwrap_err();
        assert!(why.starts_with("cannot clear"), "{why}");
    }

    /// A request the host took and never answered fails `result_max` after it was taken,
    /// not after it was written; one not yet taken waits.
    #[test]
    fn a_taken_request_without_result_fails_after_its_wait_from_the_take() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let taken = std::sync::Arc::new(std::sync::Mutex::new(None));
        let host = {
            let (dir, taken) = (dir.clone(), taken.clone());
            std::thread::spawn(move || {
                let request = dir.join(REQUEST);
                while !request.exists() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                std::thread::sleep(Duration::from_millis(400));
                std::fs::rename(&request, dir.join("taken")).unwrap();
                *taken.lock().unwrap() = Some(Instant::now());
            })
        };
        let stop_at = Instant::now() + Duration::from_secs(10);
        let result = restart_within(
            &dir,
            Duration::from_millis(300),
            &|| Instant::now() > stop_at,
            &|_| {},
        );
        let failed_at = Instant::now();
        host.join().unwrap();
        let why = result.unwrap_err();
        assert!(why.contains("wrote no result within 300ms"), "{why}");
        let taken = taken.lock().unwrap().expect("taken");
        assert!(
            failed_at.duration_since(taken) >= Duration::from_millis(300),
            "failed {:?} after the take",
            failed_at.duration_since(taken)
        );
    }

    #[test]
    fn the_request_is_written_whole_and_a_result_is_read_without_following_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join(RESULT), "old\n").unwrap();
        ask(tmp.path()).unwrap();
        assert!(
            !tmp.path().join(RESULT).exists(),
            "the last result is cleared"
        );
        assert_eq!(look(tmp.path()), Seen::Untaken);
        std::fs::rename(tmp.path().join(REQUEST), tmp.path().join("taken")).unwrap();
        assert_eq!(look(tmp.path()), Seen::Taken);
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, "success, as a lie\n").unwrap();
        std::os::unix::fs::symlink(&secret, tmp.path().join(RESULT)).unwrap();
        assert_eq!(look(tmp.path()), Seen::Taken, "a linked result is not read");
        std::fs::remove_file(tmp.path().join(RESULT)).unwrap();
        std::fs::write(tmp.path().join(RESULT), "success exited 0\nmore\n").unwrap();
        assert_eq!(look(tmp.path()), Seen::Result("success exited 0".into()));
        assert_eq!(look(&tmp.path().join("gone")), Seen::NoDir);
    }

    #[test]
    fn a_restart_asked_of_a_host_that_answers_is_done_and_one_that_fails_is_not() {
        let tmp = tempfile::tempdir().unwrap();
        for (line, ok) in [("success exited 0", true), ("exit-code exited 1", false)] {
            let dir = tmp.path().to_path_buf();
            let host = std::thread::spawn(move || {
                let request = dir.join(REQUEST);
                while !request.exists() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                std::fs::rename(&request, dir.join("taken")).unwrap();
                std::fs::write(dir.join(RESULT), format!("{line}\n")).unwrap();
            });
            let result = restart(tmp.path(), &|| false, &|_| {});
            host.join().unwrap();
            assert_eq!(result.is_ok(), ok, "{line}: {result:?}");
        }
    }
}
