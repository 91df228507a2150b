//! The bundle engine: parse and validate source content, merge the sources, render the
//! bundle, and diff two bundles. Pure: no I/O, no clock (every caller passes `now`, in unix
//! seconds), so that all of it can be tested exhaustively.

pub mod certificate;
pub mod parse;
pub mod retention;

use std::collections::HashSet;

pub use certificate::{Certificate, CertificateError, Fingerprint};
pub use parse::{MAX_SOURCE_BYTES, Rejection, SourceCertificates, parse_source};
pub use retention::Remembered;

/// An ordered, deduplicated list of CA certificates: what the managed file holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bundle {
    certificates: Vec<Certificate>,
}

impl Bundle {
    /// Builds a bundle from certificates in priority order; later duplicates are dropped.
    pub fn from_certificates(certificates: impl IntoIterator<Item = Certificate>) -> Self {
        let mut seen = HashSet::new();
        let certificates = certificates
            .into_iter()
            .filter(|c| seen.insert(c.fingerprint()))
            .collect();
        Bundle { certificates }
    }

    pub fn certificates(&self) -> &[Certificate] {
        &self.certificates
    }

    pub fn len(&self) -> usize {
        self.certificates.len()
    }

    pub fn is_empty(&self) -> bool {
        self.certificates.is_empty()
    }

    /// Certificates valid at `now`: what the kubelet can verify clients with today.
    pub fn valid_count(&self, now: i64) -> usize {
        self.certificates
            .iter()
            .filter(|c| c.is_valid_at(now))
            .count()
    }

    /// Standard PEM: one `CERTIFICATE` block per certificate, base64 in 64 columns, LF line
    /// endings, nothing between blocks. A well-formed single source renders byte-identical.
    pub fn render(&self) -> Vec<u8> {
        let size = self.certificates.iter().map(|c| c.pem().len()).sum();
        let mut out = Vec::with_capacity(size);
        for certificate in &self.certificates {
            out.extend_from_slice(certificate.pem());
        }
        out
    }
}

/// What changes between two bundles, by fingerprint.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff<'a> {
    pub added: Vec<&'a Certificate>,
    pub removed: Vec<&'a Certificate>,
}

pub fn diff<'a>(old: &'a [Certificate], new: &'a [Certificate]) -> Diff<'a> {
    let old_set: HashSet<_> = old.iter().map(Certificate::fingerprint).collect();
    let new_set: HashSet<_> = new.iter().map(Certificate::fingerprint).collect();
    Diff {
        added: new
            .iter()
            .filter(|c| !old_set.contains(&c.fingerprint()))
            .collect(),
        removed: old
            .iter()
            .filter(|c| !new_set.contains(&c.fingerprint()))
            .collect(),
    }
}

/// The merge policy: `--retain-removed` and `--drop-expired`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    /// Seconds a certificate that left every source stays in the bundle.
    pub retain_removed: i64,
    /// Leave out certificates past their notAfter.
    pub drop_expired: bool,
}

/// The result of [`build`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    pub bundle: Bundle,
    /// Kept by `--retain-removed` although no source carries them.
    pub retained: Vec<Certificate>,
    /// Left out by `--drop-expired`.
    pub dropped_expired: Vec<Certificate>,
    /// The retention memory to persist for the next build.
    pub memory: Vec<Remembered>,
}

/// The merged bundle held no certificate valid at `now`; it must not be written (SPEC 4.6).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the merged bundle holds {total} certificate(s) and none is valid now: refusing to write it"
)]
pub struct NoValidCertificate {
    pub total: usize,
}

impl NoValidCertificate {
    pub const REASON: &'static str = "no_valid_certificate";
}

/// SPEC 4.4 to 4.6: the union of the sources in order, deduplicated by fingerprint (first
/// occurrence wins), then retention and `--drop-expired`; refused when nothing in it is
/// valid at `now`.
pub fn build(
    sources: &[SourceCertificates],
    previous: &[Remembered],
    policy: Policy,
    now: i64,
) -> Result<Built, NoValidCertificate> {
    let union = Bundle::from_certificates(sources.iter().flat_map(|s| s.certificates.clone()));
    let retention = retention::apply(previous, union.certificates(), policy.retain_removed, now);
    let (kept, dropped_expired): (Vec<_>, Vec<_>) = union
        .certificates
        .into_iter()
        .chain(retention.kept.iter().cloned())
        .partition(|c| !(policy.drop_expired && c.is_expired_at(now)));
    let bundle = Bundle { certificates: kept };
    if bundle.valid_count(now) == 0 {
        return Err(NoValidCertificate {
            total: bundle.len(),
        });
    }
    Ok(Built {
        bundle,
        retained: retention.kept,
        dropped_expired,
        memory: retention.memory,
    })
}

/// Certificates made when a unit test runs (dates are whatever the test asks for, so
/// nothing here can expire), for the unit tests of the bundle engine.
#[cfg(test)]
pub(crate) mod test_certs {
    use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair};
    use time::OffsetDateTime;

    use super::Certificate;

    /// A self-signed CA with the given subject CN and O (either may be absent), valid from
    /// `not_before` to `not_after` (unix seconds).
    pub fn ca(cn: Option<&str>, o: Option<&str>, not_before: i64, not_after: i64) -> Certificate {
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        if let Some(cn) = cn {
            name.push(DnType::CommonName, cn);
        }
        if let Some(o) = o {
            name.push(DnType::OrganizationName, o);
        }
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.not_before = OffsetDateTime::from_unix_timestamp(not_before).unwrap();
        params.not_after = OffsetDateTime::from_unix_timestamp(not_after).unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        Certificate::from_der(params.self_signed(&key).unwrap().der()).unwrap()
    }

    /// Unix seconds now.
    pub fn now() -> i64 {
        OffsetDateTime::now_utc().unix_timestamp()
    }
}

#[cfg(test)]
mod build_tests {
    use super::test_certs::{ca, now};
    use super::*;

    fn source(certificates: Vec<Certificate>) -> SourceCertificates {
        SourceCertificates {
            certificates,
            not_ca: Vec::new(),
        }
    }

    #[test]
    fn a_bundle_counts_its_certificates_once_each() {
        let now = now();
        let a = ca(Some("a"), None, now - 60, now + 3600);
        let b = ca(Some("b"), None, now - 60, now + 3600);
        assert!(Bundle::default().is_empty());
        assert_eq!(Bundle::default().len(), 0);
        let bundle = Bundle::from_certificates([a.clone(), b, a]);
        assert!(!bundle.is_empty());
        assert_eq!(bundle.len(), 2);
    }

    #[test]
    fn a_merge_with_nothing_valid_now_is_refused_and_says_how_many_it_holds() {
        let now = now();
        let expired = ca(Some("expired"), None, now - 7200, now - 3600);
        let future = ca(Some("next"), None, now + 3600, now + 7200);
        let refused = build(
            &[source(vec![expired, future])],
            &[],
            Policy::default(),
            now,
        )
        .unwrap_err();
        assert_eq!(refused, NoValidCertificate { total: 2 });
        assert!(
            refused.to_string().contains("holds 2 certificate(s)"),
            "{refused}"
        );
    }
}
