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
pub const TEMP_MARKER: &str = ".kubelet-ca-agent-tmp.";

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

/// Whether `name` is one of this agent's temporary files (a write in progress, or one a
/// killed run left behind).
pub fn is_temp_file_name(name: &str) -> bool {
    name.contains(TEMP_MARKER)
}

/// Removes temporary files of this agent in `dir` left behind by a process that was killed
/// between create and rename. A writer holds an exclusive lock on its temporary file until
/// the rename, so a file whose lock can be taken has no writer left (a PID could have been
/// reused). Returns what it removed; a leftover that cannot be removed (an immutable
/// file) is logged and the others are still removed.
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
        if !is_temp_file_name(&name.to_string_lossy()) {
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
            // Removed by another cleanup since it was listed.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a temporary file left by a killed run");
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_of_a_bare_file_name_is_the_current_one() {
        assert_eq!(parent_dir(Path::new("kubelet-ca.crt")), Path::new("."));
        assert_eq!(
            parent_dir(Path::new("/etc/kubernetes/kubelet-ca.crt")),
            Path::new("/etc/kubernetes")
        );
    }

    #[test]
    fn a_temporary_file_is_hidden_and_removed_once_its_writer_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("kubelet-ca.crt");
        fs::write(&target, b"the bundle").unwrap();
        fs::write(dir.path().join("notes.txt"), b"an operator's").unwrap();
        let temp = TempFile::create(&target).unwrap();
        let name = temp
            .path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(
            name.starts_with(".kubelet-ca.crt.kubelet-ca-agent-tmp."),
            "{name}"
        );
        // While its writer holds it, a cleanup leaves it alone.
        assert_eq!(
            remove_stale_temp_files(dir.path()).unwrap(),
            [] as [PathBuf; 0]
        );
        // A writer that was killed released its lock: the next cleanup removes the file,
        // and nothing else.
        temp.file.unlock().unwrap();
        assert_eq!(
            remove_stale_temp_files(dir.path()).unwrap(),
            std::slice::from_ref(&temp.path)
        );
        let mut left: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, ["kubelet-ca.crt", "notes.txt"]);
    }

    #[test]
    fn cleanup_of_a_missing_directory_finds_nothing_and_of_a_file_fails() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            remove_stale_temp_files(&dir.path().join("missing"))
                .unwrap()
                .is_empty()
        );
        let file = dir.path().join("file");
        fs::write(&file, b"").unwrap();
        assert!(remove_stale_temp_files(&file).is_err());
    }

    #[test]
    fn a_failed_replace_leaves_the_path_as_it_was_and_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("kubelet-ca.crt");
        fs::create_dir(&target).unwrap();
        let attributes = Attributes {
            mode: 0o644,
            ..Attributes::default()
        };
        let error = replace(&target, b"bundle", &attributes).unwrap_err();
        assert_eq!(error.step, "renaming over the file");
        assert!(target.is_dir());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_temporary_file_that_cannot_be_created_fails_the_replace_at_once() {
        // Only a name already taken is stepped over; any other error (here, the directory
        // is gone) ends the replace, never a loop through names.
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("gone/kubelet-ca.crt");
        let (done, outcome) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let attributes = Attributes {
                mode: 0o644,
                ..Attributes::default()
            };
            let _ = done.send(replace(&target, b"bundle", &attributes));
        });
        let error = outcome
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the replace did not return")
            .unwrap_err();
        assert_eq!(error.step, "creating a temporary file");
        assert_eq!(error.error.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_leftover_with_the_same_name_does_not_stop_a_replace() {
        // After a restart in a container the agent often has the same PID again; a
        // temporary file an earlier run left with the name it would pick is stepped over.
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("kubelet-ca.crt");
        let prefix = temp_prefix(&target);
        let pid = std::process::id();
        let taken = SEQUENCE_IN_USE_BOUND;
        for n in 0..taken {
            fs::write(dir.path().join(format!("{prefix}{pid}.{n}")), b"").unwrap();
        }
        let attributes = Attributes {
            mode: 0o644,
            ..Attributes::default()
        };
        replace(&target, b"bundle", &attributes).unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"bundle");
    }

    /// More names than every other test of this process can have used.
    const SEQUENCE_IN_USE_BOUND: u64 = 2000;
}
