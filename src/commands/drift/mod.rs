//! `drift`: keeps the files the agent manages out of configuration-drift checks and out of
//! rendered node configs (SPEC 8). `exclusions` prints them as rules for drift monitors and
//! file-integrity tools; `check` compares a rendered config with the disk, leaving them out;
//! `strip` removes them from a rendered config, so that its renderer stops carrying them.
//!
//! Every failure exits 2, so that exit 1 from `check` always means drift.

pub mod check;
pub mod content;
pub mod rendered;

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::cli::{
    DriftCheckArgs, DriftCommand, DriftExclusionsArgs, DriftOutput, DriftStripArgs,
    ExclusionFormat, ManagedArgs,
};
use crate::error::{Exit, UsageError};
use crate::fsutil::{Links, open_regular, read_bounded};
use crate::state::StateDir;
use crate::text::escape;
use check::{Drift, Found, Root};
use content::Expected;
use rendered::{Rendered, normalize};

pub fn run(command: DriftCommand) -> anyhow::Result<Exit> {
    match command {
        DriftCommand::Exclusions(args) => exclusions(args),
        DriftCommand::Check(args) => check(args),
        DriftCommand::Strip(args) => strip(args),
    }
}

/// The files the agent manages, and where that was learnt.
#[derive(Debug)]
struct Managed {
    files: Vec<ManagedFile>,
    /// `managed-files.json`, or `None` when the flags said (it did not exist yet).
    record: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct ManagedFile {
    path: PathBuf,
    /// The SHA-256 of its content when the agent last wrote or verified it; unknown when
    /// taken from the flags.
    sha256: Option<String>,
    /// A managed kubeconfig: the agent keeps its CA data alone, so a drift check compares
    /// the rest of it, and `strip` leaves it in (a new node needs it at first boot).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    kubeconfig: bool,
}

impl Managed {
    fn load(args: &ManagedArgs) -> Result<Managed, UsageError> {
        let state = StateDir::new(args.state_dir.clone());
        let record = state.managed_files_path();
        match state.load_managed_files() {
            Ok(Some(recorded)) => Ok(Managed {
                files: recorded
                    .files
                    .into_iter()
                    .map(|f| ManagedFile {
                        kubeconfig: f.kind.as_deref() == Some(crate::state::KUBECONFIG_KIND),
                        path: f.path,
                        sha256: Some(f.sha256),
                    })
                    .collect(),
                record: Some(record),
            }),
            Ok(None) => {
                let paths = std::iter::once(("--bundle", &args.bundle))
                    .chain(args.manage.iter().map(|m| ("--manage", &m.path)))
                    .chain(
                        args.manage_kubeconfig
                            .iter()
                            .map(|m| ("--manage-kubeconfig", &m.path)),
                    );
                let files = paths
                    .map(|(flag, path)| {
                        let absolute = std::path::absolute(path).map_err(|e| {
                            UsageError(format!(
                                "{flag} {}: {e}",
                                escape(&path.display().to_string())
                            ))
                        })?;
                        Ok(ManagedFile {
                            path: absolute,
                            sha256: None,
                            kubeconfig: flag == "--manage-kubeconfig",
                        })
                    })
                    .collect::<Result<_, UsageError>>()?;
                Ok(Managed {
                    files,
                    record: None,
                })
            }
            Err(e) => Err(UsageError(format!(
                "cannot read {}: {e} (it lists the managed files; remove it and run `kubelet-ca-agent sync` to write it again)",
                escape(&record.display().to_string())
            ))),
        }
    }

    /// The managed paths as the rendered config would name them: each path as recorded,
    /// and, when it lies under `root`, as seen from inside `root` (the agent may record
    /// `/sysroot/etc/kubernetes/kubelet-ca.crt` for a config that says
    /// `/etc/kubernetes/kubelet-ca.crt`).
    fn node_paths(&self, root: &Path) -> Vec<PathBuf> {
        self.node_paths_of(root, |_| true)
    }

    /// [`Managed::node_paths`] of the managed kubeconfigs alone.
    fn kubeconfig_node_paths(&self, root: &Path) -> Vec<PathBuf> {
        self.node_paths_of(root, |f| f.kubeconfig)
    }

    fn node_paths_of(&self, root: &Path, which: impl Fn(&ManagedFile) -> bool) -> Vec<PathBuf> {
        let mut roots = vec![normalize(
            &std::path::absolute(root).unwrap_or_else(|_| root.to_path_buf()),
        )];
        if let Ok(real) = root.canonicalize() {
            roots.push(real);
        }
        let mut paths = Vec::new();
        for file in self.files.iter().filter(|f| which(f)) {
            let path = normalize(&file.path);
            for root in &roots {
                if let Ok(inside) = path.strip_prefix(root) {
                    paths.push(normalize(&Path::new("/").join(inside)));
                }
            }
            paths.push(path);
        }
        paths.sort();
        paths.dedup();
        paths
    }
}

// ---- exclusions ----

fn exclusions(args: DriftExclusionsArgs) -> anyhow::Result<Exit> {
    let managed = Managed::load(&args.managed)?;
    let sets = registry_sets(&args.managed);
    let mut out = String::new();
    match args.format {
        ExclusionFormat::Plain => {
            // Each path, then the glob of the temporary files its writes create.
            for file in &managed.files {
                out.push_str(&escape(&file.path.display().to_string()));
                out.push('\n');
                out.push_str(&escape(&temporary_glob(&file.path)));
                out.push('\n');
            }
            for set in &sets {
                for glob in set_globs(set) {
                    out.push_str(&escape(&glob));
                    out.push('\n');
                }
            }
        }
        ExclusionFormat::Aide => {
            for file in &managed.files {
                out.push_str(&format!(
                    "!{}$\n",
                    aide_regex(&file.path.display().to_string())
                ));
                out.push_str(&format!("!{}\n", temporary_aide_regex(&file.path)));
            }
            for set in &sets {
                out.push_str(&format!("!{}\n", set_aide_regex(set)));
            }
        }
        ExclusionFormat::Json => {
            #[derive(Serialize)]
            struct File<'a> {
                #[serde(flatten)]
                file: &'a ManagedFile,
                /// The temporary files a write creates beside it, as a glob.
                temporary: String,
            }
            #[derive(Serialize)]
            struct Set {
                /// A `--manage-registries` directory.
                directory: PathBuf,
                /// What the agent creates under it, as globs: each registry's directory,
                /// its CA file and the CA file's temporary files.
                paths: Vec<String>,
            }
            #[derive(Serialize)]
            struct Exclusions<'a> {
                /// `managed-files.json`, or null when the paths come from the flags.
                record: Option<&'a Path>,
                files: Vec<File<'a>>,
                registry_sets: Vec<Set>,
            }
            let json = Exclusions {
                record: managed.record.as_deref(),
                files: managed
                    .files
                    .iter()
                    .map(|file| File {
                        file,
                        temporary: temporary_glob(&file.path),
                    })
                    .collect(),
                registry_sets: sets
                    .iter()
                    .map(|set| Set {
                        directory: set.clone(),
                        paths: set_globs(set),
                    })
                    .collect(),
            };
            out = serde_json::to_string_pretty(&json)? + "\n";
        }
    }
    print_out(out.as_bytes())?;
    Ok(Exit::Success)
}

/// The registry directories the agent manages (`--manage-registries`): those recorded in
/// the state directory by `run` and `sync`, and those the flags name, each once.
fn registry_sets(args: &ManagedArgs) -> Vec<PathBuf> {
    let state = StateDir::new(args.state_dir.clone());
    let (recorded, _) = state.load_registry_record();
    let mut sets: Vec<PathBuf> = recorded
        .sets
        .into_keys()
        .chain(args.manage_registries.iter().map(|s| s.dir.clone()))
        .map(|p| normalize(&std::path::absolute(&p).unwrap_or(p)))
        .collect();
    sets.sort();
    sets.dedup();
    sets
}

/// The glob of the temporary files that a write of `path` creates beside it
/// (`.NAME.kubelet-ca-agent-tmp.*`, renamed over `path` or removed).
fn temporary_glob(path: &Path) -> String {
    let (dir, name) = dir_and_name(path);
    format!("{dir}/.{name}{}*", crate::writer::atomic::TEMP_MARKER)
}

/// [`temporary_glob`] as an AIDE regex: every `.` escaped, then any name to the end.
fn temporary_aide_regex(path: &Path) -> String {
    let (dir, name) = dir_and_name(path);
    format!(
        "{}/{}[^/]*$",
        aide_regex(&dir),
        strict_regex(&format!(".{name}{}", crate::writer::atomic::TEMP_MARKER))
    )
}

/// What the agent creates under a registry directory: one directory per registry, its
/// `ca.crt`, and the temporary files of a write of it.
fn set_globs(set: &Path) -> Vec<String> {
    let dir = set.display().to_string();
    let name = crate::registry::plan::CA_FILE;
    vec![
        format!("{dir}/*"),
        format!("{dir}/*/{name}"),
        format!("{dir}/*/.{name}{}*", crate::writer::atomic::TEMP_MARKER),
    ]
}

/// [`set_globs`] as one AIDE regex: a registry's directory, and under it the CA file and
/// its temporary files.
fn set_aide_regex(set: &Path) -> String {
    let name = crate::registry::plan::CA_FILE;
    format!(
        "{}/[^/]+(/({}|{}[^/]*))?$",
        aide_regex(&set.display().to_string()),
        strict_regex(name),
        strict_regex(&format!(".{name}{}", crate::writer::atomic::TEMP_MARKER))
    )
}

fn dir_and_name(path: &Path) -> (String, String) {
    let dir = crate::writer::atomic::parent_dir(path)
        .display()
        .to_string();
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    (dir.trim_end_matches('/').to_string(), name)
}

/// [`aide_regex`] with `.` escaped too: for the patterns this command makes up, where a
/// `.` must match only itself.
fn strict_regex(text: &str) -> String {
    aide_regex(text).replace('.', "\\.")
}

/// A path as an AIDE selection regex matching only it. AIDE's own examples leave `.`
/// as it is (`!/etc/kubernetes/kubelet-ca.crt$`); every other character that means
/// something to a regex or to AIDE's config syntax (whitespace ends a rule, `#` starts a
/// comment) is escaped, and so is any control character.
fn aide_regex(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        match c {
            '\\' | '^' | '$' | '|' | '?' | '*' | '+' | '(' | ')' | '[' | ']' | '{' | '}' | '#' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_whitespace() || c.is_control() || c == '\u{7f}' => {
                for byte in c.to_string().bytes() {
                    out.push_str(&format!("\\x{byte:02x}"));
                }
            }
            c => out.push(c),
        }
    }
    escape(&out).into_owned()
}

// ---- check ----

#[derive(Serialize)]
struct Report {
    /// The rendered config's Ignition version.
    ignition_version: String,
    drifted: Vec<Drifted>,
    /// Files whose content could not be compared offline.
    not_checked: Vec<NotChecked>,
    /// Files of the config that match the disk.
    in_sync: usize,
    /// Files of the config that the agent manages: never compared.
    managed_left_out: usize,
    /// Files that could not be looked at (the check is then incomplete: exit 2).
    errors: Vec<LookError>,
}

#[derive(Serialize)]
struct Drifted {
    path: String,
    /// Where the file is in the rendered config: `storage.files[3]`.
    entry: String,
    drift: Vec<Drift>,
}

#[derive(Serialize)]
struct NotChecked {
    path: String,
    entry: String,
    reason: String,
}

#[derive(Serialize)]
struct LookError {
    path: String,
    error: String,
}

fn check(args: DriftCheckArgs) -> anyhow::Result<Exit> {
    let managed = Managed::load(&args.managed)?;
    let (text, name) = read_rendered(&args.rendered)?;
    let rendered = parse(&text, &name)?;
    let shown_root = escape(&args.root.display().to_string()).into_owned();
    let root =
        Root::open(&args.root).map_err(|e| UsageError(format!("--root {shown_root}: {e}")))?;
    let managed_paths = managed.node_paths(&args.root);
    let kubeconfigs = managed.kubeconfig_node_paths(&args.root);
    let mut report = Report {
        ignition_version: rendered.version.clone(),
        drifted: Vec::new(),
        not_checked: Vec::new(),
        in_sync: 0,
        managed_left_out: 0,
        errors: Vec::new(),
    };
    for file in &rendered.files {
        let path = file.normalized();
        let kubeconfig = kubeconfigs.contains(&path);
        if managed_paths.contains(&path) && !kubeconfig {
            report.managed_left_out += 1;
            continue;
        }
        let expected = content::expected(file).map_err(|e| invalid(&name, e))?;
        let read = matches!(expected, Expected::Exact(_) | Expected::EndsWith(_));
        let found = match root.look(&path, read) {
            Ok(found) => found,
            Err(e) => {
                report.errors.push(LookError {
                    path: file.path.clone(),
                    error: e.to_string(),
                });
                continue;
            }
        };
        // A file that is not there has no content to leave unchecked.
        if let (Expected::Remote(scheme), Found::Regular { .. }) = (&expected, &found) {
            report.not_checked.push(NotChecked {
                path: file.path.clone(),
                entry: file.at.to_string(),
                // The scheme only: a pre-signed URL carries a credential.
                reason: format!(
                    "its content comes from a {scheme}: URL, which cannot be fetched offline"
                ),
            });
        }
        // A managed kubeconfig's CA data is the agent's: the rest of it is compared.
        let expected = match (kubeconfig, expected, &found) {
            (
                true,
                Expected::Exact(bytes),
                Found::Regular {
                    content: Some(content),
                    ..
                },
            ) if crate::kubeconfig::same_but_ca_data(&bytes, content) => {
                Expected::Exact(content.clone())
            }
            (_, expected, _) => expected,
        };
        let drift = check::judge(file.mode, &expected, &found);
        if drift.is_empty() {
            report.in_sync += 1;
        } else {
            report.drifted.push(Drifted {
                path: file.path.clone(),
                entry: file.at.to_string(),
                drift,
            });
        }
    }
    let out = match args.output {
        DriftOutput::Json => serde_json::to_string_pretty(&report)? + "\n",
        DriftOutput::Text => text_report(&report, rendered.files.len()),
    };
    print_out(out.as_bytes())?;
    if let Some(first) = report.errors.first() {
        return Err(UsageError(format!(
            "cannot check {}: {} ({} file(s) could not be looked at; the check is incomplete)",
            escape(&first.path),
            first.error,
            report.errors.len()
        ))
        .into());
    }
    Ok(if report.drifted.is_empty() {
        Exit::Success
    } else {
        Exit::Failure
    })
}

fn text_report(report: &Report, total: usize) -> String {
    let mut out = String::new();
    for file in &report.drifted {
        for drift in &file.drift {
            out.push_str(&format!("{}: {drift}\n", escape(&file.path)));
        }
    }
    for file in &report.not_checked {
        out.push_str(&format!(
            "{}: content not checked: {}\n",
            escape(&file.path),
            escape(&file.reason)
        ));
    }
    let compared = total - report.managed_left_out;
    let mut notes = Vec::new();
    if !report.not_checked.is_empty() {
        notes.push(format!(
            "{} with content not checked offline",
            report.not_checked.len()
        ));
    }
    if report.managed_left_out > 0 {
        notes.push(format!(
            "{} managed by kubelet-ca-agent left out",
            report.managed_left_out
        ));
    }
    let notes = if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join("; "))
    };
    if report.drifted.is_empty() {
        out.push_str(&format!(
            "no drift: {} of {compared} files match the rendered config{notes}\n",
            report.in_sync
        ));
    } else {
        out.push_str(&format!(
            "drift: {} of {compared} files differ from the rendered config{notes}\n",
            report.drifted.len()
        ));
    }
    out
}

// ---- strip ----

fn strip(args: DriftStripArgs) -> anyhow::Result<Exit> {
    let managed = Managed::load(&args.managed)?;
    let (text, name) = read_rendered(&args.rendered)?;
    let rendered = parse(&text, &name)?;
    let managed_paths = managed.node_paths(&args.root);
    // A managed kubeconfig stays: a new node needs it at first boot.
    let kubeconfigs = managed.kubeconfig_node_paths(&args.root);
    let remove: Vec<bool> = rendered
        .files
        .iter()
        .map(|f| managed_paths.contains(&f.normalized()) && !kubeconfigs.contains(&f.normalized()))
        .collect();
    for (file, _) in rendered.files.iter().zip(&remove).filter(|(_, r)| **r) {
        tracing::info!(entry = %file.at, path = %file.path, "removed a managed file from the rendered config");
    }
    print_out(rendered::without(&text, &rendered.files, &remove).as_bytes())?;
    Ok(Exit::Success)
}

// ---- shared ----

/// The largest rendered config read: a MachineConfig is stored in etcd, which holds
/// objects of a few MiB at most.
const MAX_RENDERED_BYTES: usize = 64 << 20;

/// The rendered config's text, and its name for messages. `-` reads standard input.
fn read_rendered(path: &Path) -> Result<(String, String), UsageError> {
    let name = if path == Path::new("-") {
        "standard input".to_string()
    } else {
        escape(&path.display().to_string()).into_owned()
    };
    let unreadable = |e: io::Error| UsageError(format!("cannot read {name}: {e}"));
    let bytes = if path == Path::new("-") {
        read_bounded(io::stdin().lock(), MAX_RENDERED_BYTES).map_err(unreadable)?
    } else {
        match open_regular(path, Links::Follow).map_err(unreadable)? {
            Ok((file, _)) => read_bounded(&file, MAX_RENDERED_BYTES).map_err(unreadable)?,
            Err(kind) => {
                return Err(UsageError(format!(
                    "cannot read {name}: it is {kind}, not a regular file (use - to read standard input)"
                )));
            }
        }
    };
    if bytes.len() > MAX_RENDERED_BYTES {
        return Err(UsageError(format!(
            "{name} is larger than {} MiB: not a rendered config",
            MAX_RENDERED_BYTES >> 20
        )));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        UsageError(format!(
            "{name}: not valid JSON: not UTF-8 at byte {}",
            e.utf8_error().valid_up_to()
        ))
    })?;
    Ok((text, name))
}

fn parse(text: &str, name: &str) -> Result<Rendered, UsageError> {
    rendered::parse(text).map_err(|e| invalid(name, e))
}

fn invalid(name: &str, e: rendered::Invalid) -> UsageError {
    UsageError(format!("{name}: {}", escape(&e.to_string())))
}

/// Writes to standard output; a reader that went away (`| head`) is not an error.
fn print_out(bytes: &[u8]) -> io::Result<()> {
    let mut stdout = io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_drift_flag_can_be_set_from_the_environment() {
        use clap::CommandFactory;
        let cli = crate::cli::Cli::command();
        let drift = cli.find_subcommand("drift").expect("drift");
        for command in drift.get_subcommands() {
            for arg in command.get_arguments() {
                if arg.get_long().is_some() && !["help"].contains(&arg.get_id().as_str()) {
                    let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
                    let expected = format!(
                        "KUBELET_CA_AGENT_{}",
                        arg.get_long().unwrap().to_uppercase().replace('-', "_")
                    );
                    assert_eq!(env, Some(expected), "drift {}", command.get_name());
                }
            }
        }
    }

    #[test]
    fn aide_rules_match_only_the_path() {
        assert_eq!(
            aide_regex("/etc/kubernetes/kubelet-ca.crt"),
            "/etc/kubernetes/kubelet-ca.crt"
        );
        assert_eq!(aide_regex("/a b/c+(1)#"), "/a\\x20b/c\\+\\(1\\)\\#");
        assert_eq!(aide_regex("/x\ny$"), "/x\\x0ay\\$");
    }

    #[test]
    fn managed_paths_are_seen_from_inside_the_root() {
        let managed = Managed {
            files: vec![ManagedFile {
                path: "/sysroot/etc/kubernetes/kubelet-ca.crt".into(),
                sha256: None,
                kubeconfig: false,
            }],
            record: None,
        };
        let paths = managed.node_paths(Path::new("/sysroot/"));
        assert!(paths.contains(&PathBuf::from("/etc/kubernetes/kubelet-ca.crt")));
        assert!(paths.contains(&PathBuf::from("/sysroot/etc/kubernetes/kubelet-ca.crt")));
        assert_eq!(
            managed.node_paths(Path::new("/")),
            [PathBuf::from("/sysroot/etc/kubernetes/kubelet-ca.crt")]
        );
    }
}
