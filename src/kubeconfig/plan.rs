//! What a pass does to a kubeconfig's CA data (SPEC 4c), pure: additions at once, removals
//! only once a check of the server allows them, and when to check again.

use std::time::{Duration, Instant};

use crate::bundle::{Certificate, Fingerprint};

/// A held removal is checked again this often (SPEC 4c asks for at least once a minute): an
/// API server rollout moves on in seconds, and a check is three TLS handshakes.
pub const RECHECK_EVERY: Duration = Duration::from_secs(10);

/// What the CA data should be after this pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The CA data to write: the sources' certificates, then any dropped one still held.
    pub ca: Vec<Certificate>,
    /// Certificates of the sources not in the CA data on disk.
    pub added: Vec<Certificate>,
    /// Certificates on disk that the sources no longer carry and that stay until a check
    /// allows their removal.
    pub held: Vec<Certificate>,
    /// How many certificates on disk go: those the sources dropped, once allowed.
    pub removed: usize,
}

impl Plan {
    /// Whether the CA data on disk already is what the plan writes (same certificates, same
    /// order): then nothing is written.
    pub fn unchanged(&self, on_disk: &[Certificate]) -> bool {
        self.ca.len() == on_disk.len()
            && self
                .ca
                .iter()
                .zip(on_disk)
                .all(|(a, b)| a.fingerprint() == b.fingerprint())
    }
}

/// The CA data to keep, given what is on disk, what the sources hold (`desired`, never
/// empty) and whether removing what they dropped is allowed.
pub fn plan(on_disk: &[Certificate], desired: &[Certificate], removal_allowed: bool) -> Plan {
    let diff = crate::bundle::diff(on_disk, desired);
    let added: Vec<Certificate> = diff.added.into_iter().cloned().collect();
    let (held, removed): (Vec<Certificate>, usize) = if removal_allowed {
        (Vec::new(), diff.removed.len())
    } else {
        (diff.removed.into_iter().cloned().collect(), 0)
    };
    // Held with nothing added: the CA data stays as it is (reordering it would be a write
    // that changes no trust).
    let ca = if !held.is_empty() && added.is_empty() {
        on_disk.to_vec()
    } else {
        desired.iter().chain(&held).cloned().collect()
    };
    Plan {
        ca,
        added,
        held,
        removed,
    }
}

/// A check of the server that was made, or is being made, and what for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    /// The CA data whose removals it is about (the sources' bundle).
    pub about: Fingerprint,
    pub at: Instant,
}

/// Whether to start a check now: removals are held, and no check about this CA data is
/// running or was made within [`RECHECK_EVERY`].
pub fn check_due(
    held: bool,
    last: Option<&Asked>,
    running: bool,
    about: Fingerprint,
    now: Instant,
) -> bool {
    if !held {
        return false;
    }
    match last {
        Some(last) if last.about == about => !running && now >= last.at + RECHECK_EVERY,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;

    fn certs() -> [Certificate; 3] {
        let now = test_certs::now();
        ["a", "b", "c"].map(|cn| test_certs::ca(Some(cn), None, now - 60, now + 86400))
    }

    fn names(list: &[Certificate]) -> Vec<String> {
        list.iter().map(|c| c.subject_cn.clone()).collect()
    }

    #[test]
    fn additions_are_written_at_once_and_removals_wait_for_the_check() {
        let [a, b, c] = certs();
        let one = |c: &Certificate| vec![c.clone()];
        // b replaces a: b is added at once, a stays until allowed.
        let held = plan(&one(&a), &one(&b), false);
        assert_eq!(names(&held.ca), ["b", "a"]);
        assert_eq!(names(&held.added), ["b"]);
        assert_eq!(names(&held.held), ["a"]);
        assert_eq!(held.removed, 0);
        assert!(!held.unchanged(&one(&a)));
        // Once written, the next pass changes nothing while the removal is held.
        let again = plan(&held.ca, &one(&b), false);
        assert!(again.unchanged(&held.ca));
        assert!(again.added.is_empty());
        // Dropped with nothing added: the file stays as it is until allowed.
        let dropped = plan(&[a.clone(), b.clone()], &one(&b), false);
        assert_eq!(names(&dropped.ca), ["a", "b"]);
        assert!(dropped.unchanged(&[a.clone(), b.clone()]));
        assert_eq!(names(&dropped.held), ["a"]);
        // Allowed: a goes.
        let allowed = plan(&held.ca, &one(&b), true);
        assert_eq!(names(&allowed.ca), ["b"]);
        assert!(allowed.held.is_empty());
        assert_eq!(allowed.removed, 1);
        // Two dropped and one added at once, allowed: two go.
        let replaced = plan(&[a.clone(), b.clone()], &one(&c), true);
        assert_eq!(
            (names(&replaced.ca), replaced.removed),
            (vec!["c".to_string()], 2)
        );
        // Only additions: nothing to hold, whatever the check says.
        let grown = plan(&one(&a), &[a.clone(), c.clone()], false);
        assert_eq!(names(&grown.ca), ["a", "c"]);
        assert!(grown.held.is_empty());
        // The same certificates in another order are written in the sources' order.
        let reordered = plan(&[b.clone(), a.clone()], &[a.clone(), b.clone()], false);
        assert!(!reordered.unchanged(&[b, a]));
    }

    #[test]
    fn a_held_removal_is_checked_once_per_change_and_again_every_ten_seconds() {
        let t0 = Instant::now();
        let about = Fingerprint([1; 32]);
        let other = Fingerprint([2; 32]);
        let asked = Asked { about, at: t0 };
        assert!(!check_due(false, None, false, about, t0), "nothing held");
        assert!(check_due(true, None, false, about, t0), "never checked");
        assert!(!check_due(true, Some(&asked), true, about, t0), "running");
        assert!(!check_due(
            true,
            Some(&asked),
            false,
            about,
            t0 + RECHECK_EVERY - Duration::from_millis(1)
        ));
        assert!(check_due(
            true,
            Some(&asked),
            false,
            about,
            t0 + RECHECK_EVERY
        ));
        assert!(
            !check_due(true, Some(&asked), true, about, t0 + RECHECK_EVERY),
            "still running"
        );
        assert!(
            check_due(true, Some(&asked), true, other, t0),
            "a change is checked at once"
        );
    }
}
