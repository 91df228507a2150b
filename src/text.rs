//! Text that came from outside (a certificate's subject, a file name, an API error body)
//! is escaped before it reaches a terminal, a log line, a health page or systemd's STATUS:
//! a control character could otherwise forge a log line or send a terminal an escape
//! sequence, and a bidirectional override could make a name read as another.

use std::borrow::Cow;
use std::io;

/// Characters that change how the surrounding text is displayed: C0 and C1 controls, DEL,
/// and the Unicode bidirectional embeddings, overrides and isolates.
fn is_unsafe(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every unsafe character written as a `\u{..}` escape; borrowed when there is none.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_unsafe) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_unsafe(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A writer for the text log format that escapes unsafe characters in each log line (the
/// formatter hands over one whole line, ending in its newline, per write). Values logged
/// from anywhere are covered, not only those a call site remembered to escape.
pub struct EscapingWriter<W>(pub W);

impl<W: io::Write> io::Write for EscapingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_all(buf)?;
        Ok(buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let (body, newline) = match buf.strip_suffix(b"\n") {
            Some(body) => (body, &b"\n"[..]),
            None => (buf, &b""[..]),
        };
        let text = String::from_utf8_lossy(body);
        let mut line = escape(&text).into_owned().into_bytes();
        line.extend_from_slice(newline);
        self.0.write_all(&line)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// Unix seconds as RFC 3339 in UTC, as the agent prints every date (the number itself when
/// it is out of range).
pub fn rfc3339(unix: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(unix)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| unix.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_is_utc() {
        assert_eq!(rfc3339(1_798_761_600), "2027-01-01T00:00:00Z");
    }
    use std::io::Write;

    #[test]
    fn controls_and_bidi_overrides_are_escaped() {
        assert_eq!(escape("kube-csr-signer"), "kube-csr-signer");
        assert!(matches!(escape("plain"), Cow::Borrowed(_)));
        assert_eq!(escape("a\u{1b}[31mb"), "a\\u{1b}[31mb");
        assert_eq!(escape("x\ny\rz\u{7}"), "x\\u{a}y\\u{d}z\\u{7}");
        assert_eq!(escape("ab\u{202e}cd"), "ab\\u{202e}cd");
        assert_eq!(escape("caf\u{e9} \u{4e2d}"), "caf\u{e9} \u{4e2d}");
    }

    #[test]
    fn a_log_line_keeps_only_its_own_newline() {
        let mut out = Vec::new();
        EscapingWriter(&mut out)
            .write_all(b"INFO subject=evil\n2026 ERROR forged\x1b]0;title\x07\n")
            .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "INFO subject=evil\\u{a}2026 ERROR forged\\u{1b}]0;title\\u{7}\n"
        );
    }
}
