#!/usr/bin/env python3
"""Checks the rendered deploy/ manifests (one YAML stream per kustomization) beyond their
schemas: what SPEC section 10 and issue 9 require of the DaemonSet, of the publisher's
Deployment when a rendering has one (SPEC 8b), least-privilege RBAC for each of the two
service accounts against what it is configured to read and write, the scrape
configuration, and the fields of the custom resources (ServiceMonitor, PrometheusRule,
SecurityContextConstraints) that kubernetes-validate has no schema for.

usage: check-manifests.py RENDERED.yaml...   (exit 1 with one line per problem)
"""
import re
import sys

import jsonschema
import yaml

NS = "kubelet-ca-agent"
AGENT = "kubelet-ca-agent"
PUBLISHER = "kubelet-ca-agent-publisher"
SA = ("ServiceAccount", AGENT, NS)
PUBLISHER_SA = ("ServiceAccount", PUBLISHER, NS)
READ = {"get", "list", "watch"}
# Writing a Node is the node's own business (its kubelet's credentials, under the Node
# authorizer and NodeRestriction): no ServiceAccount may be granted any of these on nodes
# (SPEC 8c), whatever else the checks below allow.
NODE_WRITES = {"patch", "update", "create", "delete", "deletecollection", "*"}
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
    # The kubelet learns new CA data only when it restarts: a DaemonSet that manages a
    # kubeconfig restarts it through systemd's D-Bus API, on the host's system bus.
    if kubeconfigs:
        unit = ct.value("KUBELET_CA_AGENT_KUBECONFIG_RESTART_UNIT")
        if not unit:
            bad("a DaemonSet that manages kubeconfigs must set KUBELET_CA_AGENT_KUBECONFIG_RESTART_UNIT (it has no shell for a hook)")
        if ct.value("KUBELET_CA_AGENT_KUBECONFIG_HOOK"):
            bad("the image has no shell or systemctl: use KUBELET_CA_AGENT_KUBECONFIG_RESTART_UNIT, not a hook")
        bus = (ct.value("DBUS_SYSTEM_BUS_ADDRESS") or "unix:path=/run/dbus/system_bus_socket").removeprefix("unix:path=")
        if mounted.get(bus.rsplit("/", 1)[0]) != "/run/dbus":
            bad(f"the restart needs the host's /run/dbus mounted where {bus} is")
    check_container_basics(what, ct, bad)
    if not set(c.get("securityContext", {}).get("capabilities", {}).get("add", [])) <= {"CHOWN"}:
        bad(f"capabilities beyond CHOWN: {c['securityContext']['capabilities'].get('add')}")
    # The node agents check the scraper's client certificate against the kubelet's
    # client CA (or, with the webhook component, its token).
    if not ct.value("KUBELET_CA_AGENT_CLIENT_CA_FILE"):
        bad("--client-ca-file must be set: /metrics is scraped with a client certificate")
    return ct


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


def check_rbac(docs, allowed, bad):
    """Each of our service accounts may do exactly what `allowed` says, by resourceNames,
    and nothing else; roles bound to anyone else only read in our namespace.

    allowed: {subject: (needed, specials)} with needed = {(ns or None, group, resource,
    name): verbs}, which must be granted in full and never exceeded, and specials = the
    unnamed rules ((group, resource, verbs)) it may have besides."""
    roles = {(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    check_node_writes(docs, roles, bad)
    granted = {subject: {} for subject in allowed}
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
                # Someone else's role (the platform Prometheus): read-only, in our namespace.
                if not verbs <= READ or role["kind"] != "Role" or bns != NS:
                    bad(f"a role for another subject grants more than reading in {NS}: {desc}")
                continue
            for subject in ours:
                needed, specials = allowed[subject]
                who = subject[1]
                if not names:
                    if not any(set(groups) == {g} and resources == [r] and verbs == v for g, r, v in specials):
                        bad(f"{who}: a rule without resourceNames that it has no use for: {desc}")
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


def check_node_writes(docs, roles, bad):
    """No role bound to a ServiceAccount may write nodes (or nodes/status): a node agent
    writes its report with the kubelet's own credentials, and the cluster side only reads."""
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s.get("kind") == "ServiceAccount" for s in b.get("subjects", [])):
            continue
        ref = b["roleRef"]
        role = roles.get((ref["kind"], ref["name"], b["metadata"].get("namespace") if ref["kind"] == "Role" else None))
        for rule in (role or {}).get("rules", []):
            groups, resources = set(rule.get("apiGroups", [])), set(rule.get("resources", []))
            on_nodes = ("" in groups or "*" in groups) and (
                "*" in resources or any(r == "nodes" or r.startswith("nodes/") for r in resources))
            writes = set(rule.get("verbs", [])) & NODE_WRITES
            if on_nodes and writes:
                bad(f"{b['kind']} {b['metadata']['name']} grants {sorted(writes)} on nodes to a ServiceAccount ({role['kind']} {role['metadata']['name']}): a node writes its own report with its kubelet's credentials, never with a ServiceAccount's")


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
    agent_specials = set()
    agent_needed = {g: READ for g in map(source_grants, agent_sources + agent.other_sources()) if g}
    # On OpenShift, `use` of the node agents' SecurityContextConstraints, by name.
    if named("SecurityContextConstraints", AGENT) is not None:
        agent_needed[(NS, "security.openshift.io", "securitycontextconstraints", AGENT)] = {"use"}
    if agent.token_webhook:
        agent_specials.add(("authentication.k8s.io", "tokenreviews", frozenset({"create"})))
    if agent.access_webhook and not agent.allow_list:
        agent_specials.add(("authorization.k8s.io", "subjectaccessreviews", frozenset({"create"})))
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
        specials = {("", "nodes", frozenset(READ))}
        if pub.token_webhook:
            specials.add(("authentication.k8s.io", "tokenreviews", frozenset({"create"})))
        if pub.access_webhook and not pub.allow_list:
            specials.add(("authorization.k8s.io", "subjectaccessreviews", frozenset({"create"})))
        allowed[PUBLISHER_SA] = (needed, specials)
        for scc in by_kind.get("SecurityContextConstraints", []):
            if scc.get("groups") or f"system:serviceaccount:{NS}:{PUBLISHER}" in (scc.get("users") or []):
                bad(f"SecurityContextConstraints {scc['metadata']['name']} must not be given to the publisher (or to groups)")
    elif named("ServiceAccount", PUBLISHER) is not None:
        bad("the publisher's service account is here without its Deployment")

    # --- RBAC: what each service account may do -------------------------------------
    check_rbac(docs, allowed, bad)
    return problems


def main():
    problems = [p for path in sys.argv[1:] for p in check(path)]
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"manifests: {len(sys.argv) - 1} renderings pass the DaemonSet, publisher, RBAC, scrape and custom-resource checks")


if __name__ == "__main__":
    main()
