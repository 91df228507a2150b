//! Cluster sources, read through kube-rs: a ConfigMap (one key, or every key of `data` and
//! `binaryData`) and a field of a ControllerConfig's `spec` (base64 of PEM, or a registry
//! list handed raw to its reader).
//!
//! Each object that sources read has one long-lived watch, shared by every spec that reads
//! it (several fields of a ControllerConfig, several keys of a ConfigMap: SPEC 4b, one watch
//! per object), on the single named object (field selector `metadata.name`, so RBAC by
//! resourceNames is enough). How it is listed, watched, resumed and backed off is the
//! follower's ([`crate::follow`]); what is here is what the object means: each state of it
//! becomes one update per spec, with that spec's own content or its own error, so that a bad
//! field for one spec does not fail the others.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use base64::Engine;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, ObjectList, WatchParams};

use super::{DEFAULT_CONTROLLERCONFIG_FIELD, Keys, SourceError, SourceSpec, parse_parts};
use crate::bundle::SourceCertificates;
use crate::credentials::Credentials;
use crate::follow::lifecycle::Failure;
use crate::follow::{self, Change, Events, Listed, Problem, REQUEST_DEADLINE, Selection};
use crate::registry;

fn controllerconfig_resource() -> ApiResource {
    ApiResource {
        group: "machineconfiguration.openshift.io".into(),
        version: "v1".into(),
        api_version: "machineconfiguration.openshift.io/v1".into(),
        kind: "ControllerConfig".into(),
        plural: "controllerconfigs".into(),
    }
}

/// One update from a source, for the loop that reads it.
#[derive(Debug)]
pub struct Update {
    /// Position of the source in the list the watches were started for (every target's
    /// sources, flattened, in the order of the targets).
    pub index: usize,
    pub event: Event<Content>,
    /// When the update arrived (for a cluster source, the watch event or list answer as it
    /// came in, before the object was parsed and validated): the start of
    /// `kubelet_ca_sync_duration_seconds`.
    pub at: Instant,
}

/// What a source gives its target: certificates (for a file), or a registry set's entries.
#[derive(Debug, Clone)]
pub enum Content {
    Certificates(SourceCertificates),
    Entries(Arc<registry::Entries>),
}

impl Content {
    /// The certificates, when this is what it holds.
    pub fn certificates(self) -> Option<SourceCertificates> {
        match self {
            Content::Certificates(c) => Some(c),
            Content::Entries(_) => None,
        }
    }

    /// The entries, when this is what it holds.
    pub fn entries(self) -> Option<Arc<registry::Entries>> {
        match self {
            Content::Entries(e) => Some(e),
            Content::Certificates(_) => None,
        }
    }
}

/// What the watch of one object tells its loop: for a source, `T` is its certificates.
#[derive(Debug)]
pub enum Event<T> {
    /// New valid content.
    Content(T),
    /// The source could not be used; its last good content stays.
    Failed(SourceError),
    /// The watch failed and is being restarted (after backoff).
    WatchRestart(SourceError),
}

impl<T> Event<T> {
    /// The same event with its content made into another kind, or `None` when `f` has
    /// nothing to make of it.
    pub fn filter_map<U>(self, f: impl FnOnce(T) -> Option<U>) -> Option<Event<U>> {
        match self {
            Event::Content(content) => f(content).map(Event::Content),
            Event::Failed(e) => Some(Event::Failed(e)),
            Event::WatchRestart(e) => Some(Event::WatchRestart(e)),
        }
    }
}

pub type SourceEvent = Event<SourceCertificates>;

/// A named piece of a source's content: (which key, its bytes).
pub type Part<'a> = (Option<String>, &'a [u8]);

/// The bytes of a ConfigMap that make up a source, as (part name, bytes).
pub fn configmap_parts<'a>(
    spec: &str,
    configmap: &'a ConfigMap,
    keys: &Keys,
) -> Result<Vec<Part<'a>>, SourceError> {
    let mut all: BTreeMap<&str, &[u8]> = BTreeMap::new();
    for (key, value) in configmap.data.iter().flatten() {
        all.insert(key, value.as_bytes());
    }
    for (key, value) in configmap.binary_data.iter().flatten() {
        all.insert(key, &value.0);
    }
    match keys {
        Keys::All => Ok(all
            .into_iter()
            .map(|(k, v)| (Some(format!("key {k}")), v))
            .collect()),
        Keys::Prefix(prefix) => Ok(all
            .into_iter()
            .filter(|(k, _)| k.starts_with(prefix.as_str()))
            .map(|(k, v)| (Some(format!("key {k}")), v))
            .collect()),
        Keys::One(key) => match all.get(key.as_str()) {
            Some(bytes) => Ok(vec![(None, *bytes)]),
            None => Err(SourceError::Invalid {
                spec: spec.to_string(),
                reason: "missing_key",
                problem: format!(
                    "the ConfigMap has no key {key:?} in data or binaryData (keys: {})",
                    all.keys().copied().collect::<Vec<_>>().join(", ")
                ),
            }),
        },
    }
}

/// The entries of a registry set's cluster source (`--manage-registries`): a ControllerConfig
/// registry list (absent or `null` is an empty list), or every key of a ConfigMap
/// (`configmap:NS/NAME/*`, `data` and `binaryData` in key order), each key `host..port`
/// one registry, or the keys that start with a prefix (`configmap:NS/NAME/PREFIX*`, as the
/// publisher writes `registry.host..port`), each with the prefix taken off. Each entry is
/// accepted or refused on its own ([`registry::entries`]).
pub fn registry_content(spec: &SourceSpec, raw: Raw<'_>) -> Result<registry::Entries, SourceError> {
    let name = spec.to_string();
    match (spec, raw) {
        (SourceSpec::ControllerConfig { field, .. }, Raw::Field(value)) => Ok(registry::from_list(
            &name,
            field,
            value.unwrap_or(&serde_json::Value::Null),
        )),
        (SourceSpec::ConfigMap { keys, .. }, Raw::ConfigMap(configmap)) => {
            let prefix = match keys {
                Keys::Prefix(prefix) => prefix.as_str(),
                Keys::All | Keys::One(_) => "",
            };
            let parts = configmap_parts(&name, configmap, keys)?;
            let keys = parts.iter().map(|(part, bytes)| {
                let key = part.as_deref().unwrap_or_default();
                let key = key.strip_prefix("key ").unwrap_or(key);
                (key.strip_prefix(prefix).unwrap_or(key), *bytes)
            });
            Ok(registry::from_configmap(&name, keys))
        }
        _ => Err(SourceError::Invalid {
            spec: name,
            reason: "not_a_registry_source",
            problem: "not a source of registry CAs".to_string(),
        }),
    }
}

/// One cluster object that sources read: every spec of the same object shares its watch and
/// its read.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClusterObject {
    ConfigMap { namespace: String, name: String },
    ControllerConfig { name: String },
}

impl ClusterObject {
    /// The object `spec` reads; `None` for a local source.
    pub fn of(spec: &SourceSpec) -> Option<ClusterObject> {
        match spec {
            SourceSpec::ConfigMap {
                namespace, name, ..
            } => Some(ClusterObject::ConfigMap {
                namespace: namespace.clone(),
                name: name.clone(),
            }),
            SourceSpec::ControllerConfig { name, .. } => {
                Some(ClusterObject::ControllerConfig { name: name.clone() })
            }
            SourceSpec::File(_) | SourceSpec::Dir(_) => None,
        }
    }
}

/// The cluster sources among `sources`, grouped by the object they read, in order of first
/// appearance: each object with the positions in `sources` of the specs that read it.
pub fn by_object(sources: &[SourceSpec]) -> Vec<(ClusterObject, Vec<usize>)> {
    let mut objects: Vec<(ClusterObject, Vec<usize>)> = Vec::new();
    for (index, spec) in sources.iter().enumerate() {
        let Some(object) = ClusterObject::of(spec) else {
            continue;
        };
        match objects.iter_mut().find(|(o, _)| *o == object) {
            Some((_, indices)) => indices.push(index),
            None => objects.push((object, vec![index])),
        }
    }
    objects
}

/// What one spec reads of its object's current state, for a content function to make into
/// what the spec's user needs: a PEM bundle ([`bundle_content`]), or the entries of a
/// registry set, which the registry module reads from the raw JSON of a list field.
#[derive(Debug, Clone, Copy)]
pub enum Raw<'a> {
    /// The whole ConfigMap: the spec says which keys it takes ([`configmap_parts`]).
    ConfigMap(&'a ConfigMap),
    /// The spec's field of the ControllerConfig's `spec`, as JSON; `None` when the object has
    /// no such field.
    Field(Option<&'a serde_json::Value>),
}

/// The field `field` of a ControllerConfig's `spec`, as JSON; `None` when it is not there.
pub fn controllerconfig_field<'a>(
    object: &'a DynamicObject,
    field: &str,
) -> Option<&'a serde_json::Value> {
    object.data.get("spec").and_then(|s| s.get(field))
}

/// The content of a spec that feeds one PEM file (`--source`, `--manage`): its certificates,
/// validated as one source (SPEC 4).
///
/// A ControllerConfig field other than [`DEFAULT_CONTROLLERCONFIG_FIELD`] that holds nothing
/// (absent, `null`, or blank: see [`controllerconfig_bundle`]) is valid content with no
/// certificate, not a failure: `cloudProviderCAData` is `null` on most platforms, and a
/// source reported down for it would be down for good on every node of such a cluster. Its
/// user keeps the file as it is then: a managed file whose sources hold no certificate is
/// neither created nor emptied (SPEC 4b).
pub fn bundle_content(spec: &SourceSpec, raw: Raw<'_>) -> Result<SourceCertificates, SourceError> {
    let name = spec.to_string();
    match (spec, raw) {
        (SourceSpec::ConfigMap { keys, .. }, Raw::ConfigMap(configmap)) => {
            let parts = configmap_parts(&name, configmap, keys)?;
            let pem = parts
                .into_iter()
                .map(|(part, bytes)| Ok((part.clone(), configmap_pem(&name, part, bytes)?)))
                .collect::<Result<Vec<_>, SourceError>>()?;
            parse_parts(&name, pem.iter().map(|(p, b)| (p.clone(), b.as_ref())))
        }
        (SourceSpec::ControllerConfig { field, .. }, Raw::Field(value)) => {
            match controllerconfig_bundle(&name, field, value)? {
                Some(bundle) => parse_parts(&name, [(None, bundle.as_slice())]),
                None => Ok(SourceCertificates::default()),
            }
        }
        _ => panic!("bundle_content: {name} does not read {raw:?}"),
    }
}

/// A ConfigMap value as the PEM it carries (SPEC 4c): PEM as it is; base64 of PEM (as the
/// `kubeconfig-data` ConfigMap may hold it) decoded; a kubeconfig (`kind: Config`, as
/// `kube-public/cluster-info` key `kubeconfig`) made into the CA data of its clusters, or
/// rejected whole when it holds a user's key or token. Anything else is left to the
/// parser, which says what is wrong with it.
fn configmap_pem<'a>(
    spec: &str,
    part: Option<String>,
    bytes: &'a [u8],
) -> Result<std::borrow::Cow<'a, [u8]>, SourceError> {
    use std::borrow::Cow;
    if memchr::memmem::find(bytes, b"-----BEGIN").is_some() {
        return Ok(Cow::Borrowed(bytes));
    }
    match crate::kubeconfig::clusters_ca_data(bytes) {
        Ok(Some(all)) => return Ok(Cow::Owned(all.concat())),
        Ok(None) => {}
        Err(e) => {
            return Err(SourceError::Invalid {
                spec: spec.to_string(),
                reason: "kubeconfig_credentials",
                problem: format!("{}: {e}", part.as_deref().unwrap_or("value")),
            });
        }
    }
    let compact: Vec<u8> = bytes
        .iter()
        .copied()
        .filter(|b| !b.is_ascii_whitespace())
        .collect();
    match base64::engine::general_purpose::STANDARD.decode(&compact) {
        Ok(decoded) if memchr::memmem::find(&decoded, b"-----BEGIN").is_some() => {
            Ok(Cow::Owned(decoded))
        }
        _ => Ok(Cow::Borrowed(bytes)),
    }
}

/// The content of a spec that feeds only `--manage` files, whose sources may hold nothing
/// (SPEC 4b): [`bundle_content`], except that a ConfigMap whose selected keys are all empty
/// or only whitespace is content with no certificate, as an empty ControllerConfig field
/// is. The publisher keeps `cloud-ca.pem` as the empty string on a platform without a cloud
/// CA, and a node's `--manage PATH=configmap:NS/NAME/cloud-ca.pem` is then up with nothing
/// to keep, where the bundle's own sources (`--source`) still reject an empty key.
pub fn optional_bundle_content(
    spec: &SourceSpec,
    raw: Raw<'_>,
) -> Result<SourceCertificates, SourceError> {
    if let (SourceSpec::ConfigMap { keys, .. }, Raw::ConfigMap(configmap)) = (spec, raw) {
        let parts = configmap_parts(&spec.to_string(), configmap, keys)?;
        let blank = |(_, bytes): &Part<'_>| bytes.iter().all(u8::is_ascii_whitespace);
        if !parts.is_empty() && parts.iter().all(blank) {
            return Ok(SourceCertificates::default());
        }
    }
    bundle_content(spec, raw)
}

/// The PEM bundle a ControllerConfig field carries, decoded from base64: `None` when the
/// field holds nothing, that is when it is absent, `null` (how the API writes an empty
/// `[]byte` field such as `cloudProviderCAData`), or blank once decoded (the upstream writer
/// renders an empty CA as a lone newline).
///
/// [`DEFAULT_CONTROLLERCONFIG_FIELD`], which the API requires and the kubelet's bundle is made
/// of, never holds nothing: absent it is an error (`missing_field`), and `null` or blank it
/// comes back as empty bytes, which the parser rejects as holding no certificate (SPEC 4.2),
/// as before fields could be named. A registry list is never a bundle (`not_a_bundle`).
pub fn controllerconfig_bundle(
    spec: &str,
    field: &str,
    value: Option<&serde_json::Value>,
) -> Result<Option<Vec<u8>>, SourceError> {
    let invalid = |reason, problem: String| SourceError::Invalid {
        spec: spec.to_string(),
        reason,
        problem,
    };
    if super::REGISTRY_LIST_FIELDS.contains(&field) {
        return Err(invalid("not_a_bundle", super::not_a_bundle(field)));
    }
    let required = field == DEFAULT_CONTROLLERCONFIG_FIELD;
    let text = match value {
        None if required => {
            return Err(invalid("missing_field", format!("spec.{field} is not set")));
        }
        None | Some(serde_json::Value::Null) => "",
        Some(serde_json::Value::String(text)) => text,
        Some(_) => {
            return Err(invalid(
                "bad_base64",
                format!("spec.{field} is not a string (base64 of a PEM bundle)"),
            ));
        }
    };
    let compact: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    let bundle = base64::engine::general_purpose::STANDARD
        .decode(compact)
        .map_err(|_| invalid("bad_base64", format!("spec.{field} is not valid base64")))?;
    if !required && bundle.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    Ok(Some(bundle))
}

/// What went wrong with a request to `server` for `spec`, as the source's error, and its kind
/// for a backoff: [`Problem::of`] under the spec's name.
pub(crate) fn request_error(
    spec: &str,
    server: &str,
    error: &kube::Error,
) -> (SourceError, Failure) {
    let problem = Problem::of(server, error);
    let failure = problem.failure;
    (source_error(spec, problem), failure)
}

/// A problem of the follower or of a request, as the error of the source `spec`.
fn source_error(spec: &str, problem: Problem) -> SourceError {
    match problem.reason {
        "credentials" => SourceError::Credentials {
            spec: spec.to_string(),
            problem: problem.text,
        },
        reason => SourceError::Cluster {
            spec: spec.to_string(),
            reason,
            error: problem.text,
        },
    }
}

/// `request` to `server`, unless it takes longer than [`REQUEST_DEADLINE`].
async fn within<T>(
    spec: &str,
    server: &str,
    what: &str,
    request: impl Future<Output = kube::Result<T>>,
) -> Result<T, SourceError> {
    follow::within(server, what, request)
        .await
        .map_err(|problem| source_error(spec, problem))
}

/// Reads every cluster source among `sources` once, with one list (with a deadline) per
/// object, whatever the number of specs that read it, and makes each spec's content with
/// `content` ([`bundle_content`] for PEM files). One answer per source, in order: `None` for
/// a local source. A failure to read an object is each of its specs' failure.
pub async fn read_sources<T: Clone>(
    client: &Client,
    server: &str,
    sources: &[SourceSpec],
    content: impl Fn(&SourceSpec, Raw<'_>) -> Result<T, SourceError>,
) -> Vec<Option<Result<T, SourceError>>> {
    let mut answers: Vec<Option<Result<T, SourceError>>> = sources.iter().map(|_| None).collect();
    for (object, indices) in by_object(sources) {
        let specs: Vec<SourceSpec> = indices.iter().map(|&i| sources[i].clone()).collect();
        let label = specs[0].to_string();
        let read = match &object {
            ClusterObject::ConfigMap { namespace, name } => {
                let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
                list_one(api, server, name, &label)
                    .await
                    .map(|cm| each_spec(&specs, &content, |_| Raw::ConfigMap(&cm)))
            }
            ClusterObject::ControllerConfig { name } => {
                let api: Api<DynamicObject> =
                    Api::all_with(client.clone(), &controllerconfig_resource());
                list_one(api, server, name, &label)
                    .await
                    .map(|cc| each_spec(&specs, &content, |spec| field_of(&cc, spec)))
            }
        };
        let results = match read {
            Ok(results) => results,
            Err(error) => specs
                .iter()
                .map(|spec| Err(error.for_spec(&spec.to_string())))
                .collect(),
        };
        for (index, result) in indices.into_iter().zip(results) {
            answers[index] = Some(result);
        }
    }
    answers
}

/// What each of `specs` makes of one state of their object, `raw` giving each its part. A
/// spec listed twice (the same source of two files) is read once.
fn each_spec<'a, T: Clone>(
    specs: &[SourceSpec],
    content: &impl Fn(&SourceSpec, Raw<'_>) -> Result<T, SourceError>,
    raw: impl Fn(&SourceSpec) -> Raw<'a>,
) -> Vec<Result<T, SourceError>> {
    let mut results: Vec<Result<T, SourceError>> = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let result = match specs[..i].iter().position(|earlier| earlier == spec) {
            Some(same) => results[same].clone(),
            None => content(spec, raw(spec)),
        };
        results.push(result);
    }
    results
}

/// The part of a ControllerConfig that `spec` reads: its field.
fn field_of<'a>(object: &'a DynamicObject, spec: &SourceSpec) -> Raw<'a> {
    match spec {
        SourceSpec::ControllerConfig { field, .. } => {
            Raw::Field(controllerconfig_field(object, field))
        }
        _ => Raw::Field(None),
    }
}

fn selector(object: &str) -> String {
    format!("metadata.name={object}")
}

/// The object named `object`, by a list with a field selector: the same request, and so the
/// same RBAC, as the watch.
async fn list_one<K>(api: Api<K>, server: &str, object: &str, spec: &str) -> Result<K, SourceError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = ListParams::default().fields(&selector(object));
    let list = within(spec, server, "list", api.list(&params)).await?;
    list.items.into_iter().next().ok_or(SourceError::NotFound {
        spec: spec.to_string(),
    })
}

/// Starts one watch per object that the cluster sources among `sources` read (SPEC 4b: one
/// watch per object, whatever the number of fields or keys used). Each state of an object
/// becomes one event per spec that reads it, made by `content` from that spec's part
/// ([`Raw`]) and given to `send` with the spec's position in `sources`: a spec's bad content
/// is its own failure, and the others' content still goes out. Failures of the watch, and the
/// object's absence, go to every one of its specs, each under its own name.
pub fn watch_objects<T, C, S>(
    credentials: &Credentials,
    sources: &[SourceSpec],
    content: C,
    send: S,
) where
    T: Clone + Send + Sync + 'static,
    C: Fn(&SourceSpec, Raw<'_>) -> Result<T, SourceError> + Send + Sync + 'static,
    S: Fn(usize, Event<T>, Instant) + Send + Sync + 'static,
{
    let (content, send) = (Arc::new(content), Arc::new(send));
    for (object, indices) in by_object(sources) {
        let specs: Vec<SourceSpec> = indices.iter().map(|&i| sources[i].clone()).collect();
        let names: Vec<String> = specs.iter().map(ToString::to_string).collect();
        let send = send.clone();
        let send = move |i: usize, event, at| send(indices[i], event, at);
        let content = content.clone();
        match object {
            ClusterObject::ConfigMap { namespace, name } => {
                let api = move |client| Api::<ConfigMap>::namespaced(client, &namespace);
                let made =
                    move |cm: &ConfigMap| each_spec(&specs, &*content, |_| Raw::ConfigMap(cm));
                let watch = ObjectWatch::new(credentials, &name, names, api, made, send);
                tokio::spawn(follow::follow(credentials.clone(), watch));
            }
            ClusterObject::ControllerConfig { name } => {
                let api =
                    |client| Api::<DynamicObject>::all_with(client, &controllerconfig_resource());
                let made = move |cc: &DynamicObject| {
                    each_spec(&specs, &*content, |spec| field_of(cc, spec))
                };
                let watch = ObjectWatch::new(credentials, &name, names, api, made, send);
                tokio::spawn(follow::follow(credentials.clone(), watch));
            }
        }
    }
}

/// Watches the ConfigMap `namespace/name` for as long as the process runs (as a source is
/// watched: one list, then watches resumed from the last resourceVersion), sending what
/// `content` makes of each state of it. `spec` names it in errors.
pub async fn watch_configmap<T: Clone + Send + Sync + 'static>(
    credentials: Credentials,
    namespace: &str,
    name: &str,
    spec: &str,
    content: impl Fn(&ConfigMap) -> Result<T, SourceError> + Send + Sync + 'static,
    send: impl Fn(Event<T>, Instant) + Send + Sync + 'static,
) {
    let namespace = namespace.to_string();
    let api = move |client| Api::<ConfigMap>::namespaced(client, &namespace);
    let made = move |cm: &ConfigMap| vec![content(cm)];
    let send = move |_, event, at| send(event, at);
    let watch = ObjectWatch::new(&credentials, name, vec![spec.to_string()], api, made, send);
    follow::follow(credentials, watch).await;
}

/// The object as last seen, kept to be sent again when a watch is established after a failure.
enum LastSeen<T> {
    /// It does not exist.
    Missing,
    /// What each spec made of it: its valid content, or why it is not valid (to be reported
    /// again as it was). The certificates are shared with the reconciler's copy, so this
    /// costs next to nothing, where keeping the object would hold all of its text (a
    /// ConfigMap of a thousand certificates is over a megabyte) for the life of the watch.
    Seen(Vec<Result<T, SourceError>>),
}

type ApiFor<K> = Box<dyn Fn(Client) -> Api<K> + Send + Sync>;
type Made<K, T> = Box<dyn Fn(&K) -> Vec<Result<T, SourceError>> + Send + Sync>;
type SendFn<T> = Box<dyn Fn(usize, Event<T>, Instant) + Send + Sync>;

/// The follower's part for one object that sources read, for the specs that read it:
/// `made` makes of each state of the object one result per spec, in the order of `specs`;
/// `send` gets each spec's event with the spec's position in `specs` and the instant its
/// cause arrived (the list answer, the watch event, the failure), taken before `made`
/// parses the object, so that the sync duration includes parsing and validation. What
/// befalls the object itself (a failed request, its absence) goes to every spec, each error
/// naming its own spec.
///
/// A failure is sent as a [`SourceEvent::WatchRestart`] (the source is down, its last good
/// content stays; no usable credentials are a [`SourceEvent::Failed`]). A watch that is
/// established again after a failure sends the object as last seen again: a resumed watch
/// brings no event when nothing changed, and this is what tells the reconciler that the
/// source is back.
struct ObjectWatch<K, T> {
    /// `source SPEC` of the first spec, for the follower's log lines.
    label: String,
    object: String,
    specs: Vec<String>,
    api: ApiFor<K>,
    made: Made<K, T>,
    send: SendFn<T>,
    current: LastSeen<T>,
    /// The credentials, to look for the kubeadm-style source once when the default source
    /// is missing or refused (SPEC 3); `None` once looked for, or for any other source.
    kubeadm: Option<Credentials>,
}

impl<K, T: Clone> ObjectWatch<K, T> {
    fn new(
        credentials: &Credentials,
        object: &str,
        specs: Vec<String>,
        api: impl Fn(Client) -> Api<K> + Send + Sync + 'static,
        made: impl Fn(&K) -> Vec<Result<T, SourceError>> + Send + Sync + 'static,
        send: impl Fn(usize, Event<T>, Instant) + Send + Sync + 'static,
    ) -> ObjectWatch<K, T> {
        let kubeadm = (specs[0] == crate::source::DEFAULT_SOURCE).then(|| credentials.clone());
        ObjectWatch {
            label: format!("source {}", specs[0]),
            object: object.to_string(),
            specs,
            api: Box::new(api),
            made: Box::new(made),
            send: Box::new(send),
            current: LastSeen::Missing,
            kubeadm,
        }
    }

    /// A failure of the object's reading, to every spec.
    fn fail(&self, error: &SourceError, event: fn(SourceError) -> Event<T>, at: Instant) {
        for (i, name) in self.specs.iter().enumerate() {
            (self.send)(i, event(error.for_spec(name)), at);
        }
    }

    /// The object as last seen, to every spec.
    fn tell(&mut self, at: Instant) {
        match &self.current {
            LastSeen::Missing => {
                let missing = SourceError::NotFound {
                    spec: self.specs[0].clone(),
                };
                self.fail(&missing, Event::Failed, at);
                self.look_for_kubeadm("not_found");
            }
            LastSeen::Seen(results) => {
                for (i, result) in results.iter().enumerate() {
                    let event = match result {
                        Ok(content) => Event::Content(content.clone()),
                        Err(error) => Event::Failed(error.clone()),
                    };
                    (self.send)(i, event, at);
                }
            }
        }
    }

    /// What an object seen now means for each spec, kept and told.
    fn seen(&mut self, object: Option<&K>, at: Instant) {
        self.current = match object {
            Some(k) => {
                let results = (self.made)(k);
                debug_assert_eq!(results.len(), self.specs.len());
                LastSeen::Seen(results)
            }
            None => LastSeen::Missing,
        };
        self.tell(at);
    }

    /// The default source missing or refused: said once, with the kubeadm-style source
    /// when the cluster has it (SPEC 3). One list with a deadline, on a task of its own.
    fn look_for_kubeadm(&mut self, reason: &'static str) {
        if !matches!(reason, "not_found" | "forbidden") {
            return;
        }
        let Some(credentials) = self.kubeadm.take() else {
            return;
        };
        let Ok(client) = credentials.client() else {
            return;
        };
        let spec = self.specs[0].clone();
        tokio::spawn(async move {
            let found = look_for_kubeadm_source(client).await;
            if let Some(hint) = crate::source::kubeadm_hint(&spec, reason, found) {
                tracing::warn!(
                    source = spec,
                    "source {spec} cannot be read ({reason}){hint}"
                );
            }
        });
    }
}

impl<K, T> follow::Followed for ObjectWatch<K, T>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + 'static,
    K: Send + Sync,
    T: Clone + Send + Sync,
{
    type K = K;

    fn name(&self) -> &str {
        &self.label
    }

    fn selection(&self) -> Selection {
        Selection::named(&self.object)
    }

    fn list(
        &self,
        client: Client,
        params: ListParams,
    ) -> impl Future<Output = kube::Result<ObjectList<K>>> + Send {
        let api = (self.api)(client);
        async move { api.list(&params).await }
    }

    fn watch(
        &self,
        client: Client,
        params: WatchParams,
        rv: String,
    ) -> impl Future<Output = kube::Result<Events<K>>> + Send {
        let api = (self.api)(client);
        async move { api.watch(&params, &rv).await.map(StreamExt::boxed) }
    }

    fn listed(&mut self, items: Vec<K>, _: Listed, at: Instant) {
        self.seen(items.first(), at);
    }

    fn changed(&mut self, change: Change<K>, at: Instant) {
        match change {
            Change::Applied(k) => self.seen(Some(&k), at),
            Change::Deleted(_) => self.seen(None, at),
        }
    }

    fn up(&mut self, at: Instant) {
        self.tell(at);
    }

    fn down(&mut self, problem: &Problem, at: Instant) {
        let event = match problem.reason {
            "credentials" => Event::Failed,
            _ => Event::WatchRestart,
        };
        let error = source_error(&self.specs[0], problem.clone());
        self.fail(&error, event, at);
        self.look_for_kubeadm(problem.reason);
    }
}

/// Whether the kubeadm-style source ([`crate::source::KUBEADM_SOURCE`]) exists: one list
/// with a deadline.
async fn look_for_kubeadm_source(client: Client) -> crate::source::KubeadmSource {
    use crate::source::KubeadmSource;
    let api = Api::<ConfigMap>::namespaced(client, "kube-system");
    let params = ListParams::default().fields("metadata.name=extension-apiserver-authentication");
    match tokio::time::timeout(REQUEST_DEADLINE, api.list(&params)).await {
        Ok(Ok(list)) if list.items.is_empty() => KubeadmSource::Missing,
        Ok(Ok(_)) => KubeadmSource::Exists,
        _ => KubeadmSource::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;
    use serde_json::{Value, json};

    fn spec(text: &str) -> SourceSpec {
        text.parse().unwrap()
    }

    /// A ControllerConfig as the API serves it: `spec` as given.
    fn controllerconfig(spec: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "machineconfiguration.openshift.io/v1",
            "kind": "ControllerConfig",
            "metadata": {"name": "machine-config-controller", "resourceVersion": "7"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    fn ca_pem(cn: &str) -> Vec<u8> {
        let now = test_certs::now();
        test_certs::ca(Some(cn), None, now - 3600, now + 86400)
            .pem()
            .to_vec()
    }

    #[test]
    fn a_configmap_value_that_is_base64_of_something_else_is_left_as_it_is() {
        // "bm90IGEgY2VydA==" is base64 of "not a cert": not PEM once decoded, so the value
        // goes to the parser as it came, and its error is about what the ConfigMap holds.
        let value = b"bm90IGEgY2VydA==";
        let got = configmap_pem("configmap:ns/name", None, value).unwrap();
        assert_eq!(&*got, value);
        // Base64 of PEM is decoded.
        let pem = ca_pem("signer");
        let encoded = b64(&pem);
        let got = configmap_pem("configmap:ns/name", None, encoded.as_bytes()).unwrap();
        assert_eq!(&*got, &pem[..]);
    }

    #[test]
    fn content_gives_what_it_holds_and_nothing_for_the_other_kind() {
        let pem = ca_pem("signer");
        let certificates = crate::bundle::parse_source(&pem).unwrap();
        let held = Content::Certificates(certificates.clone());
        let given = held.clone().certificates().expect("the certificates");
        assert_eq!(given.certificates.len(), 1);
        assert_eq!(
            given.certificates[0].fingerprint(),
            certificates.certificates[0].fingerprint()
        );
        assert!(held.entries().is_none());

        let entries = Arc::new(registry::Entries {
            entries: Vec::new(),
            refused: vec![registry::Refused {
                place: registry::Place {
                    source: "dir:/etc/registries".into(),
                    part: "x".into(),
                },
                error: registry::EntryError::NoFile,
            }],
        });
        let held = Content::Entries(entries.clone());
        assert_eq!(held.clone().entries().as_deref(), Some(&*entries));
        assert!(held.certificates().is_none());
    }

    #[test]
    fn specs_of_one_object_are_grouped_whatever_their_field_or_key() {
        let sources = [
            spec("controllerconfig:machine-config-controller"),
            spec("configmap:ns/a/key1"),
            spec("file:/etc/pki/ca.crt"),
            spec("controllerconfig:machine-config-controller/cloudProviderCAData"),
            spec("configmap:ns/a/*"),
            spec("configmap:other/a/key1"),
            spec("controllerconfig:other-config"),
            spec("controllerconfig:machine-config-controller"),
        ];
        let grouped: Vec<(String, Vec<usize>)> = by_object(&sources)
            .into_iter()
            .map(|(object, indices)| (format!("{object:?}"), indices))
            .collect();
        let object = |o: ClusterObject| format!("{o:?}");
        assert_eq!(
            grouped,
            vec![
                (
                    object(ClusterObject::ControllerConfig {
                        name: "machine-config-controller".into()
                    }),
                    vec![0, 3, 7]
                ),
                (
                    object(ClusterObject::ConfigMap {
                        namespace: "ns".into(),
                        name: "a".into()
                    }),
                    vec![1, 4]
                ),
                (
                    object(ClusterObject::ConfigMap {
                        namespace: "other".into(),
                        name: "a".into()
                    }),
                    vec![5]
                ),
                (
                    object(ClusterObject::ControllerConfig {
                        name: "other-config".into()
                    }),
                    vec![6]
                ),
            ]
        );
    }

    #[test]
    fn an_optional_field_that_holds_nothing_is_content_without_certificates() {
        let cloud = spec("controllerconfig:mcc/cloudProviderCAData");
        for (how, value) in [
            ("absent", None),
            ("null", Some(Value::Null)),
            ("empty", Some(json!(""))),
            ("a lone newline", Some(json!(b64(b"\n")))),
        ] {
            let content = bundle_content(&cloud, Raw::Field(value.as_ref()))
                .unwrap_or_else(|e| panic!("{how}: {e}"));
            assert_eq!(content, SourceCertificates::default(), "{how}");
        }
        // Text that is not a bundle is still refused.
        let text = json!(b64(b"not a certificate"));
        let err = bundle_content(&cloud, Raw::Field(Some(&text))).unwrap_err();
        assert_eq!(err.reason(), "no_certificate", "{err}");
    }

    #[test]
    fn the_default_field_must_hold_a_bundle() {
        let kubelet = spec("controllerconfig:mcc");
        let err = bundle_content(&kubelet, Raw::Field(None)).unwrap_err();
        assert_eq!(err.reason(), "missing_field");
        assert_eq!(
            err.to_string(),
            "source controllerconfig:mcc: spec.kubeAPIServerServingCAData is not set"
        );
        for value in [Value::Null, json!(""), json!(b64(b"\n"))] {
            let err = bundle_content(&kubelet, Raw::Field(Some(&value))).unwrap_err();
            assert_eq!(err.reason(), "no_certificate", "{value}: {err}");
        }
    }

    #[test]
    fn a_field_that_is_not_a_base64_bundle_is_refused_naming_it() {
        let cloud = spec("controllerconfig:mcc/cloudProviderCAData");
        let object = json!({"name": "x"});
        let err = bundle_content(&cloud, Raw::Field(Some(&object))).unwrap_err();
        assert_eq!(err.reason(), "bad_base64");
        assert!(
            err.to_string()
                .contains("spec.cloudProviderCAData is not a string"),
            "{err}"
        );
        let garbage = json!("%%% not base64 %%%");
        let err = bundle_content(&cloud, Raw::Field(Some(&garbage))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "source controllerconfig:mcc/cloudProviderCAData: spec.cloudProviderCAData is not valid base64"
        );
        let list =
            json!([{"file": "registry.example.com..5000", "data": b64(&ca_pem("registry"))}]);
        for (field, value) in [
            ("imageRegistryBundleData", Some(&list)),
            ("imageRegistryBundleUserData", None),
        ] {
            let registries = spec(&format!("controllerconfig:mcc/{field}"));
            let err = bundle_content(&registries, Raw::Field(value)).unwrap_err();
            assert_eq!(err.reason(), "not_a_bundle");
            assert!(err.to_string().contains("--manage-registries"), "{err}");
        }
    }

    #[test]
    fn each_spec_of_an_object_gets_its_own_content_or_its_own_error() {
        let (kube, cloud) = (ca_pem("kube-apiserver-lb-signer"), ca_pem("cloud-ca"));
        let object = controllerconfig(json!({
            "kubeAPIServerServingCAData": b64(&kube),
            "cloudProviderCAData": b64(&cloud),
            "additionalTrustBundle": "%%%",
            "imageRegistryBundleData": [{"file": "image-registry.openshift-image-registry.svc..5000", "data": b64(&kube)}],
            "imageRegistryBundleUserData": null,
        }));
        let specs = [
            spec("controllerconfig:mcc"),
            spec("controllerconfig:mcc/additionalTrustBundle"),
            spec("controllerconfig:mcc/cloudProviderCAData"),
            spec("controllerconfig:mcc/imageRegistryBundleUserData"),
            spec("controllerconfig:mcc"),
        ];
        let results = each_spec(&specs, &bundle_content, |s| field_of(&object, s));
        let pems: Vec<Result<Vec<u8>, &'static str>> = results
            .iter()
            .map(|r| match r {
                Ok(c) => Ok(c
                    .certificates
                    .iter()
                    .flat_map(|c| c.pem().to_vec())
                    .collect()),
                Err(e) => Err(e.reason()),
            })
            .collect();
        assert_eq!(
            pems,
            vec![
                Ok(kube.clone()),
                Err("bad_base64"),
                Ok(cloud),
                Err("not_a_bundle"),
                Ok(kube)
            ]
        );
        assert_eq!(
            results[1].as_ref().unwrap_err().spec(),
            "controllerconfig:mcc/additionalTrustBundle"
        );

        // A content function of its own gets the raw JSON of a list field.
        let raw = each_spec(
            &specs[3..4],
            &|_: &SourceSpec, raw: Raw<'_>| match raw {
                Raw::Field(value) => Ok(value.cloned()),
                Raw::ConfigMap(_) => unreachable!(),
            },
            |s| field_of(&object, s),
        );
        assert_eq!(raw[0].as_ref().unwrap(), &Some(Value::Null));
        let registries = spec("controllerconfig:mcc/imageRegistryBundleData");
        let Raw::Field(Some(list)) = field_of(&object, &registries) else {
            panic!("no list");
        };
        assert_eq!(
            list[0]["file"],
            "image-registry.openshift-image-registry.svc..5000"
        );
    }

    /// A ConfigMap with these `data` keys, and these `binaryData` keys.
    fn configmap(data: &[(&str, &[u8])], binary: &[(&str, &[u8])]) -> ConfigMap {
        let text = |v: &[u8]| String::from_utf8(v.to_vec()).unwrap();
        ConfigMap {
            data: Some(data.iter().map(|(k, v)| (k.to_string(), text(v))).collect()),
            binary_data: Some(
                binary
                    .iter()
                    .map(|(k, v)| (k.to_string(), k8s_openapi::ByteString(v.to_vec())))
                    .collect(),
            ),
            ..ConfigMap::default()
        }
    }

    #[test]
    fn a_prefix_takes_the_keys_that_start_with_it_in_key_order() {
        let (kube, quay, local) = (ca_pem("kube"), ca_pem("quay"), ca_pem("local"));
        let cm = configmap(
            &[
                ("ca-bundle.crt", &kube),
                ("registry.quay.io", &quay),
                ("cloud-ca.pem", b""),
                ("registryx", b"not one of them"),
            ],
            &[("registry.local..5000", &local)],
        );
        let keys = |k: &str| Keys::Prefix(k.to_string());
        let parts = configmap_parts("s", &cm, &keys("registry.")).unwrap();
        let names: Vec<_> = parts.iter().map(|(p, _)| p.clone().unwrap()).collect();
        assert_eq!(names, ["key registry.local..5000", "key registry.quay.io"]);
        assert_eq!(parts[1].1, &quay[..]);
        // As a bundle: the certificates of those keys, in key order.
        let bundle = spec("configmap:ns/cm/registry.*");
        let content = bundle_content(&bundle, Raw::ConfigMap(&cm)).unwrap();
        let pems: Vec<u8> = content
            .certificates
            .iter()
            .flat_map(|c| c.pem().to_vec())
            .collect();
        assert_eq!(pems, [local.clone(), quay.clone()].concat());
        // No key with the prefix: no part, and as a bundle no certificate.
        assert!(
            configmap_parts("s", &cm, &keys("none."))
                .unwrap()
                .is_empty()
        );
        let none = spec("configmap:ns/cm/none.*");
        let err = bundle_content(&none, Raw::ConfigMap(&cm)).unwrap_err();
        assert_eq!(err.reason(), "no_certificate");
    }

    /// A ConfigMap value is PEM, base64 of PEM (`kubeconfig-data`), or a kubeconfig
    /// (`cluster-info`), whose clusters' CA data is taken; a kubeconfig with a user's
    /// token is refused whole, without the token in the error.
    #[test]
    fn a_configmap_value_may_be_base64_of_pem_or_a_kubeconfig_without_credentials() {
        let (a, b) = (ca_pem("a"), ca_pem("b"));
        let info = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: \"\"\n  cluster:\n    certificate-authority-data: {}\n    server: https://cp:6443\n",
            b64(&b)
        );
        let wrapped = b64(&a)
            .as_bytes()
            .chunks(76)
            .map(|l| format!("{}\n", std::str::from_utf8(l).unwrap()))
            .collect::<String>();
        let cm = configmap(
            &[
                ("ca-bundle.crt", wrapped.as_bytes()),
                ("kubeconfig", info.as_bytes()),
            ],
            &[],
        );
        let cns = |source: &str| {
            bundle_content(&spec(source), Raw::ConfigMap(&cm))
                .unwrap()
                .certificates
                .iter()
                .map(|c| c.subject_cn.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(cns("configmap:ns/cm"), ["a"]);
        assert_eq!(cns("configmap:ns/cm/kubeconfig"), ["b"]);
        assert_eq!(cns("configmap:ns/cm/*"), ["a", "b"]);
        let with_token = format!("{info}users:\n- name: u\n  user:\n    token: hunter2\n");
        let cm = configmap(&[("kubeconfig", with_token.as_bytes())], &[]);
        let err =
            bundle_content(&spec("configmap:ns/cm/kubeconfig"), Raw::ConfigMap(&cm)).unwrap_err();
        assert_eq!(err.reason(), "kubeconfig_credentials");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        // Base64 of something that is not PEM stays what it was: rejected as such.
        let cm = configmap(&[("ca-bundle.crt", b64(b"not pem").as_bytes())], &[]);
        let err = bundle_content(&spec("configmap:ns/cm"), Raw::ConfigMap(&cm)).unwrap_err();
        assert_ne!(err.reason(), "kubeconfig_credentials");
    }

    #[test]
    fn a_registry_set_reads_prefixed_keys_with_the_prefix_taken_off() {
        let (quay, local) = (ca_pem("quay"), ca_pem("local"));
        let cm = configmap(
            &[
                ("ca-bundle.crt", &ca_pem("kube")),
                ("cloud-ca.pem", b""),
                ("registry.quay.io", &quay),
            ],
            &[("registry.local..5000", &local)],
        );
        let prefixed = spec("configmap:ns/cm/registry.*");
        let entries = registry_content(&prefixed, Raw::ConfigMap(&cm)).unwrap();
        let names: Vec<(&str, &str)> = entries
            .entries
            .iter()
            .map(|e| (e.name.raw(), e.name.dir()))
            .collect();
        assert_eq!(
            names,
            [("local..5000", "local:5000"), ("quay.io", "quay.io")]
        );
        assert_eq!(entries.entries[1].content, Ok(quay));
        assert_eq!(
            entries.entries[0].place.to_string(),
            "configmap:ns/cm/registry.* (local..5000)"
        );
        assert!(entries.refused.is_empty());
        // Every key: the publisher's other keys are not registries.
        let all = registry_content(&spec("configmap:ns/cm/*"), Raw::ConfigMap(&cm)).unwrap();
        assert_eq!(all.entries.len(), 4, "{all:?}");
    }

    #[test]
    fn an_empty_key_is_nothing_to_keep_for_a_managed_file_and_rejected_for_the_bundle() {
        let cloud = ca_pem("cloud");
        for (how, value) in [("empty", &b""[..]), ("blank", b" \n\r\n\t")] {
            let cm = configmap(&[("cloud-ca.pem", value)], &[]);
            let managed = spec("configmap:ns/cm/cloud-ca.pem");
            let content = optional_bundle_content(&managed, Raw::ConfigMap(&cm))
                .unwrap_or_else(|e| panic!("{how}: {e}"));
            assert_eq!(content, SourceCertificates::default(), "{how}");
            let err = bundle_content(&managed, Raw::ConfigMap(&cm)).unwrap_err();
            assert_eq!(err.reason(), "no_certificate", "{how}");
        }
        // A key with content is read as the bundle reads it: a key is still refused.
        let cm = configmap(&[("cloud-ca.pem", &cloud)], &[]);
        let managed = spec("configmap:ns/cm/cloud-ca.pem");
        let content = optional_bundle_content(&managed, Raw::ConfigMap(&cm)).unwrap();
        assert_eq!(content.certificates.len(), 1);
        let text = b"not a certificate".to_vec();
        let cm = configmap(&[("cloud-ca.pem", &text)], &[]);
        let err = optional_bundle_content(&managed, Raw::ConfigMap(&cm)).unwrap_err();
        assert_eq!(err.reason(), "no_certificate");
        // A missing key is still missing, and a ControllerConfig field reads as before.
        let cm = configmap(&[], &[]);
        let err = optional_bundle_content(&managed, Raw::ConfigMap(&cm)).unwrap_err();
        assert_eq!(err.reason(), "missing_key");
        let kube = spec("controllerconfig:mcc");
        let err = optional_bundle_content(&kube, Raw::Field(Some(&json!("")))).unwrap_err();
        assert_eq!(err.reason(), "no_certificate");
    }

    #[test]
    fn an_event_made_into_another_kind_keeps_its_failures() {
        let failed = || SourceError::NotFound { spec: "s".into() };
        let doubled = |n: u32| Some(n * 2);
        assert!(matches!(
            Event::Content(4).filter_map(doubled),
            Some(Event::Content(8))
        ));
        assert!(Event::Content(4).filter_map(|_| None::<u32>).is_none());
        assert!(matches!(
            Event::<u32>::Failed(failed()).filter_map(doubled),
            Some(Event::Failed(SourceError::NotFound { .. }))
        ));
        assert!(matches!(
            Event::<u32>::WatchRestart(failed()).filter_map(doubled),
            Some(Event::WatchRestart(SourceError::NotFound { .. }))
        ));
    }

    #[test]
    fn a_controllerconfig_list_is_a_registry_sets_entries_and_a_bundle_source_is_none() {
        let (one, two) = (ca_pem("one"), ca_pem("two"));
        let list = json!([
            {"file": "one.example.com", "data": b64(&one)},
            {"file": "two.example.com..5000", "data": b64(&two)},
        ]);
        let spec_ = spec("controllerconfig:mcc/imageRegistryBundleData");
        let entries = registry_content(&spec_, Raw::Field(Some(&list))).unwrap();
        let names: Vec<&str> = entries.entries.iter().map(|e| e.name.dir()).collect();
        assert_eq!(names, ["one.example.com", "two.example.com:5000"]);
        assert_eq!(entries.entries[0].content, Ok(one));
        // Absent: no registry, not a failure.
        let none = registry_content(&spec_, Raw::Field(None)).unwrap();
        assert!(none.entries.is_empty() && none.refused.is_empty());
        // A bundle's source is not a registry source.
        let err = registry_content(&spec("configmap:ns/cm"), Raw::Field(Some(&list))).unwrap_err();
        assert_eq!(err.reason(), "not_a_registry_source");
    }

    /// The list that stands for a watch's first state asks for the one object by name, as
    /// the watch does, so that RBAC by resourceNames allows both.
    #[test]
    fn the_list_selects_the_one_object_by_name() {
        assert_eq!(
            selector("kube-apiserver-client-ca"),
            "metadata.name=kube-apiserver-client-ca"
        );
    }
}
