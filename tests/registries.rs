//! The registry CA files (issue 19, SPEC 4b: `--manage-registries DIR=SPEC,...`), through
//! the real binary against the test API server, with a ControllerConfig shaped like a real
//! cluster's: every CA field base64-encoded, both registry lists non-empty. One agent keeps
//! the kubelet CA, the cloud CA and the registry CAs; the registry set is a directory of
//! directories, of which the agent removes only what it made.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};

use common::Node;
use common::apiserver::ApiServer;
use common::daemon::{Agent, check_line, wait_until};
use common::pki::{Algorithm, Signer, leaf};

const SECOND: Duration = Duration::from_secs(1);
const CC: &str = "machine-config-controller";
const KUBE: &str = "controllerconfig:machine-config-controller";
const CLOUD: &str = "controllerconfig:machine-config-controller/cloudProviderCAData";
const INTERNAL: &str = "controllerconfig:machine-config-controller/imageRegistryBundleData";
const USER: &str = "controllerconfig:machine-config-controller/imageRegistryBundleUserData";

fn b64(pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(pem)
}

fn entry(file: &str, pem: &str) -> Value {
    json!({"file": file, "data": b64(pem)})
}

/// A ControllerConfig's spec as a real cluster has it.
fn spec(
    kube: &str,
    cloud: &str,
    internal: Vec<Value>,
    user: Vec<Value>,
) -> Vec<(&'static str, Value)> {
    vec![
        ("kubeAPIServerServingCAData", json!(b64(kube))),
        ("cloudProviderCAData", json!(b64(cloud))),
        ("imageRegistryBundleData", Value::Array(internal)),
        ("imageRegistryBundleUserData", Value::Array(user)),
        ("platformSpec", json!({"type": "AWS"})),
    ]
}

fn verbose(agent: &Agent) -> String {
    agent.get("/readyz?verbose").unwrap_or_default().1
}

/// A node whose agent keeps all three kinds of file from the ControllerConfig.
struct Cluster {
    api: ApiServer,
    node: Node,
    cloud: PathBuf,
    certs: PathBuf,
}

impl Cluster {
    fn new() -> Cluster {
        let node = Node::new();
        let cloud = node
            .root()
            .join("etc/kubernetes/cloud-config/ca-bundle.pem");
        fs::create_dir_all(cloud.parent().unwrap()).unwrap();
        let certs = node.root().join("etc/docker/certs.d");
        fs::create_dir_all(node.root().join("etc/docker")).unwrap();
        Cluster {
            api: ApiServer::start(),
            node,
            cloud,
            certs,
        }
    }

    fn start(&self) -> Agent {
        let manage = format!("{}={CLOUD}", self.cloud.display());
        let registries = format!("{}={INTERNAL},{USER}", self.certs.display());
        let kubeconfig = self.api.kubeconfig().to_str().unwrap().to_string();
        Agent::start(
            &self.node,
            &[KUBE],
            &[
                "--manage",
                &manage,
                "--manage-registries",
                &registries,
                "--kubeconfig",
                &kubeconfig,
            ],
        )
    }

    fn ca(&self, registry: &str) -> PathBuf {
        self.certs.join(registry).join("ca.crt")
    }

    fn holds(&self, registry: &str, pem: &str) -> bool {
        fs::read(self.ca(registry)).is_ok_and(|b| b == pem.as_bytes())
    }
}

fn mode(path: &Path) -> u32 {
    fs::symlink_metadata(path).unwrap().permissions().mode() & 0o7777
}

/// Every file under `root`, with its bytes (directories as empty), for "nothing else was
/// touched".
fn tree(root: &Path, skip: &[&Path]) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if skip.iter().any(|s| path.starts_with(s)) {
                continue;
            }
            let kind = entry.file_type().unwrap();
            if kind.is_dir() {
                files.insert(path.clone(), Vec::new());
                stack.push(path);
            } else if kind.is_file() {
                files.insert(path.clone(), fs::read(&path).unwrap());
            }
        }
    }
    files
}

#[test]
fn every_ca_file_is_written_and_rotated_and_a_registry_is_added_changed_and_removed() {
    let cluster = Cluster::new();
    let (kube, cloud, internal, user, server) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
        Signer::new("cloud-provider-ca", Algorithm::P256),
        Signer::new("image-registry-ca", Algorithm::P256),
        Signer::new("registry-example-ca", Algorithm::P384),
        leaf("mirror.example.com"),
    );
    const INTERNAL_REG: &str = "image-registry.openshift-image-registry.svc..5000";
    const INTERNAL_DIR: &str = "image-registry.openshift-image-registry.svc:5000";
    cluster.api.put_controllerconfig_spec(
        CC,
        &spec(
            &kube.pem(),
            &cloud.pem(),
            vec![entry(INTERNAL_REG, &internal.pem())],
            vec![
                entry("registry.example.com..5000", &user.pem()),
                // A registry's own self-signed server certificate, not a CA.
                entry("mirror.example.com", &server),
            ],
        ),
    );
    // An admin's own registry directory and file, and a file of theirs beside nothing yet.
    let admin = cluster.certs.join("admin.example.com");
    fs::create_dir_all(&admin).unwrap();
    fs::write(admin.join("ca.crt"), "the admin's own\n").unwrap();
    fs::write(
        admin.join("client.cert"),
        "the admin's client certificate\n",
    )
    .unwrap();

    let agent = cluster.start();
    wait_until(10 * SECOND, || {
        cluster.holds("mirror.example.com", &server)
            && cluster.holds("registry.example.com:5000", &user.pem())
            && cluster.node.holds(kube.pem())
    });
    assert!(cluster.holds(INTERNAL_DIR, &internal.pem()));
    assert!(cluster.holds("registry.example.com:5000", &user.pem()));
    assert_eq!(fs::read(&cluster.cloud).unwrap(), cloud.pem().as_bytes());
    for dir in [
        INTERNAL_DIR,
        "registry.example.com:5000",
        "mirror.example.com",
    ] {
        assert_eq!(mode(&cluster.certs.join(dir)), 0o755, "{dir}");
        assert_eq!(mode(&cluster.ca(dir)), 0o644, "{dir}");
    }
    // The self-signed server certificate is kept, with a warning naming it.
    let log = agent.log();
    assert!(
        log.contains("\"mirror.example.com\"") && log.contains("is not a CA"),
        "{log}"
    );
    // Each file has its lines, and the agent is ready.
    let files: Vec<String> = [
        cluster.ca(INTERNAL_DIR),
        cluster.ca("mirror.example.com"),
        cluster.cloud.clone(),
    ]
    .iter()
    .map(|file| file.display().to_string())
    .collect();
    let in_sync = |page: &str| {
        files
            .iter()
            .all(|file| check_line(page, &format!("in-sync:{file}")).starts_with("[+]"))
    };
    wait_until(5 * SECOND, || in_sync(&verbose(&agent)));
    let page = verbose(&agent);
    assert!(in_sync(&page), "{page}");
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200), "{page}");
    let metrics = agent.get("/metrics").unwrap().1;
    let filepath = format!(
        "filepath=\"{}\"",
        cluster.ca("mirror.example.com").display()
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("x509_cert_not_after{") && l.contains(&filepath)),
        "{metrics}"
    );

    // Rotation of every kind at once, a registry added and one removed.
    let (kube2, cloud2, internal2, added) = (
        Signer::new("kube-apiserver-lb-signer-2", Algorithm::P256),
        Signer::new("cloud-provider-ca-2", Algorithm::P256),
        Signer::new("image-registry-ca-2", Algorithm::P256),
        Signer::new("quay-mirror-ca", Algorithm::P256),
    );
    // An admin's file in a directory the agent made: the directory stays when its
    // registry goes, and goes once the file has.
    let note = cluster
        .certs
        .join("registry.example.com:5000")
        .join("notes.txt");
    fs::write(&note, "admin's note\n").unwrap();
    cluster.api.put_controllerconfig_spec(
        CC,
        &spec(
            &kube2.pem(),
            &cloud2.pem(),
            vec![entry(INTERNAL_REG, &internal2.pem())],
            vec![
                entry("mirror.example.com", &server),
                entry("quay.mirror.local..8443", &added.pem()),
            ],
        ),
    );
    wait_until(10 * SECOND, || {
        cluster.holds("quay.mirror.local:8443", &added.pem())
            && cluster.holds(INTERNAL_DIR, &internal2.pem())
            && cluster.node.holds(kube2.pem())
            && fs::read(&cluster.cloud).is_ok_and(|b| b == cloud2.pem().as_bytes())
            && !cluster.ca("registry.example.com:5000").exists()
    });
    assert!(note.exists(), "the admin's file went");
    assert!(cluster.certs.join("registry.example.com:5000").is_dir());
    fs::remove_file(&note).unwrap();
    wait_until(5 * SECOND, || {
        !cluster.certs.join("registry.example.com:5000").exists()
    });
    assert!(!cluster.certs.join("registry.example.com:5000").exists());
    // The admin's directory and files never moved.
    assert_eq!(
        fs::read(admin.join("ca.crt")).unwrap(),
        b"the admin's own\n"
    );
    assert!(admin.join("client.cert").exists());

    // What a rotation replaced is in that file's history.
    let histories: Vec<PathBuf> = fs::read_dir(cluster.node.state_dir().join("files"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("ca.crt-")
        })
        .collect();
    let kept: Vec<Vec<u8>> = histories
        .iter()
        .flat_map(|dir| common::history_entries(dir))
        .map(|(_, bytes, _)| bytes)
        .collect();
    assert!(
        kept.iter().any(|b| b == internal.pem().as_bytes()),
        "the replaced registry CA is not in history: {histories:?}"
    );

    // Drift on a registry file is repaired, content and mode.
    let internal_ca = cluster.ca(INTERNAL_DIR);
    fs::write(&internal_ca, "tampered\n").unwrap();
    wait_until(5 * SECOND, || cluster.holds(INTERNAL_DIR, &internal2.pem()));
    assert!(cluster.holds(INTERNAL_DIR, &internal2.pem()));
    fs::set_permissions(&internal_ca, fs::Permissions::from_mode(0o600)).unwrap();
    wait_until(5 * SECOND, || mode(&internal_ca) == 0o644);
    assert_eq!(mode(&internal_ca), 0o644);
    let mut expected_repairs = 2.0;
    // And its owner, as root.
    if common::is_root() {
        std::os::unix::fs::chown(&internal_ca, Some(1000), Some(1000)).unwrap();
        let owner = || {
            use std::os::unix::fs::MetadataExt;
            let m = fs::symlink_metadata(&internal_ca).unwrap();
            (m.uid(), m.gid())
        };
        wait_until(5 * SECOND, || owner() == (0, 0));
        assert_eq!(owner(), (0, 0));
        expected_repairs += 1.0;
    }
    let repairs = agent.sample(
        "kubelet_ca_repairs_total",
        &[("filepath", &internal_ca.display().to_string())],
    );
    assert_eq!(repairs, Some(expected_repairs));

    // Every file is in managed-files.json, and so in drift exclusions.
    let out = std::process::Command::new(common::agent_bin())
        .args(["drift", "exclusions", "--bundle"])
        .arg(cluster.node.bundle())
        .arg("--state-dir")
        .arg(cluster.node.state_dir())
        .output()
        .unwrap();
    let listed = common::stdout(&out);
    for file in [
        cluster.node.bundle(),
        cluster.cloud.clone(),
        cluster.ca(INTERNAL_DIR),
        cluster.ca("mirror.example.com"),
        cluster.ca("quay.mirror.local:8443"),
    ] {
        assert!(
            listed.contains(&file.display().to_string()),
            "{file:?} in {listed}"
        );
    }
    assert!(!listed.contains("registry.example.com"), "{listed}");
    assert!(!listed.contains("admin.example.com"), "{listed}");

    // One list and one watch of the object, for its four fields.
    let lists = cluster
        .api
        .requests()
        .iter()
        .filter(|r| r.path.contains("controllerconfigs") && r.is_list())
        .count();
    assert_eq!(lists, 1);
    assert_eq!(cluster.api.open_watches(), 1);
}

#[test]
fn hostile_registry_names_are_refused_alone_and_nothing_outside_the_directory_is_touched() {
    let cluster = Cluster::new();
    let (kube, good) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
        Signer::new("good-registry-ca", Algorithm::P256),
    );
    let hostile = [
        "../../etc",
        "a/b",
        ".hidden",
        "",
        &"r".repeat(300),
        "bad host..x",
    ];
    let mut user: Vec<Value> = hostile
        .iter()
        .map(|name| entry(name, &good.pem()))
        .collect();
    user.push(entry("good.example.com", &good.pem()));
    cluster.api.put_controllerconfig_spec(
        CC,
        &spec(
            &kube.pem(),
            "",
            vec![entry("internal.svc..5000", &good.pem())],
            user,
        ),
    );
    fs::write(cluster.node.root().join("etc/passwd-like"), "untouched\n").unwrap();
    let before = tree(
        cluster.node.root(),
        &[
            &cluster.certs,
            &cluster.node.state_dir(),
            &cluster.node.bundle_dir(),
        ],
    );
    let agent = cluster.start();
    wait_until(10 * SECOND, || {
        cluster.holds("good.example.com", &good.pem())
            && cluster.holds("internal.svc:5000", &good.pem())
    });
    assert!(cluster.holds("good.example.com", &good.pem()));
    // Only the good registries are under the directory; nothing outside it changed.
    let mut made: Vec<String> = fs::read_dir(&cluster.certs)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    made.sort();
    assert_eq!(made, ["good.example.com", "internal.svc:5000"]);
    let after = tree(
        cluster.node.root(),
        &[
            &cluster.certs,
            &cluster.node.state_dir(),
            &cluster.node.bundle_dir(),
        ],
    );
    let changed: Vec<_> = after
        .iter()
        .filter(|(p, b)| before.get(*p) != Some(b) && !p.to_string_lossy().contains("agent-"))
        .map(|(p, _)| p.clone())
        .collect();
    assert!(
        changed.is_empty(),
        "touched outside the directory: {changed:?}"
    );

    // Each refusal is logged and counted under its source, and shown without failing
    // readiness; the cloud CA, empty, is not created. (Readiness follows the bundle alone,
    // so it is the set's line that tells when the refusals have been taken in.)
    let registries = format!("registries:{}", cluster.certs.display());
    wait_until(5 * SECOND, || {
        check_line(&verbose(&agent), &registries).starts_with("[-]")
    });
    let page = verbose(&agent);
    let note = check_line(&page, &registries);
    assert!(note.starts_with("[-]"), "{page}");
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200), "{page}");
    let log = agent.log();
    for part in [
        "imageRegistryBundleUserData[0]",
        "imageRegistryBundleUserData[1]",
        "imageRegistryBundleUserData[2]",
        "imageRegistryBundleUserData[3]",
        "imageRegistryBundleUserData[4]",
        "imageRegistryBundleUserData[5]",
    ] {
        assert!(log.contains(part), "{part} not in the log: {log}");
    }
    let refused: f64 = agent
        .get("/metrics")
        .unwrap()
        .1
        .lines()
        .filter(|l| l.starts_with("kubelet_ca_source_errors_total{") && l.contains(USER))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(refused, hostile.len() as f64);
    // Said once while it lasts: more passes (a change under DIR) count nothing more.
    fs::write(cluster.certs.join("good.example.com/notes"), "x").unwrap();
    fs::remove_file(cluster.certs.join("good.example.com/notes")).unwrap();
    std::thread::sleep(SECOND);
    let again: f64 = agent
        .get("/metrics")
        .unwrap()
        .1
        .lines()
        .filter(|l| l.starts_with("kubelet_ca_source_errors_total{") && l.contains(USER))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(
        again, refused,
        "a refusal was counted again on a later pass"
    );
    assert!(!cluster.cloud.exists(), "an empty cloud CA was created");
    assert!(!cluster.node.root().join("etc/a").exists());
    assert!(!cluster.certs.join(".hidden").exists());
}

#[test]
fn a_key_in_one_registrys_data_rejects_that_registry_alone_while_the_kubelet_ca_rotates() {
    let cluster = Cluster::new();
    let (kube, one, two) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
        Signer::new("registry-one-ca", Algorithm::P256),
        Signer::new("registry-two-ca", Algorithm::P256),
    );
    cluster.api.put_controllerconfig_spec(
        CC,
        &spec(
            &kube.pem(),
            "",
            vec![entry("one.example.com", &one.pem())],
            vec![entry("two.example.com", &two.pem())],
        ),
    );
    let agent = cluster.start();
    wait_until(10 * SECOND, || {
        cluster.holds("one.example.com", &one.pem()) && cluster.holds("two.example.com", &two.pem())
    });
    assert!(cluster.holds("two.example.com", &two.pem()));

    // A private key pasted into registry one's data, while the kubelet CA and registry two
    // rotate: one keeps its file, the others move.
    let (kube2, two2) = (
        Signer::new("kube-apiserver-lb-signer-2", Algorithm::P256),
        Signer::new("registry-two-ca-2", Algorithm::P256),
    );
    let with_key = format!("{}{}", one.pem(), one.key_pem());
    cluster.api.put_controllerconfig_spec(
        CC,
        &spec(
            &kube2.pem(),
            "",
            vec![entry("one.example.com", &with_key)],
            vec![entry("two.example.com", &two2.pem())],
        ),
    );
    wait_until(10 * SECOND, || {
        cluster.node.holds(kube2.pem()) && cluster.holds("two.example.com", &two2.pem())
    });
    assert!(
        cluster.node.holds(kube2.pem()),
        "the kubelet CA did not rotate"
    );
    assert!(cluster.holds("two.example.com", &two2.pem()));
    assert!(
        cluster.holds("one.example.com", &one.pem()),
        "registry one was touched"
    );
    let one_sync = format!("in-sync:{}", cluster.ca("one.example.com").display());
    wait_until(5 * SECOND, || {
        check_line(&verbose(&agent), &one_sync).starts_with("[-]")
    });
    let page = verbose(&agent);
    let line = check_line(&page, &one_sync);
    assert!(line.starts_with("[-]"), "{page}");
    // Health names the reason (to an authorized caller; the insecure test endpoint is one)
    // and the key never appears anywhere.
    assert!(line.contains("private key"), "{line}");
    let metrics = agent.get("/metrics").unwrap().1;
    let log = agent.log();
    let key = one.key_pem();
    let key_body = key.lines().nth(1).unwrap();
    for (what, text) in [("health", &page), ("metrics", &metrics), ("log", &log)] {
        assert!(
            !text.contains(key_body) && !text.contains("-----BEGIN"),
            "key material leaked in the {what}: {text}"
        );
    }
    // Readiness (and READY=1) follows the kubelet's bundle alone (SPEC 6): the refused
    // registry's lines fail, marked as not counted, and the agent stays ready.
    let page = verbose(&agent);
    let refused: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("[-]") && l.contains("one.example.com"))
        .collect();
    assert!(!refused.is_empty(), "{page}");
    assert!(
        refused.iter().all(|l| l.ends_with(" (not counted)")),
        "{page}"
    );
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200), "{page}");
}

/// A local `dir:` source feeds a set as a ControllerConfig would; a registry whose entry
/// the agent did not create (an admin's file holding other certificates) is never
/// overwritten, and one holding the very same certificates is adopted.
#[test]
fn a_dir_source_feeds_the_set_and_an_admins_differing_file_is_never_overwritten() {
    let node = Node::new();
    let (kube, ours, theirs) = (
        Signer::new("kubelet-signer", Algorithm::P256),
        Signer::new("ours-ca", Algorithm::P256),
        Signer::new("theirs-ca", Algorithm::P256),
    );
    let bundle = node.source("kubelet.pem", kube.pem());
    let entries = node.root().join("registry-cas");
    fs::create_dir_all(&entries).unwrap();
    for name in [
        "adopted.example.com",
        "admin.example.com",
        "new.example.com..5000",
    ] {
        fs::write(entries.join(format!("{name}.crt")), ours.pem()).unwrap();
    }
    let certs = node.root().join("certs.d");
    for (dir, pem) in [
        ("adopted.example.com", ours.pem()),
        ("admin.example.com", theirs.pem()),
    ] {
        fs::create_dir_all(certs.join(dir)).unwrap();
        fs::write(certs.join(dir).join("ca.crt"), pem).unwrap();
    }
    let set = format!("{}=dir:{}", certs.display(), entries.display());
    let agent = Agent::start(&node, &[&bundle], &["--manage-registries", &set]);
    let ca = |dir: &str| certs.join(dir).join("ca.crt");
    wait_until(10 * SECOND, || {
        fs::read(ca("new.example.com:5000")).is_ok_and(|b| b == ours.pem().as_bytes())
    });
    assert_eq!(
        fs::read(ca("admin.example.com")).unwrap(),
        theirs.pem().as_bytes()
    );
    let admin = format!("in-sync:{}", ca("admin.example.com").display());
    wait_until(5 * SECOND, || {
        check_line(&verbose(&agent), &admin).starts_with("[-]")
    });
    let page = verbose(&agent);
    let line = check_line(&page, &admin);
    assert!(
        line.contains("not written by the agent"),
        "{page}\n{}",
        agent.log()
    );

    // The sources drop all three: only what the agent made or adopted goes.
    for name in [
        "adopted.example.com",
        "admin.example.com",
        "new.example.com..5000",
    ] {
        fs::remove_file(entries.join(format!("{name}.crt"))).unwrap();
    }
    wait_until(10 * SECOND, || {
        !certs.join("new.example.com:5000").exists() && !ca("adopted.example.com").exists()
    });
    assert!(!certs.join("new.example.com:5000").exists());
    assert!(!ca("adopted.example.com").exists());
    // The adopted file goes, but not the directory the agent did not make.
    assert!(certs.join("adopted.example.com").is_dir());
    assert_eq!(
        fs::read(ca("admin.example.com")).unwrap(),
        theirs.pem().as_bytes()
    );
}

#[test]
fn a_source_that_cannot_feed_a_registry_set_is_a_usage_error() {
    let node = Node::new();
    for (spec, expected) in [
        (KUBE.to_string(), "one PEM bundle"),
        (
            "configmap:ns/name/ca.crt".to_string(),
            "configmap:NS/NAME/*",
        ),
        ("file:/etc/ca.pem".to_string(), "dir:PATH"),
    ] {
        let set = format!("{}={spec}", node.root().join("certs.d").display());
        let out = node
            .command("run")
            .args(["--source", "file:/dev/null", "--manage-registries", &set])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{spec}");
        let err = common::stderr(&out);
        assert!(err.contains(expected), "{spec}: {err}");
    }
}

/// `sync` keeps a registry set by the daemon's rules: every good registry written, a bad
/// one left as it was with exit 1, and a registry gone removed only if the agent made it.
#[test]
fn sync_writes_the_registry_set_and_a_refused_entry_exits_1() {
    let node = Node::new();
    let (kube, one, two) = (
        Signer::new("kubelet-signer", Algorithm::P256),
        Signer::new("one-ca", Algorithm::P256),
        Signer::new("two-ca", Algorithm::P256),
    );
    let bundle = node.source("kubelet.pem", kube.pem());
    let entries = node.root().join("registry-cas");
    fs::create_dir_all(&entries).unwrap();
    fs::write(entries.join("one.example.com.crt"), one.pem()).unwrap();
    fs::write(entries.join("two.example.com..5000.crt"), two.pem()).unwrap();
    let certs = node.root().join("certs.d");
    let set = format!("{}=dir:{}", certs.display(), entries.display());
    let ca = |dir: &str| certs.join(dir).join("ca.crt");

    // A dry run writes nothing and says what would be done.
    let out = node.sync(&[&bundle], &["--manage-registries", &set, "--dry-run"]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let said = common::stdout(&out);
    assert!(
        said.contains("one.example.com/ca.crt would be created"),
        "{said}"
    );
    assert!(!certs.exists());

    let out = node.sync(&[&bundle], &["--manage-registries", &set]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert_eq!(
        fs::read(ca("one.example.com")).unwrap(),
        one.pem().as_bytes()
    );
    assert_eq!(
        fs::read(ca("two.example.com:5000")).unwrap(),
        two.pem().as_bytes()
    );

    // A key in one registry's file: that registry is left, the other goes, exit 1.
    fs::write(
        entries.join("one.example.com.crt"),
        format!("{}{}", one.pem(), one.key_pem()),
    )
    .unwrap();
    fs::remove_file(entries.join("two.example.com..5000.crt")).unwrap();
    let out = node.sync(&[&bundle], &["--manage-registries", &set]);
    assert_eq!(out.status.code(), Some(1), "{}", common::stderr(&out));
    let err = common::stderr(&out);
    assert!(
        err.contains("private key") && err.contains("one.example.com"),
        "{err}"
    );
    assert_eq!(
        fs::read(ca("one.example.com")).unwrap(),
        one.pem().as_bytes()
    );
    assert!(
        !certs.join("two.example.com:5000").exists(),
        "a registry gone was kept"
    );
}

/// A node without the cloud CA's directory (most platforms): the agent starts, and makes
/// the directory only when there is a cloud CA to keep.
#[test]
fn a_managed_files_missing_directory_is_made_only_when_there_is_something_to_keep() {
    let cluster = Cluster::new();
    fs::remove_dir_all(cluster.cloud.parent().unwrap()).unwrap();
    let (kube, cloud) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
        Signer::new("cloud-provider-ca", Algorithm::P256),
    );
    cluster
        .api
        .put_controllerconfig_spec(CC, &spec(&kube.pem(), "", vec![], vec![]));
    let agent = cluster.start();
    wait_until(10 * SECOND, || cluster.node.holds(kube.pem()));
    assert!(cluster.node.holds(kube.pem()), "{}", agent.log());
    let in_sync = format!("in-sync:{}", cluster.cloud.display());
    wait_until(5 * SECOND, || {
        check_line(&verbose(&agent), &in_sync).starts_with("[+]")
    });
    assert!(!cluster.cloud.parent().unwrap().exists());
    assert_eq!(
        agent.get("/readyz").map(|r| r.0),
        Some(200),
        "{}",
        verbose(&agent)
    );

    cluster
        .api
        .put_controllerconfig_spec(CC, &spec(&kube.pem(), &cloud.pem(), vec![], vec![]));
    wait_until(10 * SECOND, || {
        fs::read(&cluster.cloud).is_ok_and(|b| b == cloud.pem().as_bytes())
    });
    assert_eq!(fs::read(&cluster.cloud).unwrap(), cloud.pem().as_bytes());
    assert_eq!(mode(cluster.cloud.parent().unwrap()), 0o755);
}

/// `sync` reads a `--manage` file's ConfigMap key as the daemon does: the publisher's empty
/// `cloud-ca.pem` (a platform without a cloud CA) is nothing to keep, not a failure, and
/// the registries come from the same ConfigMap's `registry.*` keys.
#[test]
fn sync_takes_the_publishers_empty_cloud_ca_key_as_nothing_to_keep() {
    let api = ApiServer::start();
    let (kube, registry) = (
        Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
        Signer::new("registry-ca", Algorithm::P256),
    );
    let (kube_pem, registry_pem) = (kube.pem(), registry.pem());
    api.put_configmap(
        "openshift-machine-config-operator",
        "kubelet-ca-bundle",
        &[
            ("ca-bundle.crt", kube_pem.as_str()),
            ("cloud-ca.pem", ""),
            ("registry.quay.example.com..8443", registry_pem.as_str()),
        ],
        &[],
    );
    let node = Node::new();
    let cm = "configmap:openshift-machine-config-operator/kubelet-ca-bundle";
    let cloud = node.root().join("etc/cloud/ca-bundle.pem");
    let certs = node.root().join("certs.d");
    let manage = format!("{}={cm}/cloud-ca.pem", cloud.display());
    let registries = format!("{}={cm}/registry.*", certs.display());
    let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
    let out = node.sync(
        &[cm],
        &[
            "--manage",
            &manage,
            "--manage-registries",
            &registries,
            "--kubeconfig",
            &kubeconfig,
        ],
    );
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert!(node.holds(kube.pem()));
    assert!(!cloud.exists(), "an empty cloud CA was written");
    assert_eq!(
        fs::read(certs.join("quay.example.com:8443/ca.crt")).unwrap(),
        registry.pem().as_bytes()
    );
}

/// A registry set's sources show in health and metrics whether or not the set has a
/// registry file yet, and follow their state: a `dir:` source that goes away is down.
#[test]
fn a_registry_sets_sources_show_with_no_registry_and_go_down_when_unreadable() {
    let local = Local::new();
    let (entries, certs) = (&local.entries, &local.certs);
    let agent = local.start();
    let source = format!("dir:{}", entries.display());
    let line = format!("source:{source}");
    wait_until(10 * SECOND, || {
        check_line(&verbose(&agent), &line).starts_with("[+]")
    });
    assert!(
        check_line(&verbose(&agent), &line).starts_with("[+]"),
        "{}",
        verbose(&agent)
    );
    assert_eq!(
        agent.sample("kubelet_ca_source_up", &[("source", &source)]),
        Some(1.0)
    );
    assert!(!certs.exists(), "nothing to keep, nothing made");

    fs::remove_dir(entries).unwrap();
    wait_until(10 * SECOND, || {
        check_line(&verbose(&agent), &line).starts_with("[-]")
    });
    assert!(
        check_line(&verbose(&agent), &line).starts_with("[-]"),
        "{}",
        verbose(&agent)
    );
    assert_eq!(
        agent.sample("kubelet_ca_source_up", &[("source", &source)]),
        Some(0.0)
    );
}

/// A node whose bundle comes from a `file:` source, and a registry set under `certs.d`
/// fed by a `dir:` source.
struct Local {
    node: Node,
    bundle: String,
    /// DIR (not created).
    certs: PathBuf,
    /// The `dir:` source's directory.
    entries: PathBuf,
}

impl Local {
    fn new() -> Local {
        let node = Node::new();
        let kube = Signer::new("kubelet-signer", Algorithm::P256);
        let bundle = node.source("kubelet.pem", kube.pem());
        let certs = node.root().join("certs.d");
        let entries = node.root().join("registry-cas");
        fs::create_dir_all(&entries).unwrap();
        Local {
            node,
            bundle,
            certs,
            entries,
        }
    }

    /// The registry `name` (`host..port`) in the source.
    fn add(&self, name: &str, pem: &str) {
        fs::write(self.entries.join(format!("{name}.crt")), pem).unwrap();
    }

    fn ca(&self, dir: &str) -> PathBuf {
        self.certs.join(dir).join("ca.crt")
    }

    fn start(&self) -> Agent {
        let set = format!("{}=dir:{}", self.certs.display(), self.entries.display());
        Agent::start(&self.node, &[&self.bundle], &["--manage-registries", &set])
    }
}

/// DIR may be a link to a directory (certs.d -> /etc/containers/certs.d): the files go
/// where it points; nothing under it is looked at through a link.
#[test]
fn a_registry_directory_that_is_a_link_to_a_directory_is_managed_through_it() {
    let (local, one) = (Local::new(), Signer::new("one-ca", Algorithm::P256));
    let real = local.node.root().join("containers-certs.d");
    fs::create_dir_all(&real).unwrap();
    std::os::unix::fs::symlink(&real, &local.certs).unwrap();
    local.add("one.example.com", &one.pem());
    let agent = local.start();
    let certs = &local.certs;
    let ca = real.join("one.example.com/ca.crt");
    wait_until(10 * SECOND, || {
        fs::read(&ca).is_ok_and(|b| b == one.pem().as_bytes())
    });
    assert_eq!(
        fs::read(&ca).unwrap(),
        one.pem().as_bytes(),
        "{}",
        agent.log()
    );
    assert!(
        fs::symlink_metadata(certs)
            .unwrap()
            .file_type()
            .is_symlink()
    );
}

/// A registry that leaves the sources while its CA cannot be removed (immutable) is a
/// failure in health until it is gone: that CA is still trusted.
#[test]
fn a_registry_ca_that_cannot_be_removed_fails_its_line_until_it_is_gone() {
    if !common::require(common::is_root(), "chattr +i needs root") {
        return;
    }
    let (local, one) = (Local::new(), Signer::new("one-ca", Algorithm::P256));
    local.add("one.example.com", &one.pem());
    let agent = local.start();
    let ca = local.ca("one.example.com");
    wait_until(10 * SECOND, || ca.exists());
    if !common::require(
        common::chattr("+i", &ca),
        "chattr +i on the test filesystem",
    ) {
        return;
    }
    fs::remove_file(local.entries.join("one.example.com.crt")).unwrap();
    let line = format!("in-sync:{}", ca.display());
    wait_until(10 * SECOND, || {
        check_line(&verbose(&agent), &line).starts_with("[-]")
    });
    let page = verbose(&agent);
    let shown = check_line(&page, &line);
    common::chattr("-i", &ca);
    assert!(shown.contains("cannot be removed"), "{page}");
    assert!(shown.ends_with(" (not counted)"), "{page}");
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200), "{page}");
    // Once it can be, it goes (the retry backs off from a second).
    wait_until(10 * SECOND, || !ca.exists());
    assert!(!ca.exists());
    wait_until(5 * SECOND, || {
        !check_line(&verbose(&agent), &line).starts_with("[-]")
    });
    let page = verbose(&agent);
    assert!(!check_line(&page, &line).starts_with("[-]"), "{page}");
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200), "{page}");
}

/// A `.crt` of a `dir:` source that cannot be read (a link into a mount not up yet) fails
/// the source: its registry is not taken for gone, and its CA stays.
#[test]
fn an_unreadable_entry_file_fails_its_source_and_removes_nothing() {
    let (local, one) = (Local::new(), Signer::new("one-ca", Algorithm::P256));
    let entries = &local.entries;
    let mounted = local.node.root().join("mnt");
    fs::create_dir_all(&mounted).unwrap();
    fs::write(mounted.join("one.pem"), one.pem()).unwrap();
    std::os::unix::fs::symlink(mounted.join("one.pem"), entries.join("one.example.com.crt"))
        .unwrap();
    let mut agent = local.start();
    let ca = local.ca("one.example.com");
    wait_until(10 * SECOND, || ca.exists());
    assert!(ca.exists());
    agent.terminate();
    // The next boot: the mount is not up yet, the link dangles.
    fs::remove_dir_all(&mounted).unwrap();
    let agent = local.start();
    let source = format!("source:dir:{}", entries.display());
    wait_until(10 * SECOND, || {
        check_line(&verbose(&agent), &source).starts_with("[-]")
    });
    assert!(
        check_line(&verbose(&agent), &source).starts_with("[-]"),
        "{}",
        verbose(&agent)
    );
    std::thread::sleep(SECOND);
    assert_eq!(
        fs::read(&ca).unwrap(),
        one.pem().as_bytes(),
        "the CA was removed"
    );
}

/// What is under DIR is never looked at or written through a link, and something that is
/// not a directory where a registry's directory should be is left alone: each is that
/// registry's problem alone. A DIR that is a file manages nothing.
#[test]
fn a_link_or_a_file_where_a_registry_directory_should_be_is_left_alone() {
    let (local, ca) = (Local::new(), Signer::new("registry-ca", Algorithm::P256));
    let certs = &local.certs;
    fs::create_dir_all(certs).unwrap();
    for name in ["linked.example.com", "file.example.com", "good.example.com"] {
        local.add(name, &ca.pem());
    }
    let outside = local.node.root().join("outside");
    fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, certs.join("linked.example.com")).unwrap();
    fs::write(certs.join("file.example.com"), "not a directory\n").unwrap();
    let agent = local.start();
    let good = certs.join("good.example.com/ca.crt");
    wait_until(10 * SECOND, || good.exists());
    let line = |name: &str| format!("in-sync:{}", certs.join(name).join("ca.crt").display());
    wait_until(5 * SECOND, || {
        check_line(&verbose(&agent), &line("linked.example.com")).starts_with("[-]")
    });
    let page = verbose(&agent);
    assert!(
        check_line(&page, &line("linked.example.com")).contains("symbolic link"),
        "{page}"
    );
    assert!(
        check_line(&page, &line("file.example.com")).contains("not a directory"),
        "{page}"
    );
    assert!(
        check_line(&page, &line("good.example.com")).starts_with("[+]"),
        "{page}"
    );
    assert_eq!(
        fs::read_dir(&outside).unwrap().count(),
        0,
        "written through the link"
    );
    assert_eq!(
        fs::read(certs.join("file.example.com")).unwrap(),
        b"not a directory\n"
    );

    // DIR itself a file: nothing under it is managed, and it says so.
    let local = Local::new();
    let certs = &local.certs;
    fs::write(certs, "a file\n").unwrap();
    local.add("good.example.com", &ca.pem());
    let agent = local.start();
    let line = format!(
        "in-sync:{}",
        certs.join("good.example.com/ca.crt").display()
    );
    wait_until(10 * SECOND, || {
        check_line(&verbose(&agent), &line).starts_with("[-]")
    });
    let page = verbose(&agent);
    assert!(
        check_line(&page, &line).contains("not a directory"),
        "{page}"
    );
    assert_eq!(fs::read(certs).unwrap(), b"a file\n");
}

/// A record that could not be saved (the state directory briefly unwritable) is saved
/// after the next pass, not only when the record changes again: otherwise a restart would
/// forget a registry file the agent made, and never remove it.
#[test]
fn a_record_that_could_not_be_saved_is_saved_after_the_next_pass() {
    if !common::require(common::is_root(), "chattr +i needs root") {
        return;
    }
    let (local, one, two) = (
        Local::new(),
        Signer::new("one-ca", Algorithm::P256),
        Signer::new("two-ca", Algorithm::P256),
    );
    local.add("one.example.com", &one.pem());
    let agent = local.start();
    let state = local.node.state_dir();
    let record = state.join("registries-created.json");
    let recorded = |name: &str| fs::read_to_string(&record).is_ok_and(|r| r.contains(name));
    wait_until(10 * SECOND, || recorded("one.example.com"));
    if !common::require(
        common::chattr("+i", &state),
        "chattr +i on the test filesystem",
    ) {
        return;
    }
    local.add("two.example.com", &two.pem());
    wait_until(10 * SECOND, || local.ca("two.example.com").exists());
    std::thread::sleep(SECOND);
    let unsaved = !recorded("two.example.com");
    common::chattr("-i", &state);
    assert!(unsaved, "saved into an immutable state directory?");
    // A pass for another reason (a change under DIR): the record is saved now.
    fs::write(local.certs.join("two.example.com/notes"), "x").unwrap();
    wait_until(10 * SECOND, || recorded("two.example.com"));
    assert!(recorded("two.example.com"), "{}", agent.log());
}
