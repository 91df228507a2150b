//! Local sources: `file:PATH` (one PEM bundle) and `dir:PATH` (every `*.crt` and `*.pem`
//! directly inside, in name order, as one source).

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::{SourceError, SourceSpec};
use crate::bundle::{MAX_SOURCE_BYTES, Rejection, SourceCertificates, parse_source};

/// Reads and validates a local source. Panics if `spec` is a cluster source.
pub fn load(spec: &SourceSpec) -> Result<SourceCertificates, SourceError> {
    let name = spec.to_string();
    match spec {
        SourceSpec::File(path) => {
            let bytes = read_limited(&name, path, MAX_SOURCE_BYTES)?;
            parse_source(&bytes).map_err(|rejection| SourceError::Rejected {
                spec: name,
                file: None,
                rejection,
            })
        }
        SourceSpec::Dir(dir) => load_dir(&name, dir),
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

fn load_dir(spec: &str, dir: &Path) -> Result<SourceCertificates, SourceError> {
    let files = dir_members(spec, dir)?;
    if files.is_empty() {
        return Err(SourceError::Rejected {
            spec: spec.to_string(),
            file: None,
            rejection: Rejection::NoCertificate,
        });
    }
    let mut merged = SourceCertificates::default();
    let mut budget = MAX_SOURCE_BYTES;
    for file in files {
        let bytes = read_limited(spec, &file, budget)?;
        budget -= bytes.len();
        let parsed = parse_source(&bytes).map_err(|rejection| SourceError::Rejected {
            spec: spec.to_string(),
            file: Some(file.clone()),
            rejection,
        })?;
        merged.certificates.extend(parsed.certificates);
        merged.not_ca.extend(parsed.not_ca);
    }
    Ok(merged)
}

/// Reads at most `limit` bytes; more is a `TooLarge` rejection, found without reading it all.
fn read_limited(spec: &str, path: &Path, limit: usize) -> Result<Vec<u8>, SourceError> {
    let unreadable = |error| SourceError::Unreadable {
        spec: spec.to_string(),
        path: path.to_path_buf(),
        error,
    };
    let file = fs::File::open(path).map_err(unreadable)?;
    let mut bytes = Vec::new();
    file.take(limit as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(unreadable)?;
    if bytes.len() > limit {
        let size = fs::metadata(path)
            .map(|m| m.len() as usize)
            .unwrap_or(bytes.len());
        return Err(SourceError::Rejected {
            spec: spec.to_string(),
            file: Some(path.to_path_buf()),
            rejection: Rejection::TooLarge {
                size,
                limit: MAX_SOURCE_BYTES,
            },
        });
    }
    Ok(bytes)
}
