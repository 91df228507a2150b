//! The reconciliation loop: the one owner of the agent's state. Each input (a source
//! update, a change on disk, a timer, a signal) updates the state of the managed file it
//! concerns ([`super::managed`]), and a pass then brings each file that called for one in
//! line with its sources; the outcome is published for health, metrics and systemd.
//!
//! What a pass does to a file is decided by [`decide`], a pure function of what the loop
//! knows and what is on disk, so that every policy (repair, back off, retry) is tested
//! without a process, a clock or a disk.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::signal::unix::Signal;
use tokio::sync::{mpsc, watch};
use tokio::time::sleep_until;

use super::managed::Managed;
use super::registries::{RegistrySet, RegistryUpdate};
use super::schedule::Schedule;
use crate::bundle::Fingerprint;
use crate::cli::CommonArgs;
use crate::exec::Hooks;
use crate::files::FsEvent;
use crate::fsutil::FileKind;
use crate::kubelet_config;
use crate::metrics::{Metrics, RecordLabels};
use crate::registry::CreatedRecord;
use crate::server::Pongs;
use crate::source::cluster::Update;
use crate::state::Book;
use crate::status::Status;
use crate::systemd::Notifier;
use crate::target::Target;
use crate::writer::OnDisk;

/// The managed file: a writer's create+write+close arrive as one change.
pub(super) const BUNDLE_SETTLE: Duration = Duration::from_millis(5);
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
pub(super) const BOUNDARY_RECHECK_MAX: Duration = Duration::from_secs(3600);

/// The channels the loop reads.
pub struct Inputs {
    pub updates: mpsc::UnboundedReceiver<Update>,
    /// The registry sets' cluster sources.
    pub registry_updates: mpsc::UnboundedReceiver<RegistryUpdate>,
    pub files: mpsc::UnboundedReceiver<FsEvent>,
    /// Liveness pings from the HTTP server, answered between passes.
    pub pongs: Pongs,
    /// SIGTERM and SIGINT, registered before the first pass, so that a signal during start
    /// also ends in a clean exit.
    pub sigterm: Signal,
    pub sigint: Signal,
}

/// A delay that doubles on every use in a row, up to a cap.
#[derive(Debug, Default, Clone)]
pub(super) struct Backoff {
    /// Not before this instant.
    pub(super) until: Option<Instant>,
    /// How many times in a row it was applied.
    streak: u32,
    last: Option<Instant>,
}

impl Backoff {
    pub(super) fn blocked(&self, now: Instant) -> Option<Instant> {
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

    pub(super) fn clear(&mut self) {
        *self = Backoff::default();
    }

    /// A failed write, an unreadable bundle path, or a mode or owner that could not be put
    /// back: 1 s doubling to 5 minutes, starting over after 10 quiet minutes.
    pub(super) fn step_write(&mut self, at: Instant) {
        self.step(at, WRITE_RETRY_FIRST, WRITE_RETRY_MAX, WRITE_RETRY_MAX * 2);
    }

    /// A local source that could not be read: 1 s doubling to a minute, starting over after
    /// two quiet minutes.
    pub(super) fn step_read(&mut self, at: Instant) {
        self.step(at, READ_RETRY_FIRST, READ_RETRY_MAX, READ_RETRY_MAX * 2);
    }

    /// A repair: 250 ms doubling to 5 minutes, starting over after 10 quiet minutes.
    pub(super) fn step_repair(&mut self, at: Instant) {
        self.step(at, REPAIR_FIRST, REPAIR_BACKOFF_MAX, REPAIR_STREAK_RESET);
    }
}

/// What a pass knows when it decides what to do with the file.
pub(super) struct Facts<'a> {
    /// The bytes the file should hold.
    pub(super) goal: &'a [u8],
    pub(super) on_disk: &'a OnDisk,
    /// `--file-mode`, and the owner the file should have (only when running as root).
    pub(super) mode: u32,
    pub(super) owner: Option<(u32, u32)>,
    /// The bundle this agent last wrote or adopted.
    pub(super) last_written: Option<Fingerprint>,
    /// The bundle whose last write failed.
    pub(super) write_failed: Option<Fingerprint>,
}

/// What a pass does with the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Action {
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
pub(super) const WRITE_RETRY_WAIT: &str = "the last write failed; retrying with backoff";

/// The policy of a pass: repair drift at once but back off from a writer that keeps
/// fighting, retry a failed write with backoff (a new bundle at once), and never touch a
/// file that already holds the goal as it should.
pub(super) fn decide(
    facts: &Facts,
    repair: &Backoff,
    write_retry: &Backoff,
    now: Instant,
) -> Action {
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
pub(super) enum Seen<'a> {
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

/// The loop's state: the managed files, and what is the loop's own (the re-verification,
/// the watcher's health, the kubelet's view of the bundle, what systemd is told).
pub struct Reconciler {
    /// `--bundle` first, then each `--manage` file.
    files: Vec<Managed>,
    /// Each `--manage-registries` set.
    sets: Vec<RegistrySet>,
    /// What the agent created under the registry sets' directories.
    created: CreatedRecord,
    /// The record as last saved: a save that failed is tried again after each pass.
    saved: CreatedRecord,
    /// Why the record found at start could not be read: it is then never written over, and
    /// nothing the agent did not record creating this run is removed.
    record_unreadable: Option<String>,
    book: Book,
    /// The next re-verification of the files and the local sources.
    verify_at: Instant,
    /// What inotify does not watch, as the watcher last reported.
    file_watch: Option<String>,
    /// Whether the kubelet's config names the bundle, read off the loop.
    kubelet: kubelet_config::Reader,
    status: watch::Sender<Arc<Status>>,
    notifier: Notifier,
}

impl Reconciler {
    pub fn new(
        common: &CommonArgs,
        metrics: Arc<Metrics>,
        status: watch::Sender<Arc<Status>>,
    ) -> Self {
        metrics.init_records();
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
        // One book of managed-files.json for every file; each file's records on a thread
        // of its own.
        let book = Book::open_with_sets(
            &common.state_dir,
            &common.managed_paths(),
            &common.registry_dirs(),
        );
        let target = |path: &std::path::Path| {
            let failures = metrics.clone();
            Target::for_file(common, path, book.clone()).with_background_records(move |record| {
                failures
                    .state_errors
                    .get_or_create(&RecordLabels {
                        record: record.to_string(),
                    })
                    .inc();
            })
        };
        let mut files = vec![Managed::new(
            true,
            target(&common.bundle),
            &common.sources,
            0,
            common.policy(),
            hooks,
            metrics.clone(),
        )];
        let mut first = common.sources.len();
        for manage in &common.manage {
            files.push(Managed::new(
                false,
                target(&manage.path),
                &manage.sources,
                first,
                common.policy(),
                None,
                metrics.clone(),
            ));
            first += manage.sources.len();
        }
        let mut sets = Vec::new();
        for set in &common.manage_registries {
            sets.push(RegistrySet::new(
                &set.dir,
                &set.sources,
                first,
                metrics.clone(),
                book.clone(),
                &common.state_dir,
            ));
            first += set.sources.len();
        }
        let (created, record_unreadable) = book.state_dir().load_registry_record();
        if let Some(problem) = &record_unreadable {
            tracing::warn!(
                "cannot read the record of created registry files ({problem}): it is left as it is, and nothing under the registry directories is removed but what this run creates"
            );
        }
        Reconciler {
            files,
            sets,
            saved: created.clone(),
            created,
            record_unreadable,
            book,
            verify_at: Instant::now() + VERIFY_EVERY,
            file_watch: Some("not started yet".to_string()),
            kubelet: kubelet_config::Reader::new(
                kubelet_config::paths_for(None),
                common.bundle.clone(),
            ),
            status,
            notifier: Notifier::default(),
        }
    }

    /// Adopts what is on disk, reads the local sources, and runs the first pass of every
    /// file. No API call happens here, so a valid file makes the agent ready at once.
    pub fn start(&mut self) {
        self.kubelet.request(Instant::now());
        for file in &mut self.files {
            file.start();
        }
        for set in &mut self.sets {
            set.start(&mut self.created);
        }
        self.save_record();
        self.publish();
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
            let deadline = [Some(boundary_at), Some(self.verify_at), next_watchdog]
                .into_iter()
                .chain(self.files.iter().map(|f| f.schedule.next_due()))
                .chain(self.sets.iter().map(|s| s.schedule.next_due()))
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
                Some(update) = inputs.registry_updates.recv() => { self.on_registry_update(update); work = true; }
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
            while let Ok(update) = inputs.registry_updates.try_recv() {
                self.on_registry_update(update);
                work = true;
            }
            while let Ok(event) = inputs.files.try_recv() {
                work |= self.on_file_event(event);
            }
            let now = Instant::now();
            work |= self.take_due(now);
            // A certificate boundary is a pass: readiness and the file follow validity.
            if now >= boundary_at {
                self.all_due();
                work = true;
            }
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

    /// Every file calls for a pass.
    fn all_due(&mut self) {
        for schedule in self.schedules() {
            schedule.due = true;
        }
    }

    /// Does what is due at `now`: the re-verification, the reads of local sources, a recheck
    /// of a file, a retry. True when a pass is called for.
    fn take_due(&mut self, now: Instant) -> bool {
        let mut work = false;
        if self.verify_at <= now {
            // The safety net: whatever inotify said, look at every local source and (in the
            // pass that follows) at every file. The kubelet's config is read again too, off
            // the loop: what it finds comes back as an input of its own.
            self.verify_at = now + VERIFY_EVERY;
            self.kubelet.request(now);
            for schedule in self.schedules() {
                schedule.read_local_sources_at(now);
            }
            self.all_due();
            work = true;
        }
        for file in &mut self.files {
            work |= file.take_due(now);
        }
        for set in &mut self.sets {
            work |= set.take_due(now);
        }
        work
    }

    /// The registry set, and its slot, of the loop's source `index`.
    fn set_source(&mut self, index: usize) -> Option<(&mut RegistrySet, usize)> {
        self.sets
            .iter_mut()
            .find_map(|set| set.schedule.source(index).map(|local| (set, local)))
    }

    fn on_registry_update(&mut self, update: RegistryUpdate) {
        if let Some((set, local)) = self.set_source(update.index) {
            set.on_update(local, update.event, update.at);
        }
    }

    /// The file, and its position among the file's sources, of the loop's source `index`.
    fn source(&mut self, index: usize) -> Option<(&mut Managed, usize)> {
        self.files
            .iter_mut()
            .find_map(|file| file.schedule.source(index).map(|local| (file, local)))
    }

    /// The schedule of every target: each file, then each registry set.
    fn schedules(&mut self) -> impl Iterator<Item = &mut Schedule> {
        self.files
            .iter_mut()
            .map(|f| &mut f.schedule)
            .chain(self.sets.iter_mut().map(|s| &mut s.schedule))
    }

    /// Takes a change on disk into account; true when it calls for a pass now.
    fn on_file_event(&mut self, event: FsEvent) -> bool {
        let at = Instant::now();
        match event {
            FsEvent::Bundle(index) => {
                if let Some(file) = self.files.get_mut(index) {
                    file.schedule.recheck_at.get_or_insert(at + BUNDLE_SETTLE);
                }
            }
            FsEvent::Registries(index) => {
                if let Some(set) = self.sets.get_mut(index) {
                    set.schedule.recheck_at.get_or_insert(at + BUNDLE_SETTLE);
                }
            }
            FsEvent::Rescan => {
                tracing::info!("looking at the managed files and the local sources again");
                for schedule in self.schedules() {
                    schedule.recheck_at.get_or_insert(at + BUNDLE_SETTLE);
                    schedule.read_local_sources_at(at);
                }
            }
            FsEvent::Source { index, settled } => {
                let source = self
                    .schedules()
                    .find_map(|s| s.source(index).map(|local| (s, local)));
                if let Some((schedule, local)) = source {
                    schedule.changed(local, at, settled);
                }
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

    fn on_update(&mut self, update: Update) {
        if let Some((file, local)) = self.source(update.index) {
            file.on_update(local, update.event, update.at);
        }
    }

    /// A pass over each file that calls for one; a pass over a large bundle then gives the
    /// memory it freed back to the system. Then the state is published.
    fn reconcile(&mut self) {
        let mut largest = 0;
        for file in self.files.iter_mut().filter(|f| f.schedule.due) {
            file.reconcile();
            largest = largest.max(file.built_len());
        }
        for set in self.sets.iter_mut().filter(|s| s.schedule.due) {
            set.reconcile(&mut self.created);
        }
        self.save_record();
        crate::runtime::allocator::after_pass(largest);
        self.publish();
    }

    /// Saves the record of created registry files when it differs from the one saved
    /// (a save that failed is tried again after the next pass); never over a record that
    /// could not be read at start.
    fn save_record(&mut self) {
        if self.created == self.saved || self.record_unreadable.is_some() {
            return;
        }
        match self.book.state_dir().save_registry_record(&self.created) {
            Ok(()) => self.saved = self.created.clone(),
            Err(e) => tracing::error!(
                "cannot save the record of created registry files: {e}; trying again after the next pass (until then, what was created since would be left behind if the agent stopped)"
            ),
        }
    }

    /// Time until the next instant a file's validity can change.
    fn next_boundary(&self) -> Duration {
        self.files
            .iter()
            .map(Managed::next_boundary)
            .chain(self.sets.iter().map(RegistrySet::next_boundary))
            .min()
            .unwrap_or(BOUNDARY_RECHECK_MAX)
    }

    /// Publishes the state of every file for health and metrics; systemd hears of the
    /// bundle alone (`READY=1` never waits for another file).
    fn publish(&mut self) {
        let (bundle, others) = self.files.split_first().expect("the bundle is a file");
        let status = Status {
            file_watch: self.file_watch.clone(),
            kubelet: Some(self.kubelet.seen().clone()),
            others: others
                .iter()
                .map(|f| f.status.clone())
                .chain(self.sets.iter().flat_map(|s| s.statuses.iter().cloned()))
                .collect(),
            notes: self
                .sets
                .iter()
                .map(|s| (format!("registries:{}", s.root().display()), s.note.clone()))
                .collect(),
            other_sources: self.sets.iter().flat_map(|s| s.sources()).collect(),
            ..bundle.status.clone()
        };
        self.notifier.status(&status.summary());
        self.notifier.ready(status.ready());
        self.status.send_replace(Arc::new(status));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsutil::Stat;

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

    use time::OffsetDateTime;

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

    /// The re-verification reads every local source again, of every managed file, whatever
    /// inotify said; a cluster source is left to its watch.
    #[test]
    fn the_re_verification_reads_each_files_local_sources_again_and_only_those() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let pem = |cn: &str| {
            test_certs::ca(Some(cn), None, now - 60, now + 86400)
                .pem()
                .to_vec()
        };
        let (bundle_source, cloud_source) = (dir.path().join("a.pem"), dir.path().join("b.pem"));
        std::fs::write(&bundle_source, pem("a")).unwrap();
        std::fs::write(&cloud_source, pem("b")).unwrap();
        let cli = Cli::try_parse_from([
            "kubelet-ca-agent".to_string(),
            "run".to_string(),
            format!(
                "--source=file:{},configmap:ns/name",
                bundle_source.display()
            ),
            format!(
                "--manage={}=file:{}",
                dir.path().join("cloud.pem").display(),
                cloud_source.display()
            ),
            format!("--bundle={}", dir.path().join("kubelet-ca.crt").display()),
            format!("--state-dir={}", dir.path().join("state").display()),
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("parsed as another command");
        };
        let (status, _status_rx) = watch::channel(Arc::default());
        let mut reconciler = Reconciler::new(&args.common, Arc::default(), status);
        reconciler.start();
        let content = |r: &Reconciler, file: usize, slot: usize| {
            r.files[file].slots[slot]
                .source
                .content
                .as_ref()
                .map(|c| c.certificates[0].subject_cn.clone())
        };
        assert_eq!(content(&reconciler, 1, 0).as_deref(), Some("b"));

        // Changed with no event: not seen before the re-verification...
        std::fs::write(&bundle_source, pem("a2")).unwrap();
        std::fs::write(&cloud_source, pem("b2")).unwrap();
        assert!(!reconciler.take_due(Instant::now()));
        assert_eq!(content(&reconciler, 1, 0).as_deref(), Some("b"));
        // ...and read, in every file, when it is due; the cluster source is not read.
        let due = reconciler.verify_at;
        assert!(reconciler.take_due(due));
        assert_eq!(content(&reconciler, 0, 0).as_deref(), Some("a2"));
        assert_eq!(content(&reconciler, 1, 0).as_deref(), Some("b2"));
        assert_eq!(reconciler.files[0].schedule.read_at(1), None);
        assert!(reconciler.files[0].slots[1].source.content.is_none());
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
            reconciler.files[0].read_local(0, at);
            let next = reconciler.files[0]
                .schedule
                .read_at(0)
                .expect("a retry is scheduled");
            delays.push((next - at).as_secs());
            at = next;
        }
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60]);

        let dir = tempfile::tempdir().unwrap();
        let (mut reconciler, _status) = reconciler_for(dir.path(), Some(b"not a certificate"));
        reconciler.files[0].read_local(0, Instant::now());
        assert!(!reconciler.files[0].slots[0].source.up);
        assert_eq!(
            reconciler.files[0].schedule.read_at(0),
            None,
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
        let (_registry_tx, registry_updates) = mpsc::unbounded_channel();
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
            registry_updates,
            files,
            pongs,
            sigterm: signal(SignalKind::terminate()).unwrap(),
            sigint: signal(SignalKind::interrupt()).unwrap(),
        };
        // Paused time: the loop runs until it waits, then the clock jumps to the earliest
        // timer, this one, well before the source's quiet second is up.
        let _ = tokio::time::timeout(
            crate::daemon::schedule::WRITE_QUIET / 2,
            reconciler.run(inputs),
        )
        .await;
        let file_watch = status_rx.borrow().file_watch.clone();
        assert_eq!(
            file_watch, None,
            "the file-watch check waited for the source being written"
        );
    }
}
