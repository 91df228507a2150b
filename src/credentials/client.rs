//! The kube-rs client the agent talks to the API server with: kube-rs's own stack, with no
//! hidden retries (set in [`super::load`]), and one layer that keeps what a load-shedding
//! server asks for.
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
use kube::client::{Body, ClientBuilder, DynBody};
use kube::core::Status;
use tower::BoxError;

/// The most of an error answer's body that is read to carry its wait: an error body is a
/// few hundred bytes; anything longer is cut (kube-rs shows it as text anyway).
const ERROR_BODY_MAX: usize = 64 * 1024;

/// A client for `config`, whose error answers carry their `Retry-After`.
pub fn client(config: kube::Config) -> kube::Result<kube::Client> {
    let layer = tower::layer::layer_fn(CarryRetryAfter);
    Ok(ClientBuilder::try_from(config)?.with_layer(&layer).build())
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
}
