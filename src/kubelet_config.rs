//! Whether the kubelet uses the bundle this agent keeps. The kubelet verifies clients
//! against the file its KubeletConfiguration names in `authentication.x509.clientCAFile`;
//! until that is the managed file (a kubeadm node keeps `/etc/kubernetes/pki/ca.crt` there
//! until it is changed), every metric of the agent is green while the kubelet ignores the
//! file. So the agent reads the kubelet's config too, from where kubeadm
//! (`/var/lib/kubelet/config.yaml`) and OpenShift (`/etc/kubernetes/kubelet.conf`) write
//! it, or from the path `--kubelet-config` names, and says what it found.
//!
//! What the config says is judged by pure functions ([`client_ca_file`], [`judge`]); the
//! reading runs on a thread of its own ([`Reader`]), so that a kubelet config on a hung
//! mount never stalls the loop that keeps the bundle.

use std::fmt;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::sync::mpsc;

use crate::fsutil::{Links, open_regular, read_bounded};

/// Where the kubelet's config usually is, in the order they are tried: kubeadm's, then
/// OpenShift's. (On a kubeadm node `/etc/kubernetes/kubelet.conf` is the kubelet's
/// kubeconfig, not its config: a file of another kind is passed over.)
pub const DEFAULT_PATHS: [&str; 2] = [
    "/var/lib/kubelet/config.yaml",
    "/etc/kubernetes/kubelet.conf",
];

/// A kubelet config is a few kilobytes; more is not one.
const MAX_BYTES: usize = 1024 * 1024;

/// The paths to look at: `configured` (a flag's value), else the usual ones. An empty
/// path counts as none.
pub fn paths_for(configured: Option<&Path>) -> Vec<PathBuf> {
    match configured.filter(|p| !p.as_os_str().is_empty()) {
        Some(path) => vec![path.to_path_buf()],
        None => DEFAULT_PATHS.iter().map(PathBuf::from).collect(),
    }
}

/// What the kubelet's config says about the managed bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeletUse {
    /// Its clientCAFile is the managed bundle.
    Uses { config: PathBuf },
    /// Its clientCAFile is another file: the kubelet ignores the managed bundle.
    Other {
        config: PathBuf,
        client_ca_file: PathBuf,
    },
    /// It cannot be told, and why (no config found, none set in it, not readable).
    Unknown(String),
    /// Not read yet: the first read has not come back.
    NotRead,
}

impl KubeletUse {
    /// 1 or 0 for the gauge; `None` when it is not known.
    pub fn uses(&self) -> Option<bool> {
        match self {
            KubeletUse::Uses { .. } => Some(true),
            KubeletUse::Other { .. } => Some(false),
            KubeletUse::Unknown(_) | KubeletUse::NotRead => None,
        }
    }

    /// The `kubelet-uses-bundle` check: `None` when the kubelet uses `bundle`, else why not
    /// or why it is not known.
    pub fn problem(&self, bundle: &str) -> Option<String> {
        match self {
            KubeletUse::Uses { .. } => None,
            KubeletUse::Other {
                config,
                client_ca_file,
            } => Some(format!(
                "the kubelet's config {} sets authentication.x509.clientCAFile to {}, not {bundle}: the kubelet verifies clients against that file and ignores the bundle this agent keeps; set clientCAFile to {bundle} and restart the kubelet",
                config.display(),
                client_ca_file.display()
            )),
            KubeletUse::Unknown(why) => Some(format!("not known: {why}")),
            KubeletUse::NotRead => {
                Some("not known yet: the kubelet's config has not been read yet".to_string())
            }
        }
    }
}

impl fmt::Display for KubeletUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KubeletUse::Uses { config } => write!(
                f,
                "the kubelet uses the bundle (authentication.x509.clientCAFile in {})",
                config.display()
            ),
            KubeletUse::Other {
                config,
                client_ca_file,
            } => write!(
                f,
                "the kubelet does not use the bundle: {} names {}",
                config.display(),
                client_ca_file.display()
            ),
            KubeletUse::Unknown(why) => {
                write!(f, "whether the kubelet uses the bundle is not known: {why}")
            }
            KubeletUse::NotRead => f.write_str("the kubelet's config has not been read yet"),
        }
    }
}

/// The fields of a KubeletConfiguration read here; every other field is ignored.
#[derive(Debug, Default, Deserialize)]
struct Document {
    kind: Option<String>,
    authentication: Option<Authentication>,
}

#[derive(Debug, Default, Deserialize)]
struct Authentication {
    x509: Option<X509>,
}

#[derive(Debug, Default, Deserialize)]
struct X509 {
    #[serde(rename = "clientCAFile")]
    client_ca_file: Option<String>,
}

/// What a config file holds, as far as this check goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A KubeletConfiguration, with its clientCAFile if it sets one.
    Kubelet(Option<String>),
    /// A document of another kind (a kubeconfig is `Config`), or of none.
    OtherKind(Option<String>),
}

/// Reads `authentication.x509.clientCAFile` from a KubeletConfiguration, in YAML or JSON.
pub fn client_ca_file(text: &[u8]) -> Result<Parsed, String> {
    let json = text.trim_ascii_start().starts_with(b"{");
    let document: Document = if json {
        serde_json::from_slice(text).map_err(|e| format!("not valid JSON: {e}"))?
    } else {
        let text = std::str::from_utf8(text).map_err(|_| "not UTF-8 text".to_string())?;
        // An empty document is no KubeletConfiguration, not an error.
        serde_saphyr::from_str::<Option<Document>>(text)
            .map_err(|e| format!("not valid YAML: {}", first_line(&e.to_string())))?
            .unwrap_or_default()
    };
    if document.kind.as_deref() != Some("KubeletConfiguration") {
        return Ok(Parsed::OtherKind(document.kind));
    }
    let file = document
        .authentication
        .and_then(|a| a.x509)
        .and_then(|x| x.client_ca_file)
        .filter(|f| !f.is_empty());
    Ok(Parsed::Kubelet(file))
}

/// A parser's message, on one line and bounded: it goes to a log line and a health page.
fn first_line(message: &str) -> String {
    let line = message.lines().next().unwrap_or_default().trim();
    match line.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &line[..cut]),
        None => line.to_string(),
    }
}

/// Judges a clientCAFile read from `config` against the managed `bundle`. A relative
/// clientCAFile is relative to the config's directory, as the kubelet reads it. The two
/// are the same file when their paths are the same once `.` and `..` are taken out, or
/// when `same_file` says so (a link to the bundle, another path to the same directory).
pub fn judge(
    config: &Path,
    client_ca_file: &str,
    bundle: &Path,
    same_file: impl Fn(&Path, &Path) -> bool,
) -> KubeletUse {
    let named = Path::new(client_ca_file);
    let named = match config.parent() {
        Some(dir) if named.is_relative() => dir.join(named),
        _ => named.to_path_buf(),
    };
    let (named, bundle) = (normalize(&named), normalize(bundle));
    if named == bundle || same_file(&named, &bundle) {
        KubeletUse::Uses {
            config: config.to_path_buf(),
        }
    } else {
        KubeletUse::Other {
            config: config.to_path_buf(),
            client_ca_file: named,
        }
    }
}

/// `path` made absolute (from the working directory) with `.` and `..` taken out, without
/// looking at the file system.
fn normalize(path: &Path) -> PathBuf {
    let absolute = if path.is_relative() {
        std::env::current_dir().unwrap_or_default().join(path)
    } else {
        path.to_path_buf()
    };
    let mut out = PathBuf::new();
    for component in absolute.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Two paths that lead to the same file (through links on the way).
fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Reads the first kubelet config found in `paths` and judges what it says about
/// `bundle`. Blocking I/O: [`Reader`] runs it off the loop. Only a regular file is opened
/// (never a FIFO), and no more than [`MAX_BYTES`] are read.
pub fn observe(paths: &[PathBuf], bundle: &Path) -> KubeletUse {
    let mut passed_over = Vec::new();
    for path in paths {
        let shown = path.display();
        let (file, _) = match open_regular(path, Links::Follow) {
            Ok(Ok(opened)) => opened,
            Ok(Err(kind)) => {
                return KubeletUse::Unknown(format!("{shown} is {kind}, not a regular file"));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                passed_over.push(format!("no file at {shown}"));
                continue;
            }
            Err(e) => return KubeletUse::Unknown(format!("cannot read {shown}: {e}")),
        };
        let text = match read_bounded(&file, MAX_BYTES) {
            Ok(text) if text.len() > MAX_BYTES => {
                return KubeletUse::Unknown(format!(
                    "{shown} is larger than {MAX_BYTES} bytes: not a kubelet config"
                ));
            }
            Ok(text) => text,
            Err(e) => return KubeletUse::Unknown(format!("cannot read {shown}: {e}")),
        };
        match client_ca_file(&text) {
            Ok(Parsed::Kubelet(Some(file))) => return judge(path, &file, bundle, same_file),
            Ok(Parsed::Kubelet(None)) => {
                return KubeletUse::Unknown(format!(
                    "{shown} sets no authentication.x509.clientCAFile (the kubelet may have it from its --client-ca-file flag)"
                ));
            }
            Ok(Parsed::OtherKind(kind)) => passed_over.push(format!(
                "{shown} is {}, not a KubeletConfiguration",
                kind.map_or("a document without a kind".to_string(), |k| format!(
                    "a {k}"
                ))
            )),
            Err(problem) => return KubeletUse::Unknown(format!("{shown} is {problem}")),
        }
    }
    let hint = if paths.len() == 1 {
        String::new()
    } else {
        " (pass --kubelet-config with the path of the kubelet's --config)".to_string()
    };
    KubeletUse::Unknown(format!(
        "no kubelet config found: {}{hint}",
        passed_over.join("; ")
    ))
}

/// Reads the kubelet's config on a thread of its own when asked, and hands back what it
/// found through a channel the loop reads. One read at a time: a read that has not come
/// back within [`STUCK_AFTER`] is reported as such, and no other is started meanwhile.
pub struct Reader {
    paths: Vec<PathBuf>,
    bundle: PathBuf,
    /// What the last read found.
    seen: KubeletUse,
    /// When the read in flight started.
    reading_since: Option<Instant>,
    results: mpsc::UnboundedSender<KubeletUse>,
    /// Taken by the loop while it runs ([`Reader::take_results`]).
    receiver: Option<mpsc::UnboundedReceiver<KubeletUse>>,
}

/// A read that takes this long is stuck (a hung mount): it is said so.
pub const STUCK_AFTER: Duration = Duration::from_secs(60);

impl Reader {
    pub fn new(paths: Vec<PathBuf>, bundle: PathBuf) -> Reader {
        let (results, receiver) = mpsc::unbounded_channel();
        Reader {
            paths,
            bundle,
            seen: KubeletUse::NotRead,
            reading_since: None,
            results,
            receiver: Some(receiver),
        }
    }

    pub fn seen(&self) -> &KubeletUse {
        &self.seen
    }

    /// Starts a read, unless one is in flight; true when what is seen changed (a read in
    /// flight found stuck).
    pub fn request(&mut self, at: Instant) -> bool {
        if let Some(since) = self.reading_since {
            if at.duration_since(since) < STUCK_AFTER {
                return false;
            }
            let stuck = KubeletUse::Unknown(format!(
                "reading {} has not finished after {}s (a hung mount?)",
                self.shown_paths(),
                STUCK_AFTER.as_secs()
            ));
            return self.update(stuck);
        }
        let (paths, bundle, results) = (
            self.paths.clone(),
            self.bundle.clone(),
            self.results.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("kubelet-config".into())
            .spawn(move || {
                let _ = results.send(observe(&paths, &bundle));
            });
        match spawned {
            Ok(_) => {
                self.reading_since = Some(at);
                false
            }
            Err(e) => self.update(KubeletUse::Unknown(format!(
                "cannot start a thread to read {}: {e}",
                self.shown_paths()
            ))),
        }
    }

    /// Takes in what a read found; true when it changed.
    pub fn found(&mut self, seen: KubeletUse) -> bool {
        self.reading_since = None;
        self.update(seen)
    }

    fn update(&mut self, seen: KubeletUse) -> bool {
        if seen == self.seen {
            return false;
        }
        match &seen {
            KubeletUse::Uses { .. } => tracing::info!(bundle = %self.bundle.display(), "{seen}"),
            _ => tracing::warn!(bundle = %self.bundle.display(), "{seen}"),
        }
        self.seen = seen;
        true
    }

    /// The results, for the loop to read while it runs; given back with
    /// [`Reader::give_back`].
    pub fn take_results(&mut self) -> mpsc::UnboundedReceiver<KubeletUse> {
        self.receiver.take().unwrap_or_else(|| {
            // Taken and not given back: a new channel, so that results still arrive.
            let (results, receiver) = mpsc::unbounded_channel();
            self.results = results;
            receiver
        })
    }

    pub fn give_back(&mut self, receiver: mpsc::UnboundedReceiver<KubeletUse>) {
        self.receiver = Some(receiver);
    }

    fn shown_paths(&self) -> String {
        self.paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUNDLE: &str = "/etc/kubernetes/kubelet-ca.crt";

    fn never(_: &Path, _: &Path) -> bool {
        false
    }

    #[test]
    fn the_client_ca_file_is_read_from_yaml_and_json() {
        let yaml = b"apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nauthentication:\n  anonymous:\n    enabled: false\n  x509:\n    clientCAFile: /etc/kubernetes/pki/ca.crt\nevictionHard:\n  memory.available: 100Mi\nfeatureGates: {}\n";
        assert_eq!(
            client_ca_file(yaml).unwrap(),
            Parsed::Kubelet(Some("/etc/kubernetes/pki/ca.crt".into()))
        );
        let json = br#" {"kind":"KubeletConfiguration","authentication":{"x509":{"clientCAFile":"/etc/kubernetes/kubelet-ca.crt"}},"maxPods":250}"#;
        assert_eq!(
            client_ca_file(json).unwrap(),
            Parsed::Kubelet(Some(BUNDLE.into()))
        );
        let none =
            b"kind: KubeletConfiguration\nauthentication:\n  x509:\n    clientCAFile: \"\"\n";
        assert_eq!(client_ca_file(none).unwrap(), Parsed::Kubelet(None));
        assert_eq!(
            client_ca_file(b"kind: KubeletConfiguration\n").unwrap(),
            Parsed::Kubelet(None)
        );
    }

    #[test]
    fn a_document_of_another_kind_or_none_is_told_apart() {
        let kubeconfig = b"apiVersion: v1\nkind: Config\nclusters: []\nusers:\n- name: x\n  user:\n    token: secret\n";
        assert_eq!(
            client_ca_file(kubeconfig).unwrap(),
            Parsed::OtherKind(Some("Config".into()))
        );
        assert_eq!(client_ca_file(b"").unwrap(), Parsed::OtherKind(None));
        let broken = client_ca_file(b"kind: [KubeletConfiguration\n").unwrap_err();
        assert!(broken.starts_with("not valid YAML"), "{broken}");
        assert!(!broken.contains('\n'), "{broken}");
        let broken = client_ca_file(b"{\"kind\": ").unwrap_err();
        assert!(broken.starts_with("not valid JSON"), "{broken}");
    }

    #[test]
    fn the_client_ca_file_is_the_bundle_by_path_relative_to_the_config_or_by_identity() {
        let config = Path::new("/etc/kubernetes/kubelet.conf");
        let bundle = Path::new(BUNDLE);
        for named in [
            BUNDLE,
            "/etc/kubernetes/./kubelet-ca.crt",
            "/etc/kubernetes/pki/../kubelet-ca.crt",
            "kubelet-ca.crt",
            "./kubelet-ca.crt",
        ] {
            assert_eq!(
                judge(config, named, bundle, never),
                KubeletUse::Uses {
                    config: config.into()
                },
                "{named}"
            );
        }
        assert_eq!(
            judge(config, "pki/ca.crt", bundle, never),
            KubeletUse::Other {
                config: config.into(),
                client_ca_file: "/etc/kubernetes/pki/ca.crt".into()
            }
        );
        // Another path to the same file (a link) is the bundle too.
        assert_eq!(
            judge(
                config,
                "/host/etc/kubernetes/kubelet-ca.crt",
                bundle,
                |_, _| true
            ),
            KubeletUse::Uses {
                config: config.into()
            }
        );
    }

    #[test]
    fn the_problem_names_both_files_and_what_to_do() {
        let other = KubeletUse::Other {
            config: "/var/lib/kubelet/config.yaml".into(),
            client_ca_file: "/etc/kubernetes/pki/ca.crt".into(),
        };
        let problem = other.problem(BUNDLE).unwrap();
        for needle in [
            "/var/lib/kubelet/config.yaml",
            "/etc/kubernetes/pki/ca.crt",
            "set clientCAFile to /etc/kubernetes/kubelet-ca.crt",
        ] {
            assert!(problem.contains(needle), "{needle} not in {problem}");
        }
        assert_eq!(other.uses(), Some(false));
        assert_eq!(KubeletUse::NotRead.uses(), None);
        assert!(
            KubeletUse::NotRead
                .problem(BUNDLE)
                .unwrap()
                .starts_with("not known yet")
        );
    }

    #[test]
    fn the_usual_places_are_tried_in_order_passing_over_a_kubeconfig() {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("kubelet-ca.crt");
        let kubeadm = dir.path().join("config.yaml");
        let kubeconfig = dir.path().join("kubelet.conf");
        let paths = vec![kubeadm.clone(), kubeconfig.clone()];
        fs::write(&kubeconfig, "apiVersion: v1\nkind: Config\n").unwrap();
        let found = observe(&paths, &bundle);
        let KubeletUse::Unknown(why) = &found else {
            panic!("{found:?}");
        };
        assert!(
            why.contains("no file at /")
                && why.contains("config.yaml;")
                && why.contains("kubelet.conf is a Config, not a KubeletConfiguration")
                && why.contains("--kubelet-config"),
            "{why}"
        );
        fs::write(
            &kubeadm,
            "kind: KubeletConfiguration\nauthentication:\n  x509:\n    clientCAFile: kubelet-ca.crt\n",
        )
        .unwrap();
        assert_eq!(
            observe(&paths, &bundle),
            KubeletUse::Uses {
                config: kubeadm.clone()
            }
        );
        // A link to the bundle is the bundle.
        fs::write(&bundle, "x").unwrap();
        let link = dir.path().join("link.crt");
        std::os::unix::fs::symlink(&bundle, &link).unwrap();
        fs::write(
            &kubeadm,
            format!(
                "kind: KubeletConfiguration\nauthentication:\n  x509:\n    clientCAFile: {}\n",
                link.display()
            ),
        )
        .unwrap();
        assert!(matches!(observe(&paths, &bundle), KubeletUse::Uses { .. }));
    }

    #[test]
    fn a_fifo_is_named_and_never_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("config.yaml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let found = observe(&[fifo], &dir.path().join("kubelet-ca.crt"));
        assert!(
            matches!(&found, KubeletUse::Unknown(why) if why.contains("FIFO")),
            "{found:?}"
        );
    }

    #[test]
    fn the_variable_replaces_the_usual_paths() {
        assert_eq!(paths_for(None).len(), DEFAULT_PATHS.len());
        assert_eq!(paths_for(Some(Path::new(""))).len(), DEFAULT_PATHS.len());
        assert_eq!(
            paths_for(Some(Path::new("/srv/kubelet.yaml"))),
            [PathBuf::from("/srv/kubelet.yaml")]
        );
    }

    #[test]
    fn a_read_runs_off_the_caller_and_only_one_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.yaml");
        fs::write(
            &config,
            "kind: KubeletConfiguration\nauthentication:\n  x509:\n    clientCAFile: other.crt\n",
        )
        .unwrap();
        let mut reader = Reader::new(vec![config.clone()], dir.path().join("kubelet-ca.crt"));
        let mut results = reader.take_results();
        let start = Instant::now();
        assert!(!reader.request(start));
        // A second request while the first is in flight starts nothing.
        assert!(!reader.request(start));
        let found = results.blocking_recv().unwrap();
        assert!(results.try_recv().is_err(), "two reads ran");
        assert!(reader.found(found));
        assert_eq!(reader.seen().uses(), Some(false));
        // A read that never came back is reported as stuck, after a minute.
        assert!(!reader.request(start));
        assert!(reader.request(start + STUCK_AFTER));
        assert!(
            reader
                .seen()
                .problem("b")
                .unwrap()
                .contains("has not finished"),
            "{:?}",
            reader.seen()
        );
        reader.give_back(results);
    }
}
