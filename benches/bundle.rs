//! Parse + validate + merge + render of a whole bundle (SPEC 11: under 10 ms at 1,000
//! certificates). The certificates are generated before measuring, with dates relative to now.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kubelet_ca_agent::bundle::{self, Policy, parse_source};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use time::{Duration, OffsetDateTime};

fn signers(n: usize) -> String {
    let now = OffsetDateTime::now_utc();
    (0..n)
        .map(|i| {
            let mut params = CertificateParams::default();
            params
                .distinguished_name
                .push(DnType::CommonName, format!("signer-{i}"));
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.not_before = now - Duration::hours(1);
            params.not_after = now + Duration::days(30 + i as i64);
            let key = KeyPair::generate().unwrap();
            params.self_signed(&key).unwrap().pem()
        })
        .collect()
}

fn build_bundle(c: &mut Criterion) {
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let mut group = c.benchmark_group("parse_validate_merge_render");
    for n in [10usize, 1000] {
        // Two sources that overlap by half, so the merge has duplicates to remove.
        let all = signers(n + n / 2);
        let blocks: Vec<&str> = all.split_inclusive("-----END CERTIFICATE-----\n").collect();
        let first: String = blocks[..n].concat();
        let second: String = blocks[n / 2..].concat();
        group.bench_with_input(
            BenchmarkId::from_parameter(n),
            &(first, second),
            |b, (first, second)| {
                b.iter(|| {
                    let sources = [
                        parse_source(first.as_bytes()).unwrap(),
                        parse_source(second.as_bytes()).unwrap(),
                    ];
                    let built = bundle::build(&sources, &[], Policy::default(), now).unwrap();
                    built.bundle.render()
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, build_bundle);
criterion_main!(benches);
