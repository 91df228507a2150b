//! The one-shot commands. Each takes its parsed arguments and returns the exit code, or an
//! error that `main` prints as one line.

pub mod drift;
pub mod inspect;
pub mod rollout;
pub mod sync;

use crate::error::Exit;

pub fn version() -> anyhow::Result<Exit> {
    print_out(&format!("kubelet-ca-agent {}\n", env!("CARGO_PKG_VERSION")))?;
    Ok(Exit::Success)
}

/// Writes `text` to standard output. A reader that went away (`inspect -o json | head -1`)
/// is not an error: the rest of the output is dropped quietly and the command exits with
/// its own code, as Unix tools do. Any other failure (a full disk behind `>`) is one.
pub fn print_out(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(anyhow::anyhow!("cannot write to standard output: {e}")),
        Ok(()) => Ok(()),
    }
}

/// A signed span of seconds for humans: `89d 3h`, `5h 2m`, `-2d 4h`.
pub fn human_span(seconds: i64) -> String {
    let sign = if seconds < 0 { "-" } else { "" };
    let s = seconds.unsigned_abs();
    let (d, h, m) = (s / 86400, (s % 86400) / 3600, (s % 3600) / 60);
    match (d, h) {
        (0, 0) => format!("{sign}{m}m"),
        (0, _) => format!("{sign}{h}h {m}m"),
        _ => format!("{sign}{d}d {h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_read_at_a_glance() {
        assert_eq!(human_span(89 * 86400 + 3 * 3600 + 59), "89d 3h");
        assert_eq!(human_span(5 * 3600 + 120), "5h 2m");
        assert_eq!(human_span(59), "0m");
        assert_eq!(human_span(-(2 * 86400 + 4 * 3600)), "-2d 4h");
    }
}
