//! `--exec-on-change`: a command run after each successful replace of the bundle, with
//! `KUBELET_CA_BUNDLE` set to its path. No shell; a failure is logged and counted, never
//! retried.
//!
//! `--kubeconfig-hook`: a command run after a managed kubeconfig gained a CA (SPEC 4c),
//! with `KUBELET_CA_KUBECONFIG` set to its path and `KUBELET_CA_ADDED` to the SHA-256 of
//! each added certificate (space-separated). The kubelet reads its kubeconfig's CA only when
//! it starts, so a failure is retried with backoff (1 s doubling to 5 minutes), the added
//! certificates of every run missed carried over to the next.
//!
//! The daemon runs one hook at a time on a thread of its own: replaces that happen while a
//! hook runs are folded into one more run after it, so a burst of rotations costs at most
//! two runs, never a pile of them. A hook that outlives `--exec-on-change-timeout` is
//! killed with its whole process group, and so is a hook still running when the agent
//! stops: no hook outlives the agent's clean exit.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use crate::config::KubeconfigHook;
use crate::status::Restart;

/// After SIGTERM, how long a hook's process group has before SIGKILL.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// How often a running hook is checked for exit, timeout or shutdown.
const POLL: Duration = Duration::from_millis(20);

/// Checks, before anything is written, that the hook's program can be run: an existing
/// regular file with execute permission, looked up on `PATH` when its name has no slash
/// (as the run itself will). A hook that cannot start would otherwise only be a warning
/// after each replace, and the service it was meant to reload would go on with the old
/// bundle. Returns the program's path, or one line saying what is wrong.
pub fn check(command: &[String]) -> Result<PathBuf, String> {
    let program = command.first().ok_or("the command is empty")?;
    let shown = crate::text::escape(program).into_owned();
    let fix = "fix --exec-on-change (or KUBELET_CA_AGENT_EXEC_ON_CHANGE), or install the program";
    if program.contains('/') {
        return runnable(Path::new(program))
            .map(|()| PathBuf::from(program))
            .map_err(|why| format!("--exec-on-change: {shown} {why}; {fix}"));
    }
    // Without PATH, the C library's execvp searches its own default.
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    let mut found = None;
    for dir in std::env::split_paths(&path) {
        // An empty entry would be the working directory: a hook found only there works or
        // not depending on where the agent was started, so it is not looked for.
        if dir.as_os_str().is_empty() {
            continue;
        }
        let candidate = dir.join(program);
        match runnable(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(why) if candidate.exists() => found = found.or(Some((candidate, why))),
            Err(_) => {}
        }
    }
    Err(match found {
        Some((candidate, why)) => format!(
            "--exec-on-change: {shown} was found on PATH as {}, which {why}; {fix}",
            crate::text::escape(&candidate.display().to_string())
        ),
        None => format!(
            "--exec-on-change: {shown} is not found on PATH ({}); give its full path, or {fix}",
            crate::text::escape(&path.to_string_lossy())
        ),
    })
}

/// Whether `path` is a regular file (through links) this process may execute.
fn runnable(path: &Path) -> Result<(), &'static str> {
    use std::os::unix::fs::PermissionsExt;
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err("does not exist"),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err("cannot be reached (permission denied on a directory above it)");
        }
        Err(_) => return Err("cannot be read"),
    };
    if metadata.is_dir() {
        return Err("is a directory, not a program");
    }
    if !metadata.is_file() {
        return Err("is not a regular file");
    }
    if metadata.permissions().mode() & 0o111 == 0
        || nix::unistd::access(path, nix::unistd::AccessFlags::X_OK).is_err()
    {
        return Err("is not executable (chmod +x it, or check the mount is not noexec)");
    }
    Ok(())
}

/// Runs the `--exec-on-change` command to completion, or until `timeout`, or until `stop`
/// says so. Returns whether it succeeded.
pub fn run(command: &[String], bundle: &Path, timeout: Duration, stop: &dyn Fn() -> bool) -> bool {
    let env = [("KUBELET_CA_BUNDLE", bundle.as_os_str().to_owned())];
    run_with(command, &env, "exec-on-change", timeout, stop)
}

/// Runs a hook (`what` names it in logs) with `env` set, as [`run`] does.
fn run_with(
    command: &[String],
    env: &[(&str, std::ffi::OsString)],
    what: &str,
    timeout: Duration,
    stop: &dyn Fn() -> bool,
) -> bool {
    let spawned = Command::new(&command[0])
        .args(&command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        // The hook is not the service: it must not speak to systemd in our name.
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .env_remove("WATCHDOG_PID")
        // Its own process group, so that what it starts can be stopped with it.
        .process_group(0)
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            tracing::warn!(command = %command[0], error = %e, "{what} command could not start");
            return false;
        }
    };
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => {
                tracing::info!(command = %command[0], "{what} command succeeded");
                return true;
            }
            Ok(Some(status)) => {
                tracing::warn!(command = %command[0], %status, "{what} command failed");
                return false;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(command = %command[0], error = %e, "cannot wait for the {what} command");
                kill_group(&mut child);
                return false;
            }
        }
        if stop() {
            tracing::warn!(command = %command[0], "stopping: killing the {what} command still running");
            kill_group(&mut child);
            return false;
        }
        if started.elapsed() >= timeout {
            tracing::warn!(command = %command[0], timeout = %humantime::format_duration(timeout), "{what} command timed out; killed it and its process group");
            kill_group(&mut child);
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// Asks the host to restart the kubelet (`--kubeconfig-restart-request`), logging how it
/// ended; `note` is told why it is pending meanwhile. Returns whether it succeeded.
fn restart_kubelet(dir: &Path, stop: &dyn Fn() -> bool, note: &dyn Fn(Option<String>)) -> bool {
    match crate::kubelet_restart::restart(dir, stop, note) {
        Ok(()) => {
            tracing::info!(dir = %dir.display(), "the host restarted the kubelet");
            true
        }
        Err(error) => {
            tracing::warn!(%error, "the kubelet's restart failed");
            false
        }
    }
}

/// SIGTERM to the hook's process group, then SIGKILL after a grace period; reaps the child.
fn kill_group(child: &mut Child) {
    let group = Pid::from_raw(child.id() as i32);
    let _ = killpg(group, Signal::SIGTERM);
    let deadline = Instant::now() + KILL_GRACE;
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            break;
        }
        std::thread::sleep(POLL);
    }
    // Whatever else is left in the group (the child's own children) goes too.
    let _ = killpg(group, Signal::SIGKILL);
    let _ = child.wait();
}

#[derive(Default)]
struct Queue {
    /// A replace happened since the last run started.
    pending: bool,
    /// The certificates added since the last run that succeeded (a kubeconfig's hook).
    added: std::collections::BTreeSet<String>,
    stopping: bool,
    /// A kubeconfig's hook: the kubelet's restart after the last CA added, `None` until
    /// one was added.
    restart: Option<Restart>,
    /// Why that restart is pending, when the host has not taken it.
    restart_note: Option<String>,
}

/// What a hook is run for.
#[derive(Clone)]
enum Kind {
    /// The bundle (`--exec-on-change`): a failure is counted, never retried.
    Bundle(PathBuf),
    /// A managed kubeconfig (`--kubeconfig-hook`, `--kubeconfig-restart-request`): a failure
    /// is counted and retried.
    Kubeconfig(PathBuf),
}

/// The first wait before a failed `--kubeconfig-hook` is run again, and the longest.
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(300);

/// The daemon's hook runner: one hook at a time, later changes coalesced.
pub struct Hooks {
    queue: Arc<(Mutex<Queue>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Hooks {
    /// Starts the runner of `--exec-on-change`; `failed` is called after each failed run.
    pub fn start(
        command: Vec<String>,
        bundle: PathBuf,
        timeout: Duration,
        failed: impl Fn() + Send + 'static,
    ) -> Hooks {
        Hooks::spawn(
            KubeconfigHook::Command(command),
            Kind::Bundle(bundle),
            timeout,
            failed,
            || {},
        )
    }

    /// Starts the runner of `--kubeconfig-hook` (or `--kubeconfig-restart-request`) for the
    /// kubeconfig at `path`; `ran` is called after each run, once [`Hooks::restart`] says
    /// how it ended.
    pub fn start_for_kubeconfig(
        hook: KubeconfigHook,
        path: PathBuf,
        timeout: Duration,
        failed: impl Fn() + Send + 'static,
        ran: impl Fn() + Send + 'static,
    ) -> Hooks {
        Hooks::spawn(hook, Kind::Kubeconfig(path), timeout, failed, ran)
    }

    fn spawn(
        hook: KubeconfigHook,
        kind: Kind,
        timeout: Duration,
        failed: impl Fn() + Send + 'static,
        ran: impl Fn() + Send + 'static,
    ) -> Hooks {
        let queue: Arc<(Mutex<Queue>, Condvar)> = Arc::default();
        let shared = queue.clone();
        let thread = std::thread::Builder::new()
            .name("hook".into())
            .spawn(move || {
                let (lock, wake) = &*shared;
                let stopping = || lock.lock().map_or(true, |q| q.stopping);
                let mut retry = RETRY_FIRST;
                loop {
                    let added = {
                        let mut queue = lock.lock().expect("hook queue");
                        while !queue.pending && !queue.stopping {
                            queue = wake.wait(queue).expect("hook queue");
                        }
                        if queue.stopping {
                            return;
                        }
                        queue.pending = false;
                        std::mem::take(&mut queue.added)
                    };
                    let (env, what) = match &kind {
                        Kind::Bundle(bundle) => (
                            vec![("KUBELET_CA_BUNDLE", bundle.as_os_str().to_owned())],
                            "exec-on-change",
                        ),
                        Kind::Kubeconfig(path) => (
                            vec![
                                ("KUBELET_CA_KUBECONFIG", path.as_os_str().to_owned()),
                                (
                                    "KUBELET_CA_ADDED",
                                    added.iter().cloned().collect::<Vec<_>>().join(" ").into(),
                                ),
                            ],
                            "kubeconfig-hook",
                        ),
                    };
                    let succeeded = match &hook {
                        KubeconfigHook::Command(command) => {
                            run_with(command, &env, what, timeout, &stopping)
                        }
                        KubeconfigHook::Request(dir) => {
                            let note = |why: Option<String>| {
                                if let Ok(mut queue) = lock.lock() {
                                    queue.restart_note = why;
                                }
                                ran();
                            };
                            restart_kubelet(dir, &stopping, &note)
                        }
                    };
                    if let Kind::Kubeconfig(_) = kind {
                        if let Ok(mut queue) = lock.lock() {
                            queue.restart = Some(match (succeeded, queue.pending) {
                                (false, _) => Restart::Failed,
                                // A CA added since the run began: one more run to come.
                                (true, true) => Restart::Pending,
                                (true, false) => Restart::Done,
                            });
                        }
                        ran();
                    }
                    if succeeded {
                        retry = RETRY_FIRST;
                        continue;
                    }
                    failed();
                    if let Kind::Kubeconfig(_) = kind {
                        // Run again after the backoff, with what this run was to announce;
                        // a change meanwhile does not shorten the wait.
                        tracing::warn!(
                            retry_in = %humantime::format_duration(retry),
                            "kubeconfig-hook failed: the kubelet may still hold the old CA data; running it again"
                        );
                        let mut queue = lock.lock().expect("hook queue");
                        queue.added.extend(added);
                        queue.pending = true;
                        let deadline = Instant::now() + retry;
                        while !queue.stopping && Instant::now() < deadline {
                            let left = deadline.saturating_duration_since(Instant::now());
                            queue = wake.wait_timeout(queue, left).expect("hook queue").0;
                        }
                        retry = (retry * 2).min(RETRY_MAX);
                    }
                }
            })
            .expect("spawn the hook thread");
        Hooks {
            queue,
            thread: Some(thread),
        }
    }

    /// Asks for a run after the one in progress, if any; several asks before it starts
    /// make one run.
    pub fn changed(&self) {
        self.changed_with(Vec::new());
    }

    /// [`Hooks::changed`], announcing the SHA-256 of the certificates `added`.
    pub fn changed_with(&self, added: Vec<String>) {
        let (lock, wake) = &*self.queue;
        if let Ok(mut queue) = lock.lock() {
            queue.pending = true;
            if !added.is_empty() {
                queue.restart = Some(Restart::Pending);
            }
            queue.added.extend(added);
            wake.notify_one();
        }
    }

    /// A kubeconfig's hook: the kubelet's restart after the last CA added (`None` when
    /// none was added since the agent started).
    pub fn restart(&self) -> Option<Restart> {
        let (lock, _) = &*self.queue;
        lock.lock().ok().and_then(|q| q.restart)
    }

    /// Why the kubelet's restart is pending, when the host has not taken the request.
    pub fn restart_note(&self) -> Option<String> {
        let (lock, _) = &*self.queue;
        lock.lock().ok().and_then(|q| q.restart_note.clone())
    }
}

impl Drop for Hooks {
    /// Kills a hook still running, and waits for the runner to end.
    fn drop(&mut self) {
        let (lock, wake) = &*self.queue;
        if let Ok(mut queue) = lock.lock() {
            queue.stopping = true;
            wake.notify_one();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn words(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn a_hook_is_checked_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("hook");
        std::fs::write(&script, "#!/bin/sh\n").unwrap();
        let owned = |p: &Path| vec![p.display().to_string()];
        let why = check(&owned(&script)).unwrap_err();
        assert!(why.contains("is not executable"), "{why}");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(check(&owned(&script)), Ok(script.clone()));
        let why = check(&owned(&dir.path().join("missing"))).unwrap_err();
        assert!(why.contains("does not exist"), "{why}");
        let why = check(&owned(dir.path())).unwrap_err();
        assert!(why.contains("is a directory"), "{why}");
        assert!(check(&words("sh -c true")).unwrap().ends_with("sh"));
        let why = check(&words("no-such-program-anywhere")).unwrap_err();
        assert!(why.contains("is not found on PATH"), "{why}");
    }

    #[test]
    fn a_hook_that_overstays_is_killed_with_its_group() {
        let started = Instant::now();
        let ok = run(
            &words("sh -c sleep\u{20}30"),
            Path::new("/x"),
            Duration::from_millis(200),
            &|| false,
        );
        assert!(!ok);
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    /// Waits until `condition` holds, at most 10 s (a loaded machine spawns slowly).
    fn until(condition: impl Fn() -> bool) {
        let start = Instant::now();
        while !condition() {
            assert!(start.elapsed() < Duration::from_secs(10), "not within 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn changes_during_a_run_are_coalesced_into_one_more_run() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("runs");
        let script = format!("echo run >> {}; sleep 0.3", log.display());
        let failures = Arc::new(AtomicUsize::new(0));
        let counted = failures.clone();
        let hooks = Hooks::start(
            vec!["sh".into(), "-c".into(), script],
            PathBuf::from("/x"),
            Duration::from_secs(10),
            move || {
                counted.fetch_add(1, Ordering::SeqCst);
            },
        );
        hooks.changed();
        std::thread::sleep(Duration::from_millis(100));
        for _ in 0..20 {
            hooks.changed();
        }
        let runs = || {
            std::fs::read_to_string(&log)
                .map(|text| text.lines().count())
                .unwrap_or(0)
        };
        until(|| runs() >= 2);
        // And no third: the second run took every change made during the first.
        std::thread::sleep(Duration::from_millis(1000));
        drop(hooks);
        let runs = runs();
        assert_eq!(runs, 2, "one run, then one for all the changes during it");
        assert_eq!(failures.load(Ordering::SeqCst), 0);
    }

    /// A kubeconfig's hook is told the path and what was added; a failed run is run again
    /// after a second, with the certificates it was to announce and those added since.
    #[test]
    fn a_kubeconfig_hook_that_fails_is_run_again_with_every_added_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("runs");
        let script = format!(
            "echo \"$KUBELET_CA_KUBECONFIG $KUBELET_CA_ADDED\" >> {log}; test $(wc -l < {log}) -ge 2",
            log = log.display()
        );
        let failures = Arc::new(AtomicUsize::new(0));
        let counted = failures.clone();
        let hooks = Hooks::start_for_kubeconfig(
            KubeconfigHook::Command(vec!["sh".into(), "-c".into(), script]),
            PathBuf::from("/var/lib/kubelet/kubeconfig"),
            Duration::from_secs(10),
            move || {
                counted.fetch_add(1, Ordering::SeqCst);
            },
            || {},
        );
        assert_eq!(hooks.restart(), None, "nothing added yet");
        hooks.changed_with(vec!["aa".into()]);
        until(|| hooks.restart() == Some(Restart::Failed));
        hooks.changed_with(vec!["bb".into()]);
        assert_eq!(hooks.restart(), Some(Restart::Pending));
        until(|| hooks.restart() == Some(Restart::Done));
        drop(hooks);
        let runs = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            runs, "/var/lib/kubelet/kubeconfig aa\n/var/lib/kubelet/kubeconfig aa bb\n",
            "the failed run's certificate is announced again, with the one added since"
        );
        assert_eq!(failures.load(Ordering::SeqCst), 1);
    }
}
