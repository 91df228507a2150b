//! `rollout status` and `rollout wait` (SPEC 8c): the effects around the fleet's verdict.
//! They read what the sources make (with the node agent's validation and merge), the
//! Nodes' metadata (one list for `status`, a list and then a watch for `wait`), and show
//! the [`verdict`] of [`crate::fleet::verdict`] as [`crate::fleet::show`] says. Nothing here
//! reads a report itself.
//!
//! Exit codes: 0 every counted node is current (or the condition holds), 1 one is not (or
//! the wait timed out), 2 a usage error, or the sources or the Nodes cannot be read.

use std::collections::BTreeMap;
use std::sync::Arc;

use time::OffsetDateTime;
use tokio::sync::watch;

use crate::bundle::{self, Policy, SourceCertificates};
use crate::commands::print_out;
use crate::config::{Fingerprints, Rollout, RolloutWait, WaitFor};
use crate::credentials::{Credentials, Origin};
use crate::error::{Exit, UsageError};
use crate::fleet::nodes::{self, Fleet};
use crate::fleet::prefix::{self, Named};
use crate::fleet::show;
use crate::fleet::verdict::{Ca, Condition, Question, Ready, Report, State, Target, verdict};
use crate::source::{SourceSpec, cluster, local};

pub fn run(config: Rollout) -> anyhow::Result<Exit> {
    let origin = Origin::resolve_kubectl(config.kubeconfig.as_deref(), config.pick.clone())
        .map_err(UsageError)?;
    // Certificates named by file: are read first: a file that cannot be read is a usage
    // error, before any request.
    let (asked, known) = asked(config.wait.as_ref())?;
    crate::runtime::build()?.block_on(async move {
        let (client, server) = crate::credentials::one_shot_client(&origin)
            .map_err(|e| UsageError(format!("{e:#}")))?;
        let sources = match what_the_sources_make(&client, &server, &config).await {
            Ok(sources) => sources,
            Err(problem) if matches!(asked, Asked::Sources) => {
                return Err(UsageError(problem).into());
            }
            Err(problem) => {
                // add= and remove= need the sources only to name the certificates (and
                // to resolve a prefix among them and what the reports name).
                tracing::warn!("{problem}; the certificates are named by their fingerprints alone");
                Vec::new()
            }
        };
        let unsettled = Unsettled {
            asked,
            sources,
            known,
            target: match &config.target {
                None => Target::Bundle,
                Some(path) => Target::Path(path.clone()),
            },
        };
        match &config.wait {
            None => status(&client, &server, &config, &unsettled).await,
            Some(wait) => wait_for(origin, &config, wait, &unsettled).await,
        }
    })
}

/// `--for` as given: `sources` (and `status`), or the certificates to add or remove, some
/// perhaps by their first digits.
enum Asked {
    Sources,
    Add(Vec<Named>),
    Remove(Vec<Named>),
}

/// The question before its prefixes are resolved: they are, once the Nodes are listed,
/// among what the sources make, the `file:` certificates and what the reports name.
struct Unsettled {
    asked: Asked,
    sources: Vec<Ca>,
    known: Vec<Ca>,
    target: Target,
}

impl Unsettled {
    /// The question, every prefix resolved among the certificates that `fleet`'s reports
    /// name and the named ones; one that names no single certificate is a usage error.
    fn settle(&self, fleet: &Fleet) -> Result<Question, UsageError> {
        let named: Vec<Ca> = self.sources.iter().chain(&self.known).cloned().collect();
        let reports = fleet.nodes.values().filter_map(|node| match &*node.report {
            Report::Read(Ok(held)) => Some(held),
            _ => None,
        });
        let reported = prefix::reported(&named, reports);
        let mut known = self.known.clone();
        let mut resolve = |list: &[Named]| {
            let (shas, found) = prefix::resolve_all(list, &named, &reported)
                .map_err(|e| UsageError(format!("--for: {e}")))?;
            known.extend(found);
            Ok::<_, UsageError>(shas)
        };
        let condition = match &self.asked {
            Asked::Sources => Condition::Sources,
            Asked::Add(list) => Condition::Add(resolve(list)?),
            Asked::Remove(list) => Condition::Remove(resolve(list)?),
        };
        Ok(Question {
            sources: self.sources.clone(),
            known,
            condition,
            target: self.target.clone(),
        })
    }
}

/// The condition asked (`sources` for `status`), and the certificates of the `file:`
/// fingerprints, by name.
fn asked(wait: Option<&RolloutWait>) -> Result<(Asked, Vec<Ca>), UsageError> {
    let Some(wait) = wait else {
        return Ok((Asked::Sources, Vec::new()));
    };
    let mut known = Vec::new();
    let mut named = |fingerprints: &[Fingerprints]| -> Result<Vec<Named>, UsageError> {
        let mut named = Vec::new();
        for fingerprint in fingerprints {
            match fingerprint {
                Fingerprints::Sha(sha) => named.push(Named::Sha(sha.clone())),
                Fingerprints::Prefix(prefix) => named.push(Named::Prefix(prefix.clone())),
                Fingerprints::File(path) => {
                    let spec = SourceSpec::File(path.clone());
                    let read = local::load(&spec).map_err(|e| {
                        UsageError(format!("--for: {}", crate::text::escape(&e.to_string())))
                    })?;
                    let all = read
                        .certificates
                        .iter()
                        .chain(read.not_ca.iter().map(|s| &s.certificate));
                    for certificate in all {
                        let ca = Ca::of(certificate);
                        named.push(Named::Sha(ca.sha256.clone()));
                        known.push(ca);
                    }
                }
            }
        }
        Ok(named)
    };
    let asked = match &wait.condition {
        WaitFor::Sources => Asked::Sources,
        WaitFor::Add(fingerprints) => Asked::Add(named(fingerprints)?),
        WaitFor::Remove(fingerprints) => Asked::Remove(named(fingerprints)?),
    };
    Ok((asked, known))
}

/// The certificates of the bundle the sources make, as the node agent builds it (one list
/// per cluster object, the same validation and merge), or why they cannot be read.
async fn what_the_sources_make(
    client: &kube::Client,
    server: &str,
    config: &Rollout,
) -> Result<Vec<Ca>, String> {
    let answers =
        cluster::read_sources(client, server, &config.sources, cluster::bundle_content).await;
    let mut read: Vec<SourceCertificates> = Vec::with_capacity(answers.len());
    for (spec, answer) in config.sources.iter().zip(answers) {
        let parsed = match answer {
            Some(answer) => answer,
            None => local::load(spec),
        }
        .map_err(|e| format!("cannot read the sources: {e}"))?;
        crate::source::warn_not_ca(spec, &parsed);
        read.push(parsed);
    }
    let policy = Policy {
        retain_removed: 0,
        drop_expired: config.drop_expired,
    };
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let built = bundle::build(&read, &[], policy, now)
        .map_err(|e| format!("the sources make no bundle: {e}"))?;
    Ok(built.bundle.certificates().iter().map(Ca::of).collect())
}

/// `rollout status`: one list of the Nodes' metadata, one of their readiness, the verdict.
async fn status(
    client: &kube::Client,
    server: &str,
    config: &Rollout,
    unsettled: &Unsettled,
) -> anyhow::Result<Exit> {
    let selector = config.selector.as_deref();
    let (fleet, _) = nodes::list(client, server, selector)
        .await
        .map_err(|why| UsageError(format!("cannot read the Nodes: {}", why.text)))?;
    let question = unsettled.settle(&fleet)?;
    let ready = readiness(client, server, selector).await;
    let verdict = verdict(&question, fleet.for_verdict(ready.as_ref()));
    if config.json {
        let mut text = serde_json::to_string_pretty(&show::json(&question, &verdict))?;
        text.push('\n');
        print_out(&text)?;
    } else {
        print_out(&show::table(&question, &verdict))?;
    }
    Ok(if verdict.done() {
        Exit::Success
    } else {
        Exit::Failure
    })
}

/// The Nodes' readiness, or nothing (with a warning) when it cannot be read: the verdict
/// stands without it.
async fn readiness(
    client: &kube::Client,
    server: &str,
    selector: Option<&str>,
) -> Option<BTreeMap<String, Ready>> {
    match nodes::readiness(client, server, selector).await {
        Ok(ready) => Some(ready),
        Err(why) => {
            tracing::warn!(
                "cannot read the Nodes' readiness: {}; NotReady nodes are not marked",
                why.text
            );
            None
        }
    }
}

/// `rollout wait`: follows the Nodes' metadata and prints the count each time it moves,
/// until every counted node satisfies the condition, or the timeout.
async fn wait_for(
    origin: Origin,
    config: &Rollout,
    wait: &RolloutWait,
    unsettled: &Unsettled,
) -> anyhow::Result<Exit> {
    let credentials = Credentials::follow(origin);
    let (tx, mut fleet) = watch::channel(Arc::new(Fleet::default()));
    // Stopped as soon as the command has its answer: left to the runtime's shutdown, a
    // request in flight would see its client's worker go first and say so, after success.
    let follower = tokio::spawn(nodes::follow(
        credentials.clone(),
        config.selector.clone(),
        tx,
    ));
    let answer = wait_on(&credentials, &mut fleet, config, wait, unsettled).await;
    follower.abort();
    let _ = follower.await;
    answer
}

/// [`wait_for`]'s wait on the Nodes that `fleet` tells, and its answer.
async fn wait_on(
    credentials: &Credentials,
    fleet: &mut watch::Receiver<Arc<Fleet>>,
    config: &Rollout,
    wait: &RolloutWait,
    unsettled: &Unsettled,
) -> anyhow::Result<Exit> {
    let deadline = wait.timeout.map(|t| tokio::time::Instant::now() + t);
    let mut last: Option<(usize, usize)> = None;
    // Settled on the first list of the Nodes: a prefix may name what only a report names.
    let mut question: Option<Question> = None;
    loop {
        let now = fleet.borrow_and_update().clone();
        if now.listed {
            let question = match &mut question {
                Some(question) => question,
                None => question.insert(unsettled.settle(&now)?),
            };
            let verdict = verdict(question, now.for_verdict(None));
            let count = (verdict.count(State::Current), verdict.counted());
            if last != Some(count) {
                print_out(&format!("{}\n", show::count_line(question, &verdict)))?;
                last = Some(count);
            }
            if verdict.done() {
                return Ok(Exit::Success);
            }
        } else if let Some(trouble) = now.problem.as_ref().filter(|t| t.reason == "forbidden") {
            // Refused for good. A 401 is not: the credentials are read again after one, and
            // a client certificate rotated under the wait is used as soon as it is read.
            return Err(UsageError(format!("cannot read the Nodes: {}", trouble.text)).into());
        }
        let timed_out = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = fleet.changed() => if changed.is_err() {
                anyhow::bail!("the Nodes' follower stopped");
            },
            () = timed_out => break,
        }
    }
    let now = fleet.borrow().clone();
    let after = humantime::format_duration(wait.timeout.unwrap_or_default());
    if !now.listed {
        let why = now
            .problem
            .as_ref()
            .map_or("no answer yet".to_string(), |t| t.text.clone());
        return Err(UsageError(format!("cannot read the Nodes within {after}: {why}")).into());
    }
    let question = match question {
        Some(question) => question,
        None => unsettled.settle(&now)?,
    };
    // The laggards, as `status` shows them, with their readiness when it can be read.
    let ready = match credentials.client() {
        Ok(client) => {
            let server = credentials.current().server.clone().unwrap_or_default();
            readiness(&client, &server, config.selector.as_deref()).await
        }
        Err(_) => None,
    };
    let verdict = verdict(&question, now.for_verdict(ready.as_ref()));
    print_out(&format!(
        "timed out after {after}: {}\n{}",
        show::count_line(&question, &verdict),
        show::laggards(&verdict)
    ))?;
    Ok(Exit::Failure)
}
