//! Registry names: from the untrusted raw name of an entry (a ConfigMap key, the `file` of a
//! ControllerConfig list entry, the stem of a `dir:` file) to the one directory under DIR
//! that a container runtime looks in for that registry, `host[:port]`.
//!
//! The mapping is the upstream one: every `..` is read as `:` (a ConfigMap key cannot hold
//! a `:`), left to right, as the node config daemon's certificate writer does it
//! (openshift/machine-config-operator `pkg/daemon/certificate_writer.go`:
//! `caFile := strings.ReplaceAll(CA.File, "..", ":")`). The older `node-ca` DaemonSet
//! (openshift/cluster-image-registry-operator `bindata/nodecadaemon.yaml`) maps only the
//! last `..` (`sed -r 's/(.*)\.\./\1:/'`); the two agree on every DNS name and IPv4 address,
//! which never hold `..`. The OpenShift documentation of `additionalTrustedCA` gives the
//! key form `registry-with-port.example.com..5000` ("`:` should be replaced with `..`").
//!
//! IPv6: a container image reference names an IPv6 registry in brackets
//! (`[fd00::1]:5000/ns/image`), and containers/image looks for its certificates in
//! `certs.d/` joined with that `host:port` as it is (`dockerCertDir`: `filepath.Join(
//! hostCertDir, hostPort)`), so the directory is `[fd00::1]:5000`. A ConfigMap key cannot
//! hold one (keys are `[-._a-zA-Z0-9]`, no brackets), so an IPv6 registry can only come
//! from a ControllerConfig list entry or a `dir:` file, written with every `:` as `..` as
//! upstream maps it (`[fd00....1]..5000`), or with its colons as they are
//! (`[fd00::1]:5000`): a `:` in a raw name is kept, so both spellings name the same
//! directory. The address is kept as written, not rewritten to its shortest form: the
//! runtime looks up the spelling of the image reference, byte for byte. A bare IPv6 address
//! without brackets is refused, as an image reference refuses it (its last group would be
//! read as a port).
//!
//! Length: at most 253 characters, counted on the raw name, before the mapping. 253 is both
//! the longest ConfigMap key and the longest DNS name; the mapping only shortens a name, so
//! the directory name fits too (and far within the 255 bytes a file name may have). One
//! limit for every kind of source keeps a name that works in a `dir:` source working when
//! moved into a ConfigMap, and bounds the work spent on a hostile name before anything else
//! is looked at. The price: a 253-character host with a port cannot be named, nor can it
//! be in a ConfigMap, which is where registry names come from.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Component, Path};

use crate::text::escape;

/// The longest raw name, in characters: the longest ConfigMap key and DNS name.
pub const MAX_NAME_CHARS: usize = 253;

/// How many characters of a refused name a message shows; the rest is counted.
const SHOWN_CHARS: usize = 64;

/// A registry, as the directory `DIR/<host[:port]>` that holds its `ca.crt`.
///
/// Two names are the same registry when they map to the same directory, whatever their raw
/// spelling (`host..5000` and `host:5000`): equality, order and hash are those of the
/// directory name, compared byte for byte (`Quay.io` and `quay.io` are two directories, as
/// the runtime's lookup sees them). The raw name is kept for messages.
#[derive(Clone)]
pub struct RegistryName {
    raw: String,
    dir: String,
    /// Where `:port` starts in `dir`, if there is a port.
    port_at: Option<usize>,
}

impl RegistryName {
    /// Reads an untrusted raw name (see the module doc for the rules and why).
    pub fn parse(raw: &str) -> Result<RegistryName, NameError> {
        let fail = |problem| NameError {
            raw: raw.to_string(),
            problem,
        };
        if raw.is_empty() {
            return Err(fail(NameProblem::Empty));
        }
        let chars = raw.chars().count();
        if chars > MAX_NAME_CHARS {
            return Err(fail(NameProblem::TooLong { chars }));
        }
        if let Some(c) = raw.chars().find(|c| c.is_control()) {
            return Err(fail(NameProblem::Control(c)));
        }
        if raw.contains('/') {
            return Err(fail(NameProblem::Slash));
        }
        if raw.starts_with('.') {
            return Err(fail(NameProblem::LeadingDot));
        }
        let dir = raw.replace("..", ":");
        // Already implied by the rules above and below (no '/', no leading '.', a host is
        // never "." or ".."); checked again on the very name that will be joined to DIR,
        // because a mistake here would write outside it.
        if !is_one_plain_component(&dir) {
            return Err(fail(NameProblem::NotOneDirectory { dir }));
        }
        let port_at = host_port(&dir).map_err(|why| {
            fail(NameProblem::NotHostPort {
                dir: dir.clone(),
                why,
            })
        })?;
        Ok(RegistryName {
            raw: raw.to_string(),
            dir,
            port_at,
        })
    }

    /// The raw name as the source spells it (`registry.local..5000`).
    pub fn raw(&self) -> &str {
        &self.raw
    }

    /// The directory name under DIR (`registry.local:5000`).
    pub fn dir(&self) -> &str {
        &self.dir
    }

    /// The host: a DNS name, an IPv4 address or a bracketed IPv6 address.
    pub fn host(&self) -> &str {
        &self.dir[..self.port_at.unwrap_or(self.dir.len())]
    }

    pub fn port(&self) -> Option<u16> {
        self.port_at.map(|at| {
            self.dir[at + 1..]
                .parse()
                .expect("a parsed port is 1-65535")
        })
    }
}

impl fmt::Display for RegistryName {
    /// The directory name: what an operator sees under DIR.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.dir)
    }
}

impl fmt::Debug for RegistryName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.raw == self.dir {
            write!(f, "RegistryName({:?})", self.dir)
        } else {
            write!(f, "RegistryName({:?} from {:?})", self.dir, self.raw)
        }
    }
}

impl PartialEq for RegistryName {
    fn eq(&self, other: &Self) -> bool {
        self.dir == other.dir
    }
}

impl Eq for RegistryName {}

impl Hash for RegistryName {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.dir.hash(state);
    }
}

impl PartialOrd for RegistryName {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for RegistryName {
    fn cmp(&self, other: &Self) -> Ordering {
        self.dir.cmp(&other.dir)
    }
}

/// A raw name that is not a registry. The message names the raw name, escaped and cut to a
/// readable length, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("registry name {}: {problem}", shown(.raw))]
pub struct NameError {
    /// The raw name, as given (unescaped: escape it before showing it anywhere).
    pub raw: String,
    pub problem: NameProblem,
}

impl NameError {
    /// The `reason` label of the error counters.
    pub fn reason(&self) -> &'static str {
        "invalid_registry_name"
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameProblem {
    #[error("the name is empty")]
    Empty,
    #[error(
        "{chars} characters, more than the {MAX_NAME_CHARS} a ConfigMap key or a host name can have"
    )]
    TooLong { chars: usize },
    #[error("it holds a control character (U+{:04X})", *.0 as u32)]
    Control(char),
    #[error("it is not UTF-8, so not a host name")]
    NotUtf8,
    #[error("it holds a '/': a registry is one directory under DIR, never a path")]
    Slash,
    #[error("it starts with '.': a hidden or relative directory is not a registry")]
    LeadingDot,
    #[error("read as {}, it is not one plain directory name", quoted(.dir))]
    NotOneDirectory { dir: String },
    #[error(
        "read as {} (each \"..\" stands for ':'), it is not a host[:port]: {why}",
        quoted(.dir)
    )]
    NotHostPort { dir: String, why: String },
}

/// A name for a message: escaped, quoted, and cut after [`SHOWN_CHARS`] characters.
fn shown(raw: &str) -> String {
    let chars = raw.chars().count();
    if chars <= SHOWN_CHARS {
        return quoted(raw);
    }
    let head: String = raw.chars().take(SHOWN_CHARS).collect();
    format!("{}... ({chars} characters)", quoted(&head))
}

fn quoted(text: &str) -> String {
    format!("\"{}\"", escape(text))
}

fn is_one_plain_component(dir: &str) -> bool {
    let mut components = Path::new(dir).components();
    matches!(
        (components.next(), components.next()),
        (Some(Component::Normal(c)), None) if c == dir
    )
}

/// Checks `dir` as `host[:port]`; returns where `:port` starts, if it has one.
fn host_port(dir: &str) -> Result<Option<usize>, String> {
    if let Some(inner) = dir.strip_prefix('[') {
        let close = inner
            .find(']')
            .ok_or("'[' opens an IPv6 address that no ']' closes")?;
        let address = &inner[..close];
        address.parse::<Ipv6Addr>().map_err(|_| {
            format!(
                "{} is not an IPv6 address (a zone such as %eth0 cannot be named)",
                quoted(address)
            )
        })?;
        let rest = &inner[close + 1..];
        if rest.is_empty() {
            return Ok(None);
        }
        let port = rest
            .strip_prefix(':')
            .ok_or("only :PORT may follow a bracketed IPv6 address")?;
        check_port(port)?;
        return Ok(Some(close + 2));
    }
    let (host, port_at) = match dir.find(':') {
        Some(at) if dir[at + 1..].contains(':') => {
            let ipv6 = dir.parse::<Ipv6Addr>().is_ok()
                || dir
                    .rsplit_once(':')
                    .is_some_and(|(address, _)| address.parse::<Ipv6Addr>().is_ok());
            let hint = if ipv6 {
                "an IPv6 address is written in brackets, as in an image reference: [fd00::1] or [fd00::1]:5000 (in a name, [fd00....1]..5000)"
            } else {
                "it holds more than one ':' (in the raw name, more than one \"..\")"
            };
            return Err(hint.to_string());
        }
        Some(at) => {
            check_port(&dir[at + 1..])?;
            (&dir[..at], Some(at))
        }
        None => (dir, None),
    };
    check_host(host)?;
    Ok(port_at)
}

fn check_port(port: &str) -> Result<(), String> {
    if port.is_empty() {
        return Err("the port after ':' is empty".to_string());
    }
    let ok = port.bytes().all(|b| b.is_ascii_digit())
        && !port.starts_with('0')
        && port.parse::<u16>().is_ok();
    ok.then_some(()).ok_or_else(|| {
        format!(
            "port {} is not a number from 1 to 65535 written without leading zeros",
            quoted(port)
        )
    })
}

/// A DNS name (RFC 1123 labels) or an IPv4 address. A name whose last label is all digits
/// is taken for an IPv4 address (no top-level domain is numeric), so `10.0.0.300` is
/// refused rather than read as a host name.
fn check_host(host: &str) -> Result<(), String> {
    if host.is_empty() {
        return Err("the host is empty".to_string());
    }
    let last = host.rsplit('.').next().unwrap_or(host);
    if !last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()) {
        return host.parse::<Ipv4Addr>().map(drop).map_err(|_| {
            format!(
                "{} is not an IPv4 address (four numbers 0-255, no leading zeros), and a host name cannot end in a number",
                quoted(host)
            )
        });
    }
    for label in host.split('.') {
        check_label(label)?;
    }
    Ok(())
}

fn check_label(label: &str) -> Result<(), String> {
    if label.is_empty() {
        return Err(
            "a DNS label is empty (a '.' at an end, or three dots in a row in the raw name)"
                .to_string(),
        );
    }
    if label.len() > 63 {
        return Err(format!(
            "DNS label {} is {} characters, more than 63",
            shown(label),
            label.len()
        ));
    }
    if let Some(c) = label
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-'))
    {
        return Err(format!(
            "DNS label {} holds {}: a label is letters, digits and '-' (write an international name in its xn-- form)",
            quoted(label),
            quoted(&c.to_string())
        ));
    }
    if label.starts_with('-') || label.ends_with('-') {
        return Err(format!(
            "DNS label {} starts or ends with '-'",
            quoted(label)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(raw: &str) -> String {
        match RegistryName::parse(raw) {
            Ok(name) => name.dir().to_string(),
            Err(e) => panic!("{raw:?} refused: {e}"),
        }
    }

    fn refused(raw: &str) -> String {
        match RegistryName::parse(raw) {
            Ok(name) => panic!("{raw:?} accepted as {name:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn real_registry_names_map_to_their_directories() {
        for (raw, expected) in [
            ("quay.io", "quay.io"),
            ("registry.example.com", "registry.example.com"),
            (
                "image-registry.openshift-image-registry.svc..5000",
                "image-registry.openshift-image-registry.svc:5000",
            ),
            (
                "image-registry.openshift-image-registry.svc.cluster.local..5000",
                "image-registry.openshift-image-registry.svc.cluster.local:5000",
            ),
            ("registry.local..5000", "registry.local:5000"),
            ("localhost..5000", "localhost:5000"),
            ("localhost", "localhost"),
            ("10.0.0.1..443", "10.0.0.1:443"),
            ("registry.local:5000", "registry.local:5000"),
            ("[fd00::1]", "[fd00::1]"),
            ("[fd00....1]..5000", "[fd00::1]:5000"),
            ("[fd00::1]:5000", "[fd00::1]:5000"),
            ("[2001..db8....ff00..42..8329]", "[2001:db8::ff00:42:8329]"),
            ("[....ffff..10.0.0.1]..443", "[::ffff:10.0.0.1]:443"),
            ("Registry.Example.COM", "Registry.Example.COM"),
            ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ] {
            assert_eq!(dir(raw), expected, "{raw}");
        }
    }

    #[test]
    fn host_and_port_are_read_apart() {
        let name = RegistryName::parse("registry.local..5000").unwrap();
        assert_eq!(
            (name.raw(), name.host(), name.port()),
            ("registry.local..5000", "registry.local", Some(5000))
        );
        assert_eq!(name.to_string(), "registry.local:5000");
        let v6 = RegistryName::parse("[fd00....1]..65535").unwrap();
        assert_eq!((v6.host(), v6.port()), ("[fd00::1]", Some(65535)));
        let bare = RegistryName::parse("quay.io").unwrap();
        assert_eq!((bare.host(), bare.port()), ("quay.io", None));
    }

    #[test]
    fn two_spellings_of_one_directory_are_one_registry() {
        let key = RegistryName::parse("registry.local..5000").unwrap();
        let file = RegistryName::parse("registry.local:5000").unwrap();
        assert_eq!(key, file);
        assert_ne!(key.raw(), file.raw());
        // Case is kept: the runtime's lookup is byte for byte.
        assert_ne!(
            RegistryName::parse("Quay.io").unwrap(),
            RegistryName::parse("quay.io").unwrap()
        );
    }

    #[test]
    fn names_that_could_leave_the_directory_are_refused_and_say_why() {
        for (raw, says) in [
            ("", "registry name \"\": the name is empty"),
            (
                "../../etc",
                "registry name \"../../etc\": it holds a '/': a registry is one directory under DIR, never a path",
            ),
            ("a/b", "\"a/b\": it holds a '/'"),
            ("quay.io/", "it holds a '/'"),
            ("/etc", "it holds a '/'"),
            (
                ".hidden",
                "\".hidden\": it starts with '.': a hidden or relative directory is not a registry",
            ),
            ("..", "it starts with '.'"),
            ("...", "it starts with '.'"),
            ("..5000", "it starts with '.'"),
            (
                "a\0b",
                "\"a\\u{0}b\": it holds a control character (U+0000)",
            ),
            (
                "quay.io\n2026 ERROR forged",
                "\"quay.io\\u{a}2026 ERROR forged\": it holds a control character (U+000A)",
            ),
            ("evil\u{1b}[31m", "\"evil\\u{1b}[31m\""),
        ] {
            let message = refused(raw);
            assert!(message.contains(says), "{raw:?}: {message}");
        }
    }

    #[test]
    fn a_name_longer_than_253_characters_is_refused_and_shown_cut_short() {
        let long = "a".repeat(300);
        let message = refused(&long);
        assert_eq!(
            message,
            format!(
                "registry name \"{}\"... (300 characters): 300 characters, more than the 253 a ConfigMap key or a host name can have",
                "a".repeat(64)
            )
        );
        // 253 is the limit on the raw name: a host of 63-character labels up to it passes.
        let label = "a".repeat(63);
        let longest = format!("{label}.{label}.{label}.{}", "b".repeat(61));
        assert_eq!(longest.len(), 253);
        assert_eq!(dir(&longest), longest);
        assert!(refused(&format!("{longest}..5")).contains("256 characters"));
        // Counted before the mapping: this directory name would be 253 characters, but the
        // raw name is 254.
        let host = format!("{label}.{label}.{label}.{}", "c".repeat(55));
        assert_eq!(host.len(), 247);
        let raw = format!("{host}..50000");
        assert_eq!((raw.len(), raw.replace("..", ":").len()), (254, 253));
        assert!(
            refused(&raw).contains("254 characters, more than the 253"),
            "{raw}"
        );
        assert_eq!(dir(&format!("{host}..5000")), format!("{host}:5000"));
    }

    #[test]
    fn names_that_are_not_host_and_port_are_refused_and_say_why() {
        for (raw, says) in [
            ("quay.io..", "the port after ':' is empty"),
            ("quay.io..0", "port \"0\" is not a number from 1 to 65535"),
            ("quay.io..65536", "port \"65536\""),
            ("quay.io..05000", "without leading zeros"),
            ("quay.io..http", "port \"http\""),
            ("quay.io...5000", "port \".5000\""),
            ("a..b..c", "more than one ':'"),
            ("fd00....1", "an IPv6 address is written in brackets"),
            ("fd00....1..5000", "an IPv6 address is written in brackets"),
            ("[fd00....1", "no ']' closes"),
            ("[fd00....1]5000", "only :PORT may follow"),
            ("[fe80....1%eth0]", "is not an IPv6 address"),
            ("[nope]", "\"nope\" is not an IPv6 address"),
            (
                "under_score.example",
                "DNS label \"under_score\" holds \"_\"",
            ),
            ("b\u{fc}cher.example", "holds \"\u{fc}\""),
            ("-lead.example", "starts or ends with '-'"),
            ("trail-.example", "starts or ends with '-'"),
            ("quay.io.", "a DNS label is empty"),
            ("a...b", "read as \"a:.b\""),
            ("10.0.0.300", "is not an IPv4 address"),
            ("10.0.0.1.5", "is not an IPv4 address"),
            ("010.0.0.1", "is not an IPv4 address"),
            ("bidi\u{202e}txt.io", "\"bidi\\u{202e}txt.io\""),
        ] {
            let message = refused(raw);
            assert!(message.contains(says), "{raw:?}: {message}");
        }
        let long_label = format!("{}.io", "l".repeat(64));
        assert!(refused(&long_label).contains("is 64 characters, more than 63"));
    }

    #[test]
    fn every_refusal_has_the_same_reason_label() {
        let error = RegistryName::parse("a/b").unwrap_err();
        assert_eq!(error.reason(), "invalid_registry_name");
        assert_eq!(error.raw, "a/b");
        assert_eq!(error.problem, NameProblem::Slash);
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    /// What the agent joins to DIR must stay inside it, whatever the name was.
    fn stays_inside(name: &RegistryName) -> Result<(), TestCaseError> {
        let dir = name.dir();
        prop_assert!(!dir.is_empty() && dir.len() <= MAX_NAME_CHARS);
        prop_assert!(!dir.contains('/') && !dir.contains('\0'));
        prop_assert!(!dir.starts_with('.'));
        prop_assert!(!dir.chars().any(char::is_control));
        prop_assert!(is_one_plain_component(dir));
        let joined = Path::new("/etc/docker/certs.d").join(dir);
        prop_assert_eq!(joined.parent(), Some(Path::new("/etc/docker/certs.d")));
        // The directory name read back (from the record, from a listing) is the same
        // registry.
        prop_assert_eq!(&RegistryName::parse(dir).unwrap(), name);
        Ok(())
    }

    fn label() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9]([a-zA-Z0-9-]{0,20}[a-zA-Z0-9])?"
    }

    fn dns_name() -> impl Strategy<Value = String> {
        // A letter last, so that the last label is never all digits.
        (prop::collection::vec(label(), 0..4), "[a-z]{1,6}").prop_map(|(labels, top)| {
            let mut parts = labels;
            parts.push(top);
            parts.join(".")
        })
    }

    fn host() -> impl Strategy<Value = String> {
        prop_oneof![
            dns_name(),
            any::<[u8; 4]>().prop_map(|o| Ipv4Addr::from(o).to_string()),
            any::<[u16; 8]>().prop_map(|s| format!("[{}]", Ipv6Addr::from(s))),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn any_string_is_refused_or_names_one_directory_inside_dir(raw in any::<String>()) {
            if let Ok(name) = RegistryName::parse(&raw) {
                stays_inside(&name)?;
            }
        }

        #[test]
        fn path_like_strings_are_refused_or_stay_inside(raw in "[./a-z:\\[\\]0-9\0-]{0,40}") {
            if let Ok(name) = RegistryName::parse(&raw) {
                stays_inside(&name)?;
            }
        }

        #[test]
        fn a_host_and_port_written_as_a_key_name_their_directory(
            host in host(),
            port in prop::option::of(1u16..),
        ) {
            let dir = match port {
                Some(port) => format!("{host}:{port}"),
                None => host.clone(),
            };
            prop_assume!(dir.chars().count() <= MAX_NAME_CHARS);
            // Every ':' written as "..", as a ConfigMap key must, and as it is.
            let key = dir.replace(':', "..");
            prop_assume!(key.chars().count() <= MAX_NAME_CHARS);
            let from_key = RegistryName::parse(&key).unwrap();
            let from_dir = RegistryName::parse(&dir).unwrap();
            prop_assert_eq!(from_key.dir(), dir.as_str());
            prop_assert_eq!(&from_key, &from_dir);
            prop_assert_eq!(from_key.host(), host.as_str());
            prop_assert_eq!(from_key.port(), port);
            // A directory name read back is the same registry.
            prop_assert_eq!(RegistryName::parse(from_key.dir()).unwrap(), from_key.clone());
            stays_inside(&from_key)?;
        }
    }
}
