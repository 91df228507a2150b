//! The endpoint attacked with no credentials, through the real binary: long certificate
//! chains, unread pipelined connections under a low descriptor limit, distinct bearer
//! tokens against a hung reviewer, a serving key that does not match, anonymous health
//! pages, a reviewer that is down, and a subject with two CNs. Each test asserts what a
//! user notices (a probe that does not answer, a rotation that does not reach the file, a
//! signer that stays trusted, a secret reason shown to anybody, a log flooded) with bounds
//! far from the figures the agent should reach, so that no test is a timed benchmark.
//!
//! Every test floods a two-core machine: they run one at a time ([`serial`]). Every flood
//! is bounded in count and time, and every socket has a timeout.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, DnValue,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::client::Resumption;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, SignatureScheme, StreamOwned};
use time::{Duration as Span, OffsetDateTime};

use common::Node;
use common::apiserver::ApiServer;
use common::daemon::{Agent, eventually, wait_until};
use common::pki::{Algorithm, Signer};

const SECOND: Duration = Duration::from_secs(1);
/// A kubelet probe gives up after 5 s by default: a probe must answer well within it.
const PROBE_BOUND: Duration = Duration::from_secs(2);
/// A rotation through a `file:` source reaches the bundle within this (it takes
/// milliseconds on an idle agent).
const ROTATION_BOUND: Duration = Duration::from_secs(2);
/// The service account a cluster's Prometheus scrapes as.
const PROMETHEUS_SA: &str = "system:serviceaccount:openshift-monitoring:prometheus-k8s";
/// The user the fake API server's kubeconfig token authenticates as.
const AGENT_USER: &str = "system:node:fixture-node";

/// One test at a time: each floods the machine, and a probe measured while another
/// test's flood runs would measure that flood.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------
// Certificates
// ---------------------------------------------------------------------------------------

/// A CA of the test's own (rcgen's `Issuer` is kept, so that it can sign subjects that
/// `Signer` cannot build, and chains of any shape).
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl Ca {
    fn new(subject: DistinguishedName) -> Ca {
        let params = ca_params(subject);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        Ca {
            issuer: Issuer::new(params, key),
            pem,
        }
    }

    /// A client certificate (clientAuth) whose subject is exactly `subject`; its DER and
    /// its key.
    fn issue_client(&self, subject: DistinguishedName) -> (CertificateDer<'static>, KeyPair) {
        let mut params = CertificateParams::default();
        params.distinguished_name = subject;
        params.is_ca = IsCa::ExplicitNoCa;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Span::hours(1);
        params.not_after = now + Span::days(1);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.der().clone(), key)
    }
}

/// The parameters of a CA named `subject`, valid from an hour ago for a day.
fn ca_params(subject: DistinguishedName) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = subject;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Span::hours(1);
    params.not_after = now + Span::days(1);
    params
}

fn dn(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

/// What a client presents: its certificate chain and its key.
type Identity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn identity(chain: Vec<CertificateDer<'static>>, key: &KeyPair) -> Identity {
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    (chain, key)
}

/// The chain of issue 1: a client certificate for `user` signed by a CA nobody trusts,
/// followed by `intermediates` self-signed CA certificates that all carry that CA's subject,
/// so that a path builder tries each as the issuer of the leaf and of each other.
fn long_chain(user: &str, intermediates: usize) -> Identity {
    let mut shared = dn("flood-intermediate");
    shared.push(DnType::OrganizationName, "nobody you trust");
    let stranger = Ca::new(shared.clone());
    let (leaf, key) = stranger.issue_client(dn(user));
    let mut chain = vec![leaf];
    for _ in 0..intermediates {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        chain.push(
            ca_params(shared.clone())
                .self_signed(&key)
                .unwrap()
                .der()
                .clone(),
        );
    }
    identity(chain, &key)
}

/// A client certificate from `signer` (a `common::pki` signer) for `user`.
fn client_of(signer: &Signer, user: &str) -> Identity {
    let (cert, key) = signer.issue_client_with(user, &[], Span::hours(-1), Span::days(1));
    let cert = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    (vec![cert], key)
}

// ---------------------------------------------------------------------------------------
// An HTTPS client in process (floods need thousands of requests: no process per request)
// ---------------------------------------------------------------------------------------

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Accepts whatever certificate the agent serves: these tests are about the client's
/// side of the handshake, not the server's identity (tests/endpoint.rs checks that).
#[derive(Debug)]
struct AnyServer(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
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
            &self.0.signature_verification_algorithms,
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
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A client configuration presenting `identity` (or no certificate), without session
/// resumption: every connection is a full handshake, its certificate sent afresh.
fn client_config(identity: Option<Identity>) -> Arc<ClientConfig> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)));
    let mut config = match identity {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.resumption = Resumption::disabled();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

type Tls = StreamOwned<ClientConnection, TcpStream>;

/// A TLS connection to the agent on loopback, every read and write bounded by `timeout`.
fn connect(port: u16, config: &Arc<ClientConfig>, timeout: Duration) -> io::Result<Tls> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let sock = TcpStream::connect_timeout(&addr, timeout)?;
    sock.set_read_timeout(Some(timeout))?;
    sock.set_write_timeout(Some(timeout))?;
    let _ = sock.set_nodelay(true);
    let name = ServerName::try_from("localhost").unwrap();
    let conn = ClientConnection::new(config.clone(), name).map_err(io::Error::other)?;
    Ok(StreamOwned::new(conn, sock))
}

/// An HTTP response as read off the wire.
#[derive(Debug, Clone)]
struct Response {
    code: u16,
    head: String,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then_some(v.trim())
        })
    }
}

/// Reads one response: by Content-Length, chunked, or up to the end of the connection.
fn read_response(reader: &mut impl BufRead) -> io::Result<Response> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if line == "\r\n" || line == "\n" {
            break;
        }
        head.push_str(&line);
    }
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| io::Error::other(format!("not an HTTP response: {head:?}")))?;
    let mut response = Response {
        code,
        head,
        body: String::new(),
    };
    let mut body = Vec::new();
    if let Some(length) = response.header("content-length") {
        let length: usize = length.parse().map_err(io::Error::other)?;
        body.resize(length, 0);
        reader.read_exact(&mut body)?;
    } else if response
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size)?;
            let size = usize::from_str_radix(size.trim(), 16).map_err(io::Error::other)?;
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk)?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else {
        // Up to the end of the connection; a close without close_notify ends it too.
        let _ = reader.read_to_end(&mut body);
    }
    response.body = String::from_utf8_lossy(&body).into_owned();
    Ok(response)
}

/// GET `path` over a new TLS connection with extra `headers` (each ending in CRLF);
/// None when the agent does not answer within `timeout`.
fn https_get(
    port: u16,
    config: &Arc<ClientConfig>,
    path: &str,
    headers: &str,
    timeout: Duration,
) -> Option<Response> {
    let mut tls = connect(port, config, timeout).ok()?;
    write!(
        tls,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}\r\n"
    )
    .ok()?;
    tls.flush().ok()?;
    read_response(&mut BufReader::new(tls)).ok()
}

/// Counts of outcomes: a status code, or what went wrong instead.
#[derive(Default)]
struct Tally(Mutex<BTreeMap<String, usize>>);

impl Tally {
    fn add(&self, outcome: impl Into<String>) {
        *self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(outcome.into())
            .or_default() += 1;
    }

    fn counts(&self) -> BTreeMap<String, usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

fn count(counts: &BTreeMap<String, usize>, outcome: &str) -> usize {
    counts.get(outcome).copied().unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// The agent
// ---------------------------------------------------------------------------------------

/// An endpoint served over TLS, with its own serving certificate under `tls-<name>/`.
struct Secured {
    args: Vec<String>,
    key: PathBuf,
}

impl Secured {
    fn new(node: &Node, name: &str, client_ca: &Path, extra: &[&str]) -> Secured {
        let ca = Signer::new(&format!("serving-ca-{name}"), Algorithm::P256);
        let (cert, key) = ca.issue_server(&["localhost", "127.0.0.1"]);
        let dir = node.root().join(format!("tls-{name}"));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("tls.crt"), cert).unwrap();
        fs::write(dir.join("tls.key"), key).unwrap();
        let path = |p: PathBuf| p.to_str().unwrap().to_string();
        let mut args = vec![
            "--tls-cert-file".to_string(),
            path(dir.join("tls.crt")),
            "--tls-private-key-file".to_string(),
            path(dir.join("tls.key")),
            "--client-ca-file".to_string(),
            path(client_ca.to_path_buf()),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Secured {
            args,
            key: dir.join("tls.key"),
        }
    }

    fn start(&self, node: &Node, sources: &[&str], more: &[&str]) -> Agent {
        let mut args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        args.extend(more);
        let agent = Agent::start_with(node, sources, &args, |cmd| {
            cmd.env_remove("KUBELET_CA_AGENT_INSECURE_METRICS");
        });
        let anonymous = client_config(None);
        let up = eventually(10 * SECOND, || {
            https_get(agent.port, &anonymous, "/livez", "", 5 * SECOND)
                .is_some_and(|r| r.code == 200)
        });
        assert!(up, "the agent does not answer /livez: {}", agent.log());
        agent
    }
}

/// Writes `content` to `path` as a rotation does: aside, then renamed into place.
fn replace(path: &Path, content: impl AsRef<[u8]>) {
    let staged = path.with_extension("staged");
    fs::write(&staged, content).unwrap();
    fs::rename(&staged, path).unwrap();
}

/// The file behind a `file:` source spec.
fn source_path(spec: &str) -> PathBuf {
    PathBuf::from(spec.strip_prefix("file:").unwrap())
}

/// How many descriptors the process has open.
fn open_fds(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Resident memory now, in bytes (VmRSS).
fn rss(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// How many of the process's TCP sockets are connected (or connecting) to `port` on the
/// other side: its connections to the API server.
fn connections_to(pid: u32, port: u16) -> usize {
    let inodes: std::collections::HashSet<String> = fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let link = fs::read_link(e.ok()?.path()).ok()?;
            let link = link.to_str()?;
            Some(
                link.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    let mut n = 0;
    for table in ["tcp", "tcp6"] {
        let text = fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(remote), Some(state), Some(inode)) =
                (fields.get(2), fields.get(3), fields.get(9))
            else {
                continue;
            };
            let remote_port = remote
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            // 0A is LISTEN; every other state is a connection of some kind.
            if remote_port == Some(port) && *state != "0A" && inodes.contains(*inode) {
                n += 1;
            }
        }
    }
    n
}

/// The log lines at WARN or ERROR from line `from` on.
fn warnings_since(agent: &Agent, from: usize) -> Vec<String> {
    agent
        .log()
        .lines()
        .skip(from)
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .map(str::to_string)
        .collect()
}

/// Fails listing every problem found, not just the first: a test of an attack says all
/// that went wrong under it.
fn assert_none(problems: &[String], log: &str) {
    let tail: Vec<&str> = log.lines().rev().take(30).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    assert!(
        problems.is_empty(),
        "{} problem(s):\n- {}\n--- last lines of the agent's log ---\n{}",
        problems.len(),
        problems.join("\n- "),
        tail.join("\n")
    );
}

/// Probes `/livez` (and, when `readyz`, `/readyz`) every 200 ms until `stop`; each probe's
/// outcome and how long it took.
fn probe_until(
    stop: &AtomicBool,
    mut probe: impl FnMut(&str) -> Option<u16>,
    readyz: bool,
) -> Vec<(String, Option<u16>, Duration)> {
    let mut probes = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let paths: &[&str] = if readyz {
            &["/livez", "/readyz"]
        } else {
            &["/livez"]
        };
        for path in paths {
            let started = Instant::now();
            let code = probe(path);
            probes.push((path.to_string(), code, started.elapsed()));
        }
        thread::sleep(Duration::from_millis(200));
    }
    probes
}

/// The probes that did not answer 200 within [`PROBE_BOUND`], as problems.
fn slow_probes(probes: &[(String, Option<u16>, Duration)]) -> Vec<String> {
    let bad: Vec<String> = probes
        .iter()
        .filter(|(_, code, took)| *code != Some(200) || *took > PROBE_BOUND)
        .map(|(path, code, took)| format!("{path}: {code:?} after {took:.2?}"))
        .collect();
    if bad.is_empty() {
        return Vec::new();
    }
    vec![format!(
        "{} of {} probes did not answer 200 within {PROBE_BOUND:?}: {}",
        bad.len(),
        probes.len(),
        bad.join(", ")
    )]
}

/// Rotates the `file:` source at `path` to `content` after `delay`, and says how long the
/// bundle took to hold it (None: not within 10 s).
fn rotate_after(node: &Node, path: &Path, content: &str, delay: Duration) -> Option<Duration> {
    thread::sleep(delay);
    replace(path, content);
    let started = Instant::now();
    eventually(10 * SECOND, || node.holds(content)).then(|| started.elapsed())
}

fn rotation_problem(took: Option<Duration>) -> Option<String> {
    match took {
        Some(took) if took <= ROTATION_BOUND => None,
        Some(took) => Some(format!(
            "the rotation took {took:.2?} to reach the bundle (bound {ROTATION_BOUND:?})"
        )),
        None => Some("the rotation did not reach the bundle within 10 s".to_string()),
    }
}

// ---------------------------------------------------------------------------------------
// The attacks
// ---------------------------------------------------------------------------------------

/// Issue 1: a client certificate followed by 10 self-signed "intermediates" that share one
/// subject, sent on 16 kept-alive connections, request after request, for 6 s.
#[test]
fn a_flood_of_long_certificate_chains_slows_neither_probes_nor_rotations() {
    let _serial = serial();
    let node = Node::new();
    let (old, new) = (
        Signer::new("signer-old", Algorithm::P256),
        Signer::new("signer-new", Algorithm::P256),
    );
    let source = node.source("signers.pem", old.pem());
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, scrapers.pem()).unwrap();
    let endpoint = Secured::new(
        &node,
        "a",
        &client_ca,
        &["--authorized-users", "prometheus"],
    );
    let agent = endpoint.start(&node, &[&source], &[]);
    wait_until(10 * SECOND, || node.holds(old.pem()));
    let anonymous = client_config(None);
    let flooder = client_config(Some(long_chain("prometheus", 10)));
    // The agent works: a scraper with a good certificate reads /metrics.
    let scraper = client_config(Some(client_of(&scrapers, "prometheus")));
    let before = https_get(agent.port, &scraper, "/metrics", "", 5 * SECOND);
    assert_eq!(before.map(|r| r.code), Some(200));

    let stop = AtomicBool::new(false);
    let tally = Tally::default();
    let sample = Mutex::new(None::<String>);
    let port = agent.port;
    let (probes, rotation) = thread::scope(|scope| {
        for _ in 0..16 {
            scope.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(tls) = connect(port, &flooder, 10 * SECOND) else {
                        tally.add("connect failed");
                        thread::sleep(Duration::from_millis(50));
                        continue;
                    };
                    let mut conn = BufReader::new(tls);
                    // Requests on this connection until the agent closes it or time is up.
                    while !stop.load(Ordering::Relaxed) {
                        let sent = conn
                            .get_mut()
                            .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
                            .and_then(|()| conn.get_mut().flush());
                        if let Err(e) = sent {
                            tally.add(format!("write failed: {:?}", e.kind()));
                            break;
                        }
                        match read_response(&mut conn) {
                            Ok(r) => {
                                tally.add(r.code.to_string());
                                sample
                                    .lock()
                                    .unwrap_or_else(PoisonError::into_inner)
                                    .get_or_insert(r.body.clone());
                                if r.header("connection").is_some_and(|v| v == "close") {
                                    break;
                                }
                            }
                            Err(e) => {
                                tally.add(format!("no answer: {:?}", e.kind()));
                                break;
                            }
                        }
                    }
                }
            });
        }
        let rotation =
            scope.spawn(|| rotate_after(&node, &source_path(&source), &new.pem(), 2 * SECOND));
        let timer = scope.spawn(|| {
            thread::sleep(6 * SECOND);
            stop.store(true, Ordering::Relaxed);
        });
        // Let the flood take hold before the first probe.
        thread::sleep(SECOND / 2);
        let probes = probe_until(
            &stop,
            |path| https_get(port, &anonymous, path, "", 5 * SECOND).map(|r| r.code),
            false,
        );
        timer.join().unwrap();
        (probes, rotation.join().unwrap())
    });

    let counts = tally.counts();
    eprintln!("flood outcomes: {counts:?}");
    eprintln!(
        "a 401 body: {:?}",
        sample.lock().unwrap_or_else(PoisonError::into_inner)
    );
    eprintln!("probes: {probes:?}");
    eprintln!("rotation: {rotation:?}");
    let mut problems = slow_probes(&probes);
    problems.extend(rotation_problem(rotation));
    if count(&counts, "401") == 0 {
        problems.push(format!("the flood got no 401: {counts:?}"));
    }
    if count(&counts, "200") > 0 {
        problems.push(format!("a chain of nobody's was accepted: {counts:?}"));
    }
    // Each refusal comes after a pause of 100 ms: at most ten a second on a connection, so
    // 16 connections over the 6 s get no more than about 960 (without the pause, thousands
    // a second).
    if count(&counts, "401") > 16 * 7 * 10 {
        problems.push(format!(
            "the flood was answered as fast as it asked: {counts:?}"
        ));
    }
    assert_none(&problems, &agent.log());
}

/// Issue 2: 300 connections that pipeline GET /metrics and never read, against an agent
/// whose descriptor limit is 256 (soft and hard).
#[test]
fn unread_pipelined_connections_under_a_low_descriptor_limit_starve_neither_probes_nor_the_loop() {
    let _serial = serial();
    let prlimit = Command::new("prlimit").arg("--version").output();
    if !common::require(
        prlimit.is_ok_and(|o| o.status.success()),
        "prlimit (util-linux) sets the agent's descriptor limit",
    ) {
        return;
    }
    let node = Node::new();
    let (old, new) = (
        Signer::new("signer-old", Algorithm::P256),
        Signer::new("signer-new", Algorithm::P256),
    );
    let source = node.source("signers.pem", old.pem());
    // Plain HTTP on loopback (--insecure-metrics, from the harness's environment).
    let agent = Agent::start_wrapped(
        &node,
        &[&source],
        &[],
        &["prlimit", "--nofile=256:256", "--"],
        |_| {},
    );
    agent.wait_listening();
    wait_until(10 * SECOND, || node.holds(old.pem()));
    let pid = agent.child.id();
    let limits = fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let nofile = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .skip(3)
        .take(2)
        .collect::<Vec<_>>();
    assert_eq!(nofile, ["256", "256"], "the agent runs under ulimit -n 256");
    let start_fds = open_fds(pid);
    let log_from = agent.log().lines().count();
    let start_cpu = common::cpu_ticks(pid);

    let mut flood: Vec<Option<TcpStream>> = (0..300)
        .map(|_| {
            let addr = SocketAddr::from(([127, 0, 0, 1], agent.port));
            let stream = TcpStream::connect_timeout(&addr, 2 * SECOND).ok()?;
            stream.set_nonblocking(true).ok()?;
            Some(stream)
        })
        .collect();
    let connected = flood.iter().filter(|s| s.is_some()).count();
    let requests: Vec<u8> = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n".repeat(64);
    let stop = AtomicBool::new(false);
    let written = AtomicUsize::new(0);
    let (probes, rotation, closed_by_agent) = thread::scope(|scope| {
        let writer = scope.spawn(|| {
            // Pipelined requests on every connection until its buffers are full, again and
            // again for 6 s; never a read.
            let deadline = Instant::now() + 6 * SECOND;
            let mut closed = 0;
            while Instant::now() < deadline {
                for slot in flood.iter_mut() {
                    let Some(stream) = slot else { continue };
                    match stream.write(&requests) {
                        Ok(n) => {
                            written.fetch_add(n, Ordering::Relaxed);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => {
                            // The agent closed it.
                            closed += 1;
                            *slot = None;
                        }
                    }
                }
                thread::sleep(Duration::from_millis(20));
            }
            stop.store(true, Ordering::Relaxed);
            closed
        });
        let rotation =
            scope.spawn(|| rotate_after(&node, &source_path(&source), &new.pem(), 2 * SECOND));
        thread::sleep(SECOND);
        let probes = probe_until(&stop, |path| agent.get(path).map(|(code, _)| code), true);
        let closed = writer.join().unwrap();
        (probes, rotation.join().unwrap(), closed)
    });
    let flood_fds = open_fds(pid);
    let flood_cpu = common::cpu_ticks(pid) - start_cpu;
    // Writes have stopped; the connections stay open and unread. A connection whose writes
    // make no progress is closed after a while: the agent's descriptors come back.
    let started = Instant::now();
    let recovered = eventually(15 * SECOND, || open_fds(pid) <= start_fds + 16);
    let recovery = started.elapsed();
    let end_fds = open_fds(pid);
    let after = agent.get("/livez");
    let log = agent.log();
    let new_lines: Vec<&str> = log.lines().skip(log_from).collect();
    let emfile = new_lines
        .iter()
        .filter(|l| l.contains("Too many open files"))
        .count();
    let accept_failures = new_lines
        .iter()
        .filter(|l| l.contains("cannot accept"))
        .count();
    eprintln!(
        "{connected} connections, {} bytes of requests written, {closed_by_agent} closed by the agent while writing",
        written.load(Ordering::Relaxed)
    );
    eprintln!(
        "descriptors: {start_fds} at start, {flood_fds} at the end of the flood, {end_fds} {recovery:.1?} after; peak memory {} MB",
        agent.peak_rss() >> 20
    );
    eprintln!("the agent's CPU during the flood: {flood_cpu} ticks");
    eprintln!("probes: {probes:?}");
    eprintln!("rotation: {rotation:?}");
    eprintln!(
        "log: {} new lines, {emfile} with Too many open files, {accept_failures} cannot accept",
        new_lines.len()
    );
    drop(flood);

    let mut problems = slow_probes(&probes);
    problems.extend(rotation_problem(rotation));
    if emfile > 0 {
        problems.push(format!(
            "{emfile} log lines say Too many open files, e.g. {:?}",
            new_lines.iter().find(|l| l.contains("Too many open files"))
        ));
    }
    if !recovered {
        problems.push(format!(
            "the agent's descriptors did not come back within 15 s of the writes stopping: {end_fds} open, {start_fds} at start"
        ));
    }
    if after.as_ref().map(|(code, _)| *code) != Some(200) {
        problems.push(format!("/livez after the flood: {after:?}"));
    }
    assert_none(&problems, &log);
}

/// Issue 3: 1,500 requests with distinct bearer tokens while every TokenReview hangs.
#[test]
fn distinct_tokens_against_a_hung_reviewer_make_few_reviews_and_quick_refusals() {
    let _serial = serial();
    let api = ApiServer::start();
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, scrapers.pem()).unwrap();
    let endpoint = Secured::new(
        &node,
        "c",
        &client_ca,
        &[
            "--authentication-token-webhook",
            "--authorized-users",
            PROMETHEUS_SA,
        ],
    );
    let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
    let agent = endpoint.start(&node, &[&source], &["--kubeconfig", &kubeconfig]);
    let pid = agent.child.id();
    let anonymous = client_config(None);
    // Reviews work before the attack.
    let token = api.issue_token(PROMETHEUS_SA, &[]);
    let bearer = format!("Authorization: Bearer {token}\r\n");
    let first = https_get(agent.port, &anonymous, "/metrics", &bearer, 10 * SECOND);
    assert_eq!(first.map(|r| r.code), Some(200));
    // Every review from now on answers after a minute: longer than the test.
    api.set_review_delay(60 * SECOND);
    let reviews_before = api.token_reviews().len();
    let (start_fds, start_rss) = (open_fds(pid), rss(pid));

    const REQUESTS: usize = 1500;
    const CLIENTS: usize = 32;
    // The last few requests carry tokens the API server did issue: one refused for want of
    // a review slot must be reviewed once a slot is free, its 503 not kept as its verdict.
    let issued: Vec<String> = (0..10)
        .map(|_| api.issue_token(PROMETHEUS_SA, &[]))
        .collect();
    let refused_issued = Mutex::new(Vec::<String>::new());
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let tally = Tally::default();
    let (max_fds, max_api) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let api_port = api.port();
    let port = agent.port;
    let started = Instant::now();
    thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                max_fds.fetch_max(open_fds(pid), Ordering::Relaxed);
                max_api.fetch_max(connections_to(pid, api_port), Ordering::Relaxed);
                thread::sleep(Duration::from_millis(20));
            }
        });
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                scope.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        // Bounded in count and in time, however slowly the agent answers.
                        if i >= REQUESTS || started.elapsed() > 30 * SECOND {
                            return;
                        }
                        let token = match (i + issued.len()).checked_sub(REQUESTS) {
                            Some(k) => issued[k].clone(),
                            None => format!("distinct-token-{i:05}-nobody-issued-it"),
                        };
                        let header = format!("Authorization: Bearer {token}\r\n");
                        match https_get(port, &anonymous, "/metrics", &header, 3 * SECOND) {
                            Some(r) => {
                                tally.add(r.code.to_string());
                                if issued.contains(&token) && matches!(r.code, 429 | 503) {
                                    refused_issued
                                        .lock()
                                        .unwrap_or_else(PoisonError::into_inner)
                                        .push(token);
                                }
                            }
                            None => tally.add("no answer within 3 s"),
                        }
                    }
                })
            })
            .collect();
        for client in clients {
            client.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        sampler.join().unwrap();
    });
    let took = started.elapsed();
    let counts = tally.counts();
    let sent: usize = counts.values().sum();
    let reviews = api.token_reviews().len() - reviews_before;
    let (max_fds, max_api) = (max_fds.into_inner(), max_api.into_inner());
    let peak = agent.peak_rss();
    // The reviewer answers again: a token turned away for want of a slot is now reviewed.
    api.set_review_delay(Duration::ZERO);
    let retried = refused_issued
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
        .pop()
        .map(|token| {
            let header = format!("Authorization: Bearer {token}\r\n");
            let mut last = None;
            let admitted = eventually(15 * SECOND, || {
                last = https_get(port, &anonymous, "/metrics", &header, 5 * SECOND)
                    .map(|r| (r.code, r.body));
                last.as_ref().is_some_and(|(code, _)| *code == 200)
            });
            (admitted, last)
        });
    eprintln!("{sent} requests in {took:.1?}: {counts:?}");
    eprintln!("an issued token refused during the flood, asked again: {retried:?}");
    eprintln!(
        "TokenReviews received: {reviews}; at most {max_api} connections to the API server at once"
    );
    eprintln!(
        "descriptors: {start_fds} at start, at most {max_fds}; memory: {} MB at start, peak {} MB",
        start_rss >> 20,
        peak >> 20
    );

    let mut problems = Vec::new();
    if sent < REQUESTS {
        problems.push(format!(
            "only {sent} of {REQUESTS} requests were made in 30 s: they were not refused quickly"
        ));
    }
    if max_api > 12 {
        problems.push(format!(
            "{max_api} connections to the API server at once (reviews in flight should be about 8)"
        ));
    }
    if max_fds >= 100 {
        problems.push(format!(
            "{max_fds} descriptors open at once ({start_fds} at start)"
        ));
    }
    if peak >= 40 << 20 {
        problems.push(format!("peak resident memory {} MB", peak >> 20));
    }
    if count(&counts, "200") > 0 {
        problems.push(format!(
            "a token got 200 while no review could be answered: {counts:?}"
        ));
    }
    if let Some((false, last)) = retried {
        problems.push(format!(
            "a good token refused during the flood is still refused 15 s after the reviewer recovered: {last:?}"
        ));
    }
    let refused = count(&counts, "503") + count(&counts, "429");
    // The requests that hold one of the few review slots wait for their (hung) review;
    // every other one is refused at once.
    if sent - refused > 16 {
        problems.push(format!(
            "{} requests were neither 503 nor 429: {counts:?}",
            sent - refused
        ));
    }
    assert_none(&problems, &agent.log());
}

/// Issue 4: the serving key stops matching its certificate (a half-done rotation), then a
/// signer is removed from the client CA file.
#[test]
fn a_serving_key_that_does_not_match_does_not_freeze_the_client_ca() {
    let _serial = serial();
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let (kept, removed) = (
        Signer::new("scrapers-kept", Algorithm::P256),
        Signer::new("scrapers-removed", Algorithm::P256),
    );
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, kept.pem() + &removed.pem()).unwrap();
    let endpoint = Secured::new(
        &node,
        "d",
        &client_ca,
        &["--authorized-users", "prometheus"],
    );
    let agent = endpoint.start(&node, &[&source], &[]);
    let of_kept = client_config(Some(client_of(&kept, "prometheus")));
    let of_removed = client_config(Some(client_of(&removed, "prometheus")));
    let code = |config: &Arc<ClientConfig>| {
        https_get(agent.port, config, "/metrics", "", 5 * SECOND).map(|r| r.code)
    };
    assert_eq!(code(&of_kept), Some(200));
    assert_eq!(code(&of_removed), Some(200));

    // Another key where the serving key was: the pair cannot be loaded.
    let log_from = agent.log().lines().count();
    replace(
        &endpoint.key,
        Signer::new("not-the-serving-key", Algorithm::P256).key_pem(),
    );
    let noticed = eventually(5 * SECOND, || !warnings_since(&agent, log_from).is_empty());
    eprintln!(
        "the bad key noticed: {noticed}; {:?}",
        warnings_since(&agent, log_from)
    );
    // The removed signer leaves the client CA.
    replace(&client_ca, kept.pem());
    let started = Instant::now();
    let refused = eventually(5 * SECOND, || code(&of_removed) == Some(401));
    let took = started.elapsed();
    let last = https_get(agent.port, &of_removed, "/metrics", "", 5 * SECOND);
    eprintln!("removed signer refused: {refused} after {took:.2?}; last answer {last:?}");

    let mut problems = Vec::new();
    if !refused {
        problems.push(format!(
            "the removed signer's client still gets {:?} 5 s after its signer left the client CA",
            last.map(|r| r.code)
        ));
    }
    if code(&of_kept) != Some(200) {
        problems.push("the kept signer's client is refused".to_string());
    }
    let anonymous = client_config(None);
    let live = https_get(agent.port, &anonymous, "/livez", "", 5 * SECOND).map(|r| r.code);
    if live != Some(200) {
        problems.push(format!("/livez with the bad serving key: {live:?}"));
    }
    assert_none(&problems, &agent.log());
}

/// Issue 5: a cluster source the agent may not read fails with an error that names the
/// agent's user; anybody may read `/readyz?verbose`, and anybody may send a token that
/// cannot be checked.
#[test]
fn anonymous_clients_see_which_checks_failed_but_not_why() {
    let _serial = serial();
    let api = ApiServer::start();
    // The agent's identity may do nothing: its source is forbidden, and so are its reviews.
    api.restrict_to(vec![]);
    let node = Node::new();
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, scrapers.pem()).unwrap();
    let endpoint = Secured::new(
        &node,
        "e",
        &client_ca,
        &[
            "--authentication-token-webhook",
            "--authorized-users",
            "prometheus",
        ],
    );
    let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
    let spec = "configmap:openshift-config-managed/kube-apiserver-client-ca";
    let local = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let agent = endpoint.start(&node, &[spec, &local], &["--kubeconfig", &kubeconfig]);
    let anonymous = client_config(None);
    let authorized = client_config(Some(client_of(&scrapers, "prometheus")));
    let failed_line = format!("[-]source:{spec} failed");
    let verbose = |config: &Arc<ClientConfig>| {
        https_get(agent.port, config, "/readyz?verbose", "", 5 * SECOND)
            .map(|r| r.body)
            .unwrap_or_default()
    };

    // The authorized client sees why the source failed: the API server's words.
    let mut reason = String::new();
    let shown = eventually(15 * SECOND, || {
        reason = verbose(&authorized);
        reason.contains(&failed_line) && reason.contains(AGENT_USER)
    });
    let page = verbose(&anonymous);
    let token = https_get(
        agent.port,
        &anonymous,
        "/metrics",
        "Authorization: Bearer a-token-the-agent-cannot-check\r\n",
        10 * SECOND,
    );
    eprintln!("authorized:\n{reason}\nanonymous:\n{page}\ntoken: {token:?}");

    let mut problems = Vec::new();
    if !shown {
        problems.push(format!(
            "an authorized client does not see why the source failed:\n{reason}"
        ));
    }
    if !page.contains(&failed_line) {
        problems.push(format!(
            "the anonymous page does not say the source failed:\n{page}"
        ));
    }
    for check in ["bundle-valid", "in-sync", &format!("source:{local}")] {
        if !page.contains(check) {
            problems.push(format!("the anonymous page does not name {check}:\n{page}"));
        }
    }
    // The reasons withheld: the API server's words, and the bundle's own problem.
    let shown = |text: &str, secrets: &[&'static str]| -> Vec<&'static str> {
        secrets
            .iter()
            .copied()
            .filter(|s| text.contains(s))
            .collect()
    };
    let leaked = shown(
        &page,
        &[AGENT_USER, "forbidden", "cannot list", "does not exist"],
    );
    if !leaked.is_empty() {
        problems.push(format!("the anonymous page shows {leaked:?}:\n{page}"));
    }
    // A 503: the token was not judged (issue 24).
    match &token {
        Some(r) if r.code == 503 => {
            let leaked = shown(&r.body, &[AGENT_USER, "forbidden", "tokenreviews"]);
            if !leaked.is_empty() {
                problems.push(format!(
                    "the 503 for a token that could not be checked shows {leaked:?}: {:?}",
                    r.body
                ));
            }
        }
        other => problems.push(format!(
            "a token that cannot be checked: {other:?}, not 503"
        )),
    }
    // The detail is not lost: it goes to the log.
    let log = agent.log();
    if !log.contains("tokenreviews") {
        problems.push("the log does not say why the token could not be checked".to_string());
    }
    assert_none(&problems, &log);
}

/// Issue 6: the API server is gone, and requests with bearer tokens keep coming.
#[test]
fn a_reviewer_that_is_down_is_logged_a_few_times_not_once_per_request() {
    let _serial = serial();
    let api = ApiServer::start();
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, scrapers.pem()).unwrap();
    let endpoint = Secured::new(
        &node,
        "f",
        &client_ca,
        &[
            "--authentication-token-webhook",
            "--authorized-users",
            PROMETHEUS_SA,
        ],
    );
    let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
    let agent = endpoint.start(&node, &[&source], &["--kubeconfig", &kubeconfig]);
    let anonymous = client_config(None);
    let works = api.issue_token(PROMETHEUS_SA, &[]);
    let header = |token: &str| format!("Authorization: Bearer {token}\r\n");
    let first = https_get(
        agent.port,
        &anonymous,
        "/metrics",
        &header(&works),
        10 * SECOND,
    );
    assert_eq!(first.map(|r| r.code), Some(200), "reviews work at first");
    // A token never reviewed, so that its verdict is not remembered from before.
    let token = api.issue_token(PROMETHEUS_SA, &[]);
    api.stop();
    let log_from = agent.log().lines().count();

    let next = AtomicUsize::new(0);
    let tally = Tally::default();
    let port = agent.port;
    let started = Instant::now();
    thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= 550 || started.elapsed() > 60 * SECOND {
                        return;
                    }
                    // 500 requests with the one token, then 50 with tokens of their own.
                    let token = if i < 500 {
                        token.clone()
                    } else {
                        format!("another-token-{i}")
                    };
                    match https_get(port, &anonymous, "/metrics", &header(&token), 10 * SECOND) {
                        Some(r) => tally.add(r.code.to_string()),
                        None => tally.add("no answer"),
                    }
                }
            });
        }
    });
    let took = started.elapsed();
    thread::sleep(SECOND / 2);
    let warnings = warnings_since(&agent, log_from);
    let counts = tally.counts();
    eprintln!(
        "550 requests in {took:.1?}: {counts:?}; {} WARN/ERROR lines",
        warnings.len()
    );
    for line in warnings.iter().take(5) {
        eprintln!("  {line}");
    }

    let mut problems = Vec::new();
    if warnings.len() > 5 {
        problems.push(format!(
            "{} WARN/ERROR lines for 550 requests while the API server is down, e.g. {:?}",
            warnings.len(),
            warnings.first()
        ));
    }
    if count(&counts, "no answer") > 0 || count(&counts, "200") > 0 {
        problems.push(format!(
            "every request is refused, at once, while no token can be checked: {counts:?}"
        ));
    }
    assert_none(&problems, &agent.log());
}

/// Issue 7: a client certificate whose subject is `CN=first, CN=second`. Go's crypto/x509
/// (and so the API server and the kubelet) keeps the last CN as the common name.
#[test]
fn a_subject_with_two_common_names_is_the_user_of_the_last() {
    let _serial = serial();
    let scrapers = Ca::new(dn("scrapers"));
    // rcgen keeps one value per attribute type: the second CN goes in under its OID spelt
    // out, which rcgen counts as another type.
    let mut subject = dn("first");
    subject.push(
        DnType::CustomDnType(vec![2, 5, 4, 3]),
        DnValue::Utf8String("second".into()),
    );
    let (cert, key) = scrapers.issue_client(subject);
    let text = cert_subject(&cert);
    assert!(
        text.contains("CN=first") && text.contains("CN=second"),
        "two CNs in the subject: {text}"
    );
    let client = client_config(Some(identity(vec![cert], &key)));

    // One agent per node: a node's state directory belongs to one running agent.
    let allowing = |user: &str| {
        let node = Node::new();
        let source = node.source(
            "signers.pem",
            Signer::new("kubelet-signer", Algorithm::P256).pem(),
        );
        let client_ca = node.root().join("scrapers-ca.crt");
        fs::write(&client_ca, &scrapers.pem).unwrap();
        let agent = Secured::new(&node, user, &client_ca, &["--authorized-users", user]).start(
            &node,
            &[&source],
            &[],
        );
        (agent, node)
    };
    let (allows_second, _second_node) = allowing("second");
    let (allows_first, _first_node) = allowing("first");
    let get = |agent: &Agent| https_get(agent.port, &client, "/metrics", "", 5 * SECOND);
    let (as_second, as_first) = (get(&allows_second), get(&allows_first));
    eprintln!("subject {text}\nallowing second: {as_second:?}\nallowing first: {as_first:?}");

    let mut problems = Vec::new();
    if as_second.as_ref().map(|r| r.code) != Some(200) {
        problems.push(format!(
            "with --authorized-users second: {:?}, not 200",
            as_second.map(|r| (r.code, r.body))
        ));
    }
    if as_first.as_ref().map(|r| r.code) != Some(403) {
        problems.push(format!(
            "with --authorized-users first: {:?}, not 403",
            as_first.map(|r| (r.code, r.body))
        ));
    }
    let log = allows_second.log() + &allows_first.log();
    assert_none(&problems, &log);
}

/// The subject of a certificate as openssl prints it (RFC 2253, `CN=second,CN=first`).
fn cert_subject(cert: &CertificateDer<'_>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("client.der");
    fs::write(&path, cert.as_ref()).unwrap();
    let out = Command::new("openssl")
        .args([
            "x509", "-inform", "DER", "-noout", "-subject", "-nameopt", "RFC2253", "-in",
        ])
        .arg(&path)
        .output()
        .expect("openssl is installed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
