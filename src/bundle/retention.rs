//! `--retain-removed`: a certificate that disappeared from every source stays in the bundle
//! for a while (never past its notAfter), so that a source that drops a signer a little
//! early does not cut off clients still using it.
//!
//! The memory of *when* each certificate went missing is the input and output of [`apply`];
//! the caller persists it (see `crate::state`) so that it survives restarts.

use std::collections::HashSet;

use super::certificate::{Certificate, Fingerprint};

/// A certificate of the last bundle, and since when no source has carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remembered {
    pub certificate: Certificate,
    /// Unix seconds; `None` while a source carries the certificate.
    pub missing_since: Option<i64>,
}

/// The outcome of one retention pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Retained {
    /// Certificates kept although no source carries them, in the order of `previous`.
    pub kept: Vec<Certificate>,
    /// What to remember for the next pass: every certificate of the new bundle.
    pub memory: Vec<Remembered>,
}

/// Decides which certificates of the previous bundle (`previous`) to keep although the
/// sources (`current`, already deduplicated) no longer carry them. `window` is in seconds;
/// zero keeps nothing, and the memory then holds only what the sources carry.
pub fn apply(previous: &[Remembered], current: &[Certificate], window: i64, now: i64) -> Retained {
    // A set, not a scan of `current` per certificate: the daemon passes its whole last
    // bundle as `previous`, and a thousand by a thousand comparisons cost milliseconds.
    let current_set: HashSet<Fingerprint> = if previous.is_empty() {
        HashSet::new()
    } else {
        current.iter().map(Certificate::fingerprint).collect()
    };
    let carried = |c: &Certificate| current_set.contains(&c.fingerprint());
    let mut out = Retained::default();
    for old in previous {
        if carried(&old.certificate) {
            continue;
        }
        let since = old.missing_since.unwrap_or(now);
        let within_window = now < since.saturating_add(window);
        if within_window && !old.certificate.is_expired_at(now) {
            out.kept.push(old.certificate.clone());
            out.memory.push(Remembered {
                certificate: old.certificate.clone(),
                missing_since: Some(since),
            });
        }
    }
    let from_sources = current.iter().map(|c| Remembered {
        certificate: c.clone(),
        missing_since: None,
    });
    out.memory.splice(0..0, from_sources);
    out
}
