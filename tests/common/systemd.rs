//! A system bus of its own (a real `dbus-daemon`, with a bus configuration of the test's)
//! and on it a stand-in for systemd's manager: `org.freedesktop.systemd1` at
//! `/org/freedesktop/systemd1`, whose `RestartUnit` records the call, answers with a job
//! path and, a little later, sends `JobRemoved` with the result the test chose, as systemd
//! does once a restart job ends.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zbus::object_server::SignalEmitter;

/// One `RestartUnit` call: the unit and the mode.
pub type Call = (String, String);

struct Manager {
    calls: Arc<Mutex<Vec<Call>>>,
    result: Arc<Mutex<String>>,
    /// How long a job takes before `JobRemoved`.
    takes: Duration,
}

#[zbus::interface(name = "org.freedesktop.systemd1.Manager")]
impl Manager {
    async fn restart_unit(
        &self,
        name: String,
        mode: String,
        #[zbus(signal_emitter)] emitter: SignalEmitter<'_>,
    ) -> zbus::fdo::Result<zbus::OwnedObjectPath> {
        let id = {
            let mut calls = self.calls.lock().unwrap();
            calls.push((name.clone(), mode));
            calls.len() as u32
        };
        if name == "missing.service" {
            return Err(zbus::fdo::Error::Failed(format!("Unit {name} not found.")));
        }
        let job =
            zbus::OwnedObjectPath::try_from(format!("/org/freedesktop/systemd1/job/{id}")).unwrap();
        let result = self.result.lock().unwrap().clone();
        let emitter = emitter.to_owned();
        let (path, takes) = (job.clone(), self.takes);
        tokio::spawn(async move {
            tokio::time::sleep(takes).await;
            // Another job's end first: the agent must wait for its own.
            let other = zbus::ObjectPath::try_from("/org/freedesktop/systemd1/job/999").unwrap();
            let _ = Manager::job_removed(&emitter, 999, other, "other.service", "failed").await;
            let _ = Manager::job_removed(&emitter, id, path.as_ref(), &name, &result).await;
        });
        Ok(job)
    }

    #[zbus(signal)]
    async fn job_removed(
        emitter: &SignalEmitter<'_>,
        id: u32,
        job: zbus::ObjectPath<'_>,
        unit: &str,
        result: &str,
    ) -> zbus::Result<()>;
}

/// The bus and the stand-in; both go when it is dropped.
pub struct FakeSystemd {
    daemon: Child,
    /// The bus address, for `DBUS_SYSTEM_BUS_ADDRESS`.
    pub address: String,
    calls: Arc<Mutex<Vec<Call>>>,
    result: Arc<Mutex<String>>,
    _connection: zbus::Connection,
    _runtime: tokio::runtime::Runtime,
}

impl FakeSystemd {
    /// Starts a bus whose socket is in `dir`, and the stand-in on it; each restart job
    /// ends after `takes` with result `done`.
    pub fn start(dir: &Path, takes: Duration) -> FakeSystemd {
        std::fs::create_dir_all(dir).unwrap();
        let config = dir.join("bus.conf");
        let socket = dir.join("system_bus_socket");
        std::fs::write(
            &config,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_type="method_return"/>
    <allow send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="signal"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
  </policy>
</busconfig>
"#,
                socket.display()
            ),
        )
        .unwrap();
        let mut daemon = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .args(["--nofork", "--nopidfile", "--print-address=1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("dbus-daemon (package dbus-daemon) runs");
        let mut line = String::new();
        BufReader::new(daemon.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line.trim().to_string();
        assert!(address.starts_with("unix:"), "dbus-daemon said {address:?}");

        let calls = Arc::new(Mutex::new(Vec::new()));
        let result = Arc::new(Mutex::new("done".to_string()));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let manager = Manager {
            calls: calls.clone(),
            result: result.clone(),
            takes,
        };
        let connection = runtime
            .block_on(async {
                zbus::connection::Builder::address(address.as_str())
                    .name("org.freedesktop.systemd1")
                    .serve_at("/org/freedesktop/systemd1", manager)
                    .build()
                    .await
            })
            .expect("the stand-in for systemd is on the bus");
        FakeSystemd {
            daemon,
            address,
            calls,
            result,
            _connection: connection,
            _runtime: runtime,
        }
    }

    /// The `RestartUnit` calls so far.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// The result the next jobs end with (`done`, `failed`, ...).
    pub fn set_result(&self, result: &str) {
        *self.result.lock().unwrap() = result.to_string();
    }
}

impl Drop for FakeSystemd {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}
