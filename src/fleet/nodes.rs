//! The Nodes as the cluster side follows them (SPEC 8c): their metadata only (name,
//! deletionTimestamp and the `kubelet-ca-agent/held` annotation), listed once and then
//! watched, under the same rules as a source's watch (SPEC 6), decided by the same state
//! machine ([`crate::follow::lifecycle::Watch`]): `410 Gone` lists again at once, an
//! unreachable server is asked again within 5 s, an answered failure backs off up to 30 s
//! honouring `Retry-After`, and after a lost connection the Nodes are listed again, never
//! resumed (a store restored from a backup is behind), a resourceVersion that went back
//! logged as such.
//!
//! Memory: a metadata list and watch (`PartialObjectMetadata`), and of each Node only what
//! the verdict takes; an annotation over [`held::MAX_BYTES`] is not kept, only its size.
//!
//! Readiness is not in a Node's metadata (its Ready condition is in its status, its
//! unreachable taint in its spec), and a watch of whole Nodes would cost a thousand-node
//! fleet its full objects on every status update. So the watch, which `rollout wait` and
//! `publish` keep, is of metadata alone, and `rollout status` (and `wait` when it prints its
//! laggards) reads readiness once with [`readiness`]: one list of Nodes as a server-side
//! Table (`as=Table`, no objects), its Status column only.

use std::collections::BTreeMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node as KubeNode;
use kube::Client;
use kube::api::{Api, ListParams, ObjectList, PartialObjectMeta, WatchEvent, WatchParams};
use tokio::sync::watch;

use super::held;
use super::verdict::{self, Ready, Report};
use crate::credentials::Credentials;
use crate::follow::lifecycle::Failure;
use crate::follow::{self, Change, Events, Followed, Listed, PAGE, Problem, Selection};

/// What is kept of one Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMeta {
    /// It has a deletionTimestamp.
    pub deleting: bool,
    /// Its report, read once when its annotation changed.
    pub report: Arc<Report>,
    /// A digest of the annotation as last read, so that an update that leaves it as it
    /// was (a status update, a label) is not read again.
    digest: u64,
}

impl NodeMeta {
    /// What is kept of a Node whose annotation is `raw`.
    pub fn of(deleting: bool, raw: Option<&str>) -> NodeMeta {
        NodeMeta {
            deleting,
            report: Arc::new(Report::read(raw)),
            digest: digest(raw),
        }
    }
}

fn digest(raw: Option<&str>) -> u64 {
    let mut hasher = DefaultHasher::new();
    raw.hash(&mut hasher);
    hasher.finish()
}

/// The Nodes as last known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fleet {
    /// By name.
    pub nodes: BTreeMap<String, NodeMeta>,
    /// Whether a list has been read: before that, the fleet is not known.
    pub listed: bool,
    /// Why the Nodes cannot be followed now (the last request failed), when that is so.
    pub problem: Option<Problem>,
}

impl Fleet {
    /// The fleet as a list read it.
    pub fn listed(items: Vec<PartialObjectMeta<KubeNode>>) -> Fleet {
        let mut fleet = Fleet {
            listed: true,
            ..Fleet::default()
        };
        for item in items {
            if let Some((name, meta)) = kept(&item) {
                fleet.nodes.insert(name, meta);
            }
        }
        fleet
    }

    /// Takes an item of the watch: whether what is kept changed.
    pub fn apply(&mut self, event: &WatchEvent<PartialObjectMeta<KubeNode>>) -> bool {
        match event {
            WatchEvent::Added(item) | WatchEvent::Modified(item) => {
                let Some(name) = item.metadata.name.as_deref() else {
                    return false;
                };
                let deleting = item.metadata.deletion_timestamp.is_some();
                let raw = annotation(item);
                match self.nodes.get(name) {
                    Some(old) if old.deleting == deleting && old.digest == digest(raw) => false,
                    _ => {
                        self.nodes
                            .insert(name.to_string(), NodeMeta::of(deleting, raw));
                        true
                    }
                }
            }
            WatchEvent::Deleted(item) => item
                .metadata
                .name
                .as_deref()
                .is_some_and(|name| self.nodes.remove(name).is_some()),
            WatchEvent::Bookmark(_) | WatchEvent::Error(_) => false,
        }
    }

    /// The nodes as the verdict takes them, each with its readiness when it was read
    /// (`ready`; a node the table did not show is Unknown).
    pub fn for_verdict<'a>(
        &'a self,
        ready: Option<&'a BTreeMap<String, Ready>>,
    ) -> impl Iterator<Item = verdict::Node<'a>> + 'a {
        self.nodes.iter().map(move |(name, meta)| verdict::Node {
            name,
            ready: ready.map(|r| r.get(name).copied().unwrap_or(Ready::Unknown)),
            deleting: meta.deleting,
            report: &meta.report,
        })
    }
}

/// The agent's annotation of a Node, when it has one.
fn annotation(item: &PartialObjectMeta<KubeNode>) -> Option<&str> {
    item.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(held::ANNOTATION))
        .map(String::as_str)
}

fn kept(item: &PartialObjectMeta<KubeNode>) -> Option<(String, NodeMeta)> {
    let name = item.metadata.name.clone()?;
    let deleting = item.metadata.deletion_timestamp.is_some();
    Some((name, NodeMeta::of(deleting, annotation(item))))
}

/// What went wrong with a request about the Nodes, RBAC named when it is the cause.
fn about_nodes(problem: Problem) -> Problem {
    match problem.reason {
        "forbidden" => Problem::new(
            problem.reason,
            format!(
                "{} (reading the Nodes needs get, list and watch on nodes)",
                problem.text
            ),
            problem.failure,
        ),
        _ => problem,
    }
}

/// Lists the Nodes' metadata (every page), with `selector` as a label selector: the fleet
/// and the list's resourceVersion.
pub async fn list(
    client: &kube::Client,
    server: &str,
    selector: Option<&str>,
) -> Result<(Fleet, String), Problem> {
    let api: Api<KubeNode> = Api::all(client.clone());
    let params = selection(selector).list_params();
    let page = |params: ListParams| {
        let api = api.clone();
        async move { api.list_metadata(&params).await }
    };
    let (items, rv) = follow::list_pages(server, &params, page)
        .await
        .map_err(about_nodes)?;
    Ok((Fleet::listed(items), rv.unwrap_or_default()))
}

fn selection(selector: Option<&str>) -> Selection {
    Selection {
        fields: None,
        labels: selector.map(str::to_string),
    }
}

/// The Ready condition of each Node, read once from a server-side Table of the Nodes (its
/// Status column: `Ready`, `NotReady` or `Unknown`, with `,SchedulingDisabled` when
/// cordoned), so that no Node's status is transferred whole.
pub async fn readiness(
    client: &kube::Client,
    server: &str,
    selector: Option<&str>,
) -> Result<BTreeMap<String, Ready>, Problem> {
    let mut ready = BTreeMap::new();
    let mut token: Option<String> = None;
    loop {
        let mut query = format!("limit={PAGE}");
        if let Some(selector) = selector {
            query.push_str(&format!("&labelSelector={}", encode(selector)));
        }
        if let Some(token) = &token {
            query.push_str(&format!("&continue={}", encode(token)));
        }
        let request = http::Request::get(format!("/api/v1/nodes?{query}"))
            .header(
                http::header::ACCEPT,
                "application/json;as=Table;g=meta.k8s.io;v=v1",
            )
            .body(Vec::new())
            .expect("a valid request");
        let text = follow::within(server, "list", client.request_text(request))
            .await
            .map_err(about_nodes)?;
        let table: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            Problem::new(
                "api_error",
                format!("{server}: the Nodes' table is not JSON: {e}"),
                Failure::ANSWERED,
            )
        })?;
        token = table_readiness(&table, &mut ready).map_err(|why| {
            Problem::new("api_error", format!("{server}: {why}"), Failure::ANSWERED)
        })?;
        if token.is_none() {
            return Ok(ready);
        }
    }
}

/// Reads one page of the Nodes' Table into `ready`; the continue token of the next page.
fn table_readiness(
    table: &serde_json::Value,
    ready: &mut BTreeMap<String, Ready>,
) -> Result<Option<String>, String> {
    let columns = table["columnDefinitions"]
        .as_array()
        .ok_or("the Nodes' table has no columns")?;
    let at = |wanted: &str| {
        columns
            .iter()
            .position(|c| c["name"].as_str() == Some(wanted))
            .ok_or(format!("the Nodes' table has no {wanted} column"))
    };
    let (name_at, status_at) = (at("Name")?, at("Status")?);
    for row in table["rows"].as_array().into_iter().flatten() {
        let cells = &row["cells"];
        let Some(name) = cells[name_at].as_str() else {
            continue;
        };
        let status = cells[status_at].as_str().unwrap_or_default();
        ready.insert(name.to_string(), ready_of(status));
    }
    Ok(table["metadata"]["continue"]
        .as_str()
        .filter(|c| !c.is_empty())
        .map(str::to_string))
}

/// A Status cell of the Nodes' table (`Ready,SchedulingDisabled`) as a Ready condition.
fn ready_of(status: &str) -> Ready {
    match status.split(',').next().unwrap_or_default() {
        "Ready" => Ready::True,
        "NotReady" => Ready::False,
        _ => Ready::Unknown,
    }
}

/// Percent-encodes a query value (label selectors hold `=`, `!`, `,`, parentheses).
fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Follows the Nodes (with `selector` as a label selector) for as long as the task runs,
/// each change of what is kept sent on `fleet`. A failure is told there too (the last known
/// Nodes stay, with the problem), and its end.
pub async fn follow(
    credentials: Credentials,
    selector: Option<String>,
    fleet: watch::Sender<Arc<Fleet>>,
) {
    let nodes = Nodes {
        selector,
        fleet,
        said_down: false,
    };
    follow::follow(credentials, nodes).await;
}

/// The follower's part for the Nodes.
struct Nodes {
    selector: Option<String>,
    fleet: watch::Sender<Arc<Fleet>>,
    /// Whether the failure was said in the log: once a spell.
    said_down: bool,
}

impl Nodes {
    fn set_problem(&self, problem: Option<Problem>) {
        self.fleet.send_if_modified(|f| {
            if f.problem == problem {
                return false;
            }
            Arc::make_mut(f).problem = problem.clone();
            true
        });
    }
}

impl Followed for Nodes {
    type K = PartialObjectMeta<KubeNode>;

    fn name(&self) -> &str {
        "the Nodes"
    }

    fn selection(&self) -> Selection {
        selection(self.selector.as_deref())
    }

    async fn list(&self, client: Client, params: ListParams) -> kube::Result<ObjectList<Self::K>> {
        follow::list_metadata::<KubeNode>(client, params).await
    }

    async fn watch(
        &self,
        client: Client,
        params: WatchParams,
        rv: String,
    ) -> kube::Result<Events<Self::K>> {
        follow::watch_metadata::<KubeNode>(client, params, rv).await
    }

    fn listed(&mut self, items: Vec<Self::K>, _: Listed, _: std::time::Instant) {
        self.fleet
            .send_modify(|f| *f = Arc::new(Fleet::listed(items)));
        self.up(std::time::Instant::now());
    }

    fn changed(&mut self, change: Change<Self::K>, _: std::time::Instant) {
        let event = match change {
            Change::Applied(item) => WatchEvent::Modified(item),
            Change::Deleted(item) => WatchEvent::Deleted(item),
        };
        self.fleet
            .send_if_modified(|f| Arc::make_mut(f).apply(&event));
    }

    fn up(&mut self, _: std::time::Instant) {
        if self.said_down {
            tracing::info!("following the Nodes again");
            self.said_down = false;
        }
        self.set_problem(None);
    }

    fn down(&mut self, problem: &Problem, _: std::time::Instant) {
        let problem = about_nodes(problem.clone());
        if !self.said_down {
            tracing::warn!("cannot follow the Nodes: {}; retrying", problem.text);
            self.said_down = true;
        }
        self.set_problem(Some(problem));
    }
}

/// How long `rollout` waits for the first reading of its credentials.
pub const CREDENTIALS_FIRST_READ: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use serde_json::json;

    fn node(name: &str, annotation: Option<&str>, deleting: bool) -> PartialObjectMeta<KubeNode> {
        let annotations = annotation.map(|a| {
            [
                (held::ANNOTATION.to_string(), a.to_string()),
                ("other".to_string(), "x".repeat(100)),
            ]
            .into()
        });
        PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                annotations,
                resource_version: Some("7".into()),
                deletion_timestamp: deleting.then(|| Time(Default::default())),
                ..ObjectMeta::default()
            },
            _phantom: Default::default(),
        }
    }

    #[test]
    fn a_list_keeps_each_nodes_report_read_and_an_oversized_one_by_its_size_only() {
        let huge = "x".repeat(held::MAX_BYTES + 1);
        let fleet = Fleet::listed(vec![
            node("a", None, false),
            node("b", Some("{}"), true),
            node("c", Some(&huge), false),
        ]);
        assert!(fleet.listed);
        assert_eq!(fleet.nodes.len(), 3);
        assert_eq!(*fleet.nodes["a"].report, Report::Missing);
        assert!(fleet.nodes["b"].deleting);
        assert!(matches!(*fleet.nodes["b"].report, Report::Read(Err(_))));
        assert_eq!(
            *fleet.nodes["c"].report,
            Report::Oversized(held::MAX_BYTES + 1)
        );
        let mut nameless = node("x", None, false);
        nameless.metadata.name = None;
        assert!(Fleet::listed(vec![nameless]).nodes.is_empty());
    }

    #[test]
    fn an_event_changes_the_fleet_only_when_what_is_kept_changes() {
        let mut fleet = Fleet::listed(vec![node("a", Some("{}"), false)]);
        // A status update or a label: the same annotation, nothing to tell.
        assert!(!fleet.apply(&WatchEvent::Modified(node("a", Some("{}"), false))));
        assert!(fleet.apply(&WatchEvent::Modified(node("a", Some("{ }"), false))));
        assert!(fleet.apply(&WatchEvent::Modified(node("a", Some("{ }"), true))));
        assert!(fleet.nodes["a"].deleting);
        assert!(fleet.apply(&WatchEvent::Added(node("b", None, false))));
        assert_eq!(fleet.nodes.len(), 2);
        assert!(fleet.apply(&WatchEvent::Deleted(node("b", None, false))));
        assert!(!fleet.apply(&WatchEvent::Deleted(node("b", None, false))));
        assert_eq!(fleet.nodes.len(), 1);
        let mut nameless = node("x", None, false);
        nameless.metadata.name = None;
        assert!(!fleet.apply(&WatchEvent::Added(nameless)));
        let bookmark = serde_json::from_value(json!({
            "type": "BOOKMARK",
            "object": {"kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": "9"}}
        }))
        .unwrap();
        assert!(!fleet.apply(&bookmark));
        assert_eq!(fleet.nodes.len(), 1);
    }

    #[test]
    fn the_verdict_sees_each_node_with_its_readiness_or_unknown() {
        let fleet = Fleet::listed(vec![node("a", None, false), node("b", None, true)]);
        let ready = BTreeMap::from([("a".to_string(), Ready::False)]);
        let nodes: Vec<verdict::Node<'_>> = fleet.for_verdict(Some(&ready)).collect();
        assert_eq!(nodes.len(), 2);
        assert_eq!((nodes[0].name, nodes[0].ready), ("a", Some(Ready::False)));
        assert_eq!(
            (nodes[1].ready, nodes[1].deleting),
            (Some(Ready::Unknown), true)
        );
        assert!(fleet.for_verdict(None).all(|n| n.ready.is_none()));
    }

    #[test]
    fn readiness_comes_from_the_tables_status_column() {
        let table = json!({
            "kind": "Table",
            "columnDefinitions": [
                {"name": "Name"}, {"name": "Status"}, {"name": "Roles"}
            ],
            "rows": [
                {"cells": ["a", "Ready", "<none>"]},
                {"cells": ["b", "NotReady,SchedulingDisabled", "<none>"]},
                {"cells": ["c", "Unknown", "<none>"]},
                {"cells": [7, "Ready", "<none>"]},
            ],
            "metadata": {"continue": "next"}
        });
        let mut ready = BTreeMap::new();
        assert_eq!(
            table_readiness(&table, &mut ready),
            Ok(Some("next".to_string()))
        );
        assert_eq!(ready.len(), 3);
        assert_eq!(ready["a"], Ready::True);
        assert_eq!(ready["b"], Ready::False);
        assert_eq!(ready["c"], Ready::Unknown);
        let last = json!({"columnDefinitions": [{"name": "Name"}, {"name": "Status"}], "rows": [], "metadata": {"continue": ""}});
        assert_eq!(table_readiness(&last, &mut ready), Ok(None));
        let bad = json!({"columnDefinitions": [{"name": "Name"}]});
        assert_eq!(
            table_readiness(&bad, &mut ready),
            Err("the Nodes' table has no Status column".to_string())
        );
        assert!(table_readiness(&json!({}), &mut ready).is_err());
        assert_eq!(ready_of("Ready,SchedulingDisabled"), Ready::True);
        assert_eq!(ready_of(""), Ready::Unknown);
    }

    #[test]
    fn a_selector_is_encoded_for_the_query() {
        assert_eq!(encode("role in (a,b),!x"), "role%20in%20%28a%2Cb%29%2C%21x");
        assert_eq!(encode("a-b_c.d~e"), "a-b_c.d~e");
        let selected = selection(Some("a=b"));
        assert_eq!(
            selected.list_params().label_selector.as_deref(),
            Some("a=b")
        );
        assert_eq!(
            selected.watch_params().label_selector.as_deref(),
            Some("a=b")
        );
        assert_eq!(selection(None), Selection::default());
    }

    #[test]
    fn a_refusal_names_the_permission_needed() {
        let status = |code: u16, message: &str| {
            kube::Error::Api(
                kube::core::Status::failure(message, "Forbidden")
                    .with_code(code)
                    .boxed(),
            )
        };
        let problem = |server, e| about_nodes(Problem::of(server, &e));
        let why = problem("https://h:6443", status(403, "nodes is forbidden"));
        assert!(why.text.contains("get, list and watch on nodes"), "{why:?}");
        assert_eq!((why.failure, why.reason), (Failure::ANSWERED, "forbidden"));
        let why = problem("h", status(401, "Unauthorized"));
        assert!(!why.text.contains("get, list and watch"), "{why:?}");
        let why = problem("https://h:6443", status(410, "too old\u{1b}"));
        assert_eq!((why.failure, why.reason), (Failure::Expired, "expired"));
        assert!(why.text.starts_with("https://h:6443: HTTP 410"), "{why:?}");
        assert!(!why.text.contains('\u{1b}'));
    }

    /// A proxy's HTML error page is one bounded line in what the Nodes' follower tells
    /// (before the follower, it went uncut into the Nodes' error text).
    #[test]
    fn a_proxys_page_is_cut_to_one_line_in_the_nodes_problem() {
        let page = format!(
            "<html>\n<head><title>502 Bad Gateway</title></head>\n{}</html>",
            "<p>upstream said no</p>\n".repeat(400)
        );
        let error = kube::Error::Api(
            kube::core::Status::failure(&page, "Failed to parse error data")
                .with_code(502)
                .boxed(),
        );
        let (tx, rx) = watch::channel(Arc::new(Fleet::default()));
        let mut nodes = Nodes {
            selector: None,
            fleet: tx,
            said_down: false,
        };
        nodes.down(
            &Problem::of("https://h:6443", &error),
            std::time::Instant::now(),
        );
        let told = rx.borrow().problem.clone().unwrap();
        assert!(!told.text.contains('\n'), "{}", told.text);
        assert!(told.text.len() < 1000, "{} bytes", told.text.len());
        assert!(
            told.text.starts_with(
                "https://h:6443: HTTP 502 with a body that is not a Kubernetes Status"
            ),
            "{}",
            told.text
        );
        assert!(nodes.said_down);
        nodes.up(std::time::Instant::now());
        assert_eq!(rx.borrow().problem, None);
        assert!(!nodes.said_down);
    }

    /// The follower's part for the Nodes: what it selects, and what a list and a change do
    /// to the fleet that `rollout wait` and `publish` read.
    #[test]
    fn the_nodes_watch_keeps_the_fleet_as_lists_and_changes_say() {
        let (tx, rx) = watch::channel(Arc::new(Fleet::default()));
        let mut nodes = Nodes {
            selector: Some("pool=a".into()),
            fleet: tx,
            said_down: false,
        };
        assert_eq!(nodes.name(), "the Nodes");
        assert_eq!(nodes.selection().labels.as_deref(), Some("pool=a"));
        assert_eq!(nodes.selection().fields, None);
        let now = std::time::Instant::now();
        let why = Problem::new("api_error", "500".into(), Failure::ANSWERED);
        nodes.down(&why, now);
        nodes.listed(
            vec![node("n1", None, false), node("n2", None, false)],
            Listed::default(),
            now,
        );
        let fleet = rx.borrow().clone();
        assert!(
            fleet.listed && fleet.problem.is_none(),
            "a list is the fleet, up"
        );
        assert_eq!(fleet.nodes.keys().collect::<Vec<_>>(), ["n1", "n2"]);
        nodes.changed(Change::Applied(node("n3", None, true)), now);
        assert!(rx.borrow().nodes["n3"].deleting);
        nodes.changed(Change::Deleted(node("n1", None, false)), now);
        assert_eq!(rx.borrow().nodes.keys().collect::<Vec<_>>(), ["n2", "n3"]);
    }
}
