use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::*;
use crate::config;
use crate::source::SourceSpec;

fn run(common: config::Common) -> config::Run {
    config::Run {
        common,
        server: config::Server {
            listen: "127.0.0.1:9745".parse().unwrap(),
            tls_cert_file: Some("/etc/kubelet-ca-agent/tls.crt".into()),
            tls_private_key_file: Some("/etc/kubelet-ca-agent/tls.key".into()),
            tls_min_version: config::TlsVersion::V1_2,
            client_ca_file: Some("/etc/kubernetes/kubelet-ca.crt".into()),
            authorized_users: Vec::new(),
            authorized_groups: Vec::new(),
            authentication_token_webhook: false,
            authentication_token_audiences: Vec::new(),
            authentication_token_webhook_cache_ttl: std::time::Duration::ZERO,
            authorization_webhook: false,
            authorization_webhook_cache_authorized_ttl: std::time::Duration::ZERO,
            authorization_webhook_cache_unauthorized_ttl: std::time::Duration::ZERO,
            insecure_metrics: false,
            node_name: None,
        },
        kubelet_config: None,
        report: None,
    }
}

fn kubeadm() -> config::Common {
    let mut common = config::Common::for_tests(
        Path::new("/etc/kubernetes/kubelet-ca.crt"),
        Path::new("/var/lib/kubelet-ca-agent"),
        vec![SourceSpec::ConfigMap {
            namespace: "kube-system".into(),
            name: "extension-apiserver-authentication".into(),
            keys: crate::source::Keys::One("client-ca-file".into()),
        }],
    );
    common.manage_kubeconfig = vec![config::ManageSpec {
        path: "/etc/kubernetes/kubelet.conf".into(),
        sources: common.sources.clone(),
    }];
    common.kubeconfig_hook = Some(config::KubeconfigHook::Request(
        "/run/kubelet-ca-agent/kubelet-restart".into(),
    ));
    common
}

fn facts() -> Facts {
    Facts {
        credential_files: vec![
            "/etc/kubernetes/kubelet.conf".into(),
            "/var/lib/kubelet/pki/kubelet-client-current.pem".into(),
            "/var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem".into(),
        ],
        servers: vec![
            "https://10.0.0.1:6443".into(),
            "https://api.example.com".into(),
        ],
        restart_dir: Some("/run/kubelet-ca-agent/kubelet-restart".into()),
        notify_socket: Some("/run/systemd/notify".into()),
        proc_self: Some("/proc/4242".into()),
        ..Facts::default()
    }
}

fn rule<'a>(plan: &'a Plan, path: &str) -> Option<&'a PathRule> {
    plan.paths.iter().find(|r| r.path == Path::new(path))
}

#[test]
fn a_kubeadm_node_may_replace_files_in_its_targets_directories_and_own_its_state_alone() {
    let plan = plan(&run(kubeadm()), &facts());
    let writable: Vec<(&Path, Access)> = plan
        .paths
        .iter()
        .filter(|r| r.access >= Access::Replace && r.access <= Access::Own)
        .map(|r| (r.path.as_path(), r.access))
        .collect();
    assert_eq!(
        writable,
        [
            (Path::new("/etc/kubernetes"), Access::Replace),
            (Path::new("/var/lib/kubelet-ca-agent"), Access::Own),
            (
                Path::new("/run/kubelet-ca-agent/kubelet-restart"),
                Access::Own
            ),
        ]
    );
    // The bundle's directory is also the credentials' and the client CA's: one rule, its
    // reasons all said.
    let etc = rule(&plan, "/etc/kubernetes").unwrap();
    assert!(etc.why.contains("the bundle's directory"), "{}", etc.why);
    assert!(etc.why.contains("--manage-kubeconfig"), "{}", etc.why);
    assert!(etc.why.contains("credentials"), "{}", etc.why);
    assert_eq!(etc.why.matches("credentials").count(), 1, "{}", etc.why);
}

#[test]
fn reads_reach_the_credentials_directory_but_never_the_kubelets_whole_directory() {
    let plan = plan(&run(kubeadm()), &facts());
    assert_eq!(
        rule(&plan, "/var/lib/kubelet/pki").unwrap().access,
        Access::Read
    );
    assert!(rule(&plan, "/var/lib/kubelet").is_none(), "{plan:#?}");
    // The kubelet's config is read at its path, not through its directory (which holds the
    // pods' volumes).
    assert_eq!(
        rule(&plan, "/var/lib/kubelet/config.yaml").unwrap().access,
        Access::ReadFile
    );
    assert_eq!(
        rule(&plan, "/etc/kubelet-ca-agent").unwrap().access,
        Access::Read
    );
    assert_eq!(rule(&plan, "/proc/4242").unwrap().access, Access::Read);
    assert!(rule(&plan, "/etc/kubernetes/pki").is_none());
}

#[test]
fn the_only_ports_are_the_api_servers_and_the_listen_address() {
    let plan = plan(&run(kubeadm()), &facts());
    // An API server by name needs the resolver's TCP port too.
    assert_eq!(
        plan.connect.keys().copied().collect::<Vec<_>>(),
        [53, 443, 6443]
    );
    assert_eq!(plan.bind, Some(9745));
    let mut by_address = facts();
    by_address.servers = vec!["https://[fd00::1]:6443".into()];
    let plan = super::plan(&run(kubeadm()), &by_address);
    assert_eq!(plan.connect.keys().copied().collect::<Vec<_>>(), [6443]);
}

#[test]
fn nothing_is_executable_without_a_hook() {
    let plan = plan(&run(kubeadm()), &facts());
    assert!(
        plan.paths.iter().all(|r| r.access != Access::Run),
        "{plan:#?}"
    );
    assert!(rule(&plan, "/dev/null").is_none());
    assert!(rule(&plan, "/usr/lib").is_none());
    let mut with_hook = facts();
    with_hook.programs = vec!["/opt/hooks/reload-proxy".into()];
    let plan = super::plan(&run(kubeadm()), &with_hook);
    let runnable: Vec<&PathBuf> = plan
        .paths
        .iter()
        .filter(|r| r.access == Access::Run)
        .map(|r| &r.path)
        .collect();
    assert_eq!(runnable, [&PathBuf::from("/opt/hooks/reload-proxy")]);
    // What a script runs: the system's programs, inside the same confinement.
    assert_eq!(rule(&plan, "/usr/bin").unwrap().access, Access::RunAll);
    assert_eq!(rule(&plan, "/bin").unwrap().access, Access::RunAll);
    assert_eq!(rule(&plan, "/dev/null").unwrap().access, Access::Device);
    assert_eq!(rule(&plan, "/usr/lib").unwrap().access, Access::Read);
}

#[test]
fn systemds_notification_socket_is_reachable_by_path_or_abstract_as_it_is_given() {
    let plan = plan(&run(kubeadm()), &facts());
    assert_eq!(
        rule(&plan, "/run/systemd/notify").unwrap().access,
        Access::Notify
    );
    assert!(!plan.abstract_unix);
    let mut abstract_socket = facts();
    abstract_socket.notify_socket = Some("@/org/freedesktop/systemd1/notify/1".into());
    let plan = super::plan(&run(kubeadm()), &abstract_socket);
    assert!(plan.abstract_unix);
    assert!(plan.paths.iter().all(|r| r.access != Access::Notify));
    let plan = super::plan(&run(kubeadm()), &Facts::default());
    assert!(!plan.abstract_unix);
    // Neither a path nor abstract: nothing systemd would listen on, so no rule.
    let mut relative = facts();
    relative.notify_socket = Some("run/notify".into());
    let plan = super::plan(&run(kubeadm()), &relative);
    assert!(
        plan.paths.iter().all(|r| r.access != Access::Notify),
        "{plan:#?}"
    );
    assert!(!plan.abstract_unix);
}

#[test]
fn local_sources_registry_sets_and_manage_files_each_get_their_rule() {
    let mut common = kubeadm();
    common
        .sources
        .push(SourceSpec::File("/etc/signers/extra.crt".into()));
    common
        .sources
        .push(SourceSpec::Dir("/etc/signers.d".into()));
    common.manage = vec![config::ManageSpec {
        path: "/etc/pki/cloud/ca-bundle.pem".into(),
        sources: vec![SourceSpec::File("/etc/cloud/ca.pem".into())],
    }];
    common.manage_registries = vec![config::RegistriesSpec {
        dir: "/etc/docker/certs.d".into(),
        sources: vec![SourceSpec::Dir("/etc/registries".into())],
    }];
    let plan = plan(&run(common), &Facts::default());
    let access = |path: &str| rule(&plan, path).map(|r| r.access);
    assert_eq!(access("/etc/signers"), Some(Access::Read));
    assert_eq!(access("/etc/signers.d"), Some(Access::Read));
    assert_eq!(access("/etc/cloud"), Some(Access::Read));
    assert_eq!(access("/etc/registries"), Some(Access::Read));
    assert_eq!(access("/etc/pki/cloud"), Some(Access::Replace));
    assert_eq!(access("/etc/docker/certs.d"), Some(Access::Own));
}

#[test]
fn a_wider_rule_wins_and_a_bare_file_is_in_the_working_directory() {
    let mut plan = Plan::default();
    plan.add("/a".into(), Access::Own, "one");
    plan.add("/a".into(), Access::Read, "two");
    plan.add("/a".into(), Access::Read, "two");
    assert_eq!(plan.paths.len(), 1);
    assert_eq!(plan.paths[0].access, Access::Own);
    assert_eq!(plan.paths[0].why, "one; two");
    assert_eq!(parent(Path::new("bundle.crt")), Path::new("."));
    assert_eq!(parent(Path::new("/etc/x.crt")), Path::new("/etc"));
}

#[test]
fn a_servers_port_is_its_own_or_its_schemes() {
    assert_eq!(server_port("https://10.0.0.1:6443"), Some((6443, false)));
    assert_eq!(server_port("https://api.example.com"), Some((443, true)));
    assert_eq!(server_port("http://proxy.example.com"), Some((80, true)));
    assert_eq!(server_port("https://[::1]:8443/"), Some((8443, false)));
    assert_eq!(server_port("not a url"), None);
}

#[test]
fn what_holds_is_said_by_the_kernels_abi() {
    let enforced = |abi: Option<i32>, seccomp: bool| Enforced {
        abi,
        seccomp,
        missing: Vec::new(),
        held: Default::default(),
        problems: Vec::new(),
    };
    assert_eq!(enforced(Some(6), true).warning(), None);
    assert_eq!(
        enforced(Some(7), true).summary(),
        "Landlock ABI 7 (files, TCP ports, signals and abstract Unix sockets); seccomp (no Unix stream sockets, no io_uring)"
    );
    assert!(
        enforced(Some(9), true)
            .summary()
            .contains("Unix sockets by path")
    );
    assert!(
        enforced(Some(3), true)
            .warning()
            .unwrap()
            .contains("not TCP ports")
    );
    assert!(enforced(Some(4), true).summary().contains("TCP ports"));
    assert!(!enforced(Some(3), true).summary().contains("TCP ports"));
    assert!(
        enforced(Some(5), true)
            .warning()
            .unwrap()
            .contains("signals")
    );
    // ABI 4 confines TCP ports: its warning is about the scopes alone.
    let four = enforced(Some(4), true).warning().unwrap();
    assert!(
        four.contains("files and TCP ports but not signals"),
        "{four}"
    );
    let none = enforced(None, true);
    assert!(none.warning().unwrap().contains("no Landlock"));
    assert_eq!(
        none.summary(),
        "no Landlock; seccomp (no Unix stream sockets, no io_uring)"
    );
    let check = none.check();
    assert!(!check.counted && check.problem.is_none() && check.warning.is_some());
    assert!(
        enforced(Some(7), false)
            .warning()
            .unwrap()
            .contains("no seccomp")
    );
    let mut failed = enforced(Some(7), true);
    failed.problems.push("boom".into());
    assert_eq!(failed.warning().unwrap(), "boom");
}

#[test]
fn a_link_inside_a_directory_already_read_adds_no_rule_of_its_own() {
    // A service account's token is a link into a dated directory beside it, which the
    // kubelet replaces at each rotation: the plan must not name that directory.
    let in_cluster = Facts {
        credential_files: vec![
            "/var/run/secrets/kubernetes.io/serviceaccount/..2026_11_28_00_00_00.1/token".into(),
            "/var/run/secrets/kubernetes.io/serviceaccount/token".into(),
        ],
        ..Facts::default()
    };
    let plan = plan(&run(kubeadm()), &in_cluster);
    let secrets: Vec<&Path> = plan
        .paths
        .iter()
        .map(|r| r.path.as_path())
        .filter(|p| p.starts_with("/var/run/secrets"))
        .collect();
    assert_eq!(
        secrets,
        [Path::new("/var/run/secrets/kubernetes.io/serviceaccount")]
    );
    // A file read at its path beneath a directory already read is dropped too; a program is
    // not (reading is not running).
    let mut plan = Plan::default();
    plan.add("/etc/ssl/certs".into(), Access::Read, "store");
    plan.add("/etc/ssl/certs/ca.crt".into(), Access::ReadFile, "file");
    plan.add("/etc/ssl/certs/tool".into(), Access::Run, "program");
    plan.add("/etc/ssl".into(), Access::ReadFile, "not a directory rule");
    plan.normalize();
    let left: Vec<&str> = plan.paths.iter().map(|r| r.why.as_str()).collect();
    assert_eq!(left, ["store", "program", "not a directory rule"]);
}

fn ids(entries: &[(&str, u64)]) -> BTreeMap<PathBuf, (u64, u64)> {
    entries
        .iter()
        .map(|(p, ino)| (PathBuf::from(p), (1, *ino)))
        .collect()
}

#[test]
fn what_the_confinement_cannot_give_later_is_named() {
    let then = plan(&run(kubeadm()), &facts());
    let held = ids(&[("/etc/kubernetes", 10), ("/var/lib/kubelet/pki", 20)]);
    // The same places, the same inodes: nothing.
    let same = plan(&run(kubeadm()), &facts());
    assert_eq!(then.outgrown(&held, &same, &held), None);
    // A place that is not there (deleted, not made again) needs nothing yet.
    assert_eq!(
        then.outgrown(&held, &same, &ids(&[("/etc/kubernetes", 10)])),
        None
    );
    // The bundle's directory made again: a new inode.
    let why = then
        .outgrown(
            &held,
            &same,
            &ids(&[("/etc/kubernetes", 11), ("/var/lib/kubelet/pki", 20)]),
        )
        .unwrap();
    assert!(
        why.starts_with("/etc/kubernetes (the bundle's directory")
            && why.ends_with("was replaced since the agent started"),
        "{why}"
    );
    // Credentials in a directory that was not there at start (a first boot).
    let mut first_boot = facts();
    first_boot
        .credential_files
        .push("/var/lib/kubelet/pki2/new.pem".into());
    let now = plan(&run(kubeadm()), &first_boot);
    let seen = ids(&[
        ("/etc/kubernetes", 10),
        ("/var/lib/kubelet/pki", 20),
        ("/var/lib/kubelet/pki2", 30),
    ]);
    let why = then.outgrown(&held, &now, &seen).unwrap();
    assert!(
        why.starts_with("/var/lib/kubelet/pki2 (")
            && why.ends_with("is new since the agent started"),
        "{why}"
    );
    // Beneath a place already held, with no more access: covered.
    let mut beneath = facts();
    beneath
        .credential_files
        .push("/var/lib/kubelet/pki/sub/new.pem".into());
    let now = plan(&run(kubeadm()), &beneath);
    let seen = ids(&[
        ("/etc/kubernetes", 10),
        ("/var/lib/kubelet/pki", 20),
        ("/var/lib/kubelet/pki/sub", 40),
    ]);
    assert_eq!(then.outgrown(&held, &now, &seen), None);
    // ... unless the place above was replaced meanwhile.
    let seen = ids(&[
        ("/etc/kubernetes", 10),
        ("/var/lib/kubelet/pki", 21),
        ("/var/lib/kubelet/pki/sub", 40),
    ]);
    assert!(then.outgrown(&held, &now, &seen).is_some());
    // A new API server port.
    let mut moved = facts();
    moved.servers.push("https://10.0.0.2:8443".into());
    let now = plan(&run(kubeadm()), &moved);
    assert_eq!(
        then.outgrown(&held, &now, &held).unwrap(),
        "TCP port 8443 (an API server) is new since the agent started"
    );
}

#[test]
fn a_rule_covers_what_it_gives_beneath_it_and_no_more() {
    use Access::*;
    assert!(covers(Read, ReadFile) && covers(Read, Read) && !covers(Read, Replace));
    assert!(covers(Replace, Replace) && covers(Replace, Read) && !covers(Replace, Own));
    assert!(covers(Own, Own) && covers(Own, Replace) && covers(Own, ReadFile));
    assert!(!covers(Own, Run) && !covers(Read, Run));
    assert!(covers(RunAll, Run) && covers(RunAll, ReadFile) && !covers(RunAll, Read));
    assert!(covers(ReadFile, ReadFile) && !covers(ReadFile, Read));
    assert!(covers(Notify, Notify) && !covers(Device, Notify));
}

#[test]
fn a_targets_directory_not_there_yet_may_be_made_in_the_place_above_it() {
    let mut common = kubeadm();
    common.manage = vec![config::ManageSpec {
        path: "/etc/kubernetes/static-pod-resources/configmaps/cloud-config/ca-bundle.pem".into(),
        sources: common.sources.clone(),
    }];
    common.manage_registries = vec![config::RegistriesSpec {
        dir: "/etc/docker/certs.d".into(),
        sources: common.sources.clone(),
    }];
    let mut absent = facts();
    absent.absent = [
        (
            PathBuf::from("/etc/kubernetes/static-pod-resources/configmaps/cloud-config"),
            PathBuf::from("/etc/kubernetes/static-pod-resources"),
        ),
        (
            PathBuf::from("/etc/docker/certs.d"),
            PathBuf::from("/etc/docker"),
        ),
    ]
    .into();
    let plan = plan(&run(common), &absent);
    let made = rule(&plan, "/etc/kubernetes").unwrap();
    assert_eq!(made.access, Access::Replace, "{plan:#?}");
    // Beneath /etc/kubernetes, which only replaces: the place above may have directories
    // made in it, and the directory itself is covered by that.
    let above = rule(&plan, "/etc/kubernetes/static-pod-resources").unwrap();
    assert_eq!(above.access, Access::Make);
    assert!(above.why.contains("not there yet"), "{}", above.why);
    assert!(
        rule(
            &plan,
            "/etc/kubernetes/static-pod-resources/configmaps/cloud-config"
        )
        .is_none()
    );
    // A registry set's directory not there yet: its parent is owned (it makes and removes
    // the registries' directories beneath).
    assert_eq!(rule(&plan, "/etc/docker").unwrap().access, Access::Own);
    assert!(rule(&plan, "/etc/docker/certs.d").is_none());
}

#[test]
fn each_access_gives_what_its_place_needs_and_never_a_link_a_device_or_a_program_elsewhere() {
    use super::enforce::{file_rights, rights};
    use landlock::AccessFs as Fs;
    let never =
        Fs::MakeSym | Fs::MakeChar | Fs::MakeBlock | Fs::MakeFifo | Fs::MakeSock | Fs::Refer;
    let read = Fs::ReadFile | Fs::ReadDir;
    let replace = read | Fs::WriteFile | Fs::Truncate | Fs::MakeReg | Fs::RemoveFile;
    assert_eq!(rights(Access::ReadFile), Fs::ReadFile);
    assert_eq!(rights(Access::Read), read);
    // A target's directory: files replaced by rename, nothing else made or removed.
    assert_eq!(rights(Access::Replace), replace);
    assert_eq!(rights(Access::Make), replace | Fs::MakeDir);
    assert_eq!(rights(Access::Own), replace | Fs::MakeDir | Fs::RemoveDir);
    assert_eq!(rights(Access::Run), Fs::Execute | Fs::ReadFile);
    assert_eq!(
        rights(Access::RunAll),
        Fs::Execute | Fs::ReadFile | Fs::ReadDir
    );
    assert_eq!(
        rights(Access::Device),
        Fs::ReadFile | Fs::WriteFile | Fs::IoctlDev
    );
    assert_eq!(rights(Access::Notify), Fs::ResolveUnix);
    for access in [
        Access::ReadFile,
        Access::Read,
        Access::Replace,
        Access::Make,
        Access::Own,
        Access::Run,
        Access::RunAll,
        Access::Device,
        Access::Notify,
    ] {
        assert!((rights(access) & never).is_empty(), "{access:?}");
        // A rule on a file carries only what a file can be given.
        let on_file = file_rights(rights(access));
        assert!(
            (on_file & (Fs::ReadDir | Fs::MakeReg | Fs::MakeDir | Fs::RemoveFile | Fs::RemoveDir))
                .is_empty(),
            "{access:?}"
        );
        assert_eq!(
            on_file & Fs::ReadFile,
            rights(access) & Fs::ReadFile,
            "{access:?}"
        );
    }
    assert_eq!(file_rights(rights(Access::Run)), Fs::Execute | Fs::ReadFile);
    assert_eq!(
        file_rights(rights(Access::Device)),
        Fs::ReadFile | Fs::WriteFile | Fs::IoctlDev
    );
    assert_eq!(
        file_rights(rights(Access::Replace)),
        Fs::ReadFile | Fs::WriteFile | Fs::Truncate
    );
    assert_eq!(file_rights(rights(Access::Notify)), Fs::ResolveUnix);
}

/// What start-up reads for the plan, from files a test lays out: the managed kubeconfigs'
/// servers and proxies, a `file:` source that is a link, whether anything talks to the
/// cluster, and the kubelet's restart directory.
#[test]
fn what_start_up_reads_for_the_plan_comes_from_the_configuration_and_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubelet.conf");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: a\n  cluster:\n    server: https://10.0.0.9:6443\n    proxy-url: http://proxy.example:3128\n- name: b\n  cluster:\n    server: https://api.example:8443\ncontexts: []\nusers: []\n",
    )
    .unwrap();
    assert_eq!(
        facts::kubeconfig_servers(&kubeconfig),
        [
            "https://10.0.0.9:6443",
            "http://proxy.example:3128",
            "https://api.example:8443"
        ]
    );
    assert!(facts::kubeconfig_servers(&dir.path().join("missing")).is_empty());
    let real = dir.path().join("signers.pem");
    std::fs::write(&real, "x").unwrap();
    let link = dir.path().join("link.pem");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let mut common = kubeadm();
    common.manage_kubeconfig[0].path = kubeconfig.clone();
    common.sources = vec![
        SourceSpec::File(link.clone()),
        SourceSpec::File(real.clone()),
    ];
    let gathered = Facts::gather(&run(common.clone()), &[]);
    assert!(
        !gathered.cluster,
        "no credentials: nothing talks to the cluster"
    );
    assert!(
        gathered
            .servers
            .contains(&"https://api.example:8443".to_string())
    );
    assert_eq!(
        gathered.links.get(&link),
        Some(&real.canonicalize().unwrap())
    );
    assert!(
        !gathered.links.contains_key(&real),
        "a file that is no link"
    );
    assert_eq!(
        gathered.restart_dir.as_deref(),
        Some(Path::new("/run/kubelet-ca-agent/kubelet-restart"))
    );
    common.kubeconfig_hook = None;
    let origin = crate::credentials::Origin::Kubeconfig {
        paths: vec![kubeconfig.clone()],
        chosen_by: "a test",
        pick: Default::default(),
    };
    let gathered = Facts::gather(&run(common), &[&origin]);
    assert!(gathered.cluster, "credentials: it talks to the cluster");
    assert_eq!(gathered.restart_dir, None);
    assert!(gathered.credential_files.contains(&kubeconfig));
    // The system's resolver files: each that exists, none that does not.
    for (path, access, why) in &gathered.system_files {
        if *why == "name resolution" {
            assert!(path.exists(), "{path:?}");
            assert!(matches!(access, Access::ReadFile | Access::Read));
        }
    }
    if Path::new("/etc/hosts").exists() && !Path::new("/etc/hosts").is_symlink() {
        assert!(
            gathered
                .system_files
                .iter()
                .any(|(p, a, _)| p == Path::new("/etc/hosts") && *a == Access::ReadFile)
        );
    }
}

#[test]
fn a_resolver_file_linked_into_run_is_read_in_its_directory_and_any_other_as_itself() {
    let resolv = Path::new("/etc/resolv.conf");
    assert_eq!(
        facts::resolver_rule(resolv, Some("/run/systemd/resolve/stub-resolv.conf".into())),
        (PathBuf::from("/run/systemd/resolve"), Access::Read)
    );
    for dir in ["/run/resolvconf", "/run/NetworkManager"] {
        let file = Path::new(dir).join("resolv.conf");
        assert_eq!(
            facts::resolver_rule(resolv, Some(file)),
            (PathBuf::from(dir), Access::Read)
        );
    }
    // Any other directory of /run, and /run itself, is not read whole: the file only.
    for other in ["/run/resolv.conf", "/run/secrets/resolv.conf"] {
        assert_eq!(
            facts::resolver_rule(resolv, Some(other.into())),
            (resolv.to_path_buf(), Access::ReadFile),
            "{other}"
        );
    }
    assert_eq!(
        facts::resolver_rule(resolv, Some(resolv.to_path_buf())),
        (resolv.to_path_buf(), Access::ReadFile)
    );
    assert_eq!(
        facts::resolver_rule(resolv, Some("/etc/alternatives/resolv.conf".into())),
        (resolv.to_path_buf(), Access::ReadFile),
        "a link elsewhere than /run: the file as it is read"
    );
    assert_eq!(
        facts::resolver_rule(resolv, None),
        (resolv.to_path_buf(), Access::ReadFile)
    );
}

#[test]
fn the_trust_store_the_environment_names_is_read_when_it_names_one() {
    assert_eq!(
        facts::trust_named(Some("/opt/ca.pem".into()), Some("/opt/certs".into())),
        [
            (PathBuf::from("/opt/ca.pem"), Access::ReadFile),
            (PathBuf::from("/opt/certs"), Access::Read)
        ]
    );
    assert!(facts::trust_named(Some("".into()), None).is_empty());
    assert!(facts::trust_named(None, Some("".into())).is_empty());
}

#[test]
fn a_script_names_its_interpreter_and_a_directory_is_told_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("hook");
    std::fs::write(&script, "#!/bin/sh -e\necho hi\n").unwrap();
    assert_eq!(facts::interpreter(&script), Some(PathBuf::from("/bin/sh")));
    let binary = dir.path().join("binary");
    std::fs::write(&binary, [0x7f, b'E', b'L', b'F']).unwrap();
    assert_eq!(facts::interpreter(&binary), None);
    assert!(enforce::is_dir(dir.path()));
    assert!(!enforce::is_dir(&script));
    assert!(!enforce::is_dir(&dir.path().join("missing")));
}
