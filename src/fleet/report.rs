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
use crate::credentials::{Credentials, Current};
use crate::metrics::{Metrics, ReasonLabels};
use crate::source::lifecycle::{self, Backoff, Failure};
use crate::status::{Check, Status, StatusRx};

/// How long a report whose targets are not all known yet (the first pass, before every
/// source was read) waits for them before it is written anyway.
pub const SETTLE: Duration = Duration::from_secs(10);
/// A request to the API server that takes longer has failed.
const DEADLINE: Duration = Duration::from_secs(10);
/// The field manager of the patch.
const MANAGER: &str = "kubelet-ca-agent";

/// What the policy asks for next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Read the Node's annotation as it stands (once, before the first write: an agent
    /// restarted on a node whose report has not changed writes nothing).
    Read,
    /// Write this value.
    Write(String),
    /// Nothing to do before `until` (or a new status, or new credentials).
    Wait { until: Instant },
    /// Nothing to do until a new status or new credentials.
    Idle,
}

/// How a request ended, as the policy tells them apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The Node's annotation, as read (`None`: it has none).
    Read(Option<String>),
    /// The write was accepted.
    Written,
    /// There is no such Node (yet).
    NoNode,
    /// The request failed: its kind for the backoff, its reason label, and what to say.
    Failed {
        failure: Failure,
        reason: &'static str,
        message: String,
    },
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
    /// What the Node holds, as last written or read; `None` before it was read once.
    on_node: Option<Option<Held>>,
    backoff: Backoff,
    retry_at: Option<Instant>,
    /// Why the Node does not hold the current report, when it does not.
    problem: Option<String>,
}

impl Policy {
    pub fn new(now: Instant) -> Policy {
        Policy {
            started: now,
            built: None,
            settled: false,
            on_node: None,
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
        match &self.on_node {
            None => Action::Read,
            Some(Some(held)) if held.same_as(built) => Action::Idle,
            Some(_) => Action::Write(built.to_json()),
        }
    }

    /// How the request of [`Policy::next`] ended, at `now`.
    pub fn outcome(&mut self, outcome: Outcome, now: Instant, jitter: f64) {
        match outcome {
            Outcome::Read(value) => {
                let held = value.as_deref().and_then(|v| Held::parse(v).ok());
                // What the Node already says stands, with its time, when it is this.
                if let (Some(on_node), Some(built)) = (&held, &mut self.built)
                    && on_node.same_as(built)
                {
                    *built = on_node.clone();
                }
                self.on_node = Some(held);
                self.succeeded();
            }
            Outcome::Written => {
                self.on_node = Some(self.built.clone());
                self.succeeded();
            }
            Outcome::NoNode => {
                let delay = self.backoff.after(Failure::ANSWERED, jitter);
                self.retry_at = Some(now + delay);
                self.problem = Some(format!(
                    "waiting for the Node to exist (a new node registers it); asking again in {}",
                    seconds(delay)
                ));
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

    fn succeeded(&mut self) {
        self.backoff.reset();
        self.retry_at = None;
        self.problem = None;
    }

    /// Why the Node does not hold the current report, `None` when it does.
    pub fn problem(&self, can_ask: Result<(), String>) -> Option<String> {
        if let Err(why) = can_ask {
            return Some(why);
        }
        let built = self.built.as_ref()?;
        match &self.on_node {
            Some(Some(held)) if held.same_as(built) => None,
            _ => Some(
                self.problem
                    .clone()
                    .unwrap_or_else(|| "not written yet".to_string()),
            ),
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
        // The Node's uid, once read: the Events' reference.
        let mut uid: Option<String> = None;
        // The last failure said in the log.
        let mut warned: Option<String> = None;
        loop {
            let status = self.status.borrow_and_update().clone();
            let current = credentials.mark_seen();
            let name = node_name(self.node_name.as_deref(), &current);
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
                        tracing::info!(node = %name, "reporting what this node holds on its Node ({ANNOTATION})")
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
            let now = Instant::now();
            let action = policy.next(now, can_ask.is_ok());
            let (Ok(name), Some(client)) = (&name, client) else {
                self.show(&policy, can_ask);
                if !self.wait(&mut credentials, None).await {
                    return;
                }
                continue;
            };
            let server = current.server.clone().unwrap_or_default();
            let api: Api<Node> = Api::all(client);
            let outcome = match action {
                Action::Read => {
                    let (outcome, read_uid) = read(&api, name, &server).await;
                    uid = read_uid.or(uid);
                    Some(outcome)
                }
                Action::Write(value) => Some(write(&api, name, &server, &value).await),
                Action::Wait { until } => {
                    self.show(&policy, can_ask);
                    if !self.wait(&mut credentials, Some(until)).await {
                        return;
                    }
                    None
                }
                Action::Idle => {
                    self.show(&policy, can_ask);
                    if !self.wait(&mut credentials, None).await {
                        return;
                    }
                    None
                }
            };
            if let Some(outcome) = outcome {
                self.count(&outcome, name, &mut warned);
                policy.outcome(outcome, Instant::now(), lifecycle::jitter());
                self.show(&policy, Ok(()));
            }
        }
    }

    /// Waits for a new status, new credentials, or `until`; false when the loop ended.
    async fn wait(&mut self, credentials: &mut Credentials, until: Option<Instant>) -> bool {
        let sleep = async {
            match until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = self.status.changed() => changed.is_ok(),
            () = credentials.changed() => true,
            () = sleep => true,
        }
    }

    /// Counts an outcome, and says it in the log: a failure once until it changes or the
    /// report gets through.
    fn count(&self, outcome: &Outcome, name: &str, warned: &mut Option<String>) {
        match outcome {
            Outcome::Written => {
                self.metrics.node_report_writes.inc();
                *warned = None;
                tracing::debug!(node = %name, "wrote what this node holds on its Node");
            }
            Outcome::Read(_) => *warned = None,
            Outcome::NoNode => {
                self.error("node_missing");
                tracing::debug!(node = %name, "the Node does not exist yet: waiting for it");
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

    /// Publishes the `node-report` check, when it says something new.
    fn show(&self, policy: &Policy, can_ask: Result<(), String>) {
        let check = Check::shown("node-report".to_string(), policy.problem(can_ask));
        self.check.send_if_modified(|shown| {
            let new = Some(&check) != shown.as_ref();
            if new {
                *shown = Some(check);
            }
            new
        });
    }
}

/// Reads the Node's annotation, and its uid.
async fn read(api: &Api<Node>, name: &str, server: &str) -> (Outcome, Option<String>) {
    match tokio::time::timeout(DEADLINE, api.get_metadata_opt(name)).await {
        Ok(Ok(Some(node))) => (
            Outcome::Read(
                node.metadata
                    .annotations
                    .and_then(|mut a| a.remove(ANNOTATION)),
            ),
            node.metadata.uid,
        ),
        Ok(Ok(None)) => (Outcome::NoNode, None),
        Ok(Err(e)) => (failed(&e, server, name), None),
        Err(_) => (hung(server), None),
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
        Ok(Ok(_)) => Outcome::Written,
        Ok(Err(kube::Error::Api(status))) if status.code == 404 => Outcome::NoNode,
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
            "{message} (a node may write only its own Node: is {} this node's name, and the credentials this node's?)",
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

    #[test]
    fn it_reads_the_node_once_then_writes_only_when_the_report_changes() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        assert_eq!(p.next(now, true), Action::Idle, "nothing built yet");
        let s = status(Some(true));
        p.observe(held(&s, "t1"), true);
        assert_eq!(p.next(now, false), Action::Idle, "no credentials or name");
        assert_eq!(p.next(now, true), Action::Read);
        p.outcome(Outcome::Read(None), now, MIN);
        // The same status again before the write: the report keeps the time it changed.
        p.observe(held(&s, "t1, again"), true);
        let Action::Write(json) = p.next(now, true) else {
            panic!("a write")
        };
        assert_eq!(Held::parse(&json).unwrap(), held(&s, "t1"));
        p.outcome(Outcome::Written, now, MIN);
        assert_eq!(p.next(now, true), Action::Idle);
        assert_eq!(p.problem(Ok(())), None);
        // The same report at another time: nothing to write, and its time stays.
        p.observe(held(&s, "t2"), true);
        assert_eq!(p.next(now, true), Action::Idle);
        // A change: one write, with the new time.
        let mut changed = s.clone();
        changed.in_sync = Some(false);
        p.observe(held(&changed, "t3"), true);
        assert_eq!(p.problem(Ok(())).as_deref(), Some("not written yet"));
        let Action::Write(json) = p.next(now, true) else {
            panic!("a write")
        };
        assert_eq!(Held::parse(&json).unwrap().changed, "t3");
    }

    #[test]
    fn a_node_that_already_holds_the_report_is_not_written_and_keeps_its_time() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        let s = status(Some(true));
        p.observe(held(&s, "later"), true);
        let there = held(&s, "earlier").to_json();
        p.outcome(Outcome::Read(Some(there)), now, MIN);
        assert_eq!(p.next(now, true), Action::Idle);
        // A later change is stamped anew; the unchanged one kept the Node's time.
        let mut changed = s.clone();
        changed.in_sync = Some(false);
        p.observe(held(&changed, "new"), true);
        let Action::Write(json) = p.next(now, true) else {
            panic!("a write")
        };
        assert_eq!(Held::parse(&json).unwrap().changed, "new");
        // Something else on the Node (an older report, an invalid one) is written over.
        let mut p = Policy::new(now);
        p.observe(held(&s, "t"), true);
        p.outcome(Outcome::Read(Some("{not json".into())), now, MIN);
        assert!(matches!(p.next(now, true), Action::Write(_)));
    }

    #[test]
    fn a_report_not_all_known_waits_for_the_sources_but_not_forever() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        p.observe(held(&status(None), "t"), false);
        assert_eq!(
            p.next(now, true),
            Action::Wait {
                until: now + SETTLE
            }
        );
        assert_eq!(p.next(now + SETTLE, true), Action::Read);
        // Every source read: at once.
        p.observe(held(&status(Some(true)), "t"), true);
        assert_eq!(p.next(now, true), Action::Read);
    }

    #[test]
    fn failures_back_off_by_kind_and_new_credentials_retry_at_once() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        p.observe(held(&status(Some(true)), "t"), true);
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
        let problem = p.problem(Ok(())).unwrap();
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
        assert_eq!(p.next(until, true), Action::Read);
        p.new_credentials();
        assert_eq!(p.next(now, true), Action::Read);
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
        p.outcome(Outcome::Read(None), now, MIN);
        assert!(matches!(p.next(now, true), Action::Write(_)));
        p.outcome(Outcome::Written, now, MIN);
        assert_eq!(p.problem(Ok(())), None);
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
    }

    #[test]
    fn a_missing_node_is_waited_for_quietly() {
        let now = Instant::now();
        let mut p = Policy::new(now);
        p.observe(held(&status(Some(true)), "t"), true);
        p.outcome(Outcome::NoNode, now, MIN);
        let problem = p.problem(Ok(())).unwrap();
        assert!(
            problem.starts_with("waiting for the Node to exist"),
            "{problem}"
        );
        assert!(matches!(p.next(now, true), Action::Wait { .. }));
        assert_eq!(p.problem(Err("no name".into())).as_deref(), Some("no name"));
        // Nothing built: nothing to say.
        assert_eq!(Policy::new(now).problem(Ok(())), None);
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
            message.contains("a node may write only its own Node: is worker-1 this node's name"),
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
