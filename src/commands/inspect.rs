//! `inspect`: the certificates of a bundle, their validity and the time they have left, as
//! a table for people or JSON for scripts.

use std::io::{self, Write};
use std::path::Path;

use serde::Serialize;

use crate::bundle::Certificate;
use crate::bundle::MAX_SOURCE_BYTES;
use crate::bundle::parse::scan;
use crate::cli::{InspectArgs, OutputFormat};
use crate::commands::{human_span, print_out};
use crate::error::{Exit, UsageError};
use crate::fsutil::{Links, open_regular, read_bounded};
use crate::text::escape;
use crate::text::rfc3339;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Valid,
    Expiring,
    Expired,
    NotYetValid,
}

impl Status {
    pub fn of(certificate: &Certificate, now: i64, warn_within: i64) -> Status {
        if now < certificate.not_before {
            Status::NotYetValid
        } else if certificate.is_expired_at(now) {
            Status::Expired
        } else if certificate.not_after - now <= warn_within {
            Status::Expiring
        } else {
            Status::Valid
        }
    }

    /// Why a certificate with this status makes `inspect` exit 1 (`why` in JSON).
    fn problem(self) -> Option<&'static str> {
        match self {
            Status::Valid => None,
            Status::Expiring => Some("expires_within"),
            Status::Expired => Some("expired"),
            Status::NotYetValid => Some("not_yet_valid"),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Status::Valid => "valid",
            Status::Expiring => "EXPIRING",
            Status::Expired => "EXPIRED",
            Status::NotYetValid => "NOT YET VALID",
        }
    }
}

#[derive(Serialize)]
struct Row {
    block: usize,
    subject_cn: String,
    subject_o: String,
    issuer_cn: String,
    issuer_o: String,
    serial: String,
    sha256: String,
    not_before: String,
    not_after: String,
    seconds_left: i64,
    status: Status,
    is_ca: bool,
}

/// What makes `inspect` exit 1: a certificate that is not valid now or within
/// `--warn-within` (with `subject`, `sha256` and `not_after`), or a broken block.
#[derive(Serialize)]
struct Problem {
    /// `expired`, `not_yet_valid`, `expires_within`, or for a broken block the reason a
    /// source would be rejected for (`malformed_pem`, `private_key`, ...).
    why: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    block: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    subject: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sha256: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    not_after: Option<String>,
    /// The same, for people.
    message: String,
}

#[derive(Serialize)]
struct Report {
    path: String,
    certificates: Vec<Row>,
    problems: Vec<Problem>,
}

pub fn run(args: InspectArgs) -> anyhow::Result<Exit> {
    let input = read_input(&args.path)?;
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let warn_within = args.warn_within.as_secs().try_into().unwrap_or(i64::MAX);
    let scan = scan(&input);
    let broken: Vec<String> = scan.problems.iter().map(ToString::to_string).collect();
    if scan.certificates.is_empty() {
        let why = broken
            .first()
            .map_or("no CERTIFICATE block found".to_string(), Clone::clone);
        return Err(UsageError(format!(
            "{}: holds no certificate: {why}",
            escape(&args.path.display().to_string())
        ))
        .into());
    }
    let rows: Vec<Row> = scan
        .certificates
        .iter()
        .map(|(block, c)| Row {
            block: *block,
            subject_cn: c.subject_cn.clone(),
            subject_o: c.subject_o.clone(),
            issuer_cn: c.issuer_cn.clone(),
            issuer_o: c.issuer_o.clone(),
            serial: c.serial.clone(),
            sha256: c.fingerprint().to_hex(),
            not_before: rfc3339(c.not_before),
            not_after: rfc3339(c.not_after),
            seconds_left: c.not_after - now,
            status: Status::of(c, now, warn_within),
            is_ca: c.is_ca,
        })
        .collect();
    let all_valid = rows.iter().all(|r| r.status == Status::Valid) && broken.is_empty();
    match args.output {
        OutputFormat::Json => {
            let mut problems: Vec<Problem> = rows
                .iter()
                .filter_map(|row| certificate_problem(row, args.warn_within))
                .collect();
            problems.extend(scan.problems.iter().map(|rejection| Problem {
                why: rejection.reason(),
                block: None,
                subject: None,
                sha256: None,
                not_after: None,
                message: rejection.to_string(),
            }));
            let report = Report {
                path: args.path.display().to_string(),
                certificates: rows,
                problems,
            };
            print_out(&format!("{}\n", serde_json::to_string_pretty(&report)?))?;
        }
        OutputFormat::Table => {
            print_out(&table(&rows))?;
            let mut stderr = io::stderr().lock();
            for problem in &broken {
                // A closed stderr loses the line; the exit code still says it.
                let _ = writeln!(stderr, "problem: {}", escape(problem));
            }
        }
    }
    Ok(if all_valid {
        Exit::Success
    } else {
        Exit::Failure
    })
}

/// The problem a certificate's row stands for, if its status is one.
fn certificate_problem(row: &Row, warn_within: std::time::Duration) -> Option<Problem> {
    let why = row.status.problem()?;
    let subject = if row.subject_cn.is_empty() && !row.subject_o.is_empty() {
        format!("O={}", row.subject_o)
    } else {
        row.subject_cn.clone()
    };
    let message = match row.status {
        Status::Expired => format!(
            "{} expired {} ago (notAfter {})",
            escape(&subject),
            human_span(-row.seconds_left),
            row.not_after
        ),
        Status::NotYetValid => format!(
            "{} is not valid before {}",
            escape(&subject),
            row.not_before
        ),
        _ => format!(
            "{} expires in {} (notAfter {}), within --warn-within {}",
            escape(&subject),
            human_span(row.seconds_left),
            row.not_after,
            as_written(warn_within)
        ),
    };
    Some(Problem {
        why,
        block: Some(row.block),
        subject: Some(subject),
        sha256: Some(row.sha256.clone()),
        not_after: Some(row.not_after.clone()),
        message,
    })
}

/// A duration as one would write it on the command line: `60d`, `36h`, `90m`, `45s`.
fn as_written(duration: std::time::Duration) -> String {
    let s = duration.as_secs();
    match s {
        _ if s >= 86400 && s.is_multiple_of(86400) => format!("{}d", s / 86400),
        _ if s >= 3600 && s.is_multiple_of(3600) => format!("{}h", s / 3600),
        _ if s >= 60 && s.is_multiple_of(60) => format!("{}m", s / 60),
        _ => format!("{s}s"),
    }
}

/// The input, read up to the size of the largest source the agent accepts: a bundle larger
/// than that is not one the agent would write, and `/dev/zero` must not grow forever.
/// A path must be a regular file (through links); `-` reads standard input.
fn read_input(path: &Path) -> Result<Vec<u8>, UsageError> {
    let shown = path.display().to_string();
    let name = escape(&shown);
    let unreadable = |e: io::Error| UsageError(format!("cannot read {name}: {e}"));
    let bytes = if path == Path::new("-") {
        read_bounded(io::stdin().lock(), MAX_SOURCE_BYTES).map_err(unreadable)?
    } else {
        match open_regular(path, Links::Follow).map_err(unreadable)? {
            Ok((file, _)) => read_bounded(&file, MAX_SOURCE_BYTES).map_err(unreadable)?,
            Err(kind) => {
                return Err(UsageError(format!(
                    "cannot read {name}: it is {kind}, not a regular file (use - to read standard input)"
                )));
            }
        }
    };
    if bytes.len() > MAX_SOURCE_BYTES {
        return Err(UsageError(format!(
            "{name} is larger than {} MiB: not a bundle (the agent accepts at most that much)",
            MAX_SOURCE_BYTES >> 20
        )));
    }
    Ok(bytes)
}

fn table(rows: &[Row]) -> String {
    let header = [
        "SUBJECT",
        "ISSUER",
        "SERIAL",
        "SHA-256",
        "NOT BEFORE (UTC)",
        "NOT AFTER (UTC)",
        "TIME LEFT",
        "STATUS",
    ];
    let cells: Vec<[String; 8]> = rows
        .iter()
        .map(|r| {
            let mut status = r.status.label().to_string();
            if !r.is_ca {
                status.push_str(" (not a CA)");
            }
            [
                name(&r.subject_cn, &r.subject_o),
                name(&r.issuer_cn, &r.issuer_o),
                shorten(&escape(&r.serial), 20),
                format!("{}…", &r.sha256[..12]),
                r.not_before
                    .replace('T', " ")
                    .trim_end_matches('Z')
                    .to_string(),
                r.not_after
                    .replace('T', " ")
                    .trim_end_matches('Z')
                    .to_string(),
                human_span(r.seconds_left),
                status,
            ]
        })
        .collect();
    let mut widths = header.map(|h| h.chars().count());
    for row in &cells {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cols: &[String]| {
        let padded: Vec<String> = cols
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(padded.join("  ").trim_end());
        out.push('\n');
    };
    line(&header.map(String::from));
    for row in &cells {
        line(row);
    }
    out
}

fn name(cn: &str, o: &str) -> String {
    match (cn.is_empty(), o.is_empty()) {
        (false, _) => shorten(&escape(cn), 48),
        (true, false) => shorten(&escape(&format!("O={o}")), 48),
        (true, true) => "-".to_string(),
    }
}

fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let head: String = s.chars().take(max - 1).collect();
        format!("{head}…")
    }
}
