//! What the cluster learns from the nodes (SPEC 8c), as one pure function: what the sources
//! make, the condition asked about, the target it is asked of, and each node's report in;
//! each node's verdict and the fleet's counts out. `rollout status`, `rollout wait` and
//! `publish`'s metrics are three views of the [`Verdict`], never three readings of the
//! reports.
//!
//! A report is untrusted (a node writes its own): it is read once, by [`Report::read`]
//! (size bound, strict schema), and a node whose report is not one is `invalid`, never
//! counted as holding anything.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::held::{Held, Invalid, Kind, MAX_BYTES, Restart, Sha, TargetHeld};

/// A certificate the sources (or a `file:` fingerprint) make known: its fingerprint with
/// the names an operator knows it by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Ca {
    pub sha256: Sha,
    /// The subject CN; `None` when no source names this fingerprint.
    #[serde(rename = "subjectCN", skip_serializing_if = "Option::is_none")]
    pub subject_cn: Option<String>,
    /// The serial number in decimal, as the metrics label it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
}

impl Ca {
    /// A certificate of the sources.
    pub fn of(certificate: &crate::bundle::Certificate) -> Ca {
        Ca {
            sha256: Sha::from(certificate.fingerprint()),
            subject_cn: Some(certificate.display_name()),
            serial_number: Some(certificate.serial.clone()),
        }
    }

    /// A fingerprint nothing names.
    pub fn unnamed(sha256: Sha) -> Ca {
        Ca {
            sha256,
            subject_cn: None,
            serial_number: None,
        }
    }

    /// `kube-csr-signer_@1700000002 (sha256:ab12cd34ef56...)`, or the fingerprint alone;
    /// the name escaped.
    pub fn label(&self) -> String {
        match &self.subject_cn {
            Some(cn) => format!(
                "{} (sha256:{}...)",
                crate::text::escape(cn),
                self.sha256.short()
            ),
            None => format!("sha256:{}...", self.sha256.short()),
        }
    }
}

/// What every counted node is asked to satisfy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// Hold exactly what the sources make (and, for a kubeconfig, the kubelet restarted
    /// after the last addition).
    Sources,
    /// Hold each of these (and, for a kubeconfig, the kubelet restarted after the last
    /// addition).
    Add(Vec<Sha>),
    /// Hold none of these.
    Remove(Vec<Sha>),
}

/// Which entry of a node's report is asked about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The node's bundle (`kind: bundle`), whatever its path.
    Bundle,
    /// The entry at this path (`--target PATH`).
    Path(String),
}

impl Target {
    /// The entry of `held` this target names: the first, should a report name it twice.
    fn find<'a>(&self, held: &'a Held) -> Option<&'a TargetHeld> {
        held.targets.iter().find(|t| match self {
            Target::Bundle => t.kind == Kind::Bundle,
            Target::Path(path) => t.path == *path,
        })
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Bundle => f.write_str("the bundle"),
            Target::Path(path) => f.write_str(&crate::text::escape(path)),
        }
    }
}

/// The question: what the sources make, the other certificates known by name, the
/// condition and the target.
#[derive(Debug, Clone)]
pub struct Question {
    /// What the sources make for the target, in bundle order (empty when they were not
    /// read, as `add=` and `remove=` need them only for names).
    pub sources: Vec<Ca>,
    /// Other certificates known by name (from `file:PATH` fingerprints).
    pub known: Vec<Ca>,
    pub condition: Condition,
    pub target: Target,
}

impl Question {
    /// The certificates the counts are about, in order: what the sources make (`sources`),
    /// or those named by the condition.
    pub fn counted(&self) -> Vec<Ca> {
        match &self.condition {
            Condition::Sources => self.sources.clone(),
            Condition::Add(shas) | Condition::Remove(shas) => {
                shas.iter().map(|sha| self.name(sha)).collect()
            }
        }
    }

    /// `sha` with the names the sources or the `file:` certificates give it.
    pub fn name(&self, sha: &Sha) -> Ca {
        self.sources
            .iter()
            .chain(&self.known)
            .find(|ca| ca.sha256 == *sha)
            .cloned()
            .unwrap_or_else(|| Ca::unnamed(sha.clone()))
    }
}

/// A node's Ready condition, as its status says (`Unknown` when it says nothing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Ready {
    True,
    False,
    #[default]
    Unknown,
}

/// A node's report as the follower keeps it: read once when its annotation changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The node has no annotation.
    Missing,
    /// The annotation is larger than [`MAX_BYTES`]: not kept, not read.
    Oversized(usize),
    /// The annotation, read: a report, or why it is not one.
    Read(Result<Held, Invalid>),
}

impl Report {
    /// Reads an annotation's value, if the node has one.
    pub fn read(raw: Option<&str>) -> Report {
        match raw {
            None => Report::Missing,
            Some(raw) if raw.len() > MAX_BYTES => Report::Oversized(raw.len()),
            Some(raw) => Report::Read(Held::parse(raw)),
        }
    }
}

/// One node, as the verdict takes it.
#[derive(Debug, Clone, Copy)]
pub struct Node<'a> {
    pub name: &'a str,
    /// `None` when it was not read (`rollout wait`, `publish`: a metadata watch).
    pub ready: Option<Ready>,
    /// It has a deletionTimestamp: left out of every count.
    pub deleting: bool,
    pub report: &'a Report,
}

/// A counted node's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// It satisfies the condition.
    Current,
    /// Its report says it does not.
    Behind,
    /// It has no report, or its report does not name the target.
    Unreported,
    /// Its report is not one: never counted as holding anything.
    Invalid,
}

impl State {
    pub const ALL: [State; 4] = [
        State::Current,
        State::Behind,
        State::Unreported,
        State::Invalid,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Current => "current",
            State::Behind => "behind",
            State::Unreported => "unreported",
            State::Invalid => "invalid",
        }
    }
}

/// Why a node is where it is, as far as its report (or its absence) knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Why {
    /// The target is not in sync with its sources on the node, for this reason (escaped).
    OutOfSync(String),
    /// A kubeconfig keeps these CAs until its server is seen to need them no more.
    RemovalHeld(Vec<Ca>),
    /// The kubelet has not been restarted after a CA was added to its kubeconfig.
    Restart(Restart),
    /// The node has no report.
    NoReport,
    /// The report is not one, for this reason (escaped).
    Invalid(String),
    /// The report does not name the target.
    NoTarget(Target),
    /// The node is NotReady (counted all the same).
    NotReady,
    /// The node's Ready condition is Unknown (counted all the same).
    ReadyUnknown,
}

impl Why {
    /// A word for machines: the JSON's `reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            Why::OutOfSync(_) => "outOfSync",
            Why::RemovalHeld(_) => "removalHeld",
            Why::Restart(_) => "kubeletNotRestarted",
            Why::NoReport => "noReport",
            Why::Invalid(_) => "invalidReport",
            Why::NoTarget(_) => "noTarget",
            Why::NotReady => "notReady",
            Why::ReadyUnknown => "readyUnknown",
        }
    }

    /// One line for humans, with everything from the node escaped.
    pub fn message(&self) -> String {
        let escape = |text: &str| crate::text::escape(text).into_owned();
        match self {
            Why::OutOfSync(why) => format!("out of sync: {}", escape(why)),
            Why::RemovalHeld(cas) => format!(
                "removal held of {}",
                cas.iter().map(Ca::label).collect::<Vec<_>>().join(", ")
            ),
            Why::Restart(Restart::Pending) => "kubelet restart pending after a CA was added".into(),
            Why::Restart(Restart::Failed) => "kubelet restart failed after a CA was added".into(),
            Why::Restart(Restart::Done) => "kubelet restarted".into(),
            Why::NoReport => "no report (no agent, or it cannot write its Node)".into(),
            Why::Invalid(why) => format!("invalid report: {}", escape(why)),
            Why::NoTarget(Target::Bundle) => "its report names no bundle".into(),
            Why::NoTarget(target) => format!("its report does not name {target}"),
            Why::NotReady => "node NotReady".into(),
            Why::ReadyUnknown => "node Ready condition Unknown".into(),
        }
    }
}

impl Serialize for Why {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(2))?;
        map.serialize_entry("reason", self.reason())?;
        map.serialize_entry("message", &self.message())?;
        map.end()
    }
}

/// One counted node's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeVerdict {
    pub name: String,
    pub state: State,
    /// Its Ready condition, when it was read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready: Option<Ready>,
    /// When what it holds (or why) last changed, as its report says (escaped).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// What the condition wants that it does not hold.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lacks: Vec<Ca>,
    /// What it holds that the condition wants gone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub still_holds: Vec<Ca>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub why: Vec<Why>,
}

/// How many counted nodes hold one certificate the counts are about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CaCount {
    #[serde(flatten)]
    pub ca: Ca,
    /// Nodes whose valid report shows it in the target.
    pub holding: usize,
    /// The other counted nodes: not shown to hold it (behind, unreported or invalid).
    pub missing: usize,
}

/// The fleet's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    /// Every counted node, by name.
    pub nodes: Vec<NodeVerdict>,
    /// Nodes being deleted, left out.
    pub left_out: usize,
    /// Each certificate the counts are about.
    pub certificates: Vec<CaCount>,
}

impl Verdict {
    /// How many nodes are counted.
    pub fn counted(&self) -> usize {
        self.nodes.len()
    }

    /// How many counted nodes are in `state`.
    pub fn count(&self, state: State) -> usize {
        self.nodes.iter().filter(|n| n.state == state).count()
    }

    /// Every counted node satisfies the condition (true of an empty fleet).
    pub fn done(&self) -> bool {
        self.nodes.iter().all(|n| n.state == State::Current)
    }

    /// The counted nodes that do not satisfy the condition.
    pub fn laggards(&self) -> impl Iterator<Item = &NodeVerdict> {
        self.nodes.iter().filter(|n| n.state != State::Current)
    }
}

/// The verdict on `nodes` for `question`.
pub fn verdict<'a>(question: &Question, nodes: impl IntoIterator<Item = Node<'a>>) -> Verdict {
    let counted_cas = question.counted();
    let mut left_out = 0;
    let mut verdicts = Vec::new();
    let mut holding: BTreeMap<&Sha, usize> = BTreeMap::new();
    for node in nodes {
        if node.deleting {
            left_out += 1;
            continue;
        }
        let (verdict, held) = judge(question, &node);
        if let Some(held) = held {
            for ca in &counted_cas {
                if held.contains(&ca.sha256) {
                    *holding.entry(&ca.sha256).or_default() += 1;
                }
            }
        }
        verdicts.push(verdict);
    }
    verdicts.sort_by(|a, b| a.name.cmp(&b.name));
    let counted = verdicts.len();
    let certificates = counted_cas
        .iter()
        .map(|ca| {
            let holding = holding.get(&ca.sha256).copied().unwrap_or(0);
            CaCount {
                ca: ca.clone(),
                holding,
                missing: counted - holding,
            }
        })
        .collect();
    Verdict {
        nodes: verdicts,
        left_out,
        certificates,
    }
}

/// One node's verdict, and what its valid report shows the target to hold.
fn judge(question: &Question, node: &Node<'_>) -> (NodeVerdict, Option<BTreeSet<Sha>>) {
    let mut verdict = NodeVerdict {
        name: crate::text::escape(node.name).into_owned(),
        state: State::Unreported,
        ready: node.ready,
        since: None,
        lacks: Vec::new(),
        still_holds: Vec::new(),
        why: Vec::new(),
    };
    let mut shown = None;
    match node.report {
        Report::Missing => verdict.why.push(Why::NoReport),
        Report::Oversized(bytes) => {
            verdict.state = State::Invalid;
            verdict.why.push(Why::Invalid(format!(
                "the report is {bytes} bytes, over the {MAX_BYTES} allowed"
            )));
        }
        Report::Read(Err(invalid)) => {
            verdict.state = State::Invalid;
            verdict.why.push(Why::Invalid(invalid.0.clone()));
        }
        Report::Read(Ok(held)) => {
            verdict.since = Some(crate::text::escape(&held.changed).into_owned());
            match question.target.find(held) {
                None => verdict.why.push(Why::NoTarget(question.target.clone())),
                Some(target) => {
                    let holds: BTreeSet<Sha> = target.certs.iter().cloned().collect();
                    against(question, held, target, &holds, &mut verdict);
                    shown = Some(holds);
                }
            }
        }
    }
    match node.ready {
        None | Some(Ready::True) => {}
        Some(Ready::False) => verdict.why.push(Why::NotReady),
        Some(Ready::Unknown) => verdict.why.push(Why::ReadyUnknown),
    }
    (verdict, shown)
}

/// The verdict on a node whose report names the target, which holds `holds`.
fn against(
    question: &Question,
    held: &Held,
    target: &TargetHeld,
    holds: &BTreeSet<Sha>,
    verdict: &mut NodeVerdict,
) {
    // Named by the sources or a `file:` certificate, else as the node's report names it
    // (a withdrawn CA is named by no source any more).
    let name = |sha: &Sha| {
        let ca = question.name(sha);
        match ca.subject_cn {
            Some(_) => ca,
            None => held.name(sha),
        }
    };
    // A kubeconfig's new CA counts once the kubelet has read it: after its restart.
    let restarted = match target.restart {
        None | Some(Restart::Done) => None,
        Some(pending_or_failed) => Some(pending_or_failed),
    };
    let mut needs_restart = false;
    match &question.condition {
        Condition::Sources => {
            let wanted: BTreeSet<&Sha> = question.sources.iter().map(|c| &c.sha256).collect();
            verdict.lacks = question
                .sources
                .iter()
                .filter(|c| !holds.contains(&c.sha256))
                .cloned()
                .collect();
            verdict.still_holds = target
                .certs
                .iter()
                .filter(|sha| !wanted.contains(sha))
                .map(name)
                .collect();
            needs_restart = true;
        }
        Condition::Add(shas) => {
            verdict.lacks = shas
                .iter()
                .filter(|sha| !holds.contains(*sha))
                .map(name)
                .collect();
            needs_restart = true;
        }
        Condition::Remove(shas) => {
            verdict.still_holds = shas
                .iter()
                .filter(|sha| holds.contains(*sha) || target.held_back.contains(sha))
                .map(name)
                .collect();
        }
    }
    let waits_on_restart = needs_restart.then_some(restarted).flatten();
    let satisfied =
        verdict.lacks.is_empty() && verdict.still_holds.is_empty() && waits_on_restart.is_none();
    verdict.state = if satisfied {
        State::Current
    } else {
        State::Behind
    };
    if !target.in_sync {
        let why = target.why.as_deref().unwrap_or("no reason given");
        verdict.why.push(Why::OutOfSync(why.to_string()));
    }
    if !target.held_back.is_empty() {
        verdict.why.push(Why::RemovalHeld(
            target.held_back.iter().map(name).collect(),
        ));
    }
    if let Some(restart) = waits_on_restart {
        verdict.why.push(Why::Restart(restart));
    }
}

/// Fingerprints, CAs and reports for the unit tests of the verdict and of what shows it.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub fn sha(c: char) -> Sha {
        Sha::parse(&std::iter::repeat_n(c, 64).collect::<String>()).unwrap()
    }

    pub fn ca(c: char, cn: &str) -> Ca {
        Ca {
            sha256: sha(c),
            subject_cn: Some(cn.to_string()),
            serial_number: Some(format!("{}", c as u32)),
        }
    }

    pub fn entry(path: &str, kind: Kind, certs: &[char]) -> TargetHeld {
        TargetHeld {
            path: path.to_string(),
            kind,
            sha256: None,
            certs: certs.iter().map(|c| sha(*c)).collect(),
            count: None,
            in_sync: true,
            why: None,
            held_back: Vec::new(),
            restart: None,
        }
    }

    pub fn report(targets: Vec<TargetHeld>) -> Report {
        let held = Held {
            v: 1,
            agent: "test".into(),
            changed: "2026-11-27T15:00:00Z".into(),
            targets,
            names: BTreeMap::new(),
        };
        // Through the annotation, as the follower reads it.
        Report::read(Some(&held.to_json()))
    }

    pub fn bundle(certs: &[char]) -> Report {
        report(vec![entry(
            "/etc/kubernetes/kubelet-ca.crt",
            Kind::Bundle,
            certs,
        )])
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    fn node<'a>(name: &'a str, report: &'a Report) -> Node<'a> {
        Node {
            name,
            ready: Some(Ready::True),
            deleting: false,
            report,
        }
    }

    fn sources(condition: Condition) -> Question {
        Question {
            sources: vec![ca('a', "signer-a"), ca('b', "signer-b")],
            known: vec![ca('f', "from-file")],
            condition,
            target: Target::Bundle,
        }
    }

    #[test]
    fn a_node_holding_exactly_what_the_sources_make_is_current_in_any_order() {
        let exact = bundle(&['b', 'a']);
        let v = verdict(&sources(Condition::Sources), [node("n1", &exact)]);
        assert_eq!(v.nodes[0].state, State::Current);
        assert!(v.nodes[0].why.is_empty());
        assert_eq!(v.nodes[0].since.as_deref(), Some("2026-11-27T15:00:00Z"));
        assert!(v.done());
        assert_eq!((v.counted(), v.count(State::Current)), (1, 1));
        assert_eq!(v.certificates.len(), 2);
        assert_eq!(
            (v.certificates[0].holding, v.certificates[0].missing),
            (1, 0)
        );
    }

    #[test]
    fn behind_says_what_it_lacks_and_what_it_still_holds_with_names() {
        let old = bundle(&['a', 'c']);
        let v = verdict(&sources(Condition::Sources), [node("n1", &old)]);
        let n = &v.nodes[0];
        assert_eq!(n.state, State::Behind);
        assert_eq!(n.lacks, vec![ca('b', "signer-b")]);
        assert_eq!(n.still_holds, vec![Ca::unnamed(sha('c'))]);
        assert!(!v.done());
        assert_eq!(v.laggards().count(), 1);
        assert_eq!(v.certificates[0].holding, 1);
        assert_eq!(
            (v.certificates[1].holding, v.certificates[1].missing),
            (0, 1)
        );
        // Holding more than the sources make is behind too.
        let more = bundle(&['a', 'b', 'c']);
        let v = verdict(&sources(Condition::Sources), [node("n1", &more)]);
        assert_eq!(v.nodes[0].state, State::Behind);
        assert!(v.nodes[0].lacks.is_empty());
        assert_eq!(v.nodes[0].still_holds.len(), 1);
    }

    #[test]
    fn what_no_source_names_is_named_as_the_nodes_own_report_names_it() {
        let mut held = Held {
            v: 1,
            agent: "a".into(),
            changed: "t".into(),
            targets: vec![entry("/b", Kind::Bundle, &['a', 'c'])],
            names: BTreeMap::new(),
        };
        held.names.insert(sha('c'), "withdrawn-signer".into());
        // A node cannot rename what the sources name.
        held.names.insert(sha('a'), "not-signer-a".into());
        let r = Report::read(Some(&held.to_json()));
        let n = verdict(&sources(Condition::Sources), [node("n", &r)]).nodes[0].clone();
        let withdrawn = Ca {
            sha256: sha('c'),
            subject_cn: Some("withdrawn-signer".into()),
            serial_number: None,
        };
        assert_eq!(n.still_holds, vec![withdrawn.clone()]);
        assert_eq!(n.lacks, vec![ca('b', "signer-b")]);
        // remove= names it too, and so does a removal held back.
        let mut q = sources(Condition::Remove(vec![sha('c')]));
        q.known.clear();
        let n = verdict(&q, [node("n", &r)]).nodes[0].clone();
        assert_eq!(n.still_holds, vec![withdrawn.clone()]);
        held.targets[0].certs = vec![sha('a')];
        held.targets[0].held_back = vec![sha('c')];
        let r = Report::read(Some(&held.to_json()));
        let n = verdict(&q, [node("n", &r)]).nodes[0].clone();
        assert_eq!(n.why, vec![Why::RemovalHeld(vec![withdrawn.clone()])]);
        // Another node's report does not name it for this one.
        let plain = bundle(&['a', 'c']);
        let v = verdict(&q, [node("m", &plain), node("n", &r)]);
        assert_eq!(v.nodes[0].still_holds, vec![Ca::unnamed(sha('c'))]);
    }

    #[test]
    fn add_needs_every_fingerprint_and_remove_needs_none() {
        let v_add = |certs: &[char]| {
            let r = bundle(certs);
            verdict(&sources(Condition::Add(vec![sha('f')])), [node("n", &r)]).nodes[0].clone()
        };
        assert_eq!(v_add(&['a', 'f']).state, State::Current);
        let behind = v_add(&['a']);
        assert_eq!(behind.state, State::Behind);
        // Named by the file it came from.
        assert_eq!(behind.lacks, vec![ca('f', "from-file")]);
        let v_remove = |certs: &[char]| {
            let r = bundle(certs);
            verdict(&sources(Condition::Remove(vec![sha('c')])), [node("n", &r)]).nodes[0].clone()
        };
        assert_eq!(v_remove(&['a', 'b']).state, State::Current);
        let behind = v_remove(&['a', 'c']);
        assert_eq!(behind.state, State::Behind);
        assert_eq!(behind.still_holds, vec![Ca::unnamed(sha('c'))]);
        assert!(behind.lacks.is_empty());
        // Remove does not care about what is missing.
        assert_eq!(v_remove(&[]).state, State::Current);
    }

    #[test]
    fn the_counts_are_about_the_conditions_certificates() {
        let q = sources(Condition::Add(vec![sha('f'), sha('a')]));
        assert_eq!(q.counted(), vec![ca('f', "from-file"), ca('a', "signer-a")]);
        let (r1, r2, r3) = (bundle(&['a', 'f']), bundle(&['a']), Report::Missing);
        let v = verdict(&q, [node("n1", &r1), node("n2", &r2), node("n3", &r3)]);
        let counts: Vec<(usize, usize)> = v
            .certificates
            .iter()
            .map(|c| (c.holding, c.missing))
            .collect();
        assert_eq!(counts, vec![(1, 2), (2, 1)]);
        let q = sources(Condition::Remove(vec![sha('c')]));
        assert_eq!(q.counted(), vec![Ca::unnamed(sha('c'))]);
    }

    #[test]
    fn a_kubeconfig_counts_an_added_ca_once_the_kubelet_restarted() {
        let path = "/var/lib/kubelet/kubeconfig";
        let with = |restart: Option<Restart>| {
            let mut t = entry(path, Kind::Kubeconfig, &['a', 'b']);
            t.restart = restart;
            report(vec![entry("/b", Kind::Bundle, &['e']), t])
        };
        let mut q = sources(Condition::Add(vec![sha('a')]));
        q.target = Target::Path(path.into());
        for (restart, state) in [
            (None, State::Current),
            (Some(Restart::Done), State::Current),
            (Some(Restart::Pending), State::Behind),
            (Some(Restart::Failed), State::Behind),
        ] {
            let r = with(restart);
            let v = verdict(&q, [node("n", &r)]);
            assert_eq!(v.nodes[0].state, state, "{restart:?}");
            if state == State::Behind {
                assert_eq!(v.nodes[0].why, vec![Why::Restart(restart.unwrap())]);
                assert!(v.nodes[0].why[0].message().contains("kubelet restart"));
                // It holds it all the same.
                assert_eq!(v.certificates[0].holding, 1);
            }
        }
        // `sources` too waits on the restart; `remove` does not.
        q.condition = Condition::Sources;
        let r = with(Some(Restart::Pending));
        assert_eq!(verdict(&q, [node("n", &r)]).nodes[0].state, State::Behind);
        q.condition = Condition::Remove(vec![sha('c')]);
        assert_eq!(verdict(&q, [node("n", &r)]).nodes[0].state, State::Current);
    }

    #[test]
    fn a_held_removal_is_still_held_and_said() {
        let path = "/var/lib/kubelet/kubeconfig";
        let mut t = entry(path, Kind::Kubeconfig, &['a']);
        t.held_back = vec![sha('c')];
        t.in_sync = false;
        t.why = Some("the server still presents a certificate only the old CA verifies".into());
        let r = report(vec![t]);
        let mut q = sources(Condition::Remove(vec![sha('c')]));
        q.target = Target::Path(path.into());
        let n = verdict(&q, [node("n", &r)]).nodes[0].clone();
        assert_eq!(n.state, State::Behind);
        assert_eq!(n.still_holds, vec![Ca::unnamed(sha('c'))]);
        assert_eq!(n.why[0].reason(), "outOfSync");
        assert!(n.why[0].message().contains("still presents"));
        assert_eq!(n.why[1], Why::RemovalHeld(vec![Ca::unnamed(sha('c'))]));
        assert!(
            n.why[1]
                .message()
                .starts_with("removal held of sha256:cccc")
        );
    }

    #[test]
    fn out_of_sync_says_the_nodes_reason_or_that_it_gave_none() {
        let mut t = entry("/b", Kind::Bundle, &['a']);
        t.in_sync = false;
        let r = report(vec![t]);
        let n = verdict(&sources(Condition::Sources), [node("n", &r)]).nodes[0].clone();
        assert_eq!(n.state, State::Behind);
        assert_eq!(n.why, vec![Why::OutOfSync("no reason given".into())]);
        // In sync on the node and holding it all is current even if the node says why not.
        let mut t = entry("/b", Kind::Bundle, &['a', 'b']);
        t.in_sync = false;
        t.why = Some("cannot write".into());
        let r = report(vec![t]);
        let n = verdict(&sources(Condition::Sources), [node("n", &r)]).nodes[0].clone();
        assert_eq!(n.state, State::Current);
        assert_eq!(n.why[0].message(), "out of sync: cannot write");
    }

    #[test]
    fn no_report_an_invalid_one_or_no_target_is_never_holding() {
        let missing = Report::Missing;
        let garbage = Report::read(Some("{\"v\":1,\"targets\":7}"));
        let huge_raw = "x".repeat(MAX_BYTES + 1);
        let huge = Report::read(Some(&huge_raw));
        assert_eq!(huge, Report::Oversized(MAX_BYTES + 1));
        let other = report(vec![entry("/etc/other.pem", Kind::File, &['a', 'b'])]);
        let q = sources(Condition::Sources);
        let v = verdict(
            &q,
            [
                node("a-missing", &missing),
                node("b-garbage", &garbage),
                node("c-huge", &huge),
                node("d-other", &other),
            ],
        );
        let states: Vec<State> = v.nodes.iter().map(|n| n.state).collect();
        assert_eq!(
            states,
            vec![
                State::Unreported,
                State::Invalid,
                State::Invalid,
                State::Unreported
            ]
        );
        assert_eq!(v.nodes[0].why, vec![Why::NoReport]);
        assert!(v.nodes[1].why[0].message().starts_with("invalid report: "));
        assert!(
            v.nodes[2].why[0]
                .message()
                .contains("over the 16384 allowed")
        );
        assert_eq!(v.nodes[3].why, vec![Why::NoTarget(Target::Bundle)]);
        assert_eq!(v.nodes[3].why[0].message(), "its report names no bundle");
        assert_eq!(v.nodes[3].since.as_deref(), Some("2026-11-27T15:00:00Z"));
        assert_eq!(v.nodes[1].since, None);
        // Nothing counted as held, everything missing everywhere.
        assert!(
            v.certificates
                .iter()
                .all(|c| c.holding == 0 && c.missing == 4)
        );
        assert_eq!(v.count(State::Invalid), 2);
        assert_eq!(v.count(State::Unreported), 2);
        // A path asked for is named.
        let mut q = q;
        q.target = Target::Path("/etc/x\u{1b}[31m".into());
        let v = verdict(&q, [node("d-other", &other)]);
        assert_eq!(
            v.nodes[0].why[0].message(),
            "its report does not name /etc/x\\u{1b}[31m"
        );
    }

    #[test]
    fn the_target_is_the_bundle_whatever_its_path_or_the_path_asked_for() {
        let r = report(vec![
            entry("/etc/pki/other.pem", Kind::File, &['c']),
            entry("/somewhere/else.crt", Kind::Bundle, &['a', 'b']),
        ]);
        let mut q = sources(Condition::Sources);
        assert_eq!(verdict(&q, [node("n", &r)]).nodes[0].state, State::Current);
        q.target = Target::Path("/etc/pki/other.pem".into());
        let n = verdict(&q, [node("n", &r)]).nodes[0].clone();
        assert_eq!(n.state, State::Behind);
        assert_eq!(n.still_holds, vec![Ca::unnamed(sha('c'))]);
        assert_eq!(q.target.to_string(), "/etc/pki/other.pem");
        assert_eq!(Target::Bundle.to_string(), "the bundle");
    }

    #[test]
    fn nodes_being_deleted_are_left_out_and_not_ready_ones_counted_and_marked() {
        let (good, bad) = (bundle(&['a', 'b']), bundle(&['a']));
        let mut gone = node("gone", &bad);
        gone.deleting = true;
        let mut down = node("down", &good);
        down.ready = Some(Ready::False);
        let mut unknown = node("unknown", &bad);
        unknown.ready = Some(Ready::Unknown);
        let v = verdict(&sources(Condition::Sources), [gone, down, unknown]);
        assert_eq!(v.left_out, 1);
        assert_eq!(v.counted(), 2);
        let names: Vec<&str> = v.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, vec!["down", "unknown"]);
        assert_eq!(v.nodes[0].state, State::Current);
        assert_eq!(v.nodes[0].why, vec![Why::NotReady]);
        assert_eq!(v.nodes[1].state, State::Behind);
        assert_eq!(v.nodes[1].why.last(), Some(&Why::ReadyUnknown));
        assert_eq!(v.certificates[1].missing, 1);
        // Readiness not read: nothing said of it.
        let mut unread = node("unread", &good);
        unread.ready = None;
        let v = verdict(&sources(Condition::Sources), [unread]);
        assert_eq!((v.nodes[0].ready, v.nodes[0].why.len()), (None, 0));
        assert!(
            serde_json::to_value(&v).unwrap()["nodes"][0]
                .get("ready")
                .is_none()
        );
        // An empty fleet has nothing left to wait for.
        let none = verdict(&sources(Condition::Sources), []);
        assert!(none.done());
        assert_eq!(none.certificates[0].missing, 0);
    }

    #[test]
    fn names_and_reasons_from_nodes_are_escaped() {
        let mut t = entry("/b", Kind::Bundle, &['a']);
        t.in_sync = false;
        t.why = Some("x".into());
        let mut held = Held {
            v: 1,
            agent: "a".into(),
            changed: "\u{1b}]0;t".into(),
            targets: vec![t],
            names: BTreeMap::new(),
        };
        held.targets[0].why = Some("bad\u{202e}name".into());
        held.targets[0].certs.push(sha('c'));
        held.names.insert(sha('c'), "evil\u{1b}[2J".into());
        let r = Report::Read(Ok(held));
        let v = verdict(&sources(Condition::Sources), [node("n\u{1b}[2J", &r)]);
        let n = &v.nodes[0];
        assert_eq!(
            n.still_holds[0].subject_cn.as_deref(),
            Some("evil\\u{1b}[2J")
        );
        assert_eq!(n.name, "n\\u{1b}[2J");
        assert_eq!(n.since.as_deref(), Some("\\u{1b}]0;t"));
        assert_eq!(n.why[0].message(), "out of sync: bad\\u{202e}name");
        let json = serde_json::to_value(&v).unwrap();
        assert!(!json.to_string().contains('\u{1b}'));
    }

    #[test]
    fn the_json_names_each_field_as_documented() {
        let (r1, r2) = (bundle(&['a']), Report::Missing);
        let mut down = node("n2", &r2);
        down.ready = Some(Ready::False);
        let v = verdict(&sources(Condition::Sources), [node("n1", &r1), down]);
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["leftOut"], 0);
        assert_eq!(json["nodes"][0]["name"], "n1");
        assert_eq!(json["nodes"][0]["state"], "behind");
        assert_eq!(json["nodes"][0]["ready"], "true");
        assert_eq!(json["nodes"][0]["lacks"][0]["subjectCN"], "signer-b");
        assert_eq!(json["nodes"][0]["lacks"][0]["sha256"], sha('b').as_str());
        assert_eq!(json["nodes"][0]["lacks"][0]["serialNumber"], "98");
        assert!(json["nodes"][0].get("stillHolds").is_none());
        assert_eq!(json["nodes"][1]["state"], "unreported");
        assert_eq!(json["nodes"][1]["ready"], "false");
        assert_eq!(json["nodes"][1]["why"][0]["reason"], "noReport");
        assert_eq!(json["nodes"][1]["why"][1]["reason"], "notReady");
        assert_eq!(json["certificates"][0]["subjectCN"], "signer-a");
        assert_eq!(json["certificates"][0]["holding"], 1);
        assert_eq!(json["certificates"][1]["missing"], 2);
        assert_eq!(State::Invalid.as_str(), "invalid");
        assert_eq!(
            State::ALL.map(State::as_str),
            ["current", "behind", "unreported", "invalid"]
        );
    }

    #[test]
    fn every_reason_has_its_word_and_line() {
        let cases = [
            (Why::OutOfSync("r".into()), "outOfSync", "out of sync: r"),
            (
                Why::RemovalHeld(vec![ca('a', "s")]),
                "removalHeld",
                "removal held of s (sha256:aaaaaaaaaaaa...)",
            ),
            (
                Why::Restart(Restart::Pending),
                "kubeletNotRestarted",
                "kubelet restart pending after a CA was added",
            ),
            (
                Why::Restart(Restart::Failed),
                "kubeletNotRestarted",
                "kubelet restart failed after a CA was added",
            ),
            (
                Why::Restart(Restart::Done),
                "kubeletNotRestarted",
                "kubelet restarted",
            ),
            (
                Why::NoReport,
                "noReport",
                "no report (no agent, or it cannot write its Node)",
            ),
            (
                Why::Invalid("r".into()),
                "invalidReport",
                "invalid report: r",
            ),
            (
                Why::NoTarget(Target::Path("/p".into())),
                "noTarget",
                "its report does not name /p",
            ),
            (Why::NotReady, "notReady", "node NotReady"),
            (
                Why::ReadyUnknown,
                "readyUnknown",
                "node Ready condition Unknown",
            ),
        ];
        for (why, reason, message) in cases {
            assert_eq!((why.reason(), why.message().as_str()), (reason, message));
        }
        assert_eq!(ca('a', "s").label(), "s (sha256:aaaaaaaaaaaa...)");
        assert_eq!(Ca::unnamed(sha('a')).label(), "sha256:aaaaaaaaaaaa...");
        assert_eq!(Report::read(None), Report::Missing);
        let now = crate::bundle::test_certs::now();
        let certificate = crate::bundle::test_certs::ca(Some("signer-x"), None, now - 60, now + 60);
        let of = Ca::of(&certificate);
        assert_eq!(of.sha256.as_str(), certificate.fingerprint().to_hex());
        assert_eq!(of.subject_cn.as_deref(), Some("signer-x"));
        assert_eq!(
            of.serial_number.as_deref(),
            Some(certificate.serial.as_str())
        );
        assert_eq!(
            Report::read(Some(&"x".repeat(MAX_BYTES))).clone(),
            Report::Read(Held::parse(&"x".repeat(MAX_BYTES)))
        );
    }
}
