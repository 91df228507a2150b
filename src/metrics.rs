//! Prometheus metrics (SPEC 9). Counters and the sync histogram live in [`Metrics`] and are
//! updated where things happen; everything that describes the current state (per-certificate
//! expiry, sync state, source health) is read from the loop's [`Status`] at scrape time, so
//! a certificate that left the bundle disappears at the next scrape. The per-certificate
//! families are encoded once per state of the bundle ([`Exposition`]).
//!
//! prometheus-client writes OpenMetrics text. Prometheus's own text format (0.0.4) differs
//! only in a few spellings, so [`to_prometheus_text`] rewrites those for scrapers that do
//! not ask for OpenMetrics.

use std::fmt::Write as _;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::credentials::{Credentials, HeldCertificate};
use crate::status::{StatusRx, TargetKind};

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

/// Labels of the x509 certificate exporter, so existing dashboards and rules keep working.
/// The agent's own certificates (the client certificate it presents to the API server, the
/// CAs it trusts for it) carry two more, as the exporter labels certificates it reads from a
/// kubeconfig: `embedded_kind` (`user` or `cluster`) and `embedded_key` (the kubeconfig's
/// name for that user or cluster). The managed bundle's series have neither, so
/// `{embedded_kind=""}` selects them alone.
#[allow(non_snake_case)]
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct CertificateLabels {
    filepath: String,
    serial_number: String,
    subject_CN: String,
    subject_O: String,
    issuer_CN: String,
    issuer_O: String,
    /// `(embedded_kind, embedded_key)` for the agent's own certificates.
    embedded: Option<(&'static str, String)>,
}

impl EncodeLabelSet for CertificateLabels {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel;
        for (key, value) in [
            ("filepath", self.filepath.as_str()),
            ("serial_number", &self.serial_number),
            ("subject_CN", &self.subject_CN),
            ("subject_O", &self.subject_O),
            ("issuer_CN", &self.issuer_CN),
            ("issuer_O", &self.issuer_O),
        ] {
            (key, value).encode(encoder.encode_label())?;
        }
        if let Some((kind, key)) = &self.embedded {
            ("embedded_kind", *kind).encode(encoder.encode_label())?;
            ("embedded_key", key.as_str()).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BundleInfoLabels {
    filepath: String,
    sha256: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    node: String,
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
    pub fleet: crate::fleet::gauges::FleetGauges,
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

    /// The series of a source, at 0: its errors for every reason its kind can have, the
    /// certificates it can have left out, and (a cluster source) its watch restarts.
    pub fn init_source(&self, spec: &crate::source::SourceSpec) {
        use crate::source::{Keys, SourceSpec};
        let source = spec.to_string();
        let kind: &[&[&str]] = match spec {
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
        let labels = |reason: &str| SourceReasonLabels {
            source: source.clone(),
            reason: reason.to_string(),
        };
        for reason in kind
            .iter()
            .flat_map(|r| r.iter())
            .chain(known::CONTENT_ERRORS)
        {
            let _ = self.source_errors.get_or_create(&labels(reason));
        }
        for reason in known::REJECTED_CERTIFICATES {
            let _ = self.rejected_certificates.get_or_create(&labels(reason));
        }
        if spec.is_cluster() {
            let _ = self.watch_restarts.get_or_create(&SourceLabels {
                source: source.clone(),
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

/// What `/metrics` serves: the registry (the counters, the state read from the loop, the
/// process metrics and the build info), and the per-certificate families, encoded once per
/// state of the bundle rather than on every scrape: for a bundle of a thousand signers they
/// are nearly all of the text, and they change only when the bundle does, or when one of its
/// certificates expires.
pub struct Exposition {
    registry: Registry,
    status: StatusRx,
    /// The agent's own credentials, when it talks to the API server.
    credentials: Option<Credentials>,
    certificates: std::sync::Mutex<Option<(CertificatesKey, Arc<str>)>>,
}

/// What the per-certificate families depend on: the label of the file, the certificates
/// themselves (every label of a series comes from its certificate, which its SHA-256
/// fingerprint identifies), and which of them have expired by now.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CertificatesKey {
    /// Each managed file's path and certificates.
    files: Vec<(String, Vec<crate::bundle::Fingerprint>)>,
    /// The credentials the agent holds, by their generation (a new client, new certificates)
    /// and the agent's own certificates.
    held: Vec<crate::bundle::Fingerprint>,
    /// Certificates expired now: a certificate that expires changes `x509_cert_expired`.
    expired: usize,
}

impl Exposition {
    /// The metrics in OpenMetrics text, or else in Prometheus text format 0.0.4.
    pub fn encode(&self, openmetrics: bool) -> String {
        let certificates = self.certificate_families();
        let main = encode_openmetrics(&self.registry);
        if openmetrics {
            let body = main.strip_suffix("# EOF\n").unwrap_or(&main);
            let mut out = String::with_capacity(body.len() + certificates.len() + 6);
            out.push_str(body);
            out.push_str(&certificates);
            out.push_str("# EOF\n");
            out
        } else {
            // Gauges only: the same in both formats.
            let mut out = to_prometheus_text(&main);
            out.push_str(&certificates);
            out
        }
    }

    /// `x509_cert_*` for the status as it is now, encoded again only when it changed.
    fn certificate_families(&self) -> Arc<str> {
        self.certificate_families_at(time::OffsetDateTime::now_utc().unix_timestamp())
    }

    fn certificate_families_at(&self, now: i64) -> Arc<str> {
        let status = self.status.borrow().clone();
        let held: Arc<[HeldCertificate]> = self
            .credentials
            .as_ref()
            .map(|c| c.current().held.clone())
            .unwrap_or_default();
        let key = CertificatesKey {
            files: status
                .files()
                .map(|f| {
                    let certificates = f.certificates.iter().map(|c| c.fingerprint()).collect();
                    (f.bundle_path.clone(), certificates)
                })
                .collect(),
            held: held.iter().map(|h| h.certificate.fingerprint()).collect(),
            expired: status
                .files()
                .flat_map(|f| f.certificates.iter())
                .chain(held.iter().map(|h| &h.certificate))
                .filter(|c| c.is_expired_at(now))
                .count(),
        };
        let mut cached = self
            .certificates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((seen, text)) = cached.as_ref()
            && *seen == key
        {
            return text.clone();
        }
        let mut registry = Registry::default();
        registry.register_collector(Box::new(CertificateCollector { status, held, now }));
        let text = encode_openmetrics(&registry);
        let text: Arc<str> = text.strip_suffix("# EOF\n").unwrap_or(&text).into();
        *cached = Some((key, text.clone()));
        text
    }
}

/// The registry behind `/metrics`: the counters, the state read from the loop, the
/// process metrics and the build info.
pub fn registry(
    metrics: Arc<Metrics>,
    status: StatusRx,
    credentials: Option<Credentials>,
    node: Option<&str>,
) -> Exposition {
    let mut registry = Registry::default();
    let m = &metrics;
    registry.register(
        "kubelet_ca_source_errors",
        "Source updates rejected or reads that failed, by reason",
        m.source_errors.clone(),
    );
    registry.register(
        "kubelet_ca_rejected_certificates",
        "Certificates left out of the bundle, by reason",
        m.rejected_certificates.clone(),
    );
    registry.register(
        "kubelet_ca_writes",
        "Times the bundle file was replaced",
        m.writes.clone(),
    );
    registry.register(
        "kubelet_ca_repairs",
        "Times the bundle file was rewritten after something else changed or deleted it",
        m.repairs.clone(),
    );
    registry.register(
        "kubelet_ca_sync_errors",
        "Reconciliations that could not bring the file in sync, by reason",
        m.sync_errors.clone(),
    );
    registry.register(
        "kubelet_ca_exec_on_change_failures",
        "Failed runs of the --exec-on-change command",
        m.exec_on_change_failures.clone(),
    );
    registry.register(
        "kubelet_ca_kubeconfig_hook_failures",
        "Failed runs of the --kubeconfig-hook command, or, with --kubeconfig-restart-request, kubelet restarts the host reported failed, requests that could not be written and requests the host took but answered with no result within 15 minutes (each is asked again with backoff; a request nothing has taken is pending, not failed)",
        m.kubeconfig_hook_failures.clone(),
    );
    registry.register(
        "kubelet_ca_kubeconfig_removals_held",
        "Checks of a managed kubeconfig's server after which the CAs its sources dropped were kept: the new CA data alone did not verify the certificate the server presents, or the server could not be reached",
        m.kubeconfig_removals_held.clone(),
    );
    registry.register(
        "kubelet_ca_sync_duration_seconds",
        "From a source change arriving to the new bundle being durable on disk",
        m.sync_duration.clone(),
    );
    registry.register(
        "kubelet_ca_watch_restarts",
        "Restarts of a source's watch after an error",
        m.watch_restarts.clone(),
    );
    registry.register(
        "kubelet_ca_state_errors",
        "Failed writes of the records in the state directory (history, retention, managed_files); each is retried",
        m.state_errors.clone(),
    );
    registry.register(
        "kubelet_ca_review_errors",
        "TokenReviews and SubjectAccessReviews of the endpoint that could not be made, by reason (circuit_open: turned away while the API server was taken for unreachable)",
        m.review_errors.clone(),
    );
    registry.register(
        "kubelet_ca_node_report_writes",
        "Writes of this node's report (the kubelet-ca-agent/held annotation) on its Node, by cause (start, change; removed, edited, registered, restored: put back after something undid it)",
        m.node_report_writes.clone(),
    );
    registry.register(
        "kubelet_ca_node_report_errors",
        "Requests for this node's report on its Node that failed, by reason (node_missing: the Node does not exist yet; forbidden: the credentials may not write it); each is retried with backoff",
        m.node_report_errors.clone(),
    );
    registry.register(
        "kubelet_ca_node_events_not_recorded",
        "Kubernetes Events on this node's Node that were not recorded, by reason (throttled: the same one lately, or more than a few a minute; refused, timeout, no_credentials, queue_full)",
        m.node_events_not_recorded.clone(),
    );
    let build = BuildLabels {
        version: env!("CARGO_PKG_VERSION").to_string(),
        node: node.unwrap_or_default().to_string(),
    };
    registry.register(
        "kubelet_ca_agent_build",
        "Build and node of this agent",
        Info::new(build),
    );
    registry.register_collector(Box::new(StateCollector {
        status: status.clone(),
    }));
    registry.register_collector(Box::new(ProcessCollector));
    registry.register_collector(Box::new(crate::fleet::gauges::FleetCollector(
        metrics.clone(),
    )));
    Exposition {
        registry,
        status,
        credentials,
        certificates: std::sync::Mutex::new(None),
    }
}

/// `x509_cert_not_after`, `x509_cert_not_before` and `x509_cert_expired` of one status.
#[derive(Debug)]
struct CertificateCollector {
    status: Arc<crate::status::Status>,
    /// The agent's own certificates.
    held: Arc<[HeldCertificate]>,
    now: i64,
}

impl Collector for CertificateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (status, now) = (&self.status, self.now);
        let labels = |filepath: &str, c: &crate::bundle::Certificate| CertificateLabels {
            filepath: filepath.to_string(),
            serial_number: c.serial.clone(),
            subject_CN: c.subject_cn.clone(),
            subject_O: c.subject_o.clone(),
            issuer_CN: c.issuer_cn.clone(),
            issuer_O: c.issuer_o.clone(),
            embedded: None,
        };
        // Two certificates can share every label (same serial, subject and issuer, other
        // key); emit the first only, so the exposition stays valid.
        let mut seen = std::collections::HashSet::new();
        let certs: Vec<_> = status
            .files()
            .flat_map(|f| {
                f.certificates
                    .iter()
                    .map(|c| (labels(&f.bundle_path, c), c))
            })
            .chain(self.held.iter().map(|h| {
                let mut l = labels(&h.filepath, &h.certificate);
                l.embedded = Some((h.kind, h.key.clone()));
                (l, &h.certificate)
            }))
            .filter(|(l, _)| seen.insert(l.clone()))
            .collect();
        gauge(
            &mut encoder,
            "x509_cert_not_after",
            "Certificate notAfter, unix seconds",
            certs.iter().map(|(l, c)| (l.clone(), c.not_after)),
        )?;
        gauge(
            &mut encoder,
            "x509_cert_not_before",
            "Certificate notBefore, unix seconds",
            certs.iter().map(|(l, c)| (l.clone(), c.not_before)),
        )?;
        gauge(
            &mut encoder,
            "x509_cert_expired",
            "1 if the certificate is past its notAfter",
            certs
                .iter()
                .map(|(l, c)| (l.clone(), i64::from(c.is_expired_at(now)))),
        )
    }
}

/// Metrics derived from the loop's status at scrape time.
#[derive(Debug)]
struct StateCollector {
    status: StatusRx,
}

pub(crate) fn gauge<L: EncodeLabelSet, V: prometheus_client::encoding::EncodeGaugeValue>(
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

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = self.status.borrow().clone();
        let file = || FileLabels {
            filepath: status.bundle_path.clone(),
        };
        let files = || status.files();
        let labels = |f: &crate::status::Status| FileLabels {
            filepath: f.bundle_path.clone(),
        };
        gauge(
            &mut encoder,
            "kubelet_ca_bundle_certificates",
            "Certificates in the bundle file",
            files()
                .filter(|f| f.sha256.is_some())
                .map(|f| (labels(f), f.certificates.len() as i64)),
        )?;
        // No series while a source has never been read: there is nothing to compare with.
        gauge(
            &mut encoder,
            "kubelet_ca_bundle_in_sync",
            "1 when the file equals the bundle built from the sources",
            files().filter_map(|f| Some((labels(f), i64::from(f.in_sync?)))),
        )?;
        let info = files().filter_map(|f| {
            Some((
                BundleInfoLabels {
                    filepath: f.bundle_path.clone(),
                    sha256: f.sha256.clone()?,
                },
                1i64,
            ))
        });
        gauge(
            &mut encoder,
            "kubelet_ca_bundle_info",
            "The SHA-256 of the bundle file",
            info,
        )?;
        // A source that feeds several files is one series.
        let all_sources = status.all_sources();
        let sources = || all_sources.iter();
        gauge(
            &mut encoder,
            "kubelet_ca_source_up",
            "1 when the last read or watch of the source succeeded with valid content",
            sources().map(|s| {
                (
                    SourceLabels {
                        source: s.spec.clone(),
                    },
                    i64::from(s.up),
                )
            }),
        )?;
        gauge(
            &mut encoder,
            "kubelet_ca_source_last_change_timestamp_seconds",
            "When the source's content last changed, unix seconds",
            sources().filter_map(|s| {
                Some((
                    SourceLabels {
                        source: s.spec.clone(),
                    },
                    s.last_change?,
                ))
            }),
        )?;
        if status.kind == TargetKind::File {
            encoder
            .encode_descriptor(
                "kubelet_ca_file_watch_up",
                "1 when inotify watches every directory of the bundle and the local sources; 0 when changes there are seen only by the once-a-minute re-verification",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&i64::from(status.file_watch.is_none()))?;
        }
        // A series for each managed kubeconfig alone.
        gauge(
            &mut encoder,
            "kubelet_ca_kubeconfig_removal_held",
            "1 while CAs that a managed kubeconfig's sources dropped are kept, until the new CA data alone verifies its server",
            files().filter_map(|f| Some((labels(f), i64::from(f.removal_held?)))),
        )?;
        gauge(
            &mut encoder,
            "kubelet_ca_last_sync_timestamp_seconds",
            "The last reconciliation that ended in sync, unix seconds",
            files().filter_map(|f| Some((labels(f), f.last_sync?))),
        )?;
        // No series while it is not known (no kubelet config found, none set in it).
        if status.kind == TargetKind::File {
            gauge(
                &mut encoder,
                "kubelet_ca_kubelet_uses_bundle",
                "1 when the kubelet's config names the file as its client CA (authentication.x509.clientCAFile), 0 when it names another file",
                status
                    .kubelet
                    .as_ref()
                    .and_then(|k| k.uses())
                    .map(|uses| (file(), i64::from(uses))),
            )?;
        }
        Ok(())
    }
}

/// The usual `process_*` metrics, read from /proc at scrape time.
#[derive(Debug, Default)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(p) = process_stats() else {
            return Ok(());
        };
        let mut plain = |name: &str, help: &str, value: i64| -> Result<(), std::fmt::Error> {
            encoder
                .encode_descriptor(name, help, None, MetricType::Gauge)?
                .encode_gauge(&value)
        };
        plain(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            p.resident_bytes as i64,
        )?;
        plain(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes",
            p.virtual_bytes as i64,
        )?;
        plain(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            p.start_time as i64,
        )?;
        plain(
            "process_open_fds",
            "Number of open file descriptors",
            p.open_fds as i64,
        )?;
        if let Some(max) = p.max_fds {
            plain(
                "process_max_fds",
                "Maximum number of open file descriptors",
                max as i64,
            )?;
        }
        let mut cpu = encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            MetricType::Counter,
        )?;
        cpu.encode_counter::<NoLabelSet, _, u64>(&p.cpu_seconds, None)?;
        Ok(())
    }
}

struct ProcessStats {
    cpu_seconds: f64,
    resident_bytes: u64,
    virtual_bytes: u64,
    start_time: f64,
    open_fds: usize,
    max_fds: Option<u64>,
}

fn process_stats() -> Option<ProcessStats> {
    use nix::unistd::{SysconfVar, sysconf};
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let ticks = sysconf(SysconfVar::CLK_TCK).ok()?? as f64;
    let page = sysconf(SysconfVar::PAGE_SIZE).ok()?? as u64;
    let boot_time: f64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    Some(ProcessStats {
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        start_time: boot_time + field(22)? as f64 / ticks,
        virtual_bytes: field(23)?,
        resident_bytes: field(24)? * page,
        open_fds: std::fs::read_dir("/proc/self/fd")
            .ok()?
            .count()
            .saturating_sub(1),
        max_fds: nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .ok()
            .map(|(soft, _)| soft),
    })
}

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The registry in OpenMetrics text.
pub fn encode_openmetrics(registry: &Registry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    prometheus_client::encoding::text::encode(&mut out, registry)
        .expect("writing to a String cannot fail");
    out
}

/// Rewrites OpenMetrics text into Prometheus text format 0.0.4: counter and info families
/// are named by their sample names (`x_total`, `x_info`, info becoming a gauge), and the
/// `# UNIT` and `# EOF` lines go.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut renames: Vec<(String, String)> = Vec::new();
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (new_name, new_kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "unknown" => (name.to_string(), "untyped"),
                other => (name.to_string(), other),
            };
            if new_name != name {
                renames.push((name.to_string(), new_name.clone()));
                // The HELP line came first: rename it too.
                let help_prefix = format!("# HELP {name} ");
                if let Some(start) = out.rfind(&help_prefix) {
                    out.replace_range(
                        start..start + help_prefix.len(),
                        &format!("# HELP {new_name} "),
                    );
                }
            }
            let _ = writeln!(out, "# TYPE {new_name} {new_kind}");
            continue;
        }
        // OpenMetrics `_created` samples have no place in 0.0.4.
        if let Some((family, _)) = renames.last()
            && line.starts_with(&format!("{family}_created"))
        {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;
    use crate::status::Status;

    #[test]
    fn certificate_families_are_encoded_again_only_when_the_bundle_or_an_expiry_changes() {
        const T: i64 = 1_900_000_000;
        let (a, b) = (
            test_certs::ca(Some("signer-a"), None, T - 100, T + 100),
            test_certs::ca(Some("signer-b"), None, T - 100, T + 1000),
        );
        let status = |certificates: Vec<_>, sha: &str| {
            Arc::new(Status {
                bundle_path: "/etc/kubernetes/kubelet-ca.crt".into(),
                certificates,
                sha256: Some(sha.into()),
                ..Status::default()
            })
        };
        let (tx, rx) = tokio::sync::watch::channel(status(vec![a.clone()], "1"));
        let exposition = registry(Arc::new(Metrics::default()), rx, None, None);
        let first = exposition.certificate_families_at(T);
        assert!(
            first.contains("x509_cert_expired{") && first.contains("signer-a"),
            "{first}"
        );
        assert!(!first.contains("# EOF"), "{first}");
        // A new pass over the same file: the text is reused, not encoded again.
        tx.send_replace(status(vec![a.clone()], "1"));
        assert!(Arc::ptr_eq(
            &first,
            &exposition.certificate_families_at(T + 50)
        ));
        // signer-a expires: encoded again, with x509_cert_expired 1.
        let expired = exposition.certificate_families_at(T + 101);
        assert!(!Arc::ptr_eq(&first, &expired));
        assert!(
            expired.contains("x509_cert_expired{") && expired.contains("} 1\n"),
            "{expired}"
        );
        // Another bundle: signer-a's series are gone.
        tx.send_replace(status(vec![b], "2"));
        let other = exposition.certificate_families_at(T + 101);
        assert!(
            other.contains("signer-b") && !other.contains("signer-a"),
            "{other}"
        );
        // Both formats carry them once, OpenMetrics still ending with # EOF.
        let openmetrics = exposition.encode(true);
        assert!(openmetrics.ends_with("# EOF\n"), "{openmetrics}");
        assert_eq!(
            openmetrics
                .matches("# TYPE x509_cert_not_after gauge")
                .count(),
            1
        );
        let text = exposition.encode(false);
        assert!(!text.contains("# EOF"));
        assert_eq!(text.matches("# TYPE x509_cert_not_after gauge").count(), 1);
    }

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

    #[test]
    fn every_known_series_is_shown_at_zero_from_the_start() {
        let metrics = Arc::new(Metrics::default());
        metrics.init_file("/b", &[known::FILE_SYNC_ERRORS]);
        for spec in ["file:/s.pem", "configmap:ns/name", "controllerconfig:mcc"] {
            metrics.init_source(&spec.parse().unwrap());
        }
        metrics.init_records();
        let (_, rx) = tokio::sync::watch::channel(Arc::new(Status::default()));
        let text = registry(metrics, rx, None, None).encode(false);
        for line in [
            "kubelet_ca_writes_total{filepath=\"/b\"} 0\n",
            "kubelet_ca_repairs_total{filepath=\"/b\"} 0\n",
            "kubelet_ca_sync_errors_total{filepath=\"/b\",reason=\"not_a_file\"} 0\n",
            "kubelet_ca_source_errors_total{source=\"file:/s.pem\",reason=\"private_key\"} 0\n",
            "kubelet_ca_source_errors_total{source=\"configmap:ns/name\",reason=\"missing_key\"} 0\n",
            "kubelet_ca_source_errors_total{source=\"controllerconfig:mcc\",reason=\"bad_base64\"} 0\n",
            "kubelet_ca_rejected_certificates_total{source=\"file:/s.pem\",reason=\"not_ca\"} 0\n",
            "kubelet_ca_watch_restarts_total{source=\"configmap:ns/name\"} 0\n",
            "kubelet_ca_state_errors_total{record=\"history\"} 0\n",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
        // Only the reasons a kind of source can have.
        for absent in [
            "kubelet_ca_watch_restarts_total{source=\"file:/s.pem\"}",
            "source=\"file:/s.pem\",reason=\"forbidden\"",
            "source=\"controllerconfig:mcc\",reason=\"missing_key\"",
        ] {
            assert!(!text.contains(absent), "{absent} in\n{text}");
        }
    }

    #[test]
    fn counters_and_info_are_renamed_for_prometheus_text() {
        let om = "# HELP a_writes Writes.\n# TYPE a_writes counter\na_writes_total{f=\"x\"} 2\na_writes_created 1.5\n# HELP b Build.\n# TYPE b info\nb_info{version=\"1\"} 1\n# HELP g A gauge.\n# TYPE g gauge\n# UNIT g seconds\ng 1\n# EOF\n";
        let text = to_prometheus_text(om);
        assert_eq!(
            text,
            "# HELP a_writes_total Writes.\n# TYPE a_writes_total counter\na_writes_total{f=\"x\"} 2\n# HELP b_info Build.\n# TYPE b_info gauge\nb_info{version=\"1\"} 1\n# HELP g A gauge.\n# TYPE g gauge\ng 1\n"
        );
    }
}
