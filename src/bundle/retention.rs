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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs::{ca, now};

    #[test]
    fn a_vanished_certificate_is_kept_until_its_window_ends_and_not_a_second_longer() {
        let now = now();
        let gone = ca(Some("gone"), None, now - 3600, now + 86_400);
        let carried = ca(Some("carried"), None, now - 3600, now + 86_400);
        let previous = [Remembered {
            certificate: gone.clone(),
            missing_since: Some(now - 60),
        }];
        let kept = apply(&previous, std::slice::from_ref(&carried), 61, now);
        assert_eq!(kept.kept, std::slice::from_ref(&gone));
        assert_eq!(
            kept.memory,
            [
                Remembered {
                    certificate: carried.clone(),
                    missing_since: None
                },
                Remembered {
                    certificate: gone.clone(),
                    missing_since: Some(now - 60)
                },
            ]
        );
        let ended = apply(&previous, std::slice::from_ref(&carried), 60, now);
        assert!(ended.kept.is_empty());
        assert_eq!(ended.memory.len(), 1);
        // Back in a source: no longer missing, and not kept twice.
        let back = apply(&previous, std::slice::from_ref(&gone), 61, now);
        assert!(back.kept.is_empty());
        assert_eq!(back.memory[0].missing_since, None);
    }
}
