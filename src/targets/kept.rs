//! The one interface every kind of target implements ([`Kept`]), what targets report
//! ([`Report`]), and how work a target does off the loop asks for its pass ([`Wake`]).
//! Beneath every target module and the loops that drive them; it imports none of them.

use std::time::{Duration, Instant};

use super::schedule::Schedule;
use crate::registry::CreatedRecord;
use crate::source::cluster::{Content, Event};
use crate::status::{SourceStatus, Status};

/// How a target's work off the loop (a check over the network) asks for a pass of that
/// target when it is done.
#[derive(Clone, Debug)]
pub struct Wake {
    index: usize,
    to: Option<tokio::sync::mpsc::UnboundedSender<usize>>,
}

impl Wake {
    /// Asks the loop for a pass of target `index` through `to`.
    pub fn new(index: usize, to: tokio::sync::mpsc::UnboundedSender<usize>) -> Wake {
        Wake {
            index,
            to: Some(to),
        }
    }

    /// A wake that reaches no loop (`sync`, which waits for the work itself).
    pub fn none() -> Wake {
        Wake { index: 0, to: None }
    }

    pub fn wake(&self) {
        if let Some(to) = &self.to {
            let _ = to.send(self.index);
        }
    }
}

/// One thing the agent keeps on disk. The loop routes each source's news to the target
/// that reads it, asks each target what is due, and runs a pass of the targets that call
/// for one; what the pass does is the target's own affair (its plan is pure, beside it).
pub(crate) trait Kept: Send {
    /// When its sources are read and when it calls for a pass; it also says which of the
    /// loop's sources are its own ([`Schedule::source`]).
    fn schedule(&self) -> &Schedule;
    fn schedule_mut(&mut self) -> &mut Schedule;

    /// Adopts what is on disk, reads its local sources and runs its first pass. No API
    /// call happens here.
    fn start(&mut self, created: &mut CreatedRecord);

    /// A source's news, by its position among this target's sources.
    fn on_update(&mut self, local: usize, event: Event<Content>, at: Instant);

    /// Reads the local sources that are due at `now`; true when a pass is called for.
    fn take_due(&mut self, now: Instant) -> bool;

    /// One pass: brings what is on disk in line with the sources, recording in `created`
    /// what it creates beyond its named path and removing only what is recorded there.
    fn reconcile(&mut self, created: &mut CreatedRecord);

    /// Time until the validity of what it keeps can next change.
    fn next_boundary(&self) -> Duration;

    /// Its status, as of the last pass.
    fn report(&self, report: &mut Report);

    /// Bytes of what the last pass built, for giving memory back after a large one.
    fn built_len(&self) -> usize {
        0
    }

    #[cfg(test)]
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// What the targets report after a pass, gathered into one [`Status`]: each file's status
/// (the bundle first), the checks that concern no one file, and the sources no file's
/// status carries.
#[derive(Default)]
pub struct Report {
    pub files: Vec<Status>,
    pub notes: Vec<(String, Option<String>)>,
    pub sources: Vec<SourceStatus>,
}

impl Report {
    /// One status of it all: the first file's (the bundle's, which readiness follows),
    /// with every other file's, note and source beside it.
    pub fn into_status(self) -> Status {
        let mut files = self.files.into_iter();
        let first = files.next().unwrap_or_default();
        Status {
            others: files.collect(),
            notes: self.notes,
            other_sources: self.sources,
            ..first
        }
    }
}
