//! Exit codes (SPEC 3) and the one error type callers branch on at the top: usage errors.

/// The process exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Written, already in sync, or nothing to report.
    Success = 0,
    /// A runtime failure: a source unreachable or invalid, a write that failed; for
    /// `inspect`, a certificate that is not valid (now, or within `--warn-within`).
    Failure = 1,
    /// A usage or configuration error; for `inspect`, input unreadable or without certificate.
    Usage = 2,
}

/// A usage or configuration error: the command line or environment asks for something the
/// agent cannot do. Exits 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Maps an error from `run` to its exit code.
pub fn exit_code_for(error: &anyhow::Error) -> Exit {
    if error.is::<UsageError>() || error.is::<clap::Error>() {
        Exit::Usage
    } else {
        Exit::Failure
    }
}
