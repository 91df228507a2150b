//! `--exec-on-change`: a command run after each successful replace of the bundle, with
//! `KUBELET_CA_BUNDLE` set to its path. No shell; a failure is logged, never retried.

use std::path::Path;
use std::process::Command;

/// Runs the command to completion. Returns whether it succeeded.
pub fn run(command: &[String], bundle: &Path) -> bool {
    let result = Command::new(&command[0])
        .args(&command[1..])
        .env("KUBELET_CA_BUNDLE", bundle)
        // The hook is not the service: it must not speak to systemd in our name.
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .env_remove("WATCHDOG_PID")
        .status();
    match result {
        Ok(status) if status.success() => {
            tracing::info!(command = %command[0], "exec-on-change command succeeded");
            true
        }
        Ok(status) => {
            tracing::warn!(command = %command[0], %status, "exec-on-change command failed");
            false
        }
        Err(e) => {
            tracing::warn!(command = %command[0], error = %e, "exec-on-change command could not start");
            false
        }
    }
}
