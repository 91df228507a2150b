//! `publish`: the cluster-side publisher (SPEC 8b). It builds the bundle from cluster sources
//! with the node agent's engine (same parsing, validation and merge), and keeps it in one key
//! of a ConfigMap with server-side apply, so that thousands of node agents watch a small
//! object that changes only when the bundle does. With `--cloud-ca-source` and
//! `--registry-source` the same ConfigMap also keeps the node's other CA files ([`keys`]: the
//! cloud CA, the registry CAs), so that a node still watches one small object for all of
//! them, and it changes only when one of them does.
//!
//! One loop owns the state, as in `run`: the source watches and the watch of the target
//! ConfigMap send it updates; it decides ([`configmap::decide`]) and hands each apply to a
//! task of its own, so that a slow API server never stops it from answering `/livez`. The
//! endpoint is the node agent's, over the same [`crate::status`].

pub mod configmap;
pub mod keys;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use time::OffsetDateTime;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, watch};
use tokio::time::sleep_until;

use crate::bundle::{self, Certificate, Fingerprint, Policy, SourceCertificates};
use crate::config::{ConfigMapRef, Publish, Server};
use crate::credentials::{Credentials, Origin};
use crate::error::{Exit, UsageError};
use crate::follow::lifecycle::{self, Backoff, Failure};
use crate::metrics::{FileLabels, FileReasonLabels, Metrics, SourceReasonLabels};
use crate::registry::Entries;
use crate::server::endpoint::Endpoint;
use crate::server::{self, Pongs};
use crate::source::cluster::{self, Content, Event, Raw, Update};
use crate::source::state::SourceState;
use crate::source::{SourceError, SourceSpec};
use crate::status::{Status, TargetKind, unix_now};
use configmap::{Observed, Publication, Seen, Step};
use keys::{BundleKey, CLOUD_CA_KEY, Current, Others, REGISTRY_KEY_PREFIX, Read};

/// An apply that found the ConfigMap moved looks again after this (a failed one waits as
/// [`Backoff`] says).
const APPLY_RETRY_FIRST: Duration = Duration::from_secs(1);
/// How long the watch's events are held to be older than an apply's answer, at most.
const AWAIT_OWN_WRITE: Duration = Duration::from_secs(5);
/// Certificate boundaries are re-checked at least this often, in case the clock jumps.
const BOUNDARY_RECHECK_MAX: Duration = Duration::from_secs(3600);

pub fn run(mut args: Publish) -> anyhow::Result<Exit> {
    let origin = Origin::resolve(args.kubeconfig.as_deref()).map_err(UsageError)?;
    crate::runtime::build()?.block_on(async {
        match args.server.take() {
            None => {
                let (client, server) = crate::credentials::one_shot_client(&origin)?;
                once(&args, client, &server).await
            }
            Some(endpoint) => watch_and_publish(args, endpoint, Credentials::follow(origin)).await,
        }
    })
}

/// The source specs, as the annotation and the logs give them.
fn source_list(sources: &[SourceSpec]) -> String {
    sources
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The annotations that name the sources, beside the SHA-256 ones: the bundle's always, the
/// other keys' when they are kept.
fn source_annotations(args: &Publish) -> Vec<(&'static str, String)> {
    let mut annotations = vec![(configmap::SOURCES_ANNOTATION, source_list(&args.sources))];
    if !args.cloud_ca_sources.is_empty() {
        annotations.push((
            configmap::CLOUD_CA_SOURCES_ANNOTATION,
            source_list(&args.cloud_ca_sources),
        ));
    }
    if !args.kubeconfig_ca_sources.is_empty() {
        annotations.push((
            configmap::KUBECONFIG_CA_SOURCES_ANNOTATION,
            source_list(&args.kubeconfig_ca_sources),
        ));
    }
    if !args.registry_sources.is_empty() {
        annotations.push((
            configmap::REGISTRY_SOURCES_ANNOTATION,
            source_list(&args.registry_sources),
        ));
    }
    annotations
}

/// Every source, in the order updates name them: the bundle's, each bundle key's (the cloud
/// CA's, the kubeconfigs' CA's), then the registry CAs'.
fn all_sources(args: &Publish) -> Vec<SourceSpec> {
    args.sources
        .iter()
        .chain(bundle_keys(args).into_iter().flat_map(|(_, specs)| specs))
        .chain(&args.registry_sources)
        .cloned()
        .collect()
}

/// The keys that hold a bundle of their own sources, with those sources (empty when the
/// key is not kept), in the order of [`all_sources`].
fn bundle_keys(args: &Publish) -> [(BundleKey, &[SourceSpec]); 2] {
    [
        (keys::CLOUD_CA, &args.cloud_ca_sources),
        (keys::KUBECONFIG_CA, &args.kubeconfig_ca_sources),
    ]
}

/// What the sources of each bundle key gave, as [`keys::others`] takes it.
fn bundle_reads<'a>(
    kinds: &[(BundleKey, usize)],
    read: &'a [Vec<SourceCertificates>],
    complete: &[bool],
) -> Vec<(BundleKey, Read<&'a [SourceCertificates]>)> {
    kinds
        .iter()
        .zip(read.iter().zip(complete))
        .map(|(&(kind, wanted), (sources, &complete))| {
            let read = match (wanted, complete) {
                (0, _) => Read::Off,
                (_, true) => Read::Read(&sources[..]),
                (_, false) => Read::Unread,
            };
            (kind, read)
        })
        .collect()
}

/// How each source's content is read: the flags never let one spec be both a bundle's
/// source and a registry source (the configuration refuses it).
fn content_of(
    args: &Publish,
) -> impl Fn(&SourceSpec, Raw<'_>) -> Result<Content, SourceError> + Send + Sync + 'static {
    let registry_specs: std::collections::HashSet<SourceSpec> =
        args.registry_sources.iter().cloned().collect();
    move |spec, raw| {
        if registry_specs.contains(spec) {
            cluster::registry_content(spec, raw).map(|e| Content::Entries(Arc::new(e)))
        } else {
            cluster::bundle_content(spec, raw).map(Content::Certificates)
        }
    }
}

fn policy(args: &Publish) -> Policy {
    Policy {
        retain_removed: 0,
        drop_expired: args.drop_expired,
    }
}

fn no_answer(what: &str, server: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{what}: the API server {server} did not answer within {}s (it took the request and sent nothing); the ConfigMap was left as it was",
        crate::follow::REQUEST_DEADLINE.as_secs()
    )
}

/// `--once`: read every source (one list per object), build, read the ConfigMap, apply if
/// it does not hold the publication already. A source of the bundle that fails leaves the
/// ConfigMap as it was; one of another key leaves that key as it is, the rest is published,
/// and the run exits 1.
async fn once(args: &Publish, client: kube::Client, server: &str) -> anyhow::Result<Exit> {
    let to = &args.to;
    let specs = all_sources(args);
    let bundles = args.sources.len();
    let kinds: Vec<(BundleKey, usize)> = bundle_keys(args)
        .iter()
        .map(|(kind, specs)| (*kind, specs.len()))
        .collect();
    // The source at `index` among the bundle keys' sources: which key it feeds.
    let kind_of = |index: usize| {
        let mut first = bundles;
        kinds.iter().position(|(_, n)| {
            first += n;
            index < first
        })
    };
    let answers = cluster::read_sources(&client, server, &specs, content_of(args)).await;
    let mut sources = Vec::with_capacity(bundles);
    let mut keyed: Vec<Vec<SourceCertificates>> = vec![Vec::new(); kinds.len()];
    let mut keyed_read = vec![true; kinds.len()];
    let mut registries = Vec::with_capacity(args.registry_sources.len());
    let mut registries_read = true;
    let mut failures: Vec<String> = Vec::new();
    for (index, (spec, answer)) in specs.iter().zip(answers).enumerate() {
        let answer = answer.expect("publish reads cluster sources only");
        match answer {
            Err(error) if error.reason() == "no_answer" => {
                return Err(no_answer(&format!("source {spec}"), server));
            }
            Err(error) if index < bundles => {
                return Err(anyhow::Error::new(error).context(format!("{to} was left as it was")));
            }
            Err(error) => {
                tracing::error!(source = %spec, reason = error.reason(), "{error}; the keys it feeds are left as they are");
                failures.push(error.to_string());
                match kind_of(index) {
                    Some(kind) => keyed_read[kind] = false,
                    None => registries_read = false,
                }
            }
            Ok(Content::Certificates(parsed)) => {
                crate::source::warn_not_ca(spec, &parsed);
                match kind_of(index) {
                    _ if index < bundles => sources.push(parsed),
                    Some(kind) => keyed[kind].push(parsed),
                    None => {}
                }
            }
            Ok(Content::Entries(entries)) => registries.push(Arc::unwrap_or_clone(entries)),
        }
    }
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let built = bundle::build(&sources, &[], policy(args), now)
        .with_context(|| format!("{to} was left as it was"))?;
    let rendered: Arc<[u8]> = built.bundle.render().into();
    let api: Api<ConfigMap> = Api::namespaced(client, &to.namespace);
    let current =
        match tokio::time::timeout(crate::follow::REQUEST_DEADLINE, api.get_opt(&to.name)).await {
            Ok(Ok(current)) => current,
            Ok(Err(e)) => return Err(anyhow::anyhow!("cannot read {to}: {}", kube_error(&e))),
            Err(_) => return Err(no_answer(&format!("reading {to}"), server)),
        };
    let observed = current.as_ref().map(|c| Observed::of(c, &to.key));
    let empty = Observed::new(None, None, None);
    let seen = observed.as_ref().unwrap_or(&empty);
    let reads = bundle_reads(&kinds, &keyed, &keyed_read);
    let registries = match (args.registry_sources.is_empty(), registries_read) {
        (true, _) => Read::Off,
        (false, true) => Read::Read(registries),
        (false, false) => Read::Unread,
    };
    let current_keys = Current {
        values: &seen.others,
        owned: &seen.owned,
    };
    let others = keys::others(&reads, registries, policy(args), now, current_keys);
    for (key, (reason, problem)) in &others.problems {
        tracing::error!(reason, "{problem}; {key} is left as it is");
        failures.push(problem.clone());
    }
    for told in &others.refused {
        tracing::warn!(source = %told.source, reason = told.reason, "{}", told.text);
        if told.reason != keys::SKIPPED {
            failures.push(told.text.clone());
        }
    }
    for warning in &others.warnings {
        tracing::warn!("{warning}");
    }
    let publication = Publication::new(rendered, others.values);
    let sha256 = publication.sha256.clone();
    let keys = publication.others.len();
    let fail = |failures: &[String]| -> anyhow::Result<Exit> {
        match failures {
            [] => Ok(Exit::Success),
            [one] => Err(anyhow::anyhow!(
                "{one}; what it feeds in {to} was left as it was"
            )),
            [first, rest @ ..] => Err(anyhow::anyhow!(
                "{first} (and {} more problems, logged above); what they feed in {to} was left as it was",
                rest.len()
            )),
        }
    };
    if observed.as_ref().is_some_and(|o| o.holds(&publication)) {
        tracing::info!(to = %to, certificates = built.bundle.len(), sha256 = %sha256, other_keys = keys, "already published");
        return fail(&failures);
    }
    let before = current
        .as_ref()
        .and_then(|c| c.metadata.resource_version.clone());
    let body = configmap::apply_body(
        to,
        &publication,
        &source_annotations(args),
        before.as_deref(),
    );
    match tokio::time::timeout(
        crate::follow::REQUEST_DEADLINE,
        apply(&api, &to.name, &body),
    )
    .await
    {
        Ok(Ok(_)) => {
            tracing::info!(to = %to, certificates = built.bundle.len(), sha256 = %sha256, other_keys = keys, "published");
            fail(&failures)
        }
        Ok(Err(e)) => Err(anyhow::anyhow!(
            "cannot apply {to}: {}; it was left as it was",
            kube_error(&e)
        )),
        Err(_) => Err(no_answer(&format!("applying {to}"), server)),
    }
}

async fn apply(
    api: &Api<ConfigMap>,
    name: &str,
    body: &serde_json::Value,
) -> kube::Result<ConfigMap> {
    let params = PatchParams::apply(configmap::FIELD_MANAGER).force();
    api.patch(name, &params, &Patch::Apply(body)).await
}

/// A kube error on one line, without anything from the request (the body holds no secret,
/// but the error text of a proxy may hold anything: it is made printable).
fn kube_error(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => crate::text::escape(&format!(
            "HTTP {} {}: {}",
            status.code, status.reason, status.message
        ))
        .into_owned(),
        other => crate::text::escape(&other.to_string()).into_owned(),
    }
}

/// The bundle built from the sources.
struct Bundle {
    certificates: Vec<Certificate>,
    rendered: Arc<[u8]>,
    sha256: String,
}

/// What the loop knows about one registry source.
struct RegistrySlot {
    source: SourceState,
    /// The last good entries: kept while the source fails.
    entries: Option<Arc<Entries>>,
}

/// How an apply ended.
enum Outcome {
    /// The ConfigMap as the API server returned it.
    Applied(Observed),
    /// Its resourceVersion was no longer the one the apply was made against: another
    /// writer (another replica, most likely) changed it first.
    Moved,
    /// It failed: why, and the kind of failure, which says how long to wait.
    Failed(String, Failure),
}

/// The end of an apply, sent back by its task.
struct Applied {
    /// The [`Publication::id`] it carried.
    id: String,
    /// The bundle's SHA-256, for the log.
    sha256: String,
    /// The ConfigMap as the loop saw it when it decided (`None`: it did not exist): the
    /// apply's precondition, and what each key's write is counted against.
    base: Option<Observed>,
    /// The other keys it carried.
    keys: BTreeSet<String>,
    outcome: Outcome,
    repair: bool,
}

struct Publisher {
    to: ConfigMapRef,
    label: String,
    /// The API server, through the newest client of the followed credentials.
    credentials: Credentials,
    annotations: Vec<(&'static str, String)>,
    policy: Policy,
    /// The bundle's sources, then each bundle key's (the cloud CA's, the kubeconfigs' CA's;
    /// none when the key is not kept) and the registry CAs'.
    slots: Vec<SourceState>,
    key_slots: Vec<(BundleKey, Vec<SourceState>)>,
    registry_slots: Vec<RegistrySlot>,
    bundle: Option<Bundle>,
    build_problem: Option<String>,
    /// The other keys, as the last pass made them.
    others: Others,
    /// Why a bundle key could not be built, as last logged, by key.
    key_problems: BTreeMap<&'static str, String>,
    /// The refusals and warnings about the other keys already logged (and counted), so that
    /// each is said once while it lasts.
    said: BTreeSet<String>,
    /// What to apply: the bundle and the other keys; `None` while the bundle cannot be
    /// built (nothing is published without it).
    desired: Option<Publication>,
    seen: Seen,
    /// The target's certificates, parsed once per distinct content.
    seen_certificates: Option<(String, Result<Vec<Certificate>, String>)>,
    /// Each other key's certificates, by the SHA-256 of its value.
    key_certificates: BTreeMap<String, (String, Vec<Certificate>)>,
    /// When each other key was last in sync, unix seconds.
    key_last_sync: BTreeMap<String, f64>,
    /// The other keys' `filepath` labels whose counters have their series.
    key_series: BTreeSet<String>,
    target_down: Option<String>,
    /// The id of the last publication applied, or found published.
    published: Option<String>,
    /// An apply in flight: the id it carries.
    applying: Option<String>,
    /// The target's watch said something while the apply in flight was.
    watched_during_apply: bool,
    /// After an apply, the resourceVersion it made, until the watch shows it: the watch's
    /// events before it are older than what the apply returned, and are not acted on.
    awaiting: Option<(String, Instant)>,
    /// The id of the publication whose apply failed last; another is tried at once, this
    /// one after `retry_at`.
    failed: Option<String>,
    applied_tx: mpsc::UnboundedSender<Box<Applied>>,
    retry_at: Option<Instant>,
    /// The delays between failed applies, by what failed (SPEC 6, as for the watches).
    apply_backoff: Backoff,
    last_error: Option<String>,
    /// The first source change not yet published: the start of the sync duration.
    pending_since: Option<Instant>,
    last_sync: Option<f64>,
    metrics: Arc<Metrics>,
    status: watch::Sender<Arc<Status>>,
    /// The Nodes, as the metadata watch follows them (SPEC 8c).
    fleet: watch::Receiver<Arc<crate::fleet::nodes::Fleet>>,
}

/// The loop's inputs besides the source updates.
enum Input {
    Target(Event<Observed>),
    Applied(Box<Applied>),
}

async fn watch_and_publish(
    args: Publish,
    endpoint: Server,
    credentials: Credentials,
) -> anyhow::Result<Exit> {
    let to = args.to.clone();
    let label = to.to_string();
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        to = %label,
        sources = %source_list(&args.sources),
        cloud_ca_sources = %source_list(&args.cloud_ca_sources),
        kubeconfig_ca_sources = %source_list(&args.kubeconfig_ca_sources),
        registry_sources = %source_list(&args.registry_sources),
        "publishing"
    );
    let metrics = Arc::new(Metrics::default());
    // Every counter has its series at 0 from the start, as the node agent's do.
    metrics.init_file(&label, CONFIGMAP_SYNC_ERRORS);
    let specs = all_sources(&args);
    for spec in &specs {
        spec.init_metrics(&metrics);
    }
    let (status_tx, status_rx) = watch::channel(Arc::new(Status {
        kind: TargetKind::ConfigMap,
        bundle_path: label.clone(),
        ..Status::default()
    }));
    let (liveness, pongs) = server::liveness();
    let endpoint = Endpoint::start(
        &endpoint,
        None,
        Some(&credentials),
        metrics.clone(),
        status_rx.clone(),
        liveness,
        Vec::new(),
    )
    .await?;
    // The endpoint's TLS files are watched like the node agent's (a Secret volume swaps
    // them by renaming its ..data link).
    let tls_files = endpoint.tls_files();
    let mut _fs_events = None;
    if let Some(tls_events) = endpoint.reload_tls(status_rx.clone()) {
        let plan = crate::files::Plan::new(&[], &[]).with_tls_files(&tls_files);
        let (fs_tx, fs_rx) = mpsc::unbounded_channel();
        tokio::spawn(crate::files::run(plan, fs_tx, Some(tls_events)));
        _fs_events = Some(fs_rx);
    }

    // One watch per object, whatever the number of sources (of any key) that read it.
    let (update_tx, mut updates) = mpsc::unbounded_channel();
    cluster::watch_objects(
        &credentials,
        &specs,
        content_of(&args),
        move |index, event, at| {
            let _ = update_tx.send(Update { index, event, at });
        },
    );
    let (input_tx, mut inputs) = mpsc::unbounded_channel();
    {
        let input_tx = input_tx.clone();
        let (credentials, to, label) = (credentials.clone(), to.clone(), label.clone());
        tokio::spawn(async move {
            let key = to.key.clone();
            cluster::watch_configmap(
                credentials,
                &to.namespace,
                &to.name,
                &label,
                move |cm: &ConfigMap| Ok(Observed::of(cm, &key)),
                move |event, _| {
                    let _ = input_tx.send(Input::Target(event));
                },
            )
            .await;
        });
    }
    let (applied_tx, mut applied_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(applied) = applied_rx.recv().await {
            if input_tx.send(Input::Applied(applied)).is_err() {
                return;
            }
        }
    });

    // One metadata watch on the Nodes, for the fleet's counts of the bundle published.
    let (fleet_tx, fleet) = watch::channel(Arc::new(crate::fleet::nodes::Fleet::default()));
    tokio::spawn(crate::fleet::nodes::follow(
        credentials.clone(),
        args.node_selector.clone(),
        fleet_tx,
    ));
    let mut fleet_changes = fleet.clone();
    let mut publisher = Publisher {
        fleet,
        credentials,
        to,
        label,
        annotations: source_annotations(&args),
        policy: policy(&args),
        slots: args.sources.iter().map(SourceState::new).collect(),
        key_slots: bundle_keys(&args)
            .iter()
            .map(|(kind, specs)| (*kind, specs.iter().map(SourceState::new).collect()))
            .collect(),
        registry_slots: args
            .registry_sources
            .iter()
            .map(|spec| RegistrySlot {
                source: SourceState::new(spec),
                entries: None,
            })
            .collect(),
        bundle: None,
        build_problem: None,
        others: Others::default(),
        key_problems: BTreeMap::new(),
        said: BTreeSet::new(),
        desired: None,
        seen: Seen::Unknown,
        seen_certificates: None,
        key_certificates: BTreeMap::new(),
        key_last_sync: BTreeMap::new(),
        key_series: BTreeSet::new(),
        target_down: None,
        published: None,
        applying: None,
        watched_during_apply: false,
        awaiting: None,
        failed: None,
        applied_tx,
        retry_at: None,
        apply_backoff: Backoff::default(),
        last_error: None,
        pending_since: None,
        last_sync: None,
        metrics,
        status: status_tx,
    };
    publisher.pass();

    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let mut pongs: Pongs = pongs;
    let mut updates_open = true;
    loop {
        let boundary_at = Instant::now() + publisher.next_boundary();
        let deadline = publisher
            .retry_at
            .map_or(boundary_at, |r| r.min(boundary_at));
        tokio::select! {
            update = updates.recv(), if updates_open => match update {
                Some(update) => publisher.on_update(update),
                None => updates_open = false,
            },
            Some(input) = inputs.recv() => publisher.on_input(input),
            Ok(()) = fleet_changes.changed() => {}
            Some(()) = pongs.pings.recv() => { pongs.answer(); continue; }
            _ = sleep_until(deadline.into()) => {}
            _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: stopping"); break; }
        }
        // Take whatever else is queued, so that a burst costs one pass.
        while let Ok(update) = updates.try_recv() {
            publisher.on_update(update);
        }
        while let Ok(input) = inputs.try_recv() {
            publisher.on_input(input);
        }
        if publisher.retry_at.is_some_and(|t| t <= Instant::now()) {
            publisher.retry_at = None;
        }
        publisher.pass();
    }
    Ok(Exit::Success)
}

/// The sync error reasons of the ConfigMap and of each of its keys.
const CONFIGMAP_SYNC_ERRORS: &[&[&str]] = &[
    crate::metrics::known::CONFIGMAP_SYNC_ERRORS,
    crate::metrics::known::CLUSTER_SYNC_ERRORS,
];

impl Publisher {
    fn on_update(&mut self, update: Update) {
        // As in the node agent: no usable credentials is a sync that cannot happen.
        if let Event::Failed(e) | Event::WatchRestart(e) = &update.event
            && e.reason() == "credentials"
        {
            self.metrics
                .sync_errors
                .get_or_create(&FileReasonLabels {
                    filepath: self.label.clone(),
                    reason: "credentials".to_string(),
                })
                .inc();
        }
        let keyed: usize = self.key_slots.iter().map(|(_, s)| s.len()).sum();
        let bundles = self.slots.len();
        if update.index < bundles + keyed {
            let event = update.event.filter_map(Content::certificates);
            let slot = match update.index.checked_sub(bundles) {
                None => &mut self.slots[update.index],
                Some(local) => self
                    .key_slots
                    .iter_mut()
                    .flat_map(|(_, s)| s.iter_mut())
                    .nth(local)
                    .expect("a bundle key's source"),
            };
            if let Some(event) = event
                && slot.observe(event, &self.metrics)
            {
                self.pending_since.get_or_insert(update.at);
            }
            return;
        }
        let slot = &mut self.registry_slots[update.index - bundles - keyed];
        match update.event {
            Event::Content(Content::Entries(entries)) => {
                slot.source.came_up(entries.entries.len());
                if slot.entries.as_deref() != Some(&*entries) {
                    tracing::info!(source = %slot.source.name, registries = entries.entries.len(), refused = entries.refused.len(), "source content changed");
                    slot.entries = Some(entries);
                    slot.source.last_change = Some(unix_now());
                    self.pending_since.get_or_insert(update.at);
                }
            }
            Event::Content(Content::Certificates(_)) => {}
            Event::Failed(error) => slot.source.failed(&error, false, &self.metrics),
            Event::WatchRestart(error) => slot.source.failed(&error, true, &self.metrics),
        }
    }

    fn on_input(&mut self, input: Input) {
        if let Input::Target(Event::Content(_) | Event::Failed(SourceError::NotFound { .. })) =
            &input
            && self.applying.is_some()
        {
            self.watched_during_apply = true;
        }
        if let Input::Target(Event::Content(_) | Event::Failed(SourceError::NotFound { .. })) =
            &input
            && let Some((rv, since)) = self.awaiting.take()
        {
            let event_rv = match &input {
                Input::Target(Event::Content(observed)) => observed.resource_version.as_ref(),
                _ => None,
            };
            if event_rv != Some(&rv) && since.elapsed() < AWAIT_OWN_WRITE {
                // Older than the state the apply returned.
                self.awaiting = Some((rv, since));
                return;
            }
        }
        match input {
            Input::Target(Event::Content(observed)) => {
                if self.target_down.take().is_some() {
                    tracing::info!(to = %self.label, "watching the ConfigMap again");
                }
                self.seen = Seen::Present(observed);
            }
            Input::Target(Event::Failed(SourceError::NotFound { .. })) => {
                self.target_down = None;
                if self.seen != Seen::Missing {
                    tracing::info!(to = %self.label, "the ConfigMap does not exist");
                }
                self.seen = Seen::Missing;
            }
            Input::Target(Event::Failed(error) | Event::WatchRestart(error)) => {
                let problem = error.to_string();
                if self.target_down.as_ref() != Some(&problem) {
                    tracing::warn!(to = %self.label, "cannot watch the ConfigMap: {problem}; retrying with backoff");
                }
                self.target_down = Some(problem);
            }
            Input::Applied(applied) => self.on_applied(applied),
        }
    }

    fn on_applied(&mut self, applied: Box<Applied>) {
        self.applying = None;
        let Applied {
            id,
            sha256,
            base,
            keys,
            outcome,
            repair,
        } = *applied;
        match outcome {
            Outcome::Moved => {
                // Not an error: look again once the watch shows what changed (or a second
                // from now, should it not).
                tracing::info!(to = %self.label, "the ConfigMap changed before the apply reached it (another replica?); looking again");
                self.retry_at = Some(Instant::now() + APPLY_RETRY_FIRST);
                self.failed = Some(id);
            }
            Outcome::Applied(observed) => {
                self.published = Some(id);
                self.apply_backoff.reset();
                self.retry_at = None;
                self.failed = None;
                self.last_error = None;
                // The apply was made against `before` (a precondition), so it changed the
                // ConfigMap unless it returned that very version; one that created it had
                // no precondition, and counts even if another replica created it first.
                let before = base.as_ref().and_then(|b| b.resource_version.clone());
                let changed = base.is_none() || observed.resource_version != before;
                if changed {
                    self.count_writes(base.as_ref(), &keys, repair, &observed);
                }
                if let Some(rv) = &observed.resource_version
                    && configmap::applied_is_newer(&self.seen, Some(rv), self.watched_during_apply)
                {
                    self.awaiting = Some((rv.clone(), Instant::now()));
                    self.seen = Seen::Present(observed);
                }
                if let Some(since) = self.pending_since.take() {
                    self.metrics
                        .sync_duration
                        .observe(since.elapsed().as_secs_f64());
                }
                tracing::info!(to = %self.label, sha256 = %sha256, other_keys = keys.len(), repair, "published");
            }
            Outcome::Failed(problem, failure) => {
                self.metrics
                    .sync_errors
                    .get_or_create(&FileReasonLabels {
                        filepath: self.label.clone(),
                        reason: "apply_failed".to_string(),
                    })
                    .inc();
                let delay = self.apply_backoff.after(failure, lifecycle::jitter());
                tracing::error!(to = %self.label, "cannot apply the ConfigMap: {problem}; trying again in {:.1}s", delay.as_secs_f64());
                self.retry_at = Some(Instant::now() + delay);
                self.failed = Some(id);
                self.last_error = Some(problem);
            }
        }
    }

    /// Counts an apply that changed the ConfigMap as a write (or a repair) of each key it
    /// changed: the bundle's when its key or annotation changed (or nothing else did), each
    /// other key when its value changed, came or went.
    fn count_writes(
        &mut self,
        base: Option<&Observed>,
        keys: &BTreeSet<String>,
        repair: bool,
        after: &Observed,
    ) {
        let mut keys: BTreeSet<&String> = keys.iter().collect();
        keys.extend(base.iter().flat_map(|b| b.owned.iter()));
        let changed: Vec<String> = keys
            .into_iter()
            .filter(|key| base.and_then(|b| b.others.get(*key)) != after.others.get(*key))
            .map(|key| self.key_label(key))
            .collect();
        let bundle = base.is_none_or(|b| b.bytes != after.bytes || b.annotated != after.annotated);
        let labels = (bundle || changed.is_empty())
            .then(|| self.label.clone())
            .into_iter()
            .chain(changed);
        let counter = if repair {
            &self.metrics.repairs
        } else {
            &self.metrics.writes
        };
        for filepath in labels {
            counter.get_or_create(&FileLabels { filepath }).inc();
        }
    }

    /// Builds what to publish: the bundle from every source's last good content, once each
    /// has some, and the other keys.
    fn build(&mut self) {
        self.build_bundle();
        self.build_others();
        self.desired = self
            .bundle
            .as_ref()
            .map(|b| Publication::new(b.rendered.clone(), self.others.values.clone()));
    }

    fn build_bundle(&mut self) {
        if self.slots.iter().any(|s| s.content.is_none()) {
            self.bundle = None;
            return;
        }
        let sources: Vec<SourceCertificates> = self
            .slots
            .iter()
            .filter_map(|s| s.content.clone())
            .collect();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        match bundle::build(&sources, &[], self.policy, now) {
            Ok(built) => {
                self.build_problem = None;
                let rendered: Arc<[u8]> = built.bundle.render().into();
                let sha256 = Fingerprint::of(&rendered).to_hex();
                if self.bundle.as_ref().is_some_and(|d| d.sha256 == sha256) {
                    return;
                }
                self.bundle = Some(Bundle {
                    certificates: built.bundle.certificates().to_vec(),
                    rendered,
                    sha256,
                });
            }
            Err(e) => {
                let problem = e.to_string();
                if self.build_problem.as_ref() != Some(&problem) {
                    tracing::error!(
                        reason = e.reason(),
                        "{problem}; the ConfigMap keeps the last bundle published"
                    );
                    self.metrics
                        .sync_errors
                        .get_or_create(&FileReasonLabels {
                            filepath: self.label.clone(),
                            reason: e.reason().to_string(),
                        })
                        .inc();
                    self.build_problem = Some(problem);
                }
                self.bundle = None;
            }
        }
    }

    /// The other keys, from their sources and what the ConfigMap holds now; their problems
    /// logged and counted once each while they last.
    fn build_others(&mut self) {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let kinds: Vec<(BundleKey, usize)> = self
            .key_slots
            .iter()
            .map(|(kind, slots)| (*kind, slots.len()))
            .collect();
        let keyed: Vec<Vec<SourceCertificates>> = self
            .key_slots
            .iter()
            .map(|(_, slots)| slots.iter().filter_map(|s| s.content.clone()).collect())
            .collect();
        let complete: Vec<bool> = self
            .key_slots
            .iter()
            .zip(&keyed)
            .map(|((_, slots), read)| read.len() == slots.len())
            .collect();
        let reads = bundle_reads(&kinds, &keyed, &complete);
        let entries: Vec<Entries> = self
            .registry_slots
            .iter()
            .filter_map(|s| s.entries.as_deref().cloned())
            .collect();
        let registries = if self.registry_slots.is_empty() {
            Read::Off
        } else if entries.len() == self.registry_slots.len() {
            Read::Read(entries)
        } else {
            Read::Unread
        };
        let nothing = Observed::new(None, None, None);
        let seen = match &self.seen {
            Seen::Present(observed) => observed,
            _ => &nothing,
        };
        let current = Current {
            values: &seen.others,
            owned: &seen.owned,
        };
        let others = keys::others(&reads, registries, self.policy, now, current);
        self.tell(&others);
        self.others = others;
    }

    fn tell(&mut self, others: &Others) {
        for (key, (reason, problem)) in &others.problems {
            if self.key_problems.get(key) != Some(problem) {
                tracing::error!(reason, "{problem}; {key} keeps what it holds");
                self.metrics
                    .sync_errors
                    .get_or_create(&FileReasonLabels {
                        filepath: self.key_label(key),
                        reason: reason.to_string(),
                    })
                    .inc();
                self.key_problems.insert(key, problem.clone());
            }
        }
        self.key_problems
            .retain(|key, _| others.problems.contains_key(key));
        let mut said = BTreeSet::new();
        for told in &others.refused {
            if !self.said.contains(&told.text) {
                tracing::warn!(source = %told.source, reason = told.reason, "{}", told.text);
                self.metrics
                    .source_errors
                    .get_or_create(&SourceReasonLabels {
                        source: told.source.clone(),
                        reason: told.reason.to_string(),
                    })
                    .inc();
            }
            said.insert(told.text.clone());
        }
        for warning in &others.warnings {
            if !self.said.contains(warning) {
                tracing::warn!("{warning}");
            }
            said.insert(warning.clone());
        }
        self.said = said;
    }

    fn pass(&mut self) {
        self.build();
        let desired = self.desired.as_ref();
        let id = desired.map(Publication::id);
        if let (Some(desired), Seen::Present(observed)) = (desired, &self.seen)
            && observed.holds(desired)
            && self.published != id
        {
            tracing::info!(to = %self.label, sha256 = %desired.sha256, other_keys = desired.others.len(), "the ConfigMap already holds the bundle");
            self.published = id.clone();
            self.pending_since = None;
        }
        let step = configmap::decide(
            desired,
            self.published.as_deref(),
            &self.seen,
            self.target_down.is_some(),
        );
        let backing_off = self.retry_at.is_some() && self.failed == id;
        match step {
            Step::Wait => {
                // Nothing left to publish: a source change that left the ConfigMap as it
                // was has no sync to time.
                if self.applying.is_none() && self.published == id {
                    self.pending_since = None;
                }
            }
            _ if self.applying.is_some() || backing_off => {}
            step => self.start_apply(step == Step::Repair),
        }
        self.count_fleet();
        self.publish_status();
        let size = self.desired.as_ref().map_or(0, |d| {
            d.bundle.len() + d.others.values().map(String::len).sum::<usize>()
        });
        crate::runtime::allocator::after_pass(size);
    }

    fn start_apply(&mut self, repair: bool) {
        let Some(desired) = &self.desired else {
            return;
        };
        if repair && let Seen::Present(observed) = &self.seen {
            tracing::warn!(to = %self.label, "{}; publishing the bundle again", observed.damage().unwrap_or_default());
        } else if repair {
            tracing::warn!(to = %self.label, "the ConfigMap is gone; publishing the bundle again");
        }
        let base = match &self.seen {
            Seen::Present(observed) => Some(observed.clone()),
            _ => None,
        };
        let before = base.as_ref().and_then(|b| b.resource_version.clone());
        let body = configmap::apply_body(&self.to, desired, &self.annotations, before.as_deref());
        let key = self.to.key.clone();
        let (name, tx) = (self.to.name.clone(), self.applied_tx.clone());
        let client = self.credentials.client();
        let namespace = self.to.namespace.clone();
        let id = desired.id();
        let sha256 = desired.sha256.clone();
        let keys = desired.others.keys().cloned().collect();
        self.applying = Some(id.clone());
        self.watched_during_apply = false;
        tokio::spawn(async move {
            let applied = |outcome| {
                Box::new(Applied {
                    id,
                    sha256,
                    base,
                    keys,
                    outcome,
                    repair,
                })
            };
            let api: Api<ConfigMap> = match client {
                Ok(client) => Api::namespaced(client, &namespace),
                Err(why) => {
                    let outcome = Outcome::Failed(
                        format!("no usable credentials for the API server: {why}"),
                        Failure::ANSWERED,
                    );
                    let _ = tx.send(applied(outcome));
                    return;
                }
            };
            let outcome = match tokio::time::timeout(
                crate::follow::REQUEST_DEADLINE,
                apply(&api, &name, &body),
            )
            .await
            {
                Ok(Ok(cm)) => Outcome::Applied(Observed::of(&cm, &key)),
                Ok(Err(kube::Error::Api(status))) if status.code == 409 => Outcome::Moved,
                Ok(Err(e)) => {
                    Outcome::Failed(kube_error(&e), crate::follow::problem::failure_of(&e))
                }
                Err(_) => Outcome::Failed(
                    format!(
                        "the API server sent no answer within {}s",
                        crate::follow::REQUEST_DEADLINE.as_secs()
                    ),
                    Failure::ANSWERED,
                ),
            };
            let _ = tx.send(applied(outcome));
        });
    }

    /// Time until the next instant a published certificate's validity can change.
    fn next_boundary(&self) -> Duration {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let next = self
            .slots
            .iter()
            .chain(self.key_slots.iter().flat_map(|(_, s)| s))
            .filter_map(|s| s.content.as_ref())
            .flat_map(|c| c.certificates.iter())
            .chain(self.others.certificates.values().flatten())
            .flat_map(|c| [c.not_before, c.not_after.saturating_add(1)])
            .filter(|&t| t > now)
            .min();
        next.map_or(BOUNDARY_RECHECK_MAX, |t| {
            Duration::from_secs((t - now) as u64).min(BOUNDARY_RECHECK_MAX)
        })
    }

    /// The certificates the ConfigMap holds, parsed once per distinct content.
    fn target_certificates(&mut self, observed: &Observed) -> Result<Vec<Certificate>, String> {
        let sha = observed.sha256.clone().unwrap_or_default();
        if let Some((seen, parsed)) = &self.seen_certificates
            && *seen == sha
        {
            return parsed.clone();
        }
        let parsed = match (&self.bundle, observed.bytes.as_deref()) {
            (Some(d), Some(bytes)) if d.rendered[..] == *bytes => Ok(d.certificates.clone()),
            (_, Some(bytes)) => bundle::parse_source(bytes)
                .map(|p| p.certificates)
                .map_err(|r| format!("the key is not a valid bundle: {r}")),
            (_, None) => Err(format!("the ConfigMap has no key {:?}", self.to.key)),
        };
        self.seen_certificates = Some((sha, parsed.clone()));
        parsed
    }

    fn publish_status(&mut self) {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let seen = self.seen.clone();
        let (certificates, sha256, mut valid, mut problem) = match &seen {
            Seen::Unknown => (Vec::new(), None, false, Some("not read yet".to_string())),
            Seen::Missing => (
                Vec::new(),
                None,
                false,
                Some(format!("{} does not exist", self.label)),
            ),
            Seen::Present(observed) => match self.target_certificates(observed) {
                Ok(certificates) => {
                    let valid = certificates.iter().any(|c| c.is_valid_at(now));
                    let problem = (!valid)
                        .then(|| "no certificate in the ConfigMap is valid now".to_string());
                    (certificates, observed.sha256.clone(), valid, problem)
                }
                Err(problem) => (Vec::new(), observed.sha256.clone(), false, Some(problem)),
            },
        };
        // What cannot be seen is not vouched for.
        if let Some(down) = &self.target_down {
            valid = false;
            problem = Some(format!("cannot watch the ConfigMap: {down}"));
        }
        let id = self.desired.as_ref().map(Publication::id);
        let (in_sync, sync_problem) = match (&self.bundle, &seen) {
            _ if self.target_down.is_some() => (None, None),
            (None, _) | (_, Seen::Unknown) => (None, None),
            (Some(desired), Seen::Present(observed)) if observed.holds_bundle(&desired.sha256) => {
                (Some(true), None)
            }
            (Some(desired), _) => {
                let why = match (&self.last_error, &seen) {
                    (Some(error), _) => format!("the last apply failed: {error}"),
                    (None, Seen::Present(observed)) => match observed.damage() {
                        Some(damage) => damage,
                        None if id.is_some() && self.published == id => format!(
                            "the ConfigMap holds sha256 {} from another writer; this publisher's bundle is sha256 {}",
                            short(observed.annotated.as_deref()),
                            short(Some(&desired.sha256))
                        ),
                        None => "publishing".to_string(),
                    },
                    (None, _) => "the ConfigMap does not exist yet".to_string(),
                };
                (Some(false), Some(why))
            }
        };
        if in_sync == Some(true) {
            self.last_sync = Some(unix_now());
        }
        let others = self.key_statuses(now);
        let sources = self
            .slots
            .iter()
            .chain(self.key_slots.iter().flat_map(|(_, s)| s))
            .chain(self.registry_slots.iter().map(|r| &r.source))
            .map(SourceState::status)
            .collect();
        let status = Status {
            kind: TargetKind::ConfigMap,
            bundle_path: self.label.clone(),
            file_warning: crate::bundle::expired_warning(
                &certificates,
                time::OffsetDateTime::now_utc().unix_timestamp(),
            )
            .filter(|_| valid),
            certificates,
            sha256,
            file_valid: valid,
            file_problem: problem,
            in_sync,
            sync_problem,
            sources,
            last_sync: self.last_sync,
            file_watch: None,
            kubelet: None,
            others,
            nothing_to_keep: false,
            removal_held: None,
            held_back: Vec::new(),
            restart: None,
            restart_note: None,
            registry_set: None,
            notes: {
                let mut notes = self.notes();
                notes.push(self.fleet_note());
                notes
            },
            other_sources: Vec::new(),
        };
        self.status.send_replace(Arc::new(status));
    }

    /// `configmap:NS/NAME/KEY`: the `filepath` label of one of the other keys.
    fn key_label(&self, key: &str) -> String {
        format!("configmap:{}/{}/{key}", self.to.namespace, self.to.name)
    }

    /// Whether `key` is one of the other keys this publisher keeps.
    fn keeps(&self, key: &str) -> bool {
        self.key_slots
            .iter()
            .any(|(kind, slots)| kind.key == key && !slots.is_empty())
            || (key.starts_with(REGISTRY_KEY_PREFIX) && !self.registry_slots.is_empty())
    }

    /// One status per other key: those the publisher wants, holds, or owns and is about to
    /// remove. A key is in sync when the ConfigMap holds what the publisher wants for it
    /// (for a held key, what it held).
    fn key_statuses(&mut self, now: i64) -> Vec<Status> {
        let observed = match &self.seen {
            Seen::Present(observed) => Some(observed.clone()),
            _ => None,
        };
        let mut keys: BTreeSet<String> = self.others.values.keys().cloned().collect();
        keys.extend(self.others.held.keys().cloned());
        for (kind, slots) in &self.key_slots {
            if !slots.is_empty() {
                keys.insert(kind.key.to_string());
            }
        }
        if let Some(observed) = &observed {
            keys.extend(observed.owned.iter().filter(|k| self.keeps(k)).cloned());
        }
        let mut statuses = Vec::with_capacity(keys.len());
        for key in keys {
            let label = self.key_label(&key);
            if self.key_series.insert(label.clone()) {
                self.metrics.init_file(&label, CONFIGMAP_SYNC_ERRORS);
            }
            let bytes = observed.as_ref().and_then(|o| o.others.get(&key).cloned());
            let want = self.others.values.get(&key).cloned();
            let certificates = self.key_certificates(&key, bytes.as_deref());
            let valid = certificates.iter().any(|c| c.is_valid_at(now));
            let blank = |b: &[u8]| b.iter().all(u8::is_ascii_whitespace);
            // An empty cloud CA, wanted empty: nothing to keep, and nothing wrong.
            let nothing_to_keep = key == CLOUD_CA_KEY
                && bytes.as_deref().is_some_and(blank)
                && want.as_deref().is_some_and(str::is_empty);
            let mut file_problem = match (&self.seen, &bytes) {
                _ if valid || nothing_to_keep => None,
                (Seen::Unknown, _) => Some("not read yet".to_string()),
                (Seen::Missing, _) => Some(format!("{} does not exist", self.label)),
                (_, None) => Some(format!("the ConfigMap has no key {key:?}")),
                (_, Some(_)) if certificates.is_empty() => {
                    Some("the key holds no certificate".to_string())
                }
                _ => Some("no certificate in the key is valid now".to_string()),
            };
            let held = self.others.held.get(&key);
            let (in_sync, sync_problem) = match (&self.seen, want.as_deref()) {
                _ if self.target_down.is_some() => (None, None),
                (Seen::Unknown, _) => (None, None),
                (_, Some(want)) if bytes.as_deref() == Some(want.as_bytes()) => (Some(true), None),
                (_, Some(_)) => {
                    let why = match (&self.last_error, &self.build_problem) {
                        (Some(error), _) => format!("the last apply failed: {error}"),
                        _ if self.desired.is_some() => "publishing".to_string(),
                        (None, Some(problem)) => format!(
                            "nothing is published while the bundle cannot be built: {problem}"
                        ),
                        (None, None) => {
                            "nothing is published before the bundle's sources are read".to_string()
                        }
                    };
                    (Some(false), Some(why))
                }
                (_, None) => {
                    let owned = observed.as_ref().is_some_and(|o| o.owned.contains(&key));
                    match (held, &bytes) {
                        (Some(why), Some(_)) if owned => (Some(false), Some(why.clone())),
                        (Some(why), _) => (None, Some(why.clone())),
                        (None, Some(_)) if owned => (
                            Some(false),
                            Some("no longer in the sources: the next apply removes it".to_string()),
                        ),
                        (None, _) => (
                            None,
                            Some("not known yet: a source has not been read".to_string()),
                        ),
                    }
                }
            };
            let mut file_valid = valid;
            if let Some(down) = &self.target_down {
                file_valid = false;
                file_problem = Some(format!("cannot watch the ConfigMap: {down}"));
            }
            if in_sync == Some(true) {
                self.key_last_sync.insert(key.clone(), unix_now());
            }
            statuses.push(Status {
                kind: TargetKind::ConfigMap,
                bundle_path: label,
                file_warning: None,
                sha256: bytes.as_deref().map(|b| Fingerprint::of(b).to_hex()),
                certificates,
                file_valid,
                file_problem,
                in_sync,
                sync_problem,
                sources: Vec::new(),
                last_sync: self.key_last_sync.get(&key).copied(),
                file_watch: None,
                kubelet: None,
                others: Vec::new(),
                nothing_to_keep,
                removal_held: None,
                held_back: Vec::new(),
                restart: None,
                restart_note: None,
                registry_set: None,
                notes: Vec::new(),
                other_sources: Vec::new(),
            });
        }
        statuses
    }

    /// The certificates of an other key's value, parsed once per distinct value.
    fn key_certificates(&mut self, key: &str, bytes: Option<&[u8]>) -> Vec<Certificate> {
        let Some(bytes) = bytes else {
            return Vec::new();
        };
        let sha = Fingerprint::of(bytes).to_hex();
        if let Some((seen, certificates)) = self.key_certificates.get(key)
            && *seen == sha
        {
            return certificates.clone();
        }
        let certificates = match (
            self.others.values.get(key),
            self.others.certificates.get(key),
        ) {
            (Some(want), Some(certificates)) if want.as_bytes() == bytes => certificates.clone(),
            _ => crate::targets::apply::readable_certificates(bytes),
        };
        self.key_certificates
            .insert(key.to_string(), (sha, certificates.clone()));
        certificates
    }

    /// The fleet's counts for the bundle this publisher builds, from the same verdict as
    /// `rollout status`: none while the Nodes have not been read or no bundle is built.
    fn count_fleet(&mut self) {
        use crate::fleet::verdict::{Ca, Condition, Question, Target, verdict};
        let fleet = self.fleet.borrow().clone();
        let counts = match &self.bundle {
            Some(bundle) if fleet.listed => {
                let question = Question {
                    sources: bundle.certificates.iter().map(Ca::of).collect(),
                    known: Vec::new(),
                    condition: Condition::Sources,
                    target: Target::Bundle,
                };
                let verdict = verdict(&question, fleet.for_verdict(None));
                Some(crate::fleet::gauges::counts(&verdict))
            }
            _ => None,
        };
        self.metrics.fleet.set(counts);
    }

    /// The fleet's check in `/readyz?verbose`, never counted: whether the Nodes' reports
    /// are read (a publisher without get, list and watch on nodes still publishes).
    fn fleet_note(&self) -> (String, Option<String>) {
        let fleet = self.fleet.borrow();
        let problem = match (&fleet.problem, fleet.listed) {
            (Some(trouble), true) => Some(format!(
                "the counts are as last read: cannot follow the Nodes: {}",
                trouble.text
            )),
            (Some(trouble), false) => Some(format!(
                "no counts: cannot read the Nodes: {}",
                trouble.text
            )),
            (None, false) => Some("the Nodes have not been read yet".to_string()),
            (None, true) => None,
        };
        ("fleet".to_string(), problem)
    }

    /// What concerns the other keys as kinds rather than one key: why the cloud CA is held,
    /// and the registries refused, skipped or held. Shown in `/readyz?verbose`; never a
    /// reason not to be ready (the sources' input is not the publisher's to fix).
    fn notes(&self) -> Vec<(String, Option<String>)> {
        let mut notes = Vec::new();
        for (kind, slots) in &self.key_slots {
            if !slots.is_empty() {
                let held = self.others.held.get(kind.key).cloned();
                notes.push((format!("held:{}", kind.key), held));
            }
        }
        if !self.registry_slots.is_empty() {
            let mut problems: Vec<String> =
                self.others.refused.iter().map(|t| t.text.clone()).collect();
            problems.extend(
                self.others
                    .held
                    .iter()
                    .filter(|(k, _)| k.starts_with(REGISTRY_KEY_PREFIX))
                    .map(|(k, why)| format!("{k}: {why}")),
            );
            let problem = (!problems.is_empty()).then(|| problems.join("; "));
            notes.push((format!("held:{REGISTRY_KEY_PREFIX}*"), problem));
        }
        notes
    }
}

fn short(sha256: Option<&str>) -> String {
    sha256.map_or_else(|| "-".to_string(), |s| s.chars().take(12).collect())
}
