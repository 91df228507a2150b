//! The node's kubeconfigs (issue 26, SPEC 4c), through the real binary: the CA data of a
//! `--manage-kubeconfig` follows its sources through a rotation of the API server's serving
//! CA, gaining the new CA at once and dropping the old one only once the server presents a
//! certificate that the new CA data alone verifies; nothing else in the file changes; a
//! hung server never delays the bundle.

mod common;

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use common::apiserver::ApiServer;
use common::daemon::{Agent, check_line, eventually, samples, wait_until};
use common::pki::{Algorithm, Signer};
use common::systemd::FakeHost;
use common::{Node, sha256_hex};

const SECOND: Duration = Duration::from_secs(1);

fn verbose(agent: &Agent) -> String {
    agent.get("/readyz?verbose").unwrap_or_default().1
}

fn write_atomically(path: &Path, content: &[u8]) {
    let tmp = path.with_extension("tmp-new");
    fs::write(&tmp, content).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// A kubelet's kubeconfig, as the node configuration path writes it: a comment, the CA data
/// of `ca_pem`, and a user whose key is a file and whose token is inline.
fn kubelet_kubeconfig(server: &str, ca_pem: &str) -> String {
    format!(
        "# written by the node configuration path\napiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: {server}\n  name: local\ncontexts:\n- context:\n    cluster: local\n    user: kubelet\n  name: kubelet\ncurrent-context: kubelet\npreferences: {{}}\nusers:\n- name: kubelet\n  user:\n    client-certificate: /var/lib/kubelet/pki/kubelet-client-current.pem\n    client-key: /var/lib/kubelet/pki/kubelet-client-current.pem\n    token: not-a-real-token-but-secret\n",
        STANDARD.encode(ca_pem)
    )
}

/// The CA data of the kubeconfig at `path`, decoded.
fn ca_data(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap();
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("certificate-authority-data: "))
        .expect("CA data");
    String::from_utf8(STANDARD.decode(line).unwrap()).unwrap()
}

/// A node whose kubelet kubeconfig at `etc/kubernetes/kubeconfig` (0600) trusts `ca_pem`
/// for `server`, kept from the source `apiserver-ca.pem`.
struct Kubelet {
    node: Node,
    kubeconfig: PathBuf,
    source: PathBuf,
    bundle_source: String,
}

impl Kubelet {
    fn new(server: &str, ca_pem: &str) -> Kubelet {
        let node = Node::new();
        let bundle_source = node.source(
            "kubelet-signers.pem",
            Signer::new("kubelet-signer", Algorithm::P256).pem(),
        );
        node.source("apiserver-ca.pem", ca_pem);
        let kubeconfig = node.root().join("etc/kubernetes/kubeconfig");
        fs::create_dir_all(kubeconfig.parent().unwrap()).unwrap();
        fs::write(&kubeconfig, kubelet_kubeconfig(server, ca_pem)).unwrap();
        fs::set_permissions(&kubeconfig, fs::Permissions::from_mode(0o600)).unwrap();
        let source = node.root().join("sources/apiserver-ca.pem");
        Kubelet {
            node,
            kubeconfig,
            source,
            bundle_source,
        }
    }

    fn start(&self, extra: &[&str]) -> Agent {
        self.start_with(extra, |_| {})
    }

    fn start_with(&self, extra: &[&str], adjust: impl FnOnce(&mut std::process::Command)) -> Agent {
        let manage = format!(
            "{}=file:{}",
            self.kubeconfig.display(),
            self.source.display()
        );
        let mut args = vec!["--manage-kubeconfig", &manage];
        args.extend_from_slice(extra);
        Agent::start_with(&self.node, &[&self.bundle_source], &args, adjust)
    }

    fn in_sync_line(&self, agent: &Agent) -> String {
        check_line(
            &verbose(agent),
            &format!("in-sync:{}", self.kubeconfig.display()),
        )
    }
}

#[test]
fn a_serving_ca_rotation_adds_the_new_ca_at_once_and_drops_the_old_only_once_the_server_uses_the_new()
 {
    let api = ApiServer::start();
    let old = api.ca_pem();
    let kubelet = Kubelet::new(&api.url(), &old);
    // In the state directory: a hook runs inside the agent's confinement.
    let hook_log = kubelet.node.state_dir().join("hook.log");
    let hook = format!(
        "sh -c 'echo \"$KUBELET_CA_KUBECONFIG $KUBELET_CA_ADDED\" >> {}'",
        hook_log.display()
    );
    let agent = kubelet.start(&["--kubeconfig-hook", &hook]);
    let before = fs::read_to_string(&kubelet.kubeconfig).unwrap();
    wait_until(10 * SECOND, || {
        kubelet.in_sync_line(&agent).starts_with("[+]")
    });
    assert_eq!(
        fs::read_to_string(&kubelet.kubeconfig).unwrap(),
        before,
        "in sync: not written"
    );
    assert!(!hook_log.exists(), "no CA added, no hook");

    // The cluster publishes the next serving CA beside the current one: added at once, and
    // only the CA data changes (the comment, the user's key and token stay, byte for byte).
    let next = api.next_serving_ca();
    write_atomically(&kubelet.source, format!("{old}{next}").as_bytes());
    wait_until(5 * SECOND, || {
        ca_data(&kubelet.kubeconfig) == format!("{old}{next}")
    });
    let after = fs::read_to_string(&kubelet.kubeconfig).unwrap();
    assert_eq!(
        after,
        kubelet_kubeconfig(&api.url(), &format!("{old}{next}")),
        "only the CA data changed"
    );
    let mode = fs::metadata(&kubelet.kubeconfig)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o600, "the kubeconfig's mode is kept");
    wait_until(5 * SECOND, || hook_log.exists());
    let next_sha = {
        let der = pem::parse(next.as_bytes()).unwrap();
        sha256_hex(der.contents())
    };
    assert_eq!(
        fs::read_to_string(&hook_log).unwrap(),
        format!("{} {next_sha}\n", kubelet.kubeconfig.display()),
        "the hook was told the path and the added certificate"
    );

    // The sources drop the old CA while the server still presents a certificate from it:
    // the old CA stays, and health and the metrics say why.
    write_atomically(&kubelet.source, next.as_bytes());
    let held = format!(
        "removal held: the new CA data does not verify {}",
        api.url()
    );
    assert!(
        eventually(10 * SECOND, || kubelet.in_sync_line(&agent).contains(&held)),
        "{}",
        verbose(&agent)
    );
    assert!(
        kubelet.in_sync_line(&agent).ends_with("(not counted)"),
        "{}",
        kubelet.in_sync_line(&agent)
    );
    assert_eq!(
        ca_data(&kubelet.kubeconfig),
        format!("{old}{next}"),
        "as it was: not even reordered"
    );
    let filepath = kubelet.kubeconfig.display().to_string();
    assert_eq!(
        agent.sample(
            "kubelet_ca_kubeconfig_removal_held",
            &[("filepath", &filepath)]
        ),
        Some(1.0)
    );
    assert!(
        agent
            .sample(
                "kubelet_ca_kubeconfig_removals_held_total",
                &[("filepath", &filepath)]
            )
            .is_some_and(|v| v >= 1.0)
    );
    let body = agent.get("/metrics").unwrap().1;
    assert_eq!(
        samples(&body, "x509_cert_not_after")
            .iter()
            .filter(|s| s.has(&[("filepath", &filepath)]))
            .count(),
        2,
        "both CAs are in the kubeconfig's certificates"
    );
    assert_eq!(
        agent.get("/readyz").unwrap().0,
        200,
        "readiness follows the bundle alone"
    );

    // The server moves to the new CA: the next check lets the old CA go.
    api.switch_serving_ca();
    api.restart();
    let took = wait_until(20 * SECOND, || ca_data(&kubelet.kubeconfig) == next);
    eprintln!("the old CA went {took:?} after the server moved to the new one");
    wait_until(5 * SECOND, || {
        kubelet.in_sync_line(&agent).starts_with("[+]")
    });
    assert_eq!(
        agent.sample(
            "kubelet_ca_kubeconfig_removal_held",
            &[("filepath", &filepath)]
        ),
        Some(0.0)
    );
    assert_eq!(
        fs::read_to_string(&hook_log).unwrap().lines().count(),
        1,
        "a removal alone runs no hook"
    );

    // The history keeps the replaced CA data, never the kubeconfig (it holds a token).
    let history: Vec<Vec<u8>> = walk(&kubelet.node.state_dir())
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("/history/"))
        .map(|p| fs::read(p).unwrap())
        .collect();
    assert_eq!(history.len(), 2, "two replaces, two entries");
    for entry in &history {
        let text = String::from_utf8_lossy(entry);
        assert!(text.starts_with("-----BEGIN CERTIFICATE-----"), "{text}");
        assert!(!text.contains("token"), "{text}");
    }
    let log = agent.log();
    assert!(!log.contains("not-a-real-token"), "{log}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn a_hung_or_unreachable_server_holds_the_removal_and_never_delays_the_bundle() {
    // A server that accepts connections and never says a word.
    let hung = TcpListener::bind("127.0.0.1:0").unwrap();
    let server = format!("https://127.0.0.1:{}", hung.local_addr().unwrap().port());
    let (old, new) = (
        Signer::new("apiserver-ca-old", Algorithm::P256),
        Signer::new("apiserver-ca-new", Algorithm::P256),
    );
    let kubelet = Kubelet::new(&server, &old.pem());
    let agent = kubelet.start(&[]);
    wait_until(10 * SECOND, || {
        kubelet.in_sync_line(&agent).starts_with("[+]")
    });

    write_atomically(&kubelet.source, new.pem().as_bytes());
    wait_until(5 * SECOND, || {
        ca_data(&kubelet.kubeconfig) == format!("{}{}", new.pem(), old.pem())
    });
    // While the check waits on the hung server, the bundle follows its source at once.
    let signer = Signer::new("kubelet-signer-2", Algorithm::P256);
    let bundle_source = kubelet.node.root().join("sources/kubelet-signers.pem");
    write_atomically(&bundle_source, signer.pem().as_bytes());
    let took = wait_until(3 * SECOND, || kubelet.node.holds(signer.pem()));
    eprintln!("the bundle followed in {took:?} while the kubeconfig's server hung");
    let line = kubelet.in_sync_line(&agent);
    assert!(line.contains("removal held"), "{line}");
    assert!(line.contains(&server), "{line}");

    // No server at all: held, saying it cannot be reached.
    drop(hung);
    let line = || kubelet.in_sync_line(&agent);
    assert!(
        eventually(60 * SECOND, || line().contains(&format!(
            "removal held: cannot verify {server}: cannot connect"
        ))),
        "{}",
        line()
    );
    assert_eq!(
        ca_data(&kubelet.kubeconfig),
        format!("{}{}", new.pem(), old.pem())
    );
}

#[test]
fn a_kubeconfig_that_cannot_be_kept_is_left_alone_and_named() {
    let ca = Signer::new("apiserver-ca", Algorithm::P256);
    let kubelet = Kubelet::new("https://127.0.0.1:6443", &ca.pem());
    let two = format!(
        "kind: Config\nclusters:\n- name: a\n  cluster:\n    server: https://a:6443\n    certificate-authority-data: {data}\n- name: b\n  cluster:\n    server: https://b:6443\n    certificate-authority-data: {data}\nusers:\n- name: u\n  user:\n    token: hunter2-secret\n",
        data = STANDARD.encode(ca.pem())
    );
    fs::write(&kubelet.kubeconfig, &two).unwrap();
    let agent = kubelet.start(&[]);
    let expected = "it has no current context and 2 clusters (a, b): cannot tell which one to keep";
    assert!(
        eventually(10 * SECOND, || kubelet
            .in_sync_line(&agent)
            .contains(expected)),
        "{}",
        verbose(&agent)
    );
    assert_eq!(agent.get("/readyz").unwrap().0, 200);
    assert_eq!(fs::read_to_string(&kubelet.kubeconfig).unwrap(), two);
    let filepath = kubelet.kubeconfig.display().to_string();
    assert_eq!(
        agent.sample(
            "kubelet_ca_sync_errors_total",
            &[("filepath", &filepath), ("reason", "invalid_kubeconfig")]
        ),
        Some(1.0)
    );
    assert!(!agent.log().contains("hunter2"), "{}", agent.log());
    assert!(!verbose(&agent).contains("hunter2"));
}

/// `drift`: a managed kubeconfig is listed among the exclusions, checked for any change but
/// its CA data, and kept by `strip` (a new node needs it at first boot).
#[test]
fn drift_checks_a_managed_kubeconfig_but_its_ca_data_and_strip_keeps_it() {
    let (old, new) = (
        Signer::new("apiserver-ca-old", Algorithm::P256),
        Signer::new("apiserver-ca-new", Algorithm::P256),
    );
    let server = "https://api-int.example:6443";
    let kubelet = Kubelet::new(server, &old.pem());
    let mut agent = kubelet.start(&[]);
    write_atomically(
        &kubelet.source,
        format!("{}{}", old.pem(), new.pem()).as_bytes(),
    );
    wait_until(10 * SECOND, || {
        ca_data(&kubelet.kubeconfig) == format!("{}{}", old.pem(), new.pem())
    });
    let recorded = kubelet.node.state_dir().join("managed-files.json");
    wait_until(5 * SECOND, || {
        fs::read_to_string(&recorded).is_ok_and(|r| r.contains("\"kind\": \"kubeconfig\""))
    });
    agent.terminate();

    let drift = |args: &[&str]| {
        let out = std::process::Command::new(common::agent_bin())
            .arg("drift")
            .args(args)
            .arg("--state-dir")
            .arg(kubelet.node.state_dir())
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let rendered = |content: &str| {
        let config = serde_json::json!({
            "ignition": {"version": "3.4.0"},
            "storage": {"files": [{
                "path": "/etc/kubernetes/kubeconfig",
                "mode": 0o600,
                "overwrite": true,
                "contents": {"source": format!("data:;base64,{}", STANDARD.encode(content))},
            }]},
        });
        let path = kubelet.node.root().join("rendered.json");
        fs::write(&path, config.to_string()).unwrap();
        path
    };
    // The rendered config still carries the first CA data: no drift.
    let as_rendered = rendered(&kubelet_kubeconfig(server, &old.pem()));
    let (code, out, err) = drift(&[
        "check",
        "--root",
        kubelet.node.root().to_str().unwrap(),
        "--rendered",
        as_rendered.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    // Another server is drift.
    let moved = rendered(&kubelet_kubeconfig("https://api.example:6443", &old.pem()));
    let (code, out, err) = drift(&[
        "check",
        "--root",
        kubelet.node.root().to_str().unwrap(),
        "--rendered",
        moved.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.contains("/etc/kubernetes/kubeconfig"), "{out}");
    // strip keeps it; exclusions list it.
    let (code, out, err) = drift(&[
        "strip",
        "--root",
        kubelet.node.root().to_str().unwrap(),
        "--rendered",
        as_rendered.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("/etc/kubernetes/kubeconfig"), "{out}");
    let (code, out, err) = drift(&["exclusions", "--format", "plain"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.lines()
            .any(|l| l == kubelet.kubeconfig.display().to_string()),
        "{out}"
    );
}

/// The unit's case: the managed kubeconfig is the agent's own (`--kubeconfig`). The agent's
/// client follows the CA data it writes, so it keeps following the cluster across the API
/// server's move to the new CA, and after the old CA is gone.
#[test]
fn the_agents_own_kubeconfig_is_followed_across_the_switch_it_prepared() {
    const NS: &str = "openshift-config-managed";
    const NAME: &str = "kube-apiserver-client-ca";
    let api = ApiServer::start();
    let old = api.ca_pem();
    let signers: Vec<Signer> = ["a", "b", "c"]
        .iter()
        .map(|cn| Signer::new(&format!("signer-{cn}"), Algorithm::P256))
        .collect();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &signers[0].pem())], &[]);
    let node = Node::new();
    let source = node.root().join("sources/apiserver-ca.pem");
    fs::create_dir_all(source.parent().unwrap()).unwrap();
    fs::write(&source, &old).unwrap();
    let kubeconfig = node.root().join("kubelet/kubeconfig");
    fs::create_dir_all(kubeconfig.parent().unwrap()).unwrap();
    fs::copy(api.kubeconfig(), &kubeconfig).unwrap();
    fs::set_permissions(&kubeconfig, fs::Permissions::from_mode(0o600)).unwrap();
    let manage = format!("{}=file:{}", kubeconfig.display(), source.display());
    let agent = Agent::start(
        &node,
        &[&format!("configmap:{NS}/{NAME}")],
        &[
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--manage-kubeconfig",
            &manage,
        ],
    );
    wait_until(10 * SECOND, || node.holds(signers[0].pem()));

    // The next serving CA is published: the agent's own kubeconfig gains it.
    let next = api.next_serving_ca();
    write_atomically(&source, format!("{old}{next}").as_bytes());
    wait_until(5 * SECOND, || {
        ca_data(&kubeconfig) == format!("{old}{next}")
    });
    // Its client takes the new CA data in (as it would, minutes before any server moves).
    wait_until(5 * SECOND, || agent.log().contains("trusted_cas=2"));
    // The server moves to it; every connection is new. The agent still follows.
    api.switch_serving_ca();
    api.restart();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &signers[1].pem())], &[]);
    let took = wait_until(15 * SECOND, || node.holds(signers[1].pem()));
    eprintln!("followed a rotation {took:?} after the server's switch");
    // The old CA is withdrawn: gone once the server verifies with the new one alone, and
    // the agent goes on following with the new CA data alone.
    write_atomically(&source, next.as_bytes());
    wait_until(20 * SECOND, || ca_data(&kubeconfig) == next);
    api.restart();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &signers[2].pem())], &[]);
    wait_until(15 * SECOND, || node.holds(signers[2].pem()));
    let log = agent.log();
    assert!(!log.contains("unknown authority"), "{log}");
}

/// `sync` is one pass of the kubeconfig too: an addition is written at once; a removal
/// waits for the check of the server, made then and there, and the run exits 1 naming
/// why it is held.
#[test]
fn sync_adds_at_once_and_removes_only_once_the_server_verifies() {
    let api = ApiServer::start();
    let old = api.ca_pem();
    let kubelet = Kubelet::new(&api.url(), &old);
    let manage = format!(
        "{}=file:{}",
        kubelet.kubeconfig.display(),
        kubelet.source.display()
    );
    let sync = || {
        kubelet
            .node
            .sync(&[&kubelet.bundle_source], &["--manage-kubeconfig", &manage])
    };
    let next = api.next_serving_ca();
    write_atomically(&kubelet.source, format!("{old}{next}").as_bytes());
    let out = sync();
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert_eq!(ca_data(&kubelet.kubeconfig), format!("{old}{next}"));

    write_atomically(&kubelet.source, next.as_bytes());
    let out = sync();
    assert_eq!(out.status.code(), Some(1), "{}", common::stderr(&out));
    let err = common::stderr(&out);
    assert!(
        err.contains(&format!(
            "removal held: the new CA data does not verify {}",
            api.url()
        )),
        "{err}"
    );
    assert_eq!(ca_data(&kubelet.kubeconfig), format!("{old}{next}"));

    api.switch_serving_ca();
    api.restart();
    let out = sync();
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert_eq!(ca_data(&kubelet.kubeconfig), next);
}

/// A node whose kubeconfig is in sync, and an agent that asks the host to restart the
/// kubelet through the request directory, where a stand-in for the host's path unit takes
/// each request (each restart taking 0.2 s).
fn restarting() -> (ApiServer, Kubelet, FakeHost, Agent) {
    restarting_with(SECOND / 5, &[])
}

/// [`restarting`], each restart taking `takes`, with `extra` flags.
fn restarting_with(takes: Duration, extra: &[&str]) -> (ApiServer, Kubelet, FakeHost, Agent) {
    let api = ApiServer::start();
    let kubelet = Kubelet::new(&api.url(), &api.ca_pem());
    let host = FakeHost::start(&kubelet.node.root().join("run/kubelet-restart"), takes);
    let dir = host.dir.to_str().unwrap().to_string();
    let mut args = vec!["--kubeconfig-restart-request", dir.as_str()];
    args.extend_from_slice(extra);
    let agent = kubelet.start_with(&args, |_| {});
    wait_until(10 * SECOND, || {
        kubelet.in_sync_line(&agent).starts_with("[+]")
    });
    (api, kubelet, host, agent)
}

#[test]
fn the_kubelets_restart_is_asked_of_the_host_once_per_addition_and_a_failed_one_is_retried() {
    let (api, kubelet, host, agent) = restarting();
    let old = api.ca_pem();
    assert_eq!(host.taken(), 0, "no CA added, no restart");

    // The next serving CA is added: one restart of the kubelet, asked of the host.
    let next = api.next_serving_ca();
    write_atomically(&kubelet.source, format!("{old}{next}").as_bytes());
    wait_until(5 * SECOND, || host.taken() == 1);
    wait_until(5 * SECOND, || {
        agent.log().contains("the host restarted the kubelet")
    });
    let failures = || {
        agent
            .sample("kubelet_ca_kubeconfig_hook_failures_total", &[])
            .unwrap_or(0.0)
    };
    assert_eq!(failures(), 0.0);
    let page = agent.get("/readyz?verbose").unwrap().1;
    assert!(
        page.contains(&format!(
            "[+]kubelet-restart:{} ok",
            kubelet.kubeconfig.display()
        )),
        "{page}"
    );

    // A restart that ends otherwise (the kubelet did not start) is a failure: counted,
    // logged in systemd's words, and asked again after a backoff (1 s, then 2 s), never in
    // a loop; once one is done, no more.
    host.set_result("exit-code exited 1");
    let third = Signer::new("third-ca", Algorithm::P256).pem();
    write_atomically(&kubelet.source, format!("{old}{next}{third}").as_bytes());
    wait_until(10 * SECOND, || failures() >= 2.0);
    assert!(
        agent
            .log()
            .contains(r#"the host's kubelet restart ended with "exit-code exited 1""#),
        "{}",
        agent.log()
    );
    host.set_result("success exited 0");
    let calls = wait_until(10 * SECOND, || {
        agent
            .log()
            .matches("the host restarted the kubelet")
            .count()
            == 2
    });
    eprintln!("the restart went through {calls:?} after it stopped failing");
    let made = host.taken();
    assert!((3..=4).contains(&made), "{made} restarts");
    std::thread::sleep(3 * SECOND);
    assert_eq!(host.taken(), made, "no restart once one is done");
    assert_eq!(
        agent.sample("kubelet_ca_kubeconfig_hook_failures_total", &[]),
        Some((made - 2) as f64)
    );
}

#[test]
fn a_restart_nothing_on_the_host_takes_is_pending_with_the_reason_until_the_path_unit_comes() {
    let api = ApiServer::start();
    let kubelet = Kubelet::new(&api.url(), &api.ca_pem());
    let dir = kubelet.node.root().join("run/kubelet-restart");
    let shown = dir.to_str().unwrap().to_string();
    let agent = kubelet.start_with(&["--kubeconfig-restart-request", &shown], |_| {});
    wait_until(10 * SECOND, || {
        kubelet.in_sync_line(&agent).starts_with("[+]")
    });
    assert!(
        dir.is_dir(),
        "the agent makes its request directory at start"
    );
    let next = api.next_serving_ca();
    write_atomically(
        &kubelet.source,
        format!("{}{next}", api.ca_pem()).as_bytes(),
    );
    // Nothing takes the request: pending (never failed), naming the path unit.
    let line = format!(
        "[?]kubelet-restart:{} pending: ",
        kubelet.kubeconfig.display()
    );
    let took = wait_until(15 * SECOND, || {
        agent
            .get("/readyz?verbose")
            .is_some_and(|(_, page)| page.contains(&format!("{line}nothing on this host took")))
    });
    assert!(
        took >= 9 * SECOND,
        "said pending for want of a taker after {took:?}"
    );
    let page = agent.get("/readyz?verbose").unwrap().1;
    assert!(
        page.contains("kubelet-ca-agent-kubelet-restart.path enabled?")
            && page.contains("(not counted)"),
        "{page}"
    );
    assert_eq!(agent.get("/readyz").map(|(c, _)| c), Some(200), "{page}");
    assert_eq!(
        agent.sample("kubelet_ca_kubeconfig_hook_failures_total", &[]),
        Some(0.0),
        "waiting for the host is not a failure"
    );
    // The path unit is installed: it takes the waiting request, and the restart is done.
    let host = FakeHost::start(&dir, SECOND / 5);
    wait_until(5 * SECOND, || host.taken() == 1);
    let done = format!("[+]kubelet-restart:{} ok", kubelet.kubeconfig.display());
    wait_until(5 * SECOND, || {
        agent
            .get("/readyz?verbose")
            .is_some_and(|(_, page)| page.contains(&done))
    });
}

#[test]
fn the_old_restart_unit_flag_is_read_as_the_request_and_other_units_are_refused() {
    for (flags, code, says) in [
        (
            vec![
                "--kubeconfig-restart-request",
                "/run/x",
                "--kubeconfig-hook",
                "true",
            ],
            2,
            "cannot be used with",
        ),
        (
            vec![
                "--kubeconfig-restart-unit",
                "kubelet.service",
                "--kubeconfig-hook",
                "true",
            ],
            2,
            "cannot be used with",
        ),
        (
            vec!["--kubeconfig-restart-unit", "containerd.service"],
            2,
            "no longer restarts units itself",
        ),
        (
            vec!["--kubeconfig-restart-unit", "kubelet"],
            2,
            "give the full name",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kubelet-ca-agent"))
            .arg("sync")
            .args(&flags)
            .env_clear()
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{flags:?}: {stderr}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
    }
}

#[test]
fn a_restart_slower_than_the_hook_timeout_is_waited_for_not_asked_again_and_never_holds_a_stop() {
    // The kubelet takes 4 s to start, the hook's timeout is 1 s: asking again would restart
    // it again. The agent waits for the host's result instead.
    let (api, kubelet, host, agent) =
        restarting_with(4 * SECOND, &["--exec-on-change-timeout", "1s"]);
    let next = api.next_serving_ca();
    write_atomically(
        &kubelet.source,
        format!("{}{next}", api.ca_pem()).as_bytes(),
    );
    wait_until(10 * SECOND, || {
        agent.log().contains("the host restarted the kubelet")
    });
    assert_eq!(host.taken(), 1);
    assert_eq!(
        agent.sample("kubelet_ca_kubeconfig_hook_failures_total", &[]),
        Some(0.0)
    );

    // A stop while a restart runs is not held up by it.
    let mut agent = agent;
    let third = Signer::new("third-ca", Algorithm::P256).pem();
    write_atomically(
        &kubelet.source,
        format!("{}{next}{third}", api.ca_pem()).as_bytes(),
    );
    wait_until(5 * SECOND, || host.taken() == 2);
    let asked = std::time::Instant::now();
    agent.terminate();
    let took = asked.elapsed();
    assert!(
        took < 3 * SECOND,
        "the stop waited {took:?} for the restart"
    );
}
