//! Questions for the API server: who holds this bearer token (a TokenReview), and may this
//! identity get this path (a SubjectAccessReview). Each distinct question is asked once
//! however many requests ask it at the same time, and its answer is remembered for the
//! cache TTLs of the kubelet's flags; a rejection, or a review the API server answered with
//! an error, is remembered briefly too, so that a flood of requests cannot become a flood of
//! API calls. A review that found the API server unreachable or silent is not remembered:
//! the [`breaker`](super::breaker) turns new questions away at once meanwhile, and lets one
//! through every couple of seconds to find out when the server is back.
//!
//! Tokens are never kept: the cache knows a token by its SHA-256, and no token, nor any part
//! of one, reaches a log line, a metric or an answer.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec, SubjectAccessReviewStatus,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;

pub use super::breaker::REVIEW_DEADLINE;
use super::breaker::{Breaker, Heard, Ticket};
use super::identity::Identity;
use crate::credentials::Credentials;
use crate::metrics::{Metrics, ReviewLabels};
use crate::text::escape;

/// How long a rejected token, or a review the API server answered with an error (or that
/// could not be made for want of credentials), is remembered. A review that found the API
/// server unreachable or silent is not: the breaker answers for the server meanwhile.
pub const FAILED_REVIEW_TTL: Duration = Duration::from_secs(10);
/// What "remembered for good" means to the cache: far past any process's life.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// At most this many answers are remembered; past it, expired ones are dropped first.
const MAX_ANSWERS: usize = 4096;
/// At most this many reviews (of both kinds) are asked of the API server at once: each is a
/// request, on a connection of its own while the others are busy (kube-rs's client speaks
/// HTTP/1.1), so this bounds the agent's connections to the API server for reviews too.
pub const MAX_REVIEWS_IN_FLIGHT: usize = 8;
/// At start, how long a review waits for the agent's credentials to be read for the first
/// time: a failure for credentials not read yet would be remembered as the token's verdict
/// for [`FAILED_REVIEW_TTL`], refusing a valid token after they were.
const FIRST_READ_WAIT: Duration = Duration::from_secs(5);
/// New reviews start at most this often on average, with bursts of [`REVIEW_BURST`]: every
/// distinct bearer token is a new review, and anyone can make up tokens.
pub const REVIEWS_PER_SECOND: f64 = 20.0;
pub const REVIEW_BURST: f64 = 40.0;

/// Why a question was not asked: the agent sheds the load rather than queueing it. Never
/// remembered as the question's answer, so one client's flood never becomes another's
/// verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// [`MAX_REVIEWS_IN_FLIGHT`] reviews are under way (answered 503).
    Busy,
    /// More new reviews than [`REVIEWS_PER_SECOND`] allows (answered 429).
    RateLimited,
    /// A recent review found the API server unreachable or silent, and the breaker turns
    /// new questions away for a while (answered 503); the client may try again after this.
    Unreachable(Duration),
}

/// What every review must get through before it is asked: the breaker (the API server is
/// not known to be unreachable), a place among those in flight, and a token of the rate
/// limit. One for the endpoint, shared by both kinds of review (they ask one API server).
pub struct Limiter {
    breaker: Arc<Breaker>,
    in_flight: Arc<tokio::sync::Semaphore>,
    per_second: f64,
    burst: f64,
    /// Tokens left, as of when.
    bucket: Mutex<(f64, Instant)>,
}

impl Default for Limiter {
    fn default() -> Self {
        Limiter::new(MAX_REVIEWS_IN_FLIGHT, REVIEWS_PER_SECOND, REVIEW_BURST)
    }
}

impl Limiter {
    pub fn new(in_flight: usize, per_second: f64, burst: f64) -> Limiter {
        Limiter {
            breaker: Arc::default(),
            in_flight: Arc::new(tokio::sync::Semaphore::new(in_flight)),
            per_second,
            burst,
            bucket: Mutex::new((burst, Instant::now())),
        }
    }

    /// A place for one more review, or why not. The breaker is asked first, so that a
    /// question turned away for an unreachable server costs no token of the rate limit; a
    /// probe's ticket shed after all is dropped untold, and the next question probes.
    fn admit(&self) -> Result<Pass, Shed> {
        let ticket = self.breaker.admit().map_err(Shed::Unreachable)?;
        let permit = self
            .in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| Shed::Busy)?;
        let mut bucket = self.bucket.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let (tokens, last) = *bucket;
        let tokens =
            (tokens + now.duration_since(last).as_secs_f64() * self.per_second).min(self.burst);
        if tokens < 1.0 {
            *bucket = (tokens, now);
            return Err(Shed::RateLimited);
        }
        *bucket = (tokens - 1.0, now);
        Ok(Pass {
            _permit: permit,
            ticket,
        })
    }
}

/// Leave to ask one review: its place among those in flight, held until it is done, and the
/// breaker's ticket, told what the review heard of the API server.
struct Pass {
    _permit: tokio::sync::OwnedSemaphorePermit,
    ticket: Ticket,
}

impl Pass {
    fn done(self, heard: Heard) {
        self.ticket.tell(heard);
    }
}

/// An answer to a review, as the breaker reads it: did the API server answer?
pub trait Answer: Clone + Send + Sync + 'static {
    fn heard(&self) -> Heard;
}

/// Answers remembered for a while, with concurrent askers of one question sharing one
/// review: the first asker starts it as a task of its own (so that it completes, and is
/// remembered, even if that asker goes away), the others wait for its answer.
pub struct Answers<V> {
    slots: Mutex<HashMap<[u8; 32], Slot<V>>>,
}

enum Slot<V> {
    Known { answer: V, until: Instant },
    Asking(watch::Receiver<Option<V>>),
}

impl<V> Default for Answers<V> {
    fn default() -> Self {
        Answers {
            slots: Mutex::new(HashMap::new()),
        }
    }
}

impl<V: Answer> Answers<V> {
    /// The answer to the question `key`: remembered, or being asked, or asked now with
    /// `ask` if `limiter` lets one more review start, then remembered for `ttl(&answer)`
    /// (zero: not remembered).
    pub async fn get<F, Fut, T>(
        self: &Arc<Self>,
        limiter: &Limiter,
        key: [u8; 32],
        ask: F,
        ttl: T,
        lost: V,
    ) -> Result<V, Shed>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V> + Send + 'static,
        T: FnOnce(&V) -> Duration + Send + 'static,
    {
        let mut answer = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            match slots.get(&key) {
                Some(Slot::Known { answer, until }) if *until > now => return Ok(answer.clone()),
                Some(Slot::Asking(answer)) => answer.clone(),
                _ => {
                    let pass = limiter.admit()?;
                    if slots.len() >= MAX_ANSWERS {
                        forget_some(&mut slots, now);
                    }
                    let (tx, rx) = watch::channel(None);
                    slots.insert(key, Slot::Asking(rx.clone()));
                    let asking = ask();
                    let answers = self.clone();
                    tokio::spawn(async move {
                        let answer = asking.await;
                        pass.done(answer.heard());
                        let ttl = ttl(&answer);
                        {
                            let mut slots =
                                answers.slots.lock().unwrap_or_else(PoisonError::into_inner);
                            if ttl.is_zero() {
                                slots.remove(&key);
                            } else {
                                // A TTL of centuries is "for as long as the process runs".
                                let until = Instant::now()
                                    .checked_add(ttl)
                                    .unwrap_or_else(|| Instant::now() + FOREVER);
                                let known = Slot::Known {
                                    answer: answer.clone(),
                                    until,
                                };
                                slots.insert(key, known);
                            }
                        }
                        let _ = tx.send(Some(answer));
                    });
                    rx
                }
            }
        };
        let told = answer
            .wait_for(Option::is_some)
            .await
            .map(|told| told.clone());
        match told {
            Ok(told) => Ok(told.unwrap_or(lost)),
            Err(_) => {
                // The asking task died without an answer: let the next asker try again.
                let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
                if matches!(slots.get(&key), Some(Slot::Asking(rx)) if rx.same_channel(&answer)) {
                    slots.remove(&key);
                }
                Ok(lost)
            }
        }
    }

    /// How many answers are remembered or being asked.
    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Makes room: drops expired answers, and if that is not enough, every remembered one
/// (questions being asked stay: their askers are waiting).
fn forget_some<V>(slots: &mut HashMap<[u8; 32], Slot<V>>, now: Instant) {
    slots.retain(|_, slot| !matches!(slot, Slot::Known { until, .. } if *until <= now));
    if slots.len() >= MAX_ANSWERS {
        slots.retain(|_, slot| matches!(slot, Slot::Asking(_)));
    }
}

/// Why a review could not be made: the `reason` label of
/// `kubelet_ca_review_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The API server could not be reached: refused, reset, no route, a failed lookup.
    Unreachable,
    /// The TLS handshake with the API server failed (an unknown authority, most often).
    Tls,
    /// The API server did not answer within [`REVIEW_DEADLINE`] (hung), or the review was
    /// lost.
    NoAnswer,
    /// The API server did not accept the agent's own credentials (401).
    Unauthorized,
    /// The agent's own identity may not create the review (403: RBAC).
    Forbidden,
    /// Any other error status from the API server (or a proxy in front of it).
    ApiError,
    /// The agent has no usable credentials for the API server.
    Credentials,
    /// Not asked: a recent review found the API server unreachable or silent, and the
    /// breaker turns new questions away for a while.
    CircuitOpen,
}

impl Reason {
    pub const ALL: [Reason; 8] = [
        Reason::Unreachable,
        Reason::Tls,
        Reason::NoAnswer,
        Reason::Unauthorized,
        Reason::Forbidden,
        Reason::ApiError,
        Reason::Credentials,
        Reason::CircuitOpen,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Unreachable => "unreachable",
            Reason::Tls => "tls",
            Reason::NoAnswer => "no_answer",
            Reason::Unauthorized => "unauthorized",
            Reason::Forbidden => "forbidden",
            Reason::ApiError => "api_error",
            Reason::Credentials => "credentials",
            Reason::CircuitOpen => "circuit_open",
        }
    }

    /// What a review that failed so heard of the API server.
    pub fn heard(self) -> Heard {
        match self {
            Reason::Unreachable | Reason::Tls | Reason::NoAnswer => Heard::Unanswered,
            Reason::Unauthorized | Reason::Forbidden | Reason::ApiError => Heard::Answered,
            Reason::Credentials | Reason::CircuitOpen => Heard::Nothing,
        }
    }

    /// Why, in words for the client: no address, no API error text, no token.
    pub fn told(self) -> &'static str {
        match self {
            Reason::Unreachable => "the API server could not be reached",
            Reason::Tls => "the TLS handshake with the API server failed",
            Reason::NoAnswer => "the API server did not answer in time",
            Reason::Unauthorized | Reason::Forbidden => "the API server refused the agent's review",
            Reason::ApiError => "the API server answered the review with an error",
            Reason::Credentials => "the agent has no usable credentials for the API server",
            Reason::CircuitOpen => "the API server could not be reached moments ago",
        }
    }
}

/// A review that could not be made: why, and the detail for the log (one escaped line,
/// the API server's words included, never a token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub reason: Reason,
    pub detail: String,
}

impl Failure {
    /// How long the failure stands for the question's answer: not at all when the API
    /// server could not be reached or did not answer (the breaker turns questions away
    /// meanwhile, and a server that is back is asked again at once), else
    /// [`FAILED_REVIEW_TTL`].
    fn remembered_for(&self) -> Duration {
        match self.reason.heard() {
            Heard::Unanswered => Duration::ZERO,
            Heard::Answered | Heard::Nothing => FAILED_REVIEW_TTL,
        }
    }
}

/// What a TokenReview says of a bearer token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenVerdict {
    Authenticated(Identity),
    /// The API server does not accept the token (or not for our audiences).
    Rejected,
    /// The review could not be made (the API server unreachable, slow, or refusing us).
    Failed(Failure),
}

impl Answer for TokenVerdict {
    fn heard(&self) -> Heard {
        match self {
            TokenVerdict::Failed(failure) => failure.reason.heard(),
            TokenVerdict::Authenticated(_) | TokenVerdict::Rejected => Heard::Answered,
        }
    }
}

/// Counts the reviews of one kind (`token`, `access`) that could not be made.
#[derive(Clone)]
struct Errors {
    metrics: Arc<Metrics>,
    review: &'static str,
}

impl Errors {
    /// Every reason's series, at 0.
    fn new(metrics: Arc<Metrics>, review: &'static str) -> Errors {
        metrics.init_reviews(review);
        Errors { metrics, review }
    }

    fn count(&self, reason: Reason) {
        self.metrics
            .review_errors
            .get_or_create(&ReviewLabels {
                review: self.review.to_string(),
                reason: reason.as_str().to_string(),
            })
            .inc();
    }

    /// A review's failure, counted on its way.
    fn counted(&self, failure: Failure) -> Failure {
        self.count(failure.reason);
        failure
    }

    /// A question turned away by the breaker is counted too; a shed one is not (the
    /// client's load, not the API server's state).
    fn turned_away<V>(&self, asked: Result<V, Shed>) -> Result<V, Shed> {
        if let Err(Shed::Unreachable(_)) = asked {
            self.count(Reason::CircuitOpen);
        }
        asked
    }
}

/// Bearer tokens, checked with a TokenReview (`--authentication-token-webhook`).
pub struct Tokens {
    limiter: Arc<Limiter>,
    credentials: Credentials,
    audiences: Vec<String>,
    ttl: Duration,
    answers: Arc<Answers<TokenVerdict>>,
    errors: Errors,
}

impl Tokens {
    pub fn new(
        limiter: Arc<Limiter>,
        credentials: Credentials,
        audiences: Vec<String>,
        ttl: Duration,
        metrics: Arc<Metrics>,
    ) -> Tokens {
        Tokens {
            limiter,
            credentials,
            audiences,
            ttl,
            answers: Arc::default(),
            errors: Errors::new(metrics, "token"),
        }
    }

    pub async fn authenticate(&self, token: &str) -> Result<TokenVerdict, Shed> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let (credentials, audiences, token, errors) = (
            self.credentials.clone(),
            self.audiences.clone(),
            token.to_string(),
            self.errors.clone(),
        );
        let ttl = self.ttl;
        let ask = move || async move {
            // The newest client: the review follows the agent's credentials as they rotate.
            let client = match credentials.client_once_read(FIRST_READ_WAIT).await {
                Ok(client) => client,
                Err(why) => {
                    return TokenVerdict::Failed(errors.counted(Failure {
                        reason: Reason::Credentials,
                        detail: format!(
                            "the TokenReview cannot be made: no usable credentials for the API server: {why}"
                        ),
                    }));
                }
            };
            let review = TokenReview {
                spec: TokenReviewSpec {
                    token: Some(token),
                    audiences: (!audiences.is_empty()).then(|| audiences.clone()),
                },
                ..Default::default()
            };
            let api: Api<TokenReview> = Api::all(client);
            match ask_within(&credentials, api.create(&PostParams::default(), &review)).await {
                Ok(answer) => token_verdict(answer.status.unwrap_or_default(), &audiences),
                Err(failure) => TokenVerdict::Failed(errors.counted(Failure {
                    detail: format!("the TokenReview failed: {}", failure.detail),
                    ..failure
                })),
            }
        };
        let remember = move |verdict: &TokenVerdict| match verdict {
            TokenVerdict::Authenticated(_) => ttl,
            TokenVerdict::Rejected => FAILED_REVIEW_TTL,
            TokenVerdict::Failed(failure) => failure.remembered_for(),
        };
        let asked = self
            .answers
            .get(&self.limiter, key, ask, remember, lost("TokenReview"))
            .await;
        self.errors.turned_away(asked)
    }
}

fn lost<V: From<Lost>>(what: &str) -> V {
    V::from(Lost(what.to_string()))
}

/// The task asking a review ended without an answer.
pub struct Lost(String);

impl Lost {
    fn failure(self) -> Failure {
        Failure {
            reason: Reason::NoAnswer,
            detail: format!("the {} was lost", self.0),
        }
    }
}

impl From<Lost> for TokenVerdict {
    fn from(lost: Lost) -> Self {
        TokenVerdict::Failed(lost.failure())
    }
}

impl From<Lost> for AccessVerdict {
    fn from(lost: Lost) -> Self {
        AccessVerdict::Failed(lost.failure())
    }
}

/// What a TokenReview's status means for us, as the API server's webhook token
/// authenticator reads it: authenticated, with a user name, and, when we asked for
/// audiences, meant for at least one of them.
pub fn token_verdict(status: TokenReviewStatus, audiences: &[String]) -> TokenVerdict {
    if status.authenticated != Some(true) {
        return TokenVerdict::Rejected;
    }
    if !audiences.is_empty() {
        let granted = status.audiences.unwrap_or_default();
        if !granted.iter().any(|a| audiences.contains(a)) {
            return TokenVerdict::Rejected;
        }
    }
    let user = status.user.unwrap_or_default();
    match user.username.filter(|u| !u.is_empty()) {
        Some(name) => TokenVerdict::Authenticated(Identity {
            user: name,
            groups: user.groups.unwrap_or_default(),
            uid: user.uid.filter(|u| !u.is_empty()),
            extra: user.extra.unwrap_or_default(),
        }),
        None => TokenVerdict::Rejected,
    }
}

/// What a SubjectAccessReview says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessVerdict {
    Allowed,
    /// Not allowed, with the authorizer's reason when it gave one.
    Denied(String),
    /// The review could not be made.
    Failed(Failure),
}

impl Answer for AccessVerdict {
    fn heard(&self) -> Heard {
        match self {
            AccessVerdict::Failed(failure) => failure.reason.heard(),
            AccessVerdict::Allowed | AccessVerdict::Denied(_) => Heard::Answered,
        }
    }
}

/// `--authorization-webhook`: may this identity `get` this path?
pub struct Access {
    limiter: Arc<Limiter>,
    credentials: Credentials,
    answers: Arc<Answers<AccessVerdict>>,
    allowed_ttl: Duration,
    denied_ttl: Duration,
    errors: Errors,
}

impl Access {
    pub fn new(
        limiter: Arc<Limiter>,
        credentials: Credentials,
        allowed_ttl: Duration,
        denied_ttl: Duration,
        metrics: Arc<Metrics>,
    ) -> Access {
        Access {
            limiter,
            credentials,
            answers: Arc::default(),
            allowed_ttl,
            denied_ttl,
            errors: Errors::new(metrics, "access"),
        }
    }

    pub async fn review(&self, identity: &Identity, path: &str) -> Result<AccessVerdict, Shed> {
        let spec = SubjectAccessReviewSpec {
            user: Some(identity.user.clone()),
            groups: Some(identity.groups.clone()),
            uid: identity.uid.clone(),
            extra: (!identity.extra.is_empty()).then(|| identity.extra.clone()),
            non_resource_attributes: Some(NonResourceAttributes {
                path: Some(path.to_string()),
                verb: Some("get".to_string()),
            }),
            resource_attributes: None,
        };
        // The question is the whole spec: the same identity asking the same path.
        let key: [u8; 32] = Sha256::digest(
            serde_json::to_vec(&spec).expect("a SubjectAccessReviewSpec serializes"),
        )
        .into();
        let (credentials, errors) = (self.credentials.clone(), self.errors.clone());
        let ask = move || async move {
            let client = match credentials.client_once_read(FIRST_READ_WAIT).await {
                Ok(client) => client,
                Err(why) => {
                    return AccessVerdict::Failed(errors.counted(Failure {
                        reason: Reason::Credentials,
                        detail: format!(
                            "the SubjectAccessReview cannot be made: no usable credentials for the API server: {why}"
                        ),
                    }));
                }
            };
            let review = SubjectAccessReview {
                spec,
                ..Default::default()
            };
            let api: Api<SubjectAccessReview> = Api::all(client);
            match ask_within(&credentials, api.create(&PostParams::default(), &review)).await {
                Ok(answer) => access_verdict(answer.status.unwrap_or_default()),
                Err(failure) => AccessVerdict::Failed(errors.counted(Failure {
                    detail: format!("the SubjectAccessReview failed: {}", failure.detail),
                    ..failure
                })),
            }
        };
        let (allowed_ttl, denied_ttl) = (self.allowed_ttl, self.denied_ttl);
        let remember = move |verdict: &AccessVerdict| match verdict {
            AccessVerdict::Allowed => allowed_ttl,
            AccessVerdict::Denied(_) => denied_ttl,
            AccessVerdict::Failed(failure) => failure.remembered_for(),
        };
        let asked = self
            .answers
            .get(
                &self.limiter,
                key,
                ask,
                remember,
                lost("SubjectAccessReview"),
            )
            .await;
        self.errors.turned_away(asked)
    }
}

/// A SubjectAccessReview's status, read as the API server's webhook authorizer reads it:
/// allowed only when `allowed` is true and `denied` is not.
pub fn access_verdict(status: SubjectAccessReviewStatus) -> AccessVerdict {
    if status.allowed && status.denied != Some(true) {
        return AccessVerdict::Allowed;
    }
    let reason = status
        .reason
        .filter(|r| !r.is_empty())
        .or(status.evaluation_error.filter(|e| !e.is_empty()))
        .unwrap_or_default();
    AccessVerdict::Denied(reason)
}

/// `call`, within [`REVIEW_DEADLINE`], or why it could not be made (its detail one escaped
/// line). A 401, or a server certificate that the trusted CAs do not sign, has the
/// credentials read again: the next review uses the new ones.
async fn ask_within<T>(
    credentials: &Credentials,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, Failure> {
    let failure = |reason, detail: &str| Failure {
        reason,
        detail: escape(detail).into_owned(),
    };
    match tokio::time::timeout(REVIEW_DEADLINE, call).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(kube::Error::Api(status))) => {
            let reason = match status.code {
                401 => Reason::Unauthorized,
                403 => Reason::Forbidden,
                _ => Reason::ApiError,
            };
            if reason == Reason::Unauthorized {
                credentials.stale();
            }
            let detail = format!("HTTP {} {}: {}", status.code, status.reason, status.message);
            Err(failure(reason, &detail))
        }
        Ok(Err(e)) => {
            let (reason, cause) = crate::follow::problem::transport_cause(&e);
            let reason = if reason == "tls" {
                credentials.stale();
                Reason::Tls
            } else {
                Reason::Unreachable
            };
            let server = credentials.current().server.clone().unwrap_or_default();
            Err(failure(reason, &format!("{server}: {cause}")))
        }
        Err(_) => Err(failure(
            Reason::NoAnswer,
            &format!(
                "the API server did not answer within {}s",
                REVIEW_DEADLINE.as_secs()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use k8s_openapi::api::authentication::v1::UserInfo;

    use super::*;
    use crate::server::breaker::{self, Circuit};

    /// Answers in these tests are words; "unreachable" is a review that found no server.
    impl Answer for String {
        fn heard(&self) -> Heard {
            match self.as_str() {
                "unreachable" => Heard::Unanswered,
                _ => Heard::Answered,
            }
        }
    }

    /// A limiter that never sheds: these tests are about the answers.
    fn unlimited() -> Limiter {
        Limiter::new(1 << 20, 1e9, 1e9)
    }

    fn counted(
        asked: &Arc<AtomicUsize>,
        answer: &'static str,
    ) -> impl FnOnce() -> std::pin::Pin<Box<dyn Future<Output = String> + Send>> {
        let asked = asked.clone();
        move || {
            Box::pin(async move {
                asked.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                answer.to_string()
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_askers_of_one_question_share_one_review() {
        let answers = Arc::new(Answers::<String>::default());
        let asked = Arc::new(AtomicUsize::new(0));
        let askers: Vec<_> = (0..50)
            .map(|_| {
                let (answers, asked) = (answers.clone(), asked.clone());
                tokio::spawn(async move {
                    answers
                        .get(
                            &unlimited(),
                            [1; 32],
                            counted(&asked, "yes"),
                            |_| Duration::from_secs(60),
                            "lost".into(),
                        )
                        .await
                        .unwrap()
                })
            })
            .collect();
        for asker in askers {
            assert_eq!(asker.await.unwrap(), "yes");
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1, "one review for 50 askers");
        // Another question is asked on its own.
        let other = answers
            .get(
                &unlimited(),
                [2; 32],
                counted(&asked, "no"),
                |_| Duration::ZERO,
                "lost".into(),
            )
            .await
            .unwrap();
        assert_eq!(other, "no");
        assert_eq!(asked.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_is_remembered_for_its_ttl_then_asked_again() {
        let answers = Arc::new(Answers::<String>::default());
        let asked = Arc::new(AtomicUsize::new(0));
        let ttl = |answer: &String| {
            if answer == "yes" {
                Duration::from_secs(120)
            } else {
                Duration::from_secs(10)
            }
        };
        let ask = |answer| {
            let (answers, asked) = (answers.clone(), asked.clone());
            async move {
                answers
                    .get(
                        &unlimited(),
                        [7; 32],
                        counted(&asked, answer),
                        ttl,
                        "lost".into(),
                    )
                    .await
                    .unwrap()
            }
        };
        assert_eq!(ask("yes").await, "yes");
        tokio::time::sleep(Duration::from_secs(119)).await;
        assert_eq!(ask("no").await, "yes", "still remembered");
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(ask("no").await, "no", "asked again after the TTL");
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        // A "no" is remembered for its own, shorter TTL.
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(ask("yes").await, "no");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(ask("yes").await, "yes");
        assert_eq!(asked.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_ttl_remembers_nothing_and_an_asker_that_leaves_does_not_lose_the_answer() {
        let answers = Arc::new(Answers::<String>::default());
        let asked = Arc::new(AtomicUsize::new(0));
        // The first asker gives up at once: the review still completes and is remembered.
        let limiter = unlimited();
        let first = answers.get(
            &limiter,
            [3; 32],
            counted(&asked, "yes"),
            |_| Duration::from_secs(60),
            "lost".into(),
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(1), first)
                .await
                .is_err()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let again = answers
            .get(
                &unlimited(),
                [3; 32],
                counted(&asked, "no"),
                |_| Duration::ZERO,
                "lost".into(),
            )
            .await
            .unwrap();
        assert_eq!(again, "yes");
        assert_eq!(asked.load(Ordering::SeqCst), 1);

        for _ in 0..3 {
            answers
                .get(
                    &unlimited(),
                    [4; 32],
                    counted(&asked, "x"),
                    |_| Duration::ZERO,
                    "lost".into(),
                )
                .await
                .unwrap();
        }
        assert_eq!(
            asked.load(Ordering::SeqCst),
            4,
            "nothing remembered at TTL 0"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn reviews_in_flight_are_bounded_and_what_is_shed_is_not_remembered() {
        let answers = Arc::new(Answers::<String>::default());
        let limiter = Arc::new(Limiter::new(2, 1000.0, 1000.0));
        let asked = Arc::new(AtomicUsize::new(0));
        // Two slow reviews take both places.
        let slow = |key: u8| {
            let (answers, limiter, asked) = (answers.clone(), limiter.clone(), asked.clone());
            tokio::spawn(async move {
                answers
                    .get(
                        &limiter,
                        [key; 32],
                        move || async move {
                            asked.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_secs(5)).await;
                            "slow".to_string()
                        },
                        |_| Duration::from_secs(60),
                        "lost".into(),
                    )
                    .await
            })
        };
        let (a, b) = (slow(1), slow(2));
        tokio::task::yield_now().await;
        let third = answers
            .get(
                &limiter,
                [3; 32],
                counted(&asked, "x"),
                |_| Duration::from_secs(60),
                "lost".into(),
            )
            .await;
        assert_eq!(third, Err(Shed::Busy));
        // A question already being asked still waits for its answer: no new review.
        let again = answers
            .get(
                &limiter,
                [1; 32],
                counted(&asked, "x"),
                |_| Duration::from_secs(60),
                "lost".into(),
            )
            .await;
        assert_eq!(again, Ok("slow".to_string()));
        assert_eq!(a.await.unwrap(), Ok("slow".to_string()));
        assert_eq!(b.await.unwrap(), Ok("slow".to_string()));
        // The places are free again, and the shed question was not remembered.
        let third = answers
            .get(
                &limiter,
                [3; 32],
                counted(&asked, "x"),
                |_| Duration::from_secs(60),
                "lost".into(),
            )
            .await;
        assert_eq!(third, Ok("x".to_string()));
        assert_eq!(asked.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn new_reviews_beyond_the_rate_are_shed_until_it_allows_more() {
        let answers = Arc::new(Answers::<String>::default());
        let limiter = Limiter::new(100, 1.0, 3.0);
        let asked = Arc::new(AtomicUsize::new(0));
        let mut verdicts = Vec::new();
        for key in 0..5u8 {
            verdicts.push(
                answers
                    .get(
                        &limiter,
                        [key; 32],
                        counted(&asked, "x"),
                        |_| Duration::ZERO,
                        "lost".into(),
                    )
                    .await,
            );
        }
        // The burst of 3 passed (1/s refills a twentieth during each 50 ms review); not the rest.
        assert_eq!(
            &verdicts[..3],
            &[Ok("x".to_string()), Ok("x".into()), Ok("x".into())]
        );
        assert_eq!(
            &verdicts[3..],
            &[Err(Shed::RateLimited), Err(Shed::RateLimited)]
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        let later = answers
            .get(
                &limiter,
                [9; 32],
                counted(&asked, "y"),
                |_| Duration::ZERO,
                "lost".into(),
            )
            .await;
        assert_eq!(later, Ok("y".to_string()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_distinct_questions_is_bounded() {
        let answers = Arc::new(Answers::<String>::default());
        let asked = Arc::new(AtomicUsize::new(0));
        for i in 0..(MAX_ANSWERS + 100) {
            let mut key = [0; 32];
            key[..8].copy_from_slice(&(i as u64).to_le_bytes());
            answers
                .get(
                    &unlimited(),
                    key,
                    counted(&asked, "no"),
                    |_| FAILED_REVIEW_TTL,
                    "lost".into(),
                )
                .await
                .unwrap();
        }
        assert!(
            answers.remembered() <= MAX_ANSWERS,
            "{} remembered",
            answers.remembered()
        );
    }

    /// The failure TTL of the reviews that found no server (zero) in an `Answers::get`.
    fn unless_unreachable(answer: &String) -> Duration {
        if answer == "unreachable" {
            Duration::ZERO
        } else {
            FAILED_REVIEW_TTL
        }
    }

    #[tokio::test(start_paused = true)]
    async fn once_a_review_finds_no_server_new_questions_fail_at_once_until_a_probe_finds_it() {
        let answers = Arc::new(Answers::<String>::default());
        let limiter = unlimited();
        let asked = Arc::new(AtomicUsize::new(0));
        let ask = |key: u8, answer: &'static str| {
            answers.get(
                &limiter,
                [key; 32],
                counted(&asked, answer),
                unless_unreachable,
                "lost".into(),
            )
        };
        assert_eq!(ask(1, "unreachable").await, Ok("unreachable".to_string()));
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        // Other questions, and the same one (its failure is not remembered), are turned
        // away at once, with when to try again, and nothing is asked.
        let started = Instant::now();
        for key in [2, 3, 1] {
            assert!(matches!(
                ask(key, "yes").await,
                Err(Shed::Unreachable(after)) if after <= breaker::PAUSE
            ));
        }
        assert_eq!(started.elapsed(), Duration::ZERO, "no wait");
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        assert_eq!(answers.remembered(), 0, "nothing remembered of the failure");
        // After the pause, one question probes: the server is back, and the next question
        // is asked as usual.
        tokio::time::sleep(breaker::PAUSE).await;
        assert_eq!(ask(1, "yes").await, Ok("yes".to_string()));
        assert_eq!(limiter.breaker.circuit(), Circuit::Closed);
        assert_eq!(ask(2, "no").await, Ok("no".to_string()));
        assert_eq!(asked.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_finds_no_server_opens_it_again_and_a_shed_probe_leaves_its_turn() {
        let answers = Arc::new(Answers::<String>::default());
        // Two new reviews at once, then one every 5 s.
        let limiter = Limiter::new(8, 0.2, 2.0);
        let asked = Arc::new(AtomicUsize::new(0));
        let ask = |key: u8, answer: &'static str| {
            answers.get(
                &limiter,
                [key; 32],
                counted(&asked, answer),
                unless_unreachable,
                "lost".into(),
            )
        };
        assert!(ask(1, "unreachable").await.is_ok());
        tokio::time::sleep(breaker::PAUSE).await;
        // The probe finds no server either: turned away again for a pause.
        assert!(ask(2, "unreachable").await.is_ok());
        assert!(matches!(ask(3, "yes").await, Err(Shed::Unreachable(_))));
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        tokio::time::sleep(breaker::PAUSE).await;
        // The next probe is shed by the rate limit (429 as ever); it does not keep the
        // probe's turn: the question after it may probe too (and is shed the same way,
        // not turned away by the breaker).
        assert_eq!(ask(3, "yes").await, Err(Shed::RateLimited));
        assert_eq!(ask(4, "yes").await, Err(Shed::RateLimited));
        tokio::time::sleep(breaker::PAUSE).await;
        assert_eq!(ask(4, "yes").await, Ok("yes".to_string()));
        assert_eq!(limiter.breaker.circuit(), Circuit::Closed);
        assert_eq!(asked.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_failure_is_remembered_unless_the_server_was_not_there_and_every_reason_is_counted() {
        let failure = |reason| Failure {
            reason,
            detail: String::new(),
        };
        for reason in Reason::ALL {
            let expected = match reason {
                Reason::Unreachable | Reason::Tls | Reason::NoAnswer => Duration::ZERO,
                _ => FAILED_REVIEW_TTL,
            };
            assert_eq!(failure(reason).remembered_for(), expected, "{reason:?}");
        }
        let names: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names, crate::metrics::known::REVIEW_ERRORS);
        assert_eq!(Reason::Forbidden.heard(), Heard::Answered);
        assert_eq!(Reason::Credentials.heard(), Heard::Nothing);
    }

    fn status(authenticated: bool, user: &str, audiences: &[&str]) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(authenticated),
            audiences: Some(audiences.iter().map(|a| a.to_string()).collect()),
            user: Some(UserInfo {
                username: Some(user.into()),
                groups: Some(vec!["system:serviceaccounts".into()]),
                uid: Some("1234".into()),
                extra: None,
            }),
            error: None,
        }
    }

    #[test]
    fn a_token_review_is_read_as_the_api_server_reads_it() {
        let accepted = token_verdict(status(true, "system:serviceaccount:m:p", &["api"]), &[]);
        assert_eq!(
            accepted,
            TokenVerdict::Authenticated(Identity {
                user: "system:serviceaccount:m:p".into(),
                groups: vec!["system:serviceaccounts".into()],
                uid: Some("1234".into()),
                extra: Default::default(),
            })
        );
        assert_eq!(
            token_verdict(status(false, "someone", &[]), &[]),
            TokenVerdict::Rejected
        );
        assert_eq!(
            token_verdict(TokenReviewStatus::default(), &[]),
            TokenVerdict::Rejected
        );
        assert_eq!(
            token_verdict(status(true, "", &[]), &[]),
            TokenVerdict::Rejected,
            "no user name, no identity"
        );
        let wanted = ["metrics".to_string()];
        assert!(matches!(
            token_verdict(status(true, "u", &["api", "metrics"]), &wanted),
            TokenVerdict::Authenticated(_)
        ));
        assert_eq!(
            token_verdict(status(true, "u", &["api"]), &wanted),
            TokenVerdict::Rejected,
            "a token for another audience"
        );
    }

    #[test]
    fn an_access_review_allows_only_when_allowed_and_not_denied() {
        let status = |allowed, denied, reason: &str| SubjectAccessReviewStatus {
            allowed,
            denied,
            reason: Some(reason.into()),
            evaluation_error: None,
        };
        assert_eq!(
            access_verdict(status(true, None, "RBAC: allowed")),
            AccessVerdict::Allowed
        );
        assert_eq!(
            access_verdict(status(true, Some(true), "conflict")),
            AccessVerdict::Denied("conflict".into())
        );
        assert_eq!(
            access_verdict(status(false, None, "")),
            AccessVerdict::Denied(String::new())
        );
        assert_eq!(
            access_verdict(status(false, Some(true), "denied by policy")),
            AccessVerdict::Denied("denied by policy".into())
        );
    }
}
