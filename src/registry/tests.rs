//! The registry set end to end: sources to entries, merge, build, plan; and the plan's
//! rules one by one, as an operator would see them under DIR.

use std::collections::{BTreeMap, BTreeSet};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::json;

use super::*;
use crate::bundle::Certificate;
use crate::bundle::test_certs::{ca, leaf, now};

fn name(raw: &str) -> RegistryName {
    RegistryName::parse(raw).unwrap()
}

fn dirs(names: &[RegistryName]) -> Vec<&str> {
    names.iter().map(RegistryName::dir).collect()
}

fn created(directories: &[&str], files: &[&str]) -> Created {
    Created {
        directories: directories.iter().map(|s| s.to_string()).collect(),
        files: files.iter().map(|s| s.to_string()).collect(),
    }
}

fn desired(files: &[(&str, &[u8])]) -> Desired {
    Desired {
        files: files.iter().map(|(n, b)| (name(n), b.to_vec())).collect(),
        ..Desired::default()
    }
}

fn listing(registries: Vec<(&str, OnDisk)>) -> Listing {
    Listing {
        root: Root::Directory,
        registries: registries
            .into_iter()
            .map(|(n, d)| (n.to_string(), d))
            .collect(),
    }
}

fn directory(ca: CaFile, others: bool) -> OnDisk {
    OnDisk::Directory { ca, others }
}

fn with_ca(bytes: &[u8]) -> OnDisk {
    directory(CaFile::Regular(bytes.to_vec()), false)
}

fn writes(plan: &Plan) -> Vec<(&str, bool)> {
    plan.writes
        .iter()
        .map(|w| (w.name.dir(), w.creates))
        .collect()
}

fn messages<T: ToString>(items: &[T]) -> Vec<String> {
    items.iter().map(ToString::to_string).collect()
}

fn signer(cn: &str) -> Certificate {
    let now = now();
    ca(Some(cn), None, now - 60, now + 86_400)
}

#[test]
fn a_new_registry_gets_its_directory_and_file_and_both_are_recorded() {
    let want = desired(&[("quay.io", b"Q"), ("registry.local..5000", b"R")]);
    let plan = plan(&Created::default(), &want, &listing(vec![]));
    assert!(!plan.create_root);
    assert_eq!(
        dirs(&plan.create_directories),
        ["quay.io", "registry.local:5000"]
    );
    assert_eq!(
        writes(&plan),
        [("quay.io", true), ("registry.local:5000", true)]
    );
    assert_eq!(plan.writes[1].bytes, b"R");
    assert_eq!(
        plan.record,
        created(
            &["quay.io", "registry.local:5000"],
            &["quay.io", "registry.local:5000"]
        )
    );
    assert!(plan.problems.is_empty() && plan.left_alone.is_empty());
}

#[test]
fn a_missing_root_is_created_only_when_something_goes_in_it() {
    let missing = Listing {
        root: Root::Missing,
        registries: BTreeMap::new(),
    };
    let plan = plan(
        &Created::default(),
        &desired(&[("quay.io", b"Q")]),
        &missing,
    );
    assert!(plan.create_root);
    assert_eq!(writes(&plan), [("quay.io", true)]);
    let nothing = super::plan(&Created::default(), &Desired::default(), &missing);
    assert!(nothing.is_empty());
}

#[test]
fn an_unchanged_file_is_not_touched_and_a_changed_one_is_replaced() {
    let record = created(
        &["quay.io", "registry.local:5000"],
        &["quay.io", "registry.local:5000"],
    );
    let want = desired(&[("quay.io", b"same"), ("registry.local..5000", b"new")]);
    let disk = listing(vec![
        ("quay.io", with_ca(b"same")),
        ("registry.local:5000", with_ca(b"old")),
    ]);
    let plan = plan(&record, &want, &disk);
    assert_eq!(dirs(&plan.unchanged), ["quay.io"]);
    assert_eq!(writes(&plan), [("registry.local:5000", false)]);
    assert!(plan.create_directories.is_empty());
    assert_eq!(plan.record, record);
}

#[test]
fn a_registry_that_leaves_takes_only_what_the_agent_made() {
    let record = created(&["gone.example"], &["gone.example", "admin-dir.example"]);
    let disk = listing(vec![
        ("gone.example", with_ca(b"x")),
        // The admin made this directory; the agent wrote its ca.crt.
        ("admin-dir.example", with_ca(b"y")),
        // Wholly the admin's: never looked at, never named in the plan.
        ("admins-own.example", with_ca(b"z")),
    ]);
    let plan = plan(&record, &Desired::default(), &disk);
    assert_eq!(
        dirs(&plan.remove_files),
        ["admin-dir.example", "gone.example"]
    );
    assert_eq!(dirs(&plan.remove_directories), ["gone.example"]);
    assert!(plan.left_alone.is_empty() && plan.problems.is_empty());
    assert!(plan.record.is_empty());
    assert!(!to_look_at(&record, &Desired::default()).contains("admins-own.example"));
}

#[test]
fn an_admins_extra_file_keeps_the_agents_directory_until_it_is_gone() {
    let record = created(&["quay.io"], &["quay.io"]);
    let disk = listing(vec![(
        "quay.io",
        directory(CaFile::Regular(b"Q".to_vec()), true),
    )]);
    let first = plan(&record, &Desired::default(), &disk);
    assert_eq!(dirs(&first.remove_files), ["quay.io"]);
    assert!(first.remove_directories.is_empty());
    assert_eq!(
        messages(&first.left_alone),
        [
            "registry quay.io: the directory the agent made holds files it did not write, so it stays (it goes once they have gone)"
        ]
    );
    // The directory stays recorded, so that it goes once the admin's file has.
    assert_eq!(first.record, created(&["quay.io"], &[]));
    let later = listing(vec![("quay.io", directory(CaFile::Missing, false))]);
    let second = plan(&first.record, &Desired::default(), &later);
    assert!(second.remove_files.is_empty());
    assert_eq!(dirs(&second.remove_directories), ["quay.io"]);
    assert!(second.record.is_empty());
}

#[test]
fn the_agent_writes_into_an_admins_directory_but_never_removes_it() {
    let disk = listing(vec![("quay.io", directory(CaFile::Missing, true))]);
    let want = desired(&[("quay.io", b"Q")]);
    let first = plan(&Created::default(), &want, &disk);
    assert!(first.create_directories.is_empty());
    assert_eq!(writes(&first), [("quay.io", true)]);
    assert_eq!(first.record, created(&[], &["quay.io"]));
    let disk = listing(vec![(
        "quay.io",
        directory(CaFile::Regular(b"Q".to_vec()), true),
    )]);
    let second = plan(&first.record, &Desired::default(), &disk);
    assert_eq!(dirs(&second.remove_files), ["quay.io"]);
    assert!(second.remove_directories.is_empty() && second.left_alone.is_empty());
}

#[test]
fn an_admins_own_ca_file_is_never_overwritten() {
    let ours = signer("registry root");
    let theirs = signer("the admin's root");
    let want = desired(&[("quay.io", ours.pem())]);
    let disk = listing(vec![("quay.io", with_ca(theirs.pem()))]);
    let plan = plan(&Created::default(), &want, &disk);
    assert!(plan.writes.is_empty());
    assert_eq!(
        messages(&plan.problems),
        [
            "registry quay.io: ca.crt was not written by the agent and holds other certificates than the sources give: it is left as it is; remove it to let the agent manage this registry"
        ]
    );
    assert_eq!(plan.problems[0].kind.reason(), "not_created_by_agent");
    assert!(plan.record.is_empty());
}

#[test]
fn a_file_holding_the_sources_certificates_is_adopted_as_upstream_left_it() {
    let root = signer("registry root");
    let want = desired(&[("quay.io", root.pem())]);
    // The upstream writer's file: the same certificate, as it came (CRLF, a comment).
    let upstream = format!(
        "# quay\r\n{}",
        String::from_utf8(root.pem().to_vec())
            .unwrap()
            .replace('\n', "\r\n")
    );
    let disk = listing(vec![("quay.io", with_ca(upstream.as_bytes()))]);
    let plan = plan(&Created::default(), &want, &disk);
    assert_eq!(dirs(&plan.adopted), ["quay.io"]);
    assert_eq!(writes(&plan), [("quay.io", false)]);
    assert_eq!(plan.record, created(&[], &["quay.io"]));
    // Byte for byte already: adopted, and not written.
    let exact = listing(vec![("quay.io", with_ca(root.pem()))]);
    let again = super::plan(&Created::default(), &want, &exact);
    assert_eq!(dirs(&again.adopted), ["quay.io"]);
    assert!(again.writes.is_empty());
    assert_eq!(dirs(&again.unchanged), ["quay.io"]);
    assert_eq!(again.record, created(&[], &["quay.io"]));
}

#[test]
fn a_symbolic_link_is_never_followed_and_is_a_problem_for_that_registry_alone() {
    let record = created(
        &["linked.example"],
        &["linked.example", "file-link.example"],
    );
    let want = desired(&[
        ("linked.example", b"L"),
        ("file-link.example", b"F"),
        ("fine.example", b"ok"),
    ]);
    let disk = listing(vec![
        ("linked.example", OnDisk::Symlink),
        ("file-link.example", directory(CaFile::Symlink, false)),
        ("fifo.example", OnDisk::NotADirectory),
    ]);
    let plan = plan(&record, &want, &disk);
    assert_eq!(writes(&plan), [("fine.example", true)]);
    let kinds: Vec<_> = plan
        .problems
        .iter()
        .map(|p| (p.name.as_deref().unwrap(), p.kind.reason()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("file-link.example", "symlink"),
            ("linked.example", "symlink")
        ]
    );
    assert!(
        messages(&plan.problems)[1]
            .contains("its directory is a symbolic link, which the agent never follows")
    );
    // What the agent made was replaced: it is not the agent's any more.
    assert_eq!(plan.record, created(&["fine.example"], &["fine.example"]));
    // Nor is it removed when its registry leaves.
    let leave = super::plan(&record, &Desired::default(), &disk);
    assert!(leave.is_empty());
    assert_eq!(
        messages(&leave.left_alone),
        [
            "registry file-link.example: what the agent made there was replaced by something else, which is not the agent's and stays",
            "registry linked.example: what the agent made there was replaced by something else, which is not the agent's and stays",
        ]
    );
}

#[test]
fn a_held_registry_and_held_removals_leave_everything_in_place() {
    let record = created(
        &["held.example", "left.example"],
        &["held.example", "left.example"],
    );
    let disk = listing(vec![
        ("held.example", with_ca(b"H")),
        ("left.example", with_ca(b"L")),
    ]);
    let mut want = Desired::default();
    want.held.insert(name("held.example"));
    let plan = plan(&record, &want, &disk);
    assert_eq!(dirs(&plan.remove_files), ["left.example"]);
    assert_eq!(
        messages(&plan.left_alone),
        ["registry held.example: its entry was refused, so its files stay as they are"]
    );
    assert_eq!(plan.record, created(&["held.example"], &["held.example"]));
    want.hold_removals = true;
    let held = super::plan(&record, &want, &disk);
    assert!(held.is_empty());
    assert_eq!(held.record, record);
    assert!(messages(&held.left_alone)[1].contains("nothing is removed until it can"));
}

#[test]
fn a_record_entry_that_is_not_a_registry_is_never_acted_on() {
    let record = created(&["../../etc", "quay.io"], &["../../etc"]);
    let looked = to_look_at(&record, &Desired::default());
    assert_eq!(looked, BTreeSet::from(["quay.io".to_string()]));
    let disk = listing(vec![("../../etc", with_ca(b"/etc"))]);
    let plan = plan(&record, &Desired::default(), &disk);
    assert!(plan.is_empty());
    assert_eq!(
        messages(&plan.problems),
        [
            "the record of created files names \"../../etc\", which is not a registry: ignored, and dropped from the record"
        ]
    );
    assert!(plan.record.is_empty());
}

#[test]
fn a_root_that_is_not_a_directory_stops_the_set_and_keeps_the_record() {
    let record = created(&["quay.io"], &["quay.io"]);
    let disk = Listing {
        root: Root::NotADirectory,
        registries: BTreeMap::new(),
    };
    let plan = plan(&record, &desired(&[("new.example", b"N")]), &disk);
    assert!(plan.is_empty());
    assert_eq!(plan.problems[0].kind, ProblemKind::RootNotADirectory);
    assert_eq!(plan.record, record);
}

#[test]
fn what_the_agent_made_and_is_gone_is_forgotten() {
    let record = created(&["gone.example"], &["gone.example", "emptied.example"]);
    let disk = listing(vec![("emptied.example", directory(CaFile::Missing, true))]);
    let plan = plan(&record, &Desired::default(), &disk);
    assert!(plan.is_empty() && plan.left_alone.is_empty());
    assert!(plan.record.is_empty());
}

#[test]
fn the_record_round_trips_as_json_and_another_version_is_refused() {
    let mut record = CreatedRecord::new();
    record.sets.insert(
        "/etc/docker/certs.d".into(),
        created(&["[fd00::1]:5000"], &["[fd00::1]:5000", "quay.io"]),
    );
    let json = record.to_json();
    assert_eq!(CreatedRecord::from_json(&json).unwrap(), record);
    let text = String::from_utf8(json).unwrap();
    assert!(text.contains("\"/etc/docker/certs.d\""), "{text}");
    let future = br#"{"version": 2, "sets": {}}"#;
    assert_eq!(
        CreatedRecord::from_json(future).unwrap_err(),
        "registry record version 2 (this agent reads version 1)"
    );
    assert!(CreatedRecord::from_json(b"{").is_err());
}

#[test]
fn sources_to_plan_one_bad_registry_costs_that_registry_alone() {
    let now = now();
    let internal = signer("image-registry internal CA");
    let self_signed = leaf("registry.local", now - 60, now + 86_400);
    let user = signer("user registry root");
    let key = b"-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n";
    let with_key = [user.pem(), &key[..]].concat();
    let b64 = |bytes: &[u8]| STANDARD.encode(bytes);
    let cc = "controllerconfig:machine-config-controller";
    let data = from_list(
        cc,
        "imageRegistryBundleData",
        &json!([{"file": "image-registry.openshift-image-registry.svc..5000", "data": b64(internal.pem())}]),
    );
    let user_data = from_list(
        cc,
        "imageRegistryBundleUserData",
        &json!([
            {"file": "registry.local..5000", "data": b64(self_signed.pem())},
            {"file": "keyed.example", "data": b64(&with_key)},
            {"file": "../../etc", "data": b64(user.pem())},
            {"file": "", "data": b64(user.pem())},
            {"file": ".hidden", "data": b64(user.pem())},
            {"file": "a/b", "data": b64(user.pem())},
            {"file": "x".repeat(300), "data": b64(user.pem())},
        ]),
    );
    let local = from_dir(
        "dir:/etc/kubelet-ca-agent/registries",
        [("registry.local:5000.crt", user.pem().to_vec())],
    );
    let built = build(merge([data, user_data, local]), now);
    assert_eq!(
        built
            .desired
            .files
            .keys()
            .map(RegistryName::dir)
            .collect::<Vec<_>>(),
        [
            "image-registry.openshift-image-registry.svc:5000",
            "registry.local:5000"
        ]
    );
    // The self-signed server certificate is kept, with a warning that says so.
    assert_eq!(
        built.desired.files[&name("registry.local:5000")],
        self_signed.pem()
    );
    assert_eq!(
        messages(&built.warnings),
        [format!(
            "{cc} (imageRegistryBundleUserData[0]): registry \"registry.local:5000\": block 1: \"registry.local\" (sha256 {}) is not a CA (no basicConstraints CA:TRUE): kept, as a registry's own server certificate is what the runtime must trust",
            self_signed.fingerprint().short()
        )]
    );
    // The private key rejects that registry's update alone: it is held.
    assert_eq!(built.desired.held, BTreeSet::from([name("keyed.example")]));
    assert!(!built.desired.hold_removals);
    let refused = messages(&built.refused);
    assert_eq!(refused.len(), 6, "{refused:#?}");
    assert!(refused.iter().all(|m| !m.contains("AAAA")));
    assert!(
        refused.last().unwrap().starts_with(&format!(
            "{cc} (imageRegistryBundleUserData[1]): the content for \"keyed.example\": PEM block 2 (line"
        )),
        "{refused:#?}"
    );
    assert!(
        refused
            .last()
            .unwrap()
            .contains("private keys must never reach a CA bundle")
    );
    for hostile in [
        "\"../../etc\"",
        "\"\"",
        "\".hidden\"",
        "\"a/b\"",
        "(300 characters)",
    ] {
        assert!(
            refused.iter().any(|m| m.contains(hostile)),
            "{hostile}: {refused:#?}"
        );
    }
    assert_eq!(
        messages(&built.shadowed),
        [format!(
            "dir:/etc/kubelet-ca-agent/registries (registry.local:5000.crt): registry \"registry.local:5000\" is taken from {cc} (imageRegistryBundleUserData[0]) (the first source wins)"
        )]
    );
    assert_eq!(
        built.files[&name("registry.local..5000")].certificates,
        [self_signed]
    );

    // On a node where the keyed registry had a file and an admin keeps their own
    // directory, only the good registries are written; the rest stays as it is.
    let record = created(&["keyed.example"], &["keyed.example"]);
    let disk = listing(vec![
        ("keyed.example", with_ca(user.pem())),
        ("admins-own.example", with_ca(b"theirs")),
    ]);
    let looked = to_look_at(&record, &built.desired);
    assert!(
        looked
            .iter()
            .all(|n| !n.contains('/') && !n.starts_with('.'))
    );
    let plan = plan(&record, &built.desired, &disk);
    assert_eq!(
        writes(&plan),
        [
            ("image-registry.openshift-image-registry.svc:5000", true),
            ("registry.local:5000", true)
        ]
    );
    assert!(plan.remove_files.is_empty() && plan.remove_directories.is_empty());
    assert_eq!(plan.record.files.len(), 3);
}

#[test]
fn an_entry_whose_registry_cannot_be_told_holds_every_removal() {
    let entries = from_list(
        "controllerconfig:machine-config-controller",
        "imageRegistryBundleUserData",
        &json!([{"data": "AA=="}]),
    );
    let built = build(merge([entries]), now());
    assert!(built.desired.hold_removals);
    let record = created(&["quay.io"], &["quay.io"]);
    let disk = listing(vec![("quay.io", with_ca(b"Q"))]);
    let plan = plan(&record, &built.desired, &disk);
    assert!(plan.is_empty());
    assert_eq!(plan.record, record);
}
