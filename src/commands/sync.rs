//! `sync`: one reconciliation. Read every source, build the bundle, write it if its bytes
//! changed, and exit. With no earlier content to fall back on, any rejected source or a
//! bundle with no valid certificate ends the run with exit 1 and writes nothing (SPEC 4.7).

use std::path::Path;
use std::process::Command;

use anyhow::Context;
use time::OffsetDateTime;

use crate::bundle::{self, Bundle, Policy, Remembered, SourceCertificates, parse::scan};
use crate::cli::SyncArgs;
use crate::commands::rfc3339;
use crate::error::{Exit, UsageError};
use crate::source::{SourceSpec, local};
use crate::state::StateDir;
use crate::writer::{BundleWriter, Outcome};

pub fn run(args: SyncArgs) -> anyhow::Result<Exit> {
    let common = &args.common;
    reject_cluster_sources(&common.sources)?;
    let now = OffsetDateTime::now_utc();
    let now_unix = now.unix_timestamp();
    let state = StateDir::new(common.state_dir.clone());
    let writer = BundleWriter::new(common.bundle.clone(), common.file_mode, state.path());

    let sources = read_sources(&common.sources)?;
    let on_disk = writer.read_current()?;
    let policy = Policy {
        retain_removed: common
            .retain_removed
            .as_secs()
            .try_into()
            .unwrap_or(i64::MAX),
        drop_expired: common.drop_expired,
    };
    let previous = if policy.retain_removed > 0 {
        remembered(&state, on_disk.as_deref())
    } else {
        Vec::new()
    };
    let built = bundle::build(&sources, &previous, policy, now_unix)
        .with_context(|| format!("{} was left as it was", common.bundle.display()))?;
    for certificate in &built.retained {
        tracing::info!(subject = %certificate.display_name(), sha256 = %certificate.fingerprint(), "kept although no source carries it (--retain-removed)");
    }
    let rendered = built.bundle.render();

    if args.dry_run {
        print_plan(&common.bundle, on_disk.as_deref(), &built.bundle, &rendered);
        return Ok(Exit::Success);
    }

    if let Err(e) = state.ensure() {
        tracing::warn!(state_dir = %state.path().display(), error = %e, "cannot create the state directory; history and memory are not kept");
    }
    match writer.remove_stale_temp_files() {
        Ok(removed) => {
            for path in removed {
                tracing::info!(path = %path.display(), "removed a temporary file left by a killed run");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot look for stale temporary files"),
    }
    let sha256 = bundle::Fingerprint::of(&rendered).to_hex();
    let outcome = writer.write(&rendered, now)?;
    if policy.retain_removed > 0
        && let Err(e) = state.save_retention(&built.memory)
    {
        tracing::warn!(error = %e, "cannot save the retention memory");
    }
    if let Err(e) = state.save_managed_files(&common.bundle, &sha256) {
        tracing::warn!(error = %e, "cannot write managed-files.json");
    }
    match outcome {
        Outcome::Unchanged => tracing::info!(
            bundle = %common.bundle.display(),
            certificates = built.bundle.len(),
            sha256 = %sha256,
            "bundle already in sync"
        ),
        Outcome::Replaced { previous } => {
            let old = previous
                .as_deref()
                .map(old_certificates)
                .unwrap_or_default();
            let diff = bundle::diff(&old, built.bundle.certificates());
            tracing::info!(
                bundle = %common.bundle.display(),
                certificates = built.bundle.len(),
                added = diff.added.len(),
                removed = diff.removed.len(),
                sha256 = %sha256,
                "bundle written"
            );
            if let Some(command) = &common.exec_on_change {
                run_exec_on_change(&command.0, &common.bundle);
            }
        }
    }
    Ok(Exit::Success)
}

fn reject_cluster_sources(sources: &[SourceSpec]) -> Result<(), UsageError> {
    match sources.iter().find(|s| s.is_cluster()) {
        Some(spec) => Err(UsageError(format!(
            "source {spec}: cluster sources are not available in this version yet; use file:PATH or dir:PATH"
        ))),
        None => Ok(()),
    }
}

fn read_sources(specs: &[SourceSpec]) -> anyhow::Result<Vec<SourceCertificates>> {
    let mut sources = Vec::with_capacity(specs.len());
    for spec in specs {
        let parsed = local::load(spec)?;
        for skipped in &parsed.not_ca {
            tracing::warn!(
                source = %spec,
                block = skipped.block,
                subject = %skipped.certificate.display_name(),
                sha256 = %skipped.certificate.fingerprint(),
                reason = "not_ca",
                "left out a certificate that is not a CA: the kubelet cannot verify clients with it"
            );
        }
        sources.push(parsed);
    }
    Ok(sources)
}

/// The retention memory; on first use, the bundle already on disk (it is adopted).
fn remembered(state: &StateDir, on_disk: Option<&[u8]>) -> Vec<Remembered> {
    state.load_retention().unwrap_or_else(|| {
        on_disk
            .and_then(|b| bundle::parse_source(b).ok())
            .map(|parsed| {
                parsed
                    .certificates
                    .into_iter()
                    .map(|certificate| Remembered {
                        certificate,
                        missing_since: None,
                    })
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Whatever certificates can be read from the file on disk, even if it is damaged.
fn old_certificates(bytes: &[u8]) -> Vec<bundle::Certificate> {
    scan(bytes)
        .certificates
        .into_iter()
        .map(|(_, c)| c)
        .collect()
}

fn print_plan(path: &Path, on_disk: Option<&[u8]>, new: &Bundle, rendered: &[u8]) {
    let old = on_disk.map(old_certificates).unwrap_or_default();
    let diff = bundle::diff(&old, new.certificates());
    for (sign, verb, certificates) in [("+", "add", &diff.added), ("-", "remove", &diff.removed)] {
        for c in certificates.iter() {
            println!(
                "{sign} would {verb:<6}  {}  sha256:{}  notAfter {}",
                c.display_name(),
                c.fingerprint(),
                rfc3339(c.not_after)
            );
        }
    }
    let path = path.display();
    match on_disk {
        Some(bytes) if bytes == rendered => {
            println!(
                "{path} is in sync ({} certificates); nothing would change",
                new.len()
            )
        }
        None => println!(
            "{path} does not exist; it would be created with {} certificates",
            new.len()
        ),
        Some(_) if diff.added.is_empty() && diff.removed.is_empty() => println!(
            "{path} would change: same {} certificates, rewritten in standard form",
            new.len()
        ),
        Some(_) => println!(
            "{path} would change: {} -> {} certificates ({} added, {} removed)",
            old.len(),
            new.len(),
            diff.added.len(),
            diff.removed.len()
        ),
    }
}

/// Runs `--exec-on-change` once; a failure is logged, never retried.
fn run_exec_on_change(command: &[String], bundle: &Path) {
    let result = Command::new(&command[0])
        .args(&command[1..])
        .env("KUBELET_CA_BUNDLE", bundle)
        .status();
    match result {
        Ok(status) if status.success() => {
            tracing::info!(command = %command[0], "exec-on-change command succeeded")
        }
        Ok(status) => {
            tracing::warn!(command = %command[0], %status, "exec-on-change command failed")
        }
        Err(e) => {
            tracing::warn!(command = %command[0], error = %e, "exec-on-change command could not start")
        }
    }
}
