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

mod authz;
mod control;
mod http;
mod objects;
mod read;
mod selector;
mod validate;
mod watches;
mod write;
use authz::*;
pub use http::status_body;
use http::*;
use objects::*;
pub use objects::{now_rfc3339, rfc3339};
use read::*;
use selector::*;
use watches::*;
pub use write::admit_service_account;
use write::*;
mod csr;
pub use csr::{
    csrapproving, validate_kubelet_client, validate_kubelet_serving, Approval, Approver,
    BootstrapToken, CsrRequest, TestOnlyCertWindow, KUBELET_CLIENT_SIGNER, KUBELET_SERVING_SIGNER,
};
mod reviews;
pub use reviews::APISERVER_KUBELET_CLIENT;
mod discovery;
pub mod kubelet;
mod metrics;
mod proxy;

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
    /// Who may use the kubelet's API, as the SubjectAccessReviews answer it.
    reviews: Mutex<reviews::Rbac>,
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
    /// Where the fake listens (discovery names it).
    addr: SocketAddr,
    /// The apiserver's client for the kubelets' port 10250 (node proxy, metrics scrapes).
    kubelet: kubelet::KubeletClient,
    /// Users RBAC grants the node proxy (`pods/log`, `pods/exec`, ..., `nodes/proxy`) and
    /// metrics.k8s.io reads; `system:masters` needs no grant.
    proxy_users: Mutex<std::collections::HashSet<String>>,
    /// Test-only: let `nodes/proxy` reach loopback addresses, which kube-apiserver refuses.
    loopback_node_proxy: AtomicBool,
    /// metrics-server's last scrape per node.
    metrics: Mutex<metrics::Scrapes>,
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
