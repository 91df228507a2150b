//! Cluster sources, read through kube-rs: a ConfigMap (one key, or every key of `data` and
//! `binaryData`) and a field of a ControllerConfig's `spec` (base64 of PEM, or a registry
//! list handed raw to its reader).
//!
//! Each object that sources read has one long-lived watch, shared by every spec that reads
//! it (several fields of a ControllerConfig, several keys of a ConfigMap: SPEC 4b, one watch
//! per object). It watches the single named object (field selector `metadata.name`, so RBAC
//! by resourceNames is enough): list once, then watch with bookmarks, resume from the last
//! resourceVersion after a disconnect, list again at once after `410 Gone`, and back off
//! with jitter between failures by what failed, all as [`super::lifecycle`] decides. In
//! steady state it makes no list. Each state of the object
//! becomes one update per spec, with that spec's own content or its own error: a bad field
//! for one spec does not fail the others.
//!
//! The loop is written here rather than taken from kube-runtime's `watcher` because the
//! watcher hides what tells a live watch from a dead one: it swallows bookmarks and the
//! clean end of a watch, and waits without limit on a request the server took and never
//! answered. Here every request has a deadline and an open watch that stays silent (no event,
//! no bookmark, no end) for [`WATCH_SILENCE`] is taken for dead and reported.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, WatchEvent, WatchParams};
use kube::core::Status;

use super::lifecycle::{self, Action, Failure, Happened, Report, Watch};
use super::{DEFAULT_CONTROLLERCONFIG_FIELD, Keys, SourceError, SourceSpec, parse_parts};
use crate::bundle::SourceCertificates;
use crate::credentials::{Credentials, Current};
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

/// How long a list, or the start of a watch, may go unanswered before the API server counts as
/// not answering. A single object by field selector comes back in milliseconds, and
/// kube-apiserver answers a request it cannot finish within its own 60 s limit with a 504, so
/// this only trips on a server (or a proxy) that took the request and went silent.
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

/// What went wrong with a request to `server`, and its kind for the watch's lifecycle: the
/// API server's answer, or what kept the request from reaching it, said the way an operator
/// can act on (`https://HOST:PORT: connection refused`, `... TLS: ...`), never the client
/// library's bare `client error (Connect)`. A server that could not be reached at all
/// (refused, reset, timed out) is [`Failure::Unreachable`]; a TLS failure is an answer.
pub(crate) fn request_error(
    spec: &str,
    server: &str,
    error: &kube::Error,
) -> (SourceError, Failure) {
    let source_error = match error {
        kube::Error::Api(status) => status_error(spec, status),
        other => {
            let (reason, cause) = transport_cause(other);
            SourceError::Cluster {
                spec: spec.to_string(),
                reason,
                error: format!("{server}: {cause}"),
            }
        }
    };
    (source_error, failure_of(error))
}

/// The kind of failure `error` is, for a backoff ([`lifecycle::Backoff`]): a server that
/// could not be reached at all (refused, reset, timed out), `410 Gone`, or a failure the
/// server answered (a TLS failure among them), with the wait it asked for.
pub fn failure_of(error: &kube::Error) -> Failure {
    match error {
        kube::Error::Api(status) => status_failure(status),
        other => match transport_cause(other).0 {
            "unreachable" => Failure::Unreachable,
            _ => Failure::ANSWERED,
        },
    }
}

/// The cause of a request that got no answer, from the innermost error that says it: a TLS
/// failure (reason `tls`), a refused, reset or timed-out connection, or a failed name
/// lookup (reason `unreachable`).
pub fn transport_cause(error: &(dyn std::error::Error + 'static)) -> (&'static str, String) {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error);
    let mut innermost = error.to_string();
    let mut dns = false;
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return ("tls", tls_problem(tls));
        }
        let io = e.downcast_ref::<std::io::Error>();
        if let Some(io) = io {
            use std::io::ErrorKind::*;
            let said = match io.kind() {
                ConnectionRefused => Some("connection refused"),
                ConnectionReset => Some("connection reset by the server"),
                ConnectionAborted => Some("connection aborted"),
                TimedOut => Some("connection timed out"),
                HostUnreachable => Some("no route to the host"),
                NetworkUnreachable => Some("the network is unreachable"),
                _ => None,
            };
            if let Some(said) = said {
                return ("unreachable", said.to_string());
            }
        }
        let text = e.to_string();
        dns |= text.contains("dns error");
        innermost = text;
        // An I/O error wrapping another error (TLS errors come as one inside another) says
        // where it came from through get_ref(): its source() skips the wrapped error.
        next = match io.and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    let innermost = printable(&innermost);
    if dns {
        ("unreachable", format!("DNS lookup failed: {innermost}"))
    } else {
        ("unreachable", innermost)
    }
}

/// A TLS failure, as the one line that tells what to fix.
fn tls_problem(error: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    match error {
        rustls::Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer => "TLS: unknown authority: the server's certificate is not signed by a CA the agent trusts for it".to_string(),
            C::Expired | C::ExpiredContext { .. } => "TLS: the server's certificate has expired".to_string(),
            C::NotValidYet | C::NotValidYetContext { .. } => "TLS: the server's certificate is not valid yet (is the clock right?)".to_string(),
            C::NotValidForName | C::NotValidForNameContext { .. } => "TLS: the server's certificate is not valid for this host name".to_string(),
            // A trusted CA of the same name, with another key: a serving CA rotated under
            // the same subject, as clusters do.
            C::BadSignature => "TLS: unknown authority: the server's certificate is not signed by a CA the agent trusts for it (one of the same name is trusted, with another key)".to_string(),
            other => format!("TLS: the server's certificate is not valid: {other:?}"),
        },
        rustls::Error::AlertReceived(alert) => {
            format!("TLS: the server refused the handshake ({alert:?}); is the client certificate one it accepts?")
        }
        other => format!("TLS: {other}"),
    }
}

/// Whether a failure says that the credentials may be stale: refused as unauthorized, or a
/// server certificate that the trusted CAs do not sign (the server moved to a new CA).
fn proves_stale(error: &SourceError) -> bool {
    matches!(
        error,
        SourceError::Cluster {
            reason: "unauthorized" | "tls",
            ..
        }
    )
}

/// `error`, with what the agent knows of its own credentials when they are the likely cause:
/// an expired client certificate, or the CA the server's certificate was checked against.
fn with_credentials_hint(error: SourceError, current: &Current) -> SourceError {
    let SourceError::Cluster {
        spec,
        reason,
        error,
    } = error
    else {
        return error;
    };
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let hint = match reason {
        "unauthorized" => current.client_certificate().and_then(|cert| {
            cert.is_expired_at(now).then(|| {
                format!(
                    " (the client certificate in use, {}, expired at {}: the agent reads the credentials again and uses the new certificate as soon as it is on disk)",
                    current.client_certificate_origin.as_deref().unwrap_or("?"),
                    crate::text::rfc3339(cert.not_after)
                )
            })
        }),
        "tls" => current
            .ca_origin
            .as_deref()
            .map(|ca| format!(" (trusted for it: {ca})")),
        _ => None,
    };
    SourceError::Cluster {
        spec,
        reason,
        error: format!("{error}{}", hint.unwrap_or_default()),
    }
}

/// An error answer: a metav1 Status, or what kube-rs made of a body that was not one (an HTML
/// page or an empty body from a proxy or load balancer).
fn status_error(spec: &str, status: &Status) -> SourceError {
    let reason = match status.code {
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        410 => "expired",
        _ => "api_error",
    };
    let code = status.code;
    let error = if status.reason == "Failed to parse error data" {
        // kube-rs puts the raw body in the message when it is not a Status.
        match printable(&status.message) {
            body if body.is_empty() => format!(
                "HTTP {code} with an empty body, not a Kubernetes Status (a proxy or load balancer between here and the API server?)"
            ),
            body => format!(
                "HTTP {code} with a body that is not a Kubernetes Status (a proxy or load balancer between here and the API server?): {body}"
            ),
        }
    } else {
        format!(
            "HTTP {code} {}: {}",
            printable(&status.reason),
            printable(&status.message)
        )
    };
    SourceError::Cluster {
        spec: spec.to_string(),
        reason,
        error,
    }
}

/// Text from the API server or a proxy, made safe for one log line or a health page: control
/// characters and runs of whitespace become one space, and it is cut at 300 characters.
fn printable(text: &str) -> String {
    const MAX: usize = 300;
    let mut out = String::new();
    for word in text.split(|c: char| c.is_whitespace() || c.is_control()) {
        if word.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    match out.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &out[..cut]),
        None => out,
    }
}

/// `request` to `server`, unless it takes longer than [`REQUEST_DEADLINE`].
async fn within<T>(
    spec: &str,
    server: &str,
    what: &str,
    request: impl Future<Output = kube::Result<T>>,
) -> Result<T, SourceError> {
    requested(spec, server, what, request)
        .await
        .map_err(|(error, _)| error)
}

/// [`within`], with a failure told apart as the watch's lifecycle needs it.
async fn requested<T>(
    spec: &str,
    server: &str,
    what: &str,
    request: impl Future<Output = kube::Result<T>>,
) -> Result<T, (SourceError, Failure)> {
    match tokio::time::timeout(REQUEST_DEADLINE, request).await {
        Ok(answer) => answer.map_err(|e| request_error(spec, server, &e)),
        Err(_) => Err((
            SourceError::Cluster {
                spec: spec.to_string(),
                reason: "no_answer",
                error: format!(
                    "{server}: the API server took the {what} request and sent no answer within {}s (hung, or a proxy in the way is)",
                    REQUEST_DEADLINE.as_secs()
                ),
            },
            Failure::Hung,
        )),
    }
}

/// The kind of failure an error answer is: `410 Gone`; a gateway with no API server behind
/// it (a 502, 503 or 504 that is not a Kubernetes Status and asks for no wait: a load
/// balancer whose backends are all down answers so, and it is the API server that cannot be
/// reached); or a failure the server answered, with the wait it asked for
/// (`retryAfterSeconds`, where the `Retry-After` header of an answer is put too:
/// [`crate::credentials::client`]).
fn status_failure(status: &Status) -> Failure {
    if status.code == 410 {
        return Failure::Expired;
    }
    let retry_after = status
        .details
        .as_ref()
        .map(|details| details.retry_after_seconds)
        .filter(|seconds| *seconds > 0)
        .map(|seconds| Duration::from_secs(seconds.into()));
    let not_a_status = status.reason == "Failed to parse error data";
    if matches!(status.code, 502..=504) && not_a_status && retry_after.is_none() {
        return Failure::Unreachable;
    }
    Failure::Answered { retry_after }
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
    T: Clone + Send + 'static,
    C: Fn(&SourceSpec, Raw<'_>) -> Result<T, SourceError> + Send + Sync + 'static,
    S: Fn(usize, Event<T>, Instant) + Send + Sync + 'static,
{
    let (content, send) = (Arc::new(content), Arc::new(send));
    for (object, indices) in by_object(sources) {
        let specs = indices.iter().map(|&i| sources[i].clone()).collect();
        tokio::spawn(watch_object(
            credentials.clone(),
            object,
            indices,
            specs,
            content.clone(),
            send.clone(),
        ));
    }
}

/// Watches one object for as long as the process runs, for `specs` (at `indices` of the
/// caller's list), sending every change.
async fn watch_object<T, C, S>(
    credentials: Credentials,
    object: ClusterObject,
    indices: Vec<usize>,
    specs: Vec<SourceSpec>,
    content: Arc<C>,
    send: Arc<S>,
) where
    T: Clone,
    C: Fn(&SourceSpec, Raw<'_>) -> Result<T, SourceError>,
    S: Fn(usize, Event<T>, Instant),
{
    let names: Vec<String> = specs.iter().map(ToString::to_string).collect();
    let send = |i: usize, event, at| send(indices[i], event, at);
    match &object {
        ClusterObject::ConfigMap { namespace, name } => {
            let api = |client| Api::<ConfigMap>::namespaced(client, namespace);
            let content = |cm: &ConfigMap| each_spec(&specs, &*content, |_| Raw::ConfigMap(cm));
            follow(credentials, api, name, &names, content, send).await;
        }
        ClusterObject::ControllerConfig { name } => {
            let api = |client| Api::<DynamicObject>::all_with(client, &controllerconfig_resource());
            let content =
                |cc: &DynamicObject| each_spec(&specs, &*content, |spec| field_of(cc, spec));
            follow(credentials, api, name, &names, content, send).await;
        }
    }
}

/// Watches the ConfigMap `namespace/name` for as long as the process runs (as a source is
/// watched: one list, then watches resumed from the last resourceVersion), sending what
/// `content` makes of each state of it. `spec` names it in errors.
pub async fn watch_configmap<T: Clone>(
    credentials: Credentials,
    namespace: &str,
    name: &str,
    spec: &str,
    content: impl Fn(&ConfigMap) -> Result<T, SourceError>,
    send: impl Fn(Event<T>, Instant),
) {
    let api = |client| Api::<ConfigMap>::namespaced(client, namespace);
    let content = |cm: &ConfigMap| vec![content(cm)];
    let send = |_, event, at| send(event, at);
    follow(credentials, api, name, &[spec.to_string()], content, send).await;
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

/// The watch loop shared by both kinds of object, for the specs named `specs` that read it:
/// the effects of the state machine in [`lifecycle`], which decides every step (what to
/// request, how long to wait, when the source is up or down).
///
/// `content` makes of each state of the object one result per spec, in the order of
/// `specs`; `send` gets each spec's event with the spec's position in `specs` and the
/// instant its cause arrived (the list answer, the watch event, the failure), taken before
/// `content` parses the object, so that the sync duration includes parsing and validation.
/// What befalls the object itself (a failed request, its absence) goes to every spec, each
/// error naming its own spec.
///
/// A failure is sent as a [`SourceEvent::WatchRestart`] (the source is down, its last good
/// content stays). A watch that is established again after a failure sends the object as
/// last seen again: a resumed watch brings no event when nothing changed, and this is what
/// tells the reconciler that the source is back.
///
/// Each request uses the newest client of `credentials`. When the credentials change, an
/// open watch is resumed with the new client from the resourceVersion it had reached (no
/// list), and a wait ends; until there are any usable credentials, the source is reported
/// down with why. A 401, or a server certificate the trusted CAs do not sign, makes the
/// credentials be read again at once.
async fn follow<K, T: Clone>(
    mut credentials: Credentials,
    api_for: impl Fn(Client) -> Api<K>,
    object: &str,
    specs: &[String],
    content: impl Fn(&K) -> Vec<Result<T, SourceError>>,
    send: impl Fn(usize, Event<T>, Instant),
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    // The loop's own errors are made naming the first spec, and told to each under its name.
    let spec = specs[0].as_str();
    let list_params = ListParams::default().fields(&selector(object));
    let watch_params = WatchParams::default()
        .fields(&selector(object))
        .timeout(WATCH_TIMEOUT_SECONDS);
    let mut current: LastSeen<T> = LastSeen::Missing;
    // A failure of the object's reading, to every spec.
    let fail = |error: &SourceError, event: fn(SourceError) -> Event<T>, at: Instant| {
        for (i, name) in specs.iter().enumerate() {
            send(i, event(error.for_spec(name)), at);
        }
    };
    // The object as last seen, to every spec.
    let tell = |last: &LastSeen<T>, at: Instant| match last {
        LastSeen::Missing => {
            let missing = SourceError::NotFound {
                spec: spec.to_string(),
            };
            fail(&missing, Event::Failed, at);
        }
        LastSeen::Seen(results) => {
            for (i, result) in results.iter().enumerate() {
                let event = match result {
                    Ok(content) => Event::Content(content.clone()),
                    Err(error) => Event::Failed(error.clone()),
                };
                send(i, event, at);
            }
        }
    };
    // What an object seen now means for each spec, told and kept.
    let seen = |k: Option<K>, at: Instant| {
        let last = match k {
            Some(k) => {
                let results = content(&k);
                debug_assert_eq!(results.len(), specs.len());
                LastSeen::Seen(results)
            }
            None => LastSeen::Missing,
        };
        tell(&last, at);
        last
    };
    let (mut watch, mut action) = Watch::start();
    // Whether the kubeadm-style source was looked for (once, after the default failed).
    let mut kubeadm_looked = false;
    // The open watch, and the generation of the credentials whose client opened it.
    let mut open: Option<(BoxStream<'static, kube::Result<WatchEvent<K>>>, u64)> = None;
    // When the open watch was last heard from.
    let mut heard = tokio::time::Instant::now();
    loop {
        // The newest client, for the next request.
        let creds = credentials.mark_seen();
        let Some(client) = creds.client.clone() else {
            if creds.read {
                let error = SourceError::Credentials {
                    spec: spec.to_string(),
                    problem: creds.why_none(),
                };
                fail(&error, Event::Failed, Instant::now());
                watch.lost();
            }
            credentials.changed().await;
            continue;
        };
        let server = creds.server.as_deref().unwrap_or("the API server");
        let api = api_for(client);
        // What went wrong this turn, for the report; whether the object was told this turn.
        let mut trouble: Option<SourceError> = None;
        let mut told = false;
        let happened = match &action {
            Action::List => match requested(spec, server, "list", api.list(&list_params)).await {
                Ok(list) => match list.metadata.resource_version.filter(|rv| !rv.is_empty()) {
                    Some(rv) => {
                        let arrived = Instant::now();
                        current = seen(list.items.into_iter().next(), arrived);
                        told = true;
                        Happened::Listed { rv }
                    }
                    None => {
                        trouble = Some(SourceError::Cluster {
                            spec: spec.to_string(),
                            reason: "api_error",
                            error: "the list came without a resourceVersion to watch from".into(),
                        });
                        Happened::Failed(Failure::ANSWERED)
                    }
                },
                Err((error, failure)) => {
                    trouble = Some(error);
                    Happened::Failed(failure)
                }
            },
            Action::Watch { rv } => {
                match requested(spec, server, "watch", api.watch(&watch_params, rv)).await {
                    Ok(events) => {
                        open = Some((events.boxed(), creds.generation));
                        heard = tokio::time::Instant::now();
                        Happened::Opened
                    }
                    Err((error, failure)) => {
                        trouble = Some(error);
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
                Some((events, _)) => {
                    let heard_now = tokio::select! {
                        next = tokio::time::timeout_at(heard + WATCH_SILENCE, events.next()) => Heard::Next(next),
                        () = sleep_until_some(*confirm_at) => Heard::Quiet,
                        () = credentials.changed() => Heard::Credentials,
                    };
                    match heard_now {
                        Heard::Quiet => Happened::StayedOpen,
                        // The top of the loop decides: a new client (a new generation)
                        // resumes the watch; a problem with the credentials on disk leaves
                        // the client, and the watch, as they are (SPEC 6: the last good
                        // credentials are kept).
                        Heard::Credentials => continue,
                        Heard::Next(next) => {
                            let arrived = Instant::now();
                            heard = tokio::time::Instant::now();
                            let read = watch_item(next, spec, server, watch.rv());
                            trouble = read.trouble;
                            if let Some(object) = read.object {
                                current = seen(object, arrived);
                                told = true;
                            }
                            read.happened
                        }
                    }
                }
            },
            Action::Wait { until } => {
                // A new client ends the wait: new credentials are likely what the failure
                // was waiting for. (There is a client here, and there is one from then on:
                // a problem with the credentials on disk keeps the last good one.)
                if credentials.newer_before(creds.generation, *until).await {
                    Happened::NewCredentials
                } else {
                    Happened::Waited
                }
            }
        };
        // The default source missing or refused: said once, with the kubeadm-style
        // source when the cluster has it (SPEC 3).
        if !kubeadm_looked && spec == crate::source::DEFAULT_SOURCE {
            let reason = match (&trouble, &current) {
                (Some(error), _) => Some(error.reason()),
                (None, LastSeen::Missing) if told => Some("not_found"),
                _ => None,
            };
            if let Some(reason) = reason.filter(|r| matches!(*r, "not_found" | "forbidden"))
                && let Some(client) = creds.client.clone()
            {
                kubeadm_looked = true;
                let found = look_for_kubeadm_source(client).await;
                if let Some(hint) = crate::source::kubeadm_hint(spec, reason, found) {
                    tracing::warn!(
                        source = spec,
                        "source {spec} cannot be read ({reason}){hint}"
                    );
                }
            }
        }
        if happened == Happened::Failed(Failure::Expired) {
            tracing::info!(
                source = spec,
                "the API server no longer has the watch's resourceVersion (410 Gone, as after a restart): listing again"
            );
        }
        let step = watch.step(happened, tokio::time::Instant::now(), lifecycle::jitter());
        if let Some(back) = &step.went_back {
            tracing::warn!(
                source = spec,
                from = %back.from,
                to = %back.to,
                "the API server's store went back: its resourceVersion is now {} where this watch had reached {} (a store restored from a backup?); following what it holds now",
                back.to,
                back.from,
            );
        }
        match step.report {
            Report::Down => {
                let error = trouble.unwrap_or_else(|| SourceError::Cluster {
                    spec: spec.to_string(),
                    reason: "api_error",
                    error: format!("{server}: the watch failed"),
                });
                if proves_stale(&error) {
                    credentials.stale();
                }
                let error = with_credentials_hint(error, &creds);
                fail(&error, Event::WatchRestart, Instant::now());
            }
            Report::Up if !told => tell(&current, Instant::now()),
            Report::Up | Report::Nothing => {}
        }
        if !matches!(step.action, Action::Read { .. }) {
            open = None;
        }
        action = step.action;
    }
}

/// Whether the kubeadm-style source ([`crate::source::KUBEADM_SOURCE`]) exists: one list
/// with a deadline.
async fn look_for_kubeadm_source(client: Client) -> crate::source::KubeadmSource {
    use crate::source::KubeadmSource;
    let api = Api::<ConfigMap>::namespaced(client, "kube-system");
    let params = ListParams::default().fields(&selector("extension-apiserver-authentication"));
    match tokio::time::timeout(REQUEST_DEADLINE, api.list(&params)).await {
        Ok(Ok(list)) if list.items.is_empty() => KubeadmSource::Missing,
        Ok(Ok(_)) => KubeadmSource::Exists,
        _ => KubeadmSource::Unknown,
    }
}

/// What an item of an open watch means, for the lifecycle and the loop.
struct WatchItem<K> {
    happened: Happened,
    /// What went wrong, for the report.
    trouble: Option<SourceError>,
    /// The object's new state when the item brought one: `Some(None)` when it was deleted.
    object: Option<Option<K>>,
}

/// What `next` (the next item of an open watch, or its silence for [`WATCH_SILENCE`])
/// means; `rv` is where the watch stands, for an event whose object names no
/// resourceVersion. Pure: the loop's effects are left to it.
fn watch_item<K: kube::Resource>(
    next: Result<Option<kube::Result<WatchEvent<K>>>, tokio::time::error::Elapsed>,
    spec: &str,
    server: &str,
    rv: Option<&str>,
) -> WatchItem<K> {
    let item = |happened, trouble, object| WatchItem {
        happened,
        trouble,
        object,
    };
    let at_rv = |k: &K| {
        k.meta()
            .resource_version
            .clone()
            .or_else(|| rv.map(str::to_string))
            .unwrap_or_default()
    };
    match next {
        Ok(Some(Ok(WatchEvent::Added(k) | WatchEvent::Modified(k)))) => {
            let rv = at_rv(&k);
            item(Happened::Delivered { rv }, None, Some(Some(k)))
        }
        Ok(Some(Ok(WatchEvent::Deleted(k)))) => {
            let rv = at_rv(&k);
            item(Happened::Delivered { rv }, None, Some(None))
        }
        Ok(Some(Ok(WatchEvent::Bookmark(bookmark)))) => {
            let rv = bookmark.metadata.resource_version;
            item(Happened::Delivered { rv }, None, None)
        }
        // The server ended the watch (its timeout, or a connection that closed between
        // events). Said only if the lifecycle takes it for a failure: when it came before
        // the watch was established, again.
        Ok(None) => {
            let ended = SourceError::Cluster {
                spec: spec.to_string(),
                reason: "watch_ended",
                error: format!(
                    "{server}: the watch ended as soon as it was opened (a proxy that cuts streams?)"
                ),
            };
            item(Happened::Ended, Some(ended), None)
        }
        Ok(Some(Ok(WatchEvent::Error(status)))) => {
            let failure = status_failure(&status);
            item(
                Happened::Failed(failure),
                Some(status_error(spec, &status)),
                None,
            )
        }
        Ok(Some(Err(error))) => {
            let (error, failure) = request_error(spec, server, &error);
            item(Happened::Failed(failure), Some(error), None)
        }
        Err(_silent) => {
            let silent = SourceError::Cluster {
                spec: spec.to_string(),
                reason: "watch_silent",
                error: format!(
                    "{server}: the watch sent nothing for {}s (no event, no bookmark, no end at its {WATCH_TIMEOUT_SECONDS}s timeout): the API server or the connection to it is hung; watching again",
                    WATCH_SILENCE.as_secs()
                ),
            };
            item(Happened::Failed(Failure::Hung), Some(silent), None)
        }
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
    fn each_error_answer_is_the_kind_of_failure_that_says_how_long_to_wait() {
        let status = |code: u16, body: &str| -> Status {
            match serde_json::from_str::<Status>(body) {
                Ok(status) => status,
                Err(_) => Status::failure(body, "Failed to parse error data").with_code(code),
            }
        };
        let json = |code: u16, reason: &str, retry: u32| {
            format!(
                r#"{{"kind":"Status","status":"Failure","reason":"{reason}","code":{code},"details":{{"retryAfterSeconds":{retry}}}}}"#
            )
        };
        let seconds = |s| Some(Duration::from_secs(s));
        let cases = [
            (status(410, &json(410, "Expired", 0)), Failure::Expired),
            // A load balancer with no API server behind it.
            (
                status(502, "<html>502 Bad Gateway</html>"),
                Failure::Unreachable,
            ),
            (status(503, ""), Failure::Unreachable),
            (status(504, "upstream timed out"), Failure::Unreachable),
            // The API server itself, failing or shedding load.
            (
                status(503, &json(503, "ServiceUnavailable", 0)),
                Failure::ANSWERED,
            ),
            (
                status(500, &json(500, "InternalError", 0)),
                Failure::ANSWERED,
            ),
            (
                status(429, &json(429, "TooManyRequests", 7)),
                Failure::Answered {
                    retry_after: seconds(7),
                },
            ),
            (
                status(504, &json(504, "Timeout", 1)),
                Failure::Answered {
                    retry_after: seconds(1),
                },
            ),
            (status(403, &json(403, "Forbidden", 0)), Failure::ANSWERED),
            (status(500, "oops"), Failure::ANSWERED),
        ];
        for (status, kind) in cases {
            assert_eq!(status_failure(&status), kind, "{status:?}");
        }
        // A shedding server's plain-text 429, with the wait carried into its details.
        let mut shed = status(429, "Too many requests, please try again later.");
        shed.details = serde_json::from_str(r#"{"retryAfterSeconds":20}"#).ok();
        assert_eq!(
            status_failure(&shed),
            Failure::Answered {
                retry_after: seconds(20)
            }
        );
        shed.code = 503;
        assert_eq!(
            status_failure(&shed),
            Failure::Answered {
                retry_after: seconds(20)
            }
        );
    }

    /// The silence of a watch, as `timeout_at` reports it.
    async fn silence() -> tokio::time::error::Elapsed {
        tokio::time::timeout(Duration::ZERO, std::future::pending::<()>())
            .await
            .unwrap_err()
    }

    fn configmap_at(rv: Option<&str>) -> ConfigMap {
        let mut cm = configmap(&[("ca-bundle.crt", b"x")], &[]);
        cm.metadata.resource_version = rv.map(str::to_string);
        cm
    }

    #[tokio::test]
    async fn each_item_of_a_watch_is_what_it_tells_the_lifecycle() {
        let read = |next| watch_item::<ConfigMap>(next, "s", "https://api:6443", Some("5"));
        // A change brings the object and its resourceVersion; one without a resourceVersion
        // keeps the watch's.
        let added = read(Ok(Some(Ok(WatchEvent::Added(configmap_at(Some("7")))))));
        assert_eq!(added.happened, Happened::Delivered { rv: "7".into() });
        assert!(matches!(added.object, Some(Some(_))) && added.trouble.is_none());
        let modified = read(Ok(Some(Ok(WatchEvent::Modified(configmap_at(None))))));
        assert_eq!(modified.happened, Happened::Delivered { rv: "5".into() });
        let deleted = read(Ok(Some(Ok(WatchEvent::Deleted(configmap_at(Some("9")))))));
        assert_eq!(deleted.happened, Happened::Delivered { rv: "9".into() });
        assert!(matches!(deleted.object, Some(None)));
        // A bookmark moves the watch on and brings no object.
        let bookmark: WatchEvent<ConfigMap> = serde_json::from_value(json!({
            "type": "BOOKMARK",
            "object": {"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"resourceVersion": "12"}}
        }))
        .unwrap();
        let marked = read(Ok(Some(Ok(bookmark))));
        assert_eq!(marked.happened, Happened::Delivered { rv: "12".into() });
        assert!(marked.object.is_none() && marked.trouble.is_none());
        // The end, with what to say should it be a failure.
        let ended = read(Ok(None));
        assert_eq!(ended.happened, Happened::Ended);
        assert_eq!(ended.trouble.unwrap().reason(), "watch_ended");
        // An ERROR event: its Status says which failure.
        let expired: WatchEvent<ConfigMap> = serde_json::from_value(json!({
            "type": "ERROR",
            "object": {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410, "message": "too old resource version: 5 (40)"}
        }))
        .unwrap();
        let gone = read(Ok(Some(Ok(expired))));
        assert_eq!(gone.happened, Happened::Failed(Failure::Expired));
        assert_eq!(gone.trouble.unwrap().reason(), "expired");
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
        // Silence: a failure the server answered (it took the watch and went quiet).
        let silent = read(Err(silence().await));
        assert_eq!(silent.happened, Happened::Failed(Failure::Hung));
        let why = silent.trouble.unwrap();
        assert_eq!(why.reason(), "watch_silent");
        assert!(why.to_string().contains("https://api:6443"), "{why}");
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

    #[test]
    fn text_from_a_proxy_becomes_one_short_printable_line() {
        let page = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n\x1b[31m</html>";
        assert_eq!(
            printable(page),
            "<html> <head><title>502 Bad Gateway</title></head> [31m</html>"
        );
        assert_eq!(printable(&"x".repeat(1000)).len(), 303);
    }

    /// An error and what caused it, as the layers of a client stack them.
    #[derive(Debug)]
    struct Layer(
        &'static str,
        Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    );

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|e| e as &(dyn std::error::Error + 'static))
        }
    }

    /// What the status line and the log say of a request that got no answer: each
    /// connection failure in the operator's words, a TLS failure found under the I/O error
    /// that carries it, a failed name lookup said as one even when the innermost error does
    /// not say "dns".
    #[test]
    fn a_request_without_an_answer_is_named_by_its_cause() {
        use std::io::{Error, ErrorKind};
        for (kind, said) in [
            (ErrorKind::ConnectionRefused, "connection refused"),
            (ErrorKind::ConnectionReset, "connection reset by the server"),
            (ErrorKind::ConnectionAborted, "connection aborted"),
            (ErrorKind::TimedOut, "connection timed out"),
            (ErrorKind::HostUnreachable, "no route to the host"),
            (ErrorKind::NetworkUnreachable, "the network is unreachable"),
        ] {
            let wrapped = Layer(
                "client error (Connect)",
                Some(Box::new(Error::new(kind, "os"))),
            );
            assert_eq!(
                transport_cause(&wrapped),
                ("unreachable", said.to_string()),
                "{kind:?}"
            );
            // A server that is not there: retried within 5 s, never backed off to 30.
            let failed = kube::Error::Service(Box::new(Layer(
                "client error (Connect)",
                Some(Box::new(Error::new(kind, "os"))),
            )));
            assert_eq!(failure_of(&failed), Failure::Unreachable, "{kind:?}");
        }
        // A TLS failure is an answer of a kind: backed off as one.
        let refused_tls = kube::Error::Service(Box::new(Error::other(
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        )));
        assert_eq!(failure_of(&refused_tls), Failure::ANSWERED);
        let tls = |e: rustls::Error| {
            let io = Error::other(e);
            transport_cause(&Layer("client error (Connect)", Some(Box::new(io))))
        };
        use rustls::CertificateError as C;
        assert_eq!(
            tls(rustls::Error::InvalidCertificate(C::UnknownIssuer)),
            ("tls", "TLS: unknown authority: the server's certificate is not signed by a CA the agent trusts for it".to_string())
        );
        assert!(
            tls(rustls::Error::InvalidCertificate(C::BadSignature))
                .1
                .contains("one of the same name is trusted, with another key")
        );
        assert_eq!(
            tls(rustls::Error::InvalidCertificate(C::Expired)).1,
            "TLS: the server's certificate has expired"
        );
        assert!(
            tls(rustls::Error::InvalidCertificate(C::NotValidYet))
                .1
                .contains("is the clock right?")
        );
        assert!(
            tls(rustls::Error::InvalidCertificate(C::NotValidForName))
                .1
                .contains("not valid for this host name")
        );
        assert!(
            tls(rustls::Error::AlertReceived(
                rustls::AlertDescription::BadCertificate
            ))
            .1
            .contains("is the client certificate one it accepts?")
        );
        // The lookup failure is said by an outer layer; the innermost only names the host.
        let dns = Layer(
            "client error (Connect)",
            Some(Box::new(Layer(
                "dns error: failed to lookup address information",
                Some(Box::new(Layer("Name or service not known", None))),
            ))),
        );
        assert_eq!(
            transport_cause(&dns),
            (
                "unreachable",
                "DNS lookup failed: Name or service not known".to_string()
            )
        );
        let other = Layer(
            "client error (SendRequest)",
            Some(Box::new(Layer(
                "connection closed before message completed",
                None,
            ))),
        );
        assert_eq!(
            transport_cause(&other),
            (
                "unreachable",
                "connection closed before message completed".to_string()
            )
        );
    }

    /// A 401 or a server certificate the trusted CAs do not sign sends the follower to read
    /// the credentials again; nothing else does.
    #[test]
    fn only_a_refusal_or_an_untrusted_server_proves_the_credentials_stale() {
        let cluster = |reason| SourceError::Cluster {
            spec: "s".into(),
            reason,
            error: "e".into(),
        };
        assert!(proves_stale(&cluster("unauthorized")));
        assert!(proves_stale(&cluster("tls")));
        assert!(!proves_stale(&cluster("forbidden")));
        assert!(!proves_stale(&cluster("unreachable")));
        assert!(!proves_stale(&SourceError::NotFound { spec: "s".into() }));
    }

    /// A TLS failure names the CA the server was checked against; a refusal while the client
    /// certificate in use has expired says so; other errors are left as they are.
    #[test]
    fn an_error_the_credentials_explain_says_which_of_them() {
        let now = test_certs::now();
        let expired = test_certs::ca(Some("system:node:n1"), None, now - 7200, now - 60);
        let current = Current {
            ca_origin: Some("certificate-authority-data of cluster \"c\" in kubeconfig k".into()),
            client_certificate_origin: Some(
                "client-certificate /var/lib/kubelet/pki/kubelet-client-current.pem".into(),
            ),
            held: vec![crate::credentials::HeldCertificate {
                filepath: "k".into(),
                kind: "user",
                key: "u".into(),
                certificate: expired,
            }]
            .into(),
            ..Current::default()
        };
        let cluster = |reason| SourceError::Cluster {
            spec: "s".into(),
            reason,
            error: "https://h:6443: E".into(),
        };
        let said = |reason| with_credentials_hint(cluster(reason), &current).to_string();
        assert_eq!(
            said("tls"),
            "source s: https://h:6443: E (trusted for it: certificate-authority-data of cluster \"c\" in kubeconfig k)"
        );
        let refused = said("unauthorized");
        assert!(refused.contains("the client certificate in use, client-certificate /var/lib/kubelet/pki/kubelet-client-current.pem, expired at"), "{refused}");
        assert_eq!(said("forbidden"), "source s: https://h:6443: E");
        let fresh = Current {
            held: Arc::from(Vec::new()),
            ..current.clone()
        };
        assert_eq!(
            with_credentials_hint(cluster("unauthorized"), &fresh).to_string(),
            "source s: https://h:6443: E"
        );
        let other = SourceError::NotFound { spec: "s".into() };
        assert_eq!(with_credentials_hint(other, &current).reason(), "not_found");
    }

    /// Each error answer gets its reason, and a body that is no Kubernetes Status is said to
    /// come from something between the agent and the API server.
    #[test]
    fn each_error_answer_has_its_reason_and_says_what_answered() {
        let status = |code: u16, reason: &str, message: &str| Status {
            code,
            reason: reason.into(),
            message: message.into(),
            ..Status::default()
        };
        for (code, reason) in [
            (401, "unauthorized"),
            (403, "forbidden"),
            (404, "not_found"),
            (410, "expired"),
            (500, "api_error"),
            (429, "api_error"),
        ] {
            assert_eq!(
                status_error("s", &status(code, "R", "m")).reason(),
                reason,
                "{code}"
            );
        }
        assert_eq!(
            status_error("s", &status(403, "Forbidden", "configmaps is forbidden")).to_string(),
            "source s: HTTP 403 Forbidden: configmaps is forbidden"
        );
        let empty = status_error("s", &status(502, "Failed to parse error data", "")).to_string();
        assert_eq!(
            empty,
            "source s: HTTP 502 with an empty body, not a Kubernetes Status (a proxy or load balancer between here and the API server?)"
        );
        let html = status_error(
            "s",
            &status(
                502,
                "Failed to parse error data",
                "<html>Bad Gateway</html>",
            ),
        )
        .to_string();
        assert!(
            html.starts_with("source s: HTTP 502 with a body that is not a Kubernetes Status"),
            "{html}"
        );
        assert!(html.ends_with("<html>Bad Gateway</html>"), "{html}");
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
