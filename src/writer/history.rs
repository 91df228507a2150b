//! The last replaced bundles, kept under `<state-dir>/history/` so that an operator can see
//! and restore what the node trusted before:
//! `<sequence>-<UTC time>-<sha256>.crt`, e.g.
//! `00000042-20261121T091500.123456789Z-5b19….crt`.
//!
//! Order is the sequence number the agent gives each entry, not the time in the name: after
//! the clock jumps back, a new entry is still the newest and the oldest is still the one
//! pruned. Only the agent's own entries are ever pruned, and a history directory that is a
//! symbolic link is not used at all (pruning through it would delete someone else's files).

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

/// One of the agent's own history entries, by its name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    /// 0 for entries written before names carried a sequence (`<time>-<sha256>.crt`):
    /// older than every numbered one.
    sequence: u64,
    stamp: String,
    sha256: String,
}

impl Entry {
    /// Parses `<sequence>-<time>-<sha256>.crt` or the older `<time>-<sha256>.crt`;
    /// `None` for any other name.
    fn parse(name: &str) -> Option<Entry> {
        let stem = name.strip_suffix(".crt")?;
        let (rest, sha256) = stem.rsplit_once('-')?;
        let (sequence, stamp) = match rest.split_once('-') {
            Some((seq, stamp)) => (seq.parse().ok().filter(|_| seq.len() == 8)?, stamp),
            None => (0, rest),
        };
        let is_stamp = stamp.len() == 26
            && stamp.ends_with('Z')
            && stamp.as_bytes()[8] == b'T'
            && stamp.bytes().filter(u8::is_ascii_digit).count() == 23;
        let is_sha = sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit());
        (is_stamp && is_sha).then(|| Entry {
            sequence,
            stamp: stamp.to_string(),
            sha256: sha256.to_string(),
        })
    }
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
        match fs::symlink_metadata(&self.dir) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} is a symbolic link; history is not kept through a link",
                        self.dir.display()
                    ),
                ));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => fs::create_dir(&self.dir)?,
            Err(e) => return Err(e),
        }
        let stamp = at
            .to_offset(time::UtcOffset::UTC)
            .format(format_description!(
                "[year][month][day]T[hour][minute][second].[subsecond digits:9]Z"
            ))
            .map_err(io::Error::other)?;
        // Listed once: the next sequence number comes from it, and so does what to prune.
        let mut entries = self.entries()?;
        let sequence = entries.last().map_or(0, |(e, _)| e.sequence) + 1;
        let sha256 = hex::encode(Sha256::digest(content));
        let path = self.dir.join(format!("{sequence:08}-{stamp}-{sha256}.crt"));
        // Only root reads history: it holds what the node trusted, for an operator.
        let attributes = Attributes {
            mode: 0o600,
            ..Attributes::default()
        };
        atomic::replace(&path, content, &attributes).map_err(|e| e.error)?;
        let saved = Entry {
            sequence,
            stamp,
            sha256,
        };
        entries.push((saved, path.clone()));
        let excess = entries.len().saturating_sub(KEEP);
        for (_, old) in &entries[..excess] {
            fs::remove_file(old)?;
        }
        Ok(path)
    }

    /// The agent's saved bundles, oldest first. Other files in the directory are not
    /// listed, and never pruned.
    pub fn list(&self) -> io::Result<Vec<PathBuf>> {
        Ok(self.entries()?.into_iter().map(|(_, path)| path).collect())
    }

    fn entries(&self) -> io::Result<Vec<(Entry, PathBuf)>> {
        let dir = match fs::read_dir(&self.dir) {
            Ok(dir) => dir,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut entries = Vec::new();
        for item in dir {
            let item = item?;
            let Some(entry) = item.file_name().to_str().and_then(Entry::parse) else {
                continue;
            };
            if item.file_type()?.is_file() {
                entries.push((entry, item.path()));
            }
        }
        entries.sort();
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "5b19a0c4e1f2d3b4a5968778695a4b3c2d1e0f1a2b3c4d5e6f708192a3b4c5d6";

    #[test]
    fn only_the_agents_own_names_are_entries() {
        let numbered = format!("00000042-20261121T091500.123456789Z-{SHA}.crt");
        let entry = Entry::parse(&numbered).unwrap();
        assert_eq!((entry.sequence, entry.sha256.as_str()), (42, SHA));
        let older = format!("20261121T091500.123456789Z-{SHA}.crt");
        assert_eq!(Entry::parse(&older).unwrap().sequence, 0);
        for foreign in [
            "ca.crt".to_string(),
            "backup-2026.crt".to_string(),
            format!("00000042-20261121T091500.123456789Z-{SHA}.pem"),
            format!("42-20261121T091500.123456789Z-{SHA}.crt"),
            format!("00000042-yesterday-{SHA}.crt"),
            format!("00000042-20261121T091500.123456789Z-{}.crt", &SHA[..60]),
        ] {
            assert_eq!(Entry::parse(&foreign), None, "{foreign}");
        }
    }

    #[test]
    fn order_is_the_sequence_whatever_the_clock_said() {
        let dir = tempfile::tempdir().unwrap();
        let history = History::new(dir.path());
        let late = OffsetDateTime::from_unix_timestamp(2_000_000_000).unwrap();
        let early = OffsetDateTime::from_unix_timestamp(1_000_000_000).unwrap();
        for i in 0..KEEP {
            history
                .record(format!("bundle {i}").as_bytes(), late)
                .unwrap();
        }
        // The clock jumped back: the next entry is still the newest, and kept.
        let newest = history.record(b"after the jump", early).unwrap();
        let listed = history.list().unwrap();
        assert_eq!(listed.len(), KEEP);
        assert_eq!(listed.last(), Some(&newest));
        assert_eq!(fs::read(&listed[0]).unwrap(), b"bundle 1");
    }

    #[test]
    fn foreign_files_and_linked_directories_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        fs::write(elsewhere.join("precious.crt"), b"mine").unwrap();
        let state = dir.path().join("state");
        fs::create_dir(&state).unwrap();
        std::os::unix::fs::symlink(&elsewhere, state.join("history")).unwrap();
        let error = History::new(&state)
            .record(b"x", OffsetDateTime::now_utc())
            .unwrap_err();
        assert!(error.to_string().contains("symbolic link"), "{error}");
        assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 1);

        let history = History::new(dir.path());
        fs::create_dir(history.dir()).unwrap();
        fs::write(history.dir().join("operator-backup.crt"), b"keep me").unwrap();
        for i in 0..KEEP + 3 {
            history
                .record(format!("{i}").as_bytes(), OffsetDateTime::now_utc())
                .unwrap();
        }
        assert_eq!(history.list().unwrap().len(), KEEP);
        assert!(history.dir().join("operator-backup.crt").exists());
    }
}

#[cfg(test)]
mod name_tests {
    use super::*;

    const SHA: &str = "5b19a0c4e1f2d3b4a5968778695a4b3c2d1e0f1a2b3c4d5e6f708192a3b4c5d6";
    const STAMP: &str = "20261121T091500.123456789Z";

    #[test]
    fn a_name_that_fails_one_rule_is_not_an_entry() {
        assert!(Entry::parse(&format!("00000042-{STAMP}-{SHA}.crt")).is_some());
        for foreign in [
            // The stamp: 26 characters, a T at 9, a final Z, 23 digits.
            format!("00000042-{}-{SHA}.crt", &STAMP[..25]),
            format!("00000042-{}0-{SHA}.crt", STAMP),
            format!("00000042-{}-{SHA}.crt", STAMP.replace('Z', "0")),
            format!("00000042-{}-{SHA}.crt", STAMP.replace('T', "0")),
            format!("00000042-{}-{SHA}.crt", STAMP.replacen('1', "x", 1)),
            // The SHA-256: 64 hex digits.
            format!("00000042-{STAMP}-{}.crt", SHA.replace('5', "g")),
            format!("00000042-{STAMP}-{}0.crt", SHA),
        ] {
            assert_eq!(Entry::parse(&foreign), None, "{foreign}");
        }
    }

    #[test]
    fn a_history_never_written_lists_nothing_and_one_that_is_not_a_directory_fails() {
        let dir = tempfile::tempdir().unwrap();
        assert!(History::new(dir.path()).list().unwrap().is_empty());
        fs::write(dir.path().join("history"), b"not a directory").unwrap();
        assert!(History::new(dir.path()).list().is_err());
    }
}
