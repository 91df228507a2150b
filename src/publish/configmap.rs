//! The publisher's target: the keys of a ConfigMap it keeps (the bundle's, and the other
//! CA files' of [`super::keys`]), what they hold as seen by a watch, the server-side apply
//! that writes them, and the (pure) decision of when to write.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use serde_json::{Value, json};

use crate::bundle::Fingerprint;
use crate::config::ConfigMapRef;

/// The field manager of every apply: one for every replica, so that two publishers share
/// ownership of the fields and an apply of the same bundle by the second is a no-op.
pub const FIELD_MANAGER: &str = "kubelet-ca-agent-publisher";
/// The SHA-256 of the bundle in the key, as the publisher computed it.
pub const SHA256_ANNOTATION: &str = "kubelet-ca-agent.io/bundle-sha256";
/// The source specs the bundle was built from, comma-separated, in priority order.
pub const SOURCES_ANNOTATION: &str = "kubelet-ca-agent.io/sources";
/// The SHA-256 of the other keys ([`others_sha256`]), when the publisher keeps any.
pub const OTHER_KEYS_SHA256_ANNOTATION: &str = "kubelet-ca-agent.io/other-keys-sha256";
/// The source specs of the cloud CA (`cloud-ca.pem`), comma-separated.
pub const CLOUD_CA_SOURCES_ANNOTATION: &str = "kubelet-ca-agent.io/cloud-ca-sources";
/// The source specs of the kubeconfigs' CA (`kubeconfig-ca.crt`), comma-separated.
pub const KUBECONFIG_CA_SOURCES_ANNOTATION: &str = "kubelet-ca-agent.io/kubeconfig-ca-sources";
/// The source specs of the registry CAs (`registry.*`), comma-separated.
pub const REGISTRY_SOURCES_ANNOTATION: &str = "kubelet-ca-agent.io/registry-sources";
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "kubelet-ca-agent";

/// What the publisher keeps in the ConfigMap: the bundle in its key, and the other keys
/// (the cloud CA, the registry CAs) with their values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publication {
    pub bundle: Arc<[u8]>,
    /// The bundle's SHA-256: the [`SHA256_ANNOTATION`].
    pub sha256: String,
    pub others: BTreeMap<String, String>,
    /// [`others_sha256`] of `others`: the [`OTHER_KEYS_SHA256_ANNOTATION`].
    pub others_sha256: Option<String>,
}

impl Publication {
    pub fn new(bundle: Arc<[u8]>, others: BTreeMap<String, String>) -> Publication {
        Publication {
            sha256: Fingerprint::of(&bundle).to_hex(),
            bundle,
            others_sha256: others_sha256(others.iter().map(|(k, v)| (k.as_str(), v.as_bytes()))),
            others,
        }
    }

    /// What tells one publication from another: the bundle's SHA-256, and with other keys,
    /// theirs. A publication of the bundle alone is named as it always was.
    pub fn id(&self) -> String {
        match &self.others_sha256 {
            None => self.sha256.clone(),
            Some(others) => format!("{}+{others}", self.sha256),
        }
    }
}

/// The SHA-256 of keys and their values, each length-prefixed, in key order: what the
/// [`OTHER_KEYS_SHA256_ANNOTATION`] says. `None` for no key at all.
pub fn others_sha256<'a>(keys: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Option<String> {
    let mut sorted: Vec<(&str, &[u8])> = keys.into_iter().collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort();
    let mut text = Vec::new();
    for (key, value) in sorted {
        for part in [key.as_bytes(), value] {
            text.extend_from_slice(&(part.len() as u64).to_be_bytes());
            text.extend_from_slice(part);
        }
    }
    Some(Fingerprint::of(&text).to_hex())
}

/// The ConfigMap as a watch (or a read) last saw it, reduced to what the publisher needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// The bundle key's bytes (from `data`, else `binaryData`); None when the key is absent.
    pub bytes: Option<Arc<[u8]>>,
    /// Their SHA-256.
    pub sha256: Option<String>,
    /// The SHA-256 annotation, when present.
    pub annotated: Option<String>,
    pub resource_version: Option<String>,
    /// Every other key's bytes (of `data`, else `binaryData`).
    pub others: BTreeMap<String, Arc<[u8]>>,
    /// The other keys that this publisher's field manager owns (its `Apply` entry of
    /// `managedFields`): those an apply that leaves them out removes.
    pub owned: BTreeSet<String>,
    /// The [`OTHER_KEYS_SHA256_ANNOTATION`], when present.
    pub others_annotated: Option<String>,
}

impl Observed {
    pub fn of(configmap: &ConfigMap, key: &str) -> Observed {
        let mut others: BTreeMap<String, Arc<[u8]>> = BTreeMap::new();
        for (k, v) in configmap.binary_data.iter().flatten() {
            others.insert(k.clone(), Arc::from(&v.0[..]));
        }
        for (k, v) in configmap.data.iter().flatten() {
            others.insert(k.clone(), Arc::from(v.as_bytes()));
        }
        let bytes = others.remove(key);
        let annotation = |name: &str| {
            configmap
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(name))
                .cloned()
        };
        let (mut owned, owned_annotations) = owned_fields(configmap);
        owned.remove(key);
        Observed {
            others,
            owned,
            // Taken as this publisher's only when its apply set it: one that another writer
            // put there (and which an apply that does not send it would not remove) says
            // nothing of what this publisher published.
            others_annotated: annotation(OTHER_KEYS_SHA256_ANNOTATION)
                .filter(|_| owned_annotations.contains(OTHER_KEYS_SHA256_ANNOTATION)),
            ..Observed::new(
                bytes,
                annotation(SHA256_ANNOTATION),
                configmap.metadata.resource_version.clone(),
            )
        }
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
            others: BTreeMap::new(),
            owned: BTreeSet::new(),
            others_annotated: None,
        }
    }

    /// The bundle's key holds exactly the bundle whose SHA-256 is `sha256`, and says so.
    pub fn holds_bundle(&self, sha256: &str) -> bool {
        self.annotated.as_deref() == Some(sha256) && self.sha256.as_deref() == Some(sha256)
    }

    /// The ConfigMap holds exactly what an apply of `publication` would leave in the keys the
    /// publisher keeps: the bundle, each other key's value and the annotations describing
    /// them, and no other key of this publisher's (one it no longer wants, which the apply
    /// would remove).
    pub fn holds(&self, publication: &Publication) -> bool {
        self.holds_bundle(&publication.sha256)
            && self.others_annotated == publication.others_sha256
            && publication
                .others
                .iter()
                .all(|(k, v)| self.others.get(k).is_some_and(|o| **o == *v.as_bytes()))
            && self
                .owned
                .iter()
                .all(|k| publication.others.contains_key(k))
    }

    /// What is wrong with the object as a publisher's output, if anything: the key missing,
    /// or content that its annotations do not describe (edited by hand, or by another
    /// writer). A consistent object holding another publication is not broken: it is
    /// another replica's (or an earlier) one.
    pub fn damage(&self) -> Option<String> {
        let owned = self
            .owned
            .iter()
            .filter_map(|k| Some((k.as_str(), &**self.others.get(k)?)));
        match (&self.bytes, &self.annotated) {
            (None, _) => Some("the key is missing".to_string()),
            (Some(_), None) => Some(format!("the {SHA256_ANNOTATION} annotation is missing")),
            (Some(_), Some(annotated)) if self.sha256.as_ref() != Some(annotated) => Some(format!(
                "the content does not match its {SHA256_ANNOTATION} annotation (changed by another writer)"
            )),
            _ if others_sha256(owned) != self.others_annotated => Some(format!(
                "the other keys do not match their {OTHER_KEYS_SHA256_ANNOTATION} annotation (changed by another writer)"
            )),
            _ => None,
        }
    }
}

/// The keys of `data` and `binaryData`, and the annotations, that [`FIELD_MANAGER`]'s
/// apply owns, from the object's `managedFields` (FieldsV1: `{"f:data": {"f:KEY": {}}}`).
fn owned_fields(configmap: &ConfigMap) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut keys, mut annotations) = (BTreeSet::new(), BTreeSet::new());
    let entries = configmap.metadata.managed_fields.iter().flatten();
    for entry in entries.filter(|e| {
        e.manager.as_deref() == Some(FIELD_MANAGER) && e.operation.as_deref() == Some("Apply")
    }) {
        let Some(fields) = &entry.fields_v1 else {
            continue;
        };
        let names = |path: &[&str]| -> Vec<String> {
            path.iter()
                .try_fold(&fields.0, |node, step| node.get(step))
                .and_then(Value::as_object)
                .into_iter()
                .flat_map(|m| m.keys())
                .filter_map(|k| k.strip_prefix("f:"))
                .map(str::to_string)
                .collect()
        };
        keys.extend(names(&["f:data"]));
        keys.extend(names(&["f:binaryData"]));
        annotations.extend(names(&["f:metadata", "f:annotations"]));
    }
    (keys, annotations)
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

/// Whether what an apply returned, at `applied_rv`, is newer than what the target's watch
/// shows (`seen`), and so what the ConfigMap holds now. `watched_during`: the watch said
/// something while the apply was in flight. The watch's view stands when the apply returned
/// no resourceVersion, when the watch already shows the apply's own, when the watch shows a
/// later one, and when it said during the apply that the ConfigMap is gone (that deletion
/// came after the write, or the write was a create whose own event follows): adopting the
/// apply's result then would take a deleted ConfigMap for published, and nothing would
/// ever put it back.
pub fn applied_is_newer(seen: &Seen, applied_rv: Option<&str>, watched_during: bool) -> bool {
    let Some(applied) = applied_rv else {
        return false;
    };
    match seen {
        Seen::Missing => !watched_during,
        Seen::Unknown => true,
        Seen::Present(seen) => match seen.resource_version.as_deref() {
            Some(rv) if rv == applied => false,
            Some(rv) => match (rv.parse::<u64>(), applied.parse::<u64>()) {
                (Ok(seen), Ok(applied)) => applied > seen,
                _ => true,
            },
            None => true,
        },
    }
}

/// What the loop should do about the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing: in sync, or nothing to publish yet, or another publisher's output stands.
    Wait,
    /// Apply the publication: it changed since this publisher last published (or it never
    /// has).
    Publish,
    /// Apply the publication: the ConfigMap was deleted or damaged.
    Repair,
}

/// When to write. The publisher applies when what it keeps changes (the bundle, or another
/// key), and repairs a ConfigMap that is gone or damaged; it does not overwrite a consistent
/// ConfigMap that holds another publication, since that is the output of another replica
/// whose sources are a moment ahead of (or behind) these, and taking it back would make two
/// replicas undo each other's writes during a rotation. Both converge on the next change
/// they see.
///
/// `published`: the [`Publication::id`] of what this publisher last applied, or found
/// published. `watch_down`: the target's watch failed, so `seen` may be stale.
pub fn decide(
    desired: Option<&Publication>,
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
        _ if published != Some(desired.id().as_str()) => Step::Publish,
        Seen::Missing => Step::Repair,
        Seen::Present(observed) if observed.damage().is_some() => Step::Repair,
        _ => Step::Wait,
    }
}

/// The apply configuration: the keys, the annotations and the label; nothing else, so that
/// the publisher owns only these fields and leaves any other key or annotation alone. A key
/// it applied before and leaves out now (a registry gone from the sources) is removed by the
/// API server, as server-side apply removes what a manager stops applying.
///
/// `annotations`: the source annotations, besides the SHA-256 ones, which come from
/// `publication`. `resource_version`, the version the decision was made on, is a
/// precondition: if the ConfigMap changed since (another replica wrote first), the API
/// server answers 409 and the publisher looks again, rather than overwriting a state it has
/// not seen.
pub fn apply_body(
    to: &ConfigMapRef,
    publication: &Publication,
    annotations: &[(&str, String)],
    resource_version: Option<&str>,
) -> Value {
    let mut data: BTreeMap<&str, String> = publication
        .others
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    data.insert(
        to.key.as_str(),
        String::from_utf8_lossy(&publication.bundle).into_owned(),
    );
    let mut annotated: BTreeMap<&str, &str> =
        annotations.iter().map(|(k, v)| (*k, v.as_str())).collect();
    annotated.insert(SHA256_ANNOTATION, &publication.sha256);
    if let Some(others) = &publication.others_sha256 {
        annotated.insert(OTHER_KEYS_SHA256_ANNOTATION, others);
    }
    let mut body = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": to.name,
            "namespace": to.namespace,
            "labels": { MANAGED_BY_LABEL: MANAGED_BY },
            "annotations": annotated,
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

    #[test]
    fn an_applys_result_is_taken_only_when_the_watch_shows_nothing_newer() {
        let at =
            |rv: Option<&str>| Seen::Present(Observed::new(None, None, rv.map(str::to_string)));
        // No resourceVersion returned: nothing to compare, the watch stands.
        assert!(!applied_is_newer(&at(Some("5")), None, false));
        // The watch already shows the apply's own version (a number or not).
        assert!(!applied_is_newer(&at(Some("7")), Some("7"), true));
        assert!(!applied_is_newer(&at(Some("x")), Some("x"), false));
        // Older than the apply: the apply's result is what the ConfigMap holds.
        assert!(applied_is_newer(&at(Some("5")), Some("7"), false));
        assert!(applied_is_newer(&at(Some("5")), Some("7"), true));
        // Newer than the apply (another writer after it, seen before its answer came).
        assert!(!applied_is_newer(&at(Some("9")), Some("7"), true));
        // Compared as revisions: the same one written another way is not newer.
        assert!(!applied_is_newer(&at(Some("07")), Some("7"), false));
        // Versions that are not numbers: only equality is known.
        assert!(applied_is_newer(&at(Some("x")), Some("7"), false));
        assert!(applied_is_newer(&at(None), Some("7"), false));
        // Gone before the apply (a create): the apply's result stands.
        assert!(applied_is_newer(&Seen::Missing, Some("7"), false));
        assert!(applied_is_newer(&Seen::Unknown, Some("7"), false));
        // Gone, said while the apply was in flight: deleted after the write (or the write
        // was a create whose own event follows); the watch stands.
        assert!(!applied_is_newer(&Seen::Missing, Some("7"), true));
    }

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

    /// A publication of the bundle `bytes` alone.
    fn bundle(bytes: &[u8]) -> Publication {
        Publication::new(Arc::from(bytes), BTreeMap::new())
    }

    /// A publication with other keys.
    fn with(bytes: &[u8], others: &[(&str, &str)]) -> Publication {
        let others = others
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Publication::new(Arc::from(bytes), others)
    }

    /// What the ConfigMap holds after this publisher applied `publication`.
    fn applied(publication: &Publication) -> Observed {
        Observed {
            others: publication
                .others
                .iter()
                .map(|(k, v)| (k.clone(), Arc::from(v.as_bytes())))
                .collect(),
            owned: publication.others.keys().cloned().collect(),
            others_annotated: publication.others_sha256.clone(),
            ..observed(Some(&publication.bundle), Some(&publication.sha256))
        }
    }

    #[test]
    fn a_configmap_holding_the_bundle_is_left_alone_whatever_was_published_before() {
        let a = bundle(b"A");
        assert_eq!(a.id(), sha(b"A"), "a bundle alone is named as before");
        let seen = Seen::Present(observed(Some(b"A"), Some(&a.sha256)));
        for published in [None, Some(a.id().as_str()), Some("other")] {
            for down in [false, true] {
                assert_eq!(decide(Some(&a), published, &seen, down), Step::Wait);
            }
        }
    }

    #[test]
    fn a_new_bundle_is_published_once_the_configmap_has_been_seen() {
        let (a, b) = (bundle(b"A"), bundle(b"B"));
        let seen = Seen::Present(observed(Some(b"A"), Some(&a.sha256)));
        let a = a.id();
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
        let (a, b) = (sha(b"A"), bundle(b"B"));
        // Published B; the ConfigMap holds A, consistently: another replica's, left alone.
        let other = Seen::Present(observed(Some(b"A"), Some(&a)));
        let published = Some(b.id());
        let published = published.as_deref();
        assert_eq!(decide(Some(&b), published, &other, false), Step::Wait);
        for damaged in [
            Seen::Missing,
            Seen::Present(observed(None, Some(&b.sha256))),
            Seen::Present(observed(Some(b"A"), None)),
            Seen::Present(observed(Some(b"edited"), Some(&b.sha256))),
        ] {
            assert_eq!(
                decide(Some(&b), published, &damaged, false),
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
    fn another_key_changed_is_published_and_an_unrelated_change_is_not() {
        let one = with(b"A", &[("cloud-ca.pem", ""), ("registry.quay.io", "Q")]);
        let seen = applied(&one);
        assert!(seen.holds(&one) && seen.damage().is_none());
        let id = one.id();
        assert_ne!(id, sha(b"A"));
        // A key this publisher does not own, whatever it holds, changes nothing.
        let mut foreign = seen.clone();
        foreign
            .others
            .insert("registry.theirs".into(), Arc::from(&b"T"[..]));
        assert!(foreign.holds(&one));
        assert_eq!(
            decide(Some(&one), Some(&id), &Seen::Present(foreign), false),
            Step::Wait
        );
        // A registry added, changed or gone: published.
        for next in [
            with(
                b"A",
                &[
                    ("cloud-ca.pem", ""),
                    ("registry.quay.io", "Q"),
                    ("registry.x", "X"),
                ],
            ),
            with(b"A", &[("cloud-ca.pem", ""), ("registry.quay.io", "Q2")]),
            with(b"A", &[("cloud-ca.pem", "")]),
            bundle(b"A"),
        ] {
            assert!(!seen.holds(&next), "{next:?}");
            assert_eq!(
                decide(Some(&next), Some(&id), &Seen::Present(seen.clone()), false),
                Step::Publish,
                "{next:?}"
            );
        }
        // The other keys edited by another writer (who then owns the key): repaired.
        let mut edited = seen.clone();
        edited
            .others
            .insert("registry.quay.io".into(), Arc::from(&b"E"[..]));
        edited.owned.remove("registry.quay.io");
        assert!(edited.damage().unwrap().contains("other-keys-sha256"));
        assert_eq!(
            decide(Some(&one), Some(&id), &Seen::Present(edited), false),
            Step::Repair
        );
        // Another replica's consistent publication stands.
        let theirs = with(b"A", &[("cloud-ca.pem", ""), ("registry.quay.io", "Q3")]);
        assert_eq!(
            decide(
                Some(&one),
                Some(&id),
                &Seen::Present(applied(&theirs)),
                false
            ),
            Step::Wait
        );
    }

    #[test]
    fn other_keys_hash_their_names_and_values_unambiguously() {
        let a = others_sha256([("ab", &b"c"[..])]);
        let b = others_sha256([("a", &b"bc"[..])]);
        assert_ne!(a, b);
        assert_eq!(others_sha256(std::iter::empty()), None);
        assert_eq!(
            others_sha256([("x", &b"1"[..]), ("y", &b"2"[..])]),
            others_sha256([("y", &b"2"[..]), ("x", &b"1"[..])])
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
        assert_eq!(
            Observed::of(&cm, "other").others["k"].as_ref(),
            &b"text"[..]
        );
    }

    #[test]
    fn the_keys_owned_are_those_of_this_publishers_apply() {
        let cm: ConfigMap = serde_json::from_value(json!({
            "metadata": {
                "name": "cm",
                "annotations": {OTHER_KEYS_SHA256_ANNOTATION: "abc"},
                "managedFields": [
                    {"manager": FIELD_MANAGER, "operation": "Apply", "apiVersion": "v1",
                     "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:data": {"f:ca.crt": {}, "f:registry.a": {}},
                                  "f:metadata": {"f:annotations": {"f:kubelet-ca-agent.io/bundle-sha256": {}}}}},
                    {"manager": "kubectl-edit", "operation": "Update", "apiVersion": "v1",
                     "fieldsType": "FieldsV1",
                     "fieldsV1": {"f:data": {"f:registry.b": {}},
                                  "f:metadata": {"f:annotations": {"f:kubelet-ca-agent.io/other-keys-sha256": {}}}}},
                    {"manager": FIELD_MANAGER, "operation": "Update", "apiVersion": "v1",
                     "fieldsType": "FieldsV1", "fieldsV1": {"f:data": {"f:registry.c": {}}}}
                ]
            },
            "data": {"ca.crt": "B", "registry.a": "A", "registry.b": "B"}
        }))
        .unwrap();
        let observed = Observed::of(&cm, "ca.crt");
        assert_eq!(observed.owned, ["registry.a".to_string()].into());
        // The annotation another writer set is not this publisher's.
        assert_eq!(observed.others_annotated, None);
    }

    #[test]
    fn the_apply_carries_only_the_keys_the_annotations_and_the_label() {
        let to = ConfigMapRef {
            namespace: "ns".into(),
            name: "cm".into(),
            key: "ca.crt".into(),
        };
        let sources = [(SOURCES_ANNOTATION, "controllerconfig:x".to_string())];
        let body = apply_body(&to, &bundle(b"PEM"), &sources, None);
        assert_eq!(
            body,
            json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "cm", "namespace": "ns",
                    "labels": {"app.kubernetes.io/managed-by": "kubelet-ca-agent"},
                    "annotations": {"kubelet-ca-agent.io/bundle-sha256": sha(b"PEM"),
                                    "kubelet-ca-agent.io/sources": "controllerconfig:x"}},
                "data": {"ca.crt": "PEM"}
            })
        );
        let body = apply_body(&to, &bundle(b"PEM"), &sources, Some("42"));
        assert_eq!(body["metadata"]["resourceVersion"], "42");
        let publication = with(b"PEM", &[("cloud-ca.pem", ""), ("registry.quay.io", "Q")]);
        let body = apply_body(&to, &publication, &sources, None);
        assert_eq!(
            body["data"],
            json!({"ca.crt": "PEM", "cloud-ca.pem": "", "registry.quay.io": "Q"})
        );
        assert_eq!(
            body["metadata"]["annotations"][OTHER_KEYS_SHA256_ANNOTATION],
            json!(publication.others_sha256.unwrap())
        );
    }
}
