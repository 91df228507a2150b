//! The registry CA files (`--manage-registries DIR=SPEC,...`, SPEC 4b): one
//! `DIR/<host[:port]>/ca.crt` per registry that the sources name, which container runtimes
//! (CRI-O, podman: containers/image) trust for that registry alone. Pure, like the bundle
//! engine: no I/O, no clock (`now` is passed in), so that every rule is tested here; the
//! reconciliation loop reads the sources and DIR, calls these, and does what the plan says.
//!
//! The way through, one registry set at a time:
//! 1. [`entries`]: each source's entries, `(raw name, bytes)`, from a ControllerConfig list
//!    ([`from_list`]), a ConfigMap's keys ([`from_configmap`]) or a `dir:` source's `.crt`
//!    files ([`from_dir`]); an entry is accepted or refused on its own.
//! 2. [`merge`]: the sources in order; the same registry (the same directory, however
//!    spelt) in two places is taken from the first, the later one reported as shadowed.
//! 3. [`build`]: each registry's content checked by SPEC 4's rules and rendered, a
//!    certificate that is not a CA kept with a warning ([`content`]).
//! 4. [`plan`]: from that, the record of what the agent created, and what is on disk, the
//!    steps to take and the record to keep.
//!
//! The rules, and where each lives:
//! - Names are untrusted ([`name`]): `..` stands for `:`; empty, longer than 253
//!   characters, holding `/`, NUL or a control character, starting with `.`, or not a
//!   host[:port] after the mapping is refused for that entry alone. Nothing outside DIR is
//!   ever named. IPv6 registries are written `[fd00....1]..5000` (or `[fd00::1]:5000`) and
//!   live in `[fd00::1]:5000`.
//! - A bad entry costs its registry alone: a refused name is no registry; a registry whose
//!   content is refused is held as it is on disk; an entry that could be any registry's
//!   holds every removal back ([`entries`]).
//! - Registry files are trust anchors ([`content`]): a non-CA certificate (a registry's
//!   self-signed server certificate) and an expired one are kept, with a warning; a
//!   private key, a torn block, anything but certificates, more than 4 MiB or no
//!   certificate at all rejects the entry. Nothing empty is ever written.
//! - The agent removes only what it created, as recorded; never overwrites an admin's
//!   `ca.crt` (one that already holds the sources' certificates is adopted); never follows
//!   a symbolic link under DIR ([`plan`]).

pub mod content;
pub mod entries;
pub mod name;
pub mod plan;

use std::collections::BTreeMap;

pub use content::{RegistryFile, Warning, WarningKind, registry_file};
pub use entries::{
    Entries, Entry, EntryError, Merged, Place, Refused, Shadowed, from_configmap, from_dir,
    from_list, merge,
};
pub use name::{NameError, NameProblem, RegistryName};
pub use plan::{
    CaFile, Created, CreatedRecord, Desired, LeftAlone, Listing, OnDisk, Plan, Problem,
    ProblemKind, Root, Why, Write, plan, to_look_at,
};

/// A warning about one registry's content, and where the entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryWarning {
    pub name: RegistryName,
    pub place: entries::Place,
    pub warning: Warning,
}

impl std::fmt::Display for RegistryWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: registry {}: {}",
            self.place,
            text_quoted(self.name.dir()),
            self.warning
        )
    }
}

fn text_quoted(text: &str) -> String {
    format!("\"{}\"", crate::text::escape(text))
}

/// A registry set built from its merged sources.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Built {
    /// What to have on disk: the input of [`plan`].
    pub desired: Desired,
    /// Each registry's file, with its certificates (for metrics and `inspect`).
    pub files: BTreeMap<RegistryName, RegistryFile>,
    pub warnings: Vec<RegistryWarning>,
    /// Every refusal: entries that name no registry, and registries whose entry was
    /// refused (those are held in `desired`).
    pub refused: Vec<Refused>,
    pub shadowed: Vec<Shadowed>,
}

/// Checks and renders each registry of `merged` (step 3 of the module doc). `now` is unix
/// seconds, for the expiry warnings.
pub fn build(merged: Merged, now: i64) -> Built {
    let mut built = Built {
        refused: merged.refused,
        shadowed: merged.shadowed,
        ..Built::default()
    };
    built.desired.hold_removals = merged.incomplete;
    for (name, entry) in merged.registries {
        let checked = entry.content.and_then(|bytes| {
            registry_file(&bytes, now).map_err(|rejection| EntryError::Content {
                registry: name.raw().to_string(),
                rejection,
            })
        });
        match checked {
            Ok(file) => {
                built
                    .warnings
                    .extend(file.warnings.iter().map(|warning| RegistryWarning {
                        name: name.clone(),
                        place: entry.place.clone(),
                        warning: warning.clone(),
                    }));
                built.desired.files.insert(name.clone(), file.bytes.clone());
                built.files.insert(name, file);
            }
            Err(error) => {
                built.refused.push(Refused {
                    place: entry.place,
                    error,
                });
                built.desired.held.insert(name);
            }
        }
    }
    built
}

#[cfg(test)]
mod tests;
