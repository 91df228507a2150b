//! A local kube-apiserver for the integration tests and benchmarks.
//!
//! HTTPS on 127.0.0.1 serving ConfigMaps and OpenShift ControllerConfigs with the wire behaviour
//! of kube-apiserver 1.33 for the calls kube-rs's `watcher` makes (list, watch, get) and for
//! writing a ConfigMap with server-side apply (PATCH), plus knobs to break it: stop/restart,
//! compaction, closing watches, injected errors, held or failed writes.
//!
//! The API is synchronous: the server runs its own single-threaded tokio runtime on a background
//! thread, so plain `#[test]`s, `#[tokio::test]`s and benchmark binaries can all drive it.
//!
//! Storage is modelled on etcd behind the apiserver's watch cache: one global revision counter, a
//! history of changes (for watch replay and reads at an older revision) that `compact` cuts, and a
//! watch-cache floor below which resuming watches get 410. `compact` moves both; `restart` and
//! `rolling_restart` move only the watch-cache floor, because a restarted apiserver rebuilds its
//! watch cache from a fresh list and no longer knows the events before it. They move the revision
//! on by one first, as a starting apiserver's own writes (its lease, the `kubernetes` endpoints)
//! move etcd's past anything a client saw: every resumed watch gets 410 after a restart.
//!
//! Real-server behaviour worth knowing when writing tests against it:
//! - list items of ConfigMaps have no kind/apiVersion (ControllerConfig items, being custom
//!   resources, keep them); objects in watch events and single GETs have them;
//! - an update that changes nothing is a no-op: no new resourceVersion, no event;
//! - a watch from a too-old resourceVersion gets HTTP 200 and one ERROR event (410 Expired), while
//!   a list at a too-old exact resourceVersion gets HTTP 410;
//! - load shedding (kube-apiserver's max-in-flight and priority-and-fairness filters) is not a
//!   Status: HTTP 429 with `Retry-After` and a plain-text body (`Fault::TooManyRequests`);
//! - BOOKMARKs go only to watches with `allowWatchBookmarks=true`, every bookmark interval (a
//!   minute upstream) once the resourceVersion has moved past the one the watch started from,
//!   and from then on even if it has not moved since the last bookmark (cacheWatcher.process
//!   compares with the start): a heartbeat, but not on a watch that started at the current
//!   resourceVersion of a quiet resource;
//! - without RBAC rules set, an authenticated user may do anything; with `restrict_to` a list or
//!   watch with fieldSelector `metadata.name=X` is authorized as a request for X, as upstream,
//!   and a denial names the user the request authenticated as;
//! - authentication is kube-apiserver's union of authenticators (FailOnError false): the x509
//!   client-certificate authenticator, then the bearer token; the first that succeeds decides (a
//!   valid certificate wins over any token); if none does, a failure of any of them (a wrong
//!   token, an expired, not-yet-valid or unknown-signer certificate) is 401, and no credential
//!   at all is user system:anonymous, which gets 403 (not 401) outside /version and the health
//!   checks. So an expired certificate sent with a valid token is the token's user;
//! - the listener asks for a client certificate, naming the client CA as acceptable, but neither
//!   requires nor checks it in the handshake (Go's `tls.RequestClientCert`): an expired or
//!   foreign certificate connects. The chain is verified against the client CA (clientAuth
//!   usage required) on every request at that request's time, so a certificate that expires
//!   while its connection is kept alive fails on the next request, not at the next handshake;
//! - a certificate user is its CN, with its O values and system:authenticated as groups; a
//!   valid certificate without a CN names nobody (the next authenticator decides);
//! - the serving certificate is swapped as the dynamic serving certificate controller swaps it:
//!   new handshakes present the new one, open connections keep theirs;
//! - TLS sessions are resumed (rustls clients, kube-rs's included, resume by default; client-go
//!   does not) and a resumed handshake shows no serving certificate and keeps the client
//!   certificate of the session it resumes. A restart forgets every session, as a restarted
//!   apiserver's new ticket keys do. Unlike Go's server, this one also resumes a session whose
//!   client certificate has expired since (its requests then get 401; Go would make the client
//!   do a full handshake).
//!
//! Writing ConfigMaps (PATCH; other writes, and PATCH of ControllerConfigs, get 405):
//! - server-side apply (`application/apply-patch+yaml`; the JSON bodies kube-rs sends) needs
//!   `fieldManager` (else 422 `PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required
//!   value: is required for apply patch`); merge and strategic merge patches are served too, JSON
//!   patches are not modelled, and an unknown Content-Type is 415 with the real list of types;
//! - an apply to a missing object creates it (201) and is then authorized as `create` of that
//!   name as well as `patch` (patch.go): denied, it is 403 `configmaps "x" is forbidden: `, with
//!   nothing after the colon because RBAC gives no reason. A merge patch of a missing object is
//!   404;
//! - managedFields track each entry of `data`, `binaryData`, `metadata.labels` and
//!   `metadata.annotations`. An applier owns exactly what it applied last; an entry it stops
//!   applying is removed unless another manager owns it; an entry another manager owns and the
//!   apply would change is a 409 (`Apply failed with 1 conflict: conflict with "kubectl-edit"
//!   using v1: .data.ca-bundle.crt`; several are grouped by manager, one `- .path` per line, and
//!   each is a `FieldManagerConflict` cause) unless `force=true`, which moves the ownership; the
//!   same value applied by two managers is owned by both. An Update (a merge patch,
//!   `put_configmap` as `kubectl-create`, `edit_configmap_as`) takes the entries it changes from
//!   whoever owned them, and owns a map it creates (`.` in FieldsV1);
//! - a write that changes nothing is not stored: no new resourceVersion, no event. A manager's
//!   time moves only when the object changed (and a new applier whose apply changed no value gets
//!   an entry with no time at all), so re-applying the same configuration is a true no-op;
//! - the checks come in upstream's order: content type, options, body, conflicts, then the name
//!   and namespace against the URL (400), a resourceVersion in the body as a precondition (409),
//!   validation (422: valid config keys, at most 1 MiB of values, `[]: Too long: may not be more
//!   than 1048576 bytes`, the wording since 1.32), and last the create authorization;
//! - a request this server does not model (`immutable`, YAML that is not JSON, other metadata,
//!   JSON patches) gets a 501 saying so: no real server answers that, so a test that sees it is
//!   testing the fake, not the code.
#![allow(dead_code)]

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, TcpListener as StdTcpListener};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc as std_mpsc};
use std::task::{Context, Poll};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD as B64, URL_SAFE_NO_PAD as B64_URL};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Response, StatusCode};
use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SigningKey as _,
};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::{
    CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime,
};
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

/// A response body; an error aborts the connection mid-response (a cut stream).
type Body = UnsyncBoxBody<Bytes, std::io::Error>;

const MCO_GROUP: &str = "machineconfiguration.openshift.io";
/// Who the kubeconfig's token authenticates as (it shows in Forbidden messages).
const USER: &str = "system:node:fixture-node";
/// The groups of the token's user, as a node's.
const USER_GROUPS: [&str; 2] = ["system:nodes", AUTHENTICATED];
/// The group kube-apiserver adds to every authenticated user (authenticatedGroupAdder).
const AUTHENTICATED: &str = "system:authenticated";
const ANONYMOUS: &str = "system:anonymous";
/// The resourceVersion of the empty store: real clusters are never near 1.
const INITIAL_RV: u64 = 1000;

// ---------------------------------------------------------------------------------------------
// Public interface
// ---------------------------------------------------------------------------------------------

/// One request as the server received it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// The raw query string, still percent-encoded.
    pub query: String,
    pub watch: bool,
    /// The request body as received (empty for a GET).
    pub body: Vec<u8>,
    pub at: Instant,
    /// Who the server authenticated the request as: the client certificate's CN, the token's
    /// user, or `system:anonymous`; empty when it was refused with 401.
    pub user: String,
    /// The groups that came with `user` (`system:authenticated` for any authenticated user,
    /// `system:unauthenticated` for anonymous); empty when refused.
    pub groups: Vec<String>,
    /// The hex SHA-256 of the DER of the leaf certificate presented on the request's connection,
    /// whatever the authenticators made of it; None when the client presented none.
    pub client_certificate_sha256: Option<String>,
    /// Why authentication refused the request (401), worded as kube-apiserver logs it
    /// (`Unable to authenticate the request`); None unless refused.
    pub auth_error: Option<String>,
    /// The TLS connection the request came on, numbered from 1 in the order their handshakes
    /// completed: requests on one kept-alive connection share it.
    pub connection: u64,
}

impl Request {
    /// The decoded value of query parameter `name`.
    pub fn param(&self, name: &str) -> Option<String> {
        Query::parse(&self.query).get(name).map(str::to_owned)
    }

    /// The body as JSON, if it is JSON.
    pub fn body_json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// A GET of a collection that is not a watch.
    pub fn is_list(&self) -> bool {
        self.method == "GET"
            && !self.watch
            && matches!(Route::parse(&self.path), Route::Collection { .. })
    }
}

/// Which requests a hung server leaves unanswered (see [`ApiServer::hang`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HangMode {
    /// Lists (GETs of a collection without `watch`).
    Lists,
    /// New watches, and every open watch stream (no event, no bookmark, no end).
    Watches,
    /// Writes (PATCH, PUT, POST, DELETE of resources): held before they are carried out, and
    /// carried out when released.
    Writes,
    /// Every request, and every open watch stream.
    All,
}

impl HangMode {
    fn covers(self, kind: Kind) -> bool {
        matches!(
            (self, kind),
            (HangMode::All, _)
                | (HangMode::Lists, Kind::List)
                | (HangMode::Watches, Kind::Watch)
                | (HangMode::Writes, Kind::Write)
        )
    }
}

/// Which requests an injected fault hits (see [`ApiServer::fail_next_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Lists only: a watch passes untouched and does not use up the count.
    List,
    /// Watches only.
    Watch,
    /// Writes only (PATCH, PUT, POST, DELETE of resources): the fault answers instead of the
    /// write, which is not carried out.
    Write,
    /// Any request, discovery and single GETs included.
    Any,
}

/// What an injected fault answers. Not every failure in front of or inside an API server comes
/// as a well-formed Status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A metav1 Status with this HTTP code, worded as kube-apiserver words it. A 410 on a watch
    /// comes as an ERROR event in a 200 stream, as kube-apiserver sends it.
    Status(u16),
    /// HTTP 502 with an HTML page, as a load balancer answers when no apiserver behind it does.
    BadGatewayHtml,
    /// HTTP 503 with an empty body and no content type (a proxy with no healthy backend).
    EmptyUnavailable,
    /// HTTP 200, then half of a JSON document (a watch event, or a list), then the connection
    /// is cut: no terminating chunk, no TLS close_notify.
    CutMidJson,
    /// On a watch: HTTP 200 and one ERROR event holding a Status of this code, then the end of
    /// the stream. On any other request, like `Status`.
    ErrorEvent(u16),
    /// What kube-apiserver's max-in-flight and priority-and-fairness filters answer when they
    /// shed load, to any request (watches too, under APF): HTTP 429 with `Retry-After:
    /// retry_after`, `X-Content-Type-Options: nosniff` and the plain-text body Go's
    /// `http.Error` writes, `Too many requests, please try again later.` and a newline (not a
    /// Status). Inside an open watch stream (`break_watches`): an ERROR event holding a Status
    /// of code 429, reason TooManyRequests, with `details.retryAfterSeconds` retry_after.
    TooManyRequests { retry_after: u32 },
}

/// One RBAC rule of the agent's role (see [`ApiServer::restrict_to`]).
#[derive(Debug, Clone)]
pub struct Rule {
    verbs: Vec<String>,
    group: String,
    resource: String,
    /// None: every namespace (a ClusterRole bound cluster-wide).
    namespace: Option<String>,
    /// resourceNames; empty means every name.
    names: Vec<String>,
}

impl Rule {
    pub fn new(
        verbs: &[&str],
        group: &str,
        resource: &str,
        namespace: Option<&str>,
        names: &[&str],
    ) -> Rule {
        Rule {
            verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
            group: group.to_owned(),
            resource: resource.to_owned(),
            namespace: namespace.map(str::to_owned),
            names: names.iter().map(|n| (*n).to_owned()).collect(),
        }
    }

    /// A ClusterRole's rule for a cluster-scoped resource with no names (the review endpoints).
    fn allows_cluster(&self, verb: &str, group: &str, resource: &str) -> bool {
        let any = |list: &[String], value: &str| list.iter().any(|v| v == "*" || v == value);
        any(&self.verbs, verb)
            && (self.group == "*" || self.group == group)
            && (self.resource == "*" || self.resource == resource)
            && self.namespace.is_none()
            && self.names.is_empty()
    }

    /// rbac.RuleAllows: verb, group and resource match, and resourceNames (when given) holds the
    /// request's name. A request with no name (a list without a metadata.name selector) never
    /// matches a rule with resourceNames.
    fn allows(&self, verb: &str, res: Res, ns: Option<&str>, name: Option<&str>) -> bool {
        let any = |list: &[String], value: &str| list.iter().any(|v| v == "*" || v == value);
        any(&self.verbs, verb)
            && (self.group == "*" || self.group == res.group())
            && (self.resource == "*" || self.resource == res.plural())
            && self.namespace.as_deref().is_none_or(|n| Some(n) == ns)
            && (self.names.is_empty() || name.is_some_and(|n| self.names.iter().any(|x| x == n)))
    }
}

/// A client certificate and its key, as PEM, for a kubeconfig's `client-certificate-data` and
/// `client-key-data`.
#[derive(Debug, Clone)]
pub struct ClientCertificate {
    pub cert_pem: String,
    pub key_pem: String,
    /// The certificate's notAfter, exactly as written in it (whole seconds).
    pub not_after: SystemTime,
}

/// The fake apiserver. Dropping it shuts it down and joins its thread.
pub struct ApiServer {
    shared: Arc<Shared>,
    /// The CA whose certificates the x509 authenticator accepts.
    client_ca: Authority,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
    commands: Option<mpsc::UnboundedSender<Command>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl ApiServer {
    /// Listens on 127.0.0.1 on a free port, with a fresh serving CA and certificate, a fresh
    /// client CA (apart from the serving CA, as on a real cluster) and a fresh bearer token.
    pub fn start() -> ApiServer {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let serving = ServingCertificates::new(serving_pair(&provider));
        let ca_pem = serving.current().ca_pem;
        let client_ca = Authority::new(CLIENT_CA_NAME);
        let listener = StdTcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local address").port();
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new()),
            token: Mutex::new(B64_URL.encode(random_bytes(32))),
            node_tokens: Mutex::new(HashMap::new()),
            port,
            client_auth: client_verifier(&client_ca, &provider),
            serving: Arc::new(serving),
            provider,
            connections: AtomicU64::new(0),
            last_event_sent: Mutex::new(None),
            last_rv_delivered: Mutex::new(None),
            hang: tokio::sync::watch::Sender::new(None),
            flow_schema_uid: new_uid(),
            priority_level_uid: new_uid(),
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_yaml(port, &ca_pem, &shared.token()))
            .expect("write kubeconfig");
        let (commands, receiver) = mpsc::unbounded_channel();
        let thread = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("fake-apiserver".into())
                .spawn(move || run(shared, receiver))
                .expect("spawn apiserver thread")
        };
        let server = ApiServer {
            shared,
            client_ca,
            kubeconfig,
            _dir: dir,
            commands: Some(commands),
            thread: Some(thread),
        };
        server.listen(listener);
        server
    }

    /// A kubeconfig for this server: CA data, a bearer token user, current-context set. It is
    /// written once at start: after `rotate_token` or `switch_serving_ca` it still holds the
    /// first token and CA (a test that rotates writes the new credentials where it wants them).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A kubeconfig like [`ApiServer::kubeconfig`] whose bearer token, made for it, authenticates
    /// as `user` in groups `system:nodes` and `system:authenticated` (a node's), so that the
    /// requests of many clients tell apart by [`Request::user`] (a fleet of agents, one per
    /// node). The token stays valid whatever `rotate_token` does to the fixture user's; RBAC set
    /// by `restrict_to` binds it as it binds every authenticated user.
    pub fn kubeconfig_for(&self, user: &str) -> PathBuf {
        let token = B64_URL.encode(random_bytes(32));
        let n = {
            let mut users = lock(&self.shared.node_tokens);
            users.insert(token.clone(), user.to_owned());
            users.len()
        };
        let path = self._dir.path().join(format!("kubeconfig-{n}"));
        std::fs::write(
            &path,
            kubeconfig_yaml(self.shared.port, &self.ca_pem(), &token),
        )
        .expect("write kubeconfig");
        path
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.shared.port)
    }

    pub fn port(&self) -> u16 {
        self.shared.port
    }

    /// The bearer token the server accepts (the only one, for the fixture user).
    pub fn token(&self) -> String {
        self.shared.token()
    }

    /// Makes a new bearer token the only one accepted, as when the token a node's kubeconfig
    /// names is replaced: the old token gets 401 from the next request on, even on a connection
    /// already open. Returns the new token.
    pub fn rotate_token(&self) -> String {
        let token = B64_URL.encode(random_bytes(32));
        *lock(&self.shared.token) = token.clone();
        token
    }

    /// The PEM of the CA that signed the serving certificate new handshakes get.
    pub fn ca_pem(&self) -> String {
        self.shared.serving.current().ca_pem
    }

    /// The next serving CA, as a cluster rotating kube-apiserver's serving CA publishes it
    /// before any apiserver serves a certificate it signed: a new CA (same subject, new key)
    /// and a serving certificate for 127.0.0.1 and localhost signed by it, not served until
    /// `switch_serving_ca`. Made once: later calls return the same PEM until the switch.
    pub fn next_serving_ca(&self) -> String {
        self.shared.serving.next(&self.shared.provider).ca_pem
    }

    /// Serves the certificate signed by the next serving CA (made now if `next_serving_ca` was
    /// not called), as kube-apiserver's dynamic serving certificate does: new handshakes present
    /// it, open connections keep the old one, so a test forces reconnection with `restart` (a
    /// watch closed by `close_watches` ends its stream, not its kept-alive connection). A
    /// resumed TLS session shows no certificate at all; `restart` forgets the sessions.
    pub fn switch_serving_ca(&self) {
        self.shared.serving.switch(&self.shared.provider);
    }

    /// The PEM of the CA the x509 authenticator trusts (kube-apiserver's `--client-ca-file`).
    pub fn client_ca_pem(&self) -> String {
        self.client_ca.pem.clone()
    }

    /// A client certificate signed by the client CA, as the kube-controller-manager's CSR
    /// signer issues a kubelet's: CN `user`, one O per group, clientAuth usage, a
    /// digitalSignature key usage. It is valid from a minute ago (clock skew) for `valid_for`
    /// from now, rounded up to the whole second, so it expires no sooner than that.
    pub fn issue_client_certificate(
        &self,
        user: &str,
        groups: &[&str],
        valid_for: Duration,
    ) -> ClientCertificate {
        self.client_ca.issue_client(user, groups, valid_for)
    }

    /// The same certificate signed by a CA this server does not trust, with the client CA's
    /// subject but another key (as a client CA that was rotated away): an unknown signer.
    pub fn issue_client_certificate_by_unknown_ca(
        &self,
        user: &str,
        groups: &[&str],
        valid_for: Duration,
    ) -> ClientCertificate {
        Authority::new(CLIENT_CA_NAME).issue_client(user, groups, valid_for)
    }

    /// Creates a ConfigMap, or replaces its `data` and `binaryData` (labels and annotations
    /// stay), and returns its resourceVersion. It is written as `kubectl create configmap`
    /// writes it: an Update by manager `kubectl-create`, which then owns what it set. Like a real
    /// update, a replace that changes nothing is a no-op: no new resourceVersion and no event.
    pub fn put_configmap(
        &self,
        namespace: &str,
        name: &str,
        data: &[(&str, &str)],
        binary_data: &[(&str, &[u8])],
    ) -> u64 {
        let mut st = self.shared.store();
        let key = (Res::ConfigMaps, namespace.to_owned(), name.to_owned());
        let mut content = st
            .current
            .get(&key)
            .map_or_else(Content::default, |p| Content::of(p));
        content.maps.remove(&Section::Data);
        content.maps.remove(&Section::BinaryData);
        for (k, v) in data {
            content.set(&Field::entry(Section::Data, k), v);
        }
        for (k, v) in binary_data {
            content.set(&Field::entry(Section::BinaryData, k), &B64.encode(v));
        }
        st.update_configmap(key, "kubectl-create", content)
    }

    /// Another client's write, as `kubectl edit` makes one: an Update by `manager` that sets
    /// these `data` entries and annotations and leaves the rest as it is. The manager then owns
    /// what it changed, taking it from whoever owned it (an applier that applies its own value
    /// again gets a conflict). Returns the resourceVersion; a write that changes nothing is a
    /// no-op. Panics if there is no such ConfigMap.
    pub fn edit_configmap_as(
        &self,
        manager: &str,
        namespace: &str,
        name: &str,
        data: &[(&str, &str)],
        annotations: &[(&str, &str)],
    ) -> u64 {
        let mut st = self.shared.store();
        let key = (Res::ConfigMaps, namespace.to_owned(), name.to_owned());
        let Some(prev) = st.current.get(&key) else {
            panic!("edit_configmap_as: no ConfigMap {namespace}/{name}");
        };
        let mut content = Content::of(prev);
        for (k, v) in data {
            content.set(&Field::entry(Section::Data, k), v);
        }
        for (k, v) in annotations {
            content.set(&Field::entry(Section::Annotations, k), v);
        }
        st.update_configmap(key, manager, content)
    }

    /// The ConfigMap as stored (a GET would answer it), managedFields included.
    pub fn configmap(&self, namespace: &str, name: &str) -> Option<Value> {
        let key = (Res::ConfigMaps, namespace.to_owned(), name.to_owned());
        self.shared.store().current.get(&key).map(|o| (**o).clone())
    }

    /// Deletes a ConfigMap (DELETED carries its last state with the deletion's resourceVersion).
    /// Deleting one that does not exist changes nothing and returns the current resourceVersion.
    pub fn delete_configmap(&self, namespace: &str, name: &str) -> u64 {
        self.delete((Res::ConfigMaps, namespace.to_owned(), name.to_owned()))
    }

    /// Creates or replaces the cluster-scoped ControllerConfig `name` with
    /// `spec.kubeAPIServerServingCAData` set verbatim (it is meant to be base64; it is not
    /// checked). A replace with the same data is a no-op, as on a real server.
    pub fn put_controllerconfig(&self, name: &str, kube_apiserver_serving_ca_data: &str) -> u64 {
        let mut st = self.shared.store();
        let key = (Res::ControllerConfigs, String::new(), name.to_owned());
        let prev = st.current.get(&key).cloned();
        let release = match &prev {
            Some(p) => str_at(p, "/spec/releaseImage").to_owned(),
            None => release_image(0),
        };
        if let Some(p) = &prev
            && str_at(p, "/spec/kubeAPIServerServingCAData") == kube_apiserver_serving_ca_data
        {
            return object_rv(p);
        }
        let obj = controllerconfig_object(
            name,
            kube_apiserver_serving_ca_data,
            &release,
            prev.as_deref(),
        );
        st.commit(key, Some(obj))
    }

    /// Creates or replaces the ControllerConfig `name` as [`ApiServer::put_controllerconfig`]
    /// does, then sets each of `fields` of its `spec` to the JSON given, as a real cluster has
    /// them: base64 strings, `null` for an empty one, the registry lists as
    /// `[{"file": ..., "data": ...}]`. A field left out keeps the default of a real object
    /// (`cloudProviderCAData: null`). A replace that changes nothing is a no-op.
    pub fn put_controllerconfig_spec(&self, name: &str, fields: &[(&str, Value)]) -> u64 {
        let mut st = self.shared.store();
        let key = (Res::ControllerConfigs, String::new(), name.to_owned());
        let prev = st.current.get(&key).cloned();
        let release = match &prev {
            Some(p) => str_at(p, "/spec/releaseImage").to_owned(),
            None => release_image(0),
        };
        let ca = fields
            .iter()
            .find(|(field, _)| *field == "kubeAPIServerServingCAData")
            .and_then(|(_, value)| value.as_str())
            .unwrap_or_default();
        let mut obj = controllerconfig_object(name, ca, &release, prev.as_deref());
        for (field, value) in fields {
            obj["spec"][*field] = value.clone();
        }
        if let Some(p) = &prev
            && p["spec"] == obj["spec"]
        {
            return object_rv(p);
        }
        st.commit(key, Some(obj))
    }

    pub fn delete_controllerconfig(&self, name: &str) -> u64 {
        self.delete((Res::ControllerConfigs, String::new(), name.to_owned()))
    }

    /// Changes an unrelated field (`spec.releaseImage`, so `metadata.generation` too): a new
    /// resourceVersion and a MODIFIED event with the CA data unchanged. Panics if there is no
    /// such ControllerConfig.
    pub fn touch_controllerconfig(&self, name: &str) -> u64 {
        let mut st = self.shared.store();
        let key = (Res::ControllerConfigs, String::new(), name.to_owned());
        let Some(prev) = st.current.get(&key).cloned() else {
            panic!("touch_controllerconfig: no ControllerConfig {name:?}");
        };
        st.touches += 1;
        let release = release_image(st.touches);
        let ca = str_at(&prev, "/spec/kubeAPIServerServingCAData").to_owned();
        let obj = controllerconfig_object(name, &ca, &release, Some(&prev));
        st.commit(key, Some(obj))
    }

    /// Closes the listener and drops every connection without a clean end (as a crashed or
    /// killed apiserver does): clients get EOF mid-stream, then connection refused.
    pub fn stop(&self) {
        self.roundtrip(Command::Stop);
    }

    /// Listens again on the same port with the same objects. Like a real restarted apiserver,
    /// its own writes on start (its lease, the `kubernetes` endpoints) move the revision on by
    /// one, and its watch cache starts from a fresh list there: a watch resuming from any
    /// resourceVersion a client has seen gets 410 Expired (so clients relist). Stopped or not,
    /// every connection is dropped first (see [`ApiServer::stop`]).
    pub fn restart(&self) {
        self.stop();
        let listener = bind_retrying(self.shared.port);
        self.shared.store().forget_watch_cache();
        self.listen(listener);
    }

    /// A backup of the store as etcd's snapshot takes it: the objects and the revision.
    pub fn backup(&self) -> Backup {
        let st = self.shared.store();
        Backup {
            rv: st.rv,
            objects: st.current.clone(),
        }
    }

    /// Stops the server (every connection dropped, as [`ApiServer::stop`]), puts `backup`
    /// back as its store, and listens again on the same port: a control plane restored from a
    /// backup. The revision goes back to the backup's, behind everything a client has seen
    /// since; unlike a restart nothing answers 410 (a plain `etcdctl snapshot restore` does not
    /// bump the revision), so a watch resumed from a newer resourceVersion is accepted and
    /// hears nothing until the store gets there, as a real apiserver's does.
    pub fn restore(&self, backup: &Backup) {
        self.stop();
        let listener = bind_retrying(self.shared.port);
        self.shared.store().restore(backup);
        self.listen(listener);
    }

    /// What a client behind a load balancer sees when the apiserver it was on restarts and the
    /// balancer sends it to another one: every connection cut at once without a clean end (no
    /// terminating chunk, no TLS close_notify), while the listener stays open, so that a
    /// reconnect is accepted at once, by a server that resumes none of the old TLS sessions and
    /// whose watch cache begins past every resourceVersion a client has seen (the revision moves
    /// on as in [`ApiServer::restart`]): every resumed watch gets 410. Does nothing but move the
    /// watch cache while the server is stopped.
    pub fn rolling_restart(&self) {
        self.shared.store().forget_watch_cache();
        self.roundtrip(Command::Roll);
    }

    /// Sheds load: while `Some(fault)`, every new request (discovery, lists, watches, writes,
    /// reviews, health checks) is answered `fault`, as an overloaded apiserver answers
    /// `Fault::TooManyRequests` or a load balancer with no healthy apiserver behind it
    /// `Fault::Status(503)` or `Fault::EmptyUnavailable`; `None` serves again. Watches already
    /// open are left as they are (load is shed at the door): [`ApiServer::break_watches`] ends
    /// them. A fault armed by `fail_next_on` waits, its count untouched, until the spell ends.
    pub fn shed(&self, fault: Option<Fault>) {
        self.shared.store().shed = fault;
    }

    /// Like etcd compaction (and the watch cache moving on): a watch resuming from a
    /// resourceVersion older than the current one gets an ERROR event with 410 Expired; an exact
    /// list, or a `continue`, at an older one gets HTTP 410.
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    /// Ends every open watch cleanly, after the events already queued for it, as the server does
    /// when `timeoutSeconds` elapses.
    pub fn close_watches(&self) {
        for w in self.shared.store().watches.values() {
            let _ = w.tx.send(Msg::Close);
        }
    }

    /// The next `count` requests, whatever they are, fail with a metav1 Status of HTTP `code`
    /// (403 Forbidden, 500 InternalError, ...). A 410 on a watch comes as an ERROR event in a 200
    /// stream, as kube-apiserver sends it. Note that kube-rs's client, with its default retry
    /// policy on, retries 429, 503 and 504 by itself (up to 15 times).
    pub fn fail_next(&self, count: usize, code: u16) {
        self.fail_next_on(Target::Any, count, Fault::Status(code));
    }

    /// The next `count` requests that `target` selects get `fault`; other requests pass and do
    /// not use up the count. Replaces whatever was armed before.
    pub fn fail_next_on(&self, target: Target, count: usize, fault: Fault) {
        self.shared.store().fail = (count > 0).then_some((count, target, fault));
    }

    /// Breaks every open watch in the middle of its stream: `CutMidJson` sends half an event and
    /// cuts the connection; `ErrorEvent(code)` (or `Status(code)`) sends an ERROR event with that
    /// Status and ends the stream, as the watch cache does when it gives up on a watcher;
    /// `TooManyRequests` sends an ERROR event holding a 429 Status with its
    /// `retryAfterSeconds`, and ends the stream. Other faults make no sense mid-stream and panic.
    pub fn break_watches(&self, fault: Fault) {
        let msg = || match fault {
            Fault::CutMidJson => Msg::Cut,
            Fault::ErrorEvent(_) | Fault::Status(_) | Fault::TooManyRequests { .. } => {
                Msg::Error(fault)
            }
            other => panic!("break_watches: {other:?} cannot happen inside a watch stream"),
        };
        for w in self.shared.store().watches.values() {
            let _ = w.tx.send(msg());
        }
    }

    /// The server stops answering: it still accepts connections, completes TLS and reads each
    /// request that `mode` covers, then sends nothing at all, as an apiserver stuck on etcd or a
    /// deadlocked proxy does. Watches covered go silent too: no event, no bookmark, no end at
    /// their timeout. Requests held so far are served when [`ApiServer::unhang`] is called.
    pub fn hang(&self, mode: HangMode) {
        self.shared.hang.send_replace(Some(mode));
    }

    /// Answers again, held requests first.
    pub fn unhang(&self) {
        self.shared.hang.send_replace(None);
    }

    /// Enforces RBAC as kube-apiserver's RBAC authorizer does, with `rules` bound to every
    /// authenticated user (the token's and any client certificate's: one agent whose credentials
    /// rotate): a request is allowed only if one of `rules` allows it, else it gets 403
    /// Forbidden with the real message, naming the user the request authenticated as. As
    /// upstream (the request info resolver, requestinfo.go), a list or watch whose fieldSelector
    /// requires `metadata.name=X` is authorized as a request for the object named X, so
    /// `resourceNames: [X]` covers it; without such a selector it has no name and a rule with
    /// resourceNames does not allow it. Discovery, /version and the health checks stay open
    /// (system:discovery and system:public-info-viewer).
    pub fn restrict_to(&self, rules: Vec<Rule>) {
        self.shared.store().rules = Some(rules);
    }

    /// The resourceVersion of the last event or bookmark handed to a watch's connection: where a
    /// watch resumed after it should start.
    pub fn last_rv_delivered(&self) -> Option<u64> {
        *lock(&self.shared.last_rv_delivered)
    }

    /// How often watches that asked for `allowWatchBookmarks=true` get a BOOKMARK (kube-apiserver:
    /// about every minute, and 2 s before the watch's timeout). As on the real server a bookmark
    /// is only sent once the resourceVersion moved past the one the watch started from (changes
    /// to objects the watch does not select move it too); from then on every interval, whether
    /// or not it moved again. Default 1 s. Takes effect on each watch's next scheduled bookmark.
    pub fn set_bookmark_interval(&self, every: Duration) {
        self.shared.store().bookmark_interval = every.max(Duration::from_millis(10));
    }

    /// Turns the WatchList feature gate on or off (off by default, as in Kubernetes 1.33): with it
    /// off a watch with `sendInitialEvents` is rejected with 422 Invalid; with it on it is served
    /// as a streaming list (initial ADDED events, then a BOOKMARK annotated
    /// `k8s.io/initial-events-end`).
    pub fn set_watch_list(&self, enabled: bool) {
        self.shared.store().watch_list = enabled;
    }

    /// A new bearer token that TokenReviews accept as `user` in `groups`, for the API
    /// server's own audience (`https://kubernetes.default.svc`, what a service account token
    /// is for unless it was requested for another).
    pub fn issue_token(&self, user: &str, groups: &[&str]) -> String {
        self.issue_token_for(user, groups, &[API_AUDIENCE])
    }

    /// A new bearer token meant for `audiences`.
    pub fn issue_token_for(&self, user: &str, groups: &[&str], audiences: &[&str]) -> String {
        let token = B64_URL.encode(random_bytes(24));
        let strings = |l: &[&str]| l.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        self.shared.store().review_tokens.insert(
            token.clone(),
            TokenHolder {
                user: user.to_owned(),
                uid: new_uid(),
                groups: strings(groups),
                audiences: strings(audiences),
            },
        );
        token
    }

    /// Binds a ClusterRole with `verbs` on the non-resource URLs `paths` (exact, or a prefix
    /// ending in `*`) to `subject`: what SubjectAccessReviews are decided by. No grant, no
    /// access.
    pub fn grant(&self, subject: Subject, verbs: &[&str], paths: &[&str]) {
        let mut st = self.shared.store();
        let n = st.grants.len() + 1;
        st.grants.push(Grant {
            name: format!("metrics-reader-{n}"),
            subject,
            verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
            paths: paths.iter().map(|p| (*p).to_owned()).collect(),
        });
    }

    /// Every PATCH of a ConfigMap is committed (and its watch event sent) at once, and
    /// answered only after this long: the writer hears of its write after the watch does.
    pub fn set_patch_answer_delay(&self, delay: Duration) {
        self.shared.store().patch_answer_delay = delay;
    }

    /// Every review answers only after this long (so that concurrent requests overlap one).
    pub fn set_review_delay(&self, delay: Duration) {
        self.shared.store().review_delay = delay;
    }

    /// The TokenReview bodies received, in order.
    pub fn token_reviews(&self) -> Vec<Value> {
        self.shared.store().token_reviews.clone()
    }

    /// The SubjectAccessReview bodies received, in order.
    pub fn access_reviews(&self) -> Vec<Value> {
        self.shared.store().access_reviews.clone()
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared.store().requests.clone()
    }

    pub fn open_watches(&self) -> usize {
        self.shared.store().watches.len()
    }

    /// When the last ADDED/MODIFIED/DELETED watch event was flushed to a client's socket
    /// (bookmarks do not count).
    pub fn last_event_sent(&self) -> Option<Instant> {
        *lock(&self.shared.last_event_sent)
    }

    /// The current resourceVersion (the last one handed out).
    pub fn resource_version(&self) -> u64 {
        self.shared.store().rv
    }

    fn delete(&self, key: Key) -> u64 {
        let mut st = self.shared.store();
        if st.current.contains_key(&key) {
            st.commit(key, None)
        } else {
            st.rv
        }
    }

    fn listen(&self, listener: StdTcpListener) {
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        self.roundtrip(|done| Command::Listen(listener, done));
    }

    fn roundtrip(&self, command: impl FnOnce(std_mpsc::SyncSender<()>) -> Command) {
        let (done, wait) = std_mpsc::sync_channel(1);
        let commands = self.commands.as_ref().expect("server is running");
        commands
            .send(command(done))
            .expect("apiserver thread alive");
        wait.recv().expect("apiserver thread answered");
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // Closing the command channel ends the control loop, which stops serving first.
        self.commands.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Binds the port again after `stop`; retries briefly in case the old socket is still closing.
fn bind_retrying(port: u16) -> StdTcpListener {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match StdTcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            Ok(listener) => return listener,
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("rebind 127.0.0.1:{port}: {e}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Store
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Res {
    ConfigMaps,
    ControllerConfigs,
}

impl Res {
    fn kind(self) -> &'static str {
        match self {
            Res::ConfigMaps => "ConfigMap",
            Res::ControllerConfigs => "ControllerConfig",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Res::ConfigMaps => "v1",
            Res::ControllerConfigs => "machineconfiguration.openshift.io/v1",
        }
    }

    fn group(self) -> &'static str {
        match self {
            Res::ConfigMaps => "",
            Res::ControllerConfigs => MCO_GROUP,
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Res::ConfigMaps => "configmaps",
            Res::ControllerConfigs => "controllerconfigs",
        }
    }

    fn namespaced(self) -> bool {
        self == Res::ConfigMaps
    }

    /// Built-in types are encoded from Go structs, custom resources from unstructured maps. It
    /// shows on the wire: items of a built-in list have no kind/apiVersion (kubernetes#3030),
    /// items of a custom resource list keep them; and JSON keys of custom resources are sorted.
    fn builtin(self) -> bool {
        self == Res::ConfigMaps
    }

    /// The resource as named in error messages: "configmaps", "controllerconfigs.group".
    fn qualified(self) -> String {
        match self.group() {
            "" => self.plural().to_owned(),
            group => format!("{}.{group}", self.plural()),
        }
    }
}

/// (resource, namespace or "" when cluster-scoped, name).
type Key = (Res, String, String);

/// The store as a backup holds it ([`ApiServer::backup`]).
pub struct Backup {
    rv: u64,
    objects: BTreeMap<Key, Arc<Value>>,
}

/// One write, as etcd's history and the watch cache keep it.
struct Change {
    rv: u64,
    key: Key,
    /// The new state; None for a deletion.
    obj: Option<Arc<Value>>,
    prev: Option<Arc<Value>>,
}

struct WatchReg {
    filter: Filter,
    /// Only changes after this resourceVersion are sent live (the rest were replayed).
    after: u64,
    tx: mpsc::UnboundedSender<Msg>,
}

struct Store {
    /// The global revision counter: the last resourceVersion handed out.
    rv: u64,
    /// etcd's compaction revision: exact reads and continue tokens below it get 410.
    compacted: u64,
    /// The watch cache's floor: watches resuming below it get 410 (`oldest - 1` upstream).
    watch_floor: u64,
    /// The state at `compacted`, and every change since.
    base: BTreeMap<Key, Arc<Value>>,
    log: Vec<Change>,
    current: BTreeMap<Key, Arc<Value>>,
    watches: HashMap<u64, WatchReg>,
    next_watch_id: u64,
    requests: Vec<Request>,
    /// What `fail_next_on` armed: (requests left, which ones, what they get).
    fail: Option<(usize, Target, Fault)>,
    /// What every request gets while the server sheds load (see `ApiServer::shed`).
    shed: Option<Fault>,
    /// The agent's RBAC rules; None allows every request of the fixture user.
    rules: Option<Vec<Rule>>,
    bookmark_interval: Duration,
    watch_list: bool,
    touches: u64,
    /// Bearer tokens a TokenReview accepts, and who holds each.
    review_tokens: HashMap<String, TokenHolder>,
    /// Non-resource grants SubjectAccessReviews are decided by.
    grants: Vec<Grant>,
    /// How long each review takes to answer.
    review_delay: Duration,
    /// How long a committed ConfigMap PATCH waits before it is answered.
    patch_answer_delay: Duration,
    /// The bodies of the reviews received, in order.
    token_reviews: Vec<Value>,
    access_reviews: Vec<Value>,
}

impl Store {
    fn new() -> Store {
        Store {
            rv: INITIAL_RV,
            compacted: INITIAL_RV,
            watch_floor: INITIAL_RV,
            base: BTreeMap::new(),
            log: Vec::new(),
            current: BTreeMap::new(),
            watches: HashMap::new(),
            next_watch_id: 1,
            requests: Vec::new(),
            fail: None,
            shed: None,
            rules: None,
            bookmark_interval: Duration::from_secs(1),
            watch_list: false,
            touches: 0,
            review_tokens: HashMap::new(),
            grants: Vec::new(),
            review_delay: Duration::ZERO,
            patch_answer_delay: Duration::ZERO,
            token_reviews: Vec::new(),
            access_reviews: Vec::new(),
        }
    }

    /// Writes `obj` (None deletes) at the next resourceVersion and tells the watches.
    fn commit(&mut self, key: Key, obj: Option<Value>) -> u64 {
        self.rv += 1;
        let rv = self.rv;
        let obj = obj.map(|mut o| {
            o["metadata"]["resourceVersion"] = json!(rv.to_string());
            Arc::new(o)
        });
        let prev = match &obj {
            Some(o) => self.current.insert(key.clone(), o.clone()),
            None => self.current.remove(&key),
        };
        let change = Change { rv, key, obj, prev };
        for w in self.watches.values() {
            if rv > w.after
                && let Some(line) = w.filter.event(&change)
            {
                let _ = w.tx.send(Msg::Line(line));
            }
        }
        self.log.push(change);
        rv
    }

    /// An Update by `manager` leaving the ConfigMap's maps as `content` (creating it if need
    /// be), with managedFields moved as upstream moves them. A write that changes nothing is not
    /// stored. Returns the resourceVersion.
    fn update_configmap(&mut self, key: Key, manager: &str, content: Content) -> u64 {
        let prev = self.current.get(&key).cloned();
        let (live, managers) = match prev.as_deref() {
            Some(p) => (Content::of(p), Manager::all_of(p)),
            None => Default::default(),
        };
        let written = update_fields(&live, &managers, &content, manager, &now_rfc3339());
        let obj = configmap_object(&key.1, &key.2, &written, prev.as_deref());
        match prev {
            Some(p) if *p == obj => object_rv(&p),
            _ => self.commit(key, Some(obj)),
        }
    }

    /// The objects as of resourceVersion `rv` (at least `compacted`).
    fn snapshot(&self, rv: u64) -> BTreeMap<Key, Arc<Value>> {
        if rv >= self.rv {
            return self.current.clone();
        }
        let mut state = self.base.clone();
        for c in self.log.iter().take_while(|c| c.rv <= rv) {
            match &c.obj {
                Some(o) => state.insert(c.key.clone(), o.clone()),
                None => state.remove(&c.key),
            };
        }
        state
    }

    /// A restarted apiserver: its own writes on start move the revision on, and its watch cache
    /// begins there, past every resourceVersion a client has seen. The writes are to objects no
    /// test watches (a Lease, the `kubernetes` Endpoints), so they are not kept in the history.
    fn forget_watch_cache(&mut self) {
        self.rv += 1;
        self.watch_floor = self.rv;
    }

    /// The store as `backup` left it: its objects at its revision, no history before it.
    fn restore(&mut self, backup: &Backup) {
        self.rv = backup.rv;
        self.current = backup.objects.clone();
        self.base = self.current.clone();
        self.log.clear();
        self.compacted = self.rv;
        self.watch_floor = self.rv.min(self.watch_floor);
    }

    fn compact(&mut self) {
        self.base = self.current.clone();
        self.log.clear();
        self.compacted = self.rv;
        self.watch_floor = self.rv;
    }

    /// The fault for a request of this kind, if any: the load being shed, else an armed one
    /// (using one of its count).
    fn take_failure(&mut self, kind: Kind) -> Option<Fault> {
        if let Some(fault) = self.shed {
            return Some(fault);
        }
        let (count, target, fault) = self.fail?;
        let hit = match target {
            Target::Any => true,
            Target::List => kind == Kind::List,
            Target::Watch => kind == Kind::Watch,
            Target::Write => kind == Kind::Write,
        };
        if !hit {
            return None;
        }
        self.fail = (count > 1).then_some((count - 1, target, fault));
        Some(fault)
    }
}

struct Shared {
    store: Mutex<Store>,
    /// The fixture user's bearer token (see `ApiServer::rotate_token`).
    token: Mutex<String>,
    /// The tokens `ApiServer::kubeconfig_for` made, and the node user each names.
    node_tokens: Mutex<HashMap<String, String>>,
    port: u16,
    /// The x509 authenticator's check of a chain against the client CA (clientAuth usage).
    client_auth: Arc<dyn ClientCertVerifier>,
    serving: Arc<ServingCertificates>,
    provider: Arc<CryptoProvider>,
    /// TLS connections accepted so far (their numbers in `Request::connection`).
    connections: AtomicU64,
    last_event_sent: Mutex<Option<Instant>>,
    /// The resourceVersion of the last event or bookmark handed to a watch's connection.
    last_rv_delivered: Mutex<Option<u64>>,
    /// Set while the server is hung (see `ApiServer::hang`).
    hang: tokio::sync::watch::Sender<Option<HangMode>>,
    flow_schema_uid: String,
    priority_level_uid: String,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    fn token(&self) -> String {
        lock(&self.token).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn object_rv(obj: &Value) -> u64 {
    str_at(obj, "/metadata/resourceVersion")
        .parse()
        .unwrap_or(0)
}

fn str_at<'a>(obj: &'a Value, pointer: &str) -> &'a str {
    obj.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

// ---------------------------------------------------------------------------------------------
// Objects
// ---------------------------------------------------------------------------------------------

/// A ConfigMap holding `written`: `prev` with its maps and managedFields replaced, or a new
/// object (fresh uid and creationTimestamp, resourceVersion set by the commit).
fn configmap_object(namespace: &str, name: &str, written: &Written, prev: Option<&Value>) -> Value {
    let mut obj = match prev {
        Some(p) => p.clone(),
        None => {
            let (uid, created) = identity(None);
            json!({
                "kind": "ConfigMap",
                "apiVersion": "v1",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": uid,
                    "resourceVersion": "",
                    "creationTimestamp": created,
                },
            })
        }
    };
    written.content.write(&mut obj);
    match written.managers.as_slice() {
        [] => {
            if let Some(meta) = obj["metadata"].as_object_mut() {
                meta.remove("managedFields");
            }
        }
        managers => {
            obj["metadata"]["managedFields"] = managers.iter().map(Manager::to_json).collect();
        }
    }
    obj
}

/// An OpenShift ControllerConfig as the machine-config-operator writes it: the field under test
/// plus the rest of a real spec and status, so that objects are of realistic size.
fn controllerconfig_object(
    name: &str,
    ca_data: &str,
    release: &str,
    prev: Option<&Value>,
) -> Value {
    let (uid, created) = identity(prev);
    let generation = prev
        .and_then(|p| p.pointer("/metadata/generation"))
        .and_then(Value::as_i64)
        .map_or(1, |g| g + 1);
    let art = |component: &str| {
        format!(
            "quay.io/openshift-release-dev/ocp-v4.0-art-dev@sha256:{}",
            hex(&seeded_bytes(component, 32))
        )
    };
    let now = now_rfc3339();
    let managed_fields = json!([
        {
            "manager": "machine-config-operator",
            "operation": "Update",
            "apiVersion": "machineconfiguration.openshift.io/v1",
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:annotations": {".": {}, "f:machineconfiguration.openshift.io/generated-by-controller-version": {}}}, "f:spec": {".": {}, "f:additionalTrustBundle": {}, "f:baseOSContainerImage": {}, "f:baseOSExtensionsContainerImage": {}, "f:cloudProviderCAData": {}, "f:cloudProviderConfig": {}, "f:clusterDNSIP": {}, "f:dns": {}, "f:images": {}, "f:infra": {}, "f:internalRegistryPullSecret": {}, "f:ipFamilies": {}, "f:kubeAPIServerServingCAData": {}, "f:network": {}, "f:networkType": {}, "f:osImageURL": {}, "f:platform": {}, "f:proxy": {}, "f:pullSecret": {}, "f:releaseImage": {}, "f:rootCAData": {}}}
        },
        {
            "manager": "machine-config-controller",
            "operation": "Update",
            "apiVersion": "machineconfiguration.openshift.io/v1",
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {".": {}, "f:conditions": {}, "f:controllerCertificates": {}, "f:observedGeneration": {}}},
            "subresource": "status"
        }
    ]);
    let dns = json!({
        "apiVersion": "config.openshift.io/v1",
        "kind": "DNS",
        "metadata": {"creationTimestamp": created, "generation": 1, "name": "cluster", "resourceVersion": "535", "uid": "a1e7c3d2-6b0f-4c4e-9d57-0c0a5b3e8f11"},
        "spec": {"baseDomain": "fixture.example.com", "platform": {"aws": null, "type": ""}},
        "status": {}
    });
    let images = json!({
        "apiServerWatcherKey": art("apiserver-watcher"),
        "baremetalRuntimeCfgImage": art("baremetal-runtimecfg"),
        "corednsImage": art("coredns"),
        "haproxyImage": art("haproxy-router"),
        "infraImageKey": art("pod"),
        "keepalivedImage": art("keepalived-ipfailover"),
        "kubeClientAgentImageKey": art("kube-client-agent"),
        "releaseImageKey": release,
    });
    let infra_status = json!({
        "apiServerInternalURI": "https://api-int.fixture.example.com:6443",
        "apiServerURL": "https://api.fixture.example.com:6443",
        "controlPlaneTopology": "HighlyAvailable",
        "cpuPartitioning": "None",
        "etcdDiscoveryDomain": "",
        "infrastructureName": "fixture-7xk2p",
        "infrastructureTopology": "HighlyAvailable",
        "platform": "None",
        "platformStatus": {"type": "None"}
    });
    let infra = json!({
        "apiVersion": "config.openshift.io/v1",
        "kind": "Infrastructure",
        "metadata": {"creationTimestamp": created, "generation": 1, "name": "cluster", "resourceVersion": "540", "uid": "5f0c1b9e-2a7d-4f3b-8e6a-9b2d4c1e7a30"},
        "spec": {"cloudConfig": {"name": ""}, "platformSpec": {"type": "None"}},
        "status": infra_status
    });
    let spec = json!({
        "additionalTrustBundle": null,
        "baseOSContainerImage": art("rhel-coreos"),
        "baseOSExtensionsContainerImage": art("rhel-coreos-extensions"),
        "cloudProviderCAData": null,
        "cloudProviderConfig": "",
        "clusterDNSIP": "172.30.0.10",
        "dns": dns,
        "images": images,
        "infra": infra,
        "internalRegistryPullSecret": B64.encode(pull_secret_json()),
        "ipFamilies": "IPv4",
        "kubeAPIServerServingCAData": ca_data,
        "network": {"mtuMigration": null},
        "networkType": "OVNKubernetes",
        "osImageURL": "",
        "platform": "none",
        "proxy": null,
        "pullSecret": {"name": "pull-secret", "namespace": "openshift-config"},
        "releaseImage": release,
        "rootCAData": B64.encode(fake_pem("root-ca")),
    });
    let certificate = |file: &str, cn: &str| {
        json!({"bundleFile": file, "notAfter": "2035-01-01T00:00:00Z", "notBefore": "2025-01-01T00:00:00Z",
               "signer": format!("CN={cn},OU=openshift"), "subject": format!("CN={cn},OU=openshift")})
    };
    let condition = |kind: &str, status: &str| json!({"lastTransitionTime": created, "message": "", "reason": "", "status": status, "type": kind});
    let status = json!({
        "conditions": [
            condition("TemplateControllerFailing", "False"),
            condition("TemplateControllerRunning", "False"),
            condition("TemplateControllerCompleted", "True"),
        ],
        "controllerCertificates": [
            certificate("KubeAPIServerServingCAData", "kube-apiserver-lb-signer"),
            certificate("KubeAPIServerServingCAData", "kube-apiserver-localhost-signer"),
            certificate("RootCAData", "root-ca"),
        ],
        "observedGeneration": generation
    });
    json!({
        "apiVersion": "machineconfiguration.openshift.io/v1",
        "kind": "ControllerConfig",
        "metadata": {
            "name": name,
            "uid": uid,
            "resourceVersion": "",
            "generation": generation,
            "creationTimestamp": created,
            "annotations": {
                "machineconfiguration.openshift.io/generated-by-controller-version": "4.20.0-202510141116.p2.g1d4f2b5.assembly.stream.el9"
            },
            "managedFields": managed_fields,
        },
        "spec": spec,
        "status": status,
    })
}

fn release_image(serial: u64) -> String {
    format!(
        "quay.io/openshift-release-dev/ocp-release@sha256:{}",
        hex(&seeded_bytes(&format!("release-{serial}"), 32))
    )
}

fn pull_secret_json() -> String {
    let auth = B64.encode(seeded_bytes("registry-auth", 600));
    format!(
        "{{\"auths\":{{\"image-registry.openshift-image-registry.svc:5000\":{{\"auth\":\"{auth}\"}},\"image-registry.openshift-image-registry.svc.cluster.local:5000\":{{\"auth\":\"{auth}\"}}}}}}"
    )
}

/// PEM armour around random bytes: the size and shape of a certificate, not a valid one.
fn fake_pem(seed: &str) -> String {
    pem_of(&seeded_bytes(seed, 900))
}

/// The uid and creationTimestamp kept across updates, or fresh ones for a create.
fn identity(prev: Option<&Value>) -> (String, String) {
    match prev {
        Some(p) => (
            str_at(p, "/metadata/uid").to_owned(),
            str_at(p, "/metadata/creationTimestamp").to_owned(),
        ),
        None => (new_uid(), now_rfc3339()),
    }
}

// ---------------------------------------------------------------------------------------------
// Field management: managedFields and server-side apply, for ConfigMaps
// ---------------------------------------------------------------------------------------------
//
// structured-merge-diff's rules (merge.Updater, with managedfields' managers around it) at the
// granularity of a ConfigMap: each entry of `data`, `binaryData`, `metadata.labels` and
// `metadata.annotations` is a field a manager may own, and so is each of those maps itself
// (`.` in FieldsV1) for the Update manager whose write made it appear. Pure functions: the
// request handler and the `ApiServer` helpers read the store, call in, and commit.

/// A map of a ConfigMap whose entries are owned one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Section {
    BinaryData,
    Data,
    Annotations,
    Labels,
}

impl Section {
    const ALL: [Section; 4] = [
        Section::BinaryData,
        Section::Data,
        Section::Annotations,
        Section::Labels,
    ];

    /// Where the map sits in the object.
    fn path(self) -> &'static [&'static str] {
        match self {
            Section::BinaryData => &["binaryData"],
            Section::Data => &["data"],
            Section::Annotations => &["metadata", "annotations"],
            Section::Labels => &["metadata", "labels"],
        }
    }

    fn in_object(self, obj: &Value) -> Option<&Value> {
        self.path().iter().try_fold(obj, |node, seg| node.get(*seg))
    }
}

/// A field managers own: one entry of a section, or (no key) the section's map itself.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Field {
    section: Section,
    key: Option<String>,
}

impl Field {
    fn entry(section: Section, key: &str) -> Field {
        Field {
            section,
            key: Some(key.to_owned()),
        }
    }

    fn map(section: Section) -> Field {
        Field { section, key: None }
    }

    fn segments(&self) -> Vec<&str> {
        let mut segs = self.section.path().to_vec();
        segs.extend(self.key.as_deref());
        segs
    }
}

/// fieldpath.Path.String, as conflicts print a field: `.data.ca-bundle.crt`.
impl std::fmt::Display for Field {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.segments()
            .iter()
            .try_for_each(|seg| write!(f, ".{seg}"))
    }
}

/// The order fieldpath.Set.Iterate visits fields in: at each level the paths that end there,
/// then those that go deeper, each group by name.
fn set_order(a: &Field, b: &Field) -> std::cmp::Ordering {
    let (a, b) = (a.segments(), b.segments());
    let mut i = 0;
    loop {
        let (a_ends, b_ends) = (a.len() == i + 1, b.len() == i + 1);
        let order = b_ends.cmp(&a_ends).then_with(|| a[i].cmp(b[i]));
        if order.is_ne() || a_ends {
            return order;
        }
        i += 1;
    }
}

/// What field management sees of a ConfigMap: its four maps, each present (maybe empty) or
/// absent. `binaryData` values are their base64 text.
#[derive(Debug, Clone, Default, PartialEq)]
struct Content {
    maps: BTreeMap<Section, BTreeMap<String, String>>,
}

impl Content {
    /// The maps of a stored object.
    fn of(obj: &Value) -> Content {
        let mut maps = BTreeMap::new();
        for section in Section::ALL {
            if let Some(map) = section.in_object(obj).and_then(Value::as_object) {
                let entries = map
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                    .collect();
                maps.insert(section, entries);
            }
        }
        Content { maps }
    }

    /// The maps of an object a client wrote, checked the way the conversion to a typed object
    /// checks them: each a map of strings (`null` meaning absent), binaryData base64.
    fn typed(obj: &Value) -> Result<Content, Status> {
        let mut maps = BTreeMap::new();
        for section in Section::ALL {
            let map = match section.in_object(obj) {
                None | Some(Value::Null) => continue,
                Some(Value::Object(map)) => map,
                Some(_) => {
                    let field = Field::map(section);
                    return Err(Status::unmodelled(format!("{field} that is not a map")));
                }
            };
            let mut entries = BTreeMap::new();
            for (key, value) in map {
                let Some(text) = value.as_str() else {
                    let field = Field::entry(section, key);
                    return Err(Status::unmodelled(format!("{field} that is not a string")));
                };
                let text = if section == Section::BinaryData {
                    let bytes = B64.decode(text).map_err(|_| {
                        let field = Field::entry(section, key);
                        Status::unmodelled(format!("{field} that is not base64"))
                    })?;
                    B64.encode(bytes)
                } else {
                    text.to_owned()
                };
                entries.insert(key.clone(), text);
            }
            maps.insert(section, entries);
        }
        Ok(Content { maps })
    }

    fn value(&self, field: &Field) -> Option<&str> {
        let key = field.key.as_ref()?;
        self.maps.get(&field.section)?.get(key).map(String::as_str)
    }

    /// Every entry of every map, as the fields an applier of this content owns.
    fn entries(&self) -> BTreeSet<Field> {
        self.maps
            .iter()
            .flat_map(|(section, map)| map.keys().map(|k| Field::entry(*section, k)))
            .collect()
    }

    fn set(&mut self, field: &Field, value: &str) {
        if let Some(key) = &field.key {
            let map = self.maps.entry(field.section).or_default();
            map.insert(key.clone(), value.to_owned());
        }
    }

    fn remove(&mut self, field: &Field) {
        match &field.key {
            Some(key) => {
                if let Some(map) = self.maps.get_mut(&field.section) {
                    map.remove(key);
                }
            }
            None => {
                self.maps.remove(&field.section);
            }
        }
    }

    /// As storage keeps it: an empty map is not kept (omitempty).
    fn stored(mut self) -> Content {
        self.maps.retain(|_, map| !map.is_empty());
        self
    }

    /// Puts the maps into `obj`, leaving out the empty ones.
    fn write(&self, obj: &mut Value) {
        for section in Section::ALL {
            let (name, parents) = section.path().split_last().expect("a section has a path");
            let parent = parents.iter().fold(&mut *obj, |node, seg| &mut node[*seg]);
            match self.maps.get(&section).filter(|map| !map.is_empty()) {
                Some(map) => parent[*name] = json!(map),
                None => {
                    if let Some(parent) = parent.as_object_mut() {
                        parent.remove(*name);
                    }
                }
            }
        }
    }
}

/// typed.Comparison of two states of an object: the fields whose value changed, appeared,
/// vanished. A map is a field of its own that appears or vanishes with it.
#[derive(Debug, Default)]
struct Comparison {
    modified: BTreeSet<Field>,
    added: BTreeSet<Field>,
    removed: BTreeSet<Field>,
}

impl Comparison {
    fn of(old: &Content, new: &Content) -> Comparison {
        let mut c = Comparison::default();
        let none = BTreeMap::new();
        for section in Section::ALL {
            let (before, after) = (old.maps.get(&section), new.maps.get(&section));
            match (before, after) {
                (None, Some(_)) => c.added.insert(Field::map(section)),
                (Some(_), None) => c.removed.insert(Field::map(section)),
                _ => false,
            };
            let (before, after) = (before.unwrap_or(&none), after.unwrap_or(&none));
            for (key, value) in after {
                match before.get(key) {
                    None => c.added.insert(Field::entry(section, key)),
                    Some(old) if old != value => c.modified.insert(Field::entry(section, key)),
                    Some(_) => false,
                };
            }
            for key in before.keys().filter(|k| !after.contains_key(*k)) {
                c.removed.insert(Field::entry(section, key));
            }
        }
        c
    }

    /// What a write takes from the other managers: the fields it set to a new value.
    fn taken(&self) -> BTreeSet<Field> {
        self.modified.union(&self.added).cloned().collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Operation {
    Apply,
    Update,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Apply => "Apply",
            Operation::Update => "Update",
        }
    }
}

/// One entry of managedFields.
#[derive(Debug, Clone, PartialEq)]
struct Manager {
    name: String,
    operation: Operation,
    api_version: String,
    /// None for an applier whose first apply changed no value: managedFieldsUpdater stamps a
    /// time only when the object changed.
    time: Option<String>,
    fields: BTreeSet<Field>,
}

impl Manager {
    /// The entries of an object's metadata.managedFields.
    fn all_of(obj: &Value) -> Vec<Manager> {
        let entries = obj
            .pointer("/metadata/managedFields")
            .and_then(Value::as_array);
        entries
            .into_iter()
            .flatten()
            .map(|e| {
                let text = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or_default();
                let fields_v1 = e.get("fieldsV1").cloned().unwrap_or_else(|| json!({}));
                let mut fields = BTreeSet::new();
                for section in Section::ALL {
                    let node = section
                        .path()
                        .iter()
                        .try_fold(&fields_v1, |node, seg| node.get(format!("f:{seg}")));
                    for key in node
                        .and_then(Value::as_object)
                        .into_iter()
                        .flat_map(|m| m.keys())
                    {
                        match key.strip_prefix("f:") {
                            Some(k) => fields.insert(Field::entry(section, k)),
                            None => fields.insert(Field::map(section)),
                        };
                    }
                }
                Manager {
                    name: text("manager").to_owned(),
                    operation: match text("operation") {
                        "Apply" => Operation::Apply,
                        _ => Operation::Update,
                    },
                    api_version: text("apiVersion").to_owned(),
                    time: e.get("time").and_then(Value::as_str).map(str::to_owned),
                    fields,
                }
            })
            .collect()
    }

    fn applier(name: &str, fields: BTreeSet<Field>, time: Option<String>) -> Manager {
        Manager {
            name: name.to_owned(),
            operation: Operation::Apply,
            api_version: "v1".to_owned(),
            time,
            fields,
        }
    }

    fn is(&self, name: &str, operation: Operation) -> bool {
        self.name == name && self.operation == operation && self.api_version == "v1"
    }

    /// BuildManagerIdentifier: the entry's JSON without fields or time, and without the
    /// apiVersion for an applier (one applier, whatever version it applied).
    fn identifier(&self) -> String {
        let mut id = String::from("{");
        if !self.name.is_empty() {
            id.push_str(&format!("\"manager\":{},", json!(self.name)));
        }
        id.push_str(&format!("\"operation\":\"{}\"", self.operation.as_str()));
        if self.operation == Operation::Update {
            id.push_str(&format!(",\"apiVersion\":{}", json!(self.api_version)));
        }
        id.push('}');
        id
    }

    /// printManager: how a conflict names the manager.
    fn printed(&self) -> String {
        match self.operation {
            Operation::Apply => format!("{:?}", self.name),
            Operation::Update => format!("{:?} using {}", self.name, self.api_version),
        }
    }

    fn to_json(&self) -> Value {
        let mut fields = serde_json::Map::new();
        for field in &self.fields {
            let mut node = &mut fields;
            for seg in field.section.path() {
                node = node
                    .entry(format!("f:{seg}"))
                    .or_insert_with(|| json!({}))
                    .as_object_mut()
                    .expect("a FieldsV1 node is an object");
            }
            let leaf = match &field.key {
                Some(key) => format!("f:{key}"),
                None => ".".to_owned(),
            };
            node.insert(leaf, json!({}));
        }
        let mut entry = json!({
            "operation": self.operation.as_str(),
            "apiVersion": self.api_version,
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
        });
        // omitempty
        if !self.name.is_empty() {
            entry["manager"] = json!(self.name);
        }
        if let Some(time) = &self.time {
            entry["time"] = json!(time);
        }
        entry
    }
}

/// sortEncodedManagedFields: appliers first, then the oldest (no time counts as the epoch),
/// then by name.
fn sort_managers(managers: &mut [Manager]) {
    managers.sort_by(|a, b| {
        let time = |m: &Manager| m.time.clone().unwrap_or_default();
        a.operation
            .cmp(&b.operation)
            .then_with(|| time(a).cmp(&time(b)))
            .then_with(|| a.name.cmp(&b.name))
            .then_with(|| a.api_version.cmp(&b.api_version))
    });
}

/// A field an apply would set to a new value while another manager owns it.
#[derive(Debug, Clone)]
struct Conflict {
    /// The other manager's identifier (conflicts are grouped and sorted by it).
    identifier: String,
    /// How the message names it: `"kubectl-edit" using v1`.
    manager: String,
    field: Field,
}

/// What a write leaves: the maps as stored and the managedFields entries, sorted.
#[derive(Debug, Clone, PartialEq)]
struct Written {
    content: Content,
    managers: Vec<Manager>,
}

/// A server-side apply by `applier` of the maps in `applied` (merge.Updater.Apply under
/// managedFieldsUpdater): the applied entries are merged in and become exactly the applier's
/// set; an entry it applied last time and not now is removed unless another manager owns it;
/// an entry another manager owns that the apply changes is a conflict, unless `force` (then
/// ownership moves); the same value set by both is owned by both. The applier's time moves
/// only when the object changed.
fn apply_fields(
    live: &Content,
    managers: &[Manager],
    applied: &Content,
    applier: &str,
    force: bool,
    now: &str,
) -> Result<Written, Vec<Conflict>> {
    let is_applier = |m: &&Manager| m.is(applier, Operation::Apply);
    let previous = managers.iter().find(is_applier);
    let set = applied.entries();

    let mut merged = live.clone();
    for field in &set {
        merged.set(field, applied.value(field).unwrap_or_default());
    }
    for section in applied.maps.keys() {
        merged.maps.entry(*section).or_default();
    }
    // Prune what the applier gave up, unless someone (the applier's new set included) owns it.
    let mut owned: BTreeSet<Field> = managers
        .iter()
        .filter(|m| !is_applier(m))
        .flat_map(|m| m.fields.iter().cloned())
        .collect();
    owned.extend(set.iter().cloned());
    for field in previous.iter().flat_map(|m| m.fields.iter()) {
        if field.key.is_some() && !owned.contains(field) {
            merged.remove(field);
        }
    }

    let changes = Comparison::of(live, &merged);
    let taken = changes.taken();
    let mut others: Vec<Manager> = managers
        .iter()
        .filter(|m| !is_applier(m))
        .cloned()
        .collect();
    let mut conflicts: Vec<Conflict> = others
        .iter()
        .flat_map(|m| {
            m.fields.intersection(&taken).map(|field| Conflict {
                identifier: m.identifier(),
                manager: m.printed(),
                field: field.clone(),
            })
        })
        .collect();
    if !force && !conflicts.is_empty() {
        conflicts.sort_by(|a, b| {
            a.identifier
                .cmp(&b.identifier)
                .then_with(|| set_order(&a.field, &b.field))
        });
        return Err(conflicts);
    }
    for m in &mut others {
        m.fields
            .retain(|f| !taken.contains(f) && !changes.removed.contains(f));
    }
    others.retain(|m| !m.fields.is_empty());

    let content = merged.stored();
    let changed = content != live.clone().stored();
    if !set.is_empty() {
        let time = if changed {
            Some(now.to_owned())
        } else {
            previous.and_then(|m| m.time.clone())
        };
        others.push(Manager::applier(applier, set, time));
    }
    sort_managers(&mut others);
    Ok(Written {
        content,
        managers: others,
    })
}

/// An Update (a PUT, or a non-apply PATCH) by `updater` that leaves the maps as `new`
/// (merge.Updater.Update under managedFieldsUpdater): the fields it set to a new value (maps it
/// created included) move to it from whoever owned them, fields it removed leave every manager,
/// and its time moves when it took a field. Nothing changed, nothing moves.
fn update_fields(
    live: &Content,
    managers: &[Manager],
    new: &Content,
    updater: &str,
    now: &str,
) -> Written {
    let changes = Comparison::of(live, new);
    let taken = changes.taken();
    let mut managers = managers.to_vec();
    for m in &mut managers {
        m.fields
            .retain(|f| !taken.contains(f) && !changes.removed.contains(f));
    }
    if !taken.is_empty() {
        match managers
            .iter_mut()
            .find(|m| m.is(updater, Operation::Update))
        {
            Some(m) => {
                m.fields.extend(taken);
                m.time = Some(now.to_owned());
            }
            None => managers.push(Manager {
                name: updater.to_owned(),
                operation: Operation::Update,
                api_version: "v1".to_owned(),
                time: Some(now.to_owned()),
                fields: taken,
            }),
        }
    }
    managers.retain(|m| !m.fields.is_empty());
    sort_managers(&mut managers);
    Written {
        content: new.clone().stored(),
        managers,
    }
}

/// core.MaxSecretSize, which bounds a ConfigMap's values too.
const MAX_CONFIGMAP_BYTES: usize = 1024 * 1024;

/// ValidateConfigMap (pkg/apis/core/validation): every key a valid config key and in one map
/// only, and at most 1 MiB of values (binaryData counted decoded).
fn validate_configmap(content: &Content) -> Vec<FieldError> {
    let none = BTreeMap::new();
    let data = content.maps.get(&Section::Data).unwrap_or(&none);
    let binary = content.maps.get(&Section::BinaryData).unwrap_or(&none);
    let invalid = |path: &str, key: &str, detail: &str| FieldError {
        field: format!("{path}[{key}]"),
        reason: "FieldValueInvalid",
        body: format!("Invalid value: {key:?}: {detail}"),
    };
    let mut errs = Vec::new();
    let mut total = 0;
    for (key, value) in data {
        errs.extend(
            config_key_errors(key)
                .iter()
                .map(|e| invalid("data", key, e)),
        );
        if binary.contains_key(key) {
            errs.push(invalid(
                "data",
                key,
                "duplicate of key present in binaryData",
            ));
        }
        total += value.len();
    }
    for (key, value) in binary {
        errs.extend(
            config_key_errors(key)
                .iter()
                .map(|e| invalid("binaryData", key, e)),
        );
        total += B64.decode(value).map_or(0, |bytes| bytes.len());
    }
    if total > MAX_CONFIGMAP_BYTES {
        // field.NewPath("") prints as "[]": the error is about the whole object.
        errs.push(FieldError {
            field: "[]".to_owned(),
            reason: "FieldValueTooLong",
            body: format!("Too long: may not be more than {MAX_CONFIGMAP_BYTES} bytes"),
        });
    }
    errs
}

/// validation.IsConfigMapKey.
fn config_key_errors(key: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if key.len() > 253 {
        errs.push("must be no more than 253 characters".to_owned());
    }
    let valid_chars = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_');
    if key.is_empty() || !key.chars().all(valid_chars) {
        errs.push("a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')".to_owned());
    }
    match key {
        "." => errs.push("must not be '.'".to_owned()),
        ".." => errs.push("must not be '..'".to_owned()),
        k if k.starts_with("..") => errs.push("must not start with '..'".to_owned()),
        _ => {}
    }
    errs
}

// ---------------------------------------------------------------------------------------------
// Patches: server-side apply and merge patches of ConfigMaps
// ---------------------------------------------------------------------------------------------

/// What a PATCH body is, by its Content-Type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PatchType {
    Json,
    Merge,
    Strategic,
    Apply,
}

impl PatchType {
    /// What kube-apiserver 1.33 accepts for a built-in resource, in its order (CBOR apply is
    /// behind an alpha feature gate).
    const ACCEPTED: [&'static str; 4] = [
        "application/json-patch+json",
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
        "application/apply-patch+yaml",
    ];

    /// patch.go: the Content-Type up to a `;`, matched exactly.
    fn of(content_type: &str) -> Option<PatchType> {
        let base = match content_type.find(';') {
            Some(i) if i > 0 => &content_type[..i],
            _ => content_type,
        };
        let types = [
            PatchType::Json,
            PatchType::Merge,
            PatchType::Strategic,
            PatchType::Apply,
        ];
        let i = PatchType::ACCEPTED.iter().position(|t| *t == base)?;
        Some(types[i])
    }
}

/// The request body limit (MaxRequestBodyBytes, 3 MiB by default).
const MAX_REQUEST_BODY: usize = 3 * 1024 * 1024;

/// ValidatePatchOptions (apimachinery's meta/v1 validation), for the options read here.
fn validate_patch_options(
    patch_type: PatchType,
    force_given: bool,
    field_manager: &str,
    dry_run: &[String],
) -> Result<(), Status> {
    let mut errs = Vec::new();
    if patch_type != PatchType::Apply {
        if force_given {
            errs.push(forbidden_field(
                "force",
                "may not be specified for non-apply patch",
            ));
        }
    } else if field_manager.is_empty() {
        errs.push(FieldError {
            field: "fieldManager".to_owned(),
            reason: "FieldValueRequired",
            body: "Required value: is required for apply patch".to_owned(),
        });
    }
    if field_manager.len() > 128 {
        errs.push(FieldError {
            field: "fieldManager".to_owned(),
            reason: "FieldValueTooLong",
            body: "Too long: may not be more than 128 bytes".to_owned(),
        });
    }
    // unicode.IsPrint, near enough: no control characters, no space but ' '.
    let unprintable = |c: char| c.is_control() || (c.is_whitespace() && c != ' ');
    for (i, c) in field_manager
        .char_indices()
        .filter(|(_, c)| unprintable(*c))
    {
        errs.push(FieldError {
            field: "fieldManager".to_owned(),
            reason: "FieldValueInvalid",
            body: format!(
                "Invalid value: {field_manager:?}: invalid character U+{:04X} (at position {i})",
                c as u32
            ),
        });
    }
    if dry_run.iter().any(|v| v != "All") {
        let values: Vec<String> = dry_run.iter().map(|v| format!("{v:?}")).collect();
        errs.push(FieldError {
            field: "dryRun".to_owned(),
            reason: "FieldValueNotSupported",
            body: format!(
                "Unsupported value: []string{{{}}}: supported values: \"All\"",
                values.join(", ")
            ),
        });
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(Status::invalid("meta.k8s.io", "PatchOptions", "", &errs))
    }
}

/// prefixFromUserAgent: who a non-apply patch without fieldManager is recorded as.
fn manager_from_user_agent(user_agent: &str) -> String {
    let product = user_agent.split('/').next().unwrap_or_default();
    let mut manager = String::new();
    for c in product.chars().filter(|c| !c.is_control()) {
        if manager.len() + c.len_utf8() > 128 {
            break;
        }
        manager.push(c);
    }
    manager
}

/// An apply configuration, as applyPatcher decodes it (yaml.Unmarshal into a map). JSON is the
/// YAML this server reads; text with no structure is a YAML string, anything else is refused as
/// unmodelled.
fn apply_configuration(body: &[u8]) -> Result<serde_json::Map<String, Value>, Status> {
    let not_a_map = |what: &str| {
        Status::bad_request(format!(
            "error decoding YAML: error unmarshaling JSON: while decoding JSON: json: cannot unmarshal {what} into Go value of type map[string]interface {{}}"
        ))
    };
    let text = String::from_utf8_lossy(body);
    if text.trim().is_empty() {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(Value::Null) => Ok(serde_json::Map::new()),
        Ok(Value::Array(_)) => Err(not_a_map("array")),
        Ok(Value::String(_)) => Err(not_a_map("string")),
        Ok(Value::Number(_)) => Err(not_a_map("number")),
        Ok(Value::Bool(_)) => Err(not_a_map("bool")),
        Err(_) if text.contains(':') || text.trim_start().starts_with(['-', '[', '{']) => Err(
            Status::unmodelled("an apply body that is YAML but not JSON"),
        ),
        Err(_) => Err(not_a_map("string")),
    }
}

/// schema.GroupVersionKind.String of an object's apiVersion and kind, as unstructured reads
/// them (an apiVersion with more than one `/` reads as nothing).
fn gvk_of(obj: &serde_json::Map<String, Value>) -> String {
    let text = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or_default();
    let (api_version, kind) = (text("apiVersion"), text("kind"));
    match api_version.split('/').collect::<Vec<_>>().as_slice() {
        [version] => format!("/{version}, Kind={kind}"),
        [group, version] => format!("{group}/{version}, Kind={kind}"),
        _ => "/, Kind=".to_owned(),
    }
}

/// The checks the field manager makes of an apply configuration before it merges anything:
/// the type (versionCheckManager), no managedFields (structuredMergeManager), then the fields
/// the ConfigMap schema declares (the type converter: anything else is a plain error, so a
/// 500). Metadata this server does not model is refused as unmodelled.
fn check_apply_configuration(cfg: &serde_json::Map<String, Value>) -> Result<(), Status> {
    let gvk = gvk_of(cfg);
    if gvk != "/v1, Kind=ConfigMap" {
        return Err(Status::bad_request(format!("invalid object type: {gvk}")));
    }
    let meta = cfg.get("metadata").filter(|m| !m.is_null());
    if meta
        .and_then(|m| m.get("managedFields"))
        .is_some_and(|v| !v.is_null())
    {
        return Err(Status::bad_request("metadata.managedFields must be nil"));
    }
    let mut undeclared = Vec::new();
    for (key, value) in cfg {
        match key.as_str() {
            "apiVersion" | "kind" | "data" | "binaryData" | "metadata" => {}
            "immutable" => return Err(Status::unmodelled("ConfigMap.immutable")),
            other => undeclared.push(format!(".{other}")),
        }
        if key == "metadata" && !value.is_null() && !value.is_object() {
            return Err(Status::unmodelled("metadata that is not a map"));
        }
    }
    for (key, value) in meta.and_then(Value::as_object).into_iter().flatten() {
        match key.as_str() {
            "name" | "namespace" | "resourceVersion" | "uid"
                if value.is_string() || value.is_null() => {}
            "labels" | "annotations" | "managedFields" => {}
            "creationTimestamp" if value.is_null() => {}
            "name"
            | "namespace"
            | "resourceVersion"
            | "uid"
            | "creationTimestamp"
            | "generateName"
            | "generation"
            | "selfLink"
            | "deletionTimestamp"
            | "deletionGracePeriodSeconds"
            | "ownerReferences"
            | "finalizers" => {
                return Err(Status::unmodelled(format!(
                    "metadata.{key} = {value} in an apply configuration"
                )));
            }
            other => undeclared.push(format!(".metadata.{other}")),
        }
    }
    if undeclared.is_empty() {
        return Ok(());
    }
    undeclared.sort();
    let text = |k: &str| {
        meta.and_then(|m| m.get(k))
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let errors: Vec<String> = undeclared
        .iter()
        .map(|path| format!("{path}: field not declared in schema"))
        .collect();
    let errors = match errors.as_slice() {
        [one] => one.clone(),
        many => format!("errors:\n  {}", many.join("\n  ")),
    };
    Err(Status::internal(format!(
        "failed to create typed patch object ({}/{}; {gvk}): {errors}",
        text("namespace"),
        text("name")
    )))
}

/// patch.go applyPatch, after the patch: the namespace and name of the object to store must be
/// the request's (an unset namespace is the request's).
fn check_name(obj: &Value, namespace: &str, name: &str) -> Result<(), Status> {
    let obj_namespace = str_at(obj, "/metadata/namespace");
    if !obj_namespace.is_empty() && obj_namespace != namespace {
        return Err(Status::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let obj_name = str_at(obj, "/metadata/name");
    if obj_name != name {
        return Err(Status::bad_request(format!(
            "the name of the object ({obj_name}) does not match the name on the URL ({name})"
        )));
    }
    Ok(())
}

/// The registry's optimistic lock on an update: a resourceVersion in the object written must be
/// the current one; none means an unconditional update, which ConfigMaps allow.
fn check_resource_version(written: &Value, live: &Value, name: &str) -> Result<(), Status> {
    let rv = str_at(written, "/metadata/resourceVersion");
    if rv.is_empty() {
        return Ok(());
    }
    let rv: u64 = rv.parse().map_err(|_| {
        Status::internal(format!("strconv.ParseUint: parsing {rv:?}: invalid syntax"))
    })?;
    if rv == object_rv(live) {
        Ok(())
    } else {
        Err(Status::conflict(Res::ConfigMaps, name, OPTIMISTIC_LOCK))
    }
}

fn check_valid(content: &Content, name: &str) -> Result<(), Status> {
    let errs = validate_configmap(content);
    if errs.is_empty() {
        Ok(())
    } else {
        Err(Status::invalid("", "ConfigMap", name, &errs))
    }
}

/// A server-side apply to ConfigMap `name` (patch.go's applyPatcher and applyPatch, then the
/// registry's Update, which creates a missing object for an apply): the object to store, or the
/// Status the real server answers, checked in its order.
fn apply_configmap(
    live: Option<&Value>,
    namespace: &str,
    name: &str,
    body: &[u8],
    applier: &str,
    force: bool,
    now: &str,
) -> Result<Value, Status> {
    let cfg = apply_configuration(body)?;
    check_apply_configuration(&cfg)?;
    let cfg = Value::Object(cfg);
    let applied = Content::typed(&cfg)?;
    let (live_content, managers) = match live {
        Some(l) => (Content::of(l), Manager::all_of(l)),
        None => Default::default(),
    };
    let written = apply_fields(&live_content, &managers, &applied, applier, force, now)
        .map_err(|conflicts| Status::apply_conflict(&conflicts))?;

    // What the merge leaves in metadata: the configuration's name, namespace, uid and
    // resourceVersion where it gives them, else the live object's.
    let mut merged = live.cloned().unwrap_or_else(|| json!({"metadata": {}}));
    for key in ["name", "namespace", "uid", "resourceVersion"] {
        if let Some(v) = cfg["metadata"].get(key).filter(|v| v.is_string()) {
            merged["metadata"][key] = v.clone();
        }
    }
    let uid = str_at(&merged, "/metadata/uid");
    match live {
        None if !uid.is_empty() => {
            let why = format!(
                "uid mismatch: the provided object specified uid {uid}, and no existing object was found"
            );
            return Err(Status::conflict(Res::ConfigMaps, name, &why));
        }
        Some(l) if uid != str_at(l, "/metadata/uid") => {
            return Err(Status::unmodelled("an apply that changes metadata.uid"));
        }
        _ => {}
    }
    check_name(&merged, namespace, name)?;
    if let Some(live) = live {
        check_resource_version(&merged, live, name)?;
    }
    check_valid(&written.content, name)?;
    Ok(configmap_object(namespace, name, &written, live))
}

/// Whether a strategic merge patch uses a directive ($patch, $retainKeys, ...).
fn has_directive(patch: &Value) -> bool {
    patch.as_object().is_some_and(|map| {
        map.iter()
            .any(|(k, v)| k.starts_with('$') || has_directive(v))
    })
}

/// jsonpatch.MergePatch (RFC 7386): objects merge, `null` removes, anything else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let target = target.as_object_mut().expect("made an object above");
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// A merge patch, or a strategic merge patch (the same thing for a ConfigMap's maps of
/// strings), to ConfigMap `name` (jsonPatcher or smpPatcher, then the registry's Update): an
/// Update by `updater`. Only the maps, and metadata this server can judge, may be patched.
fn merge_configmap(
    live: Option<&Value>,
    namespace: &str,
    name: &str,
    body: &[u8],
    patch_type: PatchType,
    updater: &str,
    now: &str,
) -> Result<Value, Status> {
    let Some(live) = live else {
        // Only an apply creates: the other patchers' createNewObject is NotFound.
        return Err(Status::not_found(Res::ConfigMaps, name));
    };
    let patch = match (serde_json::from_slice::<Value>(body), patch_type) {
        (Ok(Value::Object(patch)), _) => Value::Object(patch),
        (Ok(Value::Null) | Err(_), PatchType::Merge) => {
            return Err(Status::bad_request("Invalid JSON Patch"));
        }
        _ => return Err(Status::unmodelled("a patch that is not a JSON object")),
    };
    if patch_type == PatchType::Strategic && has_directive(&patch) {
        return Err(Status::unmodelled("strategic merge patch directives"));
    }
    for (key, value) in patch.as_object().into_iter().flatten() {
        match key.as_str() {
            "data" | "binaryData" => {}
            "apiVersion" if value == "v1" => {}
            "kind" if value == "ConfigMap" => {}
            "metadata" if value.is_object() => {
                let patchable = [
                    "name",
                    "namespace",
                    "resourceVersion",
                    "labels",
                    "annotations",
                ];
                if let Some(other) = value
                    .as_object()
                    .into_iter()
                    .flat_map(|m| m.keys())
                    .find(|k| !patchable.contains(&k.as_str()))
                {
                    return Err(Status::unmodelled(format!("a patch of metadata.{other}")));
                }
            }
            other => return Err(Status::unmodelled(format!("a patch of {other} = {value}"))),
        }
    }
    let mut merged = live.clone();
    merge_patch(&mut merged, &patch);
    check_name(&merged, namespace, name)?;
    check_resource_version(&merged, live, name)?;
    let content = Content::typed(&merged)?;
    check_valid(&content.clone().stored(), name)?;
    let managers = Manager::all_of(live);
    let written = update_fields(&Content::of(live), &managers, &content, updater, now);
    Ok(configmap_object(namespace, name, &written, Some(live)))
}

/// patch.go authorizes `create` on the object's name when an apply creates it
/// (withAuthorization), after the object is built and validated. RBAC gives no reason for a
/// denial, so the message ends in ": ".
fn create_denial(st: &Store, namespace: &str, name: &str) -> Option<Status> {
    let rules = st.rules.as_ref()?;
    let res = Res::ConfigMaps;
    if rules
        .iter()
        .any(|r| r.allows("create", res, Some(namespace), Some(name)))
    {
        return None;
    }
    Some(
        Status::new(
            403,
            "Forbidden",
            format!("{} {name:?} is forbidden: ", res.qualified()),
        )
        .details(resource_details(res, Some(name))),
    )
}

/// PATCH of a ConfigMap, served as kube-apiserver 1.33 serves it (endpoints/handlers/patch.go):
/// server-side apply (which creates a missing object: 201), merge and strategic merge patches.
/// The write is atomic under the store lock, as GuaranteedUpdate makes it; a write that changes
/// nothing (managedFields times aside) is not stored: no new resourceVersion, no event.
fn serve_patch(
    shared: &Shared,
    namespace: String,
    name: String,
    headers: &hyper::HeaderMap,
    q: &Query,
    body: &[u8],
) -> Result<Response<Body>, Status> {
    let header = |h: hyper::header::HeaderName| {
        headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    };
    let Some(patch_type) = PatchType::of(header(hyper::header::CONTENT_TYPE)) else {
        return Err(Status::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: {}",
                PatchType::ACCEPTED.join(", ")
            ),
        ));
    };
    if body.len() > MAX_REQUEST_BODY {
        return Err(Status::new(
            413,
            "RequestEntityTooLarge",
            format!("Request entity too large: limit is {MAX_REQUEST_BODY}"),
        ));
    }
    let force = q.bool("force")?;
    let dry_run: Vec<String> = q.all("dryRun").map(str::to_owned).collect();
    let field_manager = q.get("fieldManager").unwrap_or_default();
    validate_patch_options(patch_type, force.is_some(), field_manager, &dry_run)?;
    if patch_type == PatchType::Json {
        return Err(Status::unmodelled(
            "JSON patches (application/json-patch+json)",
        ));
    }
    let manager = match field_manager {
        "" => manager_from_user_agent(header(hyper::header::USER_AGENT)),
        m => m.to_owned(),
    };

    let now = now_rfc3339();
    let mut st = shared.store();
    let key = (Res::ConfigMaps, namespace.clone(), name.clone());
    let live = st.current.get(&key).cloned();
    let live = live.as_deref();
    let obj = match patch_type {
        PatchType::Apply => {
            let force = force.unwrap_or(false);
            apply_configmap(live, &namespace, &name, body, &manager, force, &now)?
        }
        _ => merge_configmap(live, &namespace, &name, body, patch_type, &manager, &now)?,
    };
    if live.is_none()
        && let Some(status) = create_denial(&st, &namespace, &name)
    {
        return Err(status);
    }
    let code = if live.is_some() { 200 } else { 201 };
    let stored = if !dry_run.is_empty() {
        let mut obj = obj;
        if live.is_none()
            && let Some(meta) = obj["metadata"].as_object_mut()
        {
            meta.remove("resourceVersion");
        }
        obj
    } else if live == Some(&obj) {
        obj
    } else {
        st.commit(key.clone(), Some(obj));
        (*st.current[&key]).clone()
    };
    drop(st);
    Ok(json_reply(shared, code, stored.to_string()))
}

// ---------------------------------------------------------------------------------------------
// Selectors
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
struct FieldReq {
    field: String,
    equal: bool,
    value: String,
}

#[derive(Clone)]
enum LabelReq {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// What one list or watch selects: a resource, maybe one namespace, field and label selectors.
#[derive(Clone)]
struct Filter {
    res: Res,
    namespace: Option<String>,
    fields: Vec<FieldReq>,
    labels: Vec<LabelReq>,
}

impl Filter {
    fn parse(res: Res, namespace: Option<String>, q: &Query) -> Result<Filter, Status> {
        Ok(Filter {
            res,
            namespace,
            fields: parse_field_selector(res, q.get("fieldSelector").unwrap_or(""))?,
            labels: parse_label_selector(q.get("labelSelector").unwrap_or(""))?,
        })
    }

    fn selects_everything(&self) -> bool {
        self.fields.is_empty() && self.labels.is_empty()
    }

    fn matches(&self, key: &Key, obj: &Value) -> bool {
        if key.0 != self.res || self.namespace.as_ref().is_some_and(|ns| *ns != key.1) {
            return false;
        }
        let fields_ok = self.fields.iter().all(|f| {
            let actual = match f.field.as_str() {
                "metadata.name" => &key.2,
                _ => &key.1,
            };
            (*actual == f.value) == f.equal
        });
        let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|r| match r {
            LabelReq::In(k, vs) => label(k).is_some_and(|v| vs.iter().any(|x| x == v)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|v| !vs.iter().any(|x| x == v)),
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
        });
        fields_ok && labels_ok
    }

    /// The event this watch sees for a change, as the watch cache decides it
    /// (cacheWatcher.convertToWatchEvent): an object that starts matching is ADDED, one that
    /// stops matching is DELETED with its previous state stamped with the change's
    /// resourceVersion.
    fn event(&self, c: &Change) -> Option<Line> {
        let now = c.obj.as_ref().filter(|o| self.matches(&c.key, o));
        let before = c.prev.as_ref().filter(|o| self.matches(&c.key, o));
        match (now, before) {
            (Some(o), None) => Some(Line::event("ADDED", o, c.rv)),
            (Some(o), Some(_)) => Some(Line::event("MODIFIED", o, c.rv)),
            (None, Some(p)) => {
                let mut p = (**p).clone();
                p["metadata"]["resourceVersion"] = json!(c.rv.to_string());
                Some(Line::event("DELETED", &p, c.rv))
            }
            (None, None) => None,
        }
    }
}

/// fields.ParseSelector, then the resource's field label conversion.
fn parse_field_selector(res: Res, selector: &str) -> Result<Vec<FieldReq>, Status> {
    let mut reqs = Vec::new();
    for term in split_unescaped(selector, ',') {
        if term.is_empty() {
            continue;
        }
        let Some((field, op, value)) = split_field_term(&term) else {
            return Err(Status::bad_request(format!(
                "invalid selector: '{selector}'; can't understand '{term}'"
            )));
        };
        let supported = match res {
            Res::ConfigMaps => field == "metadata.name" || field == "metadata.namespace",
            // A cluster-scoped custom resource knows only metadata.name (crConverter).
            Res::ControllerConfigs => field == "metadata.name",
        };
        if !supported {
            // The two messages differ upstream: runtime.DefaultMetaV1FieldSelectorConversion for
            // built-in types, the CRD handler's crConverter for custom resources.
            return Err(Status::bad_request(if res.builtin() {
                format!(
                    "{field:?} is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
                )
            } else {
                format!("field label not supported: {field}")
            }));
        }
        reqs.push(FieldReq {
            field: field.to_owned(),
            equal: op != "!=",
            value: unescape_field_value(value).map_err(Status::bad_request)?,
        });
    }
    Ok(reqs)
}

/// Splits on `sep` not preceded by a backslash (fields.splitTerms).
fn split_unescaped(s: &str, sep: char) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == sep {
            out.push(String::new());
            continue;
        }
        out.last_mut().unwrap().push(c);
    }
    out
}

/// The first of "!=", "==", "=" found scanning left to right (fields.splitTerm).
fn split_field_term(term: &str) -> Option<(&str, &str, &str)> {
    for i in 0..term.len() {
        let rest = &term[i..];
        for op in ["!=", "==", "="] {
            if rest.starts_with(op) {
                return Some((&term[..i], op, &term[i + op.len()..]));
            }
        }
    }
    None
}

fn unescape_field_value(v: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut chars = v.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some(e @ ('\\' | ',' | '=')) => out.push(e),
                _ => {
                    return Err(format!(
                        "invalid field selector: invalid escape sequence in {v:?}"
                    ));
                }
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// labels.Parse for the common forms: k=v, k==v, k!=v, k in (..), k notin (..), k, !k.
fn parse_label_selector(selector: &str) -> Result<Vec<LabelReq>, Status> {
    let mut terms = vec![String::new()];
    let mut depth = 0;
    for c in selector.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(String::new());
                continue;
            }
            _ => {}
        }
        terms.last_mut().unwrap().push(c);
    }
    let bad = |t: &str| {
        Status::bad_request(format!(
            "unable to parse requirement: found '{t}', expected a valid label requirement"
        ))
    };
    let key = |k: &str| {
        let k = k.trim();
        (!k.is_empty() && !k.contains(char::is_whitespace) && !k.contains(['=', '!', '(', ')']))
            .then(|| k.to_owned())
    };
    let set = |s: &str| {
        let s = s.trim();
        s.strip_prefix('(')
            .and_then(|s| s.strip_suffix(')'))
            .map(|inner| inner.split(',').map(|v| v.trim().to_owned()).collect())
    };
    let mut reqs = Vec::new();
    for term in terms.iter().map(|t| t.trim()).filter(|t| !t.is_empty()) {
        let req = if let Some(k) = term.strip_prefix('!') {
            key(k).map(LabelReq::NotExists)
        } else if let Some((k, vs)) = term.split_once(" notin ") {
            key(k).zip(set(vs)).map(|(k, vs)| LabelReq::NotIn(k, vs))
        } else if let Some((k, vs)) = term.split_once(" in ") {
            key(k).zip(set(vs)).map(|(k, vs)| LabelReq::In(k, vs))
        } else if let Some((k, v)) = term.split_once("!=") {
            key(k).map(|k| LabelReq::NotIn(k, vec![v.trim().to_owned()]))
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            key(k).map(|k| LabelReq::In(k, vec![v.trim().to_owned()]))
        } else {
            key(term).map(LabelReq::Exists)
        };
        reqs.push(req.ok_or_else(|| bad(term))?);
    }
    Ok(reqs)
}

// ---------------------------------------------------------------------------------------------
// Status errors
// ---------------------------------------------------------------------------------------------

/// A metav1 Status with HTTP code.
struct Status {
    code: u16,
    reason: &'static str,
    message: String,
    details: Option<Value>,
    /// Becomes the Retry-After header too (as responsewriters do for details.retryAfterSeconds).
    retry_after: Option<u64>,
    /// metadata.continue (only for an expired continue token).
    continue_token: Option<String>,
}

/// registry.OptimisticLockErrorMsg: a write whose resourceVersion is not the current one.
const OPTIMISTIC_LOCK: &str =
    "the object has been modified; please apply your changes to the latest version and try again";

/// What kube-apiserver says when it sheds load (the max-in-flight and APF filters).
const TOO_MANY_REQUESTS: &str = "Too many requests, please try again later.";

const CONTINUE_EXPIRED: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.";

impl Status {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Status {
        Status {
            code,
            reason,
            message: message.into(),
            details: None,
            retry_after: None,
            continue_token: None,
        }
    }

    fn details(mut self, details: Value) -> Status {
        if let Some(secs) = details.get("retryAfterSeconds").and_then(Value::as_u64) {
            self.retry_after = Some(secs);
        }
        self.details = Some(details);
        self
    }

    fn bad_request(message: impl Into<String>) -> Status {
        Status::new(400, "BadRequest", message)
    }

    fn unauthorized() -> Status {
        Status::new(401, "Unauthorized", "Unauthorized")
    }

    /// The RBAC denial message (authorization.ForbiddenStatus).
    fn forbidden(user: &str, verb: &str, route: &Route, path: &str) -> Status {
        let Some((res, ns, name)) = route.resource() else {
            return Status::new(
                403,
                "Forbidden",
                format!("forbidden: User {user:?} cannot {verb} path {path:?}"),
            )
            .details(json!({}));
        };
        Status::forbidden_resource(user, verb, res, ns, name)
    }

    /// The RBAC denial of a resource request; `name` from the path or a metadata.name selector.
    fn forbidden_resource(
        user: &str,
        verb: &str,
        res: Res,
        ns: Option<&str>,
        name: Option<&str>,
    ) -> Status {
        let subject = match name {
            Some(n) => format!("{} {n:?}", res.qualified()),
            None => res.qualified(),
        };
        let scope = match ns {
            Some(ns) => format!("in the namespace {ns:?}"),
            None => "at the cluster scope".to_owned(),
        };
        let message = format!(
            "{subject} is forbidden: User {user:?} cannot {verb} resource {:?} in API group {:?} {scope}",
            res.plural(),
            res.group()
        );
        Status::new(403, "Forbidden", message).details(resource_details(res, name))
    }

    /// An unknown path (the apiserver's NotFound handler).
    fn path_not_found() -> Status {
        Status::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
        .details(json!({}))
    }

    fn not_found(res: Res, name: &str) -> Status {
        Status::new(
            404,
            "NotFound",
            format!("{} {name:?} not found", res.qualified()),
        )
        .details(resource_details(res, Some(name)))
    }

    fn method_not_allowed() -> Status {
        Status::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
        .details(json!({}))
    }

    fn expired(message: impl Into<String>) -> Status {
        Status::new(410, "Expired", message)
    }

    /// What the watch cache says for a watch from before its window.
    fn too_old_watch(requested: u64, floor: u64) -> Status {
        Status::expired(format!("too old resource version: {requested} ({floor})"))
    }

    /// storage.NewTooLargeResourceVersionError: a read at a resourceVersion the server has not
    /// reached, after waiting 3 s for it.
    fn too_large(requested: u64, current: u64) -> Status {
        Status::new(
            504,
            "Timeout",
            format!("Timeout: Too large resource version: {requested}, current: {current}"),
        )
        .details(json!({
            "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
            "retryAfterSeconds": 1
        }))
    }

    /// 422 for bad ListOptions (apimachinery's ValidateListOptions).
    fn invalid_list_options(errs: Vec<FieldError>) -> Status {
        Status::invalid("meta.k8s.io", "ListOptions", "", &errs)
    }

    /// errors.NewInvalid: 422 with every field error as a cause. The message joins them as an
    /// aggregate does: one alone, several in brackets.
    fn invalid(group: &str, kind: &str, name: &str, errs: &[FieldError]) -> Status {
        let texts: Vec<String> = errs
            .iter()
            .map(|e| format!("{}: {}", e.field, e.body))
            .collect();
        let joined = match texts.as_slice() {
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        let causes: Vec<Value> = errs
            .iter()
            .map(|e| json!({"reason": e.reason, "message": e.body, "field": e.field}))
            .collect();
        let qualified = match group {
            "" => kind.to_owned(),
            group => format!("{kind}.{group}"),
        };
        let mut details = json!({"kind": kind, "causes": causes});
        if !group.is_empty() {
            details["group"] = json!(group);
        }
        if !name.is_empty() {
            details["name"] = json!(name);
        }
        Status::new(
            422,
            "Invalid",
            format!("{qualified} {name:?} is invalid: {joined}"),
        )
        .details(details)
    }

    /// errors.NewConflict: the write lost a race or failed a precondition.
    fn conflict(res: Res, name: &str, why: &str) -> Status {
        Status::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {name:?}: {why}",
                res.qualified()
            ),
        )
        .details(resource_details(res, Some(name)))
    }

    /// An error that is not a metav1 Status inside the apiserver: ErrorToAPIStatus makes it a
    /// 500 with no reason.
    fn internal(message: impl Into<String>) -> Status {
        Status::new(500, "", message)
    }

    /// NewConflictError (managedfields): an apply that would change fields other managers own.
    /// The message groups the fields by manager, in the managers' order; the causes list each.
    fn apply_conflict(conflicts: &[Conflict]) -> Status {
        let message = match conflicts {
            [one] => format!(
                "Apply failed with 1 conflict: conflict with {}: {}",
                one.manager, one.field
            ),
            many => {
                let mut lines = Vec::new();
                for (i, c) in many.iter().enumerate() {
                    if i == 0 || many[i - 1].identifier != c.identifier {
                        lines.push(format!("conflicts with {}:", c.manager));
                    }
                    lines.push(format!("- {}", c.field));
                }
                format!(
                    "Apply failed with {} conflicts: {}",
                    many.len(),
                    lines.join("\n")
                )
            }
        };
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|c| {
                json!({
                    "reason": "FieldManagerConflict",
                    "message": format!("conflict with {}", c.manager),
                    "field": c.field.to_string(),
                })
            })
            .collect();
        Status::new(409, "Conflict", message).details(json!({"causes": causes}))
    }

    /// A request this server does not model. No real server answers 501 here: a test that gets
    /// it is relying on behaviour this fake cannot vouch for.
    fn unmodelled(what: impl std::fmt::Display) -> Status {
        Status::new(
            501,
            "",
            format!("the test API server does not model this: {what}"),
        )
    }

    /// errors.NewTooManyRequests, with `details.retryAfterSeconds` (and so `Retry-After`).
    fn too_many_requests(retry_after: u32) -> Status {
        Status::new(429, "TooManyRequests", TOO_MANY_REQUESTS)
            .details(json!({"retryAfterSeconds": retry_after}))
    }

    /// What `fail_next` injects, worded as the real server words that error (a 403 names
    /// `user`).
    fn injected(code: u16, route: &Route, user: &str, verb: &str, path: &str) -> Status {
        let (res_name, res) = match route.resource() {
            Some((res, _, name)) => (name.unwrap_or(""), Some(res)),
            None => ("", None),
        };
        match code {
            400 => Status::bad_request("the server rejected our request for an unknown reason"),
            401 => Status::unauthorized(),
            403 => Status::forbidden(user, verb, route, path),
            404 => match res {
                Some(res) if !res_name.is_empty() => Status::not_found(res, res_name),
                _ => Status::path_not_found(),
            },
            405 => Status::method_not_allowed(),
            409 => match res {
                Some(res) => Status::conflict(res, res_name, OPTIMISTIC_LOCK),
                None => Status::new(
                    409,
                    "Conflict",
                    format!("Operation cannot be fulfilled on resource {res_name:?}: {OPTIMISTIC_LOCK}"),
                ),
            },
            410 => Status::expired("The resourceVersion for the provided list is too old."),
            429 => Status::too_many_requests(1),
            500 => Status::new(
                500,
                "InternalError",
                "Internal error occurred: etcdserver: request timed out",
            )
            .details(json!({"causes": [{"message": "etcdserver: request timed out"}]})),
            503 => Status::new(
                503,
                "ServiceUnavailable",
                "the server is currently unable to handle the request",
            ),
            504 => Status::new(
                504,
                "Timeout",
                "Timeout: request did not complete within requested timeout - context deadline exceeded",
            )
            .details(json!({})),
            _ => Status::new(code, "", format!("the server responded with HTTP {code}")),
        }
    }

    /// The JSON, in Go's field order.
    fn json(&self) -> String {
        let mut s = String::from("{\"kind\":\"Status\",\"apiVersion\":\"v1\",\"metadata\":");
        match &self.continue_token {
            Some(c) => s.push_str(&json!({"continue": c}).to_string()),
            None => s.push_str("{}"),
        }
        s.push_str(",\"status\":\"Failure\",\"message\":");
        s.push_str(&json!(self.message).to_string());
        if !self.reason.is_empty() {
            s.push_str(&format!(",\"reason\":\"{}\"", self.reason));
        }
        if let Some(d) = &self.details {
            s.push_str(&format!(",\"details\":{d}"));
        }
        s.push_str(&format!(",\"code\":{}}}", self.code));
        s
    }
}

fn resource_details(res: Res, name: Option<&str>) -> Value {
    let mut d = serde_json::Map::new();
    if let Some(n) = name {
        d.insert("name".into(), json!(n));
    }
    if !res.group().is_empty() {
        d.insert("group".into(), json!(res.group()));
    }
    d.insert("kind".into(), json!(res.plural()));
    Value::Object(d)
}

struct FieldError {
    field: String,
    reason: &'static str,
    body: String,
}

fn forbidden_field(field: &str, detail: &str) -> FieldError {
    FieldError {
        field: field.to_owned(),
        reason: "FieldValueForbidden",
        body: format!("Forbidden: {detail}"),
    }
}

fn unsupported_field(field: &str, value: &str, supported: &[&str]) -> FieldError {
    let supported: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
    FieldError {
        field: field.to_owned(),
        reason: "FieldValueNotSupported",
        body: format!(
            "Unsupported value: {value:?}: supported values: {}",
            supported.join(", ")
        ),
    }
}

/// ValidateListOptions for a list.
fn validate_list(
    rv: &str,
    rv_match: &str,
    cont: &str,
    send_initial: Option<bool>,
) -> Result<(), Status> {
    let mut errs = Vec::new();
    if !rv_match.is_empty() {
        if rv.is_empty() {
            errs.push(forbidden_field(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            ));
        }
        if !cont.is_empty() {
            errs.push(forbidden_field(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden when continue is provided",
            ));
        }
        if rv_match != "Exact" && rv_match != "NotOlderThan" {
            errs.push(unsupported_field(
                "resourceVersionMatch",
                rv_match,
                &["Exact", "NotOlderThan", ""],
            ));
        }
        if rv_match == "Exact" && rv == "0" {
            errs.push(forbidden_field(
                "resourceVersionMatch",
                "resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
            ));
        }
    }
    if send_initial.is_some() {
        errs.push(forbidden_field(
            "sendInitialEvents",
            "sendInitialEvents is forbidden for list",
        ));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(Status::invalid_list_options(errs))
    }
}

/// ValidateListOptions for a watch.
fn validate_watch(
    rv_match: &str,
    cont: &str,
    send_initial: Option<bool>,
    watch_list_gate: bool,
) -> Result<(), Status> {
    let mut errs = Vec::new();
    if send_initial.is_some() {
        if rv_match != "NotOlderThan" {
            errs.push(forbidden_field(
                "resourceVersionMatch",
                "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            ));
        }
        if !watch_list_gate {
            errs.push(forbidden_field(
                "sendInitialEvents",
                "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
            ));
        }
    }
    if !rv_match.is_empty() {
        if send_initial.is_none() {
            errs.push(forbidden_field(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
            ));
        }
        if rv_match != "NotOlderThan" {
            errs.push(unsupported_field(
                "resourceVersionMatch",
                rv_match,
                &["NotOlderThan"],
            ));
        }
        if !cont.is_empty() {
            errs.push(forbidden_field(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden when continue is provided",
            ));
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(Status::invalid_list_options(errs))
    }
}

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

enum Route {
    Version,
    Health,
    Api,
    ApiV1,
    Apis,
    McoGroup,
    McoV1,
    Collection {
        res: Res,
        ns: Option<String>,
    },
    Object {
        res: Res,
        ns: Option<String>,
        name: String,
    },
    /// POST-only review endpoints (authentication.k8s.io / authorization.k8s.io).
    Review(Review),
    Unknown,
}

impl Route {
    fn parse(path: &str) -> Route {
        let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let ns = |s: &str| Some(s.to_owned());
        match segs.as_slice() {
            ["version"] => Route::Version,
            ["healthz" | "livez" | "readyz"] => Route::Health,
            ["api"] => Route::Api,
            ["api", "v1"] => Route::ApiV1,
            ["api", "v1", "configmaps"] => Route::Collection {
                res: Res::ConfigMaps,
                ns: None,
            },
            ["api", "v1", "namespaces", n, "configmaps"] => Route::Collection {
                res: Res::ConfigMaps,
                ns: ns(n),
            },
            ["api", "v1", "namespaces", n, "configmaps", name] => Route::Object {
                res: Res::ConfigMaps,
                ns: ns(n),
                name: (*name).to_owned(),
            },
            ["apis"] => Route::Apis,
            ["apis", MCO_GROUP] => Route::McoGroup,
            ["apis", MCO_GROUP, "v1"] => Route::McoV1,
            ["apis", MCO_GROUP, "v1", "controllerconfigs"] => Route::Collection {
                res: Res::ControllerConfigs,
                ns: None,
            },
            ["apis", MCO_GROUP, "v1", "controllerconfigs", name] => Route::Object {
                res: Res::ControllerConfigs,
                ns: None,
                name: (*name).to_owned(),
            },
            ["apis", "authentication.k8s.io", "v1", "tokenreviews"] => Route::Review(Review::Token),
            ["apis", "authorization.k8s.io", "v1", "subjectaccessreviews"] => {
                Route::Review(Review::Access)
            }
            _ => Route::Unknown,
        }
    }

    fn resource(&self) -> Option<(Res, Option<&str>, Option<&str>)> {
        match self {
            Route::Collection { res, ns } => Some((*res, ns.as_deref(), None)),
            Route::Object { res, ns, name } => Some((*res, ns.as_deref(), Some(name))),
            _ => None,
        }
    }

    /// What system:public-info-viewer lets anonymous users read.
    fn public(&self) -> bool {
        matches!(self, Route::Version | Route::Health)
    }
}

fn verb(method: &str, route: &Route, watch: bool) -> &'static str {
    let collection = matches!(route, Route::Collection { .. });
    match method {
        "POST" => "create",
        "PUT" => "update",
        "PATCH" => "patch",
        "DELETE" if collection => "deletecollection",
        "DELETE" => "delete",
        _ if collection && watch => "watch",
        _ if collection => "list",
        _ => "get",
    }
}

/// Decoded query parameters (url.ParseQuery).
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(raw: &str) -> Query {
        Query(
            raw.split('&')
                .filter(|kv| !kv.is_empty())
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect(),
        )
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of a repeated parameter, in order.
    fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// strconv.ParseBool, as the query parameter codec uses it.
    fn bool(&self, name: &str) -> Result<Option<bool>, Status> {
        match self.get(name) {
            None => Ok(None),
            Some("1" | "t" | "T" | "TRUE" | "true" | "True") => Ok(Some(true)),
            Some("0" | "f" | "F" | "FALSE" | "false" | "False") => Ok(Some(false)),
            Some(v) => Err(Status::bad_request(format!(
                "strconv.ParseBool: parsing {v:?}: invalid syntax"
            ))),
        }
    }

    fn int(&self, name: &str) -> Result<Option<i64>, Status> {
        match self.get(name) {
            None | Some("") => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| {
                Status::bad_request(format!("strconv.ParseInt: parsing {v:?}: invalid syntax"))
            }),
        }
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex_digit = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%' && i + 2 < bytes.len())
            .then(|| Some(hex_digit(bytes[i + 1])? << 4 | hex_digit(bytes[i + 2])?))
            .flatten();
        match (bytes[i], escaped) {
            (_, Some(b)) => {
                out.push(b);
                i += 2;
            }
            (b'+', None) => out.push(b' '),
            (b, None) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A resourceVersion parameter: None when empty.
fn parse_rv(rv: &str) -> Result<Option<u64>, Status> {
    if rv.is_empty() {
        return Ok(None);
    }
    rv.parse().map(Some).map_err(|_| {
        Status::bad_request(format!(
            "resourceVersion: Invalid value: {rv:?}: strconv.ParseUint: parsing {rv:?}: invalid syntax"
        ))
    })
}

async fn handle(
    shared: Arc<Shared>,
    peer: Arc<Peer>,
    flushed: Arc<AtomicBool>,
    req: hyper::Request<Incoming>,
) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let method = parts.method.as_str().to_owned();
    let path = parts.uri.path().to_owned();
    let raw_query = parts.uri.query().unwrap_or("").to_owned();
    let q = Query::parse(&raw_query);
    let watch = matches!(q.bool("watch"), Ok(Some(true)));
    let route = Route::parse(&path);
    let verb = verb(&method, &route, watch);
    let kind = match (&route, method.as_str()) {
        (Route::Collection { .. }, "GET") if watch => Kind::Watch,
        (Route::Collection { .. }, "GET") => Kind::List,
        (Route::Object { .. }, "GET") => Kind::Other,
        (Route::Collection { .. } | Route::Object { .. }, _) => Kind::Write,
        _ => Kind::Other,
    };
    let body = body.collect().await.map(|b| b.to_bytes());
    // Authentication runs first, on every request, at the time the request arrives.
    let authn = authenticate(
        &shared,
        &peer.chain,
        bearer_token(&parts.headers),
        SystemTime::now(),
    );
    shared.store().requests.push(Request {
        method: method.clone(),
        path: path.clone(),
        query: raw_query,
        watch,
        body: body.as_ref().map(|b| b.to_vec()).unwrap_or_default(),
        at: Instant::now(),
        user: authn.user().to_owned(),
        groups: authn.groups(),
        client_certificate_sha256: peer.leaf_sha256.clone(),
        auth_error: match &authn {
            Authn::Refused(why) => Some(why.clone()),
            Authn::User { .. } | Authn::Anonymous => None,
        },
        connection: peer.number,
    });
    // A hung server has read the request and sends nothing until it is released.
    let _ = shared
        .hang
        .subscribe()
        .wait_for(|hang| !hang.is_some_and(|h| h.covers(kind)))
        .await;
    // A refused request has no user; an injected 403 still needs one to name.
    let user = match &authn {
        Authn::User { name, .. } => name.clone(),
        Authn::Anonymous | Authn::Refused(_) => ANONYMOUS.to_owned(),
    };
    let injected = shared.store().take_failure(kind);
    if let Some(fault) = injected {
        return injected_reply(&shared, fault, kind, &route, &user, verb, &path);
    }

    // The verdict of authentication, then authorization: a failed credential is 401; none makes
    // the request anonymous, and system:anonymous may only read /version and the health checks.
    match authn {
        Authn::Refused(_) => return status_reply(&shared, &Status::unauthorized()),
        Authn::Anonymous if !route.public() => {
            let status = Status::forbidden(ANONYMOUS, verb, &route, &path);
            return status_reply(&shared, &status);
        }
        Authn::Anonymous | Authn::User { .. } => {}
    }
    if let Some(status) = rbac_denial(&shared, &user, verb, &route, &q) {
        return status_reply(&shared, &status);
    }

    let Ok(body) = body else {
        return status_reply(&shared, &Status::bad_request("cannot read the body"));
    };
    if let Route::Review(review) = route {
        if method != "POST" {
            return status_reply(&shared, &Status::method_not_allowed());
        }
        return serve_review(&shared, review, &body)
            .await
            .unwrap_or_else(|status| status_reply(&shared, &status));
    }
    if let Err(status) = q.bool("watch") {
        return status_reply(&shared, &status);
    }
    if let (
        "PATCH",
        Route::Object {
            res: Res::ConfigMaps,
            ns,
            name,
        },
    ) = (method.as_str(), &route)
    {
        let namespace = ns.clone().unwrap_or_default();
        let answer = serve_patch(&shared, namespace, name.clone(), &parts.headers, &q, &body)
            .unwrap_or_else(|status| status_reply(&shared, &status));
        let delay = shared.store().patch_answer_delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        return answer;
    }
    if method != "GET" {
        let status = match route {
            Route::Unknown => Status::path_not_found(),
            _ => Status::method_not_allowed(),
        };
        return status_reply(&shared, &status);
    }
    let result = match route {
        Route::Collection { res, ns } if watch => {
            serve_watch(&shared, flushed, &user, res, ns, &q).await
        }
        Route::Collection { res, ns } => serve_list(&shared, res, ns, &q).await,
        Route::Object { res, ns, name } => serve_get(&shared, res, ns, &name),
        Route::Health => Ok(reply(&shared, 200, "text/plain; charset=utf-8", full("ok"))),
        Route::Unknown => Err(Status::path_not_found()),
        discovery => Ok(json_reply(
            &shared,
            200,
            discovery_json(&discovery, shared.port),
        )),
    };
    result.unwrap_or_else(|status| status_reply(&shared, &status))
}

/// Whether a request is a list, a watch, a write, or anything else (for hangs and injected
/// faults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    List,
    Watch,
    /// Any other method than GET on a resource (PATCH, PUT, POST, DELETE).
    Write,
    Other,
}

/// What an armed fault answers to a request of this kind.
fn injected_reply(
    shared: &Shared,
    fault: Fault,
    kind: Kind,
    route: &Route,
    user: &str,
    verb: &str,
    path: &str,
) -> Response<Body> {
    match fault {
        // A watch learns of an expired resourceVersion from an ERROR event, not an HTTP 410.
        Fault::Status(410) | Fault::ErrorEvent(_) if kind == Kind::Watch => {
            let code = match fault {
                Fault::ErrorEvent(code) | Fault::Status(code) => code,
                _ => unreachable!(),
            };
            watch_error(shared, &Status::injected(code, route, user, verb, path))
        }
        Fault::Status(code) | Fault::ErrorEvent(code) => {
            status_reply(shared, &Status::injected(code, route, user, verb, path))
        }
        // tooManyRequests in the max-in-flight and APF filters: Retry-After, then http.Error.
        Fault::TooManyRequests { retry_after } => {
            let mut resp = reply(
                shared,
                429,
                "text/plain; charset=utf-8",
                full(format!("{TOO_MANY_REQUESTS}\n")),
            );
            let headers = resp.headers_mut();
            headers.insert(hyper::header::RETRY_AFTER, retry_after.into());
            headers.insert(
                hyper::header::X_CONTENT_TYPE_OPTIONS,
                hyper::header::HeaderValue::from_static("nosniff"),
            );
            resp
        }
        // What an nginx-style load balancer sends when no apiserver behind it answers.
        Fault::BadGatewayHtml => {
            let page = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
            Response::builder()
                .status(StatusCode::BAD_GATEWAY)
                .header(hyper::header::CONTENT_TYPE, "text/html")
                .body(full(page))
                .expect("valid response")
        }
        Fault::EmptyUnavailable => Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .header(hyper::header::CONTENT_LENGTH, "0")
            .body(full(""))
            .expect("valid response"),
        Fault::CutMidJson => {
            let half: &'static [u8] = match kind {
                Kind::Watch => b"{\"type\":\"MODIFIED\",\"object\":{\"kind\":\"ConfigMap\",\"apiVersion\":\"v1\",\"metadata\":{\"name\":\"x\",\"resou",
                Kind::List => b"{\"kind\":\"ConfigMapList\",\"apiVersion\":\"v1\",\"metadata\":{\"resourceVersion\":\"1",
                Kind::Write | Kind::Other => b"{\"kind\":\"ConfigMap\",\"apiVersion\":\"v1\",\"metadata\":{\"name\":\"x\",\"resou",
            };
            reply(
                shared,
                200,
                "application/json",
                cut_after(Bytes::from_static(half)),
            )
        }
    }
}

/// A body that sends `bytes`, waits for them to be flushed, then fails, which makes hyper abort
/// the connection mid-response.
fn cut_after(bytes: Bytes) -> Body {
    let steps = futures::stream::unfold(0, move |step| {
        let bytes = bytes.clone();
        async move {
            match step {
                0 => Some((Ok(Frame::data(bytes)), 1)),
                1 => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Some((Err(std::io::Error::other("connection cut")), 2))
                }
                _ => None,
            }
        }
    });
    StreamBody::new(steps).boxed_unsync()
}

/// The RBAC authorizer's answer for `user` when rules are enforced: None if allowed, else the
/// 403.
fn rbac_denial(
    shared: &Shared,
    user: &str,
    verb: &str,
    route: &Route,
    q: &Query,
) -> Option<Status> {
    if let Route::Review(review) = route {
        let st = shared.store();
        let rules = st.rules.as_ref()?;
        let (group, resource) = (review.group(), review.plural());
        if rules
            .iter()
            .any(|r| r.allows_cluster(verb, group, resource))
        {
            return None;
        }
        return Some(
            Status::new(
                403,
                "Forbidden",
                format!("{resource}.{group} is forbidden: User {user:?} cannot {verb} resource {resource:?} in API group {group:?} at the cluster scope"),
            )
            .details(json!({"group": group, "kind": resource})),
        );
    }
    let (res, ns, path_name) = route.resource()?;
    let st = shared.store();
    let rules = st.rules.as_ref()?;
    // requestinfo.go: a list or watch whose field selector requires metadata.name=X (a valid
    // path segment) is authorized with name X.
    let selected = match route {
        Route::Collection { .. } => parse_field_selector(res, q.get("fieldSelector").unwrap_or(""))
            .ok()
            .and_then(|reqs| {
                reqs.into_iter()
                    .find(|r| r.field == "metadata.name" && r.equal)
                    .map(|r| r.value)
            })
            .filter(|n| !n.is_empty() && n != "." && n != ".." && !n.contains(['/', '%'])),
        _ => None,
    };
    let name = path_name.or(selected.as_deref());
    if rules.iter().any(|r| r.allows(verb, res, ns, name)) {
        return None;
    }
    Some(Status::forbidden_resource(user, verb, res, ns, name))
}

fn serve_get(
    shared: &Shared,
    res: Res,
    ns: Option<String>,
    name: &str,
) -> Result<Response<Body>, Status> {
    let key = (res, ns.unwrap_or_default(), name.to_owned());
    let obj = shared.store().current.get(&key).cloned();
    match obj {
        Some(obj) => Ok(json_reply(shared, 200, obj.to_string())),
        None => Err(Status::not_found(res, name)),
    }
}

/// How a list is read, by the rules of kube-apiserver 1.33 (cacher.shouldDelegateList and the
/// etcd3 store's GetList).
enum ListRead {
    /// resourceVersion unset: a consistent read of the latest state, paginated.
    Latest,
    /// resourceVersion=0: from the watch cache, which ignores limit.
    Cache,
    /// resourceVersionMatch=Exact, or a non-zero resourceVersion with a limit and no match
    /// (the "legacy exact" case): the state at that revision, paginated.
    Exact(u64),
    /// A continue token: the token's revision (-1 means latest), from its start key.
    Continue(i64, String),
}

async fn serve_list(
    shared: &Shared,
    res: Res,
    ns: Option<String>,
    q: &Query,
) -> Result<Response<Body>, Status> {
    let filter = Filter::parse(res, ns, q)?;
    let rv_param = q.get("resourceVersion").unwrap_or("");
    let rv_match = q.get("resourceVersionMatch").unwrap_or("");
    let cont = q.get("continue").unwrap_or("");
    let limit = q.int("limit")?.filter(|n| *n > 0).unwrap_or(0) as usize;
    validate_list(rv_param, rv_match, cont, q.bool("sendInitialEvents")?)?;
    let wanted = parse_rv(rv_param)?;
    let all_namespaces = filter.namespace.is_none();

    let read = if !cont.is_empty() {
        if wanted.is_some_and(|rv| rv != 0) {
            return Err(Status::bad_request(
                "specifying resource version is not allowed when using continue",
            ));
        }
        let (rv, start) = decode_continue(cont)?;
        ListRead::Continue(rv, start)
    } else {
        match wanted {
            None => ListRead::Latest,
            Some(0) => ListRead::Cache,
            Some(n) => {
                wait_for_rv(shared, n).await?;
                if rv_match == "Exact" || (rv_match.is_empty() && limit > 0) {
                    ListRead::Exact(n)
                } else {
                    // NotOlderThan: anything at least as new will do, so the latest.
                    ListRead::Latest
                }
            }
        }
    };

    let paginate = !matches!(read, ListRead::Cache);
    let (rv, start, snapshot) = {
        let st = shared.store();
        let (rv, start) = match read {
            ListRead::Latest | ListRead::Cache => (st.rv, String::new()),
            ListRead::Exact(n) if n < st.compacted => {
                // etcd3 interpretListError: a paginated read gets the continue flavour of 410.
                return Err(if limit > 0 {
                    let mut s = Status::expired(CONTINUE_EXPIRED);
                    s.continue_token = Some(encode_continue(-1, "\u{0}"));
                    s
                } else {
                    Status::expired("The resourceVersion for the provided list is too old.")
                });
            }
            ListRead::Exact(n) => (n, String::new()),
            ListRead::Continue(-1, start) => (st.rv, start),
            ListRead::Continue(n, start) if (n as u64) < st.compacted => {
                let mut s = Status::expired(CONTINUE_EXPIRED);
                s.continue_token = Some(encode_continue(-1, &start));
                return Err(s);
            }
            ListRead::Continue(n, start) => (n as u64, start),
        };
        (rv, start, st.snapshot(rv))
    };

    // etcd returns keys in order; a continue token holds the key after the last one returned,
    // relative to the listed prefix ("name" in a namespace, "namespace/name" across them).
    let mut items: Vec<(String, Arc<Value>)> = snapshot
        .iter()
        .filter(|(k, o)| filter.matches(k, o))
        .map(|(k, o)| {
            let rel = if res.namespaced() && all_namespaces {
                format!("{}/{}", k.1, k.2)
            } else {
                k.2.clone()
            };
            (rel, o.clone())
        })
        .filter(|(rel, _)| rel.as_str() >= start.as_str())
        .collect();
    items.sort_by(|a, b| a.0.cmp(&b.0));
    let mut next = None;
    if paginate && limit > 0 && items.len() > limit {
        let remaining = items.len() - limit;
        items.truncate(limit);
        let token = encode_continue(rv as i64, &format!("{}\u{0}", items[limit - 1].0));
        // remainingItemCount is only known when nothing was filtered out.
        next = Some((token, filter.selects_everything().then_some(remaining)));
    }
    Ok(json_reply(shared, 200, list_json(res, rv, next, &items)))
}

fn list_json(
    res: Res,
    rv: u64,
    next: Option<(String, Option<usize>)>,
    items: &[(String, Arc<Value>)],
) -> String {
    let items: Vec<String> = items
        .iter()
        .map(|(_, obj)| {
            if res.builtin() {
                let mut o = (**obj).clone();
                if let Some(map) = o.as_object_mut() {
                    map.remove("kind");
                    map.remove("apiVersion");
                }
                o.to_string()
            } else {
                obj.to_string()
            }
        })
        .collect();
    let items = items.join(",");
    let list_kind = format!("{}List", res.kind());
    let rv = json!(rv.to_string());
    if res.builtin() {
        // A Go struct: kind, apiVersion, metadata{resourceVersion, continue, remainingItemCount}.
        let mut meta = format!("{{\"resourceVersion\":{rv}");
        if let Some((token, remaining)) = &next {
            meta.push_str(&format!(",\"continue\":{}", json!(token)));
            if let Some(n) = remaining {
                meta.push_str(&format!(",\"remainingItemCount\":{n}"));
            }
        }
        meta.push('}');
        format!(
            "{{\"kind\":\"{list_kind}\",\"apiVersion\":\"{}\",\"metadata\":{meta},\"items\":[{items}]}}",
            res.api_version()
        )
    } else {
        // An unstructured list: a Go map, so sorted keys.
        let mut meta = String::from("{");
        if let Some((token, remaining)) = &next {
            meta.push_str(&format!("\"continue\":{},", json!(token)));
            if let Some(n) = remaining {
                meta.push_str(&format!("\"remainingItemCount\":{n},"));
            }
        }
        meta.push_str(&format!("\"resourceVersion\":{rv}}}"));
        format!(
            "{{\"apiVersion\":\"{}\",\"items\":[{items}],\"kind\":\"{list_kind}\",\"metadata\":{meta}}}",
            res.api_version()
        )
    }
}

/// The etcd3 store's continue token: base64url (no padding) of
/// {"v":"meta.k8s.io/v1","rv":N,"start":"<key after the last one>"}.
fn encode_continue(rv: i64, start: &str) -> String {
    B64_URL.encode(format!(
        "{{\"v\":\"meta.k8s.io/v1\",\"rv\":{rv},\"start\":{}}}",
        json!(start)
    ))
}

fn decode_continue(token: &str) -> Result<(i64, String), Status> {
    let invalid = |why: &str| Status::bad_request(format!("invalid continue token: {why}"));
    let raw = B64_URL
        .decode(token)
        .map_err(|_| invalid("continue key is not valid: illegal base64 data"))?;
    let v: Value =
        serde_json::from_slice(&raw).map_err(|_| invalid("continue key is not valid: bad json"))?;
    if v["v"] != "meta.k8s.io/v1" {
        return Err(invalid(
            "continue key is not valid: server does not recognize this encoded key",
        ));
    }
    let rv = v["rv"].as_i64().filter(|rv| *rv > 0 || *rv == -1).ok_or_else(|| {
        invalid("continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)")
    })?;
    let start = v["start"]
        .as_str()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| invalid("continue key is not valid: encoded start key empty"))?;
    Ok((rv, start.to_owned()))
}

/// The watch cache waits up to 3 s to catch up with a resourceVersion it has not seen, then
/// answers 504 "Too large resource version" (cacher.waitUntilFreshAndBlock).
async fn wait_for_rv(shared: &Shared, rv: u64) -> Result<(), Status> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let current = shared.store().rv;
        if current >= rv {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Status::too_large(rv, current));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn serve_watch(
    shared: &Arc<Shared>,
    flushed: Arc<AtomicBool>,
    user: &str,
    res: Res,
    ns: Option<String>,
    q: &Query,
) -> Result<Response<Body>, Status> {
    let filter = Filter::parse(res, ns, q)?;
    let send_initial = q.bool("sendInitialEvents")?;
    let bookmarks = q.bool("allowWatchBookmarks")?.unwrap_or(false);
    let gate = shared.store().watch_list;
    validate_watch(
        q.get("resourceVersionMatch").unwrap_or(""),
        q.get("continue").unwrap_or(""),
        send_initial,
        gate,
    )?;
    let wanted = parse_rv(q.get("resourceVersion").unwrap_or(""))?;
    // Without timeoutSeconds the server picks one between minRequestTimeout (1800 s) and twice
    // that; either way it ends the watch cleanly when it elapses.
    let timeout = match q.int("timeoutSeconds")? {
        Some(secs) if secs > 0 => Duration::from_secs(secs as u64),
        _ => Duration::from_secs(1800 + random_u64() % 1800),
    };
    let streaming_list = send_initial == Some(true);
    if streaming_list && let Some(n) = wanted.filter(|n| *n > 0) {
        // Only watch-list requests wait for the cache; a plain watch ahead of it is accepted
        // and simply gets nothing until the resourceVersion passes the requested one.
        wait_for_rv(shared, n).await?;
    }

    let deadline = tokio::time::Instant::now() + timeout;
    let (tx, rx) = mpsc::unbounded_channel();
    let mut st = shared.store();
    let mut initial = VecDeque::new();
    let current_state = |st: &Store, initial: &mut VecDeque<Line>| {
        let mut objs: Vec<(&Key, &Arc<Value>)> = st
            .current
            .iter()
            .filter(|(k, o)| filter.matches(k, o))
            .collect();
        objs.sort_by_key(|(k, _)| (k.1.clone(), k.2.clone()));
        for (_, o) in objs {
            initial.push_back(Line::event("ADDED", o, st.rv));
        }
    };
    // `seen` is the resourceVersion the watch starts at; a bookmark is only sent past it.
    let (after, seen) = match wanted {
        _ if streaming_list => {
            // sendInitialEvents=true: the current state, then a bookmark marking its end.
            current_state(&st, &mut initial);
            if bookmarks {
                let rv = st.rv.max(wanted.unwrap_or(0));
                initial.push_back(Line::bookmark(res, rv, true));
            }
            (st.rv, st.rv)
        }
        // resourceVersion 0 or unset: the current state as ADDED events first (for backward
        // compatibility, watch_cache.go), unless sendInitialEvents=false asks to skip it.
        None | Some(0) => {
            if send_initial.is_none() {
                current_state(&st, &mut initial);
            }
            (st.rv, st.rv)
        }
        Some(n) if n < st.watch_floor => {
            let status = Status::too_old_watch(n, st.watch_floor);
            drop(st);
            return Ok(watch_error(shared, &status));
        }
        Some(n) => {
            // Replay what happened after n from history, then go live.
            for change in st.log.iter().filter(|c| c.rv > n) {
                if let Some(line) = filter.event(change) {
                    initial.push_back(line);
                }
            }
            (st.rv.max(n), n)
        }
    };
    let id = st.next_watch_id;
    st.next_watch_id += 1;
    st.watches.insert(id, WatchReg { filter, after, tx });
    let interval = st.bookmark_interval;
    drop(st);

    let now = tokio::time::Instant::now();
    let stream = WatchStream {
        shared: shared.clone(),
        id,
        res,
        user: user.to_owned(),
        rx,
        // processInterval: the start moves past every initial event.
        start: initial.iter().map(|l| l.rv).fold(seen, u64::max),
        pending: initial,
        deadline,
        next_bookmark: if bookmarks {
            next_bookmark_at(now, interval, deadline)
        } else {
            None
        },
        flushed,
        ending: false,
        cut: false,
    };
    let body = futures::stream::unfold(stream, |mut w| async move {
        let bytes = w.next_line().await?;
        Some((bytes.map(Frame::data), w))
    });
    Ok(reply(
        shared,
        200,
        "application/json",
        StreamBody::new(body).boxed_unsync(),
    ))
}

/// A 200 watch response holding one ERROR event, after which the server ends the stream.
fn watch_error(shared: &Shared, status: &Status) -> Response<Body> {
    let line = Bytes::from(format!(
        "{{\"type\":\"ERROR\",\"object\":{}}}\n",
        status.json()
    ));
    let body = futures::stream::iter([Ok::<_, std::io::Error>(Frame::data(line))]);
    reply(
        shared,
        200,
        "application/json",
        StreamBody::new(body).boxed_unsync(),
    )
}

fn discovery_json(route: &Route, port: u16) -> String {
    let mco_version =
        json!({"groupVersion": "machineconfiguration.openshift.io/v1", "version": "v1"});
    let mco_group = json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": MCO_GROUP,
        "versions": [mco_version],
        "preferredVersion": mco_version,
    });
    let verbs = json!([
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "create",
        "update",
        "watch"
    ]);
    let v = match route {
        Route::Version => json!({
            "major": "1", "minor": "33", "emulationMajor": "1", "emulationMinor": "33",
            "minCompatibilityMajor": "1", "minCompatibilityMinor": "32",
            "gitVersion": "v1.33.5", "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean", "buildDate": "2025-10-01T00:00:00Z", "goVersion": "go1.24.6",
            "compiler": "gc", "platform": "linux/amd64"
        }),
        Route::Api => json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": format!("127.0.0.1:{port}")}]
        }),
        Route::ApiV1 => json!({
            "kind": "APIResourceList",
            "groupVersion": "v1",
            "resources": [{
                "name": "configmaps", "singularName": "configmap", "namespaced": true,
                "kind": "ConfigMap", "verbs": verbs, "shortNames": ["cm"],
                "storageVersionHash": "qFsyl6wFWjQ="
            }]
        }),
        Route::Apis => json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [mco_group]}),
        Route::McoGroup => mco_group,
        _ => json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": "machineconfiguration.openshift.io/v1",
            "resources": [
                {"name": "controllerconfigs", "singularName": "controllerconfig", "namespaced": false,
                 "kind": "ControllerConfig", "verbs": verbs, "storageVersionHash": "mKzXvmgBWPs="},
                {"name": "controllerconfigs/status", "singularName": "", "namespaced": false,
                 "kind": "ControllerConfig", "verbs": ["get", "patch", "update"]}
            ]
        }),
    };
    v.to_string()
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A response with the headers kube-apiserver puts on every answer.
fn reply(shared: &Shared, code: u16, content_type: &str, body: Body) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("Audit-Id", new_uid())
        .header("Cache-Control", "no-cache, private")
        .header(hyper::header::CONTENT_TYPE, content_type)
        .header("X-Kubernetes-Pf-Flowschema-Uid", &shared.flow_schema_uid)
        .header(
            "X-Kubernetes-Pf-Prioritylevel-Uid",
            &shared.priority_level_uid,
        )
        .body(body)
        .expect("valid response")
}

fn json_reply(shared: &Shared, code: u16, json: String) -> Response<Body> {
    reply(shared, code, "application/json", full(json))
}

fn status_reply(shared: &Shared, status: &Status) -> Response<Body> {
    let mut resp = json_reply(shared, status.code, status.json());
    if let Some(secs) = status.retry_after {
        resp.headers_mut()
            .insert(hyper::header::RETRY_AFTER, secs.into());
    }
    resp
}

// ---------------------------------------------------------------------------------------------
// Watch streams
// ---------------------------------------------------------------------------------------------

/// One newline-terminated watch event.
struct Line {
    bytes: Bytes,
    /// The resourceVersion this event brings the watch to.
    rv: u64,
    /// ADDED/MODIFIED/DELETED (stamped in `last_event_sent` when flushed).
    object: bool,
}

impl Line {
    fn event(kind: &str, obj: &Value, rv: u64) -> Line {
        Line {
            bytes: format!("{{\"type\":\"{kind}\",\"object\":{obj}}}\n").into(),
            rv,
            object: true,
        }
    }

    /// A BOOKMARK: an empty object of the watched kind carrying only a resourceVersion (and the
    /// initial-events-end annotation closing a streaming list). Since Kubernetes 1.33 a zero
    /// creationTimestamp is omitted rather than sent as null.
    fn bookmark(res: Res, rv: u64, initial_events_end: bool) -> Line {
        let (kind, api_version) = (res.kind(), res.api_version());
        let rv_field = format!("\"resourceVersion\":\"{rv}\"");
        let annotations = "\"annotations\":{\"k8s.io/initial-events-end\":\"true\"}";
        let object = match (res.builtin(), initial_events_end) {
            // A Go struct: ObjectMeta has resourceVersion before annotations.
            (true, false) => format!(
                "{{\"kind\":\"{kind}\",\"apiVersion\":\"{api_version}\",\"metadata\":{{{rv_field}}}}}"
            ),
            (true, true) => format!(
                "{{\"kind\":\"{kind}\",\"apiVersion\":\"{api_version}\",\"metadata\":{{{rv_field},{annotations}}}}}"
            ),
            // Unstructured: sorted keys.
            (false, false) => format!(
                "{{\"apiVersion\":\"{api_version}\",\"kind\":\"{kind}\",\"metadata\":{{{rv_field}}}}}"
            ),
            (false, true) => format!(
                "{{\"apiVersion\":\"{api_version}\",\"kind\":\"{kind}\",\"metadata\":{{{annotations},{rv_field}}}}}"
            ),
        };
        Line {
            bytes: format!("{{\"type\":\"BOOKMARK\",\"object\":{object}}}\n").into(),
            rv,
            object: false,
        }
    }
}

enum Msg {
    Line(Line),
    /// End the stream cleanly after what is queued.
    Close,
    /// Send half an event and cut the connection.
    Cut,
    /// Send an ERROR event with the Status of this fault (`Status`, `ErrorEvent` or
    /// `TooManyRequests`), then end the stream.
    Error(Fault),
}

struct WatchStream {
    shared: Arc<Shared>,
    id: u64,
    res: Res,
    /// Who the watch's request authenticated as (an ERROR event's 403 names them).
    user: String,
    rx: mpsc::UnboundedReceiver<Msg>,
    pending: VecDeque<Line>,
    /// The resourceVersion the watch started from, after its initial events: cacheWatcher.process
    /// sends a bookmark only past it (and, like upstream, compares with it, not with the last
    /// bookmark sent, so bookmarks keep coming once the resourceVersion has moved once).
    start: u64,
    deadline: tokio::time::Instant,
    next_bookmark: Option<tokio::time::Instant>,
    /// Set when an event frame is handed to hyper; the connection's writer stamps the flush.
    flushed: Arc<AtomicBool>,
    ending: bool,
    /// Cut the connection once what is pending was sent.
    cut: bool,
}

impl WatchStream {
    async fn next_line(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        loop {
            // A hung server sends nothing, not even a bookmark or the end at the deadline.
            let mut hang = self.shared.hang.subscribe();
            let _ = hang
                .wait_for(|hang| !hang.is_some_and(|h| h.covers(Kind::Watch)))
                .await;
            if let Some(line) = self.pending.pop_front() {
                if line.object {
                    self.flushed.store(true, Ordering::SeqCst);
                }
                if line.rv > 0 {
                    *lock(&self.shared.last_rv_delivered) = Some(line.rv);
                }
                return Some(Ok(line.bytes));
            }
            if self.cut {
                self.cut = false;
                self.ending = true;
                return Some(Ok(Bytes::from_static(
                    b"{\"type\":\"MODIFIED\",\"object\":{\"kind\":\"ConfigMap\",\"apiVersion\":\"v1\",\"metadata\":{\"name\":\"x\",\"resou",
                )));
            }
            if self.ending {
                return None;
            }
            let bookmark_at = self.next_bookmark;
            tokio::select! {
                biased;
                _ = hang.wait_for(|hang| hang.is_some_and(|h| h.covers(Kind::Watch))) => {}
                msg = self.rx.recv() => self.on_msg(msg),
                // timeoutSeconds elapsed: the handler returns and the response ends cleanly.
                _ = tokio::time::sleep_until(self.deadline) => self.ending = true,
                _ = tokio::time::sleep_until(bookmark_at.unwrap_or(self.deadline)), if bookmark_at.is_some() => {
                    self.bookmark();
                }
            }
        }
    }

    fn on_msg(&mut self, msg: Option<Msg>) {
        match msg {
            Some(Msg::Line(line)) => self.pending.push_back(line),
            Some(Msg::Close) | None => self.ending = true,
            Some(Msg::Cut) => self.cut = true,
            Some(Msg::Error(fault)) => {
                let route = Route::Collection {
                    res: self.res,
                    ns: None,
                };
                let status = match fault {
                    Fault::TooManyRequests { retry_after } => {
                        Status::too_many_requests(retry_after)
                    }
                    Fault::Status(code) | Fault::ErrorEvent(code) => {
                        Status::injected(code, &route, &self.user, "watch", "")
                    }
                    other => unreachable!("{other:?} is no ERROR event"),
                };
                self.pending.push_back(Line {
                    bytes: format!("{{\"type\":\"ERROR\",\"object\":{}}}\n", status.json()).into(),
                    rv: 0,
                    object: false,
                });
                self.ending = true;
            }
        }
    }

    /// Queues a BOOKMARK at the current resourceVersion, behind any events still queued, if the
    /// resourceVersion has moved past the one the watch started from.
    fn bookmark(&mut self) {
        let (current, interval) = {
            // Under the store lock no event can be queued between the drain and the read of rv.
            let shared = self.shared.clone();
            let st = shared.store();
            while let Ok(msg) = self.rx.try_recv() {
                self.on_msg(Some(msg));
            }
            (st.rv, st.bookmark_interval)
        };
        if current > self.start && !self.ending && !self.cut {
            self.pending
                .push_back(Line::bookmark(self.res, current, false));
        }
        self.next_bookmark = next_bookmark_at(tokio::time::Instant::now(), interval, self.deadline);
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        self.shared.store().watches.remove(&self.id);
    }
}

/// cacheWatcher.nextBookmarkTime: after the bookmark interval (a minute upstream) or 2 s before
/// the watch's deadline, whichever is first; none once that is past.
fn next_bookmark_at(
    now: tokio::time::Instant,
    interval: Duration,
    deadline: tokio::time::Instant,
) -> Option<tokio::time::Instant> {
    let pre_timeout = deadline.checked_sub(Duration::from_secs(2))?;
    let at = (now + interval).min(pre_timeout);
    (at >= now).then_some(at)
}

// ---------------------------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------------------------

enum Command {
    Listen(StdTcpListener, std_mpsc::SyncSender<()>),
    Stop(std_mpsc::SyncSender<()>),
    /// Cut every connection and keep listening (see `ApiServer::rolling_restart`).
    Roll(std_mpsc::SyncSender<()>),
}

/// The server thread: a current-thread runtime running the control loop.
fn run(shared: Arc<Shared>, mut commands: mpsc::UnboundedReceiver<Command>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let mut serving: Option<Serving> = None;
        while let Some(command) = commands.recv().await {
            match command {
                Command::Listen(listener, done) => {
                    halt(&mut serving).await;
                    let (stop, stopped) = oneshot::channel();
                    let (roll, rolls) = mpsc::unbounded_channel();
                    let task = tokio::spawn(serve(shared.clone(), listener, stopped, rolls));
                    serving = Some(Serving { stop, roll, task });
                    let _ = done.send(());
                }
                Command::Stop(done) => {
                    halt(&mut serving).await;
                    let _ = done.send(());
                }
                Command::Roll(done) => match &serving {
                    Some(s) => {
                        // Answered by the serving task once every connection is gone.
                        if let Err(unsent) = s.roll.send(done) {
                            let _ = unsent.0.send(());
                        }
                    }
                    None => {
                        let _ = done.send(());
                    }
                },
            }
        }
        halt(&mut serving).await;
    });
}

/// The task accepting connections, and how to reach it.
struct Serving {
    stop: oneshot::Sender<()>,
    /// Asks it to cut every connection, and says when that is done.
    roll: mpsc::UnboundedSender<std_mpsc::SyncSender<()>>,
    task: tokio::task::JoinHandle<()>,
}

async fn halt(serving: &mut Option<Serving>) {
    if let Some(Serving { stop, task, .. }) = serving.take() {
        let _ = stop.send(());
        let _ = task.await;
    }
}

/// Accepts connections until told to stop, then drops the listener and every connection. On a
/// roll it drops every connection and goes on accepting with new TLS session state (connections
/// that arrive meanwhile wait in the listen backlog).
async fn serve(
    shared: Arc<Shared>,
    listener: StdTcpListener,
    mut stop: oneshot::Receiver<()>,
    mut rolls: mpsc::UnboundedReceiver<std_mpsc::SyncSender<()>>,
) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
    let mut acceptor = TlsAcceptor::from(server_config(&shared));
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop => break,
            Some(done) = rolls.recv() => {
                connections.shutdown().await;
                acceptor = TlsAcceptor::from(server_config(&shared));
                let _ = done.send(());
            }
            accepted = listener.accept() => {
                if let Ok((tcp, _)) = accepted {
                    let _ = tcp.set_nodelay(true); // Go's default
                    connections.spawn(connection(shared.clone(), acceptor.clone(), tcp));
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.shutdown().await;
}

async fn connection(shared: Arc<Shared>, acceptor: TlsAcceptor, tcp: tokio::net::TcpStream) {
    let Ok(tls) = acceptor.accept(tcp).await else {
        return;
    };
    // What the handshake (or the session it resumed) left: kept for every request, which the
    // x509 authenticator judges afresh.
    let chain = tls
        .get_ref()
        .1
        .peer_certificates()
        .map(<[_]>::to_vec)
        .unwrap_or_default();
    let peer = Arc::new(Peer {
        number: shared.connections.fetch_add(1, Ordering::SeqCst) + 1,
        leaf_sha256: chain
            .first()
            .map(|leaf| hex(&Sha256::digest(leaf.as_ref()))),
        chain,
    });
    let flushed = Arc::new(AtomicBool::new(false));
    let io = TokioIo::new(FlushStamp {
        inner: tls,
        flushed: flushed.clone(),
        shared: shared.clone(),
    });
    let service = hyper::service::service_fn(move |req| {
        let (shared, peer, flushed) = (shared.clone(), peer.clone(), flushed.clone());
        async move { Ok::<_, Infallible>(handle(shared, peer, flushed, req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(io, service)
        .await;
}

/// The connection's transport: notes when a flush completes after a watch event was written.
struct FlushStamp<T> {
    inner: T,
    flushed: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

impl<T: AsyncRead + Unpin> AsyncRead for FlushStamp<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for FlushStamp<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_flush(cx);
        if matches!(result, Poll::Ready(Ok(()))) && this.flushed.swap(false, Ordering::SeqCst) {
            *lock(&this.shared.last_event_sent) = Some(Instant::now());
        }
        result
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

// ---------------------------------------------------------------------------------------------
// TLS, kubeconfig, small helpers
// ---------------------------------------------------------------------------------------------

/// The serving CA's subject: kept by the next serving CA, as a rotated CA keeps its name.
const SERVING_CA_NAME: &str = "kube-apiserver-localhost-signer";
/// The client CA's subject (the CSR signer that issues kubelets' client certificates).
const CLIENT_CA_NAME: &str = "kube-csr-signer";

/// A CA made when the test runs: valid from an hour ago for a year.
struct Authority {
    pem: String,
    der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

impl Authority {
    fn new(common_name: &str) -> Authority {
        let now = OffsetDateTime::now_utc();
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params
            .distinguished_name
            .push(DnType::OrganizationalUnitName, "openshift");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(365);
        let cert = params.self_signed(&key).expect("CA certificate");
        Authority {
            pem: cert.pem(),
            der: cert.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// See `ApiServer::issue_client_certificate`.
    fn issue_client(&self, user: &str, groups: &[&str], valid_for: Duration) -> ClientCertificate {
        let now = OffsetDateTime::now_utc();
        // X.509 times are whole seconds: the end is rounded up, so the certificate lasts at
        // least `valid_for`.
        let end = now + valid_for;
        let not_after = match end.replace_nanosecond(0).expect("whole second") {
            whole if whole == end => whole,
            whole => whole + time::Duration::SECOND,
        };
        let key = KeyPair::generate().expect("client key");
        let mut params = CertificateParams::default();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - time::Duration::minutes(1);
        params.not_after = not_after;
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("client certificate");
        let der = with_subject(cert.der(), &subject_der(user, groups), self.issuer.key());
        ClientCertificate {
            cert_pem: pem_of(&der),
            key_pem: key.serialize_pem(),
            not_after: not_after.into(),
        }
    }
}

/// A serving CA and the certificate for 127.0.0.1 and localhost it signed, ready to serve.
#[derive(Debug, Clone)]
struct ServingPair {
    ca_pem: String,
    key: Arc<CertifiedKey>,
}

fn serving_pair(provider: &CryptoProvider) -> ServingPair {
    let now = OffsetDateTime::now_utc();
    let ca = Authority::new(SERVING_CA_NAME);
    let key = KeyPair::generate().expect("server key");
    let mut params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("server certificate parameters");
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, "127.0.0.1");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(30);
    let cert = params
        .signed_by(&key, &ca.issuer)
        .expect("server certificate");
    let key = CertifiedKey::from_der(
        vec![cert.der().clone()],
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        provider,
    )
    .expect("serving key");
    ServingPair {
        ca_pem: ca.pem,
        key: Arc::new(key),
    }
}

/// The serving certificate, swapped under a lock as kube-apiserver's dynamic serving
/// certificate controller swaps it: each new handshake asks for the current one, and a
/// connection keeps the one it was handed.
#[derive(Debug)]
struct ServingCertificates {
    current: Mutex<ServingPair>,
    /// Made by `next_serving_ca`, not served until `switch_serving_ca`.
    next: Mutex<Option<ServingPair>>,
}

impl ServingCertificates {
    fn new(first: ServingPair) -> ServingCertificates {
        ServingCertificates {
            current: Mutex::new(first),
            next: Mutex::new(None),
        }
    }

    fn current(&self) -> ServingPair {
        lock(&self.current).clone()
    }

    fn next(&self, provider: &CryptoProvider) -> ServingPair {
        lock(&self.next)
            .get_or_insert_with(|| serving_pair(provider))
            .clone()
    }

    fn switch(&self, provider: &CryptoProvider) {
        let next = lock(&self.next)
            .take()
            .unwrap_or_else(|| serving_pair(provider));
        *lock(&self.current) = next;
    }
}

impl ResolvesServerCert for ServingCertificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(lock(&self.current).key.clone())
    }
}

/// Go's `tls.RequestClientCert`, as kube-apiserver sets up its listener: the handshake asks for a
/// client certificate, naming the client CA as acceptable, and takes whatever comes, or nothing.
/// Nothing is verified then but the handshake's own signature (proof that the client holds the
/// key); the chain is judged on each request by the x509 authenticator, so that a certificate
/// that expires, or that nobody trusts, still connects and fails as an authentication error.
#[derive(Debug)]
struct RequestClientCert(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for RequestClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// What the x509 authenticator checks a chain with: the client CA as the only root, clientAuth
/// usage (webpki, like Go's Verify, accepts a certificate with no extended key usage at all).
/// Its root hints are what the handshake names as acceptable CAs.
fn client_verifier(ca: &Authority, provider: &Arc<CryptoProvider>) -> Arc<dyn ClientCertVerifier> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.der.clone()).expect("client CA");
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()
        .expect("client certificate verifier")
}

/// The TLS configuration of one listener, made anew by every `listen` so that a restart forgets
/// the TLS sessions of the last one (a restarted apiserver has new session ticket keys); the
/// serving certificate and the client CA are shared. ALPN offers http/1.1 only: kube-rs's
/// client speaks HTTP/1.1 (the real server also offers h2).
fn server_config(shared: &Shared) -> Arc<rustls::ServerConfig> {
    let mut config = rustls::ServerConfig::builder_with_provider(shared.provider.clone())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_client_cert_verifier(Arc::new(RequestClientCert(shared.client_auth.clone())))
        .with_cert_resolver(shared.serving.clone());
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// rcgen keeps one value per attribute type, but kube-apiserver takes a user's groups from the O
/// attributes of the certificate, one per group, as Go's pkix.Name writes Organization. This
/// puts `subject` in place of the certificate's subject and signs it again with the issuer's key.
fn with_subject(cert: &[u8], subject: &[u8], issuer_key: &KeyPair) -> Vec<u8> {
    let parts = der_elements(der_content(cert));
    let [tbs, algorithm, _signature] = parts[..] else {
        panic!("a certificate is three elements, not {}", parts.len());
    };
    // version, serialNumber, signature, issuer, validity, subject, subjectPublicKeyInfo, ...
    let mut fields = der_elements(der_content(tbs));
    fields[5] = subject;
    let tbs = der_tlv(0x30, &fields.concat());
    let mut bits = vec![0]; // no unused bits
    bits.extend(issuer_key.sign(&tbs).expect("sign certificate"));
    der_tlv(0x30, &[&tbs[..], algorithm, &der_tlv(0x03, &bits)].concat())
}

/// An X.509 Name as Go's pkix.Name writes one: an O attribute per organization, then the CN
/// (left out when empty), each in an RDN of its own.
fn subject_der(common_name: &str, organizations: &[&str]) -> Vec<u8> {
    const O: &[u8] = &[0x06, 0x03, 0x55, 0x04, 0x0a];
    const CN: &[u8] = &[0x06, 0x03, 0x55, 0x04, 0x03];
    let rdn = |oid: &[u8], value: &str| {
        let utf8 = der_tlv(0x0c, value.as_bytes());
        der_tlv(0x31, &der_tlv(0x30, &[oid, &utf8[..]].concat()))
    };
    let mut rdns: Vec<u8> = organizations.iter().flat_map(|o| rdn(O, o)).collect();
    if !common_name.is_empty() {
        rdns.extend(rdn(CN, common_name));
    }
    der_tlv(0x30, &rdns)
}

/// A DER element: tag, definite length, content.
fn der_tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    match u8::try_from(content.len()) {
        Ok(short) if short < 0x80 => out.push(short),
        _ => {
            let len = content.len().to_be_bytes();
            let digits: Vec<u8> = len.into_iter().skip_while(|b| *b == 0).collect();
            out.push(0x80 | digits.len() as u8);
            out.extend(digits);
        }
    }
    out.extend_from_slice(content);
    out
}

/// (header length, content length) of the DER element at the start of `der`.
fn der_header(der: &[u8]) -> (usize, usize) {
    match der[1] {
        short if short < 0x80 => (2, usize::from(short)),
        long => {
            let n = usize::from(long & 0x7f);
            let len = der[2..2 + n]
                .iter()
                .fold(0, |len, b| (len << 8) | usize::from(*b));
            (2 + n, len)
        }
    }
}

/// The content of the DER element at the start of `der`.
fn der_content(der: &[u8]) -> &[u8] {
    let (header, len) = der_header(der);
    &der[header..header + len]
}

/// The elements (each whole) that make up DER content.
fn der_elements(mut content: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while !content.is_empty() {
        let (header, len) = der_header(content);
        let (element, rest) = content.split_at(header + len);
        out.push(element);
        content = rest;
    }
    out
}

fn pem_of(der: &[u8]) -> String {
    let body = B64.encode(der);
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

fn kubeconfig_yaml(port: u16, ca_pem: &str, token: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: fixture
  cluster:
    server: https://127.0.0.1:{port}
    certificate-authority-data: {ca}
users:
- name: fixture-node
  user:
    token: {token}
contexts:
- name: fixture
  context:
    cluster: fixture
    user: fixture-node
    namespace: default
current-context: fixture
preferences: {{}}
",
        ca = B64.encode(ca_pem)
    )
}

fn now_rfc3339() -> String {
    let now = OffsetDateTime::now_utc();
    now.replace_nanosecond(0)
        .unwrap_or(now)
        .format(&Rfc3339)
        .expect("RFC 3339 time")
}

fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

fn random_bytes(n: usize) -> Vec<u8> {
    (0..n.div_ceil(8))
        .flat_map(|_| random_u64().to_le_bytes())
        .take(n)
        .collect()
}

/// A version-4 UUID.
fn new_uid() -> String {
    let mut b = random_bytes(16);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Deterministic filler bytes (splitmix64 seeded by `seed`).
fn seeded_bytes(seed: &str, n: usize) -> Vec<u8> {
    let mut x = seed.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Authentication: the x509 and bearer token authenticators, as kube-apiserver combines them
// ---------------------------------------------------------------------------------------------

/// What a connection's handshake left for its requests.
struct Peer {
    /// See `Request::connection`.
    number: u64,
    /// The chain the client presented, leaf first; empty when it presented none.
    chain: Vec<CertificateDer<'static>>,
    /// The hex SHA-256 of the leaf's DER.
    leaf_sha256: Option<String>,
}

/// What kube-apiserver's authentication filter made of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Authn {
    /// An authenticator succeeded: this user, `system:authenticated` among the groups.
    User { name: String, groups: Vec<String> },
    /// No authenticator had an opinion: system:anonymous.
    Anonymous,
    /// Every authenticator that had an opinion failed (why, as the union aggregates it): 401.
    Refused(String),
}

impl Authn {
    /// The user recorded on the request: empty when refused.
    fn user(&self) -> &str {
        match self {
            Authn::User { name, .. } => name,
            Authn::Anonymous => ANONYMOUS,
            Authn::Refused(_) => "",
        }
    }

    fn groups(&self) -> Vec<String> {
        match self {
            Authn::User { groups, .. } => groups.clone(),
            Authn::Anonymous => vec!["system:unauthenticated".to_owned()],
            Authn::Refused(_) => Vec::new(),
        }
    }
}

/// A user and their groups, as an authenticator that succeeded names them.
type Identity = (String, Vec<String>);

/// What one authenticator says: Ok(None) when it has no opinion (nothing for it in the request),
/// an error when what it was given does not hold.
type Verdict = Result<Option<Identity>, String>;

/// The bearer token of an `Authorization: Bearer` header, if any (an empty one is none).
fn bearer_token(headers: &hyper::HeaderMap) -> Option<&str> {
    let value = headers.get(hyper::header::AUTHORIZATION)?.to_str().ok()?;
    let mut parts = value.trim().splitn(3, ' ');
    let scheme = parts.next()?;
    let token = parts.next()?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// kube-apiserver's authentication (pkg/kubeapiserver/authenticator): the union of the x509 and
/// the bearer token authenticators with FailOnError false, wrapped by the group adder, then the
/// anonymous authenticator with FailOnError true. The first authenticator that succeeds decides
/// and the others' errors are dropped; if none succeeds, their errors make a 401, and with no
/// error (nothing presented) the request is anonymous.
fn authenticate(
    shared: &Shared,
    chain: &[CertificateDer<'_>],
    bearer: Option<&str>,
    now: SystemTime,
) -> Authn {
    let x509 = || x509_user(&*shared.client_auth, chain, now);
    let token = || token_user(shared, bearer);
    let authenticators: [&dyn Fn() -> Verdict; 2] = [&x509, &token];
    let mut errors = Vec::new();
    for authenticator in authenticators {
        match authenticator() {
            Ok(Some((name, mut groups))) => {
                if !groups.iter().any(|g| g == AUTHENTICATED) {
                    groups.push(AUTHENTICATED.to_owned());
                }
                return Authn::User { name, groups };
            }
            Ok(None) => {}
            Err(why) => errors.push(why),
        }
    }
    // utilerrors.NewAggregate: one error as itself, several in brackets.
    match errors.len() {
        0 => Authn::Anonymous,
        1 => Authn::Refused(errors.remove(0)),
        _ => Authn::Refused(format!("[{}]", errors.join(", "))),
    }
}

/// The x509 authenticator with CommonNameUserConversion: no certificate is no opinion; a chain
/// that does not verify against the client CA at `now` for client auth is an error; a verified
/// one is its CN with its O values as groups, or no opinion if it has no CN.
fn x509_user(
    verifier: &dyn ClientCertVerifier,
    chain: &[CertificateDer<'_>],
    now: SystemTime,
) -> Verdict {
    let Some((leaf, intermediates)) = chain.split_first() else {
        return Ok(None);
    };
    let cert = match x509_parser::parse_x509_certificate(leaf) {
        Ok((_, cert)) => cert,
        Err(e) => return Err(format!("x509: malformed certificate: {e}")),
    };
    let failed = |why: String| {
        format!(
            "verifying certificate {} failed: {why}",
            certificate_identifier(&cert)
        )
    };
    let since_epoch = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    // Go's Verify compares the instant (`now.After(NotAfter)`); webpki, below, whole seconds
    // only, which would keep an expired certificate for up to a second more.
    let validity = cert.validity();
    let (not_before, not_after) = (
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
    );
    let at = |secs: i64| Duration::from_secs(u64::try_from(secs).unwrap_or(0));
    let invalid = |relation: &str, bound: i64| {
        failed(format!(
            "x509: certificate has expired or is not yet valid: current time {} is {relation} {}",
            go_time(OffsetDateTime::from(now)),
            go_time(OffsetDateTime::from_unix_timestamp(bound).expect("X.509 time")),
        ))
    };
    if since_epoch > at(not_after) {
        return Err(invalid("after", not_after));
    }
    if since_epoch < at(not_before) {
        return Err(invalid("before", not_before));
    }
    verifier
        .verify_client_cert(leaf, intermediates, UnixTime::since_unix_epoch(since_epoch))
        .map_err(|e| failed(x509_error(&e)))?;
    let subject = cert.subject();
    // pkix.Name keeps the last CN and every O.
    let Some(name) = subject
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok())
        .last()
        .filter(|cn| !cn.is_empty())
    else {
        return Ok(None);
    };
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok())
        .map(str::to_owned)
        .collect();
    Ok(Some((name.to_owned(), groups)))
}

/// The bearer token authenticator: no token is no opinion; the current token is the fixture
/// user, a token of `kubeconfig_for` its node user (both in the nodes' group); any other is an
/// error (bearertoken.go: `invalid bearer token`).
fn token_user(shared: &Shared, bearer: Option<&str>) -> Verdict {
    let Some(token) = bearer else {
        return Ok(None);
    };
    let user = if token == shared.token() {
        USER.to_owned()
    } else {
        lock(&shared.node_tokens)
            .get(token)
            .cloned()
            .ok_or_else(|| "invalid bearer token".to_owned())?
    };
    Ok(Some((
        user,
        USER_GROUPS.iter().map(|g| (*g).to_owned()).collect(),
    )))
}

/// certificateIdentifier in the x509 authenticator: how its errors name a certificate.
fn certificate_identifier(cert: &x509_parser::certificate::X509Certificate<'_>) -> String {
    use x509_parser::extensions::ParsedExtension;
    let colons = |bytes: &[u8]| {
        bytes
            .iter()
            .map(|b| format!("{b:02X}"))
            .collect::<Vec<_>>()
            .join(":")
    };
    let (mut skid, mut akid) = (String::new(), String::new());
    for extension in cert.extensions() {
        match extension.parsed_extension() {
            ParsedExtension::SubjectKeyIdentifier(id) => skid = colons(id.0),
            ParsedExtension::AuthorityKeyIdentifier(aki) => {
                akid = aki
                    .key_identifier
                    .as_ref()
                    .map_or_else(String::new, |id| colons(id.0));
            }
            _ => {}
        }
    }
    format!("SN={}, SKID={skid}, AKID={akid}", cert.serial)
}

/// The words of Go's x509 package for what webpki found.
fn x509_error(e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    match e {
        rustls::Error::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => {
            "x509: certificate signed by unknown authority".to_owned()
        }
        rustls::Error::InvalidCertificate(C::InvalidPurpose | C::InvalidPurposeContext { .. }) => {
            "x509: certificate specifies an incompatible key usage".to_owned()
        }
        rustls::Error::InvalidCertificate(
            C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. },
        ) => "x509: certificate has expired or is not yet valid".to_owned(),
        other => format!("x509: {other}"),
    }
}

/// A time as Go's time.RFC3339 prints it (whole seconds, UTC as Z).
fn go_time(t: OffsetDateTime) -> String {
    t.replace_nanosecond(0)
        .unwrap_or(t)
        .format(&Rfc3339)
        .expect("RFC 3339 time")
}

// ---------------------------------------------------------------------------------------------
// Reviews: TokenReview and SubjectAccessReview
// ---------------------------------------------------------------------------------------------

/// The audience kube-apiserver's tokens are for by default (--api-audiences defaults to the
/// issuer, `https://kubernetes.default.svc` on kubeadm and OpenShift clusters).
pub const API_AUDIENCE: &str = "https://kubernetes.default.svc";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Review {
    Token,
    Access,
}

impl Review {
    fn group(self) -> &'static str {
        match self {
            Review::Token => "authentication.k8s.io",
            Review::Access => "authorization.k8s.io",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Review::Token => "tokenreviews",
            Review::Access => "subjectaccessreviews",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Review::Token => "TokenReview",
            Review::Access => "SubjectAccessReview",
        }
    }
}

/// Who holds a token the server accepts.
#[derive(Debug, Clone)]
struct TokenHolder {
    user: String,
    uid: String,
    groups: Vec<String>,
    audiences: Vec<String>,
}

/// The subject of a ClusterRoleBinding.
#[derive(Debug, Clone)]
pub enum Subject {
    User(String),
    Group(String),
}

/// A ClusterRole of nonResourceURLs rules, bound to one subject.
#[derive(Debug, Clone)]
struct Grant {
    name: String,
    subject: Subject,
    verbs: Vec<String>,
    paths: Vec<String>,
}

impl Grant {
    /// rbac.NonResourceURLMatches and VerbMatches, for a request by `user` in `groups`.
    fn allows(&self, user: &str, groups: &[String], verb: &str, path: &str) -> bool {
        let subject = match &self.subject {
            Subject::User(u) => u == user,
            Subject::Group(g) => groups.iter().any(|x| x == g),
        };
        let path_matches = |p: &String| {
            p == "*"
                || p == path
                || p.strip_suffix('*')
                    .is_some_and(|prefix| path.starts_with(prefix))
        };
        subject
            && self.verbs.iter().any(|v| v == "*" || v == verb)
            && self.paths.iter().any(path_matches)
    }

    /// The reason RBAC gives when this grant allows.
    fn reason(&self) -> String {
        let subject = match &self.subject {
            Subject::User(u) => format!("User {u:?}"),
            Subject::Group(g) => format!("Group {g:?}"),
        };
        format!(
            "RBAC: allowed by ClusterRoleBinding {:?} of ClusterRole {:?} to {subject}",
            self.name, self.name
        )
    }
}

/// The 422 Invalid of a review whose spec fails validation.
fn invalid_review(review: Review, field: &str, value: &str, detail: &str) -> Status {
    Status::new(
        422,
        "Invalid",
        format!(
            "{}.{} {:?} is invalid: {field}: Invalid value: {value}: {detail}",
            review.kind(),
            review.group(),
            ""
        ),
    )
    .details(json!({
        "group": review.group(),
        "kind": review.kind(),
        "causes": [{"reason": "FieldValueInvalid", "message": format!("Invalid value: {value}: {detail}"), "field": field}],
    }))
}

/// A POST to a review endpoint, answered as kube-apiserver answers it: 201 Created with the
/// review, its status filled in.
async fn serve_review(
    shared: &Shared,
    review: Review,
    body: &[u8],
) -> Result<Response<Body>, Status> {
    let mut object: Value = serde_json::from_slice(body).map_err(|e| {
        Status::bad_request(format!(
            "error decoding request body: json: cannot unmarshal: {e}"
        ))
    })?;
    let want_version = format!("{}/v1", review.group());
    if let Some(version) = object.get("apiVersion").and_then(Value::as_str)
        && version != want_version
    {
        return Err(Status::bad_request(format!(
            "the API version in the data ({version}) does not match the expected API version ({want_version})"
        )));
    }
    let delay = {
        let mut st = shared.store();
        match review {
            Review::Token => st.token_reviews.push(object.clone()),
            Review::Access => st.access_reviews.push(object.clone()),
        }
        st.review_delay
    };
    let status = match review {
        Review::Token => token_review_status(shared, &object)?,
        Review::Access => access_review_status(shared, &object)?,
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    object["kind"] = json!(review.kind());
    object["apiVersion"] = json!(want_version);
    object["metadata"] = json!({"creationTimestamp": null});
    object["status"] = status;
    Ok(json_reply(shared, 201, object.to_string()))
}

/// registry/authentication/tokenreview: the token is required; the audiences asked for
/// (default the API server's) must meet the token's; an unknown token is not an error of the
/// request but a status without `authenticated`.
fn token_review_status(shared: &Shared, object: &Value) -> Result<Value, Status> {
    let token = object
        .pointer("/spec/token")
        .and_then(Value::as_str)
        .unwrap_or("");
    if token.is_empty() {
        return Err(Status::bad_request(
            "token is required for TokenReview in authentication",
        ));
    }
    let asked: Vec<String> = object
        .pointer("/spec/audiences")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .filter(|a: &Vec<String>| !a.is_empty())
        .unwrap_or_else(|| vec![API_AUDIENCE.to_owned()]);
    let holder = shared.store().review_tokens.get(token).cloned();
    let Some(holder) = holder else {
        return Ok(json!({
            "user": {},
            "error": "[invalid bearer token, token lookup failed]",
        }));
    };
    let met: Vec<&String> = asked
        .iter()
        .filter(|a| holder.audiences.contains(a))
        .collect();
    if met.is_empty() {
        return Ok(json!({
            "user": {},
            "error": format!(
                "[invalid bearer token, token audiences {:?} is invalid for the target audiences {:?}]",
                holder.audiences, asked
            ),
        }));
    }
    Ok(json!({
        "authenticated": true,
        "user": {
            "username": holder.user,
            "uid": holder.uid,
            "groups": holder.groups,
        },
        "audiences": met,
    }))
}

/// registry/authorization/subjectaccessreview: validated as upstream (exactly one of the two
/// attribute kinds; a user or a group), then decided by the non-resource grants (RBAC). This
/// server holds no resource rules for other users, so a resource question is denied.
fn access_review_status(shared: &Shared, object: &Value) -> Result<Value, Status> {
    let spec = object.get("spec").cloned().unwrap_or(json!({}));
    let resource = spec.get("resourceAttributes").filter(|v| !v.is_null());
    let non_resource = spec.get("nonResourceAttributes").filter(|v| !v.is_null());
    if resource.is_some() == non_resource.is_some() {
        return Err(invalid_review(
            Review::Access,
            "spec.resourceAttributes",
            "\"null\"",
            "exactly one of nonResourceAttributes or resourceAttributes must be specified",
        ));
    }
    let user = spec.get("user").and_then(Value::as_str).unwrap_or("");
    let groups: Vec<String> = spec
        .get("groups")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if user.is_empty() && groups.is_empty() {
        return Err(invalid_review(
            Review::Access,
            "spec.user",
            "\"\"",
            "at least one of user or group must be specified",
        ));
    }
    let Some(attrs) = non_resource else {
        return Ok(json!({"allowed": false}));
    };
    let path = attrs.get("path").and_then(Value::as_str).unwrap_or("");
    let verb = attrs.get("verb").and_then(Value::as_str).unwrap_or("");
    let st = shared.store();
    match st
        .grants
        .iter()
        .find(|g| g.allows(user, &groups, verb, path))
    {
        Some(grant) => Ok(json!({"allowed": true, "reason": grant.reason()})),
        None => Ok(json!({"allowed": false})),
    }
}
