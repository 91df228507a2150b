//! `sync`: one reconciliation. Read every source (cluster sources with one list each, no
//! watch), build the bundle, write it if its bytes changed, and exit. With no earlier
//! content to fall back on, any rejected source or a bundle with no valid certificate ends
//! the run with exit 1 and writes nothing (SPEC 4.7).
//!
//! Some failures are known before any source is read, and refused as configuration errors
//! (exit 2) with nothing written: a hook that cannot run, a bundle directory that does not
//! exist, and a bundle that a running agent manages (it would undo the write at once, as a
//! repair; `--force` writes anyway). `--dry-run` prints its plan, then exits as the sync
//! would on these.

use std::path::Path;

use anyhow::Context;
use time::OffsetDateTime;

use crate::bundle::{self, Bundle, SourceCertificates};
use crate::commands::print_out;
use crate::config::{self, RegistriesSpec};
use crate::credentials::Origin;
use crate::error::{Exit, UsageError};
use crate::running::{self, ManagedPath};
use crate::source::{SourceSpec, cluster, local};
use crate::state::Book;
use crate::targets::apply::{Target, readable_certificates};
use crate::text::escape;
use crate::text::rfc3339;
use crate::writer::OnDisk;

pub fn run(args: config::Sync) -> anyhow::Result<Exit> {
    let common = &args.common;
    // Every file, the bundle first: (path, sources, whether it is the bundle).
    let files: Vec<(&Path, &[SourceSpec], bool)> =
        std::iter::once((common.bundle.as_path(), common.sources.as_slice(), true))
            .chain(
                common
                    .manage
                    .iter()
                    .map(|m| (m.path.as_path(), m.sources.as_slice(), false)),
            )
            .collect();
    let blocked: Vec<Option<Blocked>> = files
        .iter()
        .map(|(path, _, bundle)| blocked(&args, path, *bundle))
        .collect();
    if !args.dry_run
        && let Some(blocked) = blocked.iter().flatten().next()
    {
        return Err(blocked.error().into());
    }
    let cluster = Cluster::connect(common)?;
    let book = Book::open_with_sets(
        &common.state_dir,
        &common.managed_paths(),
        &common.registry_dirs(),
    )
    .with_kubeconfigs(&common.kubeconfig_paths());
    // A file whose sources cannot be used is left as it was; the others are still synced,
    // and the run exits 1 with the first such failure.
    let mut failed = None;
    for ((path, specs, bundle), blocked) in files.into_iter().zip(blocked) {
        let target = Target::for_file(common, path, book.clone());
        match sync_file(&args, &cluster, &target, specs, bundle, blocked) {
            Ok(()) => {}
            Err(e) if failed.is_none() => failed = Some(e),
            Err(e) => tracing::error!("{e:#}"),
        }
    }
    for kubeconfig in &common.manage_kubeconfig {
        match sync_kubeconfig(&args, &cluster, kubeconfig, &book) {
            Ok(()) => {}
            Err(e) if failed.is_none() => failed = Some(e),
            Err(e) => tracing::error!("{e:#}"),
        }
    }
    for set in &common.manage_registries {
        match sync_registries(&args, &cluster, set, &book) {
            Ok(()) => {}
            Err(e) if failed.is_none() => failed = Some(e),
            Err(e) => tracing::error!("{e:#}"),
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(Exit::Success),
    }
}

/// Syncs one managed kubeconfig (`--manage-kubeconfig`): every source read once, then the
/// daemon's own pass, which adds at once and drops a CA only once the kubeconfig's server
/// verifies with the new CA data alone; the check is waited for here. A removal still held
/// after it makes the run exit 1, naming why (what could be written was). `--dry-run`
/// reads and checks nothing, and says what the sources would add and drop.
fn sync_kubeconfig(
    args: &config::Sync,
    cluster: &Cluster,
    spec: &config::ManageSpec,
    book: &Book,
) -> anyhow::Result<()> {
    use crate::source::cluster::{Content, Event};
    use crate::targets::Kept;
    use crate::targets::kubeconfig::Kubeconfig;
    let path = &spec.path;
    let shown = escape(&path.display().to_string()).into_owned();
    if !args.force
        && let Ok(Some(claim)) = running::find(&args.common.state_dir)
        && (claim.managed.is_empty() || claim.managed.iter().any(|m| m.is(&ManagedPath::of(path))))
    {
        let error = UsageError(format!(
            "{shown} is managed by a running kubelet-ca-agent (pid {}), which would undo this sync at once: stop it first; --force writes anyway",
            claim.who()
        ));
        if !args.dry_run {
            return Err(error.into());
        }
        eprintln!("kubelet-ca-agent: the sync itself would be refused: {error}");
    }
    let sources = cluster.read_sources(&spec.sources, path, |_| false)?;
    if args.dry_run {
        let document = crate::kubeconfig::Document::parse(
            &std::fs::read(path).with_context(|| format!("cannot read {shown}"))?,
        )
        .with_context(|| format!("{shown} cannot be kept"))?;
        let now = OffsetDateTime::now_utc().unix_timestamp();
        let built = bundle::build(&sources, &[], args.common.policy(), now)
            .with_context(|| format!("{shown} would be left as it was"))?;
        let current = document
            .cluster()
            .ca_data
            .as_deref()
            .map(readable_certificates)
            .unwrap_or_default();
        let diff = bundle::diff(&current, built.bundle.certificates());
        print_out(&format!(
            "{shown}: the CA data of its cluster {} would gain {} and drop {} certificate(s) (a drop only once {} verifies with the new CA data alone)\n",
            document.cluster().name,
            diff.added.len(),
            diff.removed.len(),
            escape(&document.cluster().server)
        ))?;
        return Ok(());
    }
    let metrics = std::sync::Arc::new(crate::metrics::Metrics::default());
    let mut target = Kubeconfig::new(
        spec,
        0,
        &args.common,
        None,
        crate::targets::Wake::none(),
        metrics,
        book.clone(),
    );
    let now = std::time::Instant::now();
    for (index, certificates) in sources.into_iter().enumerate() {
        target.on_update(
            index,
            Event::Content(Content::Certificates(certificates)),
            now,
        );
    }
    let mut created = crate::registry::CreatedRecord::default();
    target.reconcile(&mut created);
    if target.wait_for_check() {
        target.reconcile(&mut created);
    }
    let mut report = crate::targets::Report::default();
    target.report(&mut report);
    let status = report.into_status();
    if status.in_sync != Some(true) {
        anyhow::bail!(
            "{shown}: {}",
            status.sync_problem.as_deref().unwrap_or("not in sync")
        );
    }
    Ok(())
}

/// Syncs one registry set (`--manage-registries`): every source read once, then one pass
/// of the daemon's own set, which writes, repairs and removes by the same rules and keeps
/// the same record. A registry whose entry is refused, or whose file cannot be written, is
/// left as it was and makes the run exit 1; the others are synced.
fn sync_registries(
    args: &config::Sync,
    cluster: &Cluster,
    set: &RegistriesSpec,
    book: &Book,
) -> anyhow::Result<()> {
    use crate::source::cluster::{Content, Event};
    use crate::targets::Kept;
    use crate::targets::registry_set::RegistrySet;
    let dir = escape(&set.dir.display().to_string()).into_owned();
    if !args.force
        && let Ok(Some(claim)) = running::find(&args.common.state_dir)
        && (claim.managed.is_empty()
            || claim
                .managed
                .iter()
                .any(|m| m.is(&ManagedPath::of(&set.dir))))
    {
        let error = UsageError(format!(
            "the registry CAs under {dir} are managed by a running kubelet-ca-agent (pid {}), which would undo this sync at once: give that agent the entries through its sources, or stop it first; --force writes anyway",
            claim.who()
        ));
        if !args.dry_run {
            return Err(error.into());
        }
        eprintln!("kubelet-ca-agent: the sync itself would be refused: {error}");
    }
    let metrics = std::sync::Arc::new(crate::metrics::Metrics::default());
    let mut registries = RegistrySet::new(
        &set.dir,
        &set.sources,
        0,
        metrics,
        book.clone(),
        &args.common.state_dir,
    );
    for (index, spec) in set.sources.iter().enumerate() {
        let entries = cluster
            .read_registry_source(spec)
            .with_context(|| format!("the registry CAs under {dir} were left as they were"))?;
        registries.on_update(
            index,
            Event::Content(Content::Entries(std::sync::Arc::new(entries))),
            std::time::Instant::now(),
        );
    }
    let state = crate::state::StateDir::new(args.common.state_dir.clone());
    let (mut record, problem) = state.load_registry_record();
    if let Some(problem) = problem {
        tracing::warn!(
            "cannot read the record of created registry files ({problem}): nothing is removed"
        );
    }
    if args.dry_run {
        print_out(&registries.preview(&record))?;
        return Ok(());
    }
    let before = record.clone();
    registries.reconcile(&mut record);
    if record != before {
        state
            .save_registry_record(&record)
            .context("cannot save the record of created registry files")?;
    }
    if let Some(note) = &registries.note {
        anyhow::bail!("{dir}: {note}");
    }
    if let Some(status) = registries.statuses.iter().find(|s| s.in_sync != Some(true)) {
        anyhow::bail!(
            "{}: {}",
            escape(&status.bundle_path),
            status.sync_problem.as_deref().unwrap_or("not in sync")
        );
    }
    Ok(())
}

/// Syncs one managed file from `specs` (a dry run prints its plan instead).
fn sync_file(
    args: &config::Sync,
    cluster: &Cluster,
    target: &Target,
    specs: &[SourceSpec],
    bundle: bool,
    blocked: Option<Blocked>,
) -> anyhow::Result<()> {
    let common = &args.common;
    let path = target.path();
    let now = OffsetDateTime::now_utc();
    // A --manage file's source that is not also the bundle's may hold nothing (an empty
    // cloud-ca.pem key), as in the daemon.
    let optional = |spec: &SourceSpec| !bundle && !common.sources.contains(spec);
    let sources = cluster.read_sources(specs, path, optional)?;
    if !bundle
        && sources
            .iter()
            .all(|s| s.certificates.is_empty() && s.not_ca.is_empty())
    {
        // A --manage file whose sources hold no certificate (a cloud CA on a platform
        // without one): neither created nor emptied.
        tracing::info!(file = %path.display(), "its sources hold no certificate: the file is neither created nor emptied");
        if args.dry_run {
            print_out(&format!(
                "{}: its sources hold no certificate; nothing would change\n",
                escape(&path.display().to_string())
            ))?;
        }
        return Ok(());
    }
    let on_disk = target.writer().read_current()?;
    let policy = common.policy();
    let previous = target.remembered(on_disk.bytes());
    let built = bundle::build(&sources, &previous, policy, now.unix_timestamp())
        .with_context(|| format!("{} was left as it was", path.display()))?;
    for certificate in &built.retained {
        tracing::info!(subject = %certificate.display_name(), sha256 = %certificate.fingerprint(), "kept although no source carries it (--retain-removed)");
    }
    let rendered = built.bundle.render();

    if args.dry_run {
        let missing_dir = matches!(blocked, Some(Blocked::Directory(_)));
        print_out(&plan(
            path,
            &on_disk,
            &built.bundle,
            &rendered,
            now.unix_timestamp(),
            !missing_dir,
        ))?;
        // SPEC 3: a dry run writes nothing and exits 0. What would stop the sync itself is
        // said on stderr, as the sync would say it, so that the plan is not taken for a
        // promise.
        if let Some(blocked) = blocked {
            eprintln!(
                "kubelet-ca-agent: the sync itself would be refused: {}",
                escape(&blocked.error().to_string())
            );
        }
        return Ok(());
    }

    if !bundle {
        let dir = crate::writer::atomic::parent_dir(path);
        if !dir.exists() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&dir)
                .with_context(|| format!("cannot create the directory {}", dir.display()))?;
        }
    }
    target.prepare();
    if let OnDisk::Other(kind) = on_disk {
        tracing::warn!(bundle = %path.display(), "the bundle path is {kind}; replacing it with a regular file");
    }
    let applied = target.apply(&built, &rendered, &on_disk, None, now, true)?;
    target.record(&built, &applied.sha256);
    if !applied.replaced {
        tracing::info!(bundle = %path.display(), certificates = built.bundle.len(), sha256 = %applied.sha256, "bundle already in sync");
    } else if let (true, Some(command)) = (bundle, &common.exec_on_change) {
        crate::exec::run(
            &command.0,
            &common.bundle,
            common.exec_on_change_timeout,
            &|| false,
        );
    }
    Ok(())
}

/// What stops a sync before it starts, with the line that says so.
enum Blocked {
    /// The bundle's directory does not exist, or is not a directory.
    Directory(String),
    /// A running agent manages the bundle.
    Managed(String),
}

impl Blocked {
    fn error(&self) -> UsageError {
        match self {
            Blocked::Directory(why) | Blocked::Managed(why) => UsageError(why.clone()),
        }
    }
}

/// A directory that is not there (the write would fail; the daemon refuses to start on
/// it too), or an agent that manages the bundle (unless `--force`).
fn blocked(args: &config::Sync, path: &Path, is_bundle: bool) -> Option<Blocked> {
    let common = &args.common;
    let bundle = escape(&path.display().to_string()).into_owned();
    let dir = crate::writer::atomic::parent_dir(path);
    let shown_dir = escape(&dir.display().to_string()).into_owned();
    // A --manage file's directory is made when there is something to keep in it, as the
    // daemon makes it; the bundle's is the kubelet's.
    match std::fs::metadata(&dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !is_bundle => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Some(Blocked::Directory(format!(
                "cannot write {bundle}: its directory {shown_dir} does not exist; create it (on a node it is the kubelet's), or fix --bundle"
            )));
        }
        Ok(m) if !m.is_dir() => {
            return Some(Blocked::Directory(format!(
                "cannot write {bundle}: {shown_dir} is not a directory; fix --bundle"
            )));
        }
        // Anything else (permission denied) is for the write to report.
        _ => {}
    }
    let claim = match running::find(&common.state_dir) {
        Ok(claim) => claim?,
        Err(e) => {
            tracing::warn!(state_dir = %common.state_dir.display(), error = %e, "cannot tell whether a running agent manages the bundle");
            return None;
        }
    };
    let ours = ManagedPath::of(path);
    // A claim being written names no file yet: take it for ours, the safe side.
    if !claim.managed.is_empty() && !claim.managed.iter().any(|m| m.is(&ours)) {
        return None;
    }
    let lock = common.state_dir.join(running::LOCK_FILE);
    if args.force {
        tracing::warn!(bundle = %path.display(), pid = %claim.who(), "--force: a running agent manages the bundle, and will put back its own bundle at once unless its sources agree with this one");
        return None;
    }
    Some(Blocked::Managed(format!(
        "{bundle} is managed by a running kubelet-ca-agent (pid {}; it holds {}), which would undo this sync at once, as a repair: give that agent the certificates through its sources (e.g. --source dir:PATH), or stop it (systemctl stop kubelet-ca-agent) first; --force writes anyway",
        claim.who(),
        escape(&lock.display().to_string()),
    )))
}

/// The API server, when a managed file has a cluster source: a one-shot client on a
/// runtime of its own.
struct Cluster(Option<(tokio::runtime::Runtime, kube::Client, String)>);

impl Cluster {
    fn connect(common: &config::Common) -> anyhow::Result<Cluster> {
        if !common.all_sources().iter().any(SourceSpec::is_cluster) {
            return Ok(Cluster(None));
        }
        let _ = rustls::crypto::ring::default_provider().install_default();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let origin = Origin::resolve(common.kubeconfig.as_deref()).map_err(UsageError)?;
        // Said when the search chose them (SPEC 3); --kubeconfig is the user's own word, and a
        // failure stays one line on stderr.
        if common.kubeconfig.is_none() {
            tracing::info!(credentials = %origin.describe(), "credentials for the API server chosen");
        }
        // Building the client spawns its request buffer onto the runtime.
        let (client, server) = {
            let _inside = runtime.enter();
            crate::credentials::one_shot_client(&origin)?
        };
        Ok(Cluster(Some((runtime, client, server))))
    }

    /// The entries of a registry set's source (`--manage-registries`), read once.
    fn read_registry_source(&self, spec: &SourceSpec) -> anyhow::Result<crate::registry::Entries> {
        match &self.0 {
            Some((rt, client, server)) if spec.is_cluster() => {
                let answers = rt.block_on(cluster::read_sources(
                    client,
                    server,
                    std::slice::from_ref(spec),
                    cluster::registry_content,
                ));
                match answers.into_iter().next().flatten() {
                    Some(result) => Ok(result?),
                    None => anyhow::bail!("source {spec} was not read"),
                }
            }
            _ => Ok(local::registry_entries(spec)?),
        }
    }

    /// The kubeadm-style source to name when the default one failed with `reason`: looked
    /// at only then, with one read.
    fn kubeadm_hint(&self, spec: &SourceSpec, reason: &str) -> Option<String> {
        use crate::source::{KUBEADM_SOURCE, KubeadmSource, kubeadm_hint};
        let spec = spec.to_string();
        kubeadm_hint(&spec, reason, KubeadmSource::Unknown)?;
        let (rt, client, server) = self.0.as_ref()?;
        let kubeadm: SourceSpec = KUBEADM_SOURCE.parse().ok()?;
        let kubeadm = [kubeadm];
        let read = cluster::read_sources(client, server, &kubeadm, cluster::bundle_content);
        let found = match rt.block_on(read).into_iter().next().flatten() {
            Some(Ok(_)) => KubeadmSource::Exists,
            Some(Err(e)) if e.reason() == "not_found" => KubeadmSource::Missing,
            _ => KubeadmSource::Unknown,
        };
        kubeadm_hint(&spec, reason, found)
    }

    /// Every source of the file at `path`, in order; the first that cannot be used ends
    /// its sync. Each cluster read has a deadline ([`crate::follow::REQUEST_DEADLINE`]): an API
    /// server that takes the request and never answers ends it with a line naming it, not
    /// a hang.
    fn read_sources(
        &self,
        specs: &[SourceSpec],
        path: &Path,
        optional: impl Fn(&SourceSpec) -> bool,
    ) -> anyhow::Result<Vec<SourceCertificates>> {
        let mut sources = Vec::with_capacity(specs.len());
        for spec in specs {
            let parsed = match &self.0 {
                Some((rt, client, server)) if spec.is_cluster() => {
                    let content = if optional(spec) {
                        cluster::optional_bundle_content
                    } else {
                        cluster::bundle_content
                    };
                    let read =
                        cluster::read_sources(client, server, std::slice::from_ref(spec), content);
                    let answer = rt.block_on(read).into_iter().next().flatten();
                    match answer.expect("a cluster source is read") {
                        Ok(parsed) => parsed,
                        Err(error) if error.reason() == "no_answer" => anyhow::bail!(
                            "source {spec}: the API server {server} did not answer within {}s (it took the request and sent nothing); {} was left as it was",
                            crate::follow::REQUEST_DEADLINE.as_secs(),
                            path.display()
                        ),
                        Err(error) => {
                            let hint = self.kubeadm_hint(spec, error.reason());
                            return Err(anyhow::anyhow!("{error}{}", hint.unwrap_or_default()));
                        }
                    }
                }
                _ => local::load(spec)?,
            };
            crate::source::warn_not_ca(spec, &parsed);
            sources.push(parsed);
        }
        Ok(sources)
    }
}

/// What a rewrite of the same certificates changes (issue 34): their order (the sources'
/// order wins), their encoding (the standard PEM form: no text between blocks, LF line
/// endings, 64-column base64, no duplicate), or both.
fn same_certificates_change(
    on_disk: &[u8],
    old: &[bundle::Certificate],
    new: &Bundle,
) -> &'static str {
    let order = |certificates: &[bundle::Certificate]| {
        let mut seen = std::collections::HashSet::new();
        certificates
            .iter()
            .map(bundle::Certificate::fingerprint)
            .filter(|f| seen.insert(*f))
            .collect::<Vec<_>>()
    };
    let reordered = order(old) != order(new.certificates());
    let reencoded = Bundle::from_certificates(old.iter().cloned()).render() != on_disk;
    match (reordered, reencoded) {
        (true, false) => "reordered (as the sources order them); each certificate's text unchanged",
        (false, _) => {
            "in the same order, re-encoded in standard PEM form (text between blocks, line endings, line length or a duplicate removed)"
        }
        (true, true) => {
            "reordered (as the sources order them) and re-encoded in standard PEM form (text between blocks, line endings, line length or a duplicate removed)"
        }
    }
}

/// The dry run's report: one aligned line per certificate that would be added or removed
/// (an expired or not yet valid one marked), then what would happen to the file (left out
/// when nothing can be written, which the error line then says).
fn plan(
    path: &Path,
    on_disk: &OnDisk,
    new: &Bundle,
    rendered: &[u8],
    now: i64,
    writable: bool,
) -> String {
    use std::fmt::Write;
    let old = on_disk
        .bytes()
        .map(readable_certificates)
        .unwrap_or_default();
    let diff = bundle::diff(&old, new.certificates());
    let rows: Vec<(&str, &str, String, String, String, &str)> =
        [("+", "add", &diff.added), ("-", "remove", &diff.removed)]
            .into_iter()
            .flat_map(|(sign, verb, certificates)| {
                certificates.iter().map(move |c| {
                    let mark = if c.is_expired_at(now) {
                        "EXPIRED"
                    } else if now < c.not_before {
                        "NOT YET VALID"
                    } else {
                        ""
                    };
                    (
                        sign,
                        verb,
                        escape(&c.display_name()).into_owned(),
                        c.fingerprint().to_string(),
                        rfc3339(c.not_after),
                        mark,
                    )
                })
            })
            .collect();
    let width = rows.iter().map(|r| r.2.chars().count()).max().unwrap_or(0);
    let mut out = String::new();
    for (sign, verb, name, sha256, not_after, mark) in &rows {
        let line = format!(
            "{sign} would {verb:<6}  {name:<width$}  sha256:{sha256}  notAfter {not_after}  {mark}"
        );
        let _ = writeln!(out, "{}", line.trim_end());
    }
    if !writable {
        return out;
    }
    let shown = path.display().to_string();
    let path = escape(&shown);
    let _ = match on_disk {
        OnDisk::Regular { bytes, .. } if bytes == rendered => writeln!(
            out,
            "{path} is in sync ({} certificates); nothing would change",
            new.len()
        ),
        OnDisk::Missing => writeln!(
            out,
            "{path} does not exist; it would be created with {} certificates",
            new.len()
        ),
        OnDisk::Other(kind) => writeln!(
            out,
            "{path} is {kind}; it would be replaced by a regular file with {} certificates",
            new.len()
        ),
        OnDisk::Regular { bytes, .. } if diff.added.is_empty() && diff.removed.is_empty() => {
            writeln!(
                out,
                "{path} would change: same {} certificates, {}",
                new.len(),
                same_certificates_change(bytes, &old, new)
            )
        }
        OnDisk::Regular { .. } => writeln!(
            out,
            "{path} would change: {} -> {} certificates ({} added, {} removed)",
            old.len(),
            new.len(),
            diff.added.len(),
            diff.removed.len()
        ),
    };
    out
}
