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
/// It names what is wrong with each certificate, so that the reader is sent to the right
/// place: a signer whose rotation stalled (its notAfter), the clock (dates that look right
/// but are judged otherwise), or a source that carries leaf certificates instead of CAs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", describe(self))]
pub struct NoValidCertificate {
    /// Certificates in the merged bundle.
    pub total: usize,
    /// Certificates past their notAfter: in the bundle, or left out by `--drop-expired`.
    pub expired: Vec<Certificate>,
    /// Certificates before their notBefore.
    pub not_yet_valid: Vec<Certificate>,
    /// Certificates the sources carry that were left out as not CAs, and where each is.
    pub not_ca: Vec<parse::Skipped>,
}

impl NoValidCertificate {
    /// The `reason` of `kubelet_ca_sync_errors_total` when certificates are there but none
    /// is valid now.
    pub const REASON: &'static str = "no_valid_certificate";
    /// The `reason` when the sources carry certificates but not one CA among them.
    pub const REASON_NO_CA: &'static str = "no_ca_certificate";

    /// Every certificate the sources carry was left out as not a CA: nothing is expired,
    /// there is just no signer.
    pub fn only_non_ca(&self) -> bool {
        self.total == 0 && self.expired.is_empty() && !self.not_ca.is_empty()
    }

    /// The `reason` label of `kubelet_ca_sync_errors_total`.
    pub fn reason(&self) -> &'static str {
        if self.only_non_ca() {
            Self::REASON_NO_CA
        } else {
            Self::REASON
        }
    }
}

/// At most this many certificates are named in one message; the rest are counted.
const NAMED_MAX: usize = 5;

fn describe(e: &NoValidCertificate) -> String {
    let not_ca = named(&e.not_ca, |s| (&s.certificate, format!("in {}", s.place())));
    if e.only_non_ca() {
        return format!(
            "the sources hold no CA certificate: every certificate in them was left out as not a CA (no basicConstraints CA:TRUE): {not_ca}; refusing to write an empty bundle: a source must carry the signers' CA certificates, not certificates they issued"
        );
    }
    let mut text = format!(
        "the merged bundle holds {} certificate(s) and none is valid now: refusing to write it",
        e.total
    );
    if !e.expired.is_empty() {
        let list = named(&e.expired, |c| {
            (c, format!("notAfter {}", crate::text::rfc3339(c.not_after)))
        });
        text.push_str(&format!("; expired: {list}"));
    }
    if !e.not_yet_valid.is_empty() {
        let list = named(&e.not_yet_valid, |c| {
            (
                c,
                format!("notBefore {}", crate::text::rfc3339(c.not_before)),
            )
        });
        text.push_str(&format!("; not valid yet: {list}"));
    }
    if !e.not_ca.is_empty() {
        text.push_str(&format!("; left out as not CAs: {not_ca}"));
    }
    text
}

/// What to say of a bundle that holds expired certificates beside valid ones (issue 34): each
/// named (subject, fingerprint, notAfter), and why it is a warning and not a failure. `None`
/// when none is expired at `now`. Names come from certificates: the caller escapes the text
/// where it shows it.
pub fn expired_warning(certificates: &[Certificate], now: i64) -> Option<String> {
    let expired: Vec<&Certificate> = certificates
        .iter()
        .filter(|c| c.is_expired_at(now))
        .collect();
    if expired.is_empty() {
        return None;
    }
    let list = named(&expired, |c| {
        (
            *c,
            format!("notAfter {}", crate::text::rfc3339(c.not_after)),
        )
    });
    Some(format!(
        "{} expired certificate(s) in the bundle: {list}; the kubelet ignores them while a valid one remains; the sources still carry them (rotate them out there, or set --drop-expired to leave them out)",
        expired.len()
    ))
}

/// `"CN" (sha256 0123456789ab, <detail>)` for each of the first few items (a certificate
/// and what to say of it), and how many more there are.
fn named<T>(items: &[T], each: impl Fn(&T) -> (&Certificate, String)) -> String {
    let mut parts: Vec<String> = items
        .iter()
        .take(NAMED_MAX)
        .map(|item| {
            let (c, detail) = each(item);
            let sha = c.fingerprint().short();
            format!("{:?} (sha256 {sha}, {detail})", c.display_name())
        })
        .collect();
    if items.len() > NAMED_MAX {
        parts.push(format!("and {} more", items.len() - NAMED_MAX));
    }
    parts.join(", ")
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
        // Each left-out certificate once, where it was first seen.
        let mut seen = HashSet::new();
        let not_ca = sources
            .iter()
            .flat_map(|s| s.not_ca.iter())
            .filter(|skipped| seen.insert(skipped.certificate.fingerprint()))
            .cloned()
            .collect();
        let (expired, not_yet_valid) = bundle
            .certificates
            .iter()
            .chain(&dropped_expired)
            .cloned()
            .partition(|c| c.is_expired_at(now));
        return Err(NoValidCertificate {
            total: bundle.len(),
            expired,
            not_yet_valid,
            not_ca,
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

    /// A self-signed certificate that is not a CA (basicConstraints CA:FALSE), valid from
    /// `not_before` to `not_after`.
    pub fn leaf(cn: &str, not_before: i64, not_after: i64) -> Certificate {
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, cn);
        params.distinguished_name = name;
        params.is_ca = IsCa::ExplicitNoCa;
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
    use super::test_certs::{self, ca, now};
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
    fn an_expired_certificate_beside_a_valid_one_is_named_in_a_warning() {
        const T: i64 = 1_798_761_600;
        let expired = ca(Some("old-signer"), None, T - 7200, T - 3600);
        let valid = ca(Some("new-signer"), None, T - 3600, T + 3600);
        assert_eq!(expired_warning(std::slice::from_ref(&valid), T), None);
        let warning = expired_warning(&[valid, expired.clone()], T).unwrap();
        assert!(
            warning.starts_with(&format!(
                "1 expired certificate(s) in the bundle: \"old-signer\" (sha256 {}, notAfter 2026-12-31T23:00:00Z)",
                expired.fingerprint().short()
            )),
            "{warning}"
        );
        assert!(warning.contains("--drop-expired"), "{warning}");
        assert!(!warning.contains("new-signer"), "{warning}");
    }

    #[test]
    fn a_merge_with_nothing_valid_now_is_refused_and_names_each_certificate_and_its_date() {
        const T: i64 = 1_798_761_600; // 2027-01-01T00:00:00Z
        let expired = ca(Some("expired"), None, T - 7200, T - 3600);
        let future = ca(Some("next"), None, T + 3600, T + 7200);
        let refused = build(
            &[source(vec![expired.clone(), future.clone()])],
            &[],
            Policy::default(),
            T,
        )
        .unwrap_err();
        assert_eq!(refused.total, 2);
        assert_eq!(refused.reason(), "no_valid_certificate");
        let text = refused.to_string();
        for needle in [
            "holds 2 certificate(s) and none is valid now",
            &format!(
                "expired: \"expired\" (sha256 {}, notAfter 2026-12-31T23:00:00Z)",
                expired.fingerprint().short()
            ),
            &format!(
                "not valid yet: \"next\" (sha256 {}, notBefore 2027-01-01T01:00:00Z)",
                future.fingerprint().short()
            ),
        ] {
            assert!(text.contains(needle), "{needle} not in {text}");
        }
        // Left out by --drop-expired, an expired signer is still what is named.
        let policy = Policy {
            drop_expired: true,
            ..Policy::default()
        };
        let refused = build(&[source(vec![expired])], &[], policy, T).unwrap_err();
        assert_eq!(refused.total, 0);
        assert_eq!(refused.reason(), "no_valid_certificate");
        assert!(
            refused.to_string().contains("expired: \"expired\""),
            "{refused}"
        );
    }

    #[test]
    fn sources_of_leaf_certificates_only_are_refused_as_holding_no_ca() {
        let now = now();
        let leaves: Vec<_> = (0..7)
            .map(|i| test_certs::leaf(&format!("leaf-{i}"), now - 60, now + 3600))
            .collect();
        let content = SourceCertificates {
            certificates: Vec::new(),
            not_ca: leaves
                .iter()
                .enumerate()
                .map(|(i, c)| parse::Skipped {
                    source: Some("file:/leaves.pem".to_string()),
                    part: None,
                    block: i + 1,
                    certificate: c.clone(),
                })
                .collect(),
        };
        let refused = build(&[content], &[], Policy::default(), now).unwrap_err();
        assert_eq!(refused.reason(), "no_ca_certificate");
        let text = refused.to_string();
        assert!(text.contains("no CA certificate"), "{text}");
        assert!(!text.contains("valid now"), "{text}");
        assert!(
            text.contains(&format!(
                "\"leaf-0\" (sha256 {}, in file:/leaves.pem block 1)",
                leaves[0].fingerprint().short()
            )),
            "{text}"
        );
        // A handful named, the rest counted.
        assert!(
            text.contains("\"leaf-4\"") && !text.contains("\"leaf-5\""),
            "{text}"
        );
        assert!(text.contains("and 2 more"), "{text}");
    }
}
