//! The systemd notify protocol: `READY=1` once, `STATUS=` when the summary changes, and
//! `WATCHDOG=1` from the reconciliation loop itself, so that a stuck loop gets restarted.
//! Without `NOTIFY_SOCKET` every call is a no-op.

use std::time::Duration;

use sd_notify::NotifyState;

#[derive(Debug, Default)]
pub struct Notifier {
    ready_sent: bool,
    last_status: String,
}

impl Notifier {
    /// How often to send `WATCHDOG=1`: half of `WATCHDOG_USEC`, when systemd asks for it.
    pub fn watchdog_interval() -> Option<Duration> {
        sd_notify::watchdog_enabled().map(|timeout| timeout / 2)
    }

    /// Sends `READY=1` the first time it is called with `ready` true.
    pub fn ready(&mut self, ready: bool) {
        if ready && !self.ready_sent {
            self.ready_sent = true;
            if let Err(e) = sd_notify::notify(&[NotifyState::Ready]) {
                tracing::warn!(error = %e, "cannot notify systemd");
            }
        }
    }

    pub fn status(&mut self, summary: &str) {
        if summary != self.last_status {
            self.last_status = summary.to_string();
            // One line: a newline in it would start another notify assignment.
            let line = crate::text::escape(summary);
            let _ = sd_notify::notify(&[NotifyState::Status(&line)]);
        }
    }

    pub fn watchdog(&self) {
        let _ = sd_notify::notify(&[NotifyState::Watchdog]);
    }

    pub fn stopping(&self) {
        let _ = sd_notify::notify(&[NotifyState::Stopping]);
    }
}
