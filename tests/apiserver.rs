//! Self-test of the fake kube-apiserver in tests/common/apiserver.rs, driven by the real kube-rs
//! client and watcher.

#[path = "common/apiserver.rs"]
mod apiserver;

use std::time::Duration;

use apiserver::{ApiServer, Fault, HangMode, Rule, Target};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{
    Api, ApiResource, DynamicObject, ListParams, Request, VersionMatch, WatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use serde_json::Value;

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
    std::fs::write(&bad, text.replace(server.token(), "wrong-token")).unwrap();
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
