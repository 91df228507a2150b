//! A real control plane for the tests where the point is what the real one decides (a store
//! restored from a backup, the Node authorizer, NodeRestriction, RBAC, Events): etcd and
//! kube-apiserver v1.32.13 started by `../shared/tools/kube-apiserver/cluster` on free
//! loopback ports, in a scratch directory, and taken down when the value is dropped.
//!
//! The script lives beside the project, not in it: without it a test says it was skipped
//! (and fails in CI, which always has it: [`super::require`]). Writes go through curl with
//! the cluster's admin certificate, so that a test needs no kubectl.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tempfile::TempDir;

/// The script that starts and stops the control plane.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/tools/kube-apiserver/cluster")
}

pub struct Cluster {
    pub dir: TempDir,
    /// `https://127.0.0.1:PORT`.
    pub url: String,
}

impl Cluster {
    /// Starts a control plane, or says the test is skipped (`None`) when the script is not
    /// beside the project (CI always has it, and there its absence fails the test).
    pub fn up() -> Option<Cluster> {
        if !super::require(
            script().is_file(),
            "../shared/tools/kube-apiserver/cluster is not beside the project (no real API server)",
        ) {
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cluster = Cluster {
            dir,
            url: String::new(),
        };
        cluster.run("up");
        let env = fs::read_to_string(cluster.path("env")).expect("the cluster's env file");
        cluster.url = env
            .lines()
            .find_map(|line| line.strip_prefix("API_URL="))
            .expect("API_URL in the cluster's env")
            .to_string();
        Some(cluster)
    }

    /// A path under the cluster's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn run(&self, command: &str) {
        let out = Command::new("bash")
            .arg(script())
            .arg(command)
            .arg(self.dir.path())
            .output()
            .expect("run the cluster script");
        assert!(
            out.status.success(),
            "cluster {command} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Stops etcd and the API server, keeping etcd's data: an outage.
    pub fn stop(&self) {
        self.run("stop");
    }

    /// Starts both again on the same ports; returns once the API server answers `/readyz`.
    pub fn start(&self) {
        self.run("start");
    }

    /// Restarts the API server alone (same store): its watches then answer 410.
    pub fn restart(&self) {
        self.run("restart");
    }

    /// A copy of etcd's data directory, taken while the cluster is stopped: a backup.
    pub fn backup(&self, name: &str) -> PathBuf {
        let to = self.path(name);
        copy_dir(&self.path("etcd-data"), &to);
        to
    }

    /// Puts `backup` back as etcd's data (the cluster must be stopped): the store's
    /// resourceVersions go back to the backup's.
    pub fn restore(&self, backup: &Path) {
        let data = self.path("etcd-data");
        fs::remove_dir_all(&data).expect("remove etcd-data");
        copy_dir(backup, &data);
    }

    /// The admin kubeconfig (CN=admin, O=system:masters).
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.path("admin.kubeconfig")
    }

    /// The cluster CA, in PEM: it signs the API server's serving certificate and every
    /// client identity.
    pub fn ca_pem(&self) -> String {
        fs::read_to_string(self.path("pki/ca.crt")).expect("the cluster CA")
    }

    /// The cluster CA's file.
    pub fn ca_path(&self) -> PathBuf {
        self.path("pki/ca.crt")
    }

    /// A client certificate with CN `user` and O `groups`, signed by the cluster CA with
    /// openssl: the paths of its certificate and its key (PEM), in `users/USER/` under the
    /// cluster's directory. A node identity is `system:node:NAME` in `system:nodes`.
    pub fn client_cert(&self, user: &str, groups: &[&str]) -> (PathBuf, PathBuf) {
        self.signed_client_cert(user, groups, true)
    }

    /// [`Cluster::client_cert`] as `openssl x509 -req` makes it without an extension file:
    /// a certificate of X.509 version 1, which the API server accepts.
    pub fn client_cert_v1(&self, user: &str, groups: &[&str]) -> (PathBuf, PathBuf) {
        self.signed_client_cert(user, groups, false)
    }

    fn signed_client_cert(&self, user: &str, groups: &[&str], v3: bool) -> (PathBuf, PathBuf) {
        let safe: String = user
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let dir = self.path(&format!("users/{safe}"));
        fs::create_dir_all(&dir).unwrap();
        let mut subject = String::new();
        for group in groups {
            subject.push_str(&format!("/O={group}"));
        }
        subject.push_str(&format!("/CN={user}"));
        let key = dir.join("client.key");
        let csr = dir.join("client.csr");
        let crt = dir.join("client.crt");
        let ext = dir.join("client.ext");
        fs::write(&ext, "extendedKeyUsage=clientAuth\n").unwrap();
        openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            path_str(&key),
            "-out",
            path_str(&csr),
            "-subj",
            &subject,
        ]);
        let (ca, ca_key) = (self.path("pki/ca.crt"), self.path("pki/ca.key"));
        let mut sign = vec![
            "x509",
            "-req",
            "-in",
            path_str(&csr),
            "-CA",
            path_str(&ca),
            "-CAkey",
            path_str(&ca_key),
            "-CAcreateserial",
            "-out",
            path_str(&crt),
            "-days",
            "7",
        ];
        if v3 {
            sign.extend(["-extfile", path_str(&ext)]);
        }
        openssl(&sign);
        (crt, key)
    }

    /// A client certificate for `user` in `groups` signed by the cluster CA that expires
    /// `valid` from now (`openssl ca`, which takes exact dates), written to `crt` and `key`.
    pub fn client_cert_until(
        &self,
        user: &str,
        groups: &[&str],
        valid: std::time::Duration,
        crt: &Path,
        key: &Path,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let at = |p: &str| dir.path().join(p);
        fs::write(at("index.txt"), "").unwrap();
        fs::write(
            at("serial"),
            format!(
                "{:016x}\n",
                std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos() as u64
            ),
        )
        .unwrap();
        fs::write(
            at("ca.cnf"),
            format!(
                "[ca]\ndefault_ca = d\n[d]\ndatabase = {}\nnew_certs_dir = {}\nserial = {}\ndefault_md = sha256\npolicy = p\n[p]\norganizationName = optional\ncommonName = supplied\n",
                at("index.txt").display(),
                dir.path().display(),
                at("serial").display()
            ),
        )
        .unwrap();
        fs::write(at("ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        let mut subject = String::new();
        for group in groups {
            subject.push_str(&format!("/O={group}"));
        }
        subject.push_str(&format!("/CN={user}"));
        openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            path_str(key),
            "-out",
            path_str(&at("csr")),
            "-subj",
            &subject,
        ]);
        let date = |t: std::time::SystemTime| {
            let out = Command::new("date")
                .args(["-u", "-d"])
                .arg(format!(
                    "@{}",
                    t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
                ))
                .arg("+%Y%m%d%H%M%SZ")
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        let now = std::time::SystemTime::now();
        openssl(&[
            "ca",
            "-batch",
            "-notext",
            "-preserveDN",
            "-config",
            path_str(&at("ca.cnf")),
            "-cert",
            path_str(&self.path("pki/ca.crt")),
            "-keyfile",
            path_str(&self.path("pki/ca.key")),
            "-in",
            path_str(&at("csr")),
            "-out",
            path_str(crt),
            "-startdate",
            &date(now - std::time::Duration::from_secs(60)),
            "-enddate",
            &date(now + valid),
            "-extfile",
            path_str(&at("ext")),
        ]);
    }

    /// A kubeconfig for a client certificate with CN `user` and O `groups`, signed by the
    /// cluster CA ([`Cluster::client_cert`]), its certificate and key in files beside it (as
    /// the kubelet's `kubelet-client-current.pem` is).
    pub fn kubeconfig_for(&self, user: &str, groups: &[&str]) -> PathBuf {
        self.kubeconfig_with(self.client_cert(user, groups), user)
    }

    /// [`Cluster::kubeconfig_for`] with a certificate of X.509 version 1
    /// ([`Cluster::client_cert_v1`]).
    pub fn kubeconfig_for_v1(&self, user: &str, groups: &[&str]) -> PathBuf {
        self.kubeconfig_with(self.client_cert_v1(user, groups), user)
    }

    fn kubeconfig_with(&self, (crt, key): (PathBuf, PathBuf), user: &str) -> PathBuf {
        let dir = crt.parent().expect("users/USER").to_path_buf();
        let kubeconfig = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: {user}\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: test\n  context: {{cluster: test, user: \"{user}\"}}\ncurrent-context: test\n",
            self.url,
            self.path("pki/ca.crt").display(),
            crt.display(),
            key.display(),
        );
        fs::write(&kubeconfig, text).unwrap();
        kubeconfig
    }

    /// A kubeadm node's files for node `name`, in `dir`: `node.crt` and `node.key` (its
    /// identity signed by the cluster CA, as the kubelet's TLS bootstrap makes it), `ca.crt`,
    /// `kubelet.conf` (naming the client certificate
    /// `/var/lib/kubelet/pki/kubelet-client-current.pem`, as kubeadm writes it) and
    /// `config.yaml` (the kubelet's configuration, its client CA the managed bundle), for a
    /// test to lay out at the node's real paths.
    pub fn kubeadm_node_files(&self, dir: &Path, name: &str) {
        use base64::Engine;
        let (crt, key) = self.client_cert(&format!("system:node:{name}"), &["system:nodes"]);
        fs::copy(crt, dir.join("node.crt")).unwrap();
        fs::copy(key, dir.join("node.key")).unwrap();
        fs::copy(self.ca_path(), dir.join("ca.crt")).unwrap();
        let ca_data = base64::engine::general_purpose::STANDARD.encode(self.ca_pem());
        fs::write(
            dir.join("kubelet.conf"),
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: {ca_data}\n    server: {}\n  name: kubernetes\ncontexts:\n- context:\n    cluster: kubernetes\n    user: system:node:{name}\n  name: system:node:{name}@kubernetes\ncurrent-context: system:node:{name}@kubernetes\nusers:\n- name: system:node:{name}\n  user:\n    client-certificate: /var/lib/kubelet/pki/kubelet-client-current.pem\n    client-key: /var/lib/kubelet/pki/kubelet-client-current.pem\n",
                self.url
            ),
        )
        .unwrap();
        fs::write(
            dir.join("config.yaml"),
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nauthentication:\n  x509:\n    clientCAFile: /etc/kubernetes/kubelet-ca.crt\n",
        )
        .unwrap();
    }

    /// The kubelet's identity on node `name`: `system:node:NAME` in `system:nodes`.
    pub fn node_kubeconfig(&self, name: &str) -> PathBuf {
        self.kubeconfig_for(&format!("system:node:{name}"), &["system:nodes"])
    }

    /// curl's TLS arguments for the cluster's CA and its admin's client certificate.
    fn as_admin(&self, cmd: &mut Command) {
        let pki = |name: &str| self.path(&format!("pki/{name}"));
        cmd.arg("--cacert")
            .arg(pki("ca.crt"))
            .arg("--cert")
            .arg(pki("admin.crt"))
            .arg("--key")
            .arg(pki("admin.key"));
    }

    /// A request as admin: the status code and the body.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "-m", "20", "-X", method, "-w", "\n%{http_code}"]);
        self.as_admin(&mut cmd);
        with_body(&mut cmd, method, body);
        let out = cmd
            .arg(format!("{}{path}", self.url))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        let code = code.trim().parse().unwrap_or(0);
        (code, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    /// The API server's requests on `resource` so far, by verb, from its own
    /// `apiserver_request_total` (every client's, every code).
    pub fn requests_on(&self, resource: &str) -> std::collections::BTreeMap<String, f64> {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "-m", "20"]);
        self.as_admin(&mut cmd);
        let out = cmd
            .arg(format!("{}/metrics", self.url))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        let mut by_verb = std::collections::BTreeMap::new();
        let wanted = format!("resource=\"{resource}\"");
        for line in text.lines() {
            let Some(labels) = line.strip_prefix("apiserver_request_total{") else {
                continue;
            };
            if !labels.contains(&wanted) || !labels.contains("subresource=\"\"") {
                continue;
            }
            let verb = labels
                .split("verb=\"")
                .nth(1)
                .and_then(|v| v.split('"').next())
                .unwrap_or_default();
            let value: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            *by_verb.entry(verb.to_string()).or_insert(0.0) += value;
        }
        by_verb
    }

    /// Creates `namespace` unless it exists.
    pub fn namespace(&self, namespace: &str) {
        let body =
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}});
        let (code, answer) = self.request("POST", "/api/v1/namespaces", Some(&body));
        assert!(
            code == 201 || code == 409,
            "create namespace {namespace}: {code} {answer}"
        );
    }

    /// Creates or replaces ConfigMap `namespace/name` with `data`; returns its
    /// resourceVersion.
    pub fn put_configmap(&self, namespace: &str, name: &str, data: &[(&str, &str)]) -> u64 {
        self.namespace(namespace);
        let data: serde_json::Map<String, Value> = data
            .iter()
            .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
            .collect();
        let body = json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace},
            "data": data,
        });
        let one = format!("/api/v1/namespaces/{namespace}/configmaps/{name}");
        let (mut code, mut answer) = self.request("PUT", &one, Some(&body));
        if code == 404 {
            let all = format!("/api/v1/namespaces/{namespace}/configmaps");
            (code, answer) = self.request("POST", &all, Some(&body));
        }
        assert!(
            code == 200 || code == 201,
            "put configmap {namespace}/{name}: {code} {answer}"
        );
        resource_version(&answer)
    }

    /// ConfigMap `namespace/name`, when it exists.
    pub fn configmap(&self, namespace: &str, name: &str) -> Option<Value> {
        let one = format!("/api/v1/namespaces/{namespace}/configmaps/{name}");
        match self.request("GET", &one, None) {
            (200, body) => Some(body),
            (404, _) => None,
            (code, body) => panic!("get configmap {namespace}/{name}: {code} {body}"),
        }
    }

    /// Node `name`, when it exists.
    pub fn node(&self, name: &str) -> Option<Value> {
        match self.request("GET", &format!("/api/v1/nodes/{name}"), None) {
            (200, body) => Some(body),
            (404, _) => None,
            (code, body) => panic!("get node {name}: {code} {body}"),
        }
    }

    /// Node `name`'s annotation `key`, when it has one.
    pub fn node_annotation(&self, name: &str, key: &str) -> Option<String> {
        self.node(name)?["metadata"]["annotations"][key]
            .as_str()
            .map(str::to_string)
    }

    /// Grants `verbs` on the ConfigMaps `names` of `namespace` to `user` (a Role and its
    /// RoleBinding, as the deploy manifests do, by resourceNames).
    pub fn grant_configmaps(&self, namespace: &str, names: &[&str], verbs: &[&str], user: &str) {
        self.namespace(namespace);
        let role = format!("reader-{}", names.join("-"));
        let base = format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}");
        let body = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": role, "namespace": namespace},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": names, "verbs": verbs}],
        });
        let (code, answer) = self.request("POST", &format!("{base}/roles"), Some(&body));
        assert!(code == 201 || code == 409, "create role: {code} {answer}");
        let body = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": format!("{role}-{}", user.replace(':', "-")), "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        });
        let (code, answer) = self.request("POST", &format!("{base}/rolebindings"), Some(&body));
        assert!(
            code == 201 || code == 409,
            "create rolebinding: {code} {answer}"
        );
    }
}

impl Cluster {
    /// Creates Node `name` (as admin), with this value of the agent's annotation if given;
    /// a Node that exists is left as it is.
    pub fn create_node(&self, name: &str, held: Option<&str>) {
        let mut metadata = json!({"name": name, "labels": {"pool": "test"}});
        if let Some(held) = held {
            metadata["annotations"] = json!({"kubelet-ca-agent/held": held});
        }
        let body = json!({"apiVersion": "v1", "kind": "Node", "metadata": metadata});
        let (code, answer) = self.request("POST", "/api/v1/nodes", Some(&body));
        assert!(
            code == 201 || code == 409,
            "create node {name}: {code} {answer}"
        );
    }

    /// Creates many Nodes as [`Cluster::create_node`] does, each with its report, in one curl
    /// of parallel requests (a fleet larger than a page of a list in seconds).
    pub fn create_nodes(&self, nodes: &[(String, Option<String>)]) {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "--parallel", "--parallel-max", "16"]);
        for (i, (name, held)) in nodes.iter().enumerate() {
            if i > 0 {
                cmd.arg("--next");
            }
            let mut metadata = json!({"name": name, "labels": {"pool": "test"}});
            if let Some(held) = held {
                metadata["annotations"] = json!({"kubelet-ca-agent/held": held});
            }
            let body = json!({"apiVersion": "v1", "kind": "Node", "metadata": metadata});
            cmd.args(["-m", "60", "-o", "/dev/null", "-w", "%{http_code}\\n"]);
            self.as_admin(&mut cmd);
            cmd.args(["-H", "Content-Type: application/json", "--data-binary"])
                .arg(body.to_string())
                .arg(format!("{}/api/v1/nodes", self.url));
        }
        let out = cmd.output().expect("curl");
        let codes = String::from_utf8_lossy(&out.stdout);
        let created = codes.lines().filter(|c| *c == "201" || *c == "409").count();
        assert_eq!(
            created,
            nodes.len(),
            "create {} nodes: {codes}{}",
            nodes.len(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Sets (or with `None` removes) the agent's annotation on Node `name`, as admin, with
    /// a merge patch as the node agent writes it.
    pub fn set_held(&self, name: &str, held: Option<&str>) {
        let body = json!({"metadata": {"annotations": {"kubelet-ca-agent/held": held}}});
        let (code, answer) = self.request("PATCH", &format!("/api/v1/nodes/{name}"), Some(&body));
        assert_eq!(code, 200, "patch node {name}: {answer}");
    }

    /// Sets Node `name`'s Ready condition (`True`, `False`, `Unknown`) in its status.
    pub fn set_ready(&self, name: &str, ready: &str) {
        let body = json!({"status": {"conditions": [{
            "type": "Ready", "status": ready, "reason": "Test",
            "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"
        }]}});
        let path = format!("/api/v1/nodes/{name}/status");
        let (code, answer) = self.request("PATCH", &path, Some(&body));
        assert_eq!(code, 200, "patch node {name} status: {answer}");
    }

    /// Marks Node `name` as being deleted: a finalizer holds it, then it is deleted.
    pub fn delete_node_held(&self, name: &str) {
        let body = json!({"metadata": {"finalizers": ["test/hold"]}});
        let (code, answer) = self.request("PATCH", &format!("/api/v1/nodes/{name}"), Some(&body));
        assert_eq!(code, 200, "add a finalizer to {name}: {answer}");
        let (code, answer) = self.request("DELETE", &format!("/api/v1/nodes/{name}"), None);
        assert_eq!(code, 200, "delete node {name}: {answer}");
    }

    /// Grants `verbs` on every Node to `user` (a ClusterRole and its binding).
    pub fn grant_nodes(&self, verbs: &[&str], user: &str) {
        let base = "/apis/rbac.authorization.k8s.io/v1";
        let role = format!("nodes-{}", verbs.join("-"));
        let body = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": role},
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": verbs}],
        });
        let (code, answer) = self.request("POST", &format!("{base}/clusterroles"), Some(&body));
        assert!(
            code == 201 || code == 409,
            "create clusterrole: {code} {answer}"
        );
        let body = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": format!("{role}-{}", user.replace(':', "-"))},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        });
        let (code, answer) =
            self.request("POST", &format!("{base}/clusterrolebindings"), Some(&body));
        assert!(
            code == 201 || code == 409,
            "create clusterrolebinding: {code} {answer}"
        );
    }
}

impl Cluster {
    /// Creates or updates `object` as admin with server-side apply (field manager
    /// `test`, conflicts forced), at the path its apiVersion, kind, namespace and name make
    /// ([`object_path`]): the status code and the body.
    pub fn apply(&self, object: &Value) -> (u16, Value) {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "-m", "20", "-X", "PATCH", "-w", "\n%{http_code}"]);
        self.as_admin(&mut cmd);
        // JSON is YAML: an apply patch may be either.
        cmd.args(["-H", "Content-Type: application/apply-patch+yaml"])
            .arg("--data-binary")
            .arg(object.to_string())
            .arg(format!(
                "{}{}?fieldManager=test&force=true",
                self.url,
                object_path(object)
            ));
        answer(&cmd.output().expect("curl"))
    }

    /// A request with a bearer `token` (a service account's), as a pod sends it: the
    /// status code and the body. A PATCH is a JSON merge patch.
    pub fn request_with_token(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value) {
        // The header from a file, so that the token is on no command line.
        let header = tempfile::NamedTempFile::new_in(self.dir.path()).unwrap();
        fs::write(header.path(), format!("Authorization: Bearer {token}\n")).unwrap();
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "-m", "20", "-X", method, "-w", "\n%{http_code}"])
            .arg("--cacert")
            .arg(self.path("pki/ca.crt"))
            .arg("-H")
            .arg(format!("@{}", header.path().display()));
        with_body(&mut cmd, method, body);
        answer(
            &cmd.arg(format!("{}{path}", self.url))
                .output()
                .expect("curl"),
        )
    }

    /// A token of service account `namespace/name` from a TokenRequest (as admin), bound to
    /// `bound_to` (a Pod's name and uid) when given, as the kubelet asks for the token it
    /// projects into a pod; unbound otherwise.
    pub fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
        bound_to: Option<(&str, &str)>,
    ) -> String {
        let mut spec = json!({"expirationSeconds": 3600});
        if let Some((pod, uid)) = bound_to {
            spec["boundObjectRef"] =
                json!({"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid});
        }
        let body =
            json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec});
        let path = format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token");
        let (code, answer) = self.request("POST", &path, Some(&body));
        assert_eq!(code, 201, "TokenRequest for {namespace}/{name}: {answer}");
        answer["status"]["token"]
            .as_str()
            .expect("a token in the TokenRequest's status")
            .to_string()
    }
}

/// The API path of `object` (its apiVersion, kind, namespace and name), for the kinds the
/// tests write: the resource is the kind in lower case, plural with `s` (`y` -> `ies`).
pub fn object_path(object: &Value) -> String {
    let api_version = object["apiVersion"].as_str().expect("apiVersion");
    let kind = object["kind"].as_str().expect("kind").to_lowercase();
    let resource = match kind.strip_suffix('y') {
        Some(stem) => format!("{stem}ies"),
        None => format!("{kind}s"),
    };
    let group = if api_version.contains('/') {
        format!("/apis/{api_version}")
    } else {
        format!("/api/{api_version}")
    };
    let namespace = object["metadata"]["namespace"]
        .as_str()
        .map(|ns| format!("/namespaces/{ns}"))
        .unwrap_or_default();
    let name = object["metadata"]["name"].as_str().expect("metadata.name");
    format!("{group}{namespace}/{resource}/{name}")
}

/// A request's JSON body for curl: a merge patch for PATCH.
fn with_body(cmd: &mut Command, method: &str, body: Option<&Value>) {
    if let Some(body) = body {
        let content_type = if method == "PATCH" {
            "application/merge-patch+json"
        } else {
            "application/json"
        };
        cmd.arg("-H")
            .arg(format!("Content-Type: {content_type}"))
            .arg("--data-binary")
            .arg(body.to_string());
    }
}

/// curl's output with `-w "\n%{http_code}"`: the status code and the body as JSON.
fn answer(out: &std::process::Output) -> (u16, Value) {
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    let code = code.trim().parse().unwrap_or(0);
    (code, serde_json::from_str(body).unwrap_or(Value::Null))
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .arg("down")
            .arg(self.dir.path())
            .output();
    }
}

/// `kubelet-ca-agent rollout ARGS --kubeconfig KUBECONFIG`, as an operator runs it.
pub fn rollout(kubeconfig: &Path, args: &[&str]) -> std::process::Output {
    Command::new(super::agent_bin())
        .arg("rollout")
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env_remove("KUBECONFIG")
        .env_remove("RUST_LOG")
        .output()
        .expect("run the agent")
}

/// `rollout wait ARGS --kubeconfig KUBECONFIG` running in the background, as an operator's
/// script runs it: its lines as they come, its log (stderr), and its exit.
pub struct RolloutWait {
    lines: mpsc::Receiver<String>,
    child: Child,
    log: tempfile::NamedTempFile,
}

impl RolloutWait {
    pub fn start(kubeconfig: &Path, args: &[&str]) -> RolloutWait {
        RolloutWait::start_wrapped(kubeconfig, args, &[])
    }

    /// [`RolloutWait::start`] under `wrapper` (a command that runs what follows it, as
    /// `WITHOUT_INOTIFY` does).
    pub fn start_wrapped(kubeconfig: &Path, args: &[&str], wrapper: &[&str]) -> RolloutWait {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(super::agent_bin());
                command
            }
            None => Command::new(super::agent_bin()),
        };
        let mut child = command
            .args(["rollout", "wait"])
            .args(args)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .env_remove("KUBECONFIG")
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("start rollout wait");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        RolloutWait { lines, child, log }
    }

    /// The next line it prints, within `limit`.
    pub fn line(&self, limit: Duration) -> String {
        self.lines
            .recv_timeout(limit)
            .expect("a line from rollout wait")
    }

    /// Still waiting?
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log.path()).unwrap()
    }

    /// How many lines of its log say `what`.
    pub fn logged(&self, what: &str) -> usize {
        self.log().lines().filter(|l| l.contains(what)).count()
    }

    /// Its exit code and the lines it printed that were not taken yet, once it has exited
    /// within `limit`; past `limit` it is killed and the test fails with its output and log.
    pub fn exit(&mut self, limit: Duration) -> (Option<i32>, String) {
        let until = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // The reader thread ends with the pipe: take every line.
                let mut text = Vec::new();
                while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(1)) {
                    text.push(line);
                }
                return (status.code(), text.join("\n"));
            }
            if Instant::now() >= until {
                let _ = self.child.kill();
                let text: Vec<String> = self.lines.try_iter().collect();
                panic!(
                    "rollout wait did not exit within {limit:?}:\n{}\n{}",
                    text.join("\n"),
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RolloutWait {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `rollout wait` run to its end within `limit`: its exit code and output.
pub fn rollout_wait<S: AsRef<str>>(
    kubeconfig: &Path,
    args: &[S],
    limit: Duration,
) -> (Option<i32>, String) {
    let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
    RolloutWait::start(kubeconfig, &args).exit(limit)
}

/// The resourceVersion of an object as the API server answered it.
pub fn resource_version(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|rv| rv.parse().ok())
        .unwrap_or_else(|| panic!("no resourceVersion in {object}"))
}

fn copy_dir(from: &Path, to: &Path) {
    let out = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .output()
        .expect("cp");
    assert!(
        out.status.success(),
        "cp -a {} {}: {}",
        from.display(),
        to.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// A directory of `deploy/` (an overlay) as `kubectl kustomize` renders it, one value per
/// object; `None` (the test skipped, or failed in CI) when kubectl is not installed.
pub fn render(overlay: &str) -> Option<Vec<Value>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(overlay);
    let out = Command::new("kubectl").arg("kustomize").arg(&dir).output();
    if !super::require(
        out.is_ok(),
        "kubectl is not installed (kubectl kustomize renders the overlay)",
    ) {
        return None;
    }
    let out = out.unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8 YAML");
    let objects: Vec<Value> = serde_saphyr::from_multiple(&text).expect("the rendering is YAML");
    Some(objects.into_iter().filter(|o| !o.is_null()).collect())
}

/// The one object of `kind` named `name` in a rendering.
pub fn object<'a>(rendered: &'a [Value], kind: &str, name: &str) -> &'a Value {
    rendered
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the rendering"))
}

/// The value of `name` in the environment of a DaemonSet's (first) container.
pub fn env_value(daemonset: &Value, name: &str) -> String {
    daemonset["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
        .unwrap_or_else(|| panic!("{name} in the DaemonSet's environment"))
        .to_string()
}

/// The kinds of a rendering that make the agent's identity in the cluster: its namespace,
/// service account, RBAC, and the admission policies that confine it.
pub const IDENTITY_KINDS: [&str; 8] = [
    "Namespace",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

impl Cluster {
    /// Applies (as admin) the objects of `rendered` whose kind is one of
    /// [`IDENTITY_KINDS`], exactly as rendered; returns them.
    pub fn apply_identity<'a>(&self, rendered: &'a [Value]) -> Vec<&'a Value> {
        let applied: Vec<&Value> = rendered
            .iter()
            .filter(|o| IDENTITY_KINDS.iter().any(|k| o["kind"] == *k))
            .collect();
        for object in &applied {
            let (code, answer) = self.apply(object);
            assert!(
                code == 200 || code == 201,
                "apply {} {}: {code} {answer}",
                object["kind"],
                object["metadata"]["name"]
            );
        }
        applied
    }

    /// Creates, as the DaemonSet's controller would, Pod `name` of `daemonset`'s template
    /// in its namespace, bound to Node `node` (it never runs: the Pod is what a token is
    /// bound to); returns its uid.
    pub fn daemonset_pod(&self, daemonset: &Value, name: &str, node: &str) -> String {
        let namespace = daemonset["metadata"]["namespace"]
            .as_str()
            .expect("the DaemonSet's namespace");
        let template = &daemonset["spec"]["template"];
        let mut spec = template["spec"].clone();
        spec["nodeName"] = json!(node);
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": template["metadata"]["labels"]},
            "spec": spec});
        let (code, created) = self.request(
            "POST",
            &format!("/api/v1/namespaces/{namespace}/pods"),
            Some(&pod),
        );
        assert_eq!(code, 201, "the DaemonSet's own pod is admitted: {created}");
        created["metadata"]["uid"]
            .as_str()
            .expect("the Pod's uid")
            .to_string()
    }
}
