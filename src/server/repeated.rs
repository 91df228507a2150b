//! A condition that repeats (a review that cannot be made, a connection that cannot be
//! accepted) is logged when it begins and when it ends, with how often it happened, never
//! once per occurrence: a client that can make it happen cannot flood the log.

use std::sync::atomic::{AtomicU64, Ordering};

/// One kind of repeated failure.
#[derive(Debug)]
pub struct Repeated {
    /// What works again when it ends, for the log: "reviews", "accepting connections".
    what: &'static str,
    /// Failures since the condition began; 0 while it does not hold.
    count: AtomicU64,
}

impl Repeated {
    pub const fn new(what: &'static str) -> Repeated {
        Repeated {
            what,
            count: AtomicU64::new(0),
        }
    }

    /// One more failure; the first of a spell is logged with `detail`. True when this one
    /// began the spell (and so was logged).
    pub fn failed(&self, detail: &str) -> bool {
        let first = self.count.fetch_add(1, Ordering::Relaxed) == 0;
        if first {
            tracing::warn!("{detail} (logged once until it works again)");
        }
        first
    }

    /// It worked: a spell of failures, if any, ends, logged with how many there were
    /// (returned).
    pub fn succeeded(&self) -> Option<u64> {
        let failures = self.count.swap(0, Ordering::Relaxed);
        if failures > 0 {
            tracing::info!(
                failures,
                "{} work(s) again after {failures} failure(s)",
                self.what
            );
            return Some(failures);
        }
        None
    }

    /// Failures in the current spell.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spell_of_failures_is_counted_and_ends_when_it_works() {
        let repeated = Repeated::new("reviews");
        assert_eq!(repeated.succeeded(), None, "no spell to end");
        assert_eq!(repeated.count(), 0);
        // Logged once, at the first failure of the spell.
        let logged = (0..500)
            .filter(|_| repeated.failed("cannot check bearer tokens"))
            .count();
        assert_eq!(logged, 1);
        assert_eq!(repeated.count(), 500);
        assert_eq!(repeated.succeeded(), Some(500));
        assert_eq!(repeated.count(), 0);
        assert_eq!(repeated.succeeded(), None, "the spell ended once");
        // A new spell is logged again.
        assert!(repeated.failed("cannot check bearer tokens"));
    }
}
