//! The rendered node config that `drift check` and `drift strip` read: an Ignition v3.0 to
//! v3.6 document, alone or as the `spec.config` of a MachineConfig. Parsing keeps where each
//! entry of `storage.files` sits in the text, so that `strip` can remove entries and leave
//! every other byte as it was. Pure: no I/O.

use std::fmt;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

/// Where in the document something is, as a JSON path: `spec.config.storage.files[3].path`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JsonPath(String);

impl JsonPath {
    pub fn key(&self, key: &str) -> JsonPath {
        if self.0.is_empty() {
            JsonPath(key.to_string())
        } else {
            JsonPath(format!("{}.{key}", self.0))
        }
    }

    pub fn index(&self, index: usize) -> JsonPath {
        JsonPath(format!("{}[{index}]", self.0))
    }
}

impl fmt::Display for JsonPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("the document")
        } else {
            f.write_str(&self.0)
        }
    }
}

/// Why a document is not a rendered config this command can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("not valid JSON at line {line}, column {column}: {message}{hint}")]
    Syntax {
        line: usize,
        column: usize,
        message: String,
        hint: &'static str,
    },
    #[error("{path}: {message}")]
    At { path: JsonPath, message: String },
}

fn invalid(path: &JsonPath, message: impl Into<String>) -> Invalid {
    Invalid::At {
        path: path.clone(),
        message: message.into(),
    }
}

/// What kind of document held the Ignition config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wrapper {
    /// A bare Ignition document.
    Ignition,
    /// A MachineConfig whose `spec.config` is the Ignition document.
    MachineConfig,
}

/// A rendered config: its Ignition version and its files, with where each sits in the text.
#[derive(Debug)]
pub struct Rendered {
    pub wrapper: Wrapper,
    pub version: String,
    pub files: Vec<FileEntry>,
}

/// One entry of `storage.files`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    /// Where the entry is: `storage.files[3]`.
    pub at: JsonPath,
    /// Its bytes in the document, from `{` to `}`.
    pub span: Range<usize>,
    /// `path`, as written.
    pub path: String,
    /// `mode`, from its decimal JSON form.
    pub mode: Option<u32>,
    /// `contents`, unless absent or null.
    pub contents: Option<Resource>,
    /// `append`, in order.
    pub append: Vec<Resource>,
}

impl FileEntry {
    /// The path with `.`, `..` and repeated slashes resolved lexically, for comparisons.
    pub fn normalized(&self) -> PathBuf {
        normalize(Path::new(&self.path))
    }
}

/// An Ignition resource (`contents`, or one `append` entry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    /// Where it is: `storage.files[3].contents`.
    pub at: JsonPath,
    pub source: Option<String>,
    /// `compression`: `None` for none (absent, null or ""), else its value (`gzip`).
    pub compression: Option<String>,
}

/// `path` with `.` and repeated separators dropped and `..` applied lexically (never above `/`).
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// A JSON value's text, borrowed from the document, so that its place in it is known.
/// Only made from a document that `serde_json` has already accepted as valid JSON: the
/// scanning below relies on that.
#[derive(Debug, Clone, Copy)]
struct Raw<'a>(&'a str);

impl<'a> Raw<'a> {
    fn get(&self) -> &'a str {
        self.0
    }
}

fn skip_whitespace(s: &str, mut i: usize) -> usize {
    let bytes = s.as_bytes();
    while i < bytes.len() && matches!(bytes[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// The end of the string whose opening quote is at `i` (just past its closing quote).
fn string_end(s: &str, i: usize) -> usize {
    let bytes = s.as_bytes();
    let mut j = i + 1;
    while j < bytes.len() {
        match bytes[j] {
            b'\\' => j += 2,
            b'"' => return j + 1,
            _ => j += 1,
        }
    }
    bytes.len()
}

/// The end of the value that starts at `i`.
fn value_end(s: &str, i: usize) -> usize {
    let bytes = s.as_bytes();
    match bytes.get(i) {
        Some(b'"') => string_end(s, i),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut j = i;
            while j < bytes.len() {
                match bytes[j] {
                    b'"' => {
                        j = string_end(s, j);
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return j + 1;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            bytes.len()
        }
        _ => {
            let mut j = i;
            while j < bytes.len()
                && !matches!(bytes[j], b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            j
        }
    }
}

/// The members of an object (`raw` starts with `{`), in document order.
fn members(raw: Raw<'_>) -> Members<'_> {
    let s = raw.get();
    let mut members = Vec::new();
    let mut i = skip_whitespace(s, 1);
    while s.as_bytes().get(i) == Some(&b'"') {
        let key_end = string_end(s, i);
        // Valid JSON: the key decodes.
        let key: String = serde_json::from_str(&s[i..key_end]).unwrap_or_default();
        let start = skip_whitespace(s, skip_whitespace(s, key_end) + 1);
        let end = value_end(s, start);
        members.push((key, Raw(&s[start..end])));
        i = skip_whitespace(s, end);
        if s.as_bytes().get(i) == Some(&b',') {
            i = skip_whitespace(s, i + 1);
        }
    }
    Members(members)
}

/// The elements of an array (`raw` starts with `[`), in document order.
fn elements(raw: Raw<'_>) -> Vec<Raw<'_>> {
    let s = raw.get();
    let mut elements = Vec::new();
    let mut i = skip_whitespace(s, 1);
    while i < s.len() && s.as_bytes()[i] != b']' {
        let end = value_end(s, i);
        elements.push(Raw(&s[i..end]));
        i = skip_whitespace(s, end);
        if s.as_bytes().get(i) == Some(&b',') {
            i = skip_whitespace(s, i + 1);
        }
    }
    elements
}

/// The members of a JSON object in document order, each value as its raw text.
struct Members<'a>(Vec<(String, Raw<'a>)>);

impl<'a> Members<'a> {
    /// The value of `key`; null counts as absent. A key given twice is refused: readers
    /// disagree on which one wins, and the check must read what Ignition would apply.
    fn get(&self, key: &str, at: &JsonPath) -> Result<Option<Raw<'a>>, Invalid> {
        let mut found = self.0.iter().filter(|(k, _)| k == key);
        let first = found.next().map(|(_, v)| *v);
        if found.next().is_some() {
            return Err(invalid(&at.key(key), "the key appears more than once"));
        }
        Ok(first.filter(|v| v.get() != "null"))
    }
}

/// What a raw JSON value is, for messages.
fn kind(raw: Raw<'_>) -> &'static str {
    match raw.get().as_bytes().first() {
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

fn object<'a>(raw: Raw<'a>, at: &JsonPath) -> Result<Members<'a>, Invalid> {
    if !raw.get().starts_with('{') {
        return Err(invalid(
            at,
            format!("expected an object, found {}", kind(raw)),
        ));
    }
    Ok(members(raw))
}

fn array<'a>(raw: Raw<'a>, at: &JsonPath) -> Result<Vec<Raw<'a>>, Invalid> {
    if !raw.get().starts_with('[') {
        return Err(invalid(
            at,
            format!("expected an array, found {}", kind(raw)),
        ));
    }
    Ok(elements(raw))
}

fn string(raw: Raw<'_>, at: &JsonPath) -> Result<String, Invalid> {
    if !raw.get().starts_with('"') {
        return Err(invalid(
            at,
            format!("expected a string, found {}", kind(raw)),
        ));
    }
    serde_json::from_str(raw.get()).map_err(|e| invalid(at, e.to_string()))
}

/// Where `raw` is in `text`: every raw value is a slice of the text itself.
fn span(text: &str, raw: Raw<'_>) -> Range<usize> {
    let start = raw.get().as_ptr() as usize - text.as_ptr() as usize;
    debug_assert!(start + raw.get().len() <= text.len());
    start..start + raw.get().len()
}

/// The Ignition versions whose `storage.files` this reads: 3.0 to 3.6. What a file entry
/// means has not changed across them (3.5 added LUKS CEX, nothing about files) but for the
/// mode's special bits ([`SPECIAL_BITS_FROM`]). A later version may mean something this does
/// not know, so it is refused, as Ignition itself refuses a newer spec than it knows.
const MAX_MINOR: u32 = 6;
/// From spec 3.6.0 Ignition honours the setuid, setgid and sticky bits of a file's mode;
/// before, it writes the file without them (coreos/ignition#1301).
const SPECIAL_BITS_FROM: u32 = 6;

/// Parses a rendered config: an Ignition v3 document, or a MachineConfig with one in
/// `spec.config`.
pub fn parse(text: &str) -> Result<Rendered, Invalid> {
    serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| Invalid::Syntax {
        line: e.line(),
        column: e.column(),
        message: e
            .to_string()
            .split(" at line ")
            .next()
            .unwrap_or("")
            .to_string(),
        hint: if text.trim_start().starts_with(['{', '[']) {
            ""
        } else {
            " (JSON is expected: for a MachineConfig, `oc get machineconfig NAME -o json`)"
        },
    })?;
    let start = skip_whitespace(text, 0);
    let document = Raw(&text[start..value_end(text, start)]);
    let root = JsonPath::default();
    let top = object(document, &root)?;
    let (wrapper, config, at) = if top.get("ignition", &root)?.is_some() {
        (Wrapper::Ignition, document, root)
    } else if top.get("spec", &root)?.is_some() || top.get("kind", &root)?.is_some() {
        let kind_at = root.key("kind");
        if let Some(kind) = top.get("kind", &root)? {
            let kind = string(kind, &kind_at)?;
            if kind != "MachineConfig" {
                return Err(invalid(
                    &kind_at,
                    format!(
                        "a {kind} is not a rendered config: give a MachineConfig or an Ignition document"
                    ),
                ));
            }
        }
        let spec_at = root.key("spec");
        let spec = top
            .get("spec", &root)?
            .ok_or_else(|| invalid(&spec_at, "missing: a MachineConfig has a spec"))?;
        let config_at = spec_at.key("config");
        let config = object(spec, &spec_at)?
            .get("config", &spec_at)?
            .ok_or_else(|| {
                invalid(
                    &config_at,
                    "missing: this MachineConfig holds no Ignition config",
                )
            })?;
        (Wrapper::MachineConfig, config, config_at)
    } else {
        return Err(invalid(
            &root.key("ignition"),
            "missing: neither an Ignition document nor a MachineConfig",
        ));
    };
    let config_members = object(config, &at)?;
    let ignition_at = at.key("ignition");
    let ignition = config_members
        .get("ignition", &at)?
        .ok_or_else(|| invalid(&ignition_at, "missing: not an Ignition document"))?;
    let version_at = ignition_at.key("version");
    let version = object(ignition, &ignition_at)?
        .get("version", &ignition_at)?
        .ok_or_else(|| invalid(&version_at, "missing"))
        .and_then(|v| string(v, &version_at))?;
    if !supported(&version) {
        return Err(invalid(
            &version_at,
            format!(
                "Ignition version {:?} is not supported: this reads Ignition 3.0.0 to 3.{MAX_MINOR}.0 (a later or experimental version may describe files in ways it does not know)",
                crate::text::escape(&version)
            ),
        ));
    }
    let mut files = Vec::new();
    let storage_at = at.key("storage");
    if let Some(storage) = config_members.get("storage", &at)? {
        let files_at = storage_at.key("files");
        if let Some(list) = object(storage, &storage_at)?.get("files", &storage_at)? {
            for (i, raw) in array(list, &files_at)?.into_iter().enumerate() {
                files.push(file_entry(text, raw, files_at.index(i), &version)?);
            }
        }
    }
    // Ignition refuses two entries for one path; so does this, rather than guess which wins.
    for (i, file) in files.iter().enumerate() {
        if let Some(first) = files[..i]
            .iter()
            .find(|f| f.normalized() == file.normalized())
        {
            return Err(invalid(
                &file.at.key("path"),
                format!(
                    "{} is already the path of {}",
                    crate::text::escape(&file.path),
                    first.at
                ),
            ));
        }
    }
    Ok(Rendered {
        wrapper,
        version,
        files,
    })
}

/// The mode Ignition gives a file whose entry says `mode`, under spec `version` (one that
/// [`supported`] accepts): without the special bits before [`SPECIAL_BITS_FROM`].
fn written_mode(mode: u32, version: &str) -> u32 {
    let minor: u32 = version
        .split('.')
        .nth(1)
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if minor < SPECIAL_BITS_FROM {
        mode & 0o777
    } else {
        mode
    }
}

/// `3.N.P` with N from 0 to [`MAX_MINOR`]; pre-releases (`3.7.0-experimental`) are not.
fn supported(version: &str) -> bool {
    let parts: Vec<&str> = version.split('.').collect();
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    matches!(parts.as_slice(), ["3", minor, patch]
        if number(minor) && number(patch) && minor.parse::<u32>().is_ok_and(|m| m <= MAX_MINOR))
}

fn file_entry(text: &str, raw: Raw<'_>, at: JsonPath, version: &str) -> Result<FileEntry, Invalid> {
    let members = object(raw, &at)?;
    let path_at = at.key("path");
    let path = members
        .get("path", &at)?
        .ok_or_else(|| invalid(&path_at, "missing"))
        .and_then(|p| string(p, &path_at))?;
    if !path.starts_with('/') {
        return Err(invalid(
            &path_at,
            format!("{:?} is not an absolute path", crate::text::escape(&path)),
        ));
    }
    let mode_at = at.key("mode");
    let mode = match members.get("mode", &at)? {
        None => None,
        Some(m) => {
            let value: i64 = serde_json::from_str(m.get()).map_err(|_| {
                invalid(
                    &mode_at,
                    format!(
                        "expected a file mode as a decimal integer (420 for 0644), found {}",
                        crate::text::escape(m.get())
                    ),
                )
            })?;
            let mode = u32::try_from(value)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| {
                    invalid(&mode_at, format!("{value} is not a file mode (0 to 4095)"))
                })?;
            Some(written_mode(mode, version))
        }
    };
    let contents_at = at.key("contents");
    let contents = members
        .get("contents", &at)?
        .map(|c| resource(c, contents_at))
        .transpose()?;
    let append_at = at.key("append");
    let append = match members.get("append", &at)? {
        None => Vec::new(),
        Some(list) => array(list, &append_at)?
            .into_iter()
            .enumerate()
            .map(|(i, r)| resource(r, append_at.index(i)))
            .collect::<Result<_, _>>()?,
    };
    if let Some(overwrite) = members.get("overwrite", &at)? {
        serde_json::from_str::<bool>(overwrite.get()).map_err(|_| {
            invalid(
                &at.key("overwrite"),
                format!("expected a boolean, found {}", kind(overwrite)),
            )
        })?;
    }
    Ok(FileEntry {
        span: span(text, raw),
        at,
        path,
        mode,
        contents,
        append,
    })
}

fn resource(raw: Raw<'_>, at: JsonPath) -> Result<Resource, Invalid> {
    let members = object(raw, &at)?;
    let source_at = at.key("source");
    let source = members
        .get("source", &at)?
        .map(|s| string(s, &source_at))
        .transpose()?;
    let compression_at = at.key("compression");
    let compression = members
        .get("compression", &at)?
        .map(|c| string(c, &compression_at))
        .transpose()?
        .filter(|c| !c.is_empty());
    if let Some(other) = compression.as_deref().filter(|c| *c != "gzip") {
        return Err(invalid(
            &compression_at,
            format!(
                "compression {:?} is not one Ignition knows (gzip, or none)",
                crate::text::escape(other)
            ),
        ));
    }
    Ok(Resource {
        at,
        source,
        compression,
    })
}

/// `text` with the given entries of `storage.files` removed, and every other byte kept.
/// `remove[i]` says whether `files[i]` goes. The commas between the entries that stay are
/// the document's own.
pub fn without(text: &str, files: &[FileEntry], remove: &[bool]) -> String {
    debug_assert_eq!(files.len(), remove.len());
    let n = files.len();
    // The removed entries at the end of the array take the comma before them with them;
    // any other removed entry takes the comma (and space) after it.
    let trailing_from = (0..n).rev().take_while(|&i| remove[i]).last().unwrap_or(n);
    let mut cuts: Vec<Range<usize>> = Vec::new();
    for i in 0..trailing_from {
        if remove[i] {
            cuts.push(files[i].span.start..files[i + 1].span.start);
        }
    }
    if trailing_from < n {
        let start = match trailing_from {
            0 => files[0].span.start,
            kept => files[kept - 1].span.end,
        };
        cuts.push(start..files[n - 1].span.end);
    }
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for cut in cuts {
        out.push_str(&text[at..cut.start]);
        at = cut.end;
    }
    out.push_str(&text[at..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ignition(files: &str) -> String {
        format!(r#"{{"ignition":{{"version":"3.2.0"}},"storage":{{"files":[{files}]}}}}"#)
    }

    #[test]
    fn files_and_their_spans() {
        let text = ignition(
            r#"{"path":"/a","mode":420,"contents":{"source":"data:,x","compression":""}}, {"path":"/b","append":[{"source":"data:,y"}]}"#,
        );
        let rendered = parse(&text).unwrap();
        assert_eq!(rendered.wrapper, Wrapper::Ignition);
        assert_eq!(rendered.files.len(), 2);
        let a = &rendered.files[0];
        assert_eq!(a.mode, Some(0o644));
        assert_eq!(a.contents.as_ref().unwrap().compression, None);
        assert!(text[a.span.clone()].starts_with("{\"path\":\"/a\""));
        assert!(text[a.span.clone()].ends_with("}}"));
        assert_eq!(rendered.files[1].append.len(), 1);
        assert_eq!(
            rendered.files[1].append[0].at.to_string(),
            "storage.files[1].append[0]"
        );
    }

    #[test]
    fn a_machineconfig_wraps_the_document() {
        let text = format!(
            r#"{{"apiVersion":"machineconfiguration.openshift.io/v1","kind":"MachineConfig","spec":{{"config":{}}}}}"#,
            ignition(r#"{"path":"/a","contents":{"source":12}}"#)
        );
        assert_eq!(
            parse(&text).unwrap_err().to_string(),
            "spec.config.storage.files[0].contents.source: expected a string, found a number"
        );
    }

    #[test]
    fn invalid_documents_say_where() {
        let cases = [
            ("{\"ignition\":", "not valid JSON at line 1, column 12"),
            ("ignition: {}", "(JSON is expected"),
            (
                r#"{"ignition":{"version":"2.2.0"}}"#,
                "ignition.version: Ignition version \"2.2.0\" is not supported",
            ),
            (
                r#"{"ignition":{"version":"3.7.0-experimental"}}"#,
                "this reads Ignition 3.0.0 to 3.6.0",
            ),
            (r#"{"ignition":{}}"#, "ignition.version: missing"),
            (
                r#"{"kind":"ConfigMap","spec":{}}"#,
                "kind: a ConfigMap is not a rendered config",
            ),
            (
                r#"{"ignition":{"version":"3.4.0"},"storage":{"files":{}}}"#,
                "storage.files: expected an array, found an object",
            ),
            (
                r#"{"ignition":{"version":"3.0.0"},"storage":{"files":[{"path":"a"}]}}"#,
                "storage.files[0].path: \"a\" is not an absolute path",
            ),
            (
                r#"{"ignition":{"version":"3.1.0"},"storage":{"files":[{"path":"/a","mode":"0644"}]}}"#,
                "storage.files[0].mode: expected a file mode",
            ),
            (
                r#"{"ignition":{"version":"3.1.0"},"storage":{"files":[{"path":"/a","contents":{"compression":"xz"}}]}}"#,
                "storage.files[0].contents.compression: compression \"xz\"",
            ),
            (
                r#"{"ignition":{"version":"3.1.0"},"storage":{"files":[{"path":"/a"},{"path":"//a"}]}}"#,
                "storage.files[1].path: //a is already the path of storage.files[0]",
            ),
            (
                r#"{"ignition":{"version":"3.1.0"},"storage":{},"storage":{}}"#,
                "storage: the key appears more than once",
            ),
        ];
        for (text, expected) in cases {
            let error = parse(text).unwrap_err().to_string();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }

    #[test]
    fn special_mode_bits_count_from_spec_3_6_as_ignition_writes_them() {
        let mode = |version: &str| {
            let text = format!(
                r#"{{"ignition":{{"version":"{version}"}},"storage":{{"files":[{{"path":"/usr/local/bin/x","mode":2541}}]}}}}"#
            );
            parse(&text).unwrap().files[0].mode
        };
        assert_eq!(
            mode("3.4.0"),
            Some(0o755),
            "4755 is written 0755 before 3.6"
        );
        assert_eq!(mode("3.5.0"), Some(0o755));
        assert_eq!(mode("3.6.0"), Some(0o4755));
    }

    #[test]
    fn versions() {
        for ok in [
            "3.0.0", "3.1.0", "3.2.0", "3.3.0", "3.4.0", "3.5.0", "3.6.0",
        ] {
            assert!(supported(ok), "{ok}");
        }
        for bad in [
            "2.2.0",
            "3.7.0",
            "3.7.0-experimental",
            "3.6.0-experimental",
            "3.4",
            "4.0.0",
            "3.x.0",
            "",
        ] {
            assert!(!supported(bad), "{bad}");
        }
    }

    #[test]
    fn removing_entries_keeps_every_other_byte() {
        let text = "{\"ignition\":{\"version\":\"3.2.0\"},\"storage\":{\"files\":[\n  {\"path\":\"/a\"},\n  {\"path\":\"/b\"},\n  {\"path\":\"/c\"}\n]}}";
        let rendered = parse(text).unwrap();
        let strip = |remove: [bool; 3]| without(text, &rendered.files, &remove);
        let paths = |s: &str| -> Vec<String> {
            parse(s)
                .unwrap()
                .files
                .into_iter()
                .map(|f| f.path)
                .collect()
        };
        assert_eq!(strip([false; 3]), text);
        assert_eq!(paths(&strip([true, false, false])), ["/b", "/c"]);
        assert_eq!(paths(&strip([false, true, false])), ["/a", "/c"]);
        assert_eq!(paths(&strip([false, false, true])), ["/a", "/b"]);
        assert_eq!(paths(&strip([false, true, true])), ["/a"]);
        assert_eq!(paths(&strip([true, false, true])), ["/b"]);
        assert_eq!(paths(&strip([true, true, true])), Vec::<String>::new());
        assert_eq!(
            strip([false, true, false]),
            "{\"ignition\":{\"version\":\"3.2.0\"},\"storage\":{\"files\":[\n  {\"path\":\"/a\"},\n  {\"path\":\"/c\"}\n]}}"
        );
        assert_eq!(
            strip([false, false, true]),
            "{\"ignition\":{\"version\":\"3.2.0\"},\"storage\":{\"files\":[\n  {\"path\":\"/a\"},\n  {\"path\":\"/b\"}\n]}}"
        );
    }

    #[test]
    fn paths_normalize_lexically() {
        assert_eq!(
            normalize(Path::new("//etc/./kubernetes/../kubernetes/ca.crt")),
            Path::new("/etc/kubernetes/ca.crt")
        );
        assert_eq!(normalize(Path::new("/../x")), Path::new("/x"));
    }
}
