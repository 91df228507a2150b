//! What the agent's confinement costs (issue 37, SPEC 13 layer 1), for
//! `cargo bench --bench confinement`: this build's agent, which confines itself at start
//! (Landlock and a seccomp filter), against a build from before the confinement, named by
//! BENCH_BASELINE_BINARY, in ONE run. The two take turns at every step, so that whatever
//! else loads the machine weighs on both alike. It ends with one summary table (metric,
//! target, measured, result):
//!
//! - Rotation latency, 10 certificates, a ConfigMap source on a local API server (one server
//!   per agent, so that an update wakes one agent only): from the watch event leaving the
//!   server to the agent's `bundle written` line, as `benches/daemon.rs` times it
//!   (`support/rotation.rs`). The two agents run side by side and rotate in turn, update
//!   after update, the first of each pair alternating. Target: p50 within 1.1x of the
//!   agent before confinement.
//! - Start to `/readyz` answering 200, adopting a valid bundle with a `file:` source (the
//!   bundle already holds what the source makes): spawn to the first 200, polled every
//!   0.2 ms over plain HTTP on loopback; 100 starts each, in turn. Target: under 100 ms
//!   (the worst start).
//! - Resident memory (VmRSS of /proc/PID/status) in steady state after the rotations and a
//!   scrape, sampled once a second in turn over a window longer than the confinement's
//!   own check (every 10 s): the medians, and their difference. Target: within 1 MiB. The
//!   anonymous part is shown apart: the file-backed part follows the binary's size, which
//!   other changes between the two builds move too (the D-Bus client left with the
//!   confinement's commit).
//!
//! Without BENCH_BASELINE_BINARY it says that the comparison is skipped and measures this
//! build alone. Under `cargo test --benches` (no `--bench`) it runs a short version as a
//! smoke test (a debug build beside whatever the baseline is: no figure is judged then).

#[path = "support/agent.rs"]
mod agent;
#[path = "../tests/common/apiserver.rs"]
mod apiserver;
#[path = "support/clock.rs"]
mod clock;
#[path = "support/report.rs"]
mod report;
#[path = "support/rotation.rs"]
mod rotation;
#[path = "support/signers.rs"]
mod signers;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent::{Agent, p50_p99, sha256_hex, status_kib};
use apiserver::ApiServer;
use report::{Table, ms, percentile};
use signers::KeyPool;

const NS: &str = "openshift-config-managed";
const NAME: &str = "kube-apiserver-client-ca";

/// How much of each measurement a run does.
struct Run {
    /// Rotations before the timed ones, each agent.
    warmup: usize,
    /// Timed rotations, each agent.
    updates: usize,
    /// Starts to ready, each agent.
    starts: usize,
    /// Resident memory samples, one a second, each agent.
    samples: usize,
}

/// One agent binary under measurement.
struct Build {
    /// What the table calls it.
    name: &'static str,
    binary: PathBuf,
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let run = if full {
        Run {
            warmup: 10,
            updates: 500,
            starts: 100,
            samples: 15,
        }
    } else {
        println!(
            "(smoke run of the confinement benchmark: a debug build and few iterations; `cargo bench --bench confinement` gives the figures)"
        );
        Run {
            warmup: 1,
            updates: 5,
            starts: 2,
            samples: 2,
        }
    };
    let mut builds = vec![Build {
        name: "confined (this build)",
        binary: PathBuf::from(env!("CARGO_BIN_EXE_kubelet-ca-agent")),
    }];
    match std::env::var_os("BENCH_BASELINE_BINARY") {
        Some(path) => {
            let binary = PathBuf::from(path);
            assert!(
                binary.is_file(),
                "BENCH_BASELINE_BINARY={} is no file: build the commit before the confinement (e21580c) and name its release binary",
                binary.display()
            );
            builds.push(Build {
                name: "before confinement (BENCH_BASELINE_BINARY)",
                binary,
            });
        }
        None => println!(
            "BENCH_BASELINE_BINARY is not set: the comparison with the agent before confinement is skipped, this build is measured alone"
        ),
    }
    for build in &builds {
        println!("{}: {}", build.name, build.binary.display());
    }
    let pool = KeyPool::new(8);
    let mut table = Table::new(
        "confinement: kubelet-ca-agent run, confined against before confinement (same run)",
        !full,
    );
    for build in &builds {
        let size = fs::metadata(&build.binary).map_or(0, |m| m.len());
        table.info(
            &format!("binary size, {}", build.name),
            format!("{} KiB", size / 1024),
        );
    }
    // BENCH_ONLY=NAME[,NAME...] runs only those parts (the function names below).
    let only = std::env::var("BENCH_ONLY").ok();
    type Part = fn(&Run, &KeyPool, &[Build], &mut Table);
    let parts: [(&str, Part); 2] = [
        ("rotations_and_memory", rotations_and_memory),
        ("ready_on_adoption", ready_on_adoption),
    ];
    for (name, part) in parts {
        if only
            .as_deref()
            .is_none_or(|only| only.split(',').any(|o| o == name))
        {
            part(&run, &pool, &builds, &mut table);
        }
    }
    table.print();
}

/// The builds' indices in the order of turn `i`: the first of each turn alternates.
fn turn(i: usize, builds: &[Build]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..builds.len()).collect();
    if i % 2 == 1 {
        order.reverse();
    }
    order
}

/// The ConfigMap rotations of the agents side by side, in turn; then their resident memory.
fn rotations_and_memory(run: &Run, pool: &KeyPool, builds: &[Build], table: &mut Table) {
    let bundles = [pool.bundle(10, "gen-a"), pool.bundle(10, "gen-b")];
    let hashes = [
        sha256_hex(bundles[0].as_bytes()),
        sha256_hex(bundles[1].as_bytes()),
    ];
    let source = format!("configmap:{NS}/{NAME}");
    let apis: Vec<ApiServer> = builds
        .iter()
        .map(|_| {
            let api = ApiServer::start();
            // As kube-apiserver's watch cache sends them, about once a minute.
            api.set_bookmark_interval(Duration::from_secs(60));
            api.put_configmap(NS, NAME, &[("ca-bundle.crt", &bundles[0])], &[]);
            api
        })
        .collect();
    let agents: Vec<Agent> = builds
        .iter()
        .zip(&apis)
        .map(|(build, api)| {
            Agent::start_binary(
                &build.binary,
                tempfile::tempdir().unwrap(),
                std::slice::from_ref(&source),
                Some(api.kubeconfig()),
                &["--insecure-metrics".into()],
            )
        })
        .collect();
    for agent in &agents {
        agent.wait_holds(&bundles[0], Duration::from_secs(20));
    }
    // What each says of its confinement at start: this build must be confined, the
    // baseline must not be.
    for (b, (build, agent)) in builds.iter().zip(&agents).enumerate() {
        let mut said = None;
        agent.drain_lines(|line| {
            if line.contains("confined to what") || line.contains("confined only in part") {
                said = Some(line.to_string());
            }
        });
        match (b == 0, said) {
            (true, Some(line)) => table.info(
                &format!("confinement said at start, {}", build.name),
                if line.contains("only in part") {
                    format!(
                        "{} (only in part: see its warning)",
                        confinement_field(&line)
                    )
                } else {
                    confinement_field(&line)
                },
            ),
            (true, None) => panic!("{} said nothing of its confinement", build.name),
            (false, Some(line)) => panic!(
                "{} confines itself ({line}): BENCH_BASELINE_BINARY should be a build from before the confinement",
                build.name
            ),
            (false, None) => {}
        }
    }

    let rotate = |b: usize, i: usize| {
        let (api, next) = (&apis[b], &bundles[i % 2]);
        rotation::bundle(api, &agents[b], &hashes[i % 2], || {
            api.put_configmap(NS, NAME, &[("ca-bundle.crt", next)], &[]);
        })
    };
    for i in 1..=run.warmup {
        for b in turn(i, builds) {
            rotate(b, i);
        }
    }
    let mut latencies = vec![Vec::new(); builds.len()];
    for i in run.warmup + 1..=run.warmup + run.updates {
        for b in turn(i, builds) {
            latencies[b].push(rotate(b, i));
        }
    }
    // Each turn's two rotations ran back to back, under the same load: their ratio.
    let mut paired: Vec<f64> = match &latencies[..] {
        [confined, before] => confined
            .iter()
            .zip(before)
            .map(|(c, b)| c.as_secs_f64() / b.as_secs_f64())
            .collect(),
        _ => Vec::new(),
    };
    let n = run.updates;
    let p50s: Vec<Duration> = builds
        .iter()
        .zip(&mut latencies)
        .map(|(build, samples)| {
            let (p50, p99) = p50_p99(samples);
            table.info(
                &format!(
                    "ConfigMap update -> `bundle written`, 10 certificates, p50 / p99 of {n}, {}",
                    build.name
                ),
                format!("{} / {}", ms(p50), ms(p99)),
            );
            p50
        })
        .collect();
    if let [confined, before] = p50s[..] {
        let ratio = confined.as_secs_f64() / before.as_secs_f64();
        table.check(
            "rotation p50, confined / before confinement (same run, in turn)",
            "<= 1.1x",
            format!("{ratio:.2}x"),
            ratio <= 1.1,
        );
        paired.sort_by(f64::total_cmp);
        table.info(
            &format!(
                "rotation, median of the {n} turns' own ratios (confined / before, back to back)"
            ),
            format!("{:.2}x", paired[paired.len() / 2]),
        );
    }

    // Steady state: a scrape, then samples once a second, in turn, over a window that
    // holds at least one of the confinement's own checks (every 10 s).
    for agent in &agents {
        agent.scrape();
    }
    let mut rss = vec![Vec::new(); builds.len()];
    for i in 0..run.samples {
        std::thread::sleep(Duration::from_secs(1));
        for b in turn(i, builds) {
            rss[b].push(status_kib(agents[b].pid(), "VmRSS:"));
        }
    }
    let medians: Vec<(u64, u64)> = builds
        .iter()
        .zip(&mut rss)
        .zip(&agents)
        .map(|((build, samples), agent)| {
            samples.sort();
            let median = samples[samples.len() / 2];
            let (min, max) = (samples[0], samples[samples.len() - 1]);
            let (anon, file) = (
                status_kib(agent.pid(), "RssAnon:"),
                status_kib(agent.pid(), "RssFile:"),
            );
            table.info(
                &format!(
                    "resident memory, 10 certificates, after {} rotations and a scrape, median of {} samples, {}",
                    run.warmup + n,
                    samples.len(),
                    build.name
                ),
                format!(
                    "{median} KiB (min {min}, max {max}; at the end {anon} anonymous, {file} file-backed)"
                ),
            );
            (median, anon)
        })
        .collect();
    if let [(confined, confined_anon), (before, before_anon)] = medians[..] {
        let difference = confined as i64 - before as i64;
        table.check(
            "resident memory, confined - before confinement (medians)",
            "within 1 MiB",
            format!("{difference:+} KiB"),
            difference.abs() <= 1024,
        );
        // The file-backed part follows the binary's size, which other changes move too.
        table.info(
            "anonymous resident memory (RssAnon), confined - before confinement, at the end",
            format!("{:+} KiB", confined_anon as i64 - before_anon as i64),
        );
    }
}

/// The `confinement=...` field of the agent's start line, or the whole line.
fn confinement_field(line: &str) -> String {
    line.split_once("confinement=")
        .map(|(_, rest)| {
            let rest = rest.trim_start_matches('"');
            rest.split('"').next().unwrap_or(rest).to_string()
        })
        .unwrap_or_else(|| line.to_string())
}

/// Start to `/readyz` 200 with a valid bundle in place that the `file:` source makes, the
/// builds in turn.
fn ready_on_adoption(run: &Run, pool: &KeyPool, builds: &[Build], table: &mut Table) {
    let adopted = pool.bundle(10, "adopted");
    let mut samples = vec![Vec::new(); builds.len()];
    for i in 0..run.starts {
        for b in turn(i, builds) {
            samples[b].push(start_to_ready(&builds[b].binary, &adopted));
        }
    }
    let starts = run.starts;
    let mut p50s = Vec::new();
    for (b, build) in builds.iter().enumerate() {
        // Which start was the slowest (1 is the first), before the samples are sorted.
        let slowest = (0..starts).max_by_key(|&i| samples[b][i]).unwrap() + 1;
        let p50 = percentile(&mut samples[b], 0.5);
        let p90 = percentile(&mut samples[b], 0.9);
        let max = *samples[b].last().unwrap();
        let metric = format!(
            "start -> /readyz 200, adopting a valid bundle (file: source), p50 / p90 / max of {starts}, {}",
            build.name
        );
        let measured = format!(
            "{} / {} / {} (the slowest: start {slowest})",
            ms(p50),
            ms(p90),
            ms(max)
        );
        if b == 0 {
            table.check(
                &metric,
                "< 100 ms",
                measured,
                max < Duration::from_millis(100),
            );
        } else {
            table.info(&metric, measured);
        }
        p50s.push(p50);
    }
    if let [confined, before] = p50s[..] {
        table.info(
            "start -> /readyz 200 p50, confined / before confinement (same run, in turn)",
            format!(
                "{:.2}x ({:+.3} ms)",
                confined.as_secs_f64() / before.as_secs_f64(),
                (confined.as_secs_f64() - before.as_secs_f64()) * 1000.0
            ),
        );
    }
}

/// One start of `binary` with a `file:` source holding `bundle` and the bundle already in
/// place: the time from just before the spawn to the first `/readyz` that answers 200.
fn start_to_ready(binary: &Path, bundle: &str) -> Duration {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("sources/bundle.crt");
    fs::create_dir_all(source.parent().unwrap()).unwrap();
    fs::write(&source, bundle).unwrap();
    fs::create_dir_all(dir.path().join("etc")).unwrap();
    fs::write(dir.path().join("etc/kubelet-ca.crt"), bundle).unwrap();
    let start = Instant::now();
    let agent = Agent::start_binary(
        binary,
        dir,
        &[format!("file:{}", source.display())],
        None,
        &["--insecure-metrics".into()],
    );
    loop {
        if agent.readyz() == Some(200) {
            let took = start.elapsed();
            assert!(agent.holds(bundle), "the adopted bundle stays as it was");
            return took;
        }
        if start.elapsed() > Duration::from_secs(10) {
            let log: Vec<String> = agent.lines.try_iter().map(|(_, l)| l).collect();
            panic!(
                "{} was not ready within 10 s; its log:\n{}",
                binary.display(),
                log.join("\n")
            );
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
