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
