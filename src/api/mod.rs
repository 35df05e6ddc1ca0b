//! The local HTTP API on the device: OpenYurt's OTA routes (`GET /pods`,
//! `POST /openyurt.io/v1/namespaces/{ns}/pods/{name}/upgrade`, `.../imagepull`), the state of
//! an upgrade, containers' logs, status, health and metrics. It serves from the cache and
//! local files, and works with the link down.
//!
//! Input hygiene: routes and names are checked by [`router::route`] before any handler runs;
//! headers are capped by hyper's buffer size, bodies at [`MAX_BODY`], and every connection has
//! a header-read timeout and every request a deadline. Errors are short plain text, as
//! OpenYurt's are.

pub mod admit;
pub mod guard;
pub mod handlers;
pub mod identity;
mod image_list;
pub mod images;
pub mod listen;
pub mod logs;
pub mod metrics;
pub mod podlist;
pub mod rawjson;
pub mod rendered;
pub mod router;
pub mod transactions;

use crate::link::LinkState;
use crate::store::{RequestKind, Store};
use crate::sync::ReflectorStats;
use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use router::Route;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{watch, Semaphore};

/// Local API options beyond `api_addr`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ApiConfig {
    /// Also serve on this unix socket.
    pub socket: Option<std::path::PathBuf>,
    /// File mode of the socket.
    pub socket_mode: u32,
    /// Group owning the socket (by name), so the OTA manager's group can connect.
    pub socket_group: Option<String>,
    /// File holding a bearer token the API requires (health probes excepted).
    pub token_file: Option<std::path::PathBuf>,
}

/// Largest request body read (the routes take none; this only bounds what is drained).
pub const MAX_BODY: usize = 64 << 10;
/// Largest request head (request line plus headers).
pub const MAX_HEAD: usize = 16 << 10;
/// Connections served at once; more wait in the kernel's accept queue.
pub const MAX_CONNECTIONS: usize = 64;
/// Logs followed at once (`edgehub logs -f`). A follower holds its connection for as long as
/// the container writes, so followers are counted apart from [`MAX_CONNECTIONS`]: a follower
/// gives its connection's place back once its stream starts, and those beyond this many get a
/// 429 at once. 65 followers used to take all 64 connections, and the OTA manager's upgrade
/// request waited in the accept queue for as long as they stayed.
pub const MAX_FOLLOWERS: usize = 16;
/// A follower whose log has had nothing new for this long is ended (a quiet container, or a
/// client that forgot it), so followers cannot hold their places forever.
pub const FOLLOW_IDLE: Duration = Duration::from_secs(300);
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The budget of long-lived log streams ([`MAX_FOLLOWERS`], [`FOLLOW_IDLE`]), shared by every
/// listener.
#[derive(Debug, Clone)]
pub struct Streams {
    followers: Arc<Semaphore>,
    max: usize,
    pub idle: Duration,
}

impl Streams {
    pub fn new(max: usize, idle: Duration) -> Streams {
        Streams {
            followers: Arc::new(Semaphore::new(max)),
            max,
            idle,
        }
    }
}

impl Default for Streams {
    fn default() -> Streams {
        Streams::new(MAX_FOLLOWERS, FOLLOW_IDLE)
    }
}

/// What the handlers share.
pub struct ApiState {
    pub store: Arc<Store>,
    pub link: watch::Receiver<LinkState>,
    pub sync_stats: Vec<(String, Arc<ReflectorStats>)>,
    pub metrics: metrics::Metrics,
    /// When set, every route but the health probes needs `Authorization: Bearer <token>`
    /// (or a privileged socket peer), and the token opens the privileged routes.
    pub token: Option<String>,
    /// The unix socket and its group: which socket peers may call privileged routes, and
    /// what a refused caller is told.
    pub socket: guard::SocketAccess,
    pub node_name: String,
    /// The container runtime's health, for readyz.
    pub cri: watch::Receiver<crate::cri::CriHealth>,
    /// The container runtime itself, to check that an upgrade's images are on the node
    /// before accepting it offline; `None` skips the check.
    pub runtime: Option<crate::cri::CriClient>,
    /// Followed logs, counted apart from connections.
    pub streams: Streams,
    /// Image side-loads (`POST /v1/images/load`); `None` answers 503.
    pub images: Option<Arc<crate::images::Importer>>,
    /// Image garbage collection's counters and the image filesystem's last reading, for
    /// `/metrics`; `None` leaves them out.
    pub image_gc: Option<Arc<crate::images::GcStats>>,
    /// The identity task's status and the bootstrap token's handover; `None` when the node
    /// credential is made by hand.
    pub identity: Option<identity::IdentityHandle>,
    /// `GET /pods` as last rendered, served until the store changes.
    pub pods: Arc<rendered::Rendered>,
    /// A transaction's commit deadline when it asks for none (`[upgrade]
    /// manual_commit_deadline_secs`).
    pub commit_deadline: Duration,
}

/// A response before it becomes HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Bytes,
    pub allow: Option<&'static str>,
    /// For 401: the `WWW-Authenticate` challenge.
    pub challenge: Option<&'static str>,
}

impl Reply {
    pub fn text(status: u16, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            body: Bytes::from(body.into()),
            allow: None,
            challenge: None,
        }
    }

    pub fn json(status: u16, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            body: Bytes::from(body.into()),
            allow: None,
            challenge: None,
        }
    }

    /// A 500 with a short body; the detail goes to the log, not to the caller.
    pub fn internal(what: &str, e: &dyn std::fmt::Display) -> Reply {
        tracing::error!(error = %e, "{what}");
        Reply::text(500, what)
    }
}

/// What a request gets: a whole reply, or a log streamed as it is read.
#[derive(Debug)]
pub enum Answer {
    Reply(Reply),
    /// Boxed: a stream is several times the size of a reply, and most answers are replies.
    Logs(Box<logs::LogStream>),
}

impl Answer {
    pub fn status(&self) -> u16 {
        match self {
            Answer::Reply(r) => r.status,
            Answer::Logs(_) => 200,
        }
    }
}

/// Runs one route's handler. `query` is the request's query string, which only the log
/// route reads.
fn dispatch(state: &ApiState, route: &Route, query: Option<&str>, body: &[u8]) -> Answer {
    let reply = match route {
        Route::Pods => handlers::pods(state),
        Route::Upgrade { namespace, name } => {
            handlers::request(state, RequestKind::Upgrade, namespace, name)
        }
        Route::ImagePull { namespace, name } => {
            handlers::request(state, RequestKind::ImagePull, namespace, name)
        }
        Route::UpgradeStatus { namespace, name } => {
            handlers::upgrade_status(state, namespace, name)
        }
        // Streamed by `handle` before any dispatch; never reached.
        Route::ImagesLoad => Reply::text(500, "Image loads are streamed"),
        Route::Images => image_list::list(state),
        Route::Status => handlers::status(state),
        Route::Node => identity::node(state),
        Route::BootstrapToken => identity::put_token(state, body),
        Route::StartTransaction => transactions::start(state, body),
        Route::Transactions => transactions::list(state),
        Route::Transaction { id } => transactions::get(state, id),
        Route::CommitTransaction { id } => transactions::commit(state, id),
        Route::RollbackTransaction { id } => transactions::rollback(state, id, body),
        Route::Healthz => Reply::text(200, "ok"),
        Route::Readyz => handlers::readyz(state),
        Route::Metrics => handlers::metrics(state),
        Route::Logs { namespace, name } => {
            return match logs::open(state, namespace, name, query) {
                Ok(stream) if !stream.follows() => Answer::Logs(Box::new(stream)),
                Ok(mut stream) => match state.streams.followers.clone().try_acquire_owned() {
                    Ok(permit) => {
                        stream.hold(permit, state.streams.idle);
                        Answer::Logs(Box::new(stream))
                    }
                    Err(_) => Answer::Reply(Reply::text(
                        429,
                        format!(
                            "Too many log streams are followed at once (at most {}); try again \
                             when one ends, or read the log without following it",
                            state.streams.max
                        ),
                    )),
                },
                Err(reply) => Answer::Reply(reply),
            }
        }
    };
    Answer::Reply(reply)
}

/// Handles one request: admit it ([`admit::admit`]: refuse web pages and foreign hosts,
/// authenticate, route, check the route's access class), drain the (capped) body, dispatch,
/// count. A page or a client without the token learns nothing of the routes and names behind
/// them, and a privileged route refused is refused before its body is read.
pub async fn handle(state: Arc<ApiState>, req: Request<Incoming>, via: guard::Via) -> Answer {
    let method = req.method().as_str().to_string();
    let query = req.uri().query().map(str::to_string);
    let headers = req.headers();
    let one = |name: hyper::header::HeaderName| {
        let mut all = headers.get_all(name).iter();
        match (all.next(), all.next()) {
            (Some(v), None) => Some(v.as_bytes()),
            _ => None,
        }
    };
    let head = admit::Head {
        method: &method,
        path: req.uri().path(),
        host: one(hyper::header::HOST),
        origin: headers.get(hyper::header::ORIGIN).map(|v| v.as_bytes()),
        sec_fetch_site: headers.get("sec-fetch-site").map(|v| v.as_bytes()),
        authorization: headers
            .get(hyper::header::AUTHORIZATION)
            .map(|v| v.as_bytes()),
    };
    // The access class is decided here, before the body: a refused upload is not read, let
    // alone written anywhere.
    let routed = admit::admit(&head, via, state.token.as_deref().map(str::as_bytes)).map_err(|d| {
        let reply = match &d {
            admit::Denial::Refused(r) => Reply::text(r.status, r.message),
            admit::Denial::Unauthorized(auth) => Reply {
                challenge: Some(guard::challenge(*auth)),
                ..Reply::text(401, "Unauthorized")
            },
            admit::Denial::Rejected(r) => Reply {
                allow: r.allow,
                ..Reply::text(r.status, r.message.clone())
            },
            admit::Denial::Forbidden(f) => {
                tracing::warn!(method = %method, path = head.path, ?via,
                    "privileged route refused: the caller has no credential");
                let what = format!("{method} {}", head.path);
                Reply::text(403, f.message(&what, &state.socket))
            }
        };
        (d.name(), reply)
    });
    let (route_name, answer) = match routed {
        Err((name, reply)) => (name, Answer::Reply(reply)),
        // An image archive: streamed to the importer with its own size limit, not collected.
        Ok(Route::ImagesLoad) => (
            Route::ImagesLoad.name(),
            Answer::Reply(images::load(&state, req, query.as_deref()).await),
        ),
        Ok(route) => {
            let body = Limited::new(req.into_body(), MAX_BODY);
            let reply = |r| (route.name(), Answer::Reply(r));
            match tokio::time::timeout(REQUEST_TIMEOUT, body.collect()).await {
                Err(_) => reply(Reply::text(408, "Request body timeout")),
                Ok(Err(_)) => reply(Reply::text(413, "Request body too large")),
                Ok(Ok(collected)) => {
                    let st = state.clone();
                    let r = route.clone();
                    let body = collected.to_bytes();
                    // Store work is synchronous; keep it off the async workers.
                    let job = tokio::task::spawn_blocking(move || {
                        dispatch(&st, &r, query.as_deref(), &body)
                    });
                    // A request that may record something is answered with what happened:
                    // its handler bounds its own waits (the image check has a budget), and
                    // a timeout here could answer 503 for an upgrade that was recorded.
                    let done = if route.records() {
                        Ok(job.await)
                    } else {
                        tokio::time::timeout(REQUEST_TIMEOUT, job).await
                    };
                    match done {
                        Ok(Ok(answer)) => (route.name(), answer),
                        Ok(Err(e)) => reply(Reply::internal("Handler failed", &e)),
                        Err(_) => reply(Reply::text(503, "Request timed out")),
                    }
                }
            }
        }
    };
    state.metrics.count(route_name, answer.status());
    if method == "HEAD" {
        // The head of the answer without its body; an opened log is closed unread.
        return Answer::Reply(match answer {
            Answer::Reply(r) => Reply {
                body: Bytes::new(),
                ..r
            },
            Answer::Logs(_) => Reply::text(200, ""),
        });
    }
    answer
}

/// The body of a response: whole, or a streamed log.
pub type ResponseBody = Either<Full<Bytes>, logs::LogBody>;

fn to_response(answer: Answer) -> Response<ResponseBody> {
    let reply = match answer {
        Answer::Reply(r) => r,
        Answer::Logs(stream) => return log_response(*stream),
    };
    let mut resp = Response::new(Either::Left(Full::new(reply.body)));
    *resp.status_mut() = hyper::StatusCode::from_u16(reply.status)
        .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(reply.content_type),
    );
    if let Some(allow) = reply.allow {
        resp.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static(allow),
        );
    }
    if let Some(c) = reply.challenge {
        resp.headers_mut().insert(
            hyper::header::WWW_AUTHENTICATE,
            hyper::header::HeaderValue::from_static(c),
        );
    }
    resp
}

/// Header naming the container a log response is read from.
pub const CONTAINER_HEADER: &str = "edgehub-container";
/// Header listing the pod's containers, when the request named none and the pod has more
/// than one (for kubectl's "Defaulted container" notice).
pub const CONTAINERS_HEADER: &str = "edgehub-containers";

fn log_response(stream: logs::LogStream) -> Response<ResponseBody> {
    use hyper::header::HeaderValue;
    let choice = stream.choice.clone();
    let follows = stream.follows();
    let mut resp = Response::new(Either::Right(stream.into_body()));
    let h = resp.headers_mut();
    if follows {
        // The connection gave its place back when the stream started (see
        // `serve_connection`): it must not carry more requests afterwards.
        h.insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    }
    h.insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    // Container names are DNS-1123 labels, always valid header values.
    if let Ok(v) = HeaderValue::from_str(&choice.container) {
        h.insert(CONTAINER_HEADER, v);
    }
    if choice.defaulted {
        if let Ok(v) = HeaderValue::from_str(&choice.all.join(", ")) {
            h.insert(CONTAINERS_HEADER, v);
        }
    }
    resp
}

/// A connection's place among [`MAX_CONNECTIONS`], held until it closes or its request
/// becomes a followed log (which counts among [`MAX_FOLLOWERS`] instead).
type Slot = Arc<std::sync::Mutex<Option<tokio::sync::OwnedSemaphorePermit>>>;

/// Serves one connection.
async fn serve_connection<IO>(io: IO, state: Arc<ApiState>, via: guard::Via, slot: Slot)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| {
        let (state, slot) = (state.clone(), slot.clone());
        // Boxed: `without_shutdown` needs a future that is Unpin.
        Box::pin(async move {
            let answer = handle(state, req, via).await;
            if matches!(&answer, Answer::Logs(s) if s.follows()) {
                // Poisoned only if a thread panicked holding it; the slot is still a slot.
                drop(slot.lock().unwrap_or_else(|p| p.into_inner()).take());
            }
            Ok::<_, std::convert::Infallible>(to_response(answer))
        })
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .serve_connection(TokioIo::new(io), svc)
        .without_shutdown();
    match conn.await {
        Ok(parts) => {
            // The service (and with it the connection's slot) is kept while lingering, so
            // lingering connections count among MAX_CONNECTIONS.
            linger(parts.io.into_inner()).await;
            drop(parts.service);
        }
        Err(e) => tracing::debug!(error = %e, "local API connection ended with an error"),
    }
}

/// How long a closing connection still reads and discards what comes. Not bounded in bytes:
/// a fast client on loopback sends many mebibytes before it reads the answer, and a reset
/// after any byte bound would lose the answer again; reading costs no memory.
const LINGER: Duration = Duration::from_secs(1);

/// Closes our side of a connection whose last answer is written, then reads and discards
/// what the client still sends, for at most [`LINGER`], until the client closes. Closing with
/// unread bytes makes the kernel send a reset, which can discard our answer before the
/// client has read it: a client still streaming a body that the route refused before
/// reading it (a privileged route over TCP without the token) saw "error writing a body to
/// connection" instead of the 403 that says what to do.
async fn linger<IO: AsyncRead + AsyncWrite + Unpin>(mut io: IO) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if io.shutdown().await.is_err() {
        return;
    }
    let _ = tokio::time::timeout(LINGER, async {
        let mut buf = vec![0u8; 16 << 10];
        while matches!(io.read(&mut buf).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// A listener the API serves on: TCP, or a unix socket.
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// Accepts connections until `shutdown` flips, serving at most [`MAX_CONNECTIONS`] at once.
pub async fn serve(listener: Listener, state: Arc<ApiState>, mut shutdown: watch::Receiver<bool>) {
    let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            _ = shutdown.changed() => return,
        };
        let slot: Slot = Arc::new(std::sync::Mutex::new(Some(permit)));
        let state = state.clone();
        let accepted = tokio::select! {
            a = accept(&listener) => a,
            _ = shutdown.changed() => return,
        };
        match accepted {
            Ok(Conn::Tcp(s)) => {
                let _ = s.set_nodelay(true);
                let Ok(local) = s.local_addr() else {
                    continue; // Gone before it was served.
                };
                let via = guard::Via::Tcp { local: local.ip() };
                tokio::spawn(serve_connection(s, state, via, slot));
            }
            Ok(Conn::Unix(s)) => {
                let group = state.socket.group.as_ref().map(|(_, gid)| *gid);
                let peer = listen::peer(&s, group);
                tokio::spawn(serve_connection(s, state, guard::Via::Unix { peer }, slot));
            }
            Err(e) => {
                // Out of file descriptors and the like: pause instead of spinning.
                tracing::warn!(error = %e, "local API accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

enum Conn {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

async fn accept(l: &Listener) -> std::io::Result<Conn> {
    match l {
        Listener::Tcp(t) => t.accept().await.map(|(s, _)| Conn::Tcp(s)),
        Listener::Unix(u) => u.accept().await.map(|(s, _)| Conn::Unix(s)),
    }
}
