//! A fleet of agents through control-plane events (SPEC 6 and 11, issue 24), for
//! `cargo bench --bench fleet`. It runs the real binary N times (200; BENCH_FLEET_AGENTS), each
//! `kubelet-ca-agent run --source configmap:NS/NAME` with its own bundle, state directory and
//! kubeconfig, whose bearer token names a node user of its own so that the test API server's
//! request log tells the agents apart, all against one test API server. The fleet goes through
//! three events, each followed by a change of the ConfigMap made as soon as the server answers
//! again:
//!
//! 1. an outage: the server stopped (every connection dropped, then refused) for 45 s
//!    (BENCH_FLEET_OUTAGE_SECONDS), longer than any backoff cap, then restarted, its watch
//!    cache beginning past every resourceVersion an agent saw, as a real one's does;
//! 2. a rolling restart, as behind a load balancer: every connection cut at once, the server
//!    answering again at once, every resumed watch answered 410;
//! 3. a spell of load shedding: for 10 s every request answered 429 `Retry-After: 5` (the
//!    open watches ended by an ERROR event holding the same 429), then served again;
//! 4. a restore from a backup (issue 32): a backup of the store is taken, life goes on (other
//!    writes, then a rotation every node follows), the server is stopped for the outage's
//!    length and comes back on the backup, its resourceVersions behind every agent's, with no
//!    410 to tell them. Every node must follow what the restored store holds, then the change.
//!
//! For each event: from the change to each node's `bundle written` log line for the new
//! bundle (read from its stderr as it comes, as the daemon benchmark does), the slowest and
//! the median node; the lists and watches per agent and the server's peak requests in any one
//! second, from the server's request log between the start of the event and the last node
//! following; each agent's CPU time during the event (its process CPU clock: every thread,
//! to the nanosecond; /proc/PID/stat counts 10 ms ticks), median and max. During the spell
//! of 429 each agent's requests are checked against the Retry-After it was told, and counted
//! for a storm. Between events the fleet settles until every agent watches again.
//!
//! Targets (SPEC 11): the slowest node within 10 s of the server answering again (after the
//! restore too, and to the restored store's bundle), at most one list per agent, under 0.5 s of CPU per agent over the outage; during the spell no agent
//! asks before its Retry-After, and none asks more often than it allows. SPEC 6 lets a server
//! that sheds load cost up to its 30 s backoff cap, so the spell's follow time is shown, not
//! judged.
//!
//! Under `cargo test --benches` (no `--bench`) it runs 4 agents through a 3 s outage, a
//! rolling restart and a 3 s spell of `Retry-After: 1`, as a smoke test; no target is judged
//! then.

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

use std::collections::HashMap;
use std::time::{Duration, Instant};

use agent::{Agent, sha256_hex};
use apiserver::{ApiServer, Fault};
use report::{Table, ms, percentile};
use signers::KeyPool;

const NS: &str = "openshift-config-managed";
const NAME: &str = "kube-apiserver-client-ca";
/// SPEC 11: every node holds a rotation made as the API server answers again within this.
const FOLLOW_TARGET: Duration = Duration::from_secs(10);
/// SPEC 11: CPU per agent over an outage.
const CPU_TARGET: Duration = Duration::from_millis(500);
/// Left alone after every agent watches again, before an event starts.
const SETTLE: Duration = Duration::from_secs(2);

/// The sizes of a run.
struct Run {
    full: bool,
    agents: usize,
    outage: Duration,
    spell: Duration,
    retry_after: u32,
    /// How long nodes are given to follow a change before they are counted as not following.
    follow_limit: Duration,
    /// How long the fleet is given to start, or to be watching again between events.
    ready_limit: Duration,
}

impl Run {
    fn new() -> Run {
        let full = std::env::args().any(|a| a == "--bench");
        let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let agents = env("BENCH_FLEET_AGENTS").map_or(if full { 200 } else { 4 }, |n| n as usize);
        let outage = Duration::from_secs(env("BENCH_FLEET_OUTAGE_SECONDS").unwrap_or(if full {
            45
        } else {
            3
        }));
        if full {
            Run {
                full,
                agents,
                outage,
                spell: Duration::from_secs(10),
                retry_after: 5,
                follow_limit: Duration::from_secs(180),
                ready_limit: Duration::from_secs(180),
            }
        } else {
            Run {
                full,
                agents,
                outage,
                spell: Duration::from_secs(3),
                retry_after: 1,
                follow_limit: Duration::from_secs(20),
                ready_limit: Duration::from_secs(20),
            }
        }
    }
}

/// What the fleet goes through.
#[derive(Clone, Copy)]
enum Trouble {
    /// The server stopped for this long, then restarted.
    Outage(Duration),
    /// Every connection cut, the server answering at once.
    RollingRestart,
    /// Every request answered 429 with this Retry-After for `spell`, open watches ended by the
    /// same 429 in an ERROR event.
    Shedding { spell: Duration, retry_after: u32 },
    /// A backup taken, a rotation followed, then the server stopped for this long and started
    /// on the backup: the store's resourceVersions go back, and nothing answers 410.
    Restore(Duration),
}

impl Trouble {
    fn label(self) -> String {
        match self {
            Trouble::Outage(d) => format!("outage {} s", d.as_secs()),
            Trouble::RollingRestart => "rolling restart".into(),
            Trouble::Shedding { spell, retry_after } => {
                format!("429 spell {} s, Retry-After {retry_after}", spell.as_secs())
            }
            Trouble::Restore(d) => format!("restore after {} s", d.as_secs()),
        }
    }
}

/// One agent, and who the server knows it as.
struct Node {
    agent: Agent,
    user: String,
}

fn main() {
    let run = Run::new();
    if !run.full {
        println!(
            "(smoke run of the fleet benchmark: a debug build, {} agents, short events; `cargo bench --bench fleet` gives the figures)",
            run.agents
        );
    }
    let pool = KeyPool::new(if run.full { 8 } else { 2 });
    let bundles: Vec<String> = (0..6)
        .map(|i| pool.bundle(10, &format!("fleet-{i}")))
        .collect();
    let api = ApiServer::start();
    // kube-apiserver's watch cache sends a bookmark about once a minute.
    api.set_bookmark_interval(Duration::from_secs(60));
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", &bundles[0])], &[]);
    let mut table = Table::new(
        &format!(
            "fleet: {} agents through control-plane events (issue 24)",
            run.agents
        ),
        !run.full,
    );

    let started = Instant::now();
    let source = format!("configmap:{NS}/{NAME}");
    let nodes: Vec<Node> = (0..run.agents)
        .map(|i| {
            let user = format!("system:node:fleet-{i:03}");
            let kubeconfig = api.kubeconfig_for(&user);
            let agent = Agent::start_unlisted(
                tempfile::tempdir().unwrap(),
                std::slice::from_ref(&source),
                Some(&kubeconfig),
            );
            Node { agent, user }
        })
        .collect();
    let without_inotify = start_up(&nodes, &bundles[0], run.ready_limit);
    let ready = settle(&api, &nodes, &bundles[0], run.ready_limit);
    table.info(
        "fleet started: every agent holding the bundle and watching",
        format!(
            "{:.1} s{}",
            started.elapsed().as_secs_f64(),
            if ready { "" } else { " (not all: see above)" }
        ),
    );
    if without_inotify > 0 {
        let limit =
            std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances").unwrap_or_default();
        table.info(
            "agents running without inotify (fs.inotify.max_user_instances; the bundle's writes do not depend on it)",
            format!("{without_inotify} (limit {})", limit.trim()),
        );
    }

    let troubles = [
        Trouble::Outage(run.outage),
        Trouble::RollingRestart,
        Trouble::Shedding {
            spell: run.spell,
            retry_after: run.retry_after,
        },
        Trouble::Restore(run.outage),
    ];
    // The rotation that a restore takes back.
    let undone = &bundles[5];
    for (i, trouble) in troubles.into_iter().enumerate() {
        let (current, next) = (&bundles[i], &bundles[i + 1]);
        if i > 0 {
            settle(&api, &nodes, current, run.ready_limit);
        }
        let seen = go_through(&api, &nodes, trouble, [current, next, undone], &run);
        report(&mut table, &api, &nodes, trouble, &seen, &run);
    }
    table.print();
}

/// Waits until every agent holds `bundle` (its first write); returns how many said they run
/// without inotify (one instance each: past `fs.inotify.max_user_instances` they do).
fn start_up(nodes: &[Node], bundle: &str, limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    let mut without_inotify = vec![false; nodes.len()];
    let mut pending: Vec<usize> = (0..nodes.len()).collect();
    while !pending.is_empty() && Instant::now() < deadline {
        pending.retain(|&i| !nodes[i].agent.holds(bundle));
        std::thread::sleep(Duration::from_millis(50));
    }
    // What each said at start; the rest of its log is dropped by `settle`.
    for (node, without) in nodes.iter().zip(&mut without_inotify) {
        *without = node
            .agent
            .lines
            .try_iter()
            .any(|(_, line)| line.contains("cannot start inotify"));
    }
    if !pending.is_empty() {
        eprintln!(
            "note: {} of {} agents did not write the bundle within {limit:?}",
            pending.len(),
            nodes.len()
        );
    }
    without_inotify.iter().filter(|w| **w).count()
}

/// Waits until every agent holds `bundle` and watches, then leaves them alone for
/// [`SETTLE`] and forgets their log so far. False if that did not come within `limit`.
fn settle(api: &ApiServer, nodes: &[Node], bundle: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    let all = || api.open_watches() >= nodes.len() && nodes.iter().all(|n| n.agent.holds(bundle));
    while !all() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let ready = all();
    if !ready {
        eprintln!(
            "note: not every agent holds the bundle and watches after {limit:?} ({} watches open for {} agents)",
            api.open_watches(),
            nodes.len()
        );
    }
    std::thread::sleep(SETTLE);
    for node in nodes {
        while node.agent.lines.try_recv().is_ok() {}
    }
    ready
}

/// What happened to the fleet through one event.
struct Seen {
    /// The event began.
    start: Instant,
    /// The server answered again; the change was made right after.
    back: Instant,
    changed: Instant,
    /// When each node logged the new bundle written, if it did within the limit.
    followed: Vec<Option<Instant>>,
    /// After a restore: when each node logged the restored store's bundle written.
    restored: Option<Vec<Option<Instant>>>,
    /// When the last node followed, or the limit ran out.
    end: Instant,
    /// Each agent's CPU time during the event: the outage, or the spell, or the cut to the last
    /// node following.
    cpu: Vec<Duration>,
    /// From the server answering again to every agent watching again.
    watching_again: Option<Duration>,
}

fn cpu_times(nodes: &[Node]) -> Vec<Duration> {
    nodes.iter().map(|n| n.agent.cpu_time()).collect()
}

/// Takes the fleet through `trouble`, changes the ConfigMap to `next` as soon as the server
/// answers again, and follows every node until it holds it. A restore takes the fleet from
/// `current` to `undone` first, and back to `current` with the backup.
fn go_through(
    api: &ApiServer,
    nodes: &[Node],
    trouble: Trouble,
    [current, next, undone]: [&str; 3],
    run: &Run,
) -> Seen {
    eprintln!("{}: starting", trouble.label());
    let backup = matches!(trouble, Trouble::Restore(_)).then(|| {
        let backup = api.backup();
        // Life goes on: the rest of the cluster writes, and a rotation every node follows.
        for i in 0..50 {
            api.put_configmap(NS, "unrelated", &[("n", &i.to_string())], &[]);
        }
        api.put_configmap(NS, NAME, &[("ca-bundle.crt", undone)], &[]);
        settle(api, nodes, undone, run.ready_limit);
        backup
    });
    let cpu_before = cpu_times(nodes);
    let start = Instant::now();
    let mut cpu_during = None;
    match trouble {
        Trouble::Outage(outage) => {
            api.stop();
            std::thread::sleep(outage);
            cpu_during = Some(cpu_times(nodes));
            api.restart();
        }
        Trouble::RollingRestart => api.rolling_restart(),
        Trouble::Shedding { spell, retry_after } => {
            let fault = Fault::TooManyRequests { retry_after };
            api.shed(Some(fault));
            api.break_watches(fault);
            std::thread::sleep(spell);
            cpu_during = Some(cpu_times(nodes));
            api.shed(None);
        }
        Trouble::Restore(outage) => {
            api.stop();
            std::thread::sleep(outage);
            cpu_during = Some(cpu_times(nodes));
            api.restore(backup.as_ref().expect("the backup"));
        }
    }
    let back = Instant::now();
    api.put_configmap(NS, NAME, &[("ca-bundle.crt", next)], &[]);
    let changed = Instant::now();

    let hash = sha256_hex(next.as_bytes());
    // After a restore, each node writes the restored bundle back first.
    let restored_hash = backup.map(|_| sha256_hex(current.as_bytes()));
    let mut restored: Vec<Option<Instant>> = vec![None; nodes.len()];
    let mut followed: Vec<Option<Instant>> = vec![None; nodes.len()];
    let mut watching_again = None;
    let deadline = changed + run.follow_limit;
    while followed.iter().any(Option::is_none) && Instant::now() < deadline {
        for ((node, followed), restored) in nodes.iter().zip(&mut followed).zip(&mut restored) {
            for (at, line) in node.agent.lines.try_iter() {
                if !line.contains("bundle written") {
                    continue;
                }
                if followed.is_none() && line.contains(&hash) {
                    *followed = Some(at);
                }
                if restored.is_none() && restored_hash.as_ref().is_some_and(|h| line.contains(h)) {
                    *restored = Some(at);
                }
            }
        }
        if watching_again.is_none() && api.open_watches() >= nodes.len() {
            watching_again = Some(back.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let end = followed
        .iter()
        .flatten()
        .max()
        .copied()
        .filter(|_| followed.iter().all(Option::is_some))
        .unwrap_or_else(Instant::now);
    let after = cpu_during.unwrap_or_else(|| cpu_times(nodes));
    let cpu = after
        .iter()
        .zip(&cpu_before)
        .map(|(a, b)| *a - *b)
        .collect();
    eprintln!(
        "{}: {} of {} nodes followed",
        trouble.label(),
        followed.iter().flatten().count(),
        nodes.len()
    );
    Seen {
        start,
        back,
        changed,
        followed,
        restored: restored_hash.map(|_| restored),
        end,
        cpu,
        watching_again,
    }
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// The most requests that arrived within any one second, and when that second began.
fn peak_per_second(times: &mut [Instant]) -> (usize, Option<Instant>) {
    times.sort();
    let mut best = (0, None);
    let mut first = 0;
    for last in 0..times.len() {
        while times[last] - times[first] >= Duration::from_secs(1) {
            first += 1;
        }
        if last + 1 - first > best.0 {
            best = (last + 1 - first, Some(times[first]));
        }
    }
    best
}

fn report(
    table: &mut Table,
    api: &ApiServer,
    nodes: &[Node],
    trouble: Trouble,
    seen: &Seen,
    run: &Run,
) {
    let label = trouble.label();
    let n = nodes.len();

    // From the change to each node's new file.
    let mut took: Vec<Duration> = seen
        .followed
        .iter()
        .flatten()
        .map(|at| at.saturating_duration_since(seen.changed))
        .collect();
    let missing = n - took.len();
    let measured = if took.is_empty() {
        format!("none followed within {}", secs(run.follow_limit))
    } else {
        let median = percentile(&mut took, 0.5);
        let slowest = *took.last().unwrap();
        let within = took.iter().filter(|t| **t < FOLLOW_TARGET).count();
        let slowest = if missing > 0 {
            format!("> {} ({missing} did not follow)", secs(run.follow_limit))
        } else {
            secs(slowest)
        };
        format!(
            "slowest {slowest}, median {}; {within} of {n} within 10 s",
            secs(median)
        )
    };
    let metric = format!(
        "{label}: change made as the server answers again -> each node's new file (slowest, median)"
    );
    let pass = missing == 0 && took.last().is_some_and(|t| *t < FOLLOW_TARGET);
    match trouble {
        Trouble::Shedding { .. } => table.info(&metric, measured),
        _ => table.check(&metric, "< 10 s", measured, pass),
    }
    if let Some(restored) = &seen.restored {
        let mut took: Vec<Duration> = restored
            .iter()
            .flatten()
            .map(|at| at.saturating_duration_since(seen.back))
            .collect();
        let missing = n - took.len();
        let measured = match took.is_empty() {
            true => "none wrote it back".to_string(),
            false => {
                let median = percentile(&mut took, 0.5);
                let slowest = *took.last().unwrap();
                format!(
                    "slowest {}, median {}{}",
                    secs(slowest),
                    secs(median),
                    if missing > 0 {
                        format!(" ({missing} never wrote it back)")
                    } else {
                        String::new()
                    }
                )
            }
        };
        let pass = missing == 0 && took.last().is_some_and(|t| *t < FOLLOW_TARGET);
        table.check(
            &format!(
                "{label}: server answering on the restored store -> each node holding its bundle again (slowest, median)"
            ),
            "< 10 s",
            measured,
            pass,
        );
    }

    // The server's request log, from the start of the event to the last node following.
    let users: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| (node.user.as_str(), i))
        .collect();
    let mut per_agent: Vec<Vec<(Instant, bool, bool)>> = vec![Vec::new(); n];
    for r in api.requests() {
        if r.at < seen.start || r.at > seen.end {
            continue;
        }
        if let Some(&i) = users.get(r.user.as_str()) {
            per_agent[i].push((r.at, r.is_list(), r.watch));
        }
    }
    let count = |pick: fn(&(Instant, bool, bool)) -> bool| {
        let counts: Vec<usize> = per_agent
            .iter()
            .map(|reqs| reqs.iter().filter(|r| pick(r)).count())
            .collect();
        (
            counts.iter().copied().max().unwrap_or(0),
            counts.iter().sum::<usize>(),
        )
    };
    let (max_lists, lists) = count(|r| r.1);
    let (max_watches, watches) = count(|r| r.2);
    let (_, all) = count(|_| true);
    table.check(
        &format!("{label}: lists per agent, event start to last node following (max; total)"),
        "<= 1",
        format!("max {max_lists}; {lists} in all"),
        max_lists <= 1,
    );
    table.info(
        &format!("{label}: watches per agent, same window (max; total)"),
        format!(
            "max {max_watches}; {watches} in all ({} other requests)",
            all - lists - watches
        ),
    );
    let mut times: Vec<Instant> = per_agent.iter().flatten().map(|r| r.0).collect();
    let (peak, at) = peak_per_second(&mut times);
    let when = at.map_or(String::new(), |at| {
        if at >= seen.back {
            format!(
                " (the second from +{} after it answered again)",
                secs(at - seen.back)
            )
        } else {
            format!(
                " (the second from {} before it answered again)",
                secs(seen.back - at)
            )
        }
    });
    table.info(
        &format!("{label}: peak requests in one second at the server"),
        format!("{peak}{when}"),
    );
    if let Some(again) = seen.watching_again {
        table.info(
            &format!("{label}: every agent watching again, after the server answered"),
            secs(again),
        );
    }

    // CPU during the event.
    let mut cpu = seen.cpu.clone();
    let median = percentile(&mut cpu, 0.5);
    let max = *cpu.last().unwrap();
    let measured = format!("median {}, max {} per agent", ms(median), ms(max));
    match trouble {
        Trouble::Outage(_) | Trouble::Restore(_) => table.check(
            &format!("{label}: agent CPU during the outage"),
            "< 0.5 s per agent",
            measured,
            max < CPU_TARGET,
        ),
        Trouble::RollingRestart => table.info(
            &format!("{label}: agent CPU from the cut to the last node following"),
            measured,
        ),
        Trouble::Shedding { .. } => {
            table.info(&format!("{label}: agent CPU during the spell"), measured)
        }
    }

    if let Trouble::Shedding { spell, retry_after } = trouble {
        shedding(table, &label, &per_agent, seen, spell, retry_after);
    }
}

/// Each agent told to retry after `retry_after` (by the ERROR event that ended its watch at
/// the start of the spell, and by every 429 during it) must not ask again sooner; and none
/// asks more often than that allows during the spell.
fn shedding(
    table: &mut Table,
    label: &str,
    per_agent: &[Vec<(Instant, bool, bool)>],
    seen: &Seen,
    spell: Duration,
    retry_after: u32,
) {
    let wait = Duration::from_secs(retry_after.into());
    let mut early = 0;
    let mut shortest: Option<Duration> = None;
    let mut in_spell = Vec::new();
    for reqs in per_agent {
        let mut times: Vec<Instant> = reqs.iter().map(|r| r.0).collect();
        times.sort();
        // Every request in the spell was answered 429 with the Retry-After; the watch open at
        // its start got the same in an ERROR event, sent no sooner than `start`.
        let told: Vec<Instant> = std::iter::once(seen.start)
            .chain(times.iter().copied().filter(|t| *t < seen.back))
            .collect();
        in_spell.push(told.len() - 1);
        let mut was_early = false;
        for t in told {
            if let Some(next) = times.iter().find(|n| **n > t) {
                let gap = *next - t;
                if gap < wait {
                    was_early = true;
                    shortest = Some(shortest.map_or(gap, |s| s.min(gap)));
                }
            }
        }
        early += usize::from(was_early);
    }
    let n = per_agent.len();
    table.check(
        &format!("{label}: agents that asked again before their Retry-After"),
        "0",
        match shortest {
            Some(gap) => format!("{early} of {n} (the soonest after {})", secs(gap)),
            None => format!("0 of {n}"),
        },
        early == 0,
    );
    let allowed = spell.as_secs().div_ceil(retry_after.into()) as usize;
    let max = in_spell.iter().copied().max().unwrap_or(0);
    let total: usize = in_spell.iter().sum();
    let mut spell_times: Vec<Instant> = per_agent
        .iter()
        .flatten()
        .map(|r| r.0)
        .filter(|t| *t < seen.back)
        .collect();
    let (peak, _) = peak_per_second(&mut spell_times);
    table.check(
        &format!("{label}: requests during the spell, per agent (no storm)"),
        &format!("<= {allowed}"),
        format!("max {max}; {total} in all; peak {peak} in one second"),
        max <= allowed,
    );
}
