//! The shipped alerts and dashboard against the real thing: a Prometheus that scrapes a
//! running agent loads the PrometheusRules' rules (the node agents' and the publisher's,
//! whose metrics have the same names) and evaluates every one without error, every metric
//! the rules select exists, and every query of the Grafana dashboard returns data. A rule or panel on a metric name the agent does not export fails here.
//! (promtool's unit tests of each alert's logic run in scripts/check-ship.sh.)

mod common;

use base64::Engine;

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use time::Duration as Span;

use common::daemon::{Agent, eventually, wait_until};
use common::pki::{Algorithm, Signer};
use common::prometheus::Prometheus;
use common::{Node, require};

const SECOND: Duration = Duration::from_secs(1);
const RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/base/prometheusrule.yaml"
);
const PUBLISHER_RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/overlays/openshift-publisher/prometheusrule.yaml"
);
const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/base/dashboards/kubelet-ca-agent.json"
);

/// The rules file inside the PrometheusRule: everything under `spec:`, one level
/// (two spaces) less indented. Prometheus refuses the file if this is not exactly it.
fn rules_file(prometheus_rule: &str) -> String {
    let (_, spec) = prometheus_rule
        .split_once("\nspec:\n")
        .expect("a PrometheusRule with a spec");
    spec.lines()
        .map(|l| l.strip_prefix("  ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every PromQL expression of the dashboard's panels (rows included), with the panel's
/// title; Grafana's variables replaced as Grafana would with "All" selected.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(panels: &[Value], out: &mut Vec<(String, String)>) {
        for panel in panels {
            let title = panel["title"].as_str().unwrap_or("").to_string();
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"].as_str().expect("every target has an expr");
                let expr = expr
                    .replace("$__rate_interval", "1m")
                    .replace("$instance", ".*");
                out.push((title.clone(), expr));
            }
            walk(panel["panels"].as_array().map_or(&[], Vec::as_slice), out);
        }
    }
    let mut out = Vec::new();
    walk(dashboard["panels"].as_array().unwrap(), &mut out);
    out
}

/// The metric names an expression selects (`name{...}`).
fn selected_metrics(expr: &str) -> BTreeSet<String> {
    let bytes = expr.as_bytes();
    let mut names = BTreeSet::new();
    for (i, _) in expr.match_indices('{') {
        let start = bytes[..i]
            .iter()
            .rposition(|b| !(b.is_ascii_alphanumeric() || *b == b'_' || *b == b':'))
            .map_or(0, |p| p + 1);
        if start < i {
            names.insert(expr[start..i].to_string());
        }
    }
    names
}

fn result(answer: &Value) -> &[Value] {
    answer["data"]["result"]
        .as_array()
        .map_or(&[], Vec::as_slice)
}

/// Replaces `path` by rename, as producers should.
fn put(path: &Path, content: impl AsRef<[u8]>) {
    let staged = path.with_extension("staged");
    fs::write(&staged, content).unwrap();
    fs::rename(&staged, path).unwrap();
}

#[test]
fn every_alert_and_dashboard_query_evaluates_against_a_scraped_agent() {
    if !require(Prometheus::installed(), "prometheus is not installed") {
        return;
    }
    let node = Node::new();
    let signers = node.root().join("signers");
    fs::create_dir_all(&signers).unwrap();
    let (old, new) = (
        Signer::new("kube-csr-signer_@1000", Algorithm::P256),
        Signer::new("kube-csr-signer_@2000", Algorithm::P256),
    );
    put(&signers.join("a.crt"), old.pem());
    let source = format!("dir:{}", signers.display());
    // The kubelet's config, as kubeadm writes it once it is pointed at the bundle: the
    // series of KubeletCABundleNotUsedByKubelet is there (it is absent while the agent
    // cannot tell).
    let kubelet_config = node.root().join("kubelet-config.yaml");
    fs::write(
        &kubelet_config,
        format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\nauthentication:\n  x509:\n    clientCAFile: {}\n",
            node.bundle().display()
        ),
    )
    .unwrap();
    // A managed kubeconfig, in sync: the series of its alerts are there.
    let apiserver_ca = Signer::new("kube-apiserver-service-network-signer", Algorithm::P256);
    let kubeconfig = node.root().join("kubelet/kubeconfig");
    fs::create_dir_all(kubeconfig.parent().unwrap()).unwrap();
    fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:9\n    certificate-authority-data: {}\n",
            base64::engine::general_purpose::STANDARD.encode(apiserver_ca.pem())
        ),
    )
    .unwrap();
    let kubeconfig_source = node.root().join("apiserver-ca.pem");
    put(&kubeconfig_source, apiserver_ca.pem());
    let manage = format!(
        "{}=file:{}",
        kubeconfig.display(),
        kubeconfig_source.display()
    );
    let agent = Agent::start_with(
        &node,
        &[&source],
        &["--node-name", "node-a", "--manage-kubeconfig", &manage],
        |cmd| {
            cmd.env("KUBELET_CA_AGENT_KUBELET_CONFIG", &kubelet_config);
        },
    );
    wait_until(10 * SECOND, || node.holds(old.pem()));

    let rules = node.root().join("rules.yaml");
    fs::write(&rules, rules_file(&fs::read_to_string(RULES).unwrap())).unwrap();
    let publisher_rules = node.root().join("publisher-rules.yaml");
    fs::write(
        &publisher_rules,
        rules_file(&fs::read_to_string(PUBLISHER_RULES).unwrap()),
    )
    .unwrap();
    let scrape = format!(
        "- job_name: kubelet-ca-agent\n  static_configs:\n  - targets: ['127.0.0.1:{}']\n",
        agent.port
    );
    let prometheus = Prometheus::start(node.root(), &scrape, &[&rules, &publisher_rules]);
    assert!(
        prometheus.wait_targets_up(30 * SECOND),
        "the agent is not scraped: {} {}",
        prometheus.api("/api/v1/targets"),
        prometheus.log()
    );

    // What the dashboard shows, made to happen while Prometheus scrapes: a rotation (a
    // write, a sync duration), a repair, a rejected source update, a pass with no valid
    // certificate (a sync error).
    put(&signers.join("b.crt"), new.pem());
    let both = format!("{}{}", old.pem(), new.pem());
    wait_until(10 * SECOND, || node.holds(&both));
    put(&node.bundle(), new.pem());
    wait_until(10 * SECOND, || node.holds(&both));
    put(
        &signers.join("c.crt"),
        format!("{}{}", new.pem(), new.key_pem()),
    );
    agent.wait_sample(
        10 * SECOND,
        "kubelet_ca_source_errors_total",
        &[("source", &source), ("reason", "private_key")],
        |v| v >= 1.0,
    );
    fs::remove_file(signers.join("c.crt")).unwrap();
    let expired = Signer::valid_between(
        "expired-signer",
        Algorithm::P256,
        Span::days(-30),
        Span::days(-1),
    );
    put(&signers.join("0-expired.crt"), expired.pem());
    fs::remove_file(signers.join("a.crt")).unwrap();
    fs::remove_file(signers.join("b.crt")).unwrap();
    agent.wait_sample(
        10 * SECOND,
        "kubelet_ca_sync_errors_total",
        &[
            ("filepath", &node.bundle().display().to_string()),
            ("reason", "no_valid_certificate"),
        ],
        |v| v >= 1.0,
    );
    put(&signers.join("a.crt"), old.pem());
    put(&signers.join("b.crt"), new.pem());
    fs::remove_file(signers.join("0-expired.crt")).unwrap();
    wait_until(10 * SECOND, || node.holds(&both));
    agent.wait_metric(
        10 * SECOND,
        &format!(
            "kubelet_ca_bundle_in_sync{{filepath=\"{}\"",
            node.bundle().display()
        ),
        1.0,
    );
    // Counters that appeared meanwhile need two scrapes for a rate.
    std::thread::sleep(4 * SECOND);

    // The rules: loaded, and every one evaluated by Prometheus without error.
    let mut evaluated = Value::Null;
    let healthy = eventually(20 * SECOND, || {
        evaluated = serde_json::from_str(&prometheus.api("/api/v1/rules")).unwrap_or(Value::Null);
        let rules: Vec<&Value> = evaluated["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .collect();
        !rules.is_empty()
            && rules.iter().all(|r| {
                r["health"] == "ok"
                    && r["lastEvaluation"]
                        .as_str()
                        .is_some_and(|t| !t.starts_with("0001"))
            })
    });
    assert!(
        healthy,
        "rules not loaded or not all healthy: {evaluated:#} {}",
        prometheus.log()
    );
    let mut failures = Vec::new();
    let mut alerts = 0;
    let groups = evaluated["data"]["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{evaluated:#}");
    for rule in groups.iter().flat_map(|g| g["rules"].as_array().unwrap()) {
        alerts += 1;
        let name = rule["name"].as_str().unwrap();
        let expr = rule["query"].as_str().unwrap();
        let answer = prometheus.query(expr);
        if answer["status"] != "success" {
            failures.push(format!("alert {name}: {answer}"));
        }
        for metric in selected_metrics(expr) {
            if result(&prometheus.query(&format!("count({metric})"))).is_empty() {
                failures.push(format!(
                    "alert {name} selects {metric}, which the agent does not export"
                ));
            }
        }
        // This agent is healthy again and its signers are young: nothing may be firing
        // (the publisher's absence, with no publisher here, is pending for 15 minutes).
        if name != "KubeletCABundleRepairedRepeatedly" && rule["state"] == "firing" {
            failures.push(format!(
                "alert {name} fires against a healthy agent: {rule}"
            ));
        }
    }
    assert!(alerts >= 12, "{evaluated:#}");

    // The dashboard: every query returns data.
    let dashboard: Value = serde_json::from_str(&fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() >= 15, "{queries:?}");
    // The fleet's panels show the publisher's series (SPEC 8c), and no publisher is scraped
    // here: their queries must evaluate, and tests/fleet_metrics.rs checks the series.
    const PUBLISHER_ONLY: &[&str] = &[
        "kubelet_ca_fleet_nodes",
        "kubelet_ca_fleet_certificate_missing_nodes",
    ];
    for (title, expr) in &queries {
        let answer = prometheus.query(expr);
        let publishers = PUBLISHER_ONLY.iter().any(|m| expr.contains(m));
        if answer["status"] != "success" {
            failures.push(format!("panel {title:?}: {expr}: {answer}"));
        } else if result(&answer).is_empty() && !publishers {
            failures.push(format!("panel {title:?} shows no data: {expr}"));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(query) = variable["query"]["query"].as_str() {
            let selector = query
                .strip_prefix("label_values(")
                .and_then(|q| q.rsplit_once(','))
                .map(|(s, _)| s)
                .expect("label_values(selector, label)");
            if result(&prometheus.query(selector)).is_empty() {
                failures.push(format!(
                    "variable {} finds nothing: {query}",
                    variable["name"]
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    eprintln!(
        "{alerts} alert rules and {} dashboard queries evaluated against a scraped agent",
        queries.len()
    );
}
