//! Unit tests' view of the log: what an operator reads in the journal, captured.

use std::sync::{Arc, Mutex};

/// The lines logged through [`Log::subscriber`], as written.
#[derive(Clone, Default)]
pub(crate) struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    /// A subscriber that writes every event, plain, to this log.
    pub(crate) fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish()
    }

    /// Runs `f` with its log captured.
    pub(crate) fn capture<R>(f: impl FnOnce() -> R) -> (R, Log) {
        let log = Log::default();
        let result = tracing::subscriber::with_default(log.subscriber(), f);
        (result, log)
    }

    /// Everything logged.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// How many times `needle` was logged.
    pub(crate) fn count(&self, needle: &str) -> usize {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .matches(needle)
            .count()
    }
}
