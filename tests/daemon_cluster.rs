//! `run` and `sync` against a local API server that behaves like kube-apiserver: rotations
//! through a ConfigMap and a ControllerConfig, an API server that goes away or answers
//! 410 Gone, deleted objects, bad content, and the steady state (one watch, no re-list).

mod common;

use std::time::Duration;

use base64::Engine;
use common::apiserver::{ApiServer, Fault, HangMode, Rule, Target};
use common::daemon::{Agent, eventually, wait_until};
use common::pki::{self, Algorithm, Signer};
use common::{Node, fingerprint_file, stderr};

const SECOND: Duration = Duration::from_secs(1);
const NS: &str = "openshift-config-managed";
const NAME: &str = "kube-apiserver-client-ca";
const SPEC: &str = "configmap:openshift-config-managed/kube-apiserver-client-ca";

fn start(node: &Node, api: &ApiServer, sources: &[&str]) -> Agent {
    Agent::start(
        node,
        sources,
        &["--kubeconfig", api.kubeconfig().to_str().unwrap()],
    )
}

fn b64(pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(pem)
}

#[test]
fn a_configmap_rotation_reaches_the_file_within_a_second() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("kube-csr-signer-1", Algorithm::P256),
        Signer::new("kube-csr-signer-2", Algorithm::Rsa),
    );
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &a.pem())], &[]);
    let agent = start(&node, &api, &[SPEC]);
    wait_until(10 * SECOND, || node.holds(a.pem()));

    for next in [a.pem() + &b.pem(), b.pem()] {
        api.put_configmap(NS, NAME, &[("ca-bundle.crt", &next)], &[]);
        let took = wait_until(SECOND, || node.holds(&next));
        eprintln!("rotation reached the file in {took:?}");
    }
    agent.wait_listening();
    assert_eq!(agent.metric("kubelet_ca_source_up{"), Some(1.0));
    // The counter follows the rename by a moment.
    agent.wait_metric(SECOND, "kubelet_ca_writes_total{", 3.0);
}

#[test]
fn a_controllerconfig_rotation_reaches_the_file_and_unrelated_changes_do_not() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P384),
        Signer::new("signer-b", Algorithm::Ed25519),
    );
    api.put_controllerconfig("machine-config-controller", &b64(&a.pem()));
    let _agent = start(&node, &api, &["controllerconfig:machine-config-controller"]);
    wait_until(10 * SECOND, || node.holds(a.pem()));
    let before = fingerprint_file(&node.bundle());
    api.touch_controllerconfig("machine-config-controller");
    std::thread::sleep(SECOND / 2);
    assert_eq!(
        fingerprint_file(&node.bundle()),
        before,
        "an unrelated change rewrote the file"
    );

    api.put_controllerconfig("machine-config-controller", &b64(&(a.pem() + &b.pem())));
    let took = wait_until(SECOND, || node.holds(a.pem() + &b.pem()));
    eprintln!("ControllerConfig rotation reached the file in {took:?}");
}

#[test]
fn the_agent_rides_out_an_api_server_outage_and_a_410_gone() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b, c) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
        Signer::new("c", Algorithm::P256),
    );
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &a.pem())], &[]);
    let agent = start(&node, &api, &[SPEC]);
    wait_until(10 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();
    let before = fingerprint_file(&node.bundle());

    api.stop();
    // An update made while the agent cannot see it.
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &(a.pem() + &b.pem()))], &[]);
    agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 0.0);
    std::thread::sleep(2 * SECOND);
    assert_eq!(
        fingerprint_file(&node.bundle()),
        before,
        "the file changed while the API was away"
    );
    let (code, verbose) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200, "a valid file keeps the agent ready: {verbose}");
    assert!(verbose.contains(&format!("[-]source:{SPEC}")), "{verbose}");

    // The restarted server has a fresh watch cache: the resumed watch gets 410 Gone and
    // the agent lists again.
    api.restart();
    wait_until(40 * SECOND, || node.holds(a.pem() + &b.pem()));
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 1.0);
    assert!(
        agent
            .metric("kubelet_ca_watch_restarts_total{")
            .is_some_and(|v| v >= 1.0)
    );

    // Compaction while watching: the next resume gets 410, and an update still arrives.
    api.compact();
    api.close_watches();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &c.pem())], &[]);
    wait_until(10 * SECOND, || node.holds(c.pem()));
    let lists = api.requests().iter().filter(|r| r.is_list()).count();
    assert!(lists >= 2, "a 410 must lead to a new list ({lists} lists)");
}

#[test]
fn a_deleted_configmap_keeps_the_file_and_its_return_converges() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &a.pem())], &[]);
    let agent = start(&node, &api, &[SPEC]);
    wait_until(10 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();
    let before = fingerprint_file(&node.bundle());

    api.delete_configmap(NS, NAME);
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 0.0);
    std::thread::sleep(SECOND / 2);
    assert_eq!(
        fingerprint_file(&node.bundle()),
        before,
        "deleting the source must never empty the file"
    );
    let (code, verbose) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200);
    assert!(verbose.contains("does not exist"), "{verbose}");

    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    wait_until(SECOND, || node.holds(b.pem()));
    agent.wait_metric(SECOND, "kubelet_ca_source_up{", 1.0);
}

#[test]
fn bad_content_from_the_cluster_never_reaches_the_file_or_the_log() {
    let api = ApiServer::start();
    let node = Node::new();
    let good = Signer::new("good", Algorithm::P256);
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &good.pem())], &[]);
    api.put_controllerconfig("machine-config-controller", &b64(&good.pem()));
    let agent = start(
        &node,
        &api,
        &[SPEC, "controllerconfig:machine-config-controller"],
    );
    wait_until(10 * SECOND, || node.holds(good.pem()));
    agent.wait_listening();
    let before = fingerprint_file(&node.bundle());
    let key = good.key_pem();

    let bad_configmaps = [
        good.pem() + &key,
        "garbage".to_string(),
        good.pem()[..300].to_string(),
    ];
    for (i, bad) in bad_configmaps.iter().enumerate() {
        api.put_configmap(NS, NAME, &[("ca-bundle.crt", bad)], &[]);
        let want = i as f64 + 1.0;
        wait_until(5 * SECOND, || errors_total(&agent, SPEC) >= want);
    }
    api.put_controllerconfig("machine-config-controller", "%%% not base64 %%%");
    wait_until(5 * SECOND, || {
        errors_total(&agent, "controllerconfig:machine-config-controller") >= 1.0
    });
    api.put_configmap(NS, NAME, &[("other-key", &good.pem())], &[]);
    wait_until(5 * SECOND, || agent.log().contains("missing_key"));

    std::thread::sleep(SECOND / 2);
    assert_eq!(fingerprint_file(&node.bundle()), before);
    let log = agent.log();
    for reason in [
        "private_key",
        "no_certificate",
        "malformed_pem",
        "bad_base64",
        "missing_key",
    ] {
        assert!(log.contains(reason), "{reason} not logged:\n{log}");
    }
    for line in key.lines().filter(|l| !l.starts_with("-----")) {
        assert!(!log.contains(line), "key material in the log");
    }
    let (code, _) = agent.get("/readyz").unwrap();
    assert_eq!(code, 200, "the valid file stays; the agent stays ready");
}

/// kubelet_ca_source_errors_total for a source, summed over reasons.
fn errors_total(agent: &Agent, source: &str) -> f64 {
    let Some((_, body)) = agent.get("/metrics") else {
        return 0.0;
    };
    body.lines()
        .filter(|l| {
            l.starts_with(&format!(
                "kubelet_ca_source_errors_total{{source=\"{source}\""
            ))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn steady_state_is_one_watch_and_no_relist() {
    let api = ApiServer::start();
    api.set_bookmark_interval(SECOND / 2);
    let node = Node::new();
    let pems: Vec<String> = (0..4)
        .map(|i| Signer::new(&format!("gen-{i}"), Algorithm::P256).pem())
        .collect();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pems[0])], &[]);
    let _agent = start(&node, &api, &[SPEC]);
    wait_until(10 * SECOND, || node.holds(&pems[0]));
    for pem in &pems[1..] {
        api.put_configmap(NS, NAME, &[("ca-bundle.crt", pem)], &[]);
        wait_until(SECOND, || node.holds(pem));
        // Unrelated objects move the resourceVersion, so bookmarks flow.
        api.put_configmap("default", "unrelated", &[("x", pem)], &[]);
    }
    let requests = api.requests();
    let lists = requests.iter().filter(|r| r.is_list()).count();
    assert_eq!(lists, 1, "one list at start, none after: {requests:#?}");
    // The server ends the watch long before its timeout (a cut, not its timeoutSeconds): one
    // list, as after any lost connection, then a watch from where that list stood.
    api.close_watches();
    std::thread::sleep(SECOND);
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pems[0])], &[]);
    wait_until(SECOND, || node.holds(&pems[0]));

    let requests = api.requests();
    let lists = requests.iter().filter(|r| r.is_list()).count();
    let watches: Vec<_> = requests.iter().filter(|r| r.watch).collect();
    assert_eq!(lists, 2, "one list after the cut: {requests:#?}");
    assert_eq!(api.open_watches(), 1);
    for watch in &watches {
        assert_eq!(
            watch.param("fieldSelector").as_deref(),
            Some(format!("metadata.name={NAME}").as_str())
        );
        assert_eq!(watch.param("allowWatchBookmarks").as_deref(), Some("true"));
    }
    let resumed = watches.last().unwrap().param("resourceVersion").unwrap();
    assert_ne!(
        resumed, "0",
        "the resumed watch starts from the last resourceVersion"
    );
}

#[test]
fn every_key_and_binary_data_with_star() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b, c) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
        Signer::new("c", Algorithm::P256),
    );
    api.put_configmap(
        NS,
        NAME,
        &[("2-b.crt", &b.pem()), ("3-c.crt", &c.pem())],
        &[("1-a.crt", a.pem().as_bytes())],
    );
    let _agent = start(&node, &api, &[&format!("{SPEC}/*")]);
    wait_until(10 * SECOND, || node.holds(a.pem() + &b.pem() + &c.pem()));
}

#[test]
fn sync_reads_a_configmap_with_one_list_and_no_watch() {
    let api = ApiServer::start();
    let node = Node::new();
    let pem = pki::bundle_of(2, "ca");
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pem)], &[]);
    let out = node.sync(
        &[SPEC],
        &["--kubeconfig", api.kubeconfig().to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(node.read_bundle(), pem.as_bytes());
    let requests = api.requests();
    assert_eq!(requests.iter().filter(|r| r.is_list()).count(), 1);
    assert_eq!(requests.iter().filter(|r| r.watch).count(), 0);

    api.delete_configmap(NS, NAME);
    let out = node.sync(
        &[SPEC],
        &["--kubeconfig", api.kubeconfig().to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("does not exist"), "{}", stderr(&out));
    assert_eq!(node.read_bundle(), pem.as_bytes());

    api.fail_next(1, 403);
    let out = node.sync(
        &[SPEC],
        &["--kubeconfig", api.kubeconfig().to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("forbidden") || stderr(&out).contains("Forbidden"),
        "{}",
        stderr(&out)
    );
}

/// RBAC that lets the agent read ConfigMaps in one namespace it has no business in: both
/// OpenShift's source and the kubeadm-style one are forbidden.
fn only_elsewhere() -> Vec<Rule> {
    vec![Rule::new(
        &["get"],
        "",
        "configmaps",
        Some("elsewhere"),
        &[],
    )]
}

/// `sync` with no --source where OpenShift's ConfigMap is not (SPEC 3): its error names the
/// kubeadm-style source when this cluster has it, says what to try when the agent cannot
/// tell, and adds nothing when that one is not there either.
#[test]
fn sync_on_the_default_source_names_the_kubeadm_one_only_where_it_helps() {
    let api = ApiServer::start();
    let node = Node::new();
    let kubeconfig = api.kubeconfig();
    let sync = || {
        let out = node.sync(&[], &["--kubeconfig", kubeconfig.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        stderr(&out)
    };
    // Neither ConfigMap: the default source's own error, and no hint that would not help.
    let err = sync();
    assert!(
        err.contains(SPEC) && err.contains("does not exist"),
        "{err}"
    );
    assert!(!err.contains("--source"), "{err}");
    // This cluster has the kubeadm-style one: named, as the one to use.
    let pem = pki::bundle_of(1, "kubeadm");
    api.put_configmap(
        "kube-system",
        "extension-apiserver-authentication",
        &[("client-ca-file", &pem)],
        &[],
    );
    let err = sync();
    assert!(
        err.contains(
            "this cluster has the kubeadm-style one: use --source configmap:kube-system/extension-apiserver-authentication/client-ca-file"
        ),
        "{err}"
    );
    // Both forbidden: the agent cannot tell, and says what to try and what to grant.
    api.restrict_to(only_elsewhere());
    let err = sync();
    assert!(err.contains("forbidden"), "{err}");
    assert!(
        err.contains("is OpenShift's default: on a kubeadm cluster use --source configmap:kube-system/extension-apiserver-authentication/client-ca-file")
            && err.contains("let this identity get, list and watch it"),
        "{err}"
    );
    assert!(!node.bundle().exists(), "nothing is written");
}

/// `run` with no --source where OpenShift's ConfigMap is not (SPEC 3): its log names the
/// kubeadm-style source when this cluster has it, says what to try when the agent cannot
/// tell, and adds nothing when that one is not there either.
#[test]
fn run_on_the_default_source_names_the_kubeadm_one_only_where_it_helps() {
    let log_of = |api: &ApiServer| {
        let node = Node::new();
        let kubeconfig = api.kubeconfig();
        let agent = Agent::start(
            &node,
            &[],
            &[
                "--kubeconfig",
                kubeconfig.to_str().unwrap(),
                "--no-node-report",
            ],
        );
        assert!(
            eventually(10 * SECOND, || agent.log().contains(SPEC)
                && (agent.log().contains("not_found")
                    || agent.log().contains("forbidden"))),
            "{}",
            agent.log()
        );
        // The kubeadm-style source is looked for once the default is told missing.
        std::thread::sleep(2 * SECOND);
        agent.log()
    };
    let hint =
        "use --source configmap:kube-system/extension-apiserver-authentication/client-ca-file";
    // Neither ConfigMap: no hint that would not help.
    let api = ApiServer::start();
    let log = log_of(&api);
    assert!(!log.contains(hint), "{log}");
    // This cluster has the kubeadm-style one: named, once, as the one to use.
    api.put_configmap(
        "kube-system",
        "extension-apiserver-authentication",
        &[("client-ca-file", &pki::bundle_of(1, "kubeadm"))],
        &[],
    );
    let log = log_of(&api);
    let said: Vec<&str> = log.lines().filter(|l| l.contains(hint)).collect();
    assert_eq!(said.len(), 1, "{log}");
    assert!(
        said[0].contains("WARN") && said[0].contains("this cluster has the kubeadm-style one"),
        "{log}"
    );
    // A source of the user's own that is missing: nothing looked for, nothing said.
    let asked = |api: &ApiServer| {
        api.requests()
            .iter()
            .filter(|r| r.path.contains("/namespaces/kube-system/"))
            .count()
    };
    let before = asked(&api);
    let node = Node::new();
    let kubeconfig = api.kubeconfig();
    let own = Agent::start(
        &node,
        &["configmap:openshift-config-managed/not-here"],
        &[
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--no-node-report",
        ],
    );
    assert!(
        eventually(10 * SECOND, || own.log().contains("not_found")),
        "{}",
        own.log()
    );
    std::thread::sleep(2 * SECOND);
    assert_eq!(asked(&api), before, "{}", own.log());
    assert!(!own.log().contains(hint), "{}", own.log());
    drop(own);
    // Both forbidden: the agent cannot tell, and says what to try and what to grant.
    api.restrict_to(only_elsewhere());
    let log = log_of(&api);
    assert!(
        log.lines().any(
            |l| l.contains("is OpenShift's default: on a kubeadm cluster")
                && l.contains(hint)
                && l.contains("let this identity get, list and watch it")
        ),
        "{log}"
    );
}

#[test]
fn a_forbidden_list_at_start_reports_the_source_down_then_recovers() {
    let api = ApiServer::start();
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pem)], &[]);
    api.fail_next(1, 403);
    let agent = start(&node, &api, &[SPEC]);
    agent.wait_listening();
    wait_until(10 * SECOND, || node.holds(&pem));
    assert!(agent.log().contains("forbidden"), "{}", agent.log());
}

#[test]
fn a_source_is_up_again_when_its_watch_recovers_without_a_change() {
    let api = ApiServer::start();
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pem)], &[]);
    let agent = start(&node, &api, &[SPEC]);
    wait_until(10 * SECOND, || node.holds(&pem));
    agent.wait_listening();
    // The watch ends and its restart fails once; the object does not change, so the watch
    // that follows brings no event.
    api.fail_next(1, 500);
    api.close_watches();
    wait_until(10 * SECOND, || {
        agent
            .metric("kubelet_ca_watch_restarts_total{")
            .is_some_and(|v| v >= 1.0)
    });
    // The counter is read live and the source's state from the loop's last pass: wait
    // for the pass that took the failure in, then for the source to be up again.
    let down = format!("[-]source:{SPEC} failed");
    let up = format!("[+]source:{SPEC} ok");
    let page = || {
        agent
            .get("/readyz?verbose")
            .map(|(_, b)| b)
            .unwrap_or_default()
    };
    // Up again means a second "source is up" in the log (the first came at start).
    wait_until(10 * SECOND, || {
        page().contains(&down) || agent.log().matches("source is up").count() >= 2
    });
    wait_until(10 * SECOND, || page().contains(&up));
    agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 1.0);
}

/// Runs `cmd` to completion, killing it after `limit`: (output, how long it ran), or None if it
/// had to be killed.
fn run_for_at_most(
    mut cmd: std::process::Command,
    limit: Duration,
) -> (Option<std::process::Output>, Duration) {
    use std::process::Stdio;
    let started = std::time::Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run agent");
    while started.elapsed() < limit {
        if child.try_wait().unwrap().is_some() {
            return (Some(child.wait_with_output().unwrap()), started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    (None, started.elapsed())
}

#[test]
fn sync_gives_up_on_an_api_server_that_takes_the_request_and_never_answers() {
    let api = ApiServer::start();
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    std::fs::create_dir_all(node.bundle_dir()).unwrap();
    std::fs::write(node.bundle(), &pem).unwrap();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pem)], &[]);
    api.hang(HangMode::All);

    let mut cmd = node.command("sync");
    cmd.args(["--source", SPEC, "--kubeconfig"])
        .arg(api.kubeconfig());
    let (out, took) = run_for_at_most(cmd, 90 * SECOND);
    let out =
        out.unwrap_or_else(|| panic!("sync still waiting on a hung API server after {took:?}"));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(took < 40 * SECOND, "sync took {took:?}");
    assert_eq!(err.trim().lines().count(), 1, "one clear line: {err}");
    assert!(err.contains(&api.url()), "the line names the server: {err}");
    assert!(err.contains("did not answer"), "{err}");
    assert_eq!(node.read_bundle(), pem.as_bytes(), "nothing was written");
    assert_eq!(api.requests().iter().filter(|r| r.is_list()).count(), 1);
}

/// The one slow test: a watch that goes silent is only known dead after two minutes.
#[test]
fn a_hung_api_server_is_reported_within_two_minutes_and_the_agent_recovers() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &a.pem())], &[]);
    let agent = start(&node, &api, &[SPEC]);
    wait_until(10 * SECOND, || node.holds(a.pem()));
    agent.wait_listening();
    // Something else in the cluster moves the resourceVersion: bookmarks flow, as on a real
    // cluster.
    api.put_configmap("default", "unrelated", &[("x", "1")], &[]);
    wait_until(10 * SECOND, || api.open_watches() == 1);
    let before = fingerprint_file(&node.bundle());

    api.hang(HangMode::All);
    let hung = std::time::Instant::now();
    // A change the agent cannot hear of while the server is hung.
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    agent.wait_metric(150 * SECOND, "kubelet_ca_source_up{", 0.0);
    eprintln!(
        "the hung API server was reported after {:?}",
        hung.elapsed()
    );
    assert_eq!(
        fingerprint_file(&node.bundle()),
        before,
        "the file changed while the API server was hung"
    );
    let (code, verbose) = agent.get("/readyz?verbose").unwrap();
    assert_eq!(code, 200, "a valid file keeps the agent ready: {verbose}");
    let line = verbose
        .lines()
        .find(|l| l.contains(&format!("source:{SPEC}")))
        .unwrap_or_else(|| panic!("no check for the source: {verbose}"));
    assert!(line.starts_with("[-]"), "{verbose}");
    assert!(line.contains("sent nothing"), "a clear reason: {line}");

    api.unhang();
    wait_until(60 * SECOND, || node.holds(b.pem()));
    agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 1.0);
}

#[test]
fn the_agent_needs_only_get_list_watch_on_its_objects_by_name() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let cc = "machine-config-controller";
    api.restrict_to(vec![
        Rule::new(
            &["get", "list", "watch"],
            "",
            "configmaps",
            Some(NS),
            &[NAME],
        ),
        Rule::new(
            &["get", "list", "watch"],
            "machineconfiguration.openshift.io",
            "controllerconfigs",
            None,
            &[cc],
        ),
    ]);
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &a.pem())], &[]);
    api.put_controllerconfig(cc, &b64(&b.pem()));
    let agent = start(&node, &api, &[SPEC, &format!("controllerconfig:{cc}")]);
    wait_until(10 * SECOND, || node.holds(a.pem() + &b.pem()));
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    wait_until(5 * SECOND, || node.holds(b.pem()));
    agent.wait_listening();
    let (_, verbose) = agent.get("/readyz?verbose").unwrap();
    assert!(!verbose.contains("[-]source"), "{verbose}");
    assert!(!agent.log().contains("forbidden"), "{}", agent.log());

    // The same rules for another name: what the agent asks for is forbidden, and it says so.
    let other = Node::new();
    let agent = start(
        &other,
        &api,
        &["configmap:openshift-config-managed/another-name"],
    );
    agent.wait_listening();
    wait_until(10 * SECOND, || agent.log().contains("forbidden"));
    assert!(
        agent.log().contains(
            "configmaps \"another-name\" is forbidden: User \"system:node:fixture-node\" cannot list resource \"configmaps\""
        ),
        "{}",
        agent.log()
    );
}

/// Reads the readyz line of the source.
fn source_check(agent: &Agent) -> String {
    let (_, verbose) = agent.get("/readyz?verbose").unwrap_or_default();
    verbose
        .lines()
        .find(|l| l.contains(&format!("source:{SPEC}")))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn errors_that_are_not_status_json_cost_nothing_but_delay() {
    let api = ApiServer::start();
    let node = Node::new();
    let pems: Vec<String> = (0..5)
        .map(|i| Signer::new(&format!("gen-{i}"), Algorithm::P256).pem())
        .collect();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pems[0])], &[]);
    let agent = start(&node, &api, &[SPEC]);
    wait_until(10 * SECOND, || node.holds(&pems[0]));
    agent.wait_listening();
    wait_until(10 * SECOND, || api.open_watches() == 1);

    // (fault, what the health page must say while it lasts)
    let faults = [
        (
            Fault::BadGatewayHtml,
            "HTTP 502 with a body that is not a Kubernetes Status",
        ),
        (Fault::EmptyUnavailable, "HTTP 503 with an empty body"),
        (Fault::ErrorEvent(500), "HTTP 500 InternalError"),
    ];
    for (i, (fault, says)) in faults.into_iter().enumerate() {
        // The source is up on the list that follows a lost connection, a moment before its
        // watch is open again: a fault inside the watch needs the watch.
        wait_until(10 * SECOND, || api.open_watches() == 1);
        let before = fingerprint_file(&node.bundle());
        let restarts = agent
            .metric("kubelet_ca_watch_restarts_total{")
            .unwrap_or(0.0);
        match fault {
            // Inside the open watch.
            Fault::ErrorEvent(_) => api.break_watches(fault),
            // On the next two attempts to watch again.
            _ => {
                api.fail_next_on(Target::Watch, 2, fault);
                api.close_watches();
            }
        }
        wait_until(10 * SECOND, || {
            agent
                .metric("kubelet_ca_watch_restarts_total{")
                .is_some_and(|v| v > restarts)
        });
        let check = source_check(&agent);
        assert!(
            check.starts_with("[-]") && check.contains(says),
            "{fault:?}: {check}"
        );
        assert!(!check.contains('\r'), "{check:?}");
        assert_eq!(fingerprint_file(&node.bundle()), before, "{fault:?}");
        let (code, _) = agent.get("/readyz").unwrap();
        assert_eq!(code, 200, "{fault:?}: a valid file keeps the agent ready");

        // It converges once the server answers well again.
        let next = &pems[i + 1];
        api.put_configmap(NS, NAME, &[("ca-bundle.crt", next)], &[]);
        wait_until(20 * SECOND, || node.holds(next));
        agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 1.0);
    }

    // A watch cut in the middle of an event: kube-rs ends the stream quietly on an unexpected
    // EOF, and the agent, which sees it end long before its timeout, takes the connection for
    // lost: one list (the server answering next may stand on another store), then a watch
    // from that list's resourceVersion, and no failure.
    let lists = api.requests().iter().filter(|r| r.is_list()).count();
    let watches = api.requests().iter().filter(|r| r.watch).count();
    let delivered = api.last_rv_delivered().unwrap();
    api.break_watches(Fault::CutMidJson);
    wait_until(10 * SECOND, || {
        api.requests().iter().filter(|r| r.watch).count() > watches
    });
    let requests = api.requests();
    let resumed = requests.iter().filter(|r| r.watch).nth(watches).unwrap();
    let from: u64 = resumed.param("resourceVersion").unwrap().parse().unwrap();
    assert!(from >= delivered, "{from} < {delivered}");
    assert_eq!(requests.iter().filter(|r| r.is_list()).count(), lists + 1);
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pems[4])], &[]);
    wait_until(5 * SECOND, || node.holds(&pems[4]));
    assert_eq!(
        api.requests().iter().filter(|r| r.is_list()).count(),
        lists + 1
    );
    agent.wait_metric(SECOND, "kubelet_ca_source_up{", 1.0);
}

#[test]
fn steady_state_over_a_longer_idle_window_with_a_watch_error_in_the_middle() {
    let api = ApiServer::start();
    let node = Node::new();
    let pem = pki::bundle_of(1, "ca");
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &pem)], &[]);
    let agent = start(&node, &api, &[SPEC]);
    wait_until(10 * SECOND, || node.holds(&pem));
    agent.wait_listening();
    // Unrelated writes move the resourceVersion: bookmarks flow.
    api.put_configmap("default", "unrelated", &[("x", "1")], &[]);

    std::thread::sleep(7 * SECOND);
    let delivered = api.last_rv_delivered().expect("bookmarks were sent");
    api.break_watches(Fault::ErrorEvent(500));
    wait_until(10 * SECOND, || {
        agent
            .metric("kubelet_ca_watch_restarts_total{")
            .is_some_and(|v| v == 1.0)
    });
    agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 1.0);
    std::thread::sleep(8 * SECOND);

    let requests = api.requests();
    let lists: Vec<_> = requests.iter().filter(|r| r.is_list()).collect();
    let watches: Vec<_> = requests.iter().filter(|r| r.watch).collect();
    assert_eq!(
        lists.len(),
        1,
        "one list at start; none while idle, none to recover from a watch error: {requests:#?}"
    );
    assert_eq!(
        watches.len(),
        2,
        "one watch, and one to resume it after the error: {requests:#?}"
    );
    assert_eq!(
        watches[1].param("resourceVersion"),
        Some(delivered.to_string()),
        "the resumed watch starts from the last resourceVersion seen"
    );
    let selector = format!("metadata.name={NAME}");
    for r in lists.iter().chain(&watches) {
        assert_eq!(
            r.param("fieldSelector").as_deref(),
            Some(selector.as_str()),
            "{r:?}"
        );
    }
    for w in &watches {
        assert_eq!(w.param("allowWatchBookmarks").as_deref(), Some("true"));
    }
    assert_eq!(api.open_watches(), 1);
    assert_eq!(agent.metric("kubelet_ca_writes_total{"), Some(1.0));
}
