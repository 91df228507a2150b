//! The kube-rs client the agent talks to the API server with: kube-rs's own stack, with no
//! hidden retries (set in [`super::load`]), one layer that keeps what a load-shedding
//! server asks for, and one that sends a read again on a new connection when the one it
//! went out on was closed before any answer (as Go's transport, and so every client-go
//! client, does).
//!
//! kube-apiserver sheds load (its max-in-flight and priority-and-fairness filters) with a
//! 429 whose `Retry-After` header says when to come back, and a plain-text body. kube-rs
//! turns an error answer into a [`Status`] made from the body alone, so the header would be
//! lost; this layer puts it into the Status as `details.retryAfterSeconds`, the field the
//! server itself uses in the Status bodies that carry a wait, so that the watch's lifecycle
//! (and anything else) reads the wait from one place.

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use kube::client::{Body, DynBody};
use kube::core::Status;
use tower::BoxError;

/// The most of an error answer's body that is read to carry its wait: an error body is a
/// few hundred bytes; anything longer is cut (kube-rs shows it as text anyway).
const ERROR_BODY_MAX: usize = 64 * 1024;

/// A client for `config`, whose error answers carry their `Retry-After`, and whose reads
/// are sent once more when their connection closed before any answer.
pub fn client(config: kube::Config) -> kube::Result<kube::Client> {
    let carry = tower::layer::layer_fn(CarryRetryAfter);
    // Beneath the buffer, the stack can be cloned to send a request again.
    let again = tower::layer::layer_fn(|stack| {
        SendAgainIfClosed(tower::buffer::Buffer::new(stack, STACK_BUFFER))
    });
    Ok(super::tls::builder(config)?
        .with_layer(&carry)
        .with_layer(&again)
        .build())
}

/// How many requests may wait for the stack beneath [`SendAgainIfClosed`] (kube-rs's own
/// buffer in front of it holds as many).
const STACK_BUFFER: usize = 1024;

/// The service of the second layer. A connection taken from the pool may have been closed
/// by the server as the request went out on it (an idle timeout, or an API server that has
/// just started closing the first connections it served): the request then fails with no
/// answer at all, and nothing of it was seen. A read (a GET: a list, a get, a watch) is sent
/// once more at once, on a new connection, as Go's transport does for a reused connection
/// (`shouldRetryRequest`), so that such a close is not taken for the server being down.
/// Writes are never sent again, and a second close is the caller's failure.
#[derive(Clone)]
struct SendAgainIfClosed<S>(S);

impl<S> tower::Service<Request<Body>> for SendAgainIfClosed<S>
where
    S: tower::Service<Request<Body>, Response = Response<Box<DynBody>>, Error = BoxError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Box<DynBody>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Answer> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let again = copy_of_read(&request).map(|copy| (self.0.clone(), copy));
        let answer = self.0.call(request);
        Box::pin(async move {
            match (answer.await, again) {
                (Err(error), Some((mut inner, copy))) if closed_before_answer(&*error) => {
                    tracing::debug!(
                        uri = %copy.uri(),
                        "the connection closed before any answer: sending the read again"
                    );
                    use tower::ServiceExt;
                    inner.ready().await?.call(copy).await
                }
                (answer, _) => answer,
            }
        })
    }
}

/// A copy of `request` to send again, when it is a read (a GET, whose body is empty); `None`
/// for anything else.
fn copy_of_read(request: &Request<Body>) -> Option<Request<Body>> {
    if request.method() != http::Method::GET {
        return None;
    }
    let mut copy = Request::builder()
        .method(http::Method::GET)
        .uri(request.uri().clone())
        .version(request.version())
        .body(Body::empty())
        .ok()?;
    *copy.headers_mut() = request.headers().clone();
    Some(copy)
}

/// Whether `error` is a connection closed before any answer to the request came (hyper's
/// "connection closed before message completed"), found anywhere in its chain of causes.
fn closed_before_answer(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The service of the layer: kube-rs's stack, each answer through [`carry_retry_after`].
#[derive(Clone)]
struct CarryRetryAfter<S>(S);

type Answer = Result<Response<Box<DynBody>>, BoxError>;

impl<S> tower::Service<Request<Body>> for CarryRetryAfter<S>
where
    S: tower::Service<Request<Body>, Response = Response<Box<DynBody>>, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<Box<DynBody>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Answer> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let answer = self.0.call(request);
        Box::pin(async move {
            match answer.await {
                Ok(response) => carry_retry_after(response).await,
                Err(error) => Err(error),
            }
        })
    }
}

/// `response`, with its `Retry-After` (whole seconds, as kube-apiserver sends it) put into
/// its Status when it is an error answer; any other response as it came.
async fn carry_retry_after(
    response: Response<Box<DynBody>>,
) -> Result<Response<Box<DynBody>>, BoxError> {
    let Some(seconds) = retry_after(&response) else {
        return Ok(response);
    };
    let code = response.status();
    let (mut parts, body) = response.into_parts();
    let bytes = read_some(body).await;
    let status = with_retry_after(&bytes, code, seconds);
    // A Status always serializes.
    let json = serde_json::to_vec(&status).unwrap_or_default();
    parts.headers.remove(CONTENT_LENGTH);
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let body = Full::new(Bytes::from(json)).map_err(never);
    Ok(Response::from_parts(parts, Box::new(body)))
}

/// The first [`ERROR_BODY_MAX`] bytes of `body`, or what came of it before it failed: what
/// it says is only needed to carry it on.
async fn read_some(mut body: Box<DynBody>) -> Vec<u8> {
    let mut bytes = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(data) = frame.data_ref() {
            let room = ERROR_BODY_MAX - bytes.len();
            bytes.extend_from_slice(&data[..data.len().min(room)]);
        }
        if bytes.len() >= ERROR_BODY_MAX {
            break;
        }
    }
    bytes
}

/// A body that cannot fail, as kube-rs's boxed body.
fn never(infallible: std::convert::Infallible) -> BoxError {
    match infallible {}
}

/// The whole seconds of the `Retry-After` of an error answer; `None` for a success, or a
/// header that is absent, or a date (which kube-apiserver never sends).
fn retry_after<B>(response: &Response<B>) -> Option<u32> {
    if !(response.status().is_client_error() || response.status().is_server_error()) {
        return None;
    }
    let value = response.headers().get(RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse().ok()
}

/// The Status of an error answer whose body is `body`, with `seconds` as its
/// `retryAfterSeconds` unless it says one itself. A body that is not a Status becomes the
/// one kube-rs would make of it.
fn with_retry_after(body: &[u8], code: StatusCode, seconds: u32) -> Status {
    let text = String::from_utf8_lossy(body);
    let mut status = serde_json::from_str::<Status>(&text).unwrap_or_else(|_| {
        Status::failure(text.trim(), "Failed to parse error data").with_code(code.as_u16())
    });
    match &mut status.details {
        Some(details) if details.retry_after_seconds > 0 => {}
        Some(details) => details.retry_after_seconds = seconds,
        None => {
            status.details =
                serde_json::from_value(serde_json::json!({"retryAfterSeconds": seconds})).ok();
        }
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(code: u16, retry_after: Option<&str>, body: &str) -> Response<Box<DynBody>> {
        let mut builder = Response::builder().status(code);
        if let Some(value) = retry_after {
            builder = builder.header(RETRY_AFTER, value);
        }
        let body = Full::new(Bytes::from(body.to_string())).map_err(never);
        builder.body(Box::new(body) as Box<DynBody>).unwrap()
    }

    async fn status_of(response: Response<Box<DynBody>>) -> (u16, Option<Status>) {
        let answer = carry_retry_after(response).await.unwrap();
        let code = answer.status().as_u16();
        let bytes = answer.into_body().collect().await.unwrap().to_bytes();
        (code, serde_json::from_slice(&bytes).ok())
    }

    /// kube-rs's stack beneath the layer, ready only once `ready` is set (as a stack with a
    /// full connection pool is not).
    struct Gate(std::sync::Arc<std::sync::atomic::AtomicBool>);

    impl tower::Service<Request<Body>> for Gate {
        type Response = Response<Box<DynBody>>;
        type Error = BoxError;
        type Future = std::future::Ready<Answer>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            if self.0.load(std::sync::atomic::Ordering::SeqCst) {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }

        fn call(&mut self, _: Request<Body>) -> Self::Future {
            std::future::ready(Ok(response(200, None, "")))
        }
    }

    #[test]
    fn the_layer_takes_a_request_only_when_the_stack_beneath_it_can() {
        use tower::Service;
        let ready = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut service = CarryRetryAfter(Gate(ready.clone()));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(service.poll_ready(&mut cx).is_pending());
        ready.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(matches!(service.poll_ready(&mut cx), Poll::Ready(Ok(()))));
    }

    #[test]
    fn a_status_that_says_no_retry_after_gets_the_headers_and_one_that_says_one_keeps_it() {
        let status = |details: &str| {
            format!(
                r#"{{"kind":"Status","apiVersion":"v1","status":"Failure","code":429,"reason":"TooManyRequests","details":{details}}}"#
            )
        };
        let code = StatusCode::TOO_MANY_REQUESTS;
        let given = with_retry_after(status(r#"{"retryAfterSeconds":0}"#).as_bytes(), code, 7);
        assert_eq!(given.details.unwrap().retry_after_seconds, 7);
        let own = with_retry_after(status(r#"{"retryAfterSeconds":3}"#).as_bytes(), code, 7);
        assert_eq!(own.details.unwrap().retry_after_seconds, 3);
        let none = with_retry_after(b"too many requests, please try again later", code, 5);
        assert_eq!(none.details.unwrap().retry_after_seconds, 5);
        assert_eq!(none.code, 429);
    }

    #[tokio::test]
    async fn the_plain_text_429_of_a_shedding_server_carries_its_wait() {
        let shed = response(
            429,
            Some("20"),
            "Too many requests, please try again later.\n",
        );
        let (code, status) = status_of(shed).await;
        assert_eq!(code, 429);
        let status = status.unwrap();
        assert_eq!(status.code, 429);
        assert_eq!(status.details.unwrap().retry_after_seconds, 20);
        // Read as kube-rs reads a body that is not a Status: its text is the message.
        assert_eq!(status.message, "Too many requests, please try again later.");
        assert_eq!(status.reason, "Failed to parse error data");
    }

    #[tokio::test]
    async fn a_status_body_keeps_its_own_fields_and_its_own_wait() {
        let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"the server is currently unable to handle the request","reason":"ServiceUnavailable","details":{"retryAfterSeconds":3},"code":503}"#;
        let (_, status) = status_of(response(503, Some("7"), body)).await;
        let status = status.unwrap();
        assert_eq!(status.reason, "ServiceUnavailable");
        assert_eq!(status.details.unwrap().retry_after_seconds, 3);
        let body = r#"{"kind":"Status","status":"Failure","message":"slow down","reason":"TooManyRequests","code":429}"#;
        let (_, status) = status_of(response(429, Some("7"), body)).await;
        assert_eq!(status.unwrap().details.unwrap().retry_after_seconds, 7);
    }

    #[tokio::test]
    async fn a_body_in_many_frames_is_read_whole_up_to_its_bound() {
        // A proxy's page in many chunks: all of it, up to the bound, and no further.
        for (frames, size, kept) in [(10, 1000, 10_000), (200, 1000, ERROR_BODY_MAX)] {
            let chunks = (0..frames).map(move |_| {
                Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(Bytes::from(vec![
                    b'x';
                    size
                ])))
            });
            let body =
                http_body_util::StreamBody::new(futures::stream::iter(chunks)).map_err(never);
            let answer = Response::builder()
                .status(503)
                .header(RETRY_AFTER, "2")
                .body(Box::new(body) as Box<DynBody>)
                .unwrap();
            let (_, status) = status_of(answer).await;
            let status = status.unwrap();
            assert_eq!(status.message.len(), kept, "{frames} frames of {size}");
            assert_eq!(status.details.unwrap().retry_after_seconds, 2);
        }
    }

    #[tokio::test]
    async fn other_answers_pass_untouched() {
        for (code, header) in [
            (200, Some("5")),
            (429, None),
            (503, Some("Wed, 21 Oct 2015 07:28:00 GMT")),
        ] {
            let answer = carry_retry_after(response(code, header, "as it came"))
                .await
                .unwrap();
            assert_eq!(answer.status().as_u16(), code);
            let bytes = answer.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&bytes[..], b"as it came", "{code} {header:?}");
        }
    }

    /// A plain-HTTP server on loopback that takes connections in turn and, on the n-th,
    /// answers the first `answered[n]` requests (a ConfigMap) and closes the connection when
    /// the next one has been read, with `last` written first (nothing: no answer at all).
    /// What it read: each request's first line, with the number of its connection.
    async fn closing_server(answered: Vec<usize>, last: &'static [u8]) -> (String, Seen) {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Seen::default();
        let log = seen.clone();
        tokio::spawn(async move {
            for (n, answers) in answered.into_iter().enumerate() {
                let (socket, _) = listener.accept().await.unwrap();
                let mut socket = BufReader::new(socket);
                for i in 0..=answers {
                    let mut head = String::new();
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        if socket.read_line(&mut line).await.unwrap() == 0 {
                            return;
                        }
                        if let Some(value) =
                            line.to_ascii_lowercase().strip_prefix("content-length:")
                        {
                            length = value.trim().parse().unwrap();
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if head.is_empty() {
                            head = line.trim().to_string();
                        }
                    }
                    let mut body = vec![0; length];
                    socket.read_exact(&mut body).await.unwrap();
                    log.0.lock().unwrap().push((n, head));
                    if i == answers {
                        break;
                    }
                    let json = r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"c","namespace":"ns"}}"#;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{json}",
                        json.len()
                    );
                    socket.get_mut().write_all(answer.as_bytes()).await.unwrap();
                }
                // Closed with the request read and `last` as the answer.
                let _ = socket.get_mut().write_all(last).await;
            }
        });
        (url, seen)
    }

    /// What [`closing_server`] read: each request's first line, with the number of its
    /// connection. Complete once the client has its answer: a request is noted before it is
    /// answered or its connection closed.
    #[derive(Clone, Default)]
    struct Seen(std::sync::Arc<std::sync::Mutex<Vec<(usize, String)>>>);

    impl Seen {
        fn take(&self) -> Vec<(usize, String)> {
            std::mem::take(&mut self.0.lock().unwrap())
        }
    }

    fn client_of(url: &str) -> kube::Client {
        let mut config = kube::Config::new(url.parse().unwrap());
        config.default_retry = false;
        client(config).unwrap()
    }

    #[tokio::test]
    async fn a_read_whose_connection_closed_before_any_answer_is_sent_again_on_a_new_one() {
        use k8s_openapi::api::core::v1::ConfigMap;
        let (url, server) = closing_server(vec![1, 1], b"").await;
        let api: kube::Api<ConfigMap> = kube::Api::namespaced(client_of(&url), "ns");
        api.get("c").await.unwrap();
        // Sent on the pooled connection, which the server closes: sent again, answered.
        api.get("c").await.unwrap();
        let seen = server.take();
        let get = "GET /api/v1/namespaces/ns/configmaps/c HTTP/1.1";
        assert_eq!(
            seen,
            vec![
                (0, get.to_string()),
                (0, get.to_string()),
                (1, get.to_string())
            ]
        );
    }

    #[tokio::test]
    async fn a_write_is_never_sent_again_and_a_read_only_once() {
        use k8s_openapi::api::core::v1::ConfigMap;
        // A write on a connection closed before any answer: the caller's failure.
        let (url, server) = closing_server(vec![1], b"").await;
        let api: kube::Api<ConfigMap> = kube::Api::namespaced(client_of(&url), "ns");
        api.get("c").await.unwrap();
        let patch = kube::api::Patch::Merge(serde_json::json!({"data": {"k": "v"}}));
        let failed = api
            .patch("c", &kube::api::PatchParams::default(), &patch)
            .await;
        assert!(failed.is_err());
        let seen = server.take();
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(seen[1].1.starts_with("PATCH "), "{seen:?}");

        // A read closed twice: sent once more, then the caller's failure, no loop.
        let (url, server) = closing_server(vec![0, 0, 0], b"").await;
        let api: kube::Api<ConfigMap> = kube::Api::namespaced(client_of(&url), "ns");
        let failed = api.get("c").await.unwrap_err();
        assert!(closed_before_answer(&failed), "{failed}");
        let seen = server.take();
        assert_eq!(
            seen.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
            vec![0, 1],
            "{seen:?}"
        );

        // A read that failed otherwise (an answer that is no HTTP): the caller's, at once.
        let (url, server) = closing_server(vec![0, 0], b"HTTP/1.1 what\r\n\r\n").await;
        let api: kube::Api<ConfigMap> = kube::Api::namespaced(client_of(&url), "ns");
        let failed = api.get("c").await.unwrap_err();
        assert!(!closed_before_answer(&failed), "{failed}");
        assert_eq!(server.take().len(), 1);
    }

    #[test]
    fn only_a_get_is_copied_with_its_headers_and_no_body() {
        let get = Request::builder()
            .method("GET")
            .uri("/api/v1/nodes?watch=true")
            .header("accept", "application/json")
            .body(Body::empty())
            .unwrap();
        let copy = copy_of_read(&get).unwrap();
        assert_eq!(copy.uri(), "/api/v1/nodes?watch=true");
        assert_eq!(copy.headers()["accept"], "application/json");
        for method in ["PATCH", "POST", "PUT", "DELETE"] {
            let write = Request::builder()
                .method(method)
                .uri("/api/v1/nodes/n")
                .body(Body::from(b"{}".to_vec()))
                .unwrap();
            assert!(copy_of_read(&write).is_none(), "{method}");
        }
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(!closed_before_answer(&refused));
    }
}
