//! Where the signer certificates come from: the `--source` grammar (SPEC 3 and 4b) and the
//! local sources `file:` and `dir:`. Cluster sources (`configmap:`, `controllerconfig:`) are
//! parsed and validated here too; reading them lives with the cluster client.

pub mod cluster;
pub mod local;
pub mod state;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::bundle::parse::Skipped;
use crate::bundle::{MAX_SOURCE_BYTES, Rejection, SourceCertificates, parse_source};
use crate::files::Local;

/// The ConfigMap key used when a `configmap:` spec names none.
pub const DEFAULT_CONFIGMAP_KEY: &str = "ca-bundle.crt";

/// The ControllerConfig field read when a `controllerconfig:` spec names none: the bundle
/// the kubelet's client CA comes from. The API requires it (every ControllerConfig has it),
/// so unlike the other fields it may not hold nothing.
pub const DEFAULT_CONTROLLERCONFIG_FIELD: &str = "kubeAPIServerServingCAData";

/// The ControllerConfig fields that are lists of registry CAs (`[{file, data}]`), not a PEM
/// bundle: sources of `--manage-registries` only (SPEC 4b).
pub const REGISTRY_LIST_FIELDS: &[&str] =
    &["imageRegistryBundleData", "imageRegistryBundleUserData"];

/// Which keys of a ConfigMap make up the source.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Keys {
    /// One key of `data` (or `binaryData`).
    One(String),
    /// Every key of `data` and `binaryData`, in key order (`/*`).
    All,
    /// Every key of `data` and `binaryData` that starts with the prefix, in key order
    /// (`/PREFIX*`): the publisher's `registry.*` keys, beside the other keys of its
    /// ConfigMap. A registry set reads each key with the prefix taken off.
    Prefix(String),
}

/// One `--source` spec, parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SourceSpec {
    ConfigMap {
        namespace: String,
        name: String,
        keys: Keys,
    },
    /// A field of the cluster-scoped ControllerConfig's `spec`: base64 of a PEM bundle, or
    /// one of the [`REGISTRY_LIST_FIELDS`].
    ControllerConfig {
        name: String,
        /// As the API names it (`cloudProviderCAData`), without `spec.`.
        field: String,
    },
    File(PathBuf),
    Dir(PathBuf),
}

impl SourceSpec {
    /// True for sources read from the API server.
    pub fn is_cluster(&self) -> bool {
        matches!(
            self,
            SourceSpec::ConfigMap { .. } | SourceSpec::ControllerConfig { .. }
        )
    }

    /// What is watched on disk for a local source; `None` for a cluster source.
    pub fn local(&self) -> Option<Local<'_>> {
        match self {
            SourceSpec::File(path) => Some(Local::File(path)),
            SourceSpec::Dir(dir) => Some(Local::Dir(dir)),
            _ => None,
        }
    }

    /// True for a ControllerConfig field that is a list of registry CAs ([`REGISTRY_LIST_FIELDS`]),
    /// which feeds `--manage-registries` and cannot be read as a bundle.
    pub fn is_registry_list(&self) -> bool {
        matches!(self, SourceSpec::ControllerConfig { field, .. } if REGISTRY_LIST_FIELDS.contains(&field.as_str()))
    }

    /// Refuses, as a usage error naming the spec, a spec that cannot be the source of one PEM
    /// file (`--source`, `--manage`): a registry list, whose entries are files of their own.
    pub fn check_bundle_source(&self) -> Result<(), SpecError> {
        match self {
            SourceSpec::ControllerConfig { field, .. } if self.is_registry_list() => {
                Err(SpecError {
                    spec: self.to_string(),
                    problem: not_a_bundle(field),
                })
            }
            _ => Ok(()),
        }
    }
}

impl SourceSpec {
    /// Refuses, as a usage error naming the spec, a spec that cannot feed a registry set
    /// (`--manage-registries`): anything but a ControllerConfig registry list, a whole
    /// ConfigMap (`configmap:NS/NAME/*`) or a `dir:` source.
    pub fn check_registry_source(&self) -> Result<(), SpecError> {
        let problem = match self {
            SourceSpec::ControllerConfig { .. } if self.is_registry_list() => return Ok(()),
            SourceSpec::ConfigMap {
                keys: Keys::All | Keys::Prefix(_),
                ..
            }
            | SourceSpec::Dir(_) => return Ok(()),
            SourceSpec::ControllerConfig { field, .. } => format!(
                "spec.{field} is one PEM bundle, not a list of registry CAs: a registry set reads {}",
                REGISTRY_LIST_FIELDS.join(" or ")
            ),
            SourceSpec::ConfigMap { .. } => "one key of a ConfigMap is one bundle, not a set of registries: write configmap:NS/NAME/* to take each key (host..port) as one registry, or configmap:NS/NAME/PREFIX* for the keys PREFIXhost..port".to_string(),
            SourceSpec::File(_) => "a file: source is one bundle, not a set of registries: use dir:PATH, whose <host..port>.crt files are one registry each".to_string(),
        };
        Err(SpecError {
            spec: self.to_string(),
            problem,
        })
    }
}

/// Why a registry list cannot be read as a bundle, and where it belongs instead.
pub fn not_a_bundle(field: &str) -> String {
    format!(
        "spec.{field} is a list of registry CAs ({{file, data}}), not a PEM bundle: it is a source of --manage-registries DIR=SPEC, not of --source or --manage"
    )
}

/// Why a `--source` spec does not parse. Always a usage error (exit 2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid source spec {spec:?}: {problem}")]
pub struct SpecError {
    pub spec: String,
    pub problem: String,
}

const SPEC_FORMS: &str = "expected configmap:NAMESPACE/NAME[/KEY|/PREFIX*|/*], controllerconfig:NAME[/FIELD], file:PATH or dir:PATH";

impl FromStr for SourceSpec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, SpecError> {
        let fail = |problem: String| SpecError {
            spec: spec.to_string(),
            problem,
        };
        let (kind, rest) = spec
            .split_once(':')
            .ok_or_else(|| fail(SPEC_FORMS.to_string()))?;
        match kind {
            "configmap" => {
                let parts: Vec<&str> = rest.split('/').collect();
                // `configmap:ns` and the like: say what is missing rather than list every
                // form.
                if let Some(problem) = missing_configmap_parts(&parts) {
                    return Err(fail(problem));
                }
                let (namespace, name, keys) = match parts[..] {
                    [ns, name] => (ns, name, Keys::One(DEFAULT_CONFIGMAP_KEY.to_string())),
                    [ns, name, "*"] => (ns, name, Keys::All),
                    [ns, name, key] => match key.strip_suffix('*') {
                        Some(prefix) => (ns, name, Keys::Prefix(prefix.to_string())),
                        None => (ns, name, Keys::One(key.to_string())),
                    },
                    _ => return Err(fail(SPEC_FORMS.to_string())),
                };
                check_dns_label("namespace", namespace).map_err(&fail)?;
                check_dns_subdomain("ConfigMap name", name).map_err(&fail)?;
                match &keys {
                    Keys::One(key) => check_configmap_key(key).map_err(&fail)?,
                    Keys::Prefix(prefix) => check_key_prefix(prefix).map_err(&fail)?,
                    Keys::All => {}
                }
                Ok(SourceSpec::ConfigMap {
                    namespace: namespace.to_string(),
                    name: name.to_string(),
                    keys,
                })
            }
            "controllerconfig" => {
                let (name, field) = match rest.split_once('/') {
                    Some((name, field)) => (name, Some(field)),
                    None => (rest, None),
                };
                if name.is_empty() {
                    return Err(fail(
                        "the ControllerConfig's name is missing: controllerconfig:NAME[/FIELD] (usually controllerconfig:machine-config-controller)".to_string(),
                    ));
                }
                check_dns_subdomain("ControllerConfig name", name).map_err(&fail)?;
                let field = match field {
                    None => DEFAULT_CONTROLLERCONFIG_FIELD,
                    Some(field) => {
                        check_controllerconfig_field(field).map_err(&fail)?;
                        field
                    }
                };
                Ok(SourceSpec::ControllerConfig {
                    name: name.to_string(),
                    field: field.to_string(),
                })
            }
            "file" | "dir" if rest.is_empty() => Err(fail(format!("{kind}: needs a path"))),
            "file" => Ok(SourceSpec::File(PathBuf::from(rest))),
            "dir" => Ok(SourceSpec::Dir(PathBuf::from(rest))),
            other => Err(fail(format!("unknown kind {other:?}; {SPEC_FORMS}"))),
        }
    }
}

impl fmt::Display for SourceSpec {
    /// The canonical spec: the `source` label of metrics and the name in every message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourceSpec::ConfigMap {
                namespace,
                name,
                keys: Keys::One(key),
            } if key == DEFAULT_CONFIGMAP_KEY => write!(f, "configmap:{namespace}/{name}"),
            SourceSpec::ConfigMap {
                namespace,
                name,
                keys: Keys::One(key),
            } => write!(f, "configmap:{namespace}/{name}/{key}"),
            SourceSpec::ConfigMap {
                namespace,
                name,
                keys: Keys::All,
            } => write!(f, "configmap:{namespace}/{name}/*"),
            SourceSpec::ConfigMap {
                namespace,
                name,
                keys: Keys::Prefix(prefix),
            } => write!(f, "configmap:{namespace}/{name}/{prefix}*"),
            // The default field unnamed, so that `controllerconfig:NAME`, the `source` label
            // of metrics long before fields could be named, stays as it was.
            SourceSpec::ControllerConfig { name, field }
                if field == DEFAULT_CONTROLLERCONFIG_FIELD =>
            {
                write!(f, "controllerconfig:{name}")
            }
            SourceSpec::ControllerConfig { name, field } => {
                write!(f, "controllerconfig:{name}/{field}")
            }
            SourceSpec::File(path) => write!(f, "file:{}", path.display()),
            SourceSpec::Dir(path) => write!(f, "dir:{}", path.display()),
        }
    }
}

/// Why a source could not be used this time. The last good content of the source is kept.
/// No variant carries source content: every one is safe to log.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("source {spec}: cannot read {path}: {error}")]
    Unreadable {
        spec: String,
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("source {spec}: rejected{}: {rejection}", in_part(.part))]
    Rejected {
        spec: String,
        /// Which part of the source: a file of a `dir:` source, a key of a ConfigMap.
        part: Option<String>,
        rejection: Rejection,
    },
    /// The object is there but not in the expected shape (a missing key, bad base64).
    #[error("source {spec}: {problem}")]
    Invalid {
        spec: String,
        reason: &'static str,
        problem: String,
    },
    /// The object does not exist, or was deleted.
    #[error("source {spec}: the object does not exist (deleted, or not created yet)")]
    NotFound { spec: String },
    /// The agent has no usable credentials for the API server (yet).
    #[error("source {spec}: no usable credentials for the API server: {problem}")]
    Credentials { spec: String, problem: String },
    /// The API server could not be asked, or refused.
    #[error("source {spec}: {error}")]
    Cluster {
        spec: String,
        reason: &'static str,
        error: String,
    },
}

fn in_part(part: &Option<String>) -> String {
    part.as_ref().map(|p| format!(" ({p})")).unwrap_or_default()
}

impl SourceError {
    /// The `reason` label of `kubelet_ca_source_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            SourceError::Unreadable { .. } => "unreadable",
            SourceError::Rejected { rejection, .. } => rejection.reason(),
            SourceError::Invalid { reason, .. } | SourceError::Cluster { reason, .. } => reason,
            SourceError::NotFound { .. } => "not_found",
            SourceError::Credentials { .. } => "credentials",
        }
    }

    /// The spec the error names.
    pub fn spec(&self) -> &str {
        match self {
            SourceError::Unreadable { spec, .. }
            | SourceError::Rejected { spec, .. }
            | SourceError::Invalid { spec, .. }
            | SourceError::NotFound { spec }
            | SourceError::Credentials { spec, .. }
            | SourceError::Cluster { spec, .. } => spec,
        }
    }

    /// The same error, naming `spec`: a failure of an object that several specs read (its
    /// watch, its absence) is told to each, under its own name.
    pub fn for_spec(&self, spec: &str) -> SourceError {
        let spec = spec.to_string();
        match self {
            SourceError::Unreadable { path, error, .. } => SourceError::Unreadable {
                spec,
                path: path.clone(),
                // io::Error is not Clone: its kind and text are what a reader sees of it.
                error: std::io::Error::new(error.kind(), error.to_string()),
            },
            SourceError::Rejected {
                part, rejection, ..
            } => SourceError::Rejected {
                spec,
                part: part.clone(),
                rejection: rejection.clone(),
            },
            SourceError::Invalid {
                reason, problem, ..
            } => SourceError::Invalid {
                spec,
                reason,
                problem: problem.clone(),
            },
            SourceError::NotFound { .. } => SourceError::NotFound { spec },
            SourceError::Credentials { problem, .. } => SourceError::Credentials {
                spec,
                problem: problem.clone(),
            },
            SourceError::Cluster { reason, error, .. } => SourceError::Cluster {
                spec,
                reason,
                error: error.clone(),
            },
        }
    }
}

impl Clone for SourceError {
    fn clone(&self) -> SourceError {
        self.for_spec(self.spec())
    }
}

/// Parses a source made of several parts (the files of a `dir:` source, the keys of a
/// ConfigMap), in order, as one source: accepted whole or rejected whole, the size limit
/// applying to the sum, and at least one certificate needed in all.
pub fn parse_parts<'a>(
    spec: &str,
    parts: impl IntoIterator<Item = (Option<String>, &'a [u8])>,
) -> Result<SourceCertificates, SourceError> {
    let rejected = |part: Option<String>, rejection| SourceError::Rejected {
        spec: spec.to_string(),
        part,
        rejection,
    };
    let mut merged = SourceCertificates::default();
    let mut total = 0;
    for (part, bytes) in parts {
        total += bytes.len();
        if total > MAX_SOURCE_BYTES {
            let rejection = Rejection::TooLarge {
                size: total,
                limit: MAX_SOURCE_BYTES,
            };
            return Err(rejected(part, rejection));
        }
        match parse_source(bytes) {
            Ok(parsed) => {
                merged.certificates.extend(parsed.certificates);
                // A block index alone does not say which file or key it is in.
                merged
                    .not_ca
                    .extend(parsed.not_ca.into_iter().map(|skipped| Skipped {
                        source: Some(spec.to_string()),
                        part: part.clone(),
                        ..skipped
                    }));
            }
            // An empty part among others is fine; the source as a whole needs a certificate.
            Err(Rejection::NoCertificate) => {}
            Err(rejection) => return Err(rejected(part, rejection)),
        }
    }
    if merged.certificates.is_empty() && merged.not_ca.is_empty() {
        return Err(rejected(None, Rejection::NoCertificate));
    }
    Ok(merged)
}

/// Certificates that are not CAs are left out, with a warning naming each and where it is:
/// the file (of a `dir:` source) or key (of a ConfigMap), and the block.
pub fn warn_not_ca(spec: &SourceSpec, parsed: &SourceCertificates) {
    for skipped in &parsed.not_ca {
        let place = match &skipped.part {
            Some(part) => format!("{part}, block {}", skipped.block),
            None => format!("block {}", skipped.block),
        };
        tracing::warn!(
            source = %spec,
            part = skipped.part.as_deref(),
            block = skipped.block,
            subject = %skipped.certificate.display_name(),
            sha256 = %skipped.certificate.fingerprint(),
            reason = "not_ca",
            "left out {} ({place}): it is not a CA (basicConstraints CA:TRUE is missing), so the kubelet cannot verify clients with it",
            skipped.certificate.display_name()
        );
    }
}

/// What a `configmap:` spec lacks, when a part before the key is empty or absent
/// (`configmap:`, `configmap:ns`, `configmap:ns/`, `configmap:/name`), said as such.
fn missing_configmap_parts(parts: &[&str]) -> Option<String> {
    let namespace = parts.first().is_none_or(|p| p.is_empty());
    let name = parts.get(1).is_none_or(|p| p.is_empty());
    let missing = match (namespace, name) {
        (false, false) => return None,
        (true, true) => "the namespace and name are missing",
        (true, false) => "the namespace is missing",
        (false, true) => "the ConfigMap's name is missing",
    };
    Some(format!(
        "{missing}: NAMESPACE/NAME expected, e.g. openshift-config-managed/kube-apiserver-client-ca"
    ))
}

/// RFC 1123 label, as Kubernetes requires of namespaces.
fn check_dns_label(what: &str, value: &str) -> Result<(), String> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    ok.then_some(()).ok_or_else(|| {
        format!(
            "{what} {value:?} is not a valid name (lower-case letters, digits and '-', at most 63)"
        )
    })
}

/// RFC 1123 subdomain, as Kubernetes requires of most object names.
fn check_dns_subdomain(what: &str, value: &str) -> Result<(), String> {
    let ok = !value.is_empty()
        && value.len() <= 253
        && value
            .split('.')
            .all(|label| check_dns_label(what, label).is_ok());
    ok.then_some(()).ok_or_else(|| {
        format!("{what} {value:?} is not a valid name (lower-case letters, digits, '-' and '.', at most 253)")
    })
}

/// A ControllerConfig field as the API's JSON names it: letters and digits, starting with a
/// lower-case letter (`cloudProviderCAData`). One field of `spec`, never a path.
fn check_controllerconfig_field(field: &str) -> Result<(), String> {
    if field.is_empty() {
        return Err("the field is missing after '/': controllerconfig:NAME/FIELD, e.g. controllerconfig:machine-config-controller/cloudProviderCAData".to_string());
    }
    let ok = field.starts_with(|c: char| c.is_ascii_lowercase())
        && field.bytes().all(|b| b.is_ascii_alphanumeric());
    if ok {
        return Ok(());
    }
    let hint = match field.strip_prefix("spec.") {
        Some(inner) => format!("; name the field of spec without \"spec.\" ({inner})"),
        None => String::new(),
    };
    Err(format!(
        "ControllerConfig field {field:?} is not a field name as the API writes it (letters and digits, starting with a lower-case letter, e.g. cloudProviderCAData){hint}"
    ))
}

/// The longest ConfigMap key.
const MAX_CONFIGMAP_KEY: usize = 253;

/// Whether `key` can be a key of a ConfigMap: `[-._a-zA-Z0-9]+`, at most 253 characters,
/// not `.` or `..` (as the API server validates them).
/// The default source (SPEC 3): OpenShift's ConfigMap of the kubelet's client CAs.
pub const DEFAULT_SOURCE: &str = "configmap:openshift-config-managed/kube-apiserver-client-ca";

/// The kubeadm-style source: the client CA that kube-apiserver itself publishes.
pub const KUBEADM_SOURCE: &str =
    "configmap:kube-system/extension-apiserver-authentication/client-ca-file";

/// What a look at the kubeadm-style source found, when the default one could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KubeadmSource {
    /// It is there: this is a kubeadm-style cluster.
    Exists,
    /// It is not there either.
    Missing,
    /// It could not be looked at (the identity may not read it, the server failed).
    Unknown,
}

/// What to add to the error of the default source when it does not exist or cannot be read
/// (`reason` of its [`SourceError`]), given what a look at [`KUBEADM_SOURCE`] found: the
/// source to use on a kubeadm-style cluster (SPEC 3). `None` for any other source or failure.
pub fn kubeadm_hint(spec: &str, reason: &str, found: KubeadmSource) -> Option<String> {
    if spec != DEFAULT_SOURCE || !matches!(reason, "not_found" | "forbidden") {
        return None;
    }
    match found {
        KubeadmSource::Exists => Some(format!(
            "; {spec} is OpenShift's, and this cluster has the kubeadm-style one: use --source {KUBEADM_SOURCE} (KUBELET_CA_AGENT_SOURCE)"
        )),
        KubeadmSource::Unknown => Some(format!(
            "; {spec} is OpenShift's default: on a kubeadm cluster use --source {KUBEADM_SOURCE} (KUBELET_CA_AGENT_SOURCE), and let this identity get, list and watch it (docs/operations.md, \"RBAC for the unit\")"
        )),
        KubeadmSource::Missing => None,
    }
}

pub fn is_configmap_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_CONFIGMAP_KEY
        && key != "."
        && key != ".."
        && key.bytes().all(is_configmap_key_byte)
}

fn is_configmap_key_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')
}

fn check_configmap_key(key: &str) -> Result<(), String> {
    is_configmap_key(key).then_some(()).ok_or_else(|| {
        format!("ConfigMap key {key:?} is not valid (letters, digits, '-', '_' and '.'), or use * for every key, PREFIX* for the keys that start with PREFIX")
    })
}

/// The PREFIX of `/PREFIX*`: the start of a key, so made of the same characters, and short
/// enough to leave room for at least one more.
fn check_key_prefix(prefix: &str) -> Result<(), String> {
    let ok = prefix.len() < MAX_CONFIGMAP_KEY && prefix.bytes().all(is_configmap_key_byte);
    ok.then_some(()).ok_or_else(|| {
        format!("{prefix:?} cannot start a ConfigMap key (letters, digits, '-', '_' and '.'): PREFIX* takes the keys that start with PREFIX")
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_missing_default_source_names_the_kubeadm_one_when_the_cluster_has_it() {
        let hint = kubeadm_hint(DEFAULT_SOURCE, "not_found", KubeadmSource::Exists).unwrap();
        assert!(hint.contains("use --source configmap:kube-system/extension-apiserver-authentication/client-ca-file"), "{hint}");
        let forbidden = kubeadm_hint(DEFAULT_SOURCE, "forbidden", KubeadmSource::Exists).unwrap();
        assert_eq!(forbidden, hint);
        let unknown = kubeadm_hint(DEFAULT_SOURCE, "forbidden", KubeadmSource::Unknown).unwrap();
        assert!(
            unknown.contains("on a kubeadm cluster use --source") && unknown.contains("RBAC"),
            "{unknown}"
        );
        assert_eq!(
            kubeadm_hint(DEFAULT_SOURCE, "not_found", KubeadmSource::Missing),
            None
        );
        assert_eq!(
            kubeadm_hint(DEFAULT_SOURCE, "unreachable", KubeadmSource::Exists),
            None
        );
        assert_eq!(
            kubeadm_hint("configmap:a/b", "not_found", KubeadmSource::Exists),
            None
        );
        assert_eq!(
            DEFAULT_SOURCE.parse::<SourceSpec>().unwrap().to_string(),
            DEFAULT_SOURCE
        );
        assert!(KUBEADM_SOURCE.parse::<SourceSpec>().is_ok());
    }

    use super::*;

    #[test]
    fn parses_every_kind_and_prints_it_back() {
        for spec in [
            "configmap:openshift-config-managed/kube-apiserver-client-ca",
            "configmap:kube-system/extension-apiserver-authentication/client-ca-file",
            "configmap:ns/name/*",
            "configmap:kubelet-ca-agent/kubelet-ca-agent/registry.*",
            "controllerconfig:machine-config-controller",
            "controllerconfig:machine-config-controller/cloudProviderCAData",
            "controllerconfig:machine-config-controller/imageRegistryBundleUserData",
            "controllerconfig:mcc/additionalTrustBundle",
            "file:/etc/pki/ca.crt",
            "dir:/etc/kubernetes/signers",
        ] {
            let parsed: SourceSpec = spec.parse().unwrap();
            assert_eq!(parsed.to_string(), spec);
        }
    }

    #[test]
    fn default_key_is_ca_bundle_crt() {
        let explicit: SourceSpec = "configmap:a/b/ca-bundle.crt".parse().unwrap();
        let implicit: SourceSpec = "configmap:a/b".parse().unwrap();
        assert_eq!(explicit, implicit);
        assert_eq!(explicit.to_string(), "configmap:a/b");
    }

    #[test]
    fn a_key_part_ending_in_a_star_is_a_prefix_and_a_lone_star_every_key() {
        let prefix: SourceSpec = "configmap:kubelet-ca-agent/kubelet-ca-agent/registry.*"
            .parse()
            .unwrap();
        assert_eq!(
            prefix,
            SourceSpec::ConfigMap {
                namespace: "kubelet-ca-agent".into(),
                name: "kubelet-ca-agent".into(),
                keys: Keys::Prefix("registry.".into()),
            }
        );
        assert_eq!(
            prefix.to_string(),
            "configmap:kubelet-ca-agent/kubelet-ca-agent/registry.*"
        );
        let all: SourceSpec = "configmap:ns/name/*".parse().unwrap();
        assert!(matches!(
            all,
            SourceSpec::ConfigMap {
                keys: Keys::All,
                ..
            }
        ));
        // A one-character prefix, and one that is a whole key's worth but one.
        let short: SourceSpec = "configmap:ns/name/r*".parse().unwrap();
        assert!(matches!(short, SourceSpec::ConfigMap { keys: Keys::Prefix(p), .. } if p == "r"));
        let longest = format!("configmap:ns/name/{}*", "k".repeat(252));
        assert_eq!(longest.parse::<SourceSpec>().unwrap().to_string(), longest);
        let too_long = format!("configmap:ns/name/{}*", "k".repeat(253));
        assert!(too_long.parse::<SourceSpec>().is_err());
        let err = "configmap:ns/name/bad prefix*"
            .parse::<SourceSpec>()
            .unwrap_err();
        assert!(
            err.problem.contains("cannot start a ConfigMap key"),
            "{err}"
        );
        // A prefix feeds a registry set, as every key does; it is one bundle's keys too.
        assert_eq!(prefix.check_registry_source(), Ok(()));
        assert_eq!(prefix.check_bundle_source(), Ok(()));
        let one: SourceSpec = "configmap:ns/name/registry.quay.io".parse().unwrap();
        let err = one.check_registry_source().unwrap_err();
        assert!(err.problem.contains("configmap:NS/NAME/PREFIX*"), "{err}");
    }

    #[test]
    fn configmap_keys_are_checked_as_the_api_server_checks_them() {
        for good in ["ca-bundle.crt", "registry.quay.io..5000", "_x", "a"] {
            assert!(is_configmap_key(good), "{good}");
        }
        let long = "k".repeat(254);
        for bad in ["", ".", "..", "[fd00::1]:5000", "a/b", "a b", long.as_str()] {
            assert!(!is_configmap_key(bad), "{bad}");
        }
    }

    #[test]
    fn a_spec_with_a_part_missing_says_which() {
        for (spec, says) in [
            ("configmap:ns-only", "the ConfigMap's name is missing"),
            ("configmap:ns-only/", "the ConfigMap's name is missing"),
            ("configmap:ns-only//key", "the ConfigMap's name is missing"),
            ("configmap:", "the namespace and name are missing"),
            ("configmap:/", "the namespace and name are missing"),
            ("configmap:/name", "the namespace is missing"),
            (
                "controllerconfig:",
                "the ControllerConfig's name is missing",
            ),
            (
                "controllerconfig:/cloudProviderCAData",
                "the ControllerConfig's name is missing",
            ),
            (
                "controllerconfig:machine-config-controller/",
                "the field is missing after '/'",
            ),
        ] {
            let err = spec.parse::<SourceSpec>().unwrap_err();
            assert!(err.problem.starts_with(says), "{spec}: {err}");
        }
        // A spec with every part still names the bad one by its rule.
        let err = "configmap:Bad_NS/name".parse::<SourceSpec>().unwrap_err();
        assert!(err.problem.contains("namespace \"Bad_NS\""), "{err}");
    }

    #[test]
    fn bad_specs_are_refused_with_the_spec_named() {
        for bad in [
            "",
            "configmap",
            "configmap:onlyname",
            "configmap:Bad_NS/name",
            "configmap:ns/name/key/extra",
            "configmap:ns/name/bad key",
            "configmap:ns/name/**",
            "configmap:ns/name/a*b",
            "configmap:ns/name/bad prefix*",
            "configmap:ns/",
            "controllerconfig:",
            "controllerconfig:UPPER",
            "controllerconfig:UPPER/cloudProviderCAData",
            "controllerconfig:mcc/",
            "controllerconfig:mcc/CloudProviderCAData",
            "controllerconfig:mcc/cloud-provider-ca",
            "controllerconfig:mcc/cloudProviderCAData/extra",
            "controllerconfig:mcc/spec.cloudProviderCAData",
            "controllerconfig:mcc/9field",
            "controllerconfig:mcc/field_1",
            "file:",
            "dir:",
            "secret:ns/name",
            "/etc/kubernetes/ca.crt",
        ] {
            let err = bad.parse::<SourceSpec>().unwrap_err();
            assert_eq!(err.spec, bad);
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn the_default_controllerconfig_field_is_kube_apiserver_serving_ca_data_and_stays_unnamed() {
        let implicit: SourceSpec = "controllerconfig:mcc".parse().unwrap();
        let explicit: SourceSpec = "controllerconfig:mcc/kubeAPIServerServingCAData"
            .parse()
            .unwrap();
        assert_eq!(implicit, explicit);
        assert_eq!(
            implicit,
            SourceSpec::ControllerConfig {
                name: "mcc".into(),
                field: DEFAULT_CONTROLLERCONFIG_FIELD.into()
            }
        );
        // The `source` label of metrics that existed before fields could be named.
        assert_eq!(explicit.to_string(), "controllerconfig:mcc");
        let cloud: SourceSpec = "controllerconfig:mcc/cloudProviderCAData".parse().unwrap();
        assert_ne!(cloud, implicit);
        assert_eq!(
            cloud,
            SourceSpec::ControllerConfig {
                name: "mcc".into(),
                field: "cloudProviderCAData".into()
            }
        );
    }

    #[test]
    fn a_bad_controllerconfig_field_is_refused_saying_what_a_field_is() {
        for (spec, says) in [
            (
                "controllerconfig:mcc/CloudProviderCAData",
                "starting with a lower-case letter",
            ),
            (
                "controllerconfig:mcc/cloud-provider-ca",
                "letters and digits",
            ),
            (
                "controllerconfig:mcc/a/b",
                "field \"a/b\" is not a field name",
            ),
            (
                "controllerconfig:mcc/spec.cloudProviderCAData",
                "without \"spec.\" (cloudProviderCAData)",
            ),
        ] {
            let err = spec.parse::<SourceSpec>().unwrap_err();
            assert!(err.problem.contains(says), "{spec}: {err}");
            assert!(err.to_string().contains(spec), "{err}");
        }
        let err = "nope:x".parse::<SourceSpec>().unwrap_err();
        assert!(
            err.problem.contains("controllerconfig:NAME[/FIELD]"),
            "{err}"
        );
    }

    #[test]
    fn the_registry_lists_are_told_apart_and_refused_as_a_bundle() {
        for field in REGISTRY_LIST_FIELDS {
            let spec: SourceSpec = format!("controllerconfig:mcc/{field}").parse().unwrap();
            assert!(spec.is_registry_list(), "{spec}");
            let err = spec.check_bundle_source().unwrap_err();
            assert_eq!(err.spec, format!("controllerconfig:mcc/{field}"));
            assert!(err.problem.contains("--manage-registries"), "{err}");
            assert!(err.problem.contains("not a PEM bundle"), "{err}");
        }
        for bundle in [
            "controllerconfig:mcc",
            "controllerconfig:mcc/cloudProviderCAData",
            "configmap:ns/name/*",
            "dir:/etc/pki/registries",
        ] {
            let spec: SourceSpec = bundle.parse().unwrap();
            assert!(!spec.is_registry_list(), "{spec}");
            assert_eq!(spec.check_bundle_source(), Ok(()));
        }
    }

    #[test]
    fn an_error_told_to_another_spec_names_that_spec_and_keeps_the_rest() {
        let error = SourceError::Cluster {
            spec: "controllerconfig:mcc".into(),
            reason: "unreachable",
            error: "https://127.0.0.1:6443: connection refused".into(),
        };
        let other = error.for_spec("controllerconfig:mcc/cloudProviderCAData");
        assert_eq!(other.spec(), "controllerconfig:mcc/cloudProviderCAData");
        assert_eq!(other.reason(), "unreachable");
        assert_eq!(
            other.to_string(),
            "source controllerconfig:mcc/cloudProviderCAData: https://127.0.0.1:6443: connection refused"
        );
        assert_eq!(error.clone().to_string(), error.to_string());
    }
}
