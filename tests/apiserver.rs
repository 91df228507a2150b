//! Self-test of the fake kube-apiserver in tests/common/apiserver.rs, driven by the real kube-rs
//! client and watcher.

#[path = "common/apiserver.rs"]
mod apiserver;

use std::time::{Duration, SystemTime};

use apiserver::{ApiServer, ClientCertificate, Fault, HangMode, Rule, Target};
use futures::{Stream, StreamExt};
use http_body_util::BodyExt as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{
    Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, Request, VersionMatch,
    WatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use serde_json::{Value, json};

const NS: &str = "openshift-config";
const CM_PATH: &str = "/api/v1/namespaces/openshift-config/configmaps";
const CC_PATH: &str = "/apis/machineconfiguration.openshift.io/v1/controllerconfigs";
const WAIT: Duration = Duration::from_secs(10);

async fn client_from(kubeconfig: &std::path::Path) -> kube::Client {
    let kubeconfig = Kubeconfig::read_from(kubeconfig).expect("read kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("kube config");
    kube::Client::try_from(config).expect("kube client")
}

async fn configmaps(server: &ApiServer) -> Api<ConfigMap> {
    Api::namespaced(client_from(server.kubeconfig()).await, NS)
}

fn controllerconfig_resource() -> ApiResource {
    ApiResource {
        group: "machineconfiguration.openshift.io".into(),
        version: "v1".into(),
        api_version: "machineconfiguration.openshift.io/v1".into(),
        kind: "ControllerConfig".into(),
        plural: "controllerconfigs".into(),
    }
}

/// Polls `stream` in a task of its own, so that it keeps watching while the test does other
/// things, and hands its items over.
fn background<T: Send + 'static>(
    stream: impl Stream<Item = T> + Send + 'static,
) -> futures::channel::mpsc::UnboundedReceiver<T> {
    let (tx, rx) = futures::channel::mpsc::unbounded();
    tokio::spawn(stream.map(Ok).forward(tx));
    rx
}

/// Waits until `cond` holds, failing the test after `WAIT`.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The next item of a stream, failing the test after `WAIT`.
async fn next<S: Stream + Unpin>(stream: &mut S) -> S::Item {
    tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("timed out waiting for the stream")
        .expect("stream ended")
}

fn describe<K: kube::Resource>(event: &Event<K>) -> String {
    let name = |o: &K| o.meta().name.clone().unwrap_or_default();
    match event {
        Event::Init => "Init".into(),
        Event::InitApply(o) => format!("InitApply({})", name(o)),
        Event::InitDone => "InitDone".into(),
        Event::Apply(o) => format!("Apply({})", name(o)),
        Event::Delete(o) => format!("Delete({})", name(o)),
    }
}

/// The next `n` watcher events, which must all be Ok, as strings.
async fn events<K, S>(stream: &mut S, n: usize) -> Vec<String>
where
    K: kube::Resource,
    S: Stream<Item = watcher::Result<Event<K>>> + Unpin,
{
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(describe(&next(stream).await.expect("watcher event")));
    }
    out
}

fn data(cm: &ConfigMap, key: &str) -> String {
    cm.data
        .as_ref()
        .and_then(|d| d.get(key))
        .cloned()
        .unwrap_or_default()
}

fn api_code(err: &kube::Error) -> (u16, String) {
    match err {
        kube::Error::Api(s) => (s.code, s.reason.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn lists(server: &ApiServer, path: &str) -> Vec<apiserver::Request> {
    server
        .requests()
        .into_iter()
        .filter(|r| r.path == path && r.is_list())
        .collect()
}

fn watches(server: &ApiServer, path: &str) -> Vec<apiserver::Request> {
    server
        .requests()
        .into_iter()
        .filter(|r| r.path == path && r.watch)
        .collect()
}

#[tokio::test]
async fn lists_by_field_selector_and_gets() {
    let server = ApiServer::start();
    server.put_configmap(NS, "x", &[("ca.crt", "PEM-X")], &[("blob", b"\x00\x01")]);
    let rv = server.put_configmap(NS, "y", &[("ca.crt", "PEM-Y")], &[]);
    let api = configmaps(&server).await;

    let list = api
        .list(&ListParams::default().fields("metadata.name=x"))
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1);
    assert_eq!(list.items[0].metadata.name.as_deref(), Some("x"));
    assert_eq!(data(&list.items[0], "ca.crt"), "PEM-X");
    let blob = &list.items[0].binary_data.as_ref().unwrap()["blob"];
    assert_eq!(blob.0, b"\x00\x01");
    assert_eq!(list.metadata.resource_version, Some(rv.to_string()));
    let sent = &lists(&server, CM_PATH)[0];
    assert_eq!(
        sent.param("fieldSelector").as_deref(),
        Some("metadata.name=x")
    );

    let cm = api.get("y").await.unwrap();
    assert_eq!(data(&cm, "ca.crt"), "PEM-Y");
    assert_eq!(cm.metadata.resource_version, Some(rv.to_string()));
    let (code, reason) = api_code(&api.get("missing").await.unwrap_err());
    assert_eq!((code, reason.as_str()), (404, "NotFound"));

    // Label selectors are applied (nothing here has labels).
    let labelled = api
        .list(&ListParams::default().labels("app=ca"))
        .await
        .unwrap();
    assert!(labelled.items.is_empty());
    // An unsupported field selector is a 400, as upstream.
    let err = api
        .list(&ListParams::default().fields("data.x=1"))
        .await
        .unwrap_err();
    assert_eq!(api_code(&err).0, 400);

    // Pagination: limit and continue.
    let page = api.list(&ListParams::default().limit(1)).await.unwrap();
    assert_eq!(page.items.len(), 1);
    let token = page.metadata.continue_.clone().expect("continue token");
    let rest = api
        .list(&ListParams::default().limit(1).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(rest.items[0].metadata.name.as_deref(), Some("y"));
    assert_eq!(rest.metadata.continue_, None);

    // On the wire, items of a built-in list have no kind/apiVersion; a single GET has them.
    let client = client_from(server.kubeconfig()).await;
    let req = Request::new(CM_PATH).list(&ListParams::default()).unwrap();
    let raw: Value = serde_json::from_str(&client.request_text(req).await.unwrap()).unwrap();
    assert_eq!(raw["kind"], "ConfigMapList");
    assert_eq!(raw["apiVersion"], "v1");
    assert_eq!(raw["items"][0].get("kind"), None);
    assert_eq!(raw["items"][0].get("apiVersion"), None);
    let req = Request::new(CM_PATH).get("x", &Default::default()).unwrap();
    let raw: Value = serde_json::from_str(&client.request_text(req).await.unwrap()).unwrap();
    assert_eq!(raw["kind"], "ConfigMap");
}

#[tokio::test]
async fn watcher_sees_initial_object_then_modified_then_deleted() {
    let server = ApiServer::start();
    let first = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let mut w = background(watcher(
        api,
        watcher::Config::default().fields("metadata.name=x"),
    ));
    assert_eq!(
        events(&mut w, 3).await,
        ["Init", "InitApply(x)", "InitDone"]
    );

    server.put_configmap(NS, "other", &[("ca.crt", "ignored")], &[]);
    let modified = server.put_configmap(NS, "x", &[("ca.crt", "two")], &[]);
    match next(&mut w).await.unwrap() {
        Event::Apply(cm) => {
            assert_eq!(data(&cm, "ca.crt"), "two");
            assert_eq!(cm.metadata.resource_version, Some(modified.to_string()));
        }
        other => panic!("expected Apply, got {}", describe(&other)),
    }
    // Re-putting identical data is a no-op, as an update that changes nothing is upstream.
    assert_eq!(
        server.put_configmap(NS, "x", &[("ca.crt", "two")], &[]),
        modified
    );
    let deleted = server.delete_configmap(NS, "x");
    match next(&mut w).await.unwrap() {
        Event::Delete(cm) => {
            assert_eq!(data(&cm, "ca.crt"), "two");
            assert_eq!(cm.metadata.resource_version, Some(deleted.to_string()));
        }
        other => panic!("expected Delete, got {}", describe(&other)),
    }
    assert!(server.last_event_sent().is_some());

    // The raw stream: newline-delimited events whose objects carry kind and apiVersion. The
    // watch replays from `first` and ends by itself after timeoutSeconds.
    let client = client_from(server.kubeconfig()).await;
    let wp = WatchParams::default().fields("metadata.name=x").timeout(1);
    let req = Request::new(CM_PATH)
        .watch(&wp, &first.to_string())
        .unwrap();
    let text = client.request_text(req).await.unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let types: Vec<&str> = lines.iter().map(|l| l["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["MODIFIED", "DELETED"]);
    assert!(lines.iter().all(|l| l["object"]["kind"] == "ConfigMap"));
    assert!(lines.iter().all(|l| l["object"]["apiVersion"] == "v1"));
}

#[tokio::test]
async fn watcher_resumes_from_last_resource_version_after_clean_close() {
    let server = ApiServer::start();
    let listed = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let mut w = background(watcher(
        api,
        watcher::Config::default().fields("metadata.name=x"),
    ));
    assert_eq!(
        events(&mut w, 3).await,
        ["Init", "InitApply(x)", "InitDone"]
    );

    until("the watch", || server.open_watches() == 1).await;
    server.close_watches();
    until("the watch to resume", || {
        watches(&server, CM_PATH).len() == 2
    })
    .await;
    server.put_configmap(NS, "x", &[("ca.crt", "two")], &[]);
    assert_eq!(events(&mut w, 1).await, ["Apply(x)"]);

    assert_eq!(
        lists(&server, CM_PATH).len(),
        1,
        "no relist after a clean close"
    );
    let watches = watches(&server, CM_PATH);
    assert_eq!(watches.len(), 2);
    for w in &watches {
        assert_eq!(w.param("resourceVersion"), Some(listed.to_string()));
        assert_eq!(w.param("allowWatchBookmarks").as_deref(), Some("true"));
    }
}

#[tokio::test]
async fn compaction_makes_the_resumed_watch_fail_with_410_and_the_watcher_relist() {
    let server = ApiServer::start();
    // No bookmark may move the watcher past the compaction point.
    server.set_bookmark_interval(Duration::from_secs(3600));
    let listed = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let mut w = background(watcher(
        api.clone(),
        watcher::Config::default().fields("metadata.name=x"),
    ));
    assert_eq!(
        events(&mut w, 3).await,
        ["Init", "InitApply(x)", "InitDone"]
    );
    until("the watch", || server.open_watches() == 1).await;

    let now = server.put_configmap(NS, "unrelated", &[("k", "v")], &[]);
    server.compact();
    server.close_watches();
    match next(&mut w).await {
        Err(watcher::Error::WatchError(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            assert_eq!(
                status.message,
                format!("too old resource version: {listed} ({now})")
            );
        }
        other => panic!(
            "expected a 410 watch error, got {:?}",
            other.map(|e| describe(&e))
        ),
    }
    assert_eq!(
        events(&mut w, 3).await,
        ["Init", "InitApply(x)", "InitDone"]
    );
    assert_eq!(lists(&server, CM_PATH).len(), 2, "relisted after 410");

    // A plain watch from before the compaction: a 200 stream with one ERROR event.
    let mut old = api
        .watch(&WatchParams::default(), &listed.to_string())
        .await
        .unwrap()
        .boxed();
    match next(&mut old).await.unwrap() {
        WatchEvent::Error(status) => assert_eq!(status.code, 410),
        other => panic!("expected an ERROR event, got {other:?}"),
    }
    // An exact list at a compacted resourceVersion is an HTTP 410.
    let lp = ListParams::default()
        .at(&listed.to_string())
        .matching(VersionMatch::Exact);
    assert_eq!(
        api_code(&api.list(&lp).await.unwrap_err()),
        (410, "Expired".into())
    );
}

#[tokio::test]
async fn watcher_recovers_from_restart_and_sees_changes_made_while_down() {
    let server = ApiServer::start();
    server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let mut w = background(
        watcher(
            api.clone(),
            watcher::Config::default().fields("metadata.name=x"),
        )
        .default_backoff(),
    );
    assert_eq!(
        events(&mut w, 3).await,
        ["Init", "InitApply(x)", "InitDone"]
    );
    until("the watch", || server.open_watches() == 1).await;

    server.stop();
    assert_eq!(server.open_watches(), 0);
    let err = api.get("x").await.unwrap_err();
    assert!(
        !matches!(err, kube::Error::Api(_)),
        "connection refused, got {err:?}"
    );
    server.put_configmap(NS, "x", &[("ca.crt", "two")], &[]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.restart();

    // Refused while down (backing off), then a 410: the restarted server's watch cache starts
    // after the change made while it was down. So the watcher relists and sees it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    loop {
        let item = tokio::time::timeout_at(deadline, w.next())
            .await
            .expect("watcher did not recover in time")
            .expect("watcher ended");
        match item {
            Ok(Event::InitApply(cm)) if data(&cm, "ca.crt") == "two" => break,
            Ok(event) => seen.push(describe(&event)),
            Err(watcher::Error::WatchError(status)) => seen.push(format!("Error({})", status.code)),
            Err(_) => seen.push("Error".into()),
        }
    }
    assert!(seen.contains(&"Error(410)".to_owned()), "{seen:?}");
    assert_eq!(seen.last().map(String::as_str), Some("Init"), "{seen:?}");
    assert_eq!(lists(&server, CM_PATH).len(), 2);
}

#[tokio::test]
async fn injected_and_auth_errors_decode_as_status() {
    let server = ApiServer::start();
    server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;

    server.fail_next(1, 403);
    let err = api.get("x").await.unwrap_err();
    assert_eq!(api_code(&err), (403, "Forbidden".into()));
    let kube::Error::Api(status) = err else {
        unreachable!()
    };
    assert_eq!(
        status.message,
        "configmaps \"x\" is forbidden: User \"system:node:fixture-node\" cannot get resource \"configmaps\" in API group \"\" in the namespace \"openshift-config\""
    );
    assert!(api.get("x").await.is_ok(), "only the next request fails");

    server.fail_next(1, 500);
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(&err), (500, "InternalError".into()));

    // The watcher surfaces an injected 403 on its list and recovers on the next poll.
    server.fail_next(1, 403);
    let mut w = background(watcher(
        api.clone(),
        watcher::Config::default().fields("metadata.name=x"),
    ));
    assert_eq!(events(&mut w, 1).await, ["Init"]);
    match next(&mut w).await {
        Err(watcher::Error::InitialListFailed(e)) => assert_eq!(api_code(&e).0, 403),
        other => panic!(
            "expected InitialListFailed, got {:?}",
            other.map(|e| describe(&e))
        ),
    }
    assert_eq!(
        events(&mut w, 3).await,
        ["Init", "InitApply(x)", "InitDone"]
    );

    // A wrong token is 401.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("kubeconfig");
    let text = std::fs::read_to_string(server.kubeconfig()).unwrap();
    std::fs::write(&bad, text.replace(&server.token(), "wrong-token")).unwrap();
    let api: Api<ConfigMap> = Api::namespaced(client_from(&bad).await, NS);
    let err = api.get("x").await.unwrap_err();
    assert_eq!(api_code(&err), (401, "Unauthorized".into()));
}

#[tokio::test]
async fn bookmarks_are_sent_only_when_requested() {
    let server = ApiServer::start();
    server.set_bookmark_interval(Duration::from_millis(200));
    let start = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let wp = WatchParams::default().fields("metadata.name=x").timeout(30);
    let mut with = api.watch(&wp, &start.to_string()).await.unwrap().boxed();
    let mut without = api
        .watch(&wp.clone().disable_bookmarks(), &start.to_string())
        .await
        .unwrap()
        .boxed();

    // A change the watches do not select moves the resourceVersion: the bookmark carries it.
    let moved = server.put_configmap(NS, "unrelated", &[("k", "v")], &[]);
    match next(&mut with).await.unwrap() {
        WatchEvent::Bookmark(b) => {
            assert_eq!(b.metadata.resource_version, moved.to_string());
            assert_eq!(b.types.kind, "ConfigMap");
        }
        other => panic!("expected a bookmark, got {other:?}"),
    }
    let quiet = tokio::time::timeout(Duration::from_millis(800), without.next()).await;
    assert!(quiet.is_err(), "no bookmarks without allowWatchBookmarks");
    assert_eq!(server.open_watches(), 2);
}

#[tokio::test]
async fn controllerconfig_works_as_a_dynamic_object() {
    let server = ApiServer::start();
    let name = "machine-config-controller";
    let rv = server.put_controllerconfig(name, "Y2EtZGF0YQ==");
    let client = client_from(server.kubeconfig()).await;
    let ar = controllerconfig_resource();
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);

    let cc = api.get(name).await.unwrap();
    assert_eq!(
        cc.data["spec"]["kubeAPIServerServingCAData"],
        "Y2EtZGF0YQ=="
    );
    assert_eq!(cc.metadata.generation, Some(1));
    assert_eq!(cc.metadata.resource_version, Some(rv.to_string()));
    let list = api
        .list(&ListParams::default().fields(&format!("metadata.name={name}")))
        .await;
    assert_eq!(list.unwrap().items.len(), 1);
    // Custom resource lists keep kind/apiVersion on their items.
    let req = Request::new(CC_PATH).list(&ListParams::default()).unwrap();
    let raw: Value = serde_json::from_str(&client.request_text(req).await.unwrap()).unwrap();
    assert_eq!(raw["kind"], "ControllerConfigList");
    assert_eq!(raw["items"][0]["kind"], "ControllerConfig");

    let fields = format!("metadata.name={name}");
    let mut w = background(watcher(api, watcher::Config::default().fields(&fields)));
    assert_eq!(
        events(&mut w, 3).await,
        ["Init", format!("InitApply({name})").as_str(), "InitDone"]
    );
    server.touch_controllerconfig(name);
    match next(&mut w).await.unwrap() {
        Event::Apply(cc) => {
            assert_eq!(cc.metadata.generation, Some(2));
            assert_eq!(
                cc.data["spec"]["kubeAPIServerServingCAData"],
                "Y2EtZGF0YQ=="
            );
        }
        other => panic!("expected Apply, got {}", describe(&other)),
    }
    server.put_controllerconfig(name, "not base64!");
    match next(&mut w).await.unwrap() {
        Event::Apply(cc) => {
            assert_eq!(cc.data["spec"]["kubeAPIServerServingCAData"], "not base64!")
        }
        other => panic!("expected Apply, got {}", describe(&other)),
    }
    server.delete_controllerconfig(name);
    assert_eq!(events(&mut w, 1).await, [format!("Delete({name})")]);
}

#[tokio::test]
async fn streaming_lists_follow_the_watch_list_feature_gate() {
    let server = ApiServer::start();
    server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let config = watcher::Config::default()
        .fields("metadata.name=x")
        .streaming_lists();

    // Kubernetes 1.33 default: WatchList is off and sendInitialEvents is rejected.
    let mut w = background(watcher(api.clone(), config.clone()));
    match next(&mut w).await {
        Err(watcher::Error::WatchStartFailed(e)) => {
            assert_eq!(api_code(&e), (422, "Invalid".into()))
        }
        other => panic!("expected a 422, got {:?}", other.map(|e| describe(&e))),
    }
    drop(w);

    server.set_watch_list(true);
    let mut w = background(watcher(api, config));
    assert_eq!(
        events(&mut w, 3).await,
        ["Init", "InitApply(x)", "InitDone"]
    );
    server.put_configmap(NS, "x", &[("ca.crt", "two")], &[]);
    assert_eq!(events(&mut w, 1).await, ["Apply(x)"]);
    assert!(lists(&server, CM_PATH).is_empty());
    let first = &watches(&server, CM_PATH)[0];
    assert_eq!(first.param("sendInitialEvents").as_deref(), Some("true"));
    assert_eq!(
        first.param("resourceVersionMatch").as_deref(),
        Some("NotOlderThan")
    );
}

/// A client without kube-rs's own retries of 429, 503 and 504, so that every answer shows.
async fn client_without_retries(server: &ApiServer) -> kube::Client {
    let kubeconfig = Kubeconfig::read_from(server.kubeconfig()).expect("read kubeconfig");
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("kube config");
    config.default_retry = false;
    kube::Client::try_from(config).expect("kube client")
}

#[tokio::test]
async fn a_hung_server_holds_what_it_covers_until_released() {
    let server = ApiServer::start();
    server.set_bookmark_interval(Duration::from_millis(100));
    let rv = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let lp = ListParams::default().fields("metadata.name=x");
    let wp = WatchParams::default().fields("metadata.name=x").timeout(30);
    let mut open = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();

    server.hang(HangMode::Lists);
    let held = tokio::spawn({
        let api = api.clone();
        let lp = lp.clone();
        async move { api.list(&lp).await }
    });
    until("the held list to arrive", || {
        lists(&server, CM_PATH).len() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!held.is_finished(), "a hung server answers no list");
    // Watches still flow: a change reaches the open watch.
    server.put_configmap(NS, "x", &[("ca.crt", "two")], &[]);
    assert!(matches!(
        next(&mut open).await.unwrap(),
        WatchEvent::Modified(_)
    ));

    server.hang(HangMode::Watches);
    // A bookmark already on its way when the hang began may still arrive (every 100 ms
    // here); a few are let through, then the watch must go quiet.
    for _ in 0..3 {
        match tokio::time::timeout(Duration::from_millis(250), open.next()).await {
            Err(_) => break,
            Ok(Some(Ok(WatchEvent::Bookmark(_)))) => {}
            other => panic!("only a bookmark sent before the hang may arrive: {other:?}"),
        }
    }
    server.put_configmap(NS, "unrelated", &[("k", "v")], &[]);
    let quiet = tokio::time::timeout(Duration::from_millis(800), open.next()).await;
    assert!(
        quiet.is_err(),
        "an open watch is silent while hung: {quiet:?}"
    );
    let new_watch = tokio::time::timeout(Duration::from_millis(800), api.watch(&wp, "0")).await;
    assert!(new_watch.is_err(), "a new watch gets no answer while hung");
    assert_eq!(
        held.await.unwrap().unwrap().items.len(),
        1,
        "released by a new mode"
    );

    server.unhang();
    assert!(matches!(
        next(&mut open).await.unwrap(),
        WatchEvent::Bookmark(_)
    ));
    assert!(api.list(&lp).await.is_ok());
}

#[tokio::test]
async fn faults_hit_their_target_and_are_not_always_status_json() {
    let server = ApiServer::start();
    let rv = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api: Api<ConfigMap> = Api::namespaced(client_without_retries(&server).await, NS);
    let lp = ListParams::default().fields("metadata.name=x");
    let wp = WatchParams::default().fields("metadata.name=x").timeout(30);

    // A fault aimed at watches lets lists through, and the other way round.
    server.fail_next_on(Target::Watch, 1, Fault::Status(500));
    assert!(api.list(&lp).await.is_ok());
    let err = api.watch(&wp, &rv.to_string()).await.err().expect("a 500");
    assert_eq!(api_code(&err), (500, "InternalError".into()));
    server.fail_next_on(Target::List, 1, Fault::Status(403));
    assert!(api.watch(&wp, &rv.to_string()).await.is_ok());
    assert_eq!(api_code(&api.list(&lp).await.unwrap_err()).0, 403);

    // A load balancer's HTML page and a proxy's empty 503: kube-rs keeps the body as the message.
    server.fail_next_on(Target::List, 1, Fault::BadGatewayHtml);
    match api.list(&lp).await.unwrap_err() {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 502);
            assert!(status.message.contains("<title>502 Bad Gateway</title>"));
        }
        other => panic!("expected a 502, got {other:?}"),
    }
    server.fail_next_on(Target::Any, 1, Fault::EmptyUnavailable);
    match api.list(&lp).await.unwrap_err() {
        kube::Error::Api(status) => assert_eq!((status.code, status.message.as_str()), (503, "")),
        other => panic!("expected a 503, got {other:?}"),
    }
    // A list cut in the middle of its JSON.
    server.fail_next_on(Target::List, 1, Fault::CutMidJson);
    let err = api.list(&lp).await.unwrap_err();
    assert!(!matches!(err, kube::Error::Api(_)), "{err:?}");

    // An ERROR event with a code other than 410, in a new watch and in an open one.
    server.fail_next_on(Target::Watch, 1, Fault::ErrorEvent(500));
    let mut w = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();
    match next(&mut w).await.unwrap() {
        WatchEvent::Error(status) => assert_eq!(status.code, 500),
        other => panic!("expected an ERROR event, got {other:?}"),
    }
    assert!(
        w.next().await.is_none(),
        "the stream ends after the ERROR event"
    );
    let mut w = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();
    until("the watch", || server.open_watches() == 1).await;
    server.break_watches(Fault::ErrorEvent(500));
    match next(&mut w).await.unwrap() {
        WatchEvent::Error(status) => assert_eq!(status.code, 500),
        other => panic!("expected an ERROR event, got {other:?}"),
    }
    // A watch cut mid-event: kube-rs takes the unexpected EOF for the end of the watch.
    let mut w = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();
    until("the watch", || server.open_watches() == 1).await;
    server.break_watches(Fault::CutMidJson);
    let end = tokio::time::timeout(WAIT, w.next())
        .await
        .expect("the cut ends the stream");
    assert!(end.is_none(), "{end:?}");
}

#[tokio::test]
async fn rbac_by_resource_names_covers_a_list_or_watch_selecting_the_name() {
    let server = ApiServer::start();
    let rv = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    server.put_configmap(NS, "y", &[("ca.crt", "two")], &[]);
    server.restrict_to(vec![Rule::new(
        &["get", "list", "watch"],
        "",
        "configmaps",
        Some(NS),
        &["x"],
    )]);
    let api = configmaps(&server).await;
    let named = |n: &str| format!("metadata.name={n}");

    assert_eq!(
        api.list(&ListParams::default().fields(&named("x")))
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    let wp = WatchParams::default().fields(&named("x")).timeout(1);
    assert!(api.watch(&wp, &rv.to_string()).await.is_ok());
    assert!(api.get("x").await.is_ok());

    let forbidden = |err: kube::Error| match err {
        kube::Error::Api(status) => {
            assert_eq!((status.code, status.reason.as_str()), (403, "Forbidden"));
            status.message
        }
        other => panic!("expected 403, got {other:?}"),
    };
    let user = "User \"system:node:fixture-node\"";
    let scope = "in API group \"\" in the namespace \"openshift-config\"";
    assert_eq!(
        forbidden(api.list(&ListParams::default()).await.unwrap_err()),
        format!("configmaps is forbidden: {user} cannot list resource \"configmaps\" {scope}")
    );
    assert_eq!(
        forbidden(
            api.list(&ListParams::default().fields(&named("y")))
                .await
                .unwrap_err()
        ),
        format!(
            "configmaps \"y\" is forbidden: {user} cannot list resource \"configmaps\" {scope}"
        )
    );
    let wp = WatchParams::default().fields(&named("y"));
    assert_eq!(
        forbidden(api.watch(&wp, "0").await.err().unwrap()),
        format!(
            "configmaps \"y\" is forbidden: {user} cannot watch resource \"configmaps\" {scope}"
        )
    );
    assert_eq!(
        forbidden(api.get("y").await.unwrap_err()),
        format!("configmaps \"y\" is forbidden: {user} cannot get resource \"configmaps\" {scope}")
    );
    let other: Api<ConfigMap> = Api::namespaced(client_from(server.kubeconfig()).await, "default");
    let message = forbidden(other.get("x").await.unwrap_err());
    assert!(
        message.contains("in the namespace \"default\""),
        "{message}"
    );
}

#[tokio::test]
async fn bookmarks_keep_coming_once_the_resource_version_moved_past_the_start() {
    let server = ApiServer::start();
    server.set_bookmark_interval(Duration::from_millis(200));
    let start = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let wp = WatchParams::default().fields("metadata.name=x").timeout(30);
    let mut w = api.watch(&wp, &start.to_string()).await.unwrap().boxed();

    // A watch that starts at the current resourceVersion of a quiet resource hears nothing.
    let quiet = tokio::time::timeout(Duration::from_millis(700), w.next()).await;
    assert!(
        quiet.is_err(),
        "no bookmark before the resourceVersion moves: {quiet:?}"
    );
    // Once it moved, a bookmark every interval, even with no further change.
    let moved = server.put_configmap(NS, "unrelated", &[("k", "v")], &[]);
    for _ in 0..3 {
        match next(&mut w).await.unwrap() {
            WatchEvent::Bookmark(b) => assert_eq!(b.metadata.resource_version, moved.to_string()),
            other => panic!("expected a bookmark, got {other:?}"),
        }
    }
    assert_eq!(server.last_rv_delivered(), Some(moved));
}

// ---------------------------------------------------------------------------------------------
// Server-side apply
// ---------------------------------------------------------------------------------------------

/// The field manager the `publish` command applies as.
const PUBLISHER: &str = "kubelet-ca-agent-publisher";

/// What `publish` applies: the bundle and an annotation naming it.
fn bundle_config(name: &str, bundle: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": NS,
            "annotations": {"kubelet-ca-agent/sha256": format!("sha-of-{bundle}")},
        },
        "data": {"ca-bundle.crt": bundle},
    })
}

fn publish() -> PatchParams {
    PatchParams::apply(PUBLISHER).force()
}

fn apply(config: Value) -> Patch<Value> {
    Patch::Apply(config)
}

/// Sends a PATCH as kube-rs builds it and returns the HTTP status and the JSON answered (the
/// object, or a Status), which `Api::patch` does not show whole.
async fn patch_raw(
    server: &ApiServer,
    name: &str,
    pp: &PatchParams,
    patch: &Patch<Value>,
) -> (u16, Value) {
    let req = Request::new(CM_PATH).patch(name, pp, patch).unwrap();
    send_raw(server, req).await
}

/// Sends a request built with kube-rs's `Request` (maybe altered) the same way.
async fn send_raw(server: &ApiServer, req: hyper::Request<Vec<u8>>) -> (u16, Value) {
    let client = client_from(server.kubeconfig()).await;
    let resp = client
        .send(req.map(kube::client::Body::from))
        .await
        .unwrap();
    let code = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&body)));
    (code, json)
}

fn status_of(err: kube::Error) -> kube::core::Status {
    match err {
        kube::Error::Api(status) => *status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// (manager, operation) of each managedFields entry, in order.
fn managers(cm: &ConfigMap) -> Vec<(String, String)> {
    let entries = cm.metadata.managed_fields.iter().flatten();
    entries
        .map(|e| {
            let text = |s: &Option<String>| s.clone().unwrap_or_default();
            (text(&e.manager), text(&e.operation))
        })
        .collect()
}

fn owner(name: &str, operation: &str) -> (String, String) {
    (name.to_owned(), operation.to_owned())
}

#[tokio::test]
async fn apply_creates_a_missing_configmap_owned_by_its_applier() {
    let server = ApiServer::start();
    let (code, obj) = patch_raw(
        &server,
        "bundle",
        &publish(),
        &apply(bundle_config("bundle", "PEM-1")),
    )
    .await;
    assert_eq!(code, 201, "{obj}");
    assert_eq!(obj["kind"], "ConfigMap");
    assert_eq!(obj["data"]["ca-bundle.crt"], "PEM-1");
    let meta = &obj["metadata"];
    assert_eq!(
        meta["annotations"]["kubelet-ca-agent/sha256"],
        "sha-of-PEM-1"
    );
    assert_eq!(
        meta["resourceVersion"],
        server.resource_version().to_string()
    );
    assert!(
        meta["uid"].as_str().is_some_and(|u| u.len() == 36),
        "{meta}"
    );
    assert!(
        meta["creationTimestamp"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );

    let mut entry = meta["managedFields"][0].clone();
    let time = entry.as_object_mut().unwrap().remove("time");
    assert!(time.is_some_and(|t| t.as_str().is_some_and(|t| t.ends_with('Z'))));
    assert_eq!(
        entry,
        json!({
            "manager": PUBLISHER,
            "operation": "Apply",
            "apiVersion": "v1",
            "fieldsType": "FieldsV1",
            "fieldsV1": {
                "f:data": {"f:ca-bundle.crt": {}},
                "f:metadata": {"f:annotations": {"f:kubelet-ca-agent/sha256": {}}},
            },
        })
    );
    assert_eq!(meta["managedFields"].as_array().map(Vec::len), Some(1));
    assert_eq!(server.configmap(NS, "bundle"), Some(obj.clone()));

    // The object exists now: the next apply updates it, with 200.
    let (code, updated) = patch_raw(
        &server,
        "bundle",
        &publish(),
        &apply(bundle_config("bundle", "PEM-2")),
    )
    .await;
    assert_eq!(code, 200, "{updated}");
    assert_eq!(updated["metadata"]["uid"], obj["metadata"]["uid"]);
    let cm = configmaps(&server).await.get("bundle").await.unwrap();
    assert_eq!(data(&cm, "ca-bundle.crt"), "PEM-2");

    // A dry run answers what would be stored and stores nothing.
    let rv = server.resource_version();
    let (code, dry) = patch_raw(
        &server,
        "other",
        &publish().dry_run(),
        &apply(bundle_config("other", "PEM-3")),
    )
    .await;
    assert_eq!(
        (code, &dry["data"]["ca-bundle.crt"]),
        (201, &json!("PEM-3"))
    );
    assert_eq!(server.configmap(NS, "other"), None);
    assert_eq!(server.resource_version(), rv);
}

#[tokio::test]
async fn reapplying_an_unchanged_configuration_changes_nothing() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    let config = || apply(bundle_config("bundle", "PEM-1"));
    let first = api.patch("bundle", &publish(), &config()).await.unwrap();
    let rv = first.metadata.resource_version.clone().unwrap();
    let wp = WatchParams::default()
        .fields("metadata.name=bundle")
        .disable_bookmarks()
        .timeout(30);
    let mut w = api.watch(&wp, &rv).await.unwrap().boxed();

    // managedFields times have a resolution of a second: wait for a bumped time to show.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = api.patch("bundle", &publish(), &config()).await.unwrap();
    assert_eq!(again.metadata.resource_version, Some(rv.clone()));
    assert_eq!(server.resource_version().to_string(), rv);
    assert_eq!(
        again.metadata.managed_fields, first.metadata.managed_fields,
        "the applier's time does not move when nothing changed"
    );

    let changed = api
        .patch(
            "bundle",
            &publish(),
            &apply(bundle_config("bundle", "PEM-2")),
        )
        .await
        .unwrap();
    let new_rv = changed.metadata.resource_version.clone().unwrap();
    assert_ne!(new_rv, rv);
    let time = |cm: &ConfigMap| cm.metadata.managed_fields.as_ref().unwrap()[0].time.clone();
    assert_ne!(time(&changed), time(&first), "a change moves the time");
    match next(&mut w).await.unwrap() {
        WatchEvent::Modified(cm) => {
            assert_eq!(data(&cm, "ca-bundle.crt"), "PEM-2");
            assert_eq!(cm.metadata.resource_version, Some(new_rv));
        }
        other => panic!("expected the change as the first event, got {other:?}"),
    }
    let quiet = tokio::time::timeout(Duration::from_millis(500), w.next()).await;
    assert!(quiet.is_err(), "one event for one change: {quiet:?}");
}

#[tokio::test]
async fn a_key_the_applier_drops_goes_unless_another_manager_owns_it() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    let config = |data: Value| {
        apply(
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bundle"}, "data": data}),
        )
    };
    let other = PatchParams::apply("other-applier");
    api.patch("bundle", &publish(), &config(json!({"a": "1", "b": "2"})))
        .await
        .unwrap();
    let cm = api
        .patch("bundle", &publish(), &config(json!({"a": "1"})))
        .await
        .unwrap();
    assert_eq!(cm.data, Some([("a".into(), "1".into())].into()));

    // Another applier applying the same value shares the field: no conflict, two owners.
    let cm = api
        .patch("bundle", &other, &config(json!({"a": "1"})))
        .await
        .unwrap();
    let mut owners = managers(&cm);
    owners.sort();
    assert_eq!(
        owners,
        [
            owner("kubelet-ca-agent-publisher", "Apply"),
            owner("other-applier", "Apply")
        ]
    );

    // The publisher stops applying it: the value stays, the other applier keeps it.
    let cm = api
        .patch("bundle", &publish(), &config(json!({})))
        .await
        .unwrap();
    assert_eq!(data(&cm, "a"), "1");
    assert_eq!(managers(&cm), [owner("other-applier", "Apply")]);

    // Nobody applies it any more: it goes, and so does the last manager.
    let cm = api
        .patch("bundle", &other, &config(json!({})))
        .await
        .unwrap();
    assert_eq!(cm.data, None);
    assert_eq!(cm.metadata.managed_fields, None);
}

#[tokio::test]
async fn a_field_another_manager_changed_is_a_conflict_until_forced() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    api.patch(
        "bundle",
        &publish(),
        &apply(bundle_config("bundle", "PEM-1")),
    )
    .await
    .unwrap();
    // Someone edits the bundle by hand: their Update takes the field from the publisher.
    let edited = server.edit_configmap_as(
        "kubectl-edit",
        NS,
        "bundle",
        &[("ca-bundle.crt", "EDITED")],
        &[],
    );
    let cm = api.get("bundle").await.unwrap();
    assert_eq!(
        managers(&cm),
        [owner(PUBLISHER, "Apply"), owner("kubectl-edit", "Update")]
    );

    let without_force = PatchParams::apply(PUBLISHER);
    let status = status_of(
        api.patch(
            "bundle",
            &without_force,
            &apply(bundle_config("bundle", "PEM-1")),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        status.message,
        "Apply failed with 1 conflict: conflict with \"kubectl-edit\" using v1: .data.ca-bundle.crt"
    );
    assert_eq!(
        server.resource_version(),
        edited,
        "a refused apply writes nothing"
    );
    let (code, raw) = patch_raw(
        &server,
        "bundle",
        &without_force,
        &apply(bundle_config("bundle", "PEM-1")),
    )
    .await;
    assert_eq!(code, 409);
    assert_eq!(
        raw["details"],
        json!({"causes": [{
            "reason": "FieldManagerConflict",
            "message": "conflict with \"kubectl-edit\" using v1",
            "field": ".data.ca-bundle.crt",
        }]})
    );

    // Applying the value the editor set is no conflict: the publisher shares the field.
    let shared = api
        .patch(
            "bundle",
            &without_force,
            &apply(bundle_config("bundle", "EDITED")),
        )
        .await
        .unwrap();
    assert_eq!(data(&shared, "ca-bundle.crt"), "EDITED");

    // Forced, the apply takes the field over; the editor, owning nothing more, is gone.
    let cm = api
        .patch(
            "bundle",
            &publish(),
            &apply(bundle_config("bundle", "PEM-2")),
        )
        .await
        .unwrap();
    assert_eq!(data(&cm, "ca-bundle.crt"), "PEM-2");
    assert_eq!(managers(&cm), [owner(PUBLISHER, "Apply")]);
}

#[tokio::test]
async fn several_conflicts_are_listed_by_manager() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    api.patch(
        "bundle",
        &publish(),
        &apply(bundle_config("bundle", "PEM-1")),
    )
    .await
    .unwrap();
    let annotation = [("kubelet-ca-agent/sha256", "hand-made")];
    let bundle = [("ca-bundle.crt", "EDITED")];
    server.edit_configmap_as("kubectl-edit", NS, "bundle", &bundle, &annotation);
    let without_force = PatchParams::apply(PUBLISHER);
    let config = || apply(bundle_config("bundle", "PEM-1"));
    let status = status_of(
        api.patch("bundle", &without_force, &config())
            .await
            .unwrap_err(),
    );
    assert_eq!(
        status.message,
        "Apply failed with 2 conflicts: conflicts with \"kubectl-edit\" using v1:\n- .data.ca-bundle.crt\n- .metadata.annotations.kubelet-ca-agent/sha256"
    );

    server.edit_configmap_as(
        "ops",
        NS,
        "bundle",
        &[],
        &[("kubelet-ca-agent/sha256", "ops")],
    );
    let (code, raw) = patch_raw(&server, "bundle", &without_force, &config()).await;
    assert_eq!(code, 409);
    assert_eq!(
        raw["message"],
        "Apply failed with 2 conflicts: conflicts with \"kubectl-edit\" using v1:\n- .data.ca-bundle.crt\nconflicts with \"ops\" using v1:\n- .metadata.annotations.kubelet-ca-agent/sha256"
    );
    let fields: Vec<&Value> = raw["details"]["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["field"])
        .collect();
    assert_eq!(
        fields,
        [
            ".data.ca-bundle.crt",
            ".metadata.annotations.kubelet-ca-agent/sha256"
        ]
    );
}

#[tokio::test]
async fn malformed_applies_are_refused_as_upstream_refuses_them() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    let refused = |err: kube::Error| {
        let status = status_of(err);
        (status.code, status.reason, status.message)
    };

    // No fieldManager: the PatchOptions are invalid.
    let (code, raw) = patch_raw(
        &server,
        "bundle",
        &PatchParams::default(),
        &apply(bundle_config("bundle", "PEM")),
    )
    .await;
    assert_eq!(code, 422);
    let message = "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch";
    assert_eq!(raw["message"], message);
    assert_eq!(
        raw["details"],
        json!({"group": "meta.k8s.io", "kind": "PatchOptions", "causes": [{
            "reason": "FieldValueRequired",
            "message": "Required value: is required for apply patch",
            "field": "fieldManager",
        }]})
    );

    let bad_request = |message: &str| (400, "BadRequest".to_owned(), message.to_owned());
    let err = api
        .patch(
            "bundle",
            &publish(),
            &apply(bundle_config("renamed", "PEM")),
        )
        .await
        .unwrap_err();
    assert_eq!(
        refused(err),
        bad_request("the name of the object (renamed) does not match the name on the URL (bundle)")
    );
    let mut elsewhere = bundle_config("bundle", "PEM");
    elsewhere["metadata"]["namespace"] = json!("default");
    let err = api
        .patch("bundle", &publish(), &apply(elsewhere))
        .await
        .unwrap_err();
    assert_eq!(
        refused(err),
        bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
    );
    let mut secret = bundle_config("bundle", "PEM");
    secret["kind"] = json!("Secret");
    let err = api
        .patch("bundle", &publish(), &apply(secret))
        .await
        .unwrap_err();
    assert_eq!(
        refused(err),
        bad_request("invalid object type: /v1, Kind=Secret")
    );
    let err = api
        .patch("bundle", &publish(), &apply(json!(["not", "an", "object"])))
        .await
        .unwrap_err();
    assert_eq!(
        refused(err),
        bad_request(
            "error decoding YAML: error unmarshaling JSON: while decoding JSON: json: cannot unmarshal array into Go value of type map[string]interface {}"
        )
    );

    // A patch type the server does not know.
    let mut req = Request::new(CM_PATH)
        .patch("bundle", &publish(), &apply(bundle_config("bundle", "PEM")))
        .unwrap();
    req.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    let (code, raw) = send_raw(&server, req).await;
    assert_eq!(
        (code, &raw["reason"]),
        (415, &json!("UnsupportedMediaType"))
    );
    assert_eq!(
        raw["message"],
        "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json, application/apply-patch+yaml"
    );
    assert_eq!(server.configmap(NS, "bundle"), None, "nothing was created");
}

#[tokio::test]
async fn a_resource_version_in_the_apply_is_a_precondition() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    let old = api
        .patch(
            "bundle",
            &publish(),
            &apply(bundle_config("bundle", "PEM-1")),
        )
        .await
        .unwrap();
    let current = api
        .patch(
            "bundle",
            &publish(),
            &apply(bundle_config("bundle", "PEM-2")),
        )
        .await
        .unwrap();
    let at = |cm: &ConfigMap, bundle: &str| {
        let mut config = bundle_config("bundle", bundle);
        config["metadata"]["resourceVersion"] = json!(cm.metadata.resource_version);
        apply(config)
    };
    let status = status_of(
        api.patch("bundle", &publish(), &at(&old, "PEM-3"))
            .await
            .unwrap_err(),
    );
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        status.message,
        "Operation cannot be fulfilled on configmaps \"bundle\": the object has been modified; please apply your changes to the latest version and try again"
    );
    let cm = api
        .patch("bundle", &publish(), &at(&current, "PEM-3"))
        .await
        .unwrap();
    assert_eq!(data(&cm, "ca-bundle.crt"), "PEM-3");
}

#[tokio::test]
async fn an_apply_that_creates_needs_create_as_well_as_patch() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    let rule = |verbs: &[&str]| Rule::new(verbs, "", "configmaps", Some(NS), &["bundle"]);
    let config = || apply(bundle_config("bundle", "PEM-1"));

    server.restrict_to(vec![rule(&["patch"])]);
    let status = status_of(
        api.patch("bundle", &publish(), &config())
            .await
            .unwrap_err(),
    );
    assert_eq!((status.code, status.reason.as_str()), (403, "Forbidden"));
    // patch.go's create check: RBAC gives no reason, so nothing follows the colon.
    assert_eq!(status.message, "configmaps \"bundle\" is forbidden: ");
    assert_eq!(server.configmap(NS, "bundle"), None);

    server.restrict_to(vec![rule(&["create", "patch"])]);
    let cm = api.patch("bundle", &publish(), &config()).await.unwrap();
    assert_eq!(data(&cm, "ca-bundle.crt"), "PEM-1");

    // Once it exists, patch alone is enough; create alone is not.
    server.restrict_to(vec![rule(&["patch"])]);
    let cm = api
        .patch(
            "bundle",
            &publish(),
            &apply(bundle_config("bundle", "PEM-2")),
        )
        .await
        .unwrap();
    assert_eq!(data(&cm, "ca-bundle.crt"), "PEM-2");
    server.restrict_to(vec![rule(&["create"])]);
    let status = status_of(
        api.patch("bundle", &publish(), &config())
            .await
            .unwrap_err(),
    );
    assert_eq!(
        status.message,
        "configmaps \"bundle\" is forbidden: User \"system:node:fixture-node\" cannot patch resource \"configmaps\" in API group \"\" in the namespace \"openshift-config\""
    );
}

#[tokio::test]
async fn configmaps_over_a_mebibyte_or_with_bad_keys_are_invalid() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    let config = |name: &str, key: &str, value: String| {
        apply(
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {key: value}}),
        )
    };
    let mebibyte = 1024 * 1024;

    let status = status_of(
        api.patch(
            "big",
            &publish(),
            &config("big", "ca-bundle.crt", "x".repeat(mebibyte + 1)),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        status.message,
        "ConfigMap \"big\" is invalid: []: Too long: may not be more than 1048576 bytes"
    );
    assert_eq!(server.configmap(NS, "big"), None);
    let cm = api
        .patch(
            "big",
            &publish(),
            &config("big", "ca-bundle.crt", "x".repeat(mebibyte)),
        )
        .await
        .unwrap();
    assert_eq!(data(&cm, "ca-bundle.crt").len(), mebibyte);

    let status = status_of(
        api.patch("keys", &publish(), &config("keys", "ca bundle", "x".into()))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        status.message,
        "ConfigMap \"keys\" is invalid: data[ca bundle]: Invalid value: \"ca bundle\": a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"
    );
}

#[tokio::test]
async fn a_merge_patch_is_an_update_by_its_field_manager() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    api.patch(
        "bundle",
        &publish(),
        &apply(bundle_config("bundle", "PEM-1")),
    )
    .await
    .unwrap();
    let editor = PatchParams {
        field_manager: Some("kubectl-edit".into()),
        ..PatchParams::default()
    };
    let edit = Patch::Merge(json!({"data": {"ca-bundle.crt": "EDITED"}}));
    let cm = api.patch("bundle", &editor, &edit).await.unwrap();
    assert_eq!(data(&cm, "ca-bundle.crt"), "EDITED");
    assert_eq!(
        managers(&cm),
        [owner(PUBLISHER, "Apply"), owner("kubectl-edit", "Update")]
    );
    let fields = &cm.metadata.managed_fields.as_ref().unwrap()[1].fields_v1;
    assert_eq!(
        fields.as_ref().map(|f| &f.0),
        Some(&json!({"f:data": {"f:ca-bundle.crt": {}}}))
    );
    // The same patch again changes nothing.
    let again = api.patch("bundle", &editor, &edit).await.unwrap();
    assert_eq!(
        again.metadata.resource_version,
        cm.metadata.resource_version
    );
    // Only an apply creates: a merge patch of a missing object is a 404.
    let status = status_of(api.patch("missing", &editor, &edit).await.unwrap_err());
    assert_eq!(
        (status.code, status.message.as_str()),
        (404, "configmaps \"missing\" not found")
    );
}

#[tokio::test]
async fn writes_can_be_failed_or_held_apart_from_reads() {
    let server = ApiServer::start();
    let api = configmaps(&server).await;
    let config = |bundle: &str| apply(bundle_config("bundle", bundle));
    api.patch("bundle", &publish(), &config("PEM-1"))
        .await
        .unwrap();
    let rv = server.resource_version();

    server.fail_next_on(Target::Write, 1, Fault::Status(500));
    assert!(api.get("bundle").await.is_ok(), "a read passes");
    let status = status_of(
        api.patch("bundle", &publish(), &config("PEM-2"))
            .await
            .unwrap_err(),
    );
    assert_eq!(status.code, 500);
    assert_eq!(
        server.resource_version(),
        rv,
        "the failed write was not carried out"
    );

    server.hang(HangMode::Writes);
    let held = tokio::spawn({
        let api = api.clone();
        async move { api.patch("bundle", &publish(), &config("PEM-2")).await }
    });
    until("the held apply to arrive", || {
        server
            .requests()
            .iter()
            .filter(|r| r.method == "PATCH")
            .count()
            == 3
    })
    .await;
    assert_eq!(
        data(&api.get("bundle").await.unwrap(), "ca-bundle.crt"),
        "PEM-1"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!held.is_finished(), "a hung server answers no write");
    server.unhang();
    let cm = held.await.unwrap().unwrap();
    assert_eq!(data(&cm, "ca-bundle.crt"), "PEM-2");
    let sent = server
        .requests()
        .into_iter()
        .rfind(|r| r.method == "PATCH")
        .unwrap();
    assert_eq!(sent.param("fieldManager").as_deref(), Some(PUBLISHER));
    assert_eq!(sent.body_json().unwrap()["data"]["ca-bundle.crt"], "PEM-2");
}

// ---------------------------------------------------------------------------------------------
// Authentication and the serving certificate
// ---------------------------------------------------------------------------------------------

/// A client of `server` that trusts only `ca_pem` and presents `certificate` and/or `token`,
/// without kube-rs's retries (every answer shows). Each call has its own TLS configuration, so
/// no TLS session of another client is resumed.
async fn client_with(
    server: &ApiServer,
    ca_pem: &str,
    certificate: Option<&ClientCertificate>,
    token: Option<&str>,
) -> kube::Client {
    use base64::Engine as _;
    let b64 = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
    let mut user = json!({});
    if let Some(c) = certificate {
        user["client-certificate-data"] = json!(b64(&c.cert_pem));
        user["client-key-data"] = json!(b64(&c.key_pem));
    }
    if let Some(token) = token {
        user["token"] = json!(token);
    }
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fixture", "cluster": {
            "server": server.url(),
            "certificate-authority-data": b64(ca_pem),
        }}],
        "users": [{"name": "test", "user": user}],
        "contexts": [{"name": "fixture", "context": {"cluster": "fixture", "user": "test"}}],
        "current-context": "fixture",
    });
    let kubeconfig = Kubeconfig::from_yaml(&kubeconfig.to_string()).expect("kubeconfig");
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("kube config");
    config.default_retry = false;
    kube::Client::try_from(config).expect("kube client")
}

fn last_request(server: &ApiServer) -> apiserver::Request {
    server.requests().pop().expect("a request")
}

/// The hex SHA-256 of a PEM certificate's DER.
fn sha256_of(cert_pem: &str) -> String {
    use sha2::Digest as _;
    let der = pem::parse(cert_pem).expect("PEM certificate");
    hex::encode(sha2::Sha256::digest(der.contents()))
}

/// Sleeps until `at` has passed by `margin`.
async fn sleep_past(at: SystemTime, margin: Duration) {
    let left = at.duration_since(SystemTime::now()).unwrap_or_default();
    tokio::time::sleep(left + margin).await;
}

/// A failure before any HTTP answer (the TLS handshake), as a string.
fn transport_error(result: kube::Result<impl std::fmt::Debug>) -> String {
    match result {
        Err(kube::Error::Api(status)) => panic!("expected no HTTP answer, got {status:?}"),
        Err(other) => format!("{other:?}"),
        Ok(answer) => panic!("expected a failed handshake, got {answer:?}"),
    }
}

#[tokio::test]
async fn a_valid_client_certificate_authenticates_as_its_common_name() {
    let server = ApiServer::start();
    server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let cert = server.issue_client_certificate(
        "system:node:cert-node",
        &["system:nodes", "fixture:extra"],
        Duration::from_secs(600),
    );
    let client = client_with(&server, &server.ca_pem(), Some(&cert), None).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NS);

    let list = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    let sent = last_request(&server);
    assert_eq!(sent.user, "system:node:cert-node");
    assert_eq!(
        sent.groups,
        ["system:nodes", "fixture:extra", "system:authenticated"]
    );
    assert_eq!(
        sent.client_certificate_sha256,
        Some(sha256_of(&cert.cert_pem))
    );
    assert_eq!(sent.auth_error, None);

    // Authorization is decided for that user, and a denial names it.
    server.restrict_to(vec![]);
    let status = status_of(api.get("x").await.unwrap_err());
    assert_eq!(
        status.message,
        "configmaps \"x\" is forbidden: User \"system:node:cert-node\" cannot get resource \"configmaps\" in API group \"\" in the namespace \"openshift-config\""
    );
}

#[tokio::test]
async fn a_certificate_is_verified_on_every_request_not_once_per_connection() {
    let server = ApiServer::start();
    let cert = server.issue_client_certificate(
        "system:node:short-lived",
        &["system:nodes"],
        Duration::from_secs(2),
    );
    let lasts = cert.not_after.duration_since(SystemTime::now()).unwrap();
    assert!(
        lasts >= Duration::from_millis(1900) && lasts <= Duration::from_secs(3),
        "not_after {lasts:?} from now"
    );
    let client = client_with(&server, &server.ca_pem(), Some(&cert), None).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NS);

    api.list(&ListParams::default()).await.unwrap();
    let before = last_request(&server);
    assert_eq!(before.user, "system:node:short-lived");

    sleep_past(cert.not_after, Duration::from_millis(300)).await;
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(&err), (401, "Unauthorized".into()));
    let after = last_request(&server);
    assert_eq!(
        after.connection, before.connection,
        "both requests came on one kept-alive connection"
    );
    assert_eq!(after.user, "");
    assert_eq!(
        after.client_certificate_sha256,
        before.client_certificate_sha256
    );
    let why = after.auth_error.unwrap();
    assert!(
        why.contains("x509: certificate has expired or is not yet valid: current time"),
        "{why}"
    );
}

#[tokio::test]
async fn a_certificate_from_an_unknown_ca_is_unauthorized() {
    let server = ApiServer::start();
    let cert = server.issue_client_certificate_by_unknown_ca(
        "system:node:cert-node",
        &["system:nodes"],
        Duration::from_secs(600),
    );
    let client = client_with(&server, &server.ca_pem(), Some(&cert), None).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NS);

    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(&err), (401, "Unauthorized".into()));
    let sent = last_request(&server);
    assert_eq!(sent.user, "");
    assert_eq!(
        sent.client_certificate_sha256,
        Some(sha256_of(&cert.cert_pem))
    );
    let why = sent.auth_error.unwrap();
    assert!(
        why.contains("x509: certificate signed by unknown authority"),
        "{why}"
    );

    // Presenting nothing at all is anonymous (403), not a failure (401).
    let client = client_with(&server, &server.ca_pem(), None, None).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NS);
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(&err), (403, "Forbidden".into()));
    assert_eq!(last_request(&server).user, "system:anonymous");
}

#[tokio::test]
async fn an_expired_certificate_with_a_valid_token_is_the_tokens_user() {
    let server = ApiServer::start();
    let expired =
        server.issue_client_certificate("system:node:old", &["system:nodes"], Duration::ZERO);
    sleep_past(expired.not_after, Duration::from_millis(100)).await;

    // Alone, the expired certificate is a failure.
    let client = client_with(&server, &server.ca_pem(), Some(&expired), None).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NS);
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(&err), (401, "Unauthorized".into()));

    // With the token, the union goes on to the token authenticator, which decides.
    let token = server.token();
    let client = client_with(&server, &server.ca_pem(), Some(&expired), Some(&token)).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NS);
    api.list(&ListParams::default()).await.unwrap();
    let sent = last_request(&server);
    assert_eq!(sent.user, "system:node:fixture-node");
    assert_eq!(
        sent.client_certificate_sha256,
        Some(sha256_of(&expired.cert_pem))
    );

    // A valid certificate comes first in the union: it wins over the token.
    let valid = server.issue_client_certificate(
        "system:node:new",
        &["system:nodes"],
        Duration::from_secs(600),
    );
    let client = client_with(&server, &server.ca_pem(), Some(&valid), Some(&token)).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NS);
    api.list(&ListParams::default()).await.unwrap();
    assert_eq!(last_request(&server).user, "system:node:new");
}

#[tokio::test]
async fn a_rotated_token_replaces_the_old_one() {
    let server = ApiServer::start();
    let old = server.token();
    let api = configmaps(&server).await;
    api.list(&ListParams::default()).await.unwrap();

    let new = server.rotate_token();
    assert_ne!(new, old);
    assert_eq!(server.token(), new);
    // The old token fails on the connection it already had open.
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(&err), (401, "Unauthorized".into()));
    assert_eq!(
        last_request(&server).auth_error.as_deref(),
        Some("invalid bearer token")
    );

    let client = client_with(&server, &server.ca_pem(), None, Some(&new)).await;
    let api: Api<ConfigMap> = Api::namespaced(client, NS);
    api.list(&ListParams::default()).await.unwrap();
    assert_eq!(last_request(&server).user, "system:node:fixture-node");
}

#[tokio::test]
async fn a_switched_serving_ca_is_what_new_handshakes_present() {
    let server = ApiServer::start();
    let old_ca = server.ca_pem();
    let token = server.token();
    let kept =
        Api::<ConfigMap>::namespaced(client_with(&server, &old_ca, None, Some(&token)).await, NS);
    kept.list(&ListParams::default()).await.unwrap();
    let kept_connection = last_request(&server).connection;

    // The next CA is published before it is used.
    let new_ca = server.next_serving_ca();
    assert_ne!(new_ca, old_ca);
    assert_eq!(server.next_serving_ca(), new_ca, "made once");
    assert_eq!(server.ca_pem(), old_ca);
    let early = client_with(&server, &new_ca, None, Some(&token)).await;
    transport_error(
        Api::<ConfigMap>::namespaced(early, NS)
            .list(&ListParams::default())
            .await,
    );

    server.switch_serving_ca();
    assert_eq!(server.ca_pem(), new_ca);
    // An open connection keeps the certificate it was handed.
    kept.list(&ListParams::default()).await.unwrap();
    assert_eq!(last_request(&server).connection, kept_connection);

    // A new connection gets the new certificate: only a client trusting the new CA takes it.
    let received = server.requests().len();
    let stale = client_with(&server, &old_ca, None, Some(&token)).await;
    let err = transport_error(
        Api::<ConfigMap>::namespaced(stale, NS)
            .list(&ListParams::default())
            .await,
    );
    assert!(err.contains("InvalidCertificate"), "{err}");
    assert_eq!(server.requests().len(), received, "no request got through");
    let fresh = client_with(&server, &new_ca, None, Some(&token)).await;
    Api::<ConfigMap>::namespaced(fresh, NS)
        .list(&ListParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_restart_forgets_tls_sessions_so_the_switched_certificate_shows() {
    let server = ApiServer::start();
    let old_ca = server.ca_pem();
    let token = server.token();
    // This client holds a TLS session from its first handshake, which it offers to resume.
    let api =
        Api::<ConfigMap>::namespaced(client_with(&server, &old_ca, None, Some(&token)).await, NS);
    api.list(&ListParams::default()).await.unwrap();

    server.switch_serving_ca();
    server.restart();
    let err = transport_error(api.list(&ListParams::default()).await);
    assert!(err.contains("InvalidCertificate"), "{err}");
}

/// `openssl` run on `cert_pem` (written to a file) with `args` before the file name.
fn openssl_on(cert_pem: &str, args: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("client.crt");
    std::fs::write(&cert, cert_pem).unwrap();
    std::process::Command::new("openssl")
        .args(args)
        .arg(&cert)
        .output()
        .expect("openssl is installed")
}

#[test]
fn issued_client_certificates_check_out_with_openssl() {
    let server = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let client_ca = dir.path().join("client-ca.crt");
    std::fs::write(&client_ca, server.client_ca_pem()).unwrap();
    let ca = client_ca.to_str().unwrap();
    let cert = server.issue_client_certificate(
        "system:node:cert-node",
        &["system:nodes", "fixture:extra"],
        Duration::from_secs(600),
    );

    let verify = ["verify", "-purpose", "sslclient", "-CAfile", ca];
    let out = openssl_on(&cert.cert_pem, &verify);
    assert!(out.status.success(), "{out:?}");
    let subject = openssl_on(
        &cert.cert_pem,
        &["x509", "-noout", "-subject", "-nameopt", "RFC2253", "-in"],
    );
    assert_eq!(
        String::from_utf8_lossy(&subject.stdout).trim(),
        "subject=CN=system:node:cert-node,O=fixture:extra,O=system:nodes"
    );
    let foreign = server.issue_client_certificate_by_unknown_ca(
        "system:node:cert-node",
        &["system:nodes"],
        Duration::from_secs(600),
    );
    assert!(!openssl_on(&foreign.cert_pem, &verify).status.success());
    assert_ne!(server.client_ca_pem(), server.ca_pem(), "two CAs");
}

/// GETs `path` with `client` (no retries of its own) and returns the status, the headers and
/// the body as text.
async fn get_raw(client: &kube::Client, path: &str) -> (u16, hyper::HeaderMap, String) {
    let req = hyper::Request::get(path)
        .body(kube::client::Body::empty())
        .unwrap();
    let resp = client.send(req).await.unwrap();
    let (code, headers) = (resp.status().as_u16(), resp.headers().clone());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (code, headers, String::from_utf8_lossy(&body).into_owned())
}

/// What the max-in-flight and APF filters send: 429, Retry-After, http.Error's plain text.
fn assert_shed(answer: &(u16, hyper::HeaderMap, String), retry_after: &str) {
    let (code, headers, body) = answer;
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    assert_eq!(*code, 429, "{body}");
    assert_eq!(header("retry-after"), Some(retry_after));
    assert_eq!(header("content-type"), Some("text/plain; charset=utf-8"));
    assert_eq!(header("x-content-type-options"), Some("nosniff"));
    assert_eq!(body, "Too many requests, please try again later.\n");
}

#[tokio::test]
async fn too_many_requests_is_plain_text_with_retry_after_and_a_429_status_in_a_watch() {
    let server = ApiServer::start();
    let rv = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let client = client_without_retries(&server).await;
    let list = format!("{CM_PATH}?fieldSelector=metadata.name%3Dx");
    let watch = format!("{list}&watch=true&resourceVersion={rv}&timeoutSeconds=30");

    server.fail_next_on(Target::List, 1, Fault::TooManyRequests { retry_after: 7 });
    assert_shed(&get_raw(&client, &list).await, "7");
    assert_eq!(get_raw(&client, &list).await.0, 200, "only the next list");
    // Under APF watches are shed at the door like any request.
    server.fail_next_on(Target::Watch, 1, Fault::TooManyRequests { retry_after: 3 });
    assert_shed(&get_raw(&client, &watch).await, "3");
    // kube-rs reads the plain text as a 429 whose message is the body.
    server.fail_next_on(Target::Any, 1, Fault::TooManyRequests { retry_after: 1 });
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    match api.get("x").await.unwrap_err() {
        kube::Error::Api(status) => assert_eq!(status.code, 429),
        other => panic!("expected a 429, got {other:?}"),
    }

    // In an open watch: an ERROR event with a TooManyRequests Status, then the end.
    let wp = WatchParams::default().fields("metadata.name=x").timeout(30);
    let mut w = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();
    until("the watch", || server.open_watches() == 1).await;
    server.break_watches(Fault::TooManyRequests { retry_after: 5 });
    match next(&mut w).await.unwrap() {
        WatchEvent::Error(status) => {
            assert_eq!(
                (status.code, status.reason.as_str()),
                (429, "TooManyRequests")
            );
            assert_eq!(status.details.map(|d| d.retry_after_seconds), Some(5));
        }
        other => panic!("expected an ERROR event, got {other:?}"),
    }
    assert!(next_or_end(&mut w).await.is_none(), "the stream ends");
}

/// The next item of a stream, or None at its end, failing the test after `WAIT`.
async fn next_or_end<S: Stream + Unpin>(stream: &mut S) -> Option<S::Item> {
    tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("timed out waiting for the stream")
}

#[tokio::test]
async fn a_spell_of_shed_load_answers_every_request_until_it_ends() {
    let server = ApiServer::start();
    let rv = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let client = client_without_retries(&server).await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let wp = WatchParams::default().fields("metadata.name=x").timeout(30);
    let mut open = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();
    until("the watch", || server.open_watches() == 1).await;
    server.fail_next_on(Target::List, 1, Fault::Status(500));

    server.shed(Some(Fault::TooManyRequests { retry_after: 4 }));
    let watch = format!("{CM_PATH}?watch=true&resourceVersion={rv}");
    for path in [
        "/version",
        "/api/v1",
        CM_PATH,
        &watch,
        &format!("{CM_PATH}/x"),
    ] {
        assert_shed(&get_raw(&client, path).await, "4");
    }
    // Load is shed at the door: the watch already open still gets its events.
    server.put_configmap(NS, "x", &[("ca.crt", "two")], &[]);
    assert!(matches!(
        next(&mut open).await.unwrap(),
        WatchEvent::Modified(_)
    ));

    // A proxy with no healthy apiserver behind it: 503 to everything.
    server.shed(Some(Fault::Status(503)));
    assert_eq!(api_code(&api.get("x").await.unwrap_err()).0, 503);
    assert_eq!(get_raw(&client, "/version").await.0, 503);

    // Served again; the fault armed before the spell is still there for the next list.
    server.shed(None);
    assert!(api.get("x").await.is_ok());
    assert_eq!(
        api_code(&api.list(&ListParams::default()).await.unwrap_err()).0,
        500
    );
    assert!(api.list(&ListParams::default()).await.is_ok());
}

#[tokio::test]
async fn after_a_restart_every_resource_version_seen_is_too_old_to_watch_from() {
    let server = ApiServer::start();
    server.set_bookmark_interval(Duration::from_secs(3600));
    server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api = configmaps(&server).await;
    let lp = ListParams::default().fields("metadata.name=x");
    let wp = WatchParams::default().fields("metadata.name=x").timeout(30);
    // The newest resourceVersion there is: nothing changed after it.
    let seen = api
        .list(&lp)
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    assert_eq!(seen, server.resource_version().to_string());

    for restart in [ApiServer::restart, ApiServer::rolling_restart] {
        restart(&server);
        let mut w = api.watch(&wp, &seen).await.unwrap().boxed();
        match next(&mut w).await.unwrap() {
            WatchEvent::Error(status) => {
                assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            }
            other => panic!("expected a 410 ERROR event, got {other:?}"),
        }
    }
    // What a list after the restart answers is new enough to watch from.
    let listed = api
        .list(&lp)
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    assert!(listed.parse::<u64>().unwrap() > seen.parse::<u64>().unwrap());
    let mut w = api.watch(&wp, &listed).await.unwrap().boxed();
    server.put_configmap(NS, "x", &[("ca.crt", "two")], &[]);
    assert!(matches!(
        next(&mut w).await.unwrap(),
        WatchEvent::Modified(_)
    ));
}

#[tokio::test]
async fn a_rolling_restart_cuts_every_connection_and_answers_at_once() {
    let server = ApiServer::start();
    let rv = server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    let api: Api<ConfigMap> = Api::namespaced(client_without_retries(&server).await, NS);
    let wp = WatchParams::default().fields("metadata.name=x").timeout(30);
    let mut first = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();
    let mut second = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();
    until("the watches", || server.open_watches() == 2).await;
    let before = server.requests().len();

    server.rolling_restart();
    assert_eq!(server.open_watches(), 0);
    // Cut, not ended: no clean end of the chunked stream, so kube-rs sees an error or EOF.
    for w in [&mut first, &mut second] {
        if let Some(item) = next_or_end(w).await {
            assert!(item.is_err(), "a cut stream brings no event: {item:?}");
        }
    }
    // No gap: the very next request, with no retry, is answered, on a new connection.
    api.get("x").await.unwrap();
    let requests = server.requests();
    let (old, new) = (&requests[before - 1], &requests[before]);
    assert!(new.connection > old.connection, "a new connection");
    // And the resumed watch learns that the new instance's watch cache began later.
    let mut w = api.watch(&wp, &rv.to_string()).await.unwrap().boxed();
    match next(&mut w).await.unwrap() {
        WatchEvent::Error(status) => assert_eq!(status.code, 410),
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
}

#[tokio::test]
async fn each_kubeconfig_for_a_node_authenticates_as_that_node() {
    let server = ApiServer::start();
    server.put_configmap(NS, "x", &[("ca.crt", "one")], &[]);
    for node in ["system:node:fleet-000", "system:node:fleet-001"] {
        let api: Api<ConfigMap> =
            Api::namespaced(client_from(&server.kubeconfig_for(node)).await, NS);
        api.get("x").await.unwrap();
        let request = last_request(&server);
        assert_eq!(request.user, node);
        assert_eq!(
            request.groups,
            ["system:nodes", "system:authenticated"].map(String::from)
        );
    }
    // The fixture user's token rotating leaves the nodes' alone.
    let node = server.kubeconfig_for("system:node:fleet-002");
    server.rotate_token();
    let api: Api<ConfigMap> = Api::namespaced(client_from(&node).await, NS);
    api.get("x").await.unwrap();
    assert_eq!(last_request(&server).user, "system:node:fleet-002");
}
