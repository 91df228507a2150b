//! `sync` end to end: the real binary, certificates made at run time, and openssl as the
//! judge of whether the written bundle really lets the kubelet verify clients.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use common::pki::{self, ALL_ALGORITHMS, Algorithm, Signer};
use common::{Node, fingerprint_file, openssl_verifies, require, stderr, stdout};
use time::Duration;

#[test]
fn written_bundle_verifies_clients_of_every_signer_and_no_other() {
    let node = Node::new();
    let signers: Vec<Signer> = ALL_ALGORITHMS
        .iter()
        .map(|alg| Signer::new(&format!("signer-{alg:?}"), *alg))
        .collect();
    let pem: String = signers.iter().map(Signer::pem).collect();
    let out = node.sync(&[&node.source("bundle.pem", &pem)], &[]);
    assert!(out.status.success(), "sync failed: {}", stderr(&out));

    for signer in &signers {
        let (client, _) = signer.issue_client("system:admin");
        assert!(
            openssl_verifies(&node.bundle(), &client),
            "client of {} is not accepted",
            signer.cn
        );
    }
    let stranger = Signer::new("not-in-the-bundle", Algorithm::P256);
    let (client, _) = stranger.issue_client("mallory");
    assert!(!openssl_verifies(&node.bundle(), &client));
}

#[test]
fn well_formed_single_source_is_written_byte_identical() {
    let node = Node::new();
    let pem = pki::bundle_of(3, "ca");
    let out = node.sync(&[&node.source("a.pem", &pem)], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(node.read_bundle(), pem.as_bytes());
    let mode = fs::metadata(node.bundle()).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o644);
}

#[test]
fn sources_are_merged_in_order_and_deduplicated_with_crlf_and_text_accepted() {
    let node = Node::new();
    let (a, b, c) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::Ed25519),
        Signer::new("c", Algorithm::P384),
    );
    let first =
        format!("# signers of the first source\n{}{}", a.pem(), b.pem()).replace('\n', "\r\n");
    let second = format!(
        "{}\nsome text between blocks\n{}{}",
        b.pem(),
        c.pem(),
        a.pem()
    );
    let out = node.sync(
        &[
            &node.source("first.pem", first),
            &node.source("second.pem", second),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        node.read_bundle(),
        format!("{}{}{}", a.pem(), b.pem(), c.pem()).as_bytes()
    );
}

#[test]
fn dir_source_reads_crt_and_pem_files_in_name_order() {
    let node = Node::new();
    let dir = node.root().join("signers");
    fs::create_dir_all(&dir).unwrap();
    let (a, b, c) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
        Signer::new("c", Algorithm::P256),
    );
    fs::write(dir.join("20-b.pem"), b.pem()).unwrap();
    fs::write(dir.join("10-a.crt"), a.pem()).unwrap();
    fs::write(dir.join("30-c.txt"), c.pem()).unwrap(); // not *.crt or *.pem: ignored
    fs::write(dir.join("README"), "not a certificate").unwrap();
    let out = node.sync(&[&format!("dir:{}", dir.display())], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        node.read_bundle(),
        format!("{}{}", a.pem(), b.pem()).as_bytes()
    );
}

#[test]
fn unchanged_bundle_never_touches_the_file() {
    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(2, "ca"));
    assert!(node.sync(&[&source], &[]).status.success());
    let before = fingerprint_file(&node.bundle());
    std::thread::sleep(std::time::Duration::from_millis(20));
    let out = node.sync(&[&source], &[]);
    assert!(out.status.success());
    assert!(stderr(&out).contains("already in sync"), "{}", stderr(&out));
    assert_eq!(
        fingerprint_file(&node.bundle()),
        before,
        "inode, mtime or content changed"
    );
}

#[test]
fn rotation_replaces_the_file_with_a_new_inode_and_keeps_history() {
    let node = Node::new();
    let old = Signer::new("old", Algorithm::P256);
    let new = Signer::new("new", Algorithm::P256);
    let source = node.source("a.pem", old.pem());
    assert!(node.sync(&[&source], &[]).status.success());
    let inode_before = fs::metadata(node.bundle()).unwrap().ino();

    fs::write(
        node.root().join("sources/a.pem"),
        format!("{}{}", old.pem(), new.pem()),
    )
    .unwrap();
    let out = node.sync(&[&source], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("added=1"), "{}", stderr(&out));
    assert_ne!(fs::metadata(node.bundle()).unwrap().ino(), inode_before);
    assert_eq!(
        node.read_bundle(),
        format!("{}{}", old.pem(), new.pem()).as_bytes()
    );

    let history: Vec<_> = fs::read_dir(node.state_dir().join("history"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(history.len(), 1);
    assert_eq!(fs::read(&history[0]).unwrap(), old.pem().as_bytes());
    let mode = fs::metadata(&history[0]).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "history is for root only");
    let name = history[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let sha = hex_sha256(old.pem().as_bytes());
    assert!(name.contains(&sha), "history name {name} lacks the sha256");
    assert!(
        node.stray_files().is_empty(),
        "left behind: {:?}",
        node.stray_files()
    );
}

#[test]
fn history_keeps_the_last_ten_replaced_bundles() {
    let node = Node::new();
    let source = node.source("a.pem", "");
    let mut written = Vec::new();
    for i in 0..13 {
        let pem = Signer::new(&format!("gen-{i}"), Algorithm::P256).pem();
        fs::write(source.strip_prefix("file:").unwrap(), &pem).unwrap();
        let out = node.sync(&[&source], &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        written.push(pem);
    }
    let mut history: Vec<_> = fs::read_dir(node.state_dir().join("history"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    history.sort();
    assert_eq!(history.len(), 10);
    // 12 bundles were replaced (gen-0 .. gen-11); the newest 10 are gen-2 .. gen-11.
    for (entry, pem) in history.iter().zip(&written[2..12]) {
        assert_eq!(&fs::read_to_string(entry).unwrap(), pem);
    }
}

#[test]
fn non_ca_certificates_are_left_out_with_a_warning() {
    let node = Node::new();
    let ca = Signer::new("real-ca", Algorithm::P256);
    let leaf = pki::leaf("just-a-server");
    let out = node.sync(&[&node.source("a.pem", format!("{leaf}{}", ca.pem()))], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(node.read_bundle(), ca.pem().as_bytes());
    let err = stderr(&out);
    assert!(
        err.contains("not a CA") && err.contains("just-a-server") && err.contains("block=1"),
        "{err}"
    );
}

#[test]
fn expired_certificates_are_kept_unless_drop_expired() {
    let node = Node::new();
    let live = Signer::new("live", Algorithm::P256);
    let dead = Signer::valid_between(
        "dead",
        Algorithm::P256,
        Duration::days(-60),
        Duration::days(-1),
    );
    let future = Signer::valid_between(
        "next",
        Algorithm::P256,
        Duration::days(10),
        Duration::days(400),
    );
    let source = node.source(
        "a.pem",
        format!("{}{}{}", dead.pem(), live.pem(), future.pem()),
    );
    assert!(node.sync(&[&source], &[]).status.success());
    assert_eq!(
        node.read_bundle(),
        format!("{}{}{}", dead.pem(), live.pem(), future.pem()).as_bytes()
    );

    let out = node.sync(&[&source], &["--drop-expired"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // A not-yet-valid signer is the next rotation, distributed ahead: it stays.
    assert_eq!(
        node.read_bundle(),
        format!("{}{}", live.pem(), future.pem()).as_bytes()
    );
}

#[test]
fn retain_removed_keeps_a_vanished_signer_across_runs() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("a", Algorithm::P256),
        Signer::new("b", Algorithm::P256),
    );
    let source = node.source("a.pem", format!("{}{}", a.pem(), b.pem()));
    let retain = ["--retain-removed", "1h"];
    assert!(node.sync(&[&source], &retain).status.success());

    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    let out = node.sync(&[&source], &retain);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        node.read_bundle(),
        format!("{}{}", b.pem(), a.pem()).as_bytes(),
        "a is retained"
    );
    // The memory survives a restart: a later run still keeps it (and does not rewrite).
    let before = fingerprint_file(&node.bundle());
    assert!(node.sync(&[&source], &retain).status.success());
    assert_eq!(fingerprint_file(&node.bundle()), before);
    // Without retention the sources are the truth again.
    assert!(node.sync(&[&source], &[]).status.success());
    assert_eq!(node.read_bundle(), b.pem().as_bytes());
}

#[test]
fn dry_run_reports_the_plan_and_writes_nothing() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("alpha", Algorithm::P256),
        Signer::new("beta", Algorithm::P256),
    );
    let source = node.source("a.pem", a.pem());
    assert!(node.sync(&[&source], &[]).status.success());
    let before = fingerprint_file(&node.bundle());

    fs::write(source.strip_prefix("file:").unwrap(), b.pem()).unwrap();
    let out = node.sync(&[&source], &["--dry-run"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = stdout(&out);
    assert!(
        plan.contains("would add") && plan.contains("beta"),
        "{plan}"
    );
    assert!(
        plan.contains("would remove") && plan.contains("alpha"),
        "{plan}"
    );
    assert!(plan.contains(&hex_sha256(&b.der())), "{plan}");
    assert!(
        plan.contains("would change: 1 -> 1 certificates (1 added, 1 removed)"),
        "{plan}"
    );
    assert_eq!(fingerprint_file(&node.bundle()), before);

    fs::write(source.strip_prefix("file:").unwrap(), a.pem()).unwrap();
    let out = node.sync(&[&source], &["--dry-run"]);
    assert!(stdout(&out).contains("in sync"), "{}", stdout(&out));

    // Only added: counted as such, never taken for the same certificates.
    fs::write(source.strip_prefix("file:").unwrap(), a.pem() + &b.pem()).unwrap();
    let out = node.sync(&[&source], &["--dry-run"]);
    assert!(
        stdout(&out).contains("would change: 1 -> 2 certificates (1 added, 0 removed)"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn stale_temporary_files_from_a_killed_run_are_removed() {
    let node = Node::new();
    fs::create_dir_all(node.bundle_dir()).unwrap();
    // A dead writer's leftover (pid 2^22+1 cannot exist on Linux) and an unrelated file.
    let stale = node
        .bundle_dir()
        .join(".kubelet-ca.crt.kubelet-ca-agent-tmp.4194305.0");
    fs::write(&stale, "half a bund").unwrap();
    fs::write(node.bundle_dir().join("other.conf"), "keep me").unwrap();
    let out = node.sync(&[&node.source("a.pem", pki::bundle_of(1, "ca"))], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stale.exists());
    assert_eq!(node.stray_files(), vec!["other.conf".to_string()]);
}

#[test]
fn a_leftover_that_cannot_be_removed_is_reported_and_the_others_still_go() {
    if !require(common::is_root(), "chattr +i needs root") {
        return;
    }
    let node = Node::new();
    fs::create_dir_all(node.bundle_dir()).unwrap();
    let leftover = |n: u32| {
        let path = node
            .bundle_dir()
            .join(format!(".kubelet-ca.crt.kubelet-ca-agent-tmp.4194305.{n}"));
        fs::write(&path, "half a bund").unwrap();
        path
    };
    let (stuck, stale) = (leftover(0), leftover(1));
    if !require(
        common::chattr("+i", &stuck),
        "chattr +i is not supported on this filesystem",
    ) {
        return;
    }
    let out = node.sync(&[&node.source("a.pem", pki::bundle_of(1, "ca"))], &[]);
    common::chattr("-i", &stuck);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(!stale.exists(), "the removable leftover is removed: {err}");
    let warning = err
        .lines()
        .find(|l| l.contains("cannot remove a temporary file left by a killed run"))
        .unwrap_or_else(|| panic!("no warning for the immutable leftover: {err}"));
    assert!(
        warning.contains(&*stuck.to_string_lossy()) && warning.contains("Operation not permitted"),
        "{warning}"
    );
}

#[test]
fn a_temporary_file_still_being_written_is_left_alone() {
    let node = Node::new();
    fs::create_dir_all(node.bundle_dir()).unwrap();
    // Another writer's temporary file, locked as ours are while they are written.
    let busy = node
        .bundle_dir()
        .join(".kubelet-ca.crt.kubelet-ca-agent-tmp.1.0");
    let file = fs::File::create(&busy).unwrap();
    file.lock().unwrap();
    let stale_history = node
        .state_dir()
        .join("history/.x.crt.kubelet-ca-agent-tmp.1.0");
    fs::create_dir_all(stale_history.parent().unwrap()).unwrap();
    fs::write(&stale_history, "half").unwrap();
    let out = node.sync(&[&node.source("a.pem", pki::bundle_of(1, "ca"))], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        busy.exists(),
        "a locked temporary file belongs to a live writer"
    );
    assert!(
        !stale_history.exists(),
        "stale temporary files in history/ are removed too"
    );
    drop(file);
    assert!(
        node.sync(&[&node.source("a.pem", pki::bundle_of(1, "ca2"))], &[])
            .status
            .success()
    );
    assert!(!busy.exists());
}

#[test]
fn exec_on_change_runs_after_a_replace_only() {
    let node = Node::new();
    let marker = node.root().join("ran");
    let script = format!(
        "sh -c 'echo \"$KUBELET_CA_BUNDLE\" >> {}'",
        marker.display()
    );
    let source = node.source("a.pem", pki::bundle_of(1, "ca"));
    assert!(
        node.sync(&[&source], &["--exec-on-change", &script])
            .status
            .success()
    );
    assert!(
        node.sync(&[&source], &["--exec-on-change", &script])
            .status
            .success()
    );
    let runs = fs::read_to_string(&marker).unwrap();
    assert_eq!(
        runs,
        format!("{}\n", node.bundle().display()),
        "ran once, with the path"
    );

    // A failing command is reported but does not fail the sync.
    fs::write(
        source.strip_prefix("file:").unwrap(),
        pki::bundle_of(1, "other"),
    )
    .unwrap();
    let out = node.sync(&[&source], &["--exec-on-change", "false"]);
    assert!(out.status.success());
    assert!(
        stderr(&out).contains("exec-on-change command failed"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn flags_can_come_from_the_environment() {
    let node = Node::new();
    let pem = pki::bundle_of(1, "env");
    let source = node.source("a.pem", &pem);
    fs::create_dir_all(node.bundle_dir()).unwrap();
    let out = std::process::Command::new(common::agent_bin())
        .arg("sync")
        .env("KUBELET_CA_AGENT_SOURCE", &source)
        .env("KUBELET_CA_AGENT_BUNDLE", node.bundle())
        .env("KUBELET_CA_AGENT_STATE_DIR", node.state_dir())
        .env("KUBELET_CA_AGENT_FILE_MODE", "0600")
        .env("KUBELET_CA_AGENT_LOG_FORMAT", "json")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(node.read_bundle(), pem.as_bytes());
    assert_eq!(
        fs::metadata(node.bundle()).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let line = stderr(&out).lines().last().unwrap().to_string();
    let json: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
    assert_eq!(json["message"], "bundle written");
}

#[test]
fn usage_errors_exit_2_and_name_the_problem() {
    let node = Node::new();
    for (args, needle) in [
        (vec!["--source", "configmap:Bad/x"], "configmap:Bad/x"),
        (vec!["--source", "nonsense"], "nonsense"),
        (vec!["--file-mode", "0666"], "0666"),
        (vec!["--retain-removed", "forever"], "forever"),
    ] {
        let out = node.sync(&[], &args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn owner_of_the_replaced_file_is_kept_when_root() {
    if !require(common::is_root(), "keeping the owner needs root") {
        return;
    }
    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(1, "one"));
    assert!(node.sync(&[&source], &[]).status.success());
    let m = fs::metadata(node.bundle()).unwrap();
    assert_eq!((m.uid(), m.gid()), (0, 0), "a new file is root:root");
    std::os::unix::fs::chown(node.bundle(), Some(4242), Some(4343)).unwrap();
    fs::write(
        source.strip_prefix("file:").unwrap(),
        pki::bundle_of(1, "two"),
    )
    .unwrap();
    assert!(node.sync(&[&source], &[]).status.success());
    let m = fs::metadata(node.bundle()).unwrap();
    assert_eq!((m.uid(), m.gid()), (4242, 4343));
}

#[test]
fn selinux_label_of_the_replaced_file_is_kept() {
    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(1, "one"));
    assert!(node.sync(&[&source], &[]).status.success());
    let label = b"system_u:object_r:kubernetes_file_t:s0\0";
    let set = xattr::set(node.bundle(), "security.selinux", label);
    if !require(
        set.is_ok(),
        &format!("cannot set security.selinux here ({set:?})"),
    ) {
        return;
    }
    fs::write(
        source.strip_prefix("file:").unwrap(),
        pki::bundle_of(1, "two"),
    )
    .unwrap();
    let out = node.sync(&[&source], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let got = xattr::get(node.bundle(), "security.selinux").unwrap();
    assert_eq!(got.as_deref(), Some(&label[..]));
}

fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

#[test]
fn dry_run_can_be_set_from_the_environment_with_the_usual_boolean_spellings() {
    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(1, "first"));
    assert!(node.sync(&[&source], &[]).status.success());
    let path = source.strip_prefix("file:").unwrap();
    let sync_with = |value: &str| {
        node.command("sync")
            .arg("--source")
            .arg(&source)
            .env("KUBELET_CA_AGENT_DRY_RUN", value)
            .output()
            .unwrap()
    };

    fs::write(path, pki::bundle_of(1, "second")).unwrap();
    let before = fingerprint_file(&node.bundle());
    for value in ["1", "yes", "true", "TRUE", "on"] {
        let out = sync_with(value);
        assert_eq!(
            out.status.code(),
            Some(0),
            "KUBELET_CA_AGENT_DRY_RUN={value}: {}",
            stderr(&out)
        );
        let plan = stdout(&out);
        assert!(
            plan.contains("would add") && plan.contains("would change"),
            "KUBELET_CA_AGENT_DRY_RUN={value}: {plan}"
        );
        assert_eq!(
            fingerprint_file(&node.bundle()),
            before,
            "KUBELET_CA_AGENT_DRY_RUN={value} wrote the file"
        );
    }
    // The other way round: these spellings mean a real sync.
    for value in ["0", "no", "false"] {
        let next = pki::bundle_of(1, &format!("when-{value}"));
        fs::write(path, &next).unwrap();
        let out = sync_with(value);
        assert!(
            out.status.success(),
            "KUBELET_CA_AGENT_DRY_RUN={value}: {}",
            stderr(&out)
        );
        assert!(
            node.holds(&next),
            "KUBELET_CA_AGENT_DRY_RUN={value} did not write: {}",
            stdout(&out)
        );
    }
    // Anything else is a usage error, not silently a real write.
    let out = sync_with("maybe");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[test]
fn a_bundle_in_a_missing_directory_is_refused_by_sync_and_by_its_dry_run() {
    let node = Node::new();
    let source = node.source("a.pem", pki::bundle_of(1, "ca"));
    let missing = node.bundle_dir();
    for extra in [&["--dry-run"][..], &[]] {
        let out = node
            .command("sync")
            .arg("--source")
            .arg(&source)
            .args(extra)
            .output()
            .unwrap();
        let err = stderr(&out);
        // SPEC 3: a dry run exits 0; it says that the sync itself would be refused.
        let expected = if extra.is_empty() { 2 } else { 0 };
        assert_eq!(out.status.code(), Some(expected), "{extra:?}: {err}");
        assert!(
            err.contains(&format!("{} does not exist", missing.display())),
            "{extra:?} names the directory: {err}"
        );
        assert!(
            !stdout(&out).contains("would be created"),
            "{extra:?} claims it would work: {}",
            stdout(&out)
        );
        assert!(!missing.exists());
    }
}

#[test]
fn dry_run_lines_are_aligned_and_an_expired_certificate_is_marked() {
    let node = Node::new();
    let short = Signer::new("a", Algorithm::P256);
    let long = Signer::new("kube-apiserver-to-kubelet-signer", Algorithm::P256);
    let dead = Signer::valid_between(
        "old-csr-signer",
        Algorithm::P256,
        Duration::days(-30),
        Duration::days(-1),
    );
    let first = node.source("first.pem", dead.pem());
    let live = node.source("live.pem", short.pem());
    assert!(node.sync(&[&first, &live], &[]).status.success());
    let next = node.source("next.pem", long.pem());
    let out = node.sync(&[&live, &next], &["--dry-run"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = stdout(&out);
    let lines: Vec<&str> = plan.lines().filter(|l| l.contains("sha256:")).collect();
    assert_eq!(lines.len(), 2, "{plan}");
    let columns: Vec<(usize, usize)> = lines
        .iter()
        .map(|l| (l.find("sha256:").unwrap(), l.find("notAfter").unwrap()))
        .collect();
    assert!(
        columns.iter().all(|c| *c == columns[0]),
        "columns at {columns:?}:\n{plan}"
    );
    let removed = lines.iter().find(|l| l.contains("old-csr-signer")).unwrap();
    assert!(removed.ends_with("EXPIRED"), "{plan}");
    let added = lines.iter().find(|l| l.contains("kube-apiserver")).unwrap();
    assert!(
        added.ends_with('Z'),
        "a live certificate is not marked: {plan}"
    );
}

// Issue 34, item 10: the dry run says which change a rewrite of the same certificates is.

#[test]
fn a_dry_run_tells_a_reorder_from_a_re_encoding_of_the_same_certificates() {
    let node = Node::new();
    let (a, b) = (
        Signer::new("alpha", Algorithm::P256),
        Signer::new("beta", Algorithm::P256),
    );
    let source = node.source("a.pem", format!("{}{}", a.pem(), b.pem()));
    assert!(node.sync(&[&source], &[]).status.success());
    let path = source.strip_prefix("file:").unwrap();
    let dry_run = || {
        let out = node.sync(&[&source], &["--dry-run"]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };

    // The sources now order them the other way: a reorder, each text unchanged.
    fs::write(path, format!("{}{}", b.pem(), a.pem())).unwrap();
    let plan = dry_run();
    assert!(plan.contains("same 2 certificates, reordered"), "{plan}");
    assert!(!plan.contains("re-encoded"), "{plan}");

    // The file in the sources' order, but with CRLF line endings: a re-encoding only.
    fs::write(path, format!("{}{}", a.pem(), b.pem())).unwrap();
    fs::write(
        node.bundle(),
        format!("{}{}", a.pem(), b.pem()).replace('\n', "\r\n"),
    )
    .unwrap();
    let plan = dry_run();
    assert!(
        plan.contains("same 2 certificates, in the same order, re-encoded"),
        "{plan}"
    );
    assert!(!plan.contains("reordered"), "{plan}");

    // Both at once.
    fs::write(path, format!("{}{}", b.pem(), a.pem())).unwrap();
    let plan = dry_run();
    assert!(
        plan.contains("reordered") && plan.contains("re-encoded"),
        "{plan}"
    );
    assert_eq!(
        node.read_bundle(),
        format!("{}{}", a.pem(), b.pem())
            .replace('\n', "\r\n")
            .into_bytes(),
        "a dry run writes nothing"
    );
}
