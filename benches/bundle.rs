//! Parse + validate + merge + render of a whole bundle (SPEC 11: under 10 ms at 1,000
//! certificates), for `cargo bench --bench bundle`.
//!
//! The certificates are a realistic mix (of every 20, 16 RSA-2048, 3 P-256, 1 P-384; see
//! `support/signers.rs`), generated before measuring with dates relative to now. A bundle of
//! `n` certificates comes from two sources that overlap (the first 60% and the last 60%), so
//! each pass parses 1.2 n certificates and the merge has 0.2 n duplicates to drop, and
//! renders exactly `n`.
//!
//! Criterion prints its statistics; then a plain timing loop of the same work gives p50 and
//! p99 of the wall time for the one summary table at the end (judged at p99), with the CPU
//! time of the pass (what a busy machine's scheduling does not add) and each stage's p50. Under `cargo test --benches` (no `--bench`)
//! everything runs once, small, as a smoke test.

#[path = "support/clock.rs"]
mod clock;
#[path = "support/report.rs"]
mod report;
#[path = "support/signers.rs"]
mod signers;

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use kubelet_ca_agent::bundle::{self, Policy, SourceCertificates, parse_source};
use report::{Table, ms, percentile};

/// The two overlapping sources that make a bundle of `n` certificates.
fn sources(certificates: &[String]) -> (String, String) {
    let n = certificates.len();
    let first = certificates[..n * 6 / 10].concat();
    let second = certificates[n * 4 / 10..].concat();
    (first, second)
}

/// The measured work: what the agent does when a source changes.
fn build(first: &str, second: &str, now: i64) -> Vec<u8> {
    timed_build(first, second, now).0
}

/// [`build`], with the time of each stage: parse both sources, build, render.
fn timed_build(first: &str, second: &str, now: i64) -> (Vec<u8>, [Duration; 3]) {
    let start = Instant::now();
    let sources: [SourceCertificates; 2] = [
        parse_source(first.as_bytes()).unwrap(),
        parse_source(second.as_bytes()).unwrap(),
    ];
    let parsed = Instant::now();
    let built = bundle::build(&sources, &[], Policy::default(), now).unwrap();
    let merged = Instant::now();
    let rendered = built.bundle.render();
    let end = Instant::now();
    (rendered, [parsed - start, merged - parsed, end - merged])
}

/// One timed pass: wall time, CPU time of this thread, and the stages.
struct Pass {
    wall: Duration,
    cpu: Duration,
    stages: [Duration; 3],
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        println!(
            "(smoke run of the bundle benchmark: a debug build, once each; `cargo bench --bench bundle` gives the figures)"
        );
    }
    let sizes: &[usize] = if full { &[10, 1000] } else { &[10, 100] };
    let started = Instant::now();
    let pool = signers::KeyPool::new(if full { 32 } else { 4 });
    let inputs: Vec<(usize, String, String, usize)> = sizes
        .iter()
        .map(|&n| {
            let certificates = pool.certificates(n, &format!("bundle-{n}"));
            let bytes = certificates.iter().map(String::len).sum();
            let (first, second) = sources(&certificates);
            (n, first, second, bytes)
        })
        .collect();
    println!(
        "generated {} certificates in {:.1} s",
        sizes.iter().sum::<usize>(),
        started.elapsed().as_secs_f64()
    );
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    for (n, first, second, _) in &inputs {
        assert_eq!(
            parse_source(&build(first, second, now))
                .unwrap()
                .certificates
                .len(),
            *n,
            "the bundle renders {n} certificates"
        );
    }

    let mut criterion = Criterion::default().configure_from_args();
    {
        let mut group = criterion.benchmark_group("parse_validate_merge_render");
        for (n, first, second, _) in &inputs {
            group.bench_with_input(BenchmarkId::from_parameter(n), n, |b, _| {
                b.iter(|| build(first, second, now))
            });
        }
        group.finish();
    }
    criterion.final_summary();

    let rounds = if full { 300 } else { 3 };
    let mut table = Table::new("bundle: parse, validate, merge, render", !full);
    for (n, first, second, bytes) in &inputs {
        let passes: Vec<Pass> = (0..rounds)
            .map(|_| {
                let (cpu, start) = (clock::thread(), Instant::now());
                let (rendered, stages) = timed_build(
                    std::hint::black_box(first),
                    std::hint::black_box(second),
                    now,
                );
                let wall = start.elapsed();
                std::hint::black_box(rendered);
                Pass {
                    wall,
                    cpu: clock::thread() - cpu,
                    stages,
                }
            })
            .collect();
        let quantiles = |f: &dyn Fn(&Pass) -> Duration| {
            let mut samples: Vec<Duration> = passes.iter().map(f).collect();
            (
                percentile(&mut samples, 0.5),
                percentile(&mut samples, 0.99),
            )
        };
        let (p50, p99) = quantiles(&|p| p.wall);
        let (cpu50, _) = quantiles(&|p| p.cpu);
        let stage = |i: usize| ms(quantiles(&|p| p.stages[i]).0);
        let what = format!(
            "{n} certificates ({} KiB of PEM, from two sources overlapping by {})",
            bytes / 1024,
            n / 5
        );
        let measured = format!(
            "p50 {}, p99 {} (CPU p50 {}; parse {}, merge {}, render {} at p50)",
            ms(p50),
            ms(p99),
            ms(cpu50),
            stage(0),
            stage(1),
            stage(2)
        );
        if Some(n) == sizes.last() {
            table.check(
                &format!("{what}, p99 of {rounds}"),
                "< 10 ms",
                measured,
                p99 < Duration::from_millis(10),
            );
        } else {
            table.info(&format!("{what}, of {rounds}"), measured);
        }
    }
    table.print();
}
