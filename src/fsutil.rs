//! File access that cannot be turned against the agent: nothing here opens a FIFO, a device
//! or a directory (a FIFO with no writer would block the open or the read forever), the
//! managed path is never followed through a symbolic link, and every read is bounded.

use std::fmt;
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// What sits at a path when it is not a regular file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Symlink,
    Directory,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
    Unknown,
}

impl FileKind {
    /// The kind of a non-regular file, `None` for a regular one.
    pub fn of(metadata: &Metadata) -> Option<FileKind> {
        let t = metadata.file_type();
        Some(if t.is_file() {
            return None;
        } else if t.is_symlink() {
            FileKind::Symlink
        } else if t.is_dir() {
            FileKind::Directory
        } else if t.is_fifo() {
            FileKind::Fifo
        } else if t.is_socket() {
            FileKind::Socket
        } else if t.is_char_device() {
            FileKind::CharDevice
        } else if t.is_block_device() {
            FileKind::BlockDevice
        } else {
            FileKind::Unknown
        })
    }
}

impl fmt::Display for FileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileKind::Symlink => "a symbolic link",
            FileKind::Directory => "a directory",
            FileKind::Fifo => "a FIFO (named pipe)",
            FileKind::Socket => "a socket",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Unknown => "not a regular file",
        })
    }
}

/// A path that holds something other than a regular file, as an I/O error that names it.
pub fn not_regular(path: &Path, kind: FileKind) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} is {kind}, not a regular file", path.display()),
    )
}

/// Whether symbolic links on the way to the file are followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// Follow them: a source in a projected ConfigMap volume is a chain of links.
    Follow,
    /// Do not: the managed path itself must be a regular file, and its owner and mode are
    /// never read or set through a link.
    NoFollow,
}

/// Opens `path` for reading only if it is a regular file. The type is checked before the
/// open (so that a FIFO or a device is never opened) and again on the open descriptor (so
/// that a swap in between is caught); the open itself never blocks (`O_NONBLOCK`).
/// `Ok(Err(kind))` says what is there instead.
pub fn open_regular(path: &Path, links: Links) -> io::Result<Result<(File, Metadata), FileKind>> {
    let before = match links {
        Links::Follow => fs::metadata(path)?,
        Links::NoFollow => fs::symlink_metadata(path)?,
    };
    if let Some(kind) = FileKind::of(&before) {
        return Ok(Err(kind));
    }
    let mut flags = nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC;
    if links == Links::NoFollow {
        flags |= nix::fcntl::OFlag::O_NOFOLLOW;
    }
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits())
        .open(path)
    {
        Ok(file) => file,
        // Replaced by a link between the check and the open.
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => return Ok(Err(FileKind::Symlink)),
        Err(e) => return Err(e),
    };
    let metadata = file.metadata()?;
    if let Some(kind) = FileKind::of(&metadata) {
        return Ok(Err(kind));
    }
    Ok(Ok((file, metadata)))
}

/// Reads at most `limit + 1` bytes, so that a caller can tell "too large" without holding
/// more than that in memory, whatever the file's size (a sparse file, `/dev/zero` on
/// standard input).
pub fn read_bounded(reader: impl Read, limit: usize) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    reader.take(limit as u64 + 1).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// A regular file's identity and attributes, as the agent compares them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub dev: u64,
    pub ino: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl From<&Metadata> for Stat {
    fn from(m: &Metadata) -> Self {
        Stat {
            dev: m.dev(),
            ino: m.ino(),
            mode: m.mode() & 0o7777,
            uid: m.uid(),
            gid: m.gid(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_named_and_never_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // A blocking open of a FIFO with no writer would hang this test.
        assert_eq!(
            open_regular(&fifo, Links::Follow).unwrap().err(),
            Some(FileKind::Fifo)
        );
        assert_eq!(
            open_regular(dir.path(), Links::Follow).unwrap().err(),
            Some(FileKind::Directory)
        );
        let message = not_regular(&fifo, FileKind::Fifo).to_string();
        assert!(
            message.ends_with("fifo is a FIFO (named pipe), not a regular file"),
            "{message}"
        );
    }

    #[test]
    fn links_are_followed_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        fs::write(&target, b"x").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(open_regular(&link, Links::Follow).unwrap().is_ok());
        assert_eq!(
            open_regular(&link, Links::NoFollow).unwrap().err(),
            Some(FileKind::Symlink)
        );
        let missing = open_regular(&dir.path().join("none"), Links::NoFollow).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn reads_stop_past_the_limit() {
        let zeros = io::repeat(0);
        assert_eq!(read_bounded(zeros, 1024).unwrap().len(), 1025);
        assert_eq!(read_bounded(&b"abc"[..], 1024).unwrap(), b"abc");
    }
}
