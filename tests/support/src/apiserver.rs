//! An in-process fake kube-apiserver over HTTPS.
//!
//! It behaves as the recorded responses in `tests/fixtures/apiserver` show, for the requests
//! edgehub makes: list (field and label selectors, `limit`/`continue`, 410 for compacted
//! versions), watch (chunked, from a resourceVersion, BOOKMARKs, ERROR 410, streaming initial
//! events), get, create, update, merge and strategic-merge patches (status subresource too),
//! and delete with uid preconditions. It authenticates bearer tokens and client certificates,
//! and emulates the Node authorizer and NodeRestriction for `system:node:<name>` identities.
//!
//! Fault knobs: [`FakeApiServer::fail_next`] (500, 429 with Retry-After, ...),
//! [`FakeApiServer::cut_next_watch_events`] (a stream cut in the middle of an event),
//! [`FakeApiServer::corrupt_next_watch_events`] (a malformed line), [`FakeApiServer::stall`],
//! [`FakeApiServer::lose_next_answers`] (a write lands, its answer never leaves),
//! [`FakeApiServer::remove_token`] (a token stops authenticating: 401), and
//! [`FakeApiServer::set_offline`] (connections refused, open ones dropped).

use crate::certs::TestPki;
use crate::patch::{merge_patch, strategic_merge_patch};
use base64::Engine;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

mod csr;
pub use csr::{
    csrapproving, validate_kubelet_client, Approval, Approver, BootstrapToken, CsrRequest,
    TestOnlyCertWindow, KUBELET_CLIENT_SIGNER,
};

type Body = BoxBody<Bytes, std::io::Error>;

/// An early answer of a request handler (a Status error), boxed to keep `Result`s small.
type Reject = Box<Response<Body>>;

/// A resource type the fake serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceType {
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
}

impl ResourceType {
    fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

pub const RESOURCES: &[ResourceType] = &[
    ResourceType {
        group: "",
        version: "v1",
        plural: "pods",
        kind: "Pod",
        namespaced: true,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "nodes",
        kind: "Node",
        namespaced: false,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "configmaps",
        kind: "ConfigMap",
        namespaced: true,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "secrets",
        kind: "Secret",
        namespaced: true,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "events",
        kind: "Event",
        namespaced: true,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "serviceaccounts",
        kind: "ServiceAccount",
        namespaced: true,
    },
    ResourceType {
        group: "apps",
        version: "v1",
        plural: "daemonsets",
        kind: "DaemonSet",
        namespaced: true,
    },
    ResourceType {
        group: "apps",
        version: "v1",
        plural: "controllerrevisions",
        kind: "ControllerRevision",
        namespaced: true,
    },
    ResourceType {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        kind: "Lease",
        namespaced: true,
    },
    ResourceType {
        group: "certificates.k8s.io",
        version: "v1",
        plural: "certificatesigningrequests",
        kind: "CertificateSigningRequest",
        namespaced: false,
    },
];

pub fn resource_type(plural: &str) -> &'static ResourceType {
    RESOURCES
        .iter()
        .find(|r| r.plural == plural)
        .unwrap_or_else(|| panic!("fake apiserver does not serve {plural}"))
}

/// An injected failure for the next matching request.
#[derive(Debug, Clone)]
pub struct Failure {
    pub status: u16,
    pub retry_after: Option<u64>,
    /// Only requests whose path and query contain all of these.
    pub uri_contains: Vec<String>,
}

/// A request that is carried out but whose answer never leaves: the connection is closed
/// instead, as when the link drops between the apiserver's commit and its answer.
#[derive(Debug, Clone)]
struct LostAnswer {
    method: String,
    uri_contains: Vec<String>,
    /// Stall the server too, from that moment: the link stays down after the loss.
    then_stall: bool,
}

/// One request as the fake saw it.
#[derive(Debug, Clone)]
pub struct LoggedRequest {
    /// The Kubernetes verb: get, list, watch, create, update, patch, delete.
    pub verb: &'static str,
    /// The resource's plural (with `/sub` for a subresource), or "" for an unknown path.
    pub resource: String,
    pub method: String,
    pub path: String,
    pub query: BTreeMap<String, String>,
    pub user: Option<String>,
    pub status: u16,
    /// The request was carried out and its answer lost ([`FakeApiServer::lose_next_answers`]).
    pub answer_lost: bool,
    /// When the request arrived.
    pub at: std::time::Instant,
}

impl LoggedRequest {
    pub fn is_watch(&self) -> bool {
        matches!(
            self.query.get("watch").map(String::as_str),
            Some("1" | "true")
        )
    }

    /// A list (not a watch) of the collection whose path ends with `plural`, reading it
    /// afresh: not a [`LoggedRequest::is_version_check_of`].
    pub fn is_list_of(&self, plural: &str) -> bool {
        self.method == "GET"
            && !self.is_watch()
            && self.path.ends_with(&format!("/{plural}"))
            && !self.is_version_check()
    }

    /// A list that only asks whether the server has a resourceVersion
    /// (`resourceVersionMatch=NotOlderThan`, `limit=1`): edgehub's check of its cursor.
    pub fn is_version_check_of(&self, plural: &str) -> bool {
        self.method == "GET"
            && !self.is_watch()
            && self.path.ends_with(&format!("/{plural}"))
            && self.is_version_check()
    }

    fn is_version_check(&self) -> bool {
        self.query.get("resourceVersionMatch").map(String::as_str) == Some("NotOlderThan")
    }

    pub fn is_watch_of(&self, plural: &str) -> bool {
        self.method == "GET" && self.is_watch() && self.path.ends_with(&format!("/{plural}"))
    }
}

#[derive(Debug, Clone)]
struct Event {
    rv: u64,
    kind: &'static str,
    plural: &'static str,
    object: Value,
    /// The object before this change, for selector transitions.
    prev: Option<Value>,
}

/// A copy of the stored objects and resourceVersion: [`FakeApiServer::snapshot`].
#[derive(Debug, Clone)]
pub struct Snapshot {
    rv: u64,
    objects: BTreeMap<(String, String, String), Value>,
}

impl Snapshot {
    pub fn resource_version(&self) -> u64 {
        self.rv
    }
}

#[derive(Default)]
struct Db {
    rv: u64,
    compacted: u64,
    /// (plural, namespace, name) -> object with kind and apiVersion.
    objects: BTreeMap<(String, String, String), Value>,
    history: Vec<Event>,
    /// When each pod (by uid) was first stored bound to a node, for the authorizer's lag.
    bound_at: HashMap<String, std::time::Instant>,
}

#[derive(Default)]
struct Faults {
    fail_next: VecDeque<Failure>,
    lose_answers: VecDeque<LostAnswer>,
    cut_watch_events: usize,
    corrupt_watch_events: usize,
}

struct State {
    db: Mutex<Db>,
    rv_tx: watch::Sender<u64>,
    faults: Mutex<Faults>,
    stalled: AtomicBool,
    /// Requests the stall is holding right now, so a test can wait until one hangs.
    held: AtomicU64,
    log: Mutex<Vec<LoggedRequest>>,
    tokens: Mutex<HashMap<String, String>>,
    /// Client certificates by DER, checked per request (validity) as the x509 authenticator
    /// does: the handshake takes any certificate.
    certs: Mutex<HashMap<Vec<u8>, csr::CertIdentity>>,
    /// Bootstrap tokens, the CSR approver and signer settings.
    csr: Mutex<csr::CsrState>,
    pki: Arc<TestPki>,
    /// Bumped to drop every open connection.
    kill_tx: watch::Sender<u64>,
    rbac_edgehub: AtomicBool,
    bookmark_ms: AtomicU64,
    /// The Node authorizer's graph lag: for this long after a pod is bound, what it references
    /// answers 403 "no relationship found", as a real apiserver's does for a moment.
    authorizer_lag_ms: AtomicU64,
    uid_counter: AtomicU64,
    /// Issued tokens are padded to this length (0: short test tokens).
    token_len: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The fake apiserver. Dropping it stops it.
pub struct FakeApiServer {
    pub addr: SocketAddr,
    pub pki: Arc<TestPki>,
    state: Arc<State>,
    tls: Arc<rustls::ServerConfig>,
    accept: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(h) = lock(&self.accept).take() {
            h.abort();
        }
        self.state.kill_tx.send_modify(|v| *v += 1);
    }
}

/// The node identity the fixtures were recorded with.
pub const NODE_USER: &str = "system:node:edge-1";
pub const NODE_TOKEN: &str = "edge-1-token";
pub const ADMIN_TOKEN: &str = "admin-token";

impl FakeApiServer {
    /// Starts on 127.0.0.1 with a random port.
    pub async fn start() -> anyhow::Result<FakeApiServer> {
        Self::start_on("127.0.0.1:0".parse()?).await
    }

    pub async fn start_on(addr: SocketAddr) -> anyhow::Result<FakeApiServer> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let pki = Arc::new(TestPki::generate()?);
        let tls = Arc::new(server_tls(&pki)?);
        let (rv_tx, _) = watch::channel(0);
        let (kill_tx, _) = watch::channel(0);
        let state = Arc::new(State {
            db: Mutex::new(Db::default()),
            rv_tx,
            faults: Mutex::new(Faults::default()),
            stalled: AtomicBool::new(false),
            held: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
            tokens: Mutex::new(HashMap::from([
                (NODE_TOKEN.to_string(), NODE_USER.to_string()),
                (ADMIN_TOKEN.to_string(), "admin".to_string()),
            ])),
            certs: Mutex::new(HashMap::new()),
            csr: Mutex::new(csr::CsrState::default()),
            pki: pki.clone(),
            kill_tx,
            rbac_edgehub: AtomicBool::new(true),
            bookmark_ms: AtomicU64::new(60_000),
            authorizer_lag_ms: AtomicU64::new(0),
            uid_counter: AtomicU64::new(1),
            token_len: AtomicU64::new(0),
        });
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let server = FakeApiServer {
            addr,
            pki,
            state,
            tls,
            accept: Mutex::new(None),
        };
        server.spawn_accept(listener);
        Ok(server)
    }

    fn spawn_accept(&self, listener: TcpListener) {
        let state = self.state.clone();
        let acceptor = tokio_rustls::TlsAcceptor::from(self.tls.clone());
        let h = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let state = state.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let mut kill = state.kill_tx.subscribe();
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let cert_user = tls
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .map(|c| lock(&state.certs).get(c.as_ref()).cloned());
                    let st = state.clone();
                    let svc = hyper::service::service_fn(move |req| {
                        let st = st.clone();
                        let cu = cert_user.clone();
                        // An error closes the connection without an answer.
                        async move { handle(st, cu, req).await }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = kill.changed() => {}
                    }
                });
            }
        });
        *lock(&self.accept) = Some(h);
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// Writes a kubeconfig for this server into `dir` and returns its path.
    pub fn write_kubeconfig(
        &self,
        dir: &std::path::Path,
        token: &str,
    ) -> anyhow::Result<std::path::PathBuf> {
        std::fs::create_dir_all(dir)?;
        let ca = dir.join("ca.crt");
        std::fs::write(&ca, &self.pki.ca_pem)?;
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            kubeconfig_yaml(&self.url(), "ca.crt", &format!("token: {token}")),
        )?;
        Ok(path)
    }

    /// Writes a kubeconfig that authenticates with a fresh client certificate for `user`.
    pub fn write_cert_kubeconfig(
        &self,
        dir: &std::path::Path,
        user: &str,
    ) -> anyhow::Result<std::path::PathBuf> {
        std::fs::create_dir_all(dir)?;
        let cert = self.pki.client_cert(user, "system:nodes")?;
        let mut groups = Vec::new();
        if user.starts_with("system:node:") {
            groups.push("system:nodes".to_string());
        }
        groups.push("system:authenticated".to_string());
        lock(&self.state.certs).insert(
            cert.der.clone(),
            csr::CertIdentity {
                user: user.to_string(),
                groups,
                not_before: std::time::UNIX_EPOCH,
                not_after: std::time::SystemTime::now() + Duration::from_secs(10 * 365 * 86_400),
                credential_id: csr::credential_id(&cert.der),
            },
        );
        std::fs::write(dir.join("ca.crt"), &self.pki.ca_pem)?;
        std::fs::write(dir.join("client.crt"), &cert.cert_pem)?;
        std::fs::write(dir.join("client.key"), &cert.key_pem)?;
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            kubeconfig_yaml(
                &self.url(),
                "ca.crt",
                "client-certificate: client.crt\n    client-key: client.key",
            ),
        )?;
        Ok(path)
    }

    // ---- state manipulation, as the cloud side would do it ----

    /// Creates or replaces an object (kind and apiVersion are filled in), bumping the
    /// resourceVersion and emitting ADDED or MODIFIED. Returns the stored object.
    pub fn apply(&self, plural: &str, mut obj: Value) -> Value {
        let rt = resource_type(plural);
        let mut db = lock(&self.state.db);
        fill_type(&mut obj, rt);
        let key = key_of(rt, &obj);
        let prev = db.objects.get(&key).cloned();
        if obj.pointer("/metadata/uid").is_none() {
            let uid = prev
                .as_ref()
                .and_then(|p| p.pointer("/metadata/uid").cloned())
                .unwrap_or_else(|| Value::String(self.state.new_uid()));
            obj["metadata"]["uid"] = uid;
        }
        commit(&self.state, &mut db, rt, key, obj, prev)
    }

    /// Changes an existing object in place with `f`.
    pub fn modify(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Value {
        let mut obj = self
            .get(plural, namespace, name)
            .unwrap_or_else(|| panic!("no {plural} {namespace}/{name}"));
        f(&mut obj);
        self.apply(plural, obj)
    }

    /// Deletes an object at once, emitting DELETED.
    pub fn remove(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        let rt = resource_type(plural);
        let mut db = lock(&self.state.db);
        remove_locked(&self.state, &mut db, rt, namespace, name)
    }

    pub fn get(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.state.db)
            .objects
            .get(&(plural.to_string(), namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Waits for the object to satisfy `pred`, looking at it again at each write the server
    /// commits (no polling): `Ok` with the object, or, after `timeout`, `Err` with what it
    /// last was (`Null` when absent).
    pub async fn wait_for_object(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Result<Value, Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut writes = self.state.rv_tx.subscribe();
        loop {
            let now = self.get(plural, namespace, name).unwrap_or(Value::Null);
            if pred(&now) {
                return Ok(now);
            }
            match tokio::time::timeout_at(deadline, writes.changed()).await {
                Ok(Ok(())) => {}
                _ => return Err(now),
            }
        }
    }

    pub fn list(&self, plural: &str) -> Vec<Value> {
        lock(&self.state.db)
            .objects
            .iter()
            .filter(|((p, _, _), _)| p == plural)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Loads the items of a recorded list response (a fixture) as they are, keeping their
    /// resourceVersions, and moves the server's version past the list's.
    pub fn seed_list(&self, plural: &str, list: &Value) {
        let rt = resource_type(plural);
        let mut db = lock(&self.state.db);
        for item in list["items"].as_array().cloned().unwrap_or_default() {
            let mut obj = item;
            fill_type(&mut obj, rt);
            let key = key_of(rt, &obj);
            db.objects.insert(key, obj);
        }
        let list_rv: u64 = list
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        db.rv = db.rv.max(list_rv);
        self.state.rv_tx.send_replace(db.rv);
    }

    /// The recorded cluster of the fixtures: node edge-1, its two DaemonSet pods, the two
    /// DaemonSets and their first ControllerRevisions.
    pub fn seed_recorded_cluster(&self) {
        self.seed_list("pods", &crate::fixture_body("pods_list_node"));
        self.seed_list(
            "daemonsets",
            &crate::fixture_body("daemonsets_list_as_node"),
        );
        self.seed_list(
            "controllerrevisions",
            &crate::fixture_body("controllerrevisions_list_rev1"),
        );
        self.apply("nodes", crate::fixture_body("node_get_self"));
        // What the recorded pods reference: their ConfigMap, and the two CA bundles of the
        // projected token volume (the recording's apiserver is OpenShift's build).
        self.apply("configmaps", crate::fixture_body("configmap_get_as_node"));
        let ca = self.pki.ca_pem.clone();
        for (name, key) in [
            ("kube-root-ca.crt", "ca.crt"),
            ("openshift-service-ca.crt", "service-ca.crt"),
        ] {
            self.apply(
                "configmaps",
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": name, "namespace": "vehicle"},
                       "data": {key: ca}}),
            );
        }
    }

    /// Plays the fleet operator as the recording did: rolls the recorded `telemetry`
    /// DaemonSet to `127.0.0.1:5000/busybox:2.0` (a second ControllerRevision appears).
    pub fn roll_telemetry(&self) {
        for item in crate::fixture_body("controllerrevisions_list_rev2")["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            self.apply("controllerrevisions", item);
        }
        self.apply("daemonsets", crate::fixture_body("daemonset_after_update"));
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.state.db).rv
    }

    /// Forgets history up to now: watches and continue tokens from older versions get 410.
    pub fn compact(&self) {
        let mut db = lock(&self.state.db);
        db.compacted = db.rv;
        db.history.clear();
    }

    /// The cluster's objects and resourceVersion, as an etcd backup holds them.
    pub fn snapshot(&self) -> Snapshot {
        let db = lock(&self.state.db);
        Snapshot {
            rv: db.rv,
            objects: db.objects.clone(),
        }
    }

    /// An etcd restore from `snap`, as an operator does it: the objects and the
    /// resourceVersion go back to the backup's, and the apiserver restarts (every connection
    /// drops). Its new watch cache starts at the restored version, so older versions get 410
    /// and newer ones (a client's cursor from before the restore) are "too large".
    pub fn restore(&self, snap: &Snapshot) {
        {
            let mut db = lock(&self.state.db);
            db.objects = snap.objects.clone();
            db.rv = snap.rv;
            db.compacted = snap.rv;
            db.history.clear();
            self.state.rv_tx.send_replace(db.rv);
        }
        self.state.kill_tx.send_modify(|v| *v += 1);
    }

    // ---- knobs ----

    /// The next `n` requests whose path and query contain every string of `uri_contains` fail
    /// with `status`.
    pub fn fail_next(
        &self,
        n: usize,
        status: u16,
        retry_after: Option<u64>,
        uri_contains: &[&str],
    ) {
        let mut f = lock(&self.state.faults);
        for _ in 0..n {
            f.fail_next.push_back(Failure {
                status,
                retry_after,
                uri_contains: uri_contains.iter().map(|s| s.to_string()).collect(),
            });
        }
    }

    /// Forgets the failures [`Self::fail_next`] queued that no request has met yet.
    pub fn clear_failures(&self) {
        lock(&self.state.faults).fail_next.clear();
    }

    /// The next `n` requests with this method whose path and query contain every string of
    /// `uri_contains` are carried out (committed, watchers told) but get no answer: their
    /// connection is closed instead, as when the link drops after the apiserver's commit.
    pub fn lose_next_answers(&self, n: usize, method: &str, uri_contains: &[&str]) {
        self.lose_answers(n, method, uri_contains, false)
    }

    /// As [`Self::lose_next_answers`], once, and the server stalls from that moment (see
    /// [`Self::stall`]): the link stays down right after the write landed, before any watch
    /// could tell of it.
    pub fn lose_next_answer_and_stall(&self, method: &str, uri_contains: &[&str]) {
        self.lose_answers(1, method, uri_contains, true)
    }

    fn lose_answers(&self, n: usize, method: &str, uri_contains: &[&str], then_stall: bool) {
        let mut f = lock(&self.state.faults);
        for _ in 0..n {
            f.lose_answers.push_back(LostAnswer {
                method: method.to_string(),
                uri_contains: uri_contains.iter().map(|s| s.to_string()).collect(),
                then_stall,
            });
        }
    }

    /// The next `n` watch events are cut in the middle, ending their streams.
    pub fn cut_next_watch_events(&self, n: usize) {
        lock(&self.state.faults).cut_watch_events += n;
    }

    /// A malformed line is sent before each of the next `n` watch events.
    pub fn corrupt_next_watch_events(&self, n: usize) {
        lock(&self.state.faults).corrupt_watch_events += n;
    }

    /// While stalled, requests get no answer and watches send nothing.
    pub fn stall(&self, on: bool) {
        self.state.stalled.store(on, Ordering::SeqCst);
    }

    /// Requests that arrived while stalled and are waiting for their answer.
    pub fn held_requests(&self) -> u64 {
        self.state.held.load(Ordering::SeqCst)
    }

    /// Offline: the port refuses connections and open ones are dropped. Online: listen again
    /// on the same port.
    pub async fn set_offline(&self, offline: bool) -> anyhow::Result<()> {
        if offline {
            let handle = lock(&self.accept).take();
            if let Some(h) = handle {
                h.abort();
                let _ = h.await;
            }
            self.state.kill_tx.send_modify(|v| *v += 1);
        } else if lock(&self.accept).is_none() {
            let listener = TcpListener::bind(self.addr).await?;
            self.spawn_accept(listener);
        }
        Ok(())
    }

    /// Drops every open connection (watches included) without refusing new ones.
    pub fn drop_connections(&self) {
        self.state.kill_tx.send_modify(|v| *v += 1);
    }

    /// Whether the `edgehub` ClusterRole (deploy/rbac.yaml) is bound: without it a node gets
    /// 403 on daemonsets and controllerrevisions.
    /// Makes the Node authorizer lag: for `lag` after a pod is bound, the ConfigMaps and
    /// Secrets it references answer the recorded 403 (fixture
    /// `configmap_get_unreferenced_forbidden`).
    /// Issued service-account tokens are `len` bytes long, as a real bound token's JWT is
    /// (about 1 KB), for benchmarks that count what storing them costs.
    pub fn set_token_len(&self, len: usize) {
        self.state.token_len.store(len as u64, Ordering::SeqCst);
    }

    pub fn set_authorizer_lag(&self, lag: Duration) {
        self.state
            .authorizer_lag_ms
            .store(lag.as_millis() as u64, Ordering::SeqCst);
    }

    /// Requests seen, counted by (verb, resource), e.g. `("patch", "pods/status")`.
    pub fn count_by_verb(&self) -> BTreeMap<(String, String), usize> {
        let mut out = BTreeMap::new();
        for r in lock(&self.state.log).iter() {
            *out.entry((r.verb.to_string(), r.resource.clone()))
                .or_insert(0) += 1;
        }
        out
    }

    pub fn set_rbac_edgehub(&self, bound: bool) {
        self.state.rbac_edgehub.store(bound, Ordering::SeqCst);
    }

    pub fn set_bookmark_interval(&self, d: Duration) {
        self.state
            .bookmark_ms
            .store(d.as_millis().max(1) as u64, Ordering::SeqCst);
    }

    pub fn add_token(&self, token: &str, user: &str) {
        lock(&self.state.tokens).insert(token.into(), user.into());
    }

    /// The token no longer authenticates: every request with it gets the recorded 401
    /// (`unauthorized_bad_token`), as when a credential lapses. [`Self::add_token`] restores it.
    pub fn remove_token(&self, token: &str) {
        lock(&self.state.tokens).remove(token);
    }

    // ---- TLS bootstrap: bootstrap tokens, the CSR approver and signer ----

    /// Creates a bootstrap token (the `bootstrap-token-<id>` Secret): `Bearer <id>.<secret>`
    /// then authenticates as `system:bootstrap:<id>` until its expiration.
    pub fn add_bootstrap_token(&self, token: BootstrapToken) {
        lock(&self.state.csr).add_token(token);
    }

    /// The token's Secret is gone (the tokencleaner, or an operator): a plain 401.
    pub fn remove_bootstrap_token(&self, id: &str) {
        lock(&self.state.csr).remove_token(id);
    }

    /// Replaces the csrapproving stand-in with `approver` (called once per created CSR);
    /// `None` restores it. [`Approval::Pending`] for every CSR leaves approval to an external
    /// approver using the `/approval` subresource, as the attested-approval controller does.
    pub fn set_csr_approver(&self, approver: Option<Approver>) {
        lock(&self.state.csr).set_approver(approver);
    }

    /// Lets `user` (besides `admin`) approve and deny CSRs through `/approval`: RBAC's
    /// `update certificatesigningrequests/approval` and `approve` on the signer.
    pub fn allow_csr_approval(&self, user: &str) {
        lock(&self.state.csr).allow_approver(user);
    }

    /// Whether kubeadm's auto-approve bindings exist: `kubeadm:node-autoapprove-bootstrap`
    /// (`system:bootstrappers` → nodeclient) and `kubeadm:node-autoapprove-certificate-rotation`
    /// (`system:nodes` → selfnodeclient). Both are on by default, as the recording had them.
    pub fn set_csr_autoapprove_bindings(&self, bootstrap: bool, rotation: bool) {
        lock(&self.state.csr).set_bindings(bootstrap, rotation);
    }

    /// TEST ONLY, not a real apiserver behaviour: the signer issues certificates valid from
    /// `backdate` before signing to `valid_for` after it, whatever `expirationSeconds` says
    /// (the real minimum is 600 s, and the real backdate 5 minutes), so rotation tests run in
    /// seconds. `None` restores the real signer's window.
    pub fn set_test_only_certificate_window(&self, window: Option<TestOnlyCertWindow>) {
        lock(&self.state.csr).set_window(window);
    }

    /// The CertificateSigningRequests stored now.
    pub fn csrs(&self) -> Vec<Value> {
        self.list("certificatesigningrequests")
    }

    pub fn requests(&self) -> Vec<LoggedRequest> {
        lock(&self.state.log).clone()
    }

    pub fn count(&self, f: impl Fn(&LoggedRequest) -> bool) -> usize {
        lock(&self.state.log).iter().filter(|r| f(r)).count()
    }

    pub fn clear_log(&self) {
        lock(&self.state.log).clear();
    }
}

fn kubeconfig_yaml(server: &str, ca_file: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: edge\nclusters:\n- name: fake\n  cluster:\n    server: {server}\n    certificate-authority: {ca_file}\ncontexts:\n- name: edge\n  context:\n    cluster: fake\n    user: node\nusers:\n- name: node\n  user:\n    {user}\n"
    )
}

fn server_tls(pki: &TestPki) -> anyhow::Result<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(pki.ca_pem.as_bytes())?)?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()?;
    let verifier = Arc::new(csr::RequestClientCert(verifier));
    let chain = vec![CertificateDer::from_pem_slice(
        pki.server_cert_pem.as_bytes(),
    )?];
    let key = PrivateKeyDer::from_pem_slice(pki.server_key_pem.as_bytes())?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

impl State {
    fn new_uid(&self) -> String {
        let n = self.uid_counter.fetch_add(1, Ordering::Relaxed);
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let a = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            (a >> 32) as u32,
            (a >> 16) as u16,
            (a & 0xfff) as u16,
            (n & 0xfff) as u16,
            n
        )
    }
}

fn fill_type(obj: &mut Value, rt: &ResourceType) {
    if let Value::Object(m) = obj {
        let mut out = Map::new();
        out.insert("kind".into(), rt.kind.into());
        out.insert("apiVersion".into(), rt.api_version().into());
        for (k, v) in std::mem::take(m) {
            if k != "kind" && k != "apiVersion" {
                out.insert(k, v);
            }
        }
        *m = out;
    }
}

fn key_of(rt: &ResourceType, obj: &Value) -> (String, String, String) {
    let s = |p: &str| {
        obj.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    (
        rt.plural.to_string(),
        if rt.namespaced {
            s("/metadata/namespace")
        } else {
            String::new()
        },
        s("/metadata/name"),
    )
}

/// Stores `obj` at a new resourceVersion and records the event.
fn commit(
    state: &State,
    db: &mut Db,
    rt: &'static ResourceType,
    key: (String, String, String),
    mut obj: Value,
    prev: Option<Value>,
) -> Value {
    db.rv += 1;
    obj["metadata"]["resourceVersion"] = db.rv.to_string().into();
    if obj.pointer("/metadata/creationTimestamp").is_none() {
        obj["metadata"]["creationTimestamp"] = now_rfc3339().into();
    }
    if obj.pointer("/metadata/uid").is_none() {
        obj["metadata"]["uid"] = state.new_uid().into();
    }
    if rt.plural == "pods" {
        pod_status_defaults(&mut obj);
        if obj
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .is_some()
        {
            let uid = obj["metadata"]["uid"].as_str().unwrap_or("").to_string();
            db.bound_at
                .entry(uid)
                .or_insert_with(std::time::Instant::now);
        }
    }
    db.objects.insert(key, obj.clone());
    db.history.push(Event {
        rv: db.rv,
        kind: if prev.is_some() { "MODIFIED" } else { "ADDED" },
        plural: rt.plural,
        object: obj.clone(),
        prev,
    });
    // Watchers wake up and take the db lock after the caller releases it.
    state.rv_tx.send_replace(db.rv);
    obj
}

/// What the apiserver's Go types write for a pod status whatever the client sent: a
/// condition's unset times are `null`, a container status always has `state`, `lastState`,
/// `ready`, `restartCount`, `image` and `imageID`. A client that compares the status it wants
/// with the one it reads back must expect these.
fn pod_status_defaults(pod: &mut Value) {
    let Some(status) = pod.get_mut("status").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(Value::Array(conds)) = status.get_mut("conditions") {
        for c in conds.iter_mut().filter_map(Value::as_object_mut) {
            c.entry("lastProbeTime").or_insert(Value::Null);
            c.entry("lastTransitionTime").or_insert(Value::Null);
        }
    }
    for list in [
        "containerStatuses",
        "initContainerStatuses",
        "ephemeralContainerStatuses",
    ] {
        if let Some(Value::Array(cs)) = status.get_mut(list) {
            for c in cs.iter_mut().filter_map(Value::as_object_mut) {
                for (k, default) in [
                    ("state", json!({})),
                    ("lastState", json!({})),
                    ("ready", json!(false)),
                    ("restartCount", json!(0)),
                    ("image", json!("")),
                    ("imageID", json!("")),
                ] {
                    c.entry(k).or_insert(default);
                }
                for st in ["state", "lastState"] {
                    if let Some(Value::Object(m)) = c.get_mut(st) {
                        if let Some(Value::Object(r)) = m.get_mut("running") {
                            r.entry("startedAt").or_insert(Value::Null);
                        }
                        if let Some(Value::Object(t)) = m.get_mut("terminated") {
                            t.entry("startedAt").or_insert(Value::Null);
                            t.entry("finishedAt").or_insert(Value::Null);
                        }
                    }
                }
            }
        }
    }
}

/// The apiserver's pod status validation that a node's patches can trip: at most one IP per
/// family in `podIPs` and `hostIPs` (fixture `pod_status_patch_new_ip_merged_invalid`).
fn invalid_pod_ips(name: &str, pod: &Value) -> Option<Response<Body>> {
    for field in ["podIPs", "hostIPs"] {
        let Some(ips) = pod
            .pointer(&format!("/status/{field}"))
            .and_then(Value::as_array)
        else {
            continue;
        };
        let addrs: Vec<&str> = ips.iter().filter_map(|i| i["ip"].as_str()).collect();
        let v6 = addrs.iter().filter(|a| a.contains(':')).count();
        if v6 > 1 || addrs.len() - v6 > 1 {
            let value = format!(
                "[{}]",
                addrs
                    .iter()
                    .map(|a| format!("{{\"IP\":\"{a}\"}}"))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let msg = format!(
                "Invalid value: {value}: may specify no more than one IP for each IP family"
            );
            return Some(status(
                422,
                "Invalid",
                &format!("Pod \"{name}\" is invalid: status.{field}: {msg}"),
                Some(json!({"name": name, "kind": "Pod", "causes": [
                    {"reason": "FieldValueInvalid", "message": msg, "field": format!("status.{field}")}]})),
            ));
        }
    }
    None
}

fn remove_locked(
    state: &State,
    db: &mut Db,
    rt: &'static ResourceType,
    namespace: &str,
    name: &str,
) -> Option<Value> {
    let key = (
        rt.plural.to_string(),
        if rt.namespaced {
            namespace.to_string()
        } else {
            String::new()
        },
        name.to_string(),
    );
    let mut obj = db.objects.remove(&key)?;
    db.rv += 1;
    obj["metadata"]["resourceVersion"] = db.rv.to_string().into();
    db.history.push(Event {
        rv: db.rv,
        kind: "DELETED",
        plural: rt.plural,
        object: obj.clone(),
        prev: Some(obj.clone()),
    });
    state.rv_tx.send_replace(db.rv);
    Some(obj)
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// RFC 3339 UTC time of now.
pub fn now_rfc3339() -> String {
    rfc3339(unix_now())
}

/// RFC 3339 UTC time of a unix time, without pulling in a date crate.
pub fn rfc3339(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

// ---------------------------------------------------------------------------------------------
// Request handling

struct Route {
    rt: &'static ResourceType,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(path: &str) -> Option<Route> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        rest => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(n.to_string()), None),
        [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
        _ => return None,
    };
    let rt = RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.plural == plural)?;
    if namespace.is_some() && !rt.namespaced {
        return None;
    }
    Some(Route {
        rt,
        namespace,
        name,
        sub,
    })
}

fn parse_query(q: Option<&str>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let dec = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        };
        out.insert(dec(k), dec(v));
    }
    out
}

fn full(code: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", content_type)
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .unwrap_or_else(|_| {
            Response::new(
                Full::new(Bytes::new())
                    .map_err(|never| match never {})
                    .boxed(),
            )
        })
}

fn json_response(code: u16, v: &Value) -> Response<Body> {
    full(
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        "application/json",
        serde_json::to_vec(v).unwrap_or_default(),
    )
}

/// A Status body in the apiserver's field order.
pub fn status_body(code: u16, reason: &str, message: &str, details: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert("kind".into(), "Status".into());
    m.insert("apiVersion".into(), "v1".into());
    m.insert("metadata".into(), json!({}));
    m.insert("status".into(), "Failure".into());
    m.insert("message".into(), message.into());
    m.insert("reason".into(), reason.into());
    if let Some(d) = details {
        m.insert("details".into(), d);
    }
    m.insert("code".into(), code.into());
    Value::Object(m)
}

fn status(code: u16, reason: &str, message: &str, details: Option<Value>) -> Response<Body> {
    json_response(code, &status_body(code, reason, message, details))
}

/// What a handler returns to close its connection instead of answering.
#[derive(Debug)]
struct AnswerLost;

impl std::fmt::Display for AnswerLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the answer was lost (injected)")
    }
}

impl std::error::Error for AnswerLost {}

async fn handle(
    state: Arc<State>,
    cert_user: Option<Option<csr::CertIdentity>>,
    req: Request<Incoming>,
) -> Result<Response<Body>, AnswerLost> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let uri = req.uri().to_string();
    let at = std::time::Instant::now();
    let query = parse_query(req.uri().query());
    let bearer = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string());
    // A bearer token is tried first, then the client certificate, as the apiserver's union
    // authenticator does; a certificate the fake did not issue, or one outside its validity,
    // authenticates no one (401), as the x509 authenticator answers.
    let token_caller = bearer.as_deref().and_then(|t| {
        let static_user = lock(&state.tokens).get(t).cloned();
        match static_user {
            Some(u) => Some(csr::token_caller(&u)),
            None => csr::bootstrap_caller(&state, t),
        }
    });
    let caller = token_caller.or_else(|| cert_user.flatten().as_ref().and_then(csr::cert_caller));
    let user = caller.as_ref().map(|c| c.user.clone());
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };

    if state.stalled.load(Ordering::SeqCst) {
        // Counted down on drop too: a client that gives up drops this future mid-wait.
        struct Held<'a>(&'a AtomicU64);
        impl Drop for Held<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        state.held.fetch_add(1, Ordering::SeqCst);
        let _held = Held(&state.held);
        while state.stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let lost = {
        let mut f = lock(&state.faults);
        let pos = f.lose_answers.iter().position(|l| {
            l.method == method.as_str() && l.uri_contains.iter().all(|p| uri.contains(p.as_str()))
        });
        pos.and_then(|i| f.lose_answers.remove(i))
    };
    if lost.as_ref().is_some_and(|l| l.then_stall) {
        // Before the write commits: no watch may tell of it (they read the history under
        // the same lock the write takes, and look at this flag there).
        state.stalled.store(true, Ordering::SeqCst);
    }

    let resp = route(
        &state,
        caller.as_ref(),
        &method,
        &uri,
        &path,
        &query,
        &content_type,
        &body,
    )
    .await;
    let (verb, resource) = match parse_path(&path) {
        Some(r) => (
            verb(&method, &r, &query),
            match &r.sub {
                Some(sub) => format!("{}/{sub}", r.rt.plural),
                None => r.rt.plural.to_string(),
            },
        ),
        None => ("unknown", String::new()),
    };
    lock(&state.log).push(LoggedRequest {
        verb,
        resource,
        method: method.to_string(),
        path,
        query,
        user,
        status: resp.status().as_u16(),
        answer_lost: lost.is_some(),
        at,
    });
    match lost {
        Some(_) => Err(AnswerLost),
        None => Ok(resp),
    }
}

#[allow(clippy::too_many_arguments)]
async fn route(
    state: &Arc<State>,
    caller: Option<&csr::Caller>,
    method: &Method,
    uri: &str,
    path: &str,
    query: &BTreeMap<String, String>,
    content_type: &str,
    body: &[u8],
) -> Response<Body> {
    let Some(caller) = caller else {
        return status(401, "Unauthorized", "Unauthorized", None);
    };
    let user = caller.user.as_str();
    let injected = {
        let mut f = lock(&state.faults);
        let pos = f
            .fail_next
            .iter()
            .position(|x| x.uri_contains.iter().all(|p| uri.contains(p.as_str())));
        pos.and_then(|i| f.fail_next.remove(i))
    };
    if let Some(fail) = injected {
        let (reason, message) = match fail.status {
            429 => ("TooManyRequests", "Too many requests, please try again later."),
            410 => ("Expired", "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue value from the response to retrieve the remainder of the results."),
            503 => ("ServiceUnavailable", "The server is currently unable to handle the request"),
            _ => ("InternalError", "Internal error occurred: injected failure"),
        };
        let mut resp = status(fail.status, reason, message, None);
        if let Some(ra) = fail.retry_after {
            if let Ok(v) = hyper::header::HeaderValue::from_str(&ra.to_string()) {
                resp.headers_mut().insert("retry-after", v);
            }
        }
        return resp;
    }
    if method == Method::POST && path == "/apis/authentication.k8s.io/v1/selfsubjectreviews" {
        return csr::self_subject_review(caller);
    }
    let Some(route) = parse_path(path) else {
        return status(
            404,
            "NotFound",
            "the server could not find the requested resource",
            None,
        );
    };
    let v = verb(method, &route, query);
    if let Some(denied) = csr::bootstrap_forbidden(caller, v, &route) {
        return denied;
    }
    if route.rt.plural == csr::CSR.plural {
        if let Some(answer) = csr::handle(state, caller, v, method, &route, body) {
            return answer;
        }
    }
    if let Some(denied) = authorize(state, user, method, &route, query, body) {
        return denied;
    }
    let rt = route.rt;
    match (method, route.name.as_deref(), route.sub.as_deref()) {
        (&Method::GET, None, None) => {
            if matches!(query.get("watch").map(String::as_str), Some("1" | "true")) {
                watch(state, rt, route.namespace, query)
            } else if let Some(too_large) = list_from_the_future(state, query).await {
                too_large
            } else {
                list(state, rt, route.namespace.as_deref(), query)
            }
        }
        (&Method::GET, Some(name), None) => get(state, rt, route.namespace.as_deref(), name),
        (&Method::POST, None, None) => create(state, rt, route.namespace.as_deref(), body),
        (&Method::POST, Some(sa), Some("token")) => {
            token_request(state, user, route.namespace.as_deref(), sa, body)
        }
        (&Method::PUT, Some(name), None) => {
            update(state, rt, route.namespace.as_deref(), name, body)
        }
        (&Method::PATCH, Some(name), sub @ (None | Some("status"))) => patch(
            state,
            rt,
            route.namespace.as_deref(),
            name,
            sub.is_some(),
            content_type,
            body,
        ),
        (&Method::DELETE, Some(name), None) => {
            delete(state, rt, route.namespace.as_deref(), name, body)
        }
        _ => status(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
            None,
        ),
    }
}

fn node_of(user: &str) -> Option<&str> {
    user.strip_prefix("system:node:")
}

fn verb(method: &Method, route: &Route, query: &BTreeMap<String, String>) -> &'static str {
    match (method, route.name.is_some()) {
        (&Method::GET, false)
            if matches!(query.get("watch").map(String::as_str), Some("1" | "true")) =>
        {
            "watch"
        }
        (&Method::GET, false) => "list",
        (&Method::GET, true) => "get",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, _) => "delete",
        _ => "unknown",
    }
}

fn forbidden(user: &str, verb: &str, route: &Route, suffix: &str) -> Response<Body> {
    let rt = route.rt;
    let subject = match &route.name {
        Some(n) => format!("{} \"{n}\"", rt.qualified()),
        None => rt.qualified(),
    };
    let scope = match &route.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".into(),
    };
    let mut details = Map::new();
    if let Some(n) = &route.name {
        details.insert("name".into(), n.clone().into());
    }
    if !rt.group.is_empty() {
        details.insert("group".into(), rt.group.into());
    }
    details.insert("kind".into(), rt.plural.into());
    status(
        403,
        "Forbidden",
        &format!(
            "{subject} is forbidden: User \"{user}\" cannot {verb} resource \"{}\" in API group \"{}\" {scope}{suffix}",
            rt.plural, rt.group
        ),
        Some(Value::Object(details)),
    )
}

/// Whether a pod references ConfigMap or Secret `name`: the Node authorizer's graph edges.
fn pod_references(pod: &Value, plural: &str, name: &str) -> bool {
    let is = |v: Option<&Value>| v.and_then(Value::as_str) == Some(name);
    let arr = |v: &Value, p: &str| -> Vec<Value> {
        v.pointer(p)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (vol, proj, key_ref, env_from) = if plural == "secrets" {
        (
            "/secret/secretName",
            "/secret/name",
            "/valueFrom/secretKeyRef/name",
            "/secretRef/name",
        )
    } else {
        (
            "/configMap/name",
            "/configMap/name",
            "/valueFrom/configMapKeyRef/name",
            "/configMapRef/name",
        )
    };
    arr(pod, "/spec/volumes").iter().any(|v| {
        is(v.pointer(vol))
            || arr(v, "/projected/sources")
                .iter()
                .any(|s| is(s.pointer(proj)))
    }) || ["/spec/containers", "/spec/initContainers"]
        .iter()
        .any(|list| {
            arr(pod, list).iter().any(|c| {
                arr(c, "/env").iter().any(|e| is(e.pointer(key_ref)))
                    || arr(c, "/envFrom").iter().any(|e| is(e.pointer(env_from)))
            })
        })
        || (plural == "secrets"
            && arr(pod, "/spec/imagePullSecrets")
                .iter()
                .any(|s| is(s.get("name"))))
}

/// The Node authorizer and NodeRestriction, for the requests the fixtures recorded.
fn authorize(
    state: &State,
    user: &str,
    method: &Method,
    route: &Route,
    query: &BTreeMap<String, String>,
    body: &[u8],
) -> Option<Response<Body>> {
    let node = node_of(user)?;
    let v = verb(method, route, query);
    let rt = route.rt;
    match rt.plural {
        "daemonsets" | "controllerrevisions" => {
            let read = matches!(v, "get" | "list" | "watch");
            if !read || !state.rbac_edgehub.load(Ordering::SeqCst) {
                return Some(forbidden(user, v, route, ""));
            }
        }
        "events" => {
            // A node may create and patch Events but never read them, not even its own
            // (fixtures `event_get_forbidden_as_node`, `events_list_forbidden_as_node`): an
            // Event series lives in its sender's own records.
            if matches!(v, "get" | "list" | "watch") {
                return Some(forbidden(user, v, route, ""));
            }
        }
        "secrets" | "configmaps" => {
            // A list or watch narrowed to one name by `fieldSelector=metadata.name=<name>` is
            // authorized as a read of that object, as the apiserver's request info does: the
            // kubelet's watch-based ConfigMap and Secret managers rely on it.
            let by_selector = query
                .get("fieldSelector")
                .and_then(|f| f.strip_prefix("metadata.name="))
                .filter(|n| !n.is_empty() && !n.contains(','));
            let named;
            let route = match (&route.name, by_selector) {
                (None, Some(n)) if matches!(v, "list" | "watch") => {
                    named = Route {
                        rt: route.rt,
                        namespace: route.namespace.clone(),
                        name: Some(n.to_string()),
                        sub: None,
                    };
                    &named
                }
                _ => route,
            };
            let Some(name) = &route.name else {
                return Some(forbidden(user, v, route, ": No Object name found"));
            };
            let ns = route.namespace.clone().unwrap_or_default();
            let lag = Duration::from_millis(state.authorizer_lag_ms.load(Ordering::SeqCst));
            let db = lock(&state.db);
            let related = matches!(v, "get" | "list" | "watch")
                && db.objects.iter().any(|((plural, pns, _), p)| {
                    plural == "pods"
                        && *pns == ns
                        && p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node)
                        && pod_references(p, rt.plural, name)
                        && p.pointer("/metadata/uid")
                            .and_then(Value::as_str)
                            .and_then(|u| db.bound_at.get(u))
                            .is_none_or(|at| at.elapsed() >= lag)
                });
            if !related {
                return Some(forbidden(
                    user,
                    v,
                    route,
                    &format!(": no relationship found between node '{node}' and this object"),
                ));
            }
        }
        "pods" => {
            if let Some(name) = &route.name {
                let ns = route.namespace.clone().unwrap_or_default();
                let bound = lock(&state.db)
                    .objects
                    .get(&("pods".into(), ns, name.clone()))
                    .and_then(|p| {
                        p.pointer("/spec/nodeName")
                            .and_then(Value::as_str)
                            .map(|n| n == node)
                    })
                    .unwrap_or(false);
                if !bound {
                    return Some(forbidden(
                        user,
                        v,
                        route,
                        &format!(": no relationship found between node '{node}' and this object"),
                    ));
                }
                if v == "patch" && route.sub.is_none() {
                    return Some(forbidden(user, v, route, ""));
                }
            }
        }
        "nodes" => {
            let target = match &route.name {
                Some(n) => Some(n.clone()),
                None if v == "create" => serde_json::from_slice::<Value>(body).ok().and_then(|b| {
                    b.pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                }),
                None => None,
            };
            if matches!(v, "create" | "update" | "patch" | "delete") {
                if let Some(t) = target {
                    if t != node {
                        return Some(status(
                            403,
                            "Forbidden",
                            &format!("nodes \"{t}\" is forbidden: node \"{node}\" is not allowed to modify node \"{t}\""),
                            Some(json!({"name": t, "kind": "nodes"})),
                        ));
                    }
                    let labels: Vec<String> = serde_json::from_slice::<Value>(body)
                        .ok()
                        .and_then(|b| {
                            b.pointer("/metadata/labels")
                                .and_then(Value::as_object)
                                .cloned()
                        })
                        .map(|m| {
                            m.keys()
                                .filter(|k| k.starts_with("node-role.kubernetes.io/"))
                                .cloned()
                                .collect()
                        })
                        .unwrap_or_default();
                    if !labels.is_empty() {
                        return Some(status(
                            403,
                            "Forbidden",
                            &format!(
                                "nodes \"{t}\" is forbidden: node \"{node}\" is not allowed to set the following labels: {}",
                                labels.join(", ")
                            ),
                            Some(json!({"name": t, "kind": "nodes"})),
                        ));
                    }
                }
            }
        }
        _ => {}
    }
    None
}

/// A parsed selector: conjunction of requirements.
#[derive(Debug, Clone, Default)]
struct Selector(Vec<Req>);

#[derive(Debug, Clone)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

fn split_top(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0);
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn parse_selector(s: &str) -> Result<Selector, String> {
    let mut reqs = Vec::new();
    for part in split_top(s) {
        let set = |p: &str, op: &str| -> Option<(String, Vec<String>)> {
            let (k, rest) = p.split_once(op)?;
            let vals = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
            Some((
                k.trim().to_string(),
                vals.split(',').map(|v| v.trim().to_string()).collect(),
            ))
        };
        let r = if let Some((k, v)) = part.split_once("!=") {
            Req::Ne(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once("==") {
            Req::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = part.split_once('=') {
            Req::Eq(k.trim().into(), v.trim().into())
        } else if let Some((k, vs)) = set(&part, " notin ") {
            Req::NotIn(k, vs)
        } else if let Some((k, vs)) = set(&part, " in ") {
            Req::In(k, vs)
        } else if let Some(k) = part.strip_prefix('!') {
            Req::NotExists(k.trim().into())
        } else if part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._/".contains(c))
        {
            Req::Exists(part)
        } else {
            return Err(format!("unable to parse requirement: {part:?}"));
        };
        reqs.push(r);
    }
    Ok(Selector(reqs))
}

impl Selector {
    fn matches(&self, get: impl Fn(&str) -> Option<String>) -> bool {
        self.0.iter().all(|r| match r {
            Req::Eq(k, v) => get(k).as_deref() == Some(v.as_str()),
            Req::Ne(k, v) => get(k).as_deref() != Some(v.as_str()),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Req::NotIn(k, vs) => get(k).is_none_or(|x| !vs.contains(&x)),
        })
    }
}

const FIELDS: &[(&str, &str)] = &[
    ("metadata.name", "/metadata/name"),
    ("metadata.namespace", "/metadata/namespace"),
    ("spec.nodeName", "/spec/nodeName"),
    // CertificateSigningRequests' own selectable field (kubectl get csr --field-selector
    // spec.signerName=...), as the attested approver watches them.
    ("spec.signerName", "/spec/signerName"),
];

struct Filter {
    namespace: Option<String>,
    fields: Selector,
    labels: Selector,
}

impl Filter {
    fn from_query(
        namespace: Option<String>,
        rt: &ResourceType,
        q: &BTreeMap<String, String>,
    ) -> Result<Filter, Reject> {
        let bad = |m: String| Box::new(status(400, "BadRequest", &m, None));
        let fields = parse_selector(q.get("fieldSelector").map(String::as_str).unwrap_or(""))
            .map_err(bad)?;
        for r in &fields.0 {
            let (Req::Eq(k, _) | Req::Ne(k, _)) = r else {
                return Err(bad("field selectors support only =, == and !=".into()));
            };
            if !FIELDS.iter().any(|(f, _)| f == k)
                || (k == "spec.nodeName" && rt.plural != "pods")
                || (k == "spec.signerName" && rt.plural != "certificatesigningrequests")
            {
                return Err(bad(format!("field label not supported: {k}")));
            }
        }
        let labels = parse_selector(q.get("labelSelector").map(String::as_str).unwrap_or(""))
            .map_err(bad)?;
        Ok(Filter {
            namespace,
            fields,
            labels,
        })
    }

    fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace {
            if obj.pointer("/metadata/namespace").and_then(Value::as_str) != Some(ns) {
                return false;
            }
        }
        self.fields.matches(|k| {
            let p = FIELDS.iter().find(|(f, _)| *f == k)?.1;
            Some(
                obj.pointer(p)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
            )
        }) && self.labels.matches(|k| {
            obj.pointer("/metadata/labels")
                .and_then(|l| l.get(k))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
    }
}

fn strip_type(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Value::Object(m) = &mut o {
        // shift_remove keeps the apiserver's field order (remove would swap fields).
        m.shift_remove("kind");
        m.shift_remove("apiVersion");
    }
    o
}

/// How long the apiserver's watch cache waits for a resourceVersion it does not have yet
/// (`blockTimeout` in k8s.io/apiserver's watch_cache.go).
const BLOCK_TIMEOUT: Duration = Duration::from_secs(3);

/// The Status of `storage.NewTooLargeResourceVersionError(asked, current, retry)`: an
/// apimachinery Timeout error with the `ResourceVersionTooLarge` cause.
fn too_large_body(asked: u64, current: u64, retry_secs: u32) -> Value {
    status_body(
        504,
        "Timeout",
        &format!("Timeout: Too large resource version: {asked}, current: {current}"),
        Some(json!({
            "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
            "retryAfterSeconds": retry_secs,
        })),
    )
}

/// Waits up to [`BLOCK_TIMEOUT`] for the server to reach `asked`; returns the version it has.
async fn wait_fresh(state: &State, asked: u64) -> u64 {
    let mut rv = state.rv_tx.subscribe();
    let deadline = tokio::time::Instant::now() + BLOCK_TIMEOUT;
    loop {
        let current = lock(&state.db).rv;
        if current >= asked {
            return current;
        }
        tokio::select! {
            r = rv.changed() => if r.is_err() { return current; },
            _ = tokio::time::sleep_until(deadline) => return current,
        }
    }
}

/// A list asking for a resourceVersion the server does not have yet, answered as the real
/// apiserver answers it (k8s.io/apiserver v1.36: cacher/delegator.go, watch_cache.go,
/// etcd3/store.go): `NotOlderThan` (or a version without a match or a limit) is served from
/// the watch cache, which waits 3 s for the version and then answers 504 with
/// `retryAfterSeconds: 1` (and the Retry-After header the response writer derives from it);
/// `Exact` (or a version with a limit and no match) goes to etcd, whose "future revision"
/// is the same 504 at once, with no retry hint. `None`: an ordinary list.
async fn list_from_the_future(
    state: &State,
    q: &BTreeMap<String, String>,
) -> Option<Response<Body>> {
    let asked: u64 = q
        .get("resourceVersion")
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)?;
    if q.get("continue").is_some_and(|c| !c.is_empty()) {
        return None;
    }
    let exact = match q.get("resourceVersionMatch").map(String::as_str) {
        Some("Exact") => true,
        Some("NotOlderThan") => false,
        _ => q.get("limit").is_some_and(|l| l != "0"),
    };
    let current = lock(&state.db).rv;
    if current >= asked {
        return None;
    }
    if exact {
        return Some(json_response(504, &too_large_body(asked, current, 0)));
    }
    let current = wait_fresh(state, asked).await;
    if current >= asked {
        return None;
    }
    let mut resp = json_response(504, &too_large_body(asked, current, 1));
    resp.headers_mut()
        .insert("retry-after", hyper::header::HeaderValue::from_static("1"));
    Some(resp)
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    v: String,
    rv: u64,
    start: String,
}

fn list(
    state: &State,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    q: &BTreeMap<String, String>,
) -> Response<Body> {
    let filter = match Filter::from_query(namespace.map(str::to_string), rt, q) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let db = lock(&state.db);
    if q.get("resourceVersionMatch").map(String::as_str) == Some("Exact") {
        let asked: u64 = q
            .get("resourceVersion")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if asked < db.compacted {
            return status(
                410,
                "Expired",
                "The resourceVersion for the provided list is too old.",
                None,
            );
        }
    }
    let limit: usize = q
        .get("limit")
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(usize::MAX);
    let start = match q.get("continue").filter(|c| !c.is_empty()) {
        None => None,
        Some(c) => {
            let tok = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(c)
                .ok()
                .and_then(|b| serde_json::from_slice::<ContinueToken>(&b).ok());
            match tok {
                None => return status(400, "BadRequest", "continue key is not valid: illegal base64 data", None),
                Some(t) if t.rv < db.compacted => {
                    return status(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue value from the response to retrieve the remainder of the results.",
                        None,
                    )
                }
                Some(t) => Some(t.start),
            }
        }
    };
    let mut items = Vec::new();
    let mut next = None;
    let mut more = false;
    for ((p, ns, name), obj) in &db.objects {
        if p != rt.plural || !filter.matches(obj) {
            continue;
        }
        let k = if ns.is_empty() {
            format!("/{name}")
        } else {
            format!("/{ns}/{name}")
        };
        if start.as_ref().is_some_and(|s| k.as_str() < s.as_str()) {
            continue;
        }
        if items.len() == limit {
            more = true;
            break;
        }
        // As the real apiserver does: the next page starts just after the last key sent.
        next = Some(format!("{k}\u{0}"));
        items.push(strip_type(obj));
    }
    let mut meta = Map::new();
    meta.insert("resourceVersion".into(), db.rv.to_string().into());
    if let Some(start) = next.filter(|_| more) {
        let tok = serde_json::to_vec(&ContinueToken {
            v: "meta.k8s.io/v1".into(),
            rv: db.rv,
            start,
        })
        .unwrap_or_default();
        meta.insert(
            "continue".into(),
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(tok)
                .into(),
        );
    }
    let mut out = Map::new();
    out.insert("kind".into(), format!("{}List", rt.kind).into());
    out.insert("apiVersion".into(), rt.api_version().into());
    out.insert("metadata".into(), Value::Object(meta));
    out.insert("items".into(), Value::Array(items));
    json_response(200, &Value::Object(out))
}

fn get(
    state: &State,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
) -> Response<Body> {
    let key = (
        rt.plural.to_string(),
        namespace.unwrap_or("").to_string(),
        name.to_string(),
    );
    match lock(&state.db).objects.get(&key) {
        Some(o) => json_response(200, o),
        None => not_found(rt, name),
    }
}

fn not_found(rt: &ResourceType, name: &str) -> Response<Body> {
    let mut details = Map::new();
    details.insert("name".into(), name.into());
    if !rt.group.is_empty() {
        details.insert("group".into(), rt.group.into());
    }
    details.insert("kind".into(), rt.plural.into());
    status(
        404,
        "NotFound",
        &format!("{} \"{name}\" not found", rt.qualified()),
        Some(Value::Object(details)),
    )
}

fn parse_body(body: &[u8]) -> Result<Value, Reject> {
    serde_json::from_slice::<Value>(body)
        .ok()
        .filter(Value::is_object)
        .ok_or_else(|| {
            Box::new(status(
                400,
                "BadRequest",
                "the request body is not a JSON object",
                None,
            ))
        })
}

fn create(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    body: &[u8],
) -> Response<Body> {
    let mut obj = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    fill_type(&mut obj, rt);
    if let (Some(ns), true) = (namespace, rt.namespaced) {
        obj["metadata"]["namespace"] = ns.into();
    }
    if obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .is_empty()
    {
        return status(
            422,
            "Invalid",
            &format!(
                "{} \"\" is invalid: metadata.name: Required value: name is required",
                rt.kind
            ),
            None,
        );
    }
    let key = key_of(rt, &obj);
    let mut db = lock(&state.db);
    if db.objects.contains_key(&key) {
        return status(
            409,
            "AlreadyExists",
            &format!("{} \"{}\" already exists", rt.qualified(), key.2),
            Some(json!({"name": key.2, "kind": rt.plural})),
        );
    }
    obj["metadata"]["uid"] = state.new_uid().into();
    obj["metadata"]["creationTimestamp"] = now_rfc3339().into();
    if rt.plural == "pods" {
        admit_service_account(&mut obj);
    }
    if rt.plural == "nodes" {
        // What the apiserver's Go types write for a Node created without them (fixture
        // `node_create_with_issued_cert`).
        if let Value::Object(m) = &mut obj {
            m.entry("spec").or_insert(json!({}));
            let st = m.entry("status").or_insert(json!({}));
            if let Value::Object(st) = st {
                st.entry("daemonEndpoints")
                    .or_insert(json!({"kubeletEndpoint": {"Port": 0}}));
                st.entry("nodeInfo").or_insert(json!({"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "", "kubeletVersion": "", "kubeProxyVersion": "", "operatingSystem": "", "architecture": ""}));
            }
        }
    }
    if rt.plural == "events" {
        // The apiserver's defaults for core/v1 Events.
        if let Value::Object(m) = &mut obj {
            m.entry("eventTime").or_insert(Value::Null);
            m.entry("reportingComponent").or_insert("".into());
            m.entry("reportingInstance").or_insert("".into());
        }
    }
    let out = commit(state, &mut db, rt, key, obj, None);
    json_response(201, &out)
}

/// The ServiceAccount admission plugin, as the recorded replacement pod shows it
/// (fixture `pods_list_after_delete`): a pod created without a token volume gets
/// `kube-api-access-<5 random characters>` (token, CA bundle, namespace) mounted read-only
/// in every container, unless `automountServiceAccountToken` is false. Run on every pod
/// created through the API; objects a test puts in place with `apply` are stored as given.
pub fn admit_service_account(pod: &mut Value) {
    const MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
    let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    if spec.get("automountServiceAccountToken") == Some(&Value::Bool(false)) {
        return;
    }
    let has_token = |v: &Value| {
        v.pointer("/projected/sources")
            .and_then(Value::as_array)
            .is_some_and(|s| s.iter().any(|s| s.get("serviceAccountToken").is_some()))
    };
    let volumes = spec.entry("volumes").or_insert_with(|| json!([]));
    let Some(list) = volumes.as_array_mut() else {
        return;
    };
    if list.iter().any(has_token) {
        return;
    }
    // The apiserver's name generator's alphabet (no vowels, no look-alikes).
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = NAME_SEQ.fetch_add(1, Ordering::SeqCst) * 7919 + 104_729;
    let suffix: String = (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
            n /= ALPHABET.len() as u64;
            c
        })
        .collect();
    let name = format!("kube-api-access-{suffix}");
    list.push(json!({"name": name, "projected": {"sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
    ], "defaultMode": 420}}));
    for kind in ["initContainers", "containers"] {
        for c in spec
            .get_mut(kind)
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            let mounts = c
                .as_object_mut()
                .map(|c| c.entry("volumeMounts").or_insert_with(|| json!([])));
            if let Some(Value::Array(m)) = mounts {
                if !m.iter().any(|m| m["mountPath"] == MOUNT) {
                    m.push(json!({"name": name, "readOnly": true, "mountPath": MOUNT}));
                }
            }
        }
    }
    spec.entry("serviceAccountName")
        .or_insert_with(|| json!("default"));
    spec.entry("serviceAccount")
        .or_insert_with(|| json!("default"));
}

/// Feeds the token volumes' name suffixes.
static NAME_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn token_request(
    state: &Arc<State>,
    user: &str,
    namespace: Option<&str>,
    sa: &str,
    body: &[u8],
) -> Response<Body> {
    let req = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let pod = req
        .pointer("/spec/boundObjectRef/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let ns = namespace.unwrap_or("");
    if !lock(&state.db)
        .objects
        .contains_key(&("pods".into(), ns.into(), pod.into()))
    {
        return status(
            404,
            "NotFound",
            &format!("pod \"{pod}\" not found"),
            Some(json!({"name": pod, "kind": "pod"})),
        );
    }
    // NodeRestriction: a node may only ask for audiences its pods' volumes name; the test
    // pods name none.
    let audiences = req
        .pointer("/spec/audiences")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if let (Some(_), Some(aud)) = (node_of(user), audiences.first().and_then(Value::as_str)) {
        return status(
            403,
            "Forbidden",
            &format!("serviceaccounts \"{sa}\" is forbidden: audience \"{aud}\" not found in pod spec volume, {user} is not authorized to request tokens for this audience"),
            Some(json!({"name": sa, "kind": "serviceaccounts"})),
        );
    }
    let mut spec = req.get("spec").cloned().unwrap_or(json!({}));
    if audiences.is_empty() {
        spec["audiences"] = json!(["https://kubernetes.default.svc.cluster.local"]);
    }
    let ttl = spec
        .get("expirationSeconds")
        .and_then(Value::as_i64)
        .unwrap_or(3600);
    let mut token = format!("fake-token-for-{pod}");
    let len = state.token_len.load(Ordering::SeqCst) as usize;
    if token.len() < len {
        // Distinct per request, as a JWT's iat and signature are: equal bytes would let a
        // storage layer's comparison skip the write.
        let seq = state.uid_counter.fetch_add(1, Ordering::SeqCst);
        token.push('.');
        while token.len() < len {
            token.push_str(&format!("{seq:016x}"));
        }
        token.truncate(len);
    }
    let out = json!({
        "kind": "TokenRequest",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"name": sa, "namespace": ns, "uid": state.new_uid(), "creationTimestamp": now_rfc3339()},
        "spec": spec,
        "status": {"token": token, "expirationTimestamp": rfc3339(unix_now() + ttl)},
    });
    json_response(201, &out)
}

fn update(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
    body: &[u8],
) -> Response<Body> {
    let mut obj = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    fill_type(&mut obj, rt);
    let key = (
        rt.plural.to_string(),
        namespace.unwrap_or("").to_string(),
        name.to_string(),
    );
    let mut db = lock(&state.db);
    let Some(cur) = db.objects.get(&key).cloned() else {
        return not_found(rt, name);
    };
    let want = obj
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("");
    let have = cur
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !want.is_empty() && want != have {
        return status(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                rt.qualified()
            ),
            Some(json!({"name": name, "group": rt.group, "kind": rt.plural})),
        );
    }
    obj["metadata"]["uid"] = cur["metadata"]["uid"].clone();
    obj["metadata"]["creationTimestamp"] = cur["metadata"]["creationTimestamp"].clone();
    let out = commit(state, &mut db, rt, key, obj, Some(cur));
    json_response(200, &out)
}

fn patch(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
    status_only: bool,
    content_type: &str,
    body: &[u8],
) -> Response<Body> {
    let p = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let ct = content_type.split(';').next().unwrap_or("").trim();
    let strategic = match ct {
        "application/merge-patch+json" => false,
        "application/strategic-merge-patch+json" => true,
        other => {
            return status(
                415,
                "UnsupportedMediaType",
                &format!("the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (got {other:?})"),
                None,
            )
        }
    };
    let key = (
        rt.plural.to_string(),
        namespace.unwrap_or("").to_string(),
        name.to_string(),
    );
    let mut db = lock(&state.db);
    let Some(cur) = db.objects.get(&key).cloned() else {
        return not_found(rt, name);
    };
    // metadata.uid in a patch must be the object's: a report meant for an earlier pod of the
    // same name is refused (fixture `pod_status_patch_stale_uid`).
    if let Some(uid) = p.pointer("/metadata/uid").and_then(Value::as_str) {
        if Some(uid) != cur.pointer("/metadata/uid").and_then(Value::as_str) {
            let msg = format!("Invalid value: \"{uid}\": field is immutable");
            let cause =
                json!({"reason": "FieldValueInvalid", "message": msg, "field": "metadata.uid"});
            return status(
                422,
                "Invalid",
                &format!("{} \"{name}\" is invalid: metadata.uid: {msg}", rt.kind),
                Some(json!({"name": name, "kind": rt.kind, "causes": [cause.clone(), cause]})),
            );
        }
    }
    let mut next = cur.clone();
    let p = if status_only {
        json!({"status": p.get("status").cloned().unwrap_or(json!({}))})
    } else {
        p
    };
    if strategic {
        strategic_merge_patch(&mut next, &p);
    } else {
        merge_patch(&mut next, &p);
    }
    if rt.plural == "pods" && !status_only && next.get("spec") != cur.get("spec") {
        let strip_images = |v: &Value| {
            let mut s = v.get("spec").cloned().unwrap_or(Value::Null);
            for list in ["containers", "initContainers"] {
                if let Some(Value::Array(cs)) = s.get_mut(list) {
                    for c in cs {
                        if let Value::Object(m) = c {
                            m.shift_remove("image");
                        }
                    }
                }
            }
            s
        };
        if strip_images(&next) != strip_images(&cur) {
            return status(
                422,
                "Invalid",
                &format!("Pod \"{name}\" is invalid: spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)"),
                Some(json!({"name": name, "kind": "Pod"})),
            );
        }
    }
    if rt.plural == "pods" {
        pod_status_defaults(&mut next);
        if let Some(invalid) = invalid_pod_ips(name, &next) {
            return invalid;
        }
    }
    if next == cur {
        // The apiserver answers a no-op patch without a new resourceVersion.
        return json_response(200, &cur);
    }
    let out = commit(state, &mut db, rt, key, next, Some(cur));
    json_response(200, &out)
}

fn delete(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
    body: &[u8],
) -> Response<Body> {
    let opts: Value = if body.is_empty() {
        json!({})
    } else {
        match parse_body(body) {
            Ok(o) => o,
            Err(r) => return *r,
        }
    };
    let key = (
        rt.plural.to_string(),
        namespace.unwrap_or("").to_string(),
        name.to_string(),
    );
    let mut db = lock(&state.db);
    let Some(cur) = db.objects.get(&key).cloned() else {
        return not_found(rt, name);
    };
    if let Some(want) = opts.pointer("/preconditions/uid").and_then(Value::as_str) {
        let have = cur
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or("");
        if want != have {
            return status(
                409,
                "Conflict",
                &format!(
                    "Operation cannot be fulfilled on {} \"{name}\": the UID in the precondition ({want}) does not match the UID in record ({have}). The object might have been deleted and then recreated",
                    rt.kind
                ),
                Some(json!({"name": name, "kind": rt.kind})),
            );
        }
    }
    // Pods get a graceful delete (deletionTimestamp) unless the grace period is 0; the node
    // then finishes it with a delete at grace 0, as a kubelet does.
    let grace = opts
        .get("gracePeriodSeconds")
        .and_then(Value::as_i64)
        .or_else(|| {
            cur.pointer("/spec/terminationGracePeriodSeconds")
                .and_then(Value::as_i64)
                .or(Some(30))
        });
    if rt.plural == "pods" && grace.unwrap_or(0) > 0 {
        if cur.pointer("/metadata/deletionTimestamp").is_some() {
            return json_response(200, &cur);
        }
        let mut next = cur.clone();
        next["metadata"]["deletionTimestamp"] = now_rfc3339().into();
        next["metadata"]["deletionGracePeriodSeconds"] = grace.unwrap_or(30).into();
        let out = commit(state, &mut db, rt, key, next, Some(cur));
        return json_response(200, &out);
    }
    let out = remove_locked(state, &mut db, rt, namespace.unwrap_or(""), name);
    match out {
        Some(o) => json_response(200, &o),
        None => not_found(rt, name),
    }
}

fn event_line(kind: &str, object: &Value) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("type".into(), kind.into());
    m.insert("object".into(), object.clone());
    let mut line = serde_json::to_vec(&Value::Object(m)).unwrap_or_default();
    line.push(b'\n');
    line
}

fn bookmark(rt: &ResourceType, rv: u64, initial_end: bool) -> Value {
    let mut meta = Map::new();
    meta.insert("resourceVersion".into(), rv.to_string().into());
    if initial_end {
        meta.insert(
            "annotations".into(),
            json!({"k8s.io/initial-events-end": "true"}),
        );
    }
    let mut m = Map::new();
    m.insert("kind".into(), rt.kind.into());
    m.insert("apiVersion".into(), rt.api_version().into());
    m.insert("metadata".into(), Value::Object(meta));
    if rt.plural == "pods" {
        m.insert("spec".into(), json!({"containers": null}));
        m.insert("status".into(), json!({}));
    }
    if rt.plural == csr::CSR.plural {
        csr::bookmark_fields(&mut m);
    }
    Value::Object(m)
}

type Chunk = Result<Frame<Bytes>, std::io::Error>;

fn watch(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<String>,
    q: &BTreeMap<String, String>,
) -> Response<Body> {
    let filter = match Filter::from_query(namespace, rt, q) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let send_initial = q.get("sendInitialEvents").map(String::as_str) == Some("true");
    let rv_param = q.get("resourceVersion").cloned().unwrap_or_default();
    let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1800));
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    let state = state.clone();
    tokio::spawn(async move {
        let _ = watch_task(
            state,
            rt,
            filter,
            send_initial,
            rv_param,
            bookmarks,
            timeout,
            tx,
        )
        .await;
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(StreamBody::new(stream).boxed())
        .unwrap_or_else(|_| {
            Response::new(
                Full::new(Bytes::new())
                    .map_err(|never| match never {})
                    .boxed(),
            )
        })
}

#[allow(clippy::too_many_arguments)]
async fn watch_task(
    state: Arc<State>,
    rt: &'static ResourceType,
    filter: Filter,
    send_initial: bool,
    rv_param: String,
    bookmarks: bool,
    timeout: Duration,
    tx: mpsc::Sender<Chunk>,
) -> Result<(), ()> {
    let send = |bytes: Vec<u8>| {
        let tx = tx.clone();
        async move {
            tx.send(Ok(Frame::data(Bytes::from(bytes))))
                .await
                .map_err(|_| ())
        }
    };
    let mut rv_rx = state.rv_tx.subscribe();
    enum Start {
        Expired(Value),
        From(u64, Vec<Value>),
    }
    // A watch list (sendInitialEvents) from a version the server does not have: the watch
    // cache waits 3 s for it, then ends the stream with the "too large" Status as an ERROR
    // event (cacher.go, waitUntilWatchCacheFreshAndForceAllEvents). A plain watch from such a
    // version is accepted and sends nothing until the server's versions pass it.
    if let Some(asked) = rv_param
        .parse::<u64>()
        .ok()
        .filter(|&n| n > 0 && send_initial)
    {
        let current = wait_fresh(&state, asked).await;
        if current < asked {
            send(event_line("ERROR", &too_large_body(asked, current, 1))).await?;
            return Ok(());
        }
    }
    let start = {
        let db = lock(&state.db);
        let asked: Option<u64> = rv_param.parse().ok().filter(|&n| n > 0);
        match asked {
            Some(n) if !send_initial && n < db.compacted => Start::Expired(status_body(
                410,
                "Expired",
                &format!("too old resource version: {n} ({})", db.compacted),
                None,
            )),
            Some(n) if !send_initial => Start::From(n, vec![]),
            _ => Start::From(
                db.rv,
                db.objects
                    .iter()
                    .filter(|((p, _, _), o)| p == rt.plural && filter.matches(o))
                    .map(|(_, o)| o.clone())
                    .collect(),
            ),
        }
    };
    let (mut last, initial) = match start {
        Start::Expired(st) => {
            send(event_line("ERROR", &st)).await?;
            return Ok(());
        }
        Start::From(rv, initial) => (rv, initial),
    };
    // A CSR watch's bookmark goes out only once the cache holds a version newer than the
    // watch's start (fixtures `csr_watch_timeout_no_bookmark`, `csr_watch_timeout_bookmark`).
    let started_at = last;
    for obj in initial {
        send(event_line("ADDED", &obj)).await?;
    }
    if send_initial {
        send(event_line("BOOKMARK", &bookmark(rt, last, true))).await?;
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let bookmark_every = Duration::from_millis(state.bookmark_ms.load(Ordering::SeqCst));
    let mut next_bookmark = tokio::time::Instant::now() + bookmark_every;
    loop {
        while state.stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if tx.is_closed() {
                return Err(());
            }
        }
        // Read the events and the version they lead up to under one lock, so a bookmark never
        // claims a version whose events were not sent.
        let (events, current): (Vec<(u64, &'static str, Value)>, u64) = {
            let db = lock(&state.db);
            if state.stalled.load(Ordering::SeqCst) {
                continue;
            }
            let evs = db
                .history
                .iter()
                .filter(|e| e.rv > last && e.plural == rt.plural)
                .filter_map(|e| {
                    let now = filter.matches(&e.object) && e.kind != "DELETED";
                    let before = e.prev.as_ref().is_some_and(|p| filter.matches(p));
                    let kind = match (before, now, e.kind) {
                        (true, _, "DELETED") => "DELETED",
                        (false, true, _) => "ADDED",
                        (true, true, _) => "MODIFIED",
                        (true, false, _) => "DELETED",
                        _ => return None,
                    };
                    Some((e.rv, kind, e.object.clone()))
                })
                .collect();
            (evs, db.rv)
        };
        for (rv, kind, obj) in events {
            let line = event_line(kind, &obj);
            let (cut, corrupt) = {
                let mut f = lock(&state.faults);
                let cut = f.cut_watch_events > 0;
                if cut {
                    f.cut_watch_events -= 1;
                }
                let corrupt = f.corrupt_watch_events > 0;
                if corrupt {
                    f.corrupt_watch_events -= 1;
                }
                (cut, corrupt)
            };
            if corrupt {
                send(b"{\"type\":\"MODIFIED\",\"object\":{\"metadata\":{\"name\": tru\n".to_vec())
                    .await?;
            }
            if cut {
                send(line[..line.len() / 2].to_vec()).await?;
                // An error frame makes hyper abort the connection without the final chunk.
                let _ = tx.send(Err(std::io::Error::other("injected cut"))).await;
                return Ok(());
            }
            send(line).await?;
            last = last.max(rv);
        }
        tokio::select! {
            r = rv_rx.changed() => { if r.is_err() { return Ok(()); } }
            _ = tokio::time::sleep_until(deadline) => return Ok(()),
            _ = tokio::time::sleep_until(next_bookmark), if bookmarks => {
                // A bookmark carries the server's version, and only goes to a watcher that
                // has not been told a newer one: one watching from a version the server
                // does not have yet gets none (cache_watcher.go sends events newer than the
                // watcher's version only).
                let newer = rt.plural != csr::CSR.plural || current > started_at;
                if !state.stalled.load(Ordering::SeqCst) && current >= last && newer {
                    last = current;
                    send(event_line("BOOKMARK", &bookmark(rt, last, false))).await?;
                }
                next_bookmark = tokio::time::Instant::now() + bookmark_every;
            }
            _ = tx.closed() => return Err(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn label_selectors() {
        let l = labels(&[("app", "telemetry"), ("tier", "edge")]);
        for (sel, want) in [
            ("", true),
            ("app=telemetry", true),
            ("app==telemetry,tier=edge", true),
            ("app!=telemetry", false),
            ("app", true),
            ("!app", false),
            ("missing", false),
            ("!missing", true),
            ("app in (gateway, telemetry)", true),
            ("app notin (telemetry)", false),
            ("tier in (core),app=telemetry", false),
        ] {
            assert_eq!(parse_selector(sel).unwrap().matches(&l), want, "{sel}");
        }
        assert!(parse_selector("a b c").is_err());
    }

    #[test]
    fn paths() {
        let r = parse_path("/api/v1/namespaces/vehicle/pods/p/status").unwrap();
        assert_eq!(
            (
                r.rt.plural,
                r.namespace.as_deref(),
                r.name.as_deref(),
                r.sub.as_deref()
            ),
            ("pods", Some("vehicle"), Some("p"), Some("status"))
        );
        let r = parse_path("/apis/apps/v1/daemonsets").unwrap();
        assert_eq!(
            (r.rt.plural, r.namespace, r.name),
            ("daemonsets", None, None)
        );
        assert!(parse_path("/api/v1/namespaces/x/nodes").is_none());
        assert!(parse_path("/apis/apps/v2/daemonsets").is_none());
        assert!(parse_path("/healthz").is_none());
    }

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_977_769), "2026-11-29T18:42:49Z");
    }
}
