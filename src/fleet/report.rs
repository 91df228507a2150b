//! The node's side of the rollout (SPEC 8c): one more observer of the targets' status, as
//! the metrics are. After the first pass, and after each pass that changes what a target
//! holds or why, it writes the `kubelet-ca-agent/held` annotation on the agent's own Node
//! with node-scoped credentials (a JSON merge patch of that one annotation), only when its
//! value changes: nothing while idle, one write per change.
//!
//! Reporting never delays or changes a write, readiness or the loop: it runs on its own
//! task, fed by the status channel (the latest status, never a queue), every request with a
//! deadline. A refused (403), shed (429), failing or hung API server costs the report alone,
//! retried with the backoff of SPEC 6 and counted; a Node that does not exist yet (first
//! boot) is waited for quietly. What it decides is [`Policy`], pure; [`run`] carries it out.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::events::{self, Notice, Regarding};
use super::held::{ANNOTATION, Held};
use super::own_node::{self, Seen};
use crate::credentials::{Credentials, Current};
use crate::follow::lifecycle::{self, Backoff, Failure};
use crate::metrics::{CauseLabels, Metrics, ReasonLabels};
use crate::status::{Check, Status, StatusRx};

/// How long a report whose targets are not all known yet (the first pass, before every
/// source was read) waits for them before it is written anyway.
pub const SETTLE: Duration = Duration::from_secs(10);
/// A request to the API server that takes longer has failed.
const DEADLINE: Duration = Duration::from_secs(10);
/// The field manager of the patch.
const MANAGER: &str = "kubelet-ca-agent";

/// Why the report is written, for `kubelet_ca_node_report_writes_total{cause}` and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The first write of this process: the Node did not hold its report.
    Start,
    /// What the node holds, or why, changed.
    Change,
    /// Someone removed the annotation.
    Removed,
    /// Someone changed the annotation into something the node did not write.
    Edited,
    /// The Node was deleted and registered again (a new uid).
    Registered,
    /// The store was restored from a backup taken before the report.
    Restored,
}

impl Cause {
    /// The `cause` label.
    pub fn label(self) -> &'static str {
        match self {
            Cause::Start => "start",
            Cause::Change => "change",
            Cause::Removed => "removed",
            Cause::Edited => "edited",
            Cause::Registered => "registered",
            Cause::Restored => "restored",
        }
    }

    /// Whether the write puts back a report that something else undid (logged once each).
    pub fn is_repair(self) -> bool {
        matches!(
            self,
            Cause::Removed | Cause::Edited | Cause::Registered | Cause::Restored
        )
    }
}

/// What the policy asks for next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write this value, for this cause.
    Write(String, Cause),
    /// Nothing to do before `until` (or a new status, new credentials, or news of the Node).
    Wait { until: Instant },
    /// Nothing to do until a new status, new credentials, or news of the Node.
    Idle,
}

/// How a write ended, as the policy tells them apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The write was accepted; the Node's resourceVersion after it, when it is a number.
    Written { rv: Option<u64> },
    /// There is no such Node (it went between the watch and the write).
    NoNode,
    /// The request failed: its kind for the backoff, its reason label, and what to say.
    Failed {
        failure: Failure,
        reason: &'static str,
        message: String,
    },
}

/// What the Node holds, as its watch says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OnNode {
    /// Not known: its watch has not listed it yet.
    Unknown,
    /// There is no such Node (yet: a new node registers it).
    Missing,
    /// The Node `uid`: whether it has the report's annotation, and the report in it when
    /// it is one (read once, when the watch brings it).
    Holds {
        uid: String,
        present: bool,
        held: Option<Held>,
    },
}

impl OnNode {
    /// The Node `uid`, whose annotation is `annotation`.
    pub fn holds(uid: String, annotation: Option<&str>) -> OnNode {
        OnNode::Holds {
            uid,
            present: annotation.is_some(),
            held: annotation.and_then(|v| Held::parse(v).ok()),
        }
    }
}

/// How the report stands, for the `node-report` check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// The Node holds the true report.
    Held,
    /// Not written yet, and nothing failed: the first pass, the Node's watch, a Node not
    /// registered yet.
    Pending(String),
    /// It cannot be written or kept: why.
    Failed(String),
}

/// What the reporter knows, and the rules of what it does next. No socket, no clock: the
/// caller passes `now` and a jitter draw.
#[derive(Debug)]
pub struct Policy {
    /// When the reporter started: a report not all known is held back until [`SETTLE`]
    /// after it.
    started: Instant,
    /// The report as last built, with the time it last changed.
    built: Option<Held>,
    /// Whether every target of `built` was known (every source read).
    settled: bool,
    /// What the Node holds, as its watch last said (or the last write made it).
    node: OnNode,
    /// The Node and the report it held of this node's, as last seen or written: what a
    /// difference is measured from, to tell a change from a repair.
    confirmed: Option<(String, Held)>,
    /// The Node's resourceVersion after the last write: a state of the Node older than it
    /// that the watch brings after the write is not what the Node holds.
    written_rv: Option<u64>,
    /// The last list of the Node stood on a store that went back, and nothing was written
    /// since.
    restored: bool,
    /// Why the Node's watch fails, when it does.
    watch_problem: Option<String>,
    backoff: Backoff,
    retry_at: Option<Instant>,
    /// Why the last write failed, when it did.
    problem: Option<String>,
}

impl Policy {
    pub fn new(now: Instant) -> Policy {
        Policy {
            started: now,
            built: None,
            settled: false,
            node: OnNode::Unknown,
            confirmed: None,
            written_rv: None,
            restored: false,
            watch_problem: None,
            backoff: Backoff::default(),
            retry_at: None,
            problem: None,
        }
    }

    /// A new status made `held` (its time is `now`'s); `settled` when every target's sync
    /// is known. The time of the last change stays as it was when nothing else differs.
    pub fn observe(&mut self, held: Held, settled: bool) {
        self.settled = settled;
        match &self.built {
            Some(built) if built.same_as(&held) => {}
            _ => self.built = Some(held),
        }
        self.adopt();
    }

    /// The Node's watch says `node`, at resourceVersion `rv`; `as_of`: a list found it in
    /// the store as of that revision; `restored`: that list stood on a store that went
    /// back. A state older than the last write is passed over (the watch brings it after
    /// the write, and the write's own state follows it), unless the store went back since:
    /// told so, or a list past the write that finds the Node older than it (the store lost
    /// the write: restored from a backup, its revisions caught up before the list).
    pub fn seen(&mut self, node: OnNode, rv: Option<u64>, as_of: Option<u64>, restored: bool) {
        let lost = matches!(
            (self.written_rv, rv, as_of),
            (Some(written), Some(rv), Some(at)) if rv < written && at >= written
        );
        if restored || lost {
            // A store restored from a backup: its revisions are behind the write's, and
            // what it holds is what the Node holds now.
            self.restored = true;
            self.written_rv = None;
        }
        if let (Some(written), Some(rv), OnNode::Holds { .. }) = (self.written_rv, rv, &node)
            && rv < written
        {
            return;
        }
        self.node = node;
        self.adopt();
    }

    /// The Node's watch fails (`Some`, why) or follows it again (`None`).
    pub fn watch_problem(&mut self, why: Option<String>) {
        self.watch_problem = why;
    }

    /// What the Node holds is this node's report as built: it is confirmed, and its time
    /// is the Node's (an agent restarted on a node whose report has not changed writes
    /// nothing, and keeps the time).
    fn adopt(&mut self) {
        let (Some(built), OnNode::Holds { uid, held, .. }) = (&mut self.built, &self.node) else {
            return;
        };
        let Some(held) = held else {
            return;
        };
        if held.same_as(built) {
            *built = held.clone();
            self.confirmed = Some((uid.clone(), held.clone()));
            self.restored = false;
        }
    }

    /// New credentials: a request that failed is tried again with them at once.
    pub fn new_credentials(&mut self) {
        self.retry_at = None;
    }

    /// What to do at `now`. `can_ask`: there are credentials and a node name.
    pub fn next(&self, now: Instant, can_ask: bool) -> Action {
        let Some(built) = &self.built else {
            return Action::Idle;
        };
        if !can_ask {
            return Action::Idle;
        }
        let OnNode::Holds { uid, present, held } = &self.node else {
            return Action::Idle;
        };
        if held.as_ref().is_some_and(|held| held.same_as(built)) {
            return Action::Idle;
        }
        if let Some(at) = self.retry_at
            && at > now
        {
            return Action::Wait { until: at };
        }
        if !self.settled {
            let at = self.started + SETTLE;
            if at > now {
                return Action::Wait { until: at };
            }
        }
        Action::Write(built.to_json(), self.cause(uid, *present, held.as_ref()))
    }

    /// Why the Node `uid`, whose annotation is `present` and holds `on_node` of this
    /// node's reports, is to be written.
    fn cause(&self, uid: &str, present: bool, on_node: Option<&Held>) -> Cause {
        if self.restored {
            return Cause::Restored;
        }
        let Some((confirmed_uid, confirmed)) = &self.confirmed else {
            return Cause::Start;
        };
        if confirmed_uid != uid {
            return Cause::Registered;
        }
        match on_node {
            _ if !present => Cause::Removed,
            Some(held) if held.same_as(confirmed) => Cause::Change,
            _ => Cause::Edited,
        }
    }

    /// How the write of [`Policy::next`] ended, at `now`.
    pub fn outcome(&mut self, outcome: Outcome, now: Instant, jitter: f64) {
        match outcome {
            Outcome::Written { rv } => {
                if let (Some(built), OnNode::Holds { uid, present, held }) =
                    (&self.built, &mut self.node)
                {
                    *present = true;
                    *held = Some(built.clone());
                    self.confirmed = Some((uid.clone(), built.clone()));
                }
                self.written_rv = rv;
                self.restored = false;
                self.backoff.reset();
                self.retry_at = None;
                self.problem = None;
            }
            Outcome::NoNode => {
                let delay = self.backoff.after(Failure::ANSWERED, jitter);
                self.retry_at = Some(now + delay);
                self.problem = None;
            }
            Outcome::Failed {
                failure, message, ..
            } => {
                let delay = self.backoff.after(failure, jitter);
                self.retry_at = Some(now + delay);
                self.problem = Some(format!("{message}; trying again in {}", seconds(delay)));
            }
        }
    }

    /// How the report stands. `can_ask`: why it cannot be asked for, when it cannot.
    pub fn standing(&self, can_ask: Result<(), String>) -> Standing {
        if let Err(why) = can_ask {
            return Standing::Failed(why);
        }
        if let Some(why) = &self.watch_problem {
            return Standing::Failed(format!("cannot follow its Node: {why}"));
        }
        let Some(built) = &self.built else {
            return Standing::Pending("waiting for the first pass".to_string());
        };
        match &self.node {
            OnNode::Unknown => Standing::Pending("waiting for the Node's watch".to_string()),
            OnNode::Missing => Standing::Pending(
                "waiting for the Node to exist (a new node registers it)".to_string(),
            ),
            OnNode::Holds { held, .. } => match (&self.problem, held) {
                (_, Some(held)) if held.same_as(built) => Standing::Held,
                (Some(problem), _) => Standing::Failed(problem.clone()),
                (None, _) if !self.settled && self.confirmed.is_none() => Standing::Pending(
                    "waiting for every source to be read before the first report".to_string(),
                ),
                (None, _) => Standing::Pending("not written yet".to_string()),
            },
        }
    }
}

fn seconds(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// Where the report goes and who writes it.
pub struct Reporter {
    /// `--node-name`, when given: it wins over the credentials' node.
    pub node_name: Option<String>,
    pub credentials: Credentials,
    pub status: StatusRx,
    pub metrics: Arc<Metrics>,
    /// The `node-report` check of `/readyz?verbose`.
    pub check: watch::Sender<Option<Check>>,
    /// Where the Events told by the statuses go ([`super::events::run`]); `None`: none are.
    pub events: Option<mpsc::Sender<(Notice, Regarding)>>,
}

/// The Node the report goes to: `--node-name`, else the `system:node:NAME` of the
/// credentials' client certificate, else the Node their service account token is bound to.
pub fn node_name(given: Option<&str>, current: &Current) -> Result<String, String> {
    if let Some(name) = given.filter(|n| !n.is_empty()) {
        return Ok(name.to_string());
    }
    if let (None, Some(node)) = (current.client_certificate(), &current.token_node) {
        return Ok(node.clone());
    }
    match current.client_certificate() {
        Some(cert) => match cert.subject_cn.strip_prefix("system:node:") {
            Some(name) if !name.is_empty() => Ok(name.to_string()),
            _ => Err(format!(
                "no node to report to: the credentials are {}, not a node's (system:node:NAME); set --node-name, or --report-kubeconfig to the kubelet's kubeconfig",
                crate::text::escape(&cert.subject_cn)
            )),
        },
        None if !current.read => Err("the credentials have not been read yet".to_string()),
        None => Err("no node to report to: the credentials hold no client certificate naming a node (system:node:NAME) and no token bound to a Pod on a node (Kubernetes 1.30 and later); set --node-name".to_string()),
    }
}

/// The one name of this node, for the log and the `node` label: `--node-name` as given,
/// else the Node the credentials name, else `host` (this host's name). With it, a warning
/// when the name given is not the one the credentials name (the API server will refuse the
/// report to them).
pub fn identity(
    given: Option<&str>,
    credentials: Option<&str>,
    host: Option<&str>,
) -> (Option<String>, Option<String>) {
    let given = given.filter(|n| !n.is_empty());
    let warning = match (given, credentials) {
        (Some(given), Some(named)) if given != named => Some(format!(
            "--node-name {given} is not the node the credentials name ({named}): the report goes to Node {given}, which the API server refuses to {named}'s own credentials"
        )),
        _ => None,
    };
    let name = given.or(credentials).or(host).map(str::to_string);
    (name, warning)
}

/// Whether every target's sync is known: until then the report waits up to [`SETTLE`].
fn settled(status: &Status) -> bool {
    status
        .files()
        .all(|f| f.in_sync.is_some() || f.nothing_to_keep)
}

/// Now, as the report says it.
fn rfc3339_now() -> String {
    time::OffsetDateTime::now_utc()
        .replace_nanosecond(0)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

impl Reporter {
    /// Runs until the status channel closes (the loop ended).
    pub async fn run(mut self) {
        let mut policy = Policy::new(Instant::now());
        let mut credentials = self.credentials.clone();
        let mut generation = credentials.current().generation;
        let mut said_name: Option<Result<String, String>> = None;
        let mut last = Arc::new(Status::default());
        // The watch of the Node the report goes to: its name, what it sees, its task.
        let mut own: Option<Own> = None;
        // The Node's uid, once seen: the Events' reference.
        let mut uid: Option<String> = None;
        // The last failure said in the log.
        let mut warned: Option<String> = None;
        loop {
            let status = self.status.borrow_and_update().clone();
            let current = credentials.mark_seen();
            let name = node_name(self.node_name.as_deref(), &current);
            if let Ok(name) = &name
                && own.as_ref().is_none_or(|own| own.name != *name)
            {
                // A new name (the credentials name another node): the old Node's watch
                // ends, and what it knew with it.
                own = Some(Own::start(&credentials, name, &self.metrics));
                policy.seen(OnNode::Unknown, None, None, false);
            }
            // What the watch saw, read into the policy once each time it says something
            // new (the wait below marks it seen: the last one taken is compared instead).
            let news = own.as_mut().and_then(|own| {
                let now = own.seen.borrow_and_update().clone();
                (own.taken.as_ref() != Some(&now)).then_some(now)
            });
            if let (Some(own), Some(seen)) = (own.as_mut(), news) {
                own.taken = Some(seen.clone());
                let restored = seen.restores != own.restores;
                own.restores = seen.restores;
                let (node, rv) = match &seen.node {
                    _ if !seen.listed => (OnNode::Unknown, None),
                    None => (OnNode::Missing, None),
                    Some(node) => {
                        uid = Some(node.uid.clone());
                        let holds = OnNode::holds(node.uid.clone(), node.annotation.as_deref());
                        (holds, node.rv)
                    }
                };
                policy.seen(node, rv, seen.as_of, restored);
                policy.watch_problem(seen.problem.as_ref().map(|p| p.text.clone()));
            }
            // The first pass publishes a status with the bundle's path.
            if !status.bundle_path.is_empty() && !Arc::ptr_eq(&status, &last) {
                policy.observe(Held::of(&status, rfc3339_now()), settled(&status));
                if let (Some(events), Ok(name)) = (&self.events, &name) {
                    for notice in events::between(&last, &status) {
                        let regarding = Regarding {
                            name: name.clone(),
                            uid: uid.clone(),
                        };
                        if events.try_send((notice, regarding)).is_err() {
                            self.metrics.not_recorded("queue_full");
                        }
                    }
                }
                last = status;
            }
            if current.generation != generation {
                generation = current.generation;
                policy.new_credentials();
            }
            if said_name.as_ref() != Some(&name) {
                match &name {
                    Ok(name) => {
                        tracing::info!(node = %name, "reporting what this node holds on its Node ({ANNOTATION}), and keeping it there")
                    }
                    Err(why) if current.read => {
                        tracing::warn!("not reporting what this node holds: {why}")
                    }
                    Err(_) => {}
                }
                said_name = Some(name.clone());
            }
            let client = current.client.clone();
            let can_ask = match (&name, &client) {
                (Ok(_), Some(_)) => Ok(()),
                (Err(why), _) => Err(why.clone()),
                (Ok(_), None) => Err(format!("no credentials: {}", current.why_none())),
            };
            let action = policy.next(Instant::now(), can_ask.is_ok());
            let (Ok(name), Some(client), Action::Write(value, cause)) =
                (&name, client, action.clone())
            else {
                self.show(&policy, can_ask);
                let until = match action {
                    Action::Wait { until } => Some(until),
                    _ => None,
                };
                if !self.wait(&mut credentials, own.as_mut(), until).await {
                    return;
                }
                continue;
            };
            let server = current.server.clone().unwrap_or_default();
            let api: Api<Node> = Api::all(client);
            let outcome = write(&api, name, &server, &value).await;
            self.count(&outcome, cause, name, &mut warned);
            policy.outcome(outcome, Instant::now(), lifecycle::jitter());
            self.show(&policy, Ok(()));
        }
    }

    /// Waits for a new status, new credentials, news of the Node, or `until`; false when
    /// the loop ended.
    async fn wait(
        &mut self,
        credentials: &mut Credentials,
        own: Option<&mut Own>,
        until: Option<Instant>,
    ) -> bool {
        let sleep = async {
            match until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let node = async {
            match own {
                Some(own) => {
                    if own.seen.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = self.status.changed() => changed.is_ok(),
            () = credentials.changed() => true,
            () = node => true,
            () = sleep => true,
        }
    }

    /// Counts an outcome, and says it in the log: a repair once each, a failure once until
    /// it changes or the report gets through.
    fn count(&self, outcome: &Outcome, cause: Cause, name: &str, warned: &mut Option<String>) {
        match outcome {
            Outcome::Written { .. } => {
                self.metrics
                    .node_report_writes
                    .get_or_create(&CauseLabels {
                        cause: cause.label().to_string(),
                    })
                    .inc();
                *warned = None;
                if cause.is_repair() {
                    tracing::info!(node = %name, cause = cause.label(), "put this node's report back on its Node ({})", repaired(cause));
                } else {
                    tracing::debug!(node = %name, cause = cause.label(), "wrote what this node holds on its Node");
                }
            }
            Outcome::NoNode => {
                self.error("node_missing");
                tracing::debug!(node = %name, "the Node went away before the write: waiting for it");
            }
            Outcome::Failed {
                reason, message, ..
            } => {
                self.error(reason);
                if warned.as_ref() != Some(message) {
                    tracing::warn!(node = %name, reason, "cannot report what this node holds on its Node (retrying with backoff; said again only if it changes): {message}");
                    *warned = Some(message.clone());
                } else {
                    tracing::debug!(node = %name, reason, "cannot report what this node holds on its Node: {message}");
                }
            }
        }
    }

    fn error(&self, reason: &str) {
        self.metrics
            .node_report_errors
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Publishes the `node-report` check, when it says something new: pending (never
    /// failed) before the first write and while the Node is not registered.
    fn show(&self, policy: &Policy, can_ask: Result<(), String>) {
        let name = "node-report".to_string();
        let check = match policy.standing(can_ask) {
            Standing::Held => Check::shown(name, None),
            Standing::Pending(why) => Check::pending(name, why),
            Standing::Failed(why) => Check::shown(name, Some(why)),
        };
        self.check.send_if_modified(|shown| {
            let new = Some(&check) != shown.as_ref();
            if new {
                *shown = Some(check);
            }
            new
        });
    }
}

/// What a repair put right, for the log.
fn repaired(cause: Cause) -> &'static str {
    match cause {
        Cause::Removed => "someone removed the annotation",
        Cause::Edited => "someone changed the annotation",
        Cause::Registered => "the Node was registered again",
        Cause::Restored => "the API server's store was restored from a backup",
        Cause::Start | Cause::Change => "it changed",
    }
}

/// The watch of the Node the report goes to.
struct Own {
    name: String,
    seen: watch::Receiver<Seen>,
    /// The restores counted when last looked at.
    restores: u64,
    /// What the watch said when the policy last took it.
    taken: Option<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl Own {
    fn start(credentials: &Credentials, name: &str, metrics: &Arc<Metrics>) -> Own {
        let (tx, seen) = watch::channel(Seen::default());
        let follow = own_node::follow(
            credentials.clone(),
            name.to_string(),
            tx,
            Some(metrics.clone()),
        );
        let task = tokio::spawn(follow);
        Own {
            name: name.to_string(),
            seen,
            restores: 0,
            taken: None,
            task,
        }
    }
}

impl Drop for Own {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Writes the annotation: a merge patch of it alone.
async fn write(api: &Api<Node>, name: &str, server: &str, value: &str) -> Outcome {
    let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION: value}}});
    let params = PatchParams {
        field_manager: Some(MANAGER.to_string()),
        ..PatchParams::default()
    };
    match tokio::time::timeout(
        DEADLINE,
        api.patch_metadata(name, &params, &Patch::Merge(&patch)),
    )
    .await
    {
        Ok(Ok(node)) => Outcome::Written {
            rv: node
                .metadata
                .resource_version
                .as_deref()
                .and_then(|rv| rv.parse().ok()),
        },
        // A 404 (the Node went between the watch and the write) is told by `failed`.
        Ok(Err(e)) => failed(&e, server, name),
        Err(_) => hung(server),
    }
}

/// A failed request, as the policy and the operator need it.
fn failed(error: &kube::Error, server: &str, name: &str) -> Outcome {
    if let kube::Error::Api(status) = error
        && status.code == 404
    {
        return Outcome::NoNode;
    }
    let (said, failure) = crate::source::cluster::request_error("node report", server, error);
    let (said_reason, mut message) = match said {
        crate::source::SourceError::Cluster { reason, error, .. } => (reason, error),
        other => (other.reason(), other.to_string()),
    };
    let reason = match error {
        kube::Error::Api(status) => match status.code {
            401 => "unauthorized",
            403 => "forbidden",
            429 => "too_many_requests",
            500..=599 => "server_error",
            _ => "api_error",
        },
        _ => match failure {
            Failure::Unreachable => "unreachable",
            _ => said_reason,
        },
    };
    if reason == "forbidden" {
        message = format!(
            "{message} (a node may read and write only its own Node: is {} this node's name, and the credentials this node's?)",
            crate::text::escape(name)
        );
    }
    Outcome::Failed {
        failure,
        reason,
        message,
    }
}

fn hung(server: &str) -> Outcome {
    Outcome::Failed {
        failure: Failure::Hung,
        reason: "timeout",
        message: format!(
            "{server}: the API server sent no answer within {}s",
            DEADLINE.as_secs()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;

    const MIN: f64 = 0.0;

    fn status(in_sync: Option<bool>) -> Status {
        let now = test_certs::now();
        Status {
            bundle_path: "/etc/kubernetes/kubelet-ca.crt".into(),
            certificates: vec![test_certs::ca(Some("signer"), None, now - 60, now + 3600)],
            file_valid: true,
            in_sync,
            ..Status::default()
        }
    }

    fn held(status: &Status, at: &str) -> Held {
        Held::of(status, at.to_string())
    }

    fn holds(uid: &str, annotation: Option<String>) -> OnNode {
        OnNode::holds(uid.into(), annotation.as_deref())
    }

    /// The write the policy asks for, with its cause.
    fn write(p: &Policy, now: Instant) -> (Held, Cause) {
        match p.next(now, true) {
            Action::Write(json, cause) => (Held::parse(&json).unwrap(), cause),
            other => panic!("a write, not {other:?}"),
        }
    }

    #[test]
    fn it_writes_once_per_change_and_only_when_the_node_does_not_hold_the_report() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        assert_eq!(p.next(now, true), Action::Idle, "nothing built yet");
        let s = status(Some(true));
        p.observe(held(&s, "t1"), true);
        assert_eq!(
            p.next(now, true),
            Action::Idle,
            "the Node's watch has not listed it"
        );
        p.seen(holds("u1", None), Some(5), None, false);
        assert_eq!(p.next(now, false), Action::Idle, "no credentials or name");
        // The same status again before the write: the report keeps the time it changed.
        p.observe(held(&s, "t1, again"), true);
        assert_eq!(write(&p, now), (held(&s, "t1"), Cause::Start));
        p.outcome(Outcome::Written { rv: Some(6) }, now, MIN);
        assert_eq!(p.next(now, true), Action::Idle);
        assert_eq!(p.standing(Ok(())), Standing::Held);
        // The watch brings the Node as it was before the write, then the write itself.
        p.seen(holds("u1", None), Some(5), None, false);
        assert_eq!(
            p.next(now, true),
            Action::Idle,
            "an older state is passed over"
        );
        p.seen(
            holds("u1", Some(held(&s, "t1").to_json())),
            Some(6),
            None,
            false,
        );
        assert_eq!(p.next(now, true), Action::Idle);
        // The same report at another time: nothing to write, and its time stays.
        p.observe(held(&s, "t2"), true);
        assert_eq!(p.next(now, true), Action::Idle);
        // A change: one write, with the new time.
        let mut changed = s.clone();
        changed.in_sync = Some(false);
        p.observe(held(&changed, "t3"), true);
        assert_eq!(
            p.standing(Ok(())),
            Standing::Pending("not written yet".into())
        );
        let (written, cause) = write(&p, now);
        assert_eq!((written.changed.as_str(), cause), ("t3", Cause::Change));
    }

    #[test]
    fn a_report_undone_is_put_back_and_the_cause_said() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        let s = status(Some(true));
        let ours = held(&s, "t").to_json();
        p.observe(held(&s, "t"), true);
        p.seen(holds("u1", Some(ours.clone())), Some(5), None, false);
        assert_eq!(
            p.next(now, true),
            Action::Idle,
            "it holds the report already"
        );
        // Removed.
        p.seen(holds("u1", None), Some(7), None, false);
        assert_eq!(write(&p, now).1, Cause::Removed);
        p.outcome(Outcome::Written { rv: Some(8) }, now, MIN);
        // Edited into a lie: a report that says the node is out of sync.
        let mut lie = s.clone();
        lie.in_sync = Some(false);
        p.seen(
            holds("u1", Some(held(&lie, "t").to_json())),
            Some(9),
            None,
            false,
        );
        assert_eq!(write(&p, now), (held(&s, "t"), Cause::Edited));
        // Edited into something that is no report at all.
        p.seen(holds("u1", Some("{not json".into())), Some(10), None, false);
        assert_eq!(write(&p, now).1, Cause::Edited);
        p.outcome(Outcome::Written { rv: Some(11) }, now, MIN);
        // Deleted, then registered again: waited for, then a new uid.
        p.seen(OnNode::Missing, None, None, false);
        assert_eq!(p.next(now, true), Action::Idle);
        assert!(
            matches!(p.standing(Ok(())), Standing::Pending(why) if why.starts_with("waiting for the Node to exist"))
        );
        p.seen(holds("u2", None), Some(12), None, false);
        assert_eq!(write(&p, now).1, Cause::Registered);
        p.outcome(Outcome::Written { rv: Some(13) }, now, MIN);
        // A state older than the write, not from a restore: passed over.
        p.seen(holds("u2", None), Some(12), None, false);
        assert_eq!(
            p.next(now, true),
            Action::Idle,
            "older than the write: passed over"
        );
        // A list that raced the write, from before it: passed over too.
        p.seen(holds("u2", None), Some(12), Some(12), false);
        assert_eq!(
            p.next(now, true),
            Action::Idle,
            "a list from before the write"
        );
        // A list past the write that finds the Node older than it: the store lost the
        // write (restored from a backup whose revisions caught up before the list).
        p.seen(holds("u2", None), Some(12), Some(13), false);
        assert_eq!(write(&p, now).1, Cause::Restored);
        // A store restored from before the report: its revisions are behind the write's,
        // and what it says stands; the cause is the restore.
        p.seen(holds("u2", None), Some(4), None, true);
        assert_eq!(write(&p, now).1, Cause::Restored);
        p.outcome(Outcome::Written { rv: Some(5) }, now, MIN);
        p.seen(holds("u2", None), Some(4), None, false);
        assert_eq!(
            p.next(now, true),
            Action::Idle,
            "the write's revision is the new store's"
        );
        // A restore whose Node already holds the report: nothing to write, and the next
        // repair is not taken for a restore.
        p.seen(holds("u2", Some(ours.clone())), Some(20), None, true);
        assert_eq!(p.next(now, true), Action::Idle);
        p.seen(holds("u2", None), Some(21), None, false);
        assert_eq!(write(&p, now).1, Cause::Removed);
        // A list past the write that finds the write's own state changed: no restore.
        p.outcome(Outcome::Written { rv: Some(22) }, now, MIN);
        p.seen(holds("u2", None), Some(22), Some(30), false);
        assert_eq!(write(&p, now).1, Cause::Removed);
    }

    #[test]
    fn each_cause_has_its_label_and_only_an_undoing_is_a_repair() {
        let all = [
            (Cause::Start, "start", false),
            (Cause::Change, "change", false),
            (Cause::Removed, "removed", true),
            (Cause::Edited, "edited", true),
            (Cause::Registered, "registered", true),
            (Cause::Restored, "restored", true),
        ];
        for (cause, label, repair) in all {
            assert_eq!(cause.label(), label);
            assert_eq!(cause.is_repair(), repair, "{label}");
            assert!(!repaired(cause).is_empty());
        }
        assert_ne!(repaired(Cause::Removed), repaired(Cause::Edited));
        assert_ne!(repaired(Cause::Registered), repaired(Cause::Restored));
    }

    #[test]
    fn a_node_that_already_holds_the_report_is_not_written_and_keeps_its_time() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        let s = status(Some(true));
        p.observe(held(&s, "later"), true);
        p.seen(
            holds("u1", Some(held(&s, "earlier").to_json())),
            None,
            None,
            false,
        );
        assert_eq!(p.next(now, true), Action::Idle);
        assert_eq!(p.standing(Ok(())), Standing::Held);
        // A later change is stamped anew; the unchanged one kept the Node's time.
        let mut changed = s.clone();
        changed.in_sync = Some(false);
        p.observe(held(&changed, "new"), true);
        let (written, cause) = write(&p, now);
        assert_eq!((written.changed.as_str(), cause), ("new", Cause::Change));
        // Something else on the Node (an older report, an invalid one) is written over.
        let mut p = Policy::new(now);
        p.observe(held(&s, "t"), true);
        p.seen(holds("u1", Some("{not json".into())), None, None, false);
        assert_eq!(write(&p, now).1, Cause::Start);
    }

    #[test]
    fn a_report_not_all_known_waits_for_the_sources_but_not_forever() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        p.observe(held(&status(None), "t"), false);
        p.seen(holds("u1", None), None, None, false);
        assert_eq!(
            p.next(now, true),
            Action::Wait {
                until: now + SETTLE
            }
        );
        assert!(
            matches!(p.standing(Ok(())), Standing::Pending(why) if why.contains("every source"))
        );
        assert!(matches!(p.next(now + SETTLE, true), Action::Write(..)));
        // Every source read: at once.
        p.observe(held(&status(Some(true)), "t"), true);
        assert!(matches!(p.next(now, true), Action::Write(..)));
    }

    #[test]
    fn failures_back_off_by_kind_and_new_credentials_retry_at_once() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        p.observe(held(&status(Some(true)), "t"), true);
        p.seen(holds("u1", None), None, None, false);
        let refused = Outcome::Failed {
            failure: Failure::ANSWERED,
            reason: "forbidden",
            message: "HTTP 403 Forbidden".into(),
        };
        p.outcome(refused.clone(), now, MIN);
        let Action::Wait { until } = p.next(now, true) else {
            panic!("a wait")
        };
        assert_eq!(until - now, lifecycle::ANSWERED_FIRST / 2);
        let Standing::Failed(problem) = p.standing(Ok(())) else {
            panic!("failed")
        };
        assert!(
            problem.starts_with("HTTP 403 Forbidden; trying again in 0.4s"),
            "{problem}"
        );
        // Again: the delay doubles.
        p.outcome(refused, now, MIN);
        let Action::Wait { until } = p.next(now, true) else {
            panic!("a wait")
        };
        assert_eq!(until - now, lifecycle::ANSWERED_FIRST);
        // Shed with Retry-After: never sooner.
        let shed = Outcome::Failed {
            failure: Failure::Answered {
                retry_after: Some(Duration::from_secs(7)),
            },
            reason: "too_many_requests",
            message: "429".into(),
        };
        p.outcome(shed, now, MIN);
        let Action::Wait { until } = p.next(now, true) else {
            panic!("a wait")
        };
        assert!(until - now >= Duration::from_secs(7));
        assert!(matches!(p.next(until, true), Action::Write(..)));
        p.new_credentials();
        assert!(matches!(p.next(now, true), Action::Write(..)));
        // Unreachable: at most 5 s.
        for _ in 0..10 {
            p.outcome(
                Outcome::Failed {
                    failure: Failure::Unreachable,
                    reason: "unreachable",
                    message: "refused".into(),
                },
                now,
                MIN,
            );
        }
        let Action::Wait { until } = p.next(now, true) else {
            panic!("a wait")
        };
        assert!(until - now <= lifecycle::UNREACHABLE_MAX);
        // Success resets it all.
        p.outcome(Outcome::Written { rv: None }, now, MIN);
        assert_eq!(p.standing(Ok(())), Standing::Held);
        p.observe(held(&status(Some(false)), "t2"), true);
        p.outcome(
            Outcome::Failed {
                failure: Failure::ANSWERED,
                reason: "server_error",
                message: "500".into(),
            },
            now,
            MIN,
        );
        let Action::Wait { until } = p.next(now, true) else {
            panic!("a wait")
        };
        assert_eq!(until - now, lifecycle::ANSWERED_FIRST / 2, "reset");
        // A Node that went between the watch and the write: backed off, and pending.
        p.outcome(Outcome::NoNode, now, MIN);
        assert!(matches!(p.next(now, true), Action::Wait { .. }));
    }

    #[test]
    fn pending_is_not_failed_and_a_watch_that_fails_is() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        assert_eq!(
            p.standing(Ok(())),
            Standing::Pending("waiting for the first pass".into())
        );
        p.observe(held(&status(Some(true)), "t"), true);
        assert_eq!(
            p.standing(Ok(())),
            Standing::Pending("waiting for the Node's watch".into())
        );
        p.seen(OnNode::Missing, None, None, false);
        assert!(
            matches!(p.standing(Ok(())), Standing::Pending(why) if why.contains("a new node registers it"))
        );
        assert_eq!(
            p.standing(Err("no name".into())),
            Standing::Failed("no name".into())
        );
        p.watch_problem(Some("HTTP 403".into()));
        assert_eq!(
            p.standing(Ok(())),
            Standing::Failed("cannot follow its Node: HTTP 403".into())
        );
        p.watch_problem(None);
        p.seen(holds("u", None), None, None, false);
        assert_eq!(
            p.standing(Ok(())),
            Standing::Pending("not written yet".into())
        );
    }

    #[test]
    fn the_node_has_one_name_the_flags_else_the_credentials_else_the_hosts() {
        assert_eq!(
            identity(None, Some("node-1"), Some("vm")),
            (Some("node-1".into()), None)
        );
        assert_eq!(identity(None, None, Some("vm")), (Some("vm".into()), None));
        assert_eq!(
            identity(Some(""), None, Some("vm")),
            (Some("vm".into()), None)
        );
        assert_eq!(identity(None, None, None), (None, None));
        assert_eq!(
            identity(Some("node-1"), Some("node-1"), Some("vm")),
            (Some("node-1".into()), None)
        );
        let (name, warning) = identity(Some("other"), Some("node-1"), Some("vm"));
        assert_eq!(name.as_deref(), Some("other"));
        let warning = warning.unwrap();
        assert!(
            warning.contains("--node-name other is not the node the credentials name (node-1)"),
            "{warning}"
        );
        assert_eq!(
            identity(Some("other"), None, Some("vm")),
            (Some("other".into()), None)
        );
    }

    #[test]
    fn the_node_is_named_by_the_flag_else_by_the_node_credentials() {
        let mut current = Current::default();
        assert_eq!(node_name(Some("n1"), &current), Ok("n1".into()));
        assert_eq!(
            node_name(None, &current),
            Err("the credentials have not been read yet".into())
        );
        current.read = true;
        assert!(
            node_name(Some(""), &current)
                .unwrap_err()
                .contains("no client certificate naming a node")
        );
        let now = test_certs::now();
        let cert = |cn: &str| crate::credentials::HeldCertificate {
            filepath: "/var/lib/kubelet/kubeconfig".into(),
            key: "user".into(),
            kind: "user",
            certificate: test_certs::ca(Some(cn), None, now - 60, now + 3600),
        };
        current.held = vec![cert("system:node:worker-1")].into();
        assert_eq!(node_name(None, &current), Ok("worker-1".into()));
        assert_eq!(node_name(Some("other"), &current), Ok("other".into()));
        current.held = vec![cert("admin")].into();
        let why = node_name(None, &current).unwrap_err();
        assert!(why.contains("the credentials are admin"), "{why}");
        current.held = vec![cert("system:node:")].into();
        assert!(node_name(None, &current).is_err());
        // A service account token bound to a Pod names its node; a client certificate,
        // when there is one, speaks first; the flag before both.
        current.token_node = Some("worker-2".into());
        assert!(node_name(None, &current).is_err());
        current.held = Vec::new().into();
        assert_eq!(node_name(None, &current), Ok("worker-2".into()));
        assert_eq!(node_name(Some("other"), &current), Ok("other".into()));
    }

    #[test]
    fn a_failed_request_is_labelled_by_what_answered_and_a_refusal_names_the_node() {
        let api = |code: u16| {
            kube::Error::Api(
                kube::core::Status::failure("said the server", "Reason")
                    .with_code(code)
                    .boxed(),
            )
        };
        let label = |error: &kube::Error| match failed(error, "https://h:6443", "worker-1") {
            Outcome::Failed {
                failure, reason, ..
            } => (reason, failure),
            other => panic!("{other:?}"),
        };
        assert!(matches!(
            failed(&api(404), "https://h:6443", "worker-1"),
            Outcome::NoNode
        ));
        assert_eq!(label(&api(401)).0, "unauthorized");
        assert_eq!(label(&api(403)).0, "forbidden");
        assert_eq!(label(&api(429)).0, "too_many_requests");
        assert_eq!(label(&api(500)).0, "server_error");
        assert_eq!(label(&api(503)).0, "server_error");
        assert_eq!(label(&api(409)).0, "api_error");
        let refused = kube::Error::Service(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "os",
        )));
        assert_eq!(label(&refused), ("unreachable", Failure::Unreachable));
        // Only a refusal asks whether the name and the credentials are this node's.
        let Outcome::Failed { message, .. } = failed(&api(403), "https://h:6443", "worker-1")
        else {
            panic!("a failure")
        };
        assert!(
            message.contains(
                "a node may read and write only its own Node: is worker-1 this node's name"
            ),
            "{message}"
        );
        let Outcome::Failed { message, .. } = failed(&api(500), "https://h:6443", "worker-1")
        else {
            panic!("a failure")
        };
        assert!(!message.contains("its own Node"), "{message}");
    }

    #[test]
    fn settled_means_every_file_in_sync_is_known() {
        let mut s = status(Some(true));
        assert!(settled(&s));
        s.others.push(status(None));
        assert!(!settled(&s));
        s.others[0].nothing_to_keep = true;
        assert!(settled(&s));
        assert!(!settled(&status(None)));
        let now = rfc3339_now();
        assert!(now.ends_with('Z') && now.len() == 20, "{now}");
    }
}
