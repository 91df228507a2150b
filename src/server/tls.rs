//! TLS for the endpoint, through rustls (the process's one provider, ring).
//!
//! The configuration comes in generations: each reload of the serving certificate or the
//! client CA builds a new `ServerConfig`, with a session cache of its own, so that no TLS
//! session is resumed across a change, and the CA names offered in the handshake are those
//! of the current CA. A client certificate is not judged in the handshake: the handshake
//! proves the client holds the key, and each request is then checked against the CA of the
//! moment. So a certificate from a removed signer is refused at once, even on a connection
//! kept alive from before, and a bad certificate gets an HTTP 401 that says why, rather than
//! a TLS alert that a scraper reports as "connection reset".

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Context;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ServerSessionMemoryCache, WebPkiClientVerifier};
use rustls::{
    DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme,
};

use super::identity::Identity;
use crate::config::TlsVersion;

/// Where the endpoint's TLS material comes from.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--tls-cert-file` and `--tls-private-key-file`; `None`: a self-signed certificate.
    pub serving: Option<(PathBuf, PathBuf)>,
    pub client_ca: Option<PathBuf>,
    /// The client CA is the managed bundle: until the agent has written it, its absence
    /// refuses client certificates (with the reason) rather than stopping the agent.
    pub client_ca_is_bundle: bool,
    pub min_version: TlsVersion,
}

/// One generation of the configuration.
pub struct Generation {
    pub config: Arc<ServerConfig>,
    /// The client CA, to check each request's certificate against; or why there is none.
    clients: Result<Arc<dyn ClientCertVerifier>, String>,
    /// How many certificates the client CA holds, for the log.
    pub client_cas: usize,
}

/// A client may present at most this many certificates: its own and up to three
/// intermediates. Path building tries every order of what it is given, so a chain of
/// look-alike "intermediates" costs work that grows with their number; Go bounds its chain
/// building for the same reason. Real client chains are one or two certificates long.
pub const MAX_CLIENT_CHAIN: usize = 4;

impl Generation {
    /// The identity a client certificate chain proves at `now` (unix seconds): its last CN
    /// the user (as Go and Kubernetes read a subject), its O values the groups. `Err` says
    /// why it proves nothing (no client CA, an unknown signer, expired, ...), in words safe
    /// to show the client. With the verdict comes the instant until which it holds (the
    /// leaf's notAfter; for a certificate not valid yet, its notBefore).
    fn identify(
        &self,
        chain: &[CertificateDer<'static>],
        now: i64,
    ) -> (Result<Identity, String>, i64) {
        if chain.len() > MAX_CLIENT_CHAIN {
            let why = format!(
                "the client presented {} certificates; at most {MAX_CLIENT_CHAIN} are accepted (its own and three intermediates)",
                chain.len()
            );
            return (Err(why), i64::MAX);
        }
        let Some((end_entity, intermediates)) = chain.split_first() else {
            return (Err("no client certificate".into()), i64::MAX);
        };
        let (not_before, not_after) = validity(end_entity);
        let until = if not_before > now {
            not_before
        } else if now >= not_after {
            // Expired stays expired: no need to look again.
            i64::MAX
        } else {
            not_after
        };
        let verdict = match &self.clients {
            Err(why) => Err(why.clone()),
            Ok(verifier) => {
                let at =
                    UnixTime::since_unix_epoch(std::time::Duration::from_secs(now.max(0) as u64));
                match verifier.verify_client_cert(end_entity, intermediates, at) {
                    Ok(_) => Identity::of_certificate(end_entity),
                    Err(e) => Err(format!("the client certificate is not valid: {e}")),
                }
            }
        };
        (verdict, until)
    }
}

/// A certificate's notBefore and notAfter, unix seconds; one that does not parse is judged
/// by the verifier, and its verdict holds for good.
fn validity(der: &CertificateDer<'_>) -> (i64, i64) {
    use x509_parser::prelude::FromDer;
    match x509_parser::certificate::X509Certificate::from_der(der) {
        Ok((_, cert)) => (
            cert.validity().not_before.timestamp(),
            cert.validity().not_after.timestamp(),
        ),
        Err(_) => (i64::MIN, i64::MAX),
    }
}

/// A connection's client certificates and the verdict on them, kept for the life of the
/// connection: verified once, and again only when the client CA changed (a new generation)
/// or the verdict's time ran out. A client that sends request after request on one
/// connection costs one verification, not one per request.
#[derive(Clone, Default)]
pub struct PeerChain {
    chain: Arc<Vec<CertificateDer<'static>>>,
    verdict: Arc<std::sync::Mutex<Option<Verdict>>>,
}

struct Verdict {
    generation: Arc<Generation>,
    until: i64,
    identity: Result<Identity, String>,
}

impl PeerChain {
    pub fn new(chain: Vec<CertificateDer<'static>>) -> PeerChain {
        PeerChain {
            chain: Arc::new(chain),
            verdict: Arc::default(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.chain.is_empty()
    }

    /// The identity the chain proves now, under the current generation of `tls`.
    pub fn identify(&self, tls: &Tls) -> Result<Identity, String> {
        let generation = tls.current();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let mut verdict = self
            .verdict
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(known) = verdict.as_ref()
            && Arc::ptr_eq(&known.generation, &generation)
            && now < known.until
        {
            return known.identity.clone();
        }
        let (identity, until) = generation.identify(&self.chain, now);
        *verdict = Some(Verdict {
            generation,
            until,
            identity: identity.clone(),
        });
        identity
    }
}

/// The current generation, and how to make the next.
pub struct Tls {
    settings: Settings,
    /// The serving certificate and key in use: the self-signed pair, or the last pair read
    /// from the files that went together. Kept so that the client CA can follow its file
    /// while the serving files are broken.
    serving: std::sync::Mutex<Serving>,
    current: RwLock<Arc<Generation>>,
}

type Serving = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// Loads everything once; a problem here is a configuration error.
    pub fn load(settings: Settings, names: &[String]) -> anyhow::Result<Tls> {
        let serving = match &settings.serving {
            Some(files) => read_serving(files)?,
            None => self_signed(names)?,
        };
        let first = build(&settings, &serving)?;
        Ok(Tls {
            settings,
            serving: std::sync::Mutex::new(serving),
            current: RwLock::new(Arc::new(first)),
        })
    }

    pub fn current(&self) -> Arc<Generation> {
        self.current.read().expect("tls lock").clone()
    }

    /// The files whose change calls for a reload.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = self
            .settings
            .serving
            .iter()
            .flat_map(|(c, k)| [c.clone(), k.clone()])
            .collect();
        files.extend(self.settings.client_ca.clone());
        files
    }

    pub fn client_ca(&self) -> Option<&Path> {
        self.settings.client_ca.as_deref()
    }

    /// Builds the next generation from the files as they are now. Serving files that
    /// cannot be used (half written, a key that is not the certificate's) keep the previous
    /// serving certificate, and the error says which file and why; the client CA follows
    /// its file all the same, so a signer removed from it is refused at once. A client CA
    /// that cannot be read keeps the current generation whole.
    pub fn reload(&self) -> anyhow::Result<()> {
        let mut serving = self
            .serving
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let fresh = self.settings.serving.as_ref().map(read_serving);
        let (next, serving_problem) = match fresh {
            Some(Ok(pair)) => match build(&self.settings, &pair) {
                Ok(next) => {
                    *serving = pair;
                    (next, None)
                }
                Err(e) => (build(&self.settings, &serving)?, Some(e)),
            },
            Some(Err(e)) => (build(&self.settings, &serving)?, Some(e)),
            None => (build(&self.settings, &serving)?, None),
        };
        drop(serving);
        let cas = next.client_cas;
        let before = self.current().client_cas;
        *self.current.write().expect("tls lock") = Arc::new(next);
        tracing::info!(
            client_cas = cas,
            previous_client_cas = before,
            "TLS configuration reloaded"
        );
        match serving_problem {
            Some(e) => Err(e.context(
                "the serving certificate was not reloaded (the previous one is served; the client CA was reloaded)",
            )),
            None => Ok(()),
        }
    }
}

/// The serving certificate and key from their files, checked to go together.
fn read_serving((cert, key): &(PathBuf, PathBuf)) -> anyhow::Result<Serving> {
    let (chain, key) = (read_chain(cert)?, read_key(key)?);
    let signing = provider()
        .key_provider
        .load_private_key(key.clone_key())
        .context("the serving key is of a kind that cannot be used")?;
    rustls::sign::CertifiedKey::new(chain.clone(), signing)
        .keys_match()
        .context("the serving certificate and key do not go together")?;
    Ok((chain, key))
}

fn build(settings: &Settings, (chain, key): &Serving) -> anyhow::Result<Generation> {
    let (chain, key) = (chain.clone(), key.clone_key());
    let versions: &[&'static rustls::SupportedProtocolVersion] = match settings.min_version {
        TlsVersion::V1_2 => &[&rustls::version::TLS13, &rustls::version::TLS12],
        TlsVersion::V1_3 => &[&rustls::version::TLS13],
    };
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(versions)
        .context("the TLS protocol versions")?;
    let roots = settings.client_ca.as_deref().map(read_roots);
    let (builder, clients, client_cas) = match roots {
        Some(Ok(roots)) => {
            let count = roots.len();
            let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .allow_unauthenticated()
                .build()
                .context("the client CA")?;
            let lenient = Arc::new(Lenient(inner.clone()));
            (builder.with_client_cert_verifier(lenient), Ok(inner), count)
        }
        Some(Err(e)) if settings.client_ca_is_bundle => {
            tracing::warn!("client certificates are refused until the bundle is written: {e:#}");
            let why = format!("the client CA is not usable yet: {e:#}");
            (builder.with_no_client_auth(), Err(why), 0)
        }
        Some(Err(e)) => return Err(e),
        None => (
            builder.with_no_client_auth(),
            Err("client certificates are not accepted here (no --client-ca-file)".to_string()),
            0,
        ),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .context("the serving certificate and key do not go together")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    // A session cache of this generation's own: nothing resumes across a reload.
    config.session_storage = ServerSessionMemoryCache::new(256);
    Ok(Generation {
        config: Arc::new(config),
        clients,
        client_cas,
    })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_chain(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let chain = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("--tls-cert-file {}", path.display()))?;
    anyhow::ensure!(
        !chain.is_empty(),
        "--tls-cert-file {} holds no certificate",
        path.display()
    );
    Ok(chain)
}

fn read_key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    // The error never carries the key's bytes: only the path and what is wrong.
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        anyhow::anyhow!(
            "--tls-private-key-file {}: no usable private key ({})",
            path.display(),
            key_problem(&e)
        )
    })
}

fn key_problem(e: &rustls::pki_types::pem::Error) -> &'static str {
    use rustls::pki_types::pem::Error;
    match e {
        Error::NoItemsFound => "no PRIVATE KEY block",
        Error::Io(_) => "cannot read the file",
        _ => "malformed PEM",
    }
}

/// The client CA: every certificate of the file. One that does not parse is skipped by
/// rustls; a file with none usable is an error.
fn read_roots(path: &Path) -> anyhow::Result<RootCertStore> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("--client-ca-file {}", path.display()))?;
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    anyhow::ensure!(
        added > 0,
        "--client-ca-file {} holds no usable CA certificate",
        path.display()
    );
    Ok(roots)
}

/// An in-memory self-signed certificate for `names` (and the loopback addresses).
fn self_signed(
    names: &[String],
) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let mut all: Vec<String> = names.to_vec();
    all.extend([
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ]);
    all.dedup();
    let certified = rcgen::generate_simple_self_signed(all)
        .context("cannot make a self-signed serving certificate")?;
    let key = PrivateKeyDer::try_from(certified.signing_key.serialize_der())
        .map_err(|e| anyhow::anyhow!("the self-signed key: {e}"))?;
    Ok((vec![certified.cert.der().clone()], key))
}

/// Completes the handshake whatever the client certificate: the signatures that prove the
/// client holds its key are checked as usual, the chain is judged per request
/// ([`Generation::identify`]).
#[derive(Debug)]
struct Lenient(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for Lenient {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

    use super::*;

    fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), Issuer::new(params, key))
    }

    fn client(issuer: &Issuer<'_, KeyPair>, cn: &str) -> CertificateDer<'static> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        params.signed_by(&key, issuer).unwrap().der().clone()
    }

    fn tls_trusting(dir: &Path, pems: &[&str]) -> Tls {
        let file = dir.join("client-ca.crt");
        std::fs::write(&file, pems.concat()).unwrap();
        let settings = Settings {
            serving: None,
            client_ca: Some(file),
            client_ca_is_bundle: false,
            min_version: TlsVersion::V1_2,
        };
        Tls::load(settings, &["127.0.0.1".to_string()]).unwrap()
    }

    #[test]
    fn a_connection_keeps_its_verdict_until_the_client_ca_changes() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let (old_pem, old) = ca("old-signer");
        let (new_pem, _) = ca("new-signer");
        let tls = tls_trusting(dir.path(), &[&old_pem, &new_pem]);
        let peer = PeerChain::new(vec![client(&old, "scraper")]);
        assert_eq!(peer.identify(&tls).unwrap().user, "scraper");
        assert_eq!(peer.identify(&tls).unwrap().user, "scraper");
        // The signer leaves the client CA: the same connection is refused at once.
        std::fs::write(dir.path().join("client-ca.crt"), &new_pem).unwrap();
        tls.reload().unwrap();
        let refused = peer.identify(&tls).unwrap_err();
        assert!(refused.contains("not valid"), "{refused}");
    }

    #[test]
    fn a_long_chain_is_refused_by_its_length_alone() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let (pem, signer) = ca("signer");
        let tls = tls_trusting(dir.path(), &[&pem]);
        let leaf = client(&signer, "scraper");
        // Look-alike "intermediates" sharing one subject.
        let lookalikes: Vec<_> = (0..MAX_CLIENT_CHAIN)
            .map(|_| {
                let (pem, _) = ca("intermediate");
                CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
            })
            .collect();
        let mut chain = vec![leaf.clone()];
        chain.extend(lookalikes.iter().take(MAX_CLIENT_CHAIN - 1).cloned());
        assert_eq!(
            PeerChain::new(chain).identify(&tls).unwrap().user,
            "scraper"
        );
        let mut chain = vec![leaf];
        chain.extend(lookalikes);
        let refused = PeerChain::new(chain).identify(&tls).unwrap_err();
        assert!(
            refused.contains(&format!("presented {} certificates", MAX_CLIENT_CHAIN + 1)),
            "{refused}"
        );
    }

    #[test]
    fn a_serving_key_that_does_not_match_keeps_the_served_pair_and_the_client_ca_follows() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let (served, _) = ca("serving");
        let serving_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "127.0.0.1");
        let cert = params.self_signed(&serving_key).unwrap();
        let (cert_file, key_file) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, serving_key.serialize_pem()).unwrap();
        let (old_pem, old) = ca("old-signer");
        let ca_file = dir.path().join("client-ca.crt");
        std::fs::write(&ca_file, format!("{old_pem}{served}")).unwrap();
        let tls = Tls::load(
            Settings {
                serving: Some((cert_file, key_file.clone())),
                client_ca: Some(ca_file.clone()),
                client_ca_is_bundle: false,
                min_version: TlsVersion::V1_2,
            },
            &[],
        )
        .unwrap();
        let peer = PeerChain::new(vec![client(&old, "scraper")]);
        assert!(peer.identify(&tls).is_ok());
        // The key is replaced by another: the serving pair cannot be reloaded...
        std::fs::write(&key_file, KeyPair::generate().unwrap().serialize_pem()).unwrap();
        std::fs::write(&ca_file, &served).unwrap();
        let error = format!("{:#}", tls.reload().unwrap_err());
        assert!(error.contains("do not go together"), "{error}");
        // ... and the signer removed from the client CA is refused all the same.
        assert!(peer.identify(&tls).is_err());
        assert_eq!(tls.current().client_cas, 1);
    }
}
