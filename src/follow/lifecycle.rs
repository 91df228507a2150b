//! The watch of one cluster object as an explicit state machine (SPEC 6): what the loop in
//! [`super::cluster`] waits for in each state, and a pure function from (state, what
//! happened, now) to (next state, what to do, how long to wait). No socket, no clock and
//! no randomness inside: the loop passes `now` and a jitter draw, so that each rule is a
//! unit test.
//!
//! The rules, each of them a test below:
//! - `410 Gone` is what every API server answers right after it restarted: the object is
//!   listed again at once, with no backoff and no failure reported. Only a 410 for the
//!   resourceVersion of the list just made, which no restart explains, backs off.
//! - A server that cannot be reached at all (refused, reset, timed out) is asked again
//!   within [`UNREACHABLE_MAX`]: asking a server that is not there costs it nothing, and a
//!   node must be back within seconds of it.
//! - A server that answers but fails or sheds load (429, 5xx, a refusal, no answer, a
//!   silent watch) is asked again after a delay that doubles up to [`ANSWERED_MAX`], never
//!   sooner than its `Retry-After`, and not faster after it.
//! - Every delay is spread by jitter, so that a fleet does not come back in step.
//! - A resourceVersion means something only within one store. A watch that ended at its
//!   timeout resumes from it; after the connection was lost (the server could not be
//!   reached, went silent, or the watch was cut before its timeout) the object is listed
//!   again instead: the server that answers next may stand on a store restored from a
//!   backup, where a resumed watch opens and hears nothing for hours while the source looks
//!   up (behind that resourceVersion, or past it on another history). A list whose
//!   resourceVersion went back is told ([`Step::went_back`]).
//! - A watch is established once it has delivered (an event or a bookmark) or stayed open
//!   [`CONFIRM`] without an error: only then is the backoff reset and a source that was down
//!   reported up again. A watch the server accepted and then expired or cut is not.

use std::time::Duration;

use tokio::time::Instant;

/// The first delay after the server could not be reached.
pub const UNREACHABLE_FIRST: Duration = Duration::from_millis(500);
/// The longest delay while the server cannot be reached (SPEC 6: at most 5 s).
pub const UNREACHABLE_MAX: Duration = Duration::from_secs(5);
/// The first delay after the server answered with a failure (kube-runtime's 0.8 s).
pub const ANSWERED_FIRST: Duration = Duration::from_millis(800);
/// The longest delay the agent chooses itself after the server answered with a failure.
pub const ANSWERED_MAX: Duration = Duration::from_secs(30);
/// The longest `Retry-After` honoured: a server (or a proxy) that asks for more is asked
/// again after this, so that a mistaken header cannot stop a node following its CA for hours.
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(300);
/// How long an accepted watch must stay open without an error, when it has delivered
/// nothing, to count as established. An API server that restarted answers a resumed watch
/// with HTTP 200 and, at once, an ERROR event (410): a watch that is still open after this
/// was not expired. A watch on a quiet object gets no event for minutes, so waiting for one
/// would keep a source that is back reported down.
pub const CONFIRM: Duration = Duration::from_secs(1);

/// What went wrong with a request, as the policy tells failures apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The API server could not be reached at all: the connection was refused, reset or
    /// timed out, no route, a failed name lookup.
    Unreachable,
    /// The server, or a proxy in front of it, answered but failed, shed load or refused
    /// (429, 5xx, 401, 403, 404, an answer that makes no sense, a TLS failure), or took the
    /// request and went silent. `retry_after` is how long it asked the client to wait.
    Answered { retry_after: Option<Duration> },
    /// The server took the request and went silent: no answer within the request's
    /// deadline, or an open watch that sent nothing past its timeout. Backed off as a
    /// failure the server answered, but the connection it was on is as good as lost.
    Hung,
    /// `410 Gone`: the resourceVersion is older than the server keeps.
    Expired,
}

/// How much sooner than its `timeoutSeconds` a watch may end, as the client measures it
/// (from the answer to the request), and still count as ended by it.
pub const TIMEOUT_SLACK: Duration = Duration::from_secs(5);

impl Happened {
    /// The open watch ended with no error after being open `open_for`, asked to end after
    /// `timeout`: at its timeout, or cut before it.
    pub fn end(open_for: Duration, timeout: Duration) -> Happened {
        if open_for + TIMEOUT_SLACK < timeout {
            Happened::Cut
        } else {
            Happened::Ended
        }
    }
}

impl Failure {
    /// A failure that the server answered, without a `Retry-After`.
    pub const ANSWERED: Failure = Failure::Answered { retry_after: None };

    /// Whether the connection to the API server is lost with this failure, so that the
    /// server answering next may stand on another store (one restored from a backup) and a
    /// resourceVersion from before means nothing there. A server that answered (a 429, a
    /// 5xx, a 410) is the one the resourceVersion came from.
    pub fn loses_connection(self) -> bool {
        matches!(self, Failure::Unreachable | Failure::Hung)
    }
}

/// What the loop saw, for [`Watch::step`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Happened {
    /// A list answered, with the object (or its absence) as of `rv`.
    Listed { rv: String },
    /// The server accepted the watch request (HTTP 200): its stream is open.
    Opened,
    /// The open watch delivered an event or a bookmark that brought it to `rv`.
    Delivered { rv: String },
    /// The open watch stayed open [`CONFIRM`] without an error.
    StayedOpen,
    /// The server ended the open watch at its `timeoutSeconds` ([`Happened::end`]).
    Ended,
    /// The open watch ended well before its `timeoutSeconds` with no error to say why: the
    /// connection was cut (a server shutting down, a proxy, a TLS stream cut short, which
    /// the client library ends quietly). The server answering next may stand on another
    /// store.
    Cut,
    /// The request failed, or the open watch broke.
    Failed(Failure),
    /// The wait of [`Action::Wait`] is over.
    Waited,
    /// New credentials were read: the next request uses them.
    NewCredentials,
}

/// What the loop does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// List the object (field selector `metadata.name`).
    List,
    /// Open a watch from `rv`.
    Watch { rv: String },
    /// Read the open watch. `confirm_at`: when it is not established yet, the instant at
    /// which staying open makes it so ([`Happened::StayedOpen`]).
    Read { confirm_at: Option<Instant> },
    /// Wait until `until` (new credentials end the wait sooner), then [`Happened::Waited`].
    Wait { until: Instant },
}

/// What the source is to be reported as after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// Nothing new to tell.
    Nothing,
    /// It has delivered again after being down: tell its content as last seen.
    Up,
    /// It failed: tell the failure (its last good content stays).
    Down,
}

/// Where to go on after a wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    List,
    Watch { rv: String },
}

/// Where the watch of one object stands. `from_list`: the resourceVersion came from the
/// list just made and no watch has been established since, so a 410 for it is no restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Waits for the answer to a list: nothing is known yet, or the resourceVersion expired.
    Listing,
    /// Waits for the server to accept a watch from `rv`.
    Opening { rv: String, from_list: bool },
    /// Waits for the accepted watch to deliver, end, fail, or stay open until `confirm_at`.
    Accepted {
        rv: String,
        from_list: bool,
        confirm_at: Instant,
    },
    /// Waits for the next event, bookmark, end or failure of an established watch.
    Watching { rv: String },
    /// Waits until `until` after a failure, then does `then`.
    BackingOff { until: Instant, then: Resume },
}

/// The watch of one object: its state, and what its backoff has counted since a watch was
/// last established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watch {
    pub state: State,
    /// Counts since a watch was last established.
    backoff: Backoff,
    /// Watches that ended before they were established, since one last was.
    early_ends: u32,
    /// The list under way follows a watch cut before it was established, with no wait
    /// between: the early ends before it still count, or a proxy that cuts every stream
    /// would make a tight loop of lists and watches.
    relisting_at_once: bool,
    /// Whether the source was last reported up.
    up: bool,
    /// The newest resourceVersion a list or the watch has reached, kept across a list so
    /// that a store that went back is told.
    reached: Option<String>,
}

/// The delays between failed attempts at one thing, by what failed (SPEC 6), counted since
/// it last succeeded. Pure: the caller passes the jitter draw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backoff {
    /// Consecutive failures to reach the server.
    unreachable: u32,
    /// Consecutive failures the server answered.
    answered: u32,
    /// The least delay for a failure the server answers, raised by a `Retry-After` so that
    /// the delay after it never drops back to a fast retry.
    floor: Duration,
}

impl Backoff {
    /// The delay before the next attempt after `failure`; `jitter`, drawn evenly from
    /// `[0, 1)`, spreads it. A server that cannot be reached is asked again after half to
    /// all of 0.5 s doubling to [`UNREACHABLE_MAX`]; one that answered with a failure (a 410
    /// counts as one here) after [`Backoff::answered`].
    pub fn after(&mut self, failure: Failure, jitter: f64) -> Duration {
        let jitter = jitter.clamp(0.0, 1.0);
        match failure {
            Failure::Unreachable => {
                self.unreachable = self.unreachable.saturating_add(1);
                let base = doubled(UNREACHABLE_FIRST, self.unreachable, UNREACHABLE_MAX);
                base.mul_f64(0.5 + jitter / 2.0)
            }
            Failure::Answered { retry_after } => self.answered(retry_after, jitter),
            Failure::Hung | Failure::Expired => self.answered(None, jitter),
        }
    }

    /// It succeeded: the next failure starts over.
    pub fn reset(&mut self) {
        *self = Backoff::default();
    }

    /// The delay after a failure the server answered: doubling from [`ANSWERED_FIRST`] to
    /// [`ANSWERED_MAX`] with jitter, never before the server asked (`Retry-After`, up to
    /// [`RETRY_AFTER_MAX`]), and never under the floor an earlier `Retry-After` left (up to
    /// [`ANSWERED_MAX`]) until a watch is established again.
    fn answered(&mut self, retry_after: Option<Duration>, jitter: f64) -> Duration {
        self.answered = self.answered.saturating_add(1);
        let asked = retry_after.unwrap_or_default().min(RETRY_AFTER_MAX);
        self.floor = self.floor.max(asked.min(ANSWERED_MAX));
        let own = doubled(ANSWERED_FIRST, self.answered, ANSWERED_MAX).mul_f64(0.5 + jitter / 2.0);
        // Never before the server asked, nor under the floor; spread after that instant.
        let least = self.floor.max(asked).mul_f64(1.0 + jitter / 4.0);
        own.max(least)
    }
}

/// One step's outcome: what to do, and what to report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub action: Action,
    pub report: Report,
    /// The list just made stands on a store behind the one the watch had reached (one
    /// restored from a backup): to be logged as such.
    pub went_back: Option<WentBack>,
}

/// A store whose resourceVersion went back, from what the watch had reached to what a list
/// says now. Told only when both are numbers (etcd's revisions): a resourceVersion is
/// otherwise opaque, and nothing is guessed from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WentBack {
    pub from: String,
    pub to: String,
}

impl WentBack {
    /// `to`, the resourceVersion of a list, when it is behind `from`, the one reached before.
    fn between(from: Option<&str>, to: &str) -> Option<WentBack> {
        let before: u64 = from?.parse().ok()?;
        let now: u64 = to.parse().ok()?;
        (now < before).then(|| WentBack {
            from: before.to_string(),
            to: now.to_string(),
        })
    }
}

impl Watch {
    /// A new watch, and its first action: a list.
    pub fn start() -> (Watch, Action) {
        let watch = Watch {
            state: State::Listing,
            backoff: Backoff::default(),
            early_ends: 0,
            relisting_at_once: false,
            up: false,
            reached: None,
        };
        (watch, Action::List)
    }

    /// Whether the source was last reported up.
    pub fn up(&self) -> bool {
        self.up
    }

    /// The source was reported down outside the watch (no usable credentials): it is
    /// reported up again once the watch has delivered.
    pub fn lost(&mut self) {
        self.up = false;
    }

    /// The resourceVersion the watch has reached, when it has one.
    pub fn rv(&self) -> Option<&str> {
        match &self.state {
            State::Opening { rv, .. } | State::Accepted { rv, .. } | State::Watching { rv } => {
                Some(rv)
            }
            State::BackingOff {
                then: Resume::Watch { rv },
                ..
            } => Some(rv),
            State::Listing
            | State::BackingOff {
                then: Resume::List, ..
            } => None,
        }
    }

    /// The next state after `happened` at `now`, and what to do. `jitter`, drawn evenly
    /// from `[0, 1)`, spreads the delay of a backoff.
    pub fn step(&mut self, happened: Happened, now: Instant, jitter: f64) -> Step {
        let state = std::mem::replace(&mut self.state, State::Listing);
        let listed = match &happened {
            Happened::Listed { rv } if state == State::Listing => Some(rv.clone()),
            _ => None,
        };
        let (state, mut step) = self.decide(state, happened, now, jitter);
        self.state = state;
        if let Some(rv) = listed {
            step.went_back = WentBack::between(self.reached.as_deref(), &rv);
            self.reached = Some(rv);
        }
        step
    }

    fn decide(
        &mut self,
        state: State,
        happened: Happened,
        now: Instant,
        jitter: f64,
    ) -> (State, Step) {
        use Happened as H;
        use State as S;
        match (state, happened) {
            (S::Listing, H::Listed { rv }) => {
                // The list delivered: the source is up with what it said. Watches that
                // ended early before it are no loop of requests when a wait came between.
                self.up = true;
                if !std::mem::take(&mut self.relisting_at_once) {
                    self.early_ends = 0;
                }
                let open = S::Opening {
                    rv: rv.clone(),
                    from_list: true,
                };
                (open, act(Action::Watch { rv }, Report::Up))
            }
            (S::Listing, H::Failed(failure)) => {
                // A list has no resourceVersion to expire: a 410 for it is the server's fault.
                self.back_off(failure.or_answered(), Resume::List, now, jitter)
            }
            (S::Opening { rv, from_list }, H::Opened) => {
                let confirm_at = now + CONFIRM;
                let accepted = S::Accepted {
                    rv,
                    from_list,
                    confirm_at,
                };
                let read = Action::Read {
                    confirm_at: Some(confirm_at),
                };
                (accepted, act(read, Report::Nothing))
            }
            (S::Accepted { .. }, H::Delivered { rv })
            | (S::Watching { .. }, H::Delivered { rv }) => self.established(rv),
            (S::Accepted { rv, .. }, H::StayedOpen) => self.established(rv),
            (
                S::Opening { from_list, .. } | S::Accepted { from_list, .. },
                H::Failed(Failure::Expired),
            ) => {
                if from_list {
                    // Expired straight after the list that gave its resourceVersion: no
                    // restart explains it, and listing again at once could loop.
                    self.back_off(Failure::ANSWERED, Resume::List, now, jitter)
                } else {
                    // A server that restarted: list again at once, nothing failed.
                    (S::Listing, act(Action::List, Report::Nothing))
                }
            }
            (S::Watching { .. }, H::Failed(Failure::Expired)) => {
                (S::Listing, act(Action::List, Report::Nothing))
            }
            // A failure between the list and the watch may be a restart, which explains a
            // 410 later: the watch resumed after it is no longer from the list.
            (
                S::Opening { rv, .. } | S::Accepted { rv, .. } | S::Watching { rv },
                H::Failed(failure),
            ) => self.back_off(failure, Resume::Watch { rv }, now, jitter),
            (S::Accepted { rv, from_list, .. }, H::Ended) => {
                // Ended before it was established: once is the server's right (its own
                // shutdown, a timeout that fell just then), and it is resumed at once; again
                // with nothing established between (a proxy that cuts streams) it is a
                // failure, or this would be a tight loop of requests.
                self.early_ends = self.early_ends.saturating_add(1);
                if self.early_ends > 1 {
                    self.back_off(Failure::ANSWERED, Resume::Watch { rv }, now, jitter)
                } else {
                    let open = S::Opening {
                        rv: rv.clone(),
                        from_list,
                    };
                    (open, act(Action::Watch { rv }, Report::Nothing))
                }
            }
            (S::Accepted { .. }, H::Cut) => {
                // Cut before it was established: listed again at once the first time (the
                // server that answers may stand on another store); again with nothing
                // established between, a failure with a backoff.
                self.early_ends = self.early_ends.saturating_add(1);
                if self.early_ends > 1 {
                    self.back_off(Failure::ANSWERED, Resume::List, now, jitter)
                } else {
                    self.relisting_at_once = true;
                    (S::Listing, act(Action::List, Report::Nothing))
                }
            }
            (S::Watching { .. }, H::Cut) => {
                // An established watch cut: listed again at once, nothing failed.
                (S::Listing, act(Action::List, Report::Nothing))
            }
            (S::Watching { rv }, H::Ended | H::NewCredentials) => {
                let open = S::Opening {
                    rv: rv.clone(),
                    from_list: false,
                };
                (open, act(Action::Watch { rv }, Report::Nothing))
            }
            (S::Accepted { rv, from_list, .. }, H::NewCredentials) => {
                let open = S::Opening {
                    rv: rv.clone(),
                    from_list,
                };
                (open, act(Action::Watch { rv }, Report::Nothing))
            }
            (S::BackingOff { then, .. }, H::Waited | H::NewCredentials) => match then {
                Resume::List => (S::Listing, act(Action::List, Report::Nothing)),
                Resume::Watch { rv } => {
                    let open = S::Opening {
                        rv: rv.clone(),
                        from_list: false,
                    };
                    (open, act(Action::Watch { rv }, Report::Nothing))
                }
            },
            // Anything else cannot come in that state (the loop only reads a watch that
            // is open, and only waits while backing off): carry on as the state says.
            (state, _) => {
                let action = resume_action(&state);
                (state, act(action, Report::Nothing))
            }
        }
    }

    /// The watch has delivered, or stayed open long enough: the backoff starts over, and a
    /// source that was down is up again.
    fn established(&mut self, rv: String) -> (State, Step) {
        self.reached = Some(rv.clone());
        self.backoff.reset();
        self.early_ends = 0;
        let report = if self.up { Report::Nothing } else { Report::Up };
        self.up = true;
        let read = Action::Read { confirm_at: None };
        (State::Watching { rv }, act(read, report))
    }

    /// A failure: wait as its kind says, then `then`, or a list when the connection was
    /// lost with it (the store the server stands on may have gone back).
    fn back_off(
        &mut self,
        failure: Failure,
        then: Resume,
        now: Instant,
        jitter: f64,
    ) -> (State, Step) {
        let then = if failure.loses_connection() {
            Resume::List
        } else {
            then
        };
        self.up = false;
        self.relisting_at_once = false;
        let delay = self.backoff.after(failure, jitter);
        let until = now + delay;
        let state = State::BackingOff { until, then };
        (state, act(Action::Wait { until }, Report::Down))
    }
}

impl Failure {
    /// This failure, with a 410 counted as one the server answered.
    fn or_answered(self) -> Failure {
        match self {
            Failure::Expired => Failure::ANSWERED,
            other => other,
        }
    }
}

fn act(action: Action, report: Report) -> Step {
    Step {
        action,
        report,
        went_back: None,
    }
}

/// What a state is doing, for an event it does not expect.
fn resume_action(state: &State) -> Action {
    match state {
        State::Listing => Action::List,
        State::Opening { rv, .. } => Action::Watch { rv: rv.clone() },
        State::Accepted { confirm_at, .. } => Action::Read {
            confirm_at: Some(*confirm_at),
        },
        State::Watching { .. } => Action::Read { confirm_at: None },
        State::BackingOff { until, .. } => Action::Wait { until: *until },
    }
}

/// A draw for jitter, evenly in `[0, 1)`, from the standard library's randomly keyed hasher
/// (a new key for each process, a counter for each draw): enough to spread a fleet's
/// retries, and never used for anything secret.
pub fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(DRAWS.fetch_add(1, Ordering::Relaxed));
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// `first`, doubled for each failure after the first, at most `max`.
fn doubled(first: Duration, failures: u32, max: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    first.saturating_mul(1 << doublings).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: f64 = 0.0;
    const MAX: f64 = 0.999_999;

    fn rv(text: &str) -> String {
        text.to_string()
    }

    /// A watch established from a list at resourceVersion 5, at `now`.
    fn watching(now: Instant) -> Watch {
        let (mut w, _) = Watch::start();
        w.step(Happened::Listed { rv: rv("5") }, now, MIN);
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::StayedOpen, now + CONFIRM, MIN);
        assert_eq!(step.action, Action::Read { confirm_at: None });
        assert_eq!(w.state, State::Watching { rv: rv("5") });
        w
    }

    fn wait_of(step: &Step, now: Instant) -> Duration {
        match step.action {
            Action::Wait { until } => until - now,
            ref other => panic!("not a wait: {other:?}"),
        }
    }

    #[test]
    fn it_lists_then_watches_from_the_list_and_the_list_makes_the_source_up() {
        let now = Instant::now();
        let (mut w, first) = Watch::start();
        assert_eq!(first, Action::List);
        assert!(!w.up());
        let step = w.step(Happened::Listed { rv: rv("5") }, now, MIN);
        assert_eq!(step.action, Action::Watch { rv: rv("5") });
        assert_eq!(step.report, Report::Up);
        assert!(w.up());
        let step = w.step(Happened::Opened, now, MIN);
        assert_eq!(
            step.action,
            Action::Read {
                confirm_at: Some(now + CONFIRM)
            }
        );
        // Already up from the list: establishing the watch tells nothing new.
        let step = w.step(Happened::Delivered { rv: rv("6") }, now, MIN);
        assert_eq!(step.report, Report::Nothing);
        assert_eq!(w.state, State::Watching { rv: rv("6") });
    }

    #[test]
    fn a_410_after_a_reconnect_lists_again_at_once_without_a_failure() {
        let now = Instant::now();
        let mut w = watching(now);
        // The server restarts: it ends the watch as it shuts down, and answers the resumed
        // one with 503 for a while.
        let step = w.step(Happened::Ended, now, MAX);
        assert_eq!(step.action, Action::Watch { rv: rv("5") });
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MAX);
        assert_eq!(step.report, Report::Down);
        for _ in 0..10 {
            w.step(Happened::Waited, now, MAX);
            w.step(Happened::Failed(Failure::ANSWERED), now, MAX);
        }
        // It answers again, from a new watch cache: the resumed watch is accepted, then
        // expired.
        let step = w.step(Happened::Waited, now, MAX);
        assert_eq!(step.action, Action::Watch { rv: rv("5") });
        w.step(Happened::Opened, now, MAX);
        let step = w.step(Happened::Failed(Failure::Expired), now, MAX);
        assert_eq!(step.action, Action::List, "no wait before the list");
        assert_eq!(step.report, Report::Nothing, "a 410 is not a failure");
        assert!(!w.up(), "still down until something is delivered");
        let step = w.step(Happened::Listed { rv: rv("40") }, now, MAX);
        assert_eq!(step.report, Report::Up);
        assert_eq!(step.action, Action::Watch { rv: rv("40") });
    }

    #[test]
    fn a_410_on_the_watch_request_itself_lists_at_once_too() {
        let now = Instant::now();
        let mut w = watching(now);
        w.step(Happened::Ended, now, MIN);
        let step = w.step(Happened::Failed(Failure::Expired), now, MIN);
        assert_eq!(step.action, Action::List);
        assert_eq!(step.report, Report::Nothing);
        // An established watch whose resourceVersion is compacted away lists at once.
        let mut w = watching(now);
        let step = w.step(Happened::Failed(Failure::Expired), now, MIN);
        assert_eq!((step.action, step.report), (Action::List, Report::Nothing));
        assert!(w.up(), "its content is as current as the last event");
    }

    #[test]
    fn a_410_for_the_resource_version_of_the_list_just_made_backs_off() {
        let now = Instant::now();
        let (mut w, _) = Watch::start();
        w.step(Happened::Listed { rv: rv("5") }, now, MIN);
        let step = w.step(Happened::Failed(Failure::Expired), now, MIN);
        assert_eq!(step.report, Report::Down);
        assert!(wait_of(&step, now) >= ANSWERED_FIRST / 2);
        assert_eq!(w.step(Happened::Waited, now, MIN).action, Action::List);
        // Also when the stream expires it just after it was accepted.
        w.step(Happened::Listed { rv: rv("6") }, now, MIN);
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Failed(Failure::Expired), now, MIN);
        assert!(wait_of(&step, now) >= ANSWERED_FIRST, "{step:?}");
        // A list that answers 410 (no real server does) is a failure too.
        w.step(Happened::Waited, now, MIN);
        let step = w.step(Happened::Failed(Failure::Expired), now, MIN);
        assert_eq!(step.report, Report::Down);
    }

    #[test]
    fn a_410_after_a_failure_is_a_restart_even_when_the_watch_came_from_the_list() {
        let now = Instant::now();
        let (mut w, _) = Watch::start();
        w.step(Happened::Listed { rv: rv("5") }, now, MIN);
        w.step(Happened::Opened, now, MIN);
        // The server fails the watch before it is established (a 503 as it shuts down), and
        // comes back restarted.
        w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        w.step(Happened::Waited, now, MIN);
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Failed(Failure::Expired), now, MIN);
        assert_eq!((step.action, step.report), (Action::List, Report::Nothing));
        // The same when the watch request itself failed.
        let (mut w, _) = Watch::start();
        w.step(Happened::Listed { rv: rv("5") }, now, MIN);
        w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        w.step(Happened::Waited, now, MIN);
        let step = w.step(Happened::Failed(Failure::Expired), now, MIN);
        assert_eq!((step.action, step.report), (Action::List, Report::Nothing));
    }

    #[test]
    fn a_server_that_cannot_be_reached_is_asked_again_within_five_seconds_with_jitter() {
        let now = Instant::now();
        let mut w = watching(now);
        let first = w.step(Happened::Failed(Failure::Unreachable), now, MAX);
        assert!(wait_of(&first, now) <= UNREACHABLE_FIRST);
        assert_eq!(w.step(Happened::Waited, now, MAX).action, Action::List);
        let mut delays = vec![];
        for _ in 0..30 {
            let step = w.step(Happened::Failed(Failure::Unreachable), now, MAX);
            delays.push(wait_of(&step, now));
            w.step(Happened::Waited, now, MAX);
        }
        assert!(delays.iter().all(|d| *d <= UNREACHABLE_MAX), "{delays:?}");
        assert!(
            *delays.last().unwrap() > UNREACHABLE_MAX.mul_f64(0.99),
            "{delays:?}"
        );
        assert!(delays[0] > UNREACHABLE_FIRST, "it doubles: {delays:?}");
        // Jitter spreads the fleet: the least draw waits half of the most.
        let step = w.step(Happened::Failed(Failure::Unreachable), now, MIN);
        assert_eq!(wait_of(&step, now), UNREACHABLE_MAX / 2);
    }

    #[test]
    fn a_server_that_answers_with_failures_is_asked_after_a_doubling_delay_up_to_thirty_seconds() {
        let now = Instant::now();
        let (mut w, _) = Watch::start();
        let mut delays = vec![];
        for _ in 0..8 {
            let step = w.step(Happened::Failed(Failure::ANSWERED), now, MAX);
            assert_eq!(step.report, Report::Down);
            delays.push(wait_of(&step, now).as_millis());
            assert_eq!(w.step(Happened::Waited, now, MAX).action, Action::List);
        }
        assert_eq!(delays, [799, 1599, 3199, 6399, 12799, 25599, 29999, 29999]);
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert_eq!(wait_of(&step, now), ANSWERED_MAX / 2, "jitter spreads it");
    }

    #[test]
    fn retry_after_is_honoured_and_the_next_failure_does_not_drop_back_to_a_fast_retry() {
        let now = Instant::now();
        let mut w = watching(now);
        let twenty = Duration::from_secs(20);
        let shed = Failure::Answered {
            retry_after: Some(twenty),
        };
        for jitter in [MIN, 0.5, MAX] {
            let mut probe = w.clone();
            let step = probe.step(Happened::Failed(shed), now, jitter);
            let delay = wait_of(&step, now);
            assert!((twenty..=twenty * 5 / 4).contains(&delay), "{delay:?}");
        }
        w.step(Happened::Failed(shed), now, MIN);
        w.step(Happened::Waited, now, MIN);
        // The next failure, a 503 with no Retry-After, still waits as long.
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert!(wait_of(&step, now) >= twenty, "{step:?}");
        // Until a watch is established again: then the next failure is a fast retry again.
        w.step(Happened::Waited, now, MIN);
        w.step(Happened::Opened, now, MIN);
        w.step(Happened::StayedOpen, now, MIN);
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert_eq!(wait_of(&step, now), ANSWERED_FIRST / 2);
    }

    #[test]
    fn a_retry_after_beyond_reason_is_honoured_up_to_its_cap() {
        let now = Instant::now();
        let (mut w, _) = Watch::start();
        let day = Failure::Answered {
            retry_after: Some(Duration::from_secs(86_400)),
        };
        let step = w.step(Happened::Failed(day), now, MIN);
        assert_eq!(wait_of(&step, now), RETRY_AFTER_MAX);
        // What it leaves as the floor is the agent's own cap.
        w.step(Happened::Waited, now, MIN);
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert_eq!(wait_of(&step, now), ANSWERED_MAX);
    }

    #[test]
    fn a_source_is_up_only_once_its_watch_has_delivered_or_stayed_open() {
        let now = Instant::now();
        let mut w = watching(now);
        w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert!(!w.up());
        w.step(Happened::Waited, now, MIN);
        // Accepted is not delivered: no report.
        let step = w.step(Happened::Opened, now, MIN);
        assert_eq!(step.report, Report::Nothing);
        assert!(!w.up());
        // A failure right after: still down, and reported as a failure.
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert_eq!(step.report, Report::Down);
        w.step(Happened::Waited, now, MIN);
        w.step(Happened::Opened, now, MIN);
        // Delivered: up again, told once.
        let step = w.step(Happened::Delivered { rv: rv("7") }, now, MIN);
        assert_eq!(step.report, Report::Up);
        assert!(w.up());
        let step = w.step(Happened::Delivered { rv: rv("8") }, now, MIN);
        assert_eq!(step.report, Report::Nothing);
        // Staying open, with nothing to deliver on a quiet object, counts the same.
        w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        w.step(Happened::Waited, now, MIN);
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::StayedOpen, now + CONFIRM, MIN);
        assert_eq!(step.report, Report::Up);
        assert_eq!(w.state, State::Watching { rv: rv("8") });
        // After a lost connection, the list that follows is what makes it up.
        w.step(Happened::Failed(Failure::Unreachable), now, MIN);
        w.step(Happened::Waited, now, MIN);
        assert!(!w.up());
        let step = w.step(Happened::Listed { rv: rv("9") }, now, MIN);
        assert_eq!(step.report, Report::Up);
        assert!(w.up());
    }

    #[test]
    fn an_established_watch_resets_both_backoffs() {
        let now = Instant::now();
        let mut w = watching(now);
        for _ in 0..6 {
            w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
            w.step(Happened::Waited, now, MIN);
            w.step(Happened::Failed(Failure::Unreachable), now, MIN);
            w.step(Happened::Waited, now, MIN);
        }
        w.step(Happened::Listed { rv: rv("9") }, now, MIN);
        w.step(Happened::Opened, now, MIN);
        w.step(Happened::Delivered { rv: rv("9") }, now, MIN);
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert_eq!(wait_of(&step, now), ANSWERED_FIRST / 2);
        let mut w = watching(now);
        for _ in 0..6 {
            w.step(Happened::Failed(Failure::Unreachable), now, MIN);
            w.step(Happened::Waited, now, MIN);
        }
        w.step(Happened::Listed { rv: rv("9") }, now, MIN);
        w.step(Happened::Opened, now, MIN);
        w.step(Happened::StayedOpen, now, MIN);
        let step = w.step(Happened::Failed(Failure::Unreachable), now, MIN);
        assert_eq!(wait_of(&step, now), UNREACHABLE_FIRST / 2);
    }

    #[test]
    fn a_clean_end_resumes_at_once_unless_watches_keep_ending_as_soon_as_they_open() {
        let now = Instant::now();
        let mut w = watching(now);
        w.step(Happened::Delivered { rv: rv("12") }, now, MIN);
        let step = w.step(Happened::Ended, now, MIN);
        assert_eq!(step.action, Action::Watch { rv: rv("12") });
        assert_eq!(step.report, Report::Nothing);
        // Once before it is established: resumed at once, as the server may end it then.
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Ended, now, MIN);
        assert_eq!(step.action, Action::Watch { rv: rv("12") });
        assert_eq!(step.report, Report::Nothing);
        // Twice in a row: a proxy that cuts streams, a failure with a backoff.
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Ended, now, MIN);
        assert_eq!(step.report, Report::Down);
        assert!(wait_of(&step, now) >= ANSWERED_FIRST / 2);
        assert_eq!(
            w.step(Happened::Waited, now, MIN).action,
            Action::Watch { rv: rv("12") }
        );
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Ended, now, MIN);
        assert!(
            wait_of(&step, now) >= ANSWERED_FIRST,
            "it doubles: {step:?}"
        );
        // An established watch starts the count over.
        w.step(Happened::Waited, now, MIN);
        w.step(Happened::Opened, now, MIN);
        w.step(Happened::StayedOpen, now, MIN);
        w.step(Happened::Ended, now, MIN);
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Ended, now, MIN);
        assert_eq!(step.report, Report::Nothing);
    }

    #[test]
    fn a_watch_the_server_failed_resumes_from_where_it_was_without_a_list() {
        let now = Instant::now();
        let mut w = watching(now);
        w.step(Happened::Delivered { rv: rv("30") }, now, MIN);
        let shed = Failure::Answered {
            retry_after: Some(Duration::from_secs(1)),
        };
        w.step(Happened::Failed(shed), now, MIN);
        assert_eq!(
            w.step(Happened::Waited, now, MIN).action,
            Action::Watch { rv: rv("30") }
        );
        // After a failed watch request too.
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert_eq!(step.report, Report::Down);
        assert_eq!(
            w.step(Happened::Waited, now, MIN).action,
            Action::Watch { rv: rv("30") }
        );
    }

    #[test]
    fn after_the_connection_was_lost_the_object_is_listed_again_not_resumed() {
        for lost in [Failure::Unreachable, Failure::Hung] {
            let now = Instant::now();
            let mut w = watching(now);
            w.step(Happened::Delivered { rv: rv("30") }, now, MIN);
            // The established watch breaks; so does a watch request after a clean end.
            let step = w.step(Happened::Failed(lost), now, MIN);
            assert_eq!(step.report, Report::Down, "{lost:?}");
            assert_eq!(w.rv(), None, "{lost:?}: nothing to resume from");
            assert_eq!(w.step(Happened::Waited, now, MIN).action, Action::List);
            // A list that fails while the server is away is listed again, not resumed.
            w.step(Happened::Failed(Failure::Unreachable), now, MIN);
            assert_eq!(w.step(Happened::Waited, now, MIN).action, Action::List);
            // A 429 on that list keeps it a list: the resourceVersion is still unknown.
            w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
            assert_eq!(w.step(Happened::Waited, now, MIN).action, Action::List);
            // The store came back from a backup: the list is behind, and says so; the
            // watch goes on from the store's resourceVersion, and the source is up on it.
            let step = w.step(Happened::Listed { rv: rv("12") }, now, MIN);
            assert_eq!(step.report, Report::Up);
            assert_eq!(step.action, Action::Watch { rv: rv("12") });
            let back = WentBack {
                from: rv("30"),
                to: rv("12"),
            };
            assert_eq!(step.went_back, Some(back), "{lost:?}");

            // The same from a watch request after a clean end.
            let mut w = watching(now);
            w.step(Happened::Ended, now, MIN);
            w.step(Happened::Failed(lost), now, MIN);
            assert_eq!(w.step(Happened::Waited, now, MIN).action, Action::List);
            // And from a watch accepted but not yet established.
            let mut w = watching(now);
            w.step(Happened::Ended, now, MIN);
            w.step(Happened::Opened, now, MIN);
            w.step(Happened::Failed(lost), now, MIN);
            assert_eq!(w.step(Happened::Waited, now, MIN).action, Action::List);
        }
    }

    #[test]
    fn a_watch_cut_before_its_timeout_is_listed_again_and_one_cut_every_time_backs_off() {
        let s = Duration::from_secs;
        let timeout = s(100);
        assert_eq!(
            Happened::end(timeout - TIMEOUT_SLACK, timeout),
            Happened::Ended
        );
        assert_eq!(Happened::end(timeout, timeout), Happened::Ended);
        let short = timeout - TIMEOUT_SLACK - Duration::from_millis(1);
        assert_eq!(Happened::end(short, timeout), Happened::Cut);
        assert_eq!(Happened::end(s(2), timeout), Happened::Cut);

        let now = Instant::now();
        // A list, its watch accepted, then cut.
        let cut_after_list = |w: &mut Watch, at: &str| {
            w.step(Happened::Listed { rv: rv(at) }, now, MIN);
            w.step(Happened::Opened, now, MIN);
            w.step(Happened::Cut, now, MIN)
        };
        let mut w = watching(now);
        w.step(Happened::Delivered { rv: rv("30") }, now, MIN);
        // An established watch cut: listed again at once, and nothing failed.
        let step = w.step(Happened::Cut, now, MIN);
        assert_eq!((step.action, step.report), (Action::List, Report::Nothing));
        assert!(w.up(), "what it had is as current as the last event");
        assert_eq!(w.rv(), None, "nothing to resume from");
        // The list's watch cut before it is established: listed again at once the first
        // time, even straight after a list.
        let step = cut_after_list(&mut w, "31");
        assert_eq!((step.action, step.report), (Action::List, Report::Nothing));
        // Cut again: the list at once between does not start the count over (no wait came
        // between, or it would be a tight loop); a failure with a backoff, then a list.
        let step = cut_after_list(&mut w, "32");
        assert_eq!(step.report, Report::Down);
        assert!(wait_of(&step, now) >= ANSWERED_FIRST / 2, "{step:?}");
        assert_eq!(w.step(Happened::Waited, now, MIN).action, Action::List);
        // After that wait, the next cut is the first again.
        let step = cut_after_list(&mut w, "33");
        assert_eq!((step.action, step.report), (Action::List, Report::Nothing));
        // A list that fails after a cut waits: the list after that wait starts over too.
        w.step(Happened::Failed(Failure::Unreachable), now, MIN);
        w.step(Happened::Waited, now, MIN);
        let step = cut_after_list(&mut w, "34");
        assert_eq!((step.action, step.report), (Action::List, Report::Nothing));
        let step = cut_after_list(&mut w, "35");
        assert_eq!(step.report, Report::Down, "the second cut in a row");
    }

    #[test]
    fn a_list_between_two_early_ends_makes_them_no_loop() {
        let now = Instant::now();
        let mut w = watching(now);
        // A watch resumed after a clean end ends again before it is established.
        w.step(Happened::Ended, now, MIN);
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Ended, now, MIN);
        assert_eq!(step.action, Action::Watch { rv: rv("5") });
        // The server goes away; the list after it, and the watch from it, which the server
        // ends at once too: the first early end since the list, resumed at once.
        w.step(Happened::Failed(Failure::Unreachable), now, MIN);
        w.step(Happened::Waited, now, MIN);
        w.step(Happened::Listed { rv: rv("9") }, now, MIN);
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Ended, now, MIN);
        assert_eq!(step.action, Action::Watch { rv: rv("9") });
        assert_eq!(step.report, Report::Nothing);
        // The second one backs off.
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::Ended, now, MIN);
        assert_eq!(step.report, Report::Down);
    }

    #[test]
    fn a_store_that_went_back_is_told_only_when_its_list_is_behind_what_was_reached() {
        let now = Instant::now();
        let lost_then_listed = |reached: &str, listed: &str| {
            let (mut w, _) = Watch::start();
            w.step(Happened::Listed { rv: rv(reached) }, now, MIN);
            w.step(Happened::Opened, now, MIN);
            w.step(Happened::Failed(Failure::Unreachable), now, MIN);
            w.step(Happened::Waited, now, MIN);
            w.step(Happened::Listed { rv: rv(listed) }, now, MIN)
                .went_back
        };
        // Behind, numerically (not as text: "9" sorts after "12").
        let back = |from: &str, to: &str| {
            Some(WentBack {
                from: rv(from),
                to: rv(to),
            })
        };
        assert_eq!(lost_then_listed("12", "9"), back("12", "9"));
        assert_eq!(lost_then_listed("9", "12"), None);
        // The same store, or a restart (410), lists at or after where the watch was.
        assert_eq!(lost_then_listed("12", "12"), None);
        // An opaque resourceVersion is never compared.
        assert_eq!(lost_then_listed("abc", "5"), None);
        assert_eq!(lost_then_listed("12", "x"), None);
        // The first list has nothing to be behind.
        let (mut w, _) = Watch::start();
        let first = w.step(Happened::Listed { rv: rv("3") }, now, MIN);
        assert_eq!(first.went_back, None);
        // What an established watch delivered counts as reached.
        let mut w = watching(now);
        w.step(Happened::Delivered { rv: rv("40") }, now, MIN);
        w.step(Happened::Failed(Failure::Hung), now, MIN);
        w.step(Happened::Waited, now, MIN);
        let step = w.step(Happened::Listed { rv: rv("35") }, now, MIN);
        assert_eq!(step.went_back, back("40", "35"));
        // A list that is no answer to a list (cannot come) tells nothing.
        let mut w = watching(now);
        let step = w.step(Happened::Listed { rv: rv("1") }, now, MIN);
        assert_eq!(step.went_back, None);
        assert_eq!(w.rv(), Some("5"));
    }

    #[test]
    fn only_a_failure_without_an_answer_loses_the_connection() {
        assert!(Failure::Unreachable.loses_connection());
        assert!(Failure::Hung.loses_connection());
        assert!(!Failure::ANSWERED.loses_connection());
        let shed = Failure::Answered {
            retry_after: Some(Duration::from_secs(5)),
        };
        assert!(!shed.loses_connection());
        assert!(!Failure::Expired.loses_connection());
        // A hung server is backed off as one that answered, not as one that is away.
        let mut hung = Backoff::default();
        let mut answered = Backoff::default();
        for _ in 0..6 {
            assert_eq!(
                hung.after(Failure::Hung, MAX),
                answered.after(Failure::ANSWERED, MAX)
            );
        }
    }

    #[test]
    fn new_credentials_end_a_wait_and_resume_an_open_watch_with_them() {
        let now = Instant::now();
        let mut w = watching(now);
        let step = w.step(Happened::NewCredentials, now, MIN);
        assert_eq!(step.action, Action::Watch { rv: rv("5") });
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::NewCredentials, now, MIN);
        assert_eq!(step.action, Action::Watch { rv: rv("5") });
        let step = w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert!(matches!(step.action, Action::Wait { .. }));
        let step = w.step(Happened::NewCredentials, now, MIN);
        assert_eq!(step.action, Action::Watch { rv: rv("5") });
        // A failed list resumes as a list.
        let (mut w, _) = Watch::start();
        w.step(Happened::Failed(Failure::Unreachable), now, MIN);
        assert_eq!(
            w.step(Happened::NewCredentials, now, MIN).action,
            Action::List
        );
    }

    #[test]
    fn a_source_reported_down_outside_the_watch_is_up_again_once_it_delivers() {
        let now = Instant::now();
        let mut w = watching(now);
        assert!(w.up());
        // No usable credentials: the loop reports the source down and says so.
        w.lost();
        assert!(!w.up());
        w.step(Happened::NewCredentials, now, MIN);
        w.step(Happened::Opened, now, MIN);
        let step = w.step(Happened::StayedOpen, now, MIN);
        assert_eq!(step.report, Report::Up, "told up again");
    }

    #[test]
    fn the_resource_version_reached_is_known_in_every_state_that_has_one() {
        let now = Instant::now();
        let (mut w, _) = Watch::start();
        assert_eq!(w.rv(), None, "listing");
        w.step(Happened::Listed { rv: rv("5") }, now, MIN);
        assert_eq!(w.rv(), Some("5"), "opening");
        w.step(Happened::Opened, now, MIN);
        assert_eq!(w.rv(), Some("5"), "accepted");
        w.step(Happened::Delivered { rv: rv("6") }, now, MIN);
        assert_eq!(w.rv(), Some("6"), "watching");
        w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert_eq!(w.rv(), Some("6"), "backing off before a watch");
        w.step(Happened::Waited, now, MIN);
        w.step(Happened::Failed(Failure::Expired), now, MIN);
        assert_eq!(w.rv(), None, "listing after a 410");
        w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        assert_eq!(w.rv(), None, "backing off before a list");
        w.step(Happened::Waited, now, MIN);
        w.step(Happened::Listed { rv: rv("7") }, now, MIN);
        w.step(Happened::Failed(Failure::Unreachable), now, MIN);
        assert_eq!(
            w.rv(),
            None,
            "backing off before a list, the connection lost"
        );
    }

    #[test]
    fn what_a_state_does_not_expect_changes_nothing() {
        let now = Instant::now();
        let mut w = watching(now);
        let before = w.clone();
        let step = w.step(Happened::Waited, now, MIN);
        assert_eq!(step.action, Action::Read { confirm_at: None });
        assert_eq!(w, before);
        let (mut w, _) = Watch::start();
        assert_eq!(w.step(Happened::Opened, now, MIN).action, Action::List);
        w.step(Happened::Failed(Failure::ANSWERED), now, MIN);
        let waiting = w.clone();
        let step = w.step(Happened::Delivered { rv: rv("1") }, now, MIN);
        assert!(matches!(step.action, Action::Wait { .. }));
        assert_eq!(w, waiting);
    }
    #[test]
    fn jitter_draws_spread_evenly_over_zero_to_one() {
        let draws: Vec<f64> = (0..2000).map(|_| jitter()).collect();
        assert!(draws.iter().all(|d| (0.0..1.0).contains(d)), "{draws:?}");
        let low = draws.iter().filter(|d| **d < 0.5).count();
        assert!((800..1200).contains(&low), "{low} of 2000 under a half");
        let distinct: std::collections::BTreeSet<u64> = draws.iter().map(|d| d.to_bits()).collect();
        assert_eq!(distinct.len(), draws.len());
    }
}
