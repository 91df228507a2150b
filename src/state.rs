//! What the agent keeps in `--state-dir` besides history: the retention memory of
//! `--retain-removed` (so that it survives restarts) and `managed-files.json` (SPEC 8).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};

use crate::bundle::{Certificate, Remembered};
use crate::writer::atomic::{self, Attributes};

const RETENTION_FILE: &str = "retention.json";
const MANAGED_FILES: &str = "managed-files.json";

pub struct StateDir {
    path: PathBuf,
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
}

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

    /// Records the managed file and the SHA-256 of its content, for drift monitors.
    pub fn save_managed_files(&self, bundle: &Path, sha256: &str) -> io::Result<()> {
        let path = std::path::absolute(bundle)?;
        let file = ManagedFiles {
            version: 1,
            files: vec![ManagedFile {
                path,
                sha256: sha256.to_string(),
            }],
        };
        self.write_json(MANAGED_FILES, &file)
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
