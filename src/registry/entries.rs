//! Registry entries from each kind of source, and their merge. An entry is one registry's
//! raw name and bytes; each is accepted or refused on its own, so that one bad entry costs
//! that registry alone.
//!
//! What is refused, and what a refusal holds back:
//! - an entry whose name is refused (empty, a path, not a host[:port]) is no registry at
//!   all: it is reported and nothing is done for it;
//! - an entry whose name is good but whose content cannot be read (no `data`, bad base64)
//!   still names its registry: that registry is held (what is on disk for it stays as it
//!   is), and it still shadows the same registry in later sources, as the first source
//!   wins whatever its content;
//! - an entry whose registry cannot be told (a list entry that is not an object, or has no
//!   `file`), or a list field that is not a list, could be for any registry: removals wait
//!   until the sources are whole again ([`Entries::incomplete`]), so that a broken producer
//!   never makes the agent delete a registry's CA.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::Value;

use super::name::{NameError, NameProblem, RegistryName};
use crate::bundle::{MAX_SOURCE_BYTES, Rejection};
use crate::text::escape;

/// Where an entry is: its source (the spec, as every other message names it) and the part
/// of it (`imageRegistryBundleData[2]`, a ConfigMap key, a file name of a `dir:` source).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub source: String,
    pub part: String,
}

impl fmt::Display for Place {
    /// `controllerconfig:machine-config-controller (imageRegistryBundleData[2])`, as
    /// `dir:/d (/d/b.crt)` names a part elsewhere.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.source, escape(&self.part))
    }
}

/// Why an entry, or a whole list field, could not be used. No variant carries the entry's
/// content: every one is safe to log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    #[error(
        "{field} is {kind}, not a list of {{\"file\", \"data\"}} objects: none of its entries can be read"
    )]
    NotAList { field: String, kind: &'static str },
    #[error(
        "the entry is {kind}, not a {{\"file\", \"data\"}} object: which registry it is for is unknown"
    )]
    NotAnObject { kind: &'static str },
    #[error("the entry has no \"file\" string: which registry it is for is unknown")]
    NoFile,
    #[error(transparent)]
    Name(#[from] NameError),
    #[error("the entry for {} has no \"data\" string", quoted(.registry))]
    NoData { registry: String },
    #[error(
        "the \"data\" of {} is not base64 (standard alphabet, with padding, as Kubernetes encodes bytes)",
        quoted(.registry)
    )]
    BadBase64 { registry: String },
    /// The content itself (SPEC 4.2): not certificates only, a key, too large, no certificate.
    #[error("the content for {}: {rejection}", quoted(.registry))]
    Content {
        registry: String,
        rejection: Rejection,
    },
}

impl EntryError {
    /// The `reason` label of the error counters.
    pub fn reason(&self) -> &'static str {
        match self {
            EntryError::NotAList { .. } => "not_a_list",
            EntryError::NotAnObject { .. } => "not_an_object",
            EntryError::NoFile => "no_file",
            EntryError::Name(e) => e.reason(),
            EntryError::NoData { .. } => "no_data",
            EntryError::BadBase64 { .. } => "bad_base64",
            EntryError::Content { rejection, .. } => rejection.reason(),
        }
    }

    /// The entry could be for any registry: removals must wait.
    pub fn registry_unknown(&self) -> bool {
        matches!(
            self,
            EntryError::NotAList { .. } | EntryError::NotAnObject { .. } | EntryError::NoFile
        )
    }
}

fn quoted(text: &str) -> String {
    format!("\"{}\"", escape(text))
}

/// An entry refused, and where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{place}: {error}")]
pub struct Refused {
    pub place: Place,
    pub error: EntryError,
}

/// One registry's entry: its name, and its bytes or why they could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: RegistryName,
    pub place: Place,
    pub content: Result<Vec<u8>, EntryError>,
}

/// What one source holds, entry by entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entries {
    /// Entries that name a registry, in source order.
    pub entries: Vec<Entry>,
    /// Entries that name no registry, and the whole field when it is not a list.
    pub refused: Vec<Refused>,
}

impl Entries {
    /// Some entry could be for any registry (or none could be read): the source is not
    /// whole, and no registry may be removed on its word.
    pub fn incomplete(&self) -> bool {
        self.refused.iter().any(|r| r.error.registry_unknown())
    }

    fn refuse(&mut self, place: Place, error: EntryError) {
        self.refused.push(Refused { place, error });
    }

    /// Adds an entry for `raw`, or refuses it when the name is not a registry.
    fn add(&mut self, place: Place, raw: &str, content: Result<Vec<u8>, EntryError>) {
        match RegistryName::parse(raw) {
            Ok(name) => self.entries.push(Entry {
                name,
                place,
                content,
            }),
            Err(e) => self.refuse(place, e.into()),
        }
    }
}

/// A ControllerConfig list field (`spec.imageRegistryBundleData`,
/// `spec.imageRegistryBundleUserData`): `[{"file": NAME, "data": BASE64}, ...]`, `data`
/// being bytes as Kubernetes writes them in JSON (standard base64 with padding). A field
/// that is absent or `null` is an empty list (Go's `omitempty` writes no field for one).
/// `source` names the source in messages; `field` is the field's name.
pub fn from_list(source: &str, field: &str, value: &Value) -> Entries {
    let mut entries = Entries::default();
    let items = match value {
        Value::Null => return entries,
        Value::Array(items) => items,
        other => {
            let place = place(source, field);
            let field = field.to_string();
            let kind = kind(other);
            entries.refuse(place, EntryError::NotAList { field, kind });
            return entries;
        }
    };
    for (index, item) in items.iter().enumerate() {
        let place = place(source, &format!("{field}[{index}]"));
        let Value::Object(object) = item else {
            let kind = kind(item);
            entries.refuse(place, EntryError::NotAnObject { kind });
            continue;
        };
        let Some(Value::String(raw)) = object.get("file") else {
            entries.refuse(place, EntryError::NoFile);
            continue;
        };
        let registry = raw.clone();
        let content = match object.get("data") {
            // Go writes a nil []byte as null: an entry with nothing in it, refused below
            // for holding no certificate, like an empty string.
            Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(data)) => decode(&registry, data),
            _ => Err(EntryError::NoData { registry }),
        };
        entries.add(place, raw, content);
    }
    entries
}

/// Base64 that decodes to more than a source may hold is refused before it is decoded.
fn decode(registry: &str, data: &str) -> Result<Vec<u8>, EntryError> {
    let most = MAX_SOURCE_BYTES.div_ceil(3) * 4;
    if data.len() > most {
        return Err(EntryError::Content {
            registry: registry.to_string(),
            rejection: Rejection::TooLarge {
                size: data.len() / 4 * 3,
                limit: MAX_SOURCE_BYTES,
            },
        });
    }
    STANDARD.decode(data).map_err(|_| EntryError::BadBase64 {
        registry: registry.to_string(),
    })
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn place(source: &str, part: &str) -> Place {
    Place {
        source: source.to_string(),
        part: part.to_string(),
    }
}

/// A ConfigMap's keys (`data` and `binaryData`, in key order), as an `additionalTrustedCA`
/// ConfigMap holds them: each key is one registry, `host..port` for `host:port`.
pub fn from_configmap<'a>(
    source: &str,
    keys: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> Entries {
    let mut entries = Entries::default();
    for (key, bytes) in keys {
        entries.add(place(source, key), key, Ok(bytes.to_vec()));
    }
    entries
}

/// The files of a `dir:` registry source, given as (file name or path, bytes), regular
/// files only (as the caller reads a `dir:` source). Each `<name>.crt` is the registry
/// `<name>` (`registry.local..5000.crt`); every other file (`.pem`, `.key`, a README, an
/// editor's backup) is ignored, so that a directory can hold notes or keys beside the CA
/// files without each being refused. Files are taken in name order, whatever order they
/// are given in, so that which of two spellings of one registry wins does not depend on
/// how the directory was listed.
pub fn from_dir<P: AsRef<Path>>(
    source: &str,
    files: impl IntoIterator<Item = (P, Vec<u8>)>,
) -> Entries {
    let mut named: Vec<(OsString, Vec<u8>)> = files
        .into_iter()
        .filter_map(|(path, bytes)| Some((path.as_ref().file_name()?.to_os_string(), bytes)))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut entries = Entries::default();
    for (name, bytes) in named {
        let Some(stem) = name.as_encoded_bytes().strip_suffix(b".crt") else {
            continue;
        };
        let place = place(source, &name.to_string_lossy());
        match std::str::from_utf8(stem) {
            Ok(raw) => entries.add(place, raw, Ok(bytes)),
            Err(_) => {
                let error = NameError {
                    raw: String::from_utf8_lossy(stem).into_owned(),
                    problem: NameProblem::NotUtf8,
                };
                entries.refuse(place, error.into());
            }
        }
    }
    entries
}

/// A registry named again in a later place: the first place wins (SPEC 4b), and the later
/// one is reported, not refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shadowed {
    pub name: RegistryName,
    pub place: Place,
    /// The place that won.
    pub by: Place,
}

impl fmt::Display for Shadowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: registry {} is taken from {} (the first source wins)",
            self.place,
            quoted(self.name.dir()),
            self.by
        )
    }
}

/// The sources merged: one entry per registry directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Merged {
    /// The winning entry of each registry, by directory.
    pub registries: BTreeMap<RegistryName, Entry>,
    pub shadowed: Vec<Shadowed>,
    /// Every refusal of every source (entries that name no registry, fields that are not
    /// lists). Entries of a known registry whose content was refused are in `registries`.
    pub refused: Vec<Refused>,
    /// Some source was not whole: no registry may be removed this time.
    pub incomplete: bool,
}

/// Merges the sources in priority order: the same registry (the same directory, whatever
/// the spelling) in two places is taken from the first, within one source as across them.
pub fn merge(sources: impl IntoIterator<Item = Entries>) -> Merged {
    let mut merged = Merged::default();
    for source in sources {
        merged.incomplete |= source.incomplete();
        merged.refused.extend(source.refused);
        for entry in source.entries {
            match merged.registries.get(&entry.name) {
                Some(first) => merged.shadowed.push(Shadowed {
                    name: entry.name,
                    place: entry.place,
                    by: first.place.clone(),
                }),
                None => {
                    merged.registries.insert(entry.name.clone(), entry);
                }
            }
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CC: &str = "controllerconfig:machine-config-controller";

    fn names(entries: &Entries) -> Vec<&str> {
        entries.entries.iter().map(|e| e.name.dir()).collect()
    }

    fn messages(entries: &Entries) -> Vec<String> {
        entries.refused.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn base64_too_large_to_decode_is_refused_with_the_size_it_would_have() {
        let most = MAX_SOURCE_BYTES.div_ceil(3) * 4;
        let data = "A".repeat(most + 4);
        match decode("quay.io", &data) {
            Err(EntryError::Content {
                registry,
                rejection: Rejection::TooLarge { size, limit },
            }) => {
                assert_eq!(registry, "quay.io");
                assert_eq!(size, (most + 4) / 4 * 3);
                assert_eq!(limit, MAX_SOURCE_BYTES);
            }
            other => panic!("{other:?}"),
        }
        // At the bound, it is decoded.
        assert_eq!(
            decode("quay.io", &"A".repeat(most)).unwrap().len(),
            most / 4 * 3
        );
    }

    #[test]
    fn a_controllerconfig_list_gives_one_entry_per_registry() {
        let value = json!([
            {"file": "image-registry.openshift-image-registry.svc..5000", "data": STANDARD.encode(b"internal CA")},
            {"file": "quay.io", "data": STANDARD.encode(b"quay CA")},
        ]);
        let entries = from_list(CC, "imageRegistryBundleData", &value);
        assert_eq!(
            names(&entries),
            [
                "image-registry.openshift-image-registry.svc:5000",
                "quay.io"
            ]
        );
        assert_eq!(entries.entries[1].content, Ok(b"quay CA".to_vec()));
        assert_eq!(
            entries.entries[1].place.to_string(),
            "controllerconfig:machine-config-controller (imageRegistryBundleData[1])"
        );
        assert!(entries.refused.is_empty() && !entries.incomplete());
    }

    #[test]
    fn an_absent_list_is_empty_and_a_field_that_is_not_a_list_holds_removals() {
        let absent = from_list(CC, "imageRegistryBundleUserData", &Value::Null);
        assert_eq!(absent, Entries::default());
        assert!(!absent.incomplete());
        let broken = from_list(
            CC,
            "imageRegistryBundleUserData",
            &json!({"file": "quay.io"}),
        );
        assert!(broken.entries.is_empty());
        assert!(broken.incomplete());
        assert_eq!(
            messages(&broken),
            [
                "controllerconfig:machine-config-controller (imageRegistryBundleUserData): imageRegistryBundleUserData is an object, not a list of {\"file\", \"data\"} objects: none of its entries can be read"
            ]
        );
        assert_eq!(broken.refused[0].error.reason(), "not_a_list");
    }

    #[test]
    fn a_bad_list_entry_is_refused_alone_and_named_by_field_and_index() {
        let value = json!([
            {"file": "good.example", "data": STANDARD.encode(b"good")},
            {"file": "bad64.example", "data": "not base64!"},
            {"file": "nodata.example"},
            {"data": STANDARD.encode(b"whose?")},
            "just a string",
            {"file": "../../etc", "data": STANDARD.encode(b"evil")},
            {"file": "null.example", "data": null},
            {"file": 42, "data": ""},
        ]);
        let entries = from_list(CC, "imageRegistryBundleUserData", &value);
        // Entries that name a registry are kept, their content refused where it is bad:
        // those registries are held as they are on disk.
        assert_eq!(
            names(&entries),
            [
                "good.example",
                "bad64.example",
                "nodata.example",
                "null.example"
            ]
        );
        let contents: Vec<_> = entries
            .entries
            .iter()
            .map(|e| e.content.as_ref().map_err(|e| e.reason()))
            .collect();
        assert_eq!(
            contents,
            [
                Ok(&b"good".to_vec()),
                Err("bad_base64"),
                Err("no_data"),
                Ok(&Vec::new())
            ]
        );
        assert_eq!(
            entries.entries[1].content.as_ref().unwrap_err().to_string(),
            "the \"data\" of \"bad64.example\" is not base64 (standard alphabet, with padding, as Kubernetes encodes bytes)"
        );
        let field = "controllerconfig:machine-config-controller (imageRegistryBundleUserData";
        assert_eq!(
            messages(&entries),
            [
                format!(
                    "{field}[3]): the entry has no \"file\" string: which registry it is for is unknown"
                ),
                format!(
                    "{field}[4]): the entry is a string, not a {{\"file\", \"data\"}} object: which registry it is for is unknown"
                ),
                format!(
                    "{field}[5]): registry name \"../../etc\": it holds a '/': a registry is one directory under DIR, never a path"
                ),
                format!(
                    "{field}[7]): the entry has no \"file\" string: which registry it is for is unknown"
                ),
            ]
        );
        // An entry that could be any registry's holds removals back.
        assert!(entries.incomplete());
    }

    #[test]
    fn base64_too_long_for_a_source_is_refused_before_decoding() {
        let data = "A".repeat(MAX_SOURCE_BYTES / 3 * 4 + 8);
        let entries = from_list(CC, "f", &json!([{"file": "big.example", "data": data}]));
        let error = entries.entries[0].content.as_ref().unwrap_err();
        assert_eq!(error.reason(), "too_large");
        // Refused names never hold removals back: they are no registry the agent manages.
        let hostile = from_list(CC, "f", &json!([{"file": "a/b", "data": ""}]));
        assert!(!hostile.incomplete());
    }

    #[test]
    fn each_configmap_key_is_one_registry() {
        let entries = from_configmap(
            "configmap:openshift-config/registry-cas/*",
            [
                ("myregistry.corp.com..5000", &b"a"[..]),
                ("otherregistry.com", &b"b"[..]),
                (".hidden", &b"c"[..]),
            ],
        );
        assert_eq!(
            names(&entries),
            ["myregistry.corp.com:5000", "otherregistry.com"]
        );
        assert_eq!(
            messages(&entries),
            [
                "configmap:openshift-config/registry-cas/* (.hidden): registry name \".hidden\": it starts with '.': a hidden or relative directory is not a registry"
            ]
        );
        assert!(!entries.incomplete());
    }

    #[test]
    fn a_dir_source_reads_crt_files_in_name_order_and_ignores_the_rest() {
        let entries = from_dir(
            "dir:/etc/kubelet-ca-agent/registries",
            [
                ("quay.io.crt", b"q".to_vec()),
                (
                    "/etc/kubelet-ca-agent/registries/registry.local..5000.crt",
                    b"r".to_vec(),
                ),
                ("README", b"notes".to_vec()),
                ("quay.io.key", b"key".to_vec()),
                ("quay.io.pem", b"pem".to_vec()),
                ("quay.io.crt~", b"backup".to_vec()),
                ("[fd00....1]..5000.crt", b"v6".to_vec()),
                ("bad name.crt", b"x".to_vec()),
            ],
        );
        assert_eq!(
            names(&entries),
            ["[fd00::1]:5000", "quay.io", "registry.local:5000"]
        );
        assert_eq!(entries.entries[2].place.part, "registry.local..5000.crt");
        assert_eq!(entries.refused.len(), 1);
        assert!(
            messages(&entries)[0].starts_with(
                "dir:/etc/kubelet-ca-agent/registries (bad name.crt): registry name \"bad name\""
            ),
            "{:?}",
            messages(&entries)
        );
    }

    #[test]
    fn a_file_name_that_is_not_utf8_is_refused_not_lost() {
        use std::ffi::OsStr;
        use std::os::unix::ffi::OsStrExt;
        let name = OsStr::from_bytes(b"caf\xe9.example.crt");
        let entries = from_dir("dir:/d", [(Path::new(name), b"x".to_vec())]);
        assert!(entries.entries.is_empty());
        let message = entries.refused[0].to_string();
        assert_eq!(
            message,
            "dir:/d (caf\u{fffd}.example.crt): registry name \"caf\u{fffd}.example\": it is not UTF-8, so not a host name"
        );
    }

    #[test]
    fn the_first_source_wins_and_later_ones_are_reported_as_shadowed() {
        let list = from_list(
            CC,
            "imageRegistryBundleData",
            &json!([{"file": "registry.local..5000", "data": "AA=="}]),
        );
        let configmap = from_configmap(
            "configmap:ns/cas/*",
            [
                ("registry.local..5000", &b"later"[..]),
                ("quay.io", &b"q"[..]),
            ],
        );
        let dir = from_dir("dir:/d", [("registry.local:5000.crt", b"last".to_vec())]);
        let merged = merge([list, configmap, dir]);
        let winners: Vec<_> = merged
            .registries
            .values()
            .map(|e| (e.name.dir(), e.place.source.as_str()))
            .collect();
        assert_eq!(
            winners,
            [
                ("quay.io", "configmap:ns/cas/*"),
                ("registry.local:5000", CC)
            ]
        );
        let shadowed: Vec<_> = merged.shadowed.iter().map(ToString::to_string).collect();
        assert_eq!(
            shadowed,
            [
                "configmap:ns/cas/* (registry.local..5000): registry \"registry.local:5000\" is taken from controllerconfig:machine-config-controller (imageRegistryBundleData[0]) (the first source wins)",
                "dir:/d (registry.local:5000.crt): registry \"registry.local:5000\" is taken from controllerconfig:machine-config-controller (imageRegistryBundleData[0]) (the first source wins)",
            ]
        );
        assert!(!merged.incomplete);
    }

    #[test]
    fn a_refused_content_still_claims_its_registry_and_an_unknown_entry_holds_removals() {
        let first = from_list(
            CC,
            "imageRegistryBundleData",
            &json!([{"file": "quay.io", "data": "%%%"}, {"data": "AA=="}]),
        );
        let second = from_configmap("configmap:ns/cas/*", [("quay.io", &b"fine"[..])]);
        let merged = merge([first, second]);
        let quay = &merged.registries[&RegistryName::parse("quay.io").unwrap()];
        assert_eq!(quay.place.source, CC);
        assert_eq!(quay.content.as_ref().unwrap_err().reason(), "bad_base64");
        assert_eq!(merged.shadowed.len(), 1);
        assert_eq!(merged.refused.len(), 1);
        assert!(merged.incomplete);
    }
}
