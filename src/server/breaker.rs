//! The reviews' breaker: once a review finds the API server unreachable or silent, new
//! questions are turned away at once for a short while instead of each waiting out a
//! deadline, and then one review at a time, the probe, finds out whether the server is back.
//!
//! The policy is pure, as rustls keeps protocol logic apart from I/O: [`Circuit::decide`]
//! (what to do with a new question) and [`Circuit::heard`] (what a review's outcome
//! changes) take `now` and touch nothing, so every rule is a unit test without a socket or a
//! clock. [`Breaker`] keeps the circuit behind a lock, reads the clock, and hands out
//! [`Ticket`]s that report each review's outcome (or, dropped unreported, that it told
//! nothing).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// A review not answered within this has failed (the kube client sets no read timeout of
/// its own, and a scraper gives up after about 10 s anyway). Here, beneath the reviews,
/// because what the breaker waits for a probe follows from it.
pub const REVIEW_DEADLINE: Duration = Duration::from_secs(10);

/// How long new questions are turned away after a review found the API server unreachable
/// or silent, before one is let through as a probe: short, so that a server that is back
/// is used again within seconds; long enough that a server that is not there sees one
/// connection attempt every couple of seconds, however many clients knock.
pub const PAUSE: Duration = Duration::from_secs(2);
/// A probe that has told nothing for this long is taken for lost, and another question is
/// let through as the next probe. A probe's review gives up after [`REVIEW_DEADLINE`], so
/// this only happens if its task died.
pub const PROBE_LOST_AFTER: Duration = REVIEW_DEADLINE.saturating_add(PAUSE);
/// When a client turned away while a probe is under way is told to try again.
pub const WHILE_PROBING: Duration = Duration::from_secs(1);

/// What the breaker knows of the API server, for reviews.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Circuit {
    /// Waits for a review to find the API server unreachable or silent; meanwhile every
    /// question is asked.
    Closed,
    /// Waits for `until`: a review found the API server unreachable or silent, and every new
    /// question is turned away until then.
    Open { until: Instant },
    /// Waits for the probe numbered `probe`, let through at `since`, to tell whether the API
    /// server answers; every other new question is turned away meanwhile.
    Probing { probe: u64, since: Instant },
}

/// What to do with a new question.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Ask it.
    Ask,
    /// Ask it, as the probe with this number.
    Probe(u64),
    /// Do not: the API server is taken for unreachable. The client may try again after this.
    TurnAway(Duration),
}

/// Which review an outcome is of: an ordinary one, or a probe (by its number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Ordinary,
    Probe(u64),
}

/// What a review found out about the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// It answered: a verdict, or an error status (it is there, if unhappy).
    Answered,
    /// It could not be reached (refused, reset, no route, TLS failed) or did not answer in
    /// time.
    Unanswered,
    /// Nothing: the review was not made (no credentials, shed) or its task was lost.
    Nothing,
}

impl Circuit {
    /// What to do with a new question at `now`, and the circuit after it; `next_probe` is
    /// the number a probe let through now takes.
    pub fn decide(self, now: Instant, next_probe: u64) -> (Circuit, Decision) {
        let probe = || {
            let probing = Circuit::Probing {
                probe: next_probe,
                since: now,
            };
            (probing, Decision::Probe(next_probe))
        };
        match self {
            Circuit::Closed => (self, Decision::Ask),
            Circuit::Open { until } if now < until => (self, Decision::TurnAway(until - now)),
            Circuit::Open { .. } => probe(),
            Circuit::Probing { since, .. } if now < since + PROBE_LOST_AFTER => {
                (self, Decision::TurnAway(WHILE_PROBING))
            }
            Circuit::Probing { .. } => probe(),
        }
    }

    /// The circuit after a review of `role` heard `heard` at `now`. Any answer closes it
    /// (the server is there); no answer opens it for [`PAUSE`], except that while a probe is
    /// under way only the probe decides (a review that began before the circuit opened may
    /// end late); a probe that told nothing lets the next question probe at once.
    pub fn heard(self, role: Role, heard: Heard, now: Instant) -> Circuit {
        let the_probe =
            matches!(self, Circuit::Probing { probe, .. } if role == Role::Probe(probe));
        match heard {
            Heard::Answered => Circuit::Closed,
            Heard::Unanswered if matches!(self, Circuit::Probing { .. }) && !the_probe => self,
            Heard::Unanswered => {
                let until = match self {
                    Circuit::Open { until } => until.max(now + PAUSE),
                    _ => now + PAUSE,
                };
                Circuit::Open { until }
            }
            Heard::Nothing if the_probe => Circuit::Open { until: now },
            Heard::Nothing => self,
        }
    }
}

/// The circuit shared by every review of the endpoint (one API server), and the number of
/// the next probe.
#[derive(Debug)]
pub struct Breaker {
    state: Mutex<(Circuit, u64)>,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: Mutex::new((Circuit::Closed, 0)),
        }
    }
}

impl Breaker {
    /// A ticket to ask a new question, or how long until the client should try again.
    pub fn admit(self: &Arc<Self>) -> Result<Ticket, Duration> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (circuit, next) = *state;
        let (circuit, decision) = circuit.decide(Instant::now(), next);
        let role = match decision {
            Decision::Ask => Role::Ordinary,
            Decision::Probe(probe) => {
                tracing::debug!("letting one review through to see whether the API server is back");
                Role::Probe(probe)
            }
            Decision::TurnAway(retry) => return Err(retry),
        };
        *state = (
            circuit,
            next.wrapping_add(u64::from(role != Role::Ordinary)),
        );
        Ok(Ticket {
            breaker: self.clone(),
            role,
            told: false,
        })
    }

    fn hear(&self, role: Role, heard: Heard) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let before = state.0;
        state.0 = before.heard(role, heard, Instant::now());
        match (before, state.0) {
            (Circuit::Closed, Circuit::Open { .. }) => tracing::debug!(
                "the API server could not be reached: new reviews are turned away for {PAUSE:?}, then one probes"
            ),
            (Circuit::Open { .. } | Circuit::Probing { .. }, Circuit::Closed) => {
                tracing::debug!("the API server answers reviews again")
            }
            _ => {}
        }
    }

    #[cfg(test)]
    pub fn circuit(&self) -> Circuit {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0
    }
}

/// Leave to ask one question; tells the breaker what the review heard ([`Ticket::tell`]),
/// or, dropped untold (shed after all, or its task lost), that it heard nothing.
#[derive(Debug)]
pub struct Ticket {
    breaker: Arc<Breaker>,
    role: Role,
    told: bool,
}

impl Ticket {
    pub fn tell(mut self, heard: Heard) {
        self.breaker.hear(self.role, heard);
        self.told = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.told {
            self.breaker.hear(self.role, Heard::Nothing);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A start for the clock: the rules only compare instants.
    fn t0() -> Instant {
        Instant::now()
    }

    #[test]
    fn closed_asks_every_question_and_an_answer_keeps_it_closed() {
        let now = t0();
        assert_eq!(
            Circuit::Closed.decide(now, 0),
            (Circuit::Closed, Decision::Ask)
        );
        for role in [Role::Ordinary, Role::Probe(3)] {
            assert_eq!(
                Circuit::Closed.heard(role, Heard::Answered, now),
                Circuit::Closed
            );
            assert_eq!(
                Circuit::Closed.heard(role, Heard::Nothing, now),
                Circuit::Closed,
                "a review that was not made says nothing of the server"
            );
        }
    }

    #[test]
    fn no_answer_opens_it_and_questions_are_turned_away_until_the_pause_is_over() {
        let now = t0();
        let open = Circuit::Closed.heard(Role::Ordinary, Heard::Unanswered, now);
        assert_eq!(open, Circuit::Open { until: now + PAUSE });
        assert_eq!(
            open.decide(now, 0),
            (open, Decision::TurnAway(PAUSE)),
            "turned away, told when to try again"
        );
        let later = now + PAUSE - 300 * MS;
        assert_eq!(open.decide(later, 0), (open, Decision::TurnAway(300 * MS)));
        // Another review that began before it opened and fails now: the pause runs from
        // the latest failure, never shortened.
        let again = open.heard(Role::Ordinary, Heard::Unanswered, now + 500 * MS);
        assert_eq!(
            again,
            Circuit::Open {
                until: now + 500 * MS + PAUSE
            }
        );
        let early = Circuit::Open {
            until: now + 10 * PAUSE,
        };
        assert_eq!(
            early.heard(Role::Ordinary, Heard::Unanswered, now),
            early,
            "not shortened"
        );
    }

    #[test]
    fn after_the_pause_one_question_probes_and_the_others_are_turned_away() {
        let now = t0();
        let open = Circuit::Open { until: now };
        let (probing, decision) = open.decide(now, 7);
        assert_eq!(decision, Decision::Probe(7));
        assert_eq!(
            probing,
            Circuit::Probing {
                probe: 7,
                since: now
            }
        );
        // At most one probe in flight: every question until it tells is turned away.
        for after in [MS, PAUSE, REVIEW_DEADLINE] {
            assert_eq!(
                probing.decide(now + after, 8),
                (probing, Decision::TurnAway(WHILE_PROBING))
            );
        }
    }

    #[test]
    fn the_probe_decides_an_answer_closes_no_answer_opens_again() {
        let now = t0();
        let probing = Circuit::Probing {
            probe: 7,
            since: now,
        };
        let later = now + 3 * MS;
        assert_eq!(
            probing.heard(Role::Probe(7), Heard::Answered, later),
            Circuit::Closed,
            "the server is back: every question is asked again"
        );
        assert_eq!(
            probing.heard(Role::Probe(7), Heard::Unanswered, later),
            Circuit::Open {
                until: later + PAUSE
            }
        );
        // A review that began before the circuit opened, failing late, does not reopen it
        // while the probe is out (which would let a second probe through).
        assert_eq!(
            probing.heard(Role::Ordinary, Heard::Unanswered, later),
            probing
        );
        assert_eq!(
            probing.heard(Role::Probe(6), Heard::Unanswered, later),
            probing,
            "a probe given up for lost does not decide"
        );
        // But any answer shows the server is there.
        assert_eq!(
            probing.heard(Role::Ordinary, Heard::Answered, later),
            Circuit::Closed
        );
    }

    #[test]
    fn a_probe_that_tells_nothing_lets_the_next_question_probe() {
        let now = t0();
        let probing = Circuit::Probing {
            probe: 7,
            since: now,
        };
        // Shed for want of a place, or its task lost: the next question probes at once.
        let open = probing.heard(Role::Probe(7), Heard::Nothing, now + MS);
        assert_eq!(open, Circuit::Open { until: now + MS });
        assert_eq!(open.decide(now + MS, 8).1, Decision::Probe(8));
        // Another review's nothing changes nothing.
        assert_eq!(probing.heard(Role::Ordinary, Heard::Nothing, now), probing);
        // A probe that never tells is taken for lost once its deadline is long past.
        let (next, decision) = probing.decide(now + PROBE_LOST_AFTER, 8);
        assert_eq!(decision, Decision::Probe(8));
        assert_eq!(
            next,
            Circuit::Probing {
                probe: 8,
                since: now + PROBE_LOST_AFTER
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_breaker_hands_out_one_probe_and_recovers_within_a_pause() {
        let breaker = Arc::new(Breaker::default());
        // Two reviews under way when the server goes away.
        let (a, b) = (breaker.admit().unwrap(), breaker.admit().unwrap());
        a.tell(Heard::Unanswered);
        assert_eq!(breaker.admit().unwrap_err(), PAUSE);
        tokio::time::sleep(PAUSE / 2).await;
        b.tell(Heard::Unanswered);
        assert_eq!(
            breaker.admit().unwrap_err(),
            PAUSE,
            "from the latest failure"
        );
        tokio::time::sleep(PAUSE).await;
        let probe = breaker.admit().expect("a probe after the pause");
        assert_eq!(
            breaker.admit().unwrap_err(),
            WHILE_PROBING,
            "one probe at a time"
        );
        // A probe shed after all (dropped untold): the next question probes.
        drop(probe);
        let probe = breaker.admit().expect("another probe");
        assert!(breaker.admit().is_err());
        probe.tell(Heard::Answered);
        assert_eq!(breaker.circuit(), Circuit::Closed);
        let (c, d) = (breaker.admit().unwrap(), breaker.admit().unwrap());
        drop((c, d));
        assert_eq!(breaker.circuit(), Circuit::Closed);
    }
}
