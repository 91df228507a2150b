//! A running `kubelet-ca-agent run` for the benchmarks: its stderr lines timestamped as
//! they come, its memory and CPU time, a plain-HTTP scrape and probe; and the bare replace
//! the agent is compared with.

// Each benchmark uses part of this.
#![allow(dead_code)]

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::clock;
use crate::report::percentile;

/// A running agent, its stderr lines timestamped as they come.
pub struct Agent {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub lines: mpsc::Receiver<(Instant, String)>,
}

impl Agent {
    /// `run` with `sources`, a bundle under `dir`/etc, plain-HTTP metrics on loopback, the
    /// default log level (info).
    pub fn start(
        dir: tempfile::TempDir,
        sources: &[String],
        kubeconfig: Option<&Path>,
        notify: Option<&Path>,
    ) -> Agent {
        Agent::start_serving(
            dir,
            sources,
            kubeconfig,
            notify,
            &["--insecure-metrics".into()],
        )
    }

    /// Like [`Agent::start`], with `server` flags for the endpoint instead of
    /// `--insecure-metrics`.
    pub fn start_serving(
        dir: tempfile::TempDir,
        sources: &[String],
        kubeconfig: Option<&Path>,
        notify: Option<&Path>,
        server: &[String],
    ) -> Agent {
        let port = free_port();
        Agent::spawn(this_build(), dir, sources, kubeconfig, notify, server, port)
    }

    /// Like [`Agent::start_serving`], running `binary` instead of this build's agent: another
    /// build to compare with in the same run (an earlier commit's, say).
    pub fn start_binary(
        binary: &Path,
        dir: tempfile::TempDir,
        sources: &[String],
        kubeconfig: Option<&Path>,
        server: &[String],
    ) -> Agent {
        let port = free_port();
        Agent::spawn(binary, dir, sources, kubeconfig, None, server, port)
    }

    /// Like [`Agent::start`] with `--listen 127.0.0.1:0`: the kernel picks the endpoint's port
    /// and nobody learns it, so there is no scrape. For fleets, where ports picked ahead of
    /// many agents could be handed out twice before the agents bind them.
    pub fn start_unlisted(
        dir: tempfile::TempDir,
        sources: &[String],
        kubeconfig: Option<&Path>,
    ) -> Agent {
        Agent::spawn(
            this_build(),
            dir,
            sources,
            kubeconfig,
            None,
            &["--insecure-metrics".into()],
            0,
        )
    }

    fn spawn(
        binary: &Path,
        dir: tempfile::TempDir,
        sources: &[String],
        kubeconfig: Option<&Path>,
        notify: Option<&Path>,
        server: &[String],
        port: u16,
    ) -> Agent {
        fs::create_dir_all(dir.path().join("etc")).unwrap();
        let mut cmd = Command::new(binary);
        cmd.arg("run");
        for source in sources {
            cmd.arg("--source").arg(source);
        }
        if let Some(kubeconfig) = kubeconfig {
            cmd.arg("--kubeconfig").arg(kubeconfig);
        }
        cmd.arg("--bundle")
            .arg(dir.path().join("etc/kubelet-ca.crt"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(server)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(socket) = notify {
            cmd.env("NOTIFY_SOCKET", socket);
        }
        let mut child = cmd.spawn().expect("start the agent");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                // Keep draining when nobody listens, so the agent never blocks on the pipe.
                let _ = tx.send((Instant::now(), line));
            }
        });
        Agent {
            child,
            dir,
            port,
            lines,
        }
    }

    pub fn bundle(&self) -> PathBuf {
        self.dir.path().join("etc/kubelet-ca.crt")
    }

    pub fn holds(&self, content: &str) -> bool {
        fs::read(self.bundle()).is_ok_and(|b| b == content.as_bytes())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn rss_mib(&self) -> f64 {
        status_kib(self.pid(), "VmRSS:") as f64 / 1024.0
    }

    pub fn peak_rss_mib(&self) -> f64 {
        status_kib(self.pid(), "VmHWM:") as f64 / 1024.0
    }

    /// CPU time of the whole process (every thread, exited ones too).
    pub fn cpu_time(&self) -> Duration {
        process_cpu_time(self.pid())
    }

    /// Bytes the process read (`rchar` of /proc/PID/io): files, pipes and sockets.
    pub fn read_bytes(&self) -> u64 {
        fs::read_to_string(format!("/proc/{}/io", self.pid()))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("rchar:")?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// One GET /metrics on a new connection, read to the end.
    pub fn scrape(&self) -> String {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{}", first_line(&out));
        out
    }

    /// One GET /readyz on a new connection: its status code, or None while nothing listens
    /// on the endpoint's port yet (or the connection closed before an answer).
    pub fn readyz(&self) -> Option<u16> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        write!(
            s,
            "GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        first_line(&out).split(' ').nth(1)?.parse().ok()
    }

    /// Throws away the lines the agent logged so far, each shown to `seen` first.
    pub fn drain_lines(&self, mut seen: impl FnMut(&str)) {
        while let Ok((_, line)) = self.lines.try_recv() {
            seen(&line);
        }
    }

    /// Waits up to 10 s for a line with `message` and `hash` (a file's SHA-256, which the
    /// agent's `... written` lines name) and returns when it was read from the agent's
    /// stderr. Every line read meanwhile is shown to `seen`, that one too.
    pub fn logged(&self, message: &str, hash: &str, mut seen: impl FnMut(&str)) -> Instant {
        loop {
            let (at, line) = self
                .lines
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("the agent logs `{message}` within 10 s"));
            seen(&line);
            if line.contains(message) && line.contains(hash) {
                return at;
            }
        }
    }

    /// Waits for the file to hold `content`; the agent's log is shown if it does not.
    pub fn wait_holds(&self, content: &str, limit: Duration) {
        let start = Instant::now();
        while !self.holds(content) {
            if start.elapsed() > limit {
                let log: Vec<String> = self.lines.try_iter().map(|(_, l)| l).collect();
                panic!(
                    "the bundle did not follow within {limit:?}; agent log:\n{}",
                    log.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The agent this build made (`cargo bench` builds it with the bench profile).
fn this_build() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_kubelet-ca-agent"))
}

/// A loopback port free a moment ago, for an agent's endpoint.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

pub fn status_kib(pid: u32, name: &str) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)?
                .trim()
                .strip_suffix(" kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// CPU time of process `pid` from its process CPU clock (all its threads, exited ones
/// included, to the nanosecond); else from /proc/PID/stat (10 ms ticks).
pub fn process_cpu_time(pid: u32) -> Duration {
    if let Some(time) = clock::process(pid) {
        return time;
    }
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Times of the bare replace the agent cannot avoid: (write + fsync + rename, and then the
/// fsync of the directory too).
pub fn bare_replace(dir: &Path, bytes: &[u8]) -> (Duration, Duration) {
    let target = dir.join("bare.crt");
    let temp = dir.join(".bare.crt.tmp");
    let start = Instant::now();
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)
        .unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
    fs::rename(&temp, &target).unwrap();
    let renamed = start.elapsed();
    File::open(dir).unwrap().sync_all().unwrap();
    (renamed, start.elapsed())
}

pub fn p50_p99(samples: &mut [Duration]) -> (Duration, Duration) {
    (percentile(samples, 0.5), percentile(samples, 0.99))
}
