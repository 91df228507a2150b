//! The HTTP endpoint: `/livez` and `/healthz` (the reconciliation loop answers a ping;
//! concurrent probes share one answer), `/readyz` (from the loop's status, `?verbose` lists
//! each check), and `/metrics`. Health paths need no authentication. `/metrics` needs an
//! authenticated, authorized identity (a client certificate, [`tls`], checked against the
//! allow-list, [`auth`]), unless `--insecure-metrics` (loopback only) turns that off.
//!
//! Each connection is a task of its own with a deadline on the TLS handshake, on every
//! request's headers, on each request's handling and on every write, and a bound on the
//! headers' size: a silent, slow or unreading client is dropped. Connections are capped
//! ([`Limits`]) below the process's descriptor limit, with descriptors kept back for the
//! agent's own reads and a small reserve of connections that serve only the health paths,
//! so that a flood of connections never stops a probe or the loop. A client's certificate
//! chain is bounded and verified once per connection ([`tls::PeerChain`]).
//!
//! The endpoint runs on threads of its own ([`spawn`]), apart from the watches, the file
//! watcher and the reconciliation loop: nothing a client does there holds them.

pub mod auth;
pub mod breaker;
pub mod endpoint;
pub mod exposition;
pub mod identity;
pub mod render;
pub mod repeated;
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
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::credentials::Credentials;
use crate::status::{Check, StatusRx};
use crate::text::escape;
pub use auth::Guard;
use repeated::Repeated;
use tls::{PeerChain, Tls};

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
    /// `/metrics`, rendered off the endpoint's threads and shared between waiting scrapes.
    renders: Arc<render::Renders>,
    liveness: Liveness,
    guard: Arc<Guard>,
    /// The agent's credentials for the API server, when it talks to it.
    credentials: Option<Credentials>,
    /// Checks of the loop's observers (the node report), shown and never counted.
    observers: Vec<watch::Receiver<Option<Check>>>,
}

/// What a connection brought with it: the client's certificate chain, if any, and whether
/// it came in on the reserve kept for health checks.
#[derive(Clone, Default)]
struct Peer {
    chain: PeerChain,
    reserve: bool,
}

/// A TLS handshake must be done within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Each request's headers must arrive within this, counted from when the connection is
/// ready for them (so an idle keep-alive connection is closed after it too).
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Request headers larger than this are refused (hyper's smallest allowed buffer is 8 KiB).
const MAX_HEADER_BYTES: usize = 16 * 1024;
/// A connection whose writes make no progress for this long is closed: a client that sends
/// requests and never reads the answers holds nothing for longer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// A request is answered within this, or with a 503 (a review's own deadline is 10 s).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Connections at most, whatever the descriptor limit allows.
pub const MAX_CONNECTIONS: usize = 256;
/// Connections past the cap that are still served, for the health paths only, one request
/// each with a short header deadline: the kubelet's probes get in while clients hold every
/// other place.
pub const PROBE_RESERVE: usize = 8;
/// Descriptors kept back from connections for the agent's own work: the bundle, its
/// sources, the state directory, inotify, the watches and reviews to the API server.
pub const FD_RESERVE: usize = 64;
/// The header deadline on a reserve connection.
const RESERVE_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// How many connections the endpoint serves at once: [`MAX_CONNECTIONS`], or fewer when the
/// descriptor limit is low, keeping [`FD_RESERVE`] descriptors and the probe reserve free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub connections: usize,
    pub reserve: usize,
}

impl Limits {
    /// From the descriptor limit, after raising its soft value to the hard one (as Go
    /// programs do at start).
    pub fn for_process() -> Limits {
        use nix::sys::resource::{Resource, getrlimit, setrlimit};
        let soft = match getrlimit(Resource::RLIMIT_NOFILE) {
            Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
            {
                Ok(()) => hard,
                Err(_) => soft,
            },
            Ok((soft, _)) => soft,
            Err(_) => 1024,
        };
        let limits = Limits::for_descriptors(soft);
        if limits.connections < MAX_CONNECTIONS {
            tracing::warn!(
                open_files_limit = soft,
                connections = limits.connections,
                "the open-files limit is low: the endpoint serves at most {} connections (raise LimitNOFILE= or ulimit -n to {} for {MAX_CONNECTIONS})",
                limits.connections,
                MAX_CONNECTIONS + PROBE_RESERVE + FD_RESERVE
            );
        }
        limits
    }

    pub fn for_descriptors(limit: u64) -> Limits {
        let spare = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .saturating_sub(FD_RESERVE + PROBE_RESERVE);
        Limits {
            connections: spare.clamp(1, MAX_CONNECTIONS),
            reserve: PROBE_RESERVE,
        }
    }
}

pub fn router(
    status: StatusRx,
    exposition: exposition::Exposition,
    liveness: Liveness,
    guard: Arc<Guard>,
    credentials: Option<Credentials>,
    observers: Vec<watch::Receiver<Option<Check>>>,
) -> Router {
    let app = App {
        status,
        renders: render::Renders::new(Arc::new(move |openmetrics| exposition.encode(openmetrics))),
        liveness,
        guard,
        credentials,
        observers,
    };
    Router::new()
        .route("/livez", get(live))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_handler))
        .with_state(app)
}

/// Serves `router` on `listener` on threads of the endpoint's own (a runtime of two worker
/// threads that nothing else uses), for as long as the process runs.
pub fn spawn(
    listener: std::net::TcpListener,
    router: Router,
    tls: Option<Arc<Tls>>,
    limits: Limits,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kubelet-ca-agent-http")
        .enable_all()
        .build()
        .context("cannot start the endpoint's runtime")?;
    std::thread::Builder::new()
        .name("kubelet-ca-agent-http".into())
        .spawn(move || {
            runtime.block_on(async move {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => serve(listener, router, tls, limits).await,
                    Err(e) => tracing::error!(error = %e, "the endpoint cannot listen"),
                }
            })
        })
        .context("cannot start the endpoint's thread")?;
    Ok(())
}

/// Accepts connections until the process ends, each served by a task of its own, at most
/// `limits.connections` at once plus `limits.reserve` for the health paths. When every place
/// is taken, a new connection takes the place of the oldest idle one (still in its TLS
/// handshake, or waiting for a request), else of the oldest whose client has not read its
/// answers for [`STALL_GRACE`]: a silent or unreading client holds nothing another needs.
/// Only when every connection is being answered (bounded by [`REQUEST_TIMEOUT`]) is a new
/// one sent to the reserve, or closed at once.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    tls: Option<Arc<Tls>>,
    limits: Limits,
) {
    let places = Connections::new(limits.connections);
    let reserve = Connections::new(limits.reserve);
    let accept_failures = Repeated::new("accepting connections");
    let refused = Repeated::new("taking connections");
    loop {
        // Connections told to make room have not closed yet: their descriptors are not free.
        // Accept no more until they have, so that closing never lags behind accepting.
        places.settled().await;
        reserve.settled().await;
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                accept_failures.succeeded();
                stream
            }
            Err(e) => {
                // Out of descriptors, most likely: let connections close, then go on.
                accept_failures.failed(&format!("cannot accept a connection: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (place, on_reserve) = match places.admit() {
            Some(place) => (place, false),
            None => match reserve.admit() {
                Some(place) => (place, true),
                None => {
                    refused.failed(&format!(
                        "all {} connections (and {} for health checks) are busy answering: closing new connections at once",
                        limits.connections, limits.reserve
                    ));
                    drop(stream);
                    continue;
                }
            },
        };
        if !on_reserve {
            refused.succeeded();
        }
        let _ = stream.set_nodelay(true);
        bound_send_buffer(&stream);
        let (router, tls) = (router.clone(), tls.clone());
        tokio::spawn(async move {
            let state = place.state.clone();
            tokio::select! {
                () = state.close.notified() => {
                    tracing::debug!("closed an idle connection to make room for a new one");
                }
                () = connection(stream, router, tls, state.clone(), on_reserve) => {}
            }
            drop(place);
        });
    }
}

/// One connection: the TLS handshake, if any, then its requests.
async fn connection(
    stream: tokio::net::TcpStream,
    router: Router,
    tls: Option<Arc<Tls>>,
    state: Arc<Connection>,
    reserve: bool,
) {
    let stream = Deadline::new(stream, state.clone());
    let Some(tls) = tls else {
        let peer = Peer {
            chain: PeerChain::default(),
            reserve,
        };
        return serve_connection(stream, router, peer, state).await;
    };
    let acceptor = TlsAcceptor::from(tls.current().config.clone());
    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
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
    let peer = Peer {
        chain: PeerChain::new(chain),
        reserve,
    };
    serve_connection(stream, router, peer, state).await
}

/// What the kernel may hold of a connection's unread answers. Without a bound, its buffers
/// grow to megabytes for a client that sends requests and never reads (the agent keeps
/// answering into them, and a write never waits, so [`WRITE_TIMEOUT`] never starts): 300
/// such clients held over 400 MiB. With it, an unread answer stalls the write within
/// 128 KiB. A scrape of a thousand certificates (about a megabyte) is read as it is sent.
const SEND_BUFFER_BYTES: usize = 128 * 1024;

fn bound_send_buffer(stream: &tokio::net::TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    if let Err(e) = setsockopt(stream, sockopt::SndBuf, &SEND_BUFFER_BYTES) {
        tracing::debug!(error = %e, "cannot bound a connection's send buffer");
    }
}

/// The connections of one pool, oldest first, and how many it may hold.
struct Connections {
    limit: usize,
    table: Arc<std::sync::Mutex<std::collections::BTreeMap<u64, Arc<Connection>>>>,
    next: std::sync::atomic::AtomicU64,
    /// Connections told to close to make room, not yet gone.
    closing: Arc<Closing>,
}

/// Counts the connections that were told to close and have not yet, and wakes whoever
/// waits for them all to be gone.
#[derive(Default)]
struct Closing {
    count: std::sync::atomic::AtomicUsize,
    gone: tokio::sync::Notify,
}

/// A connection whose write has waited this long for its client to read gives its place
/// to a new one when no connection is idle: a client that does not read, not one that
/// reads slowly.
const STALL_GRACE: Duration = Duration::from_secs(1);

/// What the pool knows of one connection: whether it is busy, and how to close it.
struct Connection {
    accepted: std::time::Instant,
    /// Requests being answered.
    requests: std::sync::atomic::AtomicUsize,
    /// Since when (nanoseconds after `accepted`, plus one; 0: not) a write has waited for
    /// the client to read.
    stalled_at: std::sync::atomic::AtomicU64,
    close: tokio::sync::Notify,
}

impl Default for Connection {
    fn default() -> Self {
        Connection {
            accepted: std::time::Instant::now(),
            requests: Default::default(),
            stalled_at: Default::default(),
            close: Default::default(),
        }
    }
}

impl Connection {
    fn idle(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.requests.load(Relaxed) == 0 && self.stalled_at.load(Relaxed) == 0
    }

    /// A write waits for the client to read (`true`), or made progress.
    fn stall(&self, stalled: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        if !stalled {
            self.stalled_at.store(0, Relaxed);
        } else if self.stalled_at.load(Relaxed) == 0 {
            let at = u64::try_from(self.accepted.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.stalled_at.store(at.saturating_add(1), Relaxed);
        }
    }

    /// Whether a write has waited for the client for at least [`STALL_GRACE`].
    fn stalled_long(&self, now: std::time::Instant) -> bool {
        let at = self.stalled_at.load(std::sync::atomic::Ordering::Relaxed);
        at != 0
            && now.duration_since(self.accepted)
                >= Duration::from_nanos(at - 1).saturating_add(STALL_GRACE)
    }
}

/// A connection's place in its pool, given back when dropped.
struct Place {
    id: u64,
    state: Arc<Connection>,
    table: Arc<std::sync::Mutex<std::collections::BTreeMap<u64, Arc<Connection>>>>,
    closing: Arc<Closing>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let held = self
            .table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.id);
        // Not in the table any more: it was told to close to make room, and now it has.
        if held.is_none()
            && self
                .closing
                .count
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
                == 1
        {
            self.closing.gone.notify_waiters();
        }
    }
}

impl Connections {
    fn new(limit: usize) -> Connections {
        Connections {
            limit,
            table: Arc::default(),
            next: std::sync::atomic::AtomicU64::new(0),
            closing: Arc::default(),
        }
    }

    /// Returns once every connection told to make room has closed.
    async fn settled(&self) {
        loop {
            // Registered before the count is read: a close between the two is not missed
            // (notify_waiters wakes only the waiters already registered).
            let gone = self.closing.gone.notified();
            tokio::pin!(gone);
            gone.as_mut().enable();
            if self
                .closing
                .count
                .load(std::sync::atomic::Ordering::Acquire)
                == 0
            {
                return;
            }
            gone.await;
        }
    }

    /// A place for a new connection: a free one, or that of the oldest idle connection,
    /// which is told to close. None when every connection is busy.
    fn admit(&self) -> Option<Place> {
        let mut table = self
            .table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if table.len() >= self.limit {
            // The oldest idle connection, else the oldest whose client has not read for a
            // while; never one that is being answered.
            let now = std::time::Instant::now();
            let victim = table
                .iter()
                .find(|(_, c)| c.idle())
                .or_else(|| table.iter().find(|(_, c)| c.stalled_long(now)))
                .map(|(id, _)| *id)?;
            if let Some(evicted) = table.remove(&victim) {
                self.closing
                    .count
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                evicted.close.notify_one();
            }
        }
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let state = Arc::new(Connection::default());
        table.insert(id, state.clone());
        Some(Place {
            id,
            state,
            table: self.table.clone(),
            closing: self.closing.clone(),
        })
    }
}

async fn serve_connection<I>(io: I, router: Router, peer: Peer, state: Arc<Connection>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let reserve = peer.reserve;
    let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        request.extensions_mut().insert(peer.clone());
        let router = router.clone();
        let busy = Busy::new(state.clone());
        async move {
            let answer = match tokio::time::timeout(REQUEST_TIMEOUT, router.oneshot(request)).await
            {
                Ok(answer) => answer,
                Err(_) => Ok((
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the request took too long to answer\n",
                )
                    .into_response()),
            };
            // A refusal leaves after a pause, the connection idle meanwhile (room is made
            // from it first): a client that sends request after request it may not make is
            // slowed to a few a second per connection, at the cost of a timer.
            if let Ok(response) = &answer
                && response.extensions().get::<Refused>().is_some()
            {
                drop(busy);
                tokio::time::sleep(REFUSAL_PAUSE).await;
            }
            answer
        }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(if reserve {
            RESERVE_HEADER_TIMEOUT
        } else {
            HEADER_TIMEOUT
        })
        .keep_alive(!reserve)
        .max_buf_size(MAX_HEADER_BYTES);
    if let Err(e) = http.serve_connection(TokioIo::new(io), service).await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// A request being answered on a connection, for as long as it lives.
struct Busy(Arc<Connection>);

impl Busy {
    fn new(state: Arc<Connection>) -> Busy {
        state
            .requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Busy(state)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0
            .requests
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A connection's transport with a deadline on writes: a write (or flush) that makes no
/// progress for [`WRITE_TIMEOUT`] fails, and the connection is dropped. hyper's header
/// deadline covers reading a request; nothing else would end a connection whose client
/// stopped reading the answers.
struct Deadline<T> {
    inner: T,
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Told when a write waits for the client: such a connection is busy, not idle.
    state: Arc<Connection>,
}

impl<T> Deadline<T> {
    fn new(inner: T, state: Arc<Connection>) -> Deadline<T> {
        Deadline {
            inner,
            stalled: None,
            state,
        }
    }

    /// After a write that made no progress: an error once the deadline has passed.
    fn stall(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Error> {
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(WRITE_TIMEOUT)));
        sleep.as_mut().poll(cx).map(|()| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client read nothing for the write timeout",
            )
        })
    }

    fn progress<R>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: std::task::Poll<std::io::Result<R>>,
    ) -> std::task::Poll<std::io::Result<R>> {
        use std::task::Poll;
        let stalled = |deadline: &Self, yes| deadline.state.stall(yes);
        match polled {
            Poll::Pending => {
                stalled(self, true);
                match self.stall(cx) {
                    Poll::Ready(e) => Poll::Ready(Err(e)),
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                stalled(self, false);
                self.stalled = None;
                ready
            }
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Deadline<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Deadline<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progress(cx, polled)
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progress(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_flush(cx);
        this.progress(cx, polled)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.inner).poll_shutdown(cx);
        this.progress(cx, polled)
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

/// How a check neither passed nor failed is said: waiting for something, or not known.
fn undecided(check: &Check) -> &'static str {
    if check.pending { "pending" } else { "unknown" }
}

async fn ready(
    State(app): State<App>,
    Query(query): Query<std::collections::HashMap<String, String>>,
    peer: Option<Extension<Peer>>,
    headers: HeaderMap,
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
            .position(|c| c.name.starts_with("source:"))
            .unwrap_or(checks.len());
        checks.insert(
            at,
            Check::shown("credentials".to_string(), credentials_problem(credentials)),
        );
    }
    // The observers' checks, before the sources: shown, never counted.
    let at = checks
        .iter()
        .position(|c| c.name.starts_with("source:"))
        .unwrap_or(checks.len());
    let observed: Vec<Check> = app
        .observers
        .iter()
        .filter_map(|o| o.borrow().clone())
        .map(|c| Check {
            counted: false,
            ..c
        })
        .collect();
    checks.splice(at..at, observed);
    // The reasons name files, the agent's identity and the API server's words: only a
    // client that may read /readyz by the rules of /metrics gets them; others get the
    // checks and "reason withheld", as the API server answers its anonymous callers.
    let peer = peer.map(|Extension(p)| p.chain).unwrap_or_default();
    let detailed = checks
        .iter()
        .all(|c| c.problem.is_none() && c.warning.is_none())
        || app.guard.admit(&peer, &headers, "/readyz").await.is_ok();
    let mut body = String::new();
    // Names and reasons carry outside text (paths, source specs, API errors). A failing
    // check that does not count for readiness says so.
    for check in checks {
        let name = escape(&check.name);
        let counted = if check.counted { "" } else { " (not counted)" };
        let word = undecided(&check);
        match check.problem {
            None => match &check.warning {
                None => match &check.detail {
                    Some(detail) => body.push_str(&format!("[+]{name} ok: {}\n", escape(detail))),
                    None => body.push_str(&format!("[+]{name} ok\n")),
                },
                Some(warning) if detailed => body.push_str(&format!(
                    "[+]{name} ok, with a warning: {}\n",
                    escape(warning)
                )),
                Some(_) => {
                    body.push_str(&format!("[+]{name} ok, with a warning: reason withheld\n"))
                }
            },
            // Not known: neither [+] nor [-], and never counted for readiness.
            Some(why) if check.unknown && detailed => body.push_str(&format!(
                "[?]{name} {}: {} (not counted)\n",
                word,
                escape(&why)
            )),
            Some(_) if check.unknown => body.push_str(&format!(
                "[?]{name} {}: reason withheld (not counted)\n",
                word
            )),
            Some(why) if detailed => {
                body.push_str(&format!("[-]{name} failed: {}{counted}\n", escape(&why)))
            }
            Some(_) => body.push_str(&format!("[-]{name} failed: reason withheld{counted}\n")),
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

/// Why `/metrics` refuses a request: 401 for who, 403 for may not, 503 or 429 when the
/// request was shed under load (with when to try again).
/// Marks an answer that refused a request (401, 403, or shed with 429 or 503): the
/// connection waits [`REFUSAL_PAUSE`] before sending it.
#[derive(Clone, Copy)]
struct Refused;

/// How long a refusal waits before it is sent. Nobody who may read `/metrics` waits for it
/// (a refused scraper retries at its next interval), while a client that floods refused
/// requests on a connection gets at most `1 / REFUSAL_PAUSE` answers a second from it:
/// without the pause, 16 connections presenting a certificate nobody signed were answered
/// 50,000 times a second, a core's worth of work that probes then queued behind.
const REFUSAL_PAUSE: Duration = Duration::from_millis(100);

fn refuse(refusal: &auth::Refusal) -> Response {
    let body = format!(
        "{}: {}\n",
        refusal.code.canonical_reason().unwrap_or(""),
        escape(&refusal.why)
    );
    let mut response = match refusal.retry_after {
        Some(seconds) => (
            refusal.code,
            [(header::RETRY_AFTER, seconds.to_string())],
            body,
        )
            .into_response(),
        None => (refusal.code, body).into_response(),
    };
    response.extensions_mut().insert(Refused);
    response
}

async fn metrics_handler(
    State(app): State<App>,
    peer: Option<Extension<Peer>>,
    headers: HeaderMap,
) -> Response {
    let peer = peer.map(|Extension(p)| p).unwrap_or_default();
    if peer.reserve {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            "the endpoint is at its connection limit; only health checks are served on this connection\n",
        )
            .into_response();
    }
    if let Err(refusal) = app.guard.admit(&peer.chain, &headers, "/metrics").await {
        return refuse(&refusal);
    }
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let content_type = if wants_openmetrics {
        exposition::OPENMETRICS_CONTENT_TYPE
    } else {
        exposition::PROMETHEUS_CONTENT_TYPE
    };
    match app.renders.get(wants_openmetrics).await {
        Some(body) => ([(header::CONTENT_TYPE, content_type)], body).into_response(),
        None => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the metrics could not be rendered\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_full_pool_makes_room_by_closing_its_oldest_idle_connection_never_a_busy_one() {
        let pool = Connections::new(3);
        let places: Vec<Place> = (0..3).map(|_| pool.admit().unwrap()).collect();
        // The oldest is answering a request, the second waits for its client to read.
        let busy = Busy::new(places[0].state.clone());
        places[1].state.stall(true);
        let fourth = pool.admit().expect("the idle third makes room");
        assert_eq!(pool.table.lock().unwrap().len(), 3);
        assert!(!pool.table.lock().unwrap().contains_key(&places[2].id));
        // No idle one: the client that has just stopped reading keeps its place...
        let _also_busy = Busy::new(fourth.state.clone());
        assert!(pool.admit().is_none());
        // ... until it has not read for a while.
        std::thread::sleep(STALL_GRACE);
        let fifth = pool.admit().expect("the unreading second makes room");
        assert!(!pool.table.lock().unwrap().contains_key(&places[1].id));
        // Every connection being answered: a new one is refused.
        let _answering = Busy::new(fifth.state.clone());
        assert!(pool.admit().is_none());
        // A request answered: that connection is idle again, and gives its place.
        drop(busy);
        assert!(pool.admit().is_some());
        assert!(!pool.table.lock().unwrap().contains_key(&places[0].id));
    }

    #[test]
    fn connections_are_capped_below_the_descriptor_limit() {
        assert_eq!(
            Limits::for_descriptors(1 << 20).connections,
            MAX_CONNECTIONS
        );
        assert_eq!(
            Limits::for_descriptors(256).connections,
            256 - FD_RESERVE - PROBE_RESERVE
        );
        // Never none at all, however low the limit.
        assert_eq!(Limits::for_descriptors(10).connections, 1);
        assert_eq!(Limits::for_descriptors(256).reserve, PROBE_RESERVE);
    }

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
