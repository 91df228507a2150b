//! The managed bundle as a whole: the file, and the records kept beside it in the state
//! directory (history of replaced bundles, retention memory, `managed-files.json`), shared
//! by `sync` and the daemon.
//!
//! The records are for operators and for the next start; none is needed for the kubelet to
//! see a new bundle. So the daemon keeps them on a thread of their own, in order, and its
//! loop is free for the next change as soon as the bundle itself is durable.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use crate::bundle::parse::scan;
use crate::bundle::{self, Built, Certificate, Fingerprint, Remembered};
use crate::config;
use crate::state::{Book, StateDir};
use crate::writer::{BundleWriter, History, OnDisk, Outcome, WriteError};

pub struct Target {
    writer: BundleWriter,
    state: StateDir,
    /// Whether `--retain-removed` is on, so that its memory is kept.
    retains: bool,
    records: Records,
}

/// Something to write into the state directory after the bundle.
enum Record {
    /// The bundle that was replaced, at that instant.
    History(Vec<u8>, OffsetDateTime),
    Retention(Vec<Remembered>),
    ManagedFiles(String),
}

/// Where records are written: right away (`sync`), or on the records thread (the daemon).
enum Records {
    Inline(Keeper),
    Background {
        queue: Option<mpsc::Sender<Record>>,
        thread: Option<JoinHandle<()>>,
    },
}

/// Writes records; failures are logged, never fatal: the bundle matters more.
struct Keeper {
    state: StateDir,
    history: History,
    bundle: PathBuf,
    book: Book,
}

impl Record {
    /// The `record` label of `kubelet_ca_state_errors_total`.
    fn kind(&self) -> &'static str {
        match self {
            Record::History(..) => "history",
            Record::Retention(_) => "retention",
            Record::ManagedFiles(_) => "managed_files",
        }
    }
}

impl Keeper {
    /// Keeps the records of `bundle` in `state_dir` (its history and retention memory),
    /// and its entry in `book`.
    fn new(state_dir: &Path, bundle: PathBuf, book: Book) -> Self {
        Keeper {
            state: StateDir::new(state_dir.to_path_buf()),
            history: History::new(state_dir),
            bundle,
            book,
        }
    }

    fn keep(&self, record: &Record) -> Result<(), String> {
        let (what, result) = match record {
            Record::History(old, at) => (
                "save the replaced bundle to history",
                self.history.record(old, *at).map(drop),
            ),
            Record::Retention(memory) => (
                "save the retention memory",
                self.state.save_retention(memory),
            ),
            Record::ManagedFiles(sha256) => (
                "write managed-files.json",
                self.book.record(&self.bundle, sha256),
            ),
        };
        result.map_err(|e| {
            tracing::warn!(state_dir = %self.state.path().display(), error = %e, "could not {what}");
            what.to_string()
        })
    }

    /// The records thread: keeps records in order; one that fails is tried again with
    /// backoff (1 s doubling to 5 minutes) until it succeeds or a newer record of the same
    /// kind replaces it, so that a state directory that was briefly unwritable does not
    /// leave `managed-files.json` stale. Each failure is counted.
    fn serve(self, records: mpsc::Receiver<Record>, failed: impl Fn(&'static str)) {
        const FIRST: Duration = Duration::from_secs(1);
        const MAX: Duration = Duration::from_secs(300);
        let mut pending: Vec<Record> = Vec::new();
        let mut delay = FIRST;
        let mut open = true;
        while open || !pending.is_empty() {
            let next = if pending.is_empty() {
                records
                    .recv()
                    .map_err(|_| mpsc::RecvTimeoutError::Disconnected)
            } else if open {
                records.recv_timeout(delay)
            } else {
                // Stopping: one last try of what is left.
                Err(mpsc::RecvTimeoutError::Timeout)
            };
            match next {
                Ok(record) => {
                    // A newer record of a kind that describes the present replaces the old.
                    if !matches!(record, Record::History(..)) {
                        pending.retain(|r| r.kind() != record.kind());
                    }
                    pending.push(record);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => open = false,
            }
            let retrying = delay > FIRST || !open;
            let before = pending.len();
            pending.retain(|record| match self.keep(record) {
                Ok(()) => false,
                Err(_) => {
                    failed(record.kind());
                    true
                }
            });
            if pending.is_empty() {
                if retrying && before > 0 {
                    tracing::info!(state_dir = %self.state.path().display(), "the state directory is writable again; records are up to date");
                }
                delay = FIRST;
            } else if !open {
                return;
            } else {
                // Bounded: a state directory that stays unwritable must not grow memory.
                let is_history = |r: &Record| matches!(r, Record::History(..));
                while pending.iter().filter(|r| is_history(r)).count()
                    > crate::writer::history::KEEP
                {
                    let oldest = pending.iter().position(is_history).expect("counted above");
                    pending.remove(oldest);
                }
                delay = (delay * 2).min(MAX);
            }
        }
    }
}

/// What [`Target::apply`] did.
#[derive(Debug)]
pub struct Applied {
    /// True when the file was replaced; false when it already held the bundle.
    pub replaced: bool,
    pub sha256: String,
    pub added: usize,
    pub removed: usize,
    /// When the new file was durable (or found already in place): the end of
    /// `kubelet_ca_sync_duration_seconds`, before the bookkeeping that follows a write.
    pub durable_at: Instant,
}

impl Target {
    /// The bundle's target, which writes its records before `apply` returns.
    pub fn new(common: &config::Common) -> Self {
        let book = Book::open(&common.state_dir, &common.managed_paths());
        Target::for_file(common, &common.bundle, book)
    }

    /// The target of the managed file at `path` (the bundle, or a `--manage` file), its
    /// entry of `managed-files.json` kept in `book`. The bundle's history and retention
    /// memory are in the state directory itself; another file's in a directory of its own
    /// under `<state-dir>/files/` ([`file_state_dir`]).
    pub fn for_file(common: &config::Common, path: &Path, book: Book) -> Self {
        let state_dir = if path == common.bundle {
            common.state_dir.clone()
        } else {
            file_state_dir(&common.state_dir, path)
        };
        let keeper = Keeper::new(&state_dir, path.to_path_buf(), book);
        Target {
            writer: BundleWriter::new(path.to_path_buf(), common.file_mode),
            state: StateDir::new(state_dir),
            retains: !common.retain_removed.is_zero(),
            records: Records::Inline(keeper),
        }
    }

    /// Moves record keeping to a thread of its own, which retries failed records;
    /// `failed` is called with the kind of each record that could not be written.
    /// Dropping the target waits for the thread.
    pub fn with_background_records(
        mut self,
        failed: impl Fn(&'static str) + Send + 'static,
    ) -> Self {
        if let Records::Inline(keeper) = std::mem::replace(
            &mut self.records,
            Records::Background {
                queue: None,
                thread: None,
            },
        ) {
            let (queue, records) = mpsc::channel::<Record>();
            let thread = std::thread::Builder::new()
                .name("records".into())
                .spawn(move || keeper.serve(records, failed))
                .expect("spawn the records thread");
            self.records = Records::Background {
                queue: Some(queue),
                thread: Some(thread),
            };
        }
        self
    }

    fn keep(&self, record: Record) {
        match &self.records {
            Records::Inline(keeper) => {
                let _ = keeper.keep(&record);
            }
            Records::Background {
                queue: Some(queue), ..
            } => {
                let _ = queue.send(record);
            }
            Records::Background { queue: None, .. } => {}
        }
    }

    pub fn path(&self) -> &Path {
        self.writer.path()
    }

    pub fn writer(&self) -> &BundleWriter {
        &self.writer
    }

    /// Creates the state directory and removes temporary files a killed run left behind.
    /// Problems are logged: neither blocks keeping the bundle correct.
    pub fn prepare(&self) {
        if let Err(e) = self.state.ensure() {
            tracing::warn!(state_dir = %self.state.path().display(), error = %e, "cannot create the state directory; history and memory are not kept");
        }
        let history = self.state.path().join("history");
        for dir in [
            crate::writer::atomic::parent_dir(self.path()),
            self.state.path().to_path_buf(),
            history,
        ] {
            match crate::writer::atomic::remove_stale_temp_files(&dir) {
                Ok(removed) => {
                    for path in removed {
                        tracing::info!(path = %path.display(), "removed a temporary file left by a killed run");
                    }
                }
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot look for stale temporary files")
                }
            }
        }
    }

    /// The retention memory; on first use, the bundle already on disk (it is adopted).
    pub fn remembered(&self, on_disk: Option<&[u8]>) -> Vec<Remembered> {
        if !self.retains {
            return Vec::new();
        }
        self.state.load_retention().unwrap_or_else(|| {
            let adopted = on_disk.and_then(|b| bundle::parse_source(b).ok());
            adopted
                .map(|parsed| parsed.certificates)
                .unwrap_or_default()
                .into_iter()
                .map(|certificate| Remembered {
                    certificate,
                    missing_since: None,
                })
                .collect()
        })
    }

    /// Makes the file hold `built`, written only if its bytes differ from `current` (what
    /// the caller just read from it), owned by `owner` when given; the replaced bundle
    /// goes to history unless `history` is false (a repair replaces someone else's content,
    /// not a bundle of ours). The caller records the state that goes with it
    /// ([`Target::record`]).
    pub fn apply(
        &self,
        built: &Built,
        rendered: &[u8],
        current: &OnDisk,
        owner: Option<(u32, u32)>,
        now: OffsetDateTime,
        history: bool,
    ) -> Result<Applied, WriteError> {
        let sha256 = Fingerprint::of(rendered).to_hex();
        let outcome = self.writer.write(rendered, current, owner)?;
        let durable_at = Instant::now();
        let certificates = built.bundle.len();
        let path = self.path().display();
        let applied = match outcome {
            Outcome::Unchanged => {
                tracing::debug!(bundle = %path, certificates, sha256 = %sha256, "bundle already in sync");
                Applied {
                    replaced: false,
                    sha256,
                    added: 0,
                    removed: 0,
                    durable_at,
                }
            }
            Outcome::Replaced { previous } => {
                // One parse of what was replaced serves both the diff and history, which
                // keeps bundles only: content that does not parse as one (garbage, or a
                // bundle with a key pasted in) is not copied into the state directory.
                let parsed = previous.as_deref().map(bundle::parse_source);
                let old = match (&parsed, previous.as_deref()) {
                    (Some(Ok(parsed)), _) => parsed.certificates.clone(),
                    (_, Some(damaged)) => readable_certificates(damaged),
                    (_, None) => Vec::new(),
                };
                let diff = bundle::diff(&old, built.bundle.certificates());
                let (added, removed) = (diff.added.len(), diff.removed.len());
                tracing::info!(bundle = %path, certificates, added, removed, sha256 = %sha256, "bundle written");
                // An expired signer the sources still carry: a warning naming each one.
                for expired in built
                    .bundle
                    .certificates()
                    .iter()
                    .filter(|c| c.is_expired_at(now.unix_timestamp()))
                {
                    tracing::warn!(
                        bundle = %path,
                        subject = %crate::text::escape(&expired.display_name()),
                        sha256 = %expired.fingerprint(),
                        not_after = %crate::text::rfc3339(expired.not_after),
                        "the bundle holds an expired certificate that a source still carries; the kubelet ignores it while a valid one remains (rotate it out of the source, or set --drop-expired)"
                    );
                }
                if let (true, Some(Ok(_)), Some(old)) = (history, &parsed, previous) {
                    self.keep(Record::History(old, now));
                }
                Applied {
                    replaced: true,
                    sha256,
                    added,
                    removed,
                    durable_at,
                }
            }
        };
        Ok(applied)
    }

    /// Puts back `content` (the adopted bundle) after something else changed the file.
    pub fn restore(
        &self,
        content: &[u8],
        current: &OnDisk,
        owner: Option<(u32, u32)>,
    ) -> Result<Applied, WriteError> {
        let sha256 = Fingerprint::of(content).to_hex();
        let replaced = matches!(
            self.writer.write(content, current, owner)?,
            Outcome::Replaced { .. }
        );
        Ok(Applied {
            replaced,
            sha256,
            added: 0,
            removed: 0,
            durable_at: Instant::now(),
        })
    }

    /// Records the state that goes with a bundle in the file: the retention memory and
    /// `managed-files.json`.
    pub fn record(&self, built: &Built, sha256: &str) {
        if self.retains {
            self.keep(Record::Retention(built.memory.clone()));
        }
        self.keep(Record::ManagedFiles(sha256.to_string()));
    }
}

/// How long a stop waits for the records still queued. Writing them takes milliseconds; a
/// state directory on a hung mount must not turn a SIGTERM into a hang.
const RECORDS_STOP_WAIT: Duration = Duration::from_secs(5);

impl Drop for Target {
    /// Lets the records thread finish what is queued, so that a clean stop loses nothing,
    /// but waits no longer than [`RECORDS_STOP_WAIT`].
    fn drop(&mut self) {
        if let Records::Background { queue, thread } = &mut self.records {
            drop(queue.take());
            if let Some(thread) = thread.take() {
                let deadline = Instant::now() + RECORDS_STOP_WAIT;
                while !thread.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                if thread.is_finished() {
                    let _ = thread.join();
                } else {
                    tracing::warn!(
                        "stopping without the last state records: writing them took over {}s (is the state directory on a hung mount?)",
                        RECORDS_STOP_WAIT.as_secs()
                    );
                }
            }
        }
    }
}

/// Where the records of a `--manage` file are kept: `<state-dir>/files/<name>-<hash>`, its
/// file name (so that an operator finds it) and the first 8 bytes of the SHA-256 of its
/// absolute path in hex (so that two files of one name never share it).
pub fn file_state_dir(state_dir: &Path, path: &Path) -> PathBuf {
    use sha2::{Digest, Sha256};
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let digest = Sha256::digest(absolute.as_os_str().as_encoded_bytes());
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".to_string());
    state_dir
        .join("files")
        .join(format!("{name}-{}", hex::encode(&digest[..8])))
}

/// Whatever certificates can be read from a file, even a damaged one.
pub fn readable_certificates(bytes: &[u8]) -> Vec<Certificate> {
    scan(bytes)
        .certificates
        .into_iter()
        .map(|(_, c)| c)
        .collect()
}

#[cfg(test)]
mod records_tests {
    use std::fs;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::testlog::Log;

    /// Waits until `failures` moves past `seen`: the records thread has taken what was
    /// sent and tried again.
    fn next_failure(failures: &AtomicUsize, seen: usize) -> usize {
        let start = Instant::now();
        while failures.load(Ordering::SeqCst) == seen {
            assert!(start.elapsed() < Duration::from_secs(10), "no retry");
            std::thread::sleep(Duration::from_millis(2));
        }
        failures.load(Ordering::SeqCst)
    }

    /// The count of `failures` once it has not moved for 200 ms: a pass over the records
    /// held back is over (each of its records fails within microseconds of the last).
    fn settled(failures: &AtomicUsize) -> usize {
        let start = Instant::now();
        loop {
            let before = failures.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(200));
            let after = failures.load(Ordering::SeqCst);
            if after == before {
                return after;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "never settles");
        }
    }

    #[test]
    fn records_held_back_by_a_broken_state_directory_are_kept_in_order_bounded_and_with_backoff() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        fs::create_dir(&state).unwrap();
        // A file where the history directory should be: every history record fails.
        let blocker = state.join("history");
        fs::write(&blocker, b"in the way").unwrap();
        let keeper = Keeper::new(
            &state,
            dir.path().join("kubelet-ca.crt"),
            Book::open(&state, &[]),
        );
        let failures = Arc::new(AtomicUsize::new(0));
        let counted = failures.clone();
        let (queue, records) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            keeper.serve(records, move |kind| {
                assert_eq!(kind, "history");
                counted.fetch_add(1, Ordering::SeqCst);
            })
        });
        let at = OffsetDateTime::now_utc();
        let mut seen = 0;
        // Twelve replaced bundles, with the state of the file in between: a newer
        // managed-files record replaces an older one, never a history entry.
        for n in 1..=12 {
            queue
                .send(Record::History(format!("bundle {n}").into_bytes(), at))
                .unwrap();
            seen = next_failure(&failures, seen);
            queue
                .send(Record::ManagedFiles(format!("sha-{n}")))
                .unwrap();
            seen = next_failure(&failures, seen);
        }
        // The last pass over what is held back may still be failing its records one by one
        // (next_failure returns at the first): what it comes to once it is over.
        let seen = settled(&failures);
        // Backing off: no retry in the next second and a half (the delay doubled past it).
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(
            failures.load(Ordering::SeqCst),
            seen,
            "retried without backoff"
        );
        // The state directory is fixed; at stop, what is held back is written.
        fs::remove_file(&blocker).unwrap();
        drop(queue);
        let stopping = Instant::now();
        while !thread.is_finished() {
            assert!(
                stopping.elapsed() < Duration::from_secs(10),
                "the records thread did not stop"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        ends(thread);
        let saved: Vec<String> = History::new(&state)
            .list()
            .unwrap()
            .iter()
            .map(|p| String::from_utf8(fs::read(p).unwrap()).unwrap())
            .collect();
        let newest: Vec<String> = (3..=12).map(|n| format!("bundle {n}")).collect();
        assert_eq!(saved, newest);
        let managed = fs::read_to_string(state.join("managed-files.json")).unwrap();
        assert!(managed.contains("sha-12"), "{managed}");
    }

    /// Waits for the records thread to end, as it must once its queue is closed and what
    /// was left in it had its last try: a thread still running after 10 s fails the test
    /// (a thread that never ends holds the agent's stop until its deadline).
    fn ends(thread: std::thread::JoinHandle<()>) {
        let start = Instant::now();
        while !thread.is_finished() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the records thread did not end once its queue was closed"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        thread.join().unwrap();
    }

    /// Runs the records thread over `state` with its log captured.
    fn serve_logged(
        state: &Path,
        failures: Arc<AtomicUsize>,
    ) -> (mpsc::Sender<Record>, std::thread::JoinHandle<()>, Log) {
        let keeper = Keeper::new(state, state.join("kubelet-ca.crt"), Book::open(state, &[]));
        let log = Log::default();
        let subscriber = log.subscriber();
        let (queue, records) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            tracing::subscriber::with_default(subscriber, || {
                keeper.serve(records, move |_| {
                    failures.fetch_add(1, Ordering::SeqCst);
                })
            })
        });
        (queue, thread, log)
    }

    const RECOVERED: &str = "the state directory is writable again";

    #[test]
    fn records_that_succeed_at_once_never_say_the_state_directory_recovered() {
        let dir = tempfile::tempdir().unwrap();
        let failures = Arc::new(AtomicUsize::new(0));
        let (queue, thread, log) = serve_logged(dir.path(), failures.clone());
        let at = OffsetDateTime::now_utc();
        for n in 1..=3 {
            queue
                .send(Record::History(format!("bundle {n}").into_bytes(), at))
                .unwrap();
            queue
                .send(Record::ManagedFiles(format!("sha-{n}")))
                .unwrap();
        }
        drop(queue);
        ends(thread);
        assert_eq!(failures.load(Ordering::SeqCst), 0);
        assert_eq!(History::new(dir.path()).list().unwrap().len(), 3);
        assert_eq!(
            log.count(RECOVERED),
            0,
            "a recovery logged with nothing failed"
        );
    }

    #[test]
    fn a_state_directory_fixed_while_records_wait_is_logged_as_recovered_once() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the history directory should be: the record fails until it goes.
        let blocker = dir.path().join("history");
        fs::write(&blocker, b"in the way").unwrap();
        let failures = Arc::new(AtomicUsize::new(0));
        let (queue, thread, log) = serve_logged(dir.path(), failures.clone());
        let at = OffsetDateTime::now_utc();
        queue
            .send(Record::History(b"bundle 1".to_vec(), at))
            .unwrap();
        next_failure(&failures, 0);
        fs::remove_file(&blocker).unwrap();
        // The retry (after the doubled delay, 2 s) finds the directory fixed.
        let start = Instant::now();
        while History::new(dir.path()).list().unwrap().is_empty() {
            assert!(start.elapsed() < Duration::from_secs(10), "never retried");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Records after the recovery are plain successes.
        queue.send(Record::ManagedFiles("sha-2".into())).unwrap();
        drop(queue);
        ends(thread);
        assert_eq!(failures.load(Ordering::SeqCst), 1);
        assert_eq!(
            log.count(RECOVERED),
            1,
            "the recovery is logged exactly once"
        );
    }

    #[test]
    fn a_clean_stop_waits_for_the_records_thread_not_for_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let target = background_target(dir.path());
        target.keep(Record::ManagedFiles("sha".into()));
        let stopping = Instant::now();
        drop(target);
        // A SIGTERM ends the agent as soon as the records are written: the deadline is
        // for a hung state directory only.
        assert!(
            stopping.elapsed() < RECORDS_STOP_WAIT,
            "the stop waited out the deadline: {:?}",
            stopping.elapsed()
        );
        assert!(state.join("managed-files.json").exists());
    }

    /// A target as `sync` makes it, over `dir/kubelet-ca.crt` and `dir/state`, with its
    /// records on their own thread (a record that fails panics the test).
    fn background_target(dir: &Path) -> Target {
        let state = dir.join("state");
        fs::create_dir(&state).unwrap();
        let bundle = dir.join("kubelet-ca.crt");
        let default_source = "configmap:openshift-config-managed/kube-apiserver-client-ca";
        let common =
            config::Common::for_tests(&bundle, &state, vec![default_source.parse().unwrap()]);
        Target::new(&common).with_background_records(|kind| {
            panic!("a {kind} record failed");
        })
    }

    #[test]
    fn a_target_dropped_at_a_clean_stop_writes_every_queued_record_first() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let target = background_target(dir.path());
        // Enough records that the thread is still writing them when the target is dropped.
        let at = OffsetDateTime::now_utc();
        for n in 1..=200 {
            target.keep(Record::History(format!("bundle {n}").into_bytes(), at));
        }
        target.keep(Record::ManagedFiles("sha-last".into()));
        drop(target);
        let saved = History::new(&state).list().unwrap();
        assert_eq!(saved.len(), crate::writer::history::KEEP);
        assert_eq!(fs::read(saved.last().unwrap()).unwrap(), b"bundle 200");
        let managed = fs::read_to_string(state.join("managed-files.json")).unwrap();
        assert!(managed.contains("sha-last"), "{managed}");
    }
}
