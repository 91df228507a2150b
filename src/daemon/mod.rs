//! `run`: the node daemon. One reconciliation loop owns all state; the cluster watches,
//! the inotify watcher, the HTTP server and the signal handlers talk to it through
//! channels (the shape of tokio's mini-redis).
//!
//! The loop runs on the main thread and does its file I/O there; the HTTP server, the
//! watches and the signal handling run on the runtime's worker threads. So a file that
//! stalls a read (a hung mount) cannot stop `/livez` from answering, and answering the
//! truth: that the loop does not answer.

pub mod reconciler;

use std::os::unix::fs::DirBuilderExt;
use std::sync::Arc;

use anyhow::Context;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};

use crate::config;
use crate::credentials::{Credentials, Origin};
use crate::error::{Exit, UsageError};
use crate::files;
use crate::fleet::report::Reporter;
use crate::metrics::Metrics;
use crate::running;
use crate::server;
use crate::server::endpoint::Endpoint;
use crate::source::cluster;
use reconciler::{Inputs, Reconciler};

pub fn run(args: config::Run) -> anyhow::Result<Exit> {
    // Held until the agent exits: a hand-run `sync` sees it and refuses to write a file
    // this agent would put back.
    let mut claimed = args.common.managed_paths();
    claimed.extend(args.common.registry_dirs());
    let _claim = running::claim(&args.common.state_dir, &claimed)?;
    let origins = Origins::resolve(&args)?;
    // Before any thread exists: every thread and hook after this is confined.
    let confined = confine(&args, &origins);
    let mut args = args;
    if let Some(report) = &args.report {
        // One name for this node: the Node its report goes to is the node of every log
        // line and of the metrics' label.
        let host = crate::cli::host_name();
        let (name, warning) = crate::fleet::report::identity(
            report.node_name.as_deref(),
            confined.node.as_deref(),
            host.as_deref(),
        );
        if let Some(warning) = warning {
            tracing::warn!("{warning}");
        }
        args.server.node_name = name;
    }
    crate::runtime::build()?.block_on(run_async(args, origins, confined))
}

/// The confinement in force, the plan it was built from, and the Node the credentials
/// named when it was built.
struct Confined {
    enforced: crate::confine::Enforced,
    plan: crate::confine::Plan,
    node: Option<String>,
}

/// How often the agent looks whether what it needs is still within its confinement.
const CONFINEMENT_CHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// Tells `outgrown` once what the agent needs now that its confinement cannot give (a
/// place replaced or new since start, a port): a node's first boot, where the kubelet's
/// credentials appear in a directory that did not exist, or a directory deleted and made
/// again. Looks every [`CONFINEMENT_CHECK`].
async fn watch_confinement(
    args: config::Run,
    origins: Vec<Origin>,
    confined: Confined,
    outgrown: mpsc::UnboundedSender<String>,
) {
    let state = Arc::new((args, origins, confined));
    loop {
        tokio::time::sleep(CONFINEMENT_CHECK).await;
        let state = state.clone();
        let found = tokio::task::spawn_blocking(move || {
            let (args, origins, confined) = &*state;
            let known: Vec<&Origin> = origins.iter().collect();
            let facts = crate::confine::Facts::gather(args, &known);
            let now = crate::confine::plan(args, &facts);
            let seen = crate::confine::identities(
                now.paths
                    .iter()
                    .chain(&confined.plan.paths)
                    .map(|r| r.path.as_path()),
            );
            confined.plan.outgrown(&confined.enforced.held, &now, &seen)
        })
        .await;
        match found {
            Ok(None) => {}
            Ok(Some(why)) => {
                tracing::error!(%why, "the confinement no longer covers what the agent needs");
                let _ = outgrown.send(why);
                return;
            }
            Err(_) => return,
        }
    }
}

/// Where the credentials come from: the sources' (and the webhooks'), and the report's when
/// it has its own.
struct Origins {
    sources: Option<Origin>,
    report: Option<Origin>,
}

impl Origins {
    fn resolve(args: &config::Run) -> anyhow::Result<Origins> {
        let webhooks =
            args.server.authentication_token_webhook || args.server.authorization_webhook;
        let sources = if webhooks || args.common.all_sources().iter().any(|s| s.is_cluster()) {
            Some(Origin::resolve(args.common.kubeconfig.as_deref()).map_err(UsageError)?)
        } else {
            None
        };
        let report = match args.report.as_ref().and_then(|r| r.kubeconfig.as_ref()) {
            Some(path) if sources.is_none() || Some(path) != args.common.kubeconfig.as_ref() => {
                Some(Origin::resolve(Some(path)).map_err(UsageError)?)
            }
            _ => None,
        };
        Ok(Origins { sources, report })
    }
}

/// Confines the agent to what `args` needs (SPEC 13).
fn confine(args: &config::Run, origins: &Origins) -> Confined {
    if let Some(config::KubeconfigHook::Request(dir)) = &args.common.kubeconfig_hook
        && !dir.is_dir()
    {
        // Made now, while it can be: a directory that appears later is outside the rules.
        let made = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir);
        if let Err(e) = made {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot create the kubelet's restart request directory; the restart stays pending until it exists and the agent is restarted");
        }
    }
    let known: Vec<&Origin> = origins.sources.iter().chain(&origins.report).collect();
    let facts = crate::confine::Facts::gather(args, &known);
    let plan = crate::confine::plan(args, &facts);
    for rule in &plan.paths {
        tracing::debug!(path = %rule.path.display(), access = ?rule.access, why = %rule.why, "confinement: may touch");
    }
    for (port, why) in &plan.connect {
        tracing::debug!(port, why = %why, "confinement: may connect");
    }
    let enforced = crate::confine::enforce(&plan);
    for path in &enforced.missing {
        tracing::debug!(path = %path.display(), "confinement: not there at start");
    }
    Confined {
        enforced,
        plan,
        node: facts.node,
    }
}

/// Says at start what the confinement holds.
fn tell_confinement(enforced: &crate::confine::Enforced) {
    match enforced.warning() {
        None => {
            tracing::info!(confinement = %enforced.summary(), "confined to what the configuration needs")
        }
        Some(warning) => {
            tracing::warn!(confinement = %enforced.summary(), %warning, "confined only in part")
        }
    }
}

async fn run_async(
    args: config::Run,
    origins: Origins,
    confined: Confined,
) -> anyhow::Result<Exit> {
    let node = args.server.node_name.clone();
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        node = node.as_deref().unwrap_or("-"),
        bundle = %args.common.bundle.display(),
        sources = %args.common.sources.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
        "starting"
    );
    tell_confinement(&confined.enforced);
    for manage in &args.common.manage {
        tracing::info!(file = %manage.path.display(), sources = %manage.sources.iter().map(ToString::to_string).collect::<Vec<_>>().join(","), "also managing");
    }
    for set in &args.common.manage_registries {
        tracing::info!(dir = %set.dir.display(), sources = %set.sources.iter().map(ToString::to_string).collect::<Vec<_>>().join(","), "also managing the registry CAs under");
    }
    let metrics = Arc::new(Metrics::default());
    let (status_tx, status_rx) = watch::channel(Arc::default());
    let (liveness, pongs) = server::liveness();
    let (update_tx, update_rx) = mpsc::unbounded_channel();
    let (fs_tx, fs_rx) = mpsc::unbounded_channel();

    // The credentials are followed for as long as the agent runs: missing (a new node whose
    // kubelet has not bootstrapped yet), half written or refused, they hold back the
    // cluster sources only, never the file on disk or the endpoint.
    let sources = args.common.all_sources();
    let known: Vec<Origin> = origins
        .sources
        .iter()
        .chain(&origins.report)
        .cloned()
        .collect();
    let credentials = origins.sources.map(|origin| {
        tracing::info!(credentials = %origin.describe(), "credentials for the API server chosen");
        Credentials::follow(origin)
    });
    let report = report_credentials(args.report.as_ref(), credentials.as_ref(), origins.report);
    let (report_check, report_check_rx) = watch::channel(None);
    let (_confinement, confinement_rx) = watch::channel(Some(confined.enforced.check()));
    let (outgrown_tx, outgrown) = mpsc::unbounded_channel();
    if confined.enforced.abi.is_some() {
        tokio::spawn(watch_confinement(
            args.clone(),
            known,
            confined,
            outgrown_tx,
        ));
    }

    // Listen first: a port in use is a configuration error, and health answers early.
    let endpoint = Endpoint::start(
        &args.server,
        Some(&args.common.bundle),
        credentials.as_ref(),
        metrics.clone(),
        status_rx.clone(),
        liveness,
        vec![confinement_rx, report_check_rx],
    )
    .await?;

    // A directory that does not exist at start is a configuration error; later, one that
    // goes away is watched for until it is back.
    let local: Vec<_> = sources
        .iter()
        .map(crate::source::SourceSpec::local)
        .collect();
    let plan = files::Plan::new(&args.common.managed_paths(), &local)
        .with_tls_files(&endpoint.tls_files())
        .with_registry_dirs(&args.common.registry_dirs());
    for (dir, role) in plan.dirs() {
        if !dir.is_dir() {
            return Err(UsageError(format!("{} does not exist ({role})", dir.display())).into());
        }
    }
    let tls_events = endpoint.reload_tls(status_rx.clone());
    tokio::spawn(files::run(plan, fs_tx, tls_events));

    let sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    if let Some(report_credentials) = report {
        metrics.init_node_report();
        let (events, notices) = mpsc::channel(32);
        let not_recorded = metrics.clone();
        tokio::spawn(crate::fleet::events::run(
            notices,
            report_credentials.clone(),
            move |reason| not_recorded.not_recorded(reason),
        ));
        let reporter = Reporter {
            node_name: args.report.as_ref().and_then(|r| r.node_name.clone()),
            credentials: report_credentials,
            status: status_rx.clone(),
            metrics: metrics.clone(),
            check: report_check,
            events: Some(events),
        };
        tokio::spawn(reporter.run());
    }
    let mut reconciler = Reconciler::new(&args.common, metrics, status_tx)
        .with_kubelet_config(args.kubelet_config.as_deref(), &args.common.bundle);
    // Adopt what is on disk and read the local sources before any API call: a valid file
    // makes the agent ready at once, whether or not the cluster answers.
    reconciler.start();

    if let Some(credentials) = &credentials {
        watch(
            credentials,
            &sources,
            args.common.sources.len(),
            args.common.file_sources(),
            update_tx,
        );
    } else {
        drop(update_tx);
    }

    reconciler
        .run(Inputs {
            updates: update_rx,
            files: fs_rx,
            pongs,
            sigterm,
            sigint,
            outgrown,
        })
        .await?;
    Ok(Exit::Success)
}

/// The credentials that write this node's report (SPEC 8c): `--report-kubeconfig`'s, else
/// those the sources use. None (said once) when the report is off: `--no-node-report`, or
/// nothing here talks to the cluster and no `--report-kubeconfig` says where to.
fn report_credentials(
    report: Option<&config::NodeReport>,
    sources: Option<&Credentials>,
    own: Option<Origin>,
) -> Option<Credentials> {
    let Some(report) = report else {
        tracing::info!("the node report is off (--no-node-report)");
        return None;
    };
    match (own, sources) {
        (Some(origin), _) => Some(Credentials::follow(origin)),
        (None, Some(sources)) => Some(sources.clone()),
        (None, None) => {
            debug_assert!(report.kubeconfig.is_none());
            tracing::info!(
                "the node report is off: no source talks to the cluster (set --report-kubeconfig to report what this node holds anyway)"
            );
            None
        }
    }
}

/// Starts one watch per object that the cluster sources read (SPEC 4b: one per object,
/// whatever the number of fields used, by files and registry sets alike). The first
/// `bundle` of `sources` feed the bundle, the next up to `files` the `--manage` files; the
/// rest feed the registry sets.
fn watch(
    credentials: &Credentials,
    sources: &[crate::source::SourceSpec],
    bundle: usize,
    files: usize,
    updates: mpsc::UnboundedSender<cluster::Update>,
) {
    use crate::source::cluster::Content;
    use std::collections::HashSet;
    let registry_specs: HashSet<_> = sources[files..].iter().cloned().collect();
    // The specs of `--manage` files alone, which may hold nothing (an empty key); one that
    // the bundle reads too is read as the bundle reads it.
    let optional_specs: HashSet<_> = sources[bundle..files]
        .iter()
        .filter(|spec| !sources[..bundle].contains(spec))
        .cloned()
        .collect();
    let content = move |spec: &crate::source::SourceSpec, raw: cluster::Raw<'_>| {
        // The flags never let one spec feed both a file and a registry set.
        if registry_specs.contains(spec) {
            cluster::registry_content(spec, raw).map(|e| Content::Entries(Arc::new(e)))
        } else if optional_specs.contains(spec) {
            cluster::optional_bundle_content(spec, raw).map(Content::Certificates)
        } else {
            cluster::bundle_content(spec, raw).map(Content::Certificates)
        }
    };
    let send = move |index, event, at| {
        let _ = updates.send(cluster::Update { index, event, at });
    };
    cluster::watch_objects(credentials, sources, content, send);
}
