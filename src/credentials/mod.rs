//! The agent's own credentials for the API server, followed for as long as it runs: the
//! kubeconfig (or the pod's service account) and every file it names. A change to any of
//! them, the once-a-minute re-reading, or an answer that proves them stale (a 401, a server
//! certificate the trusted CA does not sign) reads them again; when what they hold has
//! changed, a new client is built and every user of the client takes it for its next request.
//!
//! Credentials that cannot be used (missing at first boot, half written, a certificate that
//! does not go with its key) never end the process: the last good client is kept, and until
//! there is one the cluster sources report why they are down. The kubelet's client
//! certificate rotates every few weeks, and the API server's CA now and then; kube-rs reads
//! both once, when a client is built, so it is here that they are followed.

pub mod client;
pub mod load;
pub mod tls;

pub use client::client;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;

use crate::files::{self, FsEvent, Plan};
pub use load::{HeldCertificate, Origin, Pick};

/// The credentials are read again this often, whatever inotify says.
pub const REREAD_EVERY: Duration = Duration::from_secs(60);
/// Credentials that could not be used are read again from 1 s, doubling, up to a minute:
/// as a local source is (a file being written is usually whole within a second).
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);
/// A writer's create+write+close, or a certificate and key replaced together: one reading.
const SETTLE: Duration = Duration::from_millis(5);
/// An answer proving the credentials stale reads them again at most this often.
const STALE_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// When the follower reads the credentials again, pure: after a failed reading, from
/// [`RETRY_FIRST`] doubling to [`RETRY_MAX`]; whatever happens, every [`REREAD_EVERY`]; on a
/// change on disk at once; when an answer proves them stale, at most once a
/// [`STALE_MIN_INTERVAL`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rereads {
    retry_delay: Duration,
    retry_at: Option<Instant>,
    reread_at: Instant,
    last_stale: Option<Instant>,
}

impl Rereads {
    fn new(now: Instant) -> Rereads {
        Rereads {
            retry_delay: RETRY_FIRST,
            retry_at: None,
            reread_at: now + REREAD_EVERY,
            last_stale: None,
        }
    }

    /// A reading succeeded: no retry is pending, and the next failure starts over.
    fn read_ok(&mut self) {
        self.retry_delay = RETRY_FIRST;
        self.retry_at = None;
    }

    /// A reading failed at `now`: the next is after the delay, which doubles.
    fn read_failed(&mut self, now: Instant) {
        self.retry_at = Some(now + self.retry_delay);
        self.retry_delay = (self.retry_delay * 2).min(RETRY_MAX);
    }

    /// When to read again if nothing happens before.
    fn deadline(&self) -> Instant {
        self.retry_at
            .map_or(self.reread_at, |r| r.min(self.reread_at))
    }

    /// An answer proved them stale at `now`: the instant to read them (now, or one
    /// [`STALE_MIN_INTERVAL`] after the last such reading).
    fn stale(&mut self, now: Instant) -> Instant {
        let at = match self.last_stale {
            Some(last) if now.duration_since(last) < STALE_MIN_INTERVAL => {
                last + STALE_MIN_INTERVAL
            }
            _ => now,
        };
        self.last_stale = Some(at);
        at
    }

    /// A reading is about to happen at `now`: the once-a-minute one, if due, moves on.
    fn reading(&mut self, now: Instant) {
        if now >= self.reread_at {
            self.reread_at = now + REREAD_EVERY;
        }
    }
}

/// The client as the credentials on disk allow now.
#[derive(Clone, Default)]
pub struct Current {
    /// The client of the last good credentials; `None` until there have been any.
    pub client: Option<kube::Client>,
    /// Counts the clients built: a watch opened on an older one is resumed on this one.
    pub generation: u64,
    /// Why the credentials on disk cannot be used now (a client, if any, is the last good one).
    pub problem: Option<String>,
    /// Whether the credentials have been read at least once (before that, nothing is known
    /// and nothing is reported).
    pub read: bool,
    /// The API server (`https://HOST:PORT`), once known.
    pub server: Option<String>,
    /// Where the CA trusted for the server comes from.
    pub ca_origin: Option<String>,
    /// Where the client certificate comes from, when there is one.
    pub client_certificate_origin: Option<String>,
    /// The certificates of the client in use: the one it presents and the CAs it trusts.
    pub held: Arc<[HeldCertificate]>,
    /// The Node its service account token names, when it is bound to a Pod.
    pub token_node: Option<String>,
}

impl Current {
    /// The client certificate in use, when there is one.
    pub fn client_certificate(&self) -> Option<&crate::bundle::Certificate> {
        self.held
            .iter()
            .find(|h| h.kind == "user")
            .map(|h| &h.certificate)
    }

    /// Why there is no client, for a message.
    pub fn why_none(&self) -> String {
        self.problem
            .clone()
            .unwrap_or_else(|| "the credentials have not been read yet".to_string())
    }
}

/// A handle on the followed credentials: cheap to clone, one per user of the client.
#[derive(Clone)]
pub struct Credentials {
    current: watch::Receiver<Arc<Current>>,
    stale: Arc<Notify>,
    origin: Arc<Origin>,
}

impl Credentials {
    /// Starts following the credentials of `origin` (on the current runtime). The first
    /// reading is under way when this returns; until it is done, [`Current::read`] is false.
    pub fn follow(origin: Origin) -> Credentials {
        let (tx, current) = watch::channel(Arc::new(Current::default()));
        let stale = Arc::new(Notify::new());
        let origin = Arc::new(origin);
        tokio::spawn(follow(origin.clone(), tx, stale.clone()));
        Credentials {
            current,
            stale,
            origin,
        }
    }

    /// Where the credentials come from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// The client and what is known of the credentials, now.
    pub fn current(&self) -> Arc<Current> {
        self.current.borrow().clone()
    }

    /// The client to use for the next request, or why there is none.
    pub fn client(&self) -> Result<kube::Client, String> {
        let current = self.current();
        current.client.clone().ok_or_else(|| current.why_none())
    }

    /// The client to use for the next request, once the credentials have been read at
    /// least once: at start, a request waits for that first read (at most `limit`) rather
    /// than fail for credentials nobody has looked at yet.
    pub async fn client_once_read(
        &self,
        limit: std::time::Duration,
    ) -> Result<kube::Client, String> {
        let mut current = self.current.clone();
        let _ = tokio::time::timeout(limit, current.wait_for(|c| c.read)).await;
        self.client()
    }

    /// Waits until the credentials change (a new client, or a new problem). Returns at once
    /// the first time for a state this handle has not seen; never returns once the follower
    /// is gone.
    pub async fn changed(&mut self) {
        if self.current.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        self.current.borrow_and_update();
    }

    /// Marks the current state as seen, so that [`Credentials::changed`] waits for the next.
    pub fn mark_seen(&mut self) -> Arc<Current> {
        self.current.borrow_and_update().clone()
    }

    /// Waits until `until`, or until a client newer than `generation` is built: true when
    /// the new client came first. New credentials are likely what a failed request was
    /// waiting for, so a backoff ends with them.
    pub async fn newer_before(&mut self, generation: u64, until: Instant) -> bool {
        let newer = async {
            loop {
                self.changed().await;
                if self.current().generation != generation {
                    return;
                }
            }
        };
        tokio::time::timeout_at(until, newer).await.is_ok()
    }

    /// An answer proved the credentials stale (a 401, or a server certificate that the
    /// trusted CA does not sign): read them again now.
    pub fn stale(&self) {
        self.stale.notify_one();
    }
}

#[cfg(test)]
impl Credentials {
    /// A handle on credentials a test sets: what it sends on the returned sender is the
    /// current state, and the returned notify is what [`Credentials::stale`] wakes.
    pub(crate) fn set_by_test(
        current: Current,
    ) -> (Credentials, watch::Sender<Arc<Current>>, Arc<Notify>) {
        let (tx, current) = watch::channel(Arc::new(current));
        let stale = Arc::new(Notify::new());
        let origin = Arc::new(Origin::Kubeconfig {
            paths: Vec::new(),
            chosen_by: "a test",
            pick: Default::default(),
        });
        let credentials = Credentials {
            current,
            stale: stale.clone(),
            origin,
        };
        (credentials, tx, stale)
    }
}

/// Reads the credentials once, for a one-shot command, with the same checks as the
/// follower. Blocking file I/O.
pub fn read_once(origin: &Origin) -> Result<load::Loaded, load::CredentialError> {
    load::load(origin).result
}

/// The follower: reads, publishes, watches the files, and reads again.
async fn follow(origin: Arc<Origin>, tx: watch::Sender<Arc<Current>>, stale: Arc<Notify>) {
    let (fs_tx, mut fs_rx) = mpsc::unbounded_channel();
    let mut watching: Option<(BTreeSet<PathBuf>, tokio::task::JoinHandle<()>)> = None;
    let mut fingerprint: Option<[u8; 32]> = None;
    let mut rereads = Rereads::new(Instant::now());
    loop {
        let attempt = {
            let origin = origin.clone();
            match tokio::task::spawn_blocking(move || load::load(&origin)).await {
                Ok(attempt) => attempt,
                Err(_) => return,
            }
        };
        // Watch what matters now: a kubeconfig that appeared may name files not seen before.
        if watching.as_ref().map(|(files, _)| files) != Some(&attempt.files) {
            if let Some((_, task)) = watching.take() {
                task.abort();
            }
            let files: Vec<PathBuf> = attempt.files.iter().cloned().collect();
            let plan = Plan::new(&[], &[]).with_credential_files(&files);
            let task = tokio::spawn(files::run(plan, fs_tx.clone(), None));
            watching = Some((attempt.files, task));
        }
        match attempt.result {
            Ok(loaded) => {
                rereads.read_ok();
                if fingerprint != Some(loaded.fingerprint) {
                    match client(loaded.config) {
                        Ok(client) => {
                            fingerprint = Some(loaded.fingerprint);
                            let previous = tx.borrow().clone();
                            log_new(&origin, &previous, &loaded.held, &loaded.server);
                            tx.send_replace(Arc::new(Current {
                                client: Some(client),
                                generation: previous.generation + 1,
                                problem: None,
                                read: true,
                                server: Some(loaded.server),
                                ca_origin: Some(loaded.ca_origin),
                                client_certificate_origin: loaded.client_certificate_origin,
                                held: loaded.held.into(),
                                token_node: loaded.token_node,
                            }));
                        }
                        Err(e) => report(
                            &tx,
                            &origin,
                            format!("cannot build a client from {}: {e}", origin.describe()),
                        ),
                    }
                } else if tx.borrow().problem.is_some() {
                    // The same credentials as the client in use, usable again.
                    tracing::info!("the credentials on disk are usable again (unchanged)");
                    tx.send_modify(|c| Arc::make_mut(c).problem = None);
                }
            }
            Err(error) => {
                report(&tx, &origin, error.problem);
                rereads.read_failed(Instant::now());
            }
        }
        // Wait for a reason to read them again.
        loop {
            let deadline = rereads.deadline();
            tokio::select! {
                event = fs_rx.recv() => match event {
                    Some(FsEvent::Credentials | FsEvent::Rescan) => {
                        tokio::time::sleep(SETTLE).await;
                        while fs_rx.try_recv().is_ok() {}
                        break;
                    }
                    Some(_) => continue,
                    None => return,
                },
                () = stale.notified() => {
                    tokio::time::sleep_until(rereads.stale(Instant::now())).await;
                    break;
                }
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        rereads.reading(Instant::now());
        if tx.is_closed() {
            return;
        }
    }
}

/// The credentials on disk cannot be used: logged once per distinct problem.
fn report(tx: &watch::Sender<Arc<Current>>, origin: &Origin, problem: String) {
    let current = tx.borrow().clone();
    if current.problem.as_deref() == Some(problem.as_str()) && current.read {
        return;
    }
    match &current.client {
        Some(_) => tracing::warn!(
            "the credentials for the API server in {} cannot be used: {problem}; keeping the client of the last good ones",
            origin.describe()
        ),
        None => tracing::warn!(
            "no usable credentials for the API server yet: {problem}; the cluster sources wait for them, the file on disk is kept and served"
        ),
    }
    tx.send_modify(|c| {
        let c = Arc::make_mut(c);
        c.problem = Some(problem);
        c.read = true;
    });
}

fn log_new(origin: &Origin, previous: &Current, held: &[HeldCertificate], server: &str) {
    let client = held.iter().find(|h| h.kind == "user");
    let subject = client.map(|h| h.certificate.display_name());
    let not_after = client.map(|h| crate::text::rfc3339(h.certificate.not_after));
    let cas = held.iter().filter(|h| h.kind == "cluster").count();
    if previous.client.is_none() {
        tracing::info!(
            server,
            credentials = %origin.describe(),
            client_certificate = subject.as_deref().unwrap_or("-"),
            client_certificate_not_after = not_after.as_deref().unwrap_or("-"),
            trusted_cas = cas,
            "credentials for the API server loaded"
        );
    } else {
        tracing::info!(
            server,
            client_certificate = subject.as_deref().unwrap_or("-"),
            client_certificate_not_after = not_after.as_deref().unwrap_or("-"),
            trusted_cas = cas,
            "credentials for the API server changed: new requests use them, watches resume from where they were"
        );
    }
}

/// A client for a one-shot command (`sync`, `publish --once`), from credentials read once
/// with the daemon's checks, and the server it talks to. Credentials that cannot be used end
/// the command with exit 1 and one line: what is wrong, and what to do.
pub fn one_shot_client(origin: &Origin) -> anyhow::Result<(kube::Client, String)> {
    let loaded = read_once(origin).map_err(|e| {
        anyhow::anyhow!(
            "no usable credentials for the API server: {}; fix them, or pass --kubeconfig with one that works (the file on disk was left as it was)",
            e.problem
        )
    })?;
    let server = loaded.server.clone();
    let client = client(loaded.config)
        .map_err(|e| anyhow::anyhow!("cannot build a client for {server}: {e}"))?;
    Ok((client, server))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// The follower's timing: failed readings retried from 1 s doubling to a minute and
    /// starting over after a success; the once-a-minute reading always comes; a stale
    /// answer reads at once, but at most once a second.
    #[test]
    fn credentials_are_read_again_as_the_rules_say() {
        let t0 = Instant::now();
        let mut r = Rereads::new(t0);
        assert_eq!(r.deadline(), t0 + REREAD_EVERY);
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..8 {
            r.read_failed(now);
            let at = r.deadline();
            delays.push((at - now).as_secs());
            now = at;
            r.reading(now);
        }
        assert_eq!(
            delays,
            [1, 2, 4, 8, 16, 29, 60, 60],
            "capped by the minute's reading"
        );
        r.read_ok();
        assert_eq!(r.retry_at, None);
        r.read_failed(now);
        assert_eq!(r.deadline(), now + RETRY_FIRST, "a success starts over");
        // The minute's reading moves on only once it is due.
        let mut r = Rereads::new(t0);
        r.reading(t0 + Duration::from_secs(59));
        assert_eq!(r.deadline(), t0 + REREAD_EVERY);
        r.reading(t0 + REREAD_EVERY);
        assert_eq!(r.deadline(), t0 + REREAD_EVERY * 2);
        // Stale answers: at once, then at most once a second.
        let mut r = Rereads::new(t0);
        assert_eq!(r.stale(t0), t0);
        assert_eq!(
            r.stale(t0 + Duration::from_millis(300)),
            t0 + STALE_MIN_INTERVAL
        );
        let later = t0 + Duration::from_secs(5);
        assert_eq!(r.stale(later), later);
    }

    /// A certificate held from kubeconfig `k`: `user` (the client's) or `cluster` (a CA
    /// trusted for the server), valid for an hour.
    fn held(kind: &'static str, cn: &str) -> HeldCertificate {
        let now = crate::bundle::test_certs::now();
        HeldCertificate {
            filepath: "k".into(),
            kind,
            key: "x".into(),
            certificate: crate::bundle::test_certs::ca(Some(cn), None, now - 60, now + 3600),
        }
    }

    /// The client certificate is the user's, never a CA trusted for the server; without
    /// credentials, why says so.
    #[test]
    fn what_is_known_of_the_credentials_in_use() {
        let current = Current {
            held: vec![held("cluster", "ca"), held("user", "system:node:n1")].into(),
            ..Current::default()
        };
        assert_eq!(
            current
                .client_certificate()
                .map(|c| c.subject_cn.clone())
                .as_deref(),
            Some("system:node:n1")
        );
        let cas_only = Current {
            held: vec![held("cluster", "ca")].into(),
            ..Current::default()
        };
        assert!(cas_only.client_certificate().is_none());
        assert_eq!(
            Current::default().why_none(),
            "the credentials have not been read yet"
        );
        let refused = Current {
            problem: Some("kubeconfig k does not exist yet".into()),
            ..Current::default()
        };
        assert_eq!(refused.why_none(), "kubeconfig k does not exist yet");
    }

    /// The journal says which client certificate a new client presents and how many CAs
    /// it trusts for the server (a CA rotation shows as two, then one).
    #[test]
    fn a_new_client_is_logged_with_how_many_cas_it_trusts() {
        let held = [
            held("user", "system:node:n1"),
            held("cluster", "ca-old"),
            held("cluster", "ca-new"),
        ];
        let origin = Origin::Kubeconfig {
            paths: vec!["k".into()],
            chosen_by: "--kubeconfig",
            pick: Pick::default(),
        };
        let ((), log) = crate::testlog::Log::capture(|| {
            log_new(&origin, &Current::default(), &held, "https://api:6443")
        });
        assert_eq!(log.count("trusted_cas=2"), 1, "{}", log.text());
        assert_eq!(
            log.count("system:node:n1"),
            1,
            "the user's certificate: {}",
            log.text()
        );
        assert_eq!(log.count("ca-old"), 0, "a CA is no client certificate");
        assert_eq!(log.count("credentials for the API server loaded"), 1);
    }

    use base64::Engine;

    use super::*;

    /// A kubeconfig with an inline CA and a token, for a server nobody listens on.
    fn kubeconfig(dir: &std::path::Path) -> std::path::PathBuf {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap().pem();
        let ca = base64::engine::general_purpose::STANDARD.encode(ca);
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n    certificate-authority-data: {ca}\nusers:\n- name: u\n  user:\n    token: t0ken\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n"
            ),
        )
        .unwrap();
        path
    }

    /// At start, a request that needs the client waits for the first read of the
    /// credentials rather than fail for credentials nobody has looked at yet (a review that
    /// failed so would be remembered, refusing a valid token for 10 s after).
    #[tokio::test(flavor = "current_thread")]
    async fn a_request_at_start_waits_for_the_first_read_of_the_credentials() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let origin = Origin::resolve(Some(&kubeconfig(dir.path()))).unwrap();
        let credentials = Credentials::follow(origin);
        // The follower has not run yet (one thread, not yielded to).
        assert!(!credentials.current().read);
        assert!(credentials.client().is_err());
        let client = credentials.client_once_read(Duration::from_secs(10)).await;
        assert!(client.is_ok(), "{:?}", client.err());
    }
}
