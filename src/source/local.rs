//! Local sources: `file:PATH` (one PEM bundle) and `dir:PATH` (every `*.crt` and `*.pem`
//! directly inside, in name order, as one source).

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::{SourceError, SourceSpec, parse_parts};
use crate::bundle::{MAX_SOURCE_BYTES, Rejection, SourceCertificates};

/// Reads and validates a local source. Panics if `spec` is a cluster source.
pub fn load(spec: &SourceSpec) -> Result<SourceCertificates, SourceError> {
    let name = spec.to_string();
    match spec {
        SourceSpec::File(path) => {
            let bytes = read_limited(&name, path)?;
            parse_parts(&name, [(None, bytes.as_slice())])
        }
        SourceSpec::Dir(dir) => {
            let mut files = Vec::new();
            for path in dir_members(&name, dir)? {
                let bytes = read_limited(&name, &path)?;
                // `cp` over a member truncates it first: an empty member is one being
                // written, and its signers must not drop out of the bundle meanwhile.
                if bytes.is_empty() {
                    return Err(SourceError::Invalid {
                        spec: name,
                        reason: "empty_file",
                        problem: format!("{} is empty (being written?)", path.display()),
                    });
                }
                files.push((Some(path.display().to_string()), bytes));
            }
            parse_parts(&name, files.iter().map(|(p, b)| (p.clone(), b.as_slice())))
        }
        _ => panic!("local::load called for cluster source {name}"),
    }
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

/// Reads a file, but no more than a source may hold: more is a `TooLarge` rejection,
/// found without reading it all.
fn read_limited(spec: &str, path: &Path) -> Result<Vec<u8>, SourceError> {
    let unreadable = |error| SourceError::Unreadable {
        spec: spec.to_string(),
        path: path.to_path_buf(),
        error,
    };
    let file = fs::File::open(path).map_err(unreadable)?;
    let mut bytes = Vec::new();
    file.take(MAX_SOURCE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(unreadable)?;
    if bytes.len() > MAX_SOURCE_BYTES {
        let size = fs::metadata(path).map_or(bytes.len(), |m| m.len() as usize);
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
