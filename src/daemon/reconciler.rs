//! The reconciliation loop: the one owner of the agent's state. Each input (a source
//! update, a change on disk, a timer, a signal) updates that state, and each pass then
//! brings the file in line with the sources, publishing the outcome for health, metrics
//! and systemd.
//!
//! What a pass does to the file is decided by [`decide`], a pure function of what the loop
//! knows and what is on disk, so that every policy (repair, back off, retry) is tested
//! without a process, a clock or a disk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use time::OffsetDateTime;
use tokio::signal::unix::Signal;
use tokio::sync::{mpsc, watch};
use tokio::time::sleep_until;

use crate::bundle::{self, Built, Fingerprint, Policy, Remembered, SourceCertificates};
use crate::cli::CommonArgs;
use crate::exec::Hooks;
use crate::files::FsEvent;
use crate::fsutil::{FileKind, Stat};
use crate::kubelet_config;
use crate::metrics::{FileLabels, FileReasonLabels, Metrics, RecordLabels, known};
use crate::server::Pongs;
use crate::source::cluster::{SourceEvent, Update};
use crate::source::local;
use crate::source::state::SourceState;
use crate::status::{Status, TargetKind, unix_now};
use crate::systemd::Notifier;
use crate::target::Target;
use crate::writer::{OnDisk, WriteError};

/// A local source being written in place (changed, not yet closed) is read once the writer
/// closes it; a writer that keeps it open is read after this long without a change, and
/// no later than the second bound after its first change.
const WRITE_QUIET: Duration = Duration::from_secs(1);
const WRITE_QUIET_MAX: Duration = Duration::from_secs(5);
/// The managed file: a writer's create+write+close arrive as one change.
const BUNDLE_SETTLE: Duration = Duration::from_millis(5);
/// The managed file and every local source are looked at again this often, whatever
/// inotify says (the kubelet's own CA reloader does the same): a missed event costs at
/// most this much drift.
pub const VERIFY_EVERY: Duration = Duration::from_secs(60);
/// A local source that could not be read is read again from 1 s, doubling, up to this.
const READ_RETRY_FIRST: Duration = Duration::from_secs(1);
const READ_RETRY_MAX: Duration = Duration::from_secs(60);
/// Repairs of a file that something keeps changing back: the delay after the n-th repair
/// in a row is 250 ms * 2^n, capped here (SPEC 6). A lone repair is immediate.
const REPAIR_FIRST: Duration = Duration::from_millis(250);
const REPAIR_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// A quiet spell this long ends a streak of repairs.
const REPAIR_STREAK_RESET: Duration = Duration::from_secs(600);
/// Failed writes (disk full, read-only, permissions) are retried from 1 s up to 5 minutes.
const WRITE_RETRY_FIRST: Duration = Duration::from_secs(1);
const WRITE_RETRY_MAX: Duration = Duration::from_secs(300);
/// Certificate boundaries are re-checked at least this often, in case the clock jumps.
const BOUNDARY_RECHECK_MAX: Duration = Duration::from_secs(3600);

/// A bundle and its retention memory, as last handed to the records.
type RecordedState = (Fingerprint, Vec<(Fingerprint, Option<i64>)>);

/// The channels the loop reads.
pub struct Inputs {
    pub updates: mpsc::UnboundedReceiver<Update>,
    pub files: mpsc::UnboundedReceiver<FsEvent>,
    /// Liveness pings from the HTTP server, answered between passes.
    pub pongs: Pongs,
    /// SIGTERM and SIGINT, registered before the first pass, so that a signal during start
    /// also ends in a clean exit.
    pub sigterm: Signal,
    pub sigint: Signal,
}

/// What the loop knows about one source.
struct Slot {
    source: SourceState,
    /// For a local source: read again at this instant.
    read_at: Option<Instant>,
    /// The first in-place change that `read_at` waits to see finished.
    writing_since: Option<Instant>,
    /// Retries of a local source that could not be read.
    read_retry: Backoff,
    /// For a local source: reads it, and parses only bytes it has not parsed already.
    loader: local::Loader,
}

/// The bundle built from the sources, ready to compare with the file.
struct Desired {
    built: Built,
    rendered: Arc<[u8]>,
}

/// A delay that doubles on every use in a row, up to a cap.
#[derive(Debug, Default, Clone)]
struct Backoff {
    /// Not before this instant.
    until: Option<Instant>,
    /// How many times in a row it was applied.
    streak: u32,
    last: Option<Instant>,
}

impl Backoff {
    fn blocked(&self, now: Instant) -> Option<Instant> {
        self.until.filter(|&t| now < t)
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

    /// A failed write, an unreadable bundle path, or a mode or owner that could not be put
    /// back: 1 s doubling to 5 minutes, starting over after 10 quiet minutes.
    fn step_write(&mut self, at: Instant) {
        self.step(at, WRITE_RETRY_FIRST, WRITE_RETRY_MAX, WRITE_RETRY_MAX * 2);
    }

    /// A local source that could not be read: 1 s doubling to a minute, starting over after
    /// two quiet minutes.
    fn step_read(&mut self, at: Instant) {
        self.step(at, READ_RETRY_FIRST, READ_RETRY_MAX, READ_RETRY_MAX * 2);
    }

    /// A repair: 250 ms doubling to 5 minutes, starting over after 10 quiet minutes.
    fn step_repair(&mut self, at: Instant) {
        self.step(at, REPAIR_FIRST, REPAIR_BACKOFF_MAX, REPAIR_STREAK_RESET);
    }
}

/// What a pass knows when it decides what to do with the file.
struct Facts<'a> {
    /// The bytes the file should hold.
    goal: &'a [u8],
    on_disk: &'a OnDisk,
    /// `--file-mode`, and the owner the file should have (only when running as root).
    mode: u32,
    owner: Option<(u32, u32)>,
    /// The bundle this agent last wrote or adopted.
    last_written: Option<Fingerprint>,
    /// The bundle whose last write failed.
    write_failed: Option<Fingerprint>,
}

/// What a pass does with the file.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    /// The file holds the goal, with the right mode and owner.
    InSync,
    /// The content is right but something else changed the mode or owner: put them back.
    RepairAttributes,
    /// A directory is at the path: no rename can replace it, and the agent never removes
    /// one. Someone has to; the file is written as soon as it is gone.
    CannotReplace,
    /// Replace the file with the goal. `repair`: the goal has not changed since this agent
    /// wrote or adopted it, so someone else changed the file.
    Write { repair: bool },
    /// A backoff holds the next attempt until then; the file is out of sync meanwhile.
    Wait {
        until: Instant,
        problem: &'static str,
    },
}

/// Why a pass waits while a failed write's retry is due later.
const WRITE_RETRY_WAIT: &str = "the last write failed; retrying with backoff";

/// The policy of a pass: repair drift at once but back off from a writer that keeps
/// fighting, retry a failed write with backoff (a new bundle at once), and never touch a
/// file that already holds the goal as it should.
fn decide(facts: &Facts, repair: &Backoff, write_retry: &Backoff, now: Instant) -> Action {
    let content_ok = facts.on_disk.bytes() == Some(facts.goal);
    let attributes_ok = facts
        .on_disk
        .stat()
        .is_some_and(|s| s.mode == facts.mode && facts.owner.is_none_or(|o| o == (s.uid, s.gid)));
    if content_ok && attributes_ok {
        return Action::InSync;
    }
    if *facts.on_disk == OnDisk::Other(FileKind::Directory) {
        return Action::CannotReplace;
    }
    let goal = Fingerprint::of(facts.goal);
    let is_repair = content_ok || facts.last_written == Some(goal);
    if is_repair && let Some(until) = repair.blocked(now) {
        return Action::Wait {
            until,
            problem: "the file was changed by something else; repair is backing off",
        };
    }
    if content_ok {
        return Action::RepairAttributes;
    }
    if facts.write_failed == Some(goal)
        && let Some(until) = write_retry.blocked(now)
    {
        return Action::Wait {
            until,
            problem: WRITE_RETRY_WAIT,
        };
    }
    Action::Write { repair: is_repair }
}

/// The file as a pass saw it, for status.
enum Seen<'a> {
    Regular(&'a [u8]),
    Missing,
    Other(FileKind),
    Unreadable(String),
}

impl<'a> From<&'a OnDisk> for Seen<'a> {
    fn from(on_disk: &'a OnDisk) -> Self {
        match on_disk {
            OnDisk::Regular { bytes, .. } => Seen::Regular(bytes),
            OnDisk::Missing => Seen::Missing,
            OnDisk::Other(kind) => Seen::Other(*kind),
        }
    }
}

pub struct Reconciler {
    target: Target,
    slots: Vec<Slot>,
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
    /// The file was reported changed: look at it at this instant.
    recheck_at: Option<Instant>,
    repair: Backoff,
    write_retry: Backoff,
    /// A pass was put off by a backoff: run one at this instant.
    retry_at: Option<Instant>,
    /// The next re-verification of the file and the local sources.
    verify_at: Instant,
    /// The last build failure, so that it is logged and counted once.
    build_problem: Option<String>,
    /// What inotify does not watch, as the watcher last reported.
    file_watch: Option<String>,
    /// Whether the kubelet's config names the file, read off the loop.
    kubelet: kubelet_config::Reader,
    metrics: Arc<Metrics>,
    file: FileLabels,
    status: watch::Sender<Arc<Status>>,
    notifier: Notifier,
    last_sync: Option<f64>,
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
                source: SourceState::new(spec),
                read_at: None,
                writing_since: None,
                read_retry: Backoff::default(),
                loader: local::Loader::default(),
            })
            .collect();
        // Every counter has its series from the start.
        let cluster: &[&str] = if common.sources.iter().any(|s| s.is_cluster()) {
            known::CLUSTER_SYNC_ERRORS
        } else {
            &[]
        };
        let filepath = common.bundle.display().to_string();
        metrics.init_file(&filepath, &[known::FILE_SYNC_ERRORS, cluster]);
        for spec in &common.sources {
            metrics.init_source(spec);
        }
        metrics.init_records();
        let failures = metrics.clone();
        let hooks = common.exec_on_change.clone().map(|command| {
            let failures = metrics.clone();
            Hooks::start(
                command.0,
                common.bundle.clone(),
                common.exec_on_change_timeout,
                move || {
                    failures.exec_on_change_failures.inc();
                },
            )
        });
        Reconciler {
            target: Target::new(common).with_background_records(move |record| {
                failures
                    .state_errors
                    .get_or_create(&RecordLabels {
                        record: record.to_string(),
                    })
                    .inc();
            }),
            slots,
            policy: common.policy(),
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
            recheck_at: None,
            repair: Backoff::default(),
            write_retry: Backoff::default(),
            retry_at: None,
            verify_at: Instant::now() + VERIFY_EVERY,
            build_problem: None,
            file_watch: Some("not started yet".to_string()),
            kubelet: kubelet_config::Reader::new(
                kubelet_config::paths_for(None),
                common.bundle.clone(),
            ),
            metrics,
            file: FileLabels { filepath },
            status,
            notifier: Notifier::default(),
            last_sync: None,
        }
    }

    /// Adopts the file on disk, reads the local sources, and runs the first pass. No API
    /// call happens here, so a valid file makes the agent ready at once.
    pub fn start(&mut self) {
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
        self.kubelet.request(now);
        for index in 0..self.slots.len() {
            if !self.slots[index].source.spec.is_cluster() {
                self.read_local(index, now);
            }
        }
        self.reconcile();
    }

    /// Reads the kubelet's config from `path` (`--kubelet-config`) rather than the usual
    /// places.
    pub fn with_kubelet_config(
        mut self,
        path: Option<&std::path::Path>,
        bundle: &std::path::Path,
    ) -> Self {
        self.kubelet =
            kubelet_config::Reader::new(kubelet_config::paths_for(path), bundle.to_path_buf());
        self
    }

    /// The loop. Returns on SIGTERM or SIGINT, after the pass in progress.
    pub async fn run(&mut self, mut inputs: Inputs) -> anyhow::Result<()> {
        let watchdog_every = Notifier::watchdog_interval();
        let mut next_watchdog = watchdog_every.map(|every| Instant::now() + every);
        let mut updates_open = true;
        let mut kubelet_reads = self.kubelet.take_results();
        loop {
            let boundary_at = Instant::now() + self.next_boundary();
            let deadline = [
                Some(boundary_at),
                Some(self.verify_at),
                self.recheck_at,
                self.retry_at,
                next_watchdog,
            ]
            .into_iter()
            .chain(self.slots.iter().map(|s| s.read_at))
            .flatten()
            .min()
            .expect("the boundary is always set");
            // Only a source update, a settled change on disk, a due retry, a re-verification
            // or a certificate boundary calls for a pass; a watchdog tick or a ping does not.
            let mut work = false;
            tokio::select! {
                update = inputs.updates.recv(), if updates_open => match update {
                    Some(update) => { self.on_update(update); work = true; }
                    None => updates_open = false,
                },
                Some(event) = inputs.files.recv() => work |= self.on_file_event(event),
                Some(seen) = kubelet_reads.recv() => work |= self.kubelet.found(seen),
                Some(()) = inputs.pongs.pings.recv() => { inputs.pongs.answer(); continue; }
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
                work |= self.on_file_event(event);
            }
            let now = Instant::now();
            work |= self.take_due(now);
            // A certificate boundary is a pass: readiness and the file follow validity.
            work |= now >= boundary_at;
            if work {
                self.reconcile();
            }
            if let (Some(every), Some(at)) = (watchdog_every, next_watchdog)
                && Instant::now() >= at
            {
                self.notifier.watchdog();
                next_watchdog = Some(Instant::now() + every);
            }
        }
        self.kubelet.give_back(kubelet_reads);
        self.notifier.stopping();
        Ok(())
    }

    /// Does what is due at `now`: the re-verification, the reads of local sources, a recheck
    /// of the file, a retry. True when a pass is called for.
    fn take_due(&mut self, now: Instant) -> bool {
        let mut work = false;
        if self.verify_at <= now {
            // The safety net: whatever inotify said, look at every local source and (in the
            // pass that follows) at the file. The kubelet's config is read again too, off
            // the loop: what it finds comes back as an input of its own.
            self.verify_at = now + VERIFY_EVERY;
            self.kubelet.request(now);
            for slot in self
                .slots
                .iter_mut()
                .filter(|s| !s.source.spec.is_cluster())
            {
                slot.read_at = Some(now);
            }
            work = true;
        }
        for index in 0..self.slots.len() {
            if self.slots[index].read_at.is_some_and(|t| t <= now) {
                self.slots[index].read_at = None;
                self.slots[index].writing_since = None;
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
        work
    }

    /// Takes a change on disk into account; true when it calls for a pass now.
    fn on_file_event(&mut self, event: FsEvent) -> bool {
        let at = Instant::now();
        match event {
            FsEvent::Bundle => {
                self.recheck_at.get_or_insert(at + BUNDLE_SETTLE);
            }
            FsEvent::Rescan => {
                tracing::info!("looking at the bundle and the local sources again");
                self.recheck_at.get_or_insert(at + BUNDLE_SETTLE);
                for slot in self
                    .slots
                    .iter_mut()
                    .filter(|s| !s.source.spec.is_cluster())
                {
                    slot.read_at = Some(at);
                }
            }
            FsEvent::Source {
                index,
                settled: true,
            } => {
                // Closed after writing, renamed into place or removed: read at once.
                self.slots[index].read_at = Some(at);
            }
            FsEvent::Source {
                index,
                settled: false,
            } => {
                // A writer at work in place: wait for it to close the file (a settled
                // event), or to fall quiet, so that a half-written file is never read as
                // the whole source.
                let slot = &mut self.slots[index];
                let first = *slot.writing_since.get_or_insert(at);
                slot.read_at = Some((at + WRITE_QUIET).min(first + WRITE_QUIET_MAX));
            }
            FsEvent::Health(problem) => {
                self.file_watch = problem;
                return true;
            }
            // The server's, never sent here.
            FsEvent::Tls | FsEvent::Credentials => {}
        }
        false
    }

    /// Reads a `file:` or `dir:` source now; a read that failed is retried with backoff.
    fn read_local(&mut self, index: usize, at: Instant) {
        let slot = &mut self.slots[index];
        let result = slot.loader.load(&slot.source.spec);
        match &result {
            Err(error) if local::retryable(error) => {
                slot.read_retry.step_read(at);
                slot.read_at = slot.read_retry.until;
            }
            _ => slot.read_retry.clear(),
        }
        let event = match result {
            Ok(content) => SourceEvent::Content(content),
            Err(error) => SourceEvent::Failed(error),
        };
        self.on_update(Update { index, event, at });
    }

    fn on_update(&mut self, update: Update) {
        // Without usable credentials no cluster source can be read: a sync that cannot
        // happen, counted as such (once per change of the problem, as the source sends it).
        if let SourceEvent::Failed(e) | SourceEvent::WatchRestart(e) = &update.event
            && e.reason() == "credentials"
        {
            self.count_sync_error("credentials");
        }
        let slot = &mut self.slots[update.index];
        if slot.source.observe(update.event, &self.metrics) {
            self.pending_since.get_or_insert(update.at);
        }
    }

    /// One pass ([`Reconciler::pass`]); a pass over a large bundle then gives the memory it
    /// freed back to the system.
    fn reconcile(&mut self) {
        self.pass();
        crate::runtime::allocator::after_pass(
            self.desired.as_ref().map_or(0, |d| d.rendered.len()),
        );
    }

    /// Builds the bundle from the last good content of every source and makes the file
    /// hold it, unless nothing valid can be built, a source has never been read, or a
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
                self.retry_at = self.write_retry.until;
                self.publish(
                    Seen::Unreadable(problem.clone()),
                    Some(false),
                    Some(problem),
                );
                return;
            }
        };
        let all_read = self.slots.iter().all(|s| s.source.content.is_some());
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
                self.retry_at = Some(until);
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
                        self.recheck_at = Some(at + BUNDLE_SETTLE);
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
                        self.retry_at = self.write_retry.until;
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
                    self.retry_at = self.write_retry.until;
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
                self.retry_at = self.write_retry.until;
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
    fn in_sync_state(&self) -> Option<bool> {
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

    fn count_sync_error(&self, reason: &str) {
        let labels = FileReasonLabels {
            filepath: self.file.filepath.clone(),
            reason: reason.to_string(),
        };
        self.metrics.sync_errors.get_or_create(&labels).inc();
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

    /// Publishes the state of the file for health, metrics and systemd.
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
        let status = Status {
            kind: TargetKind::File,
            bundle_path: self.file.filepath.clone(),
            certificates,
            sha256: bytes.map(|b| Fingerprint::of(b).to_hex()),
            file_valid,
            file_problem,
            in_sync,
            sync_problem,
            sources: self.slots.iter().map(|s| s.source.status()).collect(),
            last_sync: self.last_sync,
            file_watch: self.file_watch.clone(),
            kubelet: Some(self.kubelet.seen().clone()),
        };
        self.notifier.status(&status.summary());
        self.notifier.ready(status.ready());
        self.status.send_replace(Arc::new(status));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repair_backoff_doubles_to_five_minutes_and_resets_after_ten_quiet_minutes() {
        let mut backoff = Backoff::default();
        let start = Instant::now();
        let mut at = start;
        let mut delays = Vec::new();
        for _ in 0..14 {
            backoff.step_repair(at);
            let until = backoff.until.unwrap();
            delays.push(until - at);
            assert_eq!(backoff.blocked(at), Some(until));
            assert_eq!(backoff.blocked(until), None);
            at = until;
        }
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            delays[..5],
            [ms(250), ms(500), ms(1000), ms(2000), ms(4000)]
        );
        assert_eq!(delays[10], Duration::from_secs(256));
        assert_eq!(delays[11..], [Duration::from_secs(300); 3]);
        // A fighter at full speed gets a handful of repairs a minute, not a busy loop.
        let in_first_minute = delays
            .iter()
            .scan(Duration::ZERO, |t, d| {
                *t += *d;
                Some(*t)
            })
            .filter(|t| *t <= Duration::from_secs(60))
            .count();
        assert_eq!(in_first_minute, 7);
        // Just under ten quiet minutes after the last repair, the streak goes on; after
        // them, it starts over.
        let last = backoff.last.unwrap();
        let mut still = backoff.clone();
        still.step(
            last + Duration::from_secs(599),
            REPAIR_FIRST,
            REPAIR_BACKOFF_MAX,
            REPAIR_STREAK_RESET,
        );
        assert_eq!(
            still.until.unwrap() - (last + Duration::from_secs(599)),
            Duration::from_secs(300)
        );
        let later = last + Duration::from_secs(600);
        backoff.step_repair(later);
        assert_eq!(backoff.until.unwrap() - later, ms(250));
    }

    #[test]
    fn failed_writes_and_read_retries_back_off_to_their_caps() {
        let mut backoff = Backoff::default();
        let mut at = Instant::now();
        let mut last = Duration::ZERO;
        for _ in 0..12 {
            backoff.step_write(at);
            last = backoff.until.unwrap() - at;
            at += last;
        }
        assert_eq!(last, Duration::from_secs(300));
        let mut reads = Backoff::default();
        let at = Instant::now();
        reads.step_read(at);
        assert_eq!(reads.until.unwrap() - at, Duration::from_secs(1));
        for _ in 0..10 {
            reads.step_read(at);
        }
        assert_eq!(reads.until.unwrap() - at, Duration::from_secs(60));
    }

    const GOAL: &[u8] = b"the bundle";

    fn regular(bytes: &[u8], mode: u32, owner: (u32, u32)) -> OnDisk {
        OnDisk::Regular {
            bytes: bytes.to_vec(),
            stat: Stat {
                dev: 1,
                ino: 2,
                mode,
                uid: owner.0,
                gid: owner.1,
            },
        }
    }

    fn facts<'a>(
        on_disk: &'a OnDisk,
        last_written: Option<&[u8]>,
        write_failed: Option<&[u8]>,
    ) -> Facts<'a> {
        Facts {
            goal: GOAL,
            on_disk,
            mode: 0o644,
            owner: Some((0, 0)),
            last_written: last_written.map(Fingerprint::of),
            write_failed: write_failed.map(Fingerprint::of),
        }
    }

    #[test]
    fn a_file_as_it_should_be_is_left_alone() {
        let now = Instant::now();
        let on_disk = regular(GOAL, 0o644, (0, 0));
        let idle = Backoff::default();
        assert_eq!(
            decide(&facts(&on_disk, Some(GOAL), None), &idle, &idle, now),
            Action::InSync
        );
        // Not root: the owner is not ours to check.
        let theirs = regular(GOAL, 0o644, (1000, 1000));
        let mut f = facts(&theirs, None, None);
        f.owner = None;
        assert_eq!(decide(&f, &idle, &idle, now), Action::InSync);
    }

    #[test]
    fn a_new_bundle_is_written_at_once_even_while_repairs_back_off() {
        let now = Instant::now();
        let mut repairing = Backoff::default();
        repairing.step_repair(now);
        let idle = Backoff::default();
        let old = regular(b"the old bundle", 0o644, (0, 0));
        assert_eq!(
            decide(
                &facts(&old, Some(b"the old bundle"), None),
                &repairing,
                &idle,
                now
            ),
            Action::Write { repair: false }
        );
        for missing in [
            OnDisk::Missing,
            OnDisk::Other(FileKind::Symlink),
            OnDisk::Other(FileKind::Fifo),
        ] {
            assert_eq!(
                decide(&facts(&missing, None, None), &idle, &idle, now),
                Action::Write { repair: false }
            );
        }
    }

    #[test]
    fn drift_from_the_bundle_written_is_repaired_with_backoff() {
        let now = Instant::now();
        let idle = Backoff::default();
        let tampered = regular(b"garbage", 0o644, (0, 0));
        assert_eq!(
            decide(&facts(&tampered, Some(GOAL), None), &idle, &idle, now),
            Action::Write { repair: true }
        );
        let link = OnDisk::Other(FileKind::Symlink);
        assert_eq!(
            decide(&facts(&link, Some(GOAL), None), &idle, &idle, now),
            Action::Write { repair: true }
        );
        let mut repairing = Backoff::default();
        repairing.step_repair(now);
        let until = repairing.until.unwrap();
        assert!(matches!(
            decide(&facts(&tampered, Some(GOAL), None), &repairing, &idle, now),
            Action::Wait { until: u, .. } if u == until
        ));
        assert_eq!(
            decide(
                &facts(&tampered, Some(GOAL), None),
                &repairing,
                &idle,
                until
            ),
            Action::Write { repair: true }
        );
    }

    #[test]
    fn mode_and_owner_drift_is_repaired_in_place_under_the_same_backoff() {
        let now = Instant::now();
        let idle = Backoff::default();
        for drifted in [
            regular(GOAL, 0o666, (0, 0)),
            regular(GOAL, 0o644, (65534, 65534)),
        ] {
            assert_eq!(
                decide(&facts(&drifted, Some(GOAL), None), &idle, &idle, now),
                Action::RepairAttributes
            );
            let mut repairing = Backoff::default();
            repairing.step_repair(now);
            assert!(matches!(
                decide(&facts(&drifted, Some(GOAL), None), &repairing, &idle, now),
                Action::Wait { .. }
            ));
        }
    }

    #[test]
    fn a_directory_at_the_path_is_never_written_over_whatever_the_backoffs_say() {
        let now = Instant::now();
        let idle = Backoff::default();
        let mut busy = Backoff::default();
        busy.step_write(now);
        let directory = OnDisk::Other(FileKind::Directory);
        for (last_written, write_failed, backoff) in [
            (None, None, &idle),
            (Some(GOAL), None, &idle),
            (Some(GOAL), Some(GOAL), &busy),
        ] {
            assert_eq!(
                decide(
                    &facts(&directory, last_written, write_failed),
                    backoff,
                    backoff,
                    now
                ),
                Action::CannotReplace
            );
        }
    }

    #[test]
    fn a_failed_write_waits_for_its_retry_but_a_different_bundle_does_not() {
        let now = Instant::now();
        let idle = Backoff::default();
        let mut retrying = Backoff::default();
        retrying.step_write(now);
        let old = regular(b"old", 0o644, (0, 0));
        assert!(matches!(
            decide(&facts(&old, Some(b"old"), Some(GOAL)), &idle, &retrying, now),
            Action::Wait { problem, .. } if problem.contains("write failed")
        ));
        assert_eq!(
            decide(
                &facts(&old, Some(b"old"), Some(b"another bundle")),
                &idle,
                &retrying,
                now
            ),
            Action::Write { repair: false }
        );
        assert_eq!(
            decide(
                &facts(&old, Some(b"old"), Some(GOAL)),
                &idle,
                &retrying,
                retrying.until.unwrap()
            ),
            Action::Write { repair: false }
        );
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    #[test]
    fn a_cleared_backoff_lets_the_next_attempt_through_and_starts_over() {
        let now = Instant::now();
        let mut backoff = Backoff::default();
        for _ in 0..4 {
            backoff.step_write(now);
        }
        assert!(backoff.blocked(now).is_some());
        backoff.clear();
        assert_eq!(backoff.blocked(now), None);
        backoff.step_write(now);
        assert_eq!(backoff.until, Some(now + WRITE_RETRY_FIRST));
    }
}

#[cfg(test)]
mod loop_tests {
    use clap::Parser;
    use tokio::signal::unix::{SignalKind, signal};

    use super::*;
    use crate::bundle::test_certs;
    use crate::cli::{Cli, Command};

    /// A reconciler over one `file:` source holding `source` (None: a FIFO, which is never
    /// opened: an unreadable source), with its bundle in `dir`.
    fn reconciler_for(
        dir: &std::path::Path,
        source: Option<&[u8]>,
    ) -> (Reconciler, watch::Receiver<Arc<Status>>) {
        let path = dir.join("source.pem");
        match source {
            Some(bytes) => std::fs::write(&path, bytes).unwrap(),
            None => {
                nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()
            }
        }
        let cli = Cli::try_parse_from([
            "kubelet-ca-agent".to_string(),
            "run".to_string(),
            format!("--source=file:{}", path.display()),
            format!("--bundle={}", dir.join("kubelet-ca.crt").display()),
            format!("--state-dir={}", dir.join("state").display()),
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("parsed as another command");
        };
        let (status, status_rx) = watch::channel(Arc::default());
        (
            Reconciler::new(&args.common, Arc::default(), status),
            status_rx,
        )
    }

    /// An unreadable source is read again from 1 s, doubling to a minute, and then every
    /// minute for as long as it stays unreadable (not back to 1 s); a source that reads but
    /// is rejected is not read again until it changes (only a change can fix it).
    #[test]
    fn reads_are_retried_to_a_minute_and_stay_there_but_rejected_content_is_not_retried() {
        let dir = tempfile::tempdir().unwrap();
        let (mut reconciler, _status) = reconciler_for(dir.path(), None);
        let start = Instant::now();
        let mut at = start;
        let mut delays = Vec::new();
        for _ in 0..12 {
            reconciler.read_local(0, at);
            let next = reconciler.slots[0].read_at.expect("a retry is scheduled");
            delays.push((next - at).as_secs());
            at = next;
        }
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60]);

        let dir = tempfile::tempdir().unwrap();
        let (mut reconciler, _status) = reconciler_for(dir.path(), Some(b"not a certificate"));
        reconciler.read_local(0, Instant::now());
        assert!(!reconciler.slots[0].source.up);
        assert_eq!(
            reconciler.slots[0].read_at, None,
            "rejected content is retried"
        );
    }

    /// The kubelet's config is read off the loop at start and again at each
    /// re-verification, and health follows what it says.
    #[test]
    fn the_kubelet_config_is_read_again_at_each_re_verification() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let pem = test_certs::ca(Some("signer"), None, now - 60, now + 86400)
            .pem()
            .to_vec();
        let (mut reconciler, status_rx) = reconciler_for(dir.path(), Some(&pem));
        let config = dir.path().join("config.yaml");
        let names = |file: &str| {
            let yaml = format!(
                "kind: KubeletConfiguration\nauthentication:\n  x509:\n    clientCAFile: {file}\n"
            );
            std::fs::write(&config, yaml).unwrap();
        };
        names("/etc/kubernetes/pki/ca.crt");
        reconciler.kubelet =
            kubelet_config::Reader::new(vec![config.clone()], dir.path().join("kubelet-ca.crt"));
        let mut reads = reconciler.kubelet.take_results();
        let uses =
            |rx: &watch::Receiver<Arc<Status>>| rx.borrow().kubelet.as_ref().and_then(|k| k.uses());
        reconciler.start();
        assert_eq!(uses(&status_rx), None, "judged before it was read");
        assert!(reconciler.kubelet.found(reads.blocking_recv().unwrap()));
        reconciler.reconcile();
        assert_eq!(uses(&status_rx), Some(false));

        names("kubelet-ca.crt");
        // Not read again before the re-verification is due...
        assert!(!reconciler.take_due(Instant::now()));
        assert!(reads.try_recv().is_err());
        // ...and read again when it is.
        let due = reconciler.verify_at;
        assert!(reconciler.take_due(due));
        assert!(reconciler.kubelet.found(reads.blocking_recv().unwrap()));
        reconciler.reconcile();
        assert_eq!(uses(&status_rx), Some(true));
        assert_eq!(reconciler.verify_at, due + VERIFY_EVERY);
    }

    /// A burst of file events costs one pass, and a pass one of them calls for is not lost
    /// to a later one in the same burst that alone would wait: here inotify comes up (the
    /// file-watch check must turn at once) while a source is being written in place (read
    /// after a quiet second).
    #[tokio::test(start_paused = true)]
    async fn a_burst_of_file_events_does_not_lose_the_pass_one_of_them_needs() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let pem = test_certs::ca(Some("signer"), None, now - 60, now + 86400)
            .pem()
            .to_vec();
        let bundle = dir.path().join("kubelet-ca.crt");
        let (mut reconciler, status_rx) = reconciler_for(dir.path(), Some(&pem));
        reconciler.start();
        assert_eq!(std::fs::read(&bundle).unwrap(), pem);
        assert!(
            status_rx.borrow().file_watch.is_some(),
            "inotify not up yet"
        );

        let (_updates_tx, updates) = mpsc::unbounded_channel();
        let (files_tx, files) = mpsc::unbounded_channel();
        files_tx.send(FsEvent::Health(None)).unwrap();
        files_tx
            .send(FsEvent::Source {
                index: 0,
                settled: false,
            })
            .unwrap();
        let (_liveness, pongs) = crate::server::liveness();
        let inputs = Inputs {
            updates,
            files,
            pongs,
            sigterm: signal(SignalKind::terminate()).unwrap(),
            sigint: signal(SignalKind::interrupt()).unwrap(),
        };
        // Paused time: the loop runs until it waits, then the clock jumps to the earliest
        // timer, this one, well before the source's quiet second is up.
        let _ = tokio::time::timeout(WRITE_QUIET / 2, reconciler.run(inputs)).await;
        let file_watch = status_rx.borrow().file_watch.clone();
        assert_eq!(
            file_watch, None,
            "the file-watch check waited for the source being written"
        );
    }
}
