//! The apiserver's node proxy, as kube-apiserver does it: `pods/{name}/log` (a GET to
//! `/containerLogs/{ns}/{pod}/{container}`), `pods/{name}/exec` and `/attach` (upgraded
//! connections to `/exec/...` and `/attach/...`), `pods/{name}/portforward` (to
//! `/portForward/{ns}/{pod}`), and `nodes/{name}/proxy/{path}`, each to the pod's node over
//! [`kubelet::KubeletClient`]. The fixtures `pod_log_*`, `pod_exec_*`, `pod_attach_*`,
//! `pod_portforward_*` and `node_proxy_*` show what the real one checks and forwards.
//!
//! Upgrades are relayed, not translated: kube-apiserver turns a WebSocket exec (kubectl 1.31
//! and later) into SPDY/3.1 towards the kubelet; this fake forwards whatever protocol the
//! client asked for, which is faithful for SPDY clients such as kubectl 1.20.

use super::kubelet::{kubelet_addr, relay_body, KubeletAddr};
use super::*;

/// A node-proxy subresource of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PodSub {
    Log,
    Exec,
    Attach,
    PortForward,
}

impl PodSub {
    fn name(self) -> &'static str {
        match self {
            PodSub::Log => "log",
            PodSub::Exec => "exec",
            PodSub::Attach => "attach",
            PodSub::PortForward => "portforward",
        }
    }
}

/// A request the node proxy serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Target {
    Pod {
        namespace: String,
        name: String,
        sub: PodSub,
    },
    /// `nodes/{name}/proxy{path}`; `path` starts with `/`.
    Node { name: String, path: String },
}

impl Target {
    /// The resource as the request log names it: `pods/log`, `nodes/proxy`, ...
    pub(super) fn resource(&self) -> String {
        match self {
            Target::Pod { sub, .. } => format!("pods/{}", sub.name()),
            Target::Node { .. } => "nodes/proxy".into(),
        }
    }
}

pub(super) fn parse(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match segs.as_slice() {
        ["api", "v1", "namespaces", ns, "pods", name, sub] => {
            let sub = match *sub {
                "log" => PodSub::Log,
                "exec" => PodSub::Exec,
                "attach" => PodSub::Attach,
                "portforward" => PodSub::PortForward,
                _ => return None,
            };
            Some(Target::Pod {
                namespace: ns.to_string(),
                name: name.to_string(),
                sub,
            })
        }
        ["api", "v1", "nodes", name, "proxy", rest @ ..] => Some(Target::Node {
            name: name.to_string(),
            path: format!("/{}", rest.join("/")),
        }),
        _ => None,
    }
}

/// The query's pairs in order, repeated keys kept (`command=echo&command=hi`).
pub(super) fn query_pairs(q: Option<&str>) -> Vec<(String, String)> {
    let dec = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned()
    };
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (dec(k), dec(v))
        })
        .collect()
}

/// Encodes pairs as Go's `url.Values.Encode` does: keys sorted, values in order.
pub(super) fn encode_query(pairs: &[(String, String)]) -> String {
    const SET: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    let mut sorted: Vec<&(String, String)> = pairs.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    sorted
        .iter()
        .map(|(k, v)| {
            format!(
                "{}={}",
                percent_encoding::utf8_percent_encode(k, SET),
                percent_encoding::utf8_percent_encode(v, SET)
            )
        })
        .collect::<Vec<_>>()
        .join("&")
}

fn get<'a>(q: &'a [(String, String)], k: &str) -> Option<&'a str> {
    q.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
}

fn is_true(q: &[(String, String)], k: &str) -> bool {
    matches!(get(q, k), Some("true" | "1"))
}

/// The query the apiserver sends to `/containerLogs`: only what is set (fixtures
/// `pod_log_proxied_to_kubelet`, `pod_log_since_time_default_container`).
pub(super) fn log_query(q: &[(String, String)]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for flag in ["follow", "previous", "timestamps"] {
        if is_true(q, flag) {
            out.push((flag.to_string(), "true".to_string()));
        }
    }
    for num in ["tailLines", "sinceSeconds", "limitBytes"] {
        if let Some(v) = get(q, num).filter(|v| !v.is_empty()) {
            out.push((num.to_string(), v.to_string()));
        }
    }
    if let Some(t) = get(q, "sinceTime").filter(|v| !v.is_empty()) {
        out.push(("sinceTime".into(), t.into()));
    }
    out
}

/// The query the apiserver sends to `/exec` or `/attach`: the PodExecOptions as the
/// kubelet's names (fixtures `pod_exec_proxied_to_kubelet`, `pod_attach_proxied_to_kubelet`).
pub(super) fn stream_query(q: &[(String, String)], sub: PodSub) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if sub == PodSub::Exec {
        for (k, v) in q {
            if k == "command" {
                out.push(("command".into(), v.clone()));
            }
        }
    }
    for (from, to) in [
        ("stdin", "input"),
        ("stdout", "output"),
        ("stderr", "error"),
        ("tty", "tty"),
    ] {
        if is_true(q, from) {
            out.push((to.to_string(), "1".to_string()));
        }
    }
    out
}

/// `ports=8080` becomes `port=8080` (fixture `pod_portforward_proxied_to_kubelet`).
pub(super) fn port_forward_query(q: &[(String, String)]) -> Vec<(String, String)> {
    q.iter()
        .filter(|(k, _)| k == "ports")
        .flat_map(|(_, v)| v.split(',').map(|p| ("port".to_string(), p.to_string())))
        .collect()
}

/// The container a log, exec or attach is for: the one named, or the only one (fixtures
/// `pod_log_two_containers_no_container_bad_request`, `pod_log_unknown_container_bad_request`).
pub(super) fn pick_container(
    pod: &Value,
    name: &str,
    asked: Option<&str>,
) -> Result<String, Reject> {
    let names = |list: &str| -> Vec<String> {
        pod.pointer(&format!("/spec/{list}"))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|c| c["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let containers = names("containers");
    let bad = |m: String| Box::new(status(400, "BadRequest", &m, None));
    match asked.filter(|c| !c.is_empty()) {
        Some(c) => {
            let known = containers.iter().any(|n| n == c)
                || names("initContainers").iter().any(|n| n == c)
                || names("ephemeralContainers").iter().any(|n| n == c);
            if known {
                Ok(c.to_string())
            } else {
                Err(bad(format!("container {c} is not valid for pod {name}")))
            }
        }
        None if containers.len() == 1 => Ok(containers[0].clone()),
        None => Err(bad(format!(
            "a container name must be specified for pod {name}, choose one of: [{}]",
            containers.join(" ")
        ))),
    }
}

/// sinceSeconds and sinceTime together: 422 (fixture `pod_log_both_since_invalid`).
fn validate_log(q: &[(String, String)], name: &str) -> Option<Response<Body>> {
    if get(q, "sinceSeconds").is_some() && get(q, "sinceTime").is_some() {
        let msg = "Forbidden: at most one of `sinceTime` or `sinceSeconds` may be specified";
        return Some(status(
            422,
            "Invalid",
            &format!("PodLogOptions \"{name}\" is invalid: []: {msg}"),
            Some(json!({"name": name, "kind": "PodLogOptions",
                "causes": [{"reason": "FieldValueForbidden", "message": msg, "field": "[]"}]})),
        ));
    }
    None
}

/// A Status with no reason, as the apiserver turns a plain Go error into one (fixture
/// `pod_log_kubelet_unreachable`).
fn plain_error(code: u16, message: &str) -> Response<Body> {
    json_response(
        code,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "code": code}),
    )
}

/// What the apiserver answers when the kubelet answers a log request with an error, as its
/// `GenericHttpResponseChecker` for `pods/log` does: a 400 or a 500 carries the kubelet's
/// text (BadRequest, InternalError), anything else is its generic server response naming
/// the pod (fixture `pod_log_kubelet_404`). Only the 404 is recorded.
fn kubelet_log_error(code: u16, pod: &str, body: &str) -> Response<Body> {
    match code {
        400 => return status(400, "BadRequest", body, None),
        500 => {
            return status(
                500,
                "InternalError",
                &format!("Internal error occurred: {body}"),
                Some(json!({"causes": [{"message": body}]})),
            )
        }
        _ => {}
    }
    let (reason, message) = match code {
        404 => ("NotFound", "the server could not find the requested resource".to_string()),
        401 => ("Unauthorized", "the server has asked for the client to provide credentials".into()),
        403 => ("Forbidden", body.trim().to_string()),
        c if c > 500 => ("InternalError", format!("an error on the server ({body:?}) has prevented the request from succeeding")),
        _ => ("", format!("the server responded with the status code {code} but did not return more information")),
    };
    let mut b = status_body(
        code,
        reason,
        &format!("{message} ( pods/log {pod})"),
        Some(json!({"name": pod, "kind": "pods/log"})),
    );
    if reason.is_empty() {
        if let Some(m) = b.as_object_mut() {
            m.remove("reason");
        }
    }
    json_response(code, &b)
}

/// RBAC as the fixtures show it: `system:masters` may do anything; a node gets none of these
/// subresources (the Node authorizer gives none); other users only what a test granted.
fn may_proxy(state: &State, caller: &csr::Caller) -> bool {
    if caller.groups.iter().any(|g| g == "system:masters") {
        return true;
    }
    node_of(&caller.user).is_none() && lock(&state.proxy_users).contains(&caller.user)
}

fn forbidden_sub(user: &str, verb: &str, target: &Target) -> Response<Body> {
    let (subject, resource, scope, name) = match target {
        Target::Pod {
            namespace, name, ..
        } => (
            format!("pods \"{name}\""),
            target.resource(),
            format!("in the namespace \"{namespace}\""),
            name,
        ),
        Target::Node { name, .. } => (
            format!("nodes \"{name}\""),
            target.resource(),
            "at the cluster scope".to_string(),
            name,
        ),
    };
    let kind = resource.split('/').next().unwrap_or("");
    status(
        403,
        "Forbidden",
        &format!("{subject} is forbidden: User \"{user}\" cannot {verb} resource \"{resource}\" in API group \"\" {scope}"),
        Some(json!({"name": name, "kind": kind})),
    )
}

fn is_upgrade(req: &Request<Incoming>) -> bool {
    let connection_upgrade = req
        .headers()
        .get_all("connection")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        });
    connection_upgrade && req.headers().contains_key("upgrade")
}

/// Serves one node-proxy request. `caller` is who the request authenticated as.
pub(super) async fn serve(
    state: &Arc<State>,
    caller: Option<&csr::Caller>,
    target: Target,
    req: Request<Incoming>,
) -> Response<Body> {
    let Some(caller) = caller else {
        return status(401, "Unauthorized", "Unauthorized", None);
    };
    let verb = match (req.method(), &target) {
        (
            &Method::GET,
            Target::Pod {
                sub: PodSub::Log, ..
            },
        ) => "get",
        (_, Target::Pod { .. }) if req.method() == Method::POST => "create",
        (&Method::GET, _) => "get",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, _) => "delete",
        _ => {
            return status(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
                None,
            )
        }
    };
    if let Target::Pod {
        sub: PodSub::Log, ..
    } = &target
    {
        if req.method() != Method::GET {
            return status(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
                None,
            );
        }
    }
    if !may_proxy(state, caller) {
        return forbidden_sub(&caller.user, verb, &target);
    }
    let q = query_pairs(req.uri().query());
    match target {
        Target::Pod {
            namespace,
            name,
            sub,
        } => serve_pod(state, &namespace, &name, sub, &q, req).await,
        Target::Node { name, path } => serve_node(state, &name, &path, &q, req).await,
    }
}

fn stored(state: &State, plural: &str, ns: &str, name: &str) -> Option<Value> {
    lock(&state.db)
        .objects
        .get(&(plural.to_string(), ns.to_string(), name.to_string()))
        .cloned()
}

/// The kubelet of node `name`, or the apiserver's answer when there is none.
fn node_target(state: &State, name: &str) -> Result<KubeletAddr, Reject> {
    let node = stored(state, "nodes", "", name)
        .ok_or_else(|| Box::new(not_found(resource_type("nodes"), name)))?;
    kubelet_addr(&node).ok_or_else(|| {
        Box::new(plain_error(
            500,
            &format!("node {name} has no address the apiserver can reach"),
        ))
    })
}

async fn serve_pod(
    state: &Arc<State>,
    ns: &str,
    name: &str,
    sub: PodSub,
    q: &[(String, String)],
    req: Request<Incoming>,
) -> Response<Body> {
    let Some(pod) = stored(state, "pods", ns, name) else {
        return not_found(resource_type("pods"), name);
    };
    if sub == PodSub::Log {
        if let Some(invalid) = validate_log(q, name) {
            return invalid;
        }
    }
    let container = match sub {
        PodSub::PortForward => None,
        _ => match pick_container(&pod, name, get(q, "container")) {
            Ok(c) => Some(c),
            Err(r) => return *r,
        },
    };
    let node = pod["spec"]["nodeName"].as_str().unwrap_or("");
    if node.is_empty() {
        return status(
            400,
            "BadRequest",
            &format!("pod {name} does not have a host assigned"),
            None,
        );
    }
    let to = match node_target(state, node) {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let c = container.unwrap_or_default();
    let (path, query) = match sub {
        PodSub::Log => (format!("/containerLogs/{ns}/{name}/{c}"), log_query(q)),
        PodSub::Exec => (format!("/exec/{ns}/{name}/{c}"), stream_query(q, sub)),
        PodSub::Attach => (format!("/attach/{ns}/{name}/{c}"), stream_query(q, sub)),
        PodSub::PortForward => (format!("/portForward/{ns}/{name}"), port_forward_query(q)),
    };
    let pq = with_query(&path, &query);
    if sub == PodSub::Log {
        return forward_log(state, &to, &pq, name).await;
    }
    if !is_upgrade(&req) {
        // Fixture `pod_exec_without_upgrade_bad_request`.
        return status(400, "BadRequest", "Upgrade request required", None);
    }
    upgrade(state, &to, &pq, req).await
}

fn with_query(path: &str, query: &[(String, String)]) -> String {
    if query.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{}", encode_query(query))
    }
}

async fn forward_log(state: &Arc<State>, to: &KubeletAddr, pq: &str, pod: &str) -> Response<Body> {
    let req = Request::builder()
        .method(Method::GET)
        .uri(pq)
        .header("host", to.host_port())
        .header("user-agent", "Go-http-client/1.1")
        .body(http_body_util::Empty::<Bytes>::new());
    let Ok(req) = req else {
        return plain_error(500, "bad kubelet request");
    };
    let resp = match state.kubelet.send(to, req).await {
        Ok(r) => r,
        Err(e) => {
            return plain_error(
                500,
                &format!("Get \"https://{}{pq}\": {}", to.host_port(), e.0),
            )
        }
    };
    let code = resp.status().as_u16();
    if !(200..300).contains(&code) {
        let body = resp.into_body().collect().await.map(|b| b.to_bytes());
        let text = String::from_utf8_lossy(body.as_deref().unwrap_or_default()).into_owned();
        return kubelet_log_error(code, pod, &text);
    }
    relay(resp)
}

/// The kubelet's answer, status, headers and (streamed) body as they came.
fn relay(resp: Response<Incoming>) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, relay_body(body))
}

/// Headers an upgrade request carries on to the kubelet.
fn upgrade_header(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    matches!(
        n.as_str(),
        "connection" | "upgrade" | "x-stream-protocol-version" | "content-type"
    ) || n.starts_with("sec-websocket-")
}

/// Forwards an upgrade request, relays the kubelet's 101 and splices the two connections; a
/// non-101 answer is relayed as it is (fixture `pod_exec_kubelet_404`).
async fn upgrade(
    state: &Arc<State>,
    to: &KubeletAddr,
    pq: &str,
    mut req: Request<Incoming>,
) -> Response<Body> {
    let from_client = hyper::upgrade::on(&mut req);
    let mut b = Request::builder().method(req.method()).uri(pq);
    if let Some(host) = req.headers().get("host") {
        b = b.header("host", host);
    }
    for (k, v) in req.headers() {
        if upgrade_header(k.as_str()) {
            b = b.header(k, v);
        }
    }
    b = b.header("x-forwarded-for", "127.0.0.1");
    let Ok(kreq) = b.body(http_body_util::Empty::<Bytes>::new()) else {
        return plain_error(500, "bad kubelet request");
    };
    let resp = match state.kubelet.send(to, kreq).await {
        Ok(r) => r,
        Err(e) => return plain_error(500, &format!("error dialing backend: {}", e.0)),
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return relay(resp);
    }
    let headers = resp.headers().clone();
    let from_kubelet = hyper::upgrade::on(resp);
    let mut kill = state.kill_tx.subscribe();
    tokio::spawn(async move {
        let (Ok(a), Ok(b)) = (from_client.await, from_kubelet.await) else {
            return;
        };
        let mut a = hyper_util::rt::TokioIo::new(a);
        let mut b = hyper_util::rt::TokioIo::new(b);
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut a, &mut b) => {}
            _ = kill.changed() => {}
        }
    });
    let mut out = full(StatusCode::SWITCHING_PROTOCOLS, "", Vec::new());
    out.headers_mut().remove("content-type");
    for (k, v) in &headers {
        out.headers_mut().append(k, v.clone());
    }
    out
}

/// Loopback, link-local and unspecified addresses: kube-apiserver does not proxy
/// `nodes/proxy` to them (fixture `node_proxy_loopback_not_allowed`).
pub(super) fn proxyable(host: &str) -> bool {
    match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) => {
            !(ip.is_loopback() || ip.is_link_local() || ip.is_unspecified())
        }
        Ok(std::net::IpAddr::V6(ip)) => {
            !(ip.is_loopback() || ip.is_unspecified() || (ip.segments()[0] & 0xffc0) == 0xfe80)
        }
        Err(_) => true,
    }
}

async fn serve_node(
    state: &Arc<State>,
    name: &str,
    path: &str,
    q: &[(String, String)],
    req: Request<Incoming>,
) -> Response<Body> {
    let to = match node_target(state, name) {
        Ok(t) => t,
        Err(r) => return *r,
    };
    if !proxyable(&to.host) && !state.loopback_node_proxy.load(Ordering::SeqCst) {
        return status(400, "BadRequest", "address not allowed", None);
    }
    let pq = with_query(path, q);
    if is_upgrade(&req) {
        return upgrade(state, &to, &pq, req).await;
    }
    let method = req.method().clone();
    let mut b = Request::builder()
        .method(&method)
        .uri(&pq)
        .header("host", to.host_port());
    for (k, v) in req.headers() {
        let n = k.as_str();
        if n != "authorization" && n != "host" && n != "connection" {
            b = b.header(k, v);
        }
    }
    let Ok(kreq) = b.body(req.into_body()) else {
        return plain_error(500, "bad kubelet request");
    };
    match state.kubelet.send(&to, kreq).await {
        Ok(r) => relay(r),
        // Not recorded: worded as the apiserver's proxy error for an unreachable backend.
        Err(e) => plain_error(500, &format!("error trying to reach service: {}", e.0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(q: &str) -> Vec<(String, String)> {
        query_pairs(Some(q))
    }

    #[test]
    fn paths() {
        assert_eq!(
            parse("/api/v1/namespaces/default/pods/web/log"),
            Some(Target::Pod {
                namespace: "default".into(),
                name: "web".into(),
                sub: PodSub::Log
            })
        );
        assert_eq!(
            parse("/api/v1/nodes/edge-1/proxy/healthz"),
            Some(Target::Node {
                name: "edge-1".into(),
                path: "/healthz".into()
            })
        );
        assert_eq!(
            parse("/api/v1/nodes/edge-1/proxy"),
            Some(Target::Node {
                name: "edge-1".into(),
                path: "/".into()
            })
        );
        assert_eq!(parse("/api/v1/namespaces/default/pods/web/status"), None);
        assert_eq!(parse("/api/v1/namespaces/default/pods/web"), None);
    }

    /// The kubelet-side queries the fixtures recorded.
    #[test]
    fn queries_as_recorded() {
        for name in [
            "pod_log_proxied_to_kubelet",
            "pod_log_since_time_default_container",
            "pod_exec_proxied_to_kubelet",
            "pod_exec_no_command_forwarded",
            "pod_attach_proxied_to_kubelet",
            "pod_portforward_proxied_to_kubelet",
        ] {
            let f = crate::fixture(name);
            let path = f["request"]["path"].as_str().unwrap();
            let (_, q) = path.split_once('?').unwrap();
            let q = pairs(q);
            let want = &f["kubelet_request"];
            let sub = want["path"].as_str().unwrap().split('/').nth(1).unwrap();
            let got = match sub {
                "containerLogs" => log_query(&q),
                "exec" => stream_query(&q, PodSub::Exec),
                "attach" => stream_query(&q, PodSub::Attach),
                _ => port_forward_query(&q),
            };
            let mut got_map = serde_json::Map::new();
            for (k, v) in &got {
                got_map
                    .entry(k.clone())
                    .or_insert_with(|| json!([]))
                    .as_array_mut()
                    .unwrap()
                    .push(json!(v));
            }
            assert_eq!(Value::Object(got_map), want["query"], "{name}");
        }
        assert_eq!(
            encode_query(&pairs(
                "tailLines=10&sinceTime=2026-12-03T00:00:00Z&command=a b"
            )),
            "command=a%20b&sinceTime=2026-12-03T00%3A00%3A00Z&tailLines=10"
        );
    }

    #[test]
    fn containers_as_recorded() {
        let pod = json!({"spec": {"containers": [{"name": "app"}, {"name": "side"}]}});
        let err = pick_container(&pod, "duo", None).unwrap_err();
        assert_eq!(err.status(), 400);
        let one = json!({"spec": {"containers": [{"name": "app"}]}});
        assert_eq!(pick_container(&one, "web", None).unwrap(), "app");
        assert!(pick_container(&one, "web", Some("nope")).is_err());
    }

    #[test]
    fn loopback_is_not_proxyable() {
        assert!(!proxyable("127.0.0.1"));
        assert!(!proxyable("169.254.1.1"));
        assert!(!proxyable("::1"));
        assert!(!proxyable("fe80::1"));
        assert!(proxyable("10.0.0.7"));
        assert!(proxyable("edge-1"));
    }
}
