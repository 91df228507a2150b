//! The follower's pure parts: what each item of a watch tells the lifecycle and the caller,
//! and what a watch asks for.

use super::*;
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
