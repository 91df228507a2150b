//! The agent's own credentials rotate under it, and it follows them without a restart: a
//! first boot before the kubelet has written its kubeconfig, the kubelet's client
//! certificate swapped through its `kubelet-client-current.pem` link, the API server moving
//! to a new serving CA, a token file replaced, and credential files written in place, slowly.
//! The test API server checks client certificates on every request, as kube-apiserver does.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use common::apiserver::ApiServer;
use common::daemon::{Agent, WITHOUT_INOTIFY, eventually, wait_until};
use common::pki::{Algorithm, Signer};
use common::{Node, sha256_hex, stderr};

const SECOND: Duration = Duration::from_secs(1);
const NS: &str = "openshift-config-managed";
const NAME: &str = "kube-apiserver-client-ca";
const SPEC: &str = "configmap:openshift-config-managed/kube-apiserver-client-ca";

/// Writes `content` to `path` as a writer that knows better does: a new file renamed over.
fn write_atomically(path: &Path, content: &[u8]) {
    let tmp = path.with_extension("tmp-new");
    fs::write(&tmp, content).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// A kubeconfig for `api` whose CA is the file `ca` and whose user is `user` (YAML lines of
/// the `user:` map, indented by four spaces).
fn kubeconfig_yaml(api: &ApiServer, ca: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: kubelet
  user:
{user}
contexts:
- name: local
  context:
    cluster: local
    user: kubelet
current-context: local
",
        server = api.url(),
        ca = ca.display(),
    )
}

/// The kubelet's layout: `pki/kubelet-client-current.pem`, a link to a dated file that holds
/// the certificate and its key, named by the kubeconfig for both.
struct KubeletPki {
    dir: PathBuf,
    serial: u32,
}

impl KubeletPki {
    fn new(root: &Path) -> KubeletPki {
        let dir = root.join("pki");
        fs::create_dir_all(&dir).unwrap();
        KubeletPki { dir, serial: 0 }
    }

    fn current(&self) -> PathBuf {
        self.dir.join("kubelet-client-current.pem")
    }

    /// Writes a new dated file and swaps the link to it, as the kubelet's certificate
    /// manager does (a new link renamed over the old one).
    fn rotate_to(&mut self, cert_pem: &str, key_pem: &str) {
        self.serial += 1;
        let dated = self
            .dir
            .join(format!("kubelet-client-2026-11-23-{:02}.pem", self.serial));
        fs::write(&dated, format!("{cert_pem}{key_pem}")).unwrap();
        let link = self.dir.join(".kubelet-client-current.pem.new");
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&dated, &link).unwrap();
        fs::rename(&link, self.current()).unwrap();
    }

    fn user_yaml(&self) -> String {
        let current = self.current();
        format!(
            "    client-certificate: {0}\n    client-key: {0}",
            current.display()
        )
    }
}

/// The DER SHA-256 of the first certificate of `pem`, as the server records it.
fn der_sha256(pem: &str) -> String {
    let der = pem::parse(pem).unwrap().into_contents();
    sha256_hex(&der)
}

/// Neither a key nor a token shows in the agent's log or metrics.
fn assert_no_secret(agent: &Agent, secrets: &[&str]) {
    let log = agent.log();
    let metrics = agent.get("/metrics").map(|(_, b)| b).unwrap_or_default();
    for secret in secrets {
        // A key: any line of its base64 body; a token: the token itself.
        let pieces: Vec<&str> = if secret.contains("PRIVATE KEY") {
            secret
                .lines()
                .filter(|l| !l.starts_with("-----") && l.len() > 16)
                .collect()
        } else {
            vec![*secret]
        };
        for piece in pieces {
            assert!(!log.contains(piece), "a secret reached the log");
            assert!(!metrics.contains(piece), "a secret reached the metrics");
        }
    }
}

fn start(node: &Node, kubeconfig: &Path) -> Agent {
    start_wrapped(node, kubeconfig, &[])
}

/// [`start`], through `wrapper` (see [`Agent::start_wrapped`]).
fn start_wrapped(node: &Node, kubeconfig: &Path, wrapper: &[&str]) -> Agent {
    let kubeconfig = kubeconfig.to_str().unwrap();
    let agent = Agent::start_wrapped(
        node,
        &[SPEC],
        &["--kubeconfig", kubeconfig],
        wrapper,
        |_| {},
    );
    agent.wait_listening();
    agent
}

fn verbose(agent: &Agent) -> String {
    agent
        .get("/readyz?verbose")
        .map(|(_, b)| b)
        .unwrap_or_default()
}

#[test]
fn first_boot_without_a_kubeconfig_keeps_the_file_ready_and_converges_once_it_is_written() {
    let api = ApiServer::start();
    let node = Node::new();
    let (old, new) = (
        Signer::new("kube-csr-signer-old", Algorithm::P256),
        Signer::new("kube-csr-signer-new", Algorithm::P256),
    );
    // What the node's first configuration laid down, and what the cluster holds now.
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), old.pem()).unwrap();
    api.put_configmap(
        NS,
        NAME,
        &[("ca-bundle.crt", &(old.pem() + &new.pem()))],
        &[],
    );
    let kubelet = node.root().join("var-lib-kubelet");
    fs::create_dir_all(&kubelet).unwrap();
    let kubeconfig = kubelet.join("kubeconfig");

    let mut agent = start(&node, &kubeconfig);
    // Up, ready on the adopted file, and saying why the source is down.
    // The credentials line and the source's line come from two places (the follower, the
    // loop's last pass): wait for both.
    let source_down = format!("[-]source:{SPEC} failed: source {SPEC}: no usable credentials");
    assert!(
        eventually(5 * SECOND, || {
            let page = verbose(&agent);
            page.contains("[-]credentials failed") && page.contains(&source_down)
        }),
        "{}",
        verbose(&agent)
    );
    let page = verbose(&agent);
    assert_eq!(agent.get("/readyz").map(|(c, _)| c), Some(200), "{page}");
    assert!(
        page.contains(&format!(
            "kubeconfig {} does not exist yet",
            kubeconfig.display()
        )),
        "{page}"
    );
    assert!(
        page.contains(&format!(
            "[-]source:{SPEC} failed: source {SPEC}: no usable credentials"
        )),
        "{page}"
    );
    agent.wait_sample(
        5 * SECOND,
        "kubelet_ca_sync_errors_total",
        &[("reason", "credentials")],
        |v| v >= 1.0,
    );
    assert_eq!(agent.sample("kubelet_ca_source_up", &[]), Some(0.0));
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent exited"
    );
    assert!(node.holds(old.pem()), "the adopted file was changed");

    // The kubelet bootstraps: its client certificate, then its kubeconfig.
    let ca = kubelet.join("ca.crt");
    fs::write(&ca, api.ca_pem()).unwrap();
    let mut pki = KubeletPki::new(&kubelet);
    let client =
        api.issue_client_certificate("system:node:fixture-node", &["system:nodes"], 3600 * SECOND);
    pki.rotate_to(&client.cert_pem, &client.key_pem);
    write_atomically(
        &kubeconfig,
        kubeconfig_yaml(&api, &ca, &pki.user_yaml()).as_bytes(),
    );

    // A first boot: the API server's port was not known at start, so the confinement does
    // not reach it; the agent says so and exits, and its supervisor starts it again.
    let port = api
        .url()
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_string();
    if agent.exits_when_outgrown(&format!("TCP port {port} (an API server) is new")) {
        agent = start(&node, &kubeconfig);
    }
    let took = wait_until(10 * SECOND, || node.holds(old.pem() + &new.pem()));
    eprintln!("converged {took:?} after the kubeconfig appeared");
    agent.wait_sample(5 * SECOND, "kubelet_ca_source_up", &[], |v| v == 1.0);
    assert!(
        verbose(&agent).contains("[+]credentials ok"),
        "{}",
        verbose(&agent)
    );
    // The identity in use is what the server saw.
    let used = api
        .requests()
        .into_iter()
        .rev()
        .find(|r| r.client_certificate_sha256.is_some())
        .expect("a request with the client certificate");
    assert_eq!(used.user, "system:node:fixture-node");
    assert_no_secret(&agent, &[&client.key_pem]);
    assert!(agent.terminate().success());
}

#[test]
fn the_kubelets_client_certificate_rotation_is_followed_after_the_old_one_expired() {
    let api = ApiServer::start();
    let node = Node::new();
    let signers: Vec<Signer> = (1..=3)
        .map(|i| Signer::new(&format!("signer-{i}"), Algorithm::P256))
        .collect();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &signers[0].pem())], &[]);
    let kubelet = node.root().join("var-lib-kubelet");
    let mut pki = KubeletPki::new(&kubelet);
    let ca = kubelet.join("ca.crt");
    fs::write(&ca, api.ca_pem()).unwrap();
    // A certificate that expires in seconds, as the kubelet's does weeks after start.
    let short =
        api.issue_client_certificate("system:node:fixture-node", &["system:nodes"], 4 * SECOND);
    pki.rotate_to(&short.cert_pem, &short.key_pem);
    let kubeconfig = kubelet.join("kubeconfig");
    write_atomically(
        &kubeconfig,
        kubeconfig_yaml(&api, &ca, &pki.user_yaml()).as_bytes(),
    );

    let agent = start(&node, &kubeconfig);
    wait_until(10 * SECOND, || node.holds(signers[0].pem()));
    let short_not_after = short
        .not_after
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as f64;
    let user = [("embedded_kind", "user")];
    assert_eq!(
        agent.sample("x509_cert_not_after", &user),
        Some(short_not_after)
    );

    // The kubelet rotates: a new dated file, the link swapped. Then the old one expires.
    let renewed =
        api.issue_client_certificate("system:node:fixture-node", &["system:nodes"], 3600 * SECOND);
    pki.rotate_to(&renewed.cert_pem, &renewed.key_pem);
    let renewed_not_after = renewed
        .not_after
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as f64;
    agent.wait_sample(5 * SECOND, "x509_cert_not_after", &user, |v| {
        v == renewed_not_after
    });
    while SystemTime::now() < short.not_after + SECOND {
        std::thread::sleep(SECOND / 4);
    }
    // Every watch ends and is opened again, after the old certificate's expiry.
    api.close_watches();
    for signer in &signers[1..] {
        api.put_configmap(NS, NAME, &[("ca-bundle.crt", &signer.pem())], &[]);
        let took = wait_until(5 * SECOND, || node.holds(signer.pem()));
        eprintln!("rotation reached the file in {took:?} with the renewed certificate");
    }
    let renewed_sha = der_sha256(&renewed.cert_pem);
    let last = api.requests().into_iter().last().unwrap();
    assert_eq!(
        last.client_certificate_sha256.as_deref(),
        Some(renewed_sha.as_str())
    );
    assert!(
        agent
            .log()
            .contains("credentials for the API server changed"),
        "{}",
        agent.log()
    );
    assert_no_secret(&agent, &[&short.key_pem, &renewed.key_pem]);
}

#[test]
fn an_expired_client_certificate_is_named_with_its_not_after() {
    let api = ApiServer::start();
    let node = Node::new();
    let signer = Signer::new("signer", Algorithm::P256);
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &signer.pem())], &[]);
    let kubelet = node.root().join("var-lib-kubelet");
    let mut pki = KubeletPki::new(&kubelet);
    let ca = kubelet.join("ca.crt");
    fs::write(&ca, api.ca_pem()).unwrap();
    let short = api.issue_client_certificate("system:node:fixture-node", &[], 3 * SECOND);
    pki.rotate_to(&short.cert_pem, &short.key_pem);
    let kubeconfig = kubelet.join("kubeconfig");
    write_atomically(
        &kubeconfig,
        kubeconfig_yaml(&api, &ca, &pki.user_yaml()).as_bytes(),
    );
    let agent = start(&node, &kubeconfig);
    wait_until(10 * SECOND, || node.holds(signer.pem()));
    while SystemTime::now() < short.not_after + SECOND {
        std::thread::sleep(SECOND / 4);
    }
    api.close_watches();
    assert!(
        eventually(10 * SECOND, || verbose(&agent).contains("expired at")),
        "{}",
        verbose(&agent)
    );
    let page = verbose(&agent);
    assert!(page.contains("HTTP 401"), "{page}");
    assert!(page.contains("the client certificate in use"), "{page}");
    assert_eq!(agent.get("/readyz").map(|(c, _)| c), Some(200));
}

/// A node whose kubeconfig names a CA file and a token file (`ca.crt` and `token` in the
/// directory returned), the agent started on it and following the ConfigMap, holding
/// `first`.
fn started_on_a_token_file(api: &ApiServer, node: &Node, first: &Signer) -> (Agent, PathBuf) {
    started_on_a_token_file_wrapped(api, node, first, &[])
}

/// [`started_on_a_token_file`], the agent run through `wrapper`.
fn started_on_a_token_file_wrapped(
    api: &ApiServer,
    node: &Node,
    first: &Signer,
    wrapper: &[&str],
) -> (Agent, PathBuf) {
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &first.pem())], &[]);
    let dir = node.root().join("serviceaccount");
    fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.crt");
    fs::write(&ca, api.ca_pem()).unwrap();
    let token = dir.join("token");
    fs::write(&token, api.token()).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    let user = format!("    tokenFile: {}", token.display());
    write_atomically(&kubeconfig, kubeconfig_yaml(api, &ca, &user).as_bytes());
    let agent = start_wrapped(node, &kubeconfig, wrapper);
    wait_until(10 * SECOND, || node.holds(first.pem()));
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 1.0);
    (agent, dir)
}

#[test]
fn the_api_servers_new_ca_is_followed_once_the_ca_file_has_it() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let (agent, dir) = started_on_a_token_file(&api, &node, &a);
    let ca = dir.join("ca.crt");
    let pid = agent.child.id();

    // As a cluster rotates its serving CA: the CA file gains the new CA first...
    let next = api.next_serving_ca();
    write_atomically(&ca, format!("{}{next}", api.ca_pem()).as_bytes());
    agent.wait_sample(
        5 * SECOND,
        "x509_cert_not_after",
        &[("embedded_kind", "cluster")],
        |_| true,
    );
    wait_until(5 * SECOND, || {
        agent
            .get("/metrics")
            .is_some_and(|(_, b)| b.matches("embedded_kind=\"cluster\"").count() == 6)
    });
    // ... then the server moves to it, and every connection is new.
    api.switch_serving_ca();
    api.restart();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    let took = wait_until(10 * SECOND, || node.holds(b.pem()));
    eprintln!("followed the new serving CA: the rotation arrived {took:?} after the switch");
    assert_eq!(agent.child.id(), pid);
    assert!(
        !agent.log().contains("unknown authority"),
        "{}",
        agent.log()
    );
}

#[test]
fn a_server_ca_the_agent_does_not_have_yet_is_named_and_recovered_from() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &a.pem())], &[]);
    let dir = node.root().join("kube");
    fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.crt");
    let old_ca = api.ca_pem();
    fs::write(&ca, &old_ca).unwrap();
    let token = dir.join("token");
    fs::write(&token, api.token()).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    let user = format!("    tokenFile: {}", token.display());
    write_atomically(&kubeconfig, kubeconfig_yaml(&api, &ca, &user).as_bytes());
    let mut agent = start(&node, &kubeconfig);
    wait_until(10 * SECOND, || node.holds(a.pem()));

    // The server moves to a CA the file does not have yet.
    let next = api.next_serving_ca();
    api.switch_serving_ca();
    api.restart();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    let expected = format!("{}: TLS: unknown authority", api.url());
    assert!(
        eventually(10 * SECOND, || verbose(&agent).contains(&expected)),
        "{}",
        verbose(&agent)
    );
    assert!(verbose(&agent).contains(&format!("certificate-authority {}", ca.display())));
    assert!(node.holds(a.pem()));
    assert!(agent.log().contains(&expected), "{}", agent.log());

    // The CA file gains it: the agent recovers, without a restart.
    write_atomically(&ca, format!("{old_ca}{next}").as_bytes());
    let took = wait_until(10 * SECOND, || node.holds(b.pem()));
    eprintln!("recovered {took:?} after the CA file gained the new CA");
    assert!(agent.child.try_wait().unwrap().is_none());
}

#[test]
fn a_replaced_token_file_is_followed_and_the_old_token_refused() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let first = api.token();
    let (agent, dir) = started_on_a_token_file(&api, &node, &a);
    let token = dir.join("token");

    let second = api.rotate_token();
    write_atomically(&token, second.as_bytes());
    api.close_watches();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    let took = wait_until(5 * SECOND, || node.holds(b.pem()));
    eprintln!("the new token carried the rotation in {took:?}");
    assert_no_secret(&agent, &[&first, &second]);
}

/// The agent's requests for the ConfigMap made after `since`.
fn configmap_requests_after(
    api: &ApiServer,
    since: std::time::Instant,
) -> Vec<common::apiserver::Request> {
    api.requests()
        .into_iter()
        .filter(|r| r.at > since && r.path.contains("/configmaps"))
        .collect()
}

#[test]
fn new_credentials_resume_the_open_watch_at_once_from_where_it_was() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let (agent, dir) = started_on_a_token_file(&api, &node, &a);
    let token = dir.join("token");
    // The watch stays open on the old token (a stream already authenticated is not cut),
    // so nothing but the agent itself moves it to the new one.
    wait_until(5 * SECOND, || api.open_watches() == 1);
    let second = api.rotate_token();
    let written = std::time::Instant::now();
    write_atomically(&token, second.as_bytes());
    let resumed = wait_until(5 * SECOND, || {
        configmap_requests_after(&api, written)
            .iter()
            .any(|r| r.watch && r.auth_error.is_none())
    });
    eprintln!("the watch was resumed on the new token {resumed:?} after it was written");
    let after = configmap_requests_after(&api, written);
    assert!(
        after
            .iter()
            .all(|r| !r.is_list() && r.param("resourceVersion").is_some()),
        "resumed from its resourceVersion, without a list: {after:#?}"
    );
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    wait_until(5 * SECOND, || node.holds(b.pem()));
    assert_no_secret(&agent, &[&second]);
}

#[test]
fn new_credentials_end_a_grown_backoff_at_once() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let (agent, dir) = started_on_a_token_file(&api, &node, &a);
    let token = dir.join("token");
    // The token is revoked and the watch cut: every attempt is refused (401), and the
    // backoff grows (0.4-0.8 s, then doubling) while the token file stays as it was.
    let second = api.rotate_token();
    let revoked = std::time::Instant::now();
    api.close_watches();
    wait_until(30 * SECOND, || {
        configmap_requests_after(&api, revoked)
            .iter()
            .filter(|r| r.auth_error.is_some())
            .count()
            >= 5
    });
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 0.0);
    // The next attempt is now at least 3.2 s away; the new token must not wait for it.
    let written = std::time::Instant::now();
    write_atomically(&token, second.as_bytes());
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    let took = wait_until(5 * SECOND, || node.holds(b.pem()));
    let accepted = configmap_requests_after(&api, written)
        .into_iter()
        .find(|r| r.auth_error.is_none())
        .expect("a request on the new token");
    let gap = accepted.at - written;
    eprintln!("first request on the new token {gap:?} after it was written; the file {took:?}");
    assert!(
        gap < 2 * SECOND,
        "the new token waited {gap:?}, as if for the backoff the old one had grown"
    );
    assert_no_secret(&agent, &[&second]);
}

#[test]
fn a_401_reads_the_credentials_again_when_no_file_event_said_they_changed() {
    // No inotify at all (a user namespace where none may be made, as on a node out of
    // instances): a replaced token file sends no event. The 401 of the old token is what
    // tells the agent, at once, not at the once-a-minute reading.
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let (agent, dir) = started_on_a_token_file_wrapped(&api, &node, &a, &WITHOUT_INOTIFY);
    let token = dir.join("token");

    let second = api.rotate_token();
    write_atomically(&token, second.as_bytes());
    api.close_watches();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    let took = wait_until(10 * SECOND, || node.holds(b.pem()));
    eprintln!("with no file events, the 401 brought the new token in: the rotation took {took:?}");
    assert_no_secret(&agent, &[&second]);
}

#[test]
fn credentials_that_break_after_working_are_reported_and_the_last_good_ones_kept() {
    let api = ApiServer::start();
    let node = Node::new();
    let a = Signer::new("signer-a", Algorithm::P256);
    let (agent, dir) = started_on_a_token_file(&api, &node, &a);
    let log = agent.log();
    assert!(
        log.contains("credentials for the API server loaded"),
        "{log}"
    );
    assert!(log.contains("trusted_cas=1"), "{log}");
    // The CA file loses its certificate: the credentials cannot be used, which health and
    // the log say, while the client of the last good ones goes on.
    fs::write(dir.join("ca.crt"), "not a certificate\n").unwrap();
    wait_until(5 * SECOND, || agent.log().contains("cannot be used"));
    let said = "certificate-authority {} holds no PEM certificate; requests use the last good credentials meanwhile (not counted)";
    let said = said.replace("{}", &dir.join("ca.crt").display().to_string());
    wait_until(5 * SECOND, || {
        verbose(&agent).contains(&format!("[-]credentials failed: {said}"))
    });
    assert!(
        agent
            .log()
            .contains("keeping the client of the last good ones")
    );
    assert_eq!(agent.get("/readyz").map(|(c, _)| c), Some(200));
    // The CA file gains the next serving CA beside the current one: new credentials,
    // trusting two CAs.
    let both = format!("{}{}", api.ca_pem(), api.next_serving_ca());
    write_atomically(&dir.join("ca.crt"), both.as_bytes());
    wait_until(5 * SECOND, || {
        agent
            .log()
            .contains("credentials for the API server changed")
    });
    let log = agent.log();
    assert!(log.contains("trusted_cas=2"), "{log}");
}

#[test]
fn credentials_written_in_place_slowly_never_crash_the_agent_nor_mix_a_pair() {
    let api = ApiServer::start();
    let node = Node::new();
    let signers: Vec<Signer> = (1..=2)
        .map(|i| Signer::new(&format!("signer-{i}"), Algorithm::P256))
        .collect();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &signers[0].pem())], &[]);
    let dir = node.root().join("kube");
    fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.crt");
    fs::write(&ca, api.ca_pem()).unwrap();
    let (cert_file, key_file) = (dir.join("client.crt"), dir.join("client.key"));
    let first = api.issue_client_certificate("system:node:first", &[], 3600 * SECOND);
    fs::write(&cert_file, &first.cert_pem).unwrap();
    fs::write(&key_file, &first.key_pem).unwrap();
    let user = format!(
        "    client-certificate: {}\n    client-key: {}",
        cert_file.display(),
        key_file.display()
    );
    let kubeconfig = dir.join("kubeconfig");
    let yaml = kubeconfig_yaml(&api, &ca, &user);
    fs::write(&kubeconfig, &yaml).unwrap();
    let mut agent = start(&node, &kubeconfig);
    wait_until(10 * SECOND, || node.holds(signers[0].pem()));

    // In place, a few bytes at a time: the kubeconfig, then the certificate, then its key.
    let second = api.issue_client_certificate("system:node:second", &[], 3600 * SECOND);
    let slowly = |path: &Path, content: &str| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(path)
            .unwrap();
        for chunk in content.as_bytes().chunks(content.len() / 6 + 1) {
            file.write_all(chunk).unwrap();
            file.flush().unwrap();
            std::thread::sleep(SECOND / 5);
        }
    };
    slowly(&kubeconfig, &yaml);
    slowly(&cert_file, &second.cert_pem);
    slowly(&key_file, &second.key_pem);
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent exited"
    );

    api.close_watches();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &signers[1].pem())], &[]);
    wait_until(10 * SECOND, || node.holds(signers[1].pem()));
    // Every request carried a whole pair: the first identity or the second, never a
    // certificate with the other's key (that handshake fails before any request).
    // The watch is resumed with the second identity once its pair is whole.
    assert!(
        eventually(5 * SECOND, || api
            .requests()
            .iter()
            .any(|r| r.user == "system:node:second")),
        "{}",
        agent.log()
    );
    let known = [der_sha256(&first.cert_pem), der_sha256(&second.cert_pem)];
    for request in api.requests() {
        let sha = request
            .client_certificate_sha256
            .expect("a client certificate");
        assert!(
            known.contains(&sha),
            "an unknown client certificate was presented"
        );
        assert!(
            !request.user.is_empty(),
            "a request was refused: {}",
            request.user
        );
    }
    let last = api.requests().into_iter().last().unwrap();
    assert_eq!(last.user, "system:node:second", "{}", agent.log());
    let log = agent.log();
    assert!(!log.contains("panicked"), "{log}");
    assert_no_secret(&agent, &[&first.key_pem, &second.key_pem]);
}

#[test]
fn sync_without_usable_credentials_exits_1_with_the_cause_once() {
    let node = Node::new();
    let missing = node.root().join("var-lib-kubelet").join("kubeconfig");
    let out = node.sync(&[SPEC], &["--kubeconfig", missing.to_str().unwrap()]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(err.matches("does not exist").count(), 1, "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(err.contains("pass --kubeconfig"), "{err}");
}

/// A client certificate of X.509 version 1, as `openssl x509 -req` makes without an
/// extension file, against the real API server, which accepts it: the agent with a node's
/// such identity reads the sources and writes its report on its Node, and an operator's
/// `rollout status` with one reads the fleet. Neither is refused as a key that is not the
/// certificate's.
#[test]
fn a_version_1_client_certificate_is_used_as_the_api_server_accepts_it() {
    use common::real_cluster::{Cluster, rollout};
    use common::stdout;
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let signer = Signer::new("signer-a", Algorithm::P256).pem();
    cluster.put_configmap(NS, NAME, &[("ca-bundle.crt", &signer)]);
    cluster.grant_configmaps(
        NS,
        &[NAME],
        &["get", "list", "watch"],
        "system:node:v1-node",
    );
    cluster.create_node("v1-node", None);
    let kubeconfig = cluster.kubeconfig_for_v1("system:node:v1-node", &["system:nodes"]);
    let text = std::process::Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in"])
        .arg(cluster.path("users/system-node-v1-node/client.crt"))
        .output()
        .expect("openssl");
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("Version: 1 (0x0)"),
        "not a version 1 certificate: {}",
        String::from_utf8_lossy(&text.stdout)
    );

    let node = Node::new();
    let agent = Agent::start(
        &node,
        &[SPEC],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    assert!(
        eventually(20 * SECOND, || node.holds(&signer)),
        "the bundle was not written: {}",
        agent.log()
    );
    assert!(
        eventually(10 * SECOND, || cluster
            .node_annotation("v1-node", "kubelet-ca-agent/held")
            .is_some()),
        "no report on Node v1-node: {}",
        agent.log()
    );
    assert!(
        !agent.log().contains("do not go together"),
        "{}",
        agent.log()
    );

    let operator = cluster.kubeconfig_for_v1("v1-operator", &["system:masters"]);
    let out = rollout(&operator, &["status"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(
        stdout(&out).starts_with("1 of 1 nodes hold what the sources make"),
        "{}",
        stdout(&out)
    );
}
