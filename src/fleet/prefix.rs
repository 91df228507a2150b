//! A fingerprint given by its first digits, as git takes a short hash: `rollout wait --for
//! add=7cd38cef4711` names the one certificate, among those the sources make or a node's
//! report names, whose SHA-256 starts so. Pure: the prefix and the candidates in, the
//! certificate (or why there is none) out.

use super::held::{Held, Sha};
use super::verdict::Ca;

/// The fewest digits a prefix may have: 12, as tables and log lines print a fingerprint.
pub const MIN_DIGITS: usize = 12;

/// The first digits of a SHA-256 fingerprint, lowercase hex, at least [`MIN_DIGITS`] and
/// fewer than 64 (64 digits are a [`Sha`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShaPrefix(String);

impl ShaPrefix {
    /// `text` as a prefix: hex digits, colons allowed between them, any case, `sha256:` in
    /// front or not, and the `...` a table ends a short fingerprint with, or not.
    pub fn parse(text: &str) -> Option<ShaPrefix> {
        let text = text.trim();
        let text = text
            .strip_suffix("...")
            .or_else(|| text.strip_suffix('…'))
            .unwrap_or(text);
        let text = match text.get(..7) {
            Some(head) if head.eq_ignore_ascii_case("sha256:") => &text[7..],
            _ => text,
        };
        let hex: String = text
            .chars()
            .filter(|c| *c != ':')
            .collect::<String>()
            .to_ascii_lowercase();
        let digits = hex.len();
        ((MIN_DIGITS..64).contains(&digits) && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then_some(ShaPrefix(hex))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `sha` starts with it.
    pub fn matches(&self, sha: &Sha) -> bool {
        sha.as_str().starts_with(&self.0)
    }
}

impl std::fmt::Display for ShaPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", self.0)
    }
}

/// Why a prefix names no one certificate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unresolved {
    #[error(
        "no certificate that the sources make or a node's report names has a fingerprint starting with {0}: give the whole fingerprint (64 hex digits) or file:PATH"
    )]
    None(ShaPrefix),
    #[error("{0} names {n} certificates, give more of its digits:{list}", n = .1.len(), list = listed(.1))]
    Ambiguous(ShaPrefix, Vec<Ca>),
}

/// One line per candidate: its subject CN (escaped) and its whole fingerprint.
fn listed(cas: &[Ca]) -> String {
    cas.iter()
        .map(|ca| {
            let cn = ca
                .subject_cn
                .as_deref()
                .map_or("(no name known)".into(), crate::text::escape);
            format!("\n  {cn}  {}", ca.sha256)
        })
        .collect()
}

/// The one candidate whose fingerprint starts with `prefix`.
pub fn resolve(prefix: &ShaPrefix, candidates: &[Ca]) -> Result<Ca, Unresolved> {
    let matching: Vec<Ca> = candidates
        .iter()
        .filter(|ca| prefix.matches(&ca.sha256))
        .cloned()
        .collect();
    match <[Ca; 1]>::try_from(matching) {
        Ok([one]) => Ok(one),
        Err(none) if none.is_empty() => Err(Unresolved::None(prefix.clone())),
        Err(several) => Err(Unresolved::Ambiguous(prefix.clone(), several)),
    }
}

/// A certificate named on the command line: by its whole fingerprint, or by its first
/// digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Named {
    Sha(Sha),
    Prefix(ShaPrefix),
}

/// Each of `named` as a whole fingerprint, in order and each once, every prefix resolved
/// among `trusted` (what the sources make and the `file:` certificates), and only when none
/// of those matches among `reported` (what the nodes' reports name): a node writes its own
/// report, and a fingerprint it makes up must not make a prefix of a real CA ambiguous.
/// With them, the certificates they name, each once, to name them by (one that only a
/// report names, a CA no source makes any more, by the name a report gives it).
pub fn resolve_all(
    named: &[Named],
    trusted: &[Ca],
    reported: &[Ca],
) -> Result<(Vec<Sha>, Vec<Ca>), Unresolved> {
    let mut shas: Vec<Sha> = Vec::with_capacity(named.len());
    let mut found: Vec<Ca> = Vec::new();
    for one in named {
        let (sha, ca) = match one {
            Named::Sha(sha) => (
                sha.clone(),
                trusted
                    .iter()
                    .chain(reported)
                    .find(|c| c.sha256 == *sha)
                    .cloned(),
            ),
            Named::Prefix(prefix) => {
                let ca = match resolve(prefix, trusted) {
                    Err(Unresolved::None(_)) => resolve(prefix, reported)?,
                    found => found?,
                };
                (ca.sha256.clone(), Some(ca))
            }
        };
        if let Some(ca) = ca
            && !found.contains(&ca)
        {
            found.push(ca);
        }
        if !shas.contains(&sha) {
            shas.push(sha);
        }
    }
    Ok((shas, found))
}

/// The certificates only the reports name, each once: every fingerprint a report holds or
/// holds back, in any of its targets, that is not among `trusted`, named as a report names
/// it (for a list of the ambiguous ones).
pub fn reported<'a>(trusted: &[Ca], reports: impl IntoIterator<Item = &'a Held>) -> Vec<Ca> {
    let mut out: Vec<Ca> = Vec::new();
    let mut add = |ca: Ca| match out.iter_mut().find(|c| c.sha256 == ca.sha256) {
        Some(known) if known.subject_cn.is_none() => *known = ca,
        Some(_) => {}
        None if trusted.iter().any(|c| c.sha256 == ca.sha256) => {}
        None => out.push(ca),
    };
    for held in reports {
        for target in &held.targets {
            for sha in target.certs.iter().chain(&target.held_back) {
                add(held.name(sha));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::verdict::testing::{ca, sha};

    fn prefix(text: &str) -> ShaPrefix {
        ShaPrefix::parse(text).unwrap_or_else(|| panic!("{text} is a prefix"))
    }

    /// A fingerprint that starts with `head` and goes on with `rest`.
    fn fp(head: &str, rest: char) -> Sha {
        let text: String = head
            .chars()
            .chain(std::iter::repeat(rest))
            .take(64)
            .collect();
        Sha::parse(&text).unwrap()
    }

    fn named(sha: Sha, cn: &str) -> Ca {
        Ca {
            sha256: sha,
            subject_cn: Some(cn.into()),
            serial_number: None,
        }
    }

    #[test]
    fn a_prefix_is_twelve_to_sixty_three_hex_digits_in_any_of_the_printed_forms() {
        let twelve = "7cd38cef4711";
        for text in [
            twelve,
            "7CD38CEF4711",
            "sha256:7cd38cef4711",
            "SHA256:7cd38cef4711",
            "sha256:7cd38cef4711...",
            "7cd38cef4711…",
            " 7C:D3:8C:EF:47:11 ",
            "7C:D3:8C:EF:47:11:",
        ] {
            assert_eq!(prefix(text).as_str(), twelve, "{text:?}");
        }
        assert_eq!(prefix(&"a".repeat(63)).as_str().len(), 63);
        for bad in [
            "7cd38cef471",
            "sha256:7cd38cef471...",
            "",
            "...",
            "7cd38cef471g",
            "7cd38cef4711 x",
            "md5:7cd38cef4711",
            "7cd38cef4711....",
            "7cd38cef4711.",
        ] {
            assert_eq!(ShaPrefix::parse(bad), None, "{bad:?}");
        }
        // Sixty-four digits are a whole fingerprint, not a prefix.
        assert_eq!(ShaPrefix::parse(&"a".repeat(64)), None);
        assert_eq!(prefix(twelve).to_string(), "sha256:7cd38cef4711");
        // No panic on text whose 7th byte is inside a character.
        assert_eq!(ShaPrefix::parse("sha256é7cd38cef4711"), None);
    }

    #[test]
    fn a_prefix_names_the_one_certificate_that_starts_so() {
        let a = named(fp("7cd38cef4711aa", '0'), "signer-a");
        let b = named(fp("7cd38cef4711bb", '0'), "signer-b");
        let c = Ca::unnamed(fp("0123456789ab", 'f'));
        let all = [a.clone(), b.clone(), c.clone()];
        assert_eq!(resolve(&prefix("7cd38cef4711a"), &all), Ok(a.clone()));
        assert_eq!(resolve(&prefix("7cd38cef4711bb"), &all), Ok(b.clone()));
        assert_eq!(resolve(&prefix("0123456789AB"), &all), Ok(c.clone()));
        // Every digit given counts, not only the first twelve.
        assert_eq!(
            resolve(&prefix("0123456789abe"), &all),
            Err(Unresolved::None(prefix("0123456789abe")))
        );
        let ambiguous = resolve(&prefix("7cd38cef4711"), &all).unwrap_err();
        assert_eq!(
            ambiguous,
            Unresolved::Ambiguous(prefix("7cd38cef4711"), vec![a.clone(), b.clone()])
        );
        let said = ambiguous.to_string();
        assert_eq!(
            said,
            format!(
                "sha256:7cd38cef4711 names 2 certificates, give more of its digits:\n  signer-a  {}\n  signer-b  {}",
                a.sha256, b.sha256
            )
        );
        let none = resolve(&prefix("ffffffffffff"), &all).unwrap_err();
        assert!(
            none.to_string().starts_with(
                "no certificate that the sources make or a node's report names has a fingerprint starting with sha256:ffffffffffff: "
            ),
            "{none}"
        );
        assert_eq!(
            resolve(&prefix("ffffffffffff"), &[]),
            Err(Unresolved::None(prefix("ffffffffffff")))
        );
        // An unnamed candidate and a name from outside, escaped.
        let odd = named(fp("0123456789ab0", '1'), "x\u{1b}[2J");
        let e = resolve(&prefix("0123456789ab"), &[c.clone(), odd.clone()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "sha256:0123456789ab names 2 certificates, give more of its digits:\n  (no name known)  {}\n  x\\u{{1b}}[2J  {}",
                c.sha256, odd.sha256
            )
        );
    }

    #[test]
    fn every_prefix_of_a_list_is_resolved_in_order_and_each_certificate_kept_once() {
        let a = named(fp("7cd38cef4711aa", '0'), "signer-a");
        let b = Ca::unnamed(fp("0123456789ab", 'f'));
        let candidates = [a.clone(), b.clone()];
        let list = [
            Named::Prefix(prefix("0123456789ab")),
            Named::Sha(a.sha256.clone()),
            Named::Prefix(prefix("7cd38cef4711")),
            Named::Sha(sha('e')),
        ];
        assert_eq!(
            resolve_all(&list, &candidates, &[]),
            Ok((
                vec![b.sha256.clone(), a.sha256.clone(), sha('e')],
                vec![b.clone(), a.clone()]
            ))
        );
        // A whole fingerprint needs no candidate, and takes the name one gives it.
        assert_eq!(
            resolve_all(&[Named::Sha(sha('e'))], &[], &[]),
            Ok((vec![sha('e')], vec![]))
        );
        assert_eq!(
            resolve_all(&[Named::Sha(a.sha256.clone())], &candidates, &[]),
            Ok((vec![a.sha256.clone()], vec![a.clone()]))
        );
        assert_eq!(
            resolve_all(
                &[Named::Sha(sha('e')), Named::Prefix(prefix("ffffffffffff"))],
                &candidates,
                &[]
            ),
            Err(Unresolved::None(prefix("ffffffffffff")))
        );
    }

    #[test]
    fn a_report_never_makes_a_trusted_prefix_ambiguous() {
        let a = named(fp("7cd38cef4711aa", '0'), "signer-a");
        // A node's made-up fingerprint with a's first digits, and a withdrawn CA only the
        // reports still name.
        let twin = named(fp("7cd38cef4711ab", '1'), "made-up");
        let old = named(fp("0123456789ab", '2'), "withdrawn");
        let trusted = [a.clone()];
        let reported = [twin.clone(), old.clone()];
        let list = [Named::Prefix(prefix("7cd38cef4711"))];
        assert_eq!(
            resolve_all(&list, &trusted, &reported),
            Ok((vec![a.sha256.clone()], vec![a.clone()])),
            "the trusted one, whatever a report names"
        );
        // Only a report names it: resolved among the reports, named as a report names it.
        let list = [
            Named::Prefix(prefix("0123456789ab")),
            Named::Sha(twin.sha256.clone()),
        ];
        assert_eq!(
            resolve_all(&list, &trusted, &reported),
            Ok((
                vec![old.sha256.clone(), twin.sha256.clone()],
                vec![old.clone(), twin.clone()]
            ))
        );
        // Among the reports, two that match are still ambiguous; none is none.
        let twins = [twin.clone(), named(fp("7cd38cef4711ac", '3'), "other")];
        assert!(matches!(
            resolve_all(&list[..1], &[], &twins),
            Err(Unresolved::None(_))
        ));
        assert!(matches!(
            resolve_all(&[Named::Prefix(prefix("7cd38cef4711"))], &[], &twins),
            Err(Unresolved::Ambiguous(_, several)) if several.len() == 2
        ));
    }

    #[test]
    fn the_reported_ones_are_every_fingerprint_only_a_report_names_each_once() {
        use crate::fleet::held::{Kind, TargetHeld};
        let entry = |certs: Vec<Sha>, held_back: Vec<Sha>| TargetHeld {
            path: "/p".into(),
            kind: Kind::Bundle,
            sha256: None,
            certs,
            count: None,
            in_sync: true,
            why: None,
            held_back,
            restart: None,
        };
        let report = |targets: Vec<TargetHeld>| Held {
            v: 1,
            agent: "a".into(),
            changed: "t".into(),
            targets,
            names: Default::default(),
        };
        let mut one = report(vec![
            entry(vec![sha('a'), sha('c')], vec![]),
            entry(vec![sha('d')], vec![sha('e')]),
        ]);
        one.names.insert(sha('c'), "named-by-node".into());
        one.names.insert(sha('a'), "node-says-a".into());
        let two = report(vec![entry(vec![sha('c'), sha('f')], vec![])]);
        let sources = [ca('a', "signer-a"), ca('b', "signer-b")];
        let all = reported(&sources, [&one, &two]);
        assert_eq!(
            all,
            vec![
                Ca {
                    sha256: sha('c'),
                    subject_cn: Some("named-by-node".into()),
                    serial_number: None
                },
                Ca::unnamed(sha('d')),
                Ca::unnamed(sha('e')),
                Ca::unnamed(sha('f')),
            ]
        );
        // An unnamed candidate takes the name a later report gives it.
        let mut three = report(vec![entry(vec![sha('f')], vec![])]);
        three.names.insert(sha('f'), "f-name".into());
        let all = reported(&[], [&two, &three]);
        assert_eq!(all[1].subject_cn.as_deref(), Some("f-name"));
        assert_eq!(all.len(), 2);
        // A trusted one is never among them.
        let all = reported(&[ca('c', "from-sources")], [&one]);
        assert!(all.iter().all(|c| c.sha256 != sha('c')), "{all:?}");
        assert_eq!(all.len(), 3);
    }
}
