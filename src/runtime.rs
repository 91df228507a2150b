//! What the long-running commands (`run`, `publish`) share beneath their loops: the async
//! runtime, and how memory is given back after a large pass ([`allocator`]).

pub mod allocator;

use anyhow::Context;

/// The runtime of a long-running command (`run`, `publish`): two worker threads for the
/// endpoint, the watches and the signals, with one crypto provider for the whole process
/// (ring, the one kube-rs is built with).
pub fn build() -> anyhow::Result<tokio::runtime::Runtime> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kubelet-ca-agent-io")
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}
