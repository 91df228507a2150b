//! The fleet's rollout gate (issue 33, SPEC 8c and 11), for `cargo bench --bench rollout`:
//! a real kube-apiserver with the Node authorizer and NodeRestriction
//! (`../shared/tools/kube-apiserver/cluster`), a Node object and a `kubelet-ca-agent run` per
//! node (100; BENCH_ROLLOUT_AGENTS=1000 for the larger figure), each with node credentials of
//! its own (`system:node:NAME`, signed by the cluster CA) that write its report on its own
//! Node, all following the ConfigMap that one `kubelet-ca-agent publish` derives from a
//! stand-in for the ControllerConfig (a ConfigMap of the signers).
//!
//! Figures:
//! - From a change of the signers (a new signer added) to `kubelet-ca-agent rollout wait
//!   --for add=FP` exiting 0 (the wait started and watching before the change): through
//!   the publisher, every agent's write, every agent's report. SPEC 11: at most 2 s for 100
//!   agents and 5 s for 1,000. Several rotations; the slowest is judged.
//! - Node writes per agent per change, and while idle, counted by a watch on the Nodes (a
//!   change of the annotation's value on a Node is one write): one and none.
//! - The bundle's rotation latency with the report on and off, the same run: two more agents
//!   on one ConfigMap of their own, one reporting and one with `--no-node-report`, each
//!   rotation timed from the API server's answer to the write to the agent's `bundle written`
//!   line. SPEC 11: p50 within 1.1x.
//!
//! Under `cargo test --benches` (no `--bench`) it runs 5 agents and two rotations as a smoke
//! test; no target is judged then. Without the cluster script it says it skipped.

#[path = "support/agent.rs"]
mod agent;
#[path = "support/clock.rs"]
mod clock;
#[allow(dead_code)]
#[path = "../tests/common/real_cluster.rs"]
mod real_cluster;
#[path = "support/report.rs"]
mod report;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent::{Agent, sha256_hex};
use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair};
use real_cluster::Cluster;
use report::{Table, ms, percentile};
use serde_json::{Value, json};

const SIGNERS_NS: &str = "openshift-config-managed";
const SIGNERS: &str = "signers";
const PUBLISHED_NS: &str = "openshift-machine-config-operator";
const PUBLISHED: &str = "kubelet-ca-bundle";
const DIRECT: &str = "latency-bundle";
const KEY: &str = "ca-bundle.crt";
const HELD: &str = "kubelet-ca-agent/held";

/// What real_cluster.rs asks of its parent: a benchmark without the cluster script skips.
fn require(present: bool, why: &str) -> bool {
    if !present {
        println!("skipped: {why}");
    }
    present
}

/// The timestamp a log line of the agent starts with.
fn log_time(line: &str) -> Option<time::OffsetDateTime> {
    let stamp = line.split_whitespace().next()?;
    time::OffsetDateTime::parse(stamp, &time::format_description::well_known::Rfc3339).ok()
}

fn agent_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kubelet-ca-agent")
}

/// A self-signed signer, PEM.
fn signer(cn: &str) -> String {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, cn);
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(365);
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    params.self_signed(&key).unwrap().pem()
}

/// Node identities signed by the cluster CA in-process (openssl twice per node would take
/// most of a 1,000-node start): one key for all, a certificate each.
struct Identities {
    dir: PathBuf,
    url: String,
    ca_path: PathBuf,
    issuer: rcgen::Issuer<'static, KeyPair>,
    key: KeyPair,
}

impl Identities {
    fn new(cluster: &Cluster) -> Identities {
        let dir = cluster.path("bench-nodes");
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = std::fs::read_to_string(cluster.path("pki/ca.key")).unwrap();
        let ca_key = KeyPair::from_pem_and_sign_algo(&ca_key, &rcgen::PKCS_RSA_SHA256).unwrap();
        // The issuer's name as the cluster script gives its CA.
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, "test-cluster-ca");
        params.distinguished_name = name;
        let issuer = rcgen::Issuer::new(params, ca_key);
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        std::fs::write(dir.join("node.key"), key.serialize_pem()).unwrap();
        Identities {
            dir,
            url: cluster.url.clone(),
            ca_path: cluster.path("pki/ca.crt"),
            issuer,
            key,
        }
    }

    /// The kubeconfig of `system:node:NAME`.
    fn kubeconfig(&self, node: &str) -> PathBuf {
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::OrganizationName, "system:nodes");
        name.push(DnType::CommonName, format!("system:node:{node}"));
        params.distinguished_name = name;
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(2);
        let cert = params.signed_by(&self.key, &self.issuer).unwrap();
        let crt = self.dir.join(format!("{node}.crt"));
        std::fs::write(&crt, cert.pem()).unwrap();
        let kubeconfig = self.dir.join(format!("{node}.kubeconfig"));
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: u\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n",
                self.url,
                self.ca_path.display(),
                crt.display(),
                self.dir.join("node.key").display()
            ),
        )
        .unwrap();
        kubeconfig
    }
}

/// Every node may read the published ConfigMap and the latency one (a Role by resourceNames,
/// bound to the group system:nodes).
fn grant_nodes_the_bundles(cluster: &Cluster) {
    cluster.namespace(PUBLISHED_NS);
    let base = format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{PUBLISHED_NS}");
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "bundle-reader", "namespace": PUBLISHED_NS},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                   "resourceNames": [PUBLISHED, DIRECT], "verbs": ["get", "list", "watch"]}],
    });
    let (code, body) = cluster.request("POST", &format!("{base}/roles"), Some(&role));
    assert!(code == 201 || code == 409, "{code} {body}");
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "bundle-reader", "namespace": PUBLISHED_NS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "bundle-reader"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
    });
    let (code, body) = cluster.request("POST", &format!("{base}/rolebindings"), Some(&binding));
    assert!(code == 201 || code == 409, "{code} {body}");
}

/// The annotation's writes, as a watch on the Nodes sees them: per node, the instants its
/// value changed.
#[derive(Clone, Default)]
struct Writes(Arc<Mutex<HashMap<String, Vec<Instant>>>>);

impl Writes {
    /// Watches every Node from now on (curl as admin, one JSON event a line).
    fn watch(cluster: &Cluster) -> Writes {
        let writes = Writes::default();
        let pki = |name: &str| cluster.path(&format!("pki/{name}"));
        let curl = Curl {
            url: cluster.url.clone(),
            ca: pki("ca.crt"),
            cert: pki("admin.crt"),
            key: pki("admin.key"),
        };
        let (mut last, mut rv) = curl.list();
        let seen = writes.clone();
        std::thread::spawn(move || {
            // A watch the server ends (its timeout, or a reader too slow for a thousand
            // events at once) is resumed from where it was; one that expired lists again,
            // and what changed meanwhile counts once.
            loop {
                let mut child = curl
                    .command(&format!(
                        "/api/v1/nodes?watch=1&allowWatchBookmarks=true&resourceVersion={rv}&timeoutSeconds=600"
                    ), "PartialObjectMetadata")
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("curl");
                let stdout = child.stdout.take().unwrap();
                let mut expired = false;
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let Ok(event) = serde_json::from_str::<Value>(&line) else {
                        continue;
                    };
                    if event["type"] == "ERROR" {
                        expired = true;
                        break;
                    }
                    let meta = &event["object"]["metadata"];
                    if let Some(at) = meta["resourceVersion"].as_str() {
                        rv = at.to_string();
                    }
                    if event["type"] == "BOOKMARK" {
                        continue;
                    }
                    seen.changed(&mut last, meta);
                }
                let _ = child.kill();
                let _ = child.wait();
                if expired {
                    let (now, at) = curl.list();
                    for (name, value) in now {
                        if last.get(&name) != Some(&value) {
                            let meta = json!({"name": name, "annotations": {HELD: value}});
                            seen.changed(&mut last, &meta);
                        }
                    }
                    rv = at;
                }
            }
        });
        writes
    }

    /// A Node's metadata as a watch event gives it: a write when its annotation changed.
    fn changed(&self, last: &mut HashMap<String, String>, meta: &Value) {
        let name = meta["name"].as_str().unwrap_or("").to_string();
        let value = meta["annotations"][HELD].as_str().unwrap_or("").to_string();
        if last.get(&name) != Some(&value) {
            if !value.is_empty() {
                let mut writes = self.0.lock().unwrap();
                writes.entry(name.clone()).or_default().push(Instant::now());
            }
            last.insert(name, value);
        }
    }

    /// The last write of each of `nodes` after `from`, when it has one.
    fn last_after(&self, nodes: &[String], from: Instant) -> Vec<Option<Instant>> {
        let writes = self.0.lock().unwrap();
        nodes
            .iter()
            .map(|n| {
                writes
                    .get(n)
                    .and_then(|w| w.iter().filter(|t| **t >= from).max().copied())
            })
            .collect()
    }

    /// Writes of each of `nodes` between `from` and `to`.
    fn between(&self, nodes: &[String], from: Instant, to: Instant) -> Vec<usize> {
        let writes = self.0.lock().unwrap();
        nodes
            .iter()
            .map(|n| {
                writes
                    .get(n)
                    .map_or(0, |w| w.iter().filter(|t| **t >= from && **t <= to).count())
            })
            .collect()
    }
}

/// curl as the cluster's admin, asking for the Nodes' metadata only (small events).
struct Curl {
    url: String,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl Curl {
    /// A request for `path`, as metadata (`as`: `PartialObjectMetadataList` for a list,
    /// `PartialObjectMetadata` for a watch).
    fn command(&self, path: &str, r#as: &str) -> Command {
        let mut cmd = Command::new("curl");
        cmd.args(["-sN", "--cacert"])
            .arg(&self.ca)
            .arg("--cert")
            .arg(&self.cert)
            .arg("--key")
            .arg(&self.key)
            .arg("-H")
            .arg(format!(
                "Accept: application/json;as={as};g=meta.k8s.io;v=v1",
                r#as = r#as
            ))
            .arg(format!("{}{path}", self.url));
        cmd
    }

    /// Every Node's annotation value, and the list's resourceVersion.
    fn list(&self) -> (HashMap<String, String>, String) {
        let out = self
            .command("/api/v1/nodes", "PartialObjectMetadataList")
            .output()
            .expect("curl");
        let list: Value = serde_json::from_slice(&out.stdout).expect("a list of Nodes");
        let rv = list["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        let values = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|node| {
                let name = node["metadata"]["name"].as_str().unwrap_or("");
                let value = node["metadata"]["annotations"][HELD].as_str().unwrap_or("");
                (name.to_string(), value.to_string())
            })
            .collect();
        (values, rv)
    }
}

/// `rollout` with the admin's credentials, over the published ConfigMap.
fn rollout(cluster: &Cluster, args: &[&str]) -> Command {
    let mut cmd = Command::new(agent_bin());
    cmd.arg("rollout")
        .args(args)
        .arg("--source")
        .arg(format!("configmap:{PUBLISHED_NS}/{PUBLISHED}"))
        .arg("--kubeconfig")
        .arg(cluster.admin_kubeconfig())
        .env_remove("KUBECONFIG")
        .env_remove("RUST_LOG");
    cmd
}

/// Waits until `rollout status` says every node is current; false after `limit`.
fn all_current(cluster: &Cluster, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let out = rollout(cluster, &["status"]).output().unwrap();
        if out.status.code() == Some(0) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    false
}

/// One rotation: `rollout wait --for add=file:NEW` started and watching, then the signers
/// changed to `signers`; how long until it exited 0 (None: it did not within `limit`).
fn gate(
    cluster: &Cluster,
    signers: &str,
    new: &Path,
    limit: Duration,
) -> (Option<Duration>, Instant) {
    let mut wait = rollout(
        cluster,
        &[
            "wait",
            "--for",
            &format!("add=file:{}", new.display()),
            "--timeout",
            &format!("{}s", limit.as_secs()),
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Watching once it has printed its first count.
    let stdout = wait.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(60));
    assert!(first.is_ok(), "rollout wait printed nothing");
    let changed = Instant::now();
    cluster.put_configmap(SIGNERS_NS, SIGNERS, &[(KEY, signers)]);
    let status = wait.wait().unwrap();
    let took = changed.elapsed();
    if status.code() == Some(0) {
        (Some(took), changed)
    } else {
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(&mut wait.stderr.take().unwrap(), &mut err);
        let out: Vec<String> = rx.try_iter().collect();
        eprintln!("rollout wait exited {status}: {}\n{err}", out.join("\n"));
        (None, changed)
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let agents: usize = std::env::var("BENCH_ROLLOUT_AGENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if full { 100 } else { 5 });
    let rotations = if full { 5 } else { 2 };
    let latency_rounds = if full { 100 } else { 5 };
    if !full {
        println!(
            "(smoke run of the rollout benchmark: a debug build, {agents} agents; `cargo bench --bench rollout` gives the figures)"
        );
    }
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let mut table = Table::new(
        &format!(
            "rollout: {agents} agents, each with node credentials, against a real kube-apiserver (issue 33)"
        ),
        !full,
    );
    let target = if agents > 100 {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(2)
    };

    // The signers, the publisher, and what the nodes may read.
    let mut signers: Vec<String> = vec![signer("signer-0")];
    cluster.put_configmap(SIGNERS_NS, SIGNERS, &[(KEY, &signers.concat())]);
    cluster.namespace(PUBLISHED_NS);
    grant_nodes_the_bundles(&cluster);
    let work = tempfile::tempdir().unwrap();
    let mut publisher = Command::new(agent_bin())
        .args(["publish", "--to", &format!("{PUBLISHED_NS}/{PUBLISHED}")])
        .args(["--source", &format!("configmap:{SIGNERS_NS}/{SIGNERS}")])
        .arg("--kubeconfig")
        .arg(cluster.admin_kubeconfig())
        .args(["--listen", "127.0.0.1:0", "--insecure-metrics"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(work.path().join("publisher.log")).unwrap())
        .spawn()
        .expect("start the publisher");

    // The nodes: a Node object, credentials and an agent each.
    let started = Instant::now();
    let identities = Identities::new(&cluster);
    let names: Vec<String> = (0..agents).map(|i| format!("node-{i:04}")).collect();
    for name in &names {
        cluster.create_node(name, None);
    }
    let source = format!("configmap:{PUBLISHED_NS}/{PUBLISHED}");
    let fleet: Vec<Agent> = names
        .iter()
        .map(|name| {
            let kubeconfig = identities.kubeconfig(name);
            Agent::start_unlisted(
                tempfile::tempdir().unwrap(),
                std::slice::from_ref(&source),
                Some(&kubeconfig),
            )
        })
        .collect();
    let ready = all_current(&cluster, Duration::from_secs(if full { 600 } else { 120 }));
    table.info(
        "fleet started: every node's report current (rollout status exits 0)",
        format!(
            "{:.1} s{}",
            started.elapsed().as_secs_f64(),
            if ready {
                ""
            } else {
                " (NOT all current: see the log)"
            }
        ),
    );
    // Their logs are not read from here on: keep the pipes drained.
    for agent in &fleet {
        while agent.lines.try_recv().is_ok() {}
    }

    let writes = Writes::watch(&cluster);
    // Idle: nothing written.
    std::thread::sleep(Duration::from_secs(2));
    let idle_from = Instant::now();
    let idle = if full {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(3)
    };
    std::thread::sleep(idle);
    let idle_writes: usize = writes
        .between(&names, idle_from, Instant::now())
        .iter()
        .sum();
    table.check(
        &format!("node writes while idle {} s (all agents)", idle.as_secs()),
        "0",
        format!("{idle_writes}"),
        idle_writes == 0,
    );

    // The rotations: a new signer each time, gated by rollout wait.
    let mut took = Vec::new();
    let first_change = Instant::now();
    for r in 1..=rotations {
        let new = signer(&format!("signer-{r}"));
        let path = work.path().join(format!("signer-{r}.pem"));
        std::fs::write(&path, &new).unwrap();
        signers.push(new);
        let (gated, _) = gate(&cluster, &signers.concat(), &path, Duration::from_secs(60));
        match gated {
            Some(t) => took.push(t),
            None => eprintln!("rotation {r}: rollout wait did not exit 0"),
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    // Writes per agent over all the rotations, once the watch has seen every event (a
    // loaded machine reads them late): one each per rotation.
    std::thread::sleep(Duration::from_secs(if full { 10 } else { 3 }));
    let per_agent: Vec<usize> = writes.between(&names, first_change, Instant::now());
    let all_gated = took.len() == rotations;
    let measured = if took.is_empty() {
        "none exited 0".to_string()
    } else {
        let slowest = *took.iter().max().unwrap();
        let median = percentile(&mut took.clone(), 0.5);
        format!(
            "slowest {}, median {} of {} rotations{}",
            ms(slowest),
            ms(median),
            took.len(),
            if all_gated {
                ""
            } else {
                " (some never exited 0)"
            }
        )
    };
    let pass = all_gated && took.iter().all(|t| *t <= target);
    table.check(
        "signers' ConfigMap changed -> publish -> every agent's write and report -> rollout wait --for add=FP exits 0",
        &format!("<= {} s", target.as_secs()),
        measured,
        pass,
    );
    let max = per_agent.iter().copied().max().unwrap_or(0);
    let min = per_agent.iter().copied().min().unwrap_or(0);
    table.check(
        &format!("node writes per agent over the {rotations} changes (min, max over the agents)"),
        &format!("{rotations} (one per change)"),
        format!("min {min}, max {max} ({} agents)", per_agent.len()),
        min == rotations && max == rotations,
    );
    // The reports removed from every Node at once (issue 38): each agent follows its own
    // Node and puts its report back. How long until every report is back, and what it
    // took, by the API server's own request counts (the removals are the admin's PATCHes).
    let before = cluster.requests_on("nodes");
    let removed_at = Instant::now();
    std::thread::scope(|scope| {
        for chunk in names.chunks(names.len().div_ceil(16).max(1)) {
            let cluster = &cluster;
            scope.spawn(move || {
                for name in chunk {
                    cluster.set_held(name, None);
                }
            });
        }
    });
    let removed_in = removed_at.elapsed();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut back = writes.last_after(&names, removed_at);
    while back.iter().any(Option::is_none) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        back = writes.last_after(&names, removed_at);
    }
    std::thread::sleep(Duration::from_secs(2));
    let after = cluster.requests_on("nodes");
    let delta = |verb: &str| after.get(verb).unwrap_or(&0.0) - before.get(verb).unwrap_or(&0.0);
    let returned = back.iter().filter(|b| b.is_some()).count();
    let slowest = back
        .iter()
        .flatten()
        .max()
        .map(|t| t.duration_since(removed_at));
    table.check(
        "every Node's report removed at once -> every report back (each agent's watch of its own Node)",
        "all back within 5 s",
        match slowest {
            Some(t) => format!(
                "{returned} of {agents} back, the last {} after the first removal (removals took {})",
                ms(t),
                ms(removed_in)
            ),
            None => format!("{returned} of {agents} back"),
        },
        returned == agents && slowest.is_some_and(|t| t <= Duration::from_secs(5) + removed_in),
    );
    table.info(
        "requests on nodes for it (the API server's counts, less the admin's removals; watches counted as they end)",
        format!(
            "PATCH {} (the agents'), GET {}, LIST {}, WATCH {}",
            delta("PATCH") - agents as f64,
            delta("GET"),
            delta("LIST"),
            delta("WATCH")
        ),
    );

    // The fleet is done with: the latency below is the agent's own, on a quiet machine.
    drop(fleet);
    let _ = publisher.kill();
    let _ = publisher.wait();
    std::thread::sleep(Duration::from_secs(3));

    // The bundle's own rotation latency, with the report on and off, the same run.
    let identities_latency = identities.kubeconfig("latency-on");
    cluster.create_node("latency-on", None);
    let off_kubeconfig = identities.kubeconfig("latency-off");
    let direct = format!("configmap:{PUBLISHED_NS}/{DIRECT}");
    let bundles = [signer("latency-a"), signer("latency-b")];
    cluster.put_configmap(PUBLISHED_NS, DIRECT, &[(KEY, &bundles[0])]);
    let on = Agent::start_unlisted(
        tempfile::tempdir().unwrap(),
        std::slice::from_ref(&direct),
        Some(&identities_latency),
    );
    let off = Agent::start_serving(
        tempfile::tempdir().unwrap(),
        std::slice::from_ref(&direct),
        Some(&off_kubeconfig),
        None,
        &["--insecure-metrics".into(), "--no-node-report".into()],
    );
    on.wait_holds(&bundles[0], Duration::from_secs(60));
    off.wait_holds(&bundles[0], Duration::from_secs(60));
    std::thread::sleep(Duration::from_secs(2));
    // Per agent: the loop's own time from the change arriving ("source content changed") to
    // the file durable ("bundle written"), by the agent's log timestamps; and, for context,
    // from just before the write request to the line read here.
    let mut inside: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut outside: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for i in 0..latency_rounds {
        let bundle = &bundles[(i + 1) % 2];
        let hash = sha256_hex(bundle.as_bytes());
        for agent in [&on, &off] {
            while agent.lines.try_recv().is_ok() {}
        }
        let asked = Instant::now();
        cluster.put_configmap(PUBLISHED_NS, DIRECT, &[(KEY, bundle)]);
        for (k, agent) in [&on, &off].into_iter().enumerate() {
            let deadline = asked + Duration::from_secs(10);
            let mut arrived = None;
            while Instant::now() < deadline {
                match agent.lines.recv_timeout(Duration::from_millis(100)) {
                    Ok((_, line)) if line.contains("source content changed") => {
                        arrived = log_time(&line);
                    }
                    Ok((at, line)) if line.contains("bundle written") && line.contains(&hash) => {
                        outside[k].push(at.saturating_duration_since(asked));
                        if let (Some(from), Some(to)) = (arrived, log_time(&line)) {
                            inside[k].push((to - from).try_into().unwrap_or_default());
                        }
                        break;
                    }
                    _ => {}
                }
            }
        }
        // Let the report of this change go out before the next one.
        std::thread::sleep(Duration::from_millis(300));
    }
    let [mut in_on, mut in_off] = inside;
    let [mut out_on, mut out_off] = outside;
    if !in_on.is_empty() && !in_off.is_empty() {
        let (p50_on, p50_off) = (percentile(&mut in_on, 0.5), percentile(&mut in_off, 0.5));
        let ratio = p50_on.as_secs_f64() / p50_off.as_secs_f64().max(1e-9);
        table.check(
            "the bundle's rotation latency (change arrived -> bundle durable, the agent's own timestamps), p50 with the report on / off, same run",
            "<= 1.1x",
            format!(
                "{ratio:.2}x (on {}, off {}; {} and {} rotations)",
                ms(p50_on),
                ms(p50_off),
                in_on.len(),
                in_off.len()
            ),
            ratio <= 1.1,
        );
    }
    if !out_on.is_empty() && !out_off.is_empty() {
        table.info(
            "the same from just before the write request (curl) to the line read here, p50 on / off",
            format!(
                "on {}, off {}",
                ms(percentile(&mut out_on, 0.5)),
                ms(percentile(&mut out_off, 0.5))
            ),
        );
    }
    table.print();
}
