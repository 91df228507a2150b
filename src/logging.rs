//! Logs go to stderr through `tracing`, as text or JSON. `RUST_LOG`, when set, wins over
//! `--log-level` so that one noisy module can be turned up without touching the unit file.

use tracing_subscriber::EnvFilter;

use crate::error::UsageError;
use crate::text::EscapingWriter;

/// How log lines are written on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// The levels a log level may name.
const LEVELS: &[&str] = &["error", "warn", "info", "debug", "trace", "off"];

/// Reads `--log-level`: a level (any case; `warning` is `warn`), or comma-separated
/// directives `[TARGET=]LEVEL` each with a known level. Anything else is refused: a filter
/// that does not parse as intended (`debg`, `bogus`) would silence every line, errors
/// included, where tracing reads a bare unknown word as a target name.
pub fn parse_level(value: &str) -> Result<String, String> {
    let level = |word: &str| {
        let word = word.trim().to_ascii_lowercase();
        let word = if word == "warning" {
            "warn".to_string()
        } else {
            word
        };
        LEVELS.contains(&word.as_str()).then_some(word)
    };
    let mut directives = Vec::new();
    for directive in value.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let normal = match directive.rsplit_once('=') {
            Some((target, lvl)) if !target.trim().is_empty() => {
                level(lvl).map(|lvl| format!("{}={lvl}", target.trim()))
            }
            Some(_) => None,
            None => level(directive),
        };
        directives.push(normal.ok_or_else(|| {
            format!(
                "{directive:?} is not a log level: use one of error, warn (or warning), info, debug, trace, off, or TARGET=LEVEL directives"
            )
        })?);
    }
    if directives.is_empty() {
        return Err("is empty: use one of error, warn, info, debug, trace, off".to_string());
    }
    Ok(directives.join(","))
}

/// kube-rs logs every failed request at ERROR, with no word of which server or why (`failed
/// with error client error (Connect)`); the agent says both itself, once per change of
/// state. Unless the directives speak of kube-rs, that line is off.
const KUBE_REQUEST_LOG: &str = "kube_client::client::builder=off";

pub fn init(format: LogFormat, level: &str) -> Result<(), UsageError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => EnvFilter::try_new(directives)
            .map_err(|e| UsageError(format!("RUST_LOG does not parse: {e}")))?,
        _ => {
            let directives = if level.contains("kube") {
                level.to_string()
            } else {
                format!("{level},{KUBE_REQUEST_LOG}")
            };
            EnvFilter::try_new(&directives)
                .map_err(|e| UsageError(format!("--log-level {level:?} does not parse: {e}")))?
        }
    };
    // A log line that cannot be written (stderr closed: a pipe whose reader went away) is
    // lost, and nothing more: tracing would otherwise report it with `eprintln!`, which
    // panics on that same stderr, and the daemon would stop keeping the file correct.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .log_internal_errors(false);
    match format {
        // Logged values come from outside (subjects, file names, API errors): the text
        // format escapes control characters in each line, and so has no colours of its own.
        LogFormat::Text => builder
            .with_ansi(false)
            .with_writer(|| EscapingWriter(std::io::stderr()))
            .init(),
        // JSON escapes them itself.
        LogFormat::Json => builder
            .with_writer(std::io::stderr)
            .json()
            .flatten_event(true)
            .init(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_levels_are_read_in_any_case_and_unknown_ones_refused() {
        assert_eq!(parse_level("info").unwrap(), "info");
        assert_eq!(parse_level("WARNING").unwrap(), "warn");
        assert_eq!(parse_level("Warn").unwrap(), "warn");
        assert_eq!(
            parse_level("info, kubelet_ca_agent=Debug").unwrap(),
            "info,kubelet_ca_agent=debug"
        );
        for bad in ["debg", "bogus", "", "info,kube=loud", "=info"] {
            let why = parse_level(bad).unwrap_err();
            assert!(why.contains("error, warn"), "{bad:?}: {why}");
        }
    }
}
