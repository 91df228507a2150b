//! What the agent keeps on disk, one kind of target to a module, beneath the loops that
//! drive them (the daemon's reconciler, and `sync`'s one pass): the kubelet's bundle and
//! each `--manage` file ([`file`], applied and recorded by [`apply`]), and each registry
//! set ([`registry_set`]). Each reads its sources, decides what to do from what they say
//! and what is on disk ([`policy`], pure; the registry module's plan), carries it out, and
//! reports its status (health lines, metrics, managed-files entries). [`schedule`] holds
//! when each target's local sources are read again, retried and due for a pass.

pub mod apply;
pub mod file;
pub mod policy;
pub mod registry_set;
pub mod schedule;
