//! The agent's metric families (SPEC 9): the counters and the sync histogram in [`Metrics`],
//! updated where things happen, their label types, the label values each counter is known
//! to take ([`known`]), the fleet's counts as `publish` last set them, and the [`gauge`]
//! helper that collectors encode with.
//!
//! This is the bottom floor: it knows nothing of what it counts (the sources, the targets,
//! the fleet, the server), so that everything that counts can depend on it. What reads the
//! state at scrape time and serves `/metrics` (the exposition and its collectors) lives
//! with the server that serves it, in [`crate::server::exposition`].

use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FileLabels {
    pub filepath: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FileReasonLabels {
    pub filepath: String,
    pub reason: String,
}

/// A review of the endpoint (`token`: a TokenReview, `access`: a SubjectAccessReview) and
/// why it could not be made.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReviewLabels {
    pub review: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceReasonLabels {
    pub source: String,
    pub reason: String,
}

/// The agent's counters and histogram.
#[derive(Debug)]
pub struct Metrics {
    pub source_errors: Family<SourceReasonLabels, Counter>,
    pub rejected_certificates: Family<SourceReasonLabels, Counter>,
    pub writes: Family<FileLabels, Counter>,
    pub repairs: Family<FileLabels, Counter>,
    pub sync_errors: Family<FileReasonLabels, Counter>,
    pub exec_on_change_failures: Counter,
    /// Failed runs of `--kubeconfig-hook` (each is retried).
    pub kubeconfig_hook_failures: Counter,
    /// Checks of a kubeconfig's server that held back the removal of a CA.
    pub kubeconfig_removals_held: Family<FileLabels, Counter>,
    pub sync_duration: Histogram,
    pub watch_restarts: Family<SourceLabels, Counter>,
    pub state_errors: Family<RecordLabels, Counter>,
    pub review_errors: Family<ReviewLabels, Counter>,
    /// Writes of this node's report on its Node (SPEC 8c).
    pub node_report_writes: Family<CauseLabels, Counter>,
    /// Requests for this node's report that failed, by reason.
    pub node_report_errors: Family<ReasonLabels, Counter>,
    /// Events on the Node that were not recorded, by reason.
    pub node_events_not_recorded: Family<ReasonLabels, Counter>,
    /// The fleet's counts (`publish`, SPEC 8c); none on a node agent.
    pub fleet: FleetGauges,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RecordLabels {
    pub record: String,
}

/// Every label value a counter is known to take, in one place. Each series is shown at 0
/// from the start ([`Metrics::init_file`], [`Metrics::init_source`]): a series that
/// appears only with its first event shows as "No data" on a dashboard, and `increase()`
/// misses that first event. The unit tests check the lists against the errors that give
/// the reasons.
pub mod known {
    /// `kubelet_ca_sync_errors_total{reason}` of the node agent's file: a write that failed
    /// (`WriteError::reason`), a bundle that must not be written (`NoValidCertificate::reason`),
    /// a mode or owner that could not be put back.
    pub const FILE_SYNC_ERRORS: &[&str] = &[
        "permission_denied",
        "no_space",
        "read_only",
        "io_error",
        "not_a_file",
        "no_valid_certificate",
        "no_ca_certificate",
        "attributes",
    ];
    /// ... of a managed kubeconfig besides: it does not parse, or its cluster cannot be
    /// told or names a CA file.
    pub const KUBECONFIG_SYNC_ERRORS: &[&str] = &["invalid_kubeconfig"];
    /// `kubelet_ca_sync_errors_total{reason}` of the publisher's ConfigMap.
    pub const CONFIGMAP_SYNC_ERRORS: &[&str] =
        &["apply_failed", "no_valid_certificate", "no_ca_certificate"];
    /// `kubelet_ca_sync_errors_total{reason}` too, where a cluster source is read: no usable
    /// credentials for the API server.
    pub const CLUSTER_SYNC_ERRORS: &[&str] = &["credentials"];
    /// `kubelet_ca_node_report_errors_total{reason}`: a request for the node's report that
    /// failed (`fleet::report`).
    pub const NODE_REPORT_ERRORS: &[&str] = &[
        "node_missing",
        "unauthorized",
        "forbidden",
        "too_many_requests",
        "server_error",
        "api_error",
        "unreachable",
        "tls",
        "timeout",
    ];
    /// `kubelet_ca_source_errors_total{reason}` of every source: content rejected
    /// (`Rejection::reason`).
    pub const CONTENT_ERRORS: &[&str] = &[
        "too_large",
        "malformed_pem",
        "private_key",
        "not_certificate",
        "unparsable_certificate",
        "no_certificate",
    ];
    /// ... of a `file:` source: a read that failed.
    pub const FILE_SOURCE_ERRORS: &[&str] = &["unreadable"];
    /// ... of a `dir:` source: a read that failed, a member being written.
    pub const DIR_SOURCE_ERRORS: &[&str] = &["unreadable", "empty_file"];
    /// ... of a cluster source: the API server's answer or its absence, the credentials.
    pub const CLUSTER_SOURCE_ERRORS: &[&str] = &[
        "unreachable",
        "tls",
        "no_answer",
        "watch_silent",
        "api_error",
        "unauthorized",
        "forbidden",
        "not_found",
        "expired",
        "credentials",
    ];
    /// ... of a `configmap:` source naming one key: the key is missing.
    pub const CONFIGMAP_KEY_ERRORS: &[&str] = &["missing_key"];
    /// ... of every `configmap:` source: a value that is a kubeconfig holding a user's
    /// credentials.
    pub const CONFIGMAP_VALUE_ERRORS: &[&str] = &["kubeconfig_credentials"];
    /// ... of a `controllerconfig:` source: the field is missing or not base64.
    pub const CONTROLLERCONFIG_ERRORS: &[&str] = &["missing_field", "bad_base64", "not_a_bundle"];
    /// `kubelet_ca_rejected_certificates_total{reason}`.
    pub const REJECTED_CERTIFICATES: &[&str] = &["not_ca"];
    /// `kubelet_ca_state_errors_total{record}`.
    pub const RECORDS: &[&str] = &["history", "retention", "managed_files"];
    /// `kubelet_ca_review_errors_total{reason}` (`server::review::Reason`).
    pub const REVIEW_ERRORS: &[&str] = &[
        "unreachable",
        "tls",
        "no_answer",
        "unauthorized",
        "forbidden",
        "api_error",
        "credentials",
        "circuit_open",
    ];
}

// Creating a series (`get_or_create`) is all the `init_*` functions do: the guard it
// returns is dropped at once (`let _`).
impl Metrics {
    /// The series of a managed file (`filepath`), at 0: writes, repairs, and sync errors
    /// for each of `reasons` (from [`known`]).
    pub fn init_file(&self, filepath: &str, reasons: &[&[&str]]) {
        let file = FileLabels {
            filepath: filepath.to_string(),
        };
        let _ = self.writes.get_or_create(&file);
        let _ = self.repairs.get_or_create(&file);
        for reason in reasons.iter().flat_map(|r| r.iter()) {
            let _ = self.sync_errors.get_or_create(&FileReasonLabels {
                filepath: filepath.to_string(),
                reason: reason.to_string(),
            });
        }
    }

    /// The series of a source (`source`, as its spec is written), at 0: its errors for each
    /// of `reasons` (from [`known`], by its kind) and for rejected content, the certificates
    /// it can have left out, and (`watched`: a cluster source) its watch restarts.
    pub fn init_source(&self, source: &str, reasons: &[&[&str]], watched: bool) {
        let labels = |reason: &str| SourceReasonLabels {
            source: source.to_string(),
            reason: reason.to_string(),
        };
        for reason in reasons
            .iter()
            .flat_map(|r| r.iter())
            .chain(known::CONTENT_ERRORS)
        {
            let _ = self.source_errors.get_or_create(&labels(reason));
        }
        for reason in known::REJECTED_CERTIFICATES {
            let _ = self.rejected_certificates.get_or_create(&labels(reason));
        }
        if watched {
            let _ = self.watch_restarts.get_or_create(&SourceLabels {
                source: source.to_string(),
            });
        }
    }

    /// The series of the endpoint's reviews of one kind (`token`, `access`), at 0.
    pub fn init_reviews(&self, review: &str) {
        for reason in known::REVIEW_ERRORS {
            let _ = self.review_errors.get_or_create(&ReviewLabels {
                review: review.to_string(),
                reason: reason.to_string(),
            });
        }
    }

    /// The series of the records in the state directory, at 0.
    pub fn init_records(&self) {
        for record in known::RECORDS {
            let _ = self.state_errors.get_or_create(&RecordLabels {
                record: record.to_string(),
            });
        }
    }
}

impl Metrics {
    /// An Event on the Node was not recorded, for `reason`.
    pub fn not_recorded(&self, reason: &str) {
        self.node_events_not_recorded
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Shows every reason of `kubelet_ca_node_report_errors_total` at 0: the node reports.
    pub fn init_node_report(&self) {
        for reason in known::NODE_REPORT_ERRORS {
            let _ = self.node_report_errors.get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            });
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        // Fine around the targets (2 ms at p50, 10 ms at p99), coarse beyond.
        let buckets = [
            0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025,
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
        ];
        Metrics {
            source_errors: Family::default(),
            rejected_certificates: Family::default(),
            writes: Family::default(),
            repairs: Family::default(),
            sync_errors: Family::default(),
            exec_on_change_failures: Counter::default(),
            kubeconfig_hook_failures: Counter::default(),
            kubeconfig_removals_held: Family::default(),
            sync_duration: Histogram::new(buckets),
            watch_restarts: Family::default(),
            state_errors: Family::default(),
            review_errors: Family::default(),
            node_report_writes: Family::default(),
            node_report_errors: Family::default(),
            node_events_not_recorded: Family::default(),
            fleet: Default::default(),
        }
    }
}

/// One gauge family, a sample for each of `samples`, encoded by a collector at scrape time.
pub fn gauge<L: EncodeLabelSet, V: prometheus_client::encoding::EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, V)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        family.encode_family(&labels)?.encode_gauge(&value)?;
    }
    Ok(())
}

/// The fleet's counts of one verdict (SPEC 8c), as `publish` exports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetCounts {
    /// How many counted nodes are in each state (by its name), every state named.
    pub nodes: Vec<(&'static str, usize)>,
    /// For each certificate of the bundle: its subject CN, its serial number, and how many
    /// counted nodes are not shown to hold it.
    pub missing: Vec<(String, String, usize)>,
}

/// The last counts, shared between the publisher and the endpoint.
#[derive(Debug, Default)]
pub struct FleetGauges(Mutex<Option<Arc<FleetCounts>>>);

impl FleetGauges {
    /// The counts to export from now on; `None`: none (the Nodes cannot be read).
    pub fn set(&self, counts: Option<FleetCounts>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = counts.map(Arc::new);
    }

    pub fn get(&self) -> Option<Arc<FleetCounts>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lists of known reasons hold every reason the errors give.
    #[test]
    fn the_known_reasons_are_those_the_errors_give() {
        use crate::bundle::{CertificateError, Rejection};
        use crate::writer::{ReplaceError, WriteError};
        use std::io::ErrorKind;
        let rejections = [
            Rejection::TooLarge { size: 2, limit: 1 },
            Rejection::MalformedPem {
                block: 1,
                line: 1,
                problem: String::new(),
            },
            Rejection::PrivateKey {
                block: 1,
                line: 1,
                label: String::new(),
            },
            Rejection::NotCertificate {
                block: 1,
                line: 1,
                label: String::new(),
            },
            Rejection::UnparsableCertificate {
                block: 1,
                line: 1,
                error: CertificateError::TrailingData(1),
            },
            Rejection::NoCertificate,
        ];
        for rejection in &rejections {
            assert!(
                known::CONTENT_ERRORS.contains(&rejection.reason()),
                "{rejection:?}"
            );
        }
        let path = std::path::PathBuf::from("/x");
        for kind in [
            ErrorKind::PermissionDenied,
            ErrorKind::StorageFull,
            ErrorKind::QuotaExceeded,
            ErrorKind::ReadOnlyFilesystem,
            ErrorKind::Other,
        ] {
            let error = WriteError::Replace {
                path: path.clone(),
                cause: ReplaceError {
                    step: "renaming",
                    error: kind.into(),
                },
            };
            assert!(
                known::FILE_SYNC_ERRORS.contains(&error.reason()),
                "{kind:?}"
            );
        }
        let directory = WriteError::Directory { path };
        assert!(known::FILE_SYNC_ERRORS.contains(&directory.reason()));
        for reason in [
            crate::bundle::NoValidCertificate::REASON,
            crate::bundle::NoValidCertificate::REASON_NO_CA,
        ] {
            assert!(known::FILE_SYNC_ERRORS.contains(&reason));
            assert!(known::CONFIGMAP_SYNC_ERRORS.contains(&reason));
        }
    }
}
