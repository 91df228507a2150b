//! Property tests of the pure bundle engine: parse, merge, render and retention, over
//! sources made of signers generated at run time.

mod common;

use std::sync::OnceLock;

use kubelet_ca_agent::bundle::parse::{frame, parse_source};
use kubelet_ca_agent::bundle::retention::{self, Remembered};
use kubelet_ca_agent::bundle::{
    self, Bundle, Certificate, Fingerprint, Policy, SourceCertificates,
};
use proptest::prelude::*;
use time::{Duration, OffsetDateTime};

use common::pki::{self, Algorithm, Signer};

/// A pool of signers: valid, expired and not yet valid, of every algorithm but RSA (kept
/// out for speed; RSA is covered end to end).
struct Pool {
    pems: Vec<String>,
    certs: Vec<Certificate>,
    leaf: String,
    key: String,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let (d, h) = (Duration::days, Duration::hours);
        let signers = [
            Signer::new("p256-a", Algorithm::P256),
            Signer::new("p384-b", Algorithm::P384),
            Signer::new("ed25519-c", Algorithm::Ed25519),
            Signer::valid_between("expired-d", Algorithm::P256, d(-90), d(-1)),
            Signer::valid_between("future-e", Algorithm::P256, d(3), d(90)),
            Signer::valid_between("short-f", Algorithm::P256, h(-1), h(2)),
        ];
        let pems: Vec<String> = signers.iter().map(Signer::pem).collect();
        let certs = signers
            .iter()
            .map(|s| Certificate::from_der(&s.der()).unwrap())
            .collect();
        Pool {
            pems,
            certs,
            leaf: pki::leaf("leaf"),
            key: signers[0].key_pem(),
        }
    })
}

fn now() -> i64 {
    OffsetDateTime::now_utc().unix_timestamp()
}

/// Text that may stand between blocks (never anything PEM-like).
fn filler() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("\n".to_string()),
        Just("# comment\n".to_string()),
        Just("Subject: CN=whatever\nIssuer: ...\n\n".to_string()),
        "[a-zA-Z0-9 #:=]{0,40}\n",
    ]
}

/// A source: indexes into the pool, the text between blocks, and CRLF or LF.
fn source() -> impl Strategy<Value = (Vec<usize>, Vec<String>, bool)> {
    (1usize..8).prop_flat_map(|n| {
        (
            prop::collection::vec(0..pool().certs.len(), n),
            prop::collection::vec(filler(), n + 1),
            any::<bool>(),
        )
    })
}

fn write_source(indexes: &[usize], fillers: &[String], crlf: bool) -> String {
    let mut text = fillers[0].clone();
    for (i, &idx) in indexes.iter().enumerate() {
        text.push_str(&pool().pems[idx]);
        text.push_str(&fillers[i + 1]);
    }
    if crlf {
        text.replace('\n', "\r\n")
    } else {
        text
    }
}

fn fingerprints(certs: &[Certificate]) -> Vec<Fingerprint> {
    certs.iter().map(Certificate::fingerprint).collect()
}

fn dedup_in_order(indexes: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut seen = Vec::new();
    for i in indexes {
        if !seen.contains(&i) {
            seen.push(i);
        }
    }
    seen
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn parse_keeps_every_certificate_in_order((idx, fill, crlf) in source()) {
        let parsed = parse_source(write_source(&idx, &fill, crlf).as_bytes()).unwrap();
        let expected: Vec<Fingerprint> = idx.iter().map(|&i| pool().certs[i].fingerprint()).collect();
        prop_assert_eq!(fingerprints(&parsed.certificates), expected);
    }

    #[test]
    fn render_is_a_fixed_point((idx, fill, crlf) in source()) {
        let parsed = parse_source(write_source(&idx, &fill, crlf).as_bytes()).unwrap();
        let once = Bundle::from_certificates(parsed.certificates).render();
        let again = Bundle::from_certificates(parse_source(&once).unwrap().certificates).render();
        prop_assert_eq!(&once, &again);
        // Rendering holds CERTIFICATE blocks only, and nothing between them.
        let (blocks, error) = frame(&once);
        prop_assert!(error.is_none());
        prop_assert!(blocks.iter().all(|b| b.label == "CERTIFICATE"));
        let joined: Vec<u8> = blocks.iter().flat_map(|b| b.text.to_vec()).collect();
        prop_assert_eq!(joined, once);
    }

    #[test]
    fn well_formed_sources_render_byte_identical(idx in prop::collection::vec(0..6usize, 1..8)) {
        let unique = dedup_in_order(idx);
        let text: String = unique.iter().map(|&i| pool().pems[i].as_str()).collect();
        let parsed = parse_source(text.as_bytes()).unwrap();
        prop_assert_eq!(Bundle::from_certificates(parsed.certificates).render(), text.into_bytes());
    }

    #[test]
    fn merge_is_the_ordered_union_first_occurrence_wins(
        sources in prop::collection::vec(source(), 1..4),
        drop_expired in any::<bool>(),
    ) {
        let parsed: Vec<SourceCertificates> = sources
            .iter()
            .map(|(i, f, c)| parse_source(write_source(i, f, *c).as_bytes()).unwrap())
            .collect();
        let now = now();
        let policy = Policy { retain_removed: 0, drop_expired };
        let expected: Vec<Fingerprint> = dedup_in_order(sources.iter().flat_map(|(i, _, _)| i.clone()))
            .into_iter()
            .map(|i| &pool().certs[i])
            .filter(|c| !(drop_expired && c.is_expired_at(now)))
            .map(Certificate::fingerprint)
            .collect();
        match bundle::build(&parsed, &[], policy, now) {
            Ok(built) => {
                prop_assert_eq!(fingerprints(built.bundle.certificates()), expected);
                prop_assert!(built.bundle.valid_count(now) > 0);
            }
            Err(e) => {
                // Refused only when nothing in it is valid now.
                let valid = expected.iter().filter(|f| pool().certs.iter().any(|c| c.fingerprint() == **f && c.is_valid_at(now))).count();
                prop_assert_eq!(valid, 0);
                prop_assert_eq!(e.total, expected.len());
            }
        }
    }

    #[test]
    fn a_private_key_anywhere_rejects_the_whole_source((idx, fill, crlf) in source(), at in 0usize..8) {
        let at = at.min(idx.len());
        let mut text = String::new();
        for (i, &c) in idx.iter().enumerate() {
            if i == at { text.push_str(&pool().key); }
            text.push_str(&pool().pems[c]);
            text.push_str(&fill[i]);
        }
        if at == idx.len() { text.push_str(&pool().key); }
        if crlf { text = text.replace('\n', "\r\n"); }
        let rejection = parse_source(text.as_bytes()).unwrap_err();
        prop_assert_eq!(rejection.reason(), "private_key");
        let message = rejection.to_string();
        prop_assert!(message.contains(&format!("block {}", at + 1)), "{}", message);
        for line in pool().key.lines().filter(|l| !l.starts_with("-----")) {
            prop_assert!(!message.contains(line));
        }
    }

    #[test]
    fn non_ca_certificates_are_set_aside_with_their_block((idx, fill, crlf) in source(), at in 0usize..8) {
        let at = at.min(idx.len());
        let mut blocks: Vec<&str> = idx.iter().map(|&i| pool().pems[i].as_str()).collect();
        blocks.insert(at, &pool().leaf);
        let text = write_source(&[], &[blocks.concat()], crlf);
        let _ = fill;
        let parsed = parse_source(text.as_bytes()).unwrap();
        prop_assert_eq!(parsed.certificates.len(), idx.len());
        prop_assert_eq!(parsed.not_ca.len(), 1);
        prop_assert_eq!(parsed.not_ca[0].block, at + 1);
    }

    #[test]
    fn truncating_a_source_never_yields_a_partial_acceptance((idx, fill, crlf) in source(), cut in 1usize..3000) {
        let text = write_source(&idx, &fill, crlf);
        let cut = text.len().saturating_sub(cut).max(1);
        let truncated = &text.as_bytes()[..cut];
        // Byte spans of the blocks in the whole text.
        let spans: Vec<(usize, usize)> = frame(text.as_bytes())
            .0
            .iter()
            .map(|b| {
                let start = b.text.as_ptr() as usize - text.as_ptr() as usize;
                let armor_end = start + b.text.trim_ascii_end().len();
                (start, armor_end)
            })
            .collect();
        // A cut past a block's leading "-----" and before its closing "-----" tears it.
        let tears_a_block = spans.iter().any(|&(start, end)| start + 5 <= cut && cut < end);
        let complete: Vec<Fingerprint> = spans
            .iter()
            .zip(&idx)
            .filter(|((_, end), _)| *end <= cut)
            .map(|(_, &i)| pool().certs[i].fingerprint())
            .collect();
        match parse_source(truncated) {
            Ok(parsed) => {
                prop_assert!(!tears_a_block, "a torn block was accepted (cut at {})", cut);
                prop_assert_eq!(fingerprints(&parsed.certificates), complete);
            }
            Err(rejection) => {
                let torn_or_empty = tears_a_block || complete.is_empty();
                prop_assert!(torn_or_empty, "rejected although intact: {}", rejection);
            }
        }
    }

    #[test]
    fn retention_keeps_only_vanished_unexpired_certificates_within_the_window(
        previous in prop::collection::vec((0..6usize, prop::option::of(0i64..7200)), 0..6),
        current in prop::collection::vec(0..6usize, 0..6),
        window in prop_oneof![Just(0i64), 1i64..10_000],
    ) {
        let now = now();
        let certs = &pool().certs;
        let previous: Vec<Remembered> = dedup_in_order(previous.iter().map(|(i, _)| *i))
            .into_iter()
            .map(|i| Remembered {
                certificate: certs[i].clone(),
                missing_since: previous.iter().find(|(j, _)| *j == i).unwrap().1.map(|ago| now - ago),
            })
            .collect();
        let current: Vec<Certificate> = dedup_in_order(current).into_iter().map(|i| certs[i].clone()).collect();
        let out = retention::apply(&previous, &current, window, now);
        for kept in &out.kept {
            prop_assert!(!current.contains(kept));
            prop_assert!(!kept.is_expired_at(now));
            let since = previous.iter().find(|r| &r.certificate == kept).unwrap().missing_since.unwrap_or(now);
            prop_assert!(now < since + window);
        }
        if window == 0 {
            prop_assert!(out.kept.is_empty());
        }
        // The memory is the new bundle: the sources' certificates, then the kept ones.
        let memory: Vec<&Certificate> = out.memory.iter().map(|r| &r.certificate).collect();
        let expected: Vec<&Certificate> = current.iter().chain(&out.kept).collect();
        prop_assert_eq!(memory, expected);
    }
}

#[test]
fn a_certificate_dropped_by_every_source_is_retained_then_expires_from_memory() {
    let certs = &pool().certs;
    let now = now();
    let previous = vec![
        Remembered {
            certificate: certs[0].clone(),
            missing_since: None,
        },
        Remembered {
            certificate: certs[1].clone(),
            missing_since: None,
        },
    ];
    let first = retention::apply(&previous, &certs[1..2], 3600, now);
    assert_eq!(first.kept, vec![certs[0].clone()]);
    assert_eq!(first.memory[1].missing_since, Some(now));
    let later = retention::apply(&first.memory, &certs[1..2], 3600, now + 1800);
    assert_eq!(
        later.kept,
        vec![certs[0].clone()],
        "still within the window"
    );
    assert_eq!(
        later.memory[1].missing_since,
        Some(now),
        "disappearance time is kept"
    );
    let gone = retention::apply(&later.memory, &certs[1..2], 3600, now + 3600);
    assert!(gone.kept.is_empty());
    // Never past notAfter: the short-lived signer goes when it expires, window or not.
    let short = vec![Remembered {
        certificate: certs[5].clone(),
        missing_since: Some(now),
    }];
    assert!(
        retention::apply(&short, &[], 86400 * 30, certs[5].not_after + 1)
            .kept
            .is_empty()
    );
}
