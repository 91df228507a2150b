//! `sync`: one reconciliation. Read every source (cluster sources with one list each, no
//! watch), build the bundle, write it if its bytes changed, and exit. With no earlier
//! content to fall back on, any rejected source or a bundle with no valid certificate ends
//! the run with exit 1 and writes nothing (SPEC 4.7).

use std::path::Path;

use anyhow::Context;
use time::OffsetDateTime;

use crate::bundle::{self, Bundle, SourceCertificates};
use crate::cli::{CommonArgs, SyncArgs};
use crate::commands::rfc3339;
use crate::credentials::Origin;
use crate::error::{Exit, UsageError};
use crate::source::{SourceSpec, cluster, local};
use crate::target::{Target, readable_certificates};
use crate::text::escape;
use crate::writer::OnDisk;

pub fn run(args: SyncArgs) -> anyhow::Result<Exit> {
    let common = &args.common;
    if let Some(command) = &common.exec_on_change {
        crate::exec::check(&command.0).map_err(UsageError)?;
    }
    let now = OffsetDateTime::now_utc();
    let target = Target::new(common);

    let sources = read_sources(common)?;
    let on_disk = target.writer().read_current()?;
    let policy = common.policy();
    let previous = target.remembered(on_disk.bytes());
    let built = bundle::build(&sources, &previous, policy, now.unix_timestamp())
        .with_context(|| format!("{} was left as it was", common.bundle.display()))?;
    for certificate in &built.retained {
        tracing::info!(subject = %certificate.display_name(), sha256 = %certificate.fingerprint(), "kept although no source carries it (--retain-removed)");
    }
    let rendered = built.bundle.render();

    if args.dry_run {
        print_plan(&common.bundle, &on_disk, &built.bundle, &rendered);
        return Ok(Exit::Success);
    }

    target.prepare();
    if let OnDisk::Other(kind) = on_disk {
        tracing::warn!(bundle = %common.bundle.display(), "the bundle path is {kind}; replacing it with a regular file");
    }
    let applied = target.apply(&built, &rendered, &on_disk, None, now, true)?;
    target.record(&built, &applied.sha256);
    if !applied.replaced {
        tracing::info!(bundle = %common.bundle.display(), certificates = built.bundle.len(), sha256 = %applied.sha256, "bundle already in sync");
    } else if let Some(command) = &common.exec_on_change {
        crate::exec::run(
            &command.0,
            &common.bundle,
            common.exec_on_change_timeout,
            &|| false,
        );
    }
    Ok(Exit::Success)
}

/// Every source, in order; the first that cannot be used ends the run. Each cluster read has
/// a deadline ([`cluster::REQUEST_DEADLINE`]): an API server that takes the request and never
/// answers ends the run with exit 1 and a line naming it, not a hang.
fn read_sources(common: &CommonArgs) -> anyhow::Result<Vec<SourceCertificates>> {
    let runtime = if common.sources.iter().any(SourceSpec::is_cluster) {
        let _ = rustls::crypto::ring::default_provider().install_default();
        Some(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
        )
    } else {
        None
    };
    let cluster = match &runtime {
        Some(rt) => {
            let origin = Origin::resolve(common.kubeconfig.as_deref()).map_err(UsageError)?;
            // Building the client spawns its request buffer onto the runtime.
            let _inside = rt.enter();
            Some(super::one_shot_client(&origin)?)
        }
        None => None,
    };
    let mut sources = Vec::with_capacity(common.sources.len());
    for spec in &common.sources {
        let parsed = match (&runtime, &cluster) {
            (Some(rt), Some((client, server))) if spec.is_cluster() => {
                match rt.block_on(cluster::read_once(client, server, spec)) {
                    Ok(parsed) => parsed,
                    Err(error) if error.reason() == "no_answer" => anyhow::bail!(
                        "source {spec}: the API server {server} did not answer within {}s (it took the request and sent nothing); {} was left as it was",
                        cluster::REQUEST_DEADLINE.as_secs(),
                        common.bundle.display()
                    ),
                    Err(error) => return Err(error.into()),
                }
            }
            _ => local::load(spec)?,
        };
        crate::source::warn_not_ca(spec, &parsed);
        sources.push(parsed);
    }
    Ok(sources)
}

fn print_plan(path: &Path, on_disk: &OnDisk, new: &Bundle, rendered: &[u8]) {
    let old = on_disk
        .bytes()
        .map(readable_certificates)
        .unwrap_or_default();
    let diff = bundle::diff(&old, new.certificates());
    for (sign, verb, certificates) in [("+", "add", &diff.added), ("-", "remove", &diff.removed)] {
        for c in certificates.iter() {
            println!(
                "{sign} would {verb:<6}  {}  sha256:{}  notAfter {}",
                escape(&c.display_name()),
                c.fingerprint(),
                rfc3339(c.not_after)
            );
        }
    }
    let shown = path.display().to_string();
    let path = escape(&shown);
    match on_disk {
        OnDisk::Regular { bytes, .. } if bytes == rendered => {
            println!(
                "{path} is in sync ({} certificates); nothing would change",
                new.len()
            )
        }
        OnDisk::Missing => println!(
            "{path} does not exist; it would be created with {} certificates",
            new.len()
        ),
        OnDisk::Other(kind) => println!(
            "{path} is {kind}; it would be replaced by a regular file with {} certificates",
            new.len()
        ),
        OnDisk::Regular { .. } if diff.added.is_empty() && diff.removed.is_empty() => println!(
            "{path} would change: same {} certificates, rewritten in standard form",
            new.len()
        ),
        OnDisk::Regular { .. } => println!(
            "{path} would change: {} -> {} certificates ({} added, {} removed)",
            old.len(),
            new.len(),
            diff.added.len(),
            diff.removed.len()
        ),
    }
}
