//! Change notifications for the files the agent cares about, through inotify: the managed
//! bundle (drift), the `file:` and `dir:` sources, the endpoint's TLS files and the agent's
//! own credentials (each user of this module runs its own watcher over its own files). Directories are watched, not files,
//! so that a rename over a file, a delete and re-create, or a projected volume swapping its
//! `..data` link are all seen.
//!
//! A watch can be lost: its directory deleted, moved away, or replaced by a new one. Each
//! watched directory's parent is watched too, and a watch whose directory went away is
//! re-established as soon as the path is a directory again (and checked once a minute in
//! any case); each time, the loop is told to look at everything again, since events may
//! have been missed meanwhile. Without inotify at all (its limits exhausted), the watcher
//! says so and retries once a minute; the loop's own once-a-minute re-verification keeps the
//! file correct meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use inotify::{EventMask, EventStream, Inotify, WatchDescriptor, WatchMask};
use tokio::sync::mpsc::UnboundedSender;

use crate::writer::atomic::parent_dir;

/// How often watches are checked against the paths they are for, whatever inotify said,
/// and a failed inotify start is retried.
pub const RECHECK_EVERY: Duration = Duration::from_secs(60);

/// Something changed on disk that the loop should look at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsEvent {
    /// What a target keeps changed on disk (by the target's position: 0 is `--bundle`,
    /// then each `--manage` file, then each `--manage-registries` set): a file was
    /// written, replaced, changed or deleted; under a registry set's directory, a registry
    /// directory appeared or went, or its `ca.crt` was written, replaced, changed or
    /// removed.
    Target(usize),
    /// A local source (by position in `--source` order) changed. `settled`: the change is
    /// complete (a file closed after writing, renamed into place, removed); otherwise a
    /// writer is at work in place and the read should wait for it.
    Source { index: usize, settled: bool },
    /// Events may have been lost (queue overflow, a watch re-established): look at
    /// everything again.
    Rescan,
    /// `None` when every directory is watched; otherwise what is not, and why.
    Health(Option<String>),
    /// A file of the endpoint's TLS configuration (serving certificate, key, client CA)
    /// changed. Sent to the server's reloader, not to the loop.
    Tls,
    /// The kubeconfig, or a file it names, changed (settled).
    Credentials,
}

/// The directories to watch and what their entries mean.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The managed files, the bundle first (the publisher has none).
    managed: Vec<PathBuf>,
    sources: Vec<(usize, SourceWatch)>,
    /// The endpoint's TLS files.
    tls: Vec<PathBuf>,
    /// The kubeconfig and the files it names (and the targets of those that are links).
    credentials: Vec<PathBuf>,
    /// The registry sets' directories: each is watched with every directory in it, as they
    /// come and go.
    registries: Vec<PathBuf>,
}

/// A local source as the watcher sees it (`file:` and `dir:`, SPEC 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Local<'a> {
    /// One file.
    File(&'a Path),
    /// A directory of files.
    Dir(&'a Path),
}

#[derive(Debug, Clone)]
enum SourceWatch {
    File { dir: PathBuf, name: OsString },
    Dir(PathBuf),
}

/// A kubelet projected volume swaps its content by renaming this link.
const PROJECTED_DATA: &str = "..data";

impl Plan {
    /// The managed files and the local sources, each by its position in `--source` order
    /// (`None`: a cluster source, nothing on disk).
    pub fn new(managed: &[PathBuf], sources: &[Option<Local<'_>>]) -> Plan {
        // inotify reports names within watched directories; paths are made absolute so
        // that the directories and their parents are unambiguous.
        let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let sources = sources
            .iter()
            .enumerate()
            .filter_map(|(i, local)| match local {
                Some(Local::File(path)) => {
                    let path = absolute(path);
                    let name = path.file_name().unwrap_or_default().to_os_string();
                    Some((
                        i,
                        SourceWatch::File {
                            dir: parent_dir(&path),
                            name,
                        },
                    ))
                }
                Some(Local::Dir(dir)) => Some((i, SourceWatch::Dir(absolute(dir)))),
                None => None,
            })
            .collect();
        Plan {
            managed: managed.iter().map(|p| absolute(p)).collect(),
            sources,
            tls: Vec::new(),
            credentials: Vec::new(),
            registries: Vec::new(),
        }
    }

    /// Also watch the registry sets' directories (`--manage-registries`), and the registry
    /// directories in them. A set's directory may be missing (the agent makes it when a
    /// registry needs it): it is watched for through its parent, and is no health problem.
    pub fn with_registry_dirs(mut self, dirs: &[PathBuf]) -> Plan {
        self.registries = dirs
            .iter()
            .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
            .collect();
        self
    }

    /// Also watch the endpoint's TLS files.
    pub fn with_tls_files(mut self, files: &[PathBuf]) -> Plan {
        self.tls = files
            .iter()
            .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
            .collect();
        self
    }

    /// Also watch the agent's credentials.
    pub fn with_credential_files(mut self, files: &[PathBuf]) -> Plan {
        self.credentials = files.to_vec();
        self
    }

    /// Each directory that must exist, with what it is for. The directories of the
    /// `--manage` files and the registry sets are not among them: the agent makes them when
    /// it has something to write there (a cloud CA file on a platform without one has no
    /// directory on many nodes), and watches for them through their parents meanwhile.
    pub fn dirs(&self) -> BTreeMap<PathBuf, String> {
        let mut dirs = BTreeMap::new();
        if let Some(bundle) = self.managed.first() {
            dirs.insert(
                parent_dir(bundle),
                format!("the directory of the bundle {}", bundle.display()),
            );
        }
        for (_, watch) in &self.sources {
            let (dir, what) = match watch {
                SourceWatch::File { dir, name } => {
                    (dir, format!("file source {}", dir.join(name).display()))
                }
                SourceWatch::Dir(dir) => (dir, format!("dir source {}", dir.display())),
            };
            dirs.entry(dir.clone())
                .or_insert_with(|| format!("the directory of the {what}"));
        }
        for file in &self.tls {
            dirs.entry(parent_dir(file))
                .or_insert_with(|| format!("the directory of the TLS file {}", file.display()));
        }
        for file in &self.credentials {
            dirs.entry(parent_dir(file)).or_insert_with(|| {
                format!("the directory of the credential file {}", file.display())
            });
        }
        dirs
    }

    /// What a change to `name` inside `dir` means.
    fn classify(&self, dir: &Path, name: &OsStr, settled: bool) -> Vec<FsEvent> {
        let mut events = Vec::new();
        for (index, file) in self.managed.iter().enumerate() {
            if dir == parent_dir(file) && Some(name) == file.file_name() {
                events.push(FsEvent::Target(index));
            }
        }
        for (index, watch) in &self.sources {
            let concerns = match watch {
                SourceWatch::File { dir: d, name: n } => {
                    d == dir && (n == name || name == PROJECTED_DATA)
                }
                SourceWatch::Dir(d) => {
                    let ext = Path::new(name).extension().and_then(OsStr::to_str);
                    d == dir && (matches!(ext, Some("crt" | "pem")) || name == PROJECTED_DATA)
                }
            };
            if concerns {
                events.push(FsEvent::Source {
                    index: *index,
                    settled,
                });
            }
        }
        // A TLS file is reloaded once its change is complete (closed, or renamed into place).
        let tls = self.tls.iter().any(|file| {
            dir == parent_dir(file) && (Some(name) == file.file_name() || name == PROJECTED_DATA)
        });
        if tls && settled {
            events.push(FsEvent::Tls);
        }
        let credentials = self.credentials.iter().any(|file| {
            dir == parent_dir(file) && (Some(name) == file.file_name() || name == PROJECTED_DATA)
        });
        if credentials && settled {
            events.push(FsEvent::Credentials);
        }
        for (index, root) in self.registries.iter().enumerate() {
            // The directory itself appearing or going, an entry of it, or anything in a
            // registry directory (its ca.crt, or an admin's file that keeps a directory
            // the agent made); the agent's own temporary files are not news.
            let concerns = (dir == root)
                || (Some(dir) == root.parent() && Some(name) == root.file_name())
                || (dir.parent() == Some(root.as_path())
                    && !crate::writer::atomic::is_temp_file_name(&name.to_string_lossy()));
            if concerns {
                events.push(FsEvent::Target(self.managed.len() + index));
            }
        }
        events
    }
}

const DIR_MASK: WatchMask = WatchMask::CREATE
    .union(WatchMask::DELETE)
    .union(WatchMask::MODIFY)
    .union(WatchMask::CLOSE_WRITE)
    .union(WatchMask::MOVED_FROM)
    .union(WatchMask::MOVED_TO)
    .union(WatchMask::ATTRIB)
    .union(WatchMask::DELETE_SELF)
    .union(WatchMask::MOVE_SELF)
    .union(WatchMask::ONLYDIR);
/// A parent is watched only for its entries appearing and going.
const PARENT_MASK: WatchMask = WatchMask::CREATE
    .union(WatchMask::DELETE)
    .union(WatchMask::MOVED_FROM)
    .union(WatchMask::MOVED_TO)
    .union(WatchMask::DELETE_SELF)
    .union(WatchMask::MOVE_SELF)
    .union(WatchMask::ONLYDIR);
/// The end of a change: what a reader can act on at once.
const SETTLED: EventMask = EventMask::CLOSE_WRITE
    .union(EventMask::MOVED_TO)
    .union(EventMask::MOVED_FROM)
    .union(EventMask::DELETE)
    .union(EventMask::ATTRIB);
/// The watch itself went away or now watches something else.
const WATCH_LOST: EventMask = EventMask::DELETE_SELF
    .union(EventMask::MOVE_SELF)
    .union(EventMask::IGNORED)
    .union(EventMask::UNMOUNT);

struct Watched {
    wd: WatchDescriptor,
    /// Device and inode of the directory the watch is on.
    identity: (u64, u64),
}

struct Watcher {
    plan: Plan,
    /// Directories to watch with their masks (a directory that is also a parent gets both).
    wanted: BTreeMap<PathBuf, WatchMask>,
    roles: BTreeMap<PathBuf, String>,
    watched: BTreeMap<PathBuf, Watched>,
    paths: HashMap<WatchDescriptor, PathBuf>,
    events: UnboundedSender<FsEvent>,
    /// Where [`FsEvent::Tls`] goes.
    tls_events: Option<UnboundedSender<()>>,
    health: Option<Option<String>>,
    /// The registry directories found in the registry sets' directories, each watched
    /// (in `wanted`) for as long as it is there.
    registry_dirs: BTreeMap<PathBuf, WatchMask>,
}

/// Watches until the receiving end of `events` is dropped; TLS file changes go to
/// `tls_events`.
pub async fn run(
    plan: Plan,
    events: UnboundedSender<FsEvent>,
    tls_events: Option<UnboundedSender<()>>,
) {
    let roles = plan.dirs();
    let mut wanted: BTreeMap<PathBuf, WatchMask> = BTreeMap::new();
    let optional: Vec<PathBuf> = plan.managed.iter().skip(1).map(|f| parent_dir(f)).collect();
    for dir in roles.keys().chain(&plan.registries).chain(&optional) {
        *wanted.entry(dir.clone()).or_insert(WatchMask::empty()) |= DIR_MASK;
        if let Some(parent) = dir.parent() {
            *wanted
                .entry(parent.to_path_buf())
                .or_insert(WatchMask::empty()) |= PARENT_MASK;
        }
    }
    let mut watcher = Watcher {
        plan,
        wanted,
        roles,
        watched: BTreeMap::new(),
        paths: HashMap::new(),
        events,
        tls_events,
        health: None,
        registry_dirs: BTreeMap::new(),
    };
    loop {
        let mut stream = match Inotify::init().and_then(|i| i.into_event_stream(vec![0u8; 8192])) {
            Ok(stream) => stream,
            Err(e) => {
                watcher.report(Some(format!(
                    "{}; running on the once-a-minute re-verification",
                    init_problem(&e)
                )));
                if watcher.events.is_closed() {
                    return;
                }
                tokio::time::sleep(RECHECK_EVERY).await;
                continue;
            }
        };
        watcher.watched.clear();
        watcher.paths.clear();
        watcher.ensure(&mut stream);
        if watcher.follow(&mut stream).await.is_break() {
            return;
        }
        // The stream failed: start inotify afresh, and look at everything again.
        let _ = watcher.events.send(FsEvent::Rescan);
    }
}

impl Watcher {
    /// Handles events until the loop goes away (`Break`) or the stream fails (`Continue`).
    async fn follow(&mut self, stream: &mut EventStream<Vec<u8>>) -> std::ops::ControlFlow<()> {
        let mut recheck = tokio::time::interval(RECHECK_EVERY);
        recheck.tick().await;
        loop {
            let event = tokio::select! {
                event = stream.next() => event,
                _ = recheck.tick() => {
                    self.ensure(stream);
                    if self.events.is_closed() {
                        return std::ops::ControlFlow::Break(());
                    }
                    continue;
                }
            };
            let event = match event {
                Some(Ok(event)) => event,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "reading inotify events failed; restarting the file watch");
                    return std::ops::ControlFlow::Continue(());
                }
                None => return std::ops::ControlFlow::Continue(()),
            };
            if event.mask.contains(EventMask::Q_OVERFLOW) {
                self.send(FsEvent::Rescan);
                continue;
            }
            let Some(dir) = self.paths.get(&event.wd).cloned() else {
                continue;
            };
            if event.mask.intersects(WATCH_LOST) {
                self.ensure(stream);
                continue;
            }
            let Some(name) = event.name else { continue };
            let settled = event.mask.intersects(SETTLED);
            for change in self.plan.classify(&dir, &name, settled) {
                self.send(change);
            }
            // A watched directory appeared, went or was replaced under its parent; or an
            // entry of a registry set's directory did (a registry directory to watch).
            let path = dir.join(&name);
            if self.roles.contains_key(&path)
                || self.plan.registries.contains(&path)
                || self.plan.registries.contains(&dir)
            {
                self.ensure(stream);
            }
            if self.events.is_closed() {
                return std::ops::ControlFlow::Break(());
            }
        }
    }

    /// Brings the watched registry directories in line with the directories now in each
    /// registry set's directory (never following a link): new ones are added to what
    /// [`Watcher::ensure`] watches, and the watches of those gone are dropped.
    fn find_registry_dirs(&mut self, stream: &mut EventStream<Vec<u8>>) {
        let mut found = BTreeMap::new();
        for root in &self.plan.registries {
            let Ok(entries) = std::fs::read_dir(root) else {
                continue;
            };
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    found.insert(entry.path(), DIR_MASK);
                }
            }
        }
        let gone: Vec<PathBuf> = self
            .registry_dirs
            .keys()
            .filter(|p| !found.contains_key(*p) && !self.wanted.contains_key(*p))
            .cloned()
            .collect();
        for path in gone {
            self.forget(&path, stream);
        }
        self.registry_dirs = found;
    }

    fn send(&self, event: FsEvent) {
        match (event, &self.tls_events) {
            (FsEvent::Tls, Some(tls)) => {
                let _ = tls.send(());
            }
            (FsEvent::Tls, None) => {}
            (event, _) => {
                let _ = self.events.send(event);
            }
        }
    }

    /// Makes each watch point at the directory now at its path; re-established watches
    /// mean events may have been missed, so the loop looks at everything again.
    fn ensure(&mut self, stream: &mut EventStream<Vec<u8>>) {
        let mut problems = Vec::new();
        let mut renewed = false;
        self.find_registry_dirs(stream);
        let wanted = self.wanted.iter().chain(&self.registry_dirs);
        for (path, mask) in wanted.map(|(p, m)| (p.clone(), *m)).collect::<Vec<_>>() {
            let role = self.roles.get(&path).cloned();
            let identity = std::fs::metadata(&path).and_then(|m| {
                if m.is_dir() {
                    Ok((m.dev(), m.ino()))
                } else {
                    Err(io::Error::from(io::ErrorKind::NotADirectory))
                }
            });
            let current = self.watched.get(&path).map(|w| w.identity);
            match identity {
                Ok(identity) if current == Some(identity) => {}
                Ok(identity) => {
                    self.forget(&path, stream);
                    match stream.watches().add(&path, mask) {
                        Ok(wd) => {
                            self.paths.insert(wd.clone(), path.clone());
                            self.watched.insert(path.clone(), Watched { wd, identity });
                            // A registry directory that appeared is news of its own
                            // (FsEvent::Target), not a sign of events lost.
                            renewed |= !self.registry_dirs.contains_key(&path);
                        }
                        Err(e) => problems.push(format!(
                            "cannot watch {}: {}",
                            path.display(),
                            watch_problem(&e)
                        )),
                    }
                }
                Err(e) => {
                    if self.forget(&path, stream) {
                        renewed = true;
                    }
                    // A parent that is missing matters only through its child.
                    if let Some(role) = role {
                        let why = match e.kind() {
                            io::ErrorKind::NotFound => "does not exist".to_string(),
                            io::ErrorKind::NotADirectory => "is not a directory".to_string(),
                            _ => e.to_string(),
                        };
                        problems.push(format!("{} {why} ({role})", path.display()));
                    }
                }
            }
        }
        if renewed && self.health.is_some() {
            tracing::info!(
                "file watches re-established; looking at the bundle and the sources again"
            );
            self.send(FsEvent::Rescan);
        }
        let health = (!problems.is_empty()).then(|| {
            format!(
                "{}; changes there are seen by the once-a-minute re-verification",
                problems.join("; ")
            )
        });
        self.report(health);
    }

    /// Drops the watch on `path`, if any. Returns whether there was one.
    fn forget(&mut self, path: &Path, stream: &mut EventStream<Vec<u8>>) -> bool {
        match self.watched.remove(path) {
            Some(old) => {
                self.paths.remove(&old.wd);
                // Gone already when its directory was deleted.
                let _ = stream.watches().remove(old.wd);
                true
            }
            None => false,
        }
    }

    fn report(&mut self, health: Option<String>) {
        if self.health.as_ref() != Some(&health) {
            match &health {
                Some(problem) => tracing::warn!("file watch degraded: {problem}"),
                None if self.health.is_some() => tracing::info!("file watch restored"),
                None => {}
            }
            self.health = Some(health.clone());
            self.send(FsEvent::Health(health));
        }
    }
}

fn sysctl(name: &str) -> String {
    std::fs::read_to_string(format!("/proc/sys/fs/inotify/{name}"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Why inotify could not start, with the limit to raise.
fn init_problem(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(nix::libc::EMFILE) => format!(
            "cannot start inotify: the per-user limit on inotify instances is reached \
             (fs.inotify.max_user_instances = {}; raise it, e.g. sysctl -w fs.inotify.max_user_instances=1024) \
             or the open-file limit is ({e})",
            sysctl("max_user_instances")
        ),
        Some(nix::libc::ENFILE) => {
            format!("cannot start inotify: the system-wide open-file limit is reached ({e})")
        }
        _ => format!("cannot start inotify: {e}"),
    }
}

/// Why a directory could not be watched, with the limit to raise.
fn watch_problem(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(nix::libc::ENOSPC) => format!(
            "the per-user limit on inotify watches is reached (fs.inotify.max_user_watches = {}; \
             raise it, e.g. sysctl -w fs.inotify.max_user_watches=524288)",
            sysctl("max_user_watches")
        ),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_routed_by_directory_and_name() {
        let sources = [
            Some(Local::File(Path::new("/srv/ca/signer.crt"))),
            Some(Local::Dir(Path::new("/srv/signers"))),
            None,
        ];
        let plan = Plan::new(
            &[
                PathBuf::from("/etc/kubernetes/kubelet-ca.crt"),
                PathBuf::from("/etc/pki/cloud/ca-bundle.pem"),
            ],
            &sources,
        );
        let at = |dir: &str, name: &str| plan.classify(Path::new(dir), OsStr::new(name), true);
        assert_eq!(
            at("/etc/kubernetes", "kubelet-ca.crt"),
            [FsEvent::Target(0)]
        );
        assert_eq!(at("/etc/pki/cloud", "ca-bundle.pem"), [FsEvent::Target(1)]);
        assert_eq!(at("/etc/pki/cloud", "ca-bundle.pem.old"), []);
        assert_eq!(
            at(
                "/etc/kubernetes",
                ".kubelet-ca.crt.kubelet-ca-agent-tmp.1.2"
            ),
            []
        );
        assert_eq!(at("/etc/kubernetes", "kubeconfig"), []);
        let file = FsEvent::Source {
            index: 0,
            settled: true,
        };
        assert_eq!(at("/srv/ca", "signer.crt"), std::slice::from_ref(&file));
        assert_eq!(at("/srv/ca", "..data"), [file]);
        assert_eq!(at("/srv/ca", "other.crt"), []);
        let dir = FsEvent::Source {
            index: 1,
            settled: true,
        };
        assert_eq!(at("/srv/signers", "new.pem"), std::slice::from_ref(&dir));
        assert_eq!(at("/srv/signers", "new.crt.tmp"), []);
        assert_eq!(at("/srv/signers", "..data"), [dir]);
        // The bundle's and the sources' directories must exist; a --manage file's is made
        // when needed.
        let dirs = plan.dirs();
        assert_eq!(dirs.len(), 3, "{dirs:?}");
        assert!(!dirs.contains_key(Path::new("/etc/pki/cloud")));
        let registries = plan
            .clone()
            .with_registry_dirs(&[PathBuf::from("/etc/docker/certs.d")]);
        let at_registries =
            |dir: &str, name: &str| registries.classify(Path::new(dir), OsStr::new(name), true);
        // The set is the target after the two files.
        let set = [FsEvent::Target(2)];
        assert_eq!(at_registries("/etc/docker/certs.d", "quay.io:443"), set);
        assert_eq!(
            at_registries("/etc/docker/certs.d/quay.io:443", "ca.crt"),
            set
        );
        assert_eq!(
            at_registries("/etc/docker/certs.d/quay.io:443", "notes"),
            set
        );
        assert_eq!(
            at_registries(
                "/etc/docker/certs.d/quay.io:443",
                ".ca.crt.kubelet-ca-agent-tmp.123"
            ),
            []
        );
        assert_eq!(at_registries("/etc/docker", "certs.d"), set);
        assert_eq!(at_registries("/etc/docker", "other"), []);
        assert_eq!(
            at_registries("/etc/docker/certs.d/quay.io:443/sub", "ca.crt"),
            []
        );
        assert_eq!(
            registries.dirs().len(),
            3,
            "the registry directory need not exist"
        );
        let plan = plan.with_tls_files(&[PathBuf::from("/etc/kubelet-ca-agent/tls.crt")]);
        let tls = |name: &str, settled| {
            plan.classify(
                Path::new("/etc/kubelet-ca-agent"),
                OsStr::new(name),
                settled,
            )
        };
        assert_eq!(tls("tls.crt", true), [FsEvent::Tls]);
        assert_eq!(
            tls("tls.crt", false),
            [],
            "half written: wait for the close"
        );
        assert_eq!(tls("tls.key.new", true), []);
        assert_eq!(plan.dirs().len(), 4);
    }

    #[test]
    fn a_credential_file_or_its_link_swapped_reads_the_credentials_again() {
        let plan = Plan::new(&[], &[]).with_credential_files(&[
            PathBuf::from("/var/lib/kubelet/kubeconfig"),
            PathBuf::from("/var/lib/kubelet/pki/kubelet-client-current.pem"),
        ]);
        let at = |dir: &str, name: &str, settled| {
            plan.classify(Path::new(dir), OsStr::new(name), settled)
        };
        assert_eq!(
            at("/var/lib/kubelet", "kubeconfig", true),
            [FsEvent::Credentials]
        );
        // The kubelet renames a new link over kubelet-client-current.pem.
        assert_eq!(
            at("/var/lib/kubelet/pki", "kubelet-client-current.pem", true),
            [FsEvent::Credentials]
        );
        assert_eq!(
            at("/var/lib/kubelet", "kubeconfig", false),
            [],
            "half written"
        );
        assert_eq!(
            at("/var/lib/kubelet/pki", "kubelet-server-current.pem", true),
            []
        );
        assert_eq!(plan.dirs().len(), 2);
    }
}
