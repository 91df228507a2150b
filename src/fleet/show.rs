//! How a [`Verdict`] is shown: the line `rollout wait` prints each time the count moves,
//! the table and the JSON of `rollout status`. Pure: text in, text out; everything that
//! came from a node was escaped by the verdict, and the names of the sources' certificates
//! are escaped here.

use serde_json::{Value, json};

use super::verdict::{Ca, Condition, NodeVerdict, Question, State, Target, Verdict};

/// `38 of 40 nodes hold kube-csr-signer_@1700000002 (sha256:ab12...)`: how many counted
/// nodes satisfy the condition, and what it is.
pub fn count_line(question: &Question, verdict: &Verdict) -> String {
    let (current, counted) = (verdict.count(State::Current), verdict.counted());
    let named = question.counted();
    let what = match &question.condition {
        Condition::Sources => format!("hold what the sources make ({})", certificates(named.len())),
        Condition::Add(_) => format!("hold {}", several(&named)),
        Condition::Remove(_) => format!("no longer hold {}", several(&named)),
    };
    let place = match &question.target {
        Target::Bundle => String::new(),
        target => format!(" in {target}"),
    };
    let left_out = match verdict.left_out {
        0 => String::new(),
        1 => "; 1 node being deleted is left out".to_string(),
        n => format!("; {n} nodes being deleted are left out"),
    };
    format!("{current} of {counted} nodes {what}{place}{left_out}")
}

fn certificates(n: usize) -> String {
    match n {
        1 => "1 certificate".to_string(),
        n => format!("{n} certificates"),
    }
}

/// The first certificate's label, and how many more there are.
fn several(cas: &[Ca]) -> String {
    match cas {
        [] => "nothing".to_string(),
        [one] => one.label(),
        [first, rest @ ..] => format!("{} and {} more", first.label(), rest.len()),
    }
}

/// `rollout status` as a table: the count, how many hold each certificate, then each node
/// that is not current, with what it lacks or still holds, since when, and why.
pub fn table(question: &Question, verdict: &Verdict) -> String {
    let mut out = count_line(question, verdict);
    out.push_str("\n\n");
    let rows: Vec<Vec<String>> = verdict
        .certificates
        .iter()
        .map(|c| vec![c.ca.label(), c.holding.to_string(), c.missing.to_string()])
        .collect();
    out.push_str(&columns(&["CERTIFICATE", "HOLDING", "MISSING"], &rows));
    out.push_str(&laggards(verdict));
    out
}

/// The nodes that are not current, as a table (nothing when every node is).
pub fn laggards(verdict: &Verdict) -> String {
    let rows: Vec<Vec<String>> = verdict.laggards().map(row).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut out = "\n".to_string();
    out.push_str(&columns(
        &["NODE", "STATE", "READY", "SINCE", "DETAILS"],
        &rows,
    ));
    out
}

fn row(node: &NodeVerdict) -> Vec<String> {
    let ready = match node.ready {
        Some(super::verdict::Ready::True) => "True",
        Some(super::verdict::Ready::False) => "False",
        Some(super::verdict::Ready::Unknown) => "Unknown",
        None => "-",
    };
    let mut details: Vec<String> = Vec::new();
    if !node.lacks.is_empty() {
        details.push(format!("lacks {}", labels(&node.lacks)));
    }
    if !node.still_holds.is_empty() {
        details.push(format!("still holds {}", labels(&node.still_holds)));
    }
    details.extend(node.why.iter().map(|w| w.message()));
    vec![
        node.name.clone(),
        node.state.as_str().to_string(),
        ready.to_string(),
        node.since.clone().unwrap_or_else(|| "-".into()),
        details.join("; "),
    ]
}

fn labels(cas: &[Ca]) -> String {
    cas.iter().map(Ca::label).collect::<Vec<_>>().join(", ")
}

/// Left-aligned columns two spaces apart, the last one unpadded.
fn columns(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for cells in std::iter::once(&header).chain(rows) {
        let last = cells.len() - 1;
        for (i, cell) in cells.iter().enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(cell);
                let pad = widths[i] - cell.chars().count() + 2;
                out.push_str(&" ".repeat(pad));
            }
        }
        out.push('\n');
    }
    out
}

/// `rollout status --output json`: one object, with a `nodes` array holding every counted
/// node.
pub fn json(question: &Question, verdict: &Verdict) -> Value {
    let (condition, cas) = match &question.condition {
        Condition::Sources => ("sources", question.sources.len()),
        Condition::Add(shas) => ("add", shas.len()),
        Condition::Remove(shas) => ("remove", shas.len()),
    };
    let target = match &question.target {
        Target::Bundle => Value::Null,
        Target::Path(path) => Value::String(path.clone()),
    };
    let states: serde_json::Map<String, Value> = State::ALL
        .iter()
        .map(|s| (s.as_str().to_string(), json!(verdict.count(*s))))
        .collect();
    let mut out = json!({
        "target": target,
        "condition": condition,
        "wanted": cas,
        "counted": verdict.counted(),
        "current": verdict.count(State::Current),
        "states": states,
    });
    let whole = serde_json::to_value(verdict).expect("a verdict serializes");
    if let (Value::Object(out), Value::Object(whole)) = (&mut out, whole) {
        out.extend(whole);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::verdict::testing::{bundle, ca, sha};
    use crate::fleet::verdict::{Node, Ready, Report, verdict};

    fn question(condition: Condition) -> Question {
        Question {
            sources: vec![ca('a', "signer-a"), ca('b', "kube-csr-signer_@1700000002")],
            known: vec![],
            condition,
            target: Target::Bundle,
        }
    }

    fn node<'a>(name: &'a str, report: &'a Report, ready: Ready) -> Node<'a> {
        Node {
            name,
            ready: Some(ready),
            deleting: false,
            report,
        }
    }

    #[test]
    fn the_count_line_says_how_many_hold_what() {
        let (good, old, none) = (bundle(&['a', 'b']), bundle(&['a']), Report::Missing);
        let nodes = || {
            [
                node("n1", &good, Ready::True),
                node("n2", &old, Ready::True),
                node("n3", &none, Ready::True),
            ]
        };
        let add = question(Condition::Add(vec![sha('b')]));
        assert_eq!(
            count_line(&add, &verdict(&add, nodes())),
            "1 of 3 nodes hold kube-csr-signer_@1700000002 (sha256:bbbbbbbbbbbb...)"
        );
        let two = question(Condition::Add(vec![sha('b'), sha('a')]));
        assert_eq!(
            count_line(&two, &verdict(&two, nodes())),
            "1 of 3 nodes hold kube-csr-signer_@1700000002 (sha256:bbbbbbbbbbbb...) and 1 more"
        );
        let remove = question(Condition::Remove(vec![sha('c')]));
        let mut gone = node("n4", &none, Ready::True);
        gone.deleting = true;
        let v = verdict(&remove, [node("n1", &good, Ready::True), gone]);
        assert_eq!(
            count_line(&remove, &v),
            "1 of 1 nodes no longer hold sha256:cccccccccccc...; 1 node being deleted is left out"
        );
        let mut sources = question(Condition::Sources);
        sources.target = Target::Path("/var/lib/kubelet/kubeconfig".into());
        let v = verdict(&sources, nodes());
        assert_eq!(
            count_line(&sources, &v),
            "0 of 3 nodes hold what the sources make (2 certificates) in /var/lib/kubelet/kubeconfig"
        );
        let mut two_gone = v.clone();
        two_gone.left_out = 2;
        assert!(count_line(&sources, &two_gone).ends_with("; 2 nodes being deleted are left out"));
        sources.sources.truncate(1);
        assert!(count_line(&sources, &verdict(&sources, [])).contains("(1 certificate)"));
        assert_eq!(several(&[]), "nothing");
    }

    #[test]
    fn the_table_lists_the_certificates_and_each_laggard_with_its_details() {
        let (good, old, none) = (bundle(&['a', 'b']), bundle(&['a', 'c']), Report::Missing);
        let q = question(Condition::Sources);
        let v = verdict(
            &q,
            [
                node("node-1", &good, Ready::True),
                node("node-2", &old, Ready::True),
                node("node-3\u{1b}[2J", &none, Ready::False),
            ],
        );
        let text = table(&q, &v);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "1 of 3 nodes hold what the sources make (2 certificates)"
        );
        assert_eq!(lines[1], "");
        assert!(lines[2].starts_with("CERTIFICATE "), "{text}");
        assert!(lines[2].ends_with("  HOLDING  MISSING"), "{text}");
        assert!(
            lines[3].starts_with("signer-a (sha256:aaaaaaaaaaaa...)  "),
            "{text}"
        );
        assert!(lines[3].ends_with("  2        1"), "{text}");
        assert!(lines[4].ends_with("  1        2"), "{text}");
        assert_eq!(lines[5], "");
        assert!(lines[6].starts_with("NODE "), "{text}");
        // The current node is not listed.
        assert!(!text.contains("node-1 "), "{text}");
        let node2 = lines.iter().find(|l| l.starts_with("node-2")).unwrap();
        assert!(
            node2.contains("behind      True   2026-11-27T15:00:00Z  lacks kube-csr-signer_@1700000002 (sha256:bbbbbbbbbbbb...); still holds sha256:cccccccccccc..."),
            "{node2}"
        );
        let node3 = lines.iter().find(|l| l.starts_with("node-3")).unwrap();
        assert!(
            node3.starts_with("node-3\\u{1b}[2J  unreported  False  -"),
            "{node3}"
        );
        assert!(
            node3.ends_with("no report (no agent, or it cannot write its Node); node NotReady")
        );
        assert!(!text.contains('\u{1b}'));
        // Every node current: no node table.
        let v = verdict(&q, [node("node-1", &good, Ready::Unknown)]);
        assert_eq!(laggards(&v), "");
        assert!(!table(&q, &v).contains("NODE"));
        let unknown = verdict(&q, [node("n", &old, Ready::Unknown)]);
        assert!(laggards(&unknown).contains("  Unknown  "));
        let mut unread = node("n", &old, Ready::True);
        unread.ready = None;
        assert!(laggards(&verdict(&q, [unread])).contains("  behind  -      2026"));
    }

    #[test]
    fn the_json_is_one_object_with_the_counts_and_every_counted_node() {
        let (good, old) = (bundle(&['a', 'b']), bundle(&['a']));
        let q = question(Condition::Sources);
        let v = verdict(
            &q,
            [
                node("n1", &good, Ready::True),
                node("n2", &old, Ready::True),
            ],
        );
        let j = json(&q, &v);
        assert_eq!(j["target"], Value::Null);
        assert_eq!(j["condition"], "sources");
        assert_eq!(j["wanted"], 2);
        assert_eq!(j["counted"], 2);
        assert_eq!(j["current"], 1);
        assert_eq!(j["states"]["current"], 1);
        assert_eq!(j["states"]["behind"], 1);
        assert_eq!(j["states"]["unreported"], 0);
        assert_eq!(j["states"]["invalid"], 0);
        assert_eq!(j["leftOut"], 0);
        assert_eq!(j["nodes"].as_array().unwrap().len(), 2);
        assert_eq!(
            j["nodes"][1]["lacks"][0]["subjectCN"],
            "kube-csr-signer_@1700000002"
        );
        assert_eq!(j["certificates"][1]["holding"], 1);
        let mut add = question(Condition::Add(vec![sha('a')]));
        add.target = Target::Path("/k".into());
        let j = json(&add, &verdict(&add, []));
        assert_eq!(
            (j["condition"].as_str(), j["wanted"].as_u64()),
            (Some("add"), Some(1))
        );
        assert_eq!(j["target"], "/k");
        let remove = question(Condition::Remove(vec![sha('a'), sha('b'), sha('c')]));
        let j = json(&remove, &verdict(&remove, []));
        assert_eq!(
            (j["condition"].as_str(), j["wanted"].as_u64()),
            (Some("remove"), Some(3))
        );
    }
}
