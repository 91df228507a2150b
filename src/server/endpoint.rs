//! Setting up the endpoint from the SERVER flags, shared by `run` and `publish`: the TLS
//! configuration and what guards `/metrics`, the listener, the router over the status the
//! loop publishes, and the reloads of the TLS files.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::Guard;
use super::Liveness;
use super::auth::Authorization;
use super::exposition;
use super::review;
use super::tls::{self, Tls};
use crate::config;
use crate::credentials::Credentials;
use crate::error::UsageError;
use crate::metrics::Metrics;
use crate::status::StatusRx;

/// The endpoint as started.
pub struct Endpoint {
    tls: Option<Arc<Tls>>,
    /// Whether the client CA is the managed bundle, reloaded after each of its changes.
    follows_bundle: bool,
}

impl Endpoint {
    /// Listens on `--listen` and serves `/metrics` and the health paths from `status` (the
    /// flags were checked when `server` was made). A port in use or an unusable TLS file is
    /// a configuration error.
    ///
    /// `bundle` is the managed file when there is one (`run`): a `--client-ca-file` naming
    /// it is reloaded right after each of the loop's own writes.
    pub async fn start(
        server: &config::Server,
        bundle: Option<&Path>,
        credentials: Option<&Credentials>,
        metrics: Arc<Metrics>,
        status: StatusRx,
        liveness: Liveness,
        observers: Vec<tokio::sync::watch::Receiver<Option<crate::status::Check>>>,
    ) -> anyhow::Result<Endpoint> {
        let (tls, guard) = guard(server, bundle, credentials, &metrics)?;
        let listener = bind(server.listen)?;
        let registry = exposition::registry(
            metrics,
            status.clone(),
            credentials.cloned(),
            server.node_name.as_deref(),
        );
        let router = super::router(
            status,
            registry,
            liveness,
            guard,
            credentials.cloned(),
            observers,
        );
        super::spawn(listener, router, tls.clone(), super::Limits::for_process())?;
        let follows_bundle = tls
            .as_ref()
            .and_then(|t| t.client_ca())
            .zip(bundle)
            .is_some_and(|(ca, bundle)| same_path(ca, bundle));
        Ok(Endpoint {
            tls,
            follows_bundle,
        })
    }

    /// The files of the TLS configuration, to be watched.
    pub fn tls_files(&self) -> Vec<PathBuf> {
        self.tls.as_ref().map(|t| t.files()).unwrap_or_default()
    }

    /// Starts reloading the TLS configuration: on each message of the returned sender (a
    /// TLS file changed), and after each change of the bundle in `status` when the client
    /// CA is the managed bundle. None when the endpoint speaks plain HTTP.
    pub fn reload_tls(&self, status: StatusRx) -> Option<mpsc::UnboundedSender<()>> {
        let tls = self.tls.clone()?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(reload_tls(tls, rx, status, self.follows_bundle));
        Some(tx)
    }
}

/// The endpoint's TLS and what guards `/metrics`, from the SERVER flags. TLS is served
/// with the given certificate, or with an in-memory self-signed one off loopback (or when
/// client certificates are asked for); plain HTTP only on loopback.
///
/// `credentials` give the client that talks to the API server for the webhooks; they are
/// needed (and only followed) when `--authentication-token-webhook` or
/// `--authorization-webhook` is given. `metrics` count the reviews that could not be made.
fn guard(
    server: &config::Server,
    bundle: Option<&Path>,
    credentials: Option<&Credentials>,
    metrics: &Arc<Metrics>,
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
                .is_some_and(|ca| bundle.is_some_and(|b| same_path(ca, b))),
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
        credentials.cloned().ok_or_else(|| {
            UsageError("the webhooks need a Kubernetes client (--kubeconfig)".to_string())
        })
    };
    // One bound on the reviews in flight and their rate, and one breaker, for both kinds.
    let limiter = Arc::new(review::Limiter::default());
    let tokens = if server.authentication_token_webhook {
        Some(review::Tokens::new(
            limiter.clone(),
            webhook_client()?,
            server
                .authentication_token_audiences
                .iter()
                .filter(|a| !a.is_empty())
                .cloned()
                .collect(),
            server.authentication_token_webhook_cache_ttl,
            metrics.clone(),
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
            limiter,
            webhook_client()?,
            server.authorization_webhook_cache_authorized_ttl,
            server.authorization_webhook_cache_unauthorized_ttl,
            metrics.clone(),
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
            "no authentication is configured for /metrics (no --client-ca-file, no --authentication-token-webhook, no --insecure-metrics): /metrics answers 401 to everyone. Set KUBELET_CA_AGENT_CLIENT_CA_FILE with KUBELET_CA_AGENT_AUTHORIZED_USERS or _GROUPS, or KUBELET_CA_AGENT_INSECURE_METRICS=true on a loopback address; for the systemd unit, in /etc/default/kubelet-ca-agent (Debian, Ubuntu) or /etc/sysconfig/kubelet-ca-agent (RPM systems): with neither file, the unit runs with no configuration at all"
        );
    }
    let guard = Guard {
        insecure: server.insecure_metrics,
        tls: tls.clone(),
        tokens,
        review_failures: super::repeated::Repeated::new("reviews"),
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

/// Listens on `addr` (non-blocking, for the endpoint's runtime to take over).
pub fn bind(addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    let listen = || {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok::<_, std::io::Error>(listener)
    };
    listen().map_err(|e| {
        let why = format!("--listen {addr}: cannot listen: {e}");
        // An address that is not this host's is a configuration error; a port in use or
        // refused is the environment's (exit 1, as for any runtime failure).
        if e.kind() == std::io::ErrorKind::AddrNotAvailable {
            UsageError(why).into()
        } else {
            anyhow::anyhow!(why)
        }
    })
}
