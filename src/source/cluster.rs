//! Cluster sources, read through kube-rs: a ConfigMap (one key, or every key of `data` and
//! `binaryData`) and a ControllerConfig's `spec.kubeAPIServerServingCAData` (base64).
//!
//! Each source has one long-lived watch on the single named object (field selector
//! `metadata.name`, so RBAC by resourceNames is enough). kube-runtime's watcher does the
//! lifecycle SPEC 6 asks for: list once, then watch with bookmarks, resume from the last
//! resourceVersion after a disconnect, list again after `410 Gone`, and back off with
//! jitter (up to 30 s) between failures. In steady state it makes no list.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Client, Config};
use tokio::sync::mpsc::UnboundedSender;

use super::{Keys, SourceError, SourceSpec, parse_parts};
use crate::bundle::SourceCertificates;

/// The ControllerConfig field that carries the bundle, base64 of PEM.
pub const CONTROLLERCONFIG_FIELD: &str = "kubeAPIServerServingCAData";

fn controllerconfig_resource() -> ApiResource {
    ApiResource {
        group: "machineconfiguration.openshift.io".into(),
        version: "v1".into(),
        api_version: "machineconfiguration.openshift.io/v1".into(),
        kind: "ControllerConfig".into(),
        plural: "controllerconfigs".into(),
    }
}

/// A client from `--kubeconfig`, else in-cluster config, else `$KUBECONFIG`, else
/// `~/.kube/config`.
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    use anyhow::Context;
    let config = match kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("kubeconfig {} is not usable", path.display()))?
        }
        None => match Config::incluster() {
            Ok(config) => config,
            Err(_) => Config::from_kubeconfig(&KubeConfigOptions::default())
                .await
                .context("no in-cluster config, and no usable kubeconfig in $KUBECONFIG or ~/.kube/config (or pass --kubeconfig)")?,
        },
    };
    Client::try_from(config).context("cannot build a Kubernetes client")
}

/// One update from a source, for the reconciliation loop.
#[derive(Debug)]
pub struct Update {
    /// Position of the source in `--source` order.
    pub index: usize,
    pub event: SourceEvent,
    /// When the update arrived: the start of `kubelet_ca_sync_duration_seconds`.
    pub at: Instant,
}

#[derive(Debug)]
pub enum SourceEvent {
    /// New valid content.
    Content(SourceCertificates),
    /// The source could not be used; its last good content stays.
    Failed(SourceError),
    /// The watch failed and is being restarted (after backoff).
    WatchRestart(SourceError),
}

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

/// The PEM bundle a ControllerConfig carries, decoded from base64.
pub fn controllerconfig_bundle(spec: &str, object: &DynamicObject) -> Result<Vec<u8>, SourceError> {
    let invalid = |reason, problem: String| SourceError::Invalid {
        spec: spec.to_string(),
        reason,
        problem,
    };
    let field = object
        .data
        .get("spec")
        .and_then(|s| s.get(CONTROLLERCONFIG_FIELD))
        .ok_or_else(|| {
            invalid(
                "missing_field",
                format!("spec.{CONTROLLERCONFIG_FIELD} is not set"),
            )
        })?;
    let text = field.as_str().ok_or_else(|| {
        invalid(
            "bad_base64",
            format!("spec.{CONTROLLERCONFIG_FIELD} is not a string"),
        )
    })?;
    let compact: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact)
        .map_err(|_| {
            invalid(
                "bad_base64",
                format!("spec.{CONTROLLERCONFIG_FIELD} is not valid base64"),
            )
        })
}

fn cluster_error(spec: &str, error: &kube::Error) -> SourceError {
    let reason = match error {
        kube::Error::Api(status) => match status.code {
            401 => "unauthorized",
            403 => "forbidden",
            404 => "not_found",
            410 => "expired",
            _ => "api_error",
        },
        _ => "unreachable",
    };
    SourceError::Cluster {
        spec: spec.to_string(),
        reason,
        error: error.to_string(),
    }
}

fn watch_error(spec: &str, error: &watcher::Error) -> SourceError {
    match error {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => cluster_error(spec, e),
        other => SourceError::Cluster {
            spec: spec.to_string(),
            reason: "watch_error",
            error: other.to_string(),
        },
    }
}

/// Reads a cluster source once (for `sync`): one list of the named object.
pub async fn read_once(
    client: &Client,
    spec: &SourceSpec,
) -> Result<SourceCertificates, SourceError> {
    let name = spec.to_string();
    match spec {
        SourceSpec::ConfigMap {
            namespace,
            name: object,
            keys,
        } => {
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
            let configmap = list_one(api, object, &name).await?;
            parse_parts(&name, configmap_parts(&name, &configmap, keys)?)
        }
        SourceSpec::ControllerConfig { name: object } => {
            let api: Api<DynamicObject> =
                Api::all_with(client.clone(), &controllerconfig_resource());
            let bundle = controllerconfig_bundle(&name, &list_one(api, object, &name).await?)?;
            parse_parts(&name, [(None, bundle.as_slice())])
        }
        _ => panic!("cluster::read_once called for local source {name}"),
    }
}

/// The object named `object`, by a list with a field selector: the same request, and so the
/// same RBAC, as the watch.
async fn list_one<K>(api: Api<K>, object: &str, spec: &str) -> Result<K, SourceError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = ListParams::default().fields(&format!("metadata.name={object}"));
    let list = api
        .list(&params)
        .await
        .map_err(|e| cluster_error(spec, &e))?;
    list.items.into_iter().next().ok_or(SourceError::NotFound {
        spec: spec.to_string(),
    })
}

/// Watches one cluster source for as long as the process runs, sending every change.
pub async fn watch(
    client: Client,
    index: usize,
    spec: SourceSpec,
    updates: UnboundedSender<Update>,
) {
    let name = spec.to_string();
    let send = |event| {
        let _ = updates.send(Update {
            index,
            event,
            at: Instant::now(),
        });
    };
    match &spec {
        SourceSpec::ConfigMap {
            namespace,
            name: object,
            keys,
        } => {
            let api: Api<ConfigMap> = Api::namespaced(client, namespace);
            let content = |cm: &ConfigMap| parse_parts(&name, configmap_parts(&name, cm, keys)?);
            follow(api, object, &name, content, send).await;
        }
        SourceSpec::ControllerConfig { name: object } => {
            let api: Api<DynamicObject> = Api::all_with(client, &controllerconfig_resource());
            let content = |cc: &DynamicObject| {
                let bundle = controllerconfig_bundle(&name, cc)?;
                parse_parts(&name, [(None, bundle.as_slice())])
            };
            follow(api, object, &name, content, send).await;
        }
        _ => panic!("cluster::watch called for local source {name}"),
    }
}

/// The watch loop shared by both kinds of object.
///
/// kube-runtime resumes a failed watch silently: when the object did not change meanwhile,
/// nothing tells us the source is back. So after an error this loop probes with one list
/// of the object (backing off while that fails too): if the object is the version last
/// seen, its content is sent again, which marks the source up if it is valid; if it changed
/// or is gone, the resumed watch says so itself. There is no probe in steady state.
async fn follow<K>(
    api: Api<K>,
    object: &str,
    spec: &str,
    content: impl Fn(&K) -> Result<SourceCertificates, SourceError>,
    send: impl Fn(SourceEvent),
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let config = watcher::Config::default().fields(&format!("metadata.name={object}"));
    let mut events = watcher(api.clone(), config).default_backoff().boxed();
    // Whether the current (re)list found the object: a list without it means it is gone.
    let mut listed = false;
    // The resourceVersion of the object as last seen (None once it is gone).
    let mut seen: Option<String> = None;
    // While recovering from an error: when to probe next, and the delay after that.
    let mut probe: Option<(tokio::time::Instant, Duration)> = None;
    let result = |k: &K| match content(k) {
        Ok(certificates) => SourceEvent::Content(certificates),
        Err(error) => SourceEvent::Failed(error),
    };
    loop {
        let probe_due = async {
            match probe {
                Some((at, _)) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            event = events.next() => event,
            () = probe_due => {
                probe = match list_one(api.clone(), object, spec).await {
                    // The version last seen: its result again (valid content marks the
                    // source up and changes nothing; rejected content keeps it down).
                    Ok(k) if seen.is_some() && k.meta().resource_version == seen => {
                        send(result(&k));
                        None
                    }
                    Ok(_) | Err(SourceError::NotFound { .. }) => None,
                    Err(_) => probe.map(|(_, delay)| {
                        let next = (delay * 2).min(PROBE_BACKOFF_MAX);
                        (tokio::time::Instant::now() + delay, next)
                    }),
                };
                continue;
            }
        };
        let Some(event) = event else { break };
        if event.is_ok() {
            probe = None;
        }
        match event {
            Ok(Event::Init) => listed = false,
            Ok(Event::InitApply(k)) => {
                listed = true;
                seen = k.meta().resource_version.clone();
                send(result(&k));
            }
            Ok(Event::InitDone) if !listed => {
                seen = None;
                send(SourceEvent::Failed(SourceError::NotFound {
                    spec: spec.to_string(),
                }));
            }
            Ok(Event::InitDone) => {}
            Ok(Event::Apply(k)) => {
                seen = k.meta().resource_version.clone();
                send(result(&k));
            }
            Ok(Event::Delete(_)) => {
                seen = None;
                send(SourceEvent::Failed(SourceError::NotFound {
                    spec: spec.to_string(),
                }));
            }
            Err(e) => {
                send(SourceEvent::WatchRestart(watch_error(spec, &e)));
                probe.get_or_insert((tokio::time::Instant::now() + PROBE_FIRST, PROBE_FIRST * 2));
            }
        }
    }
}

/// After a watch error, the first probe waits this long (the watcher's own first backoff
/// is 0.8 to 1.6 s), then the delay doubles up to the watcher's cap.
const PROBE_FIRST: Duration = Duration::from_secs(2);
const PROBE_BACKOFF_MAX: Duration = Duration::from_secs(30);
