//! A kubeconfig as the agent reads and edits it (SPEC 4c): which cluster it keeps, that
//! cluster's CA data and server, and the same document with only that CA data changed.
//! Pure: bytes in, bytes out, no disk and no network.
//!
//! A kubeconfig may hold a user's key or token. Nothing here ever puts a value of the
//! document into an error: errors name clusters, contexts and files, never data.
//!
//! The edit keeps every other byte where it can: the old CA data, when it occurs once in
//! the text, is replaced in place (comments, order and quoting stay); otherwise the
//! document is written again from its parsed form. Either way the result is parsed back
//! and must equal the old document with that one value changed, or nothing is returned.

pub mod plan;
pub mod reach;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Map, Value};

/// Why a kubeconfig cannot be kept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KubeconfigError {
    #[error("not a kubeconfig: {0}")]
    NotKubeconfig(String),
    #[error("{0}")]
    Ambiguous(String),
    #[error(
        "its cluster {cluster} names the CA file {file} instead of holding CA data: keep that file with --manage"
    )]
    CaFile { cluster: String, file: String },
    #[error("the CA data of its cluster {0} is not base64")]
    NotBase64(String),
    #[error("cannot write it back: {0}")]
    Unwritable(String),
}

/// The cluster a kubeconfig keeps, as far as the agent needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    pub name: String,
    /// `server`, as written.
    pub server: String,
    pub tls_server_name: Option<String>,
    pub proxy_url: Option<String>,
    /// `certificate-authority-data`, decoded (PEM, as a rule); `None` when there is none.
    pub ca_data: Option<Vec<u8>>,
}

/// A parsed kubeconfig, and which of its clusters the agent keeps.
#[derive(Debug, Clone)]
pub struct Document {
    text: String,
    value: Value,
    /// The kept cluster's position in `clusters`.
    index: usize,
    cluster: Cluster,
}

const CA_DATA: &str = "certificate-authority-data";

impl Document {
    /// Parses `bytes` and finds the cluster to keep: the current context's, or the only
    /// one when there is no current context.
    pub fn parse(bytes: &[u8]) -> Result<Document, KubeconfigError> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| KubeconfigError::NotKubeconfig("not UTF-8 text".into()))?
            .to_string();
        let value = parse_value(&text)?;
        let (index, cluster) = kept_cluster(&value)?;
        Ok(Document {
            text,
            value,
            index,
            cluster,
        })
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// The document with the kept cluster's CA data set to base64 of `pem`, every other
    /// field as it was. The same bytes when the CA data is already `pem`.
    pub fn with_ca_data(&self, pem: &[u8]) -> Result<Vec<u8>, KubeconfigError> {
        let encoded = STANDARD.encode(pem);
        let mut expected = self.value.clone();
        cluster_fields_mut(&mut expected, self.index)
            .ok_or_else(|| KubeconfigError::Unwritable("its cluster moved".into()))?
            .insert(CA_DATA.to_string(), Value::String(encoded.clone()));
        if expected == self.value {
            return Ok(self.text.clone().into_bytes());
        }
        // In place: the old value's text replaced where it occurs, at the first occurrence
        // that reads back as `expected` (the same data may be another cluster's too), so
        // that comments, order and quoting stay.
        let old = cluster_fields(&self.value, self.index)
            .and_then(|c| c.get(CA_DATA))
            .and_then(Value::as_str)
            .filter(|old| !old.is_empty());
        if let Some(old) = old {
            for (at, _) in self.text.match_indices(old) {
                let edited = [&self.text[..at], &encoded, &self.text[at + old.len()..]].concat();
                if parse_value(&edited).ok().as_ref() == Some(&expected) {
                    return Ok(edited.into_bytes());
                }
            }
        }
        // Written again from its parsed form: every field keeps its value.
        let written = serde_saphyr::to_string(&expected)
            .map_err(|_| KubeconfigError::Unwritable("it cannot be written as YAML".into()))?;
        if parse_value(&written).ok().as_ref() != Some(&expected) {
            return Err(KubeconfigError::Unwritable(
                "written again, it would not read back the same".into(),
            ));
        }
        Ok(written.into_bytes())
    }
}

/// Whether two kubeconfigs say the same but for the CA data of the cluster each keeps
/// (`drift check`: that CA data is the agent's to change, the rest is not). Text that is
/// no kubeconfig is compared as bytes.
pub fn same_but_ca_data(a: &[u8], b: &[u8]) -> bool {
    let without = |bytes: &[u8]| {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut value = parse_value(text).ok()?;
        if let Ok((index, _)) = kept_cluster(&value)
            && let Some(fields) = cluster_fields_mut(&mut value, index)
        {
            fields.remove(CA_DATA);
        }
        Some(value)
    };
    match (without(a), without(b)) {
        (Some(a), Some(b)) => a == b,
        _ => a == b,
    }
}

/// Whether a kubeconfig holds a user's credentials (a key, a token, a password, or a
/// command or plugin that gets them): a source value that does is refused whole.
pub fn holds_credentials(value: &Value) -> bool {
    const SECRET: [&str; 7] = [
        "client-key-data",
        "client-key",
        "token",
        "tokenFile",
        "password",
        "exec",
        "auth-provider",
    ];
    value
        .get("users")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|u| u.get("user").and_then(Value::as_object))
        .any(|user| {
            SECRET
                .iter()
                .any(|k| user.get(*k).is_some_and(|v| !v.is_null()))
        })
}

/// The CA data of every cluster of a kubeconfig given as a source value (as
/// `kube-public/cluster-info` key `kubeconfig` on kubeadm), decoded, in cluster order.
/// `Ok(None)` when the bytes are no kubeconfig (`kind: Config` with clusters).
pub fn clusters_ca_data(bytes: &[u8]) -> Result<Option<Vec<Vec<u8>>>, KubeconfigError> {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Ok(None);
    };
    let Ok(value) = parse_value(text) else {
        return Ok(None);
    };
    if value.get("kind").and_then(Value::as_str) != Some("Config") {
        return Ok(None);
    }
    if holds_credentials(&value) {
        return Err(KubeconfigError::NotKubeconfig(
            "it holds a user's key or token: a source kubeconfig must hold clusters only".into(),
        ));
    }
    let mut all = Vec::new();
    for (i, named) in clusters(&value).iter().enumerate() {
        let name = cluster_name(named, i);
        if let Some(data) = named
            .get("cluster")
            .and_then(|c| c.get(CA_DATA))
            .and_then(Value::as_str)
        {
            all.push(decode(data).ok_or(KubeconfigError::NotBase64(name))?);
        }
    }
    Ok(Some(all))
}

fn decode(data: &str) -> Option<Vec<u8>> {
    let compact: String = data.split_ascii_whitespace().collect();
    STANDARD.decode(compact).ok()
}

/// A kubeconfig's text as a value; an error says where it does not parse, never what is
/// there.
fn parse_value(text: &str) -> Result<Value, KubeconfigError> {
    let value: Value = serde_saphyr::from_str(text).map_err(|e| {
        KubeconfigError::NotKubeconfig(match e.location() {
            Some(at) => format!("YAML that does not parse (line {})", at.line()),
            None => "YAML that does not parse".into(),
        })
    })?;
    if !value.is_object() {
        return Err(KubeconfigError::NotKubeconfig("not a mapping".into()));
    }
    Ok(value)
}

fn clusters(value: &Value) -> &[Value] {
    value
        .get("clusters")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn cluster_name(named: &Value, index: usize) -> String {
    named.get("name").and_then(Value::as_str).map_or_else(
        || format!("#{}", index + 1),
        |n| crate::text::escape(n).into_owned(),
    )
}

fn cluster_fields(value: &Value, index: usize) -> Option<&Map<String, Value>> {
    clusters(value).get(index)?.get("cluster")?.as_object()
}

fn cluster_fields_mut(value: &mut Value, index: usize) -> Option<&mut Map<String, Value>> {
    value
        .get_mut("clusters")?
        .as_array_mut()?
        .get_mut(index)?
        .get_mut("cluster")?
        .as_object_mut()
}

/// The cluster to keep: the current context's, or the only one.
fn kept_cluster(value: &Value) -> Result<(usize, Cluster), KubeconfigError> {
    let all = clusters(value);
    let names: Vec<String> = all
        .iter()
        .enumerate()
        .map(|(i, c)| cluster_name(c, i))
        .collect();
    let listed = || {
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    };
    let current = value
        .get("current-context")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty());
    let index = match current {
        Some(context) => {
            let shown = crate::text::escape(context).into_owned();
            let cluster = value
                .get("contexts")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|c| c.get("name").and_then(Value::as_str) == Some(context))
                .ok_or_else(|| {
                    KubeconfigError::Ambiguous(format!(
                        "its current context {shown} is not among its contexts"
                    ))
                })?
                .get("context")
                .and_then(|c| c.get("cluster"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    KubeconfigError::Ambiguous(format!(
                        "its current context {shown} names no cluster"
                    ))
                })?;
            all.iter()
                .position(|c| c.get("name").and_then(Value::as_str) == Some(cluster))
                .ok_or_else(|| {
                    KubeconfigError::Ambiguous(format!(
                        "its current context {shown} names the cluster {}, which is not among its clusters ({})",
                        crate::text::escape(cluster),
                        listed()
                    ))
                })?
        }
        None if all.len() == 1 => 0,
        None => {
            return Err(KubeconfigError::Ambiguous(format!(
                "it has no current context and {} clusters ({}): cannot tell which one to keep",
                all.len(),
                listed()
            )));
        }
    };
    let name = names[index].clone();
    let fields = cluster_fields(value, index).ok_or_else(|| {
        KubeconfigError::NotKubeconfig(format!("its cluster {name} has no fields"))
    })?;
    let text = |key: &str| {
        fields
            .get(key)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
    };
    if let Some(file) = text("certificate-authority") {
        return Err(KubeconfigError::CaFile {
            cluster: name,
            file: crate::text::escape(&file).into_owned(),
        });
    }
    let ca_data = match text(CA_DATA) {
        Some(data) => Some(decode(&data).ok_or_else(|| KubeconfigError::NotBase64(name.clone()))?),
        None => None,
    };
    let server = text("server").ok_or_else(|| {
        KubeconfigError::NotKubeconfig(format!("its cluster {name} has no server"))
    })?;
    Ok((
        index,
        Cluster {
            name,
            server,
            tls_server_name: text("tls-server-name"),
            proxy_url: text("proxy-url"),
            ca_data,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(s: &str) -> String {
        STANDARD.encode(s)
    }

    fn kubelet_kubeconfig(ca: &str) -> String {
        format!(
            "# the kubelet's\napiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: https://api-int.example:6443\n  name: local\ncontexts:\n- context:\n    cluster: local\n    user: kubelet\n  name: kubelet\ncurrent-context: kubelet\nusers:\n- name: kubelet\n  user:\n    client-certificate: /var/lib/kubelet/pki/kubelet-client-current.pem\n    client-key: /var/lib/kubelet/pki/kubelet-client-current.pem\n",
            b64(ca)
        )
    }

    #[test]
    fn the_current_contexts_cluster_is_kept_and_only_its_ca_data_changes_in_place() {
        let text = kubelet_kubeconfig("OLD PEM");
        let doc = Document::parse(text.as_bytes()).unwrap();
        assert_eq!(doc.cluster().name, "local");
        assert_eq!(doc.cluster().server, "https://api-int.example:6443");
        assert_eq!(doc.cluster().ca_data.as_deref(), Some(&b"OLD PEM"[..]));
        let edited = doc.with_ca_data(b"NEW PEM").unwrap();
        // Byte for byte the same but for the one value: the comment and order stay.
        assert_eq!(
            String::from_utf8(edited).unwrap(),
            kubelet_kubeconfig("NEW PEM")
        );
        assert_eq!(doc.with_ca_data(b"OLD PEM").unwrap(), text.as_bytes());
    }

    #[test]
    fn ca_data_shared_by_two_clusters_changes_in_the_kept_one_alone() {
        let data = b64("SHARED");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: a\n  cluster:\n    server: https://a:6443\n    certificate-authority-data: {data}\n- name: b\n  cluster:\n    server: https://b:6443\n    certificate-authority-data: {data}\ncontexts:\n- name: ctx\n  context:\n    cluster: b\ncurrent-context: ctx\n"
        );
        let doc = Document::parse(text.as_bytes()).unwrap();
        assert_eq!(doc.cluster().name, "b");
        let bytes = doc.with_ca_data(b"NEW").unwrap();
        let edited = Document::parse(&bytes).unwrap();
        assert_eq!(edited.cluster().ca_data.as_deref(), Some(&b"NEW"[..]));
        let a = &clusters(&edited.value)[0]["cluster"][CA_DATA];
        assert_eq!(a.as_str(), Some(data.as_str()));
        assert_eq!(edited.value["current-context"], "ctx");
        // Changed in place, at the second occurrence: the text is the same but for it.
        let at = text.rfind(&data).unwrap();
        let in_place = [&text[..at], &b64("NEW"), &text[at + data.len()..]].concat();
        assert_eq!(String::from_utf8(bytes).unwrap(), in_place);
    }

    #[test]
    fn ca_data_that_cannot_be_changed_in_place_is_written_again_with_every_value() {
        // The old value split over two lines of a double-quoted scalar: its text occurs
        // nowhere, so the document is written again from its values.
        let data = b64("OLD CA DATA");
        let (a, b) = data.split_at(8);
        let text = format!(
            "clusters:\n- name: c\n  cluster:\n    server: https://c\n    certificate-authority-data: \"{a}\\\n      {b}\"\n"
        );
        let doc = Document::parse(text.as_bytes()).unwrap();
        assert_eq!(doc.cluster().ca_data.as_deref(), Some(&b"OLD CA DATA"[..]));
        let bytes = doc.with_ca_data(b"NEW").unwrap();
        let edited = Document::parse(&bytes).unwrap();
        assert_eq!(edited.cluster().ca_data.as_deref(), Some(&b"NEW"[..]));
        assert_eq!(edited.cluster().server, "https://c");
    }

    #[test]
    fn a_cluster_without_ca_data_gets_it_and_keeps_every_other_field() {
        let text = "{\"apiVersion\":\"v1\",\"kind\":\"Config\",\"clusters\":[{\"name\":\"only\",\"cluster\":{\"server\":\"https://10.0.0.1\",\"tls-server-name\":\"api\",\"extensions\":[{\"name\":\"x\",\"extension\":{\"k\":1}}]}}],\"users\":[{\"name\":\"u\",\"user\":{\"token\":\"secret-token\"}}]}";
        let doc = Document::parse(text.as_bytes()).unwrap();
        assert_eq!(doc.cluster().ca_data, None);
        assert_eq!(doc.cluster().tls_server_name.as_deref(), Some("api"));
        let edited = Document::parse(&doc.with_ca_data(b"PEM").unwrap()).unwrap();
        let mut expected = doc.value.clone();
        expected["clusters"][0]["cluster"][CA_DATA] = Value::String(b64("PEM"));
        assert_eq!(edited.value, expected);
    }

    #[test]
    fn drift_is_any_difference_but_the_kept_clusters_ca_data() {
        let a = kubelet_kubeconfig("A");
        assert!(same_but_ca_data(
            a.as_bytes(),
            kubelet_kubeconfig("B").as_bytes()
        ));
        let moved = kubelet_kubeconfig("B").replace("api-int.example", "api.example");
        assert!(!same_but_ca_data(a.as_bytes(), moved.as_bytes()));
        // Formatting is not drift: the same values written as JSON.
        let doc = Document::parse(a.as_bytes()).unwrap();
        let json = serde_json::to_string(&doc.value).unwrap();
        assert!(same_but_ca_data(a.as_bytes(), json.as_bytes()));
        assert!(!same_but_ca_data(b"not: [a kubeconfig", b"not: [another"));
    }

    #[test]
    fn what_cannot_be_kept_is_refused_naming_clusters_never_data() {
        let two = "kind: Config\nclusters:\n- name: a\n  cluster: {server: https://a}\n- name: b\n  cluster: {server: https://b}\nusers:\n- name: u\n  user: {token: hunter2}\n";
        let e = Document::parse(two.as_bytes()).unwrap_err().to_string();
        assert_eq!(
            e,
            "it has no current context and 2 clusters (a, b): cannot tell which one to keep"
        );
        let file = "kind: Config\nclusters:\n- name: a\n  cluster: {server: https://a, certificate-authority: /etc/ca.crt}\n";
        let e = Document::parse(file.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("cluster a names the CA file /etc/ca.crt"), "{e}");
        let missing = "kind: Config\ncurrent-context: gone\nclusters:\n- name: a\n  cluster: {server: https://a}\n";
        let e = Document::parse(missing.as_bytes()).unwrap_err().to_string();
        assert_eq!(e, "its current context gone is not among its contexts");
        let broken = "kind: Config\nusers:\n- name: u\n  user: {token: hunter2\n";
        let e = Document::parse(broken.as_bytes()).unwrap_err().to_string();
        assert!(
            e.starts_with("not a kubeconfig: YAML that does not parse"),
            "{e}"
        );
        assert!(!e.contains("hunter2"), "{e}");
        let bad = "kind: Config\nclusters:\n- name: a\n  cluster: {server: https://a, certificate-authority-data: '%%%'}\n";
        let e = Document::parse(bad.as_bytes()).unwrap_err().to_string();
        assert_eq!(e, "the CA data of its cluster a is not base64");
    }

    #[test]
    fn a_source_kubeconfig_gives_its_clusters_ca_data_unless_it_holds_credentials() {
        let info = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: https://cp:6443\n  name: \"\"\ncontexts: []\ncurrent-context: \"\"\nusers: []\npreferences: {{}}\n",
            b64("CA PEM")
        );
        assert_eq!(
            clusters_ca_data(info.as_bytes()).unwrap(),
            Some(vec![b"CA PEM".to_vec()])
        );
        assert_eq!(
            clusters_ca_data(b"-----BEGIN CERTIFICATE-----").unwrap(),
            None
        );
        let with_key = kubelet_kubeconfig("X").replace("client-key:", "client-key-data:");
        assert!(clusters_ca_data(with_key.as_bytes()).is_err());
        let e = clusters_ca_data(kubelet_kubeconfig("X").as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds a user's key or token"), "{e}");
    }
}
