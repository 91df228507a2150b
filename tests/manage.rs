//! Several managed files in one agent (issue 19, SPEC 4b), through the real binary: each
//! `--manage` file is written, rotated, repaired and recorded as the bundle is, from
//! sources of its own; a bad update to one file's sources holds back that file alone; and
//! `READY=1`'s file, the bundle, never waits for another.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::daemon::{Agent, check_line, samples, wait_until};
use common::pki::{Algorithm, Signer};
use common::{Node, sha256_hex};

const SECOND: Duration = Duration::from_secs(1);

fn verbose(agent: &Agent) -> String {
    agent.get("/readyz?verbose").unwrap_or_default().1
}

/// A node with a bundle source and a cloud CA file managed from a source of its own.
struct Cloud {
    node: Node,
    bundle_source: String,
    cloud_source: String,
    cloud: PathBuf,
}

impl Cloud {
    fn new(bundle_pem: &str, cloud_pem: &str) -> Cloud {
        let node = Node::new();
        let bundle_source = node.source("kubelet-signers.pem", bundle_pem);
        let cloud_source = node.source("cloud-ca.pem", cloud_pem);
        let cloud = node
            .root()
            .join("etc/kubernetes/static-pod-resources/configmaps/cloud-config/ca-bundle.pem");
        fs::create_dir_all(cloud.parent().unwrap()).unwrap();
        Cloud {
            node,
            bundle_source,
            cloud_source,
            cloud,
        }
    }

    fn manage(&self) -> String {
        format!("{}={}", self.cloud.display(), self.cloud_source)
    }

    fn start(&self) -> Agent {
        let manage = self.manage();
        Agent::start(&self.node, &[&self.bundle_source], &["--manage", &manage])
    }

    fn holds(&self, content: &str) -> bool {
        fs::read(&self.cloud).is_ok_and(|b| b == content.as_bytes())
    }

    fn write_source(&self, name: &str, content: &str) {
        let path = self.node.root().join("sources").join(name);
        let temp = path.with_extension("tmp");
        fs::write(&temp, content).unwrap();
        fs::rename(&temp, &path).unwrap();
    }
}

fn history_dirs(state: &Path) -> Vec<PathBuf> {
    fs::read_dir(state.join("files"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

#[test]
fn a_managed_file_is_written_rotated_repaired_and_recorded_apart_from_the_bundle() {
    let (kubelet, cloud_old, cloud_new) = (
        Signer::new("kubelet-signer", Algorithm::P256),
        Signer::new("cloud-ca-old", Algorithm::P256),
        Signer::new("cloud-ca-new", Algorithm::P384),
    );
    let node = Cloud::new(&kubelet.pem(), &cloud_old.pem());
    let agent = node.start();
    wait_until(10 * SECOND, || {
        node.node.holds(kubelet.pem()) && node.holds(&cloud_old.pem())
    });
    let mode = fs::metadata(&node.cloud).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o7777,
        0o644
    );

    // Health and metrics name the file.
    let cloud = node.cloud.display().to_string();
    wait_until(10 * SECOND, || {
        verbose(&agent).contains(&format!("[+]in-sync:{cloud} ok"))
    });
    let page = verbose(&agent);
    assert!(
        check_line(&page, &format!("bundle-valid:{cloud}")).starts_with("[+]"),
        "{page}"
    );
    assert!(
        check_line(&page, &format!("source:{}", node.cloud_source)).starts_with("[+]"),
        "{page}"
    );
    agent.wait_sample(
        10 * SECOND,
        "kubelet_ca_bundle_in_sync",
        &[("filepath", &cloud)],
        |v| v == 1.0,
    );
    let (_, metrics) = agent.get("/metrics").unwrap();
    let expiry = samples(&metrics, "x509_cert_not_after");
    assert!(
        expiry
            .iter()
            .any(|s| s.has(&[("filepath", &cloud), ("subject_CN", "cloud-ca-old")])),
        "{metrics}"
    );
    assert!(
        !expiry
            .iter()
            .any(|s| s.has(&[("filepath", &cloud), ("subject_CN", "kubelet-signer")])),
        "the bundle's signer counted in the cloud file: {metrics}"
    );

    // A rotation of the cloud CA reaches its file alone.
    let bundle_before = node.node.read_bundle();
    node.write_source("cloud-ca.pem", &cloud_new.pem());
    wait_until(10 * SECOND, || node.holds(&cloud_new.pem()));
    assert_eq!(node.node.read_bundle(), bundle_before);

    // A hand edit is put back.
    fs::write(&node.cloud, "hand edit\n").unwrap();
    wait_until(10 * SECOND, || node.holds(&cloud_new.pem()));
    agent.wait_sample(
        10 * SECOND,
        "kubelet_ca_repairs_total",
        &[("filepath", &cloud)],
        |v| v == 1.0,
    );

    // Its history is its own, beside the bundle's.
    let dirs = history_dirs(&node.node.state_dir());
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let name = dirs[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("ca-bundle.pem-"), "{name}");
    let kept: Vec<Vec<u8>> = fs::read_dir(dirs[0].join("history"))
        .unwrap()
        .flatten()
        .map(|e| fs::read(e.path()).unwrap())
        .collect();
    assert_eq!(kept, [cloud_old.pem().into_bytes()]);

    // managed-files.json lists both, each with its content's SHA-256.
    let managed = node.node.state_dir().join("managed-files.json");
    wait_until(10 * SECOND, || {
        fs::read_to_string(&managed)
            .is_ok_and(|j| j.contains(&sha256_hex(cloud_new.pem().as_bytes())))
    });
    let json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&managed).unwrap()).unwrap();
    let files: Vec<(String, String)> = json["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap().to_string(),
                f["sha256"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let mut expected = vec![
        (
            node.node.bundle().display().to_string(),
            sha256_hex(&node.node.read_bundle()),
        ),
        (cloud.clone(), sha256_hex(cloud_new.pem().as_bytes())),
    ];
    expected.sort();
    assert_eq!(files, expected);
}

#[test]
fn a_bad_update_to_one_files_sources_holds_back_that_file_alone() {
    let (kubelet, kubelet_next, cloud_ca) = (
        Signer::new("kubelet-signer", Algorithm::P256),
        Signer::new("kubelet-signer-next", Algorithm::P256),
        Signer::new("cloud-ca", Algorithm::P256),
    );
    let node = Cloud::new(&kubelet.pem(), &cloud_ca.pem());
    let agent = node.start();
    wait_until(10 * SECOND, || {
        node.node.holds(kubelet.pem()) && node.holds(&cloud_ca.pem())
    });

    // A private key pasted into the cloud CA's source: refused for that file alone.
    node.write_source(
        "cloud-ca.pem",
        &format!("{}{}", cloud_ca.pem(), cloud_ca.key_pem()),
    );
    let source = format!("source:{}", node.cloud_source);
    wait_until(10 * SECOND, || {
        verbose(&agent)
            .lines()
            .any(|l| l.starts_with(&format!("[-]{source} ")))
    });
    let page = verbose(&agent);
    assert!(check_line(&page, &source).contains("private key"), "{page}");
    assert!(node.holds(&cloud_ca.pem()), "the cloud file was touched");

    // The bundle still rotates.
    let both = format!("{}{}", kubelet.pem(), kubelet_next.pem());
    node.write_source("kubelet-signers.pem", &both);
    wait_until(10 * SECOND, || node.node.holds(&both));
    assert!(node.holds(&cloud_ca.pem()));
    // The last good content stays in sync: readiness holds.
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200));
}

#[test]
fn two_sets_of_sources_for_one_file_are_refused_at_start() {
    let node = Node::new();
    let source = node.source("a.pem", Signer::new("a", Algorithm::P256).pem());
    let bundle = node.bundle().display().to_string();
    let out = node
        .command("run")
        .args([
            "--source",
            &source,
            "--manage",
            &format!("{bundle}={source}"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", common::stderr(&out));
    assert!(
        common::stderr(&out).contains("already managed (--bundle)"),
        "{}",
        common::stderr(&out)
    );
}

#[test]
fn a_manage_flag_without_sources_is_a_usage_error_naming_the_form() {
    let node = Node::new();
    let out = node
        .command("run")
        .args(["--manage", "/etc/pki/cloud.pem"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        common::stderr(&out).contains("PATH=SPEC"),
        "{}",
        common::stderr(&out)
    );
}

mod cluster {
    use base64::Engine;
    use serde_json::{Value, json};

    use super::*;
    use common::apiserver::ApiServer;

    const CC: &str = "machine-config-controller";
    const KUBE: &str = "controllerconfig:machine-config-controller";
    const CLOUD: &str = "controllerconfig:machine-config-controller/cloudProviderCAData";

    fn b64(pem: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(pem)
    }

    /// A ControllerConfig's CA fields as a real cluster has them, the cloud CA as given
    /// (empty on most platforms), the registry lists non-empty.
    fn fields(kube: &str, cloud: &str, registry: &str) -> Vec<(&'static str, Value)> {
        vec![
            ("kubeAPIServerServingCAData", json!(b64(kube))),
            ("cloudProviderCAData", json!(b64(cloud))),
            (
                "imageRegistryBundleData",
                json!([{"file": "image-registry.openshift-image-registry.svc..5000", "data": b64(registry)}]),
            ),
            (
                "imageRegistryBundleUserData",
                json!([{"file": "registry.example.com..5000", "data": b64(registry)}]),
            ),
        ]
    }

    /// What the upstream writer leaves for an empty cloud CA, a lone newline, is what the
    /// sources hold: nothing. It is left as it is, and nothing is wrong.
    #[test]
    fn the_upstream_writers_lone_newline_for_an_empty_cloud_ca_is_left_alone_and_healthy() {
        let api = ApiServer::start();
        let (kube, registry) = (
            Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
            Signer::new("registry-ca", Algorithm::P256),
        );
        api.put_controllerconfig_spec(CC, &fields(&kube.pem(), "", &registry.pem()));
        let node = Node::new();
        let cloud = node.root().join("etc/cloud/ca-bundle.pem");
        fs::create_dir_all(cloud.parent().unwrap()).unwrap();
        fs::write(&cloud, "\n").unwrap();
        let manage = format!("{}={CLOUD}", cloud.display());
        let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
        let agent = Agent::start(
            &node,
            &[KUBE],
            &["--manage", &manage, "--kubeconfig", &kubeconfig],
        );
        wait_until(10 * SECOND, || node.holds(kube.pem()));
        let path = cloud.display().to_string();
        wait_until(10 * SECOND, || {
            verbose(&agent).contains(&format!("[+]in-sync:{path} ok"))
        });
        let page = verbose(&agent);
        assert!(
            check_line(&page, &format!("bundle-valid:{path}")).starts_with("[+]"),
            "{page}"
        );
        assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200), "{page}");
        assert_eq!(fs::read(&cloud).unwrap(), b"\n", "the file was touched");
    }

    #[test]
    fn a_cloud_ca_from_the_controllerconfig_is_kept_when_there_is_one_and_never_created_empty() {
        let api = ApiServer::start();
        let (kube, cloud_ca, registry, registry_next) = (
            Signer::new("kube-apiserver-lb-signer", Algorithm::P256),
            Signer::new("cloud-provider-ca", Algorithm::P256),
            Signer::new("registry-ca", Algorithm::P256),
            Signer::new("registry-ca-next", Algorithm::P256),
        );
        api.put_controllerconfig_spec(CC, &fields(&kube.pem(), "", &registry.pem()));
        let node = Node::new();
        let cloud = node.root().join("etc/cloud/ca-bundle.pem");
        fs::create_dir_all(cloud.parent().unwrap()).unwrap();
        let manage = format!("{}={CLOUD}", cloud.display());
        let kubeconfig = api.kubeconfig().to_str().unwrap().to_string();
        let agent = Agent::start(
            &node,
            &[KUBE],
            &["--manage", &manage, "--kubeconfig", &kubeconfig],
        );
        wait_until(10 * SECOND, || node.holds(kube.pem()));

        // No cloud CA: nothing to keep, nothing created, and nothing wrong.
        let path = cloud.display().to_string();
        wait_until(10 * SECOND, || {
            verbose(&agent).contains(&format!("[+]in-sync:{path} ok"))
        });
        assert!(!cloud.exists(), "an empty cloud CA was written");
        let page = verbose(&agent);
        assert!(
            check_line(&page, &format!("bundle-valid:{path}")).starts_with("[+]"),
            "{page}"
        );
        assert!(
            check_line(&page, &format!("source:{CLOUD}")).starts_with("[+]"),
            "{page}"
        );
        assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200), "{page}");

        // An unrelated field of the object changes: neither file is written.
        let writes = |file: &str| agent.sample("kubelet_ca_writes_total", &[("filepath", file)]);
        let bundle = node.bundle().display().to_string();
        let before = (writes(&bundle), writes(&path));
        api.put_controllerconfig_spec(CC, &fields(&kube.pem(), "", &registry_next.pem()));
        std::thread::sleep(SECOND);
        assert_eq!((writes(&bundle), writes(&path)), before);
        assert!(!cloud.exists());

        // The platform gets a cloud CA: the file is created, the bundle left as it was.
        api.put_controllerconfig_spec(
            CC,
            &fields(&kube.pem(), &cloud_ca.pem(), &registry_next.pem()),
        );
        wait_until(10 * SECOND, || {
            fs::read(&cloud).is_ok_and(|b| b == cloud_ca.pem().as_bytes())
        });
        assert!(node.holds(kube.pem()));
        assert_eq!(writes(&bundle), before.0);

        // One list and one watch at a time for the object, whatever the fields read.
        let requests = api.requests();
        let lists = requests
            .iter()
            .filter(|r| r.path.contains("controllerconfigs") && r.is_list())
            .count();
        assert_eq!(lists, 1, "one list of the ControllerConfig");
        assert_eq!(api.open_watches(), 1, "one watch of the ControllerConfig");
    }
}

#[test]
fn sync_writes_every_managed_file_and_a_bad_one_is_left_alone_with_exit_1() {
    let (kubelet, cloud_ca) = (
        Signer::new("kubelet-signer", Algorithm::P256),
        Signer::new("cloud-ca", Algorithm::P256),
    );
    let node = Cloud::new(&kubelet.pem(), &cloud_ca.pem());
    let manage = node.manage();
    let out = node
        .node
        .sync(&[&node.bundle_source], &["--manage", &manage]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert!(node.node.holds(kubelet.pem()));
    assert!(node.holds(&cloud_ca.pem()));

    // A key in the cloud CA's source: that file is left as it was, the bundle still synced.
    let next = Signer::new("kubelet-signer-next", Algorithm::P256);
    node.write_source("kubelet-signers.pem", &next.pem());
    node.write_source(
        "cloud-ca.pem",
        &format!("{}{}", cloud_ca.pem(), cloud_ca.key_pem()),
    );
    let out = node
        .node
        .sync(&[&node.bundle_source], &["--manage", &manage]);
    assert_eq!(out.status.code(), Some(1), "{}", common::stderr(&out));
    let err = common::stderr(&out);
    assert!(err.contains("private key"), "{err}");
    assert!(node.node.holds(next.pem()), "the bundle was not synced");
    assert!(node.holds(&cloud_ca.pem()), "the cloud file was touched");
}

/// `kubelet-ca-agent drift COMMAND` with the node's `--bundle` and `--state-dir`.
fn drift(node: &Node, command: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(common::agent_bin());
    cmd.args(["drift", command, "--bundle"])
        .arg(node.bundle())
        .arg("--state-dir")
        .arg(node.state_dir())
        .env_remove("RUST_LOG");
    cmd
}

/// `drift exclusions` and `drift strip` know every managed file: from managed-files.json
/// once the agent wrote it, and from the flags before.
#[test]
fn drift_lists_and_strips_every_managed_file() {
    let (kubelet, cloud_ca) = (
        Signer::new("kubelet-signer", Algorithm::P256),
        Signer::new("cloud-ca", Algorithm::P256),
    );
    let node = Cloud::new(&kubelet.pem(), &cloud_ca.pem());
    let manage = node.manage();
    let exclusions = |extra: &[&str]| {
        let out = drift(&node.node, "exclusions")
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", common::stderr(&out));
        // The paths themselves (each is followed by its temporary files' glob).
        let mut lines: Vec<String> = common::stdout(&out)
            .lines()
            .filter(|l| !l.ends_with(".kubelet-ca-agent-tmp.*"))
            .map(String::from)
            .collect();
        lines.sort();
        lines
    };
    let mut both = vec![
        node.node.bundle().display().to_string(),
        node.cloud.display().to_string(),
    ];
    both.sort();
    // Before any run: from the flags.
    assert_eq!(exclusions(&["--manage", &manage]), both);
    // After a sync: from managed-files.json, flags or not.
    let out = node
        .node
        .sync(&[&node.bundle_source], &["--manage", &manage]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert_eq!(exclusions(&[]), both);

    // A rendered config that still carries both files: strip removes both, and keeps the
    // rest byte for byte.
    let file = |path: &str, pem: &str| {
        serde_json::json!({
            "path": path,
            "mode": 420,
            "overwrite": true,
            "contents": { "source": format!("data:,{}", pem.replace('\n', "%0A")) }
        })
    };
    let rendered = serde_json::json!({
        "ignition": { "version": "3.5.0" },
        "storage": { "files": [
            file(&node.node.bundle().display().to_string(), &kubelet.pem()),
            file("/etc/motd", "hello\n"),
            file(&node.cloud.display().to_string(), &cloud_ca.pem()),
        ] }
    });
    let path = node.node.root().join("rendered.json");
    fs::write(&path, serde_json::to_vec_pretty(&rendered).unwrap()).unwrap();
    let out = drift(&node.node, "strip")
        .args(["--rendered", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::stderr(&out));
    let stripped: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let paths: Vec<&str> = stripped["storage"]["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["/etc/motd"]);
}
