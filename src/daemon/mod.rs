//! `run`: the node daemon. One reconciliation loop owns all state; the cluster watches,
//! the inotify watcher, the HTTP server and the signal handlers talk to it through
//! channels (the shape of tokio's mini-redis).
//!
//! The loop runs on the main thread and does its file I/O there; the HTTP server, the
//! watches and the signal handling run on the runtime's worker threads. So a file that
//! stalls a read (a hung mount) cannot stop `/livez` from answering, and answering the
//! truth: that the loop does not answer.

pub mod allocator;
pub mod files;
pub mod reconciler;
pub mod status;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use crate::cli::{RunArgs, ServerArgs};
use crate::error::{Exit, UsageError};
use crate::metrics::{self, Metrics};
use crate::server;
use crate::server::Guard;
use crate::server::auth::Authorization;
use crate::server::review;
use crate::server::tls::{self, Tls};
use crate::source::cluster;
use reconciler::{Inputs, Reconciler};
use status::StatusRx;

pub fn run(args: RunArgs) -> anyhow::Result<Exit> {
    check_listen(&args)?;
    // One crypto provider for the whole process: ring, the one kube-rs is built with.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kubelet-ca-agent-io")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(run_async(args))
}

fn check_listen(args: &RunArgs) -> Result<(), UsageError> {
    let listen = args.server.listen;
    if args.server.insecure_metrics && !listen.ip().is_loopback() {
        return Err(UsageError(format!(
            "--listen {listen}: --insecure-metrics is only allowed on a loopback address"
        )));
    }
    Ok(())
}

/// The endpoint's TLS and what guards `/metrics`, from the SERVER flags. TLS is served
/// with the given certificate, or with an in-memory self-signed one off loopback (or when
/// client certificates are asked for); plain HTTP only on loopback.
///
/// `client` talks to the API server for the webhooks; it is needed (and only built) when
/// `--authentication-token-webhook` or `--authorization-webhook` is given.
pub fn guard(
    server: &ServerArgs,
    bundle: &Path,
    client: Option<&kube::Client>,
) -> Result<(Option<Arc<Tls>>, Arc<Guard>), UsageError> {
    let loopback = server.listen.ip().is_loopback();
    let serving = server
        .tls_cert_file
        .clone()
        .zip(server.tls_private_key_file.clone());
    let tls = if serving.is_some() || !loopback || server.client_ca_file.is_some() {
        if serving.is_none() {
            tracing::warn!(listen = %server.listen, "no --tls-cert-file: serving TLS with an in-memory self-signed certificate; scrapers must skip verification or pin it");
        }
        let settings = tls::Settings {
            serving,
            client_ca: server.client_ca_file.clone(),
            client_ca_is_bundle: server
                .client_ca_file
                .as_deref()
                .is_some_and(|ca| same_path(ca, bundle)),
            min_version: server.tls_min_version,
        };
        let mut names = vec![server.listen.ip().to_string()];
        names.extend(server.node_name.clone());
        let tls = Tls::load(settings, &names).map_err(|e| UsageError(format!("{e:#}")))?;
        Some(Arc::new(tls))
    } else {
        None
    };
    let users: BTreeSet<String> = server
        .authorized_users
        .iter()
        .filter(|u| !u.is_empty())
        .cloned()
        .collect();
    let groups: BTreeSet<String> = server
        .authorized_groups
        .iter()
        .filter(|g| !g.is_empty())
        .cloned()
        .collect();
    let webhook_client = || {
        client.cloned().ok_or_else(|| {
            UsageError("the webhooks need a Kubernetes client (--kubeconfig)".to_string())
        })
    };
    let tokens = if server.authentication_token_webhook {
        Some(review::Tokens::new(
            webhook_client()?,
            server
                .authentication_token_audiences
                .iter()
                .filter(|a| !a.is_empty())
                .cloned()
                .collect(),
            server.authentication_token_webhook_cache_ttl,
        ))
    } else {
        None
    };
    let authenticated = match (server.client_ca_file.is_some(), tokens.is_some()) {
        (true, true) => "a certificate from --client-ca-file or a token the API server accepts",
        (true, false) => "a certificate from --client-ca-file",
        (false, true) => "a token the API server accepts",
        (false, false) => "",
    };
    let authorization = if !users.is_empty() || !groups.is_empty() {
        if server.authorization_webhook {
            tracing::info!(
                "--authorized-users/--authorized-groups given: the static allow-list decides, --authorization-webhook is not used"
            );
        }
        Authorization::AllowList { users, groups }
    } else if server.authorization_webhook {
        Authorization::Webhook(review::Access::new(
            webhook_client()?,
            server.authorization_webhook_cache_authorized_ttl,
            server.authorization_webhook_cache_unauthorized_ttl,
        ))
    } else {
        if !server.insecure_metrics && !authenticated.is_empty() {
            tracing::warn!(
                "no --authorized-users, --authorized-groups or --authorization-webhook: any client with {authenticated} may read /metrics"
            );
        }
        Authorization::AnyAuthenticated
    };
    if !server.insecure_metrics && authenticated.is_empty() {
        tracing::warn!(
            "no --client-ca-file or --authentication-token-webhook: /metrics answers 401 to everyone (use --client-ca-file, or --insecure-metrics on a loopback address)"
        );
    }
    let guard = Guard {
        insecure: server.insecure_metrics,
        tls: tls.clone(),
        tokens,
        authorization,
    };
    Ok((tls, Arc::new(guard)))
}

/// Whether two paths name the same file, as given (made absolute, not resolved).
fn same_path(a: &Path, b: &Path) -> bool {
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    absolute(a) == absolute(b)
}

/// Reloads the TLS configuration when its files change, and, when the client CA is the
/// managed bundle, right after each change of the bundle the loop publishes (its own
/// writes included), so a client of a new signer is accepted at once.
async fn reload_tls(
    tls: Arc<Tls>,
    mut files: mpsc::UnboundedReceiver<()>,
    mut status: StatusRx,
    follows_bundle: bool,
) {
    let mut seen = status.borrow().sha256.clone();
    loop {
        tokio::select! {
            event = files.recv() => {
                if event.is_none() {
                    return;
                }
                // A writer's create+write+close or a cert and key replaced together: one reload.
                tokio::time::sleep(Duration::from_millis(5)).await;
                while files.try_recv().is_ok() {}
            }
            changed = status.changed(), if follows_bundle => {
                if changed.is_err() {
                    return;
                }
                let now = status.borrow_and_update().sha256.clone();
                if now.is_none() || now == seen {
                    continue;
                }
                seen = now;
            }
        }
        if let Err(e) = tls.reload() {
            tracing::warn!("keeping the previous TLS configuration: {e:#}");
        }
    }
}

async fn run_async(args: RunArgs) -> anyhow::Result<Exit> {
    let node = args.server.node_name.clone();
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        node = node.as_deref().unwrap_or("-"),
        bundle = %args.common.bundle.display(),
        sources = %args.common.sources.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
        "starting"
    );
    let metrics = Arc::new(Metrics::default());
    let (status_tx, status_rx) = watch::channel(Arc::default());
    let (liveness, pongs) = server::liveness();
    let (update_tx, update_rx) = mpsc::unbounded_channel();
    let (fs_tx, fs_rx) = mpsc::unbounded_channel();

    // Building the client reads configuration only; it does not call the API server.
    let webhooks = args.server.authentication_token_webhook || args.server.authorization_webhook;
    let client = if webhooks || args.common.sources.iter().any(|s| s.is_cluster()) {
        let client = cluster::client(args.common.kubeconfig.as_deref())
            .await
            .map_err(|e| UsageError(format!("{e:#}")))?;
        Some(client)
    } else {
        None
    };

    // Listen first: a port in use is a configuration error, and health answers early.
    let (tls, guard) = guard(&args.server, &args.common.bundle, client.as_ref())?;
    let listener = bind(args.server.listen).await?;
    let registry = metrics::registry(metrics.clone(), status_rx.clone(), node.as_deref());
    let router = server::router(status_rx.clone(), registry, liveness, guard);
    tokio::spawn(server::serve(listener, router, tls.clone()));

    // A directory that does not exist at start is a configuration error; later, one that
    // goes away is watched for until it is back.
    let tls_files = tls.as_ref().map(|t| t.files()).unwrap_or_default();
    let plan =
        files::Plan::new(&args.common.bundle, &args.common.sources).with_tls_files(&tls_files);
    for (dir, role) in plan.dirs() {
        if !dir.is_dir() {
            return Err(UsageError(format!("{} does not exist ({role})", dir.display())).into());
        }
    }
    let tls_events = tls.clone().map(|tls| {
        let (tx, rx) = mpsc::unbounded_channel();
        let absolute =
            |p: &std::path::Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let follows_bundle = tls
            .client_ca()
            .is_some_and(|ca| absolute(ca) == absolute(&args.common.bundle));
        tokio::spawn(reload_tls(tls, rx, status_rx.clone(), follows_bundle));
        tx
    });
    tokio::spawn(files::run(plan, fs_tx, tls_events));

    let sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut reconciler = Reconciler::new(&args.common, metrics, status_tx);
    // Adopt what is on disk and read the local sources before any API call: a valid file
    // makes the agent ready at once, whether or not the cluster answers.
    reconciler.start();

    if let Some(client) = client {
        for (index, spec) in args
            .common
            .sources
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_cluster())
        {
            tokio::spawn(cluster::watch(
                client.clone(),
                index,
                spec.clone(),
                update_tx.clone(),
            ));
        }
    }
    drop(update_tx);

    reconciler
        .run(Inputs {
            updates: update_rx,
            files: fs_rx,
            pongs,
            sigterm,
            sigint,
        })
        .await?;
    Ok(Exit::Success)
}

async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| UsageError(format!("--listen {addr}: cannot listen: {e}")).into())
}
