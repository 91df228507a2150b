//! One `--manage-kubeconfig` (SPEC 4c): the CA data of the kubeconfig's cluster follows its
//! sources, and nothing else in the file changes. A CA the sources add is written at once;
//! one they drop stays until the new CA data alone verifies what the kubeconfig's server
//! presents, which a check off the loop finds out ([`crate::kubeconfig::reach`]): a hung
//! API server never delays a pass of this or any other target.
//!
//! What a pass writes is decided by [`crate::kubeconfig::plan`], pure. The history keeps
//! the replaced CA data only, never the kubeconfig, which may hold a key or a token.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use super::file::Slot;
use super::kept::{Kept, Report, Wake};
use super::policy::{BOUNDARY_RECHECK_MAX, Backoff, WRITE_RETRY_WAIT};
use super::schedule::Schedule;
use crate::bundle::{self, Bundle, Certificate, Fingerprint, Policy};
use crate::config;
use crate::exec::Hooks;
use crate::kubeconfig::plan::{self, Asked};
use crate::kubeconfig::reach::{self, Server, Verdict};
use crate::kubeconfig::{Cluster, Document};
use crate::metrics::{FileLabels, FileReasonLabels, Metrics, known};
use crate::registry::CreatedRecord;
use crate::source::cluster::{Content, Event, SourceEvent};
use crate::state::Book;
use crate::status::{Status, TargetKind, unix_now};
use crate::targets::apply::{file_state_dir, readable_certificates};
use crate::writer::history::History;
use crate::writer::{BundleWriter, OnDisk, Outcome};

/// The check of the server in flight: what it is about, and where its verdict lands.
struct Running {
    asked: Asked,
    verdict: Arc<Mutex<Option<Verdict>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub(crate) struct Kubeconfig {
    path: PathBuf,
    /// Shown in logs, metrics and health.
    filepath: String,
    schedule: Schedule,
    slots: Vec<Slot>,
    policy: Policy,
    metrics: Arc<Metrics>,
    book: Book,
    history: History,
    hooks: Option<Hooks>,
    wake: Wake,
    /// The last check asked for, and its verdict once it came (with what it was about).
    asked: Option<Asked>,
    running: Option<Running>,
    verdict: Option<(Fingerprint, Verdict)>,
    /// The CA data this agent last wrote or found in sync: a change to it on disk, with
    /// sources unchanged, is drift to repair.
    last_written: Option<Fingerprint>,
    write_retry: Backoff,
    /// When the oldest source change not yet on disk arrived.
    pending_since: Option<Instant>,
    /// The problem last logged, so that it is logged once while it lasts.
    said: Option<String>,
    /// The SHA-256 last recorded in `managed-files.json`.
    recorded: Option<String>,
    status: Status,
}

impl Kubeconfig {
    /// The kubeconfig of `spec`, whose first source is at position `first` among the
    /// loop's sources; its counters have their series from the start.
    pub(crate) fn new(
        spec: &config::ManageSpec,
        first: usize,
        common: &config::Common,
        hooks: Option<Hooks>,
        wake: Wake,
        metrics: Arc<Metrics>,
        book: Book,
    ) -> Kubeconfig {
        let (path, sources) = (spec.path.as_path(), spec.sources.as_slice());
        let filepath = path.display().to_string();
        let cluster: &[&str] = if sources.iter().any(|s| s.is_cluster()) {
            known::CLUSTER_SYNC_ERRORS
        } else {
            &[]
        };
        metrics.init_file(
            &filepath,
            &[
                known::FILE_SYNC_ERRORS,
                known::KUBECONFIG_SYNC_ERRORS,
                cluster,
            ],
        );
        let _ = metrics.kubeconfig_removals_held.get_or_create(&FileLabels {
            filepath: filepath.clone(),
        });
        for spec in sources {
            spec.init_metrics(&metrics);
        }
        Kubeconfig {
            path: path.to_path_buf(),
            filepath: filepath.clone(),
            schedule: Schedule::new(first, sources),
            slots: sources.iter().map(Slot::new).collect(),
            policy: common.policy(),
            metrics,
            book,
            history: History::new(&file_state_dir(&common.state_dir, path)),
            hooks,
            wake,
            asked: None,
            running: None,
            verdict: None,
            last_written: None,
            write_retry: Backoff::default(),
            pending_since: None,
            said: None,
            recorded: None,
            status: Status {
                kind: TargetKind::File,
                bundle_path: filepath,
                removal_held: Some(false),
                ..Status::default()
            },
        }
    }

    /// Reads a `file:` or `dir:` source now; a read that failed is retried with backoff.
    fn read_local(&mut self, index: usize, at: Instant) {
        let event = self.slots[index].read(&mut self.schedule, index, at);
        self.observe(index, event, at);
    }

    fn observe(&mut self, index: usize, event: SourceEvent, at: Instant) {
        if self.slots[index].source.observe(event, &self.metrics) {
            self.pending_since.get_or_insert(at);
        }
        self.schedule.due = true;
    }

    fn count(&self, reason: &str) {
        self.metrics
            .sync_errors
            .get_or_create(&FileReasonLabels {
                filepath: self.filepath.clone(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Logs `problem` once while it lasts (and counts it under `reason`), and shows it.
    fn problem(&mut self, reason: Option<&str>, problem: String) {
        if self.said.as_deref() != Some(&problem) {
            tracing::warn!(kubeconfig = %self.filepath, "{problem}");
            if let Some(reason) = reason {
                self.count(reason);
            }
            self.said = Some(problem.clone());
        }
        self.status.in_sync = Some(false);
        self.status.sync_problem = Some(problem);
    }

    /// Takes in the verdict of a check that ended, if one did.
    fn take_verdict(&mut self) {
        let Some(running) = &self.running else {
            return;
        };
        let verdict = running.verdict.lock().ok().and_then(|mut v| v.take());
        if let Some(verdict) = verdict {
            let about = running.asked.about;
            self.running = None;
            if !verdict.allows_removal() {
                self.metrics
                    .kubeconfig_removals_held
                    .get_or_create(&FileLabels {
                        filepath: self.filepath.clone(),
                    })
                    .inc();
            }
            self.verdict = Some((about, verdict));
        }
    }

    /// Starts a check of `server` off the loop: does `new` alone verify what it presents,
    /// and does `old`? The loop hears of the verdict through [`Wake`].
    fn start_check(&mut self, server: Server, about: Fingerprint, new: Vec<u8>, old: Vec<u8>) {
        let verdict: Arc<Mutex<Option<Verdict>>> = Arc::default();
        let (landing, wake) = (verdict.clone(), self.wake.clone());
        let spawned = std::thread::Builder::new()
            .name("kubeconfig-check".into())
            .spawn(move || {
                let found = reach::check(&server, &new, &old);
                if let Ok(mut slot) = landing.lock() {
                    *slot = Some(found);
                }
                wake.wake();
            });
        let asked = Asked {
            about,
            at: Instant::now(),
        };
        let thread = spawned
            .map_err(|e| {
                tracing::warn!(kubeconfig = %self.filepath, "cannot start the check of its server: {e}");
            })
            .ok();
        self.asked = Some(asked.clone());
        self.running = Some(Running {
            asked,
            verdict,
            thread,
        });
    }

    /// One pass: reads the kubeconfig, builds the CA data from the sources, and writes what
    /// the plan says.
    fn pass(&mut self) {
        self.take_verdict();
        let now = OffsetDateTime::now_utc();
        self.status.sources = self.slots.iter().map(|s| s.source.status()).collect();
        let reader = BundleWriter::new(self.path.clone(), 0o600);
        let on_disk = match reader.read_current() {
            Ok(on_disk) => on_disk,
            Err(e) => {
                let reason = e.reason();
                self.problem(Some(reason), format!("cannot read it: {e}"));
                return;
            }
        };
        let OnDisk::Regular { bytes, stat } = &on_disk else {
            self.status.file_valid = false;
            self.status.sha256 = None;
            self.status.certificates.clear();
            let problem =
                "it does not exist (a kubeconfig is never created, only kept)".to_string();
            self.status.file_problem = Some(problem.clone());
            self.problem(None, problem);
            return;
        };
        self.status.sha256 = Some(Fingerprint::of(bytes).to_hex());
        let document = match Document::parse(bytes) {
            Ok(document) => document,
            Err(e) => {
                self.status.file_valid = false;
                self.status.certificates.clear();
                self.status.file_problem = Some(e.to_string());
                self.problem(
                    Some("invalid_kubeconfig"),
                    format!("it is left as it is: {e}"),
                );
                return;
            }
        };
        let cluster = document.cluster().clone();
        let current = cluster
            .ca_data
            .as_deref()
            .map(readable_certificates)
            .unwrap_or_default();
        let now_unix = now.unix_timestamp();
        self.judge(&current, &cluster.name, now_unix);

        let unread: Vec<&str> = self
            .slots
            .iter()
            .filter(|s| s.source.content.is_none())
            .map(|s| s.source.name.as_str())
            .collect();
        if !unread.is_empty() {
            self.status.in_sync = None;
            self.status.sync_problem = Some(format!(
                "waiting for every source to be read once: {}",
                unread.join(", ")
            ));
            return;
        }
        let sources: Vec<_> = self
            .slots
            .iter()
            .filter_map(|s| s.source.content.clone())
            .collect();
        let built = match bundle::build(&sources, &[], self.policy, now_unix) {
            Ok(built) => built,
            Err(e) => {
                self.problem(
                    Some(e.reason()),
                    format!("its CA data is left as it is: {e}"),
                );
                return;
            }
        };
        let desired = built.bundle.certificates();
        let about = Fingerprint::of(&built.bundle.render());
        let allowed = matches!(&self.verdict, Some((a, v)) if *a == about && v.allows_removal());
        let plan = plan::plan(&current, desired, allowed);
        let server = Server::of(&cluster);
        self.status.removal_held = Some(!plan.held.is_empty());
        self.status.held_back = plan.held.iter().map(|c| c.fingerprint().to_hex()).collect();
        if !plan.held.is_empty() {
            let due = plan::check_due(
                true,
                self.asked.as_ref(),
                self.running.is_some(),
                about,
                Instant::now(),
            );
            if let (true, Ok(server)) = (due, &server) {
                let new = built.bundle.render();
                let old = Bundle::from_certificates(current.iter().cloned()).render();
                self.start_check(server.clone(), about, new, old);
            }
            // The next check, whatever else happens meanwhile (one running calls for its
            // pass when it ends). Here no check is due, so the last began under
            // RECHECK_EVERY ago.
            if self.running.is_none()
                && server.is_ok()
                && let Some(asked) = &self.asked
            {
                self.schedule.retry_by(asked.at + plan::RECHECK_EVERY);
            }
        }
        // Something else changed the CA data this agent left, and no source change explains
        // the write: a repair.
        let repair = self.pending_since.is_none()
            && self
                .last_written
                .is_some_and(|left| left != about_written(&current));
        if !plan.unchanged(&current) && !self.write(&document, &cluster, &plan, repair, bytes, stat)
        {
            return;
        }
        self.last_written = Some(about_written(&plan.ca));
        self.record();
        if plan.held.is_empty() {
            if self.said.take().is_some() {
                tracing::info!(kubeconfig = %self.filepath, "in sync with its sources");
            }
            self.status.in_sync = Some(true);
            self.status.sync_problem = None;
            self.status.last_sync = Some(unix_now());
            self.pending_since = None;
        } else {
            let why = self.held_why(&server, about);
            self.problem(None, why);
        }
        // What the file holds now, written or already so.
        self.judge(&plan.ca, &cluster.name, now_unix);
    }

    /// The status of the CA data the file holds: its certificates, and whether one is
    /// valid now.
    fn judge(&mut self, ca: &[Certificate], cluster: &str, now_unix: i64) {
        self.status.file_valid = ca.iter().any(|c| c.is_valid_at(now_unix));
        self.status.file_problem = (!self.status.file_valid).then(|| {
            format!("the CA data of its cluster {cluster} holds no certificate valid now")
        });
        self.status.certificates = ca.to_vec();
    }

    /// Records the file's SHA-256 in `managed-files.json` when it changed.
    fn record(&mut self) {
        if self.status.sha256.is_none() || self.status.sha256 == self.recorded {
            return;
        }
        let sha256 = self.status.sha256.clone().unwrap_or_default();
        match self.book.record(&self.path, &sha256) {
            Ok(()) => self.recorded = Some(sha256),
            Err(e) => {
                tracing::warn!(kubeconfig = %self.filepath, "cannot record it in managed-files.json: {e}");
                self.metrics
                    .state_errors
                    .get_or_create(&crate::metrics::RecordLabels {
                        record: "managed_files".to_string(),
                    })
                    .inc();
            }
        }
    }

    /// Waits for the check of the server in flight, if one is (`sync`, which has no loop to
    /// wake); true when one was, and a pass then takes its verdict in.
    pub(crate) fn wait_for_check(&mut self) -> bool {
        match self.running.as_mut().and_then(|r| r.thread.take()) {
            Some(thread) => {
                let _ = thread.join();
                true
            }
            None => false,
        }
    }

    /// Why the dropped CAs are still there.
    fn held_why(&self, server: &Result<Server, String>, about: Fingerprint) -> String {
        let server = match server {
            Ok(server) => server,
            Err(why) => return format!("removal held: cannot check the server: {why}"),
        };
        match &self.verdict {
            Some((a, Verdict::Unreachable(why))) if *a == about => {
                format!("removal held: cannot verify {}: {why}", server.shown)
            }
            Some((a, _)) if *a == about => format!(
                "removal held: the new CA data does not verify {}",
                server.shown
            ),
            _ => format!(
                "removal held: checking that the new CA data alone verifies {}",
                server.shown
            ),
        }
    }

    /// Writes the plan's CA data into the kubeconfig, keeping its mode, owner and label;
    /// true when the file now holds it.
    fn write(
        &mut self,
        document: &Document,
        cluster: &Cluster,
        plan: &plan::Plan,
        repair: bool,
        bytes: &[u8],
        stat: &crate::fsutil::Stat,
    ) -> bool {
        if let Some(until) = self.write_retry.blocked(Instant::now()) {
            self.schedule.retry_at = Some(until);
            return false;
        }
        let pem = Bundle::from_certificates(plan.ca.iter().cloned()).render();
        let edited = match document.with_ca_data(&pem) {
            Ok(edited) => edited,
            Err(e) => {
                self.problem(
                    Some("invalid_kubeconfig"),
                    format!("it is left as it is: {e}"),
                );
                return false;
            }
        };
        let writer = BundleWriter::new(self.path.clone(), stat.mode & 0o7777);
        let on_disk = OnDisk::Regular {
            bytes: bytes.to_vec(),
            stat: *stat,
        };
        match writer.write(&edited, &on_disk, None) {
            Ok(Outcome::Replaced { .. }) => {
                self.write_retry.clear();
                if let Some(old) = &cluster.ca_data
                    && let Err(e) = self.history.record(old, OffsetDateTime::now_utc())
                {
                    tracing::warn!(kubeconfig = %self.filepath, "cannot keep the replaced CA data in the history: {e}");
                }
                let labels = FileLabels {
                    filepath: self.filepath.clone(),
                };
                self.metrics.writes.get_or_create(&labels).inc();
                if repair {
                    self.metrics.repairs.get_or_create(&labels).inc();
                    tracing::warn!(kubeconfig = %self.filepath, "repaired the CA data of its cluster: something else had changed it");
                }
                if let Some(since) = self.pending_since {
                    self.metrics
                        .sync_duration
                        .observe(since.elapsed().as_secs_f64());
                }
                self.status.sha256 = Some(Fingerprint::of(&edited).to_hex());
                tracing::info!(
                    kubeconfig = %self.filepath,
                    cluster = %cluster.name,
                    added = plan.added.len(),
                    removed = plan.removed,
                    kept = plan.held.len(),
                    certificates = plan.ca.len(),
                    "replaced the CA data of its cluster"
                );
                if !plan.added.is_empty()
                    && let Some(hooks) = &self.hooks
                {
                    hooks.changed_with(
                        plan.added
                            .iter()
                            .map(|c| c.fingerprint().to_hex())
                            .collect(),
                    );
                }
                true
            }
            Ok(Outcome::Unchanged) => true,
            Err(e) => {
                let now = Instant::now();
                self.write_retry.step_write(now);
                self.schedule.retry_at = self.write_retry.blocked(now);
                self.problem(
                    Some(e.reason()),
                    format!("cannot write it: {e}; {WRITE_RETRY_WAIT}"),
                );
                false
            }
        }
    }
}

/// What identifies CA data as written: its certificates in order.
fn about_written(ca: &[Certificate]) -> Fingerprint {
    Fingerprint::of(&Bundle::from_certificates(ca.iter().cloned()).render())
}

impl Kept for Kubeconfig {
    fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    fn schedule_mut(&mut self) -> &mut Schedule {
        &mut self.schedule
    }

    fn start(&mut self, created: &mut CreatedRecord) {
        if let Some(dir) = self.history.dir().parent()
            && let Err(e) = crate::state::StateDir::new(dir.to_path_buf()).ensure()
        {
            tracing::warn!(kubeconfig = %self.filepath, "cannot create its state directory {}: {e}", dir.display());
        }
        if let Err(e) = crate::writer::atomic::remove_stale_temp_files(
            &crate::writer::atomic::parent_dir(&self.path),
        ) {
            tracing::warn!(kubeconfig = %self.filepath, "cannot remove stale temporary files: {e}");
        }
        let now = Instant::now();
        for index in 0..self.slots.len() {
            if !self.slots[index].source.spec.is_cluster() {
                self.read_local(index, now);
            }
        }
        self.reconcile(created);
    }

    fn on_update(&mut self, local: usize, event: Event<Content>, at: Instant) {
        if let Some(event) = event.filter_map(Content::certificates) {
            self.observe(local, event, at);
        }
    }

    fn take_due(&mut self, now: Instant) -> bool {
        let (reads, work) = self.schedule.take_due(now);
        for local in reads {
            self.read_local(local, now);
        }
        work
    }

    fn reconcile(&mut self, _created: &mut CreatedRecord) {
        self.schedule.due = false;
        self.pass();
    }

    fn next_boundary(&self) -> Duration {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        self.status
            .certificates
            .iter()
            .flat_map(|c| [c.not_before, c.not_after])
            .filter(|&t| t > now)
            .min()
            .map_or(BOUNDARY_RECHECK_MAX, |t| {
                Duration::from_secs((t - now) as u64).min(BOUNDARY_RECHECK_MAX)
            })
    }

    fn report(&self, report: &mut Report) {
        let mut status = self.status.clone();
        status.restart = self.hooks.as_ref().and_then(Hooks::restart);
        status.restart_note = self.hooks.as_ref().and_then(Hooks::restart_note);
        report.files.push(status);
    }

    #[cfg(test)]
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;
    use std::fs;

    /// A kubeconfig in a temporary directory, kept from file sources, whose server nobody
    /// listens on (each check ends at once, unreachable).
    struct Node {
        dir: tempfile::TempDir,
        port: u16,
        metrics: Arc<Metrics>,
    }

    impl Node {
        fn new() -> Node {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            Node {
                dir: tempfile::tempdir().unwrap(),
                port,
                metrics: Arc::default(),
            }
        }

        fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }

        /// Writes the kubeconfig, its cluster's CA data being `certs`.
        fn kubeconfig(&self, certs: &[&Certificate]) {
            use base64::Engine;
            let pem: Vec<u8> = certs.iter().flat_map(|c| c.pem().to_vec()).collect();
            let data = base64::engine::general_purpose::STANDARD.encode(pem);
            let text = format!(
                "clusters:\n- name: local\n  cluster:\n    server: https://127.0.0.1:{}\n    certificate-authority-data: {data}\n",
                self.port
            );
            fs::write(self.path("kubeconfig"), text).unwrap();
        }

        /// The target of the kubeconfig, from the source file `source`.
        fn target(&self, source: &str, wake: Wake) -> Kubeconfig {
            let spec = config::ManageSpec {
                path: self.path("kubeconfig"),
                sources: vec![
                    format!("file:{}", self.path(source).display())
                        .parse()
                        .unwrap(),
                ],
            };
            let state = self.path("state");
            let common = config::Common::for_tests(&self.path("bundle"), &state, vec![]);
            let book = Book::open(&state, &[]);
            Kubeconfig::new(&spec, 0, &common, None, wake, self.metrics.clone(), book)
        }

        /// Writes and repairs counted.
        fn counted(&self) -> (u64, u64) {
            let labels = FileLabels {
                filepath: self.path("kubeconfig").display().to_string(),
            };
            (
                self.metrics.writes.get_or_create(&labels).get(),
                self.metrics.repairs.get_or_create(&labels).get(),
            )
        }

        fn on_disk(&self) -> Vec<String> {
            let bytes = fs::read(self.path("kubeconfig")).unwrap();
            let ca = Document::parse(&bytes).unwrap().cluster().ca_data.clone();
            readable_certificates(&ca.unwrap_or_default())
                .iter()
                .map(|c| c.subject_cn.clone())
                .collect()
        }
    }

    fn ca(name: &str, from: i64, to: i64) -> Certificate {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        test_certs::ca(Some(name), None, now + from, now + to)
    }

    #[test]
    fn a_held_removal_is_checked_again_ten_seconds_after_the_last_check_and_the_problem_is_named() {
        let node = Node::new();
        let old = ca("apiserver-ca-old", -7200, -3600);
        let new = ca("apiserver-ca-new", -60, 86400);
        node.kubeconfig(&[&old]);
        fs::write(node.path("new.pem"), new.pem()).unwrap();
        let (wakes, mut woken) = tokio::sync::mpsc::unbounded_channel();
        let mut target = node.target("new.pem", Wake::new(0, wakes));
        let mut created = CreatedRecord::default();
        target.start(&mut created);
        // The new CA is written at once, the expired old one held until a check says so.
        assert_eq!(node.on_disk(), ["apiserver-ca-new", "apiserver-ca-old"]);
        assert_eq!(target.status.removal_held, Some(true));
        assert_eq!(
            target.status.file_problem, None,
            "the new CA data is valid now"
        );
        assert!(target.running.is_some(), "a check was started");
        // The check asks for a pass when it ends (a refused connection: at once).
        let asked_at = std::time::Instant::now();
        let woken = loop {
            match woken.try_recv() {
                Ok(index) => break Some(index),
                Err(_) if asked_at.elapsed() < Duration::from_secs(10) => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(_) => break None,
            }
        };
        assert_eq!(woken, Some(0), "the check asks for a pass when it ends");
        // A pass that changes nothing writes nothing: not the kubeconfig, not the record.
        let inode = |name: &str| {
            use std::os::unix::fs::MetadataExt;
            fs::metadata(node.path(name)).unwrap().ino()
        };
        let before = (inode("kubeconfig"), inode("state/managed-files.json"));
        target.reconcile(&mut created);
        assert_eq!(
            (inode("kubeconfig"), inode("state/managed-files.json")),
            before
        );
        assert!(target.running.is_none());
        let asked = target.asked.clone().unwrap();
        assert!(matches!(target.verdict, Some((_, Verdict::Unreachable(_)))));
        // The next check is ten seconds after the last began, not sooner: no pass before.
        assert_eq!(
            target.schedule().next_due(),
            Some(asked.at + plan::RECHECK_EVERY)
        );
        let server = format!("https://127.0.0.1:{}", node.port);
        let problem = || target.status.sync_problem.clone().unwrap_or_default();
        assert!(
            problem().starts_with(&format!(
                "removal held: cannot verify {server}: cannot connect"
            )),
            "{}",
            problem()
        );
        // The sources change again: the verdict about the CA data before is not this one's.
        let newer = ca("apiserver-ca-newer", -60, 86400);
        fs::write(node.path("new.pem"), newer.pem()).unwrap();
        target.read_local(0, Instant::now());
        target.reconcile(&mut created);
        assert_eq!(
            target.status.sync_problem.as_deref(),
            Some(&*format!(
                "removal held: checking that the new CA data alone verifies {server}"
            ))
        );

        // CA data that holds only an expired certificate is named as the problem.
        node.kubeconfig(&[&old]);
        let mut target = node.target("absent.pem", Wake::none());
        target.start(&mut created);
        assert!(!target.status.file_valid);
        assert_eq!(
            target.status.file_problem.as_deref(),
            Some("the CA data of its cluster local holds no certificate valid now")
        );
    }

    #[test]
    fn a_change_made_by_something_else_is_a_repair_and_one_a_source_explains_is_not() {
        let node = Node::new();
        let (new, stray, newer) = (
            ca("apiserver-ca-new", -60, 86400),
            ca("stray-ca", -60, 86400),
            ca("apiserver-ca-newer", -60, 86400),
        );
        node.kubeconfig(&[&new]);
        fs::write(node.path("source.pem"), new.pem()).unwrap();
        let mut target = node.target("source.pem", Wake::none());
        let mut created = CreatedRecord::default();
        target.start(&mut created);
        assert_eq!(node.counted(), (0, 0), "in sync from the start");
        // Something else puts another CA in its place: the agent's CA is written back (the
        // stray one stays until a check allows its removal), a repair.
        node.kubeconfig(&[&stray]);
        target.reconcile(&mut created);
        assert_eq!(node.on_disk(), ["apiserver-ca-new", "stray-ca"]);
        assert_eq!(node.counted(), (1, 1));
        // The file changed by something else while a source changes: the source's change
        // explains the write, so no repair is counted.
        node.kubeconfig(&[&stray]);
        fs::write(node.path("source.pem"), newer.pem()).unwrap();
        target.read_local(0, Instant::now());
        target.reconcile(&mut created);
        assert_eq!(node.on_disk(), ["apiserver-ca-newer", "stray-ca"]);
        assert_eq!(node.counted(), (2, 1));
    }

    #[test]
    fn the_next_boundary_is_the_next_validity_change_of_the_ca_data_capped_at_an_hour() {
        let node = Node::new();
        let mut target = node.target("source.pem", Wake::none());
        assert_eq!(target.next_boundary(), BOUNDARY_RECHECK_MAX, "nothing kept");
        // One ends now, one in 100 s, one begins in 50 s and ends in two hours.
        target.status.certificates = vec![
            ca("ends-now", -60, 0),
            ca("ends-soon", -60, 100),
            ca("begins-soon", 50, 7200),
        ];
        let next = target.next_boundary();
        assert!(
            (Duration::from_secs(48)..=Duration::from_secs(50)).contains(&next),
            "{next:?}"
        );
        target.status.certificates = vec![ca("expired", -7200, -60), ca("long", -60, 7200)];
        assert_eq!(
            target.next_boundary(),
            BOUNDARY_RECHECK_MAX,
            "past, or beyond the cap"
        );
    }
}
