//! A rotation timed as SPEC 11 times it, against the local API server: from the watch event
//! leaving the server (flushed to the agent's socket) to the agent's line saying the new
//! file is durable (`bundle written`, `registry CA written`), read from its stderr pipe.
//! The agent logs that line only after the directory's fsync, so the clock stops a little
//! after the file is durable: an upper bound, never a flattering one.

use std::time::Duration;

use crate::agent::Agent;
use crate::apiserver::ApiServer;

/// `update` (a write to `api` that changes what the agent's source holds) timed to the
/// agent's `bundle written` line for the bundle whose SHA-256 is `hash`.
pub fn bundle(api: &ApiServer, agent: &Agent, hash: &str, update: impl FnOnce()) -> Duration {
    timed(api, agent, "bundle written", hash, update, |_| {})
}

/// `update` timed to the agent's line with `message` and `hash`. The lines the agent logged
/// before the update are thrown away; each line it logs until then is shown to `seen` (those
/// thrown away too).
pub fn timed(
    api: &ApiServer,
    agent: &Agent,
    message: &str,
    hash: &str,
    update: impl FnOnce(),
    mut seen: impl FnMut(&str),
) -> Duration {
    agent.drain_lines(&mut seen);
    update();
    let written = agent.logged(message, hash, seen);
    let sent = api.last_event_sent().expect("an event was sent");
    written.saturating_duration_since(sent)
}
