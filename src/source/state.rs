//! What a loop knows about one source, and how it takes in the source's events: the same
//! for the node daemon and the publisher, so that both count, log and report a source
//! alike.

use crate::bundle::{Fingerprint, SourceCertificates};
use crate::metrics::{Metrics, SourceLabels, SourceReasonLabels, known};
use crate::status::{SourceStatus, unix_now};

use super::cluster::SourceEvent;
use super::{Keys, SourceError, SourceSpec};

impl SourceSpec {
    /// Shows the series of this source at 0 ([`Metrics::init_source`]): its errors for every
    /// reason its kind can have, the certificates it can have left out, and (a cluster
    /// source) its watch restarts.
    pub fn init_metrics(&self, metrics: &Metrics) {
        let reasons: &[&[&str]] = match self {
            SourceSpec::File(_) => &[known::FILE_SOURCE_ERRORS],
            SourceSpec::Dir(_) => &[known::DIR_SOURCE_ERRORS],
            SourceSpec::ConfigMap {
                keys: Keys::One(_), ..
            } => &[
                known::CLUSTER_SOURCE_ERRORS,
                known::CONFIGMAP_KEY_ERRORS,
                known::CONFIGMAP_VALUE_ERRORS,
            ],
            SourceSpec::ConfigMap { .. } => {
                &[known::CLUSTER_SOURCE_ERRORS, known::CONFIGMAP_VALUE_ERRORS]
            }
            SourceSpec::ControllerConfig { .. } => {
                &[known::CLUSTER_SOURCE_ERRORS, known::CONTROLLERCONFIG_ERRORS]
            }
        };
        metrics.init_source(&self.to_string(), reasons, self.is_cluster());
    }
}

pub struct SourceState {
    pub spec: SourceSpec,
    /// The spec as text: the `source` label and the name in every message.
    pub name: String,
    /// The last good content: what the bundle is built from, kept while the source fails.
    pub content: Option<SourceCertificates>,
    pub up: bool,
    /// Its last update was refused for what it held.
    pub rejected: bool,
    pub problem: Option<String>,
    /// Unix seconds when the content last changed.
    pub last_change: Option<f64>,
}

impl SourceState {
    pub fn new(spec: &SourceSpec) -> SourceState {
        SourceState {
            spec: spec.clone(),
            name: spec.to_string(),
            content: None,
            up: false,
            rejected: false,
            problem: Some("not read yet".to_string()),
            last_change: None,
        }
    }

    /// Takes an event of the source in, counting and logging it; true when the content
    /// changed (the same certificates again are no change).
    pub fn observe(&mut self, event: SourceEvent, metrics: &Metrics) -> bool {
        match event {
            SourceEvent::Content(content) => {
                let changed = self
                    .content
                    .as_ref()
                    .is_none_or(|old| fingerprints(old) != fingerprints(&content));
                self.came_up(content.certificates.len());
                if changed {
                    if !content.not_ca.is_empty() {
                        let count = content.not_ca.len() as u64;
                        metrics
                            .rejected_certificates
                            .get_or_create(&SourceReasonLabels {
                                source: self.name.clone(),
                                reason: "not_ca".to_string(),
                            })
                            .inc_by(count);
                    }
                    super::warn_not_ca(&self.spec, &content);
                    if content.certificates.is_empty() && content.not_ca.is_empty() {
                        // A ControllerConfig field that is empty or absent (the cloud CA on
                        // most platforms): up, with nothing to give.
                        tracing::info!(source = %self.name, certificates = 0, "source holds no certificate (its field is empty or absent)");
                    } else {
                        tracing::info!(source = %self.name, certificates = content.certificates.len(), "source content changed");
                    }
                    self.content = Some(content);
                    self.last_change = Some(unix_now());
                }
                changed
            }
            SourceEvent::Failed(error) => {
                self.failed(&error, false, metrics);
                false
            }
            SourceEvent::WatchRestart(error) => {
                self.failed(&error, true, metrics);
                false
            }
        }
    }

    /// The source answered with content it can use (`certificates` of them, or entries).
    pub fn came_up(&mut self, certificates: usize) {
        if !self.up {
            tracing::info!(source = %self.name, certificates, "source is up");
        }
        self.up = true;
        self.rejected = false;
        self.problem = None;
    }

    /// The source could not be used (`restart`: its watch failed and is being restarted):
    /// counted, and logged once per distinct problem; its last good content stays.
    pub fn failed(&mut self, error: &SourceError, restart: bool, metrics: &Metrics) {
        metrics
            .source_errors
            .get_or_create(&SourceReasonLabels {
                source: self.name.clone(),
                reason: error.reason().to_string(),
            })
            .inc();
        self.rejected = matches!(
            error,
            SourceError::Rejected { .. } | SourceError::Invalid { .. }
        );
        if restart {
            metrics
                .watch_restarts
                .get_or_create(&SourceLabels {
                    source: self.name.clone(),
                })
                .inc();
            self.report(
                error,
                "watch failed; retrying with backoff, keeping the last good content",
            );
        } else {
            self.report(
                error,
                "source update rejected; keeping its last good content",
            );
        }
    }

    /// The source is down: logged once per distinct problem.
    fn report(&mut self, error: &SourceError, what: &str) {
        let problem = error.to_string();
        if self.problem.as_ref() != Some(&problem) {
            tracing::warn!(source = %self.name, reason = error.reason(), "{what}: {problem}");
        }
        self.up = false;
        self.problem = Some(problem);
    }

    pub fn status(&self) -> SourceStatus {
        SourceStatus {
            spec: self.name.clone(),
            up: self.up,
            rejected: self.rejected,
            problem: self.problem.clone(),
            last_change: self.last_change,
        }
    }
}

/// What identifies a source's content: its certificates, and those left out as not CAs.
fn fingerprints(content: &SourceCertificates) -> Vec<Fingerprint> {
    content
        .certificates
        .iter()
        .chain(content.not_ca.iter().map(|s| &s.certificate))
        .map(|c| c.fingerprint())
        .collect()
}
