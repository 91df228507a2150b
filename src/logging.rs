//! Logs go to stderr through `tracing`, as text or JSON. `RUST_LOG`, when set, wins over
//! `--log-level` so that one noisy module can be turned up without touching the unit file.

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

use crate::error::UsageError;
use crate::text::EscapingWriter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

pub fn init(format: LogFormat, level: &str) -> Result<(), UsageError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => EnvFilter::try_new(directives)
            .map_err(|e| UsageError(format!("RUST_LOG does not parse: {e}")))?,
        _ => EnvFilter::try_new(level)
            .map_err(|e| UsageError(format!("--log-level {level:?} does not parse: {e}")))?,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false);
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
