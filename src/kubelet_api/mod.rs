//! The node's API on port 10250, where the apiserver calls a kubelet: `kubectl logs` and
//! `kubectl top` from the cloud. A thin hyper server over rustls, with its own limits (none shared with the
//! local OTA API).
//!
//! - **TLS** with the serving certificate [`crate::identity::serving`] publishes (a
//!   kubelet-serving CSR, or a self-signed one only on the operator's explicit opt-in). No
//!   certificate yet: every handshake fails, nothing is served.
//! - **Authentication** as the kubelet's: a client certificate verified against the
//!   cluster's client CA (the apiserver calls with its kubelet-client certificate; the CN is
//!   the user, each O a group), else a bearer token sent to the apiserver in a TokenReview
//!   ([`reviews`]). Neither: 401.
//! - **Authorization** of every request by SubjectAccessReviews for the `nodes`
//!   subresource the kubelet would check ([`authz`]). Denied: 403.
//! - **Routes** ([`route`]): `/healthz`, `/containerLogs/{ns}/{pod}/{container}` ([`logs`]),
//!   `/metrics/resource` and `/stats/summary` from the CRI's container stats ([`stats`]; the
//!   summary's shape in [`summary`], its disks and networks sampled in [`sampling`]),
//!   `/exec`, `/attach` and `/portForward` proxied to the runtime's streaming server
//!   ([`streams`]); anything else 404, as the kubelet answers.
//! - **Limits:** connections not yet authorized and those admitted are bounded apart
//!   ([`admission`]: silent connections never lock out an authorized caller), and so are
//!   streams (logs, exec, attach, port-forward); a handshake has a short deadline; a
//!   request's headers, a follow with nothing new, a spliced stream with no bytes either
//!   way and a write the peer takes nothing of ([`deadline`]) all end after the idle
//!   timeout; a refused request closes its connection.

pub mod admission;
pub mod authz;
pub mod cache;
pub mod deadline;
pub mod logs;
pub mod reviews;
pub mod route;
pub mod sampling;
pub mod splice;
pub mod stats;
pub mod streams;
pub mod summary;
pub mod usage;

use crate::identity::serving::{ServingPair, ServingWatch};
use crate::store::Store;
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use reviews::{Reviewer, User};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{mpsc, watch, Semaphore};

/// The kubelet's port.
pub const DEFAULT_PORT: u16 = 10250;

/// `[node] node_api_*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletApiConfig {
    /// Where to listen; `None`: off.
    pub addr: Option<SocketAddr>,
    /// The cluster's client CA (PEM): client certificates it signed authenticate. `None`:
    /// bearer tokens only.
    pub client_ca_file: Option<PathBuf>,
    /// Serve a self-signed certificate instead of asking the cluster for one (loudly).
    pub self_signed: bool,
    /// Connections at once whose requests were authenticated and authorized.
    pub max_connections: usize,
    /// Connections at once not (yet) authenticated and authorized, from the accept on;
    /// more close the oldest of the source holding the most ([`admission`]).
    pub max_unauthenticated: usize,
    /// How long a TLS handshake may take.
    pub handshake_timeout: Duration,
    /// Streams at once: logs (follows included), exec, attach and port-forward sessions.
    pub max_streams: usize,
    pub idle_timeout: Duration,
}

impl Default for KubeletApiConfig {
    fn default() -> Self {
        KubeletApiConfig {
            addr: None,
            client_ca_file: None,
            self_signed: false,
            max_connections: 32,
            max_unauthenticated: 16,
            // The kubelet's Go server completes TLS in well under a second; 10 s leaves
            // room for a slow link to the cloud.
            handshake_timeout: Duration::from_secs(10),
            max_streams: 8,
            idle_timeout: Duration::from_secs(300),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KubeletApiError {
    #[error("node_api_client_ca_file {path}: {reason}")]
    ClientCa { path: PathBuf, reason: String },
    #[error("node API TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("node API: cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

type Body = BoxBody<Bytes, Infallible>;

fn text(status: u16, body: impl Into<String>) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(body.into()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// `r`, and the connection closed after it: a refused request's connection holds no place
/// for the next guess.
fn closing(mut r: Response<Body>) -> Response<Body> {
    r.headers_mut().insert(
        hyper::header::CONNECTION,
        hyper::header::HeaderValue::from_static("close"),
    );
    r
}

/// The chunks of a streamed answer.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

/// Picks the certificate published now for every handshake.
struct Latest {
    rx: ServingWatch,
    cur: Mutex<Option<(Arc<ServingPair>, Arc<rustls::sign::CertifiedKey>)>>,
}

impl std::fmt::Debug for Latest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Latest").finish_non_exhaustive()
    }
}

fn certified(pair: &ServingPair) -> Result<rustls::sign::CertifiedKey, String> {
    let certs = CertificateDer::pem_slice_iter(pair.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let key = PrivateKeyDer::from_pem_slice(pair.key_pem.as_bytes()).map_err(|e| e.to_string())?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| e.to_string())?;
    Ok(rustls::sign::CertifiedKey::new(certs, signer))
}

impl rustls::server::ResolvesServerCert for Latest {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        let pair = self.rx.borrow().clone()?;
        let mut cur = self.cur.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((p, ck)) = cur.as_ref() {
            if Arc::ptr_eq(p, &pair) {
                return Some(ck.clone());
            }
        }
        match certified(&pair) {
            Ok(ck) => {
                let ck = Arc::new(ck);
                *cur = Some((pair, ck.clone()));
                Some(ck)
            }
            Err(e) => {
                tracing::warn!(error = %e, "node API: the serving certificate cannot be used");
                None
            }
        }
    }
}

fn load_client_ca(path: &Path) -> Result<rustls::RootCertStore, KubeletApiError> {
    let bad = |reason: String| KubeletApiError::ClientCa {
        path: path.to_path_buf(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem) {
        roots
            .add(c.map_err(|e| bad(e.to_string()))?)
            .map_err(|e| bad(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    Ok(roots)
}

/// The server's TLS: the published serving certificate; client certificates verified against
/// the client CA when one is configured (a certificate from another CA fails the handshake),
/// optional so that bearer tokens work too.
pub fn tls_config(
    serving: ServingWatch,
    client_ca: Option<&Path>,
) -> Result<rustls::ServerConfig, KubeletApiError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        Some(path) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(load_client_ca(path)?),
                provider,
            )
            .allow_unauthenticated()
            .build()
            .map_err(|e| KubeletApiError::ClientCa {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_cert_resolver(Arc::new(Latest {
        rx: serving,
        cur: Mutex::new(None),
    }));
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The user a verified client certificate names (CN, and O as groups), with its credential
/// id (`X509SHA256=<hex of the certificate's SHA-256>`) in `extra`, as the kubelet's x509
/// authenticator (and the apiserver's) sets it.
fn cert_user(der: &[u8]) -> Option<User> {
    let (cn, orgs) = crate::identity::cert::subject_user(der).ok()?;
    let mut groups = orgs;
    groups.push("system:authenticated".into());
    let sha = ring::digest::digest(&ring::digest::SHA256, der);
    let hex: String = sha.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    Some(User {
        name: cn.filter(|c| !c.is_empty())?,
        uid: None,
        groups,
        extra: std::collections::BTreeMap::from([(
            reviews::CREDENTIAL_ID.to_string(),
            vec![format!("X509SHA256={hex}")],
        )]),
    })
}

/// The node's API.
pub struct KubeletApi {
    node_name: String,
    /// The runtime, for `/stats/summary` and `/metrics/resource`.
    cri: Option<crate::cri::CriClient>,
    reviewer: Reviewer,
    store: Arc<Store>,
    data_dir: PathBuf,
    tls: Arc<rustls::ServerConfig>,
    /// Admitted connections ([`admission`]).
    connections: Arc<Semaphore>,
    pending: Arc<admission::Pending>,
    handshake: Duration,
    streams: Arc<Semaphore>,
    idle: Duration,
    /// `/stats/summary`'s emptyDir measures, reused for a while.
    volumes: Arc<sampling::Volumes>,
}

impl KubeletApi {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &KubeletApiConfig,
        node_name: &str,
        cri: Option<crate::cri::CriClient>,
        reviewer: Reviewer,
        store: Arc<Store>,
        data_dir: &Path,
        serving: ServingWatch,
    ) -> Result<KubeletApi, KubeletApiError> {
        Ok(KubeletApi {
            node_name: node_name.to_string(),
            cri,
            reviewer,
            store,
            data_dir: data_dir.to_path_buf(),
            tls: Arc::new(tls_config(serving, cfg.client_ca_file.as_deref())?),
            connections: Arc::new(Semaphore::new(cfg.max_connections.max(1))),
            pending: admission::Pending::new(cfg.max_unauthenticated),
            handshake: cfg.handshake_timeout,
            streams: Arc::new(Semaphore::new(cfg.max_streams.max(1))),
            idle: cfg.idle_timeout,
            volumes: sampling::Volumes::new(),
        })
    }

    /// Binds `addr`.
    pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, KubeletApiError> {
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| KubeletApiError::Listen { addr, source })
    }

    /// Serves connections from `listener` until shutdown.
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.tls.clone());
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::warn!(error = %e, "node API: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                _ = shutdown.changed() => return,
            };
            // Answers go out in several writes (TLS records, headers, chunks): without
            // TCP_NODELAY each small one after the first waits for the client's delayed ACK,
            // 40 ms a request (benches/kubelet_logs.rs; Go's servers, the kubelet's too, set it).
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "node API: cannot set TCP_NODELAY");
            }
            // Pending until a request on it is authorized; a full pending budget closes
            // another pending connection, never this one.
            let standing = Arc::new(admission::Standing::pending(
                self.pending.enter(admission::Source::of(peer.ip())),
            ));
            let me = self.clone();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = standing.evicted() => {
                        tracing::debug!(%peer, "node API: closing an unauthenticated connection to make room");
                    }
                    _ = me.connection(tcp, acceptor, standing.clone()) => {}
                }
            });
        }
    }

    /// One connection: the TLS handshake within its deadline, then its requests.
    async fn connection(
        self: Arc<Self>,
        tcp: tokio::net::TcpStream,
        acceptor: tokio_rustls::TlsAcceptor,
        standing: Arc<admission::Standing>,
    ) {
        // A client that stops reading gives its connection back after the idle time.
        let tcp = deadline::WriteDeadline::new(tcp, self.idle);
        let tls = match tokio::time::timeout(self.handshake, acceptor.accept(tcp)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "node API: TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(timeout = ?self.handshake, "node API: TLS handshake too slow");
                return;
            }
        };
        let cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| cert_user(c.as_ref()));
        // Headers come within 30 s, or the idle timeout if shorter.
        let headers_within = self.idle.min(Duration::from_secs(30));
        let me = self.clone();
        let svc = hyper::service::service_fn(move |req| {
            let me = me.clone();
            let cert = cert.clone();
            let standing = standing.clone();
            async move { Ok::<_, Infallible>(me.handle(cert.as_ref(), &standing, req).await) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(Some(headers_within))
            .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
            .with_upgrades();
        let _ = conn.await;
    }

    async fn handle(
        &self,
        cert: Option<&User>,
        standing: &admission::Standing,
        req: Request<Incoming>,
    ) -> Response<Body> {
        let method = req.method().as_str().to_string();
        let path = req.uri().path().to_string();
        let query = req.uri().query().map(str::to_string);
        let bearer = req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let user = match (cert, bearer) {
            (Some(u), _) => Some(u.clone()),
            (None, Some(t)) => match self.reviewer.authenticate(&t).await {
                Ok(u) => u,
                Err(e) => {
                    tracing::warn!(error = %e, "node API: TokenReview failed");
                    None
                }
            },
            (None, None) => None,
        };
        let Some(user) = user else {
            return closing(text(401, "Unauthorized"));
        };
        let verb = authz::verb(&method).unwrap_or("");
        let subs = authz::subresources(&path);
        let mut allowed = false;
        if !verb.is_empty() {
            for sub in &subs {
                match self.reviewer.authorize(&user, verb, sub).await {
                    Ok(true) => {
                        allowed = true;
                        break;
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, user = %user.name, verb, subresource = sub, "node API: SubjectAccessReview failed");
                        return closing(text(
                            500,
                            format!(
                                "Authorization error (user={}, verb={verb}, resource=nodes, subresource={sub})",
                                user.name
                            ),
                        ));
                    }
                }
            }
        }
        if !allowed {
            tracing::info!(user = %user.name, verb, path = %path, "node API: request forbidden");
            return closing(text(403, authz::forbidden_text(&user.name, verb, &subs)));
        }
        match standing.admit(&self.connections) {
            admission::Admit::Admitted => {}
            admission::Admit::Full => {
                tracing::info!(user = %user.name, "node API: every connection place is taken");
                let mut r = closing(text(
                    503,
                    "too many connections to this node's API (its max_connections); try again later",
                ));
                r.headers_mut().insert(
                    hyper::header::RETRY_AFTER,
                    hyper::header::HeaderValue::from_static("1"),
                );
                return r;
            }
            admission::Admit::Evicted => {
                return closing(text(503, "this connection was closed to make room"));
            }
        }
        tracing::debug!(user = %user.name, verb, path = %path, "node API request");
        match route::parse(&method, &path) {
            route::Route::Stream(target) => self.stream(target, &user.name, req).await,
            route::Route::Healthz => text(200, "ok"),
            route::Route::MetricsResource => self.stats(true).await,
            route::Route::StatsSummary => self.stats(false).await,
            route::Route::ContainerLogs {
                namespace,
                pod,
                container,
            } => {
                self.container_logs(namespace, pod, container, query.as_deref())
                    .await
            }
            route::Route::NotFound => text(404, "404 page not found\n"),
        }
    }

    /// `/metrics/resource` (`metrics`) or `/stats/summary`: this node's containers as the
    /// runtime reports them, and the node from `/proc`.
    async fn stats(&self, metrics: bool) -> Response<Body> {
        let mut error = false;
        let containers = match &self.cri {
            Some(cri) => {
                let filter = std::collections::HashMap::from([(
                    crate::cri::labels::NODE.to_string(),
                    self.node_name.clone(),
                )]);
                match cri.list_container_stats(filter.clone()).await {
                    Ok(s) => {
                        let samples = s.iter().filter_map(stats::container_sample).collect();
                        // Their start times; without them the rest is still worth serving.
                        match crate::cri::CriRuntime::list_containers(cri, filter).await {
                            Ok(listed) => stats::with_start_times(samples, &listed),
                            Err(e) => {
                                tracing::debug!(error = %e, "node API: ListContainers failed");
                                samples
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "node API: ListContainerStats failed");
                        error = true;
                        Vec::new()
                    }
                }
            }
            None => Vec::new(),
        };
        let node = stats::node_sample();
        if metrics {
            let mut r = text(
                200,
                stats::metrics_resource(node.as_ref(), &containers, error || node.is_none()),
            );
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            r
        } else if error {
            text(
                500,
                "Internal Error: the runtime's container stats are unavailable",
            )
        } else {
            let extra = sampling::sample_extra(
                self.cri.as_ref(),
                &self.node_name,
                &self.data_dir,
                &containers,
                &self.volumes,
            )
            .await;
            let body = summary::summary(&self.node_name, node.as_ref(), &containers, &extra);
            let mut r = text(200, body.to_string());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            r
        }
    }

    async fn container_logs(
        &self,
        ns: &str,
        pod: &str,
        container: &str,
        query: Option<&str>,
    ) -> Response<Body> {
        let Ok(permit) = self.streams.clone().try_acquire_owned() else {
            return text(429, "too many log streams on this node; try again later");
        };
        let store = self.store.clone();
        let dir = self.data_dir.clone();
        // The pod's containers in the runtime, for a follow to ask whether its own still runs.
        let pod_labels = std::collections::HashMap::from([
            (crate::cri::labels::NODE.to_string(), self.node_name.clone()),
            (
                crate::cri::labels::POD_NAMESPACE.to_string(),
                ns.to_string(),
            ),
            (crate::cri::labels::POD_NAME.to_string(), pod.to_string()),
        ]);
        let (ns, pod, container) = (ns.to_string(), pod.to_string(), container.to_string());
        let query = query.map(str::to_string);
        let idle = self.idle;
        let opened = tokio::task::spawn_blocking(move || {
            logs::open(&store, &dir, &ns, &pod, &container, query.as_deref(), idle)
        })
        .await;
        let log = match opened {
            Ok(Ok(l)) => match &self.cri {
                Some(cri) if l.follows() => l.with_liveness(logs::Liveness {
                    cri: cri.clone(),
                    labels: pod_labels,
                    handle: tokio::runtime::Handle::current(),
                }),
                _ => l,
            },
            Ok(Err(r)) => return text(r.status, r.text),
            Err(e) => return text(500, format!("opening the log: {e}")),
        };
        let rx = log.spawn(Some(permit));
        let mut r = Response::new(BoxBody::new(ChannelBody(rx)));
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/plain"),
        );
        r
    }
}
