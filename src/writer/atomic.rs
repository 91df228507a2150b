//! Atomic file replacement: readers see the old complete file or the new complete file,
//! never anything else, even if the process dies at any instant or the machine loses power.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use xattr::FileExt;

use crate::fsutil::{Links, open_regular};

/// The extended attribute holding a file's SELinux label.
pub const SELINUX_XATTR: &str = "security.selinux";

/// Marks our temporary files: `.<target name>` + this + `<pid>.<sequence>`.
const TEMP_MARKER: &str = ".kubelet-ca-agent-tmp.";

/// What the new file should look like besides its bytes.
#[derive(Debug, Clone, Default)]
pub struct Attributes {
    pub mode: u32,
    /// `fchown` the new file to this (uid, gid) before it becomes visible.
    pub owner: Option<(u32, u32)>,
    /// Value of `security.selinux` to set on the new file.
    pub selinux_label: Option<Vec<u8>>,
}

/// One step of a replace that failed; the target is untouched when this is returned.
#[derive(Debug, thiserror::Error)]
#[error("{step} failed: {error}")]
pub struct ReplaceError {
    pub step: &'static str,
    #[source]
    pub error: io::Error,
}

impl ReplaceError {
    fn at(step: &'static str) -> impl FnOnce(io::Error) -> ReplaceError {
        move |error| ReplaceError { step, error }
    }
}

/// Replaces `target` with `content`: a temporary file in the same directory (created
/// `O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC`), written, given its mode, owner and label,
/// fsynced, renamed over `target`, and the directory fsynced so the rename is durable.
pub fn replace(target: &Path, content: &[u8], attributes: &Attributes) -> Result<(), ReplaceError> {
    let dir = parent_dir(target);
    let temp = TempFile::create(target).map_err(ReplaceError::at("creating a temporary file"))?;
    let file = &temp.file;
    (&*file)
        .write_all(content)
        .map_err(ReplaceError::at("writing the temporary file"))?;
    file.set_permissions(Permissions::from_mode(attributes.mode))
        .map_err(ReplaceError::at("setting the mode"))?;
    if let Some((uid, gid)) = attributes.owner {
        std::os::unix::fs::fchown(file, Some(uid), Some(gid))
            .map_err(ReplaceError::at("setting the owner"))?;
    }
    if let Some(label) = &attributes.selinux_label {
        // The new file already has its directory's default label, usually the same; a
        // policy that forbids relabelling must not block every update.
        let current = file.get_xattr(SELINUX_XATTR).ok().flatten();
        if current.as_ref() != Some(label)
            && let Err(e) = file.set_xattr(SELINUX_XATTR, label)
        {
            tracing::warn!(error = %e, "cannot copy the SELinux label to the new bundle; it keeps its directory's default label");
        }
    }
    file.sync_all()
        .map_err(ReplaceError::at("fsync of the temporary file"))?;
    fs::rename(&temp.path, target).map_err(ReplaceError::at("renaming over the file"))?;
    temp.committed();
    // The file is replaced now; failing to make the rename durable is worth a warning,
    // not a failed write.
    if let Err(e) = File::open(&dir).and_then(|d| d.sync_all()) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot fsync the directory: the new file may not survive a power loss");
    }
    Ok(())
}

/// Removes temporary files of this agent in `dir` left behind by a process that was killed
/// between create and rename. A writer holds an exclusive lock on its temporary file until
/// the rename, so a file whose lock can be taken has no writer left (a PID could have been
/// reused). Returns what it removed.
pub fn remove_stale_temp_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if !name.to_string_lossy().contains(TEMP_MARKER) {
            continue;
        }
        let path = entry.path();
        // Only regular files are ours: a FIFO or a link with a temp-like name is left alone
        // and never opened (a FIFO would block the open).
        let file = match open_regular(&path, Links::NoFollow) {
            Ok(Ok((file, _))) => file,
            Ok(Err(kind)) => {
                tracing::warn!(path = %path.display(), "not removing {kind} named like a temporary file of this agent");
                continue;
            }
            Err(_) => continue,
        };
        if file.try_lock().is_err() {
            continue;
        }
        match fs::remove_file(&path) {
            Ok(()) => removed.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// The directory a path lives in (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn temp_prefix(target: &Path) -> String {
    let name = target.file_name().unwrap_or_default().to_string_lossy();
    format!(".{name}{TEMP_MARKER}")
}

/// A temporary file that removes itself unless it was renamed into place.
struct TempFile {
    path: PathBuf,
    file: File,
    committed: bool,
}

impl TempFile {
    fn create(target: &Path) -> io::Result<TempFile> {
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        let dir = parent_dir(target);
        let prefix = temp_prefix(target);
        loop {
            let n = SEQUENCE.fetch_add(1, Ordering::Relaxed);
            let mut name = OsString::from(&prefix);
            name.push(format!("{}.{n}", std::process::id()));
            let path = dir.join(name);
            // create_new is O_CREAT|O_EXCL; std adds O_CLOEXEC to every open.
            let opened = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc_flags())
                .open(&path);
            match opened {
                Ok(file) => {
                    // Held until the rename: it tells a cleanup that this file is in use.
                    file.try_lock().map_err(io::Error::from)?;
                    return Ok(TempFile {
                        path,
                        file,
                        committed: false,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn committed(mut self) {
        self.committed = true;
    }
}

fn libc_flags() -> i32 {
    use nix::fcntl::OFlag;
    (OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits()
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.path);
        }
    }
}
