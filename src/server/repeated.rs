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

    /// One more failure; the first of a spell is logged with `detail`.
    pub fn failed(&self, detail: &str) {
        if self.count.fetch_add(1, Ordering::Relaxed) == 0 {
            tracing::warn!("{detail} (logged once until it works again)");
        }
    }

    /// It worked: a spell of failures, if any, ends, with how many there were.
    pub fn succeeded(&self) {
        let failures = self.count.swap(0, Ordering::Relaxed);
        if failures > 0 {
            tracing::info!(
                failures,
                "{} work(s) again after {failures} failure(s)",
                self.what
            );
        }
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
        repeated.succeeded();
        assert_eq!(repeated.count(), 0);
        for _ in 0..500 {
            repeated.failed("cannot check bearer tokens");
        }
        assert_eq!(repeated.count(), 500);
        repeated.succeeded();
        assert_eq!(repeated.count(), 0);
    }
}
