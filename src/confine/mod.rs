//! What the node agent may touch once it runs (SPEC 13), and the confinement that holds it
//! there. The agent runs as root on every node, parses what the cluster sends and serves an
//! endpoint: taken over, it must hold no more than its job. So right after start-up, before
//! any thread that parses or serves exists, it confines itself with Linux Landlock (and a
//! small seccomp filter for what Landlock cannot yet say), from a plan built here, once,
//! from the checked configuration and what start-up read from disk.
//!
//! The plan is a list: each path or port the agent needs is one entry with the reason it is
//! needed, reviewed like a dependency. [`plan`] is pure (tested without a kernel);
//! [`enforce`] carries it out.
//!
//! Landlock rules attach to inodes, and a rule on a directory covers everything beneath it.
//! A file the agent replaces by rename, or follows while someone else does (the kubelet's
//! rotating client certificate), is a new inode each time: its rule must be on its
//! directory. So the agent can read and write in `/etc/kubernetes` but not hide
//! `/etc/kubernetes/pki` inside it; the unit's and the DaemonSet's masks do that
//! (docs/security.md).

mod enforce;
mod facts;

pub use enforce::{Enforced, enforce, identities};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What the agent may do with a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    /// Read the file at this path (a rule on the file itself, not its directory).
    ReadFile,
    /// Read every file beneath this directory and list it.
    Read,
    /// Read, and replace files by rename, beneath this directory (a target's directory).
    Replace,
    /// As [`Access::Replace`], and make directories: above a target's directory that is
    /// not there yet, which the agent makes once there is something to keep.
    Make,
    /// Read, write, create and remove files and directories beneath this directory (the
    /// state directory, a registry set's directory).
    Own,
    /// Read and execute this file (a hook's program, its interpreter).
    Run,
    /// Read and execute the files beneath this directory (the programs a hook runs).
    RunAll,
    /// Read and write this device (`/dev/null`, a hook's standard input and output).
    Device,
    /// Send to this Unix socket by its path (systemd's notification socket).
    Notify,
}

/// One path the agent may touch, how, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathRule {
    pub path: PathBuf,
    pub access: Access,
    pub why: String,
}

/// Everything the confinement allows; nothing else is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Paths, at most one rule each (the widest access asked; the reasons joined).
    pub paths: Vec<PathRule>,
    /// TCP ports the agent may connect to (its API servers), and why.
    pub connect: BTreeMap<u16, String>,
    /// The TCP port it listens on.
    pub bind: Option<u16>,
    /// Whether connecting to abstract Unix sockets of other processes stays allowed: only
    /// when systemd's notification socket is one (`NOTIFY_SOCKET=@...`).
    pub abstract_unix: bool,
}

/// What start-up learnt that the plan needs, beyond the configuration: read from disk and
/// the environment once, before the confinement.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// Every file the credentials named when first read (kubeconfigs, certificates, keys,
    /// CA files, a service account's token), with the targets of symbolic links.
    pub credential_files: Vec<PathBuf>,
    /// The API servers the agent talks to: the credentials' `server`, each managed
    /// kubeconfig's servers and proxies, as URLs.
    pub servers: Vec<String>,
    /// Each hook's program as found on `PATH`, and its interpreter when it names one.
    pub programs: Vec<PathBuf>,
    /// Files read for name resolution and the system's trust store that exist here.
    pub system_files: Vec<(PathBuf, Access, &'static str)>,
    /// The directory of the kubelet's restart requests, when it is asked for.
    pub restart_dir: Option<PathBuf>,
    /// `NOTIFY_SOCKET`, when systemd set it.
    pub notify_socket: Option<String>,
    /// Where each `file:` source that is a symbolic link leads.
    pub links: BTreeMap<PathBuf, PathBuf>,
    /// Whether anything talks to the cluster (a cluster source, a webhook, the report).
    pub cluster: bool,
    /// Each target directory that is not there at start, and the nearest directory above
    /// it that is.
    pub absent: BTreeMap<PathBuf, PathBuf>,
    /// The Node the credentials name (a `system:node:NAME` certificate, a token bound to a
    /// Pod on a node), the report's when it has credentials of its own.
    pub node: Option<String>,
    /// This process's own `/proc` directory (`/proc/self` resolved).
    pub proc_self: Option<PathBuf>,
}

/// The plan for `run` with `config`, given `facts`.
pub fn plan(config: &crate::config::Run, facts: &Facts) -> Plan {
    let mut plan = Plan::default();
    let common = &config.common;
    // A target's directory that is not there yet is made by the agent once there is
    // something to keep: the place above it may have directories made in it.
    let mut target = |dir: PathBuf, access: Access, why: &str| {
        if let Some(above) = facts.absent.get(&dir) {
            let made = if access == Access::Own {
                Access::Own
            } else {
                Access::Make
            };
            plan.add(above.clone(), made, &format!("above {why}, not there yet"));
        }
        plan.add(dir, access, why);
    };
    target(
        parent(&common.bundle),
        Access::Replace,
        "the bundle's directory (it is replaced by rename)",
    );
    for manage in &common.manage {
        target(
            parent(&manage.path),
            Access::Replace,
            "a --manage file's directory",
        );
    }
    for kubeconfig in &common.manage_kubeconfig {
        target(
            parent(&kubeconfig.path),
            Access::Replace,
            "a --manage-kubeconfig file's directory",
        );
    }
    for dir in common.registry_dirs() {
        target(dir, Access::Own, "a --manage-registries directory");
    }
    plan.add(
        common.state_dir.clone(),
        Access::Own,
        "the state directory (history, records, the registry sets' records)",
    );
    if let Some(dir) = &facts.restart_dir {
        plan.add(dir.clone(), Access::Own, "the kubelet's restart requests");
    }
    for source in common.all_sources() {
        match source {
            crate::source::SourceSpec::File(path) => {
                plan.add(parent(&path), Access::Read, "a file: source's directory");
                if let Some(target) = facts.links.get(&path) {
                    plan.add(
                        parent(target),
                        Access::Read,
                        "the directory a file: source links to",
                    );
                }
            }
            crate::source::SourceSpec::Dir(path) => {
                plan.add(path, Access::Read, "a dir: source");
            }
            _ => {}
        }
    }
    for file in &facts.credential_files {
        plan.add(
            parent(file),
            Access::Read,
            "the credentials' directory (a rotated certificate is a new file there)",
        );
    }
    let server = &config.server;
    for file in [
        &server.tls_cert_file,
        &server.tls_private_key_file,
        &server.client_ca_file,
    ]
    .into_iter()
    .flatten()
    {
        plan.add(
            parent(file),
            Access::Read,
            "the endpoint's TLS files' directory (followed as they change)",
        );
    }
    for path in crate::kubelet_config::paths_for(config.kubelet_config.as_deref()) {
        plan.add(
            path,
            Access::ReadFile,
            "the kubelet's config (does it use the bundle?)",
        );
    }
    for program in &facts.programs {
        plan.add(program.clone(), Access::Run, "a hook's program");
    }
    if !facts.programs.is_empty() {
        plan.add(
            PathBuf::from("/dev/null"),
            Access::Device,
            "a hook's standard input and output",
        );
        // What a hook runs runs inside the same confinement, so it can do no more than the
        // agent; a hook that is a script runs the system's programs.
        for dir in [
            "/bin",
            "/sbin",
            "/usr/bin",
            "/usr/sbin",
            "/usr/local/bin",
            "/usr/local/sbin",
        ] {
            plan.add(
                PathBuf::from(dir),
                Access::RunAll,
                "the programs a hook runs",
            );
        }
        for dir in ["/lib", "/lib64", "/usr/lib", "/usr/lib64"] {
            plan.add(
                PathBuf::from(dir),
                Access::Read,
                "a hook's shared libraries",
            );
        }
        plan.add(
            PathBuf::from("/etc/ld.so.cache"),
            Access::ReadFile,
            "a hook's shared libraries",
        );
    }
    for (path, access, why) in &facts.system_files {
        plan.add(path.clone(), *access, why);
    }
    if let Some(proc_self) = &facts.proc_self {
        plan.add(proc_self.clone(), Access::Read, "its own process metrics");
    }
    plan.add(
        PathBuf::from("/proc/stat"),
        Access::ReadFile,
        "the boot time, for process_start_time_seconds",
    );
    plan.add(
        PathBuf::from("/proc/sys/fs/inotify"),
        Access::Read,
        "the inotify limits, for the message when they are exhausted",
    );
    if facts.cluster {
        // The API server's usual ports, so that credentials that are not there at start
        // (a node's first boot) need no new rule when they come.
        plan.allow_connect(6443, "an API server's usual port");
        plan.allow_connect(443, "an API server's usual port");
    }
    for url in &facts.servers {
        if let Some((port, named)) = server_port(url) {
            plan.allow_connect(port, "an API server");
            if named {
                plan.allow_connect(53, "name resolution over TCP (an API server by name)");
            }
        }
    }
    plan.bind = Some(server.listen.port());
    match facts.notify_socket.as_deref() {
        Some(socket) if socket.starts_with('@') => plan.abstract_unix = true,
        Some(socket) if socket.starts_with('/') => plan.add(
            PathBuf::from(socket),
            Access::Notify,
            "systemd's notification socket (READY=1, WATCHDOG=1)",
        ),
        _ => {}
    }
    plan.normalize();
    plan
}

impl Plan {
    /// Adds a rule; one on a path already listed widens it (a target's directory that is
    /// also a source's stays writable) and keeps both reasons.
    fn add(&mut self, path: PathBuf, access: Access, why: &str) {
        if let Some(rule) = self.paths.iter_mut().find(|r| r.path == path) {
            rule.access = rule.access.max(access);
            if !rule.why.split("; ").any(|w| w == why) {
                rule.why = format!("{}; {why}", rule.why);
            }
            return;
        }
        self.paths.push(PathRule {
            path,
            access,
            why: why.to_string(),
        });
    }

    /// Drops each directory rule that a rule on a directory above it already gives (a
    /// link's target inside the directory of the link: a service account's token), so that
    /// the plan names each place once however its files are laid out.
    fn normalize(&mut self) {
        let all = self.paths.clone();
        self.paths.retain(|rule| {
            !all.iter().any(|above| {
                above.path != rule.path
                    && rule.path.starts_with(&above.path)
                    && covers(above.access, rule.access)
            })
        });
    }

    /// What `now` needs that this plan, enforced, cannot give: a place that was not there
    /// at start or was replaced since (`held` and `seen` are the identities of the places
    /// then and now), or a port. Landlock rules hold inodes and are never widened: the only
    /// way to the new place is a new process.
    pub fn outgrown(
        &self,
        held: &BTreeMap<PathBuf, (u64, u64)>,
        now: &Plan,
        seen: &BTreeMap<PathBuf, (u64, u64)>,
    ) -> Option<String> {
        // A place that is not there now needs nothing yet. One is covered by a rule held
        // since start on it or above it, if that place is still the one held.
        for rule in now.paths.iter().filter(|r| seen.contains_key(&r.path)) {
            let covered = self.paths.iter().any(|old| {
                rule.path.starts_with(&old.path)
                    && covers(old.access, rule.access)
                    && held.contains_key(&old.path)
                    && seen.get(&old.path) == held.get(&old.path)
            });
            if !covered {
                let change = if held.contains_key(&rule.path) {
                    "was replaced"
                } else {
                    "is new"
                };
                return Some(format!(
                    "{} ({}) {change} since the agent started",
                    rule.path.display(),
                    rule.why
                ));
            }
        }
        now.connect
            .iter()
            .find(|(port, _)| !self.connect.contains_key(port))
            .map(|(port, why)| format!("TCP port {port} ({why}) is new since the agent started"))
    }

    fn allow_connect(&mut self, port: u16, why: &str) {
        self.connect.entry(port).or_insert_with(|| why.to_string());
    }
}

/// Whether a rule with `above` on a directory gives what `below` asks beneath it.
fn covers(above: Access, below: Access) -> bool {
    match above {
        Access::Read => matches!(below, Access::Read | Access::ReadFile),
        Access::Replace => matches!(below, Access::Read | Access::ReadFile | Access::Replace),
        Access::Make => matches!(
            below,
            Access::Read | Access::ReadFile | Access::Replace | Access::Make
        ),
        Access::Own => matches!(
            below,
            Access::Read | Access::ReadFile | Access::Replace | Access::Make | Access::Own
        ),
        Access::RunAll => matches!(below, Access::Run | Access::RunAll | Access::ReadFile),
        Access::ReadFile | Access::Run | Access::Device | Access::Notify => above == below,
    }
}

/// The directory a file is replaced in; a bare file name is in the working directory.
fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The port of an `https://HOST[:PORT]/...` URL (443 by default, 80 for `http://`), and
/// whether HOST is a name rather than an address. None for what does not parse.
pub fn server_port(url: &str) -> Option<(u16, bool)> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri.host()?;
    let port = match uri.port_u16() {
        Some(port) => port,
        None => match uri.scheme_str() {
            Some("http") => 80,
            _ => 443,
        },
    };
    let address = host.trim_start_matches('[').trim_end_matches(']');
    Some((port, address.parse::<std::net::IpAddr>().is_err()))
}

#[cfg(test)]
mod tests;
