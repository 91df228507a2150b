//! Signer bundles shaped like real ones, for the benchmarks: mostly RSA-2048 (what
//! kube-apiserver, the OpenShift operators and kubeadm make), some P-256 and P-384.
//!
//! ring signs with RSA but cannot generate RSA keys, and openssl takes tens of milliseconds
//! per 2048-bit key, so a pool of a few dozen RSA keys is made once and each certificate is a
//! distinct self-signed CA certificate (its own subject, serial and validity) over a key
//! from the pool. Parsing cost follows the key type and size, not the key's uniqueness.
//! Dates are relative to now, so nothing here can expire.

use std::process::{Command, Stdio};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
    SerialNumber,
};
use sha2::{Digest, Sha256};
use time::{Duration, OffsetDateTime};

/// The key type of the certificate at `index`: of every 20, 16 RSA-2048, 3 P-256 and
/// 1 P-384, interleaved so that a 10-certificate bundle holds all three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    Rsa2048,
    P256,
    P384,
}

pub fn key_type(index: usize) -> KeyType {
    match index % 20 {
        5 | 12 | 18 => KeyType::P256,
        9 => KeyType::P384,
        _ => KeyType::Rsa2048,
    }
}

/// Keys to sign with.
pub struct KeyPool {
    rsa: Vec<KeyPair>,
    p256: Vec<KeyPair>,
    p384: Vec<KeyPair>,
}

impl KeyPool {
    /// `rsa` RSA-2048 keys from openssl (all generated at once, in parallel processes),
    /// and a few EC keys from ring.
    pub fn new(rsa: usize) -> KeyPool {
        let children: Vec<_> = (0..rsa.max(1))
            .map(|_| {
                Command::new("openssl")
                    .args([
                        "genpkey",
                        "-algorithm",
                        "RSA",
                        "-pkeyopt",
                        "rsa_keygen_bits:2048",
                    ])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("openssl is installed (it makes the RSA keys)")
            })
            .collect();
        let rsa = children
            .into_iter()
            .map(|child| {
                let out = child.wait_with_output().expect("openssl genpkey");
                assert!(out.status.success(), "openssl genpkey failed");
                let pem = String::from_utf8(out.stdout).unwrap();
                KeyPair::from_pem_and_sign_algo(&pem, &rcgen::PKCS_RSA_SHA256).unwrap()
            })
            .collect();
        let ec = |alg| {
            (0..4)
                .map(|_| KeyPair::generate_for(alg).unwrap())
                .collect()
        };
        KeyPool {
            rsa,
            p256: ec(&rcgen::PKCS_ECDSA_P256_SHA256),
            p384: ec(&rcgen::PKCS_ECDSA_P384_SHA384),
        }
    }

    /// `n` distinct CA certificates, PEM each, named `{prefix}-{i}`.
    pub fn certificates(&self, n: usize, prefix: &str) -> Vec<String> {
        let now = OffsetDateTime::now_utc();
        (0..n)
            .map(|i| {
                let cn = format!("{prefix}-signer-{i}@{}", now.unix_timestamp());
                let mut name = DistinguishedName::new();
                name.push(DnType::CommonName, cn.as_str());
                name.push(DnType::OrganizationName, "kubelet-ca-agent benchmarks");
                let mut params = CertificateParams::default();
                params.distinguished_name = name;
                params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
                params.key_usages = vec![
                    KeyUsagePurpose::KeyCertSign,
                    KeyUsagePurpose::CrlSign,
                    KeyUsagePurpose::DigitalSignature,
                ];
                // A 16-byte positive serial, distinct per certificate.
                let mut serial = Sha256::digest(cn.as_bytes())[..16].to_vec();
                serial[0] &= 0x7f;
                params.serial_number = Some(SerialNumber::from_slice(&serial));
                params.not_before = now - Duration::hours(1) - Duration::minutes(i as i64);
                params.not_after = now + Duration::days(30 + (i % 700) as i64);
                let key = match key_type(i) {
                    KeyType::Rsa2048 => &self.rsa[i % self.rsa.len()],
                    KeyType::P256 => &self.p256[i % self.p256.len()],
                    KeyType::P384 => &self.p384[i % self.p384.len()],
                };
                params.self_signed(key).unwrap().pem()
            })
            .collect()
    }

    /// A bundle of `n` distinct CA certificates, PEM concatenated.
    #[allow(dead_code)] // not every benchmark uses it
    pub fn bundle(&self, n: usize, prefix: &str) -> String {
        self.certificates(n, prefix).concat()
    }
}
