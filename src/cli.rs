//! The command line (SPEC 3). Every flag can also be set as `KUBELET_CA_AGENT_<FLAG>`.

pub mod convert;
pub mod environment;

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::{ConfigMapRef, ExecCommand, Fingerprints, ManageSpec, RegistriesSpec, WaitFor};
use crate::source::SourceSpec;

#[derive(Debug, Parser)]
#[command(
    name = "kubelet-ca-agent",
    version,
    about = "Keeps a node's kubelet client-CA bundle correct: merges the signer certificates \
             from its sources and replaces the bundle file atomically when they change.",
    after_help = "Every flag can also be set in the environment as KUBELET_CA_AGENT_<FLAG> \
                  (upper case, dashes as underscores), e.g. KUBELET_CA_AGENT_BUNDLE=/tmp/ca.crt.\n\
                  Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub log: LogArgs,
}

/// The name under which kubectl runs the binary as its plugin: `kubectl kubelet-ca ...`
/// runs `kubectl-kubelet_ca` found on PATH (a dash in a plugin's command is an underscore
/// in its file name).
pub const KUBECTL_PLUGIN: &str = "kubectl-kubelet_ca";

/// Whether the binary was called as the kubectl plugin (`argv[0]`'s file name).
pub fn is_kubectl_plugin(argv0: &std::ffi::OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .is_some_and(|name| name == KUBECTL_PLUGIN)
}

/// The command line's definition; as the kubectl plugin, its help and usage name it
/// `kubectl kubelet-ca`.
pub fn command(plugin: bool) -> clap::Command {
    use clap::CommandFactory;
    let command = Cli::command();
    if plugin {
        command
            .name("kubectl kubelet-ca")
            .bin_name("kubectl kubelet-ca")
            .display_name("kubectl kubelet-ca")
    } else {
        command
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon: watch the sources and the file, keep the bundle converged.
    #[command(
        long_about = "Run the daemon: watch the sources and the file, and keep the bundle converged.\n\n\
                      Writes the bundle within a second of a source change, repairs the file when \
                      something else changes or deletes it, keeps the last good bundle while a source \
                      is unreachable or invalid, and serves /metrics, /healthz, /livez and /readyz on \
                      --listen. Speaks the systemd notify protocol (READY=1, STATUS=, WATCHDOG=1). \
                      SIGTERM or SIGINT finishes a write in progress, then exits 0."
    )]
    Run(Box<RunArgs>),
    /// Cluster side: derive a small ConfigMap holding the bundle from the sources.
    #[command(
        long_about = "Cluster side: build the bundle from the sources (by default the \
                      ControllerConfig machine-config-controller) with the node agent's rules, and \
                      keep it in the ConfigMap named by --to with server-side apply, annotated with \
                      its SHA-256 and the source specs. The ConfigMap is written only when the \
                      bundle changes, so a source update that leaves the bundle as it is wakes no \
                      node agent; it is never given an empty or invalid bundle (a bad source keeps \
                      the last one). A ConfigMap deleted, or edited so that its content no longer \
                      matches its SHA-256 annotation, is written again. Safe with several replicas \
                      (one field manager, idempotent apply). Serves /metrics, /healthz, /livez and \
                      /readyz like run.\n\n\
                      With --cloud-ca-source and --registry-source the same ConfigMap also keeps \
                      the cloud-provider CA (key cloud-ca.pem, empty when there is none) and one \
                      key registry.<host..port> per registry CA, so that nodes still watch one \
                      small object; it is written only when one of these keys changes.\n\n\
                      With --once: read the sources, apply if the bundle changed, and exit 0 \
                      (applied, or already published), 1 (a source or the API server failed; \
                      the ConfigMap was left as it was, or, for a source of another key or a \
                      refused registry entry, that key) or 2 (usage error)."
    )]
    Publish(Box<PublishArgs>),
    /// Build the bundle from the sources once, write it if it changed, and exit.
    #[command(
        long_about = "Build the bundle from the sources once, write it if it changed, and exit.\n\n\
                      Exits 0 when the file was written or was already in sync, 1 when a source \
                      is unreadable or rejected or the write failed (the file is left as it was), \
                      2 on a usage error (a bundle whose directory does not exist, a bundle that a \
                      running agent manages). With --dry-run: exits 0 having written nothing, and \
                      says on stderr when the sync itself would be refused."
    )]
    Sync(SyncArgs),
    /// Show the certificates in a bundle, their validity and the time they have left.
    #[command(
        long_about = "Show the certificates in a bundle, their validity and the time they have left.\n\n\
                      Exits 0 when every certificate is valid, 1 when one is expired, not yet valid, \
                      expires within --warn-within or a block is broken, 2 when the input is \
                      unreadable or holds no certificate."
    )]
    Inspect(InspectArgs),
    /// Keep the managed files out of configuration-drift checks and rendered node configs.
    #[command(
        subcommand,
        long_about = "Keep the managed files out of configuration-drift checks and rendered node configs.\n\n\
                      The managed files are read from <state-dir>/managed-files.json (written by run \
                      and sync), or taken from --bundle when it does not exist yet."
    )]
    Drift(DriftCommand),
    /// Cluster side: how many nodes hold what the sources make, and wait until they all do.
    #[command(
        subcommand,
        long_about = "Cluster side: read what each node says it holds (the kubelet-ca-agent/held \
                      annotation the node agent writes on its own Node) and tell how many nodes \
                      hold what the sources make, or wait until every node does: the gates of a CA \
                      rotation. Needs only get, list and watch on nodes and on the sources."
    )]
    Rollout(RolloutCommand),
    /// Print the version.
    Version,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The logging flags, under a heading of their own in every command's help: they are
/// global, and would otherwise fall among the command's own flags.
#[derive(Debug, Args)]
#[command(next_help_heading = "Logging")]
pub struct LogArgs {
    /// Log format on stderr.
    #[arg(long, global = true, env = "KUBELET_CA_AGENT_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log level: error, warn (or warning), info, debug, trace or off, in any case; or
    /// tracing directives such as `info,kubelet_ca_agent=debug`. RUST_LOG wins if set.
    #[arg(
        long,
        global = true,
        env = "KUBELET_CA_AGENT_LOG_LEVEL",
        default_value = "info",
        value_parser = crate::logging::parse_level
    )]
    pub log_level: String,
}

/// Flags shared by the commands that build and write the bundle.
#[derive(Debug, Args)]
pub struct CommonArgs {
    /// Where the signers come from, in priority order (repeat the flag, or separate with
    /// commas): configmap:NAMESPACE/NAME[/KEY|/PREFIX*|/*], controllerconfig:NAME[/FIELD],
    /// file:PATH, dir:PATH.
    #[arg(
        long = "source",
        value_name = "SPEC",
        env = "KUBELET_CA_AGENT_SOURCE",
        value_delimiter = ',',
        default_value = crate::source::DEFAULT_SOURCE,
        value_parser = parse_source_spec
    )]
    pub sources: Vec<SourceSpec>,
    /// The bundle file to manage.
    #[arg(
        long,
        value_name = "PATH",
        env = "KUBELET_CA_AGENT_BUNDLE",
        default_value = "/etc/kubernetes/kubelet-ca.crt"
    )]
    pub bundle: PathBuf,
    /// Kubeconfig for cluster sources. Default: in-cluster, then $KUBECONFIG, then
    /// ~/.kube/config when it exists, then the kubelet's own kubeconfig
    /// (/var/lib/kubelet/kubeconfig on OpenShift, /etc/kubernetes/kubelet.conf on kubeadm);
    /// the choice is said at start.
    #[arg(long, value_name = "PATH", env = "KUBELET_CA_AGENT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Where history and the agent's memory are kept.
    #[arg(
        long,
        value_name = "PATH",
        env = "KUBELET_CA_AGENT_STATE_DIR",
        default_value = "/var/lib/kubelet-ca-agent"
    )]
    pub state_dir: PathBuf,
    /// Mode of the bundle file, in octal. Group or other write access is refused.
    #[arg(long, value_name = "OCTAL", env = "KUBELET_CA_AGENT_FILE_MODE", default_value = "0644", value_parser = parse_file_mode)]
    pub file_mode: u32,
    /// Leave certificates past their notAfter out of the bundle (default: keep them).
    #[arg(long, env = "KUBELET_CA_AGENT_DROP_EXPIRED", value_parser = BoolishValueParser::new())]
    pub drop_expired: bool,
    /// Keep a certificate that left every source for this long (never past its notAfter),
    /// e.g. 36h or 30d. 0s: the sources are the truth.
    #[arg(long, value_name = "DURATION", env = "KUBELET_CA_AGENT_RETAIN_REMOVED", default_value = "0s", value_parser = parse_span_of_days)]
    pub retain_removed: Duration,
    /// Run this command (no shell; words split like a shell would) after each replace of the
    /// bundle, with KUBELET_CA_BUNDLE set to its path. One run at a time: replaces during a
    /// run make one more run after it. Failures are logged and counted, not retried. The
    /// program must exist and be executable (found on PATH when it has no slash), or sync
    /// and run refuse to start (exit 2).
    #[arg(long, value_name = "CMD", env = "KUBELET_CA_AGENT_EXEC_ON_CHANGE", value_parser = parse_command)]
    pub exec_on_change: Option<ExecCommand>,
    /// Kill an --exec-on-change command (and its process group) that runs longer than this.
    #[arg(long, value_name = "DURATION", env = "KUBELET_CA_AGENT_EXEC_ON_CHANGE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub exec_on_change_timeout: Duration,
    /// One more CA file to keep, from sources of its own (same forms as --source), with
    /// every guarantee the bundle has (repeat the flag; in the environment, separate files
    /// with ';'), e.g.
    /// /etc/kubernetes/static-pod-resources/configmaps/cloud-config/ca-bundle.pem=controllerconfig:machine-config-controller/cloudProviderCAData,
    /// or =configmap:NS/NAME/cloud-ca.pem from the ConfigMap publish keeps. A file whose
    /// sources hold no certificate (an empty field, an empty or blank key) is neither created
    /// nor emptied.
    #[arg(
        long = "manage",
        value_name = "PATH=SPEC[,SPEC...]",
        env = "KUBELET_CA_AGENT_MANAGE",
        value_delimiter = ';',
        value_parser = parse_manage
    )]
    pub manage: Vec<ManageSpec>,
    /// A kubeconfig whose cluster's certificate-authority-data to keep equal to the bundle of
    /// these sources (same forms as --source; repeat the flag; in the environment, separate
    /// kubeconfigs with ';'), e.g.
    /// /var/lib/kubelet/kubeconfig=configmap:openshift-machine-config-operator/kubeconfig-data.
    /// The cluster is the current context's, or the only one. Nothing else in the file
    /// changes. A CA is added at once; one is dropped only once the new CA data alone
    /// verifies the certificate that the kubeconfig's server presents (on several fresh
    /// connections): until then the dropped CAs stay, and /readyz?verbose says why.
    #[arg(
        long = "manage-kubeconfig",
        value_name = "PATH=SPEC[,SPEC...]",
        env = "KUBELET_CA_AGENT_MANAGE_KUBECONFIG",
        value_delimiter = ';',
        value_parser = parse_manage
    )]
    pub manage_kubeconfig: Vec<ManageSpec>,
    /// Run (no shell; words split like a shell would) after a managed kubeconfig gained a
    /// CA, never when it only lost one, with KUBELET_CA_KUBECONFIG set to its path and
    /// KUBELET_CA_ADDED to the SHA-256 of each added certificate: the kubelet reads its
    /// kubeconfig's CA data only when it starts, so this restarts it (e.g. systemctl
    /// restart kubelet). One run at a time; a failure is counted and run again with backoff.
    #[arg(long, value_name = "CMD", env = "KUBELET_CA_AGENT_KUBECONFIG_HOOK", value_parser = parse_command)]
    pub kubeconfig_hook: Option<ExecCommand>,
    /// Instead of --kubeconfig-hook, ask the host to restart the kubelet after a managed
    /// kubeconfig gained a CA: the agent writes DIR/request, which the host's
    /// kubelet-ca-agent-kubelet-restart.path unit takes (it runs systemctl restart
    /// kubelet.service and writes how that ended as DIR/result). The agent itself never holds
    /// systemd's bus. Until the host takes a request, the restart is shown as pending with the
    /// reason. Same rules as the hook: one at a time, coalesced, counted and retried with
    /// backoff on failure.
    #[arg(
        long,
        value_name = "DIR",
        env = "KUBELET_CA_AGENT_KUBECONFIG_RESTART_REQUEST",
        num_args = 0..=1,
        default_missing_value = crate::kubelet_restart::DEFAULT_DIR,
        conflicts_with = "kubeconfig_hook"
    )]
    pub kubeconfig_restart_request: Option<PathBuf>,
    /// Replaced by --kubeconfig-restart-request: kubelet.service is read as
    /// --kubeconfig-restart-request /run/kubelet-ca-agent/kubelet-restart, with a warning.
    #[arg(
        long,
        value_name = "UNIT",
        env = "KUBELET_CA_AGENT_KUBECONFIG_RESTART_UNIT",
        value_parser = parse_unit,
        conflicts_with_all = ["kubeconfig_hook", "kubeconfig_restart_request"],
        hide = true
    )]
    pub kubeconfig_restart_unit: Option<String>,
    /// A set of registry CA files under DIR, one DIR/<host[:port]>/ca.crt for each entry of
    /// the sources (repeat the flag; in the environment, separate sets with ';'), e.g.
    /// /etc/docker/certs.d=controllerconfig:machine-config-controller/imageRegistryBundleData,controllerconfig:machine-config-controller/imageRegistryBundleUserData.
    /// Entry sources: controllerconfig:NAME/imageRegistryBundleData|imageRegistryBundleUserData,
    /// configmap:NS/NAME/* (each key host..port is one registry), configmap:NS/NAME/PREFIX*
    /// (each key PREFIXhost..port, e.g. registry.* in the ConfigMap publish keeps), dir:PATH
    /// (each <host..port>.crt is one). The first source naming a registry wins. The agent
    /// removes only what it created; an admin's own directories and files under DIR stay.
    #[arg(
        long = "manage-registries",
        value_name = "DIR=SPEC[,SPEC...]",
        env = "KUBELET_CA_AGENT_MANAGE_REGISTRIES",
        value_delimiter = ';',
        value_parser = parse_manage_registries
    )]
    pub manage_registries: Vec<RegistriesSpec>,
}

fn parse_manage_registries(s: &str) -> Result<RegistriesSpec, String> {
    let registry_source = |spec: &str| {
        let parsed: SourceSpec = spec
            .parse()
            .map_err(|e: crate::source::SpecError| e.to_string())?;
        parsed.check_registry_source().map_err(|e| e.to_string())?;
        Ok(parsed)
    };
    let (dir, sources) = parse_path_sources(
        s,
        "DIR",
        "/etc/docker/certs.d=dir:/etc/registry-cas",
        "directory",
        registry_source,
    )?;
    Ok(RegistriesSpec { dir, sources })
}

/// `PATH=SPEC[,SPEC...]` (`--manage`, `--manage-registries`): the path and its sources in
/// order, each parsed by `source`. `form` and `example` name the form in errors, `what` the
/// kind of path.
fn parse_path_sources(
    s: &str,
    form: &str,
    example: &str,
    what: &str,
    source: impl Fn(&str) -> Result<SourceSpec, String>,
) -> Result<(PathBuf, Vec<SourceSpec>), String> {
    let s = s.trim();
    let (path, specs) = s.split_once('=').ok_or_else(|| {
        format!("{s:?} names no sources: expected {form}=SPEC[,SPEC...], e.g. {example}")
    })?;
    let path = path.trim();
    if path.is_empty() {
        return Err(format!("{s:?} names no {what} before '='"));
    }
    let sources = specs
        .split(',')
        .map(str::trim)
        .filter(|spec| !spec.is_empty())
        .map(source)
        .collect::<Result<Vec<_>, _>>()?;
    if sources.is_empty() {
        return Err(format!("{path} has no sources after '='"));
    }
    Ok((PathBuf::from(path), sources))
}

fn parse_manage(s: &str) -> Result<ManageSpec, String> {
    let (path, sources) = parse_path_sources(
        s,
        "PATH",
        "/etc/pki/ca.pem=file:/run/ca.pem",
        "file",
        parse_source_spec,
    )?;
    Ok(ManageSpec { path, sources })
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub server: ServerArgs,
    /// The kubelet's config file (KubeletConfiguration, YAML or JSON), read at start and
    /// once a minute to tell whether its authentication.x509.clientCAFile is the bundle
    /// (the kubelet-uses-bundle check). Default: /var/lib/kubelet/config.yaml, else
    /// /etc/kubernetes/kubelet.conf.
    #[arg(long, value_name = "PATH", env = "KUBELET_CA_AGENT_KUBELET_CONFIG")]
    pub kubelet_config: Option<PathBuf>,
    /// The kubeconfig whose node-scoped credentials write this node's report (what each
    /// target holds, the kubelet-ca-agent/held annotation on its own Node, for `rollout`).
    /// Default: the --kubeconfig in use (the unit's is the kubelet's). The Node is
    /// --node-name, else the system:node:NAME of these credentials.
    #[arg(long, value_name = "PATH", env = "KUBELET_CA_AGENT_REPORT_KUBECONFIG")]
    pub report_kubeconfig: Option<PathBuf>,
    /// Do not write this node's report on its Node.
    #[arg(long, env = "KUBELET_CA_AGENT_NO_NODE_REPORT", value_parser = BoolishValueParser::new())]
    pub no_node_report: bool,
}

/// The HTTP endpoint for metrics and health (`run`, and later `publish`).
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Address and port for /metrics, /healthz, /livez and /readyz: 127.0.0.1:9745,
    /// [::1]:9745, or [$(HOST_IP)]:9745 (brackets are taken around IPv4 too).
    #[arg(
        long,
        value_name = "ADDR:PORT",
        env = "KUBELET_CA_AGENT_LISTEN",
        default_value = "127.0.0.1:9745",
        value_parser = parse_listen
    )]
    pub listen: std::net::SocketAddr,
    /// Serving certificate (PEM, with its chain) for the endpoint; reloaded when it changes.
    /// Without it: plain HTTP on a loopback address, else an in-memory self-signed
    /// certificate (with a warning).
    #[arg(
        long,
        value_name = "PATH",
        env = "KUBELET_CA_AGENT_TLS_CERT_FILE",
        requires = "tls_private_key_file"
    )]
    pub tls_cert_file: Option<PathBuf>,
    /// The serving certificate's private key (PEM); reloaded when it changes.
    #[arg(
        long,
        value_name = "PATH",
        env = "KUBELET_CA_AGENT_TLS_PRIVATE_KEY_FILE",
        requires = "tls_cert_file"
    )]
    pub tls_private_key_file: Option<PathBuf>,
    /// The lowest TLS version accepted.
    #[arg(long, value_name = "1.2|1.3", env = "KUBELET_CA_AGENT_TLS_MIN_VERSION", value_enum, default_value_t = TlsVersion::V1_2)]
    pub tls_min_version: TlsVersion,
    /// Verify client certificates against this CA bundle (mutual TLS): a certificate's CN is
    /// its user, its O values its groups. Reloaded when the file changes; it may be the
    /// managed bundle itself, reloaded right after each of the agent's own writes.
    #[arg(long, value_name = "PATH", env = "KUBELET_CA_AGENT_CLIENT_CA_FILE")]
    pub client_ca_file: Option<PathBuf>,
    /// Users allowed to read /metrics (comma-separated), checked locally with no API call.
    #[arg(
        long,
        value_name = "LIST",
        env = "KUBELET_CA_AGENT_AUTHORIZED_USERS",
        value_delimiter = ','
    )]
    pub authorized_users: Vec<String>,
    /// Groups allowed to read /metrics (comma-separated), checked locally with no API call.
    #[arg(
        long,
        value_name = "LIST",
        env = "KUBELET_CA_AGENT_AUTHORIZED_GROUPS",
        value_delimiter = ','
    )]
    pub authorized_groups: Vec<String>,
    /// Accept `Authorization: Bearer` tokens on /metrics, checked with a TokenReview against
    /// the API server (so they stop working while it is unreachable; client certificates do not).
    #[arg(long, env = "KUBELET_CA_AGENT_AUTHENTICATION_TOKEN_WEBHOOK", value_parser = BoolishValueParser::new())]
    pub authentication_token_webhook: bool,
    /// Audiences the tokens must be meant for (comma-separated); default: the API server's own.
    #[arg(
        long,
        value_name = "LIST",
        env = "KUBELET_CA_AGENT_AUTHENTICATION_TOKEN_AUDIENCES",
        value_delimiter = ',',
        requires = "authentication_token_webhook"
    )]
    pub authentication_token_audiences: Vec<String>,
    /// How long an accepted token's TokenReview is cached (a rejected one: 10 s).
    #[arg(long, value_name = "DURATION", env = "KUBELET_CA_AGENT_AUTHENTICATION_TOKEN_WEBHOOK_CACHE_TTL", default_value = "2m", value_parser = parse_duration)]
    pub authentication_token_webhook_cache_ttl: Duration,
    /// Authorize /metrics with a SubjectAccessReview (verb get on the request path) when no
    /// static allow-list is given.
    #[arg(long, env = "KUBELET_CA_AGENT_AUTHORIZATION_WEBHOOK", value_parser = BoolishValueParser::new())]
    pub authorization_webhook: bool,
    /// How long an allowing SubjectAccessReview is cached.
    #[arg(long, value_name = "DURATION", env = "KUBELET_CA_AGENT_AUTHORIZATION_WEBHOOK_CACHE_AUTHORIZED_TTL", default_value = "5m", value_parser = parse_duration)]
    pub authorization_webhook_cache_authorized_ttl: Duration,
    /// How long a denying SubjectAccessReview is cached.
    #[arg(long, value_name = "DURATION", env = "KUBELET_CA_AGENT_AUTHORIZATION_WEBHOOK_CACHE_UNAUTHORIZED_TTL", default_value = "30s", value_parser = parse_duration)]
    pub authorization_webhook_cache_unauthorized_ttl: Duration,
    /// Serve /metrics without TLS or authentication; only allowed on a loopback address.
    #[arg(long, env = "KUBELET_CA_AGENT_INSECURE_METRICS", value_parser = BoolishValueParser::new())]
    pub insecure_metrics: bool,
    /// This node's name: the Node `run` reports on, shown in logs and as the `node` label of
    /// kubelet_ca_agent_build_info. Default (unset or empty): for run, the node the credentials
    /// name (a system:node:NAME client certificate, or a service account token bound to a Pod
    /// on a node), else this host's name, as `hostname` prints it; for publish, this host's
    /// name. Given, and not the node the
    /// credentials name, it is said once at start (the API server refuses that report to
    /// them).
    #[arg(long, value_name = "NAME", env = "KUBELET_CA_AGENT_NODE_NAME")]
    pub node_name: Option<String>,
}

/// This host's name (the kernel's nodename, which `gethostname(2)` returns), if it has one.
pub fn host_name() -> Option<String> {
    let uts = nix::sys::utsname::uname().ok()?;
    let name = uts.nodename().to_str()?.trim();
    (!name.is_empty()).then(|| name.to_string())
}

/// `--tls-min-version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TlsVersion {
    #[value(name = "1.2")]
    V1_2,
    #[value(name = "1.3")]
    V1_3,
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    /// The ConfigMap to keep the bundle in: NAMESPACE/NAME, key ca-bundle.crt unless
    /// NAMESPACE/NAME/KEY.
    #[arg(long, value_name = "NS/NAME[/KEY]", env = "KUBELET_CA_AGENT_TO", value_parser = parse_configmap_ref)]
    pub to: ConfigMapRef,
    /// Publish once and exit instead of watching.
    #[arg(long, env = "KUBELET_CA_AGENT_ONCE", value_parser = BoolishValueParser::new())]
    pub once: bool,
    /// Count only the Nodes with these labels in the fleet's metrics (a label selector, e.g.
    /// kubernetes.io/os=linux: the nodes that run the node agent). Default: every Node.
    #[arg(long, value_name = "LABELS", env = "KUBELET_CA_AGENT_NODE_SELECTOR")]
    pub node_selector: Option<String>,
    /// Where the signers come from, in priority order (repeat the flag, or separate with
    /// commas): configmap:NAMESPACE/NAME[/KEY|/PREFIX*|/*] or controllerconfig:NAME[/FIELD].
    #[arg(
        long = "source",
        value_name = "SPEC",
        env = "KUBELET_CA_AGENT_SOURCE",
        value_delimiter = ',',
        default_value = "controllerconfig:machine-config-controller",
        value_parser = parse_cluster_source_spec
    )]
    pub sources: Vec<SourceSpec>,
    /// Also keep the cloud-provider CA in key cloud-ca.pem of the same ConfigMap, from these
    /// sources (same forms as --source; repeat the flag, or separate with commas), e.g.
    /// controllerconfig:machine-config-controller/cloudProviderCAData: their certificates,
    /// validated and merged as the bundle's, or the empty string when they hold none. A bad
    /// update keeps the key as it is.
    #[arg(
        long = "cloud-ca-source",
        value_name = "SPEC",
        env = "KUBELET_CA_AGENT_CLOUD_CA_SOURCE",
        value_delimiter = ',',
        value_parser = parse_cluster_source_spec
    )]
    pub cloud_ca_sources: Vec<SourceSpec>,
    /// Also keep the CA data of the nodes' kubeconfigs in key kubeconfig-ca.crt of the same
    /// ConfigMap, from these sources (same forms as --source; repeat the flag, or separate
    /// with commas), e.g. configmap:openshift-machine-config-operator/kubeconfig-data (PEM,
    /// or base64 of PEM), so that nodes behind the publisher read one object
    /// (--manage-kubeconfig PATH=configmap:NS/NAME/kubeconfig-ca.crt). A bad update, or
    /// sources that hold nothing, keep the key as it is.
    #[arg(
        long = "kubeconfig-ca-source",
        value_name = "SPEC",
        env = "KUBELET_CA_AGENT_KUBECONFIG_CA_SOURCE",
        value_delimiter = ',',
        value_parser = parse_cluster_source_spec
    )]
    pub kubeconfig_ca_sources: Vec<SourceSpec>,
    /// Also keep the registry CAs in the same ConfigMap, one key registry.<host..port> per
    /// registry these sources name (repeat the flag, or separate with commas):
    /// controllerconfig:NAME/imageRegistryBundleData|imageRegistryBundleUserData, or
    /// configmap:NS/NAME/* (each key host..port is one registry). The first source naming a
    /// registry wins; a registry whose entry is refused keeps its key as it is, one that
    /// leaves the sources loses it. An IPv6 registry cannot be a ConfigMap key: it is skipped,
    /// with a warning.
    #[arg(
        long = "registry-source",
        value_name = "SPEC",
        env = "KUBELET_CA_AGENT_REGISTRY_SOURCE",
        value_delimiter = ',',
        value_parser = parse_cluster_registry_source
    )]
    pub registry_sources: Vec<SourceSpec>,
    /// Kubeconfig. Default: in-cluster, then $KUBECONFIG, then ~/.kube/config when it
    /// exists, then the kubelet's own kubeconfig (/var/lib/kubelet/kubeconfig,
    /// /etc/kubernetes/kubelet.conf).
    #[arg(long, value_name = "PATH", env = "KUBELET_CA_AGENT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Leave certificates past their notAfter out of the bundle (default: keep them).
    #[arg(long, env = "KUBELET_CA_AGENT_DROP_EXPIRED", value_parser = BoolishValueParser::new())]
    pub drop_expired: bool,
    #[command(flatten)]
    pub server: ServerArgs,
}

fn parse_configmap_ref(s: &str) -> Result<ConfigMapRef, String> {
    use crate::source::Keys;
    match format!("configmap:{s}").parse::<SourceSpec>() {
        Ok(SourceSpec::ConfigMap {
            namespace,
            name,
            keys: Keys::One(key),
        }) => Ok(ConfigMapRef {
            namespace,
            name,
            key,
        }),
        Ok(_) => Err(format!(
            "{s:?}: name one key (NAMESPACE/NAME/KEY), not /* or /PREFIX*"
        )),
        Err(e) if e.problem.starts_with("expected ") => Err(format!(
            "{s:?}: expected NAMESPACE/NAME or NAMESPACE/NAME/KEY"
        )),
        Err(e) => Err(format!("{s:?}: {}", e.problem)),
    }
}

/// A source `publish` can watch: the cluster kinds only. Local files belong to the node
/// agent (`run`, `sync`); a publisher runs in a pod, where the cluster is the source.
fn parse_cluster_source_spec(s: &str) -> Result<SourceSpec, String> {
    let spec = parse_source_spec(s)?;
    if !spec.is_cluster() {
        return Err(format!(
            "{s:?}: publish reads cluster sources only (configmap:NAMESPACE/NAME[/KEY|/PREFIX*|/*] or controllerconfig:NAME[/FIELD])"
        ));
    }
    Ok(spec)
}

/// A `--registry-source` of `publish`: a source of a registry set, from the cluster.
fn parse_cluster_registry_source(s: &str) -> Result<SourceSpec, String> {
    let spec: SourceSpec = s
        .parse()
        .map_err(|e: crate::source::SpecError| e.to_string())?;
    if !spec.is_cluster() {
        return Err(format!(
            "{s:?}: publish reads cluster sources only (controllerconfig:NAME/imageRegistryBundleData, controllerconfig:NAME/imageRegistryBundleUserData or configmap:NAMESPACE/NAME/*)"
        ));
    }
    spec.check_registry_source().map_err(|e| e.to_string())?;
    Ok(spec)
}

#[derive(Debug, Args)]
pub struct SyncArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Print which certificates would be added and removed and whether the file would
    /// change; write nothing, and exit 0. What would stop the sync itself (a missing
    /// directory, a bundle a running agent manages: exit 2 without --dry-run) is said on
    /// stderr.
    #[arg(long, env = "KUBELET_CA_AGENT_DRY_RUN", value_parser = BoolishValueParser::new())]
    pub dry_run: bool,
    /// Write even though a running agent (`run`) manages the bundle. It will put back its
    /// own bundle at once (a repair) unless the sources agree: to change what it writes,
    /// give the agent a local source (--source file:PATH or dir:PATH), or stop it first.
    #[arg(long, env = "KUBELET_CA_AGENT_FORCE", value_parser = BoolishValueParser::new())]
    pub force: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The bundle to read; - reads standard input.
    #[arg(
        value_name = "PATH|-",
        default_value = "/etc/kubernetes/kubelet-ca.crt"
    )]
    pub path: PathBuf,
    /// Output format.
    #[arg(long, short, env = "KUBELET_CA_AGENT_OUTPUT", value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// Count a certificate that expires within this duration as a problem (exit 1), e.g. 30d.
    /// A unit is needed: 7d, 36h.
    #[arg(long, value_name = "DURATION", env = "KUBELET_CA_AGENT_WARN_WITHIN", default_value = "0s", value_parser = parse_span_of_days)]
    pub warn_within: Duration,
}

// `drift`: its own block, so that it merges apart from the other commands' flags.

#[derive(Debug, Subcommand)]
pub enum DriftCommand {
    /// Print the managed paths as exclusion rules for drift monitors and file-integrity tools.
    #[command(
        long_about = "Print the managed paths as exclusion rules for drift monitors and \
                      file-integrity tools: one path per line (plain), AIDE rules such as \
                      !/etc/kubernetes/kubelet-ca.crt$ (aide), or the paths with the SHA-256 of \
                      their current content (json).\n\n\
                      Exits 0, or 2 when managed-files.json cannot be read."
    )]
    Exclusions(DriftExclusionsArgs),
    /// Compare a rendered node config (Ignition v3, or a MachineConfig) with the files on disk.
    #[command(
        long_about = "Compare a rendered node config with the files on disk: an Ignition v3.0 to \
                      v3.6 JSON document, or a MachineConfig JSON whose spec.config holds one. \
                      Each file in storage.files is compared with the file under --root: it must \
                      exist as a regular file, hold the content of its data: URL (percent-encoded \
                      or base64, gzip-compressed or not, followed by its append entries) and have \
                      its mode (0644 when unset). Content from other URLs (https:, s3:, ...) \
                      cannot be fetched offline: it is reported as not checked, not as drift. \
                      The managed files are never reported, whatever the config says about them.\n\n\
                      Exits 0 when no file drifted, 1 when one did, 2 when the document is \
                      unreadable or invalid (the message says where, e.g. \
                      storage.files[3].contents.source) or a file cannot be read."
    )]
    Check(DriftCheckArgs),
    /// Print a rendered node config with the managed files removed from storage.files.
    #[command(
        long_about = "Print a rendered node config (Ignition v3 JSON, or a MachineConfig JSON \
                      whose spec.config holds one) with the managed files removed from \
                      storage.files, so that a config renderer can stop carrying them. Every other \
                      byte of the document is printed as it was.\n\n\
                      Exits 0, or 2 when the document is unreadable or invalid."
    )]
    Strip(DriftStripArgs),
}

/// Where the managed files are recorded, for every `drift` command.
#[derive(Debug, Args)]
pub struct ManagedArgs {
    /// The managed bundle, used when <state-dir>/managed-files.json does not exist yet.
    #[arg(
        long,
        value_name = "PATH",
        env = "KUBELET_CA_AGENT_BUNDLE",
        default_value = "/etc/kubernetes/kubelet-ca.crt"
    )]
    pub bundle: PathBuf,
    /// The agent's state directory, which holds managed-files.json.
    #[arg(
        long,
        value_name = "PATH",
        env = "KUBELET_CA_AGENT_STATE_DIR",
        default_value = "/var/lib/kubelet-ca-agent"
    )]
    pub state_dir: PathBuf,
    /// The other managed files, as `run` is given them (only their paths are used), used
    /// with --bundle when managed-files.json does not exist yet.
    #[arg(
        long = "manage",
        value_name = "PATH=SPEC[,SPEC...]",
        env = "KUBELET_CA_AGENT_MANAGE",
        value_delimiter = ';',
        value_parser = parse_manage
    )]
    pub manage: Vec<ManageSpec>,
    /// The managed kubeconfigs, as `run` is given them (only their paths are used), used
    /// with --bundle when managed-files.json does not exist yet.
    #[arg(
        long = "manage-kubeconfig",
        value_name = "PATH=SPEC[,SPEC...]",
        env = "KUBELET_CA_AGENT_MANAGE_KUBECONFIG",
        value_delimiter = ';',
        value_parser = parse_manage
    )]
    pub manage_kubeconfig: Vec<ManageSpec>,
    /// The registry directories, as `run` is given them (only their paths are used), besides
    /// those recorded in the state directory: what the agent creates under each is excluded.
    #[arg(
        long = "manage-registries",
        value_name = "DIR=SPEC[,SPEC...]",
        env = "KUBELET_CA_AGENT_MANAGE_REGISTRIES",
        value_delimiter = ';',
        value_parser = parse_manage_registries
    )]
    pub manage_registries: Vec<RegistriesSpec>,
}

/// `drift exclusions --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExclusionFormat {
    /// One path per line.
    Plain,
    /// AIDE rules: `!<path>$`.
    Aide,
    /// `{"files": [{"path": ..., "sha256": ...}], ...}`.
    Json,
}

#[derive(Debug, Args)]
pub struct DriftExclusionsArgs {
    #[command(flatten)]
    pub managed: ManagedArgs,
    /// Output format.
    #[arg(long, env = "KUBELET_CA_AGENT_FORMAT", value_enum, default_value_t = ExclusionFormat::Plain)]
    pub format: ExclusionFormat,
}

/// `drift check --output`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DriftOutput {
    /// One line per difference, then a summary (`table` is accepted too, so that a
    /// KUBELET_CA_AGENT_OUTPUT set for `inspect` does not break `drift check`).
    #[value(alias = "table")]
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct DriftCheckArgs {
    #[command(flatten)]
    pub managed: ManagedArgs,
    /// The rendered config: Ignition v3 JSON, or a MachineConfig JSON; - reads standard input.
    #[arg(long, value_name = "FILE", env = "KUBELET_CA_AGENT_RENDERED")]
    pub rendered: PathBuf,
    /// The directory the config's paths are relative to (a mounted node image, a chroot).
    /// Links under it resolve as if it were /.
    #[arg(
        long,
        value_name = "DIR",
        env = "KUBELET_CA_AGENT_ROOT",
        default_value = "/"
    )]
    pub root: PathBuf,
    /// Output format.
    #[arg(long, short, env = "KUBELET_CA_AGENT_OUTPUT", value_enum, default_value_t = DriftOutput::Text)]
    pub output: DriftOutput,
}

#[derive(Debug, Args)]
pub struct DriftStripArgs {
    #[command(flatten)]
    pub managed: ManagedArgs,
    /// The rendered config: Ignition v3 JSON, or a MachineConfig JSON; - reads standard input.
    #[arg(long, value_name = "FILE", env = "KUBELET_CA_AGENT_RENDERED")]
    pub rendered: PathBuf,
    /// The directory the config's paths are relative to, as for `check`: a managed file
    /// recorded under it is also known by its path inside it.
    #[arg(
        long,
        value_name = "DIR",
        env = "KUBELET_CA_AGENT_ROOT",
        default_value = "/"
    )]
    pub root: PathBuf,
}

// `rollout`: its own block, so that it merges apart from the other commands' flags.

#[derive(Debug, Subcommand)]
pub enum RolloutCommand {
    /// How many nodes hold what the sources make, and each node that does not, with why.
    #[command(
        long_about = "How many nodes hold what the sources make for the target (by default each \
                      node's bundle, whatever its path; --target PATH for another file, such as the \
                      kubelet's kubeconfig), how many hold each CA of it, and each node that does \
                      not: what it lacks or still holds (subject CN and fingerprint, which --for \
                      takes as printed), SINCE (the time of its last report, not when it fell \
                      behind), and why as far as its report knows (out of sync, a removal held, \
                      the kubelet not restarted, no report, an invalid report, NotReady). Nodes being deleted are left out; NotReady nodes \
                      are counted and marked. One list of the Nodes' metadata, one of their \
                      readiness.\n\n\
                      Exits 0 when every counted node is current, 1 when one is not, 2 on a usage \
                      error or when the sources or the Nodes cannot be read."
    )]
    Status(RolloutStatusArgs),
    /// Wait until every node satisfies a condition (holds a CA, no longer holds one, holds what the sources make).
    #[command(
        long_about = "Watch the Nodes' metadata and exit 0 the moment every counted node satisfies \
                      --for: add=FP (holds the CA; for a kubeconfig, the kubelet was also restarted \
                      after it was added), remove=FP (no longer holds it), or sources (holds exactly \
                      what the sources make). FP is a SHA-256 fingerprint (hex, colons allowed), \
                      its first 12 or more digits as rollout status prints them \
                      (sha256:7cd38cef4711...: it must name one certificate that the sources \
                      make or a node's report names), or file:PATH (every certificate of a PEM \
                      file); several may be given, separated by commas. A line is printed each \
                      time the count moves.\n\n\
                      Exits 0 when the condition holds, 1 on --timeout (the laggards printed as \
                      rollout status prints them), 2 on a usage error or when the sources or the \
                      Nodes cannot be read."
    )]
    Wait(RolloutWaitArgs),
}

/// What `rollout status` and `rollout wait` ask about.
#[derive(Debug, Args)]
pub struct RolloutArgs {
    /// Where the signers come from, as the nodes read them (repeat the flag, or separate
    /// with commas): configmap:NAMESPACE/NAME[/KEY|/PREFIX*|/*], controllerconfig:NAME[/FIELD],
    /// file:PATH, dir:PATH. Their bundle is built with the node agent's rules.
    #[arg(
        long = "source",
        value_name = "SPEC",
        env = "KUBELET_CA_AGENT_SOURCE",
        value_delimiter = ',',
        default_value = "configmap:openshift-config-managed/kube-apiserver-client-ca",
        value_parser = parse_source_spec
    )]
    pub sources: Vec<SourceSpec>,
    /// The file asked about, as the nodes' reports name it (e.g. /var/lib/kubelet/kubeconfig
    /// for a managed kubeconfig). Default: each node's bundle, whatever its path.
    #[arg(long, value_name = "PATH", env = "KUBELET_CA_AGENT_TARGET")]
    pub target: Option<String>,
    /// Count only the Nodes with these labels (a label selector, e.g.
    /// node-role.kubernetes.io/worker).
    #[arg(long, value_name = "LABELS", env = "KUBELET_CA_AGENT_SELECTOR")]
    pub selector: Option<String>,
    /// Kubeconfig, as kubectl finds it. Default: $KUBECONFIG (several files separated by
    /// ':', merged as kubectl merges them: the first to set a name or the current-context
    /// wins; missing files are skipped), then ~/.kube/config when it exists, then in-cluster
    /// (the pod's service account; not with --context, --cluster or --user), then the
    /// kubelet's own kubeconfig
    /// (/var/lib/kubelet/kubeconfig, /etc/kubernetes/kubelet.conf).
    #[arg(long, value_name = "PATH", env = "KUBELET_CA_AGENT_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use, as kubectl's --context. Default: its current-context.
    #[arg(long, value_name = "NAME", env = "KUBELET_CA_AGENT_CONTEXT")]
    pub context: Option<String>,
    /// The kubeconfig cluster to use instead of the context's, as kubectl's --cluster.
    #[arg(long, value_name = "NAME", env = "KUBELET_CA_AGENT_CLUSTER")]
    pub cluster: Option<String>,
    /// The kubeconfig user to use instead of the context's, as kubectl's --user.
    #[arg(long, value_name = "NAME", env = "KUBELET_CA_AGENT_USER")]
    pub user: Option<String>,
    /// The nodes leave certificates past their notAfter out of the bundle (as their own
    /// --drop-expired).
    #[arg(long, env = "KUBELET_CA_AGENT_DROP_EXPIRED", value_parser = BoolishValueParser::new())]
    pub drop_expired: bool,
}

#[derive(Debug, Args)]
pub struct RolloutStatusArgs {
    #[command(flatten)]
    pub rollout: RolloutArgs,
    /// Output format.
    #[arg(long, short, env = "KUBELET_CA_AGENT_OUTPUT", value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
pub struct RolloutWaitArgs {
    #[command(flatten)]
    pub rollout: RolloutArgs,
    /// The condition: add=FP[,FP...], remove=FP[,FP...] or sources. FP: a SHA-256
    /// fingerprint (hex, colons allowed), its first 12 or more digits (as rollout status
    /// prints it: sha256:7cd38cef4711...), or file:PATH (every certificate in a PEM file).
    #[arg(long = "for", value_name = "CONDITION", env = "KUBELET_CA_AGENT_FOR", value_parser = parse_wait_for)]
    pub condition: WaitFor,
    /// Give up after this long (exit 1, naming the laggards), e.g. 10m. Default: wait as
    /// long as it takes.
    #[arg(long, value_name = "DURATION", env = "KUBELET_CA_AGENT_TIMEOUT", value_parser = parse_duration)]
    pub timeout: Option<Duration>,
}

/// `--for`: `add=FP[,FP...]`, `remove=FP[,FP...]` or `sources`.
fn parse_wait_for(s: &str) -> Result<WaitFor, String> {
    let s = s.trim();
    if s == "sources" {
        return Ok(WaitFor::Sources);
    }
    let (kind, list) = s.split_once('=').ok_or_else(|| {
        format!("{s:?} is not a condition: expected add=FP, remove=FP or sources")
    })?;
    let fingerprints = list
        .split(',')
        .map(str::trim)
        .filter(|fp| !fp.is_empty())
        .map(parse_fingerprints)
        .collect::<Result<Vec<_>, _>>()?;
    if fingerprints.is_empty() {
        return Err(format!(
            "{s:?} names no certificate: give a SHA-256 fingerprint or file:PATH after '='"
        ));
    }
    match kind.trim() {
        "add" => Ok(WaitFor::Add(fingerprints)),
        "remove" => Ok(WaitFor::Remove(fingerprints)),
        other => Err(format!(
            "{:?} is not a condition: expected add=FP, remove=FP or sources",
            crate::text::escape(other)
        )),
    }
}

/// One FP: a SHA-256 fingerprint (hex, colons allowed, any case, `sha256:` in front or
/// not), its first 12 or more digits (as `rollout status` prints them, `...` and all), or
/// `file:PATH`.
fn parse_fingerprints(s: &str) -> Result<Fingerprints, String> {
    if let Some(path) = s.strip_prefix("file:") {
        if path.is_empty() {
            return Err("file: names no file".to_string());
        }
        return Ok(Fingerprints::File(PathBuf::from(path)));
    }
    if let Some(sha) = crate::fleet::held::Sha::parse(s) {
        return Ok(Fingerprints::Sha(sha));
    }
    crate::fleet::prefix::ShaPrefix::parse(s)
        .map(Fingerprints::Prefix)
        .ok_or_else(|| {
            format!(
                "{:?} is not a SHA-256 fingerprint (its 64 hex digits, or its first 12 or more; colons allowed) or file:PATH",
                crate::text::escape(s)
            )
        })
}

/// A source of a bundle (`--source`, `--manage`): any kind, but not a registry list.
fn parse_source_spec(s: &str) -> Result<SourceSpec, String> {
    let spec: SourceSpec = s
        .parse()
        .map_err(|e: crate::source::SpecError| e.to_string())?;
    spec.check_bundle_source().map_err(|e| e.to_string())?;
    Ok(spec)
}

/// `--listen`: `IPv4:PORT` or `[IPv6]:PORT`, and also `[IPv4]:PORT`, as Go's
/// `net.SplitHostPort` accepts, so that one manifest line, `[$(HOST_IP)]:9745`, serves
/// IPv4 and IPv6 nodes alike (an unbracketed IPv6 address cannot carry a port).
fn parse_listen(s: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::{IpAddr, SocketAddr};
    let bracketed = || {
        let (host, port) = s.strip_prefix('[')?.split_once("]:")?;
        Some(SocketAddr::new(
            host.parse::<IpAddr>().ok()?,
            port.parse().ok()?,
        ))
    };
    s.parse::<SocketAddr>()
        .ok()
        .or_else(bracketed)
        .ok_or_else(|| {
            format!("{s:?} is not an address and port such as 127.0.0.1:9745 or [::1]:9745")
        })
}

/// `90s`, `15m`, `36h`, `30d` (and combinations such as `1h30m`). A bare number other than
/// 0 is refused: which unit was meant is anyone's guess.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    duration(s, |n| {
        format!("{s:?} has no unit: write {n}s for seconds, or {n}m, {n}h, {n}d")
    })
}

/// A duration usually counted in days (`--warn-within`, `--retain-removed`): as
/// [`parse_duration`], and a bare number is met with the days it most likely meant.
pub fn parse_span_of_days(s: &str) -> Result<Duration, String> {
    duration(s, |n| {
        format!("{s:?} has no unit: write {n}d for {n} days (or {n}h for hours)")
    })
}

fn duration(s: &str, bare: impl Fn(&str) -> String) -> Result<Duration, String> {
    let trimmed = s.trim();
    if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
        if trimmed.bytes().all(|b| b == b'0') {
            return Ok(Duration::ZERO);
        }
        return Err(bare(trimmed));
    }
    humantime::parse_duration(trimmed)
        .map_err(|e| format!("{s:?} is not a duration like 90s, 15m, 36h or 30d ({e})"))
}

fn parse_file_mode(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    let mode = u32::from_str_radix(digits, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal file mode such as 0644"))?;
    if mode & 0o022 != 0 {
        return Err(format!(
            "{s} lets group or others write the bundle, and so make the kubelet trust any client; use 0644 or stricter"
        ));
    }
    if mode & 0o400 == 0 {
        return Err(format!(
            "{s} does not let the owner read the bundle; use 0644 or 0600"
        ));
    }
    Ok(mode)
}

/// A systemd unit's full name (`kubelet.service`): the characters systemd allows, and a
/// unit type that can be restarted.
fn parse_unit(s: &str) -> Result<String, String> {
    const TYPES: [&str; 4] = ["service", "socket", "target", "mount"];
    let allowed = |c: char| c.is_ascii_alphanumeric() || ":-_.\\@".contains(c);
    if s.is_empty() || s.len() > 255 || !s.chars().all(allowed) {
        return Err(format!(
            "{:?} is not a systemd unit name (letters, digits and :-_.\\@, up to 255)",
            crate::text::escape(s)
        ));
    }
    match s.rsplit_once('.') {
        Some((name, kind)) if !name.is_empty() && TYPES.contains(&kind) => Ok(s.to_string()),
        _ => Err(format!(
            "{s:?} names no unit type: give the full name, e.g. kubelet.service (one of .{})",
            TYPES.join(", .")
        )),
    }
}

fn parse_command(s: &str) -> Result<ExecCommand, String> {
    let words =
        shell_words::split(s).map_err(|e| format!("{s:?} does not split into words: {e}"))?;
    if words.is_empty() {
        return Err("the command is empty".to_string());
    }
    Ok(ExecCommand(words))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn listen_addresses_take_brackets_around_either_family() {
        let ok = |s: &str| parse_listen(s).unwrap().to_string();
        assert_eq!(ok("127.0.0.1:9745"), "127.0.0.1:9745");
        assert_eq!(ok("[::1]:9745"), "[::1]:9745");
        // `[$(HOST_IP)]:9745` in a manifest, on an IPv4 node and on an IPv6 node.
        assert_eq!(ok("[10.0.3.7]:9745"), "10.0.3.7:9745");
        assert_eq!(ok("[fd00:10::7]:9745"), "[fd00:10::7]:9745");
        for bad in [
            "fd00::1:9745",
            "[10.0.3.7]",
            "[10.0.3.7]:",
            "[10.0.3.7]:65536",
            "[node-1]:9745",
            "localhost:9745",
            "10.0.3.7",
            "",
        ] {
            let e = parse_listen(bad).unwrap_err();
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains("[::1]:9745"),
                "{e}"
            );
        }
    }

    #[test]
    fn file_modes() {
        assert_eq!(parse_file_mode("0644"), Ok(0o644));
        assert_eq!(parse_file_mode("600"), Ok(0o600));
        assert_eq!(parse_file_mode("0o440"), Ok(0o440));
        assert!(parse_file_mode("0666").unwrap_err().contains("write"));
        assert!(parse_file_mode("0755").is_ok());
        assert!(parse_file_mode("0648").is_err());
        assert!(parse_file_mode("4644").is_err());
        assert!(parse_file_mode("0044").is_err());
    }

    #[test]
    fn boolean_flags_take_the_usual_spellings_from_the_environment() {
        let parse = |value: &str| {
            // SAFETY: this test is the only one touching this variable.
            unsafe { std::env::set_var("KUBELET_CA_AGENT_DRY_RUN", value) };
            let parsed = Cli::try_parse_from(["kubelet-ca-agent", "sync"]);
            unsafe { std::env::remove_var("KUBELET_CA_AGENT_DRY_RUN") };
            match parsed.map(|c| c.command) {
                Ok(Command::Sync(args)) => Ok(args.dry_run),
                Ok(_) => unreachable!(),
                Err(e) => Err(e.kind()),
            }
        };
        for yes in ["1", "true", "yes", "on", "TRUE"] {
            assert_eq!(parse(yes), Ok(true), "{yes}");
        }
        for no in ["0", "false", "no", "off"] {
            assert_eq!(parse(no), Ok(false), "{no}");
        }
        assert!(parse("maybe").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_duration("36h"), Ok(Duration::from_secs(36 * 3600)));
        assert_eq!(parse_duration("30d"), Ok(Duration::from_secs(30 * 86400)));
        assert!(parse_duration("soon").is_err());
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(
            parse_duration("60").unwrap_err(),
            "\"60\" has no unit: write 60s for seconds, or 60m, 60h, 60d"
        );
        assert_eq!(
            parse_span_of_days("7").unwrap_err(),
            "\"7\" has no unit: write 7d for 7 days (or 7h for hours)"
        );
        assert_eq!(parse_span_of_days("7d"), Ok(Duration::from_secs(7 * 86400)));
    }

    #[test]
    fn the_host_name_is_the_kernels() {
        let expected = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(host_name().as_deref(), Some(expected.trim()));
    }

    #[test]
    fn as_the_kubectl_plugin_it_is_named_kubectl_kubelet_ca() {
        use std::ffi::OsStr;
        assert!(is_kubectl_plugin(OsStr::new("kubectl-kubelet_ca")));
        assert!(is_kubectl_plugin(OsStr::new(
            "/usr/local/bin/kubectl-kubelet_ca"
        )));
        assert!(!is_kubectl_plugin(OsStr::new("kubelet-ca-agent")));
        assert!(!is_kubectl_plugin(OsStr::new(
            "/x/kubectl-kubelet_ca/kubelet-ca-agent"
        )));
        let mut plugin = command(true);
        let help = plugin.render_help().to_string();
        assert!(help.contains("kubectl kubelet-ca"), "{help}");
        let usage = command(true)
            .try_get_matches_from(["kubectl-kubelet_ca", "rollout", "nope"])
            .unwrap_err()
            .to_string();
        assert!(usage.contains("kubectl kubelet-ca rollout"), "{usage}");
        assert!(
            !command(false)
                .render_help()
                .to_string()
                .contains("kubectl kubelet-ca")
        );
    }

    #[test]
    fn a_wait_condition_is_add_remove_or_sources() {
        let hex = "ab".repeat(32);
        let sha = crate::fleet::held::Sha::parse(&hex).unwrap();
        assert_eq!(parse_wait_for(" sources "), Ok(WaitFor::Sources));
        let colons = hex
            .as_bytes()
            .chunks(2)
            .map(|p| std::str::from_utf8(p).unwrap().to_uppercase())
            .collect::<Vec<_>>()
            .join(":");
        assert_eq!(
            parse_wait_for(&format!("add={colons}")),
            Ok(WaitFor::Add(vec![Fingerprints::Sha(sha.clone())]))
        );
        assert_eq!(
            parse_wait_for(&format!("remove=sha256:{hex}, file:/tmp/old.pem,")),
            Ok(WaitFor::Remove(vec![
                Fingerprints::Sha(sha.clone()),
                Fingerprints::File("/tmp/old.pem".into())
            ]))
        );
        let prefix = |text: &str| crate::fleet::prefix::ShaPrefix::parse(text).unwrap();
        assert_eq!(
            parse_wait_for("add=sha256:abababababab...,ABABABABABABAB"),
            Ok(WaitFor::Add(vec![
                Fingerprints::Prefix(prefix("abababababab")),
                Fingerprints::Prefix(prefix("ababababababab")),
            ]))
        );
        for (bad, says) in [
            ("add=abababababa", "its first 12 or more"),
            ("source", "expected add=FP, remove=FP or sources"),
            ("add=", "names no certificate"),
            ("add= , ", "names no certificate"),
            ("add=abc", "is not a SHA-256 fingerprint"),
            ("add=file:", "file: names no file"),
            ("drop=file:/x", "\"drop\" is not a condition"),
        ] {
            let e = parse_wait_for(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn rollout_parses_its_flags_and_defaults() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.command);
        match parse(&["kubelet-ca-agent", "rollout", "status"]).unwrap() {
            Command::Rollout(RolloutCommand::Status(args)) => {
                assert_eq!(args.output, OutputFormat::Table);
                assert_eq!(
                    args.rollout.sources[0].to_string(),
                    "configmap:openshift-config-managed/kube-apiserver-client-ca"
                );
                assert_eq!(args.rollout.target, None);
                assert_eq!(args.rollout.selector, None);
            }
            other => panic!("{other:?}"),
        }
        let hex = "cd".repeat(32);
        let wait = parse(&[
            "kubelet-ca-agent",
            "rollout",
            "wait",
            "--for",
            &format!("add={hex}"),
            "--timeout",
            "90s",
            "--target",
            "/var/lib/kubelet/kubeconfig",
            "--selector",
            "pool=a",
            "--source",
            "file:/x.pem",
        ]);
        match wait.unwrap() {
            Command::Rollout(RolloutCommand::Wait(args)) => {
                assert_eq!(args.timeout, Some(Duration::from_secs(90)));
                assert!(matches!(args.condition, WaitFor::Add(_)));
                assert_eq!(
                    args.rollout.target.as_deref(),
                    Some("/var/lib/kubelet/kubeconfig")
                );
                assert_eq!(args.rollout.selector.as_deref(), Some("pool=a"));
                assert_eq!(args.rollout.sources.len(), 1);
            }
            other => panic!("{other:?}"),
        }
        // --for is required; a bad one is a usage error.
        assert!(parse(&["kubelet-ca-agent", "rollout", "wait"]).is_err());
        assert!(parse(&["kubelet-ca-agent", "rollout", "wait", "--for", "add=zz"]).is_err());
        assert!(parse(&["kubelet-ca-agent", "rollout", "status", "-o", "yaml"]).is_err());
    }

    #[test]
    fn exec_on_change_splits_like_a_shell() {
        let words = ["systemctl", "kill", "-s", "HUP", "my proxy.service"];
        assert_eq!(
            parse_command("systemctl kill -s HUP 'my proxy.service'"),
            Ok(ExecCommand(words.map(String::from).to_vec()))
        );
        assert!(parse_command("  ").is_err());
        assert!(parse_command("echo 'unclosed").is_err());
    }
}
