//! The secured endpoint against the real binary: TLS with client certificates checked
//! against `--client-ca-file` and a static allow-list, with `curl` and `openssl s_client`
//! (clients nobody here wrote) on the other side.

mod common;

use std::fs;
use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use time::Duration as Span;

use common::Node;
use common::apiserver::ApiServer;
use common::daemon::{Agent, wait_until};
use common::pki::{Algorithm, Signer};
use common::prometheus::Prometheus;

const SECOND: Duration = Duration::from_secs(1);

/// A client's certificate and key, written to files for curl.
struct Client {
    cert: PathBuf,
    key: PathBuf,
}

impl Client {
    fn new(dir: &Path, name: &str, (cert, key): (String, String)) -> Client {
        let client = Client {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
        };
        fs::write(&client.cert, cert).unwrap();
        fs::write(&client.key, key).unwrap();
        client
    }
}

/// An endpoint with a serving certificate from its own CA, for curl to verify.
struct Endpoint {
    serving_ca: PathBuf,
    args: Vec<String>,
}

impl Endpoint {
    fn new(node: &Node, client_ca: &Path, extra: &[&str]) -> Endpoint {
        let ca = Signer::new("serving-ca", Algorithm::P256);
        let (cert, key) = ca.issue_server(&["localhost", "127.0.0.1"]);
        let dir = node.root().join("tls");
        fs::create_dir_all(&dir).unwrap();
        let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
        fs::write(dir.join("serving-ca.crt"), ca.pem()).unwrap();
        fs::write(dir.join("tls.crt"), cert).unwrap();
        fs::write(dir.join("tls.key"), key).unwrap();
        let mut args = vec![
            "--tls-cert-file".to_string(),
            path("tls.crt"),
            "--tls-private-key-file".to_string(),
            path("tls.key"),
            "--client-ca-file".to_string(),
            client_ca.to_str().unwrap().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Endpoint {
            serving_ca: dir.join("serving-ca.crt"),
            args,
        }
    }

    fn start(&self, node: &Node, sources: &[&str], more: &[&str]) -> Agent {
        let mut args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        args.extend(more);
        Agent::start_with(node, sources, &args, |cmd| {
            cmd.env_remove("KUBELET_CA_AGENT_INSECURE_METRICS");
        })
    }

    /// GET `path` over TLS with curl, verifying the server; (status, body).
    fn get(&self, agent: &Agent, path: &str, client: Option<&Client>) -> (u16, String) {
        let mut cmd = Command::new("curl");
        cmd.args(["-s", "--max-time", "10", "-w", "\n%{http_code}", "--cacert"])
            .arg(&self.serving_ca)
            .arg(format!("https://localhost:{}{path}", agent.port));
        if let Some(client) = client {
            cmd.arg("--cert")
                .arg(&client.cert)
                .arg("--key")
                .arg(&client.key);
        }
        let out = cmd.output().expect("curl is installed");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.parse().unwrap_or(0), body.to_string())
    }
}

#[test]
fn client_certificates_and_the_allow_list_decide_who_reads_metrics() {
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, scrapers.pem()).unwrap();
    let endpoint = Endpoint::new(
        &node,
        &client_ca,
        &[
            "--authorized-users",
            "prometheus",
            "--authorized-groups",
            "system:monitoring",
        ],
    );
    let agent = endpoint.start(&node, &[&source], &[]);
    let dir = node.root();
    let year = Span::days(365);
    let allowed = Client::new(
        dir,
        "allowed",
        scrapers.issue_client_with("prometheus", &[], Span::hours(-1), year),
    );
    let member = Client::new(
        dir,
        "member",
        scrapers.issue_client_with("grafana", &["system:monitoring"], Span::hours(-1), year),
    );
    let outsider = Client::new(
        dir,
        "outsider",
        scrapers.issue_client_with("intruder", &["dev"], Span::hours(-1), year),
    );
    let expired = Client::new(
        dir,
        "expired",
        scrapers.issue_client_with("prometheus", &[], Span::days(-30), Span::hours(-1)),
    );
    let foreign = Client::new(
        dir,
        "foreign",
        Signer::new("another-ca", Algorithm::P256).issue_client_with(
            "prometheus",
            &[],
            Span::hours(-1),
            year,
        ),
    );
    wait_until(10 * SECOND, || {
        endpoint.get(&agent, "/livez", None).0 == 200
    });

    let (code, body) = endpoint.get(&agent, "/metrics", Some(&allowed));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("x509_cert_not_after{"), "{body}");
    assert_eq!(
        endpoint.get(&agent, "/metrics", Some(&member)).0,
        200,
        "a member of an allowed group"
    );
    let (code, body) = endpoint.get(&agent, "/metrics", Some(&outsider));
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("intruder"), "{body}");
    let (code, body) = endpoint.get(&agent, "/metrics", None);
    assert_eq!(code, 401, "{body}");
    let (code, body) = endpoint.get(&agent, "/metrics", Some(&expired));
    assert_eq!(code, 401, "{body}");
    assert!(body.to_lowercase().contains("expired"), "{body}");
    let (code, body) = endpoint.get(&agent, "/metrics", Some(&foreign));
    assert_eq!(code, 401, "{body}");
    for health in ["/healthz", "/livez", "/readyz", "/readyz?verbose"] {
        assert_eq!(
            endpoint.get(&agent, health, None).0,
            200,
            "{health} needs no credentials"
        );
    }
    // Nothing secret in the log: no key, no certificate.
    let log = agent.log();
    assert!(
        !log.contains("PRIVATE KEY") && !log.contains("BEGIN CERTIFICATE"),
        "{log}"
    );
}

#[test]
fn scraping_with_a_client_certificate_keeps_working_while_the_api_server_is_down() {
    let api = ApiServer::start();
    let node = Node::new();
    let signer = Signer::new("kubelet-signer", Algorithm::P256);
    api.put_configmap(
        "openshift-config-managed",
        "kube-apiserver-client-ca",
        &[("ca-bundle.crt", &signer.pem())],
        &[],
    );
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, scrapers.pem()).unwrap();
    let endpoint = Endpoint::new(&node, &client_ca, &["--authorized-users", "prometheus"]);
    let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
    let agent = endpoint.start(
        &node,
        &["configmap:openshift-config-managed/kube-apiserver-client-ca"],
        &["--kubeconfig", &kubeconfig],
    );
    wait_until(10 * SECOND, || node.holds(signer.pem()));
    let client = Client::new(
        node.root(),
        "prometheus",
        scrapers.issue_client_with("prometheus", &[], Span::hours(-1), Span::days(1)),
    );
    assert_eq!(endpoint.get(&agent, "/metrics", Some(&client)).0, 200);
    api.stop();
    wait_until(10 * SECOND, || {
        let (code, body) = endpoint.get(&agent, "/metrics", Some(&client));
        code == 200 && body.contains("kubelet_ca_source_up{source=\"configmap:openshift-config-managed/kube-apiserver-client-ca\"} 0")
    });
}

/// The CA names a server asks client certificates from, as `openssl s_client` prints them
/// ("Acceptable client certificate CA names").
fn acceptable_ca_names(port: u16) -> String {
    let out = Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn with_the_managed_bundle_as_client_ca_a_new_signer_is_accepted_at_once_and_a_removed_one_refused()
{
    let node = Node::new();
    let (old, new) = (
        Signer::new("signer-old", Algorithm::P256),
        Signer::new("signer-new", Algorithm::P256),
    );
    let source = node.source("signers.pem", old.pem());
    let path = source.strip_prefix("file:").unwrap().to_string();
    fs::create_dir_all(node.bundle_dir()).unwrap();
    let endpoint = Endpoint::new(
        &node,
        &node.bundle(),
        &["--authorized-groups", "system:monitoring"],
    );
    let agent = endpoint.start(&node, &[&source], &[]);
    wait_until(10 * SECOND, || node.holds(old.pem()));
    let day = Span::days(1);
    let of_old = Client::new(
        node.root(),
        "old",
        old.issue_client_with("scraper", &["system:monitoring"], Span::hours(-1), day),
    );
    let of_new = Client::new(
        node.root(),
        "new",
        new.issue_client_with("scraper", &["system:monitoring"], Span::hours(-1), day),
    );
    wait_until(5 * SECOND, || {
        endpoint.get(&agent, "/metrics", Some(&of_old)).0 == 200
    });
    assert_eq!(endpoint.get(&agent, "/metrics", Some(&of_new)).0, 401);

    // The signer rotates: the new one replaces the old in the source, and so in the bundle.
    let staged = format!("{path}.new");
    fs::write(&staged, new.pem()).unwrap();
    fs::rename(&staged, &path).unwrap();
    wait_until(SECOND, || node.holds(new.pem()));
    let took = wait_until(SECOND, || {
        endpoint.get(&agent, "/metrics", Some(&of_new)).0 == 200
    });
    eprintln!("a client of the new signer was accepted {took:?} after the bundle changed");
    assert_eq!(
        endpoint.get(&agent, "/metrics", Some(&of_old)).0,
        401,
        "the removed signer's client"
    );
    let names = acceptable_ca_names(agent.port);
    assert!(names.contains("signer-new"), "{names}");
    assert!(!names.contains("signer-old"), "{names}");
}

#[test]
fn three_hundred_silent_connections_do_not_stop_a_scrape_or_a_probe() {
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, scrapers.pem()).unwrap();
    let endpoint = Endpoint::new(&node, &client_ca, &["--authorized-users", "prometheus"]);
    let agent = endpoint.start(&node, &[&source], &[]);
    let client = Client::new(
        node.root(),
        "prometheus",
        scrapers.issue_client_with("prometheus", &[], Span::hours(-1), Span::days(1)),
    );
    wait_until(10 * SECOND, || {
        endpoint.get(&agent, "/livez", None).0 == 200
    });
    // Connections that never start a handshake, and some that send half a request line.
    let silent: Vec<TcpStream> = (0..300)
        .map(|i| {
            let mut stream = TcpStream::connect(("127.0.0.1", agent.port)).unwrap();
            if i % 3 == 0 {
                let _ = stream.write_all(b"\x16\x03\x01");
            }
            stream
        })
        .collect();
    let (code, body) = endpoint.get(&agent, "/metrics", Some(&client));
    assert_eq!(code, 200, "{body}");
    assert_eq!(endpoint.get(&agent, "/healthz", None).0, 200);
    drop(silent);
}

#[test]
fn a_real_prometheus_scrapes_the_endpoint_over_mutual_tls() {
    let node = Node::new();
    let signer = Signer::new("kubelet-signer", Algorithm::P256);
    let source = node.source("signers.pem", signer.pem());
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, scrapers.pem()).unwrap();
    let endpoint = Endpoint::new(&node, &client_ca, &["--authorized-users", "prometheus"]);
    let agent = endpoint.start(&node, &[&source], &[]);
    let client = Client::new(
        node.root(),
        "prometheus",
        scrapers.issue_client_with("prometheus", &[], Span::hours(-1), Span::days(1)),
    );
    wait_until(10 * SECOND, || {
        endpoint.get(&agent, "/livez", None).0 == 200
    });

    let scrape = format!(
        "- job_name: kubelet-ca-agent\n  scheme: https\n  tls_config:\n    ca_file: {ca}\n    cert_file: {cert}\n    key_file: {key}\n    server_name: localhost\n  static_configs:\n  - targets: ['127.0.0.1:{port}']\n",
        ca = endpoint.serving_ca.display(),
        cert = client.cert.display(),
        key = client.key.display(),
        port = agent.port,
    );
    let prometheus = Prometheus::start(node.root(), &scrape, &[]);
    let up = prometheus.wait_targets_up(30 * SECOND);
    let series = common::daemon::eventually(10 * SECOND, || {
        let answer = prometheus.query("x509_cert_not_after");
        answer
            .to_string()
            .contains("\"subject_CN\":\"kubelet-signer\"")
    });
    assert!(
        up,
        "the target is not up: {} {}",
        prometheus.api("/api/v1/targets"),
        prometheus.log()
    );
    assert!(series, "x509_cert_not_after is not in Prometheus");
}

/// The subject of the certificate the server presents, spaces removed (`CN=...`).
fn served_subject(port: u16) -> String {
    let out = Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    // The chain's first line names the server's certificate: ` 0 s:CN = localhost`.
    let text = String::from_utf8_lossy(&out.stdout).replace(' ', "");
    text.lines()
        .find_map(|l| l.strip_prefix("0s:"))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_serving_certificate_replaced_by_rename_is_served_at_once() {
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let client_ca = node.root().join("scrapers-ca.crt");
    fs::write(&client_ca, Signer::new("scrapers", Algorithm::P256).pem()).unwrap();
    let endpoint = Endpoint::new(&node, &client_ca, &[]);
    let agent = endpoint.start(&node, &[&source], &[]);
    wait_until(10 * SECOND, || {
        served_subject(agent.port).contains("CN=localhost")
    });
    // A new certificate and key, each written aside and renamed into place.
    let (cert, key) =
        Signer::new("serving-ca-2", Algorithm::P256).issue_server(&["127.0.0.1", "localhost"]);
    let dir = node.root().join("tls");
    for (name, content) in [("tls.key", key), ("tls.crt", cert)] {
        fs::write(dir.join(format!("{name}.new")), content).unwrap();
        fs::rename(dir.join(format!("{name}.new")), dir.join(name)).unwrap();
    }
    let started = std::time::Instant::now();
    let served = common::daemon::eventually(5 * SECOND, || {
        served_subject(agent.port).contains("CN=127.0.0.1")
    });
    assert!(served, "the new certificate is not served: {}", agent.log());
    eprintln!(
        "the new serving certificate was served {:?} after the rename",
        started.elapsed()
    );
    assert!(
        agent.log().contains("TLS configuration reloaded"),
        "{}",
        agent.log()
    );
}
