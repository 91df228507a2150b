//! Logs go to stderr through `tracing`, as text or JSON. `RUST_LOG`, when set, wins over
//! `--log-level` so that one noisy module can be turned up without touching the unit file.

use std::io::IsTerminal;

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

use crate::error::UsageError;

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
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    Ok(())
}
