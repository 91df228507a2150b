//! Local sources: `file:PATH` (one PEM bundle) and `dir:PATH` (every `*.crt` and `*.pem`
//! directly inside, in name order, as one source). Symbolic links are followed (a projected
//! ConfigMap volume is made of them), but only regular files are ever opened, and no more
//! than a source may hold is ever read, however large or sparse the files are.

use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{SourceError, SourceSpec, parse_parts};
use crate::bundle::{MAX_SOURCE_BYTES, Rejection, SourceCertificates};
use crate::fsutil::{Links, not_regular, open_regular, read_bounded};
use crate::registry;

/// Reads and validates a local source. Panics if `spec` is a cluster source.
pub fn load(spec: &SourceSpec) -> Result<SourceCertificates, SourceError> {
    let parts = read_parts(spec)?;
    parse_parts(&spec.to_string(), borrowed(&parts)).map_err(|e| explain(spec, &parts, e))
}

/// A `dir:` source with no certificate: the error names the files it read and the ones it
/// skipped, and why (only `*.crt` and `*.pem` are read), so that a `signer.cer` is found.
fn explain(spec: &SourceSpec, parts: &[ReadPart], error: SourceError) -> SourceError {
    match (spec, &error) {
        (
            SourceSpec::Dir(dir),
            SourceError::Rejected {
                part: None,
                rejection: Rejection::NoCertificate,
                ..
            },
        ) => SourceError::Invalid {
            spec: spec.to_string(),
            reason: "no_certificate",
            problem: no_certificate_in_dir(
                dir,
                parts.iter().filter_map(|(p, _)| p.clone()).collect(),
                dir_skipped(dir),
            ),
        },
        _ => error,
    }
}

/// What to say of a `dir:` source that holds no certificate: the files read, and those
/// skipped with why. Names are escaped (they come from the disk).
fn no_certificate_in_dir(
    dir: &Path,
    read: Vec<String>,
    skipped: Vec<(String, &'static str)>,
) -> String {
    let esc = |s: &str| crate::text::escape(s).into_owned();
    let shown = esc(&dir.display().to_string());
    let read = if read.is_empty() {
        format!("no *.crt or *.pem file in {shown}")
    } else {
        format!(
            "no CERTIFICATE block found in {}",
            read.iter().map(|r| esc(r)).collect::<Vec<_>>().join(", ")
        )
    };
    if skipped.is_empty() {
        return read;
    }
    let mut names: Vec<String> = skipped
        .iter()
        .take(10)
        .map(|(name, why)| format!("{} ({why})", esc(name)))
        .collect();
    if skipped.len() > 10 {
        names.push(format!("and {} more", skipped.len() - 10));
    }
    format!(
        "{read}; skipped: {} (a dir: source reads only the regular files named *.crt or *.pem: rename a PEM signer file to .crt)",
        names.join(", ")
    )
}

/// The entries of `dir` that a `dir:` source does not read, each with why.
fn dir_skipped(dir: &Path) -> Vec<(String, &'static str)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut skipped: Vec<(String, &'static str)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let wanted = matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("crt" | "pem")
            );
            if !wanted {
                Some((name, "not *.crt or *.pem"))
            } else if !fs::metadata(&path).is_ok_and(|m| m.is_file()) {
                Some((name, "not a regular file"))
            } else {
                None
            }
        })
        .collect();
    skipped.sort();
    skipped
}

/// Loads a local source again and again, as the daemon does (on every change, and once a
/// minute whatever happened): when the bytes read are those of the last successful load,
/// the content parsed from them then is given again instead of being parsed anew. Parsing
/// is pure, so the same bytes give the same content; most re-verifications find nothing
/// changed, and hashing the bytes costs a fraction of parsing them.
#[derive(Default)]
pub struct Loader {
    /// SHA-256 of the parts of the last successful load, and what they held.
    last: Option<([u8; 32], SourceCertificates)>,
}

impl Loader {
    /// [`load`], skipping the parse of bytes already parsed. Panics if `spec` is a cluster
    /// source.
    pub fn load(&mut self, spec: &SourceSpec) -> Result<SourceCertificates, SourceError> {
        let parts = read_parts(spec)?;
        let digest = digest(&parts);
        if let Some((last, content)) = &self.last
            && *last == digest
        {
            return Ok(content.clone());
        }
        let content = parse_parts(&spec.to_string(), borrowed(&parts))
            .map_err(|e| explain(spec, &parts, e))?;
        self.last = Some((digest, content.clone()));
        Ok(content)
    }
}

/// A named part of a local source as read: (file name for a `dir:` source, its bytes).
type ReadPart = (Option<String>, Vec<u8>);

/// A part as [`parse_parts`] takes it.
fn borrowed(parts: &[ReadPart]) -> impl Iterator<Item = (Option<String>, &[u8])> {
    parts.iter().map(|(p, b)| (p.clone(), b.as_slice()))
}

/// SHA-256 over the parts' bytes, each preceded by its length, so that moving bytes from
/// one file of a `dir:` source to the next is a change.
fn digest(parts: &[ReadPart]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for (_, bytes) in parts {
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    }
    hasher.finalize().into()
}

/// The bytes of a local source, as (part name, bytes): one unnamed part for `file:`, one
/// part per file for `dir:`. Panics if `spec` is a cluster source.
fn read_parts(spec: &SourceSpec) -> Result<Vec<ReadPart>, SourceError> {
    let name = spec.to_string();
    match spec {
        SourceSpec::File(path) => {
            let bytes = read_limited(&name, path, MAX_SOURCE_BYTES)?;
            Ok(vec![(None, bytes)])
        }
        SourceSpec::Dir(dir) => {
            let mut files = Vec::new();
            // The limit applies to the sum: each file is read only up to what is left.
            let mut left = MAX_SOURCE_BYTES;
            for path in dir_members(&name, dir)? {
                let bytes = read_limited(&name, &path, left)?;
                // `cp` over a member truncates it first: an empty member is one being
                // written, and its signers must not drop out of the bundle meanwhile.
                if bytes.is_empty() {
                    return Err(SourceError::Invalid {
                        spec: name,
                        reason: "empty_file",
                        problem: format!("{} is empty (being written?)", path.display()),
                    });
                }
                left -= bytes.len();
                files.push((Some(path.display().to_string()), bytes));
            }
            Ok(files)
        }
        _ => panic!("local::load called for cluster source {name}"),
    }
}

/// The entries of a `dir:` source of a registry set (`--manage-registries`): each
/// `<host..port>.crt` file is one registry ([`registry::from_dir`]), read as a `dir:`
/// source's files are (regular files only, each up to the size limit; an empty one is
/// being written, and fails the read so that its registry is not taken for gone).
pub fn registry_entries(spec: &SourceSpec) -> Result<registry::Entries, SourceError> {
    let name = spec.to_string();
    let SourceSpec::Dir(dir) = spec else {
        panic!("local::registry_entries called for {name}");
    };
    let unreadable = |path: &Path, error| SourceError::Unreadable {
        spec: name.clone(),
        path: path.to_path_buf(),
        error,
    };
    let mut paths = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| unreadable(dir, e))? {
        let path = entry.map_err(|e| unreadable(dir, e))?.path();
        if path.extension().and_then(|e| e.to_str()) == Some("crt") {
            paths.push(path);
        }
    }
    paths.sort();
    let mut files = Vec::new();
    for path in paths {
        // Every `.crt` is a registry: one that cannot be read (a link into a mount not up
        // yet, a FIFO) fails the whole source, so that its registry is not taken for gone
        // and its CA removed; the last good entries stand meanwhile.
        let bytes = read_limited(&name, &path, MAX_SOURCE_BYTES)?;
        if bytes.is_empty() {
            return Err(SourceError::Invalid {
                spec: name,
                reason: "empty_file",
                problem: format!("{} is empty (being written?)", path.display()),
            });
        }
        files.push((path, bytes));
    }
    Ok(registry::from_dir(&name, files))
}

/// The files a `dir:` source is made of, in name order.
pub fn dir_members(spec: &str, dir: &Path) -> Result<Vec<PathBuf>, SourceError> {
    let unreadable = |error| SourceError::Unreadable {
        spec: spec.to_string(),
        path: dir.to_path_buf(),
        error,
    };
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(unreadable)? {
        let path = entry.map_err(unreadable)?.path();
        let wanted = matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("crt" | "pem")
        );
        // fs::metadata follows symlinks: a projected ConfigMap volume is all symlinks.
        if wanted && fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Reads a regular file, but no more than `limit` bytes: more is a `TooLarge` rejection,
/// found without reading it all. Anything but a regular file is unreadable, by name.
fn read_limited(spec: &str, path: &Path, limit: usize) -> Result<Vec<u8>, SourceError> {
    let unreadable = |error| SourceError::Unreadable {
        spec: spec.to_string(),
        path: path.to_path_buf(),
        error,
    };
    let (file, metadata) = match open_regular(path, Links::Follow).map_err(unreadable)? {
        Ok(opened) => opened,
        Err(kind) => return Err(unreadable(not_regular(path, kind))),
    };
    let bytes = read_bounded(&file, limit).map_err(unreadable)?;
    if bytes.len() > limit {
        let size = MAX_SOURCE_BYTES - limit + (metadata.len() as usize).max(bytes.len());
        return Err(SourceError::Rejected {
            spec: spec.to_string(),
            part: Some(path.display().to_string()),
            rejection: Rejection::TooLarge {
                size,
                limit: MAX_SOURCE_BYTES,
            },
        });
    }
    Ok(bytes)
}

/// Whether a failed read is worth retrying on a timer: an I/O problem can pass by itself
/// (a permission restored, descriptors freed, a mount back); bad content waits for a change.
pub fn retryable(error: &SourceError) -> bool {
    matches!(error, SourceError::Unreadable { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dir_without_certificates_names_what_it_read_and_what_it_skipped() {
        let dir = std::env::temp_dir().join(format!("kca-dir-skipped-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("sub.crt")).unwrap();
        fs::write(dir.join("signer.cer"), "-----BEGIN CERTIFICATE-----\n").unwrap();
        fs::write(dir.join("notes\x1b.txt"), "x").unwrap();
        let spec = SourceSpec::Dir(dir.clone());
        let error = load(&spec).unwrap_err();
        assert_eq!(error.reason(), "no_certificate");
        let text = error.to_string();
        let shown = dir.display();
        assert!(
            text.contains(&format!("no *.crt or *.pem file in {shown}")),
            "{text}"
        );
        assert!(text.contains("signer.cer (not *.crt or *.pem)"), "{text}");
        assert!(text.contains("sub.crt (not a regular file)"), "{text}");
        assert!(text.contains("notes\\u{1b}.txt"), "{text}");
        assert!(text.contains("rename"), "{text}");
        // A .pem that holds no certificate is named as read.
        fs::write(dir.join("empty.pem"), "# nothing\n").unwrap();
        let text = Loader::default().load(&spec).unwrap_err().to_string();
        let empty = dir.join("empty.pem");
        assert!(
            text.contains(&format!(
                "no CERTIFICATE block found in {}",
                empty.display()
            )),
            "{text}"
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn at_most_ten_skipped_files_are_named_and_the_rest_counted() {
        let skipped = |n: usize| -> Vec<(String, &'static str)> {
            (0..n)
                .map(|i| (format!("f{i:02}.cer"), "not *.crt or *.pem"))
                .collect()
        };
        let dir = Path::new("/etc/signers");
        let ten = no_certificate_in_dir(dir, vec![], skipped(10));
        assert!(ten.contains("f09.cer (not *.crt or *.pem)"), "{ten}");
        assert!(!ten.contains("more"), "{ten}");
        let eleven = no_certificate_in_dir(dir, vec![], skipped(11));
        assert!(
            eleven.contains("f09.cer (not *.crt or *.pem), and 1 more"),
            "{eleven}"
        );
        assert!(!eleven.contains("f10.cer"), "{eleven}");
        let none = no_certificate_in_dir(dir, vec![], vec![]);
        assert_eq!(none, "no *.crt or *.pem file in /etc/signers");
    }
}
