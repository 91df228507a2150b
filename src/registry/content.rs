//! A registry's `ca.crt`: its content checked by the rules of SPEC 4 (certificates only,
//! never a private key, whole blocks, at most 4 MiB, at least one certificate), through
//! [`parse_source`] itself, and rendered as the bundle is rendered.
//!
//! One rule differs, because a registry file is a trust anchor for the container runtime,
//! not a list of signers for the kubelet: a certificate that is not a CA is KEPT, with a
//! warning. It is very often the registry's own self-signed server certificate, which is
//! exactly what the runtime must trust to reach that registry; leaving it out would break
//! every pull from it.
//!
//! Expired (and not yet valid) certificates are kept too, with a warning, even when no
//! certificate in the file is valid now: unlike the kubelet's bundle, a registry file has
//! no other signer to fall back on, and a runtime that holds the registry's expired CA says
//! "certificate has expired", which sends the operator to the registry, where "unknown
//! authority" (what removing or not writing it would give) sends them hunting for a missing
//! file. Upstream writes whatever bytes it is given. `--drop-expired` is the kubelet
//! bundle's policy and does not apply here.

use std::collections::HashSet;
use std::fmt;

use crate::bundle::{Bundle, Certificate, Rejection, parse_source};

/// A registry's file, ready to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryFile {
    /// Standard PEM, one block per certificate, in the entry's order, duplicates dropped.
    pub bytes: Vec<u8>,
    /// The certificates in `bytes`, in order (for metrics and `inspect`).
    pub certificates: Vec<Certificate>,
    pub warnings: Vec<Warning>,
}

/// Something worth a log line and a mark in `inspect`, never a reason not to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// The 1-based block of the entry's content.
    pub block: usize,
    pub certificate: Certificate,
    pub kind: WarningKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarningKind {
    /// Not a CA (basicConstraints CA:TRUE missing): kept, as a registry's own certificate.
    NotCa,
    /// Past its notAfter: kept, so that the runtime's error names the expiry.
    Expired,
    /// Before its notBefore: kept, it will be needed.
    NotYetValid,
}

impl Warning {
    /// The `reason` label of the warnings counter.
    pub fn reason(&self) -> &'static str {
        match self.kind {
            WarningKind::NotCa => "not_ca",
            WarningKind::Expired => "expired",
            WarningKind::NotYetValid => "not_yet_valid",
        }
    }
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.certificate;
        write!(
            f,
            "block {}: {:?} (sha256 {}) ",
            self.block,
            c.display_name(),
            c.fingerprint().short()
        )?;
        match self.kind {
            WarningKind::NotCa => f.write_str(
                "is not a CA (no basicConstraints CA:TRUE): kept, as a registry's own server certificate is what the runtime must trust",
            ),
            WarningKind::Expired => write!(
                f,
                "expired at {}: kept, so that pulls fail on an expired certificate rather than an unknown authority",
                crate::text::rfc3339(c.not_after)
            ),
            WarningKind::NotYetValid => {
                write!(f, "is not valid before {}: kept", crate::text::rfc3339(c.not_before))
            }
        }
    }
}

/// Checks and renders one registry's content (see the module doc). `now` is unix seconds.
/// A rejection is the entry's alone: the caller keeps that registry's file as it is.
pub fn registry_file(content: &[u8], now: i64) -> Result<RegistryFile, Rejection> {
    let parsed = parse_source(content)?;
    // parse_source parts CA certificates from the rest; every block it accepted is a
    // certificate, so block `i` is the next non-CA one if that is where it was, else the
    // next CA one: the entry's own order, put back together.
    let total = parsed.certificates.len() + parsed.not_ca.len();
    let mut cas = parsed.certificates.into_iter();
    let mut not_ca = parsed.not_ca.into_iter().peekable();
    let mut seen = HashSet::new();
    let mut certificates = Vec::with_capacity(total);
    let mut warnings = Vec::new();
    for block in 1..=total {
        let (certificate, is_ca) = match not_ca.next_if(|skipped| skipped.block == block) {
            Some(skipped) => (skipped.certificate, false),
            None => (
                cas.next().expect("every accepted block is a certificate"),
                true,
            ),
        };
        // A duplicate is dropped, as the bundle drops it; it was warned about where it
        // first was.
        if !seen.insert(certificate.fingerprint()) {
            continue;
        }
        let mut warn = |kind| {
            warnings.push(Warning {
                block,
                certificate: certificate.clone(),
                kind,
            })
        };
        if !is_ca {
            warn(WarningKind::NotCa);
        }
        if certificate.is_expired_at(now) {
            warn(WarningKind::Expired);
        } else if now < certificate.not_before {
            warn(WarningKind::NotYetValid);
        }
        certificates.push(certificate);
    }
    let bytes = Bundle::from_certificates(certificates.iter().cloned()).render();
    Ok(RegistryFile {
        bytes,
        certificates,
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs::{ca, leaf, now};

    fn pem(certificates: &[&Certificate]) -> Vec<u8> {
        certificates.iter().flat_map(|c| c.pem().to_vec()).collect()
    }

    #[test]
    fn a_registrys_self_signed_server_certificate_is_kept_with_a_warning() {
        let now = now();
        let server = leaf("registry.local", now - 60, now + 86_400);
        let file = registry_file(&pem(&[&server]), now).unwrap();
        assert_eq!(file.bytes, server.pem());
        assert_eq!(file.certificates, std::slice::from_ref(&server));
        assert_eq!(file.warnings.len(), 1);
        assert_eq!(file.warnings[0].reason(), "not_ca");
        assert_eq!(
            file.warnings[0].to_string(),
            format!(
                "block 1: \"registry.local\" (sha256 {}) is not a CA (no basicConstraints CA:TRUE): kept, as a registry's own server certificate is what the runtime must trust",
                server.fingerprint().short()
            )
        );
    }

    #[test]
    fn certificates_keep_the_entrys_order_and_duplicates_go() {
        let now = now();
        let root = ca(Some("registry root"), None, now - 60, now + 86_400);
        let server = leaf("registry.local", now - 60, now + 86_400);
        let other = ca(Some("other root"), None, now - 60, now + 86_400);
        let input = pem(&[&server, &root, &server, &other, &root]);
        let file = registry_file(&input, now).unwrap();
        assert_eq!(
            file.certificates,
            [server.clone(), root.clone(), other.clone()]
        );
        assert_eq!(file.bytes, pem(&[&server, &root, &other]));
        // The repeated leaf is warned about once, at its first block.
        let warned: Vec<_> = file
            .warnings
            .iter()
            .map(|w| (w.block, w.reason()))
            .collect();
        assert_eq!(warned, [(1, "not_ca")]);
    }

    #[test]
    fn a_well_formed_entry_is_written_byte_for_byte_and_crlf_is_made_lf() {
        let now = now();
        let root = ca(Some("registry root"), None, now - 60, now + 86_400);
        let file = registry_file(root.pem(), now).unwrap();
        assert_eq!(file.bytes, root.pem());
        assert!(file.warnings.is_empty());
        let crlf = String::from_utf8(root.pem().to_vec())
            .unwrap()
            .replace('\n', "\r\n");
        let text = format!("# the registry's CA\r\n{crlf}");
        assert_eq!(
            registry_file(text.as_bytes(), now).unwrap().bytes,
            root.pem()
        );
    }

    #[test]
    fn an_expired_only_certificate_is_still_written_with_a_warning() {
        const T: i64 = 1_798_761_600; // 2027-01-01T00:00:00Z
        let expired = ca(Some("old registry root"), None, T - 7200, T - 3600);
        let future = ca(Some("next registry root"), None, T + 3600, T + 7200);
        let file = registry_file(&pem(&[&expired, &future]), T).unwrap();
        assert_eq!(file.bytes, pem(&[&expired, &future]));
        let text: Vec<_> = file.warnings.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                format!(
                    "block 1: \"old registry root\" (sha256 {}) expired at 2026-12-31T23:00:00Z: kept, so that pulls fail on an expired certificate rather than an unknown authority",
                    expired.fingerprint().short()
                ),
                format!(
                    "block 2: \"next registry root\" (sha256 {}) is not valid before 2027-01-01T01:00:00Z: kept",
                    future.fingerprint().short()
                ),
            ]
        );
    }

    #[test]
    fn every_other_rule_of_section_4_still_applies() {
        let now = now();
        let root = ca(Some("registry root"), None, now - 60, now + 86_400);
        let key = b"-----BEGIN PRIVATE KEY-----\nsecret\n-----END PRIVATE KEY-----\n";
        let with_key = [root.pem(), &key[..]].concat();
        let rejection = registry_file(&with_key, now).unwrap_err();
        assert_eq!(rejection.reason(), "private_key");
        assert!(!rejection.to_string().contains("secret"));
        let torn = &root.pem()[..root.pem().len() - 10];
        assert_eq!(
            registry_file(torn, now).unwrap_err().reason(),
            "malformed_pem"
        );
        // Nothing empty is ever written.
        for empty in [&b""[..], b"\n", b"just text\n"] {
            assert_eq!(
                registry_file(empty, now).unwrap_err(),
                Rejection::NoCertificate
            );
        }
        let huge = vec![b'#'; crate::bundle::MAX_SOURCE_BYTES + 1];
        assert_eq!(registry_file(&huge, now).unwrap_err().reason(), "too_large");
    }
}
