//! `parse_source` never panics; whatever it accepts renders to a canonical bundle that
//! parses back to the same certificates and renders byte-identically (a fixed point).

#![no_main]

mod common;

use std::collections::HashSet;

use kubelet_ca_agent::bundle::{Bundle, Fingerprint, parse_source};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let parsed = match parse_source(data) {
        Ok(parsed) => parsed,
        Err(rejection) => return common::check_rejection(&rejection),
    };

    // The bundle keeps the first occurrence of each fingerprint, in source order.
    let mut seen = HashSet::new();
    let expected: Vec<Fingerprint> = parsed
        .certificates
        .iter()
        .map(|c| c.fingerprint())
        .filter(|f| seen.insert(*f))
        .collect();

    let rendered = Bundle::from_certificates(parsed.certificates).render();
    check_canonical_pem(&rendered);
    if expected.is_empty() {
        // Only non-CA certificates: nothing to render, and empty content is rejected.
        assert!(rendered.is_empty(), "an empty bundle renders to something");
        return;
    }

    let reparsed = parse_source(&rendered)
        .unwrap_or_else(|r| panic!("the rendered bundle is rejected: {r}"));
    let fingerprints: Vec<Fingerprint> =
        reparsed.certificates.iter().map(|c| c.fingerprint()).collect();
    assert_eq!(fingerprints, expected, "the rendered bundle holds other certificates");
    assert!(reparsed.not_ca.is_empty(), "the rendered bundle holds a non-CA");

    let rerendered = Bundle::from_certificates(reparsed.certificates).render();
    assert!(rerendered == rendered, "render is not a fixed point");
});

/// Every line of a rendered bundle is a CERTIFICATE armor line or at most 64 base64
/// characters, each ending in LF. No other label (so no PRIVATE KEY) can appear. "PRIVATE" is
/// looked for outside the base64 bodies only: seven base64 characters may spell it by chance.
fn check_canonical_pem(rendered: &[u8]) {
    let Some(text) = rendered.strip_suffix(b"\n") else {
        assert!(rendered.is_empty(), "no final LF");
        return;
    };
    let mut inside = false;
    for line in text.split(|&b| b == b'\n') {
        match line {
            b"-----BEGIN CERTIFICATE-----" if !inside => inside = true,
            b"-----END CERTIFICATE-----" if inside => inside = false,
            body if inside => {
                assert!(
                    !body.is_empty()
                        && body.len() <= 64
                        && body
                            .iter()
                            .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(b)),
                    "rendered body line is not base64: {:?}",
                    String::from_utf8_lossy(body)
                );
            }
            other => panic!(
                "unexpected rendered line: {:?}",
                String::from_utf8_lossy(other)
            ),
        }
        if !inside || line.starts_with(b"-----") {
            assert!(!contains(line, b"PRIVATE"), "PRIVATE outside a base64 body");
        }
    }
    assert!(!inside, "rendered bundle ends inside a block");
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
