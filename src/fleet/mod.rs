//! The fleet's rollout (SPEC 8c): what each node says it holds ([`held`], the annotation
//! on its Node), and what the cluster learns from it.

pub mod events;
pub mod gauges;
pub mod held;
pub mod nodes;
pub mod own_node;
pub mod prefix;
pub mod report;
pub mod show;
pub mod verdict;
