//! A store restored from a backup (issue 32, SPEC 6), against the real API server and etcd
//! of `../shared/tools/kube-apiserver/cluster`: etcd's data directory is copied while the
//! control plane is stopped, life goes on (other writes, a rotation the node follows), then
//! the copy is put back and the control plane started on it. Its resourceVersions are now
//! behind everything the agents saw: a watch resumed from theirs would be accepted and hear
//! nothing until the store caught up. The node agent and the publisher must list again, follow
//! what the restored store holds and every rotation after it, and never say their source is
//! up on a watch that has not seen the store it talks to.

mod common;

use std::time::{Duration, Instant};

use common::Node;
use common::daemon::{Agent, eventually, wait_until};
use common::pki::{Algorithm, Signer};
use common::real_cluster::Cluster;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const SECOND: Duration = Duration::from_secs(1);
const NS: &str = "openshift-config-managed";
const NAME: &str = "kube-apiserver-client-ca";
const SPEC: &str = "configmap:openshift-config-managed/kube-apiserver-client-ca";
const KEY: &str = "ca-bundle.crt";
const HELD: &str = "kubelet-ca-agent/held";

/// Moves the store's revision well past the backup's, as a cluster's leases and events do.
fn life_goes_on(cluster: &Cluster) {
    for i in 0..40 {
        cluster.put_configmap("default", "unrelated", &[("n", &i.to_string())]);
    }
}

/// Node `name`'s resourceVersion, as a number.
fn node_rv(cluster: &Cluster, name: &str) -> u64 {
    let node = cluster.node(name).expect("the Node");
    node["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|rv| rv.parse().ok())
        .expect("a resourceVersion")
}

/// The source's `kubelet_ca_source_up` as `agent` says it now.
fn source_up(agent: &Agent) -> Option<f64> {
    agent.sample("kubelet_ca_source_up", &[("source", SPEC)])
}

/// Stops the control plane, waits until `agent` has seen the outage (its source down), and
/// puts `backup` back as etcd's data; returns once the API server answers again.
fn restore(cluster: &Cluster, agent: &Agent, backup: &std::path::Path) -> Instant {
    cluster.stop();
    assert!(
        eventually(15 * SECOND, || source_up(agent) == Some(0.0)),
        "the source stayed up while the API server was stopped\n{}",
        agent.log()
    );
    cluster.restore(backup);
    cluster.start();
    Instant::now()
}

#[test]
fn a_node_follows_a_store_restored_from_a_backup_and_the_rotations_after_it() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let [backed_up, after_backup, after_restore] = [
        "signer-backed-up",
        "signer-after-backup",
        "signer-after-restore",
    ]
    .map(|cn| Signer::new(cn, Algorithm::P256).pem());
    cluster.put_configmap(NS, NAME, &[(KEY, &backed_up)]);
    let node = Node::new();
    let kubeconfig = cluster.admin_kubeconfig();
    let agent = Agent::start(
        &node,
        &[SPEC],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    wait_until(20 * SECOND, || node.holds(&backed_up));
    agent.wait_listening();

    // The backup, taken while the control plane is stopped; then life goes on, and a
    // rotation that the node follows.
    cluster.stop();
    let backup = cluster.backup("etcd-backup");
    cluster.start();
    life_goes_on(&cluster);
    cluster.put_configmap(NS, NAME, &[(KEY, &after_backup)]);
    wait_until(15 * SECOND, || node.holds(&after_backup));

    let answered = restore(&cluster, &agent, &backup);

    // Up only on what the restored store says: by the time the source is up again, the
    // node holds (or is a moment from holding) what that store holds.
    assert!(
        eventually(10 * SECOND, || source_up(&agent) == Some(1.0)),
        "the source is not up 10 s after the API server answered\n{}",
        agent.log()
    );
    assert!(
        eventually(SECOND, || node.holds(&backed_up)),
        "the source is up, and the node still holds the bundle from after the backup\n{}",
        agent.log()
    );
    let followed = answered.elapsed();
    assert!(
        followed < 10 * SECOND,
        "followed the restored store after {followed:?}"
    );
    let log = agent.log();
    assert!(
        log.contains("store went back"),
        "a resourceVersion that went back is logged as such\n{log}"
    );

    // A rotation made after the restore reaches the node at once.
    let made = Instant::now();
    cluster.put_configmap(NS, NAME, &[(KEY, &after_restore)]);
    assert!(
        eventually(10 * SECOND, || node.holds(&after_restore)),
        "a rotation made after the restore did not reach the node within 10 s\n{}",
        agent.log()
    );
    eprintln!(
        "restored store followed {followed:?} after the API server answered; the next rotation in {:?}",
        made.elapsed()
    );
}

#[test]
fn the_publisher_follows_a_store_restored_from_a_backup() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let [backed_up, after_backup, after_restore] = [
        "signer-backed-up",
        "signer-after-backup",
        "signer-after-restore",
    ]
    .map(|cn| Signer::new(cn, Algorithm::P256).pem());
    const TO_NS: &str = "openshift-machine-config-operator";
    const TO: &str = "kubelet-ca-bundle";
    let published = || {
        cluster
            .configmap(TO_NS, TO)
            .and_then(|cm| cm["data"][KEY].as_str().map(str::to_string))
    };
    cluster.namespace(TO_NS);
    cluster.put_configmap(NS, NAME, &[(KEY, &backed_up)]);
    let work = tempfile::tempdir().unwrap();
    let publisher = Agent::publish(
        work.path(),
        &cluster.admin_kubeconfig(),
        &format!("{TO_NS}/{TO}"),
        &[SPEC],
        &[],
    );
    wait_until(20 * SECOND, || published().as_deref() == Some(&backed_up));
    publisher.wait_listening();

    cluster.stop();
    let backup = cluster.backup("etcd-backup");
    cluster.start();
    life_goes_on(&cluster);
    cluster.put_configmap(NS, NAME, &[(KEY, &after_backup)]);
    wait_until(15 * SECOND, || {
        published().as_deref() == Some(&after_backup)
    });

    // The restored store holds both the source and the published ConfigMap as they were.
    restore(&cluster, &publisher, &backup);
    assert!(
        eventually(10 * SECOND, || source_up(&publisher) == Some(1.0)),
        "the publisher's source is not up 10 s after the API server answered\n{}",
        publisher.log()
    );
    assert_eq!(published().as_deref(), Some(backed_up.as_str()));
    let made = Instant::now();
    cluster.put_configmap(NS, NAME, &[(KEY, &after_restore)]);
    assert!(
        eventually(10 * SECOND, || published().as_deref()
            == Some(&after_restore)),
        "a rotation made after the restore was not published within 10 s\n{}",
        publisher.log()
    );
    eprintln!(
        "the publisher published a rotation made after the restore in {:?}",
        made.elapsed()
    );
    let log = publisher.log();
    assert!(
        log.contains("store went back"),
        "a resourceVersion that went back is logged as such\n{log}"
    );
}

/// The nodes' reports through a restore from a backup taken before the agents reported
/// (issue 38): the restored store has the Nodes and no report; every agent puts its report
/// back within 10 s of the API server answering, counted as a restore, even where the
/// store's revision caught up with the agent's before it listed again.
#[test]
fn every_nodes_report_is_back_after_a_store_restored_from_before_it() {
    let Some(cluster) = Cluster::up() else {
        return;
    };
    let signer = Signer::new("signer-a", Algorithm::P256).pem();
    cluster.put_configmap(NS, NAME, &[(KEY, &signer)]);
    let names = ["worker-r1", "worker-r2", "worker-r3"];
    for name in names {
        cluster.grant_configmaps(
            NS,
            &[NAME],
            &["get", "list", "watch"],
            &format!("system:node:{name}"),
        );
        cluster.create_node(name, None);
    }
    // The backup: the Nodes, and no report on any of them.
    cluster.stop();
    let backup = cluster.backup("etcd-before-reports");
    cluster.start();
    let nodes: Vec<Node> = names.iter().map(|_| Node::new()).collect();
    let agents: Vec<Agent> = names
        .iter()
        .zip(&nodes)
        .map(|(name, node)| {
            let kubeconfig = cluster.node_kubeconfig(name);
            let agent = Agent::start(
                node,
                &[SPEC],
                &["--kubeconfig", kubeconfig.to_str().unwrap()],
            );
            agent.wait_listening();
            agent
        })
        .collect();
    let reported = || {
        names
            .iter()
            .all(|name| cluster.node_annotation(name, HELD).is_some())
    };
    assert!(eventually(20 * SECOND, reported), "{}", agents[0].log());
    let before: Vec<Option<String>> = names
        .iter()
        .map(|name| cluster.node_annotation(name, HELD))
        .collect();
    life_goes_on(&cluster);
    // The kubelets of worker-r2 and worker-r3 update their Nodes' status: each agent's watch
    // of its own Node moves on with them, far past the backup.
    for i in 0..20 {
        for name in &names[1..] {
            cluster.set_ready(name, if i % 2 == 0 { "False" } else { "True" });
        }
    }
    // The newest Node's revision: a store past it no longer looks restored to a list.
    let written = names
        .iter()
        .map(|name| node_rv(&cluster, name))
        .max()
        .unwrap();

    let back = |i: usize| cluster.node_annotation(names[i], HELD) == before[i];
    let went_back = |i: usize| {
        agents[i]
            .log()
            .contains("where the watch of its own Node had reached")
    };

    // worker-r1 is frozen through the restore and until the store's revision is past every
    // Node's, as a store restored with `etcdutl snapshot restore --bump-revision` is at
    // once: its list does not go back, and only its Node, older than its write in a store
    // past it, says that the write was lost (one CI run met this by chance). The other two
    // list at once, on a store far behind what their watches had reached.
    let frozen = Pid::from_raw(agents[0].child.id() as i32);
    kill(frozen, Signal::SIGSTOP).unwrap();
    let answered = restore(&cluster, &agents[1], &backup);
    assert!(
        eventually(10 * SECOND, || back(1) && back(2)),
        "worker-r2's and worker-r3's reports were not back 10 s after the API server answered: {:?}\n{}",
        [back(1), back(2)],
        agents[1].log()
    );
    let two = answered.elapsed();
    assert!(went_back(1) && went_back(2), "{}", agents[1].log());
    let mut past = 0;
    while past <= written {
        past = cluster.put_configmap("default", "unrelated", &[("past", &past.to_string())]);
    }
    kill(frozen, Signal::SIGCONT).unwrap();
    let thawed = Instant::now();
    assert!(
        eventually(10 * SECOND, || back(0)),
        "worker-r1's report was not back 10 s after it was let go\n{}",
        agents[0].log()
    );
    let one = thawed.elapsed();
    assert!(!went_back(0), "{}", agents[0].log());
    eprintln!(
        "two reports back {two:?} after the API server answered (the store went back); the third {one:?} after its agent was let go (the store past its write)"
    );
    for agent in &agents {
        assert_eq!(
            agent.sample(
                "kubelet_ca_node_report_writes_total",
                &[("cause", "restored")]
            ),
            Some(1.0),
            "{}",
            agent.log()
        );
    }
}
