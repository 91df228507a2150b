//! The node's own Node, as the report keeps it (SPEC 8c): one metadata watch with a field
//! selector on its name, which the Node authorizer allows a node's own credentials. What it
//! sees (the Node's uid, the report's annotation, whether the store went back) goes to the
//! reporter, which puts its true report back whenever the annotation differs from it.

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{ListParams, ObjectList, PartialObjectMeta, WatchParams};
use tokio::sync::watch;

use super::held::{ANNOTATION, MAX_BYTES};
use crate::credentials::Credentials;
use crate::follow::{self, Change, Events, Followed, Listed, Problem, Selection};
use crate::metrics::{Metrics, ReasonLabels};

/// The Node as the watch last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSeen {
    pub uid: String,
    /// The report's annotation as it stands.
    pub annotation: Option<String>,
    /// Its resourceVersion, when it is a number (etcd's revision): a state older than the
    /// report's last write is not what the Node holds now.
    pub rv: Option<u64>,
}

/// What the watch of the node's own Node has seen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// Whether a list has answered: before that, nothing is known of the Node.
    pub listed: bool,
    /// The Node, when it exists.
    pub node: Option<NodeSeen>,
    /// The store's revision at which a list last found `node`, when no event changed it
    /// since: `node` is what the store holds as of it. A Node older than the report's last
    /// write in a store past that write has lost it (a store restored from a backup whose
    /// revisions caught up before the list).
    pub as_of: Option<u64>,
    /// How many lists have stood on a store that went back (restored from a backup).
    pub restores: u64,
    /// Why the Node cannot be followed now, when that is so.
    pub problem: Option<Problem>,
}

/// Follows the Node `name` for as long as the task runs, what it sees sent on `seen`; each
/// failure counted in `metrics` as one of the report's, and said once a spell.
pub async fn follow(
    credentials: Credentials,
    name: String,
    seen: watch::Sender<Seen>,
    metrics: Option<Arc<Metrics>>,
) {
    let own = OwnNode {
        name,
        seen,
        metrics,
        said_down: false,
    };
    follow::follow(credentials, own).await;
}

/// The follower's part for the node's own Node.
struct OwnNode {
    name: String,
    seen: watch::Sender<Seen>,
    metrics: Option<Arc<Metrics>>,
    /// Whether the failure was said in the log: once a spell.
    said_down: bool,
}

fn kept(item: &PartialObjectMeta<Node>) -> NodeSeen {
    NodeSeen {
        uid: item.metadata.uid.clone().unwrap_or_default(),
        // Another writer's annotation is kept only up to a report's bound: a larger one is
        // there, and no report (an empty value says so).
        annotation: item
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANNOTATION))
            .map(|v| {
                if v.len() > MAX_BYTES {
                    String::new()
                } else {
                    v.clone()
                }
            }),
        rv: item
            .metadata
            .resource_version
            .as_deref()
            .and_then(|rv| rv.parse().ok()),
    }
}

impl Followed for OwnNode {
    type K = PartialObjectMeta<Node>;

    fn name(&self) -> &str {
        "its own Node"
    }

    fn selection(&self) -> Selection {
        Selection::named(&self.name)
    }

    async fn list(&self, client: Client, params: ListParams) -> kube::Result<ObjectList<Self::K>> {
        follow::list_metadata::<Node>(client, params).await
    }

    async fn watch(
        &self,
        client: Client,
        params: WatchParams,
        rv: String,
    ) -> kube::Result<Events<Self::K>> {
        follow::watch_metadata::<Node>(client, params, rv).await
    }

    fn listed(&mut self, items: Vec<Self::K>, listed: Listed, _: Instant) {
        let node = items
            .iter()
            .find(|i| i.metadata.name.as_deref() == Some(&self.name));
        self.seen.send_modify(|seen| {
            seen.listed = true;
            seen.node = node.map(kept);
            seen.as_of = listed.rv;
            seen.restores += u64::from(listed.went_back);
            seen.problem = None;
        });
    }

    fn changed(&mut self, change: Change<Self::K>, _: Instant) {
        let node = match &change {
            Change::Applied(item) => Some(kept(item)),
            Change::Deleted(_) => None,
        };
        self.seen.send_if_modified(|seen| {
            let new = seen.node != node;
            if new {
                seen.as_of = None;
            }
            seen.node = node;
            new
        });
    }

    fn up(&mut self, _: Instant) {
        if self.said_down {
            tracing::info!(node = %self.name, "following its own Node again");
            self.said_down = false;
        }
        self.seen
            .send_if_modified(|seen| seen.problem.take().is_some());
    }

    fn down(&mut self, problem: &Problem, _: Instant) {
        let mut problem = problem.clone();
        if problem.reason == "forbidden" {
            problem.text = format!(
                "{} (a node may read and write only its own Node: is {} this node's name, and the credentials this node's? The DaemonSet's service account needs get, list, watch and patch on nodes)",
                problem.text,
                crate::text::escape(&self.name)
            );
        }
        if let Some(metrics) = &self.metrics {
            let reason = ReasonLabels {
                reason: problem.reason.to_string(),
            };
            metrics.node_report_errors.get_or_create(&reason).inc();
        }
        if !self.said_down {
            tracing::warn!(node = %self.name, reason = problem.reason, "cannot follow its own Node, and so cannot keep its report there: {}; retrying", problem.text);
            self.said_down = true;
        }
        let problem = &problem;
        self.seen.send_if_modified(|seen| {
            let new = seen.problem.as_ref() != Some(problem);
            seen.problem = Some(problem.clone());
            new
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn node(name: &str, uid: &str, rv: &str, annotation: Option<&str>) -> PartialObjectMeta<Node> {
        let mut item = PartialObjectMeta::<Node>::default();
        item.metadata.name = Some(name.into());
        item.metadata.uid = Some(uid.into());
        item.metadata.resource_version = Some(rv.into());
        item.metadata.annotations = annotation.map(|a| {
            BTreeMap::from([
                (ANNOTATION.to_string(), a.to_string()),
                ("other".to_string(), "x".to_string()),
            ])
        });
        item
    }

    fn at(rv: u64) -> Listed {
        Listed {
            went_back: false,
            rv: Some(rv),
        }
    }

    #[test]
    fn the_watch_keeps_the_nodes_uid_report_and_revision_and_counts_restores() {
        let (tx, mut rx) = watch::channel(Seen::default());
        let mut own = OwnNode {
            name: "n1".into(),
            seen: tx,
            metrics: None,
            said_down: false,
        };
        assert_eq!(own.selection(), Selection::named("n1"));
        assert_eq!(own.name(), "its own Node");
        let now = Instant::now();
        own.listed(vec![], Listed::default(), now);
        assert_eq!(
            *rx.borrow(),
            Seen {
                listed: true,
                ..Seen::default()
            },
            "listed, and no such Node yet"
        );
        own.listed(vec![node("n1", "u1", "6", None)], at(6), now);
        assert_eq!(rx.borrow().as_of, Some(6), "a list says as of when");
        own.changed(Change::Applied(node("n1", "u1", "6", None)), now);
        assert_eq!(
            rx.borrow().as_of,
            Some(6),
            "the same Node again changes nothing"
        );
        own.changed(Change::Applied(node("n1", "u1", "7", Some("{}"))), now);
        let held = NodeSeen {
            uid: "u1".into(),
            annotation: Some("{}".into()),
            rv: Some(7),
        };
        let seen = rx.borrow_and_update().clone();
        assert_eq!(
            (seen.node, seen.as_of),
            (Some(held.clone()), None),
            "an event is no list"
        );
        // The same again (a status update, a label): nothing new to tell.
        own.changed(Change::Applied(node("n1", "u1", "7", Some("{}"))), now);
        assert!(!rx.has_changed().unwrap());
        let why = Problem::new(
            "forbidden",
            "403".into(),
            crate::follow::lifecycle::Failure::ANSWERED,
        );
        let metrics = Arc::new(Metrics::default());
        own.metrics = Some(metrics.clone());
        own.down(&why, now);
        assert!(own.said_down, "said once a spell");
        let told = rx.borrow_and_update().problem.clone().unwrap();
        own.down(&why, now);
        assert!(
            !rx.has_changed().unwrap(),
            "the same failure again tells nothing new"
        );
        let counted = metrics
            .node_report_errors
            .get_or_create(&ReasonLabels {
                reason: "forbidden".into(),
            })
            .get();
        assert_eq!(counted, 2, "each failure counted");
        assert!(
            told.text.starts_with(
                "403 (a node may read and write only its own Node: is n1 this node's name"
            ),
            "{told}"
        );
        assert_eq!(rx.borrow().node, Some(held), "what it had stands");
        own.up(now);
        assert_eq!(rx.borrow().problem, None);
        assert!(!own.said_down);
        // A list on a store that went back is counted; one that did not is not.
        let back = Listed {
            went_back: true,
            rv: Some(3),
        };
        own.listed(vec![node("n1", "u2", "3", None)], back, now);
        own.listed(vec![node("n1", "u2", "x", None)], Listed::default(), now);
        let seen = rx.borrow().clone();
        assert_eq!(seen.restores, 1);
        assert_eq!(
            seen.node,
            Some(NodeSeen {
                uid: "u2".into(),
                annotation: None,
                rv: None
            })
        );
        // A value over a report's bound is kept as there, and empty.
        let huge = "x".repeat(MAX_BYTES + 1);
        own.changed(Change::Applied(node("n1", "u2", "8", Some(&huge))), now);
        assert_eq!(
            rx.borrow().node.as_ref().unwrap().annotation.as_deref(),
            Some("")
        );
        own.changed(Change::Deleted(node("n1", "u2", "9", None)), now);
        assert_eq!(rx.borrow().node, None);
    }
}
