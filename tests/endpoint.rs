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
use common::apiserver::{API_AUDIENCE, ApiServer, HangMode, Subject};
use common::daemon::{Agent, eventually, samples, wait_until};
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

/// A scrapers' CA for client certificates, written on `node` for `--client-ca-file`.
fn scrapers_ca(node: &Node) -> (Signer, PathBuf) {
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let path = write_client_ca(node, &scrapers);
    (scrapers, path)
}

fn write_client_ca(node: &Node, signer: &Signer) -> PathBuf {
    let path = node.root().join("scrapers-ca.crt");
    fs::write(&path, signer.pem()).unwrap();
    path
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
        self.fetch(agent, path, client, None)
    }

    /// GET `path` with a bearer token (and a client certificate when given).
    fn get_bearer(&self, agent: &Agent, path: &str, token: &str) -> (u16, String) {
        self.fetch(agent, path, None, Some(token))
    }

    fn fetch(
        &self,
        agent: &Agent,
        path: &str,
        client: Option<&Client>,
        token: Option<&str>,
    ) -> (u16, String) {
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
        if let Some(token) = token {
            cmd.arg("-H").arg(format!("Authorization: Bearer {token}"));
        }
        let out = cmd.output().expect("curl is installed");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.parse().unwrap_or(0), body.to_string())
    }

    /// GET `/metrics` with a client certificate or a bearer token, given up after `limit`:
    /// what came back, with its `Retry-After`, and how long it took.
    fn scrape(
        &self,
        agent: &Agent,
        client: Option<&Client>,
        token: Option<&str>,
        limit: Duration,
    ) -> Scrape {
        let mut cmd = Command::new("curl");
        cmd.args(["-s", "--max-time", &limit.as_secs().to_string()])
            .args(["-w", "\n%{http_code} %header{retry-after}", "--cacert"])
            .arg(&self.serving_ca)
            .arg(format!("https://localhost:{}/metrics", agent.port));
        if let Some(client) = client {
            cmd.arg("--cert")
                .arg(&client.cert)
                .arg("--key")
                .arg(&client.key);
        }
        if let Some(token) = token {
            cmd.arg("-H").arg(format!("Authorization: Bearer {token}"));
        }
        let started = std::time::Instant::now();
        let out = cmd.output().expect("curl is installed");
        let took = started.elapsed();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, status) = text.rsplit_once('\n').unwrap_or(("", "0"));
        let (code, retry_after) = status.split_once(' ').unwrap_or((status, ""));
        Scrape {
            code: code.parse().unwrap_or(0),
            body: body.to_string(),
            retry_after: Some(retry_after.trim().to_string()).filter(|r| !r.is_empty()),
            took,
        }
    }
}

/// One scrape's answer (code 0: none came).
#[derive(Debug)]
struct Scrape {
    code: u16,
    body: String,
    retry_after: Option<String>,
    took: Duration,
}

#[test]
fn client_certificates_and_the_allow_list_decide_who_reads_metrics() {
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let (scrapers, client_ca) = scrapers_ca(&node);
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
    let (scrapers, client_ca) = scrapers_ca(&node);
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
    let (scrapers, client_ca) = scrapers_ca(&node);
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
    let (scrapers, client_ca) = scrapers_ca(&node);
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
    let (_, client_ca) = scrapers_ca(&node);
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

/// The service account a cluster's Prometheus scrapes as.
const PROMETHEUS_SA: &str = "system:serviceaccount:openshift-monitoring:prometheus-k8s";

/// An API server, and an agent on a local source whose endpoint takes client certificates
/// from `scrapers` and bearer tokens reviewed by `api`.
struct Webhooks {
    api: ApiServer,
    node: Node,
    scrapers: Signer,
    endpoint: Endpoint,
    agent: Agent,
}

/// [`Webhooks`] with the endpoint's `extra` flags.
fn with_webhooks(extra: &[&str]) -> Webhooks {
    let api = ApiServer::start();
    let node = Node::new();
    let scrapers = Signer::new("scrapers", Algorithm::P256);
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let client_ca = write_client_ca(&node, &scrapers);
    let endpoint = Endpoint::new(&node, &client_ca, extra);
    let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
    let agent = endpoint.start(&node, &[&source], &["--kubeconfig", &kubeconfig]);
    wait_until(10 * SECOND, || {
        endpoint.get(&agent, "/livez", None).0 == 200
    });
    Webhooks {
        api,
        node,
        scrapers,
        endpoint,
        agent,
    }
}

#[test]
fn bearer_tokens_are_reviewed_and_requests_authorized_by_subject_access_reviews() {
    let Webhooks {
        api,
        node,
        scrapers,
        endpoint,
        agent,
    } = with_webhooks(&["--authentication-token-webhook", "--authorization-webhook"]);
    api.grant(Subject::User(PROMETHEUS_SA.into()), &["get"], &["/metrics"]);
    api.grant(
        Subject::Group("system:monitoring".into()),
        &["get"],
        &["/metrics", "/federate"],
    );
    let allowed = api.issue_token(PROMETHEUS_SA, &["system:serviceaccounts"]);
    let member = api.issue_token("alice", &["system:authenticated", "system:monitoring"]);
    let denied = api.issue_token("system:serviceaccount:dev:app", &["system:serviceaccounts"]);

    let (code, body) = endpoint.get_bearer(&agent, "/metrics", &allowed);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("x509_cert_not_after{"), "{body}");
    assert_eq!(
        endpoint.get_bearer(&agent, "/metrics", &member).0,
        200,
        "a member of a granted group"
    );
    let (code, body) = endpoint.get_bearer(&agent, "/metrics", &denied);
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("system:serviceaccount:dev:app"), "{body}");
    let (code, body) = endpoint.get_bearer(&agent, "/metrics", "not-a-token-the-server-knows");
    assert_eq!(code, 401, "{body}");
    let (code, body) = endpoint.get(&agent, "/metrics", None);
    assert_eq!(code, 401, "{body}");

    // A client certificate's identity is authorized by a SubjectAccessReview too.
    let year = Span::days(365);
    let in_group = Client::new(
        node.root(),
        "in-group",
        scrapers.issue_client_with("grafana", &["system:monitoring"], Span::hours(-1), year),
    );
    let outsider = Client::new(
        node.root(),
        "outsider",
        scrapers.issue_client_with("intruder", &["dev"], Span::hours(-1), year),
    );
    assert_eq!(endpoint.get(&agent, "/metrics", Some(&in_group)).0, 200);
    assert_eq!(endpoint.get(&agent, "/metrics", Some(&outsider)).0, 403);
    for health in ["/healthz", "/livez", "/readyz"] {
        assert_eq!(endpoint.get(&agent, health, None).0, 200, "{health}");
    }

    // What the API server was asked: each token once (a repeat is remembered), with no
    // audiences (the API server's own), and get on the path for the reviewed identity.
    let reviews = api.token_reviews();
    assert_eq!(reviews.len(), 4, "{reviews:?}");
    assert!(
        reviews
            .iter()
            .all(|r| r.pointer("/spec/audiences").is_none()),
        "{reviews:?}"
    );
    let accesses = api.access_reviews();
    let asked_for = |user: &str| {
        accesses
            .iter()
            .find(|r| r.pointer("/spec/user").and_then(|u| u.as_str()) == Some(user))
            .unwrap_or_else(|| panic!("no SubjectAccessReview for {user}: {accesses:?}"))
    };
    let prometheus = asked_for(PROMETHEUS_SA);
    assert_eq!(
        prometheus.pointer("/spec/nonResourceAttributes"),
        Some(&serde_json::json!({"path": "/metrics", "verb": "get"})),
        "{prometheus}"
    );
    assert_eq!(
        prometheus.pointer("/spec/groups"),
        Some(&serde_json::json!(["system:serviceaccounts"]))
    );
    assert!(
        prometheus
            .pointer("/spec/uid")
            .and_then(|u| u.as_str())
            .is_some_and(|u| !u.is_empty()),
        "the TokenReview's uid is passed on: {prometheus}"
    );
    assert_eq!(
        asked_for("grafana").pointer("/spec/groups"),
        Some(&serde_json::json!(["system:monitoring"]))
    );
    assert_eq!(accesses.len(), 5, "one review per identity: {accesses:?}");
    // Asked again: every answer is remembered, nothing is asked twice.
    for token in [&allowed, &member, &denied] {
        endpoint.get_bearer(&agent, "/metrics", token);
    }
    endpoint.get_bearer(&agent, "/metrics", "not-a-token-the-server-knows");
    assert_eq!(api.token_reviews().len(), 4);
    assert_eq!(api.access_reviews().len(), 5);

    // No token in the log, whatever happened to it.
    let log = agent.log();
    for token in [&allowed, &member, &denied] {
        assert!(
            !log.contains(token.as_str()),
            "a token is in the log: {log}"
        );
    }
}

#[test]
fn fifty_concurrent_requests_with_one_token_make_one_review_of_each_kind() {
    let Webhooks {
        api,
        node: _node,
        scrapers: _scrapers,
        endpoint,
        agent,
    } = with_webhooks(&["--authentication-token-webhook", "--authorization-webhook"]);
    api.grant(Subject::User(PROMETHEUS_SA.into()), &["get"], &["/metrics"]);
    let token = api.issue_token(PROMETHEUS_SA, &[]);
    // Every review takes a while, so that all fifty requests arrive while one is asked.
    api.set_review_delay(3 * SECOND);
    let concurrently = |token: &str| -> Vec<u16> {
        std::thread::scope(|scope| {
            let requests: Vec<_> = (0..50)
                .map(|_| scope.spawn(|| endpoint.get_bearer(&agent, "/metrics", token).0))
                .collect();
            requests.into_iter().map(|r| r.join().unwrap()).collect()
        })
    };
    let codes = concurrently(&token);
    assert!(codes.iter().all(|&c| c == 200), "{codes:?}");
    assert_eq!(api.token_reviews().len(), 1, "TokenReviews for 50 requests");
    assert_eq!(api.access_reviews().len(), 1, "SubjectAccessReviews");

    // A flood of one bad token: one review, and its rejection is remembered.
    let codes = concurrently("a-token-nobody-issued");
    assert!(codes.iter().all(|&c| c == 401), "{codes:?}");
    assert_eq!(api.token_reviews().len(), 2);
    assert_eq!(
        api.access_reviews().len(),
        1,
        "no authorization without identity"
    );
    api.set_review_delay(Duration::ZERO);
    assert_eq!(
        endpoint
            .get_bearer(&agent, "/metrics", "a-token-nobody-issued")
            .0,
        401
    );
    assert_eq!(api.token_reviews().len(), 2, "the rejection was remembered");
}

#[test]
fn tokens_for_other_audiences_are_refused_and_the_allow_list_applies_to_tokens() {
    let Webhooks {
        api,
        node: _node,
        scrapers: _scrapers,
        endpoint,
        agent,
    } = with_webhooks(&[
        "--authentication-token-webhook",
        "--authentication-token-audiences",
        "kubelet-ca-agent",
        // The allow-list decides: no SubjectAccessReview is made.
        "--authorization-webhook",
        "--authorized-users",
        PROMETHEUS_SA,
    ]);
    let ours = api.issue_token_for(PROMETHEUS_SA, &[], &["kubelet-ca-agent"]);
    let for_the_api = api.issue_token_for(PROMETHEUS_SA, &[], &[API_AUDIENCE]);
    let someone_else = api.issue_token_for("alice", &[], &["kubelet-ca-agent"]);
    assert_eq!(endpoint.get_bearer(&agent, "/metrics", &ours).0, 200);
    assert_eq!(endpoint.get_bearer(&agent, "/metrics", &for_the_api).0, 401);
    assert_eq!(
        endpoint.get_bearer(&agent, "/metrics", &someone_else).0,
        403
    );
    let reviews = api.token_reviews();
    assert!(
        reviews.iter().all(|r| r.pointer("/spec/audiences")
            == Some(&serde_json::json!(["kubelet-ca-agent"]))),
        "{reviews:?}"
    );
    assert!(
        api.access_reviews().is_empty(),
        "the allow-list needs no API call"
    );
}

#[test]
fn a_token_that_cannot_be_reviewed_is_refused_and_says_why() {
    let Webhooks {
        api,
        node,
        scrapers,
        endpoint,
        agent,
    } = with_webhooks(&[
        "--authentication-token-webhook",
        "--authorized-users",
        PROMETHEUS_SA,
    ]);
    // The agent's own identity may not create TokenReviews (RBAC without the webhook rule).
    api.restrict_to(vec![]);
    let token = api.issue_token(PROMETHEUS_SA, &[]);
    let (code, body) = endpoint.get_bearer(&agent, "/metrics", &token);
    // Not a 401: nothing judged the token.
    assert_eq!(code, 503, "{body}");
    // The client learns that the token was not checked, and why in a few words; the API
    // server's words (what the agent's own identity may not do) go to the log alone.
    assert!(
        body.contains("not checked: the API server refused the agent's review"),
        "{body}"
    );
    assert!(
        !body.contains("tokenreviews"),
        "relays the API server's error: {body}"
    );
    assert!(agent.log().contains("tokenreviews"), "{}", agent.log());
    // With the API server gone, certificates keep working and tokens are refused.
    api.stop();
    let year = Span::days(365);
    let client = Client::new(
        node.root(),
        "prometheus",
        scrapers.issue_client_with(PROMETHEUS_SA, &[], Span::hours(-1), year),
    );
    assert_eq!(endpoint.get(&agent, "/metrics", Some(&client)).0, 200);
    let other = api.issue_token(PROMETHEUS_SA, &[]);
    let (code, body) = endpoint.get_bearer(&agent, "/metrics", &other);
    assert_eq!(code, 503, "{body}");
    assert!(!agent.log().contains(&other), "{}", agent.log());
}

/// How long the agent gives a review before it has failed (`REVIEW_DEADLINE`).
const REVIEW_DEADLINE: Duration = Duration::from_secs(10);

/// `kubelet_ca_review_errors_total` of `review` (`token`, `access`) in a `/metrics` body,
/// by reason.
fn review_errors(metrics: &str, review: &str) -> std::collections::BTreeMap<String, f64> {
    samples(metrics, "kubelet_ca_review_errors_total")
        .into_iter()
        .filter(|s| s.has(&[("review", review)]))
        .map(|s| (s.label("reason").unwrap_or_default().to_string(), s.value))
        .collect()
}

/// Fails the test with every problem found, so that a run shows them all at once.
/// Asks `ask` until it answers 200, for at most 5 s after the API server is back (`what`
/// says how it came back); a problem naming the last answer when it never did.
fn answers_again(what: &str, mut ask: impl FnMut() -> (u16, String)) -> Option<String> {
    let started = std::time::Instant::now();
    let mut last = (0, String::new());
    let back = eventually(5 * SECOND, || {
        last = ask();
        last.0 == 200
    });
    eprintln!("{what}: answered {} after {:?}", last.0, started.elapsed());
    (!back).then(|| format!("still refused 5 s after {what}: {} {}", last.0, last.1))
}

fn assert_none(problems: &[String], log: &str) {
    assert!(
        problems.is_empty(),
        "{} problem(s):\n- {}\n--- agent log ---\n{log}",
        problems.len(),
        problems.join("\n- ")
    );
}

/// Issue 24: the API server goes away. A bearer token then cannot be checked: that is a
/// 503 at once (the client's credentials were not judged), counted, not a 401 and not a
/// wait; a client certificate under the allow-list needs no review and keeps working; and
/// once the server is back, a token turned away meanwhile works within seconds (it was not
/// remembered as failed).
#[test]
fn a_token_review_against_a_stopped_api_server_fails_fast_with_503_and_certificates_still_work() {
    let Webhooks {
        api,
        node,
        scrapers,
        endpoint,
        agent,
    } = with_webhooks(&[
        "--authentication-token-webhook",
        "--authorized-users",
        PROMETHEUS_SA,
    ]);
    let client = Client::new(
        node.root(),
        "prometheus",
        scrapers.issue_client_with(PROMETHEUS_SA, &[], Span::hours(-1), Span::days(1)),
    );
    let works = api.issue_token(PROMETHEUS_SA, &[]);
    assert_eq!(
        endpoint.get_bearer(&agent, "/metrics", &works).0,
        200,
        "reviews work at first"
    );
    // Tokens never reviewed: nothing is remembered of them.
    let later = api.issue_token(PROMETHEUS_SA, &[]);
    let others: Vec<String> = (0..5)
        .map(|_| api.issue_token(PROMETHEUS_SA, &[]))
        .collect();
    api.stop();

    let mut problems = Vec::new();
    let mut turned_away = 0;
    let mut took = Vec::new();
    for token in std::iter::once(&later).chain(&others) {
        let answer = endpoint.scrape(&agent, None, Some(token), 3 * REVIEW_DEADLINE);
        took.push(answer.took);
        if answer.code == 503 {
            turned_away += 1;
        } else {
            problems.push(format!(
                "a token that cannot be checked: {answer:?}, not 503"
            ));
        }
        if answer.code == 503 && answer.retry_after.is_none() {
            problems.push(format!("a 503 without Retry-After: {answer:?}"));
        }
        if !answer.body.contains("not checked") {
            problems.push(format!(
                "the body does not say the token was not checked: {answer:?}"
            ));
        }
        if answer.body.contains(token.as_str()) {
            problems.push("the body shows the token".to_string());
        }
    }
    let slowest = took.iter().max().copied().unwrap_or_default();
    eprintln!("API server stopped: 6 token scrapes took {took:?}");
    // Loosely: not one waited out the review deadline.
    if slowest >= REVIEW_DEADLINE / 2 {
        problems.push(format!(
            "a token scrape took {slowest:?} while the API server is down (the review deadline is {REVIEW_DEADLINE:?})"
        ));
    }

    // A client certificate under the allow-list waits on no review.
    let certificate = endpoint.scrape(&agent, Some(&client), None, 3 * REVIEW_DEADLINE);
    eprintln!(
        "client certificate while the API server is down: {} in {:?}",
        certificate.code, certificate.took
    );
    if certificate.code != 200 {
        problems.push(format!("a client certificate scrape: {certificate:?}"));
    }
    let errors = review_errors(&certificate.body, "token");
    eprintln!("kubelet_ca_review_errors_total{{review=\"token\"}}: {errors:?}");
    if errors.get("unreachable").copied().unwrap_or(0.0) < 1.0 {
        problems.push(format!(
            "no review counted with reason=\"unreachable\": {errors:?}"
        ));
    }
    let counted: f64 = errors.values().sum();
    if counted < f64::from(turned_away) {
        problems.push(format!(
            "{turned_away} scrapes turned away, {counted} review errors counted: {errors:?}"
        ));
    }

    // Back: a token turned away a moment ago works again within seconds.
    api.restart();
    problems.extend(answers_again("the API server came back (a token)", || {
        endpoint.get_bearer(&agent, "/metrics", &later)
    }));
    assert_none(&problems, &agent.log());
}

/// Issue 24: the API server hangs (accepts, reads, never answers). The first review waits
/// its deadline at most; while it waits, a client certificate is answered; once it has
/// failed, the next tokens are turned away at once rather than each waiting the deadline
/// out; and once the server answers again, tokens work within seconds.
#[test]
fn against_a_hung_api_server_the_first_review_waits_its_deadline_and_the_next_fail_at_once() {
    let Webhooks {
        api,
        node,
        scrapers,
        endpoint,
        agent,
    } = with_webhooks(&[
        "--authentication-token-webhook",
        "--authorized-users",
        PROMETHEUS_SA,
    ]);
    let client = Client::new(
        node.root(),
        "prometheus",
        scrapers.issue_client_with(PROMETHEUS_SA, &[], Span::hours(-1), Span::days(1)),
    );
    let works = api.issue_token(PROMETHEUS_SA, &[]);
    assert_eq!(
        endpoint.get_bearer(&agent, "/metrics", &works).0,
        200,
        "reviews work at first"
    );
    let tokens: Vec<String> = (0..3)
        .map(|_| api.issue_token(PROMETHEUS_SA, &[]))
        .collect();
    api.hang(HangMode::All);

    let mut problems = Vec::new();
    let (first, certificate, certificate_while_waiting) = std::thread::scope(|scope| {
        let waiting =
            scope.spawn(|| endpoint.scrape(&agent, None, Some(&tokens[0]), 3 * REVIEW_DEADLINE));
        // The review is under way (held by the server) before the certificate comes.
        std::thread::sleep(SECOND);
        let certificate = endpoint.scrape(&agent, Some(&client), None, 3 * REVIEW_DEADLINE);
        let while_waiting = !waiting.is_finished();
        (waiting.join().unwrap(), certificate, while_waiting)
    });
    eprintln!(
        "API server hung: the first token scrape answered {} after {:?}; a client certificate {} in {:?}",
        first.code, first.took, certificate.code, certificate.took
    );
    if first.code != 503 {
        problems.push(format!("the first token scrape: {first:?}, not 503"));
    }
    // At most the deadline, and the refusal's pause, with room for a slow machine.
    if first.took > REVIEW_DEADLINE + 4 * SECOND {
        problems.push(format!(
            "the first review waited {:?}, past its deadline",
            first.took
        ));
    }
    if certificate.code != 200 || !certificate_while_waiting {
        problems.push(format!(
            "a client certificate scrape was not answered while a review hung (answered before it: {certificate_while_waiting}): {certificate:?}"
        ));
    }
    for token in &tokens[1..] {
        let next = endpoint.scrape(&agent, None, Some(token), 3 * REVIEW_DEADLINE);
        eprintln!("the next token scrape: {} after {:?}", next.code, next.took);
        if next.code != 503 || next.retry_after.is_none() {
            problems.push(format!(
                "a later token scrape: {next:?}, not 503 with Retry-After"
            ));
        }
        // Loosely: it did not wait the deadline out as the first did.
        if next.took >= REVIEW_DEADLINE / 2 {
            problems.push(format!(
                "a later token scrape waited {:?} on the hung server",
                next.took
            ));
        }
    }
    let (code, metrics) = endpoint.get(&agent, "/metrics", Some(&client));
    let errors = review_errors(&metrics, "token");
    eprintln!("kubelet_ca_review_errors_total{{review=\"token\"}}: {errors:?}");
    if code != 200 || errors.get("no_answer").copied().unwrap_or(0.0) < 1.0 {
        problems.push(format!(
            "the hung review is not counted with reason=\"no_answer\": {code} {errors:?}"
        ));
    }

    api.unhang();
    problems.extend(answers_again(
        "the API server answered again (a token)",
        || endpoint.get_bearer(&agent, "/metrics", &tokens[2]),
    ));
    assert_none(&problems, &agent.log());
}

/// Issue 24, for SubjectAccessReviews: an identity whose access cannot be reviewed gets a
/// 503 at once, counted, and is allowed within seconds of the API server's return.
#[test]
fn a_subject_access_review_against_a_stopped_api_server_fails_fast_and_is_counted() {
    let Webhooks {
        api,
        node,
        scrapers,
        endpoint,
        agent,
    } = with_webhooks(&["--authorization-webhook"]);
    api.grant(
        Subject::Group("system:monitoring".into()),
        &["get"],
        &["/metrics"],
    );
    let year = Span::days(365);
    let client = |name: &str| {
        Client::new(
            node.root(),
            name,
            scrapers.issue_client_with(name, &["system:monitoring"], Span::hours(-1), year),
        )
    };
    // Allowed before: remembered for 5 minutes, so it can read the counters later.
    let reader = client("grafana");
    assert_eq!(endpoint.get(&agent, "/metrics", Some(&reader)).0, 200);
    let newcomer = client("newcomer");
    api.stop();

    let mut problems = Vec::new();
    let answer = endpoint.scrape(&agent, Some(&newcomer), None, 3 * REVIEW_DEADLINE);
    eprintln!(
        "API server stopped: an identity never reviewed answered {} after {:?}",
        answer.code, answer.took
    );
    if answer.code != 503 || answer.retry_after.is_none() || answer.took >= REVIEW_DEADLINE / 2 {
        problems.push(format!(
            "an access that cannot be reviewed: {answer:?}, not a quick 503 with Retry-After"
        ));
    }
    let (code, metrics) = endpoint.get(&agent, "/metrics", Some(&reader));
    let errors = review_errors(&metrics, "access");
    eprintln!("kubelet_ca_review_errors_total{{review=\"access\"}}: {errors:?}");
    if code != 200 || errors.get("unreachable").copied().unwrap_or(0.0) < 1.0 {
        problems.push(format!(
            "the SubjectAccessReview is not counted with reason=\"unreachable\": {code} {errors:?}"
        ));
    }

    api.restart();
    problems.extend(answers_again(
        "the API server came back (an identity)",
        || endpoint.get(&agent, "/metrics", Some(&newcomer)),
    ));
    assert_none(&problems, &agent.log());
}

/// The TLS version `openssl s_client` agreed with the server when limited to `version`
/// (`-tls1_2`, `-tls1_3`), or None when the handshake failed.
fn negotiated(port: u16, version: &str) -> Option<String> {
    let out = Command::new("openssl")
        .args(["s_client", "-brief", version])
        .args(["-connect", &format!("127.0.0.1:{port}")])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("Protocol version: "))
        .map(str::to_string)
}

#[test]
fn tls_min_version_refuses_older_clients() {
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    let (_, client_ca) = scrapers_ca(&node);
    let endpoint = Endpoint::new(&node, &client_ca, &[]);
    let default = endpoint.start(&node, &[&source], &[]);
    // A second agent keeps a bundle and state of its own (one agent per state directory).
    let other = Node::new();
    std::fs::create_dir_all(other.bundle_dir()).unwrap();
    let bundle = other.bundle();
    let state = other.state_dir();
    let strict = endpoint.start(
        &node,
        &[&source],
        &[
            "--tls-min-version",
            "1.3",
            "--bundle",
            bundle.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ],
    );
    for agent in [&default, &strict] {
        wait_until(10 * SECOND, || endpoint.get(agent, "/livez", None).0 == 200);
    }
    assert_eq!(
        negotiated(default.port, "-tls1_2").as_deref(),
        Some("TLSv1.2"),
        "TLS 1.2 is accepted by default"
    );
    assert_eq!(
        negotiated(strict.port, "-tls1_3").as_deref(),
        Some("TLSv1.3")
    );
    assert_eq!(
        negotiated(strict.port, "-tls1_2"),
        None,
        "a TLS 1.2 client is refused with --tls-min-version 1.3"
    );
}

#[test]
fn off_loopback_without_certificate_files_the_endpoint_serves_a_self_signed_certificate() {
    let node = Node::new();
    let source = node.source(
        "signers.pem",
        Signer::new("kubelet-signer", Algorithm::P256).pem(),
    );
    fs::create_dir_all(node.bundle_dir()).unwrap();
    let port = common::daemon::free_port();
    let log = node.root().join("agent.log");
    // Every address: not loopback. (The harness's agent listens on loopback, so this one is
    // started by hand.)
    let (_, client_ca) = scrapers_ca(&node);
    let mut agent = Command::new(common::agent_bin())
        .args(["run", "--source", &source, "--listen"])
        .arg(format!("0.0.0.0:{port}"))
        .arg("--client-ca-file")
        .arg(&client_ca)
        .arg("--bundle")
        .arg(node.bundle())
        .arg("--state-dir")
        .arg(node.state_dir())
        .env_remove("KUBELET_CA_AGENT_INSECURE_METRICS")
        .env_remove("RUST_LOG")
        .env_remove("NOTIFY_SOCKET")
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let https = |path: &str| {
        let out = Command::new("curl")
            .args(["-sk", "--max-time", "5", "-w", "\n%{http_code}"])
            .arg(format!("https://127.0.0.1:{port}{path}"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.rsplit_once('\n')
            .and_then(|(_, code)| code.parse::<u16>().ok())
            .unwrap_or(0)
    };
    let up = common::daemon::eventually(10 * SECOND, || https("/livez") == 200);
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect 127.0.0.1:{port} </dev/null 2>/dev/null | openssl x509 -noout -subject -issuer"
        ))
        .output()
        .unwrap();
    let metrics = https("/metrics");
    let plain = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg(format!("http://127.0.0.1:{port}/livez"))
        .output()
        .unwrap();
    let text = fs::read_to_string(&log).unwrap_or_default();
    let _ = agent.kill();
    let _ = agent.wait();
    assert!(up, "no TLS answer: {text}");
    assert!(
        text.contains("self-signed"),
        "the self-signed certificate is warned about: {text}"
    );
    let names = String::from_utf8_lossy(&out.stdout).replace(' ', "");
    let subject = names.lines().find_map(|l| l.strip_prefix("subject="));
    let issuer = names.lines().find_map(|l| l.strip_prefix("issuer="));
    assert!(subject.is_some(), "no certificate: {names}");
    assert_eq!(subject, issuer, "self-signed: {names}");
    assert_eq!(
        metrics, 401,
        "no credentials are configured: nobody reads /metrics"
    );
    assert_ne!(
        String::from_utf8_lossy(&plain.stdout),
        "200",
        "no plain HTTP off loopback"
    );
}
