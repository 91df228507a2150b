//! What went wrong with a request to the API server, said once for every watch and request
//! of the binary: its reason (a metric label), one bounded line for an operator that names
//! what answered what, and its kind for the watch's lifecycle ([`Failure`]). A server's or a
//! proxy's text is made one printable line and cut ([`printable`]), so that an HTML error
//! page never reaches a log line or a health page whole.

use std::time::Duration;

use kube::core::Status;

use super::lifecycle::Failure;
use crate::credentials::Current;

/// The longest text of a problem, hints included.
const MAX_TEXT: usize = 600;

/// What went wrong with one request, or with an open watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Its reason, as metric labels and the report's errors name it: `unauthorized`,
    /// `forbidden`, `not_found`, `expired`, `api_error`, `tls`, `unreachable`,
    /// `no_answer`, `watch_ended`, `watch_silent`, `credentials`.
    pub reason: &'static str,
    /// For an operator: what answered what (`https://HOST:PORT: HTTP 403 Forbidden: ...`).
    pub text: String,
    /// Its kind, for the lifecycle.
    pub failure: Failure,
}

impl Problem {
    /// A problem said as `text`, cut to its bound.
    pub fn new(reason: &'static str, text: String, failure: Failure) -> Problem {
        let text = match text.char_indices().nth(MAX_TEXT) {
            Some((cut, _)) => format!("{}...", &text[..cut]),
            None => text,
        };
        Problem {
            reason,
            text,
            failure,
        }
    }

    /// What went wrong with a request to `server`: the API server's answer, or what kept
    /// the request from reaching it, said the way an operator can act on
    /// (`https://HOST:PORT: connection refused`, `... TLS: ...`), never the client
    /// library's bare `client error (Connect)`.
    pub fn of(server: &str, error: &kube::Error) -> Problem {
        let failure = failure_of(error);
        match error {
            kube::Error::Api(status) => {
                let (reason, said) = status_text(status);
                Problem::new(reason, format!("{server}: {said}"), failure)
            }
            other => {
                let (reason, cause) = transport_cause(other);
                Problem::new(reason, format!("{server}: {cause}"), failure)
            }
        }
    }

    /// A request that `server` took and never answered within `deadline`.
    pub fn hung(server: &str, what: &str, deadline: Duration) -> Problem {
        Problem::new(
            "no_answer",
            format!(
                "{server}: the API server took the {what} request and sent no answer within {}s (hung, or a proxy in the way is)",
                deadline.as_secs()
            ),
            Failure::Hung,
        )
    }

    /// Whether it says that the credentials may be stale: refused as unauthorized, or a
    /// server certificate that the trusted CAs do not sign (the server moved to a new CA).
    pub fn proves_stale(&self) -> bool {
        matches!(self.reason, "unauthorized" | "tls")
    }

    /// This problem, with what the agent knows of its own credentials when they are the
    /// likely cause: an expired client certificate, or the CA the server's certificate was
    /// checked against.
    pub fn with_credentials_hint(self, current: &Current) -> Problem {
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let hint = match self.reason {
            "unauthorized" => current.client_certificate().and_then(|cert| {
                cert.is_expired_at(now).then(|| {
                    format!(
                        " (the client certificate in use, {}, expired at {}: the agent reads the credentials again and uses the new certificate as soon as it is on disk)",
                        current.client_certificate_origin.as_deref().unwrap_or("?"),
                        crate::text::rfc3339(cert.not_after)
                    )
                })
            }),
            "tls" => current
                .ca_origin
                .as_deref()
                .map(|ca| format!(" (trusted for it: {ca})")),
            _ => None,
        };
        match hint {
            Some(hint) => Problem::new(self.reason, format!("{}{hint}", self.text), self.failure),
            None => self,
        }
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// An error answer's reason and text: a metav1 Status, or what kube-rs made of a body that
/// was not one (an HTML page or an empty body from a proxy or load balancer).
fn status_text(status: &Status) -> (&'static str, String) {
    let reason = match status.code {
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        410 => "expired",
        _ => "api_error",
    };
    let code = status.code;
    let said = if status.reason == "Failed to parse error data" {
        // kube-rs puts the raw body in the message when it is not a Status.
        match printable(&status.message) {
            body if body.is_empty() => format!(
                "HTTP {code} with an empty body, not a Kubernetes Status (a proxy or load balancer between here and the API server?)"
            ),
            body => format!(
                "HTTP {code} with a body that is not a Kubernetes Status (a proxy or load balancer between here and the API server?): {body}"
            ),
        }
    } else {
        format!(
            "HTTP {code} {}: {}",
            printable(&status.reason),
            printable(&status.message)
        )
    };
    (reason, said)
}

/// The kind of failure `error` is, for a backoff ([`super::lifecycle::Backoff`]): a server that
/// could not be reached at all (refused, reset, timed out), `410 Gone`, or a failure the
/// server answered (a TLS failure among them), with the wait it asked for.
pub fn failure_of(error: &kube::Error) -> Failure {
    match error {
        kube::Error::Api(status) => status_failure(status),
        other => match transport_cause(other).0 {
            "unreachable" => Failure::Unreachable,
            _ => Failure::ANSWERED,
        },
    }
}

/// The cause of a request that got no answer, from the innermost error that says it: a TLS
/// failure (reason `tls`), a refused, reset or timed-out connection, or a failed name
/// lookup (reason `unreachable`).
pub fn transport_cause(error: &(dyn std::error::Error + 'static)) -> (&'static str, String) {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error);
    let mut innermost = error.to_string();
    let mut dns = false;
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return ("tls", tls_problem(tls));
        }
        let io = e.downcast_ref::<std::io::Error>();
        if let Some(io) = io {
            use std::io::ErrorKind::*;
            let said = match io.kind() {
                ConnectionRefused => Some("connection refused"),
                ConnectionReset => Some("connection reset by the server"),
                ConnectionAborted => Some("connection aborted"),
                TimedOut => Some("connection timed out"),
                HostUnreachable => Some("no route to the host"),
                NetworkUnreachable => Some("the network is unreachable"),
                _ => None,
            };
            if let Some(said) = said {
                return ("unreachable", said.to_string());
            }
        }
        let text = e.to_string();
        dns |= text.contains("dns error");
        innermost = text;
        // An I/O error wrapping another error (TLS errors come as one inside another) says
        // where it came from through get_ref(): its source() skips the wrapped error.
        next = match io.and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    let innermost = printable(&innermost);
    if dns {
        ("unreachable", format!("DNS lookup failed: {innermost}"))
    } else {
        ("unreachable", innermost)
    }
}

/// A TLS failure, as the one line that tells what to fix.
fn tls_problem(error: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    match error {
        rustls::Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer => "TLS: unknown authority: the server's certificate is not signed by a CA the agent trusts for it".to_string(),
            C::Expired | C::ExpiredContext { .. } => "TLS: the server's certificate has expired".to_string(),
            C::NotValidYet | C::NotValidYetContext { .. } => "TLS: the server's certificate is not valid yet (is the clock right?)".to_string(),
            C::NotValidForName | C::NotValidForNameContext { .. } => "TLS: the server's certificate is not valid for this host name".to_string(),
            // A trusted CA of the same name, with another key: a serving CA rotated under
            // the same subject, as clusters do.
            C::BadSignature => "TLS: unknown authority: the server's certificate is not signed by a CA the agent trusts for it (one of the same name is trusted, with another key)".to_string(),
            other => format!("TLS: the server's certificate is not valid: {other:?}"),
        },
        rustls::Error::AlertReceived(alert) => {
            format!("TLS: the server refused the handshake ({alert:?}); is the client certificate one it accepts?")
        }
        other => format!("TLS: {other}"),
    }
}

/// Text from the API server or a proxy, made safe for one log line or a health page: control
/// characters and runs of whitespace become one space, and it is cut at 300 characters.
pub fn printable(text: &str) -> String {
    const MAX: usize = 300;
    let mut out = String::new();
    for word in text.split(|c: char| c.is_whitespace() || c.is_control()) {
        if word.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    match out.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &out[..cut]),
        None => out,
    }
}

/// The kind of failure an error answer is: `410 Gone`; a gateway with no API server behind
/// it (a 502, 503 or 504 that is not a Kubernetes Status and asks for no wait: a load
/// balancer whose backends are all down answers so, and it is the API server that cannot be
/// reached); or a failure the server answered, with the wait it asked for
/// (`retryAfterSeconds`, where the `Retry-After` header of an answer is put too:
/// [`crate::credentials::client`]).
pub(super) fn status_failure(status: &Status) -> Failure {
    if status.code == 410 {
        return Failure::Expired;
    }
    let retry_after = status
        .details
        .as_ref()
        .map(|details| details.retry_after_seconds)
        .filter(|seconds| *seconds > 0)
        .map(|seconds| Duration::from_secs(seconds.into()));
    let not_a_status = status.reason == "Failed to parse error data";
    if matches!(status.code, 502..=504) && not_a_status && retry_after.is_none() {
        return Failure::Unreachable;
    }
    Failure::Answered { retry_after }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;
    use std::sync::Arc;

    #[test]
    fn each_error_answer_is_the_kind_of_failure_that_says_how_long_to_wait() {
        let status = |code: u16, body: &str| -> Status {
            match serde_json::from_str::<Status>(body) {
                Ok(status) => status,
                Err(_) => Status::failure(body, "Failed to parse error data").with_code(code),
            }
        };
        let json = |code: u16, reason: &str, retry: u32| {
            format!(
                r#"{{"kind":"Status","status":"Failure","reason":"{reason}","code":{code},"details":{{"retryAfterSeconds":{retry}}}}}"#
            )
        };
        let seconds = |s| Some(Duration::from_secs(s));
        let cases = [
            (status(410, &json(410, "Expired", 0)), Failure::Expired),
            // A load balancer with no API server behind it.
            (
                status(502, "<html>502 Bad Gateway</html>"),
                Failure::Unreachable,
            ),
            (status(503, ""), Failure::Unreachable),
            (status(504, "upstream timed out"), Failure::Unreachable),
            // The API server itself, failing or shedding load.
            (
                status(503, &json(503, "ServiceUnavailable", 0)),
                Failure::ANSWERED,
            ),
            (
                status(500, &json(500, "InternalError", 0)),
                Failure::ANSWERED,
            ),
            (
                status(429, &json(429, "TooManyRequests", 7)),
                Failure::Answered {
                    retry_after: seconds(7),
                },
            ),
            (
                status(504, &json(504, "Timeout", 1)),
                Failure::Answered {
                    retry_after: seconds(1),
                },
            ),
            (status(403, &json(403, "Forbidden", 0)), Failure::ANSWERED),
            (status(500, "oops"), Failure::ANSWERED),
        ];
        for (status, kind) in cases {
            assert_eq!(status_failure(&status), kind, "{status:?}");
        }
        // A shedding server's plain-text 429, with the wait carried into its details.
        let mut shed = status(429, "Too many requests, please try again later.");
        shed.details = serde_json::from_str(r#"{"retryAfterSeconds":20}"#).ok();
        assert_eq!(
            status_failure(&shed),
            Failure::Answered {
                retry_after: seconds(20)
            }
        );
        shed.code = 503;
        assert_eq!(
            status_failure(&shed),
            Failure::Answered {
                retry_after: seconds(20)
            }
        );
    }

    #[test]
    fn text_from_a_proxy_becomes_one_short_printable_line() {
        let page = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n\x1b[31m</html>";
        assert_eq!(
            printable(page),
            "<html> <head><title>502 Bad Gateway</title></head> [31m</html>"
        );
        assert_eq!(printable(&"x".repeat(1000)).len(), 303);
    }

    /// An error and what caused it, as the layers of a client stack them.
    #[derive(Debug)]
    struct Layer(
        &'static str,
        Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    );

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|e| e as &(dyn std::error::Error + 'static))
        }
    }

    /// What the status line and the log say of a request that got no answer: each
    /// connection failure in the operator's words, a TLS failure found under the I/O error
    /// that carries it, a failed name lookup said as one even when the innermost error does
    /// not say "dns".
    #[test]
    fn a_request_without_an_answer_is_named_by_its_cause() {
        use std::io::{Error, ErrorKind};
        for (kind, said) in [
            (ErrorKind::ConnectionRefused, "connection refused"),
            (ErrorKind::ConnectionReset, "connection reset by the server"),
            (ErrorKind::ConnectionAborted, "connection aborted"),
            (ErrorKind::TimedOut, "connection timed out"),
            (ErrorKind::HostUnreachable, "no route to the host"),
            (ErrorKind::NetworkUnreachable, "the network is unreachable"),
        ] {
            let wrapped = Layer(
                "client error (Connect)",
                Some(Box::new(Error::new(kind, "os"))),
            );
            assert_eq!(
                transport_cause(&wrapped),
                ("unreachable", said.to_string()),
                "{kind:?}"
            );
            // A server that is not there: retried within 5 s, never backed off to 30.
            let failed = kube::Error::Service(Box::new(Layer(
                "client error (Connect)",
                Some(Box::new(Error::new(kind, "os"))),
            )));
            assert_eq!(failure_of(&failed), Failure::Unreachable, "{kind:?}");
        }
        // A TLS failure is an answer of a kind: backed off as one.
        let refused_tls = kube::Error::Service(Box::new(Error::other(
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        )));
        assert_eq!(failure_of(&refused_tls), Failure::ANSWERED);
        let tls = |e: rustls::Error| {
            let io = Error::other(e);
            transport_cause(&Layer("client error (Connect)", Some(Box::new(io))))
        };
        use rustls::CertificateError as C;
        assert_eq!(
            tls(rustls::Error::InvalidCertificate(C::UnknownIssuer)),
            ("tls", "TLS: unknown authority: the server's certificate is not signed by a CA the agent trusts for it".to_string())
        );
        assert!(
            tls(rustls::Error::InvalidCertificate(C::BadSignature))
                .1
                .contains("one of the same name is trusted, with another key")
        );
        assert_eq!(
            tls(rustls::Error::InvalidCertificate(C::Expired)).1,
            "TLS: the server's certificate has expired"
        );
        assert!(
            tls(rustls::Error::InvalidCertificate(C::NotValidYet))
                .1
                .contains("is the clock right?")
        );
        assert!(
            tls(rustls::Error::InvalidCertificate(C::NotValidForName))
                .1
                .contains("not valid for this host name")
        );
        assert!(
            tls(rustls::Error::AlertReceived(
                rustls::AlertDescription::BadCertificate
            ))
            .1
            .contains("is the client certificate one it accepts?")
        );
        // The lookup failure is said by an outer layer; the innermost only names the host.
        let dns = Layer(
            "client error (Connect)",
            Some(Box::new(Layer(
                "dns error: failed to lookup address information",
                Some(Box::new(Layer("Name or service not known", None))),
            ))),
        );
        assert_eq!(
            transport_cause(&dns),
            (
                "unreachable",
                "DNS lookup failed: Name or service not known".to_string()
            )
        );
        let other = Layer(
            "client error (SendRequest)",
            Some(Box::new(Layer(
                "connection closed before message completed",
                None,
            ))),
        );
        assert_eq!(
            transport_cause(&other),
            (
                "unreachable",
                "connection closed before message completed".to_string()
            )
        );
    }

    /// A 401 or a server certificate the trusted CAs do not sign sends the follower to read
    /// the credentials again; nothing else does.
    #[test]
    fn only_a_refusal_or_an_untrusted_server_proves_the_credentials_stale() {
        let problem = |reason| Problem::new(reason, "e".into(), Failure::ANSWERED);
        assert!(problem("unauthorized").proves_stale());
        assert!(problem("tls").proves_stale());
        assert!(!problem("forbidden").proves_stale());
        assert!(!problem("unreachable").proves_stale());
    }

    /// A TLS failure names the CA the server was checked against; a refusal while the client
    /// certificate in use has expired says so; other problems are left as they are.
    #[test]
    fn a_problem_the_credentials_explain_says_which_of_them() {
        let now = test_certs::now();
        let expired = test_certs::ca(Some("system:node:n1"), None, now - 7200, now - 60);
        let current = Current {
            ca_origin: Some("certificate-authority-data of cluster \"c\" in kubeconfig k".into()),
            client_certificate_origin: Some(
                "client-certificate /var/lib/kubelet/pki/kubelet-client-current.pem".into(),
            ),
            held: vec![crate::credentials::HeldCertificate {
                filepath: "k".into(),
                kind: "user",
                key: "u".into(),
                certificate: expired,
            }]
            .into(),
            ..Current::default()
        };
        let problem = |reason| Problem::new(reason, "https://h:6443: E".into(), Failure::ANSWERED);
        let said = |reason| problem(reason).with_credentials_hint(&current).text;
        assert_eq!(
            said("tls"),
            "https://h:6443: E (trusted for it: certificate-authority-data of cluster \"c\" in kubeconfig k)"
        );
        let refused = said("unauthorized");
        assert!(refused.contains("the client certificate in use, client-certificate /var/lib/kubelet/pki/kubelet-client-current.pem, expired at"), "{refused}");
        assert_eq!(said("forbidden"), "https://h:6443: E");
        let fresh = Current {
            held: Arc::from(Vec::new()),
            ..current.clone()
        };
        assert_eq!(
            problem("unauthorized").with_credentials_hint(&fresh).text,
            "https://h:6443: E"
        );
    }

    /// Each error answer gets its reason and names the server, and a body that is no
    /// Kubernetes Status is said to come from something between the agent and the API server.
    #[test]
    fn each_error_answer_has_its_reason_and_says_what_answered() {
        let status = |code: u16, reason: &str, message: &str| {
            kube::Error::Api(
                Status {
                    code,
                    reason: reason.into(),
                    message: message.into(),
                    ..Status::default()
                }
                .boxed(),
            )
        };
        let of = |e| Problem::of("https://h:6443", &e);
        for (code, reason) in [
            (401, "unauthorized"),
            (403, "forbidden"),
            (404, "not_found"),
            (410, "expired"),
            (500, "api_error"),
            (429, "api_error"),
        ] {
            assert_eq!(of(status(code, "R", "m")).reason, reason, "{code}");
        }
        assert_eq!(
            of(status(403, "Forbidden", "configmaps is forbidden")).text,
            "https://h:6443: HTTP 403 Forbidden: configmaps is forbidden"
        );
        assert_eq!(
            of(status(502, "Failed to parse error data", "")).text,
            "https://h:6443: HTTP 502 with an empty body, not a Kubernetes Status (a proxy or load balancer between here and the API server?)"
        );
        let html = of(status(
            502,
            "Failed to parse error data",
            "<html>Bad Gateway</html>",
        ))
        .text;
        assert!(
            html.starts_with(
                "https://h:6443: HTTP 502 with a body that is not a Kubernetes Status"
            ),
            "{html}"
        );
        assert!(html.ends_with("<html>Bad Gateway</html>"), "{html}");
        assert_eq!(
            of(status(502, "Failed to parse error data", "")).failure,
            Failure::Unreachable
        );
        // However long what answered, the problem is one bounded line.
        let page = format!("<html>{}</html>", "\n<p>error</p>".repeat(500));
        let long = of(status(500, "InternalError", &page)).text;
        assert!(
            long.chars().count() <= MAX_TEXT + 3 && !long.contains('\n'),
            "{long}"
        );
        let cut = Problem::new("api_error", "y".repeat(2 * MAX_TEXT), Failure::ANSWERED).text;
        assert_eq!(cut, format!("{}...", "y".repeat(MAX_TEXT)));
        let short = Problem::new("api_error", "y".repeat(MAX_TEXT), Failure::ANSWERED).text;
        assert_eq!(short, "y".repeat(MAX_TEXT));
        let said = Problem::new("tls", "https://h:6443: TLS: x".into(), Failure::ANSWERED);
        assert_eq!(said.to_string(), "https://h:6443: TLS: x");
    }

    #[test]
    fn a_request_never_answered_is_hung_and_says_for_how_long() {
        let hung = Problem::hung("https://h:6443", "watch", Duration::from_secs(25));
        assert_eq!(hung.failure, Failure::Hung);
        assert_eq!(hung.reason, "no_answer");
        assert!(hung.text.starts_with("https://h:6443: the API server took the watch request and sent no answer within 25s"), "{}", hung.text);
    }
}
