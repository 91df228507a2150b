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
pub mod kept;
pub mod kubeconfig;
pub mod policy;
pub mod registry_set;
pub mod schedule;

pub(crate) use kept::Kept;
pub use kept::{Report, Wake};

use std::sync::Arc;

use crate::config;
use crate::exec::Hooks;
use crate::metrics::{Metrics, RecordLabels};
use crate::state::Book;
use apply::Target;
use file::Managed;
use registry_set::RegistrySet;

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
        let wake = Wake::new(targets.len(), wakes.clone());
        let hooks = common.kubeconfig_hook.clone().map(|hook| {
            let failures = metrics.clone();
            // The restart's outcome is in the target's status: a pass publishes it.
            let ran = wake.clone();
            Hooks::start_for_kubeconfig(
                hook,
                kubeconfig.path.clone(),
                common.exec_on_change_timeout,
                move || {
                    failures.kubeconfig_hook_failures.inc();
                },
                move || ran.wake(),
            )
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::SourceSpec;

    #[test]
    fn each_targets_sources_are_found_at_their_place_among_all_of_them() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        let file =
            |name: &str| -> SourceSpec { format!("file:{}", at(name).display()).parse().unwrap() };
        let mut common = config::Common::for_tests(
            &at("kubelet-ca.crt"),
            &at("state"),
            vec![file("a.pem"), file("b.pem")],
        );
        common.manage = vec![config::ManageSpec {
            path: at("cloud-ca.crt"),
            sources: vec![file("cloud.pem")],
        }];
        common.manage_kubeconfig = vec![config::ManageSpec {
            path: at("kubeconfig"),
            sources: vec![file("apiserver-a.pem"), file("apiserver-b.pem")],
        }];
        common.manage_registries = vec![config::RegistriesSpec {
            dir: at("certs.d"),
            sources: vec![file("registries.json")],
        }];
        let (wakes, _woken) = tokio::sync::mpsc::unbounded_channel();
        let book = Book::open(&at("state"), &[]);
        let targets = all(&common, &Arc::default(), &book, &wakes);
        // The loop's sources in order: the bundle's two, the cloud CA's, the kubeconfig's
        // two, the registry set's. Each is its own target's, at its place there.
        let owner = |index: usize| {
            targets
                .iter()
                .enumerate()
                .find_map(|(t, target)| target.schedule().source(index).map(|local| (t, local)))
        };
        let owners: Vec<_> = (0..7).map(owner).collect();
        assert_eq!(
            owners,
            [
                Some((0, 0)),
                Some((0, 1)),
                Some((1, 0)),
                Some((2, 0)),
                Some((2, 1)),
                Some((3, 0)),
                None
            ]
        );
    }
}
