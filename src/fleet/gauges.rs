//! `publish`'s view of the fleet's verdict (SPEC 8c): the counts that
//! `kubelet_ca_fleet_nodes{state}` and
//! `kubelet_ca_fleet_certificate_missing_nodes{subject_CN,serial_number}` export for the
//! bundle it publishes. The publisher sets them after each verdict
//! ([`crate::metrics::FleetGauges`]); the endpoint encodes them at scrape time.

use crate::metrics::FleetCounts;

use super::verdict::{State, Verdict};

/// The counts of one verdict.
pub fn counts(verdict: &Verdict) -> FleetCounts {
    FleetCounts {
        nodes: State::ALL
            .iter()
            .map(|s| (s.as_str(), verdict.count(*s)))
            .collect(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::held::Sha;
    use crate::fleet::verdict::{Ca, Condition, Node, Question, Report, Target, verdict};

    #[test]
    fn the_counts_are_the_verdicts() {
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
        let counts = counts(&verdict(&question, nodes));
        assert_eq!(
            counts.nodes,
            vec![
                ("current", 0),
                ("behind", 0),
                ("unreported", 2),
                ("invalid", 1)
            ]
        );
        assert_eq!(counts.missing, vec![("signer-a".into(), "42".into(), 3)]);
    }
}
