//! The reconciliation loop: the one owner of the agent's state. Each input (a source
//! update, a change on disk, a timer, a signal) goes to the target it concerns (a
//! [`Kept`]: the bundle, a `--manage` file, a registry set), and a pass then brings each
//! target that called for one in line with its sources; the outcome is published for
//! health, metrics and systemd. The loop knows no kind of target: what a pass does is the
//! target's own (for a file, [`crate::targets::policy::decide`], a pure function of what
//! the loop knows and what is on disk).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::signal::unix::Signal;
use tokio::sync::{mpsc, watch};
use tokio::time::sleep_until;

use crate::config;
use crate::files::FsEvent;
use crate::kubelet_config;
use crate::metrics::Metrics;
use crate::registry::CreatedRecord;
use crate::server::Pongs;
use crate::source::cluster::Update;
use crate::state::Book;
use crate::status::Status;
use crate::systemd::Notifier;
use crate::targets::policy::{BOUNDARY_RECHECK_MAX, BUNDLE_SETTLE};
use crate::targets::schedule::Schedule;
use crate::targets::{self, Kept, Report};

/// The managed file and every local source are looked at again this often, whatever
/// inotify says (the kubelet's own CA reloader does the same): a missed event costs at
/// most this much drift.
pub const VERIFY_EVERY: Duration = Duration::from_secs(60);

/// The channels the loop reads.
pub struct Inputs {
    /// The cluster sources' news, for every target.
    pub updates: mpsc::UnboundedReceiver<Update>,
    pub files: mpsc::UnboundedReceiver<FsEvent>,
    /// Liveness pings from the HTTP server, answered between passes.
    pub pongs: Pongs,
    /// SIGTERM and SIGINT, registered before the first pass, so that a signal during start
    /// also ends in a clean exit.
    pub sigterm: Signal,
    pub sigint: Signal,
    /// Why the confinement no longer covers what the agent needs (a place replaced or new
    /// since start): the loop ends with that error, after the pass in progress, so that the
    /// supervisor starts a new agent, confined anew.
    pub outgrown: mpsc::UnboundedReceiver<String>,
}

/// The loop's state: the targets, and what is the loop's own (the re-verification,
/// the watcher's health, the kubelet's view of the bundle, what systemd is told).
pub struct Reconciler {
    /// `--bundle` first, then each `--manage` file, then each `--manage-registries` set
    /// ([`targets::all`]).
    targets: Vec<Box<dyn Kept>>,
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
    /// Targets whose work off the loop is done and calls for their pass (by position).
    wakes: mpsc::UnboundedReceiver<usize>,
    /// Kept so that the channel stays open while no target holds a sender.
    _wakes_tx: mpsc::UnboundedSender<usize>,
}

impl Reconciler {
    pub fn new(
        common: &config::Common,
        metrics: Arc<Metrics>,
        status: watch::Sender<Arc<Status>>,
    ) -> Self {
        metrics.init_records();
        // One book of managed-files.json for every target.
        let book = Book::open_with_sets(
            &common.state_dir,
            &common.managed_paths(),
            &common.registry_dirs(),
        )
        .with_kubeconfigs(&common.kubeconfig_paths());
        let (wakes_tx, wakes) = mpsc::unbounded_channel();
        let targets = targets::all(common, &metrics, &book, &wakes_tx);
        let (created, record_unreadable) = book.state_dir().load_registry_record();
        if let Some(problem) = &record_unreadable {
            tracing::warn!(
                "cannot read the record of created registry files ({problem}): it is left as it is, and nothing under the registry directories is removed but what this run creates"
            );
        }
        Reconciler {
            targets,
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
            wakes,
            _wakes_tx: wakes_tx,
        }
    }

    /// Adopts what is on disk, reads the local sources, and runs the first pass of every
    /// file. No API call happens here, so a valid file makes the agent ready at once.
    pub fn start(&mut self) {
        self.kubelet.request(Instant::now());
        for target in &mut self.targets {
            target.start(&mut self.created);
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
        let mut ended = Ok(());
        loop {
            let boundary_at = Instant::now() + self.next_boundary();
            let deadline = [Some(boundary_at), Some(self.verify_at), next_watchdog]
                .into_iter()
                .chain(self.targets.iter().map(|t| t.schedule().next_due()))
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
                Some(index) = self.wakes.recv() => work |= self.wake(index),
                Some(()) = inputs.pongs.pings.recv() => { inputs.pongs.answer(); continue; }
                _ = sleep_until(deadline.into()) => {}
                _ = inputs.sigterm.recv() => { tracing::info!("SIGTERM: stopping"); break; }
                _ = inputs.sigint.recv() => { tracing::info!("SIGINT: stopping"); break; }
                Some(why) = inputs.outgrown.recv() => {
                    ended = Err(anyhow::anyhow!(
                        "the agent's confinement no longer covers what it needs: {why}; exiting so that its supervisor (systemd, the kubelet) starts it again, confined to what is there now"
                    ));
                    break;
                }
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
        ended
    }

    /// Target `index` finished work off the loop: it calls for a pass.
    fn wake(&mut self, index: usize) -> bool {
        match self.targets.get_mut(index) {
            Some(target) => {
                target.schedule_mut().due = true;
                true
            }
            None => false,
        }
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
        for target in &mut self.targets {
            work |= target.take_due(now);
        }
        work
    }

    /// The target, and the source's position among its sources, of the loop's source
    /// `index`.
    fn source(&mut self, index: usize) -> Option<(&mut Box<dyn Kept>, usize)> {
        self.targets
            .iter_mut()
            .find_map(|t| t.schedule().source(index).map(|local| (t, local)))
    }

    /// The schedule of every target.
    fn schedules(&mut self) -> impl Iterator<Item = &mut Schedule> {
        self.targets.iter_mut().map(|t| t.schedule_mut())
    }

    /// Takes a change on disk into account; true when it calls for a pass now.
    fn on_file_event(&mut self, event: FsEvent) -> bool {
        let at = Instant::now();
        match event {
            FsEvent::Target(index) => {
                if let Some(target) = self.targets.get_mut(index) {
                    target
                        .schedule_mut()
                        .recheck_at
                        .get_or_insert(at + BUNDLE_SETTLE);
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
        if let Some((target, local)) = self.source(update.index) {
            target.on_update(local, update.event, update.at);
        }
    }

    /// A pass over each target that calls for one; a pass over a large bundle then gives
    /// the memory it freed back to the system. Then the state is published.
    fn reconcile(&mut self) {
        let mut largest = 0;
        for target in self.targets.iter_mut().filter(|t| t.schedule().due) {
            target.reconcile(&mut self.created);
            largest = largest.max(target.built_len());
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

    /// Time until the next instant a target's validity can change.
    fn next_boundary(&self) -> Duration {
        self.targets
            .iter()
            .map(|t| t.next_boundary())
            .min()
            .unwrap_or(BOUNDARY_RECHECK_MAX)
    }

    /// Publishes the state of every target for health and metrics; systemd hears of the
    /// bundle alone (`READY=1` never waits for another target).
    fn publish(&mut self) {
        let mut report = Report::default();
        for target in &self.targets {
            target.report(&mut report);
        }
        let status = Status {
            file_watch: self.file_watch.clone(),
            kubelet: Some(self.kubelet.seen().clone()),
            ..report.into_status()
        };
        self.notifier.status(&status.summary());
        self.notifier.ready(status.ready());
        self.status.send_replace(Arc::new(status));
    }
}

#[cfg(test)]
mod loop_tests {
    use tokio::signal::unix::{SignalKind, signal};

    use time::OffsetDateTime;

    use super::*;
    use crate::bundle::test_certs;
    use crate::targets::file::Managed;

    impl Reconciler {
        /// The target at `index`, which is a file.
        fn file(&mut self, index: usize) -> &mut Managed {
            self.targets[index]
                .as_any_mut()
                .downcast_mut()
                .expect("a file")
        }
    }

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
        let common = config::Common::for_tests(
            &dir.join("kubelet-ca.crt"),
            &dir.join("state"),
            vec![format!("file:{}", path.display()).parse().unwrap()],
        );
        let (status, status_rx) = watch::channel(Arc::default());
        (Reconciler::new(&common, Arc::default(), status), status_rx)
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
        let mut common = config::Common::for_tests(
            &dir.path().join("kubelet-ca.crt"),
            &dir.path().join("state"),
            vec![
                format!("file:{}", bundle_source.display()).parse().unwrap(),
                "configmap:ns/name".parse().unwrap(),
            ],
        );
        common.manage = vec![config::ManageSpec {
            path: dir.path().join("cloud.pem"),
            sources: vec![format!("file:{}", cloud_source.display()).parse().unwrap()],
        }];
        let (status, _status_rx) = watch::channel(Arc::default());
        let mut reconciler = Reconciler::new(&common, Arc::default(), status);
        reconciler.start();
        let content = |r: &mut Reconciler, file: usize, slot: usize| {
            r.file(file).slots[slot]
                .source
                .content
                .as_ref()
                .map(|c| c.certificates[0].subject_cn.clone())
        };
        assert_eq!(content(&mut reconciler, 1, 0).as_deref(), Some("b"));

        // Changed with no event: not seen before the re-verification...
        std::fs::write(&bundle_source, pem("a2")).unwrap();
        std::fs::write(&cloud_source, pem("b2")).unwrap();
        assert!(!reconciler.take_due(Instant::now()));
        assert_eq!(content(&mut reconciler, 1, 0).as_deref(), Some("b"));
        // ...and read, in every file, when it is due; the cluster source is not read.
        let due = reconciler.verify_at;
        assert!(reconciler.take_due(due));
        assert_eq!(content(&mut reconciler, 0, 0).as_deref(), Some("a2"));
        assert_eq!(content(&mut reconciler, 1, 0).as_deref(), Some("b2"));
        assert_eq!(reconciler.file(0).schedule.read_at(1), None);
        assert!(reconciler.file(0).slots[1].source.content.is_none());
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
            reconciler.file(0).read_local(0, at);
            let next = reconciler
                .file(0)
                .schedule
                .read_at(0)
                .expect("a retry is scheduled");
            delays.push((next - at).as_secs());
            at = next;
        }
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60]);

        let dir = tempfile::tempdir().unwrap();
        let (mut reconciler, _status) = reconciler_for(dir.path(), Some(b"not a certificate"));
        reconciler.file(0).read_local(0, Instant::now());
        assert!(!reconciler.file(0).slots[0].source.up);
        assert_eq!(
            reconciler.file(0).schedule.read_at(0),
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
            outgrown: mpsc::unbounded_channel().1,
        };
        // Paused time: the loop runs until it waits, then the clock jumps to the earliest
        // timer, this one, well before the source's quiet second is up.
        let _ = tokio::time::timeout(
            crate::targets::schedule::WRITE_QUIET / 2,
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
