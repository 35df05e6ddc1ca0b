//! `/exec`, `/attach` and `/portForward`: what the apiserver forwards `kubectl exec`,
//! `attach` and `port-forward` to, served as the kubelet serves them with its default
//! (non-redirecting) streaming. The runtime's CRI `Exec`/`Attach`/`PortForward` answer with a
//! URL on the runtime's own streaming server; the client's upgrade request goes there
//! (method, the URL's path with the client's query, the upgrade headers), the runtime's answer
//! comes back (a 101 with its headers, or its error), and on a 101 the two upgraded
//! connections are spliced ([`super::splice`]). The runtime negotiates SPDY/3.1 or WebSocket
//! itself; edgehub reads none of the stream.
//!
//! The query is parsed here the way the kubelet parses it (pure functions below): the
//! command, and which of stdin, stdout, stderr and a TTY are asked for.

use super::{text, Body, KubeletApi};
use crate::cri::{api, labels, CriError, CriRuntime, CriStreaming};
use crate::object::Kind;
use crate::pod::observe;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response};
use std::collections::HashMap;
use std::time::Duration;
use tracing::Instrument;

/// Which streaming route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Exec,
    Attach,
    PortForward,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::Exec => "exec",
            Route::Attach => "attach",
            Route::PortForward => "portForward",
        }
    }
}

/// The target of a streaming request, from its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub route: Route,
    pub namespace: String,
    pub pod: String,
    /// The pod uid, when the path carries one.
    pub uid: Option<String>,
    /// The container (`/exec`, `/attach`); `None` for `/portForward`.
    pub container: Option<String>,
}

impl Target {
    /// The target a path names (its segments after the leading `/`), or `None` when it names
    /// no streaming route.
    pub fn from_segments(segs: &[&str]) -> Option<Target> {
        let t = |route, ns: &str, pod: &str, uid: Option<&str>, c: Option<&str>| Target {
            route,
            namespace: ns.to_string(),
            pod: pod.to_string(),
            uid: uid.map(str::to_string),
            container: c.map(str::to_string),
        };
        if segs.iter().any(|s| s.is_empty()) {
            return None;
        }
        let target = match segs {
            ["exec", ns, pod, c] => t(Route::Exec, ns, pod, None, Some(c)),
            ["exec", ns, pod, uid, c] => t(Route::Exec, ns, pod, Some(uid), Some(c)),
            ["attach", ns, pod, c] => t(Route::Attach, ns, pod, None, Some(c)),
            ["attach", ns, pod, uid, c] => t(Route::Attach, ns, pod, Some(uid), Some(c)),
            ["portForward", ns, pod] => t(Route::PortForward, ns, pod, None, None),
            ["portForward", ns, pod, uid] => t(Route::PortForward, ns, pod, Some(uid), None),
            _ => return None,
        };
        Some(target)
    }
}

/// The query's pairs, form-decoded as Go's `url.ParseQuery` does (`+` is a space).
fn pairs(query: Option<&str>) -> Vec<(String, String)> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned()
    };
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// What `/exec` and `/attach` ask for, as the kubelet reads it: `command` (repeated, exec
/// only), and `input`, `output`, `error`, `tty`, each on only when it is exactly `1`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamOptions {
    pub command: Vec<String>,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

impl StreamOptions {
    /// Parses the query (pure). A TTY has no separate stderr (the kubelet drops it); at least
    /// one of stdin, stdout, stderr is required (the kubelet's 400 text otherwise).
    pub fn parse(query: Option<&str>) -> Result<StreamOptions, String> {
        let mut o = StreamOptions::default();
        // Go's FormValue: the first value of a key.
        let mut seen = std::collections::HashSet::new();
        for (k, v) in pairs(query) {
            if k == "command" {
                o.command.push(v);
                continue;
            }
            if !seen.insert(k.clone()) {
                continue;
            }
            let on = v == "1";
            match k.as_str() {
                "input" => o.stdin = on,
                "output" => o.stdout = on,
                "error" => o.stderr = on,
                "tty" => o.tty = on,
                _ => {}
            }
        }
        if o.tty && o.stderr {
            o.stderr = false;
        }
        if !o.stdin && !o.stdout && !o.stderr {
            return Err("you must specify at least 1 of stdin, stdout, stderr".into());
        }
        Ok(o)
    }
}

/// The ports `/portForward` names in its `port` query (repeated, or comma-separated), as the
/// kubelet reads them. Required only of a WebSocket request (SPDY names its ports in its
/// streams' headers).
pub fn forward_ports(query: Option<&str>, websocket: bool) -> Result<Vec<i32>, String> {
    let values: Vec<String> = pairs(query)
        .into_iter()
        .filter(|(k, _)| k == "port")
        .map(|(_, v)| v)
        .collect();
    if !websocket {
        return Ok(Vec::new());
    }
    if values.is_empty() {
        return Err("query parameter \"port\" is required".into());
    }
    let mut ports = Vec::new();
    for v in &values {
        if v.is_empty() {
            return Err("query parameter \"port\" cannot be empty".into());
        }
        for p in v.split(',') {
            match p.parse::<u16>() {
                Ok(0) => return Err(format!("port {v:?} must be > 0")),
                Ok(n) => ports.push(i32::from(n)),
                Err(e) => return Err(format!("unable to parse {v:?} as a port: {e}")),
            }
        }
    }
    Ok(ports)
}

/// The request asks for a protocol upgrade (a `Connection` header naming `upgrade`).
pub fn is_upgrade(headers: &hyper::HeaderMap) -> bool {
    headers
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.to_ascii_lowercase().contains("upgrade"))
}

/// The request is a WebSocket upgrade.
pub fn is_websocket(headers: &hyper::HeaderMap) -> bool {
    is_upgrade(headers)
        && headers
            .get(hyper::header::UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// The client's headers that go on to the runtime's streaming server: the upgrade and the
/// protocol negotiation, nothing else (no credentials).
pub fn forwarded(name: &HeaderName) -> bool {
    let n = name.as_str();
    matches!(
        n,
        "upgrade" | "connection" | "x-stream-protocol-version" | "origin"
    ) || n.starts_with("sec-websocket-")
}

/// The status and text the kubelet answers when the runtime refuses a streaming call
/// (`streaming.WriteError`): NotFound 404, ResourceExhausted 429, anything else 500.
pub fn runtime_refusal(e: &CriError) -> (u16, String) {
    let status = match e {
        CriError::Call { code, .. } if code == "NotFound" => 404,
        CriError::Call { code, .. } if code == "ResourceExhausted" => 429,
        _ => 500,
    };
    (status, e.to_string())
}

/// Where the runtime's URL points: `host:port` and the path to ask for there.
fn runtime_endpoint(url: &str) -> Result<(String, String), String> {
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| format!("the runtime's streaming URL {url:?}: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "the runtime's streaming URL {url:?} is not plain http (TLS streaming is not supported)"
        ));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("the runtime's streaming URL {url:?} has no host"))?;
    let port = authority.port_u16().unwrap_or(80);
    Ok((
        format!("{}:{port}", authority.host()),
        uri.path().to_string(),
    ))
}

/// How long the runtime's streaming server has to answer the forwarded request.
const RUNTIME_ANSWER: Duration = Duration::from_secs(10);
/// The most of a runtime's error body relayed.
const MAX_ERROR_BODY: usize = 64 << 10;

impl KubeletApi {
    /// Serves a streaming route for `user`; `req` is the client's request, whole.
    pub(super) async fn stream(
        &self,
        target: Target,
        user: &str,
        req: Request<Incoming>,
    ) -> Response<Body> {
        let span = tracing::info_span!("node_api_stream",
            route = target.route.name(), namespace = %target.namespace, pod = %target.pod,
            container = %target.container.as_deref().unwrap_or(""), user = %user);
        self.stream_in(target, req, span.clone())
            .instrument(span)
            .await
    }

    async fn stream_in(
        &self,
        target: Target,
        mut req: Request<Incoming>,
        span: tracing::Span,
    ) -> Response<Body> {
        let query = req.uri().query().map(str::to_string);
        let websocket = is_websocket(req.headers());
        let container = target.container.clone().unwrap_or_default();
        // The kubelet's order: the options (400), then the pod (404), then the runtime.
        let (options, ports) = match target.route {
            Route::PortForward => match forward_ports(query.as_deref(), websocket) {
                Ok(p) => (StreamOptions::default(), p),
                Err(e) => return text(400, e),
            },
            _ => match StreamOptions::parse(query.as_deref()) {
                Ok(o) => (o, Vec::new()),
                Err(e) => return text(400, e),
            },
        };
        let Ok(permit) = self.streams.clone().try_acquire_owned() else {
            tracing::info!("node API: stream refused, every stream slot is taken");
            return text(
                429,
                "too many streams on this node (the node API's max_streams); try again later",
            );
        };
        let Some(cri) = self.cri.clone() else {
            return text(500, "no container runtime is configured on this node");
        };
        let uid = match self.store.get(Kind::Pod, &target.namespace, &target.pod) {
            Ok(Some(p)) => p.index.uid,
            Ok(None) => return text(404, "pod does not exist"),
            Err(e) => return text(500, format!("reading the pod: {e}")),
        };
        let upgrade = is_upgrade(req.headers());
        let url = match target.route {
            Route::PortForward => {
                let full = format!("{}_{}", target.pod, target.namespace);
                if target.uid.as_ref().is_some_and(|u| *u != uid) {
                    return text(404, "pod not found");
                }
                let sandbox = match self.ready_sandbox(&cri, &target).await {
                    Ok(Some(s)) => s,
                    Ok(None) => return text(500, format!("pod not found ({full:?})")),
                    Err(e) => return text(500, e.to_string()),
                };
                if !upgrade {
                    return text(400, "Upgrade request required");
                }
                cri.port_forward(api::PortForwardRequest {
                    pod_sandbox_id: sandbox,
                    port: ports,
                })
                .await
            }
            route => {
                let not_found = || text(500, format!("container not found ({container:?})"));
                if target.uid.as_ref().is_some_and(|u| *u != uid) {
                    return not_found();
                }
                let id = match self.running_container(&cri, &target, &container).await {
                    Ok(Some(id)) => id,
                    Ok(None) => return not_found(),
                    Err(e) => return text(500, e.to_string()),
                };
                if !upgrade {
                    return text(400, "Upgrade request required");
                }
                if route == Route::Exec {
                    cri.exec(api::ExecRequest {
                        container_id: id,
                        cmd: options.command.clone(),
                        tty: options.tty,
                        stdin: options.stdin,
                        stdout: options.stdout,
                        stderr: options.stderr,
                    })
                    .await
                } else {
                    cri.attach(api::AttachRequest {
                        container_id: id,
                        stdin: options.stdin,
                        tty: options.tty,
                        stdout: options.stdout,
                        stderr: options.stderr,
                    })
                    .await
                }
            }
        };
        let url = match url {
            Ok(u) => u,
            Err(e) => {
                tracing::info!(error = %e, "node API: the runtime refused the stream");
                let (status, body) = runtime_refusal(&e);
                let mut r = text(status, body);
                if status == 429 {
                    // The kubelet's hint: the runtime's stream tokens live a minute.
                    r.headers_mut()
                        .insert(hyper::header::RETRY_AFTER, HeaderValue::from_static("60"));
                }
                return r;
            }
        };
        let client_side = hyper::upgrade::on(&mut req);
        let runtime = match forward(&url, &req, query.as_deref()).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "node API: the runtime's streaming server failed");
                return text(500, e);
            }
        };
        let (parts, body) = runtime.into_parts();
        if parts.status != hyper::StatusCode::SWITCHING_PROTOCOLS {
            let body = tokio::time::timeout(
                RUNTIME_ANSWER,
                http_body_util::Limited::new(body, MAX_ERROR_BODY).collect(),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .map(|c| c.to_bytes())
            .unwrap_or_default();
            tracing::info!(
                status = parts.status.as_u16(),
                "node API: the runtime declined the upgrade"
            );
            let mut r = text(parts.status.as_u16(), String::from_utf8_lossy(&body));
            if let Some(ct) = parts.headers.get(hyper::header::CONTENT_TYPE) {
                r.headers_mut()
                    .insert(hyper::header::CONTENT_TYPE, ct.clone());
            }
            return r;
        }
        let runtime_side = hyper::upgrade::on(Response::from_parts(parts.clone(), body));
        let idle = self.idle;
        let task = async move {
            let _permit = permit;
            let (client, runtime) = match tokio::join!(client_side, runtime_side) {
                (Ok(c), Ok(r)) => (c, r),
                (c, r) => {
                    tracing::warn!(client = ?c.err(), runtime = ?r.err(), "node API: an upgrade failed");
                    return;
                }
            };
            tracing::info!("node API: stream open");
            let end = super::splice::splice(
                hyper_util::rt::TokioIo::new(client),
                hyper_util::rt::TokioIo::new(runtime),
                idle,
            )
            .await;
            tracing::info!(
                to_runtime = end.a_to_b,
                to_client = end.b_to_a,
                idle = end.idle,
                stalled = end.stalled,
                "node API: stream closed"
            );
        };
        tokio::spawn(task.instrument(span));
        let mut r = Response::new(Body::new(
            Empty::<Bytes>::new().map_err(|never| match never {}),
        ));
        *r.status_mut() = hyper::StatusCode::SWITCHING_PROTOCOLS;
        for (k, v) in &parts.headers {
            if k != hyper::header::CONTENT_LENGTH && k != hyper::header::TRANSFER_ENCODING {
                r.headers_mut().append(k, v.clone());
            }
        }
        r
    }

    /// The id of the pod's running container `name` (the newest, should there be two).
    async fn running_container(
        &self,
        cri: &crate::cri::CriClient,
        target: &Target,
        name: &str,
    ) -> Result<Option<String>, CriError> {
        let filter = HashMap::from([
            (labels::NODE.to_string(), self.node_name.clone()),
            (labels::POD_NAMESPACE.to_string(), target.namespace.clone()),
            (labels::POD_NAME.to_string(), target.pod.clone()),
            (labels::CONTAINER_NAME.to_string(), name.to_string()),
        ]);
        Ok(cri
            .list_containers(filter)
            .await?
            .into_iter()
            .filter(|c| c.state == api::ContainerState::ContainerRunning as i32)
            .max_by_key(|c| c.created_at)
            .map(|c| c.id))
    }

    /// The id of the pod's ready sandbox (the newest attempt).
    async fn ready_sandbox(
        &self,
        cri: &crate::cri::CriClient,
        target: &Target,
    ) -> Result<Option<String>, CriError> {
        let filter = HashMap::from([
            (labels::NODE.to_string(), self.node_name.clone()),
            (labels::POD_NAMESPACE.to_string(), target.namespace.clone()),
            (labels::POD_NAME.to_string(), target.pod.clone()),
        ]);
        Ok(cri
            .list_pod_sandbox(filter)
            .await?
            .into_iter()
            .filter(observe::is_ready)
            .max_by_key(observe::attempt_of_sandbox)
            .map(|s| s.id))
    }
}

/// Sends the client's request on to the runtime's streaming `url` (its path, the client's
/// query, the forwarded headers) and returns the runtime's answer, its connection ready to
/// be upgraded.
async fn forward(
    url: &str,
    client: &Request<Incoming>,
    query: Option<&str>,
) -> Result<Response<Incoming>, String> {
    let (addr, path) = runtime_endpoint(url)?;
    let tcp = tokio::time::timeout(RUNTIME_ANSWER, tokio::net::TcpStream::connect(&addr))
        .await
        .map_err(|_| format!("connecting to the runtime's streaming server {addr} timed out"))?
        .map_err(|e| format!("connecting to the runtime's streaming server {addr}: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .map_err(|e| format!("the runtime's streaming server {addr}: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "node API: the runtime's streaming connection ended");
        }
    });
    let path_query = match query {
        Some(q) if !q.is_empty() => format!("{path}?{q}"),
        _ => path,
    };
    let mut out = Request::builder()
        .method(client.method().clone())
        .uri(path_query)
        .header(hyper::header::HOST, &addr);
    for (k, v) in client.headers() {
        if forwarded(k) {
            out = out.header(k, v);
        }
    }
    let out = out
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("the request to the runtime: {e}"))?;
    tokio::time::timeout(RUNTIME_ANSWER, send.send_request(out))
        .await
        .map_err(|_| format!("the runtime's streaming server {addr} did not answer"))?
        .map_err(|e| format!("the runtime's streaming server {addr}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_the_kubelets_streaming_routes() {
        let t = Target::from_segments(&["exec", "ns", "web", "app"]).unwrap();
        assert_eq!(
            (t.route, t.uid, t.container),
            (Route::Exec, None, Some("app".into()))
        );
        let t = Target::from_segments(&["attach", "ns", "web", "u-1", "app"]).unwrap();
        assert_eq!(
            (t.route, t.uid, t.container),
            (Route::Attach, Some("u-1".into()), Some("app".into()))
        );
        let t = Target::from_segments(&["portForward", "ns", "web"]).unwrap();
        assert_eq!(
            (t.route, t.uid, t.container),
            (Route::PortForward, None, None)
        );
        let t = Target::from_segments(&["portForward", "ns", "web", "u-1"]).unwrap();
        assert_eq!(t.uid.as_deref(), Some("u-1"));
        for bad in [
            &["exec", "ns", "web"][..],
            &["exec", "ns", "", "app"],
            &["portforward", "ns", "web"],
            &["portForward", "ns", "web", "u", "x"],
            &["exec", "ns", "web", "u", "app", "more"],
        ] {
            assert_eq!(Target::from_segments(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn options_are_read_as_the_kubelet_reads_them() {
        let o = StreamOptions::parse(Some(
            "command=sh&command=-c&command=echo+%24HOME&input=1&output=1&error=1&tty=0",
        ))
        .unwrap();
        assert_eq!(
            o,
            StreamOptions {
                command: vec!["sh".into(), "-c".into(), "echo $HOME".into()],
                stdin: true,
                stdout: true,
                stderr: true,
                tty: false,
            }
        );
        // Only "1" is on; a TTY drops stderr; the first value of a key counts.
        let o = StreamOptions::parse(Some("input=1&output=true&error=1&tty=1&tty=0")).unwrap();
        assert_eq!(
            (o.stdin, o.stdout, o.stderr, o.tty),
            (true, false, false, true)
        );
        assert_eq!(
            StreamOptions::parse(Some("output=true&error=1&tty=1")).unwrap_err(),
            "you must specify at least 1 of stdin, stdout, stderr"
        );
        assert!(StreamOptions::parse(None).is_err());
        assert!(StreamOptions::parse(Some("command=ls")).is_err());
    }

    #[test]
    fn forwarded_ports_are_required_of_websockets_only() {
        assert_eq!(forward_ports(Some("port=8080"), false), Ok(vec![]));
        assert_eq!(forward_ports(None, false), Ok(vec![]));
        assert_eq!(
            forward_ports(Some("port=8080,9090&port=1"), true),
            Ok(vec![8080, 9090, 1])
        );
        assert_eq!(
            forward_ports(None, true).unwrap_err(),
            "query parameter \"port\" is required"
        );
        assert!(forward_ports(Some("port="), true).is_err());
        assert!(forward_ports(Some("port=0"), true).is_err());
        assert!(forward_ports(Some("port=70000"), true).is_err());
        assert!(forward_ports(Some("port=http"), true).is_err());
    }

    #[test]
    fn upgrades_and_forwarded_headers() {
        let mut h = hyper::HeaderMap::new();
        assert!(!is_upgrade(&h));
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        h.insert("upgrade", HeaderValue::from_static("SPDY/3.1"));
        assert!(is_upgrade(&h) && !is_websocket(&h));
        h.insert("upgrade", HeaderValue::from_static("WebSocket"));
        assert!(is_websocket(&h));
        for yes in [
            "upgrade",
            "connection",
            "x-stream-protocol-version",
            "sec-websocket-key",
            "sec-websocket-protocol",
            "sec-websocket-version",
        ] {
            assert!(forwarded(&HeaderName::from_static(yes)), "{yes}");
        }
        for no in ["authorization", "cookie", "host", "content-length"] {
            assert!(!forwarded(&HeaderName::from_static(no)), "{no}");
        }
    }

    #[test]
    fn runtime_refusals_map_as_the_kubelets_do() {
        let call = |code: &str| CriError::Call {
            method: "Exec",
            code: code.into(),
            message: "m".into(),
        };
        assert_eq!(runtime_refusal(&call("NotFound")).0, 404);
        assert_eq!(runtime_refusal(&call("ResourceExhausted")).0, 429);
        assert_eq!(runtime_refusal(&call("FailedPrecondition")).0, 500);
        assert_eq!(runtime_refusal(&call("Unknown")).1, "CRI Exec: Unknown: m");
    }

    #[test]
    fn the_runtimes_url_is_plain_http_on_a_host_and_port() {
        assert_eq!(
            runtime_endpoint("http://127.0.0.1:41735/exec/Xy_z").unwrap(),
            ("127.0.0.1:41735".into(), "/exec/Xy_z".into())
        );
        assert_eq!(
            runtime_endpoint("http://[::1]/attach/t").unwrap(),
            ("[::1]:80".into(), "/attach/t".into())
        );
        assert!(runtime_endpoint("https://127.0.0.1:1/exec/t").is_err());
        assert!(runtime_endpoint("not a url").is_err());
    }
}
