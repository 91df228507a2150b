//! What a loop publishes after every pass: read by `/readyz`, the metrics collector and the
//! systemd STATUS line. One writer (the node daemon's reconciler, or the cluster-side
//! publisher), many readers; the readers depend on this module alone, never on the loop.

use std::sync::Arc;

use crate::bundle::Certificate;
use crate::kubelet_config::KubeletUse;

/// What the loop keeps correct: the bundle file (`run`), or a key of a ConfigMap
/// (`publish`). Below, "the file" is whichever it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TargetKind {
    #[default]
    File,
    ConfigMap,
}

#[derive(Debug, Clone, Default)]
pub struct Status {
    pub kind: TargetKind,
    /// The file's path, or `configmap:NAMESPACE/NAME/KEY`: the `filepath` label.
    pub bundle_path: String,
    /// The certificates of the file, when it is a valid bundle.
    pub certificates: Vec<Certificate>,
    /// SHA-256 of the file, when it exists.
    pub sha256: Option<String>,
    /// The file parses as a bundle with a certificate valid now.
    pub file_valid: bool,
    /// Why the file is not valid, when it is not.
    pub file_problem: Option<String>,
    /// What the operator should know of a valid file: the expired certificates it holds
    /// (subject and fingerprint), which the kubelet ignores while a valid one remains.
    pub file_warning: Option<String>,
    /// `Some(true)` when the file equals the bundle built from the sources; `None` before
    /// every source has delivered content once (the adopted file stands meanwhile), or
    /// while a ConfigMap target cannot be seen.
    pub in_sync: Option<bool>,
    /// Why the file is not in sync, when it is not; or why that is not known, when it is
    /// not (`in_sync` is `None`).
    pub sync_problem: Option<String>,
    pub sources: Vec<SourceStatus>,
    /// Unix seconds of the last pass that ended in sync with every source read.
    pub last_sync: Option<f64>,
    /// `None` when inotify watches every directory the agent cares about; otherwise what
    /// is not watched and why. Changes there are still seen by the once-a-minute
    /// re-verification, so this does not fail readiness.
    pub file_watch: Option<String>,
    /// Whether the kubelet's config names the file as its client CA (the node agent's
    /// file only: `None` for a ConfigMap target). The kubelet's choice is not the agent's
    /// to make, so this does not fail readiness.
    pub kubelet: Option<KubeletUse>,
    /// The other files the node agent keeps (`--manage`), each as a status of its own
    /// (without `file_watch` and `kubelet`, which are the loop's, said above).
    pub others: Vec<Status>,
    /// A `--manage` file whose sources were all read and hold no certificate (a cloud CA
    /// on a platform without one): it is neither created nor emptied, and nothing is
    /// wrong.
    pub nothing_to_keep: bool,
    /// For a managed kubeconfig (`None` for any other file): whether CAs its sources
    /// dropped are kept until a check of its server allows their removal.
    pub removal_held: Option<bool>,
    /// For a managed kubeconfig: the SHA-256 fingerprints (hex) of the CAs its sources
    /// dropped that are kept until a check of its server allows their removal.
    pub held_back: Vec<String>,
    /// For a managed kubeconfig with a restart hook: the kubelet's restart after the last
    /// CA it gained (`None` when none was needed since the agent started).
    pub restart: Option<Restart>,
    /// Why that restart is pending, when the host has not taken the request.
    pub restart_note: Option<String>,
    /// For a registry CA file: the directory of its `--manage-registries` set.
    pub registry_set: Option<String>,
    /// Checks of the loop that concern no one file, and never fail readiness: each
    /// registry set's refused entries (`registries:DIR`), as (name, problem).
    pub notes: Vec<(String, Option<String>)>,
    /// Sources of the loop's that no file's status carries: a registry set's, which must
    /// show whether or not the set has a registry file yet.
    pub other_sources: Vec<SourceStatus>,
}

/// The kubelet's restart after a managed kubeconfig gained a CA (the kubelet reads its
/// kubeconfig only when it starts): the state of the hook that does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Restart {
    /// The hook ran and succeeded after the last addition.
    Done,
    /// The last run failed; it is retried with backoff.
    Failed,
    /// A run is queued or under way.
    Pending,
}

/// One line of `/readyz?verbose`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    /// `None` when it is ok, else why not.
    pub problem: Option<String>,
    /// Whether it counts for readiness.
    pub counted: bool,
    /// The problem is that the agent cannot tell (`problem` says why): said as unknown,
    /// neither ok nor failed, and never counted.
    pub unknown: bool,
    /// Not done yet, and not failed (`problem` says what it waits for): said as pending,
    /// never counted.
    pub pending: bool,
    /// It passes, with something the operator should see (an expired certificate the
    /// sources still carry beside valid ones).
    pub warning: Option<String>,
    /// What it found, said after "ok" when it passes (what the confinement holds).
    pub detail: Option<String>,
}

impl Check {
    /// A check that counts for readiness.
    pub fn counted(name: String, problem: Option<String>) -> Check {
        Check {
            name,
            problem,
            counted: true,
            unknown: false,
            pending: false,
            warning: None,
            detail: None,
        }
    }

    /// A check shown for the operator that never fails readiness.
    pub fn shown(name: String, problem: Option<String>) -> Check {
        Check {
            name,
            problem,
            counted: false,
            unknown: false,
            pending: false,
            warning: None,
            detail: None,
        }
    }

    /// A check whose state the agent cannot tell, and why: shown, never counted.
    pub fn unknown(name: String, why: String) -> Check {
        Check {
            name,
            problem: Some(why),
            counted: false,
            unknown: true,
            pending: false,
            warning: None,
            detail: None,
        }
    }

    /// A check that waits for something, and what: shown as pending, never counted.
    pub fn pending(name: String, why: String) -> Check {
        Check {
            pending: true,
            ..Check::unknown(name, why)
        }
    }

    /// The same check, saying `detail` after "ok" when it passes.
    pub fn detailed(mut self, detail: String) -> Check {
        self.detail = Some(detail);
        self
    }

    /// The same check, passing with `warning` when there is one.
    pub fn warned(mut self, warning: Option<String>) -> Check {
        self.warning = warning;
        self
    }
}

#[derive(Debug, Clone, Default)]
pub struct SourceStatus {
    pub spec: String,
    /// The last read or watch event succeeded and its content was valid.
    pub up: bool,
    /// Its last update was refused for what it held (a key, a torn certificate, nothing
    /// usable), rather than for not being read.
    pub rejected: bool,
    pub problem: Option<String>,
    /// Unix seconds when the source's content last changed.
    pub last_change: Option<f64>,
}

impl Status {
    /// Ready: the file on disk is valid and not known to be out of sync. Readiness (and
    /// systemd's `READY=1`) follows this file alone (SPEC 6): an unreachable source does not
    /// make the agent unready while the file is valid, and another managed file (a `--manage`
    /// file, a registry CA) never does: one bad registry entry must not hold every node's
    /// agent unready and stall a rollout. Their checks show, marked as not counted.
    pub fn ready(&self) -> bool {
        self.bundle_ready()
    }

    /// Every source the loop reads, each once (a source that feeds several files is one):
    /// the files' in order, then the others'.
    pub fn all_sources(&self) -> Vec<&SourceStatus> {
        let mut seen = std::collections::HashSet::new();
        self.files()
            .flat_map(|f| f.sources.iter())
            .chain(self.other_sources.iter())
            .filter(|s| seen.insert(s.spec.as_str()))
            .collect()
    }

    /// This file's status, then each other managed file's.
    pub fn files(&self) -> impl Iterator<Item = &Status> {
        std::iter::once(self).chain(self.others.iter())
    }

    /// Ready as far as this file alone goes.
    fn bundle_ready(&self) -> bool {
        self.nothing_to_keep || (self.file_valid && self.in_sync != Some(false))
    }

    /// The checks of the file itself: valid (or, for a `--manage` file, nothing to keep),
    /// and in sync; `name` makes each check's name. They count when `counted`, but a sync
    /// that is not known yet is said as unknown, never as failed (it does not fail
    /// readiness: the adopted file stands). A valid file that holds an expired certificate
    /// passes with a warning naming it.
    fn file_checks(&self, counted: bool, name: impl Fn(&str) -> String) -> [Check; 2] {
        let make = |check: &str, problem| {
            if counted {
                Check::counted(name(check), problem)
            } else {
                Check::shown(name(check), problem)
            }
        };
        let valid = make(
            "bundle-valid",
            (!self.file_valid && !self.nothing_to_keep).then(|| {
                self.file_problem
                    .clone()
                    .unwrap_or_else(|| "the file is not a valid bundle".into())
            }),
        )
        .warned(self.file_warning.clone());
        let in_sync = match self.in_sync {
            Some(true) => make("in-sync", None),
            Some(false) => make(
                "in-sync",
                Some(
                    self.sync_problem
                        .clone()
                        .unwrap_or_else(|| "the file differs from the sources".into()),
                ),
            ),
            // Not claimed for a state that cannot be seen: an unknown is said as such.
            None => Check::unknown(
                name("in-sync"),
                self.sync_problem
                    .clone()
                    .unwrap_or_else(|| "not known yet".into()),
            ),
        };
        [valid, in_sync]
    }

    /// A managed kubeconfig's `kubelet-restart:PATH`, once a restart was needed: never
    /// counted, pending (with why, when the host has not taken it) until it is done.
    fn restart_check(&self) -> Option<Check> {
        let name = format!("kubelet-restart:{}", self.bundle_path);
        Some(match self.restart? {
            Restart::Done => Check::shown(name, None),
            Restart::Failed => Check::shown(
                name,
                Some("the last restart failed; it is asked again with backoff".into()),
            ),
            Restart::Pending => Check::pending(
                name,
                self.restart_note
                    .clone()
                    .unwrap_or_else(|| "pending: under way".into())
                    .trim_start_matches("pending: ")
                    .to_string(),
            ),
        })
    }

    /// The readiness checks, in order. Only the file's own validity and sync count for
    /// readiness; every other check is shown for the operator and the alerts.
    pub fn checks(&self) -> Vec<Check> {
        let mut checks: Vec<Check> = self.file_checks(true, str::to_string).into();
        if self.kind == TargetKind::File {
            checks.push(Check::shown(
                "file-watch".to_string(),
                self.file_watch.clone(),
            ));
        }
        if let Some(kubelet) = &self.kubelet {
            let name = "kubelet-uses-bundle".to_string();
            checks.push(match (kubelet.uses(), kubelet.problem(&self.bundle_path)) {
                // Not known is said as such: neither failed nor ok (issue 34).
                (None, Some(why)) => Check::unknown(name, why),
                (_, problem) => Check::shown(name, problem),
            });
        }
        // Each other file's checks, named by its path; its sources among the others, once
        // each.
        for other in &self.others {
            checks.extend(other.file_checks(false, |name| format!("{name}:{}", other.bundle_path)));
            checks.extend(other.restart_check());
        }
        checks.extend(
            self.notes
                .iter()
                .map(|(name, problem)| Check::shown(name.clone(), problem.clone())),
        );
        for source in self.all_sources() {
            checks.push(Check::shown(
                format!("source:{}", source.spec),
                (!source.up).then(|| {
                    source
                        .problem
                        .clone()
                        .unwrap_or_else(|| "no content yet".into())
                }),
            ));
        }
        checks
    }

    /// One line for systemd's STATUS=.
    pub fn summary(&self) -> String {
        let up = self.sources.iter().filter(|s| s.up).count();
        let sources = format!("{up}/{} sources up", self.sources.len());
        let sha = self.sha256.as_deref().map(|s| &s[..12]).unwrap_or("-");
        match (self.file_valid, self.in_sync) {
            (true, Some(true)) => format!(
                "in sync: {} certificates (sha256 {sha}…), {sources}",
                self.certificates.len()
            ),
            (true, None) => format!(
                "keeping the existing bundle ({} certificates) until every source has been read; {sources}",
                self.certificates.len()
            ),
            (_, Some(false)) => format!(
                "out of sync: {}; {sources}",
                self.sync_problem.as_deref().unwrap_or("pending write")
            ),
            (false, _) => format!(
                "no valid bundle on disk: {}; {sources}",
                self.file_problem.as_deref().unwrap_or("missing")
            ),
        }
    }
}

pub type StatusRx = tokio::sync::watch::Receiver<Arc<Status>>;

/// Now, in unix seconds: the unit of the timestamps in a [`Status`].
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<'a>(checks: &'a [Check], name: &str) -> &'a Option<String> {
        &checks.iter().find(|c| c.name == name).expect(name).problem
    }

    #[test]
    fn in_sync_is_claimed_only_when_known() {
        let mut status = Status {
            file_valid: true,
            in_sync: Some(true),
            ..Status::default()
        };
        assert_eq!(check(&status.checks(), "in-sync"), &None);
        status.in_sync = None;
        assert_eq!(
            check(&status.checks(), "in-sync").as_deref(),
            Some("not known yet")
        );
        status.sync_problem = Some("not known yet: no source has been read".into());
        assert_eq!(
            check(&status.checks(), "in-sync").as_deref(),
            Some("not known yet: no source has been read")
        );
        // The adopted bundle keeps the agent ready meanwhile (SPEC 6).
        assert!(status.ready());
    }

    #[test]
    fn the_kubelet_check_is_listed_for_the_node_file_and_never_fails_readiness() {
        let mut status = Status {
            bundle_path: "/etc/kubernetes/kubelet-ca.crt".into(),
            file_valid: true,
            in_sync: Some(true),
            ..Status::default()
        };
        assert!(
            status
                .checks()
                .iter()
                .all(|c| c.name != "kubelet-uses-bundle")
        );
        status.kubelet = Some(KubeletUse::Other {
            config: "/var/lib/kubelet/config.yaml".into(),
            client_ca_file: "/etc/kubernetes/pki/ca.crt".into(),
        });
        let problem = check(&status.checks(), "kubelet-uses-bundle")
            .clone()
            .unwrap();
        assert!(problem.contains("/etc/kubernetes/pki/ca.crt"), "{problem}");
        assert!(status.ready());
        status.kubelet = Some(KubeletUse::Uses {
            config: "/var/lib/kubelet/config.yaml".into(),
        });
        assert_eq!(check(&status.checks(), "kubelet-uses-bundle"), &None);
    }

    #[test]
    fn readiness_follows_the_bundle_alone_and_every_other_check_is_shown_not_counted() {
        let ok = Status {
            bundle_path: "/etc/kubernetes/kubelet-ca.crt".into(),
            file_valid: true,
            in_sync: Some(true),
            ..Status::default()
        };
        let registry = Status {
            bundle_path: "/etc/docker/certs.d/quay.io/ca.crt".into(),
            file_valid: false,
            file_problem: Some("a private key in its data".into()),
            in_sync: Some(false),
            ..Status::default()
        };
        let mut status = Status {
            others: vec![registry],
            notes: vec![(
                "registries:/etc/docker/certs.d".into(),
                Some("2 entries refused".into()),
            )],
            sources: vec![SourceStatus {
                spec: "configmap:a/b".into(),
                up: false,
                rejected: false,
                problem: Some("connection refused".into()),
                last_change: None,
            }],
            ..ok.clone()
        };
        assert!(
            status.ready(),
            "another file or a source held readiness back"
        );
        let checks = status.checks();
        let counted: Vec<&str> = checks
            .iter()
            .filter(|c| c.counted)
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(counted, ["bundle-valid", "in-sync"]);
        let failing: Vec<&str> = checks
            .iter()
            .filter(|c| c.problem.is_some())
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            failing,
            [
                "bundle-valid:/etc/docker/certs.d/quay.io/ca.crt",
                "in-sync:/etc/docker/certs.d/quay.io/ca.crt",
                "registries:/etc/docker/certs.d",
                "source:configmap:a/b"
            ]
        );
        // The bundle's own state still counts.
        status.in_sync = Some(false);
        assert!(!status.ready());
        status.in_sync = Some(true);
        status.file_valid = false;
        assert!(!status.ready());
    }
}
