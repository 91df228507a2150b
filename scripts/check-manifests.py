#!/usr/bin/env python3
"""Checks the rendered deploy/ manifests (one YAML stream per kustomization) beyond their
schemas: what SPEC section 10 and issue 9 require of the DaemonSet, of the publisher's
Deployment when a rendering has one (SPEC 8b), least-privilege RBAC for each of the two
service accounts against what it is configured to read and write, the scrape
configuration, and the fields of the custom resources (ServiceMonitor, PrometheusRule,
SecurityContextConstraints) that kubernetes-validate has no schema for. And what a
taken-over agent may hold (SPEC 13, issue 37): the DaemonSet's host paths, the masks over
/etc/kubernetes, no control-plane node, no bus, the kubelet's restart through the host's
path unit, a write on nodes only beside the ValidatingAdmissionPolicy that confines it to
the token's own Node, no node reading the ControllerConfig, and the publisher in a
namespace of its own at the restricted Pod Security level.

usage: check-manifests.py RENDERED.yaml...   (exit 1 with one line per problem)
"""
import re
import sys

import jsonschema
import yaml

NS = "kubelet-ca-agent"
AGENT = "kubelet-ca-agent"
PUBLISHER = "kubelet-ca-agent-publisher"
# The publisher's own namespace, at the restricted Pod Security level (the agents' must be
# privileged).
PUBLISHER_NS = "kubelet-ca-agent-publisher"
SA = ("ServiceAccount", AGENT, NS)
PUBLISHER_SA = ("ServiceAccount", PUBLISHER, PUBLISHER_NS)
READ = {"get", "list", "watch"}
# A write on Nodes: granted to a ServiceAccount only beside a ValidatingAdmissionPolicy
# that confines it to the Node its token names (SPEC 8c), see check_node_writes.
NODE_WRITES = {"patch", "update", "create", "delete", "deletecollection", "*"}
# What the node report needs with the pod's own token: follow its own Node (a metadata
# watch by name, which RBAC cannot narrow), patch its annotation (cluster-wide: every node
# has its own name), and create Events in default.
NODE_REPORT = ("", "nodes", frozenset({"get", "list", "watch", "patch"}), None)
NODE_EVENTS = ("", "events", frozenset({"create"}), "default")
# The host directories a pod of this project may mount, each for a reason (and the same
# list as the ValidatingAdmissionPolicy kubelet-ca-agent-pods names):
ALLOWED_HOST_PATHS = {
    "/etc/kubernetes",                        # the bundle, the kubeconfigs it keeps
    "/var/lib/kubelet-ca-agent",              # its state
    "/run/kubelet-ca-agent/kubelet-restart",  # the kubelet's restart request (path unit)
    "/etc/docker",                            # registry CAs (openshift-publisher)
}
# Never mounted, nor a directory above them (SPEC 13): other pods' volumes and tokens and
# the kubelet's key, etcd's data, systemd's bus and its private socket. One exception: the
# kubelet's pki/, read-only, with components/kubelet-credentials (clusters before 1.30).
SECRET_HOST_PATHS = ("/var/lib/kubelet", "/var/lib/etcd", "/run/dbus", "/run/systemd",
                     "/var/run/dbus", "/var/run/systemd")
KUBELET_PKI = "/var/lib/kubelet/pki"
# Under /etc/kubernetes, which the agent must mount: the cluster's CA keys and the static
# pod manifests, hidden by read-only empty directories mounted over them.
MASKED = ("/etc/kubernetes/pki", "/etc/kubernetes/manifests")
CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
# The kubeconfigs the kubelet reads while it runs (kubeadm, OpenShift): a new CA there
# needs the kubelet's restart. A bootstrap kubeconfig (OpenShift's
# /etc/kubernetes/kubeconfig) is read only to bootstrap, and needs none.
KUBELET_KUBECONFIGS = ("/etc/kubernetes/kubelet.conf", "/var/lib/kubelet/kubeconfig")
RESTART_DIR = "/run/kubelet-ca-agent/kubelet-restart"
# Volume types the restricted Pod Security level admits.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
# The publisher's target ConfigMap: read it (get for --once, list and watch by name), apply
# to it (patch), and create it, which an apply that creates the object is authorized for.
PUBLISH = READ | {"patch", "create"}
DEFAULT_AGENT_SOURCE = "configmap:openshift-config-managed/kube-apiserver-client-ca"
DEFAULT_PUBLISHER_SOURCE = "controllerconfig:machine-config-controller"

# The fields of the custom resources that deploy/ uses, from the prometheus-operator and
# OpenShift CRDs; anything else (a typo such as `keysecret`) is refused.
def obj(props, required=()):
    return {"type": "object", "properties": props, "required": list(required),
            "additionalProperties": False}

STR = {"type": "string"}
SECRET_KEY = obj({"name": STR, "key": STR, "optional": {"type": "boolean"}}, ["name", "key"])
METADATA = {"type": "object", "required": ["name"]}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): obj({
        "apiVersion": STR, "kind": STR, "metadata": METADATA,
        "spec": obj({
            "jobLabel": STR,
            "selector": obj({"matchLabels": {"type": "object"}}),
            "namespaceSelector": obj({"matchNames": {"type": "array", "items": STR},
                                      "any": {"type": "boolean"}}),
            "endpoints": {"type": "array", "minItems": 1, "items": obj({
                "port": STR, "scheme": {"enum": ["http", "https"]}, "path": STR,
                "interval": STR, "scrapeTimeout": STR, "bearerTokenFile": STR,
                "honorLabels": {"type": "boolean"},
                "tlsConfig": obj({
                    "insecureSkipVerify": {"type": "boolean"}, "serverName": STR,
                    "caFile": STR, "certFile": STR, "keyFile": STR,
                    "ca": obj({"secret": SECRET_KEY, "configMap": SECRET_KEY}),
                    "cert": obj({"secret": SECRET_KEY, "configMap": SECRET_KEY}),
                    "keySecret": SECRET_KEY}),
                "relabelings": {"type": "array", "items": obj({
                    "sourceLabels": {"type": "array", "items": STR}, "targetLabel": STR,
                    "action": STR, "regex": STR, "replacement": STR, "separator": STR})},
            }, ["port"])},
        }, ["selector", "endpoints"]),
    }, ["apiVersion", "kind", "metadata", "spec"]),
    ("monitoring.coreos.com/v1", "PrometheusRule"): obj({
        "apiVersion": STR, "kind": STR, "metadata": METADATA,
        "spec": obj({"groups": {"type": "array", "items": obj({
            "name": STR, "interval": STR,
            "rules": {"type": "array", "items": obj({
                "alert": STR, "record": STR, "expr": STR, "for": STR,
                "labels": {"type": "object", "additionalProperties": STR},
                "annotations": {"type": "object", "additionalProperties": STR}},
                ["expr"])}}, ["name", "rules"])}}, ["groups"]),
    }, ["apiVersion", "kind", "metadata", "spec"]),
    ("security.openshift.io/v1", "SecurityContextConstraints"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "runAsUser", "seLinuxContext"],
        "additionalProperties": False,
        "properties": {k: {} for k in [
            "apiVersion", "kind", "metadata", "allowHostDirVolumePlugin", "allowHostIPC",
            "allowHostNetwork", "allowHostPID", "allowHostPorts", "allowPrivilegeEscalation",
            "allowPrivilegedContainer", "allowedCapabilities", "defaultAddCapabilities",
            "requiredDropCapabilities", "readOnlyRootFilesystem", "runAsUser",
            "seLinuxContext", "seccompProfiles", "fsGroup", "supplementalGroups", "users",
            "groups", "priority", "volumes", "allowedUnsafeSysctls", "forbiddenSysctls",
            "defaultAllowPrivilegeEscalation"]},
    },
}


def source_grants(spec):
    """(namespace or None, apiGroup, resource, name) a source spec needs read access to."""
    kind, _, rest = spec.partition(":")
    if kind == "configmap":
        ns, name = rest.split("/")[:2]
        return (ns, "", "configmaps", name)
    if kind == "controllerconfig":
        return (None, "machineconfiguration.openshift.io", "controllerconfigs", rest.split("/")[0])
    return None  # file:, dir: need no API access


def configmap_key(spec):
    """(namespace, name, key) of a configmap: source spec or a --to value (NS/NAME[/KEY])."""
    parts = spec.removeprefix("configmap:").split("/")
    return (parts[0], parts[1], parts[2] if len(parts) > 2 else "ca-bundle.crt")


class Container:
    """The one container of a workload, read as the agent reads its configuration."""

    def __init__(self, workload):
        self.pod = workload["spec"]["template"]["spec"]
        (self.c,) = self.pod["containers"]
        self.env = self.c.get("env", [])
        self.envd = {e["name"]: e for e in self.env}

    def value(self, name):
        return self.envd.get(name, {}).get("value")

    def field(self, name):
        return self.envd.get(name, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")

    def flag(self, name):
        return self.value(name) == "true"

    def sources(self, default):
        return [s for s in (self.value("KUBELET_CA_AGENT_SOURCE") or default).split(",") if s]

    def other_sources(self):
        """The sources of the --manage files, --manage-registries sets and
        --manage-kubeconfig kubeconfigs: `;` between them, each PATH=SPEC[,SPEC...]."""
        specs = []
        for var in ("KUBELET_CA_AGENT_MANAGE", "KUBELET_CA_AGENT_MANAGE_REGISTRIES",
                    "KUBELET_CA_AGENT_MANAGE_KUBECONFIG"):
            for item in (self.value(var) or "").split(";"):
                _, _, rest = item.partition("=")
                specs += [s.strip() for s in rest.split(",") if s.strip()]
        return specs

    @property
    def token_webhook(self):
        return self.flag("KUBELET_CA_AGENT_AUTHENTICATION_TOKEN_WEBHOOK")

    @property
    def access_webhook(self):
        return self.flag("KUBELET_CA_AGENT_AUTHORIZATION_WEBHOOK")

    @property
    def allow_list(self):
        return bool(self.value("KUBELET_CA_AGENT_AUTHORIZED_USERS") or self.value("KUBELET_CA_AGENT_AUTHORIZED_GROUPS"))


def check_listen(what, workload, ct, var, field_path, bad):
    """Listening on the address the downward API gives, never a wildcard, and the env
    references in order."""
    if ct.field(var) != field_path:
        bad(f"{what}: {var} must come from the downward API {field_path}")
    want = f"[$({var})]:9745"
    if ct.value("KUBELET_CA_AGENT_LISTEN") != want:
        bad(f"{what}: must listen on {want}, not {ct.value('KUBELET_CA_AGENT_LISTEN')!r}")
    text = yaml.safe_dump(workload)
    for wildcard in ("0.0.0.0", "[::]", "::/0"):
        if wildcard in text:
            bad(f"{what} mentions {wildcard}: it must never listen on a wildcard address")
    if "--listen" in " ".join(ct.c.get("args", []) + ct.c.get("command", [])):
        bad(f"{what}: --listen in the arguments would override the downward-API address")
    if ct.value("KUBELET_CA_AGENT_INSECURE_METRICS") not in (None, "false"):
        bad(f"{what}: --insecure-metrics must not be set in a pod")
    # $(VAR) references resolve only to variables defined earlier in the list.
    seen = set()
    for e in ct.env:
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
            if ref not in seen:
                bad(f"{what}: {e['name']} refers to $({ref}) before it is defined: it would stay literal")
        seen.add(e["name"])


def check_container_basics(what, ct, bad):
    """Probes (liveness on /livez only: a failing /readyz must not restart the pod),
    resources, and the confinement shared by both workloads."""
    c, pod = ct.c, ct.pod
    for probe, health in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        got = c.get(probe, {}).get("httpGet", {}).get("path")
        if got != health:
            bad(f"{what}: {probe} must GET {health}, not {got!r}")
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory"):
            if r not in res.get(kind, {}):
                bad(f"{what}: resources.{kind}.{r} is missing")
    sc = c.get("securityContext", {})
    if sc.get("readOnlyRootFilesystem") is not True:
        bad(f"{what}: the root filesystem must be read-only")
    if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
        bad(f"{what}: no privilege escalation, not privileged")
    if sc.get("capabilities", {}).get("drop") != ["ALL"]:
        bad(f"{what}: every capability must be dropped (drop: [ALL])")
    seccomp = (sc.get("seccompProfile") or pod.get("securityContext", {}).get("seccompProfile") or {})
    if seccomp.get("type") != "RuntimeDefault":
        bad(f"{what}: seccomp must be RuntimeDefault")
    if pod.get("hostPID") or pod.get("hostIPC"):
        bad(f"{what}: no host PID or IPC namespace")


def check_scrape(what, ct, sm, svc, bad, verify_server):
    """/metrics needs credentials the ServiceMonitor presents, and an authorization that
    is not "anyone authenticated"."""
    client_ca = bool(ct.value("KUBELET_CA_AGENT_CLIENT_CA_FILE"))
    if not client_ca and not ct.token_webhook:
        bad(f"{what}: /metrics needs --client-ca-file or --authentication-token-webhook")
    if not ct.allow_list and not ct.access_webhook:
        bad(f"{what}: a static allow-list (--authorized-users/--authorized-groups) or --authorization-webhook must decide who reads /metrics")
    if sm is None:
        bad(f"{what}: no ServiceMonitor")
    else:
        for ep in sm["spec"]["endpoints"]:
            tls = ep.get("tlsConfig", {})
            if ep.get("scheme") != "https":
                bad(f"ServiceMonitor {sm['metadata']['name']} must scrape over https")
            has_cert = ("cert" in tls and "keySecret" in tls) or ("certFile" in tls and "keyFile" in tls)
            has_token = bool(ep.get("bearerTokenFile"))
            if not (client_ca and has_cert) and not (ct.token_webhook and has_token):
                bad(f"ServiceMonitor {sm['metadata']['name']} must present what {what} accepts: "
                    f"a client certificate (--client-ca-file) or a token (--authentication-token-webhook)")
            # A token sent to whoever answers is a token given away.
            if verify_server and (tls.get("insecureSkipVerify") or not ("caFile" in tls or "ca" in tls)):
                bad(f"ServiceMonitor {sm['metadata']['name']} must verify the serving certificate (caFile or ca, no insecureSkipVerify)")
    if svc is None:
        bad(f"{what}: no Service")
    elif [p["port"] for p in svc["spec"]["ports"]] != [9745]:
        bad(f"Service {svc['metadata']['name']} must expose port 9745")


def check_daemonset(ds, bad):
    what = "the DaemonSet"
    ct = Container(ds)
    pod, c = ct.pod, ct.c
    if pod.get("hostNetwork") is not True:
        bad("the DaemonSet must use the host network")
    if {"operator": "Exists"} not in pod.get("tolerations", []):
        bad("the DaemonSet must tolerate every taint (a toleration with only operator: Exists)")
    if pod.get("priorityClassName") != "system-node-critical":
        bad("the DaemonSet must run as system-node-critical")
    if pod.get("dnsPolicy") != "ClusterFirstWithHostNet":
        bad("a host-network pod needs dnsPolicy ClusterFirstWithHostNet")
    # Listening: the node's own address from the downward API, never a wildcard.
    check_listen(what, ds, ct, "HOST_IP", "status.hostIP", bad)
    if ct.field("NODE_NAME") != "spec.nodeName" or ct.value("KUBELET_CA_AGENT_NODE_NAME") != "$(NODE_NAME)":
        bad("the node name must come from the downward API spec.nodeName")
    check_control_plane_excluded(pod, bad)
    # Host directories, never the bundle file.
    bundle = ct.value("KUBELET_CA_AGENT_BUNDLE") or "/etc/kubernetes/kubelet-ca.crt"
    host = {v["name"]: v["hostPath"] for v in pod.get("volumes", []) if "hostPath" in v}
    for name, hp in host.items():
        if hp.get("type") not in ("Directory", "DirectoryOrCreate"):
            bad(f"hostPath volume {name} ({hp['path']}) must be of type Directory or DirectoryOrCreate")
        if hp["path"].rstrip("/") == bundle or hp["path"].endswith((".crt", ".pem")):
            bad(f"hostPath volume {name} mounts the file {hp['path']}: a bind-mounted file cannot be replaced by rename")
    mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
    for name in host:
        m = mounts.get(name)
        if m and m.get("subPath"):
            bad(f"volume {name} is mounted with subPath: mount the directory")
    mounted = {mounts[n]["mountPath"].rstrip("/"): host[n]["path"].rstrip("/") for n in host if n in mounts}
    for needed in ("/etc/kubernetes", "/var/lib/kubelet-ca-agent"):
        if mounted.get(needed) != needed:
            bad(f"the host directory {needed} must be mounted at {needed}")
    bundle_dir = bundle.rsplit("/", 1)[0]
    if bundle_dir not in mounted:
        bad(f"the bundle's directory {bundle_dir} is not a mounted host directory")
    # Each managed kubeconfig's directory, mounted as itself (it is replaced by rename).
    kubeconfigs = [item.partition("=")[0].strip()
                   for item in (ct.value("KUBELET_CA_AGENT_MANAGE_KUBECONFIG") or "").split(";") if item.strip()]
    for path in kubeconfigs:
        directory = path.rsplit("/", 1)[0]
        if mounted.get(directory) != directory and not any(
                directory.startswith(m + "/") and mounted[m] == m for m in mounted):
            bad(f"the managed kubeconfig {path}: its directory {directory} must be a host directory mounted as itself")
    check_host_paths(ct, host, mounts, mounted, bad)
    check_kubelet_restart(ct, kubeconfigs, host, mounts, mounted, bad)
    check_container_basics(what, ct, bad)
    if not set(c.get("securityContext", {}).get("capabilities", {}).get("add", [])) <= {"CHOWN"}:
        bad(f"capabilities beyond CHOWN: {c['securityContext']['capabilities'].get('add')}")
    # The node agents check the scraper's client certificate against the kubelet's
    # client CA (or, with the webhook component, its token).
    if not ct.value("KUBELET_CA_AGENT_CLIENT_CA_FILE"):
        bad("--client-ca-file must be set: /metrics is scraped with a client certificate")
    return ct


def overlaps(path, other):
    """`path` is `other`, under it, or a directory above it."""
    return path == other or path.startswith(other + "/") or other.startswith(path.rstrip("/") + "/") or path == "/"


def kubelet_credentials(ct):
    """The opt-in of components/kubelet-credentials: the report with the kubelet's own
    credentials (clusters before Kubernetes 1.30)."""
    return bool(ct.value("KUBELET_CA_AGENT_REPORT_KUBECONFIG"))


def check_host_paths(ct, host, mounts, mounted, bad):
    """SPEC 13: only the host directories the agent needs, nothing of the kubelet's, etcd's
    or systemd's, and the control plane's secrets under /etc/kubernetes masked."""
    for name, hp in host.items():
        path = hp["path"].rstrip("/") or "/"
        secret = next((p for p in SECRET_HOST_PATHS if overlaps(path, p)), None)
        if path == KUBELET_PKI and kubelet_credentials(ct):
            # components/kubelet-credentials: the kubelet's key, read-only, for its report.
            if not (mounts.get(name, {}).get("readOnly") is True):
                bad(f"hostPath volume {name} ({path}): the kubelet's key must be mounted read-only")
        elif path == KUBELET_PKI:
            bad(f"hostPath volume {name} mounts {path}, the kubelet's key: the report goes through the pod's own token "
                f"(only components/kubelet-credentials, for clusters before 1.30, mounts it, with KUBELET_CA_AGENT_REPORT_KUBECONFIG)")
        elif secret:
            bad(f"hostPath volume {name} mounts {path}, which is or holds {secret}: never mounted in the agent's pod (SPEC 13)")
        elif path not in ALLOWED_HOST_PATHS:
            bad(f"hostPath volume {name} mounts {path}, which the agent does not need (allowed: {', '.join(sorted(ALLOWED_HOST_PATHS))})")
    if kubelet_credentials(ct) and mounted.get(KUBELET_PKI) != KUBELET_PKI:
        bad(f"KUBELET_CA_AGENT_REPORT_KUBECONFIG is set (components/kubelet-credentials) without {KUBELET_PKI} mounted read-only as itself")
    # The masks: an empty read-only directory (emptyDir) mounted over each of MASKED,
    # wherever the host's /etc/kubernetes is mounted.
    volumes = {v["name"]: v for v in ct.pod.get("volumes", [])}
    for mount_path, host_path in mounted.items():
        for masked in MASKED:
            if not masked.startswith(host_path + "/"):
                continue
            inside = mount_path + masked[len(host_path):]
            mask = next((m for m in mounts.values() if m["mountPath"].rstrip("/") == inside), None)
            if mask is None:
                bad(f"{masked} (the control plane's {'CA keys' if masked.endswith('pki') else 'static pod manifests'}) "
                    f"must be masked: mount an empty read-only volume (emptyDir) at {inside}")
            elif "emptyDir" not in volumes.get(mask["name"], {}) or mask.get("readOnly") is not True or mask.get("subPath"):
                bad(f"the mask at {inside} must be an emptyDir volume mounted readOnly: true, not {mask['name']}")
    if ct.value("DBUS_SYSTEM_BUS_ADDRESS"):
        bad("DBUS_SYSTEM_BUS_ADDRESS is set: the agent's pod never talks to systemd's bus")


def check_kubelet_restart(ct, kubeconfigs, host, mounts, mounted, bad):
    """The kubelet learns a kubeconfig's new CA data only when it restarts. The pod has no
    bus, shell or host PID namespace: it writes a request into a host directory that the
    host's path unit (kubelet-ca-agent-kubelet-restart.path) takes. Only where a managed
    kubeconfig is one the kubelet reads while it runs: the restart is a privilege too."""
    for gone in ("KUBELET_CA_AGENT_KUBECONFIG_RESTART_UNIT", "KUBELET_CA_AGENT_KUBECONFIG_HOOK"):
        if ct.value(gone):
            bad(f"{gone} is set: the DaemonSet restarts the kubelet through KUBELET_CA_AGENT_KUBECONFIG_RESTART_REQUEST and the host's path unit, never over the bus or by a hook")
    request = ct.value("KUBELET_CA_AGENT_KUBECONFIG_RESTART_REQUEST")
    needs = [k for k in kubeconfigs if k in KUBELET_KUBECONFIGS]
    if needs:
        if request != RESTART_DIR:
            bad(f"the managed kubeconfig {needs[0]} needs the kubelet's restart: set KUBELET_CA_AGENT_KUBECONFIG_RESTART_REQUEST to {RESTART_DIR}, not {request!r}")
        if mounted.get(RESTART_DIR) != RESTART_DIR:
            bad(f"the kubelet's restart request needs the host directory {RESTART_DIR} mounted as itself (hostPath, DirectoryOrCreate)")
        elif any(m.get("readOnly") for m in mounts.values() if m["mountPath"].rstrip("/") == RESTART_DIR):
            bad(f"{RESTART_DIR} must be mounted read-write: the agent writes its request there")
    elif request or RESTART_DIR in mounted.values():
        bad(f"KUBELET_CA_AGENT_KUBECONFIG_RESTART_REQUEST or the host directory {RESTART_DIR} without a managed kubeconfig that the kubelet reads while it runs ({', '.join(KUBELET_KUBECONFIGS)}): the restart is a privilege, leave it out")


def check_control_plane_excluded(pod, bad):
    """The DaemonSet never runs on a control-plane node (its /etc/kubernetes holds the admin
    kubeconfigs, which only file masks could hide): every required node-selector term
    excludes both control-plane labels. Those nodes run the systemd unit."""
    terms = (pod.get("affinity", {}).get("nodeAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
    excluded = bool(terms) and all(
        all({"key": label, "operator": "DoesNotExist"} in [
            {k: e.get(k) for k in ("key", "operator")} for e in t.get("matchExpressions", [])]
            for label in CONTROL_PLANE_LABELS)
        for t in terms)
    if not excluded or any(label in pod.get("nodeSelector", {}) for label in CONTROL_PLANE_LABELS):
        bad("the DaemonSet must not run on control-plane nodes: a required node affinity with "
            + " and ".join(f"{label} DoesNotExist" for label in CONTROL_PLANE_LABELS)
            + " in every term (control-plane nodes run systemd/kubelet-ca-agent.service)")


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def check_publisher(dep, docs, bad):
    """The cluster-side publisher: pod network, no host access, nothing privileged, two
    replicas spread over nodes, a PodDisruptionBudget, its own service account."""
    what = "the publisher"
    ct = Container(dep)
    pod, c = ct.pod, ct.c
    labels = dep["spec"]["template"]["metadata"].get("labels", {})
    if dep["spec"].get("replicas", 1) < 2:
        bad("the publisher must run two replicas (or more)")
    if pod.get("serviceAccountName") != PUBLISHER:
        bad(f"the publisher must run as its own service account {PUBLISHER}, not {pod.get('serviceAccountName')!r}")
    if pod.get("priorityClassName") != "system-cluster-critical":
        bad("the publisher must run as system-cluster-critical")
    if pod.get("hostNetwork"):
        bad("the publisher must use the pod network, not the host network")
    if any("hostPath" in v for v in pod.get("volumes", [])):
        bad("the publisher must mount no host directory")
    if any("hostPort" in p for p in c.get("ports", [])):
        bad("the publisher must use no host port")
    if (c.get("args") or [None])[0] != "publish":
        bad(f"the publisher's container must run `publish`, not {c.get('args')!r}")
    flags = " ".join(c.get("args", []) + c.get("command", []))
    for flag in ("--to", "--source"):
        if flag in flags:
            bad(f"the publisher: set {flag} in env (KUBELET_CA_AGENT_...), where overlays patch it and this check reads it")
    check_listen(what, dep, ct, "POD_IP", "status.podIP", bad)
    check_container_basics(what, ct, bad)
    sc, psc = c.get("securityContext", {}), pod.get("securityContext", {})
    if c.get("securityContext", {}).get("capabilities", {}).get("add"):
        bad(f"the publisher needs no capability: {sc['capabilities']['add']}")
    if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")) or 0 in (sc.get("runAsUser"), psc.get("runAsUser")):
        bad("the publisher must run as non-root (runAsNonRoot: true, no runAsUser 0)")
    scc = dep["spec"]["template"]["metadata"].get("annotations", {}).get("openshift.io/required-scc")
    if scc == AGENT:
        bad("the publisher must not use the node agents' SecurityContextConstraints")
    # Replicas on different nodes where there are several (preferred is enough).
    spread = any(t.get("topologyKey") == "kubernetes.io/hostname" and selects(t.get("labelSelector"), labels)
                 for t in pod.get("topologySpreadConstraints", []))
    anti = pod.get("affinity", {}).get("podAntiAffinity", {})
    terms = [t.get("podAffinityTerm", {}) for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
    terms += anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    spread = spread or any(t.get("topologyKey") == "kubernetes.io/hostname" and selects(t.get("labelSelector"), labels)
                           for t in terms)
    if not spread:
        bad("the publisher's replicas must be spread over nodes (pod anti-affinity or a topology spread on kubernetes.io/hostname)")
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget" and selects(d["spec"].get("selector"), labels)]
    if len(pdbs) != 1:
        bad(f"the publisher needs one PodDisruptionBudget selecting its pods, not {len(pdbs)}")
    else:
        spec = pdbs[0]["spec"]
        if spec.get("minAvailable") != 1:
            bad(f"the publisher's PodDisruptionBudget must keep minAvailable 1, not {spec.get('minAvailable')!r}")
        # Readiness follows the ConfigMap's state: unready publishers must not block drains.
        if spec.get("unhealthyPodEvictionPolicy") != "AlwaysAllow":
            bad("the publisher's PodDisruptionBudget must let unready pods be evicted (unhealthyPodEvictionPolicy: AlwaysAllow)")
    to = ct.value("KUBELET_CA_AGENT_TO")
    if not to:
        bad("the publisher must name its ConfigMap (KUBELET_CA_AGENT_TO)")
    return ct


def check_rbac(docs, allowed, bad, required=None):
    """Each of our service accounts may do exactly what `allowed` says, by resourceNames,
    and nothing else; roles bound to anyone else only read in our namespace.

    allowed: {subject: (needed, specials)} with needed = {(ns or None, group, resource,
    name): verbs}, which must be granted in full and never exceeded, and specials = the
    unnamed rules ((group, resource, verbs, ns: the RoleBinding's namespace, None for a
    ClusterRoleBinding)) it may have besides. required: the specials a subject must have
    (the node report's), {subject: {special}}."""
    roles = {(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    check_node_writes(docs, roles, bad)
    granted = {subject: {} for subject in allowed}
    granted_specials = {subject: set() for subject in allowed}
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        ref = b["roleRef"]
        bns = b["metadata"].get("namespace")
        role = roles.get((ref["kind"], ref["name"], bns if ref["kind"] == "Role" else None))
        if role is None:
            bad(f"{b['kind']} {b['metadata']['name']} refers to {ref['kind']} {ref['name']}, which is not in the manifests")
            continue
        ours = [s for s in ((s["kind"], s["name"], s.get("namespace")) for s in b.get("subjects", [])) if s in allowed]
        ns = bns if b["kind"] == "RoleBinding" else None
        for rule in role.get("rules", []):
            verbs = set(rule.get("verbs", []))
            groups, resources = rule.get("apiGroups", []), rule.get("resources", [])
            names = rule.get("resourceNames", [])
            desc = f"{role['kind']} {role['metadata']['name']}: {rule}"
            if "*" in verbs | set(groups) | set(resources) | set(names) or rule.get("nonResourceURLs"):
                bad(f"wildcard or non-resource rule in {desc}")
                continue
            if not ours:
                # Someone else's role (the platform Prometheus): read-only, in our namespaces.
                if not verbs <= READ or role["kind"] != "Role" or bns not in (NS, PUBLISHER_NS):
                    bad(f"a role for another subject grants more than reading in {NS} or {PUBLISHER_NS}: {desc}")
                continue
            for subject in ours:
                needed, specials = allowed[subject]
                who = subject[1]
                # No node agent reads the ControllerConfig: its spec carries the cluster's
                # internal registry pull secret (the publisher reads it, once).
                if subject == SA and "controllerconfigs" in resources:
                    bad(f"{who}: the node agents must have no access to controllerconfigs (their spec carries the cluster's pull secret; the publisher derives what nodes need): {desc}")
                    continue
                if not names:
                    match = next((sp for sp in specials if set(groups) == {sp[0]} and resources == [sp[1]]
                                  and verbs == sp[2] and sp[3] == ns), None)
                    if match is None:
                        bad(f"{who}: a rule without resourceNames that it has no use for: {desc}")
                    else:
                        granted_specials[subject].add(match)
                    continue
                for g in groups:
                    for r in resources:
                        for n in names:
                            grant = (ns, g, r, n)
                            if grant not in needed:
                                bad(f"{who}: grants {r}/{n} (group {g!r}) in {ns or 'the cluster'}, which it does not need: {desc}")
                                continue
                            if not verbs <= needed[grant]:
                                bad(f"{who}: grants {sorted(verbs - needed[grant])} on {r}/{n}, more than {sorted(needed[grant])}: {desc}")
                            granted[subject].setdefault(grant, set()).update(verbs & needed[grant])
    for subject, (needed, _) in allowed.items():
        for grant, verbs in needed.items():
            missing = verbs - granted[subject].get(grant, set())
            if missing:
                bad(f"{subject[1]}: {grant} lacks {sorted(missing)} (needs exactly {sorted(verbs)})")
        for group, resource, verbs, ns in (required or {}).get(subject, ()):
            if (group, resource, verbs, ns) not in granted_specials[subject]:
                bad(f"{subject[1]}: the node report needs {sorted(verbs)} on {resource} in {ns or 'the cluster'} "
                    f"(KUBELET_CA_AGENT_REPORT_KUBECONFIG unset: it writes with the pod's own token)")


def check_node_writes(docs, roles, bad):
    """A role bound to a ServiceAccount may write nodes (or nodes/*) only beside a
    ValidatingAdmissionPolicy that confines that ServiceAccount to the Node its token
    names (SPEC 8c): RBAC alone would let it write every Node."""
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        accounts = [s for s in b.get("subjects", []) if s.get("kind") == "ServiceAccount"]
        if not accounts:
            continue
        ref = b["roleRef"]
        role = roles.get((ref["kind"], ref["name"], b["metadata"].get("namespace") if ref["kind"] == "Role" else None))
        for rule in (role or {}).get("rules", []):
            groups, resources = set(rule.get("apiGroups", [])), set(rule.get("resources", []))
            on_nodes = ("" in groups or "*" in groups) and (
                "*" in resources or any(r == "nodes" or r.startswith("nodes/") for r in resources))
            writes = set(rule.get("verbs", [])) & NODE_WRITES
            if not (on_nodes and writes):
                continue
            for account in accounts:
                user = f"system:serviceaccount:{account.get('namespace')}:{account['name']}"
                why = per_node_policy(docs, user, "nodes", "UPDATE", "kubelet-ca-agent/held")
                if why:
                    bad(f"{b['kind']} {b['metadata']['name']} grants {sorted(writes)} on nodes to {user} "
                        f"({role['kind']} {role['metadata']['name']}) without a policy that confines it to its own Node: {why}")


def user_condition(policy, user):
    """Whether the policy's matchConditions hold it to `user`'s requests (and them only)."""
    want = f"request.userInfo.username == '{user}'"
    return any(re.sub(r"\s+", " ", c.get("expression", "")).replace('"', "'").strip() == want
               for c in policy["spec"].get("matchConditions", []))


def per_node_policy(docs, user, resource, operation, must_mention):
    """None when a ValidatingAdmissionPolicy, with failurePolicy Fail and its binding
    (validationActions Deny, nothing that narrows what it sees), matches `user`'s
    `operation`s on core `resource` and decides by the node its token names; else why not."""
    def covers(policy):
        rules = policy["spec"].get("matchConstraints", {}).get("resourceRules", [])
        return any(({"", "*"} & set(r.get("apiGroups", []))) and ({resource, "*"} & set(r.get("resources", [])))
                   and ({operation, "*"} & set(r.get("operations", []))) for r in rules)
    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and covers(d)]
    if not policies:
        return f"no ValidatingAdmissionPolicy matches {operation} on {resource}"
    policies = [d for d in policies if user_condition(d, user)]
    if not policies:
        return (f"no ValidatingAdmissionPolicy of {operation} on {resource} has the matchCondition "
                f"request.userInfo.username == '{user}'")
    reasons = []
    for policy in policies:
        name, spec = policy["metadata"]["name"], policy["spec"]
        text = yaml.safe_dump(spec)
        bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["spec"].get("policyName") == name]
        if spec.get("failurePolicy") != "Fail":
            reasons.append(f"{name}: failurePolicy must be Fail (a policy that cannot decide must refuse)")
        elif spec.get("paramKind") or "authentication.kubernetes.io/node-name" not in text or must_mention not in text:
            reasons.append(f"{name}: does not decide by the token's authentication.kubernetes.io/node-name and {must_mention}")
        elif not any("Deny" in bd["spec"].get("validationActions", []) and not bd["spec"].get("matchResources")
                     and not bd["spec"].get("paramRef") for bd in bindings):
            reasons.append(f"{name}: no ValidatingAdmissionPolicyBinding with validationActions [Deny] and no matchResources")
        else:
            return None
    return "; ".join(reasons)


def check_pod_policy(docs, agent, bad):
    """The policy kubelet-ca-agent-pods (host paths, privilege of the namespace's pods):
    present (but where components/kubelet-credentials removed every policy, for clusters
    before 1.30), failing closed, bound to the agents' namespace, naming no host path
    beyond ALLOWED_HOST_PATHS, and admitting the rendered DaemonSet's."""
    name = "kubelet-ca-agent-pods"
    policy = next((d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == name), None)
    if policy is None:
        if not kubelet_credentials(agent):
            bad(f"no ValidatingAdmissionPolicy {name}: the namespace is privileged, and only it limits what its pods may mount")
        return
    spec = policy["spec"]
    if spec.get("failurePolicy") != "Fail":
        bad(f"ValidatingAdmissionPolicy {name}: failurePolicy must be Fail")
    allowed = next((v["expression"] for v in spec.get("variables", []) if v["name"] == "allowedHostPaths"), "")
    listed = set(re.findall(r"'([^']*)'", allowed))
    if not listed or not listed <= ALLOWED_HOST_PATHS:
        bad(f"ValidatingAdmissionPolicy {name}: its allowedHostPaths {sorted(listed)} must be within {sorted(ALLOWED_HOST_PATHS)}")
    used = {v["hostPath"]["path"] for v in agent.pod.get("volumes", []) if "hostPath" in v}
    if not used <= listed:
        bad(f"ValidatingAdmissionPolicy {name} would refuse the DaemonSet's own host paths {sorted(used - listed)}")
    binding = next((d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["spec"].get("policyName") == name), None)
    selector = ((binding or {}).get("spec", {}).get("matchResources", {}).get("namespaceSelector", {}).get("matchLabels", {}))
    if binding is None or "Deny" not in binding["spec"].get("validationActions", []) or selector != {"kubernetes.io/metadata.name": NS}:
        bad(f"ValidatingAdmissionPolicy {name} needs a binding with validationActions [Deny] and the namespaceSelector kubernetes.io/metadata.name: {NS}")


def check_publisher_namespace(dep, docs, bad):
    """The publisher runs in a namespace of its own at the restricted Pod Security level
    (enforce, audit, warn), and its pod satisfies that level."""
    ns = dep["metadata"].get("namespace")
    if ns != PUBLISHER_NS:
        bad(f"the publisher must run in its own namespace {PUBLISHER_NS}, not {ns!r} (the node agents' is privileged)")
    namespace = next((d for d in docs if d["kind"] == "Namespace" and d["metadata"]["name"] == ns), None)
    labels = (namespace or {}).get("metadata", {}).get("labels", {})
    for mode in ("enforce", "audit", "warn"):
        if labels.get(f"pod-security.kubernetes.io/{mode}") != "restricted":
            bad(f"the publisher's namespace {ns} must be labelled pod-security.kubernetes.io/{mode}: restricted")
    pod = dep["spec"]["template"]["spec"]
    for v in pod.get("volumes", []):
        kind = next((k for k in v if k != "name"), None)
        if kind not in RESTRICTED_VOLUMES:
            bad(f"the publisher's volume {v['name']} ({kind}) is not one the restricted level admits")


def check(path):
    problems = []
    bad = lambda msg: problems.append(f"{path}: {msg}")
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
        schema = CRD_SCHEMAS.get((d["apiVersion"], d["kind"]))
        if schema:
            for e in jsonschema.Draft7Validator(schema).iter_errors(d):
                bad(f"{d['kind']} {d['metadata']['name']}: {'/'.join(map(str, e.path))}: {e.message}")
    named = lambda kind, name: next((d for d in by_kind.get(kind, []) if d["metadata"]["name"] == name), None)

    # --- The node agents ------------------------------------------------------------
    (ds,) = by_kind["DaemonSet"]
    agent = check_daemonset(ds, bad)
    check_scrape("the DaemonSet", agent, named("ServiceMonitor", AGENT), named("Service", AGENT), bad,
                 verify_server=False)
    agent_sources = agent.sources(DEFAULT_AGENT_SOURCE)
    for spec in agent_sources + agent.other_sources():
        if spec.startswith("controllerconfig:"):
            bad(f"the node agents must not read the ControllerConfig ({spec}): its spec carries the cluster's "
                f"internal registry pull secret; read the ConfigMap the publisher derives (overlays/openshift-publisher)")
    agent_specials = set()
    agent_needed = {g: READ for g in map(source_grants, agent_sources + agent.other_sources())
                    if g and g[2] != "controllerconfigs"}
    # On OpenShift, `use` of the node agents' SecurityContextConstraints, by name.
    if named("SecurityContextConstraints", AGENT) is not None:
        agent_needed[(NS, "security.openshift.io", "securitycontextconstraints", AGENT)] = {"use"}
    if agent.token_webhook:
        agent_specials.add(("authentication.k8s.io", "tokenreviews", frozenset({"create"}), None))
    if agent.access_webhook and not agent.allow_list:
        agent_specials.add(("authorization.k8s.io", "subjectaccessreviews", frozenset({"create"}), None))
    # The node report with the pod's own token (SPEC 8c): get and patch on nodes, create
    # on Events in default, which check_node_writes and the events' policy confine to the
    # token's own Node. With components/kubelet-credentials it goes through the kubelet's
    # credentials instead, and the service account has neither.
    required = {}
    report_off = agent.flag("KUBELET_CA_AGENT_NO_NODE_REPORT")
    if not kubelet_credentials(agent):
        agent_specials |= {NODE_REPORT, NODE_EVENTS}
        if not report_off:
            required[SA] = {NODE_REPORT, NODE_EVENTS}
            why = per_node_policy(docs, f"system:serviceaccount:{NS}:{AGENT}", "events", "CREATE", "involvedObject")
            if why:
                bad(f"the agents' Events need a policy that confines them to the token's own Node: {why}")
    check_pod_policy(docs, agent, bad)
    allowed = {SA: (agent_needed, agent_specials)}

    # --- The publisher, when there is one -------------------------------------------
    deployments = by_kind.get("Deployment", [])
    if [d["metadata"]["name"] for d in deployments] not in ([], [PUBLISHER]):
        bad(f"unexpected Deployments: {[d['metadata']['name'] for d in deployments]}")
    dep = named("Deployment", PUBLISHER)
    if dep is not None:
        pub = check_publisher(dep, docs, bad)
        check_scrape("the publisher", pub, named("ServiceMonitor", PUBLISHER), named("Service", PUBLISHER), bad,
                     verify_server=True)
        pub_sources = pub.sources(DEFAULT_PUBLISHER_SOURCE) + [
            s for var in ("KUBELET_CA_AGENT_CLOUD_CA_SOURCE", "KUBELET_CA_AGENT_REGISTRY_SOURCE",
                          "KUBELET_CA_AGENT_KUBECONFIG_CA_SOURCE")
            for s in (pub.value(var) or "").split(",") if s]
        needed = {g: READ for g in map(source_grants, pub_sources) if g}
        to = pub.value("KUBELET_CA_AGENT_TO") or ""
        if to.count("/") in (1, 2):
            tns, tname, tkey = configmap_key(to)
            needed[(tns, "", "configmaps", tname)] = PUBLISH
            # The node agents read what the publisher writes, and only that.
            if [configmap_key(s) if s.startswith("configmap:") else s for s in agent_sources] != [(tns, tname, tkey)]:
                bad(f"the node agents must read the publisher's ConfigMap {to} (key {tkey}) and only it, not {agent_sources}")
            # Their other files come from the same ConfigMap, from the keys the publisher keeps.
            for spec in agent.other_sources():
                _, _, key = configmap_key(spec) if spec.startswith("configmap:") else (None, None, None)
                if not spec.startswith(f"configmap:{tns}/{tname}/") or key not in ("cloud-ca.pem", "registry.*", "kubeconfig-ca.crt"):
                    bad(f"the node agents' other CA files must come from the publisher's ConfigMap {to} (keys cloud-ca.pem, registry.*, kubeconfig-ca.crt), not {spec}")
        # The rollout gate: one metadata watch on every Node (SPEC 8c), reading only.
        specials = {("", "nodes", frozenset(READ), None)}
        if pub.token_webhook:
            specials.add(("authentication.k8s.io", "tokenreviews", frozenset({"create"}), None))
        if pub.access_webhook and not pub.allow_list:
            specials.add(("authorization.k8s.io", "subjectaccessreviews", frozenset({"create"}), None))
        allowed[PUBLISHER_SA] = (needed, specials)
        check_publisher_namespace(dep, docs, bad)
        for scc in by_kind.get("SecurityContextConstraints", []):
            if scc.get("groups") or f"system:serviceaccount:{PUBLISHER_NS}:{PUBLISHER}" in (scc.get("users") or []):
                bad(f"SecurityContextConstraints {scc['metadata']['name']} must not be given to the publisher (or to groups)")
    elif named("ServiceAccount", PUBLISHER) is not None:
        bad("the publisher's service account is here without its Deployment")

    # --- RBAC: what each service account may do -------------------------------------
    check_rbac(docs, allowed, bad, required)
    return problems


def main():
    problems = [p for path in sys.argv[1:] for p in check(path)]
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"manifests: {len(sys.argv) - 1} renderings pass the DaemonSet, publisher, RBAC, policy, scrape and custom-resource checks")


if __name__ == "__main__":
    main()
