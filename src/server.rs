//! The HTTP endpoint: `/livez` and `/healthz` (the reconciliation loop answers a ping;
//! concurrent probes share one answer), `/readyz` (from the loop's status, `?verbose` lists
//! each check), and `/metrics`. Health paths need no authentication. `/metrics` needs an
//! authenticated, authorized identity (a client certificate, [`tls`], checked against the
//! allow-list, [`auth`]), unless `--insecure-metrics` (loopback only) turns that off.
//!
//! Each connection is a task of its own with a deadline on the TLS handshake and on every
//! request's headers, and a bound on their size: a silent or slow client is dropped, and
//! any number of idle connections cost a task each, never a place in a queue that a scrape
//! or a probe would wait behind.

pub mod auth;
pub mod endpoint;
pub mod review;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::CertificateDer;
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::credentials::Credentials;
use crate::metrics;
use crate::status::StatusRx;
use crate::text::escape;
pub use auth::Guard;
use tls::Tls;

/// How long a liveness probe waits for the loop to answer.
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(2);

/// The server's side of liveness: it asks the loop to answer (`pings`, one slot: a ping
/// already waiting serves every probe that comes meanwhile) and sees the loop's answers
/// counted on `pongs`.
#[derive(Clone)]
pub struct Liveness {
    pub pings: mpsc::Sender<()>,
    pub pongs: watch::Receiver<u64>,
}

/// The loop's side: answer each ping by counting it.
pub struct Pongs {
    pub pings: mpsc::Receiver<()>,
    pub pongs: watch::Sender<u64>,
}

impl Pongs {
    pub fn answer(&self) {
        self.pongs.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// The two ends of liveness.
pub fn liveness() -> (Liveness, Pongs) {
    let (ping_tx, ping_rx) = mpsc::channel(1);
    let (pong_tx, pong_rx) = watch::channel(0);
    (
        Liveness {
            pings: ping_tx,
            pongs: pong_rx,
        },
        Pongs {
            pings: ping_rx,
            pongs: pong_tx,
        },
    )
}

impl Liveness {
    /// True when the loop answers a ping sent after this call began: any answer counted
    /// after the count seen here proves the loop went round since.
    async fn alive(&self) -> bool {
        let mut pongs = self.pongs.clone();
        let seen = *pongs.borrow_and_update();
        match self.pings.try_send(()) {
            // A full slot is a ping already on its way: its answer serves this probe too.
            Ok(()) | Err(mpsc::error::TrySendError::Full(())) => {}
            Err(mpsc::error::TrySendError::Closed(())) => return false,
        }
        tokio::time::timeout(LIVENESS_TIMEOUT, pongs.wait_for(|&n| n != seen))
            .await
            .is_ok_and(|answered| answered.is_ok())
    }
}

#[derive(Clone)]
struct App {
    status: StatusRx,
    exposition: Arc<metrics::Exposition>,
    liveness: Liveness,
    guard: Arc<Guard>,
    /// The agent's credentials for the API server, when it talks to it.
    credentials: Option<Credentials>,
}

/// What a connection brought with it: the client's certificate chain, if any.
#[derive(Clone, Default)]
struct Peer {
    chain: Arc<Vec<CertificateDer<'static>>>,
}

/// A TLS handshake must be done within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Each request's headers must arrive within this, counted from when the connection is
/// ready for them (so an idle keep-alive connection is closed after it too).
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Request headers larger than this are refused (hyper's smallest allowed buffer is 8 KiB).
const MAX_HEADER_BYTES: usize = 16 * 1024;

pub fn router(
    status: StatusRx,
    exposition: metrics::Exposition,
    liveness: Liveness,
    guard: Arc<Guard>,
    credentials: Option<Credentials>,
) -> Router {
    let app = App {
        status,
        exposition: Arc::new(exposition),
        liveness,
        guard,
        credentials,
    };
    Router::new()
        .route("/livez", get(live))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_handler))
        .with_state(app)
}

/// Accepts connections until the process ends, each served by a task of its own.
pub async fn serve(listener: tokio::net::TcpListener, router: Router, tls: Option<Arc<Tls>>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, most likely: let connections close, then go on.
                tracing::warn!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (router, tls) = (router.clone(), tls.clone());
        tokio::spawn(async move {
            let Some(tls) = tls else {
                return serve_connection(stream, router, Peer::default()).await;
            };
            let acceptor = TlsAcceptor::from(tls.current().config.clone());
            let stream =
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => stream,
                    // A failed or abandoned handshake: nothing to answer.
                    Ok(Err(e)) => return tracing::debug!(error = %e, "TLS handshake failed"),
                    Err(_) => return tracing::debug!("TLS handshake timed out"),
                };
            let chain = stream
                .get_ref()
                .1
                .peer_certificates()
                .map(|certs| certs.iter().map(|c| c.clone().into_owned()).collect())
                .unwrap_or_default();
            serve_connection(
                stream,
                router,
                Peer {
                    chain: Arc::new(chain),
                },
            )
            .await
        });
    }
}

async fn serve_connection<I>(io: I, router: Router, peer: Peer)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        request.extensions_mut().insert(peer.clone());
        router.clone().oneshot(request)
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES);
    if let Err(e) = http.serve_connection(TokioIo::new(io), service).await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

async fn live(State(app): State<App>) -> Response {
    if app.liveness.alive().await {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the reconciliation loop does not answer\n",
        )
            .into_response()
    }
}

async fn ready(
    State(app): State<App>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Response {
    let status = app.status.borrow().clone();
    let ready = status.ready();
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    if !query.contains_key("verbose") {
        return (code, if ready { "ok\n" } else { "not ready\n" }).into_response();
    }
    let mut checks = status.checks();
    if let Some(credentials) = &app.credentials {
        // Shown beside the sources it holds back; like them, it does not fail readiness
        // while the file on disk is valid.
        let at = checks
            .iter()
            .position(|(name, _)| name.starts_with("source:"))
            .unwrap_or(checks.len());
        checks.insert(
            at,
            ("credentials".to_string(), credentials_problem(credentials)),
        );
    }
    let mut body = String::new();
    // Names and reasons carry outside text (paths, source specs, API errors).
    for (name, problem) in checks {
        match problem {
            None => body.push_str(&format!("[+]{} ok\n", escape(&name))),
            Some(why) => body.push_str(&format!("[-]{} failed: {}\n", escape(&name), escape(&why))),
        }
    }
    body.push_str(if ready {
        "readyz check passed\n"
    } else {
        "readyz check failed\n"
    });
    (code, body).into_response()
}

/// What is wrong with the agent's credentials for the API server, if anything.
fn credentials_problem(credentials: &Credentials) -> Option<String> {
    let current = credentials.current();
    match (&current.client, &current.problem) {
        (_, None) if current.read => None,
        (_, None) => Some("not read yet".to_string()),
        (None, Some(problem)) => Some(problem.clone()),
        (Some(_), Some(problem)) => Some(format!(
            "{problem}; requests use the last good credentials meanwhile"
        )),
    }
}

/// Why `/metrics` refuses a request: 401 for who, 403 for may not.
fn refuse(code: StatusCode, why: &str) -> Response {
    (
        code,
        format!(
            "{}: {}\n",
            code.canonical_reason().unwrap_or(""),
            escape(why)
        ),
    )
        .into_response()
}

async fn metrics_handler(
    State(app): State<App>,
    peer: Option<Extension<Peer>>,
    headers: HeaderMap,
) -> Response {
    let chain = peer.map(|Extension(p)| p.chain).unwrap_or_default();
    if let Err(refusal) = app.guard.admit(&chain, &headers, "/metrics").await {
        return refuse(refusal.code, &refusal.why);
    }
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let content_type = if wants_openmetrics {
        metrics::OPENMETRICS_CONTENT_TYPE
    } else {
        metrics::PROMETHEUS_CONTENT_TYPE
    };
    (
        [(header::CONTENT_TYPE, content_type)],
        app.exposition.encode(wants_openmetrics),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// The loop's side, answering every ping until dropped (what the reconciler does
    /// between passes).
    fn answering(mut pongs: Pongs) -> tokio::task::JoinHandle<Pongs> {
        tokio::spawn(async move {
            while pongs.pings.recv().await.is_some() {
                pongs.answer();
            }
            pongs
        })
    }

    #[tokio::test]
    async fn a_loop_that_never_answers_is_not_alive_within_the_timeout() {
        let (liveness, pongs) = liveness();
        // It answered once, long ago: an old answer does not count for a new probe.
        pongs.answer();
        let started = Instant::now();
        // A probe that waited forever would hang every later probe's connection too.
        let answer = tokio::time::timeout(LIVENESS_TIMEOUT * 3, liveness.alive()).await;
        assert_eq!(answer, Ok(false), "no answer within the timeout");
        let took = started.elapsed();
        assert!(took >= LIVENESS_TIMEOUT, "gave up after {took:?}");
        drop(pongs);
    }

    #[tokio::test]
    async fn a_loop_that_is_gone_is_not_alive() {
        let (liveness, pongs) = liveness();
        drop(pongs);
        assert!(!liveness.alive().await);
    }

    #[tokio::test]
    async fn a_loop_that_answers_is_alive_probe_after_probe() {
        let (liveness, pongs) = liveness();
        let _loop = answering(pongs);
        for _ in 0..5 {
            assert!(liveness.alive().await);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_probes_share_one_ping() {
        let (liveness, mut pongs) = liveness();
        // Many probes while the loop is busy (not reading pings).
        let probes: Vec<_> = (0..50)
            .map(|_| {
                let liveness = liveness.clone();
                tokio::spawn(async move { liveness.alive().await })
            })
            .collect();
        // Each probe has taken its starting count and sent (or found) its ping.
        tokio::time::sleep(Duration::from_millis(200)).await;
        // The loop comes round: one ping is waiting, not fifty.
        pongs.pings.recv().await.expect("a ping is waiting");
        assert!(
            matches!(
                pongs.pings.try_recv(),
                Err(mpsc::error::TryRecvError::Empty)
            ),
            "more than one ping was queued"
        );
        // One answer serves every probe.
        pongs.answer();
        for probe in probes {
            assert!(
                probe.await.unwrap(),
                "a probe did not see the shared answer"
            );
        }
    }
}
