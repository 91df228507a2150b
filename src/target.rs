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

use time::OffsetDateTime;

use crate::bundle::parse::scan;
use crate::bundle::{self, Built, Certificate, Fingerprint, Remembered};
use crate::cli::CommonArgs;
use crate::state::StateDir;
use crate::writer::{BundleWriter, History, Outcome, WriteError};

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
}

impl Keeper {
    fn keep(&self, record: Record) {
        let (what, result) = match record {
            Record::History(old, at) => (
                "save the replaced bundle to history",
                self.history.record(&old, at).map(drop),
            ),
            Record::Retention(memory) => (
                "save the retention memory",
                self.state.save_retention(&memory),
            ),
            Record::ManagedFiles(sha256) => (
                "write managed-files.json",
                self.state.save_managed_files(&self.bundle, &sha256),
            ),
        };
        if let Err(e) = result {
            tracing::warn!(state_dir = %self.state.path().display(), error = %e, "could not {what}");
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
}

impl Target {
    /// A target that writes its records before `apply` returns.
    pub fn new(common: &CommonArgs) -> Self {
        let keeper = Keeper {
            state: StateDir::new(common.state_dir.clone()),
            history: History::new(&common.state_dir),
            bundle: common.bundle.clone(),
        };
        Target {
            writer: BundleWriter::new(common.bundle.clone(), common.file_mode),
            state: StateDir::new(common.state_dir.clone()),
            retains: !common.retain_removed.is_zero(),
            records: Records::Inline(keeper),
        }
    }

    /// Moves record keeping to a thread of its own. Dropping the target waits for it.
    pub fn with_background_records(mut self) -> Self {
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
                .spawn(move || records.into_iter().for_each(|r| keeper.keep(r)))
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
            Records::Inline(keeper) => keeper.keep(record),
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
    /// the caller just read from it); the replaced bundle
    /// goes to history unless `history` is false (a repair replaces someone else's content,
    /// not a bundle of ours). The caller records the state that goes with it
    /// ([`Target::record`]).
    pub fn apply(
        &self,
        built: &Built,
        rendered: &[u8],
        current: Option<&[u8]>,
        now: OffsetDateTime,
        history: bool,
    ) -> Result<Applied, WriteError> {
        let sha256 = Fingerprint::of(rendered).to_hex();
        let outcome = self.writer.write(rendered, current)?;
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
                }
            }
            Outcome::Replaced { previous } => {
                let old = previous
                    .as_deref()
                    .map(readable_certificates)
                    .unwrap_or_default();
                let diff = bundle::diff(&old, built.bundle.certificates());
                let (added, removed) = (diff.added.len(), diff.removed.len());
                tracing::info!(bundle = %path, certificates, added, removed, sha256 = %sha256, "bundle written");
                if history {
                    self.keep_history(previous, now);
                }
                Applied {
                    replaced: true,
                    sha256,
                    added,
                    removed,
                }
            }
        };
        Ok(applied)
    }

    /// Puts back `content` (the adopted bundle) after something else changed the file.
    pub fn restore(&self, content: &[u8], current: Option<&[u8]>) -> Result<Applied, WriteError> {
        let sha256 = Fingerprint::of(content).to_hex();
        let replaced = matches!(
            self.writer.write(content, current)?,
            Outcome::Replaced { .. }
        );
        Ok(Applied {
            replaced,
            sha256,
            added: 0,
            removed: 0,
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

    /// History keeps bundles: content that does not parse as one (garbage, or a bundle
    /// with a key pasted in by someone) is not copied into the state directory.
    fn keep_history(&self, previous: Option<Vec<u8>>, now: OffsetDateTime) {
        if let Some(old) = previous.filter(|old| bundle::parse_source(old).is_ok()) {
            self.keep(Record::History(old, now));
        }
    }
}

impl Drop for Target {
    /// Lets the records thread finish what is queued, so that a clean stop loses nothing.
    fn drop(&mut self) {
        if let Records::Background { queue, thread } = &mut self.records {
            drop(queue.take());
            if let Some(thread) = thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// Whatever certificates can be read from a file, even a damaged one.
pub fn readable_certificates(bytes: &[u8]) -> Vec<Certificate> {
    scan(bytes)
        .certificates
        .into_iter()
        .map(|(_, c)| c)
        .collect()
}
