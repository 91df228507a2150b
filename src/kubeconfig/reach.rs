//! Whether CA data verifies the certificate that a kubeconfig's server presents right now
//! (SPEC 4c): the check that stands between the agent and a kubeconfig that locks a node
//! out. Blocking network I/O with bounded waits: it runs on a thread of its own, never on
//! the reconciliation loop.
//!
//! Each connection records the chain the server presents (the handshake's own signature
//! is still checked), and the chain is then verified offline, as the kubelet's client
//! would verify it, against each candidate CA set. Behind a load balancer, API servers in
//! the middle of a rollout present certificates from both CAs: every one of several fresh
//! connections must verify.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::Cluster;

/// Fresh connections a check makes; each must verify.
pub const CONNECTIONS: usize = 3;

/// The longest wait of one step (connect, a read, a write) of a connection.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a kubeconfig's server is, and the name its certificate must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Server {
    /// `https://HOST:PORT`, as the status and the logs name it.
    pub shown: String,
    host: String,
    port: u16,
    name: ServerName<'static>,
    /// An HTTP proxy to tunnel through (`proxy-url`), as (host, port).
    proxy: Option<(String, u16)>,
    /// An `http://` server: no TLS, so the CA data is not used at all.
    plain: bool,
}

impl Server {
    /// The server of `cluster`, or why it cannot be checked.
    pub fn of(cluster: &Cluster) -> Result<Server, String> {
        let shown_server = crate::text::escape(&cluster.server).into_owned();
        let uri: http::Uri = cluster
            .server
            .parse()
            .map_err(|_| format!("its server {shown_server} is not a URL"))?;
        let plain = match uri.scheme_str() {
            Some("https") => false,
            Some("http") => true,
            _ => return Err(format!("its server {shown_server} is not an https URL")),
        };
        let host = uri
            .host()
            .ok_or_else(|| format!("its server {shown_server} names no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = uri.port_u16().unwrap_or(if plain { 80 } else { 443 });
        let name_text = cluster
            .tls_server_name
            .clone()
            .unwrap_or_else(|| host.clone());
        let name = ServerName::try_from(name_text.clone())
            .map_err(|_| format!("{} is not a server name", crate::text::escape(&name_text)))?;
        let proxy = match &cluster.proxy_url {
            None => None,
            Some(url) => {
                let shown = crate::text::escape(url).into_owned();
                let uri: http::Uri = url
                    .parse()
                    .map_err(|_| format!("its proxy-url {shown} is not a URL"))?;
                if uri.scheme_str() != Some("http") {
                    return Err(format!(
                        "its proxy-url {shown} is not an http:// proxy, which is all the check can go through"
                    ));
                }
                let host = uri
                    .host()
                    .ok_or_else(|| format!("its proxy-url {shown} names no host"))?;
                Some((host.to_string(), uri.port_u16().unwrap_or(80)))
            }
        };
        let shown = if host.contains(':') {
            format!("https://[{host}]:{port}")
        } else {
            format!("https://{host}:{port}")
        };
        Ok(Server {
            shown: crate::text::escape(&shown).into_owned(),
            host,
            port,
            name,
            proxy,
            plain,
        })
    }
}

/// What a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The certificate of every connection was verified against each CA set: `new` and
    /// `old` say whether it verified against all of them.
    Verified { new: bool, old: bool },
    /// No certificate could be seen (refused, timed out, no TLS answer): nothing is known.
    Unreachable(String),
}

impl Verdict {
    /// Whether CAs may be dropped: the new CA data alone verifies what the server
    /// presents, or neither does (the CA data on disk already fails, so keeping the
    /// dropped CAs would save nothing).
    pub fn allows_removal(&self) -> bool {
        matches!(
            self,
            Verdict::Verified { new: true, .. } | Verdict::Verified { old: false, .. }
        )
    }
}

/// Connects to `server` [`CONNECTIONS`] times and verifies each presented chain against
/// `new` and against `old` (PEM bundles).
pub fn check(server: &Server, new: &[u8], old: &[u8]) -> Verdict {
    if server.plain {
        return Verdict::Verified {
            new: true,
            old: true,
        };
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier_of = |pem: &[u8]| {
        let mut roots = RootCertStore::empty();
        for der in CertificateDer::pem_slice_iter(pem).flatten() {
            let _ = roots.add(der);
        }
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .ok()
    };
    let (new_verifier, old_verifier) = (verifier_of(new), verifier_of(old));
    let verifies = |verifier: &Option<Arc<WebPkiServerVerifier>>, chain: &Chain| {
        verifier.as_ref().is_some_and(|v| {
            v.verify_server_cert(&chain.0, &chain.1, &server.name, &[], UnixTime::now())
                .is_ok()
        })
    };
    let (mut new_ok, mut old_ok) = (true, true);
    for _ in 0..CONNECTIONS {
        let chain = match presented_chain(server, &provider) {
            Ok(chain) => chain,
            Err(why) => return Verdict::Unreachable(why),
        };
        new_ok &= verifies(&new_verifier, &chain);
        old_ok &= verifies(&old_verifier, &chain);
    }
    Verdict::Verified {
        new: new_ok,
        old: old_ok,
    }
}

/// A presented chain: the server's certificate, then the intermediates it sent.
type Chain = (CertificateDer<'static>, Vec<CertificateDer<'static>>);

/// One fresh connection's handshake, and the chain the server presented in it.
fn presented_chain(server: &Server, provider: &Arc<CryptoProvider>) -> Result<Chain, String> {
    let shown = &server.shown;
    let mut socket = match &server.proxy {
        None => connect(&server.host, server.port)
            .map_err(|e| format!("cannot connect to {shown}: {e}"))?,
        Some((host, port)) => tunnel(host, *port, &server.host, server.port)
            .map_err(|e| format!("cannot reach {shown} through its proxy: {e}"))?,
    };
    let recorder = Arc::new(Recorder {
        provider: provider.clone(),
        chain: Mutex::default(),
    });
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(recorder.clone())
        .with_no_client_auth();
    let mut tls = rustls::ClientConnection::new(Arc::new(config), server.name.clone())
        .map_err(|e| e.to_string())?;
    while tls.is_handshaking() {
        tls.complete_io(&mut socket)
            .map_err(|e| format!("no TLS handshake with {shown}: {e}"))?;
    }
    // rustls asks the verifier whenever a handshake completes without resumption (and
    // this configuration resumes nothing), so a finished handshake has left its chain.
    let chain = recorder.chain.lock().ok().and_then(|c| c.clone());
    chain.ok_or_else(|| format!("{shown} presented no certificate"))
}

fn connect(host: &str, port: u16) -> std::io::Result<TcpStream> {
    let mut last = None;
    for address in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&address, STEP_TIMEOUT) {
            Ok(socket) => {
                socket.set_read_timeout(Some(STEP_TIMEOUT))?;
                socket.set_write_timeout(Some(STEP_TIMEOUT))?;
                return Ok(socket);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("the name resolves to no address")))
}

/// A connection to `host:port` through an HTTP proxy's CONNECT.
fn tunnel(proxy: &str, proxy_port: u16, host: &str, port: u16) -> std::io::Result<TcpStream> {
    let mut socket = connect(proxy, proxy_port)?;
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    write!(
        socket,
        "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
    )?;
    let mut reader = BufReader::new(socket.try_clone()?);
    let mut status = String::new();
    reader.read_line(&mut status)?;
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(std::io::Error::other(format!(
            "the proxy answered {}",
            crate::text::escape(status.trim())
        )));
    }
    // The rest of the answer's head; nothing follows it before the server speaks.
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    Ok(socket)
}

/// Accepts whatever chain the server presents and keeps it, for the offline
/// verification; the handshake's signature is verified as usual.
#[derive(Debug)]
struct Recorder {
    provider: Arc<CryptoProvider>,
    chain: Mutex<Option<Chain>>,
}

impl ServerCertVerifier for Recorder {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Ok(mut chain) = self.chain.lock() {
            *chain = Some((
                end_entity.clone().into_owned(),
                intermediates
                    .iter()
                    .map(|c| c.clone().into_owned())
                    .collect(),
            ));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(server: &str) -> Cluster {
        Cluster {
            name: "c".into(),
            server: server.into(),
            tls_server_name: None,
            proxy_url: None,
            ca_data: None,
        }
    }

    #[test]
    fn the_server_is_read_from_the_cluster_as_the_client_would() {
        let s = Server::of(&cluster("https://api-int.example:6443")).unwrap();
        assert_eq!(s.shown, "https://api-int.example:6443");
        assert_eq!((s.host.as_str(), s.port), ("api-int.example", 6443));
        let s = Server::of(&cluster("https://10.0.0.1")).unwrap();
        assert_eq!(s.shown, "https://10.0.0.1:443");
        let s = Server::of(&cluster("https://[fd00::1]:6443")).unwrap();
        assert_eq!(s.host, "fd00::1");
        assert_eq!(s.shown, "https://[fd00::1]:6443");
        let mut named = cluster("https://10.0.0.1:6443");
        named.tls_server_name = Some("kubernetes.default".into());
        named.proxy_url = Some("http://proxy:3128".into());
        let s = Server::of(&named).unwrap();
        assert_eq!(s.name, ServerName::try_from("kubernetes.default").unwrap());
        assert_eq!(s.proxy, Some(("proxy".to_string(), 3128)));
        assert!(Server::of(&cluster("ftp://x")).is_err());
        // An http:// server takes no CA data at all: nothing to check, nothing to hold.
        let s = Server::of(&cluster("http://127.0.0.1:1")).unwrap();
        assert_eq!((s.plain, s.port), (true, 1));
        assert_eq!(Server::of(&cluster("http://10.0.0.1")).unwrap().port, 80);
        assert!(check(&s, b"", b"").allows_removal());
        named.proxy_url = Some("socks5://proxy:1080".into());
        assert!(
            Server::of(&named)
                .unwrap_err()
                .contains("not an http:// proxy")
        );
    }

    #[test]
    fn removal_is_allowed_when_the_new_data_verifies_or_the_old_fails_too() {
        let v = |new, old| Verdict::Verified { new, old }.allows_removal();
        assert!(v(true, true));
        assert!(v(true, false));
        assert!(!v(false, true));
        assert!(v(false, false));
        assert!(!Verdict::Unreachable("refused".into()).allows_removal());
    }

    #[test]
    fn an_unreachable_server_is_unreachable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let s = Server::of(&cluster(&format!("https://127.0.0.1:{port}"))).unwrap();
        assert!(
            matches!(check(&s, b"", b""), Verdict::Unreachable(why) if why.contains("cannot connect"))
        );
    }

    /// A CA, and a server certificate for 127.0.0.1 issued by it (key and chain).
    fn ca_and_server() -> (String, (Vec<CertificateDer<'static>>, Vec<u8>)) {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (ca_pem, (vec![leaf.der().clone()], key.serialize_der()))
    }

    /// A TLS server on loopback whose n-th connection presents `presented[n % len]`.
    fn tls_server(presented: Vec<(Vec<CertificateDer<'static>>, Vec<u8>)>) -> u16 {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let configs: Vec<_> = presented
            .into_iter()
            .map(|(chain, key)| {
                let key = rustls::pki_types::PrivatePkcs8KeyDer::from(key).into();
                Arc::new(
                    rustls::ServerConfig::builder_with_provider(provider.clone())
                        .with_safe_default_protocol_versions()
                        .unwrap()
                        .with_no_client_auth()
                        .with_single_cert(chain, key)
                        .unwrap(),
                )
            })
            .collect();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for (n, socket) in listener.incoming().enumerate() {
                let Ok(mut socket) = socket else { continue };
                let config = configs[n % configs.len()].clone();
                std::thread::spawn(move || {
                    let mut tls = rustls::ServerConnection::new(config).unwrap();
                    while tls.is_handshaking() {
                        if tls.complete_io(&mut socket).is_err() {
                            return;
                        }
                    }
                    let _ = tls.complete_io(&mut socket);
                });
            }
        });
        port
    }

    /// An HTTP proxy on loopback that answers CONNECT with `status` and, when it is 200,
    /// relays to the port asked for. Counts the CONNECTs it was asked.
    fn proxy(status: &'static str) -> (u16, Arc<Mutex<Vec<String>>>) {
        use std::net::TcpListener;
        let asked = Arc::new(Mutex::new(Vec::new()));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = asked.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let seen = seen.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(client.try_clone().unwrap());
                    let mut request = String::new();
                    reader.read_line(&mut request).unwrap();
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                            break;
                        }
                    }
                    seen.lock().unwrap().push(request.trim().to_string());
                    let mut client = client;
                    // A head of several lines, as a real proxy sends, in pieces: what is
                    // left of the head must not be taken for the server's first bytes.
                    for piece in [
                        format!("HTTP/1.1 {status}\r\n"),
                        "Via: test\r\n".into(),
                        "X-A: b\r\n\r\n".into(),
                    ] {
                        client.write_all(piece.as_bytes()).unwrap();
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    if !status.starts_with("200") {
                        return;
                    }
                    let target = request.split_whitespace().nth(1).unwrap().to_string();
                    let upstream = TcpStream::connect(target).unwrap();
                    let (mut up_r, mut up_w) = (upstream.try_clone().unwrap(), upstream);
                    let (mut cl_r, mut cl_w) = (client.try_clone().unwrap(), client);
                    std::thread::spawn(move || std::io::copy(&mut up_r, &mut cl_w));
                    let _ = std::io::copy(&mut cl_r, &mut up_w);
                });
            }
        });
        (port, asked)
    }

    #[test]
    fn every_connection_must_verify_against_the_new_data_before_the_old_may_go() {
        let (old_ca, old_server) = ca_and_server();
        let (new_ca, new_server) = ca_and_server();
        let at = |port: u16| Server::of(&cluster(&format!("https://127.0.0.1:{port}"))).unwrap();
        // Still on the old CA: the new data does not verify, the old does.
        let port = tls_server(vec![old_server.clone()]);
        let verdict = check(&at(port), new_ca.as_bytes(), old_ca.as_bytes());
        assert_eq!(
            verdict,
            Verdict::Verified {
                new: false,
                old: true
            }
        );
        assert!(!verdict.allows_removal());
        // Moved to the new CA.
        let port = tls_server(vec![new_server.clone()]);
        let verdict = check(&at(port), new_ca.as_bytes(), old_ca.as_bytes());
        assert_eq!(
            verdict,
            Verdict::Verified {
                new: true,
                old: false
            }
        );
        // In the middle of a rollout behind a balancer, one connection in three still
        // meets the old CA, whichever it is: neither set verifies every connection.
        for first in 0..CONNECTIONS {
            let mut presented = vec![new_server.clone(); CONNECTIONS];
            presented[first] = old_server.clone();
            let port = tls_server(presented);
            let verdict = check(&at(port), new_ca.as_bytes(), old_ca.as_bytes());
            assert_eq!(
                verdict,
                Verdict::Verified {
                    new: false,
                    old: false
                },
                "old CA at {first}"
            );
        }
    }

    #[test]
    fn the_server_is_reached_through_its_proxy_and_a_refusing_proxy_is_unreachable() {
        let (ca, server) = ca_and_server();
        let port = tls_server(vec![server]);
        let (proxy_port, asked) = proxy("200 Connection established");
        let mut through = cluster(&format!("https://127.0.0.1:{port}"));
        through.proxy_url = Some(format!("http://127.0.0.1:{proxy_port}"));
        let verdict = check(&Server::of(&through).unwrap(), ca.as_bytes(), b"");
        assert_eq!(
            verdict,
            Verdict::Verified {
                new: true,
                old: false
            }
        );
        assert_eq!(
            asked.lock().unwrap().clone(),
            vec![format!("CONNECT 127.0.0.1:{port} HTTP/1.1"); CONNECTIONS]
        );
        let (refusing, _) = proxy("403 Forbidden");
        through.proxy_url = Some(format!("http://127.0.0.1:{refusing}"));
        let verdict = check(&Server::of(&through).unwrap(), ca.as_bytes(), b"");
        assert!(
            matches!(&verdict, Verdict::Unreachable(why) if why.contains("the proxy answered HTTP/1.1 403 Forbidden")),
            "{verdict:?}"
        );
    }
}
