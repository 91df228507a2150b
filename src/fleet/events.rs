//! Kubernetes Events on the agent's own Node (SPEC 8c), for what an operator runs
//! `kubectl describe node` to see: a target changed (Normal); a source rejected, a removal
//! held, a restart hook failed (Warning). [`between`] tells them from two statuses, pure;
//! [`Throttle`] keeps them to a few a minute and says each once; [`run`] records them on a
//! task of its own, so that an API server that is slow to take them holds back nothing else.
//! They are core/v1 Events in `default`, as the kubelet records its own: a node's
//! credentials may create those, not events.k8s.io ones (so kube-rs's recorder, which
//! writes the latter, cannot be used with them).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Api;
use kube::api::PostParams;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::credentials::Credentials;
use crate::status::{Restart, Status};

/// At most this many Events at once...
const BURST: f64 = 5.0;
/// ...and one more each this often: a few a minute at most.
const REFILL: Duration = Duration::from_secs(15);
/// The same Event again within this is not recorded again.
const DEDUP: Duration = Duration::from_secs(600);
/// A note is cut to this many characters (the API's bound is 1 kB).
const MAX_NOTE: usize = 900;
/// A request that takes longer has failed.
const DEADLINE: Duration = Duration::from_secs(10);

/// One Event to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub warning: bool,
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

/// What happened between two statuses of the loop, as Events. Nothing before the first
/// status: what the agent found at start is not a change.
pub fn between(before: &Status, now: &Status) -> Vec<Notice> {
    let mut notices = Vec::new();
    if before.bundle_path.is_empty() {
        return notices;
    }
    let earlier: HashMap<&str, &Status> = before
        .files()
        .map(|f| (f.bundle_path.as_str(), f))
        .collect();
    for file in now.files() {
        let Some(was) = earlier.get(file.bundle_path.as_str()) else {
            continue;
        };
        let held = |s: &Status| {
            s.certificates
                .iter()
                .map(|c| c.fingerprint())
                .collect::<Vec<_>>()
        };
        if held(was) != held(file) && !file.certificates.is_empty() {
            notices.push(Notice {
                warning: false,
                reason: "CAFileChanged",
                action: "Replace",
                note: changed(was, file),
            });
        }
        if file.removal_held == Some(true)
            && (was.removal_held != Some(true) || was.held_back != file.held_back)
        {
            notices.push(Notice {
                warning: true,
                reason: "CARemovalHeld",
                action: "Verify",
                note: cut(&format!(
                    "{}: {} CA(s) that its sources dropped are kept: {}",
                    file.bundle_path,
                    file.held_back.len(),
                    file.sync_problem
                        .as_deref()
                        .unwrap_or("the server still needs them")
                )),
            });
        }
        if file.restart == Some(Restart::Failed) && was.restart != Some(Restart::Failed) {
            notices.push(Notice {
                warning: true,
                reason: "KubeletRestartFailed",
                action: "Restart",
                note: cut(&format!(
                    "{} gained a CA, and the hook that restarts the kubelet failed (the kubelet reads it only when it starts); it is run again with backoff",
                    file.bundle_path
                )),
            });
        }
    }
    let rejected: HashMap<&str, Option<&str>> = before
        .all_sources()
        .into_iter()
        .filter(|s| s.rejected)
        .map(|s| (s.spec.as_str(), s.problem.as_deref()))
        .collect();
    for source in now.all_sources() {
        if source.rejected && rejected.get(source.spec.as_str()) != Some(&source.problem.as_deref())
        {
            notices.push(Notice {
                warning: true,
                reason: "SourceRejected",
                action: "Validate",
                note: cut(&format!(
                    "{}; the last good content is kept",
                    source.problem.as_deref().unwrap_or(&source.spec)
                )),
            });
        }
    }
    notices
}

/// The note of a changed file: what it holds now, what came and what went.
fn changed(was: &Status, now: &Status) -> String {
    let before: BTreeSet<_> = was.certificates.iter().map(|c| c.fingerprint()).collect();
    let after: BTreeSet<_> = now.certificates.iter().map(|c| c.fingerprint()).collect();
    let name = |c: &crate::bundle::Certificate| {
        format!("{} (sha256:{})", c.subject_cn, c.fingerprint().short())
    };
    let added: Vec<String> = now
        .certificates
        .iter()
        .filter(|c| !before.contains(&c.fingerprint()))
        .map(name)
        .collect();
    let removed: Vec<String> = was
        .certificates
        .iter()
        .filter(|c| !after.contains(&c.fingerprint()))
        .map(name)
        .collect();
    let mut note = format!(
        "{} now holds {} certificate(s)",
        now.bundle_path,
        now.certificates.len()
    );
    if !added.is_empty() {
        note.push_str(&format!("; added {}", added.join(", ")));
    }
    if !removed.is_empty() {
        note.push_str(&format!("; removed {}", removed.join(", ")));
    }
    if added.is_empty() && removed.is_empty() {
        note.push_str("; reordered");
    }
    cut(&note)
}

/// One line, escaped, at most [`MAX_NOTE`] characters.
fn cut(text: &str) -> String {
    let line = crate::text::escape(text.lines().next().unwrap_or_default()).into_owned();
    match line.char_indices().nth(MAX_NOTE) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line,
    }
}

/// Keeps the Events to a few a minute (a bucket of [`BURST`], one more each [`REFILL`]),
/// and each distinct one to once in [`DEDUP`]. Pure: the caller passes `now`.
#[derive(Debug)]
pub struct Throttle {
    tokens: f64,
    at: Instant,
    said: HashMap<(&'static str, String), Instant>,
}

impl Throttle {
    pub fn new(now: Instant) -> Throttle {
        Throttle {
            tokens: BURST,
            at: now,
            said: HashMap::new(),
        }
    }

    /// Whether `notice` is recorded at `now` (false: said lately, or too many lately).
    pub fn admit(&mut self, notice: &Notice, now: Instant) -> bool {
        self.said.retain(|_, at| now.duration_since(*at) < DEDUP);
        let key = (notice.reason, notice.note.clone());
        if self.said.contains_key(&key) {
            return false;
        }
        let refilled = now.duration_since(self.at).as_secs_f64() / REFILL.as_secs_f64();
        self.tokens = (self.tokens + refilled).min(BURST);
        self.at = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        self.said.insert(key, now);
        true
    }
}

/// The Node the Events are about: its name, and its uid when known (the kubelet uses the
/// name as the uid of its own Events; `kubectl describe node` finds both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regarding {
    pub name: String,
    pub uid: Option<String>,
}

/// The component that records the Events.
const COMPONENT: &str = "kubelet-ca-agent";

/// The Event that records `notice` about `regarding`, at `now`.
pub fn event(notice: &Notice, regarding: &Regarding, now: k8s_openapi::jiff::Timestamp) -> Event {
    Event {
        metadata: ObjectMeta {
            name: Some(format!("{}.{:x}", regarding.name, now.as_nanosecond())),
            namespace: Some("default".into()),
            ..ObjectMeta::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(regarding.name.clone()),
            uid: Some(regarding.uid.clone().unwrap_or(regarding.name.clone())),
            ..ObjectReference::default()
        },
        reason: Some(notice.reason.into()),
        action: Some(notice.action.into()),
        message: Some(notice.note.clone()),
        type_: Some(if notice.warning { "Warning" } else { "Normal" }.into()),
        source: Some(EventSource {
            component: Some(COMPONENT.into()),
            host: Some(regarding.name.clone()),
        }),
        reporting_component: Some(COMPONENT.into()),
        reporting_instance: Some(regarding.name.clone()),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        count: Some(1),
        ..Event::default()
    }
}

/// Records the notices it is sent about the Node it is told, until the sender goes;
/// `dropped` is told why one was not.
pub async fn run(
    mut notices: mpsc::Receiver<(Notice, Regarding)>,
    mut credentials: Credentials,
    dropped: impl Fn(&str),
) {
    let mut throttle = Throttle::new(Instant::now());
    while let Some((notice, regarding)) = notices.recv().await {
        if !throttle.admit(&notice, Instant::now()) {
            dropped("throttled");
            tracing::debug!(
                reason = notice.reason,
                "event not recorded: said lately, or too many lately"
            );
            continue;
        }
        let Some(client) = credentials.mark_seen().client.clone() else {
            dropped("no_credentials");
            continue;
        };
        let events: Api<Event> = Api::namespaced(client, "default");
        let event = event(&notice, &regarding, k8s_openapi::jiff::Timestamp::now());
        match tokio::time::timeout(DEADLINE, events.create(&PostParams::default(), &event)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                dropped("refused");
                tracing::warn!(
                    reason = notice.reason,
                    "cannot record an event on the Node: {}",
                    crate::text::escape(&e.to_string())
                );
            }
            Err(_) => {
                dropped("timeout");
                tracing::warn!(
                    reason = notice.reason,
                    "cannot record an event on the Node: no answer within {}s",
                    DEADLINE.as_secs()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;
    use crate::status::SourceStatus;

    fn file(path: &str, cns: Vec<crate::bundle::Certificate>) -> Status {
        Status {
            bundle_path: path.into(),
            certificates: cns,
            file_valid: true,
            in_sync: Some(true),
            ..Status::default()
        }
    }

    fn ca(cn: &str) -> crate::bundle::Certificate {
        let now = test_certs::now();
        test_certs::ca(Some(cn), None, now - 60, now + 3600)
    }

    #[test]
    fn a_changed_file_is_a_normal_event_naming_what_came_and_went() {
        let (a, b) = (ca("signer-a"), ca("signer-b"));
        let before = file("/etc/kubernetes/kubelet-ca.crt", vec![a.clone()]);
        let now = file("/etc/kubernetes/kubelet-ca.crt", vec![b.clone()]);
        let notices = between(&before, &now);
        assert_eq!(notices.len(), 1);
        let n = &notices[0];
        assert_eq!((n.warning, n.reason), (false, "CAFileChanged"));
        assert_eq!(
            n.note,
            format!(
                "/etc/kubernetes/kubelet-ca.crt now holds 1 certificate(s); added signer-b (sha256:{}); removed signer-a (sha256:{})",
                b.fingerprint().short(),
                a.fingerprint().short()
            )
        );
        // Only added; a reorder.
        let both = file("/etc/kubernetes/kubelet-ca.crt", vec![a.clone(), b.clone()]);
        assert_eq!(
            between(&before, &both)[0].note,
            format!(
                "/etc/kubernetes/kubelet-ca.crt now holds 2 certificate(s); added signer-b (sha256:{})",
                b.fingerprint().short()
            ),
            "an addition alone is no reorder"
        );
        let swapped = file("/etc/kubernetes/kubelet-ca.crt", vec![b.clone(), a.clone()]);
        assert!(between(&both, &swapped)[0].note.ends_with("; reordered"));
        // Nothing changed, nothing at start, nothing for a file that is gone or new.
        assert!(between(&before, &before).is_empty());
        assert!(between(&Status::default(), &now).is_empty());
        let mut with_other = now.clone();
        with_other
            .others
            .push(file("/etc/other.crt", vec![a.clone()]));
        assert!(between(&now, &with_other).is_empty());
        // A file now empty (its sources hold nothing) is no change to tell.
        let empty = file("/etc/kubernetes/kubelet-ca.crt", vec![]);
        assert!(between(&before, &empty).is_empty());
        // Another managed file's change is told too.
        let mut later = with_other.clone();
        later.others[0].certificates = vec![b.clone()];
        let notices = between(&with_other, &later);
        assert_eq!(notices.len(), 1);
        assert!(notices[0].note.starts_with("/etc/other.crt now holds"));
    }

    #[test]
    fn a_rejected_source_a_held_removal_and_a_failed_restart_are_warnings_told_once() {
        let a = ca("signer-a");
        let source = |rejected: bool, problem: Option<&str>| SourceStatus {
            spec: "configmap:ns/name".into(),
            up: !rejected,
            rejected,
            problem: problem.map(str::to_string),
            last_change: None,
        };
        let mut before = file("/etc/kubernetes/kubelet-ca.crt", vec![a.clone()]);
        before.sources = vec![source(false, None)];
        let mut now = before.clone();
        now.sources = vec![source(
            true,
            Some("source configmap:ns/name: a private key in block 2"),
        )];
        let notices = between(&before, &now);
        assert_eq!(notices.len(), 1);
        assert_eq!(
            (notices[0].warning, notices[0].reason),
            (true, "SourceRejected")
        );
        assert_eq!(
            notices[0].note,
            "source configmap:ns/name: a private key in block 2; the last good content is kept"
        );
        assert!(between(&now, &now).is_empty(), "the same rejection again");
        let mut other = now.clone();
        other.sources = vec![source(true, Some("another problem"))];
        assert_eq!(between(&now, &other).len(), 1);
        // A source that cannot be reached is not a rejection.
        let mut down = before.clone();
        down.sources = vec![source(false, Some("connection refused"))];
        down.sources[0].up = false;
        assert!(between(&before, &down).is_empty());

        let kubeconfig = |held: bool, held_back: &[&str], restart: Option<Restart>| Status {
            removal_held: Some(held),
            held_back: held_back.iter().map(|s| s.to_string()).collect(),
            restart,
            sync_problem: held
                .then(|| "removal held: the new CA data does not verify https://x:6443".into()),
            ..file("/var/lib/kubelet/kubeconfig", vec![a.clone()])
        };
        let with = |k: Status| {
            let mut s = before.clone();
            s.others = vec![k];
            s
        };
        let calm = with(kubeconfig(false, &[], None));
        let held = with(kubeconfig(true, &["aa"], None));
        let notices = between(&calm, &held);
        assert_eq!(notices.len(), 1);
        assert_eq!(
            (notices[0].warning, notices[0].reason),
            (true, "CARemovalHeld")
        );
        assert_eq!(
            notices[0].note,
            "/var/lib/kubelet/kubeconfig: 1 CA(s) that its sources dropped are kept: removal held: the new CA data does not verify https://x:6443"
        );
        assert!(between(&held, &held).is_empty());
        assert_eq!(
            between(&held, &with(kubeconfig(true, &["aa", "bb"], None))).len(),
            1
        );
        let failed = with(kubeconfig(false, &[], Some(Restart::Failed)));
        let notices = between(&calm, &failed);
        assert_eq!(notices.len(), 1);
        assert_eq!(notices[0].reason, "KubeletRestartFailed");
        assert!(between(&failed, &failed).is_empty());
        assert!(between(&calm, &with(kubeconfig(false, &[], Some(Restart::Done)))).is_empty());
    }

    #[test]
    fn events_are_a_few_a_minute_and_each_once_in_ten_minutes() {
        let now = Instant::now();
        let mut t = Throttle::new(now);
        let notice = |i: usize| Notice {
            warning: false,
            reason: "CAFileChanged",
            action: "Replace",
            note: format!("change {i}"),
        };
        for i in 0..5 {
            assert!(t.admit(&notice(i), now), "{i}");
        }
        assert!(!t.admit(&notice(5), now), "the burst is spent");
        assert!(!t.admit(&notice(5), now + REFILL / 2));
        assert!(
            t.admit(&notice(5), now + REFILL),
            "one more after the refill"
        );
        // The same one again is not said until ten minutes later.
        let later = now + Duration::from_secs(120);
        assert!(!t.admit(&notice(0), later));
        assert!(!t.admit(&notice(0), now + DEDUP - Duration::from_millis(1)));
        assert!(
            t.admit(&notice(0), now + DEDUP),
            "ten minutes on, it is said again"
        );
        // The bucket never holds more than the burst.
        let mut t = Throttle::new(now);
        let much_later = now + Duration::from_secs(3600);
        for i in 0..5 {
            assert!(t.admit(&notice(i), much_later));
        }
        assert!(!t.admit(&notice(9), much_later));
        // Notes are one line, escaped and cut.
        let long = format!("{}\nsecond", "x".repeat(2000));
        assert_eq!(cut(&long).chars().count(), MAX_NOTE + 1);
        assert_eq!(cut("a\u{1b}[31m"), crate::text::escape("a\u{1b}[31m"));
    }

    #[test]
    fn an_event_is_about_the_node_as_the_kubelets_own_are() {
        let now: k8s_openapi::jiff::Timestamp = "2026-11-27T12:00:00Z".parse().unwrap();
        let notice = Notice {
            warning: true,
            reason: "CARemovalHeld",
            action: "Verify",
            note: "/var/lib/kubelet/kubeconfig: 1 CA(s) that its sources dropped are kept".into(),
        };
        let regarding = Regarding {
            name: "worker-1".into(),
            uid: Some("0b6c5a3e-uid".into()),
        };
        let e = event(&notice, &regarding, now);
        assert_eq!(
            e.metadata.name,
            Some(format!("worker-1.{:x}", now.as_nanosecond()))
        );
        assert_eq!(e.metadata.namespace.as_deref(), Some("default"));
        let about = &e.involved_object;
        assert_eq!(
            (
                about.api_version.as_deref(),
                about.kind.as_deref(),
                about.name.as_deref(),
                about.uid.as_deref()
            ),
            (
                Some("v1"),
                Some("Node"),
                Some("worker-1"),
                Some("0b6c5a3e-uid")
            )
        );
        assert_eq!(e.reason.as_deref(), Some("CARemovalHeld"));
        assert_eq!(e.action.as_deref(), Some("Verify"));
        assert_eq!(e.message.as_deref(), Some(notice.note.as_str()));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        let source = e.source.as_ref().unwrap();
        assert_eq!(
            (source.component.as_deref(), source.host.as_deref()),
            (Some("kubelet-ca-agent"), Some("worker-1"))
        );
        assert_eq!(e.reporting_component.as_deref(), Some("kubelet-ca-agent"));
        assert_eq!(e.reporting_instance.as_deref(), Some("worker-1"));
        assert_eq!(e.first_timestamp, Some(Time(now)));
        assert_eq!(e.last_timestamp, Some(Time(now)));
        assert_eq!(e.count, Some(1));
        // A Normal one, about a Node whose uid is not known: the name stands for it, as
        // in the kubelet's own Events.
        let normal = Notice {
            warning: false,
            ..notice
        };
        let e = event(
            &normal,
            &Regarding {
                uid: None,
                ..regarding
            },
            now,
        );
        assert_eq!(e.type_.as_deref(), Some("Normal"));
        assert_eq!(e.involved_object.uid.as_deref(), Some("worker-1"));
    }
}
