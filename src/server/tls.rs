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

use super::auth::Identity;
use crate::cli::TlsVersion;

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

impl Generation {
    /// The identity a client certificate chain proves now: its CN the user, its O values
    /// the groups. `Err` says why it proves nothing (no client CA, an unknown signer,
    /// expired, ...), in words safe to show the client.
    pub fn identify(&self, chain: &[CertificateDer<'static>]) -> Result<Identity, String> {
        let verifier = self.clients.as_ref().map_err(Clone::clone)?;
        let (end_entity, intermediates) = chain.split_first().ok_or("no client certificate")?;
        verifier
            .verify_client_cert(end_entity, intermediates, UnixTime::now())
            .map_err(|e| format!("the client certificate is not valid: {e}"))?;
        Identity::of_certificate(end_entity)
    }
}

/// The current generation, and how to make the next.
pub struct Tls {
    settings: Settings,
    /// The self-signed certificate, made once at start when no files are given.
    self_signed: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    current: RwLock<Arc<Generation>>,
}

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
        let self_signed = match &settings.serving {
            Some(_) => None,
            None => Some(self_signed(names)?),
        };
        let first = build(&settings, self_signed.as_ref())?;
        Ok(Tls {
            settings,
            self_signed,
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

    /// Builds the next generation from the files as they are now. On failure the current
    /// generation stays, and the error says which file and why.
    pub fn reload(&self) -> anyhow::Result<()> {
        let next = build(&self.settings, self.self_signed.as_ref())?;
        let cas = next.client_cas;
        let before = self.current().client_cas;
        *self.current.write().expect("tls lock") = Arc::new(next);
        tracing::info!(
            client_cas = cas,
            previous_client_cas = before,
            "TLS configuration reloaded"
        );
        Ok(())
    }
}

fn build(
    settings: &Settings,
    self_signed: Option<&(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> anyhow::Result<Generation> {
    let (chain, key) = match (&settings.serving, self_signed) {
        (Some((cert, key)), _) => (read_chain(cert)?, read_key(key)?),
        (None, Some((chain, key))) => (chain.clone(), key.clone_key()),
        (None, None) => unreachable!("a self-signed certificate is made when no files are given"),
    };
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
