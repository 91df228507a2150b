//! The follower's pure parts: what each item of a watch tells the lifecycle and the caller,
//! and what a watch asks for.

use super::*;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use serde_json::json;

/// The silence of a watch, as `timeout_at` reports it.
async fn silence() -> tokio::time::error::Elapsed {
    tokio::time::timeout(Duration::ZERO, std::future::pending::<()>())
        .await
        .unwrap_err()
}

fn configmap_at(rv: Option<&str>) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("cm".into());
    cm.metadata.resource_version = rv.map(str::to_string);
    cm
}

#[tokio::test]
async fn each_item_of_a_watch_is_what_it_tells_the_lifecycle_and_the_caller() {
    let read = |next| item::<ConfigMap>(next, "https://api:6443", Some("5"));
    // A change brings the object and its resourceVersion; one without a resourceVersion
    // keeps the watch's.
    let added = read(Ok(Some(Ok(WatchEvent::Added(configmap_at(Some("7")))))));
    assert_eq!(added.happened, Happened::Delivered { rv: "7".into() });
    assert_eq!(added.change, Some(Change::Applied(configmap_at(Some("7")))));
    assert!(added.problem.is_none());
    let modified = read(Ok(Some(Ok(WatchEvent::Modified(configmap_at(None))))));
    assert_eq!(modified.happened, Happened::Delivered { rv: "5".into() });
    assert_eq!(modified.change, Some(Change::Applied(configmap_at(None))));
    let deleted = read(Ok(Some(Ok(WatchEvent::Deleted(configmap_at(Some("9")))))));
    assert_eq!(deleted.happened, Happened::Delivered { rv: "9".into() });
    assert_eq!(
        deleted.change,
        Some(Change::Deleted(configmap_at(Some("9"))))
    );
    // A bookmark moves the watch on and brings no change.
    let bookmark: WatchEvent<ConfigMap> = serde_json::from_value(json!({
        "type": "BOOKMARK",
        "object": {"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"resourceVersion": "12"}}
    }))
    .unwrap();
    let marked = read(Ok(Some(Ok(bookmark))));
    assert_eq!(marked.happened, Happened::Delivered { rv: "12".into() });
    assert!(marked.change.is_none() && marked.problem.is_none());
    // The end, with what to say should it be a failure.
    let ended = read(Ok(None));
    assert_eq!(ended.happened, Happened::Ended);
    assert_eq!(ended.problem.unwrap().reason, "watch_ended");
    // An ERROR event: its Status says which failure.
    let expired: WatchEvent<ConfigMap> = serde_json::from_value(json!({
        "type": "ERROR",
        "object": {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410, "message": "too old resource version: 5 (40)"}
    }))
    .unwrap();
    let gone = read(Ok(Some(Ok(expired))));
    assert_eq!(gone.happened, Happened::Failed(Failure::Expired));
    assert_eq!(gone.problem.unwrap().reason, "expired");
    let shed: WatchEvent<ConfigMap> = serde_json::from_value(json!({
        "type": "ERROR",
        "object": {"kind": "Status", "status": "Failure", "reason": "TooManyRequests", "code": 429, "details": {"retryAfterSeconds": 3}}
    }))
    .unwrap();
    assert_eq!(
        read(Ok(Some(Ok(shed)))).happened,
        Happened::Failed(Failure::Answered {
            retry_after: Some(Duration::from_secs(3))
        })
    );
    // Silence: the server took the watch and went quiet. The lifecycle lists again after
    // it (the connection is as good as lost), and the text says so.
    let silent = read(Err(silence().await));
    assert_eq!(silent.happened, Happened::Failed(Failure::Hung));
    let why = silent.problem.unwrap();
    assert_eq!(why.reason, "watch_silent");
    assert!(why.text.contains("https://api:6443"), "{why}");
    assert!(why.text.ends_with("listing again"), "{why}");
    assert!(!why.text.contains("watching again"), "{why}");
    assert!(Failure::Hung.loses_connection());
}

#[test]
fn a_watch_selects_what_its_caller_names_and_pages_its_list() {
    let one = Selection::named("kube-apiserver-client-ca");
    let list = one.list_params();
    assert_eq!(
        list.field_selector.as_deref(),
        Some("metadata.name=kube-apiserver-client-ca")
    );
    assert_eq!(list.label_selector, None);
    assert_eq!(list.limit, Some(PAGE));
    let watch = one.watch_params();
    assert_eq!(
        watch.field_selector.as_deref(),
        Some("metadata.name=kube-apiserver-client-ca")
    );
    assert_eq!(watch.timeout, Some(WATCH_TIMEOUT_SECONDS));
    assert!(watch.bookmarks);
    let pool = Selection {
        fields: None,
        labels: Some("pool=a".into()),
    };
    assert_eq!(pool.list_params().label_selector.as_deref(), Some("pool=a"));
    assert_eq!(pool.list_params().field_selector, None);
    assert_eq!(
        pool.watch_params().label_selector.as_deref(),
        Some("pool=a")
    );
    assert_eq!(pool.watch_params().field_selector, None);
    assert!(WATCH_TIMEOUT_SECONDS < WATCH_SILENCE.as_secs() as u32);
}

// ---- The loop, against a fake API server behind a real kube::Client ----------------------

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use tokio::sync::{mpsc, oneshot};

use crate::credentials::{Credentials, Current};

type Answer = http::Response<BoxBody<Bytes, std::convert::Infallible>>;

/// A request the follower made, for the test to answer.
struct Asked {
    /// `list`, or `watch from RV`.
    what: String,
    /// Which client asked: the generation of the credentials it was built for.
    client: u64,
    answer: oneshot::Sender<Answer>,
}

/// A kube client whose every request comes to the test as an [`Asked`], tagged `client`.
fn fake_client(client: u64, asked: mpsc::UnboundedSender<Asked>) -> kube::Client {
    let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
        let asked = asked.clone();
        async move {
            let query = request.uri().query().unwrap_or_default().to_string();
            let what = if query.contains("watch=true") {
                let rv = query
                    .split('&')
                    .find_map(|p| p.strip_prefix("resourceVersion="))
                    .unwrap_or_default();
                format!("watch from {rv}")
            } else {
                match query.split('&').find_map(|p| p.strip_prefix("continue=")) {
                    Some(token) => format!("list continue={token}"),
                    None => "list".to_string(),
                }
            };
            let (answer, answered) = oneshot::channel();
            let _ = asked.send(Asked {
                what,
                client,
                answer,
            });
            Ok::<_, std::convert::Infallible>(answered.await.unwrap_or_else(|_| status(503)))
        }
    });
    kube::Client::new(service, "default")
}

fn body(json: serde_json::Value) -> Answer {
    http::Response::new(Full::new(Bytes::from(json.to_string())).boxed())
}

fn listed(rv: &str, names: &[&str]) -> Answer {
    let items: Vec<_> = names
        .iter()
        .map(|n| json!({"metadata": {"name": n, "namespace": "ns", "resourceVersion": rv}}))
        .collect();
    body(
        json!({"kind": "ConfigMapList", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": items}),
    )
}

fn status(code: u16) -> Answer {
    let mut answer = body(json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": format!("HTTP {code}"), "reason": "Test", "code": code
    }));
    *answer.status_mut() = http::StatusCode::from_u16(code).unwrap();
    answer
}

/// An open watch: its answer, and where the test writes its events.
fn open_watch() -> (Answer, futures::channel::mpsc::UnboundedSender<String>) {
    let (tx, rx) = futures::channel::mpsc::unbounded::<String>();
    let frames = rx.map(|line| Ok(Frame::data(Bytes::from(line + "\n"))));
    (
        http::Response::new(BodyExt::boxed(StreamBody::new(frames))),
        tx,
    )
}

fn added(name: &str, rv: &str) -> String {
    json!({"type": "ADDED", "object": {"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv}}})
        .to_string()
}

/// What the follower told its caller, in order.
#[derive(Clone, Default)]
struct Told(Arc<Mutex<Vec<String>>>);

impl Told {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A caller that records what it is told, for ConfigMaps in `ns`.
struct Recorder(Told);

impl Followed for Recorder {
    type K = ConfigMap;

    fn name(&self) -> &str {
        "the recorder's ConfigMaps"
    }

    fn selection(&self) -> Selection {
        Selection::named("cm")
    }

    async fn list(
        &self,
        client: Client,
        params: ListParams,
    ) -> kube::Result<ObjectList<ConfigMap>> {
        kube::Api::<ConfigMap>::namespaced(client, "ns")
            .list(&params)
            .await
    }

    async fn watch(
        &self,
        client: Client,
        params: WatchParams,
        rv: String,
    ) -> kube::Result<Events<ConfigMap>> {
        let api = kube::Api::<ConfigMap>::namespaced(client, "ns");
        api.watch(&params, &rv).await.map(StreamExt::boxed)
    }

    fn listed(&mut self, items: Vec<ConfigMap>, listed: Listed, _: Instant) {
        let names: Vec<String> = items
            .iter()
            .filter_map(|i| i.metadata.name.clone())
            .collect();
        let back = if listed.went_back { " (went back)" } else { "" };
        let rv = listed.rv.map(|rv| format!(" at {rv}")).unwrap_or_default();
        self.0
            .0
            .lock()
            .unwrap()
            .push(format!("listed {}{rv}{back}", names.join(",")));
    }

    fn changed(&mut self, change: Change<ConfigMap>, _: Instant) {
        let said = match change {
            Change::Applied(k) => format!("applied {}", k.metadata.name.unwrap_or_default()),
            Change::Deleted(k) => format!("deleted {}", k.metadata.name.unwrap_or_default()),
        };
        self.0.0.lock().unwrap().push(said);
    }

    fn up(&mut self, _: Instant) {
        self.0.0.lock().unwrap().push("up".into());
    }

    fn down(&mut self, problem: &Problem, _: Instant) {
        self.0
            .0
            .lock()
            .unwrap()
            .push(format!("down {}", problem.reason));
    }
}

/// A follower on credentials whose client is generation `1`, the requests it makes, what it
/// tells, and the credentials' sender (to change them) and stale notify.
struct Harness {
    asked: mpsc::UnboundedReceiver<Asked>,
    asked_tx: mpsc::UnboundedSender<Asked>,
    told: Told,
    credentials: tokio::sync::watch::Sender<Arc<Current>>,
    stale: Arc<tokio::sync::Notify>,
}

impl Harness {
    fn start() -> Harness {
        let (asked_tx, asked) = mpsc::unbounded_channel();
        let current = |generation| Current {
            client: Some(fake_client(generation, asked_tx.clone())),
            generation,
            read: true,
            server: Some("https://api:6443".into()),
            ..Current::default()
        };
        let (creds, credentials, stale) = Credentials::set_by_test(current(1));
        let told = Told::default();
        tokio::spawn(follow(creds, Recorder(told.clone())));
        Harness {
            asked,
            asked_tx,
            told,
            credentials,
            stale,
        }
    }

    /// New credentials: a client of `generation`.
    fn new_credentials(&self, generation: u64) {
        let client = fake_client(generation, self.asked_tx.clone());
        self.credentials.send_modify(|c| {
            let mut next = (**c).clone();
            next.client = Some(client);
            next.generation = generation;
            *c = Arc::new(next);
        });
    }

    /// The next request, and the instant it came.
    async fn next(&mut self) -> (Asked, tokio::time::Instant) {
        let asked = tokio::time::timeout(Duration::from_secs(600), self.asked.recv())
            .await
            .expect("a request within 10 minutes")
            .expect("the follower runs");
        (asked, tokio::time::Instant::now())
    }
}

#[tokio::test(start_paused = true)]
async fn it_lists_then_watches_from_the_list_and_resumes_a_watch_that_ended_without_a_list() {
    let mut h = Harness::start();
    let (list, _) = h.next().await;
    assert_eq!((list.what.as_str(), list.client), ("list", 1));
    let _ = list.answer.send(listed("5", &["cm"]));
    let (watch, _) = h.next().await;
    assert_eq!(watch.what, "watch from 5");
    let (answer, events) = open_watch();
    let _ = watch.answer.send(answer);
    events.unbounded_send(added("cm", "7")).unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(h.told.take(), ["listed cm at 5", "applied cm"]);
    // The server ends the watch at its timeout: resumed from the event's resourceVersion.
    let timeout = Duration::from_secs(WATCH_TIMEOUT_SECONDS.into());
    tokio::time::sleep(timeout - lifecycle::TIMEOUT_SLACK).await;
    drop(events);
    let (again, _) = h.next().await;
    assert_eq!(again.what, "watch from 7");
    assert!(h.told.take().is_empty(), "an end is no failure");
    // The resumed watch, established, then cut long before its timeout (a server shutting
    // down, a TLS stream cut short): listed again, not resumed, and nothing failed.
    let (answer, events) = open_watch();
    let _ = again.answer.send(answer);
    tokio::time::sleep(lifecycle::CONFIRM * 2).await;
    drop(events);
    let (relist, _) = h.next().await;
    assert_eq!(relist.what, "list");
    assert!(h.told.take().is_empty(), "a cut is no failure");
}

#[tokio::test(start_paused = true)]
async fn a_401_makes_the_credentials_be_read_again_and_new_ones_end_the_backoff_at_once() {
    let mut h = Harness::start();
    let stale = h.stale.clone();
    let notified = tokio::spawn(async move { stale.notified().await });
    let (list, _) = h.next().await;
    let _ = list.answer.send(status(401));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(h.told.take(), ["down unauthorized"]);
    assert!(
        notified.is_finished(),
        "a 401 makes the credentials be read again"
    );
    // The backoff after the 401 ends as soon as new credentials come.
    let failed_at = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(100)).await;
    h.new_credentials(2);
    let (retry, at) = h.next().await;
    assert_eq!((retry.what.as_str(), retry.client), ("list", 2));
    assert!(
        at - failed_at < Duration::from_millis(200),
        "{:?}",
        at - failed_at
    );
    // A TLS failure or a 403: only the 401 and TLS prove them stale.
    let stale = h.stale.clone();
    let notified = tokio::spawn(async move { stale.notified().await });
    let _ = retry.answer.send(status(403));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(h.told.take(), ["down forbidden"]);
    assert!(
        !notified.is_finished(),
        "a 403 is no reason to read them again"
    );
    notified.abort();
}

#[tokio::test(start_paused = true)]
async fn credentials_that_came_while_a_request_failed_end_its_backoff_at_once() {
    let mut h = Harness::start();
    let (list, _) = h.next().await;
    let _ = list.answer.send(listed("5", &["cm"]));
    let (watch, _) = h.next().await;
    let (answer, events) = open_watch();
    let _ = watch.answer.send(answer);
    tokio::time::sleep(Duration::from_millis(10)).await;
    // New credentials while the watch is open: it is opened again at once on the new
    // client, from where it was, with no list.
    h.new_credentials(2);
    let (resumed, _) = h.next().await;
    assert_eq!((resumed.what.as_str(), resumed.client), ("watch from 5", 2));
    drop(events);
    // The new client's watch request is under way when newer credentials come; it then
    // fails. The backoff ends at once: the credentials that came meanwhile are new to it.
    h.new_credentials(3);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let failed_at = tokio::time::Instant::now();
    let _ = resumed.answer.send(status(500));
    let (retry, at) = h.next().await;
    assert_eq!(retry.client, 3);
    assert!(
        at - failed_at < lifecycle::ANSWERED_FIRST / 2,
        "{:?}",
        at - failed_at
    );
}

#[tokio::test(start_paused = true)]
async fn a_failure_backs_off_as_its_kind_says_and_a_silent_watch_is_listed_again() {
    let mut h = Harness::start();
    let (list, _) = h.next().await;
    let failed_at = tokio::time::Instant::now();
    let _ = list.answer.send(status(500));
    let (retry, at) = h.next().await;
    assert_eq!(h.told.take(), ["down api_error"]);
    let waited = at - failed_at;
    assert!(
        waited >= lifecycle::ANSWERED_FIRST / 2 && waited <= lifecycle::ANSWERED_FIRST,
        "{waited:?}"
    );
    let _ = retry.answer.send(listed("5", &[]));
    let (watch, _) = h.next().await;
    let (answer, events) = open_watch();
    let _ = watch.answer.send(answer);
    // Silent past WATCH_SILENCE: taken for dead, and listed again (never resumed).
    let (relist, at) = h.next().await;
    assert_eq!(relist.what, "list");
    assert!(at - failed_at >= WATCH_SILENCE, "{:?}", at - failed_at);
    assert_eq!(h.told.take(), ["listed  at 5", "down watch_silent"]);
    drop(events);
    // The store went back: the list says so.
    let _ = relist.answer.send(listed("3", &["cm"]));
    let _ = h.next().await;
    assert_eq!(h.told.take(), ["listed cm at 3 (went back)"]);
}

#[tokio::test(start_paused = true)]
async fn a_request_never_answered_is_hung_and_no_credentials_are_a_failure_said() {
    let mut h = Harness::start();
    let (list, asked_at) = h.next().await;
    // Never answered: hung after the deadline, then asked again.
    let (retry, at) = h.next().await;
    assert!(at - asked_at >= REQUEST_DEADLINE, "{:?}", at - asked_at);
    assert_eq!(
        retry.what, "list",
        "a hung server may stand on another store"
    );
    assert_eq!(h.told.take(), ["down no_answer"]);
    drop(list);
    // The credentials cannot be used any more and there is no client: down, with why.
    h.credentials.send_modify(|c| {
        let mut next = (**c).clone();
        next.client = None;
        next.problem = Some("no token".into());
        next.generation = 9;
        *c = Arc::new(next);
    });
    let _ = retry.answer.send(status(500));
    tokio::time::sleep(Duration::from_secs(60)).await;
    let told = h.told.take();
    assert_eq!(
        told.last().map(String::as_str),
        Some("down credentials"),
        "{told:?}"
    );
    assert!(h.asked.try_recv().is_err(), "no request without a client");
}

#[tokio::test(start_paused = true)]
async fn a_watch_that_failed_is_up_again_once_resumed_and_a_410_lists_again_and_says_so() {
    let log = crate::testlog::Log::default();
    let _logged = tracing::subscriber::set_default(log.subscriber());
    let mut h = Harness::start();
    let (list, _) = h.next().await;
    let _ = list.answer.send(listed("5", &["cm"]));
    let (watch, _) = h.next().await;
    let (answer, events) = open_watch();
    let _ = watch.answer.send(answer);
    tokio::time::sleep(lifecycle::CONFIRM * 2).await;
    // The server fails the established watch (a 500 on it): down, backed off, and resumed
    // from where it was; once the resumed watch stays open, up again, with no list.
    let error = |code: u16| {
        json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Test", "code": code, "message": "m"}})
            .to_string()
    };
    events.unbounded_send(error(500)).unwrap();
    let (resumed, _) = h.next().await;
    assert_eq!(resumed.what, "watch from 5");
    let (answer, events) = open_watch();
    let _ = resumed.answer.send(answer);
    tokio::time::sleep(lifecycle::CONFIRM * 2).await;
    assert_eq!(h.told.take(), ["listed cm at 5", "down api_error", "up"]);
    // 410 Gone on the established watch: listed again at once, nothing failed, and said.
    events.unbounded_send(error(410)).unwrap();
    let (relist, _) = h.next().await;
    assert_eq!(relist.what, "list");
    assert!(h.told.take().is_empty(), "a 410 is no failure");
    let said = log.text();
    assert_eq!(said.matches("410 Gone").count(), 1, "{said}");
    assert!(said.contains("the recorder's ConfigMaps"), "{said}");
    // A list on a store behind the watch's: followed, and said.
    let _ = relist.answer.send(listed("3", &["cm"]));
    let _ = h.next().await;
    assert!(log.text().contains("store went back"), "{}", log.text());
}

#[tokio::test(start_paused = true)]
async fn a_list_is_read_page_by_page_and_watched_from_the_last_pages_version() {
    let mut h = Harness::start();
    let (first, _) = h.next().await;
    let mut page = listed("5", &["cm"]);
    let mut json: serde_json::Value = serde_json::from_slice(
        &futures::executor::block_on(page.body_mut().collect())
            .unwrap()
            .to_bytes(),
    )
    .unwrap();
    json["metadata"]["continue"] = json!("next-page");
    let _ = first.answer.send(body(json));
    let (second, _) = h.next().await;
    assert_eq!(second.what, "list continue=next-page", "the second page");
    let _ = second.answer.send(listed("6", &["cm2"]));
    let (watch, _) = h.next().await;
    assert_eq!(watch.what, "watch from 6");
    assert_eq!(h.told.take(), ["listed cm,cm2 at 6"]);
}
