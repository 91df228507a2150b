//! `publish`'s view of the fleet's verdict (SPEC 8c): `kubelet_ca_fleet_nodes{state}` and
//! `kubelet_ca_fleet_certificate_missing_nodes{subject_CN,serial_number}`, for the bundle it
//! publishes. The publisher sets the counts after each verdict; the endpoint encodes them at
//! scrape time. No series before the Nodes have been read (nor ever on a node agent), so
//! that a publisher that cannot list them shows nothing rather than a fleet of none.

use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::verdict::{State, Verdict};

/// The counts of one verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counts {
    /// How many counted nodes are in each state, every state named.
    pub nodes: Vec<(State, usize)>,
    /// For each certificate of the bundle: its subject CN, its serial number, and how many
    /// counted nodes are not shown to hold it.
    pub missing: Vec<(String, String, usize)>,
}

impl Counts {
    pub fn of(verdict: &Verdict) -> Counts {
        Counts {
            nodes: State::ALL.iter().map(|s| (*s, verdict.count(*s))).collect(),
            missing: verdict
                .certificates
                .iter()
                .map(|c| {
                    (
                        c.ca.subject_cn.clone().unwrap_or_default(),
                        c.ca.serial_number.clone().unwrap_or_default(),
                        c.missing,
                    )
                })
                .collect(),
        }
    }
}

/// The last counts, shared between the publisher and the endpoint.
#[derive(Debug, Default)]
pub struct FleetGauges(Mutex<Option<Arc<Counts>>>);

impl FleetGauges {
    /// The counts to export from now on; `None`: none (the Nodes cannot be read).
    pub fn set(&self, counts: Option<Counts>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = counts.map(Arc::new);
    }

    pub fn get(&self) -> Option<Arc<Counts>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Encodes the fleet's counts at scrape time.
#[derive(Debug)]
pub struct FleetCollector(pub Arc<crate::metrics::Metrics>);

impl Collector for FleetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(counts) = self.0.fleet.get() else {
            return Ok(());
        };
        crate::metrics::gauge(
            &mut encoder,
            "kubelet_ca_fleet_nodes",
            "Nodes counted for the published bundle, by state: current (holds exactly the bundle), behind, unreported (no report of its bundle), invalid (a report that cannot be read)",
            counts
                .nodes
                .iter()
                .map(|(state, n)| ([("state", state.as_str())], *n as i64)),
        )?;
        crate::metrics::gauge(
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
    use crate::fleet::held::Sha;
    use crate::fleet::verdict::{Ca, Condition, Node, Question, Report, Target, verdict};
    use crate::metrics::Metrics;

    #[test]
    fn the_counts_are_the_verdicts_and_scrape_as_gauges() {
        let sha = Sha::parse(&"a".repeat(64)).unwrap();
        let question = Question {
            sources: vec![Ca {
                sha256: sha,
                subject_cn: Some("signer-a".into()),
                serial_number: Some("42".into()),
            }],
            known: vec![],
            condition: Condition::Sources,
            target: Target::Bundle,
        };
        let (missing, invalid) = (Report::Missing, Report::Oversized(1 << 20));
        let nodes =
            [("n1", &missing), ("n2", &invalid), ("n3", &missing)].map(|(name, report)| Node {
                name,
                ready: None,
                deleting: false,
                report,
            });
        let counts = Counts::of(&verdict(&question, nodes));
        assert_eq!(
            counts.nodes,
            vec![
                (State::Current, 0),
                (State::Behind, 0),
                (State::Unreported, 2),
                (State::Invalid, 1)
            ]
        );
        assert_eq!(counts.missing, vec![("signer-a".into(), "42".into(), 3)]);
        let metrics = Arc::new(Metrics::default());
        let encode = |metrics: &Arc<Metrics>| {
            let mut registry = prometheus_client::registry::Registry::default();
            registry.register_collector(Box::new(FleetCollector(metrics.clone())));
            crate::metrics::encode_openmetrics(&registry)
        };
        // Nothing before the Nodes are read.
        assert!(!encode(&metrics).contains("kubelet_ca_fleet"));
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
