//! What `/metrics` serves (SPEC 9): the registry of the agent's families ([`crate::metrics`])
//! and the collectors that read the current state at scrape time: per-certificate expiry,
//! sync state, source health, the fleet's counts, the process. A certificate that left the
//! bundle disappears at the next scrape. The per-certificate families are encoded once per
//! state of the bundle ([`Exposition`]).
//!
//! prometheus-client writes OpenMetrics text. Prometheus's own text format (0.0.4) differs
//! only in a few spellings, so [`to_prometheus_text`] rewrites those for scrapers that do
//! not ask for OpenMetrics.

use std::fmt::Write as _;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::credentials::{Credentials, HeldCertificate};
use crate::metrics::{FileLabels, Metrics, SourceLabels, gauge};
use crate::status::{StatusRx, TargetKind};

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
    registry.register_collector(Box::new(FleetCollector(metrics.clone())));
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

/// `kubelet_ca_fleet_nodes{state}` and
/// `kubelet_ca_fleet_certificate_missing_nodes{subject_CN,serial_number}`: `publish`'s view
/// of the fleet's verdict for the bundle it publishes, as it last set it. No series before
/// the Nodes have been read (nor ever on a node agent), so that a publisher that cannot list
/// them shows nothing rather than a fleet of none.
#[derive(Debug)]
struct FleetCollector(Arc<Metrics>);

impl Collector for FleetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(counts) = self.0.fleet.get() else {
            return Ok(());
        };
        gauge(
            &mut encoder,
            "kubelet_ca_fleet_nodes",
            "Nodes counted for the published bundle, by state: current (holds exactly the bundle), behind, unreported (no report of its bundle), invalid (a report that cannot be read)",
            counts
                .nodes
                .iter()
                .map(|(state, n)| ([("state", *state)], *n as i64)),
        )?;
        gauge(
            &mut encoder,
            "kubelet_ca_fleet_certificate_missing_nodes",
            "Counted nodes not shown to hold this certificate of the published bundle (behind, unreported or invalid)",
            counts.missing.iter().map(|(cn, serial, n)| {
                (
                    [
                        ("subject_CN", cn.as_str()),
                        ("serial_number", serial.as_str()),
                    ],
                    *n as i64,
                )
            }),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;
    use crate::metrics::known;
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

    #[test]
    fn every_known_series_is_shown_at_zero_from_the_start() {
        let metrics = Arc::new(Metrics::default());
        metrics.init_file("/b", &[known::FILE_SYNC_ERRORS]);
        for spec in ["file:/s.pem", "configmap:ns/name", "controllerconfig:mcc"] {
            let spec: crate::source::SourceSpec = spec.parse().unwrap();
            spec.init_metrics(&metrics);
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

    #[test]
    fn the_fleets_counts_scrape_as_gauges_once_set() {
        let metrics = Arc::new(Metrics::default());
        let encode = |metrics: &Arc<Metrics>| {
            let mut registry = Registry::default();
            registry.register_collector(Box::new(FleetCollector(metrics.clone())));
            encode_openmetrics(&registry)
        };
        // Nothing before the Nodes are read.
        assert!(!encode(&metrics).contains("kubelet_ca_fleet"));
        let counts = crate::metrics::FleetCounts {
            nodes: vec![
                ("current", 0),
                ("behind", 0),
                ("unreported", 2),
                ("invalid", 1),
            ],
            missing: vec![("signer-a".into(), "42".into(), 3)],
        };
        metrics.fleet.set(Some(counts.clone()));
        assert_eq!(metrics.fleet.get().as_deref(), Some(&counts));
        let text = encode(&metrics);
        assert!(
            text.contains("kubelet_ca_fleet_nodes{state=\"unreported\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("kubelet_ca_fleet_nodes{state=\"current\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("kubelet_ca_fleet_certificate_missing_nodes{subject_CN=\"signer-a\",serial_number=\"42\"} 3\n"),
            "{text}"
        );
        metrics.fleet.set(None);
        assert!(!encode(&metrics).contains("kubelet_ca_fleet"));
    }
}
