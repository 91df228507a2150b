//! A real Prometheus (the `prometheus` Debian package) for the tests: started on a free
//! port with a given scrape configuration and rule files, queried over its HTTP API with
//! curl.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::daemon::{eventually, free_port};

pub struct Prometheus {
    child: Child,
    pub port: u16,
    log: PathBuf,
}

impl Prometheus {
    /// True when the `prometheus` binary is on the PATH.
    pub fn installed() -> bool {
        Command::new("prometheus")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// Starts Prometheus in `dir` with `global:` evaluation and scrape every second, the
    /// given `scrape_configs:` (YAML list items, already indented by two) and rule files.
    pub fn start(dir: &Path, scrape_configs: &str, rule_files: &[&Path]) -> Prometheus {
        let port = free_port();
        let config = dir.join("prometheus.yml");
        let rules: String = rule_files
            .iter()
            .map(|p| format!("- {}\n", p.display()))
            .collect();
        fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nrule_files:\n{rules}scrape_configs:\n{scrape_configs}"
            ),
        )
        .unwrap();
        let log = dir.join("prometheus.log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("prometheus-data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .expect("prometheus is installed");
        Prometheus { child, port, log }
    }

    /// GET `path` from the HTTP API; the body (empty when Prometheus does not answer).
    pub fn api(&self, path: &str) -> String {
        let out = Command::new("curl")
            .args(["-s", "--max-time", "5"])
            .arg(format!("http://127.0.0.1:{}{path}", self.port))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// An instant query; the parsed answer (`status`, `data.result`, or `error`).
    pub fn query(&self, expr: &str) -> serde_json::Value {
        let out = Command::new("curl")
            .args(["-s", "--max-time", "10", "-G", "--data-urlencode"])
            .arg(format!("query={expr}"))
            .arg(format!("http://127.0.0.1:{}/api/v1/query", self.port))
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
    }

    /// Waits until every target is up; false after `limit`.
    pub fn wait_targets_up(&self, limit: Duration) -> bool {
        eventually(limit, || {
            let targets = self.api("/api/v1/targets");
            targets.contains("\"health\":\"up\"") && !targets.contains("\"health\":\"down\"")
        })
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
