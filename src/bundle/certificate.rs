//! One signer certificate as the bundle sees it: its PEM block, its fingerprint, and the
//! few fields that logs, metrics and `inspect` show. Parsed once, then immutable.
//!
//! The canonical PEM block (what the bundle file holds) is kept rather than the DER: a
//! bundle is rendered by concatenating blocks, and a block that arrived canonical is kept
//! as it came, so most certificates are never base64-encoded again.

use std::fmt;
use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use sha2::{Digest, Sha256};
use x509_parser::certificate::X509CertificateParser;
use x509_parser::extensions::BasicConstraints;
use x509_parser::nom::Parser;
use x509_parser::oid_registry::{
    OID_X509_COMMON_NAME, OID_X509_EXT_BASIC_CONSTRAINTS, OID_X509_ORGANIZATION_NAME,
};
use x509_parser::prelude::FromDer;
use x509_parser::x509::X509Name;

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
    /// The canonical PEM block: BEGIN line, base64 in 64 columns, END line, each ending LF.
    pem: Box<[u8]>,
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

/// The armor lines of a canonical CERTIFICATE block, each with its LF.
pub(crate) const PEM_BEGIN: &[u8] = b"-----BEGIN CERTIFICATE-----\n";
pub(crate) const PEM_END: &[u8] = b"-----END CERTIFICATE-----\n";
/// Base64 characters per line of a canonical block (48 bytes of DER).
pub(crate) const PEM_COLUMNS: usize = 64;

impl Certificate {
    pub fn from_der(der: &[u8]) -> Result<Self, CertificateError> {
        Self::from_der_and_pem(der, None)
    }

    /// [`Certificate::from_der`], given the canonical PEM block of `der` when the caller
    /// already holds it (a block read in canonical form), so that it is not encoded again.
    /// `pem` must be exactly what [`canonical_pem`] makes of `der`.
    pub(crate) fn from_der_and_pem(
        der: &[u8],
        pem: Option<Vec<u8>>,
    ) -> Result<Self, CertificateError> {
        // Extensions are not parsed one by one (what x509-parser calls deep parsing): only
        // basicConstraints is read, below. Deep parsing never rejects a certificate (an
        // extension that does not parse is kept as a parse error), so this accepts and
        // rejects exactly the same certificates, for less work.
        let (rest, cert) = X509CertificateParser::new()
            .with_deep_parse_extensions(false)
            .parse(der)
            .map_err(|e| CertificateError::Unparsable(describe_x509_error(&e)))?;
        if !rest.is_empty() {
            return Err(CertificateError::TrailingData(rest.len()));
        }
        let is_ca = match cert
            .tbs_certificate
            .get_extension_unique(&OID_X509_EXT_BASIC_CONSTRAINTS)
        {
            // As with deep parsing: a basicConstraints that does not parse counts as absent.
            Ok(Some(ext)) => BasicConstraints::from_der(ext.value).is_ok_and(|(_, bc)| bc.ca),
            Ok(None) => false,
            Err(e) => {
                return Err(CertificateError::Unparsable(format!(
                    "basicConstraints: {e}"
                )));
            }
        };
        let validity = cert.validity();
        let pem = pem.unwrap_or_else(|| canonical_pem(der)).into_boxed_slice();
        let (subject_cn, subject_o) = cn_and_o(cert.subject());
        // A CA certificate is mostly self-issued: the same name read once.
        let (issuer_cn, issuer_o) = if cert.issuer().as_raw() == cert.subject().as_raw() {
            (subject_cn.clone(), subject_o.clone())
        } else {
            cn_and_o(cert.issuer())
        };
        Ok(Certificate(Arc::new(Parsed {
            fingerprint: Fingerprint::of(der),
            subject_cn,
            subject_o,
            issuer_cn,
            issuer_o,
            serial: serial_decimal(cert.tbs_certificate.raw_serial(), || {
                cert.tbs_certificate.serial.to_string()
            }),
            not_before: validity.not_before.timestamp(),
            not_after: validity.not_after.timestamp(),
            is_ca,
            pem,
        })))
    }

    /// The DER encoding, decoded from the PEM block kept.
    pub fn der(&self) -> Vec<u8> {
        let payload: Vec<u8> = self.pem[PEM_BEGIN.len()..self.pem.len() - PEM_END.len()]
            .iter()
            .copied()
            .filter(|&b| b != b'\n')
            .collect();
        STANDARD
            .decode(payload)
            .expect("a kept PEM block is canonical base64")
    }

    /// The canonical PEM block, as the bundle file holds it.
    pub fn pem(&self) -> &[u8] {
        &self.pem
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

/// Standard PEM of one certificate: a CERTIFICATE block, base64 in 64 columns, LF endings.
pub(crate) fn canonical_pem(der: &[u8]) -> Vec<u8> {
    let base64_len = der.len().div_ceil(3) * 4;
    let lines = base64_len.div_ceil(PEM_COLUMNS);
    let mut out = Vec::with_capacity(PEM_BEGIN.len() + base64_len + lines + PEM_END.len());
    out.extend_from_slice(PEM_BEGIN);
    let mut line = [0u8; PEM_COLUMNS];
    // 48 bytes of DER make one full line; only the last chunk can be shorter.
    for chunk in der.chunks(PEM_COLUMNS / 4 * 3) {
        let written = STANDARD
            .encode_slice(chunk, &mut line)
            .expect("48 bytes fit in 64 base64 characters");
        out.extend_from_slice(&line[..written]);
        out.push(b'\n');
    }
    out.extend_from_slice(PEM_END);
    out
}

/// The common names and the organizations of `name` that are text, each joined by commas,
/// in one walk over its attributes.
fn cn_and_o(name: &X509Name<'_>) -> (String, String) {
    let (mut cn, mut o) = (Joined::default(), Joined::default());
    for attribute in name.iter_attributes() {
        let joined = match attribute.attr_type() {
            t if *t == OID_X509_COMMON_NAME => &mut cn,
            t if *t == OID_X509_ORGANIZATION_NAME => &mut o,
            _ => continue,
        };
        if let Ok(text) = attribute.as_str() {
            joined.push(text);
        }
    }
    (cn.text, o.text)
}

/// Text pieces joined by commas (an empty piece counts too).
#[derive(Default)]
struct Joined {
    text: String,
    pieces: usize,
}

impl Joined {
    fn push(&mut self, piece: &str) {
        if self.pieces > 0 {
            self.text.push(',');
        }
        self.text.push_str(piece);
        self.pieces += 1;
    }
}

/// The serial number in decimal, read as an unsigned big-endian integer (as x509-parser
/// reads it): directly when it fits in 128 bits (RFC 5280 allows 20 bytes, CAs mostly use
/// 16 or fewer), else by `big`.
fn serial_decimal(raw: &[u8], big: impl FnOnce() -> String) -> String {
    match raw.len() {
        0..=16 => {
            let mut bytes = [0u8; 16];
            bytes[16 - raw.len()..].copy_from_slice(raw);
            u128::from_be_bytes(bytes).to_string()
        }
        _ => big(),
    }
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

    /// An intermediate CA (signed by another) names its issuer apart from its subject; a
    /// self-issued one has them equal.
    #[test]
    fn the_issuer_of_an_intermediate_is_its_signer_not_itself() {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let params = |cn: &str, o: &str| {
            let mut p = CertificateParams::default();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.distinguished_name.push(DnType::OrganizationName, o);
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p
        };
        let root_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let root = params("kube-control-plane-signer", "openshift");
        let root_der = root.self_signed(&root_key).unwrap().der().to_vec();
        let issuer = Issuer::new(root, root_key);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let intermediate = params("kube-csr-signer", "kube")
            .signed_by(&key, &issuer)
            .unwrap();
        let c = Certificate::from_der(intermediate.der()).unwrap();
        assert_eq!(
            (c.subject_cn.as_str(), c.subject_o.as_str()),
            ("kube-csr-signer", "kube")
        );
        assert_eq!(
            (c.issuer_cn.as_str(), c.issuer_o.as_str()),
            ("kube-control-plane-signer", "openshift")
        );
        let r = Certificate::from_der(&root_der).unwrap();
        assert_eq!(r.issuer_cn, "kube-control-plane-signer");
        assert_eq!(r.issuer_o, "openshift");
    }

    /// Only CN and O make the names the metrics show; OU, C, L and the others do not leak
    /// into them. Several O values are joined in order.
    #[test]
    fn subject_organization_is_the_o_values_only() {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let mut p = CertificateParams::default();
        p.distinguished_name.push(DnType::CountryName, "DE");
        p.distinguished_name
            .push(DnType::OrganizationName, "openshift");
        p.distinguished_name
            .push(DnType::OrganizationalUnitName, "node-signers");
        p.distinguished_name.push(DnType::LocalityName, "Berlin");
        p.distinguished_name
            .push(DnType::CommonName, "kube-csr-signer");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let c = Certificate::from_der(p.self_signed(&key).unwrap().der()).unwrap();
        assert_eq!(c.subject_cn, "kube-csr-signer");
        assert_eq!(c.subject_o, "openshift");
        assert_eq!(c.issuer_o, "openshift");
    }

    /// Several values of one attribute (O) are joined by commas, in order, empty ones too.
    #[test]
    fn values_join_by_commas_in_order() {
        let mut joined = Joined::default();
        assert_eq!(joined.text, "");
        for piece in ["openshift", "", "kube"] {
            joined.push(piece);
        }
        assert_eq!(joined.text, "openshift,,kube");
    }

    /// Serial numbers in decimal, as x509-parser's big integer prints them, at every length
    /// a CA uses (1 to 20 bytes).
    #[test]
    fn serials_print_in_decimal() {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SerialNumber};
        use x509_parser::prelude::FromDer;
        for len in [1usize, 2, 8, 15, 16, 17, 20] {
            let serial: Vec<u8> = (0..len).map(|i| 0x11 + (i as u8) * 7).collect();
            let mut p = CertificateParams::default();
            p.serial_number = Some(SerialNumber::from_slice(&serial));
            p.distinguished_name.push(DnType::CommonName, "signer");
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
            let der = p.self_signed(&key).unwrap().der().to_vec();
            let (_, parsed) = x509_parser::certificate::X509Certificate::from_der(&der).unwrap();
            let c = Certificate::from_der(&der).unwrap();
            assert_eq!(c.serial, parsed.serial.to_string(), "{len}-byte serial");
        }
    }

    /// The canonical block is sized up front: one allocation of exactly its length, whatever
    /// the DER's length modulo 3 and 48.
    #[test]
    fn a_canonical_block_is_allocated_once_at_its_exact_size() {
        let der = ca(Some("signer"), None, T - 100, T).der();
        for cut in [0, 1, 2, 47, 48, 49] {
            let der = &der[..der.len() - cut];
            let pem = canonical_pem(der);
            assert_eq!(pem.capacity(), pem.len(), "DER of {} bytes", der.len());
            let text = std::str::from_utf8(&pem).unwrap();
            assert!(text.lines().all(|l| l.len() <= 64), "{text}");
        }
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
