//! What a node says it holds (SPEC 8c): the `kubelet-ca-agent/held` annotation that the node
//! agent writes on its own Node, version 1, built from the targets' status and read back by
//! `rollout` and `publish`. A node writes its own annotation, so the reader treats it as
//! untrusted input: a size bound first, then a strict schema (unknown fields ignored, wrong
//! types refused), then every fingerprint checked; anything else is a [`Invalid`] reason,
//! never a panic.
//!
//! Nothing secret goes in: paths, SHA-256 digests and fingerprints, sync state and its
//! one-line reason, the kubelet restart's state, the time and the agent's version.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use crate::status::Restart;
use crate::status::Status;

/// The annotation's key.
pub const ANNOTATION: &str = "kubelet-ca-agent/held";
/// The largest value written or read (SPEC 8c).
pub const MAX_BYTES: usize = 16 * 1024;
/// The version this agent writes and reads.
pub const VERSION: u32 = 1;
/// A reason is cut to this many characters: one line, not a log.
const MAX_WHY: usize = 240;
/// More targets than any node keeps: a report with more is refused.
const MAX_TARGETS: usize = 256;
/// A certificate's name is cut to this many characters (X.509's bound on a CN).
const MAX_NAME: usize = 64;

/// One node's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// The schema version, [`VERSION`].
    pub v: u32,
    /// The agent's version.
    pub agent: String,
    /// When what it holds (or why) last changed, RFC 3339.
    pub changed: String,
    pub targets: Vec<TargetHeld>,
    /// The subject CN (or the name `inspect` shows) of each certificate its targets hold, by
    /// fingerprint, at most [`MAX_NAME`] characters each: what `rollout status` names a
    /// certificate by when no source makes it any more (a withdrawn CA a node still holds).
    /// Left out first when the report would be too large; older agents write none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub names: BTreeMap<Sha, String>,
}

/// What kind of thing a target is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// The kubelet's client-CA bundle (`--bundle`).
    Bundle,
    /// A `--manage` file.
    File,
    /// A managed kubeconfig's CA data.
    Kubeconfig,
    /// A `--manage-registries` set, as one entry.
    Registries,
}

/// One target's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TargetHeld {
    pub path: String,
    pub kind: Kind,
    /// SHA-256 of what is on disk (for a registry set, a digest of its files' paths and
    /// digests); absent when nothing is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<Sha>,
    /// The SHA-256 fingerprint of each certificate it holds, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub certs: Vec<Sha>,
    /// A registry set: how many registry files it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    /// Whether it equals what its sources make.
    pub in_sync: bool,
    /// Why not, when it is not (or why that is not known yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// A kubeconfig: the CAs its sources dropped that are kept until the server is seen to
    /// need them no more.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_back: Vec<Sha>,
    /// A kubeconfig: the kubelet's restart after the last addition; absent when none was
    /// needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<Restart>,
}

/// A SHA-256 in lowercase hex: refused when it is anything else.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct Sha(String);

impl Sha {
    /// `text` as a SHA-256: 64 hex digits, colons allowed between them, any case.
    pub fn parse(text: &str) -> Option<Sha> {
        let text = text.trim();
        let text = match text.get(..7) {
            Some(head) if head.eq_ignore_ascii_case("sha256:") => &text[7..],
            _ => text,
        };
        let hex: String = text
            .chars()
            .filter(|c| *c != ':')
            .collect::<String>()
            .to_ascii_lowercase();
        (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(Sha(hex))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 12 digits, as tables and log lines show it.
    pub fn short(&self) -> &str {
        &self.0[..12]
    }
}

impl From<crate::bundle::Fingerprint> for Sha {
    fn from(fingerprint: crate::bundle::Fingerprint) -> Sha {
        Sha(fingerprint.to_hex())
    }
}

impl std::fmt::Display for Sha {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", self.0)
    }
}

impl<'de> Deserialize<'de> for Sha {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Sha, D::Error> {
        let text = String::deserialize(d)?;
        // Only what this agent writes: no colons, no prefix, lowercase.
        match Sha::parse(&text) {
            Some(sha) if sha.0 == text => Ok(sha),
            _ => Err(serde::de::Error::custom(format!(
                "{} is not a SHA-256 in lowercase hex",
                crate::text::escape(&cut(&text, 80))
            ))),
        }
    }
}

/// Why a node's annotation is not a report this agent can count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

impl Held {
    /// Reads an annotation's value: at most [`MAX_BYTES`], JSON of version [`VERSION`].
    pub fn parse(raw: &str) -> Result<Held, Invalid> {
        if raw.len() > MAX_BYTES {
            return Err(Invalid(format!(
                "the report is {} bytes, over the {MAX_BYTES} allowed",
                raw.len()
            )));
        }
        // The version first, so that a later schema is named as such.
        #[derive(Deserialize)]
        struct Versioned {
            v: serde_json::Value,
        }
        let versioned: Versioned = serde_json::from_str(raw)
            .map_err(|e| Invalid(format!("not a report: {}", escape_error(&e))))?;
        if versioned.v != serde_json::json!(VERSION) {
            return Err(Invalid(format!(
                "version {} of the report is not one this agent reads (it reads {VERSION})",
                crate::text::escape(&cut(&versioned.v.to_string(), 20))
            )));
        }
        let held: Held = serde_json::from_str(raw)
            .map_err(|e| Invalid(format!("not a report: {}", escape_error(&e))))?;
        if held.targets.len() > MAX_TARGETS {
            return Err(Invalid(format!(
                "{} targets, over the {MAX_TARGETS} allowed",
                held.targets.len()
            )));
        }
        // A name as the writer cuts it: at most MAX_NAME characters and its ellipsis.
        if let Some(long) = held
            .names
            .values()
            .find(|name| name.chars().count() > MAX_NAME + 1)
        {
            return Err(Invalid(format!(
                "a name of {} characters, over the {MAX_NAME} allowed",
                long.chars().count()
            )));
        }
        Ok(held)
    }

    /// The JSON to write, at most [`MAX_BYTES`]: when the whole report is larger (thousands
    /// of certificates), the certificate lists of the largest targets are left out, each
    /// such target said not in sync with the reason, so that no reader counts what it
    /// cannot see.
    pub fn to_json(&self) -> String {
        let mut held = self.clone();
        loop {
            let json = serde_json::to_string(&held).expect("a report serializes");
            if json.len() <= MAX_BYTES {
                return json;
            }
            // The names go first: without them a certificate is still counted.
            if !held.names.is_empty() {
                held.names.clear();
                continue;
            }
            let Some(largest) = held
                .targets
                .iter_mut()
                .filter(|t| !t.certs.is_empty() || !t.held_back.is_empty())
                .max_by_key(|t| t.certs.len() + t.held_back.len())
            else {
                // Nothing left to cut (paths and reasons alone are bounded well below).
                held.targets.truncate(held.targets.len() / 2);
                continue;
            };
            let n = largest.certs.len();
            largest.certs.clear();
            largest.held_back.clear();
            largest.in_sync = false;
            largest.why = Some(format!(
                "its {n} certificates are too many to list in the report"
            ));
        }
    }

    /// The report of what the loop's last pass left on disk: the bundle, each `--manage`
    /// file and managed kubeconfig, each registry set as one entry. `changed` is when that
    /// last changed.
    pub fn of(status: &Status, changed: String) -> Held {
        let mut targets = vec![target(status, Kind::Bundle)];
        let mut sets: BTreeMap<&str, Vec<&Status>> = BTreeMap::new();
        for other in &status.others {
            match &other.registry_set {
                Some(dir) => sets.entry(dir.as_str()).or_default().push(other),
                None if other.removal_held.is_some() => {
                    targets.push(target(other, Kind::Kubeconfig))
                }
                None => targets.push(target(other, Kind::File)),
            }
        }
        // A set with no registry file yet is one entry too, from its note.
        for (name, problem) in &status.notes {
            if let Some(dir) = name.strip_prefix("registries:") {
                let files = sets.remove(dir).unwrap_or_default();
                targets.push(registries(dir, &files, problem.as_deref()));
            }
        }
        for (dir, files) in sets {
            targets.push(registries(dir, &files, None));
        }
        let names = std::iter::once(status)
            .chain(status.others.iter().filter(|s| s.registry_set.is_none()))
            .flat_map(|s| &s.certificates)
            .map(|c| (Sha::from(c.fingerprint()), cut(&c.display_name(), MAX_NAME)))
            .collect();
        Held {
            v: VERSION,
            agent: env!("CARGO_PKG_VERSION").to_string(),
            changed,
            targets,
            names,
        }
    }

    /// The same report with another time: whether anything but the time differs.
    pub fn same_as(&self, other: &Held) -> bool {
        self.targets == other.targets
            && self.names == other.names
            && self.agent == other.agent
            && self.v == other.v
    }

    /// `sha` with the name this report gives it (escaped: a node writes its own report),
    /// if it gives one.
    pub fn name(&self, sha: &Sha) -> super::verdict::Ca {
        let mut ca = super::verdict::Ca::unnamed(sha.clone());
        ca.subject_cn = self
            .names
            .get(sha)
            .map(|name| crate::text::escape(name).into_owned());
        ca
    }
}

/// One file's entry.
fn target(status: &Status, kind: Kind) -> TargetHeld {
    let in_sync = status.in_sync == Some(true) || status.nothing_to_keep;
    let why = (!in_sync).then(|| {
        let why = match status.in_sync {
            Some(false) => status
                .sync_problem
                .as_deref()
                .unwrap_or("the file differs from the sources"),
            _ if !status.file_valid => status
                .file_problem
                .as_deref()
                .unwrap_or("the file is not a valid bundle"),
            _ => status.sync_problem.as_deref().unwrap_or("not known yet"),
        };
        one_line(why)
    });
    TargetHeld {
        path: status.bundle_path.clone(),
        kind,
        sha256: status.sha256.as_deref().and_then(Sha::parse),
        certs: status
            .certificates
            .iter()
            .map(|c| Sha::from(c.fingerprint()))
            .collect(),
        count: None,
        in_sync,
        why,
        held_back: status
            .held_back
            .iter()
            .filter_map(|fp| Sha::parse(fp))
            .collect(),
        restart: status.restart,
    }
}

/// A registry set's entry: its files' count, and one digest of their paths and digests.
fn registries(dir: &str, files: &[&Status], problem: Option<&str>) -> TargetHeld {
    let mut digest = Sha256::new();
    let mut lines: Vec<String> = files
        .iter()
        .map(|f| format!("{} {}\n", f.bundle_path, f.sha256.as_deref().unwrap_or("-")))
        .collect();
    lines.sort();
    for line in &lines {
        digest.update(line.as_bytes());
    }
    let out_of_sync = files.iter().find(|f| f.in_sync != Some(true));
    let why = match (out_of_sync, problem) {
        (Some(file), _) => Some(format!(
            "{}: {}",
            file.bundle_path,
            file.sync_problem
                .as_deref()
                .or(file.file_problem.as_deref())
                .unwrap_or("not in sync")
        )),
        (None, Some(problem)) => Some(problem.to_string()),
        (None, None) => None,
    };
    TargetHeld {
        path: dir.to_string(),
        kind: Kind::Registries,
        sha256: Some(Sha(hex::encode(digest.finalize()))),
        certs: Vec::new(),
        count: Some(files.len() as u32),
        in_sync: why.is_none(),
        why: why.as_deref().map(one_line),
        held_back: Vec::new(),
        restart: None,
    }
}

/// One line of at most [`MAX_WHY`] characters, escaped.
fn one_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    crate::text::escape(&cut(line, MAX_WHY)).into_owned()
}

fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

fn escape_error(e: &serde_json::Error) -> String {
    crate::text::escape(&cut(&e.to_string(), 200)).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bundle::test_certs;

    fn sha(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    fn bundle_status() -> Status {
        let now = test_certs::now();
        let ca = test_certs::ca(Some("signer-a"), None, now - 60, now + 3600);
        Status {
            bundle_path: "/etc/kubernetes/kubelet-ca.crt".into(),
            certificates: vec![ca],
            sha256: Some(sha('a')),
            file_valid: true,
            in_sync: Some(true),
            ..Status::default()
        }
    }

    #[test]
    fn a_report_round_trips_and_says_what_each_target_holds() {
        let mut status = bundle_status();
        status.others.push(Status {
            bundle_path: "/var/lib/kubelet/kubeconfig".into(),
            sha256: Some(sha('b')),
            file_valid: true,
            in_sync: Some(true),
            removal_held: Some(true),
            held_back: vec![sha('c')],
            restart: Some(Restart::Pending),
            ..Status::default()
        });
        let held = Held::of(&status, "2026-11-27T15:00:00Z".into());
        let json = held.to_json();
        let back = Held::parse(&json).unwrap();
        assert_eq!(back, held);
        assert_eq!(back.targets[0].kind, Kind::Bundle);
        assert_eq!(back.targets[0].certs.len(), 1);
        assert_eq!(
            back.targets[0].certs[0].as_str(),
            status.certificates[0].fingerprint().to_hex()
        );
        assert_eq!(back.targets[1].kind, Kind::Kubeconfig);
        assert_eq!(back.targets[1].held_back, vec![Sha(sha('c'))]);
        assert_eq!(back.targets[1].restart, Some(Restart::Pending));
        // A --manage file (no removal to hold) is a file.
        status.others.push(Status {
            bundle_path: "/etc/containerd/certs.d/ca.crt".into(),
            file_valid: true,
            in_sync: Some(true),
            ..Status::default()
        });
        let kinds: Vec<Kind> = Held::of(&status, "t".into())
            .targets
            .iter()
            .map(|t| t.kind)
            .collect();
        assert_eq!(kinds, [Kind::Bundle, Kind::Kubeconfig, Kind::File]);
        // Nothing but what the schema says: no PEM, no key.
        assert!(!json.contains("BEGIN"), "{json}");
    }

    #[test]
    fn an_untrusted_report_is_refused_with_a_reason_never_a_panic() {
        let status = bundle_status();
        let ok = Held::of(&status, "t".into()).to_json();
        assert!(Held::parse(&ok).is_ok());
        let cases = [
            ("{", "not a report"),
            ("[]", "not a report"),
            (
                r#"{"v":2,"agent":"x","changed":"t","targets":[]}"#,
                "version 2",
            ),
            (
                r#"{"v":"1","agent":"x","changed":"t","targets":[]}"#,
                "version \"1\"",
            ),
            (
                r#"{"v":1,"agent":"x","changed":"t","targets":{}}"#,
                "not a report",
            ),
            (
                r#"{"v":1,"agent":"x","changed":"t","targets":[{"path":"/x","kind":"bundle","inSync":"yes"}]}"#,
                "not a report",
            ),
            (
                r#"{"v":1,"agent":"x","changed":"t","targets":[{"path":"/x","kind":"bundle","inSync":true,"certs":["ABC"]}]}"#,
                "not a SHA-256",
            ),
            (
                r#"{"v":1,"agent":"x","changed":"t","targets":[{"path":"/x","kind":"bogus","inSync":true}]}"#,
                "not a report",
            ),
        ];
        for (raw, says) in cases {
            let why = Held::parse(raw).unwrap_err().0;
            assert!(why.contains(says), "{raw}: {why}");
        }
        // Uppercase or colons are how a user writes one, not how the agent does.
        let fingerprint = status.certificates[0].fingerprint().to_hex();
        let upper = ok.replace(&fingerprint, &fingerprint.to_uppercase());
        assert_ne!(upper, ok);
        assert!(Held::parse(&upper).is_err());
        // Oversized: refused before it is parsed.
        let huge = format!("{{\"v\":1,\"pad\":\"{}\"}}", "x".repeat(MAX_BYTES));
        let why = Held::parse(&huge).unwrap_err().0;
        assert!(why.contains("over the 16384 allowed"), "{why}");
        // ...and one of exactly the bound is read.
        let pad = MAX_BYTES - ok.len() - r#""pad":"","#.len();
        let at_bound = ok.replacen('{', &format!(r#"{{"pad":"{}","#, "x".repeat(pad)), 1);
        assert_eq!(at_bound.len(), MAX_BYTES);
        assert!(Held::parse(&at_bound).is_ok());
        // Unknown fields are ignored: a later agent may say more.
        let more = ok.replacen("{\"v\":1,", "{\"v\":1,\"extra\":{\"a\":[1]},", 1);
        assert!(Held::parse(&more).is_ok(), "{more}");
        // Too many targets.
        let target = r#"{"path":"/x","kind":"file","inSync":true}"#;
        let many = format!(
            r#"{{"v":1,"agent":"x","changed":"t","targets":[{}]}}"#,
            vec![target; MAX_TARGETS + 1].join(",")
        );
        assert!(Held::parse(&many).unwrap_err().0.contains("targets, over"));
        let most = format!(
            r#"{{"v":1,"agent":"x","changed":"t","targets":[{}]}}"#,
            vec![target; MAX_TARGETS].join(",")
        );
        assert_eq!(Held::parse(&most).unwrap().targets.len(), MAX_TARGETS);
        // Text from the node is escaped in the reason.
        let why = Held::parse(r#"{"v":"\u001b[31m"}"#).unwrap_err().0;
        assert!(!why.contains('\u{1b}'), "{why:?}");
    }

    #[test]
    fn each_certificate_is_named_and_the_names_go_first_when_the_report_is_too_large() {
        let now = test_certs::now();
        let mut status = bundle_status();
        let long = "x".repeat(80);
        let other = test_certs::ca(Some(&long), None, now - 60, now + 3600);
        status.others.push(Status {
            bundle_path: "/var/lib/kubelet/kubeconfig".into(),
            certificates: vec![other.clone()],
            file_valid: true,
            in_sync: Some(true),
            removal_held: Some(true),
            ..Status::default()
        });
        // A registry set's files are not named: the report lists no certificate of theirs.
        let unlisted = test_certs::ca(Some("registry-ca"), None, now - 60, now + 3600);
        status.others.push(Status {
            bundle_path: "/etc/containers/registries.d/x.yaml".into(),
            certificates: vec![unlisted.clone()],
            registry_set: Some("/etc/containers/registries.d".into()),
            ..Status::default()
        });
        let held = Held::of(&status, "t".into());
        let a = Sha::from(status.certificates[0].fingerprint());
        let b = Sha::from(other.fingerprint());
        assert_eq!(held.names.len(), 2, "{:?}", held.names);
        assert_eq!(held.names[&a], "signer-a");
        // Cut to 64 characters, as X.509 bounds a CN.
        assert_eq!(held.names[&b], format!("{}…", "x".repeat(64)));
        let back = Held::parse(&held.to_json()).unwrap();
        assert_eq!(back, held);
        assert_eq!(back.name(&a).subject_cn.as_deref(), Some("signer-a"));
        // Another writer's name longer than the writer cuts one: no report.
        let mut long = held.clone();
        long.names.insert(b.clone(), "y".repeat(MAX_NAME + 2));
        let e = Held::parse(&long.to_json()).unwrap_err();
        assert_eq!(e.0, "a name of 66 characters, over the 64 allowed");
        assert_eq!(
            back.name(&Sha(sha('e'))),
            crate::fleet::verdict::Ca::unnamed(Sha(sha('e')))
        );
        // A different name is a different report; the time alone is not.
        let mut renamed = held.clone();
        renamed.names.insert(a.clone(), "signer-z".into());
        assert!(!renamed.same_as(&held));
        let mut later = held.clone();
        later.changed = "u".into();
        assert!(later.same_as(&held));
        // Too large with the names, within the bound without them: every list is kept.
        let many: Vec<Sha> = (0..150).map(|i| Sha(format!("{i:064x}"))).collect();
        let mut big = held.clone();
        big.targets[0].certs = many.clone();
        big.names = many.iter().map(|s| (s.clone(), "n".repeat(64))).collect();
        let json = big.to_json();
        assert!(json.len() <= MAX_BYTES, "{}", json.len());
        let back = Held::parse(&json).unwrap();
        assert!(back.names.is_empty());
        assert_eq!(back.targets[0].certs, many);
        assert!(back.targets[0].in_sync);
        // An older agent's report, with no names, is read as before.
        let old = r#"{"v":1,"agent":"0.1.0","changed":"t","targets":[]}"#;
        assert!(Held::parse(old).unwrap().names.is_empty());
        // A name keyed by something that is not a fingerprint makes the report invalid.
        let bad = r#"{"v":1,"agent":"0.1.0","changed":"t","targets":[],"names":{"zz":"x"}}"#;
        assert!(Held::parse(bad).is_err());
    }

    #[test]
    fn a_report_over_the_bound_leaves_out_the_largest_lists_and_says_so() {
        let mut status = bundle_status();
        let one = status.certificates[0].clone();
        status.certificates = vec![one.clone(); 400];
        let held = Held::of(&status, "t".into());
        let json = held.to_json();
        assert!(json.len() <= MAX_BYTES, "{}", json.len());
        let back = Held::parse(&json).unwrap();
        assert!(back.targets[0].certs.is_empty());
        assert!(!back.targets[0].in_sync);
        assert!(
            back.targets[0]
                .why
                .as_deref()
                .unwrap()
                .contains("400 certificates"),
            "{:?}",
            back.targets[0].why
        );
        // A report within the bound is written whole.
        let small = Held::of(&bundle_status(), "t".into());
        assert_eq!(Held::parse(&small.to_json()).unwrap(), small);
        // Only the largest lists go: a kubeconfig holding one CA and keeping two that its
        // sources dropped keeps both lists when leaving out the bundle's is enough.
        status.others.push(Status {
            bundle_path: "/var/lib/kubelet/kubeconfig".into(),
            certificates: vec![one.clone()],
            file_valid: true,
            in_sync: Some(true),
            removal_held: Some(true),
            held_back: vec![sha('c'), sha('d')],
            ..Status::default()
        });
        let back = Held::parse(&Held::of(&status, "t".into()).to_json()).unwrap();
        assert!(back.targets[0].certs.is_empty());
        let kubeconfig = &back.targets[1];
        assert_eq!((kubeconfig.certs.len(), kubeconfig.held_back.len()), (1, 2));
        assert!(kubeconfig.in_sync);
        // With no list left to cut (a hundred targets, each with a long reason), the
        // targets that fit are kept, in order.
        let mut status = bundle_status();
        status.certificates.clear();
        for i in 0..100 {
            status.others.push(Status {
                bundle_path: format!("/etc/pki/managed-{i:03}.crt"),
                file_valid: true,
                in_sync: Some(false),
                sync_problem: Some("y".repeat(500)),
                ..Status::default()
            });
        }
        let json = Held::of(&status, "t".into()).to_json();
        assert!(json.len() <= MAX_BYTES, "{}", json.len());
        let back = Held::parse(&json).unwrap();
        assert!(back.targets.len() > 1, "{} kept", back.targets.len());
        assert_eq!(back.targets[0].path, "/etc/kubernetes/kubelet-ca.crt");
        assert_eq!(back.targets[1].path, "/etc/pki/managed-000.crt");
    }

    #[test]
    fn out_of_sync_unknown_and_invalid_files_say_why_in_one_line() {
        let mut status = bundle_status();
        status.in_sync = Some(false);
        status.sync_problem = Some("cannot write it: read-only\nsecond line".into());
        let held = Held::of(&status, "t".into());
        assert!(!held.targets[0].in_sync);
        assert_eq!(
            held.targets[0].why.as_deref(),
            Some("cannot write it: read-only")
        );
        status.in_sync = None;
        status.sync_problem = None;
        let held = Held::of(&status, "t".into());
        assert_eq!(held.targets[0].why.as_deref(), Some("not known yet"));
        status.file_valid = false;
        status.file_problem = Some("missing".into());
        let held = Held::of(&status, "t".into());
        assert_eq!(held.targets[0].why.as_deref(), Some("missing"));
        // Known to differ from its sources, with no reason given: said so, whatever else.
        status.in_sync = Some(false);
        let held = Held::of(&status, "t".into());
        assert_eq!(
            held.targets[0].why.as_deref(),
            Some("the file differs from the sources")
        );
        status.in_sync = Some(true);
        let held = Held::of(&status, "t".into());
        assert!(held.targets[0].in_sync);
        assert_eq!(held.targets[0].why, None);
        // A --manage file with nothing to keep is in sync.
        let nothing = Status {
            nothing_to_keep: true,
            ..Status::default()
        };
        assert!(target(&nothing, Kind::File).in_sync);
        let long = "x".repeat(1000);
        assert_eq!(one_line(&long).chars().count(), MAX_WHY + 1);
    }

    #[test]
    fn a_registry_set_is_one_entry_with_its_count_and_digest() {
        let file = |host: &str, digest: char, in_sync: bool| Status {
            bundle_path: format!("/etc/docker/certs.d/{host}/ca.crt"),
            sha256: Some(sha(digest)),
            in_sync: Some(in_sync),
            registry_set: Some("/etc/docker/certs.d".into()),
            ..Status::default()
        };
        let mut status = bundle_status();
        status.others = vec![file("a.io", 'a', true), file("b.io", 'b', true)];
        status.notes = vec![("registries:/etc/docker/certs.d".into(), None)];
        let held = Held::of(&status, "t".into());
        assert_eq!(held.targets.len(), 2);
        let set = &held.targets[1];
        assert_eq!(
            (set.kind, set.count, set.in_sync),
            (Kind::Registries, Some(2), true)
        );
        // The digest follows the files, not their order.
        status.others.reverse();
        assert_eq!(Held::of(&status, "t".into()).targets[1].sha256, set.sha256);
        status.others[0].sha256 = Some(sha('c'));
        assert_ne!(Held::of(&status, "t".into()).targets[1].sha256, set.sha256);
        // A file out of sync, or a refused entry, makes the set not in sync.
        status.others[1].in_sync = Some(false);
        status.others[1].sync_problem = Some("cannot write".into());
        let set = &Held::of(&status, "t".into()).targets[1];
        assert!(!set.in_sync);
        assert!(set.why.as_deref().unwrap().ends_with("cannot write"));
        status.others.clear();
        status.notes = vec![(
            "registries:/etc/docker/certs.d".into(),
            Some("entry x: refused".into()),
        )];
        let set = &Held::of(&status, "t".into()).targets[1];
        assert_eq!((set.count, set.in_sync), (Some(0), false));
        // Other notes are not registry sets.
        status.notes = vec![("something:else".into(), None)];
        assert_eq!(Held::of(&status, "t".into()).targets.len(), 1);
    }

    #[test]
    fn a_fingerprint_is_read_as_users_write_it() {
        let hex = sha('a');
        let with_colons: String = hex
            .as_bytes()
            .chunks(2)
            .map(|p| std::str::from_utf8(p).unwrap().to_uppercase())
            .collect::<Vec<_>>()
            .join(":");
        assert_eq!(Sha::parse(&with_colons), Some(Sha(hex.clone())));
        // As a table or openssl prints it: sha256: in any case in front.
        for head in ["sha256:", "SHA256:", "Sha256:"] {
            let text = format!("{head}{}", hex.to_uppercase());
            assert_eq!(Sha::parse(&text), Some(Sha(hex.clone())), "{text}");
        }
        assert_eq!(Sha::parse(&format!("sha256:{hex}")), Some(Sha(hex.clone())));
        assert_eq!(Sha::parse(&hex[1..]), None);
        assert_eq!(Sha::parse(&format!("{}g", &hex[1..])), None);
        assert_eq!(Sha(hex.clone()).short(), &hex[..12]);
        assert_eq!(Sha(hex.clone()).to_string(), format!("sha256:{hex}"));
        // Same as another but for the time.
        let status = bundle_status();
        let a = Held::of(&status, "t1".into());
        let b = Held::of(&status, "t2".into());
        assert!(a.same_as(&b));
        let mut c = b.clone();
        c.targets[0].in_sync = false;
        assert!(!a.same_as(&c));
    }
}
