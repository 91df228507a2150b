//! The managed bundle as a whole: the file, the state kept beside it (history, retention
//! memory, `managed-files.json`), shared by `sync` and the daemon.

use std::path::{Path, PathBuf};

use time::OffsetDateTime;

use crate::bundle::parse::scan;
use crate::bundle::{self, Built, Certificate, Fingerprint, Remembered};
use crate::cli::CommonArgs;
use crate::state::StateDir;
use crate::writer::{BundleWriter, Outcome, WriteError};

pub struct Target {
    writer: BundleWriter,
    state: StateDir,
    /// Whether `--retain-removed` is on, so that its memory is kept.
    retains: bool,
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
    pub fn new(common: &CommonArgs) -> Self {
        let state = StateDir::new(common.state_dir.clone());
        Target {
            writer: BundleWriter::new(common.bundle.clone(), common.file_mode, state.path()),
            state,
            retains: !common.retain_removed.is_zero(),
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
        match self.writer.remove_stale_temp_files() {
            Ok(removed) => {
                for path in removed {
                    tracing::info!(path = %path.display(), "removed a temporary file left by a killed run");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot look for stale temporary files"),
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

    /// Makes the file hold `built` (written only if its bytes differ) and records state.
    pub fn apply(
        &self,
        built: &Built,
        rendered: &[u8],
        now: OffsetDateTime,
    ) -> Result<Applied, WriteError> {
        let sha256 = Fingerprint::of(rendered).to_hex();
        let outcome = self.writer.write(rendered, now)?;
        if self.retains
            && let Err(e) = self.state.save_retention(&built.memory)
        {
            tracing::warn!(error = %e, "cannot save the retention memory");
        }
        if let Err(e) = self.state.save_managed_files(self.path(), &sha256) {
            tracing::warn!(error = %e, "cannot write managed-files.json");
        }
        let path = self.path().display();
        let certificates = built.bundle.len();
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

    pub fn state_dir(&self) -> PathBuf {
        self.state.path().to_path_buf()
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
