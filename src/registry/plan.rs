//! What to do under one registry set's DIR: a pure function from what the sources want,
//! what the agent recorded having created, and what the caller found on disk, to the
//! directories and files to create, write and remove, what to leave alone and why, and the
//! record to keep. The caller does the I/O, in the order of [`Plan`]'s fields.
//!
//! The rules:
//! - A registry in the sources gets `DIR/<host[:port]>/ca.crt`: the directory is made
//!   (0755) when missing, the file written (0644, atomically) when missing or different.
//! - The agent removes only what it created, as recorded: when a registry leaves the
//!   sources, its `ca.crt` is removed if the agent created it, and its directory if the
//!   agent created it and nothing else is left in it. An admin's extra file keeps the
//!   directory (the record keeps it too, so it goes once the admin's file has gone).
//! - An admin's `ca.crt` (one the agent did not create) for a registry the sources name is
//!   never overwritten. Upstream would overwrite it; but SPEC 4b says an admin's file under
//!   DIR is never touched, and a file that holds other certificates than the sources is
//!   either the admin's deliberate choice or a conflict that a person must settle: it is
//!   reported as a problem for that registry (shown in `/readyz?verbose` and the metrics),
//!   with what to do (remove it, and the agent writes its own). When it already holds the
//!   very certificates the sources give (the upstream writer's file, on a node that moves
//!   to the agent), the agent adopts it: it is recorded as the agent's, rewritten in the
//!   standard form if its bytes differ, kept up to date from then on, and removed when the
//!   registry leaves the sources, as the upstream writer would have done.
//! - A symbolic link where a registry's directory or its `ca.crt` should be is never
//!   followed, written through or removed: it is a problem for that registry alone. So is
//!   anything that is not a directory or a regular file.
//! - A registry whose entry was refused this time is held: what is on disk for it stays.
//!   When a source is not whole (an entry that could be any registry's), nothing is
//!   removed at all until it is.
//! - What the agent made and is gone, or was replaced by something else, is forgotten:
//!   the record never claims what is not the agent's any more.
//!
//! The record is updated as if every step succeeded. Save it after the steps, never
//! before: a crash in between then leaves something the agent made unrecorded, which it
//! will leave alone (the safe side), and never records as the agent's something it did not
//! make.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::name::RegistryName;
use crate::bundle::Fingerprint;
use crate::bundle::parse::scan;
use crate::text::escape;

/// The file each registry directory holds.
pub const CA_FILE: &str = "ca.crt";
/// Mode of a registry directory the agent creates.
pub const DIRECTORY_MODE: u32 = 0o755;
/// Mode of a `ca.crt` the agent writes.
pub const FILE_MODE: u32 = 0o644;
/// The record's file in the state directory.
pub const RECORD_FILE: &str = "registries-created.json";

/// What the sources want under one DIR.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// Each registry's `ca.crt` content.
    pub files: BTreeMap<RegistryName, Vec<u8>>,
    /// Registries whose entry was refused this time: left as they are on disk.
    pub held: BTreeSet<RegistryName>,
    /// A source was not whole: no registry is removed this time.
    pub hold_removals: bool,
}

/// What the agent created under one DIR, by registry directory name (`host[:port]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Created {
    /// Registry directories the agent made.
    #[serde(default)]
    pub directories: BTreeSet<String>,
    /// Registries whose `ca.crt` the agent made (or adopted).
    #[serde(default)]
    pub files: BTreeSet<String>,
}

impl Created {
    pub fn is_empty(&self) -> bool {
        self.directories.is_empty() && self.files.is_empty()
    }

    fn names(&self) -> impl Iterator<Item = &String> {
        self.directories.iter().chain(&self.files)
    }
}

/// The record as saved in the state directory ([`RECORD_FILE`]): one [`Created`] per
/// registry set, by its DIR as given on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedRecord {
    pub version: u32,
    #[serde(default)]
    pub sets: BTreeMap<PathBuf, Created>,
}

impl CreatedRecord {
    pub const VERSION: u32 = 1;

    pub fn new() -> Self {
        CreatedRecord {
            version: Self::VERSION,
            sets: BTreeMap::new(),
        }
    }

    /// Reads a saved record. A record of another version is refused: the caller then
    /// knows of nothing it created, and removes nothing (the safe side).
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        let record: CreatedRecord =
            serde_json::from_slice(bytes).map_err(|e| format!("not a registry record: {e}"))?;
        if record.version != Self::VERSION {
            return Err(format!(
                "registry record version {} (this agent reads version {})",
                record.version,
                Self::VERSION
            ));
        }
        Ok(record)
    }

    pub fn to_json(&self) -> Vec<u8> {
        let mut json = serde_json::to_vec_pretty(self).expect("a record serializes");
        json.push(b'\n');
        json
    }
}

/// What the caller found under DIR. Never read through a symbolic link: `lstat` the
/// entries, open `ca.crt` with `O_NOFOLLOW`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    pub root: Root,
    /// What is at `DIR/<name>`, for each name of [`to_look_at`] that exists; a name that
    /// is absent has nothing at its path.
    pub registries: BTreeMap<String, OnDisk>,
}

/// DIR itself. It is configuration (like `--bundle`'s directory), so a symbolic link to a
/// directory is a `Directory` here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Root {
    Directory,
    Missing,
    NotADirectory,
}

/// What is at `DIR/<name>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnDisk {
    /// A real directory.
    Directory {
        ca: CaFile,
        /// It holds something besides `ca.crt` (and the writer's temporary files).
        others: bool,
    },
    Symlink,
    /// A file, a FIFO, a socket...
    NotADirectory,
}

/// What is at `DIR/<name>/ca.crt`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaFile {
    Missing,
    Regular(Vec<u8>),
    Symlink,
    NotRegular,
    /// A regular file that could not be read (the reason, for the message).
    Unreadable(String),
}

/// Which registry names the caller must look at under DIR: those of the record and of the
/// sources. A record entry that is not a registry name is never looked at (see [`plan`]).
pub fn to_look_at(record: &Created, desired: &Desired) -> BTreeSet<String> {
    record
        .names()
        .filter(|name| RegistryName::parse(name).is_ok())
        .cloned()
        .chain(desired.files.keys().map(|n| n.dir().to_string()))
        .chain(desired.held.iter().map(|n| n.dir().to_string()))
        .collect()
}

/// A `ca.crt` to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    pub name: RegistryName,
    pub bytes: Vec<u8>,
    /// There is no `ca.crt` yet (a new file, root:root, [`FILE_MODE`]); else one is
    /// replaced.
    pub creates: bool,
}

/// What to do, in order: create DIR, create directories, write files, remove files,
/// remove directories (with `rmdir`, which refuses a directory that is not empty). Then
/// save `record`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// DIR is missing and something is to be written in it ([`DIRECTORY_MODE`]).
    pub create_root: bool,
    pub create_directories: Vec<RegistryName>,
    pub writes: Vec<Write>,
    pub remove_files: Vec<RegistryName>,
    pub remove_directories: Vec<RegistryName>,
    /// Registries whose `ca.crt` already holds what the sources give.
    pub unchanged: Vec<RegistryName>,
    /// Registries whose existing `ca.crt`, not the agent's, held the very certificates the
    /// sources give, and is the agent's from now on.
    pub adopted: Vec<RegistryName>,
    pub left_alone: Vec<LeftAlone>,
    pub problems: Vec<Problem>,
    /// The record once every step has succeeded.
    pub record: Created,
}

impl Plan {
    /// Nothing to create, write or remove.
    pub fn is_empty(&self) -> bool {
        !self.create_root
            && self.create_directories.is_empty()
            && self.writes.is_empty()
            && self.remove_files.is_empty()
            && self.remove_directories.is_empty()
    }
}

/// Something the agent leaves as it is, on purpose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftAlone {
    /// The registry's directory name.
    pub name: String,
    pub why: Why,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Its entry was refused: its file stays as it is until the entry is good again.
    Held,
    /// It left the sources, but a source is not whole: it is removed once it is.
    RemovalsHeld,
    /// The agent's directory still holds files the agent did not write.
    NotEmpty,
    /// What the agent made there was replaced by something else, which is not its own.
    Replaced,
}

impl fmt::Display for LeftAlone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = escape(&self.name);
        match self.why {
            Why::Held => write!(
                f,
                "registry {name}: its entry was refused, so its files stay as they are"
            ),
            Why::RemovalsHeld => write!(
                f,
                "registry {name}: it left the sources, but a source could not be read whole, so nothing is removed until it can"
            ),
            Why::NotEmpty => write!(
                f,
                "registry {name}: the directory the agent made holds files it did not write, so it stays (it goes once they have gone)"
            ),
            Why::Replaced => write!(
                f,
                "registry {name}: what the agent made there was replaced by something else, which is not the agent's and stays"
            ),
        }
    }
}

/// Something that keeps a registry (or the whole set) from being as the sources say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The registry's directory name; `None` for DIR itself.
    pub name: Option<String>,
    pub kind: ProblemKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProblemKind {
    RootNotADirectory,
    /// `DIR/<name>` is a symbolic link.
    Symlink,
    /// `DIR/<name>` is neither a directory nor a symbolic link.
    NotADirectory,
    /// `DIR/<name>/ca.crt` is a symbolic link.
    CaSymlink,
    /// `DIR/<name>/ca.crt` is not a regular file.
    CaNotRegular,
    CaUnreadable(String),
    /// `DIR/<name>/ca.crt` is not the agent's and holds other certificates.
    AdminCa,
    /// A record entry that is not a registry name: ignored and dropped.
    InvalidRecordEntry,
}

impl ProblemKind {
    /// The `reason` label of the error counters.
    pub fn reason(&self) -> &'static str {
        match self {
            ProblemKind::RootNotADirectory => "not_a_directory",
            ProblemKind::Symlink | ProblemKind::CaSymlink => "symlink",
            ProblemKind::NotADirectory => "not_a_directory",
            ProblemKind::CaNotRegular => "not_a_file",
            ProblemKind::CaUnreadable(_) => "unreadable",
            ProblemKind::AdminCa => "not_created_by_agent",
            ProblemKind::InvalidRecordEntry => "invalid_record",
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name.as_deref().map(escape).unwrap_or_default();
        match &self.kind {
            ProblemKind::RootNotADirectory => f.write_str(
                "the registry directory is not a directory: nothing under it is managed until it is",
            ),
            ProblemKind::Symlink => write!(
                f,
                "registry {name}: its directory is a symbolic link, which the agent never follows: nothing is written for it until it is a real directory or gone"
            ),
            ProblemKind::NotADirectory => write!(
                f,
                "registry {name}: its path is not a directory: nothing is written for it until it is one or gone"
            ),
            ProblemKind::CaSymlink => write!(
                f,
                "registry {name}: {CA_FILE} is a symbolic link, which the agent never follows or replaces: remove it to let the agent write the file"
            ),
            ProblemKind::CaNotRegular => write!(
                f,
                "registry {name}: {CA_FILE} is not a regular file: remove it to let the agent write the file"
            ),
            ProblemKind::CaUnreadable(error) => write!(
                f,
                "registry {name}: {CA_FILE} cannot be read: {}",
                escape(error)
            ),
            ProblemKind::AdminCa => write!(
                f,
                "registry {name}: {CA_FILE} was not written by the agent and holds other certificates than the sources give: it is left as it is; remove it to let the agent manage this registry"
            ),
            ProblemKind::InvalidRecordEntry => write!(
                f,
                "the record of created files names \"{name}\", which is not a registry: ignored, and dropped from the record"
            ),
        }
    }
}

/// Plans one registry set (see the module doc for the rules).
pub fn plan(record: &Created, desired: &Desired, on_disk: &Listing) -> Plan {
    let mut plan = Plan::default();
    let invalid: BTreeSet<&String> = record
        .names()
        .filter(|name| RegistryName::parse(name).is_err())
        .collect();
    for name in invalid {
        plan.problems.push(Problem {
            name: Some(name.clone()),
            kind: ProblemKind::InvalidRecordEntry,
        });
    }
    if on_disk.root == Root::NotADirectory {
        plan.problems.push(Problem {
            name: None,
            kind: ProblemKind::RootNotADirectory,
        });
        plan.record = valid_only(record);
        return plan;
    }
    let wanted: BTreeMap<&str, (&RegistryName, &Vec<u8>)> = desired
        .files
        .iter()
        .map(|(name, bytes)| (name.dir(), (name, bytes)))
        .collect();
    let held: BTreeSet<&str> = desired.held.iter().map(RegistryName::dir).collect();
    let root_missing = on_disk.root == Root::Missing;
    for dir in to_look_at(record, desired) {
        let found = if root_missing {
            None
        } else {
            on_disk.registries.get(&dir)
        };
        let mut step = Step {
            dir: &dir,
            found,
            ours_dir: record.directories.contains(&dir),
            ours_file: record.files.contains(&dir),
            plan: &mut plan,
        };
        let replaced = step.forget_what_is_gone();
        if let Some((name, bytes)) = wanted.get(dir.as_str()) {
            step.want(name, bytes);
        } else if held.contains(dir.as_str()) {
            step.leave(Why::Held);
        } else if step.ours_dir || step.ours_file {
            if desired.hold_removals {
                step.leave(Why::RemovalsHeld);
            } else {
                step.remove();
            }
        } else if replaced {
            step.leave(Why::Replaced);
        }
        let (ours_dir, ours_file) = (step.ours_dir, step.ours_file);
        if ours_dir {
            plan.record.directories.insert(dir.clone());
        }
        if ours_file {
            plan.record.files.insert(dir);
        }
    }
    plan.create_root = root_missing && !plan.create_directories.is_empty();
    plan
}

/// The record without its entries that are not registry names.
fn valid_only(record: &Created) -> Created {
    let valid = |set: &BTreeSet<String>| {
        set.iter()
            .filter(|name| RegistryName::parse(name).is_ok())
            .cloned()
            .collect()
    };
    Created {
        directories: valid(&record.directories),
        files: valid(&record.files),
    }
}

/// One registry's part of the plan.
struct Step<'a> {
    dir: &'a str,
    found: Option<&'a OnDisk>,
    ours_dir: bool,
    ours_file: bool,
    plan: &'a mut Plan,
}

impl Step<'_> {
    /// Forgets what the agent made and is no longer there; true when it was replaced by
    /// something else (not merely gone).
    fn forget_what_is_gone(&mut self) -> bool {
        let had = self.ours_dir || self.ours_file;
        match self.found {
            None => {
                self.ours_dir = false;
                self.ours_file = false;
                false
            }
            Some(OnDisk::Symlink | OnDisk::NotADirectory) => {
                self.ours_dir = false;
                self.ours_file = false;
                had
            }
            Some(OnDisk::Directory { ca, .. }) => match ca {
                CaFile::Regular(_) | CaFile::Unreadable(_) => false,
                CaFile::Missing => {
                    self.ours_file = false;
                    false
                }
                CaFile::Symlink | CaFile::NotRegular => {
                    let replaced = self.ours_file;
                    self.ours_file = false;
                    replaced
                }
            },
        }
    }

    fn name(&self) -> RegistryName {
        RegistryName::parse(self.dir).expect("only registry names are planned")
    }

    fn leave(&mut self, why: Why) {
        self.plan.left_alone.push(LeftAlone {
            name: self.dir.to_string(),
            why,
        });
    }

    fn problem(&mut self, kind: ProblemKind) {
        self.plan.problems.push(Problem {
            name: Some(self.dir.to_string()),
            kind,
        });
    }

    fn write(&mut self, name: &RegistryName, bytes: &[u8], creates: bool) {
        self.plan.writes.push(Write {
            name: name.clone(),
            bytes: bytes.to_vec(),
            creates,
        });
        self.ours_file = true;
    }

    /// The sources name this registry, with these bytes.
    fn want(&mut self, name: &RegistryName, bytes: &[u8]) {
        let ca = match self.found {
            None => {
                self.plan.create_directories.push(name.clone());
                self.ours_dir = true;
                return self.write(name, bytes, true);
            }
            Some(OnDisk::Symlink) => return self.problem(ProblemKind::Symlink),
            Some(OnDisk::NotADirectory) => return self.problem(ProblemKind::NotADirectory),
            Some(OnDisk::Directory { ca, .. }) => ca,
        };
        match ca {
            CaFile::Missing => self.write(name, bytes, true),
            CaFile::Regular(current) if self.ours_file => {
                if current.as_slice() == bytes {
                    self.plan.unchanged.push(name.clone());
                } else {
                    self.write(name, bytes, false);
                }
            }
            CaFile::Regular(current) if same_certificates(current, bytes) => {
                self.plan.adopted.push(name.clone());
                if current.as_slice() == bytes {
                    self.plan.unchanged.push(name.clone());
                    self.ours_file = true;
                } else {
                    self.write(name, bytes, false);
                }
            }
            CaFile::Regular(_) => self.problem(ProblemKind::AdminCa),
            CaFile::Symlink => self.problem(ProblemKind::CaSymlink),
            CaFile::NotRegular => self.problem(ProblemKind::CaNotRegular),
            CaFile::Unreadable(error) => self.problem(ProblemKind::CaUnreadable(error.clone())),
        }
    }

    /// The registry left the sources: remove what the agent made, and only that.
    fn remove(&mut self) {
        let Some(OnDisk::Directory { ca, others }) = self.found else {
            return;
        };
        let mut ca_left = !matches!(ca, CaFile::Missing);
        if self.ours_file {
            // Unlinking needs no read: an unreadable file of the agent's goes too.
            self.plan.remove_files.push(self.name());
            self.ours_file = false;
            ca_left = false;
        }
        if self.ours_dir {
            if *others || ca_left {
                self.leave(Why::NotEmpty);
            } else {
                self.plan.remove_directories.push(self.name());
                self.ours_dir = false;
            }
        }
    }
}

/// Whether a file holds exactly the certificates of `wanted` (as a set: the upstream
/// writer wrote its input as it came, in whatever form). A file with anything unreadable
/// in it is not the same.
fn same_certificates(current: &[u8], wanted: &[u8]) -> bool {
    let fingerprints = |bytes: &[u8]| {
        let scanned = scan(bytes);
        (scanned.problems.is_empty() && !scanned.certificates.is_empty()).then(|| {
            scanned
                .certificates
                .iter()
                .map(|(_, c)| c.fingerprint())
                .collect::<BTreeSet<Fingerprint>>()
        })
    };
    match (fingerprints(current), fingerprints(wanted)) {
        (Some(current), Some(wanted)) => current == wanted,
        _ => false,
    }
}
