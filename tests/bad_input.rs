//! Every bad input a local source can carry (SPEC 12): the run exits 1, the file stays
//! byte-for-byte as it was, and the one error line names the source and the reason without
//! echoing any of the bad content.

mod common;

use std::fs;

use common::pki::{self, Algorithm, Signer};
use common::{Node, fingerprint_file, require, stderr};
use time::Duration;

struct Case {
    name: &'static str,
    content: Vec<u8>,
    /// Words the error must contain (besides the source spec).
    expect: &'static [&'static str],
}

fn cases(good: &Signer) -> Vec<Case> {
    let pem = good.pem();
    let key = good.key_pem();
    let truncated = pem[..pem.len() / 2].to_string();
    let mut bad_base64 = pem.clone();
    bad_base64.replace_range(40..44, "!!!!");
    let corrupt_der = {
        let mut der = good.der();
        der.truncate(der.len() - 10);
        pem::encode(&pem::Pem::new("CERTIFICATE", der))
    };
    let expired = Signer::valid_between(
        "expired",
        Algorithm::P256,
        Duration::days(-30),
        Duration::days(-1),
    )
    .pem();
    vec![
        Case {
            name: "private key after a certificate",
            content: format!("{pem}{key}").into(),
            expect: &["PRIVATE KEY", "block 2"],
        },
        Case {
            name: "private key alone",
            content: key.clone().into(),
            expect: &["PRIVATE KEY", "block 1"],
        },
        Case {
            name: "truncated PEM",
            content: format!("{pem}{truncated}").into(),
            expect: &["block 2", "truncated"],
        },
        Case {
            name: "garbage",
            content: b"\x00\x01 this is not PEM at all \xff\xfe".to_vec(),
            expect: &["no CERTIFICATE"],
        },
        Case {
            name: "empty file",
            content: Vec::new(),
            expect: &["no CERTIFICATE"],
        },
        Case {
            name: "bad base64",
            content: bad_base64.into(),
            expect: &["block 1", "base64"],
        },
        Case {
            name: "corrupt DER",
            content: corrupt_der.into(),
            expect: &["block 1", "X.509"],
        },
        Case {
            name: "other PEM type",
            content: b"-----BEGIN X509 CRL-----\nMAA=\n-----END X509 CRL-----\n".to_vec(),
            expect: &["X509 CRL", "not a CERTIFICATE"],
        },
        Case {
            name: "mismatched armor",
            content: pem
                .replace("END CERTIFICATE", "END CERTIFICATE REQUEST")
                .into(),
            expect: &["closed by END"],
        },
        Case {
            name: "huge",
            content: pem.repeat(4 * 1024 * 1024 / pem.len() + 2).into(),
            expect: &["limit"],
        },
        Case {
            name: "only a non-CA certificate",
            content: pki::leaf("leaf").into(),
            // Not "none is valid now": nothing is expired, there is no CA at all.
            expect: &["no CA certificate", "not a CA", "\"leaf\""],
        },
        Case {
            name: "only an expired signer",
            content: expired.into(),
            expect: &["none is valid"],
        },
    ]
}

#[test]
fn every_bad_input_exits_1_and_leaves_the_file_as_it_was() {
    let node = Node::new();
    let good = Signer::new("good", Algorithm::P256);
    let source = node.source("a.pem", good.pem());
    assert!(node.sync(&[&source], &[]).status.success());
    let before = fingerprint_file(&node.bundle());
    let key_lines: Vec<String> = good
        .key_pem()
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .map(String::from)
        .collect();
    let cert_lines: Vec<String> = good
        .pem()
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .map(String::from)
        .collect();

    for case in cases(&good) {
        fs::write(source.strip_prefix("file:").unwrap(), &case.content).unwrap();
        let out = node.sync(&[&source], &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{}: {err}", case.name);
        assert_eq!(
            fingerprint_file(&node.bundle()),
            before,
            "{}: the file changed",
            case.name
        );
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("kubelet-ca-agent: error:"),
            "{}: {err}",
            case.name
        );
        for word in case.expect {
            assert!(
                last.contains(word),
                "{}: {last:?} lacks {word:?}",
                case.name
            );
        }
        if !case.expect.contains(&"none is valid") {
            assert!(
                last.contains(&source),
                "{}: {last:?} does not name the source",
                case.name
            );
        }
        for line in key_lines.iter().chain(&cert_lines) {
            assert!(
                !err.contains(line.as_str()),
                "{}: key or certificate material in the output",
                case.name
            );
        }
        assert!(
            node.stray_files().is_empty(),
            "{}: left {:?}",
            case.name,
            node.stray_files()
        );
    }
}

#[test]
fn one_bad_source_among_good_ones_fails_the_run() {
    let node = Node::new();
    let good = Signer::new("good", Algorithm::P256);
    let first = node.source("first.pem", good.pem());
    assert!(node.sync(&[&first], &[]).status.success());
    let before = fingerprint_file(&node.bundle());
    let bad = node.source(
        "second.pem",
        format!(
            "{}{}",
            Signer::new("x", Algorithm::P256).pem(),
            good.key_pem()
        ),
    );
    let out = node.sync(&[&first, &bad], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("second.pem"), "{}", stderr(&out));
    assert_eq!(fingerprint_file(&node.bundle()), before);
}

#[test]
fn a_missing_source_file_is_a_clear_runtime_error() {
    let node = Node::new();
    let out = node.sync(&["file:/nonexistent/ca.pem"], &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("file:/nonexistent/ca.pem") && err.contains("No such file"),
        "{err}"
    );
    assert!(!node.bundle().exists(), "nothing written");
}

#[test]
fn a_dir_source_with_a_bad_file_names_the_file() {
    let node = Node::new();
    let dir = node.root().join("signers");
    fs::create_dir_all(&dir).unwrap();
    let signer = Signer::new("s", Algorithm::P256);
    fs::write(dir.join("a.crt"), signer.pem()).unwrap();
    fs::write(dir.join("b.pem"), signer.key_pem()).unwrap();
    let out = node.sync(&[&format!("dir:{}", dir.display())], &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("b.pem") && err.contains("PRIVATE KEY"),
        "{err}"
    );
    assert!(!node.bundle().exists());

    let empty = node.root().join("empty");
    fs::create_dir_all(&empty).unwrap();
    let out = node.sync(&[&format!("dir:{}", empty.display())], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("no *.crt or *.pem file in"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn an_unwritable_directory_exits_1_and_keeps_the_old_file() {
    if !require(common::is_root(), "chattr +i needs root") {
        return;
    }
    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(1, "old"));
    assert!(node.sync(&[&source], &[]).status.success());
    let before = fingerprint_file(&node.bundle());
    fs::write(
        source.strip_prefix("file:").unwrap(),
        pki::bundle_of(1, "new"),
    )
    .unwrap();

    let dir = node.bundle_dir();
    if !require(
        common::chattr("+i", &dir),
        "chattr +i is not supported on this filesystem",
    ) {
        return;
    }
    let _undo = Undo(dir.clone());
    let out = node.sync(&[&source], &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap();
    assert!(
        last.contains("cannot replace") && last.contains("Operation not permitted"),
        "{last}"
    );
    assert!(last.contains("left as it was"), "{last}");
    assert_eq!(fingerprint_file(&node.bundle()), before);

    struct Undo(std::path::PathBuf);
    impl Drop for Undo {
        fn drop(&mut self) {
            let _ = std::process::Command::new("chattr")
                .arg("-i")
                .arg(&self.0)
                .status();
        }
    }
}
