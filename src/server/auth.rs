//! Who is asking, and may they. Identities come from client certificates (checked locally
//! against the current client CA) or bearer tokens (a TokenReview, [`review`]); decisions
//! from the static allow-list (`--authorized-users`, `--authorized-groups`, checked locally
//! with no API call, so that scraping keeps working while the API server is down), else a
//! SubjectAccessReview, else any authenticated identity.
//!
//! As the API server's union authenticator does, a valid client certificate wins; a request
//! whose certificate proves nothing may still authenticate with a token.
//!
//! A review that could not be made judged nothing: the client gets 503 with when to try
//! again, never a 401 or a 403 that would blame its credentials.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode, header};

use super::breaker;
use super::identity::Identity;
use super::repeated::Repeated;
use super::review::{self, AccessVerdict, Failure, Shed, TokenVerdict};
use super::tls::{PeerChain, Tls};

/// How an authenticated identity is authorized for `/metrics`.
pub enum Authorization {
    /// `--authorized-users` / `--authorized-groups`: allowed when the user or one of its
    /// groups is listed.
    AllowList {
        users: BTreeSet<String>,
        groups: BTreeSet<String>,
    },
    /// `--authorization-webhook`, with no list given: a SubjectAccessReview.
    Webhook(review::Access),
    /// Neither: any authenticated identity (a warning is logged at start).
    AnyAuthenticated,
}

/// Whether the static allow-list admits `identity`: its user, or one of its groups, listed.
pub fn listed(users: &BTreeSet<String>, groups: &BTreeSet<String>, identity: &Identity) -> bool {
    users.contains(&identity.user) || identity.groups.iter().any(|g| groups.contains(g))
}

/// What stands between a client and `/metrics`.
pub struct Guard {
    /// `--insecure-metrics`: no authentication at all (loopback only).
    pub insecure: bool,
    /// The TLS configuration, whose current client CA authenticates certificates.
    pub tls: Option<Arc<Tls>>,
    /// `--authentication-token-webhook`: bearer tokens, reviewed.
    pub tokens: Option<review::Tokens>,
    pub authorization: Authorization,
    /// Reviews that cannot be made: logged when they start failing and when they work
    /// again, not once per request (a cached failure is answered many times).
    pub review_failures: Repeated,
}

/// A request turned away: the status, and why, in words safe to show the client.
#[derive(Debug)]
pub struct Refusal {
    pub code: StatusCode,
    pub why: String,
    /// Seconds for a `Retry-After` header, when the request was shed under load or a
    /// review could not be made.
    pub retry_after: Option<u64>,
}

fn refusal(code: StatusCode, why: impl Into<String>) -> Refusal {
    Refusal {
        code,
        why: why.into(),
        retry_after: None,
    }
}

/// A request turned away because the review it needs (of `what`: "the bearer token",
/// "whether ... may get ...") cannot start now.
fn shed(shed: Shed, what: &str) -> Refusal {
    let (code, why, retry_after) = match shed {
        Shed::Busy => (
            StatusCode::SERVICE_UNAVAILABLE,
            "too many reviews are in flight to the API server; try again".to_string(),
            1,
        ),
        Shed::RateLimited => (
            StatusCode::TOO_MANY_REQUESTS,
            "too many new reviews in a short time; try again".to_string(),
            1,
        ),
        Shed::Unreachable(after) => {
            let seconds = seconds(after);
            let why = format!(
                "{what} was not checked: {}; try again in {seconds}s",
                review::Reason::CircuitOpen.told()
            );
            (StatusCode::SERVICE_UNAVAILABLE, why, seconds)
        }
    };
    Refusal {
        code,
        why,
        retry_after: Some(retry_after),
    }
}

/// A request whose review (of `what`) could not be made: 503, since nothing was judged.
/// The client learns why in a few words; the detail (the API server's own) is logged.
fn not_checked(what: &str, failure: &Failure) -> Refusal {
    Refusal {
        code: StatusCode::SERVICE_UNAVAILABLE,
        why: format!(
            "{what} was not checked: {}; try again later",
            failure.reason.told()
        ),
        retry_after: Some(seconds(breaker::PAUSE)),
    }
}

/// Whole seconds for `Retry-After`: rounded up, at least 1.
fn seconds(after: Duration) -> u64 {
    let whole = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    whole.max(1)
}

impl Guard {
    /// Lets the request through to `path` (its identity, or None when insecure), or says
    /// why not: 401 for who, 403 for may not, 503 when the API server could not be asked
    /// who or whether it may (or 429 or 503 when the review was shed).
    pub async fn admit(
        &self,
        peer: &PeerChain,
        headers: &HeaderMap,
        path: &str,
    ) -> Result<Option<Identity>, Refusal> {
        if self.insecure {
            return Ok(None);
        }
        let identity = self.authenticate(peer, headers).await?;
        self.authorize(&identity, path).await?;
        Ok(Some(identity))
    }

    async fn authenticate(
        &self,
        peer: &PeerChain,
        headers: &HeaderMap,
    ) -> Result<Identity, Refusal> {
        let certificate = match (&self.tls, peer.is_empty()) {
            (_, true) => None,
            (Some(tls), false) => Some(peer.identify(tls)),
            (None, false) => Some(Err("client certificates are not checked here".to_string())),
        };
        let certificate_failed = match certificate {
            Some(Ok(identity)) => return Ok(identity),
            Some(Err(why)) => Some(why),
            None => None,
        };
        let token = bearer(headers);
        match (token, &self.tokens) {
            (Some(token), Some(tokens)) => match tokens.authenticate(token).await {
                Err(shedding) => {
                    if let Shed::Unreachable(_) = shedding {
                        self.review_failures
                            .failed("cannot check bearer tokens: the API server could not be reached moments ago");
                    }
                    Err(shed(shedding, "the bearer token"))
                }
                Ok(TokenVerdict::Authenticated(identity)) => {
                    self.review_failures.succeeded();
                    Ok(identity)
                }
                Ok(TokenVerdict::Rejected) => {
                    self.review_failures.succeeded();
                    Err(refusal(
                        StatusCode::UNAUTHORIZED,
                        "the bearer token was not accepted",
                    ))
                }
                Ok(TokenVerdict::Failed(failure)) => {
                    // The detail (the API server's words) goes to the log, once per spell
                    // of failures; the client learns only why in a few words.
                    self.review_failures
                        .failed(&format!("cannot check bearer tokens: {}", failure.detail));
                    Err(not_checked("the bearer token", &failure))
                }
            },
            (Some(_), None) if certificate_failed.is_none() => Err(refusal(
                StatusCode::UNAUTHORIZED,
                "bearer tokens are not accepted here (no --authentication-token-webhook); use a client certificate",
            )),
            _ => Err(refusal(
                StatusCode::UNAUTHORIZED,
                certificate_failed.unwrap_or_else(|| self.no_credentials()),
            )),
        }
    }

    /// Why a request without credentials is refused, with what would be accepted.
    fn no_credentials(&self) -> String {
        let certificates = self
            .tls
            .as_ref()
            .is_some_and(|tls| tls.client_ca().is_some());
        match (certificates, self.tokens.is_some()) {
            (true, true) => "no client certificate or bearer token".to_string(),
            (true, false) => "no client certificate".to_string(),
            (false, true) => "no bearer token".to_string(),
            (false, false) => "no client authentication is configured (serve TLS with --client-ca-file, accept tokens with --authentication-token-webhook, or use --insecure-metrics on a loopback address)".to_string(),
        }
    }

    async fn authorize(&self, identity: &Identity, path: &str) -> Result<(), Refusal> {
        let not_allowed = |reason: &str| {
            let mut why = format!(
                "user {:?} (groups {:?}) may not get {path}",
                identity.user, identity.groups
            );
            if !reason.is_empty() {
                why.push_str(": ");
                why.push_str(reason);
            }
            refusal(StatusCode::FORBIDDEN, why)
        };
        match &self.authorization {
            Authorization::AllowList { users, groups } if listed(users, groups, identity) => Ok(()),
            Authorization::AllowList { .. } => Err(not_allowed("")),
            Authorization::AnyAuthenticated => Ok(()),
            Authorization::Webhook(access) => match access.review(identity, path).await {
                Err(shedding) => {
                    if let Shed::Unreachable(_) = shedding {
                        self.review_failures
                            .failed("cannot authorize requests: the API server could not be reached moments ago");
                    }
                    Err(shed(shedding, &may(identity, path)))
                }
                Ok(AccessVerdict::Allowed) => {
                    self.review_failures.succeeded();
                    Ok(())
                }
                Ok(AccessVerdict::Denied(reason)) => {
                    self.review_failures.succeeded();
                    Err(not_allowed(&reason))
                }
                Ok(AccessVerdict::Failed(failure)) => {
                    self.review_failures
                        .failed(&format!("cannot authorize requests: {}", failure.detail));
                    Err(not_checked(&may(identity, path), &failure))
                }
            },
        }
    }
}

/// What a SubjectAccessReview asks, for the client: "whether user "U" may get PATH".
fn may(identity: &Identity, path: &str) -> String {
    format!("whether user {:?} may get {path}", identity.user)
}

/// The bearer token of an `Authorization: Bearer TOKEN` header, read as the API server
/// reads it (the scheme in any case, the token the next space-separated word).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let mut parts = value.splitn(3, ' ');
    let scheme = parts.next()?;
    let token = parts.next()?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(user: &str, groups: &[&str]) -> Identity {
        Identity {
            user: user.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            uid: None,
            extra: Default::default(),
        }
    }

    #[test]
    fn the_allow_list_admits_listed_users_and_members_of_listed_groups() {
        let users = ["system:serviceaccount:monitoring:prometheus-k8s".to_string()].into();
        let groups = ["system:monitoring".to_string()].into();
        let allows = |identity: &Identity| listed(&users, &groups, identity);
        assert!(allows(&identity(
            "system:serviceaccount:monitoring:prometheus-k8s",
            &[]
        )));
        assert!(allows(&identity(
            "scraper",
            &["other", "system:monitoring"]
        )));
        assert!(!allows(&identity("scraper", &["other"])));
        assert!(
            !allows(&identity("system:monitoring", &[])),
            "a user is not a group"
        );
    }

    #[test]
    fn a_review_that_could_not_be_made_is_a_503_that_says_why_in_a_few_words() {
        let failure = Failure {
            reason: review::Reason::Unreachable,
            detail: "https://10.0.0.1:6443: connection refused".into(),
        };
        let refusal = not_checked("the bearer token", &failure);
        assert_eq!(refusal.code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refusal.retry_after, Some(2));
        assert_eq!(
            refusal.why,
            "the bearer token was not checked: the API server could not be reached; try again later"
        );
        // Turned away by the breaker: when to try again, rounded up.
        let refusal = shed(
            Shed::Unreachable(Duration::from_millis(1500)),
            "whether user \"u\" may get /metrics",
        );
        assert_eq!(refusal.code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refusal.retry_after, Some(2));
        assert!(
            refusal
                .why
                .starts_with("whether user \"u\" may get /metrics was not checked"),
            "{}",
            refusal.why
        );
        assert_eq!(seconds(Duration::ZERO), 1);
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_secs(2)), 2);
    }

    #[test]
    fn a_bearer_token_is_read_as_the_api_server_reads_it() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            bearer(&headers).map(str::to_string)
        };
        assert_eq!(with("Bearer abc.def"), Some("abc.def".into()));
        assert_eq!(with("bearer abc"), Some("abc".into()));
        assert_eq!(with("  BEARER abc extra"), Some("abc".into()));
        assert_eq!(with("Bearer "), None);
        assert_eq!(with("Basic dXNlcjpwYXNz"), None);
        assert_eq!(with("Bearer"), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }
}
