//! One signer certificate as the bundle sees it: its DER, its fingerprint, and the few
//! fields that logs, metrics and `inspect` show. Parsed once, then immutable.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use x509_parser::prelude::{FromDer, X509Certificate};

/// SHA-256 of a certificate's DER encoding: the identity used for dedup and diffs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn of(bytes: &[u8]) -> Self {
        Fingerprint(Sha256::digest(bytes).into())
    }

    pub fn to_hex(self) -> String {
        hex::encode(self.0)
    }

    /// The first 12 hex digits, enough to tell signers apart in a table or a log line.
    pub fn short(self) -> String {
        hex::encode(&self.0[..6])
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.short())
    }
}

/// Why a DER blob is not a usable certificate. The message never contains the bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertificateError {
    #[error("the DER does not parse as an X.509 certificate ({0})")]
    Unparsable(String),
    #[error("{0} bytes follow the certificate's DER encoding")]
    TrailingData(usize),
}

/// A parsed certificate. Cheap to clone: everything is shared behind one `Arc`.
#[derive(Clone, PartialEq, Eq)]
pub struct Certificate(Arc<Parsed>);

/// What the agent reads out of a certificate; reached through `Deref` on [`Certificate`].
#[derive(PartialEq, Eq)]
pub struct Parsed {
    der: Box<[u8]>,
    fingerprint: Fingerprint,
    pub subject_cn: String,
    pub subject_o: String,
    pub issuer_cn: String,
    pub issuer_o: String,
    /// Serial number in decimal, as the x509 certificate exporter labels it.
    pub serial: String,
    /// Unix seconds.
    pub not_before: i64,
    /// Unix seconds.
    pub not_after: i64,
    /// basicConstraints CA is true: the kubelet can verify clients with it.
    pub is_ca: bool,
}

impl std::ops::Deref for Certificate {
    type Target = Parsed;

    fn deref(&self) -> &Parsed {
        &self.0
    }
}

impl fmt::Debug for Certificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Certificate")
            .field("subject_cn", &self.subject_cn)
            .field("fingerprint", &self.fingerprint)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Certificate {
    pub fn from_der(der: &[u8]) -> Result<Self, CertificateError> {
        let (rest, cert) = X509Certificate::from_der(der)
            .map_err(|e| CertificateError::Unparsable(describe_x509_error(&e)))?;
        if !rest.is_empty() {
            return Err(CertificateError::TrailingData(rest.len()));
        }
        let is_ca = match cert.basic_constraints() {
            Ok(Some(ext)) => ext.value.ca,
            Ok(None) => false,
            Err(e) => {
                return Err(CertificateError::Unparsable(format!(
                    "basicConstraints: {e}"
                )));
            }
        };
        let validity = cert.validity();
        Ok(Certificate(Arc::new(Parsed {
            fingerprint: Fingerprint::of(der),
            subject_cn: join_attrs(cert.subject().iter_common_name()),
            subject_o: join_attrs(cert.subject().iter_organization()),
            issuer_cn: join_attrs(cert.issuer().iter_common_name()),
            issuer_o: join_attrs(cert.issuer().iter_organization()),
            serial: cert.tbs_certificate.serial.to_string(),
            not_before: validity.not_before.timestamp(),
            not_after: validity.not_after.timestamp(),
            is_ca,
            der: der.into(),
        })))
    }

    pub fn der(&self) -> &[u8] {
        &self.der
    }

    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// Valid at `now` (unix seconds): notBefore <= now <= notAfter, as RFC 5280 reads it.
    pub fn is_valid_at(&self, now: i64) -> bool {
        self.not_before <= now && now <= self.not_after
    }

    pub fn is_expired_at(&self, now: i64) -> bool {
        now > self.not_after
    }

    /// A name for humans: the subject CN, else the organization, else the short fingerprint.
    pub fn display_name(&self) -> String {
        if !self.subject_cn.is_empty() {
            self.subject_cn.clone()
        } else if !self.subject_o.is_empty() {
            format!("O={}", self.subject_o)
        } else {
            format!("sha256:{}", self.fingerprint.short())
        }
    }
}

fn join_attrs<'a>(
    attrs: impl Iterator<Item = &'a x509_parser::x509::AttributeTypeAndValue<'a>>,
) -> String {
    attrs
        .filter_map(|a| a.as_str().ok())
        .collect::<Vec<_>>()
        .join(",")
}

/// nom's error text can quote input; keep only the kind of failure.
fn describe_x509_error(e: &x509_parser::nom::Err<x509_parser::error::X509Error>) -> String {
    match e {
        x509_parser::nom::Err::Incomplete(_) => "truncated DER".to_string(),
        x509_parser::nom::Err::Error(e) | x509_parser::nom::Err::Failure(e) => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs::ca;

    const T: i64 = 1_900_000_000;

    #[test]
    fn valid_from_not_before_through_the_last_second_of_not_after() {
        let c = ca(Some("signer"), None, T - 100, T);
        assert!(!c.is_valid_at(T - 101));
        assert!(c.is_valid_at(T - 100));
        assert!(c.is_valid_at(T));
        assert!(!c.is_valid_at(T + 1));
        assert!(!c.is_expired_at(T - 100));
        assert!(!c.is_expired_at(T));
        assert!(c.is_expired_at(T + 1));
    }

    #[test]
    fn display_name_falls_back_to_the_organization_then_the_fingerprint() {
        let both = ca(Some("kube-csr-signer"), Some("openshift"), T - 100, T);
        assert_eq!(both.display_name(), "kube-csr-signer");
        assert_eq!(both.subject_o, "openshift");
        let organization = ca(None, Some("openshift"), T - 100, T);
        assert_eq!(organization.display_name(), "O=openshift");
        let anonymous = ca(None, None, T - 100, T);
        let hex = anonymous.fingerprint().to_hex();
        assert_eq!(anonymous.display_name(), format!("sha256:{}", &hex[..12]));
    }

    #[test]
    fn the_fingerprint_is_the_sha256_of_the_der_in_full_or_twelve_digits() {
        let c = ca(Some("signer"), None, T - 100, T);
        let hex = hex::encode(Sha256::digest(c.der()));
        assert_eq!(c.fingerprint().to_hex(), hex);
        assert_eq!(c.fingerprint().to_string(), hex);
        assert_eq!(c.fingerprint().short(), hex[..12]);
        assert_eq!(
            format!("{:?}", c.fingerprint()),
            format!("Fingerprint({})", &hex[..12])
        );
    }

    #[test]
    fn debug_output_names_the_certificate_without_its_der() {
        // Debug output can reach a log line: a name and a short fingerprint, never the
        // certificate itself (SPEC 7).
        let c = ca(Some("signer"), None, T - 100, T);
        let debug = format!("{c:?}");
        assert!(debug.contains("\"signer\""), "{debug}");
        assert!(debug.contains(&c.fingerprint().short()), "{debug}");
        assert!(!debug.contains(&hex::encode(c.der())), "{debug}");
        assert!(!debug.contains(&format!("{:?}", c.der())), "{debug}");
    }

    #[test]
    fn a_cut_der_is_unparsable_with_a_reason_and_no_bytes() {
        let c = ca(Some("signer"), None, T - 100, T);
        let cut = &c.der()[..c.der().len() / 2];
        match Certificate::from_der(cut) {
            // The parser's word for input that ends too soon, whichever way it says it.
            Err(CertificateError::Unparsable(reason)) => assert!(
                reason == "truncated DER" || reason.to_lowercase().contains("eof"),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
        let mut trailing = c.der().to_vec();
        trailing.extend_from_slice(&[0, 0]);
        assert_eq!(
            Certificate::from_der(&trailing).unwrap_err(),
            CertificateError::TrailingData(2)
        );
    }
}
