//! The last replaced bundles, kept under `<state-dir>/history/` so that an operator can see
//! and restore what the node trusted before. Names sort by time:
//! `20261121T091500.123456789Z-<sha256>.crt`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use time::OffsetDateTime;
use time::macros::format_description;

use super::atomic::{self, Attributes};

/// How many replaced bundles are kept.
pub const KEEP: usize = 10;

pub struct History {
    dir: PathBuf,
}

impl History {
    pub fn new(state_dir: &Path) -> Self {
        History {
            dir: state_dir.join("history"),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Saves `content` (the bundle about to be replaced) and prunes to the newest [`KEEP`].
    pub fn record(&self, content: &[u8], at: OffsetDateTime) -> io::Result<PathBuf> {
        fs::create_dir_all(&self.dir)?;
        let stamp = at
            .to_offset(time::UtcOffset::UTC)
            .format(format_description!(
                "[year][month][day]T[hour][minute][second].[subsecond digits:9]Z"
            ))
            .map_err(io::Error::other)?;
        let sha = hex::encode(Sha256::digest(content));
        let path = self.dir.join(format!("{stamp}-{sha}.crt"));
        // Only root reads history: it holds what the node trusted, for an operator.
        let attributes = Attributes {
            mode: 0o600,
            ..Attributes::default()
        };
        atomic::replace(&path, content, &attributes).map_err(|e| e.error)?;
        self.prune()?;
        Ok(path)
    }

    /// The saved bundles, oldest first.
    pub fn entries(&self) -> io::Result<Vec<PathBuf>> {
        let mut entries: Vec<PathBuf> = match fs::read_dir(&self.dir) {
            Ok(dir) => dir
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "crt"))
                .collect(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        entries.sort();
        Ok(entries)
    }

    fn prune(&self) -> io::Result<()> {
        let entries = self.entries()?;
        let excess = entries.len().saturating_sub(KEEP);
        for old in &entries[..excess] {
            fs::remove_file(old)?;
        }
        Ok(())
    }
}
