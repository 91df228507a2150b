//! When a target of the loop (a managed file, or a registry set) has something to do: the
//! reads of its local sources (on a change, a retry, the re-verification), a look at what
//! is on disk after a change there, a retry put off by a backoff, and whether a pass is
//! called for. The same for every kind of target, so that each is driven alike.

use std::time::{Duration, Instant};

use super::policy::Backoff;
use crate::source::SourceSpec;

/// A local source being written in place (changed, not yet closed) is read once the writer
/// closes it; a writer that keeps it open is read after this long without a change, and
/// no later than the second bound after its first change.
pub(crate) const WRITE_QUIET: Duration = Duration::from_secs(1);
pub(crate) const WRITE_QUIET_MAX: Duration = Duration::from_secs(5);

/// When one source is read next.
#[derive(Debug, Default)]
struct Reads {
    /// A cluster source: never read here (its watch sends its news).
    cluster: bool,
    /// Read again at this instant.
    at: Option<Instant>,
    /// The first in-place change that `at` waits to see finished.
    writing_since: Option<Instant>,
    /// Retries of a source that could not be read.
    retry: Backoff,
}

#[derive(Debug, Default)]
pub(crate) struct Schedule {
    /// Position of the target's first source among all the loop's sources: the index that
    /// source updates and file events carry.
    first: usize,
    reads: Vec<Reads>,
    /// Something on disk changed: look at it at this instant.
    pub(crate) recheck_at: Option<Instant>,
    /// A pass was put off by a backoff: run one at this instant.
    pub(crate) retry_at: Option<Instant>,
    /// Something happened that calls for a pass.
    pub(crate) due: bool,
}

impl Schedule {
    /// The schedule of a target whose `sources` start at position `first` among the loop's.
    pub(crate) fn new(first: usize, sources: &[SourceSpec]) -> Schedule {
        Schedule {
            first,
            reads: sources
                .iter()
                .map(|spec| Reads {
                    cluster: spec.is_cluster(),
                    ..Reads::default()
                })
                .collect(),
            ..Schedule::default()
        }
    }

    /// The position among the target's sources of the loop's source `index`, if it is one
    /// of them.
    pub(crate) fn source(&self, index: usize) -> Option<usize> {
        index
            .checked_sub(self.first)
            .filter(|&local| local < self.reads.len())
    }

    /// Every local source is read again at `at` (the re-verification, or a rescan).
    pub(crate) fn read_local_sources_at(&mut self, at: Instant) {
        for reads in self.reads.iter_mut().filter(|r| !r.cluster) {
            reads.at = Some(at);
        }
    }

    /// A local source (by its position among the target's) changed on disk at `at`:
    /// `settled` (closed after writing, renamed into place, removed), it is read at once;
    /// otherwise a writer is at work in place, and it is read when the writer closes it or
    /// falls quiet, so that a half-written file is never read as the whole source.
    pub(crate) fn changed(&mut self, local: usize, at: Instant, settled: bool) {
        let reads = &mut self.reads[local];
        reads.at = Some(if settled {
            at
        } else {
            let first = *reads.writing_since.get_or_insert(at);
            (at + WRITE_QUIET).min(first + WRITE_QUIET_MAX)
        });
    }

    /// A local source was read at `at`: one that could not be (`retry`) is read again with
    /// backoff; otherwise its retries start over.
    pub(crate) fn was_read(&mut self, local: usize, at: Instant, retry: bool) {
        let reads = &mut self.reads[local];
        if retry {
            reads.retry.step_read(at);
            reads.at = reads.retry.until;
        } else {
            reads.retry.clear();
        }
    }

    /// When the source `local` is read next (tests).
    #[cfg(test)]
    pub(crate) fn read_at(&self, local: usize) -> Option<Instant> {
        self.reads[local].at
    }

    /// The earliest instant the target has something to do.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        [self.recheck_at, self.retry_at]
            .into_iter()
            .chain(self.reads.iter().map(|r| r.at))
            .flatten()
            .min()
    }

    /// Takes what is due at `now`: the local sources to read now (their timers cleared, for
    /// the caller to read them), and whether a recheck or a retry fell due. A pass is then
    /// due if anything was.
    pub(crate) fn take_due(&mut self, now: Instant) -> (Vec<usize>, bool) {
        let mut reads = Vec::new();
        for (local, r) in self.reads.iter_mut().enumerate() {
            if r.at.is_some_and(|t| t <= now) {
                r.at = None;
                r.writing_since = None;
                reads.push(local);
            }
        }
        let mut work = !reads.is_empty();
        for due in [&mut self.recheck_at, &mut self.retry_at] {
            if due.is_some_and(|t| t <= now) {
                *due = None;
                work = true;
            }
        }
        self.due |= work;
        (reads, work)
    }

    /// A retry is wanted at `until`, or sooner if one is already.
    pub(crate) fn retry_by(&mut self, until: Instant) {
        self.retry_at = Some(self.retry_at.map_or(until, |t| t.min(until)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule() -> Schedule {
        let specs: Vec<SourceSpec> = ["configmap:a/b", "file:/srv/a.pem", "dir:/srv/cas"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        Schedule::new(3, &specs)
    }

    #[test]
    fn sources_are_found_by_their_place_among_the_loops() {
        let s = schedule();
        assert_eq!(s.source(2), None);
        assert_eq!(s.source(3), Some(0));
        assert_eq!(s.source(5), Some(2));
        assert_eq!(s.source(6), None);
    }

    #[test]
    fn a_change_in_progress_waits_for_quiet_but_no_longer_than_the_bound() {
        let mut s = schedule();
        let t0 = Instant::now();
        s.changed(1, t0, false);
        assert_eq!(s.read_at(1), Some(t0 + WRITE_QUIET));
        // A writer that keeps writing: each change moves the read, up to the bound.
        s.changed(1, t0 + Duration::from_millis(4500), false);
        assert_eq!(s.read_at(1), Some(t0 + WRITE_QUIET_MAX));
        // A settled change is read at once.
        s.changed(1, t0 + Duration::from_secs(2), true);
        assert_eq!(s.read_at(1), Some(t0 + Duration::from_secs(2)));
        // Taken when due: its timers cleared, a pass due; nothing before.
        assert_eq!(s.take_due(t0), (vec![], false));
        assert!(!s.due);
        assert_eq!(s.take_due(t0 + Duration::from_secs(2)), (vec![1], true));
        assert!(s.due);
        assert_eq!(s.read_at(1), None);
        // The quiet bound starts again with the next change.
        s.changed(1, t0 + Duration::from_secs(10), false);
        assert_eq!(s.read_at(1), Some(t0 + Duration::from_secs(11)));
    }

    #[test]
    fn the_re_verification_reads_local_sources_only_and_retries_keep_the_earliest() {
        let mut s = schedule();
        let t0 = Instant::now();
        s.read_local_sources_at(t0);
        assert_eq!(
            (s.read_at(0), s.read_at(1), s.read_at(2)),
            (None, Some(t0), Some(t0))
        );
        assert_eq!(s.next_due(), Some(t0));
        let (later, sooner) = (t0 + Duration::from_secs(9), t0 + Duration::from_secs(3));
        let mut s = schedule();
        s.retry_by(later);
        s.retry_by(sooner);
        s.retry_by(later);
        assert_eq!(s.retry_at, Some(sooner));
        assert_eq!(s.take_due(sooner), (vec![], true));
        assert_eq!(s.retry_at, None);
        // An unreadable source is retried from a second; a read one is not.
        s.was_read(1, t0, true);
        assert_eq!(s.read_at(1), Some(t0 + Duration::from_secs(1)));
        s.was_read(2, t0, false);
        assert_eq!(s.read_at(2), None);
    }
}
