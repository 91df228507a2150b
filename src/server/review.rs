//! Questions for the API server: who holds this bearer token (a TokenReview), and may this
//! identity get this path (a SubjectAccessReview). Each distinct question is asked once
//! however many requests ask it at the same time, and its answer is remembered for the
//! cache TTLs of the kubelet's flags; a rejection or a failed review is remembered briefly
//! too, so that a flood of requests cannot become a flood of API calls.
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

use super::auth::Identity;
use crate::credentials::Credentials;
use crate::text::escape;

/// How long a rejected token, or a review that could not be made, is remembered.
pub const FAILED_REVIEW_TTL: Duration = Duration::from_secs(10);
/// A review not answered within this has failed (the kube client sets no read timeout of
/// its own, and a scraper gives up after about 10 s anyway).
pub const REVIEW_DEADLINE: Duration = Duration::from_secs(10);
/// What "remembered for good" means to the cache: far past any process's life.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// At most this many answers are remembered; past it, expired ones are dropped first.
const MAX_ANSWERS: usize = 4096;

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

impl<V: Clone + Send + Sync + 'static> Answers<V> {
    /// The answer to the question `key`: remembered, or being asked, or asked now with
    /// `ask`, then remembered for `ttl(&answer)` (zero: not remembered).
    pub async fn get<F, Fut, T>(self: &Arc<Self>, key: [u8; 32], ask: F, ttl: T, lost: V) -> V
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V> + Send + 'static,
        T: FnOnce(&V) -> Duration + Send + 'static,
    {
        let mut answer = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            match slots.get(&key) {
                Some(Slot::Known { answer, until }) if *until > now => return answer.clone(),
                Some(Slot::Asking(answer)) => answer.clone(),
                _ => {
                    if slots.len() >= MAX_ANSWERS {
                        forget_some(&mut slots, now);
                    }
                    let (tx, rx) = watch::channel(None);
                    slots.insert(key, Slot::Asking(rx.clone()));
                    let asking = ask();
                    let answers = self.clone();
                    tokio::spawn(async move {
                        let answer = asking.await;
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
            Ok(told) => told.unwrap_or(lost),
            Err(_) => {
                // The asking task died without an answer: let the next asker try again.
                let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
                if matches!(slots.get(&key), Some(Slot::Asking(rx)) if rx.same_channel(&answer)) {
                    slots.remove(&key);
                }
                lost
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

/// What a TokenReview says of a bearer token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenVerdict {
    Authenticated(Identity),
    /// The API server does not accept the token (or not for our audiences).
    Rejected,
    /// The review could not be made (the API server unreachable, slow, or refusing us).
    Failed(String),
}

/// Bearer tokens, checked with a TokenReview (`--authentication-token-webhook`).
pub struct Tokens {
    credentials: Credentials,
    audiences: Vec<String>,
    ttl: Duration,
    answers: Arc<Answers<TokenVerdict>>,
}

impl Tokens {
    pub fn new(credentials: Credentials, audiences: Vec<String>, ttl: Duration) -> Tokens {
        Tokens {
            credentials,
            audiences,
            ttl,
            answers: Arc::default(),
        }
    }

    pub async fn authenticate(&self, token: &str) -> TokenVerdict {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let (credentials, audiences, token) = (
            self.credentials.clone(),
            self.audiences.clone(),
            token.to_string(),
        );
        let ttl = self.ttl;
        let ask = move || async move {
            // The newest client: the review follows the agent's credentials as they rotate.
            let client = match credentials.client() {
                Ok(client) => client,
                Err(why) => {
                    return TokenVerdict::Failed(format!(
                        "the TokenReview cannot be made: no usable credentials for the API server: {why}"
                    ));
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
                Err(why) => TokenVerdict::Failed(format!("the TokenReview failed: {why}")),
            }
        };
        let remember = move |verdict: &TokenVerdict| match verdict {
            TokenVerdict::Authenticated(_) => ttl,
            TokenVerdict::Rejected | TokenVerdict::Failed(_) => FAILED_REVIEW_TTL,
        };
        self.answers
            .get(key, ask, remember, lost("TokenReview"))
            .await
    }
}

fn lost<V: From<Lost>>(what: &str) -> V {
    V::from(Lost(what.to_string()))
}

/// The task asking a review ended without an answer.
pub struct Lost(String);

impl From<Lost> for TokenVerdict {
    fn from(Lost(what): Lost) -> Self {
        TokenVerdict::Failed(format!("the {what} was lost"))
    }
}

impl From<Lost> for AccessVerdict {
    fn from(Lost(what): Lost) -> Self {
        AccessVerdict::Failed(format!("the {what} was lost"))
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
    Failed(String),
}

/// `--authorization-webhook`: may this identity `get` this path?
pub struct Access {
    credentials: Credentials,
    answers: Arc<Answers<AccessVerdict>>,
    allowed_ttl: Duration,
    denied_ttl: Duration,
}

impl Access {
    pub fn new(credentials: Credentials, allowed_ttl: Duration, denied_ttl: Duration) -> Access {
        Access {
            credentials,
            answers: Arc::default(),
            allowed_ttl,
            denied_ttl,
        }
    }

    pub async fn review(&self, identity: &Identity, path: &str) -> AccessVerdict {
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
        let credentials = self.credentials.clone();
        let ask = move || async move {
            let client = match credentials.client() {
                Ok(client) => client,
                Err(why) => {
                    return AccessVerdict::Failed(format!(
                        "the SubjectAccessReview cannot be made: no usable credentials for the API server: {why}"
                    ));
                }
            };
            let review = SubjectAccessReview {
                spec,
                ..Default::default()
            };
            let api: Api<SubjectAccessReview> = Api::all(client);
            match ask_within(&credentials, api.create(&PostParams::default(), &review)).await {
                Ok(answer) => access_verdict(answer.status.unwrap_or_default()),
                Err(why) => AccessVerdict::Failed(format!("the SubjectAccessReview failed: {why}")),
            }
        };
        let (allowed_ttl, denied_ttl) = (self.allowed_ttl, self.denied_ttl);
        let remember = move |verdict: &AccessVerdict| match verdict {
            AccessVerdict::Allowed => allowed_ttl,
            AccessVerdict::Denied(_) => denied_ttl,
            AccessVerdict::Failed(_) => FAILED_REVIEW_TTL,
        };
        self.answers
            .get(key, ask, remember, lost("SubjectAccessReview"))
            .await
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

/// A review call, given up after [`REVIEW_DEADLINE`]; its error as one escaped line.
/// `call`, within [`REVIEW_DEADLINE`]. A 401, or a server certificate that the trusted CAs
/// do not sign, has the credentials read again: the next review uses the new ones.
async fn ask_within<T>(
    credentials: &Credentials,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(REVIEW_DEADLINE, call).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(kube::Error::Api(status))) => {
            if status.code == 401 {
                credentials.stale();
            }
            Err(escape(&format!(
                "HTTP {} {}: {}",
                status.code, status.reason, status.message
            ))
            .into_owned())
        }
        Ok(Err(e)) => {
            let (reason, cause) = crate::source::cluster::transport_cause(&e);
            if reason == "tls" {
                credentials.stale();
            }
            let server = credentials.current().server.clone().unwrap_or_default();
            Err(escape(&format!("{server}: {cause}")).into_owned())
        }
        Err(_) => Err(format!(
            "the API server did not answer within {}s",
            REVIEW_DEADLINE.as_secs()
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use k8s_openapi::api::authentication::v1::UserInfo;

    use super::*;

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
                            [1; 32],
                            counted(&asked, "yes"),
                            |_| Duration::from_secs(60),
                            "lost".into(),
                        )
                        .await
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
                [2; 32],
                counted(&asked, "no"),
                |_| Duration::ZERO,
                "lost".into(),
            )
            .await;
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
                    .get([7; 32], counted(&asked, answer), ttl, "lost".into())
                    .await
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
        let first = answers.get(
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
                [3; 32],
                counted(&asked, "no"),
                |_| Duration::ZERO,
                "lost".into(),
            )
            .await;
        assert_eq!(again, "yes");
        assert_eq!(asked.load(Ordering::SeqCst), 1);

        for _ in 0..3 {
            answers
                .get(
                    [4; 32],
                    counted(&asked, "x"),
                    |_| Duration::ZERO,
                    "lost".into(),
                )
                .await;
        }
        assert_eq!(
            asked.load(Ordering::SeqCst),
            4,
            "nothing remembered at TTL 0"
        );
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
                    key,
                    counted(&asked, "no"),
                    |_| FAILED_REVIEW_TTL,
                    "lost".into(),
                )
                .await;
        }
        assert!(
            answers.remembered() <= MAX_ANSWERS,
            "{} remembered",
            answers.remembered()
        );
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
