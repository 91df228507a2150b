//! `drift check`: what is on disk under the root ([`Root::look`]), and the verdict on one
//! file of the rendered config against it ([`judge`], pure).
//!
//! Like the MCO's config drift monitor, a file is judged by its type (a regular file, never
//! followed through a link), its permission bits and its bytes; owner and group are not
//! compared. Unlike it, a file without `contents.source` is only required to exist (Ignition
//! keeps whatever an existing file holds), `append` is understood rather than refused, and
//! content from a URL that cannot be fetched offline is reported as not checked.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use serde::Serialize;

use super::content::{Expected, MAX_CONTENT_BYTES};
use crate::bundle::Fingerprint;
use crate::fsutil::{FileKind, Links, open_regular, read_bounded};

/// What is at a path under the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Missing,
    NotRegular(FileKind),
    Regular {
        mode: u32,
        size: u64,
        /// The content, read up to [`MAX_CONTENT_BYTES`] + 1 bytes; `None` when not needed.
        content: Option<Vec<u8>>,
    },
}

/// The directory the rendered config's paths are relative to.
pub struct Root {
    path: PathBuf,
    /// The root opened as a directory, for `openat2(RESOLVE_IN_ROOT)`: a link under the root
    /// resolves as it would on the node, never to the host outside it. `None` where the
    /// kernel has no `openat2` (before 5.6, or a seccomp filter refusing it): paths are then
    /// joined to the root as text.
    dir: Option<OwnedFd>,
}

impl Root {
    pub fn open(path: &Path) -> io::Result<Root> {
        let how = OpenHow::new().flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC);
        let dir = match openat2(nix::fcntl::AT_FDCWD, path, how) {
            Ok(fd) => Some(fd),
            Err(Errno::ENOSYS | Errno::EPERM) => {
                std::fs::read_dir(path)?;
                None
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Root {
            path: path.to_path_buf(),
            dir,
        })
    }

    /// What is at `node_path` (absolute, normalized) under the root; the content is read
    /// when `read` is true. A link at the path itself is never followed, a FIFO never opened.
    pub fn look(&self, node_path: &Path, read: bool) -> io::Result<Found> {
        let relative = node_path.strip_prefix("/").unwrap_or(node_path);
        let relative = if relative.as_os_str().is_empty() {
            Path::new(".")
        } else {
            relative
        };
        let Some(dir) = &self.dir else {
            return self.look_joined(&self.path.join(relative), read);
        };
        let open = |flags: OFlag| {
            let how = OpenHow::new()
                .flags(flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
                .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
            openat2(dir, relative, how)
        };
        let handle = match open(OFlag::O_PATH) {
            Ok(fd) => File::from(fd),
            Err(Errno::ENOENT | Errno::ENOTDIR) => return Ok(Found::Missing),
            Err(e) => return Err(e.into()),
        };
        let metadata = handle.metadata()?;
        if let Some(kind) = FileKind::of(&metadata) {
            return Ok(Found::NotRegular(kind));
        }
        if !read {
            return Ok(Found::Regular {
                mode: metadata.mode() & 0o7777,
                size: metadata.size(),
                content: None,
            });
        }
        let file = match open(OFlag::O_RDONLY | OFlag::O_NONBLOCK) {
            Ok(fd) => File::from(fd),
            Err(Errno::ENOENT | Errno::ENOTDIR) => return Ok(Found::Missing),
            Err(Errno::ELOOP) => return Ok(Found::NotRegular(FileKind::Symlink)),
            Err(e) => return Err(e.into()),
        };
        // Swapped between the two opens: judge what was opened.
        let metadata = file.metadata()?;
        if let Some(kind) = FileKind::of(&metadata) {
            return Ok(Found::NotRegular(kind));
        }
        Ok(Found::Regular {
            mode: metadata.mode() & 0o7777,
            size: metadata.size(),
            content: Some(read_bounded(&file, MAX_CONTENT_BYTES)?),
        })
    }

    fn look_joined(&self, path: &Path, read: bool) -> io::Result<Found> {
        match open_regular(path, Links::NoFollow) {
            Ok(Ok((file, metadata))) => Ok(Found::Regular {
                mode: metadata.mode() & 0o7777,
                size: metadata.size(),
                content: if read {
                    Some(read_bounded(&file, MAX_CONTENT_BYTES)?)
                } else {
                    None
                },
            }),
            Ok(Err(kind)) => Ok(Found::NotRegular(kind)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Found::Missing),
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOTDIR) => Ok(Found::Missing),
            Err(e) => Err(e),
        }
    }
}

/// One way a file differs from the rendered config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Drift {
    /// Nothing at the path.
    Missing,
    /// Something other than a regular file at the path (a link, a directory, ...).
    NotRegular { found: String },
    /// Permission bits, in octal (`0644`).
    Mode { expected: String, found: String },
    /// Different bytes. The SHA-256 of what was found is left out for a file too large to
    /// read whole.
    Content {
        expected_bytes: usize,
        expected_sha256: String,
        found_bytes: u64,
        found_sha256: Option<String>,
    },
    /// An `append`-only file that does not end with what its `append` entries add.
    AppendMissing {
        expected_suffix_bytes: usize,
        found_bytes: u64,
    },
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let short = |sha: &str| format!("sha256 {}…", &sha[..12.min(sha.len())]);
        match self {
            Drift::Missing => f.write_str("missing"),
            Drift::NotRegular { found } => write!(f, "{found}, expected a regular file"),
            Drift::Mode { expected, found } => write!(f, "mode {found}, expected {expected}"),
            Drift::Content {
                expected_bytes,
                expected_sha256,
                found_bytes,
                found_sha256,
            } => {
                let found = match found_sha256 {
                    Some(sha) => format!("{found_bytes} bytes ({})", short(sha)),
                    None => format!("{found_bytes} bytes"),
                };
                write!(
                    f,
                    "content differs: {found}, expected {expected_bytes} bytes ({})",
                    short(expected_sha256)
                )
            }
            Drift::AppendMissing {
                expected_suffix_bytes,
                found_bytes,
            } => write!(
                f,
                "does not end with the {expected_suffix_bytes} bytes its append entries add ({found_bytes} bytes)"
            ),
        }
    }
}

/// The mode a file should have: its `mode`, else 0644 when Ignition writes its content,
/// else none (Ignition keeps an existing file's mode when it writes no content).
pub fn expected_mode(mode: Option<u32>, expected: &Expected) -> Option<u32> {
    mode.or(match expected {
        Expected::Any | Expected::EndsWith(_) => None,
        Expected::Exact(_) | Expected::Remote(_) => Some(0o644),
    })
}

/// How `found` differs from a file that should have `mode` and `expected` content. Pure.
pub fn judge(mode: Option<u32>, expected: &Expected, found: &Found) -> Vec<Drift> {
    let (found_mode, size, content) = match found {
        Found::Missing => return vec![Drift::Missing],
        Found::NotRegular(kind) => {
            return vec![Drift::NotRegular {
                found: kind.to_string(),
            }];
        }
        Found::Regular {
            mode,
            size,
            content,
        } => (*mode, *size, content.as_deref()),
    };
    let mut drift = Vec::new();
    if let Some(mode) = expected_mode(mode, expected).filter(|m| *m != found_mode) {
        drift.push(Drift::Mode {
            expected: format!("{mode:04o}"),
            found: format!("{found_mode:04o}"),
        });
    }
    let whole = content.filter(|c| c.len() <= MAX_CONTENT_BYTES);
    match expected {
        Expected::Exact(bytes) if whole != Some(bytes.as_slice()) => drift.push(Drift::Content {
            expected_bytes: bytes.len(),
            expected_sha256: Fingerprint::of(bytes).to_hex(),
            found_bytes: size,
            found_sha256: whole.map(|c| Fingerprint::of(c).to_hex()),
        }),
        Expected::EndsWith(suffix) if !whole.is_some_and(|c| c.ends_with(suffix)) => {
            drift.push(Drift::AppendMissing {
                expected_suffix_bytes: suffix.len(),
                found_bytes: size,
            })
        }
        _ => {}
    }
    drift
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regular(mode: u32, content: &[u8]) -> Found {
        Found::Regular {
            mode,
            size: content.len() as u64,
            content: Some(content.to_vec()),
        }
    }

    #[test]
    fn verdicts() {
        let exact = Expected::Exact(b"abc".to_vec());
        assert_eq!(judge(None, &exact, &regular(0o644, b"abc")), vec![]);
        assert_eq!(judge(Some(0o600), &exact, &regular(0o600, b"abc")), vec![]);
        assert_eq!(
            judge(None, &exact, &regular(0o600, b"abc")),
            vec![Drift::Mode {
                expected: "0644".into(),
                found: "0600".into()
            }]
        );
        let drift = judge(Some(0o4755), &exact, &regular(0o755, b"abd"));
        assert_eq!(drift.len(), 2);
        assert_eq!(drift[0].to_string(), "mode 0755, expected 4755");
        assert!(
            drift[1]
                .to_string()
                .starts_with("content differs: 3 bytes (sha256 ")
        );
        assert_eq!(judge(None, &exact, &Found::Missing), vec![Drift::Missing]);
        assert_eq!(
            judge(None, &exact, &Found::NotRegular(FileKind::Symlink))[0].to_string(),
            "a symbolic link, expected a regular file"
        );
    }

    #[test]
    fn files_without_content_need_only_exist() {
        assert_eq!(
            judge(None, &Expected::Any, &regular(0o600, b"whatever")),
            vec![]
        );
        assert_eq!(
            judge(None, &Expected::Any, &Found::Missing),
            vec![Drift::Missing]
        );
        let remote = Expected::Remote("https".into());
        assert_eq!(judge(None, &remote, &regular(0o644, b"x")), vec![]);
        assert_eq!(judge(None, &remote, &regular(0o640, b"x")).len(), 1);
    }

    #[test]
    fn append_only_files_end_with_their_appends() {
        let appended = Expected::EndsWith(b"tail\n".to_vec());
        assert_eq!(
            judge(None, &appended, &regular(0o600, b"head\ntail\n")),
            vec![]
        );
        assert_eq!(
            judge(None, &appended, &regular(0o600, b"head\n")),
            vec![Drift::AppendMissing {
                expected_suffix_bytes: 5,
                found_bytes: 5
            }]
        );
    }
}
