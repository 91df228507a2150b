//! From a source's bytes to certificates, strictly. A source update is accepted whole or
//! rejected whole (SPEC 4.2): one bad block means the producer is broken, and keeping its
//! last good content is safer than guessing which parts of the new one to trust.
//!
//! The framing is done here, by the armor lines, rather than by `pem::parse_many`, because
//! that function silently skips a trailing block that has no END line: exactly the torn file
//! the kubelet itself mis-reads. Having framed the lines, the payload goes straight to
//! `base64` (strict RFC 7468 form: no headers in a CERTIFICATE block).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use super::certificate::{Certificate, CertificateError, PEM_BEGIN, PEM_COLUMNS, PEM_END};

/// Larger source content is rejected before it is parsed.
pub const MAX_SOURCE_BYTES: usize = 4 * 1024 * 1024;

const BEGIN: &[u8] = b"-----BEGIN ";
const END: &[u8] = b"-----END ";
const DASHES: &[u8] = b"-----";

/// Why a source's content was rejected. Block indexes and lines are 1-based. No variant
/// carries any of the rejected bytes, so a rejection is safe to log and to show.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("content is {size} bytes, more than the {limit}-byte limit")]
    TooLarge { size: usize, limit: usize },
    #[error("PEM block {block} (line {line}): {problem}")]
    MalformedPem {
        block: usize,
        line: usize,
        problem: String,
    },
    #[error(
        "PEM block {block} (line {line}) is a {label}, not a CERTIFICATE: private keys must never reach a CA bundle"
    )]
    PrivateKey {
        block: usize,
        line: usize,
        label: String,
    },
    #[error("PEM block {block} (line {line}) is a {label}, not a CERTIFICATE")]
    NotCertificate {
        block: usize,
        line: usize,
        label: String,
    },
    #[error("PEM block {block} (line {line}): {error}")]
    UnparsableCertificate {
        block: usize,
        line: usize,
        error: CertificateError,
    },
    #[error("no CERTIFICATE block found")]
    NoCertificate,
}

impl Rejection {
    /// The `reason` label of `kubelet_ca_source_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Rejection::TooLarge { .. } => "too_large",
            Rejection::MalformedPem { .. } => "malformed_pem",
            Rejection::PrivateKey { .. } => "private_key",
            Rejection::NotCertificate { .. } => "not_certificate",
            Rejection::UnparsableCertificate { .. } => "unparsable_certificate",
            Rejection::NoCertificate => "no_certificate",
        }
    }
}

/// One framed PEM block: BEGIN line through END line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block<'a> {
    /// 1-based position among the blocks of the input.
    pub index: usize,
    /// 1-based line of the BEGIN line.
    pub line: usize,
    /// The label, made safe to print.
    pub label: String,
    /// The bytes from the BEGIN line through the END line.
    pub text: &'a [u8],
}

/// The lines of `input`, each with its LF (the last may have none), as
/// `split_inclusive(|&b| b == b'\n')` gives them, found with a vectorized search.
struct Lines<'a>(&'a [u8]);

impl<'a> Iterator for Lines<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.0.is_empty() {
            return None;
        }
        let end = memchr::memchr(b'\n', self.0).map_or(self.0.len(), |i| i + 1);
        let (line, rest) = self.0.split_at(end);
        self.0 = rest;
        Some(line)
    }
}

/// The lines of `input` that start with `-----` once trimmed: armor lines, or broken ones.
/// Every other line is payload or text between blocks, which framing passes over; a
/// vectorized search for the dashes passes over them without looking at each line.
struct DashLines<'a> {
    input: &'a [u8],
    /// Where the next line starts.
    pos: usize,
    /// Line feeds before `pos`.
    newlines: usize,
    dashes: memchr::memmem::Finder<'static>,
}

impl<'a> DashLines<'a> {
    fn new(input: &'a [u8]) -> Self {
        DashLines {
            input,
            pos: 0,
            newlines: 0,
            dashes: memchr::memmem::Finder::new(DASHES),
        }
    }
}

impl<'a> Iterator for DashLines<'a> {
    /// (1-based line number, the line with its LF if it has one, its offset in the input).
    type Item = (usize, &'a [u8], usize);

    fn next(&mut self) -> Option<Self::Item> {
        let input = self.input;
        loop {
            let at = self.pos + self.dashes.find(&input[self.pos..])?;
            let start =
                memchr::memrchr(b'\n', &input[self.pos..at]).map_or(self.pos, |i| self.pos + i + 1);
            let end = memchr::memchr(b'\n', &input[at..]).map_or(input.len(), |i| at + i + 1);
            let before = memchr::memchr_iter(b'\n', &input[self.pos..start]).count();
            let line_no = self.newlines + before + 1;
            self.newlines += before + usize::from(input[end - 1] == b'\n');
            self.pos = end;
            // Dashes after text on the same line do not make an armor line.
            if input[start..at].iter().all(u8::is_ascii_whitespace) {
                return Some((line_no, &input[start..end], start));
            }
        }
    }
}

/// Frames `input` into PEM blocks. Text outside blocks is ignored. Returns the blocks that
/// framed cleanly and, when framing stopped early, why.
pub fn frame(input: &[u8]) -> (Vec<Block<'_>>, Option<Rejection>) {
    let mut blocks = Vec::new();
    // (index, line, label, start offset) of the block being read.
    let mut open: Option<(usize, usize, String, usize)> = None;
    // Only the lines that start with dashes can open, close or break a block.
    for (line_no, raw, start) in DashLines::new(input) {
        let line = raw.trim_ascii();
        let offset = start + raw.len();
        let is_begin = line.starts_with(BEGIN);
        let is_end = line.starts_with(END);
        match open.take() {
            None if is_begin => match armor_label(line, BEGIN).map(printable_label) {
                Some(label) => open = Some((blocks.len() + 1, line_no, label, start)),
                None => {
                    let problem = "the BEGIN line is cut short or has text around it";
                    let rejection = malformed(blocks.len() + 1, line_no, problem);
                    return (blocks, Some(rejection));
                }
            },
            None if is_end => {
                let problem = "an END line with no BEGIN line before it";
                let rejection = malformed(blocks.len() + 1, line_no, problem);
                return (blocks, Some(rejection));
            }
            // Every line here starts with dashes (DashLines): a torn BEGIN line ("-----BEG")
            // must not pass as text between blocks.
            None => {
                let problem = "a line starting with ----- is not a complete BEGIN or END line";
                let rejection = malformed(blocks.len() + 1, line_no, problem);
                return (blocks, Some(rejection));
            }
            Some((index, line, _, _)) if is_begin => {
                let problem = format!("no END line before the next BEGIN at line {line_no}");
                return (blocks, Some(malformed(index, line, &problem)));
            }
            Some((index, begin_line, label, block_start)) if is_end => {
                match armor_label(line, END) {
                    // A label is ASCII: its bytes compare as its text.
                    Some(end_label) if end_label == label.as_bytes() => blocks.push(Block {
                        index,
                        line: begin_line,
                        label,
                        text: &input[block_start..offset],
                    }),
                    Some(end_label) => {
                        let end_label = printable_label(end_label);
                        let problem = format!("BEGIN {label} is closed by END {end_label}");
                        return (blocks, Some(malformed(index, begin_line, &problem)));
                    }
                    None => {
                        let problem = format!("the END line at line {line_no} is cut short");
                        return (blocks, Some(malformed(index, begin_line, &problem)));
                    }
                }
            }
            // The input ends in a torn END line ("-----EN"): truncated, said below.
            still_open if offset == input.len() => open = still_open,
            // Base64 has no dashes: this line is a broken armor line, not payload.
            Some((index, begin_line, _, _)) => {
                let problem = format!(
                    "line {line_no} starts with ----- inside the block but is not its END line"
                );
                return (blocks, Some(malformed(index, begin_line, &problem)));
            }
        }
    }
    if let Some((index, line, _, _)) = open {
        let problem = "no END line: the content is truncated";
        return (blocks, Some(malformed(index, line, problem)));
    }
    (blocks, None)
}

/// Decodes one framed block into a certificate. Non-certificate labels are refused before
/// any of their content is decoded.
pub fn decode_certificate(block: &Block<'_>) -> Result<Certificate, Rejection> {
    decode_with(block, &mut Scratch::default())
}

/// Buffers for decoding blocks, reused from one block to the next.
#[derive(Default)]
struct Scratch {
    payload: Vec<u8>,
    der: Vec<u8>,
}

/// [`decode_certificate`], with buffers that outlive the block.
///
/// The common case splits no line: a block in canonical form (what [`Bundle::render`]
/// writes) has its payload lines at fixed places, and is kept as the certificate's PEM.
/// Other blocks have their payload lines trimmed and decoded. Whatever does not decode
/// goes through [`decode_strictly`], which names the problem.
///
/// [`Bundle::render`]: super::Bundle::render
fn decode_with(block: &Block<'_>, scratch: &mut Scratch) -> Result<Certificate, Rejection> {
    if block.label != "CERTIFICATE" {
        return decode_strictly(block);
    }
    let Scratch { payload, der } = scratch;
    payload.clear();
    // The standard engine accepts only canonical base64 (padding, trailing bits), so a
    // block of canonical shape whose payload decodes is exactly the canonical PEM of `der`.
    if canonical_shape(block.text, payload) && decode_into(payload, der) {
        // The last block of a file may lack its final newline.
        let newline = !block.text.ends_with(b"\n");
        let mut pem = Vec::with_capacity(block.text.len() + usize::from(newline));
        pem.extend_from_slice(block.text);
        if newline {
            pem.push(b'\n');
        }
        return certificate(block, der, Some(pem));
    }
    payload.clear();
    let lines = Lines(block.text).map(<[u8]>::trim_ascii);
    for line in lines.skip(1).take_while(|l| !l.starts_with(END)) {
        payload.extend_from_slice(line);
    }
    // A payload that decodes held neither a header's ':' nor whitespace (neither is base64),
    // so the strict path would have decoded the same bytes.
    if decode_into(payload, der) {
        return certificate(block, der, None);
    }
    decode_strictly(block)
}

/// Whether `text` has the shape of a canonical block: the exact armor lines, and payload
/// lines of 64 characters but the last (1 to 64), each ending LF. If so, the payload lines
/// are appended to `payload`; whether they are base64 is left to the decoder.
fn canonical_shape(text: &[u8], payload: &mut Vec<u8>) -> bool {
    let end_line = &PEM_END[..PEM_END.len() - 1];
    let Some(body) = text.strip_prefix(PEM_BEGIN) else {
        return false;
    };
    let body = body.strip_suffix(b"\n").unwrap_or(body);
    let Some(lines) = body.strip_suffix(end_line) else {
        return false;
    };
    if lines.is_empty() {
        return false;
    }
    for chunk in lines.chunks(PEM_COLUMNS + 1) {
        match chunk.split_last() {
            Some((b'\n', line)) if !line.is_empty() => payload.extend_from_slice(line),
            _ => return false,
        }
    }
    true
}

/// Decodes `payload` into `der`; false when it is not base64 or holds nothing.
fn decode_into(payload: &[u8], der: &mut Vec<u8>) -> bool {
    der.clear();
    STANDARD.decode_vec(payload, der).is_ok() && !der.is_empty()
}

fn certificate(
    block: &Block<'_>,
    der: &[u8],
    pem: Option<Vec<u8>>,
) -> Result<Certificate, Rejection> {
    Certificate::from_der_and_pem(der, pem).map_err(|error| Rejection::UnparsableCertificate {
        block: block.index,
        line: block.line,
        error,
    })
}

/// Decodes one block the plain way, line by line: the reference for [`decode_with`], and
/// what names the problem in a block that is not a certificate or does not decode.
fn decode_strictly(block: &Block<'_>) -> Result<Certificate, Rejection> {
    if block.label != "CERTIFICATE" {
        let (index, line, label) = (block.index, block.line, block.label.clone());
        return Err(if block.label.contains("PRIVATE KEY") {
            Rejection::PrivateKey {
                block: index,
                line,
                label,
            }
        } else {
            Rejection::NotCertificate {
                block: index,
                line,
                label,
            }
        });
    }
    let malformed_payload = |problem: &str| malformed(block.index, block.line, problem);
    // Every line between the armor lines is base64; RFC 7468 allows no headers here.
    let lines = block.text.split(|&b| b == b'\n').map(<[u8]>::trim_ascii);
    let payload_lines = lines.skip(1).take_while(|l| !l.starts_with(END));
    let mut payload = Vec::with_capacity(block.text.len());
    for line in payload_lines {
        if line.contains(&b':') {
            return Err(malformed_payload(
                "PEM headers are not allowed in a CERTIFICATE block",
            ));
        }
        if line.iter().any(u8::is_ascii_whitespace) {
            payload.extend(line.iter().filter(|b| !b.is_ascii_whitespace()));
        } else {
            payload.extend_from_slice(line);
        }
    }
    let der = STANDARD
        .decode(&payload)
        .map_err(|_| malformed_payload("the base64 payload does not decode"))?;
    if der.is_empty() {
        return Err(malformed_payload("the block is empty"));
    }
    Certificate::from_der(&der).map_err(|error| Rejection::UnparsableCertificate {
        block: block.index,
        line: block.line,
        error,
    })
}

/// A certificate that parsed but was left out of the bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The source it came from (`None` when parsed on its own, as `inspect` does).
    pub source: Option<String>,
    /// Which part of the source: a file of a `dir:` source, a key of a ConfigMap (`None`
    /// for a source of one part).
    pub part: Option<String>,
    /// Its block index within that part.
    pub block: usize,
    pub certificate: Certificate,
}

impl Skipped {
    /// Where it is, for a message: `file:/x.pem block 2`, `dir:/d (/d/b.crt) block 1`.
    pub fn place(&self) -> String {
        let mut place = String::new();
        if let Some(source) = &self.source {
            place.push_str(source);
            place.push(' ');
        }
        if let Some(part) = &self.part {
            place.push_str(&format!("({part}) "));
        }
        place.push_str(&format!("block {}", self.block));
        place
    }
}

/// The accepted content of one source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceCertificates {
    /// CA certificates, in source order (duplicates included; the merge removes them).
    pub certificates: Vec<Certificate>,
    /// Certificates that are not CAs: the kubelet cannot verify a client with them.
    pub not_ca: Vec<Skipped>,
}

/// Parses a source's whole content, accepting it or rejecting it as a whole (SPEC 4.2, 4.3).
pub fn parse_source(input: &[u8]) -> Result<SourceCertificates, Rejection> {
    if input.len() > MAX_SOURCE_BYTES {
        return Err(Rejection::TooLarge {
            size: input.len(),
            limit: MAX_SOURCE_BYTES,
        });
    }
    let (blocks, framing_error) = frame(input);
    if let Some(rejection) = framing_error {
        return Err(rejection);
    }
    if blocks.is_empty() {
        return Err(Rejection::NoCertificate);
    }
    let mut parsed = SourceCertificates::default();
    let mut scratch = Scratch::default();
    for block in &blocks {
        let certificate = decode_with(block, &mut scratch)?;
        if certificate.is_ca {
            parsed.certificates.push(certificate);
        } else {
            parsed.not_ca.push(Skipped {
                source: None,
                part: None,
                block: block.index,
                certificate,
            });
        }
    }
    Ok(parsed)
}

fn malformed(block: usize, line: usize, problem: &str) -> Rejection {
    Rejection::MalformedPem {
        block,
        line,
        problem: problem.to_string(),
    }
}

/// The label of a well-formed armor line `-----BEGIN LABEL-----`: printable ASCII.
fn armor_label<'a>(line: &'a [u8], prefix: &[u8]) -> Option<&'a [u8]> {
    let inner = line.strip_prefix(prefix)?.strip_suffix(DASHES)?;
    if inner.is_empty() || inner.len() > 64 || inner.starts_with(b"-") || inner.ends_with(b"-") {
        return None;
    }
    if !inner.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        return None;
    }
    Some(inner)
}

fn printable_label(label: &[u8]) -> String {
    String::from_utf8_lossy(label).into_owned()
}

/// Everything readable in an input that may be broken: the certificates that decode and
/// the problems met. For showing a file (`inspect`, `sync --dry-run`), never for accepting
/// a source.
#[derive(Debug, Default)]
pub struct Scan {
    /// (block index, certificate), in file order.
    pub certificates: Vec<(usize, Certificate)>,
    pub problems: Vec<Rejection>,
}

pub fn scan(input: &[u8]) -> Scan {
    let (blocks, framing_error) = frame(input);
    let mut scan = Scan::default();
    let mut scratch = Scratch::default();
    for block in &blocks {
        match decode_with(block, &mut scratch) {
            Ok(certificate) => scan.certificates.push((block.index, certificate)),
            Err(problem) => scan.problems.push(problem),
        }
    }
    scan.problems.extend(framing_error);
    scan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reject(input: &str) -> Rejection {
        parse_source(input.as_bytes()).unwrap_err()
    }

    #[test]
    fn text_without_blocks_has_no_certificate() {
        assert_eq!(reject(""), Rejection::NoCertificate);
        assert_eq!(reject("hello\nworld\n"), Rejection::NoCertificate);
        assert_eq!(
            reject("---- not quite armor ----\n"),
            Rejection::NoCertificate
        );
    }

    #[test]
    fn a_private_key_is_refused_without_decoding_it() {
        // The payload is not even base64: the label alone decides, and nothing is echoed.
        let input =
            "-----BEGIN EC PRIVATE KEY-----\nsecret-material\n-----END EC PRIVATE KEY-----\n";
        let rejection = reject(input);
        assert_eq!(rejection.reason(), "private_key");
        assert!(!rejection.to_string().contains("secret-material"));
        assert!(rejection.to_string().contains("block 1 (line 1)"));
    }

    #[test]
    fn other_labels_are_not_certificates() {
        let input =
            "-----BEGIN TRUSTED CERTIFICATE-----\nMAA=\n-----END TRUSTED CERTIFICATE-----\n";
        assert_eq!(reject(input).reason(), "not_certificate");
    }

    #[test]
    fn framing_errors_name_block_and_line() {
        let cases = [
            (
                "x\n-----BEGIN CERTIFICATE-----\nMAA=\n",
                "PEM block 1 (line 2): no END line: the content is truncated",
            ),
            (
                "-----END CERTIFICATE-----\n",
                "PEM block 1 (line 1): an END line with no BEGIN line before it",
            ),
            (
                "-----BEGIN CERTIFICATE-----\nMAA=\n-----BEGIN CERTIFICATE-----\n",
                "PEM block 1 (line 1): no END line before the next BEGIN at line 3",
            ),
            (
                "-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERT",
                "PEM block 1 (line 1): the END line at line 3 is cut short",
            ),
            (
                "-----BEGIN CERTIFICATE-----\nMAA=\n-----END X509 CRL-----\n",
                "PEM block 1 (line 1): BEGIN CERTIFICATE is closed by END X509 CRL",
            ),
            (
                "-----BEGIN CERT",
                "PEM block 1 (line 1): the BEGIN line is cut short or has text around it",
            ),
            (
                "-----BE",
                "PEM block 1 (line 1): a line starting with ----- is not a complete BEGIN or END line",
            ),
            (
                "-----BEGIN CERTIFICATE-----\nMAA=\n-----EN",
                "PEM block 1 (line 1): no END line: the content is truncated",
            ),
            (
                "-----BEGIN CERTIFICATE-----\nMAA=\n  -----BOGUS-----\n-----END CERTIFICATE-----\n",
                "PEM block 1 (line 1): line 3 starts with ----- inside the block but is not its END line",
            ),
        ];
        for (input, message) in cases {
            assert_eq!(reject(input).to_string(), message, "{input:?}");
            assert_eq!(reject(input).reason(), "malformed_pem");
        }
    }

    #[test]
    fn undecodable_payloads_are_malformed() {
        let input = "-----BEGIN CERTIFICATE-----\n!!!not base64!!!\n-----END CERTIFICATE-----\n";
        let rejection = reject(input);
        assert_eq!(rejection.reason(), "malformed_pem");
        assert!(!rejection.to_string().contains("not base64"));
    }

    #[test]
    fn an_empty_block_is_malformed_and_says_so() {
        for input in [
            "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
            "-----BEGIN CERTIFICATE-----\n  \n-----END CERTIFICATE-----\n",
        ] {
            assert_eq!(
                reject(input).to_string(),
                "PEM block 1 (line 1): the block is empty",
                "{input:?}"
            );
        }
    }

    #[test]
    fn a_decodable_payload_that_is_not_x509_is_unparsable() {
        let input = "-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n";
        assert_eq!(reject(input).reason(), "unparsable_certificate");
    }

    #[test]
    fn oversized_content_is_refused_before_parsing() {
        let input = vec![b'a'; MAX_SOURCE_BYTES + 1];
        assert_eq!(
            parse_source(&input).unwrap_err(),
            Rejection::TooLarge {
                size: MAX_SOURCE_BYTES + 1,
                limit: MAX_SOURCE_BYTES
            }
        );
    }

    #[test]
    fn scan_keeps_what_is_readable_and_lists_the_rest() {
        let input = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n-----BEGIN CERTIFICATE-----\nMAA=\n";
        let scan = scan(input.as_bytes());
        assert!(scan.certificates.is_empty());
        let reasons: Vec<_> = scan.problems.iter().map(Rejection::reason).collect();
        assert_eq!(reasons, ["private_key", "malformed_pem"]);
    }
}

#[cfg(test)]
mod limit_and_armor_tests {
    use super::*;
    use crate::bundle::Bundle;
    use crate::bundle::test_certs::{ca, now};

    /// SPEC 4.2's limit, written out: a source of this size is still read.
    const FOUR_MIB: usize = 4 * 1024 * 1024;

    fn signer_pem() -> (Certificate, Vec<u8>) {
        let now = now();
        let certificate = ca(Some("signer"), None, now - 60, now + 3600);
        let pem = Bundle::from_certificates([certificate.clone()]).render();
        (certificate, pem)
    }

    #[test]
    fn a_source_of_exactly_four_mib_is_read_and_one_byte_more_is_refused() {
        let (certificate, mut input) = signer_pem();
        let line = [vec![b'#'; 1023], vec![b'\n']].concat();
        while input.len() + line.len() <= FOUR_MIB {
            input.extend_from_slice(&line);
        }
        input.resize(FOUR_MIB, b'#');
        let parsed = parse_source(&input).unwrap();
        assert_eq!(parsed.certificates, [certificate]);
        input.push(b'#');
        assert_eq!(
            parse_source(&input).unwrap_err(),
            Rejection::TooLarge {
                size: FOUR_MIB + 1,
                limit: FOUR_MIB
            }
        );
    }

    #[test]
    fn an_armor_line_needs_a_short_printable_label_without_outer_dashes() {
        let long = "A".repeat(64);
        let too_long = "A".repeat(65);
        let cases: [(String, Option<&str>); 9] = [
            ("-----BEGIN CERTIFICATE-----".into(), Some("CERTIFICATE")),
            (
                "-----BEGIN EC PRIVATE KEY-----".into(),
                Some("EC PRIVATE KEY"),
            ),
            (format!("-----BEGIN {long}-----"), Some(&long)),
            (format!("-----BEGIN {too_long}-----"), None),
            ("-----BEGIN -----".into(), None),
            ("-----BEGIN -CERTIFICATE-----".into(), None),
            ("-----BEGIN CERTIFICATE------".into(), None),
            ("-----BEGIN CERT\u{7}IFICATE-----".into(), None),
            ("-----BEGIN CERT\tIFICATE-----".into(), None),
        ];
        for (line, label) in cases {
            assert_eq!(
                armor_label(line.as_bytes(), BEGIN),
                label.map(str::as_bytes),
                "{line:?}"
            );
        }
    }

    #[test]
    fn a_blank_line_before_the_end_line_is_not_written_back() {
        // The block decodes, but is not canonical: the bundle holds the canonical form.
        // A blank line after a full last line (64 characters: a DER of 48n bytes) looks
        // most like a canonical block; a common name of the right length makes one.
        let now = now();
        let (certificate, text) = (0..200)
            .map(|n| {
                let certificate = ca(Some(&"s".repeat(1 + n)), None, now - 60, now + 3600);
                let pem = Bundle::from_certificates([certificate.clone()]).render();
                (certificate, String::from_utf8(pem).unwrap())
            })
            .find(|(_, text)| text.lines().rev().nth(1).unwrap().len() == 64)
            .expect("a DER of 48n bytes");
        let blank = text.replace("\n-----END", "\n\n-----END");
        assert_ne!(blank, text);
        let parsed = parse_source(blank.as_bytes()).unwrap().certificates;
        assert_eq!(parsed, [certificate]);
        assert_eq!(
            String::from_utf8(Bundle::from_certificates(parsed).render()).unwrap(),
            text
        );
    }

    #[test]
    fn blanks_inside_a_base64_line_are_ignored() {
        let (certificate, pem) = signer_pem();
        let text = String::from_utf8(pem).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        lines[1].insert(10, ' ');
        lines[1].insert(20, '\t');
        let spaced = lines.join("\n") + "\n";
        assert_eq!(
            parse_source(spaced.as_bytes()).unwrap().certificates,
            [certificate]
        );
    }
}
