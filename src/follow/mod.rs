//! The follower: every watch of the binary, in one loop (the sources of `run`, `sync`'s
//! publishing and `publish`, the Nodes of `rollout` and `publish`, and the node's own Node).
//!
//! ```text
//!   the caller (one small file a watch)          the follower (this module)
//!   ------------------------------------         -----------------------------------------
//!   what to list and watch  (Followed::list,     lists (every page), opens and reads the
//!     ::watch, ::selection)                        watch, with a deadline on each request
//!   what a list or an event does to its state    and a silence limit on an open watch;
//!     (::listed, ::changed)                      what to do next: lifecycle::Watch (pure);
//!   what "up" and "down" mean to it              failures told apart and said once:
//!     (::up, ::down)                               problem::Problem (bounded text);
//!                                                the credentials: the newest client for
//!                                                  every request, an open watch resumed
//!                                                  on a new one at once, a backoff ended by
//!                                                  one, a 401 or TLS failure makes them be
//!                                                  read again (credentials::Credentials)
//! ```
//!
//! The loop is written here rather than taken from kube-runtime's `watcher` because the
//! watcher hides what tells a live watch from a dead one: it swallows bookmarks and the
//! clean end of a watch, and waits without limit on a request the server took and never
//! answered. Here every request has a deadline ([`REQUEST_DEADLINE`]) and an open watch that
//! stays silent (no event, no bookmark, no end) for [`WATCH_SILENCE`] is taken for dead.
//! What it does next is always what [`lifecycle::Watch::step`] decides: this loop only
//! carries it out and tells the caller.

pub mod lifecycle;
pub mod problem;

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::Client;
use kube::api::{ListParams, ObjectList, WatchEvent, WatchParams};

use crate::credentials::Credentials;
use lifecycle::{Action, Failure, Happened, Report, Watch};
pub use problem::Problem;

/// How long a request (a list page, or the start of a watch) may go unanswered before the
/// API server counts as not answering. kube-apiserver answers a request it cannot finish
/// within its own 60 s limit with a 504, so this only trips on a server (or a proxy) that
/// took the request and went silent.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(25);

/// How long an open watch may stay silent (no event, no bookmark, no end) before it is taken
/// for dead. kube-apiserver sends a bookmark about once a minute (the cacher's bookmark
/// frequency) once the resourceVersion has moved past the watch's start, and ends every watch
/// at its `timeoutSeconds` ([`WATCH_TIMEOUT_SECONDS`], shorter than this) whatever happens, so
/// a server that says nothing for this long is hung, or the connection to it is dead.
pub const WATCH_SILENCE: Duration = Duration::from_secs(120);

/// The `timeoutSeconds` of each watch. Under [`WATCH_SILENCE`] so that a watch on a quiet
/// resource, which gets no bookmark (the server sends none until the resourceVersion moves
/// past the one the watch started from), still ends, and is resumed, before it could be
/// taken for dead. Resuming costs one watch request served from the watch cache; never a list.
pub const WATCH_TIMEOUT_SECONDS: u32 = 100;

/// Items per page of a list: a thousand-node fleet in two requests, none of them large.
pub const PAGE: u32 = 500;

/// An open watch's items.
pub type Events<K> = BoxStream<'static, kube::Result<WatchEvent<K>>>;

/// What a watch selects: a field selector (`metadata.name=NAME` for one object), a label
/// selector, both or neither.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    pub fields: Option<String>,
    pub labels: Option<String>,
}

impl Selection {
    /// The one object named `name`: the same request, and so the same RBAC (by
    /// resourceNames), for the list and the watch.
    pub fn named(name: &str) -> Selection {
        Selection {
            fields: Some(format!("metadata.name={name}")),
            labels: None,
        }
    }

    /// The list's parameters: pages of [`PAGE`].
    pub fn list_params(&self) -> ListParams {
        let mut params = ListParams::default().limit(PAGE);
        if let Some(fields) = &self.fields {
            params = params.fields(fields);
        }
        if let Some(labels) = &self.labels {
            params = params.labels(labels);
        }
        params
    }

    /// The watch's parameters: bookmarks (on by default), and [`WATCH_TIMEOUT_SECONDS`].
    pub fn watch_params(&self) -> WatchParams {
        let mut params = WatchParams::default().timeout(WATCH_TIMEOUT_SECONDS);
        if let Some(fields) = &self.fields {
            params = params.fields(fields);
        }
        if let Some(labels) = &self.labels {
            params = params.labels(labels);
        }
        params
    }
}

/// A change that the open watch delivered.
#[derive(Debug, Clone, PartialEq)]
pub enum Change<K> {
    /// Added or modified: the item as it is now.
    Applied(K),
    /// Deleted: the item as it was last.
    Deleted(K),
}

/// What a list found, beside its items.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Listed {
    /// The store went back since the watch last stood on it (restored from a backup): its
    /// resourceVersion is behind what the watch had reached.
    pub went_back: bool,
    /// The list's resourceVersion, when it is a number (etcd's revision): the items are
    /// the store as of it.
    pub rv: Option<u64>,
}

/// A caller's part of one watch: what to list and watch, what a list or an event does to
/// its state, and what being up or down means to it. Everything else is the follower's.
pub trait Followed: Send {
    /// An item as listed and watched (a whole object, or its metadata).
    type K: kube::Resource + Clone + serde::de::DeserializeOwned + Debug + Send + 'static;

    /// How the follower's log lines name what it follows (`the Nodes`, `source
    /// configmap:ns/name`).
    fn name(&self) -> &str;

    /// What the list and the watch select.
    fn selection(&self) -> Selection;

    /// One page of the list.
    fn list(
        &self,
        client: Client,
        params: ListParams,
    ) -> impl Future<Output = kube::Result<ObjectList<Self::K>>> + Send;

    /// A watch from `rv`.
    fn watch(
        &self,
        client: Client,
        params: WatchParams,
        rv: String,
    ) -> impl Future<Output = kube::Result<Events<Self::K>>> + Send;

    /// A list answered: `items` (every page) are what is there now, arrived at `at`.
    fn listed(&mut self, items: Vec<Self::K>, listed: Listed, at: Instant);

    /// The open watch delivered a change, arrived at `at`.
    fn changed(&mut self, change: Change<Self::K>, at: Instant);

    /// It is up again after it was down (a watch established, no list between): what it
    /// last had still stands.
    fn up(&mut self, at: Instant);

    /// It failed (`problem` says why; reason `credentials` when there are no usable ones):
    /// what it last had stands, and the follower tries again as the lifecycle says.
    fn down(&mut self, problem: &Problem, at: Instant);
}

/// Follows what `followed` selects for as long as the task runs, on the newest client of
/// `credentials`: lists, then watches resumed from the last resourceVersion, each step as
/// [`lifecycle::Watch`] decides, telling `followed` what happens.
///
/// When the credentials change, an open watch is resumed at once on the new client from the
/// resourceVersion it had reached (no list), and a backoff ends; until there are any usable
/// credentials, `followed` is down with why. A 401, or a server certificate the trusted CAs
/// do not sign, makes the credentials be read again at once, for every watch.
pub async fn follow<F: Followed>(mut credentials: Credentials, mut followed: F) {
    let selection = followed.selection();
    let list_params = selection.list_params();
    let watch_params = selection.watch_params();
    let (mut watch, mut action) = Watch::start();
    // The open watch, and the generation of the credentials whose client opened it.
    let mut open: Option<(Events<F::K>, u64)> = None;
    // When the open watch was last heard from, and when it was opened.
    let mut heard = tokio::time::Instant::now();
    let mut opened = heard;
    // The generation of the client that made the last request: a newer one ends a wait.
    let mut used: u64 = 0;
    loop {
        // The newest client, for the next request.
        let creds = credentials.mark_seen();
        let Some(client) = creds.client.clone() else {
            if creds.read {
                let why = Problem::new("credentials", creds.why_none(), Failure::ANSWERED);
                followed.down(&why, Instant::now());
                watch.lost();
            }
            credentials.changed().await;
            continue;
        };
        let server = creds.server.as_deref().unwrap_or("the API server");
        // What went wrong this turn, for the report; what a list brought, to tell after
        // the step (which says whether the store went back); whether `followed` was told
        // something new this turn.
        let mut trouble: Option<Problem> = None;
        let mut listed: Option<(Vec<F::K>, Instant, Option<u64>)> = None;
        let mut told = false;
        let happened = match &action {
            Action::List => {
                used = creds.generation;
                let page = |params| followed.list(client.clone(), params);
                match list_pages(server, &list_params, page).await {
                    Ok((items, Some(rv))) => {
                        listed = Some((items, Instant::now(), rv.parse().ok()));
                        Happened::Listed { rv }
                    }
                    Ok((_, None)) => {
                        trouble = Some(Problem::new(
                            "api_error",
                            format!(
                                "{server}: the list came without a resourceVersion to watch from"
                            ),
                            Failure::ANSWERED,
                        ));
                        Happened::Failed(Failure::ANSWERED)
                    }
                    Err(problem) => {
                        let failure = problem.failure;
                        trouble = Some(problem);
                        Happened::Failed(failure)
                    }
                }
            }
            Action::Watch { rv } => {
                used = creds.generation;
                let request = followed.watch(client, watch_params.clone(), rv.clone());
                match within(server, "watch", request).await {
                    Ok(events) => {
                        open = Some((events, creds.generation));
                        heard = tokio::time::Instant::now();
                        opened = heard;
                        Happened::Opened
                    }
                    Err(problem) => {
                        let failure = problem.failure;
                        trouble = Some(problem);
                        Happened::Failed(failure)
                    }
                }
            }
            Action::Read { confirm_at } => match open.as_mut() {
                // Nothing open to read (cannot happen): as if it had ended.
                None => Happened::Ended,
                // Credentials newer than the watch's: the watch is resumed with them. Told
                // by `changed` below, or seen at the top of this turn when they came while an
                // event was being handled.
                Some((_, generation)) if *generation != creds.generation => {
                    Happened::NewCredentials
                }
                Some((events, generation)) => {
                    used = *generation;
                    let heard_now = tokio::select! {
                        next = tokio::time::timeout_at(heard + WATCH_SILENCE, events.next()) => Heard::Next(next),
                        () = sleep_until_some(*confirm_at) => Heard::Quiet,
                        () = credentials.changed() => Heard::Credentials,
                    };
                    match heard_now {
                        Heard::Quiet => Happened::StayedOpen,
                        // The top of the loop decides: a new client (a new generation)
                        // resumes the watch; a problem with the credentials on disk leaves
                        // the client, and the watch, as they are (the last good credentials
                        // are kept).
                        Heard::Credentials => continue,
                        Heard::Next(next) => {
                            let arrived = Instant::now();
                            heard = tokio::time::Instant::now();
                            let read = item(next, server, watch.rv());
                            trouble = read.problem;
                            if let Some(change) = read.change {
                                followed.changed(change, arrived);
                                told = true;
                            }
                            match read.happened {
                                Happened::Ended => Happened::end(
                                    heard - opened,
                                    Duration::from_secs(WATCH_TIMEOUT_SECONDS.into()),
                                ),
                                happened => happened,
                            }
                        }
                    }
                }
            },
            Action::Wait { until } => {
                // A client newer than the one that failed ends the wait: new credentials
                // are likely what the failure was waiting for, and those that came while
                // the failed request was under way count too.
                if creds.generation != used
                    || credentials.newer_before(creds.generation, *until).await
                {
                    Happened::NewCredentials
                } else {
                    Happened::Waited
                }
            }
        };
        if happened == Happened::Failed(Failure::Expired) {
            tracing::info!(
                watch = followed.name(),
                "the API server no longer has the watch's resourceVersion for {} (410 Gone, as after a restart): listing again",
                followed.name()
            );
        }
        let step = watch.step(happened, tokio::time::Instant::now(), lifecycle::jitter());
        if let Some(back) = &step.went_back {
            tracing::warn!(
                watch = followed.name(),
                from = %back.from,
                to = %back.to,
                "the API server's store went back: its resourceVersion is now {} where the watch of {} had reached {} (a store restored from a backup?); following what it holds now",
                back.to,
                followed.name(),
                back.from,
            );
        }
        if let Some((items, at, rv)) = listed {
            let listed = Listed {
                went_back: step.went_back.is_some(),
                rv,
            };
            followed.listed(items, listed, at);
            told = true;
        }
        match step.report {
            Report::Down => {
                let problem = trouble.unwrap_or_else(|| {
                    Problem::new(
                        "api_error",
                        format!("{server}: the watch failed"),
                        Failure::ANSWERED,
                    )
                });
                if problem.proves_stale() {
                    credentials.stale();
                }
                let problem = problem.with_credentials_hint(&creds);
                followed.down(&problem, Instant::now());
            }
            Report::Up if !told => followed.up(Instant::now()),
            Report::Up | Report::Nothing => {}
        }
        if !matches!(step.action, Action::Read { .. }) {
            open = None;
        }
        action = step.action;
    }
}

/// One page of the metadata of cluster-scoped `K` (Nodes), for a [`Followed::list`].
pub async fn list_metadata<K>(
    client: Client,
    params: ListParams,
) -> kube::Result<ObjectList<kube::api::PartialObjectMeta<K>>>
where
    K: kube::Resource<Scope = kube::core::ClusterResourceScope> + Clone + Debug,
    K: serde::de::DeserializeOwned,
    K::DynamicType: Default,
{
    kube::Api::<K>::all(client).list_metadata(&params).await
}

/// A watch of the metadata of cluster-scoped `K` (Nodes) from `rv`, for a
/// [`Followed::watch`].
pub async fn watch_metadata<K>(
    client: Client,
    params: WatchParams,
    rv: String,
) -> kube::Result<Events<kube::api::PartialObjectMeta<K>>>
where
    K: kube::Resource<Scope = kube::core::ClusterResourceScope> + Clone + Debug + Send,
    K: serde::de::DeserializeOwned + 'static,
    K::DynamicType: Default,
{
    let api = kube::Api::<K>::all(client);
    api.watch_metadata(&params, &rv).await.map(StreamExt::boxed)
}

/// Every page of a list, each asked of `server` with `page`: its items and the
/// resourceVersion to watch from (`None` when the answer had none).
pub async fn list_pages<K, A>(
    server: &str,
    params: &ListParams,
    page: impl Fn(ListParams) -> A,
) -> Result<(Vec<K>, Option<String>), Problem>
where
    K: Clone,
    A: Future<Output = kube::Result<ObjectList<K>>>,
{
    let mut params = params.clone();
    let mut items = Vec::new();
    loop {
        let answer = within(server, "list", page(params.clone())).await?;
        items.extend(answer.items);
        match answer.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => {
                let rv = answer.metadata.resource_version.filter(|rv| !rv.is_empty());
                return Ok((items, rv));
            }
        }
    }
}

/// `request` to `server`, unless it takes longer than [`REQUEST_DEADLINE`].
pub async fn within<T>(
    server: &str,
    what: &str,
    request: impl Future<Output = kube::Result<T>>,
) -> Result<T, Problem> {
    match tokio::time::timeout(REQUEST_DEADLINE, request).await {
        Ok(answer) => answer.map_err(|e| Problem::of(server, &e)),
        Err(_) => Err(Problem::hung(server, what, REQUEST_DEADLINE)),
    }
}

/// What an item of an open watch means, for the lifecycle and the caller.
#[derive(Debug)]
struct Item<K> {
    happened: Happened,
    /// What went wrong, for the report.
    problem: Option<Problem>,
    /// The change it brought, if any.
    change: Option<Change<K>>,
}

/// What `next` (the next item of an open watch, or its silence for [`WATCH_SILENCE`])
/// means; `rv` is where the watch stands, for an event whose object names no
/// resourceVersion. Pure: the loop's effects are left to it.
fn item<K: kube::Resource>(
    next: Result<Option<kube::Result<WatchEvent<K>>>, tokio::time::error::Elapsed>,
    server: &str,
    rv: Option<&str>,
) -> Item<K> {
    let at_rv = |k: &K| {
        k.meta()
            .resource_version
            .clone()
            .or_else(|| rv.map(str::to_string))
            .unwrap_or_default()
    };
    let delivered = |rv: String, change| Item {
        happened: Happened::Delivered { rv },
        problem: None,
        change,
    };
    let failed = |problem: Problem| Item {
        happened: Happened::Failed(problem.failure),
        problem: Some(problem),
        change: None,
    };
    match next {
        Ok(Some(Ok(WatchEvent::Added(k) | WatchEvent::Modified(k)))) => {
            delivered(at_rv(&k), Some(Change::Applied(k)))
        }
        Ok(Some(Ok(WatchEvent::Deleted(k)))) => delivered(at_rv(&k), Some(Change::Deleted(k))),
        Ok(Some(Ok(WatchEvent::Bookmark(bookmark)))) => {
            delivered(bookmark.metadata.resource_version, None)
        }
        // The server ended the watch (its timeout, or a connection that closed between
        // events: the loop tells them apart by how long it was open). Said only if the
        // lifecycle takes it for a failure: when it came before the watch was established,
        // again.
        Ok(None) => Item {
            happened: Happened::Ended,
            problem: Some(Problem::new(
                "watch_ended",
                format!(
                    "{server}: the watch ended as soon as it was opened (a proxy that cuts streams?)"
                ),
                Failure::ANSWERED,
            )),
            change: None,
        },
        Ok(Some(Ok(WatchEvent::Error(status)))) => {
            failed(Problem::of(server, &kube::Error::Api(status)))
        }
        Ok(Some(Err(error))) => failed(Problem::of(server, &error)),
        Err(_silent) => failed(Problem::new(
            "watch_silent",
            format!(
                "{server}: the watch sent nothing for {}s (no event, no bookmark, no end at its {WATCH_TIMEOUT_SECONDS}s timeout): the API server or the connection to it is hung; listing again",
                WATCH_SILENCE.as_secs()
            ),
            Failure::Hung,
        )),
    }
}

/// Sleeps until `at`; forever when there is no instant.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What the open watch told, or what ended the wait for it.
enum Heard<T> {
    /// An item of the stream, its end, or its silence for [`WATCH_SILENCE`].
    Next(T),
    /// It stayed open without an error until it counts as established.
    Quiet,
    /// The credentials changed.
    Credentials,
}

#[cfg(test)]
mod tests;
