//! The managed bundle file (SPEC 5): written only when its bytes change, replaced
//! atomically with its owner and SELinux label kept, and never removed. What it replaced is
//! handed back, for history (`history`).

pub mod atomic;
pub mod history;

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use xattr::FileExt;

use crate::bundle::MAX_SOURCE_BYTES;
use crate::fsutil::{FileKind, Links, Stat, open_regular};
pub use atomic::{Attributes, ReplaceError};
pub use history::History;

/// What [`BundleWriter::write`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The file already held these bytes; it was not touched.
    Unchanged,
    /// The file was replaced. `previous` is what it held (`None` if it did not exist).
    Replaced { previous: Option<Vec<u8>> },
}

/// The managed file could not be replaced; it was left as it was.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("cannot read {path}: {error}")]
    Read { path: PathBuf, error: io::Error },
    #[error("cannot replace {path}: {cause}; the file was left as it was")]
    Replace { path: PathBuf, cause: ReplaceError },
    /// A directory is at the path. A rename cannot replace a directory with a file, and
    /// the agent never removes what it did not write: someone has to.
    #[error(
        "{path} is a directory, not the bundle file: a rename cannot replace a directory, and the agent never removes one; remove it (rmdir, once you know what put it there) and the agent writes the file at once"
    )]
    Directory { path: PathBuf },
}

impl WriteError {
    /// The `reason` of a path that holds something the bundle cannot replace.
    pub const NOT_A_FILE: &'static str = "not_a_file";

    /// The `reason` label of `kubelet_ca_sync_errors_total`.
    pub fn reason(&self) -> &'static str {
        let error = match self {
            WriteError::Read { error, .. } => error,
            WriteError::Replace { cause, .. } => &cause.error,
            WriteError::Directory { .. } => return Self::NOT_A_FILE,
        };
        io_reason(error)
    }
}

/// The `reason` label of `kubelet_ca_sync_errors_total` for a failed file operation.
pub fn io_reason(error: &io::Error) -> &'static str {
    match error.kind() {
        io::ErrorKind::PermissionDenied => "permission_denied",
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => "no_space",
        io::ErrorKind::ReadOnlyFilesystem => "read_only",
        _ => "io_error",
    }
}

/// What is at the managed path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnDisk {
    Missing,
    /// A regular file: its bytes (read up to a bound: a larger file differs from every
    /// bundle anyway) and attributes.
    Regular {
        bytes: Vec<u8>,
        stat: Stat,
    },
    /// Something else (a symbolic link, a FIFO, a directory, ...): never opened or followed.
    Other(FileKind),
}

impl OnDisk {
    /// The file's bytes, when it is a regular file.
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            OnDisk::Regular { bytes, .. } => Some(bytes),
            _ => None,
        }
    }

    pub fn stat(&self) -> Option<&Stat> {
        match self {
            OnDisk::Regular { stat, .. } => Some(stat),
            _ => None,
        }
    }
}

pub struct BundleWriter {
    path: PathBuf,
    mode: u32,
}

impl BundleWriter {
    pub fn new(path: PathBuf, mode: u32) -> Self {
        BundleWriter { path, mode }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mode the file should have (`--file-mode`).
    pub fn mode(&self) -> u32 {
        self.mode
    }

    /// Looks at the managed path without following a link or opening anything but a
    /// regular file: a FIFO moved over the bundle must not hang the agent.
    pub fn read_current(&self) -> Result<OnDisk, WriteError> {
        let read_error = |error| WriteError::Read {
            path: self.path.clone(),
            error,
        };
        let (file, metadata) = match open_regular(&self.path, Links::NoFollow) {
            Ok(Ok(opened)) => opened,
            Ok(Err(kind)) => return Ok(OnDisk::Other(kind)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(OnDisk::Missing),
            Err(e) => return Err(read_error(e)),
        };
        // Read into a buffer of the file's size: growing one by doubling would hold 2 MiB
        // for a 1.1 MiB bundle, on every pass.
        let limit = MAX_SOURCE_BYTES * 4;
        let mut bytes = Vec::with_capacity((metadata.len() as usize).min(limit) + 1);
        (&file)
            .take(limit as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(read_error)?;
        Ok(OnDisk::Regular {
            bytes,
            stat: Stat::from(&metadata),
        })
    }

    /// Puts the file's mode back to `--file-mode`, and its owner back to `owner` when one
    /// is given, if something else changed them; `expected` is the file as last read, so
    /// that a file swapped since is left for the next pass. Returns whether anything was
    /// repaired. The content is not touched: the inode and consumers' watches stay. Done
    /// through a descriptor opened without following links, never through a path.
    pub fn repair_attributes(
        &self,
        expected: &Stat,
        owner: Option<(u32, u32)>,
    ) -> io::Result<bool> {
        let wrong_mode = expected.mode != self.mode;
        let wrong_owner = owner.filter(|&o| o != (expected.uid, expected.gid));
        if !wrong_mode && wrong_owner.is_none() {
            return Ok(false);
        }
        let (file, metadata) = match open_regular(&self.path, Links::NoFollow)? {
            Ok(opened) => opened,
            Err(_) => return Ok(false),
        };
        let now = Stat::from(&metadata);
        if (now.dev, now.ino) != (expected.dev, expected.ino) {
            return Ok(false);
        }
        if let Some((uid, gid)) = wrong_owner {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid))?;
        }
        if wrong_mode || wrong_owner.is_some() {
            // chown clears set-id bits and some systems the mode with them: set it after.
            file.set_permissions(fs::Permissions::from_mode(self.mode))?;
        }
        Ok(true)
    }

    /// Makes the path hold `content`, given what is there now (`current`, from
    /// [`BundleWriter::read_current`], read by the caller anyway): nothing happens when it
    /// already holds `content`; otherwise the path is replaced atomically (a link or a
    /// FIFO at the path is replaced itself, never followed). `owner` is the owner to give
    /// the new file when running as root; `None` keeps the replaced regular file's owner,
    /// or root:root.
    pub fn write(
        &self,
        content: &[u8],
        current: &OnDisk,
        owner: Option<(u32, u32)>,
    ) -> Result<Outcome, WriteError> {
        if current.bytes() == Some(content) {
            return Ok(Outcome::Unchanged);
        }
        if *current == OnDisk::Other(FileKind::Directory) {
            return Err(WriteError::Directory {
                path: self.path.clone(),
            });
        }
        let previous = current.bytes().map(<[u8]>::to_vec);
        let attributes = self.attributes_for_replacement(current, owner);
        atomic::replace(&self.path, content, &attributes).map_err(|cause| WriteError::Replace {
            path: self.path.clone(),
            cause,
        })?;
        Ok(Outcome::Replaced { previous })
    }

    /// Mode from `--file-mode`; as root, `owner`, else the replaced regular file's owner,
    /// else root:root; the replaced regular file's SELinux label where it has one. Nothing
    /// is read through a link: a link's target is not the file being replaced.
    fn attributes_for_replacement(
        &self,
        current: &OnDisk,
        owner: Option<(u32, u32)>,
    ) -> Attributes {
        let owner = nix::unistd::geteuid()
            .is_root()
            .then(|| owner.unwrap_or_else(|| current.stat().map_or((0, 0), |s| (s.uid, s.gid))));
        let selinux_label = match current {
            OnDisk::Regular { stat, .. } => open_regular(&self.path, Links::NoFollow)
                .ok()
                .and_then(Result::ok)
                .filter(|(_, m)| (m.dev(), m.ino()) == (stat.dev, stat.ino))
                .and_then(|(file, _)| file.get_xattr(atomic::SELINUX_XATTR).ok().flatten()),
            _ => None,
        };
        Attributes {
            mode: self.mode,
            owner,
            selinux_label,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bundle merged from several full sources is larger than one source may be: it must
    /// be read whole, or it would differ from every bundle built and be rewritten on every
    /// pass.
    #[test]
    fn a_bundle_larger_than_any_one_source_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubelet-ca.crt");
        let big: Vec<u8> = (0..MAX_SOURCE_BYTES + MAX_SOURCE_BYTES / 4)
            .map(|i| b'A' + (i % 26) as u8)
            .collect();
        std::fs::write(&path, &big).unwrap();
        match BundleWriter::new(path, 0o644).read_current().unwrap() {
            OnDisk::Regular { bytes, .. } => {
                assert_eq!(bytes.len(), big.len());
                assert!(bytes == big);
            }
            other => panic!("{other:?}"),
        }
    }

    /// Something huge put at the path is not read whole into memory: the read stops one
    /// byte past the bound (16 MiB), so the file still differs from every bundle, and a
    /// file of exactly the bound is read whole.
    #[test]
    fn a_huge_file_at_the_path_is_read_one_byte_past_the_bound_and_no_further() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubelet-ca.crt");
        let writer = BundleWriter::new(path.clone(), 0o644);
        let bound = MAX_SOURCE_BYTES * 4;
        for (size, read) in [(bound, bound), (bound + 4096, bound + 1)] {
            std::fs::write(&path, vec![b'x'; size]).unwrap();
            match writer.read_current().unwrap() {
                OnDisk::Regular { bytes, .. } => {
                    assert_eq!(bytes.len(), read, "a {size}-byte file")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// Only a missing file is missing: a path that cannot be opened for another reason is
    /// an error to report, never a file to write over.
    #[test]
    fn a_bundle_path_that_cannot_be_opened_is_an_error_not_a_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let not_a_dir = dir.path().join("file");
        std::fs::write(&not_a_dir, b"x").unwrap();
        let writer = BundleWriter::new(not_a_dir.join("kubelet-ca.crt"), 0o644);
        match writer.read_current() {
            Err(error @ WriteError::Read { .. }) => {
                assert!(error.to_string().contains("kubelet-ca.crt"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        let writer = BundleWriter::new(dir.path().join("absent.crt"), 0o644);
        assert!(matches!(writer.read_current(), Ok(OnDisk::Missing)));
    }

    /// A directory cannot be renamed over: it is refused by name before any temporary file
    /// is made, under a reason of its own (not the disk's `io_error`), and left in place.
    #[test]
    fn a_directory_at_the_path_is_refused_as_such_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubelet-ca.crt");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), b"x").unwrap();
        let writer = BundleWriter::new(path.clone(), 0o644);
        let current = writer.read_current().unwrap();
        assert_eq!(current, OnDisk::Other(FileKind::Directory));
        let error = writer.write(b"bundle", &current, None).unwrap_err();
        assert_eq!(error.reason(), "not_a_file");
        let message = error.to_string();
        assert!(
            message.contains("is a directory") && message.contains("rmdir"),
            "{message}"
        );
        assert!(path.join("inside").exists());
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "a temporary file was left: {left:?}");
    }

    #[test]
    fn a_failed_write_is_labelled_by_what_the_operator_has_to_fix() {
        for (kind, reason) in [
            (io::ErrorKind::PermissionDenied, "permission_denied"),
            (io::ErrorKind::StorageFull, "no_space"),
            (io::ErrorKind::QuotaExceeded, "no_space"),
            (io::ErrorKind::ReadOnlyFilesystem, "read_only"),
            (io::ErrorKind::InvalidData, "io_error"),
        ] {
            let path = PathBuf::from("/etc/kubernetes/kubelet-ca.crt");
            let read = WriteError::Read {
                path: path.clone(),
                error: io::Error::from(kind),
            };
            let replace = WriteError::Replace {
                path,
                cause: ReplaceError {
                    step: "renaming over the file",
                    error: io::Error::from(kind),
                },
            };
            assert_eq!(
                (read.reason(), replace.reason()),
                (reason, reason),
                "{kind:?}"
            );
        }
    }
}
