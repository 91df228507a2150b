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
//! - Figures under attack, each attack against an agent of its own (10 certificates, mutual
//!   TLS with the allow-list as above, and `--authentication-token-webhook` reviewed by the
//!   local test API server), in the same run: first the figures WITHOUT the attack, then
//!   the attack is started, and once every attacker is engaged (connected and its first
//!   request sent) the same figures are taken WHILE it runs. Each window lasts 4 s; two
//!   threads of their own take the figures, paced evenly over it (200 of each at most):
//!   `/livez` as the kubelet probes it (a new connection, TLS without a client certificate,
//!   `Connection: close`), and a scrape as above (a new connection, a full handshake with
//!   the scraper's certificate), each timed from the connect to the end of the body; one
//!   that fails or takes over 10 s counts as failed, with the time it took. Targets: p99
//!   within 2x of the figure without the attack, and `/livez` p99 under 100 ms. The attacks,
//!   all from this process, each stopping by itself (in time and in requests):
//!   1. a chain flood: 16 threads, each on its own kept-alive connection, presenting a
//!      client certificate (CN `prometheus`) signed by nobody the agent trusts followed by
//!      10 self-signed CA certificates that share the name it was issued in (all made
//!      with rcgen at run time), sending GET /metrics and reading each answer;
//!   2. unread pipelined connections: 300 connections, each completing the handshake with
//!      the valid client certificate, then writing 2,000 pipelined GET /metrics (in
//!      batches of 50) and never reading, held open until the attack ends;
//!   3. distinct bearer tokens: 64 threads, each on its own kept-alive connection without a
//!      client certificate, sending GET /metrics with a new bearer token each time (each
//!      costs a TokenReview: the API server answers each after 200 ms).
//!
//!   Beside each, a line with the attack's own throughput over the same window (answers or
//!   requests written per second; for the tokens, the TokenReviews the API server got), the
//!   agent's CPU time over it and its RSS at its end; for the pipelining attack, the bytes
//!   waiting in the kernel on the agent's connections at its end (/proc/net/tcp).
//! - A rotation through a `file:` source by `mv`: the new bundle written beside the source
//!   and renamed over it; the clock starts just before the rename and stops when the
//!   agent's `bundle written` log line for the new bundle's SHA-256 is read from its stderr
//!   (emitted after the directory fsync: the file is durable). Beside it, in the same run,
//!   the bare write + fsync + rename + fsync of the same bytes on the same filesystem.
//!
//! `cargo bench --bench endpoint -- attacks` runs only the attacks (also `scrapes`,
//! `rotations`; several may be named).
//!
//! Under `cargo test --benches` it runs a short version of each as a smoke test (the attacks
//! 0.3 s each, with 4 flooding threads, 30 unread connections and 8 token threads); no
//! target is judged then.

#[path = "support/agent.rs"]
mod agent;
#[path = "../tests/common/apiserver.rs"]
mod apiserver;
#[path = "support/clock.rs"]
mod clock;
#[path = "support/report.rs"]
mod report;
#[path = "support/signers.rs"]
mod signers;

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use agent::{Agent, bare_replace, p50_p99, sha256_hex};
use apiserver::ApiServer;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair,
};
use report::{Table, ms};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use signers::KeyPool;

struct Run {
    full: bool,
    large: usize,
    scrapes: usize,
    rotations: usize,
    /// How long each attack runs once engaged (its figures are taken meanwhile), and how
    /// long the figures without it are taken for.
    attack: Duration,
    /// At most this many /livez probes, and as many scrapes, in each window.
    probes: usize,
    /// A probe, a scrape or an attacker's read or write that takes longer has failed.
    timeout: Duration,
    /// Threads of the chain flood, each on a connection of its own.
    flood_threads: usize,
    /// Connections that pipeline requests and never read, and how many requests each
    /// writes at most.
    unread_connections: usize,
    pipelined: u64,
    /// Threads sending distinct bearer tokens.
    token_threads: usize,
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let run = if full {
        Run {
            full,
            large: 1000,
            scrapes: 200,
            rotations: 300,
            attack: Duration::from_secs(4),
            probes: 200,
            timeout: Duration::from_secs(10),
            flood_threads: 16,
            unread_connections: 300,
            pipelined: 2000,
            token_threads: 64,
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
            attack: Duration::from_millis(300),
            probes: 5,
            timeout: Duration::from_secs(1),
            flood_threads: 4,
            unread_connections: 30,
            pipelined: 200,
            token_threads: 8,
        }
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pool = KeyPool::new(if full { 32 } else { 4 });
    let mut table = Table::new("endpoint: /metrics over mTLS, and mv rotations", !full);
    let pki = Pki::new();
    // `cargo bench --bench endpoint -- attacks` (or scrapes, rotations): those parts only.
    let parts: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let part = |name: &str| parts.is_empty() || parts.iter().any(|p| p == name);
    if part("scrapes") {
        let baseline = scrapes_over_tls(&run, &pool, &pki, 10, &mut table);
        scrapes_over_tls(&run, &pool, &pki, run.large, &mut table);
        scrapes_beside_idle_connections(&run, &pool, &pki, baseline, &mut table);
    }
    if part("attacks") {
        figures_under_attack(&run, &pool, &pki, &mut table);
    }
    if part("rotations") {
        mv_rotations(&run, &pool, &mut table);
    }
    table.print();
}

/// A serving CA and certificate for the agent, and a scraper's client certificate.
struct Pki {
    serving: (String, String),
    client_ca: String,
    /// A scraper: the serving CA trusted, the client certificate presented.
    client: Arc<rustls::ClientConfig>,
    /// A health prober: the serving CA trusted, no client certificate.
    anonymous: Arc<rustls::ClientConfig>,
    roots: rustls::RootCertStore,
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
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(
                vec![client.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(client_key.serialize_der())),
            )
            .unwrap();
        // A full handshake on every new connection, as a Go scraper without a session
        // cache makes.
        config.resumption = rustls::client::Resumption::disabled();
        let mut anonymous = rustls::ClientConfig::builder()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
        anonymous.resumption = rustls::client::Resumption::disabled();
        Pki {
            serving: (server.pem(), server_key.serialize_pem()),
            client_ca: scrapers.pem(),
            client: Arc::new(config),
            anonymous: Arc::new(anonymous),
            roots,
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
    let conn = rustls::ClientConnection::new(pki.client.clone(), name).unwrap();
    rustls::StreamOwned::new(conn, tcp)
}

/// One GET /metrics on `stream`, read to the end of its body (by Content-Length); the
/// body's size.
fn get_metrics(stream: &mut Tls) -> usize {
    try_metrics(stream).expect("GET /metrics over mTLS")
}

fn try_metrics(stream: &mut Tls) -> io::Result<usize> {
    stream.write_all(METRICS)?;
    match read_response(stream)? {
        (200, length) => Ok(length),
        (status, _) => Err(io::Error::other(format!("HTTP {status}"))),
    }
}

/// A scrape's request, as the rest of this benchmark sends it.
const METRICS: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";

/// One response read to the end of its body (by Content-Length): its status and the body's
/// size.
fn read_response(stream: &mut Tls) -> io::Result<(u16, usize)> {
    use std::io::{Error, ErrorKind};
    let mut buf = Vec::with_capacity(1 << 20);
    let mut chunk = [0u8; 64 * 1024];
    let closed = || Error::new(ErrorKind::UnexpectedEof, "the connection closed");
    let (head_end, status, length) = loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(closed());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let status = head
                .strip_prefix("http/1.1 ")
                .and_then(|rest| rest.get(..3))
                .and_then(|code| code.parse::<u16>().ok())
                .ok_or_else(|| Error::other(head.clone()))?;
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| Error::other("no Content-Length"))?;
            break (end + 4, status, length);
        }
    };
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(closed());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok((status, length))
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
    serving_agent_with(pool, pki, n, None, &[])
}

/// [`serving_agent`] with a kubeconfig and more endpoint flags.
fn serving_agent_with(
    pool: &KeyPool,
    pki: &Pki,
    n: usize,
    kubeconfig: Option<&Path>,
    more: &[String],
) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("sources/bundle.crt");
    fs::create_dir_all(source.parent().unwrap()).unwrap();
    let content = pool.bundle(n, "scraped");
    fs::write(&source, &content).unwrap();
    let mut flags = pki.server_flags(dir.path());
    flags.extend_from_slice(more);
    let agent = Agent::start_serving(
        dir,
        &[format!("file:{}", source.display())],
        kubeconfig,
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

/// How long the test API server takes to answer each TokenReview during the token attack:
/// a slow reviewer, so that reviews pile up unless the agent bounds them.
const REVIEW_DELAY: Duration = Duration::from_millis(200);

/// A health probe's request: what the kubelet's httpGet probe sends, one per connection.
const LIVEZ: &[u8] = b"GET /livez HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

/// `/livez` and a scrape's p99 while each attack runs, beside the same without it: each
/// attack against an agent of its own (mutual TLS with an allow-list, as the deploy
/// manifests have it, and bearer tokens reviewed by a local API server), the figures
/// without the attack taken from that same agent just before it.
fn figures_under_attack(run: &Run, pool: &KeyPool, pki: &Pki, table: &mut Table) {
    let api = ApiServer::start();
    api.set_review_delay(REVIEW_DELAY);
    let tokens = ["--authentication-token-webhook".to_string()];
    let agent = || serving_agent_with(pool, pki, 10, Some(api.kubeconfig()), &tokens);
    chain_flood(run, pki, agent(), table);
    unread_pipelined(run, pki, agent(), table);
    distinct_tokens(run, pki, agent(), &api, table);
}

/// Attack 1: `run.flood_threads` connections presenting the flood's chain, each sending
/// GET /metrics again as soon as it is answered.
fn chain_flood(run: &Run, pki: &Pki, agent: Agent, table: &mut Table) {
    let flood = Arc::new(chain_flood_config(pki));
    let without = probe_window(run, pki, agent.port);
    let attack = Attack::start(run, run.flood_threads, |shared| {
        (0..run.flood_threads)
            .map(|_| {
                let (config, shared, port) = (flood.clone(), shared.clone(), agent.port);
                let timeout = run.timeout;
                thread::spawn(move || {
                    requests(&config, port, timeout, &shared, |_| METRICS.to_vec())
                })
            })
            .collect()
    });
    let (with, during, cost) = attack.probe(run, pki, &agent);
    let window = with.took.as_secs_f64();
    attack.end(agent);
    report_attack(
        table,
        "a chain flood",
        &without,
        &with,
        format!(
            "{} connections sending GET /metrics with the chain: {} answered in the {window:.1} s window ({:.0}/s; {}), {} connections made meanwhile; {cost}",
            run.flood_threads,
            during.answered,
            during.answered as f64 / window,
            statuses(&during.answers),
            during.connections,
        ),
    );
}

/// Attack 2: `run.unread_connections` connections with a valid client certificate that
/// pipeline GET /metrics and never read, 50 to a thread.
fn unread_pipelined(run: &Run, pki: &Pki, agent: Agent, table: &mut Table) {
    let without = probe_window(run, pki, agent.port);
    let threads = run.unread_connections.div_ceil(50);
    let attack = Attack::start(run, run.unread_connections, |shared| {
        (0..threads)
            .map(|i| {
                let count = (run.unread_connections - i * 50).min(50);
                let (config, shared, port) = (pki.client.clone(), shared.clone(), agent.port);
                let (timeout, cap) = (run.timeout, run.pipelined);
                thread::spawn(move || unread(&config, port, count, cap, timeout, &shared))
            })
            .collect()
    });
    let (with, during, cost) = attack.probe(run, pki, &agent);
    let (total, ramp) = (attack.tally(), attack.ramp.as_secs_f64());
    let queues = socket_queues(agent.port);
    let window = with.took.as_secs_f64();
    attack.end(agent);
    report_attack(
        table,
        &format!("{} unread pipelined connections", run.unread_connections),
        &without,
        &with,
        format!(
            "{} connections with a valid client certificate made in {ramp:.2} s ({:.0}/s), {} failed; {} pipelined GET /metrics written ({} in the {window:.1} s window, {:.0}/s), no answer read; at the window's end {queues}; {cost}",
            total.connections,
            total.connections as f64 / ramp,
            total.failed,
            total.written,
            during.written,
            during.written as f64 / window,
        ),
    );
}

/// Attack 3: `run.token_threads` connections without a client certificate, each
/// GET /metrics with a bearer token never sent before.
fn distinct_tokens(run: &Run, pki: &Pki, agent: Agent, api: &ApiServer, table: &mut Table) {
    let without = probe_window(run, pki, agent.port);
    // Distinct from every earlier run's, though each agent starts with an empty cache.
    let prefix = format!("{:x}", std::process::id() as u64 ^ now_nanos());
    let reviews_before = api.token_reviews().len();
    let attack = Attack::start(run, run.token_threads, |shared| {
        (0..run.token_threads)
            .map(|t| {
                let (config, shared, port) = (pki.anonymous.clone(), shared.clone(), agent.port);
                let (timeout, prefix) = (run.timeout, prefix.clone());
                thread::spawn(move || {
                    requests(&config, port, timeout, &shared, |i| {
                        format!(
                            "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer bench-{prefix}-{t}-{i}\r\n\r\n"
                        )
                        .into_bytes()
                    })
                })
            })
            .collect()
    });
    let reviews_engaged = api.token_reviews().len();
    let (with, during, cost) = attack.probe(run, pki, &agent);
    let reviews_window = api.token_reviews().len() - reviews_engaged;
    let window = with.took.as_secs_f64();
    attack.end(agent);
    let reviews = api.token_reviews().len() - reviews_before;
    report_attack(
        table,
        &format!("{} threads of distinct bearer tokens", run.token_threads),
        &without,
        &with,
        format!(
            "{} connections without a client certificate, a new token on each GET /metrics: {} answered in the {window:.1} s window ({:.0}/s; {}); {reviews_window} TokenReviews reached the API server in the window ({:.0}/s), {reviews} in all (each answered after {} ms); {cost}",
            run.token_threads,
            during.answered,
            during.answered as f64 / window,
            statuses(&during.answers),
            reviews_window as f64 / window,
            REVIEW_DELAY.as_millis(),
        ),
    );
}

/// Three rows: `/livez` and the scrape under `attack` (each beside the same without it),
/// and what the attack itself did.
fn report_attack(table: &mut Table, attack: &str, without: &Probes, with: &Probes, did: String) {
    let figures = |with: &[Duration], without: &[Duration], failed: usize| {
        let (mut with, mut without) = (with.to_vec(), without.to_vec());
        let (p50, p99) = p50_p99(&mut with);
        let (b50, b99) = p50_p99(&mut without);
        let failed = if failed > 0 {
            format!(", {failed} failed")
        } else {
            String::new()
        };
        let measured = format!(
            "p50 {}, p99 {} of {}{failed} (without: p50 {}, p99 {} of {}); {:.1}x",
            ms(p50),
            ms(p99),
            with.len(),
            ms(b50),
            ms(b99),
            without.len(),
            p99.as_secs_f64() / b99.as_secs_f64(),
        );
        (p99, b99, measured)
    };
    let (p99, b99, measured) = figures(&with.livez, &without.livez, with.livez_failed);
    table.check(
        &format!(
            "/livez during {attack}: new connection, TLS without a client certificate (as the kubelet probes), p99"
        ),
        "< 100 ms, <= 2x without",
        measured,
        with.livez_failed == 0 && p99 < Duration::from_millis(100) && p99 <= b99 * 2,
    );
    let (p99, b99, measured) = figures(&with.metrics, &without.metrics, with.metrics_failed);
    table.check(
        &format!("/metrics over mTLS during {attack}: new connection + full handshake each, p99"),
        "<= 2x without",
        measured,
        with.metrics_failed == 0 && p99 <= b99 * 2,
    );
    table.info(&format!("{attack}: the attack itself"), did);
}

/// `/livez` probes and scrapes taken in one window.
struct Probes {
    livez: Vec<Duration>,
    livez_failed: usize,
    metrics: Vec<Duration>,
    metrics_failed: usize,
    took: Duration,
}

/// `/livez` probes and scrapes, each on a new connection and timed from the connect to the
/// end of the body, by two threads of their own (as the kubelet and Prometheus are apart):
/// `run.probes` of each, spread evenly over `run.attack` (one waits for the one before it),
/// and the window is always the whole of `run.attack`. One that fails or times out counts
/// with the time it took. After 5 of each untimed, to warm up, when `warm`.
fn probes(run: &Run, pki: &Pki, port: u16, warm: bool) -> Probes {
    let once = |config: &Arc<rustls::ClientConfig>, request: &[u8]| {
        let start = Instant::now();
        let answered = dial(config, port, run.timeout).and_then(|mut stream| {
            stream.write_all(request)?;
            read_response(&mut stream)
        });
        (start.elapsed(), matches!(answered, Ok((200, _))))
    };
    if warm {
        for _ in 0..5 {
            once(&pki.anonymous, LIVEZ);
            once(&pki.client, METRICS);
        }
    }
    let start = Instant::now();
    let every = run.attack / run.probes as u32;
    let paced = |config: &Arc<rustls::ClientConfig>, request: &[u8]| {
        let (mut samples, mut failed) = (Vec::new(), 0);
        for k in 0..run.probes as u32 {
            if start.elapsed() >= run.attack {
                break;
            }
            thread::sleep((start + every * k).saturating_duration_since(Instant::now()));
            let (took, ok) = once(config, request);
            samples.push(took);
            failed += usize::from(!ok);
        }
        (samples, failed)
    };
    let ((livez, livez_failed), (metrics, metrics_failed)) = thread::scope(|scope| {
        let livez = scope.spawn(|| paced(&pki.anonymous, LIVEZ));
        let metrics = paced(&pki.client, METRICS);
        (livez.join().expect("the /livez prober"), metrics)
    });
    thread::sleep((start + run.attack).saturating_duration_since(Instant::now()));
    Probes {
        livez,
        livez_failed,
        metrics,
        metrics_failed,
        took: start.elapsed(),
    }
}

/// The figures without an attack, warmed up.
fn probe_window(run: &Run, pki: &Pki, port: u16) -> Probes {
    probes(run, pki, port, true)
}

/// A TLS connection to the agent with `config`, every read and write bounded by `timeout`.
fn dial(config: &Arc<rustls::ClientConfig>, port: u16, timeout: Duration) -> io::Result<Tls> {
    let tcp = TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), timeout)?;
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(timeout))?;
    tcp.set_write_timeout(Some(timeout))?;
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(config.clone(), name).map_err(io::Error::other)?;
    Ok(rustls::StreamOwned::new(conn, tcp))
}

/// What an attack's threads share: when to stop, and what they did.
struct Attackers {
    /// Set once the figures are taken; `until` stops the attack anyway.
    stop: AtomicBool,
    until: Instant,
    /// Attackers (threads or connections) that sent a first request, or gave up.
    engaged: AtomicUsize,
    connections: AtomicU64,
    failed: AtomicU64,
    /// Requests written whose answers are never read (the pipelining attack).
    written: AtomicU64,
    /// Requests answered, by status.
    answers: Mutex<BTreeMap<u16, u64>>,
    answered: AtomicU64,
}

/// At most this many requests in any one attack, written or answered.
const ATTACK_REQUESTS: u64 = 2_000_000;

impl Attackers {
    /// The attack is on: neither stopped nor past its time.
    fn on(&self) -> bool {
        !self.stop.load(Ordering::Relaxed) && Instant::now() < self.until
    }

    /// The attack is on and may send more.
    fn going(&self) -> bool {
        self.on()
            && self.written.load(Ordering::Relaxed) + self.answered.load(Ordering::Relaxed)
                < ATTACK_REQUESTS
    }

    fn count(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn answer(&self, status: u16) {
        *self.answers.lock().unwrap().entry(status).or_default() += 1;
        Attackers::count(&self.answered, 1);
    }

    fn tally(&self) -> Tally {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Tally {
            connections: load(&self.connections),
            failed: load(&self.failed),
            written: load(&self.written),
            answered: load(&self.answered),
            answers: self.answers.lock().unwrap().clone(),
        }
    }
}

/// What the attackers had done by some instant.
#[derive(Debug, Default)]
struct Tally {
    connections: u64,
    failed: u64,
    written: u64,
    answered: u64,
    answers: BTreeMap<u16, u64>,
}

impl Tally {
    /// What was done since `earlier`.
    fn since(&self, earlier: &Tally) -> Tally {
        Tally {
            connections: self.connections - earlier.connections,
            failed: self.failed - earlier.failed,
            written: self.written - earlier.written,
            answered: self.answered - earlier.answered,
            answers: self
                .answers
                .iter()
                .map(|(status, n)| (*status, n - earlier.answers.get(status).unwrap_or(&0)))
                .filter(|(_, n)| *n > 0)
                .collect(),
        }
    }
}

/// "401: 120, 503: 4".
fn statuses(answers: &BTreeMap<u16, u64>) -> String {
    if answers.is_empty() {
        return "no answer".to_string();
    }
    answers
        .iter()
        .map(|(status, n)| format!("HTTP {status}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// An attack under way.
struct Attack {
    shared: Arc<Attackers>,
    threads: Vec<JoinHandle<()>>,
    /// From its start until every attacker was engaged.
    ramp: Duration,
}

/// How long an attack may take to engage before its figures are taken anyway.
const RAMP_LIMIT: Duration = Duration::from_secs(30);

impl Attack {
    /// Starts the threads `spawn` makes and waits (at most [`RAMP_LIMIT`]) until
    /// `attackers` of them are engaged. Each thread stops by itself at the latest
    /// `RAMP_LIMIT + run.attack` after this.
    fn start(
        run: &Run,
        attackers: usize,
        spawn: impl FnOnce(&Arc<Attackers>) -> Vec<JoinHandle<()>>,
    ) -> Attack {
        let start = Instant::now();
        let shared = Arc::new(Attackers {
            stop: AtomicBool::new(false),
            until: start + RAMP_LIMIT + run.attack,
            engaged: AtomicUsize::new(0),
            connections: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            written: AtomicU64::new(0),
            answers: Mutex::default(),
            answered: AtomicU64::new(0),
        });
        let threads = spawn(&shared);
        while shared.engaged.load(Ordering::Relaxed) < attackers && start.elapsed() < RAMP_LIMIT {
            thread::sleep(Duration::from_millis(5));
        }
        Attack {
            shared,
            threads,
            ramp: start.elapsed(),
        }
    }

    fn tally(&self) -> Tally {
        self.shared.tally()
    }

    /// The figures while it runs, what the attackers did meanwhile, and what it cost the
    /// agent: "N ms of CPU in the window (P% of a core), RSS M MiB".
    fn probe(&self, run: &Run, pki: &Pki, agent: &Agent) -> (Probes, Tally, String) {
        let (before, cpu) = (self.tally(), agent.cpu_time());
        let probes = probes(run, pki, agent.port, false);
        let (tally, cpu) = (self.tally().since(&before), agent.cpu_time() - cpu);
        let cost = format!(
            "the agent: {:.0} ms of CPU in the window ({:.0}% of a core), RSS {:.1} MiB",
            cpu.as_secs_f64() * 1000.0,
            100.0 * cpu.as_secs_f64() / probes.took.as_secs_f64(),
            agent.rss_mib()
        );
        (probes, tally, cost)
    }

    /// Stops the attack: the agent is killed first, so that no attacker waits on it.
    fn end(self, agent: Agent) {
        self.shared.stop.store(true, Ordering::Relaxed);
        drop(agent);
        for thread in self.threads {
            thread.join().expect("an attacker thread");
        }
    }
}

/// An attacker: one connection at a time (a new one when the agent closes it), on which it
/// sends `request(i)` and reads the answer, again and again until the attack ends.
fn requests(
    config: &Arc<rustls::ClientConfig>,
    port: u16,
    timeout: Duration,
    shared: &Attackers,
    mut request: impl FnMut(u64) -> Vec<u8>,
) {
    let mut engaged = false;
    let mut i = 0;
    while shared.going() {
        let Ok(mut stream) = dial(config, port, timeout) else {
            Attackers::count(&shared.failed, 1);
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        Attackers::count(&shared.connections, 1);
        while shared.going() {
            i += 1;
            if stream.write_all(&request(i)).is_err() {
                break;
            }
            if !engaged {
                engaged = true;
                shared.engaged.fetch_add(1, Ordering::Relaxed);
            }
            match read_response(&mut stream) {
                Ok((status, _)) => shared.answer(status),
                Err(_) => break,
            }
        }
    }
    if !engaged {
        shared.engaged.fetch_add(1, Ordering::Relaxed);
    }
}

/// `count` connections with a valid client certificate, each writing pipelined
/// GET /metrics (at most `cap`) and never reading, held open until the attack ends.
fn unread(
    config: &Arc<rustls::ClientConfig>,
    port: u16,
    count: usize,
    cap: u64,
    timeout: Duration,
    shared: &Attackers,
) {
    const BATCH: u64 = 50;
    let batch = METRICS.repeat(BATCH as usize);
    // (connection, requests written, blocked)
    let mut open: Vec<(Tls, u64, bool)> = Vec::new();
    for _ in 0..count {
        if shared.on() {
            match dial(config, port, timeout).and_then(|mut s| s.write_all(&batch).map(|_| s)) {
                Ok(stream) => {
                    Attackers::count(&shared.connections, 1);
                    Attackers::count(&shared.written, BATCH);
                    open.push((stream, BATCH, false));
                }
                Err(_) => Attackers::count(&shared.failed, 1),
            }
        }
        shared.engaged.fetch_add(1, Ordering::Relaxed);
    }
    // Topped up to `cap` each; a write that does not go through within a moment means the
    // agent stopped reading that connection.
    for (stream, _, _) in &open {
        let _ = stream
            .sock
            .set_write_timeout(Some(Duration::from_millis(20)));
    }
    while shared.going() {
        let mut wrote = false;
        for (stream, written, blocked) in open.iter_mut() {
            if *blocked || *written >= cap || !shared.going() {
                continue;
            }
            if stream.write_all(&batch).is_ok() {
                *written += BATCH;
                Attackers::count(&shared.written, BATCH);
                wrote = true;
            } else {
                *blocked = true;
            }
        }
        if !wrote {
            break;
        }
        thread::sleep(Duration::from_millis(10));
    }
    while shared.on() {
        thread::sleep(Duration::from_millis(10));
    }
}

/// A client configuration whose certificate no trusted CA signed (CN `prometheus`, a
/// listed user, issued in the name `bench-chain-flood`), sent with 10 self-signed CA
/// certificates of that same name: a path builder tries every order of them, up to its
/// depth limit, before it gives up (the rustls-webpki one: about 190,000 steps, each
/// parsing the 10 candidates, within its budget of 200,000).
fn chain_flood_config(pki: &Pki) -> rustls::ClientConfig {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, "bench-chain-flood");
    let mut issuer = None;
    let mut others = Vec::new();
    for _ in 0..10 {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = name.clone();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        others.push(params.self_signed(&key).unwrap().der().clone());
        issuer.get_or_insert(Issuer::new(params, key));
    }
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "prometheus");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let leaf = params.signed_by(&key, &issuer.unwrap()).unwrap();
    let mut chain = vec![leaf.der().clone()];
    chain.extend(others);
    let mut config = rustls::ClientConfig::builder()
        .with_root_certificates(pki.roots.clone())
        .with_client_auth_cert(
            chain,
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )
        .unwrap();
    config.resumption = rustls::client::Resumption::disabled();
    config
}

/// What waits in the kernel on the loopback connections to `port` (/proc/net/tcp): on the
/// agent's side, requests it has not read and responses not yet taken by the client (unsent
/// or unacknowledged); on the clients' side, responses not read.
fn socket_queues(port: u16) -> String {
    let table = fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let (mut connections, mut unsent, mut unread, mut clients_unread) = (0, 0u64, 0u64, 0u64);
    for line in table.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(remote), Some(state), Some(queues)) =
            (fields.get(1), fields.get(2), fields.get(3), fields.get(4))
        else {
            continue;
        };
        let port_of = |address: &str| {
            address
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
        };
        let Some((tx, rx)) = queues.split_once(':').and_then(|(tx, rx)| {
            Some((
                u64::from_str_radix(tx, 16).ok()?,
                u64::from_str_radix(rx, 16).ok()?,
            ))
        }) else {
            continue;
        };
        // 01: ESTABLISHED.
        if *state != "01" {
            continue;
        }
        if port_of(local) == Some(port) {
            connections += 1;
            unsent += tx;
            unread += rx;
        } else if port_of(remote) == Some(port) {
            clients_unread += rx;
        }
    }
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    format!(
        "the agent's {connections} connections held {:.1} MiB of requests it had not read and {:.1} MiB of responses not yet taken, the attackers' {:.1} MiB of responses unread",
        mib(unread),
        mib(unsent),
        mib(clients_unread)
    )
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
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
