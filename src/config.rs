//! The checked configuration: what the command line asked for, as the code below the
//! command layer takes it. `cli` parses the flags and the environment and converts them
//! into these types once, refusing what does not hold together (exit 2); the daemon, the
//! targets, the server and the publisher take these and never see clap.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::source::SourceSpec;

/// What the node agent (`run`) and `sync` keep: the bundle, the `--manage` files and the
/// registry sets, and how.
#[derive(Debug, Clone)]
pub struct Common {
    /// The bundle's sources, in priority order.
    pub sources: Vec<SourceSpec>,
    /// The bundle file.
    pub bundle: PathBuf,
    /// The kubeconfig named on the command line; None: the credentials are found as
    /// `credentials::Origin::resolve` says (in-cluster, `$KUBECONFIG`, `~/.kube/config`).
    pub kubeconfig: Option<PathBuf>,
    /// Where history, the records and the agent's memory are kept.
    pub state_dir: PathBuf,
    /// The mode of every managed file; never writable by group or others.
    pub file_mode: u32,
    /// Whether certificates past their notAfter are left out.
    pub drop_expired: bool,
    /// How long a certificate that left every source is kept (zero: not at all).
    pub retain_removed: Duration,
    /// The command run after each replace of the bundle; its program was found executable.
    pub exec_on_change: Option<ExecCommand>,
    /// How long that command may run before it is killed.
    pub exec_on_change_timeout: Duration,
    /// The other managed files, each at its own path.
    pub manage: Vec<ManageSpec>,
    /// The registry sets, each under its own directory, none overlapping a managed file.
    pub manage_registries: Vec<RegistriesSpec>,
    /// The kubeconfigs whose CA data is kept (`--manage-kubeconfig`).
    pub manage_kubeconfig: Vec<ManageSpec>,
    /// Run after a managed kubeconfig gained a CA (`--kubeconfig-hook`, or
    /// `--kubeconfig-restart-request`).
    pub kubeconfig_hook: Option<KubeconfigHook>,
}

impl Common {
    /// Every target's sources in the order of the targets: the bundle's first, then each
    /// `--manage` file's, each `--manage-kubeconfig`'s, each registry set's: the positions
    /// source updates carry.
    pub fn all_sources(&self) -> Vec<SourceSpec> {
        self.sources
            .iter()
            .chain(self.manage.iter().flat_map(|m| m.sources.iter()))
            .chain(self.manage_kubeconfig.iter().flat_map(|m| m.sources.iter()))
            .chain(self.manage_registries.iter().flat_map(|r| r.sources.iter()))
            .cloned()
            .collect()
    }

    /// How many of [`Common::all_sources`] are sources of files (the bundle's, the
    /// `--manage` files' and the kubeconfigs'); the registry sets' come after them.
    pub fn file_sources(&self) -> usize {
        self.sources.len()
            + self
                .manage
                .iter()
                .chain(&self.manage_kubeconfig)
                .map(|m| m.sources.len())
                .sum::<usize>()
    }

    /// The path of every managed file in the order of the targets: the bundle, each
    /// `--manage` file, each `--manage-kubeconfig`.
    pub fn managed_paths(&self) -> Vec<PathBuf> {
        std::iter::once(self.bundle.clone())
            .chain(self.manage.iter().map(|m| m.path.clone()))
            .chain(self.manage_kubeconfig.iter().map(|m| m.path.clone()))
            .collect()
    }

    /// The path of every `--manage-kubeconfig`.
    pub fn kubeconfig_paths(&self) -> Vec<PathBuf> {
        self.manage_kubeconfig
            .iter()
            .map(|m| m.path.clone())
            .collect()
    }

    /// The directory of every registry set, as given.
    pub fn registry_dirs(&self) -> Vec<PathBuf> {
        self.manage_registries
            .iter()
            .map(|r| r.dir.clone())
            .collect()
    }

    /// For the unit tests: the bundle at `bundle` from `sources`, the state in `state_dir`,
    /// and nothing else asked (the command line's defaults).
    #[cfg(test)]
    pub fn for_tests(bundle: &Path, state_dir: &Path, sources: Vec<SourceSpec>) -> Common {
        Common {
            sources,
            bundle: bundle.to_path_buf(),
            kubeconfig: None,
            state_dir: state_dir.to_path_buf(),
            file_mode: 0o644,
            drop_expired: false,
            retain_removed: Duration::ZERO,
            exec_on_change: None,
            exec_on_change_timeout: Duration::from_secs(60),
            manage: Vec::new(),
            manage_registries: Vec::new(),
            manage_kubeconfig: Vec::new(),
            kubeconfig_hook: None,
        }
    }

    /// The merge policy asked for.
    pub fn policy(&self) -> crate::bundle::Policy {
        crate::bundle::Policy {
            retain_removed: self.retain_removed.as_secs().try_into().unwrap_or(i64::MAX),
            drop_expired: self.drop_expired,
        }
    }
}

/// One `--manage` file: where it is, and its sources in priority order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManageSpec {
    /// The file kept.
    pub path: PathBuf,
    /// Its sources, in priority order; at least one.
    pub sources: Vec<SourceSpec>,
}

impl std::fmt::Display for ManageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write_path_sources(f, &self.path, &self.sources)
    }
}

/// One `--manage-registries` set: its directory, and its entry sources in priority order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistriesSpec {
    /// The directory holding one `<host[:port]>/ca.crt` per registry.
    pub dir: PathBuf,
    /// The sources of registry entries, in priority order; at least one.
    pub sources: Vec<SourceSpec>,
}

impl std::fmt::Display for RegistriesSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write_path_sources(f, &self.dir, &self.sources)
    }
}

/// `PATH=SPEC,SPEC`, as the flags take it.
fn write_path_sources(
    f: &mut std::fmt::Formatter<'_>,
    path: &Path,
    sources: &[SourceSpec],
) -> std::fmt::Result {
    let sources: Vec<String> = sources.iter().map(ToString::to_string).collect();
    write!(f, "{}={}", path.display(), sources.join(","))
}

/// The `--exec-on-change` command: its program and arguments, split as a shell would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecCommand(pub Vec<String>);

/// What is done after a managed kubeconfig gained a CA, so that the kubelet reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeconfigHook {
    /// `--kubeconfig-hook`: a command (its program and arguments).
    Command(Vec<String>),
    /// `--kubeconfig-restart-request`: the directory where the host's path unit takes the
    /// kubelet's restart requests.
    Request(PathBuf),
}

/// `run`: the node daemon.
#[derive(Debug, Clone)]
pub struct Run {
    /// What it keeps.
    pub common: Common,
    /// Its endpoint for metrics and health.
    pub server: Server,
    /// The kubelet's config file, when named; None: the usual places are looked at.
    pub kubelet_config: Option<PathBuf>,
    /// Where this node's report goes (SPEC 8c); `None` with `--no-node-report`.
    pub report: Option<NodeReport>,
}

/// This node's report on its Node (SPEC 8c).
#[derive(Debug, Clone, Default)]
pub struct NodeReport {
    /// `--report-kubeconfig`: None, the credentials of `--kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `--node-name` as given (not the host's name it defaults to elsewhere): it wins over
    /// the node the credentials name.
    pub node_name: Option<String>,
}

/// `sync`: one pass over what the node agent keeps.
#[derive(Debug, Clone)]
pub struct Sync {
    /// What it keeps.
    pub common: Common,
    /// Print the plan and write nothing.
    pub dry_run: bool,
    /// Write even though a running agent manages the file.
    pub force: bool,
}

/// The HTTP endpoint for metrics and health (`run`, and `publish` while it watches).
/// Checked as a whole: `--insecure-metrics` only alone and on loopback, and off loopback
/// some way to authenticate a scraper.
#[derive(Debug, Clone)]
pub struct Server {
    /// Where it listens.
    pub listen: SocketAddr,
    /// The serving certificate (PEM, with its chain); given with its key or not at all.
    pub tls_cert_file: Option<PathBuf>,
    /// The serving certificate's private key (PEM).
    pub tls_private_key_file: Option<PathBuf>,
    /// The lowest TLS version accepted.
    pub tls_min_version: TlsVersion,
    /// The CA bundle client certificates are verified against (mutual TLS).
    pub client_ca_file: Option<PathBuf>,
    /// Users allowed to read /metrics (empty entries are ignored).
    pub authorized_users: Vec<String>,
    /// Groups allowed to read /metrics (empty entries are ignored).
    pub authorized_groups: Vec<String>,
    /// Whether bearer tokens are accepted, checked with a TokenReview.
    pub authentication_token_webhook: bool,
    /// The audiences tokens must be meant for; empty: the API server's own.
    pub authentication_token_audiences: Vec<String>,
    /// How long an accepted TokenReview is cached.
    pub authentication_token_webhook_cache_ttl: Duration,
    /// Whether /metrics is authorized with a SubjectAccessReview when no allow-list is given.
    pub authorization_webhook: bool,
    /// How long an allowing SubjectAccessReview is cached.
    pub authorization_webhook_cache_authorized_ttl: Duration,
    /// How long a denying SubjectAccessReview is cached.
    pub authorization_webhook_cache_unauthorized_ttl: Duration,
    /// Serve /metrics without TLS or authentication (loopback only, nothing else asked).
    pub insecure_metrics: bool,
    /// This node's name, for logs and the build_info metric: as given, else this host's
    /// name; None when neither is known.
    pub node_name: Option<String>,
}

/// The lowest TLS version the endpoint accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsVersion {
    V1_2,
    V1_3,
}

/// `publish`: the cluster side, keeping the bundle (and the cloud and registry CAs) in a
/// ConfigMap.
#[derive(Debug, Clone)]
pub struct Publish {
    /// The key the bundle is kept in; never one the cloud or registry CAs use.
    pub to: ConfigMapRef,
    /// The bundle's sources (cluster kinds only), in priority order.
    pub sources: Vec<SourceSpec>,
    /// The cloud-provider CA's sources; empty: the key is not kept.
    pub cloud_ca_sources: Vec<SourceSpec>,
    /// The sources of the CA data of the nodes' kubeconfigs; empty: the key is not kept.
    pub kubeconfig_ca_sources: Vec<SourceSpec>,
    /// The registry entries' sources, none of them also a source of a bundle; empty: no
    /// registry keys are kept.
    pub registry_sources: Vec<SourceSpec>,
    /// The kubeconfig named on the command line; None: found as for [`Common::kubeconfig`].
    pub kubeconfig: Option<PathBuf>,
    /// Whether certificates past their notAfter are left out.
    pub drop_expired: bool,
    /// The Nodes the fleet's metrics count (a label selector); None: every Node.
    pub node_selector: Option<String>,
    /// The endpoint served while watching; None with `--once`, which publishes once and
    /// exits (and serves nothing).
    pub server: Option<Server>,
}

/// A key of a ConfigMap (`publish --to`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigMapRef {
    pub namespace: String,
    pub name: String,
    pub key: String,
}

impl std::fmt::Display for ConfigMapRef {
    /// As a source spec would name it: the `filepath` label of the publisher's metrics.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "configmap:{}/{}/{}", self.namespace, self.name, self.key)
    }
}

/// `rollout status` and `rollout wait` (SPEC 8c): what the nodes are asked about, and how.
#[derive(Debug, Clone)]
pub struct Rollout {
    /// The sources whose bundle the nodes should hold, in priority order.
    pub sources: Vec<SourceSpec>,
    /// The entry of each node's report asked about: `None`, the node's bundle.
    pub target: Option<String>,
    /// A label selector of the Nodes counted; `None`, every Node.
    pub selector: Option<String>,
    /// The kubeconfig named on the command line; None: found as kubectl finds it.
    pub kubeconfig: Option<PathBuf>,
    /// `--context`, `--cluster`, `--user`: what of the kubeconfig is used.
    pub pick: crate::credentials::Pick,
    /// Whether the nodes leave certificates past their notAfter out (`--drop-expired`).
    pub drop_expired: bool,
    /// `status`: JSON instead of a table.
    pub json: bool,
    /// `wait`: the condition and how long to wait for it; `None` for `status`.
    pub wait: Option<RolloutWait>,
}

/// `rollout wait --for ... --timeout D`.
#[derive(Debug, Clone)]
pub struct RolloutWait {
    pub condition: WaitFor,
    /// `None`: wait as long as it takes.
    pub timeout: Option<Duration>,
}

/// `--for`: what every counted node must come to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitFor {
    /// Hold exactly what the sources make.
    Sources,
    /// Hold each of these certificates.
    Add(Vec<Fingerprints>),
    /// Hold none of these certificates.
    Remove(Vec<Fingerprints>),
}

/// Certificates named on the command line: a SHA-256 fingerprint, its first digits (at
/// least 12: resolved once the sources are read and the Nodes listed), or every certificate
/// of a PEM file (read when the command starts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fingerprints {
    Sha(crate::fleet::held::Sha),
    Prefix(crate::fleet::prefix::ShaPrefix),
    File(PathBuf),
}
