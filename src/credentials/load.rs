//! Reading the agent's credentials for the API server from disk, once: the kubeconfig (or the
//! pod's service account) and every file it names, each checked the way the client would
//! use it, into a [`kube::Config`] built from exactly the bytes that were checked.
//!
//! The files are read here rather than by kube-rs because kube-rs reads a client certificate
//! and a CA file once, when the client is built, and from then on knows nothing of them. Read
//! here, the same bytes give the fingerprint that tells a change, the certificates that the
//! metrics show, and the checks that keep a client from being built from half of a rotation
//! (a new certificate with the old key).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use base64::Engine;
use kube::config::{KubeConfigOptions, Kubeconfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use secrecy::{ExposeSecret, SecretString};
use sha2::{Digest, Sha256};

use crate::bundle::Certificate;
use crate::fsutil::{self, Links};

/// Where an in-cluster pod finds its service account's token and the API server's CA.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A kubeconfig or a file it names is a few KiB; anything this large is not one.
const MAX_FILE_BYTES: usize = 1 << 20;

/// Where the credentials come from. Decided once, at start; what the files hold is read
/// again whenever they change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Kubeconfig files, merged in order as kubectl merges them.
    Kubeconfig {
        paths: Vec<PathBuf>,
        /// How the paths were chosen, for messages: `--kubeconfig`, `$KUBECONFIG`, ...
        chosen_by: &'static str,
        /// Which of their contexts, clusters and users are used.
        pick: Pick,
    },
    /// The pod's service account: the API server from the environment, the token and CA
    /// from [`SERVICE_ACCOUNT_DIR`].
    InCluster { server: String, dir: PathBuf },
}

/// Which context, cluster and user of the kubeconfig the credentials are made of, as
/// kubectl's `--context`, `--cluster` and `--user` pick them: the named context (default:
/// the current context), and in it the named cluster and user instead of its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pick {
    pub context: Option<String>,
    pub cluster: Option<String>,
    pub user: Option<String>,
}

impl Pick {
    /// Nothing picked: the current context, as it is.
    pub fn is_empty(&self) -> bool {
        self.context.is_none() && self.cluster.is_none() && self.user.is_none()
    }
}

/// Where the kubelet keeps its own kubeconfig, by distribution, with the bootstrap
/// kubeconfig that says, before the kubelet has written its own, which one it will write.
/// The agent run as root on a node takes the kubelet's identity with no flag (SPEC 3).
pub const KUBELET_KUBECONFIGS: [KubeletKubeconfig; 2] = [
    KubeletKubeconfig {
        path: "/var/lib/kubelet/kubeconfig",
        bootstrap: "/etc/kubernetes/kubeconfig",
        chosen_by: "the kubelet's kubeconfig on OpenShift",
    },
    KubeletKubeconfig {
        path: "/etc/kubernetes/kubelet.conf",
        bootstrap: "/etc/kubernetes/bootstrap-kubelet.conf",
        chosen_by: "the kubelet's kubeconfig on kubeadm",
    },
];

/// The kubeadm kubelet's kubeconfig: named in messages when another one is missing.
pub const KUBEADM_KUBELET_KUBECONFIG: &str = "/etc/kubernetes/kubelet.conf";

/// One distribution's place for the kubelet's kubeconfig.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KubeletKubeconfig {
    pub path: &'static str,
    /// The kubeconfig the kubelet bootstraps from, which exists before `path` does.
    pub bootstrap: &'static str,
    pub chosen_by: &'static str,
}

/// What [`Origin::resolve_in`] may ask of the disk about a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Missing,
    /// There, but not a kubeconfig (another kind of file at that path).
    NotKubeconfig,
    Kubeconfig,
}

impl Found {
    /// Whether the file at `path` is there, and a kubeconfig (a YAML document with
    /// clusters). Blocking file I/O, at start only.
    pub fn probe(path: &Path) -> Found {
        match fsutil::open_regular(path, Links::Follow) {
            Ok(Ok((file, _))) => match fsutil::read_bounded(file, MAX_FILE_BYTES) {
                Ok(bytes) => match std::str::from_utf8(&bytes).map(Kubeconfig::from_yaml) {
                    Ok(Ok(config)) if !config.clusters.is_empty() => Found::Kubeconfig,
                    _ => Found::NotKubeconfig,
                },
                Err(_) => Found::NotKubeconfig,
            },
            Ok(Err(_)) => Found::NotKubeconfig,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Found::Missing,
            Err(_) => Found::NotKubeconfig,
        }
    }
}

impl Origin {
    /// `--kubeconfig`, else in-cluster config, else `$KUBECONFIG`, else `~/.kube/config`
    /// when it exists, else the kubelet's own kubeconfig where the distribution puts it
    /// ([`KUBELET_KUBECONFIGS`], when it is a kubeconfig) (SPEC 3). A file that does not
    /// exist yet is still the origin: on a new node the kubelet writes its kubeconfig after
    /// the agent has started, and its bootstrap kubeconfig says which one it will be.
    pub fn resolve(explicit: Option<&Path>) -> Result<Origin, String> {
        Origin::resolve_in(explicit, None, |name| std::env::var_os(name), Found::probe)
    }

    /// As kubectl finds its credentials (`rollout`, also as the kubectl plugin):
    /// `--kubeconfig`, else `$KUBECONFIG`, else `~/.kube/config` when it exists, else
    /// in-cluster config (not when `pick` names a context, cluster or user: only a
    /// kubeconfig has them), else the kubelet's own kubeconfig as [`Origin::resolve`] finds
    /// it; of the kubeconfig, what `pick` picks.
    pub fn resolve_kubectl(explicit: Option<&Path>, pick: Pick) -> Result<Origin, String> {
        Origin::resolve_in(
            explicit,
            Some(pick),
            |name| std::env::var_os(name),
            Found::probe,
        )
    }

    /// [`Origin::resolve`] (`kubectl`: `None`) or [`Origin::resolve_kubectl`], with the
    /// environment variables as `env` gives them and the files as `probe` finds them.
    fn resolve_in(
        explicit: Option<&Path>,
        kubectl: Option<Pick>,
        env: impl Fn(&str) -> Option<std::ffi::OsString>,
        probe: impl Fn(&Path) -> Found,
    ) -> Result<Origin, String> {
        let pick = kubectl.clone().unwrap_or_default();
        let kubeconfig = |paths: Vec<PathBuf>, chosen_by: &'static str| Origin::Kubeconfig {
            paths,
            chosen_by,
            pick: pick.clone(),
        };
        if let Some(path) = explicit {
            return Ok(kubeconfig(vec![absolute(path)], "--kubeconfig"));
        }
        let text = |name| {
            env(name)
                .and_then(|v| v.into_string().ok())
                .filter(|v| !v.is_empty())
        };
        let in_cluster = || match (
            text("KUBERNETES_SERVICE_HOST"),
            text("KUBERNETES_SERVICE_PORT"),
        ) {
            (Some(host), Some(port)) => {
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host
                };
                Some(Origin::InCluster {
                    server: format!("https://{host}:{port}"),
                    dir: PathBuf::from(SERVICE_ACCOUNT_DIR),
                })
            }
            _ => None,
        };
        // The agent on a node prefers its pod's identity; kubectl, the user's kubeconfig.
        if kubectl.is_none()
            && let Some(origin) = in_cluster()
        {
            return Ok(origin);
        }
        if let Some(value) = env("KUBECONFIG") {
            let mut paths: Vec<PathBuf> = Vec::new();
            // Each once, as kubectl reads them.
            for path in std::env::split_paths(&value).filter(|p| !p.as_os_str().is_empty()) {
                let path = absolute(&path);
                if !paths.contains(&path) {
                    paths.push(path);
                }
            }
            if !paths.is_empty() {
                return Ok(kubeconfig(paths, "$KUBECONFIG"));
            }
        }
        let home = env("HOME")
            .filter(|h| !h.is_empty())
            .map(|home| PathBuf::from(home).join(".kube").join("config"));
        let kubelet =
            |path: &'static str, chosen_by| kubeconfig(vec![PathBuf::from(path)], chosen_by);
        if let Some(home) = &home
            && probe(home) != Found::Missing
        {
            return Ok(kubeconfig(vec![home.clone()], "the default ~/.kube/config"));
        }
        if kubectl.as_ref().is_some_and(Pick::is_empty)
            && let Some(origin) = in_cluster()
        {
            return Ok(origin);
        }
        if let Some(found) = KUBELET_KUBECONFIGS
            .iter()
            .find(|k| probe(Path::new(k.path)) == Found::Kubeconfig)
        {
            return Ok(kubelet(found.path, found.chosen_by));
        }
        // A new node: the kubelet has not written its kubeconfig yet, and its bootstrap
        // kubeconfig says where it will.
        if let Some(coming) = KUBELET_KUBECONFIGS.iter().find(|k| {
            probe(Path::new(k.path)) == Found::Missing
                && probe(Path::new(k.bootstrap)) == Found::Kubeconfig
        }) {
            return Ok(kubelet(coming.path, coming.chosen_by));
        }
        match home {
            Some(home) => Ok(kubeconfig(vec![home], "the default ~/.kube/config")),
            None => Err(format!(
                "no --kubeconfig, no in-cluster service account, no $KUBECONFIG, no $HOME and no kubelet kubeconfig at {}: pass --kubeconfig",
                KUBELET_KUBECONFIGS.map(|k| k.path).join(" or ")
            )),
        }
    }

    /// Whether the credentials are read from the kubeconfig at `path`.
    pub fn names(&self, path: &Path) -> bool {
        matches!(self, Origin::Kubeconfig { paths, .. } if paths.iter().any(|p| p == path))
    }

    /// What the origin is, for messages.
    pub fn describe(&self) -> String {
        match self {
            Origin::Kubeconfig {
                paths,
                chosen_by,
                pick,
            } => {
                let picked = [
                    ("context", &pick.context),
                    ("cluster", &pick.cluster),
                    ("user", &pick.user),
                ]
                .iter()
                .filter_map(|(what, name)| name.as_ref().map(|n| format!(", {what} {n:?}")))
                .collect::<String>();
                format!(
                    "kubeconfig {} ({chosen_by}){picked}",
                    join_paths(paths.iter().map(PathBuf::as_path))
                )
            }
            Origin::InCluster { dir, .. } => {
                format!("the pod's service account in {}", dir.display())
            }
        }
    }
}

/// What to add to "kubeconfig PATH does not exist", for the way PATH was chosen. On a
/// kubeadm node (`kubeadm`: its kubelet's kubeconfig is there), a kubeconfig that will
/// never appear is not said to come after the TLS bootstrap: the one that exists is named.
fn missing_hint(path: &Path, chosen_by: &str, kubeadm: bool) -> String {
    let kubelet_kubeconfig = KUBELET_KUBECONFIGS
        .iter()
        .any(|k| Path::new(k.path) == path);
    if kubeadm && path != Path::new(KUBEADM_KUBELET_KUBECONFIG) {
        let how = if chosen_by == "--kubeconfig" {
            "set --kubeconfig (KUBELET_CA_AGENT_KUBECONFIG) to it, or leave it unset to use it"
        } else {
            "pass --kubeconfig with it"
        };
        return format!(
            "; this is a kubeadm node: the kubelet's kubeconfig is {KUBEADM_KUBELET_KUBECONFIG}; {how}"
        );
    }
    if chosen_by == "--kubeconfig" || kubelet_kubeconfig {
        return " yet (on a new node, the kubelet writes it after its TLS bootstrap)".to_string();
    }
    if chosen_by == "the default ~/.kube/config" {
        return format!(
            "; nor is there a kubelet kubeconfig at {}: pass --kubeconfig",
            KUBELET_KUBECONFIGS.map(|k| k.path).join(" or ")
        );
    }
    String::new()
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

fn join_paths<'a>(paths: impl Iterator<Item = &'a Path>) -> String {
    paths
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":")
}

/// Why the credentials on disk cannot be used now: the file, and what is wrong with it.
/// Never carries a key, a token or a certificate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{problem}")]
pub struct CredentialError {
    pub problem: String,
}

fn fail<T>(problem: impl Into<String>) -> Result<T, CredentialError> {
    Err(CredentialError {
        problem: problem.into(),
    })
}

/// A certificate the agent presents or trusts for the API server, and where it came from:
/// what the `x509_cert_*` series of the agent's own identity are made of.
#[derive(Debug, Clone)]
pub struct HeldCertificate {
    /// The file it was read from (the kubeconfig, when it is embedded there).
    pub filepath: String,
    /// `user` for the client certificate, `cluster` for a CA trusted for the server.
    pub kind: &'static str,
    /// The kubeconfig's name for that user or cluster (empty in-cluster).
    pub key: String,
    pub certificate: Certificate,
}

/// The credentials, read and checked.
pub struct Loaded {
    pub config: kube::Config,
    /// SHA-256 over every byte the credentials were made from: a change to any file
    /// changes it.
    pub fingerprint: [u8; 32],
    /// The API server, as the client will reach it (`https://HOST:PORT`).
    pub server: String,
    /// Where the CA trusted for the server came from, for messages (a file, the kubeconfig,
    /// or the system's roots).
    pub ca_origin: String,
    /// Where the client certificate came from, when there is one.
    pub client_certificate_origin: Option<String>,
    pub held: Vec<HeldCertificate>,
    /// The Node a service account token bound to a Pod names (its claim
    /// `kubernetes.io.node.name`, Kubernetes 1.30 and later).
    pub token_node: Option<String>,
}

/// One reading of the credentials: the files that matter (to be watched, whether or not
/// they could be read) and what they gave.
pub struct Attempt {
    pub files: BTreeSet<PathBuf>,
    pub result: Result<Loaded, CredentialError>,
}

/// Reads and checks the credentials of `origin`. Blocking file I/O.
pub fn load(origin: &Origin) -> Attempt {
    let mut reader = Reader::default();
    let result = match origin {
        Origin::Kubeconfig {
            paths,
            chosen_by,
            pick,
        } => reader.kubeconfig(paths, chosen_by, pick),
        Origin::InCluster { server, dir } => reader.in_cluster(server, dir),
    };
    Attempt {
        files: reader.files,
        result,
    }
}

/// Reads files, remembering each one (to watch it) and hashing what it read.
#[derive(Default)]
struct Reader {
    files: BTreeSet<PathBuf>,
    hash: Sha256,
}

impl Reader {
    /// The bytes of `path` (`what` names its role in messages). A symbolic link is followed,
    /// and its target watched too: the kubelet's `kubelet-client-current.pem` is one.
    fn read(&mut self, path: &Path, what: &str) -> Result<Vec<u8>, CredentialError> {
        self.files.insert(path.to_path_buf());
        if let Ok(target) = std::fs::canonicalize(path)
            && target != path
        {
            self.files.insert(target);
        }
        let shown = path.display();
        let bytes = match fsutil::open_regular(path, Links::Follow) {
            Ok(Ok((file, _))) => {
                fsutil::read_bounded(file, MAX_FILE_BYTES).map_err(|e| CredentialError {
                    problem: format!("{what} {shown}: cannot read it: {e}"),
                })?
            }
            Ok(Err(kind)) => return fail(format!("{what} {shown} is {kind}, not a file")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return fail(format!("{what} {shown} does not exist"));
            }
            Err(e) => return fail(format!("{what} {shown}: cannot read it: {e}")),
        };
        if bytes.len() > MAX_FILE_BYTES {
            return fail(format!(
                "{what} {shown} is larger than {} KiB: not a {what}",
                MAX_FILE_BYTES / 1024
            ));
        }
        self.note(path.as_os_str().as_encoded_bytes(), &bytes);
        Ok(bytes)
    }

    /// Counts `bytes` (under `name`) into the fingerprint.
    fn note(&mut self, name: &[u8], bytes: &[u8]) {
        for part in [name, bytes] {
            self.hash.update((part.len() as u64).to_be_bytes());
            self.hash.update(part);
        }
    }

    fn kubeconfig(
        &mut self,
        paths: &[PathBuf],
        chosen_by: &str,
        pick: &Pick,
    ) -> Result<Loaded, CredentialError> {
        let mut merged: Option<Kubeconfig> = None;
        let mut missing: Option<CredentialError> = None;
        for path in paths {
            let read = self.read(path, "kubeconfig");
            // kubectl skips a file of $KUBECONFIG's list that does not exist (still watched:
            // it is read when it comes); with none there, the first is said missing.
            if paths.len() > 1
                && let Err(e) = &read
                && e.problem.ends_with("does not exist")
            {
                missing.get_or_insert(e.clone());
                continue;
            }
            let bytes = read.map_err(|e| {
                let hint = if e.problem.ends_with("does not exist") {
                    missing_hint(
                        path,
                        chosen_by,
                        Found::probe(Path::new(KUBEADM_KUBELET_KUBECONFIG)) == Found::Kubeconfig,
                    )
                } else {
                    String::new()
                };
                CredentialError {
                    problem: format!("{}{hint}", e.problem),
                }
            })?;
            let text = String::from_utf8(bytes)
                .or_else(|_| fail(format!("kubeconfig {}: not UTF-8 text", path.display())))?;
            let mut config = Kubeconfig::from_yaml(&text).or_else(|e| {
                fail(format!(
                    "kubeconfig {} is not a valid kubeconfig{} (half written?)",
                    path.display(),
                    yaml_location(&e.to_string())
                ))
            })?;
            relative_to(&mut config, path);
            // An empty current-context sets nothing: a later file's may (kubectl's merge).
            if config.current_context.as_deref() == Some("") {
                config.current_context = None;
            }
            merged = Some(match merged {
                None => config,
                Some(m) => m.merge(config).or_else(|e| {
                    fail(format!(
                        "kubeconfig {}: cannot merge it: {e}",
                        path.display()
                    ))
                })?,
            });
        }
        let mut config = match (merged, missing) {
            (Some(merged), _) => merged,
            (None, Some(missing)) => return Err(missing),
            (None, None) => Kubeconfig::default(),
        };
        let source = join_paths(paths.iter().map(PathBuf::as_path));
        let (cluster_name, user_name) = current(&config, &source, pick)?;
        let mut held = Vec::new();

        let cluster = config
            .clusters
            .iter_mut()
            .find(|c| c.name == cluster_name)
            .and_then(|c| c.cluster.as_mut())
            .ok_or_else(|| CredentialError {
                problem: format!("kubeconfig {source}: no cluster named {cluster_name:?}"),
            })?;
        let Some(server) = cluster.server.clone().filter(|s| !s.is_empty()) else {
            return fail(format!(
                "kubeconfig {source}: cluster {cluster_name:?} has no server"
            ));
        };
        let ca_origin = match (
            cluster.certificate_authority.take(),
            cluster.certificate_authority_data.take(),
        ) {
            (_, Some(data)) if !data.is_empty() => {
                let where_ = format!(
                    "certificate-authority-data of cluster {cluster_name:?} in kubeconfig {source}"
                );
                let bytes = decode(&data, &where_)?;
                self.note(b"certificate-authority-data", &bytes);
                held.extend(cas(&bytes, &where_, &source, &cluster_name)?);
                cluster.certificate_authority_data = Some(base64(&bytes));
                where_
            }
            (Some(file), _) if !file.is_empty() => {
                let path = PathBuf::from(&file);
                let bytes = self.read(&path, "certificate-authority")?;
                let where_ = format!("certificate-authority {file}");
                held.extend(cas(&bytes, &where_, &file, &cluster_name)?);
                cluster.certificate_authority_data = Some(base64(&bytes));
                where_
            }
            _ if cluster.insecure_skip_tls_verify == Some(true) => {
                "nothing (insecure-skip-tls-verify)".to_string()
            }
            _ => "the system's trusted roots".to_string(),
        };

        let user = config
            .auth_infos
            .iter_mut()
            .find(|u| u.name == user_name)
            .and_then(|u| u.auth_info.as_mut())
            .ok_or_else(|| CredentialError {
                problem: format!("kubeconfig {source}: no user named {user_name:?}"),
            })?;
        let cert = match (
            user.client_certificate.take(),
            user.client_certificate_data.take(),
        ) {
            (_, Some(data)) if !data.is_empty() => {
                let where_ =
                    format!("client-certificate-data of user {user_name:?} in kubeconfig {source}");
                let bytes = decode(&data, &where_)?;
                self.note(b"client-certificate-data", &bytes);
                Some((bytes, where_, source.clone()))
            }
            (Some(file), _) if !file.is_empty() => {
                let bytes = self.read(Path::new(&file), "client-certificate")?;
                Some((bytes, format!("client-certificate {file}"), file))
            }
            _ => None,
        };
        let key = match (user.client_key.take(), user.client_key_data.take()) {
            (_, Some(data)) if !data.expose_secret().is_empty() => {
                let where_ =
                    format!("client-key-data of user {user_name:?} in kubeconfig {source}");
                let bytes = decode(data.expose_secret(), &where_)?;
                self.note(b"client-key-data", &bytes);
                Some((bytes, where_))
            }
            (Some(file), _) if !file.is_empty() => {
                let bytes = self.read(Path::new(&file), "client-key")?;
                Some((bytes, format!("client-key {file}")))
            }
            _ => None,
        };
        let client_certificate_origin = match (cert, key) {
            (None, None) => None,
            (Some((_, where_, _)), None) => {
                return fail(format!("{where_} has no client key beside it"));
            }
            (None, Some((_, where_))) => {
                return fail(format!("{where_} has no client certificate beside it"));
            }
            (Some((cert, cert_where, filepath)), Some((key, key_where))) => {
                let leaf = pair(&cert, &cert_where, &key, &key_where)?;
                held.push(HeldCertificate {
                    filepath,
                    kind: "user",
                    key: user_name.clone(),
                    certificate: leaf,
                });
                user.client_certificate_data = Some(base64(&cert));
                user.client_key_data = Some(SecretString::from(base64(&key)));
                Some(cert_where)
            }
        };
        if let Some(file) = user.token_file.take().filter(|f| !f.is_empty()) {
            let bytes = self.read(Path::new(&file), "tokenFile")?;
            user.token = Some(token(&bytes, &format!("tokenFile {file}"))?);
        } else if let Some(token) = &user.token {
            self.note(b"token", token.expose_secret().as_bytes());
        }

        // kube-rs takes the current context: the one made of what `current` picked above.
        let namespace = pick
            .context
            .as_ref()
            .or(config.current_context.as_ref())
            .and_then(|name| config.contexts.iter().find(|c| c.name == *name))
            .and_then(|c| c.context.as_ref())
            .and_then(|c| c.namespace.clone());
        let picked = "kubelet-ca-agent:picked".to_string();
        config.contexts = vec![kube::config::NamedContext {
            name: picked.clone(),
            context: Some(kube::config::Context {
                cluster: cluster_name,
                user: Some(user_name),
                namespace,
                ..Default::default()
            }),
            ..Default::default()
        }];
        config.current_context = Some(picked);
        let options = KubeConfigOptions::default();
        let config =
            futures::executor::block_on(kube::Config::from_custom_kubeconfig(config, &options))
                .or_else(|e| fail(format!("kubeconfig {source} is not usable: {e}")))?;
        Ok(self.finish(config, server, ca_origin, client_certificate_origin, held))
    }

    fn in_cluster(&mut self, server: &str, dir: &Path) -> Result<Loaded, CredentialError> {
        let ca_path = dir.join("ca.crt");
        let token_path = dir.join("token");
        let ca = self.read(&ca_path, "service account CA")?;
        let where_ = format!("service account CA {}", ca_path.display());
        let held = cas(&ca, &where_, &ca_path.display().to_string(), "")?;
        let token_bytes = self.read(&token_path, "service account token")?;
        let token = token(
            &token_bytes,
            &format!("service account token {}", token_path.display()),
        )?;
        let namespace = std::fs::read_to_string(dir.join("namespace"))
            .map(|n| n.trim().to_string())
            .unwrap_or_default();
        self.note(b"server", server.as_bytes());
        let cluster_url = server
            .parse()
            .or_else(|_| fail(format!("the in-cluster API server {server:?} is not a URL")))?;
        let mut config = kube::Config::new(cluster_url);
        config.root_cert = Some(
            CertificateDer::pem_slice_iter(&ca)
                .filter_map(Result::ok)
                .map(|c| c.to_vec())
                .collect(),
        );
        let node = token_node(token.expose_secret());
        config.auth_info.token = Some(token);
        if !namespace.is_empty() {
            config.default_namespace = namespace;
        }
        let mut loaded = self.finish(config, server.to_string(), where_, None, held);
        loaded.token_node = node;
        Ok(loaded)
    }

    fn finish(
        &mut self,
        mut config: kube::Config,
        server: String,
        ca_origin: String,
        client_certificate_origin: Option<String>,
        held: Vec<HeldCertificate>,
    ) -> Loaded {
        // No hidden retries inside the client: kube-rs would retry a 429, 503 or 504 up to
        // 15 times over minutes, during which the source would look up. The watch loop has
        // its own backoff with jitter, reports each failure, and `sync` fails fast.
        config.default_retry = false;
        let hash = std::mem::take(&mut self.hash);
        Loaded {
            config,
            fingerprint: hash.finalize().into(),
            server: server.trim_end_matches('/').to_string(),
            ca_origin,
            client_certificate_origin,
            held,
            token_node: None,
        }
    }
}

/// The cluster and user the credentials are made of, as kubectl picks them: those of
/// `--context` (else of the current context), `--cluster` and `--user` instead when given.
fn current(
    config: &Kubeconfig,
    source: &str,
    pick: &Pick,
) -> Result<(String, String), CredentialError> {
    // (An empty current-context was made none as the files were merged.)
    let named = match (&pick.context, config.current_context.as_deref()) {
        (Some(name), _) => Some((name.as_str(), "--context")),
        (None, Some(name)) => Some((name, "current-context")),
        (None, None) => None,
    };
    let context = match named {
        Some((name, by)) => Some(
            config
                .contexts
                .iter()
                .find(|c| c.name == name)
                .and_then(|c| c.context.as_ref())
                .ok_or_else(|| CredentialError {
                    problem: format!(
                        "kubeconfig {source}: {by} {name:?} is not among its contexts"
                    ),
                })?,
        ),
        // kubectl goes on without a context when --cluster names the cluster.
        None if pick.cluster.is_some() => None,
        None => {
            return fail(format!("kubeconfig {source} has no current-context"));
        }
    };
    let cluster = pick
        .cluster
        .clone()
        .or_else(|| context.map(|c| c.cluster.clone()))
        .unwrap_or_default();
    let user = pick
        .user
        .clone()
        .or_else(|| context.and_then(|c| c.user.clone()))
        .unwrap_or_default();
    Ok((cluster, user))
}

/// Paths in a kubeconfig are relative to the file, as kubectl reads them.
fn relative_to(config: &mut Kubeconfig, path: &Path) {
    let Some(dir) = path.parent() else { return };
    let fix = |field: &mut Option<String>| {
        if let Some(file) = field.as_mut()
            && !file.is_empty()
            && Path::new(file).is_relative()
        {
            *file = dir.join(&*file).display().to_string();
        }
    };
    for cluster in config
        .clusters
        .iter_mut()
        .filter_map(|c| c.cluster.as_mut())
    {
        fix(&mut cluster.certificate_authority);
    }
    for user in config
        .auth_infos
        .iter_mut()
        .filter_map(|u| u.auth_info.as_mut())
    {
        fix(&mut user.client_certificate);
        fix(&mut user.client_key);
        fix(&mut user.token_file);
    }
}

/// Where a YAML error is (" at line L column C"), without its text: a parser's message can
/// quote the content, and a kubeconfig holds keys and tokens.
fn yaml_location(message: &str) -> String {
    let number_after = |word: &str| {
        let at = message.find(word)? + word.len();
        let digits: String = message[at..]
            .trim_start()
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        (!digits.is_empty()).then_some(digits)
    };
    match (number_after("line"), number_after("column")) {
        (Some(line), Some(column)) => format!(" (at line {line}, column {column})"),
        (Some(line), None) => format!(" (at line {line})"),
        _ => String::new(),
    }
}

fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn decode(data: &str, where_: &str) -> Result<Vec<u8>, CredentialError> {
    let compact: Vec<u8> = data.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact)
        .or_else(|_| fail(format!("{where_} is not valid base64")))
}

/// The CA certificates of a bundle trusted for the API server: at least one, each parsed.
fn cas(
    bytes: &[u8],
    where_: &str,
    filepath: &str,
    cluster: &str,
) -> Result<Vec<HeldCertificate>, CredentialError> {
    let mut held = Vec::new();
    for (index, der) in CertificateDer::pem_slice_iter(bytes).enumerate() {
        let der = der.or_else(|_| {
            fail(format!(
                "{where_}: block {} is not a whole PEM certificate (half written?)",
                index + 1
            ))
        })?;
        let certificate = Certificate::from_der(&der).or_else(|e| {
            fail(format!(
                "{where_}: certificate {} does not parse: {e}",
                index + 1
            ))
        })?;
        held.push(HeldCertificate {
            filepath: filepath.to_string(),
            kind: "cluster",
            key: cluster.to_string(),
            certificate,
        });
    }
    if held.is_empty() {
        return fail(format!("{where_} holds no PEM certificate"));
    }
    Ok(held)
}

/// A client certificate and its key: both parse, and the key is the certificate's. Returns
/// the leaf certificate.
fn pair(
    cert: &[u8],
    cert_where: &str,
    key: &[u8],
    key_where: &str,
) -> Result<Certificate, CredentialError> {
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .or_else(|_| {
            fail(format!(
                "{cert_where} is not a whole PEM certificate (half written?)"
            ))
        })?;
    let Some(leaf) = chain.first() else {
        return fail(format!("{cert_where} holds no PEM certificate"));
    };
    let certificate = Certificate::from_der(leaf)
        .or_else(|e| fail(format!("{cert_where}: the certificate does not parse: {e}")))?;
    // The error never carries the key's bytes: only where it is and what is wrong.
    let key = PrivateKeyDer::from_pem_slice(key).or_else(|_| {
        fail(format!(
            "{key_where} holds no whole PEM private key (half written?)"
        ))
    })?;
    let provider = rustls::crypto::ring::default_provider();
    let signing = provider.key_provider.load_private_key(key).or_else(|_| {
        fail(format!(
            "{key_where}: a private key of a kind the client cannot use"
        ))
    })?;
    // The key's public half against the certificate's, compared here rather than by rustls
    // (`keys_match`), which parses the certificate with webpki and so fails every
    // certificate of X.509 version 1 as if its key were another's. The API server accepts
    // version 1, and so does the client ([`super::tls`]).
    let matches = match signing.public_key() {
        Some(spki) => subject_public_key_info(leaf).is_some_and(|of_cert| of_cert == *spki),
        // A kind of key whose public half rustls cannot tell: the server will.
        None => true,
    };
    if !matches {
        return fail(format!(
            "{cert_where} and {key_where} do not go together: the key is not the certificate's (a rotation half done?)"
        ));
    }
    Ok(certificate)
}

/// The DER of a certificate's subjectPublicKeyInfo, whatever its version.
fn subject_public_key_info(der: &[u8]) -> Option<Vec<u8>> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, certificate) = X509Certificate::from_der(der).ok()?;
    Some(certificate.public_key().raw.to_vec())
}

/// The Node a service account token bound to a Pod names: the claim
/// `kubernetes.io.node.name` of its payload, read, not verified (the API server verifies
/// it, and its policy lets the token write that Node's report alone). None for a token that
/// is not such a JWT.
pub fn token_node(token: &str) -> Option<String> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let name = claims
        .get("kubernetes.io")?
        .get("node")?
        .get("name")?
        .as_str()?;
    (!name.is_empty()).then(|| name.to_string())
}

fn token(bytes: &[u8], where_: &str) -> Result<SecretString, CredentialError> {
    let text = std::str::from_utf8(bytes)
        .ok()
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match text {
        Some(t) if t.bytes().all(|b| b.is_ascii_graphic()) => Ok(SecretString::from(t.to_string())),
        Some(_) => fail(format!(
            "{where_} holds characters a bearer token cannot have"
        )),
        None => fail(format!("{where_} is empty")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_bound_tokens_node_is_read_from_its_claims() {
        use base64::Engine;
        let jwt = |claims: &str| {
            let part = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
            format!("{}.{}.signature", part(r#"{"alg":"RS256"}"#), part(claims))
        };
        let bound = r#"{"kubernetes.io":{"namespace":"kubelet-ca-agent","node":{"name":"worker-1","uid":"u"},"pod":{"name":"p"}}}"#;
        assert_eq!(token_node(&jwt(bound)), Some("worker-1".into()));
        assert_eq!(
            token_node(&jwt(r#"{"kubernetes.io":{"pod":{"name":"p"}}}"#)),
            None
        );
        assert_eq!(
            token_node(&jwt(r#"{"kubernetes.io":{"node":{"name":""}}}"#)),
            None
        );
        assert_eq!(token_node("not-a-jwt"), None);
        assert_eq!(token_node("a.!!!.c"), None);
        assert_eq!(token_node(&jwt("not json")), None);
    }

    /// Writes at `path` a kubeconfig of one cluster (server https://127.0.0.1:6443, then
    /// the lines `cluster`) and one user (the lines `user`), current, and loads it.
    fn load_kubeconfig(path: &Path, cluster: &str, user: &str, chosen_by: &'static str) -> Attempt {
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\n{cluster}users:\n- name: u\n  user:\n{user}contexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n"
            ),
        )
        .unwrap();
        load(&Origin::Kubeconfig {
            paths: vec![path.to_path_buf()],
            chosen_by,
            pick: Pick::default(),
        })
    }

    #[test]
    fn yaml_errors_keep_the_place_and_drop_the_text() {
        assert_eq!(
            yaml_location("invalid type: found token: s3cr3t at line 12 column 9"),
            " (at line 12, column 9)"
        );
        assert_eq!(yaml_location("did not find expected key"), "");
        assert_eq!(
            yaml_location("mapping values are not allowed at line 3"),
            " (at line 3)"
        );
    }

    #[test]
    fn a_token_is_trimmed_and_one_with_a_blank_or_a_control_character_inside_refused() {
        use secrecy::ExposeSecret;
        let ok = token(b" abc.def-_~+/=\n", "tokenFile t").unwrap();
        assert_eq!(ok.expose_secret(), "abc.def-_~+/=");
        for bad in [
            &b"two words"[..],
            b"tab\there",
            b"nul\0",
            "\u{e9}t\u{e9}".as_bytes(),
        ] {
            let problem = token(bad, "tokenFile t").unwrap_err().problem;
            assert_eq!(
                problem,
                "tokenFile t holds characters a bearer token cannot have"
            );
        }
        assert_eq!(
            token(b" \n", "tokenFile t").unwrap_err().problem,
            "tokenFile t is empty"
        );
    }

    #[test]
    fn the_origin_is_in_cluster_then_kubeconfig_then_home_skipping_what_is_empty() {
        let resolve = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Origin::resolve_in(
                None,
                None,
                move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.into()),
                |_| Found::Missing,
            )
        };
        assert_eq!(
            resolve(&[
                ("KUBERNETES_SERVICE_HOST", "fd00::1"),
                ("KUBERNETES_SERVICE_PORT", "443"),
                ("KUBECONFIG", "/k"),
            ]),
            Ok(Origin::InCluster {
                server: "https://[fd00::1]:443".into(),
                dir: PathBuf::from(SERVICE_ACCOUNT_DIR),
            })
        );
        // An empty host is no service: $KUBECONFIG, whose empty entries are skipped.
        let origin = resolve(&[
            ("KUBERNETES_SERVICE_HOST", ""),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("KUBECONFIG", "/a::/b"),
        ])
        .unwrap();
        assert_eq!(
            origin,
            Origin::Kubeconfig {
                paths: vec![PathBuf::from("/a"), PathBuf::from("/b")],
                chosen_by: "$KUBECONFIG",
                pick: Pick::default(),
            }
        );
        assert_eq!(origin.describe(), "kubeconfig /a:/b ($KUBECONFIG)");
        // A $KUBECONFIG of empty entries only is none: ~/.kube/config.
        assert_eq!(
            resolve(&[("KUBECONFIG", ":"), ("HOME", "/root")]),
            Ok(Origin::Kubeconfig {
                paths: vec![PathBuf::from("/root/.kube/config")],
                chosen_by: "the default ~/.kube/config",
                pick: Pick::default(),
            })
        );
        let none = resolve(&[("HOME", "")]).unwrap_err();
        assert!(none.contains("pass --kubeconfig"), "{none}");
        assert_eq!(
            Origin::InCluster {
                server: "https://10.0.0.1:443".into(),
                dir: PathBuf::from("/sa"),
            }
            .describe(),
            "the pod's service account in /sa"
        );
    }

    #[test]
    fn a_linked_credential_file_is_watched_at_the_link_and_at_its_target() {
        let dir = std::env::temp_dir().join(format!("load-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("pki")).unwrap();
        let target = dir.join("pki/token-2026");
        std::fs::write(&target, "a-token").unwrap();
        let link = dir.join("token");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let mut reader = Reader::default();
        assert_eq!(reader.read(&link, "token").unwrap(), b"a-token");
        assert!(reader.files.contains(&link));
        assert!(reader.files.contains(&target));
        // A plain file is watched once.
        let mut reader = Reader::default();
        reader.read(&target, "token").unwrap();
        assert_eq!(reader.files.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_credential_file_of_a_mebibyte_is_read_and_one_byte_more_refused() {
        let dir = std::env::temp_dir().join(format!("load-size-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, vec![b'a'; MAX_FILE_BYTES]).unwrap();
        let read = Reader::default().read(&file, "token").unwrap();
        assert_eq!(read.len(), MAX_FILE_BYTES);
        std::fs::write(&file, vec![b'a'; MAX_FILE_BYTES + 1]).unwrap();
        let refused = Reader::default().read(&file, "token").unwrap_err().problem;
        assert!(
            refused.contains("is larger than 1024 KiB: not a token"),
            "{refused}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `openssl ARGS` in `dir`, which must succeed.
    fn openssl(dir: &Path, args: &[&str]) {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A client certificate of X.509 version 1, as `openssl x509 -req` makes without an
    /// extension file (the API server accepts one), is loaded with its key, and a client is
    /// built on it; with another key it is refused as not the key's.
    #[tokio::test(flavor = "current_thread")]
    async fn a_version_1_client_certificate_is_loaded_and_a_client_built_on_it() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        let mut ca = vec!["req", "-x509", "-days", "1", "-subj", "/CN=ca"];
        ca.extend(ec);
        ca.extend(["-keyout", "ca.key", "-out", "ca.crt"]);
        openssl(d, &ca);
        let mut csr = vec!["req", "-subj", "/O=system:nodes/CN=system:node:a"];
        csr.extend(ec);
        csr.extend(["-keyout", "client.key", "-out", "client.csr"]);
        openssl(d, &csr);
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                "client.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "1",
                "-out",
                "client.crt",
            ],
        );
        let crt = std::fs::read(d.join("client.crt")).unwrap();
        let der = CertificateDer::from_pem_slice(&crt).unwrap();
        assert!(super::super::tls::is_version_1(&der), "not version 1");

        let user = |key: &str| {
            format!(
                "    client-certificate: {}\n    client-key: {}\n",
                d.join("client.crt").display(),
                d.join(key).display()
            )
        };
        let cluster = format!(
            "    certificate-authority: {}\n",
            d.join("ca.crt").display()
        );
        let path = d.join("kubeconfig");
        let loaded = load_kubeconfig(&path, &cluster, &user("client.key"), "--kubeconfig")
            .result
            .unwrap_or_else(|e| panic!("{}", e.problem));
        let held = loaded.held.iter().find(|h| h.kind == "user").unwrap();
        assert_eq!(held.certificate.subject_cn, "system:node:a");
        assert!(
            super::super::client(loaded.config).is_ok(),
            "no client is built on a version 1 certificate"
        );

        openssl(
            d,
            &[
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-out",
                "other.key",
            ],
        );
        let refused = load_kubeconfig(&path, &cluster, &user("other.key"), "--kubeconfig")
            .result
            .err()
            .expect("another key is refused")
            .problem;
        assert!(
            refused.contains("do not go together: the key is not the certificate's"),
            "{refused}"
        );
    }

    #[test]
    fn where_the_trust_and_the_client_certificate_come_from_is_named() {
        use base64::Engine;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let now = crate::bundle::test_certs::now();
        let ca = crate::bundle::test_certs::ca(Some("api-ca"), None, now - 3600, now + 86400);
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "system:node:a");
        let cert = params.self_signed(&key).unwrap();
        let dir = std::env::temp_dir().join(format!("load-origin-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kubeconfig");
        let load_with = |cluster: &str, user: &str| {
            load_kubeconfig(&path, cluster, user, "--kubeconfig")
                .result
                .unwrap()
        };
        let inline = load_with(
            &format!("    certificate-authority-data: {}\n", b64(ca.pem())),
            &format!(
                "    client-certificate-data: {}\n    client-key-data: {}\n",
                b64(cert.pem().as_bytes()),
                b64(key.serialize_pem().as_bytes())
            ),
        );
        assert!(
            inline
                .ca_origin
                .starts_with("certificate-authority-data of cluster \"c\" in kubeconfig"),
            "{}",
            inline.ca_origin
        );
        let client = inline.client_certificate_origin.unwrap();
        assert!(
            client.starts_with("client-certificate-data of user \"u\" in kubeconfig"),
            "{client}"
        );
        let kinds: Vec<&str> = inline.held.iter().map(|h| h.kind).collect();
        assert!(
            kinds.contains(&"cluster") && kinds.contains(&"user"),
            "{kinds:?}"
        );

        let insecure = load_with("    insecure-skip-tls-verify: true\n", "    token: abc\n");
        assert_eq!(insecure.ca_origin, "nothing (insecure-skip-tls-verify)");
        assert_eq!(insecure.client_certificate_origin, None);
        let roots = load_with("", "    token: abc\n");
        assert_eq!(roots.ca_origin, "the system's trusted roots");
        // A client certificate and key in files beside the kubeconfig.
        std::fs::write(dir.join("client.crt"), cert.pem()).unwrap();
        std::fs::write(dir.join("client.key"), key.serialize_pem()).unwrap();
        let files = load_with(
            "",
            &format!(
                "    client-certificate: {}\n    client-key: {}\n",
                dir.join("client.crt").display(),
                dir.join("client.key").display()
            ),
        );
        assert_eq!(
            files.client_certificate_origin,
            Some(format!(
                "client-certificate {}",
                dir.join("client.crt").display()
            ))
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn relative_paths_are_the_kubeconfigs_and_in_cluster_config_takes_the_pods_namespace() {
        let now = crate::bundle::test_certs::now();
        let ca = crate::bundle::test_certs::ca(Some("api-ca"), None, now - 3600, now + 86400);
        let dir = std::env::temp_dir().join(format!("load-relative-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("kube")).unwrap();
        std::fs::write(dir.join("kube/ca.crt"), ca.pem()).unwrap();
        std::fs::write(dir.join("kube/token"), "a-token\n").unwrap();
        let path = dir.join("kube/kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\n    certificate-authority: ca.crt\nusers:\n- name: u\n  user:\n    tokenFile: token\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n",
        )
        .unwrap();
        // Read from the kubeconfig's directory, whatever the agent's own.
        let loaded = load(&Origin::Kubeconfig {
            paths: vec![path.clone()],
            chosen_by: "--kubeconfig",
            pick: Pick::default(),
        })
        .result
        .unwrap();
        let ca_file = dir.join("kube/ca.crt");
        assert_eq!(
            loaded.ca_origin,
            format!("certificate-authority {}", ca_file.display())
        );
        let token = loaded.config.auth_info.token.as_ref().unwrap();
        assert_eq!(token.expose_secret(), "a-token");

        let in_cluster = |namespace: Option<&str>| {
            let sa = dir.join("sa");
            let _ = std::fs::remove_dir_all(&sa);
            std::fs::create_dir_all(&sa).unwrap();
            std::fs::write(sa.join("ca.crt"), ca.pem()).unwrap();
            std::fs::write(sa.join("token"), "a-token\n").unwrap();
            if let Some(namespace) = namespace {
                std::fs::write(sa.join("namespace"), namespace).unwrap();
            }
            load(&Origin::InCluster {
                server: "https://10.0.0.1:443".into(),
                dir: sa,
            })
            .result
            .unwrap()
            .config
            .default_namespace
        };
        assert_eq!(in_cluster(Some("kubelet-ca-agent\n")), "kubelet-ca-agent");
        assert_eq!(in_cluster(None), "default");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A kubeconfig of clusters `(name, port)`, token users `(name, token)`, contexts
    /// `(name, cluster, user)` and a current-context.
    fn kubeconfig_text(
        clusters: &[(&str, u16)],
        users: &[(&str, &str)],
        contexts: &[(&str, &str, &str)],
        current: &str,
    ) -> String {
        let mut text = "apiVersion: v1\nkind: Config\nclusters:\n".to_string();
        for (name, port) in clusters {
            text.push_str(&format!(
                "- name: {name}\n  cluster:\n    server: https://127.0.0.1:{port}\n"
            ));
        }
        text.push_str("users:\n");
        for (name, token) in users {
            text.push_str(&format!("- name: {name}\n  user:\n    token: {token}\n"));
        }
        text.push_str("contexts:\n");
        for (name, cluster, user) in contexts {
            text.push_str(&format!(
                "- name: {name}\n  context:\n    cluster: {cluster}\n    user: {user}\n"
            ));
        }
        text.push_str(&format!("current-context: \"{current}\"\n"));
        text
    }

    /// The server and the token of the credentials `paths` and `pick` make, or why none.
    fn picked(paths: &[&Path], pick: Pick) -> Result<(String, String), String> {
        let loaded = load(&Origin::Kubeconfig {
            paths: paths.iter().map(|p| p.to_path_buf()).collect(),
            chosen_by: "$KUBECONFIG",
            pick,
        })
        .result
        .map_err(|e| e.problem)?;
        let token = loaded
            .config
            .auth_info
            .token
            .as_ref()
            .map(|t| t.expose_secret().to_string())
            .unwrap_or_default();
        Ok((loaded.server, token))
    }

    #[test]
    fn a_context_cluster_and_user_are_picked_as_kubectl_picks_them() {
        let dir = std::env::temp_dir().join(format!("load-pick-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config");
        std::fs::write(
            &path,
            kubeconfig_text(
                &[("prod", 1), ("staging", 2)],
                &[("admin", "t-admin"), ("viewer", "t-viewer")],
                &[("prod", "prod", "admin"), ("staging", "staging", "viewer")],
                "staging",
            ),
        )
        .unwrap();
        let pick = |context: Option<&str>, cluster: Option<&str>, user: Option<&str>| Pick {
            context: context.map(Into::into),
            cluster: cluster.map(Into::into),
            user: user.map(Into::into),
        };
        let at = |port: u16, token: &str| Ok((format!("https://127.0.0.1:{port}"), token.into()));
        assert_eq!(picked(&[&path], Pick::default()), at(2, "t-viewer"));
        // The picked context's namespace is the client's default one.
        let text = std::fs::read_to_string(&path).unwrap().replace(
            "- name: prod\n  context:\n",
            "- name: prod\n  context:\n    namespace: ops\n",
        );
        let namespaced = dir.join("namespaced");
        std::fs::write(&namespaced, text).unwrap();
        let namespace = |pick: Pick| {
            load(&Origin::Kubeconfig {
                paths: vec![namespaced.clone()],
                chosen_by: "--kubeconfig",
                pick,
            })
            .result
            .unwrap()
            .config
            .default_namespace
        };
        assert_eq!(namespace(pick(Some("prod"), None, None)), "ops");
        assert_eq!(namespace(Pick::default()), "default");
        assert_eq!(
            picked(&[&path], pick(Some("prod"), None, None)),
            at(1, "t-admin")
        );
        assert_eq!(
            picked(&[&path], pick(Some("prod"), None, Some("viewer"))),
            at(1, "t-viewer")
        );
        assert_eq!(
            picked(&[&path], pick(None, Some("prod"), None)),
            at(1, "t-viewer")
        );
        let nope = picked(&[&path], pick(Some("nope"), None, None)).unwrap_err();
        assert!(
            nope.ends_with("--context \"nope\" is not among its contexts"),
            "{nope}"
        );
        let nope = picked(&[&path], pick(None, Some("nope"), None)).unwrap_err();
        assert!(nope.ends_with("no cluster named \"nope\""), "{nope}");
        let nope = picked(&[&path], pick(None, None, Some("nope"))).unwrap_err();
        assert!(nope.ends_with("no user named \"nope\""), "{nope}");
        // No current-context: --context names one, or --cluster and --user make one.
        let bare = dir.join("bare");
        std::fs::write(
            &bare,
            kubeconfig_text(
                &[("prod", 1)],
                &[("admin", "t")],
                &[("prod", "prod", "admin")],
                "",
            ),
        )
        .unwrap();
        let none = picked(&[&bare], Pick::default()).unwrap_err();
        assert!(none.ends_with("has no current-context"), "{none}");
        assert_eq!(picked(&[&bare], pick(Some("prod"), None, None)), at(1, "t"));
        assert_eq!(
            picked(&[&bare], pick(None, Some("prod"), Some("admin"))),
            at(1, "t")
        );
        // What is picked is said with the origin.
        let origin = Origin::resolve_kubectl(Some(&path), pick(Some("prod"), None, Some("u")));
        assert_eq!(
            origin.unwrap().describe(),
            format!(
                "kubeconfig {} (--kubeconfig), context \"prod\", user \"u\"",
                path.display()
            )
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kubeconfig_files_merge_as_kubectl_merges_them() {
        let dir = std::env::temp_dir().join(format!("load-merge-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (first, second) = (dir.join("first"), dir.join("second"));
        // The first file sets no current-context; both name a cluster "shared".
        std::fs::write(
            &first,
            kubeconfig_text(
                &[("shared", 1)],
                &[("me", "t-first")],
                &[("one", "shared", "me")],
                "",
            ),
        )
        .unwrap();
        std::fs::write(
            &second,
            kubeconfig_text(
                &[("shared", 2), ("own", 3)],
                &[("me", "t-second"), ("other", "t-other")],
                &[("one", "own", "other"), ("two", "shared", "other")],
                "two",
            ),
        )
        .unwrap();
        let at = |port: u16, token: &str| Ok((format!("https://127.0.0.1:{port}"), token.into()));
        // current-context from the first file that sets one; each name from the first file
        // that has it, whole.
        assert_eq!(
            picked(&[&first, &second], Pick::default()),
            at(1, "t-other")
        );
        let one = Pick {
            context: Some("one".into()),
            ..Pick::default()
        };
        assert_eq!(picked(&[&first, &second], one.clone()), at(1, "t-first"));
        assert_eq!(picked(&[&second, &first], one), at(3, "t-other"));
        // A file of the list that does not exist is skipped; with none there, it is said.
        let missing = dir.join("missing");
        assert_eq!(
            picked(&[&missing, &first, &second], Pick::default()),
            at(1, "t-other")
        );
        let attempt = load(&Origin::Kubeconfig {
            paths: vec![missing.clone(), first.clone()],
            chosen_by: "$KUBECONFIG",
            pick: Pick::default(),
        });
        assert!(
            attempt.files.contains(&missing),
            "watched, to be read when it comes"
        );
        let none = picked(&[&missing, &dir.join("gone")], Pick::default()).unwrap_err();
        assert!(
            none.starts_with(&format!("kubeconfig {} does not exist", missing.display())),
            "{none}"
        );
        // A file that is there but broken is not skipped.
        std::fs::write(dir.join("broken"), "clusters: [").unwrap();
        let broken = picked(&[&dir.join("broken"), &first], Pick::default()).unwrap_err();
        assert!(broken.contains("is not a valid kubeconfig"), "{broken}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn kubectl_finds_its_kubeconfig_before_the_pods_service_account() {
        let resolve = |vars: &[(&str, &str)], pick: Pick, home: Found| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            Origin::resolve_in(
                None,
                Some(pick),
                move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.into()),
                move |path| {
                    if path == Path::new("/root/.kube/config") {
                        home
                    } else {
                        Found::Missing
                    }
                },
            )
        };
        let pod = [
            ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("HOME", "/root"),
        ];
        let in_cluster = Ok(Origin::InCluster {
            server: "https://10.0.0.1:443".into(),
            dir: PathBuf::from(SERVICE_ACCOUNT_DIR),
        });
        assert_eq!(resolve(&pod, Pick::default(), Found::Missing), in_cluster);
        let home = Ok(Origin::Kubeconfig {
            paths: vec![PathBuf::from("/root/.kube/config")],
            chosen_by: "the default ~/.kube/config",
            pick: Pick::default(),
        });
        assert_eq!(resolve(&pod, Pick::default(), Found::Kubeconfig), home);
        let mut with_kubeconfig = pod.to_vec();
        with_kubeconfig.push(("KUBECONFIG", "/a:/b:/a"));
        assert_eq!(
            resolve(&with_kubeconfig, Pick::default(), Found::Missing),
            Ok(Origin::Kubeconfig {
                paths: vec![PathBuf::from("/a"), PathBuf::from("/b")],
                chosen_by: "$KUBECONFIG",
                pick: Pick::default(),
            })
        );
        // A context is a kubeconfig's: with one picked, the service account is not taken.
        let context = Pick {
            context: Some("prod".into()),
            ..Pick::default()
        };
        assert_eq!(
            resolve(&pod, context.clone(), Found::Missing),
            Ok(Origin::Kubeconfig {
                paths: vec![PathBuf::from("/root/.kube/config")],
                chosen_by: "the default ~/.kube/config",
                pick: context,
            })
        );
    }

    #[test]
    fn empty_fields_are_as_if_absent_and_a_file_that_cannot_be_opened_is_not_said_missing() {
        let now = crate::bundle::test_certs::now();
        let ca = crate::bundle::test_certs::ca(Some("api-ca"), None, now - 3600, now + 86400);
        let dir = std::env::temp_dir().join(format!("load-empty-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
        let path = dir.join("kubeconfig");
        let load_with =
            |cluster: &str, user: &str| load_kubeconfig(&path, cluster, user, "$KUBECONFIG").result;
        // Empty CA data: the CA file; an empty CA file name: the system's roots; empty
        // client certificate data: no client certificate.
        let file = load_with(
            "    certificate-authority-data: \"\"\n    certificate-authority: ca.crt\n",
            "    token: abc\n    client-certificate-data: \"\"\n",
        )
        .unwrap();
        assert!(
            file.ca_origin.starts_with("certificate-authority "),
            "{}",
            file.ca_origin
        );
        assert_eq!(file.client_certificate_origin, None);
        let roots = load_with(
            "    certificate-authority: \"\"\n",
            "    token: abc\n    client-certificate: \"\"\n    client-key: \"\"\n    client-key-data: \"\"\n",
        )
        .unwrap();
        assert_eq!(roots.client_certificate_origin, None);
        assert_eq!(roots.ca_origin, "the system's trusted roots");
        // A kubeconfig that cannot be opened (a link to itself) is not "missing".
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&path, &path).unwrap();
        let problem = load(&Origin::Kubeconfig {
            paths: vec![path.clone()],
            chosen_by: "--kubeconfig",
            pick: Pick::default(),
        })
        .result
        .err()
        .unwrap()
        .problem;
        assert!(problem.contains("cannot read it"), "{problem}");
        assert!(!problem.contains("does not exist"), "{problem}");
        assert!(!problem.contains("on a new node"), "{problem}");
        // The new node's hint is for --kubeconfig only.
        let missing = load(&Origin::Kubeconfig {
            paths: vec![dir.join("nowhere")],
            chosen_by: "$KUBECONFIG",
            pick: Pick::default(),
        })
        .result
        .err()
        .unwrap()
        .problem;
        assert!(missing.ends_with("does not exist"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The origin on a node, with `files` as what is on its disk and `home` as $HOME.
    fn on_node(home: Option<&str>, files: &[(&str, Found)]) -> Result<Origin, String> {
        let files: Vec<(PathBuf, Found)> =
            files.iter().map(|(p, f)| (PathBuf::from(p), *f)).collect();
        Origin::resolve_in(
            None,
            None,
            |name| (name == "HOME").then(|| home.map(Into::into)).flatten(),
            move |path| {
                files
                    .iter()
                    .find(|(p, _)| p == path)
                    .map_or(Found::Missing, |(_, f)| *f)
            },
        )
    }

    fn kubeconfig_origin(path: &str, chosen_by: &'static str) -> Result<Origin, String> {
        Ok(Origin::Kubeconfig {
            paths: vec![PathBuf::from(path)],
            chosen_by,
            pick: Pick::default(),
        })
    }

    #[test]
    fn without_a_home_kubeconfig_the_kubelets_own_is_taken_where_the_distribution_puts_it() {
        use Found::{Kubeconfig, NotKubeconfig};
        let kubeadm = "/etc/kubernetes/kubelet.conf";
        let openshift = "/var/lib/kubelet/kubeconfig";
        // A kubeadm node, run as root with no ~/.kube/config: the kubelet's kubeconfig.
        let origin = on_node(Some("/root"), &[(kubeadm, Kubeconfig)]);
        assert_eq!(
            origin,
            kubeconfig_origin(kubeadm, "the kubelet's kubeconfig on kubeadm")
        );
        assert_eq!(
            origin.unwrap().describe(),
            "kubeconfig /etc/kubernetes/kubelet.conf (the kubelet's kubeconfig on kubeadm)"
        );
        // OpenShift's, and it comes first when both are there.
        for files in [
            vec![(openshift, Kubeconfig)],
            vec![(openshift, Kubeconfig), (kubeadm, Kubeconfig)],
        ] {
            assert_eq!(
                on_node(None, &files),
                kubeconfig_origin(openshift, "the kubelet's kubeconfig on OpenShift")
            );
        }
        // A file there that is not a kubeconfig is passed over.
        assert_eq!(
            on_node(None, &[(openshift, NotKubeconfig), (kubeadm, Kubeconfig)]),
            kubeconfig_origin(kubeadm, "the kubelet's kubeconfig on kubeadm")
        );
        // ~/.kube/config, when it is there, comes first (SPEC 3's order).
        assert_eq!(
            on_node(
                Some("/root"),
                &[("/root/.kube/config", Kubeconfig), (kubeadm, Kubeconfig)]
            ),
            kubeconfig_origin("/root/.kube/config", "the default ~/.kube/config")
        );
        // A new node: the bootstrap kubeconfig says which one the kubelet will write.
        assert_eq!(
            on_node(
                Some("/root"),
                &[("/etc/kubernetes/bootstrap-kubelet.conf", Kubeconfig)]
            ),
            kubeconfig_origin(kubeadm, "the kubelet's kubeconfig on kubeadm")
        );
        assert_eq!(
            on_node(None, &[("/etc/kubernetes/kubeconfig", Kubeconfig)]),
            kubeconfig_origin(openshift, "the kubelet's kubeconfig on OpenShift")
        );
        // Nothing at all: ~/.kube/config as before, else an error naming where it looked.
        assert_eq!(
            on_node(Some("/root"), &[]),
            kubeconfig_origin("/root/.kube/config", "the default ~/.kube/config")
        );
        let none = on_node(None, &[]).unwrap_err();
        assert!(
            none.contains("/etc/kubernetes/kubelet.conf") && none.contains(openshift),
            "{none}"
        );
    }

    #[test]
    fn a_missing_kubeconfig_on_a_kubeadm_node_names_the_kubelets_and_promises_no_bootstrap() {
        let openshift = Path::new("/var/lib/kubelet/kubeconfig");
        let kubeadm = Path::new("/etc/kubernetes/kubelet.conf");
        let hint = missing_hint(openshift, "--kubeconfig", true);
        assert!(!hint.contains("bootstrap"), "{hint}");
        assert!(
            hint.contains("kubeadm node") && hint.contains("/etc/kubernetes/kubelet.conf"),
            "{hint}"
        );
        assert!(hint.contains("KUBELET_CA_AGENT_KUBECONFIG"), "{hint}");
        let hint = missing_hint(
            Path::new("/root/.kube/config"),
            "the default ~/.kube/config",
            true,
        );
        assert!(
            hint.contains("/etc/kubernetes/kubelet.conf") && hint.contains("pass --kubeconfig"),
            "{hint}"
        );
        // Elsewhere, the kubelet's own kubeconfig is still to come after its bootstrap.
        for (path, chosen_by) in [
            (openshift, "--kubeconfig"),
            (openshift, "the kubelet's kubeconfig on OpenShift"),
            (kubeadm, "the kubelet's kubeconfig on kubeadm"),
        ] {
            let hint = missing_hint(path, chosen_by, false);
            assert!(
                hint.contains("after its TLS bootstrap"),
                "{chosen_by}: {hint}"
            );
        }
        assert!(missing_hint(kubeadm, "--kubeconfig", true).contains("TLS bootstrap"));
        let hint = missing_hint(
            Path::new("/root/.kube/config"),
            "the default ~/.kube/config",
            false,
        );
        assert!(
            hint.contains("/var/lib/kubelet/kubeconfig or /etc/kubernetes/kubelet.conf"),
            "{hint}"
        );
        assert_eq!(missing_hint(Path::new("/k"), "$KUBECONFIG", false), "");
    }

    #[test]
    fn a_kubeconfig_is_told_from_another_file_and_from_none() {
        let dir = std::env::temp_dir().join(format!("kca-found-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("kubelet.conf");
        std::fs::write(
            &config,
            "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: https://127.0.0.1:6443}}]\n",
        )
        .unwrap();
        let other = dir.join("other");
        std::fs::write(&other, "KUBELET_EXTRA_ARGS=--v=2\n").unwrap();
        assert_eq!(Found::probe(&config), Found::Kubeconfig);
        assert_eq!(Found::probe(&other), Found::NotKubeconfig);
        assert_eq!(Found::probe(&dir), Found::NotKubeconfig);
        assert_eq!(Found::probe(&dir.join("none")), Found::Missing);
        // YAML with no cluster is no kubeconfig to use.
        let empty = dir.join("empty.conf");
        std::fs::write(&empty, "apiVersion: v1\nkind: Config\nclusters: []\n").unwrap();
        assert_eq!(Found::probe(&empty), Found::NotKubeconfig);
        // A path that cannot be looked at (under a regular file) is not said missing.
        assert_eq!(Found::probe(&other.join("x")), Found::NotKubeconfig);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_explicit_kubeconfig_is_the_origin_even_before_it_exists() {
        let origin = Origin::resolve(Some(Path::new("/nonexistent/kubeconfig"))).unwrap();
        assert_eq!(
            origin,
            Origin::Kubeconfig {
                paths: vec![PathBuf::from("/nonexistent/kubeconfig")],
                chosen_by: "--kubeconfig",
                pick: Pick::default(),
            }
        );
        let attempt = load(&origin);
        let problem = attempt.result.err().unwrap().problem;
        assert!(
            problem.starts_with("kubeconfig /nonexistent/kubeconfig does not exist yet"),
            "{problem}"
        );
        assert!(attempt.files.contains(Path::new("/nonexistent/kubeconfig")));
    }
}
