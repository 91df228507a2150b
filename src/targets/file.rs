//! One managed file: its sources, the bundle built from them, and all the loop knows of the
//! file (what it adopted at start, what it last wrote, its backoffs). The daemon's loop
//! owns one for `--bundle` and one for each `--manage` file, and routes each input to the
//! file it concerns: a bad source of one file never holds another.
//!
//! What a pass does to the file is decided by [`decide`], the pure policy beside it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use super::kept::{Kept, Report};
use super::policy::{
    Action, BOUNDARY_RECHECK_MAX, BUNDLE_SETTLE, Backoff, Facts, Seen, WRITE_RETRY_WAIT, decide,
};
use super::schedule::Schedule;
use crate::bundle::{self, Built, Fingerprint, Policy, Remembered, SourceCertificates};
use crate::exec::Hooks;
use crate::fsutil::Stat;
use crate::metrics::{FileLabels, FileReasonLabels, Metrics, known};
use crate::registry::CreatedRecord;
use crate::source::SourceSpec;
use crate::source::cluster::{Content, Event, SourceEvent};
use crate::source::local;
use crate::source::state::SourceState;
use crate::status::{Status, TargetKind, unix_now};
use crate::targets::apply::Target;
use crate::writer::{OnDisk, WriteError};

/// A bundle and its retention memory, as last handed to the records.
type RecordedState = (Fingerprint, Vec<(Fingerprint, Option<i64>)>);

/// What the loop knows about one source of a file (the bundle, a `--manage` file, a
/// kubeconfig's CA data).
pub(crate) struct Slot {
    pub(crate) source: SourceState,
    /// For a local source: reads it, and parses only bytes it has not parsed already.
    loader: local::Loader,
}

impl Slot {
    pub(crate) fn new(spec: &SourceSpec) -> Slot {
        Slot {
            source: SourceState::new(spec),
            loader: local::Loader::default(),
        }
    }

    /// Reads this `file:` or `dir:` source (the `index`th of its target) now; a read that
    /// failed is retried with backoff, on `schedule`.
    pub(crate) fn read(
        &mut self,
        schedule: &mut Schedule,
        index: usize,
        at: Instant,
    ) -> SourceEvent {
        let result = self.loader.load(&self.source.spec);
        let retry = matches!(&result, Err(error) if local::retryable(error));
        schedule.was_read(index, at, retry);
        match result {
            Ok(content) => SourceEvent::Content(content),
            Err(error) => SourceEvent::Failed(error),
        }
    }
}

/// The bundle built from the sources, ready to compare with the file.
struct Desired {
    built: Built,
    rendered: Arc<[u8]>,
}

/// The valid bundle found on disk at start, parsed once: its certificates decide whether it
/// may still be restored and when its validity changes, on every pass and every turn of
/// the loop while no source has been read.
struct Adopted {
    bytes: Arc<[u8]>,
    certificates: Vec<bundle::Certificate>,
}

impl Adopted {
    fn valid_at(&self, now: i64) -> bool {
        self.certificates.iter().any(|c| c.is_valid_at(now))
    }
}

pub(crate) struct Managed {
    target: Target,
    /// When its sources are read, and when it calls for a pass.
    pub(crate) schedule: Schedule,
    pub(crate) slots: Vec<Slot>,
    policy: Policy,
    hooks: Option<Hooks>,
    memory: Vec<Remembered>,
    desired: Option<Desired>,
    /// SHA-256 of the bundle this agent last wrote or found in place and in sync.
    last_written: Option<Fingerprint>,
    /// The valid bundle found on disk at start: it stands, and drift from it is repaired,
    /// until every source has been read once.
    adopted: Option<Adopted>,
    /// Running as root: the file's owner is kept, and put back when something changes it.
    is_root: bool,
    /// The owner the file should have: the adopted file's, or the one last written.
    owner: Option<(u32, u32)>,
    /// The bundle whose last write failed: only its retries wait for the backoff.
    write_failed: Option<Fingerprint>,
    /// Why that write failed, for health while the retry waits.
    write_error: Option<String>,
    /// What was last handed to the records (bundle, retention memory), so that an
    /// unchanged state is not recorded again.
    recorded: Option<RecordedState>,
    /// When the oldest source change not yet on disk arrived.
    pending_since: Option<Instant>,
    repair: Backoff,
    write_retry: Backoff,
    /// A `--manage` file: when its sources hold no certificate it is not created (the
    /// bundle, which the kubelet needs, always is).
    optional: bool,
    /// The last build failure, so that it is logged and counted once.
    build_problem: Option<String>,
    metrics: Arc<Metrics>,
    file: FileLabels,
    last_sync: Option<f64>,
    /// What the last pass found.
    pub(crate) status: Status,
}

impl Managed {
    /// The file kept by `target` from `sources`, whose first is at position `first` among
    /// the loop's sources: the bundle (`--bundle`), or a `--manage` file. Its counters have
    /// their series from the start.
    pub(crate) fn new(
        bundle: bool,
        target: Target,
        sources: &[SourceSpec],
        first: usize,
        policy: Policy,
        hooks: Option<Hooks>,
        metrics: Arc<Metrics>,
    ) -> Managed {
        let filepath = target.path().display().to_string();
        let cluster: &[&str] = if sources.iter().any(|s| s.is_cluster()) {
            known::CLUSTER_SYNC_ERRORS
        } else {
            &[]
        };
        metrics.init_file(&filepath, &[known::FILE_SYNC_ERRORS, cluster]);
        for spec in sources {
            spec.init_metrics(&metrics);
        }
        Managed {
            target,
            schedule: Schedule::new(first, sources),
            slots: sources.iter().map(Slot::new).collect(),
            policy,
            hooks,
            memory: Vec::new(),
            desired: None,
            last_written: None,
            adopted: None,
            is_root: nix::unistd::geteuid().is_root(),
            owner: None,
            write_failed: None,
            write_error: None,
            recorded: None,
            pending_since: None,
            repair: Backoff::default(),
            write_retry: Backoff::default(),
            optional: !bundle,
            build_problem: None,
            metrics,
            file: FileLabels { filepath },
            last_sync: None,
            status: Status::default(),
        }
    }

    /// Reads a `file:` or `dir:` source (by its position among this file's sources) now; a
    /// read that failed is retried with backoff.
    pub(crate) fn read_local(&mut self, index: usize, at: Instant) {
        let event = self.slots[index].read(&mut self.schedule, index, at);
        self.observe(index, event, at);
    }

    /// A source's news (by its position among this file's sources).
    pub(crate) fn observe(&mut self, index: usize, event: SourceEvent, at: Instant) {
        // Without usable credentials no cluster source can be read: a sync that cannot
        // happen, counted as such (once per change of the problem, as the source sends it).
        if let SourceEvent::Failed(e) | SourceEvent::WatchRestart(e) = &event
            && e.reason() == "credentials"
        {
            self.count_sync_error("credentials");
        }
        let slot = &mut self.slots[index];
        if slot.source.observe(event, &self.metrics) {
            self.pending_since.get_or_insert(at);
        }
        self.schedule.due = true;
    }

    /// backoff says wait. Then publishes the state.
    fn pass(&mut self) {
        let now = OffsetDateTime::now_utc();
        let at = Instant::now();
        let on_disk = match self.target.writer().read_current() {
            Ok(on_disk) => on_disk,
            Err(e) => {
                // The file cannot be seen: nothing can be compared, written over or
                // claimed. Look again with backoff.
                let problem = e.to_string();
                if self.write_retry.blocked(at).is_none() {
                    tracing::error!(reason = e.reason(), "{problem}");
                    self.count_sync_error(e.reason());
                }
                self.write_retry.step_write(at);
                self.schedule.retry_at = self.write_retry.until;
                self.publish(
                    Seen::Unreadable(problem.clone()),
                    Some(false),
                    Some(problem),
                );
                return;
            }
        };
        let all_read = self.slots.iter().all(|s| s.source.content.is_some());
        if self.optional && all_read && self.sources_hold_nothing() {
            // Nothing to keep (a cloud CA on a platform without one): the file is neither
            // created nor emptied. One that exists (an admin's, or one this agent wrote
            // before its sources emptied) stays as it is.
            self.desired = None;
            self.nothing_to_keep(&on_disk);
            return;
        }
        let goal: Arc<[u8]> = if all_read {
            match self.build(now) {
                Some(desired) => desired.rendered.clone(),
                None => {
                    let problem = self.build_problem.clone();
                    self.publish((&on_disk).into(), Some(false), problem);
                    return;
                }
            }
        } else {
            // Building from some sources only would drop the others' signers. Until each
            // source has been read once, the adopted bundle stands, and is what a repair
            // restores, while it still holds a certificate valid now.
            self.desired = None;
            match &self.adopted {
                Some(adopted) if adopted.valid_at(now.unix_timestamp()) => adopted.bytes.clone(),
                _ => {
                    self.publish((&on_disk).into(), None, None);
                    return;
                }
            }
        };
        let sha256 = Fingerprint::of(&goal);
        let owner = self.is_root.then(|| {
            self.owner
                .unwrap_or_else(|| on_disk.stat().map_or((0, 0), |s| (s.uid, s.gid)))
        });
        let facts = Facts {
            goal: &goal,
            on_disk: &on_disk,
            mode: self.target.writer().mode(),
            owner,
            last_written: self.last_written,
            write_failed: self.write_failed,
        };
        match decide(&facts, &self.repair, &self.write_retry, at) {
            Action::InSync => {
                self.in_sync(sha256);
                self.publish((&on_disk).into(), self.in_sync_state(), None);
            }
            Action::Wait { until, problem } => {
                self.schedule.retry_at = Some(until);
                // While a failed write waits for its retry, health keeps saying why it failed.
                let problem = match &self.write_error {
                    Some(error)
                        if self.write_failed == Some(sha256) && problem == WRITE_RETRY_WAIT =>
                    {
                        format!("{error}; retrying with backoff")
                    }
                    _ => problem.to_string(),
                };
                self.publish((&on_disk).into(), Some(false), Some(problem));
            }
            Action::RepairAttributes => {
                let stat: Stat = *on_disk
                    .stat()
                    .expect("the content matched, so a regular file");
                match self.target.writer().repair_attributes(&stat, owner) {
                    Ok(true) => {
                        self.metrics.repairs.get_or_create(&self.file).inc();
                        self.repair.step_repair(at);
                        tracing::warn!(bundle = %self.file.filepath, mode = format!("{:o}", stat.mode), uid = stat.uid, gid = stat.gid, "repaired the bundle's mode or owner: something else had changed it");
                        self.in_sync(sha256);
                        self.publish((&on_disk).into(), self.in_sync_state(), None);
                    }
                    Ok(false) => {
                        // Replaced since it was read: the next pass looks at the new file.
                        self.schedule.recheck_at = Some(at + BUNDLE_SETTLE);
                        self.publish(
                            (&on_disk).into(),
                            Some(false),
                            Some("the file changed while its mode was being repaired".into()),
                        );
                    }
                    Err(e) => {
                        let problem = format!(
                            "cannot repair the mode or owner of {}: {e}",
                            self.file.filepath
                        );
                        tracing::error!("{problem}");
                        self.count_sync_error("attributes");
                        self.write_retry.step_write(at);
                        self.schedule.retry_at = self.write_retry.until;
                        self.publish((&on_disk).into(), Some(false), Some(problem));
                    }
                }
            }
            Action::CannotReplace => {
                let error = WriteError::Directory {
                    path: self.target.path().to_path_buf(),
                };
                // Looked at again on every change in the bundle's directory (its removal
                // is one); counted and logged as failed writes are, with their backoff, so
                // that a directory that stays is a sync error that keeps happening.
                if self.write_retry.blocked(at).is_none() {
                    tracing::error!(reason = error.reason(), "{error}");
                    self.count_sync_error(error.reason());
                    self.write_retry.step_write(at);
                    self.schedule.retry_at = self.write_retry.until;
                }
                self.publish((&on_disk).into(), Some(false), Some(error.to_string()));
            }
            Action::Write { repair } => self.write(goal, on_disk, owner, repair, now, at),
        }
    }

    /// Replaces the file with `goal` and records the outcome.
    fn write(
        &mut self,
        goal: Arc<[u8]>,
        on_disk: OnDisk,
        owner: Option<(u32, u32)>,
        repair: bool,
        now: OffsetDateTime,
        at: Instant,
    ) {
        let sha256 = Fingerprint::of(&goal);
        if let OnDisk::Other(kind) = &on_disk {
            tracing::warn!(bundle = %self.file.filepath, "the bundle path is {kind}, not a regular file; replacing it with one (never following a link)");
        }
        // A `--manage` file's directory is made when there is something to keep in it, as
        // the node configuration would (0755, as a directory under /etc is).
        if self.optional && on_disk == OnDisk::Missing {
            let dir = crate::writer::atomic::parent_dir(self.target.path());
            if !dir.exists() {
                use std::os::unix::fs::DirBuilderExt;
                match std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(&dir)
                {
                    Ok(()) => {
                        tracing::info!(dir = %dir.display(), "created the managed file's directory")
                    }
                    Err(e) => {
                        tracing::warn!(dir = %dir.display(), "cannot create the managed file's directory: {e}")
                    }
                }
            }
        }
        // With a bundle built from the sources, it is the goal; without one (a source not
        // read yet), the goal is the adopted bundle, restored.
        let written = match &self.desired {
            Some(desired) => self.target.apply(
                &desired.built,
                &desired.rendered,
                &on_disk,
                owner,
                now,
                !repair,
            ),
            _ => self.target.restore(&goal, &on_disk, owner),
        };
        match written {
            Ok(applied) => {
                if applied.replaced {
                    self.metrics.writes.get_or_create(&self.file).inc();
                    if repair {
                        self.metrics.repairs.get_or_create(&self.file).inc();
                        self.repair.step_repair(at);
                        tracing::warn!(bundle = %self.file.filepath, "repaired the bundle: something else had changed or removed it");
                    } else if let Some(since) = self.pending_since {
                        let took = applied.durable_at.saturating_duration_since(since);
                        self.metrics.sync_duration.observe(took.as_secs_f64());
                    }
                    if let Some(hooks) = &self.hooks {
                        hooks.changed();
                    }
                }
                self.owner = owner;
                self.write_failed = None;
                self.write_error = None;
                self.write_retry.clear();
                self.in_sync(sha256);
                self.publish(Seen::Regular(&goal), self.in_sync_state(), None);
            }
            Err(e) => {
                self.count_sync_error(e.reason());
                if self.write_failed != Some(sha256) {
                    self.write_retry.clear();
                }
                self.write_failed = Some(sha256);
                self.write_error = Some(e.to_string());
                self.write_retry.step_write(at);
                self.schedule.retry_at = self.write_retry.until;
                tracing::error!(reason = e.reason(), "{e}");
                self.publish((&on_disk).into(), Some(false), Some(e.to_string()));
            }
        }
    }

    /// Builds the bundle from every source's last good content, or records why it cannot
    /// be built (logged and counted once per distinct problem).
    fn build(&mut self, now: OffsetDateTime) -> Option<&Desired> {
        let sources: Vec<SourceCertificates> = self
            .slots
            .iter()
            .filter_map(|s| s.source.content.clone())
            .collect();
        match bundle::build(&sources, &self.memory, self.policy, now.unix_timestamp()) {
            Ok(built) => {
                self.build_problem = None;
                let rendered = built.bundle.render().into();
                self.desired = Some(Desired { built, rendered });
                self.desired.as_ref()
            }
            Err(e) => {
                let problem = e.to_string();
                if self.build_problem.as_ref() != Some(&problem) {
                    tracing::error!(reason = e.reason(), "{problem}; the file stays as it is");
                    self.count_sync_error(e.reason());
                    self.build_problem = Some(problem);
                }
                self.desired = None;
                None
            }
        }
    }

    /// In sync with the sources (`Some(true)`), or holding the adopted bundle while a
    /// source has not been read yet (`None`: nothing to compare with).
    pub(crate) fn in_sync_state(&self) -> Option<bool> {
        self.desired.is_some().then_some(true)
    }

    fn in_sync(&mut self, sha256: Fingerprint) {
        self.last_written = Some(sha256);
        self.pending_since = None;
        // In sync with the sources only once every source has been read: holding the
        // adopted bundle meanwhile is not a sync.
        if let Some(desired) = &self.desired {
            self.last_sync = Some(unix_now());
            self.memory = desired.built.memory.clone();
            // Records follow the state they describe, whether or not a write was needed.
            let key = (
                sha256,
                self.memory
                    .iter()
                    .map(|r| (r.certificate.fingerprint(), r.missing_since))
                    .collect(),
            );
            if self.recorded.as_ref() != Some(&key) {
                self.target.record(&desired.built, &sha256.to_hex());
                self.recorded = Some(key);
            }
        }
    }

    pub(crate) fn count_sync_error(&self, reason: &str) {
        let labels = FileReasonLabels {
            filepath: self.file.filepath.clone(),
            reason: reason.to_string(),
        };
        self.metrics.sync_errors.get_or_create(&labels).inc();
    }

    /// Why the file can be said neither in sync nor out of sync: a source has not been
    /// read yet, so there is no bundle to compare it with.
    fn sync_unknown(&self, now: i64) -> String {
        let unread: Vec<&str> = self
            .slots
            .iter()
            .filter(|s| s.source.content.is_none())
            .map(|s| s.source.name.as_str())
            .collect();
        let mut why = if unread.len() == self.slots.len() {
            format!(
                "not known yet: no source has been read ({})",
                unread.join(", ")
            )
        } else {
            format!(
                "not known yet: {} of {} sources not read yet ({}); a bundle built from the others alone would drop its signers",
                unread.len(),
                self.slots.len(),
                unread.join(", ")
            )
        };
        if self.adopted.as_ref().is_some_and(|a| a.valid_at(now)) {
            why.push_str("; the bundle found at start stands meanwhile");
        }
        why
    }

    /// Every source was read and holds no certificate at all.
    fn sources_hold_nothing(&self) -> bool {
        self.slots.iter().all(|s| {
            s.source
                .content
                .as_ref()
                .is_some_and(|c| c.certificates.is_empty() && c.not_ca.is_empty())
        })
    }

    /// The state of a `--manage` file whose sources hold no certificate.
    fn nothing_to_keep(&mut self, on_disk: &OnDisk) {
        let why = "its sources hold no certificate: the file is neither created nor emptied";
        // A file with no certificate in it (the lone newline the upstream writer leaves for
        // an empty cloud CA) holds what the sources hold: nothing. It is left as it is.
        let holds_nothing = match on_disk {
            OnDisk::Missing => true,
            OnDisk::Regular { bytes, .. } => bundle::parse::scan(bytes).certificates.is_empty(),
            OnDisk::Other(_) => false,
        };
        if holds_nothing {
            self.pending_since = None;
            let problem = match on_disk {
                OnDisk::Missing => format!("not created: {why}"),
                _ => format!("holds no certificate either: {why}; it is left as it is"),
            };
            self.publish(on_disk.into(), Some(true), None);
            self.status.nothing_to_keep = true;
            self.status.file_problem = Some(problem);
        } else {
            let problem = format!(
                "not known: {why}; the file there still holds certificates and is left as it is (remove it if they are no longer wanted)"
            );
            self.publish(on_disk.into(), None, Some(problem));
        }
    }

    /// Keeps the state of the file for the loop to publish (health, metrics, systemd).
    fn publish(&mut self, seen: Seen, in_sync: Option<bool>, sync_problem: Option<String>) {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let sync_problem = match in_sync {
            None => sync_problem.or_else(|| Some(self.sync_unknown(now))),
            Some(_) => sync_problem,
        };
        let path = &self.file.filepath;
        let (certificates, file_valid, file_problem, bytes) = match seen {
            Seen::Missing => (
                Vec::new(),
                false,
                Some(format!("{path} does not exist")),
                None,
            ),
            Seen::Other(kind) => (
                Vec::new(),
                false,
                Some(format!("{path} is {kind}, not a regular file")),
                None,
            ),
            Seen::Unreadable(problem) => (Vec::new(), false, Some(problem), None),
            Seen::Regular(bytes) => {
                // When the file holds the bundle just built, its certificates are known.
                let built = self.desired.as_ref().filter(|d| &d.rendered[..] == bytes);
                let parsed = match built {
                    Some(d) => Ok(d.built.bundle.certificates().to_vec()),
                    None => bundle::parse_source(bytes).map(|p| p.certificates),
                };
                match parsed {
                    Ok(certificates) => {
                        let valid = certificates.iter().any(|c| c.is_valid_at(now));
                        let problem =
                            (!valid).then(|| "no certificate in the file is valid now".to_string());
                        (certificates, valid, problem, Some(bytes))
                    }
                    Err(rejection) => (
                        Vec::new(),
                        false,
                        Some(format!("the file is not a valid bundle: {rejection}")),
                        Some(bytes),
                    ),
                }
            }
        };
        let file_warning = file_valid
            .then(|| bundle::expired_warning(&certificates, now))
            .flatten();
        let status = Status {
            kind: TargetKind::File,
            bundle_path: self.file.filepath.clone(),
            file_warning,
            certificates,
            sha256: bytes.map(|b| Fingerprint::of(b).to_hex()),
            file_valid,
            file_problem,
            in_sync,
            sync_problem,
            sources: self.slots.iter().map(|s| s.source.status()).collect(),
            last_sync: self.last_sync,
            // The loop's to say: the watcher's health, and the kubelet's view of the bundle.
            file_watch: None,
            kubelet: None,
            others: Vec::new(),
            nothing_to_keep: false,
            removal_held: None,
            held_back: Vec::new(),
            restart: None,
            restart_note: None,
            registry_set: None,
            notes: Vec::new(),
            other_sources: Vec::new(),
        };
        self.status = status;
    }
}

impl Kept for Managed {
    fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    fn schedule_mut(&mut self) -> &mut Schedule {
        &mut self.schedule
    }

    fn on_update(&mut self, local: usize, event: Event<Content>, at: Instant) {
        if let Some(event) = event.filter_map(Content::certificates) {
            self.observe(local, event, at);
        }
    }

    fn report(&self, report: &mut Report) {
        report.files.push(self.status.clone());
    }

    #[cfg(test)]
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    /// Reads the local sources that are due at `now`; true when a pass is called for.
    fn take_due(&mut self, now: Instant) -> bool {
        let (reads, work) = self.schedule.take_due(now);
        for local in reads {
            self.read_local(local, now);
        }
        work
    }

    /// Bytes of the bundle last built (0 when none), to decide whether memory is given back.
    fn built_len(&self) -> usize {
        self.desired.as_ref().map_or(0, |d| d.rendered.len())
    }

    /// Adopts the file on disk, reads its local sources, and runs the first pass. No API
    /// call happens here, so a valid file makes the agent ready at once.
    fn start(&mut self, created: &mut CreatedRecord) {
        self.target.prepare();
        let on_disk = self
            .target
            .writer()
            .read_current()
            .unwrap_or(OnDisk::Missing);
        self.memory = self.target.remembered(on_disk.bytes());
        let now_unix = OffsetDateTime::now_utc().unix_timestamp();
        if let OnDisk::Regular { bytes, stat } = on_disk
            && let Ok(parsed) = bundle::parse_source(&bytes)
        {
            let adopted = Adopted {
                bytes: bytes.into(),
                certificates: parsed.certificates,
            };
            if adopted.valid_at(now_unix) {
                tracing::info!(bundle = %self.file.filepath, "adopted the valid bundle already in place");
                self.last_written = Some(Fingerprint::of(&adopted.bytes));
                self.owner = self.is_root.then_some((stat.uid, stat.gid));
                self.adopted = Some(adopted);
            }
        }
        let now = Instant::now();
        for index in 0..self.slots.len() {
            if !self.slots[index].source.spec.is_cluster() {
                self.read_local(index, now);
            }
        }
        self.reconcile(created);
    }

    /// One pass over this file.
    fn reconcile(&mut self, _created: &mut CreatedRecord) {
        self.schedule.due = false;
        self.pass();
    }

    /// Time until the next instant the bundle's validity can change: a certificate's
    /// notBefore or notAfter, or a retained certificate's window ending.
    fn next_boundary(&self) -> Duration {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let certificates = self
            .slots
            .iter()
            .filter_map(|s| s.source.content.as_ref())
            .flat_map(|c| c.certificates.iter());
        let adopted = self
            .adopted
            .iter()
            .filter(|_| self.desired.is_none())
            .flat_map(|a| a.certificates.iter());
        let instants = certificates
            .chain(adopted)
            .chain(self.memory.iter().map(|r| &r.certificate))
            .flat_map(|c| [c.not_before, c.not_after.saturating_add(1)])
            .chain(
                self.memory
                    .iter()
                    .filter_map(|r| Some(r.missing_since? + self.policy.retain_removed)),
            );
        let next = instants.filter(|&t| t > now).min();
        next.map_or(BOUNDARY_RECHECK_MAX, |t| {
            Duration::from_secs((t - now) as u64).min(BOUNDARY_RECHECK_MAX)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::Path;

    use super::*;

    /// A `--manage` file (or, with `bundle`, the bundle) at DIR/ca.crt, kept from the
    /// sources `specs`, with its state in DIR/state.
    fn managed(dir: &Path, bundle: bool, specs: &[SourceSpec]) -> Managed {
        managed_at(&dir.join("ca.crt"), dir, bundle, specs)
    }

    /// The same, at `path`.
    fn managed_at(path: &Path, dir: &Path, bundle: bool, specs: &[SourceSpec]) -> Managed {
        let state = dir.join("state");
        fs::create_dir_all(&state).unwrap();
        let common = crate::config::Common::for_tests(path, &state, specs.to_vec());
        let target = Target::new(&common);
        Managed::new(
            bundle,
            target,
            specs,
            0,
            common.policy(),
            None,
            Arc::default(),
        )
    }

    fn sync_errors(file: &Managed, reason: &str) -> u64 {
        let labels = FileReasonLabels {
            filepath: file.file.filepath.clone(),
            reason: reason.to_string(),
        };
        file.metrics.sync_errors.get(&labels).map_or(0, |c| c.get())
    }

    #[test]
    fn a_source_without_credentials_is_a_sync_that_cannot_happen_and_other_failures_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let spec: SourceSpec = "configmap:openshift-config-managed/kube-apiserver-client-ca"
            .parse()
            .unwrap();
        let mut file = managed(dir.path(), true, std::slice::from_ref(&spec));
        let name = spec.to_string();
        file.observe(
            0,
            SourceEvent::Failed(crate::source::SourceError::NotFound { spec: name.clone() }),
            Instant::now(),
        );
        assert_eq!(sync_errors(&file, "credentials"), 0);
        file.observe(
            0,
            SourceEvent::WatchRestart(crate::source::SourceError::Credentials {
                spec: name,
                problem: "the token file is missing".into(),
            }),
            Instant::now(),
        );
        assert_eq!(sync_errors(&file, "credentials"), 1);
    }

    /// A `file:` source DIR/NAME holding one CA valid for an hour.
    fn source(dir: &Path, name: &str) -> SourceSpec {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let ca = crate::bundle::test_certs::ca(Some(name), None, now - 60, now + 3600);
        fs::write(dir.join(name), ca.pem()).unwrap();
        format!("file:{}", dir.join(name).display())
            .parse()
            .unwrap()
    }

    #[test]
    fn while_repairs_back_off_health_says_so_even_after_a_failed_write() {
        let dir = tempfile::tempdir().unwrap();
        let spec = source(dir.path(), "signer.crt");
        let mut file = managed(dir.path(), true, &[spec]);
        file.start(&mut CreatedRecord::default());
        let path = dir.path().join("ca.crt");
        let goal = fs::read(&path).unwrap();
        assert_eq!(file.status.in_sync, Some(true));
        // The last write of this very bundle failed, and its retry waits...
        let error = "cannot replace the file: no space left on device";
        file.write_failed = Some(Fingerprint::of(&goal));
        file.write_error = Some(error.into());
        file.write_retry.until = Some(Instant::now() + Duration::from_secs(3600));
        fs::write(&path, "changed by something else\n").unwrap();
        file.reconcile(&mut CreatedRecord::default());
        assert_eq!(
            file.status.sync_problem,
            Some(format!("{error}; retrying with backoff")),
            "while a failed write waits for its retry, health says why it failed"
        );
        // ...but what holds the file now is the repairs' backoff: that is what is said.
        file.repair.until = Some(Instant::now() + Duration::from_secs(3600));
        file.reconcile(&mut CreatedRecord::default());
        assert_eq!(
            file.status.sync_problem.as_deref(),
            Some("the file was changed by something else; repair is backing off")
        );
    }

    #[test]
    fn the_bundles_directory_is_never_made_and_a_managed_files_is() {
        let dir = tempfile::tempdir().unwrap();
        let spec = source(dir.path(), "signer.crt");
        let bundle = dir.path().join("kubernetes").join("kubelet-ca.crt");
        let mut file = managed_at(&bundle, dir.path(), true, std::slice::from_ref(&spec));
        file.start(&mut CreatedRecord::default());
        assert!(
            !bundle.parent().unwrap().exists(),
            "the kubelet's directory is the node configuration's to make"
        );
        assert_eq!(file.status.in_sync, Some(false));
        let managed_file = dir.path().join("cloud").join("ca-bundle.pem");
        let mut file = managed_at(&managed_file, dir.path(), false, &[spec]);
        file.start(&mut CreatedRecord::default());
        assert!(managed_file.exists());
        assert_eq!(file.status.in_sync, Some(true));
        assert_eq!(
            file.built_len(),
            fs::read(&managed_file).unwrap().len(),
            "what was built is the size the loop gives memory back after"
        );
    }

    #[test]
    fn a_managed_file_whose_sources_hold_nothing_is_not_created_and_one_there_is_left() {
        let dir = tempfile::tempdir().unwrap();
        // The publisher's empty cloud CA key: read, and no certificate in it.
        let spec: SourceSpec = "configmap:openshift-config-managed/kube-cloud-config/ca-bundle.pem"
            .parse()
            .unwrap();
        let path = dir.path().join("ca.crt");
        let why = "its sources hold no certificate: the file is neither created nor emptied";
        let mut file = managed(dir.path(), false, std::slice::from_ref(&spec));
        file.start(&mut CreatedRecord::default());
        let nothing = SourceEvent::Content(crate::bundle::SourceCertificates::default());
        file.observe(0, nothing, Instant::now());
        file.reconcile(&mut CreatedRecord::default());
        assert!(!path.exists());
        assert!(file.status.nothing_to_keep);
        assert_eq!(
            file.status.file_problem,
            Some(format!("not created: {why}"))
        );
        fs::write(&path, "\n").unwrap();
        file.reconcile(&mut CreatedRecord::default());
        assert_eq!(
            file.status.file_problem,
            Some(format!(
                "holds no certificate either: {why}; it is left as it is"
            ))
        );
        assert_eq!(fs::read(&path).unwrap(), b"\n");
    }

    #[test]
    fn the_next_boundary_is_the_next_validity_change_after_this_second() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        // Valid from this very second: that start is no boundary to wait for.
        let ca = crate::bundle::test_certs::ca(Some("signer"), None, now, now + 600);
        fs::write(dir.path().join("signer.crt"), ca.pem()).unwrap();
        let spec: SourceSpec = format!("file:{}", dir.path().join("signer.crt").display())
            .parse()
            .unwrap();
        let mut file = managed(dir.path(), true, &[spec]);
        file.start(&mut CreatedRecord::default());
        let next = file.next_boundary();
        assert!(
            next <= Duration::from_secs(601) && next >= Duration::from_secs(599),
            "{next:?}"
        );
    }
}
