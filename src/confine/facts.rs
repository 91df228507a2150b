//! What the plan needs from the disk and the environment, read once at start-up before the
//! confinement: the files the credentials name, the API servers, the hooks' programs, and
//! the system files name resolution and the trust store use.

use std::path::{Path, PathBuf};

use super::{Access, Facts};
use crate::credentials::Origin;

/// The files a resolver reads for each lookup (glibc's and musl's), read at their paths.
const RESOLVER_FILES: [&str; 5] = [
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
];

/// The system's trust store where the usual distributions keep it (what
/// rustls-native-certs looks at): public certificates only, never `/etc/ssl/private`.
const TRUST_STORE: [(&str, Access); 7] = [
    ("/etc/ssl/certs", Access::Read),
    ("/usr/share/ca-certificates", Access::Read),
    ("/etc/pki/tls/certs", Access::Read),
    ("/etc/pki/ca-trust/extracted", Access::Read),
    ("/etc/ssl/cert.pem", Access::ReadFile),
    ("/etc/ssl/ca-bundle.pem", Access::ReadFile),
    ("/etc/ca-certificates", Access::Read),
];

/// The dynamic loaders a hook's program may name.
const LOADERS: [&str; 4] = [
    "/lib64/ld-linux-x86-64.so.2",
    "/lib/ld-linux-aarch64.so.1",
    "/lib/ld-musl-x86_64.so.1",
    "/lib/ld-musl-aarch64.so.1",
];

impl Facts {
    /// Reads what `config` needs, with the credentials of `origins` (the sources', the
    /// report's).
    pub fn gather(config: &crate::config::Run, origins: &[&Origin]) -> Facts {
        let mut facts = Facts::default();
        for origin in origins {
            let attempt = crate::credentials::load::load(origin);
            facts.credential_files.extend(attempt.files);
            if let Ok(loaded) = attempt.result {
                let certificate = loaded.held.iter().find(|h| h.kind == "user");
                let named = certificate
                    .and_then(|h| h.certificate.subject_cn.strip_prefix("system:node:"))
                    .map(str::to_string)
                    .or(loaded.token_node);
                // The report's credentials come last, and name its Node.
                facts.node = named.filter(|n| !n.is_empty()).or(facts.node.take());
                facts.servers.push(loaded.server);
            }
            if let Origin::InCluster { dir, .. } = origin {
                facts.credential_files.push(dir.join("token"));
            }
        }
        for kubeconfig in &config.common.manage_kubeconfig {
            facts.servers.extend(kubeconfig_servers(&kubeconfig.path));
        }
        // Before the kubelet's first start its kubeconfig is not there yet; the bootstrap
        // kubeconfig names the same API server.
        for kubelet in crate::credentials::load::KUBELET_KUBECONFIGS {
            if origins.iter().any(|o| o.names(Path::new(kubelet.path))) {
                facts
                    .servers
                    .extend(kubeconfig_servers(Path::new(kubelet.bootstrap)));
            }
        }
        facts.cluster = !origins.is_empty();
        let common = &config.common;
        let managed = common.managed_paths();
        let target_dirs = managed
            .iter()
            .filter_map(|p| p.parent().map(Path::to_path_buf))
            .chain(common.registry_dirs());
        for dir in target_dirs {
            if dir.as_os_str().is_empty() || dir.exists() {
                continue;
            }
            if let Some(above) = dir.ancestors().skip(1).find(|a| a.is_dir()) {
                facts.absent.insert(dir.clone(), above.to_path_buf());
            }
        }
        for source in common.all_sources() {
            if let crate::source::SourceSpec::File(path) = source
                && let Ok(target) = std::fs::canonicalize(&path)
                && target != path
            {
                facts.links.insert(path, target);
            }
        }
        let commands =
            common
                .exec_on_change
                .iter()
                .map(|c| &c.0)
                .chain(match &common.kubeconfig_hook {
                    Some(crate::config::KubeconfigHook::Command(command)) => Some(command),
                    _ => None,
                });
        for command in commands {
            if let Ok(program) = crate::exec::check(command) {
                facts.programs.extend(interpreter(&program));
                facts.programs.push(program);
            }
        }
        if !facts.programs.is_empty() {
            facts
                .programs
                .extend(LOADERS.iter().map(PathBuf::from).filter(|p| p.exists()));
        }
        for file in RESOLVER_FILES {
            let path = Path::new(file);
            if !path.exists() {
                continue;
            }
            let (at, access) = resolver_rule(path, std::fs::canonicalize(path).ok());
            facts.system_files.push((at, access, "name resolution"));
        }
        for (path, access) in TRUST_STORE {
            if Path::new(path).exists() {
                facts
                    .system_files
                    .push((PathBuf::from(path), access, "the system's trust store"));
            }
        }
        let named = |variable| std::env::var_os(variable);
        facts.system_files.extend(
            trust_named(named("SSL_CERT_FILE"), named("SSL_CERT_DIR"))
                .into_iter()
                .map(|(path, access)| (path, access, "the system's trust store")),
        );
        facts.restart_dir = match &common.kubeconfig_hook {
            Some(crate::config::KubeconfigHook::Request(dir)) => Some(dir.clone()),
            _ => None,
        };
        facts.notify_socket = std::env::var("NOTIFY_SOCKET").ok();
        facts.proc_self = std::fs::canonicalize("/proc/self").ok();
        facts
    }
}

/// The directories of /run where a resolver replaces its file by rename: systemd-resolved's,
/// resolvconf's and NetworkManager's. Only these are read whole for a resolver's link; any
/// other (all of /run, for a link to /run/resolv.conf) would hand the agent far more.
const RESOLVER_DIRS: [&str; 3] = [
    "/run/systemd/resolve",
    "/run/resolvconf",
    "/run/NetworkManager",
];

/// The rule for a resolver's file at `path`, which resolves to `target`: the file itself,
/// or, for a link into one of [`RESOLVER_DIRS`], where the file is replaced by rename, that
/// directory (the link itself needs no rule: Landlock checks what is opened, not the link).
pub(super) fn resolver_rule(path: &Path, target: Option<PathBuf>) -> (PathBuf, Access) {
    match target.as_deref().and_then(Path::parent) {
        Some(dir) if RESOLVER_DIRS.iter().any(|known| dir == Path::new(known)) => {
            (dir.to_path_buf(), Access::Read)
        }
        _ => (path.to_path_buf(), Access::ReadFile),
    }
}

/// The trust store that `SSL_CERT_FILE` (`file`) and `SSL_CERT_DIR` (`dir`) name, when they
/// are set and not empty.
pub(super) fn trust_named(
    file: Option<std::ffi::OsString>,
    dir: Option<std::ffi::OsString>,
) -> Vec<(PathBuf, Access)> {
    [(file, Access::ReadFile), (dir, Access::Read)]
        .into_iter()
        .filter_map(|(value, access)| {
            value
                .filter(|v| !v.is_empty())
                .map(|v| (PathBuf::from(v), access))
        })
        .collect()
}

/// Every cluster's server and proxy of the kubeconfig at `path` (the removal check connects
/// to them), when it can be read now.
pub(super) fn kubeconfig_servers(path: &Path) -> Vec<String> {
    let Ok(config) = kube::config::Kubeconfig::read_from(path) else {
        return Vec::new();
    };
    config
        .clusters
        .iter()
        .filter_map(|c| c.cluster.as_ref())
        .flat_map(|c| [c.server.clone(), c.proxy_url.clone()])
        .flatten()
        .collect()
}

/// The interpreter a script names on its `#!` line.
pub(super) fn interpreter(program: &Path) -> Option<PathBuf> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let read = std::fs::File::open(program).ok()?.read(&mut head).ok()?;
    let line = head[..read].strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next()?;
    let text = std::str::from_utf8(line).ok()?;
    text.split_whitespace().next().map(PathBuf::from)
}
