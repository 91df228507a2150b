//! One registry set (`--manage-registries DIR=SPEC,...`, SPEC 4b) in the loop: its entry
//! sources, and the registry files under DIR. The rules are the pure [`crate::registry`]
//! module's; this is its effects layer: it reads the sources and DIR, asks
//! [`registry::plan`] what to do, does it (directories 0755, each `ca.crt` replaced
//! atomically 0644 root:root by the bundle's own writer, removals of what the agent created
//! only), keeps the record, and says how each registry file stands.
//!
//! Every registry file has the guarantees of the bundle: validated content, a write only
//! when its bytes change, repair of its content, mode and owner (with the bundle's
//! backoff against a writer that fights back), history of what it replaced, its own
//! `filepath` in the metrics, its line in `/readyz?verbose` and its entry in
//! `managed-files.json`. A bad entry costs its registry alone; nothing is written or
//! removed before every source has been read once.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use super::kept::{Kept, Report};
use super::policy::{BOUNDARY_RECHECK_MAX, Backoff};
use super::schedule::Schedule;
use crate::bundle::{self, Fingerprint};
use crate::metrics::{FileLabels, FileReasonLabels, Metrics, known};
use crate::registry::{
    self, CaFile, Created, CreatedRecord, Entries, Listing, OnDisk as RegistryOnDisk, Plan,
    ProblemKind, RegistryName, Root, Why,
};
use crate::source::cluster::{Content, Event};
use crate::source::state::SourceState;
use crate::source::{SourceSpec, local};
use crate::state::Book;
use crate::status::{Status, TargetKind, unix_now};
use crate::writer::history::History;
use crate::writer::{BundleWriter, OnDisk, Outcome};

/// What the loop knows about one entry source.
struct RegistrySlot {
    source: SourceState,
    /// The last good entries: kept while the source fails.
    entries: Option<Arc<Entries>>,
}

pub(crate) struct RegistrySet {
    /// DIR as given: the record's key.
    dir: PathBuf,
    /// DIR made absolute: where the files are.
    root: PathBuf,
    /// When its sources are read, and when it calls for a pass.
    pub(crate) schedule: Schedule,
    slots: Vec<RegistrySlot>,
    /// Each registry's content as this agent last wrote it or found it in sync: a file
    /// that differs from an unchanged goal is drift to repair.
    written: BTreeMap<String, Fingerprint>,
    /// The refusals and warnings already logged and counted, so that each is said once
    /// while it lasts.
    said: BTreeSet<String>,
    /// The sources' entries as last built, and what was built of them: the same entries
    /// are not checked again until a certificate's validity changes.
    built: Option<(registry::Merged, registry::Built)>,
    /// The SHA-256 each registry file was last recorded with in `managed-files.json`.
    recorded: BTreeMap<String, Fingerprint>,
    /// The file paths whose counters have their series.
    known_paths: BTreeSet<String>,
    repair: Backoff,
    write_retry: Backoff,
    /// The registries whose last write failed, and why.
    failed: BTreeMap<String, String>,
    /// When the oldest source change not yet on disk arrived.
    pending_since: Option<Instant>,
    /// The next instant a registry file's validity changes (unix seconds).
    boundary: Option<i64>,
    is_root: bool,
    metrics: Arc<Metrics>,
    book: Book,
    state_dir: PathBuf,
    /// Each registry file's state, as the last pass found it.
    pub(crate) statuses: Vec<Status>,
    /// What concerns the set rather than one file (entries that name no registry, a DIR
    /// that is not a directory): `None` when nothing.
    pub(crate) note: Option<String>,
}

/// Mode of the directories the agent makes, whatever the umask.
const DIRECTORY_MODE: u32 = registry::plan::DIRECTORY_MODE;
/// Mode of every registry file.
const FILE_MODE: u32 = registry::plan::FILE_MODE;

impl RegistrySet {
    pub(crate) fn new(
        dir: &Path,
        sources: &[SourceSpec],
        first: usize,
        metrics: Arc<Metrics>,
        book: Book,
        state_dir: &Path,
    ) -> RegistrySet {
        for spec in sources {
            spec.init_metrics(&metrics);
        }
        RegistrySet {
            dir: dir.to_path_buf(),
            root: std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf()),
            schedule: Schedule::new(first, sources),
            slots: sources
                .iter()
                .map(|spec| RegistrySlot {
                    source: SourceState::new(spec),
                    entries: None,
                })
                .collect(),
            written: BTreeMap::new(),
            said: BTreeSet::new(),
            built: None,
            recorded: BTreeMap::new(),
            known_paths: BTreeSet::new(),
            repair: Backoff::default(),
            write_retry: Backoff::default(),
            failed: BTreeMap::new(),
            pending_since: None,
            boundary: None,
            is_root: nix::unistd::geteuid().is_root(),
            metrics,
            book,
            state_dir: state_dir.to_path_buf(),
            statuses: Vec::new(),
            note: None,
        }
    }

    /// Reads a `dir:` source now; a read that failed is retried with backoff.
    pub(crate) fn read_local(&mut self, index: usize, at: Instant) {
        let result = local::registry_entries(&self.slots[index].source.spec);
        let retry = matches!(&result, Err(error) if local::retryable(error));
        self.schedule.was_read(index, at, retry);
        let event = match result {
            Ok(entries) => Event::Content(Arc::new(entries)),
            Err(error) => Event::Failed(error),
        };
        self.observe(index, event, at);
    }

    /// A source's news (by its position among this set's sources).
    pub(crate) fn observe(&mut self, index: usize, event: Event<Arc<Entries>>, at: Instant) {
        let slot = &mut self.slots[index];
        let was_up = slot.source.up;
        match event {
            Event::Content(entries) => {
                slot.source.came_up(entries.entries.len());
                if slot.entries.as_deref() != Some(&*entries) {
                    tracing::info!(source = %slot.source.name, registries = entries.entries.len(), refused = entries.refused.len(), "source content changed");
                    slot.entries = Some(entries);
                    slot.source.last_change = Some(unix_now());
                    self.pending_since.get_or_insert(at);
                    self.schedule.due = true;
                }
            }
            Event::Failed(error) => slot.source.failed(&error, false, &self.metrics),
            Event::WatchRestart(error) => slot.source.failed(&error, true, &self.metrics),
        }
        // The same entries again (another field of a shared object changed) call for no
        // pass; a source that went up or down does, for its state to be shown.
        self.schedule.due |= slot.source.up != was_up;
    }

    /// The path of a registry's file.
    fn path_of(&self, dir: &str) -> PathBuf {
        self.root.join(dir).join(registry::plan::CA_FILE)
    }

    /// What a pass would do, one line each, without doing it (`sync --dry-run`). Every
    /// source must have been read.
    pub(crate) fn preview(&mut self, record: &CreatedRecord) -> String {
        use std::fmt::Write;
        let created = record.sets.get(&self.dir).cloned().unwrap_or_default();
        let merged = registry::merge(
            self.slots
                .iter()
                .filter_map(|s| s.entries.as_deref().cloned()),
        );
        let built = registry::build(merged, OffsetDateTime::now_utc().unix_timestamp());
        let names = registry::to_look_at(&created, &built.desired);
        let (listing, _) = self.list(&names);
        let plan = registry::plan(&created, &built.desired, &listing);
        let mut out = String::new();
        let shown =
            |dir: &str| crate::text::escape(&self.path_of(dir).display().to_string()).into_owned();
        for write in &plan.writes {
            let verb = if write.creates { "created" } else { "replaced" };
            let _ = writeln!(out, "{} would be {verb}", shown(write.name.dir()));
        }
        for name in &plan.remove_files {
            let _ = writeln!(
                out,
                "{} would be removed (its registry left the sources)",
                shown(name.dir())
            );
        }
        for name in &plan.unchanged {
            let _ = writeln!(
                out,
                "{} is in sync; nothing would change",
                shown(name.dir())
            );
        }
        for problem in &plan.problems {
            let _ = writeln!(
                out,
                "{}: {problem}",
                crate::text::escape(&self.root.display().to_string())
            );
        }
        for refused in &built.refused {
            let _ = writeln!(out, "refused: {refused}");
        }
        out
    }

    /// Logs and counts, once each while they last, the set's refusals, shadowed entries and
    /// content warnings.
    fn say(&mut self, built: &registry::Built) {
        let mut now_said = BTreeSet::new();
        for refused in &built.refused {
            let line = refused.to_string();
            if !self.said.contains(&line) {
                tracing::warn!(dir = %self.root.display(), reason = refused.error.reason(), "registry entry refused: {line}");
                self.metrics
                    .source_errors
                    .get_or_create(&crate::metrics::SourceReasonLabels {
                        source: refused.place.source.clone(),
                        reason: refused.error.reason().to_string(),
                    })
                    .inc();
            }
            now_said.insert(line);
        }
        for shadowed in &built.shadowed {
            let line = shadowed.to_string();
            if !self.said.contains(&line) {
                tracing::info!(dir = %self.root.display(), "{line}");
            }
            now_said.insert(line);
        }
        for warning in &built.warnings {
            let line = warning.to_string();
            if !self.said.contains(&line) {
                tracing::warn!(dir = %self.root.display(), reason = warning.warning.reason(), "{line}");
            }
            now_said.insert(line);
        }
        self.said = now_said;
    }

    /// What is on disk for each of `names` under DIR, never following a link: the plan's
    /// listing, and each regular `ca.crt` as the writer read it (for its stat and
    /// SELinux label when it is replaced).
    fn list(&self, names: &BTreeSet<String>) -> (Listing, BTreeMap<String, OnDisk>) {
        // DIR itself may be a link to a directory (certs.d -> /etc/containers/certs.d); what
        // is under it is never looked at through a link.
        let root = match fs::metadata(&self.root) {
            Ok(m) if m.is_dir() => Root::Directory,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Root::Missing,
            _ => Root::NotADirectory,
        };
        let mut listing = Listing {
            root,
            registries: BTreeMap::new(),
        };
        let mut found = BTreeMap::new();
        if root != Root::Directory {
            return (listing, found);
        }
        for name in names {
            let dir = self.root.join(name);
            let on_disk = match fs::symlink_metadata(&dir) {
                Err(_) => continue,
                Ok(m) if m.file_type().is_symlink() => RegistryOnDisk::Symlink,
                Ok(m) if !m.is_dir() => RegistryOnDisk::NotADirectory,
                Ok(_) => {
                    let writer = BundleWriter::new(self.path_of(name), FILE_MODE);
                    let ca = match writer.read_current() {
                        Ok(OnDisk::Missing) => CaFile::Missing,
                        Ok(OnDisk::Regular { bytes, stat }) => {
                            found.insert(
                                name.clone(),
                                OnDisk::Regular {
                                    bytes: bytes.clone(),
                                    stat,
                                },
                            );
                            CaFile::Regular(bytes)
                        }
                        Ok(OnDisk::Other(crate::fsutil::FileKind::Symlink)) => CaFile::Symlink,
                        Ok(OnDisk::Other(_)) => CaFile::NotRegular,
                        Err(e) => CaFile::Unreadable(e.to_string()),
                    };
                    RegistryOnDisk::Directory {
                        ca,
                        others: holds_others(&dir),
                    }
                }
            };
            listing.registries.insert(name.clone(), on_disk);
        }
        (listing, found)
    }

    /// Does what `plan` says, in its order; a step that fails costs its registry alone.
    fn apply(
        &mut self,
        plan: &Plan,
        found: &BTreeMap<String, OnDisk>,
        now: OffsetDateTime,
        at: Instant,
    ) -> Outcome2 {
        let mut outcome = Outcome2::default();
        let owner = self.is_root.then_some((0, 0));
        if plan.create_root {
            let made = fs::DirBuilder::new()
                .recursive(true)
                .mode(DIRECTORY_MODE)
                .create(&self.root);
            if let Err(e) = made {
                let problem = format!("cannot create {}: {e}", self.root.display());
                for write in &plan.writes {
                    outcome.fail(write.name.dir(), problem.clone());
                }
            }
        }
        for name in &plan.create_directories {
            let dir = self.root.join(name.dir());
            let made = fs::DirBuilder::new()
                .mode(DIRECTORY_MODE)
                .create(&dir)
                .and_then(|()| {
                    // The umask may have taken bits away.
                    fs::set_permissions(&dir, fs::Permissions::from_mode(DIRECTORY_MODE))
                });
            match made {
                Ok(()) => {
                    tracing::info!(dir = %dir.display(), "created the registry directory");
                }
                Err(e) => {
                    outcome.not_made.insert(name.dir().to_string());
                    outcome.fail(
                        name.dir(),
                        format!("cannot create the directory {}: {e}", dir.display()),
                    );
                }
            }
        }
        let repairs_wait = self.repair.blocked(at);
        let writes_wait = self.write_retry.blocked(at);
        for write in &plan.writes {
            let dir = write.name.dir();
            if outcome.errors.contains_key(dir) {
                if write.creates {
                    outcome.not_written.insert(dir.to_string());
                }
                continue;
            }
            let sha256 = Fingerprint::of(&write.bytes);
            let repair = self.written.get(dir) == Some(&sha256);
            let failed_before = self.failed.contains_key(dir);
            let wait = if repair { repairs_wait } else { None }.or(if failed_before {
                writes_wait
            } else {
                None
            });
            if let Some(until) = wait {
                self.schedule.retry_by(until);
                let why = if repair {
                    "something else keeps changing the file: repairs back off".to_string()
                } else {
                    format!(
                        "{}; retrying with backoff",
                        self.failed.get(dir).cloned().unwrap_or_default()
                    )
                };
                outcome.waiting.insert(dir.to_string(), why);
                if write.creates {
                    outcome.not_written.insert(dir.to_string());
                }
                continue;
            }
            let path = self.path_of(dir);
            let filepath = path.display().to_string();
            self.init_counters(&filepath);
            let writer = BundleWriter::new(path, FILE_MODE);
            let current = found.get(dir).cloned().unwrap_or(OnDisk::Missing);
            match writer.write(&write.bytes, &current, owner) {
                Ok(Outcome::Unchanged) => {}
                Ok(Outcome::Replaced { previous }) => {
                    let labels = FileLabels {
                        filepath: filepath.clone(),
                    };
                    self.metrics.writes.get_or_create(&labels).inc();
                    if repair {
                        self.metrics.repairs.get_or_create(&labels).inc();
                        self.repair.step_repair(at);
                        tracing::warn!(file = %filepath, "repaired the registry CA: something else had changed or removed it");
                    } else {
                        tracing::info!(file = %filepath, sha256 = %sha256.to_hex(), "registry CA written");
                        // What it replaced, when it was certificates, goes to history.
                        if let Some(previous) = previous
                            && !bundle::parse::scan(&previous).certificates.is_empty()
                        {
                            let history = History::new(&crate::targets::apply::file_state_dir(
                                &self.state_dir,
                                writer.path(),
                            ));
                            if let Some(parent) = history.dir().parent()
                                && let Err(e) = fs::create_dir_all(parent)
                                    .and_then(|()| history.record(&previous, now).map(drop))
                            {
                                tracing::warn!(file = %filepath, "cannot keep the replaced registry CA in history: {e}");
                            }
                        }
                        if let Some(since) = self.pending_since {
                            self.metrics
                                .sync_duration
                                .observe(since.elapsed().as_secs_f64());
                        }
                    }
                }
                Err(e) => {
                    self.count_sync_error(&filepath, e.reason());
                    tracing::error!(reason = e.reason(), "{e}");
                    if !failed_before {
                        self.write_retry.clear();
                    }
                    self.write_retry.step_write(at);
                    if let Some(until) = self.write_retry.until {
                        self.schedule.retry_by(until);
                    }
                    self.failed.insert(dir.to_string(), e.to_string());
                    outcome.fail(dir, e.to_string());
                    if write.creates {
                        outcome.not_written.insert(dir.to_string());
                    }
                    continue;
                }
            }
            self.failed.remove(dir);
            self.written.insert(dir.to_string(), sha256);
            outcome.on_disk.insert(dir.to_string(), write.bytes.clone());
        }
        if self.failed.is_empty() {
            self.write_retry.clear();
        }
        // A registry file as it should be, but with another mode or owner: put back in
        // place, under the repairs' backoff.
        for name in &plan.unchanged {
            let dir = name.dir();
            if !plan.record.files.contains(dir) {
                continue;
            }
            let Some(OnDisk::Regular { bytes, stat }) = found.get(dir) else {
                continue;
            };
            self.written.insert(dir.to_string(), Fingerprint::of(bytes));
            let wrong_mode = stat.mode != FILE_MODE;
            let wrong_owner = owner.is_some_and(|o| o != (stat.uid, stat.gid));
            if !(wrong_mode || wrong_owner) {
                continue;
            }
            if let Some(until) = repairs_wait {
                self.schedule.retry_by(until);
                outcome.waiting.insert(
                    dir.to_string(),
                    "something else keeps changing the file's mode or owner: repairs back off"
                        .to_string(),
                );
                continue;
            }
            let path = self.path_of(dir);
            let filepath = path.display().to_string();
            match BundleWriter::new(path, FILE_MODE).repair_attributes(stat, owner) {
                Ok(true) => {
                    self.init_counters(&filepath);
                    self.metrics
                        .repairs
                        .get_or_create(&FileLabels {
                            filepath: filepath.clone(),
                        })
                        .inc();
                    self.repair.step_repair(at);
                    tracing::warn!(file = %filepath, mode = format!("{:o}", stat.mode), uid = stat.uid, gid = stat.gid, "repaired the registry CA's mode or owner: something else had changed it");
                }
                Ok(false) => self.schedule.recheck_at = Some(at),
                Err(e) => {
                    self.count_sync_error(&filepath, "attributes");
                    outcome.fail(
                        dir,
                        format!("cannot repair the mode or owner of {filepath}: {e}"),
                    );
                }
            }
        }
        for name in &plan.remove_files {
            let path = self.path_of(name.dir());
            match fs::remove_file(&path) {
                Ok(()) => {
                    tracing::info!(file = %path.display(), "removed the registry CA: its registry left the sources");
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    // Its registry left the sources, and its CA is still trusted: a
                    // failure to say, in health and metrics, until it is gone.
                    let problem = format!(
                        "its registry left the sources, but {} cannot be removed: {e}",
                        path.display()
                    );
                    tracing::error!("{problem}");
                    self.count_sync_error(
                        &path.display().to_string(),
                        crate::writer::io_reason(&e),
                    );
                    outcome.not_removed.insert(name.dir().to_string());
                    // Kept among the failures, so that its retries back off.
                    self.failed.insert(name.dir().to_string(), problem.clone());
                    outcome.fail(name.dir(), problem);
                    self.write_retry.step_write(at);
                    if let Some(until) = self.write_retry.until {
                        self.schedule.retry_by(until);
                    }
                    continue;
                }
            }
            self.written.remove(name.dir());
            self.failed.remove(name.dir());
            self.recorded.remove(name.dir());
            if let Err(e) = self.book.forget(&path) {
                tracing::warn!("cannot update managed-files.json: {e}");
            }
        }
        for name in &plan.remove_directories {
            let dir = self.root.join(name.dir());
            match fs::remove_dir(&dir) {
                Ok(()) => {
                    tracing::info!(dir = %dir.display(), "removed the registry directory the agent had made");
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    // Something appeared in it since it was listed: it stays, and stays
                    // recorded, to go once it is empty.
                    tracing::info!(dir = %dir.display(), "the registry directory stays: {e}");
                    outcome.dirs_kept.insert(name.dir().to_string());
                }
            }
        }
        outcome
    }

    /// The state of each registry file after a pass, for health and metrics.
    fn describe(
        &mut self,
        built: &registry::Built,
        plan: &Plan,
        found: &BTreeMap<String, OnDisk>,
        outcome: &Outcome2,
        now: i64,
    ) {
        let sources: Vec<_> = self.slots.iter().map(|s| s.source.status()).collect();
        let mut problems: BTreeMap<String, String> = BTreeMap::new();
        let mut notes: Vec<String> = Vec::new();
        for problem in &plan.problems {
            match (&problem.name, &problem.kind) {
                (_, ProblemKind::RootNotADirectory) | (_, ProblemKind::InvalidRecordEntry) => {
                    notes.push(problem.to_string())
                }
                (Some(name), _) => {
                    problems.insert(name.clone(), problem.to_string());
                }
                (None, _) => notes.push(problem.to_string()),
            }
        }
        // Refusals that concern a registry hold it; the others name no registry.
        let mut refusals: BTreeMap<String, String> = BTreeMap::new();
        for refused in &built.refused {
            let held = refused_registry(&refused.error)
                .and_then(|raw| RegistryName::parse(raw).ok())
                .filter(|n| built.desired.held.contains(n));
            match held {
                Some(name) => {
                    refusals.insert(
                        name.dir().to_string(),
                        format!("{refused}; the file stays as it is"),
                    );
                }
                None => notes.push(format!("entry refused: {refused}")),
            }
        }
        let root_problem = (plan
            .problems
            .iter()
            .any(|p| p.kind == ProblemKind::RootNotADirectory))
        .then(|| format!("{} is not a directory", self.root.display()));
        let removals_held: BTreeSet<&str> = plan
            .left_alone
            .iter()
            .filter(|l| l.why == Why::RemovalsHeld)
            .map(|l| l.name.as_str())
            .collect();
        let mut names: BTreeSet<String> = built
            .desired
            .files
            .keys()
            .chain(&built.desired.held)
            .map(|n| n.dir().to_string())
            .collect();
        names.extend(problems.keys().cloned());
        names.extend(outcome.errors.keys().cloned());
        names.extend(removals_held.iter().map(|s| s.to_string()));
        let mut statuses = Vec::with_capacity(names.len());
        let mut boundary: Option<i64> = None;
        for name in names {
            let path = self.path_of(&name);
            let filepath = path.display().to_string();
            self.init_counters(&filepath);
            let bytes: Option<&[u8]> = outcome
                .on_disk
                .get(&name)
                .map(Vec::as_slice)
                .or_else(|| found.get(&name).and_then(OnDisk::bytes));
            let goal = RegistryName::parse(&name)
                .ok()
                .and_then(|n| built.desired.files.get(&n).map(Vec::as_slice));
            // The file holding what was built: its certificates are known already.
            let known = RegistryName::parse(&name)
                .ok()
                .and_then(|n| built.files.get(&n))
                .filter(|f| Some(f.bytes.as_slice()) == bytes);
            let certificates = match (known, bytes) {
                (Some(file), _) => file.certificates.clone(),
                (None, Some(b)) => crate::targets::apply::readable_certificates(b),
                (None, None) => Vec::new(),
            };
            for c in &certificates {
                for t in [c.not_before, c.not_after.saturating_add(1)] {
                    if t > now {
                        boundary = Some(boundary.map_or(t, |b| b.min(t)));
                    }
                }
            }
            let valid = certificates.iter().any(|c| c.is_valid_at(now));
            let file_problem = match (bytes, valid) {
                (None, _) => Some(format!("{filepath} does not exist")),
                (Some(_), false) if certificates.is_empty() => {
                    Some("the file holds no certificate".to_string())
                }
                (Some(_), false) => Some("no certificate in the file is valid now".to_string()),
                _ => None,
            };
            let sync_problem = root_problem
                .clone()
                .or_else(|| problems.get(&name).cloned())
                .or_else(|| outcome.errors.get(&name).cloned())
                .or_else(|| outcome.waiting.get(&name).cloned())
                .or_else(|| refusals.get(&name).cloned())
                .or_else(|| {
                    removals_held.contains(name.as_str()).then(|| {
                        "its registry left the sources, but a source could not be read whole: nothing is removed until it can".to_string()
                    })
                })
                .or_else(|| match (goal, bytes) {
                    (Some(goal), Some(bytes)) if goal == bytes => None,
                    (Some(_), _) => Some("the file differs from the sources".to_string()),
                    (None, _) => None,
                });
            let in_sync = sync_problem.is_none();
            if in_sync && let Some(bytes) = bytes {
                let sha256 = Fingerprint::of(bytes);
                if self.recorded.get(&name) != Some(&sha256) {
                    match self.book.record(&path, &sha256.to_hex()) {
                        Ok(()) => {
                            self.recorded.insert(name.clone(), sha256);
                        }
                        Err(e) => tracing::warn!("cannot update managed-files.json: {e}"),
                    }
                }
            }
            statuses.push(Status {
                kind: TargetKind::File,
                bundle_path: filepath,
                sha256: bytes.map(|b| Fingerprint::of(b).to_hex()),
                certificates,
                file_valid: valid,
                file_problem,
                in_sync: Some(in_sync),
                sync_problem,
                sources: sources.clone(),
                last_sync: in_sync.then(unix_now),
                registry_set: Some(self.root.display().to_string()),
                ..Status::default()
            });
        }
        self.boundary = boundary;
        self.statuses = statuses;
        self.note = (!notes.is_empty()).then(|| notes.join("; "));
    }

    /// The state while a source has not been read: each file the agent made is listed,
    /// as it is on disk, with its sync not known.
    fn unknown(&mut self, created: &Created, unread: &[String]) {
        let why = format!(
            "not known yet: {} of {} sources not read yet ({}); nothing under {} is written or removed until each has been read",
            unread.len(),
            self.slots.len(),
            unread.join(", "),
            self.root.display()
        );
        let sources: Vec<_> = self.slots.iter().map(|s| s.source.status()).collect();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        self.statuses = created
            .files
            .iter()
            .map(|name| {
                let path = self.path_of(name);
                let on_disk = BundleWriter::new(path.clone(), FILE_MODE).read_current();
                let bytes = match &on_disk {
                    Ok(OnDisk::Regular { bytes, .. }) => Some(bytes.as_slice()),
                    _ => None,
                };
                let certificates = bytes
                    .map(crate::targets::apply::readable_certificates)
                    .unwrap_or_default();
                let valid = certificates.iter().any(|c| c.is_valid_at(now));
                Status {
                    kind: TargetKind::File,
                    bundle_path: path.display().to_string(),
                    sha256: bytes.map(|b| Fingerprint::of(b).to_hex()),
                    certificates,
                    file_valid: valid,
                    file_problem: (!valid)
                        .then(|| "no certificate in the file is valid now".into()),
                    in_sync: None,
                    sync_problem: Some(why.clone()),
                    sources: sources.clone(),
                    registry_set: Some(self.root.display().to_string()),
                    ..Status::default()
                }
            })
            .collect();
        self.note = None;
    }

    /// Gives a registry file's counters their series, once.
    fn init_counters(&mut self, filepath: &str) {
        if self.known_paths.insert(filepath.to_string()) {
            let cluster: &[&str] = if self.slots.iter().any(|s| s.source.spec.is_cluster()) {
                known::CLUSTER_SYNC_ERRORS
            } else {
                &[]
            };
            self.metrics
                .init_file(filepath, &[known::FILE_SYNC_ERRORS, cluster]);
        }
    }

    fn count_sync_error(&mut self, filepath: &str, reason: &str) {
        self.init_counters(filepath);
        self.metrics
            .sync_errors
            .get_or_create(&FileReasonLabels {
                filepath: filepath.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }
}

impl Kept for RegistrySet {
    fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    fn schedule_mut(&mut self) -> &mut Schedule {
        &mut self.schedule
    }

    fn on_update(&mut self, local: usize, event: Event<Content>, at: Instant) {
        if let Some(event) = event.filter_map(Content::entries) {
            self.observe(local, event, at);
        }
    }

    fn report(&self, report: &mut Report) {
        report.files.extend(self.statuses.iter().cloned());
        report.notes.push((
            format!("registries:{}", self.root.display()),
            self.note.clone(),
        ));
        report
            .sources
            .extend(self.slots.iter().map(|s| s.source.status()));
    }

    #[cfg(test)]
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    /// Reads the `dir:` sources that are due at `now`; true when a pass is called for.
    fn take_due(&mut self, now: Instant) -> bool {
        let (reads, work) = self.schedule.take_due(now);
        for local in reads {
            self.read_local(local, now);
        }
        work
    }

    /// Reads the `dir:` sources, and runs the first pass. No API call happens here.
    fn start(&mut self, record: &mut CreatedRecord) {
        // Temporary files a killed write left in the registry directories (SPEC 5): they
        // would keep a directory the agent made from going with its registry.
        if let Some(created) = record.sets.get(&self.dir) {
            for name in created.directories.iter().chain(&created.files) {
                if RegistryName::parse(name).is_ok()
                    && let Err(e) =
                        crate::writer::atomic::remove_stale_temp_files(&self.root.join(name))
                {
                    tracing::warn!(dir = %self.root.join(name).display(), "cannot remove stale temporary files: {e}");
                }
            }
        }
        let now = Instant::now();
        for index in 0..self.slots.len() {
            if !self.slots[index].source.spec.is_cluster() {
                self.read_local(index, now);
            }
        }
        self.reconcile(record);
    }

    /// One pass over the set: builds what the sources want, looks at DIR, does what the
    /// plan says, and records it in `record` (saved by the caller when it changed).
    fn reconcile(&mut self, record: &mut CreatedRecord) {
        self.schedule.due = false;
        let now = OffsetDateTime::now_utc();
        let at = Instant::now();
        let created = record.sets.get(&self.dir).cloned().unwrap_or_default();
        let unread: Vec<String> = self
            .slots
            .iter()
            .filter(|s| s.entries.is_none())
            .map(|s| s.source.name.clone())
            .collect();
        if !unread.is_empty() {
            // The first source naming a registry wins: until each has been read, what the
            // others say may be shadowed, and a registry missing from them may only be
            // unread. Nothing is written or removed meanwhile; the files stand as found.
            self.unknown(&created, &unread);
            return;
        }
        let merged = registry::merge(
            self.slots
                .iter()
                .filter_map(|s| s.entries.as_deref().cloned()),
        );
        let boundary_passed = self.boundary.is_some_and(|b| b <= now.unix_timestamp());
        let built = match self.built.take() {
            Some((last, built)) if last == merged && !boundary_passed => (last, built),
            _ => {
                let built = registry::build(merged.clone(), now.unix_timestamp());
                (merged, built)
            }
        };
        let built = &self.built.insert(built).1.clone();
        self.say(built);
        let names = registry::to_look_at(&created, &built.desired);
        let (listing, found) = self.list(&names);
        let plan = registry::plan(&created, &built.desired, &listing);
        let mut outcome = self.apply(&plan, &found, now, at);
        let mut kept = plan.record.clone();
        outcome.correct(&mut kept);
        if kept.is_empty() {
            record.sets.remove(&self.dir);
        } else {
            record.sets.insert(self.dir.clone(), kept);
        }
        self.describe(built, &plan, &found, &outcome, now.unix_timestamp());
        if outcome.errors.is_empty() && self.statuses.iter().all(|s| s.in_sync == Some(true)) {
            self.pending_since = None;
        }
    }

    /// Time until a registry file's validity changes.
    fn next_boundary(&self) -> Duration {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        self.boundary
            .filter(|&t| t > now)
            .map_or(BOUNDARY_RECHECK_MAX, |t| {
                Duration::from_secs((t - now) as u64).min(BOUNDARY_RECHECK_MAX)
            })
    }
}

/// What a pass did not do as planned, so that the record claims only what is so and
/// health says why.
#[derive(Debug, Default)]
struct Outcome2 {
    /// Registries whose step failed, and why.
    errors: BTreeMap<String, String>,
    /// Registries whose write waits for a backoff, and why.
    waiting: BTreeMap<String, String>,
    /// Directories the plan made that could not be made.
    not_made: BTreeSet<String>,
    /// Files the plan created that were not written.
    not_written: BTreeSet<String>,
    /// Files the plan removed that are still there.
    not_removed: BTreeSet<String>,
    /// Directories the plan removed that are still there.
    dirs_kept: BTreeSet<String>,
    /// The content now on disk of each registry written (or found as wanted) this pass.
    on_disk: BTreeMap<String, Vec<u8>>,
}

impl Outcome2 {
    fn fail(&mut self, dir: &str, problem: String) {
        self.errors.entry(dir.to_string()).or_insert(problem);
    }

    /// The plan's record, as if every step succeeded, made true to what happened.
    fn correct(&mut self, record: &mut Created) {
        for dir in &self.not_made {
            record.directories.remove(dir);
        }
        for dir in &self.not_written {
            record.files.remove(dir);
        }
        record.files.extend(self.not_removed.iter().cloned());
        record.directories.extend(self.dirs_kept.iter().cloned());
    }
}

/// The raw registry name a refusal concerns, when it names one.
fn refused_registry(error: &registry::EntryError) -> Option<&str> {
    use registry::EntryError;
    match error {
        EntryError::NoData { registry }
        | EntryError::BadBase64 { registry }
        | EntryError::Content { registry, .. } => Some(registry),
        _ => None,
    }
}

/// Whether a registry directory holds anything but its `ca.crt` (and the agent's own
/// temporary files, which a killed write may leave behind).
fn holds_others(dir: &Path) -> bool {
    let Ok(entries) = fs::read_dir(dir) else {
        return true;
    };
    entries.flatten().any(|entry| {
        let name = entry.file_name();
        name != registry::plan::CA_FILE
            && !crate::writer::atomic::is_temp_file_name(&name.to_string_lossy())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(dir: &Path) -> RegistrySet {
        let spec: SourceSpec = format!("dir:{}", dir.display()).parse().unwrap();
        let book = Book::open_with_sets(dir, &[], &[dir.join("certs.d")]);
        RegistrySet::new(&dir.join("certs.d"), &[spec], 0, Arc::default(), book, dir)
    }

    #[test]
    fn a_dir_that_cannot_be_looked_at_is_not_taken_for_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        let set = set(dir.path());
        let root = dir.path().join("certs.d");
        assert_eq!(set.list(&BTreeSet::new()).0.root, Root::Missing);
        // A link to itself: looking at it fails (ELOOP), and a DIR the agent cannot look
        // at must never be made anew or written under.
        std::os::unix::fs::symlink(&root, &root).unwrap();
        assert_eq!(set.list(&BTreeSet::new()).0.root, Root::NotADirectory);
        fs::remove_file(&root).unwrap();
        fs::create_dir(&root).unwrap();
        assert_eq!(set.list(&BTreeSet::new()).0.root, Root::Directory);
    }

    #[test]
    fn while_sources_are_unread_a_valid_file_the_agent_made_is_said_valid() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = set(dir.path());
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let valid = crate::bundle::test_certs::ca(Some("registry-ca"), None, now - 60, now + 3600);
        let expired = crate::bundle::test_certs::ca(Some("old-ca"), None, now - 7200, now - 3600);
        for (name, cert) in [("quay.io", &valid), ("old.example", &expired)] {
            fs::create_dir_all(dir.path().join("certs.d").join(name)).unwrap();
            fs::write(set.path_of(name), cert.pem()).unwrap();
        }
        let created = Created {
            directories: BTreeSet::new(),
            files: ["quay.io", "old.example"].map(String::from).into(),
        };
        set.unknown(&created, &["dir:/nowhere".to_string()]);
        let problem = |name: &str| {
            let status = status(&set, name).unwrap();
            (status.file_valid, status.file_problem.clone())
        };
        // Each file as it is on disk, its sync not known, and why.
        let quay = status(&set, "quay.io").unwrap();
        assert_eq!(
            quay.sha256,
            Some(Fingerprint::of(&fs::read(set.path_of("quay.io")).unwrap()).to_hex())
        );
        assert_eq!(quay.certificates.len(), 1);
        assert_eq!(quay.in_sync, None);
        assert_eq!(
            quay.sync_problem.as_deref(),
            Some(
                format!(
                    "not known yet: 1 of 1 sources not read yet (dir:/nowhere); nothing under {} is written or removed until each has been read",
                    dir.path().join("certs.d").display()
                )
                .as_str()
            )
        );
        assert_eq!(quay.sources.len(), 1, "the line shows the set's sources");
        assert_eq!(problem("quay.io"), (true, None));
        assert_eq!(
            problem("old.example"),
            (
                false,
                Some("no certificate in the file is valid now".into())
            )
        );
    }

    #[test]
    fn the_next_boundary_is_the_next_validity_change_of_a_file_capped_at_an_hour() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = set(dir.path());
        assert_eq!(set.next_boundary(), BOUNDARY_RECHECK_MAX);
        let now = OffsetDateTime::now_utc().unix_timestamp();
        set.boundary = Some(now + 100);
        let next = set.next_boundary();
        assert!(
            next <= Duration::from_secs(100) && next >= Duration::from_secs(98),
            "{next:?}"
        );
        // Passed, or further than the cap: the cap.
        set.boundary = Some(now - 5);
        assert_eq!(set.next_boundary(), BOUNDARY_RECHECK_MAX);
        set.boundary = Some(now);
        assert_eq!(
            set.next_boundary(),
            BOUNDARY_RECHECK_MAX,
            "this second is past"
        );
        set.boundary = Some(now + 7200);
        assert_eq!(set.next_boundary(), BOUNDARY_RECHECK_MAX);
    }

    /// A set fed by one `dir:` source, DIR/entries (a `.crt` per registry), kept under
    /// DIR/certs.d.
    fn fed(dir: &Path) -> RegistrySet {
        let entries = dir.join("entries");
        fs::create_dir_all(&entries).unwrap();
        let spec: SourceSpec = format!("dir:{}", entries.display()).parse().unwrap();
        let root = dir.join("certs.d");
        let book = Book::open_with_sets(dir, &[], std::slice::from_ref(&root));
        RegistrySet::new(&root, &[spec], 0, Arc::default(), book, dir)
    }

    /// A CA valid from `from` to `to` (unix seconds), as PEM.
    fn ca_pem(cn: &str, from: i64, to: i64) -> Vec<u8> {
        crate::bundle::test_certs::ca(Some(cn), None, from, to)
            .pem()
            .to_vec()
    }

    fn feed(dir: &Path, registry: &str, pem: &[u8]) {
        fs::write(dir.join("entries").join(format!("{registry}.crt")), pem).unwrap();
    }

    /// A set fed one CA for quay.io, valid for an hour, after its first pass; and when
    /// that was (unix seconds).
    fn started() -> (tempfile::TempDir, RegistrySet, CreatedRecord, i64) {
        let dir = tempfile::tempdir().unwrap();
        let mut set = fed(dir.path());
        let now = OffsetDateTime::now_utc().unix_timestamp();
        feed(
            dir.path(),
            "quay.io",
            &ca_pem("quay-ca", now - 60, now + 3600),
        );
        let mut record = CreatedRecord::default();
        set.start(&mut record);
        (dir, set, record, now)
    }

    fn status<'a>(set: &'a RegistrySet, registry: &str) -> Option<&'a Status> {
        let path = set.path_of(registry).display().to_string();
        set.statuses.iter().find(|s| s.bundle_path == path)
    }

    fn sync_errors(set: &RegistrySet, registry: &str, reason: &str) -> Option<u64> {
        let labels = FileReasonLabels {
            filepath: set.path_of(registry).display().to_string(),
            reason: reason.to_string(),
        };
        set.metrics.sync_errors.get(&labels).map(|c| c.get())
    }

    #[test]
    fn a_pass_writes_each_registry_and_says_how_its_file_stands() {
        let (_dir, set, _, now) = started();
        let written = fs::read(set.path_of("quay.io")).unwrap();
        let status = status(&set, "quay.io").unwrap().clone();
        assert_eq!(set.statuses.len(), 1);
        assert_eq!(
            status.sha256,
            Some(Fingerprint::of(&written).to_hex()),
            "the status names what is on disk"
        );
        assert_eq!(status.certificates.len(), 1);
        assert_eq!(status.certificates[0].not_after, now + 3600);
        assert!(status.file_valid);
        assert_eq!(status.file_problem, None);
        assert_eq!((status.in_sync, status.sync_problem), (Some(true), None));
        assert!(status.last_sync.is_some(), "a file in sync says when");
        assert_eq!(
            status.sources.iter().map(|s| s.up).collect::<Vec<_>>(),
            [true],
            "each file's line shows the set's sources"
        );
        // The next recheck is when the certificate expires, the second after its last.
        assert_eq!(set.boundary, Some(now + 3601));
        // Its counters have their series from the first pass, at 0: an alert on their
        // rate sees the first error.
        let labels = FileLabels {
            filepath: set.path_of("quay.io").display().to_string(),
        };
        assert_eq!(set.metrics.writes.get(&labels).map(|c| c.get()), Some(1));
        assert_eq!(set.metrics.repairs.get(&labels).map(|c| c.get()), Some(0));
        for reason in known::FILE_SYNC_ERRORS {
            assert_eq!(sync_errors(&set, "quay.io", reason), Some(0), "{reason}");
        }
    }

    #[test]
    fn the_same_entries_again_call_for_no_pass_and_new_ones_do() {
        let (dir, mut set, _, now) = started();
        assert!(!set.schedule.due);
        let spec = set.slots[0].source.spec.clone();
        let read = || Event::Content(Arc::new(local::registry_entries(&spec).unwrap()));
        set.observe(0, read(), Instant::now());
        assert!(
            !set.schedule.due,
            "the same entries, re-read, changed nothing"
        );
        feed(
            dir.path(),
            "ghcr.io",
            &ca_pem("ghcr-ca", now - 60, now + 3600),
        );
        set.observe(0, read(), Instant::now());
        assert!(set.schedule.due);
    }

    /// Runs `describe` for what `entries` (registry, PEM) build at `now`, with `on_disk`
    /// as the pass left it.
    fn describe_with(
        dir: &Path,
        entries: &[(&str, Vec<u8>)],
        on_disk: &[(&str, &[u8])],
        plan: &Plan,
        now: i64,
    ) -> RegistrySet {
        let mut set = fed(dir);
        for (registry, pem) in entries {
            feed(dir, registry, pem);
        }
        let read = local::registry_entries(&set.slots[0].source.spec).unwrap();
        let built = registry::build(registry::merge([read]), now);
        let outcome = Outcome2 {
            on_disk: on_disk
                .iter()
                .map(|(name, bytes)| (name.to_string(), bytes.to_vec()))
                .collect(),
            ..Outcome2::default()
        };
        set.describe(&built, plan, &BTreeMap::new(), &outcome, now);
        set
    }

    #[test]
    fn a_file_missing_empty_expired_or_not_as_built_is_said_so() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let valid = ca_pem("valid-ca", now - 60, now + 3600);
        let expired = ca_pem("expired-ca", now - 7200, now - 3600);
        let entries: Vec<(&str, Vec<u8>)> = ["missing.example", "expired.example", "junk.example"]
            .iter()
            .map(|r| (*r, valid.clone()))
            .collect();
        let on_disk: [(&str, &[u8]); 2] = [
            ("expired.example", &expired),
            ("junk.example", b"not a certificate\n"),
        ];
        let set = describe_with(dir.path(), &entries, &on_disk, &Plan::default(), now);
        let shown = |registry: &str| {
            let s = status(&set, registry).unwrap();
            (
                s.file_valid,
                s.certificates.len(),
                s.file_problem.clone(),
                s.sync_problem.clone(),
            )
        };
        let differs = Some("the file differs from the sources".to_string());
        let missing = set.path_of("missing.example").display().to_string();
        assert_eq!(
            shown("missing.example"),
            (
                false,
                0,
                Some(format!("{missing} does not exist")),
                differs.clone()
            )
        );
        // What is on disk is judged, not what was built for it.
        assert_eq!(
            shown("expired.example"),
            (
                false,
                1,
                Some("no certificate in the file is valid now".into()),
                differs.clone()
            )
        );
        assert_eq!(
            shown("junk.example"),
            (
                false,
                0,
                Some("the file holds no certificate".into()),
                differs
            )
        );
    }

    #[test]
    fn a_held_removal_has_its_line_and_other_files_left_alone_none() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let left = |name: &str, why| registry::plan::LeftAlone {
            name: name.to_string(),
            why,
        };
        let plan = Plan {
            left_alone: vec![
                left("gone.example", Why::RemovalsHeld),
                left("admins.example", Why::NotEmpty),
            ],
            ..Plan::default()
        };
        let set = describe_with(dir.path(), &[], &[], &plan, now);
        assert_eq!(set.statuses.len(), 1);
        let held = status(&set, "gone.example").unwrap();
        assert!(
            held.sync_problem
                .as_deref()
                .is_some_and(|p| p.contains("nothing is removed until it can")),
            "{:?}",
            held.sync_problem
        );
    }

    #[test]
    fn a_certificate_that_begins_now_is_no_boundary_to_wait_for() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let pem = ca_pem("quay-ca", now, now + 3600);
        let set = describe_with(
            dir.path(),
            &[("quay.io", pem.clone())],
            &[("quay.io", &pem)],
            &Plan::default(),
            now,
        );
        assert!(status(&set, "quay.io").unwrap().file_valid);
        assert_eq!(set.boundary, Some(now + 3601));
    }

    #[test]
    fn a_removal_of_what_is_already_gone_succeeds_and_a_directory_not_empty_stays_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let mut set = fed(dir.path());
        let root = dir.path().join("certs.d");
        fs::create_dir_all(root.join("full.example")).unwrap();
        fs::write(root.join("full.example").join("admin.crt"), "admin's").unwrap();
        let name = |n: &str| RegistryName::parse(n).unwrap();
        let plan = Plan {
            remove_files: vec![name("gone.example")],
            remove_directories: vec![name("full.example"), name("absent.example")],
            ..Plan::default()
        };
        let outcome = set.apply(
            &plan,
            &BTreeMap::new(),
            OffsetDateTime::now_utc(),
            Instant::now(),
        );
        assert!(outcome.errors.is_empty(), "{:?}", outcome.errors);
        assert!(outcome.not_removed.is_empty());
        assert_eq!(
            outcome.dirs_kept,
            BTreeSet::from(["full.example".to_string()]),
            "a directory that is not empty stays in the record, to go once it is; one already gone leaves it"
        );
        assert_eq!(sync_errors(&set, "gone.example", "io_error"), None);
    }

    /// `chattr` on `path`, for a test that needs root and a filesystem that has the flag.
    fn chattr(flag: &str, path: &Path) -> bool {
        std::process::Command::new("chattr")
            .arg(flag)
            .arg(path)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    #[test]
    fn a_write_that_keeps_failing_is_counted_and_retried_ever_later() {
        let (_dir, mut set, _, now) = started();
        let ca = set.path_of("quay.io");
        if !nix::unistd::geteuid().is_root() || !chattr("+i", &ca) {
            eprintln!("skipped: chattr +i needs root and a filesystem that has it");
            return;
        }
        let plan = Plan {
            writes: vec![registry::plan::Write {
                name: RegistryName::parse("quay.io").unwrap(),
                bytes: ca_pem("next-ca", now - 60, now + 3600),
                creates: false,
            }],
            ..Plan::default()
        };
        let found = BTreeMap::new();
        let first = Instant::now();
        let failed = set.apply(&plan, &found, OffsetDateTime::now_utc(), first);
        let until = set.write_retry.until;
        // Within the wait, the write waits; after it, it is tried again.
        let waited = set.apply(
            &plan,
            &found,
            OffsetDateTime::now_utc(),
            first + Duration::from_millis(500),
        );
        let second = first + Duration::from_secs(2);
        let failed_again = set.apply(&plan, &found, OffsetDateTime::now_utc(), second);
        let grown = set.write_retry.until;
        chattr("-i", &ca);
        assert!(failed.errors.contains_key("quay.io"), "{failed:?}");
        assert_eq!(until, Some(first + Duration::from_secs(1)));
        assert!(waited.waiting.contains_key("quay.io"), "{waited:?}");
        assert!(failed_again.errors.contains_key("quay.io"));
        assert_eq!(
            grown,
            Some(second + Duration::from_secs(2)),
            "the wait doubles while the same write keeps failing"
        );
        assert_eq!(sync_errors(&set, "quay.io", "permission_denied"), Some(2));
    }

    #[test]
    fn a_shadowed_entry_is_logged_once_while_it_lasts() {
        let dir = tempfile::tempdir().unwrap();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let (first, second) = (dir.path().join("first"), dir.path().join("second"));
        for source in [&first, &second] {
            fs::create_dir(source).unwrap();
            fs::write(
                source.join("quay.io.crt"),
                ca_pem("quay-ca", now - 60, now + 3600),
            )
            .unwrap();
        }
        let specs: Vec<SourceSpec> = [&first, &second]
            .iter()
            .map(|d| format!("dir:{}", d.display()).parse().unwrap())
            .collect();
        let root = dir.path().join("certs.d");
        let book = Book::open_with_sets(dir.path(), &[], std::slice::from_ref(&root));
        let mut set = RegistrySet::new(&root, &specs, 0, Arc::default(), book, dir.path());
        let mut record = CreatedRecord::default();
        let ((), log) = crate::testlog::Log::capture(|| set.start(&mut record));
        let shadowed = "(the first source wins)";
        assert_eq!(log.count(shadowed), 1, "{}", log.text());
        set.built = None;
        let ((), log) = crate::testlog::Log::capture(|| set.reconcile(&mut record));
        assert_eq!(
            log.count(shadowed),
            0,
            "said once while it lasts: {}",
            log.text()
        );
    }

    #[test]
    fn the_same_entries_are_built_again_only_once_a_validity_boundary_has_passed() {
        let (_dir, mut set, mut record, now) = started();
        let (merged, built) = set.built.clone().unwrap();
        assert!(!built.desired.files.is_empty());
        // A stand-in for what was built before, to see whether it is built again.
        let before = registry::Built::default();
        set.built = Some((merged.clone(), before.clone()));
        set.boundary = Some(now + 3600);
        set.reconcile(&mut record);
        assert_eq!(set.built.as_ref().unwrap().1, before, "not built again");
        set.built = Some((merged, before.clone()));
        set.boundary = Some(now - 1);
        set.reconcile(&mut record);
        assert_eq!(
            set.built.as_ref().unwrap().1.desired,
            built.desired,
            "built again"
        );
    }

    #[test]
    fn a_change_is_pending_until_every_file_is_in_sync() {
        let (_dir, mut set, mut record, _) = started();
        assert_eq!(set.pending_since, None, "written: nothing pending");
        // Something else changes the file while repairs back off: the repair waits, with
        // no error, and what is pending stays pending (its sync time is measured from it).
        fs::write(set.path_of("quay.io"), "changed by something else\n").unwrap();
        set.repair.until = Some(Instant::now() + Duration::from_secs(3600));
        let since = Instant::now();
        set.pending_since = Some(since);
        set.reconcile(&mut record);
        let quay = status(&set, "quay.io").unwrap();
        assert!(
            quay.sync_problem
                .as_deref()
                .is_some_and(|p| p.contains("repairs back off")),
            "{:?}",
            quay.sync_problem
        );
        assert_eq!(set.pending_since, Some(since));
    }

    #[test]
    fn a_registry_directory_holds_others_when_anything_but_its_ca_and_the_agents_temporary_files_is_there()
     {
        let dir = tempfile::tempdir().unwrap();
        let registry = dir.path().join("quay.io");
        assert!(
            holds_others(&registry),
            "one that cannot be read is not taken for empty"
        );
        fs::create_dir(&registry).unwrap();
        assert!(!holds_others(&registry));
        fs::write(registry.join(registry::plan::CA_FILE), "ca").unwrap();
        // The name a write of this agent's gives its temporary file.
        let temp = registry.join(".ca.crt.kubelet-ca-agent-tmp.4242.x1");
        fs::write(&temp, "a killed write's").unwrap();
        assert!(!holds_others(&registry));
        fs::write(registry.join("client.cert"), "an admin's").unwrap();
        assert!(holds_others(&registry));
    }
}
