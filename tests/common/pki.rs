//! Signers and client certificates made at run time, with validity relative to now.

use std::process::Command;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SignatureAlgorithm,
};
use time::{Duration, OffsetDateTime};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Rsa,
    P256,
    P384,
    Ed25519,
}

pub const ALL_ALGORITHMS: [Algorithm; 4] = [
    Algorithm::Rsa,
    Algorithm::P256,
    Algorithm::P384,
    Algorithm::Ed25519,
];

fn key_pair(algorithm: Algorithm) -> KeyPair {
    let alg: &'static SignatureAlgorithm = match algorithm {
        Algorithm::P256 => &rcgen::PKCS_ECDSA_P256_SHA256,
        Algorithm::P384 => &rcgen::PKCS_ECDSA_P384_SHA384,
        Algorithm::Ed25519 => &rcgen::PKCS_ED25519,
        Algorithm::Rsa => {
            // ring signs with RSA but does not generate RSA keys: openssl makes the key.
            let out = Command::new("openssl")
                .args([
                    "genpkey",
                    "-algorithm",
                    "RSA",
                    "-pkeyopt",
                    "rsa_keygen_bits:2048",
                ])
                .output()
                .expect("openssl genpkey");
            assert!(out.status.success(), "openssl genpkey failed");
            let pem = String::from_utf8(out.stdout).unwrap();
            return KeyPair::from_pem_and_sign_algo(&pem, &rcgen::PKCS_RSA_SHA256).unwrap();
        }
    };
    KeyPair::generate_for(alg).unwrap()
}

fn name(cn: &str, o: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    if let Some(o) = o {
        dn.push(DnType::OrganizationName, o);
    }
    dn
}

/// A CA certificate and its key: one signer of the kubelet's client CA bundle.
pub struct Signer {
    pub cn: String,
    pub cert: rcgen::Certificate,
    issuer: Issuer<'static, KeyPair>,
}

impl Signer {
    /// A CA valid from an hour ago for a year.
    pub fn new(cn: &str, algorithm: Algorithm) -> Signer {
        Signer::valid_between(cn, algorithm, Duration::hours(-1), Duration::days(365))
    }

    /// A CA valid from `now + from` to `now + to`.
    pub fn valid_between(cn: &str, algorithm: Algorithm, from: Duration, to: Duration) -> Signer {
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name = name(cn, Some("kubelet-ca-agent tests"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = now + from;
        params.not_after = now + to;
        let key = key_pair(algorithm);
        let cert = params.self_signed(&key).unwrap();
        Signer {
            cn: cn.to_string(),
            cert,
            issuer: Issuer::new(params, key),
        }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    pub fn der(&self) -> Vec<u8> {
        self.cert.der().to_vec()
    }

    /// A client certificate (clientAuth) for `cn`, signed by this signer; (cert, key) PEM.
    pub fn issue_client(&self, cn: &str) -> (String, String) {
        let mut params = CertificateParams::default();
        params.distinguished_name = name(cn, Some("system:masters"));
        params.is_ca = IsCa::ExplicitNoCa;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + Duration::days(30);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A client certificate for user `cn` in `groups` (its O values), valid from `now + from`
    /// to `now + to`; (cert, key) PEM.
    pub fn issue_client_with(
        &self,
        cn: &str,
        groups: &[&str],
        from: Duration,
        to: Duration,
    ) -> (String, String) {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, cn);
        for group in groups {
            dn.push(DnType::OrganizationName, *group);
        }
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now + from;
        params.not_after = now + to;
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A serving certificate for `names` (DNS names or IP addresses); (cert, key) PEM.
    pub fn issue_server(&self, names: &[&str]) -> (String, String) {
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name = name(names[0], None);
        params.is_ca = IsCa::ExplicitNoCa;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + Duration::days(30);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// The signer's private key, PEM: to feed as a bad input.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }
}

/// A self-signed certificate that is not a CA (basicConstraints CA:FALSE).
pub fn leaf(cn: &str) -> String {
    let mut params = CertificateParams::default();
    params.distinguished_name = name(cn, None);
    params.is_ca = IsCa::ExplicitNoCa;
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    params.self_signed(&key).unwrap().pem()
}

/// `n` distinct P-256 signers' PEM concatenated: a bundle of `n` certificates.
pub fn bundle_of(n: usize, prefix: &str) -> String {
    (0..n)
        .map(|i| Signer::new(&format!("{prefix}-{i}"), Algorithm::P256).pem())
        .collect()
}
