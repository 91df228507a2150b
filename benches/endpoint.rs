//! The secured endpoint and a local source's rotation (SPEC 11), for
//! `cargo bench --bench endpoint`. It runs the real binary and ends with one summary table:
//!
//! - `/metrics` over mutual TLS, the deploy-ready mode (a serving certificate, client
//!   certificates from `--client-ca-file`, a static allow-list), with 10 and 1,000
//!   certificates in the bundle: 200 scrapes after 5 warm-up ones, each on a new TCP
//!   connection with a full TLS handshake (a P-256 client certificate; session resumption
//!   off on the client, as Go's TLS client has it by default, so every handshake is whole),
//!   read to the end. The same over one kept-alive connection is shown for context (what
//!   Prometheus does between scrapes that are closer than the agent's 30 s idle timeout).
//! - The same scrapes at 10 certificates while 300 idle connections are open (200 that
//!   never send a byte, 100 that sent the first bytes of a ClientHello), beside the figures
//!   without them.
//! - A rotation through a `file:` source by `mv`: the new bundle written beside the source
//!   and renamed over it; the clock starts just before the rename and stops when the
//!   agent's `bundle written` log line for the new bundle's SHA-256 is read from its stderr
//!   (emitted after the directory fsync: the file is durable). Beside it, in the same run,
//!   the bare write + fsync + rename + fsync of the same bytes on the same filesystem.
//!
//! Under `cargo test --benches` it runs a short version of each as a smoke test.

#[path = "support/agent.rs"]
mod agent;
#[path = "support/clock.rs"]
mod clock;
#[path = "support/report.rs"]
mod report;
#[path = "support/signers.rs"]
mod signers;

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agent::{Agent, bare_replace, p50_p99, sha256_hex};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use report::{Table, ms};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use signers::KeyPool;

struct Run {
    full: bool,
    large: usize,
    scrapes: usize,
    rotations: usize,
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let run = if full {
        Run {
            full,
            large: 1000,
            scrapes: 200,
            rotations: 300,
        }
    } else {
        println!(
            "(smoke run of the endpoint benchmark: a debug build and few iterations; `cargo bench --bench endpoint` gives the figures)"
        );
        Run {
            full,
            large: 100,
            scrapes: 5,
            rotations: 5,
        }
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pool = KeyPool::new(if full { 32 } else { 4 });
    let mut table = Table::new("endpoint: /metrics over mTLS, and mv rotations", !full);
    let pki = Pki::new();
    let baseline = scrapes_over_tls(&run, &pool, &pki, 10, &mut table);
    scrapes_over_tls(&run, &pool, &pki, run.large, &mut table);
    scrapes_beside_idle_connections(&run, &pool, &pki, baseline, &mut table);
    mv_rotations(&run, &pool, &mut table);
    table.print();
}

/// A serving CA and certificate for the agent, and a scraper's client certificate.
struct Pki {
    serving: (String, String),
    client_ca: String,
    client: rustls::ClientConfig,
}

impl Pki {
    fn new() -> Pki {
        let ca = |name: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            let cert = params.self_signed(&key).unwrap();
            (cert, Issuer::new(params, key))
        };
        let leaf = |names: Vec<String>, cn: &str, usage, issuer: &Issuer<'_, KeyPair>| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(names).unwrap();
            params.distinguished_name.push(DnType::CommonName, cn);
            params.extended_key_usages = vec![usage];
            (params.signed_by(&key, issuer).unwrap(), key)
        };
        let (serving_ca, serving_issuer) = ca("bench-serving-ca");
        let (scrapers, scrapers_issuer) = ca("bench-scrapers");
        let (server, server_key) = leaf(
            vec!["localhost".into(), "127.0.0.1".into()],
            "localhost",
            ExtendedKeyUsagePurpose::ServerAuth,
            &serving_issuer,
        );
        let (client, client_key) = leaf(
            vec![],
            "prometheus",
            ExtendedKeyUsagePurpose::ClientAuth,
            &scrapers_issuer,
        );
        let mut roots = rustls::RootCertStore::empty();
        roots.add(serving_ca.der().clone()).unwrap();
        let mut config = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_client_auth_cert(
                vec![client.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(client_key.serialize_der())),
            )
            .unwrap();
        // A full handshake on every new connection, as a Go scraper without a session
        // cache makes.
        config.resumption = rustls::client::Resumption::disabled();
        Pki {
            serving: (server.pem(), server_key.serialize_pem()),
            client_ca: scrapers.pem(),
            client: config,
        }
    }

    /// The endpoint's flags for an agent whose files go under `dir`.
    fn server_flags(&self, dir: &Path) -> Vec<String> {
        let tls = dir.join("tls");
        fs::create_dir_all(&tls).unwrap();
        fs::write(tls.join("tls.crt"), &self.serving.0).unwrap();
        fs::write(tls.join("tls.key"), &self.serving.1).unwrap();
        fs::write(tls.join("scrapers.crt"), &self.client_ca).unwrap();
        let path = |name: &str| tls.join(name).to_str().unwrap().to_string();
        vec![
            "--tls-cert-file".into(),
            path("tls.crt"),
            "--tls-private-key-file".into(),
            path("tls.key"),
            "--client-ca-file".into(),
            path("scrapers.crt"),
            "--authorized-users".into(),
            "prometheus".into(),
        ]
    }
}

/// A TLS connection to the agent.
type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

fn connect(pki: &Pki, port: u16) -> Tls {
    let tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_nodelay(true).unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(pki.client.clone()), name).unwrap();
    rustls::StreamOwned::new(conn, tcp)
}

/// One GET /metrics on `stream`, read to the end of its body (by Content-Length); the
/// body's size.
fn get_metrics(stream: &mut Tls) -> usize {
    try_metrics(stream).expect("GET /metrics over mTLS")
}

fn try_metrics(stream: &mut Tls) -> std::io::Result<usize> {
    use std::io::{Error, ErrorKind};
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")?;
    let mut buf = Vec::with_capacity(1 << 20);
    let mut chunk = [0u8; 64 * 1024];
    let closed = || Error::new(ErrorKind::UnexpectedEof, "the connection closed");
    let (head_end, length) = loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(closed());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            if !head.starts_with("http/1.1 200") {
                return Err(Error::other(head));
            }
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| Error::other("no Content-Length"))?;
            break (end + 4, length);
        }
    };
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(closed());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(length)
}

/// `count` scrapes, each on a new connection (handshake included), after 5 warm-up ones.
fn timed_scrapes(pki: &Pki, port: u16, count: usize) -> (Vec<Duration>, usize) {
    let mut size = 0;
    for _ in 0..5 {
        size = get_metrics(&mut connect(pki, port));
    }
    let samples = (0..count)
        .map(|_| {
            let start = Instant::now();
            get_metrics(&mut connect(pki, port));
            start.elapsed()
        })
        .collect();
    (samples, size)
}

/// An agent on a `file:` source of `n` certificates, serving mTLS; waits until its
/// metrics show all of them.
fn serving_agent(pool: &KeyPool, pki: &Pki, n: usize) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("sources/bundle.crt");
    fs::create_dir_all(source.parent().unwrap()).unwrap();
    let content = pool.bundle(n, "scraped");
    fs::write(&source, &content).unwrap();
    let flags = pki.server_flags(dir.path());
    let agent = Agent::start_serving(
        dir,
        &[format!("file:{}", source.display())],
        None,
        None,
        &flags,
    );
    agent.wait_holds(&content, Duration::from_secs(30));
    let waited = Instant::now();
    loop {
        let body = try_metrics(&mut connect(pki, agent.port)).unwrap_or(0);
        // Each certificate's series are a few hundred bytes: all of them are there once the
        // body is at least that large and stops growing.
        if body > n * 300 {
            let again = get_metrics(&mut connect(pki, agent.port));
            if again == body {
                break;
            }
        }
        assert!(
            waited.elapsed() < Duration::from_secs(20),
            "/metrics shows {n} certificates"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    agent
}

/// Scrapes over mTLS at `n` certificates; returns the (p50, p99) on new connections.
fn scrapes_over_tls(
    run: &Run,
    pool: &KeyPool,
    pki: &Pki,
    n: usize,
    table: &mut Table,
) -> (Duration, Duration) {
    let agent = serving_agent(pool, pki, n);
    let (mut samples, size) = timed_scrapes(pki, agent.port, run.scrapes);
    let (p50, p99) = p50_p99(&mut samples);
    let measured = format!("p50 {}, p99 {}", ms(p50), ms(p99));
    let metric = format!(
        "/metrics over mTLS, {n} certificates ({} KiB), new connection + full handshake each, p99 of {}",
        size / 1024,
        run.scrapes
    );
    if n >= 1000 || !run.full {
        table.check(
            &metric,
            "< 10 ms",
            measured,
            p99 < Duration::from_millis(10),
        );
    } else {
        table.info(&metric, measured);
    }
    let mut stream = connect(pki, agent.port);
    get_metrics(&mut stream);
    let mut kept: Vec<Duration> = (0..run.scrapes)
        .map(|_| {
            let start = Instant::now();
            get_metrics(&mut stream);
            start.elapsed()
        })
        .collect();
    let (k50, k99) = p50_p99(&mut kept);
    table.info(
        &format!("/metrics over mTLS, {n} certificates, one kept-alive connection"),
        format!("p50 {}, p99 {}", ms(k50), ms(k99)),
    );
    (p50, p99)
}

/// Scrapes at 10 certificates while 300 idle connections are open.
fn scrapes_beside_idle_connections(
    run: &Run,
    pool: &KeyPool,
    pki: &Pki,
    (base50, base99): (Duration, Duration),
    table: &mut Table,
) {
    let agent = serving_agent(pool, pki, 10);
    let idle: Vec<TcpStream> = (0..300)
        .map(|i| {
            let mut stream = TcpStream::connect(("127.0.0.1", agent.port)).unwrap();
            if i % 3 == 0 {
                // The first bytes of a TLS record header, and nothing more.
                stream.write_all(b"\x16\x03\x01").unwrap();
            }
            stream
        })
        .collect();
    let started = Instant::now();
    let (mut samples, _) = timed_scrapes(pki, agent.port, run.scrapes);
    let took = started.elapsed();
    let (p50, p99) = p50_p99(&mut samples);
    // The agent drops a connection that has not finished its handshake in 10 s: the
    // figures count only if the idle connections were still open throughout.
    assert!(
        took < Duration::from_secs(9),
        "the scrapes took {took:?}: the idle connections may have been dropped meanwhile"
    );
    table.check(
        &format!(
            "/metrics over mTLS, 10 certificates, with 300 idle connections open, p99 of {}",
            run.scrapes
        ),
        "< 10 ms",
        format!(
            "p50 {}, p99 {} (without them: p50 {}, p99 {})",
            ms(p50),
            ms(p99),
            ms(base50),
            ms(base99)
        ),
        p99 < Duration::from_millis(10),
    );
    drop(idle);
}

/// Rotations of a `file:` source by `mv`, against the bare replace of the same bytes.
fn mv_rotations(run: &Run, pool: &KeyPool, table: &mut Table) {
    let dir = tempfile::tempdir().unwrap();
    let sources = dir.path().join("sources");
    fs::create_dir_all(&sources).unwrap();
    let source = sources.join("bundle.crt");
    let bundles = [pool.bundle(10, "mv-a"), pool.bundle(10, "mv-b")];
    let hashes = [
        sha256_hex(bundles[0].as_bytes()),
        sha256_hex(bundles[1].as_bytes()),
    ];
    fs::write(&source, &bundles[0]).unwrap();
    let agent = Agent::start(dir, &[format!("file:{}", source.display())], None, None);
    agent.wait_holds(&bundles[0], Duration::from_secs(20));
    let bare_dir = tempfile::tempdir_in(agent.dir.path()).unwrap();
    let staged = sources.join(".bundle.crt.new");

    let mut to_durable = Vec::new();
    let mut bare = Vec::new();
    for i in 1..=run.rotations {
        let (next, hash) = (&bundles[i % 2], &hashes[i % 2]);
        // What a `mv` rotation does: the new file is complete before it is renamed in.
        fs::write(&staged, next).unwrap();
        while agent.lines.try_recv().is_ok() {}
        let start = Instant::now();
        fs::rename(&staged, &source).unwrap();
        let durable = loop {
            let (at, line) = agent
                .lines
                .recv_timeout(Duration::from_secs(10))
                .expect("the agent logs `bundle written` within 10 s");
            if line.contains("bundle written") && line.contains(hash.as_str()) {
                break at;
            }
        };
        to_durable.push(durable.saturating_duration_since(start));
        assert!(agent.holds(next), "the file holds the new bundle");
        bare.push(bare_replace(bare_dir.path(), next.as_bytes()).1);
    }
    let (p50, p99) = p50_p99(&mut to_durable);
    let (b50, b99) = p50_p99(&mut bare);
    let ratio = p50.as_secs_f64() / b50.as_secs_f64();
    table.check(
        &format!(
            "mv rotation of a file: source (10 certificates) -> file durable, p50 / bare write+fsync+rename+fsync p50, of {}",
            run.rotations
        ),
        "<= 2x",
        format!(
            "{ratio:.2}x (p50 {}, p99 {}; bare p50 {}, p99 {})",
            ms(p50),
            ms(p99),
            ms(b50),
            ms(b99)
        ),
        ratio <= 2.0,
    );
}
