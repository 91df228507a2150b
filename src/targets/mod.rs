//! What the agent keeps on disk, one kind of target to a module, beneath the loops that
//! drive them (the daemon's reconciler, and `sync`'s one pass): the kubelet's bundle and
//! each `--manage` file ([`file`], applied and recorded by [`apply`]), and each registry
//! set ([`registry_set`]). Each reads its sources, decides what to do from what they say
//! and what is on disk ([`policy`], pure; the registry module's plan), carries it out, and
//! reports its status (health lines, metrics, managed-files entries). [`schedule`] holds
//! when each target's local sources are read again, retried and due for a pass.
//!
//! Every kind is a [`Kept`]: the one interface the loops drive. A new kind of target is a
//! new module here that implements it, and a line where the targets are listed
//! ([`crate::daemon::reconciler::Reconciler::new`], `sync`).

pub mod apply;
pub mod file;
pub mod kubeconfig;
pub mod policy;
pub mod registry_set;
pub mod schedule;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config;
use crate::exec::Hooks;
use crate::metrics::{Metrics, RecordLabels};
use crate::registry::CreatedRecord;
use crate::source::cluster::{Content, Event};
use crate::state::Book;
use crate::status::{SourceStatus, Status};
use apply::Target;
use file::Managed;
use registry_set::RegistrySet;
use schedule::Schedule;

/// Every target of `common`, in the order of their sources (a source's position among all
/// of them is how its news finds its target): the bundle, each `--manage` file, each
/// `--manage-kubeconfig`, each `--manage-registries` set. Records are written off the
/// loop, each failure counted; work a target does off the loop asks for its pass on
/// `wakes`.
pub(crate) fn all(
    common: &config::Common,
    metrics: &Arc<Metrics>,
    book: &Book,
    wakes: &tokio::sync::mpsc::UnboundedSender<usize>,
) -> Vec<Box<dyn Kept>> {
    let hooks = common.exec_on_change.clone().map(|command| {
        let failures = metrics.clone();
        Hooks::start(
            command.0,
            common.bundle.clone(),
            common.exec_on_change_timeout,
            move || {
                failures.exec_on_change_failures.inc();
            },
        )
    });
    let target = |path: &std::path::Path| {
        let failures = metrics.clone();
        Target::for_file(common, path, book.clone()).with_background_records(move |record| {
            failures
                .state_errors
                .get_or_create(&RecordLabels {
                    record: record.to_string(),
                })
                .inc();
        })
    };
    let mut first = 0;
    let mut next = |sources: &[crate::source::SourceSpec]| {
        let at = first;
        first += sources.len();
        at
    };
    let mut targets: Vec<Box<dyn Kept>> = vec![Box::new(Managed::new(
        true,
        target(&common.bundle),
        &common.sources,
        next(&common.sources),
        common.policy(),
        hooks,
        metrics.clone(),
    ))];
    for manage in &common.manage {
        targets.push(Box::new(Managed::new(
            false,
            target(&manage.path),
            &manage.sources,
            next(&manage.sources),
            common.policy(),
            None,
            metrics.clone(),
        )));
    }
    for kubeconfig in &common.manage_kubeconfig {
        let hooks = common.kubeconfig_hook.clone().map(|command| {
            let failures = metrics.clone();
            Hooks::start_for_kubeconfig(
                command.0,
                kubeconfig.path.clone(),
                common.exec_on_change_timeout,
                move || {
                    failures.kubeconfig_hook_failures.inc();
                },
            )
        });
        let wake = Wake::new(targets.len(), wakes.clone());
        targets.push(Box::new(kubeconfig::Kubeconfig::new(
            kubeconfig,
            next(&kubeconfig.sources),
            common,
            hooks,
            wake,
            metrics.clone(),
            book.clone(),
        )));
    }
    for set in &common.manage_registries {
        targets.push(Box::new(RegistrySet::new(
            &set.dir,
            &set.sources,
            next(&set.sources),
            metrics.clone(),
            book.clone(),
            &common.state_dir,
        )));
    }
    targets
}

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
