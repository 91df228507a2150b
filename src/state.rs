//! What the agent keeps in `--state-dir` besides history: the retention memory of
//! `--retain-removed` (so that it survives restarts) and `managed-files.json` (SPEC 8).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};

use crate::registry::CreatedRecord;

use crate::bundle::{Certificate, Remembered};
use crate::writer::atomic::{self, Attributes};

const RETENTION_FILE: &str = "retention.json";
const MANAGED_FILES: &str = "managed-files.json";

pub struct StateDir {
    path: PathBuf,
}

/// The entries of `managed-files.json`: each managed file's absolute path and the SHA-256
/// of its content when last written or verified. Shared by the targets of one state
/// directory, so that each file's record updates its own entry and the file always lists
/// them all.
#[derive(Clone)]
pub struct Book {
    index: Arc<StateDir>,
    entries: Arc<Mutex<BTreeMap<PathBuf, String>>>,
    /// The managed kubeconfigs among the entries, absolute.
    kubeconfigs: Arc<Vec<PathBuf>>,
}

impl Book {
    /// The book of `state_dir` for the files at `managed`: what `managed-files.json`
    /// already says of them (so that a restart does not drop a file's entry until its
    /// first pass), and nothing of files no longer managed.
    pub fn open(state_dir: &Path, managed: &[PathBuf]) -> Book {
        Book::open_with_sets(state_dir, managed, &[])
    }

    /// As [`Book::open`], keeping also what it says of files under the registry
    /// directories `sets` (`--manage-registries`), which come and go with their sources.
    pub fn open_with_sets(state_dir: &Path, managed: &[PathBuf], sets: &[PathBuf]) -> Book {
        let index = StateDir::new(state_dir.to_path_buf());
        let absolute = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
        let managed: Vec<PathBuf> = managed.iter().map(absolute).collect();
        let sets: Vec<PathBuf> = sets.iter().map(absolute).collect();
        let entries = match index.load_managed_files() {
            Ok(Some(recorded)) => recorded
                .files
                .into_iter()
                .filter(|f| managed.contains(&f.path) || sets.iter().any(|d| f.path.starts_with(d)))
                .map(|f| (f.path, f.sha256))
                .collect(),
            _ => BTreeMap::new(),
        };
        Book {
            index: Arc::new(index),
            entries: Arc::new(Mutex::new(entries)),
            kubeconfigs: Arc::default(),
        }
    }

    /// Marks the files at `paths` as managed kubeconfigs (`--manage-kubeconfig`).
    pub fn with_kubeconfigs(mut self, paths: &[PathBuf]) -> Book {
        self.kubeconfigs = Arc::new(
            paths
                .iter()
                .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
                .collect(),
        );
        self
    }

    /// Records `path` (made absolute) as holding content of `sha256`, and writes the file.
    pub fn record(&self, path: &Path, sha256: &str) -> io::Result<()> {
        let path = std::path::absolute(path)?;
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries.insert(path, sha256.to_string());
        // Written under the lock: two files' records never race to the one file.
        self.index.save_managed_files(&entries, &self.kubeconfigs)
    }

    /// Drops `path`'s entry (a registry file the agent removed), and writes the file.
    pub fn forget(&self, path: &Path) -> io::Result<()> {
        let path = std::path::absolute(path)?;
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if entries.remove(&path).is_some() {
            self.index.save_managed_files(&entries, &self.kubeconfigs)?;
        }
        Ok(())
    }

    /// The state directory this book is kept in.
    pub fn state_dir(&self) -> &StateDir {
        &self.index
    }
}

#[derive(Serialize, Deserialize)]
struct RetentionFile {
    version: u32,
    certificates: Vec<RetentionEntry>,
}

#[derive(Serialize, Deserialize)]
struct RetentionEntry {
    sha256: String,
    der: String,
    missing_since: Option<i64>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
pub struct ManagedFiles {
    pub version: u32,
    pub files: Vec<ManagedFile>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
pub struct ManagedFile {
    pub path: PathBuf,
    pub sha256: String,
    /// `kubeconfig` for a managed kubeconfig, whose CA data alone the agent keeps (drift
    /// checks compare the rest of it); absent for a file the agent keeps whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

/// [`ManagedFile::kind`] of a managed kubeconfig.
pub const KUBECONFIG_KIND: &str = "kubeconfig";

impl StateDir {
    pub fn new(path: PathBuf) -> Self {
        StateDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn ensure(&self) -> io::Result<()> {
        fs::create_dir_all(&self.path)
    }

    /// The retention memory, or `None` when there is none yet (or it cannot be used, which
    /// is logged: the agent then starts remembering afresh).
    pub fn load_retention(&self) -> Option<Vec<Remembered>> {
        let path = self.path.join(RETENTION_FILE);
        let text = match fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the retention memory; starting afresh");
                return None;
            }
        };
        let file: RetentionFile = match serde_json::from_slice(&text) {
            Ok(file) => file,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "the retention memory does not parse; starting afresh");
                return None;
            }
        };
        let remembered = file
            .certificates
            .into_iter()
            .filter_map(|entry| {
                let der = STANDARD.decode(&entry.der).ok()?;
                let certificate = Certificate::from_der(&der).ok()?;
                Some(Remembered {
                    certificate,
                    missing_since: entry.missing_since,
                })
            })
            .collect();
        Some(remembered)
    }

    /// Saves the retention memory, atomically, when it differs from what is on disk.
    pub fn save_retention(&self, memory: &[Remembered]) -> io::Result<()> {
        let file = RetentionFile {
            version: 1,
            certificates: memory
                .iter()
                .map(|r| RetentionEntry {
                    sha256: r.certificate.fingerprint().to_hex(),
                    der: STANDARD.encode(r.certificate.der()),
                    missing_since: r.missing_since,
                })
                .collect(),
        };
        self.write_json(RETENTION_FILE, &file)
    }

    /// Records every managed file and the SHA-256 of its content, for drift monitors; those
    /// among `kubeconfigs` are marked as kubeconfigs.
    pub fn save_managed_files(
        &self,
        files: &BTreeMap<PathBuf, String>,
        kubeconfigs: &[PathBuf],
    ) -> io::Result<()> {
        let file = ManagedFiles {
            version: 1,
            files: files
                .iter()
                .map(|(path, sha256)| ManagedFile {
                    path: path.clone(),
                    sha256: sha256.clone(),
                    kind: kubeconfigs
                        .contains(path)
                        .then(|| KUBECONFIG_KIND.to_string()),
                })
                .collect(),
        };
        self.write_json(MANAGED_FILES, &file)
    }

    /// Where `managed-files.json` is.
    pub fn managed_files_path(&self) -> PathBuf {
        self.path.join(MANAGED_FILES)
    }

    /// `managed-files.json`, or `None` when there is none yet. A file that cannot be read
    /// or does not parse is an error: whoever asks must not guess which files are managed.
    pub fn load_managed_files(&self) -> io::Result<Option<ManagedFiles>> {
        use crate::fsutil::{Links, not_regular, open_regular, read_bounded};
        const LIMIT: usize = 1 << 20;
        let path = self.managed_files_path();
        let file = match open_regular(&path, Links::Follow) {
            Ok(Ok((file, _))) => file,
            Ok(Err(kind)) => return Err(not_regular(&path, kind)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let bytes = read_bounded(&file, LIMIT)?;
        if bytes.len() > LIMIT {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "larger than 1 MiB: not one the agent wrote",
            ));
        }
        let managed: ManagedFiles = serde_json::from_slice(&bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if managed.version != 1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "version {} is not one this agent reads (1): it was written by another version",
                    managed.version
                ),
            ));
        }
        Ok(Some(managed))
    }

    /// What the agent created under each registry directory
    /// ([`crate::registry::RECORD_FILE`]). None recorded, or a record that cannot be read,
    /// is an empty record: the agent then removes nothing (the safe side); why it could
    /// not be read is returned beside it.
    pub fn load_registry_record(&self) -> (CreatedRecord, Option<String>) {
        let path = self.path.join(crate::registry::plan::RECORD_FILE);
        match fs::read(&path) {
            Ok(bytes) => match CreatedRecord::from_json(&bytes) {
                Ok(record) => (record, None),
                Err(e) => (
                    CreatedRecord::new(),
                    Some(format!("{}: {e}", path.display())),
                ),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => (CreatedRecord::new(), None),
            Err(e) => (
                CreatedRecord::new(),
                Some(format!("{}: {e}", path.display())),
            ),
        }
    }

    /// Saves the record of what the agent created under the registry directories.
    pub fn save_registry_record(&self, record: &CreatedRecord) -> io::Result<()> {
        self.write_json(crate::registry::plan::RECORD_FILE, record)
    }

    fn write_json(&self, name: &str, value: &impl Serialize) -> io::Result<()> {
        let mut bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
        bytes.push(b'\n');
        let path = self.path.join(name);
        if fs::read(&path).is_ok_and(|old| old == bytes) {
            return Ok(());
        }
        let attributes = Attributes {
            mode: 0o644,
            ..Attributes::default()
        };
        atomic::replace(&path, &bytes, &attributes).map_err(|e| io::Error::new(e.error.kind(), e))
    }
}
