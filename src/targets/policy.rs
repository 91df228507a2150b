//! What a pass does to a managed file, decided apart from doing it: [`decide`] is a pure
//! function of what the loop knows and what is on disk, and [`Backoff`] the delays between
//! repairs, failed writes and failed reads, so that every policy (adopt, repair, back off,
//! retry) is tested without a process, a clock or a disk. Beneath every kind of target of
//! the daemon (the files, the registry sets) and the loop that drives them.

use std::time::{Duration, Instant};

use crate::bundle::Fingerprint;
use crate::fsutil::FileKind;
use crate::writer::OnDisk;

/// The managed file: a writer's create+write+close arrive as one change.
pub(crate) const BUNDLE_SETTLE: Duration = Duration::from_millis(5);
/// A local source that could not be read is read again from 1 s, doubling, up to this.
const READ_RETRY_FIRST: Duration = Duration::from_secs(1);
const READ_RETRY_MAX: Duration = Duration::from_secs(60);
/// Repairs of a file that something keeps changing back: the delay after the n-th repair
/// in a row is 250 ms * 2^n, capped here (SPEC 6). A lone repair is immediate.
const REPAIR_FIRST: Duration = Duration::from_millis(250);
const REPAIR_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// A quiet spell this long ends a streak of repairs.
const REPAIR_STREAK_RESET: Duration = Duration::from_secs(600);
/// Failed writes (disk full, read-only, permissions) are retried from 1 s up to 5 minutes.
const WRITE_RETRY_FIRST: Duration = Duration::from_secs(1);
const WRITE_RETRY_MAX: Duration = Duration::from_secs(300);
/// Certificate boundaries are re-checked at least this often, in case the clock jumps.
pub(crate) const BOUNDARY_RECHECK_MAX: Duration = Duration::from_secs(3600);

/// A delay that doubles on every use in a row, up to a cap.
#[derive(Debug, Default, Clone)]
pub(crate) struct Backoff {
    /// Not before this instant.
    pub(crate) until: Option<Instant>,
    /// How many times in a row it was applied.
    streak: u32,
    last: Option<Instant>,
}

impl Backoff {
    pub(crate) fn blocked(&self, now: Instant) -> Option<Instant> {
        self.until.filter(|&t| now < t)
    }

    /// Records one more use at `now` and sets the next allowed instant.
    fn step(&mut self, now: Instant, first: Duration, cap: Duration, reset_after: Duration) {
        let recent = self
            .last
            .is_some_and(|l| now.duration_since(l) < reset_after);
        self.streak = if recent { self.streak + 1 } else { 0 };
        self.last = Some(now);
        let delay = (first * (1u32 << self.streak.min(16))).min(cap);
        self.until = Some(now + delay);
    }

    pub(crate) fn clear(&mut self) {
        *self = Backoff::default();
    }

    /// A failed write, an unreadable bundle path, or a mode or owner that could not be put
    /// back: 1 s doubling to 5 minutes, starting over after 10 quiet minutes.
    pub(crate) fn step_write(&mut self, at: Instant) {
        self.step(at, WRITE_RETRY_FIRST, WRITE_RETRY_MAX, WRITE_RETRY_MAX * 2);
    }

    /// A local source that could not be read: 1 s doubling to a minute, starting over after
    /// two quiet minutes.
    pub(crate) fn step_read(&mut self, at: Instant) {
        self.step(at, READ_RETRY_FIRST, READ_RETRY_MAX, READ_RETRY_MAX * 2);
    }

    /// A repair: 250 ms doubling to 5 minutes, starting over after 10 quiet minutes.
    pub(crate) fn step_repair(&mut self, at: Instant) {
        self.step(at, REPAIR_FIRST, REPAIR_BACKOFF_MAX, REPAIR_STREAK_RESET);
    }
}

/// What a pass knows when it decides what to do with the file.
pub(crate) struct Facts<'a> {
    /// The bytes the file should hold.
    pub(crate) goal: &'a [u8],
    pub(crate) on_disk: &'a OnDisk,
    /// `--file-mode`, and the owner the file should have (only when running as root).
    pub(crate) mode: u32,
    pub(crate) owner: Option<(u32, u32)>,
    /// The bundle this agent last wrote or adopted.
    pub(crate) last_written: Option<Fingerprint>,
    /// The bundle whose last write failed.
    pub(crate) write_failed: Option<Fingerprint>,
}

/// What a pass does with the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    /// The file holds the goal, with the right mode and owner.
    InSync,
    /// The content is right but something else changed the mode or owner: put them back.
    RepairAttributes,
    /// A directory is at the path: no rename can replace it, and the agent never removes
    /// one. Someone has to; the file is written as soon as it is gone.
    CannotReplace,
    /// Replace the file with the goal. `repair`: the goal has not changed since this agent
    /// wrote or adopted it, so someone else changed the file.
    Write { repair: bool },
    /// A backoff holds the next attempt until then; the file is out of sync meanwhile.
    Wait {
        until: Instant,
        problem: &'static str,
    },
}

/// Why a pass waits while a failed write's retry is due later.
pub(crate) const WRITE_RETRY_WAIT: &str = "the last write failed; retrying with backoff";

/// The policy of a pass: repair drift at once but back off from a writer that keeps
/// fighting, retry a failed write with backoff (a new bundle at once), and never touch a
/// file that already holds the goal as it should.
pub(crate) fn decide(
    facts: &Facts,
    repair: &Backoff,
    write_retry: &Backoff,
    now: Instant,
) -> Action {
    let content_ok = facts.on_disk.bytes() == Some(facts.goal);
    let attributes_ok = facts
        .on_disk
        .stat()
        .is_some_and(|s| s.mode == facts.mode && facts.owner.is_none_or(|o| o == (s.uid, s.gid)));
    if content_ok && attributes_ok {
        return Action::InSync;
    }
    if *facts.on_disk == OnDisk::Other(FileKind::Directory) {
        return Action::CannotReplace;
    }
    let goal = Fingerprint::of(facts.goal);
    let is_repair = content_ok || facts.last_written == Some(goal);
    if is_repair && let Some(until) = repair.blocked(now) {
        return Action::Wait {
            until,
            problem: "the file was changed by something else; repair is backing off",
        };
    }
    if content_ok {
        return Action::RepairAttributes;
    }
    if facts.write_failed == Some(goal)
        && let Some(until) = write_retry.blocked(now)
    {
        return Action::Wait {
            until,
            problem: WRITE_RETRY_WAIT,
        };
    }
    Action::Write { repair: is_repair }
}

/// The file as a pass saw it, for status.
pub(crate) enum Seen<'a> {
    Regular(&'a [u8]),
    Missing,
    Other(FileKind),
    Unreadable(String),
}

impl<'a> From<&'a OnDisk> for Seen<'a> {
    fn from(on_disk: &'a OnDisk) -> Self {
        match on_disk {
            OnDisk::Regular { bytes, .. } => Seen::Regular(bytes),
            OnDisk::Missing => Seen::Missing,
            OnDisk::Other(kind) => Seen::Other(*kind),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsutil::Stat;

    #[test]
    fn repair_backoff_doubles_to_five_minutes_and_resets_after_ten_quiet_minutes() {
        let mut backoff = Backoff::default();
        let start = Instant::now();
        let mut at = start;
        let mut delays = Vec::new();
        for _ in 0..14 {
            backoff.step_repair(at);
            let until = backoff.until.unwrap();
            delays.push(until - at);
            assert_eq!(backoff.blocked(at), Some(until));
            assert_eq!(backoff.blocked(until), None);
            at = until;
        }
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            delays[..5],
            [ms(250), ms(500), ms(1000), ms(2000), ms(4000)]
        );
        assert_eq!(delays[10], Duration::from_secs(256));
        assert_eq!(delays[11..], [Duration::from_secs(300); 3]);
        // A fighter at full speed gets a handful of repairs a minute, not a busy loop.
        let in_first_minute = delays
            .iter()
            .scan(Duration::ZERO, |t, d| {
                *t += *d;
                Some(*t)
            })
            .filter(|t| *t <= Duration::from_secs(60))
            .count();
        assert_eq!(in_first_minute, 7);
        // Just under ten quiet minutes after the last repair, the streak goes on; after
        // them, it starts over.
        let last = backoff.last.unwrap();
        let mut still = backoff.clone();
        still.step(
            last + Duration::from_secs(599),
            REPAIR_FIRST,
            REPAIR_BACKOFF_MAX,
            REPAIR_STREAK_RESET,
        );
        assert_eq!(
            still.until.unwrap() - (last + Duration::from_secs(599)),
            Duration::from_secs(300)
        );
        let later = last + Duration::from_secs(600);
        backoff.step_repair(later);
        assert_eq!(backoff.until.unwrap() - later, ms(250));
    }

    #[test]
    fn failed_writes_and_read_retries_back_off_to_their_caps() {
        let mut backoff = Backoff::default();
        let mut at = Instant::now();
        let mut last = Duration::ZERO;
        for _ in 0..12 {
            backoff.step_write(at);
            last = backoff.until.unwrap() - at;
            at += last;
        }
        assert_eq!(last, Duration::from_secs(300));
        let mut reads = Backoff::default();
        let at = Instant::now();
        reads.step_read(at);
        assert_eq!(reads.until.unwrap() - at, Duration::from_secs(1));
        for _ in 0..10 {
            reads.step_read(at);
        }
        assert_eq!(reads.until.unwrap() - at, Duration::from_secs(60));
    }

    const GOAL: &[u8] = b"the bundle";

    fn regular(bytes: &[u8], mode: u32, owner: (u32, u32)) -> OnDisk {
        OnDisk::Regular {
            bytes: bytes.to_vec(),
            stat: Stat {
                dev: 1,
                ino: 2,
                mode,
                uid: owner.0,
                gid: owner.1,
            },
        }
    }

    fn facts<'a>(
        on_disk: &'a OnDisk,
        last_written: Option<&[u8]>,
        write_failed: Option<&[u8]>,
    ) -> Facts<'a> {
        Facts {
            goal: GOAL,
            on_disk,
            mode: 0o644,
            owner: Some((0, 0)),
            last_written: last_written.map(Fingerprint::of),
            write_failed: write_failed.map(Fingerprint::of),
        }
    }

    #[test]
    fn a_file_as_it_should_be_is_left_alone() {
        let now = Instant::now();
        let on_disk = regular(GOAL, 0o644, (0, 0));
        let idle = Backoff::default();
        assert_eq!(
            decide(&facts(&on_disk, Some(GOAL), None), &idle, &idle, now),
            Action::InSync
        );
        // Not root: the owner is not ours to check.
        let theirs = regular(GOAL, 0o644, (1000, 1000));
        let mut f = facts(&theirs, None, None);
        f.owner = None;
        assert_eq!(decide(&f, &idle, &idle, now), Action::InSync);
    }

    #[test]
    fn a_new_bundle_is_written_at_once_even_while_repairs_back_off() {
        let now = Instant::now();
        let mut repairing = Backoff::default();
        repairing.step_repair(now);
        let idle = Backoff::default();
        let old = regular(b"the old bundle", 0o644, (0, 0));
        assert_eq!(
            decide(
                &facts(&old, Some(b"the old bundle"), None),
                &repairing,
                &idle,
                now
            ),
            Action::Write { repair: false }
        );
        for missing in [
            OnDisk::Missing,
            OnDisk::Other(FileKind::Symlink),
            OnDisk::Other(FileKind::Fifo),
        ] {
            assert_eq!(
                decide(&facts(&missing, None, None), &idle, &idle, now),
                Action::Write { repair: false }
            );
        }
    }

    #[test]
    fn drift_from_the_bundle_written_is_repaired_with_backoff() {
        let now = Instant::now();
        let idle = Backoff::default();
        let tampered = regular(b"garbage", 0o644, (0, 0));
        assert_eq!(
            decide(&facts(&tampered, Some(GOAL), None), &idle, &idle, now),
            Action::Write { repair: true }
        );
        let link = OnDisk::Other(FileKind::Symlink);
        assert_eq!(
            decide(&facts(&link, Some(GOAL), None), &idle, &idle, now),
            Action::Write { repair: true }
        );
        let mut repairing = Backoff::default();
        repairing.step_repair(now);
        let until = repairing.until.unwrap();
        assert!(matches!(
            decide(&facts(&tampered, Some(GOAL), None), &repairing, &idle, now),
            Action::Wait { until: u, .. } if u == until
        ));
        assert_eq!(
            decide(
                &facts(&tampered, Some(GOAL), None),
                &repairing,
                &idle,
                until
            ),
            Action::Write { repair: true }
        );
    }

    #[test]
    fn mode_and_owner_drift_is_repaired_in_place_under_the_same_backoff() {
        let now = Instant::now();
        let idle = Backoff::default();
        for drifted in [
            regular(GOAL, 0o666, (0, 0)),
            regular(GOAL, 0o644, (65534, 65534)),
        ] {
            assert_eq!(
                decide(&facts(&drifted, Some(GOAL), None), &idle, &idle, now),
                Action::RepairAttributes
            );
            let mut repairing = Backoff::default();
            repairing.step_repair(now);
            assert!(matches!(
                decide(&facts(&drifted, Some(GOAL), None), &repairing, &idle, now),
                Action::Wait { .. }
            ));
        }
    }

    #[test]
    fn a_directory_at_the_path_is_never_written_over_whatever_the_backoffs_say() {
        let now = Instant::now();
        let idle = Backoff::default();
        let mut busy = Backoff::default();
        busy.step_write(now);
        let directory = OnDisk::Other(FileKind::Directory);
        for (last_written, write_failed, backoff) in [
            (None, None, &idle),
            (Some(GOAL), None, &idle),
            (Some(GOAL), Some(GOAL), &busy),
        ] {
            assert_eq!(
                decide(
                    &facts(&directory, last_written, write_failed),
                    backoff,
                    backoff,
                    now
                ),
                Action::CannotReplace
            );
        }
    }

    #[test]
    fn a_failed_write_waits_for_its_retry_but_a_different_bundle_does_not() {
        let now = Instant::now();
        let idle = Backoff::default();
        let mut retrying = Backoff::default();
        retrying.step_write(now);
        let old = regular(b"old", 0o644, (0, 0));
        assert!(matches!(
            decide(&facts(&old, Some(b"old"), Some(GOAL)), &idle, &retrying, now),
            Action::Wait { problem, .. } if problem.contains("write failed")
        ));
        assert_eq!(
            decide(
                &facts(&old, Some(b"old"), Some(b"another bundle")),
                &idle,
                &retrying,
                now
            ),
            Action::Write { repair: false }
        );
        assert_eq!(
            decide(
                &facts(&old, Some(b"old"), Some(GOAL)),
                &idle,
                &retrying,
                retrying.until.unwrap()
            ),
            Action::Write { repair: false }
        );
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    #[test]
    fn a_cleared_backoff_lets_the_next_attempt_through_and_starts_over() {
        let now = Instant::now();
        let mut backoff = Backoff::default();
        for _ in 0..4 {
            backoff.step_write(now);
        }
        assert!(backoff.blocked(now).is_some());
        backoff.clear();
        assert_eq!(backoff.blocked(now), None);
        backoff.step_write(now);
        assert_eq!(backoff.until, Some(now + WRITE_RETRY_FIRST));
    }
}
