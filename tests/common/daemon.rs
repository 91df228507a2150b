//! Running `kubelet-ca-agent run` as a user would: a child process with its own port, its
//! log captured to a file, and small helpers to poll it over HTTP.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{Node, agent_bin};

pub struct Agent {
    pub child: Child,
    pub port: u16,
    log: PathBuf,
}

/// A free loopback port (the race with another process taking it is accepted in tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Agent {
    /// Starts `run` on `node` with the given sources and extra arguments.
    pub fn start(node: &Node, sources: &[&str], extra: &[&str]) -> Agent {
        Agent::start_with(node, sources, extra, |_| {})
    }

    /// Like [`Agent::start`], with a hook to adjust the command (environment, ...).
    pub fn start_with(
        node: &Node,
        sources: &[&str],
        extra: &[&str],
        adjust: impl FnOnce(&mut Command),
    ) -> Agent {
        Agent::start_wrapped(node, sources, extra, &[], adjust)
    }

    /// Like [`Agent::start_with`], run through `wrapper` (a program and its arguments that
    /// exec the agent in the same process, e.g. `setpriv ... --`), so that the agent's
    /// pid is the child's.
    pub fn start_wrapped(
        node: &Node,
        sources: &[&str],
        extra: &[&str],
        wrapper: &[&str],
        adjust: impl FnOnce(&mut Command),
    ) -> Agent {
        fs::create_dir_all(node.bundle_dir()).unwrap();
        let port = free_port();
        let log = node.root().join(format!("agent-{port}.log"));
        let mut cmd = match wrapper {
            [] => Command::new(agent_bin()),
            [program, args @ ..] => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(agent_bin());
                cmd
            }
        };
        // Bundle and state dir through the environment, so that a test can still pass
        // --bundle itself (the command line wins).
        cmd.arg("run")
            .env("KUBELET_CA_AGENT_BUNDLE", node.bundle())
            .env("KUBELET_CA_AGENT_STATE_DIR", node.state_dir());
        Agent::launch(cmd, port, log, sources, extra, adjust)
    }

    /// Adds what every command of a test shares (metrics on `port`, insecure and in the
    /// environment so that a test of the secured endpoint can remove it, a clean
    /// environment, stderr to `log`), the sources and `extra`, and starts it.
    fn launch(
        mut cmd: Command,
        port: u16,
        log: PathBuf,
        sources: &[&str],
        extra: &[&str],
        adjust: impl FnOnce(&mut Command),
    ) -> Agent {
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .env("KUBELET_CA_AGENT_INSECURE_METRICS", "true")
            .env_remove("RUST_LOG")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("KUBECONFIG")
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap());
        for s in sources {
            cmd.arg("--source").arg(s);
        }
        cmd.args(extra);
        adjust(&mut cmd);
        let child = cmd.spawn().expect("start the agent");
        Agent { child, port, log }
    }

    /// Starts `publish --to TO` against the API server of `kubeconfig`, with its log under
    /// `dir`, metrics on a free loopback port (insecure, as for `run`).
    pub fn publish(
        dir: &std::path::Path,
        kubeconfig: &std::path::Path,
        to: &str,
        sources: &[&str],
        extra: &[&str],
    ) -> Agent {
        Agent::publish_with(dir, kubeconfig, to, sources, extra, |_| {})
    }

    /// Like [`Agent::publish`], with a hook to adjust the command.
    pub fn publish_with(
        dir: &std::path::Path,
        kubeconfig: &std::path::Path,
        to: &str,
        sources: &[&str],
        extra: &[&str],
        adjust: impl FnOnce(&mut Command),
    ) -> Agent {
        let port = free_port();
        let log = dir.join(format!("publisher-{port}.log"));
        let mut cmd = Command::new(agent_bin());
        cmd.arg("publish")
            .arg("--to")
            .arg(to)
            .arg("--kubeconfig")
            .arg(kubeconfig);
        Agent::launch(cmd, port, log, sources, extra, adjust)
    }

    /// GET `path`; (status code, body), or None if the agent does not answer.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        self.get_with(path, "").map(|(code, _, body)| (code, body))
    }

    /// GET `path` with extra header lines; (status code, response head, body).
    pub fn get_with(&self, path: &str, headers: &str) -> Option<(u16, String, String)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}\r\n"
        )
        .ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let code = response.split_whitespace().nth(1)?.parse().ok()?;
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        Some((
            code,
            head.to_string(),
            decode_chunked(head, body.to_string()),
        ))
    }

    /// The value of a metric sample whose line starts with `prefix` (name and labels).
    pub fn metric(&self, prefix: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        body.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    /// Waits until the metric sample starting with `prefix` equals `value`.
    pub fn wait_metric(&self, limit: Duration, prefix: &str, value: f64) {
        wait_until(limit, || self.metric(prefix).is_some_and(|v| v == value));
    }

    /// The value of the sample of metric `name` (exactly that name) whose labels include
    /// every `(label, value)` pair in `labels`; None when no such series is exposed.
    pub fn sample(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        samples(&body, name)
            .into_iter()
            .find(|s| s.has(labels))
            .map(|s| s.value)
    }

    /// Waits until the sample of `name` with `labels` satisfies `check`; returns its value.
    pub fn wait_sample(
        &self,
        limit: Duration,
        name: &str,
        labels: &[(&str, &str)],
        check: impl Fn(f64) -> bool,
    ) -> f64 {
        let mut value = None;
        wait_until(limit, || {
            value = self.sample(name, labels);
            value.is_some_and(&check)
        });
        value.unwrap()
    }

    /// Waits until the HTTP endpoint answers.
    /// On a kernel with Landlock, waits (up to 20 s) for the agent to exit 1 because its
    /// confinement no longer covers what it needs, its log naming `what` (a place replaced or
    /// new since start, a port): a new agent is then started as its supervisor would, and
    /// true is returned. Without Landlock the agent carries on: false.
    pub fn exits_when_outgrown(&mut self, what: &str) -> bool {
        let page = self
            .get("/readyz?verbose")
            .map(|(_, b)| b)
            .unwrap_or_default();
        if !page.contains("[+]confinement ok: Landlock") {
            return false;
        }
        let status = wait_for_exit(&mut self.child, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("the agent goes on without {what}: {}", self.log()));
        let log = self.log();
        assert_eq!(status.code(), Some(1), "{log}");
        assert!(
            log.contains("confinement no longer covers what it needs") && log.contains(what),
            "{log}"
        );
        true
    }

    pub fn wait_listening(&self) {
        wait_until(Duration::from_secs(10), || self.get("/livez").is_some());
    }

    /// Peak resident memory of the agent so far, in bytes (VmHWM).
    pub fn peak_rss(&self) -> u64 {
        let status = fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/<pid>/status");
        kb * 1024
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not stop after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A failed test shows what the agent said.
        if std::thread::panicking() {
            eprintln!("--- the agent's log ---\n{}", self.log());
        }
    }
}

fn decode_chunked(head: &str, body: String) -> String {
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body;
    }
    let mut out = String::new();
    let mut rest = body.as_str();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// A wrapper for [`Agent::start_wrapped`]: the agent in a user namespace of its own, where
/// no inotify instance may be made at all (as on a node out of instances).
pub const WITHOUT_INOTIFY: [&str; 6] = [
    "unshare",
    "-Ur",
    "sh",
    "-c",
    "echo 0 > /proc/sys/user/max_inotify_instances && exec \"$@\"",
    "sh",
];

/// Polls `condition` every 5 ms until it holds; panics after `limit`. Returns how long it took.
/// The child's exit status once it exits, or None after `limit`.
pub fn wait_for_exit(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().ok().flatten() {
            return Some(status);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn wait_until(limit: Duration, mut condition: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !condition() {
        assert!(
            start.elapsed() < limit,
            "condition not met within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    start.elapsed()
}

/// Like [`wait_until`] but returns false instead of panicking.
pub fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !condition() {
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// One sample of the Prometheus text exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// True when every `(label, value)` pair is among the labels.
    pub fn has(&self, labels: &[(&str, &str)]) -> bool {
        labels.iter().all(|(k, v)| self.label(k) == Some(v))
    }
}

/// Every sample of metric `name` (exactly that name, not a prefix) in a text exposition.
/// Label values are unescaped (`\\`, `\"`, `\n`).
pub fn samples(body: &str, name: &str) -> Vec<Sample> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let (labels, rest) = match rest.strip_prefix('{') {
                Some(inner) => parse_labels(inner)?,
                None if rest.starts_with(' ') => (Vec::new(), rest),
                None => return None,
            };
            let value = rest.split_whitespace().next()?.parse().ok()?;
            Some(Sample { labels, value })
        })
        .collect()
}

/// Parses `k="v",k2="v2"}` and returns the labels and what follows the `}`.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start_matches(',');
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (key, rest) = s.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        s = &rest[end + 1..];
    }
}

/// The line of `/readyz?verbose` about `check` (empty when there is none).
pub fn check_line(verbose: &str, check: &str) -> String {
    verbose
        .lines()
        .find(|l| {
            l.get(3..)
                .is_some_and(|l| l.starts_with(&format!("{check} ")))
        })
        .unwrap_or_default()
        .to_string()
}
