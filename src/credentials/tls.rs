//! The client's stack when kube-rs cannot hold its client certificate: one of X.509 version
//! 1, as `openssl x509 -req` makes without an extension file.
//!
//! kube-rs gives the certificate and key to rustls, which first checks that they go
//! together by parsing the certificate with webpki; webpki parses version 3 certificates
//! alone, so a version 1 certificate is refused before any connection, with an error that
//! reads as a wrong key. Yet a client certificate is only sent: the API server decides
//! whether it accepts it, and kube-apiserver (Go's x509) accepts version 1. So for such a
//! certificate the stack is built here as kube-rs builds its own (its TLS configuration
//! with the trusted CAs, its connector timeouts, its base URI, authentication and header
//! layers; not its debug-level tracing spans), with the certificate given to rustls as it
//! is. The key was checked against the certificate when it was loaded ([`super::load`]).
//! Every other certificate takes kube-rs's own stack.

use std::sync::Arc;

use http::{Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::{Body, ClientBuilder, ConfigExt, DynBody};
use rustls::client::ResolvesClientCert;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use secrecy::ExposeSecret;
use tower::util::BoxService;
use tower::{BoxError, ServiceBuilder, ServiceExt};

/// The service a [`ClientBuilder`] starts from, as kube-rs's own.
pub type Stack = BoxService<Request<Body>, Response<Box<DynBody>>, BoxError>;

/// kube-rs's builder for `config`, or, when its client certificate is of version 1, the
/// same stack built here around it.
pub fn builder(config: kube::Config) -> kube::Result<ClientBuilder<Stack>> {
    match version_1_identity(&config) {
        Some(identity) if config.proxy_url.is_none() => with_identity(config, identity),
        _ => ClientBuilder::try_from(config),
    }
}

/// The client certificate chain and key of `config`, when its leaf is of version 1.
fn version_1_identity(
    config: &kube::Config,
) -> Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    use base64::Engine;
    let decode = |data: &str| {
        let compact: Vec<u8> = data.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
        base64::engine::general_purpose::STANDARD
            .decode(compact)
            .ok()
    };
    let user = &config.auth_info;
    let cert = decode(user.client_certificate_data.as_deref()?)?;
    let key = decode(user.client_key_data.as_ref()?.expose_secret())?;
    let chain = CertificateDer::pem_slice_iter(&cert)
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    if !is_version_1(chain.first()?) {
        return None;
    }
    Some((chain, PrivateKeyDer::from_pem_slice(&key).ok()?))
}

/// Whether `der` is a certificate of X.509 version 1 (no extensions, no version field).
pub fn is_version_1(der: &[u8]) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate, X509Version};
    X509Certificate::from_der(der).is_ok_and(|(_, c)| c.version() == X509Version::V1)
}

/// kube-rs's stack (`ClientBuilder::try_from`, without a proxy) with `identity` as the
/// client certificate.
fn with_identity(
    mut config: kube::Config,
    (chain, key): (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
) -> kube::Result<ClientBuilder<Stack>> {
    let tls_error = |e: rustls::Error| {
        kube::Error::RustlsTls(kube::client::RustlsTlsError::InvalidPrivateKey(e))
    };
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(tls_error)?;
    // `CertifiedKey::new`, unlike `with_client_auth_cert`, does not parse the certificate.
    let resolver: Arc<dyn ResolvesClientCert> =
        Arc::new(SingleCertAndKey::from(CertifiedKey::new(chain, signing)));
    // kube-rs's TLS configuration (the trusted CAs, the verifier) without the identity,
    // which the resolver then gives.
    config.auth_info.client_certificate_data = None;
    config.auth_info.client_key_data = None;
    let mut tls = config.rustls_client_config()?;
    tls.client_auth_cert_resolver = resolver;

    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let mut https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = name.clone().try_into().map_err(|e| {
            kube::Error::RustlsTls(kube::client::RustlsTlsError::InvalidServerName(e))
        })?;
        https = https.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    let mut connector =
        hyper_timeout::TimeoutConnector::new(https.enable_http1().wrap_connector(http));
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let client: hyper_util::client::legacy::Client<_, Body> =
        hyper_util::client::legacy::Builder::new(TokioExecutor::new()).build(connector);

    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(client)
        .map_response(|response: Response<hyper::body::Incoming>| {
            response.map(|body| {
                Box::new(http_body_util::BodyExt::map_err(body, BoxError::from)) as Box<DynBody>
            })
        })
        .boxed();
    Ok(ClientBuilder::new(service, config.default_namespace))
}
