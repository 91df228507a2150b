//! Restarting a systemd unit through systemd's D-Bus API on the host's system bus, for
//! `--kubeconfig-restart-unit` (SPEC 4c): the kubelet reads its kubeconfig's CA data only
//! when it starts, and the DaemonSet's image has no shell and no `systemctl`, and its pod
//! no host PID namespace. What `systemctl restart UNIT` does, the agent does itself:
//! `org.freedesktop.systemd1.Manager.RestartUnit(UNIT, "replace")`, then it waits for the
//! job's `JobRemoved` signal (which systemd sends to the client that queued the job) and
//! takes its result. Only "done" is a success.
//!
//! The bus is `DBUS_SYSTEM_BUS_ADDRESS` when set, else the host's
//! `unix:path=/run/dbus/system_bus_socket` (a pod mounts the host's `/run/dbus`).

use std::time::Duration;

use futures::StreamExt;
use zbus::OwnedObjectPath;

/// The system bus when `DBUS_SYSTEM_BUS_ADDRESS` does not say otherwise. `/run`, not
/// zbus's `/var/run`: an image `FROM scratch` has no `/var/run` link.
pub const SYSTEM_BUS: &str = "unix:path=/run/dbus/system_bus_socket";

const SYSTEMD: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";

/// The bus address to use: `DBUS_SYSTEM_BUS_ADDRESS` when set and not empty, else
/// [`SYSTEM_BUS`].
pub fn system_bus(from_env: Option<&str>) -> &str {
    match from_env {
        Some(address) if !address.trim().is_empty() => address,
        _ => SYSTEM_BUS,
    }
}

/// The longest wait for systemd to end a restart job it has queued. systemd bounds the job
/// itself (the unit's start timeout, then the result `timeout`); this only guards against a
/// `JobRemoved` that never comes.
pub const JOB_WAIT_MAX: Duration = Duration::from_secs(15 * 60);

/// How often a wait checks whether the agent is stopping.
const POLL: Duration = Duration::from_millis(100);

/// Restarts `unit` and waits for systemd to say how the restart ended, as `systemctl
/// restart` does. Reaching systemd and queueing the job are bounded by `timeout`; the job
/// itself is not (a kubelet may take longer to start than a hook may run, and asking again
/// would restart it again), up to [`JOB_WAIT_MAX`]. Gives up at once when `stop` says so.
/// Runs its own small runtime: it is called from the hook's thread. The error says what
/// failed (the bus, systemd's refusal, the job's result), never more.
pub fn restart(unit: &str, timeout: Duration, stop: &dyn Fn() -> bool) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime for D-Bus: {e}"))?;
    let address = std::env::var("DBUS_SYSTEM_BUS_ADDRESS").ok();
    let address = system_bus(address.as_deref()).to_string();
    runtime.block_on(async {
        let stopping = async {
            while !stop() {
                tokio::time::sleep(POLL).await;
            }
        };
        tokio::select! {
            result = restart_on(&address, unit, timeout) => result,
            () = stopping => Err(format!("stopping: the restart of {unit} is no longer waited for")),
        }
    })
}

/// [`restart`] on the bus at `address`.
async fn restart_on(address: &str, unit: &str, timeout: Duration) -> Result<(), String> {
    let queue = async {
        let parsed: zbus::Address = address
            .parse()
            .map_err(|e| format!("the system bus address {address:?} is not valid: {e}"))?;
        let bus = zbus::connection::Builder::address(parsed)
            .build()
            .await
            .map_err(|e| format!("cannot connect to the system bus at {address}: {e}"))?;
        let manager = zbus::Proxy::new(&bus, SYSTEMD, MANAGER_PATH, MANAGER)
            .await
            .map_err(|e| format!("cannot reach systemd on the system bus: {e}"))?;
        // Listening before asking: the job may end before the call's answer is read.
        let removed = manager
            .receive_signal("JobRemoved")
            .await
            .map_err(|e| format!("cannot listen for systemd's jobs on the system bus: {e}"))?;
        let job: OwnedObjectPath = manager
            .call("RestartUnit", &(unit, "replace"))
            .await
            .map_err(|e| format!("systemd refused to restart {unit}: {}", refusal(&e)))?;
        Ok::<_, String>((bus, removed, job))
    };
    let (_bus, mut removed, job) = tokio::time::timeout(timeout, queue).await.map_err(|_| {
        format!(
            "systemd did not take the restart of {unit} within {}",
            humantime::format_duration(timeout)
        )
    })??;
    let ended = async {
        while let Some(signal) = removed.next().await {
            let Ok((_id, path, _unit, result)) =
                signal
                    .body()
                    .deserialize::<(u32, OwnedObjectPath, String, String)>()
            else {
                continue;
            };
            if path == job {
                return outcome(unit, &result);
            }
        }
        Err(format!(
            "the system bus closed before the restart of {unit} ended"
        ))
    };
    tokio::time::timeout(JOB_WAIT_MAX, ended)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "systemd did not end the restart job of {unit} within {}",
                humantime::format_duration(JOB_WAIT_MAX)
            ))
        })
}

/// What a job's result means: "done" is the only success (systemd's own list: done,
/// canceled, timeout, failed, dependency, skipped).
fn outcome(unit: &str, result: &str) -> Result<(), String> {
    match result {
        "done" => Ok(()),
        other => Err(format!(
            "systemd's restart of {unit} ended with {:?} (systemctl status {unit} says why)",
            crate::text::escape(other)
        )),
    }
}

/// A D-Bus error as one line: its name and message (systemd's own words: "Unit kubelet.service
/// not found.", "Access denied").
fn refusal(error: &zbus::Error) -> String {
    match error {
        zbus::Error::MethodError(name, message, _) => match message {
            Some(message) => format!("{name}: {}", crate::text::escape(message)),
            None => name.to_string(),
        },
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bus_is_the_environments_when_set_else_the_hosts() {
        assert_eq!(system_bus(None), SYSTEM_BUS);
        assert_eq!(system_bus(Some("")), SYSTEM_BUS);
        assert_eq!(system_bus(Some("  ")), SYSTEM_BUS);
        assert_eq!(
            system_bus(Some("unix:path=/host/run/dbus/system_bus_socket")),
            "unix:path=/host/run/dbus/system_bus_socket"
        );
    }

    #[test]
    fn only_a_done_job_is_a_success_and_any_other_result_is_named() {
        assert_eq!(outcome("kubelet.service", "done"), Ok(()));
        for result in [
            "failed",
            "canceled",
            "timeout",
            "dependency",
            "skipped",
            "Done",
        ] {
            let error = outcome("kubelet.service", result).unwrap_err();
            assert!(error.contains("kubelet.service"), "{error}");
            assert!(error.contains(&format!("{result:?}")), "{error}");
        }
    }

    #[test]
    fn a_bus_that_is_not_there_is_named() {
        let dir = std::env::temp_dir().join(format!("unit-test-{}", std::process::id()));
        let address = format!("unix:path={}/no-bus", dir.display());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let error = runtime
            .block_on(restart_on(
                &address,
                "kubelet.service",
                Duration::from_secs(5),
            ))
            .unwrap_err();
        assert!(
            error.contains("cannot connect to the system bus at"),
            "{error}"
        );
        assert!(error.contains("no-bus"), "{error}");
        let error = runtime
            .block_on(restart_on(
                "not-an-address",
                "kubelet.service",
                Duration::from_secs(5),
            ))
            .unwrap_err();
        assert!(error.contains("is not valid"), "{error}");
    }
}
