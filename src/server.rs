//! The HTTP endpoint: `/livez` and `/healthz` (the reconciliation loop answers a ping),
//! `/readyz` (from the loop's status, `?verbose` lists each check), and `/metrics`. Health
//! paths need no authentication. `/metrics` is served only with `--insecure-metrics` (on
//! loopback) until TLS client authentication is configured; otherwise it answers 401.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot};

use crate::daemon::status::StatusRx;
use crate::metrics;

/// A liveness ping: the loop answers on the oneshot when it gets to it.
pub type Ping = oneshot::Sender<()>;

#[derive(Clone)]
struct App {
    status: StatusRx,
    registry: Arc<Registry>,
    pings: mpsc::Sender<Ping>,
    insecure_metrics: bool,
}

pub fn router(
    status: StatusRx,
    registry: Registry,
    pings: mpsc::Sender<Ping>,
    insecure_metrics: bool,
) -> Router {
    let app = App {
        status,
        registry: Arc::new(registry),
        pings,
        insecure_metrics,
    };
    Router::new()
        .route("/livez", get(live))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_handler))
        .with_state(app)
}

pub async fn serve(listener: tokio::net::TcpListener, router: Router) {
    if let Err(e) = axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    {
        tracing::error!(error = %e, "the HTTP server stopped");
    }
}

async fn live(State(app): State<App>) -> Response {
    let (tx, rx) = oneshot::channel();
    let answered = app.pings.try_send(tx).is_ok()
        && tokio::time::timeout(Duration::from_secs(2), rx)
            .await
            .is_ok_and(|r| r.is_ok());
    if answered {
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
    let mut body = String::new();
    for (name, problem) in status.checks() {
        match problem {
            None => body.push_str(&format!("[+]{name} ok\n")),
            Some(why) => body.push_str(&format!("[-]{name} failed: {why}\n")),
        }
    }
    body.push_str(if ready {
        "readyz check passed\n"
    } else {
        "readyz check failed\n"
    });
    (code, body).into_response()
}

async fn metrics_handler(State(app): State<App>, headers: HeaderMap) -> Response {
    if !app.insecure_metrics {
        return (
            StatusCode::UNAUTHORIZED,
            "Unauthorized: no client authentication is configured; use --insecure-metrics on a loopback address\n",
        )
            .into_response();
    }
    let openmetrics = metrics::encode_openmetrics(&app.registry);
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    if wants_openmetrics {
        (
            [(header::CONTENT_TYPE, metrics::OPENMETRICS_CONTENT_TYPE)],
            openmetrics,
        )
            .into_response()
    } else {
        let text = metrics::to_prometheus_text(&openmetrics);
        (
            [(header::CONTENT_TYPE, metrics::PROMETHEUS_CONTENT_TYPE)],
            text,
        )
            .into_response()
    }
}
