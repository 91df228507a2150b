//! The managed bundle file (SPEC 5): written only when its bytes change, replaced
//! atomically with its owner and SELinux label kept, and never removed. What it replaced is
//! handed back, for history (`history`).

pub mod atomic;
pub mod history;

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::bundle::MAX_SOURCE_BYTES;
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
}

impl WriteError {
    /// The `reason` label of `kubelet_ca_sync_errors_total`.
    pub fn reason(&self) -> &'static str {
        let error = match self {
            WriteError::Read { error, .. } => error,
            WriteError::Replace { cause, .. } => &cause.error,
        };
        match error.kind() {
            io::ErrorKind::PermissionDenied => "permission_denied",
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => "no_space",
            io::ErrorKind::ReadOnlyFilesystem => "read_only",
            _ => "io_error",
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

    /// The file's current bytes, `None` if it does not exist. A file larger than any valid
    /// bundle is read only up to that size: it differs from every bundle anyway.
    pub fn read_current(&self) -> Result<Option<Vec<u8>>, WriteError> {
        let read = || -> io::Result<Vec<u8>> {
            let mut bytes = Vec::new();
            File::open(&self.path)?
                .take(MAX_SOURCE_BYTES as u64 * 4)
                .read_to_end(&mut bytes)?;
            Ok(bytes)
        };
        match read() {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(WriteError::Read {
                path: self.path.clone(),
                error,
            }),
        }
    }

    /// Puts the file's mode back to `--file-mode` if something changed it. Returns whether
    /// it did. The content is not touched, so the inode and consumers' watches stay.
    pub fn repair_mode(&self) -> io::Result<bool> {
        use std::os::unix::fs::PermissionsExt;
        let metadata = fs::metadata(&self.path)?;
        if metadata.permissions().mode() & 0o7777 == self.mode {
            return Ok(false);
        }
        fs::set_permissions(&self.path, fs::Permissions::from_mode(self.mode))?;
        Ok(true)
    }

    /// Makes the file hold `content`, given what it holds now (`current`, from
    /// [`BundleWriter::read_current`], read by the caller anyway): nothing happens when it
    /// already holds `content`; otherwise the file is replaced atomically.
    pub fn write(&self, content: &[u8], current: Option<&[u8]>) -> Result<Outcome, WriteError> {
        if current == Some(content) {
            return Ok(Outcome::Unchanged);
        }
        let previous = current.map(<[u8]>::to_vec);
        let attributes = self.attributes_for_replacement(previous.is_some());
        atomic::replace(&self.path, content, &attributes).map_err(|cause| WriteError::Replace {
            path: self.path.clone(),
            cause,
        })?;
        Ok(Outcome::Replaced { previous })
    }

    /// Mode from `--file-mode`; as root, the replaced file's owner (root:root for a new
    /// file); the replaced file's SELinux label where it has one.
    fn attributes_for_replacement(&self, exists: bool) -> Attributes {
        let metadata = exists.then(|| fs::metadata(&self.path).ok()).flatten();
        let owner = nix::unistd::geteuid()
            .is_root()
            .then(|| metadata.as_ref().map_or((0, 0), |m| (m.uid(), m.gid())));
        let selinux_label = exists
            .then(|| xattr::get(&self.path, atomic::SELINUX_XATTR).ok().flatten())
            .flatten();
        Attributes {
            mode: self.mode,
            owner,
            selinux_label,
        }
    }
}
