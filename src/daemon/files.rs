//! Change notifications for the files the daemon cares about, through inotify: the managed
//! bundle (drift) and the `file:` and `dir:` sources. Directories are watched, not files,
//! so that a rename over a file, a delete and re-create, or a projected volume swapping its
//! `..data` link are all seen.

use std::collections::BTreeMap;

use anyhow::Context;
use std::path::{Path, PathBuf};

use notify::event::{AccessKind, AccessMode, EventKind};
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc::UnboundedSender;

use crate::source::SourceSpec;
use crate::writer::atomic::parent_dir;

/// Something changed on disk that the loop should look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsEvent {
    /// The managed bundle was written, replaced, changed or deleted.
    Bundle,
    /// A local source (by position in `--source` order) may have changed.
    Source(usize),
    /// Events were lost (the inotify queue overflowed): look at everything again.
    Rescan,
}

/// Starts watching; events arrive on `events` until the returned watcher is dropped.
pub fn watch(
    bundle: &Path,
    sources: &[SourceSpec],
    events: UnboundedSender<FsEvent>,
) -> anyhow::Result<RecommendedWatcher> {
    // notify reports absolute paths (it joins a relative watch path to the working
    // directory), so the paths matched against them must be absolute too.
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let bundle = absolute(bundle);
    let bundle_dir = parent_dir(&bundle);
    // For each local source, the directory whose entries concern it.
    let source_dirs: Vec<(usize, PathBuf)> = sources
        .iter()
        .enumerate()
        .filter_map(|(i, spec)| match spec {
            SourceSpec::File(path) => Some((i, parent_dir(&absolute(path)))),
            SourceSpec::Dir(dir) => Some((i, absolute(dir))),
            _ => None,
        })
        .collect();
    let our_temp_prefix = format!(
        ".{}.kubelet-ca-agent-tmp.",
        bundle.file_name().unwrap_or_default().to_string_lossy()
    );

    let handler = {
        let (bundle, bundle_dir, source_dirs) =
            (bundle.clone(), bundle_dir.clone(), source_dirs.clone());
        move |result: notify::Result<notify::Event>| {
            let event = match result {
                Ok(event) if !event.need_rescan() => event,
                _ => {
                    let _ = events.send(FsEvent::Rescan);
                    return;
                }
            };
            // Reads (our own included) must not wake the loop, or it would chase itself.
            if let EventKind::Access(kind) = event.kind
                && kind != AccessKind::Close(AccessMode::Write)
            {
                return;
            }
            for path in &event.paths {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                if name.starts_with(&our_temp_prefix) {
                    continue;
                }
                let dir = parent_dir(path);
                if path == &bundle
                    || (dir == bundle_dir
                        && name == bundle.file_name().unwrap_or_default().to_string_lossy())
                {
                    let _ = events.send(FsEvent::Bundle);
                }
                for (index, source_dir) in &source_dirs {
                    if &dir == source_dir {
                        let _ = events.send(FsEvent::Source(*index));
                    }
                }
            }
        }
    };
    let mut watcher = notify::recommended_watcher(handler)?;
    // Each directory once, with what it is for, so that an error can say so.
    let mut dirs: BTreeMap<PathBuf, String> = BTreeMap::new();
    dirs.insert(
        bundle_dir,
        format!("the directory of the bundle {}", bundle.display()),
    );
    for (index, dir) in source_dirs {
        dirs.entry(dir)
            .or_insert_with(|| format!("the directory of source {}", sources[index]));
    }
    for (dir, role) in dirs {
        if !dir.is_dir() {
            anyhow::bail!("{} does not exist ({role})", dir.display());
        }
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .with_context(|| format!("cannot watch {} ({role})", dir.display()))?;
    }
    Ok(watcher)
}
