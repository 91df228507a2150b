//! `publish`: the cluster-side publisher (SPEC 8b). It builds the bundle from cluster sources
//! with the node agent's engine (same parsing, validation and merge), and keeps it in one key
//! of a ConfigMap with server-side apply, so that thousands of node agents watch a small
//! object that changes only when the bundle does.
//!
//! One loop owns the state, as in `run`: the source watches and the watch of the target
//! ConfigMap send it updates; it decides ([`configmap::decide`]) and hands each apply to a
//! task of its own, so that a slow API server never stops it from answering `/livez`. The
//! endpoint is the node agent's, over the same [`crate::status`].

pub mod configmap;

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
use crate::cli::{ConfigMapRef, PublishArgs};
use crate::credentials::{Credentials, Origin};
use crate::error::{Exit, UsageError};
use crate::metrics::{FileLabels, FileReasonLabels, Metrics};
use crate::server::endpoint::Endpoint;
use crate::server::{self, Pongs};
use crate::source::cluster::{self, Event, Update};
use crate::source::state::SourceState;
use crate::source::{SourceError, SourceSpec};
use crate::status::{Status, TargetKind, unix_now};
use configmap::{Observed, Seen, Step};

/// A failed apply is tried again from 1 s, doubling, up to this.
const APPLY_RETRY_FIRST: Duration = Duration::from_secs(1);
const APPLY_RETRY_MAX: Duration = Duration::from_secs(60);
/// How long the watch's events are held to be older than an apply's answer, at most.
const AWAIT_OWN_WRITE: Duration = Duration::from_secs(5);
/// Certificate boundaries are re-checked at least this often, in case the clock jumps.
const BOUNDARY_RECHECK_MAX: Duration = Duration::from_secs(3600);

pub fn run(args: PublishArgs) -> anyhow::Result<Exit> {
    if !args.once {
        server::endpoint::check_listen(&args.server)?;
    }
    let origin = Origin::resolve(args.kubeconfig.as_deref()).map_err(UsageError)?;
    crate::runtime::build()?.block_on(async {
        if args.once {
            let (client, server) = crate::commands::one_shot_client(&origin)?;
            once(&args, client, &server).await
        } else {
            watch_and_publish(args, Credentials::follow(origin)).await
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

fn policy(args: &PublishArgs) -> Policy {
    Policy {
        retain_removed: 0,
        drop_expired: args.drop_expired,
    }
}

fn no_answer(what: &str, server: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{what}: the API server {server} did not answer within {}s (it took the request and sent nothing); the ConfigMap was left as it was",
        cluster::REQUEST_DEADLINE.as_secs()
    )
}

/// `--once`: read every source, build, read the ConfigMap, apply if it does not hold the
/// bundle already.
async fn once(args: &PublishArgs, client: kube::Client, server: &str) -> anyhow::Result<Exit> {
    let to = &args.to;
    let mut sources = Vec::with_capacity(args.sources.len());
    for spec in &args.sources {
        match cluster::read_once(&client, server, spec).await {
            Ok(parsed) => {
                crate::source::warn_not_ca(spec, &parsed);
                sources.push(parsed);
            }
            Err(error) if error.reason() == "no_answer" => {
                return Err(no_answer(&format!("source {spec}"), server));
            }
            Err(error) => {
                return Err(anyhow::Error::new(error).context(format!("{to} was left as it was")));
            }
        }
    }
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let built = bundle::build(&sources, &[], policy(args), now)
        .with_context(|| format!("{to} was left as it was"))?;
    let rendered = built.bundle.render();
    let sha256 = Fingerprint::of(&rendered).to_hex();
    let api: Api<ConfigMap> = Api::namespaced(client, &to.namespace);
    let current = match tokio::time::timeout(cluster::REQUEST_DEADLINE, api.get_opt(&to.name)).await
    {
        Ok(Ok(current)) => current,
        Ok(Err(e)) => return Err(anyhow::anyhow!("cannot read {to}: {}", kube_error(&e))),
        Err(_) => return Err(no_answer(&format!("reading {to}"), server)),
    };
    if let Some(current) = &current
        && Observed::of(current, &to.key).holds(&sha256)
    {
        tracing::info!(to = %to, certificates = built.bundle.len(), sha256 = %sha256, "already published");
        return Ok(Exit::Success);
    }
    let before = current
        .as_ref()
        .and_then(|c| c.metadata.resource_version.clone());
    let body = configmap::apply_body(
        to,
        &rendered,
        &sha256,
        &source_list(&args.sources),
        before.as_deref(),
    );
    match tokio::time::timeout(cluster::REQUEST_DEADLINE, apply(&api, &to.name, &body)).await {
        Ok(Ok(_)) => {
            tracing::info!(to = %to, certificates = built.bundle.len(), sha256 = %sha256, "published");
            Ok(Exit::Success)
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
struct Desired {
    certificates: Vec<Certificate>,
    rendered: Arc<[u8]>,
    sha256: String,
}

/// The end of an apply, sent back by its task.
/// How an apply ended.
enum Outcome {
    /// The ConfigMap as the API server returned it.
    Applied(Observed),
    /// Its resourceVersion was no longer the one the apply was made against: another
    /// writer (another replica, most likely) changed it first.
    Moved,
    Failed(String),
}

struct Applied {
    sha256: String,
    /// The resourceVersion the ConfigMap had before, as the loop saw it: the apply's
    /// precondition.
    before: Option<String>,
    outcome: Outcome,
    repair: bool,
}

struct Publisher {
    to: ConfigMapRef,
    label: String,
    /// The API server, through the newest client of the followed credentials.
    credentials: Credentials,
    sources_annotation: String,
    policy: Policy,
    slots: Vec<SourceState>,
    desired: Option<Desired>,
    build_problem: Option<String>,
    seen: Seen,
    /// The target's certificates, parsed once per distinct content.
    seen_certificates: Option<(String, Result<Vec<Certificate>, String>)>,
    target_down: Option<String>,
    /// The SHA-256 of the last bundle applied, or found published.
    published: Option<String>,
    /// An apply in flight: the SHA-256 it carries.
    applying: Option<String>,
    /// After an apply, the resourceVersion it made, until the watch shows it: the watch's
    /// events before it are older than what the apply returned, and are not acted on.
    awaiting: Option<(String, Instant)>,
    /// The SHA-256 of the bundle whose apply failed last; another bundle is tried at once,
    /// this one after `retry_at`.
    failed: Option<String>,
    applied_tx: mpsc::UnboundedSender<Applied>,
    retry_at: Option<Instant>,
    retry_delay: Duration,
    last_error: Option<String>,
    /// The first source change not yet published: the start of the sync duration.
    pending_since: Option<Instant>,
    last_sync: Option<f64>,
    metrics: Arc<Metrics>,
    status: watch::Sender<Arc<Status>>,
}

/// The loop's inputs besides the source updates.
enum Input {
    Target(Event<Observed>),
    Applied(Applied),
}

async fn watch_and_publish(args: PublishArgs, credentials: Credentials) -> anyhow::Result<Exit> {
    let to = args.to.clone();
    let label = to.to_string();
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        to = %label,
        sources = %source_list(&args.sources),
        "publishing"
    );
    let metrics = Arc::new(Metrics::default());
    // Every counter has its series at 0 from the start, as the node agent's do.
    metrics.init_file(
        &label,
        &[
            crate::metrics::known::CONFIGMAP_SYNC_ERRORS,
            crate::metrics::known::CLUSTER_SYNC_ERRORS,
        ],
    );
    for spec in &args.sources {
        metrics.init_source(spec);
    }
    let (status_tx, status_rx) = watch::channel(Arc::new(Status {
        kind: TargetKind::ConfigMap,
        bundle_path: label.clone(),
        ..Status::default()
    }));
    let (liveness, pongs) = server::liveness();
    let endpoint = Endpoint::start(
        &args.server,
        None,
        Some(&credentials),
        metrics.clone(),
        status_rx.clone(),
        liveness,
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

    let (update_tx, mut updates) = mpsc::unbounded_channel();
    cluster::watch_sources(&credentials, &args.sources, &update_tx);
    drop(update_tx);
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

    let mut publisher = Publisher {
        credentials,
        to,
        label,
        sources_annotation: source_list(&args.sources),
        policy: policy(&args),
        slots: args.sources.iter().map(SourceState::new).collect(),
        desired: None,
        build_problem: None,
        seen: Seen::Unknown,
        seen_certificates: None,
        target_down: None,
        published: None,
        applying: None,
        awaiting: None,
        failed: None,
        applied_tx,
        retry_at: None,
        retry_delay: APPLY_RETRY_FIRST,
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
        if self.slots[update.index].observe(update.event, &self.metrics) {
            self.pending_since.get_or_insert(update.at);
        }
    }

    fn on_input(&mut self, input: Input) {
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

    fn on_applied(&mut self, applied: Applied) {
        self.applying = None;
        let file = FileLabels {
            filepath: self.label.clone(),
        };
        match applied.outcome {
            Outcome::Moved => {
                // Not an error: look again once the watch shows what changed (or a second
                // from now, should it not).
                tracing::info!(to = %self.label, "the ConfigMap changed before the apply reached it (another replica?); looking again");
                self.retry_at = Some(Instant::now() + APPLY_RETRY_FIRST);
                self.failed = Some(applied.sha256);
            }
            Outcome::Applied(observed) => {
                self.published = Some(applied.sha256.clone());
                self.retry_delay = APPLY_RETRY_FIRST;
                self.retry_at = None;
                self.failed = None;
                self.last_error = None;
                // The apply was made against `before` (a precondition), so it changed the
                // ConfigMap unless it returned that very version; one that created it had
                // no precondition, and counts even if another replica created it first.
                let changed =
                    applied.before.is_none() || observed.resource_version != applied.before;
                if changed {
                    let counter = if applied.repair {
                        &self.metrics.repairs
                    } else {
                        &self.metrics.writes
                    };
                    counter.get_or_create(&file).inc();
                }
                let seen_rv = match &self.seen {
                    Seen::Present(seen) => seen.resource_version.clone(),
                    _ => None,
                };
                if let Some(rv) = &observed.resource_version
                    && seen_rv.as_ref() != Some(rv)
                {
                    self.awaiting = Some((rv.clone(), Instant::now()));
                    self.seen = Seen::Present(observed);
                }
                if let Some(since) = self.pending_since.take() {
                    self.metrics
                        .sync_duration
                        .observe(since.elapsed().as_secs_f64());
                }
                tracing::info!(to = %self.label, sha256 = %applied.sha256, repair = applied.repair, "published");
            }
            Outcome::Failed(problem) => {
                self.metrics
                    .sync_errors
                    .get_or_create(&FileReasonLabels {
                        filepath: self.label.clone(),
                        reason: "apply_failed".to_string(),
                    })
                    .inc();
                tracing::error!(to = %self.label, "cannot apply the ConfigMap: {problem}; trying again in {}s", self.retry_delay.as_secs());
                self.retry_at = Some(Instant::now() + self.retry_delay);
                self.retry_delay = (self.retry_delay * 2).min(APPLY_RETRY_MAX);
                self.failed = Some(applied.sha256);
                self.last_error = Some(problem);
            }
        }
    }

    /// Builds the bundle from every source's last good content, once each has some.
    fn build(&mut self) {
        if self.slots.iter().any(|s| s.content.is_none()) {
            self.desired = None;
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
                if self.desired.as_ref().is_some_and(|d| d.sha256 == sha256) {
                    return;
                }
                self.desired = Some(Desired {
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
                self.desired = None;
            }
        }
    }

    fn pass(&mut self) {
        self.build();
        let desired = self.desired.as_ref().map(|d| d.sha256.as_str());
        if let (Some(desired), Seen::Present(observed)) = (desired, &self.seen)
            && observed.holds(desired)
            && self.published.as_deref() != Some(desired)
        {
            tracing::info!(to = %self.label, sha256 = %desired, "the ConfigMap already holds the bundle");
            self.published = Some(desired.to_string());
            self.pending_since = None;
        }
        let step = configmap::decide(
            desired,
            self.published.as_deref(),
            &self.seen,
            self.target_down.is_some(),
        );
        let backing_off = self.retry_at.is_some() && self.failed.as_deref() == desired;
        match step {
            Step::Wait => {
                // Nothing left to publish: a source change that left the bundle as it was
                // has no sync to time.
                if self.applying.is_none() && self.published.as_deref() == desired {
                    self.pending_since = None;
                }
            }
            _ if self.applying.is_some() || backing_off => {}
            step => self.start_apply(step == Step::Repair),
        }
        self.publish_status();
        crate::runtime::allocator::after_pass(
            self.desired.as_ref().map_or(0, |d| d.rendered.len()),
        );
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
        let before = match &self.seen {
            Seen::Present(observed) => observed.resource_version.clone(),
            _ => None,
        };
        let body = configmap::apply_body(
            &self.to,
            &desired.rendered,
            &desired.sha256,
            &self.sources_annotation,
            before.as_deref(),
        );
        let key = self.to.key.clone();
        let (name, tx) = (self.to.name.clone(), self.applied_tx.clone());
        let client = self.credentials.client();
        let namespace = self.to.namespace.clone();
        let sha256 = desired.sha256.clone();
        self.applying = Some(sha256.clone());
        tokio::spawn(async move {
            let api: Api<ConfigMap> = match client {
                Ok(client) => Api::namespaced(client, &namespace),
                Err(why) => {
                    let outcome =
                        Outcome::Failed(format!("no usable credentials for the API server: {why}"));
                    let _ = tx.send(Applied {
                        sha256,
                        before,
                        outcome,
                        repair,
                    });
                    return;
                }
            };
            let outcome =
                match tokio::time::timeout(cluster::REQUEST_DEADLINE, apply(&api, &name, &body))
                    .await
                {
                    Ok(Ok(cm)) => Outcome::Applied(Observed::of(&cm, &key)),
                    Ok(Err(kube::Error::Api(status))) if status.code == 409 => Outcome::Moved,
                    Ok(Err(e)) => Outcome::Failed(kube_error(&e)),
                    Err(_) => Outcome::Failed(format!(
                        "the API server sent no answer within {}s",
                        cluster::REQUEST_DEADLINE.as_secs()
                    )),
                };
            let _ = tx.send(Applied {
                sha256,
                before,
                outcome,
                repair,
            });
        });
    }

    /// Time until the next instant the bundle's validity can change.
    fn next_boundary(&self) -> Duration {
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let next = self
            .slots
            .iter()
            .filter_map(|s| s.content.as_ref())
            .flat_map(|c| c.certificates.iter())
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
        let parsed = match (&self.desired, observed.bytes.as_deref()) {
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
        let (in_sync, sync_problem) = match (&self.desired, &seen) {
            _ if self.target_down.is_some() => (None, None),
            (None, _) | (_, Seen::Unknown) => (None, None),
            (Some(desired), Seen::Present(observed)) if observed.holds(&desired.sha256) => {
                (Some(true), None)
            }
            (Some(desired), _) => {
                let why = match (&self.last_error, &seen) {
                    (Some(error), _) => format!("the last apply failed: {error}"),
                    (None, Seen::Present(observed)) => match observed.damage() {
                        Some(damage) => damage,
                        None if self.published.as_deref() == Some(&desired.sha256) => format!(
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
        let status = Status {
            kind: TargetKind::ConfigMap,
            bundle_path: self.label.clone(),
            certificates,
            sha256,
            file_valid: valid,
            file_problem: problem,
            in_sync,
            sync_problem,
            sources: self.slots.iter().map(SourceState::status).collect(),
            last_sync: self.last_sync,
            file_watch: None,
            kubelet: None,
            others: Vec::new(),
            nothing_to_keep: false,
            notes: Vec::new(),
        };
        self.status.send_replace(Arc::new(status));
    }
}

fn short(sha256: Option<&str>) -> String {
    sha256.map_or_else(|| "-".to_string(), |s| s.chars().take(12).collect())
}
