//! The reconciliation loop: the one owner of the agent's state. Each input (a source
//! update, a change on disk, a timer, a signal) updates that state, and each pass then
//! brings the file in line with the sources, publishing the outcome for health, metrics
//! and systemd.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use time::OffsetDateTime;
use tokio::signal::unix::Signal;
use tokio::sync::{mpsc, watch};
use tokio::time::sleep_until;

use super::files::FsEvent;
use super::status::{SourceStatus, Status};
use crate::bundle::{self, Built, Fingerprint, Policy, Remembered, SourceCertificates};
use crate::cli::{CommonArgs, ExecCommand};
use crate::metrics::{FileLabels, FileReasonLabels, Metrics, SourceLabels, SourceReasonLabels};
use crate::server::Ping;
use crate::source::cluster::{SourceEvent, Update};
use crate::source::{SourceError, SourceSpec, local};
use crate::systemd::Notifier;
use crate::target::Target;

/// How long the inotify events on a local source must pause before the source is read, so
/// that a file being written in place is read once, complete; and the longest the read
/// waits for such a pause.
const SOURCE_SETTLE: Duration = Duration::from_millis(20);
const SOURCE_SETTLE_MAX: Duration = Duration::from_millis(500);
/// The same for the managed file: a writer's create+write+close arrive as one change.
const BUNDLE_SETTLE: Duration = Duration::from_millis(5);
/// Repairs of a file that something keeps changing back: the delay after the n-th repair
/// in a row is 250 ms * 2^n, capped here (SPEC 6). A lone repair is immediate.
const REPAIR_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Failed writes (disk full, read-only, permissions) are retried from 1 s up to 5 minutes.
const WRITE_RETRY_FIRST: Duration = Duration::from_secs(1);
const REPAIR_FIRST: Duration = Duration::from_millis(250);
/// A quiet spell this long ends a streak of repairs.
const REPAIR_STREAK_RESET: Duration = Duration::from_secs(600);
const WRITE_RETRY_MAX: Duration = Duration::from_secs(300);
/// Certificate boundaries are re-checked at least this often, in case the clock jumps.
const BOUNDARY_RECHECK_MAX: Duration = Duration::from_secs(3600);

/// A bundle and its retention memory, as last handed to the records.
type RecordedState = (Fingerprint, Vec<(Fingerprint, Option<i64>)>);

/// The channels the loop reads.
pub struct Inputs {
    pub updates: mpsc::UnboundedReceiver<Update>,
    pub files: mpsc::UnboundedReceiver<FsEvent>,
    pub pings: mpsc::Receiver<Ping>,
    /// SIGTERM and SIGINT, registered before the first pass, so that a signal during start
    /// also ends in a clean exit.
    pub sigterm: Signal,
    pub sigint: Signal,
}

/// What the loop knows about one source.
struct Slot {
    spec: SourceSpec,
    name: String,
    /// The last good content: what the bundle is built from, kept while the source fails.
    content: Option<SourceCertificates>,
    up: bool,
    problem: Option<String>,
    last_change: Option<f64>,
    /// For a local source: read again at this instant (inotify events settle first).
    read_at: Option<Instant>,
    /// The first of the events that `read_at` waits to settle.
    settling_since: Option<Instant>,
}

/// The bundle built from the sources, ready to compare with the file.
struct Desired {
    built: Built,
    rendered: Arc<[u8]>,
}

/// A delay that doubles on every use in a row, up to a cap.
#[derive(Debug, Default)]
struct Backoff {
    /// Not before this instant.
    until: Option<Instant>,
    /// How many times in a row it was applied.
    streak: u32,
    last: Option<Instant>,
}

impl Backoff {
    fn blocked(&self, now: Instant) -> bool {
        self.until.is_some_and(|t| now < t)
    }

    /// Records one more use at `now` and sets the next allowed instant.
    fn step(&mut self, now: Instant, first: Duration, cap: Duration, reset_after: Duration) {
        let recent = self
            .last
            .is_some_and(|l| now.duration_since(l) < reset_after);
        self.streak = if recent { self.streak + 1 } else { 0 };
        self.last = Some(now);
        let delay = (first * (1u32 << self.streak.min(16))).min(cap);
        self.until = Some(now + delay);
    }

    fn clear(&mut self) {
        *self = Backoff::default();
    }
}

pub struct Reconciler {
    target: Target,
    slots: Vec<Slot>,
    policy: Policy,
    exec: Option<ExecCommand>,
    memory: Vec<Remembered>,
    desired: Option<Desired>,
    /// SHA-256 of the bundle this agent last wrote or found in place and in sync.
    last_written: Option<Fingerprint>,
    /// The valid bundle found on disk at start: it stands, and drift from it is repaired,
    /// until every source has been read once.
    adopted: Option<Arc<[u8]>>,
    /// The bundle whose last write failed: only its retries wait for the backoff.
    write_failed: Option<Fingerprint>,
    /// What was last handed to the records (bundle, retention memory), so that an
    /// unchanged state is not recorded again.
    recorded: Option<RecordedState>,
    /// When the oldest source change not yet on disk arrived.
    pending_since: Option<Instant>,
    /// The file was reported changed: look at it at this instant.
    recheck_at: Option<Instant>,
    repair: Backoff,
    write_retry: Backoff,
    /// A pass was put off by a backoff: run one at this instant.
    retry_at: Option<Instant>,
    /// The last build failure, so that it is logged and counted once.
    build_problem: Option<String>,
    metrics: Arc<Metrics>,
    file: FileLabels,
    status: watch::Sender<Arc<Status>>,
    notifier: Notifier,
    last_sync: Option<f64>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Reconciler {
    pub fn new(
        common: &CommonArgs,
        metrics: Arc<Metrics>,
        status: watch::Sender<Arc<Status>>,
    ) -> Self {
        let slots = common
            .sources
            .iter()
            .map(|spec| Slot {
                spec: spec.clone(),
                name: spec.to_string(),
                content: None,
                up: false,
                problem: Some("not read yet".to_string()),
                last_change: None,
                read_at: None,
                settling_since: None,
            })
            .collect();
        Reconciler {
            target: Target::new(common).with_background_records(),
            slots,
            policy: common.policy(),
            exec: common.exec_on_change.clone(),
            memory: Vec::new(),
            desired: None,
            last_written: None,
            adopted: None,
            write_failed: None,
            recorded: None,
            pending_since: None,
            recheck_at: None,
            repair: Backoff::default(),
            write_retry: Backoff::default(),
            retry_at: None,
            build_problem: None,
            metrics,
            file: FileLabels {
                filepath: common.bundle.display().to_string(),
            },
            status,
            notifier: Notifier::default(),
            last_sync: None,
        }
    }

    /// Adopts the file on disk, reads the local sources, and runs the first pass. No API
    /// call happens here, so a valid file makes the agent ready at once.
    pub fn start(&mut self) {
        self.target.prepare();
        let on_disk = self.target.writer().read_current().ok().flatten();
        self.memory = self.target.remembered(on_disk.as_deref());
        let now_unix = OffsetDateTime::now_utc().unix_timestamp();
        let valid = |b: &[u8]| {
            bundle::parse_source(b)
                .is_ok_and(|p| p.certificates.iter().any(|c| c.is_valid_at(now_unix)))
        };
        if let Some(bytes) = on_disk.filter(|b| valid(b)) {
            tracing::info!(bundle = %self.file.filepath, "adopted the valid bundle already in place");
            self.last_written = Some(Fingerprint::of(&bytes));
            self.adopted = Some(bytes.into());
        }
        let now = Instant::now();
        for index in 0..self.slots.len() {
            if !self.slots[index].spec.is_cluster() {
                self.read_local(index, now);
            }
        }
        self.reconcile();
    }

    /// The loop. Returns on SIGTERM or SIGINT, after the pass in progress.
    pub async fn run(&mut self, mut inputs: Inputs) -> anyhow::Result<()> {
        let watchdog_every = Notifier::watchdog_interval();
        let mut next_watchdog = watchdog_every.map(|every| Instant::now() + every);
        let mut updates_open = true;
        loop {
            let now = Instant::now();
            let boundary_at = now + self.next_boundary();
            let deadline = [
                Some(boundary_at),
                self.recheck_at,
                self.retry_at,
                next_watchdog,
            ]
            .into_iter()
            .chain(self.slots.iter().map(|s| s.read_at))
            .flatten()
            .min()
            .expect("the boundary is always set");
            // Only a source update, a settled change on disk, a due retry or a certificate
            // boundary calls for a pass; a watchdog tick or a ping does not.
            let mut work = false;
            tokio::select! {
                update = inputs.updates.recv(), if updates_open => match update {
                    Some(update) => { self.on_update(update); work = true; }
                    None => updates_open = false,
                },
                Some(event) = inputs.files.recv() => self.on_file_event(event),
                Some(ping) = inputs.pings.recv() => { let _ = ping.send(()); continue; }
                _ = sleep_until(deadline.into()) => {}
                _ = inputs.sigterm.recv() => { tracing::info!("SIGTERM: stopping"); break; }
                _ = inputs.sigint.recv() => { tracing::info!("SIGINT: stopping"); break; }
            }
            // Take whatever else is queued, so that a burst costs one pass.
            while let Ok(update) = inputs.updates.try_recv() {
                self.on_update(update);
                work = true;
            }
            while let Ok(event) = inputs.files.try_recv() {
                self.on_file_event(event);
            }
            let now = Instant::now();
            for index in 0..self.slots.len() {
                if self.slots[index].read_at.is_some_and(|t| t <= now) {
                    self.slots[index].read_at = None;
                    self.slots[index].settling_since = None;
                    self.read_local(index, now);
                    work = true;
                }
            }
            for due in [&mut self.recheck_at, &mut self.retry_at] {
                if due.is_some_and(|t| t <= now) {
                    *due = None;
                    work = true;
                }
            }
            work |= boundary_at <= now;
            if let (Some(every), Some(at)) = (watchdog_every, next_watchdog)
                && at <= now
            {
                self.notifier.watchdog();
                next_watchdog = Some(now + every);
            }
            if work {
                self.reconcile();
            }
        }
        self.notifier.stopping();
        Ok(())
    }

    fn on_file_event(&mut self, event: FsEvent) {
        let at = Instant::now();
        match event {
            FsEvent::Bundle => {
                self.recheck_at.get_or_insert(at + BUNDLE_SETTLE);
            }
            FsEvent::Rescan => {
                tracing::warn!(
                    "file events were lost; looking at the bundle and the local sources again"
                );
                self.recheck_at.get_or_insert(at + BUNDLE_SETTLE);
                for slot in self.slots.iter_mut().filter(|s| !s.spec.is_cluster()) {
                    slot.read_at.get_or_insert(at + SOURCE_SETTLE);
                }
            }
            FsEvent::Source(index) => {
                // Read once the events stop for a moment, but no later than a bound after the
                // first one, so that a writer that never pauses is still followed.
                let slot = &mut self.slots[index];
                let first = *slot.settling_since.get_or_insert(at);
                slot.read_at = Some((at + SOURCE_SETTLE).min(first + SOURCE_SETTLE_MAX));
            }
        }
    }

    /// Reads a `file:` or `dir:` source now.
    fn read_local(&mut self, index: usize, at: Instant) {
        let event = match local::load(&self.slots[index].spec) {
            Ok(content) => SourceEvent::Content(content),
            Err(error) => SourceEvent::Failed(error),
        };
        self.on_update(Update { index, event, at });
    }

    fn on_update(&mut self, update: Update) {
        let metrics = self.metrics.clone();
        let slot = &mut self.slots[update.index];
        let labels = |reason: &str| SourceReasonLabels {
            source: slot.name.clone(),
            reason: reason.to_string(),
        };
        match update.event {
            SourceEvent::Content(content) => {
                let changed = slot
                    .content
                    .as_ref()
                    .is_none_or(|old| fingerprints(old) != fingerprints(&content));
                if !slot.up {
                    tracing::info!(source = %slot.name, certificates = content.certificates.len(), "source is up");
                }
                slot.up = true;
                slot.problem = None;
                if changed {
                    if !content.not_ca.is_empty() {
                        let count = content.not_ca.len() as u64;
                        metrics
                            .rejected_certificates
                            .get_or_create(&labels("not_ca"))
                            .inc_by(count);
                    }
                    crate::source::warn_not_ca(&slot.spec, &content);
                    tracing::info!(source = %slot.name, certificates = content.certificates.len(), "source content changed");
                    slot.content = Some(content);
                    slot.last_change = Some(unix_now());
                    self.pending_since.get_or_insert(update.at);
                }
            }
            SourceEvent::Failed(error) => {
                metrics
                    .source_errors
                    .get_or_create(&labels(error.reason()))
                    .inc();
                report(
                    slot,
                    &error,
                    "source update rejected; keeping its last good content",
                );
            }
            SourceEvent::WatchRestart(error) => {
                metrics
                    .source_errors
                    .get_or_create(&labels(error.reason()))
                    .inc();
                metrics
                    .watch_restarts
                    .get_or_create(&SourceLabels {
                        source: slot.name.clone(),
                    })
                    .inc();
                report(
                    slot,
                    &error,
                    "watch failed; retrying with backoff, keeping the last good content",
                );
            }
        }
    }

    /// One pass: build the bundle from the last good content of every source and make the
    /// file hold it, unless nothing valid can be built, a source has never been read, or a
    /// backoff says wait. Then publish the state.
    fn reconcile(&mut self) {
        let now = OffsetDateTime::now_utc();
        let on_disk = match self.target.writer().read_current() {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the bundle file");
                None
            }
        };
        let all_read = self.slots.iter().all(|s| s.content.is_some());
        let goal: Arc<[u8]> = if all_read {
            match self.build(now) {
                Some(desired) => desired.rendered.clone(),
                None => {
                    let problem = self.build_problem.clone();
                    self.publish(on_disk.as_deref(), Some(false), problem);
                    return;
                }
            }
        } else {
            // Building from some sources only would drop the others' signers. Until each
            // source has been read once, the adopted bundle stands, and is what a repair
            // restores.
            self.desired = None;
            match &self.adopted {
                Some(adopted) => adopted.clone(),
                None => {
                    self.publish(on_disk.as_deref(), None, None);
                    return;
                }
            }
        };
        let sha256 = Fingerprint::of(&goal);
        if on_disk.as_deref() == Some(&goal[..]) {
            match self.target.writer().repair_mode() {
                Ok(true) => {
                    self.metrics.repairs.get_or_create(&self.file).inc();
                    tracing::warn!(bundle = %self.file.filepath, "repaired the bundle's mode: something else had changed it");
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "cannot check or repair the bundle's mode"),
            }
            self.in_sync(sha256);
            self.publish(on_disk.as_deref(), self.in_sync_state(), None);
            return;
        }
        let at = Instant::now();
        // The goal has not changed since it was written (or adopted): someone else changed
        // the file.
        let repair = self.last_written == Some(sha256);
        let (waiting_for, problem) = if repair && self.repair.blocked(at) {
            (
                self.repair.until,
                "the file was changed by something else; repair is backing off",
            )
        } else if self.write_failed == Some(sha256) && self.write_retry.blocked(at) {
            (
                self.write_retry.until,
                "the last write failed; retrying with backoff",
            )
        } else {
            (None, "")
        };
        if waiting_for.is_some() {
            self.retry_at = waiting_for;
            self.publish(on_disk.as_deref(), Some(false), Some(problem.into()));
            return;
        }
        let written = match &self.desired {
            Some(desired) if all_read => self.target.apply(
                &desired.built,
                &desired.rendered,
                on_disk.as_deref(),
                now,
                !repair,
            ),
            _ => self.target.restore(&goal, on_disk.as_deref()),
        };
        match written {
            Ok(applied) => {
                if applied.replaced {
                    self.metrics.writes.get_or_create(&self.file).inc();
                    if repair {
                        self.metrics.repairs.get_or_create(&self.file).inc();
                        self.repair
                            .step(at, REPAIR_FIRST, REPAIR_BACKOFF_MAX, REPAIR_STREAK_RESET);
                        tracing::warn!(bundle = %self.file.filepath, "repaired the bundle: something else had changed or removed it");
                    } else if let Some(since) = self.pending_since {
                        self.metrics
                            .sync_duration
                            .observe(since.elapsed().as_secs_f64());
                    }
                    self.run_exec_on_change();
                }
                self.write_failed = None;
                self.write_retry.clear();
                self.in_sync(sha256);
                self.publish(Some(&goal), self.in_sync_state(), None);
            }
            Err(e) => {
                self.count_sync_error(e.reason());
                if self.write_failed != Some(sha256) {
                    self.write_retry.clear();
                }
                self.write_failed = Some(sha256);
                self.write_retry
                    .step(at, WRITE_RETRY_FIRST, WRITE_RETRY_MAX, WRITE_RETRY_MAX * 2);
                self.retry_at = self.write_retry.until;
                tracing::error!(reason = e.reason(), "{e}");
                self.publish(on_disk.as_deref(), Some(false), Some(e.to_string()));
            }
        }
    }

    /// Builds the bundle from every source's last good content, or records why it cannot
    /// be built (logged and counted once per distinct problem).
    fn build(&mut self, now: OffsetDateTime) -> Option<&Desired> {
        let sources: Vec<SourceCertificates> = self
            .slots
            .iter()
            .filter_map(|s| s.content.clone())
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
                    tracing::error!(
                        reason = bundle::NoValidCertificate::REASON,
                        "{problem}; the file stays as it is"
                    );
                    self.count_sync_error(bundle::NoValidCertificate::REASON);
                    self.build_problem = Some(problem);
                }
                self.desired = None;
                None
            }
        }
    }

    /// In sync with the sources (`Some(true)`), or holding the adopted bundle while a
    /// source has not been read yet (`None`: nothing to compare with).
    fn in_sync_state(&self) -> Option<bool> {
        self.desired.is_some().then_some(true)
    }

    fn in_sync(&mut self, sha256: Fingerprint) {
        self.last_written = Some(sha256);
        self.pending_since = None;
        self.last_sync = Some(unix_now());
        if let Some(desired) = &self.desired {
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

    fn count_sync_error(&self, reason: &str) {
        let labels = FileReasonLabels {
            filepath: self.file.filepath.clone(),
            reason: reason.to_string(),
        };
        self.metrics.sync_errors.get_or_create(&labels).inc();
    }

    /// Runs `--exec-on-change` on its own thread: a slow hook must not stall the loop.
    fn run_exec_on_change(&self) {
        if let Some(command) = self.exec.clone() {
            let (metrics, path) = (self.metrics.clone(), self.target.path().to_path_buf());
            std::thread::spawn(move || {
                if !crate::exec::run(&command.0, &path) {
                    metrics.exec_on_change_failures.inc();
                }
            });
        }
    }

    /// Time until the next instant the bundle's validity can change: a certificate's
    /// notBefore or notAfter, or a retained certificate's window ending.
    fn next_boundary(&self) -> Duration {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let certificates = self
            .slots
            .iter()
            .filter_map(|s| s.content.as_ref())
            .flat_map(|c| c.certificates.iter());
        let instants = certificates
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

    /// Publishes the state of the file for health, metrics and systemd.
    fn publish(
        &mut self,
        on_disk: Option<&[u8]>,
        in_sync: Option<bool>,
        sync_problem: Option<String>,
    ) {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let (certificates, file_valid, file_problem) = match on_disk {
            None => (
                Vec::new(),
                false,
                Some("the file does not exist".to_string()),
            ),
            Some(bytes) => {
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
                        (certificates, valid, problem)
                    }
                    Err(rejection) => (
                        Vec::new(),
                        false,
                        Some(format!("the file is not a valid bundle: {rejection}")),
                    ),
                }
            }
        };
        if in_sync == Some(true) {
            self.last_sync = Some(unix_now());
        }
        let status = Status {
            bundle_path: self.file.filepath.clone(),
            certificates,
            sha256: on_disk.map(|b| Fingerprint::of(b).to_hex()),
            file_valid,
            file_problem,
            in_sync,
            sync_problem,
            sources: self
                .slots
                .iter()
                .map(|s| SourceStatus {
                    spec: s.name.clone(),
                    up: s.up,
                    problem: s.problem.clone(),
                    last_change: s.last_change,
                })
                .collect(),
            last_sync: self.last_sync,
        };
        self.notifier.status(&status.summary());
        self.notifier.ready(status.ready());
        self.status.send_replace(Arc::new(status));
    }
}

fn fingerprints(content: &SourceCertificates) -> Vec<Fingerprint> {
    content
        .certificates
        .iter()
        .chain(content.not_ca.iter().map(|s| &s.certificate))
        .map(|c| c.fingerprint())
        .collect()
}

/// Marks a source down and logs why, once per distinct problem.
fn report(slot: &mut Slot, error: &SourceError, what: &str) {
    let problem = error.to_string();
    if slot.problem.as_ref() != Some(&problem) {
        tracing::warn!(source = %slot.name, reason = error.reason(), "{what}: {problem}");
    }
    slot.up = false;
    slot.problem = Some(problem);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repair_backoff_doubles_to_the_cap_and_resets_after_quiet() {
        let mut backoff = Backoff::default();
        let start = Instant::now();
        let mut at = start;
        let mut delays = Vec::new();
        for _ in 0..14 {
            backoff.step(at, REPAIR_FIRST, REPAIR_BACKOFF_MAX, REPAIR_STREAK_RESET);
            let until = backoff.until.unwrap();
            delays.push(until - at);
            assert!(backoff.blocked(at));
            at = until;
        }
        assert_eq!(delays[0], Duration::from_millis(250));
        assert_eq!(delays[1], Duration::from_millis(500));
        assert_eq!(delays[4], Duration::from_secs(4));
        assert_eq!(*delays.last().unwrap(), REPAIR_BACKOFF_MAX);
        // A fighter at full speed gets a handful of repairs a minute, not a busy loop.
        let in_first_minute = delays
            .iter()
            .scan(Duration::ZERO, |t, d| {
                *t += *d;
                Some(*t)
            })
            .filter(|t| *t <= Duration::from_secs(60))
            .count();
        assert!(in_first_minute <= 9, "{in_first_minute}");
        // After a quiet spell the next repair is immediate again and the delay starts over.
        let later = at + REPAIR_STREAK_RESET;
        assert!(!backoff.blocked(later));
        backoff.step(later, REPAIR_FIRST, REPAIR_BACKOFF_MAX, REPAIR_STREAK_RESET);
        assert_eq!(backoff.until.unwrap() - later, REPAIR_FIRST);
    }
}
