//! `scan` never panics, its problems stay short, and it agrees with `parse_source`: the
//! strict parse accepts exactly the inputs (within the size limit) in which the lenient
//! scan finds certificates and no problem, and then both see the same certificates in the same blocks.

#![no_main]

mod common;

use kubelet_ca_agent::bundle::parse::scan;
use kubelet_ca_agent::bundle::{Fingerprint, MAX_SOURCE_BYTES, parse_source};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let scanned = scan(data);
    scanned.problems.iter().for_each(common::check_rejection);
    let blocks: Vec<usize> = scanned.certificates.iter().map(|(b, _)| *b).collect();
    assert!(
        blocks.first() != Some(&0) && blocks.windows(2).all(|w| w[0] < w[1]),
        "block indexes are not 1-based and increasing: {blocks:?}"
    );

    let strict = parse_source(data);
    let clean = data.len() <= MAX_SOURCE_BYTES
        && scanned.problems.is_empty()
        && !scanned.certificates.is_empty();
    let parsed = match strict {
        Ok(parsed) => parsed,
        Err(rejection) => {
            common::check_rejection(&rejection);
            assert!(!clean, "parse_source rejects what scan reads cleanly: {rejection}");
            return;
        }
    };
    assert!(clean, "parse_source accepts what scan has problems with");

    let (ca, not_ca): (Vec<_>, Vec<_>) = scanned.certificates.iter().partition(|(_, c)| c.is_ca);
    let ca: Vec<Fingerprint> = ca.iter().map(|(_, c)| c.fingerprint()).collect();
    let not_ca: Vec<(usize, Fingerprint)> =
        not_ca.iter().map(|(b, c)| (*b, c.fingerprint())).collect();
    let parsed_ca: Vec<Fingerprint> = parsed.certificates.iter().map(|c| c.fingerprint()).collect();
    let parsed_not_ca: Vec<(usize, Fingerprint)> = parsed
        .not_ca
        .iter()
        .map(|s| (s.block, s.certificate.fingerprint()))
        .collect();
    assert_eq!(ca, parsed_ca, "CA certificates differ between scan and parse_source");
    assert_eq!(not_ca, parsed_not_ca, "non-CA certificates differ");
});
