//! `drift exclusions`, `drift check` and `drift strip` as a user runs them: rendered configs
//! (Ignition v3, and MachineConfigs wrapping one) generated here against a temporary root,
//! the managed bundle written by the real agent; and the migration, where the old writer
//! deletes the file it no longer carries and the running agent puts it back.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use base64::Engine;
use common::apiserver::ApiServer;
use common::daemon::{Agent, wait_until};
use common::pki::{self, Algorithm, Signer};
use common::{KUBECONFIG_NOWHERE, Node, agent_bin, sha256_hex, stderr, stdout};
use serde_json::{Value, json};

const SECOND: Duration = Duration::from_secs(1);
/// Where the rendered configs say the bundle is; on disk it is under the node's root.
const BUNDLE: &str = "/etc/kubernetes/kubelet-ca.crt";

// ---- rendered configs, generated against the node's root ----

/// How a file's content is written in the rendered config.
#[derive(Clone, Copy)]
enum Encoding {
    /// `data:,` with every byte that is not unreserved percent-encoded.
    Percent,
    Base64,
    /// gzip, then base64, with `compression: gzip`.
    Gzip,
}

fn data_url(content: &[u8], encoding: Encoding) -> String {
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::STANDARD.encode(bytes);
    match encoding {
        Encoding::Percent => {
            let mut url = String::from("data:,");
            for &b in content {
                if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                    url.push(b as char);
                } else {
                    url.push_str(&format!("%{b:02X}"));
                }
            }
            url
        }
        Encoding::Base64 => format!("data:;base64,{}", b64(content)),
        Encoding::Gzip => {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
            gz.write_all(content).unwrap();
            format!("data:;base64,{}", b64(&gz.finish().unwrap()))
        }
    }
}

/// One `storage.files` entry: `mode` in octal here, decimal in the JSON as Ignition has it.
fn file_entry(path: &str, content: &[u8], mode: u32, encoding: Encoding) -> Value {
    let mut contents = json!({ "source": data_url(content, encoding) });
    if let Encoding::Gzip = encoding {
        contents["compression"] = json!("gzip");
    }
    json!({ "path": path, "mode": mode, "overwrite": true, "contents": contents })
}

fn ignition(version: &str, files: Vec<Value>) -> Value {
    json!({
        "ignition": { "version": version },
        "passwd": { "users": [ { "name": "core", "sshAuthorizedKeys": ["ssh-ed25519 AAAA test"] } ] },
        "storage": { "files": files },
        "systemd": { "units": [ { "name": "kubelet.service", "enabled": true } ] }
    })
}

fn machineconfig(config: Value) -> Value {
    json!({
        "apiVersion": "machineconfiguration.openshift.io/v1",
        "kind": "MachineConfig",
        "metadata": {
            "name": "rendered-worker-0123456789abcdef",
            "annotations": { "machineconfiguration.openshift.io/generated-by-controller-version": "4.16.0" }
        },
        "spec": { "config": config, "kernelArguments": [], "osImageURL": "" }
    })
}

/// Files the old writer's config carries besides the bundle, written on the node as the
/// config says: each encoding, a mode other than 0644, a file in a nested directory.
fn node_files() -> Vec<(&'static str, Vec<u8>, u32, Encoding)> {
    vec![
        (
            "/etc/kubernetes/kubelet.conf",
            b"apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n".to_vec(),
            0o644,
            Encoding::Percent,
        ),
        (
            "/etc/crio/crio.conf.d/00-default",
            b"[crio.runtime]\nselinux = true # 100%\n".to_vec(),
            0o644,
            Encoding::Base64,
        ),
        (
            "/etc/sysconfig/kubelet-env",
            b"KUBELET_EXTRA=1\n".repeat(50),
            0o600,
            Encoding::Gzip,
        ),
        (
            "/usr/local/bin/configure-ovs.sh",
            b"#!/bin/bash\nexec true\n".to_vec(),
            0o755,
            Encoding::Base64,
        ),
    ]
}

/// Writes each file under the node's root, as the config renderer's writer would have.
fn write_node_files(node: &Node) {
    for (path, content, mode, _) in node_files() {
        let on_disk = on_node(node, path);
        fs::create_dir_all(on_disk.parent().unwrap()).unwrap();
        fs::write(&on_disk, content).unwrap();
        fs::set_permissions(&on_disk, fs::Permissions::from_mode(mode)).unwrap();
    }
}

fn on_node(node: &Node, path: &str) -> std::path::PathBuf {
    node.root().join(path.trim_start_matches('/'))
}

/// The rendered config of the old writer: the node files, and the bundle as it carried it.
fn rendered_with_bundle(bundle: &[u8]) -> Value {
    let mut files: Vec<Value> = node_files()
        .into_iter()
        .map(|(path, content, mode, encoding)| file_entry(path, &content, mode, encoding))
        .collect();
    files.insert(2, file_entry(BUNDLE, bundle, 0o644, Encoding::Base64));
    ignition("3.4.0", files)
}

fn write_json(node: &Node, name: &str, value: &Value) -> std::path::PathBuf {
    let path = node.root().join(name);
    fs::write(&path, serde_json::to_string_pretty(value).unwrap()).unwrap();
    path
}

// ---- running the commands ----

/// `kubelet-ca-agent drift <args>` against this node's bundle and state directory.
fn drift(node: &Node, args: &[&str]) -> Output {
    Command::new(agent_bin())
        .arg("drift")
        .args(args)
        .arg("--bundle")
        .arg(node.bundle())
        .arg("--state-dir")
        .arg(node.state_dir())
        .env_remove("RUST_LOG")
        .output()
        .expect("run the agent")
}

fn check(node: &Node, rendered: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "check",
        "--rendered",
        rendered.to_str().unwrap(),
        "--root",
        node.root().to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    drift(node, &args)
}

fn strip(node: &Node, rendered: &Path) -> Output {
    drift(
        node,
        &[
            "strip",
            "--rendered",
            rendered.to_str().unwrap(),
            "--root",
            node.root().to_str().unwrap(),
        ],
    )
}

fn check_json(node: &Node, rendered: &Path) -> (i32, Value) {
    let out = check(node, rendered, &["--output", "json"]);
    let report = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", stdout(&out), stderr(&out)));
    (out.status.code().unwrap(), report)
}

/// The node with its files in place and a bundle written by `sync` (so that
/// managed-files.json exists), and the bundle's content.
fn synced_node() -> (Node, String) {
    let node = Node::new();
    write_node_files(&node);
    let pem = pki::bundle_of(2, "signer");
    let source = node.source("signers.pem", &pem);
    let out = node.sync(&[&source], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(node.state_dir().join("managed-files.json").exists());
    (node, pem)
}

// ---- check ----

#[test]
fn no_drift_while_the_rendered_config_still_carries_an_older_bundle() {
    let (node, _) = synced_node();
    let older = pki::bundle_of(1, "older-signer");
    let mut config = rendered_with_bundle(older.as_bytes());
    // Whatever the config says about the managed file, even its mode, it is not compared.
    config["storage"]["files"][2]["mode"] = json!(0o600);
    // Content from elsewhere cannot be fetched offline: not checked, not drift.
    config["storage"]["files"]
        .as_array_mut()
        .unwrap()
        .push(json!({
            "path": "/etc/pki/ca-trust/source/anchors/corp.pem",
            "contents": { "source": "https://config.example.com/corp.pem?X-Amz-Signature=secret" }
        }));
    fs::create_dir_all(node.root().join("etc/pki/ca-trust/source/anchors")).unwrap();
    fs::write(
        node.root().join("etc/pki/ca-trust/source/anchors/corp.pem"),
        "x",
    )
    .unwrap();
    let rendered = write_json(&node, "rendered.json", &config);

    let out = check(&node, &rendered, &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let text = stdout(&out);
    assert!(
        !text.contains("kubelet-ca.crt"),
        "the managed file is never reported: {text}"
    );
    assert!(
        text.contains("/etc/pki/ca-trust/source/anchors/corp.pem: content not checked: its content comes from a https: URL"),
        "{text}"
    );
    assert!(
        !text.contains("secret"),
        "the URL itself is not printed: {text}"
    );
    assert!(
        text.contains("no drift: 5 of 5 files match the rendered config (1 with content not checked offline; 1 managed by kubelet-ca-agent left out)"),
        "{text}"
    );

    let (code, report) = check_json(&node, &rendered);
    assert_eq!(code, 0);
    assert_eq!(report["drifted"], json!([]));
    assert_eq!(report["in_sync"], 5);
    assert_eq!(report["managed_left_out"], 1);
    assert_eq!(report["ignition_version"], "3.4.0");
    assert_eq!(report["not_checked"][0]["entry"], "storage.files[5]");
}

#[test]
fn before_the_first_sync_the_bundle_flag_names_the_managed_file() {
    let node = Node::new();
    write_node_files(&node);
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), pki::bundle_of(1, "adopted")).unwrap();
    let rendered = write_json(&node, "rendered.json", &rendered_with_bundle(b"older"));
    assert!(!node.state_dir().join("managed-files.json").exists());
    let out = check(&node, &rendered, &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
}

#[test]
fn content_drift_is_reported_with_its_path() {
    let (node, _) = synced_node();
    let rendered = write_json(&node, "rendered.json", &rendered_with_bundle(b"old"));
    fs::write(
        on_node(&node, "/etc/kubernetes/kubelet.conf"),
        "edited by hand\n",
    )
    .unwrap();

    let out = check(&node, &rendered, &[]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let text = stdout(&out);
    let expected = b"apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n";
    let line = format!(
        "/etc/kubernetes/kubelet.conf: content differs: 15 bytes (sha256 {}…), expected {} bytes (sha256 {}…)",
        &sha256_hex(b"edited by hand\n")[..12],
        expected.len(),
        &sha256_hex(expected)[..12],
    );
    assert!(text.contains(&line), "{text}");
    assert!(text.contains("drift: 1 of 4 files differ"), "{text}");

    let (code, report) = check_json(&node, &rendered);
    assert_eq!(code, 1);
    assert_eq!(report["drifted"].as_array().unwrap().len(), 1);
    let drifted = &report["drifted"][0];
    assert_eq!(drifted["path"], "/etc/kubernetes/kubelet.conf");
    assert_eq!(drifted["entry"], "storage.files[0]");
    assert_eq!(drifted["drift"][0]["kind"], "content");
    assert_eq!(
        drifted["drift"][0]["found_sha256"],
        sha256_hex(b"edited by hand\n")
    );
    assert_eq!(drifted["drift"][0]["expected_sha256"], sha256_hex(expected));
}

#[test]
fn mode_drift_on_a_gzip_compressed_file() {
    let (node, _) = synced_node();
    let rendered = write_json(&node, "rendered.json", &rendered_with_bundle(b"old"));
    // The gzip-compressed file's content matches: only its mode drifted.
    let path = on_node(&node, "/etc/sysconfig/kubelet-env");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();

    let out = check(&node, &rendered, &[]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let text = stdout(&out);
    assert!(
        text.contains("/etc/sysconfig/kubelet-env: mode 0644, expected 0600\n"),
        "{text}"
    );
    assert!(
        !text.contains("content differs"),
        "gzip is honoured: {text}"
    );

    let (_, report) = check_json(&node, &rendered);
    assert_eq!(
        report["drifted"][0]["drift"],
        json!([{ "kind": "mode", "expected": "0600", "found": "0644" }])
    );
}

#[test]
fn a_missing_file_is_drift_and_its_name_is_escaped() {
    let (node, _) = synced_node();
    let mut config = rendered_with_bundle(b"old");
    config["storage"]["files"]
        .as_array_mut()
        .unwrap()
        .push(file_entry(
            "/etc/evil\u{1b}[31m.conf",
            b"x",
            0o644,
            Encoding::Percent,
        ));
    let rendered = write_json(&node, "rendered.json", &config);
    fs::remove_file(on_node(&node, "/etc/crio/crio.conf.d/00-default")).unwrap();

    let out = check(&node, &rendered, &[]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains("/etc/crio/crio.conf.d/00-default: missing\n"),
        "{text}"
    );
    assert!(
        text.contains("/etc/evil\\u{1b}[31m.conf: missing\n"),
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "{text}");
    // A link where the file should be is not followed: it is drift too.
    let link = on_node(&node, "/etc/crio/crio.conf.d/00-default");
    std::os::unix::fs::symlink(on_node(&node, "/etc/kubernetes/kubelet.conf"), &link).unwrap();
    let text = stdout(&check(&node, &rendered, &[]));
    assert!(
        text.contains("/etc/crio/crio.conf.d/00-default: a symbolic link, expected a regular file"),
        "{text}"
    );
}

#[test]
fn a_machineconfig_wrapper_is_read_like_the_ignition_document_it_holds() {
    let (node, _) = synced_node();
    let mc = machineconfig(rendered_with_bundle(b"old"));
    let rendered = write_json(&node, "rendered-mc.json", &mc);
    let out = check(&node, &rendered, &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(stdout(&out).contains("no drift: 4 of 4 files"));

    fs::write(
        on_node(&node, "/usr/local/bin/configure-ovs.sh"),
        "#!/bin/sh\n",
    )
    .unwrap();
    let (code, report) = check_json(&node, &rendered);
    assert_eq!(code, 1);
    assert_eq!(
        report["drifted"][0]["path"],
        "/usr/local/bin/configure-ovs.sh"
    );
    assert_eq!(
        report["drifted"][0]["entry"],
        "spec.config.storage.files[4]"
    );
}

#[test]
fn todays_machineconfigs_rendered_as_ignition_3_5_are_checked_and_stripped() {
    let (node, _) = synced_node();
    for version in ["3.5.0", "3.6.0"] {
        let mut config = rendered_with_bundle(b"old");
        config["ignition"]["version"] = json!(version);
        let rendered = write_json(&node, &format!("mc-{version}.json"), &machineconfig(config));
        let out = check(&node, &rendered, &[]);
        assert_eq!(out.status.code(), Some(0), "{version}: {}", stderr(&out));
        assert!(
            stdout(&out).contains("no drift: 4 of 4 files"),
            "{}",
            stdout(&out)
        );
        let out = strip(&node, &rendered);
        assert_eq!(out.status.code(), Some(0), "{version}: {}", stderr(&out));
        assert!(
            !stdout(&out).contains(BUNDLE),
            "{version}: the bundle was not stripped"
        );
    }
}

#[test]
fn bad_json_and_a_wrong_ignition_version_exit_2_saying_where() {
    let (node, _) = synced_node();
    let write = |name: &str, text: &str| {
        let path = node.root().join(name);
        fs::write(&path, text).unwrap();
        path
    };
    let cases: Vec<(std::path::PathBuf, &str)> = vec![
        (
            write(
                "truncated.json",
                "{\n  \"ignition\": {\"version\": \"3.4.0\"},\n  \"storage\": {",
            ),
            "truncated.json: not valid JSON at line 3, column 14",
        ),
        (
            write("v2.json", &ignition("2.2.0", vec![]).to_string()),
            "v2.json: ignition.version: Ignition version \"2.2.0\" is not supported",
        ),
        (
            write(
                "mc-v37.json",
                &machineconfig(ignition("3.7.0-experimental", vec![])).to_string(),
            ),
            "mc-v37.json: spec.config.ignition.version: Ignition version \"3.7.0-experimental\" is not supported: this reads Ignition 3.0.0 to 3.6.0",
        ),
        (
            write("bad-source.json", &{
                let mut config = rendered_with_bundle(b"old");
                config["storage"]["files"][3]["contents"]["source"] =
                    json!("data:;base64,not base64!");
                config.to_string()
            }),
            "bad-source.json: storage.files[3].contents.source: not a valid data URL: the base64 data does not decode",
        ),
        (
            write("yaml.json", "spec:\n  config: {}\n"),
            "(JSON is expected",
        ),
    ];
    for (path, expected) in &cases {
        let out = check(&node, path, &[]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{}: {}",
            path.display(),
            stderr(&out)
        );
        let err = stderr(&out);
        assert!(err.contains(expected), "{}: {err}", path.display());
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(stdout(&out).is_empty());
    }
    // strip reads the same documents the same way.
    let out = strip(&node, &cases[1].0);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("\"2.2.0\" is not supported"));
    // A file the document names that cannot be read: not drift, not no drift.
    let missing = node.root().join("nowhere.json");
    let out = check(&node, &missing, &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("cannot read"), "{}", stderr(&out));
}

// ---- strip ----

#[test]
fn strip_removes_the_managed_file_and_keeps_every_other_byte() {
    let (node, pem) = synced_node();
    for wrap in [false, true] {
        let config = rendered_with_bundle(pem.as_bytes());
        let document = if wrap { machineconfig(config) } else { config };
        // Compact, so that each entry's text can be found verbatim in the output.
        let path = node.root().join("rendered.json");
        fs::write(&path, document.to_string()).unwrap();
        let out = strip(&node, &path);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let text = stdout(&out);
        let stripped: Value = serde_json::from_str(&text).expect("the output parses");

        let files = |doc: &Value| -> Vec<Value> {
            let config = if wrap { &doc["spec"]["config"] } else { doc };
            config["storage"]["files"].as_array().unwrap().clone()
        };
        let before = files(&document);
        let after = files(&stripped);
        let kept: Vec<&Value> = before.iter().filter(|f| f["path"] != BUNDLE).collect();
        assert_eq!(after.len(), before.len() - 1);
        assert!(after.iter().all(|f| f["path"] != BUNDLE));
        for (was, is) in kept.iter().zip(&after) {
            assert_eq!(*was, is);
            // Byte for byte: the entry's text, and the content it decodes to.
            assert!(text.contains(&is.to_string()), "{is} not verbatim");
            let (path, content, ..) = node_files()
                .into_iter()
                .find(|(p, ..)| *p == is["path"])
                .unwrap();
            assert_eq!(decode(is), content, "{path}");
        }
        // Everything else is as it was.
        let mut expected = document.clone();
        let config = if wrap {
            &mut expected["spec"]["config"]
        } else {
            &mut expected
        };
        config["storage"]["files"] = Value::Array(kept.into_iter().cloned().collect());
        assert_eq!(stripped, expected);
        // The stripped config is one the check reads, with no drift.
        let stripped_path = node.root().join("stripped.json");
        fs::write(&stripped_path, &text).unwrap();
        assert_eq!(check(&node, &stripped_path, &[]).status.code(), Some(0));
    }
}

#[test]
fn strip_of_a_document_without_the_managed_file_prints_it_unchanged() {
    let (node, _) = synced_node();
    let mut config = rendered_with_bundle(b"old");
    config["storage"]["files"].as_array_mut().unwrap().remove(2);
    // Pretty, with a float, a unicode escape and key order a re-serializer would change.
    let text = serde_json::to_string_pretty(&config).unwrap().replacen(
        "{\n  \"ignition\"",
        "{\n  \"zeta\": 1.50e2,\n  \"name\": \"caf\\u00e9\",\n  \"ignition\"",
        1,
    ) + "\n";
    let path = node.root().join("rendered.json");
    fs::write(&path, &text).unwrap();
    let out = drift(&node, &["strip", "--rendered", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), text);
    // Standard input works too.
    let mut child = Command::new(agent_bin())
        .args(["drift", "strip", "--rendered", "-", "--state-dir"])
        .arg(node.state_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), text);
}

/// The bytes of a generated entry's data URL.
fn decode(entry: &Value) -> Vec<u8> {
    let source = entry["contents"]["source"].as_str().unwrap();
    let (header, data) = source
        .strip_prefix("data:")
        .unwrap()
        .split_once(',')
        .unwrap();
    let bytes = if header.ends_with(";base64") {
        base64::engine::general_purpose::STANDARD
            .decode(data)
            .unwrap()
    } else {
        let mut out = Vec::new();
        let mut rest = data.as_bytes();
        while let Some((&b, tail)) = rest.split_first() {
            if b == b'%' {
                out.push(u8::from_str_radix(std::str::from_utf8(&tail[..2]).unwrap(), 16).unwrap());
                rest = &tail[2..];
            } else {
                out.push(b);
                rest = tail;
            }
        }
        out
    };
    if entry["contents"]["compression"] == "gzip" {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut out)
            .unwrap();
        out
    } else {
        bytes
    }
}

// ---- exclusions ----

#[test]
fn exclusions_in_each_format() {
    let node = Node::new();
    let bundle = node.bundle();
    let bundle = bundle.to_str().unwrap();
    let exclusions = |format: &str| {
        let out = drift(&node, &["exclusions", "--format", format]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        stdout(&out)
    };
    // Every path the agent creates under the bundle's directory: the bundle, and the
    // temporary file each write creates beside it (issue 34), in every format.
    let dir = node.bundle().parent().unwrap().display().to_string();
    let temporary = format!("{dir}/.kubelet-ca.crt.kubelet-ca-agent-tmp.*");
    let aide = format!(
        "!{bundle}$\n!{}/\\.kubelet-ca\\.crt\\.kubelet-ca-agent-tmp\\.[^/]*$\n",
        dir
    );
    // Before the first sync, from the flags.
    assert_eq!(exclusions("plain"), format!("{bundle}\n{temporary}\n"));
    assert_eq!(exclusions("aide"), aide);
    let json: Value = serde_json::from_str(&exclusions("json")).unwrap();
    assert_eq!(
        json,
        json!({ "record": null, "files": [ { "path": bundle, "sha256": null, "temporary": temporary } ], "registry_sets": [] })
    );

    // After it, from managed-files.json, with the SHA-256 of the content.
    let pem = pki::bundle_of(1, "ca");
    let source = node.source("ca.pem", &pem);
    assert!(node.sync(&[&source], &[]).status.success());
    let record = node.state_dir().join("managed-files.json");
    let json: Value = serde_json::from_str(&exclusions("json")).unwrap();
    assert_eq!(
        json,
        json!({ "record": record, "files": [ { "path": bundle, "sha256": sha256_hex(pem.as_bytes()), "temporary": temporary } ], "registry_sets": [] })
    );
    assert_eq!(exclusions("plain"), format!("{bundle}\n{temporary}\n"));
    assert_eq!(exclusions("aide"), aide);
    // The AIDE rule matches the names the writer gives its temporary files, and nothing
    // else, by a regex engine nobody here wrote (grep -E, as AIDE's are POSIX-like).
    let rule = aide
        .lines()
        .nth(1)
        .unwrap()
        .trim_start_matches('!')
        .to_string();
    let matches = |name: &str| {
        Command::new("grep")
            .args(["-Eq", &format!("^{rule}")])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .map(|mut child| {
                use std::io::Write;
                child
                    .stdin
                    .take()
                    .unwrap()
                    .write_all(format!("{dir}/{name}\n").as_bytes())
                    .unwrap();
                child.wait().unwrap().success()
            })
            .unwrap()
    };
    assert!(matches(".kubelet-ca.crt.kubelet-ca-agent-tmp.1234.0"));
    assert!(!matches("xkubelet-caxcrt.kubelet-ca-agent-tmp.1"));
    assert!(!matches(".kubelet-ca.crt.kubelet-ca-agent-tmp.1/x"));
    // The default path, as SPEC 8 shows it.
    let out = Command::new(agent_bin())
        .args(["drift", "exclusions", "--format", "aide", "--state-dir"])
        .arg(node.root().join("no-state"))
        .env_remove("KUBELET_CA_AGENT_BUNDLE")
        .output()
        .unwrap();
    assert_eq!(
        stdout(&out),
        "!/etc/kubernetes/kubelet-ca.crt$\n!/etc/kubernetes/\\.kubelet-ca\\.crt\\.kubelet-ca-agent-tmp\\.[^/]*$\n"
    );
    // A registry set: each registry's directory, its ca.crt and that file's temporary
    // files, whichever registries come later; in each format.
    let set = |format: &str| {
        let out = Command::new(agent_bin())
            .args(["drift", "exclusions", "--format", format, "--state-dir"])
            .arg(node.root().join("no-state"))
            .args([
                "--manage-registries",
                "/etc/docker/certs.d=dir:/etc/registries",
            ])
            .env_remove("KUBELET_CA_AGENT_BUNDLE")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        stdout(&out)
    };
    assert!(
        set("aide").ends_with(
            "!/etc/docker/certs.d/[^/]+(/(ca\\.crt|\\.ca\\.crt\\.kubelet-ca-agent-tmp\\.[^/]*))?$\n"
        ),
        "{}",
        set("aide")
    );
    let globs = [
        "/etc/docker/certs.d/*",
        "/etc/docker/certs.d/*/ca.crt",
        "/etc/docker/certs.d/*/.ca.crt.kubelet-ca-agent-tmp.*",
    ];
    assert!(
        set("plain").ends_with(&format!("{}\n", globs.join("\n"))),
        "{}",
        set("plain")
    );
    let json: Value = serde_json::from_str(&set("json")).unwrap();
    assert_eq!(
        json["registry_sets"],
        json!([{"directory": "/etc/docker/certs.d", "paths": globs}])
    );
    // A record that cannot be trusted is an error, never a guess.
    fs::write(&record, "{ not json").unwrap();
    let out = drift(&node, &["exclusions"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("managed-files.json"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn managed_files_json_follows_a_rotation() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("kube-csr-signer-1", Algorithm::P256),
        Signer::new("kube-csr-signer-2", Algorithm::P256),
    );
    let source = node.source("signers.pem", a.pem());
    let _agent = Agent::start(&node, &[&source], &[]);
    wait_until(5 * SECOND, || node.holds(a.pem()));
    let recorded = || -> Option<String> {
        let out = drift(&node, &["exclusions", "--format", "json"]);
        let json: Value = serde_json::from_slice(&out.stdout).ok()?;
        json["files"][0]["sha256"].as_str().map(String::from)
    };
    wait_until(2 * SECOND, || {
        recorded() == Some(sha256_hex(a.pem().as_bytes()))
    });

    let rotated = a.pem() + &b.pem();
    fs::write(source.strip_prefix("file:").unwrap(), &rotated).unwrap();
    wait_until(2 * SECOND, || node.holds(&rotated));
    wait_until(2 * SECOND, || {
        recorded() == Some(sha256_hex(rotated.as_bytes()))
    });
    assert_eq!(recorded(), Some(sha256_hex(&node.read_bundle())));
}

// ---- the migration ----

/// The old writer's config carried the bundle; `strip` takes it out; the old writer, applying
/// the new config, deletes the file it no longer carries; the agent puts it back within a
/// second, with nothing to ask the API server; and neither config shows drift.
fn migrate(node: &Node, agent: &Agent, bundle: &str) {
    agent.wait_listening();
    wait_until(5 * SECOND, || {
        agent.get("/readyz").is_some_and(|(code, _)| code == 200)
    });
    // The old writer's config carries a bundle of its own time, older than the file's.
    let older = pki::bundle_of(1, "older-signer");
    let old = write_json(
        node,
        "rendered-old.json",
        &machineconfig(rendered_with_bundle(older.as_bytes())),
    );
    let out = strip(node, &old);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).contains(BUNDLE));
    let new = node.root().join("rendered-new.json");
    fs::write(&new, &out.stdout).unwrap();

    fs::remove_file(node.bundle()).unwrap();
    let took = wait_until(SECOND, || node.holds(bundle));
    eprintln!("the deleted bundle was back in {took:?}");
    for config in [&old, &new] {
        let out = check(node, config, &[]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}{}",
            stdout(&out),
            stderr(&out)
        );
    }
}

#[test]
fn migration_with_the_api_server_unreachable_the_deleted_bundle_comes_back() {
    let node = Node::new();
    write_node_files(&node);
    let pem = pki::bundle_of(2, "signer");
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &pem).unwrap();
    let kubeconfig = node.root().join("kubeconfig");
    fs::write(&kubeconfig, KUBECONFIG_NOWHERE).unwrap();
    let agent = Agent::start(
        &node,
        &["configmap:openshift-config-managed/kube-apiserver-client-ca"],
        &["--kubeconfig", kubeconfig.to_str().unwrap()],
    );
    migrate(&node, &agent, &pem);
}

#[test]
fn migration_with_the_api_server_gone_after_the_first_sync_the_deleted_bundle_comes_back() {
    let api = ApiServer::start();
    let node = Node::new();
    write_node_files(&node);
    let signer = Signer::new("kube-csr-signer", Algorithm::P256);
    let pem = signer.pem();
    // The old writer's file, with the signer the cluster carries.
    fs::create_dir_all(node.bundle_dir()).unwrap();
    fs::write(node.bundle(), &pem).unwrap();
    api.put_configmap(
        "openshift-config-managed",
        "kube-apiserver-client-ca",
        &[("ca-bundle.crt", &pem)],
        &[],
    );
    let agent = Agent::start(
        &node,
        &["configmap:openshift-config-managed/kube-apiserver-client-ca"],
        &["--kubeconfig", api.kubeconfig().to_str().unwrap()],
    );
    agent.wait_listening();
    wait_until(10 * SECOND, || {
        agent.metric("kubelet_ca_source_up{") == Some(1.0)
            && node.state_dir().join("managed-files.json").exists()
    });
    api.stop();
    migrate(&node, &agent, &pem);
}

#[test]
fn links_under_the_root_resolve_inside_it() {
    let (node, _) = synced_node();
    let rendered = write_json(&node, "rendered.json", &rendered_with_bundle(b"old"));
    // /etc/crio is an absolute link, as in a node image: under --root it must lead to the
    // node's /etc/crio-real, never to the host's.
    let crio = on_node(&node, "/etc/crio");
    fs::rename(&crio, on_node(&node, "/etc/crio-real")).unwrap();
    std::os::unix::fs::symlink("/etc/crio-real", &crio).unwrap();
    let out = check(&node, &rendered, &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
}
