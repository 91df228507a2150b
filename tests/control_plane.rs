//! Control-plane events through the real binary (issue 24, SPEC 6): an outage longer than
//! any backoff cap, a restart that forgets the watch cache (410 Gone after the reconnect),
//! a server that sheds load with 429 and `Retry-After`, and a source reported up only once
//! its watch has delivered.

mod common;

use std::time::{Duration, Instant};

use common::Node;
use common::apiserver::{ApiServer, Fault, Request, Target};
use common::daemon::{Agent, wait_until};
use common::pki::{Algorithm, Signer};

const SECOND: Duration = Duration::from_secs(1);
const NS: &str = "openshift-config-managed";
const NAME: &str = "kube-apiserver-client-ca";
const SPEC: &str = "configmap:openshift-config-managed/kube-apiserver-client-ca";

/// An agent following the ConfigMap, once it holds `first` and is listening.
fn started(api: &ApiServer, node: &Node, first: &Signer) -> Agent {
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &first.pem())], &[]);
    let agent = Agent::start(
        node,
        &[SPEC],
        &["--kubeconfig", api.kubeconfig().to_str().unwrap()],
    );
    wait_until(10 * SECOND, || node.holds(first.pem()));
    agent.wait_listening();
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 1.0);
    agent
}

/// Moves the API server's resourceVersion on, as the rest of a cluster does all the time
/// (leases, events): a watch cache rebuilt after a restart then starts past anything the
/// agent has seen, and its resumed watch gets 410 Gone.
fn cluster_moves_on(api: &ApiServer) {
    api.put_configmap(
        NS,
        "unrelated",
        &[("n", &format!("{:?}", Instant::now()))],
        &[],
    );
}

/// An outage: the API server stops, the agent sees it, and it stays away for `length`
/// while the cluster moves on.
fn outage(api: &ApiServer, agent: &Agent, length: Duration) {
    api.stop();
    agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 0.0);
    std::thread::sleep(length);
    cluster_moves_on(api);
}

/// The requests the agent made at or after `since`, for the ConfigMap (lists and watches).
fn requests_since(api: &ApiServer, since: Instant) -> Vec<Request> {
    api.requests()
        .into_iter()
        .filter(|r| r.at >= since && r.path.contains("/configmaps"))
        .collect()
}

#[test]
fn after_an_outage_longer_than_any_backoff_cap_a_change_is_followed_within_ten_seconds() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let agent = started(&api, &node, &a);

    // Longer than the 30 s cap of a server that answers with failures: a backoff grown
    // on a server that is not there would still be waiting when it is back.
    outage(&api, &agent, 40 * SECOND);
    api.restart();
    let back = Instant::now();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &(a.pem() + &b.pem()))], &[]);
    let took = wait_until(10 * SECOND, || node.holds(a.pem() + &b.pem()));
    eprintln!("the change reached the file {took:?} after the API server was back");
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 1.0);
    let lists = requests_since(&api, back)
        .iter()
        .filter(|r| r.is_list())
        .count();
    assert_eq!(lists, 1, "one list after the outage");
}

#[test]
fn a_410_after_a_reconnect_lists_again_at_once_without_a_backoff() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let agent = started(&api, &node, &a);

    // The server answers 503 long enough for several failed attempts, so that a backoff
    // would have grown (an answer, not a lost connection: the watch is resumed, not
    // listed). Then it is back with a watch cache that begins past the agent's
    // resourceVersion, as after a restart: the resumed watch gets 410.
    let unavailable = Fault::Status(503);
    api.shed(Some(unavailable));
    api.break_watches(unavailable);
    agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 0.0);
    std::thread::sleep(6 * SECOND);
    cluster_moves_on(&api);
    api.compact();
    let back = Instant::now();
    api.shed(None);
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    wait_until(10 * SECOND, || node.holds(b.pem()));

    let after = requests_since(&api, back);
    let expired = after
        .iter()
        .position(|r| r.watch)
        .expect("a watch resumed after the restart");
    let relist = after[expired..]
        .iter()
        .find(|r| r.is_list())
        .expect("a list after the 410");
    let gap = relist.at - after[expired].at;
    assert!(
        gap < SECOND,
        "the list came {gap:?} after the watch that got 410 Gone: {:#?}",
        &after[..=expired]
    );
    // Nothing failed: the 410 is not counted as a source error.
    let log = agent.log();
    assert_eq!(
        log.matches("410 Gone").count(),
        1,
        "one 410, told once, as such: {log}"
    );
    let expired = agent.sample(
        "kubelet_ca_source_errors_total",
        &[("source", SPEC), ("reason", "expired")],
    );
    assert_eq!(expired.unwrap_or(0.0), 0.0, "a 410 is not a failure");
}

#[test]
fn a_rolling_restart_is_followed_within_seconds_with_one_list() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let agent = started(&api, &node, &a);

    cluster_moves_on(&api);
    let back = Instant::now();
    // Every connection cut at once, and an instance whose watch cache began later answers
    // at once.
    api.restart();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    let took = wait_until(5 * SECOND, || node.holds(b.pem()));
    eprintln!("followed {took:?} after the rolling restart");
    let lists = requests_since(&api, back)
        .iter()
        .filter(|r| r.is_list())
        .count();
    assert_eq!(lists, 1, "one list after the restart");
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 1.0);
}

#[test]
fn a_source_is_not_reported_up_on_a_watch_that_is_accepted_then_expired() {
    let api = ApiServer::start();
    let node = Node::new();
    let a = Signer::new("signer-a", Algorithm::P256);
    let agent = started(&api, &node, &a);
    let ups = || agent.log().matches("source is up").count();
    assert_eq!(ups(), 1);

    outage(&api, &agent, Duration::ZERO);
    // Back, but every list fails: a resumed watch is accepted (HTTP 200) and expired at
    // once (410), and nothing is ever delivered.
    api.fail_next_on(Target::List, 1_000, Fault::Status(500));
    api.restart();
    wait_until(10 * SECOND, || {
        let after = api.requests();
        after.iter().any(|r| r.watch) && after.iter().filter(|r| r.is_list()).count() >= 3
    });
    assert_eq!(ups(), 1, "reported up on a watch that delivered nothing");
    assert_eq!(agent.metric("kubelet_ca_source_up{"), Some(0.0));
    let (_, verbose) = agent.get("/readyz?verbose").unwrap();
    assert!(verbose.contains(&format!("[-]source:{SPEC}")), "{verbose}");

    // Lists answer again: up once the list has delivered.
    api.fail_next_on(Target::List, 0, Fault::Status(500));
    agent.wait_metric(40 * SECOND, "kubelet_ca_source_up{", 1.0);
    assert_eq!(ups(), 2);
}

#[test]
fn a_quiet_object_is_up_again_once_its_resumed_watch_stays_open() {
    let api = ApiServer::start();
    let node = Node::new();
    let a = Signer::new("signer-a", Algorithm::P256);
    let agent = started(&api, &node, &a);

    // The same server fails the open watch (a 503 in it, as the watch cache does when it
    // gives up on a watcher) and its next watch request: the watch resumed after the backoff
    // is accepted and stays open, with nothing to deliver on an object that does not change.
    // (A watch cut before its timeout is listed again instead: the server that answers next
    // may stand on another store.)
    api.fail_next_on(Target::Watch, 1, Fault::Status(503));
    api.break_watches(Fault::ErrorEvent(503));
    agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 0.0);
    agent.wait_metric(10 * SECOND, "kubelet_ca_source_up{", 1.0);
    let lists = api.requests().iter().filter(|r| r.is_list()).count();
    assert_eq!(lists, 1, "resumed from where it was, with no list");
}

#[test]
fn a_429_with_retry_after_is_honoured_and_the_failures_after_it_are_no_faster() {
    let api = ApiServer::start();
    let node = Node::new();
    let (a, b) = (
        Signer::new("signer-a", Algorithm::P256),
        Signer::new("signer-b", Algorithm::P256),
    );
    let agent = started(&api, &node, &a);
    let wait = 8;
    let asked = Duration::from_secs(wait);
    let shedding = Fault::TooManyRequests {
        retry_after: wait as u32,
    };

    // The server sheds load: the open watch ends with a 429 ERROR event, and every request
    // gets HTTP 429 with `Retry-After` (a plain-text body, as the APF filter sends it).
    api.shed(Some(shedding));
    let since = Instant::now();
    api.break_watches(shedding);
    let times = |n: usize| {
        wait_until(4 * asked, || requests_since(&api, since).len() >= n);
        requests_since(&api, since)
            .iter()
            .map(|r| r.at)
            .collect::<Vec<_>>()
    };
    let first = times(1)[0];
    assert!(
        first - since >= asked,
        "asked again {:?} after the 429 event",
        first - since
    );
    let second = times(2)[1];
    assert!(
        second - first >= asked,
        "asked again {:?} after the 429",
        second - first
    );
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 0.0);
    // Then 503s with no Retry-After: no faster than the server asked before.
    api.shed(Some(Fault::Status(503)));
    let third = times(3)[2];
    let fourth = times(4)[3];
    assert!(
        fourth - third >= asked,
        "dropped back to a fast retry: {:?} after a 503",
        fourth - third
    );

    // Served again: it follows.
    api.shed(None);
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &b.pem())], &[]);
    wait_until(4 * asked, || node.holds(b.pem()));
    agent.wait_metric(5 * SECOND, "kubelet_ca_source_up{", 1.0);
}
