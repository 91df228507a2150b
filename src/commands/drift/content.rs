//! What a file of a rendered config should hold: its resources decoded from their data URLs
//! (RFC 2397: percent-encoded, or base64), gunzipped when `compression` says so, and its
//! `append` entries after them. Pure: no I/O.

use std::io::Read;

use base64::Engine;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};

use super::rendered::{FileEntry, Invalid, JsonPath, Resource};

/// The largest content a file may decode to. A node file is small; a gzip bomb must not
/// take the node's memory.
pub const MAX_CONTENT_BYTES: usize = 64 << 20;

/// What the file's content should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// Exactly these bytes.
    Exact(Vec<u8>),
    /// Whatever was there, followed by these bytes (`append` without `contents.source`).
    EndsWith(Vec<u8>),
    /// Anything: no `contents.source` and no `append` (Ignition keeps an existing file).
    Any,
    /// Unknown offline: a resource comes from this URL scheme (`https`, `s3`, ...).
    Remote(String),
}

/// The content `file` calls for.
pub fn expected(file: &FileEntry) -> Result<Expected, Invalid> {
    let base = match &file.contents {
        Some(resource) if resource.source.is_some() => Some(decode(resource)?),
        _ => None,
    };
    let mut appended = Vec::new();
    let mut remote = None;
    for resource in &file.append {
        match decode(resource)? {
            Decoded::Data(bytes) => appended.extend_from_slice(&bytes),
            Decoded::Remote(scheme) => remote = remote.or(Some(scheme)),
            Decoded::Unspecified => {}
        }
        if appended.len() > MAX_CONTENT_BYTES {
            return Err(too_large(&resource.at.key("source")));
        }
    }
    Ok(match (base, remote) {
        (Some(Decoded::Remote(scheme)), _) | (_, Some(scheme)) => Expected::Remote(scheme),
        (Some(Decoded::Data(mut bytes)), None) => {
            bytes.extend_from_slice(&appended);
            Expected::Exact(bytes)
        }
        (Some(Decoded::Unspecified) | None, None) if appended.is_empty() => Expected::Any,
        (Some(Decoded::Unspecified) | None, None) => Expected::EndsWith(appended),
    })
}

#[derive(Debug, PartialEq, Eq)]
enum Decoded {
    Data(Vec<u8>),
    Remote(String),
    Unspecified,
}

/// The URL schemes Ignition fetches from; their content cannot be checked offline.
const REMOTE_SCHEMES: [&str; 6] = ["http", "https", "tftp", "s3", "gs", "arn"];

fn decode(resource: &Resource) -> Result<Decoded, Invalid> {
    let at = resource.at.key("source");
    let Some(source) = &resource.source else {
        return Ok(Decoded::Unspecified);
    };
    let fail = |message: String| Invalid::At {
        path: at.clone(),
        message,
    };
    let Some((scheme, rest)) = source.split_once(':') else {
        return Err(fail("not a URL (a data: URL is expected)".to_string()));
    };
    let scheme = scheme.to_ascii_lowercase();
    if REMOTE_SCHEMES.contains(&scheme.as_str()) {
        return Ok(Decoded::Remote(scheme));
    }
    if scheme != "data" {
        return Err(fail(format!(
            "URL scheme {:?} is not one Ignition fetches from",
            crate::text::escape(&scheme)
        )));
    }
    let raw = data_url(rest).map_err(|why| fail(format!("not a valid data URL: {why}")))?;
    match resource.compression.as_deref() {
        None => Ok(Decoded::Data(raw)),
        Some(_gzip) => gunzip(&raw).map(Decoded::Data).map_err(|why| Invalid::At {
            path: resource.at.key("compression"),
            message: format!("the content of {at} does not gunzip: {why}"),
        }),
    }
}

fn too_large(at: &JsonPath) -> Invalid {
    Invalid::At {
        path: at.clone(),
        message: format!(
            "decodes to more than {} MiB, more than a node file should hold",
            MAX_CONTENT_BYTES >> 20
        ),
    }
}

/// The bytes of a data URL, after `data:`: `[<mediatype>][;base64],<data>`.
fn data_url(rest: &str) -> Result<Vec<u8>, String> {
    let (header, data) = rest
        .split_once(',')
        .ok_or("no comma between the media type and the data")?;
    let base64 = header
        .rsplit(';')
        .next()
        .is_some_and(|last| last.eq_ignore_ascii_case("base64"));
    let bytes = percent_decode(data)?;
    if !base64 {
        return Ok(bytes);
    }
    // Padding is optional in what Ignition's decoder accepts from renderers in the wild;
    // whitespace is not part of the alphabet.
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    LENIENT
        .decode(&bytes)
        .map_err(|e| format!("the base64 data does not decode: {e}"))
}

/// RFC 3986 percent-decoding: `%XX` is the byte XX; every other character stands for itself.
fn percent_decode(data: &str) -> Result<Vec<u8>, String> {
    let bytes = data.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-escape at character {}", i + 1))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn gunzip(compressed: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(compressed)
        .take(MAX_CONTENT_BYTES as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| e.to_string())?;
    if out.len() > MAX_CONTENT_BYTES {
        return Err(format!(
            "it decompresses to more than {} MiB",
            MAX_CONTENT_BYTES >> 20
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn resource(source: &str, compression: Option<&str>) -> Resource {
        Resource {
            at: JsonPath::default(),
            source: Some(source.to_string()),
            compression: compression.map(String::from),
        }
    }

    #[test]
    fn data_urls() {
        let data = |s: &str| decode(&resource(s, None));
        assert_eq!(data("data:,"), Ok(Decoded::Data(vec![])));
        assert_eq!(data("data:,a%20b%0A"), Ok(Decoded::Data(b"a b\n".to_vec())));
        assert_eq!(
            data("data:text/plain;charset=utf-8,x+y"),
            Ok(Decoded::Data(b"x+y".to_vec()))
        );
        assert_eq!(data("data:;base64,aGk="), Ok(Decoded::Data(b"hi".to_vec())));
        assert_eq!(
            data("DATA:text/plain;BASE64,aGk"),
            Ok(Decoded::Data(b"hi".to_vec()))
        );
        assert_eq!(
            data("https://example.com/x"),
            Ok(Decoded::Remote("https".into()))
        );
        assert!(
            data("data:,%zz")
                .unwrap_err()
                .to_string()
                .contains("percent-escape")
        );
        assert!(
            data("data:;base64,a!")
                .unwrap_err()
                .to_string()
                .contains("base64")
        );
        assert!(data("data:nocomma").is_err());
        assert!(data("ftp://x").unwrap_err().to_string().contains("\"ftp\""));
    }

    #[test]
    fn gzip_is_honoured() {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"compressed").unwrap();
        let b64 = base64::engine::general_purpose::STANDARD.encode(gz.finish().unwrap());
        let url = format!("data:;base64,{b64}");
        assert_eq!(
            decode(&resource(&url, Some("gzip"))),
            Ok(Decoded::Data(b"compressed".to_vec()))
        );
        let error = decode(&resource("data:,plain", Some("gzip"))).unwrap_err();
        assert!(error.to_string().contains("does not gunzip"), "{error}");
    }
}
