#!/usr/bin/env python3
"""Checks the rendered deploy/ manifests (one YAML stream per kustomization) beyond their
schemas: what SPEC section 10 and issue 9 require of the DaemonSet, least-privilege RBAC
against the sources the agent is configured with, the scrape configuration, and the
fields of the custom resources (ServiceMonitor, PrometheusRule, SecurityContextConstraints)
that kubernetes-validate has no schema for.

usage: check-manifests.py RENDERED.yaml...   (exit 1 with one line per problem)
"""
import re
import sys

import jsonschema
import yaml

NS = "kubelet-ca-agent"
SA = ("ServiceAccount", "kubelet-ca-agent", NS)
READ = {"get", "list", "watch"}

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
        return (None, "machineconfiguration.openshift.io", "controllerconfigs", rest)
    return None  # file:, dir: need no API access


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

    # --- The DaemonSet --------------------------------------------------------------
    (ds,) = by_kind["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = c.get("env", [])
    envd = {e["name"]: e for e in env}
    value = lambda name: envd.get(name, {}).get("value")
    if pod.get("hostNetwork") is not True:
        bad("the DaemonSet must use the host network")
    if {"operator": "Exists"} not in pod.get("tolerations", []):
        bad("the DaemonSet must tolerate every taint (a toleration with only operator: Exists)")
    if pod.get("priorityClassName") != "system-node-critical":
        bad("the DaemonSet must run as system-node-critical")
    if pod.get("dnsPolicy") != "ClusterFirstWithHostNet":
        bad("a host-network pod needs dnsPolicy ClusterFirstWithHostNet")
    # Listening: the node's own address from the downward API, never a wildcard.
    field = lambda name: envd.get(name, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if field("HOST_IP") != "status.hostIP":
        bad("HOST_IP must come from the downward API status.hostIP")
    if value("KUBELET_CA_AGENT_LISTEN") != "$(HOST_IP):9745":
        bad(f"the agent must listen on $(HOST_IP):9745, not {value('KUBELET_CA_AGENT_LISTEN')!r}")
    if field("NODE_NAME") != "spec.nodeName" or value("KUBELET_CA_AGENT_NODE_NAME") != "$(NODE_NAME)":
        bad("the node name must come from the downward API spec.nodeName")
    text = yaml.safe_dump(ds)
    for wildcard in ("0.0.0.0", "[::]", "::/0"):
        if wildcard in text:
            bad(f"the DaemonSet mentions {wildcard}: it must never listen on a wildcard address")
    if "--listen" in " ".join(c.get("args", []) + c.get("command", [])):
        bad("--listen in the arguments would override the downward-API address")
    if value("KUBELET_CA_AGENT_INSECURE_METRICS") not in (None, "false"):
        bad("--insecure-metrics must not be set in a pod")
    # $(VAR) references resolve only to variables defined earlier in the list.
    seen = set()
    for e in env:
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
            if ref not in seen:
                bad(f"{e['name']} refers to $({ref}) before it is defined: it would stay literal")
        seen.add(e["name"])
    # Host directories, never the bundle file.
    bundle = value("KUBELET_CA_AGENT_BUNDLE") or "/etc/kubernetes/kubelet-ca.crt"
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
    # Probes, resources, and the container's confinement.
    for probe, health in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        got = c.get(probe, {}).get("httpGet", {}).get("path")
        if got != health:
            bad(f"{probe} must GET {health}, not {got!r}")
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory"):
            if r not in res.get(kind, {}):
                bad(f"resources.{kind}.{r} is missing")
    sc = c.get("securityContext", {})
    if sc.get("readOnlyRootFilesystem") is not True:
        bad("the root filesystem must be read-only")
    if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
        bad("no privilege escalation, not privileged")
    caps = sc.get("capabilities", {})
    if caps.get("drop") != ["ALL"]:
        bad("every capability must be dropped (drop: [ALL])")
    if not set(caps.get("add", [])) <= {"CHOWN"}:
        bad(f"capabilities beyond CHOWN: {caps.get('add')}")
    seccomp = (sc.get("seccompProfile") or pod.get("securityContext", {}).get("seccompProfile") or {})
    if seccomp.get("type") != "RuntimeDefault":
        bad("seccomp must be RuntimeDefault")
    if pod.get("hostPID") or pod.get("hostIPC"):
        bad("no host PID or IPC namespace")

    # --- Authentication of the scraper ----------------------------------------------
    webhook = value("KUBELET_CA_AGENT_AUTHENTICATION_TOKEN_WEBHOOK") == "true" or \
        value("KUBELET_CA_AGENT_AUTHORIZATION_WEBHOOK") == "true"
    if not value("KUBELET_CA_AGENT_CLIENT_CA_FILE"):
        bad("--client-ca-file must be set: /metrics is scraped with a client certificate")
    if not webhook and not (value("KUBELET_CA_AGENT_AUTHORIZED_USERS") or value("KUBELET_CA_AGENT_AUTHORIZED_GROUPS")):
        bad("without the webhooks, a static allow-list (--authorized-users/--authorized-groups) must be set")
    (sm,) = by_kind["ServiceMonitor"]
    for ep in sm["spec"]["endpoints"]:
        tls = ep.get("tlsConfig", {})
        if ep.get("scheme") != "https":
            bad("the ServiceMonitor must scrape over https")
        has_cert = ("cert" in tls and "keySecret" in tls) or ("certFile" in tls and "keyFile" in tls)
        if not has_cert and not (webhook and ep.get("bearerTokenFile")):
            bad("the ServiceMonitor must present a client certificate (or, with the webhooks, a token)")
    (svc,) = by_kind["Service"]
    if [p["port"] for p in svc["spec"]["ports"]] != [9745]:
        bad("the Service must expose port 9745")

    # --- RBAC: what the agent's service account may do ------------------------------
    sources = [s for s in (value("KUBELET_CA_AGENT_SOURCE") or
                           "configmap:openshift-config-managed/kube-apiserver-client-ca").split(",") if s]
    needed = {g for g in map(source_grants, sources) if g}
    roles = {(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    covered = set()
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        ref = b["roleRef"]
        bns = b["metadata"].get("namespace")
        role = roles.get((ref["kind"], ref["name"], bns if ref["kind"] == "Role" else None))
        ours = any((s["kind"], s["name"], s.get("namespace")) == SA for s in b.get("subjects", []))
        if role is None:
            bad(f"{b['kind']} {b['metadata']['name']} refers to {ref['kind']} {ref['name']}, which is not in the manifests")
            continue
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
            ns = bns if b["kind"] == "RoleBinding" else None
            if set(groups) == {"authentication.k8s.io"} and resources == ["tokenreviews"] and verbs == {"create"} and not names:
                if value("KUBELET_CA_AGENT_AUTHENTICATION_TOKEN_WEBHOOK") != "true":
                    bad(f"tokenreviews granted without --authentication-token-webhook: {desc}")
                continue
            if set(groups) == {"authorization.k8s.io"} and resources == ["subjectaccessreviews"] and verbs == {"create"} and not names:
                if value("KUBELET_CA_AGENT_AUTHORIZATION_WEBHOOK") != "true":
                    bad(f"subjectaccessreviews granted without --authorization-webhook: {desc}")
                continue
            if groups == ["security.openshift.io"] and resources == ["securitycontextconstraints"] and verbs == {"use"} and names == ["kubelet-ca-agent"]:
                continue
            if not names:
                bad(f"a rule without resourceNames: {desc}")
                continue
            if not verbs <= READ:
                bad(f"more than get, list, watch: {desc}")
            for g in groups:
                for r in resources:
                    for n in names:
                        grant = (ns, g, r, n)
                        if grant not in needed:
                            bad(f"grants {r}/{n} (group {g!r}) in {ns or 'the cluster'}, which no source needs: {desc}")
                        elif verbs == READ:
                            covered.add(grant)
    for g in needed - covered:
        bad(f"source object {g} is not readable (get, list, watch) by the agent's service account")
    return problems


def main():
    problems = [p for path in sys.argv[1:] for p in check(path)]
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"manifests: {len(sys.argv) - 1} renderings pass the DaemonSet, RBAC, scrape and custom-resource checks")


if __name__ == "__main__":
    main()
