//! Carries out a [`Plan`]: Landlock for files, TCP ports, abstract Unix sockets and
//! signals, at the highest ABI the kernel offers; and a seccomp filter for what Landlock
//! says only from ABI 9 on (a connection to a Unix socket by path: systemd's bus) and for
//! io_uring, whose operations seccomp cannot see.
//!
//! Called once, on the only thread, before the runtime starts: a Landlock domain binds the
//! thread that asks for it and the threads and processes it creates after, so every thread
//! of the agent and every hook it runs is confined.

use std::collections::BTreeMap;
use std::path::Path;

use landlock::{
    ABI, Access as _, AccessFs, AccessNet, BitFlags, LandlockStatus, NetPort, PathBeneath, PathFd,
    Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
};

use super::{Access, Plan};

/// What the confinement holds, as said at start and in `/readyz?verbose`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enforced {
    /// The Landlock ABI in force; None when the kernel has none (or it is turned off).
    pub abi: Option<i32>,
    /// The seccomp filter is in place.
    pub seccomp: bool,
    /// Paths of the plan that did not exist at start, so no rule was made for them.
    pub missing: Vec<std::path::PathBuf>,
    /// The identity (device, inode) of each place a rule holds: a rule holds that inode,
    /// not the path.
    pub held: BTreeMap<std::path::PathBuf, (u64, u64)>,
    /// What could not be done, when something could not.
    pub problems: Vec<String>,
}

impl Enforced {
    /// The line of `/readyz?verbose` (`confinement`), never counted: a kernel without
    /// Landlock is a warning, not a reason to be unready.
    pub fn check(&self) -> crate::status::Check {
        crate::status::Check::shown("confinement".into(), None)
            .detailed(self.summary())
            .warned(self.warning())
    }

    /// What the confinement holds, in a few words.
    pub fn summary(&self) -> String {
        let landlock = match self.abi {
            Some(abi) => {
                let mut what = vec!["files"];
                if abi >= 4 {
                    what.push("TCP ports");
                }
                if abi >= 6 {
                    what.push("signals and abstract Unix sockets");
                }
                if abi >= 9 {
                    what.push("Unix sockets by path");
                }
                format!("Landlock ABI {abi} ({})", what.join(", "))
            }
            None => "no Landlock".to_string(),
        };
        let seccomp = if self.seccomp {
            "seccomp (no Unix stream sockets, no io_uring)"
        } else {
            "no seccomp filter"
        };
        format!("{landlock}; {seccomp}")
    }

    /// Why the confinement is less than the plan, when it is.
    pub fn warning(&self) -> Option<String> {
        let mut what = Vec::new();
        match self.abi {
            None => what.push(
                "the kernel has no Landlock: files and ports are not confined (it needs Linux 5.13 or later with landlock in its lsm= list)".to_string(),
            ),
            Some(abi) if abi < 4 => what.push(format!(
                "Landlock ABI {abi} confines files but not TCP ports (ABI 4, Linux 6.7) nor signals and abstract sockets (ABI 6, Linux 6.12)"
            )),
            Some(abi) if abi < 6 => what.push(format!(
                "Landlock ABI {abi} confines files and TCP ports but not signals and abstract sockets (ABI 6, Linux 6.12)"
            )),
            Some(_) => {}
        }
        if !self.seccomp {
            what.push(
                "no seccomp filter: Unix stream sockets (systemd's bus) are not refused".into(),
            );
        }
        what.extend(self.problems.iter().cloned());
        (!what.is_empty()).then(|| what.join("; "))
    }
}

/// Confines this thread, and every thread and process it creates after, to `plan`. Never
/// fails the agent: what cannot be enforced is said in the result.
pub fn enforce(plan: &Plan) -> Enforced {
    let mut enforced = Enforced {
        abi: None,
        seccomp: false,
        missing: Vec::new(),
        held: identities(plan.paths.iter().map(|r| r.path.as_path())),
        problems: Vec::new(),
    };
    match landlock(plan, &mut enforced.missing) {
        Ok(status) => {
            // The crate's own ABI is capped at what it knows; the kernel's may be newer.
            enforced.abi = match status.landlock {
                LandlockStatus::Available {
                    effective_abi,
                    kernel_abi,
                } => Some(kernel_abi.unwrap_or(effective_abi as i32)),
                _ => None,
            };
            if status.ruleset == RulesetStatus::NotEnforced {
                enforced.abi = None;
            }
        }
        Err(e) => enforced
            .problems
            .push(format!("Landlock could not be set up: {e}")),
    }
    match seccomp() {
        Ok(()) => enforced.seccomp = true,
        Err(e) => enforced
            .problems
            .push(format!("the seccomp filter could not be set up: {e}")),
    }
    enforced
}

/// The rights behind each [`Access`] on a directory.
pub(super) fn rights(access: Access) -> BitFlags<AccessFs> {
    use landlock::make_bitflags;
    match access {
        Access::ReadFile => AccessFs::ReadFile.into(),
        Access::Read => make_bitflags!(AccessFs::{ReadFile | ReadDir}),
        Access::Replace => make_bitflags!(AccessFs::{
            ReadFile | ReadDir | WriteFile | Truncate | MakeReg | RemoveFile
        }),
        Access::Make => make_bitflags!(AccessFs::{
            ReadFile | ReadDir | WriteFile | Truncate | MakeReg | RemoveFile | MakeDir
        }),
        Access::Own => make_bitflags!(AccessFs::{
            ReadFile | ReadDir | WriteFile | Truncate | MakeReg | RemoveFile | MakeDir | RemoveDir
        }),
        Access::Run => make_bitflags!(AccessFs::{Execute | ReadFile}),
        Access::RunAll => make_bitflags!(AccessFs::{Execute | ReadFile | ReadDir}),
        Access::Device => make_bitflags!(AccessFs::{ReadFile | WriteFile | IoctlDev}),
        Access::Notify => AccessFs::ResolveUnix.into(),
    }
}

/// The rights of a directory that a rule on a file cannot carry.
pub(super) fn file_rights(rights: BitFlags<AccessFs>) -> BitFlags<AccessFs> {
    rights
        & landlock::make_bitflags!(AccessFs::{
            ReadFile | WriteFile | Truncate | Execute | IoctlDev | ResolveUnix
        })
}

fn landlock(
    plan: &Plan,
    missing: &mut Vec<std::path::PathBuf>,
) -> Result<landlock::RestrictionStatus, landlock::RulesetError> {
    let best = ABI::V10;
    let scopes = if plan.abstract_unix {
        BitFlags::from(Scope::Signal)
    } else {
        landlock::make_bitflags!(Scope::{Signal | AbstractUnixSocket})
    };
    let mut ruleset = Ruleset::default()
        .handle_access(AccessFs::from_all(best))?
        .handle_access(landlock::make_bitflags!(AccessNet::{BindTcp | ConnectTcp}))?
        .scope(scopes)?
        .create()?;
    for rule in &plan.paths {
        let Ok(fd) = PathFd::new(&rule.path) else {
            missing.push(rule.path.clone());
            continue;
        };
        let mut access = rights(rule.access);
        if !is_dir(&rule.path) {
            access = file_rights(access);
        }
        ruleset = ruleset.add_rule(PathBeneath::new(fd, access))?;
    }
    for port in plan.connect.keys() {
        ruleset = ruleset.add_rule(NetPort::new(*port, AccessNet::ConnectTcp))?;
    }
    if let Some(port) = plan.bind {
        ruleset = ruleset.add_rule(NetPort::new(port, AccessNet::BindTcp))?;
    }
    ruleset.restrict_self()
}

/// The identity (device, inode) of each of `paths` that exists now.
pub fn identities<'a>(
    paths: impl Iterator<Item = &'a Path>,
) -> BTreeMap<std::path::PathBuf, (u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    paths
        .filter_map(|p| {
            let m = std::fs::metadata(p).ok()?;
            Some((p.to_path_buf(), (m.dev(), m.ino())))
        })
        .collect()
}

pub(super) fn is_dir(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_dir())
}

/// Refuses, in every thread, a Unix stream or seqpacket socket (systemd's bus, its private
/// socket, any local service on one; `sd_notify` is a datagram and stays allowed), and
/// io_uring (its operations would pass around this filter). Each is refused with EACCES.
fn seccomp() -> Result<(), seccompiler::Error> {
    use nix::libc;
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
        SeccompRule, TargetArch,
    };
    let unix = |kind: i32| -> Result<SeccompRule, seccompiler::BackendError> {
        SeccompRule::new(vec![
            SeccompCondition::new(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                libc::AF_UNIX as u64,
            )?,
            // The type without SOCK_NONBLOCK and SOCK_CLOEXEC.
            SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(0xf),
                kind as u64,
            )?,
        ])
    };
    let rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::from([
        (
            libc::SYS_socket,
            vec![unix(libc::SOCK_STREAM)?, unix(libc::SOCK_SEQPACKET)?],
        ),
        (libc::SYS_io_uring_setup, vec![]),
        (libc::SYS_io_uring_enter, vec![]),
        (libc::SYS_io_uring_register, vec![]),
    ]);
    let arch = TargetArch::try_from(std::env::consts::ARCH)?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EACCES as u32),
        arch,
    )?;
    let program: seccompiler::BpfProgram = filter.try_into()?;
    seccompiler::apply_filter_all_threads(&program)
}
