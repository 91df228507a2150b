//! A real API server for the tests that need one (what the Node authorizer, RBAC or the API
//! server itself decides): `../shared/tools/kube-apiserver/cluster` started in a temporary
//! directory and stopped when the value is dropped. Self-contained: it needs nothing else
//! of tests/common, so that a test can include it alone (`#[path]`).
#![allow(dead_code)]

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

/// The cluster script, beside the repository (`../shared/tools` from its root).
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/tools/kube-apiserver/cluster")
}

/// Whether the real API server can be started here: the script is there.
pub fn available() -> bool {
    script().is_file()
}

/// A running etcd and kube-apiserver, stopped (and their data removed) on drop.
pub struct RealCluster {
    pub dir: TempDir,
    env: HashMap<String, String>,
}

impl RealCluster {
    /// Starts one (about 4 s). Panics with the script's output if it cannot.
    pub fn up() -> RealCluster {
        let dir = tempfile::Builder::new()
            .prefix("real-cluster-")
            .tempdir()
            .unwrap();
        let out = Command::new(script())
            .arg("up")
            .arg(dir.path())
            .output()
            .expect("run the cluster script");
        assert!(
            out.status.success(),
            "cluster up failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let env = parse_env(&fs::read_to_string(dir.path().join("env")).unwrap());
        RealCluster { dir, env }
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.env["API_URL"]
    }

    pub fn ca_crt(&self) -> PathBuf {
        self.dir.path().join("pki/ca.crt")
    }

    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.path().join("admin.kubeconfig")
    }

    /// A request as the cluster's admin (system:masters): (HTTP status, body).
    pub fn admin(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let pki = self.dir.path().join("pki");
        let mut curl = Command::new("curl");
        curl.args(["-sS", "-m", "10", "-X", method, "-w", "\n%{http_code}"])
            .arg("--cacert")
            .arg(pki.join("ca.crt"))
            .arg("--cert")
            .arg(pki.join("admin.crt"))
            .arg("--key")
            .arg(pki.join("admin.key"));
        if let Some(body) = body {
            curl.args([
                "-H",
                "Content-Type: application/json",
                "--data-binary",
                body,
            ]);
        }
        let out = curl.arg(format!("{}{path}", self.url())).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    /// A client certificate and key (PEM) for `cn` in the groups `groups`, signed by the
    /// cluster CA with openssl: a node identity is `system:node:NAME` in `system:nodes`.
    pub fn sign(&self, cn: &str, groups: &[&str]) -> (String, String) {
        let work = tempfile::tempdir().unwrap();
        let subject: String = groups
            .iter()
            .map(|o| format!("/O={o}"))
            .chain(std::iter::once(format!("/CN={cn}")))
            .collect();
        let pki = self.dir.path().join("pki");
        let key = work.path().join("id.key");
        let csr = work.path().join("id.csr");
        let crt = work.path().join("id.crt");
        let ext = work.path().join("id.ext");
        fs::write(&ext, "extendedKeyUsage=clientAuth\n").unwrap();
        let run = |args: &[&std::ffi::OsStr]| {
            let out = Command::new("openssl").args(args).output().unwrap();
            assert!(
                out.status.success(),
                "openssl: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&[
            "req".as_ref(),
            "-newkey".as_ref(),
            "ec".as_ref(),
            "-pkeyopt".as_ref(),
            "ec_paramgen_curve:P-256".as_ref(),
            "-nodes".as_ref(),
            "-keyout".as_ref(),
            key.as_os_str(),
            "-out".as_ref(),
            csr.as_os_str(),
            "-subj".as_ref(),
            subject.as_ref(),
        ]);
        run(&[
            "x509".as_ref(),
            "-req".as_ref(),
            "-in".as_ref(),
            csr.as_os_str(),
            "-CA".as_ref(),
            pki.join("ca.crt").as_os_str(),
            "-CAkey".as_ref(),
            pki.join("ca.key").as_os_str(),
            "-CAcreateserial".as_ref(),
            "-CAserial".as_ref(),
            work.path().join("ca.srl").as_os_str(),
            "-days".as_ref(),
            "2".as_ref(),
            "-out".as_ref(),
            crt.as_os_str(),
            "-extfile".as_ref(),
            ext.as_os_str(),
        ]);
        (
            fs::read_to_string(crt).unwrap(),
            fs::read_to_string(key).unwrap(),
        )
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .arg("down")
            .arg(self.dir.path())
            .output();
    }
}

/// `DIR/env`: `NAME=VALUE` lines.
fn parse_env(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}
