//! The publisher's target: one key of a ConfigMap, what it holds as seen by a watch, the
//! server-side apply that writes it, and the (pure) decision of when to write.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use serde_json::{Value, json};

use crate::bundle::Fingerprint;
use crate::cli::ConfigMapRef;

/// The field manager of every apply: one for every replica, so that two publishers share
/// ownership of the fields and an apply of the same bundle by the second is a no-op.
pub const FIELD_MANAGER: &str = "kubelet-ca-agent-publisher";
/// The SHA-256 of the bundle in the key, as the publisher computed it.
pub const SHA256_ANNOTATION: &str = "kubelet-ca-agent.io/bundle-sha256";
/// The source specs the bundle was built from, comma-separated, in priority order.
pub const SOURCES_ANNOTATION: &str = "kubelet-ca-agent.io/sources";
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "kubelet-ca-agent";

/// The ConfigMap as a watch (or a read) last saw it, reduced to what the publisher needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// The key's bytes (from `data`, else `binaryData`); None when the key is absent.
    pub bytes: Option<Arc<[u8]>>,
    /// Their SHA-256.
    pub sha256: Option<String>,
    /// The SHA-256 annotation, when present.
    pub annotated: Option<String>,
    pub resource_version: Option<String>,
}

impl Observed {
    pub fn of(configmap: &ConfigMap, key: &str) -> Observed {
        let bytes = configmap
            .data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|v| Arc::from(v.as_bytes()))
            .or_else(|| {
                configmap
                    .binary_data
                    .as_ref()
                    .and_then(|d| d.get(key))
                    .map(|v| Arc::from(&v.0[..]))
            });
        Observed::new(
            bytes,
            configmap
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SHA256_ANNOTATION))
                .cloned(),
            configmap.metadata.resource_version.clone(),
        )
    }

    pub fn new(
        bytes: Option<Arc<[u8]>>,
        annotated: Option<String>,
        resource_version: Option<String>,
    ) -> Observed {
        Observed {
            sha256: bytes.as_deref().map(|b| Fingerprint::of(b).to_hex()),
            bytes,
            annotated,
            resource_version,
        }
    }

    /// The key holds exactly the bundle whose SHA-256 is `sha256`, and says so.
    pub fn holds(&self, sha256: &str) -> bool {
        self.annotated.as_deref() == Some(sha256) && self.sha256.as_deref() == Some(sha256)
    }

    /// What is wrong with the object as a publisher's output, if anything: the key missing,
    /// or content that its annotation does not describe (edited by hand, or by another
    /// writer). A consistent object holding another bundle is not broken: it is another
    /// replica's (or an earlier) publication.
    pub fn damage(&self) -> Option<String> {
        match (&self.bytes, &self.annotated) {
            (None, _) => Some("the key is missing".to_string()),
            (Some(_), None) => Some(format!("the {SHA256_ANNOTATION} annotation is missing")),
            (Some(_), Some(annotated)) if self.sha256.as_ref() != Some(annotated) => Some(format!(
                "the content does not match its {SHA256_ANNOTATION} annotation (changed by another writer)"
            )),
            _ => None,
        }
    }
}

/// The target as the loop knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Not seen yet.
    Unknown,
    /// It does not exist.
    Missing,
    Present(Observed),
}

/// What the loop should do about the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing: in sync, or nothing to publish yet, or another publisher's bundle stands.
    Wait,
    /// Apply the bundle: it changed since this publisher last published (or it never has).
    Publish,
    /// Apply the bundle: the ConfigMap was deleted or damaged.
    Repair,
}

/// When to write. The publisher applies its bundle when the bundle changes, and repairs a
/// ConfigMap that is gone or damaged; it does not overwrite a consistent ConfigMap that
/// holds another bundle, since that is the output of another replica whose sources are a
/// moment ahead of (or behind) these, and taking it back would make two replicas undo each
/// other's writes during a rotation. Both converge on the next change they see.
///
/// `published`: the SHA-256 of the last bundle this publisher applied, or found published.
/// `watch_down`: the target's watch failed, so `seen` may be stale.
pub fn decide(
    desired: Option<&str>,
    published: Option<&str>,
    seen: &Seen,
    watch_down: bool,
) -> Step {
    let Some(desired) = desired else {
        return Step::Wait;
    };
    if let Seen::Present(observed) = seen
        && observed.holds(desired)
    {
        return Step::Wait;
    }
    match seen {
        // Until the first look at the ConfigMap, unless that look fails: then publish
        // blindly (an apply of what is already there changes nothing).
        Seen::Unknown if !watch_down => Step::Wait,
        _ if published != Some(desired) => Step::Publish,
        Seen::Missing => Step::Repair,
        Seen::Present(observed) if observed.damage().is_some() => Step::Repair,
        _ => Step::Wait,
    }
}

/// The apply configuration: the key, the annotations and the label; nothing else, so that
/// the publisher owns only these fields and leaves any other key or annotation alone.
///
/// `resource_version`, the version the decision was made on, is a precondition: if the
/// ConfigMap changed since (another replica wrote first), the API server answers 409 and
/// the publisher looks again, rather than overwriting a state it has not seen.
pub fn apply_body(
    to: &ConfigMapRef,
    rendered: &[u8],
    sha256: &str,
    sources: &str,
    resource_version: Option<&str>,
) -> Value {
    let data: BTreeMap<&str, String> = [(
        to.key.as_str(),
        String::from_utf8_lossy(rendered).into_owned(),
    )]
    .into();
    let mut body = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": to.name,
            "namespace": to.namespace,
            "labels": { MANAGED_BY_LABEL: MANAGED_BY },
            "annotations": {
                SHA256_ANNOTATION: sha256,
                SOURCES_ANNOTATION: sources,
            },
        },
        "data": data,
    });
    if let Some(rv) = resource_version {
        body["metadata"]["resourceVersion"] = json!(rv);
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observed(bytes: Option<&[u8]>, annotated: Option<&str>) -> Observed {
        Observed::new(
            bytes.map(Arc::from),
            annotated.map(str::to_string),
            Some("7".into()),
        )
    }

    fn sha(bytes: &[u8]) -> String {
        Fingerprint::of(bytes).to_hex()
    }

    #[test]
    fn a_configmap_holding_the_bundle_is_left_alone_whatever_was_published_before() {
        let a = sha(b"A");
        let seen = Seen::Present(observed(Some(b"A"), Some(&a)));
        for published in [None, Some(a.as_str()), Some("other")] {
            for down in [false, true] {
                assert_eq!(decide(Some(&a), published, &seen, down), Step::Wait);
            }
        }
    }

    #[test]
    fn a_new_bundle_is_published_once_the_configmap_has_been_seen() {
        let (a, b) = (sha(b"A"), sha(b"B"));
        let seen = Seen::Present(observed(Some(b"A"), Some(&a)));
        assert_eq!(decide(Some(&b), Some(&a), &seen, false), Step::Publish);
        assert_eq!(decide(Some(&b), None, &seen, false), Step::Publish);
        assert_eq!(decide(Some(&b), None, &Seen::Missing, false), Step::Publish);
        // Not before the first look, unless the look failed.
        assert_eq!(decide(Some(&b), None, &Seen::Unknown, false), Step::Wait);
        assert_eq!(decide(Some(&b), None, &Seen::Unknown, true), Step::Publish);
        // Nothing to publish before every source was read.
        assert_eq!(decide(None, None, &Seen::Missing, true), Step::Wait);
    }

    #[test]
    fn another_replicas_consistent_bundle_stands_but_damage_is_repaired() {
        let (a, b) = (sha(b"A"), sha(b"B"));
        // Published B; the ConfigMap holds A, consistently: another replica's, left alone.
        let other = Seen::Present(observed(Some(b"A"), Some(&a)));
        assert_eq!(decide(Some(&b), Some(&b), &other, false), Step::Wait);
        for damaged in [
            Seen::Missing,
            Seen::Present(observed(None, Some(&b))),
            Seen::Present(observed(Some(b"A"), None)),
            Seen::Present(observed(Some(b"edited"), Some(&b))),
        ] {
            assert_eq!(
                decide(Some(&b), Some(&b), &damaged, false),
                Step::Repair,
                "{damaged:?}"
            );
        }
    }

    #[test]
    fn damage_names_what_is_wrong() {
        let a = sha(b"A");
        assert_eq!(observed(Some(b"A"), Some(&a)).damage(), None);
        assert!(
            observed(None, Some(&a))
                .damage()
                .unwrap()
                .contains("key is missing")
        );
        assert!(
            observed(Some(b"A"), None)
                .damage()
                .unwrap()
                .contains("annotation is missing")
        );
        assert!(
            observed(Some(b"B"), Some(&a))
                .damage()
                .unwrap()
                .contains("does not match")
        );
    }

    #[test]
    fn the_key_is_read_from_data_or_binary_data() {
        let mut cm = ConfigMap {
            binary_data: Some([("k".to_string(), k8s_openapi::ByteString(b"bin".to_vec()))].into()),
            ..ConfigMap::default()
        };
        assert_eq!(Observed::of(&cm, "k").bytes.as_deref(), Some(&b"bin"[..]));
        cm.data = Some([("k".to_string(), "text".to_string())].into());
        assert_eq!(Observed::of(&cm, "k").bytes.as_deref(), Some(&b"text"[..]));
        assert_eq!(Observed::of(&cm, "other").bytes, None);
    }

    #[test]
    fn the_apply_carries_only_the_key_the_annotations_and_the_label() {
        let to = ConfigMapRef {
            namespace: "ns".into(),
            name: "cm".into(),
            key: "ca.crt".into(),
        };
        let body = apply_body(&to, b"PEM", "abc", "controllerconfig:x", None);
        assert_eq!(
            body,
            json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "cm", "namespace": "ns",
                    "labels": {"app.kubernetes.io/managed-by": "kubelet-ca-agent"},
                    "annotations": {"kubelet-ca-agent.io/bundle-sha256": "abc",
                                    "kubelet-ca-agent.io/sources": "controllerconfig:x"}},
                "data": {"ca.crt": "PEM"}
            })
        );
        let body = apply_body(&to, b"PEM", "abc", "controllerconfig:x", Some("42"));
        assert_eq!(body["metadata"]["resourceVersion"], "42");
    }
}
